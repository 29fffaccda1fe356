"""Everything that compiles: torch.compile of the decode, prefill and sampler steps, CUDA graph capture, the
background and child compiles, saved compiles and warm-up, behind the one object the engine loop holds
(steps.CompiledSteps, an engine.steps.Steps). Models and kernels stay plain PyTorch."""

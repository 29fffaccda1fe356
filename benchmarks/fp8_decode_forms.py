"""FP8 decode at one token in candidate forms side by side, one process, with and without CUDA graphs (without: the
Mac-like mode, every kernel launched from the host). Each form other than the engine's replaces one function of
`server` in this process only: a measurement, not a setting.

    PYTHONPATH=. python3 benchmarks/fp8_decode_forms.py --preset llama-3.1-8b --graphs on,off --json out/fp8forms.jsonl
    PYTHONPATH=. python3 benchmarks/fp8_decode_forms.py --preset qwen3-30b-a3b --graphs off -- --num-layers 12

Forms (`--forms`, in order; each runs `mps-serve bench --batch-sizes 1` at every `--graphs` setting):
  engine        bf16 and FP8 as the engine picks (the weight-only reduction at one token)
  scaled-mm     FP8 through row-wise scaled_mm with the activation quantized per call (forced)
  stored-moe-input  Qwen3-MoE blocks store their input (the post-attention norm's output) first: with FP8
                linears the tuned step runs the bf16 router as a reduction, and it and the FP8 experts' gate/up
                recompute the norm for every output row where bf16's router GEMM makes inductor store it
  fused-top-k   the routers' top-k as k rounds of max-then-mask in every compiled step (one kernel with the
                softmax), where the engine fuses it only in layer regions (torch >= 2.13) and inline layers call
                torch.topk (a kernel of its own per layer): the cost is compile time per inline layer
A form runs at `--form-quantize` (fp8; `none,fp8` for a form that is not FP8's). Arguments after `--` go to the
bench (`--num-layers 12`, `--prompt-len 2048`). Every run's table and JSON lines carry kernels/step.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from torch._inductor.runtime.cache_dir_utils import cache_dir  # private: where torch keeps its caches

from server import cli
from server.kernels import fp8, moe
from server.kernels.capabilities import fp8_rowwise_ok, fp8_weight_only_ok
from server.kernels.gemv import stored
from server.models import layers


def scaled_mm_at_one_token(device: torch.device, num_tokens) -> bool:
    # scaled_mm at one token wherever the device has it; weight-only only where it has not
    return (torch.compiler.is_compiling() and num_tokens <= fp8.WEIGHT_ONLY_MAX_TOKENS
            and not fp8_rowwise_ok(device, False) and fp8_weight_only_ok(device))


def moe_input_stored(self, x: torch.Tensor, fuse_top_k: bool = True) -> torch.Tensor:
    return ENGINE_MOE_FORWARD(self, stored(x), fuse_top_k)  # stored before the router and the experts read it


def top_k_fused_in_every_step(top_k: int, fuse: bool = True) -> bool:
    return torch.compiler.is_compiling() and top_k <= moe.MAX_FUSED_TOP_K


ENGINE_MOE_FORWARD = layers.SoftmaxMoE.forward
FORMS = {  # name -> (module, attribute, replacement); the engine's form replaces nothing
    "engine": None,
    "scaled-mm": (fp8, "use_weight_only", scaled_mm_at_one_token),
    "stored-moe-input": (layers.SoftmaxMoE, "forward", moe_input_stored),
    "fused-top-k": (moe, "fuses_top_k", top_k_fused_in_every_step),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    bench_extra = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-3.1-8b")
    parser.add_argument("--graphs", default="off", help="on, off or on,off: as the bench's --graphs")
    parser.add_argument("--forms", default="engine,scaled-mm", help=f"comma-separated, of {', '.join(FORMS)}")
    parser.add_argument("--form-quantize", default="fp8", help="the --quantize of every form but the engine's")
    parser.add_argument("--json", default=None, help="append every run's JSON lines here")
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    forms = args.forms.split(",")
    unknown = [form for form in forms if form not in FORMS]
    if unknown:
        parser.error(f"unknown form(s) {', '.join(unknown)}: choose from {', '.join(FORMS)}")
    common = ["bench", "--preset", args.preset, "--batch-sizes", "1", "--graphs", args.graphs, *bench_extra]
    common += ["--json", args.json] if args.json else []
    status, engine_cache = 0, cache_dir()
    for form in forms:
        print(f"== FP8 form: {form}", flush=True)
        if FORMS[form] is None:
            status |= cli.main([*common, "--quantize", "none,fp8"])
            continue
        module, name, replacement = FORMS[form]
        # a compile cache of its own: a saved step of the engine's form (torch >= 2.13) has the same key
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(engine_cache) / f"form-{form}")
        original = getattr(module, name)
        setattr(module, name, replacement)
        try:
            status |= cli.main([*common, "--quantize", args.form_quantize])
        finally:
            setattr(module, name, original)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = engine_cache
    return status


if __name__ == "__main__":
    sys.exit(main())

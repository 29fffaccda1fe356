"""The engine: scheduler, KV cache, model runner, sampler, tokenizer, weights.

Import submodules directly; `server.engine.types` and `server.engine.protocol` are torch-free.
"""

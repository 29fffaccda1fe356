"""Which runs warm the compiled steps up before serving, so that no request waits for a compile or a capture.
`Engine.warm_up` runs them, then has the decode graphs capture their longer KV buckets (prepare_shapes)."""

from __future__ import annotations

from server.engine.types import SamplingParams
from server.kernels.gated_delta import CHUNK_SIZE

WARM_UP_PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)  # one decode step each


def warm_up_runs(decode_batch_sizes: list[int] | None, compile_prefill: bool, hybrid: bool, vocab_size: int,
                 max_num_batched_tokens: int, max_model_len: int) -> list[list[list[int]]]:
    """The batches of prompt ids to run, one batch per run, with WARM_UP_PARAMS.

    Decode: one run per batch bucket of the compiled decode step (None: there is none), of 1-token prompts, so
    the whole batch is prefilled in one step through the decode step, then decodes. Batch 1 compiles apart, then
    one graph serves larger batches, whose later buckets only capture CUDA graphs unless a size guard differs,
    as MoE's few-tokens path does. With compile_prefill,
    also the prefill forms (a fresh prompt alone, fresh prompts together, continued chunks and mixes), each
    with few and with many tokens (MoE paths differ)."""
    if decode_batch_sizes is None:  # decode steps run through the compiled prefill forward: one sequence, several
        decode_batch_sizes = [1, 2]
    runs = [[[1 + i % (vocab_size - 1)] for i in range(n)] for n in decode_batch_sizes]
    if not compile_prefill:
        return runs
    budget = max_num_batched_tokens
    shapes = [(1, 3), (1, budget + 2), (2, 2), (2, budget // 2), (2, budget + 3)]  # (prompts, prompt length)
    if hybrid:  # the chunked GDN specializes on one chunk or more and on padding, and each decoder layer
        # compiles apart (a graph break around the GDN chunk loop): a long tail too
        shapes += [(n, length) for n in (1, 2) for length in (CHUNK_SIZE, CHUNK_SIZE + 6)]
        shapes.append((1, budget + CHUNK_SIZE + 6))
    for run, (num_prompts, prompt_len) in enumerate(shapes):  # distinct prompts: no prefix-cache hits
        prompt_len = max(1, min(prompt_len, max_model_len - WARM_UP_PARAMS.max_tokens))
        runs.append([[1 + (7 * run + 3 * i + j) % (vocab_size - 1) for j in range(prompt_len)]
                     for i in range(num_prompts)])
    return runs

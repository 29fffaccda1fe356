"""What warms the compiled steps up, so that no request waits for a compile or a capture: stages, each live as
soon as it ends (the decode step of one sequence first, which is what a single user needs), run in order by
`Engine.warm_up` or beside serving by a BackgroundCompile."""

from __future__ import annotations

from collections.abc import Callable

from server.engine.types import SamplingParams
from server.kernels.gated_delta import CHUNK_SIZE

WARM_UP_PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)  # one decode step each

Stage = tuple[str, Callable[[], None]]  # (what it compiles, run it)
PREFILL_STAGE = "prefill"
# Stages that read sampled ids back to the host (prefill runs whole requests): not on fake tensors (compile.twin).
HOST_READING_STAGES = frozenset({PREFILL_STAGE})


def warm_up_stages(runner, max_gather_blocks: int, warm_prefill: Callable[[object], None] | None,
                   beside_serving: bool = False) -> list[Stage]:
    """The stages that warm `runner`'s compiled steps up. Until a stage ends, the runner takes its eager path for
    what the stage covers: decode steps of more sequences than `ready_num_seqs`, sampled (not greedy) rows
    (`sampler_ready`), and prefill (its forward is the eager model until `warm_prefill(compiled_forward)` has
    run). Stages run on padding rows, scratch ids and the null block only, so they may run while the runner
    serves. `beside_serving`: where no CUDA graph replays the decode step, the steps launch from inductor's
    Python wrapper first and from its C++ wrapper once a last stage has built that (slower to build, faster to
    run: launch_wrapper)."""
    graphs, stages = runner.decode_graphs, []
    cpp_later = graphs is not None and beside_serving and not graphs.use_graphs
    if cpp_later:
        runner.launch_from_python_first()
    if graphs is not None:
        graphs.ready_num_seqs = 0
        sizes = graphs.batch_sizes

        def one_sequence() -> None:
            graphs.warm(sizes[:1], max_gather_blocks)
            graphs.ready_num_seqs = 1

        def larger_batches() -> None:
            graphs.warm(sizes[1:], max_gather_blocks)
            graphs.ready_num_seqs = sizes[-1]

        runner.sampler_ready = False

        def sampler() -> None:
            runner.warm_sampler()
            runner.sampler_ready = True

        stages += [("the decode step of one sequence", one_sequence), ("the sampler", sampler)]
        if len(sizes) > 1:
            stages.append((f"the decode step of 2-{sizes[-1]} sequences", larger_batches))
    if warm_prefill is not None:
        compiled_forward, runner.forward_steps = runner.forward_steps, runner.eager_forward

        def prefill() -> None:
            warm_prefill(compiled_forward)
            runner.forward_steps = compiled_forward

        stages.append((PREFILL_STAGE, prefill))
    if cpp_later:  # last: the others make every request compiled, this one makes decode faster
        stages.append(("the decode step and the sampler launched from C++", runner.build_cpp_forms))
    return stages


class PrefillForms:
    """The forward of prefill warm-up runs: `compiled` for steps with more than one token of some sequence, the
    eager forward for one token per sequence, which the serving runner sends to its compiled decode step."""

    def __init__(self, compiled, eager):
        self.compiled, self.eager = compiled, eager

    def __call__(self, input_ids, positions, meta, kv_layers):
        forward = self.eager if meta.query_index.shape[1] == 1 else self.compiled
        return forward(input_ids, positions, meta, kv_layers)


def prefill_warm_up_runs(decode_through_prefill: bool, hybrid: bool, vocab_size: int, max_num_batched_tokens: int,
                         max_model_len: int) -> list[list[list[int]]]:
    """The batches of prompt ids that compile the prefill forms, one batch per run, with WARM_UP_PARAMS: a fresh
    prompt alone, fresh prompts together, continued chunks and mixes, each with few and with many tokens (MoE
    paths differ). `decode_through_prefill` (no compiled decode step): decode steps of one sequence and of
    several run through the same forward, so those too."""
    runs = [[[1]], [[1], [2]]] if decode_through_prefill else []
    budget = max_num_batched_tokens
    # (prompts, prompt length); a prompt alone continues in a full chunk, then a short one (torch specializes a
    # batch of one sequence)
    shapes = [(1, 3), (1, 2 * budget + 2), (2, 2), (2, budget // 2), (2, budget + 3)]
    if hybrid:  # the chunked GDN specializes on one chunk or more and on padding, and each decoder layer
        # compiles apart (a graph break around the GDN chunk loop): a long tail too
        shapes += [(n, length) for n in (1, 2) for length in (CHUNK_SIZE, CHUNK_SIZE + 6)]
        shapes.append((1, budget + CHUNK_SIZE + 6))
    for run, (num_prompts, prompt_len) in enumerate(shapes):  # distinct prompts: no prefix-cache hits
        prompt_len = max(1, min(prompt_len, max_model_len - WARM_UP_PARAMS.max_tokens))
        runs.append([[1 + (7 * run + 3 * i + j) % (vocab_size - 1) for j in range(prompt_len)]
                     for i in range(num_prompts)])
    return runs

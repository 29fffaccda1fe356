"""SchedulerOutput -> device tensors -> model -> logits -> sampler. Owns the paged KV tensors."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx.experimental._config as shape_config
from torch import nn

from server.engine.device import serialized_device_work
from server.engine.launch_wrapper import LaunchCompiled
from server.engine.request import PLACEHOLDER, Request
from server.engine.scheduler import ScheduledChunk, SchedulerOutput
from server.kernels import sampling
from server.kernels.paged_attention import prefill_sdpa_backends
from server.kernels.plan import StepPlan, StepPlans
from server.kernels.streams import DeviceStreams, PendingCopy
from server.models.base import AttentionMetadata


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass
class StepResult:
    sampled: dict[str, SampledToken] = field(default_factory=dict)
    all_logits: dict[str, torch.Tensor] = field(default_factory=dict)  # request id -> [num_tokens, vocab] fp32


@dataclass
class InFlightStep:
    """A launched step: its device outputs and the host copies in progress."""

    out: SchedulerOutput
    sample_chunks: list[ScheduledChunk]
    sample_rows: dict[str, int]  # request id -> row of `token_ids`
    token_ids: torch.Tensor | None  # [num_samples] int64 on the device (feeds the next step)
    copies: dict[str, PendingCopy]
    all_logits: dict[str, torch.Tensor]

    def resolve(self) -> StepResult:
        """Wait for this step's host copies: the one read of its sampled ids."""
        result = StepResult(all_logits={k: v.cpu() for k, v in self.all_logits.items()})
        if not self.sample_chunks:
            return result
        host = {name: copy.wait().tolist() for name, copy in self.copies.items()}
        for i, chunk in enumerate(self.sample_chunks):
            token = SampledToken(host["token_ids"][i])
            num_top = chunk.request.params.logprobs
            if num_top is not None and "logprobs" in host:
                token.logprob = host["logprobs"][i]
                if num_top and "top_ids" in host:
                    token.top_ids = host["top_ids"][i][:num_top]
                    token.top_logprobs = host["top_logprobs"][i][:num_top]
            result.sampled[chunk.request.request_id] = token
        return result


class CompiledSteps:
    """Prefill and mixed steps through torch.compile(dynamic=True) (EngineConfig.compile_prefill): one graph per
    attention form instead of one per shape. Token, sequence and block counts vary freely; the caches never
    change shape, so they are static (else torch's duck sizing equates e.g. a batch of 8 with 8 KV heads and
    recompiles when they differ), and sizes 0/1 are not specialized (one graph serves one sequence or many; not
    for hybrids, see below)."""

    def __init__(self, model: nn.Module, cache_tensors: list[torch.Tensor], plan: StepPlan, size_oblivious: bool = True):
        self.plan = plan  # the compiled plan: the same object every call, so dynamo's guards on it always pass
        for tensor in cache_tensors:
            torch._dynamo.mark_static(tensor)
        self._compiled = torch.compile(model, dynamic=True)
        # Hybrids specialize size 1: with it size-oblivious, the Gated DeltaNet chunked prefill fails to trace or
        # lower (a state broadcast, a `[-1:]` slice, solve_triangular's fake strides).
        wanted = {"use_duck_shape": False, "backed_size_oblivious": size_oblivious}  # private knobs, where present
        self._shape_config = {k: v for k, v in wanted.items() if hasattr(shape_config, k)}
        # attention forms x MoE token-count paths: a few graphs of one forward, within dynamo's limit
        self._recompile_limit = max(torch._dynamo.config.recompile_limit, 16)

    def __call__(self, *args):
        # Set per call, in the calling thread: torch's compile settings are per thread (2.13+), and the
        # background compile, the engine thread and the caller each compile on their own thread.
        with shape_config.patch(**self._shape_config), torch._dynamo.config.patch(
                recompile_limit=self._recompile_limit):
            return self._compiled(*args, self.plan)


class KVCache:
    """Per layer one `[num_blocks, block_size, 2, num_kv_heads, head_dim]` tensor on the device: K and V side by
    side, so a step writes both with one scatter (kernels.paged_attention.write_kv)."""

    def __init__(self, shapes: list[tuple[int, int]], num_blocks: int, block_size: int, dtype, device):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.layers = [torch.zeros(num_blocks, block_size, 2, kv_heads, head_dim, dtype=dtype, device=device)
                       for kv_heads, head_dim in shapes]

    @staticmethod
    def bytes_per_block(shapes: list[tuple[int, int]], block_size: int, dtype: torch.dtype) -> int:
        item = torch.empty((), dtype=dtype).element_size()
        return sum(2 * block_size * kv_heads * head_dim * item for kv_heads, head_dim in shapes)


class ModelRunner:
    def __init__(self, model: nn.Module, kv_cache: KVCache, device: torch.device, vocab_size: int, decode_graphs,
                 state_cache, plans: StepPlans):
        self.decode_graphs = decode_graphs  # DecodeGraphs, or None for the eager path
        # With the compiled decode step, sampling is compiled too: the seeded sampler is several times faster
        # compiled than eager per step; greedy-only batches stay eager (argmax).
        self._sample = sampling.sample
        if decode_graphs is not None:
            self._sample = LaunchCompiled(sampling.sample, "the sampler",
                                          None if decode_graphs.use_graphs else _sample_launched_from_cpp,
                                          fullgraph=True, dynamic=None)
        self.sampler_ready = True  # False while a background compile builds it: the eager sampler meanwhile
        self.state_cache = state_cache  # StateCache of a hybrid model, or None
        self.model = model
        self.plans = plans
        self.eager_forward = functools.partial(model, plan=plans.eager)
        self.forward_steps = self.eager_forward  # prefill and mixed steps (eager, or compiled: compile_prefill)
        self.kv_cache = kv_cache
        self.device = device
        self.vocab_size = vocab_size
        self.streams = DeviceStreams(device)

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, prev: InFlightStep | None = None,
               token_bitmask: Callable[[list[ScheduledChunk]], torch.Tensor] | None = None) -> InFlightStep:
        """Queue the step's device work and the copy of its sampled ids to the host; returns at once on an
        accelerator. Tokens still on the device from `prev` are fed by a device-side gather, not a host read.
        `token_bitmask(sample_chunks)`, when given, is called once the forward is queued, before the sampler:
        the host-side int32 [num_samples, ceil(V / 32)] mask of the tokens each row may sample."""
        chunks = out.chunks
        sample_chunks = [c for c in chunks if c.sample and not c.request.return_all_logits]
        step = InFlightStep(out, sample_chunks, {}, None, {}, {})
        rows = [_sampling_row(c.request) for c in sample_chunks]
        if self.decode_graphs is not None and self._is_plain_decode(chunks):
            logits = self._decode(chunks, prev)
            if token_bitmask is None and sampling.is_plain_greedy(rows):  # the in-graph argmax is the sample
                step.token_ids = self.decode_graphs.last_token_ids[: len(chunks)]
        else:
            input_ids, positions, meta, sample_index, logit_ranges, pending = self._prepare(chunks)
            self._feed_pending(input_ids, pending, prev)
            with prefill_sdpa_backends(self.device):
                hidden = self.forward_steps(input_ids, positions, meta, self.kv_cache.layers)  # [num_tokens, hidden]
            logits_of = functools.partial(self.model.compute_logits, plan=self.plans.eager)
            step.all_logits = {rid: logits_of(hidden[a:b]) for rid, (a, b) in logit_ranges.items()}
            logits = logits_of(hidden[sample_index]) if sample_chunks else None
        if sample_chunks:
            if step.token_ids is None:
                sampled = self._sample_rows(logits, rows, token_bitmask(sample_chunks) if token_bitmask else None)
                self._keep_on_device(sampled.token_ids, prev)
            else:
                sampled = sampling.SamplerOutput(step.token_ids)
            step.token_ids = sampled.token_ids
            step.sample_rows = {c.request.request_id: i for i, c in enumerate(sample_chunks)}
            for name in ("token_ids", "logprobs", "top_ids", "top_logprobs"):
                value = getattr(sampled, name)
                if value is not None:
                    step.copies[name] = self.streams.copy_to_host(value)
        return step

    def _sample_rows(self, logits: torch.Tensor, rows: list[sampling.SamplingRow],
                     token_bitmask: torch.Tensor | None) -> sampling.SamplerOutput:
        batch = sampling.build_sampling_batch(rows, self.vocab_size, self.device, token_bitmask)
        eager = batch.all_greedy or not self.sampler_ready
        return sampling.sample(logits, batch) if eager else self._sample(logits, batch)

    @torch.inference_mode()
    def warm_sampler(self, sample=None) -> None:
        """Compile the sampler (`sample`: a form of it) for the usual sampled requests (a temperature, with top-p
        or without), at one row and at several, so that the first of them does not wait for it."""
        sample = sample or self._sample
        for top_p in (1.0, 0.95):
            for num_rows in (1, 2):
                rows = [sampling.SamplingRow(temperature=0.7, top_p=top_p, seed=row) for row in range(num_rows)]
                with serialized_device_work(self.device):
                    batch = sampling.build_sampling_batch(rows, self.vocab_size, self.device)
                    sample(torch.zeros(num_rows, self.vocab_size, device=self.device), batch, warm_up=True)

    @property
    def kernel_launch(self) -> str:
        """Who launches the decode step's kernels now: DecodeGraphs.kernel_launch, or "eager"."""
        return "eager" if self.decode_graphs is None else self.decode_graphs.kernel_launch

    def launch_from_python_first(self) -> None:
        """While the engine serves beside the compile: the compiled steps launch from inductor's Python wrapper,
        which builds sooner, until `build_cpp_forms` has built their C++ forms (launch_wrapper)."""
        self.decode_graphs.compiled.python_first()
        self._sample.python_first()

    def build_cpp_forms(self) -> None:
        self.decode_graphs.build_cpp_form()
        if self.sampler_ready:  # else its own stage failed: sampled rows stay eager
            self._sample.build_cpp_form(self.warm_sampler)

    def _keep_on_device(self, token_ids: torch.Tensor, prev: InFlightStep | None) -> None:
        """Where the compiled decode step feeds from: the ids of the last step sampled, whichever path ran it."""
        if self.decode_graphs is None:
            return
        self._after_readers(prev)
        self.decode_graphs.last_token_ids[: token_ids.shape[0]].copy_(token_ids)

    def _after_readers(self, prev: InFlightStep | None) -> None:
        """Order what comes next after the host copy of `prev`'s ids, which may read `last_token_ids` (a wait on
        the device; the host goes on)."""
        if prev is not None and "token_ids" in prev.copies:
            self.streams.wait(prev.copies["token_ids"])

    def _feed_pending(self, input_ids: torch.Tensor, pending: list[tuple[int, str]], prev: InFlightStep | None) -> None:
        """Copy tokens sampled by the in-flight step into this step's inputs, on the device."""
        if not pending:
            return
        assert prev is not None and prev.token_ids is not None, "placeholder without an in-flight step"
        dest = torch.tensor([i for i, _ in pending], dtype=torch.int64).to(self.device, non_blocking=True)
        rows = torch.tensor([prev.sample_rows[rid] for _, rid in pending], dtype=torch.int64)
        input_ids.index_copy_(0, dest, prev.token_ids[rows.to(self.device, non_blocking=True)])

    def _is_plain_decode(self, chunks: list[ScheduledChunk]) -> bool:
        return len(chunks) <= self.decode_graphs.ready_num_seqs and all(
            c.num_tokens == 1 and c.sample and not c.request.return_all_logits for c in chunks
        )

    def _decode(self, chunks: list[ScheduledChunk], prev: InFlightStep | None) -> torch.Tensor:
        """One token per sequence through the compiled (and, on CUDA, graph-captured) step: the rows packed on
        the host, one copy to the device (see DecodeGraphs)."""
        graphs, block_size = self.decode_graphs, self.kv_cache.block_size
        num_blocks = max(c.start // block_size + 1 for c in chunks)
        padded_seqs, padded_blocks = graphs.padded_shape(len(chunks), num_blocks)
        state_slots = self.state_cache.decode_slot_ids(chunks) if self.state_cache is not None else None
        packed = []
        for row, chunk in enumerate(chunks):
            request, pos = chunk.request, chunk.start
            token_id = request.token_ids[pos]
            feed_row = prev.sample_rows[request.request_id] if token_id == PLACEHOLDER else -1
            kv_slot = request.block_ids[pos // block_size] * block_size + pos % block_size
            state_slot = state_slots[row] if state_slots is not None else None
            table = request.block_ids[: pos // block_size + 1]
            packed.append(graphs.rows.pack_row(max(token_id, 0), pos, kv_slot, feed_row, state_slot, table,
                                               padded_blocks))
        packed.extend([graphs.rows.padding_row(padded_blocks)] * (padded_seqs - len(chunks)))
        host = torch.tensor(packed, dtype=torch.int64)  # [B_pad, num_fixed + blocks_pad]
        if self.device.type == "cuda":
            host = host.pin_memory()
        return graphs.run(host, before_write=lambda: self._after_readers(prev))[: len(chunks)]

    def _prepare(self, chunks: list[ScheduledChunk]):
        block_size = self.kv_cache.block_size
        num_seqs = len(chunks)
        max_q_len = max(c.num_tokens for c in chunks)
        max_blocks = max(-(-(c.start + c.num_tokens) // block_size) for c in chunks)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        cols: list[int] = []
        query_index = [[0] * max_q_len for _ in range(num_seqs)]
        query_pos = [[0] * max_q_len for _ in range(num_seqs)]
        block_tables = [[0] * max_blocks for _ in range(num_seqs)]
        sample_index: list[int] = []
        pending: list[tuple[int, str]] = []  # (flat index, request id) of tokens still on the device
        logit_ranges: dict[str, tuple[int, int]] = {}
        for row, chunk in enumerate(chunks):
            request = chunk.request
            first = len(input_ids)
            for col in range(chunk.num_tokens):
                pos = chunk.start + col
                query_index[row][col] = len(input_ids)
                query_pos[row][col] = pos
                token_id = request.token_ids[pos]
                if token_id == PLACEHOLDER:
                    pending.append((len(input_ids), request.request_id))
                    token_id = 0
                input_ids.append(token_id)
                positions.append(pos)
                slots.append(request.block_ids[pos // block_size] * block_size + pos % block_size)
                rows.append(row)
                cols.append(col)
            num_blocks = -(-(chunk.start + chunk.num_tokens) // block_size)
            block_tables[row][:num_blocks] = request.block_ids[:num_blocks]
            if request.return_all_logits:
                logit_ranges[request.request_id] = (first, len(input_ids))
            elif chunk.sample:
                sample_index.append(len(input_ids) - 1)

        def tensor(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)

        meta = AttentionMetadata(
            slot_mapping=tensor(slots),
            block_tables=tensor(block_tables),
            query_index=tensor(query_index),
            query_positions=tensor(query_pos),
            token_rows=tensor(rows),
            token_cols=tensor(cols),
            fresh_prefill=all(c.start == 0 for c in chunks),
        )
        if self.state_cache is not None:  # hybrids: snapshot copies / resets, then the rows' state slots
            self.state_cache.prepare(chunks, meta)
        return tensor(input_ids), tensor(positions), meta, tensor(sample_index), logit_ranges, pending


def _sample_launched_from_cpp(*args, **kwargs):
    """`sampling.sample` under a code object of its own, for its C++-wrapper form: dynamo keeps what it saw of a
    function's shapes per code object, so after the Python form the C++ form compiled other (dynamic) graphs than
    it does alone, and a restart that builds it alone missed the cache."""
    return sampling.sample(*args, **kwargs)


def _sampling_row(request: Request) -> sampling.SamplingRow:
    params = request.params
    return sampling.SamplingRow(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        logit_bias=params.logit_bias,
        seed=request.seed,
        step=request.num_output_tokens,
        prompt_token_ids=request.token_ids[: request.num_prompt_tokens],
        output_token_ids=request.output_token_ids,
        num_logprobs=params.logprobs,
    )

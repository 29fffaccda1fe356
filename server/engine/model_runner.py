"""SchedulerOutput -> device tensors -> model -> logits -> sampler. Owns the paged KV tensors."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from server.engine.request import PLACEHOLDER, Request
from server.engine.scheduler import ScheduledChunk, SchedulerOutput
from server.kernels import sampling
from server.kernels.paged_attention import prefill_sdpa_backends
from server.kernels.plan import StepPlans
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


@dataclass
class QueuedForward:
    """A step whose forward is queued and whose sampler is not yet (ModelRunner.forward -> ModelRunner.sample)."""

    step: InFlightStep
    rows: list[sampling.SamplingRow]  # one per sample chunk, read before the step changed its requests
    logits: torch.Tensor | None  # [num_samples, vocab] float32; None without sample chunks
    prev: InFlightStep | None


class ModelRunner:
    """The eager step: SchedulerOutput -> device inputs -> model -> logits, then the sampler. A step is two calls,
    `forward` and `sample`, so that the caller can compute the constrained rows' token masks in between."""

    decode_graphs = None  # no compiled decode step (compile.runner.CompiledRunner has one)

    def __init__(self, model: nn.Module, kv_cache: KVCache, device: torch.device, vocab_size: int, state_cache,
                 plans: StepPlans):
        self.state_cache = state_cache  # StateCache of a hybrid model, or None
        self.model = model
        self.plans = plans
        self.eager_forward = functools.partial(model, plan=plans.eager)
        self.forward_steps = self.eager_forward  # prefill and mixed steps: eager, or a compiled form (compile.prefill)
        self.kv_cache = kv_cache
        self.device = device
        self.vocab_size = vocab_size
        self.streams = DeviceStreams(device)

    @property
    def kernel_launch(self) -> str:
        """Who launches the decode step's kernels."""
        return "eager"

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, prev: InFlightStep | None = None,
               token_bitmask: torch.Tensor | None = None) -> InFlightStep:
        """`forward` then `sample`, for a step without constrained rows or with their mask known already."""
        return self.sample(self.forward(out, prev), token_bitmask)

    @torch.inference_mode()
    def forward(self, out: SchedulerOutput, prev: InFlightStep | None = None) -> QueuedForward:
        """Queue the step's forward; returns at once on an accelerator. Tokens still on the device from `prev` are
        fed by a device-side gather, not a host read."""
        sample_chunks = [c for c in out.chunks if c.sample and not c.request.return_all_logits]
        step = InFlightStep(out, sample_chunks, {}, None, {}, {})
        rows = [_sampling_row(c.request) for c in sample_chunks]
        logits = self._forward(step, rows, prev)
        return QueuedForward(step, rows, logits, prev)

    def _forward(self, step: InFlightStep, rows: list[sampling.SamplingRow],
                 prev: InFlightStep | None) -> torch.Tensor | None:
        """The forward of any step: its all-position logits into `step.all_logits`; -> the sample rows' logits."""
        input_ids, positions, meta, sample_index, logit_ranges, pending = self._prepare(step.out.chunks)
        self._feed_pending(input_ids, pending, prev)
        with prefill_sdpa_backends(self.device):
            hidden = self.forward_steps(input_ids, positions, meta, self.kv_cache.layers)  # [num_tokens, hidden]
        plan = self.plans.eager
        step.all_logits = {rid: self.model.compute_logits(hidden[a:b], plan) for rid, (a, b) in logit_ranges.items()}
        return self.model.compute_logits(hidden[sample_index], plan) if step.sample_chunks else None

    @torch.inference_mode()
    def sample(self, queued: QueuedForward, token_bitmask: torch.Tensor | None = None) -> InFlightStep:
        """Queue the sampler and the copy of the sampled ids to the host. `token_bitmask`: the host-side int32
        [num_samples, ceil(V / 32)] mask of the tokens each row may sample (structured outputs)."""
        step = queued.step
        if not step.sample_chunks:
            return step
        if step.token_ids is None:
            sampled = self._sample_rows(queued.logits, queued.rows, token_bitmask)
            self._on_sampled(sampled.token_ids, queued.prev)
        else:  # the forward sampled already (a compiled greedy decode step)
            sampled = sampling.SamplerOutput(step.token_ids)
        step.token_ids = sampled.token_ids
        step.sample_rows = {c.request.request_id: i for i, c in enumerate(step.sample_chunks)}
        for name in ("token_ids", "logprobs", "top_ids", "top_logprobs"):
            value = getattr(sampled, name)
            if value is not None:
                step.copies[name] = self.streams.copy_to_host(value)
        return step

    def _sample_rows(self, logits: torch.Tensor, rows: list[sampling.SamplingRow],
                     token_bitmask: torch.Tensor | None) -> sampling.SamplerOutput:
        batch = sampling.build_sampling_batch(rows, self.vocab_size, self.device, token_bitmask)
        return sampling.sample(logits, batch)

    def _on_sampled(self, token_ids: torch.Tensor, prev: InFlightStep | None) -> None:
        """What a runner does with ids sampled outside its forward (a compiled decode step keeps them)."""

    def _feed_pending(self, input_ids: torch.Tensor, pending: list[tuple[int, str]], prev: InFlightStep | None) -> None:
        """Copy tokens sampled by the in-flight step into this step's inputs, on the device."""
        if not pending:
            return
        assert prev is not None and prev.token_ids is not None, "placeholder without an in-flight step"
        dest = torch.tensor([i for i, _ in pending], dtype=torch.int64).to(self.device, non_blocking=True)
        rows = torch.tensor([prev.sample_rows[rid] for _, rid in pending], dtype=torch.int64)
        input_ids.index_copy_(0, dest, prev.token_ids[rows.to(self.device, non_blocking=True)])

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

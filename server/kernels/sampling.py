"""Batched, sync-free token sampling.

Per step, `build_sampling_batch` turns each request's settings into device tensors once (two small packed
host-to-device copies plus one per penalty/bias table); `sample` then runs only tensor ops: no `.item()`,
`.tolist()`, `torch.multinomial`, `nonzero` or boolean-mask indexing, so it can sit inside a captured or compiled
decode step.

Order: the grammar's token bitmask (structured outputs: disallowed tokens -> -inf) -> logit_bias -> repetition penalty (prompt and output, HF/vLLM: logit > 0 -> /p else *p) -> presence and
frequency penalties (output only, OpenAI) -> greedy rows take the argmax here -> temperature -> top-k -> top-p ->
min-p -> exponential race. Logprobs are log_softmax of the logits after bias and penalties, before temperature and
the filters (what the model "thinks", as OpenAI reports it).

The exponential race picks argmax_i p_i / E_i with E_i ~ Exp(1), which draws i with probability p_i. It is done
in log space, argmax_i (l_i - log E_i): the softmax normalizer does not move the argmax, so no softmax pass is
needed. E_i = -log(u_i), u_i from a counter-based hash of (seed, step, vocab index) in integer tensor ops,
so a seeded request draws the same noise whatever batch it is in. The uniforms are exact (integer ops, then
IEEE-exact scaling) and so identical on every device; `log` may differ in the last ulp between devices (CPU vs
CUDA), which can change a draw only when two candidates tie to within that ulp.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from server.kernels import compat, devices

_M32 = 0xFFFFFFFF
_MIX_A, _MIX_B = 0x7FEB352D, 0x68E31DA5  # odd, < 2**31: a 32-bit value times one never overflows int64
_GOLDEN = 0x61C88647  # spreads consecutive vocab indices before mixing
_SEED_SALT = 0x9E3779B9


@dataclass
class SamplingRow:
    """One request's settings for this step, as plain Python values."""

    temperature: float  # 0 = greedy
    top_k: int = 0  # <= 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int = 0
    step: int = 0  # index of the token being sampled in this request's output
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    num_logprobs: int | None = None  # None: off; 0: the sampled token's only; n: also the top n


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [B] f32, 1.0 on greedy rows
    is_greedy: torch.Tensor  # [B] bool
    top_k: torch.Tensor  # [B] int64, vocab_size where off
    top_p: torch.Tensor  # [B] f32
    min_p: torch.Tensor  # [B] f32
    repetition_penalty: torch.Tensor  # [B] f32
    presence_penalty: torch.Tensor  # [B] f32
    frequency_penalty: torch.Tensor  # [B] f32
    seed_lo: torch.Tensor  # [B] int64, low 32 bits of the seed
    seed_hi: torch.Tensor  # [B] int64, high 32 bits
    step: torch.Tensor  # [B] int64, low 32 bits of the step
    output_counts: torch.Tensor | None  # [B, V] f32 occurrences in the output, when penalties are on
    seen_mask: torch.Tensor | None  # [B, V] bool, prompt or output, when a repetition penalty is on
    logit_bias: torch.Tensor | None  # [B, V] f32, when any row has one
    token_bitmask: torch.Tensor | None  # [B, ceil(V / 32)] int32, bit t of row b: token t allowed; None: all
    all_greedy: bool
    need_penalties: bool
    need_repetition: bool
    need_bias: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    max_top_k: int
    max_num_logprobs: int | None  # None: no row wants logprobs


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64, on the device
    logprobs: torch.Tensor | None = None  # [B] f32, of the sampled tokens
    top_ids: torch.Tensor | None = None  # [B, n] int64
    top_logprobs: torch.Tensor | None = None  # [B, n] f32


def is_plain_greedy(rows: Sequence[SamplingRow]) -> bool:
    """Argmax of the raw logits is the whole job: greedy, no bias, no penalties, no logprobs. Then the compiled
    decode step's own argmax is the sample, and no sampling batch is built (its copies are skipped too)."""
    return all(
        r.temperature <= 0.0 and not r.logit_bias and r.repetition_penalty == 1.0 and r.presence_penalty == 0
        and r.frequency_penalty == 0 and r.num_logprobs is None
        for r in rows
    )


def _to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return _host_to_device(torch.tensor(values, dtype=dtype), device)


def _host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if devices.pins_host_memory(device) and not compat.is_fake(host):  # a fake (the compile child's twin) has nothing to pin
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _scatter_table(flat_index: list[int], values: list[float], shape: tuple[int, int], device) -> torch.Tensor:
    """A dense [B, V] float32 table built on the device from (row * V + token, value) pairs."""
    table = torch.zeros(shape[0] * shape[1], dtype=torch.float32, device=device)
    if flat_index:
        index = _to_device(flat_index, torch.int64, device)
        table.scatter_add_(0, index, _to_device(values, torch.float32, device))
    return table.view(shape)


def build_sampling_batch(rows: list[SamplingRow], vocab_size: int, device,
                         token_bitmask: torch.Tensor | None = None) -> SamplingBatch:
    """`token_bitmask`: int32 [B, ceil(V / 32)] on the host, the tokens each row may sample (all bits set on
    unconstrained rows); one more host-to-device copy."""
    device = torch.device(device)
    shape = (len(rows), vocab_size)
    greedy = [row.temperature <= 0.0 for row in rows]
    sampled = [row for row, is_greedy in zip(rows, greedy, strict=True) if not is_greedy]
    top_ks = [row.top_k if 0 < row.top_k < vocab_size else vocab_size for row in rows]
    floats = [
        [1.0 if g else r.temperature, r.top_p, r.min_p, r.repetition_penalty, r.presence_penalty, r.frequency_penalty]
        for r, g in zip(rows, greedy, strict=True)
    ]
    ints = [
        [k, r.seed & _M32, (r.seed >> 32) & _M32, r.step & _M32, int(g)]
        for r, k, g in zip(rows, top_ks, greedy, strict=True)
    ]
    packed_f, packed_i = _to_device(floats, torch.float32, device), _to_device(ints, torch.int64, device)

    need_repetition = any(r.repetition_penalty != 1.0 for r in rows)
    need_penalties = need_repetition or any(r.presence_penalty != 0 or r.frequency_penalty != 0 for r in rows)
    output_counts = seen_mask = logit_bias = None
    if need_penalties:
        flat = [b * vocab_size + t for b, r in enumerate(rows) for t in r.output_token_ids if 0 <= t < vocab_size]
        output_counts = _scatter_table(flat, [1.0] * len(flat), shape, device)
    if need_repetition:
        flat = [b * vocab_size + t for b, r in enumerate(rows) for t in r.prompt_token_ids if 0 <= t < vocab_size]
        seen_mask = (_scatter_table(flat, [1.0] * len(flat), shape, device) > 0) | (output_counts > 0)
    need_bias = any(r.logit_bias for r in rows)
    if need_bias:
        pairs = [
            (b * vocab_size + t, v)
            for b, r in enumerate(rows)
            for t, v in (r.logit_bias or {}).items()
            if 0 <= t < vocab_size
        ]
        logit_bias = _scatter_table([i for i, _ in pairs], [v for _, v in pairs], shape, device)
    wanted = [r.num_logprobs for r in rows if r.num_logprobs is not None]
    return SamplingBatch(
        temperature=packed_f[:, 0],
        top_p=packed_f[:, 1],
        min_p=packed_f[:, 2],
        repetition_penalty=packed_f[:, 3],
        presence_penalty=packed_f[:, 4],
        frequency_penalty=packed_f[:, 5],
        top_k=packed_i[:, 0],
        seed_lo=packed_i[:, 1],
        seed_hi=packed_i[:, 2],
        step=packed_i[:, 3],
        is_greedy=packed_i[:, 4].bool(),
        output_counts=output_counts,
        seen_mask=seen_mask,
        logit_bias=logit_bias,
        token_bitmask=_host_to_device(token_bitmask, device) if token_bitmask is not None else None,
        all_greedy=all(greedy),
        need_penalties=need_penalties,
        need_repetition=need_repetition,
        need_bias=need_bias,
        need_top_k=any(0 < r.top_k < vocab_size for r in sampled),
        need_top_p=any(r.top_p < 1.0 for r in sampled),
        need_min_p=any(r.min_p > 0.0 for r in sampled),
        max_top_k=max([k for k, g in zip(top_ks, greedy, strict=True) if not g and k < vocab_size], default=vocab_size),
        max_num_logprobs=max(wanted) if wanted else None,
    )


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [B, V] with the tokens whose bit is clear in `bitmask` [B, ceil(V / 32)] int32 set to -inf."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)[:, : logits.shape[-1]]  # [B, V]
    return logits.masked_fill(allowed == 0, float("-inf"))


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer (xorshift-multiply) on int64 tensors holding values in [0, 2**32)."""
    h = h ^ (h >> 16)
    h = (h * _MIX_A) & _M32
    h = h ^ (h >> 15)
    h = (h * _MIX_B) & _M32
    return h ^ (h >> 16)


def exponential_noise(seed_lo: torch.Tensor, seed_hi: torch.Tensor, step: torch.Tensor, vocab_size: int):
    """Exp(1) draws [B, V] f32, a pure function of (seed, step, vocab index) per row."""
    key = _mix32(_mix32(_mix32(seed_lo ^ _SEED_SALT) ^ seed_hi) ^ step)  # [B]
    spread = torch.arange(0, vocab_size * _GOLDEN, _GOLDEN, device=key.device, dtype=torch.int64)  # [V]
    bits = _mix32((spread + key.unsqueeze(1)) & _M32)  # [B, V]
    # 23 bits + 0.5 fit float32's 24-bit mantissa exactly, so u < 1 strictly (24 bits could round up to 1.0)
    uniform = ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
    return -torch.log(uniform)  # > 0: the smallest value is -log(1 - 2**-24)


def apply_bias_and_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.token_bitmask is not None:
        logits = apply_token_bitmask(logits, batch.token_bitmask)
    if batch.need_bias:
        logits = logits + batch.logit_bias
    if batch.need_repetition:
        penalty = batch.repetition_penalty.unsqueeze(1)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(batch.seen_mask, penalized, logits)
    if batch.need_penalties:
        counts = batch.output_counts
        logits = logits - batch.frequency_penalty.unsqueeze(1) * counts
        logits = logits - batch.presence_penalty.unsqueeze(1) * (counts > 0).to(logits.dtype)
    return logits


def _kth_largest(values: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """[B, 1] the top_k[b]-th largest value of each row; -inf where top-k is off (top_k == V)."""
    top_values = torch.topk(values, max_top_k, dim=-1).values  # [B, max_k], max_k over rows with top-k on
    kth = top_values.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))
    return kth.masked_fill((top_k >= values.shape[-1]).unsqueeze(1), float("-inf"))


def apply_filters(scaled: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """top-k, then top-p over the survivors, then min-p; removed entries become -inf. Ties at the k-th kept."""
    neg_inf = float("-inf")
    if batch.need_top_p:
        sorted_logits, sorted_idx = torch.sort(scaled, dim=-1, descending=True)  # [B, V]
        if batch.need_top_k:
            kth = sorted_logits.gather(1, (batch.top_k - 1).unsqueeze(1))
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, neg_inf)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = chunked_cumsum(probs) - probs  # exclusive: the top token is always kept
        sorted_logits = sorted_logits.masked_fill(mass_before > batch.top_p.unsqueeze(1), neg_inf)
        scaled = torch.full_like(scaled, neg_inf).scatter(1, sorted_idx, sorted_logits)
    elif batch.need_top_k:
        scaled = scaled.masked_fill(scaled < _kth_largest(scaled, batch.top_k, batch.max_top_k), neg_inf)
    if batch.need_min_p:
        row_max = scaled.max(dim=-1, keepdim=True).values
        scaled = scaled.masked_fill(scaled < row_max + torch.log(batch.min_p).unsqueeze(1), neg_inf)
    return scaled


def chunked_cumsum(values: torch.Tensor, num_chunks: int = 64) -> torch.Tensor:
    """torch.cumsum over the last dim of [B, V] in two stages: each of `num_chunks` chunks of a row scans alone,
    then the chunk totals shift them. Inductor scans a long row with few rows as a split scan, whose code
    generation fails for a dynamic number of rows on torch 2.11 CUDA; short scans over many rows do not split."""
    num_rows, width = values.shape
    scans = _as_chunks(values, num_chunks, 0.0).cumsum(dim=-1)  # [B, C, chunk_len]; zero padding adds nothing
    totals = scans[..., -1]  # [B, C]
    offsets = totals.cumsum(dim=-1) - totals  # [B, C], exclusive
    return (scans + offsets.unsqueeze(-1)).view(num_rows, -1)[:, :width]


def _as_chunks(rows: torch.Tensor, num_chunks: int, pad_value: float) -> torch.Tensor:
    """[B, V] -> [B, num_chunks, ceil(V / num_chunks)], the last chunk padded with `pad_value`."""
    num_rows, width = rows.shape
    chunk_len = -(-width // num_chunks)
    return F.pad(rows, (0, chunk_len * num_chunks - width), value=pad_value).view(num_rows, num_chunks, chunk_len)


def greedy_ids(logits: torch.Tensor, two_stage: bool) -> torch.Tensor:
    """The argmax of each row [B, V] -> [B], as the compiled decode step takes it: in two stages where a device
    reduces a row's chunks in parallel (`two_stage`, StepPlan.two_stage_argmax); torch.argmax on the CPU, where a
    row is one thread's work either way and torch 2.11's CPU code for the two stages picks wrong indices."""
    return two_stage_argmax(logits) if two_stage else logits.argmax(dim=-1)


def two_stage_argmax(logits: torch.Tensor, num_chunks: int = 64) -> torch.Tensor:
    """torch.argmax over the last dim (first index of the maximum) in two stages, for compiled code: inductor
    does not split an argmax, so over a 128k vocabulary one row is one thread block. Here the row is cut into
    `num_chunks` rows first, reduced in parallel."""
    chunks = _as_chunks(logits, num_chunks, float("-inf"))  # [B, C, chunk_len]
    chunk_len = chunks.shape[-1]
    in_chunk = chunks.argmax(dim=-1, keepdim=True)  # [B, C, 1]
    best_chunk = chunks.gather(-1, in_chunk).squeeze(-1).argmax(dim=-1, keepdim=True)  # [B, 1]: first max wins
    return (best_chunk * chunk_len + in_chunk.squeeze(-1).gather(-1, best_chunk)).squeeze(-1)  # [B]


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """logits [B, V] f32 -> SamplerOutput; no host sync."""
    logits = apply_bias_and_penalties(logits.float(), batch)
    if batch.all_greedy:
        token_ids = torch.argmax(logits, dim=-1)
    else:
        scaled = apply_filters(logits / batch.temperature.unsqueeze(1), batch)
        noise = exponential_noise(batch.seed_lo, batch.seed_hi, batch.step, logits.shape[-1])
        sampled_ids = torch.argmax(scaled - torch.log(noise), dim=-1)
        token_ids = torch.where(batch.is_greedy, torch.argmax(logits, dim=-1), sampled_ids)
    return _with_logprobs(SamplerOutput(token_ids), logits, batch)


def _with_logprobs(out: SamplerOutput, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    if batch.max_num_logprobs is None:
        return out
    logprobs = torch.log_softmax(logits, dim=-1)  # [B, V]
    out.logprobs = logprobs.gather(1, out.token_ids.unsqueeze(1)).squeeze(1)
    if batch.max_num_logprobs > 0:
        out.top_logprobs, out.top_ids = torch.topk(logprobs, batch.max_num_logprobs, dim=-1)
    return out


def sample_reference(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """Readable per-row twin with the same noise; host syncs allowed."""
    vocab_size = logits.shape[-1]
    token_ids, processed_rows = [], []
    for b in range(logits.shape[0]):
        row = _reference_process_row(logits[b].float(), batch, b)
        processed_rows.append(row)
        if bool(batch.is_greedy[b]):
            token_ids.append(int(row.argmax()))
            continue
        scaled = _reference_filter_row(row / batch.temperature[b], batch, b)
        probs = torch.softmax(scaled, dim=-1)
        noise = exponential_noise(batch.seed_lo[b : b + 1], batch.seed_hi[b : b + 1], batch.step[b : b + 1], vocab_size)
        token_ids.append(int((probs / noise[0]).argmax()))
    out = SamplerOutput(torch.tensor(token_ids, dtype=torch.int64, device=logits.device))
    return _with_logprobs(out, torch.stack(processed_rows), batch)


def _reference_process_row(row: torch.Tensor, batch: SamplingBatch, b: int) -> torch.Tensor:
    row = row.clone()
    if batch.token_bitmask is not None:
        word = batch.token_bitmask[b].tolist()
        for token in range(row.shape[0]):
            if not (word[token // 32] >> (token % 32)) & 1:
                row[token] = float("-inf")
    if batch.logit_bias is not None:
        row += batch.logit_bias[b]
    if batch.seen_mask is not None:
        penalty = float(batch.repetition_penalty[b])
        for token in batch.seen_mask[b].nonzero().flatten().tolist():
            row[token] = row[token] / penalty if row[token] > 0 else row[token] * penalty
    if batch.output_counts is not None:
        counts = batch.output_counts[b]
        row -= float(batch.frequency_penalty[b]) * counts + float(batch.presence_penalty[b]) * (counts > 0).float()
    return row


def _reference_filter_row(scaled: torch.Tensor, batch: SamplingBatch, b: int) -> torch.Tensor:
    top_k, top_p, min_p = int(batch.top_k[b]), float(batch.top_p[b]), float(batch.min_p[b])
    order = torch.argsort(scaled, descending=True).tolist()
    kth_value = scaled[order[top_k - 1]]
    kept = [t for t in order if scaled[t] >= kth_value]  # top-k, ties kept
    if top_p < 1.0:
        probs = torch.softmax(scaled[kept], dim=-1).tolist()
        mass, survivors = 0.0, []
        for token, p in zip(kept, probs, strict=True):
            if survivors and mass > top_p:
                break
            survivors.append(token)
            mass += p
        kept = survivors
    out = torch.full_like(scaled, float("-inf"))
    out[kept] = scaled[kept]
    if min_p > 0.0:
        probs = torch.softmax(out, dim=-1)
        out[probs < min_p * probs.max()] = float("-inf")
    return out

"""Mixture-of-experts: routing and the expert SwiGLU FFNs, with no host sync on the fast paths.

Fast path (grouped_mm works for this device and dtype):

    expert_ids [T, k] --flatten, sort--> sorted ids [T*k], order [T*k]
        offs[e] = searchsorted(sorted ids, e, right=True, out_int32=True)   # int32 group ends, on the device
    x[order // k] --grouped_mm gate_up--> [T*k, 2I] --silu(gate)*up--> [T*k, I] --grouped_mm down--> [T*k, H]
        --index_copy back to slot order--> [T, k, H] --bmm with weights [T, 1, k]--> [T, H]

`bincount` is avoided because on CUDA it reads its maximum on the host; the final weighted sum is one bmm in
fp32 accumulation instead of an index_add_ scatter (deterministic, no atomics). The routing weight is applied
after `down`, as Hugging Face does.

moe_experts picks, as the step plan says (server.kernels.plan): with few slots (T*k*4 <= E) where the plan has it
(compiled, not on MPS), the gather-reduce path (it reads each chosen expert once, where grouped_mm pays for sorting
and grouping a handful of slots); grouped_mm where the plan has it for this dtype (the probe found it, traced too
when the step is) and it has not failed on this device (capabilities.with_fallback); else gather + bmm (T*k <= E)
or every token through every expert. All are sync-free.

Routing (route_softmax, route_sigmoid_bias) takes its top-k through `top_k_unsorted`: torch.topk, or where the
plan says (StepPlan.fused_top_k: compiled, in a decoder layer compiled once as a region) k rounds of
max-then-mask, which inductor fuses into one kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from server.kernels import compat
from server.kernels.capabilities import with_fallback
from server.kernels.gemv import stored
from server.kernels.plan import StepPlan


def route_softmax(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, plan: StepPlan
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE routing: router_logits [T, E] -> (weights [T, k] in router_logits.dtype, expert_ids [T, k] int64).

    With renormalization the weights are the softmax of the k winning logits, which equals the full softmax
    renormalized over them, and costs no softmax over all E nor a separate sum of the winners."""
    # The winners are picked in the logits' own dtype: widening to fp32 keeps their order and would cost a kernel.
    if renormalize:
        top_logits, expert_ids = top_k_unsorted(router_logits, top_k, plan.fused_top_k)
        weights = winners_softmax(top_logits.float(), plan.pointwise_winners_softmax)
    else:
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
        weights, expert_ids = top_k_unsorted(probs, top_k, plan.fused_top_k)
    return weights.to(router_logits.dtype), expert_ids


def winners_softmax(top_logits: torch.Tensor, pointwise: bool = False) -> torch.Tensor:
    """Softmax over each row's k winning logits [T, k] -> [T, k]. `pointwise` (compiled steps): the row's max and
    sum are pointwise over its k columns, stored as [T, 1] values that a kernel of the token's shape computes (the
    FP8 experts' last one: the weighted sum of the slots, the residual and the next norm), where softmax's
    reduction over the k columns is a kernel of its own per layer. The weights stay an expression that their
    readers inline."""
    if not pointwise or top_logits.shape[-1] > MAX_FUSED_TOP_K:
        return torch.softmax(top_logits, dim=-1)
    columns = top_logits.split(1, dim=-1)  # k of [T, 1]
    row_max = stored(functools.reduce(torch.maximum, columns))
    exps = [torch.exp(column - row_max) for column in columns]
    row_sum = stored(sum(exps[1:], exps[0]))
    return torch.exp(top_logits - row_max) / row_sum


def route_sigmoid_bias(
    router_logits: torch.Tensor,
    expert_bias: torch.Tensor | None,
    top_k: int,
    renormalize: bool,
    scaling: float,
    plan: StepPlan,
) -> tuple[torch.Tensor, torch.Tensor]:
    """LFM2-MoE routing: experts chosen by sigmoid + bias (fp32), weighted by the unbiased sigmoid (model dtype)."""
    scores = router_logits.sigmoid()  # [T, E] in the model dtype, as HF computes it
    if expert_bias is None:
        weights, expert_ids = top_k_unsorted(scores, top_k, plan.fused_top_k)
    else:
        expert_ids = top_k_unsorted(scores + expert_bias.float(), top_k, plan.fused_top_k)[1]
        weights = scores.gather(1, expert_ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
    return weights * scaling, expert_ids


def top_k_unsorted(scores: torch.Tensor, top_k: int, fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest along the last dim, in no promised order -> (values [T, k], ids [T, k] int64). `fused`:
    StepPlan.fused_top_k (see fuses_top_k).

    Slot order only changes the fp32 summation order of the combine, and sorting the winners costs a kernel."""
    if not fuses_top_k(top_k, fused):
        return torch.topk(scores, top_k, dim=-1, sorted=False)
    values, ids = _top_k_rounds(scores, top_k)
    return torch.cat(values, dim=-1), torch.cat(ids, dim=-1)


def fuses_top_k(top_k: int, fused: bool) -> bool:
    """Compiled, k rounds of max-then-mask trace to reductions over the same row, which inductor runs as one kernel
    with whatever consumes the winners per row; torch.topk is a library call on every backend, a kernel of its own
    per layer. Only where the decoder layer compiles once for all layers (`fused`, StepPlan.fused_top_k: the
    caller's layer is such a region): generating that kernel is slow, and inline layers pay it once per layer
    (48 routers: 55 s instead of 18 s on the CPU)."""
    return fused and top_k <= MAX_FUSED_TOP_K


def _top_k_rounds(scores: torch.Tensor, top_k: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """k rounds of (max, its index) over the last dim, each round masking the last winner -> k values [T, 1]
    in descending order and k ids [T, 1]. A tie goes to one index per round, so the set equals topk's."""
    columns = torch.arange(scores.shape[-1], device=scores.device)  # [E]
    values, ids = [], []
    for _ in range(top_k):
        value, index = scores.max(dim=-1, keepdim=True)  # [T, 1] each
        values.append(value)
        ids.append(index)
        scores = scores.masked_fill(columns == index, float("-inf"))
    return values, ids


MAX_FUSED_TOP_K = 16  # the rounds unroll in the graph; the routers served pick 4-10


def moe_experts(
    x: torch.Tensor,  # [T, H]
    weights: torch.Tensor,  # [T, k]
    expert_ids: torch.Tensor,  # [T, k] int64
    gate_up: torch.Tensor,  # [E, 2I, H], rows 0..I-1 are the gate
    down: torch.Tensor,  # [E, H, I]
    plan: StepPlan,
) -> torch.Tensor:
    """y[t] = sum_j weights[t, j] * down[e] @ (silu(gate_e x[t]) * up_e x[t]), e = expert_ids[t, j] -> [T, H]."""
    if use_gather_reduce(plan, expert_ids, gate_up.shape[0]):
        return _experts_gather_reduce(x, weights, expert_ids, gate_up, down)
    if plan.grouped_mm:
        return with_fallback(
            x.device, "grouped_mm", lambda: _experts_grouped(x, weights, expert_ids, gate_up, down, plan.private_ops),
            lambda: _experts_ungrouped(x, weights, expert_ids, gate_up, down), plan.catch_fast_path_failures)
    return _experts_ungrouped(x, weights, expert_ids, gate_up, down)


def _experts_ungrouped(x, weights, expert_ids, gate_up, down):
    """Without grouped_mm: copy the chosen experts when there are few slots, else run every expert."""
    if expert_ids.numel() <= gate_up.shape[0]:
        return _experts_gather_bmm(x, weights, expert_ids, gate_up, down)
    return _experts_dense(x, weights, expert_ids, gate_up, down)


def few_slots(num_slots: int, num_experts: int) -> bool:
    """Decode-sized steps, where reading each chosen expert through one fused reduction beats grouped_mm."""
    return num_slots * 4 <= num_experts  # few_slots_only_at_fewest has its complement


def use_gather_reduce(plan: StepPlan, expert_ids: torch.Tensor, num_experts: int) -> bool:
    """Where the plan has the form (StepPlan.moe_gather_reduce: compiled, not on MPS, where the native grouped_mm
    is the measured path and this one is not measured on a Mac) and the step has few slots. `expert_ids`: [T, k]."""
    if not plan.moe_gather_reduce:
        return False
    num_tokens, top_k = expert_ids.shape
    if plan.regions_compile_once and few_slots_only_at_fewest(num_tokens, top_k, num_experts):
        return False
    return few_slots(num_tokens * top_k, num_experts)


def few_slots_only_at_fewest(num_tokens, top_k: int, num_experts: int) -> bool:
    """Whether a token count of 2 or more (the symbolic batch of a decode step) has few slots at its smallest value
    only. Guarding that would leave the symbolic count a single value, which inside a compiled decoder layer
    replaces a symbol the layer's other copies take (torch then fails to stamp them out), so such a step takes the
    other path. Decided without a guard; a fixed count of 2 or more (no compile in serving has one) would take the
    other path too."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    def surely_not_few(n) -> bool:  # few_slots' complement (torch.sym_not does not trace on a fixed count)
        return statically_known_true(n * top_k * 4 > num_experts)

    return (statically_known_true(num_tokens >= 2) and surely_not_few(num_tokens + 1)
            and not surely_not_few(num_tokens))


def sort_by_expert(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-expert slots sorted by expert -> (order [T*k] int64 slot ids, offs [E] int32 group ends), no host sync."""
    sorted_ids, order = torch.sort(expert_ids.reshape(-1))
    experts = torch.arange(num_experts, device=expert_ids.device, dtype=sorted_ids.dtype)
    offs = torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)  # [E]
    return order, offs


def combine_slots(y_sorted: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Expert outputs in sorted order [T*k, H] -> routing-weighted sum per token [T, H]."""
    num_tokens, top_k = weights.shape
    y_slots = torch.empty_like(y_sorted).index_copy_(0, order, y_sorted)  # [T*k, H] in slot order
    y_slots = y_slots.view(num_tokens, top_k, -1)
    return torch.bmm(weights.to(y_slots.dtype).unsqueeze(1), y_slots).squeeze(1)


def swiglu(gate_up_out: torch.Tensor) -> torch.Tensor:
    """[N, 2I] -> silu(first half) * second half, [N, I]."""
    inter = gate_up_out.shape[-1] // 2
    return F.silu(gate_up_out[..., :inter]) * gate_up_out[..., inter:]


def _experts_grouped(x, weights, expert_ids, gate_up, down, private: bool):
    top_k = expert_ids.shape[1]
    order, offs = sort_by_expert(expert_ids, gate_up.shape[0])
    x_sorted = x.index_select(0, order // top_k)  # [T*k, H]
    hidden = compat.grouped_mm(x_sorted, gate_up.transpose(-2, -1), offs, private=private)  # [T*k, 2I]
    y_sorted = compat.grouped_mm(swiglu(hidden), down.transpose(-2, -1), offs, private=private)  # [T*k, H]
    return combine_slots(y_sorted, order, weights).to(x.dtype)


def _experts_gather_reduce(x, weights, expert_ids, gate_up, down):
    """For torch.compile only: inductor folds the expert gathers into the reductions, so every chosen expert's
    weights are read once and never copied. Eager would materialize [T*k, 2I, H] products: never call it
    uncompiled."""
    flat_ids = expert_ids.reshape(-1)  # [T*k]
    act = slot_swiglu(gate_up, flat_ids, token_slots(x, expert_ids.shape[1]).unsqueeze(1))  # [T*k, I]
    return down_and_combine(down[flat_ids].float(), act, weights).to(x.dtype)


def token_slots(x: torch.Tensor, top_k: int) -> torch.Tensor:
    """Each token's row once per routed slot, in slot order: x [T, H] -> [T*k, H] (a view at one token)."""
    return x.unsqueeze(1).expand(x.shape[0], top_k, x.shape[-1]).reshape(-1, x.shape[-1])


def slot_swiglu(gate_up: torch.Tensor, flat_ids: torch.Tensor, x_slots: torch.Tensor,
                gate_up_scale: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up of each token-expert slot -> [T*k, I] float32 (swiglu_of_halves), each half of the chosen
    experts' rows gathered for its own reduction. gate_up [E, 2I, H], flat_ids [T*k], x_slots [T*k, 1, H],
    gate_up_scale [E, 2I] (FP8 row scales, applied after the reduction) or None."""

    def half(rows: slice) -> torch.Tensor:
        return gate_up[:, rows][flat_ids].float()

    scale = None if gate_up_scale is None else (lambda rows: gate_up_scale[:, rows][flat_ids])
    return swiglu_of_halves(half, gate_up.shape[1] // 2, x_slots, scale)


def swiglu_of_halves(half: Callable[[slice], torch.Tensor], inter: int, x_slots: torch.Tensor,
                     row_scale: Callable[[slice], torch.Tensor] | None = None) -> torch.Tensor:
    """silu(gate) * up of each slot -> [T*k, I] float32, gate and up as two reductions over H of the same output
    shape: inductor runs them as one kernel with the SwiGLU as its epilogue, where one reduction over [T*k, 2I]
    leaves the SwiGLU (which pairs two of its outputs) to a kernel of its own. `half(rows)` is each slot's
    weight rows [T*k, n, H] in float32, an expression gathered for its own reduction (one gathered expression read
    by both would be stored, a copy of the weights). The output is stored: the down reduction would otherwise
    inline it and evaluate the SiLU per weight element."""
    halves = []
    for rows in (slice(0, inter), slice(inter, None)):
        product = (half(rows) * x_slots.float()).sum(-1)  # [T*k, I]
        halves.append(product if row_scale is None else product * row_scale(rows))
    return stored(F.silu(halves[0]) * halves[1])


def down_and_combine(down_slots: torch.Tensor, act: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum over a token's slots j and over i of weights[j] * down_slots[j, h, i] * act[j, i] -> [T, H] float32:
    the down projection and the routing-weighted combine as ONE reduction over (slot, i), so inductor emits one
    kernel and no [T*k, H] intermediate (FP8 experts reduce per slot instead: moe_fp8). down_slots [T*k, H, I]
    (gathered: an expression under compile, never materialized), act [T*k, I], weights [T, k]."""
    num_tokens, top_k = weights.shape
    weighted_act = act.float() * weights.reshape(-1, 1).float()  # [T*k, I]
    products = down_slots * weighted_act.unsqueeze(1)  # [T*k, H, I]
    return products.view(num_tokens, top_k, *products.shape[1:]).sum(dim=(1, 3))


def _experts_gather_bmm(x, weights, expert_ids, gate_up, down):
    """Few slots: copy the chosen experts' weights (T*k <= E copies) and batch the matvecs."""
    flat_ids = expert_ids.reshape(-1)  # [T*k]
    return slot_matvecs(x, weights, gate_up.index_select(0, flat_ids), down.index_select(0, flat_ids))


def slot_matvecs(x, weights, gate_up_slots, down_slots):
    """Each token-expert slot's SwiGLU FFN as batched matvecs, with the experts' weights already gathered per
    slot: gate_up_slots [T*k, 2I, H], down_slots [T*k, H, I] -> routing-weighted sum [T, H]."""
    num_tokens, top_k = weights.shape
    hidden = torch.bmm(gate_up_slots, token_slots(x, top_k).unsqueeze(-1)).squeeze(-1)  # [T*k, 2I]
    y_slots = torch.bmm(down_slots, swiglu(hidden).unsqueeze(-1)).squeeze(-1)  # [T*k, H]
    y_slots = y_slots.view(num_tokens, top_k, -1)
    return torch.bmm(weights.to(y_slots.dtype).unsqueeze(1), y_slots).squeeze(1).to(x.dtype)


def _experts_dense(x, weights, expert_ids, gate_up, down):
    """Many slots: run every token through every expert (reads each expert once), zero weight where unrouted."""
    num_experts = gate_up.shape[0]
    hidden = torch.matmul(x.unsqueeze(0), gate_up.transpose(-2, -1))  # [E, T, 2I]
    y_all = torch.bmm(swiglu(hidden), down.transpose(-2, -1))  # [E, T, H]
    dense_weights = torch.zeros(x.shape[0], num_experts, dtype=y_all.dtype, device=x.device)
    dense_weights.scatter_(1, expert_ids, weights.to(y_all.dtype))  # [T, E]
    return torch.bmm(dense_weights.unsqueeze(1), y_all.transpose(0, 1)).squeeze(1).to(x.dtype)


def moe_experts_reference(x, weights, expert_ids, gate_up, down):
    """Readable twin: a loop over the experts that were hit (host syncs allowed), fp32 accumulation."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
    for expert in expert_ids.unique().tolist():
        token_idx, slot_idx = (expert_ids == expert).nonzero(as_tuple=True)
        hidden = x[token_idx] @ gate_up[expert].t()  # [n, 2I]
        y = swiglu(hidden) @ down[expert].t()  # [n, H]
        out.index_add_(0, token_idx, y.float() * weights[token_idx, slot_idx, None].float())
    return out.to(x.dtype)

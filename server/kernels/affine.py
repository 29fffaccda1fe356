"""Affine group-quantized weights in MLX's format (4 or 8 bits), and the products that read them.

Format (mlx.core.quantize, mode "affine"): a weight [..., N, K] is cut into groups of `group_size` (32, 64, 128)
consecutive values along K, the input dimension; each group has a scale and a bias in the model dtype and
`w ~= scale * q + bias` with q an integer in [0, 2**bits). The q of a row are packed little-endian into uint32:
the first value in the lowest bits (8 values per word at 4 bits, 4 at 8 bits), so a packed weight is
[..., N, K * bits / 32] uint32, its scales and biases [..., N, K / group_size].

Quantizing follows MLX's rounding exactly (mlx's CPU `quantize`, checked against `mx.quantize` in
tests/kernels/test_affine.py): per group, in float32, the scale is (max - min) / (2**bits - 1) (at least 1e-7),
signed towards the edge (min or max) of larger magnitude, then adjusted so that edge falls on an integer q0 and
the bias is that edge (or 0 when q0 rounds to 0); q = clamp(round_half_even((w - bias) / scale), 0, 2**bits - 1)
with the float32 scale and bias, which are only then rounded to the model dtype. Dequantizing is
`q.to(dtype) * scale + bias` in the model dtype, rounded after the product and after the sum, as
`mx.dequantize` does: for the same packed tensors our weights equal MLX's bit for bit.

Products take their form as an argument (`form`); which form runs is decided by the caller's step plan:
- "reference": dequantize the whole weight and call F.linear (any token count, any device); the experts' twin
  loops over the experts that were hit (host syncs: tests and the self-check only).
- "reduction": one float32 reduction over K whose weight operand is the dequantized expression of the packed
  words (unpacked and scaled inside the accumulation): the one-token decode form for torch.compile, where
  inductor emits one kernel that reads the packed weight once (for experts, only the routed experts' rows).
  Eager it materializes [M, N, K]: use it compiled, at few tokens.
- "grouped" (experts): the stacks dequantized to the model dtype, then the model dtype's experts kernel
  (kernels/moe: grouped_mm where the plan has it): prefill and batched decode, sync-free.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from server.kernels import moe
from server.kernels.gemv import stored
from server.kernels.plan import StepPlan

SUPPORTED_BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
LINEAR_FORMS = ("reference", "reduction")
EXPERT_FORMS = ("reference", "reduction", "grouped")
_EPS = 1e-7
_ROW_CHUNK = 4096  # rows quantized at a time, so the float32 copy of a big weight never exists whole


def check_format(group_size: int, bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"affine quantization with {bits} bits is not supported; use one of {SUPPORTED_BITS}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"affine group size {group_size} is not supported; use one of {GROUP_SIZES}")


def packed_width(in_features: int, bits: int) -> int:
    """uint32 words per row of `in_features` values."""
    return in_features * bits // 32


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 32, bits, dtype=torch.int32, device=device)


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Integers in [0, 2**bits) [..., K] -> uint32 [..., K * bits / 32], first value in the lowest bits."""
    per_word = 32 // bits
    words = values.to(torch.int64).reshape(*values.shape[:-1], -1, per_word)
    packed = (words << _shifts(bits, values.device).to(torch.int64)).sum(-1)  # [0, 2**32)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # the same 32 bits, signed
    return packed.view(torch.uint32)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """uint32 [..., P] -> int32 [..., P * 32 / bits] in [0, 2**bits). Shifts on the int32 view (uint32 has few ops
    on most backends); the mask drops the sign bits an arithmetic shift brings in."""
    words = packed.view(torch.int32).unsqueeze(-1)  # [..., P, 1]
    values = (words >> _shifts(bits, packed.device)) & (2**bits - 1)  # [..., P, 32 / bits]
    return values.reshape(*packed.shape[:-1], -1)


def quantize_affine(weight: torch.Tensor, group_size: int = 64, bits: int = 4
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., K] float -> (q uint32 [..., K*bits/32], scales [..., K/gs], biases [..., K/gs] in weight.dtype), equal to
    mx.quantize(weight, group_size, bits)'s."""
    check_format(group_size, bits)
    if weight.shape[-1] % group_size:
        raise ValueError(f"the input dimension {weight.shape[-1]} is not a multiple of the group size {group_size}")
    rows = weight.reshape(-1, weight.shape[-1])
    q = torch.empty(rows.shape[0], packed_width(rows.shape[1], bits), dtype=torch.uint32, device=weight.device)
    scales = torch.empty(rows.shape[0], rows.shape[1] // group_size, dtype=weight.dtype, device=weight.device)
    biases = torch.empty_like(scales)
    for start in range(0, rows.shape[0], _ROW_CHUNK):
        chunk = slice(start, start + _ROW_CHUNK)
        q[chunk], scales[chunk], biases[chunk] = _quantize_rows(rows[chunk], group_size, bits)
    lead = weight.shape[:-1]
    return q.view(*lead, -1), scales.view(*lead, -1), biases.view(*lead, -1)


def _quantize_rows(rows: torch.Tensor, group_size: int, bits: int):
    groups = rows.float().reshape(rows.shape[0], -1, group_size)  # [R, G, gs]
    n_bins = float(2**bits - 1)
    w_max, w_min = groups.amax(-1, keepdim=True), groups.amin(-1, keepdim=True)
    min_side = w_min.abs() > w_max.abs()
    scale = ((w_max - w_min) / n_bins).clamp_min(_EPS)
    scale = torch.where(min_side, scale, -scale)
    edge = torch.where(min_side, w_min, w_max)
    q0 = torch.round(edge / scale)  # round half to even, as mlx's CPU quantize (std::rint)
    on_grid = q0 != 0
    scale = torch.where(on_grid, edge / q0, scale)
    bias = torch.where(on_grid, edge, torch.zeros_like(edge))
    q = torch.round((groups - bias) / scale).clamp_(0, n_bins)  # the float32 scale and bias, as mlx
    packed = pack(q.reshape(rows.shape), bits)
    return packed, scale.squeeze(-1).to(rows.dtype), bias.squeeze(-1).to(rows.dtype)


def dequantize_affine(q: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, group_size: int, bits: int
                      ) -> torch.Tensor:
    """Packed [..., P] with scales, biases [..., G] -> [..., G * group_size] in scales.dtype, equal to
    mx.dequantize's: the product and the sum each rounded to the model dtype."""
    values = unpack(q, bits)
    groups = values.reshape(*values.shape[:-1], -1, group_size).to(scales.dtype)  # [..., G, gs]
    out = groups * scales.unsqueeze(-1) + biases.unsqueeze(-1)
    return out.reshape(*values.shape)


def affine_linear(
    x: torch.Tensor,  # [..., K]
    q: torch.Tensor,  # [N, K * bits / 32] uint32
    scales: torch.Tensor,  # [N, K / group_size]
    biases: torch.Tensor,  # [N, K / group_size]
    group_size: int,
    bits: int,
    bias: torch.Tensor | None = None,  # [N]
    form: str = "reference",
) -> torch.Tensor:
    """x @ dequantize(q, scales, biases).T (+ bias) -> [..., N] in x.dtype, in the given form (module docstring)."""
    if form == "reference":
        return affine_linear_reference(x, q, scales, biases, group_size, bits, bias)
    if form == "reduction":
        return affine_linear_reduction(x, q, scales, biases, group_size, bits, bias)
    raise ValueError(f"unknown affine linear form {form!r}; one of {LINEAR_FORMS}")


def affine_linear_reference(x, q, scales, biases, group_size, bits, bias=None):
    """The twin: dequantize the whole weight to the model dtype and call F.linear."""
    weight = dequantize_affine(q, scales, biases, group_size, bits)
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


def affine_linear_reduction(x, q, scales, biases, group_size, bits, bias=None):
    """One float32 reduction over K of x against the dequantized expression of q (for torch.compile at one
    token: inductor folds the unpacking and the groups' scales and biases into the reduction's weight loads, one
    kernel reading the packed weight once); eager it is correct but materializes [M, N, K]."""
    # x stored first and the output after: else inductor inlines x's producer (a norm, attention's combine) into
    # the reduction, recomputed per output row, and the output into each reader
    x = stored(x)
    out = (x.float().unsqueeze(-2) * dequantized_rows(q, scales, biases, group_size, bits)).sum(-1)  # [..., N]
    if bias is not None:
        out = out + bias.float()
    return stored(out.to(x.dtype))


def dequantized_rows(q: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, group_size: int, bits: int
                     ) -> torch.Tensor:
    """Packed [..., P] -> float32 [..., K], q * scale + bias unrounded: the weight operand of the reductions (under
    torch.compile an expression inlined into their loads, never stored)."""
    values = unpack(q, bits)
    groups = values.view(*values.shape[:-1], -1, group_size).float()  # [..., G, gs]
    return (groups * scales.float().unsqueeze(-1) + biases.float().unsqueeze(-1)).view(values.shape)


def affine_embedding(ids: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor,
                     group_size: int, bits: int) -> torch.Tensor:
    """The rows `ids` of a quantized table, dequantized: [...] -> [..., H] in scales.dtype (mlx's
    QuantizedEmbedding: only the looked-up rows are read)."""
    return dequantize_affine(q[ids], scales[ids], biases[ids], group_size, bits)


# An experts projection: packed (q, scales, biases) with its format (group_size, bits), or a float tensor [E, N, K]
# with format None (mlx-lm leaves a projection whose input dimension the group does not divide unquantized, so
# gate_up may be packed while down is not).
Format = tuple[int, int] | None


def affine_experts(
    x: torch.Tensor,  # [T, H]
    weights: torch.Tensor,  # [T, k]
    expert_ids: torch.Tensor,  # [T, k] int64
    gate_up: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | torch.Tensor,  # packed [E, 2I, H*b/32] + [E, 2I, H/gs] x2
    down: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | torch.Tensor,  # packed [E, H, I*b/32] + [E, H, I/gs] x2
    gate_up_format: Format,
    down_format: Format,
    form: str = "reference",
    plan: StepPlan | None = None,
) -> torch.Tensor:
    """y[t] = sum_j weights[t, j] * down_e(silu(gate_e x[t]) * up_e x[t]), e = expert_ids[t, j] -> [T, H] in x.dtype,
    each expert's weights dequantized from the packed form (MLX's SwitchGLU with QuantizedSwitchLinear); a
    projection whose format is None is a float [E, N, K] tensor (SwitchLinear). `plan`: the step's, which the
    "grouped" form hands to the model dtype's experts kernel."""
    if form == "grouped":
        gate_up_w, down_w = (_expert_weight(w, fmt, slice(None)).to(x.dtype)
                             for w, fmt in ((gate_up, gate_up_format), (down, down_format)))
        return moe.moe_experts(x, weights, expert_ids, gate_up_w, down_w, plan)
    if form == "reference":
        return affine_experts_reference(x, weights, expert_ids, gate_up, down, gate_up_format, down_format)
    if form == "reduction":
        return affine_experts_reduction(x, weights, expert_ids, gate_up, down, gate_up_format, down_format)
    raise ValueError(f"unknown affine experts form {form!r}; one of {EXPERT_FORMS}")


def _expert_weight(weight, fmt: Format, index) -> torch.Tensor:
    """Rows `index` (an expert id, or a tensor of them) of an experts projection, dequantized where packed."""
    if fmt is None:
        return weight[index]
    return dequantize_affine(*(t[index] for t in weight), *fmt)


def affine_experts_reference(x, weights, expert_ids, gate_up, down, gate_up_format, down_format):
    """The twin: a loop over the experts that were hit (host syncs), dequantizing only those experts, each
    projection computed in the model dtype as F.linear does, the routed sum in float32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
    for expert in expert_ids.unique().tolist():
        token_idx, slot_idx = (expert_ids == expert).nonzero(as_tuple=True)
        w_gate_up = _expert_weight(gate_up, gate_up_format, expert).to(x.dtype)
        w_down = _expert_weight(down, down_format, expert).to(x.dtype)
        hidden = F.linear(x[token_idx], w_gate_up)  # [n, 2I]
        inter = hidden.shape[-1] // 2
        y = F.linear(F.silu(hidden[:, :inter]) * hidden[:, inter:], w_down)  # [n, H]
        out.index_add_(0, token_idx, y.float() * weights[token_idx, slot_idx, None].float())
    return out.to(x.dtype)


def affine_experts_reduction(x, weights, expert_ids, gate_up, down, gate_up_format, down_format):
    """Sync-free, in the model dtype's gather-reduce shape (kernels/moe): each token-expert slot reads only its
    expert's packed rows (gathered by id), dequantized inside the reductions, gate and up as two reductions with
    the SwiGLU as their epilogue, down and the routed sum as one. For torch.compile at decode sizes (few slots);
    eager it materializes [T*k, 2I, H]."""
    flat_ids = expert_ids.reshape(-1)  # [T*k]
    x_slots = moe.token_slots(x, expert_ids.shape[1]).unsqueeze(1)  # [T*k, 1, H]
    inter = (gate_up[0] if gate_up_format is not None else gate_up).shape[1] // 2
    act = moe.swiglu_of_halves(lambda rows: _gathered(gate_up, gate_up_format, flat_ids, rows), inter, x_slots)
    return moe.down_and_combine(_gathered(down, down_format, flat_ids), act, weights).to(x.dtype)


def _gathered(weight, fmt: Format, flat_ids: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
    """Rows `rows` of each slot's expert in float32 [T*k, n, K]: gathered first, then dequantized, so that under
    torch.compile only the routed experts' packed words are read."""
    if fmt is None:
        return weight[:, rows][flat_ids].float()
    return dequantized_rows(*(t[:, rows][flat_ids] for t in weight), *fmt)

"""FP8 (e4m3) weights with one float32 scale per output row, multiplied through row-wise `scaled_mm`, or, in a
compiled step at one token, read as FP8 inside one reduction (weight-only).

Weights: `w ~= w_fp8 * scale`, scale [N, 1] = amax(|row|) / 448. Activations: one scale per token row, quantized
once per input and shared by every projection that reads it (pass `x_quant` to `Fp8Linear`): quantizing the
activation per call, as separate ops, costs as much as FP8 saves on the weight read. Where the probe finds no row-wise
`scaled_mm` kernel, the fallback dequantizes in float32 (correct, slow: the reference, not a fast path).

A compiled step at one token (decode at batch 1) reads FP8 weights in the weight-only form: each FP8 weight
widened inside the reduction that accumulates in float32, the row scale applied after it, no activation
quantization; inductor emits it as one reduction kernel (Triton on CUDA, Metal on MPS, C++ on the CPU). It reads
the weight at least as fast as `scaled_mm` once CUDA's block sizes are tuned (compat.tune_generated_kernels) and
saves the activation's quantization kernels, with or without CUDA graphs (docs/PERF.md, session 31). Eager it
would materialize [M, N, K], so it runs only under torch.compile, where the probe found the FP8 widening on the
device (StepPlan.fp8_weight_only).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from server.kernels import compat
from server.kernels.capabilities import fast_path_failed, with_fallback
from server.kernels.gemv import stored
from server.kernels.plan import StepPlan

FP8_DTYPE = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_MIN_SCALE = 1e-12 / FP8_MAX  # an all-zero row gets a tiny scale, not a division by zero
_ROW_CHUNK = 4096  # rows quantized at a time, so the float32 copy of a big weight never exists whole
# Up to this many tokens a compiled step may read FP8 weights in its own reduction; beyond, the weight would be
# re-read per token. One: the batch-1 decode graph is traced apart, so it adds no graph.
WEIGHT_ONLY_MAX_TOKENS = 1


def quantize_fp8_rowwise(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (w_fp8 [N, K] float8_e4m3fn, scale [N, 1] float32), w ~= w_fp8 * scale."""
    weight_fp8 = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
    scale = torch.empty(weight.shape[0], 1, dtype=torch.float32, device=weight.device)
    for start in range(0, weight.shape[0], _ROW_CHUNK):
        rows = slice(start, start + _ROW_CHUNK)
        weight_fp8[rows], scale[rows] = _quantize_rows(weight[rows])
    return weight_fp8, scale


def _quantize_rows(values: torch.Tensor, opaque_cast: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    values = values.float()
    scale = (values.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(_MIN_SCALE)  # [rows, 1]
    return fp8_cast((values / scale).clamp(-FP8_MAX, FP8_MAX), FP8_DTYPE, opaque_cast), scale


def quantize_activation(x: torch.Tensor, opaque_cast: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] -> (x_fp8 [M, K], x_scale [M, 1] float32) with M = prod(leading dims); one scale per token.
    `opaque_cast`: StepPlan.opaque_fp8_casts."""
    return _quantize_rows(x.reshape(-1, x.shape[-1]), opaque_cast)


@torch.library.custom_op("mps_serve::fp8_cast", mutates_args=())
def _opaque_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype)


@_opaque_cast.register_fake
def _opaque_cast_shape(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_like(x, dtype=dtype)


def fp8_cast(x: torch.Tensor, dtype: torch.dtype, opaque: bool) -> torch.Tensor:
    """x.to(dtype), to or from float8. `opaque` (StepPlan.opaque_fp8_casts): as one op inductor calls rather than
    generates (its Metal backend has no float8 type), which runs the device's own cast kernel."""
    return torch.ops.mps_serve.fp8_cast(x, dtype) if opaque else x.to(dtype)


def fp8_linear(
    x_fp8: torch.Tensor,  # [M, K] float8_e4m3fn
    x_scale: torch.Tensor,  # [M, 1] float32
    w_fp8: torch.Tensor,  # [N, K] float8_e4m3fn
    w_scale: torch.Tensor,  # [N, 1] float32
    bias: torch.Tensor | None,  # [N] in out_dtype
    out_dtype: torch.dtype,
    plan: StepPlan,
) -> torch.Tensor:
    """(x_fp8 * x_scale) @ (w_fp8 * w_scale).T + bias -> [M, N] in out_dtype: row-wise scaled_mm where the plan
    has it (the bias fused where that runs too), else the reference."""
    device, catch = x_fp8.device, plan.catch_fast_path_failures

    def scaled_mm(fused_bias: torch.Tensor | None) -> torch.Tensor:
        return compat.scaled_mm_rowwise(x_fp8, w_fp8.t(), x_scale, w_scale.view(1, -1), fused_bias, out_dtype,
                                        plan.private_ops)

    def reference() -> torch.Tensor:
        return fp8_linear_reference(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype)

    if bias is not None and plan.fp8_rowwise_bias and not fast_path_failed(device, "fp8_rowwise_bias"):
        return with_fallback(device, "fp8_rowwise_bias", lambda: scaled_mm(bias), reference, catch)
    if plan.fp8_rowwise:
        unfused = (lambda: scaled_mm(None)) if bias is None else (lambda: scaled_mm(None) + bias)
        return with_fallback(device, "fp8_rowwise", unfused, reference, catch)
    return reference()


def fp8_linear_reference(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype):
    """Twin of fp8_linear: dequantize both operands to float32 and multiply."""
    out = (x_fp8.float() * x_scale) @ (w_fp8.float() * w_scale).t()  # [M, N]
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def use_weight_only(plan: StepPlan, num_tokens) -> bool:
    """Whether a linear reads its FP8 weight in the weight-only reduction: at one token where the plan has the form
    (StepPlan.fp8_weight_only: a compiled step, where the device widens FP8)."""
    return plan.fp8_weight_only and num_tokens <= WEIGHT_ONLY_MAX_TOKENS


def has_fp8_linears(model: nn.Module) -> bool:
    return any(isinstance(module, Fp8Linear) for module in model.modules())


def fp8_weight_only_linear(
    x: torch.Tensor,  # [M, K] in the model dtype
    w_fp8: torch.Tensor,  # [N, K] float8_e4m3fn
    w_scale: torch.Tensor,  # [N, 1] float32
    bias: torch.Tensor | None,  # [N]
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """x @ (w_fp8 * w_scale).T + bias -> [M, N]: one reduction over K reading the weight as FP8 (see the module
    docstring: for torch.compile)."""
    # x stored first and the output after: else inductor inlines x's producer (a norm, attention's combine) into
    # the reduction, recomputed per output row, and the scaled output into each reader
    x = stored(x)
    out = (x.float().unsqueeze(1) * w_fp8.float().unsqueeze(0)).sum(-1) * w_scale.view(1, -1)  # [M, N]
    if bias is not None:
        out = out + bias.float()
    return stored(out.to(out_dtype))


def fp8_weight_only_reference(x, w_fp8, w_scale, bias, out_dtype):
    """Twin of fp8_weight_only_linear: the weight dequantized to float32, one matmul."""
    out = x.float() @ (w_fp8.float() * w_scale).t()  # [M, N]
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def blockwise_to_rowwise(
    weight_fp8: torch.Tensor,  # [N, K] float8_e4m3fn, Hugging Face `quant_method: fp8` checkpoint
    scale_inv: torch.Tensor,  # [ceil(N / bn), ceil(K / bk)] float32, the checkpoint's `weight_scale_inv`
    block_size: tuple[int, int] = (128, 128),  # the checkpoint's `weight_block_size`
) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-quantize a block-scaled FP8 weight to one scale per row (dequantize a chunk of rows at a time)."""
    block_rows, block_cols = block_size
    num_rows, num_cols = weight_fp8.shape
    out_fp8 = torch.empty_like(weight_fp8)
    scale = torch.empty(num_rows, 1, dtype=torch.float32, device=weight_fp8.device)
    chunk = max(block_rows, _ROW_CHUNK // block_rows * block_rows)  # whole blocks per chunk
    for start in range(0, num_rows, chunk):
        rows = slice(start, min(start + chunk, num_rows))
        block_scale = scale_inv[start // block_rows : math.ceil(rows.stop / block_rows)].float()
        block_scale = block_scale.repeat_interleave(block_rows, 0)[: rows.stop - start]
        block_scale = block_scale.repeat_interleave(block_cols, 1)[:, :num_cols]  # [rows, K]
        out_fp8[rows], scale[rows] = _quantize_rows(weight_fp8[rows].float() * block_scale)
    return out_fp8, scale


class Fp8Linear(nn.Module):
    """A linear layer whose weight is FP8 with per-row scales; the bias stays in the model dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=torch.bfloat16, device=None):
        super().__init__()
        if FP8_DTYPE is None:
            raise TypeError("this torch build has no float8_e4m3fn; FP8 quantization needs torch >= 2.1")
        self.in_features, self.out_features, self.out_dtype = in_features, out_features, dtype
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, 1, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None)

    def forward(self, x: torch.Tensor, plan: StepPlan,
                x_quant: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x [..., K] -> [..., N]; pass `x_quant = quantize_activation(x)` to share it between layers."""
        x_rows = x.reshape(-1, self.in_features)  # [M, K]
        if x_quant is None and use_weight_only(plan, x_rows.shape[0]):
            out = fp8_weight_only_linear(x_rows, self.weight, self.weight_scale, self.bias, self.out_dtype)
            return out.view(*x.shape[:-1], self.out_features)
        x_fp8, x_scale = x_quant if x_quant is not None else quantize_activation(x, plan.opaque_fp8_casts)
        out = fp8_linear(x_fp8, x_scale, self.weight, self.weight_scale, self.bias, self.out_dtype, plan)
        return out.view(*x.shape[:-1], self.out_features)

    @torch.no_grad()
    def load_rows(self, rows: slice, tensor: torch.Tensor) -> None:
        """Quantize a checkpoint tensor and copy it into rows `rows` (one part of a fused qkv / gate_up)."""
        weight_fp8, scale = quantize_fp8_rowwise(tensor.to(self.weight.device))
        self.weight[rows].copy_(weight_fp8)
        self.weight_scale[rows].copy_(scale)

    @torch.no_grad()
    def copy_from(self, linear: nn.Linear) -> None:
        """Quantize a model-dtype linear's weight (and copy its bias) into this layer of the same shape."""
        self.load_rows(slice(0, self.out_features), linear.weight)
        if linear.bias is not None:
            self.bias.copy_(linear.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

"""Affine group quantization (MLX's format): our pack / quantize / dequantize equal mx.quantize and mx.dequantize
bit for bit on fresh random inputs; every form of the products equals its reference twin."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from server.kernels import affine
from server.kernels.moe import moe_experts_reference
from server.kernels.plan import step_plan

mx = pytest.importorskip("mlx.core")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FORMATS = [(gs, bits) for gs in affine.GROUP_SIZES for bits in affine.SUPPORTED_BITS]


def to_mx(t: torch.Tensor):
    if t.dtype == torch.bfloat16:
        return mx.array(t.float().numpy()).astype(mx.bfloat16)
    return mx.array(t.numpy())


def from_mx(a) -> torch.Tensor:
    if a.dtype == mx.bfloat16:
        return torch.from_numpy(np.array(a.astype(mx.float32))).to(torch.bfloat16)
    if a.dtype == mx.uint32:
        return torch.from_numpy(np.array(a).view(np.int32)).view(torch.uint32)
    return torch.from_numpy(np.array(a))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32) if a.dtype == torch.uint32
                                                                     else a, b.view(torch.int32)
                                                                     if b.dtype == torch.uint32 else b)


def random_weight(shape, dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    magnitude = 10 ** (torch.rand((), generator=gen).item() * 4 - 3)  # 1e-3 .. 10
    w = torch.randn(shape, generator=gen) * magnitude
    if seed % 4 == 0:
        w = w.abs()  # one-signed groups: the bias is the edge nearest zero
    if seed % 7 == 0:
        w[0, :64] = 0.0  # an all-zero group
    return w.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group_size,bits", FORMATS)
def test_quantize_equals_mlx_bit_for_bit(group_size, bits, dtype):
    for seed in range(4):
        w = random_weight((24, 384), dtype, seed + 10 * bits + group_size)
        q, scales, biases = affine.quantize_affine(w, group_size, bits)
        mq, ms, mb = mx.quantize(to_mx(w), group_size=group_size, bits=bits)
        assert q.shape == (24, 384 * bits // 32) and scales.shape == (24, 384 // group_size)
        assert same_bits(q, from_mx(mq))
        assert same_bits(scales, from_mx(ms)) and same_bits(biases, from_mx(mb))
        ours = affine.dequantize_affine(q, scales, biases, group_size, bits)
        theirs = from_mx(mx.dequantize(mq, ms, mb, group_size=group_size, bits=bits))
        assert same_bits(ours, theirs)


@pytest.mark.parametrize("bits", affine.SUPPORTED_BITS)
def test_pack_unpack_round_trip_and_layout(bits):
    gen = torch.Generator().manual_seed(bits)
    values = torch.randint(0, 2**bits, (3, 5, 64), generator=gen, dtype=torch.int32)
    packed = affine.pack(values, bits)
    assert packed.dtype == torch.uint32 and packed.shape == (3, 5, 64 * bits // 32)
    assert torch.equal(affine.unpack(packed, bits), values)
    word = packed.view(torch.int32)[0, 0, 0].item() & 0xFFFFFFFF  # little-endian: the first value lowest
    assert word & (2**bits - 1) == values[0, 0, 0].item()
    assert word >> (32 - bits) == values[0, 0, 32 // bits - 1].item()


def test_dequantize_of_mlx_tensors_3d_and_refusals():
    w = random_weight((4, 16, 128), torch.bfloat16, 3)  # stacked experts
    mq, ms, mb = mx.quantize(to_mx(w), group_size=32, bits=4)
    ours = affine.dequantize_affine(from_mx(mq), from_mx(ms), from_mx(mb), 32, 4)
    assert same_bits(ours, from_mx(mx.dequantize(mq, ms, mb, group_size=32, bits=4)))
    with pytest.raises(ValueError, match="3 bits"):
        affine.quantize_affine(w, 64, 3)
    with pytest.raises(ValueError, match="group size 16"):
        affine.quantize_affine(w, 16, 4)
    with pytest.raises(ValueError, match="multiple of the group size"):
        affine.quantize_affine(w[..., :96], 64, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group_size,bits", [(32, 4), (64, 8), (128, 4)])
def test_linear_forms_equal_the_reference(group_size, bits, dtype):
    w = random_weight((48, 256), torch.float32, 5)
    q, scales, biases = affine.quantize_affine(w.to(dtype), group_size, bits)
    bias = torch.randn(48).to(dtype)
    dense = affine.dequantize_affine(q, scales, biases, group_size, bits).float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for shape in [(1, 256), (3, 7, 256)]:
        x = torch.randn(shape).to(dtype)
        expected = x.float() @ dense.t() + bias.float()
        for form in affine.LINEAR_FORMS:
            out = affine.affine_linear(x, q, scales, biases, group_size, bits, bias, form=form)
            assert out.dtype == dtype and out.shape == (*shape[:-1], 48)
            assert torch.allclose(out.float(), expected, rtol=tol, atol=tol * expected.abs().max().item()), form
    with pytest.raises(ValueError, match="form"):
        affine.affine_linear(x, q, scales, biases, group_size, bits, form="fast")


def test_embedding_rows_equal_mlx():
    w = random_weight((50, 128), torch.bfloat16, 6)
    q, scales, biases = affine.quantize_affine(w, 64, 4)
    ids = torch.tensor([[3, 49, 0], [3, 7, 7]])
    rows = affine.affine_embedding(ids, q, scales, biases, 64, 4)
    table = from_mx(mx.dequantize(*mx.quantize(to_mx(w), group_size=64, bits=4), group_size=64, bits=4))
    assert same_bits(rows, table[ids])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_tokens", [1, 5])
@pytest.mark.parametrize("parts", ["both", "gate_up only", "down 8-bit"])
def test_expert_forms_equal_the_dense_reference(num_tokens, dtype, parts):
    """Experts packed, partly packed (mlx-lm leaves a down projection the group does not divide in the model dtype)
    or with a format of their own per projection: both forms equal the dense product of the same weights."""
    gen = torch.Generator().manual_seed(num_tokens)
    num_experts, hidden, inter, top_k = 6, 64, 32, 2
    gate_up_w = (0.2 * torch.randn(num_experts, 2 * inter, hidden, generator=gen)).to(dtype)
    down_w = (0.2 * torch.randn(num_experts, hidden, inter, generator=gen)).to(dtype)
    gate_up_fmt, down_fmt = (32, 4), {"both": (32, 4), "gate_up only": None, "down 8-bit": (32, 8)}[parts]
    gate_up = affine.quantize_affine(gate_up_w, *gate_up_fmt)
    down = down_w if down_fmt is None else affine.quantize_affine(down_w, *down_fmt)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=gen), -1).to(dtype)
    expert_ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    dense = moe_experts_reference(x, weights, expert_ids, affine.dequantize_affine(*gate_up, *gate_up_fmt),
                                  down if down_fmt is None else affine.dequantize_affine(*down, *down_fmt))
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for form in affine.EXPERT_FORMS:
        out = affine.affine_experts(x, weights, expert_ids, gate_up, down, gate_up_fmt, down_fmt, form,
                                    step_plan("cpu", dtype))
        assert out.dtype == dtype and out.shape == x.shape
        assert torch.allclose(out.float(), dense.float(), rtol=tol, atol=tol * dense.abs().max().item()), form

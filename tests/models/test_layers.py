"""Shared layers against their Hugging Face twins, bit for bit in the low-precision dtypes models run in."""

from __future__ import annotations

import pytest
import torch

from server.models.layers import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_rms_norm_matches_transformers(dtype, zero_centered):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    gen = torch.Generator().manual_seed(int(zero_centered) * 10 + dtype.itemsize)
    x = (3 * torch.randn(37, 256, generator=gen)).to(dtype)
    weight = 0.1 * torch.randn(256, generator=gen) + (0.0 if zero_centered else 1.0)
    ref = Qwen3NextRMSNorm(256, eps=1e-6) if zero_centered else LlamaRMSNorm(256, eps=1e-6)
    ours = RMSNorm(256, eps=1e-6, zero_centered=zero_centered)
    with torch.no_grad():
        ref.weight.copy_(weight)
        ours.weight.copy_(weight)
        ref, ours = ref.to(dtype), ours.to(dtype)
        expected, got = ref(x), ours(x)
    assert got.dtype == expected.dtype == dtype
    assert torch.equal(got, expected)

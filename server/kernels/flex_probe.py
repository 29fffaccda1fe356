"""Whether flex decode compiles and is right on a device: compiled there on a small paged cache and compared with
the gathered SDPA decode (kernels.paged_attention), which is why it is a module of its own."""

from __future__ import annotations

import functools

import torch

from server.kernels.flex_decode import decode_block_mask, flex_attention, flex_decode_attention
from server.kernels.paged_attention import gathered_decode_attention
from server.kernels.plan import step_plan


@functools.cache
def probe_compiled(device: str, dtype: torch.dtype, block_size: int) -> tuple[bool, str]:
    """Compile flex decode on `device` (static batch 2, grouped heads, sequences over shuffled blocks ending in
    partial blocks) and compare it with the gathered SDPA decode in fp32 -> (ok, reason). Once per process."""
    if flex_attention is None:
        return False, f"torch {torch.__version__} has no FlexAttention"
    gen = torch.Generator().manual_seed(0)
    num_blocks, kv_heads, head_dim = 24, 2, 64
    k_cache, v_cache = (torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen) for _ in range(2))
    q = torch.randn(2, 2 * kv_heads, head_dim, generator=gen)
    tables = (torch.randperm(num_blocks - 1, generator=gen)[:8] + 1).view(2, 4)
    positions = torch.tensor([block_size + 2, 3 * block_size + block_size // 2])
    scale = head_dim**-0.5
    expected = gathered_decode_attention(q, k_cache, v_cache, tables, positions, scale)
    plan = step_plan(device, dtype, traced=True)

    def step(q, k_cache, v_cache, tables, positions):
        mask = decode_block_mask(tables, positions, block_size, k_cache.shape[0] * block_size, plan.flex_listed_blocks)
        return flex_decode_attention(q, k_cache, v_cache, mask, scale, plan.flex_kv_tile)

    try:
        args = [t.to(device, dtype) for t in (q, k_cache, v_cache)] + [t.to(device) for t in (tables, positions)]
        got = torch.compile(step, fullgraph=True, dynamic=False)(*args).float().cpu()
    except Exception as exc:  # noqa: BLE001 - any failure means: not usable here, and why
        return False, f"compiling it failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    error = (got - expected).abs().max().item()
    tolerance = 1e-3 if dtype == torch.float32 else 3e-2
    if not error <= tolerance:
        return False, f"compiled, it is wrong here (max error {error:.3g} > {tolerance:g} against the reference)"
    return True, f"compiled and right (max error {error:.2g})"

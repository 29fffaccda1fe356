"""Gated DeltaNet (Qwen3-Next, Qwen3.5/3.6) and the causal depthwise conv of the hybrid layers, with state.

Every op takes a padded batch of rows `[B, L, ...]` (rows padded at the end) and a per-row state, and returns
the outputs and the new state, so chunked prefill continues exactly where the previous chunk stopped and decode
rows at different positions share one call. No host sync anywhere: lengths stay on the device.

Gated delta rule per value head, state S [dk, dv] in fp32 (q, k L2-normalised, q scaled by dk^-0.5):

    S <- exp(g_t) S ;  u_t = beta_t (v_t - S^T k_t) ;  S <- S + k_t u_t^T ;  o_t = S^T q_t

Prefill uses the chunked form (chunk 64): inside a chunk the T delta updates are one unit-lower triangular
solve (the WY/UT transform), between chunks a short loop carries S. A padded position must have g = 0 and
beta = 0: it then leaves S untouched. `gated_delta_rule_reference` is the token-by-token twin.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64  # tokens per chunk of the prefill form


def causal_conv1d(
    x: torch.Tensor,  # [B, L, C]
    weight: torch.Tensor,  # [C, K]
    state: torch.Tensor,  # [B, C, K-1]: the K-1 inputs before x[:, 0]
    lengths: torch.Tensor,  # [B] int64: valid tokens per row
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv (no bias, no activation) -> (y [B, L, C], new state [B, C, K-1] of the last K-1
    valid inputs of each row)."""
    num_rows, seq_len, channels = x.shape
    kernel = weight.shape[-1]
    xs = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [B, C, K-1+L]
    if seq_len == 1:
        y = (xs * weight).sum(-1, keepdim=True)  # [B, C, 1]: decode, one dot product per channel
    else:
        y = F.conv1d(xs, weight.unsqueeze(1), groups=channels)  # [B, C, L]
    index = lengths[:, None] + torch.arange(kernel - 1, device=x.device)  # [B, K-1]
    new_state = xs.gather(2, index[:, None, :].expand(num_rows, channels, kernel - 1))
    return y.transpose(1, 2), new_state.to(state.dtype)


def causal_conv1d_reference(x, weight, state, lengths):
    """Token-by-token twin of causal_conv1d (host loops, fp32 accumulation)."""
    num_rows = x.shape[0]
    y = torch.zeros_like(x)
    new_state = state.clone()
    for row in range(num_rows):
        window = state[row].float().clone()  # [C, K-1]
        for t in range(int(lengths[row])):
            full = torch.cat([window, x[row, t].float()[:, None]], dim=-1)  # [C, K]
            y[row, t] = (full * weight.float()).sum(-1).to(x.dtype)
            window = full[:, 1:]
        new_state[row] = window.to(state.dtype)
    return y, new_state


def _normalize_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 L2 norm (eps 1e-6, as FLA/HF), q scaled by dk^-0.5, key heads repeated to the value heads. q and k
    heads are normed as one tensor: one reduction kernel in the compiled step where each took one."""
    qk = torch.cat((q, k), dim=-2).float()
    q, k = (qk * torch.rsqrt((qk * qk).sum(-1, keepdim=True) + 1e-6)).split([q.shape[-2], k.shape[-2]], -2)
    q = q * q.shape[-1] ** -0.5
    ratio = num_v_heads // k.shape[-2]
    if ratio > 1:
        q, k = q.repeat_interleave(ratio, dim=-2), k.repeat_interleave(ratio, dim=-2)
    return q, k


def chunk_gated_delta_rule(
    q: torch.Tensor,  # [B, L, Hk, dk]
    k: torch.Tensor,  # [B, L, Hk, dk]
    v: torch.Tensor,  # [B, L, Hv, dv]
    g: torch.Tensor,  # [B, L, Hv] log decay (<= 0)
    beta: torch.Tensor,  # [B, L, Hv]
    state: torch.Tensor,  # [B, Hv, dk, dv] fp32
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked prefill -> (o [B, L, Hv, dv] in v.dtype, new state [B, Hv, dk, dv] fp32)."""
    out_dtype = v.dtype
    num_rows, seq_len, num_v_heads, v_dim = v.shape
    q, k = _normalize_qk(q, k, num_v_heads)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v.float()))  # [B, Hv, L, d]
    g, beta = g.float().transpose(1, 2), beta.float().transpose(1, 2)  # [B, Hv, L]
    pad = (-seq_len) % chunk_size
    if pad:  # compiled, this specializes on pad == 0 (as the contiguity checks below do): warm_up covers both
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    num_chunks = (seq_len + pad) // chunk_size
    if num_chunks == 1:  # compiled: one chunk or several is decided here, by a dynamo guard. Left to inductor
        num_chunks = 1  # (one graph, specialized to 1 on a one-chunk first call), an FX-graph-cache hit in a new
        # process did not bring that guard back (torch 2.13): a warm restart ran the one-chunk code on two chunks

    def chunked(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(num_rows, num_v_heads, num_chunks, chunk_size, *t.shape[3:])

    q, k, v, g, beta = (chunked(t) for t in (q, k, v, g, beta))  # [B, Hv, n, C, d] / [B, Hv, n, C]
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    cum = g.cumsum(-1)  # [B, Hv, n, C]
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()  # [.., C, C]
    # (I + strictly-lower(beta_i k_i.k_j decay_ij)) U = V_beta: the T delta updates of a chunk at once.
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)  # [.., C, dv]
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay  # [.., C, C], causal incl. the diagonal
    q_decayed = q * cum.exp().unsqueeze(-1)
    k_decayed = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [B, Hv, n, 1, 1]
    o, s = _carry_across_chunks(u, w, q_decayed, intra, k_decayed, chunk_decay, state.float())
    o = o.reshape(num_rows, num_v_heads, -1, v_dim)[:, :, :seq_len]
    return o.transpose(1, 2).to(out_dtype), s


@torch.compiler.disable
def _carry_across_chunks(u, w, q_decayed, intra, k_decayed, chunk_decay, s):
    """The short loop that carries S from chunk to chunk -> (o [B, Hv, n, C, dv], final S).

    Eager even inside torch.compile (compile_prefill): unrolled, the loop made one graph per number of chunks and
    the whole model one graph (CPU, 12 tiny layers: 124 s per new chunk count); broken here, each decoder layer
    compiles once for all layers and lengths (46 s). It costs a few small eager matmuls per chunk and layer."""
    outs = []
    for i in range(u.shape[2]):
        v_new = u[:, :, i] - w[:, :, i] @ s  # [B, Hv, C, dv]
        outs.append(q_decayed[:, :, i] @ s + intra[:, :, i] @ v_new)
        s = s * chunk_decay[:, :, i] + k_decayed[:, :, i].transpose(-1, -2) @ v_new
    return torch.stack(outs, dim=2), s


def recurrent_gated_delta_step(q, k, v, g, beta, state) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode (L = 1): same signature and result as chunk_gated_delta_rule, as batched mat-vecs."""
    out_dtype = v.dtype
    q, k = _normalize_qk(q[:, 0], k[:, 0], v.shape[-2])  # [B, Hv, dk]
    v, g, beta = v[:, 0].float(), g[:, 0].float(), beta[:, 0].float()  # [B, Hv, dv], [B, Hv]
    s = state.float() * g.exp()[..., None, None]  # [B, Hv, dk, dv]
    predicted = (k.unsqueeze(-2) @ s).squeeze(-2)  # [B, Hv, dv] = S^T k
    delta = (v - predicted) * beta.unsqueeze(-1)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    o = (q.unsqueeze(-2) @ s).squeeze(-2)  # [B, Hv, dv]
    return o.unsqueeze(1).to(out_dtype), s


def gated_delta_decode_(q, k, v, g, beta, state_t_cache: torch.Tensor, slots: torch.Tensor,
                        fused: bool) -> torch.Tensor:
    """Decode (L = 1) for rows whose states live transposed in `state_t_cache [num_slots, Hv, dv, dk]` (S^T) at
    `slots [B]`: returns o [B, 1, Hv, dv] and updates those states in place.

    The cache holds S^T so that both products reduce over the contiguous dim. `fused` (StepPlan.fused_state_update:
    a compiled step) is written so inductor reads each state once for both products and once for the update,
    fusing the slot gather into them and writing back in place (index_put_ on the cache itself, as the KV write):
    o = S_new^T q = exp(g) S^T q + (q.k) u. Else (eager) the batched mat-vec form plus one index_copy_."""
    if not fused:
        out, new_state = recurrent_gated_delta_step(q, k, v, g, beta, state_t_cache[slots].transpose(-1, -2))
        state_t_cache.index_copy_(0, slots, new_state.transpose(-1, -2).to(state_t_cache.dtype))
        return out
    out_dtype = v.dtype
    q, k = _normalize_qk(q[:, 0], k[:, 0], v.shape[-2])  # [B, Hv, dk]
    v, beta = v[:, 0].float(), beta[:, 0].float()  # [B, Hv, dv], [B, Hv]
    decay = g[:, 0].float().exp()[..., None]  # [B, Hv, 1]
    state_t = state_t_cache[slots].float()  # [B, Hv, dv, dk]: folded into its two consumers below
    predicted = (state_t * k[:, :, None, :]).sum(-1) * decay  # [B, Hv, dv] = (exp(g) S)^T k
    seen = (state_t * q[:, :, None, :]).sum(-1) * decay  # [B, Hv, dv] = (exp(g) S)^T q
    update = (v - predicted) * beta[..., None]  # [B, Hv, dv]
    out = seen + (q * k).sum(-1, keepdim=True) * update
    new_state_t = state_t * decay[..., None] + update[..., None] * k[:, :, None, :]
    state_t_cache.index_put_((slots,), new_state_t.to(state_t_cache.dtype))
    return out.unsqueeze(1).to(out_dtype)


def gated_delta_rule(q, k, v, g, beta, state, chunk_size: int = CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrent step for decode batches (static L = 1), the chunked form otherwise."""
    if q.shape[1] == 1:
        return recurrent_gated_delta_step(q, k, v, g, beta, state)
    return chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size)


def gated_delta_rule_reference(q, k, v, g, beta, state) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token twin, written as the recurrence reads (elementwise sums, fp32)."""
    out_dtype, ratio = v.dtype, v.shape[-2] // k.shape[-2]
    q = q.float() / torch.sqrt((q.float() ** 2).sum(-1, keepdim=True) + 1e-6) / q.shape[-1] ** 0.5
    k = k.float() / torch.sqrt((k.float() ** 2).sum(-1, keepdim=True) + 1e-6)
    q, k = q.repeat_interleave(ratio, dim=2), k.repeat_interleave(ratio, dim=2)  # value head h reads key h // r
    v, g, beta = v.float(), g.float(), beta.float()
    s = state.float().clone()  # [B, Hv, dk, dv]
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for t in range(v.shape[1]):
        s = s * g[:, t].exp()[..., None, None]
        predicted = (s * k[:, t, :, :, None]).sum(-2)  # [B, Hv, dv]
        delta = (v[:, t] - predicted) * beta[:, t, :, None]
        s = s + k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = (s * q[:, t, :, :, None]).sum(-2)
    return out.to(out_dtype), s

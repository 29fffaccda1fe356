"""Layers of the hybrid architectures (LFM2 short-conv, Qwen3-Next / Qwen3.5 Gated DeltaNet), written once.

A hybrid decoder has two kinds of token mixer: attention layers over the paged KV cache, and state layers
(ShortConv, GatedDeltaNet) that keep a fixed-size state per sequence in the engine's state pool
(`meta.state_caches[j]`: tensors `[num_slots, ...]`, row `meta.state_slots[r]` for sequence row r).
State layers work on the padded `[num_seqs, max_q_len]` view of the step's flat tokens; a row's padding
never reaches its state (conv: the new state is gathered at the row's length; GDN: g = beta = 0).
"""

from __future__ import annotations

import logging
import re

import torch
import torch.nn.functional as F
from torch import nn

from server.kernels import gated_delta
from server.kernels import moe as moe_ops
from server.kernels.gemv import RowReductionLinear
from server.kernels.paged_attention import paged_attention, write_kv
from server.kernels.plan import StepPlan
from server.models.base import ATTENTION, AttentionMetadata
from server.models.layers import (
    Attention,
    CausalLM,
    DecoderLayer,
    FusedExperts,
    GatedMLP,
    Linear,
    MergedLinear,
    RMSNorm,
    apply_rope,
    norm_q_and_k_heads,
)

log = logging.getLogger(__name__)

STATE_LAYER_TYPES = ("conv", "linear_attention")


def default_layer_types(num_layers: int, full_attention_interval: int) -> list[str]:
    """Qwen3-Next / Qwen3.5: every `interval`-th layer (1-based) is attention, the rest Gated DeltaNet."""
    return [ATTENTION if (i + 1) % full_attention_interval == 0 else "linear_attention" for i in range(num_layers)]


def _padded(x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Flat [num_tokens, ...] -> padded rows [num_seqs, max_q_len, ...]."""
    return x.unsqueeze(1) if meta.is_decode else x[meta.query_index]


def _flat(x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Padded rows [num_seqs, max_q_len, ...] -> flat [num_tokens, ...]."""
    return x.squeeze(1) if meta.is_decode else x[meta.token_rows, meta.token_cols]


def _valid_mask(meta: AttentionMetadata, max_q_len: int) -> torch.Tensor:
    """[num_seqs, max_q_len] bool: which padded positions hold a real token."""
    cols = torch.arange(max_q_len, device=meta.query_lens.device)
    return cols[None, :] < meta.query_lens[:, None]


class ShortConv(nn.Module):
    """LFM2 `conv` operator: B, C, x = in_proj(h); y = out_proj(C * conv(B * x)), conv causal depthwise."""

    def __init__(self, hidden_size: int, kernel_size: int):
        super().__init__()
        self.hidden_size, self.kernel_size = hidden_size, kernel_size
        self.in_proj = Linear(hidden_size, 3 * hidden_size, bias=False)
        self.conv = nn.Conv1d(hidden_size, hidden_size, kernel_size, groups=hidden_size, bias=False)  # weight only
        self.out_proj = RowReductionLinear(hidden_size, hidden_size, bias=False)

    def state_shapes(self) -> list[tuple[tuple[int, ...], torch.dtype | None]]:
        return [((self.hidden_size, self.kernel_size - 1), None)]  # conv state of B*x, model dtype

    def forward(self, x, rope, meta: AttentionMetadata, state, plan: StepPlan) -> torch.Tensor:
        (conv_cache,) = state
        b, c, xx = self.in_proj(x, plan).chunk(3, dim=-1)
        slots = meta.state_slots
        y, new_state = gated_delta.causal_conv1d(
            _padded(b * xx, meta), self.conv.weight.squeeze(1), conv_cache[slots], meta.query_lens
        )
        conv_cache.index_copy_(0, slots, new_state)
        return self.out_proj(c * _flat(y, meta), plan)


class GatedRMSNorm(nn.Module):
    """GDN output norm: (w * norm(x).to(dtype)) * silu(z) in fp32, cast back. Weight is plain (not 1 + w)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """Qwen3.5 / Qwen3-Next linear attention. All four input projections run as one GEMM (`in_proj`);
    Qwen3-Next's grouped `in_proj_qkvz` / `in_proj_ba` are un-grouped to the same rows while loading
    (`split_grouped_projections`)."""

    traces_whole = False  # the chunked prefill carries its state across chunks eagerly (a graph break; decode has none)

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, k_dim: int, v_dim: int, kernel_size: int, eps: float):
        super().__init__()
        self.num_k_heads, self.num_v_heads, self.k_dim, self.v_dim = num_k_heads, num_v_heads, k_dim, v_dim
        self.key_size, self.value_size = num_k_heads * k_dim, num_v_heads * v_dim
        self.conv_dim, self.kernel_size = 2 * self.key_size + self.value_size, kernel_size
        self.in_proj = MergedLinear(
            hidden_size,
            [self.conv_dim, self.value_size, num_v_heads, num_v_heads],
            ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"],
        )
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel_size, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(num_v_heads))
        self.A_log = nn.Parameter(torch.empty(num_v_heads))
        self.norm = GatedRMSNorm(v_dim, eps)
        self.out_proj = RowReductionLinear(self.value_size, hidden_size, bias=False)

    def state_shapes(self) -> list[tuple[tuple[int, ...], torch.dtype | None]]:
        return [
            ((self.conv_dim, self.kernel_size - 1), None),  # pre-conv [q|k|v], model dtype
            ((self.num_v_heads, self.v_dim, self.k_dim), torch.float32),  # recurrent state, stored as S^T
        ]

    def forward(self, x, rope, meta: AttentionMetadata, state, plan: StepPlan) -> torch.Tensor:
        conv_cache, recurrent_cache = state
        num_tokens, slots = x.shape[0], meta.state_slots
        qkv, z, b, a = self.in_proj(x, plan).split([self.conv_dim, self.value_size, self.num_v_heads, self.num_v_heads], -1)
        qkv, new_conv = gated_delta.causal_conv1d(
            _padded(qkv, meta), self.conv1d.weight.squeeze(1), conv_cache[slots], meta.query_lens
        )
        conv_cache.index_copy_(0, slots, new_conv)
        qkv = F.silu(qkv)  # [S, L, conv_dim]
        num_rows, max_q_len = qkv.shape[:2]
        q, k, v = qkv.split([self.key_size, self.key_size, self.value_size], dim=-1)
        q = q.reshape(num_rows, max_q_len, self.num_k_heads, self.k_dim)
        k = k.reshape(num_rows, max_q_len, self.num_k_heads, self.k_dim)
        v = v.reshape(num_rows, max_q_len, self.num_v_heads, self.v_dim)
        beta = _padded(b.sigmoid(), meta).float()  # [S, L, Hv]
        g = _padded(-self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias), meta)
        if not meta.is_decode:  # padding must leave the state alone: decay 1, no update
            valid = _valid_mask(meta, max_q_len)[..., None]
            beta, g = beta * valid, g * valid
        if meta.is_decode:
            out = gated_delta.gated_delta_decode_(q, k, v, g, beta, recurrent_cache, slots, plan.fused_state_update)
        else:
            state = recurrent_cache[slots].transpose(-1, -2)  # the cache holds S^T: see gated_delta_decode_
            out, new_state = gated_delta.gated_delta_rule(q, k, v, g, beta, state)
            recurrent_cache.index_copy_(0, slots, new_state.transpose(-1, -2))
        out = self.norm(_flat(out, meta), z.view(num_tokens, self.num_v_heads, self.v_dim))
        return self.out_proj(out.reshape(num_tokens, self.value_size), plan)


def gated_hybrid_layer(args, layer_type: str, ffn: nn.Module, make_norm) -> DecoderLayer:
    """A Qwen3.5 / Qwen3-Next decoder layer: gated attention (ATTENTION) or Gated DeltaNet, then `ffn`, under the
    checkpoint's names. `args`: the model's ModelArgs (the Qwen3.5 fields)."""
    if layer_type == ATTENTION:
        name = "self_attn"
        mixer = GatedAttention(
            args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim, args.rms_norm_eps
        )
    else:
        name = "linear_attn"
        mixer = GatedDeltaNet(
            args.hidden_size, args.linear_num_key_heads, args.linear_num_value_heads, args.linear_key_head_dim,
            args.linear_value_head_dim, args.linear_conv_kernel_dim, args.rms_norm_eps,
        )
    return DecoderLayer(("input_layernorm", name, "post_attention_layernorm", "mlp"), mixer, ffn, make_norm)


def split_grouped_projections(name: str, tensor: torch.Tensor, num_k_heads: int, k_dim: int, v_dim: int, ratio: int):
    """Qwen3-Next checkpoint -> Qwen3.5 layout: `in_proj_qkvz` rows [q k v(r) z(r)] per key head become
    `in_proj_qkv` [q_all|k_all|v_all] and `in_proj_z`; `in_proj_ba` rows [b(r) a(r)] per key head become
    `in_proj_b` and `in_proj_a` (value head = group * r + j). Other tensors pass through."""
    prefix, _, leaf = name.rpartition(".")
    if prefix.endswith("in_proj_qkvz"):
        base = prefix[: -len("in_proj_qkvz")]
        grouped = tensor.view(num_k_heads, 2 * k_dim + 2 * ratio * v_dim, -1)
        q, k, v, z = grouped.split([k_dim, k_dim, ratio * v_dim, ratio * v_dim], dim=1)
        qkv = torch.cat([t.reshape(-1, tensor.shape[-1]) for t in (q, k, v)])
        return [(f"{base}in_proj_qkv.{leaf}", qkv), (f"{base}in_proj_z.{leaf}", z.reshape(-1, tensor.shape[-1]))]
    if prefix.endswith("in_proj_ba"):
        base = prefix[: -len("in_proj_ba")]
        b, a = tensor.view(num_k_heads, 2 * ratio, -1).split([ratio, ratio], dim=1)
        return [(f"{base}in_proj_b.{leaf}", b.reshape(-1, tensor.shape[-1])), (f"{base}in_proj_a.{leaf}", a.reshape(-1, tensor.shape[-1]))]
    return [(name, tensor)]


class GatedAttention(nn.Module):
    """Qwen3-Next / Qwen3.5 attention: q_proj emits [q_h | gate_h] per head, zero-centred q/k norms,
    partial RoPE, output `o_proj(attn * sigmoid(gate))`."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = MergedLinear(
            hidden_size, [2 * self.q_size, self.kv_size, self.kv_size], ["q_proj", "k_proj", "v_proj"]
        )
        self.o_proj = RowReductionLinear(self.q_size, hidden_size, bias=False)
        self.q_norm = RMSNorm(head_dim, eps, zero_centered=True)
        self.k_norm = RMSNorm(head_dim, eps, zero_centered=True)

    def forward(self, x, rope, meta: AttentionMetadata, kv_cache, plan: StepPlan) -> torch.Tensor:
        num_tokens = x.shape[0]
        q_gate, k, v = self.qkv_proj(x, plan).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = q_gate.view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q, k = self._norm_rope_qk(q, k.view(num_tokens, self.num_kv_heads, self.head_dim), rope, plan)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = write_kv(kv_cache, k, v, meta.slot_mapping)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.head_dim**-0.5, plan)  # [tokens, heads, head_dim]
        out = out * torch.sigmoid(gate)
        return self.o_proj(out.reshape(num_tokens, self.q_size), plan)

    def _norm_rope_qk(self, q: torch.Tensor, k: torch.Tensor, rope, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """q_norm, k_norm, then RoPE, on the q and k heads as one tensor: one kernel for both in the compiled step
        where each took kernels of its own (q lies between the gates in q_proj's rows: joining it to k copies)."""
        qk = torch.cat((q, k), dim=1)  # [num_tokens, heads + kv_heads, head_dim]
        normed = norm_q_and_k_heads(qk, self.q_norm, self.k_norm, self.num_heads)
        return apply_rope(normed, *rope, plan.partial_rope_whole_head).split([self.num_heads, self.num_kv_heads], dim=1)


class SharedExpertMoE(nn.Module):
    """Qwen3-Next / Qwen3.5 MoE: softmax router in fp32, top-k (renormalized), plus a shared SwiGLU expert
    scaled by sigmoid(shared_expert_gate(x)).

    Where the shared expert is as wide as the routed ones (every released model), it is the experts' last slot
    (`experts.shared_slot`, filled from `shared_expert.*`: the model's `sanitize` renames them), and every token
    routes to it with that weight: its FFN then runs inside the routed experts' kernels instead of three of its
    own per layer. Otherwise it is a GatedMLP beside them."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, shared_size: int, renormalize: bool):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        if shares_expert_slot(intermediate_size, shared_size):
            self.experts = FusedExperts(num_experts + 1, hidden_size, intermediate_size, shared_slot=num_experts)
            self.shared_expert = None
        else:
            self.experts = FusedExperts(num_experts, hidden_size, intermediate_size)
            self.shared_expert = GatedMLP(hidden_size, shared_size)
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        weights, expert_ids = moe_ops.route_softmax(self.gate(x), self.top_k, self.renormalize, plan)
        shared_weight = torch.sigmoid(self._shared_gate_logit(x, plan.shared_gate_reduction))  # [T, 1]
        if self.shared_expert is not None:
            return self.experts(x, weights, expert_ids, plan) + shared_weight * self.shared_expert(x, plan)
        shared_ids = torch.full_like(expert_ids[:, :1], self.experts.shared_slot)  # [T, 1]
        return self.experts(x, torch.cat((weights, shared_weight.to(weights.dtype)), dim=-1),
                            torch.cat((expert_ids, shared_ids), dim=-1), plan)

    def _shared_gate_logit(self, x: torch.Tensor, reduction: bool) -> torch.Tensor:
        """shared_expert_gate(x) [T, 1]. `reduction` (StepPlan.shared_gate_reduction: compiled): a reduction over
        the hidden size that inductor generates with its neighbours, where a one-row linear is a BLAS call of its
        own (a dot and its reduction on CUDA)."""
        if not reduction or not isinstance(self.shared_expert_gate, nn.Linear):  # or quantized
            return self.shared_expert_gate(x)
        return (x.float() * self.shared_expert_gate.weight.float()).sum(-1, keepdim=True).to(x.dtype)


def shares_expert_slot(intermediate_size: int, shared_size: int) -> bool:
    """Whether SharedExpertMoE keeps its shared expert as the experts' last slot (same width as the routed)."""
    return shared_size == intermediate_size


def shared_expert_slot_name(name: str, args) -> str:
    """Checkpoint name -> ours for a SharedExpertMoE model (`args`: its ModelArgs): a shared expert's tensors
    (`model.layers.N.mlp.shared_expert.gate_proj.weight`, its FP8 scales too) become those of the experts' last
    slot (`model.layers.N.mlp.experts.{num_experts}.gate_proj.weight`) where the layer keeps it there."""
    match = _SHARED_EXPERT_RE.match(name)
    if match is None or not shares_expert_slot(args.moe_intermediate_size, args.shared_expert_intermediate_size):
        return name
    return f"{match['mlp']}.experts.{args.num_experts}.{match['rest']}"


_SHARED_EXPERT_RE = re.compile(r"^(?P<mlp>model\.layers\.\d+\.mlp)\.shared_expert\.(?P<rest>(gate|up|down)_proj\..+)$")


class SigmoidBiasMoE(nn.Module):
    """LFM2-MoE: sigmoid router in the model dtype; the fp32 `expert_bias` buffer only picks the experts."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool, scaling: float, use_bias: bool):
        super().__init__()
        self.top_k, self.renormalize, self.scaling = top_k, renormalize, scaling
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, per_expert_names=("w1", "w3", "w2"))
        self.use_bias = use_bias
        if use_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))

    def reset_buffers(self) -> None:
        """Keep expert_bias fp32 whatever the model dtype (the loader fills it from the checkpoint)."""
        if self.use_bias:
            self.expert_bias = torch.zeros(self.expert_bias.shape, dtype=torch.float32, device=self.expert_bias.device)

    def forward(self, x: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        bias = self.expert_bias if self.use_bias else None
        weights, expert_ids = moe_ops.route_sigmoid_bias(self.gate(x), bias, self.top_k, self.renormalize, self.scaling,
                                                        plan)
        return self.experts(x, weights, expert_ids, plan)


class HybridModel(CausalLM):
    """Decoder with attention and state layers (`args.layer_types`). Subclasses build the layers (`make_layer`)
    and the norms; `state_shapes()` lists the state layers (meta.state_caches align with them)."""

    ignored_prefixes: tuple[str, ...] = ()  # checkpoint parts that are not the text model (vision, MTP)
    shared_expert_slots = False  # SharedExpertMoE layers: their shared expert's tensors go to the experts' last slot

    def __init__(self, args):
        layer_types = args.layer_types
        unknown = sorted({t for t in layer_types if t != ATTENTION and t not in STATE_LAYER_TYPES})
        if unknown or len(layer_types) != args.num_hidden_layers:
            raise ValueError(
                f"layer_types must name each of the {args.num_hidden_layers} layers as {ATTENTION!r} or one of "
                f"{STATE_LAYER_TYPES}; got {layer_types}"
            )
        super().__init__(args, layer_types)
        self._skipped_logged: set[str] = set()

    def mixer(self, layer_idx: int) -> nn.Module:
        layer = self.model.layers[layer_idx]
        return getattr(layer, layer.names[1])

    def state_shapes(self) -> list[list[tuple[tuple[int, ...], torch.dtype | None]]]:
        """Per state layer: the per-sequence state tensors as (shape, dtype; None = model dtype)."""
        return [self.mixer(i).state_shapes() for i, t in enumerate(self.model.layer_types) if t != ATTENTION]

    def sanitize(self, name: str) -> str | None:
        """Checkpoint name -> ours; None skips it (rotary buffers, a tied lm_head, vision / MTP parts); a shared
        expert kept as the experts' last slot is renamed to it (`shared_expert_slots`)."""
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model.") :]
        for prefix in self.ignored_prefixes:
            if name.startswith(prefix):
                if prefix not in self._skipped_logged:
                    self._skipped_logged.add(prefix)
                    log.info("ignoring checkpoint tensors %s* (not part of the text model)", prefix)
                return None
        name = super().sanitize(name)
        if name is not None and self.shared_expert_slots:
            name = shared_expert_slot_name(name, self.args)
        return name


def lfm2_layer(args, layer_type: str, ffn: nn.Module, make_norm) -> DecoderLayer:
    """An LFM2 decoder layer: attention (ATTENTION) or the short conv, then `ffn`, under the checkpoint's names.
    LFM2 attention is the shared GQA layer with q/k_layernorm (plain RMSNorm) and `out_proj`. `args`: the model's
    ModelArgs (the LFM2 fields)."""
    if layer_type == ATTENTION:
        name = "self_attn"
        mixer = Attention(
            args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim,
            qk_norm_eps=args.norm_eps, o_proj_name="out_proj", q_norm_name="q_layernorm", k_norm_name="k_layernorm",
        )
    else:
        name, mixer = "conv", ShortConv(args.hidden_size, args.conv_L_cache)
    return DecoderLayer(("operator_norm", name, "ffn_norm", "feed_forward"), mixer, ffn, make_norm)

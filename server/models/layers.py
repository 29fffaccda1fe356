"""Layers shared by every architecture: norms, RoPE, paged attention, SwiGLU, fused linears, MoE, and the
decoder they make up (`DecoderLayer`, `DecoderStack`, `CausalLM`).

Attribute names follow Hugging Face so weight loading is an identity map plus the fusion table that
`MergedLinear.source_names` and `FusedExperts` declare.

Every forward takes the step plan (server.kernels.plan.StepPlan) as its last argument and hands it down: which
form an op runs is the plan's to say, not the layer's (the same model serves eager and compiled steps at once).
Projections are called `proj(x, plan)` (`Linear`); routers stay plain `nn.Linear`, which the FP8 swap skips.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from server.kernels import moe as moe_ops
from server.kernels.gemv import RowReductionLinear, stored
from server.kernels.paged_attention import paged_attention, write_kv
from server.kernels.plan import StepPlan
from server.models.base import ATTENTION, AttentionMetadata
from server.models.rope import rope_attention_factor, rope_inv_freq


class RMSNorm(nn.Module):
    """`zero_centered=False` (Llama/Qwen3/LFM2): w * norm(x).to(dtype). True (Qwen3-Next/3.5): (norm(x) * (1 + w)).to(dtype)."""

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.zero_centered = zero_centered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm normalizes in fp32 and rounds once, as Hugging Face does; it is one fused kernel in eager
        # mode where the backend has one (the prefill and the MPS paths are eager) and the same fused
        # reduction under torch.compile. HF applies w after the cast, so w stays outside.
        if self.zero_centered:
            return F.rms_norm(x.float(), x.shape[-1:], 1.0 + self.weight.float(), self.eps).to(x.dtype)
        return self.weight * F.rms_norm(x, x.shape[-1:], None, self.eps)


def norm_q_and_k_heads(qk: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm, num_q_heads: int) -> torch.Tensor:
    """q_norm on the first `num_q_heads` heads of `qk` [num_tokens, heads, head_dim] and k_norm on the others, as
    one RMSNorm whose weight row depends on the head (each rounded as RMSNorm rounds): one kernel for both in the
    compiled step."""
    weight = torch.cat((q_norm.weight.expand(num_q_heads, -1), k_norm.weight.expand(qk.shape[1] - num_q_heads, -1)))
    if q_norm.zero_centered:
        return (F.rms_norm(qk.float(), qk.shape[-1:], None, q_norm.eps) * (1.0 + weight.float())).to(qk.dtype)
    return weight * F.rms_norm(qk, qk.shape[-1:], None, q_norm.eps)


class Linear(nn.Linear):
    """nn.Linear called as every projection is, `proj(x, plan)`: a plain GEMM has no form to choose; the FP8 and
    row-reduction linears that take its place read the plan."""

    def forward(self, x: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several checkpoint projections stored as one weight (rows concatenated), read with one GEMM.

    `source_names[i]` is the checkpoint module name of the i-th row block; the loader fills the block.
    """

    def __init__(self, in_features: int, output_sizes: list[int], source_names: list[str], bias: bool = False):
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)
        self.source_names = list(source_names)

    def shard_rows(self, index: int) -> slice:
        start = sum(self.output_sizes[:index])
        return slice(start, start + self.output_sizes[index])


class RotaryEmbedding(nn.Module):
    """cos/sin for the given positions; computed once per forward and shared by every layer. As transformers
    returns them, they carry the rope type's attention factor (yarn), so attention needs no scaling of its own.

    "dynamic" (NTK) computes its frequencies per forward on the device from the step's longest position, as
    transformers does per forward call. Up to max_position_embeddings, which bounds a loaded model's
    max_model_len, that is default RoPE exactly. Past it: a whole prompt in one step equals transformers'
    forward, and a decode step at position p scales by p + 1, as transformers' generate does; cached keys keep
    the frequencies they were rotated with, there as here (a prefix-cache hit too). Sequences stepped together
    share the longest one's length, and a chunked prefill scales each chunk by its own end.
    """

    def __init__(self, head_dim: int, rope: dict):
        super().__init__()
        self.head_dim = head_dim
        self.rope = dict(rope)
        self.is_dynamic = self.rope.get("rope_type") == "dynamic"
        self.attention_factor = rope_attention_factor(self.rope)
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, self.rope, "cpu"), persistent=False)

    def reset_buffers(self) -> None:
        """Recompute after the model was materialized from the meta device."""
        self.inv_freq = rope_inv_freq(self.head_dim, self.rope, self.inv_freq.device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq
        if self.is_dynamic:
            inv_freq = rope_inv_freq(self.head_dim, self.rope, positions.device, positions.max() + 1)
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [num_tokens, rot_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)  # [num_tokens, rot_dim]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, whole_head: bool = False) -> torch.Tensor:
    """Rotate-half RoPE on the first `cos.shape[-1]` dims of each head (partial rotary passes the rest). `whole_head`
    (StepPlan.partial_rope_whole_head): partial rotary as one expression over the whole head."""
    rot_dim = cos.shape[-1]
    if rot_dim < x.shape[-1] and whole_head:
        return _apply_partial_rope_whole_head(x, cos, sin)
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    half = rot_dim // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    out = x_rot * cos[:, None, :] + rotated * sin[:, None, :]  # x: [num_tokens, heads, head_dim]
    return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out


def _apply_partial_rope_whole_head(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope's partial rotary as one expression over the whole head (cos padded with ones, sin with zeros
    over the passed dims, which come out exactly: x * 1 + 0). Compiled, the rotated part concatenated with the
    passed part is a buffer inductor stores in a kernel of its own; this form stays in the norm's kernel."""
    rot_dim, pass_dim = cos.shape[-1], x.shape[-1] - cos.shape[-1]
    half = rot_dim // 2
    rotated = torch.cat((-x[..., half:rot_dim], x[..., :half], x[..., rot_dim:]), dim=-1)
    cos_full = F.pad(cos, (0, pass_dim), value=1.0)[:, None, :]  # [num_tokens, 1, head_dim]
    sin_full = F.pad(sin, (0, pass_dim), value=0.0)[:, None, :]
    return x * cos_full + rotated * sin_full


class Attention(nn.Module):
    """GQA attention over the paged KV cache, with optional per-head q/k RMSNorm before RoPE."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qk_norm_eps: float | None = None,
        o_proj_name: str = "o_proj",
        q_norm_name: str = "q_norm",
        k_norm_name: str = "k_norm",
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = MergedLinear(
            hidden_size, [self.q_size, self.kv_size, self.kv_size], ["q_proj", "k_proj", "v_proj"]
        )
        self.o_proj_name = o_proj_name
        setattr(self, o_proj_name, RowReductionLinear(self.q_size, hidden_size, bias=False))
        self.q_norm_name, self.k_norm_name = q_norm_name, k_norm_name
        self.has_qk_norm = qk_norm_eps is not None
        if self.has_qk_norm:
            setattr(self, q_norm_name, RMSNorm(head_dim, qk_norm_eps))
            setattr(self, k_norm_name, RMSNorm(head_dim, qk_norm_eps))

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,  # [num_blocks, block_size, 2, kv_heads, head_dim]
        plan: StepPlan,
    ) -> torch.Tensor:
        num_tokens, num_qk_heads = x.shape[0], self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(x, plan).view(num_tokens, num_qk_heads + self.num_kv_heads, self.head_dim)
        qk, v = qkv[:, :num_qk_heads], qkv[:, num_qk_heads:]  # [num_tokens, heads + kv_heads | kv_heads, head_dim]
        if self.has_qk_norm:
            qk = norm_q_and_k_heads(qk, getattr(self, self.q_norm_name), getattr(self, self.k_norm_name),
                                    self.num_heads)
        # q and k heads normed and rotated together: one kernel of the compiled step instead of one per tensor
        q, k = apply_rope(qk, *rope, plan.partial_rope_whole_head).split([self.num_heads, self.num_kv_heads], dim=1)
        k_cache, v_cache = write_kv(kv_cache, k, v, meta.slot_mapping)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.head_dim**-0.5, plan)  # [tokens, heads, head_dim]
        return getattr(self, self.o_proj_name)(out.reshape(num_tokens, self.q_size), plan)


class GatedMLP(nn.Module):
    """SwiGLU `down(silu(gate(x)) * up(x))` with gate and up fused into one GEMM."""

    def __init__(self, hidden_size: int, intermediate_size: int, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        gate_name, up_name, down_name = names
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], [gate_name, up_name])
        self.down_name = down_name
        setattr(self, down_name, RowReductionLinear(intermediate_size, hidden_size, bias=False))

    def forward(self, x: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        gate, up = self.gate_up_proj(x, plan).chunk(2, dim=-1)
        return getattr(self, self.down_name)(F.silu(gate) * up, plan)


class FusedExperts(nn.Module):
    """All experts of one MoE layer: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I].

    Checkpoints store these fused (Qwen3.5) or per expert (`experts.{e}.{gate,up,down}_proj.weight`);
    `per_expert_names` declares the latter for the loader. `shared_slot`: the index of a shared expert kept as the
    last expert (SharedExpertMoE), which a fused checkpoint tensor of the routed experts does not cover.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 per_expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 shared_slot: int | None = None):
        super().__init__()
        self.num_experts, self.intermediate_size, self.shared_slot = num_experts, intermediate_size, shared_slot
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.per_expert_names = per_expert_names

    def forward(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        return moe_ops.moe_experts(x, weights, expert_ids, self.gate_up_proj, self.down_proj, plan)


class SoftmaxMoE(nn.Module):
    """Qwen3-MoE block: softmax router in fp32, top-k, optional renormalization; no shared expert."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        weights, expert_ids = moe_ops.route_softmax(self.gate(x), self.top_k, self.renormalize, plan)
        return self.experts(x, weights, expert_ids, plan)


class DecoderLayer(nn.Module):
    """Pre-norm block `h = x + mixer(norm1(x)); out = h + ffn(norm2(h))` under the checkpoint's names.
    `traces_whole`: False where the mixer's multi-token form has a deliberate graph break (models.regions)."""

    def __init__(self, names: tuple[str, str, str, str], mixer: nn.Module, ffn: nn.Module, make_norm):
        super().__init__()
        self.names = names  # (norm1, mixer, norm2, ffn)
        norm1, mixer_name, norm2, ffn_name = names
        setattr(self, norm1, make_norm())
        setattr(self, mixer_name, mixer)
        setattr(self, norm2, make_norm())
        setattr(self, ffn_name, ffn)
        self.traces_whole = getattr(mixer, "traces_whole", True)

    def forward(self, x, rope, meta, cache, plan: StepPlan):
        norm1, mixer, norm2, ffn = (getattr(self, name) for name in self.names)
        h = x + mixer(norm1(x), rope, meta, cache, plan)
        # stored: else an FFN whose readers of it compile to reductions (an MoE block's router, experts and shared
        # gate) recomputes the norm inside each of them, per output row
        return h + ffn(stored(norm2(h)), plan)


def call_layer(layer: nn.Module, x, rope, meta, cache, plan: StepPlan):
    """A decoder layer's call as a plain function: DecoderStack's `layer_call` until whoever compiles the model
    puts compiled regions in its place (models.regions.compiled_layer_regions)."""
    return layer(x, rope, meta, cache, plan)


def layer_metadata(meta: AttentionMetadata) -> AttentionMetadata:
    """What a layer sees of the step's metadata: not every state layer's caches, one of which is its own `cache`
    argument. Gated DeltaNet layers compiled as one region, each given its own state twice (there and in the
    metadata), decoded wrong tokens."""
    return meta if meta.state_caches is None else dataclasses.replace(meta, state_caches=None)


def attention_decoder_layer(args, ffn: nn.Module, make_norm, qk_norm: bool) -> DecoderLayer:
    """A Llama-style decoder layer: GQA attention (with per-head q/k RMSNorm where `qk_norm`: Qwen3), then `ffn`,
    under the checkpoint's names. `args`: the model's ModelArgs (the Llama fields)."""
    attention = Attention(args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim,
                          qk_norm_eps=args.rms_norm_eps if qk_norm else None)
    return DecoderLayer(("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"), attention, ffn, make_norm)


class DecoderStack(nn.Module):
    """`model.*` in HF naming: embed_tokens, layers, the final norm (`norm`, or `embedding_norm` in LFM2) and the
    rotary embedding; forward runs embed -> rope -> layers -> final norm.

    Layer i of type ATTENTION gets its KV cache from `kv_caches`, any other its state from `meta.state_caches`;
    each list holds its kind of layer in layer order. Each layer runs through `layer_call` (call_layer, or the
    compiled regions of models.regions).
    """

    layer_call: Callable = staticmethod(call_layer)

    def __init__(self, vocab_size: int, hidden_size: int, layers: list[nn.Module], layer_types: list[str],
                 rotary_emb: RotaryEmbedding, final_norm: nn.Module, final_norm_name: str):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(layers)
        self.final_norm_name = final_norm_name
        setattr(self, final_norm_name, final_norm)
        self.rotary_emb = rotary_emb
        self.layer_types = list(layer_types)
        # Per layer: its index into kv_caches (attention) or meta.state_caches (state layers).
        self.cache_index = [
            sum(1 for u in layer_types[:i] if (u == ATTENTION) == (t == ATTENTION)) for i, t in enumerate(layer_types)
        ]

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],  # per attention layer: [num_blocks, block_size, 2, kv_heads, head_dim]
        plan: StepPlan,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary_emb(positions, x.dtype)
        state_caches, meta = meta.state_caches, layer_metadata(meta)
        for layer, layer_type, index in zip(self.layers, self.layer_types, self.cache_index, strict=True):
            cache = kv_caches[index] if layer_type == ATTENTION else state_caches[index]
            x = self.layer_call(layer, x, rope, meta, cache, plan)
        return getattr(self, self.final_norm_name)(x)  # [num_tokens, hidden]


class CausalLM(nn.Module):
    """Decoder-only LM over the paged KV cache: `model` (a DecoderStack) and an `lm_head` (maybe tied to the
    embedding). Architectures build the layers (`make_layer`) under their checkpoint's names, and the norms
    (`make_norm`: RMSNorm of `args.rms_norm_eps`, `zero_centered_norms` as the architecture says); forward() returns
    hidden states, compute_logits() the logits. Layers are all attention unless `layer_types` says otherwise."""

    final_norm_name = "norm"
    zero_centered_norms = False

    def __init__(self, args, layer_types: list[str] | None = None):
        super().__init__()
        self.args = args
        layer_types = layer_types if layer_types is not None else [ATTENTION] * args.num_hidden_layers
        layers = [self.make_layer(i, t) for i, t in enumerate(layer_types)]
        rotary_emb = RotaryEmbedding(args.head_dim, args.rope_parameters)
        self.model = DecoderStack(
            args.vocab_size, args.hidden_size, layers, layer_types, rotary_emb, self.make_norm(), self.final_norm_name
        )
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        self.tie_weights()

    def make_layer(self, layer_idx: int, layer_type: str) -> nn.Module:
        raise NotImplementedError

    def make_norm(self) -> nn.Module:
        return RMSNorm(self.args.hidden_size, self.args.rms_norm_eps, zero_centered=self.zero_centered_norms)

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches: list[torch.Tensor],
                plan: StepPlan) -> torch.Tensor:
        return self.model(input_ids, positions, meta, kv_caches, plan)  # [num_tokens, hidden]

    def kv_cache_shapes(self) -> list[tuple[int, int]]:
        """(num_kv_heads, head_dim) of each attention layer's KV cache, in layer order."""
        return [(self.args.num_key_value_heads, self.args.head_dim)] * self.model.layer_types.count(ATTENTION)

    def tie_weights(self) -> None:
        """Share the LM head with the embedding; the loader calls this again after `to_empty`, which gives
        every module its own tensor."""
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def sanitize(self, name: str) -> str | None:
        """Map a checkpoint tensor name to this model's name; None skips it."""
        if "rotary_emb.inv_freq" in name or "pos_emb.inv_freq" in name:
            return None
        if self.args.tie_word_embeddings and name == "lm_head.weight":
            return None
        return name

    def compute_logits(self, hidden: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        return self.lm_head(hidden, plan).float()  # [num_tokens, vocab]

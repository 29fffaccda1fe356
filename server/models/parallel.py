"""One model over several processes (torch.distributed): tensor parallel (every layer's heads and FFN columns
split across ranks) and pipeline parallel (contiguous layer ranges per rank).

Both rewrite a model built on the meta device, before it is materialized, so each rank allocates only its
part, and leave a `ShardPlan` on it: which checkpoint tensors this rank reads, under which local name, and
which slice of each (`Shard`), so the loader reads only that slice from the safetensors file.

Tensor parallel (Megatron style): q/k/v, gate/up and the state layers' input projections are split by output
rows (heads, channels), o/down/out projections by input columns; each token mixer's and FFN's partial output
is summed by one all_reduce (a forward hook on the mixer and on the FFN). Experts are split along their
intermediate dim: every rank holds every expert's slice, so routing stays local and identical on all ranks,
grouped_mm runs unchanged on narrower experts, and a batch-1 token's k experts load every rank evenly (a
split by expert ids would leave ranks whose experts were not chosen idle). Embedding, norms, routers and the
LM head are replicated. KV heads split when num_kv_heads % N == 0; when N is a multiple of num_kv_heads each
rank holds the one KV head its query heads use.

Pipeline parallel: rank r holds layers [start, stop); rank 0 also holds the embedding, the final norm and
the LM head, so the sampled ids never leave it. Hidden states go round a ring: 0 -> 1 -> ... -> N-1 -> 0.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from server.kernels import devices
from server.kernels.gemv import RowReductionLinear
from server.kernels.plan import StepPlan
from server.models.base import ATTENTION
from server.models.hybrid import (
    GatedAttention,
    GatedDeltaNet,
    SharedExpertMoE,
    ShortConv,
    SigmoidBiasMoE,
)
from server.models.layers import (
    Attention,
    FusedExperts,
    GatedMLP,
    Linear,
    MergedLinear,
    SoftmaxMoE,
    call_layer,
    layer_metadata,
)

TENSOR, PIPELINE = "tensor", "pipeline"
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_EXPERT_RE = re.compile(r"^\d+\.")


@dataclass(frozen=True)
class Layout:
    """This process's place in the model: `kind` TENSOR or PIPELINE, rank `rank` of `size`; `group` is the
    process group of the forward's collectives (None: the default group)."""

    kind: str
    rank: int
    size: int
    group: Any = None


@dataclass(frozen=True)
class Shard:
    """The part of a full tensor one rank holds: along `dim`, the concatenation of the `ranges` [start, stop)."""

    dim: int
    ranges: tuple[tuple[int, int], ...]

    def take(self, full) -> torch.Tensor:
        """Read this shard of `full`: a tensor, or a safetensors slice (only the shard's bytes are read)."""
        lead = (slice(None),) * self.dim
        parts = [full[(*lead, slice(a, b))] for a, b in self.ranges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)

    def blocks(self, block: int) -> Shard:
        """The same shard on a grid of `block`-sized blocks (block-wise FP8 scales); the ranges must align."""
        if any(a % block or b % block for a, b in self.ranges):
            raise ValueError(f"shard {self.ranges} does not fall on FP8 blocks of {block}")
        return Shard(self.dim, tuple((a // block, b // block) for a, b in self.ranges))


def rows(*ranges: tuple[int, int]) -> Shard:
    return Shard(0, ranges)


class ShardPlan:
    """Which tensors this rank holds. `locate(name)` -> (local name, Shard or None for the whole tensor), or
    None when the tensor lives on another rank. Names are ours after `sanitize`, checkpoint or fused."""

    def __init__(self, layout: Layout, rules: dict[str, dict[str, Shard]], layer_range: tuple[int, int] | None):
        self.layout = layout
        self.rules = rules  # module name -> {name relative to it ("*." for any expert index): Shard}
        self.layer_range = layer_range  # pipeline: the global layers [start, stop) this rank holds

    def locate(self, name: str) -> tuple[str, Shard | None] | None:
        if self.layer_range is not None:
            return self._locate_stage(name)
        module, _, leaf = name.rpartition(".")
        while module:
            rules = self.rules.get(module)
            if rules is not None:
                relative = _EXPERT_RE.sub("*.", name[len(module) + 1 :], count=1)
                return name, rules.get(relative) or self._scale_rule(rules, relative)
            module = module.rpartition(".")[0]
        return name, None

    @staticmethod
    def _scale_rule(rules: dict[str, Shard], relative: str) -> Shard | None:
        """Block-wise FP8 checkpoints: a weight's `weight_scale_inv` marks its shard, in blocks (taken later)."""
        if relative.endswith(".weight_scale_inv"):
            return rules.get(relative.removesuffix("_scale_inv"))
        return None

    def _locate_stage(self, name: str) -> tuple[str, None] | None:
        match = _LAYER_RE.match(name)
        if match is None:  # embedding, final norm, LM head: rank 0's
            return (name, None) if self.layout.rank == 0 else None
        start, stop = self.layer_range
        index = int(match[1])
        return (f"model.layers.{index - start}.{match[2]}", None) if start <= index < stop else None


def locate(model: nn.Module, name: str) -> tuple[str, Shard | None] | None:
    """`ShardPlan.locate` of a parallel model; a single-process model holds every tensor whole."""
    plan = getattr(model, "shard_plan", None)
    return (name, None) if plan is None else plan.locate(name)


def apply_layout(model: nn.Module, layout: Layout) -> None:
    """Rewrite a model built on the meta device into this rank's part (before FP8 swaps and materializing)."""
    if layout.kind == TENSOR:
        shard_tensor_parallel(model, layout)
    elif layout.kind == PIPELINE:
        split_pipeline(model, layout)
    else:
        raise ValueError(f"unknown parallel layout {layout.kind!r}")


# ---- collectives ---------------------------------------------------------------------------------------------
def all_reduce(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum over the group, in place. Gloo (CPU, several Macs) takes CPU tensors: MPS tensors go through the host."""
    if devices.collectives_through_host(x.device):
        host = x.cpu()
        dist.all_reduce(host, group=group)
        return x.copy_(host)
    dist.all_reduce(x, group=group)
    return x


def broadcast(x: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """`src`'s x on every rank, in place (through the host for MPS tensors, as all_reduce)."""
    if devices.collectives_through_host(x.device):
        host = x.cpu()
        dist.broadcast(host, src, group=group)
        return x.copy_(host)
    dist.broadcast(x, src, group=group)
    return x


def send(x: torch.Tensor, dst: int, group=None) -> None:
    dist.send(x.cpu() if devices.collectives_through_host(x.device) else x.contiguous(), dst, group=group)


def recv(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src: int, group=None) -> torch.Tensor:
    host = devices.collectives_through_host(device)
    out = torch.empty(shape, dtype=dtype, device="cpu" if host else device)
    dist.recv(out, src, group=group)
    return out.to(device) if host else out


# ---- tensor parallel -----------------------------------------------------------------------------------------
def _part(total: int, layout: Layout, what: str) -> tuple[int, int]:
    """[start, stop) of this rank's equal share of `total` items."""
    if total % layout.size:
        raise ValueError(f"tensor parallel {layout.size} does not divide the {total} {what}")
    size = total // layout.size
    return layout.rank * size, (layout.rank + 1) * size


def kv_head_range(num_kv_heads: int, layout: Layout) -> tuple[int, int]:
    """KV heads split when num_kv_heads % N == 0; when N is a multiple of num_kv_heads, rank r holds the one KV
    head its query heads read (head r // (N / num_kv_heads)), replicated on N / num_kv_heads ranks."""
    if num_kv_heads % layout.size == 0:
        return _part(num_kv_heads, layout, "KV heads")
    if layout.size % num_kv_heads == 0:
        head = layout.rank // (layout.size // num_kv_heads)
        return head, head + 1
    raise ValueError(f"tensor parallel {layout.size} neither divides nor is a multiple of the {num_kv_heads} KV heads")


def _scaled(r: tuple[int, int], unit: int, offset: int = 0) -> tuple[int, int]:
    return offset + r[0] * unit, offset + r[1] * unit


def _fused_rows(sizes: list[int], parts: list[tuple[tuple[int, int], ...]]) -> Shard:
    """The rows of a fused weight (row blocks of the full `sizes`) that hold each block's `parts`."""
    ranges, offset = [], 0
    for size, block in zip(sizes, parts, strict=True):
        ranges += [(offset + a, offset + b) for a, b in block]
        offset += size
    return Shard(0, tuple(ranges))


def _shard_attention(attn: Attention | GatedAttention, layout: Layout) -> dict[str, Shard]:
    """q/k/v by heads (GatedAttention's q_proj holds [q | gate] per head: 2 * head_dim rows), o_proj by columns."""
    heads = _part(attn.num_heads, layout, "attention heads")
    kv = kv_head_range(attn.num_kv_heads, layout)
    head_dim, old = attn.head_dim, attn.qkv_proj
    q_rows_per_head = old.output_sizes[0] // attn.q_size
    o_name = getattr(attn, "o_proj_name", "o_proj")
    hidden = getattr(attn, o_name).out_features
    attn.num_heads, attn.num_kv_heads = heads[1] - heads[0], kv[1] - kv[0]
    attn.q_size, attn.kv_size = attn.num_heads * head_dim, attn.num_kv_heads * head_dim
    q_rows, kv_rows = _scaled(heads, q_rows_per_head * head_dim), _scaled(kv, head_dim)
    attn.qkv_proj = MergedLinear(old.in_features, [q_rows[1] - q_rows[0], attn.kv_size, attn.kv_size],
                                 old.source_names)
    setattr(attn, o_name, RowReductionLinear(attn.q_size, hidden, bias=False))
    q, k, v = old.source_names
    return {f"{q}.weight": rows(q_rows), f"{k}.weight": rows(kv_rows), f"{v}.weight": rows(kv_rows),
            f"{o_name}.weight": Shard(1, (_scaled(heads, head_dim),)),
            "qkv_proj.weight": _fused_rows(old.output_sizes, [(q_rows,), (kv_rows,), (kv_rows,)])}


def _shard_mlp(mlp: GatedMLP, layout: Layout) -> dict[str, Shard]:
    old = mlp.gate_up_proj
    size = old.output_sizes[0]
    part = _part(size, layout, "FFN columns")
    down = getattr(mlp, mlp.down_name)
    mlp.gate_up_proj = MergedLinear(old.in_features, [part[1] - part[0]] * 2, old.source_names)
    setattr(mlp, mlp.down_name, RowReductionLinear(part[1] - part[0], down.out_features, bias=False))
    gate, up = old.source_names
    return {f"{gate}.weight": rows(part), f"{up}.weight": rows(part), f"{mlp.down_name}.weight": Shard(1, (part,)),
            "gate_up_proj.weight": _fused_rows(old.output_sizes, [(part,), (part,)])}


def _shard_experts(experts: FusedExperts, layout: Layout) -> tuple[FusedExperts, dict[str, Shard]]:
    size = experts.intermediate_size
    part = _part(size, layout, "expert FFN columns")
    hidden = experts.gate_up_proj.shape[-1]
    local = FusedExperts(experts.num_experts, hidden, part[1] - part[0], experts.per_expert_names, experts.shared_slot)
    gate, up, down = experts.per_expert_names
    return local, {f"*.{gate}.weight": rows(part), f"*.{up}.weight": rows(part), f"*.{down}.weight": Shard(1, (part,)),
                   "gate_up_proj": Shard(1, (part, _scaled(part, 1, size))), "down_proj": Shard(2, (part,))}


def _shard_gated_delta_net(gdn: GatedDeltaNet, layout: Layout) -> dict[str, Shard]:
    """Split by key heads and the value heads they group (value head j reads key head j // ratio)."""
    k_heads = _part(gdn.num_k_heads, layout, "linear-attention key heads")
    v_heads = _part(gdn.num_v_heads, layout, "linear-attention value heads")
    k_dim, v_dim, ratio = gdn.k_dim, gdn.v_dim, gdn.num_v_heads // gdn.num_k_heads
    key_size = gdn.key_size
    qkv = (_scaled(k_heads, k_dim), _scaled(k_heads, k_dim, key_size), _scaled(v_heads, v_dim, 2 * key_size))
    z, heads = _scaled(v_heads, v_dim), v_heads
    old_sizes, names = gdn.in_proj.output_sizes, gdn.in_proj.source_names
    gdn.num_k_heads, gdn.num_v_heads = k_heads[1] - k_heads[0], v_heads[1] - v_heads[0]
    gdn.key_size, gdn.value_size = gdn.num_k_heads * k_dim, gdn.num_v_heads * v_dim
    gdn.conv_dim = 2 * gdn.key_size + gdn.value_size
    hidden = gdn.in_proj.in_features
    gdn.in_proj = MergedLinear(hidden, [gdn.conv_dim, gdn.value_size, gdn.num_v_heads, gdn.num_v_heads], names)
    gdn.conv1d = nn.Conv1d(gdn.conv_dim, gdn.conv_dim, gdn.kernel_size, groups=gdn.conv_dim, bias=False)
    gdn.dt_bias = nn.Parameter(torch.empty(gdn.num_v_heads))
    gdn.A_log = nn.Parameter(torch.empty(gdn.num_v_heads))
    gdn.out_proj = RowReductionLinear(gdn.value_size, hidden, bias=False)
    group_rows = 2 * k_dim + 2 * ratio * v_dim  # Qwen3-Next's grouped in_proj_qkvz: [q k v z] per key head
    qkv_name, z_name, b_name, a_name = names
    return {f"{qkv_name}.weight": rows(*qkv), f"{z_name}.weight": rows(z), f"{b_name}.weight": rows(heads),
            f"{a_name}.weight": rows(heads), "conv1d.weight": rows(*qkv), "dt_bias": rows(heads),
            "A_log": rows(heads), "out_proj.weight": Shard(1, (z,)),
            "in_proj_qkvz.weight": rows(_scaled(k_heads, group_rows)),
            "in_proj_ba.weight": rows(_scaled(k_heads, 2 * ratio)),
            "in_proj.weight": _fused_rows(old_sizes, [qkv, (z,), (heads,), (heads,)])}


def _shard_short_conv(conv: ShortConv, layout: Layout) -> dict[str, Shard]:
    """LFM2's gated short conv is per channel: B, C, x and the conv split by channels, out_proj by columns."""
    hidden = conv.hidden_size
    part = _part(hidden, layout, "conv channels")
    conv.hidden_size = part[1] - part[0]
    conv.in_proj = Linear(hidden, 3 * conv.hidden_size, bias=False)
    conv.conv = nn.Conv1d(conv.hidden_size, conv.hidden_size, conv.kernel_size, groups=conv.hidden_size, bias=False)
    conv.out_proj = RowReductionLinear(conv.hidden_size, hidden, bias=False)
    return {"in_proj.weight": rows(part, _scaled(part, 1, hidden), _scaled(part, 1, 2 * hidden)),
            "conv.weight": rows(part), "out_proj.weight": Shard(1, (part,))}


def _shard_block(module: nn.Module, name: str, layout: Layout, rules: dict[str, dict[str, Shard]]) -> None:
    """Shard one token mixer or FFN in place; its rules (and its children's) go into `rules` by module name."""
    if isinstance(module, Attention | GatedAttention):
        rules[name] = _shard_attention(module, layout)
    elif isinstance(module, GatedMLP):
        rules[name] = _shard_mlp(module, layout)
    elif isinstance(module, GatedDeltaNet):
        rules[name] = _shard_gated_delta_net(module, layout)
    elif isinstance(module, ShortConv):
        rules[name] = _shard_short_conv(module, layout)
    elif isinstance(module, SoftmaxMoE | SigmoidBiasMoE | SharedExpertMoE):
        module.experts, rules[f"{name}.experts"] = _shard_experts(module.experts, layout)
        if isinstance(module, SharedExpertMoE) and module.shared_expert is not None:  # its partial sum joins
            rules[f"{name}.shared_expert"] = _shard_mlp(module.shared_expert, layout)  # the routed one's all_reduce
    else:
        raise ValueError(f"{type(module).__name__} has no tensor-parallel form")


def shard_tensor_parallel(model: nn.Module, layout: Layout) -> None:
    rules: dict[str, dict[str, Shard]] = {}
    for index, layer in enumerate(model.model.layers):
        for role in (layer.names[1], layer.names[3]):  # the token mixer and the FFN
            module = getattr(layer, role)
            _shard_block(module, f"model.layers.{index}.{role}", layout, rules)
            module.register_forward_hook(_all_reduce_output(layout.group))
    model.args = local_args(model.args, layout)
    model.shard_plan = ShardPlan(layout, rules, None)


def _all_reduce_output(group):
    def hook(module, args, output):
        return all_reduce(output, group)

    return hook


def local_args(args, layout: Layout):
    """The model args with this rank's KV and linear-attention head counts (the KV cache's shapes and the
    loader's un-grouping of Qwen3-Next projections read them); every other field is the whole model's."""
    changes = {}
    if getattr(args, "num_key_value_heads", None):
        start, stop = kv_head_range(args.num_key_value_heads, layout)
        changes["num_key_value_heads"] = stop - start
    for field in ("linear_num_key_heads", "linear_num_value_heads"):
        if getattr(args, field, None):
            changes[field] = getattr(args, field) // layout.size
    return dataclasses.replace(args, **changes)


# ---- pipeline parallel ---------------------------------------------------------------------------------------
def stage_range(num_layers: int, layout: Layout) -> tuple[int, int]:
    """[start, stop) of the layers rank r holds: contiguous, sizes differing by at most one (earlier ranks get
    the extra layers' share last: rank 0 also carries the embedding and the LM head)."""
    if num_layers < layout.size:
        raise ValueError(f"pipeline parallel {layout.size} needs at least as many layers; the model has {num_layers}")
    base, extra = divmod(num_layers, layout.size)
    sizes = [base + (1 if r >= layout.size - extra else 0) for r in range(layout.size)]
    start = sum(sizes[: layout.rank])
    return start, start + sizes[layout.rank]


class Absent(nn.Module):
    """Stands where a module lives on another rank (a pipeline stage's embedding, LM head): no weights."""

    weight = None


class PipelineStack(nn.Module):
    """`model.*` of one pipeline stage: its layers (local indices), and on rank 0 the embedding and final norm.
    Forward: rank 0 embeds; every other rank receives the hidden states from the rank before it; each runs its
    layers and sends the result on; rank 0 receives the last stage's output and applies the final norm."""

    def __init__(self, stack: nn.Module, layer_range: tuple[int, int], layout: Layout, hidden_size: int):
        super().__init__()
        start, stop = layer_range
        self.layout, self.hidden_size = layout, hidden_size
        self.layers = nn.ModuleList(list(stack.layers)[start:stop])
        self.layer_types = stack.layer_types[start:stop]
        self.cache_index = [sum(1 for u in self.layer_types[:i] if (u == ATTENTION) == (t == ATTENTION))
                            for i, t in enumerate(self.layer_types)]
        self.rotary_emb = stack.rotary_emb
        self.final_norm_name = stack.final_norm_name
        first = layout.rank == 0
        self.embed_tokens = stack.embed_tokens if first else Absent()
        setattr(self, self.final_norm_name, getattr(stack, self.final_norm_name) if first else Absent())

    layer_call = staticmethod(call_layer)

    def forward(self, input_ids, positions, meta, kv_caches, plan: StepPlan):
        rank, size, group = self.layout.rank, self.layout.size, self.layout.group
        dtype = self._dtype()
        if rank == 0:
            x = self.embed_tokens(input_ids)
        else:
            x = recv((input_ids.shape[0], self.hidden_size), dtype, input_ids.device, rank - 1, group)
        rope = self.rotary_emb(positions, dtype)
        state_caches, meta = meta.state_caches, layer_metadata(meta)
        for layer, layer_type, index in zip(self.layers, self.layer_types, self.cache_index, strict=True):
            cache = kv_caches[index] if layer_type == ATTENTION else state_caches[index]
            x = self.layer_call(layer, x, rope, meta, cache, plan)
        send(x, (rank + 1) % size, group)
        if rank != 0:
            return x  # followers' output is not read: rank 0 computes the logits
        x = recv(tuple(x.shape), x.dtype, x.device, size - 1, group)
        return getattr(self, self.final_norm_name)(x)  # [num_tokens, hidden]

    def _dtype(self) -> torch.dtype:
        """The model dtype, read off a norm weight (FP8 stages keep their norms in the model dtype)."""
        layer = self.layers[0]
        return getattr(layer, layer.names[0]).weight.dtype


def split_pipeline(model: nn.Module, layout: Layout) -> None:
    layer_range = stage_range(len(model.model.layers), layout)
    model.model = PipelineStack(model.model, layer_range, layout, model.args.hidden_size)
    if layout.rank != 0:
        model.lm_head = Absent()
        model.args = dataclasses.replace(model.args, tie_word_embeddings=False)  # nothing to tie on this rank
    model.shard_plan = ShardPlan(layout, {}, layer_range)

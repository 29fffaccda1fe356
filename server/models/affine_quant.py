"""Affine group-quantized weights in the model (int4 / int8, MLX's format: server/kernels/affine.py).

Modules: `AffineLinear` (and `AffineMergedLinear`, which keeps a fused projection's table), `AffineFusedExperts`
(all experts of an MoE layer packed, [E, rows, K*bits/32]), `AffineEmbedding` and `AffineTiedHead` (an LM head
that reads the quantized embedding table, as mlx's `as_linear`). Each holds its packed weight (`weight`, uint32),
`scales` and `biases` (the model dtype) as buffers; the step plan a product is called with picks its form (the
reference, or one reduction over the packed weight where the step is compiled: kernels/affine.py).

`swap_to_affine` replaces the modules a `QuantSpec` names, on the meta device, so that checkpoint tensors (packed
ones from an MLX checkpoint, or float ones quantized as they stream in) fill them one at a time
(engine/mlx_checkpoint.AffineLoader); the WeightLoader skips their buffers (`checkpoint_buffers = ()`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from server.kernels import affine, moe
from server.kernels.plan import StepPlan
from server.models.layers import FusedExperts, MergedLinear

# (a module's checkpoint source name in Hugging Face naming, e.g. "model.layers.0.self_attn.q_proj", or
# "model.layers.1.mlp.experts.gate_proj" for stacked experts; its input dimension) -> its format, or None to keep
# it unquantized.
QuantSpec = Callable[[str, int], "AffineFormat | None"]


@dataclass(frozen=True)
class AffineFormat:
    group_size: int
    bits: int

    def __post_init__(self) -> None:
        affine.check_format(self.group_size, self.bits)


class _Packed(nn.Module):
    """Packed weight + scales + biases of `rows` [..., N] x `in_features` in one format."""

    checkpoint_buffers: tuple[str, ...] = ()  # filled by engine/mlx_checkpoint.AffineLoader, not the WeightLoader
    LEAVES = ("weight", "scales", "biases")

    def _register_packed(self, prefix: str, rows: tuple[int, ...], in_features: int, fmt: AffineFormat,
                         dtype: torch.dtype, device) -> None:
        if in_features % fmt.group_size:
            raise ValueError(f"input dimension {in_features} is not a multiple of the group size {fmt.group_size}")
        groups = in_features // fmt.group_size
        self.register_buffer(prefix + "weight", torch.empty(*rows, affine.packed_width(in_features, fmt.bits),
                                                            dtype=torch.uint32, device=device))
        self.register_buffer(prefix + "scales", torch.empty(*rows, groups, dtype=dtype, device=device))
        self.register_buffer(prefix + "biases", torch.empty(*rows, groups, dtype=dtype, device=device))

    def packed(self, prefix: str = "") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(getattr(self, prefix + leaf) for leaf in self.LEAVES)


class AffineLinear(_Packed):
    """A bias-free linear whose weight [out, in] is held packed (kernels/affine.py)."""

    def __init__(self, in_features: int, out_features: int, fmt: AffineFormat, dtype: torch.dtype, device=None):
        super().__init__()
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        self.group_size, self.bits = fmt.group_size, fmt.bits
        self._register_packed("", (out_features,), in_features, fmt, dtype, device)

    @classmethod
    def like(cls, linear: nn.Linear, fmt: AffineFormat, dtype: torch.dtype) -> AffineLinear:
        if linear.bias is not None:
            raise ValueError("affine quantization of linears with a bias is not supported")
        return cls(linear.in_features, linear.out_features, fmt, dtype, linear.weight.device)

    def forward(self, x: torch.Tensor, plan: StepPlan | None = None) -> torch.Tensor:
        """`plan` None: a router, called as nn.Linear is (the reference form)."""
        return affine.affine_linear(x, *self.packed(), self.group_size, self.bits, None, linear_form(x, plan))

    def dequantized(self) -> torch.Tensor:
        return affine.dequantize_affine(*self.packed(), self.group_size, self.bits)


class AffineMergedLinear(AffineLinear):
    """AffineLinear that keeps MergedLinear's fusion table (q/k/v or gate/up rows concatenated: groups run along
    the input dimension, so fusing rows is exact)."""

    def __init__(self, merged: MergedLinear, fmt: AffineFormat, dtype: torch.dtype):
        super().__init__(merged.in_features, merged.out_features, fmt, dtype, merged.weight.device)
        self.output_sizes, self.source_names = merged.output_sizes, merged.source_names

    shard_rows = MergedLinear.shard_rows


class AffineEmbedding(_Packed):
    """nn.Embedding with its table [vocab, hidden] packed; a lookup dequantizes only its rows."""

    def __init__(self, embedding: nn.Embedding, fmt: AffineFormat, dtype: torch.dtype):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.fmt = embedding.num_embeddings, embedding.embedding_dim, fmt
        self.group_size, self.bits = fmt.group_size, fmt.bits
        self._register_packed("", (self.num_embeddings,), self.embedding_dim, fmt, dtype, embedding.weight.device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return affine.affine_embedding(ids, *self.packed(), self.group_size, self.bits)


class AffineTiedHead(nn.Module):
    """An LM head tied to a quantized embedding: logits from the packed table (mlx's `as_linear`). Holds no
    tensor of its own; `weight` is the embedding's, and assigning it (CausalLM.tie_weights) changes nothing."""

    def __init__(self, embedding: AffineEmbedding):
        super().__init__()
        self._embedding = (embedding,)  # not a child: its tensors are the embedding's, counted once

    @property
    def weight(self) -> torch.Tensor:
        return self._embedding[0].weight

    @weight.setter
    def weight(self, value) -> None:
        pass

    def read_tensors(self) -> tuple[torch.Tensor, ...]:
        """What computing the logits reads: the whole packed table, its scales and biases."""
        return self._embedding[0].packed()

    def forward(self, x: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        emb = self._embedding[0]
        return affine.affine_linear(x, *emb.packed(), emb.group_size, emb.bits, None, linear_form(x, plan))


class AffineFusedExperts(_Packed):
    """FusedExperts packed: gate_up_weight [E, 2I, H*b/32] (+ gate_up_scales, gate_up_biases [E, 2I, H/gs]) and
    down_weight [E, H, I*b/32] (+ down_scales, down_biases), gate and up in one format (`gate_up_fmt`), down in
    its own (`down_fmt`). A projection left in the model dtype (format None: mlx-lm keeps a layer whose input
    dimension the group does not divide unquantized) is held as FusedExperts holds it, `gate_up_proj`
    [E, 2I, H] or `down_proj` [E, H, I], a buffer the AffineLoader fills."""

    def __init__(self, experts: FusedExperts, gate_up_fmt: AffineFormat | None, down_fmt: AffineFormat | None,
                 dtype: torch.dtype):
        super().__init__()
        if gate_up_fmt is None and down_fmt is None:
            raise ValueError("AffineFusedExperts needs at least one quantized projection")
        self.num_experts, self.intermediate_size = experts.num_experts, experts.intermediate_size
        self.per_expert_names, self.shared_slot = experts.per_expert_names, experts.shared_slot
        self.gate_up_fmt, self.down_fmt = gate_up_fmt, down_fmt
        self.fmt = gate_up_fmt or down_fmt  # the format reported for the module (the larger part's where packed)
        self.group_size, self.bits = self.fmt.group_size, self.fmt.bits
        num_experts, two_inter, hidden = experts.gate_up_proj.shape
        device = experts.gate_up_proj.device
        for prefix, rows, in_features, fmt in (("gate_up_", (num_experts, two_inter), hidden, gate_up_fmt),
                                               ("down_", (num_experts, hidden), experts.intermediate_size, down_fmt)):
            if fmt is None:
                self.register_buffer(prefix + "proj", torch.empty(*rows, in_features, dtype=dtype, device=device))
            else:
                self._register_packed(prefix, rows, in_features, fmt, dtype, device)

    def part(self, prefix: str) -> tuple[tuple[torch.Tensor, ...] | torch.Tensor, tuple[int, int] | None]:
        """(the packed triple or the float tensor, (group_size, bits) or None) of "gate_up_" or "down_"."""
        fmt = self.gate_up_fmt if prefix == "gate_up_" else self.down_fmt
        if fmt is None:
            return getattr(self, prefix + "proj"), None
        return self.packed(prefix), (fmt.group_size, fmt.bits)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        (gate_up, gate_up_format), (down, down_format) = self.part("gate_up_"), self.part("down_")
        form = experts_form(plan, expert_ids, self.num_experts)
        return affine.affine_experts(x, weights, expert_ids, gate_up, down, gate_up_format, down_format, form, plan)


def experts_form(plan: StepPlan, expert_ids: torch.Tensor, num_experts: int) -> str:
    """Decode-sized steps (few slots) read only the routed experts' packed rows in one reduction; larger ones
    dequantize the stacks and run the model dtype's experts kernel (both sync-free). A compiled decoder layer
    whose symbolic token count has few slots only at its smallest value takes the latter without a guard
    (kernels/moe.few_slots_only_at_fewest)."""
    num_tokens, top_k = expert_ids.shape
    if plan.regions_compile_once and moe.few_slots_only_at_fewest(num_tokens, top_k, num_experts):
        return "grouped"
    return "reduction" if moe.few_slots(num_tokens * top_k, num_experts) else "grouped"


def swap_to_affine(model: nn.Module, dtype: torch.dtype, spec: QuantSpec) -> None:
    """Replace, in place (on the meta device), every linear, experts block and embedding whose checkpoint
    source(s) `spec` quantizes by its affine form. A fused linear's sources must share one format; experts take
    one for gate and up and one for down (either may be None). A tied LM head follows the embedding. Every
    source's format is kept as `model.affine_layout`, from which `layout_spec` rebuilds the same model (the compile
    child's twin)."""
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    model.affine_layout = layout = {}
    given = spec

    def spec(source: str, in_features: int) -> AffineFormat | None:
        fmt = given(source, in_features)
        layout[source] = None if fmt is None else [fmt.group_size, fmt.bits]
        return fmt

    for name, module in list(model.named_modules()):
        if tied and name == "lm_head":
            continue
        sources = source_names(name, module)
        if not sources:
            continue
        if isinstance(module, FusedExperts):
            gate_up, down = expert_sources(name, module)
            gate_up_fmt, down_fmt = _common_format(name, gate_up, spec), _common_format(name, down, spec)
            if gate_up_fmt is not None or down_fmt is not None:
                _replace(model, name, AffineFusedExperts(module, gate_up_fmt, down_fmt, dtype))
            continue
        fmt = _common_format(name, sources, spec)
        if fmt is None:
            continue
        if isinstance(module, MergedLinear):
            new = AffineMergedLinear(module, fmt, dtype)
        elif isinstance(module, nn.Embedding):
            new = AffineEmbedding(module, fmt, dtype)
        else:
            new = AffineLinear.like(module, fmt, dtype)
        _replace(model, name, new)
    if tied and isinstance(model.model.embed_tokens, AffineEmbedding):
        model.lm_head = AffineTiedHead(model.model.embed_tokens)


def layout_spec(layout: dict[str, list[int] | None]) -> QuantSpec:
    """The QuantSpec of a model's `affine_layout` (source name -> [group_size, bits], or None)."""
    def spec(source: str, in_features: int) -> AffineFormat | None:
        fmt = layout.get(source)
        return None if fmt is None else AffineFormat(*fmt)

    return spec


def source_names(name: str, module: nn.Module) -> list[tuple[str, int]] | None:
    """(checkpoint module name in HF naming, stacked experts as `<experts>.<proj>`; its input dimension) of each
    weight `module` at `name` holds; None for modules that are not quantizable. Experts list gate, up, down, and
    where a shared expert is kept as their last slot its gate, up, down as `<experts>.<slot>.<proj>`."""
    parent = name.rpartition(".")[0]
    if isinstance(module, FusedExperts):
        gate_up, down = expert_sources(name, module)
        return gate_up + down
    if isinstance(module, MergedLinear):
        return [(f"{parent}.{src}" if parent else src, module.in_features) for src in module.source_names]
    if isinstance(module, nn.Linear):
        return [(name, module.in_features)]
    if isinstance(module, nn.Embedding):
        return [(name, module.embedding_dim)]
    return None


def expert_sources(name: str, experts: FusedExperts) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """source_names of an experts block as (gate and up, down)."""
    gate, up, down = experts.per_expert_names
    hidden, inter = experts.gate_up_proj.shape[-1], experts.intermediate_size
    slots = [""] if experts.shared_slot is None else ["", f"{experts.shared_slot}."]
    return ([(f"{name}.{slot}{proj}", hidden) for slot in slots for proj in (gate, up)],
            [(f"{name}.{slot}{down}", inter) for slot in slots])


def _common_format(name: str, sources: list[tuple[str, int]], spec: QuantSpec) -> AffineFormat | None:
    formats = {spec(*src) for src in sources}
    if len(formats) > 1:
        shown = ", ".join(f"{src}: {spec(src, dim)}" for src, dim in sources)
        raise ValueError(f"the projections fused into {name} are quantized differently ({shown}); mixed formats "
                         "within one fused projection are not supported (mlx-lm's recipes do not write them)")
    return formats.pop()


def packed_weights(model: nn.Module) -> dict[int, int]:
    """id(tensor) -> the weights it stands for, for every tensor of the affine modules: a packed weight holds
    32 / bits per word, scales and biases none (mlx-lm's get_total_parameters counts alike)."""
    counts = {}
    for module in affine_modules(model).values():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.dtype == torch.uint32:
                fmt = (module.gate_up_fmt if name.startswith("gate_up_") else module.down_fmt
                       if name.startswith("down_") else module.fmt)
                counts[id(buffer)] = buffer.numel() * 32 // fmt.bits
            elif name.endswith(("scales", "biases")):
                counts[id(buffer)] = 0
    return counts


def affine_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, (_Packed, AffineTiedHead))}



def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, module)


def linear_form(x: torch.Tensor, plan: StepPlan | None) -> str:
    """The product's form (kernels/affine.LINEAR_FORMS): one reduction over the packed weight for one token of a compiled
    step, else the reference."""
    num_tokens = x.numel() // x.shape[-1]
    one_token = isinstance(num_tokens, int) and num_tokens == 1
    return "reduction" if plan is not None and plan.affine_reduction and one_token else "reference"

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

from server.kernels import affine
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

    def forward(self, x: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        emb = self._embedding[0]
        return affine.affine_linear(x, *emb.packed(), emb.group_size, emb.bits, None, linear_form(x, plan))


class AffineFusedExperts(_Packed):
    """FusedExperts packed: gate_up_proj [E, 2I, H*b/32] (+ gate_up_scales, gate_up_biases [E, 2I, H/gs]) and
    down_proj [E, H, I*b/32] (+ down_scales, down_biases), gate and up (and down) in one format."""

    def __init__(self, experts: FusedExperts, fmt: AffineFormat, dtype: torch.dtype):
        super().__init__()
        self.num_experts, self.intermediate_size = experts.num_experts, experts.intermediate_size
        self.per_expert_names, self.shared_slot, self.fmt = experts.per_expert_names, experts.shared_slot, fmt
        self.group_size, self.bits = fmt.group_size, fmt.bits
        num_experts, two_inter, hidden = experts.gate_up_proj.shape
        device = experts.gate_up_proj.device
        self._register_packed("gate_up_", (num_experts, two_inter), hidden, fmt, dtype, device)
        self._register_packed("down_", (num_experts, hidden), experts.intermediate_size, fmt, dtype, device)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        form = "reduction" if plan.affine_reduction else "reference"  # the reference syncs with the host
        return affine.affine_experts(x, weights, expert_ids, self.packed("gate_up_"), self.packed("down_"),
                                     self.group_size, self.bits, form)


def swap_to_affine(model: nn.Module, dtype: torch.dtype, spec: QuantSpec) -> None:
    """Replace, in place (on the meta device), every linear, experts block and embedding whose checkpoint
    source(s) `spec` quantizes by its affine form. A fused module's sources must share one format. A tied LM
    head follows the embedding."""
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    for name, module in list(model.named_modules()):
        if tied and name == "lm_head":
            continue
        fmt = _module_format(name, module, spec)
        if fmt is None:
            continue
        if isinstance(module, FusedExperts):
            new = AffineFusedExperts(module, fmt, dtype)
        elif isinstance(module, MergedLinear):
            new = AffineMergedLinear(module, fmt, dtype)
        elif isinstance(module, nn.Embedding):
            new = AffineEmbedding(module, fmt, dtype)
        else:
            new = AffineLinear.like(module, fmt, dtype)
        _replace(model, name, new)
    if tied and isinstance(model.model.embed_tokens, AffineEmbedding):
        model.lm_head = AffineTiedHead(model.model.embed_tokens)


def source_names(name: str, module: nn.Module) -> list[tuple[str, int]] | None:
    """(checkpoint module name in HF naming, stacked experts as `<experts>.<proj>`; its input dimension) of each
    weight `module` at `name` holds; None for modules that are not quantizable."""
    parent = name.rpartition(".")[0]
    if isinstance(module, FusedExperts):
        gate, up, down = module.per_expert_names
        hidden = module.gate_up_proj.shape[-1]
        return [(f"{name}.{gate}", hidden), (f"{name}.{up}", hidden), (f"{name}.{down}", module.intermediate_size)]
    if isinstance(module, MergedLinear):
        return [(f"{parent}.{src}" if parent else src, module.in_features) for src in module.source_names]
    if isinstance(module, nn.Linear):
        return [(name, module.in_features)]
    if isinstance(module, nn.Embedding):
        return [(name, module.embedding_dim)]
    return None


def _module_format(name: str, module: nn.Module, spec: QuantSpec) -> AffineFormat | None:
    sources = source_names(name, module)
    if not sources:
        return None
    formats = {spec(*src) for src in sources}
    if len(formats) > 1:
        shown = ", ".join(f"{src}: {spec(src, dim)}" for src, dim in sources)
        raise ValueError(f"the projections fused into {name} are quantized differently ({shown}); mixed formats "
                         "within one fused projection are not supported")
    return formats.pop()


def affine_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, (_Packed, AffineTiedHead))}



def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, module)


def linear_form(x: torch.Tensor, plan: StepPlan | None) -> str:
    """The product's form (kernels/affine.FORMS): one reduction over the packed weight for one token of a compiled
    step, else the reference."""
    num_tokens = x.numel() // x.shape[-1]
    one_token = isinstance(num_tokens, int) and num_tokens == 1
    return "reduction" if plan is not None and plan.affine_reduction and one_token else "reference"

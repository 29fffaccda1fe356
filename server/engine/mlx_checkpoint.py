"""MLX-quantized checkpoints (the mlx-community layout) and int4 / int8 quantization at load, into one format.

An MLX checkpoint's config.json carries `quantization` (and the same as `quantization_config`): the default
`group_size`, `bits` and `mode`, plus overrides keyed by mlx-lm's module path (a dict of the same keys, e.g. an
8-bit router gate). Each quantized module stores `<path>.weight` (uint32, packed), `<path>.scales` and
`<path>.biases`; stacked experts live under `switch_mlp.{gate,up,down}_proj`. Only the affine mode is served; any
other (mxfp4, nvfp4, mxfp8) is refused at load, naming it. As mlx-lm does, a module is quantized where the
checkpoint holds its scales, in the format its override names or else the one its shapes give.

mlx-lm names some parameters unlike Hugging Face; `MLX_RENAMES` maps them per model_type, and the model's own
`sanitize` then applies as for any checkpoint. Quantized routers are served quantized (affine linears), as the
checkpoint has them; norms follow the checkpoint (never quantized by mlx-lm).

`--quantize int4|int8` quantizes a float checkpoint as it streams in, with MLX's rounding and mlx-lm's default
recipe (`recipe_spec`): every linear, the experts, the embedding and an untied LM head at `bits` in groups of 64
(a layer whose input dimension the group does not divide stays in the model dtype), MoE routers at 8 bits in
groups of 64; a tied LM head reads the quantized embedding. Loading `mlx_lm.convert -q` output of the same
weights gives the same model.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from server.engine.types import ModelLoadError
from server.kernels import affine
from server.models.affine_quant import (
    AffineFormat,
    AffineFusedExperts,
    AffineMergedLinear,
    AffineTiedHead,
    QuantSpec,
    affine_modules,
)

log = logging.getLogger(__name__)

AFFINE_QUANTIZATIONS = {"int4": 4, "int8": 8}
DEFAULT_GROUP_SIZE = 64
ROUTER_FORMAT = AffineFormat(64, 8)  # mlx-lm's quant_predicate of the MoE models
ROUTER_SUFFIXES = ("mlp.gate", "shared_expert_gate", "feed_forward.gate")
LEAVES = ("weight", "scales", "biases")

# mlx-lm name -> Hugging Face name, per model_type: (pattern, replacement) applied in order (mlx-lm's models/*.py
# `sanitize` show how their stored names differ: stacked experts as `switch_mlp`, Qwen3.5's text model under
# `language_model.`, LFM2-MoE's w1 / w3 / w2 as gate / up / down_proj).
_SWITCH_MLP = (r"\.mlp\.switch_mlp\.", ".mlp.experts.")
_LANGUAGE_MODEL = (r"^language_model\.", "")
_LFM2_MOE = [(r"\.feed_forward\.switch_mlp\.", ".feed_forward.experts."),
             *((rf"\.feed_forward\.(experts\.|){mlx}\.", rf".feed_forward.\1{hf}.")
               for mlx, hf in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")))]
MLX_RENAMES: dict[str, list[tuple[str, str]]] = {
    "qwen3_moe": [_SWITCH_MLP],
    "qwen3_next": [_SWITCH_MLP],
    **dict.fromkeys(("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"), [_LANGUAGE_MODEL, _SWITCH_MLP]),
    "lfm2_moe": _LFM2_MOE,
}
# Norms mlx-lm stores as 1 + w where Hugging Face stores w (zero-centred RMSNorm: Qwen3.5 / Qwen3-Next).
ZERO_CENTRED_NORMS = re.compile(r"(\.input_layernorm|\.post_attention_layernorm|^model\.norm|\.q_norm|\.k_norm)\.weight$")
ZERO_CENTRED = {"qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"}
# Depthwise conv weights mlx-lm stores as [C, K, 1] where Hugging Face stores [C, 1, K].
CONV_WEIGHT = re.compile(r"(\.conv\.conv|\.linear_attn\.conv1d)\.weight$")
_EXPERT_RE = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)$")


def mlx_quantization(config: dict[str, Any]) -> dict[str, Any] | None:
    """The `quantization` table of an MLX checkpoint's config.json, or None for any other checkpoint. Raises
    ModelLoadError for a mode or bit width that is not served."""
    table = config.get("quantization")
    if not isinstance(table, dict):
        table = config.get("quantization_config")
        if not isinstance(table, dict) or "quant_method" in table or "bits" not in table:
            return None
    for path, entry in [("the checkpoint", table), *((k, v) for k, v in table.items() if isinstance(v, dict))]:
        mode = entry.get("mode", "affine")
        if mode != "affine":
            raise ModelLoadError(f"MLX quantization mode {mode!r} ({path}) is not supported: only affine 4-bit and "
                                 "8-bit checkpoints are served")
        bits, group_size = entry.get("bits", table.get("bits")), entry.get("group_size", table.get("group_size"))
        try:
            AffineFormat(group_size, bits)
        except ValueError as exc:
            raise ModelLoadError(f"MLX quantization of {path}: {exc}") from None
    return table


def mlx_to_hf(model_type: str, name: str) -> str:
    for pattern, replacement in MLX_RENAMES.get(model_type, ()):
        name = re.sub(pattern, replacement, name)
    return name


def mlx_tensor_to_hf(model_type: str, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
    """An MLX checkpoint's float tensor as Hugging Face stores it (mlx-lm's `sanitize` undone): depthwise conv
    weights [C, K, 1] -> [C, 1, K]; zero-centred norms 1 + w -> w (exact: 1 + w lies in [0.5, 2], where the
    difference is representable, and the forward's 1 + w gives back the stored value bit for bit)."""
    if CONV_WEIGHT.search(hf_name) and tensor.ndim == 3 and tensor.shape[-1] == 1:
        return tensor.transpose(1, 2)
    if model_type in ZERO_CENTRED and tensor.ndim == 1 and ZERO_CENTRED_NORMS.search(hf_name):
        return tensor - 1.0
    return tensor


def hf_tensor_to_mlx(model_type: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The inverse of mlx_tensor_to_hf (`name`: ours, after the model's sanitize): what mlx-lm's `sanitize`
    makes of a Hugging Face tensor, for `mps-serve quantize`."""
    if CONV_WEIGHT.search(name) and tensor.ndim == 3 and tensor.shape[1] == 1:
        return tensor.transpose(1, 2).contiguous()
    if model_type in ZERO_CENTRED and tensor.ndim == 1 and ZERO_CENTRED_NORMS.search(name):
        return tensor + 1.0
    return tensor


def read_headers(files: list[Path]) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, safetensors dtype) of every tensor in `files`, from the headers only."""
    found = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    piece = handle.get_slice(name)
                    found[name] = (tuple(piece.get_shape()), piece.get_dtype())
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"weight file {file} is corrupt or unreadable: {exc}") from None
    return found


def checkpoint_spec(config: dict[str, Any], table: dict[str, Any], files: list[Path]
                    ) -> Callable[[nn.Module], QuantSpec]:
    """For empty_model: given the model (for its `sanitize`), the format of each module this MLX checkpoint holds
    quantized: its override in `table`, else what its shapes give (mlx-lm's infer_quant_config)."""
    headers = read_headers(files)
    model_type = config["model_type"]

    def bind(model: nn.Module) -> QuantSpec:
        quantized = {}  # our source name -> (mlx path, packed width, groups)
        split = getattr(model, "split_tensor", None)
        for name, (shape, _) in headers.items():
            if name.endswith(".scales") and name[: -len("scales")] + "weight" in headers:
                path = name[: -len(".scales")]
                ours = model.sanitize(mlx_to_hf(model_type, path + ".weight"))
                if ours is None:
                    continue
                weight_shape = headers[path + ".weight"][0]
                # a tensor the model splits while loading (Qwen3-Next's grouped GDN projections): its pieces
                pieces = split(ours, torch.empty(weight_shape, device="meta")) if split else [(ours, None)]
                for piece, _ in pieces:
                    quantized[piece.removesuffix(".weight")] = (path, weight_shape[-1], shape[-1])

        def spec(source: str, in_features: int) -> AffineFormat | None:
            if source not in quantized:
                return None
            path, width, groups = quantized[source]
            group_size, bits = in_features // max(groups, 1), width * 32 // in_features
            if width * 32 != bits * in_features or groups * group_size != in_features:
                raise ModelLoadError(f"{path}: packed width {width} and {groups} groups do not fit an input "
                                     f"dimension of {in_features}")
            try:
                fmt = AffineFormat(group_size, bits)
            except ValueError as exc:
                raise ModelLoadError(f"{path}: {exc}") from None
            override = table.get(path)
            if isinstance(override, dict):
                declared = (override.get("group_size", table["group_size"]), override.get("bits", table["bits"]))
                if (fmt.group_size, fmt.bits) != declared:
                    raise ModelLoadError(f"{path}: config.json declares group size {declared[0]} and {declared[1]} "
                                         f"bits, the tensors hold group size {group_size} and {bits} bits")
            return fmt

        return spec

    return bind


def recipe_spec(bits: int, group_size: int = DEFAULT_GROUP_SIZE) -> Callable[[nn.Module], QuantSpec]:
    """`--quantize int4|int8`: mlx-lm's default recipe (mlx_lm.convert -q, quantize_model with the models'
    quant_predicate)."""
    default = AffineFormat(group_size, bits)

    def spec(source: str, in_features: int) -> AffineFormat | None:
        fmt = ROUTER_FORMAT if source.endswith(ROUTER_SUFFIXES) else default
        return fmt if in_features % fmt.group_size == 0 else None

    return lambda model: spec


def iter_mlx_checkpoint(files: list[Path], model: nn.Module, model_type: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, tensor) of every tensor of an MLX checkpoint, mlx-lm's names and layouts mapped to Hugging Face's
    and then through the model's `sanitize`."""
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    hf_name = mlx_to_hf(model_type, name)
                    mapped = model.sanitize(hf_name)
                    if mapped is not None:
                        yield mapped, mlx_tensor_to_hf(model_type, hf_name, handle.get_tensor(name))
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"weight file {file} is corrupt or unreadable: {exc}") from None


class AffineLoader:
    """Fills the affine modules of a model from checkpoint tensors named as Hugging Face names the projections
    (`<module>.weight|scales|biases`, per-expert `experts.<e>.<proj>.*`, stacked `experts.<proj>.*`, fused
    `experts.gate_up_proj`): packed tensors are copied, float weights quantized in place. Tracks the rows filled
    of every tensor, so that a missing piece is named."""

    def __init__(self, model: nn.Module):
        self.targets: dict[str, tuple[str, nn.Module, str, tuple]] = {}  # source -> (module name, module, prefix, rows)
        self.filled: dict[tuple[str, str], torch.Tensor] = {}  # (module name, buffer) -> bool mask of its rows
        for name, module in affine_modules(model).items():
            if isinstance(module, AffineTiedHead):
                continue
            if isinstance(module, AffineFusedExperts):
                self._add_experts(name, module)
            elif isinstance(module, AffineMergedLinear):
                parent = name.rpartition(".")[0]
                for i, src in enumerate(module.source_names):
                    self.targets[f"{parent}.{src}" if parent else src] = (name, module, "", (module.shard_rows(i),))
                self.targets[name] = (name, module, "", ())  # all rows at once (bench/random_model's tensors)
            else:
                self.targets[name] = (name, module, "", ())
            for buffer_name, buffer in module.named_buffers(recurse=False):
                self.filled[(name, buffer_name)] = torch.zeros(buffer.shape[:-1], dtype=torch.bool)

    def _add_experts(self, name: str, module: AffineFusedExperts) -> None:
        gate, up, down = module.per_expert_names
        inter = module.intermediate_size
        routed = slice(None) if module.shared_slot is None else slice(0, module.shared_slot)
        rows = {gate: ("gate_up_", slice(0, inter)), up: ("gate_up_", slice(inter, 2 * inter)), down: ("down_", None)}
        for proj, (prefix, part) in rows.items():
            self.targets[f"{name}.{proj}"] = (name, module, prefix, (routed,) if part is None else (routed, part))
        self.targets[f"{name}.gate_up_proj"] = (name, module, "gate_up_", (routed,))  # fused float (Qwen3.5)
        self.targets[f"{name}.down_proj"] = (name, module, "down_", (routed,))
        if module.shared_slot is not None:
            parent = name.rpartition(".")[0]
            for proj, (prefix, part) in rows.items():
                index = (module.shared_slot,) if part is None else (module.shared_slot, part)
                self.targets[f"{parent}.shared_expert.{proj}"] = (name, module, prefix, index)

    def resolve(self, name: str) -> tuple[str, nn.Module, str, tuple, str] | None:
        source, _, leaf = name.rpartition(".")
        if leaf not in LEAVES:
            source, leaf = name, "weight"  # a fused expert parameter: experts.gate_up_proj, experts.down_proj
        if source in self.targets:
            return (*self.targets[source], leaf)
        match = _EXPERT_RE.match(source)
        if match and f"{match['prefix']}.{match['proj']}" in self.targets:
            module_name, module, prefix, index = self.targets[f"{match['prefix']}.{match['proj']}"]
            return module_name, module, prefix, (int(match["expert"]), *index[1:]), leaf
        return None

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        """Load `tensor` if it belongs to an affine module; False if not (the WeightLoader's then)."""
        target = self.resolve(name)
        if target is None:
            return False
        module_name, module, prefix, index, leaf = target
        if prefix and len(index) == 1 and isinstance(index[0], slice) and tensor.shape[0] == module.num_experts:
            index = ()  # a fused tensor of every slot, the shared expert's too (bench/random_model's)
        fmt = part_format(module, prefix)
        if fmt is None:  # an experts projection kept in the model dtype
            if leaf != "weight" or not tensor.is_floating_point():
                raise ModelLoadError(f"{name}: {module_name} holds this projection unquantized, the checkpoint "
                                     "has it quantized")
            self._fill(name, module_name, module, prefix + "proj", index, tensor)
        elif leaf == "weight" and tensor.is_floating_point():  # a float checkpoint: quantize as it streams in
            dest = getattr(module, prefix + "scales")
            pieces = affine.quantize_affine(tensor.to(dest.device, dest.dtype), fmt.group_size, fmt.bits)
            for piece_leaf, piece in zip(LEAVES, pieces, strict=True):
                self._fill(name, module_name, module, prefix + piece_leaf, index, piece)
        else:
            self._fill(name, module_name, module, prefix + leaf, index, tensor)
        return True

    def _fill(self, name: str, module_name: str, module: nn.Module, buffer_name: str, index: tuple,
              tensor: torch.Tensor) -> None:
        dest = getattr(module, buffer_name)[index] if index else getattr(module, buffer_name)
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ModelLoadError(f"shape mismatch for {name}: checkpoint has {list(tensor.shape)}, the "
                                 f"quantized model expects {list(dest.shape)} ({buffer_name} of {module_name})")
        if (dest.dtype == torch.uint32) != (tensor.dtype == torch.uint32):
            raise ModelLoadError(f"{name} is {tensor.dtype}, expected {dest.dtype}")
        dest.copy_(tensor)
        mask = self.filled[(module_name, buffer_name)]
        mask[index if index else slice(None)] = True

    def filter(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors this loader does not take, for the WeightLoader."""
        for name, tensor in tensors:
            if not self.take(name, tensor):
                yield name, tensor

    def check_complete(self) -> None:
        missing = [f"{module}.{buffer}" for (module, buffer), mask in self.filled.items() if not bool(mask.all())]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ModelLoadError(f"checkpoint is missing quantized tensors (or rows of them): {shown}")


def quantized_target(loader: AffineLoader, model: nn.Module, name: str, tensor: torch.Tensor
                     ) -> tuple[nn.Module, AffineFormat | None] | None:
    """(the affine module, the format of its part) that checkpoint tensor `name` (ours, after sanitize) fills, or
    None where no affine module takes it; a tensor the model splits while loading goes where its pieces go."""
    split = getattr(model, "split_tensor", None)
    pieces = split(name, torch.empty(tensor.shape, device="meta")) if split else [(name, None)]
    target = loader.resolve(pieces[0][0])
    if target is None:
        return None
    module, prefix = target[1], target[2]
    return module, part_format(module, prefix)


def part_format(module: nn.Module, prefix: str) -> AffineFormat | None:
    """The format of an affine module's part ("gate_up_" / "down_" of experts, "" for the others)."""
    return module.gate_up_fmt if prefix == "gate_up_" else module.down_fmt if prefix == "down_" else module.fmt

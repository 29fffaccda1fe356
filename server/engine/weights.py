"""Find a checkpoint (local folder or Hub repo id), build the model on the meta device, stream
safetensors tensors straight into the device parameters, fusing per the model's declared table.

Only safetensors are read: never a pickle, never remote code.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm import tqdm

from server.engine.mlx_checkpoint import (
    AFFINE_QUANTIZATIONS,
    AffineLoader,
    checkpoint_spec,
    iter_mlx_checkpoint,
    mlx_quantization,
    recipe_spec,
)
from server.engine.types import ModelLoadError
from server.kernels.fp8 import FP8_DTYPE, blockwise_to_rowwise
from server.models.affine_quant import QuantSpec, affine_modules, packed_weights, swap_to_affine
from server.models.parallel import Layout, apply_layout, locate
from server.models.quant import swap_to_fp8
from server.models.registry import get_model_module

log = logging.getLogger(__name__)

HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]
MAX_NUM_LAYERS = 10_000  # far past any real model; more would take minutes to build even on the meta device
ROUTED = "routed experts"  # the fill key of a fused routed-experts tensor beside a shared expert's slot
_EXPERT_RE = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")


def resolve_model_path(model: str, revision: str | None = None, config_only: bool = False) -> Path:
    """A local directory as is; otherwise a Hub repo id through huggingface_hub (cache, HF_HUB_OFFLINE): its
    snapshot, or with `config_only` the snapshot folder holding just its config.json (nothing else fetched)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ModelLoadError(f"model path {model!r} is not a directory with a Hugging Face checkpoint")
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        if config_only:
            return Path(hf_hub_download(model, "config.json", revision=revision)).parent
        return Path(snapshot_download(model, revision=revision, allow_patterns=HUB_PATTERNS))
    except HFValidationError:
        raise ModelLoadError(f"{model!r} is neither a local directory nor a valid Hub repo id") from None
    except LocalEntryNotFoundError:
        raise ModelLoadError(
            f"{model!r} is not a local directory and is not in the Hugging Face cache, and downloading is "
            "not possible (offline, or HF_HUB_OFFLINE=1). Pass a local checkpoint directory or go online."
        ) from None
    except Exception as exc:  # network / auth / missing repo: say which model and why
        reason = next(iter(str(exc).strip().splitlines()), "") or type(exc).__name__
        raise ModelLoadError(f"could not fetch {model!r} from the Hugging Face Hub: {reason}") from None


def read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{model_dir} has no config.json; is it a Hugging Face checkpoint directory?")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from None
    if "model_type" not in config:
        raise ModelLoadError(f"{path} has no model_type")
    return config


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {exc}") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in model_dir.glob("*.bin")] + [p.name for p in model_dir.glob("*.pt*")]
        hint = f" (found {pickles}: pickle checkpoints are never loaded; convert to safetensors)" if pickles else ""
        raise ModelLoadError(f"{model_dir} has no *.safetensors weights{hint}")
    for file in files:
        if not file.is_file():
            raise ModelLoadError(f"weight file {file} named in the index is missing")
    return files


def iter_checkpoint(
    files: list[Path], model: nn.Module, fp8_block: tuple[int, int] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, tensor) of every checkpoint tensor this rank holds (all of them on one device), named by the
    model's `sanitize`; of a sharded tensor only its shard is read from the file. `fp8_block`: the block size
    of a block-wise FP8 checkpoint, whose `weight_scale_inv` grids shard with their weights."""
    for file in tqdm(files, desc="loading weights", unit="file", disable=len(files) < 2):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    mapped = model.sanitize(name)
                    where = None if mapped is None else locate(model, mapped)
                    if where is None:
                        continue
                    local_name, shard = where
                    if shard is None:
                        yield local_name, handle.get_tensor(name)
                        continue
                    piece = handle.get_slice(name)
                    if fp8_block is not None and name.endswith(".weight_scale_inv"):  # [rows, cols] of blocks
                        shard = shard.blocks(fp8_block[shard.dim + 2 - len(piece.get_shape())])
                    yield local_name, shard.take(piece)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"weight file {file} is corrupt or unreadable: {exc}") from None
        except ValueError as exc:  # a shard that does not fall on the checkpoint's FP8 blocks
            raise ModelLoadError(f"{file}: {exc}") from None


class WeightLoader:
    """Copies checkpoint tensors into a materialized model, tracking which parameter pieces were filled."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.params.update(_checkpoint_buffers(model))  # e.g. LFM2's fp32 expert_bias, FP8 weights
        self.filled: set[tuple[str, Any]] = set()
        self.bare_decoder = False  # tensors named without `model.`: a checkpoint of the decoder alone, no LM head

    def load(self, name: str, tensor: torch.Tensor) -> None:
        target = self.resolve(name, tensor.shape)
        if target is None and not name.startswith("model."):  # embedding checkpoints (e.g. Qwen3-Embedding)
            target = self.resolve(f"model.{name}", tensor.shape)
            self.bare_decoder = self.bare_decoder or target is not None
        if target is None:
            log.debug("ignoring checkpoint tensor %s", name)
            return
        param_name, index, key = target
        param = self.params[param_name]
        dest = param.data[index] if index is not None else param.data
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ModelLoadError(
                f"shape mismatch for {name}: checkpoint has {list(tensor.shape)}, model expects {list(dest.shape)}"
            )
        module_name, _, leaf = param_name.rpartition(".")
        owner = self._module(module_name)
        if hasattr(owner, "load_weight"):
            owner.load_weight(leaf, index, tensor)  # quantizes while loading
        else:
            dest.copy_(tensor)
        self.filled.add((param_name, key))

    def resolve(self, name: str, shape: Sequence[int] | None = None) -> tuple[str, Any, Any] | None:
        """(parameter name, row index or None, fill key) that checkpoint tensor `name` (of `shape`, where known)
        goes to; None if none."""
        if name in self.params:
            shared_slot = getattr(self._module(name.rpartition(".")[0]), "shared_slot", None)
            if shared_slot is not None and shape is not None and shape[0] == shared_slot:  # the routed experts fused:
                return name, slice(0, shared_slot), ROUTED  # all but the shared expert's slot
            return name, None, None
        module_name, _, leaf = name.rpartition(".")
        parent_name, _, child = module_name.rpartition(".")
        # q_proj -> qkv_proj[rows], gate_proj -> gate_up_proj[rows], declared by MergedLinear.source_names
        for fused_name, module in self._children(parent_name):
            if hasattr(module, "source_names") and child in module.source_names and leaf == "weight":
                shard = module.source_names.index(child)
                return _join(parent_name, fused_name, "weight"), module.shard_rows(shard), shard
        match = _EXPERT_RE.match(name)
        if match:
            experts = self._module(match["prefix"])
            if hasattr(experts, "per_expert_names") and match["proj"] in experts.per_expert_names:
                e, size = int(match["expert"]), experts.intermediate_size
                gate, up, down = experts.per_expert_names
                if match["proj"] == down:
                    return match["prefix"] + ".down_proj", (e,), (e, 2)
                rows = slice(0, size) if match["proj"] == gate else slice(size, 2 * size)
                return match["prefix"] + ".gate_up_proj", (e, rows), (e, 0 if match["proj"] == gate else 1)
        return None

    def _children(self, module_name: str):
        module = self._module(module_name)
        return module.named_children() if module is not None else ()

    def _module(self, name: str) -> nn.Module | None:
        try:
            return self.model.get_submodule(name)
        except AttributeError:
            return None

    def check_complete(self) -> None:
        missing = []
        for param_name, param in [*self.model.named_parameters(), *_checkpoint_buffers(self.model).items()]:
            if self.bare_decoder and param_name == "lm_head.weight" and (param_name, None) not in self.filled:
                param.data.zero_()  # a decoder-only checkpoint serves embeddings; its logits are never meaningful
                continue
            for key, ckpt_name in self._expected_pieces(param_name):
                if (param_name, key) not in self.filled:
                    missing.append(ckpt_name)
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ModelLoadError(f"checkpoint is missing tensors: {shown}")

    def _expected_pieces(self, param_name: str):
        module_name, _, leaf = param_name.rpartition(".")
        module = self._module(module_name)
        parent = module_name.rpartition(".")[0]
        if hasattr(module, "source_names") and leaf == "weight":
            return [(i, _join(parent, src, "weight")) for i, src in enumerate(module.source_names)]
        if hasattr(module, "per_expert_names") and (param_name, None) not in self.filled:
            names, shared_slot = module.per_expert_names, getattr(module, "shared_slot", None)
            projs = [0, 1] if leaf == "gate_up_proj" else [2]
            experts = range(module.num_experts)
            pieces = []
            if (param_name, ROUTED) in self.filled:  # the routed experts came fused; the shared slot per tensor
                experts, pieces = [shared_slot], [(ROUTED, param_name)]
            return pieces + [((e, p), f"{parent}.shared_expert.{names[p]}.weight" if e == shared_slot else
                              f"{module_name}.{e}.{names[p]}.weight") for e in experts for p in projs]
        return [(None, param_name)]


def _checkpoint_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Buffers that come from the checkpoint: persistent ones (not e.g. rotary inv_freq), and for FP8 modules
    only the weights they declare (their scales are computed while loading)."""
    found = {}
    for module_name, module in model.named_modules():
        declared = getattr(module, "checkpoint_buffers", None)
        for name, buf in module.named_buffers(recurse=False):
            if buf is None or name in module._non_persistent_buffers_set:
                continue
            if declared is None or name in declared:
                found[_join(module_name, name)] = buf
    return found


def dequantize_blockwise(tensors: Iterator[tuple[str, torch.Tensor]], quant_config: dict[str, Any]):
    """Hugging Face `quant_method: fp8` checkpoints: pair each FP8 weight with its block-wise
    `weight_scale_inv` and yield it converted to row-wise scales, dequantized one tensor at a time (the
    loader then re-quantizes it row-wise, or keeps the model dtype)."""
    block = tuple(quant_config.get("weight_block_size") or (128, 128))
    waiting: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        if name.endswith(".weight_scale_inv"):
            base = name[: -len("_scale_inv")]
        elif tensor.dtype == FP8_DTYPE and name.endswith(".weight"):
            base = name
        else:
            yield name, tensor
            continue
        if base not in waiting:
            waiting[base] = tensor
            continue
        other = waiting.pop(base)
        weight, scale_inv = (tensor, other) if name == base else (other, tensor)
        weight_fp8, row_scale = blockwise_to_rowwise(weight, scale_inv, block)
        yield base, weight_fp8.float() * row_scale
    if waiting:
        raise ModelLoadError(f"FP8 checkpoint tensors without their pair: {sorted(waiting)[:5]}")


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def empty_model(
    hf_config: dict[str, Any], device: torch.device | str, dtype: torch.dtype, quantization: str | None = None,
    layout: Layout | None = None, affine_spec: Callable[[nn.Module], QuantSpec] | None = None,
) -> nn.Module:
    """Our model of this config.json, built on the meta device (cut to this rank's part under a parallel
    `layout`; its linears and experts swapped for their FP8 forms when `quantization="fp8"`) and materialized
    uninitialized on `device`, computed buffers (RoPE) reset: ready for its weights. Raises ValueError for an
    unknown model_type or quantization, or a layout the model's shapes do not divide. `affine_spec`: which modules
    hold affine-quantized weights, in which format (engine/mlx_checkpoint; int4 / int8 and MLX checkpoints)."""
    module = get_model_module(hf_config["model_type"])
    refuse_absurd_sizes(hf_config, device, dtype)
    args = module.ModelArgs.from_hf_config(hf_config)
    with torch.device("meta"):
        model = module.Model(args)
        if layout is not None:
            apply_layout(model, layout)
        model = model.to(dtype)
    num_params = sum(p.numel() for p in model.parameters())
    affine = quantization in AFFINE_QUANTIZATIONS or affine_spec is not None  # int4 / int8 / an MLX checkpoint
    if not affine:
        _refuse_past_memory(num_params * (1 if quantization == "fp8" else dtype.itemsize), device,
                            "the model's weights")
    if quantization == "fp8":
        swap_to_fp8(model, dtype)
    elif affine:
        if layout is not None:
            raise ValueError("affine-quantized (int4 / int8, MLX) models are not split over processes yet")
        swap_to_affine(model, dtype, (affine_spec or recipe_spec(AFFINE_QUANTIZATIONS[quantization]))(model))
        _refuse_past_memory(resident_bytes(model), device, "the model's quantized weights")
    elif quantization is not None:
        raise ValueError(f"unknown quantization {quantization!r}; use fp8, int8 or int4")
    model = model.to_empty(device=device)
    model.tie_weights()  # to_empty gives every module its own tensor, which unties a shared lm_head
    for sub in model.modules():
        if hasattr(sub, "reset_buffers"):
            sub.reset_buffers()
    if layout is None:  # what a compile child builds the model's twin from (compile.twin)
        model.hf_config = hf_config
    return model.eval()


def refuse_absurd_sizes(hf_config: dict[str, Any], device: torch.device | str, dtype: torch.dtype) -> None:
    """Before anything is built: the embedding and the per-layer norms alone, which every decoder has, must fit
    the device's memory; the layer count must be sane. Raises ModelLoadError naming the sizes."""
    text = hf_config.get("text_config") if isinstance(hf_config.get("text_config"), dict) else hf_config
    sizes = {k: text.get(k) for k in ("vocab_size", "hidden_size", "num_hidden_layers")}
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in sizes.values()):
        return  # the model's own ModelArgs says what is missing
    if any(v <= 0 for v in sizes.values()) or sizes["num_hidden_layers"] > MAX_NUM_LAYERS:
        raise ModelLoadError(f"config.json has impossible sizes {sizes} (at most {MAX_NUM_LAYERS} layers)")
    num_params = (sizes["vocab_size"] + 2 * sizes["num_hidden_layers"]) * sizes["hidden_size"]
    _refuse_past_memory(num_params * dtype.itemsize, torch.device(device), f"config.json's sizes {sizes}")


def _refuse_past_memory(num_bytes: int, device: torch.device, what: str) -> None:
    if torch.device(device).type == "meta":
        return  # shapes only (benchmarks size real models this way): nothing is allocated
    available = memory_bytes(torch.device(device))
    if num_bytes > available:
        raise ModelLoadError(
            f"{what} need at least {num_bytes / 2**30:.1f} GiB of weights, more than the {available / 2**30:.1f} GiB "
            f"of memory available on {device}: refused before allocating"
        )


def memory_bytes(device: torch.device) -> int:
    """Memory that weights on `device` can take at most: free device memory (CUDA), Metal's working-set limit
    (MPS), available RAM (CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "mps":
        return int(torch.mps.recommended_max_memory())
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def load_model(
    model_dir: Path, device: torch.device, dtype: torch.dtype, quantization: str | None = None,
    layout: Layout | None = None, on_materialized: Callable[[nn.Module], None] | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """Build the architecture named by config.json (this rank's part of it under a parallel `layout`) and
    stream the weights in (quantized to FP8 tensor by tensor when `quantization="fp8"`, or when the checkpoint
    holds FP8 weights). `on_materialized(model)` runs once the model's tensors hold their device memory, before
    any weight is read."""
    config = read_config(model_dir)
    quant_config = config.get("quantization_config") or {}
    checkpoint_fp8 = quant_config.get("quant_method") == "fp8"
    if checkpoint_fp8 and quantization is None:
        log.info("%s holds FP8 weights: loading them as FP8 (row-wise scales)", model_dir)
        quantization = "fp8"
    # MLX-quantized checkpoints (mlx-community layout): their modules swapped for affine ones as they are stored
    mlx_table = mlx_quantization(config)
    affine_spec = None
    if mlx_table is not None:
        if quantization == "fp8":
            raise ModelLoadError(f"{model_dir} holds MLX {mlx_table['bits']}-bit weights; it cannot be loaded as FP8")
        log.info("%s is an MLX checkpoint (%s-bit affine, groups of %s): loading its packed weights as they are",
                 model_dir, mlx_table["bits"], mlx_table["group_size"])
        quantization, affine_spec = None, checkpoint_spec(config, mlx_table, safetensors_files(model_dir))
    try:
        model = empty_model(config, device, dtype, quantization, layout, affine_spec)
    except (ValueError, ModelLoadError) as exc:
        raise ModelLoadError(f"{model_dir}: {exc}") from None
    if on_materialized is not None:
        on_materialized(model)
    loader = WeightLoader(model)
    affine_loader = AffineLoader(model) if affine_modules(model) else None
    fp8_block = tuple(quant_config.get("weight_block_size") or (128, 128)) if checkpoint_fp8 else None
    with torch.no_grad():
        if mlx_table is not None:
            tensors = iter_mlx_checkpoint(safetensors_files(model_dir), model, config["model_type"])
        else:
            tensors = iter_checkpoint(safetensors_files(model_dir), model, fp8_block)
        if checkpoint_fp8:
            tensors = dequantize_blockwise(tensors, quant_config)
        tensors = split_tensors(model, tensors)
        if affine_loader is not None:
            tensors = affine_loader.filter(tensors)  # packed tensors, and float ones quantized as they stream in
        for name, tensor in tensors:
            loader.load(name, tensor)
    loader.check_complete()
    if affine_loader is not None:
        affine_loader.check_complete()
    return model, config


def split_tensors(model: nn.Module, tensors: Iterator[tuple[str, torch.Tensor]]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """A model may split one checkpoint tensor into several (Qwen3-Next's grouped GDN projections, whose rows
    split alike whether they hold float weights or packed ones with their scales and biases)."""
    split = getattr(model, "split_tensor", None)
    for name, tensor in tensors:
        yield from split(name, tensor) if split else [(name, tensor)]


def persistent_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by name, each tensor once (a tied LM head appears under the embedding)."""
    seen: set[int] = set()
    out = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out[name] = tensor
    return out


def resident_bytes(model: nn.Module) -> int:
    """Bytes of all weights: parameters and persistent buffers (FP8 weights and their scales, packed affine
    weights with their scales and biases, expert biases), each shared tensor once; not derived tables such as
    RoPE frequencies. Works on the meta device."""
    return sum(t.numel() * t.element_size() for t in persistent_tensors(model).values())


def bits_per_weight(model: nn.Module) -> float:
    """Bits of the resident weights per model weight, as mlx-lm reports it (compute_bits_per_weight): all
    persistent tensors' bytes (scales, biases, norms included) * 8 over the weights they stand for (a packed
    word for 32 / bits of them; scales and biases for none). 16 for a bf16 model, about 8.5 / 4.5 for affine
    8 / 4 bits in groups of 64, a little over 8 for FP8 (its row scales)."""
    tensors = persistent_tensors(model).values()
    counts = packed_weights(model)
    num_weights = sum(counts.get(id(t), t.numel()) for t in tensors)
    return 8 * sum(t.numel() * t.element_size() for t in tensors) / max(num_weights, 1)

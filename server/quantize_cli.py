"""`mps-serve quantize SRC DST --bits 4|8 [--group-size 64]`: a float checkpoint written as an MLX-quantized one
(mlx-community layout) that mlx-lm loads unchanged and mps-serve loads as stored.

The tensors equal `mlx_lm.convert -q`'s for the same weights and settings: the same quantization (kernels/affine.py,
MLX's rounding), the same recipe (engine/mlx_checkpoint.recipe_spec: MoE routers at 8 bits, layers the group does
not divide kept in the model dtype), experts stacked as `switch_mlp.<proj>`, and config.json's `quantization`
table with the per-module overrides mlx-lm writes. config.json also spells out the keys mlx-lm needs that
transformers 5 no longer writes (rope_theta, rope_scaling, num_experts).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path
from typing import Any

from server.engine.types import ModelLoadError

SHARD_BYTES = 5 << 30  # mlx-lm's shard size
# Hugging Face name -> mlx-lm name, per model_type (the inverse of engine/mlx_checkpoint.MLX_RENAMES)
_SWITCH_MLP = (r"\.mlp\.experts\.", ".mlp.switch_mlp.")
_QWEN3_5 = [(r"^model\.language_model\.", "language_model.model."), (r"^model\.", "language_model.model."),
            (r"^lm_head(?=\.|$)", "language_model.lm_head"), _SWITCH_MLP]
HF_TO_MLX: dict[str, list[tuple[str, str]]] = {
    "qwen3_moe": [_SWITCH_MLP],
    "qwen3_next": [_SWITCH_MLP],
    **dict.fromkeys(("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"), _QWEN3_5),
    "lfm2_moe": [(r"\.feed_forward\.experts\.", ".feed_forward.switch_mlp."),
                 *((rf"\.feed_forward\.(switch_mlp\.|){hf}(?=\.|$)", rf".feed_forward.\1{mlx}")
                   for hf, mlx in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")))],
}
# Tensors mlx_lm.convert keeps in their own dtype (the models' cast_predicate)
KEEP_DTYPE = {"lfm2_moe": ("expert_bias",), **dict.fromkeys(("qwen3_5", "qwen3_5_moe"), ("A_log",))}
_PER_EXPERT_RE = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
_FUSED_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")  # Qwen3.5's stored experts [E, 2I, H], [E, H, I]
DTYPES = ("bfloat16", "float16", "float32")
MLX_MODEL_TYPES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}  # mlx-lm has no *_text modules


def add_quantize_parser(sub, common) -> None:
    parser = sub.add_parser("quantize", parents=common,
                            help="write a float checkpoint as an MLX-quantized one (affine int4 / int8) that mlx-lm "
                                 "and mps-serve load")
    parser.add_argument("src", help="local Hugging Face checkpoint directory or Hub repo id (float weights)")
    parser.add_argument("dst", help="the directory to write (must not exist)")
    parser.add_argument("--bits", type=int, choices=[4, 8], required=True, help="bits per weight (required)")
    parser.add_argument("--group-size", type=int, choices=[32, 64, 128], default=64,
                        help="values per scale and bias along the input dimension (default: 64)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="dtype of the scales, biases and unquantized tensors (default: the checkpoint's)")


def cmd_quantize(args: argparse.Namespace) -> int:
    out = quantize_checkpoint(args.src, args.dst, args.bits, args.group_size, args.dtype)
    print(f"wrote {out}")
    return 0


def mlx_config(config: dict[str, Any]) -> dict[str, Any]:
    """config.json with the keys mlx-lm 0.32 reads spelled out: rope_theta / rope_scaling / partial_rotary_factor
    from transformers 5's rope_parameters, num_experts from num_local_experts, LFM2's block_dim; the text-only
    Qwen3.5 types as mlx-lm names them (qwen3_5_text -> qwen3_5, which reads a flat config as its text config)."""
    config = dict(config)
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config.setdefault("rope_theta", rope["rope_theta"])
    if "partial_rotary_factor" in rope:
        config.setdefault("partial_rotary_factor", rope["partial_rotary_factor"])
    if rope.get("rope_type") not in (None, "default"):
        config.setdefault("rope_scaling", rope)
    if "num_local_experts" in config:
        config.setdefault("num_experts", config["num_local_experts"])
    if config.get("model_type") == "lfm2":
        config.setdefault("block_dim", config["hidden_size"])
    config["model_type"] = MLX_MODEL_TYPES.get(config.get("model_type"), config.get("model_type"))
    if isinstance(config.get("text_config"), dict):  # Qwen3.5's multimodal config: the text model's keys
        config["text_config"] = mlx_config(config["text_config"])
    return config


def quantize_checkpoint(src: str, dst: str, bits: int, group_size: int = 64, dtype: str | None = None) -> Path:
    import torch
    from safetensors import safe_open

    from server.engine.mlx_checkpoint import (
        ROUTER_SUFFIXES,
        AffineLoader,
        hf_tensor_to_mlx,
        mlx_quantization,
        quantized_target,
        recipe_spec,
    )
    from server.engine.weights import empty_model, read_config, resolve_model_path, safetensors_files
    from server.kernels import affine

    src_dir, dst_dir = resolve_model_path(src), Path(dst)
    if dst_dir.exists():
        raise ValueError(f"{dst_dir} already exists; name a new directory")
    config = read_config(src_dir)
    if mlx_quantization(config) is not None or config.get("quantization_config"):
        raise ModelLoadError(f"{src_dir} is already quantized; quantize a float checkpoint")
    model_type = config["model_type"]
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}  # Qwen3.5's nesting
    dtype = dtype or next((c[k] for c in (config, text) for k in ("dtype", "torch_dtype") if c.get(k)), None)
    torch_dtype = getattr(torch, dtype) if dtype in DTYPES else torch.bfloat16
    model = empty_model(config, "meta", torch_dtype, None, None, recipe_spec(bits, group_size))
    loader = AffineLoader(model)  # which checkpoint tensors are quantized, in which format
    table: dict[str, Any] = {"group_size": group_size, "bits": bits, "mode": "affine"}
    out: dict[str, Any] = {}
    stacks: dict[str, dict[int, Any]] = {}  # per-expert weights gathered to be stacked (switch_mlp)

    def emit(hf_module: str, weight, fmt) -> None:
        mlx_module = hf_to_mlx(model_type, hf_module)
        if fmt is None:
            out[mlx_module + ".weight"] = weight
            return
        pieces = affine.quantize_affine(weight, fmt.group_size, fmt.bits)
        out.update(zip((f"{mlx_module}.{leaf}" for leaf in ("weight", "scales", "biases")), pieces, strict=True))
        if (fmt.group_size, fmt.bits) != (group_size, bits) or hf_module.endswith(ROUTER_SUFFIXES):
            table[mlx_module] = {"group_size": fmt.group_size, "bits": fmt.bits}  # as mlx-lm's quant_predicate

    keep = KEEP_DTYPE.get(mlx_config(config)["model_type"], ())
    for file in safetensors_files(src_dir):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                ours = model.sanitize(name)
                if ours is None:
                    continue
                tensor = hf_tensor_to_mlx(model_type, ours, handle.get_tensor(name))  # before the cast, as mlx-lm
                if tensor.is_floating_point() and not name.endswith(keep):
                    tensor = tensor.to(torch_dtype)
                quantizable = name.endswith((".weight", *_FUSED_EXPERTS))
                target = quantized_target(loader, model, ours, tensor) if quantizable else None
                if target is None:
                    out[hf_to_mlx(model_type, name)] = tensor
                    continue
                module, fmt = target
                if name.endswith(_FUSED_EXPERTS):  # mlx-lm stores gate and up apart
                    base, _, proj = name.rpartition(".")
                    gate, up, down = (f"{base}.{p}" for p in module.per_expert_names)
                    if proj == "down_proj":
                        emit(down, tensor, fmt)
                    else:
                        emit(gate, tensor[:, : module.intermediate_size], fmt)
                        emit(up, tensor[:, module.intermediate_size :], fmt)
                    continue
                match = _PER_EXPERT_RE.match(name)
                if match:
                    key = f"{match['prefix']}.{match['proj']}"
                    stacks.setdefault(key, {})[int(match["expert"])] = tensor
                    routed = module.num_experts if module.shared_slot is None else module.shared_slot
                    if len(stacks[key]) == routed:
                        experts = stacks.pop(key)
                        emit(key, torch.stack([experts[e] for e in range(routed)]), fmt)
                    continue
                emit(name.removesuffix(".weight"), tensor, fmt)
    if stacks:
        raise ModelLoadError(f"experts missing from {sorted(stacks)[:3]}: every expert's weight is needed to stack them")
    write_mlx_checkpoint(src_dir, dst_dir, mlx_config(config), table, out)
    return dst_dir


def hf_to_mlx(model_type: str, name: str) -> str:
    for pattern, replacement in HF_TO_MLX.get(model_type, ()):
        name = re.sub(pattern, replacement, name)
    return name


def write_mlx_checkpoint(src_dir: Path, dst_dir: Path, config: dict[str, Any], table: dict[str, Any],
                         tensors: dict[str, Any]) -> None:
    """Shards of at most SHARD_BYTES as mlx-lm names them, the index, config.json with `quantization` (and the
    same as `quantization_config`), and every other file of the source (tokenizer, chat template)."""
    from safetensors.torch import save_file

    dst_dir.mkdir(parents=True)
    shards: list[dict[str, Any]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name].contiguous()
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(dst_dir / file), metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (dst_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
    config = {**config, "quantization": table, "quantization_config": table}
    (dst_dir / "config.json").write_text(json.dumps(dict(sorted(config.items())), indent=4))
    for file in src_dir.iterdir():
        if file.is_file() and not file.name.startswith(("model", "config.json")) and file.suffix != ".safetensors":
            shutil.copy(file, dst_dir / file.name)

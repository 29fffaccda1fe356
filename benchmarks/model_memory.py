"""The README's "Models and memory" table, computed from the presets' configs (real model shapes): weight
bytes in bf16 and in FP8 as the engine stores them (counted on the meta device, nothing is allocated), the KV
cache per token, and which form fits a Mac of each unified-memory size.

    PYTHONPATH=. python3 benchmarks/model_memory.py

A model fits when its weights, a KV cache of KV_TOKENS tokens in bf16 (one long conversation, or several short
ones) and OVERHEAD_BYTES (activations, compiled graphs) fit in the memory macOS lets the GPU use: about 2/3 of
unified memory up to 36 GB, 3/4 above.
"""

from __future__ import annotations

import torch

from server.bench.measure import total_weight_bytes
from server.bench.presets import available_presets, load_preset
from server.engine.model_runner import KVCache
from server.engine.weights import empty_model

MEMORY_GB = (16, 24, 36, 48, 64, 96, 128)
KV_TOKENS = 32768
OVERHEAD_BYTES = 2 * 10**9


def usable_bytes(memory_gb: int) -> float:
    return memory_gb * 1e9 * (2 / 3 if memory_gb <= 36 else 3 / 4)


def sizes(name: str) -> dict:
    hf_config = load_preset(name).hf_config
    bf16 = empty_model(hf_config, "meta", torch.bfloat16)
    fp8 = empty_model(hf_config, "meta", torch.bfloat16, "fp8")
    kv_per_token = KVCache.bytes_per_block(bf16.kv_cache_shapes(), 1, torch.bfloat16)
    return {
        "name": name,
        "model_type": hf_config["model_type"],
        "params": sum(p.numel() for p in bf16.parameters()),
        "bf16": total_weight_bytes(bf16),
        "fp8": total_weight_bytes(fp8),
        "kv_per_token": kv_per_token,
    }


def fitting(row: dict, memory_gb: int) -> str:
    extra = row["kv_per_token"] * KV_TOKENS + OVERHEAD_BYTES
    for form in ("bf16", "fp8"):
        if row[form] + extra <= usable_bytes(memory_gb):
            return form
    return "-"


def flags(row: dict) -> str:
    fits = {gb: fitting(row, gb) for gb in MEMORY_GB}
    bf16_from = next((gb for gb in MEMORY_GB if fits[gb] == "bf16"), None)
    fp8_from = next((gb for gb in MEMORY_GB if fits[gb] == "fp8"), None)
    if fp8_from is None and bf16_from is None:
        return "over 128 GB: not on one Mac"
    if fp8_from is None or bf16_from == fp8_from:
        return f"none needed from {bf16_from} GB"
    if bf16_from is None:
        return f"`--quantize fp8` from {fp8_from} GB"
    last_fp8 = MEMORY_GB[MEMORY_GB.index(bf16_from) - 1]
    span = f"{fp8_from}" if last_fp8 == fp8_from else f"{fp8_from}-{last_fp8}"
    return f"`--quantize fp8` on {span} GB; none from {bf16_from} GB"


def table() -> str:
    rows = [sizes(n) for n in available_presets() if n != "tiny-moe"]
    header = ["preset (real shapes)", "model_type", "params", "bf16", "FP8", "KV / 1k tokens",
              *(f"{gb} GB" for gb in MEMORY_GB), "recommended flags"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in sorted(rows, key=lambda r: r["bf16"]):
        cells = [f"`{row['name']}`", f"`{row['model_type']}`", f"{row['params'] / 1e9:.1f}B",
                 f"{row['bf16'] / 1e9:.1f} GB", f"{row['fp8'] / 1e9:.1f} GB",
                 f"{row['kv_per_token'] * 1024 / 2**20:.0f} MiB", *(fitting(row, gb) for gb in MEMORY_GB), flags(row)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())

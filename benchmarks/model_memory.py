"""The README's "Models and memory" tables, computed from the presets' configs (real model shapes) by
server/engine/model_size.py, as `mps-serve info MODEL` computes them: weight bytes in bf16, FP8, int8 and int4 as
the engine stores them (counted on the meta device, nothing is allocated), bits per weight, the KV cache per token,
and which form fits a Mac of each unified-memory size.

    PYTHONPATH=. python3 benchmarks/model_memory.py

A form fits when its weights, a KV cache of KV_TOKENS tokens in bf16 (one long conversation, or several short
ones) and OVERHEAD_BYTES (activations, compiled graphs) fit in the memory macOS lets the GPU use: about 2/3 of
unified memory up to 36 GB, 3/4 above. A cell names the first of bf16, FP8, int8, int4 that fits.
"""

from __future__ import annotations

from server.bench.presets import available_presets, load_preset
from server.engine.model_size import MAC_MEMORY_GB, ModelSizes, best_form, model_sizes

FLAG = {"bf16": "none", "fp8": "`--quantize fp8`", "int8": "`--quantize int8`", "int4": "`--quantize int4`"}


def kv_mib_per_1k(sizes: ModelSizes) -> str:
    return f"{sizes.kv_bytes_per_token * 1024 / 2**20:.0f} MiB"


def flags(sizes: ModelSizes) -> str:
    """The flag for each run of Mac sizes that serve the same form, e.g. "`--quantize int4` on 24-36 GB; none
    from 48 GB"."""
    runs: list[tuple[str, list[int]]] = []
    for gb in MAC_MEMORY_GB:
        form = best_form(sizes, gb)
        if form is None:
            continue
        if runs and runs[-1][0] == form:
            runs[-1][1].append(gb)
        else:
            runs.append((form, [gb]))
    if not runs:
        return f"over {MAC_MEMORY_GB[-1]} GB: not on one Mac"
    parts = []
    for i, (form, gbs) in enumerate(runs):
        if i == len(runs) - 1 and gbs[-1] == MAC_MEMORY_GB[-1]:
            parts.append(f"{FLAG[form]} from {gbs[0]} GB")
        else:
            parts.append(f"{FLAG[form]} on {gbs[0]}" + (f"-{gbs[-1]}" if len(gbs) > 1 else "") + " GB")
    return "; ".join(parts)


def rows() -> list[tuple[str, ModelSizes]]:
    found = [(n, model_sizes(load_preset(n).hf_config)) for n in available_presets() if n != "tiny-moe"]
    return sorted(found, key=lambda row: row[1].forms["bf16"].weight_bytes)


def size_cell(sizes: ModelSizes, form: str) -> str:
    size = sizes.forms[form]
    gb = f"{size.weight_bytes / 1e9:.1f} GB"
    return gb if form in ("bf16", "fp8") else f"{gb} ({size.bits_per_weight:.2f})"


def size_table(found: list[tuple[str, ModelSizes]]) -> str:
    header = ["preset (real shapes)", "model_type", "params", "bf16", "FP8", "int8 (bits/weight)",
              "int4 (bits/weight)", "KV / 1k tokens", "recommended flags"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, sizes in found:
        cells = [f"`{name}`", f"`{sizes.model_type}`", f"{sizes.params / 1e9:.1f}B",
                 *(size_cell(sizes, form) for form in sizes.forms), kv_mib_per_1k(sizes), flags(sizes)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fit_table(found: list[tuple[str, ModelSizes]]) -> str:
    header = ["Mac memory", *(f"`{name}`" for name, _ in found)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for gb in MAC_MEMORY_GB:
        lines.append("| " + " | ".join([f"{gb} GB", *(best_form(sizes, gb) or "-" for _, sizes in found)]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    found = rows()
    print(size_table(found))
    print()
    print(fit_table(found))

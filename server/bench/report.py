"""Bench records: one JSON object per batch size (JSON lines, appended), and a table for people."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from server.bench.measure import Rates, WeightBytes

FORMULAS = (
    "decode tok/s: steady rate B*(n_long-n_short)/(t_long-t_short), prefill and warm-up excluded; ms/tok: time "
    "between two tokens of one sequence (one decode step). GB/s = weight bytes per step / step time (weights are "
    "read once per step; at batch B, MoE layers read 1-(1-k/E)^B of their experts); roofline = GB/s / copy GB/s "
    "of a device-to-device copy measured in this run (KV-cache reads not counted). kernels/step: device kernels "
    "of one steady decode step by torch.profiler, outside the timed calls: CUDA kernel records (graph replays "
    "included) on CUDA, else ATen ops that do device work (a compiled step's generated kernels are none); "
    "kernel ms: their summed durations (CUDA; the rest of ms/tok is host time or idle). "
    "graphs: whether decode steps replayed CUDA graphs (n/a: not off, but none here: they need the compiled "
    "decode step on CUDA). launch: who launches the decode step's kernels (a CUDA graph replay, inductor's C++ "
    "or Python wrapper code, or the eager model op by op)."
)


def speed_fields(rates: Rates, weights: WeightBytes, copy_gb_s: float, prefix: str = "") -> dict[str, Any]:
    bytes_per_step = weights.per_step(rates.batch_size)
    achieved = bytes_per_step / rates.step_s / 1e9
    return {
        f"{prefix}decode_tok_s": rates.decode_tok_s,
        f"{prefix}prefill_tok_s": rates.prefill_tok_s,
        f"{prefix}ms_per_token": rates.step_s * 1e3,
        f"{prefix}achieved_gb_s": achieved,
        f"{prefix}roofline_fraction": achieved / copy_gb_s,
        f"{prefix}compile_s": rates.warmup_s,
        f"{prefix}first_call_s": rates.t_first,
        f"{prefix}times_s": {"t1": rates.t_one, "t_short": rates.t_short, "t_long": rates.t_long},
    }


def roofline_fields(batch_size: int, weights: WeightBytes, copy_gb_s: float) -> dict[str, Any]:
    bytes_per_step = weights.per_step(batch_size)
    return {
        "weight_bytes_per_token": weights.per_token,
        "weight_bytes_per_step": bytes_per_step,
        "roofline_decode_tok_s": batch_size * copy_gb_s * 1e9 / bytes_per_step,
    }


def check_finite(record: dict[str, Any]) -> list[str]:
    """Names of numeric fields that are not positive finite numbers (printed as a warning, never hidden)."""
    bad = []
    for key, value in record.items():
        if isinstance(value, float) and not (math.isfinite(value) and value > 0) and not key.endswith("compile_s"):
            bad.append(key)
    return bad


def append_json_lines(path: str, records: list[dict[str, Any]]) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as handle:
        for record in records:
            handle.write(json.dumps(record, sort_keys=True) + "\n")


def gigabytes(num_bytes: int) -> str:
    return f"{num_bytes / 1e9:.3f} GB" if num_bytes >= 1e8 else f"{num_bytes / 1e6:.3f} MB"


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def graph_mode(record: dict[str, Any]) -> str:
    """on / off / n/a: graphs not turned off, but none replayed (they need the compiled decode step on CUDA)."""
    if record["cuda_graphs"]:
        return "on"
    return "off" if record["engine_config"]["cuda_graphs"] is False else "n/a"


def _bits(record: dict[str, Any]) -> str:
    """Resident bits per weight of a record (absent from records written before it was measured)."""
    return _fmt(record.get("bits_per_weight"), ".2f")


def table(records: list[dict[str, Any]]) -> str:
    if not records:
        return "(no results)"
    first = records[0]
    quantizations = list(dict.fromkeys(r["quantize"] for r in records))
    several = len(quantizations) > 1  # then bytes per step go in a column
    title = (
        f"{first['preset']} ({first['model_type']}) on {first['device']} [{first['gpu_name']}], {first['dtype']}, "
        f"quantize={','.join(quantizations)}, prompt {first['prompt_len']}, decode {first['num_decode_tokens']}, "
        f"torch {first['torch_version']}; copy {first['copy_gb_s']:.0f} GB/s; "
        + ("" if several else f"{gigabytes(first['weight_bytes_per_token'])} of weights read per "
           f"token at batch 1 ({_bits(first)} bits per weight); model + engine built in {first['build_s']:.1f} s; ")
        + f"kernels/step counted as {first['kernels_counted_by']}"
    )
    header = ["graphs", "launch", "B", "decode tok/s", "ms/tok", "kernels/step", "kernel ms", "prefill tok/s",
              "GB/s", "roofline", "warm-up s"]
    if several:
        header = ["quantize", "bits/w", "weights/step", *header]
    comparing = any("peer_decode_tok_s" in r for r in records)
    if comparing:
        header += ["peer tok/s", "peer roofline", "speedup"]
    rows = []
    for r in records:
        row = [graph_mode(r), r.get("kernel_launch", "-"), str(r["batch_size"]), _fmt(r["decode_tok_s"], ".1f"),
               _fmt(r["ms_per_token"], ".2f"), _fmt(r["kernels_per_step"], "d"),
               _fmt(r.get("kernel_ms_per_step"), ".3f"), _fmt(r["prefill_tok_s"], ".0f"),
               _fmt(r["achieved_gb_s"], ".1f"),
               _fmt(r["roofline_fraction"] * 100, ".1f") + "%", _fmt(r["compile_s"], ".1f")]
        if several:
            row = [r["quantize"], _bits(r), gigabytes(r["weight_bytes_per_step"]), *row]
        if comparing:
            frac = r.get("peer_roofline_fraction")
            row += [_fmt(r.get("peer_decode_tok_s"), ".1f"), "-" if frac is None else f"{frac * 100:.1f}%",
                    _fmt(r.get("speedup_vs_peer"), ".2f") + ("x" if r.get("speedup_vs_peer") else "")]
        rows.append(row)
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = [title, "  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    notes = {r["peer_mode"] for r in records if r.get("peer_mode")}
    notes |= {r["peer_note"] for r in records if r.get("peer_note")}
    lines += [f"peer: {n}" for n in sorted(notes)]
    lines.append(FORMULAS)
    return "\n".join(lines)

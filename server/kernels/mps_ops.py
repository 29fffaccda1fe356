"""What torch 2.15's MPS backend runs, from the table tools/mps_ops/generate.py builds out of the release itself
(mps_ops.json beside this file): which aten ops have an MPS kernel, which run their decomposition, which go to the
CPU; the dtypes MPS refuses or limits; what inductor's Metal code generator can lower.

Tests check every op of the MPS step plans against it on the CPU (tests/kernels/test_mps_audit.py); `mps-serve
info` lists the plan's ops that would run through PyTorch's CPU fallback.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from server.kernels.capabilities import Capabilities, Probe

TABLE = Path(__file__).with_name("mps_ops.json")
# The ops the MPS step plans run (tools/mps_ops/record_plan.py; the audit test keeps it complete).
PLAN_OPS = Path(__file__).with_name("mps_plan_ops.json")
# The kinds of op that run on MPS: a kernel of its own, or the ops its decomposition calls (checked in turn).
RUNS = ("mps", "composite_explicit", "composite_implicit")
# Decompositions that pick a backend's own op (at::_fused_sdp_choice, rms_norm's MPS branch): on the CPU they call
# other ops (CPU-only ones for attention), so the
# audit records the op itself (or, in a traced graph, the CPU's pick) and checks what MPS runs in its place.
# Our own ops (kernels.fp8.fp8_cast) are audited as the aten op they run.
MPS_CHOICES = {"scaled_dot_product_attention": "_scaled_dot_product_attention_math_for_mps",
               "rms_norm": "_fused_rms_norm",
               "_scaled_dot_product_flash_attention_for_cpu": "_scaled_dot_product_attention_math_for_mps",
               "mps_serve::fp8_cast": "_to_copy"}


@dataclass(frozen=True)
class MpsTable:
    torch_version: str
    commit: str
    kinds: dict[str, frozenset[str]]  # kind -> "op.overload" names ("op" for the default overload)
    cpu_fallback: dict[str, str]
    never_dtypes: frozenset[str]
    limited_dtypes: dict[str, frozenset[str]]  # dtype -> the ops with a kernel for it
    metal: dict  # inductor's Metal code generator: dtypes, reductions, limits

    def kind(self, op: str) -> str:
        """'mps', 'composite_explicit', 'composite_implicit', 'mps_choice', 'cpu_fallback' or 'missing' for an op as
        torch spells it ('aten::add.Tensor', 'aten::relu', 'add.Tensor', 'relu.default')."""
        name = op_name(op)
        if name in self.cpu_fallback:
            return "cpu_fallback"
        if name in MPS_CHOICES:
            return "mps_choice" if self.kind(MPS_CHOICES[name]) in RUNS else "missing"
        return next((kind for kind in RUNS if name in self.kinds[kind]), "missing")

    def dtype_problem(self, op: str, dtypes: tuple[str, ...]) -> str | None:
        """Why MPS cannot run `op` on tensors of `dtypes` (None: it can)."""
        name = op_name(op)
        for dtype in dtypes:
            if dtype in self.never_dtypes:
                return f"MPS has no {dtype}"
            limited = self.limited_dtypes.get(dtype)
            if limited is not None and name not in limited and name.split(".")[0] not in limited:
                return f"MPS has no {name} kernel for {dtype}"
        return None


def op_name(op: str) -> str:
    """'aten::add.Tensor' -> 'add.Tensor'; 'aten::relu' and 'relu.default' -> 'relu'."""
    name = op.removeprefix("aten::")
    return name.removesuffix(".default")


@functools.cache
def mps_table() -> MpsTable:
    raw = json.loads(TABLE.read_text())

    def names(grouped: dict[str, list[str]]) -> frozenset[str]:
        return frozenset(f"{op}.{overload}" if overload else op for op, overloads in grouped.items() for overload in overloads)

    dtypes = raw["dtypes"]
    return MpsTable(raw["torch"], raw["commit"], {kind: names(raw[kind]) for kind in RUNS}, raw["cpu_fallback"],
                    frozenset(dtypes["never"]), {k: frozenset(v) for k, v in dtypes["limited"].items()},
                    raw["inductor_metal"])


def table_capabilities(table: MpsTable | None = None) -> Capabilities:
    """The probe's answers on a Mac with the table's torch, read from the table: what a plan for MPS is built from
    on a machine without one (tests, the audit). Each reason names the table entry it rests on."""
    table = table or mps_table()
    where = f"torch {table.torch_version} table"

    def has(op: str) -> Probe:
        ok = table.kind(op) == "mps"
        return Probe(ok, f"{op} {'has' if ok else 'has no'} MPS kernel ({where})")

    fp8_codegen = "float8_e4m3fn" in table.metal["dtypes"]
    widens = "_to_copy" in table.limited_dtypes.get("float8_e4m3fn", ())  # the eager form; compiled needs fp8_codegen
    grouped = has("_grouped_mm")
    # torch 2.15's shape function (_meta_registrations) takes bf16, fp16 and fp32 operands
    traced = Probe(grouped.ok, f"{grouped.reason}; its 2.15 shape function takes bf16, fp16, fp32")
    return Capabilities(
        device="mps", torch_version=table.torch_version,
        fp8_rowwise=has("_scaled_mm_v2"), fp8_rowwise_bias=has("_scaled_mm_v2"),
        grouped_mm_bf16=grouped, grouped_mm_fp16=grouped, grouped_mm_fp32=grouped,
        grouped_mm_bf16_traced=traced, grouped_mm_fp16_traced=traced, grouped_mm_fp32_traced=traced,
        fp8_grouped=has("_scaled_grouped_mm_v2"),
        fp8_weight_only=Probe(widens, f"float8 -> float32 {'has' if widens else 'has no'} copy kernel ({where})"),
        fp8_codegen=Probe(fp8_codegen, f"Metal code generator {'has' if fp8_codegen else 'has no'} float8 type ({where})"),
        private_spellings=Probe(table.kind("_scaled_mm") == "mps", f"torch._scaled_mm on MPS per the {where}"),
        streams=Probe(True, f"torch.mps.Stream + Event ({where})"),
        compile=Probe(True, f"inductor (mps) ({where})"),
    )


def ops_not_on_mps(ops: dict[str, set[tuple[str, ...]]], table: MpsTable | None = None) -> dict[str, str]:
    """{op: why} for the recorded ops (name -> the dtype tuples it ran with) that MPS cannot run as recorded."""
    table = table or mps_table()
    problems = {}
    for op, dtype_sets in sorted(ops.items()):
        kind = table.kind(op)
        if kind == "missing":
            problems[op] = f"no MPS kernel in torch {table.torch_version}"
        elif kind == "cpu_fallback":
            problems[op] = table.cpu_fallback[op_name(op)]
        elif kind != "composite_implicit":  # a decomposed op's dtypes are its parts'
            runs = MPS_CHOICES.get(op_name(op), op)
            problem = next(filter(None, (table.dtype_problem(runs, dtypes) for dtypes in sorted(dtype_sets))), None)
            if problem:
                problems[op] = problem
    return problems


def live_has_mps_kernel(op: str) -> bool:
    """Whether the running torch has an MPS kernel (or a decomposition) for `op`: on a Mac, the dispatcher's own
    answer, which may be newer than the table's."""
    name = op if "::" in op else f"aten::{op}"
    name = name.removesuffix(".default")
    keys = ("MPS", "CompositeExplicitAutograd", "CompositeImplicitAutograd")
    return any(torch._C._dispatch_has_kernel_for_dispatch_key(name, key) for key in keys)


def plan_ops() -> dict[str, list[str]]:
    """op -> the dtypes its tensors had, over every architecture and precision of the MPS plans."""
    return json.loads(PLAN_OPS.read_text())["ops"]


def fallback_report(on_mps: bool, ops: dict[str, list[str]] | None = None) -> list[str]:
    """`mps-serve info`'s lines: the MPS plans' ops (`ops`, default plan_ops()) that would run through PyTorch's
    CPU fallback. Per the table (torch 2.15, expected none), and on a Mac per the running torch's own dispatcher."""
    table, ops = mps_table(), plan_ops() if ops is None else ops
    static = ops_not_on_mps({name: {tuple(dtypes)} for name, dtypes in ops.items()}, table)
    lines = [f"MPS ops: the step plans run {len(ops)} aten ops; per torch {table.torch_version}'s MPS kernels "
             f"(commit {table.commit[:12]}) {len(static) or 'none'} would run through the CPU fallback"]
    lines += [f"  {op}: {why}" for op, why in static.items()]
    if on_mps:
        live = [op for op in ops if op.startswith("aten::") and not live_has_mps_kernel(op)]
        lines.append(f"  this torch ({torch.__version__}): {', '.join(live) if live else 'every op has an MPS kernel'}")
    return lines

"""Regenerate server/kernels/mps_ops.json: the aten ops and dtypes torch 2.15's MPS backend has, and what inductor's
Metal code generator can lower, read from the torch 2.15.0 release itself.

Usage (from the repository root; the wheel is the macOS arm64 build of the release, ~140 MB):

    pip download --no-deps --only-binary=:all: --platform macosx_14_0_arm64 --python-version 311 \
        torch==2.15.0 -d /tmp/torch-2.15
    python tools/mps_ops/generate.py /tmp/torch-2.15/torch-2.15.0-cp311-cp311-macosx_14_0_arm64.whl

What it reads from the wheel (its torch/version.py names the commit, recorded in the table):
- torchgen/packaged/ATen/native/native_functions.yaml, the release's copy of aten/src/ATen/native/: every op whose
  dispatch names MPS (or whose structured delegate's does) has an MPS kernel; CompositeExplicitAutograd ops run on
  any backend through the ops they call; ops with no dispatch (CompositeImplicitAutograd) decompose before any
  backend sees them.
- torch/lib/libtorch_cpu.dylib, the built MPS backend: every yaml MPS op must have its generated
  `wrapper_MPS_<op>` registration there (checked); the embedded Metal library's kernel names say which ops have
  kernels for the dtypes MPSGraph lacks (float8_e4m3fn, the unsigned integers).
- torch/mps/__init__.py: the names torch.mps exports (its streams and events).
- torch/_inductor/codegen/mps.py: the dtypes, reductions, store modes and pointwise ops the Metal code generator
  emits; anything else in a compiled MPS step either falls back to an aten kernel (then it must be in the table) or
  fails the compile.

Two registration sets outside the yaml come from aten/src/ATen/mps/MPSFallback.mm and the TORCH_LIBRARY_IMPL(aten,
MPS, m) blocks under aten/src/ATen/native/mps/ (LIBRARY_IMPLS, CPU_FALLBACKS below, read from pytorch's sources);
each name is checked to be in the release binary.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import zipfile
from collections import defaultdict
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "server" / "kernels" / "mps_ops.json"

# TORCH_LIBRARY_IMPL(aten, MPS, m) registrations outside native_functions.yaml (aten/src/ATen/native/mps/): real
# MPS kernels.
LIBRARY_IMPLS = ["_copy_from", "_copy_from_and_resize", "grid_sampler_2d_backward", "_upsample_trilinear3d",
                 "upsample_trilinear3d.out"]
# aten/src/ATen/mps/MPSFallback.mm: ops registered for MPS that run on the CPU (with a warning), whatever
# PYTORCH_ENABLE_MPS_FALLBACK says; every other op without an MPS kernel raises unless that variable is 1.
CPU_FALLBACKS = ["embedding_renorm_", "linalg_svd", "linalg_svd.U", "col2im", "upsample_nearest3d.vec"]

# Metal kernel families (the kernel name before its dtype suffix) -> the aten ops they implement, for the dtypes
# MPSGraph has no type for: only ops with a kernel instantiated for such a dtype take its tensors.
KERNEL_FAMILY_OPS = {
    "copy": ["_to_copy", "copy_", "clone", "_copy_from", "_copy_from_and_resize", "contiguous"],
    "eq": ["eq.Tensor", "eq.Scalar"], "ne": ["ne.Tensor", "ne.Scalar"],
    "lt": ["lt.Tensor", "lt.Scalar"], "le": ["le.Tensor", "le.Scalar"],
    "gt": ["gt.Tensor", "gt.Scalar"], "ge": ["ge.Tensor", "ge.Scalar"],
    "logical_and": ["logical_and"], "logical_or": ["logical_or"], "logical_xor": ["logical_xor"],
    "gather": ["gather", "index.Tensor", "index_select"],
    "scatter_set": ["scatter.src", "scatter.value", "index_put_", "_index_put_impl_", "index_copy_"],
    "constant_pad_nd": ["constant_pad_nd"], "eye": ["eye"], "fill": ["fill_.Scalar", "zero_"],
    "cat": ["cat"], "where": ["where.self"], "scaled_mm": ["_scaled_mm_v2", "_scaled_mm_v2.out"],
    "sort_block": ["sort", "topk"], "radix_scatter": ["sort", "topk"], "random_int": ["random_"],
}
# Metal's type names for the dtypes whose ops are limited to the families found.
LIMITED_DTYPES = {"float8_e4m3fn": "float8_e4m3fn", "uint32": "uint", "uint16": "ushort", "uint64": "ulong"}
# Allocation and metadata ops: no kernel reads the data, so any dtype the device can hold works.
ANY_DTYPE = ["empty.memory_format", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "set_.source_Storage",
             "set_.source_Storage_storage_offset", "resize_", "as_strided", "view", "view.dtype", "_reshape_alias",
             "alias", "detach", "t", "transpose.int", "permute", "expand", "slice.Tensor", "select.int", "unsqueeze",
             "squeeze.dim", "squeeze.dims", "unfold", "narrow", "split.Tensor", "split_with_sizes", "unbind.int",
             "_unsafe_view", "lift_fresh", "diagonal", "chunk", "split_with_sizes_copy"]


def op_key(func: str) -> str:
    """'add.Tensor(Tensor self, ...) -> Tensor' -> 'add.Tensor'; the default overload is the bare name."""
    return func.split("(", 1)[0]


def dispatch_keys(entry: dict) -> set[str]:
    keys = set()
    for spec in (entry.get("dispatch") or {}):
        keys.update(part.strip() for part in spec.split(","))
    return keys


def classify(functions: list[dict]) -> dict[str, set[str]]:
    by_name = {op_key(entry["func"]): entry for entry in functions}
    kinds: dict[str, set[str]] = {"mps": set(), "composite_explicit": set(), "composite_implicit": set()}
    for name, entry in by_name.items():
        keys = dispatch_keys(entry)
        delegate = entry.get("structured_delegate")
        if delegate:
            keys |= dispatch_keys(by_name[delegate])
        if "MPS" in keys:
            kinds["mps"].add(name)
        elif keys & {"CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional"}:
            kinds["composite_explicit"].add(name)
        elif not keys or "CompositeImplicitAutograd" in keys:
            kinds["composite_implicit"].add(name)
    return kinds


def wrapper_names(name: str) -> list[str]:
    """torchgen's names for an op's MPS wrapper: `name_overload` (structured), `overload_name` (others), with the
    overload once more after either, or `name_out_overload`, for out= variants."""
    base, _, overload = name.partition(".")
    if not overload:
        return [f"_{base}", base]
    return [f"{base}_{overload}", f"{overload}_{base}", f"{base}_{overload}_{overload}", f"{overload}_{base}_{overload}",
            f"{base}_out_{overload}"]


def check_registrations(mps_ops: set[str], binary: bytes) -> list[str]:
    """yaml MPS ops that have no generated `wrapper_MPS_` function in the binary (expected none). The mangled
    symbol goes on after the identifier with an upper-case letter or a digit, never a lower-case one."""
    wrappers = {m.decode() for m in re.findall(rb"wrapper_MPS_([A-Za-z0-9_]+)", binary)}

    def registered(candidate: str) -> bool:
        return any(w.startswith(candidate) and not re.match(r"[a-z_]", w[len(candidate):len(candidate) + 1])
                   for w in wrappers)

    return [name for name in sorted(mps_ops) if not any(registered(c) for c in wrapper_names(name))]


def metal_kernel_families(names: set[str], metal_type: str) -> set[str]:
    """Kernel families of the embedded Metal library (`names`: its identifiers) with a kernel for `metal_type`."""
    found = set()
    for name in names:
        for family in KERNEL_FAMILY_OPS:
            if name.startswith(family + "_") and re.search(rf"(^|_){metal_type}(_|$)", name[len(family):]):
                found.add(family)
    return found


def limited_dtypes(binary: bytes) -> dict[str, list[str]]:
    pattern = rb"(?<![A-Za-z0-9_])((?:" + b"|".join(re.escape(f).encode() for f in KERNEL_FAMILY_OPS) + rb")_[a-z0-9_]{1,100})"
    names = {m.decode() for m in re.findall(pattern, binary)}
    table = {}
    for dtype, metal_type in LIMITED_DTYPES.items():
        ops = set(ANY_DTYPE)
        for family in metal_kernel_families(names, metal_type):
            ops.update(KERNEL_FAMILY_OPS[family])
        table[dtype] = sorted(ops)
    return table


def metal_codegen(source: str) -> dict:
    """What torch/_inductor/codegen/mps.py generates: dtypes (DTYPE_TO_METAL), reductions, store modes, and the ops
    MetalOverrides spells for Metal."""
    tree = ast.parse(source)
    dtypes, ops = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "DTYPE_TO_METAL" for t in node.targets):
            dtypes = [str(ast.unparse(key)).removeprefix("torch.") for key in node.value.keys]
        if isinstance(node, ast.ClassDef) and node.name == "MetalOverrides":
            ops.update(item.name for item in node.body if isinstance(item, ast.FunctionDef) and not item.name.startswith("_"))
            for call in ast.walk(node):  # the special functions registered in _initialize_special_ops
                if isinstance(call, ast.For) and isinstance(call.iter, ast.List):
                    ops.update(elt.value for elt in call.iter.elts if isinstance(elt, ast.Constant))
    reductions = sorted(set(re.findall(r'reduction_type == "(\w+)"', source)) |
                        {r for group in re.findall(r"reduction_type in \[([^\]]+)\]", source)
                         for r in re.findall(r'"(\w+)"', group)})
    aliases = {"float": "float32", "half": "float16", "double": "float64"}
    return {
        "dtypes": sorted({aliases.get(d, d) for d in dtypes}),
        "reductions": reductions,
        "store_modes": ["store", "atomic_add"] if 'mode == "atomic_add"' in source else ["store"],
        "metal_overrides": sorted(ops),  # beside these, OpOverrides' C-like defaults: + - * /, bitwise, shifts, compares
        "limits": [
            "float8 types have no Metal type in the generator: a generated kernel that reads or writes one fails the compile",
            "float64 only as a 0-d scalar input (cast to float); a float64 buffer fails the compile",
            "at most 3 index variables per kernel",
            "no scan (cumsum, cumprod) or sort codegen: inductor calls the aten kernel instead",
            "no matmul templates: mm, bmm, addmm and the grouped/scaled mms call the aten kernel",
        ],
    }


def module_all(source: str) -> list[str]:
    """A module's __all__ (torch/mps: whether Stream, Event, stream and current_stream exist)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return sorted(elt.value for elt in node.value.elts)
    return []


def compact(names: set[str]) -> dict[str, list[str]]:
    """{'add': ['Tensor', 'out', ...]}: one entry per op name, '' for the default overload."""
    grouped: dict[str, list[str]] = defaultdict(list)
    for name in names:
        base, _, overload = name.partition(".")
        grouped[base].append(overload)
    return {base: sorted(grouped[base]) for base in sorted(grouped)}


def read(wheel: zipfile.ZipFile, member: str) -> bytes:
    return wheel.read(member)


def build(wheel_path: Path) -> dict:
    with zipfile.ZipFile(wheel_path) as wheel:
        version_src = read(wheel, "torch/version.py").decode()
        functions = yaml.safe_load(read(wheel, "torchgen/packaged/ATen/native/native_functions.yaml"))
        codegen = read(wheel, "torch/_inductor/codegen/mps.py").decode()
        binary = read(wheel, "torch/lib/libtorch_cpu.dylib")
        mps_module = read(wheel, "torch/mps/__init__.py").decode()
    version = re.search(r"__version__ = '([^']+)'", version_src).group(1)
    commit = re.search(r"git_version = '([0-9a-f]+)'", version_src).group(1)
    kinds = classify(functions)
    unregistered = check_registrations(kinds["mps"], binary)
    if unregistered:  # torchgen names a few out= wrappers otherwise; a reader confirms these by hand
        print(f"{len(unregistered)} of {len(kinds['mps'])} yaml MPS ops matched no wrapper_MPS_ name: {unregistered}",
              file=sys.stderr)
    absent = [name for name in [*LIBRARY_IMPLS, *CPU_FALLBACKS] if name.encode() not in binary]
    if absent:
        raise SystemExit(f"registrations not found in this binary (update LIBRARY_IMPLS/CPU_FALLBACKS): {absent}")
    mps = (kinds["mps"] | set(LIBRARY_IMPLS)) - set(CPU_FALLBACKS)
    return {
        "torch": version,
        "commit": commit,
        "built_by": "tools/mps_ops/generate.py from the macOS arm64 wheel of this release",
        "mps": compact(mps),
        "composite_explicit": compact(kinds["composite_explicit"] - mps),
        "composite_implicit": compact(kinds["composite_implicit"] - mps),
        "cpu_fallback": {name: "aten/src/ATen/mps/MPSFallback.mm registers it to run on the CPU" for name in CPU_FALLBACKS},
        "dtypes": {
            "never": ["float64", "complex128"],
            "never_why": "MPS has no float64 (OperationUtils getMPSDataType: 'the MPS framework doesn't support float64')",
            "limited": limited_dtypes(binary),
            "limited_why": "conservative: the ops whose Metal kernels are instantiated for the dtype (MPSGraph has no "
                           "float8 type; its unsigned types need macOS 14+ and are not counted here)",
        },
        "inductor_metal": metal_codegen(codegen),
        "torch_mps_api": module_all(mps_module),
    }


def dumps(value, depth: int = 0) -> str:
    """JSON with one op (or one list) per line: diffs of a regenerated table stay readable."""
    if isinstance(value, dict) and depth < 2:
        pad = "  " * (depth + 1)
        items = [f"{pad}{json.dumps(key)}: {dumps(item, depth + 1)}" for key, item in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + "  " * depth + "}" + ("\n" if depth == 0 else "")
    return json.dumps(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path, help="torch-2.15.0-...-macosx_*_arm64.whl")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    table = build(args.wheel)
    args.out.write_text(dumps(table))
    counts = {key: len(table[key]) for key in ("mps", "composite_explicit", "composite_implicit")}
    print(f"wrote {args.out} (torch {table['torch']} @ {table['commit']}): {counts}")


if __name__ == "__main__":
    main()

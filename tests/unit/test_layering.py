"""Dependencies point down only: api -> engine -> models -> kernels, with the compile wing between the engine's
loop and its step-level parts; no import circle between any two modules of server/."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "server"
ORDER = ["api", "engine", "compile", "models", "kernels"]
# The compile wing builds on the engine's step-level parts (runner, scheduler, KV manager, types) and is used by its
# loop: these engine modules may import server.compile; no other engine module may, and compile imports no loop.
ENGINE_LOOP = {"engine/engine.py", "engine/async_engine.py"}
# Torch-free modules: the scheduler and KV bookkeeping are tested without a device; the API never sees torch.
TORCH_FREE = ["api", "config.py", "engine/scheduler.py", "engine/kv_manager.py", "engine/block_allocator.py",
              "engine/prefix_disk.py",
              "engine/state_slots.py", "engine/request.py", "engine/types.py", "engine/protocol.py",
              "compile/background.py", "compile/child.py"]
FORBIDDEN_IN_ENGINE = {"fastapi", "pydantic", "starlette", "uvicorn"}


def imports_of(path: Path, with_names: bool = False) -> set[str]:
    """Modules `path` imports, at its top or inside functions; `with_names`: `from a import b` also as `a.b`."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            if with_names:
                names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def module_name(path: Path) -> str:
    parts = ["server", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """server's modules -> the server modules each imports."""
    paths = {module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: {m for m in imports_of(path, with_names=True) if m in paths and m != name}
            for name, path in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while (member := stack.pop()) != node:
                component.append(member)
            component.append(node)
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "server" and parts[1] in ORDER else None


def test_no_import_circle():
    assert not cycles(import_graph())


def test_the_cycle_finder_sees_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_layer_imports_upward():
    violations = []
    for layer in ORDER:
        for path in (ROOT / layer).rglob("*.py"):
            relative = path.relative_to(ROOT).as_posix()
            for module in imports_of(path):
                target = layer_of(module)
                if layer == "compile" and target == "engine":
                    if f"{module.removeprefix('server.').replace('.', '/')}.py" in ENGINE_LOOP:
                        violations.append(f"{relative} imports the engine's loop {module}")
                elif layer == "engine" and target == "compile":
                    if relative not in ENGINE_LOOP:
                        violations.append(f"{relative} imports {module}: only the loop holds the compile wing")
                elif target is not None and ORDER.index(target) < ORDER.index(layer):
                    violations.append(f"{relative} imports {module}")
                if layer == "api" and target in ("models", "kernels"):
                    violations.append(f"{path.relative_to(ROOT)} reaches past the engine into {module}")
    assert not violations, violations


def test_torch_free_modules_and_engine_without_http():
    violations = []
    for entry in TORCH_FREE:
        paths = (ROOT / entry).rglob("*.py") if (ROOT / entry).is_dir() else [ROOT / entry]
        for path in paths:
            bad = {m for m in imports_of(path) if m.split(".")[0] == "torch" or layer_of(m) in ("models", "kernels")}
            violations += [f"{path.relative_to(ROOT)} imports {m}" for m in bad]
    for path in (ROOT / "engine").rglob("*.py"):
        bad = {m for m in imports_of(path) if m.split(".")[0] in FORBIDDEN_IN_ENGINE}
        violations += [f"{path.relative_to(ROOT)} imports {m}" for m in bad]
    for path in (ROOT / "kernels").rglob("*.py"):
        bad = {m for m in imports_of(path) if m.startswith("server.") and layer_of(m) != "kernels"}
        violations += [f"{path.relative_to(ROOT)} imports {m}" for m in bad]
    assert not violations, violations


def test_the_walker_sees_an_upward_import(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("from server.engine.engine import Engine\nimport torch\n")
    assert imports_of(bad) == {"server.engine.engine", "torch"}
    assert layer_of("server.engine.engine") == "engine"


# Which form of an op runs is the step plan's to say (server/kernels/plan.py): kernels and models neither ask
# whether torch.compile traces them nor test the device's type. The probe (capabilities), the plan builder and the
# named device facts of plumbing (devices) may.
MAY_ASK_THE_DEVICE = {"kernels/capabilities.py", "kernels/plan.py", "kernels/devices.py"}
ASKING = re.compile(r"is_compiling\(|\.type\s*[!=]=|device\.type\b")


def test_kernels_and_models_take_their_forms_from_the_plan():
    violations = []
    for layer in ("kernels", "models"):
        for path in sorted((ROOT / layer).rglob("*.py")):
            if str(path.relative_to(ROOT)) in MAY_ASK_THE_DEVICE:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if ASKING.search(line):
                    violations.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not violations, violations


def test_the_form_check_sees_each_way_of_asking():
    asking = ["if torch.compiler.is_compiling():", 'if x.device.type == "mps":', 'cuda = device.type != "cpu"',
              'kind = torch.device(d).type == "cuda"']
    assert all(ASKING.search(line) for line in asking)
    assert not ASKING.search("if plan.fused_top_k and top_k <= MAX_FUSED_TOP_K:")

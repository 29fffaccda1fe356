"""Dependencies point down only: api -> engine -> models -> kernels."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "server"
ORDER = ["api", "engine", "models", "kernels"]
# Torch-free modules: the scheduler and KV bookkeeping are tested without a device; the API never sees torch.
TORCH_FREE = ["api", "engine/scheduler.py", "engine/kv_manager.py", "engine/block_allocator.py",
              "engine/state_slots.py", "engine/request.py", "engine/types.py", "engine/protocol.py",
              "engine/background_compile.py", "engine/compile_child.py"]
FORBIDDEN_IN_ENGINE = {"fastapi", "pydantic", "starlette", "uvicorn"}


def imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "server" and parts[1] in ORDER else None


def test_no_layer_imports_upward():
    violations = []
    for layer in ORDER:
        for path in (ROOT / layer).rglob("*.py"):
            for module in imports_of(path):
                target = layer_of(module)
                if target is not None and ORDER.index(target) < ORDER.index(layer):
                    violations.append(f"{path.relative_to(ROOT)} imports {module}")
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

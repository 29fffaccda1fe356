"""Packaging: a built wheel carries the presets and default.toml, loads presets from its own package data, and
`mps-serve --version` says the installed version."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import server
from server.bench import presets
from server.cli import installed_version

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR = Path(server.__file__).resolve().parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the sources, so the checkout gets no build/ or egg-info."""
    pytest.importorskip("setuptools", minversion="77", reason="building the wheel needs setuptools>=77")
    src = tmp_path_factory.mktemp("src")
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copy(ROOT / "README.md", src)
    shutil.copytree(ROOT / "server", src / "server", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    # No index and no build isolation: the build runs offline with the setuptools installed here.
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    if "No module named pip" in done.stderr:
        pytest.skip("pip is not installed")
    assert done.returncode == 0, done.stderr
    (built,) = out.glob("mps_serve-*.whl")
    return built


def test_wheel_carries_the_presets_and_default_config(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "server/configs/default.toml" in names
    assert "server/configs/presets/README.md" in names
    shipped = {n.removeprefix("server/configs/presets/") for n in names if n.startswith("server/configs/presets/")}
    assert {p.name for p in (PACKAGE_DIR / "configs" / "presets").glob("*.toml")} <= shipped
    assert "tiny-moe.toml" in shipped


def test_unpacked_wheel_loads_presets_from_its_package_data(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # The unpacked wheel goes first on sys.path, ahead of the checkout's editable install.
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from server.bench import presets\n"
        "print(presets.preset_path('tiny-moe'))\n"
        "print(presets.load_preset('tiny-moe').hf_config['model_type'])\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(site)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    path, model_type = done.stdout.split()
    assert Path(path) == site / "server" / "configs" / "presets" / "tiny-moe.toml"
    assert model_type == presets.load_preset("tiny-moe").hf_config["model_type"]


def test_wheel_metadata_says_python_and_license(wheel):
    (meta,) = [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".dist-info/METADATA")]
    lines = zipfile.ZipFile(wheel).read(meta).decode().splitlines()
    assert "Requires-Python: >=3.11" in lines
    assert "License-Expression: Apache-2.0" in lines


def test_presets_load_from_the_package(tmp_path):
    assert presets.preset_path("tiny-moe") == PACKAGE_DIR / "configs" / "presets" / "tiny-moe.toml"
    assert "tiny-moe" in presets.available_presets()
    assert presets.load_preset("tiny-moe").name == "tiny-moe"
    copy = tmp_path / "my-moe.toml"  # a path to a .toml still works alongside the names
    shutil.copy(PACKAGE_DIR / "configs" / "presets" / "tiny-moe.toml", copy)
    loaded = presets.load_preset(str(copy))
    assert loaded.name == "my-moe" and loaded.hf_config == presets.load_preset("tiny-moe").hf_config


def test_version_flag_prints_the_installed_version():
    done = subprocess.run([sys.executable, "-m", "server", "--version"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"mps-serve {installed_version()}"
    assert installed_version() != "unknown"


def test_version_falls_back_to_pyproject_in_a_checkout_that_is_not_installed(monkeypatch):
    import importlib.metadata
    import tomllib

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    expected = tomllib.loads((PACKAGE_DIR.parent / "pyproject.toml").read_text())["project"]["version"]
    assert installed_version() == expected

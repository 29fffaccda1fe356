"""The installed version of mps-serve."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path


def installed_version() -> str:
    """The installed distribution's version; in a source checkout that is not installed, pyproject.toml's."""
    try:
        return importlib.metadata.version("mps-serve")
    except importlib.metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        try:
            return tomllib.loads(pyproject.read_text())["project"]["version"]
        except (OSError, tomllib.TOMLDecodeError, KeyError):
            return "unknown"

"""mps-serve: an OpenAI-compatible LLM inference server on PyTorch, specialized for Apple silicon.

`from server import Engine, SamplingParams`. Heavy modules (torch) load on first attribute access.
"""

from typing import Any

__all__ = ["Engine", "AsyncEngine", "SamplingParams", "RequestOutput"]


def __getattr__(name: str) -> Any:
    if name in ("Engine",):
        from server.engine.engine import Engine

        return Engine
    if name == "AsyncEngine":
        from server.engine.async_engine import AsyncEngine

        return AsyncEngine
    if name in ("SamplingParams", "RequestOutput"):
        from server.engine import types

        return getattr(types, name)
    raise AttributeError(name)

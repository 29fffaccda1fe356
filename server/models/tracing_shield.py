"""Modules that keep working on one thread while torch.fx traces on another. FX's tracer (inside AOT autograd,
on the background compile's thread) replaces `nn.Module.__call__` and `__getattr__` on the class itself,
process-wide, for as long as it traces: an eager forward on the serving thread then runs through that tracer
and fails ("module is not installed as a submodule"). A class that defines both itself is not affected, so each
module is moved to a subclass that binds torch's own two, which leaves the math, the parameters, their names
and `isinstance` as they were."""

from __future__ import annotations

from torch import nn

# Taken at import, before anything traces.
_MODULE_METHODS = {"__call__": nn.Module.__call__, "__getattr__": nn.Module.__getattr__}
_SHIELDED: dict[type, type] = {}


def shield_from_tracing(model: nn.Module) -> None:
    """Give every module of `model` a class whose `__call__` and `__getattr__` FX's patching cannot reach."""
    for module in model.modules():
        module.__class__ = _shielded_class(type(module))


def _shielded_class(cls: type) -> type:
    if cls in _SHIELDED.values():
        return cls
    if cls not in _SHIELDED:
        inherited = {name: method for name, method in _MODULE_METHODS.items() if getattr(cls, name) is method}
        _SHIELDED[cls] = type(cls.__name__, (cls,), {**inherited, "__module__": cls.__module__,
                                                      "__qualname__": cls.__qualname__})
    return _SHIELDED[cls]

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
        # A top-level name of this module, so that a saved compiled step's guards can name the class (pickle
        # finds it by reference; dynamo saves no type guard of a class whose __qualname__ is not its __name__).
        name = f"{cls.__module__}.{cls.__qualname__}".replace(".", "_")
        _SHIELDED[cls] = globals()[name] = type(name, (cls,), {
            **inherited, "__module__": __name__, "_get_name": lambda self: cls.__name__})
    return _SHIELDED[cls]

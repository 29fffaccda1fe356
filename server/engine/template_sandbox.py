"""The jinja2 environment chat templates render in: transformers' globals and filters in an immutable sandbox
that also bounds time, recursion and the size of what `*` and `**` build.

A render is stopped past its time limit: a line-level trace of the template's own compiled code checks the clock
(other code on the thread is not traced), so even a loop that calls nothing is stopped.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

RENDER_TIME_LIMIT_S = 10.0  # real templates render in milliseconds, even for conversations of megabytes
MAX_TEMPLATE_PRODUCT_LEN = 1 << 24  # items of a string or list a template may build with `*`
MAX_TEMPLATE_EXPONENT = 1 << 10
_TEMPLATE_FILENAME = "<template>"  # what jinja compiles templates from strings as


class RenderTimeout(Exception):
    """Raised into a template's frame when its render runs out of time."""


def render_within(template: jinja2.Template, limit_s: float, **variables: Any) -> str:
    """template.render(), stopped by RenderTimeout past `limit_s`: the template's compiled code is traced line by
    line on this thread (other code is not traced) and each line checks the clock."""
    deadline = time.monotonic() + limit_s

    def on_template_line(frame, event, arg):
        if time.monotonic() > deadline:
            raise RenderTimeout
        return on_template_line

    def on_call(frame, event, arg):
        return on_template_line if frame.f_code.co_filename == _TEMPLATE_FILENAME else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        return template.render(**variables)
    finally:
        sys.settrace(previous)


class _TemplateSandbox(ImmutableSandboxedEnvironment):
    """Also bounds `*` and `**`: one expression could otherwise allocate gigabytes or compute for minutes inside a
    single operation, where no time check can reach."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, operator, left, right):
        if operator == "**":
            if isinstance(right, int | float) and abs(right) > MAX_TEMPLATE_EXPONENT:
                raise jinja2.exceptions.SecurityError(f"exponent {right} is too large for a chat template")
            return left**right
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, str | list | tuple) and isinstance(times, int) and len(seq) * times > MAX_TEMPLATE_PRODUCT_LEN:
                raise jinja2.exceptions.SecurityError("a chat template may not build a sequence that long")
        return left * right


def sandboxed_environment() -> ImmutableSandboxedEnvironment:
    """The environment transformers builds for chat templates, with the same globals and filters."""

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters; chat templates expect plain json.dumps output.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = _TemplateSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


class _TemplateDict:
    """`dict(...)` for templates without exposing the dict type itself (no `dict.__subclasses__` tricks)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's namespace() that refuses underscore names, so templates cannot reach interpreter internals."""

    def __init__(*args, **kwargs):  # noqa: N805 - same signature trick as jinja's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set the namespace attribute {name!r}.")

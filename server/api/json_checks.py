"""One walk over a parsed request body that refuses what would only fail deeper in the server.

- A lone UTF-16 surrogate ("\\ud800" as a JSON escape) is valid JSON but not text: the tokenizer cannot encode it.
- Nesting past MAX_JSON_DEPTH: the template-input conversion and the template itself recurse once per level,
  so a few hundred levels would exhaust Python's recursion limit there.
The walk is iterative and builds a field's path only for the error, so a large body costs one cheap pass.
"""

from __future__ import annotations

import re
from typing import Any

from server.api.errors import APIError

MAX_JSON_DEPTH = 64  # far beyond real tool schemas and template kwargs, far below the recursion limit

# a too-deep value is reported at the field where free-form JSON starts, not at its innermost level
_FREE_FORM_FIELD = re.compile(r"^.*?(?:chat_template_kwargs|\.parameters|\.arguments|\.content)(?=[.\[]|$)")

Trail = tuple[Any, Any] | None  # (parent trail, key): a path kept as links until an error needs it


def check_json_body(body: Any, where: str = "") -> None:
    """Raise a 400 naming the first field that holds a lone surrogate or nests deeper than MAX_JSON_DEPTH."""
    if not isinstance(body, dict | list):  # a scalar, e.g. tool-call arguments that parse to a number
        if isinstance(body, str) and not _is_text(body):
            _refuse_surrogate(where or "body")
        return
    stack: list[tuple[Any, int, Trail]] = [(body, 0, None)]
    while stack:
        value, depth, trail = stack.pop()
        if depth > MAX_JSON_DEPTH:
            path = _path(where, trail)
            named = _FREE_FORM_FIELD.match(path)
            param = named.group(0) if named else re.split(r"[.\[]", path, maxsplit=1)[0]
            raise APIError(400, f"{param} nests deeper than {MAX_JSON_DEPTH} levels.", param=param,
                           code="too_deeply_nested")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str) and not _is_text(key):
                _refuse_surrogate(_path(where, trail) or "body")
            if isinstance(item, str):
                if not _is_text(item):
                    _refuse_surrogate(_path(where, (trail, key)))
            elif isinstance(item, dict | list):
                stack.append((item, depth + 1, (trail, key)))


def _path(where: str, trail: Trail) -> str:
    keys = []
    while trail is not None:
        trail, key = trail
        keys.append(key)
    path = where
    for key in reversed(keys):
        path = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)
    return path


def _is_text(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _refuse_surrogate(param: str) -> None:
    raise APIError(
        400,
        f"{param} contains a lone UTF-16 surrogate, which is not valid Unicode text.",
        param=param,
        code="invalid_unicode",
    )

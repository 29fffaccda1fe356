"""One walk over a parsed request body that refuses what would only fail deeper in the server.

A lone UTF-16 surrogate ("\\ud800" as a JSON escape) is valid JSON but not text: the tokenizer cannot encode it.
The walk is iterative and visits each string once, so a large body costs one pass and no recursion.
"""

from __future__ import annotations

from typing import Any

from server.api.errors import APIError


def check_json_body(body: Any, where: str = "") -> None:
    """Raise a 400 naming the first string (or object key) that holds a lone surrogate."""
    stack: list[tuple[Any, str]] = [(body, where)]
    while stack:
        value, path = stack.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            item_path = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and not _is_text(key):
                _refuse_surrogate(path or "body")
            if isinstance(item, str):
                if not _is_text(item):
                    _refuse_surrogate(item_path)
            elif isinstance(item, dict | list):
                stack.append((item, item_path))


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

"""The JSON schemas a constraint enforces (response_format, text.format, a forced tool's parameters), checked and
shaped before any grammar is built.

- A schema no finite JSON value satisfies (`{"$ref": "#"}`, two definitions naming each other, a required
  property of the object's own type) would let the model write nothing valid: a 400, not an empty answer.
- llguidance's parser keeps at most 2,000 items per row; an object with more optional properties than
  MAX_OPTIONAL_PROPERTIES (~4 items each) or a choice of more than MAX_ALTERNATIVES branches would hit it
  mid-answer, so they are refused up front (anything that still hits it ends as an error, never as "stop").
- Tool parameters: an object schema that declares `properties` but not `additionalProperties` is closed
  (`additionalProperties: false`), as OpenAI's strict mode requires: an open object lets a model write
  undeclared keys until max_tokens (pydantic's and LangChain's schemas leave the key out).
The walk follows the JSON Schema keywords that hold subschemas; the body's nesting is bounded already (json_checks).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from server.api.errors import APIError

MAX_OPTIONAL_PROPERTIES = 400
MAX_ALTERNATIVES = 1500
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems")
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def check_schema(schema: Any, param: str) -> None:
    """Raise a 400 naming `param` when `schema` cannot be enforced to a valid answer."""
    nodes = list(_subschemas(schema))
    for node in nodes:
        properties = node.get("properties")
        if isinstance(properties, dict):
            required = node.get("required") if isinstance(node.get("required"), list) else []
            num_optional = sum(1 for name in properties if name not in required)
            if num_optional > MAX_OPTIONAL_PROPERTIES:
                raise APIError(400, f"{param} cannot be enforced: an object has {num_optional} optional properties, "
                               f"over the limit of {MAX_OPTIONAL_PROPERTIES}; make some required or split it.",
                               param=param, code="schema_too_complex")
        for key in ("anyOf", "oneOf"):
            branches = node.get(key)
            if isinstance(branches, list) and len(branches) > MAX_ALTERNATIVES:
                raise APIError(400, f"{param} cannot be enforced: {key} has {len(branches)} branches, over the "
                               f"limit of {MAX_ALTERNATIVES}.", param=param, code="schema_too_complex")
    if isinstance(schema, dict) and not _satisfiable(schema, nodes):
        raise APIError(400, f"{param} cannot be enforced: no finite JSON value satisfies the schema (a $ref that "
                       "leads back to itself, or a required property of its own type, with no way out).",
                       param=param, code="unsatisfiable_schema")


def closed_objects(schema: Any) -> Any:
    """A copy of `schema` with `additionalProperties: false` on each object that declares `properties` but says
    nothing about other keys."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _ONE or key in _LISTS:
            out[key] = closed_objects(value)
        elif key in _MAPS and isinstance(value, dict):
            out[key] = {name: closed_objects(sub) for name, sub in value.items()}
        else:
            out[key] = value
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _subschemas(schema: Any) -> Iterator[dict[str, Any]]:
    """Every schema object in `schema`, parents before their subschemas."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        yield node
        for key in _ONE:
            stack.append(node.get(key))
        for key in _LISTS:
            if isinstance(node.get(key), list):
                stack.extend(node[key])
        for key in _MAPS:
            if isinstance(node.get(key), dict):
                stack.extend(node[key].values())


def _resolve(root: dict[str, Any], ref: Any) -> Any:
    """The local target of `$ref` ("#", "#/$defs/a"); None when it is not one."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    target: Any = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            return None
    return target


def _satisfiable(root: dict[str, Any], nodes: list[dict[str, Any]]) -> bool:
    """Whether some finite value satisfies `root`: the least fixed point of "this schema has a finite value",
    over every subschema, a `$ref` as its target. Keywords that only narrow a value (types, bounds) are left to
    llguidance, which refuses the contradictions it finds."""
    finite: set[int] = set()
    known = {id(node) for node in nodes}

    def has_value(schema: Any) -> bool:
        if isinstance(schema, bool):
            return schema
        return not isinstance(schema, dict) or id(schema) in finite or id(schema) not in known

    def check(node: dict[str, Any]) -> bool:
        if "$ref" in node:
            target = _resolve(root, node["$ref"])
            if target is not None and not has_value(target):
                return False
        if isinstance(node.get("allOf"), list) and not all(has_value(s) for s in node["allOf"]):
            return False
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list) and node[key] and not any(has_value(s) for s in node[key]):
                return False
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        for name in node.get("required") if isinstance(node.get("required"), list) else []:
            if isinstance(name, str) and name in properties and not has_value(properties[name]):
                return False
        min_items = node.get("minItems")
        if isinstance(min_items, int) and min_items > 0 and isinstance(node.get("items"), dict | bool):
            return has_value(node["items"])
        return True

    pending = list(reversed(nodes))  # subschemas first: most are settled in the first pass
    changed = True
    while changed:
        changed = False
        for node in pending:
            if id(node) not in finite and check(node):
                finite.add(id(node))
                changed = True
        pending = [node for node in pending if id(node) not in finite]
    return id(root) in finite

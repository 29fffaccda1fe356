"""response_format and enforced tool_choice -> the engine's StructuredOutput (an llguidance Lark grammar).

- response_format json_object / json_schema (Responses: text.format): the answer is that JSON; text: none.
- tool_choice "required" / a named function (Anthropic: "any" / "tool"; `strict` tools under "required"): one or more
  tool calls in the model's own format, arguments valid against the tool's parameters; parallel_tool_calls=false
  allows exactly one call. The format is read from the rendered prompt, where the template describes it.
- Chat output may first reason: free text inside `<think>...</think>` (from the start when the prompt opened
  it; not at all when the prompt closed an empty one), then the constrained answer. Completions are
  constrained from the first token.
The grammar is compiled (and a bad schema refused with a 400 naming the field) by the engine, before generating.
"""

from __future__ import annotations

import json
from typing import Any

from server.api.errors import APIError
from server.api.reasoning import THINK_END, THINK_START, prompt_opens_reasoning
from server.api.schema_checks import check_schema, closed_objects
from server.api.schemas import NamedToolChoice
from server.engine.types import StructuredOutput, json_rule

# Spacing a model may put between its reasoning and its answer
_WS_RULE = "WS: /[ \\t\\r\\n]{1,8}/\n"
_HERMES = ("<tool_call>", "</tool_call>")
_PYTHONIC = ("<|tool_call_start|>", "<|tool_call_end|>")


def chat_constraint(req: Any, tools: list[dict[str, Any]] | None, prompt: str) -> StructuredOutput | None:
    """The constraint of a chat request (schemas.ChatCompletionRequest) whose rendered prompt is `prompt`."""
    named = isinstance(req.tool_choice, NamedToolChoice)
    return turn_constraint(prompt, tools, force_tool=named or req.tool_choice == "required",
                           parallel=not named and req.parallel_tool_calls is not False,
                           response_format=req.response_format)


def turn_constraint(prompt: str, tools: list[dict[str, Any]] | None, *, force_tool: bool, parallel: bool,
                    response_format: Any = None, format_param: str = "response_format") -> StructuredOutput | None:
    """The constraint of one assistant turn (chat completions, Responses, Anthropic Messages) rendered as
    `prompt`: a call of `tools` (those the template saw) when `force_tool`, one only unless `parallel`; else the
    answer `response_format` (schemas.ResponseFormat, named `format_param` in errors) asks for; else None."""
    has_format = response_format is not None and response_format.type != "text"
    if tools and force_tool:
        if has_format:
            raise APIError(400, f"{format_param} cannot be enforced together with a required tool call; drop one.",
                           param=format_param)
        return tool_choice_output(tools, tool_call_format(prompt), parallel=parallel, reasoning=reasoning_mode(prompt))
    if not has_format:
        return None
    return response_format_output(response_format, reasoning=reasoning_mode(prompt), param=format_param)


def reasoning_mode(prompt: str) -> str:
    """How a chat answer to `prompt` may reason before its constrained part: "open" when the template opened
    `<think>`, "none" when it closed an (empty) one, else "optional"."""
    if prompt_opens_reasoning(prompt):
        return "open"
    return "none" if prompt.rstrip().endswith(THINK_END) else "optional"


def response_format_output(response_format: Any, *, reasoning: str = "none",
                           param: str = "response_format") -> StructuredOutput | None:
    """`response_format` (schemas.ResponseFormat, named `param` in errors) -> the constraint, None for text."""
    kind = response_format.type
    if kind == "text":
        return None
    if kind == "json_object":
        answer = json_rule(None)
    elif kind == "json_schema":
        spec = response_format.json_schema
        if spec is None:
            raise APIError(400, f"{param} of type 'json_schema' needs a schema.", param=param)
        schema = spec.schema_ if spec.schema_ is not None else {}
        check_schema(schema, param)
        answer = json_rule(schema)
    else:
        raise APIError(400, f"{param} type {kind!r} is not supported; use 'text', 'json_object' or "
                       "'json_schema'.", param=param)
    return _with_reasoning(f"answer: {answer}\n", (), param, reasoning)


def tool_call_format(prompt: str) -> str:
    """The tool-call format the rendered prompt (tools included) asks the model for: "xml" (Qwen3-Coder),
    "pythonic" (LFM2) or "json" (Hermes / Qwen)."""
    if "<function=" in prompt:
        return "xml"
    if _PYTHONIC[0] in prompt or "<|tool_list_start|>" in prompt:
        return "pythonic"
    return "json"


def tool_choice_output(tools: list[dict[str, Any]], fmt: str, *, parallel: bool, reasoning: str) -> StructuredOutput:
    """One call (parallel=False) or more of `tools` (those the template saw), in format `fmt`; each tool's
    objects closed to their declared properties (schema_checks.closed_objects)."""
    functions = [{**tool["function"], "parameters": closed_objects(_parameters(tool["function"]))} for tool in tools]
    for function in functions:
        check_schema(function["parameters"], "tool_choice")
    if fmt == "pythonic":
        calls = [_pythonic_call(f, i) for i, f in enumerate(functions)]
        rules = "".join(rule for _, rule in calls)
        names = " | ".join(name for name, _ in calls)
        more = ' (", " call)*' if parallel else ""
        body = f'answer: marker0 "[" call{more} "]" marker1\ncall: {names}\n{rules}'
        return _with_reasoning(body, _PYTHONIC, "tool_choice", reasoning)
    if fmt == "xml":
        calls = [_xml_call(f, i) for i, f in enumerate(functions)]
        rules = "".join(rule for _, rule in calls)
        call = " | ".join(name for name, _ in calls)
    else:
        schemas = [_call_schema(f) for f in functions]
        call_schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        rules, call = f"call_json: {json_rule(call_schema)}\n", '"\\n" call_json "\\n"'
    more = ' ("\\n" call)*' if parallel else ""
    body = f"answer: call{more}\ncall: marker0 {call} marker1\n{rules}"
    return _with_reasoning(body, _HERMES, "tool_choice", reasoning)


def _with_reasoning(answer_rules: str, markers: tuple[str, ...], param: str, reasoning: str) -> StructuredOutput:
    """The grammar of `answer`, after the reasoning the output starts with: "none", "open" (the prompt opened
    it: it runs up to `</think>`) or "optional" (the output may open it)."""
    k = len(markers)  # the think markers follow the answer's own
    if reasoning == "none":
        start, markers_used = "start: answer\n", markers
    elif reasoning == "open":
        start, markers_used = f"start: upto_marker{k} WS? answer\n", (*markers, THINK_END)
    else:
        start, markers_used = f"start: (marker{k} upto_marker{k + 1} WS?)? answer\n", (*markers, THINK_START, THINK_END)
    return StructuredOutput(start + answer_rules + _WS_RULE, markers_used, param)


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters")
    return parameters if isinstance(parameters, dict) and parameters else {"type": "object"}


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": _parameters(function)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _properties(function: dict[str, Any]) -> list[tuple[str, dict[str, Any], bool]]:
    """(name, schema, required) per parameter, in the order the tool declares them."""
    parameters = _parameters(function)
    required = set(parameters.get("required") or [])
    props = parameters.get("properties") or {}
    return [(name, spec if isinstance(spec, dict) else {}, name in required) for name, spec in props.items()]


def _xml_value(schema: dict[str, Any], rule: str, rules: list[str]) -> str:
    """The value of one parameter and its closing tag. Text for string (and untyped) parameters, as the parser
    reads them: an enum as its literal values, else any text up to the closing tag; JSON for any other type."""
    kind = schema.get("type")
    if kind not in (None, "string") and not (isinstance(kind, list) and "string" in kind):
        rules.append(f"{rule}: {json_rule(schema)}\n")
        return f'{rule} "\\n</parameter>\\n"'
    values = schema.get("enum")
    if isinstance(values, list) and values and all(isinstance(v, str) for v in values):
        return f'({" | ".join(_lark_string(v) for v in values)}) "\\n</parameter>\\n"'
    rules.append(f"{rule}[lazy]: /(?s:.*)\\n<\\/parameter>/\n")
    return f'{rule} "\\n"'


def _xml_call(function: dict[str, Any], index: int) -> tuple[str, str]:
    """Qwen3-Coder: `\\n<function=f>\\n<parameter=p>\\nvalue\\n</parameter>\\n...</function>\\n`, the
    declared parameters in order, the required ones always."""
    name = f"xml_call{index}"
    items, rules = [], []
    for j, (param, schema, required) in enumerate(_properties(function)):
        rule = f"{name}_p{j}"
        value = _xml_value(schema, f"{rule}_v", rules)
        rules.append(f"{rule}: {_lark_string(f'<parameter={param}>')} \"\\n\" {value}\n")
        items.append(rule if required else f"{rule}?")
    head = _lark_string(f"\n<function={function['name']}>\n")
    rules.insert(0, f"{name}: {head} {' '.join(items)} \"</function>\\n\"\n")
    return name, "".join(rules)


def _pythonic_call(function: dict[str, Any], index: int) -> tuple[str, str]:
    """LFM2: `f(a=1, b="x")`: keyword arguments, the required ones always, each value a JSON literal (Python
    reads JSON strings and numbers alike; booleans and null are spelled True, False, None)."""
    name = f"py_call{index}"
    params = _properties(function)
    rules = []
    for j, (param, schema, _) in enumerate(params):
        rules.append(f"{name}_p{j}: {_lark_string(param + '=')} {_python_value(schema, f'{name}_p{j}_v', rules)}\n")
    args = _separated([(f"{name}_p{j}", required) for j, (_, _, required) in enumerate(params)], f"{name}_a", rules)
    rules.insert(0, f"{name}: {_lark_string(function['name'] + '(')} {args} \")\"\n")
    return name, "".join(rules)


def _python_value(schema: dict[str, Any], rule: str, rules: list[str]) -> str:
    kind = schema.get("type")
    if kind == "boolean":
        return '("True" | "False")'
    if kind == "null":
        return '"None"'
    rules.append(f"{rule}: {json_rule(schema)}\n")
    return rule


def _separated(items: list[tuple[str, bool]], prefix: str, rules: list[str]) -> str:
    """Items joined by ", ", the optional ones possibly absent: per item one rule for "no item yet" and one for
    "a separator comes first", so the grammar grows linearly with the number of items."""
    if not items:
        return ""
    for i in range(len(items) - 1, -1, -1):
        item, required = items[i]
        if i + 1 == len(items):
            optional = "" if required else "?"
            rules.append(f"{prefix}{i}_first: ({item}){optional}\n{prefix}{i}_sep: (\", \" {item}){optional}\n")
            continue
        first, sep = [f"{item} {prefix}{i + 1}_sep"], [f'", " {item} {prefix}{i + 1}_sep']
        if not required:
            first.append(f"{prefix}{i + 1}_first")
            sep.append(f"{prefix}{i + 1}_sep")
        rules.append(f"{prefix}{i}_first: {' | '.join(first)}\n{prefix}{i}_sep: {' | '.join(sep)}\n")
    return f"{prefix}0_first"

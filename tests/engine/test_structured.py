"""Structured outputs in the engine: every output of a constrained request is valid against its schema, whatever
the model prefers; a constrained request in a batch leaves its unconstrained neighbours' tokens unchanged."""

from __future__ import annotations

import json

import jsonschema
import pytest

from server import Engine, SamplingParams
from server.engine.types import InvalidRequestError, StructuredOutput

NAME = {"type": "string", "maxLength": 10}
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0,
                     "maximum": 120}}, "required": ["name", "age"], "additionalProperties": False},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
            "active": {"type": "boolean"},
        },
        "required": ["user", "tags"],
        "additionalProperties": False,
    },
    "any_of_and_optional": {
        "type": "object",
        "properties": {
            "id": {"anyOf": [{"type": "integer"}, {"type": "string", "pattern": "^[a-z]{2,4}$"}]},
            "score": {"type": "number", "minimum": -1, "maximum": 1},
            "note": {"type": ["string", "null"], "maxLength": 6},
        },
        "required": ["id"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "array",
        "items": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"const": "fixed"}},
                  "required": ["x", "y"], "additionalProperties": False},
        "minItems": 1,
        "maxItems": 2,
    },
    "refs_and_formats": {
        "$defs": {"when": {"type": "string", "format": "date"}},
        "type": "object",
        "properties": {"day": {"$ref": "#/$defs/when"}, "level": {"enum": [1, 2, 3]}},
        "required": ["day", "level"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained("demo", device="cpu")


def _constrained(schema, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 96, "temperature": 1.0, **kw},
                          structured=StructuredOutput.from_json_schema(schema))


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_outputs_are_valid_json_of_the_schema_batched_and_alone(engine, name) -> None:
    schema = SCHEMAS[name]
    prompts = ["the cache keeps keys", "hello"]
    outs = engine.generate(prompts, _constrained(schema, seed=7))
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
    alone = engine.generate(prompts[1], _constrained(schema, seed=7))
    assert alone.text == outs[1].text  # seeded and batch-independent, with the mask as without


def test_the_mask_overrules_what_the_model_prefers(engine) -> None:
    """A scripted preference: logit_bias makes EOS (or one text token) all but certain. Without a grammar the
    output is that preference; with one the output is still complete, valid JSON."""
    schema = SCHEMAS["nested"]
    eos = min(engine.tokenizer.eos_token_ids)
    x_token = engine.tokenizer.encode("x", add_special_tokens=False)[0]
    for token in (eos, x_token):
        free = engine.generate("hi", SamplingParams(max_tokens=8, temperature=0.0, logit_bias={token: 100.0}))
        assert free.token_ids[0] == token
        forced = engine.generate("hi", _constrained(schema, temperature=0.0, logit_bias={token: 100.0}))
        assert forced.finish_reason == "stop"
        jsonschema.validate(json.loads(forced.text), schema)


def test_json_object_mode_gives_an_object(engine) -> None:
    outs = engine.generate(["a", "b"], SamplingParams(max_tokens=64, temperature=0.0, structured=StructuredOutput
                                                      .from_json_schema({"type": "object", "maxProperties": 0})))
    assert [o.text for o in outs] == ["{}", "{}"]


def test_unconstrained_neighbours_keep_their_tokens(engine) -> None:
    plain = SamplingParams(max_tokens=12, temperature=1.0, seed=5)
    alone = engine.generate("the small model", plain)
    reqs = [engine.inputs.make_request("the small model", plain),
            engine.inputs.make_request("hello", _constrained(SCHEMAS["nested"], seed=3))]
    mixed = engine.run_to_completion(reqs)
    assert mixed[0].token_ids == alone.token_ids
    jsonschema.validate(json.loads(mixed[1].text), SCHEMAS["nested"])


def test_a_grammar_that_cannot_finish_ends_with_length(engine) -> None:
    schema = {"type": "object", "properties": {"text": {"type": "string", "minLength": 50}}, "required": ["text"]}
    out = engine.generate("x", _constrained(schema, max_tokens=6, seed=1))
    assert out.finish_reason == "length"
    assert out.completion_tokens == 6
    assert out.text.startswith('{"text": "')


@pytest.mark.parametrize("schema, reason", [
    ({"type": "strin"}, "Invalid type"),
    ({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}, "nowhere"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, ""),
])
def test_a_bad_schema_is_refused_before_generating(engine, schema, reason) -> None:
    with pytest.raises(InvalidRequestError) as info:
        engine.inputs.make_request("x", SamplingParams(structured=StructuredOutput.from_json_schema(schema, param="rf")))
    assert info.value.param == "rf"
    assert reason in info.value.message
    assert not engine.has_unfinished


def _optional_object(prefix: str, num: int = 390) -> dict:
    return {"type": "object", "properties": {f"{prefix}{i}": {"type": "integer"} for i in range(num)}}


# under the API's per-object limits, yet llguidance's 2,000 items per parser row are hit at the first key
ROW_LIMIT_SCHEMA = {"anyOf": [_optional_object("a"), _optional_object("b")]}


def test_a_grammar_that_refuses_mid_answer_ends_with_error_not_stop(engine) -> None:
    """llguidance's row limit hit after `{"`: the request ends "error" with a reason a client may read (no
    llguidance internals), never "stop" with a partial answer."""
    open_key = engine.tokenizer.encode('{"', add_special_tokens=False)
    assert len(open_key) == 1
    out = engine.generate("hello", _constrained(ROW_LIMIT_SCHEMA, logit_bias={open_key[0]: 100.0}, seed=1))
    assert out.finish_reason == "error"
    grammar = engine.inputs.grammars.compile(StructuredOutput.from_json_schema(ROW_LIMIT_SCHEMA))
    assert grammar.advance(open_key[0]) and grammar.refusal is not None
    assert grammar.refusal.param == "response_format"
    assert "max is" not in grammar.refusal.message and "<state>" not in grammar.refusal.message


def test_each_grammar_compiles_once(engine) -> None:
    grammars = engine.inputs.grammars
    spec = StructuredOutput.from_json_schema({"type": "object", "properties": {"once": {"type": "integer"}}})
    before = grammars.num_compiles
    first, second = grammars.compile(spec), grammars.compile(spec)
    assert grammars.num_compiles == before + 1 and first._matcher is not second._matcher


@pytest.mark.parametrize("text", ["<|im_end|>", "</tool_call>", "<think>"])
def test_a_const_string_that_spells_a_special_token_completes(engine, text) -> None:
    schema = {"type": "object", "properties": {"v": {"const": text}}, "required": ["v"], "additionalProperties": False}
    out = engine.generate("hello", _constrained(schema, seed=3))
    assert out.finish_reason == "stop" and json.loads(out.text) == {"v": text}


def test_grammars_past_the_size_limit_are_refused_without_llguidance_internals(engine) -> None:
    from server.engine.grammar import MAX_GRAMMAR_CHARS

    names = {f"property_with_a_long_name_{i:05d}": {"type": "integer"} for i in range(MAX_GRAMMAR_CHARS // 40)}
    schema = {"type": "object", "properties": names, "required": list(names)}
    with pytest.raises(InvalidRequestError) as refused:
        engine.inputs.grammars.compile(StructuredOutput.from_json_schema(schema))
    assert refused.value.param == "response_format" and "limit" in refused.value.message
    assert "panic" not in refused.value.message

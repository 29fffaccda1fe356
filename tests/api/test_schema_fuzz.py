"""Schema fuzzing: schemathesis generates requests from the server's own OpenAPI document, both valid ones and
ones that break the schema, against a real uvicorn serving the demo model. A seeded run of a thousand cases:
no 5xx, every error in OpenAI's shape, every stream well framed."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.config import SchemathesisConfig
from schemathesis.generation.modes import GenerationMode

from tests.api.harness import RunningServer

pytestmark = pytest.mark.slow
NUM_CASES = int(os.environ.get("MPS_SERVE_FUZZ_CASES", 1000))  # docs/RELIABILITY.md: a longer run
MAX_NEW_TOKENS = 2  # generated requests ask for up to the whole context; the fuzz is about the API, not the model
ERROR_FIELDS = {"message", "type", "param", "code"}
MAX_STREAM_EVENTS = 100_000


def _cases(app) -> st.SearchStrategy:
    # every event of a stream is read (n choices of several prompts are hundreds), up to the request's timeout
    config = SchemathesisConfig.from_dict({"max-stream-events": MAX_STREAM_EVENTS})
    schema = schemathesis.openapi.from_dict(app.openapi(), config=config)
    return st.one_of([schema.as_strategy(mode) for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)])


def _bounded(case) -> None:
    """Short generations: a valid request's token budget (also a float or a numeric string, which pydantic takes
    as an int) is cut to MAX_NEW_TOKENS, and set where the request leaves it to the context length."""
    if not isinstance(case.body, dict):
        return
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = case.body.get(name)
        try:
            too_many = not isinstance(value, bool) and float(value) > MAX_NEW_TOKENS
        except (TypeError, ValueError, OverflowError):
            continue
        if too_many:
            case.body[name] = MAX_NEW_TOKENS
    if case.path == "/v1/responses":
        if case.body.get("max_output_tokens") is None:
            case.body["max_output_tokens"] = MAX_NEW_TOKENS
    elif case.body.get("max_tokens") is None and case.body.get("max_completion_tokens") is None:
        case.body["max_tokens"] = MAX_NEW_TOKENS


def _check(response) -> None:
    """`response`: schemathesis' (headers map to lists of values). Errors in OpenAI's shape, Anthropic's on
    /v1/messages; streams well framed: JSON events ending in [DONE], the protocol's last event, or an error."""
    where = (f"{response.request.method} {response.request.url} {response.request.body!r:.1500} -> "
             f"{response.status_code}: {response.text[-1500:]}")
    anthropic = "/v1/messages" in response.request.url
    assert response.status_code < 500, where
    if response.status_code >= 400:
        body = response.json()
        if anthropic:
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, where
        else:
            assert set(body) == {"error"} and set(body["error"]) == ERROR_FIELDS, where
        assert isinstance(body["error"]["message"], str) and body["error"]["message"], where
    elif response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        assert not response.stream_cut_short, where  # schemathesis stops reading a stream past its time limit
        events = [line.split("data: ", 1)[1] for line in response.text.split("\n\n") if "data: " in line]
        assert events, where
        if events[-1] == "[DONE]":
            events = events[:-1]
        last = json.loads(events[-1])
        for event in map(json.loads, events[:-1]):
            assert event.get("type") != "error" and (anthropic or "/v1/responses" in where or "error" not in event), where
        ends = {"message_stop", "response.completed", "response.incomplete", "error"}
        assert last.get("type") in ends or "choices" in last or set(last.get("error", ())) == ERROR_FIELDS, where


def test_schema_fuzz_finds_no_5xx_and_only_openai_errors(demo_server: RunningServer) -> None:
    app = demo_server.server.config.app
    statuses: Counter = Counter()
    session = requests.Session()

    @given(case=_cases(app))
    @settings(max_examples=NUM_CASES, derandomize=True, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    def run(case) -> None:
        _bounded(case)
        response = case.call(base_url=demo_server.url, session=session, timeout=30)
        statuses[response.status_code] += 1
        _check(response)

    run()
    print(f"schema fuzz: {sum(statuses.values())} cases, statuses {dict(sorted(statuses.items()))}")
    assert sum(statuses.values()) == NUM_CASES
    assert statuses[200] >= 100 and sum(n for s, n in statuses.items() if 400 <= s < 500) >= 100, statuses

"""The reasoning budget: after `reasoning_budget` tokens of reasoning the engine writes `</think>` itself and the
answer follows; the tokens before that point are the model's own, unchanged; neighbours in the batch are untouched."""

from __future__ import annotations

import random

import pytest

from server import Engine, SamplingParams
from server.engine.reasoning_budget import ReasoningBudget
from server.engine.types import ChatPrompt, InvalidRequestError


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained("demo", device="cpu")


def _ids(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_special_tokens=False)


def _prompt(engine: Engine, question: str, opened: bool) -> ChatPrompt:
    """A thinking turn's prompt; `opened`: ending inside `<think>` as Qwen3.5's template writes it."""
    prompt = engine.inputs.chat_prompt([{"role": "user", "content": question}], enable_thinking=True)
    return ChatPrompt(prompt + "<think>\n") if opened else prompt


def _params(engine: Engine, budget: int | None, **kw) -> SamplingParams:
    """The model is kept from closing its reasoning (and from stopping): only the budget can close it."""
    (end,) = _ids(engine, "</think>")
    return SamplingParams(**{"max_tokens": 30, "temperature": 0.0, "ignore_eos": True, "logit_bias": {end: -100.0},
                             "reasoning_budget": budget, **kw})


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 7, "top_p": 0.9}])
def test_reasoning_ends_at_the_budget_and_the_answer_follows(engine: Engine, sampling: dict) -> None:
    rng = random.Random(sampling.get("seed", 0))
    budget = rng.randint(3, 12)
    prompt = _prompt(engine, f"question {rng.randint(0, 10**6)}", opened=True)
    (end,) = _ids(engine, "</think>")
    other = _prompt(engine, "other", opened=True)
    free, budgeted, neighbour = _run(engine, [(prompt, _params(engine, None, **sampling)),
                                              (prompt, _params(engine, budget, **sampling)), (other, _params(engine, None))])
    assert end not in free.token_ids  # the bias holds the model off the marker
    assert budgeted.token_ids.index(end) == budget  # exactly `budget` reasoning tokens, then the marker
    assert budgeted.token_ids[:budget] == free.token_ids[:budget]  # the model's own tokens up to there
    assert len(budgeted.token_ids) == 30 and budgeted.finish_reason == "length"  # the answer runs on after it
    alone = engine.generate(other, _params(engine, None))
    assert neighbour.token_ids == alone.token_ids


def _run(engine: Engine, pairs):
    return engine.run_to_completion([engine.inputs.make_request(p, params) for p, params in pairs])


def test_budget_counts_from_an_opening_think_in_the_output(engine: Engine) -> None:
    """Qwen3's template leaves `<think>` to the model: the reasoning starts after it."""
    (start,) = _ids(engine, "<think>")
    (end,) = _ids(engine, "</think>")
    prompt = _prompt(engine, "q", opened=False)
    params = _params(engine, 5)
    params.logit_bias = {end: -100.0, start: 100.0}  # the model opens its reasoning (and keeps writing <think>)
    out = engine.generate(prompt, params)
    assert out.token_ids[0] == start and out.token_ids.index(end) == 1 + 5


def test_no_reasoning_no_forcing(engine: Engine) -> None:
    (end,) = _ids(engine, "</think>")
    out = engine.generate(_prompt(engine, "q", opened=False), _params(engine, 2))  # the output never opens <think>
    assert end not in out.token_ids and len(out.token_ids) == 30


@pytest.mark.parametrize("budget", [0, -3, True, 2.5])
def test_budget_is_validated(engine: Engine, budget) -> None:
    with pytest.raises(InvalidRequestError) as info:
        engine.generate("hi", SamplingParams(max_tokens=4, reasoning_budget=budget))
    assert info.value.param == "reasoning_budget"


def test_a_marker_of_several_tokens_is_forced_token_by_token() -> None:
    start, end = (90, 91), (7, 8, 9)
    budget = ReasoningBudget(3, start, end, opened=False)
    output: list[int] = []
    for index in range(12):
        forced = budget.forced_token(index)
        token = forced if forced is not None else [90, 91, 1, 2, 3, 4, 5, 6, 1, 1, 1, 1][index]
        output.append(token)
        budget.advance(token)
    assert output == [90, 91, 1, 2, 3, 7, 8, 9, 1, 1, 1, 1]
    assert not budget.thinking


def test_a_marker_the_model_writes_itself_ends_the_budget() -> None:
    budget = ReasoningBudget(4, (90,), (91,), opened=True)
    for token in (1, 91):
        budget.advance(token)
    assert budget.forced_token(5) is None and not budget.thinking


@pytest.mark.compile
def test_the_compiled_greedy_step_forces_the_marker_as_eager_does(engine: Engine) -> None:
    """A plain greedy batch takes the compiled step's in-graph argmax; a row whose budget is spent leaves it for the
    sampler, which takes the mask."""
    compiled = Engine.from_pretrained("demo", device="cpu", compile="on")
    assert compiled.runner.decode_graphs is not None
    (end,) = _ids(engine, "</think>")
    prompts = [_prompt(engine, f"question {i}", opened=True) for i in range(3)]
    budgets = [4, None, 9]

    def run(on: Engine):
        params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, reasoning_budget=b) for b in budgets]
        return [o.token_ids for o in _run(on, list(zip(prompts, params, strict=True)))]

    want = run(engine)
    assert want[0].index(end) <= 4 and want[2].index(end) <= 9  # ended by the budget at the latest
    assert run(compiled) == want

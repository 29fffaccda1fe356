"""Tokenizer parity with transformers: ids, decoding, special tokens, EOS ids, loading errors, and chat
templates (real Qwen3 and Llama-3.1 templates, precedence, sandbox). Inputs are drawn fresh each run; the
seed is printed with every failure."""

from __future__ import annotations

import json
import random
import secrets
import shutil
from pathlib import Path

import pytest

from server.engine.demo import ensure_demo_model
from server.engine.tokenizer import Tokenizer
from server.engine.types import InvalidRequestError, ModelLoadError
from tests.helpers import random_text

transformers = pytest.importorskip("transformers")

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "templates"


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory) -> Path:
    return ensure_demo_model(tmp_path_factory.mktemp("mps-serve-cache"))


@pytest.fixture(scope="module")
def tok(demo_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(demo_dir)


@pytest.fixture(scope="module")
def hf_tok(demo_dir):
    return transformers.AutoTokenizer.from_pretrained(demo_dir)


@pytest.fixture
def rng() -> random.Random:
    seed = secrets.randbits(32)
    print(f"random seed: {seed}")
    return random.Random(seed)


def copy_tokenizer(demo_dir: Path, dst: Path, config: dict, extra_special: list[str] = ()) -> Path:
    """A model dir with the demo tokenizer.json (optionally more special tokens) and the given tokenizer_config."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend

    dst.mkdir(parents=True, exist_ok=True)
    backend = Backend.from_file(str(demo_dir / "tokenizer.json"))
    if extra_special:
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra_special])
    backend.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config}))
    return dst


# ---------------------------------------------------------------------- ids and text


def test_encode_matches_transformers(tok, hf_tok, rng):
    for _ in range(200):
        text = random_text(rng)
        for add_special in (True, False):
            expected = hf_tok(text, add_special_tokens=add_special).input_ids
            assert tok.encode(text, add_special_tokens=add_special) == expected, repr(text)


def test_decode_matches_transformers(tok, hf_tok, rng):
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 40))]
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip), ids


def test_roundtrip_of_multibyte_text(tok, rng):
    import unicodedata

    for _ in range(100):
        text = unicodedata.normalize("NFC", random_text(rng))  # the demo normalizer is NFC
        assert tok.decode(tok.encode(text)) == text


def test_vocab_and_special_ids_match_transformers(tok, hf_tok):
    assert tok.vocab_size == len(hf_tok)
    assert tok.bos_token_id == hf_tok.bos_token_id
    assert tok.pad_token_id == hf_tok.pad_token_id
    assert tok.special_token_ids == {i for i, t in hf_tok.added_tokens_decoder.items() if t.special}
    assert set(hf_tok.all_special_ids) <= tok.special_token_ids


def test_token_text_and_bytes(tok, hf_tok):
    whole = b"".join(tok.token_bytes(i) for i in tok.encode("naïve 中文 🙂 text"))
    assert whole.decode("utf-8") == "naïve 中文 🙂 text"
    for token_id in range(tok.vocab_size):
        raw, text = tok.token_bytes(token_id), tok.token_text(token_id)
        reference = hf_tok.decode([token_id])
        if "\ufffd" in reference:  # part of a character: shown as escaped bytes, OpenAI style
            assert text == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        else:
            assert text == reference and raw == reference.encode("utf-8")
    assert tok.token_text(tok.vocab_size + 5) == "" and tok.token_text(-1) == ""


def test_config_special_tokens_and_add_bos_match_transformers(demo_dir, tmp_path, rng):
    """A bos token only declared in tokenizer_config.json; add_bos_token flags (which transformers ignores
    when a tokenizer.json exists: the post-processor there decides)."""
    config = {"bos_token": {"content": "<|begin_of_text|>", "__type": "AddedToken"}, "eos_token": "<|im_end|>"}
    for flags in ({"add_bos_token": True}, {"add_bos_token": True, "add_eos_token": True}, {}):
        model_dir = copy_tokenizer(demo_dir, tmp_path / str(len(flags)), {**config, **flags})
        ours, hf = Tokenizer.from_pretrained(model_dir), transformers.AutoTokenizer.from_pretrained(model_dir)
        assert ours.vocab_size == len(hf) and ours.bos_token_id == hf.bos_token_id is not None
        for _ in range(30):
            text = random_text(rng) + rng.choice(["", "<|begin_of_text|>x"])
            for add_special in (True, False):
                assert ours.encode(text, add_special) == hf(text, add_special_tokens=add_special).input_ids, flags


def test_eos_ids_from_every_config(demo_dir, tmp_path):
    model_dir = copy_tokenizer(demo_dir, tmp_path, {"eos_token": {"content": "<tool_call>", "__type": "AddedToken"}})
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 1000]}))
    (model_dir / "config.json").write_text(json.dumps({"eos_token_id": 1002, "model_type": "qwen3"}))
    ours = Tokenizer.from_pretrained(model_dir)
    gen = transformers.GenerationConfig.from_pretrained(model_dir)
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert ours.eos_token_ids == set(gen.eos_token_id) | {1002, hf.eos_token_id}
    assert hf.eos_token_id in ours.eos_token_ids and len(ours.eos_token_ids) == 4

    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    (model_dir / "config.json").write_text(json.dumps({"text_config": {"eos_token_id": 9}}))
    assert Tokenizer.from_pretrained(model_dir).eos_token_ids == {5, 9, hf.eos_token_id}


def test_missing_or_corrupt_files_raise_model_load_error(demo_dir, tmp_path):
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json.*" + str(tmp_path)):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    shutil.copy(demo_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "generation_config.json").write_text("[1, 2")
    with pytest.raises(ModelLoadError, match="generation_config.json"):
        Tokenizer.from_pretrained(tmp_path)


# ---------------------------------------------------------------------- chat templates

LLAMA_SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"]
LLAMA_SPECIAL += ["<|python_tag|>"]


@pytest.fixture(scope="module")
def template_dirs(demo_dir, tmp_path_factory) -> dict[str, Path]:
    """Model dirs whose tokenizer_config.json carries a real-world template (and its special tokens)."""
    root = tmp_path_factory.mktemp("templates")
    qwen = {"chat_template": (TEMPLATES / "qwen3.jinja").read_text(), "eos_token": "<|im_end|>"}
    qwen |= {"pad_token": "<|endoftext|>", "bos_token": None}
    llama = {"chat_template": (TEMPLATES / "llama-3.1-instruct.jinja").read_text()}
    llama |= {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    return {
        "qwen3": copy_tokenizer(demo_dir, root / "qwen3", qwen),
        "llama3.1": copy_tokenizer(demo_dir, root / "llama", llama, extra_special=LLAMA_SPECIAL),
    }


def weather_tools(rng: random.Random) -> list[dict]:
    return [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Température actuelle — " + random_text(rng, 10),
                "parameters": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string", "description": "City <name> & country"},
                        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    },
                    "required": ["city"],
                },
            },
        },
        {"type": "function", "function": {"name": "now", "description": "Current time", "parameters": {}}},
    ]


def tool_call(name: str, arguments: dict, as_string: bool) -> dict:
    # OpenAI clients send arguments as a JSON string (compact here, so leaving it unparsed would show)
    args = json.dumps(arguments, separators=(",", ":"), ensure_ascii=True) if as_string else arguments
    return {"id": "call_" + name, "type": "function", "function": {"name": name, "arguments": args}}


def conversations(rng: random.Random, name: str, as_string: bool) -> list[tuple[list[dict], dict]]:
    """(messages, kwargs) pairs; `as_string` gives tool-call arguments the way OpenAI clients send them."""
    say = lambda: random_text(rng, 30).strip() or "hi"  # noqa: E731
    tools = weather_tools(random.Random(rng.random()))
    paris = tool_call("get_weather", {"city": "Paris", "unit": "celsius", "note": "à côté 中"}, as_string)
    plain = [
        ([{"role": "user", "content": say()}], {}),
        ([{"role": "system", "content": say()}, {"role": "user", "content": say()}], {"add_generation_prompt": False}),
        (
            [
                {"role": "system", "content": say()},
                {"role": "user", "content": say()},
                {"role": "assistant", "content": say()},
                {"role": "user", "content": say()},
            ],
            {},
        ),
        ([{"role": "system", "content": say()}, {"role": "user", "content": say()}], {"tools": tools}),
    ]
    calls = [
        {"role": "user", "content": "Weather in Paris? " + say()},
        # OpenAI clients send content null here; transformers drops it (Qwen3's template then fails), we send ""
        {"role": "assistant", "content": None if as_string else "", "tool_calls": [paris]},
        {"role": "tool", "tool_call_id": "call_get_weather", "content": '{"temp": 21.5}'},
    ]
    if name == "qwen3":
        now = tool_call("now", {}, as_string)
        two_calls = [
            {"role": "user", "content": say()},
            {"role": "assistant", "content": "Let me check.", "tool_calls": [paris, now]},
            {"role": "tool", "content": "21 C"},
            {"role": "tool", "content": "12:00"},
        ]
        thinking = [
            {"role": "user", "content": say()},
            {"role": "assistant", "content": "<think>\nhmm " + say() + "\n</think>\n\n" + say()},
            {"role": "user", "content": say()},
            {"role": "assistant", "content": say(), "reasoning_content": "because " + say()},
        ]
        return plain + [
            (calls, {"tools": tools}),
            (two_calls, {"tools": tools}),
            (two_calls + [{"role": "assistant", "content": say()}], {"tools": tools, "add_generation_prompt": False}),
            (thinking, {"add_generation_prompt": False}),
            (thinking + [{"role": "user", "content": say()}], {"enable_thinking": False}),
            (thinking[:1], {"enable_thinking": True}),
        ]
    builtin = tool_call("brave_search", {"query": "mps " + say()}, as_string)
    return plain + [
        (calls, {"tools": tools, "date_string": "26 Jul 2024"}),
        (calls, {"tools": tools, "tools_in_user_message": False, "date_string": "01 Jan 2026"}),
        (calls[:1] + [{"role": "assistant", "tool_calls": [builtin]}], {"builtin_tools": ["brave_search", "wolfram"]}),
        (calls[:1] + [{"role": "ipython", "content": {"result": [1, 2]}}], {"date_string": "7 May 2025"}),
    ]


@pytest.mark.parametrize("name", ["qwen3", "llama3.1"])
def test_chat_template_matches_transformers(template_dirs, name, rng):
    ours = Tokenizer.from_pretrained(template_dirs[name])
    hf = transformers.AutoTokenizer.from_pretrained(template_dirs[name])
    seed = rng.random()
    string_args = conversations(random.Random(seed), name, as_string=True)
    for (messages, kwargs), (hf_messages, _) in zip(
        string_args, conversations(random.Random(seed), name, False), strict=True
    ):
        kwargs = {"add_generation_prompt": True, **kwargs}
        if name == "llama3.1":
            kwargs.setdefault("date_string", "26 Jul 2024")
        expected = hf.apply_chat_template(hf_messages, tokenize=False, **kwargs)
        before = json.dumps(messages)
        text = ours.apply_chat_template(messages, **kwargs)
        assert text == expected, (messages, kwargs)
        assert json.dumps(messages) == before  # the caller's messages are not modified
        expected_ids = hf.apply_chat_template(hf_messages, tokenize=True, return_dict=True, **kwargs)["input_ids"]
        assert ours.encode(text, add_special_tokens=False) == expected_ids


def test_template_errors_become_invalid_request(template_dirs):
    ours = Tokenizer.from_pretrained(template_dirs["llama3.1"])
    hf = transformers.AutoTokenizer.from_pretrained(template_dirs["llama3.1"])
    call = tool_call("now", {}, as_string=False)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call, call]}]
    with pytest.raises(jinja_error()) as hf_error:
        hf.apply_chat_template(messages, tokenize=False)
    with pytest.raises(InvalidRequestError, match="only supports single tool-calls") as ours_error:
        ours.apply_chat_template(messages)
    assert str(hf_error.value) in str(ours_error.value)
    qwen = Tokenizer.from_pretrained(template_dirs["qwen3"])
    with pytest.raises(InvalidRequestError, match="chat template"):  # list content: the template adds str + list
        qwen.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    with pytest.raises(InvalidRequestError, match="at least one message"):
        qwen.apply_chat_template([])


def jinja_error():
    import jinja2

    return jinja2.TemplateError


def write_template_dir(demo_dir: Path, path: Path, config_template, jinja_file: str | None = None) -> Path:
    model_dir = copy_tokenizer(demo_dir, path, {"chat_template": config_template} if config_template else {})
    if jinja_file is not None:
        (model_dir / "chat_template.jinja").write_text(jinja_file)
    return model_dir


def test_chat_template_jinja_file_wins(demo_dir, tmp_path, rng):
    qwen3 = (TEMPLATES / "qwen3.jinja").read_text()
    model_dir = write_template_dir(demo_dir, tmp_path, "{{ 'from tokenizer_config' }}", jinja_file=qwen3)
    ours, hf = Tokenizer.from_pretrained(model_dir), transformers.AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": random_text(rng)}]
    text = ours.apply_chat_template(messages)
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user" in text and "from tokenizer_config" not in text


def test_named_templates_pick_tool_use(demo_dir, tmp_path, rng):
    named = [{"name": "default", "template": "D{{ messages[0].content }}"}]
    named += [{"name": "tool_use", "template": "T{{ tools | tojson(indent=2, sort_keys=True) }}"}]
    model_dir = write_template_dir(demo_dir, tmp_path, named)
    ours, hf = Tokenizer.from_pretrained(model_dir), transformers.AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": random_text(rng)}]
    tools = weather_tools(rng)
    for kwargs in ({}, {"tools": tools}):
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        assert ours.apply_chat_template(messages, **kwargs) == expected
    assert ours.apply_chat_template(messages, tools=tools).startswith("T[")


def test_no_chat_template(demo_dir, tmp_path):
    ours = Tokenizer.from_pretrained(write_template_dir(demo_dir, tmp_path, None))
    assert not ours.chat_template
    with pytest.raises(InvalidRequestError, match="no chat template"):
        ours.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_helpers_match_transformers(demo_dir, tmp_path, rng):
    template = (
        "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ extra | tojson }}|{{ extra | tojson(indent=2) }}|"
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m.reasoning_content }}/"
        "{{ m.thinking }};{% endfor %}{{ strftime_now('%Y-%m') }}|{% set ns = namespace(n=0) %}"
        "{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}|{{ dict(a=1) | tojson }}\n"
        "  {% if messages %}\n    kept\n  {% endif %}\n"  # trim_blocks / lstrip_blocks whitespace rules
    )
    config = {"chat_template": template, "bos_token": {"content": "<|endoftext|>", "__type": "AddedToken"}}
    model_dir = copy_tokenizer(demo_dir, tmp_path, {**config, "eos_token": "<|im_end|>", "pad_token": "<|im_end|>"})
    ours, hf = Tokenizer.from_pretrained(model_dir), transformers.AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "x", "reasoning": random_text(rng)}, {"role": "assistant", "content": "y"}]
    messages += [{"role": "user", "content": "z"}]
    extra = {"text": random_text(rng) + "<tag> & 'quote'", "n": rng.random()}
    expected = hf.apply_chat_template(messages, tokenize=False, extra=extra)
    assert ours.apply_chat_template(messages, add_generation_prompt=False, extra=extra) == expected


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__base__ }}",
        "{{ raise_exception.__globals__['os'] }}",
        "{{ cycler.__init__.__globals__.os }}",
        "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
        "{{ namespace(_private=1) }}",
        "{{ messages.append(1) }}",
        "{{ dict.__call__.__globals__ }}",
        "{% for m in messages %}{{ m.update({'role': 'x'}) }}{% endfor %}",
    ],
)
def test_sandbox_refuses_attribute_escapes(demo_dir, tmp_path, template):
    model_dir = write_template_dir(demo_dir, tmp_path, template)
    ours, hf = Tokenizer.from_pretrained(model_dir), transformers.AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(jinja_error()):  # the reference refuses too
        hf.apply_chat_template(messages, tokenize=False)
    with pytest.raises(InvalidRequestError, match="chat template"):
        ours.apply_chat_template(messages)


def test_sandbox_hides_python_objects(demo_dir, tmp_path):
    template = "[{{ ''.__class__ }}][{{ messages[0].content.__len__ }}][{{ raise_exception.__globals__ }}]"
    model_dir = write_template_dir(demo_dir, tmp_path, template)
    assert Tokenizer.from_pretrained(model_dir).apply_chat_template([{"role": "user", "content": "hi"}]) == "[][][]"

"""The tokenizer of a Hugging Face checkpoint: `tokenizer.json` through `tokenizers`, the chat template
rendered in a sandboxed jinja2 environment exactly as transformers' `apply_chat_template` renders it,
and the EOS ids gathered from every config file that declares them.

Chat templates come from the Hub and are untrusted code: they run in jinja2's ImmutableSandboxedEnvironment
(template_sandbox.py) and only ever see plain JSON-like data (dicts, lists, strings, numbers), never the
caller's objects.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import AddedToken, decoders
from tokenizers import Tokenizer as BackendTokenizer

from server.engine.template_sandbox import RENDER_TIME_LIMIT_S, RenderTimeout, render_within, sandboxed_environment
from server.engine.types import InvalidRequestError, ModelLoadError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
# The named special tokens transformers passes to every chat template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Names a message's reasoning arrives under; transformers copies it to all of them before rendering.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Normalizers and pre-tokenizers that keep every character of the text: they may compose, expand or re-split it,
# never drop it. With only these, each character ends up inside some token.
_CHAR_KEEPING_STEPS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend", "Sequence", "ByteLevel", "Metaspace",
                       "Digits", "Split", "Punctuation", "UnicodeScripts", "Replace"}
# Unicode composition merges at most three code points into one (a Hangul syllable), so a token spans at most
# this many times its own length of input characters.
_COMPOSITION_FACTOR = 4


class Tokenizer:
    """Encode, decode and render chat prompts for one model. Build it with `Tokenizer.from_pretrained(dir)`."""

    def __init__(
        self,
        backend: BackendTokenizer,
        special_tokens: Mapping[str, str] | None = None,
        chat_template: str | Mapping[str, str] | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
    ):
        self.backend = backend
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.chat_template = dict(chat_template) if isinstance(chat_template, Mapping) else chat_template
        eos = self.special_tokens.get("eos_token")
        eos_id = backend.token_to_id(eos) if eos else None
        self.eos_token_ids = frozenset(eos_token_ids) | ({eos_id} if eos_id is not None else set())
        bos = self.special_tokens.get("bos_token")
        self.bos_token_id: int | None = backend.token_to_id(bos) if bos else None
        pad = self.special_tokens.get("pad_token")
        self.pad_token_id: int | None = backend.token_to_id(pad) if pad else None
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        added = backend.get_added_tokens_decoder()
        self.special_token_ids = frozenset(i for i, tok in added.items() if tok.special)
        self._byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        self._unicode_to_byte = {c: b for b, c in _bytes_to_unicode().items()} if self._byte_level else {}
        self._env = sandboxed_environment()
        self._compiled: dict[str, jinja2.Template] = {}
        self.max_chars_per_token = _max_chars_per_token(backend)
        self.render_time_limit_s = RENDER_TIME_LIMIT_S

    def min_num_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)) that costs no tokenization: 0 when this tokenizer can drop text."""
        if self.max_chars_per_token is None:
            return 0
        return -(-len(text) // self.max_chars_per_token)

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        tokenizer_path = model_dir / TOKENIZER_FILE
        if not tokenizer_path.is_file():
            raise ModelLoadError(
                f"{TOKENIZER_FILE} not found in {model_dir}: mps-serve needs the fast-tokenizer file that "
                "Hugging Face checkpoints ship (re-save the tokenizer with transformers' save_pretrained to create it)."
            )
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_path))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise ModelLoadError(f"{tokenizer_path} could not be read by the tokenizers library: {exc}") from exc
        # transformers' tokenizer(text) encodes without truncation or padding, whatever tokenizer.json says;
        # with a tokenizer.json it also ignores tokenizer_config's add_bos_token / add_eos_token.
        backend.no_truncation()
        backend.no_padding()

        config = _read_json(model_dir / TOKENIZER_CONFIG_FILE)
        special_tokens = {name: _token_content(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
        _add_config_tokens(backend, config, special_tokens)

        eos_ids: set[int] = set()
        for name in ("generation_config.json", "config.json"):
            data = _read_json(model_dir / name)
            eos_ids.update(_id_list(data.get("eos_token_id")))
            text_config = data.get("text_config")
            if isinstance(text_config, dict):  # multimodal checkpoints keep the language model's ids here
                eos_ids.update(_id_list(text_config.get("eos_token_id")))
        return cls(backend, special_tokens, _load_chat_template(model_dir, config), frozenset(eos_ids))

    # ------------------------------------------------------------------ text <-> ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (OpenAI's logprobs `bytes`); b"" for an unknown id."""
        try:
            token_id = int(token_id)
            token = self.backend.id_to_token(token_id) if token_id >= 0 else None
        except (TypeError, ValueError, OverflowError):
            token = None
        if token is None:
            return b""
        if self._byte_level and token_id not in self.special_token_ids:
            if all(c in self._unicode_to_byte for c in token):
                return bytes(self._unicode_to_byte[c] for c in token)
            return self.decode([token_id]).encode("utf-8")  # an added token stored as plain text
        raw = _byte_fallback(token)
        if raw is not None:
            return raw
        text = self.decode([token_id])
        if token.startswith("\u2581") and not text.startswith(" "):
            text = " " + text  # SentencePiece decoders drop the space of a string's first word
        return text.encode("utf-8")

    def token_text(self, token_id: int) -> str:
        """Display string of one token, for logprobs. A token holding part of a UTF-8 character is shown
        the way OpenAI shows it, as `bytes:\\xe4\\xb8`. Never raises."""
        raw = self.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    # ------------------------------------------------------------------ chat template

    def get_chat_template(self, tools: list[dict] | None = None) -> str:
        """The template transformers would pick: the only one, or `tool_use` when tools are given, else `default`."""
        template = self.chat_template
        if isinstance(template, dict):
            if tools is not None and "tool_use" in template:
                return template["tool_use"]
            if "default" in template:
                return template["default"]
            raise InvalidRequestError(
                f"This model has several chat templates ({', '.join(sorted(template))}) and none is named 'default'."
            )
        if not template:
            raise InvalidRequestError(
                "This model has no chat template (no chat_template in tokenizer_config.json and no "
                f"{CHAT_TEMPLATE_FILE}), so it cannot serve chat requests. Use the completions endpoint with a "
                "plain prompt, or add a chat template to the model directory.",
                param="messages",
            )
        return template

    def apply_chat_template(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` like transformers' `apply_chat_template(..., tokenize=False)`. Encode the result with
        `add_special_tokens=False`: the template already wrote every special token it wants."""
        template = self._compile(chat_template or self.get_chat_template(tools))
        if not messages:
            raise InvalidRequestError("messages must contain at least one message.", param="messages")
        chat = _alias_reasoning_fields(_plain([_prepare_message(m) for m in messages]))
        tools = _plain(list(tools)) if tools is not None else None
        variables = _plain({**self.special_tokens, **template_kwargs})
        documents = variables.pop("documents", None)
        try:
            return render_within(
                template,
                self.render_time_limit_s,
                messages=chat,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        # the template's own failures are deterministic: a 4xx, which clients do not retry
        except jinja2.exceptions.SecurityError as exc:
            raise InvalidRequestError(f"The model's chat template did what its sandbox forbids and was stopped: {exc}",
                                      param="messages") from None
        except RenderTimeout:
            raise InvalidRequestError(f"The model's chat template ran longer than {self.render_time_limit_s:g} s and "
                                      "was stopped; it may loop without end.", param="messages") from None
        except RecursionError:
            raise InvalidRequestError("The model's chat template recursed without end and was stopped.",
                                      param="messages") from None
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"The chat template rejected this request: {exc}", param="messages") from exc
        except (TypeError, ValueError, LookupError, ArithmeticError) as exc:
            # Raised by the template's own expressions on data it does not expect (e.g. list content).
            msg = f"The chat template could not render this request ({type(exc).__name__}: {exc})."
            raise InvalidRequestError(msg, param="messages") from exc

    def _compile(self, source: str) -> jinja2.Template:
        if source not in self._compiled:
            try:
                self._compiled[source] = self._env.from_string(source)
            except jinja2.TemplateSyntaxError as exc:
                raise InvalidRequestError(
                    f"The model's chat template has a syntax error at line {exc.lineno}: {exc.message}"
                ) from exc
        return self._compiled[source]


# ---------------------------------------------------------------------- loading helpers


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path} is not a readable JSON file: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} should hold a JSON object, found {type(data).__name__}.")
    return data


def _token_content(value: Any) -> str | None:
    """A special token given as a string or as an AddedToken dict ({"content": ..., "__type": "AddedToken"})."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _id_list(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _added_token(spec: dict, special: bool) -> AddedToken:
    return AddedToken(
        spec["content"],
        single_word=spec.get("single_word", False),
        lstrip=spec.get("lstrip", False),
        rstrip=spec.get("rstrip", False),
        normalized=spec.get("normalized", not special),
        special=spec.get("special", special),
    )


def _add_config_tokens(backend: BackendTokenizer, config: dict, special_tokens: dict) -> None:
    """Tokens that tokenizer_config.json declares but tokenizer.json lacks are added, as transformers does."""
    decoder = config.get("added_tokens_decoder") or {}
    specs = [decoder[k] for k in sorted(decoder, key=int) if isinstance(decoder[k], dict) and "content" in decoder[k]]
    missing = [_added_token(s, special=False) for s in specs if backend.token_to_id(s["content"]) is None]
    if missing:
        backend.add_tokens(missing)
    named = [t for t in special_tokens.values() if t is not None and backend.token_to_id(t) is None]
    if named:
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(named)])


def _load_chat_template(model_dir: Path, config: dict) -> str | dict[str, str] | None:
    """chat_template.jinja (and additional_chat_templates/*.jinja) win over tokenizer_config.json, as in transformers."""
    templates: dict[str, str] = {}
    if (model_dir / CHAT_TEMPLATE_FILE).is_file():
        templates["default"] = (model_dir / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    extra_dir = model_dir / CHAT_TEMPLATE_DIR
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.stem] = path.read_text(encoding="utf-8")
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    template = config.get("chat_template")
    if isinstance(template, list):  # the older named-templates form: [{"name": ..., "template": ...}]
        return {t["name"]: t["template"] for t in template if isinstance(t, dict) and "name" in t}
    return template if isinstance(template, str) else None


def _max_chars_per_token(backend: BackendTokenizer) -> int | None:
    """Input characters one token can stand for at most, or None when some text may map to no token at all
    (whitespace-dropping pre-tokenizers, stripping normalizers, an unknown token fused over a run of text)."""
    steps = [_component_state(backend.normalizer), _component_state(backend.pre_tokenizer)]
    if not all(_keeps_every_char(step) for step in steps):
        return None
    model = json.loads(backend.model.__getstate__())
    covers_unknown = model.get("unk_token") is None or model.get("byte_fallback") or not model.get("fuse_unk")
    if model.get("type") not in ("BPE", "Unigram") or not covers_unknown:
        return None
    longest = max(len(token) for token in backend.get_vocab(with_added_tokens=True))
    return _COMPOSITION_FACTOR * longest


def _component_state(component: Any) -> dict | None:
    return json.loads(component.__getstate__()) if component is not None else None


def _keeps_every_char(step: dict | None) -> bool:
    if step is None:
        return True
    kind = step.get("type")
    if kind not in _CHAR_KEEPING_STEPS or step.get("behavior") == "Removed":
        return False
    if kind == "Replace":  # keeps the length only when no pattern is replaced by something shorter
        pattern = step.get("pattern", {}).get("String")
        return pattern is not None and len(step.get("content", "")) >= len(pattern)
    parts = step.get("normalizers") or step.get("pretokenizers") or []
    return all(_keeps_every_char(part) for part in parts)


def _byte_fallback(token: str) -> bytes | None:
    """SentencePiece byte-fallback tokens look like <0xE4>."""
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return bytes([int(token[3:5], 16)])
        except ValueError:
            return None
    return None


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable character table, the one tokenizers' ByteLevel uses."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# ---------------------------------------------------------------------- template data


def _prepare_message(message: Any) -> dict:
    """Drop None-valued keys as transformers does, except `content`: OpenAI clients send content=null next
    to tool_calls and templates such as Qwen3's fail without it, so it becomes "" (vLLM does the same).
    Tool-call arguments sent as JSON strings are parsed into dicts, since templates index and iterate them."""
    if dataclasses.is_dataclass(message) and not isinstance(message, type):
        message = dataclasses.asdict(message)
    if not isinstance(message, Mapping):
        raise InvalidRequestError(f"Each message must be an object with a role, got {message!r}.", param="messages")
    null_content = "content" in message and message["content"] is None
    message = {k: v for k, v in message.items() if v is not None}
    if null_content:
        message["content"] = ""
    if isinstance(message.get("tool_calls"), list):
        message["tool_calls"] = [_parse_tool_call(call) for call in message["tool_calls"]]
    return message


def _parse_tool_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call  # leave malformed arguments as text; templates that print strings still work
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def _alias_reasoning_fields(chat: list[dict]) -> list[dict]:
    aliased = []
    for message in chat:
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


def _plain(value: Any) -> Any:
    """Rebuild what the template sees out of plain JSON-like types; anything else becomes an inert
    placeholder naming its type, so no caller object's methods are reachable from the sandbox."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"

"""Structured outputs: one llguidance matcher per constrained request, and the token bitmask of a step. No torch.

A request's `StructuredOutput` is a Lark grammar (JSON schemas embedded as `%json {...}`). It is compiled
against the model's tokenizer when the request is made, so an invalid or unsupported schema is refused before
anything runs. The grammar's marker rules (`marker0`, `upto_marker0`, ...) are defined here, from the tokenizer:
a marker that is one added token (`<tool_call>`, `</think>`) can only be matched as that token, a marker that is
plain text as its text.

Per step the engine asks for the bitmask of the sampled rows: bit t of row b says whether token t may follow;
rows without a grammar allow everything. A matcher sees each sampled token once that token reaches the host; it
is complete when its grammar can take no more text (the request then ends with finish_reason "stop"), refused
when llguidance cannot go on (a limit such as its 2,000 items per parser row hit mid-answer): the request then
ends with finish_reason "error" and `refusal` says why, so the partial answer is never reported as complete.

Each grammar text is compiled once: the compiled matcher is kept (a few, least recently used first out) and each
request gets a copy. Grammar text over MAX_GRAMMAR_CHARS is refused before llguidance sees it (its compile time
grows faster than the text: ~1 s at 100 KB of optional properties), and its own limits come back as a short
reason, never its internals (a Rust panic, the grammar dump).

The llguidance tokenizer is told that added tokens (`<|im_end|>`, `</tool_call>`) are never spelled by text: a
schema string that spells one is then written with ordinary tokens, and the answer completes.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import llguidance.numpy as llguidance_np
import numpy as np

from server.engine.tokenizer import Tokenizer
from server.engine.types import InvalidRequestError, StructuredOutput

log = logging.getLogger(__name__)

_MARKER_REF = re.compile(r"\b(upto_)?marker(\d+)\b")
_LOCATION = re.compile(r"^(at )?\d+\(\d+\):\s*")  # "line(column): " in front of llguidance's reasons
MAX_GRAMMAR_CHARS = 128 * 1024  # larger grammars are refused before compiling (seconds of work, see above)
MAX_GRAMMAR_SYMBOLS = 60_000  # llguidance asserts (a panic) past 65,525 symbols; its own limit refuses first
NUM_CACHED_GRAMMARS = 16
_TOO_COMPLEX = "the schema is too large or complex to enforce; simplify it (fewer properties or alternatives)"


class GrammarMatcher:
    """Where one request's output stands in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, param: str = "response_format"):
        self._matcher = matcher
        self.param = param
        self.refusal: InvalidRequestError | None = None  # set when the grammar could not go on

    def advance(self, token_id: int) -> bool:
        """Take the sampled token; True once nothing more can be generated inside the grammar: the output is
        complete, or the matcher refused the token (`refusal` then says why)."""
        if not self._matcher.consume_token(token_id):
            reason = _first_line(self._matcher.get_error())
            log.warning("structured output: token %d refused by the grammar: %s", token_id, reason)
            self.refusal = InvalidRequestError(
                f"{self.param} could not be enforced to the end of the answer: {_client_reason(reason)}",
                param=self.param, code="grammar_limit")
            return True
        return self._matcher.is_stopped()

    @property
    def is_complete(self) -> bool:
        return self._matcher.is_stopped()


class Grammars:
    """Compiles requests' grammars against one tokenizer; fills the bitmask of a step."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int):
        self._tokenizer = tokenizer
        self.vocab_size = max(vocab_size, tokenizer.vocab_size if tokenizer is not None else 0)
        self.num_words = -(-vocab_size // 32)  # int32 words per bitmask row, over the model's logits
        self._ll_tokenizer: llguidance.LLTokenizer | None = None  # built on first use: ~1 s for a large vocabulary
        self._executor: llguidance.LLExecutor | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()  # grammar text -> fresh matcher
        self._lock = threading.Lock()  # requests are made on worker threads too (api.offload)
        self.num_compiles = 0

    def compile(self, spec: StructuredOutput) -> GrammarMatcher:
        """Raises InvalidRequestError naming `spec.param` when the grammar or one of its schemas is refused.
        Thread-safe; llguidance releases the GIL while it compiles."""
        if self._tokenizer is None:
            raise InvalidRequestError("structured outputs need a tokenizer; this engine has none", param=spec.param)
        if len(spec.grammar) > MAX_GRAMMAR_CHARS:
            raise InvalidRequestError(f"{spec.param} cannot be enforced: its schema is {len(spec.grammar):,} "
                                      f"characters as a grammar, over the limit of {MAX_GRAMMAR_CHARS:,}.",
                                      param=spec.param, code="grammar_too_large")
        grammar = spec.grammar + self._marker_rules(spec.markers, spec.grammar)
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
                return GrammarMatcher(compiled.deep_copy(), spec.param)
        limits = llguidance.LLParserLimits(max_grammar_size=MAX_GRAMMAR_SYMBOLS)
        matcher = llguidance.LLMatcher(self._llguidance_tokenizer(), grammar, log_level=0, limits=limits)
        if matcher.is_error():
            reason = _first_line(matcher.get_error())
            log.info("structured output refused: %s", reason)
            raise InvalidRequestError(f"{spec.param} cannot be enforced: {_client_reason(reason)}", param=spec.param)
        with self._lock:
            self.num_compiles += 1
            self._compiled[grammar] = matcher.deep_copy()
            while len(self._compiled) > NUM_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return GrammarMatcher(matcher, spec.param)

    def bitmask(self, matchers: Sequence[GrammarMatcher | None]) -> np.ndarray:
        """int32 [len(matchers), num_words]: the tokens each row may sample next; all bits set on rows without a
        matcher (or whose matcher is complete: their token is discarded)."""
        mask = np.full((len(matchers), self.num_words), -1, dtype=np.int32)
        rows = [(m._matcher, i) for i, m in enumerate(matchers) if m is not None and not m.is_complete]
        if rows:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            full = np.empty((len(matchers), -(-self.vocab_size // 32)), dtype=np.int32)
            llguidance_np.fill_next_token_bitmask_par(self._executor, rows, full)
            for _, i in rows:
                mask[i] = full[i, : self.num_words]
        return mask

    def _llguidance_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                eos = sorted(self._tokenizer.eos_token_ids)
                self._ll_tokenizer = llguidance.LLTokenizer(_unspellable_added_tokens(self._tokenizer.backend.to_str()),
                                                            n_vocab=self.vocab_size, eos_token=eos or None)
            return self._ll_tokenizer

    def _marker_rules(self, markers: Sequence[str], grammar: str) -> str:
        """`markerK` matches markers[K]; `upto_markerK` any text, then markers[K] (its first occurrence)."""
        used = {(bool(m.group(1)), int(m.group(2))) for m in _MARKER_REF.finditer(grammar)}
        rules = []
        for index, text in enumerate(markers):
            token = self._added_token(text)
            rules.append(f"marker{index}: {f'<[{token}]>' if token is not None else json.dumps(text)}")
            if (True, index) in used:
                if token is not None:  # free text cannot contain the token: it ends where the token comes
                    rules.append(f"upto_marker{index}: /(?s:.*)/ marker{index}")
                else:
                    rules.append(f"upto_marker{index}[lazy]: /(?s:.*){re.escape(text).replace('/', chr(92) + '/')}/")
        return "\n" + "\n".join(rules) + "\n" if rules else ""

    def _added_token(self, text: str) -> int | None:
        """The id of `text` when it is one added token, which llguidance matches only as that token."""
        token_id = self._tokenizer.backend.token_to_id(text)
        if token_id is None or token_id not in self._tokenizer.backend.get_added_tokens_decoder():
            return None
        return token_id if self._llguidance_tokenizer().is_special_token(token_id) else None


def only_token(row: np.ndarray, token_id: int) -> None:
    """Narrow one bitmask row (int32 words) to `token_id`, where the row allows it."""
    word, bit = divmod(token_id, 32)
    if word < row.shape[0] and (int(row[word]) >> bit) & 1:
        row[:] = 0
        row[word] = np.uint32(1 << bit).view(np.int32)


def _unspellable_added_tokens(tokenizer_json: str) -> str:
    """The tokenizer with each added token's text made one no text contains. llguidance tokenizes forced text
    (a `const` string) with the tokenizer and allows only that tokenization; text spelling `<|im_end|>` would
    become the special token, which the grammar refuses inside a string, and the answer would end there. The
    tokens keep their ids, so grammars still name them (`<[id]>`): all of them as special tokens, which only
    match as themselves."""
    spec = json.loads(tokenizer_json)
    for token in spec.get("added_tokens") or []:
        token["content"] = "\x00" + token["content"]
        token["special"] = True
    return json.dumps(spec)


def _client_reason(reason: str) -> str:
    """llguidance's reason as a client may read it: its limits and panics as one plain sentence."""
    if "panic" in reason or "too big" in reason or "max is" in reason or "too complex" in reason.lower():
        return _TOO_COMPLEX
    return reason[:300]


def _first_line(message: str) -> str:
    """llguidance's messages carry the grammar text after the reason; the reason is what a client can act on."""
    return _LOCATION.sub("", message.strip().splitlines()[0]).strip()

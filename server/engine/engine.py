"""The engine: one loop `schedule() -> runner.launch() -> scheduler.on_launched()`, then the previous step is
resolved (`scheduler.on_resolved()`) while the device computes the new one.

`Engine` is what Python users call (`generate`, `chat`, `score`); `AsyncEngine` drives the same `step()`
from a background thread for the HTTP server. Wiring and memory sizing are `build`'s, text and logprobs
`outputs`', the warm-up's runs `warmup`'s.

Structured outputs and the overlap: a constrained row's bitmask depends on the token sampled just before, which
is still on the device when the next step is launched. So a step with constrained rows is launched in two parts:
the forward is queued first (its input token fed on the device as always), then the previous step is finished
on the host (ids read, matchers advanced, text, stop checks) while the device runs that forward, then the rows'
bitmasks are computed and the sampler queued with them. Unconstrained rows in that batch keep the overlapped
forward and wait only for the mask work before their sampler; batches without constrained rows are unchanged.
"""

from __future__ import annotations

import logging
import secrets
import uuid
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from server.config import EngineConfig
from server.engine.background_compile import BackgroundCompile, describe_failure
from server.engine.build import EngineParts, build_parts, load_pretrained
from server.engine.compiled_steps import CompiledSteps, child_before_load
from server.engine.device import serialized_device_work
from server.engine.embeddings import Pooling, check_embeddable, hidden_states, pool, read_pooling, truncate
from server.engine.grammar import Grammars
from server.engine.model_runner import ModelRunner
from server.engine.outputs import OutputAssembler, final_output, stream_delta
from server.engine.request import PLACEHOLDER, Request
from server.engine.scheduler import ScheduledChunk, SchedulerOutput
from server.engine.threads import apply_cpu_threads
from server.engine.tokenizer import Tokenizer
from server.engine.types import (
    ChatPrompt,
    ContextLengthExceededError,
    EngineStats,
    InvalidRequestError,
    RequestOutput,
    SamplingParams,
    StepFailedError,
    StreamDelta,
)
from server.engine.weights import persistent_tensors, resolve_model_path
from server.kernels.capabilities import REPORT_HINT
from server.models.tracing_shield import shield_from_tracing

log = logging.getLogger(__name__)


class Engine(CompiledSteps):
    def __init__(self, model, tokenizer: Tokenizer | None, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                 max_model_len: int, model_name: str, parts: EngineParts | None = None, pooling: Pooling | None = None):
        shield_from_tracing(model)  # eager steps may run while a background compile traces the model
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.pooling = pooling  # set for embedding checkpoints (embeddings.read_pooling)
        if pooling is not None:
            check_embeddable(model)
        self.device, self.dtype = device, dtype
        self.max_model_len = max_model_len
        self.model_name = model_name
        self.vocab_size = model.args.vocab_size
        parts = parts or build_parts(model, config, device, dtype, max_model_len)
        self.kv_cache, self.state_cache, self.kv_manager = parts.kv_cache, parts.state_cache, parts.kv_manager
        self.scheduler, self.runner, self.compile_prefill = parts.scheduler, parts.runner, parts.compile_prefill
        self.outputs = OutputAssembler(tokenizer, self.scheduler.finish)
        self.grammars = Grammars(tokenizer, self.vocab_size)
        self._score_logits: dict[str, list[torch.Tensor]] = {}  # score(): chunks of all-position logits
        self._num_prompt_tokens = 0
        self._in_flight = None  # the launched step whose sampled ids have not been read yet
        self._num_generated_tokens = 0
        self._warmed_up = False
        self._background: BackgroundCompile | None = None
        self._compiled_runner: ModelRunner | None = None  # built beside serving, in use once ready
        self._early_child = None  # the compile child started while the weights loaded (from_config)
        self._warming_up = False  # warm_up's runs: a compile failure is raised to its caller
        self._compile_failed = False  # the lazily compiled step failed: eager from then on

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model: str = "demo", device: str = "auto", dtype: str = "auto", quantization: str | None = None, **overrides: Any) -> Engine:
        return cls.from_config(EngineConfig(model=model, device=device, dtype=dtype, quantization=quantization, **overrides))

    @classmethod
    def from_model(cls, model, config: EngineConfig, device: torch.device, tokenizer: Tokenizer | None = None, max_model_len: int | None = None) -> Engine:
        """Serve an already-built model (benchmarks build random-weight models of real shapes on the device).
        Without a tokenizer, prompts must be token ids and outputs carry no text."""
        dtype = next(model.parameters()).dtype
        limit = max_model_len or config.max_model_len or model.args.max_position_embeddings
        engine = cls(model, tokenizer, config, device, dtype, limit, config.model)
        engine.save_compiled_steps()
        return engine

    @classmethod
    def from_config(cls, config: EngineConfig, compile_beside_serving: bool = False) -> Engine:
        """`compile_beside_serving`: the caller calls `compile_in_background` next; its compile child starts as
        soon as the model's tensors exist, and compiles while the weights load."""
        apply_cpu_threads(config.cpu_threads)  # before loading: FP8 quantization already runs CPU ops
        if config.tensor_parallel > 1 or config.pipeline_parallel > 1:
            from server.engine.distributed import BuildSpec, start_engine  # it builds Engines: imported late

            return start_engine(BuildSpec(config))
        early = child_before_load(config) if compile_beside_serving else None
        model, tokenizer, device, dtype, max_model_len = load_pretrained(config, on_materialized=early)
        pooling = None if config.model == "demo" else read_pooling(resolve_model_path(config.model, config.revision))
        parts = build_parts(model, config, device, dtype, max_model_len,
                            num_kv_blocks=early.num_kv_blocks if early else None)
        engine = cls(model, tokenizer, config, device, dtype, max_model_len, config.model, parts, pooling)
        engine._early_child = early.child if early else None
        engine.save_compiled_steps()
        return engine

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights on the device: parameters and persistent buffers (FP8 weights and their
        scales, expert biases), each shared tensor once; not derived tables such as RoPE frequencies."""
        return sum(t.numel() * t.element_size() for t in persistent_tensors(self.model).values())

    # ---- requests -----------------------------------------------------------------------------
    def make_request(self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None) -> Request:
        """Tokenize and validate; raises InvalidRequestError / ContextLengthExceededError."""
        params.validate(self.vocab_size)
        prompt_ids = self.prompt_ids(prompt)
        if len(prompt_ids) >= self.max_model_len:
            num_tokens = len(prompt_ids)
            # the exception's traceback keeps this frame: without the list in it, a refusal retains no tokens
            del prompt_ids
            raise ContextLengthExceededError(num_tokens, self.max_model_len)
        grammar = self.grammars.compile(params.structured) if params.structured is not None else None
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos and self.tokenizer is not None:
            stop_ids |= set(self.tokenizer.eos_token_ids)
        return Request(
            request_id=request_id or uuid.uuid4().hex,
            token_ids=list(prompt_ids),
            num_prompt_tokens=len(prompt_ids),
            params=params,
            seed=params.seed if params.seed is not None else secrets.randbits(62),
            stop_token_ids=frozenset(stop_ids),
            max_total_tokens=min(len(prompt_ids) + params.max_tokens, self.max_model_len),
            grammar=grammar,
        )

    def prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """The token ids of a prompt (text or ids); one that cannot fit is refused on its length alone, before
        tokenizing; raises InvalidRequestError when empty or outside the vocab."""
        if isinstance(prompt, str):
            prompt_ids = self.encode_prompt(prompt)
        else:
            if len(prompt) >= self.max_model_len:
                raise ContextLengthExceededError(len(prompt), self.max_model_len)
            prompt_ids = [int(t) for t in prompt]
            bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size][:5]
            if bad:
                raise InvalidRequestError(f"prompt token ids {bad} are outside the vocabulary [0, {self.vocab_size}).", param="prompt")
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty; send at least one token of text", param="prompt")
        return prompt_ids

    def encode_prompt(self, prompt: str) -> list[int]:
        """Token ids of a text prompt; a ChatPrompt already holds its special tokens, so none are added."""
        if self.tokenizer is None:
            raise InvalidRequestError("this engine has no tokenizer; send token ids", param="prompt")
        min_tokens = self.tokenizer.min_num_tokens(prompt)
        if min_tokens >= self.max_model_len:
            raise ContextLengthExceededError(min_tokens, self.max_model_len, at_least=True)
        return self.tokenizer.encode(prompt, add_special_tokens=not isinstance(prompt, ChatPrompt))

    def add_request(self, request: Request) -> None:
        self.scheduler.add(request)  # first: it refuses an id in use before that request's text is touched
        self.outputs.add(request)
        self._num_prompt_tokens += request.num_prompt_tokens

    def abort(self, request_id: str) -> StreamDelta | None:
        """Stop a request now and free its KV blocks. Returns its final delta, if it was known."""
        request = self.scheduler.abort(request_id)
        if request is None or not self.outputs.drop(request_id):
            return None
        return stream_delta(request, "", [], None)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> list[StreamDelta]:
        """Schedule and launch step N+1, then finish step N (read its ids, detokenize, stop checks) while
        the device computes N+1. On the CPU the launch itself computes, so nothing overlaps there."""
        if (self._compiled_runner is not None and self.runner is not self._compiled_runner
                and self._background.first_stage_ready):
            self._move_to_compiled_runner()
        out = self.scheduler.schedule()
        try:
            with serialized_device_work(self.device):
                return self._run_step(out)
        except Exception as exc:
            raise self._abandon_step(out, exc) from exc

    def _run_step(self, out: SchedulerOutput) -> list[StreamDelta]:
        deltas: list[StreamDelta] = []
        if self._in_flight is not None and self._needs_known_tokens(out):
            deltas += self._complete(self._in_flight)
            self._in_flight = None
            out.chunks = [c for c in out.chunks if not c.request.is_finished]
        prev, launched = self._in_flight, None
        if out.chunks:
            launched, prev_done = self._launch(out, prev, deltas)
            prev = None if prev_done else prev
        if prev is not None:
            deltas += self._complete(prev)
        self._in_flight = launched
        return deltas

    def _launch(self, out: SchedulerOutput, prev, deltas: list[StreamDelta]):
        """Launch `out` -> (the launched step, whether `prev` was finished meanwhile, its deltas added to
        `deltas`: a step with constrained rows, see the module docstring)."""
        if not any(c.request.grammar is not None for c in out.chunks):
            launched = self._run_launch(out, prev)
            self.scheduler.on_launched(out)
            return launched, False
        finished = []

        def token_bitmask(sample_chunks: list[ScheduledChunk]) -> torch.Tensor:
            self.scheduler.on_launched(out)
            if prev is not None:
                deltas.extend(self._complete(prev))
            finished.append(prev)
            live = [None if c.request.is_finished else c.request.grammar for c in sample_chunks]
            return torch.from_numpy(self.grammars.bitmask(live))

        launched = self._run_launch(out, prev, token_bitmask)
        if not finished:  # no row sampled in this step
            self.scheduler.on_launched(out)
        return launched, bool(finished)

    def _run_launch(self, out: SchedulerOutput, prev, token_bitmask=None):
        """runner.launch; a compiled step that fails to compile here (dynamo or inductor raising before the
        step runs: its first use, or a shape the warm-up did not cover) moves the engine to the eager runner for
        good, with one warning, and the step runs there. The warm-up re-raises instead: its caller (the
        background compile, or whoever asked for it) reports the failure."""
        try:
            return self.runner.launch(out, prev, token_bitmask)
        except torch._dynamo.exc.TorchDynamoException as exc:
            if self._warming_up or (self.runner.decode_graphs is None and not self.compile_prefill):
                raise
            log.warning("compiling the decode step failed on %s (%s); this engine runs eagerly from now on, which "
                        "is slower. %s.", self.device, describe_failure(exc), REPORT_HINT)
            self.runner = ModelRunner(self.model, self.kv_cache, self.device, self.vocab_size, None, self.state_cache,
                                      self.runner.plans)
            self.compile_prefill = False
            self._compile_failed = True
            self._compiled_runner = None  # a background compile's runner too: never moved to again
            return self.runner.launch(out, prev, token_bitmask)

    def _abandon_step(self, out: SchedulerOutput, exc: Exception) -> StepFailedError:
        """A step raised: end the requests it held and those of the step still in flight (their tokens are lost),
        freeing their blocks; the others keep their state and go on with the next step."""
        steps = [out] if self._in_flight is None else [out, self._in_flight.out]
        self._in_flight = None
        request_ids = list(dict.fromkeys(c.request.request_id for step in steps for c in step.chunks))
        for request_id in request_ids:
            self.abort(request_id)
        return StepFailedError(request_ids, exc)

    @staticmethod
    def _needs_known_tokens(out: SchedulerOutput) -> bool:
        """Penalties count the previous tokens on the host, so they cannot use a token still in flight."""
        for chunk in out.chunks:
            request, params = chunk.request, chunk.request.params
            if request.num_pending_tokens and (
                params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty
            ):
                return True
        return False

    def _complete(self, step) -> list[StreamDelta]:
        result = step.resolve()
        for request_id, logits in result.all_logits.items():
            self._score_logits.setdefault(request_id, []).append(logits)
        sampled = {rid: tok.token_id for rid, tok in result.sampled.items()}
        self._num_generated_tokens += len(sampled)
        deltas = []
        for request, token_id in self.scheduler.on_resolved(step.out, sampled):
            if request.grammar is not None and not request.is_finished and request.grammar.advance(token_id):
                self._finish_grammar(request)
            deltas.append(self.outputs.on_token(request, result.sampled[request.request_id]))
        return deltas

    def _finish_grammar(self, request: Request) -> None:
        """The output is complete in its grammar: the request ends ("stop"), the next token in flight is dropped."""
        while request.token_ids[-1] == PLACEHOLDER:
            request.token_ids.pop()
        self.scheduler.finish(request, "stop")

    def stats(self) -> EngineStats:
        return EngineStats(
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            kv_blocks_used=self.kv_manager.num_used_blocks,
            kv_blocks_free=self.kv_manager.num_free_blocks,
            prefix_cache_hit_tokens=self.scheduler.num_prefix_hit_tokens,
            prompt_tokens=self._num_prompt_tokens,
            generation_tokens=self._num_generated_tokens,
            compile_state=self.compile_state,
        )

    # ---- convenience API ----------------------------------------------------------------------
    def generate(self, prompt, params: SamplingParams | None = None):
        """One prompt (str or token ids) -> RequestOutput; a list of prompts -> a list, run as one batch."""
        single = isinstance(prompt, str) or (len(prompt) > 0 and isinstance(prompt[0], int))
        prompts = [prompt] if single else list(prompt)
        params = params or SamplingParams()
        results = self.run_to_completion([self.make_request(p, replace(params)) for p in prompts])
        return results[0] if single else results

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None, tools=None, **template_kwargs) -> RequestOutput:
        text = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, **template_kwargs)
        return self.generate(ChatPrompt(text), params)

    def run_to_completion(self, requests: list[Request]) -> list[RequestOutput]:
        """Run made requests (each with its own params) as one batch on an idle engine; their outputs in order."""
        if self.has_unfinished:
            raise RuntimeError("generate() cannot run while the engine serves other requests; use AsyncEngine")
        deltas: dict[str, list[StreamDelta]] = {}
        for request in requests:
            self.add_request(request)
            deltas[request.request_id] = []
        while self.has_unfinished:
            for delta in self.step():
                deltas[delta.request_id].append(delta)
        return [final_output(r, deltas[r.request_id]) for r in requests]

    def embed(self, prompts: Sequence[str | Sequence[int]], dimensions: int | None = None) -> tuple[list[list[float]], int]:
        """Pooled embedding of each prompt (text or token ids), truncated to `dimensions` if given; -> (vectors,
        number of prompt tokens). Only for embedding checkpoints; runs while the engine is between steps."""
        if self.pooling is None:
            raise InvalidRequestError(
                f"the served model {self.model_name} is not an embedding model: its checkpoint has no "
                "sentence-transformers pooling config (modules.json and a Pooling module). Serve an embedding "
                "checkpoint such as Qwen3-Embedding.", param="model", code="model_not_embedding")
        vectors, num_tokens = [], 0
        for index, prompt in enumerate(prompts):
            ids = self.prompt_ids(prompt)
            if len(ids) > self.max_model_len:
                raise InvalidRequestError(
                    f"input[{index}] is {len(ids)} tokens, more than this model's maximum context length of "
                    f"{self.max_model_len} tokens.", param="input", code="context_length_exceeded")
            with serialized_device_work(self.device):
                vector = pool(hidden_states(self.model, ids, self.device, self.runner.plans.eager), self.pooling).tolist()
            vectors.append(truncate(vector, dimensions, self.pooling.normalize))
            num_tokens += len(ids)
        return vectors, num_tokens

    def score(self, token_ids: Sequence[int]) -> torch.Tensor:
        """float32 logits `[len, vocab]` of one full (chunked) prefill, for parity tests and perplexity."""
        request = self.make_request(list(token_ids), SamplingParams(max_tokens=1, temperature=0.0))
        request.return_all_logits = True
        self.add_request(request)
        while request.num_computed_tokens < request.num_tokens:
            self.step()
        while self._in_flight is not None:
            self.step()
        self.scheduler.finish(request, "stop")
        self.outputs.drop(request.request_id)
        return torch.cat(self._score_logits.pop(request.request_id)).cpu()

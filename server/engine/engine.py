"""The engine: one loop `schedule() -> runner.forward() -> runner.sample() -> scheduler.on_launched()`, then the
previous step is resolved (`scheduler.on_resolved()`) while the device computes the new one.

`Engine` is what Python users call (`generate`, `chat`, `score`); `AsyncEngine` drives the same `step()`
from a background thread for the HTTP server. Wiring and memory sizing are `build`'s, request input `inputs`',
text and logprobs `outputs`', what compiles server.compile's: the engine holds "the runner for the next step"
(engine.steps.Steps) and never swaps a runner itself.

Structured outputs and the overlap: a constrained row's bitmask depends on the token sampled just before, which
is still on the device when the next step is launched. So a step is launched in two runner calls: the forward is
queued first (its input token fed on the device as always), then, where the step has constrained rows, the
previous step is finished on the host (ids read, matchers advanced, text, stop checks) while the device runs that
forward and the rows' bitmasks are computed; then the sampler is queued with them. Unconstrained rows in that batch
keep the overlapped forward and wait only for the mask work before their sampler; batches without constrained rows
are unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from server.compile.steps import build_steps, child_before_load
from server.config import EngineConfig
from server.engine.build import EngineParts, attach_disk_tier, build_parts, load_pretrained
from server.engine.device import serialized_device_work
from server.engine.embeddings import Pooling, check_embeddable, embed, read_pooling
from server.engine.grammar import only_token
from server.engine.inputs import Inputs
from server.engine.model_runner import InFlightStep, ModelRunner
from server.engine.outputs import OutputAssembler, final_output, stream_delta
from server.engine.request import PLACEHOLDER, Request
from server.engine.scheduler import SchedulerOutput
from server.engine.steps import EagerSteps, Steps
from server.engine.threads import apply_cpu_threads
from server.engine.tokenizer import Tokenizer
from server.engine.types import (
    EngineStats,
    FinishReason,
    InfillPrompt,
    ModelDescription,
    RequestOutput,
    SamplingParams,
    StepFailedError,
    StreamDelta,
)
from server.engine.weights import bits_per_weight, resident_bytes, resolve_model_path
from server.kernels.capabilities import Capabilities

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, model, tokenizer: Tokenizer | None, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                 max_model_len: int, model_name: str, parts: EngineParts, steps: Steps | None = None,
                 pooling: Pooling | None = None):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self._bits_per_weight: float | None = None  # computed on first use (stats(), /metrics)
        self.pooling = pooling  # set for embedding checkpoints (embeddings.read_pooling)
        if pooling is not None:
            check_embeddable(model)
        self.device, self.dtype = device, dtype
        self.max_model_len = max_model_len
        self.model_name = model_name
        self.vocab_size = model.args.vocab_size
        self.kv_cache, self.state_cache, self.kv_manager = parts.kv_cache, parts.state_cache, parts.kv_manager
        self.scheduler = parts.scheduler
        self.steps = steps or EagerSteps(parts.runner)
        self.inputs = Inputs(tokenizer, self.vocab_size, max_model_len)
        self.outputs = OutputAssembler(tokenizer, self._finish_early)
        self._score_logits: dict[str, list[torch.Tensor]] = {}  # score(): chunks of all-position logits
        self._num_prompt_tokens = 0
        self._in_flight: InFlightStep | None = None  # the launched step whose sampled ids have not been read yet
        self._num_generated_tokens = 0

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model: str = "demo", device: str = "auto", dtype: str = "auto", quantization: str | None = None, **overrides: Any) -> Engine:
        return cls.from_config(EngineConfig.from_flat(model=model, device=device, dtype=dtype, quantization=quantization, **overrides))

    @classmethod
    def from_model(cls, model, config: EngineConfig, device: torch.device, tokenizer: Tokenizer | None = None, max_model_len: int | None = None) -> Engine:
        """Serve an already-built model (benchmarks build random-weight models of real shapes on the device).
        Without a tokenizer, prompts must be token ids and outputs carry no text."""
        dtype = next(model.parameters()).dtype
        limit = max_model_len or config.scheduler.max_model_len or model.args.max_position_embeddings
        parts = build_parts(model, config, device, dtype, limit)
        attach_disk_tier(parts, model, config, device, dtype)
        steps = build_steps(model, config, parts, device, dtype, limit)
        return cls(model, tokenizer, config, device, dtype, limit, config.load.model, parts, steps)

    @classmethod
    def from_config(cls, config: EngineConfig, compile_beside_serving: bool = False,
                    plan_as: Capabilities | None = None) -> Engine:
        """`compile_beside_serving`: the caller calls `compile_in_background` next; its compile child starts as
        soon as the model's tensors exist, and compiles while the weights load. `plan_as`: build_parts'."""
        apply_cpu_threads(config.load.cpu_threads)  # before loading: FP8 quantization already runs CPU ops
        if config.parallel.tensor_parallel > 1 or config.parallel.pipeline_parallel > 1:
            from server.engine.distributed import start_engine  # torch.distributed: imported where it serves

            if config.cache.prefix_cache_dir is not None:
                log.warning("prefix_cache_dir is ignored: the disk tier serves one process's KV cache, not a "
                            "tensor- or pipeline-parallel one")

            return cls(*start_engine(config))  # run eagerly: the compiled decode step is one process's
        early = child_before_load(config) if compile_beside_serving else None
        model, tokenizer, device, dtype, max_model_len = load_pretrained(config, on_materialized=early)
        pooling = None if config.load.model == "demo" else read_pooling(resolve_model_path(config.load.model, config.load.revision))
        parts = build_parts(model, config, device, dtype, max_model_len,
                            num_kv_blocks=early.num_kv_blocks if early else None, plan_as=plan_as)
        attach_disk_tier(parts, model, config, device, dtype)
        steps = build_steps(model, config, parts, device, dtype, max_model_len, early)
        return cls(model, tokenizer, config, device, dtype, max_model_len, config.load.model, parts, steps, pooling)

    @property
    def runner(self) -> ModelRunner:
        """The runner the next step runs on."""
        return self.steps.runner

    @property
    def compile_state(self) -> str:
        """One of types.COMPILE_STATES."""
        return self.steps.state

    def warm_up(self) -> float:
        """Compile (and capture) the compiled steps before serving, so that no request waits for them; returns
        the seconds taken (0 where nothing compiles: the CPU default)."""
        return self.steps.warm_up()

    def compile_in_background(self):
        """Serve on the eager path now and compile beside serving (compile.steps); None when nothing compiles."""
        return self.steps.compile_in_background()

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights on the device (engine/weights.resident_bytes)."""
        return resident_bytes(self.model)

    @property
    def bits_per_weight(self) -> float:
        """Resident bits per model weight (engine/weights.bits_per_weight): ~16 bf16, ~8 FP8, ~4.5 int4."""
        if self._bits_per_weight is None:
            self._bits_per_weight = bits_per_weight(self.model)
        return self._bits_per_weight

    def describe(self) -> ModelDescription:
        """The served checkpoint, for the HTTP APIs that list and show models."""
        args, bits = self.model.args, self.bits_per_weight
        quantization = self.config.load.quantization
        if quantization is None and bits < 0.75 * 8 * self.dtype.itemsize:  # packed weights: an MLX checkpoint
            quantization = "mlx"
        template = self.tokenizer.chat_template if self.tokenizer is not None else None
        if isinstance(template, dict):  # named templates: the default one is what chat requests use
            template = template.get("default")
        return ModelDescription(
            model_type=args.model_type, parameter_count=round(self.weight_bytes * 8 / max(bits, 1e-9)),
            weight_bytes=self.weight_bytes, dtype=str(self.dtype).removeprefix("torch."), quantization=quantization,
            max_model_len=self.max_model_len, device=self.device.type, hidden_size=args.hidden_size,
            num_layers=args.num_hidden_layers, vocab_size=args.vocab_size, chat_template=template, embedding=self.pooling is not None,
        )

    # ---- requests -----------------------------------------------------------------------------
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
        self.steps.before_step(self._in_flight)
        out = self.scheduler.schedule()
        try:
            with serialized_device_work(self.device):
                self.kv_manager.apply_disk_copies()  # evicted blocks out, blocks read from disk in
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

    def _launch(self, out: SchedulerOutput, prev: InFlightStep | None,
                deltas: list[StreamDelta]) -> tuple[InFlightStep, bool]:
        """Launch `out` -> (the launched step, whether `prev` was finished meanwhile, its deltas added to
        `deltas`: a step with constrained rows, see the module docstring)."""
        queued = self.steps.run(lambda runner: runner.forward(out, prev))
        self.scheduler.on_launched(out)
        sample_chunks = queued.step.sample_chunks
        token_bitmask, prev_done = None, False
        # the placeholder of the token sampled now is in token_ids already (on_launched)
        if any(c.request.may_mask(c.request.num_output_tokens - 1) for c in sample_chunks):
            if prev is not None:  # its ids advance the matchers and budgets this step's masks come from
                deltas.extend(self._complete(prev))
            prev_done = True
            token_bitmask = self._token_bitmask(sample_chunks)
        launched = self.steps.run(lambda runner: runner.sample(queued, token_bitmask))
        return launched, prev_done

    def _token_bitmask(self, sample_chunks) -> torch.Tensor | None:
        """The rows' grammar masks, where a spent reasoning budget forces its marker's next token (unless the grammar
        refuses it); None when no row is constrained any more."""
        live = [None if c.request.is_finished else c.request.grammar for c in sample_chunks]
        forced = [None if c.request.is_finished or c.request.reasoning is None
                  else c.request.reasoning.forced_token(c.request.num_output_tokens - 1) for c in sample_chunks]
        if all(g is None for g in live) and all(f is None for f in forced):
            return None
        mask = self.inputs.grammars.bitmask(live)
        for row, token_id in enumerate(forced):
            if token_id is not None:
                only_token(mask[row], token_id)
        return torch.from_numpy(mask)

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
            if request.reasoning is not None:
                request.reasoning.advance(token_id)
            if request.grammar is not None and not request.is_finished and request.grammar.advance(token_id):
                self._finish_grammar(request)
            deltas.append(self.outputs.on_token(request, result.sampled[request.request_id]))
        return deltas

    def _finish_grammar(self, request: Request) -> None:
        """The output is complete in its grammar: the request ends ("stop"), the next token in flight is dropped.
        A grammar that refused the token instead ends it with "error" and the refusal (the text is partial)."""
        request.error = request.grammar.refusal
        reason = FinishReason.STOP if request.error is None else FinishReason.ERROR
        self._finish_early(request, reason.value)

    def _finish_early(self, request: Request, reason: str) -> None:
        """End a request on a token already resolved (a stop string, the grammar, the time budget): the tokens
        launched after it are dropped, so they are neither output nor counted."""
        while request.token_ids[-1] == PLACEHOLDER:
            request.token_ids.pop()
        self.scheduler.finish(request, reason)

    def save_prefix_cache(self, wait: bool = True) -> bool:
        """Write the cached KV blocks (and hybrid snapshots) that the disk tier lacks, so that the next process on
        this model finds them. `wait`: until all are written (shutdown); else queue what the writer takes now and
        return (between requests: a crash then loses little). -> whether all were queued; True without a tier."""
        if self.kv_manager.disk is None:
            return True
        while True:
            with serialized_device_work(self.device):  # the writer waits for its copies outside this lock
                done = self.kv_manager.save_to_disk()
            if not wait:
                return done
            self.kv_manager.disk.io.drain()
            if done:
                return True

    def stats(self) -> EngineStats:
        disk = self.kv_manager.disk
        return EngineStats(
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            kv_blocks_used=self.kv_manager.num_used_blocks,
            kv_blocks_free=self.kv_manager.num_free_blocks,
            prefix_cache_hit_tokens=self.scheduler.num_prefix_hit_tokens,
            prefix_cache_disk_hit_tokens=self.scheduler.num_prefix_disk_hit_tokens,
            prefix_cache_miss_tokens=self.scheduler.num_prefix_miss_tokens,
            prefix_cache_disk_bytes=disk.index.total_bytes if disk is not None else 0,
            prefix_cache_disk_writes_dropped=disk.counts.writes_dropped if disk is not None else 0,
            prompt_tokens=self._num_prompt_tokens,
            generation_tokens=self._num_generated_tokens,
            compile_state=self.compile_state,
            bits_per_weight=self.bits_per_weight,
        )

    # ---- convenience API ----------------------------------------------------------------------
    def generate(self, prompt, params: SamplingParams | None = None):
        """One prompt (str, token ids or an InfillPrompt) -> RequestOutput; a list of prompts -> a list, run as one batch."""
        single = isinstance(prompt, str | InfillPrompt) or (len(prompt) > 0 and isinstance(prompt[0], int))
        prompts = [prompt] if single else list(prompt)
        params = params or SamplingParams()
        results = self.run_to_completion([self.inputs.make_request(p, replace(params)) for p in prompts])
        return results[0] if single else results

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None, tools=None, **template_kwargs) -> RequestOutput:
        return self.generate(self.inputs.chat_prompt(messages, tools, **template_kwargs), params)

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
        """embeddings.embed of this engine's model: (vectors, number of prompt tokens)."""
        return embed(self.model, self.inputs, self.device, self.runner.plans.eager, self.pooling, self.model_name,
                     prompts, dimensions)

    def score(self, token_ids: Sequence[int]) -> torch.Tensor:
        """float32 logits `[len, vocab]` of one full (chunked) prefill, for parity tests and perplexity."""
        request = self.inputs.make_request(list(token_ids), SamplingParams(max_tokens=1, temperature=0.0))
        request.return_all_logits = True
        self.add_request(request)
        while request.num_computed_tokens < request.num_tokens:
            self.step()
        while self._in_flight is not None:
            self.step()
        self.scheduler.finish(request, "stop")
        self.outputs.drop(request.request_id)
        return torch.cat(self._score_logits.pop(request.request_id)).cpu()

"""The engine: one loop `schedule() -> runner.launch() -> scheduler.on_launched()`, then the previous step is
resolved (`scheduler.on_resolved()`) while the device computes the new one.

`Engine` is what Python users call (`generate`, `chat`, `score`); `AsyncEngine` drives the same `step()`
from a background thread for the HTTP server.
"""

from __future__ import annotations

import logging
import secrets
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from server.config import EngineConfig
from server.engine import device as device_mod
from server.engine.block_allocator import BlockAllocator
from server.engine.decode_graphs import DecodeGraphs, use_flex_at_batch_1
from server.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from server.engine.model_runner import CompiledSteps, KVCache, ModelRunner, SampledToken
from server.engine.request import Request
from server.engine.scheduler import Scheduler, SchedulerConfig
from server.engine.state_cache import StateCache, StateSlots
from server.engine.tokenizer import Tokenizer
from server.engine.types import (
    ChatPrompt,
    ContextLengthExceededError,
    EngineStats,
    InvalidRequestError,
    RequestOutput,
    SamplingParams,
    StreamDelta,
    TokenLogprob,
    TopLogprob,
)
from server.engine.weights import load_model, resolve_model_path
from server.kernels.gated_delta import CHUNK_SIZE

log = logging.getLogger(__name__)


@dataclass
class _OutputState:
    """Per-request text assembly: incremental detokenizing and stop strings with hold-back."""

    detokenizer: IncrementalDetokenizer
    stop: StopStringMatcher
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None


class _NoText:
    """Detokenizer stand-in for engines without a tokenizer (benchmarks): outputs are token ids only."""

    def add(self, token_ids: list[int]) -> str:
        return ""

    def flush(self) -> str:
        return ""


class Engine:
    def __init__(self, model, tokenizer: Tokenizer, config: EngineConfig, device: torch.device, dtype: torch.dtype, max_model_len: int, model_name: str):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.device, self.dtype = device, dtype
        self.max_model_len = max_model_len
        self.model_name = model_name
        self.vocab_size = model.args.vocab_size
        shapes = model.kv_cache_shapes()
        self.state_cache, state_slots = self._state_pool()  # hybrids only; see _num_kv_blocks for its memory
        num_blocks = self._num_kv_blocks(shapes)
        # One more block than the budget's: block 0 is the scratch target of padded decode rows.
        self.kv_cache = KVCache(shapes, num_blocks + 1, config.block_size, dtype, device)
        self.allocator = BlockAllocator(num_blocks + 1, config.block_size, config.enable_prefix_caching, num_reserved=1)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, max_model_len), self.allocator, state_slots
        )
        self.runner = ModelRunner(model, self.kv_cache, device, self.vocab_size, self._decode_graphs(), self.state_cache)
        self.compile_prefill = self._wants_compiled_prefill()
        if self.compile_prefill:
            caches = list(self.kv_cache.layers)
            caches += [t for layer in (self.state_cache.layers if self.state_cache else []) for t in layer]
            self.runner.forward_steps = CompiledSteps(model, caches, size_oblivious=self.state_cache is None)
        self._outputs: dict[str, _OutputState] = {}
        self._score_logits: dict[str, list[torch.Tensor]] = {}  # score(): chunks of all-position logits
        self._num_prompt_tokens = 0
        self._in_flight = None  # the launched step whose sampled ids have not been read yet
        self._num_generated_tokens = 0

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
        return cls(model, tokenizer, config, device, dtype, limit, config.model)

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        if config.model == "demo":
            from server.engine.demo import ensure_demo_model

            model_dir = ensure_demo_model()
        else:
            model_dir = resolve_model_path(config.model, config.revision)
        torch_device, reason = device_mod.select_device(config.device)
        from server.engine.weights import read_config

        hf_config = read_config(model_dir)
        checkpoint_dtype = hf_config.get("torch_dtype") or hf_config.get("dtype")
        dtype = device_mod.select_dtype(config.dtype, torch_device, checkpoint_dtype)
        log.info("loading %s on %s (%s) as %s", config.model, torch_device, reason, dtype)
        model, hf_config = load_model(model_dir, torch_device, dtype, config.quantization)
        tokenizer = Tokenizer.from_pretrained(model_dir)
        limit = int(getattr(model.args, "max_position_embeddings", None) or 4096)  # nested text_config resolved
        max_model_len = min(config.max_model_len or limit, limit)
        return cls(model, tokenizer, config, torch_device, dtype, max_model_len, config.model)

    def _decode_graphs(self) -> DecodeGraphs | None:
        """The compiled decode step: on by default on GPU backends, off on the CPU (tests switch it on)."""
        mode = self.config.compile
        if mode == "off" or (mode == "auto" and self.device.type == "cpu"):
            return None
        flex = use_flex_at_batch_1(self.device, self.dtype, self.config.block_size, self.state_cache is None)
        blocks_per_seq = -(-self.max_model_len // self.config.block_size)
        graphs = self.config.cuda_graphs if self.config.cuda_graphs is not None else True
        return DecodeGraphs(self.model, self.kv_cache.layers, self.device, self.config.max_num_seqs, blocks_per_seq,
                            graphs, state_cache=self.state_cache, flex_at_batch_1=flex)

    def _wants_compiled_prefill(self) -> bool:
        """None: on where it was measured: with the compiled decode step, on CUDA, bf16/fp16 weights (FP8 prefill
        compiled is not measured yet), attention-only models (a hybrid's dynamic-shape prefill graph took 290 s to
        compile cold on the H200; Qwen3.6's prefill was 2x faster once compiled, docs/PERF.md)."""
        if self.config.compile_prefill is not None:
            return self.config.compile_prefill
        measured = self.device.type == "cuda" and self.state_cache is None and self.config.quantization is None
        return self.runner.decode_graphs is not None and measured

    def _num_kv_blocks(self, shapes: list[tuple[int, int]]) -> int:
        config = self.config
        per_block = KVCache.bytes_per_block(shapes, config.block_size, self.dtype)
        budget = config.kv_cache_memory_bytes  # explicit: for the paged KV alone
        if budget is None:  # a share of free memory, which the hybrids' fixed states also draw from
            budget = int(device_mod.free_memory_bytes(self.device) * config.kv_cache_memory_fraction)
            budget -= self._state_bytes
        blocks_per_seq = -(-self.max_model_len // config.block_size)
        num_blocks = min(budget // per_block, config.max_num_seqs * blocks_per_seq)
        if num_blocks < blocks_per_seq and num_blocks < 2:
            raise ValueError(f"the KV memory budget ({budget} bytes) holds no KV block of {per_block} bytes")
        return int(num_blocks)

    def _state_pool(self) -> tuple[StateCache | None, StateSlots | None]:
        """Hybrid models: per-sequence states, one live slot per running sequence plus as many block-boundary
        snapshots (prefix reuse of a conversation's states) when prefix caching is on."""
        self._state_bytes = 0
        if not hasattr(self.model, "state_shapes"):
            return None, None
        specs = self.model.state_shapes()
        num_snapshots = self.config.max_num_seqs if self.config.enable_prefix_caching else 0
        slots = StateSlots(self.config.max_num_seqs, num_snapshots, self.config.block_size)
        self._state_bytes = StateCache.total_bytes(specs, slots.num_slots, self.dtype)
        return StateCache(specs, slots.num_slots, self.dtype, self.device), slots

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights on the device: parameters and persistent buffers (FP8 weights and their
        scales, expert biases), each shared tensor once; not derived tables such as RoPE frequencies."""
        tensors = {id(p): p for p in self.model.parameters()}
        for module in self.model.modules():
            for name, buf in module.named_buffers(recurse=False):
                if buf is not None and name not in module._non_persistent_buffers_set:
                    tensors[id(buf)] = buf
        return sum(t.numel() * t.element_size() for t in tensors.values())

    # ---- requests -----------------------------------------------------------------------------
    def make_request(self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None) -> Request:
        """Tokenize and validate; raises InvalidRequestError / ContextLengthExceededError."""
        params.validate(self.vocab_size)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this engine has no tokenizer; send token ids", param="prompt")
            prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=not isinstance(prompt, ChatPrompt))
        else:
            prompt_ids = [int(t) for t in prompt]
            bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size}).", param="prompt")
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty; send at least one token of text", param="prompt")
        if len(prompt_ids) >= self.max_model_len:
            raise ContextLengthExceededError(len(prompt_ids), self.max_model_len)
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
        )

    def add_request(self, request: Request) -> None:
        self._outputs[request.request_id] = _OutputState(
            IncrementalDetokenizer(self.tokenizer, request.token_ids) if self.tokenizer else _NoText(),
            StopStringMatcher(request.params.stop, request.params.include_stop_str_in_output),
            logprobs=[] if request.params.logprobs is not None else None,
        )
        self.scheduler.add(request)
        self._num_prompt_tokens += request.num_prompt_tokens

    def abort(self, request_id: str) -> StreamDelta | None:
        """Stop a request now and free its KV blocks. Returns its final delta, if it was known."""
        request = self.scheduler.abort(request_id)
        state = self._outputs.pop(request_id, None)
        if request is None or state is None:
            return None
        return self._delta(request, "", [], None)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> list[StreamDelta]:
        """Schedule and launch step N+1, then finish step N (read its ids, detokenize, stop checks) while
        the device computes N+1. On the CPU the launch itself computes, so nothing overlaps there."""
        out = self.scheduler.schedule()
        deltas: list[StreamDelta] = []
        if self._in_flight is not None and self._needs_known_tokens(out):
            deltas += self._complete(self._in_flight)
            self._in_flight = None
            out.chunks = [c for c in out.chunks if not c.request.is_finished]
        launched = None
        if out.chunks:
            launched = self.runner.launch(out, self._in_flight)
            self.scheduler.on_launched(out)
        if self._in_flight is not None:
            deltas += self._complete(self._in_flight)
        self._in_flight = launched
        return deltas

    @staticmethod
    def _needs_known_tokens(out) -> bool:
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
        return [
            self._process_token(request, result.sampled[request.request_id])
            for request, _ in self.scheduler.on_resolved(step.out, sampled)
        ]

    def _process_token(self, request: Request, token: SampledToken) -> StreamDelta:
        state = self._outputs[request.request_id]
        piece = state.detokenizer.add([token.token_id])
        emit, stopped = state.stop.push(piece)
        if stopped:
            self.scheduler.finish(request, "stop")
        elif request.is_finished:
            tail, stopped = state.stop.push(state.detokenizer.flush())
            emit += tail + ("" if stopped else state.stop.flush())
        state.text.append(emit)
        logprob = self._logprob(token) if state.logprobs is not None else None
        if logprob is not None:
            state.logprobs.append(logprob)
        if request.is_finished:
            self._outputs.pop(request.request_id, None)
        return self._delta(request, emit, [token.token_id], [logprob] if logprob else None)

    def _logprob(self, token: SampledToken) -> TokenLogprob:
        text = self.tokenizer.token_text if self.tokenizer else str
        top = [TopLogprob(t, text(t), lp) for t, lp in zip(token.top_ids, token.top_logprobs, strict=True)]
        return TokenLogprob(token.token_id, text(token.token_id), float(token.logprob or 0.0), top)

    def _delta(self, request: Request, text: str, token_ids: list[int], logprobs) -> StreamDelta:
        return StreamDelta(
            request_id=request.request_id,
            text=text,
            token_ids=token_ids,
            finish_reason=request.finish_reason,
            prompt_tokens=request.num_prompt_tokens,
            completion_tokens=request.num_output_tokens,
            cached_tokens=request.num_cached_tokens,
            logprobs=logprobs,
        )

    def stats(self) -> EngineStats:
        return EngineStats(
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            kv_blocks_used=self.allocator.num_used,
            kv_blocks_free=self.allocator.num_free,
            prefix_cache_hit_tokens=self.scheduler.num_prefix_hit_tokens,
            prompt_tokens=self._num_prompt_tokens,
            generation_tokens=self._num_generated_tokens,
        )

    # ---- convenience API ----------------------------------------------------------------------
    def generate(self, prompt, params: SamplingParams | None = None):
        """One prompt (str or token ids) -> RequestOutput; a list of prompts -> a list, run as one batch."""
        single = isinstance(prompt, str) or (len(prompt) > 0 and isinstance(prompt[0], int))
        prompts = [prompt] if single else list(prompt)
        params = params or SamplingParams()
        requests = [self.make_request(p, replace(params)) for p in prompts]
        results = self._run_to_completion(requests)
        return results[0] if single else results

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None, tools=None, **template_kwargs) -> RequestOutput:
        text = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, **template_kwargs)
        return self.generate(ChatPrompt(text), params)

    def warm_up(self) -> float:
        """Compile (and capture) the compiled steps before serving, so that no request waits for them; returns
        the seconds taken. Decode: one run per batch bucket (sdpa/reduce compile batch 1 and then one graph for
        larger batches, whose later buckets only capture CUDA graphs unless a size guard differs, as MoE's
        few-tokens path does; flex beyond batch 1 compiles each bucket), then the CUDA graphs of the longer KV
        buckets (DecodeGraphs.prepare_shapes). With compile_prefill, also the prefill forms (a fresh
        prompt alone, fresh prompts together, continued chunks and mixes), each with few and with many tokens.
        A no-op when nothing is compiled (the CPU default)."""
        graphs = self.runner.decode_graphs
        if graphs is None and not self.compile_prefill:
            return 0.0
        start = time.perf_counter()
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)  # one decode step each
        # 1-token prompts: the whole batch is prefilled in one step (through the decode step), then decodes
        runs = [[[1 + i % (self.vocab_size - 1)] for i in range(n)] for n in (graphs.batch_sizes if graphs is not None else [1, 2])]
        if self.compile_prefill:  # each attention form with few and with many tokens (MoE paths differ)
            budget = self.config.max_num_batched_tokens
            shapes = [(1, 3), (1, budget + 2), (2, 2), (2, budget // 2), (2, budget + 3)]  # (prompts, prompt length)
            if self.state_cache is not None:  # the chunked GDN specializes on one chunk or more and on padding,
                # and each decoder layer compiles apart (a graph break around the GDN chunk loop): a long tail too
                shapes += [(n, length) for n in (1, 2) for length in (CHUNK_SIZE, CHUNK_SIZE + 6)]
                shapes.append((1, budget + CHUNK_SIZE + 6))
            for run, (num_prompts, prompt_len) in enumerate(shapes):  # distinct prompts: no prefix-cache hits
                prompt_len = max(1, min(prompt_len, self.max_model_len - params.max_tokens))
                runs.append([[1 + (7 * run + 3 * i + j) % (self.vocab_size - 1) for j in range(prompt_len)]
                             for i in range(num_prompts)])
        for prompts in runs:
            self._run_to_completion([self.make_request(p, replace(params)) for p in prompts])
        # Every decode bucket whose KV gather (batch x blocks, one layer at a time) is no larger than the cache's
        # usable blocks: a bounded share of memory, where capturing every bucket up to 128k context would not be.
        num_shapes = graphs.prepare_shapes(self.allocator.num_usable) if graphs is not None else 0
        seconds = time.perf_counter() - start
        log.info("compiled steps warmed up (%d runs, %d more decode shapes) in %.1f s", len(runs), num_shapes, seconds)
        return seconds

    def _run_to_completion(self, requests: list[Request]) -> list[RequestOutput]:
        if self.has_unfinished:
            raise RuntimeError("generate() cannot run while the engine serves other requests; use AsyncEngine")
        states = {}
        for request in requests:
            self.add_request(request)
            states[request.request_id] = self._outputs[request.request_id]
        while self.has_unfinished:
            self.step()
        return [self._final_output(r, states[r.request_id]) for r in requests]

    def _final_output(self, request: Request, state: _OutputState) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            text="".join(state.text),
            token_ids=request.output_token_ids,
            finish_reason=request.finish_reason or "abort",
            prompt_tokens=request.num_prompt_tokens,
            completion_tokens=request.num_output_tokens,
            cached_tokens=request.num_cached_tokens,
            logprobs=state.logprobs,
        )

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
        self._outputs.pop(request.request_id, None)
        return torch.cat(self._score_logits.pop(request.request_id)).cpu()

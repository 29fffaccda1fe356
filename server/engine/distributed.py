"""One model over several processes: the process groups, and rank 0's lead.

torchrun (or any launcher that sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT) starts one
process per rank. Rank 0 runs the command (HTTP server, generate, bench) and its scheduler decides every
step; the other ranks follow (`follow`). Rank 0 broadcasts each engine it builds (`BuildSpec`: every rank
builds its own part of the model) and, before each step, the step's plan (`StepPlan`: sequences, positions,
KV blocks, state slots, and in tensor parallel the token ids); every rank runs the same forward. Only rank 0
computes logits and samples; in tensor parallel it broadcasts the sampled ids, which the next step's
embedding reads on every rank.

Two process groups. The default group (Gloo, on the host) carries builds and plans and waits as long as a
server may stay idle. Each engine's forward group (NCCL on CUDA, Gloo elsewhere) carries the activations and
times out after `EngineConfig.parallel.distributed_timeout_s`. A rank whose process ends closes its connections, so
the others fail their next collective at once; a hung rank is caught by the timeout. Either way a rank that
loses another prints why and exits: the model is incomplete without it.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from server.config import EngineConfig
from server.engine.build import build_parts, load_pretrained
from server.engine.device import select_device
from server.engine.model_runner import InFlightStep, ModelRunner, QueuedForward
from server.engine.request import Request
from server.engine.scheduler import ScheduledChunk, SchedulerOutput
from server.engine.types import EngineError, SamplingParams
from server.kernels.paged_attention import prefill_sdpa_backends
from server.models.parallel import PIPELINE, TENSOR, Layout, broadcast

log = logging.getLogger(__name__)

IDLE_TIMEOUT = timedelta(days=30)  # followers wait this long for rank 0's next message (an idle server)


@dataclass(frozen=True)
class ProcessInfo:
    """What the launcher told this process (torchrun's RANK, WORLD_SIZE, LOCAL_RANK)."""

    rank: int
    world_size: int
    local_rank: int


def parallel_kind(config: EngineConfig) -> tuple[str, int] | None:
    """(TENSOR or PIPELINE, number of ranks) of the config; None for one process."""
    if config.parallel.tensor_parallel > 1:
        return TENSOR, config.parallel.tensor_parallel
    if config.parallel.pipeline_parallel > 1:
        return PIPELINE, config.parallel.pipeline_parallel
    return None


def init(info: ProcessInfo, num_ranks: int, device_name: str) -> None:
    """Join the default group; on CUDA, this process's GPU is its LOCAL_RANK."""
    if info.world_size != num_ranks:
        raise ValueError(f"the parallel size is {num_ranks} but the launcher started {info.world_size} processes; "
                         f"use torchrun --nproc-per-node {num_ranks} (or --nnodes x --nproc-per-node = {num_ranks})")
    device, _ = select_device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(info.local_rank)
    dist.init_process_group("gloo", rank=info.rank, world_size=info.world_size, timeout=IDLE_TIMEOUT)
    log.info("rank %d of %d joined (local rank %d, %s)", info.rank, info.world_size, info.local_rank, device.type)


def finish() -> None:
    """Rank 0: release the followers (they return from `follow`). Every rank then leaves the group."""
    if dist.get_rank() == 0:
        _exchange(None)
    dist.destroy_process_group()


def lost_contact(exc: BaseException) -> None:
    """A collective failed: another rank died or hung. Say so and end this process."""
    rank = dist.get_rank() if dist.is_initialized() else "?"
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    _exit(f"rank {rank} lost contact with the other ranks (one died, or hung past the timeout), so the model is "
          f"incomplete; exiting. {type(exc).__name__}: {first_line}")


def abandon(exc: BaseException) -> None:
    """The command failed on this rank: say why and end the process, which closes its connections, so the other
    ranks stop too (an orderly exit would wait for them in a collective they never reach)."""
    if isinstance(exc, ValueError | EngineError):  # configuration and request errors: the message says what to fix
        _exit(str(exc), 2)
    if isinstance(exc, KeyboardInterrupt):
        _exit("interrupted", 130)
    traceback.print_exception(exc)
    _exit(f"rank {dist.get_rank()} failed: {type(exc).__name__}: {exc}")


def _exit(message: str, code: int = 1) -> None:
    log.critical(message)
    print(f"mps-serve: error: {message}", file=sys.stderr, flush=True)
    os._exit(code)  # a normal exit would wait on the broken group


def _exchange(message=None):
    """Rank 0 sends `message` to every rank on the default group; the others receive and return it."""
    box = [message]
    try:
        dist.broadcast_object_list(box, src=0)
    except RuntimeError as exc:  # a closed connection or a timeout: gloo raises RuntimeError
        lost_contact(exc)
    return box[0]


# ---- engines -------------------------------------------------------------------------------------------------
Loader = Callable[[EngineConfig, Layout], tuple]  # -> (model, tokenizer, device, dtype, max_model_len)


@dataclass(frozen=True)
class BuildSpec:
    """How every rank builds its part of one engine: `load(config, layout)` (picklable: a module-level function
    or a functools.partial of one)."""

    config: EngineConfig
    load: Loader = load_pretrained


RankEngine = tuple  # Engine's arguments: (model, tokenizer, config, device, dtype, max_model_len, name, parts)


def start_engine(config: EngineConfig, load: Loader = load_pretrained) -> RankEngine:
    """Rank 0: have every rank build its part of the engine, and build rank 0's; -> the Engine's arguments."""
    spec = BuildSpec(config, load)
    if not dist.is_initialized():
        kind, size = parallel_kind(spec.config)
        raise ValueError(f"{kind} parallel {size} runs one process per rank: start it with "
                         f"torchrun --nproc-per-node {size} -m server ...")
    _exchange(spec)
    return build_engine(spec)


def build_engine(spec: BuildSpec) -> RankEngine:
    """This rank's engine's arguments: its part of the model and its KV cache (as many blocks as every rank
    holds), run eagerly (the compiled decode step is one process's), led by rank 0 or following it."""
    config = spec.config.replace_flat(compile="off", compile_prefill=False)
    kind, size = parallel_kind(config)
    device, _ = select_device(config.load.device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    group = dist.new_group(backend=backend, timeout=timedelta(seconds=config.parallel.distributed_timeout_s))
    layout = Layout(kind, dist.get_rank(), size, group)
    model, tokenizer, device, dtype, max_model_len = spec.load(config, layout)
    parts = build_parts(model, config, device, dtype, max_model_len, agree_num_blocks=_fewest_over_ranks)
    runner_cls = LeaderRunner if layout.rank == 0 else FollowerRunner
    parts.runner = runner_cls(layout, model, parts.kv_cache, device, model.args.vocab_size, parts.state_cache,
                              parts.plans)
    return model, tokenizer, config, device, dtype, max_model_len, config.load.model, parts


def _fewest_over_ranks(num_blocks: int) -> int:
    value = torch.tensor([num_blocks])
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return int(value)


def follow() -> int:
    """A follower's life: build each engine rank 0 builds, run each step it plans; 0 once rank 0 finishes.
    Ctrl-C is rank 0's to act on (torchrun sends it to every rank): rank 0 drains its requests, then releases
    the followers."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    runner, prev = None, None
    while (message := _exchange()) is not None:
        if isinstance(message, BuildSpec):
            runner = prev = None
            _release()
            runner = build_engine(message)[-1].runner
        else:
            prev = runner.follow(message, prev)
    return 0


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- steps ---------------------------------------------------------------------------------------------------
class _TokenWindow:
    """A follower's view of a request's token ids: only the positions of this step (0 where not sent)."""

    def __init__(self, start: int, token_ids: list[int] | None):
        self.start, self.token_ids = start, token_ids

    def __getitem__(self, pos: int) -> int:
        return self.token_ids[pos - self.start] if self.token_ids is not None else 0


@dataclass(frozen=True)
class ChunkPlan:
    request_id: str
    start: int
    num_tokens: int
    sample: bool
    return_all_logits: bool
    block_ids: list[int]  # the blocks up to this chunk's last token
    token_ids: list[int] | None  # positions [start, start + num_tokens); tensor parallel only
    state_slot: int | None
    state_restore: int | None
    state_save: int | None

    def scheduled(self) -> ScheduledChunk:
        request = Request(self.request_id, _TokenWindow(self.start, self.token_ids), 0, SamplingParams(), 0,
                          block_ids=self.block_ids, return_all_logits=self.return_all_logits,
                          state_slot=self.state_slot)
        return ScheduledChunk(request, self.start, self.num_tokens, self.sample, self.state_restore, self.state_save)


@dataclass(frozen=True)
class StepPlan:
    """What a follower needs to run rank 0's step: the chunks in row order."""

    chunks: list[ChunkPlan]

    @classmethod
    def of(cls, out: SchedulerOutput, block_size: int, with_token_ids: bool) -> StepPlan:
        plans = []
        for chunk in out.chunks:
            request, end = chunk.request, chunk.start + chunk.num_tokens
            ids = request.token_ids[chunk.start : end] if with_token_ids else None
            plans.append(ChunkPlan(request.request_id, chunk.start, chunk.num_tokens, chunk.sample,
                                   request.return_all_logits, request.block_ids[: -(-end // block_size)], ids,
                                   request.state_slot, chunk.state_restore, chunk.state_save))
        return cls(plans)


class _RankRunner(ModelRunner):
    def __init__(self, layout: Layout, *args):
        super().__init__(*args)
        self.layout = layout


class LeaderRunner(_RankRunner):
    """Rank 0's runner: each step's plan goes to the followers first; in tensor parallel the sampled ids after."""

    def forward(self, out: SchedulerOutput, prev: InFlightStep | None = None) -> QueuedForward:
        _exchange(StepPlan.of(out, self.kv_cache.block_size, with_token_ids=self.layout.kind == TENSOR))
        try:
            return super().forward(out, prev)
        except RuntimeError as exc:  # a collective of the forward; every rank is now out of step
            lost_contact(exc)

    def sample(self, queued: QueuedForward, token_bitmask=None) -> InFlightStep:
        step = super().sample(queued, token_bitmask)
        if self.layout.kind == TENSOR and step.token_ids is not None:
            try:
                broadcast(step.token_ids, 0, self.layout.group)
            except RuntimeError as exc:
                lost_contact(exc)
        return step


class FollowerRunner(_RankRunner):
    """A follower's runner: rank 0's plan -> the same inputs -> this rank's part of the forward."""

    @torch.inference_mode()
    def follow(self, plan: StepPlan, prev: InFlightStep | None) -> InFlightStep | None:
        """Run one step; in tensor parallel returns its sampled ids (rank 0's), which the next step may read."""
        chunks = [c.scheduled() for c in plan.chunks]
        try:
            input_ids, positions, meta, _, _, pending = self._prepare(chunks)
            if self.layout.kind == TENSOR:
                self._feed_pending(input_ids, pending, prev)
            with prefill_sdpa_backends(self.device):
                self.forward_steps(input_ids, positions, meta, self.kv_cache.layers)
            sample_chunks = [c for c in chunks if c.sample and not c.request.return_all_logits]
            if self.layout.kind != TENSOR or not sample_chunks:
                return None
            token_ids = torch.empty(len(sample_chunks), dtype=torch.int64, device=self.device)
            broadcast(token_ids, 0, self.layout.group)
        except RuntimeError as exc:
            lost_contact(exc)
        rows = {c.request.request_id: i for i, c in enumerate(sample_chunks)}
        return InFlightStep(None, sample_chunks, rows, token_ids, {}, {})

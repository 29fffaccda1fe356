"""The decode step as one compiled graph: `torch.compile(fullgraph=True)` of embedding → layers → LM head
for one token per sequence, with batch size and KV length bucketed so recompiles and graph captures stay
bounded; replayed as a CUDA graph where the device has them (MPS has none: there the compiled step runs
as is, which `graphs=False` reproduces on CUDA for measurement).

Padded rows read and write block 0, which the block allocator never hands out.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from server.compile.launch_wrapper import LaunchCompiled
from server.engine.device import serialized_device_work
from server.engine.kv_manager import NULL_BLOCK
from server.kernels import flex_probe, sampling
from server.kernels.plan import StepPlan, StepPlans
from server.models.base import AttentionMetadata

log = logging.getLogger(__name__)


def use_flex_at_batch_1(device: torch.device, dtype: torch.dtype, block_size: int, attention_only: bool) -> bool:
    """Whether the batch-1 decode step runs its attention as one FlexAttention kernel over the paged cache
    (faster than gather + SDPA on CUDA). Only on CUDA for attention-only models, and only where its compiled
    probe is right on this device; larger batches keep SDPA, whose one symbolic-batch graph serves
    every bucket, where flex needs a static batch and so one compile per bucket."""
    if device.type != "cuda" or not attention_only:
        return False
    ok, reason = flex_probe.probe_compiled(str(device), dtype, block_size)
    log.info("decode attention at batch 1: %s (flex probe: %s); sdpa beyond", "flex" if ok else "sdpa", reason)
    return ok


def batch_buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8]
    while sizes[-1] < max_num_seqs:
        sizes.append(sizes[-1] + (8 if sizes[-1] < 32 else 32))
    return [s for s in sizes if s < max_num_seqs] + [max_num_seqs]


def bucket(value: int, sizes: list[int]) -> int:
    for size in sizes:
        if value <= size:
            return size
    raise ValueError(f"{value} exceeds the largest bucket {sizes[-1]}")


class DecodeFields(NamedTuple):
    """The columns of packed decode rows `[B_pad, num_fixed + blocks_pad]`, each `[B_pad]` but the last."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor  # KV slot the row's token is written to
    feed_rows: torch.Tensor  # >= 0: take the input id from last_token_ids[feed_row] instead
    state_slots: torch.Tensor | None  # hybrids: the row's live state slot
    block_tables: torch.Tensor  # [B_pad, blocks_pad]


@dataclass(frozen=True)
class DecodeRows:
    """The layout of one packed int64 decode row: input id, position, KV slot, feed row, (hybrids: state slot,)
    then the block table, padded with the null block to the bucket's width. The only place that knows it."""

    scratch_state_slot: int | None = None  # hybrids: the state slot padded rows read and write

    STATE_SLOT = 4  # the column of a hybrid's state slot

    @property
    def num_fixed(self) -> int:
        return self.STATE_SLOT + (self.scratch_state_slot is not None)

    def pack_row(self, token_id: int, position: int, kv_slot: int, feed_row: int, state_slot: int | None,
                 block_table: list[int], num_blocks: int) -> list[int]:
        state = [state_slot] if self.scratch_state_slot is not None else []
        table = block_table + [NULL_BLOCK] * (num_blocks - len(block_table))
        return [token_id, position, kv_slot, feed_row] + state + table

    def padding_row(self, num_blocks: int) -> list[int]:
        """A row that fills a bucket: it reads and writes the null block (and, in hybrids, the scratch state)."""
        return self.pack_row(0, 0, 0, -1, self.scratch_state_slot, [], num_blocks)  # slot 0: the null block's

    def num_blocks(self, packed: torch.Tensor) -> int:
        return packed.shape[1] - self.num_fixed

    def unpack(self, packed: torch.Tensor) -> DecodeFields:
        """Copies, not views: the compiled decoder layer region refuses inputs that alias one another."""
        state_slots = packed[:, self.STATE_SLOT].clone() if self.scratch_state_slot is not None else None
        columns = (packed[:, i].clone() for i in range(self.STATE_SLOT))
        return DecodeFields(*columns, state_slots, packed[:, self.num_fixed:].clone())


# Compile for every block-table width at once, and every batch size past 1 at once (torch specializes size 1
# anyway): two compiles in all instead of one per changed dimension.
DYNAMIC_DIMS = {0: (0, 1)}  # the packed rows [B_pad, num_fixed + blocks_pad]


@dataclass(eq=False)
class DecodeStep:
    """The decode step's code and what it reads besides its inputs: plain data, which a saved compile of the step
    names in its guards (compile.saved)."""

    model: torch.nn.Module
    kv_layers: list[torch.Tensor]
    state_layers: list | None  # hybrids: StateCache.layers
    rows: DecodeRows
    flex_at_batch_1: bool
    plans: StepPlans

    def forward(self, packed: torch.Tensor, last_token_ids: torch.Tensor) -> torch.Tensor:
        return self._step(packed, last_token_ids, self.plans.compiled)

    def forward_layers_inline(self, packed: torch.Tensor, last_token_ids: torch.Tensor) -> torch.Tensor:
        """The step as inductor's C++ wrapper builds it: every decoder layer inlined (it cannot call a compiled
        region). A function of its own, so that its compiled code and guards are apart from `forward`'s."""
        return self._step(packed, last_token_ids, self.plans.compiled_layers_inline)

    def _step(self, packed: torch.Tensor, last_token_ids: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        rows = self.rows.unpack(packed)
        fed_ids = last_token_ids[rows.feed_rows.clamp(min=0)]
        input_ids, positions = torch.where(rows.feed_rows >= 0, fed_ids, rows.input_ids), rows.positions
        state = {}
        if rows.state_slots is not None:
            state = dict(query_lens=torch.ones_like(positions), state_slots=rows.state_slots,
                         state_caches=self.state_layers)
        # Batch 1 is its own graph (static size 1); larger batches share one symbolic batch size, assumed >= 2 by
        # dynamo, so this test adds no guard.
        flex = self.flex_at_batch_1 and packed.shape[0] == 1
        meta = AttentionMetadata.for_decode(rows.slot_mapping, rows.block_tables, positions, flex, self.kv_layers[0],
                                            plan, **state)
        hidden = self.model(input_ids, positions, meta, self.kv_layers, plan)
        logits = self.model.compute_logits(hidden, plan)  # [num_seqs, vocab] float32
        last_token_ids[: logits.shape[0]].copy_(sampling.greedy_ids(logits, plan.two_stage_argmax))
        return logits


class DecodeGraphs:
    """The step takes ONE packed int64 input `[B_pad, num_fixed + blocks_pad]`, a row per sequence (DecodeRows),
    so a step is one host-to-device copy plus the replay. A feed row >= 0 takes the input id from
    `last_token_ids[feed_row]`: the id the previous step sampled, still on the device. The step's own greedy
    argmax is written back to `last_token_ids` inside the graph, so a plain greedy step needs no kernel outside
    it."""

    def __init__(self, model, kv_layers, device: torch.device, max_num_seqs: int, max_blocks_per_seq: int, graphs: bool,
                 plans: StepPlans, state_cache=None, flex_at_batch_1: bool = False):
        # hybrids (state_cache: StateCache): each row carries its state slot too
        self.rows = DecodeRows(state_cache.scratch_slot if state_cache is not None else None)
        self.step = DecodeStep(model, kv_layers, state_cache.layers if state_cache is not None else None, self.rows,
                               flex_at_batch_1, plans)
        self.device = device
        self.batch_sizes = batch_buckets(max_num_seqs)
        self.block_counts = [4]
        while self.block_counts[-1] < max_blocks_per_seq:
            self.block_counts.append(self.block_counts[-1] * 2)
        # The ids sampled by the last step, row = its sample row; any sampled step writes them here.
        self.last_token_ids = torch.zeros(self.batch_sizes[-1], dtype=torch.int64, device=device)  # [max_num_seqs]
        # What warm-up runs write instead; made here, outside inference mode, so that its guards match the above.
        self._scratch_ids = torch.zeros_like(self.last_token_ids)
        self.use_graphs = graphs and device.type == "cuda"
        self.pin_inputs = device.type == "cuda"  # the packed rows' host copy, pinned: an asynchronous upload
        # Launched kernel by kernel, the C++ wrapper saves host time per kernel; its step inlines the layers.
        self.compiled = LaunchCompiled(self.step.forward, "the decode step",
                                       None if self.use_graphs else self.step.forward_layers_inline,
                                       dynamic_dims=DYNAMIC_DIMS, fullgraph=True, dynamic=None)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.graph_pool = None
        self.shapes_run: set[tuple[int, int]] = set()  # every padded (batch, blocks) shape the step has run at
        # Steps of more sequences take the runner's other path: a background compile raises it as it goes.
        self.ready_num_seqs = self.batch_sizes[-1]
        self._capture_lock = threading.Lock()  # one capture into the shared graph pool at a time

    @property
    def kernel_launch(self) -> str:
        """Who launches the step's kernels: a CUDA graph replay, or inductor's C++ or Python wrapper code."""
        if self.use_graphs:
            return "cuda graph"
        return "c++ wrapper" if self.compiled.cpp_wrapper else "python wrapper"

    def padded_shape(self, num_seqs: int, num_blocks: int) -> tuple[int, int]:
        return bucket(num_seqs, self.batch_sizes), bucket(num_blocks, self.block_counts)

    @torch.inference_mode()  # as the steps' own inputs: else the CPU graphs differ in dispatch keys and recompile
    def warm(self, batch_sizes: list[int], max_gather_blocks: int) -> int:
        """Compile the step for these batch buckets and, with graphs, capture every (batch, blocks) bucket whose
        KV gather, batch x blocks, stays within `max_gather_blocks` (a capture when a stream first reaches it
        would stall every stream of its batch). Runs on padding rows and scratch ids only, so a serving thread
        may replay the buckets already warm meanwhile. Without graphs, one run per batch bucket covers every
        block count (symbolic) and finds any size guard that splits the batches (MoE's few-tokens path).
        -> the number of shapes newly prepared."""
        count, within = 0, self.buckets_within(max_gather_blocks)
        for num_seqs in batch_sizes:
            keys = [key for key in within if key[0] == num_seqs] or [(num_seqs, self.block_counts[0])]
            for key in keys if self.use_graphs else keys[:1]:
                if key in self.graphs or (not self.use_graphs and key in self.shapes_run):
                    continue
                with serialized_device_work(self.device):
                    if self.use_graphs:
                        self._capture(key)
                    else:
                        self.compiled(self._padding(key), self._scratch_ids, warm_up=True)
                self.shapes_run.add(key)
                count += 1
        return count

    def buckets_within(self, max_gather_blocks: int) -> list[tuple[int, int]]:
        """Every (batch, blocks) bucket whose KV gather, batch x blocks, is at most `max_gather_blocks`."""
        return [(b, n) for b in self.batch_sizes for n in self.block_counts if b * n <= max_gather_blocks]

    @torch.inference_mode()  # as the steps' own inputs: else its guards would fail at the first served step
    def build_cpp_form(self) -> None:
        """Build the step's C++-wrapper form for every batch bucket the step has run at (in warm-up runs) and launch
        from it from then on (LaunchCompiled.build_cpp_form)."""
        batch_sizes = sorted({num_seqs for num_seqs, _ in self.shapes_run}) or self.batch_sizes[:1]

        def run_warm_up(step) -> None:
            for num_seqs in batch_sizes:
                with serialized_device_work(self.device):
                    step(self._padding((num_seqs, self.block_counts[0])), self._scratch_ids)

        self.compiled.build_cpp_form(run_warm_up)

    @torch.inference_mode()
    def run(self, packed_host: torch.Tensor, before_write=None) -> torch.Tensor:
        """packed_host: the step's packed rows on the host (pinned on CUDA). `before_write()` is called once the
        input copy is queued and before the step is: it must order the step after any reader of
        `last_token_ids`, which the step overwrites. Returns the logits [B_pad, vocab] (a static buffer)."""
        key = (packed_host.shape[0], self.rows.num_blocks(packed_host))
        if not self.use_graphs:
            packed = packed_host.to(self.device, non_blocking=True)
            if before_write is not None:
                before_write()
            out = self.compiled(packed, self.last_token_ids)  # the first call of a shape may compile
            self.shapes_run.add(key)
            return out
        self.shapes_run.add(key)
        if key not in self.graphs:
            self._capture(key)
        graph, static_packed, static_out = self.graphs[key]
        static_packed.copy_(packed_host, non_blocking=True)
        if before_write is not None:
            before_write()
        graph.replay()
        return static_out

    def _padding(self, key: tuple[int, int]) -> torch.Tensor:
        """A step of padding rows on the device (the null block, the scratch state)."""
        num_seqs, num_blocks = key
        return torch.tensor([self.rows.padding_row(num_blocks)] * num_seqs, dtype=torch.int64, device=self.device)

    def _capture(self, key: tuple[int, int]) -> None:
        start = time.perf_counter()
        static_packed = self._padding(key)  # a replay copies its step's rows in first
        # Compile and warm up outside the capture, on scratch ids: a serving thread may be reading the real ones.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.compiled(static_packed, self._scratch_ids)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with self._capture_lock:
            if key in self.graphs:  # the other thread captured it meanwhile
                return
            # thread_local: the engine thread may serve steps while a background compile captures
            with torch.cuda.graph(graph, pool=self.graph_pool, capture_error_mode="thread_local"):
                static_out = self.compiled(static_packed, self.last_token_ids)
            self.graph_pool = graph.pool()
            self.graphs[key] = (graph, static_packed, static_out)
        log.info("captured decode graph for batch %d x %d blocks in %.1f s", key[0], key[1], time.perf_counter() - start)

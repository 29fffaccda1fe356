"""The decode step as one compiled graph: `torch.compile(fullgraph=True)` of embedding → layers → LM head
for one token per sequence, with batch size and KV length bucketed so recompiles and graph captures stay
bounded; replayed as a CUDA graph where the device has them (MPS has none: there the compiled step runs
as is, which `graphs=False` reproduces on CUDA for measurement).

Padded rows read and write block 0, which the block allocator never hands out.
"""

from __future__ import annotations

import logging
import time

import torch

from server.kernels import flex_decode, sampling
from server.models.base import AttentionMetadata

log = logging.getLogger(__name__)
NULL_BLOCK = 0


def resolve_decode_attention(kind: str, device: torch.device, dtype: torch.dtype, block_size: int,
                             attention_only: bool) -> tuple[str, str]:
    """-> (the batch-1 step's decode attention, larger batches'). "auto": flex for batch 1 where it was measured
    faster (CUDA, attention-only models: 75.9% of roofline vs ~71% with sdpa on the H200, docs/PERF.md) and its
    compiled probe passes here, sdpa otherwise. Batch 1 compiles apart anyway (size-1 specialization), so this costs
    no extra compile, whereas flex for every batch compiles once per batch bucket. A clear error for "flex" where
    the probe fails (EngineConfig checks the name)."""
    if kind in ("sdpa", "reduce"):
        return kind, kind
    if kind == "auto" and (device.type != "cuda" or not attention_only):
        return "sdpa", "sdpa"
    ok, reason = flex_decode.probe_compiled(str(device), dtype, block_size)
    if kind == "auto":
        log.info("decode attention auto: %s at batch 1 (flex probe: %s), sdpa beyond", "flex" if ok else "sdpa", reason)
        return ("flex" if ok else "sdpa"), "sdpa"
    if not ok:
        raise ValueError(f"decode_attention='flex' cannot run on {device.type} with torch {torch.__version__}: "
                         f"{reason}; use 'sdpa'")
    log.info("flex decode attention on %s: %s", device, reason)
    return "flex", "flex"


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


class DecodeGraphs:
    """The step takes ONE packed int64 input `[B_pad, NUM_FIXED (+1) + blocks_pad]`, a row per sequence:
    input id, position, KV slot, feed row, (hybrids: state slot,) then the block table. So a step is one
    host-to-device copy plus the replay. A feed row >= 0 takes the input id from `last_token_ids[feed_row]`:
    the id the previous step sampled, still on the device. The step's own greedy argmax is written back to
    `last_token_ids` inside the graph, so a plain greedy step needs no kernel outside it."""

    NUM_FIXED = 4  # input id, position, slot, feed row

    def __init__(self, model, kv_layers, device: torch.device, max_num_seqs: int, max_blocks_per_seq: int, graphs: bool, decode_kernel: str = "sdpa", state_cache=None, static_shapes: bool = False, autotune_batch1: bool = False, batch1_kernel: str | None = None):
        self.decode_kernel = decode_kernel  # the decode attention of batches >= 2
        self.batch1_kernel = batch1_kernel or decode_kernel
        self.static_shapes = static_shapes
        self.state_cache = state_cache  # hybrids: StateCache; each row then carries its state slot too
        self.num_fixed = self.NUM_FIXED + (state_cache is not None)
        self.model, self.kv_layers, self.device = model, kv_layers, device
        self.batch_sizes = batch_buckets(max_num_seqs)
        self.block_counts = [4]
        while self.block_counts[-1] < max_blocks_per_seq:
            self.block_counts.append(self.block_counts[-1] * 2)
        # The ids sampled by the last step, row = its sample row; any sampled step writes them here.
        self.last_token_ids = torch.zeros(self.batch_sizes[-1], dtype=torch.int64, device=device)  # [max_num_seqs]
        self.use_graphs = graphs and device.type == "cuda"
        self.compiled = torch.compile(self._forward, fullgraph=True, dynamic=None)
        # Batch 1 alone through inductor's GEMM autotuning (an A/B knob): alone, its Triton kernels beat cuBLAS for
        # the one-token qkv and o_proj on the H200 (13.7 vs 15.4 us, 10.0 vs 12.5), yet the whole step got slower
        # (5.35 vs 4.66 ms, docs/PERF.md session 9). A second compiled callable: dynamo keeps graphs apart by backend.
        self.compiled_one = self.compiled
        if autotune_batch1:
            self.compiled_one = torch.compile(self._forward, fullgraph=True, dynamic=None,
                                              options={"max_autotune_gemm": True})
        if decode_kernel == "flex" or static_shapes:  # one graph per bucket (see _mark_shapes), within dynamo's limit
            num_graphs = len(self.batch_sizes) * (len(self.block_counts) if static_shapes else 1)
            limit = torch._dynamo.config.recompile_limit
            torch._dynamo.config.recompile_limit = max(limit, num_graphs + 4)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.graph_pool = None
        self.compile_seconds = 0.0  # first-call compile and capture time, reported by the benchmark
        self._seen: set[tuple[int, int]] = set()

    def padded_shape(self, num_seqs: int, num_blocks: int) -> tuple[int, int]:
        return bucket(num_seqs, self.batch_sizes), bucket(num_blocks, self.block_counts)

    def padding_row(self, num_blocks: int) -> list[int]:
        """A row that fills a bucket: it reads and writes the null block (and, in hybrids, the scratch state)."""
        state = [self.state_cache.scratch_slot] if self.state_cache is not None else []
        return [0, 0, 0, -1] + state + [NULL_BLOCK] * num_blocks  # id 0, position 0, slot 0 (the null block's), no feed

    @torch.inference_mode()  # as the steps' own inputs: else the CPU graphs differ in dispatch keys and recompile
    def prepare_shapes(self, max_gather_blocks: int) -> int:
        """Capture (CUDA graphs) or compile (static shapes) now every (batch, blocks) bucket whose KV gather, batch
        x blocks, stays within `max_gather_blocks`, instead of when a stream first reaches it: on the H200 such a
        capture stalled every stream of a batch for ~88 ms (docs/PERF.md session 9). Steps of padding rows only.
        Symbolic shapes without graphs (MPS) need none of it. -> the number of new shapes."""
        if not (self.use_graphs or self.static_shapes):
            return 0
        keys = [(b, n) for b in self.batch_sizes for n in self.block_counts
                if b * n <= max_gather_blocks and (b, n) not in self.graphs and (b, n) not in self._seen]
        for num_seqs, num_blocks in keys:
            packed_host = torch.tensor([self.padding_row(num_blocks)] * num_seqs, dtype=torch.int64)
            self.run(packed_host.pin_memory() if self.use_graphs else packed_host)
        return len(keys)

    def _forward(self, packed: torch.Tensor, last_token_ids: torch.Tensor) -> torch.Tensor:
        input_ids, positions, slot_mapping, feed_rows = packed[:, 0], packed[:, 1], packed[:, 2], packed[:, 3]
        fed_ids = last_token_ids[feed_rows.clamp(min=0)]
        input_ids = torch.where(feed_rows >= 0, fed_ids, input_ids)
        block_tables = packed[:, self.num_fixed:]
        state = {}
        if self.state_cache is not None:
            state = dict(query_lens=torch.ones_like(positions), state_slots=packed[:, self.NUM_FIXED],
                         state_caches=self.state_cache.layers)
        # Batch 1 is its own graph (static size 1); larger batches share one symbolic batch size, assumed >= 2 by
        # dynamo, so this test adds no guard.
        kernel = self.batch1_kernel if packed.shape[0] == 1 else self.decode_kernel
        meta = AttentionMetadata.for_decode(slot_mapping, block_tables, positions, kernel,
                                            self.kv_layers[0], **state)
        hidden = self.model(input_ids, positions, meta, self.kv_layers)
        logits = self.model.compute_logits(hidden)  # [num_seqs, vocab] float32
        last_token_ids[: logits.shape[0]].copy_(sampling.chunked_argmax(logits))
        return logits

    @torch.inference_mode()
    def run(self, packed_host: torch.Tensor, before_write=None) -> torch.Tensor:
        """packed_host: the step's packed rows on the host (pinned on CUDA). `before_write()` is called once the
        input copy is queued and before the step is: it must order the step after any reader of
        `last_token_ids`, which the step overwrites. Returns the logits [B_pad, vocab] (a static buffer)."""
        key = (packed_host.shape[0], packed_host.shape[1] - self.num_fixed)
        if not self.use_graphs:
            packed = packed_host.to(self.device, non_blocking=True)
            self._mark_shapes(packed)
            if before_write is not None:
                before_write()
            compiled = self._compiled_for(key)
            if key in self._seen:
                return compiled(packed, self.last_token_ids)
            start = time.perf_counter()
            out = compiled(packed, self.last_token_ids)  # first call of this shape: compiles
            self._seen.add(key)
            self.compile_seconds += time.perf_counter() - start
            return out
        if key not in self.graphs:
            if before_write is not None:  # the warm-up runs of the capture write last_token_ids too
                before_write()
            self._capture(key, packed_host)
        graph, static_packed, static_out = self.graphs[key]
        static_packed.copy_(packed_host, non_blocking=True)
        if before_write is not None:
            before_write()
        graph.replay()
        return static_out

    def _compiled_for(self, key: tuple[int, int]):
        return self.compiled_one if key[0] == 1 else self.compiled

    def _mark_shapes(self, packed: torch.Tensor) -> None:
        """Compile for every block-table width at once, and every batch size past 1 at once (torch specializes
        size 1 anyway): two compiles in all instead of one per changed dimension. Except FlexAttention's decoding
        kernel, which needs a static batch size (else torch falls back to its general kernel): with flex each
        batch bucket compiles once, whatever the context length. `static_shapes`: every bucket compiles once."""
        static_batch = self.static_shapes or self.decode_kernel == "flex"
        (torch._dynamo.mark_static if static_batch else torch._dynamo.maybe_mark_dynamic)(packed, 0)
        (torch._dynamo.mark_static if self.static_shapes else torch._dynamo.maybe_mark_dynamic)(packed, 1)

    def _capture(self, key, packed_host: torch.Tensor) -> None:
        start = time.perf_counter()
        static_packed = packed_host.to(self.device)
        if self.state_cache is not None:  # warm-up runs must not advance the real sequences' states
            static_packed[:, self.NUM_FIXED] = self.state_cache.scratch_slot
        self._mark_shapes(static_packed)
        # The warm-up runs execute and overwrite last_token_ids, which this very step may still have to read
        # (its feed rows): restore them after each run. The capture itself executes nothing.
        saved_ids = self.last_token_ids.clone()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        compiled = self._compiled_for(key)
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile and warm up outside the capture
                compiled(static_packed, self.last_token_ids)
                self.last_token_ids.copy_(saved_ids)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            static_out = compiled(static_packed, self.last_token_ids)
        self.graph_pool = graph.pool()
        self.graphs[key] = (graph, static_packed, static_out)
        self.compile_seconds += time.perf_counter() - start
        log.info("captured decode graph for batch %d x %d blocks in %.1f s", key[0], key[1], time.perf_counter() - start)

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

from server.models.base import AttentionMetadata

log = logging.getLogger(__name__)
NULL_BLOCK = 0


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
    def __init__(self, model, kv_layers, device: torch.device, max_num_seqs: int, max_blocks_per_seq: int, graphs: bool, decode_kernel: str = "sdpa", state_cache=None):
        self.decode_kernel = decode_kernel
        self.state_cache = state_cache  # hybrids: StateCache; the step then takes the rows' state slots too
        self.model, self.kv_layers, self.device = model, kv_layers, device
        self.batch_sizes = batch_buckets(max_num_seqs)
        self.block_counts = [4]
        while self.block_counts[-1] < max_blocks_per_seq:
            self.block_counts.append(self.block_counts[-1] * 2)
        self.use_graphs = graphs and device.type == "cuda"
        self.compiled = torch.compile(self._forward, fullgraph=True, dynamic=None)
        if decode_kernel == "flex":  # one graph per batch bucket (see _mark_shapes), each within dynamo's limit
            limit = torch._dynamo.config.recompile_limit
            torch._dynamo.config.recompile_limit = max(limit, len(self.batch_sizes) + 4)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, list[torch.Tensor], torch.Tensor]] = {}
        self.graph_pool = None
        self.compile_seconds = 0.0  # first-call compile and capture time, reported by the benchmark
        self._seen: set[tuple[int, int]] = set()

    def padded_shape(self, num_seqs: int, num_blocks: int) -> tuple[int, int]:
        return bucket(num_seqs, self.batch_sizes), bucket(num_blocks, self.block_counts)

    def _forward(self, input_ids, positions, slot_mapping, block_tables, state_slots=None) -> torch.Tensor:
        state = {}
        if self.state_cache is not None:
            state = dict(query_lens=torch.ones_like(positions), state_slots=state_slots,
                         state_caches=self.state_cache.layers)
        meta = AttentionMetadata.for_decode(slot_mapping, block_tables, positions, self.decode_kernel,
                                            self.kv_layers[0][0], **state)
        hidden = self.model(input_ids, positions, meta, self.kv_layers)
        return self.model.compute_logits(hidden)  # [num_seqs, vocab] float32

    @torch.inference_mode()
    def run(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        """inputs: input_ids, positions, slot_mapping [B_pad], block_tables [B_pad, blocks_pad] on the device
        (hybrids: then state_slots [B_pad])."""
        key = tuple(inputs[3].shape)
        if not self.use_graphs:
            self._mark_shapes(inputs)
            if key in self._seen:
                return self.compiled(*inputs)
            start = time.perf_counter()
            out = self.compiled(*inputs)  # first call of this shape: compiles
            self._seen.add(key)
            self.compile_seconds += time.perf_counter() - start
            return out
        if key not in self.graphs:
            self._capture(key, inputs)
        graph, static_inputs, static_out = self.graphs[key]
        for static, value in zip(static_inputs, inputs, strict=True):
            static.copy_(value, non_blocking=True)
        graph.replay()
        return static_out

    def _mark_shapes(self, inputs: list[torch.Tensor]) -> None:
        """FlexAttention's decoding kernel needs a static batch size (else torch falls back to its general
        kernel): the batch dimension is static and the block-table width dynamic, so each batch bucket
        compiles once, whatever the context length."""
        if self.decode_kernel != "flex":
            return
        for tensor in inputs:
            torch._dynamo.mark_static(tensor, 0)
        torch._dynamo.maybe_mark_dynamic(inputs[3], 1)

    def _capture(self, key, inputs) -> None:
        start = time.perf_counter()
        static_inputs = [t.clone() for t in inputs]
        if self.state_cache is not None:  # warm-up runs must not advance the real sequences' states
            static_inputs[4].fill_(self.state_cache.scratch_slot)
        self._mark_shapes(static_inputs)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile and warm up outside the capture
                self.compiled(*static_inputs)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            static_out = self.compiled(*static_inputs)
        self.graph_pool = graph.pool()
        self.graphs[key] = (graph, static_inputs, static_out)
        self.compile_seconds += time.perf_counter() - start
        log.info("captured decode graph for batch %d x %d blocks in %.1f s", key[0], key[1], time.perf_counter() - start)

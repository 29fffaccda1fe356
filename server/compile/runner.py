"""The compiled runner: the eager runner's steps, with plain decode steps through the compiled (and, on CUDA,
graph-captured) decode step and sampled rows through the compiled sampler."""

from __future__ import annotations

import torch

from server.compile.decode_graphs import DecodeGraphs
from server.compile.launch_wrapper import LaunchCompiled
from server.engine.device import serialized_device_work
from server.engine.model_runner import InFlightStep, KVCache, ModelRunner
from server.engine.request import PLACEHOLDER
from server.engine.scheduler import ScheduledChunk
from server.kernels import sampling
from server.kernels.plan import StepPlans


class CompiledRunner(ModelRunner):
    def __init__(self, model, kv_cache: KVCache, device: torch.device, vocab_size: int, decode_graphs: DecodeGraphs,
                 state_cache, plans: StepPlans):
        super().__init__(model, kv_cache, device, vocab_size, state_cache, plans)
        self.decode_graphs = decode_graphs
        # The seeded sampler is several times faster compiled than eager per step; greedy-only batches stay eager
        # (argmax).
        self._sample = LaunchCompiled(sampling.sample, "the sampler",
                                      None if decode_graphs.use_graphs else _sample_launched_from_cpp,
                                      fullgraph=True, dynamic=None)
        self.sampler_ready = True  # False while a background compile builds it: the eager sampler meanwhile

    @property
    def kernel_launch(self) -> str:
        """Who launches the decode step's kernels: DecodeGraphs.kernel_launch."""
        return self.decode_graphs.kernel_launch

    def _forward(self, step: InFlightStep, rows: list[sampling.SamplingRow],
                 prev: InFlightStep | None) -> torch.Tensor | None:
        chunks = step.out.chunks
        if not self._is_plain_decode(chunks):
            return super()._forward(step, rows, prev)
        logits = self._decode(chunks, prev)
        constrained = any(c.request.may_mask(c.request.num_output_tokens) for c in chunks)  # sampled under a mask
        if not constrained and sampling.is_plain_greedy(rows):  # the in-graph argmax is the sample
            step.token_ids = self.decode_graphs.last_token_ids[: len(chunks)]
        return logits

    def _sample_rows(self, logits: torch.Tensor, rows: list[sampling.SamplingRow],
                     token_bitmask: torch.Tensor | None) -> sampling.SamplerOutput:
        batch = sampling.build_sampling_batch(rows, self.vocab_size, self.device, token_bitmask)
        eager = batch.all_greedy or not self.sampler_ready
        return sampling.sample(logits, batch) if eager else self._sample(logits, batch)

    def _on_sampled(self, token_ids: torch.Tensor, prev: InFlightStep | None) -> None:
        """Where the compiled decode step feeds from: the ids of the last step sampled, whichever path ran it."""
        self._after_readers(prev)
        self.decode_graphs.last_token_ids[: token_ids.shape[0]].copy_(token_ids)

    def _after_readers(self, prev: InFlightStep | None) -> None:
        """Order what comes next after the host copy of `prev`'s ids, which may read `last_token_ids` (a wait on
        the device; the host goes on)."""
        if prev is not None and "token_ids" in prev.copies:
            self.streams.wait(prev.copies["token_ids"])

    @torch.inference_mode()
    def warm_sampler(self, sample=None) -> None:
        """Compile the sampler (`sample`: a form of it) for the usual sampled requests (a temperature, with top-p
        or without), at one row and at several, so that the first of them does not wait for it."""
        sample = sample or self._sample
        for top_p in (1.0, 0.95):
            for num_rows in (1, 2):
                rows = [sampling.SamplingRow(temperature=0.7, top_p=top_p, seed=row) for row in range(num_rows)]
                with serialized_device_work(self.device):
                    batch = sampling.build_sampling_batch(rows, self.vocab_size, self.device)
                    sample(torch.zeros(num_rows, self.vocab_size, device=self.device), batch, warm_up=True)

    def launch_from_python_first(self) -> None:
        """While the engine serves beside the compile: the compiled steps launch from inductor's Python wrapper,
        which builds sooner, until `build_cpp_forms` has built their C++ forms (launch_wrapper)."""
        self.decode_graphs.compiled.python_first()
        self._sample.python_first()

    def build_cpp_forms(self) -> None:
        self.decode_graphs.build_cpp_form()
        if self.sampler_ready:  # else its own stage failed: sampled rows stay eager
            self._sample.build_cpp_form(self.warm_sampler)

    def feed_from(self, in_flight: InFlightStep | None) -> None:
        """Taking over from another runner between two steps: the ids of the step in flight become the ones the
        compiled decode step feeds from."""
        if in_flight is not None and in_flight.token_ids is not None:
            self.decode_graphs.last_token_ids[: in_flight.token_ids.shape[0]].copy_(in_flight.token_ids)

    def _is_plain_decode(self, chunks: list[ScheduledChunk]) -> bool:
        return len(chunks) <= self.decode_graphs.ready_num_seqs and all(
            c.num_tokens == 1 and c.sample and not c.request.return_all_logits for c in chunks
        )

    def _decode(self, chunks: list[ScheduledChunk], prev: InFlightStep | None) -> torch.Tensor:
        """One token per sequence through the compiled step: the rows packed on the host, one copy to the device
        (see DecodeGraphs)."""
        graphs, block_size = self.decode_graphs, self.kv_cache.block_size
        num_blocks = max(c.start // block_size + 1 for c in chunks)
        padded_seqs, padded_blocks = graphs.padded_shape(len(chunks), num_blocks)
        state_slots = self.state_cache.decode_slot_ids(chunks) if self.state_cache is not None else None
        packed = []
        for row, chunk in enumerate(chunks):
            request, pos = chunk.request, chunk.start
            token_id = request.token_ids[pos]
            feed_row = prev.sample_rows[request.request_id] if token_id == PLACEHOLDER else -1
            kv_slot = request.block_ids[pos // block_size] * block_size + pos % block_size
            state_slot = state_slots[row] if state_slots is not None else None
            table = request.block_ids[: pos // block_size + 1]
            packed.append(graphs.rows.pack_row(max(token_id, 0), pos, kv_slot, feed_row, state_slot, table,
                                               padded_blocks))
        packed.extend([graphs.rows.padding_row(padded_blocks)] * (padded_seqs - len(chunks)))
        host = torch.tensor(packed, dtype=torch.int64)  # [B_pad, num_fixed + blocks_pad]
        if graphs.pin_inputs:
            host = host.pin_memory()
        return graphs.run(host, before_write=lambda: self._after_readers(prev))[: len(chunks)]


def _sample_launched_from_cpp(*args, **kwargs):
    """`sampling.sample` under a code object of its own, for its C++-wrapper form: dynamo keeps what it saw of a
    function's shapes per code object, so after the Python form the C++ form compiled other (dynamic) graphs than
    it does alone, and a restart that builds it alone missed the cache."""
    return sampling.sample(*args, **kwargs)

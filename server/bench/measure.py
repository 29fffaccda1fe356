"""What the bench measures, device-agnostic: copy bandwidth, weight bytes per token and per step, timings.

Formulas (also printed under the table):
- weight bytes per token (batch 1): every weight tensor except the embedding table, plus the LM head (the tied
  table when tied), plus top_k of the num_experts experts in each MoE layer; counted from the tensors' real
  element sizes, so FP8 weights count 1 byte plus their scales. The KV cache is not counted.
- bytes per step at batch B: weights are read once per step, experts once per step for each distinct expert
  the B tokens route to: dense + expert_bytes * (1 - (1 - k/E)^B) (the expected share of distinct experts
  under uniform routing; exactly k/E at B = 1).
- achieved GB/s = bytes per step / step time; roofline_fraction = achieved GB/s / copy GB/s, where copy GB/s
  is (bytes read + bytes written) / time of one large device-to-device copy, measured in the same run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from server.bench.random_model import persistent_tensors
from server.kernels.compat import synchronize


@dataclass(frozen=True)
class WeightBytes:
    dense: int  # read once per step, whatever the batch
    experts: int  # all experts of all MoE layers
    num_experts: int  # per MoE layer (0: no MoE)
    top_k: int

    @property
    def per_token(self) -> int:
        return self.per_step(1)

    def per_step(self, batch_size: int) -> int:
        if not self.num_experts:
            return self.dense
        share = 1.0 - (1.0 - self.top_k / self.num_experts) ** batch_size
        return self.dense + round(self.experts * share)


def _is_expert_tensor(module: nn.Module, tensor: torch.Tensor) -> bool:
    """Expert weights (and their FP8 scales) live in a module that declares num_experts, with E leading."""
    num_experts = getattr(module, "num_experts", None)
    return isinstance(num_experts, int) and tensor.dim() >= 2 and tensor.shape[0] == num_experts


def weight_bytes(model: nn.Module) -> WeightBytes:
    """Count the bytes a decode step reads, from the model's actual tensors (works on the meta device)."""
    head = getattr(model, "lm_head", None)
    head_ids = {id(t) for t in head.state_dict(keep_vars=True).values()} if isinstance(head, nn.Module) else set()
    embed_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    dense = experts = 0
    num_experts = 0
    for name, tensor in persistent_tensors(model).items():
        size = tensor.numel() * tensor.element_size()
        if id(tensor) in embed_ids and id(tensor) not in head_ids:
            continue  # embedding lookups read B rows, not the table
        owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        if _is_expert_tensor(owner, tensor):
            experts += size
            num_experts = owner.num_experts
        else:
            dense += size
    top_k = int(getattr(model.args, "num_experts_per_tok", 0) or 0) if num_experts else 0
    return WeightBytes(dense, experts, num_experts, top_k)


def total_weight_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in persistent_tensors(model).values())


def timed(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    """Wall seconds of fn() with the device drained before and after (generate() reads tokens on the host anyway)."""
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return time.perf_counter() - start, result


def cuda_graph_us(fn: Callable[[], object], warmups: int = 2, replays: int = 20) -> float:
    """Microseconds per replay of `fn` captured in one CUDA graph (device time, no launch cost): the
    benchmarks' way to time a sequence of kernels."""
    for _ in range(warmups):  # compile / autotune outside the capture
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / replays


def copy_bandwidth_gb_s(device: torch.device, num_bytes: int, reps: int = 10) -> float:
    """(bytes read + bytes written) / time of a device-to-device copy of `num_bytes`, median of `reps` after a
    warm-up. CUDA events time it on CUDA; elsewhere synchronize + perf_counter."""
    numel = max(1, num_bytes // 4)
    src = torch.empty(numel, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = sorted(_copy_seconds(src, dst) for _ in range(reps))
    return 2 * numel * 4 / times[len(times) // 2] / 1e9


def _copy_seconds(src: torch.Tensor, dst: torch.Tensor) -> float:
    if src.device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    return timed(lambda: dst.copy_(src), src.device)[0]


@dataclass(frozen=True)
class Rates:
    """From the best (minimum) wall time of generate() at 1, n_short and n_long new tokens."""

    batch_size: int
    prompt_len: int
    n_short: int
    n_long: int
    t_first: float  # the very first generate(n_long) at this batch size: compile, graph capture, warm-up
    t_one: float
    t_short: float
    t_long: float

    @property
    def step_s(self) -> float:
        """Steady time per decode step, prefill and warm-up excluded (the reference's (t129 - t65) / 64)."""
        return max(self.t_long - self.t_short, 1e-12) / (self.n_long - self.n_short)

    @property
    def decode_tok_s(self) -> float:
        return self.batch_size / self.step_s

    @property
    def prefill_tok_s(self) -> float:
        return self.batch_size * self.prompt_len / self.t_one

    @property
    def warmup_s(self) -> float:
        """What the first call cost beyond a warm call of the same length."""
        return max(self.t_first - self.t_long, 0.0)


def decode_lengths(num_decode_tokens: int) -> tuple[int, int]:
    """(n_short, n_long) new tokens: 65 and 129 for 128, as the reference measured."""
    if num_decode_tokens < 2:
        raise ValueError(f"--decode-tokens must be at least 2 (the steady rate needs two lengths), "
                         f"got {num_decode_tokens}")
    return 1 + num_decode_tokens // 2, 1 + num_decode_tokens

"""What the bench measures, device-agnostic: copy bandwidth, weight bytes per token and per step, timings.

Formulas (also printed under the table):
- weight bytes per token (batch 1): every weight tensor except the embedding table (a lookup reads B rows,
  quantized or not), plus the LM head (the tied table when tied, packed when quantized), plus top_k of the
  num_experts experts in each MoE layer; counted from the tensors' real element sizes, so FP8 weights count
  1 byte plus their scales, affine int4 / int8 weights their packed words plus their scales and biases. The KV
  cache is not counted.
- bytes per step at batch B: weights are read once per step, experts once per step for each distinct expert
  the B tokens route to: dense + expert_bytes * (1 - (1 - k/E)^B) (the expected share of distinct experts
  under uniform routing; exactly k/E at B = 1).
- achieved GB/s = bytes per step / step time; roofline_fraction = achieved GB/s / copy GB/s, where copy GB/s
  is (bytes read + bytes written) / time of one large device-to-device copy, measured in the same run.
- kernels per step: what one steady decode step launches, counted by torch.profiler around one engine step
  after all of that engine's timed calls (and CUPTI detached again after it, so later launches cost what they
  did). CUDA ("cuda_kernels"): the kernel records CUPTI reports; a CUDA graph replay reports each kernel it runs
  as its own record, so graphs on and off count alike. Elsewhere ("aten_ops"), as a stand-in: ATen ops called
  from outside any other ATen op that do device work (views, allocations and no-op conversions left out);
  inductor's own generated kernels are no ATen ops and go uncounted there.
- kernel ms per step (CUDA only): the summed durations of those kernel records, the step's device time; the rest
  of the step's time is the host's (launches, Python) or idle. It ranks forms where host speed is noisy.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from server.engine.weights import persistent_tensors, resident_bytes
from server.kernels.compat import synchronize
from server.models.affine_quant import AffineEmbedding


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


def _read_tensors(head: nn.Module) -> list[torch.Tensor]:
    """The tensors the LM head reads: its own, or a tied affine head's quantized table (AffineTiedHead)."""
    if hasattr(head, "read_tensors"):
        return list(head.read_tensors())
    return list(head.state_dict(keep_vars=True).values())


def weight_bytes(model: nn.Module) -> WeightBytes:
    """Count the bytes a decode step reads, from the model's actual tensors (works on the meta device)."""
    head = getattr(model, "lm_head", None)
    head_ids = {id(t) for t in _read_tensors(head)} if isinstance(head, nn.Module) else set()
    embed_ids = {id(t) for m in model.modules() if isinstance(m, (nn.Embedding, AffineEmbedding))
                 for t in (m.packed() if isinstance(m, AffineEmbedding) else (m.weight,))}
    dense = experts = 0
    num_experts = 0
    for name, tensor in persistent_tensors(model).items():
        size = tensor.numel() * tensor.element_size()
        if id(tensor) in embed_ids and id(tensor) not in head_ids:
            continue  # embedding lookups read B rows, not the table
        owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        if _is_expert_tensor(owner, tensor):
            shared = size // owner.num_experts if getattr(owner, "shared_slot", None) is not None else 0
            dense += shared  # a shared expert kept as the experts' last slot is read every step
            experts += size - shared
            num_experts = owner.num_experts - (1 if shared else 0)
        else:
            dense += size
    top_k = int(getattr(model.args, "num_experts_per_tok", 0) or 0) if num_experts else 0
    return WeightBytes(dense, experts, num_experts, top_k)


def total_weight_bytes(model: nn.Module) -> int:
    return resident_bytes(model)


def timed(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    """Wall seconds of fn() with the device drained before and after (generate() reads tokens on the host anyway)."""
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return time.perf_counter() - start, result


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


def compile_cache_state() -> str:
    """"warm" when inductor's cache directory already holds artifacts (a restart), else "cold"."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir  # private: where torch keeps it
    except ImportError:
        return "unknown"
    path = Path(cache_dir())
    return "warm" if path.is_dir() and any(path.iterdir()) else "cold"


def kernels_counted_by(device: torch.device) -> str:
    return "cuda_kernels" if device.type == "cuda" else "aten_ops"


@dataclass(frozen=True)
class KernelProfile:
    num_kernels: int
    kernel_ms: float | None  # the kernels' summed durations (device time); None where the count is of ATen ops


def profile_kernels(fn: Callable[[], object], device: torch.device) -> KernelProfile:
    """Kernels the device runs for fn(), by torch.profiler, with the device drained before and after so that
    exactly fn's work is seen (see the module docstring; the method is `kernels_counted_by(device)`)."""
    synchronize(device)
    cuda = device.type == "cuda"
    if cuda:
        _detach_cupti_after_profiling()
    # kineto prints its start/stop trace points ("USDT: ... profiler_start") at every level below 6; read at the
    # profiler's first start
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    activities = [torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        synchronize(device)
    return _cuda_kernels(prof) if cuda else KernelProfile(count_aten_ops(prof.events()), None)


def _detach_cupti_after_profiling() -> None:
    """Left attached once the profiler stops, CUPTI makes every later kernel launch slower, and so the timed
    calls of the engines measured after this one. torch keeps it attached with CUDA graphs before CUDA 12.6,
    where attaching it again crashed; there the count stays right but later launches pay."""
    major, minor = (int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    if (major, minor) >= (12, 6):
        os.environ.setdefault("TEARDOWN_CUPTI", "1")


def _cuda_kernels(prof) -> KernelProfile:
    """Kernel records of the trace (its categories are the stable way to tell kernels from copies and runtime
    calls across torch versions) and their summed durations. Each kernel a cudaGraphLaunch runs carries that
    launch's correlation id: a launch without one would mean the graph's kernels went untraced, so it raises
    rather than under-count."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    graph_launches = {e.get("args", {}).get("correlation") for e in events
                      if e.get("cat") in ("cuda_runtime", "cuda_driver")
                      and e.get("name", "").startswith(("cudaGraphLaunch", "cuGraphLaunch"))}
    untraced = graph_launches - {e.get("args", {}).get("correlation") for e in kernels}
    if untraced:
        raise RuntimeError(f"the profiler traced no kernels of {len(untraced)} CUDA graph replays")
    return KernelProfile(len(kernels), sum(e.get("dur", 0.0) for e in kernels) / 1e3)  # the trace's "dur" is in us


# Ops that do no device work yet are not views by their schemas.
NO_DEVICE_WORK = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view",
                            "resize_", "set_", "detach_", "result_type", "record_stream"})


def count_aten_ops(events: Iterable) -> int:
    """Profiler events (FunctionEvent) -> the ATen ops called from outside any other ATen op that do device
    work: an op that returns a view or only allocates counts when an op inside it does work (`to` that copies,
    `contiguous` that clones)."""
    return sum(1 for e in events if _is_aten(e) and _aten_parent(e) is None and _does_device_work(e))


def _is_aten(event) -> bool:
    return event.name.startswith("aten::")


def _aten_parent(event):
    parent = event.cpu_parent
    while parent is not None and not _is_aten(parent):
        parent = parent.cpu_parent
    return parent


def _aten_children(event) -> list:
    children = []
    for child in event.cpu_children:
        children += [child] if _is_aten(child) else _aten_children(child)
    return children


def _does_device_work(event) -> bool:
    op = event.name.removeprefix("aten::")
    if op not in NO_DEVICE_WORK and not _is_view_op(op):
        return True
    return any(_does_device_work(child) for child in _aten_children(event))


@functools.cache
def _is_view_op(op: str) -> bool:
    """Every overload of `op` that takes a tensor returns a view of it (the profiler records no overload names;
    the overloads taking no tensor are TorchScript's list and string forms)."""
    try:
        packet = getattr(torch.ops.aten, op)
        overloads = [getattr(packet, name) for name in packet.overloads()]
    except (AttributeError, RuntimeError):
        return False
    on_tensors = [o for o in overloads if any(isinstance(a.type, torch.TensorType) for a in o._schema.arguments)]
    return bool(on_tensors) and all(o.is_view for o in on_tensors)


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


GenerateFn = Callable[[list[list[int]], int], list[list[int]]]


@dataclass
class Series:
    """One side's measurements: batch size -> rates, and the long run's greedy tokens of sequence 0."""

    rates: dict[int, Rates] = field(default_factory=dict)
    tokens: dict[int, list[int]] = field(default_factory=dict)
    modes: dict[int, str] = field(default_factory=dict)
    kernels: dict[int, KernelProfile | None] = field(default_factory=dict)  # one steady decode step's kernels
    notes: list[str] = field(default_factory=list)


def measure_series(series: Series, side: str, generate: GenerateFn, device, batch: list[list[int]],
                   lengths: tuple[int, int], reps: int, progress) -> None:
    """Warm-up call at the long length (compile, graphs), then `reps` x (1, n_short, n_long) new tokens; best times."""
    n_short, n_long = lengths
    batch_size = len(batch)

    def call(num_new: int, what: str) -> tuple[float, list[list[int]]]:
        progress.set_description(f"{side} B={batch_size}: {what}")
        seconds, tokens = timed(lambda: generate(batch, num_new), device)
        if any(len(t) != num_new for t in tokens):
            raise RuntimeError(f"{side} returned {[len(t) for t in tokens]} tokens, asked for {num_new} per sequence")
        progress.update()
        return seconds, tokens

    progress.write(f"{side} B={batch_size}: first call of {n_long} tokens (compile / warm-up) ...")
    t_first, _ = call(n_long, "first call (compile / warm-up)")
    best = {1: float("inf"), n_short: float("inf"), n_long: float("inf")}
    long_tokens: list[list[int]] = []
    for rep in range(reps):
        for num_new in (1, n_short, n_long):
            seconds, tokens = call(num_new, f"{num_new} tokens, rep {rep + 1}/{reps}")
            best[num_new] = min(best[num_new], seconds)
            if num_new == n_long:
                long_tokens = tokens
    rates = Rates(batch_size, len(batch[0]), n_short, n_long, t_first, best[1], best[n_short], best[n_long])
    if rates.t_long <= rates.t_short:
        progress.write(f"{side} B={batch_size}: WARNING {n_long} tokens took no longer than {n_short}: timing noise "
                       "dominates; raise --decode-tokens or --reps")
    series.rates[batch_size], series.tokens[batch_size] = rates, long_tokens[0]
    progress.write(f"{side} B={batch_size}: decode {rates.decode_tok_s:.1f} tok/s ({rates.step_s * 1e3:.2f} ms/step), "
                   f"prefill {rates.prefill_tok_s:.0f} tok/s, first call {t_first:.1f} s")


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else ""

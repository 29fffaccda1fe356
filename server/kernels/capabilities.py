"""Which fast paths work on a device with this torch build, found by running each op on tiny tensors.

A version number alone cannot say whether e.g. row-wise `scaled_mm` has a kernel for this device (CPU has one from
2.13, MPS from 2.15), so every entry is probed once per process per device and keeps the reason when it fails.

A probe runs tiny shapes; a real shape can still fail where the probe passed. Each fast path therefore runs
through `with_fallback`: the first time it raises on a device, one warning names it and how to report it, and
that call and every later one (in this process, on that device) take the reference path instead.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TypeVar

import torch
import torch.nn.functional as F

from server.kernels import compat

_FP8 = getattr(torch, "float8_e4m3fn", None)
log = logging.getLogger(__name__)
T = TypeVar("T")
REPORT_HINT = "Please report it on the mps-serve issue tracker with the output of `mps-serve selfcheck`"
_MAX_REL_ERR = 3e-2  # fp8 / bf16 outputs against an fp32 product of the same (dequantized) operands


@dataclass(frozen=True)
class Probe:
    ok: bool
    reason: str
    brief: str = ""  # a failure's reason in a few words (`reason` has the exception); empty: `reason` is short


@dataclass(frozen=True)
class Capabilities:
    device: str
    torch_version: str
    fp8_rowwise: Probe  # scaled_mm with one scale per row of each operand (M = 1 and M = 16)
    fp8_rowwise_bias: Probe  # the same with the bias fused
    grouped_mm_bf16: Probe
    grouped_mm_fp16: Probe
    grouped_mm_fp32: Probe
    grouped_mm_bf16_traced: Probe  # the op's shape function (used by torch.compile) accepts the dtype
    grouped_mm_fp16_traced: Probe
    grouped_mm_fp32_traced: Probe
    fp8_grouped: Probe  # scaled_grouped_mm row-wise
    fp8_weight_only: Probe  # FP8 weights widened inside a float32 reduction (compiled decode at batch 1)
    fp8_codegen: Probe  # inductor's code generator for the device has float8 types (not Metal in torch 2.15)
    private_spellings: Probe  # torch._scaled_mm / torch._grouped_mm run here too (what traced steps call)
    streams: Probe  # a side stream + event for non-blocking device-to-host copies
    compile: Probe  # torch.compile's default backend has what it needs (no compile is run)
    # fast path name -> why it failed at run time: from then on its reference path runs (see with_fallback)
    runtime_failures: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def grouped_mm(self, dtype: torch.dtype, tracing: bool = False) -> bool:
        """Whether grouped_mm runs for dtype; with tracing, also under torch.compile."""
        names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
        if dtype not in names:
            return False
        eager = getattr(self, f"grouped_mm_{names[dtype]}").ok
        return eager and (not tracing or getattr(self, f"grouped_mm_{names[dtype]}_traced").ok)

    def describe(self, verbose: bool = False) -> list[str]:
        """One line per probe; a failure by its brief reason, or `verbose` by its exception."""
        lines = [f"device {self.device}, torch {self.torch_version}"]
        for entry in fields(self):
            value = getattr(self, entry.name)
            if isinstance(value, Probe):
                reason = value.reason if verbose or not value.brief else value.brief
                lines.append(f"  {entry.name:<22} {'yes' if value.ok else 'no ':<4} {reason}")
        return lines


def _normalize(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def capabilities(device: torch.device | str) -> Capabilities:
    return _probe_all(_normalize(device))


@functools.cache
def _probe_all(device_name: str) -> Capabilities:
    device = torch.device(device_name)
    return Capabilities(
        device=device_name,
        torch_version=torch.__version__,
        fp8_rowwise=_run(lambda: _check_scaled_mm(device, with_bias=False)),
        fp8_rowwise_bias=_run(lambda: _check_scaled_mm(device, with_bias=True)),
        grouped_mm_bf16=_run(lambda: _check_grouped_mm(device, torch.bfloat16)),
        grouped_mm_fp16=_run(lambda: _check_grouped_mm(device, torch.float16)),
        grouped_mm_fp32=_run(lambda: _check_grouped_mm(device, torch.float32)),
        grouped_mm_bf16_traced=_run(lambda: _check_grouped_mm_meta(torch.bfloat16)),
        grouped_mm_fp16_traced=_run(lambda: _check_grouped_mm_meta(torch.float16)),
        grouped_mm_fp32_traced=_run(lambda: _check_grouped_mm_meta(torch.float32)),
        fp8_grouped=_run(lambda: _check_scaled_grouped_mm(device)),
        fp8_weight_only=_run(lambda: _check_weight_only(device)),
        fp8_codegen=_run(lambda: _check_fp8_codegen(device)),
        private_spellings=_run(lambda: _check_private_spellings(device)),
        streams=_run(lambda: _check_streams(device)),
        compile=_run(lambda: _check_compile(device)),
    )


def _run(check: Callable[[], str]) -> Probe:
    """A check returns a reason when it works and raises when it does not."""
    try:
        return Probe(True, check())
    except Exception as exc:  # any failure of an optional fast path means "use the fallback"
        return Probe(False, failure_reason(exc), brief_reason(exc))


# torch's refusals, in a few words: (pattern of the message, what to say)
_BRIEF = (
    (re.compile(r"Could not run '(?:aten::)?([\w.]+)' with arguments from the '(\w+)' backend"), "{0}: no {1} kernel"),
    (re.compile(r"Expected inputs of (\w+) type"), "takes {0} inputs only"),
    (re.compile(r"not (?:implemented|supported)", re.IGNORECASE), "not supported here"),
)
_MAX_BRIEF = 60


def brief_reason(exc: BaseException) -> str:
    """Why a probe failed in a few words, for `mps-serve info` (the exception is `failure_reason`'s, under
    --verbose): torch's usual refusals by a pattern; any other reason by its first clause."""
    text = str(exc).strip()
    for pattern, say in _BRIEF:
        found = pattern.search(text)
        if found:
            return say.format(*found.groups())
    first = re.split(r"(?<=[.;:])\s", text.splitlines()[0] if text else "", maxsplit=1)[0].rstrip(".;:")
    if not first:
        return type(exc).__name__
    return first if len(first) <= _MAX_BRIEF else first[: _MAX_BRIEF - 4].rsplit(" ", 1)[0] + " ..."


def failure_reason(exc: BaseException, max_len: int = 320) -> str:
    """The exception's type and the first line of its text, cut at a sentence end when long (torch's
    dispatcher errors go on to list every backend)."""
    text = str(exc).strip()
    message = text.splitlines()[0] if text else ""
    if len(message) > max_len:
        end = message.rfind(". ", 0, max_len)
        message = message[: end + 1] if end > 0 else message[:max_len] + " ..."
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _rand(*shape: int, device: torch.device, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(device)


def _compare(out: torch.Tensor, ref: torch.Tensor, what: str) -> str:
    err = ((out.float().cpu() - ref.cpu()).norm() / ref.norm().clamp_min(1e-12)).item()
    if not err <= _MAX_REL_ERR:  # also catches NaN
        raise ArithmeticError(f"{what} gives wrong numbers (rel err {err:.2e})")
    return f"{what}, rel err {err:.1e}"


def _spellings(public: str, every: bool = False) -> list[tuple[str, bool]]:
    """The spelling eager steps call: the public op, else the private one; with `every`, each this build has.
    The private spellings of scaled_mm and grouped_mm, which traced steps prefer, are probed apart
    (private_spellings): torch 2.15 has `torch._scaled_mm` on CUDA and the CPU, not on MPS. Traced steps call
    torch._scaled_grouped_mm (dynamo 2.11 skips the public op), so the FP8 grouped probe needs both."""
    found = compat.spellings(public)
    if not found:
        raise AttributeError(f"neither F.{public} nor torch._{public} exists in this torch build")
    return found if every else found[:1]


def _check_scaled_mm(device: torch.device, with_bias: bool) -> str:
    if _FP8 is None:
        raise TypeError("torch.float8_e4m3fn is missing from this torch build")
    num_rows, num_cols, inner = (16, 32, 64)
    weight = _rand(num_cols, inner, device=device, seed=1).to(_FP8)  # [N, K]
    bias = _rand(num_cols, device=device, seed=2).to(torch.bfloat16) if with_bias else None
    reasons = []
    for name, private in _spellings("scaled_mm"):
        for m in (1, num_rows):
            x = _rand(m, inner, device=device, seed=3).to(_FP8)
            scale_a = torch.rand(m, 1, device=device) + 0.5
            scale_b = torch.rand(1, num_cols, device=device) + 0.5
            out = compat.scaled_mm_rowwise(x, weight.t(), scale_a, scale_b, bias, torch.bfloat16, private)
            ref = (x.float() * scale_a) @ (weight.float().t() * scale_b)
            if bias is not None:
                ref = ref + bias.float()
            error = _compare(out, ref, name)
        reasons.append(error)
    return "; ".join(reasons)


def _grouped_operands(device: torch.device, dtype: torch.dtype):
    offs = torch.tensor([8, 8, 24, 32], dtype=torch.int32, device=device)  # group 1 is empty
    mat_a = _rand(32, 64, device=device, seed=4).to(dtype)  # [sum M, K]
    weight = _rand(4, 48, 64, device=device, seed=5).to(dtype)  # [G, N, K]
    return mat_a, weight, offs, _grouped_product(mat_a, weight, offs)


def _grouped_product(mat_a: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """In float32: the rows of group g (between the group ends `offs`) times weight[g].T."""
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    pieces = [mat_a[s:e].float() @ weight[g].float().t() for g, (s, e) in enumerate(zip(starts, ends, strict=True))]
    return torch.cat(pieces)


def _check_grouped_mm(device: torch.device, dtype: torch.dtype) -> str:
    mat_a, weight, offs, ref = _grouped_operands(device, dtype)
    reasons = []
    for name, private in _spellings("grouped_mm"):
        reasons.append(_compare(compat.grouped_mm(mat_a, weight.transpose(-2, -1), offs, None, private), ref, name))
    return "; ".join(reasons)


def _check_grouped_mm_meta(dtype: torch.dtype) -> str:
    """Meta tensors run the op's shape function, which is what torch.compile traces through."""
    meta = torch.device("meta")
    offs = torch.empty(4, dtype=torch.int32, device=meta)
    mat_b = torch.empty(4, 48, 64, dtype=dtype, device=meta).transpose(-2, -1)
    compat.grouped_mm(torch.empty(32, 64, dtype=dtype, device=meta), mat_b, offs, None, private=True)
    return "shape function accepts it"


def _check_scaled_grouped_mm(device: torch.device) -> str:
    if _FP8 is None:
        raise TypeError("torch.float8_e4m3fn is missing from this torch build")
    mat_a, weight, offs, _ = _grouped_operands(device, torch.float32)
    a_fp8, w_fp8 = mat_a.to(_FP8), weight.to(_FP8)
    scale_a = torch.rand(mat_a.shape[0], device=device) + 0.5  # [sum M]
    scale_b = torch.rand(weight.shape[0], weight.shape[1], device=device) + 0.5  # [G, N]
    ref = _grouped_product(a_fp8.float() * scale_a[:, None], w_fp8.float() * scale_b[:, :, None], offs)
    reasons = []
    for name, private in _spellings("scaled_grouped_mm", every=True):
        out = compat.scaled_grouped_mm_rowwise(
            a_fp8, w_fp8.transpose(-2, -1), scale_a, scale_b, offs, torch.bfloat16, private
        )
        reasons.append(_compare(out, ref, name))
    return "; ".join(reasons)


def _check_private_spellings(device: torch.device) -> str:
    """torch._scaled_mm and torch._grouped_mm where the build also has their public ops (else the public ones are
    what every step calls already)."""
    reasons = []
    if hasattr(F, "scaled_mm") and hasattr(torch, "_scaled_mm") and _FP8 is not None:
        x, weight = _rand(16, 64, device=device, seed=3).to(_FP8), _rand(32, 64, device=device, seed=1).to(_FP8)
        scale_a, scale_b = torch.rand(16, 1, device=device) + 0.5, torch.rand(1, 32, device=device) + 0.5
        out = compat.scaled_mm_rowwise(x, weight.t(), scale_a, scale_b, None, torch.bfloat16, private=True)
        reasons.append(_compare(out, (x.float() * scale_a) @ (weight.float().t() * scale_b), "torch._scaled_mm"))
    if hasattr(F, "grouped_mm") and hasattr(torch, "_grouped_mm"):
        mat_a, weight, offs, ref = _grouped_operands(device, torch.float32)
        out = compat.grouped_mm(mat_a, weight.transpose(-2, -1), offs, None, private=True)
        reasons.append(_compare(out, ref, "torch._grouped_mm"))
    return "; ".join(reasons) or "no private spelling beside a public one in this torch build"


def _check_weight_only(device: torch.device) -> str:
    """The eager form of the reduction inductor fuses: FP8 -> float32 on the device, multiply, sum."""
    if _FP8 is None:
        raise TypeError("torch.float8_e4m3fn is missing from this torch build")
    weight = _rand(32, 64, device=device, seed=4).to(_FP8)  # [N, K]
    scale = torch.rand(32, 1, device=device) + 0.5
    x = _rand(2, 64, device=device, seed=5).to(torch.bfloat16)
    out = ((x.float().unsqueeze(1) * weight.float().unsqueeze(0)).sum(-1) * scale.view(1, -1)).to(torch.bfloat16)
    ref = x.float().cpu() @ (weight.float().cpu() * scale.cpu()).t()
    return _compare(out, ref, "float8 widening in a float32 reduction")


def _check_fp8_codegen(device: torch.device) -> str:
    """Whether a compiled step's generated kernels may read and write float8 (casts, widened weights): Metal's code
    generator has a type table of its own; no kernel is generated here."""
    if _FP8 is None:
        raise TypeError("torch.float8_e4m3fn is missing from this torch build")
    if device.type != "mps":
        return f"inductor's {device.type} code generator has float8 types"
    from torch._inductor.codegen.mps import DTYPE_TO_METAL

    if _FP8 not in DTYPE_TO_METAL:
        raise TypeError("inductor's Metal code generator has no float8 type in this torch build")
    return "inductor's Metal code generator has float8 types"


def _check_streams(device: torch.device) -> str:
    if device.type == "cpu":
        raise RuntimeError("cpu has no device streams; host copies are synchronous")
    module = getattr(torch, device.type)
    missing = [name for name in ("Stream", "Event", "stream", "current_stream") if not hasattr(module, name)]
    if missing:
        raise AttributeError(f"torch.{device.type} lacks {', '.join(missing)} in this torch build")
    stream = module.Stream(device=device) if device.type == "cuda" else module.Stream()
    source = torch.arange(8, device=device)
    stream.wait_stream(module.current_stream())
    with module.stream(stream):
        host = torch.empty(8, dtype=source.dtype, pin_memory=device.type == "cuda")
        host.copy_(source, non_blocking=True)
        event = module.Event()
        event.record()
    source.record_stream(stream)
    event.synchronize()
    if host.tolist() != list(range(8)):
        raise RuntimeError("side-stream copy returned wrong values")
    return f"torch.{device.type}.Stream + Event"


def _check_compile(device: torch.device) -> str:
    if not hasattr(torch, "compile"):
        raise AttributeError("torch.compile is missing")
    if device.type == "cpu":
        compiler = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
        if compiler is None:
            raise FileNotFoundError("inductor on cpu needs a C++ compiler (g++/clang++) on PATH")
        return f"inductor (cpu, {compiler}); checked cheaply, nothing compiled"
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        raise ModuleNotFoundError("inductor on cuda needs triton")
    return f"inductor ({device.type}); checked cheaply, nothing compiled"


@torch.compiler.assume_constant_result
def fast_path_failed(device: torch.device, name: str) -> bool:
    return name in capabilities(device).runtime_failures


def with_fallback(device: torch.device, name: str, fast: Callable[[], T], reference: Callable[[], T],
                  catch: bool) -> T:
    """fast(), or reference() once fast has raised on this device. `catch` (StepPlan.catch_fast_path_failures):
    a failure of fast() switches to reference() with one warning. A traced step calls fast() as is: a failure
    there fails the compile, and the engine then stays on its eager path, which catches it here."""
    if fast_path_failed(device, name):
        return reference()
    if not catch:
        return fast()
    try:
        return fast()
    except Exception as exc:  # noqa: BLE001 - any failure of a fast path: the reference path answers instead
        record_failure(device, name, exc)
        return reference()


def record_failure(device: torch.device | str, name: str, exc: BaseException) -> None:
    """Switch `name` to its reference path on this device, with one warning (the first failure only)."""
    failures = capabilities(device).runtime_failures
    if name in failures:
        return
    failures[name] = failure_reason(exc)
    log.warning("the %s fast path failed on %s (%s); its reference path runs from now on (same results, slower). "
                "The probe passed it, so this is a bug. %s.", name, _normalize(device), failures[name], REPORT_HINT)

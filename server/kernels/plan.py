"""The step plan: which form of each op a step runs, decided once per engine from the probe, the device, the model
dtype and whether torch.compile traces the step.

One model object serves eager steps and compiled steps at once (a background compile beside eager serving), so the
plan is not a property of the model: it is an argument of every forward, passed down to the layers and kernels,
which read it and never ask whether they are traced or which device they run on. An engine holds `StepPlans`: the
eager plan, the compiled (traced) one, and the compiled one for a step whose every decoder layer is inlined
(inductor's C++ wrapper cannot call a compiled region).

Every field is a bool or a string: dynamo guards those as constants, so a compiled step folds each choice away and
the same plan (or an equal one) never recompiles it. An int field would be made symbolic under dynamic shapes.
Benchmarks and tests compare forms by building another plan (`dataclasses.replace`), not by patching modules.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from server.kernels import compat
from server.kernels.capabilities import Capabilities, capabilities


@dataclass(frozen=True)
class StepPlan:
    # Fast-path failures at run time (capabilities.with_fallback): caught eagerly, the reference answering from
    # then on; traced, the fast path is called as is (a failure fails the compile, and the eager path serves).
    catch_fast_path_failures: bool
    # kernels.gemv: a one-token linear with out <= in as one reduction over K, where the GEMM library splits K
    # (CUDA) and the step is compiled (eager, the product would materialize [M, N, K]).
    row_reduction_linear: bool
    # kernels.fp8: a one-token FP8 linear reads its weight inside one float32 reduction (compiled, where the probe
    # found FP8 widening); else row-wise scaled_mm (`fp8_rowwise`, `fp8_rowwise_bias`: with the bias fused) or
    # the dequantizing reference.
    fp8_weight_only: bool
    fp8_rowwise: bool
    fp8_rowwise_bias: bool
    # kernels.moe / moe_fp8: grouped_mm for the model dtype (traced: also its shape function), scaled_grouped_mm
    # for FP8 experts; the gather-reduce experts at few slots (compiled, not on MPS, where grouped_mm is measured).
    grouped_mm: bool
    fp8_grouped: bool
    moe_gather_reduce: bool
    # torch compiles a nested region once for every call site (2.13+): a decode batch's token count must then
    # stay symbolic inside a layer (moe.few_slots_only_at_fewest).
    regions_compile_once: bool
    # The router's top-k as k rounds of max-then-mask (one fused kernel; worth its generation time only where a
    # decoder layer compiles once as a region), and the winners' softmax pointwise over their k columns.
    fused_top_k: bool
    pointwise_winners_softmax: bool
    # kernels.compat: the private aten spellings (torch._scaled_mm, ...), which dynamo traces, where the probe
    # found them (torch 2.15 has no torch._scaled_mm on MPS); eager, and traced elsewhere, the public F ops.
    private_ops: bool
    # models.layers.apply_rope: partial rotary as one expression over the whole head (stays in the norm's kernel).
    partial_rope_whole_head: bool
    # kernels.gated_delta.gated_delta_decode_: the state read once for both products and updated in place with
    # index_put_ (compiled), else batched mat-vecs and one index_copy_.
    fused_state_update: bool
    # models.hybrid.SharedExpertMoE: the shared expert's gate logit as a reduction inductor fuses with its
    # neighbours (compiled), else a one-row linear.
    shared_gate_reduction: bool
    # How decoder layers run: "eager" (plain calls), "regions" (each layer that traces whole is one compiled region,
    # traced once and stamped out for the others: models.regions), "inline" (traced into the step's graph).
    layers: str
    # kernels.flex_decode: the block mask right on the listed blocks only (compiled, static batch) or on the whole
    # cache (eager); the Triton kernel's KV tile bounded by the cache block (CUDA).
    flex_listed_blocks: bool
    flex_kv_tile: bool
    # kernels.sampling.greedy_ids: the argmax in two stages where a device reduces a row's chunks in parallel.
    two_stage_argmax: bool
    # kernels.affine: packed int4/int8 weights read inside one reduction (one-token linears, the experts' slots)
    # where the step is compiled; eager, the reference dequantizes and multiplies.
    affine_reduction: bool = False
    # kernels.fp8.fp8_cast: casts to and from float8 as calls of the device's cast kernel, where the compiled step's
    # code generator has no float8 type (inductor's Metal backend in torch 2.15); else generated with their neighbours.
    opaque_fp8_casts: bool = False

    def for_inline_call(self) -> StepPlan:
        """The plan of a layer traced inline in a step that compiles its others as regions: no fused top-k there."""
        return dataclasses.replace(self, fused_top_k=False) if self.fused_top_k else self


@dataclass(frozen=True)
class StepPlans:
    """An engine's plans: eager steps, compiled steps, and compiled steps with every decoder layer inlined."""

    eager: StepPlan
    compiled: StepPlan
    compiled_layers_inline: StepPlan


def build_step_plan(caps: Capabilities, device: torch.device | str, dtype: torch.dtype, traced: bool,
                    layers_inline: bool = False) -> StepPlan:
    """The forms a step on `device` with weights in `dtype` runs, eager or traced by torch.compile.
    `layers_inline`: a traced step that cannot call compiled regions (inductor's C++ wrapper); its layers are
    still regions where torch inlines them after tracing (compat.regions_inline_after_tracing)."""
    kind = torch.device(device).type
    regions_once = compat.regions_compile_once()
    if not traced:
        layers = "eager"
    elif layers_inline:
        layers = "regions" if compat.regions_inline_after_tracing() else "inline"
    else:
        layers = "regions" if regions_once else "inline"
    return StepPlan(
        catch_fast_path_failures=not traced,
        row_reduction_linear=traced and kind == "cuda",
        fp8_weight_only=traced and caps.fp8_weight_only.ok and caps.fp8_codegen.ok,
        fp8_rowwise=caps.fp8_rowwise.ok,
        fp8_rowwise_bias=caps.fp8_rowwise_bias.ok,
        grouped_mm=caps.grouped_mm(dtype, traced),
        fp8_grouped=caps.fp8_grouped.ok,
        moe_gather_reduce=traced and kind != "mps",
        regions_compile_once=traced and regions_once,
        fused_top_k=traced and regions_once and not layers_inline,
        pointwise_winners_softmax=traced,
        private_ops=traced and caps.private_spellings.ok,
        partial_rope_whole_head=traced,
        fused_state_update=traced,
        shared_gate_reduction=traced,
        layers=layers,
        flex_listed_blocks=traced,
        flex_kv_tile=kind == "cuda",
        two_stage_argmax=kind != "cpu",
        affine_reduction=traced,
        opaque_fp8_casts=traced and not caps.fp8_codegen.ok,
    )


def build_step_plans(caps: Capabilities, device: torch.device | str, dtype: torch.dtype) -> StepPlans:
    return StepPlans(
        eager=build_step_plan(caps, device, dtype, traced=False),
        compiled=build_step_plan(caps, device, dtype, traced=True),
        compiled_layers_inline=build_step_plan(caps, device, dtype, traced=True, layers_inline=True),
    )


def step_plans(device: torch.device | str, dtype: torch.dtype) -> StepPlans:
    """The plans of an engine on `device` (probed once per process) with weights in `dtype`."""
    return build_step_plans(capabilities(device), device, dtype)


def step_plan(device: torch.device | str, dtype: torch.dtype, traced: bool = False) -> StepPlan:
    """One plan on `device`, for callers outside an engine (tests, benchmarks, the self-check)."""
    return build_step_plan(capabilities(device), device, dtype, traced)

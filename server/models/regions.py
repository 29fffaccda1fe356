"""Decoder layers as compiled regions, for whoever compiles a model: `compiled_layer_regions(model)` once, and a
compiled step whose plan says `layers == "regions"` traces each distinct layer graph once and stamps it out for the
other layers (torch.compiler.nested_compile_region): compile time stops growing with depth, and no fusion is lost
at the boundary, whose only neighbours are the residual add before it and the next norm's reduction after it.

A region must trace whole: a layer whose mixer has a deliberate graph break in its multi-token form
(`DecoderLayer.traces_whole = False`) runs inline outside the decode step, as do all layers of a plan that inlines
them (`layers == "inline"`: inductor's C++ wrapper, which cannot call a region, where torch lacks the pass that
inlines them after tracing). An eager plan calls every layer as is.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from server.kernels import compat
from server.kernels.plan import StepPlan
from server.models.base import AttentionMetadata

_META_FIELDS = tuple(field.name for field in dataclasses.fields(AttentionMetadata))
_PLAN_FIELDS = tuple(field.name for field in dataclasses.fields(StepPlan))


def compiled_layer_regions(model: nn.Module) -> None:
    """Run `model`'s decoder layers through call_layer_region (idempotent; eager steps are unaffected)."""
    model.model.layer_call = call_layer_region


def call_layer_region(layer: nn.Module, x, rope, meta, cache, plan: StepPlan):
    """The layer as its plan says: a compiled region, inline, or (eager) a plain call."""
    if plan.layers == "eager":
        return layer(x, rope, meta, cache, plan)
    if plan.layers == "regions" and (layer.traces_whole or meta.is_decode):
        return _call_region(layer, x, rope, meta, cache, plan)
    return layer(x, rope, meta, cache, plan.for_inline_call())


def _call_region(layer: nn.Module, x, rope, meta, cache, plan: StepPlan):
    """The region takes only leaves (tensors, constants, the layer): dynamo fingerprints those directly to find
    the region it already traced, where a nested argument (the metadata, the plan) makes it trace pytree's flatten
    at every layer's call (a third of a warm start), or not reuse the region at all. A state layer's cache is a
    tuple of tensors, an attention layer's one tensor."""
    caches = cache if isinstance(cache, tuple) else (cache,)
    meta_fields = tuple(getattr(meta, name) for name in _META_FIELDS)
    plan_fields = tuple(getattr(plan, name) for name in _PLAN_FIELDS)
    return _layer_region(layer, x, isinstance(cache, tuple), len(caches), *rope, *caches, *meta_fields, *plan_fields)


def _region_forward(layer: nn.Module, x, cache_is_tuple: bool, num_caches: int, cos, sin, *rest):
    caches, rest = rest[:num_caches], rest[num_caches:]
    meta_fields, plan_fields = rest[: len(_META_FIELDS)], rest[len(_META_FIELDS) :]
    cache = tuple(caches) if cache_is_tuple else caches[0]
    return layer(x, (cos, sin), AttentionMetadata(*meta_fields), cache, StepPlan(*plan_fields))


# Compiled once per distinct layer graph (where torch compiles a region once for all its call sites; else inline).
_layer_region = compat.compile_region(_region_forward)

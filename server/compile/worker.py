"""Starting the compile child (`python -m server.compile.twin`) and keying what it fills; compile.child has the
protocol, compile.twin the child's side. It builds the serving engine's twin, every parameter, buffer and cache a
FakeTensor of the real shape, dtype and device (no weight or KV memory), and runs the warm-up stages: each graph
goes to inductor, which writes its caches, and then runs as FX code on the fakes (compiled kernels would read data
the fakes do not have). The serving process then compiles each stage as a cache hit."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

from server.compile.child import CompileChild
from server.compile.policy import compiles_decode
from server.compile.warmup import HOST_READING_STAGES
from server.config import EngineConfig
from server.kernels.fp8 import has_fp8_linears

STAGE_LIST = "the twin's stages"  # filled_marker's name for the list of them

log = logging.getLogger(__name__)


def start_compile_child(spec: dict | None, stages: list[str] | None) -> CompileChild | None:
    """A child that fills the compile cache for those of the engine's warm-up stages named in `stages` that the
    cache lacks (None: all of them, as a child's twin listed them before, or as the child names them once it has
    built the twin). None where `spec` is (the engine has no twin: a parallel or a hand-built model) or where the
    cache holds all of `stages` (a warm start: loading them here is quicker than waiting for a child to find
    them)."""
    if spec is None:
        return None
    if stages is None:  # before the engine exists: the stages a twin of it listed before, if one did
        stages = twin_stage_names(spec)
    spec = dict(spec, stages=None if stages is None else stages_to_fill(spec, stages),
                save_steps=saved_steps_dir(spec) is not None)  # whether this process loads what it saves
    if spec["stages"] == []:
        log.info("the compile cache holds this model's steps (%s): loading them in this process",
                 filled_marker(spec, "").parent)
        return None
    root = str(Path(__file__).resolve().parents[2])  # where `server` is importable from
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    log_path = Path(tempfile.gettempdir()) / f"mps-serve-compile-{os.getpid()}.log"
    return CompileChild.start(spec, [sys.executable, "-m", "server.compile.twin"], env, log_path, count_cache_misses)


def stages_to_fill(spec: dict, stages: list[str]) -> list[str]:
    """Those of `stages` a child can fill and the cache lacks: not the ones reading ids on the host, not the ones
    a child filled for this same engine before."""
    return [what for what in stages if what not in HOST_READING_STAGES and not filled_marker(spec, what).exists()]


def cache_holds_every_stage(spec: dict | None) -> bool:
    """Whether a child filled every stage it can of the engine `spec` describes (as its twin listed them)."""
    names = None if spec is None else twin_stage_names(spec)
    return names is not None and not stages_to_fill(spec, names)


def twin_stage_names(spec: dict) -> list[str] | None:
    """The warm-up stages a child's twin of this engine listed, None where no child built that twin yet."""
    try:
        return json.loads(filled_marker(spec, STAGE_LIST).read_text())
    except (OSError, ValueError):
        return None


def count_cache_misses() -> int:
    """Inductor's FX-graph cache misses in this process so far."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_miss"]


class ChildBeforeLoad:
    """`load_pretrained`'s `on_materialized`: starts the compile child (through `start`, start_compile_child)
    once the model's tensors hold their device memory, so that it compiles while the weights stream in. The KV
    block count is planned then, as the twin needs it: the weights' memory is taken, their values do not
    matter."""

    def __init__(self, config: EngineConfig, start):
        self.config, self._start = config, start
        self.child: CompileChild | None = None
        self.num_kv_blocks: int | None = None

    def __call__(self, model: nn.Module, device: torch.device, dtype: torch.dtype, max_model_len: int) -> None:
        from server.engine.build import plan_num_kv_blocks

        self.num_kv_blocks = plan_num_kv_blocks(model, self.config, device, dtype, max_model_len)
        if compiles_decode(self.config, device) or self.config.compilation.compile_prefill:
            spec = child_spec(model, self.config, device, dtype, max_model_len, self.num_kv_blocks)
            self.child = self._start(spec, None)


def child_spec(model: nn.Module, config: EngineConfig, device: torch.device, dtype: torch.dtype, max_model_len: int,
               num_kv_blocks: int) -> dict | None:
    """What the child needs to build the twin of the engine these make, all of it part of its stages' cache
    key."""
    hf_config = getattr(model, "hf_config", None)
    if hf_config is None or config.parallel.tensor_parallel > 1 or config.parallel.pipeline_parallel > 1:
        return None
    return {"hf_config": hf_config, "config": dataclasses.asdict(config), "device": str(device),
            "dtype": str(dtype).removeprefix("torch."), "max_model_len": max_model_len,
            "num_kv_blocks": num_kv_blocks, "fp8": has_fp8_linears(model),
            "affine_layout": getattr(model, "affine_layout", None),
            "num_threads": torch.get_num_threads(), "torch_version": torch.__version__,
            "source": source_fingerprint()}


def source_fingerprint() -> str:
    """The sources of mps-serve (names, sizes, modification times): other code may trace other graphs."""
    root = Path(__file__).resolve().parents[1]
    entries = sorted(f"{p.relative_to(root)}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in root.rglob("*.py"))
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()[:16]


def saved_steps_dir(spec: dict) -> Path:
    """Where the compiled steps of the engine `spec` describes are saved whole (compile.saved), keyed as the
    child's markers are and on the device's name too: dynamo's guards do not check which GPU it is."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir  # private: where torch keeps its caches

    device = torch.device(spec["device"])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return Path(cache_dir()) / "mps-serve-saved" / _engine_key(spec, name)


def _engine_key(spec: dict, what) -> str:
    """A key of the engine `spec` describes and `what`; the KV memory settings are not in it: what they do to the
    graphs is the block count's, which is."""
    engine = {k: v for k, v in spec.items() if k not in ("stages", "save_steps")}
    cache = {k: v for k, v in spec["config"]["cache"].items() if not k.startswith("kv_cache_memory_")}
    engine["config"] = {**spec["config"], "cache": cache}
    return hashlib.sha256(json.dumps([engine, what], sort_keys=True).encode()).hexdigest()[:32]


def filled_marker(spec: dict, what: str) -> Path:
    """The file a child leaves in inductor's cache directory once it filled stage `what` of the engine `spec`
    describes (whichever stages it was asked for)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir  # private: where torch keeps its caches

    return Path(cache_dir()) / "mps-serve-filled" / _engine_key(spec, what)

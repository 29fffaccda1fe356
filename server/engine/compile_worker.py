"""The compile child (`python -m server.engine.compile_worker`, started by `start_compile_child`; compile_child
has the serving side and the protocol). It builds the serving engine's twin, every parameter, buffer and cache a
FakeTensor of the real shape, dtype and device (no weight or KV memory), and runs the warm-up stages: each graph
goes to inductor, which writes its caches, and then runs as FX code on the fakes (compiled kernels would read data
the fakes do not have). The serving process then compiles each stage as a cache hit."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch import nn

from server.config import EngineConfig
from server.engine.compile_child import CompileChild
from server.engine.warmup import HOST_READING_STAGES
from server.kernels import compat
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
    return CompileChild.start(spec, [sys.executable, "-m", __name__], env, log_path, count_cache_misses)


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
        from server.engine.build import compiles_decode, plan_num_kv_blocks

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
            "num_threads": torch.get_num_threads(), "torch_version": torch.__version__,
            "source": source_fingerprint()}


def source_fingerprint() -> str:
    """The sources of mps-serve (names, sizes, modification times): other code may trace other graphs."""
    root = Path(__file__).resolve().parents[1]
    entries = sorted(f"{p.relative_to(root)}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in root.rglob("*.py"))
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()[:16]


def saved_steps_dir(spec: dict) -> Path:
    """Where the compiled steps of the engine `spec` describes are saved whole (saved_compile), keyed as the
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


# ---- the child --------------------------------------------------------------------------------------------------
def main() -> int:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed goes to the log, not into the protocol
    spec = json.loads(sys.stdin.readline())
    wanted: dict[str, set[str]] = {}  # "stages": those the serving process runs, once it says so
    threading.Thread(target=_read_parent, args=(wanted,), daemon=True).start()
    with contextlib.suppress(OSError):
        os.nice(10)  # the serving process's steps come first
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def say(**message) -> None:
        protocol.write(json.dumps(message) + "\n")

    try:
        names, stages = twin_stages(spec)
    except Exception as exc:  # noqa: BLE001 - the serving process compiles instead
        log.exception("building the engine's twin failed")
        say(failed=f"{type(exc).__name__}: {exc}"[:300])
        return 1
    say(stages=[what for what, _ in stages])
    write_marker(spec, STAGE_LIST, names)
    for what, run in stages:  # none where a child before us filled them all
        if "stages" in wanted and what not in wanted["stages"]:
            continue  # the serving process does not run it
        start = time.perf_counter()
        try:
            run()
        except Exception as exc:  # noqa: BLE001 - this stage is the serving process's to compile
            log.exception("compiling %s failed", what)
            say(stage=what, ok=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
            continue
        write_marker(spec, what, [spec, what])
        say(stage=what, ok=True, seconds=round(time.perf_counter() - start, 1))
    return 0


def write_marker(spec: dict, what: str, content) -> None:
    marker = filled_marker(spec, what)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps(content, sort_keys=True))


def _read_parent(wanted: dict[str, set[str]]) -> None:
    """The serving process keeps our stdin open, and may name the stages it runs there (a child started before
    the engine existed fills all it can until then); when it ends (or ends us), so do we."""
    for line in sys.stdin:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            wanted["stages"] = set(json.loads(line)["stages"])
    os._exit(0)


def twin_stages(spec: dict) -> tuple[list[str], list]:
    """The names of all warm-up stages of the engine `spec` describes, and those of them `spec` names, on
    fakes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from server.engine.build import build_parts
    from server.engine.engine import Engine
    from server.kernels import flex_decode
    from server.kernels.capabilities import capabilities

    device, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
    config = EngineConfig(**spec["config"])
    torch.set_num_threads(spec["num_threads"])  # CPU kernels are generated for the thread count
    # As build_parts sets it in the serving process, but before the probes here: their compiles share its cache too.
    compat.tune_generated_kernels(device, spec["fp8"])
    # The probes run for real and first (cached per process): on fakes they would fail and pick other forms.
    capabilities(device)
    if device.type == "cuda":
        flex_decode.probe_compiled(str(device), dtype, config.cache.block_size)
    fill_caches_on_compile()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = fake_model(spec["hf_config"], device, dtype, fake_mode, spec["fp8"])
    with fake_mode:
        parts = build_parts(model, config, device, dtype, spec["max_model_len"], lambda _: spec["num_kv_blocks"])
        engine = Engine(model, None, config, device, dtype, spec["max_model_len"], config.load.model, parts)
        stages = engine._warm_up_stages(engine.runner, beside_serving=True)
    graphs = engine.runner.decode_graphs
    if graphs is not None:
        graphs.use_graphs = False  # compile what the server captures, without a capture (no real tensors here)
        if spec.get("save_steps"):  # the serving process loads the decode step from there
            graphs.compiled.save_to(saved_steps_dir(spec), save_only=True)
    names = [what for what, _ in stages]
    wanted = spec["stages"] if spec["stages"] is not None else stages_to_fill(spec, names)
    return names, [(what, _under(fake_mode, run)) for what, run in stages if what in wanted]


def _under(mode, run):
    def run_under_mode() -> None:
        with mode:
            run()

    return run_under_mode


def fill_caches_on_compile() -> None:
    """Every torch.compile from now on hands its graphs to inductor (or the inductor-based backend it names), which
    writes its caches, and runs them as FX code: the compiled kernels would read the fakes' (absent) data."""
    from torch._inductor.compile_fx import compile_fx

    compile_ = torch.compile

    def compile_filling(fn=None, *, options=None, backend=None, **kwargs):
        def fill(graph_module, example_inputs):
            if backend is None:
                compile_fx(graph_module, example_inputs, config_patches=options)
            else:
                backend(graph_module, example_inputs)
            return graph_module.forward

        return compile_(fn, backend=fill, **kwargs)

    torch.compile = compile_filling


def fake_model(hf_config: dict, device: torch.device, dtype: torch.dtype, fake_mode, fp8: bool):
    """The model on the meta device (in its FP8 form with `fp8`), each parameter and buffer then a FakeTensor of
    its shape, stride and dtype on `device`; tied weights stay one tensor."""
    from server.engine.weights import empty_model

    model = empty_model(hf_config, "meta", dtype, "fp8" if fp8 else None)
    fakes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(meta) -> (meta, kept alive: ids stay unique; fake)
    with fake_mode:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, meta in table.items():
                    if meta is None:
                        continue
                    if id(meta) not in fakes:
                        fake = torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype, device=device)
                        if isinstance(meta, nn.Parameter):
                            fake = nn.Parameter(fake, requires_grad=meta.requires_grad)
                        fakes[id(meta)] = (meta, fake)
                    table[name] = fakes[id(meta)][1]
    return model


if __name__ == "__main__":
    sys.exit(main())

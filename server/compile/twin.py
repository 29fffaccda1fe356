"""The compile child's side (`python -m server.compile.twin`, started by worker.start_compile_child): it builds
the serving engine's twin, every parameter, buffer and cache a FakeTensor of the real shape, dtype and device (no
weight or KV memory), and runs the warm-up stages: each graph goes to inductor, which writes its caches, and then
runs as FX code on the fakes (compiled kernels would read data the fakes do not have). The serving process then
compiles each stage as a cache hit."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time

import torch
from torch import nn

from server.compile.steps import build_steps
from server.compile.worker import STAGE_LIST, filled_marker, saved_steps_dir, stages_to_fill
from server.config import EngineConfig
from server.engine.build import build_parts
from server.kernels import compat

log = logging.getLogger(__name__)


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

    from server.kernels import flex_probe
    from server.kernels.capabilities import capabilities

    device, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
    config = EngineConfig(**spec["config"])
    torch.set_num_threads(spec["num_threads"])  # CPU kernels are generated for the thread count
    # As build_parts sets it in the serving process, but before the probes here: their compiles share its cache too.
    compat.tune_generated_kernels(device, spec["fp8"])
    # The probes run for real and first (cached per process): on fakes they would fail and pick other forms.
    capabilities(device)
    if device.type == "cuda":
        flex_probe.probe_compiled(str(device), dtype, config.cache.block_size)
    fill_caches_on_compile()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = fake_model(spec["hf_config"], device, dtype, fake_mode, spec["fp8"], spec.get("affine_layout"))
    with fake_mode:
        parts = build_parts(model, config, device, dtype, spec["max_model_len"], lambda _: spec["num_kv_blocks"])
        steps = build_steps(model, config, parts, device, dtype, spec["max_model_len"], serving=False)
        stages = steps.warm_up_stages(beside_serving=True)
    graphs = steps.compiled.decode_graphs
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


def fake_model(hf_config: dict, device: torch.device, dtype: torch.dtype, fake_mode, fp8: bool,
               affine_layout: dict | None = None):
    """The model on the meta device (in its FP8 form with `fp8`, its affine-quantized form with `affine_layout`:
    models.affine_quant.swap_to_affine's record), each parameter and buffer then a FakeTensor of its shape, stride
    and dtype on `device`; tied weights stay one tensor."""
    from server.engine.weights import empty_model
    from server.models.affine_quant import layout_spec

    affine_spec = None if affine_layout is None else (lambda _: layout_spec(affine_layout))
    model = empty_model(hf_config, "meta", dtype, "fp8" if fp8 else None, affine_spec=affine_spec)
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

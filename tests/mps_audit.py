"""The MPS audit's machinery (tests/kernels/test_mps_audit.py, tools/mps_ops/record_plan.py): engines built with the
step plans of MPS (torch 2.15's capabilities, read from server/kernels/mps_ops.json) serve tiny checkpoints of
every architecture and precision on the CPU under `OpRecorder`, which notes every aten op and its tensors' dtypes;
`post_grad_ops` takes the compiled decode step's graph as inductor would hand it to its Metal backend.
"""

from __future__ import annotations

import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from server.kernels.mps_ops import MPS_CHOICES, MpsTable, mps_table, op_name, ops_not_on_mps
from tests.helpers import ENGINE_KW, build_tiny, build_tiny_hybrid

ARCHS = ["llama", "qwen3", "qwen3_moe", "lfm2", "lfm2_moe", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"]
# bf16 weights, FP8 quantized at load, int4 affine quantized at load, an MLX int8 checkpoint loaded as stored
PRECISIONS = ["bf16", "fp8", "int4", "mlx-int8"]
Ops = dict[str, set[tuple[str, ...]]]


class OpRecorder(TorchDispatchMode):
    """ops: 'aten::name.overload' -> the (sorted) dtype tuples of its tensor arguments and results. An op the
    table says decomposes above the backend (CompositeImplicitAutograd) is run through its decomposition under the
    recorder, so its parts are recorded too; one whose decomposition picks a backend's op (MPS_CHOICES) is recorded
    as itself, since on the CPU it would pick the CPU's. A CompositeExplicitAutograd op (e.g. _to_copy) is recorded
    as itself: its kernel calls its parts below the recorder."""

    def __init__(self, table: MpsTable):
        super().__init__()
        self.table = table
        self.ops: Ops = defaultdict(set)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = NotImplemented
        if self.table.kind(func.name()) == "composite_implicit" and op_name(func.name()) not in MPS_CHOICES:
            with self:
                out = func.decompose(*args, **kwargs)
        if out is NotImplemented:
            out = func(*args, **kwargs)
        tensors = [leaf for leaf in tree_leaves((args, kwargs, out)) if isinstance(leaf, torch.Tensor)]
        self.ops[func.name()].add(tuple(sorted({str(t.dtype).removeprefix("torch.") for t in tensors})))
        return out


def merge(into: Ops, ops: Ops) -> None:
    for name, dtype_sets in ops.items():
        into.setdefault(name, set()).update(dtype_sets)


def checkpoint(arch: str, precision: str, root: Path) -> tuple[Path, str | None]:
    """(checkpoint dir, quantization) of a tiny random `arch` in `precision`, written under `root`."""
    src = root / arch
    if not src.exists():
        (build_tiny if arch in ("llama", "qwen3", "qwen3_moe") else build_tiny_hybrid)(arch, src)
    if precision.startswith("mlx-"):
        from server.quantize_cli import quantize_checkpoint

        dst = root / f"{arch}-{precision}"
        if not dst.exists():
            quantize_checkpoint(str(src), str(dst), bits=int(precision.removeprefix("mlx-int")), group_size=32)
        return dst, None
    return src, None if precision == "bf16" else precision


def mps_engine(path: Path, quantization: str | None):
    """An engine on the CPU whose steps run the plans of MPS with torch 2.15 (bf16, MPS's default dtype)."""
    from server.config import EngineConfig
    from server.engine.engine import Engine
    from server.kernels.mps_ops import table_capabilities

    config = EngineConfig.from_flat(model=str(path), quantization=quantization, **dict(ENGINE_KW, dtype="bfloat16"))
    return Engine.from_config(config, plan_as=table_capabilities())


def record_serving(arch: str, precision: str, root: Path) -> Ops:
    """Every op of loading `arch` in `precision` and serving two requests: prefill chunks (prompts longer than the
    step's token budget), eager decode steps, greedy sampling and sampling with every filter, penalties and
    logprobs."""
    from server.engine.types import SamplingParams
    from server.kernels.capabilities import capabilities

    path, quantization = checkpoint(arch, precision, root)
    capabilities("cpu")  # the CPU's own probe runs now, outside the recording
    recorder = OpRecorder(mps_table())
    with recorder:
        engine = mps_engine(path, quantization)
        engine.generate(list(range(3, 40)), SamplingParams(max_tokens=4, temperature=0.0))
        engine.generate(list(range(5, 30)), SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, top_k=20, min_p=0.01,
                                                           seed=1, repetition_penalty=1.1, presence_penalty=0.2,
                                                           frequency_penalty=0.1, logit_bias={7: 2.0}, logprobs=2))
    failures = capabilities("cpu").runtime_failures
    assert not failures, f"a fast path failed on the CPU, so its reference's ops were recorded instead: {failures}"
    return recorder.ops


def record_all(root: Path | None = None) -> Ops:
    """The union over every architecture and precision (tools/mps_ops/record_plan.py)."""
    ops: Ops = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ARCHS:
            for precision in PRECISIONS:
                merge(ops, record_serving(arch, precision, root or Path(tmp)))
    return ops


class _Captured(Exception):
    pass


def post_grad_graph(fn, *args) -> torch.fx.Graph:
    """The graph inductor lowers for `fn(*args)` compiled whole (fullgraph): after its decompositions and post-grad
    passes, where each node becomes a generated kernel or a call of an aten kernel. Captured and stopped there:
    no code is generated or built."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    graphs: list[torch.fx.Graph] = []

    def keep(graph: torch.fx.Graph) -> None:
        graphs.append(graph)
        raise _Captured

    def backend(gm, example_inputs):
        try:
            with inductor_config.patch(post_grad_custom_post_pass=keep, fx_graph_cache=False):
                compile_fx(gm, example_inputs)
        except Exception:
            if not graphs:
                raise
        return gm.forward

    torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*args)
    assert len(graphs) == 1, f"expected one graph, got {len(graphs)}"
    return graphs[0]


# What inductor calls as aten kernels on MPS rather than generating Metal for: matmuls (no Metal templates), scans
# and sorts (no Metal codegen for them), beside the ops it has no lowering for or lowers as fallbacks.
ATEN_KERNEL_ON_MPS = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm", "_scaled_mm_v2", "_int_mm",
                      "_scaled_grouped_mm", "_scaled_grouped_mm_v2", "convolution", "sort", "sort.stable", "topk",
                      "cumsum", "cumprod", "searchsorted.Tensor", "_weight_int4pack_mm"}


def lowered_by_metal(node: torch.fx.Node) -> bool:
    """Whether inductor generates this node's code (a Metal kernel on MPS), else it calls the aten kernel."""
    from torch._inductor import lowering

    target = node.target
    if op_name(target.name()) in ATEN_KERNEL_ON_MPS:
        return False
    return target in lowering.lowerings and target not in lowering.fallbacks


def node_dtypes(node: torch.fx.Node) -> tuple[str, ...]:
    values = [node.meta.get("val")] + [arg.meta.get("val") for arg in node.all_input_nodes]
    return tuple(sorted({str(v.dtype).removeprefix("torch.") for v in tree_leaves(values) if isinstance(v, torch.Tensor)}))


def metal_audit(graph: torch.fx.Graph, table: MpsTable) -> tuple[dict[str, str], dict[str, str]]:
    """-> ({op: 'metal' | 'aten kernel'}, {op: why MPS cannot run it}) for every aten op of a post-grad graph: a
    generated kernel needs Metal types for its dtypes; an aten kernel needs an MPS kernel for its dtypes."""
    how, problems = {}, {}
    metal_dtypes = set(table.metal["dtypes"])
    for node in graph.nodes:
        # a view is no kernel: what reads it is checked, with the view's dtype among its inputs'
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload) or node.target.is_view:
            continue
        name, dtypes = node.target.name(), node_dtypes(node)
        if lowered_by_metal(node):
            how[name] = "metal"
            missing = sorted(set(dtypes) - metal_dtypes)
            if missing:
                problems[name] = f"inductor's Metal code generator has no type for {', '.join(missing)}"
        else:
            how[name] = "aten kernel"
            problem = ops_not_on_mps({name: {dtypes}}, table).get(name)
            if problem:
                problems[name] = problem
    return how, problems

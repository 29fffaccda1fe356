"""One model over two processes (Gloo on the CPU): tensor and pipeline parallel give the single-process engine's
greedy tokens and logits; a rank that dies ends the other with a clear error; each rank loads only its shard."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from server.engine.types import ModelLoadError, SamplingParams, StructuredOutput
from server.engine.weights import load_model
from server.models.parallel import PIPELINE, TENSOR, Layout, kv_head_range, locate, stage_range
from tests.helpers import make_engine, write_blockwise_fp8_checkpoint

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 9, 200, 31, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 99], [42, 17, 3]]
NUM_NEW = 6


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_ranks(spec: dict, tmp_path: Path) -> list[subprocess.Popen]:
    """Two ranks of tests/engine/dist_worker.py, with the variables torchrun would set."""
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1"}
    return [subprocess.Popen([sys.executable, "-m", "tests.engine.dist_worker", str(spec_path)], cwd=ROOT,
                             env={**env, "RANK": str(rank)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for rank in (0, 1)]


def run_ranks(kind: str, models: list[Path | str], tmp_path: Path, **extra) -> list[dict]:
    out = tmp_path / "results.pt"
    spec = {"kind": kind, "models": [str(m) for m in models], "prompts": PROMPTS, "num_new": NUM_NEW,
            "out": str(out), **extra}
    ranks = start_ranks(spec, tmp_path)
    errors = [proc.communicate(timeout=120)[1] for proc in ranks]
    failed = [f"rank {rank} failed:\n{err[-3000:]}" for rank, (proc, err) in enumerate(zip(ranks, errors, strict=True))
              if proc.returncode != 0]
    assert not failed, "\n".join(failed)  # every rank's error: the first to die is often not rank 0
    return torch.load(out)


def assert_matches_one_process(models: list[Path], results: list[dict]) -> None:
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    for path, result in zip(models, results, strict=True):
        engine = make_engine(path)
        assert result["tokens"] == [out.token_ids for out in engine.generate(PROMPTS, params)], path
        expected = engine.score(PROMPTS[0])
        assert result["logits"].shape == expected.shape == (len(PROMPTS[0]), 256)
        torch.testing.assert_close(result["logits"], expected, atol=1e-4, rtol=1e-4, msg=str(path))


def test_tensor_parallel_matches_one_process(tiny_checkpoint, hybrid_checkpoint, tmp_path):
    """llama, qwen3_moe (softmax experts, a dense layer) and the Qwen3-Next hybrid (Gated DeltaNet, gated
    attention, shared expert)."""
    models = [tiny_checkpoint("llama")[0], tiny_checkpoint("qwen3_moe")[0], hybrid_checkpoint("qwen3_next")[0]]
    assert_matches_one_process(models, run_ranks(TENSOR, models, tmp_path))


def test_pipeline_parallel_matches_one_process(tiny_checkpoint, hybrid_checkpoint, tmp_path):
    """qwen3_moe, Qwen3-Next (its stage 0 holds no attention layer, so no KV cache) and LFM2-MoE, whose LM head
    is its embedding: both on rank 0."""
    models = [tiny_checkpoint("qwen3_moe")[0], hybrid_checkpoint("qwen3_next")[0], hybrid_checkpoint("lfm2_moe")[0]]
    assert_matches_one_process(models, run_ranks(PIPELINE, models, tmp_path))


def test_a_constrained_request_under_tensor_parallel_matches_one_process(tmp_path):
    """The demo model (it has a tokenizer) at TP 2: a JSON-schema row beside a free one gives the single-process
    engine's tokens for both, and the constraint changed the constrained row's tokens."""
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]}
    [result] = run_ranks(TENSOR, ["demo"], tmp_path, schema=schema)
    engine = make_engine("demo")
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    constrained = replace(params, structured=StructuredOutput.from_json_schema(schema))
    expected = engine.run_to_completion([engine.inputs.make_request(PROMPTS[0], constrained),
                                         engine.inputs.make_request(PROMPTS[1], params)])
    assert result["constrained"] == [out.token_ids for out in expected]
    assert result["constrained"][0] != result["tokens"][0] and result["constrained"][1] == result["tokens"][1]


@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_that_dies_ends_the_other_with_a_clear_error(victim, tiny_checkpoint, tmp_path):
    spec = {"kind": TENSOR, "models": [str(tiny_checkpoint("llama")[0])], "prompts": PROMPTS, "num_new": NUM_NEW,
            "out": str(tmp_path / "unused.pt"), "forever": True}
    ranks = start_ranks(spec, tmp_path)
    try:
        assert ranks[0].stdout.readline().strip() == "stepping"
        ranks[victim].send_signal(signal.SIGKILL)
        survivor = ranks[1 - victim]
        start = time.monotonic()
        _, stderr = survivor.communicate(timeout=60)
        assert time.monotonic() - start < 30
        assert survivor.returncode == 1
        assert f"rank {1 - victim} lost contact with the other ranks" in stderr
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_each_tensor_parallel_rank_holds_its_slice_of_every_weight(arch, tiny_checkpoint, hybrid_checkpoint):
    """Read from the checkpoint shard by shard, each rank's tensors are exactly the slices its plan names of the
    whole model's fused tensors (which the bench's random models slice the same way)."""
    path = tiny_checkpoint(arch)[0] if arch == "qwen3_moe" else hybrid_checkpoint(arch)[0]
    cpu = torch.device("cpu")
    whole = load_model(path, cpu, torch.float32)[0].state_dict()
    num_sliced = 0
    for rank in (0, 1):
        part, _ = load_model(path, cpu, torch.float32, layout=Layout(TENSOR, rank, 2))
        for name, tensor in part.state_dict().items():
            _, shard = locate(part, name)
            expected = whole[name] if shard is None else shard.take(whole[name])
            num_sliced += shard is not None
            torch.testing.assert_close(tensor, expected, atol=0, rtol=0, msg=name)
    assert num_sliced > 10


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_fp8_ranks_quantize_their_own_slices(arch, tiny_checkpoint, hybrid_checkpoint):
    """Each rank's FP8 weights times their row scales are its slices of the unquantized weights, to FP8
    precision: column-parallel rows keep their own scales, row-parallel slices get scales of their own."""
    path = tiny_checkpoint(arch)[0] if arch == "qwen3_moe" else hybrid_checkpoint(arch)[0]
    assert_fp8_ranks_hold_slices(path, load_model(path, torch.device("cpu"), torch.float32)[0].state_dict())


def test_blockwise_fp8_checkpoint_shards_on_its_blocks(tiny_checkpoint, tmp_path):
    """A Hugging Face block-wise FP8 checkpoint: each rank reads its weights' slices and their scale blocks."""
    src = tiny_checkpoint("llama")[0]
    path = write_blockwise_fp8_checkpoint(src, tmp_path / "fp8-16", 16)  # TP 2 shards: 16-row multiples
    assert_fp8_ranks_hold_slices(path, load_model(src, torch.device("cpu"), torch.float32)[0].state_dict())
    unaligned = write_blockwise_fp8_checkpoint(src, tmp_path / "fp8-32", 32)  # 16 rows of k_proj per rank
    with pytest.raises(ModelLoadError, match="does not fall on FP8 blocks of 32"):
        load_model(unaligned, torch.device("cpu"), torch.float32, layout=Layout(TENSOR, 0, 2))


def assert_fp8_ranks_hold_slices(path: Path, whole: dict[str, torch.Tensor]) -> None:
    scale_names = {"weight": "weight_scale", "gate_up_proj": "gate_up_scale", "down_proj": "down_scale"}
    for rank in (0, 1):
        part, _ = load_model(path, torch.device("cpu"), torch.float32, "fp8", Layout(TENSOR, rank, 2))
        state = part.state_dict()
        fp8_names = [name for name, t in state.items() if t.dtype == torch.float8_e4m3fn]
        assert len(fp8_names) > 5
        for name in fp8_names:
            module, _, leaf = name.rpartition(".")
            scale = state[f"{module}.{scale_names[leaf]}"]
            value = state[name].float() * (scale if scale.dim() == state[name].dim() else scale[..., None])
            _, shard = locate(part, name)
            expected = whole[name] if shard is None else shard.take(whole[name])
            assert float((value - expected).abs().max() / expected.abs().max()) < 0.07, name  # e4m3: 3 mantissa bits


def test_pipeline_stages_hold_contiguous_layer_ranges(hybrid_checkpoint):
    assert [stage_range(48, Layout(PIPELINE, r, 2)) for r in range(2)] == [(0, 24), (24, 48)]
    assert [stage_range(10, Layout(PIPELINE, r, 4)) for r in range(4)] == [(0, 2), (2, 4), (4, 7), (7, 10)]
    path = hybrid_checkpoint("qwen3_next")[0]  # layers: 3 Gated DeltaNet, then attention
    stages = [load_model(path, torch.device("cpu"), torch.float32, layout=Layout(PIPELINE, r, 2))[0] for r in (0, 1)]
    assert [s.kv_cache_shapes() for s in stages] == [[], [(2, 32)]]
    assert [len(s.state_shapes()) for s in stages] == [2, 1]
    assert "lm_head.weight" in stages[0].state_dict() and "lm_head.weight" not in stages[1].state_dict()


def test_kv_heads_split_or_replicate():
    assert [kv_head_range(8, Layout(TENSOR, r, 2)) for r in range(2)] == [(0, 4), (4, 8)]
    assert [kv_head_range(2, Layout(TENSOR, r, 8)) for r in range(8)] == [(0, 1)] * 4 + [(1, 2)] * 4
    with pytest.raises(ValueError, match="neither divides nor is a multiple"):
        kv_head_range(6, Layout(TENSOR, 0, 4))


def test_parallel_flags_without_a_launcher_say_how_to_start(tiny_checkpoint, capsys, monkeypatch):
    from server.cli import main

    monkeypatch.delenv("RANK", raising=False)
    code = main(["generate", str(tiny_checkpoint("llama")[0]), "--prompt", "hi", "--tensor-parallel", "2"])
    assert code == 2
    assert "torchrun --nproc-per-node 2 -m server generate" in capsys.readouterr().err

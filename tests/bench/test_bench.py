"""`mps-serve bench` on the CPU: the records, the byte counts, the exact weight transfer to transformers, presets.

Speed is never asserted; numbers are checked for being measured (positive, finite) and bytes against
independent counts.
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from server.bench import measure, presets, run
from server.bench.peer import build_peer_from_preset
from server.bench.random_model import build_random_model, empty_model, init_value
from server.cli import main
from server.config import EngineConfig
from server.engine.engine import Engine
from server.engine.types import SamplingParams
from server.engine.weights import read_config

REQUIRED = ["preset", "device", "dtype", "quantize", "batch_size", "prompt_len", "decode_tok_s", "prefill_tok_s",
            "ms_per_token", "weight_bytes_per_token", "achieved_gb_s", "copy_gb_s", "roofline_fraction", "compile_s",
            "torch_version", "gpu_name", "peer_decode_tok_s", "speedup_vs_peer", "kernels_per_step",
            "kernels_counted_by", "kernel_ms_per_step", "cuda_graphs", "kernel_launch"]
POSITIVE = ["decode_tok_s", "prefill_tok_s", "ms_per_token", "achieved_gb_s", "copy_gb_s", "roofline_fraction",
            "peer_decode_tok_s", "peer_prefill_tok_s", "speedup_vs_peer", "weight_bytes_per_token", "kernels_per_step"]


def expected_bytes_per_token(c: dict, itemsize: int) -> int:
    """Independent count from the config: what one decoded token reads (embedding table excluded)."""
    hidden, head_dim = c["hidden_size"], c["head_dim"]
    attention = hidden * head_dim * (2 * c["num_attention_heads"] + 2 * c["num_key_value_heads"])
    norms = 2 * hidden + 2 * head_dim  # input/post-attention norms, q/k norms
    dense_mlp = 3 * hidden * c["intermediate_size"]
    routed = hidden * c["num_experts"] + c["num_experts_per_tok"] * 3 * hidden * c["moe_intermediate_size"]
    layers = sum(attention + norms + (dense_mlp if i in c["mlp_only_layers"] else routed)
                 for i in range(c["num_hidden_layers"]))
    return (layers + hidden + c["vocab_size"] * hidden) * itemsize  # + final norm + LM head


def test_bench_tiny_moe_with_transformers_peer(tmp_path, capsys):
    out = tmp_path / "bench.jsonl"
    code = main(["bench", "--preset", "tiny-moe", "--batch-sizes", "1,2", "--decode-tokens", "8", "--prompt-len",
                 "16", "--json", str(out), "--compare", "transformers", "--device", "cpu", "--reps", "1",
                 "--copy-mib", "8", "--quantize", "none,fp8", "--engine-option", "compile_prefill=false"])
    assert code == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["quantize"], r["batch_size"]) for r in records] == [("none", 1), ("none", 2), ("fp8", 1), ("fp8", 2)]
    records, fp8 = records[:2], records[2:]
    config = presets.load_preset("tiny-moe").hf_config
    for r, q in zip(records, fp8, strict=True):  # one peer, measured once, beside both
        assert q["peer_decode_tok_s"] == r["peer_decode_tok_s"] and q["peer_achieved_gb_s"] == r["peer_achieved_gb_s"]
        assert q["weight_bytes_per_step"] < 0.5 * r["weight_bytes_per_step"]  # fp32 experts -> fp8
        assert q["speedup_vs_peer"] == pytest.approx(q["decode_tok_s"] / q["peer_decode_tok_s"])
    for r in records:
        assert not [k for k in REQUIRED if k not in r]
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in POSITIVE), {k: r[k] for k in POSITIVE}
        assert r["compile_s"] >= 0 and r["dtype"] == "float32" and r["device"] == "cpu"
        startup = r["startup_s"]  # a server's start-up: build, then the first call with its compile
        assert startup["build"] == r["build_s"] > 0 and startup["first_call"] == r["first_call_s"] > 0
        assert startup["compile"] == r["compile_s"] and startup["compile_cache"] == r["compile_cache"] in ("cold", "warm")
        assert r["engine_options"] == {"compile_prefill": False}  # recorded, so A/B lines tell themselves apart
        assert r["weight_bytes_per_token"] == expected_bytes_per_token(config, 4)
        assert r["speedup_vs_peer"] == pytest.approx(r["decode_tok_s"] / r["peer_decode_tok_s"])
        assert r["roofline_fraction"] == pytest.approx(r["achieved_gb_s"] / r["copy_gb_s"])
        # Same random weights in both: greedy tokens agree exactly (fp32), which proves the transfer is exact.
        assert len(r["sample_token_ids"]) == 9
        assert r["peer_sample_token_ids"] == r["sample_token_ids"]
    # MoE at batch 2 reads more distinct experts per step than at batch 1.
    one, two = records
    assert two["weight_bytes_per_step"] > one["weight_bytes_per_step"] == one["weight_bytes_per_token"]
    table = capsys.readouterr().out
    assert "decode tok/s" in table and "speedup" in table and "quantize=none,fp8" in table


def test_bench_int8_and_int4_report_bits_per_weight_and_packed_bytes(tmp_path, capsys):
    """--quantize none,int8,int4: each side's bits per weight and the bytes a token reads, counted from the packed
    tensors (packed words + scales + biases; the untied embedding only for the looked-up rows)."""
    out = tmp_path / "bench.jsonl"
    assert main(["bench", "--preset", "tiny-moe", "--batch-sizes", "1", "--decode-tokens", "4", "--prompt-len", "8",
                 "--json", str(out), "--device", "cpu", "--reps", "1", "--copy-mib", "8", "--quantize", "none,int8,int4",
                 "--engine-option", "compile_prefill=false"]) == 0
    none, int8, int4 = (json.loads(line) for line in out.read_text().splitlines())
    assert none["bits_per_weight"] == 32.0  # float32 on the CPU
    assert none["bits_per_weight"] > int8["bits_per_weight"] > int4["bits_per_weight"]
    assert none["weight_bytes_per_token"] > int8["weight_bytes_per_token"] > int4["weight_bytes_per_token"]
    for r in (int8, int4):
        assert r["roofline_fraction"] == pytest.approx(r["achieved_gb_s"] / r["copy_gb_s"])
        assert r["weight_bytes_per_token"] < r["weight_bytes_total"]
    table = capsys.readouterr().out
    assert "bits/w" in table and f"{int4['bits_per_weight']:.2f}" in table


def test_bench_measures_both_graph_modes_side_by_side(tmp_path, capsys):
    out = tmp_path / "bench.jsonl"
    assert main(["bench", "--preset", "tiny-moe", "--batch-sizes", "1,2", "--decode-tokens", "4", "--prompt-len", "8",
                 "--json", str(out), "--device", "cpu", "--reps", "1", "--copy-mib", "1", "--graphs", "on,off"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    asked = [(r["engine_config"]["cuda_graphs"], r["batch_size"]) for r in records]
    assert asked == [(True, 1), (True, 2), (False, 1), (False, 2)]
    assert not any(r["cuda_graphs"] for r in records)  # the CPU never replays CUDA graphs, whatever was asked
    for r in records:
        assert r["kernels_counted_by"] == "aten_ops"
        assert isinstance(r["kernels_per_step"], int) and r["kernels_per_step"] > 20  # 3 layers' ops, at least
        assert r["kernel_ms_per_step"] is None  # ATen ops on the CPU: no device time summed
        assert r["decode_tok_s"] > 0
    on, off = records[:2], records[2:]
    assert [r["kernels_per_step"] for r in on] == [r["kernels_per_step"] for r in off]  # the same eager engine
    table = capsys.readouterr().out
    assert "kernels/step" in table and "kernels/step counted as aten_ops" in table
    rows = [line.split() for line in table.splitlines() if line.split()[:1] in (["n/a"], ["off"])]
    modes = ["n/a", "n/a", "off", "off"]  # graphs asked for but none on the CPU, then turned off
    assert [(row[0], row[1], row[2], row[5], row[6]) for row in rows] == [
        (mode, "eager", str(r["batch_size"]), str(r["kernels_per_step"]), "-")
        for mode, r in zip(modes, records, strict=True)]
    assert all(r["kernel_launch"] == "eager" for r in records)  # the CPU compiles nothing by default


def test_graph_mode_options():
    from server.bench.options import options_from_args
    from server.cli import build_parser

    def parse(*flags):
        return options_from_args(build_parser().parse_args(["bench", "--preset", "tiny-moe", *flags]))

    assert parse().graphs == (None,)
    assert parse("--no-graphs").graphs == (False,) == parse("--graphs", "off").graphs
    assert parse("--graphs", "on,off").graphs == (True, False)
    assert parse("--graphs", "off,on,off").graphs == (False, True)
    config = run.engine_config(parse(), "none", False, run.resolve_target(parse()), torch.device("cpu"),
                               torch.float32, 2, 40)
    assert config.compilation.cuda_graphs is False


def _tiny_engine(num_layers: int) -> Engine:
    config = dict(presets.load_preset("tiny-moe").hf_config, num_hidden_layers=num_layers)
    cpu = torch.device("cpu")
    model = build_random_model(config, cpu, torch.float32, seed=0)
    return Engine.from_model(model, EngineConfig.from_flat(device="cpu", dtype="float32", kv_cache_memory_bytes=1 << 20),
                             cpu)


def _generate_kernels(engine: Engine, prompts: list[list[int]], num_new: int) -> int:
    params = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
    return measure.profile_kernels(lambda: engine.generate(prompts, params), torch.device("cpu")).num_kernels


def test_kernels_per_step_count_one_decode_step_and_grow_by_layer():
    """The count is one decode step's: what each extra step adds to a whole generate(), and each MoE layer adds
    the same ops."""
    cpu, prompts = torch.device("cpu"), [[3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5, 8, 9, 7]]
    counts = {}
    for num_layers in (3, 4, 5):  # layer 0 dense, the others MoE
        engine = _tiny_engine(num_layers)
        profile = run.decode_step_kernels(engine, prompts, cpu)
        assert profile.kernel_ms is None  # ATen ops on the CPU: no device time to sum
        counts[num_layers] = profile.num_kernels
        whole_run = {n: _generate_kernels(engine, prompts, n) for n in (6, 9)}
        assert whole_run[9] - whole_run[6] == 3 * counts[num_layers]
        assert not engine.has_unfinished
    assert counts[5] - counts[4] == counts[4] - counts[3] > 10  # a MoE layer: norms, attention, router, experts
    assert counts[3] > counts[5] - counts[3]  # plus the embedding, final norm, LM head and argmax


def test_aten_ops_leave_out_views_allocations_and_no_op_conversions():
    x = torch.randn(8, 8)

    def ops():
        torch.nn.functional.linear(x, x).relu()  # 2
        x.view(-1), x.t(), x.reshape(4, 16), x[1:3], x.to(torch.float32), torch.empty(3), x.contiguous()  # 0
        x.t().contiguous(), x.to(torch.float16), torch.zeros(2), x.sum()  # 4

    assert measure.profile_kernels(ops, torch.device("cpu")).num_kernels == 6


class _Trace:
    def __init__(self, events):
        self.events = events

    def export_chrome_trace(self, path):
        with open(path, "w") as handle:
            json.dump({"traceEvents": self.events}, handle)


def test_cuda_kernels_count_graph_replays_sum_kernel_time_and_refuse_untraced_ones():
    launch = {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "args": {"correlation": 7}}
    durations = [random.uniform(0.5, 20.0) for _ in range(4)]
    kernels = [{"ph": "X", "cat": "kernel", "name": f"k{i}", "dur": durations[i], "args": {"correlation": 7}}
               for i in range(3)]
    others = [{"ph": "X", "cat": "kernel", "name": "eager", "dur": durations[3], "args": {"correlation": 9}},
              {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "dur": 100.0, "args": {"correlation": 8}},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "dur": 50.0, "args": {"correlation": 9}},
              {"ph": "f", "cat": "ac2g", "name": "flow", "args": {"correlation": 7}}]
    profile = measure._cuda_kernels(_Trace([launch, *kernels, *others]))
    assert profile.num_kernels == 4
    assert profile.kernel_ms == pytest.approx(sum(durations) / 1e3)  # kernels only: no copy, no runtime call
    with pytest.raises(RuntimeError, match="no kernels of 1 CUDA graph replays"):
        measure._cuda_kernels(_Trace([launch, *others]))


@pytest.mark.parametrize("which", ["tiny-moe", "qwen3_5_moe_text"])
def test_transformers_gets_exactly_our_random_weights(which):
    """Qwen3.5-MoE: transformers' fused routed experts and its shared expert, which ours keeps as the experts'
    last slot."""
    config = presets.load_preset("tiny-moe").hf_config if which == "tiny-moe" else _tiny_hybrid_config(which)
    ours = build_random_model(config, torch.device("cpu"), torch.float32, seed=3)
    engine = Engine.from_model(ours, EngineConfig.from_flat(device="cpu", dtype="float32", kv_cache_memory_bytes=1 << 20,
                                                            max_num_batched_tokens=16), torch.device("cpu"))
    ids = torch.randint(0, config["vocab_size"], (37,), generator=torch.Generator().manual_seed(5)).tolist()
    logits = engine.score(ids)
    hf = build_peer_from_preset(config, torch.device("cpu"), torch.float32, seed=3)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert logits.shape == ref.shape == (37, config["vocab_size"])
    assert (logits - ref).abs().max().item() < 1e-4
    assert logits.std().item() > 1e-3  # not a degenerate (all-equal) model


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor  # fp8 has no equal on CPU


def _tiny_hybrid_config(arch: str) -> dict:
    from tests.helpers import tiny_hybrid_configs

    cfg_cls, _, kwargs = tiny_hybrid_configs()[arch]
    return cfg_cls(**kwargs).to_dict()


@pytest.mark.parametrize("which", ["tiny-moe", "qwen3_next"])
def test_fp8_random_build_equals_quantizing_the_bf16_build(which):
    """The bench builds FP8 presets tensor by tensor (an 80B model never exists in bf16); the weights must be
    exactly those of quantizing the unquantized random model afterwards."""
    from server.models.quant import quantize_model

    config = presets.load_preset("tiny-moe").hf_config if which == "tiny-moe" else _tiny_hybrid_config("qwen3_next")
    cpu = torch.device("cpu")
    direct = build_random_model(config, cpu, torch.bfloat16, seed=4, quantization="fp8")
    post_hoc = quantize_model(build_random_model(config, cpu, torch.bfloat16, seed=4))
    a, b = direct.state_dict(), post_hoc.state_dict()
    assert a.keys() == b.keys()
    assert any(t.dtype == torch.float8_e4m3fn for t in a.values())
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(_bits(a[name]), _bits(b[name])), name
    with pytest.raises(ValueError, match="unknown quantization"):
        build_random_model(config, cpu, torch.bfloat16, quantization="int3")


def test_random_weights_are_deterministic_and_never_zero():
    a = init_value("model.layers.0.mlp.down_proj.weight", (64, 32), torch.float32, torch.device("cpu"), seed=1)
    b = init_value("model.layers.0.mlp.down_proj.weight", (64, 32), torch.float32, torch.device("cpu"), seed=1)
    c = init_value("model.layers.1.mlp.down_proj.weight", (64, 32), torch.float32, torch.device("cpu"), seed=1)
    norm = init_value("model.layers.0.input_layernorm.weight", (4096,), torch.float32, torch.device("cpu"), seed=1)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.std().item() == pytest.approx(0.02, rel=0.2) and (a != 0).all()
    assert norm.mean().item() == pytest.approx(1.0, abs=0.01) and norm.std().item() == pytest.approx(0.02, rel=0.2)


@pytest.mark.parametrize("tied", [False, True])
def test_weight_bytes_count_the_lm_head_once_and_skip_the_embedding(tied):
    config = dict(presets.load_preset("tiny-moe").hf_config, tie_word_embeddings=tied)
    model = empty_model(config, "meta", torch.bfloat16)
    counted = measure.weight_bytes(model)
    assert counted.per_token == expected_bytes_per_token(config, 2)
    experts = 2 * 3 * config["hidden_size"] * config["moe_intermediate_size"] * config["num_experts"]
    assert counted.experts == experts * 2  # two MoE layers, 2 bytes per element
    assert counted.per_step(10**6) == pytest.approx(counted.dense + counted.experts, rel=1e-9)
    table = config["vocab_size"] * config["hidden_size"] * 2
    assert measure.total_weight_bytes(model) == counted.dense + counted.experts + (0 if tied else table)


# (total params, params read per token) in billions, from reference/models.md §3 (meta-device counts of HF 5.24).
REFERENCE_COUNTS = {  # models.md §3: total params and params read per token, billions
    "llama-3.1-8b": (8.03, 7.50), "qwen3-8b": (8.19, 7.57), "qwen3-30b-a3b": (30.53, 3.04),
    "lfm2-8b-a1b": (8.34, 1.56), "lfm2.5-8b-a1b": (8.47, 1.69), "qwen3.6-35b-a3b": (34.66, 2.95),
    "qwen3-next-80b-a3b": (79.67, 3.56),
}


@pytest.mark.parametrize("name", sorted(REFERENCE_COUNTS))
def test_real_presets_have_the_reference_parameter_counts(name):
    model = empty_model(presets.load_preset(name).hf_config, "meta", torch.bfloat16)
    total, per_token = REFERENCE_COUNTS[name]
    counted = measure.weight_bytes(model)
    assert measure.total_weight_bytes(model) / 2e9 == pytest.approx(total, abs=0.006)
    assert counted.per_token / 2e9 == pytest.approx(per_token, abs=0.006)


def _registered_presets() -> list[str]:
    from server.models.registry import MODEL_MODULES

    return [n for n in presets.available_presets() if presets.load_preset(n).hf_config["model_type"] in MODEL_MODULES]


def _normalized(args):
    rope = dict(args.rope_parameters)
    rope.setdefault("rope_type", "default")  # transformers spells out the default rope type
    args.rope_parameters = rope
    return args


@pytest.mark.parametrize("name", _registered_presets())
def test_preset_builds_the_same_model_args_as_its_config_json(name, tmp_path):
    import transformers

    hf_config = presets.load_preset(name).hf_config
    transformers.AutoConfig.for_model(**hf_config).to_json_file(tmp_path / "config.json")
    from_json = presets.model_args(read_config(tmp_path))
    assert _normalized(presets.model_args(hf_config)) == _normalized(from_json)


def test_bad_invocations_say_what_to_fix(tmp_path, capsys):
    assert main(["bench", "--preset", "no-such-model"]) == 2
    assert "available: " in capsys.readouterr().err
    assert main(["bench", "somedir", "--preset", "tiny-moe"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["bench", "--preset", "tiny-moe", "--device", "cpu", "--engine-option", "no_such=1",
                 "--copy-mib", "1"]) == 2
    assert "unknown EngineConfig fields ['no_such']" in capsys.readouterr().err
    assert main(["bench", "--preset", "tiny-moe", "--no-graphs", "--engine-option", "cuda_graphs=true"]) == 2
    assert "with --graphs or --no-graphs, not --engine-option cuda_graphs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--preset", "tiny-moe", "--graphs", "on,maybe"])
    assert "--graphs takes on, off or on,off, got 'on,maybe'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--preset", "tiny-moe", "--graphs", "on", "--no-graphs"])
    assert "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: usage error, exit 2
        main(["bench", "--preset", "tiny-moe", "--quantize", "none,int3"])
    assert "--quantize takes none, fp8, int8, int4 or a comma list of them, got 'none,int3'" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text('[model]\nmodel_type = "llama"\n[bench]\nprompt_length = 3\n')
    with pytest.raises(ValueError, match="unknown \\[bench\\] key 'prompt_length'"):
        presets.load_preset(str(bad))


BLOCK_SERVER_DEPS = """
import sys
BLOCKED = ("fastapi", "uvicorn", "pydantic", "prometheus_client", "openai", "starlette", "server.api")
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.startswith(BLOCKED):
            raise ImportError(f"{name} is blocked: the H200 machine does not have it")
sys.meta_path.insert(0, Block())
from server.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_bench_runs_without_the_server_dependencies(tmp_path):
    """The H200 has torch + transformers but no fastapi/uvicorn/pydantic/prometheus_client/openai."""
    import subprocess
    import sys

    out = tmp_path / "b.jsonl"
    argv = ["bench", "--preset", "tiny-moe", "--device", "cpu", "--batch-sizes", "1", "--decode-tokens", "4",
            "--prompt-len", "8", "--reps", "1", "--copy-mib", "1", "--json", str(out), "--compare", "transformers"]
    done = subprocess.run([sys.executable, "-c", BLOCK_SERVER_DEPS, *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "USDT" not in done.stderr and "profiler_start" not in done.stderr  # kineto's trace points stay quiet
    record = json.loads(out.read_text())
    assert record["peer_sample_token_ids"] == record["sample_token_ids"]

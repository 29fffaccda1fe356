"""MLX-quantized checkpoints against the real thing: tiny random checkpoints converted by `mlx_lm.convert -q`
load with our loader; our unpacked weights equal `mx.dequantize` bit for bit, our logits equal mlx-lm's forward of
the same files within a stated bound, `--quantize int4|int8` at load equals loading the converted files, and
`mps-serve quantize` writes checkpoints mlx-lm loads with the same logits."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from server.engine.engine import Engine
from server.engine.mlx_checkpoint import ZERO_CENTRED_NORMS, AffineLoader, mlx_to_hf, part_format
from server.engine.types import ModelLoadError, SamplingParams
from server.kernels import affine
from server.models.affine_quant import AffineEmbedding, AffineFusedExperts, AffineLinear, AffineTiedHead
from server.quantize_cli import mlx_config
from tests.helpers import ENGINE_KW, build_tiny, build_tiny_hybrid, random_ids, replan
from tests.models.test_hybrid_parity import _rewrite_checkpoint

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")

# Expert and MLP widths that every group size divides (mlx_lm.convert leaves a layer it cannot group unquantized).
OVERRIDES = {"llama": {}, "qwen3": {"tie_word_embeddings": True}, "qwen3_moe": {"moe_intermediate_size": 64}}
# The hybrids as tests/helpers.py builds them: at groups of 64 their experts' down projections (input 32), LFM2's
# dense w2 (96) and Qwen3.5's GDN out_proj (96) stay in the model dtype, as mlx_lm.convert leaves them. Qwen3.5
# as released: the config nested under the multimodal one, weights under `model.language_model.`, experts fused.
HYBRIDS = {"lfm2": None, "lfm2_moe": None, "qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe",
           "qwen3_next": None}
# float32 scales: our forward and mlx-lm's differ only by summation order (measured: <= 1e-6 relative)
LOGITS_REL_F32 = 1e-5


def mlx_ready_copy(src, dst):
    """A copy of an HF checkpoint with the keys mlx-lm 0.32 needs spelled out (rope_theta, rope_scaling,
    num_experts): transformers 5 writes rope_parameters and num_local_experts."""
    shutil.copytree(src, dst)
    (dst / "config.json").write_text(json.dumps(mlx_config(json.loads((dst / "config.json").read_text()))))
    return dst


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """arch -> float32 HF checkpoint ready for mlx-lm, built once per module."""
    built = {}

    def make(arch):
        if arch not in built:
            root = tmp_path_factory.mktemp(arch)
            if arch in HYBRIDS and HYBRIDS[arch]:
                build_tiny_hybrid(arch, root / "per-expert")
                _rewrite_checkpoint(root / "per-expert", root / "hf", "model.language_model.", HYBRIDS[arch])
            elif arch in HYBRIDS:
                build_tiny_hybrid(arch, root / "hf")
            else:
                build_tiny(arch, root / "hf", **OVERRIDES[arch])
            built[arch] = mlx_ready_copy(root / "hf", root / "src")
        return built[arch]

    return make


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory):
    """(arch, bits, group_size, dtype) -> the directory mlx_lm.convert -q wrote."""
    from mlx_lm.convert import convert

    done = {}

    def make(arch, bits, group_size, dtype="float32"):
        key = (arch, bits, group_size, dtype)
        if key not in done:
            out = tmp_path_factory.mktemp("mlx") / f"{arch}-{bits}-{group_size}-{dtype}"
            convert(str(source(arch)), str(out), quantize=True, q_bits=bits, q_group_size=group_size, dtype=dtype)
            done[key] = out
        return done[key]

    return make


def mlx_logits(path, ids):
    model, _ = mlx_lm.load(str(path))
    return torch.from_numpy(np.array(model(mx.array([ids])).astype(mx.float32)))[0]


def mx_to_torch(a):
    if a.dtype == mx.bfloat16:
        return torch.from_numpy(np.array(a.astype(mx.float32))).to(torch.bfloat16)
    return torch.from_numpy(np.array(a))


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def assert_weights_equal_mx_dequantize(model, path, model_type=None):
    """Every quantized tensor of the checkpoint: our module's rows, dequantized, equal mx.dequantize's bit for bit."""
    config = json.loads((path / "config.json").read_text())
    model_type = model_type or config["model_type"]
    config = config["quantization"]
    weights = {}
    for file in path.glob("*.safetensors"):
        weights.update(mx.load(str(file)))
    loader = AffineLoader(model)
    checked = 0
    for name in weights:
        if not name.endswith(".scales"):
            continue
        module_path = name[: -len(".scales")]
        override = config.get(module_path) if isinstance(config.get(module_path), dict) else config
        theirs = mx.dequantize(weights[module_path + ".weight"], weights[name], weights[module_path + ".biases"],
                               group_size=override["group_size"], bits=override["bits"])
        ours_name = model.sanitize(mlx_to_hf(model_type, module_path + ".weight"))
        split = getattr(model, "split_tensor", None)  # Qwen3-Next's grouped projections: compare row pieces
        for piece_name, expected in split(ours_name, mx_to_torch(theirs)) if split else [(ours_name, mx_to_torch(theirs))]:
            _, module, prefix, index, _ = loader.resolve(piece_name)
            fmt = part_format(module, prefix)
            ours = affine.dequantize_affine(*module.packed(prefix), fmt.group_size, fmt.bits)
            ours = ours[index] if index else ours
            assert ours.dtype == expected.dtype and torch.equal(ours, expected), piece_name
            checked += 1
    assert checked >= 10


CASES = [("llama", 4, 64), ("llama", 8, 32), ("qwen3", 4, 32), ("qwen3_moe", 4, 64), ("qwen3_moe", 8, 32)]


@pytest.mark.parametrize("arch,bits,group_size", CASES)
def test_mlx_checkpoint_loads_with_mlx_weights_and_logits(arch, bits, group_size, converted):
    path = converted(arch, bits, group_size)
    engine = Engine.from_pretrained(str(path), **ENGINE_KW)
    model = engine.model
    modules = list(model.modules())
    assert any(isinstance(m, AffineLinear) for m in modules) and isinstance(model.model.embed_tokens, AffineEmbedding)
    assert isinstance(model.lm_head, AffineTiedHead) == OVERRIDES[arch].get("tie_word_embeddings", False)
    assert any(isinstance(m, AffineFusedExperts) for m in modules) == (arch == "qwen3_moe")
    if arch == "qwen3_moe":  # the router as the checkpoint has it: 8 bits, groups of 64
        gate = model.model.layers[1].mlp.gate
        assert isinstance(gate, AffineLinear) and (gate.bits, gate.group_size) == (8, 64)
    assert_weights_equal_mx_dequantize(model, path, arch)
    ids = random_ids(24, 3)
    theirs = mlx_logits(path, ids)
    print(f"logits vs mlx-lm ({arch}, {bits} bits, groups of {group_size}): {rel(engine.score(ids), theirs):.2e}")
    assert rel(engine.score(ids), theirs) < LOGITS_REL_F32


@pytest.mark.parametrize("arch,bits,group_size", [("llama", 4, 64), ("qwen3", 8, 64), ("qwen3_moe", 4, 64)])
def test_quantize_at_load_equals_mlx_convert(arch, bits, group_size, source, converted):
    path = converted(arch, bits, group_size)
    ours = Engine.from_pretrained(str(source(arch)), **ENGINE_KW, quantization=f"int{bits}")
    loaded = Engine.from_pretrained(str(path), **ENGINE_KW)
    a, b = ours.model.state_dict(), loaded.model.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    ids = random_ids(20, 5)
    assert torch.equal(ours.score(ids), loaded.score(ids))


HYBRID_CASES = [("lfm2", 4, 64), ("lfm2_moe", 4, 64), ("lfm2_moe", 8, 32), ("qwen3_5_text", 4, 64),
                ("qwen3_5_moe_text", 4, 64), ("qwen3_next", 4, 64), ("qwen3_next", 8, 32)]


def moe_block(model):
    layer = model.model.layers[1]
    return getattr(layer, "feed_forward", None) or layer.mlp


@pytest.mark.parametrize("arch,bits,group_size", HYBRID_CASES)
def test_hybrid_mlx_checkpoint_loads_with_mlx_weights_and_logits(arch, bits, group_size, converted):
    """Gated DeltaNet and short-conv hybrids as mlx_lm.convert writes them (conv weights [C, K, 1], zero-centred
    norms stored as 1 + w, Qwen3.5 under `language_model.`, LFM2-MoE's experts as gate / up / down_proj, Qwen3-Next's
    grouped projections quantized whole): every packed tensor is MLX's bit for bit and the logits are mlx-lm's.
    At groups of 64 the experts' down projection (input 32) stays float beside packed gate and up."""
    path = converted(arch, bits, group_size)
    engine = Engine.from_pretrained(str(path), **ENGINE_KW)
    model = engine.model
    assert isinstance(model.model.embed_tokens, AffineEmbedding)
    if arch.startswith("lfm2"):
        assert isinstance(model.lm_head, AffineTiedHead)
    if "moe" in arch or arch == "qwen3_next":
        block = moe_block(model)
        assert isinstance(block.gate, AffineLinear) and (block.gate.bits, block.gate.group_size) == (8, 64)
        experts = block.experts
        assert isinstance(experts, AffineFusedExperts) and experts.gate_up_fmt.bits == bits
        assert (experts.down_fmt is None) == (group_size == 64)
    assert_weights_equal_mx_dequantize(model, path)
    ids = random_ids(24, 3)
    error = rel(engine.score(ids), mlx_logits(path, ids))
    print(f"logits vs mlx-lm ({arch}, {bits} bits, groups of {group_size}): {error:.2e}")
    assert error < LOGITS_REL_F32


@pytest.mark.parametrize("arch", list(HYBRIDS))
def test_hybrid_quantize_at_load_equals_mlx_convert(arch, source, converted):
    """--quantize int4 on the float checkpoint gives the model loaded from mlx_lm.convert -q's files: the same
    tensors (a zero-centred norm compared as the 1 + w the forward uses: mlx-lm stores that sum) and the same
    logits bit for bit."""
    ours = Engine.from_pretrained(str(source(arch)), **ENGINE_KW, quantization="int4")
    loaded = Engine.from_pretrained(str(converted(arch, 4, 64)), **ENGINE_KW)
    a, b = ours.model.state_dict(), loaded.model.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        zero_centred = arch.startswith("qwen3") and ZERO_CENTRED_NORMS.search(name)
        x, y = (1.0 + a[name], 1.0 + b[name]) if zero_centred else (a[name], b[name])
        assert x.dtype == y.dtype and torch.equal(x, y), name
    ids = random_ids(20, 5)
    assert torch.equal(ours.score(ids), loaded.score(ids))


@pytest.mark.parametrize("arch,bits,group_size", [("llama", 4, 64), ("qwen3", 4, 32), ("qwen3_moe", 8, 32),
                                                   ("lfm2_moe", 4, 64), ("qwen3_next", 4, 64)])
def test_bits_per_weight_and_bytes_read_per_token(arch, bits, group_size, converted):
    """Bits per weight as mlx-lm reports them for the same files (compute_bits_per_weight; measured within 1e-4);
    the bytes a token reads (bench/measure.weight_bytes): every packed tensor with its scales and biases, an
    untied quantized embedding not at all (a lookup reads one row), a tied one as the LM head reads it."""
    from mlx_lm.utils import compute_bits_per_weight

    from server.bench.measure import weight_bytes

    path = converted(arch, bits, group_size)
    engine = Engine.from_pretrained(str(path), **ENGINE_KW)
    theirs = compute_bits_per_weight(mlx_lm.load(str(path))[0])
    assert engine.bits_per_weight == pytest.approx(theirs, rel=1e-3)
    assert engine.stats().bits_per_weight == engine.bits_per_weight
    read = weight_bytes(engine.model)
    embed = sum(t.numel() * t.element_size() for t in engine.model.model.embed_tokens.packed())
    tied = isinstance(engine.model.lm_head, AffineTiedHead)
    assert read.dense + read.experts == engine.weight_bytes - (0 if tied else embed)
    if read.num_experts:
        assert read.per_token < read.dense + read.experts


def test_published_bf16_form_dequantizes_bit_for_bit(converted):
    """mlx-community checkpoints hold bf16 scales and biases: loaded in bf16, our weights are MLX's exactly; the
    logits follow mlx-lm's bf16 forward within bf16's rounding."""
    path = converted("qwen3_moe", 4, 64, "bfloat16")
    engine = Engine.from_pretrained(str(path), **{**ENGINE_KW, "dtype": "bfloat16"})
    assert engine.model.model.layers[1].mlp.experts.gate_up_scales.dtype == torch.bfloat16
    assert_weights_equal_mx_dequantize(engine.model, path, "qwen3_moe")
    ids = random_ids(16, 7)
    print(f"bf16 logits vs mlx-lm: {rel(engine.score(ids), mlx_logits(path, ids)):.2e}")
    assert rel(engine.score(ids), mlx_logits(path, ids)) < 0.05


def test_other_modes_are_refused_by_name(converted, tmp_path):
    path = tmp_path / "mx"
    shutil.copytree(converted("llama", 4, 64), path)
    config = json.loads((path / "config.json").read_text())
    for key in ("quantization", "quantization_config"):
        config[key] = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="mxfp4"):
        Engine.from_pretrained(str(path), **ENGINE_KW)


def test_reduction_form_equals_the_reference_form(converted, monkeypatch):
    """A plan with the packed weights read inside reductions (kernels/affine.py "reduction", a compiled step's)
    gives the reference form's greedy tokens and logprobs; eager it is only slow."""
    path = str(converted("qwen3_moe", 4, 64))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    reference = Engine.from_pretrained(path, **ENGINE_KW).generate(random_ids(12, 9), params)
    replan(monkeypatch, eager={"affine_reduction": True})
    reduced = Engine.from_pretrained(path, **ENGINE_KW).generate(random_ids(12, 9), params)
    assert reduced.token_ids == reference.token_ids
    for a, b in zip(reduced.logprobs, reference.logprobs, strict=True):
        assert abs(a.logprob - b.logprob) < 1e-4


@pytest.mark.parametrize("arch,bits,group_size", [("llama", 4, 64), ("qwen3", 8, 32), ("qwen3_moe", 4, 64),
                                                   ("lfm2", 4, 64), ("lfm2_moe", 8, 32), ("qwen3_5_text", 4, 64),
                                                   ("qwen3_5_moe_text", 4, 64), ("qwen3_next", 4, 64)])
def test_quantize_command_writes_what_mlx_lm_convert_writes(arch, bits, group_size, source, converted, tmp_path):
    """`mps-serve quantize` writes the tensors mlx_lm.convert -q writes (bit for bit, same names), and mlx-lm loads
    the result with the logits we compute from it."""
    from safetensors.torch import load_file

    from server.cli import main

    out = tmp_path / "q"
    assert main(["quantize", str(source(arch)), str(out), "--bits", str(bits), "--group-size", str(group_size)]) == 0
    ours = {k: v for f in out.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    theirs = {k: v for f in converted(arch, bits, group_size).glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name]), name
    config = json.loads((out / "config.json").read_text())
    mlx_config = json.loads((converted(arch, bits, group_size) / "config.json").read_text())
    assert config["quantization"] == mlx_config["quantization"] == config["quantization_config"]
    ids = random_ids(20, 11)
    theirs_logits = mlx_logits(out, ids)
    assert rel(Engine.from_pretrained(str(out), **ENGINE_KW).score(ids), theirs_logits) < LOGITS_REL_F32


def test_memory_check_counts_packed_bytes_and_embeddings_run(converted, monkeypatch):
    """A 4-bit checkpoint is refused only past its packed size (not its bf16 size), and the embeddings path (which
    sizes its scratch KV from the embedding's dtype) runs on a quantized table."""
    import server.engine.weights as weights
    from server.engine.embeddings import hidden_states

    path = converted("llama", 4, 64)
    packed = Engine.from_pretrained(str(path), **ENGINE_KW).weight_bytes
    monkeypatch.setattr(weights, "memory_bytes", lambda device: int(packed * 1.5))  # far below the float32 size
    engine = Engine.from_pretrained(str(path), **ENGINE_KW)
    hidden = hidden_states(engine.model, random_ids(6, 1), torch.device("cpu"), engine.runner.plans.eager)
    assert hidden.shape == (6, 64) and hidden.dtype == torch.float32
    monkeypatch.setattr(weights, "memory_bytes", lambda device: packed // 2)
    with pytest.raises(ModelLoadError, match="refused before allocating"):
        Engine.from_pretrained(str(path), **ENGINE_KW)

"""Every kernel op on the device against its reference twin on the CPU, on fresh random inputs.

The inputs are drawn on the CPU from `seed` (reported, so a failure can be replayed) and copied to the device;
each twin runs on the CPU in float32 or float64, so a device op that is wrong shows even where the device's
own basic ops are. Bounds are relative errors (norm of the difference over the norm of the reference): float32
agrees to rounding, bf16/fp16 to a few parts in a thousand per op, FP8 against its twin (same quantized
operands) to bf16 rounding, and where activations are quantized too, to the FP8 activation error. The affine
int4 / int8 products (both forms the step plan picks: the reference of eager steps and the reduction of compiled
one-token steps, run eagerly) against the twin of the same packed weights, dequantized in the model dtype as
mx.dequantize does and multiplied in float64: the model dtype's bound, twice that for the experts (the reduction
scales and offsets in float32 what the twin rounds to the model dtype, for each of the three projections).
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from server.kernels import affine, fp8, gated_delta, moe, moe_fp8, sampling
from server.kernels.capabilities import capabilities
from server.kernels.flex_decode import decode_block_mask, flex_attention, flex_decode_attention
from server.kernels.paged_attention import attention_reference, fresh_prefill_attention, gathered_decode_attention
from server.kernels.plan import step_plan
from server.selfcheck.results import FAIL, PASS, SKIP, Check, attempt, bounded

SECTION = "kernels"
FP8_TWIN_BOUND = 1e-2  # same quantized operands: bf16 rounding of the output
FP8_ACTIVATION_BOUND = 6e-2  # the fast path also quantizes the activations the twin keeps


def model_dtype_bound(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 2e-2


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().cpu().double(), ref.detach().cpu().double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


class Inputs:
    """Random tensors drawn on the CPU in float32 from one seed."""

    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)

    def randn(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator) * scale

    def perm(self, n: int) -> torch.Tensor:
        return torch.randperm(n, generator=self.generator)


def kernel_checks(device: torch.device, dtype: torch.dtype, seed: int) -> list[Check]:
    checks: list[tuple[str, Callable[[], Check]]] = [
        ("fp8_linear", lambda: check_fp8_linear(device, dtype, Inputs(seed))),
        ("fp8_weight_only", lambda: check_fp8_weight_only(device, dtype, Inputs(seed + 9))),
        ("moe_experts", lambda: check_moe(device, dtype, Inputs(seed + 1))),
        ("moe_experts_fp8", lambda: check_moe_fp8(device, dtype, Inputs(seed + 2))),
        ("decode_attention_sdpa", lambda: check_decode_attention(device, dtype, Inputs(seed + 3), flex=False)),
        ("decode_attention_flex", lambda: check_decode_attention(device, dtype, Inputs(seed + 3), flex=True)),
        ("prefill_attention", lambda: check_prefill_attention(device, dtype, Inputs(seed + 4))),
        ("gated_delta_chunked", lambda: check_gated_delta(device, dtype, Inputs(seed + 5), seq_len=70)),
        ("gated_delta_step", lambda: check_gated_delta(device, dtype, Inputs(seed + 6), seq_len=1)),
        ("causal_conv1d", lambda: check_causal_conv(device, dtype, Inputs(seed + 7))),
        ("sampling", lambda: check_sampling(device, seed + 8)),
        ("affine_linear", lambda: check_affine_linear(device, dtype, Inputs(seed + 10))),
        ("affine_experts", lambda: check_affine_experts(device, dtype, Inputs(seed + 11))),
    ]
    return [attempt(SECTION, name, fn) for name, fn in checks]


def check_fp8_linear(device, dtype, inputs: Inputs) -> Check:
    if fp8.FP8_DTYPE is None:
        return Check(SECTION, "fp8_linear", SKIP, f"torch {torch.__version__} has no float8_e4m3fn")
    weight = inputs.randn(96, 256).to(device, dtype)  # [N, K]
    bias = inputs.randn(96).to(device, dtype)
    w_fp8, w_scale = fp8.quantize_fp8_rowwise(weight)
    errors = []
    for num_tokens in (1, 5):
        x_fp8, x_scale = fp8.quantize_activation(inputs.randn(num_tokens, 256).to(device, dtype))
        for b in (None, bias):
            out = fp8.fp8_linear(x_fp8, x_scale, w_fp8, w_scale, b, dtype, step_plan(device, dtype))
            cpu = [t.cpu() for t in (x_fp8, x_scale, w_fp8, w_scale)]
            ref = fp8.fp8_linear_reference(*cpu, None if b is None else b.cpu(), torch.float32)
            errors.append(rel_err(out, ref))
    return bounded(SECTION, "fp8_linear", max(errors), FP8_TWIN_BOUND)


def check_fp8_weight_only(device, dtype, inputs: Inputs) -> Check:
    """The compiled decode step's FP8 form, run eagerly: the weight widened inside the reduction."""
    if fp8.FP8_DTYPE is None:
        return Check(SECTION, "fp8_weight_only", SKIP, f"torch {torch.__version__} has no float8_e4m3fn")
    w_fp8, w_scale = fp8.quantize_fp8_rowwise(inputs.randn(96, 256).to(device, dtype))
    bias = inputs.randn(96).to(device, dtype)
    errors = []
    for num_tokens in (1, 3):  # the compiled step uses it at one token; the math holds at any count
        x = inputs.randn(num_tokens, 256).to(device, dtype)
        out = fp8.fp8_weight_only_linear(x, w_fp8, w_scale, bias, dtype)
        ref = fp8.fp8_weight_only_reference(*(t.cpu() for t in (x, w_fp8, w_scale, bias)), torch.float32)
        errors.append(rel_err(out, ref))
    return bounded(SECTION, "fp8_weight_only", max(errors), FP8_TWIN_BOUND)


AFFINE_LINEAR_FORMATS = ((64, 4), (128, 8), (32, 4))  # (group size, bits)


def check_affine_linear(device, dtype, inputs: Inputs) -> Check:
    """Packed int4 / int8 linears: each form on the device against the float64 twin of the same packed weight."""
    errors = []
    for group_size, bits in AFFINE_LINEAR_FORMATS:
        packed = affine.quantize_affine(inputs.randn(96, 256, scale=256**-0.5).to(dtype), group_size, bits)
        bias = inputs.randn(96).to(dtype)
        for num_tokens in (1, 3):  # the reduction runs at one token in a compiled step; the math holds at any count
            x = inputs.randn(num_tokens, 256).to(dtype)
            ref = affine.affine_linear_reference(x.double(), *packed, group_size, bits, bias.double())
            for form in affine.LINEAR_FORMS:
                out = affine.affine_linear(x.to(device), *(t.to(device) for t in packed), group_size, bits,
                                           bias.to(device), form)
                errors.append(rel_err(out, ref))
    return bounded(SECTION, "affine_linear", max(errors), model_dtype_bound(dtype))


def check_affine_experts(device, dtype, inputs: Inputs) -> Check:
    """Packed MoE experts (gate and up 4-bit in groups of 64, down 8-bit in groups of 32, as mixed recipes write
    them): each form on the device against the float64 twin, at decode token counts."""
    errors = []
    for num_tokens in (1, 3):
        x, weights, expert_ids, gate_up, down = (t.to(dtype) if t.is_floating_point() else t
                                                 for t in _moe_case(inputs, num_tokens))
        formats = ((64, 4), (32, 8))
        packed = [affine.quantize_affine(w, *fmt) for w, fmt in zip((gate_up, down), formats, strict=True)]
        ref = affine.affine_experts_reference(x.double(), weights.double(), expert_ids, *packed, *formats)
        on_device = [tuple(t.to(device) for t in p) for p in packed]
        for form in affine.EXPERT_FORMS:
            out = affine.affine_experts(x.to(device), weights.to(device), expert_ids.to(device), *on_device,
                                        *formats, form, step_plan(device, dtype))
            errors.append(rel_err(out, ref))
    return bounded(SECTION, "affine_experts", max(errors), 2 * model_dtype_bound(dtype))


def _moe_case(inputs: Inputs, num_tokens: int, num_experts=8, hidden=64, inter=32, top_k=2):
    gate_up = inputs.randn(num_experts, 2 * inter, hidden, scale=hidden**-0.5)
    down = inputs.randn(num_experts, hidden, inter, scale=inter**-0.5)
    x = inputs.randn(num_tokens, hidden)
    # a few hot experts and some rarely chosen: groups of very different sizes, empty ones included
    skew = torch.tensor([3.0, 2.0, 0, 0, -9, 0, 1, -9])
    weights, expert_ids = moe.route_softmax(inputs.randn(num_tokens, num_experts) + skew, top_k, True,
                                            step_plan("cpu", torch.float32))
    return x, weights, expert_ids, gate_up, down


def check_moe(device, dtype, inputs: Inputs) -> Check:
    errors = []
    for num_tokens in (1, 7, 33):
        x, weights, expert_ids, gate_up, down = _moe_case(inputs, num_tokens)
        out = moe.moe_experts(*(t.to(device, dtype) for t in (x, weights)), expert_ids.to(device),
                              gate_up.to(device, dtype), down.to(device, dtype), step_plan(device, dtype))
        ref = moe.moe_experts_reference(*(t.to(dtype).double() for t in (x, weights)), expert_ids,
                                        gate_up.to(dtype).double(), down.to(dtype).double())
        errors.append(rel_err(out, ref))
    return bounded(SECTION, "moe_experts", max(errors), model_dtype_bound(dtype))


def check_moe_fp8(device, dtype, inputs: Inputs) -> Check:
    if fp8.FP8_DTYPE is None:
        return Check(SECTION, "moe_experts_fp8", SKIP, f"torch {torch.__version__} has no float8_e4m3fn")
    errors = []
    for num_tokens in (1, 7, 33):
        x, weights, expert_ids, gate_up, down = _moe_case(inputs, num_tokens)
        gate_up_q, gate_up_scale = moe_fp8.quantize_experts(gate_up.to(device, dtype))
        down_q, down_scale = moe_fp8.quantize_experts(down.to(device, dtype))
        quantized = (gate_up_q, gate_up_scale, down_q, down_scale)
        out = moe_fp8.moe_experts_fp8(x.to(device, dtype), weights.to(device, dtype), expert_ids.to(device), *quantized,
                                      step_plan(device, dtype))
        ref = moe_fp8.moe_experts_fp8_reference(x.to(dtype).float(), weights.to(dtype).float(), expert_ids,
                                                *(t.cpu() for t in quantized))
        errors.append(rel_err(out, ref))
    activations_quantized = capabilities(device).fp8_grouped.ok
    return bounded(SECTION, "moe_experts_fp8", max(errors),
                   FP8_ACTIVATION_BOUND if activations_quantized else FP8_TWIN_BOUND)


def _paged_case(inputs: Inputs, block_size=16, num_blocks=24, kv_heads=2, heads=4, head_dim=64):
    k_cache, v_cache = (inputs.randn(num_blocks, block_size, kv_heads, head_dim) for _ in range(2))
    q = inputs.randn(3, heads, head_dim)
    tables = (inputs.perm(num_blocks - 1)[:12] + 1).view(3, 4)  # block 0 stays the padding block
    positions = torch.tensor([block_size + 2, 3 * block_size + block_size // 2, 5])
    return q, k_cache, v_cache, tables, positions


def check_decode_attention(device, dtype, inputs: Inputs, flex: bool) -> Check:
    name = "decode_attention_flex" if flex else "decode_attention_sdpa"
    if flex and flex_attention is None:
        return Check(SECTION, name, SKIP, f"torch {torch.__version__} has no FlexAttention")
    q, k_cache, v_cache, tables, positions = _paged_case(inputs)
    scale = q.shape[-1] ** -0.5
    on_device = [t.to(device, dtype) for t in (q, k_cache, v_cache)] + [t.to(device) for t in (tables, positions)]
    if flex:  # eager here (torch warns that it is unfused); the compiled form is checked with the decode step
        plan = step_plan(device, dtype)
        mask = decode_block_mask(on_device[3], on_device[4], k_cache.shape[1], k_cache.shape[0] * k_cache.shape[1],
                                 plan.flex_listed_blocks)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            out = flex_decode_attention(*on_device[:3], mask, scale, plan.flex_kv_tile)
    else:
        out = gathered_decode_attention(*on_device, scale)
    ref = gathered_decode_attention(*(t.to(dtype).double() for t in (q, k_cache, v_cache)), tables, positions, scale)
    return bounded(SECTION, name, rel_err(out, ref), model_dtype_bound(dtype))


def check_prefill_attention(device, dtype, inputs: Inputs, num_tokens=40, heads=4, kv_heads=2, head_dim=64) -> Check:
    q = inputs.randn(num_tokens, heads, head_dim)
    k, v = (inputs.randn(num_tokens, kv_heads, head_dim) for _ in range(2))
    scale = head_dim**-0.5
    meta = _OneSequence(torch.zeros(1, num_tokens, dtype=torch.int64, device=device))
    out = fresh_prefill_attention(*(t.to(device, dtype) for t in (q, k, v)), meta, scale)
    causal = torch.ones(num_tokens, num_tokens, dtype=torch.bool).tril()
    as_batch = [t.to(dtype).double().transpose(0, 1)[None] for t in (q, k, v)]  # [1, heads, T, dim]
    ref = attention_reference(*as_batch, causal, scale)[0].transpose(0, 1)
    return bounded(SECTION, "prefill_attention", rel_err(out, ref), model_dtype_bound(dtype))


class _OneSequence:
    """The attention metadata fresh_prefill_attention reads for one sequence (its rows need no gather)."""

    def __init__(self, query_index: torch.Tensor):
        self.query_index = query_index


def check_gated_delta(device, dtype, inputs: Inputs, seq_len: int, rows=2, k_heads=2, v_heads=4, k_dim=32,
                      v_dim=16) -> Check:
    q, k = (inputs.randn(rows, seq_len, k_heads, k_dim) for _ in range(2))
    v = inputs.randn(rows, seq_len, v_heads, v_dim)
    g = -F.softplus(inputs.randn(rows, seq_len, v_heads))  # log decay <= 0
    beta = torch.sigmoid(inputs.randn(rows, seq_len, v_heads))
    state = inputs.randn(rows, v_heads, k_dim, v_dim)  # fp32, as the engine keeps it
    qkv = [t.to(dtype) for t in (q, k, v)]
    out, new_state = gated_delta.gated_delta_rule(*(t.to(device) for t in qkv), g.to(device), beta.to(device),
                                                  state.to(device))
    ref_out, ref_state = gated_delta.gated_delta_rule_reference(*(t.float() for t in qkv), g, beta, state)
    error = max(rel_err(out, ref_out), rel_err(new_state, ref_state))
    name = "gated_delta_step" if seq_len == 1 else "gated_delta_chunked"
    return bounded(SECTION, name, error, model_dtype_bound(dtype))


def check_causal_conv(device, dtype, inputs: Inputs, rows=3, seq_len=20, channels=48, kernel=4) -> Check:
    x = inputs.randn(rows, seq_len, channels).to(dtype)
    weight = inputs.randn(channels, kernel).to(dtype)
    state = inputs.randn(rows, channels, kernel - 1).to(dtype)
    lengths = torch.tensor([seq_len, 7, 1])
    y, new_state = gated_delta.causal_conv1d(*(t.to(device) for t in (x, weight, state, lengths)))
    ref_y, ref_state = gated_delta.causal_conv1d_reference(x.float(), weight.float(), state.float(), lengths)
    valid = torch.arange(seq_len)[None, :] < lengths[:, None]  # [rows, L]: padded outputs are never read
    error = max(rel_err(y.cpu()[valid], ref_y[valid]), rel_err(new_state, ref_state))
    return bounded(SECTION, "causal_conv1d", error, model_dtype_bound(dtype))


def check_sampling(device, seed: int, vocab_size=300, num_rows=7) -> Check:
    rng = random.Random(seed)
    rows = [_sampling_row(rng, vocab_size) for _ in range(num_rows)]
    logits = torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * 3
    fast = sampling.sample(logits.to(device), sampling.build_sampling_batch(rows, vocab_size, device))
    ref = sampling.sample_reference(logits, sampling.build_sampling_batch(rows, vocab_size, "cpu"))
    mismatched = int((fast.token_ids.cpu() != ref.token_ids).sum())
    return Check(SECTION, "sampling", PASS if mismatched == 0 else FAIL,
                 f"{mismatched} of {num_rows} sampled tokens differ from the twin's (bound 0)",
                 {"error": mismatched, "bound": 0})


def _sampling_row(rng: random.Random, vocab_size: int) -> sampling.SamplingRow:
    return sampling.SamplingRow(
        temperature=rng.choice([0.0, 0.5, 1.0, 1.7]), top_k=rng.choice([0, 5, 40]), top_p=rng.choice([1.0, 0.9]),
        min_p=rng.choice([0.0, 0.05]), repetition_penalty=rng.choice([1.0, 1.3]),
        presence_penalty=rng.choice([0.0, 0.5]), frequency_penalty=rng.choice([0.0, 0.25]),
        logit_bias=rng.choice([None, {3: 4.0, 17: -100.0}]), seed=rng.randrange(2**62), step=rng.randrange(500),
        prompt_token_ids=[rng.randrange(vocab_size) for _ in range(rng.randrange(20))],
        output_token_ids=[rng.randrange(vocab_size) for _ in range(rng.randrange(12))],
    )

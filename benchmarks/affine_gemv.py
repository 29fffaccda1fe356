"""Packed int4 / int8 one-token linears on a CUDA GPU: the compiled forms against bf16 F.linear and torch's
tinygemm int4 kernel (CUDA's `_weight_int4pack_mm`, a ceiling of what a 4-bit GEMV reaches on this GPU).

    PYTHONPATH=. python3 benchmarks/affine_gemv.py [--bits 4] [--shapes 4096x4096,14336x4096,4096x14336]

Forms (server/kernels/affine.py and candidates compared here):
- "flat": affine_linear_reduction, one float32 reduction over K whose weight operand is the dequantized expression.
- "per-shift": the same sum as 32/bits reductions over the packed words, one per bit position, which inductor
  fuses into one kernel that loads each word once.
Each compiled as the engine compiles (inductor, coordinate descent tuning on), timed as CUDA-graph replays
(weights rotating past the L2), GB/s = bytes of the packed weight, scales and biases per call / time.
"""

from __future__ import annotations

import argparse

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F

from benchmarks.kernels import DEVICE, ROTATE_BYTES, copy_bandwidth, fmt, rel_err, time_graph
from server.kernels import affine


def per_shift(x, q, scales, biases, group_size, bits):
    """x [1, K] against packed q [N, P] -> [1, N]: sum over bit positions j of a reduction over the words p of
    x[p * per_word + j] * (((q[:, p] >> bits * j) & mask) * scale + bias), float32."""
    per_word, mask = 32 // bits, 2**bits - 1
    words = q.view(torch.int32)  # [N, P]
    x_words = x.float().view(-1, per_word)  # [P, per_word]
    words_per_group = group_size // per_word
    scale = scales.float().repeat_interleave(words_per_group, -1)  # [N, P] (an index expression under compile)
    bias = biases.float().repeat_interleave(words_per_group, -1)
    out = 0
    for j in range(per_word):
        values = ((words >> (bits * j)) & mask).float()
        out = out + (x_words[:, j] * (values * scale + bias)).sum(-1)
    return out.to(x.dtype).view(1, -1)


def bench_shape(num_out: int, num_in: int, bits: int, group_size: int, copy_gbps: float) -> None:
    copies = max(2, -(-ROTATE_BYTES // (num_out * num_in * bits // 8)))
    dense = [torch.randn(num_out, num_in, device=DEVICE, dtype=torch.bfloat16) / num_in**0.5 for _ in range(copies)]
    packed = [affine.quantize_affine(w, group_size, bits) for w in dense]
    x = torch.randn(1, num_in, device=DEVICE, dtype=torch.bfloat16)
    ref = affine.affine_linear_reference(x.float(), *(t.float() if t.is_floating_point() else t for t in packed[0]),
                                         group_size, bits)
    packed_bytes = sum(t.numel() * t.element_size() for t in packed[0])
    flat = torch.compile(affine.affine_linear_reduction, dynamic=False)
    shifted = torch.compile(per_shift, dynamic=False)
    variants = {
        "bf16 F.linear": (lambda i: F.linear(x, dense[i % copies]), num_out * num_in * 2),
        f"int{bits} flat (compiled)": (lambda i: flat(x, *packed[i % copies], group_size, bits), packed_bytes),
        f"int{bits} per-shift (compiled)": (lambda i: shifted(x, *packed[i % copies], group_size, bits), packed_bytes),
    }
    tiny = None
    if bits == 4:
        try:
            tiny = [_tinygemm_weight(w, group_size) for w in dense]
        except Exception as exc:  # noqa: BLE001 - a build without tinygemm
            print(f"| {num_out}x{num_in} | int4 tinygemm | unavailable: {type(exc).__name__}: {str(exc)[:120]} |")
    if tiny is not None:
        variants["int4 tinygemm _weight_int4pack_mm"] = (
            lambda i: torch.ops.aten._weight_int4pack_mm(x, tiny[i % copies][0], group_size, tiny[i % copies][1]),
            num_out * num_in // 2 + tiny[0][1].numel() * tiny[0][1].element_size())
    for name, (fn, nbytes) in variants.items():
        try:
            err = rel_err(fn(0).float().view(1, -1), ref.view(1, -1))
            micros = time_graph(fn, calls=40)
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(f"| {num_out}x{num_in} | {name} | failed: {type(exc).__name__}: {str(exc)[:120]} |")
            continue
        gbps = nbytes / (micros * 1e-6) / 1e9 if isinstance(micros, float) else float("nan")
        print(f"| {num_out}x{num_in} | {name} | {fmt(micros)} | {gbps:.0f} | {100 * gbps / copy_gbps:.0f}% | {err:.1e} |")


def _tinygemm_weight(weight: torch.Tensor, group_size: int):
    """bf16 [N, K] -> (tinygemm packed int4, scales_and_zeros [K/gs, N, 2]) with torch's asymmetric recipe."""
    groups = weight.float().reshape(weight.shape[0], -1, group_size)
    w_min, w_max = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = ((w_max - w_min) / 15).clamp_min(1e-6)
    q = ((groups - w_min) / scale).round().clamp(0, 15).to(torch.int32).reshape(weight.shape)
    zero = w_min + 8 * scale  # tinygemm dequantizes (q - 8) * scale + zero
    packed_u8 = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
    packed = torch.ops.aten._convert_weight_to_int4pack(packed_u8, 8)
    scales_zeros = torch.stack([scale.squeeze(-1), zero.squeeze(-1)], -1).transpose(0, 1).contiguous()
    return packed, scales_zeros.to(torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bits", type=int, default=4, choices=[4, 8])
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--shapes", default="4096x4096,14336x4096,4096x14336")
    args = parser.parse_args()
    inductor_config.coordinate_descent_tuning = True  # as compile.knobs sets it for packed models
    copy_gbps = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name(DEVICE)}, torch {torch.__version__}, copy {copy_gbps:.0f} GB/s")
    print("| W (N x K) | form | graph us | GB/s | % of copy | rel err vs reference |\n|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        num_out, num_in = (int(v) for v in shape.split("x"))
        bench_shape(num_out, num_in, args.bits, args.group_size, copy_gbps)


if __name__ == "__main__":
    main()

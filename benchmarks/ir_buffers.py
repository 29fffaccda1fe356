"""The buffers inductor stores for a small piece of a compiled decode step, on the CPU: what a GPU would run as
kernels before the scheduler fuses neighbours of one shape (a reduction and the pointwise work around it become one
kernel). A check of a fusion change without a GPU; the GPU's kernel listing (decode_breakdown.py --list-step) is
the measurement.

    PYTHONPATH=. python3 benchmarks/ir_buffers.py --case gated-attention-qk
    PYTHONPATH=. python3 benchmarks/ir_buffers.py --case gdn-qk
    PYTHONPATH=. python3 benchmarks/ir_buffers.py --case moe-experts|moe-experts-fp8|fp8-down

CUDA's lowering of a small concatenation (masked loads) is forced, and the realize heuristics are CUDA's (the
accumulated-read limit, no CPU rule for reused exp), so that the stored buffers are the ones CUDA would store.
Prints each buffer (its IR node, size and the first FX ops it fuses) and the largest difference from eager."""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")  # a cache hit would skip the lowering

import torch  # noqa: E402
import torch._inductor.config as inductor_config  # noqa: E402
from torch._inductor import graph as inductor_graph  # noqa: E402
from torch._inductor import ir as inductor_ir  # noqa: E402

inductor_config.force_pointwise_cat = True
inductor_config.realize_acc_reads_threshold = 8
inductor_ir.is_cpu = lambda node: False  # ir.py asks it only for its realize heuristics: take a GPU's


def gated_attention_qk():
    from server.models.hybrid import GatedAttention

    attn = GatedAttention(64, 4, 2, 32, 1e-6)
    for param in attn.parameters():
        torch.nn.init.normal_(param, std=0.3)
    rope = torch.randn(3, 8), torch.randn(3, 8)  # partial rotary: 8 of 32 dims

    def prep(x):
        q_gate, k, _ = attn.qkv_proj(x).split([2 * attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q, _ = q_gate.view(3, attn.num_heads, 2 * attn.head_dim).chunk(2, dim=-1)
        return attn._norm_rope_qk(q, k.view(3, attn.num_kv_heads, attn.head_dim), rope)

    return prep, (torch.randn(3, 64),)


def gdn_qk():
    import torch.nn.functional as F

    from server.kernels import gated_delta

    def prep(qkv):
        q, k, _ = F.silu(qkv).split([64, 64, 128], -1)
        return gated_delta._normalize_qk(q.reshape(2, 4, 16), k.reshape(2, 4, 16), 8)

    return prep, (torch.randn(2, 256),)


def moe_experts_one_token(fp8: bool = False):
    """Routing (torch.topk, as layers compiled inline route) and the gather-reduce experts of a MoE layer at one
    token (the compiled step's path on CUDA and the CPU), then the residual add."""
    from server.kernels import moe, moe_fp8
    from server.kernels.plan import step_plan

    inline = step_plan("cpu", torch.float32, traced=True).for_inline_call()  # routing reads no device field
    num_experts, hidden, inter, top_k = 16, 64, 32, 4
    gate_up, down = torch.randn(num_experts, 2 * inter, hidden), torch.randn(num_experts, hidden, inter)
    quantized = [*moe_fp8.quantize_experts(gate_up), *moe_fp8.quantize_experts(down)]

    def experts(x, logits, residual):
        weights, expert_ids = moe.route_softmax(logits, top_k, True, inline)
        if fp8:
            return (residual + moe_fp8._experts_gather_reduce_fp8(x, weights, expert_ids, *quantized),)
        return (residual + moe._experts_gather_reduce(x, weights, expert_ids, gate_up, down),)

    return experts, (torch.randn(1, hidden), torch.randn(1, num_experts), torch.randn(1, hidden))


def fp8_down_one_token():
    """An FP8 down projection at one token, its input the SwiGLU of a gate/up product (the weight-only form)."""
    from server.kernels import fp8

    w_fp8, w_scale = fp8.quantize_fp8_rowwise(torch.randn(64, 128))

    def down(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        act = torch.nn.functional.silu(gate) * up
        return (fp8.fp8_weight_only_linear(act, w_fp8, w_scale, None, torch.float32),)

    return down, (torch.randn(1, 256),)


CASES = {"gated-attention-qk": gated_attention_qk, "gdn-qk": gdn_qk, "moe-experts": moe_experts_one_token,
         "moe-experts-fp8": lambda: moe_experts_one_token(fp8=True),
         "fp8-down": fp8_down_one_token}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=sorted(CASES), required=True)
    args = parser.parse_args()
    codegen = inductor_graph.GraphLowering.codegen

    def report_then_codegen(graph, *rest, **kwargs):
        stored = [b for b in graph.buffers if type(b).__name__ == "ComputedBuffer"]
        print(f"{len(stored)} stored buffers, {sum(type(b.data).__name__ == 'Reduction' for b in stored)} reductions")
        for buffer in stored:
            ops = sorted(str(origin) for origin in buffer.origins)[:12]
            print(f"  {buffer.get_name()}: {type(buffer.data).__name__} {list(buffer.get_size())} {ops}")
        return codegen(graph, *rest, **kwargs)

    inductor_graph.GraphLowering.codegen = report_then_codegen
    torch.manual_seed(0)
    fn, inputs = CASES[args.case]()
    with torch.no_grad():
        got, expected = torch.compile(fn, fullgraph=True)(*inputs), fn(*inputs)
    print("max difference from eager:", max((g - e).abs().max().item() for g, e in zip(got, expected, strict=True)))


if __name__ == "__main__":
    main()

"""FP8 decode at one token in candidate forms side by side, one process, with and without CUDA graphs (without: the
Mac-like mode, every kernel launched from the host). Each form other than the engine's replaces functions of
`server` in this process only: a measurement, not a setting.

    PYTHONPATH=. python3 benchmarks/fp8_decode_forms.py --preset llama-3.1-8b --graphs on,off --json out/fp8forms.jsonl
    PYTHONPATH=. python3 benchmarks/fp8_decode_forms.py --preset qwen3-30b-a3b --graphs off -- --num-layers 12

Forms (`--forms`, in order; each runs `mps-serve bench --batch-sizes 1` at every `--graphs` setting):
  engine          bf16 and FP8 as the engine picks (the weight-only reduction at one token)
  scaled-mm       FP8 through row-wise scaled_mm with the activation quantized per call (forced)
  two-stage-down  bf16 and FP8 MoE experts with the down projection reduced per slot over I (FP8: the row scale as
                  its epilogue), then the routing-weighted sum over the k slots written as k pointwise terms, which
                  inductor can fuse into the residual add (it unrolls a sum of fewer than 8 itself, not k = 8)
Arguments after `--` go to the bench (`--num-layers 12`, `--prompt-len 2048`). Every run's table and JSON lines
carry kernels/step.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from torch._inductor.runtime.cache_dir_utils import cache_dir  # private: where torch keeps its caches

from server import cli
from server.kernels import fp8, moe, moe_fp8
from server.kernels.capabilities import fp8_rowwise_ok, fp8_weight_only_ok


def scaled_mm_at_one_token(device: torch.device, num_tokens) -> bool:
    # scaled_mm at one token wherever the device has it; weight-only only where it has not
    return (torch.compiler.is_compiling() and num_tokens <= fp8.WEIGHT_ONLY_MAX_TOKENS
            and not fp8_rowwise_ok(device, False) and fp8_weight_only_ok(device))


def slot_down(down_slots, act, row_scale=None):
    """down_slots [T*k, H, I] (gathered), act [T*k, I], row_scale [T*k, H] (FP8) or None -> [T*k, H] float32: the
    down projection of each token-expert slot, the row scale as the reduction's epilogue."""
    y_slots = (down_slots.float() * act.float().unsqueeze(1)).sum(-1)  # [T*k, H]
    return y_slots if row_scale is None else y_slots * row_scale


def two_stage(x, weights, expert_ids, gate_up, down, gate_up_scale=None, down_scale=None):
    """The experts (FP8 when given the row scales) with the down reduced per slot, then the routing-weighted sum
    over the k slots as k pointwise terms -> [T, H]."""
    num_tokens, top_k = expert_ids.shape
    flat_ids = expert_ids.reshape(-1)  # [T*k]
    act = moe.slot_swiglu(gate_up, flat_ids, moe.token_slots(x, top_k).unsqueeze(1), gate_up_scale)  # [T*k, I]
    row_scale = None if down_scale is None else down_scale[flat_ids]
    y_slots = slot_down(down[flat_ids], act, row_scale).view(num_tokens, top_k, -1)
    terms = [y_slots[:, j] * weights[:, j, None].float() for j in range(top_k)]  # [T, H] each
    return sum(terms[1:], terms[0]).to(x.dtype)


def two_stage_fp8(x, weights, expert_ids, gate_up_q, gate_up_scale, down_q, down_scale):
    return two_stage(x, weights, expert_ids, gate_up_q, down_q, gate_up_scale, down_scale)


FORMS = {  # name -> (quantize modes, [(module, attribute, replacement)]); the engine's form replaces nothing
    "engine": ("none,fp8", []),
    "scaled-mm": ("fp8", [(fp8, "use_weight_only", scaled_mm_at_one_token)]),
    "two-stage-down": ("none,fp8", [(moe, "_experts_gather_reduce", two_stage),
                                    (moe_fp8, "_experts_gather_reduce_fp8", two_stage_fp8)]),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    bench_extra = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-3.1-8b")
    parser.add_argument("--graphs", default="off", help="on, off or on,off: as the bench's --graphs")
    parser.add_argument("--forms", default="engine,scaled-mm", help=f"comma-separated, of {', '.join(FORMS)}")
    parser.add_argument("--json", default=None, help="append every run's JSON lines here")
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    forms = args.forms.split(",")
    unknown = [form for form in forms if form not in FORMS]
    if unknown:
        parser.error(f"unknown form(s) {', '.join(unknown)}: choose from {', '.join(FORMS)}")
    common = ["bench", "--preset", args.preset, "--batch-sizes", "1", "--graphs", args.graphs, *bench_extra]
    common += ["--json", args.json] if args.json else []
    status, engine_cache = 0, cache_dir()
    for form in forms:
        print(f"== FP8 form: {form}", flush=True)
        quantize, replacements = FORMS[form]
        if not replacements:
            status |= cli.main([*common, "--quantize", quantize])
            continue
        # a compile cache of its own: a saved step of the engine's form (torch >= 2.13) has the same key
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(engine_cache) / f"form-{form}")
        originals = [(module, name, getattr(module, name)) for module, name, _ in replacements]
        for module, name, replacement in replacements:
            setattr(module, name, replacement)
        try:
            status |= cli.main([*common, "--quantize", quantize])
        finally:
            for module, name, original in originals:
                setattr(module, name, original)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = engine_cache
    return status


if __name__ == "__main__":
    sys.exit(main())

"""Decode at one token in candidate forms side by side, one process, with and without CUDA graphs (without: the
Mac-like mode, every kernel launched from the host). Each form other than the engine's replaces functions of
`server` in this process only: a measurement, not a setting.

    PYTHONPATH=. python3 benchmarks/decode_forms.py --preset llama-3.1-8b --graphs on,off --json out/forms.jsonl
    PYTHONPATH=. python3 benchmarks/decode_forms.py --preset qwen3-30b-a3b --graphs off -- --num-layers 12
    PYTHONPATH=. python3 benchmarks/decode_forms.py --preset qwen3.6-35b-a3b --graphs on --quantize none \
        --forms engine,ffn-input-inlined

Forms (`--forms`, in order, a form may repeat; `a+b` patches a and b in together; each runs `mps-serve bench
--batch-sizes 1` at every `--graphs` setting, bf16 and FP8 unless the (first) form names one or `--quantize` does):
  engine             bf16 and FP8 as the engine picks (the weight-only reduction at one token)
  scaled-mm          FP8 through row-wise scaled_mm with the activation quantized per call (forced)
  ffn-input-inlined  the decoder layer's FFN input not stored: its readers recompute the post-attention norm
  bf16-down-per-slot the bf16 experts' down reduced per slot, the k slots weighted at the end (FP8's form)
  bf16-weights-in-swiglu  the bf16 routing weights applied to the SwiGLU output, not inside the down reduction
(benchmarks/decode_attention_forms.py compares the decode attention's GQA forms the same way.)
Arguments after `--` go to the bench (`--num-layers 12`, `--prompt-len 2048`). Every run's table and JSON lines
carry kernels/step and, on CUDA, the step's kernel time (kernel ms: device time, which host noise does not move).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import torch
from torch._inductor.runtime.cache_dir_utils import cache_dir  # private: where torch keeps its caches

from server import cli
from server.engine import build
from server.kernels import gemv, moe
from server.kernels.plan import StepPlans, step_plans
from server.models import layers


def scaled_mm_at_one_token(device: torch.device, dtype: torch.dtype) -> StepPlans:
    """The engine's plans, but scaled_mm at one token wherever the device has it; weight-only only where it has
    not."""
    plans = step_plans(device, dtype)
    compiled = [dataclasses.replace(plan, fp8_weight_only=plan.fp8_weight_only and not plan.fp8_rowwise)
                for plan in (plans.compiled, plans.compiled_layers_inline)]
    return StepPlans(plans.eager, *compiled)


def gather_reduce_per_slot(x, weights, expert_ids, gate_up, down):
    """In place of moe._experts_gather_reduce: the down reduced per slot and the k slots weighted at the end, as
    FP8 experts do (the routing weights then meet the token-shaped last kernel, with the winners' max and sum)."""
    num_tokens, top_k = expert_ids.shape
    flat_ids = expert_ids.reshape(-1)  # [T*k]
    act = moe.slot_swiglu(gate_up, flat_ids, moe.token_slots(x, top_k).unsqueeze(1))  # [T*k, I]
    y_slots = (down[flat_ids].float() * act.unsqueeze(1)).sum(-1).view(num_tokens, top_k, -1)  # [T, k, H]
    terms = [y_slots[:, j] * weights[:, j, None].float() for j in range(top_k)]
    return sum(terms[1:], terms[0]).to(x.dtype)


def gather_reduce_weights_in_swiglu(x, weights, expert_ids, gate_up, down):
    """In place of moe._experts_gather_reduce: the routing weights applied to the SwiGLU output (the gate/up
    kernel's epilogue, an exp per slot and column) instead of inside the down reduction (an exp per element read)."""
    flat_ids = expert_ids.reshape(-1)  # [T*k]
    act = moe.slot_swiglu(gate_up, flat_ids, moe.token_slots(x, expert_ids.shape[1]).unsqueeze(1))  # [T*k, I]
    ones = torch.ones_like(weights)  # down_and_combine weights the slots again: here they are weighted already
    weighted_act = gemv.stored(act * weights.reshape(-1, 1).float())  # [T*k, I]
    return moe.down_and_combine(down[flat_ids].float(), weighted_act, ones).to(x.dtype)


def inlined(x):
    """In place of gemv.stored: the value as an expression its readers inline."""
    return x


FORMS = {  # name -> (quantize modes, [(module, attribute, replacement)]); the engine's form replaces nothing
    "engine": ("none,fp8", []),
    "scaled-mm": ("fp8", [(build, "step_plans", scaled_mm_at_one_token)]),  # another plan for every engine
    "ffn-input-inlined": ("none,fp8", [(layers, "stored", inlined)]),
    "bf16-down-per-slot": ("none", [(moe, "_experts_gather_reduce", gather_reduce_per_slot)]),
    "bf16-weights-in-swiglu": ("none", [(moe, "_experts_gather_reduce", gather_reduce_weights_in_swiglu)]),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    bench_extra = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-3.1-8b")
    parser.add_argument("--graphs", default="off", help="on, off or on,off: as the bench's --graphs")
    parser.add_argument("--forms", default="engine,scaled-mm",
                        help=f"comma-separated, of {', '.join(FORMS)}; a+b runs forms a and b together")
    parser.add_argument("--json", default=None, help="append every run's JSON lines here")
    parser.add_argument("--quantize", default=None, help="none, fp8 or none,fp8 for every form (default: the form's)")
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    forms = [(form, form.split("+")) for form in args.forms.split(",")]  # (form, the names it patches together)
    unknown = [name for _, names in forms for name in names if name not in FORMS]
    if unknown:
        parser.error(f"unknown form(s) {', '.join(unknown)}: choose from {', '.join(FORMS)}")
    common = ["bench", "--preset", args.preset, "--batch-sizes", "1", "--graphs", args.graphs, *bench_extra]
    common += ["--json", args.json] if args.json else []
    status, engine_cache = 0, cache_dir()
    for form, names in forms:
        print(f"== form: {form}", flush=True)
        quantize = args.quantize or FORMS[names[0]][0]
        replacements = [replacement for name in names for replacement in FORMS[name][1]]
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

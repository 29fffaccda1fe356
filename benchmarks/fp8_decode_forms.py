"""FP8 decode at one token in its two forms side by side, with and without CUDA graphs (without: the Mac-like
mode, every kernel launched from the host): the weight-only reduction (the FP8 weight read inside one compiled
reduction, what the engine picks) against row-wise `scaled_mm` with the activation quantized per call. The second
run forces the `scaled_mm` form by replacing `fp8.use_weight_only` in this process only: a measurement, not a
setting.

    PYTHONPATH=. python3 benchmarks/fp8_decode_forms.py --preset llama-3.1-8b --graphs on,off --json out/fp8forms.jsonl

Runs `mps-serve bench --batch-sizes 1` twice in one process: bf16 and FP8 as the engine picks, then FP8 through
row-wise scaled_mm, each at every `--graphs` setting. Both runs' tables and JSON lines carry kernels/step.
"""

from __future__ import annotations

import argparse
import sys

import torch

from server import cli
from server.kernels import fp8
from server.kernels.capabilities import fp8_rowwise_ok, fp8_weight_only_ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-3.1-8b")
    parser.add_argument("--graphs", default="off", help="on, off or on,off: as the bench's --graphs")
    parser.add_argument("--json", default=None, help="append both runs' JSON lines here")
    args = parser.parse_args(argv)
    common = ["bench", "--preset", args.preset, "--batch-sizes", "1", "--graphs", args.graphs]
    common += ["--json", args.json] if args.json else []
    print("== bf16 and FP8 as the engine picks (weight-only at one token)", flush=True)
    status = cli.main([*common, "--quantize", "none,fp8"])

    def weight_only(device: torch.device, num_tokens) -> bool:
        # scaled_mm at one token wherever the device has it; weight-only only where it has not
        return (torch.compiler.is_compiling() and num_tokens <= fp8.WEIGHT_ONLY_MAX_TOKENS
                and not fp8_rowwise_ok(device, False) and fp8_weight_only_ok(device))

    fp8.use_weight_only = weight_only
    print("== FP8 through row-wise scaled_mm (forced)", flush=True)
    return status or cli.main([*common, "--quantize", "fp8"])


if __name__ == "__main__":
    sys.exit(main())

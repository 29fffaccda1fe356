"""Regenerate server/kernels/mps_plan_ops.json: every aten op (with its tensors' dtypes) that engines planned for
MPS run on tiny checkpoints of each architecture and precision: loading, prefill, eager decode and sampling,
recorded on the CPU (tests/mps_audit.py). `mps-serve info` checks these against the running torch on a Mac;
tests/kernels/test_mps_audit.py fails when the models come to run an op that is not listed here.

Usage, from the repository root: PYTHONPATH=. python tools/mps_ops/record_plan.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from server.kernels.mps_ops import PLAN_OPS  # noqa: E402
from tests.mps_audit import ARCHS, PRECISIONS, record_all  # noqa: E402


def main() -> None:
    ops = record_all()
    table = {name: sorted({dtype for dtypes in dtype_sets for dtype in dtypes}) for name, dtype_sets in sorted(ops.items())}
    header = {"recorded_with": f"torch {torch.__version__}", "architectures": ARCHS, "precisions": PRECISIONS}
    lines = [f"  {json.dumps(name)}: {json.dumps(dtypes)}" for name, dtypes in table.items()]
    body = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in header.items())
    PLAN_OPS.write_text("{\n" + body + ',\n  "ops": {\n' + ",\n".join("  " + line for line in lines) + "\n  }\n}\n")
    print(f"wrote {PLAN_OPS}: {len(table)} ops")


if __name__ == "__main__":
    main()

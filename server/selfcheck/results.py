"""Selfcheck results: one Check per line of the table, the summary line for bug reports, the JSON document."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from server.kernels.capabilities import failure_reason

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


@dataclass
class Check:
    section: str  # kernels | speed | decode | ...
    name: str
    status: str  # PASS | FAIL | SKIP
    detail: str  # what was found, in words: the error and its bound, a rate, or why it was skipped
    values: dict[str, Any] = field(default_factory=dict)  # the numbers behind `detail`, for the JSON
    seconds: float = 0.0


def attempt(section: str, name: str, fn: Callable[[], Check]) -> Check:
    """Run one check; an exception is that check's FAIL with its reason, never the end of the selfcheck."""
    start = time.perf_counter()
    try:
        check = fn()
    except Exception as exc:  # noqa: BLE001 - any failure is the finding
        check = Check(section, name, FAIL, failure_reason(exc))
    check.seconds = time.perf_counter() - start
    return check


def bounded(section: str, name: str, error: float, bound: float, what: str = "rel err") -> Check:
    """PASS when error <= bound (NaN fails)."""
    status = PASS if error <= bound else FAIL
    return Check(section, name, status, f"{what} {error:.2e} (bound {bound:.0e})", {"error": error, "bound": bound})


def table(checks: list[Check]) -> str:
    rows = [(c.section, c.name, c.status, c.detail) for c in checks]
    widths = [max(len(r[i]) for r in rows + [("section", "check", "status", "")]) for i in range(3)]
    lines = [f"{'section':<{widths[0]}}  {'check':<{widths[1]}}  {'status':<{widths[2]}}  detail"]
    lines += [f"{s:<{widths[0]}}  {n:<{widths[1]}}  {st:<{widths[2]}}  {d}" for s, n, st, d in rows]
    return "\n".join(lines)


def counts(checks: list[Check]) -> dict[str, int]:
    return {status: sum(c.status == status for c in checks) for status in (PASS, FAIL, SKIP)}


def summary(system: dict[str, Any], checks: list[Check]) -> str:
    """One line with what a bug report needs: versions, device, chip, the counts and the failed checks."""
    tally = counts(checks)
    failed = [f"{c.section}/{c.name}" for c in checks if c.status == FAIL]
    return (
        f"mps-serve {system['mps_serve']} selfcheck: torch {system['torch']}, {system['device']} "
        f"[{system['chip']}], {system['os']}, python {system['python']}: "
        f"{tally[PASS]} pass, {tally[FAIL]} fail, {tally[SKIP]} skip"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )


def write_json(path: str, system: dict[str, Any], checks: list[Check], capability_lines: list[str]) -> None:
    document = {
        "system": system,
        "capabilities": capability_lines,
        "checks": [asdict(c) for c in checks],
        "counts": counts(checks),
        "summary": summary(system, checks),
    }
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=2, sort_keys=True, default=str) + "\n")

"""`mps-serve selfcheck`: the system, the capability probe, kernels against their twins, speeds, decode; then the
table and the summary line. Exit status 1 when any check failed."""

from __future__ import annotations

import argparse
import logging
import os
import platform
import random
import subprocess
import sys
import time
from typing import Any

import torch

from server.engine.device import mps_unavailable_reason, select_device, select_dtype
from server.kernels.capabilities import REPORT_HINT, Capabilities, Probe, capabilities
from server.selfcheck import decode, kernel_pairs, speed
from server.selfcheck.results import FAIL, PASS, SKIP, Check, counts, summary, table, write_json


def chip_name(device: torch.device) -> str:
    """The accelerator's name on CUDA; else the CPU's (on macOS, the Apple chip)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if platform.system() == "Darwin":
        try:
            done = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  timeout=5)
            if done.returncode == 0 and done.stdout.strip():
                return done.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def system_info(device: torch.device, why: str, dtype: torch.dtype) -> dict[str, Any]:
    from server.version import installed_version

    mac = platform.mac_ver()[0]
    ram = memory_bytes()
    return {
        "mps_serve": installed_version(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "os": f"macOS {mac} {platform.machine()}" if mac else f"{platform.system()} {platform.release()} "
                                                              f"{platform.machine()}",
        "chip": chip_name(device),
        "ram_gb": None if ram is None else round(ram / 1e9, 1),
        "device": str(device),
        "device_reason": why,
        "dtype": str(dtype).removeprefix("torch."),
        "mps": mps_unavailable_reason() or "available",
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else "not available",
    }


def probe_checks(caps: Capabilities) -> list[Check]:
    """Each fast path the probe decides: PASS where it runs; SKIP where the engine uses the reference path
    instead (the reason says why); FAIL where the op ran but gave wrong numbers, which is a torch bug to report."""
    checks = []
    for name, probe in vars(caps).items():
        if not isinstance(probe, Probe):
            continue
        if probe.ok:
            checks.append(Check("probe", name, PASS, probe.reason))
        elif probe.reason.startswith("ArithmeticError"):
            checks.append(Check("probe", name, FAIL, probe.reason))
        else:
            checks.append(Check("probe", name, SKIP, f"reference path used: {probe.reason}"))
    return checks


def fallback_checks(caps: Capabilities) -> list[Check]:
    """Fast paths that passed the probe but raised during the checks: the checks above then passed on the
    reference path, so each of these is a failure of its own."""
    return [Check("fallback", name, FAIL, f"raised at run time; the reference path answered instead: {reason}")
            for name, reason in caps.runtime_failures.items()]


def run_selfcheck(device_name: str, quick: bool, seed: int, log=print) -> tuple[dict[str, Any], list[str], list[Check]]:
    start = time.perf_counter()
    device, why = select_device(device_name)
    dtype = select_dtype("auto", device, "bfloat16")
    system = system_info(device, why, dtype)
    system["quick"], system["seed"] = quick, seed
    log(f"selfcheck on {device} [{system['chip']}], torch {system['torch']}, {system['dtype']}"
        f"{', --quick' if quick else ''} (seed {seed})")
    caps = capabilities(device)
    checks = probe_checks(caps)
    log("kernels against their reference twins ...")
    checks += kernel_pairs.kernel_checks(device, dtype, seed)
    log("copy bandwidth, GEMV, MoE layer ...")
    speed_sizes = speed.QUICK if quick or device.type == "cpu" else speed.FULL
    speed_results, copy_gb_s = speed.speed_checks(device, dtype, speed_sizes)
    checks += speed_results
    log("decode: compiled vs eager, short decodes ...")
    checks += decode.decode_checks(device, dtype, decode.QUICK if quick else decode.FULL,
                                   decode.Copy(speed_sizes.copy_mib, copy_gb_s))
    checks += fallback_checks(caps)
    system["seconds"] = round(time.perf_counter() - start, 1)
    return system, caps.describe(verbose=True), checks


def cmd_selfcheck(args: argparse.Namespace) -> int:
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    if logging.getLogger().level >= logging.INFO:  # the bench's and the engine's info lines would bury the table
        for name in ("server", "torch"):
            logging.getLogger(name).setLevel(logging.WARNING)
    system, capability_lines, checks = run_selfcheck(args.device, args.quick, seed,
                                                     log=lambda line: print(line, file=sys.stderr))
    print(table(checks))
    line = summary(system, checks)
    print(f"\n{line}")
    if args.json_path:
        write_json(args.json_path, system, checks, capability_lines)
    if counts(checks)[FAIL]:
        print(f"\nSome checks failed. {REPORT_HINT}: the summary line above, and the file written by "
              "`mps-serve selfcheck --json selfcheck.json`.", file=sys.stderr)
        return 1
    return 0

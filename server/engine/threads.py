"""How many threads torch's CPU ops use (intra-op parallelism), set once when an engine is built.

torch's default is one thread per core. Its workers spin while they wait for each other, so when another busy
process (or the server's own event loop and tokenizer threads) holds a core, every CPU op waits for a thread
that is not running: short requests slow down by an order of magnitude. The default leaves half the cores to
everything else and stops at 8, past which the matrix sizes of a decode step gain nothing from more threads.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)
MAX_DEFAULT_CPU_THREADS = 8


def default_cpu_threads() -> int:
    """Half the cores this process may run on (SMT siblings count as cores), between 1 and 8."""
    try:
        num_cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity masks
        num_cores = os.cpu_count() or 1
    return max(1, min(MAX_DEFAULT_CPU_THREADS, num_cores // 2))


def apply_cpu_threads(cpu_threads: int | None) -> int:
    """torch.set_num_threads(cpu_threads, or the default when None); returns the number set."""
    num_threads = cpu_threads if cpu_threads is not None else default_cpu_threads()
    if num_threads < 1:
        raise ValueError(f"cpu_threads must be at least 1, got {num_threads}")
    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)
        log.info("torch CPU ops use %d thread(s)", num_threads)
    return num_threads

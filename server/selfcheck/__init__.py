"""`mps-serve selfcheck`: every fast path of this machine against its reference twin, the speeds that decide
whether it serves well, and a PASS/FAIL/SKIP table with a one-line summary to paste into a bug report.

- results: the Check record, the table, the summary line and the JSON document.
- kernel_pairs: each kernel op against its reference twin on fresh random inputs (error vs bound).
- speed: copy bandwidth, GEMV GB/s (model dtype and FP8), one MoE layer grouped vs the host-synced loop.
- decode: the compiled decode step against eager (same tokens); short decodes of a tiny random model (compiled)
  and of a preset that fits the device's memory (eager; tok/s, kernels per step, roofline fraction, through the
  bench).
- run: the command itself.
"""

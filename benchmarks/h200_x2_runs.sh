#!/usr/bin/env bash
# The two-GPU runs recorded in docs/PERF.md (issue 24), one case per device call (each well inside the 10-minute
# call limit). Run on a two-GPU machine from the repo root; results land in $OUT (or ./out).
#   bash benchmarks/h200_x2_runs.sh CASE...
#   next_tp     Qwen3-Next-80B-A3B bf16 (too big for one GPU), tensor parallel 2, batches 1 and 16
#   next_pp     Qwen3-Next-80B-A3B bf16, pipeline parallel 2, batch 1
#   qwen_tp     Qwen3-30B-A3B bf16, tensor parallel 2, batch 1 (eager: distributed engines run uncompiled)
#   qwen_tp1    Qwen3-30B-A3B bf16 on one GPU, batch 1, eager and with CUDA graphs: the side-by-side baseline
set -u
out=${OUT:-out}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
run2() { timeout 560 python3 -m torch.distributed.run --nproc-per-node 2 --master-port 29517 -m server "$@"; }
for case in "$@"; do
  start=$SECONDS
  case $case in
    next_tp) run2 bench --preset qwen3-next-80b-a3b --tensor-parallel 2 --batch-sizes 1,16 --reps 2 \
               --json "$out/next_tp.jsonl" > "$out/next_tp.txt" 2>&1 ;;
    next_pp) run2 bench --preset qwen3-next-80b-a3b --pipeline-parallel 2 --batch-sizes 1 --reps 2 \
               --json "$out/next_pp.jsonl" > "$out/next_pp.txt" 2>&1 ;;
    qwen_tp) run2 bench --preset qwen3-30b-a3b --tensor-parallel 2 --batch-sizes 1 \
               --json "$out/qwen_tp.jsonl" > "$out/qwen_tp.txt" 2>&1 ;;
    qwen_tp1) timeout 560 python3 -m server bench --preset qwen3-30b-a3b --batch-sizes 1 --engine-option compile=off \
                --json "$out/qwen_tp1.jsonl" > "$out/qwen_tp1.txt" 2>&1 &&
              timeout 560 python3 -m server bench --preset qwen3-30b-a3b --batch-sizes 1 \
                --json "$out/qwen_tp1.jsonl" >> "$out/qwen_tp1.txt" 2>&1 ;;
    *) echo "unknown case $case"; exit 2 ;;
  esac
  echo "== $case: exit $? after $((SECONDS - start)) s"
  tail -n 25 "$out/$case.txt"
done

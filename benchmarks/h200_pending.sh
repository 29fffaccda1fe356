#!/usr/bin/env bash
# The issue-5 measurements still pending after session 3, with timeouts that fit what each needs (batch-16
# compile ~80 s, a 35B random build + compile ~3 min). Run on the GPU machine from the repo root, with the
# server wheels carried as `.whl` (see the device README); results land in $OUT (or ./out).
#   bash benchmarks/h200_pending.sh [sse|flex16|qwen36|all]
set -u
out=${OUT:-out}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
what=${1:-all}
if [[ $what == sse || $what == all ]]; then  # GIL hand-over + RequestHandle.forward, landed unmeasured
  timeout 320 python3 benchmarks/sse_delivery.py --preset llama-3.1-8b --streams 16 --reps 2 \
    --json "$out/sse.jsonl" > "$out/sse.txt" 2>&1; grep -v INFO "$out/sse.txt" | tail -4
fi
if [[ $what == flex16 || $what == all ]]; then  # flex at batch 16 with the final mask, sdpa beside it
  for kind in flex sdpa; do
    timeout 200 python3 -m server bench --preset llama-3.1-8b --batch-sizes 1,16 --engine-option decode_attention=$kind \
      --json "$out/llama-$kind.jsonl" > "$out/llama-$kind.txt" 2>&1; grep -A3 "^ *B " "$out/llama-$kind.txt"
  done
fi
if [[ $what == qwen36 || $what == all ]]; then
  timeout 300 python3 benchmarks/decode_breakdown.py --preset qwen3.6-35b-a3b --top 25 > "$out/breakdown-qwen36.txt" 2>&1
  tail -30 "$out/breakdown-qwen36.txt"
fi

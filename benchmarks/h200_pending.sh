#!/usr/bin/env bash
# The issue-5 measurements on the H200 (sessions 4-9), with
# timeouts that fit what each needs (batch-16 compile ~80 s, a 35B random build + compile ~3 min). Run on the GPU machine from the repo root, with the
# server wheels carried as `.whl` (see the device README); results land in $OUT (or ./out).
#   bash benchmarks/h200_pending.sh CASE... (decode sse flex16 sse512 qwen36 gdn warmup prefill kvwrite nographs
#   ssecp llama3 qwen36e2e arrivals arrivalsmain qwen36cp nostatic ssepool sdpa nographsattn autotune kvlayout gemv
#   gemvab gemvbreak spans ssemulti auto autoqwen,
#   or all)
set -u
out=${OUT:-out}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then  # httptools (compiled, manylinux_2_28) apart: uvicorn falls back to h11
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    $(ls .whl/*.whl | grep -v httptools)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/httptools-*.whl 2>/dev/null || echo "httptools did not install: uvicorn runs on h11"
fi
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
cases=" ${*:-all} "
want() { [[ $cases == *" $1 "* || $cases == *" all "* ]]; }
if want decode; then  # session 4: packed step input, feed + greedy argmax in the graph
  timeout 150 python3 benchmarks/flex_decode_check.py --block-sizes 16 --batches 1 --timed-block-size 0 \
    > "$out/parity.txt" 2>&1; grep engine_parity "$out/parity.txt"
  for variant in flex flex-noworkspace sdpa; do  # no cuBLAS workspace: does split-K's reduce kernel go?
    env=(); [[ $variant == flex-noworkspace ]] && env=(CUBLAS_WORKSPACE_CONFIG=:0:0)
    env "${env[@]}" timeout 120 python3 -m server bench --preset llama-3.1-8b --batch-sizes 1 \
      --engine-option decode_attention=${variant%%-*} --json "$out/b1-$variant.jsonl" > "$out/b1-$variant.txt" 2>&1
    grep -A2 "^ *B " "$out/b1-$variant.txt"
  done
  timeout 150 python3 benchmarks/decode_breakdown.py --shape llama-3.1-8b --decode-attention flex --top 25 \
    > "$out/breakdown-llama-flex.txt" 2>&1; tail -32 "$out/breakdown-llama-flex.txt"
fi
if want sse; then  # GIL hand-over + RequestHandle.forward, landed unmeasured
  timeout 320 python3 benchmarks/sse_delivery.py --preset llama-3.1-8b --streams 16 --reps 2 \
    --json "$out/sse.jsonl" > "$out/sse.txt" 2>&1; grep -v INFO "$out/sse.txt" | tail -4
fi
if want flex16; then  # flex at batch 16 with the final mask, sdpa beside it
  for kind in flex sdpa; do
    timeout 170 python3 -m server bench --preset llama-3.1-8b --batch-sizes 1,16 --engine-option decode_attention=$kind \
      --json "$out/llama-$kind.jsonl" > "$out/llama-$kind.txt" 2>&1; grep -A3 "^ *B " "$out/llama-$kind.txt"
  done
fi
if want sse512; then  # longer streams: the arrival ramp amortized as in a chat
  timeout 240 python3 benchmarks/sse_delivery.py --preset llama-3.1-8b --streams 16 --max-tokens 512 --reps 2 \
    --json "$out/sse512.jsonl" > "$out/sse512.txt" 2>&1; grep -v INFO "$out/sse512.txt" | tail -3
fi
if want qwen36; then
  timeout 300 python3 benchmarks/decode_breakdown.py --preset qwen3.6-35b-a3b --top 25 > "$out/breakdown-qwen36.txt" 2>&1
  tail -30 "$out/breakdown-qwen36.txt"
fi
if want gdn; then  # session 5: which GDN decode form moves the state fastest
  timeout 200 python3 benchmarks/gdn_decode.py --batch 1 > "$out/gdn.jsonl" 2>&1; grep '^{' "$out/gdn.jsonl"
  timeout 200 python3 benchmarks/gdn_decode.py --batch 16 --layers 8 >> "$out/gdn.jsonl" 2>&1; grep '^{' "$out/gdn.jsonl" | tail -4
fi
if want warmup; then  # serve's warm-up with a cold, then a warm compile cache (since session 9 it captures every KV bucket too)
  rm -rf /tmp/inductor-warmup
  for run in cold warm; do
    timeout 270 python3 benchmarks/warmup_time.py --preset llama-3.1-8b --cache-dir /tmp/inductor-warmup 2>&1 \
      | grep '^{' | tee -a "$out/warmup.jsonl"
  done
fi
if want prefill; then  # session 5: compile_prefill (TTFT, the SSE ramp), side by side
  for flag in false true; do
    timeout 200 python3 -m server bench --preset llama-3.1-8b --batch-sizes 1,16 --prompt-len 512 --reps 2 \
      --engine-option compile_prefill=$flag --json "$out/prefill-$flag.jsonl" > "$out/prefill-$flag.txt" 2>&1
    grep -A3 "^ *B " "$out/prefill-$flag.txt"
  done
fi
if want kvwrite; then  # session 5: one KV-write kernel per layer instead of two?
  for batch in 1 16; do timeout 120 python3 benchmarks/kv_write.py --batch $batch 2>&1 | grep '^{' | tee -a "$out/kv_write.jsonl"; done
fi
if want nographs; then  # the MPS-like mode (no CUDA graphs): does inductor's C++ wrapper
  for wrapper in ${NOGRAPHS_WRAPPERS:-0 1}; do  # cut the per-kernel launch cost of the compiled step? (env only, no code change needed)
    TORCHINDUCTOR_CPP_WRAPPER=$wrapper timeout 150 python3 -m server bench --preset llama-3.1-8b --batch-sizes 1 \
      --engine-option cuda_graphs=false --json "$out/nographs-cpp$wrapper.jsonl" > "$out/nographs-cpp$wrapper.txt" 2>&1
    grep -A1 "^ *B " "$out/nographs-cpp$wrapper.txt"
  done
fi
if want ssecp; then  # session 5: 16 x 128-token streams with compiled prefill (the arrival ramp)
  timeout 420 python3 benchmarks/sse_delivery.py --preset llama-3.1-8b --streams 16 --reps 2 \
    --engine-option compile_prefill=true --json "$out/sse-cp.jsonl" > "$out/sse-cp.txt" 2>&1
  grep -v INFO "$out/sse-cp.txt" | tail -4
fi
if want llama3; then  # session 5: three batch-1 runs on one machine (the target sits at the machine spread)
  for run in 1 2 3; do
    timeout 110 python3 -m server bench --preset llama-3.1-8b --batch-sizes 1 --engine-option decode_attention=flex \
      --json "$out/llama3.jsonl" > "$out/llama3-$run.txt" 2>&1; grep -A2 "^ *B " "$out/llama3-$run.txt"
  done
fi
if want qwen36e2e; then  # session 5: S^T GDN state + compiled prefill (default on CUDA) on the hybrid, end to end
  timeout 400 python3 -m server bench --preset qwen3.6-35b-a3b --batch-sizes 1 --reps 1 --decode-tokens 64 \
    --json "$out/qwen36.jsonl" > "$out/qwen36.txt" 2>&1; grep -A2 "^ *B " "$out/qwen36.txt" || tail -20 "$out/qwen36.txt"
fi
if want arrivals; then  # sessions 5-6: where 16 SSE requests lose time against one generate call (the ramp)
  # session 6: warm-up and reference on the engine thread (as serve now does), pooled connections
  timeout 400 python3 benchmarks/sse_arrivals.py --preset llama-3.1-8b --reps 4 --open-connections \
    > "$out/arrivals.txt" 2>&1
  grep '^{' "$out/arrivals.txt" | cut -c1-1500 || tail -5 "$out/arrivals.txt"
fi
if want arrivalsmain; then  # the same with warm-up and reference on the main thread (before session 6): the A/B
  timeout 400 python3 benchmarks/sse_arrivals.py --preset llama-3.1-8b --reps 4 --open-connections --main-thread \
    > "$out/arrivals-main.txt" 2>&1
  grep '^{' "$out/arrivals-main.txt" | cut -c1-1500 || tail -5 "$out/arrivals-main.txt"
fi
if want ssepool; then  # session 6: 16 x 128 with the client's connections open before the timed run (pooled)
  timeout 420 python3 benchmarks/sse_delivery.py --preset llama-3.1-8b --streams 16 --reps 3 --open-connections \
    --json "$out/sse-pool.jsonl" > "$out/sse-pool.txt" 2>&1; grep -v INFO "$out/sse-pool.txt" | tail -4
fi
if want nostatic; then  # session 6: no CUDA graphs went 45% -> 30% after session 4 made the decode sizes symbolic
  TORCHINDUCTOR_CPP_WRAPPER=0 timeout 170 python3 -m server bench --preset llama-3.1-8b --batch-sizes 1 \
    --engine-option cuda_graphs=false --engine-option decode_static_shapes=true \
    --json "$out/nographs-static.jsonl" > "$out/nographs-static.txt" 2>&1
  grep -A1 "^ *B " "$out/nographs-static.txt" || tail -5 "$out/nographs-static.txt"
fi
if want qwen36cp; then  # session 5: the hybrid's compiled prefill after the per-layer change (cold compile, prefill)
  timeout 500 python3 -m server bench --preset qwen3.6-35b-a3b --batch-sizes 1 --reps 1 --decode-tokens 64 \
    --engine-option compile_prefill=true --json "$out/qwen36cp.jsonl" > "$out/qwen36cp.txt" 2>&1
  grep -A2 "^ *B " "$out/qwen36cp.txt" || tail -20 "$out/qwen36cp.txt"
fi
if want sdpa; then  # session 7: the first call of SDPA / a linear on a new shape, per backend (cuDNN plans each)
  timeout 120 python3 benchmarks/sdpa_shapes.py 2>&1 | grep '^{' | tee "$out/sdpa_shapes.jsonl" | cut -c1-300
  CUDA_MODULE_LOADING=EAGER timeout 120 python3 benchmarks/sdpa_shapes.py 2>&1 | grep '^{' \
    | tee "$out/sdpa_shapes_eager_loading.jsonl" | cut -c1-300
fi
if want nographsattn; then  # session 7: the no-graph decode graph has symbolic sizes, so SDPA's backend meets new
  for kind in sdpa reduce flex; do  # shapes at run time (cuDNN: a plan each); reduce and flex do not use SDPA
    TORCHINDUCTOR_CPP_WRAPPER=0 timeout 150 python3 -m server bench --preset llama-3.1-8b --batch-sizes 1 \
      --engine-option cuda_graphs=false --engine-option decode_attention=$kind \
      --json "$out/nographs-$kind.jsonl" > "$out/nographs-$kind.txt" 2>&1
    grep -A1 "^ *B " "$out/nographs-$kind.txt" || tail -5 "$out/nographs-$kind.txt"
  done
fi
if want autotune; then  # session 7: qkv (74% of copy speed) and o_proj (71%) GEMVs vs 93% for the big ones:
  # does inductor's GEMM autotuning (Triton templates vs cuBLAS, per decode bucket) find faster kernels? ~0.18 ms
  # per Llama step if both reached 93%. Slow compile: batch 1 only, flex as in the target runs.
  TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1 timeout 500 python3 -m server bench --preset llama-3.1-8b --batch-sizes 1 \
    --engine-option decode_attention=flex --json "$out/autotune.jsonl" > "$out/autotune.txt" 2>&1
  grep -A2 "^ *B " "$out/autotune.txt" || tail -5 "$out/autotune.txt"
fi
if want kvlayout; then  # session 7: kv_layout=combined (one KV scatter per layer; kv_write.py: -0.027 ms per Llama
  for run in 1 2; do  # step at batch 1) against split, alternating on one machine, flex as in the target runs
    for layout in split combined; do
      timeout 140 python3 -m server bench --preset llama-3.1-8b --batch-sizes 1 --engine-option decode_attention=flex \
        --engine-option kv_layout=$layout --json "$out/kvlayout.jsonl" > "$out/kvlayout-$layout-$run.txt" 2>&1
      echo "$layout run $run"; grep -A2 "^ *B " "$out/kvlayout-$layout-$run.txt" || tail -5 "$out/kvlayout-$layout-$run.txt"
    done
  done
fi
if want gemv; then  # session 8: few-token GEMV as cuBLAS, inductor-autotuned or one Triton reduction (qkv / o_proj
  # at 71-74% of copy speed, 64 split-K reduce kernels per step)
  timeout 240 python3 benchmarks/gemv_forms.py --batches 1,4 2>&1 | grep '^{' | tee "$out/gemv_forms.jsonl" | cut -c1-600
fi
if want gemvab; then  # session 8: decode_gemv reduction (o_proj, down as one Triton reduction each; inputs stored
  # first since the first, slower run) and the autotuned batch-1 graph against blas, alternating on one machine,
  for run in ${GEMVAB_RUNS:-1 2}; do  # flex and the combined KV layout as in the target runs
    for variant in decode_gemv=blas decode_gemv=reduction decode_autotune_batch1=true; do
      name=${variant#*_}; name=${name/=/-}
      timeout 200 python3 -m server bench --preset llama-3.1-8b --batch-sizes 1 --engine-option decode_attention=flex \
        --engine-option $variant --json "$out/gemvab.jsonl" > "$out/gemvab-$name-$run.txt" 2>&1
      echo "$variant run $run"; grep -A2 "^ *B " "$out/gemvab-$name-$run.txt" || tail -5 "$out/gemvab-$name-$run.txt"
    done
  done
fi
if want gemvbreak; then  # session 8: why the reduction GEMVs made the step slower (4.71 -> 6.09 ms) in the graph
  timeout 280 python3 benchmarks/decode_breakdown.py --shape llama-3.1-8b --decode-attention flex --top 25 \
    --decode-gemv reduction > "$out/breakdown-llama-reduction.txt" 2>&1; tail -34 "$out/breakdown-llama-reduction.txt"
fi
if want spans; then  # session 8: SSE decode steps ran 7.4-7.5 ms against 7.1 in one generate call (session 7): is the
  # device slower per step, or idle because the host queued late? (device_spans: gpu ms and idle ms per launch)
  timeout 400 python3 benchmarks/sse_arrivals.py --preset llama-3.1-8b --reps 3 --open-connections > "$out/spans.txt" 2>&1
  grep '^{' "$out/spans.txt" | python3 -c 'import json, sys
for d in map(json.loads, sys.stdin):
    print(json.dumps({k: d.get(k) for k in ("run", "rep", "end_ms", "num_steps", "device_gpu_ms", "device_idle_ms",
                                            "device_idle_max_ms", "device_spans")}))' || tail -5 "$out/spans.txt"
fi
if want ssemulti; then  # session 8: ssepool with one client process per stream, all sending at one instant (16
  # independent users); one asyncio client sends its 16 requests over 6-10 ms (session 7's sse_arrivals)
  timeout 420 python3 benchmarks/sse_delivery.py --preset llama-3.1-8b --streams 16 --reps 3 --open-connections \
    --client-processes 16 --json "$out/sse-multi.jsonl" > "$out/sse-multi.txt" 2>&1; grep -v INFO "$out/sse-multi.txt" | tail -4
fi
if want auto; then  # session 9: decode_attention "auto" (the new default: flex in the batch-1 graph, sdpa beyond)
  for run in 1 2; do  # against the explicit sdpa it replaced, alternating on one machine
    for kind in auto sdpa; do
      timeout 200 python3 -m server bench --preset llama-3.1-8b --batch-sizes 1,16 --engine-option decode_attention=$kind \
        --json "$out/auto.jsonl" > "$out/auto-$kind-$run.txt" 2>&1
      echo "$kind run $run"; grep -A3 "^ *B " "$out/auto-$kind-$run.txt" || tail -5 "$out/auto-$kind-$run.txt"
    done
  done
  grep -o '"decode_attention": {[^}]*}' "$out/auto.jsonl" | sort | uniq -c
fi
if want autoqwen; then  # session 9: "auto" puts flex in the batch-1 graph of Qwen3-MoE too (measured on Llama only)
  for kind in auto sdpa; do
    timeout 250 python3 -m server bench --preset qwen3-30b-a3b --batch-sizes 1 --engine-option decode_attention=$kind \
      --json "$out/autoqwen.jsonl" > "$out/autoqwen-$kind.txt" 2>&1
    echo "$kind"; grep -A2 "^ *B " "$out/autoqwen-$kind.txt" || tail -5 "$out/autoqwen-$kind.txt"
  done
fi

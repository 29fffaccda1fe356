#!/usr/bin/env bash
# The GPU runs recorded in docs/PERF.md, one case per device call (each well inside the 10-minute call limit).
# Run on the GPU machine from the repo root; results land in $OUT (or ./out).
#   bash benchmarks/h200_runs.sh CASE...
#   llama      Llama-3.1-8B, batches 1 and 16, with and without CUDA graphs, beside transformers
#   qwen       Qwen3-30B-A3B, batch 1, with and without CUDA graphs
#   qwenfp8    Qwen3-30B-A3B, batch 1, bf16 and FP8 side by side, CUDA graphs, 128-token prompts (QWENFP8_ARGS adds to
#              the bench's arguments: "--prompt-len 2048" for prefill, about 520 s of cold compiles)
#   qwenfp8off the same without CUDA graphs (the Mac-like mode)
#   llamafp8   Llama-3.1-8B, batch 1, bf16 and FP8 side by side, with and without CUDA graphs (LLAMAFP8_GRAPHS=on or
#              off: one of them, when both do not fit one call)
#   structured constrained vs unconstrained decode, Llama-3.1-8B, batches 1 and 16 (benchmarks/structured_decode.py;
#              a synthetic tokenizer of Llama-3's vocabulary size)
#   fp8prefill Llama-3.1-8B, batch 1, bf16 and FP8 side by side, 2,048-token prompts, prefill compiled for both
#   forms      Llama-3.1-8B (FORMS_PRESET), batch 1, CUDA graphs on then off (FORMS_GRAPHS): bf16 and FP8 in decode
#              forms side by side in one process (benchmarks/decode_forms.py; FORMS_FORMS picks forms, default
#              engine,scaled-mm; FORMS_QUANTIZE=none only bf16; FORMS_ARGS adds to the bench's arguments, e.g.
#              "--num-layers 12"; up to FORMS_LIMIT_S, 560 s)
#   selfcheck  `mps-serve selfcheck` on the GPU, its JSON kept
#   startup    Llama-3.1-8B (STARTUP_PRESET) started as `serve` starts (compile in the background), cold then warm compile cache,
#              CUDA graphs on (STARTUP_GRAPHS=off: the Mac-like mode, Python wrapper first, then the C++ wrapper)
#              (cold up to STARTUP_COLD_LIMIT_S, 330 s, warm up to STARTUP_WARM_LIMIT_S, 200 s, 0 skips; partial lines are
#              printed as the stages end): first token, one sequence compiled, all compiled, seconds after the
#              weights are loaded (benchmarks/warmup_time.py); STARTUP_CHILD=off compiles in the serving process
#   ckptstart  STARTUP_PRESET written to disk as a checkpoint (benchmarks/write_checkpoint.py, bf16), then started as
#              `serve` starts it from there, cold cache, STARTUP_GRAPHS: the compile child started before the weights
#              load (on) and after (late), each up to CKPTSTART_LIMIT_S (200 s): what the child's head start saves
#   eagercost  the eager decode rate alone and while the compile runs beside it, Llama-3.1-8B and Qwen3-30B-A3B, cold
#              cache, GIL switch interval 200 and 20 us (EAGERCOST_RUNS="preset:us:child ...", child on|off, each up
#              to EAGERCOST_LIMIT_S; benchmarks/warmup_time.py --eager-only): what the background compile costs the
#              first requests
#   stagedcheck greedy tokens served through every background-compile stage (graph captures beside replays) vs
#              eager, tiny-moe with Qwen3's vocabulary (the sampler's scans at full width; staged_compile_check.py),
#              float32 (STAGEDCHECK_DTYPE): bf16 near-ties among 151,936 logits flip greedy picks
#   breakdown  per-kernel decode breakdown of Qwen3-30B-A3B without graphs (benchmarks/decode_breakdown.py;
#              BREAKDOWN_ARGS="--quantize fp8 --num-layers 12" adds to its arguments; BREAKDOWN_LIMIT_S, 300 s:
#              FP8 at 12 layers, tuned, did not finish in 300 s compiling every batch bucket; "--max-num-seqs 1
#              --eager-prefill" compiles only the one-sequence step; "--prefill --steps 8" profiles 8 prefills of
#              128-token prompts instead: FP8 at 8 layers did not finish its compile in 150 s, bf16 did)
#   fp8reduce  FP8 weight-only reductions at one token op by op beside bf16 and scaled_mm (Qwen3-30B-A3B's experts and
#              lm_head, then Llama-3.1-8B's lm_head, gate_up and down shapes; benchmarks/fp8_reduction_forms.py),
#              each also with inductor's coordinate descent tuning (FP8REDUCE_ONLY=experts, FP8REDUCE_SHAPES= skips the
#              Llama shapes; FP8REDUCE_MATCH="add&norm" only the expert forms so named; the first part up to
#              FP8REDUCE_LIMIT_S, 280 s)
#   moeops     one Qwen3-30B-A3B MoE layer op by op at MOEOPS_TOKENS (128,2048) tokens: bf16 grouped_mm beside FP8
#              scaled_grouped_mm stage by stage, eager, graph replays and compiled (inductor's Triton grouped template
#              under max-autotune; benchmarks/kernels.py), up to MOEOPS_LIMIT_S (300 s)
#   layers     the kernels of one decode step, in order, of 4-layer Qwen3-30B-A3B, Llama-3.1-8B and Qwen3.6-35B-A3B (full widths;
#              LAYERS_PRESETS picks some, LAYERS_ARGS="--quantize fp8" adds to decode_breakdown's arguments, each run up
#              to LAYERS_LIMIT_S, 150 s; only the one-sequence step is compiled)
#   cppwrapper the no-graph decode step with inductor's Python wrapper and its C++ wrapper (the engine's) side by side,
#              each cold in its own compile cache (CPPWRAPPER_RUNS="preset:layers:python|cpp ...", layers 0 = all, each up
#              to CPPWRAPPER_LIMIT_S; benchmarks/launch_wrapper_bench.py): the host's cost per launched kernel
#   nographs   Qwen3-30B-A3B, batch 1, bf16 and FP8 side by side without CUDA graphs (the engine's C++ wrapper) at
#              NOGRAPHS_FP8_LAYERS (12) layers, full widths (the whole model: nographs48)
#   nographs48 Qwen3-30B-A3B, batch 1, without CUDA graphs as the engine builds that step, cold then warm compile cache
#              (NOGRAPHS48_COLD_S, 400 s, then 130 s): the C++ wrapper's build time and what a restart reuses
#   llamaown   Llama-3.1-8B, batch 1, with and without CUDA graphs, no peer (fits one call with a cold cache)
#   gqaforms   decode attention's GQA, query groups folded into SDPA's query axis vs KV heads repeated: the op alone
#              (Qwen3-30B-A3B's heads, batches 1 and 16), then Llama-3.1-8B end to end at batch 16 (GQAFORMS_GRAPHS, on),
#              1,024-token prompts, both forms in one process (benchmarks/decode_attention_forms.py; GQAFORMS_OP=off
#              skips the op part, GQAFORMS_FORMS=repeated runs one form: a cold compile each, ~285 s on an H200)
#   hybrids    Qwen3.6-35B-A3B and LFM2.5-8B-A1B, batch 1, CUDA graphs (HYBRIDS_GRAPHS: on, off or on,off), no peer,
#              each up to HYBRIDS_LIMIT_S (270 s)
set -u
out=${OUT:-out}
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
for case in "$@"; do
  start=$SECONDS
  case $case in
    llama) timeout 560 python3 -m server bench --preset llama-3.1-8b --batch-sizes 1,16 --graphs on,off \
             --compare transformers --json "$out/llama.jsonl" > "$out/llama.txt" 2>&1 ;;
    qwen) timeout 560 python3 -m server bench --preset qwen3-30b-a3b --batch-sizes 1 --graphs on,off \
            --json "$out/qwen.jsonl" > "$out/qwen.txt" 2>&1 ;;
    qwenfp8) timeout 560 python3 -m server bench --preset qwen3-30b-a3b --batch-sizes 1 --quantize none,fp8 \
               ${QWENFP8_ARGS:-} --json "$out/qwenfp8.jsonl" > "$out/qwenfp8.txt" 2>&1 ;;
    qwenfp8off) timeout 560 python3 -m server bench --preset qwen3-30b-a3b --batch-sizes 1 --quantize none,fp8 \
                  --graphs off --json "$out/qwenfp8off.jsonl" > "$out/qwenfp8off.txt" 2>&1 ;;
    llamafp8) timeout 560 python3 -m server bench --preset llama-3.1-8b --batch-sizes 1 --quantize none,fp8 \
                --graphs ${LLAMAFP8_GRAPHS:-on,off} --json "$out/llamafp8.jsonl" > "$out/llamafp8.txt" 2>&1 ;;
    structured) timeout 560 python3 benchmarks/structured_decode.py --preset llama-3.1-8b --batch-sizes ${STRUCTURED_BATCHES:-1,16} \
                  > "$out/structured.txt" 2>&1 ;;
    fp8prefill) timeout ${FP8PREFILL_LIMIT_S:-560} python3 -m server bench --preset llama-3.1-8b --batch-sizes 1 --quantize none,fp8 --graphs off \
                  --prompt-len 2048 --decode-tokens 64 --engine-option compile_prefill=true \
                  --json "$out/fp8prefill.jsonl" > "$out/fp8prefill.txt" 2>&1 ;;
    startup) for limit in ${STARTUP_COLD_LIMIT_S:-330} ${STARTUP_WARM_LIMIT_S:-200}; do [ "$limit" = 0 ] && continue
               timeout $limit python3 \
               benchmarks/warmup_time.py --preset ${STARTUP_PRESET:-llama-3.1-8b} --serve-path --graphs ${STARTUP_GRAPHS:-on} \
               --compile-child ${STARTUP_CHILD:-on} \
               --cache-dir /tmp/startup-${STARTUP_PRESET:-llama-3.1-8b}-${STARTUP_GRAPHS:-on}-${STARTUP_CHILD:-on} 2>&1 \
               | grep '^{\|compiled \|failed\|compile child\|compile cache\|saved a compile\|a saved compile' >> "$out/startup.txt"; done ;;
    ckptstart) ckpt=/tmp/ckpt-${STARTUP_PRESET:-llama-3.1-8b}
               [ -f $ckpt/config.json ] || python3 benchmarks/write_checkpoint.py --preset ${STARTUP_PRESET:-llama-3.1-8b} \
                 --out $ckpt >> "$out/ckptstart.txt" 2>&1
               for child in on late; do rm -rf /tmp/ckptstart-$child
                 timeout ${CKPTSTART_LIMIT_S:-200} python3 benchmarks/warmup_time.py --preset ${STARTUP_PRESET:-llama-3.1-8b} \
                   --checkpoint $ckpt --serve-path --graphs ${STARTUP_GRAPHS:-on} --compile-child $child \
                   --cache-dir /tmp/ckptstart-$child 2>&1 | grep '^{\|compiled \|failed\|compile child\|weights loaded' \
                   >> "$out/ckptstart.txt"; done ;;
    eagercost) for run in ${EAGERCOST_RUNS:-qwen3-30b-a3b:20:on qwen3-30b-a3b:20:off llama-3.1-8b:20:on llama-3.1-8b:20:off}; do
                 set -- ${run//:/ }
                 timeout ${EAGERCOST_LIMIT_S:-150} python3 benchmarks/warmup_time.py --preset $1 --serve-path --eager-only --switch-interval-us $2 \
                   --compile-child $3 --cache-dir /tmp/eagercost-$1-$2-$3 > "$out/eagercost-$1-$2-$3.log" 2>&1
                 grep '^{' "$out/eagercost-$1-$2-$3.log" >> "$out/eagercost.txt"; done ;;
    stagedcheck) timeout 240 python3 benchmarks/staged_compile_check.py --preset tiny-moe --vocab-size 151936 --timeout-s 200 \
                   --dtype ${STAGEDCHECK_DTYPE:-float32} > "$out/stagedcheck.txt" 2>&1 ;;
    forms) timeout ${FORMS_LIMIT_S:-560} python3 benchmarks/decode_forms.py --preset ${FORMS_PRESET:-llama-3.1-8b} \
                --graphs ${FORMS_GRAPHS:-on,off} --forms ${FORMS_FORMS:-engine,scaled-mm} \
                ${FORMS_QUANTIZE:+--quantize $FORMS_QUANTIZE} --json "$out/forms.jsonl" -- ${FORMS_ARGS:-} \
                > "$out/forms.txt" 2>&1 ;;
    selfcheck) timeout 150 python3 -m server selfcheck --json "$out/selfcheck.json" > "$out/selfcheck.txt" 2>&1 ;;
    breakdown) timeout ${BREAKDOWN_LIMIT_S:-300} python3 benchmarks/decode_breakdown.py --preset qwen3-30b-a3b --graphs 0 --top 25 ${BREAKDOWN_ARGS:-} \
                 > "$out/breakdown.json" 2>"$out/breakdown.err" ;;
    fp8reduce) timeout ${FP8REDUCE_LIMIT_S:-280} python3 benchmarks/fp8_reduction_forms.py ${FP8REDUCE_ONLY:+--only $FP8REDUCE_ONLY} \
                 ${FP8REDUCE_MATCH:+--match "$FP8REDUCE_MATCH"} > "$out/fp8reduce.txt" 2>&1
               for shape in ${FP8REDUCE_SHAPES-4096:128256 4096:28672 14336:4096}; do set -- ${shape//:/ }
                 timeout 90 python3 benchmarks/fp8_reduction_forms.py --only lm_head --hidden $1 --vocab $2 2>&1 \
                   | grep "lm_head\|copy" | sed "s/^lm_head/K=$1 N=$2/" >> "$out/fp8reduce.txt"; done ;;
    moeops) timeout ${MOEOPS_LIMIT_S:-300} python3 benchmarks/kernels.py --skip gemv,sampling --tokens ${MOEOPS_TOKENS:-128,2048} \
              --json "$out/moeops.json" > "$out/moeops.txt" 2>&1 ;;
    layers) for p in ${LAYERS_PRESETS:-qwen3-30b-a3b llama-3.1-8b qwen3.6-35b-a3b}; do
              timeout ${LAYERS_LIMIT_S:-150} python3 benchmarks/decode_breakdown.py --preset $p --num-layers 4 --graphs 0 \
                --steps 8 --list-step --max-num-seqs 1 --eager-prefill ${LAYERS_ARGS:-} > "$out/layers-$p.txt" 2>&1; echo "$p: exit $?"; done
            cat "$out"/layers-*.txt > "$out/layers.txt" ;;
    cppwrapper) for run in ${CPPWRAPPER_RUNS:-llama-3.1-8b:0:python llama-3.1-8b:0:cpp qwen3-30b-a3b:12:python qwen3-30b-a3b:12:cpp}; do
                  set -- ${run//:/ }; layers=; [ "$2" = 0 ] || layers="--num-layers $2"
                  TORCHINDUCTOR_CACHE_DIR=/tmp/cppwrapper-$1-$2-$3 timeout ${CPPWRAPPER_LIMIT_S:-140} \
                    python3 benchmarks/launch_wrapper_bench.py --wrapper $3 --preset $1 $layers --batch-sizes 1 --graphs off \
                    --engine-option compile_prefill=false --json "$out/cppwrapper-$1-$2-$3.jsonl" > "$out/cppwrapper-$1-$2-$3.log" 2>&1
                  echo "$run: exit $?" >> "$out/cppwrapper.txt"; grep -i "warn\|ours\|^ *off" "$out/cppwrapper-$1-$2-$3.log" >> "$out/cppwrapper.txt"; done ;;
    nographs) timeout 400 python3 -m server bench --preset qwen3-30b-a3b --num-layers ${NOGRAPHS_FP8_LAYERS:-12} \
                --batch-sizes 1 --quantize none,fp8 --graphs off --json "$out/nographs-fp8.jsonl" > "$out/nographs.txt" 2>&1 ;;
    nographs48) for limit in ${NOGRAPHS48_COLD_S:-400} 130; do
                  timeout $limit python3 -m server bench --preset qwen3-30b-a3b --batch-sizes 1 --graphs off \
                    --json "$out/nographs48.jsonl" >> "$out/nographs48.txt" 2>&1; echo "exit $?" >> "$out/nographs48.txt"; done ;;
    llamaown) timeout 560 python3 -m server bench --preset llama-3.1-8b --batch-sizes 1 --graphs on,off \
                --json "$out/llamaown.jsonl" > "$out/llamaown.txt" 2>&1 ;;
    gqaforms) [ "${GQAFORMS_OP:-on}" = on ] && for b in 1 16; do python3 benchmarks/decode_attention_forms.py --op --batch $b --contexts 256,2048,8192 \
                >> "$out/gqaforms.txt" 2>&1; done
              timeout ${GQAFORMS_LIMIT_S:-480} python3 benchmarks/decode_attention_forms.py --forms ${GQAFORMS_FORMS:-folded,repeated} \
                -- --preset ${GQAFORMS_PRESET:-llama-3.1-8b} \
                --batch-sizes ${GQAFORMS_BATCHES:-16} --prompt-len 1024 --graphs ${GQAFORMS_GRAPHS:-on} --json "$out/gqaforms.jsonl" \
                >> "$out/gqaforms.txt" 2>&1 ;;
    hybrids) for p in qwen3.6-35b-a3b lfm2.5-8b-a1b; do
               timeout ${HYBRIDS_LIMIT_S:-270} python3 -m server bench --preset $p --batch-sizes 1 --graphs ${HYBRIDS_GRAPHS:-on} \
                 --json "$out/hybrids.jsonl" >> "$out/hybrids.txt" 2>&1; echo "$p: exit $?" >> "$out/hybrids.txt"; done ;;
    *) echo "unknown case $case"; exit 2 ;;
  esac
  echo "== $case: exit $? after $((SECONDS - start)) s"
  tail -n 25 "$out/$case.txt" 2>/dev/null || tail -c 3000 "$out/$case.json"
done

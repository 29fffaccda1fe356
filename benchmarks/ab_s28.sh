# session-28 A/B: Qwen3-30B-A3B 12 layers, no graphs, batch 1 and 4, prompt 512; each form cold in its own cache
for v in base:0:reduced topk:1:reduced attn:0:gathered; do set -- ${v//:/ }; start=$SECONDS
  MPS_SERVE_FUSE_TOPK=$2 MPS_SERVE_DECODE_ATTN=$3 TORCHINDUCTOR_CACHE_DIR=/tmp/ab-$1 timeout ${AB_LIMIT_S:-170} \
    python3 -m server bench --preset qwen3-30b-a3b --num-layers 12 --batch-sizes 1,4 --prompt-len 512 --graphs off \
    --json $OUT/ab-$1.jsonl > $OUT/ab-$1.txt 2>&1
  echo "$1: exit $? after $((SECONDS-start)) s"; grep -A3 "^graphs" $OUT/ab-$1.txt; done

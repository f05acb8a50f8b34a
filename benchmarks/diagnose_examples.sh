#!/usr/bin/env bash
# Worked examples for docs/DIAGNOSE.md: record a trace per bottleneck, diagnose it (text + JSON).
# Run from the repository root: bash benchmarks/diagnose_examples.sh
set -euo pipefail
OUT=benchmarks/results/diagnose
PY=${PYTHON:-python}
mkdir -p "$OUT"
W=tests/data/diagnose
example() {  # name, then serve flags
  local name=$1; shift
  rm -f "$OUT/$name.kvtrace"
  $PY -m kvscope serve --no-progress --record "$OUT/$name.kvtrace" "$@" > /dev/null
  $PY -m kvscope diagnose "$OUT/$name.kvtrace" --json "$OUT/$name.json" > "$OUT/$name.txt"
}
example kv-h100-70b --backend sim --model llama-3.3-70b-fp8 --gpu h100-sxm5 --workload mixed --num-requests 160
example prefill-continuous --backend sim --model llama-3.1-8b --gpu h200 --mode continuous --workload $W/long-mix.json
example sjf-starvation --backend sim --model llama-3.3-70b-fp8 --gpu h200 --policy sjf --max-num-seqs 256 \
  --workload $W/sjf-mix.json --num-requests 150
example compute-h200-70b --backend sim --model llama-3.3-70b-fp8 --gpu h200 --max-num-seqs 512 \
  --workload $W/heavy-chat.json --num-requests 300
example tiny-cpu-seqs --model tiny --device cpu --max-num-seqs 2 --workload chat --num-requests 12

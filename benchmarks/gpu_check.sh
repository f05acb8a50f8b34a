#!/usr/bin/env bash
# kvscope GPU check: kernels in bf16 vs references, decode kernel table, end to end vs transformers, a GPU trace.
# Usage: benchmarks/gpu_check.sh RESULTS_DIR [extra gpu_check.py options]   (about 6-8 minutes on an H200)
# Writes RESULTS_DIR/gpu-check.json after every section; the trace goes to traces/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-bench/results}"
shift || true
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
mkdir -p "$OUT" traces
nvidia-smi -L 2>/dev/null || true
# Hard stop under 8 minutes; the JSON keeps every section that finished.
timeout --signal=INT --kill-after=15 465 "$PY" benchmarks/gpu_check.py --out "$OUT" "$@"
rc=$?
echo "gpu_check exit $rc; results in $OUT/gpu-check.json"
exit $rc

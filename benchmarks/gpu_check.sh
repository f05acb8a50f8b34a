#!/usr/bin/env bash
# kvscope GPU check: kernels in bf16 vs references, decode kernel table, end to end vs transformers, a GPU trace.
# Usage: benchmarks/gpu_check.sh [RESULTS_DIR] [extra gpu_check.py options]   (under 8 minutes on an H200)
# Writes RESULTS_DIR/gpu-check.json (default benchmarks/results) after every section; the trace goes to traces/.
# The e2e sections run kvscope's engine, which needs msgspec: where python lacks it and WHEELS
# (default .whl) holds its wheel, it is installed from there into a temporary folder first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-benchmarks/results}"
shift || true
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
WHEELS="${WHEELS:-.whl}"
if ! "$PY" -c "import msgspec" 2>/dev/null && compgen -G "$WHEELS/*.whl" >/dev/null; then
  SITE="$(mktemp -d)"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl \
    && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
mkdir -p "$OUT" traces
nvidia-smi -L 2>/dev/null || true
# Hard stop under 8 minutes; the JSON keeps every section that finished.
timeout --signal=INT --kill-after=15 465 "$PY" benchmarks/gpu_check.py --out "$OUT" "$@"
rc=$?
echo "gpu_check exit $rc; results in $OUT/gpu-check.json"
exit $rc

#!/usr/bin/env bash
# GPU checks for a lent GPU (one H200): build with CUDA, run the CUDA-marked tests and the GPU
# benchmarks. Each section is bounded so the whole script stays under 8 minutes.
#   bash benchmarks/gpu_check.sh            (PYTHON=... to choose the interpreter)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
status=0
run() { echo "+ $*"; timeout "${STEP_TIMEOUT:-240}" "$@" || { echo "FAILED ($?): $*"; status=1; }; }

run "$PY" setup.py -q build_ext --inplace
run "$PY" -m llmmem info

# ---- caching memory pool (issue 5) ----
run "$PY" -m pytest -q -x tests/test_pool_cuda.py
run "$PY" benchmarks/record_traces.py --device cuda   # adds benchmarks/traces/*_cuda.json.gz
run "$PY" benchmarks/run.py --only pool --device cuda --quick

exit $status

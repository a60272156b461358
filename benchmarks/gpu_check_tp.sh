#!/usr/bin/env bash
# GPU checks of tensor parallelism for the lent single-GPU machine (about 2 minutes):
# CUDA tests (layers at world size 1 vs nn.Linear; IPC all-reduce between two processes sharing
# GPU 0, bitwise against the fp32 CPU sum, and its timeout), then the IPC all-reduce benchmark.
# Meant to be called from benchmarks/gpu_check.sh; run from the repository root after building.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 300 "$PY" -m pytest -q -p no:cacheprovider tests/test_parallel_cuda.py
timeout 300 "$PY" benchmarks/bench_comm.py --device cuda --quick

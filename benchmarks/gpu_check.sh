#!/usr/bin/env bash
# The GPU check, for a lent GPU machine (torch, nvcc and pytest already there; nothing installed).
# Builds llmmem in place, runs the CUDA-marked tests, then the GPU benchmarks, and prints a short
# table. The step limits add up to 8 minutes (the device tool allows 10 a call); one hang cannot
# eat the machine. Results (JSON) land in ${OUT:-benchmarks/results}.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-benchmarks/results}
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
status=0

step() {  # step NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  echo "== $name"
  timeout "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log" | tail -n 40
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc in $(( $(date +%s) - t0 )) s"
  [ "$rc" -eq 0 ] || status=1
  printf '%-14s exit %-3s %4s s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" >> "$OUT_DIR/summary.txt"
}

: > "$OUT_DIR/summary.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$OUT_DIR/gpu.txt"
step build 120 env MAX_JOBS=16 "$PY" setup.py -q build_ext --inplace -j 16
step info 30 env PYTHONPATH="$PWD" "$PY" -m llmmem info
step tests 150 env PYTHONPATH="$PWD" "$PY" -m pytest -q -m cuda -p no:cacheprovider tests
step bench 150 env PYTHONPATH="$PWD" "$PY" benchmarks/run.py --device cuda --quick
# auto_checkpoint on Hugging Face Llama and GPT-2 (skips itself when transformers is missing)
step hf_planner 30 env PYTHONPATH="$PWD" "$PY" benchmarks/bench_checkpointing.py --device cuda --hf llama,gpt2 \
  --skip-chain --skip-solver --quick --json "$OUT_DIR/checkpoint_hf.json"
cp benchmarks/results/*.json "$OUT_DIR"/ 2>/dev/null || true

echo
echo "summary"
cat "$OUT_DIR/summary.txt"
exit $status

#!/usr/bin/env bash
# Creates, once, the virtual environment that llmmem's commands run in, then (re)installs llmmem
# into it from this checkout. Idempotent: a second run only rebuilds llmmem (seconds).
#
#   LLMMEM_VENV           where the environment lives (default ~/.cache/llmmem-venv: outside the
#                         checkout, so fresh clones on the same machine reuse the multi-GB torch)
#   LLMMEM_TORCH_VERSION  the torch pinned for tests and CI (default 2.11.0)
#   PYTHON                the interpreter that creates the environment (default python3)
set -euo pipefail

VENV=${LLMMEM_VENV:-$HOME/.cache/llmmem-venv}
TORCH_VERSION=${LLMMEM_TORCH_VERSION:-2.11.0}
TRANSFORMERS_VERSION=5.24.0
MATPLOTLIB_VERSION=3.11.2
TQDM_VERSION=4.70.1
ACCELERATE_VERSION=1.15.0
RUFF_VERSION=0.17.6
PYTHON=${PYTHON:-python3}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
have=$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
if [ "$have" != "$TORCH_VERSION" ]; then
  echo "setup: installing torch==$TORCH_VERSION (a few GB, once)"
  "$VENV/bin/pip" install -q "torch==$TORCH_VERSION"
fi
"$VENV/bin/python" -c 'import pytest, xdist, numpy, setuptools, wheel' 2>/dev/null ||
  "$VENV/bin/pip" install -q pytest pytest-xdist numpy "setuptools>=64" wheel
# What the tests, the main job and the lint use beyond torch: Hugging Face models built from small
# configs (nothing is downloaded) and its Trainer (which needs accelerate), the charts, the progress
# bar, and the linter/formatter CI runs.
EXTRAS=("transformers==$TRANSFORMERS_VERSION" "accelerate==$ACCELERATE_VERSION" "matplotlib==$MATPLOTLIB_VERSION"
  "tqdm==$TQDM_VERSION" "ruff==$RUFF_VERSION")
"$VENV/bin/python" - "${EXTRAS[@]}" <<'PY' 2>/dev/null || "$VENV/bin/pip" install -q "${EXTRAS[@]}"
import sys
from importlib.metadata import version
for spec in sys.argv[1:]:
    name, want = spec.split("==")
    if version(name) != want:
        sys.exit(1)
PY
# No build isolation: the build needs only setuptools (already here) and never torch, and this
# avoids fetching a fresh setuptools for every install. No deps: torch is pinned above.
start=$(date +%s)
"$VENV/bin/pip" install -q --no-build-isolation --no-deps --force-reinstall "$ROOT"
echo "setup: llmmem built and installed in $(( $(date +%s) - start )) s ($VENV)"

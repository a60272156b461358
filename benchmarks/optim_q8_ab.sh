#!/bin/sh
# Builds benchmarks/optim_q8_ab.c with the working tree's csrc/optim/adamw_cpu.c as "new" and
# OLD_REV's (a git revision) as "old", then runs it: see optim_q8_ab.c.
#   sh benchmarks/optim_q8_ab.sh OLD_REV [REPS]
set -e
OLD_REV=${1:?usage: optim_q8_ab.sh OLD_REV [REPS]}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP/old/csrc/optim"
# the old step's own headers sit beside it, so its quoted includes find them first
for f in $(git -C "$ROOT" ls-tree --name-only "$OLD_REV" csrc/optim/); do
  git -C "$ROOT" show "$OLD_REV:$f" >"$TMP/old/$f"
done
F="-std=c11 -O3 -fno-math-errno -fno-trapping-math -ffp-contract=off -pthread -DLLMMEM_DEBUG=0 -I$ROOT/csrc/include -I$ROOT/csrc/common"
CC=${CC:-cc}
$CC $F -Dllmmem_optim_adamw_step=old_adamw_step -D_llmmem_optim_force_isa=old_force_isa \
  -c "$TMP/old/csrc/optim/adamw_cpu.c" -o "$TMP/old.o"
$CC $F -c "$ROOT/csrc/optim/adamw_cpu.c" -o "$TMP/new.o"
$CC $F "$ROOT/benchmarks/optim_q8_ab.c" "$TMP/old.o" "$TMP/new.o" "$ROOT"/csrc/common/*.c \
  "$ROOT/csrc/optim/adamw_check.c" "$ROOT/csrc/optim/adamw_ref.c" "$ROOT/csrc/optim/quantize.c" \
  "$ROOT/csrc/optim/adamw_cuda_stub.c" -o "$TMP/optim_q8_ab" -lm -ldl
"$TMP/optim_q8_ab" ${2:-40}

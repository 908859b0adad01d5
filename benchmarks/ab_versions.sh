#!/bin/bash
# A/B of code versions: the Muon/AdamW ratio of several commits, measured alternately on the same machine.
#
# Why: one run's whole-step ratio moves by +-5% with the machine's noise (see docs/performance.md), so a
# change is judged by alternating the versions on one machine, several repetitions each.
#
#   bash benchmarks/ab_versions.sh prepare base=9a9f29f new=HEAD   # here (needs git): ab/<name>/ per version
#   VARIANTS="base new" REPS=2 bash benchmarks/ab_versions.sh run  # on the GPUs (no git needed); carry "ab"
#
# `run` writes $OUT/<name>-<rep>.log (and the JSON/markdown of each run) and prints each run's ratio line. Each
# run is the ZeRO-2 bf16 Muon and AdamW modes only, $BLOCKS blocks (default 10), no extras: about 40 s on 2 x H200.
# BENCH_ARGS adds flags (BENCH_ARGS=--smoke checks the script on a CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  prepare)
    shift
    for spec in "$@"; do
      name=${spec%%=*}; commit=${spec#*=}
      rm -rf "ab/$name" && mkdir -p "ab/$name"
      # deepspeed/ops/op_builder and deepspeed/ops/csrc link to the top-level folders, where a commit has them.
      paths="deepspeed benchmarks"
      for extra in op_builder csrc; do git cat-file -e "$commit:$extra" 2>/dev/null && paths="$paths $extra"; done
      git archive "$commit" $paths | tar -x -C "ab/$name"
      echo "ab/$name = $(git rev-parse --short "$commit")"
    done ;;
  run)
    out=${OUT:-benchmarks/results/ab}
    mkdir -p "$out"
    for rep in $(seq "${REPS:-2}"); do
      for v in ${VARIANTS:?set VARIANTS to the names given to prepare}; do
        PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/ab/$v" timeout 150 python3 -m torch.distributed.run --standalone \
          --nproc_per_node "${NPROC:-2}" "ab/$v/benchmarks/muon_zero_bench.py" \
          --modes ds-z2-bf16-muon,ds-z2-bf16-adamw --blocks "${BLOCKS:-10}" --ns-timing-steps 0 --profile-steps 0 \
          --standalone-reps 0 --matmul-size 0 --out-dir "$out/$v-$rep" --name ab ${BENCH_ARGS:-} > "$out/$v-$rep.log" 2>&1 \
          || true
        echo "== $v rep $rep: $(grep -E '1.05 x' "$out/$v-$rep.log" || echo 'no result, see the log')"
      done
    done ;;
  *)
    echo "usage: $0 prepare NAME=COMMIT... | run (with VARIANTS, REPS, BLOCKS)" >&2
    exit 2 ;;
esac

#!/usr/bin/env bash
# The benchmark, one command: every mode on one host, interleaved in blocks; JSON, markdown, profile tables and
# (with matplotlib) the chart go to $OUT when set, else benchmarks/results/. Extra arguments pass through to
# muon_zero_bench.py, e.g.
#   bash benchmarks/run_all.sh                      # 2 GPUs, GPT-2 small, micro-batch 8 x 1024
#   NPROC=4 bash benchmarks/run_all.sh --blocks 24
#   bash benchmarks/run_all.sh --model gpt-1.1b     # 1.11B GPT, ZeRO-2 bf16 and DDP; one GPU unless NPROC says
#   TREES="this 0.19.8" bash benchmarks/run_all.sh --model moe-gpt   # 8 experts, top-2: Muon vs AdamW, one GPU
#   bash benchmarks/run_all.sh --experts 8 --top-k 2  # any size as a mixture of experts
#   DS_ACCELERATOR=cpu bash benchmarks/run_all.sh --smoke   # CPU check, two gloo processes
# TREES="this 0.19.8" runs the same benchmark in this checkout and in upstream releases, one after the other, and
# merges the results (benchmarks/run_trees.py; prepare a release first with benchmarks/upstream_tree.py).
set -euo pipefail
cd "$(dirname "$0")/.."
nproc=2
for arg in "$@"; do
    case "$arg" in gpt-1.1b|--model=gpt-1.1b|moe-gpt|--model=moe-gpt) nproc=1 ;; esac
done
export NPROC="${NPROC:-$nproc}"
if [ "${TREES:-this}" != this ]; then
    exec python3 benchmarks/run_trees.py "$@"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec python3 -m torch.distributed.run --standalone --nproc_per_node "$NPROC" \
    benchmarks/muon_zero_bench.py "$@"

#!/usr/bin/env bash
# The benchmark, one command: every mode on one host, interleaved in blocks; JSON, markdown, profile tables and
# (with matplotlib) the chart go to $OUT when set, else benchmarks/results/. Extra arguments pass through to
# muon_zero_bench.py, e.g.
#   bash benchmarks/run_all.sh                      # 2 GPUs, GPT-2 small, micro-batch 8 x 1024
#   NPROC=4 bash benchmarks/run_all.sh --blocks 24
#   DS_ACCELERATOR=cpu bash benchmarks/run_all.sh --smoke   # CPU check, two gloo processes
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec python3 -m torch.distributed.run --standalone --nproc_per_node "${NPROC:-2}" \
    benchmarks/muon_zero_bench.py "$@"

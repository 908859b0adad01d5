#!/bin/bash
# Run test suites on a GPU machine within a time limit and always get the failures back.
#
#   bash tools/gpu_check.sh [SECONDS] [TEST PATHS...]
#
# Defaults: 400 s; the whole unit suite (its GPU paths -- NCCL, CUDA streams, bf16 Newton-Schulz, fused kernels,
# pinned copies -- are what CPU CI cannot reach; on one H100 it took 139 s with WORKERS=10). Tests run 6 at a time
# (WORKERS; each spawns its own ranks; one GPU holds several small tests at once). At the limit pytest gets SIGINT
# rather than being killed, so it still prints which tests failed and how many passed: a cut run is a partial result,
# not a lost one. The full log goes to $OUT/gpu_check.log when OUT is set (the device tool's output folder).
#
# A tree not installed as the `deepspeed` distribution is installed in place first (`pip install -e .`, no
# downloads; its log in gpu_check.log.install): the launcher tests start `accelerate launch` and `deepspeed`,
# which look for it.
#
# On this project's GPU machine, with the wheels staged (../shared/device/stage, carry ".device"):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device/wheels/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD && bash tools/gpu_check.sh 400
set -uo pipefail
cd "$(dirname "$0")/.."
limit=${1:-400}
shift || true
paths=("$@")
[ ${#paths[@]} -eq 0 ] && paths=(unit)
log=${OUT:-/tmp}/gpu_check.log
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# `accelerate launch` and transformers look for an installed `deepspeed` distribution (its metadata), not only an
# importable package, so the launcher tests need this tree installed; on a bare machine install it in place.
if ! python3 -c "import importlib.metadata as m; m.version('deepspeed')" 2>/dev/null; then
    # --use-pep517: without it a recent pip runs setup.py develop, whose setuptools calls pip again with build
    # isolation, which needs the network.
    echo "installing this tree in place (pip install --use-pep517 --no-build-isolation --no-deps -e .)"
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --use-pep517 -e . > "$log.install" 2>&1 \
        || { tail -n 20 "$log.install"; echo "the install failed: the launcher tests in unit/huggingface will fail"; }
fi
(cd tests && DS_UNITTEST_TIMEOUT=${DS_UNITTEST_TIMEOUT:-150} timeout -s INT "$limit" python3 -m pytest "${paths[@]}" \
    -n "${WORKERS:-6}" -q -p no:cacheprovider -rfE > "$log" 2>&1)
status=$?
grep -E "^(FAILED|ERROR) |Greatest|line [0-9]+, in test_" "$log" | head -40
tail -n 1 "$log"
[ $status -eq 124 ] || [ $status -eq 130 ] || grep -q "KeyboardInterrupt" "$log" && echo "cut at ${limit} s: a partial result"
exit $status

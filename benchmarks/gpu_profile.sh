#!/usr/bin/env bash
# Where a warm trakflow pass spends its time on a lent GPU, thread by thread: featurize_bench's worker (TRAKer
# defaults, cold + warm passes) once plain (its times) and once under py-spy (every thread's Python stacks, idle
# time included; py-spy's wheel carried in .whl/). Summarize a stacks file with benchmarks/thread_profile.py.
#
#   OUT=... MODELS="mlp2 convbn" bash benchmarks/gpu_profile.sh     # in the repository root on the device
set -u
OUT=${OUT:-/tmp/gpu_profile}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/pylib:$PWD PYTHONUNBUFFERED=1
for m in ${MODELS:-mlp2 convbn}; do
    spec='{"model": "'$m'", "impl": "factored", "n": 16384, "batch": 1024, "proj_dim": 2048, "warm_runs": 3, "device": "cuda"}'
    timeout "${PLAIN_S:-90}" python3 benchmarks/featurize_bench.py --worker "$spec" >"$OUT/plain_$m.json" 2>"$OUT/plain_$m.log"
    timeout "${SPY_S:-120}" /tmp/site/bin/py-spy record --threads --idle --nonblocking -r "${RATE:-250}" -f raw \
        -o "$OUT/stacks_$m.txt" -- python3 benchmarks/featurize_bench.py --worker "$spec" >"$OUT/spied_$m.json" \
        2>"$OUT/spied_$m.log"
done
[ -z "${CUDA_TESTS:-}" ] || timeout "${TESTS_S:-120}" python3 -m pytest -q -m cuda -p no:cacheprovider -o addopts="-ra" \
    $CUDA_TESTS >"$OUT/cuda_tests.log" 2>&1
echo "done"

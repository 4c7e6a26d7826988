#!/usr/bin/env bash
# The GPU checks and benchmarks of one lent-device session, in one call (docs/gpu.md, "Running on a lent GPU
# machine"): the CUDA tests, traker's fast_jl built on the device, the benchmark matrix's MLP, conv net and
# transformer against traker, the model sizes users run and the host path. Each step has its own time limit and
# writes its report under $OUT as it goes, so a step cut short still leaves what it measured.
#
#   bash benchmarks/gpu_session.sh          # in the repository root on the device; .whl/ carried (docs/gpu.md)
#   TESTS_S, PROFILE_S, MATRIX_S, SIZES_S, HOST_S: each step's time limit in seconds (0 skips it);
#   CUDA_TESTS: the test files to run (default: every file with CUDA tests)
set -u
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/pylib:$PWD PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    nproc
    python3 -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)"
} >"$OUT/env.txt" 2>&1

# traker's GPU kernel, fast_jl: its setup.py needs a CUDA torch, so it is built here (sdist carried in .whl/). Its
# setup.py pins TORCH_CUDA_ARCH_LIST to 7.0+PTX, which CUDA 13's nvcc no longer accepts: the build names the
# device's own architecture instead (FASTJL_ARCH, e.g. 9.0 for an H100 / H200).
(
    SECONDS=0
    rm -rf /tmp/fjsrc && mkdir -p /tmp/fjsrc && tar xzf .whl/fast_jl-*.tar.gz -C /tmp/fjsrc
    sed -i "s/^environ\['TORCH_CUDA_ARCH_LIST'\].*/environ['TORCH_CUDA_ARCH_LIST'] = '${FASTJL_ARCH:-9.0}'/" \
        /tmp/fjsrc/fast_jl-*/setup.py
    python3 -m pip install --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/fj /tmp/fjsrc/fast_jl-*/
    echo "build seconds: $SECONDS"
) >"$OUT/fastjl.log" 2>&1 &
build=$!

# where a warm trakflow pass spends its time on the GPU (cProfile of one featurize_bench worker: cold + 2 warm passes)
[ "${PROFILE_S:-120}" = 0 ] || timeout "${PROFILE_S:-120}" python3 -m cProfile -o /tmp/prof.out benchmarks/featurize_bench.py --worker \
    '{"model": "mlp2", "impl": "factored", "n": 16384, "batch": 1024, "proj_dim": 2048, "warm_runs": 2, "device": "cuda"}' \
    >/dev/null 2>&1
[ -f /tmp/prof.out ] && python3 -c "import pstats; s = pstats.Stats('/tmp/prof.out'); s.sort_stats('tottime').print_stats(30); \
s.sort_stats('cumulative').print_stats(40)" >"$OUT/profile_factored.txt" 2>&1

[ "${TESTS_S:-200}" = 0 ] || timeout "${TESTS_S:-200}" python3 -m pytest -q -m cuda -p no:cacheprovider -o addopts="-ra" \
    ${CUDA_TESTS:-tests/trak_core/test_causal_lm.py tests/trak_core/test_sjlt_factored.py \
    tests/trak_core/test_factored_attention.py tests/trak_core/test_factored_mha.py tests/trak_core/test_finalize_fast.py tests/trak_core/test_projector_contract.py tests/compat/test_gpu_traker.py \
    tests/cuda_ext/test_cuda_ext.py} >"$OUT/cuda_tests.log" 2>&1
echo "pytest exit: $?" >>"$OUT/cuda_tests.log"

wait $build
if PYTHONPATH=/tmp/fj:$PYTHONPATH python3 -c "import torch, fast_jl" >>"$OUT/fastjl.log" 2>&1; then
    export PYTHONPATH=/tmp/fj:$PYTHONPATH
    echo "fast_jl imports" >>"$OUT/fastjl.log"
fi

[ "${MATRIX_S:-220}" = 0 ] || timeout "${MATRIX_S:-220}" python3 benchmarks/matrix.py --device cuda --models mlp2 convbn encoder --proj-dims 2048 \
    --n 16384 --batch 1024 --json "$OUT/matrix_cuda.json" >"$OUT/matrix_cuda.md" 2>&1
[ "${SIZES_S:-150}" = 0 ] || timeout "${SIZES_S:-150}" python3 benchmarks/sizes.py --device cuda --models resnet18 gpt2 --rows 256 --batch 32 --passes 2 \
    >"$OUT/sizes_cuda.md" 2>&1
[ "${HOST_S:-60}" = 0 ] || timeout "${HOST_S:-60}" python3 benchmarks/host_path.py --n 65536 --threads 1 --repeats 2 \
    --paths traker traker-behind shard floor --batches 2048 >"$OUT/host_path.md" 2>&1
echo "done"

#!/usr/bin/env bash
# The GPU checks and benchmarks of one lent-device session, in one call of about 7–8 minutes (docs/gpu.md, "Running
# on a lent GPU machine"): the CUDA tests; GPT-2 small (124M) and a ~1B GPT-2-shaped model (random init from a
# config) featurized against a training step of the same batches (rows/s, peak GPU memory); the conv net against
# traker (BasicSingleBlockProjector, and fast_jl's CudaProjector where fast_jl builds); the host path (µs a row); a
# memory budget (max_memory) against the measured peak.
# Each step runs under its own `timeout` and writes its report under $OUT as it goes; a step that fails or runs out
# of time is recorded in status.txt and the next one runs. results.md gathers the tables at the end.
#
#   OUT=$OUT bash benchmarks/gpu_session.sh             # on the device, in the repository root; .whl/ carried
#   SMOKE=1 OUT=/tmp/s bash benchmarks/gpu_session.sh   # on a CPU machine: every step at tiny sizes (no .whl needed)
#   TESTS_S, SIZES_S, MATRIX_S, HOST_S, BUDGET_S, FASTJL_S: each step's time limit in seconds (0 skips it);
#   CUDA_TESTS: the test files to run (default: tests/cuda_ext and every other file with CUDA tests)
set -u
OUT=${OUT:-/tmp/gpu_session}
SMOKE=${SMOKE:-0}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
: >"$OUT/status.txt"
if [ "$SMOKE" = 1 ]; then DEV=cpu; else DEV=cuda; fi

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        || echo "install rc=$?" >>"$OUT/status.txt"
    export PYTHONPATH=/tmp/site:$PWD/.whl/pylib:$PWD
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
    echo "cores: $(nproc)"
    $PY -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__, \
'cuda' if torch.cuda.is_available() else 'no cuda')"
} >"$OUT/env.txt" 2>&1

# step NAME LIMIT_S COMMAND...: the command's output to $OUT/NAME.md, its exit status and seconds to status.txt
step() {
    local name=$1 limit=$2 t0=$SECONDS rc
    shift 2
    if [ "$limit" = 0 ]; then
        echo "$name: skipped (limit 0)" >>"$OUT/status.txt"
        return
    fi
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.md" 2>&1
    rc=$?
    case $rc in
    0) echo "$name: ok, $((SECONDS - t0)) s" >>"$OUT/status.txt" ;;
    124 | 137) echo "$name: cut at its ${limit} s limit (what it wrote is kept)" >>"$OUT/status.txt" ;;
    *) echo "$name: failed, exit $rc after $((SECONDS - t0)) s (see $name.md)" >>"$OUT/status.txt" ;;
    esac
}

# traker's GPU kernel, fast_jl, built on the device in the background (its setup.py needs a CUDA torch; it pins
# TORCH_CUDA_ARCH_LIST to 7.0+PTX, which CUDA 13's nvcc no longer accepts: FASTJL_ARCH names the device's, 9.0)
build=
if [ "$SMOKE" != 1 ] && [ "${FASTJL_S:-200}" != 0 ] && ls .whl/fast_jl-*.tar.gz >/dev/null 2>&1; then
    (
        SECONDS=0
        rm -rf /tmp/fjsrc && mkdir -p /tmp/fjsrc && tar xzf .whl/fast_jl-*.tar.gz -C /tmp/fjsrc
        sed -i "s/^environ\['TORCH_CUDA_ARCH_LIST'\].*/environ['TORCH_CUDA_ARCH_LIST'] = '${FASTJL_ARCH:-9.0}'/" \
            /tmp/fjsrc/fast_jl-*/setup.py
        timeout "${FASTJL_S:-200}" $PY -m pip install --no-index --no-deps --no-build-isolation --no-cache-dir \
            --target /tmp/fj /tmp/fjsrc/fast_jl-*/
        echo "build exit $?, $SECONDS s"
    ) >"$OUT/fastjl.log" 2>&1 &
    build=$!
else
    echo "fast_jl: not built (smoke run, FASTJL_S=0 or no .whl/fast_jl-*.tar.gz)" >"$OUT/fastjl.log"
fi

# 1. the CUDA tests (skipped, not failed, without a GPU)
step cuda_tests "${TESTS_S:-100}" $PY -m pytest -q -m cuda -p no:cacheprovider -o addopts="-ra" \
    ${CUDA_TESTS:-tests/cuda_ext tests/trak_core/test_causal_lm.py tests/trak_core/test_sjlt_factored.py \
    tests/trak_core/test_factored_attention.py tests/trak_core/test_factored_mha.py tests/trak_core/test_finalize_fast.py \
    tests/trak_core/test_projector_contract.py tests/compat/test_gpu_traker.py}

# 2. GPT-2 124M and ~1B: featurize (TRAKer defaults, proj_dim 2048) against a training step of the same batches
if [ "$SMOKE" = 1 ]; then
    step sizes "${SIZES_S:-170}" $PY benchmarks/sizes.py --device cpu --models gpt2-tiny --rows 8 --batch 4 \
        --seq-len 16 --proj-dim 64 --what train featurize --timeout 300
else
    step sizes "${SIZES_S:-170}" $PY benchmarks/sizes.py --device cuda --models gpt2 gpt2-1b --rows 128 --batch 16 \
        --seq-len 128 --passes 2 --what train featurize --timeout 80
fi

# 3. the conv net against traker (+ fast_jl where it built)
if [ -n "$build" ]; then
    wait "$build"
    if PYTHONPATH=/tmp/fj:$PYTHONPATH $PY -c "import torch, fast_jl" >>"$OUT/fastjl.log" 2>&1; then
        export PYTHONPATH=/tmp/fj:$PYTHONPATH
        echo "fast_jl imports" >>"$OUT/fastjl.log"
    else
        echo "fast_jl does not import: the traker + fast_jl column is skipped" >>"$OUT/fastjl.log"
    fi
fi
if [ "$SMOKE" = 1 ]; then
    step matrix_conv "${MATRIX_S:-90}" $PY benchmarks/matrix.py --device cpu --models convbn --proj-dims 64 --n 128 \
        --batch 64 --traker-max-gib 0.5 --json "$OUT/matrix_conv.json"
else
    step matrix_conv "${MATRIX_S:-90}" $PY benchmarks/matrix.py --device cuda --models convbn --proj-dims 2048 \
        --n 16384 --batch 1024 --json "$OUT/matrix_conv.json"
fi

# 4. the host path, µs a row (goal: ≤ 5)
if [ "$SMOKE" = 1 ]; then
    step host_path "${HOST_S:-40}" $PY benchmarks/host_path.py --smoke
else
    step host_path "${HOST_S:-40}" $PY benchmarks/host_path.py --n 65536 --threads 1 --repeats 2 \
        --paths traker shard floor --batches 2048
fi

# 5. a memory budget against the measured peak (torch's allocated memory on the GPU)
if [ "$SMOKE" = 1 ]; then
    step budget "${BUDGET_S:-40}" $PY benchmarks/budget_check.py --smoke
else
    step budget "${BUDGET_S:-40}" $PY benchmarks/budget_check.py --device cuda --model gpt2 --rows 64 --seq-len 128
fi

# results.md: the environment, each step's status, the CUDA tests' summary line and the steps' tables
{
    printf '# GPU session results\n\n## Machine\n\n'
    sed 's/^/    /' "$OUT/env.txt"
    printf '\n## Steps\n\n'
    sed 's/^/- /' "$OUT/status.txt"
    printf '\n## CUDA tests\n\n'
    { grep -E ' passed| failed| skipped|error' "$OUT/cuda_tests.md" 2>/dev/null || echo "(no summary line)"; } | tail -n 1
    printf '\n## fast_jl\n\n%s\n' "$(grep . "$OUT/fastjl.log" | tail -n 1)"
    for s in "sizes:GPT-2 124M and ~1B: featurize against a training step of the same batches" \
        "matrix_conv:Conv net against traker (+ fast_jl)" "host_path:Host path (µs a row)" \
        "budget:Memory budget against the measured peak"; do
        printf '\n## %s\n\n' "${s#*:}"
        grep '^|' "$OUT/${s%%:*}.md" 2>/dev/null || echo "(no table: see ${s%%:*}.md)"
    done
} >"$OUT/results.md"
echo "done: $OUT/results.md"

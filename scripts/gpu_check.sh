#!/usr/bin/env bash
# The checks that need an NVIDIA GPU (docs/GPU.md), for a machine that has one and a Python with a
# CUDA build of torch: builds the package with that Python, runs the CUDA tests (and the API tests
# with CUDA present, which must behave as on a CPU-only machine), then bench/gpu_bench.py with the
# arguments given. Logs and the benchmark's JSON go to $OUT (default: build/gpu_check).
#   scripts/gpu_check.sh                      # tests, then the benchmark at 1, 8 and 32 GiB
#   scripts/gpu_check.sh --gib 1,8 --runs 3   # benchmark arguments
#   GPU_CHECK_TESTS_ONLY=1 scripts/gpu_check.sh   # no benchmark; GPU_CHECK_API=0: no API tests
# The build needs libzstd's header and library; where they are not installed, point
# CMAKE_INCLUDE_PATH / CMAKE_LIBRARY_PATH (and LD_LIBRARY_PATH) at a copy.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT="${OUT:-build/gpu_check}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
export PYTHONUNBUFFERED=1 SHARDPOINT_QUIET=1
SITE="$(mktemp -d)"
echo "== build ($($PY -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)'))"
start=$(date +%s)
if ! $PY -m pip install -q --no-build-isolation --no-deps --target "$SITE" \
    --config-settings=build-dir="${GPU_CHECK_BUILD_DIR:-build/gpu_python}" . > "$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"; echo "build failed"; exit 1
fi
echo "built in $(( $(date +%s) - start )) s"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
echo "== pytest: CUDA tests"
$PY -m pytest -q -p no:cacheprovider python/tests/test_cuda.py python/tests/test_fill.py \
    python/tests/test_pinned_pool.py -rs 2>&1 | tee "$OUT/pytest_cuda.log" | tail -25
cuda_rc=${PIPESTATUS[0]}
api_rc=0
if [ "${GPU_CHECK_API:-1}" != 0 ]; then
  echo "== pytest: API tests with CUDA present"
  $PY -m pytest -q -p no:cacheprovider python/tests/test_api.py python/tests/test_async.py \
      python/tests/test_dtensor.py python/tests/test_stateful.py python/tests/test_dcp_storage.py 2>&1 \
      | tee "$OUT/pytest_api.log" | tail -6
  api_rc=${PIPESTATUS[0]}
fi
bench_rc=0
if [ -z "${GPU_CHECK_TESTS_ONLY:-}" ]; then
  echo "== bench/gpu_bench.py $*"
  (cd bench && $PY gpu_bench.py --json "$OUT/gpu_bench.json" "$@") 2>&1 | tee "$OUT/gpu_bench.log" | tail -80
  bench_rc=${PIPESTATUS[0]}
fi
echo "== rc: cuda tests $cuda_rc, api tests $api_rc, bench $bench_rc"
[ "$cuda_rc" -eq 0 ] && [ "$api_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]

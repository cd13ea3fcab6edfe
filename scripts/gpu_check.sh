#!/usr/bin/env bash
# The checks that need an NVIDIA GPU (docs/GPU.md), for a machine that has one and a Python with a
# CUDA build of torch: builds the package with that Python, runs the CUDA tests (and the API tests
# with CUDA present, which must behave as on a CPU-only machine), then bench/gpu_bench.py with the
# arguments given. Logs and the benchmark's JSON go to $OUT (default: build/gpu_check).
#   scripts/gpu_check.sh                      # tests, then the benchmark at 1, 8 and 32 GiB
#   scripts/gpu_check.sh --gib 1,8 --runs 3   # benchmark arguments
#   GPU_CHECK_TESTS_ONLY=1 scripts/gpu_check.sh   # no benchmark; GPU_CHECK_API=0: no API tests
#   GPU_CHECK_BENCH_ONLY=1 scripts/gpu_check.sh --gib 32 --steps raw,sp-save   # no tests
# The build needs the headers and libraries of libzstd and libcurl. Where they are not installed,
# GPU_CHECK_DEPS=DIR names a root holding them as Debian's packages unpack (usr/include,
# usr/include/x86_64-linux-gnu/curl, usr/lib/x86_64-linux-gnu: e.g. `dpkg -x` of libzstd-dev,
# libzstd1, libcurl4-openssl-dev and libcurl4 with its libraries); the machine's own libraries are
# taken where it has them. GPU_CHECK_SITE=DIR installs the package there (default: a new temporary
# folder), so that a later run on the same machine can reuse the build (GPU_CHECK_NO_BUILD=1).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT="${OUT:-build/gpu_check}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
export PYTHONUNBUFFERED=1 SHARDPOINT_QUIET=1
SITE="${GPU_CHECK_SITE:-$(mktemp -d)}"
mkdir -p "$SITE"
defines=()
if [ -n "${GPU_CHECK_DEPS:-}" ]; then
  deps="$(cd "$GPU_CHECK_DEPS" && pwd)"
  lib=/usr/lib/x86_64-linux-gnu
  # use_dep HEADER INCLUDE_DIR NAME SONAME: where HEADER is missing, CMake's NAME_INCLUDE_DIR and
  # NAME_LIBRARY point into $deps (the machine's own SONAME where it has one).
  use_dep() {
    echo "#include <$1>" | ${CC:-cc} -E -x c - > /dev/null 2>&1 && return
    defines+=(--config-settings=cmake.define.$3_INCLUDE_DIR="$2")
    if [ -e "$lib/$4" ]; then
      defines+=(--config-settings=cmake.define.$3_LIBRARY="$lib/$4")
    else
      defines+=(--config-settings=cmake.define.$3_LIBRARY="$deps$lib/$4")
      case ":${LD_LIBRARY_PATH:-}:" in *":$deps$lib:"*) ;; *)
        export LD_LIBRARY_PATH="$deps$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}";; esac
    fi
    echo "$1: from $deps"
  }
  use_dep zstd.h "$deps/usr/include" ZSTD libzstd.so.1
  use_dep curl/curl.h "$deps/usr/include/x86_64-linux-gnu" CURL libcurl.so.4
fi
echo "== build ($($PY -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)'))"
start=$(date +%s)
if [ -n "${GPU_CHECK_NO_BUILD:-}" ] && [ -d "$SITE/shardpoint" ]; then
  echo "reusing the package in $SITE"
elif ! $PY -m pip install -q --no-build-isolation --no-deps --target "$SITE" --upgrade "${defines[@]}" \
    --config-settings=build-dir="${GPU_CHECK_BUILD_DIR:-build/gpu_python}" . > "$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"; echo "build failed"; exit 1
else
  echo "built in $(( $(date +%s) - start )) s"
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
cuda_rc=0
api_rc=0
if [ -z "${GPU_CHECK_BENCH_ONLY:-}" ]; then
  echo "== pytest: CUDA tests"
  $PY -m pytest -q -p no:cacheprovider python/tests/test_cuda.py python/tests/test_fill.py \
      python/tests/test_pinned_pool.py python/tests/test_batch_lanes.py python/tests/test_pipeline.py -rs 2>&1 \
      | tee "$OUT/pytest_cuda.log" | tail -25
  cuda_rc=${PIPESTATUS[0]}
fi
if [ "${GPU_CHECK_API:-1}" != 0 ] && [ -z "${GPU_CHECK_BENCH_ONLY:-}" ]; then
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

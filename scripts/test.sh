#!/usr/bin/env bash
# Sets up a fresh machine, builds shardpoint and runs every test: the GoogleTest suites through
# ctest (unit, store conformance, randomized resharding, failure injection, MPI when available),
# then the fuzz targets for a bounded time.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh build

echo "== ctest"
(cd build && ctest --output-on-failure -j "$(nproc)" --timeout 1200) 2>&1 | tee build/ctest.log | grep -vE "^ *[0-9]+/[0-9]+ Test +#[0-9]+: .* Passed" || true
grep -qE "^100% tests passed" build/ctest.log || { echo "ctest failed"; exit 1; }

if [ -x fuzz/run_fuzzers.sh ] && command -v clang++ >/dev/null; then
  echo "== fuzzers (${FUZZ_SECONDS:-30} s each)"
  fuzz/run_fuzzers.sh "${FUZZ_SECONDS:-30}" > build/fuzz.log 2>&1 || { tail -50 build/fuzz.log; echo "fuzzers failed"; exit 1; }
  grep -E "^(== |Done [0-9]+ runs)" build/fuzz.log
fi

echo "== summary"
grep -E "^[0-9]+% tests passed" build/ctest.log
echo "== all tests passed"

#!/usr/bin/env bash
# The bounded fuzzing sample CI runs: builds the fuzz targets (clang, ASan + UBSan, libFuzzer),
# seeds them and runs each for SECONDS (9 targets: 20 s each keeps the runs near 3 minutes).
# Usage: fuzz/run_fuzzers.sh SECONDS [BUILD_DIR]
# BUILD_DIR may be the build directory of scripts/sanitizers.sh asan, which builds the same
# instrumentation (one compilation for both). Exits non-zero when a target finds something; the
# reproducer is left in BUILD_DIR/fuzz-runs/ (fuzz/campaign.sh runs the long campaign).
set -euo pipefail

seconds="${1:?usage: fuzz/run_fuzzers.sh SECONDS [BUILD_DIR]}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${2:-${root}/build-fuzz}"
source "${root}/fuzz/fuzz_lib.sh"

sp_fuzz_configure "${root}" "${build}"
sp_fuzz_build "${build}"
out="${build}/fuzz-runs"
rm -rf "${out}" "${build}/corpus"
sp_fuzz_seed "${root}" "${build}" "${build}/corpus"

status=0
for target in "${SP_FUZZ_TARGETS[@]}"; do
  echo "== ${target}_fuzz for ${seconds} s"
  sp_fuzz_run "${build}" "${target}" "${build}/corpus" "${out}" -max_total_time="${seconds}" || status=1
  grep -E "^Done [0-9]+ runs" "${out}/${target}.log" || tail -30 "${out}/${target}.log"
  sp_fuzz_summary "${out}" "${target}" "${build}"
done
exit "${status}"

#!/usr/bin/env bash
# The bounded fuzzing sample CI runs: builds the fuzz targets (clang, ASan + UBSan, libFuzzer),
# seeds them and runs each for SECONDS, SP_FUZZ_JOBS targets at a time (default: the cores; each
# target is one process with its own corpus and log). 9 targets of 20 s, two at a time, take
# about 100 s.
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

jobs="${SP_FUZZ_JOBS:-$(nproc)}"
status=0
targets=("${SP_FUZZ_TARGETS[@]}")
for ((first = 0; first < ${#targets[@]}; first += jobs)); do
  batch=("${targets[@]:first:jobs}")
  pids=()
  for target in "${batch[@]}"; do
    sp_fuzz_run "${build}" "${target}" "${build}/corpus" "${out}" -max_total_time="${seconds}" &
    pids+=("$!")
  done
  # Reported in the targets' order once the batch is done; any target's failure fails the run.
  for i in "${!batch[@]}"; do
    target="${batch[i]}"
    wait "${pids[i]}" || status=1
    echo "== ${target}_fuzz for ${seconds} s"
    grep -E "^Done [0-9]+ runs" "${out}/${target}.log" || tail -30 "${out}/${target}.log"
    sp_fuzz_summary "${out}" "${target}" "${build}"
  done
done
exit "${status}"

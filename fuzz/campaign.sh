#!/usr/bin/env bash
# The long fuzzing campaign: builds every target (clang, ASan + UBSan, libFuzzer), seeds it and
# runs it for EXECUTIONS executions (-runs), JOBS targets at a time, then prints per target the
# executions done, exec/s, coverage at start and end, new inputs and findings.
# Usage: fuzz/campaign.sh EXECUTIONS [JOBS] [BUILD_DIR]
#   e.g. fuzz/campaign.sh 10000000 8   (the issue's campaign: >= 10 million per target)
# Findings (a crash, a sanitizer report, a leak, an input over the memory or time limits of
# fuzz/fuzz_lib.sh) make it exit 1; the reproducer stays in BUILD_DIR/campaign/<target>-*,
# the corpus grown by the campaign in BUILD_DIR/campaign/corpus/<target>/, the logs in
# BUILD_DIR/campaign/<target>.log. Replay a reproducer with BUILD_DIR/fuzz/<target>_fuzz FILE.
set -euo pipefail

executions="${1:?usage: fuzz/campaign.sh EXECUTIONS [JOBS] [BUILD_DIR]}"
jobs="${2:-1}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${3:-${root}/build-fuzz}"
source "${root}/fuzz/fuzz_lib.sh"

sp_fuzz_configure "${root}" "${build}"
sp_fuzz_build "${build}"
out="${build}/campaign"
rm -rf "${out}"
sp_fuzz_seed "${root}" "${build}" "${out}/corpus"

echo "== ${#SP_FUZZ_TARGETS[@]} targets, ${executions} executions each, ${jobs} at a time"
started=$(date +%s)
for target in "${SP_FUZZ_TARGETS[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "${jobs}" ]; do wait -n || true; done
  echo "   start ${target}_fuzz"
  sp_fuzz_run "${build}" "${target}" "${out}/corpus" "${out}" -runs="${executions}" &
done
wait
status=0
echo "== results after $(( $(date +%s) - started )) s"
for target in "${SP_FUZZ_TARGETS[@]}"; do
  sp_fuzz_summary "${out}" "${target}"
  # A target that stopped early without a reproducer (killed, out of memory) is a failure too.
  if [ -n "$(find "${out}" -maxdepth 1 -name "${target}-*" -type f)" ] ||
     ! grep -qE "^Done [0-9]+ runs" "${out}/${target}.log"; then status=1; fi
done
[ "${status}" -eq 0 ] && echo "== no findings" || echo "== findings: see the reproducers above"
exit "${status}"

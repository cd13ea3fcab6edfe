#!/usr/bin/env bash
# The long fuzzing campaign: builds every target (clang, ASan + UBSan, libFuzzer), seeds it and
# runs it for EXECUTIONS executions (-runs), JOBS targets at a time, then prints per target the
# executions done, exec/s, coverage at start and end, new inputs and findings.
# Usage: fuzz/campaign.sh EXECUTIONS [JOBS] [BUILD_DIR] [TARGET...]
#   e.g. fuzz/campaign.sh 10000000 8   (the release campaign: >= 10 million per target)
# SP_FUZZ_WORKERS=W runs each target as W processes (each a job) that share its corpus, each
# running EXECUTIONS/W executions: on an idle machine with more cores than targets, the same
# campaign in a fraction of the time. The summary adds up the workers' executions.
# With TARGETs (names without _fuzz), only those run, each from fresh seeds, and the results of
# the other targets from an earlier run in BUILD_DIR stay and are listed too: on a small machine
# the campaign can be run a few targets at a time. BUILD_DIR/campaign/<target>.info records the
# commit and the time each target's run started.
# Findings (a crash, a sanitizer report, a leak, an input over the memory or time limits of
# fuzz/fuzz_lib.sh) make it exit 1; the reproducer stays in BUILD_DIR/campaign/<target>-*,
# the corpus grown by the campaign in BUILD_DIR/campaign/corpus/<target>/, the logs in
# BUILD_DIR/campaign/<target>.log. Replay a reproducer with BUILD_DIR/fuzz/<target>_fuzz FILE.
set -euo pipefail

executions="${1:?usage: fuzz/campaign.sh EXECUTIONS [JOBS] [BUILD_DIR]}"
jobs="${2:-1}"
workers="${SP_FUZZ_WORKERS:-1}"
[[ "${workers}" =~ ^[1-9][0-9]*$ ]] || { echo "SP_FUZZ_WORKERS must be a positive number" >&2; exit 2; }
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${3:-${root}/build-fuzz}"
shift $(( $# < 3 ? $# : 3 ))
source "${root}/fuzz/fuzz_lib.sh"
selected=("$@")
[ "${#selected[@]}" -gt 0 ] || selected=("${SP_FUZZ_TARGETS[@]}")
for target in "${selected[@]}"; do
  [[ " ${SP_FUZZ_TARGETS[*]} " == *" ${target} "* ]] ||
    { echo "unknown target '${target}' (one of: ${SP_FUZZ_TARGETS[*]})" >&2; exit 2; }
done

sp_fuzz_configure "${root}" "${build}"
sp_fuzz_build "${build}"
out="${build}/campaign"
seeds="$(mktemp -d)"
trap 'rm -rf "${seeds}"' EXIT
sp_fuzz_seed "${root}" "${build}" "${seeds}"
commit="$(git -C "${root}" rev-parse --short HEAD 2>/dev/null || echo unknown)"
mkdir -p "${out}/corpus"
for target in "${selected[@]}"; do
  rm -rf "${out}/corpus/${target}" "${out}/${target}.info"
  rm -f "${out}/${target}.log" "${out}/${target}".w*.log
  find "${out}" -maxdepth 1 -name "${target}-*" -type f -delete
  mv "${seeds}/${target}" "${out}/corpus/${target}"
done

echo "== ${#selected[@]} targets, ${executions} executions each, ${jobs} processes at a time," \
  "${workers} per target"
started=$(date +%s)
for target in "${selected[@]}"; do
  echo "commit ${commit} started $(date -u +%Y-%m-%dT%H:%M:%SZ) executions ${executions}" \
    "workers ${workers}" > "${out}/${target}.info"
  for ((w = 0; w < workers; ++w)); do
    while [ "$(jobs -rp | wc -l)" -ge "${jobs}" ]; do wait -n || true; done
    # Worker 0 runs the remainder of the division too.
    runs=$(( executions / workers + (w == 0 ? executions % workers : 0) ))
    echo "   start ${target}_fuzz (worker ${w}, ${runs} executions)"
    SP_FUZZ_LOG="$(sp_fuzz_worker_log "${out}" "${target}" "${w}")" \
      sp_fuzz_run "${build}" "${target}" "${out}/corpus" "${out}" -runs="${runs}" &
  done
done
wait
status=0
echo "== results after $(( $(date +%s) - started )) s"
incomplete=()
for target in "${SP_FUZZ_TARGETS[@]}"; do
  [ -f "${out}/${target}.log" ] || continue
  sp_fuzz_summary "${out}" "${target}" "${build}"
  [[ " ${selected[*]} " == *" ${target} "* ]] || echo "  (earlier run: $(cat "${out}/${target}.info" 2>/dev/null || echo "not recorded"))"
  [ -z "$(sp_fuzz_findings "${out}" "${target}")" ] || status=1
  # A target that stopped early without a reproducer (killed, out of memory) failed too.
  for log in $(sp_fuzz_logs "${out}" "${target}"); do
    grep -qE "^Done [0-9]+ runs" "${log}" || { incomplete+=("${target}"); break; }
  done
done
[ "${#incomplete[@]}" -eq 0 ] || { echo "== did not finish: ${incomplete[*]}"; status=1; }
[ "${status}" -eq 0 ] && echo "== no findings" || echo "== findings or unfinished targets: see above"
exit "${status}"

# Shared by fuzz/run_fuzzers.sh, fuzz/campaign.sh and scripts/sanitizers.sh (sourced, not run).
# docs/TESTING.md describes the targets, the corpus and the limits.

# Every libFuzzer target in fuzz/; the corpus folder of target T is named T without "_fuzz".
SP_FUZZ_TARGETS=(metadata safetensors unpickle zip hf_directory objects zstd_item hf_index
                 metadata_wire)
# The instrumentation of the fuzz build, which also builds the ASan + UBSan tests: undefined
# behaviour aborts (-fno-sanitize-recover) like a memory error.
SP_ASAN_FLAGS="-fsanitize=address,undefined,fuzzer-no-link -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
# The sanitizer builds' optimization and debug information: line tables only, which is all a
# report's stack (file and line of each frame) needs, and compiles about 15% faster than -g.
SP_SANITIZER_BUILD_FLAGS="-O2 -gline-tables-only -DNDEBUG"
# libFuzzer limits: an input that needs more than 2 GiB, one allocation over 512 MiB, or more
# than 25 s is a finding (memory and time bombs), as is any leak.
SP_FUZZ_LIMITS=(-rss_limit_mb=2048 -malloc_limit_mb=512 -timeout=25 -max_len=65536)

# sp_fuzz_configure ROOT BUILD [TESTS]: a clang build directory with the fuzz targets; TESTS=ON
# adds the GoogleTest suites (scripts/sanitizers.sh asan). An existing directory keeps its choice.
sp_fuzz_configure() {
  local root="$1" build="$2" tests="${3:-}"
  local extra=()
  if [ -n "${tests}" ]; then
    extra=(-DSP_BUILD_TESTS="${tests}")
  elif [ ! -f "${build}/CMakeCache.txt" ]; then
    extra=(-DSP_BUILD_TESTS=OFF)
  fi
  CC=clang CXX=clang++ cmake -S "${root}" -B "${build}" -G Ninja \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSP_BUILD_FUZZERS=ON "${extra[@]}" \
    -DCMAKE_CXX_FLAGS="${SP_ASAN_FLAGS}" \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="${SP_SANITIZER_BUILD_FLAGS}" >/dev/null
}

# sp_fuzz_build BUILD: the targets and the seed generator.
sp_fuzz_build() {
  local targets=()
  for t in "${SP_FUZZ_TARGETS[@]}"; do targets+=("${t}_fuzz"); done
  ninja -C "$1" "${targets[@]}" make_fuzz_seeds
}

# sp_fuzz_seed ROOT BUILD CORPUS: CORPUS/<target>/ holds the committed corpus (fuzz/corpus), the
# seeds make_fuzz_seeds encodes, the torch and safetensors fixtures of the source tree and zstd
# frames written by the zstd tool (when installed).
sp_fuzz_seed() {
  local root="$1" build="$2" corpus="$3"
  for t in "${SP_FUZZ_TARGETS[@]}"; do
    mkdir -p "${corpus}/${t}"
    if [ -d "${root}/fuzz/corpus/${t}" ]; then cp "${root}/fuzz/corpus/${t}/"* "${corpus}/${t}/"; fi
  done
  "${build}/fuzz/make_fuzz_seeds" "${corpus}" "${root}"
  local td="${root}/shardpoint/format/torch_dcp/testdata"
  cp "${root}/shardpoint/format/safetensors/testdata/"*.safetensors "${corpus}/safetensors/"
  cp "${td}/"*.metadata "${corpus}/unpickle/"
  for d in plain sharded zstd megatron; do cp "${td}/${d}/.metadata" "${corpus}/unpickle/${d}.metadata"; done
  cp "${td}/"*.pt "${corpus}/zip/"
  cp "${td}/megatron/common.pt" "${corpus}/zip/megatron_common.pt"
  cp "${td}/object.pt" "${td}/megatron/common.pt" "${corpus}/objects/"
  cp "${root}/fuzz/seeds/hf_directory/"* "${corpus}/hf_directory/"
  if command -v zstd >/dev/null; then
    local tmp
    tmp="$(mktemp -d)"
    # Sizes around the decoder's 128 KiB output blocks, with and without the content size.
    for n in 0 1 131071 131072 131073 262144; do
      head -c "${n}" /dev/zero > "${tmp}/z${n}"
      zstd -q -3 -f "${tmp}/z${n}" -o "${corpus}/zstd_item/zero${n}.zst"
      zstd -q -3 -f --no-content-size < "${tmp}/z${n}" > "${corpus}/zstd_item/zero${n}-stream.zst"
    done
    zstd -q -19 -f "${td}/state_dict.pt" -o "${corpus}/zstd_item/state_dict.pt.zst"
    rm -rf "${tmp}"
  fi
}

# sp_fuzz_run BUILD TARGET CORPUS OUT ARGS...: runs one target on CORPUS/TARGET (new inputs are
# added there) with the limits and ARGS (-runs=N or -max_total_time=S). The log is OUT/TARGET.log
# (or SP_FUZZ_LOG when set: campaign.sh's workers); a reproducer is written as
# OUT/TARGET-crash-*, -leak-*, -timeout-*, -oom-*. Returns the target's exit status.
sp_fuzz_run() {
  local build="$1" target="$2" corpus="$3" out="$4"
  shift 4
  mkdir -p "${out}"
  "${build}/fuzz/${target}_fuzz" "${SP_FUZZ_LIMITS[@]}" "$@" -print_final_stats=1 \
    -artifact_prefix="${out}/${target}-" "${corpus}/${target}" \
    > "${SP_FUZZ_LOG:-${out}/${target}.log}" 2>&1
}

# sp_fuzz_worker_log OUT TARGET W: the log of worker W of a target: OUT/TARGET.log for worker 0,
# OUT/TARGET.wW.log for the others.
sp_fuzz_worker_log() {
  if [ "$3" -eq 0 ]; then echo "$1/$2.log"; else echo "$1/$2.w$3.log"; fi
}

# sp_fuzz_logs OUT TARGET: the logs of every worker of TARGET in OUT, one per line.
sp_fuzz_logs() {
  [ -f "$1/$2.log" ] && echo "$1/$2.log"
  find "$1" -maxdepth 1 -type f -name "$2.w*.log" | sort
}

# sp_fuzz_findings OUT TARGET: the reproducers of TARGET in OUT, one per line: crashes and
# sanitizer reports, leaks, timeouts and inputs over the memory limits. Slow units (libFuzzer's
# -report_slow_units, 10 s by default) are not findings: on a loaded machine a starved process
# writes them for inputs that run in milliseconds; sp_fuzz_summary replays them to show which.
sp_fuzz_findings() {
  find "$1" -maxdepth 1 -type f \( -name "$2-crash-*" -o -name "$2-leak-*" -o -name "$2-timeout-*" \
    -o -name "$2-oom-*" \)
}

# sp_fuzz_sum_stat KEY LOG...: the sum over the LOGs of libFuzzer's final stat KEY
# (stat::KEY), empty when no log has it.
sp_fuzz_sum_stat() {
  local key="$1" total="" value log
  shift
  for log in "$@"; do
    value="$(sed -n "s/^stat::${key}: *//p" "${log}" | tail -1)"
    [ -z "${value}" ] || total=$(( ${total:-0} + value ))
  done
  echo "${total}"
}

# sp_fuzz_summary OUT TARGET [BUILD]: one line from the logs: executions, exec/s, coverage at start
# and end, findings (reproducer files), and with BUILD the slow units replayed alone with their
# time. With several workers (campaign.sh), executions, exec/s and new inputs are their sums and
# the coverage at the end is the highest any worker reached.
sp_fuzz_summary() {
  local out="$1" target="$2" build="${3:-}" log="$1/$2.log"
  local runs execs start end added findings logs
  logs="$(sp_fuzz_logs "${out}" "${target}")"
  # shellcheck disable=SC2086
  runs="$(sp_fuzz_sum_stat number_of_executed_units ${logs})"
  # shellcheck disable=SC2086
  execs="$(sp_fuzz_sum_stat average_exec_per_sec ${logs})"
  # shellcheck disable=SC2086
  added="$(sp_fuzz_sum_stat new_units_added ${logs})"
  start="$(sed -n 's/.*INITED cov: \([0-9]*\) ft: \([0-9]*\).*/\1 edges, \2 features/p' "${log}" | head -1)"
  # shellcheck disable=SC2086
  end="$(for l in ${logs}; do grep -E '^#[0-9]+[[:space:]].*cov: ' "${l}" | tail -1; done |
    sed -n 's/.*cov: \([0-9]*\) ft: \([0-9]*\).*/\1 \2/p' | sort -n -k2 | tail -1 |
    awk '{print $1 " edges, " $2 " features"}')"
  findings="$(sp_fuzz_findings "${out}" "${target}" | wc -l)"
  printf '%-14s executions %-10s exec/s %-7s coverage %s -> %s (new inputs %s) findings %s\n' \
    "${target}" "${runs:-?}" "${execs:-?}" "${start:-?}" "${end:-?}" "${added:-?}" "${findings}"
  local workers
  workers="$(echo "${logs}" | wc -w)"
  [ "${workers}" -le 1 ] || echo "  (${workers} workers sharing the corpus)"
  for f in $(sp_fuzz_findings "${out}" "${target}"); do
    echo "  reproducer: ${f}"
    # shellcheck disable=SC2086
    grep -h -m1 -E "ERROR: (AddressSanitizer|UndefinedBehaviorSanitizer|libFuzzer|LeakSanitizer)|runtime error:" ${logs} | sed 's/^/  /'
  done
  for f in $(find "${out}" -maxdepth 1 -type f -name "${target}-slow-unit-*"); do
    local took="not replayed"
    if [ -n "${build}" ]; then
      took="$("${build}/fuzz/${target}_fuzz" "${f}" 2>&1 | sed -n 's/^Executed .* in \([0-9]*\) ms$/\1 ms alone/p')"
    fi
    echo "  slow unit (not a finding): ${f##*/}: ${took:-replay failed}"
  done
}

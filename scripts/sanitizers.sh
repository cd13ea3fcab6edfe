#!/usr/bin/env bash
# Sanitizer builds of the C++ tests (clang), each in its own build directory, run through ctest.
# Usage: scripts/sanitizers.sh asan|tsan [BUILD_DIR]
#
# asan (BUILD_DIR default build-asan): AddressSanitizer + UndefinedBehaviorSanitizer with
#   -fno-sanitize-recover=undefined (UB aborts the test). Builds and runs the suites of the code
#   that decodes untrusted bytes and the pure planners: base_test geometry_test layout_test
#   plan_test store_test fault_store_test format_test safetensors_test native_format_test
#   torch_save_test torch_dcp_test format_writer_test. The engine,
#   comm, CLI and Python suites are left out (they add most of the compile time and go through the
#   same decoders; the threaded ones run under tsan). The build directory is configured with the
#   fuzz targets' instrumentation (fuzz/fuzz_lib.sh), so fuzz/run_fuzzers.sh SECONDS BUILD_DIR
#   reuses the compiled libraries. LeakSanitizer is on.
# tsan (BUILD_DIR default build-tsan): ThreadSanitizer on the threaded engine tests only, built by
#   target name so nothing else compiles: exec_test (thread pool, task group, parallel for),
#   io_tuner_test (the read-depth gate, the staging buffer pool), shared_io_tuner_test (the gate
#   shared by processes, with forked members), comm_test (thread communicator, collectives), engine_unit_test (read executor, read exchange,
#   engine context, the range buffers of streaming saves), engine_async_save_test (async save), and the shared-read cases of
#   engine_reshard_test, and the S3 client and store against a real server (s3_client_test,
#   s3_store_test: the event loops, parts sent in the background, the store's part budget; they
#   skip when no weed binary is found, SP_TEST_WEED defaulting to the main build's venv), and the
#   save planner on a pool (plan_test's SavePlanTest cases that plan on one), and the packed chunk
#   lists that threads unpack at once (native_format_test's PackedChunksTest).
#   TSAN_OPTIONS=halt_on_error=1: the first race fails the run. No suppressions are needed.
# Prints ctest's summary lines; exits non-zero when a build or a test fails.
set -euo pipefail

mode="${1:?usage: scripts/sanitizers.sh asan|tsan [BUILD_DIR]}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
jobs="${SP_BUILD_JOBS:-$(nproc)}"

run_ctest() {
  local build="$1" log="$1/ctest-sanitizer.log"
  shift
  set +e
  (cd "${build}" && ctest --output-on-failure -j "${jobs}" --timeout 900 "$@") > "${log}" 2>&1
  local rc=$?
  set -e
  grep -E "^[0-9]+% tests passed|^Total Test time" "${log}"
  if [ "${rc}" -ne 0 ]; then grep -E "\*\*\*Failed|Exception|\(Failed\)|SUMMARY: " "${log}" | head -40; fi
  return "${rc}"
}

case "${mode}" in
  asan)
    build="${2:-${root}/build-asan}"
    source "${root}/fuzz/fuzz_lib.sh"
    sp_fuzz_configure "${root}" "${build}" ON
    tests=(base_test geometry_test layout_test plan_test store_test fault_store_test format_test
           safetensors_test native_format_test torch_save_test torch_dcp_test format_writer_test)
    ninja -C "${build}" -j "${jobs}" "${tests[@]}" > "${build}/ninja-sanitizer.log" 2>&1 ||
      { tail -40 "${build}/ninja-sanitizer.log"; exit 1; }
    # Tests of targets not built here appear as <target>_NOT_BUILT (the S3 suites that run as one
    # test each are named after their binaries); the others need the CLI, the
    # crash driver, the engine's MPI tests, MPI, a Python with torch or the benchmarks.
    ASAN_OPTIONS="detect_leaks=1:abort_on_error=1" UBSAN_OPTIONS="print_stacktrace=1" \
      run_ctest "${build}" \
        -E "_NOT_BUILT|^torch_dcp_torch_reads$|^cli_|^mpi_comm_test$|^mpi_load_test$|^mpi_scale_|^crash_trials_sample$|^s3_(client|store|engine)_test$|^dcp_plan_bench_sample$|^plan_bench_coordinators_sample$"
    ;;
  tsan)
    build="${2:-${root}/build-tsan}"
    flags="-fsanitize=thread -fno-omit-frame-pointer"
    source "${root}/fuzz/fuzz_lib.sh"  # SP_SANITIZER_BUILD_FLAGS
    CC=clang CXX=clang++ cmake -S "${root}" -B "${build}" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DSP_BUILD_TESTS=ON -DCMAKE_CXX_FLAGS="${flags}" \
      -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="${SP_SANITIZER_BUILD_FLAGS}" >/dev/null
    ninja -C "${build}" -j "${jobs}" exec_test io_tuner_test shared_io_tuner_test comm_test engine_unit_test \
      engine_async_save_test \
      engine_reshard_test s3_client_test s3_store_test plan_test native_format_test \
      > "${build}/ninja-sanitizer.log" 2>&1 ||
      { tail -40 "${build}/ninja-sanitizer.log"; exit 1; }
    suites="ParallelForTest|TaskGroupTest|ThreadPoolTest|ThreadCommTest|CollectiveTest|DecodeStatusTest"
    suites+="|EncodeStatusTest|AsyncSaverTest|UncheckedReadTest|ReadExchangeTest|EngineContextTest"
    suites+="|SaveMessagesTest|ChunkReaderTest|IoTunerTest|DepthControllerTest|BufferPoolTest"
    suites+="|ReadDepthTest|TunerCoreTest|SharedIoTunerTest|RangeBuffersTest|WriteReportsTest"
    suites+="|PackedChunksTest"
    shared="ReshardTest\.(SharedReads|ManyReadsOfOneFile|CorruptSharedChunk|RankFailingBeforeSharedReads"
    shared+="|ProcessesOfOneMachine)"
    planner="SavePlanTest\.(APoolGivesTheSamePlanAndTheSameFirstError"
    planner+="|OneFilePerRankIsLaidOutAsThePassPerRankLaysItOut)"
    cache="PlanCacheTest\."  # the coordinator's cache: decoded back on a thread while ranks write
    if [ -z "${SP_TEST_WEED:-}" ] && [ -x "${root}/build/venv/bin/weed" ]; then
      export SP_TEST_WEED="${root}/build/venv/bin/weed"
    fi
    TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" \
      run_ctest "${build}" \
      -R "^(${suites})\.|^${shared}|^${planner}$|^${cache}|^s3_(client|store)_test$" \
      -E "_NOT_BUILT"
    ;;
  *)
    echo "usage: scripts/sanitizers.sh asan|tsan [BUILD_DIR]" >&2
    exit 2
    ;;
esac

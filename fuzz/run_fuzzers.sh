#!/usr/bin/env bash
# Builds the fuzz targets with clang (address sanitizer, libFuzzer) and runs each for SECONDS.
# Usage: fuzz/run_fuzzers.sh SECONDS [BUILD_DIR]
# Exits non-zero when a target finds a crash; the reproducer is left in the build directory.
set -euo pipefail

seconds="${1:?usage: fuzz/run_fuzzers.sh SECONDS [BUILD_DIR]}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${2:-${root}/build-fuzz}"
flags="-fsanitize=address,fuzzer-no-link -fno-omit-frame-pointer"

CC=clang CXX=clang++ cmake -S "${root}" -B "${build}" -G Ninja \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSP_BUILD_FUZZERS=ON -DSP_BUILD_TESTS=OFF \
  -DCMAKE_C_FLAGS="${flags}" -DCMAKE_CXX_FLAGS="${flags}" >/dev/null
ninja -C "${build}" metadata_fuzz safetensors_fuzz unpickle_fuzz zip_fuzz hf_directory_fuzz make_fuzz_seeds

corpus="${build}/corpus"
mkdir -p "${corpus}/metadata" "${corpus}/safetensors" "${corpus}/unpickle" "${corpus}/zip" \
  "${corpus}/hf_directory"
"${build}/fuzz/make_fuzz_seeds" "${corpus}/metadata" "${corpus}/safetensors" "${corpus}/unpickle" \
  "${corpus}/zip"
cp "${root}/shardpoint/format/safetensors/testdata/"*.safetensors "${corpus}/safetensors/"
torch_testdata="${root}/shardpoint/format/torch_dcp/testdata"
cp "${torch_testdata}/"*.metadata "${corpus}/unpickle/"
for d in plain sharded zstd; do cp "${torch_testdata}/${d}/.metadata" "${corpus}/unpickle/${d}.metadata"; done
cp "${torch_testdata}/"*.pt "${corpus}/zip/"
cp "${torch_testdata}/megatron/.metadata" "${corpus}/unpickle/megatron.metadata"
cp "${torch_testdata}/megatron/common.pt" "${corpus}/zip/megatron_common.pt"
cp "${root}/fuzz/seeds/hf_directory/"* "${corpus}/hf_directory/"

status=0
for target in metadata safetensors unpickle zip hf_directory; do
  echo "== ${target}_fuzz for ${seconds} s"
  (cd "${build}" && "./fuzz/${target}_fuzz" -max_total_time="${seconds}" -max_len=65536 \
      -print_final_stats=1 "${corpus}/${target}") || status=1
done
exit "${status}"

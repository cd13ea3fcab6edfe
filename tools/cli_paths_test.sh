#!/usr/bin/env bash
# End-to-end tests of how the shardpoint command treats the paths of a checkpoint: files that are
# not regular files (FIFOs), symbolic links that lead out of the checkpoint, consolidate and
# convert writing over their own source under another spelling, and allocation failures.
#
# usage: tools/cli_paths_test.sh PATH_TO_SHARDPOINT PATH_TO_MAKE_TEST_CHECKPOINT
# Every command runs under `timeout`, so a reader that blocks on a FIFO fails its check instead of
# hanging the test. Prints one line per check and "N passed, N failed"; exits 1 when one failed.
set -u

if [[ $# -ne 2 || ! -x "$1" || ! -x "$2" ]]; then
  echo "usage: $0 PATH_TO_SHARDPOINT PATH_TO_MAKE_TEST_CHECKPOINT" >&2
  exit 2
fi
BIN_REAL=$(realpath "$1")
MAKE=$2
WORK=$(mktemp -d "${TMPDIR:-/tmp}/shardpoint-cli-paths-test.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
# The harness's run() calls $BIN: a wrapper bounds every command to 10 seconds (exit 124).
BIN=$WORK/shardpoint-bounded
printf '#!/usr/bin/env bash\nexec timeout 10 %q "$@"\n' "$BIN_REAL" >"$BIN"
chmod +x "$BIN"

# shellcheck source=tools/cli_test_lib.sh
source "$(dirname "$0")/cli_test_lib.sh"


# ---- fixtures: native, torch-dcp and a sharded Hugging Face directory ---------------------------
make_checkpoint "$WORK/native"
run convert "$WORK/native" "$WORK/dcp" --to torch-dcp
[[ $RC -eq 0 ]] || { fail "fixture: convert to torch-dcp" "exit $RC"; exit 1; }
run consolidate "$WORK/native" "$WORK/hf" --all --max-shard-size 1KB
[[ $RC -eq 0 && -f $WORK/hf/model.safetensors.index.json ]] ||
  { fail "fixture: consolidate into shards" "exit $RC"; exit 1; }

# copy_with_fifo NAME SRC FILE: a copy of checkpoint SRC at $WORK/NAME whose FILE is a FIFO.
copy_with_fifo() {
  rm -rf "${WORK:?}/$1"
  cp -r "$2" "$WORK/$1"
  rm "$WORK/$1/$3"
  mkfifo "$WORK/$1/$3"
}

# ---- defect 5: a FIFO in place of a checkpoint file is refused, never waited on -----------------
first_data_file() { (cd "$1" && ls | grep -v -e '\.metadata$' -e '\.json$' | head -n 1); }
native_data=$(first_data_file "$WORK/native")
copy_with_fifo fifo_native_data "$WORK/native" "$native_data"
run verify "$WORK/fifo_native_data"
check "fifo: native data file: verify exits 1, naming the FIFO" eval '[[ $RC -eq 1 ]] && contains "$OUT$ERR" "$native_data" && contains "$OUT$ERR" "FIFO"'
run diff "$WORK/fifo_native_data" "$WORK/native"
check "fifo: native data file: diff fails with a message" eval '[[ $RC -eq 1 ]] && contains "$ERR" "is a FIFO (named pipe), not a regular file"'

copy_with_fifo fifo_native_md "$WORK/native" shardpoint.metadata
run inspect "$WORK/fifo_native_md"
check "fifo: native metadata: inspect exits 1, naming the file" eval '[[ $RC -eq 1 ]] && contains "$ERR" "fifo_native_md/shardpoint.metadata" && contains "$ERR" "FIFO"'

copy_with_fifo fifo_dcp_md "$WORK/dcp" .metadata
run inspect "$WORK/fifo_dcp_md"
check "fifo: DCP .metadata: inspect exits 1" eval '[[ $RC -eq 1 ]] && contains "$ERR" "FIFO"'

dcp_data=$(cd "$WORK/dcp" && ls | grep '\.distcp$' | head -n 1)
copy_with_fifo fifo_dcp_data "$WORK/dcp" "$dcp_data"
run inspect "$WORK/fifo_dcp_data"
check "fifo: DCP relative_path: inspect exits 1, naming the file" eval '[[ $RC -eq 1 ]] && contains "$ERR" "$dcp_data" && contains "$ERR" "FIFO"'

copy_with_fifo fifo_hf_index "$WORK/hf" model.safetensors.index.json
run inspect "$WORK/fifo_hf_index"
check "fifo: HF index: inspect exits 1" eval '[[ $RC -eq 1 ]] && contains "$ERR" "FIFO"'

hf_shard=$(cd "$WORK/hf" && ls | grep '\.safetensors$' | head -n 1)
copy_with_fifo fifo_hf_shard "$WORK/hf" "$hf_shard"
run inspect "$WORK/fifo_hf_shard"
check "fifo: safetensors file: inspect exits 1, naming the file" eval '[[ $RC -eq 1 ]] && contains "$ERR" "$hf_shard" && contains "$ERR" "FIFO"'

mkfifo "$WORK/lone.safetensors"
run inspect "$WORK/lone.safetensors"
check "fifo: single safetensors file: inspect exits 1" eval '[[ $RC -eq 1 ]] && contains "$ERR" "FIFO"'

# ---- defect 6: symbolic links out of the checkpoint are refused unless allowed ------------------
mkdir -p "$WORK/elsewhere"
rm -rf "$WORK/link_native"
cp -r "$WORK/native" "$WORK/link_native"
mv "$WORK/link_native/$native_data" "$WORK/elsewhere/$native_data"
ln -s "$WORK/elsewhere/$native_data" "$WORK/link_native/$native_data"
run diff "$WORK/link_native" "$WORK/native"
check "links: native data file outside: diff refuses, naming the link and its target" eval '[[ $RC -eq 1 ]] && contains "$ERR" "link_native/$native_data" && contains "$ERR" "elsewhere/$native_data" && contains "$ERR" "outside the checkpoint"'
run diff "$WORK/link_native" "$WORK/native" --allow-external-links
check "links: --allow-external-links reads it (diff: equal)" eval '[[ $RC -eq 0 ]]'
run verify "$WORK/link_native"
check "links: verify reports the link out as a defect" eval '[[ $RC -eq 1 ]] && contains "$OUT" "DEFECT: $native_data is a symbolic link to"'
run verify "$WORK/link_native" --allow-external-links
check "links: verify with --allow-external-links: a note, OK" eval '[[ $RC -eq 0 ]] && contains "$OUT" "NOTE: $native_data is a symbolic link to" && contains "$OUT" "OK:"'

rm -rf "$WORK/link_hf"
cp -r "$WORK/hf" "$WORK/link_hf"
mv "$WORK/link_hf/$hf_shard" "$WORK/elsewhere/$hf_shard"
ln -s "../elsewhere/$hf_shard" "$WORK/link_hf/$hf_shard"
run inspect "$WORK/link_hf"
check "links: HF shard outside: inspect refuses" eval '[[ $RC -eq 1 ]] && contains "$ERR" "$hf_shard" && contains "$ERR" "outside the checkpoint"'
run inspect "$WORK/link_hf" --allow-external-links
check "links: HF shard outside: inspect --allow-external-links reads it" eval '[[ $RC -eq 0 ]]'
run verify "$WORK/link_hf"
check "links: HF shard outside: verify reports a defect" eval '[[ $RC -eq 1 ]] && contains "$OUT" "DEFECT: $hf_shard is a symbolic link to"'

rm -rf "$WORK/inside"
cp -r "$WORK/native" "$WORK/inside"
mkdir "$WORK/inside/blobs"
mv "$WORK/inside/$native_data" "$WORK/inside/blobs/$native_data"
ln -s "blobs/$native_data" "$WORK/inside/$native_data"
ln -s "$WORK/inside" "$WORK/latest"
run diff "$WORK/latest" "$WORK/native"
check "links: a linked checkpoint directory with links inside it loads (diff: equal)" eval '[[ $RC -eq 0 ]]'
run verify "$WORK/latest"
check "links: verify notes a link inside and is OK" eval '[[ $RC -eq 0 ]] && contains "$OUT" "NOTE: $native_data is a symbolic link to" && contains "$OUT" "(inside the checkpoint)"'

# ---- defect 9: consolidate and convert never write over their source ---------------------------
rm -rf "$WORK/c01"
cp -r "$WORK/hf" "$WORK/c01"
before=$(fingerprint "$WORK/c01")
ln -s "$WORK/c01" "$WORK/alias"
for out in "$WORK/c01" "$WORK/c01/." "$WORK/c01/../c01" "$WORK/alias" "c01" "./c01/" "c01/../c01"; do
  OUT=$(cd "$WORK" && "$BIN" consolidate c01 "$out" --overwrite --all --dtype bf16 2>"$WORK/stderr")
  RC=$?
  ERR=$(<"$WORK/stderr")
  check "consolidate c01 into $out is refused" eval '[[ $RC -eq 1 ]] && contains "$ERR" "holds the source checkpoint"'
done
check "consolidate: the source is byte-identical afterwards" eval '[[ "$(fingerprint "$WORK/c01")" == "$before" ]]'

before=$(fingerprint "$WORK/native")
ln -s "$WORK/native" "$WORK/native_alias"
for dst in "$WORK/native_alias" "$WORK/native/../native"; do
  run convert "$WORK/native" "$dst" --to torch-dcp --overwrite
  check "convert native into $dst is refused" eval '[[ $RC -eq 1 ]] && contains "$ERR" "is the source checkpoint"'
done
check "convert: the source is byte-identical afterwards" eval '[[ "$(fingerprint "$WORK/native")" == "$before" ]]'

# ---- defect 10: an allocation that fails ends the command with a message, not a signal ----------
mkdir "$WORK/huge"
truncate -s 64G "$WORK/huge/shardpoint.metadata"
OUT=$( (ulimit -v 4000000 && exec "$BIN_REAL" inspect "$WORK/huge") 2>"$WORK/stderr")
RC=$?
ERR=$(<"$WORK/stderr")
check "allocation failure: inspect exits 1 with a message (no signal)" eval '[[ $RC -eq 1 ]] && contains "$ERR" "shardpoint inspect: out of memory"'

echo "$passed passed, $failed failed"
[[ $failed -eq 0 ]]

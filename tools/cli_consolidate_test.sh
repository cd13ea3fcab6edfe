#!/usr/bin/env bash
# End-to-end tests of `shardpoint consolidate`: outputs, options, refusals and exit codes. When a
# Python with torch and safetensors is given (and works), the outputs are also opened with
# safetensors.torch.load_file and compared bit for bit against tensors reassembled independently
# from the source's data files (native data files are safetensors files, one entry per chunk).
#
# usage: tools/cli_consolidate_test.sh PATH_TO_SHARDPOINT_BINARY [PYTHON]
# Prints one line per check and "N passed, N failed, N skipped" at the end; exits 1 when a check
# failed. Exit codes under test (tools/cli.h): 0 success, 1 failure, 2 bad command line.
set -u

if [[ $# -lt 1 || ! -x "$1" ]]; then
  echo "usage: $0 PATH_TO_SHARDPOINT_BINARY [PYTHON]" >&2
  exit 2
fi
BIN=$1
PY=${2:-}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/shardpoint-consolidate-test.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
CKPT=$WORK/checkpoint

# shellcheck source=tools/cli_test_lib.sh
source "$(dirname "$0")/cli_test_lib.sh"

listing() { (cd "$1" && ls -A | tr '\n' ' '); }

HAVE_PY=0
if [[ -n "$PY" && -x "$PY" ]] && "$PY" -c "import torch, safetensors.torch" 2>/dev/null; then
  HAVE_PY=1
fi

# py_check NAME SCRIPT ARGS...: runs SCRIPT under the Python with ARGS as sys.argv[1:]; the
# script prints "ok" when the outputs are right.
py_check() {
  local name=$1 script=$2
  shift 2
  if [[ $HAVE_PY -ne 1 ]]; then
    skipped=$((skipped + 1))
    echo "SKIP $name: no Python with torch and safetensors"
    return
  fi
  OUT=$("$PY" -c "$script" "$@" 2>"$WORK/stderr")
  RC=$?
  ERR=$(<"$WORK/stderr")
  if [[ $RC -eq 0 && $OUT == *ok* ]]; then pass "$name"; else fail "$name" "python check"; fi
}

# Reassembles whole tensors from a native checkpoint's data files ("name@o0,o1" entries), then
# compares every tensor of the consolidated directory (sys.argv[2]) bit for bit, after the
# optional cast (sys.argv[3]) and rename ("old=new", sys.argv[4]). The demo's tensors hold random
# bits, NaNs included; a cast NaN only has to be a NaN (torch's own CPU kernels disagree on the
# bits of a converted NaN: 0xFFFF vectorized on x86, 0x7FC0 in c10's scalar bfloat16).
COMPARE_PY='
import glob, json, os, sys, torch
from safetensors.torch import load_file
src, out = sys.argv[1], sys.argv[2]
cast = getattr(torch, sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] else None
old, new = sys.argv[4].split("=") if len(sys.argv) > 4 else ("", "")
chunks = {}
for path in glob.glob(os.path.join(src, "d-*.safetensors")):
    for key, t in load_file(path).items():
        name, offsets = key.rsplit("@", 1)
        chunks.setdefault(name, []).append(([int(o) for o in offsets.split(",") if o], t))
whole, cast_from = {}, {}
for name, parts in chunks.items():
    shape = [max(o[d] + t.shape[d] for o, t in parts) for d in range(parts[0][1].dim())]
    full = torch.zeros(shape, dtype=parts[0][1].dtype)
    for o, t in parts:
        full[tuple(slice(a, a + s) for a, s in zip(o, t.shape))] = t
    out_name = new + name[len(old):] if name.startswith(old) else name
    cast_from[out_name] = full.dtype
    if cast is not None and full.is_floating_point():
        full = full.to(cast)
    whole[out_name] = full
got = {}
for path in glob.glob(os.path.join(out, "*.safetensors")):
    got.update(load_file(path))
index = os.path.join(out, "model.safetensors.index.json")
if os.path.exists(index):
    with open(index) as f:
        idx = json.load(f)
    assert set(idx["weight_map"]) == set(got), "index keys differ from the files"
    assert idx["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())
wanted = {k: v for k, v in whole.items() if k in got}
assert len(wanted) == len(got), sorted(set(got) - set(whole))[:5]
for k, t in got.items():
    w = wanted[k]
    assert t.dtype == w.dtype and t.shape == w.shape, (k, t.dtype, w.dtype, t.shape, w.shape)
    if cast is not None and t.is_floating_point() and t.dtype != cast_from.get(k, t.dtype):
        nan = torch.isnan(w)
        assert torch.equal(torch.isnan(t), nan), k
        t, w = t[~nan], w[~nan]
    assert torch.equal(t.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)), k
print("ok", len(got))
'

# Every tensor of the torch files in sys.argv[2] (torch.load, weights_only) equals the same tensor
# of the safetensors files in sys.argv[1].
TORCH_PY='
import glob, json, os, sys, torch
from safetensors.torch import load_file
ref = {}
for path in glob.glob(os.path.join(sys.argv[1], "*.safetensors")):
    ref.update(load_file(path))
with open(os.path.join(sys.argv[2], "pytorch_model.bin.index.json")) as f:
    weight_map = json.load(f)["weight_map"]
got = {}
for name in sorted(set(weight_map.values())):
    part = torch.load(os.path.join(sys.argv[2], name), weights_only=True)
    assert all(weight_map[k] == name for k in part), name
    got.update(part)
assert set(got) == set(ref), sorted(set(got) ^ set(ref))[:5]
for k, t in got.items():
    assert t.dtype == ref[k].dtype and t.shape == ref[k].shape, k
    assert torch.equal(t.reshape(-1).view(torch.uint8), ref[k].reshape(-1).view(torch.uint8)), k
print("ok", len(got))
'

# ---- command line -------------------------------------------------------------------------------
run consolidate --help
expect_rc "--help exits 0" 0
check "--help lists the options" contains "$OUT" "--max-shard-size"
run consolidate
expect_rc "no arguments is a usage error" 2
check "usage error names the problem" contains "$ERR" "expected SRC and OUT"
run consolidate a b --shard-size 1GB
expect_rc "an unknown option is a usage error" 2
check "unknown option is named" contains "$ERR" "unknown option --shard-size"
run consolidate a b --max-shard-size 5XB
expect_rc "a bad size is a usage error" 2
check "bad size is named" contains "$ERR" "invalid size '5XB'"
run consolidate a b --dtype fp12
expect_rc "a bad dtype is a usage error" 2
check "bad dtype is named" contains "$ERR" "unknown dtype 'fp12'"
run consolidate a b --format onnx
expect_rc "a bad format is a usage error" 2
run consolidate a b --rename nothing
expect_rc "a bad rename is a usage error" 2
check "bad rename is named" contains "$ERR" "--rename expects OLD=NEW"
run consolidate "$WORK/missing" "$WORK/out"
expect_rc "a missing source fails" 1
check "missing source is named" contains "$ERR" "no committed checkpoint at $WORK/missing"

# ---- a native checkpoint saved by 4 ranks -------------------------------------------------------
run demo --mib 8 --dir "$CKPT" --keep
expect_rc "demo writes a 4-rank checkpoint" 0

run consolidate "$CKPT" "$WORK/hf" --max-shard-size 3MB --threads 3 --all
expect_rc "consolidate into 3 MB shards exits 0" 0
check "three shards and an index" [ "$(listing "$WORK/hf")" = "model-00001-of-00003.safetensors model-00002-of-00003.safetensors model-00003-of-00003.safetensors model.safetensors.index.json " ]
check "reports what it wrote" contains "$OUT" "114 tensor(s), 7.80 MiB in 3 file(s)"
check "quiet when stderr is not a terminal" [ -z "$ERR" ]
py_check "shards equal the source bit for bit (safetensors.torch.load_file)" "$COMPARE_PY" \
  "$CKPT" "$WORK/hf"

run consolidate "$CKPT" "$WORK/hf"
expect_rc "existing outputs are not overwritten" 1
check "refusal names the directory" contains "$ERR" "already holds model-00001-of-00003.safetensors"
run consolidate "$CKPT" "$WORK/hf" --overwrite --json --all
expect_rc "--overwrite replaces them" 0
check "one file now, stale shards and index gone" [ "$(listing "$WORK/hf")" = "model.safetensors " ]
check "--json result" contains "$OUT" '"files":["model.safetensors"],"index":null'
py_check "the single file equals the source" "$COMPARE_PY" "$CKPT" "$WORK/hf"

run consolidate "$CKPT" "$WORK/pt" --format torch --max-shard-size 3MB --memory-budget 1MiB --all
expect_rc "--format torch exits 0" 0
check "three .bin shards and their index" [ "$(listing "$WORK/pt")" = "pytorch_model-00001-of-00003.bin pytorch_model-00002-of-00003.bin pytorch_model-00003-of-00003.bin pytorch_model.bin.index.json " ]
py_check "torch.load reads the .bin shards, equal to the safetensors output" "$TORCH_PY" \
  "$WORK/hf" "$WORK/pt"

run consolidate "$CKPT" "$WORK/bf16" --dtype bf16 --keys optim.state.layers.0 --prefix model.layers.1. \
  --rename optim.state.=opt.
expect_rc "selection, rename and dtype" 0
check "selected 18 + 9 tensors" contains "$OUT" "27 tensor(s)"
py_check "bf16 output equals torch's .to(torch.bfloat16) of the source" "$COMPARE_PY" \
  "$CKPT" "$WORK/bf16" bfloat16 optim.state.=opt.
run consolidate "$CKPT" "$WORK/weights"
expect_rc "no keys: the model weights of the training checkpoint" 0
check "says what it picked and what it left out" contains "$OUT" \
  "exported the model weights: 38 tensors under 'model.' (the prefix removed); left out the training state: optim (76 tensors)"
check "38 tensors written" contains "$OUT" "38 tensor(s)"
py_check "the model weights under their own names equal the source" "$COMPARE_PY" \
  "$CKPT" "$WORK/weights" "" "model.="
run consolidate "$CKPT" "$WORK/none" --keys no.such.key
expect_rc "a key that selects nothing fails" 1
check "the key is named" contains "$ERR" "key 'no.such.key' selects no tensor"

# ---- a Hugging Face directory as the source -----------------------------------------------------
run inspect "$WORK/hf"
expect_rc "inspect opens the Hugging Face directory" 0
check "inspect lists its tensors" contains "$OUT" "model.embed.weight"
run verify "$WORK/hf"
expect_rc "verify of the Hugging Face directory exits 0" 0
check "verify says the format has no checksums" contains "$OUT" "no checksums"
run consolidate "$WORK/hf" "$WORK/hf2" --max-shard-size 2MiB --all
expect_rc "a Hugging Face directory consolidates again" 0
py_check "resharded Hugging Face output equals the source" "$COMPARE_PY" "$CKPT" "$WORK/hf2"
run consolidate "$WORK/hf/model.safetensors" "$WORK/hf"
expect_rc "the source's own directory is refused" 1
check "the refusal explains" contains "$ERR" "holds the source checkpoint"
check "2 MiB shards: five of them" [ -f "$WORK/hf2/model-00005-of-00005.safetensors" ]
truncate -s -100 "$WORK/hf2/model-00002-of-00005.safetensors"
run consolidate "$WORK/hf2" "$WORK/hf3"
expect_rc "a truncated shard fails" 1
check "the truncated file is named" contains "$ERR" "model-00002-of-00005.safetensors"
check "nothing written for the failed run" [ ! -e "$WORK/hf3/model.safetensors" ]

# ---- sizes from untrusted input (issue 13, defect 2) ----------------------------------------------
# A 200-byte Hugging Face directory whose DCP_SHARDING_INFO puts a 2x2 chunk at offsets near 2^62:
# the tensor's element count would wrap. Every verb refuses it at once, naming file and numbers.
mkdir -p "$WORK/huge"
HDR='{"__metadata__":{"DCP_SHARDING_INFO":"{\"w\": {\"saved_offsets\": [4611686018427387900, 4611686018427387900]}}"},"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}'
N=${#HDR}
{
  printf "\\x$(printf %02x $((N & 255)))\\x$(printf %02x $((N >> 8 & 255)))\\0\\0\\0\\0\\0\\0"
  printf '%s' "$HDR"
  head -c 16 /dev/zero
} >"$WORK/huge/m.safetensors"
HUGE_MSG="tensor 'w' (DCP_SHARDING_INFO of $WORK/huge/m.safetensors): shape [4611686018427387902, 4611686018427387902] of float32 exceeds 2^62 bytes"
run verify "$WORK/huge"
expect_rc "verify refuses a shape past 2^62 bytes" 1
check "verify names the file, tensor and shape" contains "$ERR" "$HUGE_MSG"
run diff "$WORK/huge" "$WORK/huge"
expect_rc "diff refuses it" 1
check "diff names the file, tensor and shape" contains "$ERR" "$HUGE_MSG"
run consolidate "$WORK/huge" "$WORK/huge-out"
expect_rc "consolidate refuses it" 1
check "consolidate names the file, tensor and shape" contains "$ERR" "$HUGE_MSG"
check "consolidate leaves no .partial file" [ -z "$(ls -A "$WORK/huge-out" 2>/dev/null)" ]

echo "$passed passed, $failed failed, $skipped skipped"
[[ $failed -eq 0 ]]

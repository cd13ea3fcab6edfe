#!/usr/bin/env bash
# End-to-end tests of the checkpoint-management verbs of the shardpoint command: list, gc, prune
# and diff, their success and error paths and exit codes.
#
# usage: tools/cli_verbs_test.sh PATH_TO_SHARDPOINT PATH_TO_MAKE_TEST_CHECKPOINT
# make_test_checkpoint (tools/make_test_checkpoint.cc) writes the small native checkpoints used
# here. Prints one line per check and "N passed, N failed"; exits 1 when a check failed.
# Exit codes under test (tools/cli.h): 0 success (diff: equal), 1 failure (diff: different),
# 2 bad command line.
set -u

if [[ $# -ne 2 || ! -x "$1" || ! -x "$2" ]]; then
  echo "usage: $0 PATH_TO_SHARDPOINT PATH_TO_MAKE_TEST_CHECKPOINT" >&2
  exit 2
fi
BIN=$1
MAKE=$2
WORK=$(mktemp -d "${TMPDIR:-/tmp}/shardpoint-cli-verbs-test.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
RUN=$WORK/run

# shellcheck source=tools/cli_test_lib.sh
source "$(dirname "$0")/cli_test_lib.sh"

# ---- fixtures -----------------------------------------------------------------------------------
mkdir -p "$RUN"
for step in 100 200 300 400 500; do
  make_checkpoint "$RUN/step_$(printf '%06d' "$step")" --step "$step"
done
mkdir -p "$RUN/global_step900"                 # a save in progress: data, no metadata
echo partial >"$RUN/global_step900/d-x-r00000-f000.safetensors.tmp"
mkdir -p "$RUN/iter_50"                        # a PyTorch DCP checkpoint: .metadata is its commit
echo dcp >"$RUN/iter_50/.metadata"
mkdir -p "$RUN/logs" "$RUN/.step_700"          # neither is a step checkpoint

# ---- list ---------------------------------------------------------------------------------------
run list "$RUN"
expect_rc "list exits 0" 0
check "list shows a native checkpoint" contains "$OUT" "step_000100"
check "list marks the latest committed one" contains "$OUT" "step_000500  (latest)"
check "list shows the uncommitted one" contains "$OUT" "uncommitted"
check "list names the latest in its summary" contains "$OUT" "latest committed: step_000500 (step 500)"
check "list skips directories without a step" eval '! contains "$OUT" "logs"'
check "list skips hidden directories" eval '! contains "$OUT" ".step_700"'

run list "$RUN" --json
expect_rc "list --json exits 0" 0
check "list --json gives the steps in order" \
  python_json "assert [c['step'] for c in d['checkpoints']] == [50, 100, 200, 300, 400, 500, 900], d"
check "list --json gives the latest" python_json "assert d['latest']['name'] == 'step_000500'"
check "list --json says what is committed" \
  python_json "assert [c['committed'] for c in d['checkpoints']] == [True] * 6 + [False]"
check "list --json gives the formats" \
  python_json "assert d['checkpoints'][0]['format'] == 'torch-dcp' and d['checkpoints'][1]['format'] == 'native'"
check "list --json gives the bytes on disk" \
  python_json "import os; p = d['checkpoints'][1]['path']; assert d['checkpoints'][1]['bytes'] == sum(os.path.getsize(os.path.join(p, f)) for f in os.listdir(p)) > 0"

run list "$WORK/no-such-dir"
expect_rc "list of a missing directory exits 1" 1
check "list names the missing directory" contains "$ERR" "no-such-dir"

# ---- diff ---------------------------------------------------------------------------------------
make_checkpoint "$WORK/same" --step 100
make_checkpoint "$WORK/bumped" --step 100 --bump 9
make_checkpoint "$WORK/no_optim" --step 100 --no-optim

run diff "$RUN/step_000100" "$WORK/same"
expect_rc "diff of equal checkpoints exits 0" 0
check "diff says EQUAL" contains "$OUT" "EQUAL: $RUN/step_000100 and $WORK/same: 4 tensor(s) compared"

run diff "$RUN/step_000100" "$WORK/bumped"
expect_rc "diff of different values exits 1" 1
check "diff names the tensor, count, difference and index" \
  contains "$OUT" "differs: tensor model.w: 1 element(s), max abs diff 0.5, first at [1,1]"
check "diff says DIFFERENT" contains "$OUT" "DIFFERENT: "

run diff "$RUN/step_000100" "$WORK/bumped" --json
expect_rc "diff --json of different values exits 1" 1
check "diff --json gives the value difference" \
  python_json "v = d['values_differ']; assert d['equal'] is False and len(v) == 1 and v[0]['name'] == 'model.w' and v[0]['max_abs_diff'] == 0.5 and v[0]['first_index'] == [1, 1] and v[0]['elements_differing'] == 1, d"

run diff "$RUN/step_000100" "$WORK/bumped" --atol 0.5
expect_rc "diff within --atol exits 0" 0
run diff "$RUN/step_000100" "$WORK/bumped" --atol 0.49
expect_rc "diff beyond --atol exits 1" 1

run diff "$RUN/step_000100" "$RUN/step_000200" --json
expect_rc "diff of different objects exits 1" 1
check "diff --json names the differing object" \
  python_json "assert d['objects_differ'] == ['train.step'] and d['values_differ'] == [], d"

run diff "$RUN/step_000100" "$WORK/no_optim"
expect_rc "diff with keys only in A exits 1" 1
check "diff lists a tensor only in A" contains "$OUT" "only in A: tensor optim.m"
check "diff lists an object only in A" contains "$OUT" "only in A: object optim.lr"
run diff "$WORK/no_optim" "$RUN/step_000100" --json
check "diff --json lists the keys only in B" \
  python_json "assert d['tensors_only_in_b'] == ['optim.count', 'optim.m'] and d['objects_only_in_b'] == ['optim.lr'], d"

run diff "$RUN/step_000100" "$WORK/nothing-here"
expect_rc "diff with a missing checkpoint exits 1" 1
check "diff names the missing checkpoint" contains "$ERR" "$WORK/nothing-here"
run diff "$RUN/step_000100"
expect_rc "diff with one checkpoint exits 2" 2
run diff "$RUN/step_000100" "$WORK/same" --atol -1
expect_rc "diff with a negative --atol exits 2" 2
check "diff names the bad --atol" contains "$ERR" "--atol expects a finite number >= 0, not '-1'"

# ---- prune --------------------------------------------------------------------------------------
make_checkpoint "$WORK/prune" --step 100
BEFORE=$(fingerprint "$WORK/prune")
run prune "$WORK/prune" --prefix optim. --dry-run
expect_rc "prune --dry-run exits 0" 0
check "prune --dry-run says what would go" contains "$OUT" "would remove tensor optim.m"
check "prune --dry-run changes nothing" test "$BEFORE" == "$(fingerprint "$WORK/prune")"

run prune "$WORK/prune" --prefix optim. --prefix nothing.here
expect_rc "prune with a prefix matching nothing exits 1" 1
check "prune names the prefix matching nothing" contains "$ERR" "prefix 'nothing.here' matches no tensor or object"
check "a failed prune changes nothing" test "$BEFORE" == "$(fingerprint "$WORK/prune")"

run prune "$WORK/prune" --prefix optim. --json
expect_rc "prune exits 0" 0
check "prune --json lists what it removed" \
  python_json "assert d['tensors_removed'] == ['optim.count', 'optim.m'] and d['objects_removed'] == ['optim.lr'], d"
run verify "$WORK/prune"
expect_rc "the pruned checkpoint verifies" 0
run diff "$WORK/prune" "$WORK/no_optim"
expect_rc "the pruned checkpoint equals one saved without the pruned keys" 0

make_checkpoint "$WORK/prune2" --step 100
run prune "$WORK/prune2" --prefix model.b --json
expect_rc "prune of a tensor sharing its files exits 0" 0
check "prune rewrites the files holding it" \
  python_json "assert len(d['files_rewritten']) >= 1 and len(d['files_written']) == len(d['files_rewritten']), d"
REWRITTEN=$(python3 -c "import json, sys; print(json.load(sys.stdin)['files_rewritten'][0])" <<<"$OUT")
check "prune removed the old file" test ! -e "$WORK/prune2/$REWRITTEN"
check "prune leaves only the committed files" \
  python_json "import os; files = set(os.listdir('$WORK/prune2')); assert files == set(d['files_written'] + d['files_untouched'] + ['shardpoint.metadata']), files"
run verify "$WORK/prune2"
expect_rc "the rewritten checkpoint verifies" 0
run diff "$RUN/step_000100" "$WORK/prune2" --json
check "the rewritten checkpoint differs only by the pruned key" \
  python_json "assert d['tensors_only_in_a'] == ['model.b'] and d['values_differ'] == [] and d['tensors_compared'] == 3, d"

run prune "$WORK/prune"
expect_rc "prune without --prefix exits 2" 2
run prune "$WORK/nothing-here" --prefix x
expect_rc "prune of a missing checkpoint exits 1" 1
run prune "$RUN/iter_50" --prefix x
expect_rc "prune of a non-native checkpoint exits 1" 1

# ---- gc -----------------------------------------------------------------------------------------
BEFORE=$(fingerprint "$RUN")
run gc "$RUN" --keep-last 2 --keep-every 200 --dry-run
expect_rc "gc --dry-run exits 0" 0
check "gc --dry-run says what would go" contains "$OUT" "would delete  step 100"
check "gc --dry-run changes nothing" test "$BEFORE" == "$(fingerprint "$RUN")"

run gc "$RUN" --keep-last 2 --keep-every 200 --json
expect_rc "gc exits 0" 0
check "gc --json gives every decision" \
  python_json "a = {c['name']: (c['action'], c['reason']) for c in d['checkpoints']}; assert a == {'iter_50': ('delete', 'expired'), 'step_000100': ('delete', 'expired'), 'step_000200': ('keep', 'keep-every'), 'step_000300': ('delete', 'expired'), 'step_000400': ('keep', 'keep-last'), 'step_000500': ('keep', 'latest'), 'global_step900': ('keep', 'uncommitted')}, a"
check "gc deleted the expired ones" test ! -e "$RUN/step_000100" -a ! -e "$RUN/step_000300" -a ! -e "$RUN/iter_50"
check "gc kept the uncommitted one and its file" test -f "$RUN/global_step900/d-x-r00000-f000.safetensors.tmp"
check "gc left other directories alone" test -d "$RUN/logs" -a -d "$RUN/.step_700"
run verify "$RUN/step_000500"
expect_rc "the latest checkpoint still verifies" 0

run gc "$RUN" --keep-last 1
expect_rc "gc keeping one exits 0" 0
check "gc never deletes the latest" test -f "$RUN/step_000500/shardpoint.metadata"
check "gc never deletes an uncommitted checkpoint" test -d "$RUN/global_step900"
check "gc deleted the rest" test ! -e "$RUN/step_000200" -a ! -e "$RUN/step_000400"

run gc "$RUN"
expect_rc "gc without --keep-last exits 2" 2
check "gc says --keep-last is required" contains "$ERR" "--keep-last is required"
run gc "$RUN" --keep-last 0
expect_rc "gc --keep-last 0 exits 2" 2
run gc "$RUN" --keep-last two
expect_rc "gc with a non-numeric --keep-last exits 2" 2
run gc "$RUN" --keep-last 1 --keep-every 0
expect_rc "gc --keep-every 0 exits 2" 2
run gc "$WORK/no-such-dir" --keep-last 1
expect_rc "gc of a missing directory exits 1" 1

# ---- the command line ---------------------------------------------------------------------------
for verb in list gc prune diff; do
  run "$verb" --no-such-option
  expect_rc "$verb with an unknown option exits 2" 2
  check "$verb names the unknown option" contains "$ERR" "unknown option --no-such-option"
  check "$verb prints its usage on a bad option" contains "$ERR" "usage: shardpoint $verb"
  run "$verb" --help
  expect_rc "$verb --help exits 0" 0
  check "$verb --help prints its usage" contains "$OUT" "usage: shardpoint $verb"
done
run list
expect_rc "list without DIR exits 2" 2
run --help
check "--help lists the new verbs" contains "$OUT" "gc DIR"

echo "$passed passed, $failed failed"
[[ $failed -eq 0 ]]

# The harness shared by the command-line end-to-end tests (sourced, not run).
#
# The sourcing script sets BIN (the shardpoint binary) and WORK (a scratch directory) first. It
# provides: run ARGS... (the binary's stdout in OUT, stderr in ERR, status in RC), pass, fail,
# check NAME CONDITION..., contains TEXT PART, expect_rc NAME STATUS, known_bug, python_json,
# make_checkpoint and fingerprint (with MAKE set to make_test_checkpoint), and
# the counters passed / failed / skipped that finish prints and turns into the exit status.

passed=0
failed=0
skipped=0
OUT=""
ERR=""
RC=0

# run ARGS...: runs the binary, keeping its stdout in OUT, its stderr in ERR and its status in RC.
run() {
  OUT=$("$BIN" "$@" 2>"$WORK/stderr")
  RC=$?
  ERR=$(<"$WORK/stderr")
}

pass() {
  passed=$((passed + 1))
  echo "PASS $1"
}

fail() {
  failed=$((failed + 1))
  echo "FAIL $1: $2"
  echo "  exit status: $RC"
  echo "  stdout: $(head -c 2000 <<<"$OUT")"
  echo "  stderr: $(head -c 2000 <<<"$ERR")"
}

# make_checkpoint DIR [options]: a fixture checkpoint written by $MAKE (make_test_checkpoint), or
# the test stops.
make_checkpoint() {
  if ! "$MAKE" "$@"; then
    echo "FAIL could not create the checkpoint $1"
    exit 1
  fi
}

# fingerprint DIR: every file under DIR with its checksum, to see that nothing changed.
fingerprint() { (cd "$1" && find . -type f -print0 | sort -z | xargs -0 -r md5sum); }

# check NAME CONDITION...: the condition is a command (usually [[ ... ]]) evaluated now.
check() {
  local name=$1
  shift
  if "$@"; then pass "$name"; else fail "$name" "$*"; fi
}

contains() { [[ $1 == *"$2"* ]]; }

# The exit status and where the message went.
expect_rc() {
  local name=$1 want=$2
  if [[ $RC -eq $want ]]; then pass "$name"; else fail "$name" "expected exit status $want"; fi
}

# A check that fails because of a reported bug: it does not count as a failure while the bug is
# open, and says so when it starts passing.
known_bug() {
  local name=$1 reason=$2
  shift 2
  if "$@" 2>/dev/null; then
    pass "$name (fixed: remove it from the known bugs)"
  else
    skipped=$((skipped + 1))
    echo "SKIP $name: known bug: $reason"
  fi
}

python_json() {  # python_json SCRIPT: runs SCRIPT with the JSON document in OUT as `d`.
  python3 -c "import json, sys; d = json.load(sys.stdin); $1" <<<"$OUT"
}

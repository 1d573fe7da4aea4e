#!/usr/bin/env bash
# kvmeshctl's own front end, without a node: the usage text, per-command --help, the dispatch
# of every command, and the exit codes and messages of bad command lines (0: success; 1: a bad
# flag value or a failed call; 2: an unknown command, flag or argument). The commands' calls
# against real nodes are covered by deploy/local/demo.sh and the benchmarks.
#
#   tests/integration/kvmeshctl_cli_test.sh KVMESHCTL
set -uo pipefail

ctl=${1:?usage: $0 KVMESHCTL}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
passed=0
failed=0

# check MESSAGE COMMAND...: one assertion; COMMAND's success is a pass, else MESSAGE is printed.
check() {
  local message=$1
  shift
  if "$@"; then
    passed=$((passed + 1))
  else
    echo "FAIL: $message"
    failed=$((failed + 1))
  fi
}

# run ARGS...: runs kvmeshctl, leaving its exit code in $rc and its output in $work/out, err.
run() {
  "$ctl" "$@" >"$work/out" 2>"$work/err"
  rc=$?
}

# expect CODE STREAM TEXT ARGS...: kvmeshctl ARGS exits with CODE and STREAM (out or err)
# contains TEXT.
expect() {
  local code=$1 stream=$2 text=$3
  shift 3
  run "$@"
  check "kvmeshctl $*: exit $rc, want $code; stderr: $(head -c 400 "$work/err")" \
    [ "$rc" -eq "$code" ]
  check "kvmeshctl $*: $stream lacks '$text': $(head -c 400 "$work/$stream")" \
    grep -qF -- "$text" "$work/$stream"
}

commands=(create delete get list usage append read visible copy-prefix remove can-resume
          reserve set-retention list-sequences lookup-prefix watch-events snapshot restore
          merge-snapshots
          split-snapshot drop-snapshot list-snapshots commit-speculation health list-members
          migrate migrate-snapshot drain)

# The usage: every command, on stdout with exit 0 for help; on stderr with exit 2 for nothing.
expect 0 out "usage: kvmeshctl [--addr=HOST:PORT]" help
cp "$work/out" "$work/help"
for c in "${commands[@]}"; do
  check "kvmeshctl help does not list '$c'" grep -qE "^  $c +" "$work/help"
done
listed=$(grep -cE '^  [a-z][a-z-]+ ' "$work/help" | tr -d ' ')
# The commands, plus the help entry itself.
check "kvmeshctl help lists $listed entries, want $((${#commands[@]} + 1)) (update this list)" \
  [ "$listed" -eq $((${#commands[@]} + 1)) ]
expect 0 out "usage: kvmeshctl" --help
check "kvmeshctl --help differs from kvmeshctl help" cmp -s "$work/out" "$work/help"
expect 2 err "usage: kvmeshctl"
check "kvmeshctl without a command printed on stdout" [ ! -s "$work/out" ]

# COMMAND --help: the usage line and that command's entry alone.
for c in "${commands[@]}"; do
  expect 0 out "usage: kvmeshctl" "$c" --help
  check "kvmeshctl $c --help lacks its entry" grep -qE "^  $c( |$)" "$work/out"
  others=$(grep -E '^  [a-z][a-z-]+( |$)' "$work/out" | grep -cvE "^  $c( |$)")
  check "kvmeshctl $c --help shows $others other entries" [ "$others" -eq 0 ]
done

# Bad command lines.
expect 2 err "error: INVALID_ARGUMENT: unknown command 'bogus'" bogus
expect 2 err "unknown flag --bogus for 'list'; allowed: --addr, --timeout, --json, --help" \
  list --bogus=1
expect 2 err "unknown flag --seq for 'get'" get --cache=c --seq=1
expect 2 err "unknown flag --seq for 'drain'" drain --seq=1
expect 2 err "unexpected argument 'extra'" list extra
expect 1 err "--timeout='abc' is not a duration" --timeout=abc list
expect 1 err "give --seed or --payload-file, not both" \
  append --cache=c --seq=0 --positions=0 --seed=1 --payload-file=/nonexistent
expect 1 err "--token-ids names 2 ids for 1 positions; give one per position" \
  append --cache=c --seq=0 --positions=0 --token-ids=1,2

# A call that cannot reach a node: exit 1 and the gRPC code (port 1 on loopback refuses).
run --addr=127.0.0.1:1 --timeout=5s health
check "health against a closed port: exit $rc, want 1" [ "$rc" -eq 1 ]
check "health against a closed port: stderr is '$(cat "$work/err")'" \
  grep -qE '^error: (UNAVAILABLE|DEADLINE_EXCEEDED): ' "$work/err"

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]

#!/usr/bin/env bash
# fuzz_seeds_current: whether the committed seeds are what kvmesh_fuzz_seeds writes now.
#   check_seeds.sh SEEDS_BINARY CORPUS_DIR
set -euo pipefail
seeds=$1 corpus=$2
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$seeds" "$out" >/dev/null
if ! diff -r "$out" "$corpus"; then
  echo "$corpus is not what kvmesh_fuzz_seeds writes now (a wire format, proto or baseline"
  echo "change?): regenerate it with   $seeds $corpus"
  exit 1
fi
echo "the seeds in $corpus are current"

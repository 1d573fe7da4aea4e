#!/usr/bin/env bash
# Prepares a kvmesh node for the ghz configs of deploy/load/ (docs/load.md), with kvmeshctl:
#
#   1. deletes the cache load-llama3-8b when it exists (everything a previous run left goes),
#   2. creates it with the Llama-3-8B KV shape: 32 layers, 8 KV heads, head dim 128, F16, NEOX
#      RoPE over 128 dims, base 500000 (128 KiB per token); max_sequences 32, capacity 512,
#      max_batch 512: 16384 cells = 2 GiB, allocated when the cache is created (the host
#      device maps it untouched: memory becomes resident as tokens are written),
#   3. appends the prefix: seq 0, positions 0..4095 (512 MiB of kvmeshctl's pattern, seed 1),
#   4. forks it into seqs 1..16 with CopyPrefix (cells shared, nothing copied): 17 sequences of
#      4096 tokens, the state the control-plane goal of docs/benchmarks.md is measured in.
#
# The configs then use: seq 0 (CanResume at 4096, the CopyPrefix source, Visible), seqs 1..8
# and 11..14 (CopyPrefix destinations), seqs 9..16 (Remove), seqs 100..103 and 200..203
# (Append, at positions {{.RequestNumber}}: empty after this script). The node needs --memory-budget of at least
# 2GiB; run.sh starts its node with 3GiB.
#
#   deploy/load/prepare.sh [--addr=HOST:PORT] [--ctl=PATH] [--prefix-tokens=N]
#
#   --addr           the node (default 127.0.0.1:7700)
#   --ctl            kvmeshctl (default: $KVMESH_CTL, else build*/service/kvmeshctl of this
#                    checkout, else kvmeshctl on PATH)
#   --prefix-tokens  length of seq 0's prefix (default 4096; the CI check of the sanitizer
#                    builds uses 512 to stay fast: every call of the configs works with any)
#
# A node with tokens (docs/security.md): kvmeshctl reads $KVMESH_TOKEN.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
addr=127.0.0.1:7700
ctl=${KVMESH_CTL:-}
prefix=4096
for arg in "$@"; do
  case "$arg" in
    --addr=*) addr=${arg#--addr=} ;;
    --ctl=*) ctl=${arg#--ctl=} ;;
    --prefix-tokens=*) prefix=${arg#--prefix-tokens=} ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "prepare.sh: unknown argument '$arg' (--help)" >&2; exit 2 ;;
  esac
done
case "$prefix" in
  ''|*[!0-9]*) echo "prepare.sh: --prefix-tokens=$prefix is not a number" >&2; exit 2 ;;
esac
if [ "$prefix" -lt 1 ] || [ "$prefix" -gt 16384 ]; then
  echo "prepare.sh: --prefix-tokens=$prefix is not in [1, 16384]" >&2
  exit 2
fi

if [ -z "$ctl" ]; then
  for candidate in "$root"/build/service/kvmeshctl "$root"/build-*/service/kvmeshctl; do
    if [ -x "$candidate" ]; then ctl=$candidate; break; fi
  done
fi
if [ -z "$ctl" ]; then ctl=$(command -v kvmeshctl || true); fi
if [ -z "$ctl" ] || [ ! -x "$ctl" ]; then
  echo "prepare.sh: no kvmeshctl: build it (cmake --build build --target kvmesh_ctl)" \
       "or pass --ctl=PATH" >&2
  exit 2
fi

cache=load-llama3-8b
k() { "$ctl" --addr="$addr" "$@"; }

if ! out=$(k delete --cache="$cache" 2>&1); then
  case "$out" in
    *NOT_FOUND*) ;;
    *) echo "prepare.sh: deleting $cache on $addr failed: $out" >&2; exit 1 ;;
  esac
fi
k create --name="$cache" --dtype=f16 --max-sequences=32 --capacity=512 --max-batch=512 \
  --group=attention:layers=32,heads=8,head_dim=128,window=full,rope=neox:128:500000:1 >/dev/null
k append --cache="$cache" --seq=0 --positions=0:"$prefix" --seed=1 --stream >/dev/null
for dst in $(seq 1 16); do
  k copy-prefix --cache="$cache" --src=0 --dst="$dst" --length="$prefix" >/dev/null
done
echo "prepare.sh: $addr: cache $cache (Llama-3-8B shape, 16384 cells), seq 0 holds" \
     "positions 0..$((prefix - 1)), seqs 1..16 fork it"

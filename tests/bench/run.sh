#!/usr/bin/env bash
# Builds the benchmarks and runs them, printing the machine first. Never run by ctest.
#
#   tests/bench/run.sh [all]           engine_bench, rpc_bench (starts its own node), then
#                                      migrate_bench (starts two nodes); takes no ARGS
#   tests/bench/run.sh engine [ARGS]   engine_bench only; ARGS go to it (--benchmark_filter=Read)
#   tests/bench/run.sh rpc [ARGS]      rpc_bench only; ARGS go to it (--threads=16 --duration=5s)
#   tests/bench/run.sh migrate [ARGS]  migrate_bench only; ARGS go to it (--reps=9
#                                      --node-flags="--transport=grpc-stream")
#   tests/bench/run.sh lookup [ARGS]   lookup_bench only (prefix lookups against the block
#                                      index up to 10M blocks); ARGS go to it (--max-blocks=N)
#   tests/bench/run.sh events [ARGS]   events_bench only (two nodes: how fast appends reach the
#                                      other's cluster index, and the writer's cost); ARGS go
#                                      to it (--reps=N --tokens=N --duration=5s)
#   tests/bench/run.sh eviction [ARGS] eviction_bench only (an Append that evicts, against one
#                                      with room); ARGS go to it (--appends=N)
#   tests/bench/run.sh local [ARGS]    local_bench (the local data path's write and read
#                                      against memcpy and gRPC, 1 GiB of Llama-3-8B KV; ARGS go
#                                      to it: --tokens=N --reps=N), then the reference worker's
#                                      time to first token of a 4K-token prompt, full prefix hit
#                                      against recomputing it (tests/bench/worker_ttft.py)
#
# KVMESH_BUILD_DIR picks the build directory (default <repo>/build).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build_dir=${KVMESH_BUILD_DIR:-$root/build}
what=all
case "${1:-}" in
  engine|rpc|migrate|lookup|events|eviction|local|all) what=$1; shift ;;
  -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
esac
if [ "$what" = all ] && [ "$#" -gt 0 ]; then
  echo "run.sh: ARGS need a mode (engine, rpc, migrate, lookup, events, eviction or local): each bench has its own flags" >&2
  exit 2
fi

"$root/scripts/bootstrap.sh"
cmake -S "$root" -B "$build_dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVMESH_BUILD_BENCH=ON \
  >/dev/null
targets=()
case "$what" in
  engine) targets+=(engine_bench) ;;
  rpc) targets+=(rpc_bench kvmesh_node) ;;
  migrate) targets+=(migrate_bench kvmesh_node) ;;
  lookup) targets+=(lookup_bench) ;;
  events) targets+=(events_bench kvmesh_node) ;;
  eviction) targets+=(eviction_bench) ;;
  local) targets+=(local_bench kvmesh_node kvmesh_python) ;;
  all) targets+=(engine_bench rpc_bench migrate_bench kvmesh_node) ;;
esac
cmake --build "$build_dir" -j"$(nproc)" --target "${targets[@]}"

echo
echo "== machine"
echo "nproc: $(nproc)"
lscpu | grep 'Model name' || true
grep MemTotal /proc/meminfo
echo "kernel: $(uname -r)"
echo "commit: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)"

if [ "$what" = engine ] || [ "$what" = all ]; then
  echo
  echo "== engine_bench $*"
  "$build_dir/tests/bench/engine_bench" "$@"
fi
if [ "$what" = rpc ] || [ "$what" = all ]; then
  echo
  echo "== rpc_bench $*"
  "$build_dir/tests/bench/rpc_bench" "$@"
fi
if [ "$what" = lookup ]; then
  echo
  echo "== lookup_bench $*"
  "$build_dir/tests/bench/lookup_bench" "$@"
fi
if [ "$what" = eviction ]; then
  echo
  echo "== eviction_bench $*"
  "$build_dir/tests/bench/eviction_bench" "$@"
fi
if [ "$what" = local ]; then
  echo
  echo "== local_bench $*"
  "$build_dir/tests/bench/local_bench" "$@"
  echo
  echo "== worker_ttft.py --tokens=4096"
  PYTHONPATH="$root/clients/python/examples:$root/clients/python/tests:$root/clients/python:$build_dir/clients/python" \
    KVMESH_NODE="$build_dir/service/kvmesh-node" PYTHONDONTWRITEBYTECODE=1 \
    /usr/bin/python3 "$root/tests/bench/worker_ttft.py" --tokens=4096
fi
if [ "$what" = events ]; then
  echo
  echo "== events_bench $*"
  "$build_dir/tests/bench/events_bench" "$@"
fi
if [ "$what" = migrate ] || [ "$what" = all ]; then
  echo
  echo "== migrate_bench $*"
  "$build_dir/tests/bench/migrate_bench" "$@"
fi

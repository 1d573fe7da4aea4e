#!/usr/bin/env bash
# Builds the benchmarks and runs them, printing the machine first. Never run by ctest.
#
#   tests/bench/run.sh                 engine_bench, then rpc_bench (starts its own node)
#   tests/bench/run.sh engine [ARGS]   engine_bench only; ARGS go to it (--benchmark_filter=Read)
#   tests/bench/run.sh rpc [ARGS]      rpc_bench only; ARGS go to it (--threads=16 --duration=5s)
#
# KVMESH_BUILD_DIR picks the build directory (default <repo>/build).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build_dir=${KVMESH_BUILD_DIR:-$root/build}
what=all
case "${1:-}" in
  engine|rpc|all) what=$1; shift ;;
  -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
esac

"$root/scripts/bootstrap.sh"
cmake -S "$root" -B "$build_dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVMESH_BUILD_BENCH=ON \
  >/dev/null
targets=()
[ "$what" = rpc ] || targets+=(engine_bench)
[ "$what" = engine ] || targets+=(rpc_bench)
cmake --build "$build_dir" -j"$(nproc)" --target "${targets[@]}"

echo
echo "== machine"
echo "nproc: $(nproc)"
lscpu | grep 'Model name' || true
grep MemTotal /proc/meminfo
echo "kernel: $(uname -r)"
echo "commit: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)"

if [ "$what" != rpc ]; then
  echo
  echo "== engine_bench $*"
  "$build_dir/tests/bench/engine_bench" "$@"
fi
if [ "$what" != engine ]; then
  echo
  echo "== rpc_bench $*"
  "$build_dir/tests/bench/rpc_bench" "$@"
fi

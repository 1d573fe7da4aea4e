#!/usr/bin/env bash
# Builds kvmesh_soak and the node, prints the machine, and runs the soak (default: 10 minutes,
# 8 clients, 100 ops/s on a two-node cluster; tests/soak/soak_main.cc). Never run by ctest
# (ctest runs only soak_smoke, a few seconds).
#
#   tests/soak/run.sh [ARGS]     ARGS go to kvmesh_soak (--duration=30m --rate=200 --seed=7 ...)
#
# KVMESH_BUILD_DIR picks the build directory (default <repo>/build). Exit status: kvmesh_soak's
# (0 pass, 1 a failure, 2 bad flags or setup).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build_dir=${KVMESH_BUILD_DIR:-$root/build}
case "${1:-}" in
  -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
esac

"$root/scripts/bootstrap.sh"
cmake -S "$root" -B "$build_dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVMESH_BUILD_BENCH=ON \
  >/dev/null
cmake --build "$build_dir" -j"$(nproc)" --target kvmesh_soak kvmesh_node

echo
echo "== machine"
echo "nproc: $(nproc)"
lscpu | grep 'Model name' || true
grep MemTotal /proc/meminfo
echo "kernel: $(uname -r)"
echo "commit: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)"
echo "uptime before: $(uptime)"

echo
echo "== kvmesh_soak $*"
status=0
"$build_dir/tests/soak/kvmesh_soak" "$@" || status=$?
echo "uptime after: $(uptime)"
exit "$status"

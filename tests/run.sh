#!/usr/bin/env bash
# Installs what is missing, builds kvmesh and runs every test through ctest.
#
#   tests/run.sh                 RelWithDebInfo build (gcc) in build/, all tests
#   tests/run.sh --asan          ASan+UBSan build (clang) in build-asan/
#   tests/run.sh --tsan          TSan build (clang) in build-tsan/
#   tests/run.sh --all           the three builds one after another
#   tests/run.sh -L unit         only tests with a label (unit, integration); other
#                                arguments after the mode go to ctest as they are
#
# All three builds are -DKVMESH_CUDA=SIM: the CUDA device, its kernels and the nccl transport run
# on the simulated GPU and NCCL of tests/testing/ (docs/cuda.md), so their tests run here
# instead of skipping (under TSan the parity test runs once, short).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
modes=()
ctest_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --asan) modes+=(asan) ;;
    --tsan) modes+=(tsan) ;;
    --default) modes+=(default) ;;
    --all) modes+=(default asan tsan) ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) ctest_args+=("$1") ;;
  esac
  shift
done
[ ${#modes[@]} -gt 0 ] || modes=(default)

"$root/scripts/bootstrap.sh"
jobs=$(nproc)

run_mode() {
  local mode=$1 dir cmake_args=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVMESH_WERROR=ON)
  case "$mode" in
    default) dir="$root/build"
             cmake_args+=(-DKVMESH_CUDA=SIM) ;;
    asan) dir="$root/build-asan"
          cmake_args+=(-DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++
                       -DKVMESH_SANITIZE=address -DKVMESH_CUDA=SIM -DKVMESH_BUILD_BENCH=OFF) ;;
    tsan) dir="$root/build-tsan"
          cmake_args+=(-DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++
                       -DKVMESH_SANITIZE=thread -DKVMESH_CUDA=SIM -DKVMESH_BUILD_BENCH=OFF) ;;
  esac
  echo "== tests/run.sh: $mode build in ${dir#$root/}"
  cmake -S "$root" -B "$dir" "${cmake_args[@]}" >/dev/null
  cmake --build "$dir" -j"$jobs"
  export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}
  export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
  export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1:suppressions=$root/tests/sanitizers/tsan.supp}
  ctest --test-dir "$dir" --output-on-failure -j"$jobs" "${ctest_args[@]}"
}

for mode in "${modes[@]}"; do
  run_mode "$mode"
done

#!/usr/bin/env bash
# Builds kvmesh with CUDA on the GPU machine (engine and tests; no gRPC), runs the tests labelled
# `gpu` and then gpu_bench, and leaves the logs in $OUT (or <build dir>/gpu-logs).
#
# The GPU machine's image has nvcc, cmake and ninja but neither GoogleTest nor Abseil, and
# nothing can be installed there. So, first, on the Debian build machine:
#
#   tests/gpu/prepare.sh            # fills .gpu-deps (gitignored, ~14 MiB)
#
# then, through the device tool, from the repo root, in one call:
#
#   run(command="bash tests/gpu/run.sh", carry=[".gpu-deps"], timeout_s=600)
#
# and read the table and summary at the end of output_tail; the files come back from $OUT:
# build.log (configure + build), env.txt (nvidia-smi, compilers, OS), ctest.log (console),
# ctest-full.log (every test's whole output), gpu_bench.log, summary.txt.
#
# NCCL (the nccl transport's tests/gpu/nccl_self_transfer_test): kvmesh links no NCCL; it loads
# libnccl.so.2 at run time (transport/nccl_api.h), so the build needs nccl.h only and the test
# needs the GPU machine's own library, too large to carry (~200 MiB): /usr/local/cuda's when it
# has one, else the one in Python's nvidia-nccl wheel (PyTorch's), with that wheel's nccl.h or,
# lacking one, the nccl.h that prepare.sh copied into .gpu-deps/nccl. KVMESH_GPU_NCCL_DIR=<dir
# with lib/ and include/> overrides the search. The library found is passed to CMake as
# KVMESH_NCCL_LIBRARY, which ctest hands to the tests in the environment variable of that name
# (and it is exported here too). Without nccl.h that test is not built; without a library it
# fails to load NCCL (the summary says which).
#
# Options:
#   --build-only      configure and build only (checks the build path on a machine without GPU)
#   --build-dir DIR   build directory (default <repo>/build-gpu)
#   --quick           pass --quick to gpu_bench (small shape, smoke run)
#   -- ARGS...        further gpu_bench arguments, e.g. `-- --iters 50`
# Environment: KVMESH_GPU_JOBS (build jobs, default nproc), KVMESH_CTEST_JOBS (tests run at once,
# default 4), KVMESH_GPU_BUILD_TYPE (default Release).
#
# Order: tests first, then gpu_bench even when tests failed (its timings and wrong-byte checks
# stand on their own), then the summary, last, so that it ends the console output. Exit status:
# 0 built, every gpu test passed and gpu_bench found no wrong byte; 1 a test or gpu_bench failed
# (a test binary that skips for want of a GPU, and gpu_bench's "no CUDA device" exit 77, count
# as failures here: this script is for a GPU machine); 2 .gpu-deps missing or bad arguments;
# 3 configure or build failed.
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
deps=$root/.gpu-deps
build_dir=$root/build-gpu
build_only=0
bench_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --build-only) build_only=1 ;;
    --build-dir)
      [ -n "${2:-}" ] || { echo "run.sh: --build-dir needs a directory" >&2; exit 2; }
      build_dir=$(realpath -m "$2"); shift ;;
    --quick) bench_args+=(--quick) ;;
    --) shift; bench_args+=("$@"); break ;;
    -h|--help) awk 'NR > 1 && /^#/ {print; next} NR > 1 {exit}' "$0"; exit 0 ;;
    *) echo "run.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done

absl_dir=$deps/absl/lib/x86_64-linux-gnu/cmake/absl
gtest_src=$deps/googletest
if [ ! -f "$absl_dir/abslConfig.cmake" ] || [ ! -f "$gtest_src/CMakeLists.txt" ]; then
  cat >&2 <<EOF
run.sh: ERROR: $deps is missing or incomplete (need $absl_dir/abslConfig.cmake and
run.sh: $gtest_src/CMakeLists.txt). Run tests/gpu/prepare.sh on the build machine and carry
run.sh: .gpu-deps: run(command="bash tests/gpu/run.sh", carry=[".gpu-deps"]).
EOF
  exit 2
fi

log_dir=${OUT:-$build_dir/gpu-logs}
mkdir -p "$build_dir" "$log_dir"
# The copied Abseil is a set of shared libraries: binaries find them through their build RPATH
# (see the configure flags); this covers anything that has none.
export LD_LIBRARY_PATH=$deps/absl/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

summary=()
note() { summary+=("$*"); }
finish() {
  {
    echo
    echo "== summary ($(date -u +%H:%M:%SZ))"
    printf '%s\n' "${summary[@]}"
  } | tee -a "$log_dir/summary.txt"
  exit "$1"
}
# Keeps a log file within what the device tool brings back (16 MiB a file).
cap() { [ ! -f "$1" ] || [ "$(stat -c %s "$1")" -le 15000000 ] ||
        { tail -c 15000000 "$1" >"$1.tmp" && mv "$1.tmp" "$1"; }; }
: >"$log_dir/summary.txt"

# ---- environment, for the record ----------------------------------------------------------
{
  echo "== $(date -u +%Y-%m-%dT%H:%M:%SZ) $(uname -srm)"
  # shellcheck disable=SC1091
  [ -r /etc/os-release ] && (. /etc/os-release && echo "os: $PRETTY_NAME")
  echo "glibc: $(ldd --version 2>&1 | head -1)"
  echo "nproc: $(nproc)"
  echo "cmake: $(cmake --version | head -1)"
  echo "c++: $(c++ --version 2>&1 | head -1)"
  nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  echo "nvcc: $nvcc: $("$nvcc" --version 2>&1 | tail -1)"
  echo ".gpu-deps:"; sed 's/^/  /' "$deps/MANIFEST" 2>/dev/null
  echo
  if command -v nvidia-smi >/dev/null; then nvidia-smi 2>&1; else echo "nvidia-smi: not found"; fi
} >"$log_dir/env.txt" 2>&1
cat "$log_dir/env.txt"

# ---- NCCL ----------------------------------------------------------------------------------
nccl_args=()
nccl_dir=${KVMESH_GPU_NCCL_DIR:-}
if [ -z "$nccl_dir" ] && ! ls /usr/local/cuda/lib64/libnccl.so* >/dev/null 2>&1; then
  nccl_dir=$(python3 -c 'import nvidia.nccl as n; print(list(n.__path__)[0])' 2>/dev/null || true)
fi
if [ -n "$nccl_dir" ]; then
  nccl_lib=$(find "$nccl_dir/lib" -maxdepth 1 -name 'libnccl.so*' 2>/dev/null | sort | head -1)
  nccl_inc=$nccl_dir/include
  [ -f "$nccl_inc/nccl.h" ] || nccl_inc=$deps/nccl/include
  if [ -n "$nccl_lib" ] && [ -f "$nccl_inc/nccl.h" ]; then
    nccl_args=(-DKVMESH_NCCL_LIBRARY="$nccl_lib" -DKVMESH_NCCL_INCLUDE_DIR="$nccl_inc")
    LD_LIBRARY_PATH=$(dirname "$nccl_lib"):$LD_LIBRARY_PATH
    export KVMESH_NCCL_LIBRARY=$nccl_lib
    note "nccl: $nccl_lib, headers $nccl_inc ($(grep -m1 -E '^#define NCCL_VERSION_CODE' \
      "$nccl_inc/nccl.h" | awk '{print $3}'))"
  else
    note "nccl: WARNING: nothing usable under $nccl_dir (lib/libnccl.so*, include/nccl.h)"
  fi
fi

# ---- configure and build -------------------------------------------------------------------
build_type=${KVMESH_GPU_BUILD_TYPE:-Release}
jobs=${KVMESH_GPU_JOBS:-$(nproc)}
generator=()
if [ ! -f "$build_dir/CMakeCache.txt" ] && command -v ninja >/dev/null; then generator=(-G Ninja); fi
configure=(cmake -S "$root" -B "$build_dir" "${generator[@]}"
  -DCMAKE_BUILD_TYPE="$build_type"
  -DKVMESH_BUILD_GRPC=OFF -DKVMESH_BUILD_TESTS=ON -DKVMESH_BUILD_BENCH=ON -DKVMESH_CUDA=ON
  -DKVMESH_GTEST_SOURCE_DIR="$gtest_src"
  -Dabsl_DIR="$absl_dir"
  -DKVMESH_XXHASH_INCLUDE_DIR="$deps/xxhash/include"
  "${nccl_args[@]}"
  # DT_RPATH, not RUNPATH: it also applies to the libraries' own dependencies (libabsl_* need
  # each other), so the binaries run there without LD_LIBRARY_PATH.
  "-DCMAKE_EXE_LINKER_FLAGS=-Wl,--disable-new-dtags")
echo
echo "== configure: ${configure[*]}"
start=$SECONDS
if ! "${configure[@]}" >"$log_dir/build.log" 2>&1; then
  tail -40 "$log_dir/build.log"
  note "configure: FAILED (see build.log)"
  finish 3
fi
grep -E '^-- kvmesh:' "$log_dir/build.log"
cached() { sed -n "s/^$1:[A-Z]*=//p" "$build_dir/CMakeCache.txt"; }
if grep -q 'NCCL=OFF' "$log_dir/build.log"; then
  note "nccl: WARNING: nccl.h not found; nccl_self_transfer_test is not built (see KVMESH_GPU_NCCL_DIR)"
elif [ ${#nccl_args[@]} = 0 ]; then
  nccl_lib=$(cached KVMESH_NCCL_LIBRARY)
  case "$nccl_lib" in
    ''|*NOTFOUND) note "nccl: WARNING: nccl.h found but no libnccl; nccl_self_transfer_test will fail to load NCCL (see KVMESH_GPU_NCCL_DIR)" ;;
    *) export KVMESH_NCCL_LIBRARY=$nccl_lib
       note "nccl: $nccl_lib (loaded at run time)" ;;
  esac
fi
echo "absl_DIR=$(cached absl_DIR)"
echo "KVMESH_GTEST_SOURCE_DIR=$(cached KVMESH_GTEST_SOURCE_DIR) (GTest_DIR=$(cached GTest_DIR))"
if [ "$(realpath -m "$(cached absl_DIR)")" != "$(realpath -m "$absl_dir")" ]; then
  note "configure: FAILED: CMake took Abseil from $(cached absl_DIR), not .gpu-deps"
  finish 3
fi

echo "== build (-j$jobs, $build_type)"
if ! cmake --build "$build_dir" -j"$jobs" >>"$log_dir/build.log" 2>&1; then
  grep -E -A12 'error|FAILED' "$log_dir/build.log" | head -80
  cap "$log_dir/build.log"
  note "build: FAILED after $((SECONDS - start)) s (see build.log)"
  finish 3
fi
cap "$log_dir/build.log"
note "build: ok in $((SECONDS - start)) s ($build_type, $build_dir)"
probe=$(find "$build_dir/tests" -maxdepth 2 -type f -name '*_test' -perm -u+x | head -1)
if [ -n "$probe" ]; then
  echo "abseil at run time ($(basename "$probe")): $(ldd "$probe" | grep -m1 libabsl_ | sed 's/^[[:space:]]*//')"
fi

if [ "$build_only" = 1 ]; then
  note "tests and gpu_bench: not run (--build-only)"
  finish 0
fi

# ---- gpu tests -----------------------------------------------------------------------------
status=0
echo
echo "== ctest -L gpu"
start=$SECONDS
(cd "$build_dir" && ctest -L gpu --output-on-failure --no-tests=error -j"${KVMESH_CTEST_JOBS:-4}") \
  2>&1 | tee "$log_dir/ctest.log"
ctest_rc=${PIPESTATUS[0]}
cp "$build_dir/Testing/Temporary/LastTest.log" "$log_dir/ctest-full.log" 2>/dev/null
cap "$log_dir/ctest.log"
cap "$log_dir/ctest-full.log"
skipped=$(grep -ohE '^\[  SKIPPED \] [0-9]+ tests?, listed below' "$log_dir/ctest-full.log" \
            2>/dev/null | awk '{s += $3} END {print s + 0}')
result=$(grep -E 'tests passed|No tests were found' "$log_dir/ctest.log" | tail -1)
if [ "$ctest_rc" = 0 ]; then
  note "gpu tests: ok in $((SECONDS - start)) s: $result"
else
  note "gpu tests: FAILED (ctest exit $ctest_rc) in $((SECONDS - start)) s: $result"
  status=1
fi
ctest_skipped=$(grep -c '\*\*\*Skipped' "$log_dir/ctest.log")
if [ "$ctest_skipped" != 0 ]; then
  # A whole binary skips only when it sees no GPU: on the machine this script is for, a failure.
  note "gpu tests: FAILED: $ctest_skipped test binaries skipped (no usable GPU?); see ctest.log"
  status=1
fi
if [ "$skipped" != 0 ]; then
  note "gpu tests: WARNING: $skipped test cases called GTEST_SKIP; see ctest-full.log"
fi

# ---- gpu_bench -----------------------------------------------------------------------------
echo
echo "== gpu_bench ${bench_args[*]}"
bench=$build_dir/tests/bench/gpu_bench
if [ ! -x "$bench" ]; then
  note "gpu_bench: FAILED: $bench was not built (KVMESH_HAVE_CUDA off?)"
  status=1
else
  timeout 300 "$bench" "${bench_args[@]}" 2>&1 | tee "$log_dir/gpu_bench.log"
  bench_rc=${PIPESTATUS[0]}
  case "$bench_rc" in
    0) note "gpu_bench: ok: $(grep -m1 '^# device' "$log_dir/gpu_bench.log")" ;;
    77) note "gpu_bench: FAILED: no CUDA device visible (exit 77)"; status=1 ;;
    124) note "gpu_bench: FAILED: timed out after 300 s"; status=1 ;;
    *) note "gpu_bench: FAILED (exit $bench_rc): $(tail -1 "$log_dir/gpu_bench.log")"; status=1 ;;
  esac
fi

note "logs: $log_dir"
finish "$status"

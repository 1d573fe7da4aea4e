#!/usr/bin/env bash
# Installs what is missing, builds kvmesh and runs every test through ctest.
#
#   tests/run.sh                 RelWithDebInfo build (gcc) in build/, all tests
#   tests/run.sh --asan          ASan+UBSan build (clang) in build-asan/
#   tests/run.sh --tsan          TSan build (clang) in build-tsan/
#   tests/run.sh --fuzz          libFuzzer build (clang, ASan+UBSan) in build-fuzz/: only the
#                                fuzz targets of tests/fuzz; replays their seeds and regression
#                                inputs, then fuzzes them at once, each for
#                                KVMESH_FUZZ_SECONDS (default 60) seconds; fails when one
#                                finds a crash (the input is left in
#                                build-fuzz/fuzz-artifacts/, the log in build-fuzz/fuzz-logs/)
#   tests/run.sh --all           the four builds one after another
#   tests/run.sh --default --asan --tsan
#                                the three test builds, what .ci/run runs (every build
#                                replays the fuzz targets' seeds and regression inputs)
#   tests/run.sh -L unit         only tests with a label (unit, integration); other
#                                arguments after the mode go to ctest as they are
#
# With several modes, each one after the first builds (at nice 19) while the one before it runs
# its tests; its build output is printed after those tests.
#
# All three builds are -DKVMESH_CUDA=SIM: the CUDA device, its kernels and the nccl transport run
# on the simulated GPU and NCCL of tests/testing/ (docs/cuda.md), so their tests run here
# instead of skipping (tests/CMakeLists.txt: which runs the sanitizer builds leave out, and why).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
modes=()
ctest_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --asan) modes+=(asan) ;;
    --tsan) modes+=(tsan) ;;
    --default) modes+=(default) ;;
    --fuzz) modes+=(fuzz) ;;
    --all) modes+=(default asan tsan fuzz) ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) ctest_args+=("$1") ;;
  esac
  shift
done
[ ${#modes[@]} -gt 0 ] || modes=(default)

"$root/scripts/bootstrap.sh"
jobs=$(nproc)

# The fuzz targets (tests/fuzz/CMakeLists.txt) and the libFuzzer flags each runs with beyond the
# common ones. rpc_fuzzer: a session sets off many features, which libFuzzer's entropic schedule
# spends most of its time weighing (4x fewer runs), and gRPC's threads allocate during every
# run, which makes libFuzzer look for leaks after each one (half the time); the harness checks
# every byte comes back after each session instead, and LeakSanitizer still checks the whole run
# at exit.
fuzz_targets=(snapshot_import_fuzzer rpc_fuzzer ctl_parse_fuzzer)
fuzz_flags() {
  case "$1" in
    rpc_fuzzer) echo "-entropic=0 -detect_leaks=0 -timeout=120" ;;
    *) echo "-timeout=30" ;;
  esac
}

# Fuzzes the targets at once, each for KVMESH_FUZZ_SECONDS, from its committed seeds and
# regression inputs and what earlier runs here found (build-fuzz/fuzz-corpus/, where new inputs
# go); prints exec/s and coverage per target. Every target runs; the mode fails if any found a
# crash. At once: on 2 cores three targets share the time one after another would take three.
run_fuzzers() {
  local dir=$1 seconds=${KVMESH_FUZZ_SECONDS:-60} failed=() pids=() target
  mkdir -p "$dir/fuzz-corpus" "$dir/fuzz-artifacts" "$dir/fuzz-logs"
  echo "== tests/run.sh: fuzzing ${fuzz_targets[*]} at once for ${seconds}s"
  for target in "${fuzz_targets[@]}"; do
    mkdir -p "$dir/fuzz-corpus/$target"
    # shellcheck disable=SC2046
    "$dir/tests/fuzz/$target" -max_total_time="$seconds" -print_final_stats=1 \
        -artifact_prefix="$dir/fuzz-artifacts/$target-" $(fuzz_flags "$target") \
        "$dir/fuzz-corpus/$target" "$root/tests/fuzz/corpus/$target" \
        "$root/tests/fuzz/regressions/$target" >"$dir/fuzz-logs/$target.log" 2>&1 &
    pids+=($!)
  done
  local i
  for i in "${!fuzz_targets[@]}"; do
    target=${fuzz_targets[$i]}
    local log="$dir/fuzz-logs/$target.log" rc=0
    wait "${pids[$i]}" || rc=$?
    # "#N INITED cov: C ft: F corp: K/..." after the seeds, "#N DONE ..." at the end.
    local inited done_line execs
    inited=$(grep -E '^#[0-9]+[[:space:]]+INITED' "$log" | head -1 || true)
    done_line=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -1 || true)
    execs=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log")
    if [ -n "$inited" ] && [ -n "$done_line" ]; then
      local a b
      read -r -a a <<<"$inited"
      read -r -a b <<<"$done_line"
      echo "   $target: ${b[0]#\#} runs, ${execs:-?} exec/s; coverage ${a[3]} -> ${b[3]} edges," \
           "${b[5]} features; corpus ${a[7]%%/*} -> ${b[7]%%/*} inputs"
    fi
    if [ "$rc" -ne 0 ]; then
      echo "   $target FAILED (exit $rc); the end of $log:"
      { grep -v -E '^#[0-9]+[[:space:]]+(NEW|REDUCE|pulse)' "$log" || true; } | tail -40 |
        sed 's/^/   | /'
      failed+=("$target")
    fi
  done
  if [ "${#failed[@]}" -gt 0 ]; then
    echo "== tests/run.sh: fuzzing found crashes in: ${failed[*]} (inputs in $dir/fuzz-artifacts/)"
    return 1
  fi
}

# The build directory and configure flags of a mode.
mode_dir() {
  case "$1" in
    default) echo "$root/build" ;;
    asan) echo "$root/build-asan" ;;
    tsan) echo "$root/build-tsan" ;;
    fuzz) echo "$root/build-fuzz" ;;
  esac
}

# Configures and builds a mode's tree.
build_mode() {
  local mode=$1 dir cmake_args=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVMESH_WERROR=ON)
  dir=$(mode_dir "$mode")
  case "$mode" in
    default) cmake_args+=(-DKVMESH_CUDA=SIM) ;;
    # ASan: line tables only (enough for its reports; no suppressions match names here), which
    # compiles a library file 12% faster than -g. TSan keeps -g: tests/sanitizers/tsan.supp
    # matches gRPC's functions by their qualified names.
    asan) cmake_args+=(-DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++
                       "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O2 -gline-tables-only -DNDEBUG"
                       "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -gline-tables-only -DNDEBUG"
                       -DKVMESH_SANITIZE=address -DKVMESH_CUDA=SIM -DKVMESH_BUILD_BENCH=OFF) ;;
    tsan) cmake_args+=(-DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++
                       -DKVMESH_SANITIZE=thread -DKVMESH_CUDA=SIM -DKVMESH_BUILD_BENCH=OFF) ;;
    # Only what the fuzz targets need: no CUDA, no tests, no benchmarks; -O1 with line tables
    # (as OSS-Fuzz builds), which compiles in less time than -O2 -g.
    fuzz) cmake_args+=(-DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++
                       "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -gline-tables-only -DNDEBUG"
                       "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -gline-tables-only -DNDEBUG"
                       -DKVMESH_SANITIZE=address -DKVMESH_FUZZ=ON -DKVMESH_CUDA=OFF
                       -DKVMESH_BUILD_TESTS=OFF -DKVMESH_BUILD_BENCH=OFF) ;;
  esac
  echo "== tests/run.sh: $mode build in ${dir#$root/}"
  cmake -S "$root" -B "$dir" "${cmake_args[@]}" >/dev/null
  if [ "$mode" = fuzz ]; then
    cmake --build "$dir" -j"$jobs" --target "${fuzz_targets[@]}" kvmesh_fuzz_seeds
  else
    cmake --build "$dir" -j"$jobs"
  fi
}

# Runs a built mode's tests (and, for fuzz, the fuzzers).
test_mode() {
  local mode=$1 dir
  dir=$(mode_dir "$mode")
  echo "== tests/run.sh: $mode tests in ${dir#$root/}"
  export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}
  export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$root/tests/sanitizers/lsan.supp}
  export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
  export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1:suppressions=$root/tests/sanitizers/tsan.supp}
  # The gcc and ASan builds' tests leave cores idle at -j$(nproc) (waiting on nodes, sockets,
  # timeouts): one more at once took the gcc ctest from 308 s to 243 s on 2 cores, and the ASan
  # one from 474 s to 410 s (1.45 cores busy; with the fuzz replays it has since, 1 s), all
  # passing. TSan's tests keep the cores busy (82%) in several times the memory, so they stay
  # at nproc.
  local ctest_jobs=$jobs
  if [ "$mode" = default ] || [ "$mode" = asan ]; then ctest_jobs=$((jobs + 1)); fi
  ctest --test-dir "$dir" --output-on-failure -j"$ctest_jobs" "${ctest_args[@]}"
  if [ "$mode" = fuzz ]; then
    run_fuzzers "$dir"
  fi
}

# With several modes, the next mode builds while this one's tests run, at the lowest priority
# (nice 19), so that it takes only the CPU the tests leave idle: they wait on nodes, sockets and
# timeouts, and even the TSan ctest kept 2 cores only 82% busy. Its output goes to a log in its
# build directory, printed once this mode's tests are done. The build of the first mode, and the
# tests of every mode, have the machine to themselves as before.
bg_pid=""
stop_background_build() {
  if [ -n "$bg_pid" ]; then
    kill -- "-$bg_pid" 2>/dev/null || true
    wait "$bg_pid" 2>/dev/null || true
    bg_pid=""
  fi
}
trap stop_background_build EXIT

build_mode "${modes[0]}"
for i in "${!modes[@]}"; do
  mode=${modes[$i]}
  next=${modes[$((i + 1))]:-}
  bg_log=""
  if [ -n "$next" ]; then
    mkdir -p "$(mode_dir "$next")"
    bg_log="$(mode_dir "$next")/tests-run-build.log"
    # Job control on for this one job: its own process group, which stop_background_build ends
    # whole (make and its compilers) when the tests fail first.
    set -m
    ( set +m; renice -n 19 -p "$BASHPID" >/dev/null; build_mode "$next" ) >"$bg_log" 2>&1 &
    bg_pid=$!
    set +m
  fi
  test_mode "$mode"
  if [ -n "$next" ]; then
    rc=0
    wait "$bg_pid" || rc=$?
    bg_pid=""
    cat "$bg_log"
    if [ "$rc" -ne 0 ]; then
      echo "== tests/run.sh: the $next build failed (exit $rc; log above, in $bg_log)"
      exit "$rc"
    fi
  fi
done

#!/usr/bin/env bash
# The image flow of deploy/docker refuses test builds: build-rootfs.sh and test-rootfs.sh, given
# this build's kvmesh-node and kvmeshctl, stop before anything needs root or the network, with a
# message naming why (the simulated GPU's libkvmesh_cudasim.so, a sanitizer) and the build to
# use (deploy/docker/build-release.sh); build-rootfs.sh --check-only accepts a production build.
#
#   image_rootfs_test.sh KVMESH_NODE KVMESH_CTL SOURCE_DIR sim=ON|OFF sanitize=[address|thread]
#
# sim= and sanitize= are what CMake configured this build with (KVMESH_CUDA_SIM,
# KVMESH_SANITIZE): the test expects a refusal for a SIM or sanitizer build (every build of
# tests/run.sh) and acceptance otherwise. Then the detection itself, on binaries made here: one
# copied out of its build folder and stripped (as in an image, found by its NEEDED entries), an
# ELF under a CMakeCache.txt saying KVMESH_CUDA=SIM, KVMESH_SANITIZE=address or neither, a
# clang ASan binary, a file that is not ELF. A few seconds; no root, no network (ctest label
# deploy, tests/deploy/CMakeLists.txt). The production flow itself (build-release.sh, then
# test-rootfs.sh as root) is a separate command: deploy/docker/README.md.
set -euo pipefail

node=${1:?KVMESH_NODE}
ctl=${2:?KVMESH_CTL}
src=${3:?SOURCE_DIR}
sim=${4#sim=}
sanitize=${5-sanitize=}
sanitize=${sanitize#sanitize=}
build_rootfs="$src/deploy/docker/build-rootfs.sh"

work=$(mktemp -d /tmp/kvmesh-image-rootfs-test.XXXXXX)
chmod 755 "$work"
trap 'rm -rf "$work"' EXIT
failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }
pass() { echo "ok: $*"; }
show_log() { while IFS= read -r line; do echo "    | $line" >&2; done <<<"$log"; }

# run NAME CMD...: runs CMD, its stderr and stdout in $work/NAME.log, its status in $rc.
run() {
  local name=$1
  shift
  rc=0
  "$@" >"$work/$name.log" 2>&1 || rc=$?
  log=$(cat "$work/$name.log")
}
# expect_refused CASE BIN PATTERN...: the last run exited 1, refusing BIN, and its message holds
# every PATTERN (fixed strings) and names the production build to make.
expect_refused() {
  local what=$1 bin=$2 p ok=1
  shift 2
  if [ "$rc" -ne 1 ]; then
    fail "$what: exit status $rc, expected 1 (refused)"; ok=0
  fi
  for p in "REFUSED: $bin is a test build" "deploy/docker/build-release.sh" "$@"; do
    if ! grep -qF -- "$p" <<<"$log"; then
      fail "$what: the message lacks '$p'"; ok=0
    fi
  done
  if [ "$ok" = 1 ]; then pass "$what: refused"; else show_log; fi
}
expect_accepted() {
  local what=$1
  if [ "$rc" -eq 0 ] && grep -qF "are production builds" <<<"$log"; then
    pass "$what: accepted"
  else
    fail "$what: exit status $rc, expected 0 (accepted)"
    show_log
  fi
}

# ---- 1. this build's binaries ----------------------------------------------------------------
build_dir=$(cd "$(dirname "$node")/.." && pwd)
test_build=0
reasons=()
if [ "$sim" = ON ]; then
  test_build=1
  reasons+=("libkvmesh_cudasim.so" "configured with KVMESH_CUDA=SIM")
fi
if [ -n "$sanitize" ]; then
  test_build=1
  reasons+=("configured with KVMESH_SANITIZE=$sanitize")
fi

run check-only "$build_rootfs" --check-only --node "$node" --ctl "$ctl" --out "$work/out"
if [ "$test_build" = 1 ]; then
  expect_refused "build-rootfs.sh --check-only on $build_dir" "$node" "${reasons[@]}"
  # kvmeshctl is refused too, for its build folder at least.
  grep -qF "REFUSED: $ctl is a test build" <<<"$log" || fail "kvmeshctl of $build_dir was not refused"
else
  expect_accepted "build-rootfs.sh --check-only on $build_dir"
fi

# The documented commands themselves, as an unprivileged user: on a test build they must stop at
# the refusal, before "needs root" (and, as root, before debootstrap and the mirror).
as_user=()
if [ "$(id -u)" -eq 0 ]; then
  as_user=(setpriv --reuid=65534 --regid=65534 --clear-groups)
  if ! "${as_user[@]}" test -r "$build_rootfs" -a -x "$node"; then
    as_user=()
    echo "note: user 65534 cannot read $build_rootfs or $node: the unprivileged runs are skipped"
  fi
fi
if [ "$(id -u)" -ne 0 ] || [ "${#as_user[@]}" -gt 0 ]; then
  for script in build-rootfs test-rootfs; do
    path="$src/deploy/docker/$script.sh"
    run "$script" "${as_user[@]}" "$path" --node "$node" --ctl "$ctl" --out "$work/$script-out"
    if [ "$test_build" = 1 ]; then
      expect_refused "$script.sh on $build_dir" "$node" "${reasons[@]}"
    elif [ "$rc" -ne 0 ] && grep -qF "needs root" <<<"$log"; then
      pass "$script.sh on $build_dir: past the check, stops at needing root"
    else
      fail "$script.sh on $build_dir (unprivileged): status $rc: $log"
    fi
    [ ! -e "$work/$script-out" ] || fail "$script.sh created its output folder before refusing"
  done
fi

# ---- 2. the detection, on binaries made here ---------------------------------------------------
# This build's node outside any build folder, stripped as build-rootfs.sh packs it: only its
# NEEDED entries tell (what test-rootfs.sh --no-build sees in an image).
mkdir -p "$work/loose"
strip --strip-unneeded -o "$work/loose/kvmesh-node" "$node"
run loose "$build_rootfs" --check-only --node "$work/loose/kvmesh-node" --ctl "$work/loose/kvmesh-node"
if [ "$sim" = ON ]; then
  expect_refused "a stripped SIM kvmesh-node outside its build folder" "$work/loose/kvmesh-node" \
    "it needs libkvmesh_cudasim.so"
  grep -qF "configured with" <<<"$log" && fail "found a CMakeCache.txt for $work/loose"
elif [ -z "$sanitize" ]; then
  expect_accepted "a stripped production kvmesh-node outside its build folder"
fi

# Any ELF without test libraries (/bin/true's), in folders shaped as build folders.
elf=$(type -P true)
fake_build() {  # fake_build DIR CACHE-LINES...: DIR/CMakeCache.txt, DIR/service/kvmesh-node
  local dir=$1
  shift
  mkdir -p "$dir/service"
  printf '%s\n' "# This is the CMakeCache file." "$@" >"$dir/CMakeCache.txt"
  cp "$elf" "$dir/service/kvmesh-node"
}
fake_build "$work/sim" "KVMESH_CUDA:STRING=SIM" "KVMESH_SANITIZE:STRING="
run fake-sim "$build_rootfs" --check-only --node "$work/sim/service/kvmesh-node" --ctl "$elf"
expect_refused "an ELF in a KVMESH_CUDA=SIM build folder" "$work/sim/service/kvmesh-node" \
  "its build folder $work/sim is configured with KVMESH_CUDA=SIM"

fake_build "$work/asan" "KVMESH_CUDA:STRING=OFF" "KVMESH_SANITIZE:STRING=address"
run fake-asan "$build_rootfs" --check-only --node "$work/asan/service/kvmesh-node" --ctl "$elf"
expect_refused "an ELF in a KVMESH_SANITIZE=address build folder" "$work/asan/service/kvmesh-node" \
  "configured with KVMESH_SANITIZE=address"

for mode in OFF AUTO ON; do
  fake_build "$work/release-$mode" "CMAKE_BUILD_TYPE:STRING=Release" "KVMESH_CUDA:STRING=$mode" \
    "KVMESH_SANITIZE:STRING=" "KVMESH_FUZZ:BOOL=OFF"
  run "fake-$mode" "$build_rootfs" --check-only --node "$work/release-$mode/service/kvmesh-node" \
    --ctl "$elf"
  expect_accepted "an ELF in a KVMESH_CUDA=$mode Release build folder"
done

printf '#!/bin/sh\nexit 0\n' >"$work/script"
chmod 755 "$work/script"
run not-elf "$build_rootfs" --check-only --node "$work/script" --ctl "$elf"
expect_refused "a shell script as kvmesh-node" "$work/script" "it is not an ELF executable"

# clang links its sanitizer runtimes statically: the exported __asan_init tells.
if command -v clang >/dev/null 2>&1; then
  echo 'int main(void) { return 0; }' >"$work/main.c"
  clang -fsanitize=address -o "$work/asan-bin" "$work/main.c"
  run clang-asan "$build_rootfs" --check-only --node "$work/asan-bin" --ctl "$elf"
  expect_refused "a clang ASan binary outside any build folder" "$work/asan-bin" \
    "built with AddressSanitizer (__asan_init)"
else
  echo "note: no clang: the clang ASan case is skipped"
fi

if [ "$failures" -gt 0 ]; then
  echo "image_rootfs_test: $failures failure(s)" >&2
  exit 1
fi
echo "image_rootfs_test: PASS"

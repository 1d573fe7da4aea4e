#!/usr/bin/env bash
# Builds the two binaries an image holds, kvmesh-node and kvmeshctl, as the Dockerfiles' build
# stages do: Release, no tests, no benchmarks, in a build folder of its own, so that
# build-rootfs.sh never packs the simulated-GPU or sanitizer test builds of tests/run.sh.
#
#   deploy/docker/build-release.sh [--cuda] [--build-dir DIR] [-j N]
#
#   (default)        KVMESH_CUDA=OFF, the host image's build (Dockerfile), in build-release/
#   --cuda           KVMESH_CUDA=ON (nvcc required; the CUDA runtime linked statically, NCCL
#                    opened at run time), Dockerfile.cuda's build, in build-release-cuda/
#   --build-dir DIR  build there instead (a folder used for nothing else: the configure line
#                    below overrides its cache)
#   -j N, --jobs N   parallel compile jobs (default: nproc)
#
# Prints the binaries' paths as node=PATH and ctl=PATH, the arguments build-rootfs.sh takes:
#   deploy/docker/build-rootfs.sh --tar           (build-release/'s binaries are its default)
#   deploy/docker/build-rootfs.sh --node PATH --ctl PATH
# Needs the build dependencies of scripts/bootstrap.sh (Debian 12); no root, no network.
set -euo pipefail

root_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cuda=OFF
build_dir=""
jobs=$(nproc)

die() { echo "build-release: $*" >&2; exit 1; }
note() { echo "build-release: $*" >&2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --cuda) cuda=ON; shift ;;
    --build-dir) build_dir=$2; shift 2 ;;
    --build-dir=*) build_dir=${1#*=}; shift ;;
    -j|--jobs) jobs=$2; shift 2 ;;
    -j*) jobs=${1#-j}; shift ;;
    --jobs=*) jobs=${1#*=}; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
case "$jobs" in '' | *[!0-9]* | 0) die "-j needs a positive number of jobs, not '$jobs'" ;; esac
if [ -z "$build_dir" ]; then
  if [ "$cuda" = ON ]; then build_dir="$root_dir/build-release-cuda"; else build_dir="$root_dir/build-release"; fi
fi
mkdir -p "$build_dir"
build_dir=$(cd "$build_dir" && pwd)
[ "$build_dir" != "$root_dir" ] || die "--build-dir must not be the source tree"

# Every setting that makes a test build is named, so a folder configured otherwise before
# (say, a copy of build/) is turned into a production one, not packed as it was.
note "configuring ${build_dir#"$root_dir"/}: Release, KVMESH_CUDA=$cuda, no tests, no sanitizer"
cmake -S "$root_dir" -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DKVMESH_CUDA="$cuda" \
  -DKVMESH_SANITIZE= -DKVMESH_FUZZ=OFF -DKVMESH_BUILD_GRPC=ON \
  -DKVMESH_BUILD_TESTS=OFF -DKVMESH_BUILD_BENCH=OFF >"$build_dir/configure.log" 2>&1 ||
  { tail -30 "$build_dir/configure.log" >&2; die "cmake configure failed (log: $build_dir/configure.log)"; }
summary=$(grep -o 'kvmesh: gRPC=.*' "$build_dir/configure.log" | head -1)
note "$summary"
case "$summary" in
  *"(simulated: OFF)"*) ;;
  *) die "the configure summary does not say 'simulated: OFF': $summary" ;;
esac
# As Dockerfile.cuda's build stage: a CUDA node without the nccl transport is not the GPU image's.
if [ "$cuda" = ON ] && [[ "$summary" != *"CUDA=ON (simulated: OFF) NCCL=ON"* ]]; then
  die "--cuda needs nvcc and nccl.h ('CUDA=ON (simulated: OFF) NCCL=ON'), the summary says: $summary"
fi

note "building kvmesh_node kvmesh_ctl with -j$jobs"
cmake --build "$build_dir" --target kvmesh_node kvmesh_ctl -j"$jobs"

node="$build_dir/service/kvmesh-node"
ctl="$build_dir/service/kvmeshctl"
for b in "$node" "$ctl"; do
  [ -x "$b" ] || die "the build made no $b"
done
# The CUDA runtime is static and NCCL opened at run time: neither may be a link dependency.
if [ "$cuda" = ON ] && ldd "$node" | grep -E 'libcudart|libnccl' >&2; then
  die "$node links the CUDA runtime or NCCL dynamically (above); the image has neither"
fi
# The check build-rootfs.sh makes before packing: no simulated GPU, no sanitizer runtime.
"$root_dir/deploy/docker/build-rootfs.sh" --check-only --node "$node" --ctl "$ctl"
echo "node=$node"
echo "ctl=$ctl"

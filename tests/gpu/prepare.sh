#!/usr/bin/env bash
# Fills <repo>/.gpu-deps with what the GPU machine lacks to build kvmesh's engine, tests and
# gpu_bench (it has nvcc, cmake and ninja but no Debian packages, and nothing can be installed
# there). Run it HERE, on the Debian 12 build machine, before carrying .gpu-deps over:
#
#   tests/gpu/prepare.sh
#
# Result (gitignored, about 15 MiB, no symbolic links so it survives any copy):
#   .gpu-deps/googletest/                       Debian's /usr/src/googletest (built from source
#                                               there via -DKVMESH_GTEST_SOURCE_DIR)
#   .gpu-deps/absl/include/absl/                Debian's libabsl-dev headers
#   .gpu-deps/absl/lib/x86_64-linux-gnu/        libabsl_*.so* (links resolved to copies) and
#     cmake/absl/                               the CMake package: -Dabsl_DIR=<that folder>
#   .gpu-deps/xxhash/include/xxhash.h           Debian's libxxhash-dev header (used header-only)
#   .gpu-deps/nccl/include/nccl.h               this machine's NCCL header, for a GPU machine
#                                               whose NCCL (a Python wheel's) comes without one;
#                                               the library itself is the GPU machine's own
#   .gpu-deps/MANIFEST                          package versions and the glibc they need
#
# The Abseil package config computes every path from its own location (_IMPORT_PREFIX is four
# levels up from cmake/absl), so the copied prefix works wherever it lands; this script checks
# that no absolute /usr path slipped into the targets. Idempotent: rebuilds .gpu-deps from
# scratch each time. Then run tests/gpu/run.sh on the GPU machine (its header says how).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
dest=$root/.gpu-deps
multiarch=x86_64-linux-gnu
sys_lib=/usr/lib/$multiarch

die() { echo "prepare.sh: $*" >&2; exit 1; }

[ "$(uname -m)" = x86_64 ] || die "the GPU machine is x86-64; run this on an x86-64 Debian host"

# googletest (sources) and libabsl-dev come from scripts/bootstrap.sh's package list.
if [ ! -f /usr/src/googletest/CMakeLists.txt ] || [ ! -f "$sys_lib/cmake/absl/abslConfig.cmake" ]; then
  "$root/scripts/bootstrap.sh"
fi
[ -f /usr/src/googletest/CMakeLists.txt ] || die "/usr/src/googletest missing (apt-get install googletest)"
[ -f "$sys_lib/cmake/absl/abslConfig.cmake" ] || die "Abseil CMake package missing (apt-get install libabsl-dev)"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvmesh-gpu-deps.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
chmod 755 "$tmp"

# -L: copy what links point to, so that nothing depends on how links travel.
cp -rL /usr/src/googletest "$tmp/googletest"

mkdir -p "$tmp/absl/include" "$tmp/absl/lib/$multiarch/cmake"
cp -rL /usr/include/absl "$tmp/absl/include/absl"
cp -L "$sys_lib"/libabsl_*.so* "$tmp/absl/lib/$multiarch/"
cp -rL "$sys_lib/cmake/absl" "$tmp/absl/lib/$multiarch/cmake/absl"

# xxHash is used header-only (XXH_INLINE_ALL, cache/token_chain.cc): its header is all it needs.
[ -f /usr/include/xxhash.h ] || "$root/scripts/bootstrap.sh"
mkdir -p "$tmp/xxhash/include"
cp -L /usr/include/xxhash.h "$tmp/xxhash/include/xxhash.h"

# NCCL's header only (tests/gpu/run.sh says why the library is not carried).
nccl_header=/usr/local/cuda/include/nccl.h
if [ -f "$nccl_header" ]; then
  mkdir -p "$tmp/nccl/include"
  cp -L "$nccl_header" "$tmp/nccl/include/nccl.h"
fi

# Every path in the package must derive from its location, except the "/usr move" check that
# compares against the original install folder (false once copied).
if grep -n '"/usr' "$tmp/absl/lib/$multiarch/cmake/absl/"*.cmake | grep -v -e '_realOrig' -e ':#' \
    | grep -v 'set(_IMPORT_PREFIX "/usr/lib/' | grep -v 'set(PACKAGE_PREFIX_DIR "/usr")'; then
  die "the Abseil CMake package above names absolute /usr paths; it would not relocate"
fi
missing=0
# shellcheck disable=SC2016  # ${_IMPORT_PREFIX} is CMake's, matched literally
while read -r lib; do
  [ -f "$tmp/absl/lib/$multiarch/$(basename "$lib")" ] || { echo "missing: $lib" >&2; missing=1; }
done < <(grep -ho '${_IMPORT_PREFIX}/lib/[^"]*' "$tmp/absl/lib/$multiarch/cmake/absl/"abslTargets-*.cmake |
         sed 's|${_IMPORT_PREFIX}/lib/||' | sort -u)
[ "$missing" = 0 ] || die "libraries named by abslTargets-*.cmake were not copied"

# What the copied libraries need from the C and C++ runtimes of the GPU machine.
needs=$(for f in "$tmp/absl/lib/$multiarch"/libabsl_*.so.*.*.*; do
          objdump -T "$f" 2>/dev/null | grep -oE '(GLIBC|GLIBCXX|CXXABI)_[0-9.]+'
        done | sort -u -V | awk -F_ '{v[$1]=$0} END {for (k in v) print v[k]}' | sort | tr '\n' ' ')
{
  echo "made by tests/gpu/prepare.sh on $(hostname) at $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  # shellcheck disable=SC1091
  echo "build host: $(. /etc/os-release && echo "$PRETTY_NAME"), $(ldd --version | head -1)"
  dpkg-query -W -f='${Package} ${Version}\n' googletest libabsl-dev libxxhash-dev 2>/dev/null || true
  echo "libabsl_*.so need at least: $needs"
  if [ -f "$tmp/nccl/include/nccl.h" ]; then
    echo "nccl.h: NCCL_VERSION_CODE $(grep -m1 -E '^#define NCCL_VERSION_CODE' \
      "$tmp/nccl/include/nccl.h" | awk '{print $3}')"
  fi
} >"$tmp/MANIFEST"

rm -rf "$dest"
mv "$tmp" "$dest"
trap - EXIT

if [ -n "$(find "$dest" -type l)" ]; then die "symbolic links left in $dest"; fi
size=$(du -sm "$dest" | cut -f1)
cat "$dest/MANIFEST"
echo "prepare.sh: $dest is $(du -sh "$dest" | cut -f1) (carry limit 64 MiB with the working tree)"
[ "$size" -lt 48 ] || die "$dest is ${size} MiB, too close to the 64 MiB carry limit"

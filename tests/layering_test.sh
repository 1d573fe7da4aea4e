#!/usr/bin/env bash
# Checks that the project's includes follow its layering (README "Layout"):
#
#   cache/            the engine: no gRPC, no generated proto code, nothing above it; below
#                     the Cache, nothing includes its façade cache/cache.h (cache/types.h)
#   transport/        cache/ and the generated proto code; never service/
#   service/common/   cache/ and the proto code; never the node, cluster/, ctl/ or transport/
#   service/cluster/  cache/, transport/, service/common/; never the node nor ctl/
#   service/ctl/      cache/, service/common/; never the node, cluster/ or transport/
#   service/*         the node: anything above, but never ctl/
#
# and that production folders include nothing from tests/ but the sanitizer support
# (tests/sanitizers/tsan_handoff.h, in the reactor code of transport/ and the node). The link
# dependencies in the folders' CMakeLists.txt are held to the same rules. Prints every offending
# include or link with its file and line and exits 1 when there is one.
#
#   tests/layering_test.sh [ROOT]                ROOT: the repository (default: this
#                                                script's parent)
#   tests/layering_test.sh --self-test [ROOT]    each kind of violation, planted, must fail
set -euo pipefail

self=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")

# --self-test: plants one violation of each kind in a copy of the three folders and checks that
# each makes this script fail, so that it cannot pass by checking nothing.
if [ "${1:-}" = --self-test ]; then
  root=${2:-$(cd "$(dirname "$self")/.." && pwd)}
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  cases=(
    'cache/cache.h|#include <grpcpp/grpcpp.h>'
    'cache/cache.cc|#include "service/common/convert.h"'
    'cache/layer_group.h|#include "cache/cache.h"'
    'cache/device/host_device.cc|  # include <cache/cache.h>'
    'transport/transport.h|#include "service/cluster/cluster.h"'
    'service/common/convert.h|#include "transport/transport.h"'
    'service/cluster/leases.h|  #  include "service/cache_service.h"'
    'service/cluster/planted.cuh|#include "service/executor.h"'
    'service/ctl/parse.h|#include <service/peer_service.h>'
    'service/ctl/parse.cc|#include "../cluster/cluster.h"'
    'service/ctl/main.cc|#include "service/cluster/membership.h"'
    'service/peer_service.cc|#include "tests/testing/pattern.h"'
    'service/node_main.cc|#include "service/ctl/args.h"'
    'service/ctl/CMakeLists.txt|target_link_libraries(kvmesh_ctl PRIVATE kvmesh::cluster)'
    'service/cluster/CMakeLists.txt|target_link_libraries(kvmesh_cluster PRIVATE kvmesh::service)'
    'cache/CMakeLists.txt|target_link_libraries(kvmesh_cache PUBLIC gRPC::grpc++)'
  )
  failed=0
  for c in "${cases[@]}"; do
    file=${c%%|*}
    rm -rf "$work/tree" && mkdir -p "$work/tree"
    cp -r "$root/cache" "$root/transport" "$root/service" "$work/tree/"
    mkdir -p "$work/tree/tests/sanitizers"
    printf '%s\n' "${c#*|}" >>"$work/tree/$file"
    if bash "$self" "$work/tree" >"$work/out" 2>&1; then
      echo "self-test: a planted violation passed: ${c#*|} in $file"
      failed=1
    fi
  done
  if ! bash "$self" "$root" >"$work/out" 2>&1; then
    echo "self-test: the tree itself fails:"; cat "$work/out"; failed=1
  fi
  [ "$failed" -eq 0 ] &&
    echo "layering_test --self-test: all ${#cases[@]} planted violations caught"
  exit "$failed"
fi

root=${1:-$(cd "$(dirname "$self")/.." && pwd)}
cd "$root"
violations=0

# check DIR DEPTH PATTERN WHY: every include in the C/C++/CUDA files of DIR (DEPTH 1: DIR's
# own files only; 0: the whole subtree), quoted or in angle brackets, whose path matches the
# extended regular expression PATTERN is a violation.
check() {
  local dir=$1 depth=$2 pattern=$3 why=$4
  local find_args=("$dir")
  [ "$depth" = 1 ] && find_args+=(-maxdepth 1)
  local files hits rc=0
  mapfile -d '' files < <(find "${find_args[@]}" -type f \( -name '*.h' -o -name '*.hh' \
    -o -name '*.hpp' -o -name '*.inc' -o -name '*.c' -o -name '*.cc' -o -name '*.cpp' \
    -o -name '*.cu' -o -name '*.cuh' \) -print0 | sort -z)
  [ "${#files[@]}" -gt 0 ] || return 0
  hits=$(grep -HnE "^[[:space:]]*#[[:space:]]*include[[:space:]]*[\"<](${pattern})" \
           "${files[@]}") || rc=$?
  if [ "$rc" -gt 1 ]; then  # grep: 1 is "no match", more is an error
    echo "layering_test: grep failed ($rc) in $dir"
    exit 1
  fi
  if [ -n "$hits" ]; then
    echo "$why:"
    sed 's/^/  /' <<<"$hits"
    violations=$((violations + $(wc -l <<<"$hits")))
  fi
}

# check_links CMAKELISTS PATTERN WHY: a target named in CMAKELISTS that matches PATTERN (the
# link dependencies of that folder's targets) is a violation.
check_links() {
  local file=$1 pattern=$2 why=$3 hits
  hits=$(grep -HnE "(^|[[:space:]])(${pattern})([[:space:])]|$)" "$file" | grep -v ':[0-9]*:#') ||
    true
  if [ -n "$hits" ]; then
    echo "$why:"
    sed 's/^/  /' <<<"$hits"
    violations=$((violations + $(wc -l <<<"$hits")))
  fi
}

# Every folder the rules speak of must exist, so that a rename cannot make this test pass
# by checking nothing.
for dir in cache transport service service/common service/cluster service/ctl tests/sanitizers; do
  if [ ! -d "$dir" ]; then
    echo "layering_test: $root/$dir does not exist: update the rules in $0"
    exit 1
  fi
done

# Includes name paths from the repository root; a relative one could reach any layer.
for dir in cache transport service; do
  check "$dir" 0 '\.\./|\./' "$dir/ includes by a relative path (name it from the repository root)"
done
check cache 0 'service/|transport/|kvmesh/v1/|grpc|tests/' \
  'cache/ (the engine) includes gRPC, proto code or a layer above it'
# Below the Cache: the layer groups, the snapshot wire format, the devices, the token index and
# the vocabulary (cache/types.h) never include the façade, cache/cache.h. Only the Cache's own
# files (cache.cc and its parts, cache_*.cc) and the registry that owns caches
# (cache_registry.*) do.
below_cache=()
while IFS= read -r -d '' f; do
  case "${f##*/}" in
    cache.h | cache.cc | cache_*.cc | cache_registry.h) ;;
    *) below_cache+=("$f") ;;
  esac
done < <(find cache -type f \( -name '*.h' -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh' \) \
           -print0 | sort -z)
if [ "${#below_cache[@]}" -gt 0 ]; then
  hits=$(grep -HnE '^[[:space:]]*#[[:space:]]*include[[:space:]]*["<]cache/cache\.h[">]' \
           "${below_cache[@]}") || true
  if [ -n "$hits" ]; then
    echo "a file below the Cache includes its façade, cache/cache.h (take cache/types.h):"
    sed 's/^/  /' <<<"$hits"
    violations=$((violations + $(wc -l <<<"$hits")))
  fi
fi
check transport 0 'service/|tests/(testing|unit|integration|bench|gpu)/' \
  'transport/ includes service/ or test code'
check service/common 0 'service/[a-z_]+\.h|service/(cluster|ctl)/|transport/|tests/' \
  'service/common/ includes the node, cluster/, ctl/, transport/ or test code'
check service/cluster 0 'service/[a-z_]+\.h|service/ctl/|tests/' \
  'service/cluster/ includes the node (CacheServiceImpl, PeerServiceImpl, executor) or ctl/'
check service/ctl 0 'service/[a-z_]+\.h|service/cluster/|transport/|tests/' \
  'service/ctl/ (kvmeshctl) includes the node, cluster/ or transport/'
check service 1 'service/ctl/|tests/(testing|unit|integration|bench|gpu)/' \
  'the node (service/) includes ctl/ or test code'

# The same rules for the targets the folders link.
check_links service/common/CMakeLists.txt \
  'kvmesh::(service|cluster|ctl_support|transport)|kvmesh_(service|cluster|ctl_support|transport)' \
  'service/common/ links the node, cluster/, ctl/ or transport/'
check_links service/cluster/CMakeLists.txt \
  'kvmesh::(service|ctl_support)|kvmesh_(service|ctl_support)' \
  'service/cluster/ links the node or ctl/'
check_links service/ctl/CMakeLists.txt \
  'kvmesh::(service|cluster|transport)|kvmesh_(service|cluster|transport|node)' \
  'service/ctl/ links the node, cluster/ or transport/'
check_links cache/CMakeLists.txt \
  'kvmesh::(service[a-z_]*|cluster|ctl_support|transport|proto)|gRPC::[a-z+_]*' \
  'cache/ links gRPC, proto code or a layer above it'

if [ "$violations" -ne 0 ]; then
  echo "layering_test: $violations include(s) break the layering"
  exit 1
fi
echo "layering_test: the includes and links of cache/, transport/ and service/ follow the layering"

#!/usr/bin/env bash
# Checks that the project's includes follow its layering (README "Layout"):
#
#   cache/            the engine: no gRPC, no generated proto code, nothing above it
#   transport/        cache/ and the generated proto code; never service/
#   service/common/   cache/ and the proto code; never the node, cluster/, ctl/ or transport/
#   service/cluster/  cache/, transport/, service/common/; never the node nor ctl/
#   service/ctl/      cache/, service/common/; never the node, cluster/ or transport/
#   service/*         the node: anything above, but never ctl/
#
# and that production folders include nothing from tests/ but the sanitizer support
# (tests/sanitizers/tsan_handoff.h, in the reactor code of transport/ and the node). Prints every offending include with its file
# and line and exits 1 when there is one.
#
#   tests/layering_test.sh [ROOT]     ROOT: the repository (default: this script's parent)
set -euo pipefail

root=${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
cd "$root"
violations=0

# check DIR DEPTH PATTERN WHY: every quoted include in the C/C++/CUDA files of DIR (DEPTH 1:
# DIR's own files only; 0: the whole subtree) that matches the extended regular expression
# PATTERN is a violation.
check() {
  local dir=$1 depth=$2 pattern=$3 why=$4
  local find_args=("$dir")
  [ "$depth" = 1 ] && find_args+=(-maxdepth 1)
  local hits
  hits=$(find "${find_args[@]}" -type f \( -name '*.h' -o -name '*.cc' -o -name '*.cu' \) \
           -print0 | sort -z |
         xargs -0 grep -nE "^[[:space:]]*#[[:space:]]*include[[:space:]]*\"(${pattern})" || true)
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

check cache 0 'service/|transport/|kvmesh/v1/|grpc|tests/' \
  'cache/ (the engine) includes gRPC, proto code or a layer above it'
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
if [ "$violations" -ne 0 ]; then
  echo "layering_test: $violations include(s) break the layering"
  exit 1
fi
echo "layering_test: the includes of cache/, transport/ and service/ follow the layering"

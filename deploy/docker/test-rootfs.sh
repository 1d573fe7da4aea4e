#!/usr/bin/env bash
# Tests the runtime image that deploy/docker/build-rootfs.sh makes, without a container daemon:
# unpacks the OCI image (not the rootfs folder: the layer is what ships), checks with `ldd`
# inside it that every library of kvmesh-node and kvmeshctl is there, then starts kvmesh-node
# from it as the image's user (uid 65532, chroot in private mount and PID namespaces, the tree
# mounted read-only) on 127.0.0.1 with a free port, and with the image's own kvmeshctl: health,
# create a small cache, append, read it back with --verify-seed. Then stops the node with SIGTERM
# and expects exit 0.
#
#   deploy/docker/test-rootfs.sh [--out DIR] [--no-build] [build-rootfs.sh flags...]
#
#   --out DIR     build-rootfs.sh's output folder (default build-image/)
#   --no-build    test what DIR holds; default: run build-rootfs.sh first (fast when cached)
#                 with the other flags, so by default on build-release/'s binaries
#                 (deploy/docker/build-release.sh)
#
# Test builds are refused, before anything else when it builds the image, and in the unpacked
# image with --no-build: KVMESH_CUDA=SIM (every build of tests/run.sh), sanitizer and fuzzing
# builds (build-rootfs.sh --check-only). The whole flow is build-release.sh, then this script,
# a separate command rather than a ctest test: it needs root (chroot, namespaces), the Debian
# mirror (debootstrap, on a cold cache) and a minute, and writes outside the build tree. Run it
# when the image, the runtime package list or the binaries' libraries change
# (deploy/docker/README.md); tests/deploy/image_rootfs_test.sh runs the refusal in ctest.
set -euo pipefail

root_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
here="$root_dir/deploy/docker"
out="$root_dir/build-image"
build=1
build_args=()
uid=65532

# in_root from build-rootfs.sh.
# shellcheck source=build-rootfs.sh source-path=SCRIPTDIR
KVMESH_BUILD_ROOTFS_LIB=1 . "$here/build-rootfs.sh"
die() { echo "test-rootfs: FAIL: $*" >&2; exit 1; }
note() { echo "test-rootfs: $*" >&2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; build_args+=(--out "$2"); shift 2 ;;
    --out=*) out=${1#*=}; build_args+=("$1"); shift ;;
    --no-build) build=0; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) build_args+=("$1"); shift ;;
  esac
done
if [ "$build" = 1 ]; then
  # The binaries build-rootfs.sh would pack (its defaults or --node/--ctl), checked before root
  # is needed or anything is downloaded.
  "$here/build-rootfs.sh" --check-only "${build_args[@]}" || exit 1
fi
[ "$(id -u)" -eq 0 ] || die "needs root (chroot, mount and PID namespaces)"

if [ "$build" = 1 ]; then
  "$here/build-rootfs.sh" "${build_args[@]}" >/dev/null
fi
out=$(cd "$out" && pwd)
[ -f "$out/oci/index.json" ] || die "no OCI layout in $out/oci (run deploy/docker/build-rootfs.sh)"
tag=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"])' "$out/oci/index.json")


work=$(mktemp -d /tmp/kvmesh-image-test.XXXXXX)
node_pid=""
ns_pid=""
cleanup() {
  if [ -n "$node_pid" ] && kill -0 "$node_pid" 2>/dev/null; then kill -KILL "$node_pid" || true; fi
  if [ -n "$ns_pid" ]; then wait "$ns_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

# ---- 1. the image as a runtime sees it: unpack the OCI layout --------------------------------
note "unpacking ${out#"$root_dir"/}/oci:$tag"
umoci unpack --image "$out/oci:$tag" "$work/bundle" >/dev/null
rootfs="$work/bundle/rootfs"
config=$(python3 -c '
import json, sys
c = json.load(open(sys.argv[1]))
p = c["process"]
print(" ".join(p["args"]), "|", "%d:%d" % (p["user"]["uid"], p["user"]["gid"]))' "$work/bundle/config.json")
[ "$config" = "/usr/local/bin/kvmesh-node | $uid:$uid" ] ||
  die "the image's process is '$config', expected '/usr/local/bin/kvmesh-node | $uid:$uid'"
grep -q "^kvmesh:x:$uid:$uid:" "$rootfs/etc/passwd" || die "no user $uid in the image's /etc/passwd"
# What the image holds, however it was packed (--no-build tests an image made earlier).
refuse_test_builds test-rootfs "$rootfs/usr/local/bin/kvmesh-node" "$rootfs/usr/local/bin/kvmeshctl"

# ---- 2. every library there ----------------------------------------------------------------
ldd_out=$(in_root "$rootfs" /usr/bin/ldd /usr/local/bin/kvmesh-node /usr/local/bin/kvmeshctl 2>&1) ||
  die "ldd failed in the image: $ldd_out"
if grep -q "not found" <<<"$ldd_out"; then
  grep "not found" <<<"$ldd_out" >&2
  die "libraries missing from the image (add their packages to deploy/docker/runtime-packages.txt)"
fi
note "ldd: $(grep -c '=>' <<<"$ldd_out") libraries resolved in the image, none missing"

# ---- 3. the node, as the image's user ----------------------------------------------------------
mkdir -p "$work/tmp"; chmod 1777 "$work/tmp"
export KVMESH_BIND_TMP="$work/tmp"
# --undefok: binaries from before --drain_timeout_ms accept the flag too. The tree read-only, as
# deploy/k8s runs it (readOnlyRootFilesystem): the node must not need to write to it.
KVMESH_RO_ROOT=1 in_root "$rootfs" --userspec=$uid:$uid /usr/local/bin/kvmesh-node \
  --listen=127.0.0.1:0 --port_file=/tmp/port --node_name=image-test \
  --memory_budget=64MiB --snapshot_budget=16MiB \
  --undefok=drain_timeout_ms --drain_timeout_ms=0 >"$work/node.log" 2>&1 &
ns_pid=$!
deadline=$((SECONDS + 30))
while [ ! -s "$work/tmp/port" ]; do
  kill -0 "$ns_pid" 2>/dev/null || { cat "$work/node.log" >&2; die "kvmesh-node exited at start-up"; }
  [ "$SECONDS" -lt "$deadline" ] || { cat "$work/node.log" >&2; die "no port file after 30 s"; }
  sleep 0.1
done
port=$(cat "$work/tmp/port")
# The node's host PID, to signal: $ns_pid is the subshell running in_root, whose descendants
# are unshare, then the node (the namespace's PID 1: the inner sh exec'd chroot, which exec'd it).
node_pid=$ns_pid
for _ in 1 2 3 4; do
  [ "$(readlink "/proc/$node_pid/exe" 2>/dev/null)" = "$rootfs/usr/local/bin/kvmesh-node" ] && break
  node_pid=$(ps -o pid= --ppid "$node_pid" | tr -d ' ' | head -1)
  [ -n "$node_pid" ] || break
done
[ "$(readlink "/proc/$node_pid/exe" 2>/dev/null)" = "$rootfs/usr/local/bin/kvmesh-node" ] ||
  die "cannot find kvmesh-node's PID under $ns_pid"
node_user=$(ps -o uid= -p "$node_pid" | tr -d ' ')
[ "$node_user" = "$uid" ] || die "kvmesh-node runs as uid $node_user, not $uid"
root_options=$(awk '$5 == "/" { print $6 }' "/proc/$node_pid/mountinfo" | tail -1)
case ",$root_options," in *,ro,*) ;; *) die "the node's / is mounted '$root_options', not read-only" ;; esac
note "kvmesh-node up on 127.0.0.1:$port as uid $node_user, / read-only (host PID $node_pid)"

# ---- 4. calls with the image's kvmeshctl -------------------------------------------------------
ctl() {
  in_root "$rootfs" --userspec=$uid:$uid /usr/local/bin/kvmeshctl --addr="127.0.0.1:$port" \
    --timeout=10s "$@"
}
step() {
  local out
  out=$(ctl "$@" 2>&1) || { echo "$out" >&2; cat "$work/node.log" >&2; die "kvmeshctl $*"; }
  printf '$ kvmeshctl %s\n%s\n' "$*" "$out"
  last=$out
}
step health
grep -q SERVING <<<"$last" || die "health: expected SERVING, got: $last"
step create --name=img --dtype=f16 --max-sequences=2 --capacity=64 --max-batch=16 \
  --group=attention:layers=2,heads=2,head_dim=16,window=full,rope=none
step append --cache=img --seq=0 --positions=0:32 --seed=7
step read --cache=img --seq=0 --verify-seed=7
step usage --cache=img

# ---- 5. stop ----------------------------------------------------------------------------------
kill -TERM "$node_pid"
rc=0
wait "$ns_pid" || rc=$?
ns_pid=""
[ "$rc" -eq 0 ] || { cat "$work/node.log" >&2; die "kvmesh-node exited with status $rc after SIGTERM"; }
note "kvmesh-node stopped on SIGTERM (exit 0)"
note "PASS"

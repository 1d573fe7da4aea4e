#!/usr/bin/env bash
# Builds the kvmesh-node runtime image without a container daemon: the filesystem of the
# Dockerfile's runtime stage (Debian 12 minbase + deploy/docker/runtime-packages.txt + the user
# 65532 + the two binaries) with debootstrap, then an OCI image layout of it with umoci.
#
#   deploy/docker/build-rootfs.sh [--out DIR] [--node BIN] [--ctl BIN] [--tag TAG] [--no-strip]
#                                 [--tar] [--refresh] [--check-only]
#
#   --out DIR    where everything goes (default build-image/, git-ignored):
#                  DIR/rootfs/       the image's filesystem
#                  DIR/oci/          OCI image layout, tag TAG (default: kvmesh-node:dev)
#                  DIR/kvmesh-node-oci.tar  the layout as one tar (an oci-archive), with --tar
#                  DIR/cache/        debootstrap and package-install results reused by later runs
#   --node BIN   the kvmesh-node to put in /usr/local/bin (default
#                build-release/service/kvmesh-node, which deploy/docker/build-release.sh builds)
#   --ctl BIN    the kvmeshctl to put beside it (default build-release/service/kvmeshctl)
#                Build them on Debian 12 (this host): the image's libraries are bookworm's, the
#                same ones the binaries were linked against. Test builds are refused before
#                anything else happens: KVMESH_CUDA=SIM (tests/run.sh's builds, which need the
#                simulated GPU's libkvmesh_cudasim.so), sanitizer and fuzzing builds.
#   --check-only only that refusal: exits 0 when both binaries may go into an image (no root)
#   --no-strip   copy the binaries as they are (default: strip --strip-unneeded, as the
#                Dockerfile's Release build has no debug info either)
#   --refresh    drop the cache (take the mirror's current packages and security updates)
#
# Needs root (debootstrap, chroot, mount namespaces) and the Debian mirror that apt uses here
# (read from /etc/apt/sources.list*; nothing else is contacted). Installs debootstrap and umoci
# with apt when missing. A second run reuses DIR/cache and only copies the binaries and packs.
set -euo pipefail

root_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
here="$root_dir/deploy/docker"
out="$root_dir/build-image"
node_bin="$root_dir/build-release/service/kvmesh-node"
ctl_bin="$root_dir/build-release/service/kvmeshctl"
tag="dev"
strip=1
tarball=0
refresh=0
check_only=0
suite=bookworm
uid=65532

die() { echo "build-rootfs: $*" >&2; exit 1; }
note() { echo "build-rootfs: $*" >&2; }

# ---- running commands in the tree ------------------------------------------------------------
# in_root ROOT [--userspec=U:G] CMD...: runs CMD chrooted in ROOT, in private mount and PID
# namespaces with /proc, a minimal /dev and /dev/shm mounted, so nothing leaks onto the host
# tree and the tree keeps empty /proc and /dev. $KVMESH_BIND_TMP, when set, is a host folder
# mounted on ROOT/tmp (how the test reads the node's port file); $KVMESH_RO_ROOT=1 mounts ROOT
# read-only (as Kubernetes' readOnlyRootFilesystem).
in_root() {
  local r=$1; shift
  # shellcheck disable=SC2016  # expanded by the inner shell
  unshare --mount --pid --fork --kill-child --propagation private -- /bin/sh -c '
    set -e
    r=$1; shift
    if [ "${KVMESH_RO_ROOT:-0}" = 1 ]; then
      mount --bind "$r" "$r"; mount -o remount,bind,ro "$r"
    fi
    mount -t proc proc "$r/proc"
    mount -t tmpfs -o mode=0755,nosuid tmpfs "$r/dev"
    for d in null zero full random urandom tty; do
      touch "$r/dev/$d"; mount --bind "/dev/$d" "$r/dev/$d"
    done
    mkdir "$r/dev/shm" "$r/dev/pts"
    mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$r/dev/shm"
    ln -s /proc/self/fd "$r/dev/fd"
    ln -s /proc/self/fd/0 "$r/dev/stdin"; ln -s /proc/self/fd/1 "$r/dev/stdout"
    ln -s /proc/self/fd/2 "$r/dev/stderr"
    if [ -n "${KVMESH_BIND_TMP:-}" ]; then mount --bind "$KVMESH_BIND_TMP" "$r/tmp"; fi
    case "${1:-}" in
      --userspec=*) u=$1; shift; exec chroot "$u" "$r" "$@" ;;
    esac
    exec chroot "$r" "$@"' in_root "$r" "$@"
}

# ---- which builds may go into an image ---------------------------------------------------------
# test_build_reasons BIN: prints, one a line, why BIN is a test build that no image may hold;
# prints nothing for a production build. Two sources, so that a binary copied out of its build
# folder (or already in an image, stripped) is recognised too:
# - the binary itself: a test-tree library among its NEEDED entries (libkvmesh_cudasim.so, the
#   simulated CUDA runtime of KVMESH_CUDA=SIM), or a sanitizer runtime (gcc links libasan,
#   libtsan; clang links its runtime statically and exports __asan_init / __tsan_init);
# - the CMakeCache.txt of the build folder BIN sits in, when there is one: KVMESH_CUDA=SIM,
#   KVMESH_SANITIZE, KVMESH_FUZZ.
test_build_reasons() {
  local bin=$1 dynamic symbols lib dir cache value
  if ! dynamic=$(LC_ALL=C readelf -d -W "$bin" 2>&1); then
    echo "it is not an ELF executable (readelf: ${dynamic##*$'\n'})"
    return 0
  fi
  while read -r lib; do
    case "$lib" in
      libkvmesh_cudasim*) echo "it needs $lib, the simulated GPU of a KVMESH_CUDA=SIM test build" ;;
      libkvmesh_*) echo "it needs $lib, a library of kvmesh's test tree" ;;
      libasan* | libtsan* | libubsan* | liblsan*) echo "it needs $lib, a sanitizer's runtime" ;;
    esac
  done < <(sed -n 's/.*(NEEDED).*\[\(.*\)\]$/\1/p' <<<"$dynamic")
  symbols=$(LC_ALL=C readelf --dyn-syms -W "$bin" 2>/dev/null | awk '{ print $NF }')
  if grep -qx '__asan_init' <<<"$symbols"; then echo "it is built with AddressSanitizer (__asan_init)"; fi
  if grep -qx '__tsan_init' <<<"$symbols"; then echo "it is built with ThreadSanitizer (__tsan_init)"; fi
  dir=$(dirname "$bin")
  for _ in 1 2 3 4; do
    if [ -f "$dir/CMakeCache.txt" ]; then
      cache="$dir/CMakeCache.txt"
      value=$(sed -n 's/^KVMESH_CUDA:[A-Z]*=//p' "$cache")
      if [ "$value" = SIM ]; then echo "its build folder $dir is configured with KVMESH_CUDA=SIM"; fi
      value=$(sed -n 's/^KVMESH_SANITIZE:[A-Z]*=//p' "$cache")
      if [ -n "$value" ]; then echo "its build folder $dir is configured with KVMESH_SANITIZE=$value"; fi
      value=$(sed -n 's/^KVMESH_FUZZ:[A-Z]*=//p' "$cache")
      case "$value" in ON | TRUE | 1 | YES) echo "its build folder $dir is configured with KVMESH_FUZZ=$value" ;; esac
      break
    fi
    [ "$dir" != / ] || break
    dir=$(dirname "$dir")
  done
  return 0
}

# refuse_test_builds WHO BIN...: when any BIN is a test build, exits 1 with each reason and the
# build to use instead.
refuse_test_builds() {
  local who=$1 bin reasons line refused=0
  shift
  for bin in "$@"; do
    reasons=$(test_build_reasons "$bin")
    [ -n "$reasons" ] || continue
    refused=1
    echo "$who: REFUSED: $bin is a test build, which no image may contain:" >&2
    while read -r line; do echo "  - $line" >&2; done <<<"$reasons"
  done
  [ "$refused" = 1 ] || return 0
  cat >&2 <<EOF
$who: an image holds a production build. Make one with
    deploy/docker/build-release.sh      # Release, KVMESH_CUDA=OFF, in build-release/
whose build-release/service/kvmesh-node and kvmeshctl build-rootfs.sh and test-rootfs.sh pack
by default (--node/--ctl take those of another Release build with KVMESH_CUDA=OFF, AUTO or ON
and no sanitizer). The builds of tests/run.sh (build/, build-asan/, build-tsan/) are
KVMESH_CUDA=SIM test builds.
EOF
  exit 1
}

# test-rootfs.sh sources this file for in_root and the checks above only.
if [ "${KVMESH_BUILD_ROOTFS_LIB:-0}" = 1 ]; then return 0; fi

while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --out=*) out=${1#*=}; shift ;;
    --node) node_bin=$2; shift 2 ;;
    --node=*) node_bin=${1#*=}; shift ;;
    --ctl) ctl_bin=$2; shift 2 ;;
    --ctl=*) ctl_bin=${1#*=}; shift ;;
    --tag) tag=$2; shift 2 ;;
    --tag=*) tag=${1#*=}; shift ;;
    --no-strip) strip=0; shift ;;
    --tar) tarball=1; shift ;;
    --refresh) refresh=1; shift ;;
    --check-only) check_only=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done

[ -x "$node_bin" ] || die "no kvmesh-node at $node_bin (build it: deploy/docker/build-release.sh, or --node BIN)"
[ -x "$ctl_bin" ] || die "no kvmeshctl at $ctl_bin (build it: deploy/docker/build-release.sh, or --ctl BIN)"
# Before anything is downloaded or needs root: a test build never gets packed.
refuse_test_builds build-rootfs "$node_bin" "$ctl_bin"
if [ "$check_only" = 1 ]; then
  note "--check-only: $node_bin and $ctl_bin are production builds"
  exit 0
fi
[ "$(id -u)" -eq 0 ] || die "needs root (debootstrap, chroot, mount namespaces)"
mkdir -p "$out"
out=$(cd "$out" && pwd)

# ---- tools, installed when missing (as scripts/bootstrap.sh does) -----------------------------
tools=(debootstrap umoci debian-archive-keyring binutils)
missing=()
for p in "${tools[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  note "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# ---- the mirror: the Debian sources apt is configured with here --------------------------------
# Prints "URI SUITE" for every enabled deb source with the main component, from the deb822
# (*.sources) and one-line (sources.list, *.list) files.
apt_sources() {
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] && { cat "$f"; echo; }
  done | awk 'BEGIN { RS = ""; FS = "\n" }
    { types = uris = suites = comps = ""; enabled = "yes"
      for (i = 1; i <= NF; i++) {
        line = $i; if (line ~ /^[ \t]*#/) continue
        n = index(line, ":"); if (!n) continue
        k = tolower(substr(line, 1, n - 1)); v = substr(line, n + 1)
        gsub(/^[ \t]+|[ \t]+$/, "", v)
        if (k == "types") types = v; else if (k == "uris") uris = v
        else if (k == "suites") suites = v; else if (k == "components") comps = v
        else if (k == "enabled") enabled = tolower(v)
      }
      if (enabled == "no" || (" " types " ") !~ / deb / || (" " comps " ") !~ / main /) next
      nu = split(uris, u, /[ \t]+/); ns = split(suites, s, /[ \t]+/)
      for (a = 1; a <= nu; a++) for (b = 1; b <= ns; b++) print u[a], s[b] }'
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -f "$f" ] || continue
    sed -e 's/#.*//' -e 's/\[[^]]*\]//' "$f" |
      awk '$1 == "deb" { m = 0; for (i = 4; i <= NF; i++) if ($i == "main") m = 1; if (m) print $2, $3 }'
  done
}
# The bookworm, bookworm-updates and bookworm-security sources, as apt lines for the image.
image_sources=$(apt_sources | awk -v s="$suite" '$2 == s || $2 == s "-updates" || $2 == s "-security" { print "deb " $1 " " $2 " main" }' | sort -u)
mirror=$(apt_sources | awk -v s="$suite" '$2 == s { print $1; exit }')
[ -n "$mirror" ] || die "no '$suite main' source in /etc/apt/sources.list*: which Debian mirror to use?"
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
arch=$(dpkg --print-architecture)
packages=$(sed -e 's/#.*//' "$here/runtime-packages.txt" | xargs)
[ -n "$packages" ] || die "deploy/docker/runtime-packages.txt lists no package"

cache="$out/cache"
mkdir -p "$cache"
if [ "$refresh" = 1 ]; then
  note "--refresh: dropping $cache"
  rm -rf "${cache:?}"/*
fi
key() { sha256sum | cut -c1-12; }
base_key=$(printf '%s\n' "$suite" "$arch" "$mirror" minbase | key)
base="$cache/debootstrap-$suite-$arch-$base_key"
# The runtime tree's key: the base, the package list, the sources and this script (which
# decides how the tree is slimmed and the user made).
runtime_key=$( { echo "$base_key"; echo "$packages"; echo "$image_sources"; cat "$0"; } | key)
runtime="$cache/runtime-$runtime_key"

# ---- 1. debootstrap minbase (cached) ---------------------------------------------------------
if [ ! -d "$base" ]; then
  note "debootstrap --variant=minbase $suite from $mirror (cached in ${base#"$root_dir"/})"
  rm -rf "$base.tmp"
  unshare --mount --propagation private -- debootstrap --variant=minbase --arch="$arch" --keyring="$keyring" "$suite" "$base.tmp" "$mirror" \
    >"$cache/debootstrap.log" 2>&1 || { tail -20 "$cache/debootstrap.log" >&2; die "debootstrap failed (log: $cache/debootstrap.log)"; }
  rm -f "$base.tmp/var/cache/apt/archives/"*.deb
  mv "$base.tmp" "$base"
fi

# ---- 2. runtime packages, slimmed, user (cached) ----------------------------------------------
if [ ! -d "$runtime" ]; then
  note "installing the runtime packages: $packages"
  rm -rf "$runtime.tmp"
  cp -a "$base" "$runtime.tmp"
  t="$runtime.tmp"
  # As debian:bookworm-slim (debuerreotype's slimify): no documentation, manuals or translations.
  mkdir -p "$t/etc/dpkg/dpkg.cfg.d"
  cat >"$t/etc/dpkg/dpkg.cfg.d/docker" <<'EOF'
# Keep the image small, as debian:bookworm-slim does.
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
EOF
  printf '%s\n' "$image_sources" >"$t/etc/apt/sources.list"
  rm -f "$t/etc/apt/sources.list.d/"*
  cp /etc/resolv.conf "$t/etc/resolv.conf"
  printf '#!/bin/sh\nexit 101\n' >"$t/usr/sbin/policy-rc.d"; chmod 755 "$t/usr/sbin/policy-rc.d"
  # shellcheck disable=SC2086  # $packages is a list of words
  in_root "$t" /usr/bin/env DEBIAN_FRONTEND=noninteractive /bin/sh -c "
    set -e
    apt-get update -qq
    apt-get -y -qq -o Dpkg::Use-Pty=0 upgrade >/dev/null
    apt-get install -y -qq -o Dpkg::Use-Pty=0 --no-install-recommends $packages >/dev/null
    groupadd --gid $uid kvmesh
    useradd --uid $uid --gid $uid --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin --comment kvmesh kvmesh
    apt-get clean
  " >"$cache/packages.log" 2>&1 || { tail -20 "$cache/packages.log" >&2; die "installing the packages failed (log: $cache/packages.log)"; }
  # What debootstrap installed before the dpkg filter, and what apt and the build leave behind.
  find "$t/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete 2>/dev/null || true
  find "$t/usr/share/doc" -mindepth 1 -type d -empty -delete 2>/dev/null || true
  rm -rf "$t/usr/share/man/"* "$t/usr/share/groff/"* "$t/usr/share/info/"* "$t/usr/share/lintian/"* \
    "$t/usr/share/linda/"*
  find "$t/usr/share/locale" -mindepth 1 -maxdepth 1 -not -name locale.alias -exec rm -rf {} + 2>/dev/null || true
  rm -rf "$t/var/lib/apt/lists/"* "$t/var/cache/apt/"*.bin "$t/var/cache/debconf/"*-old \
    "$t/var/lib/dpkg/"*-old "$t/var/log/apt/"* "$t/var/log/"*.log "$t/tmp/"* "$t/var/tmp/"* \
    "$t/usr/sbin/policy-rc.d" "$t/var/cache/ldconfig/aux-cache" \
    "$t/etc/passwd-" "$t/etc/group-" "$t/etc/shadow-" "$t/etc/gshadow-"
  # Device nodes and what debootstrap's mounts left; runtimes mount /dev, /proc, /sys and /run.
  find "$t/dev" "$t/proc" "$t/sys" -mindepth 1 -delete 2>/dev/null || true
  rm -rf "$t/run/mount"
  : >"$t/etc/resolv.conf"; : >"$t/etc/machine-id"; : >"$t/etc/hostname"
  mv "$t" "$runtime"
fi
# Earlier package lists' or scripts' trees (100 MiB each) are not used again.
for old in "$cache"/runtime-*; do
  [ "$old" = "$runtime" ] || rm -rf "$old"
done

# ---- 3. the image's tree: runtime + the binaries ---------------------------------------------
rootfs="$out/rootfs"
note "rootfs: ${rootfs#"$root_dir"/} (from ${runtime#"$root_dir"/})"
rm -rf "$rootfs"
cp -a "$runtime" "$rootfs"
for b in "$node_bin:kvmesh-node" "$ctl_bin:kvmeshctl"; do
  src=${b%:*}; dst="$rootfs/usr/local/bin/${b##*:}"
  if [ "$strip" = 1 ]; then strip --strip-unneeded -o "$dst" "$src"; else cp "$src" "$dst"; fi
  chown 0:0 "$dst"; chmod 0755 "$dst"
done

# ---- 4. the OCI image layout ------------------------------------------------------------------
oci="$out/oci"
note "OCI layout: ${oci#"$root_dir"/}:$tag"
rm -rf "$oci"
umoci init --layout "$oci"
umoci new --image "$oci:$tag"
# One layer holding the whole tree (umoci insert SOURCE at /), gzip-compressed.
umoci insert --image "$oci:$tag" --history.created_by "deploy/docker/build-rootfs.sh" "$rootfs" /
# The binaries come from a build folder, not from a commit this script knows: the labels say
# which tree packed the image and which kvmesh-node it holds.
revision=$(git -C "$root_dir" rev-parse --short HEAD 2>/dev/null || echo unknown)
node_sha=$(sha256sum "$rootfs/usr/local/bin/kvmesh-node" | cut -d' ' -f1)
umoci config --image "$oci:$tag" --os linux --architecture "$arch" \
  --config.user "$uid:$uid" \
  --config.entrypoint /usr/local/bin/kvmesh-node \
  --config.workingdir / \
  --config.env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --config.exposedports 7700/tcp --config.exposedports 7701/tcp --config.exposedports 7702/tcp \
  --config.label org.opencontainers.image.title=kvmesh-node \
  --config.label "io.kvmesh.packed-by=deploy/docker/build-rootfs.sh at $revision" \
  --config.label "io.kvmesh.kvmesh-node.sha256=$node_sha" \
  --config.label org.opencontainers.image.base.name=debian:bookworm-minbase \
  --history.created_by "umoci config (entrypoint, user $uid, ports 7700 7701 7702)"
umoci gc --layout "$oci"
rm -f "$out/kvmesh-node-oci.tar"
if [ "$tarball" = 1 ]; then
  tar -C "$oci" -cf "$out/kvmesh-node-oci.tar" .
fi

# ---- summary ----------------------------------------------------------------------------------
rootfs_size=$(du -sb "$rootfs" | cut -f1)
manifest=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["manifests"][0]["digest"])' "$oci/index.json" 2>/dev/null || true)
layer_bytes=0
if [ -n "$manifest" ]; then
  layer_bytes=$(python3 -c '
import json, sys
m = json.load(open(sys.argv[1] + "/blobs/" + sys.argv[2].replace(":", "/")))
print(sum(l["size"] for l in m["layers"]))' "$oci" "$manifest")
fi
oci_size=$(du -sb "$oci" | cut -f1)
note "done: rootfs $((rootfs_size / 1024 / 1024)) MiB ($rootfs_size bytes); compressed layer $((layer_bytes / 1024 / 1024)) MiB ($layer_bytes bytes); OCI layout $oci_size bytes"
echo "rootfs=$rootfs"
echo "oci=$oci:$tag"
echo "rootfs_bytes=$rootfs_size"
echo "layer_bytes=$layer_bytes"

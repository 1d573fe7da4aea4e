#!/usr/bin/env bash
# Offline validation of deploy/k8s: renders every overlay and the monitoring kustomization with
# kustomize and checks the objects against the Kubernetes schemas, against kvmesh-node and against
# its metrics (validate.mjs says what is checked). No cluster is needed, nor reached.
#
#   check_manifests.sh install   WORKDIR                  npm ci of package-lock.json into WORKDIR
#                                                         (skipped when the lock has not changed)
#   check_manifests.sh validate  WORKDIR KVMESH_NODE ROOT  render ROOT/deploy/k8s/overlays/* and
#                                                         ROOT/deploy/k8s/monitoring, check
#   check_manifests.sh self-test WORKDIR KVMESH_NODE ROOT  plant errors in the host overlay's and the
#                                                         monitoring objects; each must be found
#
# ctest runs the three (tests/deploy/CMakeLists.txt; label deploy); by hand:
#   ctest --test-dir build -L deploy --output-on-failure
#
# kubectl (for `kubectl kustomize`) is on the project's machines; it is not a Debian package, so
# scripts/bootstrap.sh cannot install it. A machine without it fails here, saying how to get it,
# rather than skipping: a skipped check looks green and validates nothing.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
command=${1:-}
work=${2:-}
[ -n "$command" ] && [ -n "$work" ] || { sed -n '2,14p' "$0"; exit 2; }
mkdir -p "$work"

need() {
  command -v "$1" >/dev/null 2>&1 && return 0
  echo "check_manifests: $1 is not installed. $2" >&2
  exit 1
}

case "$command" in
  install)
    need npm "Node.js 20 and npm come with the machine image (Debian: apt-get install nodejs npm)."
    lock_sum=$(sha256sum "$here/package-lock.json" | cut -d' ' -f1)
    stamp="$work/node_modules/.kvmesh-lock.sha256"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$lock_sum" ]; then
      echo "check_manifests: node_modules in $work is up to date with package-lock.json"
      exit 0
    fi
    cp "$here/package.json" "$here/package-lock.json" "$work/"
    # npm ci installs exactly what package-lock.json pins (and checks each package's integrity).
    (cd "$work" && npm ci --no-audit --no-fund --loglevel=error)
    echo "$lock_sum" >"$stamp"
    echo "check_manifests: installed $(cd "$work" && npm ls --depth=0 --parseable 2>/dev/null |
                                       tail -n +2 | xargs -n1 basename | tr '\n' ' ')"
    ;;
  validate|self-test)
    node_bin=${3:?KVMESH_NODE}
    root=${4:?ROOT}
    need node "Node.js 20 comes with the machine image (Debian: apt-get install nodejs)."
    need kubectl "It renders the overlays (kubectl kustomize). Install it from the Kubernetes \
packages (https://kubernetes.io/docs/tasks/tools/install-kubectl-linux/: its apt repository, or \
the single static binary into /usr/local/bin), or the Google Cloud SDK's apt package kubectl."
    if [ ! -f "$work/node_modules/.kvmesh-lock.sha256" ]; then
      echo "check_manifests: no validator in $work: run '$0 install $work' first" >&2
      exit 1
    fi
    # Beside its node_modules, where Node looks for the packages it imports.
    cp "$here/validate.mjs" "$work/validate.mjs"
    "$node_bin" --helpfull >"$work/helpfull.txt" 2>&1 || true
    rendered=()
    for overlay in "$root"/deploy/k8s/overlays/*/; do
      name=$(basename "$overlay")
      kubectl kustomize "$overlay" >"$work/$name.yaml"
      rendered+=("$name=$work/$name.yaml")
    done
    [ "${#rendered[@]}" -gt 0 ] || { echo "check_manifests: no overlay in $root/deploy/k8s/overlays" >&2; exit 1; }
    # The optional monitoring kustomization (PodMonitor, alerts, dashboard), checked on its own and
    # against every overlay, and the node's metrics that its queries may name.
    kubectl kustomize "$root/deploy/k8s/monitoring" >"$work/monitoring.yaml"
    monitoring=(--metrics="$root/deploy/k8s/monitoring/metrics.txt" --monitoring="$work/monitoring.yaml")
    if [ "$command" = validate ]; then
      node "$work/validate.mjs" --flags="$work/helpfull.txt" "${monitoring[@]}" "${rendered[@]}"
    else
      node "$work/validate.mjs" --flags="$work/helpfull.txt" "${monitoring[@]}" --self-test "$work/host.yaml"
    fi
    ;;
  *)
    sed -n '2,14p' "$0"
    exit 2
    ;;
esac

#!/usr/bin/env bash
# Runs the ghz load tests of deploy/load/ against a kvmesh node (docs/load.md).
#
#   deploy/load/run.sh [--addr=HOST:PORT] [--reports=DIR] [PROFILE...]
#
#   PROFILE      health (the reference: grpc.health.v1.Health/Check), canresume, copyprefix,
#                getcache, listsequences, remove, visible, visible-ranges, listmembers, append
#                (one ghz run each, deploy/load/NAME.json), mixed (the five configs of
#                deploy/load/mixed/ started together); default: all of them, in this order
#   --addr       a node that is already running (it must have --memory-budget of 2GiB or more
#                free; the cache load-llama3-8b on it is deleted and recreated); default: start
#                BUILD/service/kvmesh-node on 127.0.0.1 (a free port) with --memory-budget=3GiB
#                and stop it at the end
#   --reports    where the reports go (default deploy/load/reports/<UTC time>/, git-ignored)
#
# Before every profile the node is prepared afresh by prepare.sh (cache load-llama3-8b, a
# 4096-token prefix in seq 0 and its forks in seqs 1..8), so each run starts from the same
# state. When BUILD/tests/load/ghz_config_check exists, every config is first checked against
# the node (the check of ctest's ghz_configs_test). Each ghz run writes its JSON report to
# the reports directory; run.sh prints a summary of each and machine.txt records the machine.
# When health ran, the control calls' req/s are printed at the end as ratios of its req/s, each
# "met" at >= 0.8 (the control-plane goal of docs/benchmarks.md: 16 calls in flight on one
# connection).
#
# BUILD is $KVMESH_BUILD_DIR (default <repo>/build); ghz is $GHZ or ghz on PATH. A node with
# tokens: $KVMESH_TOKEN is sent as "authorization: Bearer ..." (kvmeshctl and ghz).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
here=$root/deploy/load
build=${KVMESH_BUILD_DIR:-$root/build}
addr=
reports=
profiles=()
all_profiles=(health canresume copyprefix getcache listsequences remove visible visible-ranges
              listmembers append mixed)
# The scheduler-facing control calls, compared with health at the end.
control_profiles=(canresume getcache listsequences copyprefix remove visible visible-ranges
                  listmembers)
for arg in "$@"; do
  case "$arg" in
    --addr=*) addr=${arg#--addr=} ;;
    --reports=*) reports=${arg#--reports=} ;;
    -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
    -*) echo "run.sh: unknown flag '$arg' (--help)" >&2; exit 2 ;;
    *)
      case " ${all_profiles[*]} " in
        *" $arg "*) profiles+=("$arg") ;;
        *) echo "run.sh: unknown profile '$arg'; one of: ${all_profiles[*]}" >&2; exit 2 ;;
      esac ;;
  esac
done
[ ${#profiles[@]} -gt 0 ] || profiles=("${all_profiles[@]}")

ghz=${GHZ:-$(command -v ghz || true)}
if [ -z "$ghz" ] || [ ! -x "$ghz" ]; then
  cat >&2 <<'EOF'
run.sh: ghz is not installed (not on PATH, and $GHZ is not set).
Install it, then run this again:
  - a release binary: https://github.com/bojand/ghz/releases (ghz-linux-x86_64.tar.gz: put
    the ghz binary on PATH, or point $GHZ at it), or
  - with a Go toolchain: go install github.com/bojand/ghz/cmd/ghz@latest
    (it lands in $(go env GOPATH)/bin).
Without ghz, tests/bench/run.sh rpc measures the same calls with rpc_bench, and ctest -L load
checks these configs against a node (docs/load.md).
EOF
  exit 2
fi
if ! command -v python3 >/dev/null; then
  echo "run.sh: python3 is needed to summarize ghz's reports (scripts/bootstrap.sh installs it)" >&2
  exit 2
fi

ctl=$build/service/kvmeshctl
if [ ! -x "$ctl" ]; then
  echo "run.sh: $ctl is missing: cmake --build ${build#$root/} --target kvmesh_ctl kvmesh_node" >&2
  exit 2
fi
reports=${reports:-$here/reports/$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$reports"
reports=$(cd "$reports" && pwd)

node_pid=
cleanup() {
  if [ -n "$node_pid" ]; then
    kill "$node_pid" 2>/dev/null || true
    wait "$node_pid" 2>/dev/null || true
  fi
}
trap cleanup EXIT

if [ -z "$addr" ]; then
  node=$build/service/kvmesh-node
  if [ ! -x "$node" ]; then
    echo "run.sh: $node is missing: cmake --build ${build#$root/} --target kvmesh_node" >&2
    exit 2
  fi
  rm -f "$reports/node.port"
  "$node" --listen=127.0.0.1:0 --port_file="$reports/node.port" --node-name=load \
    --memory-budget=3GiB >"$reports/node.out" 2>"$reports/node.log" &
  node_pid=$!
  for _ in $(seq 100); do
    [ -s "$reports/node.port" ] && break
    kill -0 "$node_pid" 2>/dev/null || { echo "run.sh: the node exited; $reports/node.log:" >&2
                                         cat "$reports/node.log" >&2; exit 1; }
    sleep 0.1
  done
  [ -s "$reports/node.port" ] || { echo "run.sh: the node did not start in 10 s" >&2; exit 1; }
  addr=127.0.0.1:$(cat "$reports/node.port")
  echo "run.sh: started $node on $addr (--memory-budget=3GiB; log: $reports/node.log)"
fi

metadata=()
if [ -n "${KVMESH_TOKEN:-}" ]; then
  metadata=(--metadata="{\"authorization\":\"Bearer $KVMESH_TOKEN\"}")
fi

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "nproc: $(nproc)"
  lscpu | grep 'Model name' || true
  grep MemTotal /proc/meminfo
  echo "kernel: $(uname -r)"
  echo "ghz: $("$ghz" --version 2>&1 | head -1)"
  echo "node: $addr"
  echo "loadavg at start: $(cut -d' ' -f1-3 /proc/loadavg)"
} >"$reports/machine.txt"
cat "$reports/machine.txt"

prepare() { bash "$here/prepare.sh" --addr="$addr" --ctl="$ctl" >/dev/null; }

# One line per report: calls, errors, req/s, latency (ghz's JSON report: durations in ns).
# Fails when a report counts a failed call.
summarize() {
  python3 - "$@" <<'PY'
import json, sys
failed = 0
print(f"{'report':<28} {'count':>7} {'errors':>6} {'req/s':>9} {'avg ms':>8} {'p50 ms':>8} "
      f"{'p99 ms':>8}  status codes")
for path in sys.argv[1:]:
    with open(path) as f:
        r = json.load(f)
    lat = {d["percentage"]: d["latency"] for d in (r.get("latencyDistribution") or [])}
    codes = r.get("statusCodeDistribution") or {}
    errors = sum(n for c, n in codes.items() if c != "OK")
    ms = lambda ns: f"{ns / 1e6:8.3f}" if ns else "       -"
    name = path.rsplit("/", 1)[-1][:-5]
    print(f"{name:<28} {r['count']:>7} {errors:>6} {r['rps']:>9.0f} {ms(r.get('average'))} "
          f"{ms(lat.get(50))} {ms(lat.get(99))}  {codes}")
    for err, n in sorted((r.get("errorDistribution") or {}).items())[:3]:
        print(f"    {n} x {err[:160]}")
    failed += errors
if failed:
    print(f"run.sh: {failed} call(s) failed (status codes above)")
sys.exit(1 if failed else 0)
PY
}

run_ghz() {  # NAME CONFIG
  "$ghz" --config="$2" --output="$reports/$1.json" --format=json "${metadata[@]}" "$addr"
}

checker=$build/tests/load/ghz_config_check
if [ -x "$checker" ]; then
  echo "== checking the configs against the node ($checker)"
  prepare
  "$checker" --addr="$addr" "$here"/*.json "$here"/mixed/*.json
fi

failed=0
for profile in "${profiles[@]}"; do
  echo
  echo "== $profile (loadavg $(cut -d' ' -f1-3 /proc/loadavg))"
  case "$profile" in
    health)
      # The reference: the node's trivial health check over the same connection settings as
      # the single-method configs. ghz finds its messages through the node's reflection, as for
      # kvmesh's own services (the node links grpc.health.v1's descriptors for that).
      "$ghz" --call=grpc.health.v1.Health.Check --insecure \
        --data='{"service":""}' --concurrency=16 --connections=1 --duration=10s \
        --duration-stop=wait --skipFirst=200 --timeout=5s --name="reference: Health/Check" \
        --output="$reports/health.json" --format=json "${metadata[@]}" "$addr" || failed=1
      summarize "$reports/health.json" || failed=1 ;;
    mixed)
      prepare
      pids=()
      for config in "$here"/mixed/*.json; do
        name=mixed-$(basename "$config" .json)
        run_ghz "$name" "$config" & pids+=($!)
      done
      for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
      summarize "$reports"/mixed-*.json || failed=1 ;;
    *)
      prepare
      run_ghz "$profile" "$here/$profile.json" || failed=1
      summarize "$reports/$profile.json" || failed=1 ;;
  esac
done

# The control-plane goal: each control call's req/s as a ratio of Health/Check's in this run.
ratio_reports=()
for profile in "${control_profiles[@]}"; do
  [ -s "$reports/$profile.json" ] && ratio_reports+=("$reports/$profile.json")
done
if [ -s "$reports/health.json" ] && [ ${#ratio_reports[@]} -gt 0 ]; then
  echo
  python3 - "$reports/health.json" "${ratio_reports[@]}" <<'PY'
import json, sys
def rps(path):
    with open(path) as f:
        return json.load(f)["rps"]
health = rps(sys.argv[1])
print(f"control calls as a ratio of Health/Check's req/s ({health:.0f}; goal >= 0.8):")
for path in sys.argv[2:]:
    name = path.rsplit("/", 1)[-1][:-5]
    ratio = rps(path) / health if health > 0 else 0.0
    print(f"  {name:<16} {ratio:5.2f}  {'met' if ratio >= 0.8 else 'NOT met'}")
PY
fi
echo
echo "run.sh: reports in $reports"
exit "$failed"

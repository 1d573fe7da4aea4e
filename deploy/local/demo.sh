#!/usr/bin/env bash
# kvmesh demo on loopback: builds kvmesh-node and kvmeshctl, starts a node on 127.0.0.1 and
# runs what a cluster scheduler does through kvmeshctl: create a Llama-shaped cache, push a
# prompt, fork it three ways, continue each fork, context-shift one, ask what can resume, show
# that forks share cells, read back and verify. Then a hybrid model (LFM2-shaped: attention
# layers with RoPE plus short-conv recurrent layers): push a prompt, snapshot it, extend the
# sequence, restore it from the snapshot, fork from the snapshot, decode speculatively and commit
# part of the draft, merge/split/drop snapshots, verifying every step's data. Then a three-node
# cluster on loopback: a prompt appended on node 0, forked onto node 1 with a cross-node
# CopyPrefix, migrated to node 2, node 2 drained (its sequence moves to a peer, as on SIGTERM),
# removed cluster-wide, with the bytes moved and the time taken. Then the Python client's example
# scheduler (clients/python/examples/scheduler.py) serves chat requests on the same three nodes:
# routed to the longest cached prefix, forked with CopyPrefix, context-shifted, rebalanced with
# Migrate, verified. Then the reference worker (clients/python/examples/reference_worker.py), a
# torch decoder reading its K/V in place through the local data path of node-0 and node-1,
# checks its logits against recomputation after CopyPrefix, a context shift, snapshot/restore
# and speculation. Stop every node.
#
#   deploy/local/demo.sh           (from any directory; as root or with sudo for bootstrap)
#
# Environment: KVMESH_BUILD_DIR (default <repo>/build), KVMESH_DEMO_BUDGET (node memory budget,
# default 4GiB), KVMESH_DEMO_SNAPSHOT_BUDGET (node snapshot pool, default 1GiB), KVMESH_RUN_DIR
# (logs and port files, default deploy/local/run/, not tracked by git),
# KVMESH_DEMO_CLUSTER_BACKEND (host, the default, or cuda: the three nodes run --backend=cuda
# --transport=nccl on the simulated GPU and NCCL of the test build, docs/cuda.md).
#
# The build is configured as tests/run.sh configures it (-DKVMESH_CUDA=SIM), so that the two
# share build/; the single-node part and a host cluster never touch the simulated GPU.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
run_dir=${KVMESH_RUN_DIR:-$root/deploy/local/run}
build_dir=${KVMESH_BUILD_DIR:-$root/build}
budget=${KVMESH_DEMO_BUDGET:-4GiB}
snapshot_budget=${KVMESH_DEMO_SNAPSHOT_BUDGET:-1GiB}
cluster_backend=${KVMESH_DEMO_CLUSTER_BACKEND:-host}
case "$cluster_backend" in
  host) cluster_flags=() ;;
  cuda) cluster_flags=(--backend=cuda --transport=nccl) ;;
  *) echo "demo: KVMESH_DEMO_CLUSTER_BACKEND=$cluster_backend: expected host or cuda" >&2; exit 1 ;;
esac
mkdir -p "$run_dir"

step() { printf '\n=== %s\n' "$*"; }
die() { echo "demo: $*" >&2; exit 1; }

# ---- build ---------------------------------------------------------------------------------
step "bootstrap, configure and build kvmesh-node and kvmeshctl (${build_dir#$root/})"
"$root/scripts/bootstrap.sh"
if ! cmake -S "$root" -B "$build_dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVMESH_CUDA=SIM \
    >"$run_dir/cmake.log" 2>&1; then
  tail -n 30 "$run_dir/cmake.log" >&2
  die "cmake configure failed (log: $run_dir/cmake.log)"
fi
# kvmesh_python: the Python client's generated stubs (clients/python), for the last step.
targets=(kvmesh_node kvmesh_ctl kvmesh_python)
[ "$cluster_backend" = cuda ] && targets+=(kvmesh_ncclsim)
if ! cmake --build "$build_dir" -j"$(nproc)" --target "${targets[@]}" >"$run_dir/build.log" 2>&1; then
  tail -n 40 "$run_dir/build.log" >&2
  die "build failed (log: $run_dir/build.log)"
fi
node_bin="$build_dir/service/kvmesh-node"
ctl_bin="$build_dir/service/kvmeshctl"
[ -x "$node_bin" ] && [ -x "$ctl_bin" ] || die "missing $node_bin or $ctl_bin after the build"
echo "built $node_bin"
echo "built $ctl_bin"

# ---- nodes ---------------------------------------------------------------------------------
# One entry per started node; a multi-node demo calls start_node once per node.
declare -A node_pid=() node_addr=()

# start_node NAME [EXTRA_FLAGS...]: starts a node on a free loopback port and waits (with a
# deadline) until it has written its port file. Logs: run/NAME.log (stderr), run/NAME.out.
start_node() {
  local name=$1
  shift
  local port_file="$run_dir/$name.port"
  rm -f "$port_file"
  "$node_bin" --listen="127.0.0.1:${node_port:-0}" --port-file="$port_file" --node-name="$name" \
    --memory-budget="$budget" --snapshot-budget="$snapshot_budget" --max-message-bytes=128MiB \
    "$@" \
    >"$run_dir/$name.out" 2>"$run_dir/$name.log" &
  local pid=$!
  node_pid[$name]=$pid
  local deadline=$((SECONDS + 30))
  until [ -s "$port_file" ]; do
    if ! kill -0 "$pid" 2>/dev/null; then
      cat "$run_dir/$name.log" >&2
      die "node $name exited during startup"
    fi
    [ "$SECONDS" -lt "$deadline" ] || die "node $name did not write $port_file within 30s"
    sleep 0.1
  done
  node_addr[$name]="127.0.0.1:$(cat "$port_file")"
  echo "node $name (pid $pid): $(cat "$run_dir/$name.out")"
}

# stop_node NAME: SIGTERM, then SIGKILL when the node has not exited within 10s.
stop_node() {
  local name=$1 pid=${node_pid[$1]:-}
  [ -n "$pid" ] || return 0
  unset "node_pid[$name]"
  kill -TERM "$pid" 2>/dev/null || return 0
  local deadline=$((SECONDS + 10))
  while kill -0 "$pid" 2>/dev/null; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "demo: node $name did not stop within 10s; killing it" >&2
      kill -KILL "$pid" 2>/dev/null || true
      break
    fi
    sleep 0.1
  done
  local rc=0
  wait "$pid" 2>/dev/null || rc=$?
  echo "node $name stopped (exit status $rc; log: ${run_dir#$root/}/$name.log)"
}

stop_all_nodes() {
  local name
  for name in "${!node_pid[@]}"; do stop_node "$name"; done
}
trap stop_all_nodes EXIT

# ctl NODE ARGS...: runs kvmeshctl against NODE, echoing the command first.
ctl() {
  local name=$1
  shift
  printf '$ kvmeshctl %s\n' "$*"
  "$ctl_bin" --addr="${node_addr[$name]}" --timeout=60s "$@"
}

# expect_json NODE WANT ARGS...: runs kvmeshctl --json and checks that its output contains WANT.
expect_json() {
  local name=$1 want=$2
  shift 2
  local out
  printf '$ kvmeshctl --json %s\n' "$*"
  out=$("$ctl_bin" --addr="${node_addr[$name]}" --timeout=60s --json "$@")
  printf '%s\n' "$out"
  [[ "$out" == *"$want"* ]] || die "expected $want from: kvmeshctl $*"
}

# expect_fail NODE CODE ARGS...: runs kvmeshctl, which must fail with status CODE (e.g.
# FAILED_PRECONDITION); prints the error it gave.
expect_fail() {
  local name=$1 code=$2
  shift 2
  printf '$ kvmeshctl %s   (expected to fail with %s)\n' "$*" "$code"
  local rc=0
  "$ctl_bin" --addr="${node_addr[$name]}" --timeout=60s "$@" >"$run_dir/expect-fail.out" \
    2>"$run_dir/expect-fail.err" || rc=$?
  [ "$rc" -ne 0 ] || die "kvmeshctl $* succeeded; expected $code"
  grep -q "^error: $code: " "$run_dir/expect-fail.err" ||
    die "kvmeshctl $* failed differently than $code: $(cat "$run_dir/expect-fail.err")"
  echo "  $(cat "$run_dir/expect-fail.err")"
}

# snapshot_id JSON: the "id" of the first snapshot in a kvmeshctl --json answer.
snapshot_id() {
  local id
  id=$(printf '%s' "$1" | sed -n 's/^[^}]*"id":"\([0-9]*\)".*/\1/p')
  [ -n "$id" ] || die "no snapshot id in: $1"
  echo "$id"
}

# ---- the workload --------------------------------------------------------------------------
step "start a node on 127.0.0.1 (port picked by the kernel)"
start_node node-a
N=node-a
ctl $N health

cache=llama3-8b
rope=neox:128:500000
step "create a Llama-3-8B-shaped cache: 32 full-attention layers + 4 sliding-window layers (window 256)"
ctl $N create --name=$cache --dtype=f16 --max-sequences=8 --capacity=2048 --max-batch=512 \
  --group=attention:layers=32,heads=8,head_dim=128,window=full,rope=$rope \
  --group=attention:layers=4,heads=8,head_dim=128,window=sliding:256,rope=$rope

step "prefill: reserve room for a 512-token prompt for seq 0, then push its KV (AppendStream, 4 appends of 128 tokens)"
# The reservation keeps other sequences from taking the cells between the 4 appends.
ctl $N reserve --cache=$cache --seq=0 --positions=512 --ttl=30s
ctl $N append --cache=$cache --seq=0 --positions=0:512 --seed=1 --stream --batch=128
ctl $N reserve --cache=$cache --seq=0 --positions=0

step "fork the conversation three ways: copy-prefix seq 0 -> seqs 1, 2, 3 (cells shared, not copied)"
# --require-src-offset: a scheduler passes the offset it recorded for seq 0, so that a source
# removed or truncated since is refused instead of leaving the fork empty.
for dst in 1 2 3; do
  ctl $N copy-prefix --cache=$cache --src=0 --dst=$dst --length=512 --require-src-offset=512
done

step "each fork continues differently (a 128-token turn, 4 decode steps, a 256-token turn)"
ctl $N append --cache=$cache --seq=1 --positions=512:640 --seed=11
for pos in 512 513 514 515; do
  ctl $N append --cache=$cache --seq=2 --positions=$pos --seed=12
done
ctl $N append --cache=$cache --seq=3 --positions=512:768 --seed=13

step "sequences and usage: the forks share the prompt's cells"
ctl $N list-sequences --cache=$cache
ctl $N usage --cache=$cache
usage_json=$("$ctl_bin" --addr="${node_addr[$N]}" --json usage --cache=$cache)
used=$(printf '%s' "$usage_json" | sed -n 's/.*{"group":0,"cellsTotal":"[0-9]*","cellsUsed":"\([0-9]*\)".*/\1/p')
[ -n "$used" ] || die "cannot parse cells used from: $usage_json"
tokens=$((512 + 640 + 516 + 768))
echo "group 0 holds $tokens token positions over 4 sequences in $used cells (unshared: $tokens cells)"
[ "$used" -lt "$tokens" ] || die "forks do not share cells: $used cells for $tokens positions"

step "context shift on fork 1: remove [16, 144); later positions move down by 128, keys re-rotated"
ctl $N remove --cache=$cache --seq=1 --begin=16 --end=144
ctl $N list-sequences --cache=$cache

step "attention masks: what a query attends to (full group 0, sliding group 1)"
ctl $N visible --cache=$cache --group=0 --seq=1 --pos=511
ctl $N visible --cache=$cache --group=1 --seq=3 --pos=767,600

step "can-resume: the sliding group only allows positions whose window is still stored"
expect_json $N '"canResume":true' can-resume --cache=$cache --seq=3 --pos=768
expect_json $N '"canResume":true' can-resume --cache=$cache --seq=3 --pos=600
expect_json $N '"canResume":false' can-resume --cache=$cache --seq=3 --pos=100
expect_json $N '"canResume":false' can-resume --cache=$cache --seq=3 --pos=800
expect_json $N '"canResume":true' can-resume --cache=$cache --seq=1 --pos=512

step "read back and verify against the seeds the payloads were generated from"
ctl $N read --cache=$cache --seq=0 --verify-seed=1
ctl $N read --cache=$cache --seq=3 --end=512 --verify-seed=1
ctl $N read --cache=$cache --seq=3 --begin=512 --verify-seed=13
ctl $N read --cache=$cache --seq=1 --end=16 --verify-seed=1
ctl $N read --cache=$cache --seq=2 --begin=512 --verify-seed=12 --out="$run_dir/seq2-turn.bin"
echo "fork 1 past the shift holds old positions 144.. at 16.. with re-rotated keys, so the"
echo "seed-1 pattern must no longer match there:"
if "$ctl_bin" --addr="${node_addr[$N]}" read --cache=$cache --seq=1 --begin=16 --end=32 \
     --verify-seed=1 >/dev/null 2>"$run_dir/shift-check.txt"; then
  die "fork 1 [16, 32) still matches the unshifted pattern"
fi
echo "  $(cat "$run_dir/shift-check.txt")"

step "delete the cache"
ctl $N delete --cache=$cache
ctl $N list

step "a full cache with the LRU policy: an Append evicts the least recently used sequence that is not pinned"
ctl $N create --name=lru-demo --dtype=f16 --max-sequences=2 --capacity=256 --max-batch=256 \
    --group=attention:layers=2,heads=2,head_dim=64,rope=normal --eviction=lru
ctl $N append --cache=lru-demo --seq=0 --positions=0:256 --seed=1
ctl $N append --cache=lru-demo --seq=1 --positions=0:256 --seed=2
ctl $N set-retention --cache=lru-demo --seq=0 --pin
ctl $N append --cache=lru-demo --seq=2 --positions=0:256 --seed=3
ctl $N list-sequences --cache=lru-demo
echo "seq 1 was evicted to make room for seq 2; seq 0 is pinned and stayed"
expect_fail $N NOT_FOUND read --cache=lru-demo --seq=1
ctl $N read --cache=lru-demo --seq=0 --verify-seed=1
ctl $N read --cache=lru-demo --seq=2 --verify-seed=3
ctl $N set-retention --cache=lru-demo --seq=2 --pin
expect_fail $N RESOURCE_EXHAUSTED append --cache=lru-demo --seq=3 --positions=0:256 --seed=4
ctl $N delete --cache=lru-demo

# ---- a hybrid model: snapshots and speculative decoding -----------------------------------------
hc=lfm2-1.2b
step "create an LFM2-1.2B-shaped hybrid cache: 6 attention layers (GQA, NEOX RoPE) + 10 short-conv layers (conv state [2][2048] per layer and sequence)"
ctl $N create --name=$hc --dtype=bf16 --max-sequences=4 --capacity=2048 --max-batch=256 \
  --group=attention:layers=6,heads=8,head_dim=64,window=full,rope=neox:64:1000000 \
  --group=recurrent:layers=10,conv_tail=2,conv_dim=2048

step "prefill seq 0 with a 512-token prompt (2 appends of 256 tokens; each carries the conv state it reaches)"
ctl $N append --cache=$hc --seq=0 --positions=0:512 --seed=1
ctl $N list-sequences --cache=$hc
ctl $N read --cache=$hc --seq=0 --verify-seed=1

step "snapshot the prompt: seq 0 [0, 512) goes to the node's snapshot pool"
printf '$ kvmeshctl --json snapshot --cache=%s --seq=0 --from=0\n' "$hc"
snap_json=$("$ctl_bin" --addr="${node_addr[$N]}" --json snapshot --cache=$hc --seq=0 --from=0)
printf '%s\n' "$snap_json"
prompt_snap=$(snapshot_id "$snap_json")
ctl $N list-snapshots --cache=$hc

step "extend seq 0 with a 128-token turn (seed 2): the conv state moves on to offset 640"
ctl $N append --cache=$hc --seq=0 --positions=512:640 --seed=2
ctl $N list-sequences --cache=$hc
ctl $N read --cache=$hc --seq=0 --end=512 --verify-seed=1
ctl $N read --cache=$hc --seq=0 --begin=512 --verify-seed=2

step "a recurrent state cannot be rewound from live data: restore without a snapshot is refused"
expect_fail $N FAILED_PRECONDITION restore --cache=$hc --seq=0 --target=512

step "restore seq 0 from snapshot $prompt_snap: back to the prompt (offset 512, the conv state of offset 512)"
ctl $N restore --cache=$hc --seq=0 --snapshot=$prompt_snap --target=512
ctl $N list-sequences --cache=$hc
ctl $N read --cache=$hc --seq=0 --verify-seed=1
ctl $N list-snapshots --cache=$hc

step "fork from the snapshot: restore it into a new seq 1, which continues differently (seed 4)"
ctl $N restore --cache=$hc --seq=1 --snapshot=$prompt_snap --target=512
ctl $N append --cache=$hc --seq=1 --positions=512:520 --seed=4
ctl $N list-sequences --cache=$hc
ctl $N read --cache=$hc --seq=1 --end=512 --verify-seed=1
ctl $N read --cache=$hc --seq=1 --begin=512 --verify-seed=4

step "speculative decoding on seq 0: a 4-token draft is pending (one conv state per draft token)"
ctl $N append --cache=$hc --seq=0 --positions=512:516 --seed=3 --speculative
ctl $N list-sequences --cache=$hc
ctl $N read --cache=$hc --seq=0 --begin=512 --verify-seed=3
expect_fail $N ABORTED snapshot --cache=$hc --seq=0

step "the target model accepts 2 of the 4 draft tokens: the rest is dropped, the state is the one after token 2"
ctl $N commit-speculation --cache=$hc --seq=0 --accepted=2
expect_json $N '{"seq":"0","offset":514,' list-sequences --cache=$hc
ctl $N read --cache=$hc --seq=0 --begin=512 --verify-seed=3

step "snapshot chain: [512, 514) on top of the prompt snapshot, merged into one [0, 514)"
printf '$ kvmeshctl --json snapshot --cache=%s --seq=0 --from=512\n' "$hc"
snap_json=$("$ctl_bin" --addr="${node_addr[$N]}" --json snapshot --cache=$hc --seq=0 --from=512)
printf '%s\n' "$snap_json"
turn_snap=$(snapshot_id "$snap_json")
printf '$ kvmeshctl --json merge-snapshots --cache=%s --parent=%s --child=%s\n' "$hc" \
  "$prompt_snap" "$turn_snap"
snap_json=$("$ctl_bin" --addr="${node_addr[$N]}" --json merge-snapshots --cache=$hc \
  --parent=$prompt_snap --child=$turn_snap)
printf '%s\n' "$snap_json"
merged_snap=$(snapshot_id "$snap_json")
ctl $N list-snapshots --cache=$hc

step "restore the merged snapshot $merged_snap into seq 2 and verify both of its parts"
ctl $N restore --cache=$hc --seq=2 --snapshot=$merged_snap --target=514
ctl $N list-sequences --cache=$hc
ctl $N read --cache=$hc --seq=2 --end=512 --verify-seed=1
ctl $N read --cache=$hc --seq=2 --begin=512 --verify-seed=3

step "split snapshot $merged_snap at 512: a recurrent state cannot be split, so it stays whole (no parent)"
ctl $N split-snapshot --cache=$hc --snapshot=$merged_snap --at=512
ctl $N list-snapshots --cache=$hc
ctl $N usage --cache=$hc

step "drop every snapshot; the pool is empty again"
for id in $(printf '%s' "$("$ctl_bin" --addr="${node_addr[$N]}" --json list-snapshots --cache=$hc)" |
              grep -o '"id":"[0-9]*"' | grep -o '[0-9]*'); do
  ctl $N drop-snapshot --cache=$hc --snapshot="$id"
done
ctl $N list-snapshots --cache=$hc

step "delete the hybrid cache and stop the node"
ctl $N delete --cache=$hc
ctl $N list
stop_all_nodes

# ---- a three-node cluster ------------------------------------------------------------------------
# free_port: a loopback port nothing listens on now (from 17700 up).
free_port() {
  local port=${1:-17700}
  while ss -Htln "sport = :$port" | grep -q .; do port=$((port + 1)); done
  echo "$port"
}
step "start a three-node cluster on 127.0.0.1 (backend $cluster_backend): each node knows the others from --peers"
if [ "$cluster_backend" = cuda ]; then
  export KVMESH_NCCL_LIBRARY="$build_dir/tests/testing/ncclsim/libnccl_sim.so"
  echo "nodes on the simulated GPU, payloads over the nccl transport ($KVMESH_NCCL_LIBRARY)"
fi
p0=$(free_port 17700); p1=$(free_port $((p0 + 1))); p2=$(free_port $((p1 + 1)))
# local_flags NAME: the local data path's socket, where workers map the node's caches
# (docs/api.md): run/NODE.sock.
local_flags() {
  rm -f "$run_dir/$1.sock"
  echo "--local-socket=$run_dir/$1.sock"
}
node_port=$p0 start_node node-0 --peers=node-1=127.0.0.1:$p1,node-2=127.0.0.1:$p2 "${cluster_flags[@]}" $(local_flags node-0)
node_port=$p1 start_node node-1 --peers=node-0=127.0.0.1:$p0,node-2=127.0.0.1:$p2 "${cluster_flags[@]}" $(local_flags node-1)
node_port=$p2 start_node node-2 --peers=node-0=127.0.0.1:$p0,node-1=127.0.0.1:$p1 "${cluster_flags[@]}" $(local_flags node-2)
ctl node-1 list-members

cc=llama3-8b
step "create the Llama-3-8B-shaped cache on every node (32 layers, 8 KV heads, head dim 128, F16)"
for n in node-0 node-1 node-2; do
  ctl $n create --name=$cc --dtype=f16 --max-sequences=4 --capacity=4096 --max-batch=512 \
    --group=attention:layers=32,heads=8,head_dim=128,window=full,rope=$rope
done

step "node-0: prefill a 1024-token prompt for seq 0 (128 MiB of K/V), with its token ids"
ctl node-0 append --cache=$cc --seq=0 --positions=0:1024 --token-ids=50000:51024 --seed=21 \
  --stream --batch=256

step "a new request starts with the same 1024 tokens: node-1 asks which node holds its longest prefix"
# node-1 knows node-0's blocks from node-0's events (its index of the cluster), a moment after
# the append: by block hash, then verified token by token by node-0.
for _ in $(seq 50); do
  "$ctl_bin" --addr="${node_addr[node-1]}" --timeout=10s lookup-prefix --cache=$cc \
    --tokens=50000:51024 --scope=cluster | grep -q '^node-0 ' && break
  sleep 0.1
done
ctl node-1 lookup-prefix --cache=$cc --tokens=50000:51024,7,8,9 --scope=cluster
expect_json node-1 '"verified":true' lookup-prefix --cache=$cc --tokens=50000:51024,7,8,9 \
  --scope=cluster --verify
ctl node-0 watch-events --cache=$cc --count=1

step "node-1 forks it: CopyPrefix from node-0's seq 0 into its own seq 5 (the destination pulls)"
ctl node-1 copy-prefix --cache=$cc --src=0 --dst=5 --length=1024 --source-node=node-0 \
  --require-src-offset=1024
ctl node-1 read --cache=$cc --seq=5 --verify-seed=21
ctl node-1 append --cache=$cc --seq=5 --positions=1024:1040 --seed=22
ctl node-0 list-sequences --cache=$cc
ctl node-1 list-sequences --cache=$cc
# The fork carried the token ids: node-1 now finds the prefix in its own seq 5.
ctl node-1 lookup-prefix --cache=$cc --tokens=50000:51024,7,8,9

step "node-0's conversation grows by 512 tokens; node-1 pulls the longer prefix into seq 5 again: only the new positions move"
ctl node-0 append --cache=$cc --seq=0 --positions=1024:1536 --token-ids=51024:51536 --seed=23 \
  --stream --batch=256
# seq 5 holds the first 1024 token ids exactly (its own turn, appended without ids, does not
# count): they stay, and positions 1024.. come from node-0.
expect_json node-1 '"keptPositions":1024' copy-prefix --cache=$cc --src=0 --dst=5 --length=1536 \
  --source-node=node-0
ctl node-1 read --cache=$cc --seq=5 --end=1024 --verify-seed=21
ctl node-1 read --cache=$cc --seq=5 --begin=1024 --verify-seed=23

step "migrate node-0's seq 0 to node-2 as seq 1: copy, commit on node-2, then remove on node-0"
ctl node-0 migrate --cache=$cc --seq=0 --target-node=node-2 --target-seq=1
ctl node-2 read --cache=$cc --seq=1 --end=1024 --verify-seed=21
ctl node-2 read --cache=$cc --seq=1 --begin=1024 --verify-seed=23
ctl node-0 list-sequences --cache=$cc
ctl node-2 list-sequences --cache=$cc

step "remove positions [512, end) of seq 1 everywhere: one result per node"
ctl node-2 remove --cache=$cc --seq=1 --begin=512 --scope=cluster
ctl node-2 list-sequences --cache=$cc
ctl node-2 read --cache=$cc --seq=1 --verify-seed=21

step "drain node-2, as a pod deletion does on SIGTERM: its seq 1 moves to the peer with the most free cells (node-0)"
ctl node-2 drain --timeout-ms=30000
ctl node-0 read --cache=$cc --seq=1 --verify-seed=21
ctl node-2 list-sequences --cache=$cc
ctl node-2 health --service=kvmesh.v1.CacheService
ctl node-2 drain --resume

step "remove seq 5 and seq 1 cluster-wide; every node is empty again"
ctl node-0 remove --cache=$cc --seq=5 --begin=0 --scope=cluster
ctl node-0 remove --cache=$cc --seq=1 --begin=0 --scope=cluster
for n in node-0 node-1 node-2; do
  printf '$ kvmeshctl --json list-sequences --cache=%s   (on %s)\n' "$cc" "$n"
  out=$("$ctl_bin" --addr="${node_addr[$n]}" --timeout=60s --json list-sequences --cache=$cc)
  printf '%s\n' "$out"
  case "$(printf '%s' "$out" | tr -d ' \n')" in
    '{}' | '{"sequences":[]}' | '{"sequences":[],"nextPageToken":""}') ;;
    *) die "$n still holds sequences" ;;
  esac
done

step "the Python client: clients/python/examples/scheduler.py schedules chat requests on the three nodes"
printf '$ PYTHONPATH=clients/python:%s/clients/python /usr/bin/python3 clients/python/examples/scheduler.py %s %s %s\n' \
  "${build_dir#$root/}" "${node_addr[node-0]}" "${node_addr[node-1]}" "${node_addr[node-2]}"
PYTHONPATH="$root/clients/python:$build_dir/clients/python" PYTHONDONTWRITEBYTECODE=1 \
  /usr/bin/python3 "$root/clients/python/examples/scheduler.py" \
  "${node_addr[node-0]}" "${node_addr[node-1]}" "${node_addr[node-2]}" ||
  die "the Python example scheduler failed"

step "the reference worker: a torch decoder whose attention reads its K/V from kvmesh's cells in place (local data path on node-0 and node-1)"
# On the simulated GPU the worker imports the nodes' GPU memory through the simulator's driver.
worker_env=()
if [ "$cluster_backend" = cuda ]; then
  worker_env=("KVMESH_CUDA_DRIVER=$build_dir/tests/testing/cudasim/libkvmesh_cudasim.so")
fi
# f32 and bf16 of the Llama-like shape, then f32 of the hybrid one (a ring and a conv state).
for shape in "--dtype=f32" "--dtype=bf16" "--dtype=f32 --hybrid"; do
  printf '$ PYTHONPATH=clients/python:%s/clients/python /usr/bin/python3 clients/python/examples/reference_worker.py %s --node-a=%s --socket-a=%s --name-a=node-0 --node-b=%s --socket-b=%s\n' \
    "${build_dir#$root/}" "$shape" "${node_addr[node-0]}" "${run_dir#$root/}/node-0.sock" \
    "${node_addr[node-1]}" "${run_dir#$root/}/node-1.sock"
  # shellcheck disable=SC2086 # $shape is two flags or three
  env "${worker_env[@]}" PYTHONPATH="$root/clients/python:$build_dir/clients/python" \
    PYTHONDONTWRITEBYTECODE=1 \
    /usr/bin/python3 "$root/clients/python/examples/reference_worker.py" $shape \
    --node-a="${node_addr[node-0]}" --socket-a="$run_dir/node-0.sock" --name-a=node-0 \
    --node-b="${node_addr[node-1]}" --socket-b="$run_dir/node-1.sock" ||
    die "the reference worker's outputs differ (see above)"
done
stop_all_nodes
echo
echo "demo: done"

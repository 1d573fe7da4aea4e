// kvmesh-node: one node of kvmesh. Serves kvmesh.v1.CacheService, grpc.health.v1.Health and
// server reflection on --listen (PeerService on --peer-listen, health alone on --health-listen)
// until SIGTERM or SIGINT. Then it drains (docs/api.md#drain: readiness NOT_SERVING, no new
// caches or sequences, its sequences and snapshots moved to peers, for up to
// --drain-timeout-ms), and shuts down cleanly: the health status turns NOT_SERVING, in-flight
// calls get a grace period, and the executors drain.
//
// Once it listens it prints exactly one line to stdout, which scripts and tests parse:
//   kvmesh-node <name> listening on <host>:<port> backend=<host|cuda> peers=<number of peers>
//   [peer-plane=<host>:<port>] [health=<host>:<port>] [metrics=<host>:<port>]
#include <malloc.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cache/cache_registry.h"
#include "cache/device/cuda_device.h"
#include "cache/device/host_device.h"
#include "cache/mutex.h"
#include "grpc/grpc.h"
#include "grpc/health/v1/health.pb.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/resource_quota.h"
#include "service/auth.h"
#include "service/cache_service.h"
#include "service/cluster/cluster.h"
#include "service/cluster/cluster_index.h"
#include "service/cluster/drain.h"
#include "service/cluster/drain_gate.h"
#include "service/cluster/leases.h"
#include "service/cluster/membership.h"
#include "service/cluster/reservations.h"
#include "service/common/flags.h"
#include "service/common/log.h"
#include "service/common/metrics.h"
#include "service/common/process_info.h"
#include "service/common/tls.h"
#include "service/executor.h"
#include "service/inflight_budget.h"
#include "service/local_server.h"
#include "service/node_lifecycle.h"
#include "service/node_wiring.h"
#include "service/peer_service.h"
#include "service/rpc_observer.h"
#include "transport/grpc_stream_transport.h"
#ifdef KVMESH_HAVE_NCCL
#include "transport/nccl_api.h"
#include "transport/nccl_transport.h"
static_assert(kvmesh::transport::kNcclChunkBytes == uint64_t{64} << 20,
              "--testing_nccl_chunk_bytes defaults to kNcclChunkBytes");
#endif

ABSL_FLAG(std::string, listen, "127.0.0.1:7700",
          "address to serve on, host:port; port 0 picks a free port (see --port_file)");
ABSL_FLAG(std::string, peer_listen, "",
          "address of the peer plane (kvmesh.v1.PeerService, the node-to-node API, and "
          "grpc.health.v1.Health), host:port, port 0 picks one; meant for a private network. "
          "Empty: PeerService is served on --listen in development mode (plaintext, no "
          "--token-file, loopback --listen) and nowhere otherwise (docs/security.md)");
ABSL_FLAG(std::string, health_listen, "",
          "address of a plaintext server of grpc.health.v1.Health alone, host:port (port 0 "
          "picks one), for probes that cannot speak TLS (Kubernetes' gRPC probes): service '' is "
          "SERVING from start-up until shutdown (liveness), 'kvmesh.v1.CacheService' while the "
          "node takes work, NOT_SERVING while it drains or shuts down (readiness). Empty: none");
ABSL_FLAG(int64_t, drain_timeout_ms, 60000,
          "on SIGTERM the node drains first (docs/api.md#drain): it takes no new caches or "
          "sequences and moves its sequences and snapshots to peers for up to this long, then "
          "shuts down (5 s more for calls in flight); also the Drain RPC's default timeout. "
          "0: SIGTERM shuts down at once");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate (chain) of this node: TLS on --listen and mTLS on the peer plane; "
          "re-read when the file changes (docs/security.md)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls-cert; re-read when it changes");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle: when set, clients on --listen must present a certificate it signed");
ABSL_FLAG(std::string, peer_ca, "",
          "PEM CA bundle of the peer plane (required with --tls-cert): members' certificates "
          "must verify against it, both ways");
ABSL_FLAG(int32_t, testing_tls_reload_interval_s, kvmesh::kDefaultTlsReloadIntervalSeconds,
          "testing only: how often the TLS files are re-read, in seconds");
ABSL_FLAG(std::string, node_name, "", "this node's name in the cluster (default: the hostname)");
ABSL_FLAG(kvmesh::ByteSize, memory_budget, kvmesh::ByteSize{uint64_t{8} << 30},
          "device memory the caches may use, in bytes or with a suffix: 512MiB, 8GiB");
ABSL_FLAG(kvmesh::ByteSize, snapshot_budget, kvmesh::ByteSize{uint64_t{2} << 30},
          "device memory the snapshots of all caches may use, apart from --memory-budget, in "
          "bytes or with a suffix: 512MiB, 2GiB");
ABSL_FLAG(kvmesh::ByteSize, max_message_bytes, kvmesh::ByteSize{uint64_t{128} << 20},
          "largest gRPC message received or sent (Append payloads, Read chunks); the default "
          "fits a unary Append of 512 Llama-3-8B tokens (64 MiB) with room to spare");
ABSL_FLAG(int32_t, executor_threads, 0,
          "threads running engine calls (0: the hardware concurrency, at least 2)");
ABSL_FLAG(int32_t, executor_queue, 4096,
          "engine calls that may wait for a thread; beyond it calls fail with UNAVAILABLE");
ABSL_FLAG(std::string, backend, "host",
          "where caches live: host (host memory, needs no GPU) or cuda (the GPU --device)");
ABSL_FLAG(int32_t, device, 0, "with --backend=cuda: the CUDA device index to serve from");
ABSL_FLAG(std::string, port_file, "", "when set, the bound port is written to this file");
ABSL_FLAG(int32_t, metrics_port, 0,
          "serve Prometheus metrics at http://<host of --listen>:<port>/metrics "
          "(docs/operate.md#metrics); 0: no metrics endpoint");
ABSL_FLAG(std::string, metrics_port_file, "",
          "testing: when set, the bound metrics port is written to this file");
ABSL_FLAG(std::string, log_level, "info",
          "least severe log lines written to stderr: debug (a line per request), info "
          "(lifecycle), warning (every error status a request gets), error, or off");
ABSL_FLAG(std::string, log_format, "text", "log lines as text or json (one object per line)");
ABSL_FLAG(kvmesh::ByteSize, kept_arena_limit,
          kvmesh::ByteSize{kvmesh::HostDevice::kDefaultKeptLimit},
          "--backend=host: most memory of freed cache arenas kept mapped for reuse (a new cache "
          "or snapshot of the same size then skips the page faults); RSS stays up to this much "
          "above what the caches hold after a DeleteCache. 0: unmap every freed arena at once");
ABSL_FLAG(bool, prefault_memory, false,
          "--backend=host: fault in every page of a new cache or snapshot arena when it is "
          "allocated, so that the first operation to write it (a new cache's first migration "
          "into it) does not pay for fresh memory; CreateCache takes that time instead and the "
          "RSS holds the whole cache from then on");
ABSL_FLAG(std::string, local_socket, "",
          "a Unix-domain socket path for workers on this machine to map caches' memory and read "
          "cells in place (docs/api.md#local-data-path). Cache memory is then shared (memfds "
          "on the host, CUDA memory exported as file descriptors on a GPU) and never reused "
          "after a cache is deleted");
ABSL_FLAG(std::string, peers, "",
          "the other members of the cluster: name=host:port,name=host:port,... where host:port "
          "is each member's peer plane (its --peer-listen, or its --listen in development "
          "mode); docs/cluster.md");
ABSL_FLAG(std::string, peer_dns, "",
          "discover the members from a Kubernetes headless Service instead: SERVICE:PORT "
          "(StatefulSet pods; each pod's name is the first label of its reverse DNS name)");
ABSL_FLAG(std::string, transport, "auto",
          "how payloads move between nodes: auto (nccl when both nodes run on CUDA and have it, "
          "else grpc-stream), grpc-stream or nccl (needs --backend=cuda); a cuda node loads "
          "NCCL at start-up from $KVMESH_NCCL_LIBRARY, else libnccl.so.2");
ABSL_FLAG(int64_t, lease_ms, 30000,
          "an export lease that sees no transfer for this long expires and frees its copy");
ABSL_FLAG(int64_t, max_lease_ms, 120000,
          "the longest lease time a receiving node may ask for (each unreleased lease pins a copy "
          "in the snapshot pool until it expires)");
ABSL_FLAG(int32_t, max_leases_per_receiver, 32,
          "export leases one receiving node may hold on this node at once");
ABSL_FLAG(std::string, token_file, "",
          "tenants and bearer tokens (docs/security.md): each call must carry 'authorization: "
          "Bearer <token>' of a token listed here (by its SHA-256); reloaded when it changes. "
          "Empty: development mode, one tenant 'default' and no authentication");
ABSL_FLAG(int64_t, transfer_timeout_ms, 120000,
          "deadline of a cluster operation (copy, migration) whose caller set none or a later one");
ABSL_FLAG(int32_t, cluster_threads, 8,
          "threads running cluster operations (they wait on the network, apart from the engine)");
ABSL_FLAG(kvmesh::ByteSize, inflight_budget, kvmesh::ByteSize{0},
          "host memory for requests in flight, apart from --memory-budget and --snapshot-budget "
          "(docs/security.md#bounded-memory): three quarters for what kvmesh buffers (AppendStream "
          "bodies, unary Append payloads, Read payloads, Visible answers; beyond it calls fail "
          "with RESOURCE_EXHAUSTED), a quarter for gRPC's own buffers of messages being "
          "received (its ResourceQuota), which must hold one of --max-message-bytes; "
          "0 (default): 1GiB, or 4 x --max-message-bytes when that is more");
ABSL_FLAG(kvmesh::ByteSize, stream_window, kvmesh::ByteSize{0},
          "how much of one call's incoming data gRPC may buffer beyond the message being read "
          "(its HTTP/2 stream window, fixed instead of gRPC's own tuning, which grows it past "
          "its quota on a fast link and then cancels the call); 0 (default): a sixteenth of "
          "gRPC's quarter of --inflight-budget, between 1MiB and 8MiB");
ABSL_FLAG(int64_t, stream_idle_timeout_ms, 30000,
          "an AppendStream that sends no message for this long is ended with DEADLINE_EXCEEDED "
          "and its buffer freed, and a Read whose client takes no message for this long is "
          "cancelled and its pinned cells released; 0: never");
ABSL_FLAG(double, inflight_tenant_share, 0.5,
          "the most of kvmesh's part of --inflight-budget one tenant's requests may hold at once, "
          "as a fraction in (0, 1]: beyond it that tenant's requests fail with RESOURCE_EXHAUSTED "
          "while other tenants' still fit; 1: no share (as without --token-file, where every "
          "caller is one tenant)");
ABSL_FLAG(kvmesh::ByteSize, stream_min_rate, kvmesh::ByteSize{size_t{64} << 10},
          "the slowest an AppendStream may send, in bytes per second averaged from its first "
          "message, once it has run --stream_min_rate_grace_ms: a slower one holds in-flight "
          "budget for too little progress and is ended with RESOURCE_EXHAUSTED; 0: no minimum");
ABSL_FLAG(int64_t, stream_min_rate_grace_ms, 10000,
          "how long an AppendStream may run before --stream_min_rate applies");
ABSL_FLAG(int64_t, max_visible_positions, kvmesh::kDefaultMaxVisiblePositions,
          "most positions one Visible call may list in all; larger requests fail with "
          "RESOURCE_EXHAUSTED before any work");
ABSL_FLAG(int64_t, testing_chunk_delay_ms, 0,
          "testing only: the grpc-stream and nccl senders wait this long before each chunk "
          "(nccl: piece)");
ABSL_FLAG(int32_t, testing_corrupt_chunk, -1,
          "testing only: the grpc-stream and nccl senders flip a byte of this chunk (nccl: "
          "piece) index of every transfer, after its CRC-32C was computed");
ABSL_FLAG(kvmesh::ByteSize, event_log_bytes, kvmesh::ByteSize{size_t{64} << 20},
          "most memory the node's event log keeps (docs/api.md#watchevents): a watcher that falls "
          "further behind is ended and resumes from a listing");
ABSL_FLAG(bool, cluster_index, true,
          "follow every peer's events to answer LookupPrefix with LOOKUP_SCOPE_CLUSTER "
          "(docs/cluster.md, \"Prefix index\"); off: such lookups are FAILED_PRECONDITION");
ABSL_FLAG(int64_t, ttl_sweep_ms, 1000,
          "how often the node removes sequences idle past their TTL (SetRetention, "
          "docs/api.md#eviction), in milliseconds; 0: never");
ABSL_FLAG(int32_t, testing_token_hash_bits, 64,
          "testing only: keep this many low bits of every block hash (1 to 64), so that tests "
          "can force hash collisions");
ABSL_FLAG(int32_t, testing_lose_pull_replies, 0,
          "testing only: the first this many migrations into this node that commit answer "
          "UNAVAILABLE anyway, as when the reply is lost (a drain then asks again)");
ABSL_FLAG(int64_t, testing_release_lag_ms, 0,
          "testing only: an export's payload is freed this much later than its lease is "
          "released, as when gRPC finishes the Fetch stream late (Release answers after it)");
// The default is transport::kNcclChunkBytes (checked below where NCCL is built).
ABSL_FLAG(kvmesh::ByteSize, testing_nccl_chunk_bytes, kvmesh::ByteSize{uint64_t{64} << 20},
          "testing only: the nccl transport's piece size (a protocol constant: every node of "
          "the cluster must use the same), at least 4KiB");

namespace kvmesh {
namespace {

// Threads reading grpc-stream chunks that must be copied (see transfer_reads in Run).
constexpr int kTransferReadThreads = 2;
constexpr uint64_t kMinMessageBytes = 64 << 10;

int Fail(const std::string& message) {
  std::fprintf(stderr, "kvmesh-node: %s\n", message.c_str());
  return EXIT_FAILURE;
}

int Run() {
  // Payload buffers (gRPC's receive slices of 4 MiB transfer chunks, Append payloads) come and
  // go at a high rate. glibc would map each one fresh (above its dynamic mmap threshold) and
  // fault every page in again; keep them in the heap and keep freed heap memory instead.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);

  // The log first: every line from here on is in the chosen format.
  std::string name = absl::GetFlag(FLAGS_node_name);
  if (name.empty()) name = Hostname();
  if (const absl::Status s =
          ConfigureLogging(absl::GetFlag(FLAGS_log_level), absl::GetFlag(FLAGS_log_format), name);
      !s.ok()) {
    return Fail(std::string(s.message()));
  }
  const std::string backend = absl::GetFlag(FLAGS_backend);
  if (backend != "host" && backend != "cuda") {
    return Fail(absl::StrCat("--backend=", backend, " is not a backend: use host or cuda"));
  }

  const std::string listen = absl::GetFlag(FLAGS_listen);
  std::string host;
  if (!SplitHostPort(listen, &host)) {
    return Fail(absl::StrCat("--listen=", listen, " is not host:port"));
  }
  const std::string health_listen = absl::GetFlag(FLAGS_health_listen);
  std::string health_host;
  if (!health_listen.empty() && !SplitHostPort(health_listen, &health_host)) {
    return Fail(absl::StrCat("--health_listen=", health_listen, " is not host:port"));
  }
  const int64_t drain_timeout_ms = absl::GetFlag(FLAGS_drain_timeout_ms);
  if (drain_timeout_ms < 0) {
    return Fail(absl::StrCat("--drain_timeout_ms=", drain_timeout_ms, " is negative (0: none)"));
  }
  const int64_t ttl_sweep_ms = absl::GetFlag(FLAGS_ttl_sweep_ms);
  if (ttl_sweep_ms < 0 || ttl_sweep_ms > 86'400'000) {
    return Fail(absl::StrCat("--ttl_sweep_ms=", ttl_sweep_ms,
                             " is outside [0, 86400000] (0: no sweep; at most a day)"));
  }
  const std::string peer_listen = absl::GetFlag(FLAGS_peer_listen);
  std::string peer_host;
  if (!peer_listen.empty() && !SplitHostPort(peer_listen, &peer_host)) {
    return Fail(absl::StrCat("--peer_listen=", peer_listen, " is not host:port"));
  }
  // Development mode: nothing but this machine can call the node, and nothing authenticates
  // callers anyway, so the peer plane may share the client port. Anywhere else PeerService,
  // which hands out any cache's data to its caller, is served only on --peer-listen (mTLS from
  // members when TLS is on; a private network otherwise) and never beside the client API.
  NodeTlsOptions tls_options;
  tls_options.cert_file = absl::GetFlag(FLAGS_tls_cert);
  tls_options.key_file = absl::GetFlag(FLAGS_tls_key);
  tls_options.client_ca_file = absl::GetFlag(FLAGS_tls_client_ca);
  tls_options.peer_ca_file = absl::GetFlag(FLAGS_peer_ca);
  const int32_t tls_reload_s = absl::GetFlag(FLAGS_testing_tls_reload_interval_s);
  if (tls_reload_s < 1) {
    return Fail(
        absl::StrCat("--testing_tls_reload_interval_s=", tls_reload_s, " must be at least 1"));
  }
  tls_options.reload_interval_s = static_cast<unsigned>(tls_reload_s);
  absl::StatusOr<std::unique_ptr<NodeTls>> node_tls = NodeTls::Create(tls_options);
  if (!node_tls.ok()) return Fail(std::string(node_tls.status().message()));
  const bool tls = (*node_tls)->enabled();
  if (!tls && !IsLoopbackListenAddress(listen)) {
    Log(LogLevel::kWarning,
        absl::StrCat("WARNING: PLAINTEXT on --listen=", listen,
                     ", which other machines can reach: requests, cache contents and bearer "
                     "tokens cross the network unencrypted and unauthenticated. Give --tls-cert, "
                     "--tls-key and --peer-ca (docs/security.md), or listen on 127.0.0.1 for "
                     "development."));
  }
  if (!tls && !peer_listen.empty() && !IsLoopbackListenAddress(peer_listen)) {
    Log(LogLevel::kWarning,
        absl::StrCat("WARNING: PLAINTEXT peer plane on --peer-listen=", peer_listen,
                     ": anyone who can reach it can read and write caches through PeerService; "
                     "only on a private network, else give --tls-cert, --tls-key and --peer-ca "
                     "(docs/security.md)."));
  }
  const std::string token_file = absl::GetFlag(FLAGS_token_file);
  const bool development = !tls && token_file.empty() && IsLoopbackListenAddress(listen);
  const bool has_peers =
      !absl::GetFlag(FLAGS_peers).empty() || !absl::GetFlag(FLAGS_peer_dns).empty();
  if (peer_listen.empty() && !development && has_peers) {
    return Fail(absl::StrCat(
        "--peers/--peer_dns need --peer_listen here: outside development mode (plaintext, no "
        "--token_file, loopback --listen) the peer plane is served only on its own address, and "
        "--listen=",
        listen, " is not one"));
  }

  const uint64_t max_message = absl::GetFlag(FLAGS_max_message_bytes).bytes;
  if (max_message < kMinMessageBytes || max_message > static_cast<uint64_t>(INT_MAX)) {
    return Fail(absl::StrCat("--max_message_bytes=", max_message, " is out of range [",
                             kMinMessageBytes, ", ", INT_MAX, "]"));
  }
  int32_t threads = absl::GetFlag(FLAGS_executor_threads);
  if (threads < 0) return Fail(absl::StrCat("--executor_threads=", threads, " is negative"));
  if (threads == 0) {
    threads = std::max(2, static_cast<int>(std::thread::hardware_concurrency()));
  }
  const int32_t queue = absl::GetFlag(FLAGS_executor_queue);
  if (queue < 1) return Fail(absl::StrCat("--executor_queue=", queue, " must be at least 1"));
  const absl::StatusOr<InflightSizes> sizes =
      SizeInflight(absl::GetFlag(FLAGS_inflight_budget).bytes,
                   absl::GetFlag(FLAGS_stream_window).bytes, max_message);
  if (!sizes.ok()) return Fail(std::string(sizes.status().message()));
  const uint64_t grpc_quota_bytes = sizes->grpc_quota_bytes;
  const uint64_t kvmesh_inflight_bytes = sizes->kvmesh_inflight_bytes;
  const uint64_t stream_window = sizes->stream_window;
  const int64_t stream_idle_timeout_ms = absl::GetFlag(FLAGS_stream_idle_timeout_ms);
  if (stream_idle_timeout_ms < 0) {
    return Fail(absl::StrCat("--stream_idle_timeout_ms=", stream_idle_timeout_ms,
                             " is negative (0: never)"));
  }
  const double inflight_tenant_share = absl::GetFlag(FLAGS_inflight_tenant_share);
  if (!(inflight_tenant_share > 0.0 && inflight_tenant_share <= 1.0)) {
    return Fail(absl::StrCat("--inflight_tenant_share=", inflight_tenant_share,
                             " is not a fraction in (0, 1]"));
  }
  const uint64_t stream_min_rate = absl::GetFlag(FLAGS_stream_min_rate).bytes;
  const int64_t stream_min_rate_grace_ms = absl::GetFlag(FLAGS_stream_min_rate_grace_ms);
  if (stream_min_rate_grace_ms < 0) {
    return Fail(
        absl::StrCat("--stream_min_rate_grace_ms=", stream_min_rate_grace_ms, " is negative"));
  }
  const int64_t max_visible_positions = absl::GetFlag(FLAGS_max_visible_positions);
  if (max_visible_positions < 1) {
    return Fail(
        absl::StrCat("--max_visible_positions=", max_visible_positions, " must be at least 1"));
  }
  const int32_t metrics_port = absl::GetFlag(FLAGS_metrics_port);
  if (metrics_port < 0 || metrics_port > 65535) {
    return Fail(absl::StrCat("--metrics_port=", metrics_port, " is out of range [0, 65535]"));
  }
  const std::string transport_flag = absl::GetFlag(FLAGS_transport);
  if (transport_flag != "auto" && transport_flag != transport::kGrpcStream &&
      transport_flag != transport::kNccl) {
    return Fail(absl::StrCat("--transport=", transport_flag,
                             " is not a transport: use auto, grpc-stream or nccl"));
  }
  const uint64_t nccl_chunk_bytes = absl::GetFlag(FLAGS_testing_nccl_chunk_bytes).bytes;
  if (nccl_chunk_bytes < 4096 || nccl_chunk_bytes > (uint64_t{1} << 30)) {
    return Fail(absl::StrCat("--testing_nccl_chunk_bytes=", nccl_chunk_bytes,
                             " is out of range [4096, 1GiB]"));
  }
  const std::string local_socket = absl::GetFlag(FLAGS_local_socket);
  if (transport_flag == transport::kNccl && backend != "cuda") {
    return Fail(absl::StrCat("--transport=nccl needs --backend=cuda, but this node has --backend=",
                             backend, " (the nccl transport moves GPU memory)"));
  }

  // Every thread started from here on (gRPC's, the executor's) inherits this mask, so the
  // termination signals reach only the sigwait below.
  sigset_t signals;
  if (const absl::Status s = BlockTerminationSignals(&signals); !s.ok()) {
    return Fail(std::string(s.message()));
  }

  // NCCL is loaded only by a cuda node that may use it, never by a host node (docs/cuda.md);
  // after the signal mask, so that threads NCCL starts inherit it.
  bool have_nccl = false;
  if (backend == "cuda" && transport_flag != transport::kGrpcStream) {
#ifdef KVMESH_HAVE_NCCL
    absl::StatusOr<const transport::NcclApi*> nccl = transport::LoadNccl();
    if (nccl.ok()) {
      have_nccl = true;
      Log(LogLevel::kInfo,
          absl::StrCat("nccl transport: NCCL ", transport::FormatNcclVersion((*nccl)->version),
                       " from ", (*nccl)->path));
    } else if (transport_flag == transport::kNccl) {
      return Fail(absl::StrCat("--transport=nccl: ", nccl.status().message()));
    } else {
      Log(LogLevel::kWarning,
          absl::StrCat("no nccl transport, grpc-stream only: ", nccl.status().message()));
    }
#else
    if (transport_flag == transport::kNccl) {
      return Fail("--transport=nccl: this kvmesh-node was built without NCCL");
    }
#endif
  }

  const size_t memory_budget = absl::GetFlag(FLAGS_memory_budget).bytes;
  const size_t snapshot_budget = absl::GetFlag(FLAGS_snapshot_budget).bytes;
  std::unique_ptr<Device> device;
  {
    absl::StatusOr<std::unique_ptr<Device>> created = CreateNodeDevice(
        backend, absl::GetFlag(FLAGS_device), memory_budget, snapshot_budget,
        absl::GetFlag(FLAGS_kept_arena_limit).bytes, absl::GetFlag(FLAGS_prefault_memory),
        /*shareable=*/!local_socket.empty());
    if (!created.ok()) return Fail(std::string(created.status().message()));
    device = *std::move(created);
  }
  // Before the registry, whose caches publish into it.
  EventLog::Options event_options;
  event_options.max_bytes = absl::GetFlag(FLAGS_event_log_bytes).bytes;
  event_options.boot_id = ThisProcess().boot_id;
  EventLog events(event_options);
  // Declared after the device: the registry's caches hold device memory and are destroyed first.
  CacheRegistry registry(device.get(), absl::GetFlag(FLAGS_testing_token_hash_bits), &events);
  Executor executor(threads, static_cast<size_t>(queue));
  // Before everything that counts into it; its endpoint starts once the node listens.
  Metrics metrics;

  // ---- cluster ------------------------------------------------------------------------------
  const int64_t lease_ms = absl::GetFlag(FLAGS_lease_ms);
  const int64_t transfer_timeout_ms = absl::GetFlag(FLAGS_transfer_timeout_ms);
  const int32_t cluster_threads = absl::GetFlag(FLAGS_cluster_threads);
  if (lease_ms <= 0 || transfer_timeout_ms <= 0 || cluster_threads < 1) {
    executor.Shutdown();
    return Fail(absl::StrCat("--lease_ms=", lease_ms,
                             ", --transfer_timeout_ms=", transfer_timeout_ms,
                             " and --cluster_threads=", cluster_threads, " must all be positive"));
  }
  const std::string backend_name = device->name();
  std::vector<std::string> transports = {transport::kGrpcStream};
  if (have_nccl) transports.push_back(transport::kNccl);
  Membership::Options membership_options;
  membership_options.self_name = name;
  membership_options.self_address = peer_listen.empty() ? listen : peer_listen;
  membership_options.backend = backend_name;
  membership_options.transports = transports;
  membership_options.max_message_bytes = static_cast<int>(max_message);
  membership_options.peer_dns = absl::GetFlag(FLAGS_peer_dns);
  if (tls) {
    const NodeTls* const credentials = node_tls->get();
    membership_options.channel_credentials = [credentials](const MemberAddress& member) {
      return credentials->PeerChannelCredentials(member.name);
    };
  }
  absl::StatusOr<std::vector<MemberAddress>> peers =
      Membership::ParsePeers(absl::GetFlag(FLAGS_peers));
  if (!peers.ok()) {
    executor.Shutdown();
    return Fail(absl::StrCat("--peers: ", peers.status().message()));
  }
  membership_options.peers = *std::move(peers);
  absl::StatusOr<std::unique_ptr<Membership>> membership =
      Membership::Create(std::move(membership_options));
  if (!membership.ok()) {
    executor.Shutdown();
    return Fail(std::string(membership.status().message()));
  }
  const int64_t max_lease_ms = absl::GetFlag(FLAGS_max_lease_ms);
  const int32_t max_leases_per_receiver = absl::GetFlag(FLAGS_max_leases_per_receiver);
  if (max_lease_ms < lease_ms || max_leases_per_receiver < 1) {
    executor.Shutdown();
    return Fail(
        absl::StrCat("--max_lease_ms=", max_lease_ms, " must be at least --lease_ms=", lease_ms,
                     ", and --max_leases_per_receiver=", max_leases_per_receiver, " at least 1"));
  }
  Authenticator::Options auth_options;
  auth_options.token_file = token_file;
  absl::StatusOr<std::unique_ptr<Authenticator>> auth = Authenticator::Create(auth_options);
  if (!auth.ok()) {
    executor.Shutdown();
    return Fail(absl::StrCat("--token_file: ", auth.status().message()));
  }
  if (token_file.empty()) {
    Log(LogLevel::kInfo,
        absl::StrCat("no --token_file: development mode, every caller is an admin of the one "
                     "tenant '",
                     kDefaultTenant, "' and nothing is authenticated"));
  }
  // The local data path: after the registry and the authenticator, before them at exit.
  std::unique_ptr<LocalServer> local_server;
  if (!local_socket.empty()) {
    LocalServer::Options local_options;
    local_options.path = local_socket;
    local_options.node_name = name;
    local_options.auth = auth->get();
    local_options.registry = &registry;
    local_options.max_lease = absl::Milliseconds(max_lease_ms);
    local_options.default_lease = absl::Milliseconds(lease_ms);
    absl::StatusOr<std::unique_ptr<LocalServer>> started = LocalServer::Start(local_options);
    if (!started.ok()) {
      executor.Shutdown();
      return Fail(std::string(started.status().message()));
    }
    local_server = *std::move(started);
  }
  LeaseTable leases(absl::Milliseconds(100), static_cast<size_t>(max_leases_per_receiver));
  leases.set_testing_release_lag(absl::Milliseconds(absl::GetFlag(FLAGS_testing_release_lag_ms)));
  Reservations reservations;
  // A sequence under migration is neither evicted nor expired: the migration would lose it.
  registry.SetEvictionFilterFactory(
      [&reservations](const std::string& tenant, const std::string& name) {
        return [&reservations, key = Reservations::Key(tenant, name)](int64_t seq) {
          return !reservations.IsReserved(Reservations::Kind::kSequence, key, seq);
        };
      });
  transport::GrpcStreamTransport::Options stream_options;
  stream_options.max_receive_message = static_cast<int32_t>(max_message);
  Membership* const members = membership->get();
  // What the other members hold, by block hash (a watcher per peer; stopped before the
  // membership goes).
  std::unique_ptr<ClusterIndex> cluster_index;
  if (absl::GetFlag(FLAGS_cluster_index)) {
    ClusterIndex::Options index_options;
    index_options.membership = members;
    cluster_index = std::make_unique<ClusterIndex>(index_options);
  }
  transport::GrpcStreamTransport grpc_stream(
      [members](const std::string& address) {
        return members->Channel(MemberAddress{address, address});
      },
      stream_options);
  std::map<std::string, transport::Transport*> cluster_transports = {
      {transport::kGrpcStream, &grpc_stream}};
  PeerServiceImpl::NcclHooks nccl_hooks;
#ifdef KVMESH_HAVE_NCCL
  // Declared after the device: its communicators are closed before the device goes.
  std::unique_ptr<transport::NcclTransport> nccl_transport;
  std::unique_ptr<transport::NcclPeerSide> nccl_peer_side;
  if (have_nccl) {
    transport::NcclTransport::Options nccl_options;
    nccl_options.self_name = name;
    nccl_options.device = absl::GetFlag(FLAGS_device);
    nccl_options.channels = [members](const std::string& address) {
      return members->Channel(MemberAddress{address, address});
    };
    nccl_options.chunk_bytes = nccl_chunk_bytes;
    nccl_options.piece_delay = absl::Milliseconds(absl::GetFlag(FLAGS_testing_chunk_delay_ms));
    nccl_options.corrupt_piece = absl::GetFlag(FLAGS_testing_corrupt_chunk);
    nccl_transport = std::make_unique<transport::NcclTransport>(std::move(nccl_options));
    nccl_peer_side = std::make_unique<transport::NcclPeerSide>(nccl_transport.get());
    cluster_transports[transport::kNccl] = nccl_transport.get();
    transport::NcclPeerSide* const side = nccl_peer_side.get();
    nccl_hooks.connect = [side](const v1::NcclConnectRequest& request, absl::Time deadline,
                                const PeerServiceImpl::Interrupt& interrupt) {
      return side->Connect(request, deadline, interrupt);
    };
    nccl_hooks.send = [side, &leases](const v1::NcclSendRequest& request, absl::Time deadline,
                                      const PeerServiceImpl::Interrupt& interrupt) {
      return side->Send(request, &leases, deadline, interrupt);
    };
  }
#endif
  Cluster::Options cluster_options;
  cluster_options.self_name = name;
  cluster_options.backend = backend_name;
  cluster_options.lease_time = absl::Milliseconds(lease_ms);
  cluster_options.requested_lease_time = absl::Milliseconds(lease_ms);
  cluster_options.max_lease_time = absl::Milliseconds(max_lease_ms);
  cluster_options.transfer_timeout = absl::Milliseconds(transfer_timeout_ms);
  cluster_options.transport = transport_flag;
  cluster_options.testing_lose_pull_replies = absl::GetFlag(FLAGS_testing_lose_pull_replies);
  cluster_options.metrics = &metrics;
  cluster_options.events = &events;
  // Whether the node takes new caches and sequences; readiness follows it (the listener is set
  // once the servers run).
  DrainGate gate(name);
  cluster_options.gate = &gate;
  const Authenticator* const authenticator = auth->get();
  cluster_options.quota = [authenticator](const std::string& tenant) {
    return authenticator->Quota(tenant);
  };
  Cluster cluster(cluster_options, &registry, members, &leases, &reservations, cluster_transports);
  Drainer::Options drainer_options;
  drainer_options.self_name = name;
  drainer_options.log = [](const std::string& line) { Log(LogLevel::kInfo, line); };
  drainer_options.metrics = &metrics;
  Drainer drainer(drainer_options, &registry, members, &cluster, &gate);
  Executor cluster_executor(cluster_threads, static_cast<size_t>(queue));
  // The grpc-stream sender's reads of chunks that must be copied: a payload without a host view
  // (a CUDA export: each chunk is a Gather through pinned staging that waits for the device) is
  // read here, never on gRPC's callback threads. A pool of its own rather than the engine
  // executor: transfers are bulk background work, and two threads bound how many of the
  // device's staging sets they hold at once, while a migration's reads neither wait behind every
  // queued engine call nor make engine calls wait behind them. Not the cluster executor: its
  // threads block in Receive on peers' Fetch streams, so two nodes pulling from each other with
  // every cluster thread so blocked would queue the reads that feed those very streams behind
  // them, until the deadlines. A stream has at most one read queued, so the queue
  // (--executor_queue) fills only with that many streams reading at once; a refused read ends
  // its stream with UNAVAILABLE (retry later), as every call an overloaded node refuses.
  Executor transfer_reads(kTransferReadThreads, static_cast<size_t>(queue));

  // Without a token file every caller is the one tenant "default": a share would only halve
  // its budget.
  InflightBudget inflight(kvmesh_inflight_bytes, "kvmesh's three quarters of --inflight-budget",
                          token_file.empty() ? 1.0 : inflight_tenant_share);
  CacheServiceImpl::Options options;
  options.max_send_message_bytes = max_message;
  options.max_receive_message_bytes = max_message;
  options.cluster = &cluster;
  options.cluster_executor = &cluster_executor;
  options.inflight = &inflight;
  options.stream_idle_timeout = stream_idle_timeout_ms == 0
                                    ? absl::InfiniteDuration()
                                    : absl::Milliseconds(stream_idle_timeout_ms);
  options.stream_min_rate = stream_min_rate;
  options.stream_min_rate_grace = absl::Milliseconds(stream_min_rate_grace_ms);
  options.max_visible_positions = max_visible_positions;
  options.auth = auth->get();
  options.gate = &gate;
  options.drainer = &drainer;
  options.drain_timeout = absl::Milliseconds(drain_timeout_ms);
  options.events = &events;
  options.cluster_index = cluster_index.get();
  CacheServiceImpl service(&registry, &executor, options);
  PeerServiceImpl::Options peer_options;
  peer_options.name = name;
  peer_options.membership = members;
  peer_options.require_member_certificate = tls;
  peer_options.backend = backend_name;
  peer_options.transports = transports;
  peer_options.sender.max_chunk_bytes = static_cast<int>(max_message / 2);
  peer_options.sender.chunk_delay = absl::Milliseconds(absl::GetFlag(FLAGS_testing_chunk_delay_ms));
  peer_options.sender.corrupt_chunk = absl::GetFlag(FLAGS_testing_corrupt_chunk);
  peer_options.sender.run_read = [&transfer_reads, name](std::function<void()> read) {
    if (transfer_reads.Submit(std::move(read))) return absl::OkStatus();
    return absl::UnavailableError(absl::StrCat(
        "kvmesh-node ", name, " is overloaded: its transfer read queue holds ",
        transfer_reads.max_queued(), " reads already (or it is shutting down); retry later"));
  };
  peer_options.nccl = std::move(nccl_hooks);
  peer_options.registry = &registry;
  peer_options.events = &events;
  PeerServiceImpl peer_service(&cluster, &leases, &executor, &cluster_executor, peer_options);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  // Reflection describes what the generated descriptor pool holds; gRPC's health service has
  // no descriptors of its own, so the node links grpc.health.v1's (proto/grpc/health/v1).
  // Naming one keeps the linker from dropping the file's registration.
  (void)grpc::health::v1::HealthCheckRequest::descriptor();
  // Settings both servers share.
  // gRPC's own memory for calls (messages it receives before a handler sees them, its read
  // buffers) is held to its share of --inflight-budget: under pressure it shrinks flow-control
  // windows, beyond the quota it cancels streams. One quota for both servers.
  grpc::ResourceQuota grpc_quota("kvmesh-node");
  grpc_quota.Resize(static_cast<size_t>(grpc_quota_bytes));
  auto configure = [max_message, stream_window, &grpc_quota,
                    &metrics](grpc::ServerBuilder& builder) {
    ConfigureServerBuilder(builder, grpc_quota, &metrics, max_message, stream_window);
  };
  auto fail_to_listen = [&](const std::string& flag, const std::string& address) {
    cluster_executor.Shutdown();
    executor.Shutdown();
    transfer_reads.Shutdown();
    return Fail(absl::StrCat("cannot listen on --", flag, "=", address));
  };
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(listen, (*node_tls)->ClientPortServerCredentials(), &port);
  builder.RegisterService(&service);
  builder.RegisterCallbackGenericService(service.request_gate());
  const bool peer_plane_on_client_port = peer_listen.empty() && development;
  // One generic service per server: on the client port PeerService goes through CacheService's
  // gate, with its own identification of callers.
  if (peer_plane_on_client_port) peer_service.AddTo(service.request_gate());
  configure(builder);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) return fail_to_listen("listen", listen);
  // The peer plane's own server: PeerService and health (membership checks a peer's health
  // there), no CacheService and no reflection.
  std::unique_ptr<grpc::Server> peer_server;
  int peer_port = 0;
  if (!peer_listen.empty()) {
    grpc::ServerBuilder peer_builder;
    peer_builder.AddListeningPort(peer_listen, (*node_tls)->PeerPortServerCredentials(),
                                  &peer_port);
    peer_builder.RegisterCallbackGenericService(peer_service.request_gate());
    configure(peer_builder);
    peer_server = peer_builder.BuildAndStart();
    if (peer_server == nullptr || peer_port == 0) {
      server->Shutdown();
      return fail_to_listen("peer_listen", peer_listen);
    }
  } else if (!peer_plane_on_client_port) {
    Log(LogLevel::kWarning,
        "no --peer_listen: this node serves no PeerService, so no other node can copy from it "
        "or move data to it");
  }
  // The probes' server: health alone, plaintext (kubelet's gRPC probes have no TLS).
  std::unique_ptr<grpc::Server> health_server;
  int health_port = 0;
  if (!health_listen.empty()) {
    grpc::ServerBuilder health_builder;
    health_builder.AddListeningPort(health_listen, grpc::InsecureServerCredentials(), &health_port);
    health_builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    health_server = health_builder.BuildAndStart();
    if (health_server == nullptr || health_port == 0) {
      if (peer_server != nullptr) peer_server->Shutdown();
      server->Shutdown();
      return fail_to_listen("health_listen", health_listen);
    }
  }
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  grpc::HealthCheckServiceInterface* probe_health =
      health_server != nullptr ? health_server->GetHealthCheckService() : nullptr;
  // Readiness: CacheService is SERVING while the node takes work.
  Mutex readiness_mu;
  auto set_ready = [&](bool ready) {
    MutexLock lock(&readiness_mu);
    health->SetServingStatus(v1::CacheService::service_full_name(), ready);
    if (probe_health != nullptr) {
      probe_health->SetServingStatus(v1::CacheService::service_full_name(), ready);
    }
  };
  gate.set_listener([&](bool draining) {
    set_ready(!draining);
    if (draining) {
      Event event;
      event.kind = EventKind::kDraining;
      events.Publish(std::move(event));
    }
  });
  set_ready(!gate.draining());
  if (peer_plane_on_client_port) {
    health->SetServingStatus(v1::PeerService::service_full_name(), true);
  }
  grpc::HealthCheckServiceInterface* peer_health =
      peer_server != nullptr ? peer_server->GetHealthCheckService() : nullptr;
  if (peer_health != nullptr) {
    peer_health->SetServingStatus(v1::PeerService::service_full_name(), true);
  }
  members->SetSelfAddress(peer_server != nullptr ? absl::StrCat(peer_host, ":", peer_port)
                                                 : absl::StrCat(host, ":", port));

  const std::string port_file = absl::GetFlag(FLAGS_port_file);
  if (!port_file.empty() && !WritePortFile(port_file, port)) {
    if (peer_server != nullptr) peer_server->Shutdown();
    server->Shutdown();
    cluster_executor.Shutdown();
    executor.Shutdown();
    return Fail(absl::StrCat("cannot write --port_file=", port_file, ": ", std::strerror(errno)));
  }
  // /metrics, once everything it reads exists; stopped (by the cleanup) before any of it goes.
  AddNodeCollectors(&metrics, NodeState{name,
                                        backend_name,
                                        &registry,
                                        device.get(),
                                        {{"engine", &executor},
                                         {"cluster", &cluster_executor},
                                         {"transfer_reads", &transfer_reads}},
                                        &inflight,
                                        &leases,
                                        &gate,
                                        &events,
                                        &service,
                                        cluster_index.get(),
                                        local_server.get()});
  const std::string metrics_port_file = absl::GetFlag(FLAGS_metrics_port_file);
  int bound_metrics_port = 0;
  if (metrics_port > 0 || !metrics_port_file.empty()) {
    if (const absl::Status s =
            metrics.Serve(absl::StrCat(host, ":", metrics_port), &bound_metrics_port);
        !s.ok()) {
      if (peer_server != nullptr) peer_server->Shutdown();
      server->Shutdown();
      cluster_executor.Shutdown();
      executor.Shutdown();
      return Fail(absl::StrCat("--metrics_port=", metrics_port, ": ", s.message()));
    }
  }
  absl::Cleanup stop_metrics = [&metrics] { metrics.StopServing(); };
  if (!metrics_port_file.empty() && !WritePortFile(metrics_port_file, bound_metrics_port)) {
    return Fail(absl::StrCat("cannot write --metrics_port_file=", metrics_port_file, ": ",
                             std::strerror(errno)));
  }
  const std::string metrics_plane =
      bound_metrics_port != 0 ? absl::StrCat(" metrics=", host, ":", bound_metrics_port) : "";
  const std::string peer_plane =
      peer_server != nullptr ? absl::StrCat(" peer-plane=", peer_host, ":", peer_port) : "";
  const std::string health_plane =
      health_server != nullptr ? absl::StrCat(" health=", health_host, ":", health_port) : "";
  std::printf("kvmesh-node %s listening on %s:%d backend=%s peers=%zu%s%s%s\n", name.c_str(),
              host.c_str(), port, backend.c_str(), members->Peers().size(), peer_plane.c_str(),
              health_plane.c_str(), metrics_plane.c_str());
  std::fflush(stdout);
  const ProcessInfo& process = ThisProcess();
  Log(LogLevel::kInfo, "listening",
      {{"address", absl::StrCat(host, ":", port)},
       {"peer_plane", peer_plane.empty() ? "" : peer_plane.substr(strlen(" peer-plane="))},
       {"health", health_plane.empty() ? "" : health_plane.substr(strlen(" health="))},
       {"metrics", metrics_plane.empty() ? "" : metrics_plane.substr(strlen(" metrics="))},
       {"backend", backend_name},
       {"local_socket", local_socket},
       {"peers", absl::StrCat(members->Peers().size())},
       {"version", process.version},
       {"boot_id", process.boot_id}});

  const TtlSweeper ttl_sweeper(&registry, absl::Milliseconds(ttl_sweep_ms));
  const absl::StatusOr<int> signal = WaitForTermination(signals);
  if (!signal.ok()) {
    gate.set_listener(nullptr);
    return Fail(std::string(signal.status().message()));
  }
  if (drain_timeout_ms > 0) {
    DrainForShutdown(signals, *signal, absl::Milliseconds(drain_timeout_ms), &drainer, &leases);
  }
  RunningNode running;
  running.gate = &gate;
  running.readiness_mu = &readiness_mu;
  running.health = health;
  running.probe_health = probe_health;
  running.peer_health = peer_health;
  running.service = &service;
  running.peer_service = &peer_service;
  running.cluster_index = cluster_index.get();
  running.server = &server;
  running.peer_server = &peer_server;
  running.health_server = &health_server;
  running.executors = {&cluster_executor, &executor, &transfer_reads};
  return ShutDown(running, *signal);
}

}  // namespace
}  // namespace kvmesh

int main(int argc, char** argv) {
  const kvmesh::ProcessInfo& process = kvmesh::ThisProcess();  // the start time: now
  absl::SetProgramUsageMessage(
      "one node of kvmesh: holds KV caches in memory (host or GPU) and serves "
      "kvmesh.v1.CacheService to schedulers and kvmesh.v1.PeerService to the other nodes "
      "(README.md, docs/api.md, docs/operate.md).\n\n"
      "Caches live in memory only: a node that restarts starts empty (a new boot_id in "
      "ListMembers tells a scheduler so).\n\n"
      "  kvmesh-node --listen=127.0.0.1:7700 --memory-budget=8GiB [flags]\n\n"
      "Flags take dashes or underscores (--node-name or --node_name); --version prints the "
      "version. The node's flags:");
  absl::FlagsUsageConfig usage;
  // --help and --helpshort list the node's own flags (not absl's and gRPC's: --helpfull).
  auto own = [](absl::string_view file) { return absl::EndsWith(file, "node_main.cc"); };
  usage.contains_help_flags = own;
  usage.contains_helpshort_flags = own;
  usage.normalize_filename = [](absl::string_view file) {
    const size_t at = file.rfind("service/");
    return std::string(at == absl::string_view::npos ? file : file.substr(at));
  };
  usage.version_string = [] {
    const kvmesh::ProcessInfo& p = kvmesh::ThisProcess();
    return absl::StrCat("kvmesh-node ", p.version, " (", p.build_type, " build",
                        kvmesh::CudaSimulated() ? ", simulated CUDA: a test build" : "", ")\n");
  };
  absl::SetFlagsUsageConfig(usage);
  (void)process;
  std::vector<std::string> storage;
  std::vector<char*> args = kvmesh::NormalizeFlagNames(argc, argv, &storage);
  absl::ParseCommandLine(argc, args.data());
  return kvmesh::Run();
}

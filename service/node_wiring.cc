// The definitions of node_wiring.h: kvmesh-node's own helpers, the in-flight sizing, the
// device, the servers' shared gRPC settings and the metrics collectors (moved out of
// node_main.cc unchanged).
#include "service/node_wiring.h"

#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <fstream>
#include <map>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cache/device/cuda_device.h"
#include "cache/device/host_device.h"
#include "grpc/grpc.h"
#include "service/common/log.h"
#include "service/common/process_info.h"
#include "service/rpc_observer.h"

namespace kvmesh {
namespace {

constexpr uint64_t kDefaultInflightBytes = uint64_t{1} << 30;
// gRPC needs several MiB for the buffers of a busy connection: a single client's AppendStream
// of 1 MiB messages was cancelled with a quarter of 32 MiB (8 MiB), and with 16 MiB in one of
// five tries on a loaded machine; with 32 MiB it went through every time.
constexpr uint64_t kMinInflightBytes = uint64_t{128} << 20;
// The HTTP/2 stream window (--stream_window). gRPC's own tuning sizes it from the measured
// bandwidth-delay product, at least 16 MiB: on loopback one AppendStream whose handler writes
// slower than its client sends (cells on a device) then filled gRPC's 32 MiB quota and gRPC
// cancelled it (RST_STREAM, ENHANCE_YOUR_CALM), eight tries in a row on a loaded machine.
constexpr uint64_t kMinStreamWindow = 64 << 10;
constexpr uint64_t kMinAutoStreamWindow = uint64_t{1} << 20;
constexpr uint64_t kMaxAutoStreamWindow = uint64_t{8} << 20;

// Reads /proc/self/statm: resident pages.
double ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  uint64_t size = 0, resident = 0;
  if (!(statm >> size >> resident)) return 0;
  return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE));
}

}  // namespace

bool SplitHostPort(const std::string& address, std::string* host) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0) return false;
  *host = address.substr(0, colon);
  return true;
}

std::string Hostname() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') return "kvmesh-node";
  return name;
}

bool WritePortFile(const std::string& path, int port) {
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << port << "\n";
    out.close();
    if (!out) return false;
  }
  return std::rename(tmp.c_str(), path.c_str()) == 0;
}

absl::StatusOr<InflightSizes> SizeInflight(uint64_t inflight_budget, uint64_t stream_window,
                                           uint64_t max_message) {
  uint64_t inflight_bytes = inflight_budget;
  if (inflight_bytes == 0) inflight_bytes = std::max(kDefaultInflightBytes, 4 * max_message);
  // gRPC's share of the in-flight budget, and kvmesh's (InflightBudget). gRPC cancels a call
  // whose message does not fit its share (RESOURCE_EXHAUSTED, "RST_STREAM with error code 11"),
  // so the share must hold the largest message the node accepts.
  const uint64_t grpc_quota_bytes = inflight_bytes / 4;
  const uint64_t kvmesh_inflight_bytes = inflight_bytes - grpc_quota_bytes;
  if (inflight_bytes < kMinInflightBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("--inflight_budget=", inflight_bytes, " is less than ", kMinInflightBytes,
                     " bytes: gRPC's quarter of it holds its buffers of "
                     "every connection"));
  }
  if (grpc_quota_bytes < max_message) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--inflight_budget=", inflight_bytes, " is less than 4 x --max_message_bytes=", max_message,
        ": gRPC's quarter of it must hold a whole message; raise --inflight_budget "
        "or lower --max_message_bytes"));
  }
  if (stream_window == 0) {
    stream_window =
        std::clamp<uint64_t>(grpc_quota_bytes / 16, kMinAutoStreamWindow, kMaxAutoStreamWindow);
  }
  const uint64_t max_stream_window =
      std::min<uint64_t>(grpc_quota_bytes / 4, static_cast<uint64_t>(INT_MAX));
  if (stream_window < kMinStreamWindow || stream_window > max_stream_window) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--stream_window=", stream_window, " is out of range [", kMinStreamWindow, ", ",
        max_stream_window, "] (at most a quarter of gRPC's quarter of --inflight_budget)"));
  }
  return InflightSizes{grpc_quota_bytes, kvmesh_inflight_bytes, stream_window};
}

absl::StatusOr<std::unique_ptr<Device>> CreateNodeDevice(const std::string& backend, int ordinal,
                                                         size_t memory_budget,
                                                         size_t snapshot_budget,
                                                         size_t kept_arena_limit,
                                                         bool prefault_memory, bool shareable) {
  std::unique_ptr<Device> device;
  if (backend == "cuda") {
    CudaDeviceOptions options;
    options.ordinal = ordinal;
    options.budget_bytes = memory_budget;
    options.snapshot_budget_bytes = snapshot_budget;
    options.shareable = shareable;  // GPU memory that workers import (--local-socket)
    absl::StatusOr<std::unique_ptr<Device>> cuda = CreateCudaDevice(options);
    if (!cuda.ok()) {
      return absl::Status(
          cuda.status().code(),
          absl::StrCat("--backend=cuda --device=", options.ordinal, ": ", cuda.status().message()));
    }
    device = *std::move(cuda);
    if (CudaSimulated()) {
      // A test build (-DKVMESH_CUDA=SIM): say so loudly, and the device name says it too.
      Log(LogLevel::kWarning,
          absl::StrCat("WARNING: ", device->name(),
                       " is the SIMULATED GPU of a -DKVMESH_CUDA=SIM test build: caches live in "
                       "host memory, kernels run on the CPU. Not for production; build with "
                       "-DKVMESH_CUDA=ON for a GPU."));
    }
  } else {
    device = std::make_unique<HostDevice>(memory_budget, snapshot_budget, kept_arena_limit,
                                          prefault_memory, shareable);
  }
  return device;
}

void ConfigureServerBuilder(grpc::ServerBuilder& builder, const grpc::ResourceQuota& grpc_quota,
                            Metrics* metrics, uint64_t max_message, uint64_t stream_window) {
  builder.SetResourceQuota(grpc_quota);
  // A fixed stream window (--stream_window): without BDP probing gRPC keeps the one given.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES,
                             static_cast<int>(stream_window));
  // Every call counted, timed and logged (service/rpc_observer.h).
  builder.experimental().SetInterceptorCreators(RpcObserverCreators(metrics));
  builder.SetMaxReceiveMessageSize(static_cast<int>(max_message));
  builder.SetMaxSendMessageSize(static_cast<int>(max_message));
  // gRPC sets SO_REUSEPORT by default: a second node on the same port would start and share
  // the traffic instead of failing.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
}

void AddNodeCollectors(Metrics* metrics, NodeState state) {
  metrics->AddCollector([state](ScrapeSink& sink) {
    const ProcessInfo& process = ThisProcess();
    sink.Gauge("kvmesh_build_info", "Always 1: the node's version, build and boot id");
    sink.Add({{"version", process.version},
              {"build_type", process.build_type},
              {"backend", state.backend},
              {"node", state.name},
              {"boot_id", process.boot_id}},
             1);
    sink.Gauge("kvmesh_start_time_seconds",
               "When this process started, Unix seconds (a restarted node holds nothing)");
    sink.Add({}, absl::ToDoubleSeconds(process.start_time - absl::UnixEpoch()));
    sink.Gauge("process_resident_memory_bytes", "Resident memory of the node process");
    sink.Add({}, ResidentBytes());

    sink.Gauge("kvmesh_executor_queue_depth", "Tasks waiting for a worker, by executor");
    for (const auto& [name, executor] : state.executors) {
      sink.Add({{"executor", name}}, static_cast<double>(executor->queued()));
    }
    sink.Counter("kvmesh_executor_rejections_total",
                 "Tasks an executor refused because its queue was full (the RPC got UNAVAILABLE)");
    for (const auto& [name, executor] : state.executors) {
      sink.Add({{"executor", name}}, static_cast<double>(executor->rejected()));
    }
    sink.Gauge("kvmesh_inflight_budget_bytes",
               "Host memory kvmesh may hold for requests in flight (its share of "
               "--inflight-budget)");
    sink.Add({}, static_cast<double>(state.inflight->capacity()));
    sink.Gauge("kvmesh_inflight_held_bytes", "Host memory held for requests in flight now");
    sink.Add({}, static_cast<double>(state.inflight->held()));
    sink.Counter("kvmesh_inflight_refusals_total",
                 "Requests refused with RESOURCE_EXHAUSTED for want of in-flight budget");
    sink.Add({}, static_cast<double>(state.inflight->refused()));

    const std::vector<CacheRegistry::Entry> caches = state.registry->ListAll();
    sink.Gauge("kvmesh_caches", "Caches on this node, all tenants");
    sink.Add({}, static_cast<double>(caches.size()));
    struct PerCache {
      std::map<std::string, std::string> labels;
      CacheUsage usage;
      std::vector<int64_t> shared;
      TokenIndexStats index;
      Cache::EvictionCounts evictions;
    };
    std::vector<PerCache> per_cache;
    per_cache.reserve(caches.size());
    for (const CacheRegistry::Entry& entry : caches) {
      per_cache.push_back({{{"tenant", entry.tenant}, {"cache", entry.cache->spec().name}},
                           entry.cache->Usage(),
                           entry.cache->SharedCells(),
                           entry.cache->TokenIndex(),
                           entry.cache->Evictions()});
    }
    auto per_group = [&](const char* name, const char* help, auto value) {
      sink.Gauge(name, help);
      for (const PerCache& c : per_cache) {
        for (size_t g = 0; g < c.usage.groups.size(); ++g) {
          std::map<std::string, std::string> labels = c.labels;
          labels.emplace("group", absl::StrCat(g));
          sink.Add(labels, static_cast<double>(value(c, g)));
        }
      }
    };
    per_group("kvmesh_cache_cells",
              "Capacity of a cache's layer group in cells (rotating: ring rows; recurrent: "
              "state slots)",
              [](const PerCache& c, size_t g) { return c.usage.groups[g].cells_total; });
    per_group("kvmesh_cache_cells_used", "Cells that at least one sequence references",
              [](const PerCache& c, size_t g) { return c.usage.groups[g].cells_used; });
    per_group("kvmesh_cache_cells_reserved",
              "Free cells held back for room reservations (Reserve) of sequences",
              [](const PerCache& c, size_t g) { return c.usage.groups[g].cells_reserved; });
    per_group(
        "kvmesh_cache_cells_shared",
        "Cells that more than one sequence references (prefixes shared by CopyPrefix)",
        [](const PerCache& c, size_t g) { return g < c.shared.size() ? c.shared[g] : int64_t{0}; });
    auto per_cache_gauge = [&](const char* name, const char* help, auto value) {
      sink.Gauge(name, help);
      for (const PerCache& c : per_cache) sink.Add(c.labels, static_cast<double>(value(c)));
    };
    sink.Counter("kvmesh_cache_evictions_total",
                 "Sequences a cache removed by itself: reason lru (room for an Append, "
                 "docs/api.md#eviction), ttl (idle past its TTL)");
    for (const PerCache& c : per_cache) {
      for (const auto& [reason, count] :
           {std::pair<const char*, int64_t>{"lru", c.evictions.lru}, {"ttl", c.evictions.ttl}}) {
        std::map<std::string, std::string> labels = c.labels;
        labels.emplace("reason", reason);
        sink.Add(labels, static_cast<double>(count));
      }
    }
    per_cache_gauge("kvmesh_cache_sequences", "Sequences that store something",
                    [](const PerCache& c) { return c.usage.sequences_live; });
    per_cache_gauge("kvmesh_cache_bytes",
                    "Device memory a cache holds: its group arenas and pending speculative data",
                    [](const PerCache& c) { return c.usage.bytes_held; });
    per_cache_gauge("kvmesh_token_blocks",
                    "Distinct block hashes of a cache's token chains (its prefix index)",
                    [](const PerCache& c) { return c.index.hashes; });
    per_cache_gauge("kvmesh_token_index_bytes", "Host memory of a cache's prefix index",
                    [](const PerCache& c) { return c.index.bytes; });
    sink.Counter("kvmesh_events_total", "Events the node published (docs/api.md#watchevents)");
    sink.Add({}, static_cast<double>(state.events->next_number() - 1));
    sink.Counter("kvmesh_events_dropped_total",
                 "Events the event log dropped for its bound (--event-log-bytes)");
    sink.Add({}, static_cast<double>(state.events->dropped()));
    sink.Gauge("kvmesh_event_watchers", "WatchEvents streams being served");
    sink.Add({}, static_cast<double>(state.service->watchers()));
    // The index of the other members' blocks (docs/cluster.md, "Prefix index").
    const std::vector<ClusterIndex::PeerState> indexed =
        state.cluster_index != nullptr ? state.cluster_index->Peers()
                                       : std::vector<ClusterIndex::PeerState>();
    sink.Gauge("kvmesh_cluster_index_synced",
               "1 when this node's index holds a peer's blocks (its listing is complete), 0 "
               "while it lists them or cannot reach the peer");
    for (const ClusterIndex::PeerState& p : indexed) sink.Add({{"peer", p.node}}, p.synced);
    sink.Gauge("kvmesh_cluster_index_blocks",
               "Block hashes of a peer's sequences in this node's index of the cluster");
    for (const ClusterIndex::PeerState& p : indexed) {
      sink.Add({{"peer", p.node}}, static_cast<double>(p.blocks));
    }
    sink.Counter("kvmesh_cluster_index_resyncs_total",
                 "Event streams of a peer that ended and were started again (each drops the "
                 "peer's entries and lists them anew)");
    for (const ClusterIndex::PeerState& p : indexed) {
      sink.Add({{"peer", p.node}}, static_cast<double>(p.resyncs));
    }
    // The local data path (docs/api.md#local-data-path); absent without --local-socket.
    if (const LocalServer* local = state.local_server; local != nullptr) {
      sink.Gauge("kvmesh_local_sessions", "Worker sessions open on --local-socket");
      sink.Add({}, static_cast<double>(local->sessions()));
      sink.Gauge("kvmesh_local_pins", "Pins of cells the local sessions hold");
      sink.Add({}, static_cast<double>(local->pins()));
      sink.Gauge("kvmesh_local_plans", "Append plans (cells written in place) not yet committed");
      sink.Add({}, static_cast<double>(local->plans()));
      sink.Counter("kvmesh_local_sessions_total", "Worker sessions accepted");
      sink.Add({}, static_cast<double>(local->sessions_total()));
      sink.Counter("kvmesh_local_commits_total", "Appends written in place and committed");
      sink.Add({}, static_cast<double>(local->commits()));
      sink.Counter("kvmesh_local_refusals_total",
                   "Local requests answered with an error, and sessions refused at the bound");
      sink.Add({}, static_cast<double>(local->refusals()));
    }
    per_cache_gauge("kvmesh_snapshots", "Snapshots of a cache",
                    [](const PerCache& c) { return c.usage.snapshots; });
    per_cache_gauge("kvmesh_snapshot_bytes", "Snapshot pool memory a cache's snapshots hold",
                    [](const PerCache& c) { return c.usage.snapshot_bytes; });

    sink.Gauge("kvmesh_device_memory_used_bytes",
               "Device memory allocated, by pool (cache: caches; snapshot: snapshots, exports)");
    sink.Add({{"pool", "cache"}},
             static_cast<double>(state.device->used_bytes(MemoryPool::kCache)));
    sink.Add({{"pool", "snapshot"}},
             static_cast<double>(state.device->used_bytes(MemoryPool::kSnapshot)));
    sink.Gauge("kvmesh_device_memory_budget_bytes",
               "Device memory budget by pool (--memory-budget, --snapshot-budget)");
    sink.Add({{"pool", "cache"}},
             static_cast<double>(state.device->budget_bytes(MemoryPool::kCache)));
    sink.Add({{"pool", "snapshot"}},
             static_cast<double>(state.device->budget_bytes(MemoryPool::kSnapshot)));
    sink.Gauge("kvmesh_device_kept_arena_bytes",
               "Freed arenas kept mapped for reuse (resident, in no budget; --kept-arena-limit)");
    sink.Add({}, static_cast<double>(state.device->kept_bytes()));
    sink.Gauge("kvmesh_device_kept_arena_limit_bytes", "The most kept for reuse");
    sink.Add({}, static_cast<double>(state.device->kept_limit_bytes()));

    sink.Gauge("kvmesh_export_leases", "Export leases other nodes hold on this node");
    sink.Add({}, static_cast<double>(state.leases->size()));
    sink.Gauge("kvmesh_export_leased_bytes", "Payload bytes the export leases pin");
    sink.Add({}, static_cast<double>(state.leases->leased_bytes()));
    sink.Counter("kvmesh_export_leases_expired_total",
                 "Export leases that expired unreleased (a receiver that failed or vanished)");
    sink.Add({}, static_cast<double>(state.leases->expired()));
    sink.Gauge("kvmesh_draining", "1 while the node drains (takes no new caches or sequences)");
    sink.Add({}, state.gate->draining() ? 1 : 0);
  });
}

}  // namespace kvmesh

// What a cache's bookkeeping costs in host memory, and whether a node gives it back.
//
//   metadata_bench [--sequences=N (1048576)] [--runs=N (3)] [--engine-only] [--node-only]
//                  [--node-flag=FLAG]...   (FLAG passed on to kvmesh-node)
//
// Engine: for a few cache shapes, the heap bytes (glibc's mallinfo2, in use) that N live
// sequences of one position each take in a Cache, per sequence, against what CacheMetadataBytes
// charges for them (cache/spec.h): the figures the charge is derived from.
//
// Node (--runs times, a fresh kvmesh-node each): the node's VmRSS after start-up; after
// CreateCache of a cache of N sequences of one position (one Attention group, 1 layer x 1 head
// x 4 dims, f16); after filling it (Appends of 65,536 new sequences each); at the peak while a
// client lists every sequence a page of 4,096 at a time (and how long that takes); at the peak
// of one ListSequences with no page_size; what a second CreateCache of the same shape answers
// (the default metadata budget); and after DeleteCache. Prints each run and the medians.
#include <malloc.h>
#include <sys/types.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cache/cache.h"
#include "cache/cache_registry.h"
#include "cache/device/host_device.h"
#include "cache/spec.h"
#include "grpcpp/client_context.h"
#include "kvmesh/v1/kvmesh.grpc.pb.h"
#include "tests/testing/node_process.h"

namespace kvmesh {
namespace {

using Clock = std::chrono::steady_clock;
constexpr double kMiB = 1024.0 * 1024.0;
constexpr int32_t kBatch = 65536;

struct Flags {
  int64_t sequences = int64_t{1} << 20;
  int runs = 3;
  bool engine = true;
  bool node = true;
  std::vector<std::string> node_flags;
};

Flags ParseFlags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    int64_t v = 0;
    if (absl::ConsumePrefix(&arg, "--sequences=") && absl::SimpleAtoi(arg, &v) && v > 0 &&
        v <= kMaxSequences) {
      f.sequences = v;
    } else if (absl::ConsumePrefix(&arg, "--runs=") && absl::SimpleAtoi(arg, &v) && v > 0) {
      f.runs = static_cast<int>(v);
    } else if (arg == "--engine-only") {
      f.node = false;
    } else if (arg == "--node-only") {
      f.engine = false;
    } else if (absl::ConsumePrefix(&arg, "--node-flag=")) {
      f.node_flags.emplace_back(arg);
    } else {
      std::fprintf(stderr,
                   "usage: metadata_bench [--sequences=N] [--runs=N] [--engine-only] "
                   "[--node-only] [--node-flag=FLAG]...\n");
      std::exit(2);
    }
  }
  return f;
}

void Check(const absl::Status& status, const char* what) {
  if (status.ok()) return;
  std::fprintf(stderr, "metadata_bench: %s: %s\n", what, status.ToString().c_str());
  std::exit(1);
}

void CheckRpc(const grpc::Status& status, const char* what) {
  if (status.ok()) return;
  std::fprintf(stderr, "metadata_bench: %s: %d %s\n", what, static_cast<int>(status.error_code()),
               status.error_message().c_str());
  std::exit(1);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// ---- engine -------------------------------------------------------------------------------

GroupSpec AttentionGroup() {
  GroupSpec g;
  g.num_layers = 1;
  g.kind = GroupKind::kAttention;
  g.attention.num_kv_heads = 1;
  g.attention.head_dim_k = 4;
  g.attention.head_dim_v = 4;
  return g;
}

GroupSpec RecurrentGroup() {
  GroupSpec g;
  g.num_layers = 1;
  g.kind = GroupKind::kRecurrent;
  g.recurrent.conv_tail = 1;
  g.recurrent.conv_dim = 4;
  return g;
}

CacheSpec TinySpec(const std::string& name, int64_t sequences, std::vector<GroupSpec> groups) {
  CacheSpec spec;
  spec.name = name;
  spec.dtype = DType::kF16;
  spec.max_sequences = static_cast<int32_t>(sequences);
  spec.capacity = 1;
  spec.max_batch = kBatch;
  spec.groups = std::move(groups);
  return spec;
}

size_t HeapInUse() {
  const struct mallinfo2 info = mallinfo2();
  return info.uordblks + info.hblkhd;
}

// Heap bytes per sequence of `n` one-position sequences in a cache of `spec` (token ids: each
// token carries one, so that every sequence has a token chain).
void EngineShape(const char* what, const CacheSpec& spec, int64_t n, bool token_ids) {
  HostDevice device(size_t{8} << 30);
  CacheRegistry registry(&device);
  registry.SetMetadataBudget(uint64_t{1} << 40);
  const size_t before = HeapInUse();
  absl::StatusOr<CacheRegistry::CreateResult> created = registry.Create(spec);
  Check(created.status(), "Create");
  const size_t created_heap = HeapInUse();
  Cache& cache = *created->cache;
  std::vector<Token> tokens;
  for (int64_t first = 0; first < n; first += kBatch) {
    tokens.clear();
    for (int64_t seq = first; seq < std::min<int64_t>(n, first + kBatch); ++seq) {
      tokens.push_back(Token{seq, 0, token_ids ? static_cast<int32_t>(seq % 50000) : kNoTokenId});
    }
    const std::vector<uint8_t> payload(AppendPayloadBytes(spec, static_cast<int64_t>(tokens.size()),
                                                          static_cast<int64_t>(tokens.size())),
                                       1);
    Check(cache.Append(tokens, payload), "Append");
  }
  const size_t filled = HeapInUse();
  const double per_sequence = static_cast<double>(filled - created_heap) / static_cast<double>(n);
  const double per_cell_part = static_cast<double>(created_heap - before);
  const uint64_t charged = CacheMetadataBytes(spec);
  const double charged_per_sequence = static_cast<double>(
      kSequenceMetadataBytes + kGroupSequenceMetadataBytes * spec.groups.size());
  std::printf("%-34s %9.1f %9.1f %12.1f %12.1f %8.2f\n", what, per_sequence, charged_per_sequence,
              per_cell_part / kMiB, static_cast<double>(filled - before) / kMiB,
              static_cast<double>(filled - before) / static_cast<double>(charged));
  created->cache.reset();
  Check(registry.Delete(spec.name), "Delete");
}

void RunEngine(int64_t n) {
  std::printf("engine: %lld sequences of one position each, heap in use (mallinfo2)\n",
              static_cast<long long>(n));
  std::printf("%-34s %9s %9s %12s %12s %8s\n", "shape", "B/seq", "charged", "create MiB",
              "total MiB", "of charge");
  EngineShape("attention", TinySpec("a", n, {AttentionGroup()}), n, false);
  EngineShape("attention, token ids", TinySpec("b", n, {AttentionGroup()}), n, true);
  EngineShape("attention + recurrent", TinySpec("c", n, {AttentionGroup(), RecurrentGroup()}), n,
              false);
  EngineShape("attention + recurrent, token ids",
              TinySpec("d", n, {AttentionGroup(), RecurrentGroup()}), n, true);
  EngineShape("2 attention + recurrent, token ids",
              TinySpec("e", n, {AttentionGroup(), AttentionGroup(), RecurrentGroup()}), n, true);
}

// ---- node ---------------------------------------------------------------------------------

uint64_t RssBytes(pid_t pid) { return testutil::ProcessStatusBytes(pid, "VmRSS"); }

// The peak VmRSS of `pid` while it lives, sampled every 5 ms.
class PeakRss {
 public:
  explicit PeakRss(pid_t pid) : pid_(pid), peak_(RssBytes(pid)) {
    thread_ = std::thread([this] {
      while (!stop_.load()) {
        peak_.store(std::max(peak_.load(), RssBytes(pid_)));
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    });
  }
  double StopMiB() {
    stop_.store(true);
    thread_.join();
    return static_cast<double>(std::max(peak_.load(), RssBytes(pid_))) / kMiB;
  }

 private:
  const pid_t pid_;
  std::atomic<uint64_t> peak_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

v1::CacheSpec NodeSpec(const std::string& name, int64_t sequences) {
  v1::CacheSpec spec;
  spec.set_name(name);
  spec.set_dtype(v1::DTYPE_F16);
  spec.set_max_sequences(static_cast<int32_t>(sequences));
  spec.set_capacity(1);
  spec.set_max_batch(kBatch);
  v1::LayerGroup* g = spec.add_groups();
  g->set_num_layers(1);
  g->mutable_attention()->set_num_kv_heads(1);
  g->mutable_attention()->set_head_dim_k(4);
  g->mutable_attention()->set_head_dim_v(4);
  return spec;
}

struct NodeRun {
  double start = 0, created = 0, filled = 0, list_all_peak = 0, list_all_s = 0, one_call_peak = 0,
         deleted = 0, settled = 0;
  int64_t listed = 0, pages = 0, one_call_listed = 0;
  std::string second_create;
};

NodeRun RunNode(int64_t n, const std::vector<std::string>& node_flags) {
  testutil::NodeProcess::Options options;
  options.node_name = "metadata-bench";
  options.extra_args = {"--memory-budget=1GiB"};
  options.extra_args.insert(options.extra_args.end(), node_flags.begin(), node_flags.end());
  absl::StatusOr<std::unique_ptr<testutil::NodeProcess>> started =
      testutil::NodeProcess::Start(options);
  Check(started.status(), "start kvmesh-node");
  testutil::NodeProcess& node = **started;
  std::unique_ptr<v1::CacheService::Stub> stub = node.NewStub();
  const pid_t pid = node.pid();
  auto context = [] {
    auto c = std::make_unique<grpc::ClientContext>();
    c->set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(5));
    return c;
  };
  NodeRun run;
  absl::SleepFor(absl::Milliseconds(500));
  run.start = static_cast<double>(RssBytes(pid)) / kMiB;
  {
    v1::CreateCacheRequest request;
    *request.mutable_spec() = NodeSpec("tiny", n);
    v1::CreateCacheResponse response;
    CheckRpc(stub->CreateCache(context().get(), request, &response), "CreateCache");
  }
  run.created = static_cast<double>(RssBytes(pid)) / kMiB;
  for (int64_t first = 0; first < n; first += kBatch) {
    v1::AppendRequest request;
    request.set_cache("tiny");
    const int64_t end = std::min<int64_t>(n, first + kBatch);
    for (int64_t seq = first; seq < end; ++seq) {
      v1::TokenRange* range = request.add_token_ranges();
      range->set_seq(seq);
      range->set_first(0);
      range->set_count(1);
    }
    request.set_payload(std::string(static_cast<size_t>(end - first) * 16, '\1'));
    v1::AppendResponse response;
    CheckRpc(stub->Append(context().get(), request, &response), "Append");
  }
  run.filled = static_cast<double>(RssBytes(pid)) / kMiB;
  {
    PeakRss peak(pid);
    const auto start = Clock::now();
    v1::ListSequencesRequest request;
    request.set_cache("tiny");
    request.set_page_size(4096);
    for (;;) {
      v1::ListSequencesResponse response;
      CheckRpc(stub->ListSequences(context().get(), request, &response), "ListSequences");
      run.listed += response.sequences_size();
      ++run.pages;
      if (response.next_page_token().empty()) break;
      request.set_page_token(response.next_page_token());
    }
    run.list_all_s = std::chrono::duration<double>(Clock::now() - start).count();
    run.list_all_peak = peak.StopMiB();
  }
  {
    PeakRss peak(pid);
    v1::ListSequencesRequest request;
    request.set_cache("tiny");
    v1::ListSequencesResponse response;
    CheckRpc(stub->ListSequences(context().get(), request, &response), "ListSequences");
    run.one_call_listed = response.sequences_size();
    run.one_call_peak = peak.StopMiB();
  }
  {
    v1::CreateCacheRequest request;
    *request.mutable_spec() = NodeSpec("tiny2", n);
    v1::CreateCacheResponse response;
    const grpc::Status status = stub->CreateCache(context().get(), request, &response);
    run.second_create =
        status.ok() ? "OK" : absl::StrCat(status.error_code(), " ", status.error_message());
    if (status.ok()) {
      v1::DeleteCacheRequest del;
      del.set_cache("tiny2");
      v1::DeleteCacheResponse deleted;
      CheckRpc(stub->DeleteCache(context().get(), del, &deleted), "DeleteCache");
    }
  }
  {
    v1::DeleteCacheRequest request;
    request.set_cache("tiny");
    v1::DeleteCacheResponse response;
    CheckRpc(stub->DeleteCache(context().get(), request, &response), "DeleteCache");
  }
  run.deleted = static_cast<double>(RssBytes(pid)) / kMiB;
  absl::SleepFor(absl::Seconds(2));
  run.settled = static_cast<double>(RssBytes(pid)) / kMiB;
  return run;
}

void RunNodes(int64_t n, int runs, const std::vector<std::string>& node_flags) {
  std::printf("\nnode: a cache of %lld one-position sequences, node VmRSS in MiB\n",
              static_cast<long long>(n));
  std::printf("%-4s %7s %8s %8s %10s %8s %9s %9s %8s\n", "run", "start", "created", "filled",
              "list-all", "list s", "one call", "deleted", "+2 s");
  std::vector<NodeRun> all;
  for (int r = 0; r < runs; ++r) {
    all.push_back(RunNode(n, node_flags));
    const NodeRun& x = all.back();
    std::printf("%-4d %7.1f %8.1f %8.1f %10.1f %8.2f %9.1f %9.1f %8.1f\n", r + 1, x.start,
                x.created, x.filled, x.list_all_peak, x.list_all_s, x.one_call_peak, x.deleted,
                x.settled);
    std::printf("     listed %lld in %lld pages; one call without page_size listed %lld\n",
                static_cast<long long>(x.listed), static_cast<long long>(x.pages),
                static_cast<long long>(x.one_call_listed));
    std::printf("     a second cache of the same shape: %s\n", x.second_create.c_str());
    std::fflush(stdout);
  }
  auto median = [&](double NodeRun::*field) {
    std::vector<double> v;
    for (const NodeRun& x : all) v.push_back(x.*field);
    return Median(v);
  };
  std::printf("%-4s %7.1f %8.1f %8.1f %10.1f %8.2f %9.1f %9.1f %8.1f\n", "med",
              median(&NodeRun::start), median(&NodeRun::created), median(&NodeRun::filled),
              median(&NodeRun::list_all_peak), median(&NodeRun::list_all_s),
              median(&NodeRun::one_call_peak), median(&NodeRun::deleted),
              median(&NodeRun::settled));
}

}  // namespace
}  // namespace kvmesh

int main(int argc, char** argv) {
  const kvmesh::Flags flags = kvmesh::ParseFlags(argc, argv);
  if (flags.engine) kvmesh::RunEngine(flags.sequences);
  if (flags.node) kvmesh::RunNodes(flags.sequences, flags.runs, flags.node_flags);
  return 0;
}

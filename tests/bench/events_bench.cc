// Events benchmark: how fast a node's changes reach the other members' indexes of the cluster
// (docs/cluster.md "Prefix index"), and what following them costs the node that changes.
//
//  - Starts nodes "ev-a" and "ev-b" on ports reserved up front, each naming the other in
//    --peers (each node's index watches the other), and creates the same small cache on both:
//    one Attention layer, one KV head, head dim 8, F16 (a token's K/V is 32 bytes, so the
//    metadata and the events dominate), 64 sequences of up to 1024 tokens, blocks of 16.
//  - Propagation: --reps times, appends a prompt of --tokens fresh token ids to a sequence of
//    ev-a (one unary Append), then asks ev-b, in a loop, LookupPrefix with the cluster scope
//    (unverified: the index alone) until ev-b answers with that sequence at the whole prompt's
//    blocks. Prints the time from the Append's return to that answer (p50, p90, p99, max), and
//    the round trip of one such LookupPrefix on ev-b as the reference measured in the same run.
//  - Write cost: for --duration, as many Appends as one client makes (each --tokens ids to the
//    next of the 64 sequences, which a Remove empties first), while a WatchEvents stream of the
//    bench's own counts what ev-a publishes; once with ev-b (and so ev-b's index) watching ev-a,
//    once after ev-b has stopped. Prints appends/s, tokens/s and events/s delivered to the
//    bench's watcher in each, and the ratio: the index must not slow the writer.
//
// Nodes and client share the machine's cores (2 on the reference VM).
//
//   events_bench [--reps=200] [--tokens=64] [--duration=5s] [--help]
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cache/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "kvmesh/v1/kvmesh.grpc.pb.h"
#include "service/common/convert.h"
#include "service/ctl/args.h"
#include "tests/testing/node_process.h"

namespace kvmesh {
namespace {

using Clock = std::chrono::steady_clock;
using Stub = v1::CacheService::Stub;
using testutil::NodeProcess;
using testutil::ReservePort;

constexpr absl::string_view kFlags[] = {"reps", "tokens", "duration", "help"};
constexpr int kSequences = 64;
constexpr char kCache[] = "events";

struct Options {
  int reps = 200;
  int tokens = 64;
  absl::Duration duration = absl::Seconds(5);
};

v1::CacheSpec Spec() {
  v1::CacheSpec spec;
  spec.set_name(kCache);
  spec.set_dtype(v1::DTYPE_F16);
  spec.set_max_sequences(kSequences);
  spec.set_capacity(1024);
  spec.set_max_batch(1024);
  spec.set_token_block_size(16);
  v1::LayerGroup* group = spec.add_groups();
  group->set_num_layers(1);
  v1::Attention* a = group->mutable_attention();
  a->set_num_kv_heads(1);
  a->set_head_dim_k(8);
  a->set_head_dim_v(8);
  return spec;
}

absl::Status Check(const grpc::Status& status, const char* what) {
  if (status.ok()) return absl::OkStatus();
  const absl::Status s = FromGrpcStatus(status);
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

template <typename Request, typename Response, typename Method>
absl::Status Call(Stub& stub, Method method, const Request& request, Response* response,
                  const char* what) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  return Check((stub.*method)(&context, request, response), what);
}

// Positions [0, ids.size()) of `seq` with those token ids (after emptying it), as one Append.
absl::Status AppendPrompt(Stub& stub, int64_t seq, const std::vector<int32_t>& ids) {
  v1::RemoveRequest remove;
  remove.set_cache(kCache);
  remove.set_seq(seq);
  remove.set_begin(0);
  v1::RemoveResponse removed;
  RETURN_IF_ERROR(Call(stub, &Stub::Remove, remove, &removed, "Remove"));
  v1::AppendRequest append;
  append.set_cache(kCache);
  v1::TokenRange* range = append.add_token_ranges();
  range->set_seq(seq);
  range->set_first(0);
  range->set_count(static_cast<int32_t>(ids.size()));
  range->mutable_token_ids()->Add(ids.begin(), ids.end());
  // F16, K and V of 8 each: 32 bytes a token.
  append.set_payload(std::string(ids.size() * 32, '\x01'));
  v1::AppendResponse appended;
  return Call(stub, &Stub::Append, append, &appended, "Append");
}

// The cluster-scope LookupPrefix of `ids` on `stub`: the first match's (node, seq, length).
absl::StatusOr<v1::PrefixMatch> Lookup(Stub& stub, const std::vector<int32_t>& ids) {
  v1::LookupPrefixRequest request;
  request.set_cache(kCache);
  request.mutable_tokens()->Add(ids.begin(), ids.end());
  request.set_scope(v1::LOOKUP_SCOPE_CLUSTER);
  v1::LookupPrefixResponse response;
  RETURN_IF_ERROR(Call(stub, &Stub::LookupPrefix, request, &response, "LookupPrefix"));
  return response.matches().empty() ? v1::PrefixMatch() : response.matches(0);
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())))];
}

double Micros(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

// Counts the events of ev-a's cache on a WatchEvents stream of its own until stopped.
class EventCounter {
 public:
  explicit EventCounter(NodeProcess& node) : stub_(node.NewStub()) {
    thread_ = std::thread([this] {
      v1::WatchEventsRequest request;
      request.add_caches(kCache);
      std::unique_ptr<grpc::ClientReader<v1::WatchEventsResponse>> reader =
          stub_->WatchEvents(&context_, request);
      v1::WatchEventsResponse message;
      while (reader->Read(&message)) {
        for (const v1::Event& e : message.events()) {
          if (e.number() > 0) events_.fetch_add(1);
        }
      }
      (void)reader->Finish();
    });
  }
  ~EventCounter() {
    context_.TryCancel();
    thread_.join();
  }
  uint64_t events() const { return events_.load(); }

 private:
  std::unique_ptr<Stub> stub_;
  grpc::ClientContext context_;
  std::atomic<uint64_t> events_{0};
  std::thread thread_;
};

struct WriteRun {
  int64_t appends = 0;
  double seconds = 0;
  uint64_t events = 0;
};

absl::StatusOr<WriteRun> Write(Stub& stub, NodeProcess& node, const Options& o, int32_t* next_id) {
  EventCounter counter(node);
  absl::SleepFor(absl::Milliseconds(200));  // its listing first
  const uint64_t before = counter.events();
  WriteRun run;
  const Clock::time_point start = Clock::now();
  const Clock::time_point end = start + absl::ToChronoNanoseconds(o.duration);
  while (Clock::now() < end) {
    std::vector<int32_t> ids(o.tokens);
    for (int32_t& id : ids) id = (*next_id)++;
    RETURN_IF_ERROR(AppendPrompt(stub, run.appends % kSequences, ids));
    ++run.appends;
  }
  run.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  absl::SleepFor(absl::Milliseconds(200));  // the stream catches up
  run.events = counter.events() - before;
  return run;
}

absl::Status Run(const Options& o) {
  const int ports[2] = {ReservePort(), ReservePort()};
  if (ports[0] == 0 || ports[1] == 0) return absl::UnavailableError("no free port");
  const char* names[2] = {"ev-a", "ev-b"};
  std::unique_ptr<NodeProcess> nodes[2];
  for (int i = 0; i < 2; ++i) {
    NodeProcess::Options options;
    options.node_name = names[i];
    options.port = ports[i];
    options.extra_args = {absl::StrCat("--peers=", names[1 - i], "=127.0.0.1:", ports[1 - i]),
                          "--memory-budget=256MiB", "--snapshot-budget=64MiB"};
    ASSIGN_OR_RETURN(nodes[i], NodeProcess::Start(options));
  }
  std::unique_ptr<Stub> a = nodes[0]->NewStub();
  std::unique_ptr<Stub> b = nodes[1]->NewStub();
  for (Stub* stub : {a.get(), b.get()}) {
    v1::CreateCacheRequest create;
    *create.mutable_spec() = Spec();
    v1::CreateCacheResponse created;
    RETURN_IF_ERROR(Call(*stub, &Stub::CreateCache, create, &created, "CreateCache"));
  }

  // ---- propagation ----
  int32_t next_id = 1;
  std::vector<double> lag_us, lookup_us;
  // ev-b's watcher of ev-a may still be waiting to retry: wait until a first prompt shows.
  {
    std::vector<int32_t> ids(o.tokens);
    for (int32_t& id : ids) id = next_id++;
    RETURN_IF_ERROR(AppendPrompt(*a, 0, ids));
    const absl::Time give_up = absl::Now() + absl::Seconds(30);
    for (;;) {
      ASSIGN_OR_RETURN(const v1::PrefixMatch m, Lookup(*b, ids));
      if (m.node() == "ev-a") break;
      if (absl::Now() > give_up) return absl::DeadlineExceededError("ev-b never saw ev-a's prompt");
      absl::SleepFor(absl::Milliseconds(50));
    }
  }
  const int32_t whole = o.tokens / 16 * 16;
  for (int rep = 0; rep < o.reps; ++rep) {
    const int64_t seq = rep % kSequences;
    std::vector<int32_t> ids(o.tokens);
    for (int32_t& id : ids) id = next_id++;
    RETURN_IF_ERROR(AppendPrompt(*a, seq, ids));
    const Clock::time_point appended = Clock::now();
    for (;;) {
      const Clock::time_point asked = Clock::now();
      ASSIGN_OR_RETURN(const v1::PrefixMatch m, Lookup(*b, ids));
      lookup_us.push_back(Micros(Clock::now() - asked));
      if (m.node() == "ev-a" && m.seq() == seq && m.length() == whole) break;
      if (Clock::now() - appended > std::chrono::seconds(10)) {
        return absl::DeadlineExceededError(absl::StrCat("rep ", rep, ": not seen in 10 s"));
      }
    }
    lag_us.push_back(Micros(Clock::now() - appended));
  }
  std::printf(
      "propagation: %d prompts of %d token ids (%d blocks) appended on ev-a, until "
      "ev-b's cluster LookupPrefix answers with them\n",
      o.reps, o.tokens, whole / 16);
  std::printf("  append -> seen on ev-b   p50 %8.1f us  p90 %8.1f us  p99 %8.1f us  max %8.1f us\n",
              Percentile(lag_us, 0.5), Percentile(lag_us, 0.9), Percentile(lag_us, 0.99),
              Percentile(lag_us, 1.0));
  std::printf(
      "  reference: one cluster LookupPrefix on ev-b  p50 %8.1f us  p99 %8.1f us  (%zu calls)\n",
      Percentile(lookup_us, 0.5), Percentile(lookup_us, 0.99), lookup_us.size());

  // ---- write cost ----
  ASSIGN_OR_RETURN(const WriteRun watched, Write(*a, *nodes[0], o, &next_id));
  b.reset();
  nodes[1]->ReleaseChannel();
  nodes[1]->Stop();
  ASSIGN_OR_RETURN(const WriteRun alone, Write(*a, *nodes[0], o, &next_id));
  std::printf("write cost: one client, Remove + Append of %d token ids per step, for %s\n",
              o.tokens, absl::FormatDuration(o.duration).c_str());
  for (const auto& [name, run] : {std::pair<const char*, const WriteRun&>{"ev-b watching", watched},
                                  {"ev-b stopped", alone}}) {
    std::printf("  %-14s %8.0f steps/s  %10.0f tokens/s  %9.0f events/s delivered to a watcher\n",
                name, run.appends / run.seconds, run.appends * o.tokens / run.seconds,
                run.events / run.seconds);
  }
  std::printf("  ratio watching/stopped: %.2f\n",
              (watched.appends / watched.seconds) / (alone.appends / alone.seconds));
  a.reset();
  nodes[0]->ReleaseChannel();
  nodes[0]->Stop();
  return absl::OkStatus();
}

}  // namespace
}  // namespace kvmesh

int main(int argc, char** argv) {
  using kvmesh::ctl::Args;
  constexpr absl::string_view kBool[] = {"help"};
  absl::StatusOr<Args> args = Args::Parse(argc, argv, kBool);
  absl::Status status = args.status();
  kvmesh::Options o;
  if (status.ok()) status = args->CheckAllowed(kvmesh::kFlags);
  if (status.ok() && args->Has("help")) {
    std::printf("events_bench [--reps=200] [--tokens=64] [--duration=5s]\n");
    return 0;
  }
  if (status.ok()) {
    absl::StatusOr<int64_t> reps = args->GetInt("reps", 200);
    absl::StatusOr<int64_t> tokens = args->GetInt("tokens", 64);
    absl::StatusOr<absl::Duration> duration = args->GetDuration("duration", absl::Seconds(5));
    if (!reps.ok()) status = reps.status();
    if (!tokens.ok()) status = tokens.status();
    if (!duration.ok()) status = duration.status();
    if (status.ok()) {
      o.reps = static_cast<int>(*reps);
      o.tokens = static_cast<int>(*tokens);
      o.duration = *duration;
      if (o.reps < 1 || o.tokens < 16 || o.tokens > 1024) {
        status = absl::InvalidArgumentError("--reps must be >= 1 and --tokens in [16, 1024]");
      }
    }
  }
  if (status.ok()) status = kvmesh::Run(o);
  if (!status.ok()) {
    std::fprintf(stderr, "events_bench: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}

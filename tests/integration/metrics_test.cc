// /metrics of real kvmesh-node processes, scraped over HTTP with libcurl, and the node's log in
// both formats (docs/operate.md). Each test checks that series move with the operations that
// should move them: RPC counters by method and code, cache gauges, transfers and migrations
// between two nodes, drains, the in-flight budget, kept arenas; and that every log line of a
// JSON node is a JSON object with the fields the docs promise.
#include <curl/curl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "clients/cpp/kvmesh_local.h"
#include "gmock/gmock.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "kvmesh/v1/kvmesh.grpc.pb.h"
#include "tests/integration/client_util.h"
#include "tests/integration/node_fixture.h"
#include "tests/testing/node_process.h"

namespace kvmesh {
namespace testutil {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using Stub = v1::CacheService::Stub;
using Labels = std::map<std::string, std::string>;

// ---- scraping ---------------------------------------------------------------------------------

size_t AppendBody(char* data, size_t size, size_t count, void* out) {
  static_cast<std::string*>(out)->append(data, size * count);
  return size * count;
}

// GET http://127.0.0.1:<port><path>: the body, or nullopt (with a test failure) on any error.
std::optional<std::string> HttpGet(int port, const std::string& path, long* code = nullptr) {
  std::unique_ptr<CURL, void (*)(CURL*)> curl(curl_easy_init(), curl_easy_cleanup);
  if (curl == nullptr) {
    ADD_FAILURE() << "curl_easy_init failed";
    return std::nullopt;
  }
  std::string body;
  const std::string url = absl::StrCat("http://127.0.0.1:", port, path);
  curl_easy_setopt(curl.get(), CURLOPT_URL, url.c_str());
  curl_easy_setopt(curl.get(), CURLOPT_WRITEFUNCTION, AppendBody);
  curl_easy_setopt(curl.get(), CURLOPT_WRITEDATA, &body);
  curl_easy_setopt(curl.get(), CURLOPT_TIMEOUT_MS, 10000L);
  curl_easy_setopt(curl.get(), CURLOPT_NOSIGNAL, 1L);
  const CURLcode result = curl_easy_perform(curl.get());
  if (result != CURLE_OK) {
    ADD_FAILURE() << "GET " << url << ": " << curl_easy_strerror(result);
    return std::nullopt;
  }
  long status = 0;
  curl_easy_getinfo(curl.get(), CURLINFO_RESPONSE_CODE, &status);
  if (code != nullptr) *code = status;
  return body;
}

struct Sample {
  std::string name;
  Labels labels;
  double value = 0;
};

// The Prometheus text format (version 0.0.4), as much as a test needs: one sample per line,
// `name{label="value",...} number`; # lines are comments. Fails the test on a malformed line.
std::vector<Sample> ParseExposition(const std::string& text) {
  std::vector<Sample> samples;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    if (absl::StartsWith(line, "#")) continue;
    Sample sample;
    const size_t brace = line.find('{');
    const size_t space = line.rfind(' ');
    if (space == absl::string_view::npos) {
      ADD_FAILURE() << "malformed sample: " << line;
      continue;
    }
    if (brace != absl::string_view::npos && brace < space) {
      sample.name = std::string(line.substr(0, brace));
      const size_t close = line.rfind('}');
      absl::string_view labels = line.substr(brace + 1, close - brace - 1);
      while (!labels.empty()) {
        const size_t eq = labels.find("=\"");
        size_t end = eq + 2;
        std::string value;
        while (end < labels.size() && labels[end] != '"') {
          if (labels[end] == '\\' && end + 1 < labels.size()) ++end;
          value.push_back(labels[end++]);
        }
        sample.labels[std::string(labels.substr(0, eq))] = value;
        labels.remove_prefix(std::min(labels.size(), end + 1));
        absl::ConsumePrefix(&labels, ",");
      }
    } else {
      sample.name = std::string(line.substr(0, space));
    }
    if (!absl::SimpleAtod(line.substr(space + 1), &sample.value)) {
      ADD_FAILURE() << "malformed value: " << line;
      continue;
    }
    samples.push_back(std::move(sample));
  }
  return samples;
}

class Scrape {
 public:
  explicit Scrape(std::vector<Sample> samples) : samples_(std::move(samples)) {}
  // The value of the one sample of `name` whose labels include `labels`; nullopt when none.
  // Fails the test when several match.
  std::optional<double> Get(const std::string& name, const Labels& labels = {}) const {
    std::optional<double> found;
    for (const Sample& s : samples_) {
      if (s.name != name || !Includes(s.labels, labels)) continue;
      EXPECT_FALSE(found.has_value()) << "several samples of " << name << " match";
      found = s.value;
    }
    return found;
  }
  // 0 when absent (a counter that never moved has no series yet).
  double Count(const std::string& name, const Labels& labels = {}) const {
    return Get(name, labels).value_or(0);
  }
  const std::vector<Sample>& samples() const { return samples_; }

 private:
  static bool Includes(const Labels& have, const Labels& want) {
    for (const auto& [k, v] : want) {
      auto it = have.find(k);
      if (it == have.end() || it->second != v) return false;
    }
    return true;
  }
  std::vector<Sample> samples_;
};

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return absl::StrCat(dir != nullptr ? dir : "/tmp", "/kvmesh-metrics-test-", getpid(), "-", name);
}

int ReadPort(const std::string& path) {
  for (absl::Time end = absl::Now() + absl::Seconds(10); absl::Now() < end;) {
    std::ifstream in(path);
    int port = 0;
    if (in >> port && port > 0) return port;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return 0;
}

// A node with /metrics on a port it picks (written to --metrics-port-file).
struct MetricsNode {
  std::unique_ptr<NodeProcess> process;
  std::unique_ptr<Stub> stub;
  int metrics_port = 0;

  Scrape ScrapeNow() const {
    std::optional<std::string> body = HttpGet(metrics_port, "/metrics");
    return Scrape(body.has_value() ? ParseExposition(*body) : std::vector<Sample>{});
  }
};

MetricsNode StartNode(NodeProcess::Options options) {
  MetricsNode node;
  const std::string port_file = TempPath(absl::StrCat(options.node_name, ".metrics-port"));
  std::remove(port_file.c_str());
  options.extra_args.push_back(absl::StrCat("--metrics-port-file=", port_file));
  absl::StatusOr<std::unique_ptr<NodeProcess>> process = NodeProcess::Start(options);
  EXPECT_TRUE(process.ok()) << process.status();
  if (!process.ok()) return node;
  node.process = *std::move(process);
  node.stub = node.process->NewStub();
  node.metrics_port = ReadPort(port_file);
  std::remove(port_file.c_str());
  EXPECT_NE(node.metrics_port, 0);
  EXPECT_THAT(node.process->listening_line(),
              HasSubstr(absl::StrCat(" metrics=127.0.0.1:", node.metrics_port)));
  return node;
}

void StopNode(MetricsNode& node) {
  node.stub.reset();
  node.process->ReleaseChannel();
  EXPECT_TRUE(node.process->Stop().clean()) << node.process->ReadStderr();
}

v1::CacheSpec SmallSpec(const std::string& name) {
  AttentionOptions a;
  a.num_layers = 2;
  a.num_kv_heads = 2;
  a.head_dim_k = 16;
  a.head_dim_v = 16;
  a.rope = v1::ROPE_TYPE_NONE;
  return SpecProto(name, 4, 256, 64, {AttentionGroupProto(a)});
}

std::vector<int32_t> Positions(int32_t n) {
  std::vector<int32_t> p(n);
  std::iota(p.begin(), p.end(), 0);
  return p;
}

v1::ListMembersResponse Members(Stub& stub) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::ListMembersResponse response;
  const grpc::Status status = stub.ListMembers(&context, v1::ListMembersRequest(), &response);
  EXPECT_TRUE(status.ok()) << StatusText(status);
  return response;
}

// deploy/k8s/monitoring/metrics.txt, the list the dashboard and the alerts are checked against:
// name -> (type, label names).
struct Contracted {
  std::string type;
  std::set<std::string> labels;
};
std::map<std::string, Contracted> ReadContract() {
  std::map<std::string, Contracted> contract;
  std::ifstream in(absl::StrCat(KVMESH_SOURCE_DIR, "/deploy/k8s/monitoring/metrics.txt"));
  EXPECT_TRUE(in.good()) << "cannot read deploy/k8s/monitoring/metrics.txt";
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::vector<std::string> words = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (words.size() < 3) continue;
    Contracted c;
    c.type = words[1];
    if (words[2] != "-") {
      for (absl::string_view l : absl::StrSplit(words[2], ',')) c.labels.insert(std::string(l));
    }
    contract[words[0]] = c;
  }
  return contract;
}

// Every series a node exposes is in the contract, with the contract's type and label names.
void ExpectWithinContract(const MetricsNode& node) {
  const std::map<std::string, Contracted> contract = ReadContract();
  ASSERT_FALSE(contract.empty());
  std::optional<std::string> text = HttpGet(node.metrics_port, "/metrics");
  ASSERT_TRUE(text.has_value());
  // prometheus-cpp's exposer adds series about itself (exposer_scrapes_total, ...).
  for (absl::string_view line : absl::StrSplit(*text, '\n', absl::SkipEmpty())) {
    if (!absl::StartsWith(line, "# TYPE ") || absl::StartsWith(line, "# TYPE exposer_")) continue;
    std::vector<std::string> words = absl::StrSplit(line, ' ');
    ASSERT_EQ(words.size(), 4u) << line;
    auto it = contract.find(words[2]);
    ASSERT_NE(it, contract.end()) << words[2] << " is not in deploy/k8s/monitoring/metrics.txt";
    EXPECT_EQ(it->second.type, words[3]) << words[2];
  }
  for (const Sample& sample : ParseExposition(*text)) {
    if (absl::StartsWith(sample.name, "exposer_")) continue;
    std::string name = sample.name;
    for (const char* suffix : {"_bucket", "_sum", "_count"}) {
      const std::string base = name.substr(0, name.size() - std::min(name.size(), strlen(suffix)));
      auto it = contract.find(base);
      if (absl::EndsWith(name, suffix) && it != contract.end() && it->second.type == "histogram") {
        name = base;
      }
    }
    auto it = contract.find(name);
    ASSERT_NE(it, contract.end()) << sample.name;
    std::set<std::string> labels;
    for (const auto& [k, v] : sample.labels) {
      if (k != "le") labels.insert(k);
    }
    EXPECT_EQ(labels, it->second.labels) << sample.name;
  }
}

// ---- one node ---------------------------------------------------------------------------------

TEST(MetricsTest, SeriesMoveWithRpcsAndCaches) {
  NodeProcess::Options options;
  options.node_name = "metrics-a";
  options.extra_args = {"--memory-budget=64MiB", "--snapshot-budget=16MiB"};
  MetricsNode node = StartNode(options);
  ASSERT_NE(node.process, nullptr);

  const Scrape before = node.ScrapeNow();
  // Build and process series, from the first scrape on.
  const v1::ListMembersResponse members = Members(*node.stub);
  ASSERT_GE(members.members_size(), 1);
  const v1::Member& self = members.members(0);
  EXPECT_EQ(self.boot_id().size(), 32u);
  EXPECT_FALSE(self.version().empty());
  EXPECT_EQ(before.Get("kvmesh_build_info", {{"boot_id", self.boot_id()},
                                             {"version", self.version()},
                                             {"node", "metrics-a"},
                                             {"backend", self.backend()}}),
            1);
  EXPECT_NEAR(before.Count("kvmesh_start_time_seconds"),
              static_cast<double>(self.start_time_unix_ms()) / 1000, 0.01);
  EXPECT_GT(before.Count("process_resident_memory_bytes"), 1 << 20);
  EXPECT_EQ(before.Get("kvmesh_caches"), 0);
  EXPECT_EQ(before.Get("kvmesh_device_memory_budget_bytes", {{"pool", "cache"}}), 64 << 20);
  EXPECT_EQ(before.Get("kvmesh_device_memory_budget_bytes", {{"pool", "snapshot"}}), 16 << 20);
  EXPECT_EQ(before.Get("kvmesh_executor_queue_depth", {{"executor", "engine"}}), 0);
  EXPECT_TRUE(before.Get("kvmesh_inflight_budget_bytes").has_value());
  const Labels append_ok = {{"service", "CacheService"}, {"method", "Append"}, {"code", "OK"}};
  EXPECT_EQ(before.Count("kvmesh_rpc_handled_total", append_ok), 0);

  const v1::CacheSpec spec = SmallSpec("m");
  KVMESH_ASSERT_OK(CreateCache(*node.stub, spec));
  KVMESH_ASSERT_OK(Append(*node.stub, MakeAppend(spec, 0, Positions(48))));
  KVMESH_ASSERT_OK(Append(*node.stub, MakeAppend(spec, 2, Positions(8))));
  KVMESH_ASSERT_OK(CopyPrefix(*node.stub, "m", 0, 1, 32));
  v1::GetCacheResponse ignored;
  EXPECT_EQ(GetCache(*node.stub, "no-such-cache", &ignored).error_code(),
            grpc::StatusCode::NOT_FOUND);

  const Scrape after = node.ScrapeNow();
  EXPECT_EQ(after.Count("kvmesh_rpc_handled_total", append_ok), 2);
  EXPECT_EQ(after.Count("kvmesh_rpc_handled_total", {{"method", "CopyPrefix"}, {"code", "OK"}}), 1);
  EXPECT_EQ(
      after.Count("kvmesh_rpc_handled_total", {{"method", "GetCache"}, {"code", "NOT_FOUND"}}), 1);
  EXPECT_EQ(after.Count("kvmesh_rpc_handling_seconds_count",
                        {{"service", "CacheService"}, {"method", "Append"}}),
            2);
  // Nothing runs between the calls: nothing in flight, nothing queued.
  EXPECT_EQ(after.Get("kvmesh_rpc_in_flight", {{"service", "CacheService"}, {"method", "Append"}}),
            0);
  EXPECT_EQ(after.Get("kvmesh_inflight_held_bytes"), 0);
  const Labels cache = {{"tenant", "default"}, {"cache", "m"}};
  Labels group = cache;
  group["group"] = "0";
  EXPECT_EQ(after.Get("kvmesh_caches"), 1);
  EXPECT_EQ(after.Get("kvmesh_cache_cells", group), spec.max_sequences() * spec.capacity());
  // 48 + 8 cells; the fork's 32 share seq 0's cells.
  EXPECT_EQ(after.Get("kvmesh_cache_cells_used", group), 56);
  EXPECT_EQ(after.Get("kvmesh_cache_cells_shared", group), 32);
  EXPECT_EQ(after.Get("kvmesh_cache_sequences", cache), 3);
  v1::GetCacheResponse got;
  KVMESH_ASSERT_OK(GetCache(*node.stub, "m", &got));
  EXPECT_EQ(after.Get("kvmesh_cache_bytes", cache), got.cache().usage().bytes_held());
  EXPECT_EQ(after.Get("kvmesh_device_memory_used_bytes", {{"pool", "cache"}}),
            got.cache().usage().bytes_held());

  EXPECT_EQ(after.Get("kvmesh_cache_cells_reserved", group), 0);
  // A room reservation for a new sequence of 20 positions holds back 20 free cells.
  KVMESH_ASSERT_OK(Reserve(*node.stub, "m", 7, 20));
  EXPECT_EQ(node.ScrapeNow().Get("kvmesh_cache_cells_reserved", group), 20);
  KVMESH_ASSERT_OK(Reserve(*node.stub, "m", 7, 0));

  // A snapshot shows in the cache's snapshot series and the snapshot pool.
  v1::SnapshotInfo snapshot;
  KVMESH_ASSERT_OK(Snapshot(*node.stub, "m", 0, 0, &snapshot));
  const Scrape with_snapshot = node.ScrapeNow();
  EXPECT_EQ(with_snapshot.Get("kvmesh_snapshots", cache), 1);
  EXPECT_GT(with_snapshot.Count("kvmesh_snapshot_bytes", cache), 0);
  EXPECT_EQ(with_snapshot.Get("kvmesh_device_memory_used_bytes", {{"pool", "snapshot"}}),
            with_snapshot.Count("kvmesh_snapshot_bytes", cache));

  // Token ids: a sequence of 40 positions with ids holds two blocks of 16 in the prefix
  // index; every change so far was an event, and nobody watches.
  EXPECT_EQ(with_snapshot.Get("kvmesh_token_blocks", cache), 0);
  v1::AppendRequest with_ids = MakeAppend(spec, 3, Positions(40));
  for (v1::Token& t : *with_ids.mutable_tokens()) t.set_token_id(t.pos());
  KVMESH_ASSERT_OK(Append(*node.stub, with_ids));
  const Scrape indexed = node.ScrapeNow();
  EXPECT_EQ(indexed.Get("kvmesh_token_blocks", cache), 2);
  EXPECT_GT(indexed.Count("kvmesh_token_index_bytes", cache), 0);
  EXPECT_GE(indexed.Count("kvmesh_events_total"), 3);  // created, snapshot, blocks
  EXPECT_EQ(indexed.Count("kvmesh_events_dropped_total"), 0);
  EXPECT_EQ(indexed.Get("kvmesh_event_watchers"), 0);

  // A deleted cache leaves no series behind; its arena may be kept for reuse, within the limit.
  KVMESH_ASSERT_OK(DeleteCache(*node.stub, "m"));
  const Scrape deleted = node.ScrapeNow();
  EXPECT_EQ(deleted.Get("kvmesh_caches"), 0);
  EXPECT_FALSE(deleted.Get("kvmesh_cache_sequences", cache).has_value());
  EXPECT_FALSE(deleted.Get("kvmesh_cache_cells", group).has_value());
  EXPECT_EQ(deleted.Get("kvmesh_device_memory_used_bytes", {{"pool", "cache"}}), 0);
  EXPECT_LE(deleted.Count("kvmesh_device_kept_arena_bytes"),
            deleted.Count("kvmesh_device_kept_arena_limit_bytes"));

  // The exposition is well-formed for Prometheus: every family has HELP and TYPE.
  std::optional<std::string> text = HttpGet(node.metrics_port, "/metrics");
  ASSERT_TRUE(text.has_value());
  EXPECT_THAT(*text, HasSubstr("# TYPE kvmesh_rpc_handled_total counter"));
  EXPECT_THAT(*text, HasSubstr("# TYPE kvmesh_rpc_handling_seconds histogram"));
  EXPECT_THAT(*text, HasSubstr("# TYPE kvmesh_cache_cells_used gauge"));
  StopNode(node);
}

// A request the in-flight budget cannot hold is refused and counted.
// The local data path's series: sessions, pins and plans held now, and what happened since
// start; absent on a node without --local-socket.
TEST(MetricsTest, LocalSessionsPinsAndPlansAreCounted) {
  NodeProcess::Options options;
  options.node_name = "metrics-local";
  const std::string socket = TempPath("local.sock");
  options.extra_args = {"--memory-budget=64MiB", "--snapshot-budget=16MiB",
                        absl::StrCat("--local-socket=", socket)};
  MetricsNode node = StartNode(options);
  ASSERT_NE(node.process, nullptr);
  EXPECT_EQ(node.ScrapeNow().Get("kvmesh_local_sessions"), 0);
  const v1::CacheSpec spec = SmallSpec("m");
  KVMESH_ASSERT_OK(CreateCache(*node.stub, spec));
  KVMESH_ASSERT_OK(Append(*node.stub, MakeAppend(spec, 0, Positions(8))));
  {
    absl::StatusOr<std::unique_ptr<local::Session>> session = local::Session::Connect(socket);
    ASSERT_TRUE(session.ok()) << session.status();
    absl::StatusOr<local::Pin> pin = (*session)->PinCells("m", 0, 0, std::nullopt);
    ASSERT_TRUE(pin.ok()) << pin.status();
    EXPECT_EQ((*session)->PinCells("m", 7, 0, std::nullopt).status().code(),
              absl::StatusCode::kNotFound);
    absl::StatusOr<local::AppendPlan> plan = (*session)->BeginAppend("m", {1}, {0});
    ASSERT_TRUE(plan.ok()) << plan.status();
    const Scrape held = node.ScrapeNow();
    EXPECT_EQ(held.Get("kvmesh_local_sessions"), 1);
    EXPECT_EQ(held.Get("kvmesh_local_pins"), 1);
    EXPECT_EQ(held.Get("kvmesh_local_plans"), 1);
    EXPECT_EQ(held.Count("kvmesh_local_sessions_total"), 1);
    EXPECT_EQ(held.Count("kvmesh_local_refusals_total"), 1);
    EXPECT_EQ(held.Count("kvmesh_local_commits_total"), 0);
    ASSERT_TRUE((*session)->CommitAppend(plan->id).ok());
    const Scrape committed = node.ScrapeNow();
    EXPECT_EQ(committed.Get("kvmesh_local_plans"), 0);
    EXPECT_EQ(committed.Count("kvmesh_local_commits_total"), 1);
  }
  // The session's end (the socket closed) drops its pin.
  std::optional<double> sessions;
  for (absl::Time end = absl::Now() + absl::Seconds(10); absl::Now() < end;) {
    sessions = node.ScrapeNow().Get("kvmesh_local_sessions");
    if (sessions == 0) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(sessions, 0);
  EXPECT_EQ(node.ScrapeNow().Get("kvmesh_local_pins"), 0);
  ExpectWithinContract(node);
  StopNode(node);
}

TEST(MetricsTest, InflightRefusalsAreCounted) {
  NodeProcess::Options options;
  options.node_name = "metrics-b";
  options.extra_args = {"--memory-budget=160MiB", "--snapshot-budget=16MiB",
                        "--inflight-budget=128MiB", "--max-message-bytes=8MiB"};
  MetricsNode node = StartNode(options);
  ASSERT_NE(node.process, nullptr);
  // Tokens of 8 KiB; a payload of up to 128 MiB is valid for the cache, but kvmesh's share of
  // the budget is 96 MiB. The cache is a ring (a Rotating group), so an AppendStream buffers
  // its payload (into an Attention-only cache it would write into cells and hold no budget).
  const v1::CacheSpec spec = BigTokenRingSpec("r", 16384);
  KVMESH_ASSERT_OK(CreateCache(*node.stub, spec));
  EXPECT_EQ(node.ScrapeNow().Count("kvmesh_inflight_refusals_total"), 0);
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::AppendResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::AppendStreamRequest>> writer =
      node.stub->AppendStream(&context, &response);
  v1::AppendStreamRequest header;
  header.mutable_header()->set_cache("r");
  constexpr int32_t kTokens = 12800;  // 100 MiB
  for (int32_t pos = 0; pos < kTokens; ++pos) {
    v1::Token* token = header.mutable_header()->add_tokens();
    token->set_seq(0);
    token->set_pos(pos);
  }
  header.mutable_header()->set_payload_bytes(int64_t{kTokens} * 8192);
  writer->Write(header);
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << StatusText(status);
  const Scrape scrape = node.ScrapeNow();
  EXPECT_EQ(scrape.Count("kvmesh_inflight_refusals_total"), 1);
  EXPECT_EQ(scrape.Count("kvmesh_rpc_handled_total",
                         {{"method", "AppendStream"}, {"code", "RESOURCE_EXHAUSTED"}}),
            1);
  EXPECT_EQ(scrape.Get("kvmesh_inflight_held_bytes"), 0);
  EXPECT_EQ(scrape.Count("kvmesh_executor_rejections_total", {{"executor", "engine"}}), 0);
  StopNode(node);
}

// ---- two nodes --------------------------------------------------------------------------------

TEST(MetricsTest, TransfersMigrationsAndDrainsBetweenTwoNodes) {
  const int port_a = ReservePort();
  const int port_b = ReservePort();
  ASSERT_NE(port_a, 0);
  ASSERT_NE(port_b, 0);
  auto options = [&](const std::string& name, int port, const std::string& peer, int peer_port) {
    NodeProcess::Options o;
    o.node_name = name;
    o.port = port;
    o.extra_args = {absl::StrCat("--peers=", peer, "=127.0.0.1:", peer_port),
                    "--memory-budget=64MiB", "--snapshot-budget=64MiB"};
    return o;
  };
  MetricsNode a = StartNode(options("mx-a", port_a, "mx-b", port_b));
  ASSERT_NE(a.process, nullptr);
  MetricsNode b = StartNode(options("mx-b", port_b, "mx-a", port_a));
  ASSERT_NE(b.process, nullptr);

  // Each lists the other with the boot id, start time and version that the other reports.
  {
    const v1::ListMembersResponse at_a = Members(*a.stub);
    const v1::ListMembersResponse at_b = Members(*b.stub);
    ASSERT_EQ(at_a.members_size(), 2);
    ASSERT_EQ(at_b.members_size(), 2);
    EXPECT_EQ(at_a.members(1).name(), "mx-b");
    EXPECT_EQ(at_a.members(1).boot_id(), at_b.members(0).boot_id());
    EXPECT_EQ(at_a.members(1).start_time_unix_ms(), at_b.members(0).start_time_unix_ms());
    EXPECT_EQ(at_a.members(1).version(), at_b.members(0).version());
    EXPECT_NE(at_a.members(0).boot_id(), at_b.members(0).boot_id());
  }

  const v1::CacheSpec spec = SmallSpec("t");
  KVMESH_ASSERT_OK(CreateCache(*a.stub, spec));
  KVMESH_ASSERT_OK(CreateCache(*b.stub, spec));
  KVMESH_ASSERT_OK(Append(*a.stub, MakeAppend(spec, 0, Positions(40))));

  // b pulls 24 positions of a's sequence 0.
  {
    grpc::ClientContext context;
    SetDeadline(&context);
    v1::CopyPrefixRequest request;
    request.set_cache("t");
    request.set_src_seq(0);
    request.set_dst_seq(5);
    request.set_length(24);
    request.set_source_node("mx-a");
    v1::CopyPrefixResponse response;
    KVMESH_ASSERT_OK(b.stub->CopyPrefix(&context, request, &response));
    const std::string transport = response.transfer().transport();
    const double bytes = static_cast<double>(response.transfer().bytes());
    ASSERT_GT(bytes, 0);
    const Scrape at_b = b.ScrapeNow();
    const Labels received = {{"transport", transport}, {"peer", "mx-a"}, {"direction", "receive"}};
    EXPECT_EQ(at_b.Count("kvmesh_transfer_bytes_total", received), bytes);
    Labels received_ok = received;
    received_ok["code"] = "OK";
    EXPECT_EQ(at_b.Count("kvmesh_transfers_total", received_ok), 1);
    EXPECT_EQ(at_b.Count("kvmesh_transfer_duration_seconds_count", received), 1);
    // The sender counts its side once the receiver released the lease.
    const Scrape at_a = a.ScrapeNow();
    const Labels sent = {{"transport", transport}, {"peer", "mx-b"}, {"direction", "send"}};
    EXPECT_EQ(at_a.Count("kvmesh_transfer_bytes_total", sent), bytes);
    EXPECT_EQ(at_a.Get("kvmesh_export_leases"), 0);
    EXPECT_EQ(at_a.Get("kvmesh_export_leased_bytes"), 0);
    EXPECT_EQ(at_a.Count("kvmesh_rpc_handled_total",
                         {{"service", "PeerService"}, {"method", "Export"}, {"code", "OK"}}),
              1);
  }

  // a migrates sequence 0 to b: a counts a source, b a target.
  {
    grpc::ClientContext context;
    SetDeadline(&context);
    v1::MigrateRequest request;
    request.set_cache("t");
    request.set_seq(0);
    request.set_target_node("mx-b");
    request.set_target_seq(0);
    v1::MigrateResponse response;
    KVMESH_ASSERT_OK(a.stub->Migrate(&context, request, &response));
    EXPECT_EQ(a.ScrapeNow().Count("kvmesh_migrations_total",
                                  {{"kind", "sequence"}, {"role", "source"}, {"code", "OK"}}),
              1);
    EXPECT_EQ(b.ScrapeNow().Count("kvmesh_migrations_total",
                                  {{"kind", "sequence"}, {"role", "target"}, {"code", "OK"}}),
              1);
  }
  // A migration that fails (no such sequence) counts with its code.
  {
    grpc::ClientContext context;
    SetDeadline(&context);
    v1::MigrateRequest request;
    request.set_cache("t");
    request.set_seq(3);
    request.set_target_node("mx-b");
    v1::MigrateResponse response;
    EXPECT_EQ(a.stub->Migrate(&context, request, &response).error_code(),
              grpc::StatusCode::NOT_FOUND);
    EXPECT_EQ(
        a.ScrapeNow().Count("kvmesh_migrations_total",
                            {{"kind", "sequence"}, {"role", "source"}, {"code", "NOT_FOUND"}}),
        1);
  }

  // b drains: its two sequences go to a.
  {
    EXPECT_EQ(b.ScrapeNow().Get("kvmesh_draining"), 0);
    grpc::ClientContext context;
    SetDeadline(&context);
    v1::DrainRequest request;
    request.set_timeout_ms(20000);
    v1::DrainResponse response;
    KVMESH_ASSERT_OK(b.stub->Drain(&context, request, &response));
    EXPECT_EQ(response.stayed_size(), 0);
    const Scrape at_b = b.ScrapeNow();
    EXPECT_EQ(at_b.Get("kvmesh_draining"), 1);
    EXPECT_EQ(at_b.Count("kvmesh_drains_total", {{"result", "complete"}}), 1);
    EXPECT_EQ(at_b.Count("kvmesh_drain_moved_total", {{"kind", "sequence"}}),
              response.sequences_size());
    EXPECT_EQ(response.sequences_size(), 2);
    EXPECT_EQ(at_b.Get("kvmesh_cache_sequences", {{"cache", "t"}}), 0);
    EXPECT_EQ(a.ScrapeNow().Get("kvmesh_cache_sequences", {{"cache", "t"}}), 2);
  }
  // Each node's index of the cluster follows the other (a draining node still serves its
  // events); these sequences carry no token ids, so no blocks. The watchers started with the
  // nodes, so a watcher that called its peer before it listened retries a second later.
  for (const MetricsNode* node : {&a, &b}) {
    const std::string peer = node == &a ? "mx-b" : "mx-a";
    const absl::Time end = absl::Now() + absl::Seconds(15);
    while (node->ScrapeNow().Get("kvmesh_cluster_index_synced", {{"peer", peer}}) != 1.0 &&
           absl::Now() < end) {
      absl::SleepFor(absl::Milliseconds(100));
    }
    const Scrape scrape = node->ScrapeNow();
    EXPECT_EQ(scrape.Get("kvmesh_cluster_index_synced", {{"peer", peer}}), 1) << peer;
    EXPECT_EQ(scrape.Get("kvmesh_cluster_index_blocks", {{"peer", peer}}), 0) << peer;
  }
  // After all that, every series either node exposes is one the dashboard and alerts know.
  ExpectWithinContract(a);
  ExpectWithinContract(b);
  StopNode(b);
  StopNode(a);
}

// ---- logs -------------------------------------------------------------------------------------

std::vector<google::protobuf::Struct> JsonLines(const std::string& text) {
  std::vector<google::protobuf::Struct> lines;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    google::protobuf::Struct object;
    const auto status = google::protobuf::util::JsonStringToMessage(std::string(line), &object);
    EXPECT_TRUE(status.ok()) << "not a JSON object: " << line;
    if (status.ok()) lines.push_back(std::move(object));
  }
  return lines;
}

std::string Field(const google::protobuf::Struct& line, const std::string& key) {
  auto it = line.fields().find(key);
  return it == line.fields().end() ? "" : it->second.string_value();
}

TEST(LogTest, JsonLinesCarryRequestsAndErrors) {
  NodeProcess::Options options;
  options.node_name = "log-json";
  options.extra_args = {"--memory-budget=64MiB", "--snapshot-budget=16MiB", "--log-format=json",
                        "--log-level=debug"};
  absl::StatusOr<std::unique_ptr<NodeProcess>> node = NodeProcess::Start(options);
  ASSERT_TRUE(node.ok()) << node.status();
  std::unique_ptr<Stub> stub = (*node)->NewStub();
  const v1::CacheSpec spec = SmallSpec("j");
  KVMESH_ASSERT_OK(CreateCache(*stub, spec));
  KVMESH_ASSERT_OK(Append(*stub, MakeAppend(spec, 1, Positions(4))));
  // A failing call whose names need escaping.
  EXPECT_EQ(Remove(*stub, "j\"q", 7, 0).error_code(), grpc::StatusCode::NOT_FOUND);
  stub.reset();
  (*node)->ReleaseChannel();
  ASSERT_TRUE((*node)->Stop().clean());
  const std::vector<google::protobuf::Struct> lines = JsonLines((*node)->ReadStderr());
  ASSERT_FALSE(lines.empty());
  bool listening = false, append = false, failed = false, shutdown = false;
  for (const google::protobuf::Struct& line : lines) {
    EXPECT_EQ(Field(line, "node"), "log-json");
    EXPECT_FALSE(Field(line, "ts").empty());
    EXPECT_FALSE(Field(line, "msg").empty());
    const std::string level = Field(line, "level");
    EXPECT_TRUE(level == "debug" || level == "info" || level == "warning") << level;
    if (Field(line, "msg") == "listening") {
      listening = true;
      EXPECT_EQ(Field(line, "boot_id").size(), 32u);
      EXPECT_FALSE(Field(line, "version").empty());
    }
    if (Field(line, "msg") == "rpc" && Field(line, "method") == "Append") {
      append = true;
      EXPECT_EQ(level, "debug");
      EXPECT_EQ(Field(line, "code"), "OK");
      EXPECT_EQ(Field(line, "cache"), "j");
      EXPECT_FALSE(Field(line, "ms").empty());
    }
    if (Field(line, "msg") == "rpc failed") {
      failed = true;
      EXPECT_EQ(level, "warning");
      EXPECT_EQ(Field(line, "method"), "Remove");
      EXPECT_EQ(Field(line, "code"), "NOT_FOUND");
      EXPECT_EQ(Field(line, "cache"), "j\"q");
      EXPECT_EQ(Field(line, "seq"), "7");
      EXPECT_THAT(Field(line, "error"), HasSubstr("j\"q"));
      EXPECT_THAT(Field(line, "client"), HasSubstr("127.0.0.1"));
    }
    if (absl::StrContains(Field(line, "msg"), "shutting down")) shutdown = true;
  }
  EXPECT_TRUE(listening);
  EXPECT_TRUE(append);
  EXPECT_TRUE(failed);
  EXPECT_TRUE(shutdown);
}

TEST(LogTest, TextAtWarningLeavesOutSuccessesAndKeepsErrors) {
  NodeProcess::Options options;
  options.node_name = "log-text";
  options.extra_args = {"--memory-budget=64MiB", "--snapshot-budget=16MiB", "--log-level=warning"};
  absl::StatusOr<std::unique_ptr<NodeProcess>> node = NodeProcess::Start(options);
  ASSERT_TRUE(node.ok()) << node.status();
  std::unique_ptr<Stub> stub = (*node)->NewStub();
  KVMESH_ASSERT_OK(CreateCache(*stub, SmallSpec("w")));
  v1::GetCacheResponse ignored;
  EXPECT_EQ(GetCache(*stub, "absent", &ignored).error_code(), grpc::StatusCode::NOT_FOUND);
  // A raw Append (served from its bytes) is named too when it fails, and not when it succeeds.
  const v1::CacheSpec spec = SmallSpec("w");
  KVMESH_ASSERT_OK(Append(*stub, MakeAppend(spec, 6, {0, 1})));
  v1::AppendRequest missing = MakeAppend(spec, 7, {0, 1});
  missing.set_cache("no-such-cache");
  EXPECT_EQ(Append(*stub, missing).error_code(), grpc::StatusCode::NOT_FOUND);
  stub.reset();
  (*node)->ReleaseChannel();
  ASSERT_TRUE((*node)->Stop().clean());
  const std::string log = (*node)->ReadStderr();
  EXPECT_THAT(log, HasSubstr("method=Append code=NOT_FOUND"));
  EXPECT_THAT(log, HasSubstr("cache=no-such-cache"));
  EXPECT_THAT(log, Not(HasSubstr("method=Append code=OK")));
  EXPECT_THAT(log, Not(HasSubstr("method=CreateCache")));
  EXPECT_THAT(log, Not(HasSubstr("listening")));  // info
  EXPECT_THAT(log, HasSubstr(" W kvmesh-node log-text: rpc failed service=CacheService "
                             "method=GetCache code=NOT_FOUND"));
  EXPECT_THAT(log, HasSubstr("cache=absent"));
  EXPECT_THAT(log, HasSubstr("error=\"no cache named 'absent'\""));
}

// ---- start-up -----------------------------------------------------------------------------------

std::string StartupFailure(const std::vector<std::string>& args) {
  NodeProcess::Options options;
  options.node_name = "bad-flags";
  options.extra_args = args;
  absl::StatusOr<std::unique_ptr<NodeProcess>> node = NodeProcess::Start(options);
  EXPECT_FALSE(node.ok()) << "started with " << absl::StrJoin(args, " ");
  return node.ok() ? "" : std::string(node.status().message());
}

TEST(MetricsTest, BadFlagsAreRefusedAtStartup) {
  EXPECT_THAT(StartupFailure({"--log-level=loud"}), HasSubstr("--log-level=loud is not a level"));
  EXPECT_THAT(StartupFailure({"--log-format=xml"}), HasSubstr("--log-format=xml is not a format"));
  EXPECT_THAT(StartupFailure({"--metrics-port=70000"}),
              HasSubstr("--metrics_port=70000 is out of range"));
  // A port something else holds.
  MetricsNode holder;
  {
    NodeProcess::Options options;
    options.node_name = "holder";
    holder = StartNode(options);
    ASSERT_NE(holder.process, nullptr);
  }
  EXPECT_THAT(StartupFailure({absl::StrCat("--metrics-port=", holder.metrics_port)}),
              HasSubstr(absl::StrCat("cannot serve /metrics on 127.0.0.1:", holder.metrics_port)));
  // Scraping any other path is a 404, not a crash.
  long code = 0;
  ASSERT_TRUE(HttpGet(holder.metrics_port, "/nothing-here", &code).has_value());
  EXPECT_EQ(code, 404);
  StopNode(holder);
}

}  // namespace
}  // namespace testutil
}  // namespace kvmesh

int main(int argc, char** argv) {
  curl_global_init(CURL_GLOBAL_DEFAULT);
  ::testing::InitGoogleTest(&argc, argv);
  const int result = RUN_ALL_TESTS();
  curl_global_cleanup();
  return result;
}

// kvmesh_soak: a bounded soak of a two-node kvmesh cluster under valid, unverifiable and hostile
// traffic (issue 14, item 6). Not a ctest (a 5-second smoke run is); tests/soak/run.sh builds and
// runs it with the defaults.
//
// It starts two kvmesh-node processes on 127.0.0.1 as a cluster (--peers, development mode:
// plaintext on loopback, PeerService on the client port), creates fixture caches on both, then
// runs --clients threads for --duration at --rate operations per second in all (client.h:
// verified, chaos and hostile operations on both nodes). Meanwhile it samples each node's RSS
// (/proc/<pid>/status VmRSS) every 100 ms. At the end it reads the fixtures back, deletes every
// cache, waits for unreleased export leases to expire, and samples RSS once more.
//
// It prints the results by gRPC status code per operation kind and in total, p50/p99/max
// latency per kind, and each node's RSS at start, peak and after the cleanup, and exits 1 on any
// failure:
//   - an INTERNAL or UNKNOWN status, or an error message longer than 2 KiB;
//   - a status other than the expected ones, wrong positions or bytes from a Read, a wrong
//     Visible, ListSequences, CanResume or snapshot answer (client.h);
//   - a node that stopped running, or did not exit cleanly on SIGTERM at the end;
//   - a node's RSS (peak, or after the cleanup) above memory budget + snapshot budget +
//     in-flight budget (when the node has --inflight-budget) + --overhead.
// Exit 2: bad flags or a setup that failed.
//
//   kvmesh_soak [--duration=10m] [--clients=8] [--rate=100] [--seed=1] [--node-binary=PATH]
//               [--memory-budget=256MiB] [--snapshot-budget=128MiB] [--inflight-budget=128MiB]
//               [--stream-idle-timeout-ms=5000] [--max-lease-ms=20000]
//               [--max-message-bytes=32MiB] [--overhead=256MiB] [--hostile-percent=20]
//               [--chaos-percent=25] [--visible-queries=20000] [--long-positions=16384]
//               [--stream-bytes=256MiB] [--slow-threads=6] [--progress=30s]
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <numeric>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cache/status_macros.h"
#include "service/ctl/args.h"
#include "tests/integration/client_util.h"
#include "tests/soak/client.h"
#include "tests/soak/soak.h"
#include "tests/testing/node_process.h"

namespace kvmesh {
namespace soak {
namespace {

constexpr absl::string_view kFlags[] = {"duration",
                                        "clients",
                                        "rate",
                                        "seed",
                                        "node-binary",
                                        "memory-budget",
                                        "snapshot-budget",
                                        "inflight-budget",
                                        "stream-idle-timeout-ms",
                                        "max-lease-ms",
                                        "max-message-bytes",
                                        "overhead",
                                        "hostile-percent",
                                        "chaos-percent",
                                        "visible-queries",
                                        "long-positions",
                                        "stream-bytes",
                                        "slow-threads",
                                        "progress",
                                        "trace-client",
                                        "check-every-op",
                                        "help"};

constexpr char kUsage[] =
    "kvmesh_soak: two kvmesh-node processes under valid, unverifiable and hostile traffic\n"
    "  --duration=10m          how long the clients run\n"
    "  --clients=8             client threads\n"
    "  --rate=100              operations per second, all clients together\n"
    "  --seed=1                random seed (operations, payloads)\n"
    "  --node-binary=PATH      kvmesh-node to run (default: this build's)\n"
    "  --memory-budget=256MiB  --snapshot-budget=128MiB  --inflight-budget=128MiB\n"
    "  --stream-idle-timeout-ms=5000  --max-lease-ms=20000  --max-message-bytes=32MiB\n"
    "                          node flags (in-flight, idle and lease flags only when the node\n"
    "                          has them)\n"
    "  --overhead=256MiB       RSS allowed above the budgets\n"
    "  --hostile-percent=20 --chaos-percent=25   the mix (the rest is verified)\n"
    "  --visible-queries=20000 --long-positions=16384   the huge Visible\n"
    "  --stream-bytes=256MiB   announced size of the hostile AppendStreams\n"
    "  --slow-threads=6        hostile calls that may linger at once (idle streams...)\n"
    "  --progress=30s          interval of the progress lines on stderr\n"
    "  --trace-client=N        print every checked call of client N (to reproduce a failure)\n"
    "  --check-every-op        after every verified operation, compare both nodes' sequences\n"
    "                          and snapshots with the model (pins a divergence on its cause)\n";

std::string MiB(int64_t bytes) { return absl::StrFormat("%.1f MiB", bytes / 1048576.0); }

absl::StatusOr<Options> ParseOptions(int argc, char** argv, bool* help) {
  ASSIGN_OR_RETURN(ctl::Args args, ctl::Args::Parse(argc, argv, {"help", "check-every-op"}));
  RETURN_IF_ERROR(args.CheckAllowed(kFlags));
  if (!args.command().empty()) {
    return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", args.command(), "'"));
  }
  ASSIGN_OR_RETURN(*help, args.GetBool("help"));
  Options o;
  ASSIGN_OR_RETURN(o.duration, args.GetDuration("duration", o.duration));
  ASSIGN_OR_RETURN(int64_t clients, args.GetInt("clients", o.clients));
  ASSIGN_OR_RETURN(o.rate, args.GetDouble("rate", o.rate));
  ASSIGN_OR_RETURN(int64_t seed, args.GetInt("seed", static_cast<int64_t>(o.seed)));
  ASSIGN_OR_RETURN(o.node_binary, args.GetString("node-binary", testutil::NodeBinaryPath()));
  ASSIGN_OR_RETURN(o.memory_budget, args.GetBytes("memory-budget", o.memory_budget));
  ASSIGN_OR_RETURN(o.snapshot_budget, args.GetBytes("snapshot-budget", o.snapshot_budget));
  ASSIGN_OR_RETURN(o.inflight_budget, args.GetBytes("inflight-budget", o.inflight_budget));
  ASSIGN_OR_RETURN(o.stream_idle_timeout_ms,
                   args.GetInt("stream-idle-timeout-ms", o.stream_idle_timeout_ms));
  ASSIGN_OR_RETURN(o.max_lease_ms, args.GetInt("max-lease-ms", o.max_lease_ms));
  ASSIGN_OR_RETURN(o.max_message_bytes, args.GetBytes("max-message-bytes", o.max_message_bytes));
  ASSIGN_OR_RETURN(o.overhead, args.GetBytes("overhead", o.overhead));
  ASSIGN_OR_RETURN(int64_t hostile, args.GetInt("hostile-percent", o.hostile_percent));
  ASSIGN_OR_RETURN(int64_t chaos, args.GetInt("chaos-percent", o.chaos_percent));
  ASSIGN_OR_RETURN(int64_t queries, args.GetInt("visible-queries", o.visible_queries));
  ASSIGN_OR_RETURN(int64_t positions, args.GetInt("long-positions", o.long_positions));
  ASSIGN_OR_RETURN(o.stream_bytes, args.GetBytes("stream-bytes", o.stream_bytes));
  ASSIGN_OR_RETURN(int64_t slow, args.GetInt("slow-threads", o.slow_threads));
  ASSIGN_OR_RETURN(o.progress, args.GetDuration("progress", o.progress));
  ASSIGN_OR_RETURN(int64_t trace, args.GetInt("trace-client", o.trace_client));
  o.trace_client = static_cast<int>(trace);
  ASSIGN_OR_RETURN(o.check_every_op, args.GetBool("check-every-op"));
  if (clients < 1 || clients > 256) {
    return absl::InvalidArgumentError(absl::StrCat("--clients=", clients, " is not in [1, 256]"));
  }
  if (!(o.rate > 0)) {
    return absl::InvalidArgumentError(absl::StrCat("--rate=", o.rate, " must be positive"));
  }
  if (hostile < 0 || chaos < 0 || hostile + chaos > 100) {
    return absl::InvalidArgumentError(absl::StrCat("--hostile-percent=", hostile,
                                                   " and --chaos-percent=", chaos,
                                                   " must be >= 0 and add up to at most 100"));
  }
  if (queries < 1 || queries > 1000000 || positions < 1 || positions > (1 << 20)) {
    return absl::InvalidArgumentError(absl::StrCat("--visible-queries=", queries,
                                                   " or --long-positions=", positions,
                                                   " out of range ([1, 1000000], [1, 1048576])"));
  }
  if (slow < 0 || slow > 64) {
    return absl::InvalidArgumentError(absl::StrCat("--slow-threads=", slow, " is not in [0, 64]"));
  }
  if (o.stream_bytes < (1 << 20) || o.stream_bytes > (int64_t{256} << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--stream-bytes=", o.stream_bytes,
                     " is not in [1MiB, 256MiB] (the stream cache's largest Append)"));
  }
  if (o.duration <= absl::ZeroDuration() || o.progress <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--duration and --progress must be positive");
  }
  o.clients = static_cast<int>(clients);
  o.seed = static_cast<uint64_t>(seed);
  o.hostile_percent = static_cast<int>(hostile);
  o.chaos_percent = static_cast<int>(chaos);
  o.visible_queries = static_cast<int>(queries);
  o.long_positions = static_cast<int32_t>(positions);
  o.slow_threads = static_cast<int>(slow);
  return o;
}

// Which flags the node knows, from its --helpfull (absl prints "--name (help)").
absl::StatusOr<NodeSupport> DetectSupport(const std::string& binary) {
  const std::string command = absl::StrCat("'", binary, "' --helpfull 2>&1");
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return absl::InternalError(absl::StrCat("cannot run ", command));
  std::string text;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) text.append(buf, n);
  pclose(pipe);
  if (!absl::StrContains(text, "--memory_budget")) {
    return absl::FailedPreconditionError(
        absl::StrCat(binary, " --helpfull does not list --memory_budget: not a kvmesh-node?"));
  }
  auto has = [&](const char* flag) {
    return absl::StrContains(text, absl::StrCat("--", flag, " ("));
  };
  NodeSupport s;
  s.inflight_budget = has("inflight_budget");
  s.stream_idle_timeout = has("stream_idle_timeout_ms");
  s.max_lease = has("max_lease_ms");
  s.max_leases_per_receiver = has("max_leases_per_receiver");
  return s;
}

// VmRSS of `pid` in bytes; -1 when it cannot be read (the process is gone).
int64_t Rss(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, "VmRSS:")) {
      std::istringstream fields(line.substr(6));
      int64_t kib = -1;
      fields >> kib;
      return kib < 0 ? -1 : kib * 1024;
    }
  }
  return -1;
}

std::string LoadAverage() {
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  in >> a >> b >> c;
  return absl::StrCat(a, " ", b, " ", c);
}

struct RssTrack {
  int64_t start = 0;
  std::atomic<int64_t> current{0};
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> peak_at_ms{0};  // since the clients started
  int64_t after = 0;
};

absl::Status StartNodes(Shared* shared) {
  const Options& o = shared->options;
  std::array<int, 2> ports{};
  for (int& port : ports) {
    port = testutil::ReservePort();
    if (port == 0) return absl::UnavailableError("no free port on 127.0.0.1");
  }
  const std::array<std::string, 2> names = {"soak-a", "soak-b"};
  for (int i = 0; i < 2; ++i) {
    testutil::NodeProcess::Options node;
    node.node_name = names[i];
    node.port = ports[i];
    node.binary = o.node_binary;
    node.extra_args = {
        absl::StrCat("--peers=", names[1 - i], "=127.0.0.1:", ports[1 - i]),
        absl::StrCat("--memory-budget=", o.memory_budget),
        absl::StrCat("--snapshot-budget=", o.snapshot_budget),
        absl::StrCat("--max-message-bytes=", o.max_message_bytes),
    };
    if (shared->support.inflight_budget) {
      node.extra_args.push_back(absl::StrCat("--inflight-budget=", o.inflight_budget));
    }
    if (shared->support.stream_idle_timeout) {
      node.extra_args.push_back(
          absl::StrCat("--stream-idle-timeout-ms=", o.stream_idle_timeout_ms));
    }
    if (shared->support.max_lease) {
      // The lease time the node asks for as a receiver may not exceed the maximum.
      node.extra_args.push_back(absl::StrCat("--max-lease-ms=", o.max_lease_ms));
      node.extra_args.push_back(
          absl::StrCat("--lease-ms=", std::min<int64_t>(o.max_lease_ms, 30000)));
    }
    std::fprintf(stderr, "soak: starting %s --listen=127.0.0.1:%d --node-name=%s %s\n",
                 o.node_binary.c_str(), ports[i], names[i].c_str(),
                 absl::StrJoin(node.extra_args, " ").c_str());
    ASSIGN_OR_RETURN(shared->nodes[i].process, testutil::NodeProcess::Start(node));
    shared->nodes[i].name = names[i];
    shared->nodes[i].address = shared->nodes[i].process->address();
  }
  return absl::OkStatus();
}

// Creates the fixture caches on both nodes and appends their fixture sequences.
absl::Status SetUpFixtures(Shared* shared) {
  for (int n = 0; n < 2; ++n) {
    auto stub = v1::CacheService::NewStub(NewChannel(shared->nodes[n].address, 1000 + n));
    for (const v1::CacheSpec* spec : {&shared->long_spec, &shared->stream_spec,
                                      &shared->chaos_hybrid_spec, &shared->chaos_attention_spec}) {
      const grpc::Status s = testutil::CreateCache(*stub, *spec);
      if (!s.ok()) {
        return absl::InternalError(absl::StrCat("creating ", spec->name(), " on ",
                                                shared->nodes[n].name, ": ",
                                                testutil::StatusText(s)));
      }
    }
    struct Fill {
      const v1::CacheSpec* spec;
      int32_t tokens;
      uint64_t seed;
      int32_t batch;
    };
    for (const Fill& fill :
         {Fill{&shared->long_spec, shared->options.long_positions, shared->long_seed, 4096},
          Fill{&shared->stream_spec, kStreamFixtureTokens, shared->stream_seed, 256}}) {
      for (int32_t begin = 0; begin < fill.tokens; begin += fill.batch) {
        std::vector<int32_t> positions(std::min(fill.batch, fill.tokens - begin));
        std::iota(positions.begin(), positions.end(), begin);
        const v1::AppendRequest append =
            testutil::MakeAppend(*fill.spec, kFixtureSeq, positions, fill.seed);
        const grpc::Status s =
            testutil::AppendStream(*stub, testutil::StreamMessages(append, 1 << 20, 1 << 20));
        if (!s.ok()) {
          return absl::InternalError(absl::StrCat("filling ", fill.spec->name(), " on ",
                                                  shared->nodes[n].name, ": ",
                                                  testutil::StatusText(s)));
        }
      }
    }
  }
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  bool help = false;
  absl::StatusOr<Options> options = ParseOptions(argc, argv, &help);
  if (!options.ok()) {
    std::fprintf(stderr, "kvmesh_soak: %s\n%s", std::string(options.status().message()).c_str(),
                 kUsage);
    return 2;
  }
  if (help) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  auto shared = std::make_unique<Shared>();
  shared->options = *options;
  const Options& o = shared->options;
  absl::StatusOr<NodeSupport> support = DetectSupport(o.node_binary);
  if (!support.ok()) {
    std::fprintf(stderr, "kvmesh_soak: %s\n", std::string(support.status().message()).c_str());
    return 2;
  }
  shared->support = *support;
  shared->long_spec = LongSpec(o.long_positions);
  shared->stream_spec = StreamSpec();
  shared->chaos_hybrid_spec = ChaosHybridSpec();
  shared->chaos_attention_spec = ChaosAttentionSpec();
  shared->long_seed = o.seed * 7919 + 1;
  shared->stream_seed = o.seed * 7919 + 2;

  const std::string load_before = LoadAverage();
  if (absl::Status s = StartNodes(shared.get()); !s.ok()) {
    std::fprintf(stderr, "kvmesh_soak: starting the nodes: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  if (absl::Status s = SetUpFixtures(shared.get()); !s.ok()) {
    std::fprintf(stderr, "kvmesh_soak: %s\n", std::string(s.message()).c_str());
    return 2;
  }

  std::array<RssTrack, 2> rss;
  for (int n = 0; n < 2; ++n) {
    rss[n].start = Rss(shared->nodes[n].process->pid());
    rss[n].peak = rss[n].start;
  }
  const int64_t bound = o.memory_budget + o.snapshot_budget +
                        (shared->support.inflight_budget ? o.inflight_budget : 0) + o.overhead;

  // The sampler: RSS every 100 ms, and whether both nodes still run.
  const absl::Time begin = absl::Now();
  std::atomic<bool> sampling{true};
  std::thread sampler([&] {
    while (sampling.load()) {
      for (int n = 0; n < 2; ++n) {
        testutil::NodeProcess& process = *shared->nodes[n].process;
        if (!process.Running()) {
          const std::string err = process.ReadStderr();
          shared->failures.Add(absl::StrCat(
              "node ", shared->nodes[n].name, " is not running: ", process.Stop().ToString(),
              "; its stderr ends:\n", err.substr(err.size() > 4000 ? err.size() - 4000 : 0)));
          shared->stop = true;
          sampling = false;
          return;
        }
        const int64_t now = Rss(process.pid());
        rss[n].current = now;
        if (now > rss[n].peak) {
          rss[n].peak = now;
          rss[n].peak_at_ms = (absl::Now() - begin) / absl::Milliseconds(1);
        }
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
  });

  SlowPool slow(o.slow_threads);
  shared->slow = &slow;
  std::vector<std::unique_ptr<Client>> clients;
  for (int i = 0; i < o.clients; ++i) clients.push_back(std::make_unique<Client>(shared.get(), i));
  const absl::Time end = begin + o.duration;
  std::fprintf(stderr,
               "soak: %d clients at %.1f ops/s for %s (seed %llu); nodes %s (pid %d) and %s "
               "(pid %d); RSS bound %s per node\n",
               o.clients, o.rate, absl::FormatDuration(o.duration).c_str(),
               static_cast<unsigned long long>(o.seed), shared->nodes[0].address.c_str(),
               static_cast<int>(shared->nodes[0].process->pid()), shared->nodes[1].address.c_str(),
               static_cast<int>(shared->nodes[1].process->pid()), MiB(bound).c_str());
  std::vector<std::thread> threads;
  for (auto& client : clients) {
    threads.emplace_back([&client, end] { client->Run(end); });
  }
  while (absl::Now() < end && !shared->stop.load()) {
    absl::SleepFor(std::min(o.progress, std::max(absl::Milliseconds(1), end - absl::Now())));
    if (absl::Now() >= end || shared->stop.load()) break;
    std::fprintf(stderr,
                 "soak: %3.0fs %8lld ops, %lld failures, %lld resyncs, %lld slots missed, "
                 "%lld in-flight refusals, %lld honest UNAVAILABLE; RSS %s %s / %s %s; load %s\n",
                 absl::ToDoubleSeconds(absl::Now() - begin),
                 static_cast<long long>(shared->ops_started.load()),
                 static_cast<long long>(shared->failures.count()),
                 static_cast<long long>(shared->resyncs.load()),
                 static_cast<long long>(shared->slots_missed.load()),
                 static_cast<long long>(shared->inflight_refusals.load()),
                 static_cast<long long>(shared->honest_unavailable.load()),
                 shared->nodes[0].name.c_str(), MiB(rss[0].current).c_str(),
                 shared->nodes[1].name.c_str(), MiB(rss[1].current).c_str(), LoadAverage().c_str());
  }
  shared->stop = true;
  for (std::thread& t : threads) t.join();
  slow.Finish();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - begin);

  // Final checks and cleanup, from a client of their own.
  auto final_owner = std::make_unique<Client>(shared.get(), o.clients);
  Client& final_client = *final_owner;
  const bool alive = sampling.load();
  if (alive) {
    final_client.VerifyFixtures();
    final_client.DeleteAllCaches();
    // Unreleased export leases pin snapshot-pool copies until they expire.
    const absl::Duration settle =
        absl::Seconds(2) +
        (shared->support.max_lease ? absl::Milliseconds(o.max_lease_ms) : absl::ZeroDuration());
    std::fprintf(stderr, "soak: every cache deleted; waiting %s for leases to expire\n",
                 absl::FormatDuration(settle).c_str());
    absl::SleepFor(settle);
  }
  sampling = false;
  sampler.join();
  for (int n = 0; n < 2; ++n) {
    rss[n].after = shared->nodes[n].process->Running() ? Rss(shared->nodes[n].process->pid()) : -1;
  }
  const std::string load_after = LoadAverage();

  Recorder all;
  for (auto& client : clients) all.Merge(client->recorder());
  all.Merge(slow.Merged());
  all.Merge(final_client.recorder());
  // Connections close before the nodes stop, so that their shutdown waits for no client.
  clients.clear();
  final_owner.reset();
  for (Node& node : shared->nodes) node.process->ReleaseChannel();

  // Stop the nodes: both must exit cleanly on SIGTERM.
  std::array<std::string, 2> exits;
  for (int n = 0; n < 2; ++n) {
    const testutil::ExitStatus status = shared->nodes[n].process->Stop();
    exits[n] = status.ToString();
    if (!status.clean()) {
      shared->failures.Add(
          absl::StrCat("node ", shared->nodes[n].name, " ", status.ToString(), " at the end"));
    }
  }
  // A failed run keeps the nodes' logs (NodeProcess removes them), for whoever looks into it.
  std::array<std::string, 2> logs;
  if (shared->failures.count() > 0) {
    const char* tmpdir = std::getenv("TEST_TMPDIR");
    for (int n = 0; n < 2; ++n) {
      logs[n] =
          absl::StrCat(tmpdir != nullptr && *tmpdir != '\0' ? tmpdir : "/tmp", "/kvmesh-soak-",
                       shared->nodes[n].name, "-", shared->nodes[n].process->pid(), ".log");
      std::ofstream(logs[n]) << shared->nodes[n].process->ReadStderr();
    }
  }
  for (int n = 0; n < 2; ++n) {
    if (rss[n].peak > bound) {
      shared->failures.Add(absl::StrCat("node ", shared->nodes[n].name, " peak RSS ",
                                        MiB(rss[n].peak), " above the bound ", MiB(bound)));
    }
    if (rss[n].after > bound) {
      shared->failures.Add(absl::StrCat("node ", shared->nodes[n].name, " RSS after cleanup ",
                                        MiB(rss[n].after), " above the bound ", MiB(bound)));
    }
  }

  std::printf("kvmesh_soak: %d clients, %.1f ops/s for %s, seed %llu, node %s\n", o.clients, o.rate,
              absl::FormatDuration(o.duration).c_str(), static_cast<unsigned long long>(o.seed),
              o.node_binary.c_str());
  std::printf("node flags: --memory-budget=%s --snapshot-budget=%s --max-message-bytes=%s",
              MiB(o.memory_budget).c_str(), MiB(o.snapshot_budget).c_str(),
              MiB(o.max_message_bytes).c_str());
  if (shared->support.inflight_budget)
    std::printf(" --inflight-budget=%s", MiB(o.inflight_budget).c_str());
  if (shared->support.stream_idle_timeout) {
    std::printf(" --stream-idle-timeout-ms=%lld", static_cast<long long>(o.stream_idle_timeout_ms));
  }
  if (shared->support.max_lease)
    std::printf(" --max-lease-ms=%lld", static_cast<long long>(o.max_lease_ms));
  std::printf("\n");
  if (!shared->support.inflight_budget || !shared->support.stream_idle_timeout ||
      !shared->support.max_lease) {
    std::printf("node lacks:%s%s%s (not passed; no in-flight term in the RSS bound)\n",
                shared->support.inflight_budget ? "" : " --inflight-budget",
                shared->support.stream_idle_timeout ? "" : " --stream-idle-timeout-ms",
                shared->support.max_lease ? "" : " --max-lease-ms");
  }
  std::printf(
      "load average before %s, after %s; %lld resyncs, %lld slots missed, %lld calls refused "
      "by a full in-flight budget (%lld verified ones by gRPC's quota), %lld verified or chaos "
      "calls UNAVAILABLE, %lld hostile calls ended by a closed connection, %lld migrations "
      "committed on the target despite an error\n\n",
      load_before.c_str(), load_after.c_str(), static_cast<long long>(shared->resyncs.load()),
      static_cast<long long>(shared->slots_missed.load()),
      static_cast<long long>(shared->inflight_refusals.load()),
      static_cast<long long>(shared->quota_cancels.load()),
      static_cast<long long>(shared->honest_unavailable.load()),
      static_cast<long long>(shared->hostile_drops.load()),
      static_cast<long long>(shared->migrations_after_error.load()));
  PrintReport(all, seconds, stdout);
  std::printf("\nRSS bound per node: memory %s + snapshot %s + in-flight %s + overhead %s = %s\n",
              MiB(o.memory_budget).c_str(), MiB(o.snapshot_budget).c_str(),
              MiB(shared->support.inflight_budget ? o.inflight_budget : 0).c_str(),
              MiB(o.overhead).c_str(), MiB(bound).c_str());
  for (int n = 0; n < 2; ++n) {
    std::printf("%s RSS: start %s, peak %s (at %.1f s), after cleanup %s; exit: %s\n",
                shared->nodes[n].name.c_str(), MiB(rss[n].start).c_str(), MiB(rss[n].peak).c_str(),
                rss[n].peak_at_ms.load() / 1000.0,
                rss[n].after < 0 ? "(not running)" : MiB(rss[n].after).c_str(), exits[n].c_str());
    if (!logs[n].empty()) std::printf("  its stderr: %s\n", logs[n].c_str());
  }
  const int64_t failures = shared->failures.count();
  std::printf("\n%lld failures\n", static_cast<long long>(failures));
  for (const std::string& f : shared->failures.kept()) std::printf("  %s\n", f.c_str());
  if (failures > static_cast<int64_t>(shared->failures.kept().size())) {
    std::printf("  ... and %lld more\n",
                static_cast<long long>(failures - shared->failures.kept().size()));
  }
  std::printf("%s\n", failures == 0 ? "PASS" : "FAIL");
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace soak
}  // namespace kvmesh

int main(int argc, char** argv) { return kvmesh::soak::Main(argc, argv); }

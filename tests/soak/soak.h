// Shared pieces of the soak (tests/soak/soak_main.cc): its options, the two nodes, the fixture
// caches every client uses, and the pool that runs the slow hostile calls (idle streams,
// stalled Reads) beside the clients so that they do not hold up the clients' fixed rate.
//
// Thread safety: Shared is set up before the clients start and read-only afterwards, except
// for its atomics, `failures` (thread-safe) and `slow` (thread-safe).
#ifndef KVMESH_TESTS_SOAK_SOAK_H_
#define KVMESH_TESTS_SOAK_SOAK_H_

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/time.h"
#include "kvmesh/v1/kvmesh.pb.h"
#include "tests/soak/stats.h"
#include "tests/testing/node_process.h"

namespace kvmesh {
namespace soak {

struct Options {
  absl::Duration duration = absl::Minutes(10);
  int clients = 8;
  double rate = 100;  // operations per second, all clients together
  uint64_t seed = 1;
  std::string node_binary;  // empty: the build's kvmesh-node
  // Node flags (passed to both nodes; the in-flight, idle and lease flags only when the node
  // knows them).
  int64_t memory_budget = int64_t{256} << 20;
  int64_t snapshot_budget = int64_t{128} << 20;
  int64_t inflight_budget = int64_t{128} << 20;
  int64_t stream_idle_timeout_ms = 5000;
  int64_t max_lease_ms = 20000;
  int64_t max_message_bytes = int64_t{32} << 20;
  // RSS bound after cleanup: memory + snapshot + in-flight budgets + this.
  int64_t overhead = int64_t{256} << 20;
  // Mix: percentages of hostile and of unverified ("chaos") operations; the rest are verified.
  int hostile_percent = 20;
  int chaos_percent = 25;
  // Hostile sizes.
  int visible_queries = 20000;
  int32_t long_positions = 16384;
  int64_t stream_bytes = int64_t{256} << 20;  // payload_bytes of the hostile AppendStreams
  int slow_threads = 6;                       // hostile calls that may linger at once
  absl::Duration progress = absl::Seconds(30);
  // >= 0: every checked call of this client is printed to stderr (reproducing a failure).
  int trace_client = -1;
  // After every verified operation, both nodes' sequences and snapshots must match the model.
  bool check_every_op = false;
};

// Which of the bounded-memory flags the node binary knows (read from its --helpfull).
struct NodeSupport {
  bool inflight_budget = false;
  bool stream_idle_timeout = false;
  bool max_lease = false;
  bool max_leases_per_receiver = false;
};

struct Node {
  std::string name;
  std::unique_ptr<testutil::NodeProcess> process;
  std::string address;
};

// Runs jobs on a few threads, each job with its thread's Recorder; TrySubmit refuses when every
// thread is busy, so a client draws another operation instead of queueing behind a lingering
// call.
class SlowPool {
 public:
  using Job = std::function<void(Recorder*)>;
  explicit SlowPool(int threads);
  ~SlowPool();  // Finish()
  bool TrySubmit(Job job);
  // Stops taking jobs and waits for the running ones.
  void Finish();
  // What the jobs recorded. REQUIRES: Finish() has returned.
  Recorder Merged() const;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  int idle_ = 0;
  bool done_ = false;
  std::vector<Recorder> recorders_;
  std::vector<std::thread> threads_;
};

// The fixture caches, created on both nodes before the clients start.
inline constexpr char kLongCache[] = "soak-long";      // one sequence of long_positions tokens
inline constexpr char kStreamCache[] = "soak-stream";  // hostile streams; a 16 MiB sequence
inline constexpr char kChaosHybrid[] = "soak-chaos-hybrid";
inline constexpr char kChaosAttention[] = "soak-chaos-attn";
inline constexpr int64_t kFixtureSeq = 0;  // the fixtures' sequence nobody changes
inline constexpr int32_t kStreamFixtureTokens = 1024;

struct Shared {
  Options options;
  NodeSupport support;
  std::array<Node, 2> nodes;
  Failures failures;
  SlowPool* slow = nullptr;
  std::atomic<bool> stop{false};
  std::atomic<int> huge_visible_in_flight{0};
  std::atomic<int64_t> ops_started{0};
  std::atomic<int64_t> resyncs{0};
  std::atomic<int64_t> slots_missed{0};
  std::atomic<int64_t> inflight_refusals{0};  // calls refused by a full in-flight budget
  std::atomic<int64_t> ambiguous_notes{0};
  std::atomic<int64_t> hostile_drops{0};           // hostile calls ended by a closed connection
  std::atomic<int64_t> honest_unavailable{0};      // verified and chaos calls that got UNAVAILABLE
  std::atomic<int64_t> migrations_after_error{0};  // committed on the target despite an error
  std::atomic<int64_t> quota_cancels{0};  // verified calls cancelled by gRPC's quota (RST_STREAM)
  v1::CacheSpec long_spec, stream_spec, chaos_hybrid_spec, chaos_attention_spec;
  uint64_t long_seed = 0, stream_seed = 0;  // pattern seeds of the fixture sequences
};

v1::CacheSpec LongSpec(int32_t positions);
v1::CacheSpec StreamSpec();
v1::CacheSpec ChaosHybridSpec();
v1::CacheSpec ChaosAttentionSpec();

}  // namespace soak
}  // namespace kvmesh

#endif  // KVMESH_TESTS_SOAK_SOAK_H_

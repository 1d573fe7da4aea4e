// One soak client: a thread that issues operations at a fixed rate against both nodes, drawn at
// random from three classes:
//
//  - verified ("v:"): valid and invalid operations on the client's own cache (a pair of caches
//    of the same name and spec, one per node) and reads of the fixtures; the client models what
//    the caches hold (model.h), so every status, position and byte is known in advance and any
//    difference fails the run;
//  - chaos ("c:"): operations on caches every client shares, whose outcome depends on the other
//    clients; only the status is checked against the codes the operation may return, plus the
//    invariants of the answer (a Read's data adds up to its header, one Visibility per query);
//  - hostile ("h:"): malformed and abusive calls (docs/api.md error table, issue 14): malformed
//    specs, wrong payload sizes, unknown names, negative positions, 10 KB names, huge Visible
//    queries, unfinished, idle and cancelled AppendStreams, abandoned Reads, oversized messages,
//    PeerService calls with unknown transports, receivers and guessed leases. Each has its
//    expected code.
//
// Ambiguous outcomes of verified calls (a deadline or an UNAVAILABLE after which the call may or
// may not have happened) are resolved by recreating the client's cache ("resync").
//
// Thread safety: a Client runs on one thread; Shared's thread-safe parts are shared.
#ifndef KVMESH_TESTS_SOAK_CLIENT_H_
#define KVMESH_TESTS_SOAK_CLIENT_H_

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "kvmesh/v1/kvmesh.grpc.pb.h"
#include "kvmesh/v1/peer.grpc.pb.h"
#include "tests/soak/model.h"
#include "tests/soak/soak.h"
#include "tests/soak/stats.h"

namespace kvmesh {
namespace soak {

using Codes = std::vector<grpc::StatusCode>;

// Deadline of every call whose outcome the client waits for.
inline constexpr absl::Duration kCallTimeout = absl::Seconds(60);

// A channel to `address` without message size limits and with a connection of its own.
std::shared_ptr<grpc::Channel> NewChannel(const std::string& address, int salt);

// `text`, cut to `n` bytes with its length noted, for failure messages.
std::string Short(const std::string& text, size_t n = 300);

// Records calls into a Recorder and checks their statuses; failures go to Shared::failures,
// tagged with the client. Used by the clients and by their jobs on the SlowPool.
class Checker {
 public:
  Checker(Shared* shared, Recorder* recorder, int client)
      : shared_(shared), recorder_(recorder), client_(client) {}

  // Records the status and latency (since `start`) of a call under `kind`, and screens it:
  // INTERNAL, UNKNOWN and over-long error messages are failures whatever the operation.
  void Record(const std::string& kind, const grpc::Status& status, absl::Time start);
  // Whether `status` is one of `allowed`; when not, a failure naming `what`.
  bool Expect(const std::string& kind, const grpc::Status& status, const Codes& allowed,
              const std::string& what);
  void Fail(const std::string& kind, const std::string& what);

 private:
  Shared* shared_;
  Recorder* recorder_;
  int client_;
};

class Client {
 public:
  Client(Shared* shared, int index);

  // Runs operations at this client's share of the rate until Shared::stop or the deadline.
  void Run(absl::Time end);

  Recorder& recorder() { return recorder_; }

  // For main, after the clients have stopped (they record like any call):
  // reads every fixture sequence in full on both nodes and checks every byte;
  void VerifyFixtures();
  // deletes every cache of both nodes, then checks that none is left.
  void DeleteAllCaches();

 private:
  // ---- calls and checks ----
  // Runs `call` with a fresh context (deadline `timeout`), records its status and latency
  // under `kind`, and screens it (INTERNAL, UNKNOWN, an over-long message).
  grpc::Status Rpc(const std::string& kind,
                   const std::function<grpc::Status(grpc::ClientContext*)>& call,
                   absl::Duration timeout = kCallTimeout);
  bool Expect(const std::string& kind, const grpc::Status& status, const Codes& allowed,
              const std::string& what);
  void Fail(const std::string& kind, const std::string& what) { check_.Fail(kind, what); }
  std::string Where(int node) const;

  // Random helpers.
  uint64_t Rand(uint64_t n);               // [0, n)
  int32_t RandIn(int32_t lo, int32_t hi);  // [lo, hi]
  bool Chance(int percent);
  uint64_t NextSeed();

  // ---- verified: the client's own cache ----
  void Verified();
  void VerifiedOp();
  void CreateOwn(int node);
  void Recreate(const std::string& why);
  void Resync(const std::string& why);
  // Handles a status that leaves the model unknown; true when it did (the op should stop).
  bool Ambiguous(const grpc::Status& status, const std::string& kind);
  int64_t PickSeq(const NodeModel& node, int live_percent);
  std::vector<int32_t> AppendPositions(const SeqModel* seq, int32_t count);
  void VAppend(bool stream);
  void VRead();
  void VReadFixture();
  void VVisible();
  void VCopyLocal();
  void VCopyRemote();
  void VRemove(bool middle);
  void VCanResume();
  void VListSequences();
  void VGetCache();
  void VSnapshot();
  void VRestore();
  void VRestoreLive();
  void VMerge();
  void VSplit();
  void VDrop();
  void VListSnapshots();
  void VMigrate();
  void VMigrateSnapshot();
  // ListSequences and ListSnapshots of the own cache on `node`; false when a call failed.
  bool List(int node, const std::string& kind, const std::string& what,
            v1::ListSequencesResponse* sequences, v1::ListSnapshotsResponse* snapshots);
  // After a Migrate or MigrateSnapshot error: either nothing happened or the target committed
  // (and the source may have let go, unless keep); the model follows, anything else fails.
  void ReconcileMigrate(const std::string& kind, const std::string& what, int n, int64_t seq,
                        int64_t target_seq, bool keep);
  void ReconcileMigrateSnapshot(const std::string& kind, const std::string& what, int n,
                                uint64_t id, bool keep);
  void VSpeculate();
  // A Read of `seq` on `node` checked against `model` (null: must be NOT_FOUND).
  void ReadAndCheck(const std::string& kind, int node, const std::string& cache, int64_t seq,
                    const CacheModel& cache_model, const SeqModel* model, int32_t begin,
                    std::optional<int32_t> end);
  bool SnapshotIdFresh(int node, uint64_t id, const std::string& kind);

  // ---- chaos: the shared caches ----
  void Chaos();
  int32_t& Hint(const std::string& cache, int node, int64_t seq);
  void ChaosAppend(const v1::CacheSpec& spec, int node, int64_t seq, bool stream);
  void ChaosRead(const v1::CacheSpec& spec, int node, int64_t seq);
  void ChaosScratch(int node);
  std::string CheckReadShape(const v1::CacheSpec& spec, const v1::ReadHeader& header,
                             size_t payload_size);

  // ---- hostile ----
  void Hostile();
  // After a refused call on the own cache: ListSequences must match the model.
  void CheckUnchanged(int node, const std::string& kind, const std::string& what);
  void HMalformedSpec();
  void HBadAppend();
  void HBadStreamInline();
  void HUnknownCache();
  void HInvalidArguments();
  void HLongName();
  void HHugeVisible();
  void HSlowStream();
  void HAbandonRead();
  void HStalledRead();
  void HOversizedMessage();
  void HPeer();

  Shared* shared_;
  const int index_;
  std::mt19937_64 rng_;
  uint64_t seed_counter_ = 0;
  Recorder recorder_;
  Checker check_;
  std::array<std::shared_ptr<grpc::Channel>, 2> channels_;
  std::array<std::unique_ptr<v1::CacheService::Stub>, 2> cache_;
  std::array<std::unique_ptr<v1::PeerService::Stub>, 2> peer_;
  // Hostile calls go over connections of their own, as an attacker's would: what the node does
  // to them (gRPC may close a connection to reclaim memory) must not land on the honest calls,
  // and when honest calls suffer anyway, that is the node's doing.
  std::array<std::shared_ptr<grpc::Channel>, 2> hostile_channels_;
  std::array<std::unique_ptr<v1::CacheService::Stub>, 2> hcache_;
  std::array<std::unique_ptr<v1::PeerService::Stub>, 2> hpeer_;
  bool in_hostile_ = false;    // Hostile() is running: a dropped connection is no failure
  bool needs_resync_ = false;  // the model may be wrong: recreate the cache before the next op
  std::vector<std::string> op_calls_;  // the current operation's checked calls (--check-every-op)

  CacheModel own_;
  int generation_ = 0;
  std::array<uint64_t, 2> max_snapshot_id_{};  // per node, of own_

  // Chaos: the offset each (cache, node, seq) was last seen at.
  std::map<std::tuple<std::string, int, int64_t>, int32_t> hints_;
  // Chaos: the last snapshot id each (cache, node) was seen to give.
  std::map<std::pair<std::string, int>, uint64_t> snapshot_hints_;
  // A CreateCache of the own cache that ended ambiguously (the cache may exist).
  std::array<bool, 2> create_uncertain_{};
  uint64_t bad_names_ = 0;
};

// The fixture sequences as models, for reads that must return exact bytes.
const CacheModel& LongFixtureModel(const Shared& shared);
const CacheModel& StreamFixtureModel(const Shared& shared);

}  // namespace soak
}  // namespace kvmesh

#endif  // KVMESH_TESTS_SOAK_CLIENT_H_

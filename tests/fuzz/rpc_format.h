// The input format of rpc_fuzzer, shared with the seeds that make_seeds.cc writes for it.
//
// An input is a session of at most kMaxRecords calls, each a record
//   [1 byte: Rpc, modulo kRpcCount] [2 bytes: length L, little-endian] [L bytes]
// whose bytes are the request message in protobuf wire format; for AppendStream they are the
// stream's messages, each [2 bytes: length][AppendStreamRequest]. Bytes that do not parse as the
// message end the session (libFuzzer's mutations then keep to inputs that parse). A record cut
// short by the end of the input is sent with the bytes there are.
//
// The calls go to node "a" (CacheService and PeerService on one server), whose peer is node
// "b"; both start every session with the caches of BaselineSpecs() holding BaselineSequences().
#ifndef KVMESH_TESTS_FUZZ_RPC_FORMAT_H_
#define KVMESH_TESTS_FUZZ_RPC_FORMAT_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "google/protobuf/message.h"
#include "kvmesh/v1/kvmesh.pb.h"

namespace kvmesh {
namespace fuzz {

enum class Rpc : uint8_t {
  // kvmesh.v1.CacheService
  kCreateCache,
  kDeleteCache,
  kGetCache,
  kListCaches,
  kAppend,
  kAppendStream,
  kRead,
  kVisible,
  kCopyPrefix,
  kRemove,
  kCanResume,
  kListSequences,
  kSnapshot,
  kRestore,
  kMergeSnapshots,
  kSplitSnapshot,
  kDropSnapshot,
  kListSnapshots,
  kCommitSpeculation,
  kMigrate,
  kMigrateSnapshot,
  kListMembers,
  // kvmesh.v1.PeerService
  kNodeInfo,
  kExport,
  kFetch,
  kRelease,
  kPull,
  kNcclConnect,
  kNcclSend,
  kPeerRemove,  // PeerService.Remove
};
inline constexpr int kRpcCount = static_cast<int>(Rpc::kPeerRemove) + 1;
inline constexpr size_t kMaxRecords = 24;

// The method's name, e.g. "CreateCache".
const char* RpcName(Rpc rpc);

// The names of the two nodes.
inline constexpr char kNodeA[] = "a";
inline constexpr char kNodeB[] = "b";

// The caches both nodes hold at the start of a session: "attn" (full attention, NEOX rope, F16)
// and "hybrid" (sliding attention, a rotating ring and a recurrent group with a delta state,
// BF16).
std::vector<v1::CacheSpec> BaselineSpecs();
// What each baseline cache holds: sequence 0 at [0, 6) and sequence 1 at [0, 3) of "attn",
// sequence 0 at [0, 5) of "hybrid", with a snapshot (id 1) of each cache's sequence 0.
struct BaselineSequence {
  std::string cache;
  int64_t seq;
  int32_t begin;
  int32_t end;
};
std::vector<BaselineSequence> BaselineSequences();

// Appends one record.
void AppendRecord(std::string* input, Rpc rpc, const google::protobuf::Message& request);
void AppendStreamRecord(std::string* input, const std::vector<v1::AppendStreamRequest>& stream);

}  // namespace fuzz
}  // namespace kvmesh

#endif  // KVMESH_TESTS_FUZZ_RPC_FORMAT_H_

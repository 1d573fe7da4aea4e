// The input format of rpc_fuzzer, shared with the seeds that make_seeds.cc writes for it.
//
// An input is a session of at most kMaxRecords calls, each a record
//   [1 byte: Rpc, modulo kRpcCount] [2 bytes: length L, little-endian] [L bytes]
// whose bytes are the request message in protobuf wire format; for AppendStream they are the
// stream's messages, each [2 bytes: length][AppendStreamRequest]. Bytes that do not parse as the
// message end the session (libFuzzer's mutations then keep to inputs that parse). A record cut
// short by the end of the input is sent with the bytes there are.
//
// The calls go to node "a", whose peer is node "b"; both start every session with
// BaselineCaches() holding BaselineSequences().
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
  kReserve,
  kSetRetention,
  kLookupPrefix,
  // kvmesh.v1.PeerService
  kNodeInfo,
  kExport,
  kFetch,
  kRelease,
  kPull,
  kNcclConnect,
  kNcclSend,
  kPeerRemove,        // PeerService.Remove
  kPeerLookupPrefix,  // PeerService.LookupPrefix
  kPlace,
};
inline constexpr int kRpcCount = static_cast<int>(Rpc::kPlace) + 1;
inline constexpr size_t kMaxRecords = 24;

// The method's name, e.g. "CreateCache".
const char* RpcName(Rpc rpc);

// Who makes a CacheService call: the record's first byte is rpc + kRpcCount * principal
// (principal modulo kPrincipalCount), so a plain Rpc byte is the admin. The nodes run with a
// token file (rpc_fuzzer.cc) listing an admin of tenant "default" and tenants "t1" and "t2"
// (t2 with a quota of one cache). PeerService calls carry no token: the peer plane knows its
// callers by their address.
enum class Principal : uint8_t {
  kAdmin,           // the admin's token: tenant "default"
  kTenant1,         // t1's token
  kTenant2,         // t2's token
  kAnonymous,       // no authorization metadata: UNAUTHENTICATED
  kUnknownToken,    // a token the file does not list: UNAUTHENTICATED
  kTenant1AsOther,  // t1's token naming tenant "default" in kvmesh-tenant: PERMISSION_DENIED
  kAdminAsTenant1,  // the admin's token acting for t1
};
inline constexpr int kPrincipalCount = static_cast<int>(Principal::kAdminAsTenant1) + 1;
static_assert(kRpcCount * kPrincipalCount <= 256, "a record's first byte holds both");

// The names of the two nodes.
inline constexpr char kNodeA[] = "a";
inline constexpr char kNodeB[] = "b";

// The specs of the caches both nodes hold at the start of a session: "attn" (full attention,
// NEOX rope, F16) and "hybrid" (sliding attention, a rotating ring and a recurrent group with a
// delta state, BF16).
std::vector<v1::CacheSpec> BaselineSpecs();
// The caches themselves: "attn" and "hybrid" of tenant "default", and an "attn" of tenant "t1"
// (names are per tenant).
struct BaselineCache {
  std::string tenant;
  std::string name;
};
std::vector<BaselineCache> BaselineCaches();
// What they hold: sequence 0 at [0, 6) and sequence 1 at [0, 3) of each "attn", sequence 0 at
// [0, 5) of "hybrid", with a snapshot (id 1) of each cache's sequence 0. Every position p holds
// token id BaselineTokenId(p), so that the sequences share a prefix that LookupPrefix finds
// (blocks of 2 tokens).
struct BaselineSequence {
  std::string tenant;
  std::string cache;
  int64_t seq;
  int32_t begin;
  int32_t end;
};
std::vector<BaselineSequence> BaselineSequences();
inline int32_t BaselineTokenId(int32_t pos) { return 100 + pos; }

// Appends one record.
void AppendRecord(std::string* input, Rpc rpc, const google::protobuf::Message& request,
                  Principal principal = Principal::kAdmin);
void AppendStreamRecord(std::string* input, const std::vector<v1::AppendStreamRequest>& stream,
                        Principal principal = Principal::kAdmin);

}  // namespace fuzz
}  // namespace kvmesh

#endif  // KVMESH_TESTS_FUZZ_RPC_FORMAT_H_

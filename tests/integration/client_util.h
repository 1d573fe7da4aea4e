// Client-side helpers for the integration tests: blocking calls of every kvmesh.v1 RPC with a
// deadline, builders of specs and Append batches whose payloads come from
// tests/testing/pattern.h, a model of what a sequence stores (to compute the expected bytes of a
// Read), and raw calls of the health and reflection services (Debian's gRPC ships no generated
// code for reflection, so its messages are encoded by hand).
//
// Thread safety: stateless functions, safe from any thread with a thread-safe stub; a
// SequenceModel is a plain value (one owner at a time).
#ifndef KVMESH_TESTS_INTEGRATION_CLIENT_UTIL_H_
#define KVMESH_TESTS_INTEGRATION_CLIENT_UTIL_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "cache/spec.h"
#include "google/protobuf/descriptor.pb.h"
#include "grpcpp/grpcpp.h"
#include "kvmesh/v1/kvmesh.grpc.pb.h"

namespace kvmesh {
namespace testutil {

using Stub = v1::CacheService::Stub;

// Deadline of every call made through these helpers.
inline constexpr absl::Duration kCallTimeout = absl::Seconds(60);

void SetDeadline(grpc::ClientContext* context, absl::Duration timeout = kCallTimeout);

// "code: message", for assertion output.
std::string StatusText(const grpc::Status& status);

// ---- specs ----------------------------------------------------------------------------------

struct AttentionOptions {
  int32_t num_layers = 2;
  int32_t num_kv_heads = 2;
  int32_t head_dim_k = 4;
  int32_t head_dim_v = 4;
  // Window: FULL unless one of these is set.
  int32_t sliding_window = 0;
  int32_t sliding_memory = 0;
  int32_t chunk = 0;
  v1::RopeType rope = v1::ROPE_TYPE_NORMAL;
  int32_t rope_dims = 2;  // when rope != NONE
};

v1::LayerGroup AttentionGroupProto(const AttentionOptions& options);

struct RotatingOptions {
  int32_t num_layers = 1;
  int32_t num_kv_heads = 1;
  int32_t head_dim_k = 4;
  int32_t head_dim_v = 4;
  int32_t max_size = 4;
  v1::RopeType rope = v1::ROPE_TYPE_NORMAL;
  int32_t rope_dims = 2;  // when rope != NONE
};

v1::LayerGroup RotatingGroupProto(const RotatingOptions& options);

struct RecurrentOptions {
  int32_t num_layers = 1;
  int32_t conv_tail = 2;
  int32_t conv_dim = 3;
  int32_t num_v_heads = 1;  // 0: conv state only
  int32_t head_v_dim = 2;
  int32_t head_k_dim = 2;
};

v1::LayerGroup RecurrentGroupProto(const RecurrentOptions& options);

v1::CacheSpec SpecProto(const std::string& name, int32_t max_sequences, int32_t capacity,
                        int32_t max_batch, std::vector<v1::LayerGroup> groups,
                        v1::DType dtype = v1::DTYPE_F32);

// One sequence of a ring (a Rotating group of 16 rows, 8 KV heads of 128, F32: 8 KiB a token)
// taking up to `max_batch` tokens per Append. An AppendStream into it buffers its payload in host
// memory (a ring is written in place, so its rows cannot be taken before the commit) and holds
// the in-flight budget: the cache of the budget's tests.
v1::CacheSpec BigTokenRingSpec(const std::string& name, int32_t max_batch);

// The engine's view of `proto`. REQUIRES: a valid spec (asserted by the caller's test).
CacheSpec EngineSpec(const v1::CacheSpec& proto);

// ---- payloads -------------------------------------------------------------------------------

// The pattern id of token (seq, pos) as first appended: equal ids give equal K/V rows.
uint64_t TokenId(int64_t seq, int32_t pos, uint64_t seed = 0);

// The pattern id of the Recurrent state of `seq` after its token at `pos`.
uint64_t StateId(int64_t seq, int32_t pos, uint64_t seed = 0);

// What a sequence stores, per group: position -> pattern id of the row it holds.
using SequenceModel = std::vector<std::map<int32_t, uint64_t>>;

// An Append of `positions` of `seq` whose rows are TokenId(seq, pos, seed). Recurrent groups
// get the state StateId(seq, last position, seed).
v1::AppendRequest MakeAppend(const v1::CacheSpec& spec, int64_t seq,
                             const std::vector<int32_t>& positions, uint64_t seed = 0);

// An Append over several sequences: tokens[i] = (seqs[i], positions[i]). Recurrent groups get,
// per distinct sequence in order of first appearance, StateId of its last token in the batch.
v1::AppendRequest MakeMultiAppend(const v1::CacheSpec& spec, const std::vector<int64_t>& seqs,
                                  const std::vector<int32_t>& positions, uint64_t seed = 0);

// A speculative Append of `positions` of `seq`: rows TokenId(seq, pos, seed) and, for
// Recurrent groups, one state per token, StateId(seq, pos, seed).
v1::AppendRequest MakeSpeculativeAppend(const v1::CacheSpec& spec, int64_t seq,
                                        const std::vector<int32_t>& positions, uint64_t seed = 0);

// Records an Append of `positions` (ids TokenId(seq, pos, seed)) in every group of `model`.
void ModelAppend(const v1::CacheSpec& spec, int64_t seq, const std::vector<int32_t>& positions,
                 uint64_t seed, SequenceModel* model);

// The bytes a Read must return when group g returns `positions[g]` of a sequence whose rows are
// given by `model` (REQUIRES: every position is in the model).
std::string ExpectedReadPayload(const v1::CacheSpec& spec, const SequenceModel& model,
                                const std::vector<std::vector<int32_t>>& positions);

// ---- calls ----------------------------------------------------------------------------------

grpc::Status CreateCache(Stub& stub, const v1::CacheSpec& spec,
                         v1::CreateCacheResponse* response = nullptr);
grpc::Status DeleteCache(Stub& stub, const std::string& cache);
grpc::Status GetCache(Stub& stub, const std::string& cache, v1::GetCacheResponse* response);
grpc::Status ListCaches(Stub& stub, v1::ListCachesResponse* response);
grpc::Status Append(Stub& stub, const v1::AppendRequest& request,
                    v1::AppendResponse* response = nullptr);
// Sends `messages` in order over one AppendStream, then closes the stream.
grpc::Status AppendStream(Stub& stub, const std::vector<v1::AppendStreamRequest>& messages,
                          v1::AppendResponse* response = nullptr);
// The same Append as a stream: header (with the first `first_chunk` bytes), then the payload
// in chunks of `chunk_bytes`.
std::vector<v1::AppendStreamRequest> StreamMessages(const v1::AppendRequest& request,
                                                    size_t first_chunk, size_t chunk_bytes);

struct ReadOutput {
  v1::ReadHeader header;
  std::string payload;
  int messages = 0;
  bool header_only_in_first = true;  // no later message carried a header
  std::vector<size_t> chunk_sizes;
};
grpc::Status Read(Stub& stub, const v1::ReadRequest& request, ReadOutput* output);
v1::ReadRequest ReadRequest(const std::string& cache, int64_t seq, int32_t begin = 0,
                            std::optional<int32_t> end = std::nullopt, int32_t max_chunk_bytes = 0);
// Positions per group of a Read header, in group order.
std::vector<std::vector<int32_t>> HeaderPositions(const v1::ReadHeader& header);

grpc::Status Visible(Stub& stub, const v1::VisibleRequest& request, v1::VisibleResponse* response);
// A RESOURCE_EXHAUSTED status's details (a google.rpc.Status holding an ErrorInfo of domain
// "kvmesh.io"), decoded with the standard messages: "REASON [group=G ]needed=N free=F total=T";
// "" without details; what went wrong when they do not decode.
std::string ShortageText(const grpc::Status& status);
// With `offset`, dst's offset as the response gives it.
grpc::Status CopyPrefix(Stub& stub, const std::string& cache, int64_t src, int64_t dst,
                        int32_t length, int32_t require_src_offset = 0, int32_t* offset = nullptr);
grpc::Status Remove(Stub& stub, const std::string& cache, int64_t seq, int32_t begin,
                    std::optional<int32_t> end = std::nullopt);
grpc::Status CanResume(Stub& stub, const std::string& cache, int64_t seq, int32_t pos,
                       bool* can_resume);
// Reserve; with `usage`, the response's.
grpc::Status Reserve(Stub& stub, const std::string& cache, int64_t seq, int32_t positions,
                     int64_t ttl_ms = 0, v1::CacheUsage* usage = nullptr);
// SetRetention; with `response`, the response.
grpc::Status SetRetention(Stub& stub, const std::string& cache, int64_t seq, int32_t priority,
                          bool pinned, int64_t ttl_ms,
                          v1::SetRetentionResponse* response = nullptr);
// ListSequences, each sequence's idle_ms cleared (it changes with time).
grpc::Status ListSequences(Stub& stub, const std::string& cache,
                           v1::ListSequencesResponse* response);
grpc::Status LookupPrefix(Stub& stub, const std::string& cache, const std::vector<int32_t>& tokens,
                          v1::LookupPrefixResponse* response, int32_t max_matches = 0,
                          v1::LookupScope scope = v1::LOOKUP_SCOPE_LOCAL, bool verify = false);

// Snapshots and speculation. Output pointers may be null.
grpc::Status Snapshot(Stub& stub, const std::string& cache, int64_t seq, int32_t from_offset,
                      v1::SnapshotInfo* snapshot = nullptr);
grpc::Status Restore(Stub& stub, const std::string& cache, int64_t seq,
                     std::optional<uint64_t> snapshot_id, int32_t target);
grpc::Status MergeSnapshots(Stub& stub, const std::string& cache, uint64_t parent, uint64_t child,
                            v1::SnapshotInfo* merged = nullptr);
grpc::Status SplitSnapshot(Stub& stub, const std::string& cache, uint64_t snapshot_id, int32_t at,
                           v1::SplitSnapshotResponse* response = nullptr);
grpc::Status DropSnapshot(Stub& stub, const std::string& cache, uint64_t snapshot_id);
grpc::Status ListSnapshots(Stub& stub, const std::string& cache,
                           v1::ListSnapshotsResponse* response);
grpc::Status CommitSpeculation(Stub& stub, const std::string& cache, int64_t seq, int32_t accepted,
                               int32_t* offset = nullptr);

// grpc.health.v1.Health/Check of `service` ("" = the server), through kvmesh::HealthClient
// (service/common/health_client.h). *serving_status is the response's enum value (1 = SERVING, 2 =
// NOT_SERVING).
grpc::Status HealthCheck(const std::shared_ptr<grpc::Channel>& channel, const std::string& service,
                         int* serving_status);

// A length-delimited protobuf field `number` holding `value` (a string, bytes or a message), as
// the wire has it: for requests built by hand (bytes no generated class would send).
std::string StringField(int number, const std::string& value);

// Calls `method` ("/package.Service/Method") with `request`'s bytes as its one message and
// collects the bytes of every response until the server ends the call; its status.
grpc::Status CallRaw(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                     const std::string& request, std::vector<std::string>* responses);
// The same with each of `requests` as a message, in order (a client or bidirectional stream).
grpc::Status CallRaw(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                     const std::vector<std::string>& requests, std::vector<std::string>* responses);

// grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo with list_services.
grpc::Status ListReflectedServices(const std::shared_ptr<grpc::Channel>& channel,
                                   std::vector<std::string>* services);

// The same with file_containing_symbol: the file that defines `symbol` and those it imports,
// as reflection sends them; NOT_FOUND with the server's message when it knows no such symbol.
grpc::Status ReflectedFilesOfSymbol(const std::shared_ptr<grpc::Channel>& channel,
                                    const std::string& symbol,
                                    std::vector<google::protobuf::FileDescriptorProto>* files);

}  // namespace testutil
}  // namespace kvmesh

#endif  // KVMESH_TESTS_INTEGRATION_CLIENT_UTIL_H_

#include "tests/integration/client_util.h"

#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "google/protobuf/unknown_field_set.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"
#include "grpcpp/generic/generic_stub.h"
#include "service/common/convert.h"
#include "service/common/health_client.h"
#include "tests/testing/pattern.h"

namespace kvmesh {
namespace testutil {
namespace {

void AppendVarint(uint64_t value, std::string* out) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>((value & 0x7F) | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

grpc::ByteBuffer ToByteBuffer(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

std::string FromByteBuffer(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  std::string out;
  if (!buffer.Dump(&slices).ok()) return out;
  for (const grpc::Slice& slice : slices) {
    out.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  return out;
}

// Waits for the next event of `cq` and checks it is `tag`.
bool Await(grpc::CompletionQueue* cq, void* tag) {
  void* got = nullptr;
  bool ok = false;
  return cq->Next(&got, &ok) && got == tag && ok;
}

void Drain(grpc::CompletionQueue* cq) {
  cq->Shutdown();
  void* tag;
  bool ok;
  while (cq->Next(&tag, &ok)) {
  }
}

std::vector<uint64_t> Ids(const std::vector<int64_t>& seqs, const std::vector<int32_t>& positions,
                          uint64_t seed) {
  std::vector<uint64_t> ids;
  ids.reserve(positions.size());
  for (size_t i = 0; i < positions.size(); ++i) ids.push_back(TokenId(seqs[i], positions[i], seed));
  return ids;
}

}  // namespace

std::string StringField(int number, const std::string& value) {
  std::string out;
  AppendVarint((static_cast<uint64_t>(number) << 3) | 2, &out);
  AppendVarint(value.size(), &out);
  out += value;
  return out;
}

void SetDeadline(grpc::ClientContext* context, absl::Duration timeout) {
  context->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}

std::string StatusText(const grpc::Status& status) {
  return absl::StrCat(status.error_code(), ": ", status.error_message());
}

v1::LayerGroup AttentionGroupProto(const AttentionOptions& o) {
  v1::LayerGroup group;
  group.set_num_layers(o.num_layers);
  v1::Attention* a = group.mutable_attention();
  a->set_num_kv_heads(o.num_kv_heads);
  a->set_head_dim_k(o.head_dim_k);
  a->set_head_dim_v(o.head_dim_v);
  if (o.sliding_window > 0) {
    a->mutable_window()->mutable_sliding()->set_window(o.sliding_window);
    a->mutable_window()->mutable_sliding()->set_memory(o.sliding_memory);
  } else if (o.chunk > 0) {
    a->mutable_window()->mutable_chunked()->set_chunk(o.chunk);
  }
  a->mutable_rope()->set_type(o.rope);
  if (o.rope != v1::ROPE_TYPE_NONE) {
    a->mutable_rope()->set_dims(o.rope_dims);
    a->mutable_rope()->set_base(10000.0f);
    a->mutable_rope()->set_freq_scale(1.0f);
  }
  return group;
}

v1::LayerGroup RotatingGroupProto(const RotatingOptions& o) {
  v1::LayerGroup group;
  group.set_num_layers(o.num_layers);
  v1::Rotating* r = group.mutable_rotating();
  r->set_num_kv_heads(o.num_kv_heads);
  r->set_head_dim_k(o.head_dim_k);
  r->set_head_dim_v(o.head_dim_v);
  r->set_max_size(o.max_size);
  r->mutable_rope()->set_type(o.rope);
  if (o.rope != v1::ROPE_TYPE_NONE) {
    r->mutable_rope()->set_dims(o.rope_dims);
    r->mutable_rope()->set_base(10000.0f);
    r->mutable_rope()->set_freq_scale(1.0f);
  }
  return group;
}

v1::LayerGroup RecurrentGroupProto(const RecurrentOptions& o) {
  v1::LayerGroup group;
  group.set_num_layers(o.num_layers);
  v1::Recurrent* r = group.mutable_recurrent();
  r->set_conv_tail(o.conv_tail);
  r->set_conv_dim(o.conv_dim);
  r->set_num_v_heads(o.num_v_heads);
  r->set_head_v_dim(o.head_v_dim);
  r->set_head_k_dim(o.head_k_dim);
  return group;
}

v1::CacheSpec BigTokenRingSpec(const std::string& name, int32_t max_batch) {
  RotatingOptions r;
  r.num_kv_heads = 8;
  r.head_dim_k = 128;
  r.head_dim_v = 128;
  r.max_size = 16;
  r.rope = v1::ROPE_TYPE_NONE;
  return SpecProto(name, 1, max_batch, max_batch, {RotatingGroupProto(r)});
}

v1::CacheSpec SpecProto(const std::string& name, int32_t max_sequences, int32_t capacity,
                        int32_t max_batch, std::vector<v1::LayerGroup> groups, v1::DType dtype) {
  v1::CacheSpec spec;
  spec.set_name(name);
  spec.set_dtype(dtype);
  spec.set_max_sequences(max_sequences);
  spec.set_capacity(capacity);
  spec.set_max_batch(max_batch);
  for (v1::LayerGroup& group : groups) *spec.add_groups() = std::move(group);
  return spec;
}

CacheSpec EngineSpec(const v1::CacheSpec& proto) {
  absl::StatusOr<CacheSpec> spec = SpecFromProto(proto);
  return spec.ok() ? *std::move(spec) : CacheSpec{};
}

uint64_t TokenId(int64_t seq, int32_t pos, uint64_t seed) {
  return Mix64(seed) ^ (static_cast<uint64_t>(seq) << 32) ^ static_cast<uint32_t>(pos);
}

uint64_t StateId(int64_t seq, int32_t pos, uint64_t seed) {
  return Mix64(TokenId(seq, pos, seed) ^ 0x57A7E57A7Eull);
}

v1::AppendRequest MakeAppend(const v1::CacheSpec& spec, int64_t seq,
                             const std::vector<int32_t>& positions, uint64_t seed) {
  return MakeMultiAppend(spec, std::vector<int64_t>(positions.size(), seq), positions, seed);
}

v1::AppendRequest MakeMultiAppend(const v1::CacheSpec& spec, const std::vector<int64_t>& seqs,
                                  const std::vector<int32_t>& positions, uint64_t seed) {
  v1::AppendRequest request;
  request.set_cache(spec.name());
  for (size_t i = 0; i < positions.size(); ++i) {
    v1::Token* token = request.add_tokens();
    token->set_seq(seqs[i]);
    token->set_pos(positions[i]);
  }
  // The state after the batch of each distinct sequence, in order of first appearance.
  std::vector<int64_t> order;
  std::map<int64_t, int32_t> last;
  for (size_t i = 0; i < positions.size(); ++i) {
    if (last.find(seqs[i]) == last.end()) order.push_back(seqs[i]);
    last[seqs[i]] = positions[i];
  }
  std::vector<uint64_t> states;
  for (int64_t seq : order) states.push_back(StateId(seq, last[seq], seed));
  const std::vector<uint8_t> payload =
      AppendPayload(EngineSpec(spec), Ids(seqs, positions, seed), states);
  request.set_payload(payload.data(), payload.size());
  return request;
}

v1::AppendRequest MakeSpeculativeAppend(const v1::CacheSpec& spec, int64_t seq,
                                        const std::vector<int32_t>& positions, uint64_t seed) {
  v1::AppendRequest request;
  request.set_cache(spec.name());
  request.set_speculative(true);
  std::vector<uint64_t> states;
  for (int32_t pos : positions) {
    v1::Token* token = request.add_tokens();
    token->set_seq(seq);
    token->set_pos(pos);
    states.push_back(StateId(seq, pos, seed));
  }
  const std::vector<uint8_t> payload = AppendPayload(
      EngineSpec(spec), Ids(std::vector<int64_t>(positions.size(), seq), positions, seed), states);
  request.set_payload(payload.data(), payload.size());
  return request;
}

void ModelAppend(const v1::CacheSpec& spec, int64_t seq, const std::vector<int32_t>& positions,
                 uint64_t seed, SequenceModel* model) {
  model->resize(spec.groups_size());
  for (auto& group : *model) {
    for (int32_t pos : positions) group[pos] = TokenId(seq, pos, seed);
  }
}

std::string ExpectedReadPayload(const v1::CacheSpec& spec, const SequenceModel& model,
                                const std::vector<std::vector<int32_t>>& positions) {
  std::vector<std::vector<uint64_t>> ids(positions.size());
  for (size_t g = 0; g < positions.size(); ++g) {
    for (int32_t pos : positions[g]) {
      auto it = model[g].find(pos);
      ids[g].push_back(it == model[g].end() ? ~uint64_t{0} : it->second);
    }
  }
  return ReadPayload(EngineSpec(spec), ids);
}

grpc::Status CreateCache(Stub& stub, const v1::CacheSpec& spec, v1::CreateCacheResponse* response) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::CreateCacheRequest request;
  *request.mutable_spec() = spec;
  v1::CreateCacheResponse ignored;
  return stub.CreateCache(&context, request, response != nullptr ? response : &ignored);
}

grpc::Status DeleteCache(Stub& stub, const std::string& cache) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::DeleteCacheRequest request;
  request.set_cache(cache);
  v1::DeleteCacheResponse response;
  return stub.DeleteCache(&context, request, &response);
}

grpc::Status GetCache(Stub& stub, const std::string& cache, v1::GetCacheResponse* response) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::GetCacheRequest request;
  request.set_cache(cache);
  return stub.GetCache(&context, request, response);
}

grpc::Status ListCaches(Stub& stub, v1::ListCachesResponse* response) {
  grpc::ClientContext context;
  SetDeadline(&context);
  return stub.ListCaches(&context, v1::ListCachesRequest(), response);
}

grpc::Status Append(Stub& stub, const v1::AppendRequest& request, v1::AppendResponse* response) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::AppendResponse ignored;
  return stub.Append(&context, request, response != nullptr ? response : &ignored);
}

grpc::Status AppendStream(Stub& stub, const std::vector<v1::AppendStreamRequest>& messages,
                          v1::AppendResponse* response) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::AppendResponse ignored;
  std::unique_ptr<grpc::ClientWriter<v1::AppendStreamRequest>> writer =
      stub.AppendStream(&context, response != nullptr ? response : &ignored);
  for (const v1::AppendStreamRequest& message : messages) {
    // A failed write means the server has finished the call; Finish says why.
    if (!writer->Write(message)) break;
  }
  writer->WritesDone();
  return writer->Finish();
}

std::vector<v1::AppendStreamRequest> StreamMessages(const v1::AppendRequest& request,
                                                    size_t first_chunk, size_t chunk_bytes) {
  std::vector<v1::AppendStreamRequest> messages(1);
  v1::AppendHeader* header = messages[0].mutable_header();
  header->set_cache(request.cache());
  *header->mutable_tokens() = request.tokens();
  *header->mutable_token_ranges() = request.token_ranges();
  header->set_payload_bytes(static_cast<int64_t>(request.payload().size()));
  header->set_speculative(request.speculative());
  const std::string& payload = request.payload();
  size_t offset = std::min(first_chunk, payload.size());
  messages[0].set_data(payload.substr(0, offset));
  while (offset < payload.size()) {
    const size_t n = std::min(chunk_bytes, payload.size() - offset);
    messages.emplace_back().set_data(payload.substr(offset, n));
    offset += n;
  }
  return messages;
}

grpc::Status Read(Stub& stub, const v1::ReadRequest& request, ReadOutput* output) {
  *output = ReadOutput();
  grpc::ClientContext context;
  SetDeadline(&context);
  std::unique_ptr<grpc::ClientReader<v1::ReadResponse>> reader = stub.Read(&context, request);
  v1::ReadResponse message;
  while (reader->Read(&message)) {
    if (output->messages == 0) {
      output->header = message.header();
    } else if (message.has_header()) {
      output->header_only_in_first = false;
    }
    ++output->messages;
    output->chunk_sizes.push_back(message.data().size());
    output->payload += message.data();
  }
  return reader->Finish();
}

v1::ReadRequest ReadRequest(const std::string& cache, int64_t seq, int32_t begin,
                            std::optional<int32_t> end, int32_t max_chunk_bytes) {
  v1::ReadRequest request;
  request.set_cache(cache);
  request.set_seq(seq);
  request.set_begin(begin);
  if (end.has_value()) request.set_end(*end);
  request.set_max_chunk_bytes(max_chunk_bytes);
  return request;
}

std::vector<std::vector<int32_t>> HeaderPositions(const v1::ReadHeader& header) {
  std::vector<std::vector<int32_t>> out;
  for (const v1::GroupPositions& group : header.groups()) {
    out.emplace_back(group.positions().begin(), group.positions().end());
  }
  return out;
}

grpc::Status Visible(Stub& stub, const v1::VisibleRequest& request, v1::VisibleResponse* response) {
  grpc::ClientContext context;
  SetDeadline(&context);
  return stub.Visible(&context, request, response);
}

std::string ShortageText(const grpc::Status& status) {
  if (status.error_details().empty()) return "";
  google::rpc::Status details;
  if (!details.ParseFromString(status.error_details())) return "details do not parse";
  if (details.code() != status.error_code()) return "details with another code";
  if (details.details_size() != 1) return absl::StrCat(details.details_size(), " details");
  google::rpc::ErrorInfo info;
  if (!details.details(0).UnpackTo(&info)) return "a detail that is not an ErrorInfo";
  if (info.domain() != "kvmesh.io") return absl::StrCat("domain ", info.domain());
  std::string text = info.reason();
  for (const char* key : {"group", "needed", "free", "total"}) {
    auto found = info.metadata().find(key);
    if (found != info.metadata().end()) absl::StrAppend(&text, " ", key, "=", found->second);
  }
  if (info.metadata_size() > 4) absl::StrAppend(&text, " and more metadata");
  return text;
}

grpc::Status CopyPrefix(Stub& stub, const std::string& cache, int64_t src, int64_t dst,
                        int32_t length, int32_t require_src_offset, int32_t* offset) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::CopyPrefixRequest request;
  request.set_cache(cache);
  request.set_src_seq(src);
  request.set_dst_seq(dst);
  request.set_length(length);
  request.set_require_src_offset(require_src_offset);
  v1::CopyPrefixResponse response;
  grpc::Status status = stub.CopyPrefix(&context, request, &response);
  if (status.ok() && offset != nullptr) *offset = response.offset();
  return status;
}

grpc::Status Remove(Stub& stub, const std::string& cache, int64_t seq, int32_t begin,
                    std::optional<int32_t> end) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::RemoveRequest request;
  request.set_cache(cache);
  request.set_seq(seq);
  request.set_begin(begin);
  if (end.has_value()) request.set_end(*end);
  v1::RemoveResponse response;
  return stub.Remove(&context, request, &response);
}

grpc::Status Reserve(Stub& stub, const std::string& cache, int64_t seq, int32_t positions,
                     int64_t ttl_ms, v1::CacheUsage* usage) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::ReserveRequest request;
  request.set_cache(cache);
  request.set_seq(seq);
  request.set_positions(positions);
  request.set_ttl_ms(ttl_ms);
  v1::ReserveResponse response;
  grpc::Status status = stub.Reserve(&context, request, &response);
  if (status.ok() && usage != nullptr) *usage = response.usage();
  return status;
}

grpc::Status SetRetention(Stub& stub, const std::string& cache, int64_t seq, int32_t priority,
                          bool pinned, int64_t ttl_ms, v1::SetRetentionResponse* response) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::SetRetentionRequest request;
  request.set_cache(cache);
  request.set_seq(seq);
  request.set_priority(priority);
  request.set_pinned(pinned);
  request.set_ttl_ms(ttl_ms);
  v1::SetRetentionResponse ignored;
  return stub.SetRetention(&context, request, response != nullptr ? response : &ignored);
}

grpc::Status CanResume(Stub& stub, const std::string& cache, int64_t seq, int32_t pos,
                       bool* can_resume) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::CanResumeRequest request;
  request.set_cache(cache);
  request.set_seq(seq);
  request.set_pos(pos);
  v1::CanResumeResponse response;
  grpc::Status status = stub.CanResume(&context, request, &response);
  *can_resume = response.can_resume();
  return status;
}

grpc::Status ListSequences(Stub& stub, const std::string& cache,
                           v1::ListSequencesResponse* response) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::ListSequencesRequest request;
  request.set_cache(cache);
  const grpc::Status status = stub.ListSequences(&context, request, response);
  // Tests compare listings taken at different times: the time since each sequence's last use
  // is left out (a test of it calls the stub itself).
  for (v1::SequenceInfo& info : *response->mutable_sequences()) info.clear_idle_ms();
  return status;
}

grpc::Status LookupPrefix(Stub& stub, const std::string& cache, const std::vector<int32_t>& tokens,
                          v1::LookupPrefixResponse* response, int32_t max_matches,
                          v1::LookupScope scope, bool verify) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::LookupPrefixRequest request;
  request.set_cache(cache);
  request.mutable_tokens()->Add(tokens.begin(), tokens.end());
  request.set_max_matches(max_matches);
  request.set_scope(scope);
  request.set_verify(verify);
  return stub.LookupPrefix(&context, request, response);
}

grpc::Status Snapshot(Stub& stub, const std::string& cache, int64_t seq, int32_t from_offset,
                      v1::SnapshotInfo* snapshot) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::SnapshotRequest request;
  request.set_cache(cache);
  request.set_seq(seq);
  request.set_from_offset(from_offset);
  v1::SnapshotResponse response;
  const grpc::Status status = stub.Snapshot(&context, request, &response);
  if (snapshot != nullptr) *snapshot = response.snapshot();
  return status;
}

grpc::Status Restore(Stub& stub, const std::string& cache, int64_t seq,
                     std::optional<uint64_t> snapshot_id, int32_t target) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::RestoreRequest request;
  request.set_cache(cache);
  request.set_seq(seq);
  if (snapshot_id.has_value()) request.set_snapshot_id(*snapshot_id);
  request.set_target(target);
  v1::RestoreResponse response;
  return stub.Restore(&context, request, &response);
}

grpc::Status MergeSnapshots(Stub& stub, const std::string& cache, uint64_t parent, uint64_t child,
                            v1::SnapshotInfo* merged) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::MergeSnapshotsRequest request;
  request.set_cache(cache);
  request.set_parent(parent);
  request.set_child(child);
  v1::MergeSnapshotsResponse response;
  const grpc::Status status = stub.MergeSnapshots(&context, request, &response);
  if (merged != nullptr) *merged = response.snapshot();
  return status;
}

grpc::Status SplitSnapshot(Stub& stub, const std::string& cache, uint64_t snapshot_id, int32_t at,
                           v1::SplitSnapshotResponse* response) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::SplitSnapshotRequest request;
  request.set_cache(cache);
  request.set_snapshot_id(snapshot_id);
  request.set_at(at);
  v1::SplitSnapshotResponse ignored;
  return stub.SplitSnapshot(&context, request, response != nullptr ? response : &ignored);
}

grpc::Status DropSnapshot(Stub& stub, const std::string& cache, uint64_t snapshot_id) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::DropSnapshotRequest request;
  request.set_cache(cache);
  request.set_snapshot_id(snapshot_id);
  v1::DropSnapshotResponse response;
  return stub.DropSnapshot(&context, request, &response);
}

grpc::Status ListSnapshots(Stub& stub, const std::string& cache,
                           v1::ListSnapshotsResponse* response) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::ListSnapshotsRequest request;
  request.set_cache(cache);
  return stub.ListSnapshots(&context, request, response);
}

grpc::Status CommitSpeculation(Stub& stub, const std::string& cache, int64_t seq, int32_t accepted,
                               int32_t* offset) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::CommitSpeculationRequest request;
  request.set_cache(cache);
  request.set_seq(seq);
  request.set_accepted(accepted);
  v1::CommitSpeculationResponse response;
  const grpc::Status status = stub.CommitSpeculation(&context, request, &response);
  if (offset != nullptr) *offset = response.offset();
  return status;
}

grpc::Status HealthCheck(const std::shared_ptr<grpc::Channel>& channel, const std::string& service,
                         int* serving_status) {
  grpc::ClientContext context;
  SetDeadline(&context);
  ServingStatus status = ServingStatus::kUnknown;
  const grpc::Status rpc = HealthClient(channel).Check(&context, service, &status);
  *serving_status = static_cast<int>(status);
  return rpc;
}

grpc::Status CallRaw(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                     const std::string& request, std::vector<std::string>* responses) {
  return CallRaw(channel, method, std::vector<std::string>{request}, responses);
}

grpc::Status CallRaw(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                     const std::vector<std::string>& requests,
                     std::vector<std::string>* responses) {
  responses->clear();
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  SetDeadline(&context);
  grpc::CompletionQueue cq;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call =
      stub.PrepareCall(&context, method, &cq);
  int tags[4];
  grpc::ByteBuffer response;
  grpc::Status status;
  bool ok = true;
  call->StartCall(&tags[0]);
  ok = ok && Await(&cq, &tags[0]);
  for (const std::string& request : requests) {
    if (ok) call->Write(ToByteBuffer(request), &tags[1]);
    ok = ok && Await(&cq, &tags[1]);
  }
  if (ok) call->WritesDone(&tags[2]);
  ok = ok && Await(&cq, &tags[2]);
  while (ok) {
    call->Read(&response, &tags[3]);
    ok = Await(&cq, &tags[3]);
    if (ok) responses->push_back(FromByteBuffer(response));
  }
  call->Finish(&status, &tags[0]);
  void* got = nullptr;
  bool finished = false;
  // Finish completes even when an earlier step failed; it reports why.
  while (cq.Next(&got, &finished) && got != &tags[0]) {
  }
  Drain(&cq);
  return status;
}

namespace {

// One request on a grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo stream: the
// string field `field` of ServerReflectionRequest set to `value`; the response's fields.
grpc::Status AskReflection(const std::shared_ptr<grpc::Channel>& channel, int field,
                           const std::string& value, google::protobuf::UnknownFieldSet* fields) {
  std::vector<std::string> responses;
  const grpc::Status status =
      CallRaw(channel, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
              StringField(field, value), &responses);
  if (!status.ok()) return status;
  if (responses.empty()) {
    return grpc::Status(grpc::StatusCode::INTERNAL, "reflection stream sent no response");
  }
  if (!fields->ParseFromString(responses[0])) {
    return grpc::Status(grpc::StatusCode::INTERNAL, "reflection response does not parse");
  }
  return status;
}

// The length-delimited values of field `number` in `fields`.
std::vector<std::string> Submessages(const google::protobuf::UnknownFieldSet& fields, int number) {
  std::vector<std::string> out;
  for (int i = 0; i < fields.field_count(); ++i) {
    if (fields.field(i).number() == number &&
        fields.field(i).type() == google::protobuf::UnknownField::TYPE_LENGTH_DELIMITED) {
      out.push_back(fields.field(i).length_delimited());
    }
  }
  return out;
}

}  // namespace

grpc::Status ListReflectedServices(const std::shared_ptr<grpc::Channel>& channel,
                                   std::vector<std::string>* services) {
  services->clear();
  // ServerReflectionRequest { string list_services = 7; }
  google::protobuf::UnknownFieldSet fields;
  const grpc::Status status = AskReflection(channel, 7, "*", &fields);
  if (!status.ok()) return status;
  // ServerReflectionResponse { ListServiceResponse list_services_response = 6; }
  // ListServiceResponse { repeated ServiceResponse service = 1; } ServiceResponse { name = 1 }
  for (const std::string& list_bytes : Submessages(fields, 6)) {
    google::protobuf::UnknownFieldSet list;
    if (!list.ParseFromString(list_bytes)) continue;
    for (const std::string& service_bytes : Submessages(list, 1)) {
      google::protobuf::UnknownFieldSet service;
      if (!service.ParseFromString(service_bytes)) continue;
      for (std::string& name : Submessages(service, 1)) services->push_back(std::move(name));
    }
  }
  return status;
}

grpc::Status ReflectedFilesOfSymbol(const std::shared_ptr<grpc::Channel>& channel,
                                    const std::string& symbol,
                                    std::vector<google::protobuf::FileDescriptorProto>* files) {
  files->clear();
  // ServerReflectionRequest { string file_containing_symbol = 4; }
  google::protobuf::UnknownFieldSet fields;
  const grpc::Status status = AskReflection(channel, 4, symbol, &fields);
  if (!status.ok()) return status;
  // ServerReflectionResponse { FileDescriptorResponse file_descriptor_response = 4;
  //                            ErrorResponse error_response = 7; }
  // FileDescriptorResponse { repeated bytes file_descriptor_proto = 1; }
  // ErrorResponse { int32 error_code = 1; string error_message = 2; }
  for (const std::string& error_bytes : Submessages(fields, 7)) {
    google::protobuf::UnknownFieldSet error;
    std::string message = "(no message)";
    if (error.ParseFromString(error_bytes) && !Submessages(error, 2).empty()) {
      message = Submessages(error, 2).front();
    }
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        absl::StrCat("reflection error for ", symbol, ": ", message));
  }
  for (const std::string& response_bytes : Submessages(fields, 4)) {
    google::protobuf::UnknownFieldSet response;
    if (!response.ParseFromString(response_bytes)) continue;
    for (const std::string& file_bytes : Submessages(response, 1)) {
      google::protobuf::FileDescriptorProto file;
      if (!file.ParseFromString(file_bytes)) {
        return grpc::Status(grpc::StatusCode::INTERNAL,
                            absl::StrCat("a file descriptor for ", symbol, " does not parse"));
      }
      files->push_back(std::move(file));
    }
  }
  return status;
}

}  // namespace testutil
}  // namespace kvmesh

#include "service/common/convert.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "cache/status_macros.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"

namespace kvmesh {
namespace {

absl::StatusOr<DType> DTypeFromProto(int value) {
  switch (value) {
    case v1::DTYPE_F32:
      return DType::kF32;
    case v1::DTYPE_F16:
      return DType::kF16;
    case v1::DTYPE_BF16:
      return DType::kBF16;
    case v1::DTYPE_UNSPECIFIED:
      return absl::InvalidArgumentError(
          "dtype = DTYPE_UNSPECIFIED: set DTYPE_F32, DTYPE_F16 or DTYPE_BF16");
  }
  return absl::InvalidArgumentError(absl::StrCat("dtype = ", value, " is not a known DType"));
}

v1::DType DTypeToProto(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return v1::DTYPE_F32;
    case DType::kF16:
      return v1::DTYPE_F16;
    case DType::kBF16:
      return v1::DTYPE_BF16;
  }
  return v1::DTYPE_UNSPECIFIED;
}

absl::StatusOr<RopeType> RopeTypeFromProto(const std::string& field, int value) {
  switch (value) {
    case v1::ROPE_TYPE_NONE:
      return RopeType::kNone;
    case v1::ROPE_TYPE_NORMAL:
      return RopeType::kNormal;
    case v1::ROPE_TYPE_NEOX:
      return RopeType::kNeox;
  }
  return absl::InvalidArgumentError(absl::StrCat(field, " = ", value, " is not a known RopeType"));
}

v1::RopeType RopeTypeToProto(RopeType type) {
  switch (type) {
    case RopeType::kNone:
      return v1::ROPE_TYPE_NONE;
    case RopeType::kNormal:
      return v1::ROPE_TYPE_NORMAL;
    case RopeType::kNeox:
      return v1::ROPE_TYPE_NEOX;
  }
  return v1::ROPE_TYPE_NONE;
}

absl::StatusOr<RopeSpec> RopeFromProto(const std::string& field, const v1::Rope& proto) {
  RopeSpec rope;
  ASSIGN_OR_RETURN(rope.type, RopeTypeFromProto(field + ".type", proto.type()));
  rope.dims = proto.dims();
  rope.base = proto.base();
  rope.freq_scale = proto.freq_scale();
  return rope;
}

void RopeToProto(const RopeSpec& rope, v1::Rope* proto) {
  proto->set_type(RopeTypeToProto(rope.type));
  proto->set_dims(rope.dims);
  proto->set_base(rope.base);
  proto->set_freq_scale(rope.freq_scale);
}

absl::StatusOr<AttentionSpec> AttentionFromProto(const std::string& field,
                                                 const v1::Attention& proto) {
  AttentionSpec a;
  a.num_kv_heads = proto.num_kv_heads();
  a.head_dim_k = proto.head_dim_k();
  a.head_dim_v = proto.head_dim_v();
  switch (proto.window().kind_case()) {
    // A window message without a case says no more than an absent one: FULL.
    case v1::Window::KIND_NOT_SET:
    case v1::Window::kFull:
      a.window.kind = WindowKind::kFull;
      break;
    case v1::Window::kSliding:
      a.window.kind = WindowKind::kSliding;
      a.window.window = proto.window().sliding().window();
      a.window.memory = proto.window().sliding().memory();
      break;
    case v1::Window::kChunked:
      a.window.kind = WindowKind::kChunked;
      a.window.chunk = proto.window().chunked().chunk();
      break;
  }
  ASSIGN_OR_RETURN(a.rope, RopeFromProto(field + ".rope", proto.rope()));
  return a;
}

absl::StatusOr<RotatingSpec> RotatingFromProto(const std::string& field,
                                               const v1::Rotating& proto) {
  RotatingSpec r;
  r.num_kv_heads = proto.num_kv_heads();
  r.head_dim_k = proto.head_dim_k();
  r.head_dim_v = proto.head_dim_v();
  r.max_size = proto.max_size();
  ASSIGN_OR_RETURN(r.rope, RopeFromProto(field + ".rope", proto.rope()));
  return r;
}

RecurrentSpec RecurrentFromProto(const v1::Recurrent& proto) {
  RecurrentSpec r;
  r.conv_tail = proto.conv_tail();
  r.conv_dim = proto.conv_dim();
  r.num_v_heads = proto.num_v_heads();
  r.head_v_dim = proto.head_v_dim();
  r.head_k_dim = proto.head_k_dim();
  return r;
}

}  // namespace

absl::StatusOr<CacheSpec> SpecFromProto(const v1::CacheSpec& proto) {
  CacheSpec spec;
  spec.name = proto.name();
  ASSIGN_OR_RETURN(spec.dtype, DTypeFromProto(proto.dtype()));
  spec.max_sequences = proto.max_sequences();
  spec.capacity = proto.capacity();
  spec.max_batch = proto.max_batch();
  if (proto.token_block_size() != 0) spec.token_block_size = proto.token_block_size();
  switch (proto.eviction()) {
    case v1::EVICTION_POLICY_UNSPECIFIED:
    case v1::EVICTION_POLICY_NONE:
      spec.eviction = EvictionPolicy::kNone;
      break;
    case v1::EVICTION_POLICY_LRU:
      spec.eviction = EvictionPolicy::kLru;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("eviction ", static_cast<int>(proto.eviction()), " is not a policy"));
  }
  spec.groups.reserve(proto.groups_size());
  for (int g = 0; g < proto.groups_size(); ++g) {
    const v1::LayerGroup& group = proto.groups(g);
    const std::string field = absl::StrCat("groups[", g, "]");
    GroupSpec out;
    out.num_layers = group.num_layers();
    switch (group.kind_case()) {
      case v1::LayerGroup::kAttention: {
        out.kind = GroupKind::kAttention;
        ASSIGN_OR_RETURN(out.attention,
                         AttentionFromProto(field + ".attention", group.attention()));
        break;
      }
      case v1::LayerGroup::kRotating: {
        out.kind = GroupKind::kRotating;
        ASSIGN_OR_RETURN(out.rotating, RotatingFromProto(field + ".rotating", group.rotating()));
        break;
      }
      case v1::LayerGroup::kRecurrent:
        out.kind = GroupKind::kRecurrent;
        out.recurrent = RecurrentFromProto(group.recurrent());
        break;
      case v1::LayerGroup::KIND_NOT_SET:
        return absl::InvalidArgumentError(
            absl::StrCat(field, " has no kind: set attention, rotating or recurrent"));
    }
    spec.groups.push_back(std::move(out));
  }
  RETURN_IF_ERROR(ValidateSpec(spec));
  return spec;
}

v1::CacheSpec SpecToProto(const CacheSpec& spec) {
  v1::CacheSpec proto;
  proto.set_name(spec.name);
  proto.set_dtype(DTypeToProto(spec.dtype));
  proto.set_max_sequences(spec.max_sequences);
  proto.set_capacity(spec.capacity);
  proto.set_max_batch(spec.max_batch);
  if (spec.token_block_size != kDefaultTokenBlockSize) {
    proto.set_token_block_size(spec.token_block_size);
  }
  if (spec.eviction == EvictionPolicy::kLru) proto.set_eviction(v1::EVICTION_POLICY_LRU);
  for (const GroupSpec& group : spec.groups) {
    v1::LayerGroup* out = proto.add_groups();
    out->set_num_layers(group.num_layers);
    switch (group.kind) {
      case GroupKind::kAttention: {
        const AttentionSpec& a = group.attention;
        v1::Attention* attention = out->mutable_attention();
        attention->set_num_kv_heads(a.num_kv_heads);
        attention->set_head_dim_k(a.head_dim_k);
        attention->set_head_dim_v(a.head_dim_v);
        v1::Window* window = attention->mutable_window();
        switch (a.window.kind) {
          case WindowKind::kFull:
            window->mutable_full();
            break;
          case WindowKind::kSliding:
            window->mutable_sliding()->set_window(a.window.window);
            window->mutable_sliding()->set_memory(a.window.memory);
            break;
          case WindowKind::kChunked:
            window->mutable_chunked()->set_chunk(a.window.chunk);
            break;
        }
        RopeToProto(a.rope, attention->mutable_rope());
        break;
      }
      case GroupKind::kRotating: {
        const RotatingSpec& r = group.rotating;
        v1::Rotating* rotating = out->mutable_rotating();
        rotating->set_num_kv_heads(r.num_kv_heads);
        rotating->set_head_dim_k(r.head_dim_k);
        rotating->set_head_dim_v(r.head_dim_v);
        rotating->set_max_size(r.max_size);
        RopeToProto(r.rope, rotating->mutable_rope());
        break;
      }
      case GroupKind::kRecurrent: {
        const RecurrentSpec& r = group.recurrent;
        v1::Recurrent* recurrent = out->mutable_recurrent();
        recurrent->set_conv_tail(r.conv_tail);
        recurrent->set_conv_dim(r.conv_dim);
        recurrent->set_num_v_heads(r.num_v_heads);
        recurrent->set_head_v_dim(r.head_v_dim);
        recurrent->set_head_k_dim(r.head_k_dim);
        break;
      }
    }
  }
  return proto;
}

v1::CacheUsage UsageToProto(const CacheUsage& usage) {
  v1::CacheUsage proto;
  for (size_t g = 0; g < usage.groups.size(); ++g) {
    const GroupUsage& group = usage.groups[g];
    v1::GroupUsage* out = proto.add_groups();
    out->set_group(static_cast<int32_t>(g));
    out->set_cells_total(group.cells_total);
    out->set_cells_used(group.cells_used);
    out->set_memory(group.memory == kUnlimitedMemory ? 0 : group.memory);
    out->set_bytes(static_cast<int64_t>(group.bytes));
    out->set_cells_reserved(group.cells_reserved);
  }
  proto.set_sequences_live(usage.sequences_live);
  proto.set_sequences_reserved(usage.sequences_reserved);
  proto.set_bytes_held(static_cast<int64_t>(usage.bytes_held));
  proto.set_snapshots(usage.snapshots);
  proto.set_snapshot_bytes(static_cast<int64_t>(usage.snapshot_bytes));
  proto.set_export_bytes(static_cast<int64_t>(usage.export_bytes));
  return proto;
}

v1::SequenceInfo SequenceInfoToProto(const SequenceInfo& info) {
  v1::SequenceInfo proto;
  proto.set_seq(info.seq);
  proto.set_offset(info.offset);
  proto.set_pending(info.pending);
  for (size_t g = 0; g < info.groups.size(); ++g) {
    const GroupSequenceInfo& group = info.groups[g];
    v1::GroupSequence* out = proto.add_groups();
    out->set_group(static_cast<int32_t>(g));
    out->set_stored(group.stored);
    out->set_shared(group.shared);
    out->set_first(group.first);
    out->set_last(group.last);
    out->set_state(StateStatusToProto(group.state));
  }
  proto.set_tokens(info.tokens);
  proto.set_exact_tokens(info.exact_tokens);
  proto.set_token_blocks(info.token_blocks);
  proto.set_priority(info.priority);
  proto.set_pinned(info.pinned);
  proto.set_ttl_ms(absl::ToInt64Milliseconds(info.ttl));
  if (info.last_used != absl::InfinitePast()) {
    proto.set_idle_ms(
        std::max<int64_t>(0, absl::ToInt64Milliseconds(absl::Now() - info.last_used)));
  }
  return proto;
}

v1::CacheInfo CacheInfoToProto(const Cache& cache) {
  v1::CacheInfo proto;
  *proto.mutable_spec() = SpecToProto(cache.spec());
  *proto.mutable_usage() = UsageToProto(cache.Usage());
  return proto;
}

v1::ReadHeader ReadHeaderToProto(const ReadResult& result) {
  v1::ReadHeader proto;
  for (size_t g = 0; g < result.positions.size(); ++g) {
    v1::GroupPositions* out = proto.add_groups();
    out->set_group(static_cast<int32_t>(g));
    out->mutable_positions()->Add(result.positions[g].begin(), result.positions[g].end());
    if (g < result.states.size()) out->set_state(StateStatusToProto(result.states[g]));
  }
  proto.set_payload_bytes(static_cast<int64_t>(result.payload.size()));
  return proto;
}

v1::StateStatus StateStatusToProto(StateStatus status) {
  switch (status) {
    case StateStatus::kNone:
      return v1::STATE_STATUS_NONE;
    case StateStatus::kValid:
      return v1::STATE_STATUS_VALID;
    case StateStatus::kInvalid:
      return v1::STATE_STATUS_INVALID;
  }
  return v1::STATE_STATUS_NONE;
}

absl::StatusOr<StateStatus> StateStatusFromProto(const std::string& field, int value) {
  switch (value) {
    case v1::STATE_STATUS_NONE:
      return StateStatus::kNone;
    case v1::STATE_STATUS_VALID:
      return StateStatus::kValid;
    case v1::STATE_STATUS_INVALID:
      return StateStatus::kInvalid;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, " = ", value, " is not a known StateStatus"));
}

v1::SnapshotInfo SnapshotInfoToProto(const SnapshotInfo& info) {
  v1::SnapshotInfo proto;
  proto.set_id(info.id);
  proto.set_seq(info.seq);
  proto.set_from_offset(info.from);
  proto.set_to_offset(info.to);
  proto.set_bytes(static_cast<int64_t>(info.bytes));
  for (size_t g = 0; g < info.groups.size(); ++g) {
    const SnapshotGroupInfo& group = info.groups[g];
    v1::SnapshotGroup* out = proto.add_groups();
    out->set_group(static_cast<int32_t>(g));
    out->set_stored(group.stored);
    out->set_ring_index(group.ring_index);
    out->set_state(StateStatusToProto(group.state));
  }
  proto.set_tokens(info.tokens);
  return proto;
}

absl::StatusOr<SnapshotInfo> SnapshotInfoFromProto(const v1::SnapshotInfo& proto) {
  SnapshotInfo info;
  info.id = proto.id();
  info.seq = proto.seq();
  info.from = proto.from_offset();
  info.to = proto.to_offset();
  if (proto.bytes() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("snapshot.bytes = ", proto.bytes(), " is negative"));
  }
  info.bytes = static_cast<size_t>(proto.bytes());
  info.groups.reserve(proto.groups_size());
  for (int g = 0; g < proto.groups_size(); ++g) {
    const v1::SnapshotGroup& group = proto.groups(g);
    if (group.group() != g) {
      return absl::InvalidArgumentError(
          absl::StrCat("snapshot.groups[", g, "].group = ", group.group(), ", expected ", g));
    }
    SnapshotGroupInfo out;
    out.stored = group.stored();
    out.ring_index = group.ring_index();
    ASSIGN_OR_RETURN(out.state, StateStatusFromProto(absl::StrCat("snapshot.groups[", g, "].state"),
                                                     group.state()));
    info.groups.push_back(out);
  }
  if (proto.tokens() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("snapshot.tokens = ", proto.tokens(), " is negative"));
  }
  info.tokens = proto.tokens();
  return info;
}

void AddTokenRanges(int64_t seq, absl::Span<const int32_t> positions,
                    google::protobuf::RepeatedPtrField<v1::TokenRange>* ranges,
                    absl::Span<const int32_t> token_ids) {
  v1::TokenRange* run = nullptr;
  for (size_t i = 0; i < positions.size(); ++i) {
    const int32_t pos = positions[i];
    if (run != nullptr && int64_t{run->first()} + run->count() == pos) {
      run->set_count(run->count() + 1);
    } else {
      run = ranges->Add();
      run->set_seq(seq);
      run->set_first(pos);
      run->set_count(1);
    }
    if (!token_ids.empty()) run->add_token_ids(token_ids[i]);
  }
}

int64_t CountTokens(const google::protobuf::RepeatedPtrField<v1::Token>& tokens,
                    const google::protobuf::RepeatedPtrField<v1::TokenRange>& ranges, int64_t cap) {
  int64_t n = std::min<int64_t>(tokens.size(), cap);
  for (const v1::TokenRange& r : ranges) {
    n += std::max<int32_t>(r.count(), 0);
    if (n >= cap) return cap;
  }
  return n;
}

absl::StatusOr<std::vector<Token>> TokensFromProto(
    const google::protobuf::RepeatedPtrField<v1::Token>& tokens,
    const google::protobuf::RepeatedPtrField<v1::TokenRange>& ranges, int64_t max_tokens) {
  int64_t total = tokens.size();
  for (int i = 0; i < ranges.size(); ++i) {
    const v1::TokenRange& r = ranges.Get(i);
    if (r.seq() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("token_ranges[", i, "].seq = ", r.seq(), " is negative"));
    }
    if (r.first() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("token_ranges[", i, "].first = ", r.first(), " is negative"));
    }
    if (r.count() < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("token_ranges[", i, "].count = ", r.count(), " is below 1"));
    }
    if (r.token_ids_size() != 0 && r.token_ids_size() != r.count()) {
      return absl::InvalidArgumentError(
          absl::StrCat("token_ranges[", i, "] has ", r.token_ids_size(),
                       " token_ids for count = ", r.count(), "; give none or one per position"));
    }
    // The engine's positions are below INT32_MAX, so that an offset (last + 1) is an int32.
    if (int64_t{r.first()} + r.count() > INT32_MAX) {
      return absl::InvalidArgumentError(absl::StrCat("token_ranges[", i, "] (first = ", r.first(),
                                                     ", count = ", r.count(),
                                                     ") reaches past position ", INT32_MAX - 1));
    }
    total += r.count();
  }
  if (total > max_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the batch has ", total, " tokens (", tokens.size(), " in tokens, ", total - tokens.size(),
        " in token_ranges), more than max_batch = ", max_tokens));
  }
  std::vector<Token> out;
  out.reserve(static_cast<size_t>(total));
  for (int i = 0; i < tokens.size(); ++i) {
    const v1::Token& t = tokens.Get(i);
    if (t.seq() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokens[", i, "].seq = ", t.seq(), " is negative"));
    }
    if (t.pos() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokens[", i, "].pos = ", t.pos(), " is negative"));
    }
    if (t.has_token_id() && t.token_id() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokens[", i, "].token_id = ", t.token_id(), " is negative"));
    }
    out.push_back(Token{t.seq(), t.pos(), t.has_token_id() ? t.token_id() : kNoTokenId});
  }
  for (int i = 0; i < ranges.size(); ++i) {
    const v1::TokenRange& r = ranges.Get(i);
    const bool ids = r.token_ids_size() > 0;
    for (int32_t k = 0; k < r.count(); ++k) {
      const int32_t id = ids ? r.token_ids(k) : kNoTokenId;
      if (ids && id < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("token_ranges[", i, "].token_ids[", k, "] = ", id, " is negative"));
      }
      out.push_back(Token{r.seq(), r.first() + k, id});
    }
  }
  return out;
}

absl::StatusOr<std::vector<Query>> QueriesFromProto(
    const google::protobuf::RepeatedPtrField<v1::Query>& queries) {
  std::vector<Query> out;
  out.reserve(queries.size());
  for (int i = 0; i < queries.size(); ++i) {
    const v1::Query& q = queries.Get(i);
    if (q.seq() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("queries[", i, "].seq = ", q.seq(), " is negative"));
    }
    if (q.pos() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("queries[", i, "].pos = ", q.pos(), " is negative"));
    }
    out.push_back(Query{q.seq(), q.pos(), q.non_causal()});
  }
  return out;
}

absl::Status CheckNameLength(absl::string_view field, absl::string_view value) {
  if (value.size() <= kMaxNameBytes) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      field, " is ", value.size(), " bytes long, more than the limit of ", kMaxNameBytes,
      " bytes; it begins \"", absl::CHexEscape(value.substr(0, kQuotedNameBytes)), "\"..."));
}

std::string QuoteBounded(absl::string_view value) {
  if (value.size() <= kMaxNameBytes) return std::string(value);
  return absl::StrCat(value.size(), " bytes beginning \"",
                      absl::CHexEscape(value.substr(0, kQuotedNameBytes)), "\"...");
}

absl::Status CheckNames(
    std::initializer_list<std::pair<absl::string_view, absl::string_view>> names) {
  for (const auto& [field, value] : names) RETURN_IF_ERROR(CheckNameLength(field, value));
  return absl::OkStatus();
}

google::rpc::ErrorInfo ShortageToErrorInfo(const Shortage& shortage) {
  google::rpc::ErrorInfo info;
  info.set_reason(std::string(ShortageReason(shortage.resource)));
  info.set_domain(std::string(kErrorDomain));
  auto& metadata = *info.mutable_metadata();
  if (shortage.group >= 0) metadata["group"] = absl::StrCat(shortage.group);
  metadata["needed"] = absl::StrCat(shortage.needed);
  metadata["free"] = absl::StrCat(shortage.free);
  metadata["total"] = absl::StrCat(shortage.total);
  return info;
}

std::optional<Shortage> ShortageFromErrorInfo(const google::rpc::ErrorInfo& info) {
  if (info.domain() != kErrorDomain) return std::nullopt;
  const std::optional<Resource> resource = ResourceOfReason(info.reason());
  if (!resource.has_value()) return std::nullopt;
  Shortage shortage;
  shortage.resource = *resource;
  auto number = [&info](const char* key, int64_t* out) {
    auto found = info.metadata().find(key);
    return found != info.metadata().end() && absl::SimpleAtoi(found->second, out);
  };
  int64_t group = -1;
  if (info.metadata().count("group") > 0 && !number("group", &group)) return std::nullopt;
  shortage.group = static_cast<int32_t>(group);
  if (!number("needed", &shortage.needed) || !number("free", &shortage.free) ||
      !number("total", &shortage.total)) {
    return std::nullopt;
  }
  return shortage;
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  const int code = static_cast<int>(status.code());
  // Both enums are the canonical codes 0..16; anything else is not a code gRPC can carry.
  const grpc::StatusCode grpc_code =
      code >= grpc::StatusCode::CANCELLED && code <= grpc::StatusCode::UNAUTHENTICATED
          ? static_cast<grpc::StatusCode>(code)
          : grpc::StatusCode::UNKNOWN;
  const std::optional<Shortage> shortage = GetShortage(status);
  if (!shortage.has_value()) return grpc::Status(grpc_code, std::string(status.message()));
  google::rpc::Status details;
  details.set_code(grpc_code);
  details.set_message(std::string(status.message()));
  details.add_details()->PackFrom(ShortageToErrorInfo(*shortage));
  return grpc::Status(grpc_code, std::string(status.message()), details.SerializeAsString());
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  const int code = static_cast<int>(status.error_code());
  const absl::StatusCode absl_code =
      code >= static_cast<int>(absl::StatusCode::kCancelled) &&
              code <= static_cast<int>(absl::StatusCode::kUnauthenticated)
          ? static_cast<absl::StatusCode>(code)
          : absl::StatusCode::kUnknown;
  // A shortage reported by another node stays one here (a cross-node call's refusal).
  std::optional<Shortage> shortage = GetShortage(status);
  if (absl_code == absl::StatusCode::kResourceExhausted && shortage.has_value()) {
    return ResourceExhaustedWith(status.error_message(), *shortage);
  }
  return absl::Status(absl_code, status.error_message());
}

std::optional<Shortage> GetShortage(const grpc::Status& status) {
  if (status.error_details().empty()) return std::nullopt;
  google::rpc::Status details;
  if (!details.ParseFromString(status.error_details())) return std::nullopt;
  for (const google::protobuf::Any& any : details.details()) {
    google::rpc::ErrorInfo info;
    if (!any.Is<google::rpc::ErrorInfo>() || !any.UnpackTo(&info)) continue;
    if (std::optional<Shortage> shortage = ShortageFromErrorInfo(info)) return shortage;
  }
  return std::nullopt;
}

}  // namespace kvmesh

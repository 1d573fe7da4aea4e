// Translation between the public protobuf API (kvmesh.v1) and the engine's types. service/ is
// the only layer that knows both; the engine never sees generated code and clients never see
// engine types. Every function here is stateless and safe to call from any thread.
//
// Conversions from protobuf validate what the engine cannot express (unset or unknown enum
// values, a oneof without a case, negative ids) and return INVALID_ARGUMENT naming the field and
// its value; the semantic checks stay in the engine.
#ifndef KVMESH_SERVICE_COMMON_CONVERT_H_
#define KVMESH_SERVICE_COMMON_CONVERT_H_

#include <cstddef>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "cache/cache.h"
#include "cache/shortage.h"
#include "cache/spec.h"
#include "google/protobuf/repeated_field.h"
#include "google/rpc/error_details.pb.h"
#include "grpcpp/support/status.h"
#include "kvmesh/v1/kvmesh.pb.h"

namespace kvmesh {

// The engine spec of `proto`, checked by kvmesh::ValidateSpec. An unset window means FULL;
// Attention and Rotating groups take their rope alike. INVALID_ARGUMENT naming the field for
// DTYPE_UNSPECIFIED or an unknown enum value, a group without a kind (attention, rotating or
// recurrent), and anything ValidateSpec rejects.
absl::StatusOr<CacheSpec> SpecFromProto(const v1::CacheSpec& proto);

// The inverse of SpecFromProto: SpecFromProto(SpecToProto(s)) == s for every valid `s`.
v1::CacheSpec SpecToProto(const CacheSpec& spec);

// Usage with kUnlimitedMemory reported as memory 0, as the proto documents, and the cache's
// snapshot count and bytes.
v1::CacheUsage UsageToProto(const CacheUsage& usage);

// Offset, pending speculative tokens and, per group, stored positions and Recurrent state.
v1::SequenceInfo SequenceInfoToProto(const SequenceInfo& info);

v1::StateStatus StateStatusToProto(StateStatus status);
// INVALID_ARGUMENT naming `field` and `value` for a value outside the enum.
absl::StatusOr<StateStatus> StateStatusFromProto(const std::string& field, int value);

// A snapshot's id, source sequence, range [from_offset, to_offset), bytes and per-group data.
v1::SnapshotInfo SnapshotInfoToProto(const SnapshotInfo& info);
// The inverse of SnapshotInfoToProto. INVALID_ARGUMENT for negative bytes, a group entry out
// of order or an unknown state.
absl::StatusOr<SnapshotInfo> SnapshotInfoFromProto(const v1::SnapshotInfo& proto);

// Spec and current usage of `cache` (takes the cache's lock shared, briefly).
v1::CacheInfo CacheInfoToProto(const Cache& cache);

// Positions and Recurrent state per group and payload size of a Read, without the payload.
v1::ReadHeader ReadHeaderToProto(const ReadResult& result);

// The tokens of an Append: `tokens`, then each range of `ranges` position by position.
// INVALID_ARGUMENT naming the field and value of a negative seq, pos or first, a count below 1,
// a range past position 2^31 - 2, or more than `max_tokens` tokens in all (found before any
// range is expanded, so a request cannot make the node allocate more than that).
absl::StatusOr<std::vector<Token>> TokensFromProto(
    const google::protobuf::RepeatedPtrField<v1::Token>& tokens,
    const google::protobuf::RepeatedPtrField<v1::TokenRange>& ranges, int64_t max_tokens);
// Appends `positions` of `seq` (ascending, as an Append names them) to `ranges`: one range per
// run of consecutive positions. `token_ids`: empty, or the token id of each position, which the
// ranges then carry.
void AddTokenRanges(int64_t seq, absl::Span<const int32_t> positions,
                    google::protobuf::RepeatedPtrField<v1::TokenRange>* ranges,
                    absl::Span<const int32_t> token_ids = {});
// How many tokens `tokens` and `ranges` name (a negative count as 0), at most `cap`: what a
// request will parse to at most, for the in-flight budget, before its cache is known.
int64_t CountTokens(const google::protobuf::RepeatedPtrField<v1::Token>& tokens,
                    const google::protobuf::RepeatedPtrField<v1::TokenRange>& ranges, int64_t cap);

// Queries of a Visible. INVALID_ARGUMENT naming the index and value of a negative seq or pos.
absl::StatusOr<std::vector<Query>> QueriesFromProto(
    const google::protobuf::RepeatedPtrField<v1::Query>& queries);

// The longest name (cache, node, tenant) any RPC takes: the limit CreateCache applies to a
// cache's name (kvmesh::kMaxNameLength, cache/spec.h).
inline constexpr size_t kMaxNameBytes = kMaxNameLength;
// How much of an over-long name an error message quotes.
inline constexpr size_t kQuotedNameBytes = 32;

// INVALID_ARGUMENT when `value` (the request field named `field`) is longer than kMaxNameBytes.
// The message gives the length and quotes at most the first kQuotedNameBytes bytes, escaped:
// an error that echoed a 10 KB name would not fit gRPC's metadata limit and the client would get
// an unrelated transport error instead. Every RPC that takes a name checks it with this before
// using it. Empty names are left to the caller (some fields are optional).
absl::Status CheckNameLength(absl::string_view field, absl::string_view value);
// `value` for an error message: itself when it is at most kMaxNameBytes long, else its length
// and its first kQuotedNameBytes bytes, escaped ("10240 bytes beginning \"abc\"..."). For
// values that are not names but must not be echoed whole either (lease ids).
std::string QuoteBounded(absl::string_view value);
// CheckNameLength of each (field, value) in order: the first error, or OK.
absl::Status CheckNames(
    std::initializer_list<std::pair<absl::string_view, absl::string_view>> names);

// absl and gRPC share the canonical status codes: the code maps 1:1 and the message is kept.
// A status carrying a Shortage (cache/shortage.h) becomes one with details: a google.rpc.Status
// holding a google.rpc.ErrorInfo of domain kErrorDomain (ShortageToErrorInfo); FromGrpcStatus
// turns such details back into the Shortage.
grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

inline constexpr absl::string_view kErrorDomain = "kvmesh.io";
// ErrorInfo{reason: ShortageReason, domain: kErrorDomain, metadata: needed, free, total and,
// for a group's resource, group}, and back (nullopt for another domain or reason, or numbers
// that do not parse).
google::rpc::ErrorInfo ShortageToErrorInfo(const Shortage& shortage);
std::optional<Shortage> ShortageFromErrorInfo(const google::rpc::ErrorInfo& info);
// The Shortage in a gRPC status's details, if any.
std::optional<Shortage> GetShortage(const grpc::Status& status);

}  // namespace kvmesh

#endif  // KVMESH_SERVICE_COMMON_CONVERT_H_

// Parsers for kvmeshctl's shorthand flags: layer groups, dtypes and position lists. They build
// the public protobuf types (the CLI sends what the user typed; the server validates the spec).
//
// Stateless functions; safe from any thread.
#ifndef KVMESH_SERVICE_CTL_PARSE_H_
#define KVMESH_SERVICE_CTL_PARSE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cache/spec.h"
#include "kvmesh/v1/kvmesh.pb.h"

namespace kvmesh {
namespace ctl {

// "f32", "f16" or "bf16" (any case, "DTYPE_" prefix allowed).
absl::StatusOr<v1::DType> ParseDType(absl::string_view text);

// One --group flag, KIND:KEY=VALUE,...:
//   attention:layers=32,heads=8,head_dim=128,window=full,rope=neox:128:500000
//   rotating:layers=4,heads=8,head_dim=128,max_size=4096,rope=neox:128:10000
//   recurrent:layers=10,conv_tail=2,conv_dim=2048[,v_heads=16,head_v_dim=128,head_k_dim=128]
// attention keys: layers, heads (or kv_heads), head_dim (sets K and V), head_dim_k, head_dim_v,
// window=full | sliding:WINDOW[:MEMORY] | chunked:CHUNK,
// rope=none | normal|neox[:DIMS[:BASE[:FREQ_SCALE]]] (DIMS defaults to head_dim_k, BASE to
// 10000, FREQ_SCALE to 1). Missing window means full; missing rope means none.
// rotating keys: those of attention but window, plus max_size (required).
// recurrent keys: layers, conv_tail and conv_dim (required), v_heads (or num_v_heads),
// head_v_dim, head_k_dim (required when v_heads > 0; v_heads absent means no delta state).
// INVALID_ARGUMENT names the key and the value that do not parse (ranges are the server's).
absl::StatusOr<v1::LayerGroup> ParseGroup(absl::string_view text);

// The most positions a position list may name: the largest max_batch a spec may have, so no
// Append can take more.
inline constexpr int64_t kMaxPositions = kMaxCellsPerGroup;

// A position list: comma-separated items, each a position "P" or a half-open range "B:E"
// (B < E). The result is in the order written. INVALID_ARGUMENT for anything else, and for a
// list of more than kMaxPositions positions (refused before a range is expanded).
absl::StatusOr<std::vector<int32_t>> ParsePositions(absl::string_view text);

// Ascending positions as compact ranges, e.g. "0-15,144-511" (inclusive ends); "-" when empty.
std::string FormatPositions(const std::vector<int32_t>& positions);
// The same text for ascending, maximal ranges (a Visible answer in ranges); "-" when empty.
std::string FormatRanges(const google::protobuf::RepeatedPtrField<v1::PositionRange>& ranges);

}  // namespace ctl
}  // namespace kvmesh

#endif  // KVMESH_SERVICE_CTL_PARSE_H_

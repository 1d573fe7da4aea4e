// The soak's model of what a client's own cache holds on each node, so that the outcome of
// every valid operation on it is known in advance: which status, which positions, which bytes.
//
// A client's cache has one of two flavours:
//   kAttention: F16, a full Attention group (NEOX RoPE over part of the head) and a chunked one
//               (NORMAL RoPE, another base and freq_scale): any positions, gaps allowed;
//   kHybrid:    BF16, a full Attention group and a Recurrent group: contiguous sequences, a
//               state that a Remove below the offset makes INVALID.
// Both groups of kAttention store every position, so one map of rows per sequence describes
// both. A row remembers the pattern id it was appended with (tests/testing/pattern.h), the
// position it was appended at and how many Removes moved it: V rows and the unrotated tail of K
// rows must come back exactly; the rotated part of a moved K row must equal the pattern rotated
// by (position - appended position) (docs/api.md#rope-shift), within the rounding of one step
// per move.
//
// Thread safety: plain values, one owner.
#ifndef KVMESH_TESTS_SOAK_MODEL_H_
#define KVMESH_TESTS_SOAK_MODEL_H_

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "cache/spec.h"
#include "kvmesh/v1/kvmesh.pb.h"

namespace kvmesh {
namespace soak {

enum class Flavour { kAttention, kHybrid };

// Positions per sequence the client keeps at most: half the cells of the pool per sequence, so
// that no Append, fork or Remove's private copies can run out of cells (those shortages are
// RESOURCE_EXHAUSTED and would make outcomes depend on cell accounting).
inline constexpr int32_t kMaxRows = 128;
inline constexpr int32_t kModelMaxSequences = 8;
inline constexpr int32_t kModelCapacity = 256;
inline constexpr int32_t kModelMaxBatch = 32;
inline constexpr int32_t kChunk = 16;  // the kAttention flavour's chunked group

v1::CacheSpec ModelSpec(const std::string& name, Flavour flavour);

struct Row {
  uint64_t id = 0;           // pattern id (RowBytes)
  int32_t appended_pos = 0;  // where it was appended: the K rotation it carries
  int32_t moves = 0;         // Removes that shifted it
};

enum class State { kNone, kValid, kInvalid };

struct SeqModel {
  std::map<int32_t, Row> rows;  // stored positions (every Attention group)
  State state = State::kNone;   // kHybrid: the Recurrent state
  uint64_t state_id = 0;        // StateLayerBytes id when kValid (kept when kInvalid)

  int32_t offset() const { return rows.empty() ? 0 : rows.rbegin()->first + 1; }
};

struct SnapModel {
  int64_t seq = 0;
  int32_t from = 0;
  int32_t to = 0;
  std::map<int32_t, Row> rows;  // positions in [from, to)
  State state = State::kNone;
  uint64_t state_id = 0;
};

struct NodeModel {
  bool exists = false;
  std::map<int64_t, SeqModel> seqs;  // live sequences
  std::map<uint64_t, SnapModel> snaps;
};

struct CacheModel {
  std::string name;
  Flavour flavour = Flavour::kAttention;
  v1::CacheSpec spec;
  CacheSpec engine;
  std::array<NodeModel, 2> nodes;

  bool hybrid() const { return flavour == Flavour::kHybrid; }
};

// Remove [begin, end) (end absent: truncate) from `seq` as the engine does: rows in the range
// go, rows at or past `end` move down (one more move each), a Recurrent state turns INVALID when
// anything below the offset goes. Returns false when nothing is left (the sequence stops being
// live). REQUIRES for kHybrid: end <= offset when present.
bool ApplyRemove(Flavour flavour, SeqModel* seq, int32_t begin, std::optional<int32_t> end);

// The positions a Visible query of `seq` (null: stores nothing) sees in `group`.
std::vector<int32_t> ExpectedVisible(const CacheModel& cache, int group, const SeqModel* seq,
                                     int32_t pos, bool non_causal);

// "" when (header, payload) is what a Read of [begin, end) of `seq` must return, else what
// differs (the first few differences).
std::string CheckRead(const CacheModel& cache, const SeqModel& seq, int32_t begin,
                      std::optional<int32_t> end, const v1::ReadHeader& header,
                      const std::string& payload);

// Bytes of one token's rows in every group and layer (K and V), and of one Recurrent state in
// every layer: the payload arithmetic of docs/api.md#payload-layout.
int64_t TokenBytes(const CacheSpec& spec);
int64_t StateBytes(const CacheSpec& spec);

// "" when the rows of `snap` are those of `info` (range, per-group stored counts, state).
std::string CheckSnapshotInfo(const CacheModel& cache, const SnapModel& snap,
                              const v1::SnapshotInfo& info);

// "" when a ListSequences answer describes exactly the live sequences of `node`.
std::string CheckSequences(const CacheModel& cache, const NodeModel& node,
                           const v1::ListSequencesResponse& response);

}  // namespace soak
}  // namespace kvmesh

#endif  // KVMESH_TESTS_SOAK_MODEL_H_

// What the fuzz targets of tests/fuzz share: the check that turns a broken invariant into a
// crash libFuzzer reports, the caches they fuzz against, and a digest of a cache's whole state
// for the all-or-nothing checks (docs/security.md, "Fuzzing").
#ifndef KVMESH_TESTS_FUZZ_FUZZ_SUPPORT_H_
#define KVMESH_TESTS_FUZZ_FUZZ_SUPPORT_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "cache/cache.h"
#include "cache/spec.h"

namespace kvmesh {
namespace fuzz {

// Prints "fuzz invariant broken: <what>" and aborts, so that libFuzzer (or the replay driver)
// reports the input. Never returns.
[[noreturn]] void Fail(absl::string_view what);

// Fails unless `condition`; `what` is built only when it fails.
#define KVMESH_FUZZ_CHECK(condition, what)                                        \
  do {                                                                            \
    if (!(condition)) ::kvmesh::fuzz::Fail(absl::StrCat(#condition, ": ", what)); \
  } while (false)

// ---- the snapshot wire image target -------------------------------------------------------

// A cache the wire image target imports into, with the budgets of the device it lives on (each
// case has a device of its own: a small snapshot pool makes RESOURCE_EXHAUSTED reachable).
struct WireCase {
  CacheSpec spec;
  size_t cache_budget = 0;
  size_t snapshot_budget = 0;
};

// The cases, indexed by the first byte of an input (modulo their number): attention (full,
// sliding, chunked; NEOX and NORMAL rope), rotating, recurrent with and without a delta state,
// hybrids, in F32, F16 and BF16.
const std::vector<WireCase>& WireCases();

// An input of the wire image target: kWireInputHeader bytes, then the image.
//   [0] case index      [1] WireFlags     [2] seed of the sizes of the writes
inline constexpr size_t kWireInputHeader = 3;
enum WireFlags : uint8_t {
  // Overwrite magic, version, spec_fingerprint and total_bytes with the values a well-behaved
  // sender would write, so that mutations reach the rest of the header and the data.
  kFixPreamble = 1 << 0,
  // Restore the imported snapshot into the prefilled sequence 0 instead of the empty sequence 1.
  kRestoreIntoPrefilled = 1 << 1,
  // The transport announced more bytes than it delivers: Commit must refuse the import.
  kShortDelivery = 1 << 2,
  // The transfer fails after the last write: the writer is dropped without Commit.
  kDropWithoutCommit = 1 << 3,
};

// The deterministic state the target gives every case's cache before an import: sequence 0
// holds positions [0, PrefillTokens(spec)) with PrefillPayload's bytes, and snapshot 1 of it.
int32_t PrefillTokens(const CacheSpec& spec);
std::string PrefillPayload(const CacheSpec& spec, int32_t tokens, uint8_t salt);
absl::Status Prefill(Cache& cache);

// ---- whole-cache digests -----------------------------------------------------------------

// Everything observable of `cache`: its sequences (offsets, pending tokens, per-group positions
// and states), snapshots (ids, ranges, bytes, groups), usage (but export_bytes, which follows
// the transfers in flight), and a hash of a Read of every sequence. Two equal digests mean no
// call could tell the caches apart.
std::string CacheDigest(const Cache& cache);

}  // namespace fuzz
}  // namespace kvmesh

#endif  // KVMESH_TESTS_FUZZ_FUZZ_SUPPORT_H_

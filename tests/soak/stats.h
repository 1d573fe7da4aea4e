// What the soak counts: per operation kind, results by gRPC status code and latencies
// (Recorder, one per thread, merged at the end), and the outcomes that fail the run (Failures,
// shared).
//
// Thread safety: a Recorder belongs to one thread at a time; Failures is thread-safe.
#ifndef KVMESH_TESTS_SOAK_STATS_H_
#define KVMESH_TESTS_SOAK_STATS_H_

#include <array>
#include <cstdint>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "grpcpp/support/status.h"

namespace kvmesh {
namespace soak {

// "OK", "INVALID_ARGUMENT", ... ("CODE_<n>" outside the canonical range).
std::string CodeName(grpc::StatusCode code);
std::string CodeName(int code);

inline constexpr int kCodes = 17;  // canonical gRPC codes 0..16

struct OpStats {
  std::array<int64_t, kCodes> codes{};
  int64_t other_codes = 0;  // outside 0..16 (none expected)
  int64_t unexpected = 0;   // results that failed the run
  std::vector<float> latencies_us;

  int64_t calls() const;
  void Merge(const OpStats& other);
};

// Results of the calls of one thread, by operation kind ("v:Read", "h:Visible.huge", ...).
class Recorder {
 public:
  void Record(const std::string& kind, grpc::StatusCode code, double micros);
  void CountUnexpected(const std::string& kind) { ops_[kind].unexpected++; }
  void Merge(const Recorder& other);
  const std::map<std::string, OpStats>& ops() const { return ops_; }
  int64_t calls() const;

 private:
  std::map<std::string, OpStats> ops_;
};

// Outcomes that fail the run. Each is printed to stderr as it happens (the first kPrinted; the
// rest are counted), so a long run shows its problems without waiting for the report.
class Failures {
 public:
  static constexpr int kPrinted = 40;
  static constexpr int kKept = 40;

  void Add(const std::string& what);
  int64_t count() const;
  std::vector<std::string> kept() const;

 private:
  mutable std::mutex mu_;
  int64_t count_ = 0;
  std::vector<std::string> kept_;
};

// p in [0, 1] of `sorted` (ascending), nearest rank; 0 for none.
double Percentile(const std::vector<float>& sorted, double p);

// Prints the per-kind table and the totals by code to `out`.
void PrintReport(const Recorder& all, double seconds, std::FILE* out);

}  // namespace soak
}  // namespace kvmesh

#endif  // KVMESH_TESTS_SOAK_STATS_H_

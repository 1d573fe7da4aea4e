#include "tests/soak/stats.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvmesh {
namespace soak {

std::string CodeName(int code) {
  static const char* const kNames[kCodes] = {"OK",
                                             "CANCELLED",
                                             "UNKNOWN",
                                             "INVALID_ARGUMENT",
                                             "DEADLINE_EXCEEDED",
                                             "NOT_FOUND",
                                             "ALREADY_EXISTS",
                                             "PERMISSION_DENIED",
                                             "RESOURCE_EXHAUSTED",
                                             "FAILED_PRECONDITION",
                                             "ABORTED",
                                             "OUT_OF_RANGE",
                                             "UNIMPLEMENTED",
                                             "INTERNAL",
                                             "UNAVAILABLE",
                                             "DATA_LOSS",
                                             "UNAUTHENTICATED"};
  if (code >= 0 && code < kCodes) return kNames[code];
  return absl::StrCat("CODE_", code);
}

std::string CodeName(grpc::StatusCode code) { return CodeName(static_cast<int>(code)); }

int64_t OpStats::calls() const {
  int64_t n = other_codes;
  for (int64_t c : codes) n += c;
  return n;
}

void OpStats::Merge(const OpStats& other) {
  for (int i = 0; i < kCodes; ++i) codes[i] += other.codes[i];
  other_codes += other.other_codes;
  unexpected += other.unexpected;
  latencies_us.insert(latencies_us.end(), other.latencies_us.begin(), other.latencies_us.end());
}

void Recorder::Record(const std::string& kind, grpc::StatusCode code, double micros) {
  OpStats& op = ops_[kind];
  const int c = static_cast<int>(code);
  if (c >= 0 && c < kCodes) {
    op.codes[c]++;
  } else {
    op.other_codes++;
  }
  op.latencies_us.push_back(static_cast<float>(micros));
}

void Recorder::Merge(const Recorder& other) {
  for (const auto& [kind, op] : other.ops_) ops_[kind].Merge(op);
}

int64_t Recorder::calls() const {
  int64_t n = 0;
  for (const auto& [kind, op] : ops_) n += op.calls();
  return n;
}

void Failures::Add(const std::string& what) {
  std::lock_guard<std::mutex> lock(mu_);
  ++count_;
  if (count_ <= kPrinted) {
    std::fprintf(stderr, "soak: FAILURE %lld at %s: %s\n", static_cast<long long>(count_),
                 absl::FormatTime("%H:%M:%S", absl::Now(), absl::LocalTimeZone()).c_str(),
                 what.c_str());
    std::fflush(stderr);
  }
  if (static_cast<int>(kept_.size()) < kKept) kept_.push_back(what);
}

int64_t Failures::count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return count_;
}

std::vector<std::string> Failures::kept() const {
  std::lock_guard<std::mutex> lock(mu_);
  return kept_;
}

double Percentile(const std::vector<float>& sorted, double p) {
  if (sorted.empty()) return 0;
  const size_t rank = static_cast<size_t>(std::ceil(p * static_cast<double>(sorted.size())));
  return sorted[std::min(sorted.size() - 1, rank == 0 ? 0 : rank - 1)];
}

void PrintReport(const Recorder& all, double seconds, std::FILE* out) {
  std::array<int64_t, kCodes> totals{};
  int64_t other = 0, unexpected = 0, calls = 0;
  std::fprintf(out, "%-34s %8s %8s %9s %9s %9s %5s  %s\n", "operation", "calls", "OK", "p50 ms",
               "p99 ms", "max ms", "bad", "other codes");
  for (const auto& [kind, op] : all.ops()) {
    std::vector<float> sorted = op.latencies_us;
    std::sort(sorted.begin(), sorted.end());
    std::string codes;
    for (int c = 1; c < kCodes; ++c) {
      if (op.codes[c] == 0) continue;
      absl::StrAppend(&codes, codes.empty() ? "" : " ", CodeName(c), "=", op.codes[c]);
    }
    if (op.other_codes > 0) absl::StrAppend(&codes, " other=", op.other_codes);
    std::fprintf(out, "%-34s %8lld %8lld %9.2f %9.2f %9.1f %5lld  %s\n", kind.c_str(),
                 static_cast<long long>(op.calls()), static_cast<long long>(op.codes[0]),
                 Percentile(sorted, 0.5) / 1000.0, Percentile(sorted, 0.99) / 1000.0,
                 sorted.empty() ? 0.0 : sorted.back() / 1000.0,
                 static_cast<long long>(op.unexpected), codes.c_str());
    for (int c = 0; c < kCodes; ++c) totals[c] += op.codes[c];
    other += op.other_codes;
    unexpected += op.unexpected;
    calls += op.calls();
  }
  std::fprintf(out, "\ntotal: %lld calls in %.0f s (%.1f calls/s), %lld unexpected\n",
               static_cast<long long>(calls), seconds, seconds > 0 ? calls / seconds : 0.0,
               static_cast<long long>(unexpected));
  std::fprintf(out, "by code:");
  for (int c = 0; c < kCodes; ++c) {
    if (totals[c] > 0) {
      std::fprintf(out, " %s=%lld", CodeName(c).c_str(), static_cast<long long>(totals[c]));
    }
  }
  if (other > 0) std::fprintf(out, " other=%lld", static_cast<long long>(other));
  std::fprintf(out, "\n");
}

}  // namespace soak
}  // namespace kvmesh

// What eviction costs an Append (docs/api.md#eviction): the latency of a 16-token Append of a new
// sequence into a full cache of N sequences under the LRU policy, which evicts the least
// recently used one first, against the same Append into a cache with room (policy NONE, one
// sequence removed beforehand, its Remove not timed), measured in the same run.
//
//   eviction_bench [--appends=N (2000)] [--max-sequences=N (100000)]
//
// Caches of 1K, 10K and 100K sequences (up to --max-sequences) of 16 positions each, one
// Attention group of 1 layer x 1 head x 8 dims (f16) on the HostDevice: what is measured is the
// bookkeeping, not the bytes. Prints p50, p99 and the mean in microseconds.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "cache/cache.h"
#include "cache/device/host_device.h"
#include "cache/spec.h"

namespace kvmesh {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int32_t kTokens = 16;

struct Flags {
  int appends = 2000;
  int64_t max_sequences = 100000;
};

Flags ParseFlags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    int64_t v = 0;
    if (absl::ConsumePrefix(&arg, "--appends=") && absl::SimpleAtoi(arg, &v) && v > 0) {
      f.appends = static_cast<int>(v);
    } else if (absl::ConsumePrefix(&arg, "--max-sequences=") && absl::SimpleAtoi(arg, &v) &&
               v > 0) {
      f.max_sequences = v;
    } else {
      std::fprintf(stderr, "usage: eviction_bench [--appends=N] [--max-sequences=N]\n");
      std::exit(2);
    }
  }
  return f;
}

CacheSpec BenchSpec(int32_t sequences, EvictionPolicy policy) {
  CacheSpec spec;
  spec.name = "evict";
  spec.dtype = DType::kF16;
  spec.max_sequences = sequences;
  spec.capacity = kTokens;
  spec.max_batch = kTokens;
  spec.eviction = policy;
  GroupSpec g;
  g.num_layers = 1;
  g.kind = GroupKind::kAttention;
  g.attention.num_kv_heads = 1;
  g.attention.head_dim_k = 8;
  g.attention.head_dim_v = 8;
  spec.groups.push_back(g);
  return spec;
}

std::vector<Token> TokensOf(int64_t seq) {
  std::vector<Token> tokens(kTokens);
  for (int32_t p = 0; p < kTokens; ++p) tokens[p] = Token{seq, p};
  return tokens;
}

void Check(const absl::Status& status, const char* what) {
  if (status.ok()) return;
  std::fprintf(stderr, "eviction_bench: %s: %s\n", what, status.ToString().c_str());
  std::exit(1);
}

struct Stats {
  double p50 = 0, p99 = 0, mean = 0;
};

Stats Summarize(std::vector<double> us) {
  std::sort(us.begin(), us.end());
  Stats s;
  s.p50 = us[us.size() / 2];
  s.p99 = us[std::min(us.size() - 1, us.size() * 99 / 100)];
  for (double u : us) s.mean += u;
  s.mean /= static_cast<double>(us.size());
  return s;
}

// Appends of new sequences into a full cache of `n` (LRU), or into one with room (NONE: the
// oldest sequence is removed before each timed Append).
Stats Run(int32_t n, EvictionPolicy policy, int appends, const std::vector<uint8_t>& payload) {
  HostDevice device(size_t{4} << 30);
  absl::StatusOr<std::unique_ptr<Cache>> created = Cache::Create(BenchSpec(n, policy), &device);
  Check(created.status(), "Create");
  Cache& cache = **created;
  for (int64_t seq = 0; seq < n; ++seq) Check(cache.Append(TokensOf(seq), payload), "fill");
  std::vector<double> us;
  us.reserve(appends);
  for (int i = 0; i < appends; ++i) {
    const int64_t seq = n + i;
    if (policy == EvictionPolicy::kNone) Check(cache.Remove(i, 0, std::nullopt), "Remove");
    const std::vector<Token> tokens = TokensOf(seq);
    const auto start = Clock::now();
    Check(cache.Append(tokens, payload), "Append");
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
  }
  if (policy == EvictionPolicy::kLru && cache.Evictions().lru != appends) {
    std::fprintf(stderr, "eviction_bench: %lld evictions, expected %d\n",
                 static_cast<long long>(cache.Evictions().lru), appends);
    std::exit(1);
  }
  return Summarize(std::move(us));
}

}  // namespace
}  // namespace kvmesh

int main(int argc, char** argv) {
  using namespace kvmesh;
  const Flags flags = ParseFlags(argc, argv);
  const std::vector<uint8_t> payload(
      AppendPayloadBytes(BenchSpec(1, EvictionPolicy::kNone), kTokens, 1), 1);
  std::printf("%-10s %-28s %10s %10s %10s\n", "sequences", "append of 16 tokens", "p50 us",
              "p99 us", "mean us");
  for (int64_t n = 1000; n <= flags.max_sequences; n *= 10) {
    for (EvictionPolicy policy : {EvictionPolicy::kNone, EvictionPolicy::kLru}) {
      const Stats s = Run(static_cast<int32_t>(n), policy, flags.appends, payload);
      std::printf("%-10lld %-28s %10.1f %10.1f %10.1f\n", static_cast<long long>(n),
                  policy == EvictionPolicy::kLru ? "full, evicts one (lru)" : "with room (none)",
                  s.p50, s.p99, s.mean);
      std::fflush(stdout);
    }
  }
  return 0;
}

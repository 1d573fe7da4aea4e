// Prefix lookups against a cache's block index (Cache::LookupPrefix, docs/api.md#tokens):
// latency (p50, p99) and lookups/s of 4K-token prompts as the index grows from 10K to 10M
// blocks, the bytes the index and the chains take per block, and what building the index costs
// an Append (the same Appends without token ids are the reference, measured in the same run).
//
//   lookup_bench [--max-blocks=N (10000000)] [--lookups=N (20000)] [--block=B (16)]
//
// The caches are built with real Appends of token ids on the HostDevice. To reach 10M distinct
// blocks in one cache (more positions than a group may have cells, 2^24), the cache's one
// Attention group is a sliding window of 16 tokens: pruned positions keep their ids and blocks
// (docs/api.md#tokens), which is all a lookup reads, so the index and the chains are what they
// would be with full attention, without the cells. Sequences are 64K tokens: 2,048 tokens from
// one of 64 shared "system prompts", then their own random ids.
//
// Prompts, each 4,096 tokens:
//   shared  a system prompt, then random ids: matches 2,048 tokens of many sequences
//   whole   the first 4,096 tokens of one sequence: matches all of them, one holder
//   miss    random ids: the first block is not in the index
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
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

constexpr int32_t kSequenceTokens = 1 << 16;
constexpr int32_t kSystemTokens = 2048;
constexpr int kSystemPrompts = 64;
constexpr int32_t kPromptTokens = 4096;
constexpr int32_t kBatch = 8192;
constexpr int32_t kVocabulary = 128000;

struct Flags {
  int64_t max_blocks = 10'000'000;
  int lookups = 20000;
  int32_t block = 16;
};

Flags ParseFlags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    auto value = [&](absl::string_view name, int64_t* out) {
      if (!absl::ConsumePrefix(&arg, name)) return false;
      if (!absl::SimpleAtoi(arg, out) || *out <= 0) {
        std::fprintf(stderr, "lookup_bench: bad %s%s\n", std::string(name).c_str(),
                     std::string(arg).c_str());
        std::exit(2);
      }
      return true;
    };
    int64_t v = 0;
    if (value("--max-blocks=", &v)) {
      f.max_blocks = v;
    } else if (value("--lookups=", &v)) {
      f.lookups = static_cast<int>(v);
    } else if (value("--block=", &v)) {
      f.block = static_cast<int32_t>(v);
    } else {
      std::fprintf(stderr, "usage: lookup_bench [--max-blocks=N] [--lookups=N] [--block=B]\n");
      std::exit(2);
    }
  }
  return f;
}

CacheSpec BenchSpec(int32_t sequences, int32_t block) {
  CacheSpec spec;
  spec.name = "lookup";
  spec.dtype = DType::kF16;
  spec.max_sequences = sequences;
  spec.capacity = kSequenceTokens;
  spec.max_batch = kBatch;
  spec.token_block_size = block;
  GroupSpec g;
  g.num_layers = 1;
  g.kind = GroupKind::kAttention;
  g.attention.num_kv_heads = 1;
  g.attention.head_dim_k = 1;
  g.attention.head_dim_v = 1;
  g.attention.window.kind = WindowKind::kSliding;
  g.attention.window.window = 16;
  spec.groups.push_back(g);
  return spec;
}

// The ids of sequence `seq`: its system prompt, then its own.
std::vector<int32_t> SequenceIds(const std::vector<std::vector<int32_t>>& systems, int64_t seq,
                                 int32_t length) {
  std::vector<int32_t> ids = systems[static_cast<size_t>(seq) % systems.size()];
  ids.resize(static_cast<size_t>(length));
  std::mt19937 rng(static_cast<uint32_t>(seq) * 2654435761u + 1);
  for (size_t i = kSystemTokens; i < ids.size(); ++i)
    ids[i] = static_cast<int32_t>(rng() % kVocabulary);
  return ids;
}

// Appends `sequences` sequences of `length` tokens (with ids unless `with_ids` is false);
// returns the seconds it took.
double Fill(Cache& cache, const std::vector<std::vector<int32_t>>& systems, int32_t sequences,
            int32_t length, bool with_ids) {
  const std::vector<uint8_t> payload(AppendPayloadBytes(cache.spec(), kBatch, 1), 0);
  std::vector<Token> tokens(kBatch);
  const Clock::time_point start = Clock::now();
  for (int64_t seq = 0; seq < sequences; ++seq) {
    const std::vector<int32_t> ids = SequenceIds(systems, seq, length);
    for (int32_t begin = 0; begin < length; begin += kBatch) {
      const int32_t n = std::min(kBatch, length - begin);
      tokens.resize(static_cast<size_t>(n));
      for (int32_t i = 0; i < n; ++i) {
        tokens[i] =
            Token{seq, begin + i, with_ids ? ids[static_cast<size_t>(begin + i)] : kNoTokenId};
      }
      const absl::Status status = cache.Append(
          tokens, absl::MakeConstSpan(payload.data(), AppendPayloadBytes(cache.spec(), n, 1)));
      if (!status.ok()) {
        std::fprintf(stderr, "lookup_bench: Append: %s\n", status.ToString().c_str());
        std::exit(1);
      }
    }
  }
  return std::chrono::duration<double>(Clock::now() - start).count();
}

struct Latency {
  double p50_us = 0;
  double p99_us = 0;
  double per_second = 0;  // one thread
  int32_t matched = 0;    // tokens the last lookup matched
};

Latency Measure(const Cache& cache, const std::vector<std::vector<int32_t>>& prompts, int lookups) {
  std::vector<double> us;
  us.reserve(static_cast<size_t>(lookups));
  Latency out;
  const Clock::time_point start = Clock::now();
  for (int i = 0; i < lookups; ++i) {
    const std::vector<int32_t>& prompt = prompts[static_cast<size_t>(i) % prompts.size()];
    const Clock::time_point t0 = Clock::now();
    absl::StatusOr<std::vector<PrefixMatch>> got = cache.LookupPrefix(prompt, 1);
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    if (!got.ok()) {
      std::fprintf(stderr, "lookup_bench: LookupPrefix: %s\n", got.status().ToString().c_str());
      std::exit(1);
    }
    out.matched = got->empty() ? 0 : (*got)[0].length;
  }
  out.per_second = lookups / std::chrono::duration<double>(Clock::now() - start).count();
  std::sort(us.begin(), us.end());
  out.p50_us = us[us.size() / 2];
  out.p99_us = us[us.size() * 99 / 100];
  return out;
}

// The reference: p50 and p99 of hashing a prompt's whole blocks alone (what every lookup does
// before it looks anything up), with the cache's hasher.
Latency HashOnly(const TokenHasher& hasher, const std::vector<std::vector<int32_t>>& prompts,
                 int reps) {
  std::vector<double> us;
  uint64_t sink = 0;
  for (int i = 0; i < reps; ++i) {
    const std::vector<int32_t>& p = prompts[static_cast<size_t>(i) % prompts.size()];
    const Clock::time_point t0 = Clock::now();
    uint64_t h = hasher.seed;
    const size_t b = static_cast<size_t>(hasher.block_size);
    for (size_t k = 0; k + b <= p.size(); k += b) {
      h = hasher.Block(h, absl::MakeConstSpan(p.data() + k, b));
    }
    sink ^= h;
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  std::sort(us.begin(), us.end());
  Latency out;
  out.p50_us = us[us.size() / 2];
  out.p99_us = us[us.size() * 99 / 100];
  out.matched = static_cast<int32_t>(sink & 1);  // keeps the loop
  return out;
}

// Lookups/s of `threads` threads at once, each doing `lookups` of `prompts`.
double Concurrent(const Cache& cache, const std::vector<std::vector<int32_t>>& prompts, int lookups,
                  int threads) {
  const Clock::time_point start = Clock::now();
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      for (int i = 0; i < lookups; ++i) {
        (void)cache.LookupPrefix(prompts[static_cast<size_t>(i + t) % prompts.size()], 1);
      }
    });
  }
  for (std::thread& w : workers) w.join();
  return threads * lookups / std::chrono::duration<double>(Clock::now() - start).count();
}

int Run(const Flags& flags) {
  std::mt19937 rng(42);
  std::vector<std::vector<int32_t>> systems(kSystemPrompts);
  for (auto& s : systems) {
    s.resize(kSystemTokens);
    for (int32_t& id : s) id = static_cast<int32_t>(rng() % kVocabulary);
  }
  std::printf(
      "block %d tokens; sequences of %d tokens (%d from one of %d system prompts); "
      "prompts of %d tokens; %d lookups per row\n",
      flags.block, kSequenceTokens, kSystemTokens, kSystemPrompts, kPromptTokens, flags.lookups);
  std::printf("%10s %6s | %-8s %6s %9s %9s %11s | %11s | %9s %9s %9s | %s\n", "blocks", "seqs",
              "prompt", "match", "p50 us", "p99 us", "lookups/s", "2 thr /s", "index B/b",
              "chain B/b", "entries", "append with ids vs without (Mtok/s)");
  for (int64_t target = 10'000; target <= flags.max_blocks; target *= 10) {
    const int64_t blocks_per_seq = kSequenceTokens / flags.block;
    int32_t sequences = static_cast<int32_t>((target + blocks_per_seq - 1) / blocks_per_seq);
    int32_t length = kSequenceTokens;
    if (sequences == 1) length = static_cast<int32_t>(target * flags.block);
    HostDevice device(size_t{8} << 30);
    absl::StatusOr<std::unique_ptr<Cache>> created =
        Cache::Create(BenchSpec(std::max(sequences, 2), flags.block), &device);
    if (!created.ok()) {
      std::fprintf(stderr, "lookup_bench: %s\n", created.status().ToString().c_str());
      return 1;
    }
    Cache& cache = **created;
    const double with_ids = Fill(cache, systems, sequences, length, true);
    const TokenIndexStats stats = cache.TokenIndex();
    // The reference: the same Appends into a second cache without ids.
    double without_ids = 0;
    {
      HostDevice plain_device(size_t{8} << 30);
      absl::StatusOr<std::unique_ptr<Cache>> plain =
          Cache::Create(BenchSpec(std::max(sequences, 2), flags.block), &plain_device);
      if (!plain.ok()) return 1;
      without_ids = Fill(**plain, systems, sequences, length, false);
    }
    const double tokens = static_cast<double>(sequences) * length;

    std::vector<std::vector<int32_t>> shared, whole, miss;
    for (int i = 0; i < 64; ++i) {
      // A system prompt some sequence holds (sequence s holds s mod 64).
      std::vector<int32_t> p =
          systems[static_cast<size_t>(i) % std::min<size_t>(systems.size(), sequences)];
      while (p.size() < static_cast<size_t>(kPromptTokens)) {
        p.push_back(static_cast<int32_t>(rng() % kVocabulary));
      }
      shared.push_back(p);
      std::vector<int32_t> w = SequenceIds(systems, static_cast<int64_t>(rng() % sequences),
                                           std::min(length, kPromptTokens));
      whole.push_back(w);
      std::vector<int32_t> m(kPromptTokens);
      for (int32_t& id : m) id = static_cast<int32_t>(rng() % kVocabulary);
      miss.push_back(m);
    }
    const size_t chain_bytes = sizeof(uint64_t) + sizeof(int32_t) * flags.block;
    bool first = true;
    for (const auto& [name, prompts] :
         {std::pair<const char*, const std::vector<std::vector<int32_t>>*>{"shared", &shared},
          {"whole", &whole},
          {"miss", &miss}}) {
      const Latency l = Measure(cache, *prompts, flags.lookups);
      const double two = Concurrent(cache, *prompts, flags.lookups / 2, 2);
      if (first) {
        std::printf(
            "%10zu %6d | %-8s %6d %9.1f %9.1f %11.0f | %11.0f | %9.1f %9zu %9zu | "
            "%.1f vs %.1f\n",
            stats.hashes, sequences, name, l.matched, l.p50_us, l.p99_us, l.per_second, two,
            static_cast<double>(stats.bytes) / std::max<size_t>(stats.hashes, 1), chain_bytes,
            stats.entries, tokens / with_ids / 1e6, tokens / without_ids / 1e6);
      } else {
        std::printf("%10s %6s | %-8s %6d %9.1f %9.1f %11.0f | %11.0f |\n", "", "", name, l.matched,
                    l.p50_us, l.p99_us, l.per_second, two);
      }
      first = false;
    }
    const Latency hash = HashOnly(cache.token_hasher(), whole, flags.lookups);
    std::printf("%10s %6s | reference: hashing a prompt's %d blocks alone: p50 %.1f us, "
                "p99 %.1f us\n",
                "", "", kPromptTokens / flags.block, hash.p50_us, hash.p99_us);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace
}  // namespace kvmesh

int main(int argc, char** argv) { return kvmesh::Run(kvmesh::ParseFlags(argc, argv)); }

// Engine benchmarks: kvmesh::Cache on HostDevice at the KV shape of Llama-3-8B (32 layers,
// 8 KV heads, head dim 128, F16, NEOX RoPE over 128 dims, base 500000): 128 KiB per token,
// 512 MiB per 4K-token sequence.
//
// Snapshot and Restore copy a 4K-token sequence (and a Qwen3-Next-sized recurrent state)
// between a cache and the snapshot pool.
//
// Each benchmark creates its own cache and frees it when done, so at most about 1 GiB of host
// memory is touched at a time. Destructive operations (Remove) restore their input outside the
// timed region, with a fixed iteration count so the untimed setup stays bounded. Arenas are
// touched once before timing, so the figures are steady state, not first-touch page faults.
//
//   build-*/tests/bench/engine_bench [--benchmark_filter=Remove]
//
// Counters: bytes_per_second is the K/V bytes the operation produces or delivers (see each
// benchmark); items_per_second is tokens.
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "absl/types/span.h"
#include "benchmark/benchmark.h"
#include "cache/cache.h"
#include "cache/device/host_device.h"
#include "cache/spec.h"
#include "tests/testing/llama_spec.h"
#include "tests/testing/pattern.h"

namespace kvmesh {
namespace {

// Host memory is only accounted against this budget; pages are used when written.
constexpr size_t kBudgetBytes = size_t{64} << 30;
constexpr int32_t kMaxBatch = 512;
constexpr int32_t kSequenceTokens = 4096;

CacheSpec LlamaSpec(int32_t max_sequences, int32_t capacity) {
  return testutil::Llama3_8BSpec("llama3-8b", max_sequences, capacity, kMaxBatch);
}

size_t TokenBytes() { return GroupTokenBytes(LlamaSpec(1, 1), 0); }
size_t KeyBytesPerToken() { return TokenBytes() / 2; }  // head_dim_k == head_dim_v

// The payload of `n` tokens (pattern data), built once per n: every bench uses the same shape.
const std::vector<uint8_t>& Payload(int32_t n) {
  static auto* const payloads = new std::map<int32_t, std::vector<uint8_t>>();
  auto it = payloads->find(n);
  if (it == payloads->end()) {
    std::vector<uint64_t> ids(n);
    for (int32_t i = 0; i < n; ++i) ids[i] = static_cast<uint64_t>(i);
    it = payloads->emplace(n, testutil::AppendPayload(LlamaSpec(1, 1), ids)).first;
  }
  return it->second;
}

std::vector<Token> Tokens(int64_t seq, int32_t begin, int32_t end) {
  std::vector<Token> tokens;
  tokens.reserve(end - begin);
  for (int32_t p = begin; p < end; ++p) tokens.push_back(Token{seq, p});
  return tokens;
}

// Appends positions [begin, end) of `seq` in batches of at most kMaxBatch tokens.
absl::Status Fill(Cache& cache, int64_t seq, int32_t begin, int32_t end) {
  for (int32_t b = begin; b < end; b += kMaxBatch) {
    const int32_t e = std::min(end, b + kMaxBatch);
    const std::vector<Token> tokens = Tokens(seq, b, e);
    absl::Status s = cache.Append(tokens, Payload(e - b));
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

// A cache of the Llama shape, or nullptr after reporting the error to `state`.
std::unique_ptr<Cache> MakeCache(benchmark::State& state, HostDevice* device, int32_t max_sequences,
                                 int32_t capacity) {
  auto cache = Cache::Create(LlamaSpec(max_sequences, capacity), device);
  if (!cache.ok()) {
    state.SkipWithError(cache.status().ToString().c_str());
    return nullptr;
  }
  return std::move(cache).value();
}

bool Check(benchmark::State& state, const absl::Status& s) {
  if (s.ok()) return true;
  state.SkipWithError(s.ToString().c_str());
  return false;
}

// Append of batches of state.range(0) tokens to one sequence, building it up to 4K tokens and
// truncating it (untimed) when full. Bytes: the payload sent in.
void BM_Append(benchmark::State& state) {
  const int32_t batch = static_cast<int32_t>(state.range(0));
  HostDevice device(kBudgetBytes);
  std::unique_ptr<Cache> cache = MakeCache(state, &device, 1, kSequenceTokens);
  if (cache == nullptr) return;
  // Touch every cell once so the timed appends do not pay for first-touch page faults.
  if (!Check(state, Fill(*cache, 0, 0, kSequenceTokens))) return;
  if (!Check(state, cache->Remove(0, 0, std::nullopt))) return;
  const std::vector<uint8_t>& payload = Payload(batch);
  std::vector<Token> tokens = Tokens(0, 0, batch);
  int32_t next = 0;
  for (auto _ : state) {
    if (next + batch > kSequenceTokens) {
      state.PauseTiming();
      const absl::Status s = cache->Remove(0, 0, std::nullopt);
      next = 0;
      state.ResumeTiming();
      if (!Check(state, s)) break;
    }
    for (int32_t i = 0; i < batch; ++i) tokens[i].pos = next + i;
    if (!Check(state, cache->Append(tokens, payload))) break;
    next += batch;
  }
  state.SetItemsProcessed(state.iterations() * batch);
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(payload.size()));
}
BENCHMARK(BM_Append)->Arg(1)->Arg(16)->Arg(128)->Arg(512)->UseRealTime()->Unit(
    benchmark::kMicrosecond);

// Read of a whole sequence of state.range(0) tokens into a fresh payload. Bytes: the payload.
void BM_Read(benchmark::State& state) {
  const int32_t n = static_cast<int32_t>(state.range(0));
  HostDevice device(kBudgetBytes);
  std::unique_ptr<Cache> cache = MakeCache(state, &device, 1, kSequenceTokens);
  if (cache == nullptr || !Check(state, Fill(*cache, 0, 0, n))) return;
  size_t bytes = 0;
  for (auto _ : state) {
    auto result = cache->Read(0, 0, std::nullopt);
    if (!Check(state, result.status())) break;
    bytes = result->payload.size();
    benchmark::DoNotOptimize(result->payload.data());
  }
  state.SetItemsProcessed(state.iterations() * n);
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(bytes));
}
BENCHMARK(BM_Read)->Arg(512)->Arg(4096)->UseRealTime()->Unit(benchmark::kMillisecond);

// Cache::OpenRead of the same sequence, its payload gathered in 4 MiB pieces into one reused,
// touched buffer (as the Read RPC sends it: one chunk at a time). Bytes: the payload.
void BM_ReadCursor(benchmark::State& state) {
  const int32_t n = static_cast<int32_t>(state.range(0));
  HostDevice device(kBudgetBytes);
  std::unique_ptr<Cache> made = MakeCache(state, &device, 1, kSequenceTokens);
  if (made == nullptr || !Check(state, Fill(*made, 0, 0, n))) return;
  const std::shared_ptr<Cache> cache = std::move(made);
  std::vector<uint8_t> chunk(size_t{4} << 20, 1);
  size_t bytes = 0;
  for (auto _ : state) {
    absl::StatusOr<std::unique_ptr<ReadCursor>> cursor = Cache::OpenRead(cache, 0, 0, std::nullopt);
    if (!Check(state, cursor.status())) break;
    bytes = (*cursor)->size();
    for (size_t at = 0; at < bytes; at += chunk.size()) {
      const size_t len = std::min(chunk.size(), bytes - at);
      if (!Check(state, (*cursor)->ReadAt(at, absl::MakeSpan(chunk.data(), len)))) return;
      benchmark::DoNotOptimize(chunk.data());
    }
  }
  state.SetItemsProcessed(state.iterations() * n);
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(bytes));
}
BENCHMARK(BM_ReadCursor)->Arg(512)->Arg(4096)->UseRealTime()->Unit(benchmark::kMillisecond);

// The reference for both Reads: memcpy of a sequence's payload (state.range(0) tokens) from
// one touched buffer into another, in 4 MiB pieces. Bytes: the payload.
void BM_MemcpyReference(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0)) * TokenBytes();
  std::vector<uint8_t> src(bytes, 1);
  std::vector<uint8_t> dst(size_t{4} << 20, 2);
  for (auto _ : state) {
    for (size_t at = 0; at < bytes; at += dst.size()) {
      std::memcpy(dst.data(), src.data() + at, std::min(dst.size(), bytes - at));
      benchmark::DoNotOptimize(dst.data());
    }
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(bytes));
}
BENCHMARK(BM_MemcpyReference)->Arg(512)->Arg(4096)->UseRealTime()->Unit(benchmark::kMillisecond);

// CopyPrefix of state.range(0) tokens of a 4K-token sequence into one of 15 other sequences in
// turn (16 live sequences, each dst's old fork released). Cells are shared, not copied; bytes
// are the K/V a deep copy would have moved (the work the fork saves), items the tokens forked.
void BM_CopyPrefix(benchmark::State& state) {
  const int32_t length = static_cast<int32_t>(state.range(0));
  constexpr int32_t kSequences = 16;
  HostDevice device(kBudgetBytes);
  std::unique_ptr<Cache> cache = MakeCache(state, &device, kSequences, kSequenceTokens);
  if (cache == nullptr || !Check(state, Fill(*cache, 0, 0, kSequenceTokens))) return;
  for (int64_t dst = 1; dst < kSequences; ++dst) {
    if (!Check(state, cache->CopyPrefix(0, dst, length))) return;
  }
  int64_t dst = 1;
  for (auto _ : state) {
    if (!Check(state, cache->CopyPrefix(0, dst, length))) break;
    dst = dst + 1 < kSequences ? dst + 1 : 1;
  }
  state.SetItemsProcessed(state.iterations() * length);
  state.SetBytesProcessed(state.iterations() * length * static_cast<int64_t>(TokenBytes()));
}
BENCHMARK(BM_CopyPrefix)->Arg(4096)->Arg(2048)->UseRealTime()->Unit(benchmark::kMicrosecond);

// Remove truncating the last state.range(0) tokens of a 4K-token sequence (appended back
// untimed). Nothing moves, so no bytes; items are the tokens dropped.
void BM_RemoveTruncate(benchmark::State& state) {
  const int32_t tail = static_cast<int32_t>(state.range(0));
  HostDevice device(kBudgetBytes);
  std::unique_ptr<Cache> cache = MakeCache(state, &device, 1, kSequenceTokens);
  if (cache == nullptr || !Check(state, Fill(*cache, 0, 0, kSequenceTokens))) return;
  for (auto _ : state) {
    if (!Check(state, cache->Remove(0, kSequenceTokens - tail, std::nullopt))) break;
    state.PauseTiming();
    const absl::Status s = Fill(*cache, 0, kSequenceTokens - tail, kSequenceTokens);
    state.ResumeTiming();
    if (!Check(state, s)) break;
  }
  state.SetItemsProcessed(state.iterations() * tail);
}
BENCHMARK(BM_RemoveTruncate)
    ->Arg(512)
    ->Iterations(50)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

// A context shift: Remove [16, 144) from a private 4K-token sequence, so 3952 tokens move down
// by 128 and their keys are re-rotated (NEOX, 128 dims). The 128 tokens are appended back at the
// end untimed. Bytes: the keys re-rotated; items: tokens moved.
void BM_RemoveMiddle(benchmark::State& state) {
  constexpr int32_t kBegin = 16, kEnd = 144;
  constexpr int32_t kMoved = kSequenceTokens - kEnd;
  HostDevice device(kBudgetBytes);
  std::unique_ptr<Cache> cache = MakeCache(state, &device, 1, kSequenceTokens);
  if (cache == nullptr || !Check(state, Fill(*cache, 0, 0, kSequenceTokens))) return;
  for (auto _ : state) {
    if (!Check(state, cache->Remove(0, kBegin, kEnd))) break;
    state.PauseTiming();
    const absl::Status s = Fill(*cache, 0, kSequenceTokens - (kEnd - kBegin), kSequenceTokens);
    state.ResumeTiming();
    if (!Check(state, s)) break;
  }
  state.SetItemsProcessed(state.iterations() * kMoved);
  state.SetBytesProcessed(state.iterations() * kMoved * static_cast<int64_t>(KeyBytesPerToken()));
}
BENCHMARK(BM_RemoveMiddle)->Iterations(8)->UseRealTime()->Unit(benchmark::kMillisecond);

// The same context shift on a fork whose cells all are shared with its source (the fork is
// re-made untimed before each Remove): the moved cells are copied (K and V) before their keys
// are re-rotated. Bytes: K/V of the moved tokens written; items: tokens moved.
void BM_RemoveMiddleShared(benchmark::State& state) {
  constexpr int32_t kBegin = 16, kEnd = 144;
  constexpr int32_t kMoved = kSequenceTokens - kEnd;
  HostDevice device(kBudgetBytes);
  std::unique_ptr<Cache> cache = MakeCache(state, &device, 2, kSequenceTokens);
  if (cache == nullptr || !Check(state, Fill(*cache, 0, 0, kSequenceTokens))) return;
  for (auto _ : state) {
    state.PauseTiming();
    const absl::Status s = cache->CopyPrefix(0, 1, kSequenceTokens);
    state.ResumeTiming();
    if (!Check(state, s)) break;
    if (!Check(state, cache->Remove(1, kBegin, kEnd))) break;
  }
  state.SetItemsProcessed(state.iterations() * kMoved);
  state.SetBytesProcessed(state.iterations() * kMoved * static_cast<int64_t>(TokenBytes()));
}
BENCHMARK(BM_RemoveMiddleShared)->Iterations(8)->UseRealTime()->Unit(benchmark::kMillisecond);

// Snapshot of a whole 4K-token sequence into the snapshot pool (a fresh allocation each time,
// dropped untimed). Bytes: the K/V copied.
void BM_Snapshot(benchmark::State& state) {
  HostDevice device(kBudgetBytes);
  std::unique_ptr<Cache> cache = MakeCache(state, &device, 2, kSequenceTokens);
  if (cache == nullptr || !Check(state, Fill(*cache, 0, 0, kSequenceTokens))) return;
  size_t bytes = 0;
  for (auto _ : state) {
    auto snap = cache->Snapshot(0, 0);
    if (!Check(state, snap.status())) break;
    bytes = snap->bytes;
    state.PauseTiming();
    const absl::Status dropped = cache->DropSnapshot(snap->id);
    state.ResumeTiming();
    if (!Check(state, dropped)) break;
  }
  state.SetItemsProcessed(state.iterations() * kSequenceTokens);
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(bytes));
}
BENCHMARK(BM_Snapshot)->Iterations(8)->UseRealTime()->Unit(benchmark::kMillisecond);

// Restore of a 4K-token snapshot into another (empty) sequence, which is truncated untimed
// afterwards. Bytes: the K/V copied back.
void BM_Restore(benchmark::State& state) {
  HostDevice device(kBudgetBytes);
  std::unique_ptr<Cache> cache = MakeCache(state, &device, 2, kSequenceTokens);
  if (cache == nullptr || !Check(state, Fill(*cache, 0, 0, kSequenceTokens))) return;
  auto snap = cache->Snapshot(0, 0);
  if (!Check(state, snap.status())) return;
  // Touch the destination cells once so the timed restores do not pay for first-touch faults.
  if (!Check(state, Fill(*cache, 1, 0, kSequenceTokens))) return;
  if (!Check(state, cache->Remove(1, 0, std::nullopt))) return;
  for (auto _ : state) {
    if (!Check(state, cache->Restore(1, snap->id, kSequenceTokens))) break;
    state.PauseTiming();
    const absl::Status removed = cache->Remove(1, 0, std::nullopt);
    state.ResumeTiming();
    if (!Check(state, removed)) break;
  }
  state.SetItemsProcessed(state.iterations() * kSequenceTokens);
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(snap->bytes));
}
BENCHMARK(BM_Restore)->Iterations(8)->UseRealTime()->Unit(benchmark::kMillisecond);

// The recurrent state of Qwen3-Next-80B's 36 gated-delta layers: conv [3][8192] F16 and delta
// [32][128][128] float32 per layer, 73.7 MiB per sequence.
CacheSpec QwenNextStateSpec() {
  CacheSpec spec;
  spec.name = "qwen3-next-state";
  spec.dtype = DType::kF16;
  spec.max_sequences = 2;
  spec.capacity = kSequenceTokens;
  spec.max_batch = 1;
  GroupSpec group;
  group.num_layers = 36;
  group.kind = GroupKind::kRecurrent;
  group.recurrent.conv_tail = 3;
  group.recurrent.conv_dim = 8192;
  group.recurrent.num_v_heads = 32;
  group.recurrent.head_v_dim = 128;
  group.recurrent.head_k_dim = 128;
  spec.groups.push_back(group);
  return spec;
}

// Snapshot (state.range(0) == 0) or Restore (1) of one recurrent state. Bytes: the state.
void BM_RecurrentState(benchmark::State& state) {
  const bool restore = state.range(0) == 1;
  HostDevice device(kBudgetBytes);
  const CacheSpec spec = QwenNextStateSpec();
  auto created = Cache::Create(spec, &device);
  if (!Check(state, created.status())) return;
  Cache& cache = **created;
  const uint64_t state_id = 1;
  const std::vector<uint64_t> token_ids = {0};
  const std::vector<uint8_t> payload =
      testutil::AppendPayload(spec, token_ids, absl::MakeConstSpan(&state_id, 1));
  const Token token{0, 0};
  if (!Check(state, cache.Append({&token, 1}, payload))) return;
  auto snap = cache.Snapshot(0, 0);
  if (!Check(state, snap.status())) return;
  for (auto _ : state) {
    if (restore) {
      if (!Check(state, cache.Restore(0, snap->id, 1))) break;
    } else {
      auto taken = cache.Snapshot(0, 0);
      if (!Check(state, taken.status())) break;
      state.PauseTiming();
      const absl::Status dropped = cache.DropSnapshot(taken->id);
      state.ResumeTiming();
      if (!Check(state, dropped)) break;
    }
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(snap->bytes));
}
BENCHMARK(BM_RecurrentState)
    ->Arg(0)
    ->Arg(1)
    ->Iterations(16)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace kvmesh

BENCHMARK_MAIN();

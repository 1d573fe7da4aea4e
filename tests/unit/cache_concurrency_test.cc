// Concurrent use of one Cache and one CacheRegistry. Every thread works on its own sequences,
// so the outcome is the same under any interleaving and each thread checks its own data exactly;
// the shared pool is large enough that no operation runs out of cells. Meant for TSan too.
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cache/cache.h"
#include "cache/cache_registry.h"
#include "gtest/gtest.h"
#include "tests/unit/cache_test_util.h"

namespace kvmesh {
namespace {

using testutil::AppendRange;
using testutil::Full;
using testutil::Group;
using testutil::Ids;
using testutil::Range;
using testutil::ReadPayload;
using testutil::Rope;
using testutil::Sliding;
using testutil::Spec;
using testutil::TestCache;

constexpr int kThreads = 4;
constexpr int kRounds = 200;

TEST(CacheConcurrencyTest, IndependentSequencesFromManyThreads) {
  // Each thread uses sequences 2t and 2t+1.
  const CacheSpec spec = Spec(DType::kF16, 2 * kThreads, 32, 8,
                              {Group(Full(), 2, 2, 4, 2, Rope(RopeType::kNormal, 4)),
                               Group(Sliding(4, 12), 1, 1, 2, 2, Rope(RopeType::kNeox, 2))});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  std::atomic<int> failures{0};
  std::atomic<bool> done{false};

  auto worker = [&](int t) {
    const int64_t a = 2 * t;
    const int64_t b = 2 * t + 1;
    for (int round = 0; round < kRounds; ++round) {
      const uint64_t salt = static_cast<uint64_t>(round);
      // a: 0..11 in two batches; b: a copy of a's first 6; then both checked and dropped.
      bool ok = AppendRange(cache, a, 0, 6, salt).ok() && AppendRange(cache, a, 6, 12, salt).ok();
      ok = ok && cache.CopyPrefix(a, b, 6).ok();
      absl::StatusOr<ReadResult> read = cache.Read(b, 0, std::nullopt);
      ok = ok && read.ok() &&
           read->payload ==
               ReadPayload(spec, {Ids(a, Range(0, 6), salt), Ids(a, Range(0, 6), salt)});
      ok = ok && cache.Remove(a, 8, std::nullopt).ok();
      read = cache.Read(a, 0, std::nullopt);
      ok = ok && read.ok() &&
           read->payload ==
               ReadPayload(spec, {Ids(a, Range(0, 8), salt), Ids(a, Range(0, 8), salt)});
      absl::StatusOr<bool> resume = cache.CanResume(a, 8);
      ok = ok && resume.ok() && *resume;
      ok = ok && cache.Remove(a, 0, std::nullopt).ok() && cache.Remove(b, 0, std::nullopt).ok();
      ok = ok && cache.Read(a, 0, std::nullopt).status().code() == absl::StatusCode::kNotFound;
      if (!ok) {
        failures.fetch_add(1);
        return;
      }
    }
  };
  // Readers of the whole cache run alongside.
  auto observer = [&] {
    while (!done.load()) {
      const CacheUsage usage = cache.Usage();
      if (usage.sequences_live > 2 * kThreads || usage.groups[0].cells_used > 12 * kThreads) {
        failures.fetch_add(1);
      }
      for (const SequenceInfo& info : cache.ListSequences()) {
        if (info.offset > 12) failures.fetch_add(1);
      }
      (void)cache.Visible(0, {Query{0, 5, false}, Query{3, 20, true}});
    }
  };

  std::thread watch(observer);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  for (std::thread& th : threads) th.join();
  done.store(true);
  watch.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(cache.Usage().sequences_live, 0);
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 0);
  EXPECT_EQ(cache.Usage().groups[1].cells_used, 0);
}

TEST(CacheConcurrencyTest, RacingCreatesOfOneNameMakeOneCache) {
  std::unique_ptr<Device> device = testutil::MakeTestDevice(size_t{1} << 24);
  CacheRegistry registry(device.get());
  const CacheSpec spec = Spec(DType::kF32, 2, 16, 4, {Group(Full(), 1, 2, 4, 4)}, "shared");
  for (int round = 0; round < 50; ++round) {
    std::vector<absl::StatusOr<CacheRegistry::CreateResult>> results(kThreads);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] { results[t] = registry.Create(spec); });
    }
    for (std::thread& th : threads) th.join();
    int created = 0;
    for (const auto& r : results) {
      ASSERT_TRUE(r.ok()) << r.status();
      created += r->created;
      EXPECT_EQ(r->cache.get(), results[0]->cache.get());
    }
    EXPECT_EQ(created, 1);
    results.clear();
    ASSERT_TRUE(registry.Delete("shared").ok());
    EXPECT_EQ(device->used_bytes(), 0u);
  }
}

}  // namespace
}  // namespace kvmesh

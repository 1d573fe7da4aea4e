// CacheRegistry: idempotent create, ALREADY_EXISTS, NOT_FOUND, the device and metadata budgets;
// paged listings of caches, sequences and snapshots.
#include "cache/cache_registry.h"

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "cache/device/device.h"
#include "cache/shortage.h"
#include "gtest/gtest.h"
#include "tests/unit/cache_test_util.h"

namespace kvmesh {
namespace {

using testutil::AppendRange;
using testutil::Full;
using testutil::Group;
using testutil::Spec;

// 2 sequences * 16 tokens * 1 layer * 2 heads * (4 + 4) elements * 4 bytes = 2048 bytes.
CacheSpec SmallSpec(const std::string& name) {
  return Spec(DType::kF32, 2, 16, 4, {Group(Full(), 1, 2, 4, 4)}, name);
}
constexpr size_t kSmallBytes = 2048;

TEST(RegistryTest, CreateGetListDelete) {
  std::unique_ptr<Device> device = testutil::MakeTestDevice(1 << 20);
  CacheRegistry registry(device.get());
  EXPECT_EQ(registry.device(), device.get());
  absl::StatusOr<CacheRegistry::CreateResult> b = registry.Create(SmallSpec("b"));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(b->created);
  absl::StatusOr<CacheRegistry::CreateResult> a = registry.Create(SmallSpec("a"));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(device->used_bytes(), 2 * kSmallBytes);

  absl::StatusOr<std::shared_ptr<Cache>> got = registry.Get("b");
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->get(), b->cache.get());
  EXPECT_EQ((*got)->spec(), SmallSpec("b"));

  {
    const std::vector<std::shared_ptr<Cache>> list = registry.List();
    ASSERT_EQ(list.size(), 2u);
    EXPECT_EQ(list[0]->spec().name, "a");
    EXPECT_EQ(list[1]->spec().name, "b");
  }

  a->cache.reset();
  b->cache.reset();
  got->reset();
  ASSERT_TRUE(registry.Delete("a").ok());
  EXPECT_EQ(registry.Get("a").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.List().size(), 1u);
  EXPECT_EQ(device->used_bytes(), kSmallBytes);
}

TEST(RegistryTest, SameSpecAgainIsIdempotent) {
  std::unique_ptr<Device> device = testutil::MakeTestDevice(1 << 20);
  CacheRegistry registry(device.get());
  absl::StatusOr<CacheRegistry::CreateResult> first = registry.Create(SmallSpec("m"));
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE(AppendRange(*first->cache, 0, 0, 3).ok());
  absl::StatusOr<CacheRegistry::CreateResult> again = registry.Create(SmallSpec("m"));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE(again->created);
  EXPECT_EQ(again->cache.get(), first->cache.get());
  EXPECT_EQ(again->cache->Usage().sequences_live, 1);  // the data is still there
  EXPECT_EQ(device->used_bytes(), kSmallBytes);
}

TEST(RegistryTest, SameNameDifferentSpecIsAlreadyExists) {
  std::unique_ptr<Device> device = testutil::MakeTestDevice(1 << 20);
  CacheRegistry registry(device.get());
  ASSERT_TRUE(registry.Create(SmallSpec("m")).ok());
  CacheSpec other = SmallSpec("m");
  other.capacity = 32;
  absl::Status s = registry.Create(other).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_NE(s.message().find("capacity 16 vs 32"), std::string::npos) << s;
  other = SmallSpec("m");
  other.dtype = DType::kF16;
  s = registry.Create(other).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_NE(s.message().find("dtype F32 vs F16"), std::string::npos) << s;
  other = SmallSpec("m");
  other.groups[0].attention.head_dim_v = 8;
  s = registry.Create(other).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_NE(s.message().find("groups[0]"), std::string::npos) << s;
  EXPECT_EQ(device->used_bytes(), kSmallBytes);
  absl::StatusOr<std::shared_ptr<Cache>> got = registry.Get("m");
  ASSERT_TRUE(got.ok());
  EXPECT_EQ((*got)->spec(), SmallSpec("m"));
}

TEST(RegistryTest, RopeFieldsAreIgnoredWithoutRotation) {
  // With rope NONE, base/freq_scale/dims are meaningless (and unchecked): a repeated create
  // that differs only there is the same cache, even with a NaN base.
  std::unique_ptr<Device> device = testutil::MakeTestDevice(1 << 20);
  CacheRegistry registry(device.get());
  ASSERT_TRUE(registry.Create(SmallSpec("m")).ok());
  CacheSpec again = SmallSpec("m");
  again.groups[0].attention.rope.base = std::nanf("");
  again.groups[0].attention.rope.dims = 3;
  absl::StatusOr<CacheRegistry::CreateResult> r = registry.Create(again);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->created);
}

TEST(RegistryTest, UnknownNames) {
  std::unique_ptr<Device> device = testutil::MakeTestDevice(1 << 20);
  CacheRegistry registry(device.get());
  EXPECT_EQ(registry.Delete("nope").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.Get("nope").status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(registry.Create(SmallSpec("m")).ok());
  ASSERT_TRUE(registry.Delete("m").ok());
  EXPECT_EQ(registry.Delete("m").code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(registry.List().empty());
}

TEST(RegistryTest, InvalidSpec) {
  std::unique_ptr<Device> device = testutil::MakeTestDevice(1 << 20);
  CacheRegistry registry(device.get());
  CacheSpec bad = SmallSpec("m");
  bad.max_batch = 0;
  EXPECT_EQ(registry.Create(bad).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.Get("m").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(device->used_bytes(), 0u);
}

TEST(RegistryTest, MemoryBudgetAndBytesReturnedOnDelete) {
  std::unique_ptr<Device> device = testutil::MakeTestDevice(2 * kSmallBytes + 100);
  CacheRegistry registry(device.get());
  ASSERT_TRUE(registry.Create(SmallSpec("a")).ok());
  ASSERT_TRUE(registry.Create(SmallSpec("b")).ok());
  EXPECT_EQ(registry.Create(SmallSpec("c")).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(registry.Get("c").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(device->used_bytes(), 2 * kSmallBytes);
  ASSERT_TRUE(registry.Delete("a").ok());
  EXPECT_EQ(device->used_bytes(), kSmallBytes);
  EXPECT_TRUE(registry.Create(SmallSpec("c")).ok());
  EXPECT_EQ(device->used_bytes(), 2 * kSmallBytes);
}

// A holder of the cache keeps its memory until it lets go, even after Delete.
TEST(RegistryTest, DeleteWhileHeldFreesWhenReleased) {
  std::unique_ptr<Device> device = testutil::MakeTestDevice(1 << 20);
  CacheRegistry registry(device.get());
  absl::StatusOr<CacheRegistry::CreateResult> created = registry.Create(SmallSpec("m"));
  ASSERT_TRUE(created.ok());
  std::shared_ptr<Cache> held = created->cache;
  created->cache.reset();
  ASSERT_TRUE(registry.Delete("m").ok());
  EXPECT_EQ(registry.Get("m").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(device->used_bytes(), kSmallBytes);
  ASSERT_TRUE(AppendRange(*held, 0, 0, 2).ok());  // still usable by its holder
  held.reset();
  EXPECT_EQ(device->used_bytes(), 0u);
  // The name is free again.
  EXPECT_TRUE(registry.Create(SmallSpec("m")).ok());
}

std::vector<int64_t> Seqs(const std::vector<SequenceInfo>& infos) {
  std::vector<int64_t> out;
  for (const SequenceInfo& info : infos) out.push_back(info.seq);
  return out;
}

// Pages of ListSequences come in ascending order, each sequence once, also when every group
// holds the same sequences (a hybrid cache); the full listing agrees.
TEST(ListPagesTest, SequencesPageByPage) {
  std::unique_ptr<Device> device = testutil::MakeTestDevice(1 << 20);
  CacheRegistry registry(device.get());
  absl::StatusOr<CacheRegistry::CreateResult> created = registry.Create(
      Spec(DType::kF32, 8, 4, 4, {Group(Full(), 1, 1, 2, 2), testutil::RecurrentGroup()}, "h"));
  ASSERT_TRUE(created.ok()) << created.status();
  Cache& cache = *created->cache;
  for (int64_t seq : {9, 2, 7, 0, 5}) ASSERT_TRUE(AppendRange(cache, seq, 0, 1).ok());

  Cache::SequencePage page = cache.ListSequences(0, 2);
  EXPECT_EQ(Seqs(page.sequences), (std::vector<int64_t>{0, 2}));
  EXPECT_TRUE(page.more);
  page = cache.ListSequences(3, 2);
  EXPECT_EQ(Seqs(page.sequences), (std::vector<int64_t>{5, 7}));
  EXPECT_TRUE(page.more);
  page = cache.ListSequences(8, 2);
  EXPECT_EQ(Seqs(page.sequences), (std::vector<int64_t>{9}));
  EXPECT_FALSE(page.more);
  page = cache.ListSequences(0, 5);  // exactly all of them: nothing follows
  EXPECT_EQ(page.sequences.size(), 5u);
  EXPECT_FALSE(page.more);
  page = cache.ListSequences(10, 2);
  EXPECT_TRUE(page.sequences.empty());
  EXPECT_FALSE(page.more);
  page = cache.ListSequences(0, 0);  // taken as 1
  EXPECT_EQ(Seqs(page.sequences), (std::vector<int64_t>{0}));
  EXPECT_TRUE(page.more);
  EXPECT_EQ(Seqs(cache.ListSequences()), (std::vector<int64_t>{0, 2, 5, 7, 9}));

  // A removed sequence leaves the listing; one created behind the cursor is not seen.
  ASSERT_TRUE(cache.Remove(5, 0, std::nullopt).ok());
  page = cache.ListSequences(3, 2);
  EXPECT_EQ(Seqs(page.sequences), (std::vector<int64_t>{7, 9}));
  EXPECT_FALSE(page.more);
  // Each page's entries are the whole listing's.
  const std::vector<SequenceInfo> all = cache.ListSequences();
  EXPECT_EQ(cache.ListSequences(2, 1).sequences[0].offset, all[1].offset);
}

TEST(ListPagesTest, SnapshotsPageByPage) {
  std::unique_ptr<Device> device = testutil::MakeTestDevice(1 << 20);
  CacheRegistry registry(device.get());
  absl::StatusOr<CacheRegistry::CreateResult> created = registry.Create(SmallSpec("s"));
  ASSERT_TRUE(created.ok());
  Cache& cache = *created->cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 3).ok());
  std::vector<uint64_t> ids;
  for (int i = 0; i < 5; ++i) {
    absl::StatusOr<SnapshotInfo> snap = cache.Snapshot(0, i % 3);
    ASSERT_TRUE(snap.ok()) << snap.status();
    ids.push_back(snap->id);
  }
  ASSERT_TRUE(cache.DropSnapshot(ids[1]).ok());
  std::vector<uint64_t> listed;
  uint64_t first = 1;
  int pages = 0;
  for (;; ++pages) {
    const Cache::SnapshotPage page = cache.ListSnapshots(first, 2);
    for (const SnapshotInfo& info : page.snapshots) listed.push_back(info.id);
    if (!page.more) break;
    first = page.snapshots.back().id + 1;
  }
  EXPECT_EQ(listed, (std::vector<uint64_t>{ids[0], ids[2], ids[3], ids[4]}));
  EXPECT_EQ(pages, 1);  // two pages: the second is the last
}

TEST(ListPagesTest, CachesPageByPageAndByTenant) {
  std::unique_ptr<Device> device = testutil::MakeTestDevice(1 << 20);
  CacheRegistry registry(device.get());
  for (const char* name : {"d", "b", "a", "c"}) {
    ASSERT_TRUE(registry.Create("t1", SmallSpec(name), TenantQuota()).ok());
  }
  ASSERT_TRUE(registry.Create("t0", SmallSpec("z"), TenantQuota()).ok());
  ASSERT_TRUE(registry.Create("t2", SmallSpec("a"), TenantQuota()).ok());
  auto names = [](const CacheRegistry::Page& page) {
    std::vector<std::string> out;
    for (const CacheRegistry::Entry& e : page.entries) {
      out.push_back(e.tenant + "/" + e.cache->spec().name);
    }
    return out;
  };
  CacheRegistry::Page page = registry.ListPage("t1", "", 3);
  EXPECT_EQ(names(page), (std::vector<std::string>{"t1/a", "t1/b", "t1/c"}));
  EXPECT_TRUE(page.more);
  page = registry.ListPage("t1", "c", 3);
  EXPECT_EQ(names(page), (std::vector<std::string>{"t1/d"}));
  EXPECT_FALSE(page.more);  // t2's caches are not t1's
  page = registry.ListAllPage("", "", 2);
  EXPECT_EQ(names(page), (std::vector<std::string>{"t0/z", "t1/a"}));
  EXPECT_TRUE(page.more);
  page = registry.ListAllPage("t1", "d", 2);
  EXPECT_EQ(names(page), (std::vector<std::string>{"t2/a"}));
  EXPECT_FALSE(page.more);
}

// The host memory of caches' bookkeeping is bounded at creation: a cache of 2^20 sequences
// charges what 2^20 live sequences take, and one that would take the node past the metadata
// budget is refused before anything is allocated, naming its max_sequences and the budget.
TEST(MetadataBudgetTest, CreateBeyondTheBudgetIsRefused) {
  std::unique_ptr<Device> device = testutil::MakeTestDevice(size_t{64} << 20);
  CacheRegistry registry(device.get());
  EXPECT_EQ(registry.metadata_budget(), kDefaultMetadataBudget);
  // 2^20 one-position sequences, 4 bytes a cell: a 4 MiB arena, 436 MiB of bookkeeping.
  const CacheSpec big = Spec(DType::kF16, 1 << 20, 1, 16, {Group(Full(), 1, 1, 1, 1)}, "big");
  const uint64_t charge = CacheMetadataBytes(big);
  EXPECT_EQ(charge, (uint64_t{1} << 20) * (kSequenceMetadataBytes + kGroupSequenceMetadataBytes +
                                           kCellMetadataBytes));
  ASSERT_GT(charge, kDefaultMetadataBudget / 2);
  ASSERT_LE(charge, kDefaultMetadataBudget);
  ASSERT_TRUE(registry.Create(big).ok());
  EXPECT_EQ(registry.MetadataBytes(), charge);

  CacheSpec second = big;
  second.name = "big2";
  const absl::Status refused = registry.Create(second).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_TRUE(testutil::ContainsToken(std::string(refused.message()), "max_sequences = 1048576"))
      << refused;
  EXPECT_TRUE(testutil::ContainsToken(std::string(refused.message()),
                                      std::to_string(kDefaultMetadataBudget)))
      << refused;
  const std::optional<Shortage> shortage = GetShortage(refused);
  ASSERT_TRUE(shortage.has_value());
  EXPECT_EQ(shortage->resource, Resource::kMetadataBytes);
  EXPECT_EQ(shortage->needed, static_cast<int64_t>(charge));
  EXPECT_EQ(shortage->total, static_cast<int64_t>(kDefaultMetadataBudget));
  EXPECT_EQ(registry.Get("big2").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(device->used_bytes(), CacheBytes(big));  // nothing of the second was allocated

  // An idempotent repeat is not charged again; a delete gives the charge back.
  ASSERT_TRUE(registry.Create(big).ok());
  EXPECT_EQ(registry.MetadataBytes(), charge);
  ASSERT_TRUE(registry.Delete("big").ok());
  EXPECT_EQ(registry.MetadataBytes(), 0u);
  EXPECT_TRUE(registry.Create(second).ok());

  // A smaller budget refuses what it cannot hold.
  CacheRegistry small(device.get());
  small.SetMetadataBudget(uint64_t{1} << 20);
  EXPECT_EQ(small.Create(SmallSpec("fits")).status().code(), absl::StatusCode::kOk);
  EXPECT_EQ(small.Create(Spec(DType::kF32, 4096, 16, 4, {Group(Full(), 1, 2, 4, 4)}, "no"))
                .status()
                .code(),
            absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace kvmesh

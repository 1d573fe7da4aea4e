// CacheRegistry: idempotent create, ALREADY_EXISTS, NOT_FOUND, the device budget.
#include "cache/cache_registry.h"

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "cache/device/device.h"
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

}  // namespace
}  // namespace kvmesh

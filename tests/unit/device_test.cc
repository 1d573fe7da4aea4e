// Device: budget accounting, arena ownership and the row operations, on the device under test
// (tests/testing/test_device.h: HostDevice, or CudaDevice with KVMESH_TEST_DEVICE=cuda). Arena
// memory may be a GPU address, so the tests reach it only through Scatter and Gather (WriteArena,
// ArenaBytes), never through DeviceArena::data().
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "cache/device/device.h"
#include "cache/device/host_device.h"
#include "gtest/gtest.h"
#include "tests/testing/test_device.h"

namespace kvmesh {
namespace {

using testutil::ArenaBytes;
using testutil::MakeTestDevice;
using testutil::WriteArena;

// The name MakeTestDevice's device must report.
std::string ExpectedName() {
  absl::StatusOr<testutil::TestDeviceSelection> selection = testutil::SelectedTestDevice();
  return selection.ok() ? selection->name() : "invalid KVMESH_TEST_DEVICE";
}

TEST(DeviceTest, AccountsAllocationsAgainstTheBudget) {
  std::unique_ptr<Device> device = MakeTestDevice(1000);
  EXPECT_EQ(device->name(), ExpectedName());
  EXPECT_EQ(device->budget_bytes(), 1000u);
  EXPECT_EQ(device->used_bytes(), 0u);
  absl::StatusOr<DeviceArena> a = device->Allocate(600);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->size(), 600u);
  EXPECT_NE(a->data(), nullptr);
  EXPECT_EQ(device->used_bytes(), 600u);
  absl::StatusOr<DeviceArena> b = device->Allocate(401);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted) << b.status();
  EXPECT_EQ(device->used_bytes(), 600u);
  absl::StatusOr<DeviceArena> c = device->Allocate(400);  // exactly the rest
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(device->used_bytes(), 1000u);
  *c = DeviceArena();  // freeing returns the bytes
  EXPECT_EQ(device->used_bytes(), 600u);
}

TEST(DeviceTest, MovedArenaFreesOnce) {
  std::unique_ptr<Device> device = MakeTestDevice(1000);
  {
    absl::StatusOr<DeviceArena> a = device->Allocate(300);
    ASSERT_TRUE(a.ok());
    uint8_t* data = a->data();  // compared, never dereferenced
    DeviceArena moved(std::move(*a));
    EXPECT_EQ(moved.data(), data);
    EXPECT_EQ(moved.size(), 300u);
    EXPECT_EQ(device->used_bytes(), 300u);
    DeviceArena assigned;
    assigned = std::move(moved);
    EXPECT_EQ(assigned.data(), data);
    EXPECT_EQ(device->used_bytes(), 300u);
  }
  EXPECT_EQ(device->used_bytes(), 0u);
}

TEST(DeviceTest, ArenasBoundToAStreamKeepItAndWork) {
  std::unique_ptr<Device> device = MakeTestDevice(1 << 20);
  absl::StatusOr<std::shared_ptr<DeviceStream>> stream = device->CreateStream();
  ASSERT_TRUE(stream.ok()) << stream.status();
  ASSERT_NE(*stream, nullptr);
  absl::StatusOr<DeviceArena> bound = device->Allocate(64, MemoryPool::kCache, *stream);
  absl::StatusOr<DeviceArena> unbound = device->Allocate(64);
  ASSERT_TRUE(bound.ok() && unbound.ok());
  EXPECT_EQ(bound->stream(), *stream);
  EXPECT_EQ(unbound->stream(), nullptr);
  // The arena holds a reference: the stream outlives the caller's handle.
  std::weak_ptr<DeviceStream> weak = *stream;
  stream->reset();
  EXPECT_FALSE(weak.expired());
  std::vector<uint8_t> bytes(64);
  std::iota(bytes.begin(), bytes.end(), uint8_t{3});
  ASSERT_TRUE(WriteArena(*device, *bound, bytes));
  // Across the two streams: bound row 2 (bytes 16..32 in rows of 16) into unbound row 0.
  std::vector<uint8_t> zeros(64, 0);
  ASSERT_TRUE(WriteArena(*device, *unbound, zeros));
  const std::vector<Plane> planes = {Plane{0, 16}};
  const std::vector<int32_t> row2 = {2};
  const std::vector<int32_t> row0 = {0};
  ASSERT_TRUE(device->CopyRowsBetween(*bound, planes, row2, *unbound, planes, row0).ok());
  std::vector<uint8_t> expected = zeros;
  std::memcpy(expected.data(), bytes.data() + 32, 16);
  EXPECT_EQ(ArenaBytes(*device, *unbound), expected);
  EXPECT_EQ(ArenaBytes(*device, *bound), bytes);
}

// Two planes of 8 rows of 6 bytes, the second starting at byte 100.
std::vector<Plane> TwoPlanes() { return {Plane{0, 6}, Plane{100, 6}}; }

TEST(DeviceTest, ScatterGatherRoundTripInPlaneThenRowOrder) {
  std::unique_ptr<Device> device = MakeTestDevice(1 << 20);
  absl::StatusOr<DeviceArena> arena = device->Allocate(200);
  ASSERT_TRUE(arena.ok());
  ASSERT_TRUE(WriteArena(*device, *arena, std::vector<uint8_t>(200, 0xEE)));
  const std::vector<Plane> planes = TwoPlanes();
  const std::vector<int32_t> rows = {5, 0, 3};
  std::vector<uint8_t> src(2 * 3 * 6);
  std::iota(src.begin(), src.end(), uint8_t{1});
  ASSERT_TRUE(device->Scatter(*arena, planes, rows, src.data()).ok());
  // Plane 0 row 5 holds src[0..6), row 0 src[6..12), row 3 src[12..18); plane 1 the rest.
  const std::vector<uint8_t> data = ArenaBytes(*device, *arena);
  ASSERT_EQ(data.size(), 200u);
  EXPECT_EQ(std::memcmp(data.data() + 5 * 6, src.data(), 6), 0);
  EXPECT_EQ(std::memcmp(data.data() + 0 * 6, src.data() + 6, 6), 0);
  EXPECT_EQ(std::memcmp(data.data() + 3 * 6, src.data() + 12, 6), 0);
  EXPECT_EQ(std::memcmp(data.data() + 100 + 5 * 6, src.data() + 18, 6), 0);
  EXPECT_EQ(std::memcmp(data.data() + 100 + 0 * 6, src.data() + 24, 6), 0);
  EXPECT_EQ(std::memcmp(data.data() + 100 + 3 * 6, src.data() + 30, 6), 0);
  EXPECT_EQ(data[1 * 6], 0xEE);  // untouched rows stay
  EXPECT_EQ(data[100 + 7 * 6 + 5], 0xEE);

  std::vector<uint8_t> dst(src.size());
  ASSERT_TRUE(device->Gather(*arena, planes, rows, dst.data()).ok());
  EXPECT_EQ(dst, src);
  // Gathering in another order permutes rows within each plane.
  const std::vector<int32_t> reversed = {3, 0, 5};
  ASSERT_TRUE(device->Gather(*arena, planes, reversed, dst.data()).ok());
  EXPECT_EQ(std::memcmp(dst.data(), src.data() + 12, 6), 0);
  EXPECT_EQ(std::memcmp(dst.data() + 12, src.data(), 6), 0);
  EXPECT_EQ(std::memcmp(dst.data() + 18, src.data() + 30, 6), 0);
}

TEST(DeviceTest, ScatterSkipsRowsMarkedMinusOne) {
  std::unique_ptr<Device> device = MakeTestDevice(1 << 20);
  absl::StatusOr<DeviceArena> arena = device->Allocate(200);
  ASSERT_TRUE(arena.ok());
  ASSERT_TRUE(WriteArena(*device, *arena, std::vector<uint8_t>(200, 0xEE)));
  const std::vector<Plane> planes = TwoPlanes();
  // The second source row of each plane is consumed but written nowhere.
  const std::vector<int32_t> rows = {2, -1, 6};
  std::vector<uint8_t> src(2 * 3 * 6);
  std::iota(src.begin(), src.end(), uint8_t{1});
  ASSERT_TRUE(device->Scatter(*arena, planes, rows, src.data()).ok());
  std::vector<uint8_t> expected(200, 0xEE);
  for (size_t p = 0; p < 2; ++p) {
    std::memcpy(expected.data() + planes[p].offset + 2 * 6, src.data() + p * 18, 6);
    std::memcpy(expected.data() + planes[p].offset + 6 * 6, src.data() + p * 18 + 12, 6);
  }
  EXPECT_EQ(ArenaBytes(*device, *arena), expected);
}

TEST(DeviceTest, CopyRowsCopiesEveryPlane) {
  std::unique_ptr<Device> device = MakeTestDevice(1 << 20);
  absl::StatusOr<DeviceArena> arena = device->Allocate(200);
  ASSERT_TRUE(arena.ok());
  std::vector<uint8_t> before(200);
  for (int i = 0; i < 200; ++i) before[i] = static_cast<uint8_t>(i);
  ASSERT_TRUE(WriteArena(*device, *arena, before));
  const std::vector<Plane> planes = TwoPlanes();
  const std::vector<int32_t> src_rows = {1, 2};
  const std::vector<int32_t> dst_rows = {6, 0};
  ASSERT_TRUE(device->CopyRows(*arena, planes, src_rows, dst_rows).ok());
  std::vector<uint8_t> expected = before;
  for (size_t p = 0; p < 2; ++p) {
    const size_t base = p == 0 ? 0 : 100;
    std::memcpy(expected.data() + base + 6 * 6, before.data() + base + 1 * 6, 6);
    std::memcpy(expected.data() + base + 0 * 6, before.data() + base + 2 * 6, 6);
  }
  EXPECT_EQ(ArenaBytes(*device, *arena), expected);
}

TEST(DeviceTest, EmptyRowListsAreNoOps) {
  std::unique_ptr<Device> device = MakeTestDevice(1 << 20);
  absl::StatusOr<DeviceArena> arena = device->Allocate(200);
  ASSERT_TRUE(arena.ok());
  ASSERT_TRUE(WriteArena(*device, *arena, std::vector<uint8_t>(200, 0x5A)));
  const std::vector<Plane> planes = TwoPlanes();
  EXPECT_TRUE(device->Scatter(*arena, planes, {}, nullptr).ok());
  EXPECT_TRUE(device->Gather(*arena, planes, {}, nullptr).ok());
  EXPECT_TRUE(device->CopyRows(*arena, planes, {}, {}).ok());
  RopeShiftParams params;
  params.rope.type = RopeType::kNormal;
  params.rope.dims = 2;
  params.dtype = DType::kF16;
  params.num_heads = 1;
  params.head_dim = 3;
  params.delta = 5;
  EXPECT_TRUE(device->RopeShift(*arena, planes, {}, params).ok());
  const std::vector<uint8_t> data = ArenaBytes(*device, *arena);
  ASSERT_EQ(data.size(), 200u);
  for (int i = 0; i < 200; ++i) ASSERT_EQ(data[i], 0x5A) << i;
}

TEST(DeviceTest, SnapshotPoolHasItsOwnBudget) {
  std::unique_ptr<Device> device = MakeTestDevice(1000, 300);
  EXPECT_EQ(device->budget_bytes(), 1000u);
  EXPECT_EQ(device->budget_bytes(MemoryPool::kCache), 1000u);
  EXPECT_EQ(device->budget_bytes(MemoryPool::kSnapshot), 300u);
  absl::StatusOr<DeviceArena> cache_arena = device->Allocate(900);
  ASSERT_TRUE(cache_arena.ok()) << cache_arena.status();
  // A full cache pool does not limit the snapshot pool, and the other way round.
  absl::StatusOr<DeviceArena> snap = device->Allocate(300, MemoryPool::kSnapshot);
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(device->used_bytes(MemoryPool::kCache), 900u);
  EXPECT_EQ(device->used_bytes(MemoryPool::kSnapshot), 300u);
  EXPECT_EQ(device->free_bytes(MemoryPool::kCache), 100u);
  EXPECT_EQ(device->free_bytes(MemoryPool::kSnapshot), 0u);
  absl::StatusOr<DeviceArena> more = device->Allocate(1, MemoryPool::kSnapshot);
  EXPECT_EQ(more.status().code(), absl::StatusCode::kResourceExhausted) << more.status();
  EXPECT_NE(more.status().message().find("snapshot budget (300 of 300 bytes in use)"),
            std::string::npos)
      << more.status();
  absl::StatusOr<DeviceArena> rest = device->Allocate(100);
  ASSERT_TRUE(rest.ok()) << rest.status();
  absl::StatusOr<DeviceArena> over = device->Allocate(1);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted) << over.status();
  EXPECT_NE(over.status().message().find("memory budget (1000 of 1000 bytes in use)"),
            std::string::npos)
      << over.status();
  EXPECT_EQ(device->used_bytes(MemoryPool::kSnapshot), 300u);
  // Freeing returns bytes to the pool they came from, also through moves.
  DeviceArena moved;
  moved = std::move(*snap);
  EXPECT_EQ(device->used_bytes(MemoryPool::kSnapshot), 300u);
  moved = DeviceArena();
  EXPECT_EQ(device->used_bytes(MemoryPool::kSnapshot), 0u);
  EXPECT_EQ(device->used_bytes(MemoryPool::kCache), 1000u);
  *cache_arena = DeviceArena();
  EXPECT_EQ(device->used_bytes(MemoryPool::kCache), 100u);
  EXPECT_EQ(device->used_bytes(MemoryPool::kSnapshot), 0u);
}

TEST(DeviceTest, ZeroSnapshotBudgetRefusesEverySnapshotArena) {
  std::unique_ptr<Device> none = MakeTestDevice(500, 0);
  EXPECT_EQ(none->budget_bytes(MemoryPool::kSnapshot), 0u);
  absl::StatusOr<DeviceArena> a = none->Allocate(1, MemoryPool::kSnapshot);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kResourceExhausted) << a.status();
  EXPECT_EQ(none->used_bytes(MemoryPool::kSnapshot), 0u);
}

// HostDevice-only: its one-budget constructor. Runs in the host variant only (the _cuda variant
// would test the same HostDevice again).
TEST(HostDeviceTest, SnapshotBudgetDefaultsToTheCacheBudget) {
  if (testutil::TestOnCuda()) GTEST_SKIP() << "HostDevice constructor; covered by the host run";
  HostDevice device(500);
  EXPECT_EQ(device.budget_bytes(MemoryPool::kSnapshot), 500u);
  EXPECT_EQ(device.name(), "host");
}

// Pages of [data, data + bytes) resident in memory (mincore).
size_t ResidentPages(const uint8_t* data, size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> resident((bytes + page - 1) / page);
  if (mincore(const_cast<uint8_t*>(data), bytes, resident.data()) != 0) return 0;
  size_t n = 0;
  for (unsigned char r : resident) n += r & 1;
  return n;
}

TEST(HostDeviceTest, PrefaultMakesNewArenasResidentAtAllocation) {
  if (testutil::TestOnCuda()) GTEST_SKIP() << "HostDevice only";
  if (!HostDevice::KeepsArenas()) GTEST_SKIP() << "sanitizer build: arenas come from malloc";
  constexpr size_t kMiB = size_t{1} << 20;
  const size_t pages = 8 * kMiB / static_cast<size_t>(sysconf(_SC_PAGESIZE));
  HostDevice lazy(64 * kMiB, 64 * kMiB, /*kept_limit=*/0, /*prefault=*/false);
  HostDevice eager(64 * kMiB, 64 * kMiB, /*kept_limit=*/0, /*prefault=*/true);
  absl::StatusOr<DeviceArena> untouched = lazy.Allocate(8 * kMiB);
  ASSERT_TRUE(untouched.ok());
  EXPECT_EQ(ResidentPages(untouched->data(), untouched->size()), 0u);
  for (MemoryPool pool : {MemoryPool::kCache, MemoryPool::kSnapshot}) {
    absl::StatusOr<DeviceArena> faulted = eager.Allocate(8 * kMiB, pool);
    ASSERT_TRUE(faulted.ok());
    EXPECT_EQ(ResidentPages(faulted->data(), faulted->size()), pages);
    // Still zero-filled, as fresh memory is.
    const uint8_t* data = faulted->data();
    EXPECT_TRUE(std::all_of(data, data + faulted->size(), [](uint8_t b) { return b == 0; }));
  }
}

TEST(HostDeviceTest, FreedLargeArenasAreKeptAndReusedBySize) {
  if (testutil::TestOnCuda()) GTEST_SKIP() << "HostDevice only";
  if (!HostDevice::KeepsArenas()) GTEST_SKIP() << "sanitizer build: arenas come from malloc";
  constexpr size_t kMiB = size_t{1} << 20;
  HostDevice device(64 * kMiB, 64 * kMiB);
  uint8_t* first = nullptr;
  {
    absl::StatusOr<DeviceArena> arena = device.Allocate(3 * kMiB);  // mapped as 4 MiB
    ASSERT_TRUE(arena.ok()) << arena.status();
    first = arena->data();
    std::memset(first, 0x5a, arena->size());
    EXPECT_EQ(device.kept_bytes(), 0u);
  }
  EXPECT_EQ(device.kept_bytes(), 4 * kMiB);
  EXPECT_EQ(device.used_bytes(), 0u);  // kept arenas are in no budget
  {
    // Another mapped length does not take it.
    absl::StatusOr<DeviceArena> other = device.Allocate(6 * kMiB, MemoryPool::kSnapshot);
    ASSERT_TRUE(other.ok()) << other.status();
    EXPECT_NE(other->data(), first);
    EXPECT_EQ(device.kept_bytes(), 4 * kMiB);
  }
  EXPECT_EQ(device.kept_bytes(), 10 * kMiB);
  // The same mapped length, from either pool, does (its contents are unspecified: kept arenas
  // are MADV_FREE, so the kernel may have zeroed pages), and it is writable.
  absl::StatusOr<DeviceArena> again = device.Allocate(4 * kMiB, MemoryPool::kSnapshot);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->data(), first);
  std::memset(again->data(), 0x33, 4 * kMiB);
  EXPECT_EQ(again->data()[4 * kMiB - 1], 0x33);
  EXPECT_EQ(device.kept_bytes(), 6 * kMiB);
  EXPECT_EQ(device.used_bytes(MemoryPool::kSnapshot), 4 * kMiB);
}

// The local data path's memory: another process maps a shareable arena through its memfd and
// sees (and makes) the same bytes; a freed arena is never given out again, and its pages go at
// once even while another mapping holds them.
TEST(HostDeviceTest, ShareableArenasAreMemfdsThatAreNeverReused) {
  if (testutil::TestOnCuda()) GTEST_SKIP() << "HostDevice only";
  constexpr size_t kMiB = size_t{1} << 20;
  HostDevice device(64 * kMiB, 64 * kMiB, HostDevice::kDefaultKeptLimit, /*prefault=*/false,
                    /*shareable=*/true);
  EXPECT_TRUE(device.shareable());
  EXPECT_EQ(device.kept_limit_bytes(), 0u);
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  uint8_t* view = nullptr;
  size_t view_bytes = 0;
  ino_t first_inode = 0;
  {
    absl::StatusOr<DeviceArena> arena =
        device.Allocate(3 * kMiB + 5, MemoryPool::kCache, nullptr, /*shareable=*/true);
    ASSERT_TRUE(arena.ok()) << arena.status();
    absl::StatusOr<SharedArena> shared = device.Share(*arena);
    ASSERT_TRUE(shared.ok()) << shared.status();
    EXPECT_EQ(shared->size, (3 * kMiB + 5 + page - 1) / page * page);
    // A borrowed view of the arena shares the same memory.
    absl::StatusOr<SharedArena> borrowed = device.Share(DeviceArena::Borrow(*arena));
    ASSERT_TRUE(borrowed.ok()) << borrowed.status();
    EXPECT_EQ(borrowed->fd, shared->fd);
    struct stat st;
    ASSERT_EQ(fstat(shared->fd, &st), 0);
    first_inode = st.st_ino;
    // What a worker does: map the descriptor (here a copy of it, as SCM_RIGHTS would give).
    const int copy = dup(shared->fd);
    ASSERT_GE(copy, 0);
    void* mapped = mmap(nullptr, shared->size, PROT_READ | PROT_WRITE, MAP_SHARED, copy, 0);
    close(copy);
    ASSERT_NE(mapped, MAP_FAILED);
    view = static_cast<uint8_t*>(mapped);
    view_bytes = shared->size;
    // Rows scattered by the device are in the mapping, and rows written there are gathered.
    const Plane plane{0, 64};
    std::vector<uint8_t> row(64, 0xab);
    ASSERT_TRUE(device.Scatter(*arena, {&plane, 1}, std::vector<int32_t>{7}, row.data()).ok());
    EXPECT_EQ(view[7 * 64], 0xab);
    EXPECT_EQ(view[8 * 64 - 1], 0xab);
    std::memset(view + 2 * 64, 0x17, 64);
    std::vector<uint8_t> out(64);
    ASSERT_TRUE(device.Gather(*arena, {&plane, 1}, std::vector<int32_t>{2}, out.data()).ok());
    EXPECT_EQ(out, std::vector<uint8_t>(64, 0x17));
  }
  EXPECT_EQ(device.used_bytes(), 0u);
  EXPECT_EQ(device.kept_bytes(), 0u);
  // Freed: the worker's mapping still exists, but its pages were released and read as zeros.
  EXPECT_EQ(view[7 * 64], 0);
  EXPECT_EQ(view[2 * 64], 0);
  // A new arena of the same size is another memfd, never the freed one.
  absl::StatusOr<DeviceArena> again =
      device.Allocate(3 * kMiB + 5, MemoryPool::kCache, nullptr, /*shareable=*/true);
  ASSERT_TRUE(again.ok()) << again.status();
  absl::StatusOr<SharedArena> shared = device.Share(*again);
  ASSERT_TRUE(shared.ok()) << shared.status();
  struct stat st;
  ASSERT_EQ(fstat(shared->fd, &st), 0);
  EXPECT_NE(st.st_ino, first_inode);
  again->data()[0] = 0x42;
  EXPECT_EQ(view[0], 0);
  munmap(view, view_bytes);
  // Only arenas allocated shareable (a group's cells, what a worker maps) are shared: not a
  // snapshot chunk, nor a speculative chunk of the cache pool.
  for (const MemoryPool pool : {MemoryPool::kSnapshot, MemoryPool::kCache}) {
    absl::StatusOr<DeviceArena> chunk = device.Allocate(kMiB, pool);
    ASSERT_TRUE(chunk.ok()) << chunk.status();
    EXPECT_EQ(device.Share(*chunk).status().code(), absl::StatusCode::kFailedPrecondition);
  }
}

TEST(HostDeviceTest, ArenasOfADeviceThatDoesNotShareAreNotShared) {
  if (testutil::TestOnCuda()) GTEST_SKIP() << "HostDevice only";
  HostDevice device(1 << 20);
  absl::StatusOr<DeviceArena> arena = device.Allocate(4096);
  ASSERT_TRUE(arena.ok()) << arena.status();
  const absl::StatusOr<SharedArena> shared = device.Share(*arena);
  EXPECT_EQ(shared.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(shared.status().message(),
            "device host does not share its memory with other processes");
}

TEST(HostDeviceTest, KeptArenasStayUnderTheLimitOldestUnmappedFirst) {
  if (testutil::TestOnCuda()) GTEST_SKIP() << "HostDevice only";
  if (!HostDevice::KeepsArenas()) GTEST_SKIP() << "sanitizer build: arenas come from malloc";
  constexpr size_t kMiB = size_t{1} << 20;
  HostDevice device(64 * kMiB, 64 * kMiB, /*kept_limit=*/8 * kMiB);
  std::vector<DeviceArena> arenas;
  std::vector<uint8_t*> addresses;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<DeviceArena> arena = device.Allocate(4 * kMiB);
    ASSERT_TRUE(arena.ok()) << arena.status();
    addresses.push_back(arena->data());
    arenas.push_back(*std::move(arena));
  }
  arenas.clear();  // freed in order 0, 1, 2: 0 is unmapped when 2 comes
  EXPECT_EQ(device.kept_bytes(), 8 * kMiB);
  absl::StatusOr<DeviceArena> a = device.Allocate(4 * kMiB);
  absl::StatusOr<DeviceArena> b = device.Allocate(4 * kMiB);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->data(), addresses[2]);  // the most recently freed first
  EXPECT_EQ(b->data(), addresses[1]);
  EXPECT_EQ(device.kept_bytes(), 0u);

  // An arena larger than the limit is never kept; the limit is also capped by the budgets.
  HostDevice small(4 * kMiB, 4 * kMiB, /*kept_limit=*/size_t{1} << 40);
  { ASSERT_TRUE(small.Allocate(4 * kMiB).ok()); }
  EXPECT_EQ(small.kept_bytes(), 4 * kMiB);
  { ASSERT_TRUE(small.Allocate(4 * kMiB, MemoryPool::kSnapshot).ok()); }
  EXPECT_EQ(small.kept_bytes(), 4 * kMiB);
  HostDevice none(64 * kMiB, 64 * kMiB, /*kept_limit=*/0);
  { ASSERT_TRUE(none.Allocate(4 * kMiB).ok()); }
  EXPECT_EQ(none.kept_bytes(), 0u);
}

TEST(DeviceTest, CopyRowsBetweenArenasOfBothPools) {
  std::unique_ptr<Device> device = MakeTestDevice(1 << 20, 1 << 20);
  absl::StatusOr<DeviceArena> src = device->Allocate(200);
  absl::StatusOr<DeviceArena> dst = device->Allocate(64, MemoryPool::kSnapshot);
  ASSERT_TRUE(src.ok() && dst.ok());
  std::vector<uint8_t> src_bytes(200);
  for (int i = 0; i < 200; ++i) src_bytes[i] = static_cast<uint8_t>(i);
  ASSERT_TRUE(WriteArena(*device, *src, src_bytes));
  ASSERT_TRUE(WriteArena(*device, *dst, std::vector<uint8_t>(64, 0xEE)));
  // Source planes at 0 and 100 (rows of 6); destination planes packed at 0 and 30.
  const std::vector<Plane> src_planes = TwoPlanes();
  const std::vector<Plane> dst_planes = {Plane{0, 6}, Plane{30, 6}};
  const std::vector<int32_t> src_rows = {7, 2, 4};
  const std::vector<int32_t> dst_rows = {0, 1, 3};
  ASSERT_TRUE(device->CopyRowsBetween(*src, src_planes, src_rows, *dst, dst_planes, dst_rows).ok());
  std::vector<uint8_t> expected(64, 0xEE);
  for (size_t p = 0; p < 2; ++p) {
    for (size_t i = 0; i < 3; ++i) {
      std::memcpy(expected.data() + dst_planes[p].offset + dst_rows[i] * 6,
                  src_bytes.data() + src_planes[p].offset + src_rows[i] * 6, 6);
    }
  }
  const std::vector<uint8_t> dst_bytes = ArenaBytes(*device, *dst);
  ASSERT_EQ(dst_bytes, expected);
  // And back into other rows of the source arena (restore): row r of the copy to source row.
  const std::vector<uint8_t>& before = src_bytes;
  const std::vector<int32_t> back_src = {3, 0};
  const std::vector<int32_t> back_dst = {1, 5};
  ASSERT_TRUE(device->CopyRowsBetween(*dst, dst_planes, back_src, *src, src_planes, back_dst).ok());
  std::vector<uint8_t> after = before;
  for (size_t p = 0; p < 2; ++p) {
    for (size_t i = 0; i < 2; ++i) {
      std::memcpy(after.data() + src_planes[p].offset + back_dst[i] * 6,
                  dst_bytes.data() + dst_planes[p].offset + back_src[i] * 6, 6);
    }
  }
  const std::vector<uint8_t> now = ArenaBytes(*device, *src);
  ASSERT_EQ(now.size(), 200u);
  EXPECT_EQ(now, after);
  // Source row 4 went to copy row 3 and came back into row 1.
  EXPECT_EQ(std::memcmp(now.data() + 1 * 6, before.data() + 4 * 6, 6), 0);
  EXPECT_EQ(std::memcmp(now.data() + 100 + 5 * 6, before.data() + 100 + 7 * 6, 6), 0);
}

TEST(DeviceTest, CopyRowsBetweenWithinOneArenaAndEmptyLists) {
  std::unique_ptr<Device> device = MakeTestDevice(1 << 20);
  absl::StatusOr<DeviceArena> arena = device->Allocate(200);
  ASSERT_TRUE(arena.ok());
  std::vector<uint8_t> before(200);
  for (int i = 0; i < 200; ++i) before[i] = static_cast<uint8_t>(i * 7);
  ASSERT_TRUE(WriteArena(*device, *arena, before));
  // Plane 0 rows into plane 1 rows of the same arena (distinct bytes).
  const std::vector<Plane> from = {Plane{0, 6}};
  const std::vector<Plane> to = {Plane{100, 6}};
  const std::vector<int32_t> row2 = {2};
  const std::vector<int32_t> row0 = {0};
  ASSERT_TRUE(device->CopyRowsBetween(*arena, from, row2, *arena, to, row0).ok());
  std::vector<uint8_t> expected = before;
  std::memcpy(expected.data() + 100, before.data() + 12, 6);
  EXPECT_EQ(ArenaBytes(*device, *arena), expected);
  ASSERT_TRUE(device->CopyRowsBetween(*arena, from, {}, *arena, to, {}).ok());
  EXPECT_EQ(ArenaBytes(*device, *arena), expected);
}

}  // namespace
}  // namespace kvmesh

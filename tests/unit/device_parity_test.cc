// HostDevice against CudaDevice, byte for byte. Needs a GPU: every test skips without one.
//
// DeviceOpsParityTest runs one seeded random sequence of Device operations on a HostDevice and on
// a CudaDevice: Scatter (with -1 rows that consume their source row and write nothing), Gather
// (rows may repeat), CopyRows, CopyRowsBetween between a cache-pool and a snapshot-pool arena
// (both ways and within one arena), and RopeShift (rows may repeat) NORMAL and NEOX on F32, F16
// and BF16 rows of
// many shapes (dims < head_dim, odd head counts, rows of a few MiB). Layouts are irregular on
// purpose: odd row sizes, plane offsets that are not 16-byte aligned (element-aligned for RoPE,
// which addresses whole elements; any byte for the copies), planes in shuffled order, gaps.
// After every step the full contents of both arenas, read back by Gather, and the output of
// every Gather must be identical on the two devices. It runs with the default staging buffers
// and with tiny ones, so that payloads cross the bus in many pieces and rows larger than a
// staging half take the huge-row path.
//
// RoPE is held to exact equality for every dtype. The CUDA kernel computes from the same float32
// cos/sin tables as HostDevice (angles in double, rounded once), rounds each multiply and add
// separately (no FMA contraction; the host build has none either) and narrows with round to
// nearest even, so bit-exact results are its design; an ulp of difference would mean the two
// devices serve different bytes for the same cache, which callers cannot tell from corruption.
// Inputs of the RoPE layouts are pattern values (finite, normal), so NaN payloads, which the
// two conversions need not preserve alike, never arise.
//
// CacheParityTest drives two Caches with the same random spec, one per device, through the same
// random Append (plain and speculative), CommitSpeculation, Remove (re-rotating keys), CopyPrefix,
// Snapshot, Restore, Merge/Split/DropSnapshot and Read calls; every status code, every returned
// value and, after every step, everything observable (ListSequences, Usage, ListSnapshots and
// the Read payload of every live sequence) must be identical.
//
// KVMESH_PARITY_SEED sets the base seed, KVMESH_PARITY_EPISODES the number of episodes of each
// test. A failure prints the seed, the episode and its operations up to the failing step.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cache/cache.h"
#include "cache/device/cuda_device.h"
#include "cache/device/device.h"
#include "cache/device/host_device.h"
#include "cache/spec.h"
#include "gtest/gtest.h"
#include "tests/testing/pattern.h"
#include "tests/testing/test_device.h"
#include "tests/unit/cache_test_util.h"

namespace kvmesh {
namespace {

using testutil::Mix64;

constexpr uint64_t kDefaultSeed = 20250611;

uint64_t EnvU64(const char* name, uint64_t fallback) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return fallback;
  return std::strtoull(value, nullptr, 10);
}

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() { return Mix64(state_++); }
  // Uniform in [0, n), n > 0.
  int64_t Below(int64_t n) { return static_cast<int64_t>(Next() % static_cast<uint64_t>(n)); }
  // Uniform in [lo, hi].
  int64_t Between(int64_t lo, int64_t hi) { return lo + Below(hi - lo + 1); }
  bool Chance(int percent) { return Below(100) < percent; }
  template <typename T>
  const T& Pick(const std::vector<T>& v) {
    return v[Below(static_cast<int64_t>(v.size()))];
  }
  template <typename T>
  void Shuffle(std::vector<T>* v) {
    for (size_t i = v->size(); i > 1; --i) std::swap((*v)[i - 1], (*v)[Below(i)]);
  }

 private:
  uint64_t state_;
};

// Opens the GPU the tests are pointed at (KVMESH_TEST_CUDA_DEVICE); staging_bytes 0: default.
absl::StatusOr<std::unique_ptr<Device>> OpenCuda(size_t budget, size_t snapshot_budget,
                                                 size_t staging_bytes) {
  CudaDeviceOptions options;
  options.ordinal = testutil::TestCudaOrdinal();
  options.budget_bytes = budget;
  options.snapshot_budget_bytes = snapshot_budget;
  if (staging_bytes != 0) options.staging_bytes = staging_bytes;
  return CreateCudaDevice(options);
}

#define KVMESH_SKIP_WITHOUT_GPU()                                                      \
  do {                                                                                 \
    if (CudaDeviceCount() == 0) {                                                      \
      GTEST_SKIP() << "no CUDA device is visible (built with CUDA: "                   \
                   << (CudaBuilt() ? "yes" : "no") << "): nothing to compare against"; \
    }                                                                                  \
  } while (0)

// ---- Device operations --------------------------------------------------------------------

std::string RowsToString(const std::vector<int32_t>& rows) {
  if (rows.size() > 24) return "{" + std::to_string(rows.size()) + " rows}";
  return testutil::ToString(rows);
}

// A table of planes in an arena: every plane holds `rows` rows.
struct Layout {
  std::vector<Plane> planes;
  int32_t rows = 0;
  size_t bytes = 0;  // arena size

  std::string Describe() const {
    std::ostringstream os;
    os << rows << " rows, " << bytes << " bytes, planes";
    for (const Plane& p : planes) os << " [" << p.offset << " +" << p.row_bytes << "]";
    return os.str();
  }
};

size_t AlignUp(size_t n, size_t a) { return (n + a - 1) / a * a; }

// Places planes of the given row sizes in shuffled order, with gaps that are multiples of
// `align`; some planes start 16-byte aligned (the kernels' vector path), most do not.
Layout PlaceLayout(Rng& rng, const std::vector<size_t>& row_bytes, int32_t rows, size_t align) {
  Layout layout;
  layout.rows = rows;
  layout.planes.resize(row_bytes.size());
  std::vector<size_t> order(row_bytes.size());
  std::iota(order.begin(), order.end(), size_t{0});
  rng.Shuffle(&order);
  size_t cursor = align * rng.Below(3);
  for (size_t index : order) {
    if (rng.Chance(30)) {
      cursor = AlignUp(cursor, 16);
    } else {
      cursor += align * rng.Below(8);
    }
    layout.planes[index] = Plane{cursor, row_bytes[index]};
    cursor += row_bytes[index] * rows;
  }
  layout.bytes = std::max<size_t>(1, cursor + rng.Below(32));
  return layout;
}

// One episode's geometry: RoPE layouts hold rows of [heads][head_dim] elements of `dtype` in
// every plane; copy layouts hold raw bytes of any size.
struct Shape {
  bool rope = false;
  bool large = false;  // rows of 1 to 4 MiB
  DType dtype = DType::kF16;
  int32_t heads = 0;
  int32_t head_dim = 0;
  Layout cache;     // MemoryPool::kCache
  Layout snapshot;  // MemoryPool::kSnapshot: same row sizes plane by plane, other placement

  std::string Describe() const {
    std::ostringstream os;
    if (rope) {
      os << "rope rows " << DTypeName(dtype) << " " << heads << "x" << head_dim;
    } else {
      os << "byte rows";
    }
    os << "; cache arena " << cache.Describe() << "; snapshot arena " << snapshot.Describe();
    return os.str();
  }
};

Shape RandomShape(Rng& rng) {
  Shape shape;
  shape.rope = rng.Chance(55);
  shape.large = rng.Chance(12);
  const bool large = shape.large;
  std::vector<size_t> row_bytes;
  int32_t rows_cache, rows_snapshot;
  size_t align = 1;
  if (shape.rope) {
    shape.dtype = static_cast<DType>(rng.Below(3));
    const size_t esize = DTypeSize(shape.dtype);
    if (large) {
      // Rows of 1 to 4 MiB.
      shape.head_dim = static_cast<int32_t>(rng.Pick(std::vector<int64_t>{128, 256, 512}));
      const size_t target = static_cast<size_t>(rng.Between(1, 4)) << 20;
      shape.heads = static_cast<int32_t>(std::max<size_t>(1, target / (shape.head_dim * esize)));
      shape.heads += static_cast<int32_t>(rng.Below(3));  // not always a power of two
    } else {
      shape.heads = static_cast<int32_t>(rng.Pick(std::vector<int64_t>{1, 1, 2, 3, 4, 5, 8, 16}));
      shape.head_dim = static_cast<int32_t>(
          rng.Pick(std::vector<int64_t>{2, 4, 6, 8, 10, 14, 16, 18, 32, 64, 80, 96, 128, 256}));
    }
    const size_t row = size_t(shape.heads) * shape.head_dim * esize;
    row_bytes.assign(static_cast<size_t>(rng.Between(1, large ? 3 : 6)), row);
    align = esize;
  } else {
    const int planes = static_cast<int>(rng.Between(1, large ? 3 : 8));
    for (int p = 0; p < planes; ++p) {
      size_t row;
      if (large) {
        row = (static_cast<size_t>(rng.Between(1, 3)) << 20) + static_cast<size_t>(rng.Below(4099));
      } else if (rng.Chance(60)) {
        row = static_cast<size_t>(
            rng.Pick(std::vector<int64_t>{1,  2,  3,  5,  6,  7,  8,   12,  15,  16,   17,
                                          31, 32, 33, 48, 63, 64, 100, 255, 256, 1000, 4097}));
      } else {
        row = static_cast<size_t>(rng.Between(1, rng.Chance(80) ? 300 : 70000));
      }
      row_bytes.push_back(row);
    }
  }
  rows_cache = static_cast<int32_t>(large ? rng.Between(2, 4) : rng.Between(1, 64));
  rows_snapshot = static_cast<int32_t>(large ? rng.Between(1, 3) : rng.Between(1, 40));
  shape.cache = PlaceLayout(rng, row_bytes, rows_cache, align);
  shape.snapshot = PlaceLayout(rng, row_bytes, rows_snapshot, align);
  return shape;
}

// `n` bytes of the random stream `seed`.
std::vector<uint8_t> RandomBytes(uint64_t seed, size_t n) {
  std::vector<uint8_t> bytes(n);
  for (size_t i = 0; i < n; i += 8) {
    const uint64_t word = Mix64(seed ^ (i * 0x9E3779B97F4A7C15ull));
    std::memcpy(bytes.data() + i, &word, std::min<size_t>(8, n - i));
  }
  return bytes;
}

// Row data for a RoPE layout is pattern elements (finite, normal); otherwise random bytes.
std::vector<uint8_t> RowData(const Shape& shape, uint64_t seed, size_t n) {
  if (!shape.rope) return RandomBytes(seed, n);
  std::vector<uint8_t> bytes(n);
  testutil::FillPattern(shape.dtype, seed, n / DTypeSize(shape.dtype), bytes.data());
  return bytes;
}

// The first difference between two arena images, located in the layout.
::testing::AssertionResult SameBytesIn(const std::string& what, const Layout& layout,
                                       const std::vector<uint8_t>& host,
                                       const std::vector<uint8_t>& cuda) {
  if (host.size() != cuda.size()) {
    return ::testing::AssertionFailure()
           << what << ": host read " << host.size() << " bytes, CUDA " << cuda.size();
  }
  size_t first = host.size(), count = 0;
  for (size_t i = 0; i < host.size(); ++i) {
    if (host[i] != cuda[i]) {
      if (first == host.size()) first = i;
      ++count;
    }
  }
  if (count == 0) return ::testing::AssertionSuccess();
  ::testing::AssertionResult r = ::testing::AssertionFailure();
  r << what << ": " << count << " of " << host.size() << " bytes differ, the first at byte "
    << first << " (host 0x" << std::hex << int(host[first]) << ", CUDA 0x" << int(cuda[first])
    << std::dec << ")";
  for (size_t p = 0; p < layout.planes.size(); ++p) {
    const Plane& plane = layout.planes[p];
    if (first >= plane.offset && first < plane.offset + plane.row_bytes * layout.rows) {
      const size_t in = first - plane.offset;
      r << ": plane " << p << " row " << in / plane.row_bytes << " byte " << in % plane.row_bytes;
      return r;
    }
  }
  return r << ": between planes";
}

// One arena allocated on both devices, with the same contents.
struct TwinArena {
  Layout layout;
  DeviceArena host;
  DeviceArena cuda;
};

class DeviceOpsEpisode {
 public:
  DeviceOpsEpisode(uint64_t seed, Device& host, Device& cuda)
      : rng_(seed), host_(host), cuda_(cuda), shape_(RandomShape(rng_)) {}

  const Shape& shape() const { return shape_; }
  const std::vector<std::string>& log() const { return log_; }

  ::testing::AssertionResult Run(int steps) {
    ::testing::AssertionResult setup = SetUp();
    if (!setup) return setup;
    for (int step = 0; step < steps; ++step) {
      ::testing::AssertionResult r = Step();
      if (r) r = Compare();
      if (!r) return r << "\n(at step " << step << ")";
    }
    return ::testing::AssertionSuccess();
  }

 private:
  // Allocates both arenas on both devices (the cache arena on a stream of its own, the snapshot
  // arena on the same stream, another one or the device's own) and fills them alike.
  ::testing::AssertionResult SetUp() {
    std::shared_ptr<DeviceStream> host_streams[2], cuda_streams[2];
    for (int i = 0; i < 2; ++i) {
      absl::StatusOr<std::shared_ptr<DeviceStream>> h = host_.CreateStream();
      absl::StatusOr<std::shared_ptr<DeviceStream>> c = cuda_.CreateStream();
      if (!h.ok() || !c.ok()) {
        return ::testing::AssertionFailure()
               << "CreateStream: host " << h.status() << ", CUDA " << c.status();
      }
      host_streams[i] = *h;
      cuda_streams[i] = *c;
    }
    const int64_t cache_binding = rng_.Below(4);     // 0: none, else stream 0
    const int64_t snapshot_binding = rng_.Below(3);  // 0: none, 1: stream 0, 2: stream 1
    auto pick = [&](std::shared_ptr<DeviceStream>* streams, int64_t binding) {
      return binding == 0 ? nullptr : streams[binding == 2 ? 1 : 0];
    };
    log_.push_back("cache arena stream " + std::to_string(cache_binding != 0) +
                   ", snapshot arena stream " + std::to_string(snapshot_binding));
    ::testing::AssertionResult a =
        Allocate(shape_.cache, MemoryPool::kCache, pick(host_streams, cache_binding != 0),
                 pick(cuda_streams, cache_binding != 0), &cache_);
    if (!a) return a;
    a = Allocate(shape_.snapshot, MemoryPool::kSnapshot, pick(host_streams, snapshot_binding),
                 pick(cuda_streams, snapshot_binding), &snapshot_);
    if (!a) return a;
    return Compare();
  }

  ::testing::AssertionResult Allocate(const Layout& layout, MemoryPool pool,
                                      std::shared_ptr<DeviceStream> host_stream,
                                      std::shared_ptr<DeviceStream> cuda_stream, TwinArena* twin) {
    twin->layout = layout;
    absl::StatusOr<DeviceArena> h = host_.Allocate(layout.bytes, pool, std::move(host_stream));
    absl::StatusOr<DeviceArena> c = cuda_.Allocate(layout.bytes, pool, std::move(cuda_stream));
    if (!h.ok() || !c.ok()) {
      return ::testing::AssertionFailure()
             << "Allocate(" << layout.bytes << "): host " << h.status() << ", CUDA " << c.status();
    }
    twin->host = std::move(h).value();
    twin->cuda = std::move(c).value();
    // Random bytes everywhere, then (RoPE layouts) pattern rows in every plane.
    std::vector<uint8_t> image = RandomBytes(rng_.Next(), layout.bytes);
    for (const Plane& plane : layout.planes) {
      const std::vector<uint8_t> rows = RowData(shape_, rng_.Next(), plane.row_bytes * layout.rows);
      std::memcpy(image.data() + plane.offset, rows.data(), rows.size());
    }
    ::testing::AssertionResult w = testutil::WriteArena(host_, twin->host, image);
    if (w) w = testutil::WriteArena(cuda_, twin->cuda, image);
    return w;
  }

  ::testing::AssertionResult Compare() {
    for (TwinArena* twin : {&cache_, &snapshot_}) {
      std::vector<uint8_t> h, c;
      ::testing::AssertionResult r = testutil::ReadArena(host_, twin->host, &h);
      if (r) r = testutil::ReadArena(cuda_, twin->cuda, &c);
      if (r) {
        r = SameBytesIn(twin == &cache_ ? "cache arena" : "snapshot arena", twin->layout, h, c);
      }
      if (!r) return r;
    }
    return ::testing::AssertionSuccess();
  }

  // Both devices returned OK.
  ::testing::AssertionResult BothOk(const char* op, const absl::Status& host,
                                    const absl::Status& cuda) {
    if (host.ok() && cuda.ok()) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << op << ": host " << host << ", CUDA " << cuda;
  }

  // A non-empty subset of the plane indices in random order; half the time all, in order.
  std::vector<size_t> PlaneSubset() {
    std::vector<size_t> all(shape_.cache.planes.size());
    std::iota(all.begin(), all.end(), size_t{0});
    if (rng_.Chance(50)) return all;
    rng_.Shuffle(&all);
    all.resize(static_cast<size_t>(rng_.Between(1, static_cast<int64_t>(all.size()))));
    return all;
  }

  static std::vector<Plane> Select(const Layout& layout, const std::vector<size_t>& subset) {
    std::vector<Plane> planes;
    for (size_t p : subset) planes.push_back(layout.planes[p]);
    return planes;
  }

  static size_t RowBytesSum(const std::vector<Plane>& planes) {
    size_t sum = 0;
    for (const Plane& p : planes) sum += p.row_bytes;
    return sum;
  }

  // Up to `max_count` distinct rows of [0, rows) outside `exclude`, in random order.
  std::vector<int32_t> DistinctRows(int32_t rows, int64_t max_count,
                                    const std::set<int32_t>& exclude = {}) {
    std::vector<int32_t> candidates;
    for (int32_t r = 0; r < rows; ++r) {
      if (exclude.count(r) == 0) candidates.push_back(r);
    }
    rng_.Shuffle(&candidates);
    const int64_t limit = std::min<int64_t>(max_count, static_cast<int64_t>(candidates.size()));
    candidates.resize(static_cast<size_t>(limit <= 0 ? 0 : rng_.Between(0, limit)));
    return candidates;
  }

  // Rows of [0, rows) outside `exclude`, repeats allowed.
  std::vector<int32_t> AnyRows(int32_t rows, size_t count, const std::set<int32_t>& exclude = {}) {
    std::vector<int32_t> allowed;
    for (int32_t r = 0; r < rows; ++r) {
      if (exclude.count(r) == 0) allowed.push_back(r);
    }
    std::vector<int32_t> out;
    if (allowed.empty()) return out;
    for (size_t i = 0; i < count; ++i) out.push_back(rng_.Pick(allowed));
    return out;
  }

  int64_t MaxRowsPerOp(const Layout& layout) const {
    return layout.planes[0].row_bytes * layout.rows > (size_t{4} << 20) ? 3 : layout.rows;
  }

  TwinArena& PickArena() { return rng_.Chance(65) ? cache_ : snapshot_; }
  const char* NameOf(const TwinArena& twin) const {
    return &twin == &cache_ ? "cache" : "snapshot";
  }

  ::testing::AssertionResult Step() {
    const int64_t op = rng_.Below(shape_.rope ? 100 : 75);
    if (op < 20) return DoScatter();
    if (op < 32) return DoGather();
    if (op < 45) return DoCopyRows();
    if (op < 75) return DoCopyRowsBetween();
    return DoRopeShift();
  }

  ::testing::AssertionResult DoScatter() {
    TwinArena& twin = PickArena();
    const std::vector<Plane> planes = Select(twin.layout, PlaneSubset());
    std::vector<int32_t> rows = DistinctRows(twin.layout.rows, MaxRowsPerOp(twin.layout));
    // Skipped rows: their source rows are consumed and written nowhere.
    const int64_t skips = rows.empty() ? 0 : rng_.Below(3);
    for (int64_t i = 0; i < skips; ++i) {
      rows.insert(rows.begin() + rng_.Below(static_cast<int64_t>(rows.size()) + 1), -1);
    }
    const std::vector<uint8_t> src =
        RowData(shape_, rng_.Next(), RowBytesSum(planes) * rows.size());
    log_.push_back(std::string("Scatter ") + NameOf(twin) + " " + std::to_string(planes.size()) +
                   " planes rows " + RowsToString(rows));
    return BothOk("Scatter", host_.Scatter(twin.host, planes, rows, src.data()),
                  cuda_.Scatter(twin.cuda, planes, rows, src.data()));
  }

  ::testing::AssertionResult DoGather() {
    TwinArena& twin = PickArena();
    const std::vector<Plane> planes = Select(twin.layout, PlaneSubset());
    std::vector<int32_t> rows;
    if (rng_.Chance(50)) {
      rows = DistinctRows(twin.layout.rows, MaxRowsPerOp(twin.layout));
    } else {
      rows = AnyRows(twin.layout.rows, static_cast<size_t>(rng_.Between(
                                           0, std::min<int64_t>(MaxRowsPerOp(twin.layout), 80))));
    }
    const size_t n = RowBytesSum(planes) * rows.size();
    // Different fill bytes, so an untouched output byte cannot match by accident.
    std::vector<uint8_t> h(n, 0xA5), c(n, 0x5A);
    log_.push_back(std::string("Gather ") + NameOf(twin) + " " + std::to_string(planes.size()) +
                   " planes rows " + RowsToString(rows));
    ::testing::AssertionResult r = BothOk("Gather", host_.Gather(twin.host, planes, rows, h.data()),
                                          cuda_.Gather(twin.cuda, planes, rows, c.data()));
    if (!r) return r;
    Layout packed;  // the output is one plane of the gathered rows, for the error message
    packed.planes = {Plane{0, n / std::max<size_t>(1, rows.size())}};
    packed.rows = static_cast<int32_t>(rows.size());
    return SameBytesIn("Gather output", packed, h, c);
  }

  ::testing::AssertionResult DoCopyRows() {
    TwinArena& twin = PickArena();
    const std::vector<Plane> planes = Select(twin.layout, PlaneSubset());
    const int64_t limit =
        std::max<int64_t>(1, std::min<int64_t>(MaxRowsPerOp(twin.layout), twin.layout.rows / 2));
    const std::vector<int32_t> dst = DistinctRows(twin.layout.rows, limit);
    const std::set<int32_t> written(dst.begin(), dst.end());
    std::vector<int32_t> src = AnyRows(twin.layout.rows, dst.size(), written);
    if (src.size() != dst.size()) return ::testing::AssertionSuccess();  // every row written
    log_.push_back(std::string("CopyRows ") + NameOf(twin) + " " + RowsToString(src) + " -> " +
                   RowsToString(dst));
    return BothOk("CopyRows", host_.CopyRows(twin.host, planes, src, dst),
                  cuda_.CopyRows(twin.cuda, planes, src, dst));
  }

  ::testing::AssertionResult DoCopyRowsBetween() {
    TwinArena& from = rng_.Chance(50) ? cache_ : snapshot_;
    TwinArena& to = rng_.Chance(80) ? (&from == &cache_ ? snapshot_ : cache_) : from;
    const std::vector<size_t> subset = PlaneSubset();
    const std::vector<Plane> src_planes = Select(from.layout, subset);
    const std::vector<Plane> dst_planes = Select(to.layout, subset);
    const int64_t limit = std::min(MaxRowsPerOp(from.layout), MaxRowsPerOp(to.layout));
    const std::vector<int32_t> dst = DistinctRows(to.layout.rows, limit);
    // Within one arena no row may be both read and written.
    std::set<int32_t> exclude;
    if (&from == &to) exclude.insert(dst.begin(), dst.end());
    const std::vector<int32_t> src = AnyRows(from.layout.rows, dst.size(), exclude);
    if (src.size() != dst.size()) return ::testing::AssertionSuccess();
    log_.push_back(std::string("CopyRowsBetween ") + NameOf(from) + " " + RowsToString(src) +
                   " -> " + NameOf(to) + " " + RowsToString(dst) + " over " +
                   std::to_string(subset.size()) + " planes");
    return BothOk("CopyRowsBetween",
                  host_.CopyRowsBetween(from.host, src_planes, src, to.host, dst_planes, dst),
                  cuda_.CopyRowsBetween(from.cuda, src_planes, src, to.cuda, dst_planes, dst));
  }

  ::testing::AssertionResult DoRopeShift() {
    TwinArena& twin = rng_.Chance(80) ? cache_ : snapshot_;
    const std::vector<Plane> planes = Select(twin.layout, PlaneSubset());
    // Sometimes with rows listed more than once: each listing rotates the row again, so a launch
    // must never hold two of them (on a GPU they would race; the simulator runs threads one
    // after another and cannot see that, only the result's order of rotations).
    const std::vector<int32_t> rows =
        rng_.Chance(25) ? AnyRows(twin.layout.rows,
                                  static_cast<size_t>(rng_.Between(1, MaxRowsPerOp(twin.layout))))
                        : DistinctRows(twin.layout.rows, MaxRowsPerOp(twin.layout));
    RopeShiftParams params;
    params.rope.type = rng_.Chance(50) ? RopeType::kNormal : RopeType::kNeox;
    // Any even dims up to head_dim: often all of it, often fewer (partial rotary).
    const int32_t max_pairs = shape_.head_dim / 2;
    params.rope.dims =
        2 * static_cast<int32_t>(rng_.Chance(40) ? max_pairs : rng_.Between(1, max_pairs));
    params.rope.base =
        static_cast<float>(rng_.Pick(std::vector<int64_t>{10000, 10000, 500000, 1000000, 100, 10}));
    params.rope.freq_scale = rng_.Pick(std::vector<float>{1.0f, 1.0f, 0.25f, 0.75f, 8.0f});
    params.dtype = shape_.dtype;
    params.num_heads = shape_.heads;
    params.head_dim = shape_.head_dim;
    switch (rng_.Below(5)) {
      case 0:
        params.delta = static_cast<int32_t>(rng_.Between(-3, 3));
        break;
      case 1:
        params.delta = static_cast<int32_t>(rng_.Between(-100000, 100000));
        break;
      case 2:
        params.delta = rng_.Chance(50) ? 1 << 20 : -(1 << 20);
        break;
      default:
        params.delta = static_cast<int32_t>(rng_.Between(-300, 300));
        break;
    }
    std::ostringstream os;
    os << "RopeShift " << NameOf(twin) << " "
       << (params.rope.type == RopeType::kNormal ? "NORMAL" : "NEOX") << " dims "
       << params.rope.dims << " base " << params.rope.base << " freq_scale "
       << params.rope.freq_scale << " delta " << params.delta << " " << planes.size()
       << " planes rows " << RowsToString(rows);
    log_.push_back(os.str());
    return BothOk("RopeShift", host_.RopeShift(twin.host, planes, rows, params),
                  cuda_.RopeShift(twin.cuda, planes, rows, params));
  }

  Rng rng_;
  Device& host_;
  Device& cuda_;
  const Shape shape_;
  TwinArena cache_;
  TwinArena snapshot_;
  std::vector<std::string> log_;
};

std::string JoinLog(const std::vector<std::string>& log) {
  std::ostringstream os;
  for (const std::string& line : log) os << "\n  " << line;
  return os.str();
}

// The staging size of the CudaDevice: 0 for the default, or a tiny one (a 32 KiB half) so that
// every payload moves in pieces and large rows take the huge-row path.
class DeviceOpsParityTest : public ::testing::TestWithParam<size_t> {};

TEST_P(DeviceOpsParityTest, RandomOperationsLeaveIdenticalBytes) {
  KVMESH_SKIP_WITHOUT_GPU();
  constexpr size_t kBudget = size_t{1} << 29;
  HostDevice host(kBudget, kBudget);
  absl::StatusOr<std::unique_ptr<Device>> cuda = OpenCuda(kBudget, kBudget, GetParam());
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  const uint64_t base_seed = EnvU64("KVMESH_PARITY_SEED", kDefaultSeed);
  const int episodes = static_cast<int>(EnvU64("KVMESH_PARITY_EPISODES", 150));
  std::map<std::string, int> shapes;
  for (int e = 0; e < episodes; ++e) {
    const uint64_t seed = Mix64(base_seed ^ (0xD0D0ull << 32) ^ static_cast<uint64_t>(e));
    // Arenas are destroyed with the episode, before the devices.
    DeviceOpsEpisode episode(seed, host, **cuda);
    SCOPED_TRACE("KVMESH_PARITY_SEED=" + std::to_string(base_seed) + " episode " +
                 std::to_string(e) + ": " + episode.shape().Describe());
    // Fewer steps on large rows: every step reads back tens of MiB from each device.
    const ::testing::AssertionResult r = episode.Run(episode.shape().large ? 16 : 40);
    ASSERT_TRUE(r) << "\noperations:" << JoinLog(episode.log());
    ++shapes[episode.shape().rope
                 ? std::string("rope ") + std::string(DTypeName(episode.shape().dtype))
                 : "bytes"];
  }
  for (const auto& [k, v] : shapes) std::printf("  %-12s %d episodes\n", k.c_str(), v);
  EXPECT_EQ(host.used_bytes(MemoryPool::kCache) + host.used_bytes(MemoryPool::kSnapshot), 0u);
  EXPECT_EQ((*cuda)->used_bytes(MemoryPool::kCache) + (*cuda)->used_bytes(MemoryPool::kSnapshot),
            0u);
}

INSTANTIATE_TEST_SUITE_P(Staging, DeviceOpsParityTest,
                         ::testing::Values(size_t{0}, size_t{64} << 10),
                         [](const ::testing::TestParamInfo<size_t>& info) {
                           return info.param == 0 ? std::string("Default") : std::string("Tiny");
                         });

// ---- Caches ------------------------------------------------------------------------------

RopeSpec RandomRope(Rng& rng, int32_t head_dim_k) {
  RopeSpec rope;
  const int64_t r = rng.Below(10);
  if (r >= 2) {
    rope.type = r < 6 ? RopeType::kNormal : RopeType::kNeox;
    rope.dims =
        rng.Chance(50) ? head_dim_k : static_cast<int32_t>(2 * rng.Between(1, head_dim_k / 2));
    rope.base = rng.Chance(50) ? 10000.0f : (rng.Chance(50) ? 100.0f : 1e6f);
    rope.freq_scale = rng.Chance(60) ? 1.0f : (rng.Chance(50) ? 0.5f : 2.0f);
  }
  return rope;
}

int32_t RandomHeadDimK(Rng& rng) {
  return static_cast<int32_t>(rng.Pick(std::vector<int64_t>{2, 4, 6, 8, 16, 18, 64, 128}));
}

int32_t RandomHeadDimV(Rng& rng) {
  return static_cast<int32_t>(rng.Pick(std::vector<int64_t>{1, 3, 4, 8, 17, 64, 128}));
}

GroupSpec RandomAttentionGroup(Rng& rng, const CacheSpec& spec) {
  WindowSpec window;
  switch (rng.Below(3)) {
    case 0:
      window = testutil::Full();
      break;
    case 1: {
      const int32_t w = static_cast<int32_t>(rng.Between(1, 8));
      window = testutil::Sliding(
          w, rng.Chance(50) ? 0 : w + static_cast<int32_t>(rng.Between(0, spec.capacity)));
      break;
    }
    default:
      window = testutil::Chunked(static_cast<int32_t>(rng.Between(1, 8)));
      break;
  }
  const int32_t k = RandomHeadDimK(rng);
  return testutil::Group(window, static_cast<int32_t>(rng.Between(1, 3)),
                         static_cast<int32_t>(rng.Between(1, 4)), k, RandomHeadDimV(rng),
                         RandomRope(rng, k));
}

GroupSpec RandomRotatingGroup(Rng& rng, const CacheSpec& spec) {
  const int32_t k = RandomHeadDimK(rng);
  return testutil::RotatingGroup(static_cast<int32_t>(rng.Between(1, std::min(spec.capacity, 8))),
                                 static_cast<int32_t>(rng.Between(1, 2)),
                                 static_cast<int32_t>(rng.Between(1, 3)), k, RandomHeadDimV(rng),
                                 RandomRope(rng, k));
}

GroupSpec RandomRecurrentGroup(Rng& rng) {
  if (rng.Chance(50)) {
    return testutil::RecurrentGroup(static_cast<int32_t>(rng.Between(1, 2)),
                                    static_cast<int32_t>(rng.Between(1, 3)),
                                    static_cast<int32_t>(rng.Between(1, 40)), 0, 0, 0);
  }
  return testutil::RecurrentGroup(
      static_cast<int32_t>(rng.Between(1, 2)), static_cast<int32_t>(rng.Between(1, 3)),
      static_cast<int32_t>(rng.Between(1, 40)), static_cast<int32_t>(rng.Between(1, 2)),
      static_cast<int32_t>(rng.Between(1, 8)), static_cast<int32_t>(rng.Between(1, 8)));
}

CacheSpec RandomCacheSpec(Rng& rng) {
  CacheSpec spec;
  spec.name = "parity";
  spec.dtype = static_cast<DType>(rng.Below(3));
  spec.max_sequences = static_cast<int32_t>(rng.Between(1, 4));
  spec.capacity = static_cast<int32_t>(rng.Between(6, 40));
  spec.max_batch = static_cast<int32_t>(rng.Between(1, 12));
  const int groups = static_cast<int>(rng.Between(1, 3));
  const bool hybrid = rng.Chance(45);
  for (int g = 0; g < groups; ++g) {
    const int64_t kind = hybrid ? rng.Below(3) : 0;
    if (kind == 0) {
      spec.groups.push_back(RandomAttentionGroup(rng, spec));
    } else if (kind == 1) {
      spec.groups.push_back(RandomRotatingGroup(rng, spec));
    } else {
      spec.groups.push_back(RandomRecurrentGroup(rng));
    }
  }
  return spec;
}

std::string DescribeSpec(const CacheSpec& spec) {
  std::ostringstream os;
  os << DTypeName(spec.dtype) << " max_sequences " << spec.max_sequences << " capacity "
     << spec.capacity << " max_batch " << spec.max_batch;
  for (const GroupSpec& g : spec.groups) {
    os << " [" << GroupKindName(g.kind) << " x" << g.num_layers;
    if (g.kind == GroupKind::kAttention) {
      const AttentionSpec& a = g.attention;
      os << " heads " << a.num_kv_heads << " k " << a.head_dim_k << " v " << a.head_dim_v
         << " window " << static_cast<int>(a.window.kind) << "/" << a.window.window << "/"
         << a.window.memory << "/" << a.window.chunk << " rope " << static_cast<int>(a.rope.type)
         << "/" << a.rope.dims;
    } else if (g.kind == GroupKind::kRotating) {
      const RotatingSpec& r = g.rotating;
      os << " heads " << r.num_kv_heads << " k " << r.head_dim_k << " v " << r.head_dim_v
         << " max_size " << r.max_size << " rope " << static_cast<int>(r.rope.type) << "/"
         << r.rope.dims;
    } else {
      const RecurrentSpec& r = g.recurrent;
      os << " conv " << r.conv_tail << "x" << r.conv_dim << " delta " << r.num_v_heads << "x"
         << r.head_v_dim << "x" << r.head_k_dim;
    }
    os << "]";
  }
  return os.str();
}

std::string DescribeSnapshot(const SnapshotInfo& info) {
  std::ostringstream os;
  os << "id " << info.id << " seq " << info.seq << " [" << info.from << ", " << info.to
     << ") bytes " << info.bytes;
  for (const SnapshotGroupInfo& g : info.groups) {
    os << " {" << g.stored << " " << g.ring_index << " " << StateStatusName(g.state) << "}";
  }
  return os.str();
}

std::string DescribeResult(const absl::StatusOr<SnapshotInfo>& r) {
  return r.ok() ? DescribeSnapshot(*r) : r.status().ToString();
}

std::string DescribeResult(const absl::StatusOr<SplitResult>& r) {
  if (!r.ok()) return r.status().ToString();
  return "parent " + (r->parent ? DescribeSnapshot(*r->parent) : std::string("none")) + ", child " +
         (r->child ? DescribeSnapshot(*r->child) : std::string("none"));
}

class CacheParityEpisode {
 public:
  CacheParityEpisode(uint64_t seed, const CacheSpec& spec, Cache& host, Cache& cuda)
      : rng_(seed), spec_(spec), host_(host), cuda_(cuda) {
    pool_ = {0, 1, 2, 7, int64_t{1} << 35};
    pool_.resize(std::min<size_t>(pool_.size(), spec.max_sequences + 2));
  }

  std::map<std::string, int> outcomes;
  const std::vector<std::string>& log() const { return log_; }

  ::testing::AssertionResult Run(int steps) {
    for (int step = 0; step < steps; ++step) {
      ::testing::AssertionResult r = Step();
      if (r) {
        r = testutil::SameState(testutil::CaptureState(host_), testutil::CaptureState(cuda_));
        if (!r) r << "\n(the state after the step differs: host first, then CUDA)";
      }
      if (!r) return r << "\n(at step " << step << ")";
    }
    return ::testing::AssertionSuccess();
  }

 private:
  // Offset of `seq` (pending included), 0 when it is not live; the same in both caches.
  int32_t Offset(int64_t seq) const {
    std::optional<SequenceInfo> info = testutil::FindSequence(host_, seq);
    return info ? info->offset : 0;
  }
  int32_t Pending(int64_t seq) const {
    std::optional<SequenceInfo> info = testutil::FindSequence(host_, seq);
    return info ? info->pending : 0;
  }

  ::testing::AssertionResult SameCode(const std::string& op, const absl::Status& host,
                                      const absl::Status& cuda) {
    log_.push_back(op + " -> " + host.ToString());
    ++outcomes[op.substr(0, op.find(' ')) + " " + absl::StatusCodeToString(host.code())];
    if (host.code() == cuda.code()) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << op << ": host " << host << ", CUDA " << cuda;
  }

  template <typename T>
  ::testing::AssertionResult SameResult(const std::string& op, const absl::StatusOr<T>& host,
                                        const absl::StatusOr<T>& cuda) {
    ::testing::AssertionResult r = SameCode(op, host.status(), cuda.status());
    if (!r || !host.ok()) return r;
    const std::string h = DescribeResult(host), c = DescribeResult(cuda);
    if (h == c) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << op << ": host " << h << ", CUDA " << c;
  }

  int32_t Near(int32_t value, int32_t spread) {
    return std::max(0, value + static_cast<int32_t>(rng_.Between(-spread, spread)));
  }

  ::testing::AssertionResult Step() {
    const int64_t seq = rng_.Pick(pool_);
    const int64_t op = rng_.Below(100);
    std::ostringstream os;
    if (op < 34) {  // Append, sometimes of two sequences
      std::vector<Token> tokens;
      const int32_t begin = rng_.Chance(85) ? Offset(seq) : Near(Offset(seq), 2);
      const int32_t n = static_cast<int32_t>(rng_.Between(1, spec_.max_batch));
      for (const Token& t : testutil::Tokens(seq, begin, begin + n)) tokens.push_back(t);
      const int64_t other = rng_.Pick(pool_);
      if (other != seq && rng_.Chance(30)) {
        const int32_t b = Offset(other);
        for (const Token& t :
             testutil::Tokens(other, b, b + static_cast<int32_t>(rng_.Between(1, 3)))) {
          tokens.push_back(t);
        }
      }
      const uint64_t salt = rng_.Next() & 0xFFF;
      os << "Append " << tokens.size() << " tokens from " << seq << ":" << begin << " salt "
         << salt;
      return SameCode(os.str(), testutil::AppendTokens(host_, tokens, salt),
                      testutil::AppendTokens(cuda_, tokens, salt));
    }
    if (op < 42) {
      const int32_t begin = Offset(seq);
      const int32_t end = begin + static_cast<int32_t>(rng_.Between(1, 3));
      const uint64_t salt = rng_.Next() & 0xFFF;
      os << "AppendSpeculative " << seq << " [" << begin << ", " << end << ") salt " << salt;
      return SameCode(os.str(), testutil::AppendSpeculative(host_, seq, begin, end, salt),
                      testutil::AppendSpeculative(cuda_, seq, begin, end, salt));
    }
    if (op < 48) {
      const int32_t accepted = static_cast<int32_t>(rng_.Between(0, Pending(seq)));
      os << "CommitSpeculation " << seq << " " << accepted;
      return SameCode(os.str(), host_.CommitSpeculation(seq, accepted),
                      cuda_.CommitSpeculation(seq, accepted));
    }
    if (op < 64) {  // Remove: mostly from the middle, so later keys are re-rotated
      const int32_t offset = Offset(seq);
      const int32_t begin = static_cast<int32_t>(rng_.Between(0, std::max(0, offset - 1)));
      std::optional<int32_t> end;
      if (rng_.Chance(75)) end = begin + static_cast<int32_t>(rng_.Between(0, 4));
      os << "Remove " << seq << " [" << begin << ", " << (end ? std::to_string(*end) : "end")
         << ")";
      return SameCode(os.str(), host_.Remove(seq, begin, end), cuda_.Remove(seq, begin, end));
    }
    if (op < 72) {
      const int64_t dst = rng_.Pick(pool_);
      const int32_t length = static_cast<int32_t>(rng_.Between(0, Offset(seq) + 1));
      os << "CopyPrefix " << seq << " -> " << dst << " " << length;
      return SameCode(os.str(), host_.CopyPrefix(seq, dst, length),
                      cuda_.CopyPrefix(seq, dst, length));
    }
    if (op < 80) {
      const int32_t from = static_cast<int32_t>(rng_.Between(0, std::max(0, Offset(seq) - 1)));
      os << "Snapshot " << seq << " from " << from;
      absl::StatusOr<SnapshotInfo> h = host_.Snapshot(seq, from);
      absl::StatusOr<SnapshotInfo> c = cuda_.Snapshot(seq, from);
      if (h.ok()) snapshots_.push_back(h->id);
      return SameResult(os.str(), h, c);
    }
    if (op < 88) {
      std::optional<uint64_t> id;
      int32_t target = Offset(seq);
      if (!snapshots_.empty() && rng_.Chance(80)) {
        id = rng_.Pick(snapshots_);
        for (const SnapshotInfo& info : host_.ListSnapshots()) {
          if (info.id == *id) target = info.to;
        }
      }
      if (rng_.Chance(40)) target = Near(target, 3);
      os << "Restore " << seq << " from " << (id ? std::to_string(*id) : "itself") << " to "
         << target;
      return SameCode(os.str(), host_.Restore(seq, id, target), cuda_.Restore(seq, id, target));
    }
    if (op < 94 && !snapshots_.empty()) {
      const uint64_t a = rng_.Pick(snapshots_);
      switch (rng_.Below(3)) {
        case 0: {
          const uint64_t b = rng_.Pick(snapshots_);
          os << "MergeSnapshots " << a << " " << b;
          absl::StatusOr<SnapshotInfo> h = host_.MergeSnapshots(a, b);
          absl::StatusOr<SnapshotInfo> c = cuda_.MergeSnapshots(a, b);
          if (h.ok()) snapshots_.push_back(h->id);
          return SameResult(os.str(), h, c);
        }
        case 1: {
          const int32_t at = static_cast<int32_t>(rng_.Between(0, spec_.capacity));
          os << "SplitSnapshot " << a << " at " << at;
          absl::StatusOr<SplitResult> h = host_.SplitSnapshot(a, at);
          absl::StatusOr<SplitResult> c = cuda_.SplitSnapshot(a, at);
          if (h.ok() && h->parent) snapshots_.push_back(h->parent->id);
          if (h.ok() && h->child) snapshots_.push_back(h->child->id);
          return SameResult(os.str(), h, c);
        }
        default:
          os << "DropSnapshot " << a;
          return SameCode(os.str(), host_.DropSnapshot(a), cuda_.DropSnapshot(a));
      }
    }
    // Read of a random range (whole sequences are compared after every step anyway).
    const int32_t begin = static_cast<int32_t>(rng_.Between(0, Offset(seq) + 1));
    std::optional<int32_t> end;
    if (rng_.Chance(60)) end = begin + static_cast<int32_t>(rng_.Between(0, 6));
    os << "Read " << seq << " [" << begin << ", " << (end ? std::to_string(*end) : "end") << ")";
    absl::StatusOr<ReadResult> h = host_.Read(seq, begin, end);
    absl::StatusOr<ReadResult> c = cuda_.Read(seq, begin, end);
    ::testing::AssertionResult r = SameCode(os.str(), h.status(), c.status());
    if (!r || !h.ok()) return r;
    if (h->positions != c->positions || h->states != c->states) {
      return ::testing::AssertionFailure() << os.str() << ": positions or states differ";
    }
    r = testutil::SameBytes(h->payload, c->payload);
    if (!r) r << " (" << os.str() << ": host payload first, then CUDA)";
    return r;
  }

  Rng rng_;
  const CacheSpec spec_;
  Cache& host_;
  Cache& cuda_;
  std::vector<int64_t> pool_;
  std::vector<uint64_t> snapshots_;
  std::vector<std::string> log_;
};

TEST(CacheParityTest, RandomOperationsReadTheSameBytes) {
  KVMESH_SKIP_WITHOUT_GPU();
  const uint64_t base_seed = EnvU64("KVMESH_PARITY_SEED", kDefaultSeed);
  const int episodes = static_cast<int>(EnvU64("KVMESH_PARITY_EPISODES", 150));
  std::map<std::string, int> outcomes;
  for (int e = 0; e < episodes; ++e) {
    const uint64_t seed = Mix64(base_seed ^ (0xCAC4Eull << 32) ^ static_cast<uint64_t>(e));
    Rng spec_rng(seed ^ 0x5EC);
    const CacheSpec spec = RandomCacheSpec(spec_rng);
    SCOPED_TRACE("KVMESH_PARITY_SEED=" + std::to_string(base_seed) + " episode " +
                 std::to_string(e) + ", spec: " + DescribeSpec(spec));
    ASSERT_TRUE(ValidateSpec(spec).ok()) << ValidateSpec(spec);
    // A snapshot pool that sometimes runs out, the same on both devices.
    const size_t budget = std::max<size_t>(size_t{1} << 24, 4 * CacheBytes(spec));
    const size_t snapshot_budget = spec_rng.Chance(25) ? CacheBytes(spec) / 3 : budget;
    HostDevice host_device(budget, snapshot_budget);
    absl::StatusOr<std::unique_ptr<Device>> cuda_device = OpenCuda(budget, snapshot_budget, 0);
    ASSERT_TRUE(cuda_device.ok()) << cuda_device.status();
    absl::StatusOr<std::unique_ptr<Cache>> host = Cache::Create(spec, &host_device);
    absl::StatusOr<std::unique_ptr<Cache>> cuda = Cache::Create(spec, cuda_device->get());
    ASSERT_TRUE(host.ok()) << host.status();
    ASSERT_TRUE(cuda.ok()) << cuda.status();
    CacheParityEpisode episode(seed, spec, **host, **cuda);
    const ::testing::AssertionResult r = episode.Run(120);
    ASSERT_TRUE(r) << "\noperations:" << JoinLog(episode.log());
    for (const auto& [k, v] : episode.outcomes) outcomes[k] += v;
    // The caches go before their devices.
    host->reset();
    cuda->reset();
    EXPECT_EQ((*cuda_device)->used_bytes(MemoryPool::kCache), 0u);
    EXPECT_EQ((*cuda_device)->used_bytes(MemoryPool::kSnapshot), 0u);
  }
  // The run reached the operations that move data on the device.
  if (episodes >= 100) {
    for (const char* outcome :
         {"Append OK", "AppendSpeculative OK", "CommitSpeculation OK", "Remove OK", "CopyPrefix OK",
          "Snapshot OK", "Restore OK", "Snapshot RESOURCE_EXHAUSTED", "Read OK"}) {
      EXPECT_GT(outcomes[outcome], 0) << outcome;
    }
  }
  for (const auto& [k, v] : outcomes) std::printf("  %-40s %d\n", k.c_str(), v);
}

}  // namespace
}  // namespace kvmesh

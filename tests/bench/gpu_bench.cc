// gpu_bench: memory bandwidth of CudaDevice's kernels at the KV shape of a 4K-token Llama-3-8B
// sequence (32 layers x K and V planes, 8 KV heads x head dim 128, F16: 2048-byte rows, 64
// planes, 4096 rows, 512 MiB), reported the way nccl-tests reports collectives.
//
// Device section (CUDA events on one stream; median of --iters runs after warm-up):
//   scatter  kvmesh::cuda::LaunchCopyRows, contiguous plane-major source -> cells given by a
//            shuffled row list inside a larger table (8192 cells), as Append writes a cache
//   gather   the reverse, as Read does
//   rope     kvmesh::cuda::LaunchRopeShift in place over the 32 K planes (256 MiB), NORMAL and
//            NEOX, delta -100, base 500000, dims 128, as Remove re-rotates keys
//   memcpy   cudaMemcpyAsync device-to-device of the same payloads: the ceiling to compare with
// Host section (wall clock around synchronous calls; median likewise):
//   Device::Scatter / Device::Gather through a CudaDevice from pageable host memory (PCIe via
//   the device's pinned staging), against cudaMemcpy from pinned and from pageable memory.
//
// Columns: algbw = payload bytes / time; rwbw = (bytes read + bytes written) / time, counted
// the same way for every row, memcpy included (a D2D copy of N bytes reads N and writes N, a
// RoPE shift of N bytes in place reads N and writes N; a host<->device copy reads N on one side
// and writes N on the other, so for those rows algbw is the PCIe rate). GB/s is 1e9 bytes per
// second. `vs` is rwbw over the rwbw of the reference row named in `ref` (same payload size).
// `wrong` is the number of bytes that differ from the expected result, checked on the host after
// the timed runs: sources are filled from (seed, index) patterns; RoPE output is compared bit
// for bit with HostDevice::RopeShift on the same input; cells outside the row list must be
// untouched.
//
//   build-gpu/tests/bench/gpu_bench [--iters N] [--quick]
//
// --quick shrinks the shape (4 layers, 512 tokens, 1024 cells: 8 MiB) for a smoke run; its
// figures are L2-resident and mean nothing. Exit status: 0 all results right; 1 a wrong byte or a
// failed call; 2 bad flags; 77 no CUDA device visible (skipped, as automake and CTest's
// SKIP_RETURN_CODE read it).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "cache/device/cuda_device.h"
#include "cache/device/cuda_kernels.h"
#include "cache/device/device.h"
#include "cache/device/host_device.h"
#include "cache/spec.h"
#include "tests/testing/llama_spec.h"
#include "tests/testing/pattern.h"

namespace kvmesh {
namespace {

constexpr int kExitWrong = 1;
constexpr int kExitUsage = 2;
constexpr int kExitSkipped = 77;
constexpr int kWarmup = 3;
constexpr uint64_t kSeed = 0x6B766D657368ull;  // "kvmesh"
constexpr uint8_t kUntouched = 0x5A;           // fill of cells outside the row list
constexpr int32_t kRopeDelta = -100;

// A benchmark has nowhere to return an error to: report the call and stop.
[[noreturn]] void Fail(const std::string& what, const char* file, int line) {
  std::fprintf(stderr, "gpu_bench: %s at %s:%d\n", what.c_str(), file, line);
  std::exit(kExitWrong);
}

#define BENCH_CUDA(expr)                                                                  \
  do {                                                                                    \
    const cudaError_t bench_error_ = (expr);                                              \
    if (bench_error_ != cudaSuccess) {                                                    \
      Fail(std::string(#expr) + " failed: " + cudaGetErrorString(bench_error_), __FILE__, \
           __LINE__);                                                                     \
    }                                                                                     \
  } while (0)

#define BENCH_OK(expr)                                                                       \
  do {                                                                                       \
    const absl::Status bench_status_ = (expr);                                               \
    if (!bench_status_.ok()) {                                                               \
      Fail(std::string(#expr) + " failed: " + bench_status_.ToString(), __FILE__, __LINE__); \
    }                                                                                        \
  } while (0)

// Owners of the runtime objects this benchmark makes itself (timing events need timing
// enabled, which the device's own completion events do not have). All are destroyed before
// main returns: nothing CUDA has static lifetime.
struct DeviceFree {
  void operator()(void* p) const { cudaFree(p); }
};
struct PinnedFree {
  void operator()(void* p) const { cudaFreeHost(p); }
};
struct StreamDestroy {
  void operator()(cudaStream_t s) const { cudaStreamDestroy(s); }
};
template <typename T>
using DevicePtr = std::unique_ptr<T, DeviceFree>;
using PinnedPtr = std::unique_ptr<uint8_t, PinnedFree>;
using StreamPtr = std::unique_ptr<CUstream_st, StreamDestroy>;

template <typename T>
DevicePtr<T> DeviceAlloc(size_t count) {
  void* p = nullptr;
  BENCH_CUDA(cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T)));
  return DevicePtr<T>(static_cast<T*>(p));
}

PinnedPtr PinnedAlloc(size_t bytes) {
  void* p = nullptr;
  BENCH_CUDA(cudaMallocHost(&p, bytes));
  return PinnedPtr(static_cast<uint8_t*>(p));
}

// cudaMemcpy from pageable memory and cudaMemset may return before the device has finished, and
// the benchmark's own stream does not wait for the legacy default stream: both helpers wait.
template <typename T>
void Upload(T* dst, const std::vector<T>& src) {
  BENCH_CUDA(cudaMemcpy(dst, src.data(), src.size() * sizeof(T), cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaDeviceSynchronize());
}

void Fill(void* dst, uint8_t byte, size_t bytes) {
  BENCH_CUDA(cudaMemset(dst, byte, bytes));
  BENCH_CUDA(cudaDeviceSynchronize());
}

// The measured shape. Full size is one 4K-token Llama-3-8B sequence in a cache of 8K cells.
struct Shape {
  int32_t layers = 0;
  int32_t heads = 0;
  int32_t head_dim = 0;
  int32_t tokens = 0;  // rows moved per plane
  int32_t cells = 0;   // rows per plane of the cell table
  float rope_base = 0;

  int32_t planes() const { return 2 * layers; }  // K0 V0 K1 V1 ..., as AttentionGroup lays out
  size_t row_bytes() const { return size_t(heads) * head_dim * 2; }  // F16
  size_t payload_bytes() const { return size_t(planes()) * tokens * row_bytes(); }
  size_t k_bytes() const { return size_t(layers) * tokens * row_bytes(); }
  size_t table_plane_bytes() const { return size_t(cells) * row_bytes(); }
  size_t table_bytes() const { return size_t(planes()) * table_plane_bytes(); }
};

Shape MakeShape(bool quick) {
  const GroupSpec g = testutil::Llama3_8BSpec("bench", 1, 8192, 512).groups[0];
  Shape s;
  s.layers = quick ? 4 : g.num_layers;
  s.heads = g.attention.num_kv_heads;
  s.head_dim = g.attention.head_dim_k;
  s.tokens = quick ? 512 : 4096;
  s.cells = quick ? 1024 : 8192;
  s.rope_base = g.attention.rope.base;
  return s;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Median device time in microseconds of `iters` runs of `op`, each bracketed by its own pair of
// events. All runs are enqueued back to back before one synchronization, so the figure holds
// GPU time only, not host launch gaps.
double TimeOnStream(cudaStream_t stream, int iters, const std::function<absl::Status()>& op) {
  for (int i = 0; i < kWarmup; ++i) BENCH_OK(op());
  BENCH_CUDA(cudaStreamSynchronize(stream));
  std::vector<cudaEvent_t> start(iters), stop(iters);
  for (int i = 0; i < iters; ++i) {
    BENCH_CUDA(cudaEventCreate(&start[i]));
    BENCH_CUDA(cudaEventCreate(&stop[i]));
  }
  for (int i = 0; i < iters; ++i) {
    BENCH_CUDA(cudaEventRecord(start[i], stream));
    BENCH_OK(op());
    BENCH_CUDA(cudaEventRecord(stop[i], stream));
  }
  BENCH_CUDA(cudaStreamSynchronize(stream));
  std::vector<double> us(iters);
  for (int i = 0; i < iters; ++i) {
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, start[i], stop[i]));
    us[i] = 1e3 * ms;
    BENCH_CUDA(cudaEventDestroy(start[i]));
    BENCH_CUDA(cudaEventDestroy(stop[i]));
  }
  return Median(us);
}

// Median wall time in microseconds of `iters` runs of a synchronous `op`.
double TimeOnHost(int iters, const std::function<absl::Status()>& op) {
  for (int i = 0; i < kWarmup; ++i) BENCH_OK(op());
  std::vector<double> us(iters);
  for (int i = 0; i < iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    BENCH_OK(op());
    const auto t1 = std::chrono::steady_clock::now();
    us[i] = std::chrono::duration<double, std::micro>(t1 - t0).count();
  }
  return Median(us);
}

absl::Status CudaStatus(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(std::string(what) + ": " + cudaGetErrorString(e));
}

// A synchronous copy that has also landed when it returns (cudaMemcpy from pageable memory
// returns once the data is staged), as Device::Scatter's contract promises: compared like for
// like.
absl::Status CopyAndWait(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  absl::Status status = CudaStatus(cudaMemcpy(dst, src, bytes, kind), "cudaMemcpy");
  if (status.ok()) status = CudaStatus(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  return status;
}

// Bytes of got[0, n) that differ from want[0, n).
uint64_t CountWrong(const uint8_t* got, const uint8_t* want, size_t n) {
  constexpr size_t kChunk = 4096;
  uint64_t wrong = 0;
  for (size_t off = 0; off < n; off += kChunk) {
    const size_t len = std::min(kChunk, n - off);
    if (std::memcmp(got + off, want + off, len) == 0) continue;
    for (size_t i = 0; i < len; ++i) wrong += got[off + i] != want[off + i];
  }
  return wrong;
}

uint64_t CountNot(const uint8_t* got, uint8_t byte, size_t n) {
  uint64_t wrong = 0;
  for (size_t i = 0; i < n; ++i) wrong += got[i] != byte;
  return wrong;
}

// Checks a cell table read back from the device: for every plane p, cell rows[i] must equal
// expected(p, i) and every other cell must still hold kUntouched.
uint64_t CheckTable(const Shape& s, const std::vector<uint8_t>& table,
                    const std::vector<int32_t>& rows,
                    const std::function<const uint8_t*(int32_t plane, int32_t i)>& expected) {
  std::vector<int32_t> index_of(s.cells, -1);
  for (int32_t i = 0; i < s.tokens; ++i) index_of[rows[i]] = i;
  const size_t rb = s.row_bytes();
  uint64_t wrong = 0;
  for (int32_t p = 0; p < s.planes(); ++p) {
    const uint8_t* plane = table.data() + p * s.table_plane_bytes();
    for (int32_t c = 0; c < s.cells; ++c) {
      const uint8_t* row = plane + size_t(c) * rb;
      wrong += index_of[c] >= 0 ? CountWrong(row, expected(p, index_of[c]), rb)
                                : CountNot(row, kUntouched, rb);
    }
  }
  return wrong;
}

// cos/sin of each pair's angle, exactly as HostDevice::RopeShift computes them (double, then
// rounded to float), so the kernel and the host reference rotate by the same numbers.
void RopeTables(const RopeSpec& rope, int32_t delta, std::vector<float>* cos_table,
                std::vector<float>* sin_table) {
  const int32_t half = rope.dims / 2;
  cos_table->resize(half);
  sin_table->resize(half);
  for (int32_t i = 0; i < half; ++i) {
    const double theta = double(delta) * double(rope.freq_scale) *
                         std::pow(double(rope.base), -2.0 * i / double(rope.dims));
    (*cos_table)[i] = static_cast<float>(std::cos(theta));
    (*sin_table)[i] = static_cast<float>(std::sin(theta));
  }
}

RopeShiftParams RopeParams(const Shape& s, RopeType type) {
  RopeShiftParams p;
  p.rope.type = type;
  p.rope.dims = s.head_dim;
  p.rope.base = s.rope_base;
  p.rope.freq_scale = 1.0f;
  p.dtype = DType::kF16;
  p.num_heads = s.heads;
  p.head_dim = s.head_dim;
  p.delta = kRopeDelta;
  return p;
}

// The K planes of the source payload rotated by HostDevice (the engine's reference
// implementation): layer l's rows at [l * tokens * row_bytes, ...).
std::vector<uint8_t> HostRotatedKeys(const Shape& s, const std::vector<uint8_t>& src,
                                     RopeType type) {
  const size_t plane_bytes = size_t(s.tokens) * s.row_bytes();
  HostDevice host(s.k_bytes());
  absl::StatusOr<DeviceArena> arena = host.Allocate(s.k_bytes());
  BENCH_OK(arena.status());
  std::vector<Plane> planes;
  for (int32_t l = 0; l < s.layers; ++l) {
    std::memcpy(arena->data() + l * plane_bytes, src.data() + size_t(2 * l) * plane_bytes,
                plane_bytes);
    planes.push_back(Plane{l * plane_bytes, s.row_bytes()});
  }
  std::vector<int32_t> rows(s.tokens);
  std::iota(rows.begin(), rows.end(), 0);
  BENCH_OK(host.RopeShift(*arena, planes, rows, RopeParams(s, type)));
  return std::vector<uint8_t>(arena->data(), arena->data() + s.k_bytes());
}

struct Row {
  std::string op;
  size_t payload = 0;
  double us = 0;
  std::string ref;  // name of the reference row ("" for a reference itself)
  uint64_t wrong = 0;
};

// The result table. Each row is printed as soon as it is measured (nccl-tests style), so a
// crash or a timeout still leaves the rows before it; reference rows are measured first.
class Report {
 public:
  void PrintHeader() const {
    std::printf("#\n# %-30s %12s %11s %11s %11s %-20s %6s %8s\n", "operation", "payload(B)",
                "time(us)", "algbw(GB/s)", "rwbw(GB/s)", "ref", "vs", "wrong");
    std::fflush(stdout);
  }

  void Add(const Row& r) {
    char vs[16] = "-";
    for (const Row& ref : rows_) {
      if (!r.ref.empty() && ref.op == r.ref) {
        std::snprintf(vs, sizeof(vs), "%.2f", RwBw(r) / RwBw(ref));
      }
    }
    std::printf("  %-30s %12zu %11.1f %11.2f %11.2f %-20s %6s %8llu\n", r.op.c_str(), r.payload,
                r.us, r.payload / (r.us * 1e3), RwBw(r), r.ref.empty() ? "-" : r.ref.c_str(), vs,
                static_cast<unsigned long long>(r.wrong));
    std::fflush(stdout);
    rows_.push_back(r);
    wrong_ += r.wrong;
  }

  uint64_t wrong() const { return wrong_; }

 private:
  // Every row moves its payload once: read once and written once.
  static double RwBw(const Row& r) { return 2.0 * r.payload / (r.us * 1e3); }

  std::vector<Row> rows_;
  uint64_t wrong_ = 0;
};

void PrintDevice(int ordinal) {
  cudaDeviceProp prop;
  BENCH_CUDA(cudaGetDeviceProperties(&prop, ordinal));
  int driver = 0, runtime = 0;
  BENCH_CUDA(cudaDriverGetVersion(&driver));
  BENCH_CUDA(cudaRuntimeGetVersion(&runtime));
  std::printf("# device %d: %s, sm_%d%d, %d SMs, %.1f GiB, L2 %.0f MiB\n", ordinal, prop.name,
              prop.major, prop.minor, prop.multiProcessorCount,
              prop.totalGlobalMem / double(1 << 30), prop.l2CacheSize / double(1 << 20));
  std::printf("# CUDA driver %d.%d, runtime %d.%d\n", driver / 1000, (driver % 1000) / 10,
              runtime / 1000, (runtime % 1000) / 10);
}

int Run(int iters, bool quick) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    std::printf("gpu_bench: no CUDA device visible (%s); skipped\n",
                e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    (void)cudaGetLastError();
    return kExitSkipped;
  }
  const int ordinal = 0;
  BENCH_CUDA(cudaSetDevice(ordinal));
  const Shape s = MakeShape(quick);
  const size_t rb = s.row_bytes();
  const size_t payload = s.payload_bytes();
  const size_t src_plane = size_t(s.tokens) * rb;
  const size_t cell_plane = s.table_plane_bytes();

  std::printf(
      "# gpu_bench: %d layers x {K,V} x %d heads x %d dims F16 (%zu-byte rows, %d "
      "planes); %d tokens into %d cells in shuffled order%s\n",
      s.layers, s.heads, s.head_dim, rb, s.planes(), s.tokens, s.cells,
      quick ? " [--quick: smoke run, figures meaningless]" : "");
  PrintDevice(ordinal);
  std::printf(
      "# time: median of %d runs after %d warm-up; device rows timed by CUDA events on one "
      "stream, host rows by wall clock around synchronous calls\n",
      iters, kWarmup);
  std::printf(
      "# algbw = payload / time; rwbw = (bytes read + bytes written) / time for every row,"
      " memcpy included (host<->device rows: algbw is the PCIe rate); GB/s = 1e9 B/s\n");
  std::printf(
      "# vs = rwbw / rwbw of row `ref`; wrong = bytes differing from the expected result "
      "(checked on the host after the timed runs)\n");

  // Source pattern (pageable: also what Device::Scatter reads, as the engine passes it) and
  // the destination rows: the first `tokens` of a shuffled permutation of the cells.
  std::vector<uint8_t> src(payload);
  testutil::FillPattern(DType::kF16, kSeed, payload / 2, src.data());
  std::vector<int32_t> rows(s.cells);
  std::iota(rows.begin(), rows.end(), 0);
  std::shuffle(rows.begin(), rows.end(), std::mt19937_64(kSeed));
  rows.resize(s.tokens);

  StreamPtr stream_owner;
  {
    cudaStream_t st = nullptr;
    BENCH_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    stream_owner.reset(st);
  }
  cudaStream_t stream = stream_owner.get();

  DevicePtr<uint8_t> d_src = DeviceAlloc<uint8_t>(payload);
  DevicePtr<uint8_t> d_dst = DeviceAlloc<uint8_t>(payload);
  DevicePtr<uint8_t> d_table = DeviceAlloc<uint8_t>(s.table_bytes());
  DevicePtr<int32_t> d_rows = DeviceAlloc<int32_t>(rows.size());
  Upload(d_src.get(), src);
  Upload(d_rows.get(), rows);

  std::vector<cuda::CopyPlane> scatter_planes, gather_planes;
  std::vector<uint8_t*> k_planes;
  for (int32_t p = 0; p < s.planes(); ++p) {
    uint8_t* cells = d_table.get() + p * cell_plane;
    scatter_planes.push_back({d_src.get() + p * src_plane, cells, rb});
    gather_planes.push_back({cells, d_dst.get() + p * src_plane, rb});
    if (p % 2 == 0) k_planes.push_back(cells);
  }
  DevicePtr<cuda::CopyPlane> d_scatter_planes = DeviceAlloc<cuda::CopyPlane>(s.planes());
  DevicePtr<cuda::CopyPlane> d_gather_planes = DeviceAlloc<cuda::CopyPlane>(s.planes());
  DevicePtr<uint8_t*> d_k_planes = DeviceAlloc<uint8_t*>(k_planes.size());
  Upload(d_scatter_planes.get(), scatter_planes);
  Upload(d_gather_planes.get(), gather_planes);
  Upload(d_k_planes.get(), k_planes);

  auto scatter = [&] {
    return cuda::LaunchCopyRows(d_scatter_planes.get(), s.planes(), nullptr, d_rows.get(), s.tokens,
                                stream);
  };
  auto gather = [&] {
    return cuda::LaunchCopyRows(d_gather_planes.get(), s.planes(), d_rows.get(), nullptr, s.tokens,
                                stream);
  };
  auto reset_table = [&] {
    BENCH_CUDA(cudaMemsetAsync(d_table.get(), kUntouched, s.table_bytes(), stream));
    BENCH_OK(scatter());
    BENCH_CUDA(cudaStreamSynchronize(stream));
  };
  std::vector<uint8_t> table(s.table_bytes());
  auto read_table = [&] {
    BENCH_CUDA(cudaMemcpy(table.data(), d_table.get(), table.size(), cudaMemcpyDeviceToHost));
  };
  std::vector<uint8_t> out(payload);
  auto read_dst = [&](size_t bytes) {
    BENCH_CUDA(cudaMemcpy(out.data(), d_dst.get(), bytes, cudaMemcpyDeviceToHost));
  };
  auto from_src = [&](int32_t p, int32_t i) { return src.data() + p * src_plane + size_t(i) * rb; };

  Report report;
  report.PrintHeader();
  const std::string kMemcpyFull = "memcpy D2D";
  const std::string kMemcpyKeys = "memcpy D2D (K bytes)";

  // (a) scatter and (b) gather, after the copy they are measured against.
  Fill(d_dst.get(), 0, payload);
  Row row{kMemcpyFull, payload, TimeOnStream(stream, iters, [&] {
            return CudaStatus(cudaMemcpyAsync(d_dst.get(), d_src.get(), payload,
                                              cudaMemcpyDeviceToDevice, stream),
                              "cudaMemcpyAsync");
          })};
  read_dst(payload);
  row.wrong = CountWrong(out.data(), src.data(), payload);
  report.Add(row);

  Fill(d_table.get(), kUntouched, s.table_bytes());
  row = Row{"scatter LaunchCopyRows", payload, TimeOnStream(stream, iters, scatter), kMemcpyFull};
  read_table();
  row.wrong = CheckTable(s, table, rows, from_src);
  report.Add(row);

  Fill(d_dst.get(), 0, payload);
  row = Row{"gather LaunchCopyRows", payload, TimeOnStream(stream, iters, gather), kMemcpyFull};
  read_dst(payload);
  row.wrong = CountWrong(out.data(), src.data(), payload);
  report.Add(row);

  // The copy the RoPE shifts are measured against: as many bytes as the K planes.
  Fill(d_dst.get(), 0, payload);
  row = Row{kMemcpyKeys, s.k_bytes(), TimeOnStream(stream, iters, [&] {
              return CudaStatus(cudaMemcpyAsync(d_dst.get(), d_src.get(), s.k_bytes(),
                                                cudaMemcpyDeviceToDevice, stream),
                                "cudaMemcpyAsync");
            })};
  read_dst(s.k_bytes());
  row.wrong = CountWrong(out.data(), src.data(), s.k_bytes());
  report.Add(row);

  // (c) RoPE shift of the K planes in place. The timed runs keep rotating the same rows (values
  // stay finite: a rotation keeps their norm); the check starts again from the source.
  std::vector<float> cos_table, sin_table;
  RopeTables(RopeParams(s, RopeType::kNeox).rope, kRopeDelta, &cos_table, &sin_table);
  DevicePtr<float> d_cos = DeviceAlloc<float>(cos_table.size());
  DevicePtr<float> d_sin = DeviceAlloc<float>(sin_table.size());
  Upload(d_cos.get(), cos_table);
  Upload(d_sin.get(), sin_table);
  for (RopeType type : {RopeType::kNormal, RopeType::kNeox}) {
    auto rope = [&] {
      return cuda::LaunchRopeShift(d_k_planes.get(), s.layers, rb, d_rows.get(), s.tokens,
                                   cuda::RopeDType::kF16, s.heads, s.head_dim, s.head_dim,
                                   type == RopeType::kNeox, d_cos.get(), d_sin.get(), stream);
    };
    reset_table();
    row = Row{type == RopeType::kNeox ? "rope NEOX LaunchRopeShift" : "rope NORMAL LaunchRopeShift",
              s.k_bytes(), TimeOnStream(stream, iters, rope), kMemcpyKeys};
    reset_table();
    BENCH_OK(rope());
    BENCH_CUDA(cudaStreamSynchronize(stream));
    read_table();
    const std::vector<uint8_t> keys = HostRotatedKeys(s, src, type);
    row.wrong = CheckTable(s, table, rows, [&](int32_t p, int32_t i) {
      return p % 2 == 1 ? from_src(p, i) : keys.data() + (p / 2) * src_plane + size_t(i) * rb;
    });
    report.Add(row);
  }

  // (d) Through the Device interface from host memory, against plain copies over PCIe.
  const std::string kH2D = "memcpy H2D pinned";
  const std::string kD2H = "memcpy D2H pinned";
  PinnedPtr pinned = PinnedAlloc(payload);
  std::memcpy(pinned.get(), src.data(), payload);
  row = Row{kH2D, payload, TimeOnHost(iters, [&] {
              return CopyAndWait(d_dst.get(), pinned.get(), payload, cudaMemcpyHostToDevice);
            })};
  read_dst(payload);
  row.wrong = CountWrong(out.data(), src.data(), payload);
  report.Add(row);

  row = Row{
      "memcpy H2D pageable", payload,
      TimeOnHost(
          iters,
          [&] { return CopyAndWait(d_dst.get(), src.data(), payload, cudaMemcpyHostToDevice); }),
      kH2D};
  read_dst(payload);
  row.wrong = CountWrong(out.data(), src.data(), payload);
  report.Add(row);

  std::memset(pinned.get(), 0, payload);
  row = Row{kD2H, payload, TimeOnHost(iters, [&] {
              return CopyAndWait(pinned.get(), d_src.get(), payload, cudaMemcpyDeviceToHost);
            })};
  row.wrong = CountWrong(pinned.get(), src.data(), payload);
  report.Add(row);
  pinned.reset();

  {
    CudaDeviceOptions options;
    options.ordinal = ordinal;
    options.budget_bytes = s.table_bytes();
    options.snapshot_budget_bytes = size_t{16} << 20;
    absl::StatusOr<std::unique_ptr<Device>> device = CreateCudaDevice(options);
    BENCH_OK(device.status());
    {
      absl::StatusOr<std::shared_ptr<DeviceStream>> device_stream = (*device)->CreateStream();
      BENCH_OK(device_stream.status());
      absl::StatusOr<DeviceArena> arena =
          (*device)->Allocate(s.table_bytes(), MemoryPool::kCache, *device_stream);
      BENCH_OK(arena.status());
      std::vector<Plane> planes;
      for (int32_t p = 0; p < s.planes(); ++p) planes.push_back(Plane{p * cell_plane, rb});
      // The benchmark knows a CudaDevice arena is plain device memory: it fills and reads it
      // back directly to check Scatter by itself.
      Fill(arena->data(), kUntouched, s.table_bytes());
      row = Row{
          "Device::Scatter host->cells", payload,
          TimeOnHost(iters, [&] { return (*device)->Scatter(*arena, planes, rows, src.data()); }),
          kH2D};
      BENCH_CUDA(cudaMemcpy(table.data(), arena->data(), table.size(), cudaMemcpyDeviceToHost));
      row.wrong = CheckTable(s, table, rows, from_src);
      report.Add(row);

      std::fill(out.begin(), out.end(), 0);
      row = Row{
          "Device::Gather cells->host", payload,
          TimeOnHost(iters, [&] { return (*device)->Gather(*arena, planes, rows, out.data()); }),
          kD2H};
      row.wrong = CountWrong(out.data(), src.data(), payload);
      report.Add(row);
    }  // arena and stream go before the device
  }

  const uint64_t wrong = report.wrong();
  std::printf("#\n# %s: %llu wrong bytes in all\n", wrong == 0 ? "OK" : "FAILED",
              static_cast<unsigned long long>(wrong));
  return wrong == 0 ? 0 : kExitWrong;
}

int Usage(const char* argv0) {
  std::fprintf(stderr, "usage: %s [--iters N] [--quick]\n", argv0);
  return kExitUsage;
}

}  // namespace
}  // namespace kvmesh

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // rows show up in a piped log as they are measured
  int iters = 20;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--quick") {
      quick = true;
    } else if (arg == "--iters" && i + 1 < argc) {
      char* end = nullptr;
      const long n = std::strtol(argv[++i], &end, 10);
      if (*end != '\0' || n < 1 || n > 100000) return kvmesh::Usage(argv[0]);
      iters = static_cast<int>(n);
    } else {
      return kvmesh::Usage(argv[0]);
    }
  }
  return kvmesh::Run(iters, quick);
}

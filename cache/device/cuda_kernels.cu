// Kernels behind cuda_kernels.h. Both are memory-bound, so every choice below is about keeping
// enough bytes in flight to saturate HBM while touching each byte once:
//
// - One warp per work item (a (plane, row) pair, or a slice of one): rows of a KV plane are a
//   few KiB, which one warp covers with a handful of 16-byte accesses per lane, and a warp needs
//   no block-wide synchronization, so items of different planes and row sizes can share a block.
// - Vector width is chosen per item in the kernel, because the plane table lives in device
//   memory and the host cannot see the addresses: 16-byte accesses when source, destination and
//   row size allow it, else the widest of 8, 4, 2 and 1 bytes that does.
// - Each lane issues kCopyUnroll loads before its first store, so a warp has 2 KiB in flight.
// - Rows can be MiB long (recurrent state). The host cannot see row sizes either, so it splits
//   every item into as many slices as needed for the grid to cover the whole device at least once
//   when there are few items; slice s of an item copies its 2 KiB chunks s, s + slices, ... so
//   neighbouring warps still stream neighbouring bytes. With many items there is one slice per
//   item and no split is needed: the items alone fill the device.
// - RoPE rotates in place with the separately rounded float32 operations of HostDevice
//   (__fmul_rn and friends keep nvcc from contracting them into FMAs), so results match the host
//   bit for bit. It loads 16-byte vectors holding whole pairs (NORMAL) or the two matching
//   vectors of both halves (NEOX) where the shape allows, else one pair at a time.
#include "cache/device/cuda_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "cache/device/cuda_check.h"
#include "cache/status_macros.h"

// Launches `kernel` (which may be a template-id with commas, hence last) on `stream`. nvcc's
// <<<>>> unless the includer defined it: the simulated GPU of the tests compiles this file as
// host C++ with its own launcher (docs/cuda.md, "The simulated GPU").
#ifndef KVMESH_LAUNCH
#define KVMESH_LAUNCH(grid, block, shared, stream, ...) __VA_ARGS__<<<grid, block, shared, stream>>>
#endif

namespace kvmesh {
namespace cuda {
namespace {

constexpr int kWarpSize = 32;
constexpr int kBlockThreads = 256;
constexpr int kWarpsPerBlock = kBlockThreads / kWarpSize;
// Loads each lane keeps in flight before storing: 32 lanes x 4 x 16 bytes = 2 KiB per warp, one
// whole K or V row of a typical model (8 heads x 128 dims x 2 bytes).
constexpr int kCopyUnroll = 4;
// 16-byte vectors each lane of the RoPE kernel loads per round, for the same 2 KiB per warp.
constexpr int kRopeLoads = 4;
// Blocks per SM the kernels are compiled for: 32 warps of at most 64 registers, which keep
// 64 KiB per SM in flight (more than HBM needs) with no spills; asking for more spills.
constexpr int kMinBlocksPerSm = 4;
// Grid-stride kernels are launched with at most this many device-fulls of blocks; more work
// loops inside the kernel instead of growing the grid without bound.
constexpr uint64_t kMaxWaves = 32;

uint64_t CeilDiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

// ---- Row copy --------------------------------------------------------------------------------

// Copies the chunks slice, slice + slices, ... of kWarpSize * kCopyUnroll elements of type Vec
// of a row. REQUIRES: src, dst and bytes are multiples of sizeof(Vec).
template <typename Vec>
__device__ __forceinline__ void CopySlice(const uint8_t* __restrict__ src,
                                          uint8_t* __restrict__ dst, uint64_t bytes, uint64_t slice,
                                          uint64_t slices, unsigned lane) {
  constexpr uint64_t kChunk = kWarpSize * kCopyUnroll;
  const uint64_t n = bytes / sizeof(Vec);
  for (uint64_t first = slice * kChunk + lane; first < n; first += slices * kChunk) {
    const Vec* __restrict__ from = reinterpret_cast<const Vec*>(src) + first;
    Vec* __restrict__ to = reinterpret_cast<Vec*>(dst) + first;
    const uint64_t left = n - first;
    Vec v[kCopyUnroll];
#pragma unroll
    for (int k = 0; k < kCopyUnroll; ++k) {
      if (uint64_t(k) * kWarpSize < left) v[k] = __ldg(from + k * kWarpSize);
    }
#pragma unroll
    for (int k = 0; k < kCopyUnroll; ++k) {
      if (uint64_t(k) * kWarpSize < left) to[k * kWarpSize] = v[k];
    }
  }
}

// Work unit u (one per warp, grid-stride) is slice u % slices of item u / slices; item j is row
// j % num_rows of plane j / num_rows, so consecutive warps walk consecutive rows of a plane.
__global__ void __launch_bounds__(kBlockThreads, kMinBlocksPerSm)
    CopyRowsKernel(const CopyPlane* __restrict__ planes, const int32_t* __restrict__ src_rows,
                   const int32_t* __restrict__ dst_rows, uint64_t num_rows, uint64_t slices,
                   uint64_t num_units) {
  const unsigned lane = threadIdx.x % kWarpSize;
  const uint64_t stride = uint64_t(gridDim.x) * kWarpsPerBlock;
  for (uint64_t unit = uint64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
       unit < num_units; unit += stride) {
    const uint64_t item = slices == 1 ? unit : unit / slices;
    const uint64_t slice = unit - item * slices;
    const uint64_t p = item / num_rows;
    const uint64_t i = item - p * num_rows;
    const int32_t src_row = src_rows != nullptr ? __ldg(src_rows + i) : int32_t(i);
    const int32_t dst_row = dst_rows != nullptr ? __ldg(dst_rows + i) : int32_t(i);
    if (src_row < 0 || dst_row < 0) continue;
    const CopyPlane plane = planes[p];
    const uint8_t* src = plane.src + uint64_t(src_row) * plane.row_bytes;
    uint8_t* dst = plane.dst + uint64_t(dst_row) * plane.row_bytes;
    // The same for every lane of the warp, so the branches below do not diverge.
    const uint64_t align =
        reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) | plane.row_bytes;
    if (align % 16 == 0) {
      CopySlice<uint4>(src, dst, plane.row_bytes, slice, slices, lane);
    } else if (align % 8 == 0) {
      CopySlice<uint2>(src, dst, plane.row_bytes, slice, slices, lane);
    } else if (align % 4 == 0) {
      CopySlice<uint32_t>(src, dst, plane.row_bytes, slice, slices, lane);
    } else if (align % 2 == 0) {
      CopySlice<uint16_t>(src, dst, plane.row_bytes, slice, slices, lane);
    } else {
      CopySlice<uint8_t>(src, dst, plane.row_bytes, slice, slices, lane);
    }
  }
}

// ---- RoPE shift ------------------------------------------------------------------------------

template <typename To, typename From>
__device__ __forceinline__ To BitCast(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "BitCast between types of different sizes");
  To to;
  memcpy(&to, &from, sizeof(To));
  return to;
}

// Element types: conversions of one element's bits and of a 16-byte vector, all with the
// round-to-nearest-even conversions HostDevice uses.
struct F32 {
  using Bits = uint32_t;
  static constexpr int kBytes = 4;
  __device__ static float ToFloat(Bits b) { return __uint_as_float(b); }
  __device__ static Bits FromFloat(float f) { return __float_as_uint(f); }
  __device__ static void Unpack(const uint4& v, float* f) {
    f[0] = __uint_as_float(v.x);
    f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z);
    f[3] = __uint_as_float(v.w);
  }
  __device__ static uint4 Pack(const float* f) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                      __float_as_uint(f[3]));
  }
};

// Conversions of the 16-bit types, overloaded so that one template serves both.
__device__ __forceinline__ float2 ToFloat2(__half2 h) { return __half22float2(h); }
__device__ __forceinline__ float2 ToFloat2(__nv_bfloat162 h) { return __bfloat1622float2(h); }
__device__ __forceinline__ void FromFloats(float a, float b, __half2* h) {
  *h = __floats2half2_rn(a, b);
}
__device__ __forceinline__ void FromFloats(float a, float b, __nv_bfloat162* h) {
  *h = __floats2bfloat162_rn(a, b);
}
__device__ __forceinline__ void FromBits(uint16_t b, __half* h) { *h = __ushort_as_half(b); }
__device__ __forceinline__ void FromBits(uint16_t b, __nv_bfloat16* h) {
  *h = __ushort_as_bfloat16(b);
}
__device__ __forceinline__ float ToFloat(__half h) { return __half2float(h); }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 h) { return __bfloat162float(h); }
__device__ __forceinline__ uint16_t BitsOf(__half h) { return __half_as_ushort(h); }
__device__ __forceinline__ uint16_t BitsOf(__nv_bfloat16 h) { return __bfloat16_as_ushort(h); }
__device__ __forceinline__ void Narrow(float f, __half* h) { *h = __float2half_rn(f); }
__device__ __forceinline__ void Narrow(float f, __nv_bfloat16* h) { *h = __float2bfloat16_rn(f); }

template <typename Scalar, typename Pair>
struct Half16 {
  using Bits = uint16_t;
  static constexpr int kBytes = 2;
  __device__ static float ToFloat(Bits b) {
    Scalar h;
    FromBits(b, &h);
    return ::kvmesh::cuda::ToFloat(h);
  }
  __device__ static Bits FromFloat(float f) {
    Scalar h;
    Narrow(f, &h);
    return BitsOf(h);
  }
  __device__ static void Unpack(const uint4& v, float* f) {
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float2 pair = ToFloat2(BitCast<Pair>(words[w]));
      f[2 * w] = pair.x;
      f[2 * w + 1] = pair.y;
    }
  }
  __device__ static uint4 Pack(const float* f) {
    uint32_t words[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      Pair pair;
      FromFloats(f[2 * w], f[2 * w + 1], &pair);
      words[w] = BitCast<uint32_t>(pair);
    }
    return make_uint4(words[0], words[1], words[2], words[3]);
  }
};

using F16 = Half16<__half, __half2>;
using BF16 = Half16<__nv_bfloat16, __nv_bfloat162>;

// y0 = x0*c - x1*s, y1 = x0*s + x1*c, each operation rounded on its own as on the host.
__device__ __forceinline__ void Rotate(float x0, float x1, float c, float s, float* y0, float* y1) {
  *y0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
  *y1 = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
}

// Loads table[0, N). REQUIRES: table is 16-byte aligned when N % 4 == 0, 8-byte when N is even.
template <int N>
__device__ __forceinline__ void LoadTable(const float* __restrict__ table, float* out) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int k = 0; k < N; k += 4) {
      const float4 v = __ldg(reinterpret_cast<const float4*>(table + k));
      out[k] = v.x;
      out[k + 1] = v.y;
      out[k + 2] = v.z;
      out[k + 3] = v.w;
    }
  } else {
    static_assert(N % 2 == 0, "tables are loaded in float2 at least");
#pragma unroll
    for (int k = 0; k < N; k += 2) {
      const float2 v = __ldg(reinterpret_cast<const float2*>(table + k));
      out[k] = v.x;
      out[k + 1] = v.y;
    }
  }
}

// Shape of one RoPE launch, the same for every row.
struct RopeShape {
  uint32_t head_bytes;  // head_dim * element size
  int32_t num_heads;
  int32_t dims;
};

// Rotates one row with 16-byte vectors. A unit is one vector of kV elements: kV/2 adjacent pairs
// (NORMAL), or kV pairs whose second elements are the vector dims/2 elements further (NEOX).
// REQUIRES: row, head_bytes, cos and sin 16-byte aligned; kV divides dims (NORMAL) or dims/2
// (NEOX).
template <typename E, bool kNeox>
__device__ __forceinline__ void RotateRowVector(uint8_t* row, const RopeShape& shape,
                                                const float* __restrict__ cos,
                                                const float* __restrict__ sin, unsigned lane) {
  constexpr int kV = 16 / E::kBytes;
  constexpr int kPairs = kNeox ? kV : kV / 2;
  constexpr int kRopeUnroll = kNeox ? kRopeLoads / 2 : kRopeLoads;  // NEOX loads two per unit
  const int half = shape.dims / 2;
  const int units_per_head = kNeox ? half / kV : shape.dims / kV;
  const int units = shape.num_heads * units_per_head;
  const uint32_t hi_offset = uint32_t(half) * E::kBytes;
  for (int first = lane; first < units; first += kWarpSize * kRopeUnroll) {
    uint4 lo[kRopeUnroll], hi[kRopeUnroll];
    uint32_t at[kRopeUnroll];  // byte offset in the row: the host checked the heads fit 32 bits
    int pair0[kRopeUnroll];
    // All loads of the round before any store: the stores may alias them as far as the compiler
    // knows, so it would not hoist later loads above earlier stores by itself.
#pragma unroll
    for (int k = 0; k < kRopeUnroll; ++k) {
      const int u = first + k * kWarpSize;
      if (u >= units) continue;
      const int head = u / units_per_head;
      const int j = u - head * units_per_head;
      at[k] = uint32_t(head) * shape.head_bytes + uint32_t(j) * 16;
      pair0[k] = j * kPairs;
      lo[k] = *reinterpret_cast<const uint4*>(row + at[k]);
      if constexpr (kNeox) hi[k] = *reinterpret_cast<const uint4*>(row + at[k] + hi_offset);
    }
#pragma unroll
    for (int k = 0; k < kRopeUnroll; ++k) {
      const int u = first + k * kWarpSize;
      if (u >= units) continue;
      float c[kPairs], s[kPairs];
      LoadTable<kPairs>(cos + pair0[k], c);
      LoadTable<kPairs>(sin + pair0[k], s);
      float x[kV];
      E::Unpack(lo[k], x);
      if constexpr (kNeox) {
        float y[kV];
        E::Unpack(hi[k], y);
#pragma unroll
        for (int q = 0; q < kPairs; ++q) Rotate(x[q], y[q], c[q], s[q], &x[q], &y[q]);
        *reinterpret_cast<uint4*>(row + at[k] + hi_offset) = E::Pack(y);
      } else {
#pragma unroll
        for (int q = 0; q < kPairs; ++q) {
          Rotate(x[2 * q], x[2 * q + 1], c[q], s[q], &x[2 * q], &x[2 * q + 1]);
        }
      }
      *reinterpret_cast<uint4*>(row + at[k]) = E::Pack(x);
    }
  }
}

// One element's bits at p; byte by byte unless kAligned (p a multiple of the element size).
template <typename E, bool kAligned>
__device__ __forceinline__ typename E::Bits LoadBits(const uint8_t* p) {
  typename E::Bits b;
  if constexpr (kAligned) {
    b = *reinterpret_cast<const typename E::Bits*>(p);
  } else {
    memcpy(&b, p, sizeof(b));
  }
  return b;
}

template <typename E, bool kAligned>
__device__ __forceinline__ void StoreBits(uint8_t* p, typename E::Bits b) {
  if constexpr (kAligned) {
    *reinterpret_cast<typename E::Bits*>(p) = b;
  } else {
    memcpy(p, &b, sizeof(b));
  }
}

// Rotates one row a pair at a time: any even dims, any row address.
template <typename E, bool kNeox, bool kAligned>
__device__ __forceinline__ void RotateRowScalar(uint8_t* row, const RopeShape& shape,
                                                const float* __restrict__ cos,
                                                const float* __restrict__ sin, unsigned lane) {
  const int half = shape.dims / 2;
  const int pairs = shape.num_heads * half;
  for (int u = lane; u < pairs; u += kWarpSize) {
    const int head = u / half;
    const int i = u - head * half;
    uint8_t* x = row + uint64_t(head) * shape.head_bytes;
    uint8_t* p0 = x + uint64_t(kNeox ? i : 2 * i) * E::kBytes;
    uint8_t* p1 = x + uint64_t(kNeox ? i + half : 2 * i + 1) * E::kBytes;
    float y0, y1;
    Rotate(E::ToFloat(LoadBits<E, kAligned>(p0)), E::ToFloat(LoadBits<E, kAligned>(p1)),
           __ldg(cos + i), __ldg(sin + i), &y0, &y1);
    StoreBits<E, kAligned>(p0, E::FromFloat(y0));
    StoreBits<E, kAligned>(p1, E::FromFloat(y1));
  }
}

// One warp per item (grid-stride); item j is row rows[j % num_rows] of plane j / num_rows.
// `vector_ok` says the host found the shape, row size and tables fit for RotateRowVector; the
// plane's base alignment, which the host cannot see, is checked here. Rows that are not even
// element-aligned (HostDevice accepts any row size) go byte by byte.
template <typename E, bool kNeox>
__global__ void __launch_bounds__(kBlockThreads, kMinBlocksPerSm)
    RopeShiftKernel(uint8_t* const* __restrict__ planes, uint64_t row_bytes,
                    const int32_t* __restrict__ rows, uint64_t num_rows, uint64_t num_items,
                    RopeShape shape, bool vector_ok, const float* __restrict__ cos,
                    const float* __restrict__ sin) {
  const unsigned lane = threadIdx.x % kWarpSize;
  const uint64_t stride = uint64_t(gridDim.x) * kWarpsPerBlock;
  for (uint64_t item = uint64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
       item < num_items; item += stride) {
    const uint64_t p = item / num_rows;
    const int32_t r = __ldg(rows + (item - p * num_rows));
    if (r < 0) continue;
    uint8_t* base = planes[p];
    uint8_t* row = base + uint64_t(r) * row_bytes;
    const uintptr_t align = reinterpret_cast<uintptr_t>(base) | row_bytes;
    if (vector_ok && align % 16 == 0) {
      RotateRowVector<E, kNeox>(row, shape, cos, sin, lane);
    } else if (align % E::kBytes == 0) {
      RotateRowScalar<E, kNeox, true>(row, shape, cos, sin, lane);
    } else {
      RotateRowScalar<E, kNeox, false>(row, shape, cos, sin, lane);
    }
  }
}

// ---- Host side -------------------------------------------------------------------------------

// Warps the current device holds at once: the parallelism a launch must reach to saturate it.
absl::StatusOr<uint64_t> ResidentWarps() {
  int device = 0, sms = 0, threads_per_sm = 0;
  KVMESH_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  KVMESH_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  KVMESH_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&threads_per_sm, cudaDevAttrMaxThreadsPerMultiProcessor, device));
  return std::max<uint64_t>(1, uint64_t(sms) * uint64_t(threads_per_sm / kWarpSize));
}

// Blocks for `warps` warps of work, capped at kMaxWaves device-fulls (the kernels grid-stride),
// which also keeps the count far below gridDim.x's limit of 2^31 - 1.
unsigned GridBlocks(uint64_t warps, uint64_t resident_warps) {
  const uint64_t max_blocks = std::max<uint64_t>(1, resident_warps / kWarpsPerBlock) * kMaxWaves;
  return static_cast<unsigned>(std::min(CeilDiv(warps, kWarpsPerBlock), max_blocks));
}

// The launch status of `kernel`. cudaGetLastError also clears a launch error, so it is not
// reported again by an unrelated later call.
absl::Status LaunchStatus(const char* kernel) {
  const cudaError_t error = cudaGetLastError();
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("launch of ", kernel,
                                          " failed: ", cudaGetErrorName(error), " (",
                                          cudaGetErrorString(error), ")"));
}

template <typename E, bool kNeox>
absl::Status LaunchRope(uint8_t* const* planes, int32_t num_planes, uint64_t row_bytes,
                        const int32_t* rows, int32_t num_rows, const RopeShape& shape,
                        const float* cos, const float* sin, cudaStream_t stream) {
  constexpr int kV = 16 / E::kBytes;
  const int32_t vector_dims = kNeox ? shape.dims / 2 : shape.dims;
  const bool vector_ok = vector_dims % kV == 0 && shape.head_bytes % 16 == 0 &&
                         row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(cos) % 16 == 0 &&
                         reinterpret_cast<uintptr_t>(sin) % 16 == 0;
  ASSIGN_OR_RETURN(const uint64_t resident_warps, ResidentWarps());
  const uint64_t items = uint64_t(num_planes) * uint64_t(num_rows);
  KVMESH_LAUNCH(GridBlocks(items, resident_warps), kBlockThreads, 0, stream,
                RopeShiftKernel<E, kNeox>)(planes, row_bytes, rows, uint64_t(num_rows), items,
                                           shape, vector_ok, cos, sin);
  return LaunchStatus("RopeShiftKernel");
}

}  // namespace

absl::Status LaunchCopyRows(const CopyPlane* planes, int32_t num_planes, const int32_t* src_rows,
                            const int32_t* dst_rows, int32_t num_rows, cudaStream_t stream) {
  if (num_planes < 0 || num_rows < 0) {
    return absl::InvalidArgumentError(absl::StrCat("LaunchCopyRows: negative count (", num_planes,
                                                   " planes, ", num_rows, " rows)"));
  }
  if (num_planes == 0 || num_rows == 0) return absl::OkStatus();
  if (planes == nullptr) return absl::InvalidArgumentError("LaunchCopyRows: null plane table");
  ASSIGN_OR_RETURN(const uint64_t resident_warps, ResidentWarps());
  const uint64_t items = uint64_t(num_planes) * uint64_t(num_rows);
  // Few items: split each so that the device is still covered once (see the top comment).
  const uint64_t slices = items >= resident_warps ? 1 : CeilDiv(resident_warps, items);
  const uint64_t units = items * slices;
  KVMESH_LAUNCH(GridBlocks(units, resident_warps), kBlockThreads, 0, stream, CopyRowsKernel)(
      planes, src_rows, dst_rows, uint64_t(num_rows), slices, units);
  return LaunchStatus("CopyRowsKernel");
}

absl::Status LaunchRopeShift(uint8_t* const* planes, int32_t num_planes, uint64_t row_bytes,
                             const int32_t* rows, int32_t num_rows, RopeDType dtype,
                             int32_t num_heads, int32_t head_dim, int32_t dims, bool neox,
                             const float* cos, const float* sin, cudaStream_t stream) {
  int elem_bytes = 0;
  switch (dtype) {
    case RopeDType::kF32:
      elem_bytes = 4;
      break;
    case RopeDType::kF16:
    case RopeDType::kBF16:
      elem_bytes = 2;
      break;
  }
  if (elem_bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("LaunchRopeShift: unknown dtype ", static_cast<int32_t>(dtype)));
  }
  if (dims <= 0 || dims % 2 != 0 || dims > head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "LaunchRopeShift: dims ", dims, " must be even, positive and at most head_dim ", head_dim));
  }
  if (num_planes < 0 || num_rows < 0 || num_heads < 0) {
    return absl::InvalidArgumentError(absl::StrCat("LaunchRopeShift: negative count (", num_planes,
                                                   " planes, ", num_rows, " rows, ", num_heads,
                                                   " heads)"));
  }
  // Heads must fit in a row; the kernel addresses them with 32-bit offsets.
  const uint64_t head_bytes = uint64_t(head_dim) * uint64_t(elem_bytes);
  const uint64_t heads_bytes = uint64_t(num_heads) * head_bytes;
  if (heads_bytes > row_bytes || heads_bytes > UINT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(
        "LaunchRopeShift: ", num_heads, " heads of ", head_dim, " elements of ", elem_bytes,
        " bytes do not fit a row of ", row_bytes, " bytes (or exceed 4 GiB)"));
  }
  if (num_planes == 0 || num_rows == 0 || num_heads == 0) return absl::OkStatus();
  if (planes == nullptr || rows == nullptr || cos == nullptr || sin == nullptr) {
    return absl::InvalidArgumentError("LaunchRopeShift: null plane table, row list or table");
  }
  const RopeShape shape{uint32_t(head_bytes), num_heads, dims};
  switch (dtype) {
    case RopeDType::kF32:
      return neox ? LaunchRope<F32, true>(planes, num_planes, row_bytes, rows, num_rows, shape, cos,
                                          sin, stream)
                  : LaunchRope<F32, false>(planes, num_planes, row_bytes, rows, num_rows, shape,
                                           cos, sin, stream);
    case RopeDType::kF16:
      return neox ? LaunchRope<F16, true>(planes, num_planes, row_bytes, rows, num_rows, shape, cos,
                                          sin, stream)
                  : LaunchRope<F16, false>(planes, num_planes, row_bytes, rows, num_rows, shape,
                                           cos, sin, stream);
    case RopeDType::kBF16:
      return neox ? LaunchRope<BF16, true>(planes, num_planes, row_bytes, rows, num_rows, shape,
                                           cos, sin, stream)
                  : LaunchRope<BF16, false>(planes, num_planes, row_bytes, rows, num_rows, shape,
                                            cos, sin, stream);
  }
  return absl::OkStatus();  // Unreachable: dtype was checked above.
}

}  // namespace cuda
}  // namespace kvmesh

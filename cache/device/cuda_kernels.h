// Launchers for the CUDA kernels of CudaDevice. Plain C++ declarations so that only
// cuda_kernels.cu is compiled by nvcc; each launcher enqueues its kernel on `stream` and returns
// the launch status (errors of the kernel itself surface at the next synchronization).
//
// Every pointer below is a device pointer unless it says otherwise. The kernels are bound by
// memory bandwidth by design: one warp per (row, plane) item, 16-byte vector accesses when the
// addresses and the row size allow it, and no more than one read and one write of each byte.
//
// Thread safety: launchers are thread-safe; the data they touch is the caller's to protect.
#ifndef KVMESH_CACHE_DEVICE_CUDA_KERNELS_H_
#define KVMESH_CACHE_DEVICE_CUDA_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"

namespace kvmesh {
namespace cuda {

// One plane of a row copy: row r of the source plane starts at src + r * row_bytes, row r of the
// destination plane at dst + r * row_bytes.
struct CopyPlane {
  const uint8_t* src;
  uint8_t* dst;
  uint64_t row_bytes;
};

// For every plane p in planes[0, num_planes) and every i in [0, num_rows):
//   row dst_rows[i] of plane p  <-  row src_rows[i] of plane p
// A null src_rows (dst_rows) stands for the identity (row i). A negative row index in either list
// skips item i. REQUIRES: no destination row is written twice or read by another item;
// `planes`, `src_rows` and `dst_rows` are in device memory. This one kernel serves Scatter
// (contiguous source, indexed destination: cells of attention groups, ring slots of rotating
// groups, recurrent state slots), Gather (the reverse), CopyRows (copy-on-write, recurrent slot
// copies) and CopyRowsBetween (snapshots and speculative commits).
absl::Status LaunchCopyRows(const CopyPlane* planes, int32_t num_planes, const int32_t* src_rows,
                            const int32_t* dst_rows, int32_t num_rows, cudaStream_t stream);

enum class RopeDType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

// Rotates, in place, the first `dims` elements of each of `num_heads` heads (each head_dim
// elements long) in rows rows[0, num_rows) of every plane (base pointers planes[0, num_planes),
// rows row_bytes apart): pair i of a head is (x[2i], x[2i+1]) when `neox` is false and
// (x[i], x[i + dims/2]) when it is true, rotated by the angle whose cosine and sine are cos[i],
// sin[i] (device arrays of dims/2 floats). Arithmetic is float32 with separately rounded
// multiplies and adds, so the result matches HostDevice bit for bit.
absl::Status LaunchRopeShift(uint8_t* const* planes, int32_t num_planes, uint64_t row_bytes,
                             const int32_t* rows, int32_t num_rows, RopeDType dtype,
                             int32_t num_heads, int32_t head_dim, int32_t dims, bool neox,
                             const float* cos, const float* sin, cudaStream_t stream);

}  // namespace cuda
}  // namespace kvmesh

#endif  // KVMESH_CACHE_DEVICE_CUDA_KERNELS_H_

// What nvcc provides to device code, for compiling cache/device/cuda_kernels.cu as host C++
// against the simulated runtime (cuda_sim.h). Included before the kernels' own source by
// cuda_kernels_sim.cc; nothing here is used by production code.
//
// - Qualifiers: CUDA's host_defines.h already blanks __global__, __device__ and __host__ for a
//   host compiler; __launch_bounds__ is blanked here.
// - threadIdx, blockIdx, blockDim and gridDim read the coordinates of the simulated thread being
//   run (kernel_coords).
// - __ldg is a plain load; the _rn arithmetic intrinsics are single IEEE operations, which stay
//   separate because this code is compiled with -ffp-contract=off (as nvcc keeps them).
// - KVMESH_LAUNCH(grid, block, shared, stream, kernel)(args...) enqueues the kernel on the
//   simulated stream, to run every (block, thread) one after another in the order the simulator
//   is set to (the kernels use no shared memory, barriers, warp shuffles or atomics, so any
//   serial order is a faithful schedule).
#ifndef KVMESH_TESTS_TESTING_CUDASIM_KERNEL_PRELUDE_H_
#define KVMESH_TESTS_TESTING_CUDASIM_KERNEL_PRELUDE_H_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstring>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "tests/testing/cudasim/cuda_sim.h"

#define __launch_bounds__(...)
// Shared memory (and the barriers that go with it) has no serial schedule that is faithful: a
// kernel that uses it must not compile for the simulator, where CUDA's headers would blank
// __shared__ into a per-thread variable. (__syncthreads, warp shuffles, votes and atomics are not
// declared for host code at all.)
#undef __shared__
#define __shared__ __shared___memory_is_not_simulated_by_cudasim
#define threadIdx (::cudasim::internal::kernel_coords.thread_idx)
#define blockIdx (::cudasim::internal::kernel_coords.block_idx)
#define blockDim (::cudasim::internal::kernel_coords.block_dim)
#define gridDim (::cudasim::internal::kernel_coords.grid_dim)

template <typename T>
inline T __ldg(const T* p) {
  return *p;
}
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __uint_as_float(unsigned int u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline unsigned int __float_as_uint(float f) {
  unsigned int u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

namespace cudasim {
namespace internal {

// The simulated thread running on this host thread. Defined here, in the kernels' own
// translation unit (linked into the executable), rather than in the runtime library, so that
// reading threadIdx is a plain thread-local load.
inline thread_local ThreadCoords kernel_coords;

// Binds a kernel to its launch configuration; calling it with the kernel's arguments enqueues
// the launch. Pointer arguments are handed to the simulator, which checks each is null or device
// memory, as a GPU would fault on anything else.
template <typename... Params>
class Launcher {
 public:
  Launcher(const char* name, void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared,
           cudaStream_t stream)
      : name_(name),
        kernel_(kernel),
        grid_(grid),
        block_(block),
        shared_(shared),
        stream_(stream) {}

  template <typename... Args>
  void operator()(Args&&... args) const {
    static_assert(sizeof...(Args) == sizeof...(Params), "wrong number of kernel arguments");
    auto params = std::make_shared<std::tuple<std::decay_t<Params>...>>(
        static_cast<std::decay_t<Params>>(std::forward<Args>(args))...);
    std::vector<const void*> pointers;
    std::apply([&pointers](const auto&... p) { (Collect(p, &pointers), ...); }, *params);
    void (*kernel)(Params...) = kernel_;
    LaunchKernel(name_, grid_, block_, shared_, stream_, pointers.data(), pointers.size(),
                 [kernel, params](const LaunchOrder& order) {
                   for (uint64_t k = 0; k < order.total; ++k) {
                     kernel_coords = order.Coords(order.At(k));
                     std::apply(kernel, *params);
                   }
                 });
  }

 private:
  template <typename T>
  static void Collect(const T& value, std::vector<const void*>* pointers) {
    if constexpr (std::is_pointer_v<T>) {
      pointers->push_back(static_cast<const void*>(value));
    }
  }

  const char* name_;
  void (*kernel_)(Params...);
  dim3 grid_, block_;
  size_t shared_;
  cudaStream_t stream_;
};

template <typename... Params>
Launcher<Params...> MakeLauncher(const char* name, dim3 grid, dim3 block, size_t shared,
                                 cudaStream_t stream, void (*kernel)(Params...)) {
  return Launcher<Params...>(name, kernel, grid, block, shared, stream);
}

}  // namespace internal
}  // namespace cudasim

#define KVMESH_LAUNCH(grid, block, shared, stream, ...) \
  ::cudasim::internal::MakeLauncher(#__VA_ARGS__, (grid), (block), (shared), (stream), __VA_ARGS__)

#endif  // KVMESH_TESTS_TESTING_CUDASIM_KERNEL_PRELUDE_H_

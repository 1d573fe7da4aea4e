// cache/device/cuda_kernels.cu, unchanged, compiled as host C++ for the simulated GPU: the
// prelude supplies what nvcc would (kernel_prelude.h). Built only with -DKVMESH_CUDA=SIM and
// compiled with -ffp-contract=off, so the kernels' separately rounded float operations stay
// separate, as nvcc's __fmul_rn and friends keep them.
#include "tests/testing/cudasim/kernel_prelude.h"

// The kernels' BitCast copies CUDA's half pairs with memcpy, as device code may (they are
// trivially copyable on the device, not to g++'s check). nvcc's `#pragma unroll` is silenced by
// -Wno-unknown-pragmas (cache/CMakeLists.txt): g++ ignores that warning's pragma form.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wclass-memaccess"
#endif
// The production source itself:
#include "cache/device/cuda_kernels.cu"

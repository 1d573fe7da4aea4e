// Hooks between the simulator's own translation units: runtime.cc owns the allocation tables,
// the accounting of device memory, error injection and misuse reporting; vmm.cc (the driver API's
// virtual memory management, cuda_sim.h) reaches them only through these. Neither tests nor
// simulated libraries use this header: cuda_sim.h is their API.
//
// Thread safety: every function is thread-safe. vmm.cc calls the runtime.cc hooks while it holds
// its own lock, so those take only runtime.cc's registry lock and never call back into vmm.cc
// (lock order: vmm -> registry). SynchronizeAll runs streams: it must be called with no lock held.
#ifndef KVMESH_TESTS_TESTING_CUDASIM_SIM_INTERNAL_H_
#define KVMESH_TESTS_TESTING_CUDASIM_SIM_INTERNAL_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "tests/testing/cudasim/cuda_sim.h"

namespace cudasim {
namespace internal {

// What fresh device memory holds, from cudaMalloc or cuMemCreate.
constexpr uint8_t kDevicePoison = 0xA5;

// ---- Calls (runtime.cc) ----------------------------------------------------------------------

// Starts a call named `call` (a name KnownCall accepts): the sticky error of a dead context, else
// the failure injected into this call of it, else cudaSuccess. Driver calls return the CUresult
// of the same number (CUDA numbers its runtime and driver errors alike).
cudaError_t EnterCall(const char* call);
// Only the injected failure: calls that release resources go on in a dead context (cudaFree).
cudaError_t InjectedFailure(const char* call);
// The error a device fault left behind (cudaSuccess when none).
cudaError_t StickyError();
// Records `why` as this thread's LastMessage(); counts and prints it when it is a misuse, prints
// it when tracing (KVMESH_CUDASIM_TRACE). `error_name` names the error in the printed line.
void ReportFailure(const char* error_name, const std::string& why, bool misuse);
// KVMESH_CUDASIM_DEVICES.
int DeviceCount();
// Runs every stream to its end (what cudaDeviceSynchronize does); the first error it met.
cudaError_t SynchronizeAll();

// ---- Device memory (runtime.cc) --------------------------------------------------------------

// Counts `bytes` against simulated device `device` (KVMESH_CUDASIM_MEMORY), as cudaMalloc does.
// False, with *why naming `call`, when they do not fit.
bool ChargeDevice(int device, size_t bytes, const char* call, std::string* why);
void UnchargeDevice(int device, size_t bytes);

// Memory that cuMemMap placed at [base, base + size) on `device`. Registered at once, without
// access: copies and kernels refuse it until SetMappedAccess(base, true). cudaFree refuses it.
// REQUIRES: base, size page-aligned; the range is mapped and overlaps no registered memory.
void RegisterMapped(void* base, size_t size, int device);
// Whether copies and kernels may use the mapping that starts at `base`.
// REQUIRES: `base` was registered by RegisterMapped and not unregistered.
void SetMappedAccess(void* base, bool accessible);
// The mapping at `base` is gone (cuMemUnmap): it moves to the quarantine, so a copy that still
// names it is refused as a use after free. vmm.cc keeps the range itself inaccessible.
void UnregisterMapped(void* base);
// Drops what the quarantine remembers of unmapped ranges inside [base, base + size): the range is
// mapped again, or its addresses go back to the system (cuMemAddressFree).
void ForgetUnmapped(void* base, size_t size);

// ---- Driver API (vmm.cc) ---------------------------------------------------------------------

// The number of a CUresult named `name` (CUDA_ERROR_OUT_OF_MEMORY); false for an unknown name.
bool DriverErrorCode(const std::string& name, int* code);
// Adds the driver API's live objects to `stats`.
void AddDriverStats(Stats* stats);

}  // namespace internal
}  // namespace cudasim

#endif  // KVMESH_TESTS_TESTING_CUDASIM_SIM_INTERNAL_H_

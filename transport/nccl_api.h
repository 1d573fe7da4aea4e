// NCCL loaded at run time: the table of NCCL functions that kvmesh calls, resolved with dlopen
// and dlsym from libnccl.so.2 (docs/cuda.md, "NCCL").
//
// Why not link NCCL: a kvmesh-node binary serves `--backend=host` too, on machines without CUDA
// or NCCL, so nothing in it may need libnccl.so at start-up. Types and constants still come from
// nccl.h (the header only); every NCCL call goes through an NcclApi, and nothing in kvmesh links
// the library (a direct call would fail to link).
//
// Which library: $KVMESH_NCCL_LIBRARY when set and not empty (a file name, searched like any
// dlopen name, or a path), else "libnccl.so.2" (the dynamic linker's search: LD_LIBRARY_PATH,
// ld.so.cache, ...). A library is accepted when it has every symbol of NcclApi and its major
// version (ncclGetVersion) is the major version of the nccl.h kvmesh was built with.
//
// A library once loaded stays loaded for the life of the process (NCCL keeps threads and state
// that a dlclose would pull from under them); a library that is refused is closed again.
//
// Thread safety: LoadNccl and OpenNcclLibrary are thread-safe; an NcclApi is immutable.
#ifndef KVMESH_TRANSPORT_NCCL_API_H_
#define KVMESH_TRANSPORT_NCCL_API_H_

#include <nccl.h>

#include <string>

#include "absl/status/statusor.h"

namespace kvmesh {
namespace transport {

inline constexpr char kNcclLibraryEnv[] = "KVMESH_NCCL_LIBRARY";
inline constexpr char kNcclDefaultLibrary[] = "libnccl.so.2";

// The NCCL functions kvmesh uses, each named as in nccl.h; none is null.
struct NcclApi {
  decltype(&::ncclGetVersion) ncclGetVersion;
  decltype(&::ncclGetUniqueId) ncclGetUniqueId;
  decltype(&::ncclCommInitRankConfig) ncclCommInitRankConfig;
  decltype(&::ncclCommFinalize) ncclCommFinalize;
  decltype(&::ncclCommDestroy) ncclCommDestroy;
  decltype(&::ncclCommAbort) ncclCommAbort;
  decltype(&::ncclCommGetAsyncError) ncclCommGetAsyncError;
  decltype(&::ncclGetErrorString) ncclGetErrorString;
  decltype(&::ncclGetLastError) ncclGetLastError;
  decltype(&::ncclGroupStart) ncclGroupStart;
  decltype(&::ncclGroupEnd) ncclGroupEnd;
  decltype(&::ncclSend) ncclSend;
  decltype(&::ncclRecv) ncclRecv;

  int version = 0;      // ncclGetVersion's code, e.g. 22809 for 2.28.9
  std::string library;  // the name or path it was opened by
  std::string path;     // the file the dynamic linker found for it
};

// The library LoadNccl opens: $KVMESH_NCCL_LIBRARY when set and not empty, else
// kNcclDefaultLibrary.
std::string NcclLibraryName();

// Opens `library` (a dlopen name or path), resolves every function of NcclApi and checks the
// version. FAILED_PRECONDITION, naming `library`: dlopen failed (with dlerror's text), a symbol
// is missing (naming it), or the major version differs from nccl.h's. Not cached: each call
// opens the library again (the dynamic linker maps a library once, so this is cheap); kvmesh
// code uses LoadNccl instead.
absl::StatusOr<NcclApi> OpenNcclLibrary(const std::string& library);

// The process's NCCL: the first call opens NcclLibraryName() with OpenNcclLibrary, and every
// call returns that call's result (a failure is not retried; the environment is read once).
// The NcclApi lives until the process exits.
absl::StatusOr<const NcclApi*> LoadNccl();

// "2.28.9" for ncclGetVersion's code 22809 (and "2.8.4" for the pre-2.9 code 2804).
std::string FormatNcclVersion(int code);
// The major version in ncclGetVersion's code: 2 for 22809 or 2804.
int NcclMajorVersion(int code);

}  // namespace transport
}  // namespace kvmesh

#endif  // KVMESH_TRANSPORT_NCCL_API_H_

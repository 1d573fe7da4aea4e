#include "transport/nccl_api.h"

#include <dlfcn.h>

#include <cstdlib>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvmesh {
namespace transport {
namespace {

// dlerror's text, or `fallback` when it has none. dlerror is per thread, so this reads the
// error of this thread's last dl* call.
std::string DlError(const char* fallback) {
  const char* error = dlerror();
  return error != nullptr ? error : fallback;
}

// Sets *fn to `name` in `handle`; false (with *missing set) when the library has no such symbol.
template <typename Fn>
bool Resolve(void* handle, const char* name, Fn* fn, std::string* missing) {
  dlerror();  // clear an earlier error
  void* symbol = dlsym(handle, name);
  if (symbol == nullptr) {
    *missing = absl::StrCat("it has no symbol ", name, " (", DlError("null address"), ")");
    return false;
  }
  *fn = reinterpret_cast<Fn>(symbol);
  return true;
}

}  // namespace

std::string FormatNcclVersion(int code) {
  if (code >= 10000) return absl::StrCat(code / 10000, ".", code % 10000 / 100, ".", code % 100);
  return absl::StrCat(code / 1000, ".", code % 1000 / 100, ".", code % 100);
}

int NcclMajorVersion(int code) { return code >= 10000 ? code / 10000 : code / 1000; }

std::string NcclLibraryName() {
  const char* env = std::getenv(kNcclLibraryEnv);
  return env != nullptr && env[0] != '\0' ? env : kNcclDefaultLibrary;
}

absl::StatusOr<NcclApi> OpenNcclLibrary(const std::string& library) {
  dlerror();
  // RTLD_NOW: a library whose own dependencies are missing fails here, not at its first call.
  void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot load NCCL from ", library, ": ", DlError("dlopen failed")));
  }
  NcclApi api;
  api.library = library;
  std::string problem;
  const bool resolved =
      Resolve(handle, "ncclGetVersion", &api.ncclGetVersion, &problem) &&
      Resolve(handle, "ncclGetUniqueId", &api.ncclGetUniqueId, &problem) &&
      Resolve(handle, "ncclCommInitRankConfig", &api.ncclCommInitRankConfig, &problem) &&
      Resolve(handle, "ncclCommFinalize", &api.ncclCommFinalize, &problem) &&
      Resolve(handle, "ncclCommDestroy", &api.ncclCommDestroy, &problem) &&
      Resolve(handle, "ncclCommAbort", &api.ncclCommAbort, &problem) &&
      Resolve(handle, "ncclCommGetAsyncError", &api.ncclCommGetAsyncError, &problem) &&
      Resolve(handle, "ncclGetErrorString", &api.ncclGetErrorString, &problem) &&
      Resolve(handle, "ncclGetLastError", &api.ncclGetLastError, &problem) &&
      Resolve(handle, "ncclGroupStart", &api.ncclGroupStart, &problem) &&
      Resolve(handle, "ncclGroupEnd", &api.ncclGroupEnd, &problem) &&
      Resolve(handle, "ncclSend", &api.ncclSend, &problem) &&
      Resolve(handle, "ncclRecv", &api.ncclRecv, &problem);
  // The file the dynamic linker picked, for messages (dladdr of a symbol names its object).
  Dl_info info;
  if (resolved && dladdr(reinterpret_cast<void*>(api.ncclGetVersion), &info) != 0 &&
      info.dli_fname != nullptr) {
    api.path = info.dli_fname;
  } else {
    api.path = library;
  }
  if (resolved) {
    const ncclResult_t result = api.ncclGetVersion(&api.version);
    if (result != ncclSuccess) {
      problem = absl::StrCat("its ncclGetVersion failed with error ", static_cast<int>(result));
    } else if (NcclMajorVersion(api.version) != NCCL_MAJOR) {
      problem = absl::StrCat(
          "it is NCCL ", FormatNcclVersion(api.version),
          ", but kvmesh was built with nccl.h of NCCL ", FormatNcclVersion(NCCL_VERSION_CODE),
          ": the major versions differ (use a libnccl.so of major version ", NCCL_MAJOR, ")");
    }
  }
  if (!problem.empty()) {
    dlclose(handle);
    return absl::FailedPreconditionError(
        absl::StrCat("cannot use ", library,
                     api.path != library ? absl::StrCat(" (", api.path, ")") : std::string(),
                     " as NCCL: ", problem));
  }
  // The handle is never closed: see the header.
  return api;
}

absl::StatusOr<const NcclApi*> LoadNccl() {
  // Never destroyed: NCCL may be in use by other threads while the process exits.
  static const absl::StatusOr<NcclApi>* const loaded =
      new absl::StatusOr<NcclApi>(OpenNcclLibrary(NcclLibraryName()));
  if (!loaded->ok()) return loaded->status();
  return &**loaded;
}

}  // namespace transport
}  // namespace kvmesh

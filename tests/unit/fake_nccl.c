/* A stand-in for libnccl.so.2 that nccl_api_test loads (transport/nccl_api.h): it exports the
 * NCCL symbols kvmesh resolves, and ncclGetVersion reports FAKE_NCCL_VERSION. With
 * FAKE_NCCL_OMIT_RECV it lacks ncclRecv, the last symbol the loader resolves. Only
 * ncclGetVersion is ever called; the others exist to be found by dlsym and fail if called. */
#ifndef FAKE_NCCL_VERSION
#error "FAKE_NCCL_VERSION must be defined by the build"
#endif

#define FAKE_NCCL_INVALID_USAGE 5 /* ncclInvalidUsage */
#define FAKE_NCCL_STUB(name) \
  int name(void) { return FAKE_NCCL_INVALID_USAGE; }

int ncclGetVersion(int* version) {
  *version = FAKE_NCCL_VERSION;
  return 0;
}

FAKE_NCCL_STUB(ncclGetUniqueId)
FAKE_NCCL_STUB(ncclCommInitRankConfig)
FAKE_NCCL_STUB(ncclCommFinalize)
FAKE_NCCL_STUB(ncclCommDestroy)
FAKE_NCCL_STUB(ncclCommAbort)
FAKE_NCCL_STUB(ncclCommGetAsyncError)
FAKE_NCCL_STUB(ncclGetErrorString)
FAKE_NCCL_STUB(ncclGetLastError)
FAKE_NCCL_STUB(ncclGroupStart)
FAKE_NCCL_STUB(ncclGroupEnd)
FAKE_NCCL_STUB(ncclSend)
#ifndef FAKE_NCCL_OMIT_RECV
FAKE_NCCL_STUB(ncclRecv)
#endif

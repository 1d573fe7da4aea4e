// ncclGetLastError's text: the message of the last failure the simulator reported, from any
// thread and any communicator, as NCCL keeps one for the process (the async errors that a
// communicator's thread finds included, so that a caller polling ncclCommGetAsyncError can
// say what went wrong).
//
// Thread safety: thread-safe.
#ifndef KVMESH_TESTS_TESTING_NCCLSIM_LAST_ERROR_H_
#define KVMESH_TESTS_TESTING_NCCLSIM_LAST_ERROR_H_

#include <string>

namespace ncclsim {

// Records `message` as the last error and prints it to stderr when $NCCL_DEBUG is set (any
// value but empty), as NCCL prints its warnings.
void RecordError(const std::string& message);

// The last error's text ("" when none): a copy in a buffer of the calling thread, valid until
// that thread's next call.
const char* LastError();

}  // namespace ncclsim

#endif  // KVMESH_TESTS_TESTING_NCCLSIM_LAST_ERROR_H_

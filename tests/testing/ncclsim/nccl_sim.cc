// The exported NCCL functions of the simulator (nccl_sim.h): argument checks, injected call
// failures, the per-thread group, and the hand-over of each group's operations to the
// communicators (communicator.h) and the streams (cudasim::Enqueue).
#include "tests/testing/ncclsim/nccl_sim.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <climits>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tests/testing/cudasim/cuda_sim.h"
#include "tests/testing/ncclsim/bootstrap_root.h"
#include "tests/testing/ncclsim/communicator.h"
#include "tests/testing/ncclsim/fault_injection.h"
#include "tests/testing/ncclsim/last_error.h"
#include "tests/testing/ncclsim/wire.h"

// What an ncclComm_t points to.
struct ncclComm {
  std::shared_ptr<ncclsim::Communicator> impl;
};

namespace ncclsim {
namespace {

// An operation posted inside the calling thread's group.
struct Posted {
  std::shared_ptr<Communicator> comm;
  cudaStream_t stream;
  std::shared_ptr<Op> op;
};

// The calling thread's ncclGroupStart nesting and what it has posted since the outermost one.
struct Group {
  int depth = 0;
  ncclResult_t error = ncclSuccess;  // the first failed call inside the group
  std::vector<Posted> ops;
};
thread_local Group group;

// Records `message` as the last error and returns `result`.
ncclResult_t Fail(ncclResult_t result, const std::string& message) {
  RecordError(message);
  return result;
}

// The result of the injected failure of this call of `function`, if KVMESH_NCCLSIM_ERROR
// plans one.
std::optional<ncclResult_t> Injected(const char* function) {
  const std::optional<ncclResult_t> result = FaultInjection::Get().OnCall(function);
  if (result) {
    RecordError(std::string(function) + " failed with " + ResultName(*result) +
                ", as KVMESH_NCCLSIM_ERROR planned");
  }
  return result;
}

size_t TypeBytes(ncclDataType_t type) {
  switch (type) {
    case ncclInt8:
    case ncclUint8:
    case ncclFloat8e4m3:
    case ncclFloat8e5m2:
      return 1;
    case ncclFloat16:
    case ncclBfloat16:
      return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
      return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64:
      return 8;
    case ncclNumTypes:
      break;
  }
  return 0;
}

// Sends to and receives from the own rank must pair up in order with equal sizes on each
// stream: a GPU would wait forever for the missing half.
ncclResult_t CheckSelfPairs(const Communicator& comm, const std::vector<const Posted*>& ops) {
  std::map<cudaStream_t, std::pair<std::vector<size_t>, std::vector<size_t>>> by_stream;
  for (const Posted* posted : ops) {
    if (posted->op->peer != comm.rank()) continue;
    auto& [sends, recvs] = by_stream[posted->stream];
    (posted->op->send ? sends : recvs).push_back(posted->op->bytes);
  }
  for (const auto& [stream, pairs] : by_stream) {
    const auto& [sends, recvs] = pairs;
    if (sends != recvs) {
      return Fail(ncclInvalidUsage,
                  comm.name() + ": a group posts " + std::to_string(sends.size()) +
                      " sends to this rank itself and " + std::to_string(recvs.size()) +
                      " receives from it on one stream, but each send needs a receive of the "
                      "same size in the same order on the same stream");
    }
  }
  return ncclSuccess;
}

// Hands a closed group's operations to their communicators and streams. All or nothing for
// the checks; a stream that refuses its operation fails that communicator.
ncclResult_t Launch(std::vector<Posted> ops) {
  // Communicators in order of first use, each with its operations in posting order.
  std::vector<std::pair<Communicator*, std::vector<const Posted*>>> comms;
  for (const Posted& posted : ops) {
    auto it = comms.begin();
    while (it != comms.end() && it->first != posted.comm.get()) ++it;
    if (it == comms.end()) it = comms.insert(comms.end(), {posted.comm.get(), {}});
    it->second.push_back(&posted);
  }
  for (const auto& [comm, posted] : comms) {
    const ncclResult_t result = CheckSelfPairs(*comm, posted);
    if (result != ncclSuccess) return result;
  }
  bool in_progress = false;
  for (const auto& [comm, posted] : comms) {
    // One stream operation per stream, in order of first use.
    std::vector<std::pair<cudaStream_t, std::vector<std::shared_ptr<Op>>>> streams;
    for (const Posted* p : posted) {
      auto it = streams.begin();
      while (it != streams.end() && it->first != p->stream) ++it;
      if (it == streams.end()) it = streams.insert(streams.end(), {p->stream, {}});
      it->second.push_back(p->op);
    }
    std::vector<std::unique_ptr<StreamOp>> stream_ops;
    for (const auto& [stream, of_stream] : streams) {
      auto completion = std::make_shared<Completion>(of_stream.size());
      for (const std::shared_ptr<Op>& op : of_stream) op->completion = completion;
      stream_ops.push_back(std::make_unique<StreamOp>(posted.front()->comm, of_stream, completion));
    }
    std::vector<std::shared_ptr<Op>> in_order;
    for (const Posted* p : posted) in_order.push_back(p->op);
    comm->Post(in_order);
    for (size_t i = 0; i < streams.size(); ++i) {
      const cudaError_t error =
          cudasim::Enqueue(streams[i].first, std::move(stream_ops[i]), "NCCL send/receive");
      if (error != cudaSuccess) {
        const std::string message = "cannot put NCCL operations on their stream: " +
                                    std::string(cudaGetErrorString(error)) + " (" +
                                    cudasim::LastMessage() + ")";
        comm->Fail(ncclUnhandledCudaError, message);
        return ncclUnhandledCudaError;
      }
    }
    in_progress = in_progress || !comm->blocking();
  }
  return in_progress ? ncclInProgress : ncclSuccess;
}

ncclResult_t Post(bool send, void* data, size_t count, ncclDataType_t type, int peer,
                  ncclComm_t handle, cudaStream_t stream) {
  const char* function = send ? "ncclSend" : "ncclRecv";
  const auto invalid = [&](const std::string& why) {
    return Fail(ncclInvalidArgument, std::string(function) + ": " + why);
  };
  ncclResult_t result = ncclSuccess;
  const size_t type_bytes = TypeBytes(type);
  if (handle == nullptr) {
    result = invalid("null communicator");
  } else if (type_bytes == 0) {
    result = invalid("invalid data type " + std::to_string(static_cast<int>(type)));
  } else if (peer < 0 || peer >= handle->impl->nranks()) {
    result = invalid("peer " + std::to_string(peer) + " is not a rank of " + handle->impl->name());
  } else if (count > SIZE_MAX / type_bytes) {
    result = invalid("count " + std::to_string(count) + " overflows");
  } else if (count > 0 && data == nullptr) {
    result = invalid("null buffer");
  } else if (count > 0 && !cudasim::CheckDeviceRange(data, count * type_bytes, function)) {
    result = invalid(std::string("the buffer is not device memory: ") + cudasim::LastMessage());
  } else {
    std::string why;
    result = handle->impl->CheckUsable(&why);
    if (result != ncclSuccess) RecordError(std::string(function) + ": " + why);
  }
  if (result == ncclSuccess) {
    auto op = std::make_shared<Op>();
    op->send = send;
    op->peer = peer;
    op->data = static_cast<uint8_t*>(data);
    op->bytes = count * type_bytes;
    op->fault = FaultInjection::Get().OnOp(send);
    group.ops.push_back(Posted{handle->impl, stream, std::move(op)});
  }
  if (group.depth > 0) {
    if (group.error == ncclSuccess) group.error = result;
    return result;
  }
  // Outside a group a call is a group of its own.
  std::vector<Posted> ops = std::move(group.ops);
  group.ops.clear();
  if (result != ncclSuccess) return result;
  return Launch(std::move(ops));
}

const char* ErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess:
      return "no error";
    case ncclUnhandledCudaError:
      return "unhandled cuda error";
    case ncclSystemError:
      return "unhandled system error (a socket or thread failed)";
    case ncclInternalError:
      return "internal error";
    case ncclInvalidArgument:
      return "invalid argument";
    case ncclInvalidUsage:
      return "invalid usage";
    case ncclRemoteError:
      return "remote process exited or there was a network error";
    case ncclInProgress:
      return "NCCL operation in progress";
    case ncclNumResults:
      break;
  }
  return "unknown result code";
}

}  // namespace
}  // namespace ncclsim

// ---- The exported functions -------------------------------------------------------------------
// nccl.h and nccl_sim.h declare them with C linkage; exports.map keeps every other symbol of the
// library local, so that its internals cannot clash with the process's.

using ncclsim::Fail;
using ncclsim::Injected;

const char* kvmesh_ncclsim_version(void) {
  // Immortal, like the library.
  static const std::string* const version =
      new std::string("kvmesh ncclsim (NCCL " + std::to_string(NCCL_MAJOR) + "." +
                      std::to_string(NCCL_MINOR) + "." + std::to_string(NCCL_PATCH) + " API)");
  return version->c_str();
}

ncclResult_t ncclGetVersion(int* version) {
  if (auto injected = Injected("ncclGetVersion")) return *injected;
  if (version == nullptr) return Fail(ncclInvalidArgument, "ncclGetVersion: null version");
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (auto injected = Injected("ncclGetUniqueId")) return *injected;
  if (id == nullptr) return Fail(ncclInvalidArgument, "ncclGetUniqueId: null id");
  const ncclsim::FaultInjection& faults = ncclsim::FaultInjection::Get();
  if (!faults.problem().empty()) return Fail(ncclInvalidUsage, faults.problem());
  std::string error;
  ncclsim::BootstrapRoot* root = ncclsim::BootstrapRoot::Get(&error);
  if (root == nullptr || !root->NewId(id, &error)) {
    return Fail(ncclSystemError, "ncclGetUniqueId: " + error);
  }
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId comm_id, int rank,
                                    ncclConfig_t* config) {
  if (auto injected = Injected("ncclCommInitRankConfig")) return *injected;
  const auto invalid = [](ncclResult_t result, const std::string& why) {
    return Fail(result, "ncclCommInitRankConfig: " + why);
  };
  if (comm == nullptr) return invalid(ncclInvalidArgument, "null communicator pointer");
  *comm = nullptr;
  const ncclsim::FaultInjection& faults = ncclsim::FaultInjection::Get();
  if (!faults.problem().empty()) return invalid(ncclInvalidUsage, faults.problem());
  if (nranks < 1 || rank < 0 || rank >= nranks) {
    return invalid(ncclInvalidArgument,
                   "rank " + std::to_string(rank) + " of " + std::to_string(nranks));
  }
  const ncclsim::IdLayout id = ncclsim::ReadId(comm_id);
  if (!ncclsim::IsSimulatorId(id)) {
    return invalid(ncclInvalidArgument,
                   "the unique id is not one of the kvmesh NCCL simulator's (ncclGetUniqueId of "
                   "this library makes them)");
  }
  if (config != nullptr && (config->magic != 0xcafebeef ||
                            config->size < offsetof(ncclConfig_t, blocking) + sizeof(int))) {
    return invalid(ncclInvalidArgument, "the config was not set up with NCCL_CONFIG_INITIALIZER");
  }
  if (ncclsim::group.depth > 0) {
    return invalid(ncclInvalidUsage, "the simulator does not initialize inside a group");
  }
  if (!cudasim::Active()) {
    return invalid(ncclInvalidUsage, "the kvmesh NCCL simulator runs only on cudasim");
  }
  int device = 0;
  const cudaError_t cuda = cudaGetDevice(&device);
  if (cuda != cudaSuccess) {
    return invalid(ncclUnhandledCudaError,
                   std::string("cudaGetDevice: ") + cudaGetErrorString(cuda));
  }
  const bool blocking =
      config == nullptr || config->blocking == NCCL_CONFIG_UNDEF_INT || config->blocking != 0;
  std::string error;
  std::shared_ptr<ncclsim::Communicator> impl =
      ncclsim::Communicator::Create(id, nranks, rank, device, blocking, faults.OnInit(), &error);
  if (impl == nullptr) return invalid(ncclSystemError, error);
  if (!blocking) {
    *comm = new ncclComm{std::move(impl)};
    return ncclInProgress;
  }
  const ncclResult_t result = impl->WaitInit(&error);
  if (result != ncclSuccess) {
    impl->Abort();
    return invalid(result, error);
  }
  *comm = new ncclComm{std::move(impl)};
  return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  if (auto injected = Injected("ncclCommFinalize")) return *injected;
  if (comm == nullptr) return Fail(ncclInvalidArgument, "ncclCommFinalize: null communicator");
  std::string error;
  const ncclResult_t result = comm->impl->Finalize(&error);
  if (result != ncclSuccess && result != ncclInProgress) {
    return Fail(result, "ncclCommFinalize: " + error);
  }
  return result;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (auto injected = Injected("ncclCommDestroy")) return *injected;
  if (comm == nullptr) return Fail(ncclInvalidArgument, "ncclCommDestroy: null communicator");
  comm->impl->Destroy();
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (auto injected = Injected("ncclCommAbort")) return *injected;
  if (comm == nullptr) return ncclSuccess;  // as NCCL: nothing to abort
  comm->impl->Abort();
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* async_error) {
  if (auto injected = Injected("ncclCommGetAsyncError")) return *injected;
  if (comm == nullptr || async_error == nullptr) {
    return Fail(ncclInvalidArgument, "ncclCommGetAsyncError: null argument");
  }
  *async_error = comm->impl->AsyncError();
  return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t result) { return ncclsim::ErrorString(result); }

const char* ncclGetLastError(ncclComm_t /*comm*/) { return ncclsim::LastError(); }

ncclResult_t ncclGroupStart() {
  if (auto injected = Injected("ncclGroupStart")) return *injected;
  ++ncclsim::group.depth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  ncclsim::Group& group = ncclsim::group;
  if (group.depth == 0) return Fail(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  // An injected failure closes the group all the same (discarding what it posted), so that the
  // thread can go on with new groups.
  const std::optional<ncclResult_t> injected = Injected("ncclGroupEnd");
  if (--group.depth > 0) return injected.value_or(ncclSuccess);
  std::vector<ncclsim::Posted> ops = std::move(group.ops);
  group.ops.clear();
  const ncclResult_t error = std::exchange(group.error, ncclSuccess);
  if (injected) return *injected;
  if (error != ncclSuccess) return error;
  return ncclsim::Launch(std::move(ops));
}

ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  if (auto injected = Injected("ncclSend")) return *injected;
  return ncclsim::Post(true, const_cast<void*>(sendbuff), count, datatype, peer, comm, stream);
}

ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  if (auto injected = Injected("ncclRecv")) return *injected;
  return ncclsim::Post(false, recvbuff, count, datatype, peer, comm, stream);
}

#include "transport/nccl_comm.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/memory/memory.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "cache/device/cuda_check.h"
#include "cache/status_macros.h"

namespace kvmesh {
namespace transport {
namespace {

// The status for NCCL result `result` of `expr` at file:line. NCCL's remote and system errors
// (a peer or the network went away) are UNAVAILABLE: a new communicator may work. Everything else
// (CUDA errors inside NCCL, invalid usage, internal errors) is INTERNAL.
absl::Status NcclError(const NcclApi& nccl, ncclResult_t result, absl::string_view expr,
                       const char* file, int line) {
  std::string message =
      absl::StrCat(expr, " failed at ", file, ":", line, ": ", nccl.ncclGetErrorString(result));
  // The last error's text (thread-local in NCCL) usually says what actually went wrong.
  const char* detail = nccl.ncclGetLastError(nullptr);
  if (detail != nullptr && detail[0] != '\0') absl::StrAppend(&message, " (", detail, ")");
  if (result == ncclRemoteError || result == ncclSystemError) {
    return absl::UnavailableError(message);
  }
  return absl::InternalError(message);
}

// OK for ncclSuccess and ncclInProgress (a non-blocking communicator's "started").
absl::Status NcclCheck(const NcclApi& nccl, ncclResult_t result, const char* expr, const char* file,
                       int line) {
  if (result == ncclSuccess || result == ncclInProgress) return absl::OkStatus();
  return NcclError(nccl, result, expr, file, line);
}

// Calls NCCL function `fn` of the table `api` (an NcclApi) with the remaining arguments and
// checks the result; the message names the call as written, e.g. "ncclSend(send, bytes, ...)".
#define KVMESH_NCCL_CHECK(api, fn, ...) \
  NcclCheck((api), (api).fn(__VA_ARGS__), #fn "(" #__VA_ARGS__ ")", __FILE__, __LINE__)

absl::StatusOr<bool> InitDone(ncclResult_t async) { return async == ncclSuccess; }

}  // namespace

class NcclComm::Use {
 public:
  explicit Use(std::atomic<int>* users) : users_(users) { users_->fetch_add(1); }
  ~Use() { users_->fetch_sub(1); }
  Use(const Use&) = delete;
  Use& operator=(const Use&) = delete;

 private:
  std::atomic<int>* const users_;
};

absl::StatusOr<std::string> NewNcclUniqueId() {
  ASSIGN_OR_RETURN(const NcclApi* nccl, LoadNccl());
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  const ncclResult_t result = nccl->ncclGetUniqueId(&id);
  if (result != ncclSuccess) {
    return NcclError(*nccl, result, "ncclGetUniqueId(&id)", __FILE__, __LINE__);
  }
  return std::string(id.internal, sizeof(id.internal));
}

// ---- NcclComm --------------------------------------------------------------------------------

NcclComm::NcclComm(const NcclApi* nccl, const NcclCommOptions& options, int nranks, int rank,
                   uint64_t generation, cuda::Stream stream, cuda::Event done0, cuda::Event done1)
    : nccl_(nccl),
      options_(options),
      nranks_(nranks),
      rank_(rank),
      generation_(generation),
      last_used_ns_(absl::ToUnixNanos(absl::Now())),
      stream_(std::move(stream)) {
  done_[0] = std::move(done0);
  done_[1] = std::move(done1);
}

absl::StatusOr<std::unique_ptr<NcclComm>> NcclComm::Start(absl::string_view unique_id, int nranks,
                                                          int rank, uint64_t generation,
                                                          const NcclCommOptions& options) {
  if (unique_id.size() != NCCL_UNIQUE_ID_BYTES) {
    return absl::InvalidArgumentError(absl::StrCat("an NCCL unique id has ", NCCL_UNIQUE_ID_BYTES,
                                                   " bytes, not ", unique_id.size()));
  }
  if (nranks < 1 || rank < 0 || rank >= nranks) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " of ", nranks, " names no rank of the communicator"));
  }
  if (options.chunk_bytes == 0 || options.device < 0) {
    return absl::InvalidArgumentError(absl::StrCat("bad NCCL options: device ", options.device,
                                                   ", chunk_bytes ", options.chunk_bytes));
  }
  ASSIGN_OR_RETURN(const NcclApi* nccl, LoadNccl());
  KVMESH_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.device));
  ASSIGN_OR_RETURN(cuda::Stream stream, cuda::Stream::Create());
  ASSIGN_OR_RETURN(cuda::Event done0, cuda::Event::Create());
  ASSIGN_OR_RETURN(cuda::Event done1, cuda::Event::Create());
  std::unique_ptr<NcclComm> comm =
      absl::WrapUnique(new NcclComm(nccl, options, nranks, rank, generation, std::move(stream),
                                    std::move(done0), std::move(done1)));

  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), NCCL_UNIQUE_ID_BYTES);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every call returns at once; see the header
  MutexLock lock(&comm->mu_);
  ncclComm_t handle = nullptr;
  const absl::Status status =
      KVMESH_NCCL_CHECK(*nccl, ncclCommInitRankConfig, &handle, nranks, id, rank, &config);
  comm->comm_ = handle;
  if (!status.ok()) return comm->AbortLocked(status);
  return comm;
}

absl::StatusOr<std::unique_ptr<NcclComm>> NcclComm::Create(absl::string_view unique_id, int nranks,
                                                           int rank, uint64_t generation,
                                                           const NcclCommOptions& options,
                                                           absl::Time deadline) {
  ASSIGN_OR_RETURN(std::unique_ptr<NcclComm> comm,
                   Start(unique_id, nranks, rank, generation, options));
  RETURN_IF_ERROR(comm->WaitReady(deadline));
  return comm;
}

NcclComm::~NcclComm() {
  MutexLock lock(&mu_);
  // Errors ignored but cleared, so that the next launch check does not report them.
  if (cudaSetDevice(options_.device) != cudaSuccess) (void)cudaGetLastError();
  if (comm_ != nullptr) {
    if (state_.load() == State::kReady && !abort_requested_.load()) {
      (void)CloseLocked(absl::Now() + options_.close_timeout);
    } else {
      (void)AbortLocked(absl::CancelledError("communicator destroyed"));
    }
  }
  if (stream_stuck_) {
    // The GPU may still write into these after the abort: leak them rather than free memory in
    // use (cudaFree would also wait for the stuck work).
    static_cast<void>(new Staging(std::move(send_staging_)));
    static_cast<void>(new Staging(std::move(recv_staging_)));
  }
  // The remaining members go in reverse order of declaration: staging memory, events, stream.
}

std::string NcclComm::Describe() const {
  return absl::StrCat("NCCL communicator (rank ", rank_, " of ", nranks_,
                      " on cuda:", options_.device, ", generation ", generation_, ")");
}

absl::Status NcclComm::CheckAliveLocked() {
  if (state_.load() != State::kDead && abort_requested_.load()) {
    return AbortLocked(absl::AbortedError(absl::StrCat(Describe(), " was replaced or shut down")));
  }
  if (state_.load() == State::kDead) {
    return absl::UnavailableError(
        absl::StrCat(Describe(), " is no longer usable: ", dead_reason_.message()));
  }
  return absl::OkStatus();
}

absl::Status NcclComm::AbortLocked(absl::Status reason) {
  if (comm_ != nullptr) {
    // Its result is of no use: the communicator is gone either way.
    (void)nccl_->ncclCommAbort(comm_);
    comm_ = nullptr;
  }
  if (state_.load() != State::kDead) {
    dead_reason_ = reason;
    state_.store(State::kDead, std::memory_order_release);
  }
  // The abort makes NCCL's kernels return; let the stream drain so that the staging buffers
  // can be freed or reused safely.
  const absl::Time until = absl::Now() + options_.close_timeout;
  while (!stream_stuck_) {
    const cudaError_t error = cudaStreamQuery(stream_.get());
    if (error == cudaSuccess) break;
    if (error != cudaErrorNotReady) {
      // A sticky error: the context is broken and nothing will run any more.
      (void)cudaGetLastError();
      break;
    }
    if (absl::Now() >= until) {
      std::fprintf(stderr,
                   "kvmesh: %s: the stream did not drain within %s after ncclCommAbort; its "
                   "staging memory is leaked\n",
                   Describe().c_str(), absl::FormatDuration(options_.close_timeout).c_str());
      stream_stuck_ = true;
      break;
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
  return reason;
}

absl::Status NcclComm::PollLocked(absl::string_view what,
                                  absl::FunctionRef<absl::StatusOr<bool>(ncclResult_t)> done,
                                  absl::Time deadline, const NcclInterrupt& interrupt) {
  absl::Duration sleep = options_.min_poll_interval;
  while (true) {
    if (abort_requested_.load(std::memory_order_relaxed)) {
      return AbortLocked(
          absl::AbortedError(absl::StrCat(what, ": ", Describe(), " was replaced or shut down")));
    }
    if (interrupt) {
      absl::Status status = interrupt();
      if (!status.ok()) return AbortLocked(std::move(status));
    }
    ncclResult_t async = ncclSuccess;
    absl::Status status = KVMESH_NCCL_CHECK(*nccl_, ncclCommGetAsyncError, comm_, &async);
    if (status.ok() && async != ncclSuccess && async != ncclInProgress) {
      status = NcclError(*nccl_, async, absl::StrCat(what, " on ", Describe()), __FILE__, __LINE__);
    }
    if (!status.ok()) return AbortLocked(std::move(status));
    absl::StatusOr<bool> finished = done(async);
    if (!finished.ok()) return AbortLocked(finished.status());
    if (*finished) return absl::OkStatus();
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return AbortLocked(absl::DeadlineExceededError(
          absl::StrCat(what, " on ", Describe(),
                       " did not complete before the deadline; the communicator was aborted")));
    }
    absl::SleepFor(std::min(sleep, deadline - now));
    sleep = std::min(sleep * 2, options_.max_poll_interval);
  }
}

absl::Status NcclComm::WaitReadyLocked(absl::Time deadline, const NcclInterrupt& interrupt) {
  RETURN_IF_ERROR(CheckAliveLocked());
  if (state_.load() == State::kReady) return absl::OkStatus();
  RETURN_IF_ERROR(PollLocked("initialization", InitDone, deadline, interrupt));
  state_.store(State::kReady, std::memory_order_release);
  Touch();
  return absl::OkStatus();
}

absl::Status NcclComm::WaitReady(absl::Time deadline, const NcclInterrupt& interrupt) {
  Use use(&users_);
  MutexLock lock(&mu_);
  KVMESH_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  return WaitReadyLocked(deadline, interrupt);
}

absl::Status NcclComm::Send(int peer, const NcclSource& source, absl::Time deadline,
                            const NcclInterrupt& interrupt) {
  return Transfer("ncclSend", peer, &source, nullptr, deadline, interrupt);
}

absl::Status NcclComm::Recv(int peer, const NcclDestination& destination, absl::Time deadline,
                            const NcclInterrupt& interrupt) {
  return Transfer("ncclRecv", peer, nullptr, &destination, deadline, interrupt);
}

absl::Status NcclComm::SendRecv(int peer, const NcclSource& source,
                                const NcclDestination& destination, absl::Time deadline,
                                const NcclInterrupt& interrupt) {
  return Transfer("ncclSend+ncclRecv", peer, &source, &destination, deadline, interrupt);
}

absl::Status NcclComm::Transfer(const char* what, int peer, const NcclSource* source,
                                const NcclDestination* destination, absl::Time deadline,
                                const NcclInterrupt& interrupt) {
  if (peer < 0 || peer >= nranks_) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": peer rank ", peer, " is not a rank of ", Describe()));
  }
  if (source != nullptr && destination != nullptr && source->size() != destination->size()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": sends ", source->size(),
                                                   " bytes but receives ", destination->size()));
  }
  const size_t total = source != nullptr ? source->size() : destination->size();
  if (total > 0 &&
      ((source != nullptr && source->payload() == nullptr && source->device() == nullptr) ||
       (destination != nullptr && destination->sink() == nullptr &&
        destination->device() == nullptr))) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": null device pointer"));
  }
  Use use(&users_);
  MutexLock lock(&mu_);
  KVMESH_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  RETURN_IF_ERROR(WaitReadyLocked(deadline, interrupt));
  absl::Status status = TransferLocked(what, peer, source, destination, deadline, interrupt);
  if (!status.ok() && state_.load() != State::kDead) status = AbortLocked(std::move(status));
  Touch();
  return status;
}

absl::Status NcclComm::EnsureStagingLocked(Staging* staging, size_t bytes) {
  if (staging->capacity >= bytes) return absl::OkStatus();
  // A power of two (at most one chunk), so that growing transfers reallocate only a few times.
  size_t capacity = 4096;
  while (capacity < bytes) capacity *= 2;
  capacity = std::max(bytes, std::min(capacity, options_.chunk_bytes));
  // Free the old buffers first: the peak stays at the new size.
  staging->capacity = 0;
  for (int slot = 0; slot < 2; ++slot) {
    staging->host[slot] = cuda::PinnedBuffer();
    staging->device[slot] = cuda::DeviceBuffer();
  }
  for (int slot = 0; slot < 2; ++slot) {
    ASSIGN_OR_RETURN(staging->host[slot], cuda::PinnedBuffer::Create(capacity));
    ASSIGN_OR_RETURN(staging->device[slot], cuda::DeviceBuffer::Create(capacity));
  }
  staging->capacity = capacity;
  return absl::OkStatus();
}

absl::Status NcclComm::PostLocked(int peer, const void* send, void* recv, size_t bytes,
                                  absl::Time deadline, const NcclInterrupt& interrupt) {
  RETURN_IF_ERROR(KVMESH_NCCL_CHECK(*nccl_, ncclGroupStart));
  absl::Status status;
  if (send != nullptr) {
    status =
        KVMESH_NCCL_CHECK(*nccl_, ncclSend, send, bytes, ncclUint8, peer, comm_, stream_.get());
  }
  if (status.ok() && recv != nullptr) {
    status =
        KVMESH_NCCL_CHECK(*nccl_, ncclRecv, recv, bytes, ncclUint8, peer, comm_, stream_.get());
  }
  // Always close the group (NCCL's group depth is per thread), even after an error.
  const absl::Status end = KVMESH_NCCL_CHECK(*nccl_, ncclGroupEnd);
  RETURN_IF_ERROR(status);
  RETURN_IF_ERROR(end);
  // A non-blocking communicator may still be launching the group (ncclInProgress): only once
  // its state is ncclSuccess is the work on the stream, so that an event recorded after it
  // covers it.
  return PollLocked("NCCL group launch", InitDone, deadline, interrupt);
}

absl::Status NcclComm::FinishPieceLocked(const char* what, int slot, size_t* pending,
                                         const NcclDestination* destination, absl::Time deadline,
                                         const NcclInterrupt& interrupt) {
  if (*pending == 0) return absl::OkStatus();
  const cudaEvent_t event = done_[slot].get();
  RETURN_IF_ERROR(PollLocked(
      what,
      [event](ncclResult_t) -> absl::StatusOr<bool> {
        const cudaError_t error = cudaEventQuery(event);
        if (error == cudaSuccess) return true;
        if (error == cudaErrorNotReady) return false;
        (void)cudaGetLastError();
        return cuda::CudaError(error, "cudaEventQuery(piece done)", __FILE__, __LINE__);
      },
      deadline, interrupt));
  const size_t bytes = std::exchange(*pending, 0);
  if (destination != nullptr && destination->sink() != nullptr) {
    return (*destination->sink())(
        absl::Span<const uint8_t>(recv_staging_.host[slot].data(), bytes));
  }
  return absl::OkStatus();
}

absl::Status NcclComm::TransferLocked(const char* what, int peer, const NcclSource* source,
                                      const NcclDestination* destination, absl::Time deadline,
                                      const NcclInterrupt& interrupt) {
  const size_t total = source != nullptr ? source->size() : destination->size();
  if (total == 0) return absl::OkStatus();  // both ranks know the size: nothing to exchange
  const bool host_send = source != nullptr && source->payload() != nullptr;
  const bool host_recv = destination != nullptr && destination->sink() != nullptr;
  const size_t chunk = options_.chunk_bytes;
  if (host_send) RETURN_IF_ERROR(EnsureStagingLocked(&send_staging_, std::min(chunk, total)));
  if (host_recv) RETURN_IF_ERROR(EnsureStagingLocked(&recv_staging_, std::min(chunk, total)));
  const cudaStream_t stream = stream_.get();

  // Piece i uses slot i % 2: its staging buffers and its completion event. Before a slot is
  // reused its previous piece (i - 2) is finished, while piece i - 1 stays in flight in the other
  // slot: the CPU reads or delivers one piece while the GPU moves the next.
  size_t pending[2] = {0, 0};  // bytes of the unfinished piece in each slot
  const size_t pieces = (total + chunk - 1) / chunk;
  for (size_t i = 0; i < pieces; ++i) {
    const int slot = static_cast<int>(i % 2);
    const size_t offset = i * chunk;
    const size_t bytes = std::min(chunk, total - offset);
    RETURN_IF_ERROR(
        FinishPieceLocked(what, slot, &pending[slot], destination, deadline, interrupt));
    const void* send = nullptr;
    if (host_send) {
      uint8_t* host = send_staging_.host[slot].data();
      RETURN_IF_ERROR(source->payload()->ReadAt(offset, absl::Span<uint8_t>(host, bytes)));
      uint8_t* device = send_staging_.device[slot].data();
      KVMESH_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream));
      send = device;
    } else if (source != nullptr) {
      send = source->device() + offset;
    }
    void* recv = nullptr;
    if (host_recv) {
      recv = recv_staging_.device[slot].data();
    } else if (destination != nullptr) {
      recv = destination->device() + offset;
    }
    RETURN_IF_ERROR(PostLocked(peer, send, recv, bytes, deadline, interrupt));
    if (host_recv) {
      KVMESH_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(recv_staging_.host[slot].data(), recv, bytes,
                                                  cudaMemcpyDeviceToHost, stream));
    }
    KVMESH_CUDA_RETURN_IF_ERROR(cudaEventRecord(done_[slot].get(), stream));
    pending[slot] = bytes;
  }
  // The last two pieces, oldest first.
  for (size_t i = pieces < 2 ? 0 : pieces - 2; i < pieces; ++i) {
    const int slot = static_cast<int>(i % 2);
    RETURN_IF_ERROR(
        FinishPieceLocked(what, slot, &pending[slot], destination, deadline, interrupt));
  }
  return absl::OkStatus();
}

absl::Status NcclComm::CloseLocked(absl::Time deadline) {
  if (comm_ == nullptr) return absl::OkStatus();  // already closed or aborted
  if (state_.load() != State::kReady) {
    // Still initializing: there is nothing to flush; finalize is for initialized communicators.
    (void)AbortLocked(absl::UnavailableError("closed during initialization"));
    return absl::OkStatus();
  }
  absl::Status status = KVMESH_NCCL_CHECK(*nccl_, ncclCommFinalize, comm_);
  if (!status.ok()) return AbortLocked(std::move(status));
  // Finalize needs the other ranks to finalize too; a peer that does not within the deadline
  // gets the communicator aborted instead (PollLocked does that).
  RETURN_IF_ERROR(PollLocked("ncclCommFinalize", InitDone, deadline, nullptr));
  status = KVMESH_NCCL_CHECK(*nccl_, ncclCommDestroy, comm_);
  if (!status.ok()) return AbortLocked(std::move(status));
  comm_ = nullptr;
  dead_reason_ = absl::UnavailableError("closed");
  state_.store(State::kDead, std::memory_order_release);
  return absl::OkStatus();
}

absl::Status NcclComm::Close(absl::Time deadline) {
  Use use(&users_);
  MutexLock lock(&mu_);
  KVMESH_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  if (abort_requested_.load() && comm_ != nullptr) {
    return AbortLocked(absl::AbortedError(absl::StrCat(Describe(), " was replaced")));
  }
  return CloseLocked(deadline);
}

// ---- NcclCommPool ----------------------------------------------------------------------------

NcclCommPool::~NcclCommPool() {
  std::map<std::string, std::shared_ptr<NcclComm>> comms;
  {
    MutexLock lock(&mu_);
    comms.swap(comms_);
  }
  for (auto& entry : comms) {
    (void)entry.second->Close(absl::Now() + options_.close_timeout);
  }
}

std::shared_ptr<NcclComm> NcclCommPool::Find(const std::string& key) const {
  MutexLock lock(&mu_);
  auto it = comms_.find(key);
  return it == comms_.end() ? nullptr : it->second;
}

absl::StatusOr<std::shared_ptr<NcclComm>> NcclCommPool::GetOrCreate(
    const std::string& key, absl::FunctionRef<absl::StatusOr<std::unique_ptr<NcclComm>>()> create) {
  std::shared_ptr<NcclComm> dead;  // destroyed outside the lock
  {
    MutexLock lock(&mu_);
    auto it = comms_.find(key);
    if (it != comms_.end()) {
      if (it->second->healthy()) return it->second;
      dead = std::move(it->second);
      comms_.erase(it);
    }
  }
  dead.reset();
  ASSIGN_OR_RETURN(std::unique_ptr<NcclComm> created, create());
  std::shared_ptr<NcclComm> comm(std::move(created));
  Put(key, comm);
  return comm;
}

void NcclCommPool::Put(const std::string& key, std::shared_ptr<NcclComm> comm) {
  const NcclComm* const added = comm.get();
  std::shared_ptr<NcclComm> old;  // destroyed outside the lock
  {
    MutexLock lock(&mu_);
    old = std::exchange(comms_[key], std::move(comm));
  }
  if (old != nullptr && old.get() != added) old->RequestAbort();
}

void NcclCommPool::Remove(const std::string& key, const NcclComm* comm) {
  std::shared_ptr<NcclComm> removed;  // destroyed outside the lock
  {
    MutexLock lock(&mu_);
    auto it = comms_.find(key);
    if (it != comms_.end() && it->second.get() == comm) {
      removed = std::move(it->second);
      comms_.erase(it);
    }
  }
}

size_t NcclCommPool::CloseIdle(absl::Duration idle, absl::Time now) {
  const absl::Time cutoff = now - idle;
  std::vector<std::shared_ptr<NcclComm>> closing;
  {
    MutexLock lock(&mu_);
    for (auto it = comms_.begin(); it != comms_.end();) {
      const NcclComm& comm = *it->second;
      if (!comm.healthy() || (!comm.in_use() && comm.last_used() <= cutoff)) {
        closing.push_back(std::move(it->second));
        it = comms_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (const std::shared_ptr<NcclComm>& comm : closing) {
    (void)comm->Close(absl::Now() + options_.close_timeout);
  }
  return closing.size();
}

size_t NcclCommPool::size() const {
  MutexLock lock(&mu_);
  return comms_.size();
}

}  // namespace transport
}  // namespace kvmesh

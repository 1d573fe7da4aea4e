#include "tests/testing/ncclsim/communicator.h"

#include <errno.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <system_error>
#include <utility>

#include "tests/testing/ncclsim/last_error.h"

namespace ncclsim {
namespace {

std::string Bytes(size_t bytes) { return std::to_string(bytes) + " bytes"; }

}  // namespace

std::shared_ptr<Communicator> Communicator::Create(const IdLayout& id, int nranks, int rank,
                                                   int device, bool blocking,
                                                   std::optional<ncclResult_t> init_fault,
                                                   std::string* error) {
  Fd wake = MakeEventFd(error);
  if (!wake.valid()) return nullptr;
  std::shared_ptr<Communicator> comm(
      new Communicator(id, nranks, rank, device, blocking, init_fault, std::move(wake)));
  try {
    // The thread holds no reference: Abort and Destroy end it before the last one goes.
    comm->thread_ = std::thread([raw = comm.get()] { raw->Run(); });
  } catch (const std::system_error& e) {
    *error = std::string("cannot start the communicator's thread: ") + e.what();
    return nullptr;
  }
  return comm;
}

Communicator::Communicator(const IdLayout& id, int nranks, int rank, int device, bool blocking,
                           std::optional<ncclResult_t> init_fault, Fd wake)
    : id_(id),
      nranks_(nranks),
      rank_(rank),
      blocking_(blocking),
      init_fault_(init_fault),
      name_("rank " + std::to_string(rank) + " of " + std::to_string(nranks) + " (pid " +
            std::to_string(getpid()) + ", cuda:" + std::to_string(device) + ")"),
      wake_(std::move(wake)),
      links_(static_cast<size_t>(nranks)),
      peers_(static_cast<size_t>(nranks)) {}

std::string Communicator::PeerName(int rank) const {
  return "rank " + std::to_string(rank) + " (pid " + std::to_string(links_[rank].pid) + ")";
}

// ---- state seen by callers --------------------------------------------------------------------

bool Communicator::InProgressLocked() const {
  return !initialized_ || launching_ > 0 || finalize_ == Finalizing::kRequested;
}

ncclResult_t Communicator::AsyncError() {
  kvmesh::MutexLock lock(&mu_);
  if (error_ != ncclSuccess) return error_;
  return InProgressLocked() ? ncclInProgress : ncclSuccess;
}

ncclResult_t Communicator::CheckReadyLocked(std::string* error) const {
  if (error_ != ncclSuccess) {
    *error = error_message_;
    return error_;
  }
  if (InProgressLocked()) {
    *error = name_ +
             " used before its previous call completed (ncclCommGetAsyncError still says "
             "ncclInProgress)";
    return ncclInvalidArgument;
  }
  if (finalize_ == Finalizing::kDone) {
    *error = name_ + " is finalized";
    return ncclInvalidUsage;
  }
  return ncclSuccess;
}

ncclResult_t Communicator::WaitInit(std::string* error) {
  kvmesh::MutexLock lock(&mu_);
  while (!initialized_ && error_ == ncclSuccess) changed_.wait(mu_);
  if (error_ != ncclSuccess) *error = error_message_;
  return error_;
}

ncclResult_t Communicator::CheckUsable(std::string* error) {
  kvmesh::MutexLock lock(&mu_);
  return CheckReadyLocked(error);
}

void Communicator::Fail(ncclResult_t result, const std::string& message) {
  kvmesh::MutexLock lock(&mu_);
  FailLocked(result, message);
}

void Communicator::FailLocked(ncclResult_t result, const std::string& message) {
  if (error_ != ncclSuccess) return;
  error_ = result;
  error_message_ = name_ + ": " + message;
  RecordError(error_message_);
  changed_.notify_all();
}

// ---- operations -------------------------------------------------------------------------------

void Communicator::Post(const std::vector<std::shared_ptr<Op>>& ops) {
  {
    kvmesh::MutexLock lock(&mu_);
    for (const std::shared_ptr<Op>& op : ops) {
      op->pending_at = pending_.insert(pending_.end(), op);
      if (op->peer == rank_) continue;  // StartOps copies it
      if (blocking_) {
        Peer& peer = peers_[op->peer];
        (op->send ? peer.sends : peer.recvs).push_back(op);
      } else {
        handoff_.push_back(op);
      }
    }
    if (!blocking_) ++launching_;
  }
  Signal(wake_.get());
}

void Communicator::StartOps(const std::vector<std::shared_ptr<Op>>& ops) {
  std::vector<std::pair<std::shared_ptr<Op>, std::shared_ptr<Op>>> copies;
  {
    kvmesh::MutexLock lock(&mu_);
    // Aborted: Abort completed every operation already, and none may touch memory now.
    if (aborted_) return;
    std::vector<std::shared_ptr<Op>> self_sends;
    std::vector<std::shared_ptr<Op>> self_recvs;
    for (const std::shared_ptr<Op>& op : ops) {
      op->started = true;
      if (op->peer == rank_) (op->send ? self_sends : self_recvs).push_back(op);
    }
    for (size_t i = 0; i < self_sends.size() && i < self_recvs.size(); ++i) {
      const std::shared_ptr<Op>& send = self_sends[i];
      const std::shared_ptr<Op>& recv = self_recvs[i];
      for (const std::shared_ptr<Op>& op : {send, recv}) {
        if (op->fault.failure) {
          FailLocked(*op->fault.failure,
                     std::string("a ") + (op->send ? "send to" : "receive from") +
                         " itself failed with " + ResultName(*op->fault.failure) +
                         ", as KVMESH_NCCLSIM_ERROR planned");
        }
      }
      if (error_ != ncclSuccess) break;
      if (send->fault.hang || recv->fault.hang) continue;
      copies.emplace_back(send, recv);
    }
  }
  // Other ranks' operations are the thread's.
  Signal(wake_.get());
  // Outside the lock: a copy may be large. An Abort meanwhile completes the two operations, but
  // the stream that runs this cannot drain (nor its memory be freed) before this returns.
  for (const auto& [send, recv] : copies) {
    if (send->bytes > 0) std::memmove(recv->data, send->data, send->bytes);
  }
  kvmesh::MutexLock lock(&mu_);
  for (const auto& [send, recv] : copies) {
    CompleteLocked(send);
    CompleteLocked(recv);
  }
}

void Communicator::WaitDone(const Completion& completion) {
  kvmesh::MutexLock lock(&mu_);
  while (completion.remaining.load(std::memory_order_acquire) > 0) changed_.wait(mu_);
}

void Communicator::CompleteLocked(const std::shared_ptr<Op>& op) {
  if (op->done) return;
  op->done = true;
  pending_.erase(op->pending_at);
  op->completion->remaining.fetch_sub(1, std::memory_order_release);
  changed_.notify_all();
  // The last operation of a finalizing communicator: the thread sends the finalize messages.
  if (finalize_ == Finalizing::kRequested && pending_.empty()) Signal(wake_.get());
}

bool StreamOp::Poll(bool blocking) {
  if (completion_->remaining.load(std::memory_order_acquire) == 0) return true;
  if (!blocking) return false;
  comm_->WaitDone(*completion_);
  return true;
}

// ---- finalize, destroy, abort -----------------------------------------------------------------

ncclResult_t Communicator::Finalize(std::string* error) {
  {
    kvmesh::MutexLock lock(&mu_);
    const ncclResult_t ready = CheckReadyLocked(error);
    if (ready != ncclSuccess) return ready;
    finalize_ = Finalizing::kRequested;
  }
  Signal(wake_.get());
  if (!blocking_) return ncclInProgress;
  kvmesh::MutexLock lock(&mu_);
  while (finalize_ != Finalizing::kDone && error_ == ncclSuccess) changed_.wait(mu_);
  if (error_ != ncclSuccess) *error = error_message_;
  return error_;
}

void Communicator::Destroy() {
  bool graceful = false;
  {
    kvmesh::MutexLock lock(&mu_);
    if (initialized_ && error_ == ncclSuccess && finalize_ == Finalizing::kNo) {
      finalize_ = Finalizing::kRequested;
      Signal(wake_.get());
    }
    // NCCL's destroy of a communicator that is not finalized finalizes it, blocking.
    while (initialized_ && error_ == ncclSuccess && finalize_ != Finalizing::kDone) {
      changed_.wait(mu_);
    }
    graceful = initialized_ && error_ == ncclSuccess;
  }
  if (graceful) {
    Stop();
  } else {
    Abort();
  }
}

void Communicator::Abort() {
  {
    kvmesh::MutexLock lock(&mu_);
    aborted_ = true;
    while (!pending_.empty()) CompleteLocked(std::shared_ptr<Op>(pending_.front()));
    for (Peer& peer : peers_) {
      peer.sends.clear();
      peer.recvs.clear();
    }
    handoff_.clear();
  }
  Stop();
}

void Communicator::Stop() {
  {
    kvmesh::MutexLock lock(&mu_);
    stopping_ = true;
    changed_.notify_all();
  }
  Signal(wake_.get());
  if (thread_.joinable()) thread_.join();
  links_.clear();  // closes the connections
}

// ---- the thread -------------------------------------------------------------------------------

void Communicator::Run() {
  std::string error;
  bool stopped = false;
  const ncclResult_t result = Bootstrap(&error, &stopped);
  {
    kvmesh::MutexLock lock(&mu_);
    if (stopped || stopping_) return;
    if (result != ncclSuccess) {
      FailLocked(result, error);
    } else if (init_fault_) {
      FailLocked(*init_fault_, "initialization failed with " + ResultName(*init_fault_) +
                                   ", as KVMESH_NCCLSIM_ERROR planned");
    } else {
      initialized_ = true;
      changed_.notify_all();
    }
  }
  TransferLoop();
}

ncclResult_t Communicator::Bootstrap(std::string* error, bool* stopped) {
  const int stop = wake_.get();
  const std::string root = "the bootstrap root at 127.0.0.1:" + std::to_string(id_.root_port) +
                           " (pid " + std::to_string(id_.root_pid) + ")";
  // Other ranks connect to this rank's listener (none needed alone).
  Fd listener;
  uint16_t port = 0;
  if (nranks_ > 1 && ListenLoopback(&listener, &port, error) != Step::kDone) {
    *error = "cannot listen for the other ranks: " + *error;
    return ncclSystemError;
  }
  // A step that did not complete: the result for it, with *error saying what failed.
  auto failed = [&](Step step, const std::string& what) {
    *stopped = step == Step::kStopped;
    *error = what + ": " + *error;
    return step == Step::kClosed ? ncclRemoteError : ncclSystemError;
  };

  Fd connection;
  Step step = ConnectLoopback(id_.root_port, stop, &connection, error);
  if (step != Step::kDone) return failed(step, "cannot reach " + root);
  RootHello hello;
  std::memset(&hello, 0, sizeof(hello));
  hello.magic = kMessageMagic;
  hello.nranks = nranks_;
  hello.rank = rank_;
  hello.pid = getpid();
  hello.nonce = id_.nonce;
  hello.port = port;
  step = WriteFull(connection.get(), &hello, sizeof(hello), stop, error);
  if (step != Step::kDone) return failed(step, "cannot register with " + root);
  RootReply reply;
  step = ReadFull(connection.get(), &reply, sizeof(reply), stop, error);
  if (step != Step::kDone) return failed(step, "no answer from " + root);
  reply.message[sizeof(reply.message) - 1] = '\0';
  if (reply.magic != kMessageMagic) {
    *error = root + " answered with garbage";
    return ncclInternalError;
  }
  if (reply.result != ncclSuccess) {
    *error = root + " refused this rank: " + reply.message;
    return static_cast<ncclResult_t>(reply.result);
  }
  if (reply.nranks != nranks_) {
    *error = root + " answered with " + std::to_string(reply.nranks) + " ranks";
    return ncclInternalError;
  }
  std::vector<RankAddress> addresses(static_cast<size_t>(nranks_));
  step = ReadFull(connection.get(), addresses.data(), addresses.size() * sizeof(RankAddress), stop,
                  error);
  if (step != Step::kDone) return failed(step, "no answer from " + root);
  connection.reset();
  for (int r = 0; r < nranks_; ++r) links_[r].pid = addresses[r].pid;

  // Connect to the ranks below, accept the ranks above.
  PeerHello peer_hello;
  std::memset(&peer_hello, 0, sizeof(peer_hello));
  peer_hello.magic = kMessageMagic;
  peer_hello.rank = rank_;
  peer_hello.nonce = id_.nonce;
  for (int r = 0; r < rank_; ++r) {
    const std::string peer = PeerName(r) + " at 127.0.0.1:" + std::to_string(addresses[r].port);
    step = ConnectLoopback(addresses[r].port, stop, &links_[r].fd, error);
    if (step != Step::kDone) return failed(step, "cannot connect to " + peer);
    step = WriteFull(links_[r].fd.get(), &peer_hello, sizeof(peer_hello), stop, error);
    if (step != Step::kDone) return failed(step, "cannot greet " + peer);
  }
  for (int waiting = nranks_ - 1 - rank_; waiting > 0;) {
    Fd accepted;
    step = Accept(listener.get(), stop, &accepted, error);
    if (step != Step::kDone) return failed(step, "cannot accept the ranks above this one");
    PeerHello from;
    std::memset(&from, 0, sizeof(from));
    step = ReadFull(accepted.get(), &from, sizeof(from), stop, error);
    if (step == Step::kStopped) {
      *stopped = true;
      return ncclSystemError;
    }
    // A connection that is not a rank of this communicator is dropped; the wait goes on.
    if (step != Step::kDone || from.magic != kMessageMagic || !(from.nonce == id_.nonce) ||
        from.rank <= rank_ || from.rank >= nranks_ || links_[from.rank].fd.valid()) {
      continue;
    }
    links_[from.rank].fd = std::move(accepted);
    --waiting;
  }
  return ncclSuccess;
}

void Communicator::TransferLoop() {
  std::vector<pollfd> fds;
  std::vector<int> ranks;  // the rank of each entry of fds after the first
  std::vector<short> wanted;
  while (true) {
    fds.assign(1, pollfd{wake_.get(), POLLIN, 0});
    ranks.clear();
    wanted.clear();
    {
      kvmesh::MutexLock lock(&mu_);
      if (stopping_) return;
      // Queue what ncclGroupEnd handed over: this is what "launched" means here.
      while (!handoff_.empty()) {
        const std::shared_ptr<Op> op = std::move(handoff_.front());
        handoff_.pop_front();
        Peer& peer = peers_[op->peer];
        (op->send ? peer.sends : peer.recvs).push_back(op);
      }
      if (launching_ > 0) {
        launching_ = 0;
        changed_.notify_all();
      }
      for (int r = 0; r < nranks_ && error_ == ncclSuccess && initialized_; ++r) {
        if (r == rank_) continue;
        short events = ProgressLocked(r);
        const Peer& peer = peers_[r];
        // An idle connection is watched for the peer going away.
        if ((events & POLLIN) == 0 && !peer.hangup_seen && !peer.finalize_received) {
          events |= POLLRDHUP;
        }
        if (events != 0) {
          fds.push_back(pollfd{links_[r].fd.get(), events, 0});
          ranks.push_back(r);
          wanted.push_back(events);
        }
      }
      CheckFinalizedLocked();
      // After an error nothing moves until Abort or Destroy: only the wake-up is watched.
      if (error_ != ncclSuccess) {
        fds.resize(1);
        ranks.clear();
      }
    }
    if (poll(fds.data(), fds.size(), -1) < 0 && errno != EINTR) {
      kvmesh::MutexLock lock(&mu_);
      FailLocked(ncclSystemError, Errno("poll"));
      continue;
    }
    if ((fds[0].revents & POLLIN) != 0) Drain(wake_.get());
    for (size_t i = 0; i < ranks.size(); ++i) {
      const short revents = fds[i + 1].revents;
      // Reads find out themselves; only an idle connection needs a look.
      if ((wanted[i] & POLLIN) == 0 && (revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0) {
        kvmesh::MutexLock lock(&mu_);
        HangupLocked(ranks[i], revents);
      }
    }
  }
}

short Communicator::ProgressLocked(int rank) {
  short events = 0;
  if (SendLocked(rank)) events |= POLLOUT;
  if (error_ == ncclSuccess && RecvLocked(rank)) events |= POLLIN;
  return error_ == ncclSuccess ? events : 0;
}

bool Communicator::SendLocked(int rank) {
  Peer& peer = peers_[rank];
  const int fd = links_[rank].fd.get();
  while (error_ == ncclSuccess) {
    std::shared_ptr<Op> op = peer.sends.empty() ? nullptr : peer.sends.front();
    if (op != nullptr) {
      if (!op->started || op->fault.hang) return false;
      if (op->fault.failure) {
        FailLocked(*op->fault.failure, "a send of " + Bytes(op->bytes) + " to " + PeerName(rank) +
                                           " failed with " + ResultName(*op->fault.failure) +
                                           ", as KVMESH_NCCLSIM_ERROR planned");
        return false;
      }
      peer.out_frame = Frame{kMessageMagic, kData, op->bytes};
    } else if (finalize_ == Finalizing::kRequested && handoff_.empty() && !peer.finalize_sent) {
      peer.out_frame = Frame{kMessageMagic, kFinalize, 0};
    } else {
      return false;
    }
    const size_t payload = op != nullptr ? op->bytes : 0;
    const char* header = reinterpret_cast<const char*>(&peer.out_frame);
    size_t header_bytes = 0;
    size_t offset = 0;  // into the payload
    if (peer.out_done < sizeof(Frame)) {
      header += peer.out_done;
      header_bytes = sizeof(Frame) - peer.out_done;
    } else {
      offset = peer.out_done - sizeof(Frame);
    }
    const ssize_t n =
        WriteSome(fd, header, header_bytes, op != nullptr ? op->data + offset : nullptr,
                  std::min(payload - offset, kMaxIoBytes));
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
      IoFailedLocked(rank, op != nullptr ? "sending" : "sending the finalize message", false);
      return false;
    }
    peer.out_done += static_cast<size_t>(n);
    if (peer.out_done < sizeof(Frame) + payload) continue;
    peer.out_done = 0;
    if (op != nullptr) {
      peer.sends.pop_front();
      CompleteLocked(op);
    } else {
      peer.finalize_sent = true;
    }
  }
  return false;
}

bool Communicator::RecvLocked(int rank) {
  Peer& peer = peers_[rank];
  const int fd = links_[rank].fd.get();
  while (error_ == ncclSuccess) {
    std::shared_ptr<Op> op = peer.recvs.empty() ? nullptr : peer.recvs.front();
    if (op != nullptr) {
      if (!op->started || op->fault.hang) return false;
      if (op->fault.failure) {
        FailLocked(*op->fault.failure, "a receive of " + Bytes(op->bytes) + " from " +
                                           PeerName(rank) + " failed with " +
                                           ResultName(*op->fault.failure) +
                                           ", as KVMESH_NCCLSIM_ERROR planned");
        return false;
      }
    } else if (finalize_ != Finalizing::kRequested || !handoff_.empty() || peer.finalize_received) {
      return false;
    }
    if (peer.in_header < sizeof(Frame)) {
      const ssize_t n = ReadSome(fd, reinterpret_cast<char*>(&peer.in_frame) + peer.in_header,
                                 sizeof(Frame) - peer.in_header);
      if (n <= 0) {
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
        IoFailedLocked(rank, op != nullptr ? "receiving" : "waiting for its finalize message",
                       n == 0);
        return false;
      }
      peer.in_header += static_cast<size_t>(n);
      if (peer.in_header < sizeof(Frame)) continue;
      const Frame& frame = peer.in_frame;
      if (frame.magic != kMessageMagic || (frame.kind != kData && frame.kind != kFinalize)) {
        FailLocked(ncclInternalError, PeerName(rank) + " sent garbage");
        return false;
      }
      if (frame.kind == kFinalize) {
        if (op != nullptr) {
          // Its side is going away: as a closed connection, not as this rank's misuse.
          FailLocked(ncclRemoteError, PeerName(rank) +
                                          " finalized its communicator while this rank still "
                                          "expected " +
                                          Bytes(op->bytes) + " from it");
          return false;
        }
        peer.in_header = 0;
        peer.finalize_received = true;
        continue;
      }
      if (op == nullptr) {
        FailLocked(ncclInvalidUsage, PeerName(rank) + " sent " + Bytes(frame.bytes) +
                                         " that no receive of this rank matches (a send "
                                         "without a matching receive before ncclCommFinalize)");
        return false;
      }
      if (frame.bytes != op->bytes) {
        FailLocked(ncclInvalidUsage, PeerName(rank) + " sent " + Bytes(frame.bytes) +
                                         ", but the matching receive expects " + Bytes(op->bytes));
        return false;
      }
    }
    if (peer.in_done < op->bytes) {
      const ssize_t n =
          ReadSome(fd, op->data + peer.in_done, std::min(op->bytes - peer.in_done, kMaxIoBytes));
      if (n <= 0) {
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
        IoFailedLocked(rank, "receiving", n == 0);
        return false;
      }
      peer.in_done += static_cast<size_t>(n);
      if (peer.in_done < op->bytes) continue;
    }
    peer.in_header = 0;
    peer.in_done = 0;
    peer.recvs.pop_front();
    CompleteLocked(op);
  }
  return false;
}

void Communicator::IoFailedLocked(int rank, const char* doing, bool end_of_file) {
  const int error = errno;
  if (end_of_file || IsDisconnect(error)) {
    FailLocked(ncclRemoteError,
               std::string(doing) + ": " + PeerName(rank) +
                   " closed its connection (its process exited, or it aborted or destroyed "
                   "its communicator)" +
                   (end_of_file ? std::string() : std::string(": ") + std::strerror(error)));
  } else {
    FailLocked(ncclSystemError,
               std::string(doing) + " (" + PeerName(rank) + "): " + std::strerror(error));
  }
}

void Communicator::HangupLocked(int rank, short revents) {
  Peer& peer = peers_[rank];
  const int fd = links_[rank].fd.get();
  if ((revents & POLLERR) != 0) {
    int error = 0;
    socklen_t length = sizeof(error);
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length) != 0) error = errno;
    errno = error;
    IoFailedLocked(rank, "idle", false);
    return;
  }
  peer.hangup_seen = true;
  // What it sent before it went is still for the receives to come (its finalize message, say).
  int buffered = 0;
  if (ioctl(fd, FIONREAD, &buffered) == 0 && buffered > 0) return;
  errno = 0;
  IoFailedLocked(rank, "idle", true);
}

void Communicator::CheckFinalizedLocked() {
  if (finalize_ != Finalizing::kRequested || error_ != ncclSuccess) return;
  if (!handoff_.empty() || !pending_.empty()) return;
  for (int r = 0; r < nranks_; ++r) {
    if (r != rank_ && (!peers_[r].finalize_sent || !peers_[r].finalize_received)) return;
  }
  finalize_ = Finalizing::kDone;
  changed_.notify_all();
}

}  // namespace ncclsim

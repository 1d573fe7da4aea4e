// Loopback TCP for the simulator's bootstrap and its rank-to-rank connections: an owning file
// descriptor, and blocking steps (connect, accept, read or write a whole message) that a
// communicator's thread can stop from another thread through an eventfd.
//
// Why stoppable steps: NCCL's bootstrap blocks until every rank has joined, and only
// ncclCommAbort ends a bootstrap whose peers never come; every wait here polls the socket and
// the stop eventfd together, so an abort never waits for a peer. Sockets are non-blocking
// throughout (the transfer loop of communicator.cc needs them so).
//
// Only 127.0.0.1: the simulator connects processes of one machine.
//
// Thread safety: Fd is not thread-safe; the functions are (each works on its arguments only).
#ifndef KVMESH_TESTS_TESTING_NCCLSIM_SOCKET_H_
#define KVMESH_TESTS_TESTING_NCCLSIM_SOCKET_H_

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

namespace ncclsim {

// Owns a file descriptor (-1: none) and closes it when destroyed or reset.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

// How a stoppable step ended. kClosed and kFailed come with a message.
enum class Step {
  kDone,
  kStopped,  // the stop eventfd became readable
  kClosed,   // the other side closed the connection (end of file, reset, broken pipe)
  kFailed,   // any other error of this side
};

// "what: strerror(errno)".
std::string Errno(const char* what);

// An eventfd for stop and wake-up signals (non-blocking, close-on-exec); an invalid Fd and
// *error set when it cannot be made.
Fd MakeEventFd(std::string* error);
// Makes `event_fd` readable (adds 1); safe from any thread.
void Signal(int event_fd);
// Consumes the pending signals of `event_fd`.
void Drain(int event_fd);

// A listening socket on 127.0.0.1 with a port the kernel picks (*port).
Step ListenLoopback(Fd* listener, uint16_t* port, std::string* error);
// Connects to 127.0.0.1:port. kClosed when nothing listens there (the process is gone).
Step ConnectLoopback(uint16_t port, int stop_fd, Fd* connection, std::string* error);
// Accepts one connection on `listener`.
Step Accept(int listener, int stop_fd, Fd* connection, std::string* error);
// Reads exactly `bytes` bytes (kClosed on an early end of file).
Step ReadFull(int fd, void* data, size_t bytes, int stop_fd, std::string* error);
// Writes exactly `bytes` bytes.
Step WriteFull(int fd, const void* data, size_t bytes, int stop_fd, std::string* error);

// One non-blocking read or write of at most `bytes`: the byte count; 0 for end of file (reads
// only); -1 with errno EAGAIN when it would block; -1 with another errno on failure. Writes
// never raise SIGPIPE. `header` (may be empty) is written before `data` in the same call.
ssize_t ReadSome(int fd, void* data, size_t bytes);
ssize_t WriteSome(int fd, const void* header, size_t header_bytes, const void* data, size_t bytes);
// Whether `error` (an errno) means that the other side went away.
bool IsDisconnect(int error);

}  // namespace ncclsim

#endif  // KVMESH_TESTS_TESTING_NCCLSIM_SOCKET_H_

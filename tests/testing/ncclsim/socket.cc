#include "tests/testing/ncclsim/socket.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cstring>

namespace ncclsim {
namespace {

sockaddr_in Loopback(uint16_t port) {
  sockaddr_in address;
  std::memset(&address, 0, sizeof(address));
  address.sin_family = AF_INET;
  address.sin_port = htons(port);
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return address;
}

// Waits until `fd` shows one of `events` (or an error or hang-up) or `stop_fd` (-1: none) is
// readable.
Step WaitFor(int fd, short events, int stop_fd, std::string* error) {
  pollfd fds[2] = {{fd, events, 0}, {stop_fd, POLLIN, 0}};
  while (true) {
    const int ready = poll(fds, stop_fd >= 0 ? 2 : 1, -1);
    if (ready < 0) {
      if (errno == EINTR) continue;
      *error = Errno("poll");
      return Step::kFailed;
    }
    if (stop_fd >= 0 && (fds[1].revents & POLLIN) != 0) return Step::kStopped;
    if (fds[0].revents != 0) return Step::kDone;
  }
}

Step Failure(const char* what, std::string* error) {
  const int saved = errno;
  *error = Errno(what);
  return IsDisconnect(saved) ? Step::kClosed : Step::kFailed;
}

}  // namespace

Fd& Fd::operator=(Fd&& o) noexcept {
  if (this != &o) reset(std::exchange(o.fd_, -1));
  return *this;
}

void Fd::reset(int fd) {
  if (fd_ >= 0) close(fd_);
  fd_ = fd;
}

std::string Errno(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

bool IsDisconnect(int error) {
  return error == ECONNREFUSED || error == ECONNRESET || error == EPIPE || error == ECONNABORTED;
}

Fd MakeEventFd(std::string* error) {
  Fd fd(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!fd.valid()) *error = Errno("eventfd");
  return fd;
}

void Signal(int event_fd) {
  const uint64_t one = 1;
  // EAGAIN means the counter is saturated: it is readable already.
  while (write(event_fd, &one, sizeof(one)) < 0 && errno == EINTR) {
  }
}

void Drain(int event_fd) {
  uint64_t count;
  while (read(event_fd, &count, sizeof(count)) < 0 && errno == EINTR) {
  }
}

Step ListenLoopback(Fd* listener, uint16_t* port, std::string* error) {
  Fd fd(socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return Failure("socket", error);
  sockaddr_in address = Loopback(0);
  if (bind(fd.get(), reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    return Failure("bind 127.0.0.1:0", error);
  }
  if (listen(fd.get(), SOMAXCONN) != 0) return Failure("listen", error);
  socklen_t length = sizeof(address);
  if (getsockname(fd.get(), reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    return Failure("getsockname", error);
  }
  *port = ntohs(address.sin_port);
  *listener = std::move(fd);
  return Step::kDone;
}

Step ConnectLoopback(uint16_t port, int stop_fd, Fd* connection, std::string* error) {
  Fd fd(socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return Failure("socket", error);
  const std::string what = "connect to 127.0.0.1:" + std::to_string(port);
  sockaddr_in address = Loopback(port);
  if (connect(fd.get(), reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    if (errno != EINPROGRESS) return Failure(what.c_str(), error);
    const Step step = WaitFor(fd.get(), POLLOUT, stop_fd, error);
    if (step != Step::kDone) return step;
    int result = 0;
    socklen_t length = sizeof(result);
    if (getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &result, &length) != 0) {
      return Failure("getsockopt(SO_ERROR)", error);
    }
    if (result != 0) {
      errno = result;
      return Failure(what.c_str(), error);
    }
  }
  *connection = std::move(fd);
  return Step::kDone;
}

Step Accept(int listener, int stop_fd, Fd* connection, std::string* error) {
  while (true) {
    const int fd = accept4(listener, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      connection->reset(fd);
      return Step::kDone;
    }
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return Failure("accept", error);
    const Step step = WaitFor(listener, POLLIN, stop_fd, error);
    if (step != Step::kDone) return step;
  }
}

Step ReadFull(int fd, void* data, size_t bytes, int stop_fd, std::string* error) {
  uint8_t* at = static_cast<uint8_t*>(data);
  while (bytes > 0) {
    const ssize_t n = ReadSome(fd, at, bytes);
    if (n > 0) {
      at += n;
      bytes -= static_cast<size_t>(n);
      continue;
    }
    if (n == 0) {
      *error = "the connection was closed";
      return Step::kClosed;
    }
    if (errno != EAGAIN && errno != EWOULDBLOCK) return Failure("read", error);
    const Step step = WaitFor(fd, POLLIN, stop_fd, error);
    if (step != Step::kDone) return step;
  }
  return Step::kDone;
}

Step WriteFull(int fd, const void* data, size_t bytes, int stop_fd, std::string* error) {
  const uint8_t* at = static_cast<const uint8_t*>(data);
  while (bytes > 0) {
    const ssize_t n = WriteSome(fd, nullptr, 0, at, bytes);
    if (n >= 0) {
      at += n;
      bytes -= static_cast<size_t>(n);
      continue;
    }
    if (errno != EAGAIN && errno != EWOULDBLOCK) return Failure("write", error);
    const Step step = WaitFor(fd, POLLOUT, stop_fd, error);
    if (step != Step::kDone) return step;
  }
  return Step::kDone;
}

ssize_t ReadSome(int fd, void* data, size_t bytes) {
  while (true) {
    const ssize_t n = read(fd, data, bytes);
    if (n >= 0 || errno != EINTR) return n;
  }
}

ssize_t WriteSome(int fd, const void* header, size_t header_bytes, const void* data, size_t bytes) {
  iovec parts[2];
  int count = 0;
  if (header_bytes > 0) parts[count++] = {const_cast<void*>(header), header_bytes};
  if (bytes > 0) parts[count++] = {const_cast<void*>(data), bytes};
  msghdr message;
  std::memset(&message, 0, sizeof(message));
  message.msg_iov = parts;
  message.msg_iovlen = static_cast<size_t>(count);
  while (true) {
    const ssize_t n = sendmsg(fd, &message, MSG_NOSIGNAL);
    if (n >= 0 || errno != EINTR) return n;
  }
}

}  // namespace ncclsim

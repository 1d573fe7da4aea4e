#include "tests/bench/tcp_reference.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvmesh {
namespace testutil {

absl::Status ErrnoStatus(absl::string_view what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

namespace {
using Clock = std::chrono::steady_clock;
}  // namespace

absl::StatusOr<std::vector<double>> LoopbackTcpSeconds(size_t bytes, int reps) {
  const int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listener < 0) return ErrnoStatus("socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(listener, 1) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const absl::Status s = ErrnoStatus("bind/listen on 127.0.0.1");
    close(listener);
    return s;
  }
  const int sender = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (sender < 0 || connect(sender, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const absl::Status s = ErrnoStatus("connect to 127.0.0.1");
    if (sender >= 0) close(sender);
    close(listener);
    return s;
  }
  const int receiver = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
  close(listener);
  if (receiver < 0) {
    const absl::Status s = ErrnoStatus("accept");
    close(sender);
    return s;
  }

  // Touched once, so that neither side measures first-touch page faults.
  std::vector<char> out(kTcpBufferBytes, 'x');
  std::vector<char> in(kTcpBufferBytes, 0);
  std::vector<double> seconds;
  absl::Status status;
  for (int rep = 0; rep < reps && status.ok(); ++rep) {
    Clock::time_point received_at;
    absl::Status receive_status;
    std::thread reader([&] {
      size_t got = 0;
      while (got < bytes) {
        const ssize_t n = recv(receiver, in.data(), std::min(in.size(), bytes - got), 0);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
          receive_status = n == 0 ? absl::DataLossError("recv: the connection closed early")
                                  : ErrnoStatus("recv");
          return;
        }
        got += static_cast<size_t>(n);
      }
      received_at = Clock::now();
    });
    const Clock::time_point start = Clock::now();
    size_t sent = 0;
    while (sent < bytes) {
      const size_t want = std::min(out.size(), bytes - sent);
      const ssize_t n = send(sender, out.data(), want, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        status = ErrnoStatus("send");
        shutdown(sender, SHUT_RDWR);  // ends the reader's recv
        break;
      }
      sent += static_cast<size_t>(n);
    }
    reader.join();
    if (status.ok()) status = receive_status;
    if (status.ok()) seconds.push_back(std::chrono::duration<double>(received_at - start).count());
  }
  close(sender);
  close(receiver);
  if (!status.ok()) return status;
  return seconds;
}

}  // namespace testutil
}  // namespace kvmesh

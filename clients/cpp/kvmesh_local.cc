#include "clients/cpp/kvmesh_local.h"

#include <errno.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvmesh {
namespace local {

void CopyRows(void* dst, const void* src, size_t bytes) {
#if defined(__SSE2__)
  if (bytes >= kStreamCopyBytes) {
    auto* d = static_cast<uint8_t*>(dst);
    const auto* s = static_cast<const uint8_t*>(src);
    // Up to the destination's first 16-byte boundary, then whole 64-byte lines, then the rest.
    const size_t head = (16 - reinterpret_cast<uintptr_t>(d) % 16) % 16;
    std::memcpy(d, s, head);
    d += head;
    s += head;
    bytes -= head;
    for (; bytes >= 64; bytes -= 64, d += 64, s += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
      const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(d), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), e);
    }
    _mm_sfence();  // the streamed stores are visible before anything after the copy
    std::memcpy(d, s, bytes);
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

namespace {

absl::Status StatusOf(const v1::LocalResponse& response) {
  if (response.code() == 0) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(response.code()), response.message());
}

bool WriteAll(int fd, const std::string& bytes) {
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n = send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    sent += static_cast<size_t>(n);
  }
  return true;
}

// Reads exactly `n` bytes; descriptors that come with them are appended to *fds.
bool ReadAll(int fd, char* out, size_t n, std::vector<int>* fds) {
  size_t got = 0;
  while (got < n) {
    iovec iov{out + got, n - got};
    char control[CMSG_SPACE(sizeof(int) * 64)];
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    const ssize_t r = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int received;
        std::memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        fds->push_back(received);
      }
    }
    got += static_cast<size_t>(r);
  }
  return true;
}

}  // namespace

namespace {

// Maps (host) or takes the descriptor of (GPU) one group's memory; *fd is -1 once taken.
absl::Status MapGroup(const v1::LocalGroupMemory& memory, int* fd, MappedGroup* group) {
  group->bytes = memory.bytes();
  group->cells = memory.cells();
  for (const v1::LocalPlane& plane : memory.planes()) {
    group->planes.push_back({plane.offset(), plane.row_bytes()});
  }
  if (memory.kind() == v1::LOCAL_MEMORY_CUDA) {
    // GPU memory: the engine imports the descriptor with its CUDA driver (MappedGroup).
    group->cuda_device = memory.device();
    group->cuda_fd = *fd;
    *fd = -1;
    return absl::OkStatus();
  }
  void* base =
      mmap(nullptr, group->bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, *fd, 0);
  if (base == MAP_FAILED) {
    return absl::InternalError(
        absl::StrCat("mapping ", group->bytes, " bytes of a group: ", std::strerror(errno)));
  }
  group->base = static_cast<uint8_t*>(base);
  return absl::OkStatus();
}

}  // namespace

MappedCache::~MappedCache() {
  for (const MappedGroup& g : groups_) {
    if (g.base != nullptr) munmap(g.base, g.bytes);
    if (g.cuda_fd >= 0) close(g.cuda_fd);
  }
}

absl::StatusOr<std::unique_ptr<Session>> Session::Connect(const std::string& path,
                                                          const std::string& token,
                                                          const std::string& tenant) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("socket path '", path, "' is too long"));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("socket: ", std::strerror(errno)));
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int error = errno;
    close(fd);
    return absl::UnavailableError(
        absl::StrCat("cannot connect to ", path, ": ", std::strerror(error)));
  }
  std::unique_ptr<Session> session(new Session(fd));
  v1::LocalRequest hello;
  hello.mutable_hello()->set_token(token);
  hello.mutable_hello()->set_tenant(tenant);
  absl::StatusOr<v1::LocalResponse> response = session->Call(std::move(hello));
  if (!response.ok()) return response.status();
  if (absl::Status s = StatusOf(*response); !s.ok()) return s;
  session->tenant_ = response->hello().tenant();
  return session;
}

Session::~Session() { close(fd_); }

absl::StatusOr<v1::LocalResponse> Session::Call(v1::LocalRequest request, std::vector<int>* fds) {
  request.set_id(next_id_++);
  const std::string body = request.SerializeAsString();
  std::string frame(4, '\0');
  const uint32_t length = static_cast<uint32_t>(body.size());
  for (int i = 0; i < 4; ++i) frame[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  frame += body;
  // A node that refuses the session (too many sessions) answers and closes before it reads:
  // its answer may still be there to read when the write fails.
  const bool written = WriteAll(fd_, frame);
  std::vector<int> received;
  char header[4];
  if (!ReadAll(fd_, header, 4, &received)) {
    for (int f : received) close(f);
    return absl::UnavailableError(written ? "the node closed the local session"
                                          : "the node closed the local session before the request");
  }
  uint32_t size = 0;
  for (int i = 0; i < 4; ++i) size |= uint32_t{static_cast<uint8_t>(header[i])} << (8 * i);
  std::string reply(size, '\0');
  v1::LocalResponse response;
  if (!ReadAll(fd_, reply.data(), size, &received) || !response.ParseFromString(reply)) {
    for (int f : received) close(f);
    return absl::UnavailableError("the node's local response was cut off or malformed");
  }
  if (fds != nullptr) {
    fds->insert(fds->end(), received.begin(), received.end());
  } else {
    for (int f : received) close(f);
  }
  return response;
}

absl::StatusOr<std::unique_ptr<MappedCache>> Session::Attach(const std::string& cache) {
  v1::LocalRequest request;
  request.mutable_attach()->set_cache(cache);
  std::vector<int> fds;
  absl::StatusOr<v1::LocalResponse> response = Call(std::move(request), &fds);
  if (!response.ok()) return response.status();
  std::unique_ptr<MappedCache> mapped(new MappedCache());
  absl::Status status = StatusOf(*response);
  if (status.ok() && fds.size() != static_cast<size_t>(response->attach().groups_size())) {
    status = absl::InternalError(absl::StrCat("the node sent ", fds.size(), " descriptors for ",
                                              response->attach().groups_size(), " groups"));
  }
  for (size_t g = 0; status.ok() && g < fds.size(); ++g) {
    status = MapGroup(response->attach().groups(static_cast<int>(g)), &fds[g],
                      &mapped->groups_.emplace_back());
  }
  for (int f : fds) {
    if (f >= 0) close(f);  // the mappings keep the memory
  }
  if (!status.ok()) return status;
  mapped->spec_ = response->attach().spec();
  return mapped;
}

absl::StatusOr<Pin> Session::PinCells(const std::string& cache, int64_t seq, int32_t begin,
                                      std::optional<int32_t> end, absl::Duration lease,
                                      const std::vector<int32_t>& queries) {
  v1::LocalRequest request;
  v1::LocalPin* pin = request.mutable_pin();
  pin->set_cache(cache);
  pin->set_seq(seq);
  pin->set_begin(begin);
  if (end.has_value()) {
    pin->set_end(*end);
    pin->set_has_end(true);
  }
  pin->set_lease_ms(absl::ToInt64Milliseconds(lease));
  pin->mutable_queries()->Add(queries.begin(), queries.end());
  absl::StatusOr<v1::LocalResponse> response = Call(std::move(request));
  if (!response.ok()) return response.status();
  if (absl::Status s = StatusOf(*response); !s.ok()) return s;
  Pin out;
  out.id = response->pin().pin();
  for (const v1::LocalGroupCells& g : response->pin().groups()) {
    out.positions.emplace_back(g.positions().begin(), g.positions().end());
    out.cells.emplace_back(g.cells().begin(), g.cells().end());
    std::vector<std::vector<PositionRange>>& visible = out.visible.emplace_back();
    for (const v1::LocalVisibleRanges& v : g.visible()) {
      std::vector<PositionRange>& ranges = visible.emplace_back();
      for (int i = 0; i < v.first_size() && i < v.last_size(); ++i) {
        ranges.push_back({v.first(i), v.last(i)});
      }
    }
  }
  out.expires = absl::FromUnixMillis(response->pin().expires_unix_ms());
  return out;
}

absl::StatusOr<AppendPlan> Session::BeginAppend(const std::string& cache,
                                                const std::vector<int64_t>& seqs,
                                                const std::vector<int32_t>& positions,
                                                const std::vector<int32_t>& token_ids,
                                                bool speculative, absl::Duration lease) {
  v1::LocalRequest request;
  v1::LocalBeginAppend* begin = request.mutable_begin_append();
  begin->set_cache(cache);
  begin->mutable_seqs()->Add(seqs.begin(), seqs.end());
  begin->mutable_positions()->Add(positions.begin(), positions.end());
  begin->mutable_token_ids()->Add(token_ids.begin(), token_ids.end());
  begin->set_speculative(speculative);
  begin->set_lease_ms(absl::ToInt64Milliseconds(lease));
  std::vector<int> fds;
  absl::StatusOr<v1::LocalResponse> response = Call(std::move(request), &fds);
  if (!response.ok()) return response.status();
  AppendPlan plan;
  absl::Status status = StatusOf(*response);
  plan.id = response->begin_append().plan();
  size_t next_fd = 0;
  for (const v1::LocalGroupCells& g : response->begin_append().groups()) {
    plan.cells.emplace_back(g.cells().begin(), g.cells().end());
    if (!status.ok() || !g.has_staging()) continue;
    if (plan.staging == nullptr) plan.staging.reset(new MappedCache());
    plan.staging->groups_.resize(plan.cells.size());
    if (next_fd == fds.size()) {
      status = absl::InternalError("the node sent fewer descriptors than staging groups");
      break;
    }
    status = MapGroup(g.staging(), &fds[next_fd++], &plan.staging->groups_.back());
  }
  for (int f : fds) {
    if (f >= 0) close(f);  // the mappings keep the memory
  }
  if (!status.ok()) {
    // The node made the plan: give its rows back now rather than at the lease's end.
    if (StatusOf(*response).ok()) AbandonAppend(plan.id).IgnoreError();
    return status;
  }
  if (plan.staging != nullptr) plan.staging->groups_.resize(plan.cells.size());
  plan.expires = absl::FromUnixMillis(response->begin_append().expires_unix_ms());
  return plan;
}

absl::Status Session::CallForStatus(v1::LocalRequest request) {
  absl::StatusOr<v1::LocalResponse> response = Call(std::move(request));
  if (!response.ok()) return response.status();
  return StatusOf(*response);
}

absl::Status Session::CommitAppend(uint64_t plan) {
  v1::LocalRequest request;
  request.mutable_commit_append()->set_plan(plan);
  return CallForStatus(std::move(request));
}

absl::Status Session::AbandonAppend(uint64_t plan) {
  v1::LocalRequest request;
  request.mutable_abandon_append()->set_plan(plan);
  return CallForStatus(std::move(request));
}

absl::Status Session::Unpin(uint64_t pin) {
  v1::LocalRequest request;
  request.mutable_unpin()->set_pin(pin);
  return CallForStatus(std::move(request));
}

}  // namespace local
}  // namespace kvmesh

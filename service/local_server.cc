#include "service/local_server.h"

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cache/cache.h"
#include "kvmesh/v1/local.pb.h"
#include "service/common/convert.h"
#include "service/common/log.h"

namespace kvmesh {

namespace {

// How often a session looks at its pins' leases and at the server stopping while it waits.
constexpr int kPollMs = 100;

// Writes all of `bytes`, with `fds` attached to the first byte (SCM_RIGHTS). false when the
// peer is gone.
bool SendAll(int fd, const std::string& bytes, const std::vector<int>& fds) {
  size_t sent = 0;
  while (sent < bytes.size()) {
    iovec iov{const_cast<char*>(bytes.data() + sent), bytes.size() - sent};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    std::vector<char> control;
    if (sent == 0 && !fds.empty()) {
      control.resize(CMSG_SPACE(sizeof(int) * fds.size()));
      msg.msg_control = control.data();
      msg.msg_controllen = control.size();
      cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
      cmsg->cmsg_level = SOL_SOCKET;
      cmsg->cmsg_type = SCM_RIGHTS;
      cmsg->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
      std::memcpy(CMSG_DATA(cmsg), fds.data(), sizeof(int) * fds.size());
    }
    const ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    sent += static_cast<size_t>(n);
  }
  return true;
}

bool SendResponse(int fd, const v1::LocalResponse& response, const std::vector<int>& fds = {}) {
  const std::string body = response.SerializeAsString();
  std::string frame(4, '\0');
  const uint32_t length = static_cast<uint32_t>(body.size());
  for (int i = 0; i < 4; ++i) frame[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  frame += body;
  return SendAll(fd, frame, fds);
}

// What a worker needs to map a group's memory (its descriptor goes with the response).
void DescribeMemory(const SharedGroup& group, v1::LocalGroupMemory* memory) {
  memory->set_bytes(group.memory.size);
  memory->set_cells(group.cells);
  if (group.memory.kind == SharedArena::Kind::kCudaMemory) {
    memory->set_kind(v1::LOCAL_MEMORY_CUDA);
    memory->set_device(group.memory.device);
  }
  for (const Plane& plane : group.planes) {
    v1::LocalPlane* p = memory->add_planes();
    p->set_offset(plane.offset);
    p->set_row_bytes(plane.row_bytes);
  }
}

v1::LocalResponse ErrorResponse(uint64_t id, const absl::Status& status) {
  v1::LocalResponse response;
  response.set_id(id);
  response.set_code(static_cast<int>(status.code()));
  response.set_message(std::string(status.message()));
  return response;
}

}  // namespace

struct LocalServer::Session {
  int fd = -1;
  std::thread thread;
  std::atomic<bool> done{false};
  // Set by Hello.
  std::optional<Principal> principal;
  std::string token;
  std::string tenant;
  uint64_t generation = 0;
  struct Pin {
    Cache::PinnedCells cells;
    absl::Time expires;
  };
  std::map<uint64_t, Pin> pins;
  uint64_t next_pin = 1;
  struct Plan {
    std::unique_ptr<AppendWriter> writer;
    absl::Time expires;
  };
  std::map<uint64_t, Plan> plans;
  uint64_t next_plan = 1;
};

absl::StatusOr<std::unique_ptr<LocalServer>> LocalServer::Start(Options options) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (options.path.empty() || options.path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("--local-socket=", options.path,
                                                   " must be a path of 1 to ",
                                                   sizeof(addr.sun_path) - 1, " bytes"));
  }
  std::memcpy(addr.sun_path, options.path.data(), options.path.size());
  struct stat st;
  if (lstat(options.path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--local-socket=", options.path, " exists and is not a socket: not replacing it"));
    }
    unlink(options.path.c_str());
  }
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("socket: ", std::strerror(errno)));
  // Made 0660 from the start: no moment when others could connect.
  const mode_t old_mask = umask(0117);
  const int bound = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  const int bind_error = errno;
  umask(old_mask);
  if (bound != 0 || listen(fd, 64) != 0) {
    const int error = bound != 0 ? bind_error : errno;
    close(fd);
    return absl::UnavailableError(
        absl::StrCat("cannot listen on --local-socket=", options.path, ": ", std::strerror(error)));
  }
  std::unique_ptr<LocalServer> server(new LocalServer(std::move(options), fd));
  server->acceptor_ = std::thread([s = server.get()] { s->AcceptLoop(); });
  return server;
}

LocalServer::LocalServer(Options options, int listen_fd)
    : options_(std::move(options)), listen_fd_(listen_fd) {}

LocalServer::~LocalServer() {
  stopping_.store(true);
  shutdown(listen_fd_, SHUT_RDWR);
  if (acceptor_.joinable()) acceptor_.join();
  close(listen_fd_);
  std::vector<std::unique_ptr<Session>> sessions;
  {
    MutexLock lock(&mu_);
    sessions.swap(sessions_);
  }
  for (auto& session : sessions) {
    shutdown(session->fd, SHUT_RDWR);
    if (session->thread.joinable()) session->thread.join();
    close(session->fd);
  }
  unlink(options_.path.c_str());
}

size_t LocalServer::sessions() const {
  MutexLock lock(&mu_);
  size_t open = 0;
  for (const auto& session : sessions_) open += !session->done.load();
  return open;
}

void LocalServer::AcceptLoop() {
  while (!stopping_.load()) {
    pollfd p{listen_fd_, POLLIN, 0};
    if (poll(&p, 1, kPollMs) <= 0) continue;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    MutexLock lock(&mu_);
    // Sessions that ended: their threads have returned.
    for (auto it = sessions_.begin(); it != sessions_.end();) {
      if ((*it)->done.load()) {
        (*it)->thread.join();
        close((*it)->fd);
        it = sessions_.erase(it);
      } else {
        ++it;
      }
    }
    if (sessions_.size() >= static_cast<size_t>(options_.max_sessions)) {
      SendResponse(fd, ErrorResponse(0, absl::ResourceExhaustedError(absl::StrCat(
                                            "kvmesh-node ", options_.node_name, " serves ",
                                            options_.max_sessions,
                                            " local sessions already; try again later"))));
      refusals_.fetch_add(1);
      close(fd);
      continue;
    }
    // A worker that stops reading its answers must not hold its session thread, and with it its
    // pins past their leases: a send that waits this long ends the session.
    const timeval send_timeout{5, 0};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &send_timeout, sizeof(send_timeout));
    auto session = std::make_unique<Session>();
    session->fd = fd;
    Session* s = session.get();
    sessions_.push_back(std::move(session));
    sessions_total_.fetch_add(1);
    s->thread = std::thread([this, s] {
      Serve(s);
      // The worker sees the end at once; the descriptor is closed when the session is reaped.
      shutdown(s->fd, SHUT_RDWR);
      // Pins go with the session, before anyone can take it for ended.
      pins_.fetch_sub(s->pins.size());
      plans_.fetch_sub(s->plans.size());
      s->pins.clear();
      s->plans.clear();
      s->done.store(true);
    });
  }
}

namespace {

// Reads exactly `n` bytes, waking every kPollMs to call `expire` and to see `stopping`.
// false when the peer closed, an error, or stopping.
template <typename Expire>
bool ReadExactly(int fd, char* out, size_t n, const std::atomic<bool>& stopping,
                 absl::Time deadline, Expire expire) {
  size_t got = 0;
  while (got < n) {
    if (stopping.load() || absl::Now() >= deadline) return false;
    expire();
    pollfd p{fd, POLLIN, 0};
    const int ready = poll(&p, 1, kPollMs);
    if (ready < 0 && errno != EINTR) return false;
    if (ready <= 0) continue;
    const ssize_t r = recv(fd, out + got, n - got, 0);
    if (r == 0) return false;
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return false;
    }
    got += static_cast<size_t>(r);
  }
  return true;
}

}  // namespace

void LocalServer::Serve(Session* session) {
  const int fd = session->fd;
  // An error answer, counted (kvmesh_local_refusals_total).
  auto refuse = [&](const v1::LocalResponse& response) {
    refusals_.fetch_add(1);
    return SendResponse(fd, response);
  };
  auto expire = [&] {
    const absl::Time now = absl::Now();
    for (auto it = session->pins.begin(); it != session->pins.end();) {
      if (it->second.expires <= now) {
        it = session->pins.erase(it);
        pins_.fetch_sub(1);
      } else {
        ++it;
      }
    }
    for (auto it = session->plans.begin(); it != session->plans.end();) {
      // The writer's destruction gives its cells back.
      if (it->second.expires <= now) {
        it = session->plans.erase(it);
        plans_.fetch_sub(1);
      } else {
        ++it;
      }
    }
  };
  // A lease asked for in ms: 0 for the default; INVALID_ARGUMENT outside [0, max_lease].
  auto lease = [&](int64_t lease_ms) -> absl::StatusOr<absl::Time> {
    if (lease_ms < 0 || absl::Milliseconds(lease_ms) > options_.max_lease) {
      return absl::InvalidArgumentError(absl::StrCat("lease_ms = ", lease_ms, " is outside [0, ",
                                                     absl::ToInt64Milliseconds(options_.max_lease),
                                                     "] (0: the node's default)"));
    }
    return absl::Now() + (lease_ms == 0 ? options_.default_lease : absl::Milliseconds(lease_ms));
  };
  while (true) {
    // Before Hello, the session has hello_timeout in all; after it, no limit between requests.
    const absl::Time deadline = session->principal.has_value()
                                    ? absl::InfiniteFuture()
                                    : absl::Now() + options_.hello_timeout;
    char header[4];
    if (!ReadExactly(fd, header, 4, stopping_, deadline, expire)) return;
    uint32_t length = 0;
    for (int i = 0; i < 4; ++i) length |= uint32_t{static_cast<uint8_t>(header[i])} << (8 * i);
    if (length > kMaxRequestBytes) {
      refuse(ErrorResponse(0, absl::ResourceExhaustedError(absl::StrCat(
                                  "a local request of ", length, " bytes is more than the ",
                                  kMaxRequestBytes, "-byte limit; ending the session"))));
      return;
    }
    std::string body(length, '\0');
    if (!ReadExactly(fd, body.data(), length, stopping_, deadline, expire)) return;
    v1::LocalRequest request;
    if (!request.ParseFromString(body)) {
      refuse(
          ErrorResponse(0, absl::InvalidArgumentError("a local request that is not a LocalRequest; "
                                                      "ending the session")));
      return;
    }
    const uint64_t id = request.id();
    // Hello first, once; a failed one ends the session.
    if (!session->principal.has_value()) {
      if (request.op_case() != v1::LocalRequest::kHello) {
        refuse(
            ErrorResponse(id, absl::UnauthenticatedError("a local session starts with a Hello")));
        return;
      }
      const v1::LocalHello& hello = request.hello();
      session->token = hello.token().empty() ? "" : absl::StrCat("Bearer ", hello.token());
      session->tenant = hello.tenant();
      session->generation = options_.auth->generation();
      absl::StatusOr<Principal> who = options_.auth->Authenticate(
          session->token.empty() ? std::nullopt : std::optional<absl::string_view>(session->token),
          session->tenant.empty() ? std::nullopt
                                  : std::optional<absl::string_view>(session->tenant));
      if (!who.ok()) {
        refuse(ErrorResponse(id, who.status()));
        return;
      }
      session->principal = *who;
      v1::LocalResponse response;
      response.set_id(id);
      response.mutable_hello()->set_tenant(who->tenant);
      response.mutable_hello()->set_node(options_.node_name);
      if (!SendResponse(fd, response)) return;
      continue;
    }
    // A token revoked (or a tenant removed) at a reload of the token file ends the session.
    if (const uint64_t generation = options_.auth->generation();
        generation != session->generation) {
      session->generation = generation;
      absl::StatusOr<Principal> who = options_.auth->Authenticate(
          session->token.empty() ? std::nullopt : std::optional<absl::string_view>(session->token),
          session->tenant.empty() ? std::nullopt
                                  : std::optional<absl::string_view>(session->tenant));
      if (!who.ok() || who->tenant != session->principal->tenant ||
          who->role != session->principal->role) {
        refuse(ErrorResponse(
            id, who.ok() ? absl::PermissionDeniedError("the session's token changed tenant or "
                                                       "role at a reload of the token file")
                         : who.status()));
        return;
      }
    }
    expire();
    const std::string& tenant = session->principal->tenant;
    v1::LocalResponse response;
    response.set_id(id);
    std::vector<int> fds;
    absl::Status status;
    switch (request.op_case()) {
      case v1::LocalRequest::kAttach: {
        absl::StatusOr<std::shared_ptr<Cache>> cache =
            options_.registry->Get(tenant, request.attach().cache());
        if (!cache.ok()) {
          status = cache.status();
          break;
        }
        absl::StatusOr<std::vector<Cache::SharedGroup>> groups = (*cache)->SharedGroups();
        if (!groups.ok()) {
          status = absl::FailedPreconditionError(absl::StrCat(
              "cache '", request.attach().cache(), "' cannot be mapped: ",
              groups.status().message(), " (a node started with --local-socket shares it)"));
          break;
        }
        v1::LocalAttachResult* result = response.mutable_attach();
        *result->mutable_spec() = SpecToProto((*cache)->spec());
        for (const Cache::SharedGroup& group : *groups) {
          DescribeMemory(group, result->add_groups());
          fds.push_back(group.memory.fd);
        }
        // The descriptors are the device's, open while the cache lives: `cache` holds it
        // until they are sent (the kernel then holds copies).
        if (!SendResponse(fd, response, fds)) return;
        continue;
      }
      case v1::LocalRequest::kPin: {
        const v1::LocalPin& pin = request.pin();
        if (session->pins.size() >= static_cast<size_t>(options_.max_pins)) {
          status = absl::ResourceExhaustedError(
              absl::StrCat("this session holds ", session->pins.size(),
                           " pins, the most a local session may; unpin some first"));
          break;
        }
        absl::StatusOr<absl::Time> expires = lease(pin.lease_ms());
        if (!expires.ok()) {
          status = expires.status();
          break;
        }
        absl::StatusOr<std::shared_ptr<Cache>> cache = options_.registry->Get(tenant, pin.cache());
        if (!cache.ok()) {
          status = cache.status();
          break;
        }
        absl::StatusOr<Cache::PinnedCells> cells = Cache::PinCells(
            *cache, pin.seq(), pin.begin(),
            pin.has_end() ? std::optional<int32_t>(pin.end()) : std::nullopt, pin.queries());
        if (!cells.ok()) {
          status = cells.status();
          break;
        }
        v1::LocalPinResult* result = response.mutable_pin();
        for (size_t g = 0; g < cells->cells.size(); ++g) {
          v1::LocalGroupCells* group = result->add_groups();
          group->mutable_positions()->Add(cells->positions[g].begin(), cells->positions[g].end());
          group->mutable_cells()->Add(cells->cells[g].begin(), cells->cells[g].end());
          if (g < cells->visible.size()) {
            for (const std::vector<PositionRange>& ranges : cells->visible[g]) {
              v1::LocalVisibleRanges* visible = group->add_visible();
              for (const PositionRange& r : ranges) {
                visible->add_first(r.first);
                visible->add_last(r.last);
              }
            }
          }
        }
        // The pin keeps its cells; what the queries see is the answer's alone.
        cells->visible = {};
        const uint64_t pin_id = session->next_pin++;
        result->set_pin(pin_id);
        result->set_expires_unix_ms(absl::ToUnixMillis(*expires));
        session->pins.emplace(pin_id, Session::Pin{*std::move(cells), *expires});
        pins_.fetch_add(1);
        break;
      }
      case v1::LocalRequest::kUnpin: {
        auto it = session->pins.find(request.unpin().pin());
        if (it == session->pins.end()) {
          status =
              absl::NotFoundError(absl::StrCat("this session holds no pin ", request.unpin().pin(),
                                               " (unpinned, or its lease ran out)"));
          break;
        }
        session->pins.erase(it);
        pins_.fetch_sub(1);
        response.mutable_unpin();
        break;
      }
      case v1::LocalRequest::kBeginAppend: {
        const v1::LocalBeginAppend& begin = request.begin_append();
        if (session->plans.size() >= static_cast<size_t>(options_.max_plans)) {
          status = absl::ResourceExhaustedError(
              absl::StrCat("this session holds ", session->plans.size(),
                           " Append plans, the most a local session may; commit or abandon "
                           "some first"));
          break;
        }
        if (begin.positions_size() != begin.seqs_size() ||
            (begin.token_ids_size() != 0 && begin.token_ids_size() != begin.seqs_size())) {
          status = absl::InvalidArgumentError(
              absl::StrCat("seqs (", begin.seqs_size(), "), positions (", begin.positions_size(),
                           ") and token_ids (", begin.token_ids_size(),
                           ", or none) must have one entry per token"));
          break;
        }
        absl::StatusOr<absl::Time> expires = lease(begin.lease_ms());
        if (!expires.ok()) {
          status = expires.status();
          break;
        }
        absl::StatusOr<std::shared_ptr<Cache>> cache =
            options_.registry->Get(tenant, begin.cache());
        if (!cache.ok()) {
          status = cache.status();
          break;
        }
        std::vector<Token> tokens(static_cast<size_t>(begin.seqs_size()));
        absl::flat_hash_set<int64_t> seqs;
        for (int i = 0; i < begin.seqs_size(); ++i) {
          tokens[i] = Token{begin.seqs(i), begin.positions(i),
                            begin.token_ids_size() == 0 ? kNoTokenId : begin.token_ids(i)};
          seqs.insert(begin.seqs(i));
        }
        const size_t payload =
            AppendPayloadBytes((*cache)->spec(), begin.seqs_size(),
                               static_cast<int64_t>(seqs.size()), begin.speculative());
        absl::StatusOr<std::unique_ptr<AppendWriter>> writer =
            Cache::BeginAppend(*cache, tokens, payload, begin.speculative(), /*in_place=*/true);
        if (!writer.ok()) {
          status = writer.status();
          break;
        }
        absl::StatusOr<std::vector<std::optional<SharedGroup>>> staging =
            (*writer)->StagingMemory();
        if (!staging.ok()) {
          status = staging.status();
          break;
        }
        v1::LocalBeginAppendResult* result = response.mutable_begin_append();
        const std::vector<std::vector<int32_t>> cells = (*writer)->Cells();
        for (size_t g = 0; g < cells.size(); ++g) {
          v1::LocalGroupCells* group = result->add_groups();
          group->mutable_cells()->Add(cells[g].begin(), cells[g].end());
          if ((*staging)[g].has_value()) {
            DescribeMemory(*(*staging)[g], group->mutable_staging());
            fds.push_back((*staging)[g]->memory.fd);  // open while the plan holds the chunk
          }
        }
        const uint64_t plan = session->next_plan++;
        result->set_plan(plan);
        result->set_expires_unix_ms(absl::ToUnixMillis(*expires));
        session->plans.emplace(plan, Session::Plan{*std::move(writer), *expires});
        plans_.fetch_add(1);
        break;
      }
      case v1::LocalRequest::kCommitAppend:
      case v1::LocalRequest::kAbandonAppend: {
        const bool commit = request.op_case() == v1::LocalRequest::kCommitAppend;
        const uint64_t plan =
            commit ? request.commit_append().plan() : request.abandon_append().plan();
        auto it = session->plans.find(plan);
        if (it == session->plans.end()) {
          status =
              absl::NotFoundError(absl::StrCat("this session holds no Append plan ", plan,
                                               " (committed, abandoned, or its lease ran out)"));
          break;
        }
        std::unique_ptr<AppendWriter> writer = std::move(it->second.writer);
        session->plans.erase(it);
        plans_.fetch_sub(1);
        if (commit) {
          status = writer->CommitInPlace();
          if (status.ok()) {
            response.mutable_commit_append();
            commits_.fetch_add(1);
          }
        } else {
          writer.reset();
          response.mutable_abandon_append();
        }
        break;
      }
      case v1::LocalRequest::kHello:
        status = absl::FailedPreconditionError("this session said Hello already");
        break;
      default:
        status = absl::InvalidArgumentError("a local request without an operation");
        break;
    }
    if (!status.ok()) {
      response = ErrorResponse(id, status);
      refusals_.fetch_add(1);
      fds.clear();
    }
    if (!SendResponse(fd, response, fds)) return;
  }
}

}  // namespace kvmesh

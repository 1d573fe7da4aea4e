#include "tests/testing/ncclsim/bootstrap_root.h"

#include <errno.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>

#include <cstdio>
#include <cstring>
#include <list>
#include <map>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace ncclsim {
namespace {

// A connection from a rank: its hello as it arrives, then its place in a pending communicator.
struct Client {
  Fd fd;
  RootHello hello;
  size_t got = 0;  // bytes of `hello` read so far
  bool registered = false;
};

// The ranks of one id that have joined so far.
struct Pending {
  int nranks = 0;
  std::map<int, Client*> ranks;
};

// Tells a rank why it is refused; it is dropped right after, so a failed write changes nothing.
void Refuse(Client* client, ncclResult_t result, const std::string& message) {
  RootReply reply;
  std::memset(&reply, 0, sizeof(reply));
  reply.magic = kMessageMagic;
  reply.result = result;
  std::snprintf(reply.message, sizeof(reply.message), "%s", message.c_str());
  std::string ignored;
  (void)WriteFull(client->fd.get(), &reply, sizeof(reply), -1, &ignored);
}

// Sends every rank of a complete communicator the addresses of all of them.
void Answer(const Pending& pending) {
  std::vector<char> message(sizeof(RootReply) + pending.ranks.size() * sizeof(RankAddress));
  RootReply reply;
  std::memset(&reply, 0, sizeof(reply));
  reply.magic = kMessageMagic;
  reply.result = ncclSuccess;
  reply.nranks = pending.nranks;
  std::memcpy(message.data(), &reply, sizeof(reply));
  char* at = message.data() + sizeof(reply);
  for (const auto& [rank, client] : pending.ranks) {
    RankAddress address;
    std::memset(&address, 0, sizeof(address));
    address.pid = client->hello.pid;
    address.port = client->hello.port;
    std::memcpy(at, &address, sizeof(address));
    at += sizeof(address);
  }
  for (const auto& [rank, client] : pending.ranks) {
    // A rank that left just now finds out when it connects to its peers; nothing to do here.
    std::string ignored;
    (void)WriteFull(client->fd.get(), message.data(), message.size(), -1, &ignored);
  }
}

}  // namespace

BootstrapRoot* BootstrapRoot::Get(std::string* error) {
  // Immortal, like the thread that serves it. Per process: a child forked without exec has
  // the parent's object but not its thread, so it starts a root of its own.
  static std::mutex* const mu = new std::mutex;
  static BootstrapRoot* root = nullptr;
  std::lock_guard<std::mutex> lock(*mu);
  if (root != nullptr && root->pid_ == getpid()) return root;
  Fd listener;
  uint16_t port = 0;
  if (ListenLoopback(&listener, &port, error) != Step::kDone) {
    *error = "cannot start the bootstrap root: " + *error;
    return nullptr;
  }
  BootstrapRoot* started = new BootstrapRoot(std::move(listener), port);
  try {
    std::thread([started] { started->Serve(); }).detach();
  } catch (const std::system_error& e) {
    *error = std::string("cannot start the bootstrap root's thread: ") + e.what();
    delete started;
    return nullptr;
  }
  root = started;
  return root;
}

bool BootstrapRoot::NewId(ncclUniqueId* id, std::string* error) {
  IdLayout layout;
  std::memset(&layout, 0, sizeof(layout));
  std::memcpy(layout.magic, kIdMagic, sizeof(kIdMagic));
  layout.root_port = port_;
  layout.root_pid = pid_;
  if (getrandom(&layout.nonce, sizeof(layout.nonce), 0) != sizeof(layout.nonce)) {
    *error = Errno("getrandom");
    return false;
  }
  {
    kvmesh::MutexLock lock(&mu_);
    issued_.insert(layout.nonce);
  }
  std::memset(id->internal, 0, sizeof(id->internal));
  std::memcpy(id->internal, &layout, sizeof(layout));
  return true;
}

bool BootstrapRoot::Issued(const Nonce& nonce) {
  kvmesh::MutexLock lock(&mu_);
  return issued_.count(nonce) != 0;
}

void BootstrapRoot::Forget(const Nonce& nonce) {
  kvmesh::MutexLock lock(&mu_);
  issued_.erase(nonce);
}

void BootstrapRoot::Serve() {
  std::list<Client> clients;
  std::map<Nonce, Pending> pending;
  const std::string self = "the bootstrap root (pid " + std::to_string(pid_) + ")";

  // Removes a client, and its rank from the communicator it joined.
  auto drop = [&](std::list<Client>::iterator it) {
    if (it->registered) {
      const auto group = pending.find(it->hello.nonce);
      if (group != pending.end()) {
        group->second.ranks.erase(it->hello.rank);
        if (group->second.ranks.empty()) pending.erase(group);
      }
    }
    return clients.erase(it);
  };
  // A complete hello: refuses it (dropping the client) or adds the rank; answers and drops the
  // whole communicator once it is complete. Returns the next client to look at.
  auto join = [&](std::list<Client>::iterator it) {
    const RootHello& hello = it->hello;
    std::string refusal;
    ncclResult_t result = ncclInvalidUsage;
    const auto group = pending.find(hello.nonce);
    if (hello.magic != kMessageMagic) {
      refusal = "not a kvmesh ncclsim bootstrap message";
    } else if (!Issued(hello.nonce)) {
      result = ncclInvalidArgument;
      refusal = self + " made no such unique id, or all ranks of its communicator have joined";
    } else if (hello.nranks < 1 || hello.rank < 0 || hello.rank >= hello.nranks) {
      result = ncclInvalidArgument;
      refusal = "rank " + std::to_string(hello.rank) + " of " + std::to_string(hello.nranks) +
                " names no rank";
    } else if (group != pending.end() && group->second.nranks != hello.nranks) {
      refusal = "rank " + std::to_string(hello.rank) + " says the communicator has " +
                std::to_string(hello.nranks) + " ranks, but another rank said " +
                std::to_string(group->second.nranks);
    } else if (group != pending.end() && group->second.ranks.count(hello.rank) != 0) {
      refusal = "rank " + std::to_string(hello.rank) + " joined twice (pids " +
                std::to_string(group->second.ranks[hello.rank]->hello.pid) + " and " +
                std::to_string(hello.pid) + ")";
    }
    if (!refusal.empty()) {
      Refuse(&*it, result, refusal);
      return drop(it);
    }
    Pending& joined = pending[hello.nonce];
    joined.nranks = hello.nranks;
    joined.ranks[hello.rank] = &*it;
    it->registered = true;
    if (static_cast<int>(joined.ranks.size()) < joined.nranks) return std::next(it);
    Answer(joined);
    const Nonce nonce = hello.nonce;
    Forget(nonce);
    for (auto c = clients.begin(); c != clients.end();) {
      c = c->registered && c->hello.nonce == nonce ? clients.erase(c) : std::next(c);
    }
    pending.erase(nonce);
    // The list changed under `it`: start the scan of this round over.
    return clients.end();
  };

  std::vector<pollfd> fds;
  while (true) {
    fds.clear();
    fds.push_back({listener_.get(), POLLIN, 0});
    for (const Client& client : clients) fds.push_back({client.fd.get(), POLLIN, 0});
    if (poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      std::fprintf(stderr, "ncclsim: %s stops: %s\n", self.c_str(), Errno("poll").c_str());
      return;
    }
    // Readable clients first (their fds are in list order), then new connections.
    std::vector<int> readable;
    for (size_t i = 1; i < fds.size(); ++i) {
      if (fds[i].revents != 0) readable.push_back(fds[i].fd);
    }
    for (auto it = clients.begin(); it != clients.end();) {
      bool ready = false;
      for (int fd : readable) ready = ready || fd == it->fd.get();
      if (!ready) {
        ++it;
        continue;
      }
      if (it->registered) {
        // A registered rank only ever closes (it gave up, or its process ended).
        it = drop(it);
        continue;
      }
      const ssize_t n = ReadSome(it->fd.get(), reinterpret_cast<char*>(&it->hello) + it->got,
                                 sizeof(it->hello) - it->got);
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        ++it;
      } else if (n <= 0) {
        it = drop(it);
      } else {
        it->got += static_cast<size_t>(n);
        it = it->got == sizeof(it->hello) ? join(it) : std::next(it);
      }
    }
    if ((fds[0].revents & POLLIN) != 0) {
      while (true) {
        const int fd = accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) break;
        clients.emplace_back();
        clients.back().fd.reset(fd);
      }
    }
  }
}

}  // namespace ncclsim

#include "tests/testing/node_process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "grpc/grpc.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

#ifndef KVMESH_NODE_PATH
#error "KVMESH_NODE_PATH must be defined by the build (the path of kvmesh-node)"
#endif

namespace kvmesh {
namespace testutil {
namespace {

std::string Errno(const char* what) { return absl::StrCat(what, ": ", std::strerror(errno)); }

// Reaps `pid` if it exits before `deadline`. Polls: a child's exit has no fd to wait on that
// works on every kernel this runs on.
std::optional<ExitStatus> WaitUntil(pid_t pid, absl::Time deadline) {
  absl::Duration pause = absl::Milliseconds(1);
  for (;;) {
    int status = 0;
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) return FromWaitStatus(status);
    if (r < 0 && errno != EINTR) return ExitStatus{};  // not our child any more: nothing to reap
    if (absl::Now() >= deadline) return std::nullopt;
    absl::SleepFor(std::min(pause, deadline - absl::Now()));
    pause = std::min(pause * 2, absl::Milliseconds(20));
  }
}

ExitStatus KillAndReap(pid_t pid) {
  kill(pid, SIGKILL);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  ExitStatus out = FromWaitStatus(status);
  out.killed_after_timeout = true;
  return out;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// The channel arguments of every test channel: no message size limits on the client side (the
// node enforces its own); `own_connection`: a connection not shared with other channels.
grpc::ChannelArguments TestChannelArguments(bool own_connection) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  if (own_connection) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return args;
}

// `channel` once it has connected, or after 10 s as it is. A first connection can fail with a
// transient error on a loaded machine (CI saw "No such file or directory" from connect() once),
// and a channel that failed fails every call that does not wait for ready until its reconnect
// backoff ends; waiting here keeps that out of tests that are not about connecting.
std::shared_ptr<grpc::Channel> Connected(std::shared_ptr<grpc::Channel> channel) {
  channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10));
  return channel;
}

struct Child {
  pid_t pid = -1;
  int stdout_fd = -1;
  std::string stderr_path;
};

// This process's environment with the "NAME=value" entries of `overrides` set or replaced.
std::vector<std::string> ChildEnvironment(const std::vector<std::string>& overrides) {
  std::vector<std::string> env;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string variable = *entry;
    const std::string name = variable.substr(0, variable.find('='));
    const bool replaced =
        std::any_of(overrides.begin(), overrides.end(),
                    [&](const std::string& o) { return o.substr(0, o.find('=')) == name; });
    if (!replaced) env.push_back(variable);
  }
  env.insert(env.end(), overrides.begin(), overrides.end());
  return env;
}

// Starts kvmesh-node with `args` and `env` (NodeProcess::Options::env): stdout into a pipe,
// stderr into a new temporary file.
absl::StatusOr<Child> Spawn(const std::vector<std::string>& args,
                            const std::vector<std::string>& env, const std::string& binary = "") {
  const char* tmpdir = std::getenv("TEST_TMPDIR");
  std::string path =
      absl::StrCat(tmpdir != nullptr && *tmpdir != '\0' ? tmpdir : "/tmp", "/kvmesh-node-XXXXXX");
  const int err_fd = mkostemp(path.data(), O_CLOEXEC);
  if (err_fd < 0) return absl::InternalError(Errno("mkostemp"));
  int out[2];
  if (pipe2(out, O_CLOEXEC) != 0) {
    close(err_fd);
    unlink(path.c_str());
    return absl::InternalError(Errno("pipe2"));
  }
  // Everything the child needs is prepared before fork: after it, only async-signal-safe calls.
  std::vector<std::string> argv_storage;
  argv_storage.push_back(binary.empty() ? NodeBinaryPath() : binary);
  argv_storage.insert(argv_storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& arg : argv_storage) argv.push_back(arg.data());
  argv.push_back(nullptr);
  std::vector<std::string> envp_storage = ChildEnvironment(env);
  std::vector<char*> envp;
  for (std::string& variable : envp_storage) envp.push_back(variable.data());
  envp.push_back(nullptr);
  const pid_t parent = getpid();
  sigset_t none;
  sigemptyset(&none);

  const pid_t pid = fork();
  if (pid < 0) {
    close(err_fd);
    close(out[0]);
    close(out[1]);
    unlink(path.c_str());
    return absl::InternalError(Errno("fork"));
  }
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(126);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    if (dup2(out[1], STDOUT_FILENO) < 0 || dup2(err_fd, STDERR_FILENO) < 0) _exit(125);
    execve(argv[0], argv.data(), envp.data());
    static const char kMessage[] = "node_process: execve of kvmesh-node failed\n";
    (void)!write(STDERR_FILENO, kMessage, sizeof(kMessage) - 1);
    _exit(127);
  }
  close(err_fd);
  close(out[1]);
  return Child{pid, out[0], std::move(path)};
}

// Reads from `fd` into `*text` until `stop(*text)` holds, end of file, or the deadline.
// Returns true at end of file.
template <typename Stop>
absl::StatusOr<bool> ReadUntil(int fd, absl::Time deadline, std::string* text, Stop stop) {
  while (!stop(*text)) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError("timed out reading kvmesh-node's stdout");
    }
    pollfd p{fd, POLLIN, 0};
    const int ready =
        poll(&p, 1, static_cast<int>(std::max<int64_t>(1, left / absl::Milliseconds(1))));
    if (ready < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(Errno("poll"));
    }
    if (ready == 0) continue;
    char buf[4096];
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(Errno("read"));
    }
    if (n == 0) return true;
    text->append(buf, static_cast<size_t>(n));
  }
  return false;
}

}  // namespace

std::string ExitStatus::ToString() const {
  std::string out = exited
                        ? absl::StrCat("exited with code ", code)
                        : absl::StrCat("killed by signal ", signal, " (", strsignal(signal), ")");
  if (killed_after_timeout) absl::StrAppend(&out, " after SIGTERM timed out");
  return out;
}

ExitStatus FromWaitStatus(int status) {
  ExitStatus out;
  if (WIFEXITED(status)) {
    out.exited = true;
    out.code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    out.signal = WTERMSIG(status);
  }
  return out;
}

const char* NodeBinaryPath() { return KVMESH_NODE_PATH; }

NodeProcess::NodeProcess(pid_t pid, int stdout_fd, std::string stderr_path)
    : pid_(pid), stdout_fd_(stdout_fd), stderr_path_(std::move(stderr_path)) {}

absl::StatusOr<std::unique_ptr<NodeProcess>> NodeProcess::Start(const Options& options) {
  // The client's credentials first: a test's bad certificate path fails before a node starts.
  absl::StatusOr<ClientConnector> client = ClientConnector::Create(options.client);
  if (!client.ok()) return client.status();
  // Stop() ends a test's node at once: a drain on SIGTERM (docs/api.md#drain) would move its
  // data to the other nodes of a test's cluster, all of them stopping too. Tests of the drain
  // give --drain-timeout-ms themselves, which overrides this (a later flag wins).
  std::vector<std::string> args = {absl::StrCat("--listen=127.0.0.1:", options.port),
                                   absl::StrCat("--node-name=", options.node_name),
                                   "--drain-timeout-ms=0"};
  args.insert(args.end(), options.extra_args.begin(), options.extra_args.end());
  // The backend of a whole test run (the _cuda runs of the integration tests in a
  // -DKVMESH_CUDA=SIM build), unless the test chose one itself.
  const char* backend = std::getenv(kTestNodeBackendEnv);
  const bool chosen =
      std::any_of(options.extra_args.begin(), options.extra_args.end(),
                  [](const std::string& a) { return a.rfind("--backend=", 0) == 0; });
  if (backend != nullptr && backend[0] != '\0' && !chosen) {
    args.push_back(absl::StrCat("--backend=", backend));
  }
  absl::StatusOr<Child> child = Spawn(args, options.env, options.binary);
  if (!child.ok()) return child.status();
  std::unique_ptr<NodeProcess> node(
      new NodeProcess(child->pid, child->stdout_fd, std::move(child->stderr_path)));
  node->client_ = *std::move(client);

  const absl::Time deadline = absl::Now() + options.start_timeout;
  std::string text;
  absl::StatusOr<bool> eof = ReadUntil(node->stdout_fd_, deadline, &text, [](const std::string& t) {
    return t.find('\n') != std::string::npos;
  });
  if (!eof.ok()) {
    node->Stop(absl::ZeroDuration());
    return absl::Status(
        eof.status().code(),
        absl::StrCat(eof.status().message(), " (", absl::FormatDuration(options.start_timeout),
                     "); node stderr:\n", node->ReadStderr()));
  }
  if (*eof) {
    const ExitStatus status = node->Stop(absl::Seconds(10));
    return absl::UnavailableError(absl::StrCat("kvmesh-node ", status.ToString(),
                                               " before it listened; stdout: '", text,
                                               "'; stderr:\n", node->ReadStderr()));
  }
  node->line_ = text.substr(0, text.find('\n'));
  // kvmesh-node <name> listening on <host>:<port> backend=<backend> peers=<n>
  const std::string prefix = absl::StrCat("kvmesh-node ", options.node_name, " listening on ");
  const size_t addr_end = node->line_.find(' ', prefix.size());
  const size_t colon = node->line_.rfind(':', addr_end);
  int port = 0;
  if (!absl::StartsWith(node->line_, prefix) || addr_end == std::string::npos ||
      colon == std::string::npos || colon < prefix.size() ||
      !absl::SimpleAtoi(node->line_.substr(colon + 1, addr_end - colon - 1), &port) || port <= 0 ||
      !absl::StartsWith(node->line_.substr(addr_end), " backend=")) {
    return absl::InternalError(
        absl::StrCat("kvmesh-node printed an unexpected line: '", node->line_, "'"));
  }
  node->port_ = port;
  node->address_ = absl::StrCat("127.0.0.1:", port);
  // "... peer-plane=<host>:<port>" at the end when the node serves its peer plane apart.
  node->peer_port_ = port;
  const size_t peer_plane = node->line_.find(" peer-plane=");
  if (peer_plane != std::string::npos) {
    const size_t peer_colon = node->line_.rfind(':');
    if (peer_colon < peer_plane ||
        !absl::SimpleAtoi(node->line_.substr(peer_colon + 1), &node->peer_port_) ||
        node->peer_port_ <= 0) {
      return absl::InternalError(
          absl::StrCat("kvmesh-node printed an unexpected line: '", node->line_, "'"));
    }
  }
  node->peer_address_ = absl::StrCat("127.0.0.1:", node->peer_port_);
  node->channel_ =
      Connected(node->client_->NewChannel(node->address_, TestChannelArguments(false)));
  return node;
}

NodeProcess::~NodeProcess() {
  // An idle client notices the node's GOAWAY only when gRPC's backup poller next runs (every
  // 5 s), and the node's shutdown waits for it: the connection closes first, unless a test still
  // holds a stub of channel().
  ReleaseChannel();
  const ExitStatus status = Stop();
  if (!status.clean()) {
    std::fprintf(stderr, "kvmesh-node (pid %d) %s; its stderr:\n%s\n", static_cast<int>(pid_),
                 status.ToString().c_str(), ReadStderr().c_str());
  }
  close(stdout_fd_);
  unlink(stderr_path_.c_str());
}

std::shared_ptr<grpc::Channel> NodeProcess::NewChannel() const {
  return Connected(client_->NewChannel(address_, TestChannelArguments(true)));
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> NodeProcess::NewChannelWith(
    const ClientConnectionOptions& client) const {
  return NewClientChannel(address_, client, TestChannelArguments(true));
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> NodeProcess::NewPeerChannelWith(
    const ClientConnectionOptions& client) const {
  return NewClientChannel(peer_address_, client, TestChannelArguments(true));
}

std::unique_ptr<v1::CacheService::Stub> NodeProcess::NewStub() const {
  return v1::CacheService::NewStub(channel_);
}

ExitStatus NodeProcess::Stop(absl::Duration timeout) {
  if (exit_.has_value()) return *exit_;
  const absl::Time start = absl::Now();
  kill(pid_, SIGTERM);
  kill(pid_, SIGCONT);  // a frozen node (Freeze) takes its SIGTERM only once it runs
  std::optional<ExitStatus> status = WaitUntil(pid_, start + timeout);
  exit_ = status.has_value() ? *status : KillAndReap(pid_);
  // A node waits out its shutdown grace (5 s) for connections that stay open: a test that
  // holds an idle channel to it costs that much and should drop it first.
  if (const absl::Duration took = absl::Now() - start; took >= absl::Seconds(4)) {
    const std::string name = line_.substr(0, line_.find(" listening"));
    std::fprintf(stderr, "%s (pid %d) took %s to exit after SIGTERM\n",
                 name.empty() ? "kvmesh-node" : name.c_str(), static_cast<int>(pid_),
                 absl::FormatDuration(took).c_str());
  }
  return *exit_;
}

bool NodeProcess::Running() {
  if (exit_.has_value()) return false;
  std::optional<ExitStatus> status = WaitUntil(pid_, absl::InfinitePast());
  if (status.has_value()) exit_ = status;
  return !exit_.has_value();
}

std::string NodeProcess::ReadStderr() const { return ReadFile(stderr_path_); }

absl::Status NodeProcess::Freeze(absl::Duration timeout) {
  if (kill(pid_, SIGSTOP) != 0) {
    return absl::InternalError(absl::StrCat("kill(", pid_, ", SIGSTOP): ", std::strerror(errno)));
  }
  const std::string tasks = absl::StrCat("/proc/", pid_, "/task");
  const absl::Time until = absl::Now() + timeout;
  while (true) {
    // The state is the field after the command name, which is in parentheses and may hold
    // any character: read it after the last ')'.
    std::string running;
    std::error_code error;
    for (const auto& entry : std::filesystem::directory_iterator(tasks, error)) {
      const std::string stat = ReadFile(entry.path().string() + "/stat");
      const size_t close = stat.rfind(')');
      if (close == std::string::npos || close + 2 >= stat.size()) continue;  // exited meanwhile
      if (stat[close + 2] != 'T' && stat[close + 2] != 't') {
        running = absl::StrCat("thread ", entry.path().filename().string(), " in state ",
                               std::string(1, stat[close + 2]));
        break;
      }
    }
    if (error) {
      return absl::InternalError(absl::StrCat("reading ", tasks, ": ", error.message()));
    }
    if (running.empty()) return absl::OkStatus();
    if (absl::Now() >= until) {
      return absl::DeadlineExceededError(absl::StrCat(
          "pid ", pid_, " not stopped after ", absl::FormatDuration(timeout), ": ", running));
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
}

absl::Status NodeProcess::Thaw() {
  if (kill(pid_, SIGCONT) != 0) {
    return absl::InternalError(absl::StrCat("kill(", pid_, ", SIGCONT): ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

namespace {

// Binds `port` (0: the kernel picks) on 127.0.0.1 and closes it again: the port bound, or 0.
int TryBind(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  socklen_t len = sizeof(addr);
  int bound = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    bound = ntohs(addr.sin_port);
  }
  close(fd);
  return bound;
}

}  // namespace

uint64_t ProcessStatusBytes(pid_t pid, const char* field) {
  const std::string path = absl::StrCat("/proc/", pid, "/status");
  std::FILE* file = std::fopen(path.c_str(), "r");
  if (file == nullptr) return 0;
  const std::string format = absl::StrCat(field, ": %lu kB");
  char line[256];
  unsigned long kib = 0;
  while (std::fgets(line, sizeof(line), file) != nullptr) {
    if (std::sscanf(line, format.c_str(), &kib) == 1) break;
  }
  std::fclose(file);
  return static_cast<uint64_t>(kib) * 1024;
}

int ReservePort() {
  int ephemeral_low = 32768;
  {
    std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range");
    int low = 0;
    if (range >> low && low > 0) ephemeral_low = low;
  }
  constexpr int kLowest = 10000;
  if (ephemeral_low - kLowest >= 1000) {
    // Random candidates, seeded per process and call: tests running at once pick apart.
    static std::atomic<uint64_t> calls{0};
    uint64_t state = (static_cast<uint64_t>(getpid()) << 32) ^
                     static_cast<uint64_t>(absl::ToUnixNanos(absl::Now())) ^ (++calls << 48);
    for (int attempt = 0; attempt < 200; ++attempt) {
      state = state * 6364136223846793005ULL + 1442695040888963407ULL;  // an LCG step
      const int port = kLowest + static_cast<int>((state >> 33) % (ephemeral_low - kLowest));
      if (TryBind(port) == port) return port;
    }
  }
  return TryBind(0);
}

absl::StatusOr<NodeRun> RunNodeToExit(const std::vector<std::string>& args, absl::Duration timeout,
                                      const std::vector<std::string>& env) {
  absl::StatusOr<Child> child = Spawn(args, env);
  if (!child.ok()) return child.status();
  const absl::Time deadline = absl::Now() + timeout;
  NodeRun run;
  absl::StatusOr<bool> eof = ReadUntil(child->stdout_fd, deadline, &run.stdout_text,
                                       [](const std::string&) { return false; });
  close(child->stdout_fd);
  std::optional<ExitStatus> status;
  if (eof.ok()) status = WaitUntil(child->pid, deadline);
  run.status = status.has_value() ? *status : KillAndReap(child->pid);
  run.stderr_text = ReadFile(child->stderr_path);
  unlink(child->stderr_path.c_str());
  return run;
}

}  // namespace testutil
}  // namespace kvmesh

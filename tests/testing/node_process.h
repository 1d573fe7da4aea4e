// NodeProcess: a real kvmesh-node child process for integration tests. It listens on
// 127.0.0.1 with a port the kernel picks (--listen=127.0.0.1:0); Start() parses the port from
// the node's one stdout line under a deadline. The node's stderr goes to a temporary file, so a
// test can read its log (and sanitizer reports); the destructor prints it when the node did not
// exit cleanly.
//
// The child dies with the thread that started it (PR_SET_PDEATHSIG), so a crashed test leaves
// no node behind; start nodes from the test's main thread.
//
// Thread safety: channel(), NewChannel(), NewStub() and the accessors are safe from any thread.
// Stop() and the destructor must not race with each other.
#ifndef KVMESH_TESTS_TESTING_NODE_PROCESS_H_
#define KVMESH_TESTS_TESTING_NODE_PROCESS_H_

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "kvmesh/v1/kvmesh.grpc.pb.h"
#include "service/common/client_channel.h"

namespace kvmesh {
namespace testutil {

// How a child process ended.
struct ExitStatus {
  bool exited = false;  // true: exited with `code`; false: killed by `signal`
  int code = 0;
  int signal = 0;
  bool killed_after_timeout = false;  // Stop() had to send SIGKILL

  bool clean() const { return exited && code == 0 && !killed_after_timeout; }
  std::string ToString() const;
};

// An ExitStatus from a waitpid() status.
ExitStatus FromWaitStatus(int status);

// Path of the kvmesh-node binary this test build runs (injected by CMake).
const char* NodeBinaryPath();

// When set (e.g. to "cuda"), every node a test starts gets --backend=<value> unless its
// Options::extra_args choose a backend: the integration tests' _cuda runs in a -DKVMESH_CUDA=SIM
// build use it to run on the simulated GPU.
inline constexpr char kTestNodeBackendEnv[] = "KVMESH_TEST_NODE_BACKEND";

class NodeProcess {
 public:
  struct Options {
    std::string node_name = "test-node";
    // Port to listen on; 0: one the kernel picks (see ReservePort for a port known in advance,
    // as a cluster's --peers needs).
    int port = 0;
    // Further flags, e.g. "--memory-budget=64MiB". --listen and --node-name are set already.
    std::vector<std::string> extra_args;
    // Environment variables to set (or replace) in the node's environment, "NAME=value"; the
    // rest of the environment is this process's.
    std::vector<std::string> env;
    // How long the node may take to print its listening line.
    absl::Duration start_timeout = absl::Seconds(60);
    // The kvmesh-node binary to run; empty: NodeBinaryPath() (the soak runs other builds).
    std::string binary;
    // How this test's channels to the node (channel(), NewChannel(), NewStub()) connect: TLS
    // (a CA, a client certificate, a server name; give the node --tls-cert etc. in extra_args),
    // a bearer token and a tenant that every call on them carries. Default: plaintext, none.
    ClientConnectionOptions client;
  };

  // Starts kvmesh-node and waits for "kvmesh-node <name> listening on <host>:<port> ...".
  // UNAVAILABLE with the node's stderr when it exits first; DEADLINE_EXCEEDED when the line
  // does not come in time (the child is killed); INTERNAL when the line does not parse;
  // INVALID_ARGUMENT (before starting anything) when options.client does not make credentials.
  static absl::StatusOr<std::unique_ptr<NodeProcess>> Start(const Options& options);

  // Stop(), then removes the stderr file. Prints the node's stderr when it did not exit
  // cleanly.
  ~NodeProcess();

  NodeProcess(const NodeProcess&) = delete;
  NodeProcess& operator=(const NodeProcess&) = delete;

  pid_t pid() const { return pid_; }
  int port() const { return port_; }
  const std::string& address() const { return address_; }  // "127.0.0.1:<port>"
  // The peer plane's port and address when the node serves it apart (--peer-listen), else
  // port() and address().
  int peer_port() const { return peer_port_; }
  const std::string& peer_address() const { return peer_address_; }
  const std::string& listening_line() const { return line_; }

  // A channel shared by the callers, without message size limits on the client side, connected
  // as Options::client says.
  std::shared_ptr<grpc::Channel> channel() const { return channel_; }
  // A new channel with its own connection (not shared with channel() or other NewChannel()s),
  // connected as Options::client says.
  std::shared_ptr<grpc::Channel> NewChannel() const;
  std::unique_ptr<v1::CacheService::Stub> NewStub() const;
  // A new channel with its own connection to the client port (address()) or the peer port
  // (peer_address()), connected as `client` says instead. The errors of
  // ClientConnector::Create.
  absl::StatusOr<std::shared_ptr<grpc::Channel>> NewChannelWith(
      const ClientConnectionOptions& client) const;
  absl::StatusOr<std::shared_ptr<grpc::Channel>> NewPeerChannelWith(
      const ClientConnectionOptions& client) const;

  // Drops this object's reference to channel(). When no stub or copy holds it any more, the
  // connection closes, and the node's shutdown need not wait for an idle client to notice it.
  // channel() is null afterwards.
  void ReleaseChannel() { channel_.reset(); }

  // SIGTERM, then SIGKILL when the node has not exited within `timeout`; reaps it. Later calls
  // return the first result.
  ExitStatus Stop(absl::Duration timeout = absl::Seconds(30));

  // Whether the child has not exited yet (reaps it when it has).
  bool Running();

  // SIGSTOP, then waits until every thread of the node has stopped: kill() returns once the
  // signal is queued, and one thread takes it and stops the others, so on a loaded machine the
  // node may still serve a request that comes right after kill(). DEADLINE_EXCEEDED naming a
  // thread still running after `timeout`; INTERNAL when /proc cannot be read.
  absl::Status Freeze(absl::Duration timeout = absl::Seconds(10));
  // SIGCONT: a frozen node runs again.
  absl::Status Thaw();

  // What the node has written to stderr so far.
  std::string ReadStderr() const;

 private:
  NodeProcess(pid_t pid, int stdout_fd, std::string stderr_path);

  pid_t pid_;
  int stdout_fd_;  // read end of the node's stdout, kept open so its writes never fail
  std::string stderr_path_;
  std::string line_;
  int port_ = 0;
  std::string address_;
  int peer_port_ = 0;
  std::string peer_address_;
  std::optional<ClientConnector> client_;  // Options::client, set by Start
  std::shared_ptr<grpc::Channel> channel_;
  std::optional<ExitStatus> exit_;
};

// A size field of /proc/<pid>/status ("VmRSS", "VmHWM") in bytes; 0 when it cannot be read.
uint64_t ProcessStatusBytes(pid_t pid, const char* field);

// A port on 127.0.0.1 that was free a moment ago (bound, then closed), for nodes whose
// addresses must be known before they start. 0 when none could be bound. Chosen at random
// below the kernel's ephemeral range (net.ipv4.ip_local_port_range): a port from that range
// may be handed to any socket that binds port 0 or connects (another test's client, node or
// metrics endpoint) before the node binds it.
int ReservePort();

// Result of running kvmesh-node to completion.
struct NodeRun {
  ExitStatus status;
  std::string stdout_text;
  std::string stderr_text;
};

// Runs kvmesh-node with `args` (no --listen added) until it exits by itself, for startup
// failures. The child is killed after `timeout` (then status.killed_after_timeout is true).
// `env` as in NodeProcess::Options.
absl::StatusOr<NodeRun> RunNodeToExit(const std::vector<std::string>& args,
                                      absl::Duration timeout = absl::Seconds(30),
                                      const std::vector<std::string>& env = {});

}  // namespace testutil
}  // namespace kvmesh

#endif  // KVMESH_TESTS_TESTING_NODE_PROCESS_H_

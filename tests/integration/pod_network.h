// PodNetwork and PodProcess: the pods test's stand-in for a node's pod network and container
// runtime (pods_test.cc). Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2 and dnsmasq.
//
// PodNetwork builds, for N pods, named kvmtest-<pid>-*:
//   - a "switch" network namespace (kvmtest-<pid>-sw) holding a bridge br0 with 10.213.S.2/24,
//     where dnsmasq answers the cluster's DNS (A records of the headless Service: every pod's IP;
//     A and PTR records of each pod's name <pod>.<service>.<namespace>.svc.cluster.local), and
//     nothing else: it forwards no query anywhere;
//   - one namespace per pod (kvmtest-<pid>-<i>): eth0 with 10.213.S.(10+i)/24 on the bridge, lo,
//     and /etc/netns/<ns>/resolv.conf naming dnsmasq with Kubernetes' search path and ndots:5
//     (`ip netns exec` bind-mounts it over /etc/resolv.conf);
//   - a veth from this (the root) namespace into the bridge, 10.213.S.1/24, so the test process
//     reaches every pod as the kubelet and in-cluster clients would.
// S is the first of 20..249 no address of this namespace uses (chosen under a file lock, so
// concurrent test runs take different subnets). The bridge lives in its own namespace so that
// the host's firewall (br_netfilter, a FORWARD policy of DROP) never sees pod traffic. The
// destructor kills what runs in the namespaces and deletes them, the veths with them, and the
// files; CleanLeftovers() does the same for runs whose process is gone.
//
// PodProcess runs a command in a pod's namespace (`ip netns exec`, which execs it, so the pid
// is the command's) and, for kvmesh-node, parses its start-up line.
//
// Thread safety: neither class is thread-safe; create and destroy them on the test's main thread
// (children die with the thread that forked them: PR_SET_PDEATHSIG).
#ifndef KVMESH_TESTS_INTEGRATION_POD_NETWORK_H_
#define KVMESH_TESTS_INTEGRATION_POD_NETWORK_H_

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tests/testing/node_process.h"

namespace kvmesh {
namespace testutil {

// "" when this process may create network namespaces, else why not (not root, or `ip netns
// add` refused, or iproute2 or dnsmasq missing): the reason a test skips.
std::string NetnsUnavailableReason();

// Deletes namespaces, /etc/netns entries and processes of earlier runs (prefix kvmtest-<pid>-)
// whose pid no longer exists. Returns what it removed, for the log.
std::vector<std::string> CleanLeftovers();

class PodNetwork {
 public:
  struct Options {
    std::vector<std::string> pods;  // pod names, e.g. kvmesh-0..2
    std::string service;            // the headless Service, e.g. kvmesh-peers
    std::string namespace_;         // e.g. default
    std::string cluster_domain = "cluster.local";
    std::string scratch_dir;  // for dnsmasq's files (its hosts file, log)
  };
  // INTERNAL naming the command and its output when a step fails (what was made is undone).
  static absl::StatusOr<std::unique_ptr<PodNetwork>> Create(const Options& options);
  ~PodNetwork();

  PodNetwork(const PodNetwork&) = delete;
  PodNetwork& operator=(const PodNetwork&) = delete;

  const std::string& pod_ip(size_t i) const { return pod_ips_[i]; }
  const std::string& pod_netns(size_t i) const { return pod_netns_[i]; }
  const std::string& dns_ip() const { return dns_ip_; }
  // <service>.<namespace>.svc.<domain>
  std::string ServiceFqdn() const;
  std::string PodFqdn(size_t i) const;
  // Takes pod i's records out of the DNS (its A record in the headless Service and its own
  // name), as Kubernetes does once a deleted pod is gone. INTERNAL when the hosts file cannot
  // be written.
  absl::Status RemovePodRecords(size_t i);
  // dnsmasq's log (queries are logged), for failure output.
  std::string DnsLog() const;

 private:
  explicit PodNetwork(Options options) : options_(std::move(options)) {}
  absl::Status Build();
  absl::Status WriteHosts();
  void TearDown();

  Options options_;
  std::string prefix_;  // kvmtest-<pid>
  std::string switch_netns_;
  std::vector<std::string> pod_netns_;
  std::vector<std::string> pod_ips_;
  std::vector<bool> published_;  // pod i has DNS records
  std::string dns_ip_;
  std::string hosts_file_, dns_log_;
  pid_t dnsmasq_ = -1;
};

class PodProcess {
 public:
  // Runs `argv` (argv[0] an absolute path) in network namespace `netns` with `env` ("NAME=value")
  // added to (or replacing in) this process's environment. stdout is a pipe read by
  // WaitForListeningLine, stderr goes to `stderr_path`.
  static absl::StatusOr<std::unique_ptr<PodProcess>> Start(const std::string& netns,
                                                           const std::vector<std::string>& argv,
                                                           const std::vector<std::string>& env,
                                                           const std::string& stderr_path);
  // SIGKILL when still running, then reaps it.
  ~PodProcess();

  PodProcess(const PodProcess&) = delete;
  PodProcess& operator=(const PodProcess&) = delete;

  // Reads kvmesh-node's "kvmesh-node <name> listening on ..." line. UNAVAILABLE with the
  // stderr when the process exits first, DEADLINE_EXCEEDED when it does not come in time.
  absl::StatusOr<std::string> WaitForListeningLine(absl::Duration timeout);

  pid_t pid() const { return pid_; }
  void Signal(int signal);
  // Reaps the process if it exits before `deadline`; the first result is kept.
  std::optional<ExitStatus> WaitUntil(absl::Time deadline);
  bool Running() { return !WaitUntil(absl::Now()).has_value(); }
  std::string ReadStderr() const;

 private:
  PodProcess(pid_t pid, int stdout_fd, std::string stderr_path)
      : pid_(pid), stdout_fd_(stdout_fd), stderr_path_(std::move(stderr_path)) {}

  pid_t pid_;
  int stdout_fd_;
  std::string stderr_path_;
  std::optional<ExitStatus> exit_;
};

}  // namespace testutil
}  // namespace kvmesh

#endif  // KVMESH_TESTS_INTEGRATION_POD_NETWORK_H_

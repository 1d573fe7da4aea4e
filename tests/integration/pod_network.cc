#include "tests/integration/pod_network.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "tests/testing/certs.h"

extern char** environ;

namespace kvmesh {
namespace testutil {
namespace {

constexpr char kPrefix[] = "kvmtest-";
// Where concurrent runs serialize the choice of a subnet.
constexpr char kLockFile[] = "/run/lock/kvmtest-pods.lock";
constexpr char kFallbackLockFile[] = "/tmp/kvmtest-pods.lock";

std::string Errno(const char* what) { return absl::StrCat(what, ": ", std::strerror(errno)); }

// The first of these that exists; "" when none does.
std::string FindBinary(std::initializer_list<const char*> paths) {
  for (const char* p : paths) {
    if (access(p, X_OK) == 0) return p;
  }
  return "";
}
std::string IpBinary() {
  return FindBinary({"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"});
}
std::string DnsmasqBinary() { return FindBinary({"/usr/sbin/dnsmasq", "/usr/bin/dnsmasq"}); }

absl::Status Ip(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {IpBinary()};
  argv.insert(argv.end(), args.begin(), args.end());
  absl::StatusOr<std::string> out = RunCommand(argv);
  return out.status();
}

absl::Status WriteFile(const std::string& path, const std::string& content) {
  std::ofstream f(path, std::ios::trunc);
  f << content;
  f.close();
  if (!f) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

// Whether `pid` has exited: no such process, or a zombie nobody reaped (a killed test's
// parent may be an init that does not reap).
bool ProcessIsGone(int pid) {
  if (kill(pid, 0) != 0) return errno == ESRCH;
  absl::StatusOr<std::string> stat = ReadTextFile(absl::StrCat("/proc/", pid, "/stat"));
  if (!stat.ok()) return true;
  const size_t paren = stat->rfind(')');  // "pid (comm) S ..."
  return paren != std::string::npos && paren + 2 < stat->size() && (*stat)[paren + 2] == 'Z';
}

// The pid in "kvmtest-<pid>-..." and whether that process is gone.
bool OwnerIsGone(const std::string& name) {
  if (!absl::StartsWith(name, kPrefix)) return false;
  const std::string rest = name.substr(sizeof(kPrefix) - 1);
  int pid = 0;
  if (!absl::SimpleAtoi(rest.substr(0, rest.find('-')), &pid) || pid <= 0) return false;
  return ProcessIsGone(pid);
}

// Every network namespace `ip netns list` shows.
std::vector<std::string> ListNetns() {
  std::vector<std::string> out;
  absl::StatusOr<std::string> list = RunCommand({IpBinary(), "netns", "list"});
  if (!list.ok()) return out;
  for (absl::string_view line : absl::StrSplit(*list, '\n', absl::SkipEmpty())) {
    out.emplace_back(line.substr(0, line.find(' ')));  // "name (id: 3)"
  }
  return out;
}

// Kills every process in `netns`, then deletes it (its veths go with it; a veth's peer in
// another namespace too).
void DeleteNetns(const std::string& netns) {
  absl::StatusOr<std::string> pids = RunCommand({IpBinary(), "netns", "pids", netns});
  if (pids.ok()) {
    for (absl::string_view p : absl::StrSplit(*pids, '\n', absl::SkipEmpty())) {
      int pid = 0;
      if (absl::SimpleAtoi(p, &pid) && pid > 0) kill(pid, SIGKILL);
    }
  }
  Ip({"netns", "delete", netns}).IgnoreError();
  const std::string etc = absl::StrCat("/etc/netns/", netns);
  unlink((etc + "/resolv.conf").c_str());
  rmdir(etc.c_str());
}

// This process's environment with `env` ("NAME=value") set or replaced.
std::vector<std::string> ChildEnvironment(const std::vector<std::string>& env) {
  std::vector<std::string> out;
  std::set<std::string> replaced;
  for (const std::string& e : env) replaced.insert(e.substr(0, e.find('=')));
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string var(*e);
    if (replaced.count(var.substr(0, var.find('='))) == 0) out.push_back(var);
  }
  out.insert(out.end(), env.begin(), env.end());
  return out;
}

// fork + exec of `argv` (absolute argv[0]) with stdout to `out_fd` (-1: /dev/null) and stderr
// to `err_fd`; the child gets SIGKILL when this thread dies.
absl::StatusOr<pid_t> Spawn(const std::vector<std::string>& argv_in,
                            const std::vector<std::string>& env, int out_fd, int err_fd) {
  std::vector<std::string> argv_storage = argv_in;
  std::vector<char*> argv;
  for (std::string& a : argv_storage) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> envp_storage = ChildEnvironment(env);
  std::vector<char*> envp;
  for (std::string& e : envp_storage) envp.push_back(e.data());
  envp.push_back(nullptr);
  const int null_fd = open("/dev/null", O_RDWR | O_CLOEXEC);
  const pid_t parent = getpid();
  sigset_t none;
  sigemptyset(&none);
  const pid_t pid = fork();
  if (pid < 0) {
    close(null_fd);
    return absl::InternalError(Errno("fork"));
  }
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(126);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    if (dup2(null_fd, STDIN_FILENO) < 0 ||
        dup2(out_fd >= 0 ? out_fd : null_fd, STDOUT_FILENO) < 0 ||
        dup2(err_fd >= 0 ? err_fd : null_fd, STDERR_FILENO) < 0) {
      _exit(125);
    }
    execve(argv[0], argv.data(), envp.data());
    static const char kMessage[] = "pod_network: execve failed\n";
    (void)!write(STDERR_FILENO, kMessage, sizeof(kMessage) - 1);
    _exit(127);
  }
  close(null_fd);
  return pid;
}

}  // namespace

std::string NetnsUnavailableReason() {
  if (geteuid() != 0) return "not root: network namespaces need CAP_NET_ADMIN and CAP_SYS_ADMIN";
  if (IpBinary().empty()) return "no ip command (Debian package iproute2)";
  if (DnsmasqBinary().empty()) return "no dnsmasq (Debian package dnsmasq-base)";
  const std::string probe = absl::StrCat(kPrefix, getpid(), "-probe");
  absl::StatusOr<CommandResult> add = RunProcess({IpBinary(), "netns", "add", probe});
  if (!add.ok()) return std::string(add.status().message());
  if (add->exit_code != 0) return absl::StrCat("`ip netns add` is not permitted: ", add->output);
  Ip({"netns", "delete", probe}).IgnoreError();
  return "";
}

std::vector<std::string> CleanLeftovers() {
  std::vector<std::string> removed;
  for (const std::string& ns : ListNetns()) {
    if (!OwnerIsGone(ns)) continue;
    DeleteNetns(ns);
    removed.push_back(absl::StrCat("netns ", ns));
  }
  // Root ends of the veths into the switch namespaces: kvm<pid>r.
  absl::StatusOr<std::string> links = RunCommand({IpBinary(), "-o", "link", "show"});
  if (links.ok()) {
    for (absl::string_view line : absl::StrSplit(*links, '\n', absl::SkipEmpty())) {
      // "7: kvm123r@if6: <...> ..."
      std::vector<absl::string_view> f = absl::StrSplit(line, absl::MaxSplits(' ', 2));
      if (f.size() < 2) continue;
      const std::string name(f[1].substr(0, f[1].find_first_of("@:")));
      if (!absl::StartsWith(name, "kvm") || !absl::EndsWith(name, "r")) continue;
      int pid = 0;
      if (!absl::SimpleAtoi(name.substr(3, name.size() - 4), &pid) || pid <= 0) continue;
      if (!ProcessIsGone(pid)) continue;
      Ip({"link", "delete", name}).IgnoreError();
      removed.push_back(absl::StrCat("link ", name));
    }
  }
  if (DIR* dir = opendir("/etc/netns")) {
    while (dirent* e = readdir(dir)) {
      const std::string name = e->d_name;
      if (!OwnerIsGone(name)) continue;
      const std::string path = absl::StrCat("/etc/netns/", name);
      unlink((path + "/resolv.conf").c_str());
      rmdir(path.c_str());
      removed.push_back(path);
    }
    closedir(dir);
  }
  return removed;
}

absl::StatusOr<std::unique_ptr<PodNetwork>> PodNetwork::Create(const Options& options) {
  std::unique_ptr<PodNetwork> net(new PodNetwork(options));
  absl::Status status = net->Build();
  if (!status.ok()) return status;  // the destructor undoes what Build made
  return net;
}

std::string PodNetwork::ServiceFqdn() const {
  return absl::StrCat(options_.service, ".", options_.namespace_, ".svc.", options_.cluster_domain);
}

std::string PodNetwork::PodFqdn(size_t i) const {
  return absl::StrCat(options_.pods[i], ".", ServiceFqdn());
}

std::string PodNetwork::DnsLog() const {
  absl::StatusOr<std::string> log = ReadTextFile(dns_log_);
  return log.ok() ? *log : std::string(log.status().message());
}

absl::Status PodNetwork::Build() {
  prefix_ = absl::StrCat(kPrefix, getpid());
  switch_netns_ = prefix_ + "-sw";
  const std::string root_if = absl::StrCat("kvm", getpid(), "r");
  const std::string sw_if = absl::StrCat("kvm", getpid(), "s");

  // The subnet: the first 10.213.S.0/24 that no address here uses, chosen and claimed (the
  // root end's address) under a lock, so that concurrent runs never share one.
  int lock = open(kLockFile, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (lock < 0) lock = open(kFallbackLockFile, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (lock < 0) return absl::InternalError(Errno(kFallbackLockFile));
  flock(lock, LOCK_EX);
  absl::Status status = [&]() -> absl::Status {
    absl::StatusOr<std::string> addrs = RunCommand({IpBinary(), "-o", "-4", "addr", "show"});
    if (!addrs.ok()) return addrs.status();
    int subnet = -1;
    for (int s = 20; s < 250 && subnet < 0; ++s) {
      if (!absl::StrContains(*addrs, absl::StrCat(" 10.213.", s, "."))) subnet = s;
    }
    if (subnet < 0) return absl::ResourceExhaustedError("no free 10.213.S.0/24 subnet");
    const std::string net = absl::StrCat("10.213.", subnet, ".");
    dns_ip_ = net + "2";
    for (size_t i = 0; i < options_.pods.size(); ++i) {
      pod_ips_.push_back(absl::StrCat(net, 10 + i));
    }
    if (absl::Status s = Ip({"netns", "add", switch_netns_}); !s.ok()) return s;
    for (const auto& args :
         std::vector<std::vector<std::string>>{{"link", "add", root_if, "type", "veth", "peer",
                                                "name", sw_if, "netns", switch_netns_},
                                               {"addr", "add", net + "1/24", "dev", root_if},
                                               {"link", "set", root_if, "up"}}) {
      if (absl::Status s = Ip(args); !s.ok()) return s;
    }
    return absl::OkStatus();
  }();
  flock(lock, LOCK_UN);
  close(lock);
  if (!status.ok()) return status;

  const std::string sw = switch_netns_;
  std::vector<std::vector<std::string>> steps = {
      {"-n", sw, "link", "set", "lo", "up"},
      {"-n", sw, "link", "add", "br0", "type", "bridge"},
      {"-n", sw, "addr", "add", dns_ip_ + "/24", "dev", "br0"},
      {"-n", sw, "link", "set", "br0", "up"},
      {"-n", sw, "link", "set", sw_if, "master", "br0"},
      {"-n", sw, "link", "set", sw_if, "up"},
  };
  for (size_t i = 0; i < options_.pods.size(); ++i) {
    const std::string ns = absl::StrCat(prefix_, "-", i);
    const std::string host_if = absl::StrCat("kvm", getpid(), "h", i);
    if (absl::Status s = Ip({"netns", "add", ns}); !s.ok()) return s;
    pod_netns_.push_back(ns);
    steps.push_back(
        {"-n", sw, "link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", ns});
    steps.push_back({"-n", sw, "link", "set", host_if, "master", "br0"});
    steps.push_back({"-n", sw, "link", "set", host_if, "up"});
    steps.push_back({"-n", ns, "link", "set", "lo", "up"});
    steps.push_back({"-n", ns, "addr", "add", pod_ips_[i] + "/24", "dev", "eth0"});
    steps.push_back({"-n", ns, "link", "set", "eth0", "up"});
  }
  for (const std::vector<std::string>& args : steps) {
    if (absl::Status s = Ip(args); !s.ok()) return s;
  }

  // Each pod's resolver, as the kubelet writes it for dnsPolicy ClusterFirst.
  const std::string ns_domain = absl::StrCat(options_.namespace_, ".svc.", options_.cluster_domain);
  const std::string resolv =
      absl::StrCat("search ", ns_domain, " svc.", options_.cluster_domain, " ",
                   options_.cluster_domain, "\nnameserver ", dns_ip_, "\noptions ndots:5\n");
  mkdir("/etc/netns", 0755);
  for (const std::string& ns : pod_netns_) {
    const std::string dir = absl::StrCat("/etc/netns/", ns);
    if (mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST)
      return absl::InternalError(Errno("mkdir"));
    if (absl::Status s = WriteFile(dir + "/resolv.conf", resolv); !s.ok()) return s;
  }

  // dnsmasq: each pod's FQDN first (its PTR record comes from the first name of the first line
  // of its address), then the headless Service's A records, one per pod.
  hosts_file_ = absl::StrCat(options_.scratch_dir, "/dns-hosts");
  dns_log_ = absl::StrCat(options_.scratch_dir, "/dnsmasq.log");
  published_.assign(options_.pods.size(), true);
  if (absl::Status s = WriteHosts(); !s.ok()) return s;
  const std::vector<std::string> argv = {
      IpBinary(),
      "netns",
      "exec",
      sw,
      DnsmasqBinary(),
      "--keep-in-foreground",
      "--no-resolv",
      "--no-hosts",
      "--no-poll",
      absl::StrCat("--addn-hosts=", hosts_file_),
      absl::StrCat("--listen-address=", dns_ip_),
      "--bind-interfaces",
      "--user=root",
      absl::StrCat("--pid-file=", options_.scratch_dir, "/dnsmasq.pid"),
      absl::StrCat("--local=/", options_.cluster_domain, "/"),
      "--local=/in-addr.arpa/",
      "--log-queries",
      absl::StrCat("--log-facility=", dns_log_)};
  absl::StatusOr<pid_t> pid = Spawn(argv, {}, -1, -1);
  if (!pid.ok()) return pid.status();
  dnsmasq_ = *pid;
  // Ready when it answers: a pod namespace resolves the Service to every pod.
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  std::string last;
  while (absl::Now() < deadline) {
    absl::StatusOr<CommandResult> r = RunProcess(
        {IpBinary(), "netns", "exec", pod_netns_[0], "getent", "ahostsv4", ServiceFqdn()});
    if (r.ok()) {
      last = r->output;
      bool all = r->exit_code == 0;
      for (const std::string& ip : pod_ips_) all = all && absl::StrContains(r->output, ip);
      if (all) return absl::OkStatus();
    }
    int wstatus = 0;
    if (waitpid(dnsmasq_, &wstatus, WNOHANG) == dnsmasq_) {
      dnsmasq_ = -1;
      return absl::InternalError(absl::StrCat("dnsmasq exited: ", DnsLog()));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("dnsmasq does not answer ", ServiceFqdn(), " with every pod: ", last));
}

absl::Status PodNetwork::WriteHosts() {
  // dnsmasq's PTR record for an address is the first name of its first line: the pod's name.
  std::string hosts;
  for (size_t i = 0; i < options_.pods.size(); ++i) {
    if (published_[i]) absl::StrAppend(&hosts, pod_ips_[i], " ", PodFqdn(i), "\n");
  }
  for (size_t i = 0; i < options_.pods.size(); ++i) {
    if (published_[i]) absl::StrAppend(&hosts, pod_ips_[i], " ", ServiceFqdn(), "\n");
  }
  const std::string next = hosts_file_ + ".next";
  if (absl::Status s = WriteFile(next, hosts); !s.ok()) return s;
  if (rename(next.c_str(), hosts_file_.c_str()) != 0) return absl::InternalError(Errno("rename"));
  return absl::OkStatus();
}

absl::Status PodNetwork::RemovePodRecords(size_t i) {
  published_[i] = false;
  if (absl::Status s = WriteHosts(); !s.ok()) return s;
  if (dnsmasq_ > 0) kill(dnsmasq_, SIGHUP);  // re-reads --addn-hosts, clears its cache
  return absl::OkStatus();
}

void PodNetwork::TearDown() {
  if (dnsmasq_ > 0) {
    kill(dnsmasq_, SIGKILL);
    waitpid(dnsmasq_, nullptr, 0);
    dnsmasq_ = -1;
  }
  for (const std::string& ns : pod_netns_) DeleteNetns(ns);
  pod_netns_.clear();
  if (!switch_netns_.empty()) {
    // The root end's veth explicitly: a deleted namespace's devices go asynchronously.
    Ip({"link", "delete", absl::StrCat("kvm", getpid(), "r")}).IgnoreError();
    DeleteNetns(switch_netns_);
  }
  switch_netns_.clear();
}

PodNetwork::~PodNetwork() { TearDown(); }

absl::StatusOr<std::unique_ptr<PodProcess>> PodProcess::Start(const std::string& netns,
                                                              const std::vector<std::string>& argv,
                                                              const std::vector<std::string>& env,
                                                              const std::string& stderr_path) {
  const int err_fd = open(stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (err_fd < 0) return absl::InternalError(Errno(stderr_path.c_str()));
  int out[2];
  if (pipe2(out, O_CLOEXEC) != 0) {
    close(err_fd);
    return absl::InternalError(Errno("pipe2"));
  }
  std::vector<std::string> full = {IpBinary(), "netns", "exec", netns};
  full.insert(full.end(), argv.begin(), argv.end());
  absl::StatusOr<pid_t> pid = Spawn(full, env, out[1], err_fd);
  close(err_fd);
  close(out[1]);
  if (!pid.ok()) {
    close(out[0]);
    return pid.status();
  }
  return std::unique_ptr<PodProcess>(new PodProcess(*pid, out[0], stderr_path));
}

PodProcess::~PodProcess() {
  if (!exit_.has_value()) {
    kill(pid_, SIGKILL);
    int status = 0;
    waitpid(pid_, &status, 0);
  }
  close(stdout_fd_);
}

absl::StatusOr<std::string> PodProcess::WaitForListeningLine(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  std::string text;
  while (text.find('\n') == std::string::npos) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(
          absl::StrCat("no listening line in time; stderr:\n", ReadStderr()));
    }
    pollfd p{stdout_fd_, POLLIN, 0};
    const int ready =
        poll(&p, 1, static_cast<int>(std::max<int64_t>(1, left / absl::Milliseconds(1))));
    if (ready < 0 && errno != EINTR) return absl::InternalError(Errno("poll"));
    if (ready <= 0) continue;
    char buf[1024];
    const ssize_t n = read(stdout_fd_, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      WaitUntil(absl::Now() + absl::Seconds(5));
      return absl::UnavailableError(
          absl::StrCat("kvmesh-node exited before listening; stderr:\n", ReadStderr()));
    }
    text.append(buf, static_cast<size_t>(n));
  }
  return text.substr(0, text.find('\n'));
}

void PodProcess::Signal(int signal) {
  if (!exit_.has_value()) kill(pid_, signal);
}

std::optional<ExitStatus> PodProcess::WaitUntil(absl::Time deadline) {
  absl::Duration pause = absl::Milliseconds(1);
  while (!exit_.has_value()) {
    int status = 0;
    const pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      exit_ = FromWaitStatus(status);
      break;
    }
    if (absl::Now() >= deadline) break;
    absl::SleepFor(std::min(pause, deadline - absl::Now()));
    pause = std::min(pause * 2, absl::Milliseconds(50));
  }
  return exit_;
}

std::string PodProcess::ReadStderr() const {
  absl::StatusOr<std::string> text = ReadTextFile(stderr_path_);
  return text.ok() ? *text : std::string(text.status().message());
}

}  // namespace testutil
}  // namespace kvmesh

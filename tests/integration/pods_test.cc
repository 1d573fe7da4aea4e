// Pods on one machine: CI's stand-in for a Kubernetes cluster. The StatefulSet that
// deploy/k8s/overlays/host renders (kubectl kustomize) runs as it would on Kubernetes, as far as
// one machine allows: three replicas of its container, each a real kvmesh-node process in a
// network namespace of its own with its own address on a bridge, started with the container's
// command, args and env exactly (downward API values and $(VAR) expansion as the kubelet does),
// the token Secret made of real files, the TLS volume filled as cert-manager's csi-driver fills
// it (a key and certificate issued for that pod alone, with the names and files its volume
// attributes give, and the CA), and a real DNS server (dnsmasq) answering the headless Service
// and the pods' reverse names, which is how the nodes find each other (--peer-dns). The test then
// acts as the kubelet (the manifest's startup, liveness and readiness probes over grpc.health.v1 on
// the health port) and as a tenant client over TLS with a bearer token: the cluster forms through
// DNS, a cross-node CopyPrefix and a Migrate move data byte-exact, and deleting a pod the kubelet's
// way (SIGTERM, SIGKILL after terminationGracePeriodSeconds) drains it: readiness turns
// NOT_SERVING, the node exits 0 in time, and every sequence and snapshot it held reads byte-exact
// on the survivors.
//
// Not emulated: the kubelet itself, a CNI plugin, the Kubernetes API (no Endpoints, the DNS
// records are static: the headless Service publishes not-ready addresses, so that matches),
// securityContext (the node runs as root here), resource limits, and restarts.
//
// Needs root and `ip netns add` (it skips otherwise; CI runs as root and runs it), iproute2,
// dnsmasq (Debian dnsmasq-base), openssl and kubectl (to render the manifest; or
// KVMESH_PODS_MANIFEST naming a rendered file).
#include <openssl/sha.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "service/common/client_channel.h"
#include "service/common/health_client.h"
#include "tests/integration/client_util.h"
#include "tests/integration/pod_manifest.h"
#include "tests/integration/pod_network.h"
#include "tests/testing/certs.h"
#include "tests/testing/node_process.h"

namespace kvmesh {
namespace testutil {
namespace {

using ::testing::HasSubstr;

constexpr char kTenant[] = "pods-test";
// Where the kubelet runs the container's command; replaced by the kvmesh-node of this build.
constexpr char kImageBinary[] = "/usr/local/bin/kvmesh-node";
// A grace period above this is cut to it: a hung drain should fail the test, not stall CI.
constexpr absl::Duration kMaxGrace = absl::Seconds(120);

// ---- $(VAR) expansion, as the kubelet does it (no root needed) ------------------------------

TEST(PodManifestTest, ExpandsVariablesAsKubernetesDoes) {
  const std::map<std::string, std::string> vars = {{"POD_NAME", "kvmesh-0"}, {"A", "x"}};
  EXPECT_EQ(ExpandK8sVars("--node-name=$(POD_NAME)", vars), "--node-name=kvmesh-0");
  EXPECT_EQ(ExpandK8sVars("$(A)$(A)-$(A)", vars), "xx-x");
  EXPECT_EQ(ExpandK8sVars("$(MISSING)", vars), "$(MISSING)");  // unknown: kept
  EXPECT_EQ(ExpandK8sVars("$$(A)", vars), "$(A)");             // escaped
  EXPECT_EQ(ExpandK8sVars("$$$(A)", vars), "$x");
  EXPECT_EQ(ExpandK8sVars("a$b", vars), "a$b");
  EXPECT_EQ(ExpandK8sVars("$(A", vars), "$(A");  // unterminated
  EXPECT_EQ(ExpandK8sVars("end$", vars), "end$");

  PodTemplate pod;
  pod.command = {"/bin/x"};
  pod.args = {"--a=$(B)", "--ip=$(IP)"};
  pod.env = {{"IP", "", "status.podIP"}, {"B", "$(IP):1-$(C)", ""}, {"C", "late", ""}};
  absl::StatusOr<ExpandedContainer> out = Expand(pod, {"p-0", "ns", "10.0.0.1"});
  ASSERT_TRUE(out.ok()) << out.status();
  // B may use IP (defined before it), not C (defined after).
  EXPECT_THAT(out->argv, ::testing::ElementsAre("/bin/x", "--a=10.0.0.1:1-$(C)", "--ip=10.0.0.1"));
}

// cert-manager's csi-driver expands its own variables in volume attributes, per pod.
TEST(PodManifestTest, ExpandsCsiDriverVariables) {
  const PodIdentity pod = {"kvmesh-1", "ns", "10.0.0.2"};
  absl::StatusOr<std::string> out =
      ExpandCsiVars("${POD_NAME},${POD_NAME}.peers.${POD_NAMESPACE}.svc,$POD_NAME-x,end$", pod);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, "kvmesh-1,kvmesh-1.peers.ns.svc,kvmesh-1-x,end$");
  // The driver refuses to issue for a variable it does not know; so does the emulation.
  EXPECT_THAT(ExpandCsiVars("${POD_IP}", pod).status().message(), HasSubstr("POD_IP"));
  EXPECT_FALSE(ExpandCsiVars("${POD_NAME", pod).ok());
  EXPECT_FALSE(ExpandCsiVars("$(POD_NAME)", pod).ok());  // Kubernetes' syntax is not the driver's
}

// The manifest's TLS volume is a per-pod csi.cert-manager.io volume, parsed with its attributes.
TEST(PodManifestTest, ParsesCsiVolumes) {
  absl::StatusOr<PodTemplate> pod = ParsePodTemplate(R"(
apiVersion: apps/v1
kind: StatefulSet
metadata: {name: s}
spec:
  serviceName: h
  template:
    spec:
      containers:
        - name: c
          command: [/bin/x]
          volumeMounts: [{name: tls, mountPath: /tls, readOnly: true}]
      volumes:
        - name: tls
          csi:
            driver: csi.cert-manager.io
            readOnly: true
            volumeAttributes: {csi.cert-manager.io/dns-names: "${POD_NAME}"}
)");
  ASSERT_TRUE(pod.ok()) << pod.status();
  EXPECT_EQ(pod->volumes.at("tls"), "csi:csi.cert-manager.io");
  EXPECT_TRUE(pod->csi_volumes.at("tls").read_only);
  EXPECT_EQ(pod->csi_volumes.at("tls").attributes.at("csi.cert-manager.io/dns-names"),
            "${POD_NAME}");
}

// ---- the cluster of pods ---------------------------------------------------------------------

std::string Sha256Hex(const std::string& data) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(data.data()), data.size(), digest);
  std::string hex;
  for (unsigned char b : digest) absl::StrAppend(&hex, absl::Hex(b, absl::kZeroPad2));
  return hex;
}

// The rendered manifest: $KVMESH_PODS_MANIFEST (a file), else `kubectl kustomize` of the host
// overlay. NOT_FOUND without kubectl.
absl::StatusOr<std::string> RenderManifest() {
  if (const char* file = std::getenv("KVMESH_PODS_MANIFEST"); file != nullptr && *file != '\0') {
    return ReadTextFile(file);
  }
  const std::string overlay = absl::StrCat(KVMESH_SOURCE_DIR, "/deploy/k8s/overlays/host");
  absl::StatusOr<CommandResult> r = RunProcess({"kubectl", "kustomize", overlay});
  if (!r.ok()) return absl::NotFoundError(absl::StrCat("kubectl: ", r.status().message()));
  if (r->exit_code == 127) return absl::NotFoundError("no kubectl in PATH");
  if (r->exit_code != 0) {
    return absl::InternalError(absl::StrCat("kubectl kustomize ", overlay, ": ", r->output));
  }
  return r->output;
}

// "key=value" words of kvmesh-node's listening line, and "listening on" as "listen".
std::map<std::string, std::string> ParseListeningLine(const std::string& line) {
  std::map<std::string, std::string> out;
  std::vector<std::string> words = absl::StrSplit(line, ' ', absl::SkipEmpty());
  for (size_t i = 0; i < words.size(); ++i) {
    if (words[i] == "on" && i + 1 < words.size()) out["listen"] = words[i + 1];
    const size_t eq = words[i].find('=');
    if (eq != std::string::npos) out[words[i].substr(0, eq)] = words[i].substr(eq + 1);
  }
  return out;
}

int PortOf(const std::string& host_port) {
  int port = 0;
  const size_t colon = host_port.rfind(':');
  if (colon == std::string::npos || !absl::SimpleAtoi(host_port.substr(colon + 1), &port)) return 0;
  return port;
}

struct Pod {
  std::string name;
  std::string ip;
  std::unique_ptr<PodProcess> process;
  std::string line;
  int client_port = 0;
  int health_port = 0;
  std::shared_ptr<grpc::Channel> health_channel;  // plaintext, as the kubelet probes
  std::unique_ptr<Stub> stub;                     // the tenant client, TLS + token
};

// ServingStatus of `service` on the pod's health port; nullopt when the RPC fails.
std::optional<ServingStatus> Probe(const Pod& pod, const std::string& service,
                                   absl::Duration timeout) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  ServingStatus status = ServingStatus::kUnknown;
  if (!HealthClient(pod.health_channel).Check(&context, service, &status).ok()) return std::nullopt;
  return status;
}

// Runs `probe` as the kubelet would until it succeeds (SERVING), loosely: polled from the start
// and more often than every period (no fixed sleeps), giving up after
// initialDelaySeconds + periodSeconds x failureThreshold (at least 10 s).
::testing::AssertionResult ProbeUntilServing(const Pod& pod, const GrpcProbe& probe,
                                             const char* which) {
  if (!probe.present) return ::testing::AssertionSuccess() << which << ": none";
  const absl::Duration budget = std::max(
      absl::Seconds(10), absl::Seconds(probe.initial_delay_seconds +
                                       int64_t{probe.period_seconds} * probe.failure_threshold));
  const absl::Time end = absl::Now() + budget;
  std::optional<ServingStatus> last;
  while (true) {
    last = Probe(pod, probe.service, absl::Seconds(std::max(1, probe.timeout_seconds)));
    if (last == ServingStatus::kServing) return ::testing::AssertionSuccess();
    if (absl::Now() > end) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return ::testing::AssertionFailure()
         << pod.name << ": " << which << " (grpc port " << probe.port << " service '"
         << probe.service << "') not SERVING within " << budget << ", last "
         << (last.has_value() ? ServingStatusName(*last) : "RPC failed") << "; stderr:\n"
         << pod.process->ReadStderr();
}

// Polls `condition` every 20 ms until it holds or `timeout` passes.
template <typename F>
bool Eventually(F condition, absl::Duration timeout) {
  const absl::Time end = absl::Now() + timeout;
  while (absl::Now() < end) {
    if (condition()) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return condition();
}

class PodsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const std::string why = NetnsUnavailableReason(); !why.empty()) {
      GTEST_SKIP() << "pods test needs network namespaces: " << why
                   << " (CI runs as root and runs it)";
    }
    for (const std::string& gone : CleanLeftovers()) {
      std::fprintf(stderr, "pods_test: removed a leftover of an earlier run: %s\n", gone.c_str());
    }
    // Without kubectl this fails rather than skips, as tests/deploy does: CI must run it.
    absl::StatusOr<std::string> yaml = RenderManifest();
    ASSERT_TRUE(yaml.ok()) << "cannot render the manifest: " << yaml.status()
                           << " (kubectl is not a Debian package: install it as "
                              "tests/deploy/check_manifests.sh says, or set "
                              "KVMESH_PODS_MANIFEST to a rendered file)";
    absl::StatusOr<PodTemplate> pod = ParsePodTemplate(*yaml);
    ASSERT_TRUE(pod.ok()) << pod.status();
    template_ = *std::move(pod);
    namespace_ = template_.namespace_.empty() ? "default" : template_.namespace_;
    ASSERT_EQ(template_.replicas, 3) << "the test expects the manifest's three replicas";

    absl::StatusOr<std::unique_ptr<TempDir>> dir = TempDir::Create("kvmesh-pods");
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = *std::move(dir);

    std::vector<std::string> names;
    for (int i = 0; i < template_.replicas; ++i) {
      names.push_back(absl::StrCat(template_.statefulset, "-", i));
    }
    PodNetwork::Options net;
    net.pods = names;
    net.service = template_.service_name;
    net.namespace_ = namespace_;
    net.scratch_dir = dir_->path();
    absl::StatusOr<std::unique_ptr<PodNetwork>> network = PodNetwork::Create(net);
    ASSERT_TRUE(network.ok()) << network.status();
    network_ = *std::move(network);

    ASSERT_NO_FATAL_FAILURE(MakeSecrets());
    for (size_t i = 0; i < names.size(); ++i) ASSERT_NO_FATAL_FAILURE(StartPod(i, names[i]));
    for (Pod& pod : pods_) ASSERT_NO_FATAL_FAILURE(AwaitStarted(pod));
  }

  // Scales the StatefulSet to zero: the test's caches are deleted first (a node drains what it
  // holds on SIGTERM; this test's drain is the pod deleted alone, not every pod at once), then
  // every pod gets SIGTERM at once and must exit 0.
  void TearDown() override {
    for (Pod& pod : pods_) {
      if (pod.stub == nullptr) continue;
      v1::ListCachesResponse caches;
      if (!ListCaches(*pod.stub, &caches).ok()) continue;
      for (const v1::CacheInfo& cache : caches.caches()) {
        EXPECT_TRUE(DeleteCache(*pod.stub, cache.spec().name()).ok()) << pod.name;
      }
    }
    for (Pod& pod : pods_) {
      pod.stub.reset();
      pod.health_channel.reset();
      if (pod.process == nullptr) continue;
      pod.process->Signal(SIGTERM);
    }
    for (Pod& pod : pods_) {
      if (pod.process == nullptr) continue;
      std::optional<ExitStatus> status = pod.process->WaitUntil(absl::Now() + absl::Seconds(60));
      EXPECT_TRUE(status.has_value() && status->clean())
          << pod.name << ": " << (status.has_value() ? status->ToString() : "did not exit")
          << "; stderr:\n"
          << pod.process->ReadStderr();
      pod.process.reset();  // SIGKILL if still there
    }
    pods_.clear();
    network_.reset();
  }

  // What exists before the pods (deploy/k8s/README.md, "Before applying"): the Secret
  // kvmesh-tokens with the key `tokens`, and the CA behind the Issuer the TLS volume names.
  void MakeSecrets() {
    const std::string tokens = dir_->File("secret-kvmesh-tokens");
    ASSERT_EQ(mkdir(tokens.c_str(), 0700), 0);
    absl::StatusOr<std::unique_ptr<TestCa>> ca =
        TestCa::Create(dir_->path(), "ca", "kvmesh pods test CA");
    ASSERT_TRUE(ca.ok()) << ca.status();
    ca_ = *std::move(ca);
    ca_file_ = ca_->cert_file();  // the client's trust
    token_ = absl::StrCat("pods-test-token-", getpid(), "-", absl::ToUnixNanos(absl::Now()));
    ASSERT_TRUE(ReplaceFile(tokens + "/tokens", absl::StrCat("token sha256:", Sha256Hex(token_),
                                                             " ", kTenant, " tenant\n"))
                    .ok());
    secrets_["kvmesh-tokens"] = tokens;
  }

  // Fills `dir` as cert-manager's csi-driver fills the pod's volume: a key made for this pod
  // alone and a certificate from the CA with the volume's dns-names (expanded for the pod) and
  // extended key usages, and the CA, under the file names its attributes give (the driver's
  // defaults otherwise). INVALID_ARGUMENT for attributes the driver would refuse or this
  // emulation does not do.
  absl::Status FillCertManagerVolume(const CsiVolume& volume, const PodIdentity& pod,
                                     const std::string& dir) {
    const auto attr = [&](const std::string& key, const std::string& fallback) {
      const auto it = volume.attributes.find(absl::StrCat("csi.cert-manager.io/", key));
      return it == volume.attributes.end() ? fallback : it->second;
    };
    if (!volume.read_only) return absl::InvalidArgumentError("csi.cert-manager.io needs readOnly");
    if (attr("issuer-name", "").empty()) {
      return absl::InvalidArgumentError("csi.cert-manager.io/issuer-name is required");
    }
    absl::StatusOr<std::string> dns_names = ExpandCsiVars(attr("dns-names", ""), pod);
    if (!dns_names.ok()) return dns_names.status();
    LeafOptions leaf;  // no common name unless the attributes ask for one, as the driver does
    absl::StatusOr<std::string> common_name = ExpandCsiVars(attr("common-name", ""), pod);
    if (!common_name.ok()) return common_name.status();
    leaf.common_name = *common_name;
    for (absl::string_view name : absl::StrSplit(*dns_names, ',', absl::SkipWhitespace())) {
      leaf.sans.push_back(absl::StrCat("DNS:", absl::StripAsciiWhitespace(name)));
    }
    std::vector<std::string> extended;
    for (absl::string_view usage : absl::StrSplit(attr("key-usages", ""), ',')) {
      usage = absl::StripAsciiWhitespace(usage);
      if (usage == "server auth") extended.push_back("serverAuth");
      if (usage == "client auth") extended.push_back("clientAuth");
    }
    if (extended.empty()) {
      return absl::InvalidArgumentError(
          "csi.cert-manager.io/key-usages name neither server auth nor client auth");
    }
    leaf.extended_key_usage = absl::StrJoin(extended, ",");
    if (attr("key-algorithm", "ECDSA") != "ECDSA" || attr("key-size", "256") != "256") {
      return absl::InvalidArgumentError("only ECDSA P-256 keys are emulated (certs.cc)");
    }
    absl::StatusOr<CertFiles> files = ca_->Issue(absl::StrCat("issued-", pod.name), leaf);
    if (!files.ok()) return files.status();
    for (auto [from, key, fallback] : {std::tuple{files->cert, "certificate-file", "tls.crt"},
                                       std::tuple{files->key, "privatekey-file", "tls.key"},
                                       std::tuple{ca_->cert_file(), "ca-file", "ca.crt"}}) {
      absl::StatusOr<std::string> pem = ReadTextFile(from);
      if (!pem.ok()) return pem.status();
      if (absl::Status s = ReplaceFile(absl::StrCat(dir, "/", attr(key, fallback)), *pem);
          !s.ok()) {
        return s;
      }
    }
    // The key lives in the pod's volume only, as the driver keeps it.
    if (unlink(files->key.c_str()) != 0) {
      return absl::InternalError(absl::StrCat("unlink ", files->key, ": ", strerror(errno)));
    }
    return absl::OkStatus();
  }

  // The container's command line for pod i: expanded as the kubelet does, with two rewrites:
  // the image's kvmesh-node becomes this build's, and each volume's mountPath prefix becomes the
  // directory that stands for the volume (a Secret's files, or a per-pod emptyDir).
  absl::StatusOr<std::vector<std::string>> CommandLine(size_t i, const std::string& name,
                                                       std::vector<std::string>* env) {
    absl::StatusOr<ExpandedContainer> c =
        Expand(template_, {name, namespace_, network_->pod_ip(i)});
    if (!c.ok()) return c.status();
    if (c->argv.empty() || c->argv[0] != kImageBinary) {
      return absl::InvalidArgumentError(
          absl::StrCat("the container's command is not ", kImageBinary));
    }
    c->argv[0] = NodeBinaryPath();
    std::map<std::string, std::string> volume_dirs;  // mountPath -> directory here
    for (const auto& [mount_path, volume] : template_.mounts) {
      const auto v = template_.volumes.find(volume);
      const std::string kind = v == template_.volumes.end() ? "" : v->second;
      if (absl::StartsWith(kind, "secret:")) {
        const auto s = secrets_.find(kind.substr(7));
        if (s == secrets_.end()) {
          return absl::InvalidArgumentError(absl::StrCat("volume ", volume, ": unknown ", kind));
        }
        volume_dirs[mount_path] = s->second;
      } else if (kind == "emptyDir") {
        const std::string d = dir_->File(absl::StrCat(name, "-", volume));
        mkdir(d.c_str(), 0700);
        volume_dirs[mount_path] = d;
      } else if (kind == "csi:csi.cert-manager.io") {
        const std::string d = dir_->File(absl::StrCat(name, "-", volume));
        mkdir(d.c_str(), 0700);
        absl::Status filled = FillCertManagerVolume(template_.csi_volumes.at(volume),
                                                    {name, namespace_, network_->pod_ip(i)}, d);
        if (!filled.ok()) {
          return absl::InvalidArgumentError(
              absl::StrCat("volume ", volume, ": ", filled.message()));
        }
        volume_dirs[mount_path] = d;
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat("volume ", volume, " (", kind, ") is not emulated"));
      }
    }
    // A path under a mount is a whole argument or follows "--flag="; the longest mountPath
    // that prefixes it wins, once per argument. Not argv[0], this build's binary, which may
    // itself live under a mounted path (a checkout under /tmp, the emptyDir's mountPath).
    for (size_t a = 1; a < c->argv.size(); ++a) {
      std::string& arg = c->argv[a];
      const size_t eq = arg.find('=');
      const size_t at =
          absl::StartsWith(arg, "/") ? 0 : (eq == std::string::npos ? arg.size() : eq + 1);
      const std::string path = arg.substr(at);
      std::string best;
      for (const auto& [mount_path, local] : volume_dirs) {
        if (absl::StartsWith(path, mount_path + "/") && mount_path.size() > best.size()) {
          best = mount_path;
        }
      }
      if (!best.empty()) arg.replace(at, best.size(), volume_dirs[best]);
    }
    for (const std::string& var : c->env_order) env->push_back(absl::StrCat(var, "=", c->env[var]));
    return c->argv;
  }

  void StartPod(size_t i, const std::string& name) {
    std::vector<std::string> env;
    absl::StatusOr<std::vector<std::string>> argv = CommandLine(i, name, &env);
    ASSERT_TRUE(argv.ok()) << argv.status();
    std::fprintf(stderr, "pods_test: %s in %s (%s): %s\n", name.c_str(),
                 network_->pod_netns(i).c_str(), network_->pod_ip(i).c_str(),
                 absl::StrJoin(*argv, " ").c_str());
    absl::StatusOr<std::unique_ptr<PodProcess>> process = PodProcess::Start(
        network_->pod_netns(i), *argv, env, dir_->File(absl::StrCat(name, ".stderr")));
    ASSERT_TRUE(process.ok()) << process.status();
    Pod pod;
    pod.name = name;
    pod.ip = network_->pod_ip(i);
    pod.process = *std::move(process);
    pods_.push_back(std::move(pod));
  }

  void AwaitStarted(Pod& pod) {
    absl::StatusOr<std::string> line = pod.process->WaitForListeningLine(absl::Seconds(60));
    ASSERT_TRUE(line.ok()) << pod.name << ": " << line.status();
    pod.line = *line;
    std::fprintf(stderr, "pods_test: %s: %s\n", pod.name.c_str(), line->c_str());
    const std::map<std::string, std::string> words = ParseListeningLine(*line);
    ASSERT_TRUE(words.count("listen")) << *line;
    pod.client_port = PortOf(words.at("listen"));
    ASSERT_NE(pod.client_port, 0) << *line;
    // The probes' port is the manifest's; the node's line must agree with it.
    pod.health_port = template_.startup.present ? template_.startup.port : pod.client_port;
    if (words.count("health")) {
      EXPECT_EQ(PortOf(words.at("health")), pod.health_port) << *line;
    }
    pod.health_channel = grpc::CreateChannel(absl::StrCat(pod.ip, ":", pod.health_port),
                                             grpc::InsecureChannelCredentials());
    ClientConnectionOptions client;
    client.tls.ca_file = ca_file_;
    client.tls.server_name = network_->PodFqdn(&pod - pods_.data());
    client.token = token_;
    absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
        NewClientChannel(absl::StrCat(pod.ip, ":", pod.client_port), client);
    ASSERT_TRUE(channel.ok()) << channel.status();
    pod.stub = v1::CacheService::NewStub(*channel);
    // The kubelet: the startup probe first, then liveness and readiness.
    ASSERT_TRUE(ProbeUntilServing(pod, template_.startup, "startupProbe"));
    ASSERT_TRUE(ProbeUntilServing(pod, template_.liveness, "livenessProbe"));
    ASSERT_TRUE(ProbeUntilServing(pod, template_.readiness, "readinessProbe"));
  }

  // ListMembers on every pod shows every pod SERVING (discovery through DNS re-resolves every
  // few seconds, so a pod that started before the others were up needs a moment).
  void AwaitCluster() {
    for (Pod& pod : pods_) {
      v1::ListMembersResponse members;
      const bool formed = Eventually(
          [&] {
            grpc::ClientContext context;
            SetDeadline(&context, absl::Seconds(10));
            members.Clear();
            if (!pod.stub->ListMembers(&context, v1::ListMembersRequest(), &members).ok()) {
              return false;
            }
            if (members.members_size() != static_cast<int>(pods_.size())) return false;
            for (const v1::Member& m : members.members()) {
              if (m.health() != v1::MEMBER_HEALTH_SERVING) return false;
            }
            return true;
          },
          absl::Seconds(30));
      ASSERT_TRUE(formed) << pod.name << " sees " << members.DebugString() << "\nstderr:\n"
                          << pod.process->ReadStderr() << "\ndnsmasq:\n"
                          << network_->DnsLog();
      EXPECT_EQ(members.members(0).name(), pod.name);
      EXPECT_TRUE(members.members(0).self());
      std::set<std::string> names;
      for (const v1::Member& m : members.members()) names.insert(m.name());
      std::set<std::string> expected;
      for (const Pod& p : pods_) expected.insert(p.name);
      EXPECT_EQ(names, expected);
    }
  }

  PodTemplate template_;
  std::string namespace_;
  std::unique_ptr<TempDir> dir_;
  std::unique_ptr<PodNetwork> network_;
  std::map<std::string, std::string> secrets_;  // secretName -> directory
  std::unique_ptr<TestCa> ca_;                  // the Issuer's CA
  std::string ca_file_, token_;
  std::vector<Pod> pods_;
};

// ---- data ------------------------------------------------------------------------------------

// Attention only (full and sliding windows are not mixed, so that the model of what a sequence
// stores is exact): F32, 2 layers x 2 heads x 4 + 4 dims, 128 B per token and layer.
v1::CacheSpec PodsSpec(const std::string& name) {
  return SpecProto(name, 16, 256, 64, {AttentionGroupProto(AttentionOptions())});
}

std::vector<int32_t> Range(int32_t begin, int32_t end) {
  std::vector<int32_t> out(end - begin);
  std::iota(out.begin(), out.end(), begin);
  return out;
}

// What the test wrote: a sequence's pattern ids (seq and seed of its Append), per group.
struct Written {
  std::string cache;
  int64_t seq = 0;  // the id it was written under (its pattern ids depend on it)
  SequenceModel model;
};

void AppendModelled(Stub& stub, const v1::CacheSpec& spec, int64_t seq, int32_t tokens,
                    uint64_t seed, Written* out) {
  out->cache = spec.name();
  out->seq = seq;
  out->model.assign(spec.groups_size(), {});
  const grpc::Status status = Append(stub, MakeAppend(spec, seq, Range(0, tokens), seed));
  ASSERT_TRUE(status.ok()) << StatusText(status);
  ModelAppend(spec, seq, Range(0, tokens), seed, &out->model);
}

// Whether `seq` of `cache` on `stub` holds exactly what `model` says (positions and bytes).
::testing::AssertionResult ReadsAs(Stub& stub, const v1::CacheSpec& spec, int64_t seq,
                                   const SequenceModel& model) {
  ReadOutput out;
  const grpc::Status status = Read(stub, ReadRequest(spec.name(), seq), &out);
  if (!status.ok()) return ::testing::AssertionFailure() << "Read: " << StatusText(status);
  const std::vector<std::vector<int32_t>> positions = HeaderPositions(out.header);
  for (size_t g = 0; g < model.size(); ++g) {
    std::vector<int32_t> expected;
    for (const auto& [pos, id] : model[g]) expected.push_back(pos);
    if (g >= positions.size() || positions[g] != expected) {
      return ::testing::AssertionFailure() << "group " << g << " positions differ";
    }
  }
  if (out.payload != ExpectedReadPayload(spec, model, positions)) {
    return ::testing::AssertionFailure() << "payload differs (" << out.payload.size() << " bytes)";
  }
  return ::testing::AssertionSuccess();
}

std::vector<int64_t> Seqs(Stub& stub, const std::string& cache) {
  v1::ListSequencesResponse list;
  const grpc::Status status = ListSequences(stub, cache, &list);
  std::vector<int64_t> out;
  if (!status.ok()) return out;  // NOT_FOUND: no such cache there (yet)
  for (const v1::SequenceInfo& s : list.sequences()) out.push_back(s.seq());
  return out;
}

TEST_F(PodsTest, ClusterFormsThroughDnsAndMovesDataAcrossPods) {
  ASSERT_NO_FATAL_FAILURE(AwaitCluster());
  const v1::CacheSpec spec = PodsSpec("pods");
  for (Pod& pod : pods_) {
    const grpc::Status status = CreateCache(*pod.stub, spec);
    ASSERT_TRUE(status.ok()) << pod.name << ": " << StatusText(status);
  }
  Written one, two;
  ASSERT_NO_FATAL_FAILURE(AppendModelled(*pods_[0].stub, spec, 1, 40, 7, &one));
  ASSERT_NO_FATAL_FAILURE(AppendModelled(*pods_[0].stub, spec, 2, 25, 9, &two));
  ASSERT_TRUE(ReadsAs(*pods_[0].stub, spec, 1, one.model));

  // CopyPrefix on kvmesh-1 from kvmesh-0 (the whole sequence, same id, so that the pattern
  // ids agree).
  {
    grpc::ClientContext context;
    SetDeadline(&context);
    v1::CopyPrefixRequest request;
    request.set_cache("pods");
    request.set_src_seq(1);
    request.set_dst_seq(1);
    request.set_length(40);
    request.set_source_node(pods_[0].name);
    v1::CopyPrefixResponse response;
    const grpc::Status status = pods_[1].stub->CopyPrefix(&context, request, &response);
    ASSERT_TRUE(status.ok()) << StatusText(status);
    EXPECT_EQ(response.transfer().transport(), "grpc-stream");
    EXPECT_GT(response.transfer().bytes(), 0);
  }
  EXPECT_TRUE(ReadsAs(*pods_[1].stub, spec, 1, one.model));
  EXPECT_TRUE(ReadsAs(*pods_[0].stub, spec, 1, one.model));  // the source is unchanged

  // Migrate seq 2 from kvmesh-0 to kvmesh-2: there, gone here.
  {
    grpc::ClientContext context;
    SetDeadline(&context);
    v1::MigrateRequest request;
    request.set_cache("pods");
    request.set_seq(2);
    request.set_target_node(pods_[2].name);
    request.set_target_seq(2);
    v1::MigrateResponse response;
    const grpc::Status status = pods_[0].stub->Migrate(&context, request, &response);
    ASSERT_TRUE(status.ok()) << StatusText(status);
  }
  EXPECT_TRUE(ReadsAs(*pods_[2].stub, spec, 2, two.model));
  EXPECT_THAT(Seqs(*pods_[0].stub, "pods"), ::testing::ElementsAre(1));
}

// A snapshot the test took: the sequence it came from (as written) and its range.
struct WrittenSnapshot {
  std::string cache;
  const Written* source = nullptr;
  int32_t from = 0, to = 0;
};

TEST_F(PodsTest, DeletedPodDrainsEverySequenceAndSnapshotToTheSurvivors) {
  ASSERT_NO_FATAL_FAILURE(AwaitCluster());
  Pod& doomed = pods_[1];
  const v1::CacheSpec shared = PodsSpec("pods");
  const v1::CacheSpec only_here = PodsSpec("only-on-kvmesh-1");  // drain creates it on a peer
  for (Pod& pod : pods_) ASSERT_TRUE(CreateCache(*pod.stub, shared).ok());
  ASSERT_TRUE(CreateCache(*doomed.stub, only_here).ok());

  // The survivors hold seq 1 already (other data): the doomed pod's seq 1 must move under
  // another id, its seqs 11..16 may keep theirs.
  std::vector<Written> survivors_own(2);
  ASSERT_NO_FATAL_FAILURE(AppendModelled(*pods_[0].stub, shared, 1, 8, 100, &survivors_own[0]));
  ASSERT_NO_FATAL_FAILURE(AppendModelled(*pods_[2].stub, shared, 1, 9, 101, &survivors_own[1]));
  std::vector<Written> written;
  written.reserve(16);  // WrittenSnapshot points into it
  for (int64_t seq : {1, 11, 12, 13, 14, 15, 16}) {
    written.emplace_back();
    ASSERT_NO_FATAL_FAILURE(AppendModelled(*doomed.stub, shared, seq,
                                           30 + static_cast<int32_t>(seq), 7, &written.back()));
  }
  for (int64_t seq : {3, 4}) {
    written.emplace_back();
    ASSERT_NO_FATAL_FAILURE(AppendModelled(*doomed.stub, only_here, seq, 50, 8, &written.back()));
  }
  std::vector<WrittenSnapshot> snapshots;
  for (size_t i : {size_t{1}, size_t{7}}) {  // seq 11 of "pods", seq 3 of "only-on-kvmesh-1"
    const v1::CacheSpec& spec = written[i].cache == "pods" ? shared : only_here;
    v1::SnapshotInfo info;
    const grpc::Status status = Snapshot(*doomed.stub, spec.name(), written[i].seq, 0, &info);
    ASSERT_TRUE(status.ok()) << StatusText(status);
    snapshots.push_back({spec.name(), &written[i], info.from_offset(), info.to_offset()});
  }
  // A snapshot whose sequence is gone afterwards: it must move on its own.
  Written gone;
  {
    ASSERT_NO_FATAL_FAILURE(AppendModelled(*doomed.stub, shared, 20, 12, 9, &gone));
    v1::SnapshotInfo info;
    ASSERT_TRUE(Snapshot(*doomed.stub, "pods", 20, 0, &info).ok());
    snapshots.push_back({"pods", &gone, info.from_offset(), info.to_offset()});
    ASSERT_TRUE(Remove(*doomed.stub, "pods", 20, 0).ok());
  }

  // The kubelet deletes the pod: SIGTERM, then SIGKILL after the grace period. Meanwhile the
  // readiness probe (polled tightly: a small drain is quick) must turn NOT_SERVING before the
  // node goes.
  const absl::Duration grace =
      std::min(kMaxGrace, absl::Seconds(template_.termination_grace_seconds));
  // Once it is seen, one CreateCache tells how the draining node treats new work: UNAVAILABLE
  // ("draining" while it drains; a connection error once it has shut its port).
  std::atomic<bool> stop{false};
  std::atomic<bool> saw_not_serving{false};
  grpc::Status create_while_draining;
  std::optional<ServingStatus> liveness_while_draining;
  std::thread readiness([&] {
    while (!stop.load()) {
      const std::optional<ServingStatus> s =
          Probe(doomed, template_.readiness.service, absl::Seconds(1));
      if (s == ServingStatus::kNotServing && !saw_not_serving.load()) {
        saw_not_serving.store(true);
        // The liveness probe's service must stay SERVING while the node drains (a kubelet
        // would restart it half-way otherwise): probed before the CreateCache, so that a
        // "draining" answer to that proves the probe came during the drain.
        liveness_while_draining = Probe(doomed, template_.liveness.service, absl::Seconds(1));
        create_while_draining = CreateCache(*doomed.stub, PodsSpec("created-while-draining"));
      }
      if (!s.has_value() && saw_not_serving.load()) break;  // gone after draining
    }
  });
  const absl::Time deleted_at = absl::Now();
  doomed.process->Signal(SIGTERM);
  std::optional<ExitStatus> exit = doomed.process->WaitUntil(deleted_at + grace);
  if (!exit.has_value()) {
    doomed.process->Signal(SIGKILL);  // what the kubelet would do
    exit = doomed.process->WaitUntil(absl::InfiniteFuture());
    ADD_FAILURE() << doomed.name << " did not exit within the grace period " << grace;
  }
  const absl::Duration took = absl::Now() - deleted_at;
  stop.store(true);
  readiness.join();
  const std::string log = doomed.process->ReadStderr();
  std::fprintf(stderr, "pods_test: %s deleted: %s after %s; its stderr:\n%s\n", doomed.name.c_str(),
               exit->ToString().c_str(), absl::FormatDuration(took).c_str(), log.c_str());
  EXPECT_TRUE(exit->exited && exit->code == 0) << exit->ToString();
  EXPECT_TRUE(saw_not_serving.load())
      << "readiness (" << template_.readiness.service << ") never NOT_SERVING while draining";
  if (saw_not_serving.load()) {
    EXPECT_EQ(create_while_draining.error_code(), grpc::StatusCode::UNAVAILABLE)
        << StatusText(create_while_draining);
    std::fprintf(stderr, "pods_test: CreateCache while %s drained: %s\n", doomed.name.c_str(),
                 StatusText(create_while_draining).c_str());
    if (template_.liveness.present &&
        absl::StrContains(create_while_draining.error_message(), "draining")) {
      EXPECT_EQ(liveness_while_draining, ServingStatus::kServing)
          << "livenessProbe (service '" << template_.liveness.service
          << "') failed while the node drained";
    }
  }
  doomed.process.reset();
  doomed.stub.reset();
  // The pod object is gone: so are its DNS records.
  ASSERT_TRUE(network_->RemovePodRecords(1).ok());

  // Every sequence it held is on a survivor, byte-exact: matched by content, since ids may
  // change (seq 1 was taken on both survivors).
  std::vector<Pod*> survivors = {&pods_[0], &pods_[2]};
  std::set<std::tuple<Pod*, std::string, int64_t>> claimed;
  for (size_t s = 0; s < survivors.size(); ++s) {
    claimed.insert({survivors[s], "pods", 1});
    EXPECT_TRUE(ReadsAs(*survivors[s]->stub, shared, 1, survivors_own[s].model))
        << survivors[s]->name << "'s own seq 1 changed";
  }
  for (const Written& w : written) {
    const v1::CacheSpec& spec = w.cache == "pods" ? shared : only_here;
    bool found = false;
    for (Pod* pod : survivors) {
      for (int64_t seq : Seqs(*pod->stub, w.cache)) {
        if (claimed.count({pod, w.cache, seq}) != 0) continue;
        if (ReadsAs(*pod->stub, spec, seq, w.model)) {
          claimed.insert({pod, w.cache, seq});
          found = true;
          std::fprintf(stderr, "pods_test: %s seq %lld is seq %lld on %s\n", w.cache.c_str(),
                       static_cast<long long>(w.seq), static_cast<long long>(seq),
                       pod->name.c_str());
          break;
        }
      }
      if (found) break;
    }
    EXPECT_TRUE(found) << w.cache << " seq " << w.seq << " is on no survivor";
  }
  // Every snapshot too: restored into a fresh sequence on the survivor that holds it, it reads
  // as the sequence did when it was taken.
  std::set<std::tuple<Pod*, std::string, uint64_t>> used;
  int64_t scratch_seq = 900;
  for (const WrittenSnapshot& snap : snapshots) {
    const v1::CacheSpec& spec = snap.cache == "pods" ? shared : only_here;
    SequenceModel expected = snap.source->model;
    for (auto& group : expected) {
      for (auto it = group.begin(); it != group.end();) {
        it = it->first >= snap.from && it->first < snap.to ? std::next(it) : group.erase(it);
      }
    }
    bool found = false;
    for (Pod* pod : survivors) {
      v1::ListSnapshotsResponse list;
      if (!ListSnapshots(*pod->stub, snap.cache, &list).ok()) continue;
      for (const v1::SnapshotInfo& info : list.snapshots()) {
        if (used.count({pod, snap.cache, info.id()}) != 0) continue;
        if (info.from_offset() != snap.from || info.to_offset() != snap.to) continue;
        const int64_t into = scratch_seq++;
        const grpc::Status status = Restore(*pod->stub, snap.cache, into, info.id(), snap.to);
        if (!status.ok()) continue;
        // Restored under another id, the pattern ids are still those of the original seq.
        if (ReadsAs(*pod->stub, spec, into, expected)) {
          used.insert({pod, snap.cache, info.id()});
          found = true;
        }
        ASSERT_TRUE(Remove(*pod->stub, snap.cache, into, 0).ok());
        if (found) break;
      }
      if (found) break;
    }
    EXPECT_TRUE(found) << snap.cache << ": the snapshot of seq " << snap.source->seq << " ["
                       << snap.from << ", " << snap.to << ") is on no survivor";
  }
}

}  // namespace
}  // namespace testutil
}  // namespace kvmesh

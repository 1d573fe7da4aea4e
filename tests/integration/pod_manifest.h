// PodTemplate: what the pods test (pods_test.cc) takes from a rendered Kubernetes manifest
// (`kubectl kustomize deploy/k8s/overlays/host`): the StatefulSet's one container, its command,
// args and env, its volume mounts and volumes (CSI volumes with their attributes), its probes,
// the grace period, and the headless Service it names. Parsed with yaml-cpp, no Kubernetes API
// involved.
//
// Expand() applies what the kubelet would to a container's command and args: the env entries
// in order (plain values and the downward API's metadata.name, metadata.namespace,
// status.podIP), each value able to refer to earlier ones, and then $(VAR) references in the
// command and args, with Kubernetes' rules ($$ is a literal $, an unknown $(VAR) stays as it
// is; ExpandK8sVars). ExpandCsiVars does what cert-manager's csi-driver does to its volume
// attributes (${POD_NAME} and the like).
//
// Thread safety: plain values.
#ifndef KVMESH_TESTS_INTEGRATION_POD_MANIFEST_H_
#define KVMESH_TESTS_INTEGRATION_POD_MANIFEST_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvmesh {
namespace testutil {

// A probe as the kubelet runs it. Only grpc probes are supported (a manifest with httpGet,
// tcpSocket or exec probes is refused by ParsePodTemplate, since kvmesh-node serves none).
struct GrpcProbe {
  bool present = false;
  int32_t port = 0;
  std::string service;  // "" checks the whole server
  int32_t initial_delay_seconds = 0;
  int32_t period_seconds = 10;  // Kubernetes' defaults
  int32_t timeout_seconds = 1;
  int32_t failure_threshold = 3;
};

struct EnvVar {
  std::string name;
  std::string value;       // when field_path is empty
  std::string field_path;  // downward API: metadata.name, metadata.namespace, status.podIP
};

// A CSI volume of the pod: the driver and its volumeAttributes, as written (a driver expands
// its own variables in them, per pod).
struct CsiVolume {
  std::string driver;
  bool read_only = false;
  std::map<std::string, std::string> attributes;
};

struct PodTemplate {
  std::string statefulset;   // metadata.name
  std::string namespace_;    // metadata.namespace, "" when the manifest sets none
  std::string service_name;  // spec.serviceName: the headless Service
  int32_t replicas = 1;
  int64_t termination_grace_seconds = 30;  // Kubernetes' default
  std::string container;
  std::vector<std::string> command;
  std::vector<std::string> args;
  std::vector<EnvVar> env;
  std::map<std::string, std::string> mounts;  // mountPath -> volume name
  // Volume name -> "secret:<secretName>", "csi:<driver>", "emptyDir" or "other".
  std::map<std::string, std::string> volumes;
  std::map<std::string, CsiVolume> csi_volumes;  // the "csi:" ones, by volume name
  GrpcProbe startup, liveness, readiness;
  // Ports of the Services the manifest defines, by Service name (first port of each).
  std::map<std::string, int32_t> service_ports;
};

// The StatefulSet of `yaml` (several documents, as kubectl prints them). INVALID_ARGUMENT naming
// the field when the manifest has no StatefulSet, not exactly one container, or a construct this
// emulation does not do (an env source other than a value or those three fieldRefs, a probe
// that is not grpc).
absl::StatusOr<PodTemplate> ParsePodTemplate(const std::string& yaml);

// Kubernetes' $(VAR) expansion (k8s.io/kubernetes third_party/forked/golang/expansion): $(NAME)
// becomes vars[NAME] when NAME is defined, else stays "$(NAME)"; "$$" becomes "$"; a "$" before
// anything else, and an unterminated "$(", stay as they are.
std::string ExpandK8sVars(absl::string_view input, const std::map<std::string, std::string>& vars);

// The downward-API facts of one pod.
struct PodIdentity {
  std::string name;        // metadata.name, e.g. kvmesh-0
  std::string namespace_;  // metadata.namespace
  std::string ip;          // status.podIP
};

// The container's environment (name -> value, as the kubelet builds it) and its command line
// (command then args, expanded). INVALID_ARGUMENT for a fieldPath other than the three above.
struct ExpandedContainer {
  std::map<std::string, std::string> env;
  std::vector<std::string> env_order;  // names in manifest order
  std::vector<std::string> argv;
};
absl::StatusOr<ExpandedContainer> Expand(const PodTemplate& pod, const PodIdentity& identity);

// cert-manager csi-driver's expansion of a volume attribute for one pod (Go's os.Expand over the
// pod's facts): ${POD_NAME} or $POD_NAME, ${POD_NAMESPACE}. INVALID_ARGUMENT naming the variable
// for any other (the driver refuses to issue then; POD_UID and SERVICE_ACCOUNT_NAME, which it
// knows, are not emulated), and for a "$" followed by neither a name nor "{".
absl::StatusOr<std::string> ExpandCsiVars(absl::string_view input, const PodIdentity& identity);

}  // namespace testutil
}  // namespace kvmesh

#endif  // KVMESH_TESTS_INTEGRATION_POD_MANIFEST_H_

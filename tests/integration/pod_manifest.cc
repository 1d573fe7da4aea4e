#include "tests/integration/pod_manifest.h"

#include <exception>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "yaml-cpp/yaml.h"

namespace kvmesh {
namespace testutil {
namespace {

absl::Status Invalid(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("manifest: ", what));
}

// An integer field of a probe, or its Kubernetes default when absent.
int32_t IntOr(const YAML::Node& node, const char* key, int32_t fallback) {
  const YAML::Node v = node[key];
  return v ? v.as<int32_t>() : fallback;
}

absl::StatusOr<GrpcProbe> ParseProbe(const YAML::Node& container, const char* key) {
  GrpcProbe probe;
  const YAML::Node node = container[key];
  if (!node) return probe;
  const YAML::Node grpc = node["grpc"];
  if (!grpc) {
    return Invalid(absl::StrCat(key, " is not a grpc probe: this emulation runs grpc probes only"));
  }
  probe.present = true;
  probe.port = grpc["port"].as<int32_t>();
  if (grpc["service"]) probe.service = grpc["service"].as<std::string>();
  probe.initial_delay_seconds = IntOr(node, "initialDelaySeconds", 0);
  probe.period_seconds = IntOr(node, "periodSeconds", 10);
  probe.timeout_seconds = IntOr(node, "timeoutSeconds", 1);
  probe.failure_threshold = IntOr(node, "failureThreshold", 3);
  return probe;
}

absl::StatusOr<PodTemplate> ParseStatefulSet(const YAML::Node& doc) {
  PodTemplate pod;
  pod.statefulset = doc["metadata"]["name"].as<std::string>();
  if (doc["metadata"]["namespace"]) pod.namespace_ = doc["metadata"]["namespace"].as<std::string>();
  const YAML::Node spec = doc["spec"];
  if (!spec["serviceName"]) return Invalid("the StatefulSet has no spec.serviceName");
  pod.service_name = spec["serviceName"].as<std::string>();
  if (spec["replicas"]) pod.replicas = spec["replicas"].as<int32_t>();
  const YAML::Node pod_spec = spec["template"]["spec"];
  if (pod_spec["terminationGracePeriodSeconds"]) {
    pod.termination_grace_seconds = pod_spec["terminationGracePeriodSeconds"].as<int64_t>();
  }
  const YAML::Node containers = pod_spec["containers"];
  if (!containers || !containers.IsSequence() || containers.size() != 1) {
    return Invalid("the StatefulSet's pod must have exactly one container");
  }
  const YAML::Node c = containers[0];
  pod.container = c["name"].as<std::string>();
  if (!c["command"]) return Invalid("the container has no command");
  for (const YAML::Node& s : c["command"]) pod.command.push_back(s.as<std::string>());
  if (c["args"]) {
    for (const YAML::Node& s : c["args"]) pod.args.push_back(s.as<std::string>());
  }
  if (c["env"]) {
    for (const YAML::Node& e : c["env"]) {
      EnvVar var;
      var.name = e["name"].as<std::string>();
      if (e["value"]) {
        var.value = e["value"].as<std::string>();
      } else if (e["valueFrom"] && e["valueFrom"]["fieldRef"]) {
        var.field_path = e["valueFrom"]["fieldRef"]["fieldPath"].as<std::string>();
      } else if (e["valueFrom"]) {
        return Invalid(absl::StrCat("env ", var.name,
                                    ": only values and fieldRef are emulated, not ",
                                    YAML::Dump(e["valueFrom"])));
      }
      pod.env.push_back(std::move(var));
    }
  }
  if (c["volumeMounts"]) {
    for (const YAML::Node& m : c["volumeMounts"]) {
      pod.mounts[m["mountPath"].as<std::string>()] = m["name"].as<std::string>();
    }
  }
  if (pod_spec["volumes"]) {
    for (const YAML::Node& v : pod_spec["volumes"]) {
      std::string kind = "other";
      const std::string name = v["name"].as<std::string>();
      if (v["secret"]) {
        kind = absl::StrCat("secret:", v["secret"]["secretName"].as<std::string>());
      } else if (v["emptyDir"]) {
        kind = "emptyDir";
      } else if (const YAML::Node csi = v["csi"]) {
        CsiVolume volume;
        volume.driver = csi["driver"].as<std::string>();
        volume.read_only = csi["readOnly"] && csi["readOnly"].as<bool>();
        if (const YAML::Node attributes = csi["volumeAttributes"]) {
          for (const auto& entry : attributes) {
            volume.attributes[entry.first.as<std::string>()] = entry.second.as<std::string>();
          }
        }
        kind = absl::StrCat("csi:", volume.driver);
        pod.csi_volumes[name] = std::move(volume);
      }
      pod.volumes[name] = kind;
    }
  }
  for (auto [probe, key] :
       {std::pair{&pod.startup, "startupProbe"}, std::pair{&pod.liveness, "livenessProbe"},
        std::pair{&pod.readiness, "readinessProbe"}}) {
    absl::StatusOr<GrpcProbe> parsed = ParseProbe(c, key);
    if (!parsed.ok()) return parsed.status();
    *probe = *parsed;
  }
  return pod;
}

}  // namespace

absl::StatusOr<PodTemplate> ParsePodTemplate(const std::string& yaml) {
  try {
    std::vector<YAML::Node> docs = YAML::LoadAll(yaml);
    std::map<std::string, int32_t> service_ports;
    std::vector<PodTemplate> sets;
    for (const YAML::Node& doc : docs) {
      if (!doc.IsMap() || !doc["kind"]) continue;
      const std::string kind = doc["kind"].as<std::string>();
      if (kind == "Service" && doc["spec"]["ports"] && doc["spec"]["ports"].size() > 0) {
        service_ports[doc["metadata"]["name"].as<std::string>()] =
            doc["spec"]["ports"][0]["port"].as<int32_t>();
      } else if (kind == "StatefulSet") {
        absl::StatusOr<PodTemplate> pod = ParseStatefulSet(doc);
        if (!pod.ok()) return pod.status();
        sets.push_back(*std::move(pod));
      }
    }
    if (sets.size() != 1) {
      return Invalid(absl::StrCat("expected one StatefulSet, found ", sets.size()));
    }
    sets[0].service_ports = std::move(service_ports);
    return sets[0];
  } catch (const std::exception& e) {  // yaml-cpp reports by exception; nothing else here does
    return Invalid(absl::StrCat("cannot parse: ", e.what()));
  }
}

std::string ExpandK8sVars(absl::string_view input, const std::map<std::string, std::string>& vars) {
  std::string out;
  size_t i = 0;
  while (i < input.size()) {
    if (input[i] != '$' || i + 1 == input.size()) {
      out.push_back(input[i++]);
      continue;
    }
    const char next = input[i + 1];
    if (next == '$') {  // escaped operator
      out.push_back('$');
      i += 2;
    } else if (next == '(') {
      const size_t close = input.find(')', i + 2);
      if (close == absl::string_view::npos) {  // incomplete reference: kept, scanning goes on
        out.append("$(");
        i += 2;
        continue;
      }
      const std::string name(input.substr(i + 2, close - i - 2));
      auto it = vars.find(name);
      out.append(it != vars.end() ? it->second : absl::StrCat("$(", name, ")"));
      i = close + 1;
    } else {  // "$" before anything else: both kept
      out.push_back('$');
      out.push_back(next);
      i += 2;
    }
  }
  return out;
}

absl::StatusOr<ExpandedContainer> Expand(const PodTemplate& pod, const PodIdentity& identity) {
  ExpandedContainer out;
  for (const EnvVar& var : pod.env) {
    std::string value;
    if (var.field_path.empty()) {
      value = ExpandK8sVars(var.value, out.env);  // earlier entries only, as the kubelet does
    } else if (var.field_path == "metadata.name") {
      value = identity.name;
    } else if (var.field_path == "metadata.namespace") {
      value = identity.namespace_;
    } else if (var.field_path == "status.podIP") {
      value = identity.ip;
    } else {
      return Invalid(absl::StrCat("env ", var.name, ": fieldPath ", var.field_path,
                                  " is not emulated (metadata.name, metadata.namespace, "
                                  "status.podIP are)"));
    }
    if (out.env.count(var.name) == 0) out.env_order.push_back(var.name);
    out.env[var.name] = std::move(value);
  }
  for (const std::string& s : pod.command) out.argv.push_back(ExpandK8sVars(s, out.env));
  for (const std::string& s : pod.args) out.argv.push_back(ExpandK8sVars(s, out.env));
  return out;
}

absl::StatusOr<std::string> ExpandCsiVars(absl::string_view input, const PodIdentity& identity) {
  const std::map<std::string, std::string> vars = {{"POD_NAME", identity.name},
                                                   {"POD_NAMESPACE", identity.namespace_}};
  std::string out;
  size_t i = 0;
  while (i < input.size()) {
    if (input[i] != '$' || i + 1 == input.size()) {  // a trailing "$" stays, as in os.Expand
      out.push_back(input[i++]);
      continue;
    }
    std::string name;
    if (input[i + 1] == '{') {
      const size_t close = input.find('}', i + 2);
      if (close == absl::string_view::npos) {
        return Invalid(absl::StrCat("csi attribute \"", input, "\": unterminated ${"));
      }
      name = std::string(input.substr(i + 2, close - i - 2));
      i = close + 1;
    } else {
      size_t end = i + 1;
      while (end < input.size() && (absl::ascii_isalnum(input[end]) || input[end] == '_')) ++end;
      if (end == i + 1) {
        return Invalid(
            absl::StrCat("csi attribute \"", input, "\": \"$\" before neither a name nor {"));
      }
      name = std::string(input.substr(i + 1, end - i - 1));
      i = end;
    }
    const auto it = vars.find(name);
    if (it == vars.end()) {
      return Invalid(absl::StrCat("csi attribute \"", input, "\": variable ", name,
                                  " is not emulated (POD_NAME and POD_NAMESPACE are)"));
    }
    out.append(it->second);
  }
  return out;
}

}  // namespace testutil
}  // namespace kvmesh

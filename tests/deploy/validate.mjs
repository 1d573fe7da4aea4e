// Offline validation of kvmesh's Kubernetes manifests (deploy/k8s), as rendered by kustomize.
//
//   node validate.mjs --flags=HELPFULL --metrics=METRICS --monitoring=MONITORING.yaml
//                     OVERLAY=RENDERED.yaml ...      check the monitoring objects and each overlay
//   node validate.mjs --flags=HELPFULL --metrics=METRICS --monitoring=MONITORING.yaml
//                     --self-test RENDERED.yaml      plant errors, expect each found
//
// HELPFULL is what `kvmesh-node --helpfull` printed; METRICS is deploy/k8s/monitoring/metrics.txt,
// the node's metrics; MONITORING.yaml is deploy/k8s/monitoring rendered. Exit status 0 when
// everything passed, 1 when a check failed (each problem is printed), 2 on a usage error.
//
// Five checks, every object of every overlay and of the monitoring kustomization:
//  1. Schema, at run time: kubernetes-models' validators, compiled (ajv) from the Kubernetes
//     OpenAPI spec: types, required fields, enums and formats (int32, ...). They do not reject
//     unknown fields (the OpenAPI spec does not say additionalProperties: false).
//  2. Schema, unknown fields: each object is type-checked by the TypeScript compiler as an
//     object literal of kubernetes-models' interface for its kind (generated from the same
//     spec). TypeScript rejects a property the interface does not have at every depth of a
//     literal (excess property checks), and wrong types too: the strict check kubeconform
//     -strict makes.
//  3. The cluster: what a Kubernetes 1.33 API server, its controllers and the kubelet would
//     refuse, or accept and get wrong: an apiVersion it no longer serves (kubernetes-models
//     keeps removed versions), a workload selector that does not match its template's labels,
//     a mount of a volume the pod lacks, a Secret, ConfigMap, ServiceAccount or cert-manager
//     Issuer that is neither rendered nor on the list of those the operator creates out of
//     band, requests above limits, runAsUser 0 beside runAsNonRoot, an image without a fixed
//     tag (or latest), an egress policy without DNS.
//  4. kvmesh: every flag in the container's args is one kvmesh-node accepts; the ports of
//     --listen, --peer-listen and --health-listen agree with the containerPorts, the Services,
//     the probes and the NetworkPolicy (and an egress policy lets members reach each other);
//     the probes ask the health services kvmesh-node serves; the grace period outlasts the
//     drain; memory covers the budgets; --metrics-port agrees with the containerPort metrics,
//     the NetworkPolicy (Prometheus only, no entry that admits a whole namespace), any Service
//     port named metrics and the PodMonitor (or ServiceMonitor) that scrapes the pods; each
//     pod's TLS key comes from a per-pod cert-manager csi-driver volume (never a Secret, which
//     every pod would mount) whose certificate names the pod; pod anti-affinity and a
//     topology spread constraint select the pods.
//  5. Monitoring: the PodMonitor, the PrometheusRule and the Grafana dashboard (in its
//     ConfigMap). Schemas as in 1 and 2, with @kubernetes-models/prometheus-operator. Every
//     PromQL expression (alerts, panels, variable queries) parses (Prometheus' own grammar,
//     @prometheus-io/lezer-promql) and names only metrics of METRICS (a histogram's _bucket,
//     _sum and _count) and `up`, with their labels and the target's; rate() and increase()
//     only of counters, histogram_quantile() only of buckets aggregated by le; legends and
//     alert annotations use labels the query has; job matches the PodMonitor's job. The
//     dashboard parses, is of a current Grafana, takes its Prometheus from a ${datasource}
//     variable in every panel and query, and has a node variable. Every alert has a for:, a
//     severity, a summary and a description.
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";
import YAML from "yaml";
import ts from "typescript";
import { parser as promqlParser } from "@prometheus-io/lezer-promql";

const here = path.dirname(fileURLToPath(import.meta.url));

// ---------------------------------------------------------------------------------------------
// 1 and 2: the schemas.

// kubernetes-models' module for an apiVersion: "v1" -> kubernetes-models/v1,
// "apps/v1" -> kubernetes-models/apps/v1; prometheus-operator's (monitoring.coreos.com/v1) come
// from @kubernetes-models/prometheus-operator (generated from the operator's v0.65.1 CRDs).
function modelModule(apiVersion) {
  if (typeof apiVersion !== "string" || !/^([a-z0-9.-]+\/)?v[0-9a-z]+$/.test(apiVersion)) {
    return null;
  }
  if (apiVersion.startsWith("monitoring.coreos.com/")) {
    return `@kubernetes-models/prometheus-operator/${apiVersion}`;
  }
  return `kubernetes-models/${apiVersion}`;
}

function describe(obj) {
  const m = obj && obj.metadata ? obj.metadata : {};
  return `${obj && obj.kind}/${m.name}`;
}

async function runtimeSchemaProblems(objects) {
  const problems = [];
  for (const obj of objects) {
    const mod = modelModule(obj.apiVersion);
    let Model = null;
    if (mod) {
      try {
        Model = (await import(mod))[obj.kind];
      } catch {
        Model = null;
      }
    }
    if (typeof Model !== "function") {
      problems.push(`${describe(obj)}: no schema for apiVersion ${obj.apiVersion} kind ${obj.kind}`);
      continue;
    }
    try {
      new Model(JSON.parse(JSON.stringify(obj))).validate();
    } catch (e) {
      const errors = Array.isArray(e.errors) ? e.errors : null;
      if (errors) {
        for (const err of errors) {
          problems.push(`${describe(obj)}: schema: ${err.instancePath || "/"} ${err.message}` +
                        (err.params && err.params.allowedValues
                             ? ` (${err.params.allowedValues.join(", ")})` : ""));
        }
      } else {
        problems.push(`${describe(obj)}: schema: ${e.message}`);
      }
    }
  }
  return problems;
}

// Type-checks several sets of objects in one compiler run (the compiler's start-up is most of
// the time); returns each set's problems.
function typeScriptProblems(objectSets) {
  // One in-memory file beside this script (so that node_modules resolves), one typed constant
  // per object.
  const file = path.join(here, "__manifests__.ts");
  const lines = [];
  const ranges = [];  // [first line, last line, set, object]
  objectSets.forEach((objects, set) => objects.forEach((obj, i) => {
    const mod = modelModule(obj.apiVersion);
    if (!mod) return;  // reported by the runtime check
    const body = JSON.stringify(obj, null, 2).split("\n");
    const first = lines.length;
    lines.push(`export const o${set}_${i}: import(${JSON.stringify(mod)}).I${obj.kind} = ${body[0]}`);
    lines.push(...body.slice(1));
    lines[lines.length - 1] += ";";
    ranges.push([first, lines.length - 1, set, obj]);
  }));
  const source = lines.join("\n") + "\n";
  const options = {
    strict: true, noEmit: true, skipLibCheck: true, types: [],
    target: ts.ScriptTarget.ES2020, module: ts.ModuleKind.ESNext,
    moduleResolution: ts.ModuleResolutionKind.Bundler,
  };
  const host = ts.createCompilerHost(options);
  const getSourceFile = host.getSourceFile.bind(host);
  host.getSourceFile = (name, version, ...rest) =>
      path.resolve(name) === file ? ts.createSourceFile(name, source, version)
                                  : getSourceFile(name, version, ...rest);
  const fileExists = host.fileExists.bind(host);
  host.fileExists = (name) => path.resolve(name) === file || fileExists(name);
  const program = ts.createProgram([file], options, host);
  const problems = objectSets.map(() => []);
  for (const d of ts.getPreEmitDiagnostics(program)) {
    const text = ts.flattenDiagnosticMessageText(d.messageText, "\n  ");
    if (!d.file || path.resolve(d.file.fileName) !== file) {
      problems.forEach((p) => p.push(`typescript: ${text}`));
      continue;
    }
    const { line } = d.file.getLineAndCharacterOfPosition(d.start);
    const range = ranges.find(([a, b]) => line >= a && line <= b);
    const message = `schema (unknown field or wrong type): near \`${lines[line].trim()}\`: ` +
                    text.split("\n")[0];
    if (range) problems[range[2]].push(`${describe(range[3])}: ${message}`);
    else problems.forEach((p) => p.push(`?: ${message}`));
  }
  return problems;
}

// ---------------------------------------------------------------------------------------------
// 3: what the cluster itself would refuse, which the schemas do not say: an apiVersion its API
// server no longer serves, a selector that does not match its template, a mount of a volume the
// pod lacks, a Secret or ConfigMap that nobody creates, requests above limits (the API server
// refuses these), a root user beside runAsNonRoot (the kubelet refuses to start it), and what a
// controller would accept but that does not work as meant: a floating image tag, an egress
// policy that blocks DNS.

// The Kubernetes release the manifests are written for and checked against
// (deploy/k8s/README.md, "Validation").
const kubernetesRelease = "1.33";

// The built-in group versions a Kubernetes 1.33 API server serves by default. kubernetes-models
// keeps every version it ever generated a model for (extensions/v1beta1, policy/v1beta1, ...),
// so its schemas alone accept an apiVersion the cluster refuses. Beta APIs introduced since 1.24
// are off by default, and no manifest here uses one.
const servedGroupVersions = new Set([
  "v1", "admissionregistration.k8s.io/v1", "apiextensions.k8s.io/v1", "apiregistration.k8s.io/v1",
  "apps/v1", "authentication.k8s.io/v1", "authorization.k8s.io/v1", "autoscaling/v1",
  "autoscaling/v2", "batch/v1", "certificates.k8s.io/v1", "coordination.k8s.io/v1",
  "discovery.k8s.io/v1", "events.k8s.io/v1", "flowcontrol.apiserver.k8s.io/v1",
  "networking.k8s.io/v1", "node.k8s.io/v1", "policy/v1", "rbac.authorization.k8s.io/v1",
  "scheduling.k8s.io/v1", "storage.k8s.io/v1",
]);

// Group versions Kubernetes once served: the release that stopped serving them, and where their
// kinds went (Kubernetes' deprecated API migration guide).
const removedGroupVersions = new Map([
  ["extensions/v1beta1", "removed in 1.16 (NetworkPolicy: networking.k8s.io/v1; Deployment, " +
                         "DaemonSet, ReplicaSet: apps/v1) and 1.22 (Ingress: networking.k8s.io/v1)"],
  ["apps/v1beta1", "removed in 1.16; use apps/v1"],
  ["apps/v1beta2", "removed in 1.16; use apps/v1"],
  ["policy/v1beta1", "removed in 1.25; use policy/v1 (PodSecurityPolicy: no replacement)"],
  ["batch/v1beta1", "removed in 1.25; use batch/v1"],
  ["autoscaling/v2beta1", "removed in 1.25; use autoscaling/v2"],
  ["autoscaling/v2beta2", "removed in 1.26; use autoscaling/v2"],
  ["discovery.k8s.io/v1beta1", "removed in 1.25; use discovery.k8s.io/v1"],
  ["events.k8s.io/v1beta1", "removed in 1.25; use events.k8s.io/v1"],
  ["node.k8s.io/v1beta1", "removed in 1.25; use node.k8s.io/v1"],
  ["networking.k8s.io/v1beta1", "removed in 1.22; use networking.k8s.io/v1"],
  ["rbac.authorization.k8s.io/v1beta1", "removed in 1.22; use rbac.authorization.k8s.io/v1"],
  ["scheduling.k8s.io/v1beta1", "removed in 1.22; use scheduling.k8s.io/v1"],
  ["storage.k8s.io/v1beta1", "removed in 1.22 (CSIStorageCapacity in 1.27); use storage.k8s.io/v1"],
  ["flowcontrol.apiserver.k8s.io/v1beta1", "removed in 1.26; use flowcontrol.apiserver.k8s.io/v1"],
  ["flowcontrol.apiserver.k8s.io/v1beta2", "removed in 1.29; use flowcontrol.apiserver.k8s.io/v1"],
  ["flowcontrol.apiserver.k8s.io/v1beta3", "removed in 1.32; use flowcontrol.apiserver.k8s.io/v1"],
]);

// Built-in groups: the core group, the unqualified ones (apps, batch, policy, ...) and *.k8s.io.
// Others (monitoring.coreos.com, cert-manager.io) are custom resources, checked by their own
// schemas.
function isBuiltInGroup(group) {
  return group === "" || !group.includes(".") || group.endsWith(".k8s.io");
}

// What the pods refer to that the rendered manifests do not hold: the operator creates these
// before applying (deploy/k8s/README.md, "Before applying"). Any other Secret, ConfigMap,
// ServiceAccount or cert-manager issuer a pod names must be among the rendered objects.
const outOfBand = new Map([
  ["Secret", new Set(["kvmesh-tokens"])],
  ["ConfigMap", new Set()],
  ["ServiceAccount", new Set(["default"])],  // every namespace has it
  ["Issuer", new Set(["kvmesh-ca"])],
  ["ClusterIssuer", new Set()],
]);

// A label selector (matchLabels and matchExpressions) against a set of labels. `undefined` and
// null select nothing, as in a pod (anti-)affinity term or a spread constraint.
function matchesSelector(selector, labels) {
  if (!selector) return false;
  const byLabels = Object.entries(selector.matchLabels ?? {}).every(([k, v]) => labels[k] === v);
  const byExpressions = (selector.matchExpressions ?? []).every((e) => {
    const has = Object.prototype.hasOwnProperty.call(labels, e.key);
    switch (e.operator) {
      case "In": return has && (e.values ?? []).includes(labels[e.key]);
      case "NotIn": return !has || !(e.values ?? []).includes(labels[e.key]);
      case "Exists": return has;
      case "DoesNotExist": return !has;
      default: return false;
    }
  });
  return byLabels && byExpressions;
}

const isEmptySelector = (s) => !s || (Object.keys(s.matchLabels ?? {}).length === 0 &&
                                      (s.matchExpressions ?? []).length === 0);
const showLabels = (labels) =>
    `{${Object.entries(labels ?? {}).map(([k, v]) => `${k}=${v}`).join(", ")}}`;
const showSelector = (s) => JSON.stringify(s ?? null);

// Kubernetes quantities as numbers: "2", "500m", "1.5Gi", "1e3".
function quantity(q) {
  const m = /^([+-]?[0-9.]+)(?:([eE][+-]?[0-9]+)|(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei))?$/.exec(String(q ?? ""));
  if (!m) return null;
  const unit = { m: 1e-3, k: 1e3, M: 1e6, G: 1e9, T: 1e12, P: 1e15, E: 1e18, Ki: 2 ** 10,
                 Mi: 2 ** 20, Gi: 2 ** 30, Ti: 2 ** 40, Pi: 2 ** 50, Ei: 2 ** 60 }[m[3]] ?? 1;
  return Number(m[1]) * (m[2] ? 10 ** Number(m[2].slice(1)) : 1) * unit;
}

// The pod templates of the workloads among `objects`: {owner, spec, labels, selector, kind}.
function podTemplates(objects) {
  const out = [];
  for (const o of objects) {
    if (["StatefulSet", "Deployment", "DaemonSet", "ReplicaSet", "Job"].includes(o.kind)) {
      out.push({ owner: describe(o), spec: o.spec?.template?.spec ?? {}, selector: o.spec?.selector,
                 labels: o.spec?.template?.metadata?.labels ?? {}, kind: o.kind });
    } else if (o.kind === "CronJob") {
      const t = o.spec?.jobTemplate?.spec?.template;
      out.push({ owner: describe(o), spec: t?.spec ?? {}, labels: t?.metadata?.labels ?? {},
                 selector: o.spec?.jobTemplate?.spec?.selector, kind: o.kind });
    } else if (o.kind === "Pod") {
      out.push({ owner: describe(o), spec: o.spec ?? {}, labels: o.metadata?.labels ?? {}, kind: o.kind });
    }
  }
  return out;
}

const allContainers = (spec) => [...(spec.initContainers ?? []), ...(spec.containers ?? []),
                                 ...(spec.ephemeralContainers ?? [])];

// NetworkPolicies that restrict egress of pods with `labels` (policyTypes names Egress, or,
// without policyTypes, the policy has egress rules), and the egress rules they allow together.
function egressPolicies(objects, labels) {
  const policies = objects.filter((o) => {
    if (o.kind !== "NetworkPolicy") return false;
    const sel = o.spec?.podSelector ?? {};
    if (!(isEmptySelector(sel) || matchesSelector(sel, labels))) return false;
    const types = o.spec?.policyTypes;
    return types ? types.includes("Egress") : o.spec?.egress !== undefined;
  });
  return { policies, rules: policies.flatMap((p) => p.spec?.egress ?? []) };
}

// Whether an egress (or ingress) rule's ports admit `port`/`protocol` (no ports: every port;
// a port without protocol is TCP; endPort makes a range).
function rulePortsAdmit(rule, port, protocol, resolve = (p) => p) {
  if (!rule.ports || rule.ports.length === 0) return true;
  return rule.ports.some((p) => {
    if ((p.protocol ?? "TCP") !== protocol) return false;
    if (p.port === undefined) return true;
    const from = resolve(p.port);
    return from === port || (p.endPort !== undefined && from <= port && port <= p.endPort);
  });
}

function clusterProblems(objects) {
  const problems = [];
  const bad = (obj, msg) => problems.push(`${typeof obj === "string" ? obj : describe(obj)}: ${msg}`);

  // Served API versions.
  for (const o of objects) {
    const apiVersion = String(o.apiVersion ?? "");
    const group = apiVersion.includes("/") ? apiVersion.slice(0, apiVersion.lastIndexOf("/")) : "";
    if (!isBuiltInGroup(group) || servedGroupVersions.has(apiVersion)) continue;
    const removed = removedGroupVersions.get(apiVersion);
    bad(o, `apiVersion ${apiVersion} is not served by Kubernetes ${kubernetesRelease}` +
           (removed ? ` (${removed})` : " (not a group version it serves by default)"));
  }

  const exists = (kind, name) => outOfBand.get(kind)?.has(name) ||
      objects.some((o) => o.kind === kind && o.metadata?.name === name);
  const needs = (owner, kind, name, where) => {
    if (name === undefined || exists(kind, name)) return;
    bad(owner, `${where} refers to ${kind} ${name}, which is neither among the rendered objects nor ` +
               `one of those created out of band (${[...(outOfBand.get(kind) ?? [])].join(", ") || "none"}; ` +
               "deploy/k8s/README.md)");
  };

  for (const t of podTemplates(objects)) {
    const { owner, spec, labels } = t;
    // The controller's selector must select its own template's pods: the API server refuses a
    // workload whose selector does not match the template's labels.
    if (t.kind !== "Pod" && t.kind !== "CronJob" && !(t.kind === "Job" && !t.selector)) {
      if (isEmptySelector(t.selector)) {
        bad(owner, "spec.selector is empty: the API server requires one that matches the template's labels");
      } else if (!matchesSelector(t.selector, labels)) {
        bad(owner, `spec.selector ${showSelector(t.selector)} does not match the template's labels ` +
                   `${showLabels(labels)}: the API server refuses it`);
      }
    }

    // Volumes: unique names; every mount names one; Secrets and ConfigMaps that exist.
    const volumeNames = new Set();
    for (const v of spec.volumes ?? []) {
      if (volumeNames.has(v.name)) bad(owner, `volume ${v.name} is defined twice`);
      volumeNames.add(v.name);
      const where = `volume ${v.name}`;
      if (v.secret && !v.secret.optional) needs(owner, "Secret", v.secret.secretName, where);
      if (v.configMap && !v.configMap.optional) needs(owner, "ConfigMap", v.configMap.name, where);
      for (const s of v.projected?.sources ?? []) {
        if (s.secret && !s.secret.optional) needs(owner, "Secret", s.secret.name, where);
        if (s.configMap && !s.configMap.optional) needs(owner, "ConfigMap", s.configMap.name, where);
      }
      if (v.csi?.nodePublishSecretRef) needs(owner, "Secret", v.csi.nodePublishSecretRef.name, where);
      if (v.csi?.driver === "csi.cert-manager.io") {
        const attrs = v.csi.volumeAttributes ?? {};
        const kind = attrs["csi.cert-manager.io/issuer-kind"] ?? "Issuer";
        if (!attrs["csi.cert-manager.io/issuer-name"]) {
          bad(owner, `${where}: csi.cert-manager.io needs csi.cert-manager.io/issuer-name`);
        } else {
          needs(owner, kind, attrs["csi.cert-manager.io/issuer-name"], where);
        }
      }
    }
    for (const s of spec.imagePullSecrets ?? []) needs(owner, "Secret", s.name, "imagePullSecrets");
    if (spec.serviceAccountName) needs(owner, "ServiceAccount", spec.serviceAccountName, "serviceAccountName");

    const psc = spec.securityContext ?? {};
    for (const c of allContainers(spec)) {
      const who = `container ${c.name}`;
      const paths = new Set();
      for (const m of c.volumeMounts ?? []) {
        if (!volumeNames.has(m.name)) {
          bad(owner, `${who} mounts volume ${m.name} at ${m.mountPath}, which the pod does not define`);
        }
        if (paths.has(m.mountPath)) bad(owner, `${who} mounts two volumes at ${m.mountPath}`);
        paths.add(m.mountPath);
      }
      for (const e of c.env ?? []) {
        const ref = e.valueFrom ?? {};
        if (ref.secretKeyRef && !ref.secretKeyRef.optional) needs(owner, "Secret", ref.secretKeyRef.name, `${who} env ${e.name}`);
        if (ref.configMapKeyRef && !ref.configMapKeyRef.optional) needs(owner, "ConfigMap", ref.configMapKeyRef.name, `${who} env ${e.name}`);
      }
      for (const e of c.envFrom ?? []) {
        if (e.secretRef && !e.secretRef.optional) needs(owner, "Secret", e.secretRef.name, `${who} envFrom`);
        if (e.configMapRef && !e.configMapRef.optional) needs(owner, "ConfigMap", e.configMapRef.name, `${who} envFrom`);
      }

      // Requests above limits: the API server refuses the pod ("must be less than or equal to
      // ... limit"). A request alone is fine; a limit alone sets the request.
      const requests = c.resources?.requests ?? {};
      const limits = c.resources?.limits ?? {};
      for (const [resource, request] of Object.entries(requests)) {
        if (limits[resource] === undefined) continue;
        const r = quantity(request);
        const l = quantity(limits[resource]);
        if (r === null || l === null) {
          bad(owner, `${who}: ${resource} ${request} / ${limits[resource]} is not a quantity`);
        } else if (r > l) {
          bad(owner, `${who}: requests.${resource} ${request} is above limits.${resource} ` +
                     `${limits[resource]}: the API server refuses it`);
        }
      }

      // The image: a fixed tag or a digest. No tag is :latest, which moves under a running
      // StatefulSet: pods of one revision would run different builds.
      const image = String(c.image ?? "");
      const slash = image.lastIndexOf("/");
      const at = image.indexOf("@");
      const colon = image.indexOf(":", slash + 1);
      const tag = colon >= 0 ? image.slice(colon + 1, at >= 0 ? at : undefined) : "";
      if (at < 0 && (tag === "" || tag === "latest")) {
        bad(owner, `${who}: image ${image} ${tag === "" ? "has no tag (it means :latest)" : "uses the tag latest"}: ` +
                   "name a fixed version or a digest");
      }

      // runAsNonRoot with user 0: the kubelet refuses to start the container
      // (CreateContainerConfigError). The container's settings override the pod's.
      const csc = c.securityContext ?? {};
      const nonRoot = csc.runAsNonRoot ?? psc.runAsNonRoot;
      const user = csc.runAsUser ?? psc.runAsUser;
      if (nonRoot === true && user === 0) {
        bad(owner, `${who}: runAsUser 0 (root) beside runAsNonRoot: true: the kubelet refuses to start it`);
      }
    }

    // Egress: a policy that restricts it must still let the pods resolve names (UDP port 53).
    const { policies, rules } = egressPolicies(objects, labels);
    if (policies.length > 0 && !rules.some((r) => rulePortsAdmit(r, 53, "UDP"))) {
      bad(owner, `NetworkPolicy ${policies.map((p) => p.metadata?.name).join(", ")} restricts egress ` +
                 "(policyTypes: Egress) but no egress rule allows DNS (UDP port 53): the pods cannot " +
                 "resolve names");
    }
  }
  return problems;
}

// ---------------------------------------------------------------------------------------------
// 4: kvmesh-node's flags and the ports, probes, grace period and memory.

// The flag names in `--helpfull`: "    --name (help...); default: ...". Stored with underscores.
function parseHelpfull(text) {
  const flags = new Set();
  for (const m of text.matchAll(/^ {4}--([A-Za-z0-9_]+) \(/gm)) flags.add(m[1]);
  return flags;
}

const normalise = (name) => name.replace(/-/g, "_");

function portOf(address) {
  const m = /:([0-9]+)$/.exec(address || "");
  return m ? Number(m[1]) : null;
}

// Byte sizes as kvmesh-node takes them (512MiB, 8GiB, plain bytes).
function flagBytes(value) {
  const m = /^([0-9]+)(B|KiB|MiB|GiB|TiB)?$/.exec(value || "");
  if (!m) return null;
  const unit = { B: 1, KiB: 2 ** 10, MiB: 2 ** 20, GiB: 2 ** 30, TiB: 2 ** 40 }[m[2] || "B"];
  return Number(m[1]) * unit;
}

// Kubernetes quantities (binary and decimal suffixes).
function quantityBytes(q) {
  const m = /^([0-9.]+)(Ki|Mi|Gi|Ti|k|M|G|T)?$/.exec(String(q ?? ""));
  if (!m) return null;
  const unit = { Ki: 2 ** 10, Mi: 2 ** 20, Gi: 2 ** 30, Ti: 2 ** 40, k: 1e3, M: 1e6, G: 1e9,
                 T: 1e12 }[m[2]] ?? 1;
  return Number(m[1]) * unit;
}

function selects(selector, labels) {
  return !!selector && Object.keys(selector).length > 0 &&
         Object.entries(selector).every(([k, v]) => labels[k] === v);
}

// `monitoring`: objects of the monitoring kustomization, beside the overlay's own.
function kvmeshProblems(objects, flags, monitoring = []) {
  const problems = [];
  const bad = (msg) => problems.push(`kvmesh: ${msg}`);
  const sets = objects.filter((o) => o.kind === "StatefulSet");
  if (sets.length !== 1) {
    bad(`expected one StatefulSet, found ${sets.length}`);
    return problems;
  }
  const sts = sets[0];
  const pod = sts.spec?.template?.spec ?? {};
  const podLabels = sts.spec?.template?.metadata?.labels ?? {};
  const container = (pod.containers ?? []).find((c) => c.name === "kvmesh-node");
  if (!container) {
    bad("the StatefulSet has no container kvmesh-node");
    return problems;
  }
  if ((container.command ?? [])[0] !== "/usr/local/bin/kvmesh-node") {
    bad(`the container's command is ${JSON.stringify(container.command)}, not /usr/local/bin/kvmesh-node`);
  }

  // Every arg is --name=value with a flag kvmesh-node has, each given once.
  const args = new Map();
  for (const arg of container.args ?? []) {
    const m = /^--([A-Za-z0-9_-]+)=(.*)$/.exec(arg);
    if (!m) {
      bad(`arg ${JSON.stringify(arg)} is not --flag=value`);
      continue;
    }
    const name = normalise(m[1]);
    if (!flags.has(name)) bad(`--${m[1]} is not a flag of kvmesh-node (see kvmesh-node --helpfull)`);
    if (args.has(name)) bad(`--${m[1]} is given twice`);
    args.set(name, m[2]);
  }
  const arg = (name) => args.get(name);
  for (const required of ["node_name", "listen", "peer_listen", "health_listen", "peer_dns",
                          "backend", "memory_budget", "snapshot_budget", "drain_timeout_ms",
                          "token_file", "tls_cert", "tls_key", "peer_ca", "metrics_port"]) {
    if (!args.has(required)) bad(`the args lack --${required.replace(/_/g, "-")}`);
  }

  // $(VAR) in args must be env vars of the container; the downward API ones must be right.
  const env = new Map((container.env ?? []).map((e) => [e.name, e]));
  for (const value of args.values()) {
    for (const m of value.matchAll(/\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g)) {
      if (!env.has(m[1])) bad(`the args use $(${m[1]}), which the container's env does not define`);
    }
  }
  for (const [name, fieldPath] of [["POD_NAME", "metadata.name"], ["POD_IP", "status.podIP"],
                                   ["POD_NAMESPACE", "metadata.namespace"]]) {
    const got = env.get(name)?.valueFrom?.fieldRef?.fieldPath;
    if (env.has(name) && got !== fieldPath) bad(`env ${name} comes from ${got}, not ${fieldPath}`);
  }
  if (arg("node_name") !== "$(POD_NAME)") bad("--node-name must be $(POD_NAME): peers name members by pod name");

  // Ports: each address flag, its containerPort, the Services, the probes, the NetworkPolicy.
  const containerPorts = new Map((container.ports ?? []).map((p) => [p.name, p.containerPort]));
  const resolve = (target) => (typeof target === "number" ? target : containerPorts.get(target));
  const planes = [
    { flag: "listen", portName: "grpc", service: "kvmesh" },
    { flag: "peer_listen", portName: "peer", service: "kvmesh-peers" },
    { flag: "health_listen", portName: "health", service: null },
  ];
  const services = new Map(objects.filter((o) => o.kind === "Service").map((s) => [s.metadata.name, s]));
  for (const plane of planes) {
    const port = portOf(arg(plane.flag));
    const flagName = `--${plane.flag.replace(/_/g, "-")}`;
    if (port === null) {
      bad(`${flagName}=${arg(plane.flag)} has no port`);
      continue;
    }
    plane.port = port;
    if (containerPorts.get(plane.portName) !== port) {
      bad(`${flagName} listens on ${port} but containerPort ${plane.portName} is ` +
          `${containerPorts.get(plane.portName)}`);
    }
    if (plane.service) {
      const svc = services.get(plane.service);
      if (!svc) {
        bad(`no Service ${plane.service}`);
        continue;
      }
      if (!selects(svc.spec?.selector, podLabels)) bad(`Service ${plane.service} does not select the pods`);
      const targets = (svc.spec?.ports ?? []).map((p) => resolve(p.targetPort ?? p.port));
      if (!targets.includes(port)) {
        bad(`Service ${plane.service} targets ports ${JSON.stringify(targets)}, not ${flagName}'s ${port}`);
      }
    }
  }
  const [client, peer, health] = planes;

  // The headless Service: discovery (--peer-dns) and the pods' DNS names.
  const peers = services.get("kvmesh-peers");
  if (peers) {
    if (peers.spec?.clusterIP !== "None") bad("Service kvmesh-peers must be headless (clusterIP: None)");
    if (peers.spec?.publishNotReadyAddresses !== true) {
      bad("Service kvmesh-peers needs publishNotReadyAddresses: true (draining and starting pods stay members)");
    }
  }
  if (sts.spec?.serviceName !== "kvmesh-peers") bad("the StatefulSet's serviceName must be kvmesh-peers");
  const dns = arg("peer_dns") ?? "";
  if (!dns.startsWith("kvmesh-peers.$(POD_NAMESPACE).svc.")) {
    bad(`--peer-dns=${dns} does not name the headless Service kvmesh-peers in the pod's namespace`);
  }
  if (peer.port !== undefined && portOf(dns) !== peer.port) {
    bad(`--peer-dns port ${portOf(dns)} is not --peer-listen's ${peer.port}`);
  }

  // Probes: the plaintext health port; "" for startup and liveness, CacheService for readiness.
  for (const [probe, service] of [["startupProbe", ""], ["livenessProbe", ""],
                                  ["readinessProbe", "kvmesh.v1.CacheService"]]) {
    const grpc = container[probe]?.grpc;
    if (!grpc) {
      bad(`${probe} is not a gRPC probe`);
      continue;
    }
    if (grpc.port !== health.port) bad(`${probe} probes port ${grpc.port}, not --health-listen's ${health.port}`);
    if ((grpc.service ?? "") !== service) {
      bad(`${probe} asks for service ${JSON.stringify(grpc.service ?? "")}, expected ${JSON.stringify(service)}`);
    }
  }

  // NetworkPolicy: the peer port from kvmesh pods only; the client and health ports allowed.
  const policies = objects.filter((o) => o.kind === "NetworkPolicy" &&
                                         selects(o.spec?.podSelector?.matchLabels, podLabels));
  if (policies.length === 0) bad("no NetworkPolicy selects the kvmesh pods");
  const rules = policies.flatMap((p) => p.spec?.ingress ?? []);
  const rulesFor = (port) => rules.filter((r) => (r.ports ?? []).some((p) => resolve(p.port) === port));
  for (const plane of planes) {
    if (plane.port !== undefined && rulesFor(plane.port).length === 0) {
      bad(`the NetworkPolicy admits nothing to port ${plane.port} (--${plane.flag.replace(/_/g, "-")})`);
    }
  }
  for (const rule of rulesFor(peer.port)) {
    const from = rule.from ?? [];
    if (from.length === 0 || !from.every((f) => !f.namespaceSelector && !f.ipBlock &&
                                               selects(f.podSelector?.matchLabels, podLabels))) {
      bad(`a NetworkPolicy rule admits more than the kvmesh pods to the peer port ${peer.port}`);
    }
  }
  if (rules.some((r) => !r.ports || r.ports.length === 0)) {
    bad("a NetworkPolicy rule admits every port");
  }

  // Metrics: --metrics-port (plain HTTP /metrics on --listen's host), its containerPort, the
  // NetworkPolicy (Prometheus only: the labels name tenants and caches), any Service port named
  // metrics, and the monitors that scrape the pods.
  const metricsPort = /^[0-9]+$/.test(arg("metrics_port") ?? "") ? Number(arg("metrics_port")) : null;
  if (args.has("metrics_port") && !(metricsPort > 0 && metricsPort < 65536)) {
    bad(`--metrics-port=${arg("metrics_port")}: expected a port (0 turns metrics off)`);
  } else if (metricsPort !== null) {
    if (containerPorts.get("metrics") !== metricsPort) {
      bad(`--metrics-port is ${metricsPort} but containerPort metrics is ${containerPorts.get("metrics")}`);
    }
    if ([client, peer, health].some((p) => p.port === metricsPort)) {
      bad(`--metrics-port ${metricsPort} is also a gRPC port`);
    }
    const metricsRules = rulesFor(metricsPort);
    if (metricsRules.length === 0) {
      bad(`the NetworkPolicy admits nothing to port ${metricsPort} (--metrics-port)`);
    }
    for (const rule of metricsRules) {
      const from = rule.from ?? [];
      if (from.length === 0 || from.some((f) => f.ipBlock || (!f.podSelector && !f.namespaceSelector))) {
        bad(`a NetworkPolicy rule admits anyone to the metrics port ${metricsPort} (Prometheus only: ` +
            "its labels name tenants and caches)");
        continue;
      }
      // Each entry of `from` admits on its own: a namespaceSelector and a podSelector in one
      // entry admit the selected pods of the selected namespaces; split into two entries they
      // admit every pod of those namespaces, and the selected pods of this one.
      for (const f of from) {
        if (f.namespaceSelector && isEmptySelector(f.podSelector)) {
          bad(`a NetworkPolicy rule admits every pod of the namespaces ${showSelector(f.namespaceSelector)} ` +
              `to the metrics port ${metricsPort}: a namespaceSelector without a podSelector in the same ` +
              "entry (split from it, it widens the rule); Prometheus only");
        } else if (f.namespaceSelector && isEmptySelector(f.namespaceSelector)) {
          bad(`a NetworkPolicy rule admits pods of every namespace to the metrics port ${metricsPort} ` +
              "(an empty namespaceSelector); Prometheus only");
        } else if (isEmptySelector(f.podSelector)) {
          bad(`a NetworkPolicy rule admits every pod of the namespace to the metrics port ${metricsPort} ` +
              "(an empty podSelector); Prometheus only");
        }
      }
    }
    for (const svc of services.values()) {
      for (const p of svc.spec?.ports ?? []) {
        if (p.name === "metrics" && resolve(p.targetPort ?? p.port) !== metricsPort) {
          bad(`Service ${svc.metadata.name} port metrics targets ${resolve(p.targetPort ?? p.port)}, ` +
              `not --metrics-port's ${metricsPort}`);
        }
      }
    }
    const namespace = sts.metadata?.namespace;
    const inNamespace = (monitor) => {
      const sel = monitor.spec?.namespaceSelector;
      if (sel?.any) return true;
      if (sel?.matchNames) return namespace === undefined || sel.matchNames.includes(namespace);
      return (monitor.metadata?.namespace ?? namespace) === namespace;
    };
    const allObjects = [...objects, ...monitoring];
    const monitors = allObjects.filter((o) => o.kind === "PodMonitor" || o.kind === "ServiceMonitor");
    let scraped = false;
    for (const monitor of monitors) {
      const what = `${monitor.kind} ${monitor.metadata?.name}`;
      if (monitor.kind === "PodMonitor") {
        if (!selects(monitor.spec?.selector?.matchLabels, podLabels)) continue;
        if (!inNamespace(monitor)) {
          bad(`${what} is in namespace ${monitor.metadata?.namespace}, not the pods' ${namespace} ` +
              "(and its namespaceSelector does not name it)");
          continue;
        }
        for (const ep of monitor.spec?.podMetricsEndpoints ?? []) {
          const port = ep.port !== undefined ? containerPorts.get(ep.port) : resolve(ep.targetPort);
          if (port !== metricsPort) {
            bad(`${what} scrapes port ${JSON.stringify(ep.port ?? ep.targetPort)} (${port}), not ` +
                `--metrics-port's ${metricsPort}`);
          }
          if ((ep.path ?? "/metrics") !== "/metrics") bad(`${what} scrapes ${ep.path}, not /metrics`);
          if ((ep.scheme ?? "http") !== "http") bad(`${what} scrapes over ${ep.scheme}: /metrics is plain HTTP`);
          scraped = true;
        }
      } else {
        // A ServiceMonitor scrapes the Services it selects, by Service port name.
        for (const svc of services.values()) {
          if (!selects(monitor.spec?.selector?.matchLabels, svc.metadata?.labels ?? {}) ||
              !selects(svc.spec?.selector, podLabels)) continue;
          if (!inNamespace(monitor)) {
            bad(`${what} is in namespace ${monitor.metadata?.namespace}, not the pods' ${namespace}`);
            continue;
          }
          for (const ep of monitor.spec?.endpoints ?? []) {
            const svcPort = (svc.spec?.ports ?? []).find((p) => p.name === ep.port);
            if (!svcPort) continue;  // another Service it selects may have it
            const port = resolve(svcPort.targetPort ?? svcPort.port);
            if (port !== metricsPort) {
              bad(`${what} scrapes Service ${svc.metadata.name} port ${ep.port} (${port}), not ` +
                  `--metrics-port's ${metricsPort}`);
            }
            if ((ep.path ?? "/metrics") !== "/metrics") bad(`${what} scrapes ${ep.path}, not /metrics`);
            scraped = true;
          }
        }
      }
    }
    if (monitoring.length > 0 && !scraped) {
      bad("no PodMonitor or ServiceMonitor of deploy/k8s/monitoring scrapes the kvmesh pods");
    }
  }

  // Drain: the kubelet's SIGKILL must come after the drain and the 5 s shutdown grace.
  const drainMs = Number(arg("drain_timeout_ms") ?? 60000);
  const grace = pod.terminationGracePeriodSeconds ?? 30;
  if (!(grace >= drainMs / 1000 + 5 + 10)) {
    bad(`terminationGracePeriodSeconds ${grace} must exceed --drain-timeout-ms (${drainMs / 1000} s) ` +
        "+ 5 s of shutdown grace + 10 s of margin");
  }

  // Files: under read-only whole-directory mounts (a subPath mount never sees an update).
  const mounts = container.volumeMounts ?? [];
  const volumes = new Map((pod.volumes ?? []).map((v) => [v.name, v]));
  const mountOf = (file) => mounts.filter((m) => file.startsWith(m.mountPath.replace(/\/?$/, "/")))
                                  .sort((a, b) => b.mountPath.length - a.mountPath.length)[0];
  const fileVolume = new Map();  // flag -> the volume its file is in
  for (const flag of ["token_file", "tls_cert", "tls_key", "peer_ca"]) {
    const file = arg(flag);
    if (file === undefined) continue;
    const mount = mountOf(file);
    const volume = mount && volumes.get(mount.name);
    const flagName = `--${flag.replace(/_/g, "-")}=${file}`;
    if (!mount || !mount.readOnly || mount.subPath || mount.subPathExpr || !volume) {
      bad(`${flagName} is not under a read-only volume mount of the whole volume (no subPath)`);
      continue;
    }
    fileVolume.set(flag, volume);
    if (flag === "token_file" && !volume.secret) bad(`${flagName} is not under a Secret volume`);
  }

  // TLS: each pod holds its own key and no other pod's. Every pod of a StatefulSet mounts the
  // same volumes, so a key from a Secret (or a projected Secret) would be in every pod; the
  // key comes from cert-manager's csi-driver, which makes one for the pod it mounts into.
  const keyVolume = fileVolume.get("tls_key");
  if (keyVolume) {
    const sharedSecret = keyVolume.secret?.secretName ??
        (keyVolume.projected?.sources ?? []).find((s) => s.secret)?.secret?.name;
    if (sharedSecret !== undefined) {
      bad(`--tls-key=${arg("tls_key")} comes from the Secret ${sharedSecret}, which every pod of the ` +
          "StatefulSet mounts: each pod would hold every pod's private key (use the per-pod " +
          "csi.cert-manager.io volume, deploy/k8s/README.md)");
    } else if (keyVolume.csi?.driver !== "csi.cert-manager.io") {
      bad(`--tls-key=${arg("tls_key")} is in volume ${keyVolume.name}, not a csi.cert-manager.io volume ` +
          "that issues each pod its own key");
    } else {
      const attrs = keyVolume.csi.volumeAttributes ?? {};
      const attr = (key, fallback) => attrs[`csi.cert-manager.io/${key}`] ?? fallback;
      if (keyVolume.csi.readOnly !== true) bad(`volume ${keyVolume.name}: csi.cert-manager.io needs readOnly: true`);
      if (fileVolume.get("tls_cert") !== keyVolume) {
        bad(`--tls-cert=${arg("tls_cert")} is not in the key's volume ${keyVolume.name}`);
      }
      for (const [flag, key, fallback] of [["tls_key", "privatekey-file", "tls.key"],
                                           ["tls_cert", "certificate-file", "tls.crt"],
                                           ["peer_ca", "ca-file", "ca.crt"]]) {
        const file = arg(flag);
        if (file === undefined || fileVolume.get(flag) !== keyVolume) continue;
        const want = `${mountOf(file).mountPath.replace(/\/$/, "")}/${attr(key, fallback)}`;
        if (file !== want) {
          bad(`--${flag.replace(/_/g, "-")}=${file} is not the file the csi-driver writes (${want}, ` +
              `csi.cert-manager.io/${key})`);
        }
      }
      const dnsNames = String(attr("dns-names", "")).split(",").map((n) => n.trim());
      if (!dnsNames.includes("${POD_NAME}")) {
        bad(`volume ${keyVolume.name}: csi.cert-manager.io/dns-names lacks \${POD_NAME}, the member ` +
            "name the peer plane checks");
      }
      const podDns = `\${POD_NAME}.${sts.spec?.serviceName}.\${POD_NAMESPACE}.svc`;
      if (!dnsNames.includes(podDns)) {
        bad(`volume ${keyVolume.name}: csi.cert-manager.io/dns-names lacks ${podDns}, the pod's own ` +
            "DNS name that schedulers dial");
      }
      const fixedPod = new RegExp(`(^|\\.)${sts.metadata?.name}-[0-9]+(\\.|$)`);
      for (const n of dnsNames) {
        if (fixedPod.test(n)) bad(`volume ${keyVolume.name}: dns-names name a fixed pod (${n}): every pod would claim it`);
      }
      const usages = String(attr("key-usages", "")).split(",").map((u) => u.trim());
      for (const u of ["server auth", "client auth"]) {
        if (!usages.includes(u)) {
          bad(`volume ${keyVolume.name}: csi.cert-manager.io/key-usages lack "${u}" (a member is ` +
              "both server and client of its peers)");
        }
      }
      const fsGroup = pod.securityContext?.fsGroup;
      if (String(attr("fs-group", "")) !== String(fsGroup)) {
        bad(`volume ${keyVolume.name}: csi.cert-manager.io/fs-group ${attr("fs-group", "(unset)")} is not ` +
            `the pod's fsGroup ${fsGroup}: the non-root node could not read its key`);
      }
    }
  }

  // Scheduling: replicas on different machines and spread over zones, so that one machine
  // going down does not take several nodes' caches with it. Soft or hard; a term or constraint
  // whose selector does not select the pods does nothing.
  const anti = pod.affinity?.podAntiAffinity ?? {};
  const antiTerms = [...(anti.requiredDuringSchedulingIgnoredDuringExecution ?? []),
                     ...(anti.preferredDuringSchedulingIgnoredDuringExecution ?? [])
                         .map((w) => w.podAffinityTerm ?? {})];
  for (const term of antiTerms) {
    if (!matchesSelector(term.labelSelector, podLabels)) {
      bad(`a podAntiAffinity term (topologyKey ${term.topologyKey}) has labelSelector ` +
          `${showSelector(term.labelSelector)}, which selects no kvmesh pod: it keeps nothing apart`);
    }
  }
  if (!antiTerms.some((t) => t.topologyKey === "kubernetes.io/hostname" &&
                             matchesSelector(t.labelSelector, podLabels))) {
    bad("no podAntiAffinity on kubernetes.io/hostname selects the pods: replicas on one machine " +
        "lose their in-memory caches together");
  }
  const spread = pod.topologySpreadConstraints ?? [];
  for (const c of spread) {
    if (!matchesSelector(c.labelSelector, podLabels)) {
      bad(`the topologySpreadConstraint on ${c.topologyKey} has labelSelector ` +
          `${showSelector(c.labelSelector)}, which selects no kvmesh pod: it spreads nothing`);
    }
  }
  if (!spread.some((c) => matchesSelector(c.labelSelector, podLabels))) {
    bad("no topologySpreadConstraint selects the pods: nothing spreads them over zones");
  }

  // Egress, when a NetworkPolicy restricts it: members must reach each other's peer port.
  const egress = egressPolicies(objects, podLabels);
  if (egress.policies.length > 0 && peer.port !== undefined &&
      !egress.rules.some((r) => rulePortsAdmit(r, peer.port, "TCP") &&
                                (!r.to || r.to.length === 0 ||
                                 r.to.some((t) => !t.ipBlock && !t.namespaceSelector &&
                                                  matchesSelector(t.podSelector, podLabels))))) {
    bad(`NetworkPolicy ${egress.policies.map((p) => p.metadata?.name).join(", ")} restricts egress but ` +
        `no egress rule allows the peer port ${peer.port} to the kvmesh pods: members cannot reach each other`);
  }

  // Memory: the budgets that are host memory, plus the in-flight budget, fit the limit.
  const backend = arg("backend");
  const limits = container.resources?.limits ?? {};
  const requests = container.resources?.requests ?? {};
  const limit = quantityBytes(limits.memory);
  const gib = 2 ** 30;
  const inflight = flagBytes(arg("inflight_budget") ?? "1GiB");
  let hostBytes = inflight;
  if (backend === "host") {
    hostBytes += flagBytes(arg("memory_budget")) + flagBytes(arg("snapshot_budget"));
  } else if (backend === "cuda") {
    if (!(Number(limits["nvidia.com/gpu"]) >= 1)) bad("--backend=cuda without an nvidia.com/gpu limit");
  } else {
    bad(`--backend=${backend}: expected host or cuda`);
  }
  if (backend !== "cuda" && limits["nvidia.com/gpu"] !== undefined) bad(`--backend=${backend} with a GPU`);
  if (limit === null || !(limit >= hostBytes)) {
    bad(`memory limit ${limits.memory} is below the host-memory budgets (${(hostBytes / gib).toFixed(2)} GiB)`);
  }
  if (quantityBytes(requests.memory) !== limit) bad("the memory request must equal the limit");

  // Hardening.
  const psc = pod.securityContext ?? {};
  const csc = container.securityContext ?? {};
  if (!(psc.runAsNonRoot || csc.runAsNonRoot)) bad("runAsNonRoot is not set");
  if (csc.readOnlyRootFilesystem !== true) bad("readOnlyRootFilesystem is not true");
  if (csc.allowPrivilegeEscalation !== false) bad("allowPrivilegeEscalation is not false");
  if (!(csc.capabilities?.drop ?? []).includes("ALL")) bad("capabilities do not drop ALL");
  if ((psc.seccompProfile ?? csc.seccompProfile)?.type !== "RuntimeDefault") bad("seccompProfile is not RuntimeDefault");
  if (pod.automountServiceAccountToken !== false) bad("the pod mounts a service account token");
  if (!objects.some((o) => o.kind === "PodDisruptionBudget" && o.spec?.maxUnavailable === 1 &&
                           selects(o.spec?.selector?.matchLabels, podLabels))) {
    bad("no PodDisruptionBudget with maxUnavailable: 1 selects the pods");
  }
  return problems;
}

// ---------------------------------------------------------------------------------------------
// 5: monitoring: the PodMonitor, the alerts and the dashboard against the node's metrics.

// metrics.txt: "NAME TYPE LABELS HELP" a line; # comments. Returns the series a query may name:
// name -> {metric, type (counter, gauge, bucket, sum, count), labels}.
function parseMetrics(text) {
  const series = new Map();
  for (const [i, raw] of text.split("\n").entries()) {
    const line = raw.replace(/#.*/, "").trim();
    if (!line) continue;
    const m = /^([a-zA-Z_:][a-zA-Z0-9_:]*)\s+(counter|gauge|histogram)\s+(\S+)(\s+.*)?$/.exec(line);
    if (!m) throw new Error(`metrics file line ${i + 1}: expected NAME TYPE LABELS HELP: ${raw}`);
    const [, name, type, labelList] = m;
    const labels = labelList === "-" ? [] : labelList.split(",");
    if (type === "histogram") {
      series.set(`${name}_bucket`, { metric: name, type: "bucket", labels: new Set([...labels, "le"]) });
      series.set(`${name}_sum`, { metric: name, type: "sum", labels: new Set(labels) });
      series.set(`${name}_count`, { metric: name, type: "count", labels: new Set(labels) });
    } else {
      series.set(name, { metric: name, type, labels: new Set(labels) });
    }
  }
  // Prometheus' own series for every target.
  series.set("up", { metric: "up", type: "gauge", labels: new Set() });
  return series;
}

// The labels Prometheus (prometheus-operator's PodMonitor) puts on every series of a target.
const targetLabels = new Set(["job", "instance", "namespace", "pod", "container", "endpoint"]);

// Grafana's variables: the built-in durations become 5m; other variables must be defined and
// become a plain word (they are used inside label matcher strings).
const grafanaDurations = new Set(["__rate_interval", "__interval", "__range"]);
const grafanaNumbers = new Set(["__range_s", "__range_ms", "__interval_ms", "__rate_interval_ms"]);
function substituteGrafana(expr, variables, problems, where) {
  return expr.replace(/\$\{([A-Za-z0-9_]+)(?::[A-Za-z0-9_]+)?\}|\$([A-Za-z0-9_]+)|\[\[([A-Za-z0-9_]+)\]\]/g,
                      (all, a, b, c) => {
    const name = a ?? b ?? c;
    if (grafanaDurations.has(name)) return "5m";
    if (grafanaNumbers.has(name)) return "300";
    if (!variables.has(name)) problems.push(`${where}: uses $${name}, which the dashboard does not define`);
    return "x";
  });
}

const unquote = (text) => {
  if (text.startsWith("`")) return text.slice(1, -1);
  try {
    return JSON.parse(text.startsWith("'") ? `"${text.slice(1, -1).replace(/"/g, '\\"')}"` : text);
  } catch {
    return text.slice(1, -1);
  }
};

// Parses one PromQL expression and checks it against the metrics. Returns the labels its
// series can carry (for legends and annotations).
function checkPromQL(expr, where, ctx, problems) {
  const bad = (msg) => problems.push(`${where}: ${msg}`);
  const tree = promqlParser.parse(expr);
  const text = (n) => expr.slice(n.from, n.to);
  let syntax = null;
  tree.iterate({ enter: (n) => { if (n.type.isError && syntax === null) syntax = n.from; } });
  if (syntax !== null) {
    bad(`does not parse as PromQL at offset ${syntax}: ` +
        `${JSON.stringify(expr.slice(Math.max(0, syntax - 20), syntax))} ^ ` +
        `${JSON.stringify(expr.slice(syntax, syntax + 20))}`);
    return new Set();
  }
  const labels = new Set(targetLabels);
  const seriesOf = new Map();  // VectorSelector position -> series
  const grouping = [];
  tree.iterate({ enter: (ref) => {
    const n = ref.node;
    if (n.name === "GroupingLabels") {
      for (let c = n.firstChild; c; c = c.nextSibling) {
        if (c.name === "LabelName") grouping.push(text(c));
        if (c.name === "QuotedLabelName") grouping.push(unquote(text(c)));
      }
      return;
    }
    if (n.name !== "VectorSelector") return;
    let name = null;
    const matchers = [];
    const id = n.getChild("Identifier");
    if (id) name = text(id);
    const list = n.getChild("LabelMatchers");
    for (let c = list?.firstChild; c; c = c.nextSibling) {
      if (c.name === "QuotedLabelName") {
        name = unquote(text(c));
      } else if (c.name === "UnquotedLabelMatcher" || c.name === "QuotedLabelMatcher") {
        const ln = c.getChild("LabelName") ?? c.getChild("QuotedLabelName");
        const op = c.getChild("MatchOp");
        const value = c.getChild("StringLiteral");
        matchers.push({ label: ln.name === "LabelName" ? text(ln) : unquote(text(ln)),
                        op: op ? text(op) : "", value: value ? unquote(text(value)) : "" });
      }
    }
    for (const m of matchers) if (m.label === "__name__" && m.op === "=") name = m.value;
    if (name === null) {
      bad(`${JSON.stringify(text(n))} does not name a metric`);
      return;
    }
    const series = ctx.series.get(name);
    if (!series) {
      bad(`${name} is not a metric of kvmesh-node (deploy/k8s/monitoring/metrics.txt)`);
      return;
    }
    seriesOf.set(n.from, { name, ...series });
    for (const l of series.labels) labels.add(l);
    for (const m of matchers) {
      if (m.label === "__name__") continue;
      if (!series.labels.has(m.label) && !targetLabels.has(m.label)) {
        bad(`${name} has no label ${m.label} (it has ${[...series.labels, ...targetLabels].join(", ")})`);
      }
      if (m.label === "job" && m.op === "=" && ctx.job !== undefined && m.value !== ctx.job) {
        bad(`selects job="${m.value}" but the PodMonitor's job is "${ctx.job}"`);
      }
    }
  } });
  for (const g of grouping) {
    if (!labels.has(g) && !(g === "le" && [...seriesOf.values()].some((s) => s.type === "bucket"))) {
      bad(`groups or matches by ${g}, which none of its series has`);
    }
  }
  // Functions: rate() and friends of counters; histogram_quantile() of buckets, by le.
  const descendants = (node, name, out = []) => {
    for (let c = node.firstChild; c; c = c.nextSibling) {
      if (c.name === name) out.push(c);
      descendants(c, name, out);
    }
    return out;
  };
  const selectorsUnder = (node) =>
      descendants(node, "VectorSelector").map((v) => seriesOf.get(v.from)).filter((s) => s);
  tree.iterate({ enter: (ref) => {
    const n = ref.node;
    if (n.name !== "FunctionCall") return;
    const fn = n.getChild("FunctionIdentifier")?.firstChild?.name;
    const body = n.getChild("FunctionCallBody");
    if (!fn || !body) return;
    if (["Rate", "Irate", "Increase", "Resets"].includes(fn)) {
      for (const s of selectorsUnder(body)) {
        if (s.type === "gauge") bad(`${text(n.getChild("FunctionIdentifier"))}() of the gauge ${s.name}`);
      }
    } else if (fn === "HistogramQuantile") {
      for (const s of selectorsUnder(body)) {
        if (s.type !== "bucket") bad(`histogram_quantile() of ${s.name}, which is not a histogram's _bucket`);
      }
      for (const mod of descendants(body, "AggregateModifier")) {
        const kind = mod.firstChild?.name;
        const names = descendants(mod, "LabelName").map(text);
        if ((kind === "By" && !names.includes("le")) || (kind === "Without" && names.includes("le"))) {
          bad("histogram_quantile() of an aggregation that drops le");
        }
      }
    }
  } });
  return labels;
}

// {{label}} in a legend, {{ $labels.label }} in an annotation: labels the query has.
function checkTemplateLabels(template, pattern, labels, where, problems) {
  for (const m of (template ?? "").matchAll(pattern)) {
    if (!labels.has(m[1])) problems.push(`${where}: uses the label ${m[1]}, which its query does not have`);
  }
}

function* allPanels(panels) {
  for (const p of panels ?? []) {
    yield p;
    yield* allPanels(p.panels);
  }
}

function dashboardProblems(text, where, ctx) {
  const problems = [];
  const bad = (msg) => problems.push(`${where}: ${msg}`);
  let dash;
  try {
    dash = JSON.parse(text);
  } catch (e) {
    bad(`does not parse as JSON: ${e.message}`);
    return problems;
  }
  // Grafana 11.0 wrote schemaVersion 39, 12.0 writes 41.
  if (!Number.isInteger(dash.schemaVersion) || dash.schemaVersion < 39) {
    bad(`schemaVersion ${dash.schemaVersion}: expected that of a current Grafana (39 or later)`);
  }
  if (!dash.uid || !dash.title) bad("no uid or title");
  const vars = dash.templating?.list ?? [];
  const variables = new Set(vars.map((v) => v.name));
  const dsVar = vars.find((v) => v.name === "datasource");
  if (!dsVar || dsVar.type !== "datasource" || dsVar.query !== "prometheus") {
    bad("no datasource variable (name datasource, type datasource, query prometheus)");
  }
  const isOurs = (ds) => ds?.uid === "${datasource}" && (ds.type ?? "prometheus") === "prometheus";
  if (!vars.some((v) => v.name === "node" && v.type === "query")) bad("no node variable (type query)");
  for (const v of vars.filter((v) => v.type === "query")) {
    const w = `${where} variable ${v.name}`;
    if (!isOurs(v.datasource)) problems.push(`${w}: datasource is not \${datasource}`);
    const q = typeof v.query === "string" ? v.query : v.query?.query ?? "";
    const m = /^\s*label_values\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*$/.exec(q);
    if (!m) {
      problems.push(`${w}: expected label_values(SELECTOR, LABEL), got ${JSON.stringify(q)}`);
      continue;
    }
    const expr = substituteGrafana(m[1], variables, problems, w);
    const labels = checkPromQL(expr, w, ctx, problems);
    if (labels.size > 0 && !labels.has(m[2])) problems.push(`${w}: ${m[1]} has no label ${m[2]}`);
  }
  const ids = new Set();
  for (const panel of allPanels(dash.panels)) {
    const w = `${where} panel ${JSON.stringify(panel.title)}`;
    if (ids.has(panel.id)) problems.push(`${w}: id ${panel.id} is not unique`);
    ids.add(panel.id);
    if (!panel.gridPos || !(panel.gridPos.w > 0) || !(panel.gridPos.h > 0)) problems.push(`${w}: no gridPos`);
    if (panel.type === "row") continue;
    if (!isOurs(panel.datasource)) problems.push(`${w}: datasource is not \${datasource}`);
    if (!(panel.targets?.length > 0)) problems.push(`${w}: no queries`);
    for (const t of panel.targets ?? []) {
      const tw = `${w} query ${t.refId}`;
      if (t.datasource !== undefined && !isOurs(t.datasource)) problems.push(`${tw}: datasource is not \${datasource}`);
      if (typeof t.expr !== "string" || !t.expr.trim()) {
        problems.push(`${tw}: no expr`);
        continue;
      }
      const labels = checkPromQL(substituteGrafana(t.expr, variables, problems, tw), tw, ctx, problems);
      checkTemplateLabels(t.legendFormat, /\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}/g, labels, tw, problems);
    }
  }
  return problems;
}

function monitoringProblems(objects, series) {
  const problems = [];
  const bad = (msg) => problems.push(`monitoring: ${msg}`);
  const podMonitors = objects.filter((o) => o.kind === "PodMonitor");
  const ruleSets = objects.filter((o) => o.kind === "PrometheusRule");
  const dashboards = objects.filter((o) => o.kind === "ConfigMap" && o.metadata?.labels?.grafana_dashboard);
  if (podMonitors.length + objects.filter((o) => o.kind === "ServiceMonitor").length === 0) {
    bad("no PodMonitor or ServiceMonitor");
  }
  if (ruleSets.length === 0) bad("no PrometheusRule");
  if (dashboards.length === 0) bad("no ConfigMap labelled grafana_dashboard");
  // The job the monitor gives its targets: the value of the pods' label jobLabel names, else
  // namespace/name.
  let job;
  const pm = podMonitors[0];
  if (pm) {
    job = pm.spec?.jobLabel ? pm.spec?.selector?.matchLabels?.[pm.spec.jobLabel]
                            : `${pm.metadata?.namespace}/${pm.metadata?.name}`;
    if (pm.spec?.jobLabel && job === undefined) {
      bad(`PodMonitor ${pm.metadata?.name}: jobLabel ${pm.spec.jobLabel} is not in its selector's matchLabels`);
    }
  }
  const ctx = { series, job };
  const severities = new Set(["critical", "warning", "info"]);
  for (const rs of ruleSets) {
    const names = new Set();
    for (const group of rs.spec?.groups ?? []) {
      for (const rule of group.rules ?? []) {
        const w = `PrometheusRule ${rs.metadata?.name} ${rule.alert ?? rule.record}`;
        const expr = String(rule.expr ?? "");
        const labels = checkPromQL(expr, w, ctx, problems);
        if (rule.record) continue;
        if (names.has(rule.alert)) problems.push(`${w}: alert defined twice`);
        names.add(rule.alert);
        if (rule.for === undefined) problems.push(`${w}: no for:`);
        if (!severities.has(rule.labels?.severity)) {
          problems.push(`${w}: severity ${rule.labels?.severity}: expected critical, warning or info`);
        }
        for (const a of ["summary", "description"]) {
          if (!String(rule.annotations?.[a] ?? "").trim()) problems.push(`${w}: no ${a} annotation`);
          checkTemplateLabels(rule.annotations?.[a], /\$labels\.([A-Za-z_][A-Za-z0-9_]*)/g, labels,
                              `${w} ${a}`, problems);
        }
      }
    }
  }
  for (const cm of dashboards) {
    for (const [key, text] of Object.entries(cm.data ?? {})) {
      if (key.endsWith(".json")) problems.push(...dashboardProblems(text, `dashboard ${key}`, ctx));
    }
  }
  return problems;
}

const isMonitoring = (o) => String(o.apiVersion).startsWith("monitoring.coreos.com/") ||
                            (o.kind === "ConfigMap" && o.metadata?.labels?.grafana_dashboard !== undefined);

// The problems of each set of objects. A set may hold an overlay, the monitoring objects, or
// both; `monitoring` (the monitoring kustomization) is checked against each overlay too.
async function allProblems(objectSets, flags, series, monitoring = []) {
  const typed = typeScriptProblems(objectSets);
  const result = [];
  for (const [set, objects] of objectSets.entries()) {
    const mine = objects.filter(isMonitoring);
    const rest = objects.filter((o) => !isMonitoring(o));
    result.push([...(await runtimeSchemaProblems(objects)), ...typed[set], ...clusterProblems(objects),
                 ...(rest.length > 0 ? kvmeshProblems(rest, flags, [...mine, ...monitoring]) : []),
                 ...(mine.length > 0 ? monitoringProblems(mine, series) : [])]);
  }
  return result;
}

function readObjects(file) {
  return YAML.parseAllDocuments(fs.readFileSync(file, "utf8")).map((doc) => {
    if (doc.errors.length > 0) throw new Error(`${file}: ${doc.errors[0].message}`);
    return doc.toJS();
  }).filter((o) => o !== null);
}

// ---------------------------------------------------------------------------------------------
// The self-test: each case plants one error in the host overlay's objects and the monitoring
// objects (checked together) and must be found, with a problem that contains `expect`.

const find = (objects, kind, name) =>
    objects.find((o) => o.kind === kind && (name === undefined || o.metadata.name === name));
const podSpec = (objects) => find(objects, "StatefulSet").spec.template.spec;
const node = (objects) => podSpec(objects).containers[0];
const volume = (objects, name) => podSpec(objects).volumes.find((v) => v.name === name);
const tlsAttrs = (objects) => volume(objects, "tls").csi.volumeAttributes;
const setArg = (objects, flag, value) => {
  const args = node(objects).args;
  args[args.findIndex((a) => a.startsWith(`${flag}=`))] = `${flag}=${value}`;
};
const metricsRule = (objects) =>
    find(objects, "NetworkPolicy").spec.ingress.find((r) => r.ports.some((p) => p.port === 9400));
const alert = (objects, name) => find(objects, "PrometheusRule").spec.groups
    .flatMap((g) => g.rules).find((r) => r.alert === name);
// Edits the dashboard in its ConfigMap: edit(dashboard, panel titled `title`).
const dashboardKey = "kvmesh-dashboard.json";
const editDashboard = (objects, title, edit) => {
  const cm = find(objects, "ConfigMap", "kvmesh-dashboard");
  const dash = JSON.parse(cm.data[dashboardKey]);
  edit(dash, [...allPanels(dash.panels)].find((p) => p.title === title));
  cm.data[dashboardKey] = JSON.stringify(dash, null, 2);
};
const selfTests = [
  { name: "unknown field (a typo in a probe)", expect: "'\"serviceName\"' does not exist in type 'IGRPCAction'",
    plant: (o) => { node(o).readinessProbe.grpc.serviceName = "kvmesh.v1.CacheService"; } },
  { name: "unknown field (a misspelt Service field)", expect: "'\"clusterIp\"' does not exist in type 'IServiceSpec'",
    plant: (o) => { find(o, "Service", "kvmesh-peers").spec.clusterIp = "None"; } },
  { name: "unknown field (top level)", expect: "'\"specs\"' does not exist in type 'IPodDisruptionBudget'",
    plant: (o) => { find(o, "PodDisruptionBudget").specs = {}; } },
  { name: "unknown field in a list (env)", expect: "'\"fieldPth\"' does not exist",
    plant: (o) => { node(o).env[0].valueFrom.fieldRef.fieldPth = "metadata.name"; } },
  { name: "unknown field in a list (volumes)", expect: "'\"secretNme\"' does not exist",
    plant: (o) => { podSpec(o).volumes.find((v) => v.secret).secret.secretNme = "x"; } },
  { name: "wrong type (a port as a string)", expect: "/spec/ports/0/port must be integer",
    plant: (o) => { find(o, "Service", "kvmesh").spec.ports[0].port = "7700"; } },
  { name: "wrong type (args as a string)", expect: "args must be array",
    plant: (o) => { node(o).args = "--listen=0.0.0.0:7700"; } },
  { name: "not an enum value", expect: "must be equal to one of the allowed values",
    plant: (o) => { find(o, "StatefulSet").spec.podManagementPolicy = "parallel"; } },
  { name: "required field missing", expect: "containers/0 must have required property name",
    plant: (o) => { delete node(o).name; } },
  { name: "unknown kind", expect: "no schema for apiVersion apps/v1 kind StatefulSett",
    plant: (o) => { find(o, "StatefulSet").kind = "StatefulSett"; } },
  { name: "a flag kvmesh-node does not have", expect: "--peer-listen-address is not a flag",
    plant: (o) => { node(o).args.push("--peer-listen-address=0.0.0.0:7701"); } },
  { name: "a flag given twice", expect: "--memory_budget is given twice",
    plant: (o) => { node(o).args.push("--memory_budget=1GiB"); } },
  { name: "peer port differs from its containerPort", expect: "containerPort peer is 7711",
    plant: (o) => { node(o).ports.find((p) => p.name === "peer").containerPort = 7711; } },
  { name: "client Service targets another port", expect: "Service kvmesh targets ports [7799]",
    plant: (o) => { find(o, "Service", "kvmesh").spec.ports[0].targetPort = 7799; } },
  { name: "probe on the client port", expect: "livenessProbe probes port 7700",
    plant: (o) => { node(o).livenessProbe.grpc.port = 7700; } },
  { name: "readiness on the process-wide service", expect: "readinessProbe asks for service \"\"",
    plant: (o) => { node(o).readinessProbe.grpc.service = ""; } },
  { name: "liveness on CacheService (would kill draining pods)", expect: "livenessProbe asks for service",
    plant: (o) => { node(o).livenessProbe.grpc.service = "kvmesh.v1.CacheService"; } },
  { name: "grace period shorter than the drain", expect: "terminationGracePeriodSeconds 60",
    plant: (o) => { find(o, "StatefulSet").spec.template.spec.terminationGracePeriodSeconds = 60; } },
  { name: "peer port open to every pod", expect: "admits more than the kvmesh pods to the peer port",
    plant: (o) => { find(o, "NetworkPolicy").spec.ingress[0].from = [{ podSelector: {} }]; } },
  { name: "NetworkPolicy without the health port", expect: "admits nothing to port 7702",
    plant: (o) => { find(o, "NetworkPolicy").spec.ingress.pop(); } },
  { name: "headless Service without unready addresses", expect: "publishNotReadyAddresses",
    plant: (o) => { find(o, "Service", "kvmesh-peers").spec.publishNotReadyAddresses = false; } },
  { name: "--peer-dns on another port", expect: "--peer-dns port 7777",
    plant: (o) => {
      const args = node(o).args;
      const i = args.findIndex((a) => a.startsWith("--peer-dns="));
      args[i] = args[i].replace(/:7701$/, ":7777");
    } },
  { name: "memory limit below the budgets", expect: "memory limit 4Gi is below",
    plant: (o) => { node(o).resources.limits.memory = "4Gi"; node(o).resources.requests.memory = "4Gi"; } },
  { name: "$(VAR) without an env var", expect: "$(POD_UID)",
    plant: (o) => { node(o).args.push("--port-file=/tmp/$(POD_UID)"); } },
  { name: "token file through subPath", expect: "--token-file=/etc/kvmesh/tokens/tokens is not under",
    plant: (o) => { node(o).volumeMounts.find((m) => m.name === "tokens").subPath = "tokens"; } },
  { name: "writable root file system", expect: "readOnlyRootFilesystem",
    plant: (o) => { node(o).securityContext.readOnlyRootFilesystem = false; } },
  // Metrics: the port, everywhere it appears.
  { name: "no --metrics-port", expect: "the args lack --metrics-port",
    plant: (o) => { node(o).args = node(o).args.filter((a) => !a.startsWith("--metrics-port=")); } },
  { name: "metrics containerPort differs from --metrics-port", expect: "--metrics-port is 9400 but containerPort metrics is 9401",
    plant: (o) => { node(o).ports.find((p) => p.name === "metrics").containerPort = 9401; } },
  { name: "--metrics-port differs from the containerPort", expect: "--metrics-port is 9500 but containerPort metrics is 9400",
    plant: (o) => { setArg(o, "--metrics-port", "9500"); } },
  { name: "NetworkPolicy admits another metrics port", expect: "admits nothing to port 9400 (--metrics-port)",
    plant: (o) => { metricsRule(o).ports[0].port = 9401; } },
  { name: "metrics port open to everyone", expect: "admits anyone to the metrics port 9400",
    plant: (o) => { delete metricsRule(o).from; } },
  { name: "PodMonitor scrapes another port", expect: "scrapes port \"health\" (7702), not --metrics-port's 9400",
    plant: (o) => { find(o, "PodMonitor").spec.podMetricsEndpoints[0].port = "health"; } },
  { name: "PodMonitor in another namespace", expect: "is in namespace monitoring, not the pods' kvmesh",
    plant: (o) => { find(o, "PodMonitor").metadata.namespace = "monitoring"; } },
  { name: "unknown field in the PodMonitor", expect: "'\"scrapeInterval\"' does not exist",
    plant: (o) => { find(o, "PodMonitor").spec.podMetricsEndpoints[0].scrapeInterval = "15s"; } },
  { name: "wrong type in the PrometheusRule", expect: "for must be string",
    plant: (o) => { alert(o, "KvmeshDrainStuck").for = 15; } },
  // Alerts.
  { name: "unknown metric in an alert", expect: "kvmesh_device_memory_limit_bytes is not a metric of kvmesh-node",
    plant: (o) => {
      const r = alert(o, "KvmeshDeviceMemoryNearBudget");
      r.expr = r.expr.replace("kvmesh_device_memory_budget_bytes", "kvmesh_device_memory_limit_bytes");
    } },
  { name: "rate() of a gauge", expect: "rate() of the gauge kvmesh_executor_queue_depth",
    plant: (o) => {
      const r = alert(o, "KvmeshExecutorRejecting");
      r.expr = r.expr.replace("kvmesh_executor_rejections_total", "kvmesh_executor_queue_depth");
    } },
  { name: "PromQL that does not parse", expect: "does not parse as PromQL",
    plant: (o) => { alert(o, "KvmeshDrainStuck").expr = 'max by (namespace, pod) (kvmesh_draining{job="kvmesh"} == 1'; } },
  { name: "alert on another job", expect: "selects job=\"kvmesh-node\" but the PodMonitor's job is \"kvmesh\"",
    plant: (o) => { alert(o, "KvmeshNodeDown").expr = 'up{job="kvmesh-node"} == 0'; } },
  { name: "alert without a description", expect: "no description annotation",
    plant: (o) => { delete alert(o, "KvmeshNodeRestarted").annotations.description; } },
  { name: "annotation with a label the query lacks", expect: "uses the label executor",
    plant: (o) => { alert(o, "KvmeshInflightBudgetExhausted").annotations.summary += " ({{ $labels.executor }})"; } },
  // The dashboard.
  { name: "unknown metric in a panel", expect: "kvmesh_rpc_handled_totals is not a metric of kvmesh-node",
    plant: (o) => editDashboard(o, "RPC rate by method and code", (d, p) => {
      p.targets[0].expr = p.targets[0].expr.replace("kvmesh_rpc_handled_total", "kvmesh_rpc_handled_totals");
    }) },
  { name: "label a metric does not have", expect: "kvmesh_executor_queue_depth has no label queue",
    plant: (o) => editDashboard(o, "Executor queue depth", (d, p) => {
      p.targets[0].expr = p.targets[0].expr.replace("{", '{queue="engine", ');
    }) },
  { name: "histogram_quantile without le", expect: "histogram_quantile() of an aggregation that drops le",
    plant: (o) => editDashboard(o, "Latency p99 by method", (d, p) => {
      p.targets[0].expr = p.targets[0].expr.replace("by (le, ", "by (");
    }) },
  { name: "legend with a label the query lacks", expect: "uses the label tennant",
    plant: (o) => editDashboard(o, "Sequences", (d, p) => { p.targets[0].legendFormat = "{{pod}} {{tennant}}"; }) },
  { name: "undefined dashboard variable", expect: "uses $instance, which the dashboard does not define",
    plant: (o) => editDashboard(o, "Sequences", (d, p) => {
      p.targets[0].expr = p.targets[0].expr.replace("}", ', instance=~"$instance"}');
    }) },
  { name: "panel with a fixed datasource", expect: "datasource is not ${datasource}",
    plant: (o) => editDashboard(o, "Sequences", (d, p) => { p.datasource = { type: "prometheus", uid: "prom" }; }) },
  { name: "dashboard without the node variable", expect: "no node variable",
    plant: (o) => editDashboard(o, "Sequences", (d) => {
      d.templating.list = d.templating.list.filter((v) => v.name !== "node");
    }) },
  { name: "dashboard that is not JSON", expect: "does not parse as JSON",
    plant: (o) => {
      const cm = find(o, "ConfigMap", "kvmesh-dashboard");
      cm.data[dashboardKey] = cm.data[dashboardKey].slice(0, 1000);
    } },
  // What the cluster would refuse (the API server, a controller, the kubelet).
  { name: "PodDisruptionBudget policy/v1beta1 (removed)",
    expect: "PodDisruptionBudget/kvmesh: apiVersion policy/v1beta1 is not served by Kubernetes 1.33 (removed in 1.25",
    plant: (o) => { find(o, "PodDisruptionBudget").apiVersion = "policy/v1beta1"; } },
  { name: "NetworkPolicy extensions/v1beta1 (removed)",
    expect: "NetworkPolicy/kvmesh: apiVersion extensions/v1beta1 is not served by Kubernetes 1.33 (removed in 1.16",
    plant: (o) => { find(o, "NetworkPolicy").apiVersion = "extensions/v1beta1"; } },
  { name: "StatefulSet apps/v1beta2 (removed)", expect: "apiVersion apps/v1beta2 is not served",
    plant: (o) => { find(o, "StatefulSet").apiVersion = "apps/v1beta2"; } },
  { name: "Egress policy type without egress rules", expect: "no egress rule allows DNS (UDP port 53)",
    plant: (o) => { find(o, "NetworkPolicy").spec.policyTypes.push("Egress"); } },
  { name: "egress rules for DNS only", expect: "no egress rule allows the peer port 7701 to the kvmesh pods",
    plant: (o) => {
      const spec = find(o, "NetworkPolicy").spec;
      spec.policyTypes.push("Egress");
      spec.egress = [{ ports: [{ port: 53, protocol: "UDP" }, { port: 53, protocol: "TCP" }] }];
    } },
  { name: "a Secret nobody creates", expect: "refers to Secret kvmesh-token, which is neither among the rendered objects",
    plant: (o) => { volume(o, "tokens").secret.secretName = "kvmesh-token"; } },
  { name: "a ConfigMap nobody creates", expect: "refers to ConfigMap kvmesh-config, which is neither among the rendered objects",
    plant: (o) => {
      podSpec(o).volumes.push({ name: "config", configMap: { name: "kvmesh-config" } });
      node(o).volumeMounts.push({ name: "config", mountPath: "/etc/kvmesh/config", readOnly: true });
    } },
  { name: "an Issuer nobody creates", expect: "refers to Issuer kvmesh-issuer, which is neither",
    plant: (o) => { tlsAttrs(o)["csi.cert-manager.io/issuer-name"] = "kvmesh-issuer"; } },
  { name: "CPU limit below the request", expect: "requests.cpu 2 is above limits.cpu 1500m",
    plant: (o) => { node(o).resources.limits.cpu = "1500m"; } },
  { name: "selector that does not match the template's labels",
    expect: "spec.selector {\"matchLabels\":{\"app.kubernetes.io/name\":\"kvmesh-node\"}} does not match the template's labels",
    plant: (o) => { find(o, "StatefulSet").spec.selector.matchLabels["app.kubernetes.io/name"] = "kvmesh-node"; } },
  { name: "mount of an undefined volume", expect: "mounts volume certs at /etc/kvmesh/certs, which the pod does not define",
    plant: (o) => { node(o).volumeMounts.push({ name: "certs", mountPath: "/etc/kvmesh/certs", readOnly: true }); } },
  { name: "runAsUser 0 beside runAsNonRoot", expect: "runAsUser 0 (root) beside runAsNonRoot: true",
    plant: (o) => { node(o).securityContext.runAsUser = 0; } },
  { name: "the latest tag", expect: "image kvmesh/kvmesh-node:latest uses the tag latest",
    plant: (o) => { node(o).image = "kvmesh/kvmesh-node:latest"; } },
  { name: "no tag", expect: "image registry.example:5000/kvmesh/kvmesh-node has no tag",
    plant: (o) => { node(o).image = "registry.example:5000/kvmesh/kvmesh-node"; } },
  { name: "metrics rule split into two entries (widened)",
    expect: "admits every pod of the namespaces {\"matchLabels\":{\"kubernetes.io/metadata.name\":\"monitoring\"}} to the metrics port 9400",
    plant: (o) => {
      const rule = metricsRule(o);
      const [{ namespaceSelector, podSelector }] = rule.from;
      rule.from = [{ namespaceSelector }, { podSelector }];
    } },
  { name: "metrics rule from every namespace", expect: "admits pods of every namespace to the metrics port 9400",
    plant: (o) => { metricsRule(o).from[0].namespaceSelector = {}; } },
  // Each pod's key is its own.
  { name: "TLS key from a Secret every pod mounts",
    expect: "--tls-key=/etc/kvmesh/tls/tls.key comes from the Secret kvmesh-tls, which every pod of the StatefulSet mounts",
    plant: (o) => {
      Object.assign(volume(o, "tls"), { csi: undefined, secret: { secretName: "kvmesh-tls", defaultMode: 0o440 } });
      delete volume(o, "tls").csi;
      o.push({ apiVersion: "v1", kind: "Secret", metadata: { name: "kvmesh-tls", namespace: "kvmesh" },
               type: "Opaque", data: {} });
    } },
  { name: "TLS key from a projected Secret", expect: "comes from the Secret kvmesh-tls, which every pod",
    plant: (o) => {
      delete volume(o, "tls").csi;
      volume(o, "tls").projected = { sources: [{ secret: { name: "kvmesh-tls" } }] };
      o.push({ apiVersion: "v1", kind: "Secret", metadata: { name: "kvmesh-tls", namespace: "kvmesh" },
               type: "Opaque", data: {} });
    } },
  { name: "certificate without the member name", expect: "csi.cert-manager.io/dns-names lacks ${POD_NAME}, the member name",
    plant: (o) => {
      const a = tlsAttrs(o);
      a["csi.cert-manager.io/dns-names"] = a["csi.cert-manager.io/dns-names"].replace(/^\$\{POD_NAME\},/, "");
    } },
  { name: "certificate naming a fixed pod", expect: "dns-names name a fixed pod (kvmesh-0)",
    plant: (o) => { tlsAttrs(o)["csi.cert-manager.io/dns-names"] += ",kvmesh-0"; } },
  { name: "certificate without client auth", expect: "key-usages lack \"client auth\"",
    plant: (o) => { tlsAttrs(o)["csi.cert-manager.io/key-usages"] = "server auth,digital signature"; } },
  { name: "key file the driver does not write", expect: "--tls-key=/etc/kvmesh/tls/key.pem is not the file the csi-driver writes",
    plant: (o) => { setArg(o, "--tls-key", "/etc/kvmesh/tls/key.pem"); } },
  { name: "TLS files unreadable by the node", expect: "fs-group (unset) is not the pod's fsGroup 65532",
    plant: (o) => { delete tlsAttrs(o)["csi.cert-manager.io/fs-group"]; } },
  // Spreading the pods.
  { name: "no pod anti-affinity", expect: "no podAntiAffinity on kubernetes.io/hostname selects the pods",
    plant: (o) => { delete podSpec(o).affinity; } },
  { name: "anti-affinity that selects no pod", expect: "which selects no kvmesh pod: it keeps nothing apart",
    plant: (o) => {
      podSpec(o).affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution[0]
          .podAffinityTerm.labelSelector = { matchLabels: { app: "kvmesh" } };
    } },
  { name: "spread constraint that selects no pod", expect: "topology.kubernetes.io/zone has labelSelector {\"matchLabels\":{\"app\":\"kvmesh\"}}, which selects no kvmesh pod",
    plant: (o) => { podSpec(o).topologySpreadConstraints[0].labelSelector = { matchLabels: { app: "kvmesh" } }; } },
  { name: "no topology spread", expect: "no topologySpreadConstraint selects the pods",
    plant: (o) => { delete podSpec(o).topologySpreadConstraints; } },
];

// Variants that must pass: what deploy/k8s/README.md tells an operator to do.
const acceptedVariants = [
  { name: "hard anti-affinity and spread (deploy/k8s/README.md, \"Spreading the pods\")",
    plant: (o) => {
      const spec = podSpec(o);
      const anti = spec.affinity.podAntiAffinity;
      anti.requiredDuringSchedulingIgnoredDuringExecution =
          anti.preferredDuringSchedulingIgnoredDuringExecution.map((w) => w.podAffinityTerm);
      delete anti.preferredDuringSchedulingIgnoredDuringExecution;
      spec.topologySpreadConstraints[0].whenUnsatisfiable = "DoNotSchedule";
    } },
  { name: "egress restricted to DNS and the peers",
    plant: (o) => {
      const spec = find(o, "NetworkPolicy").spec;
      spec.policyTypes.push("Egress");
      spec.egress = [
        { ports: [{ port: 53, protocol: "UDP" }, { port: 53, protocol: "TCP" }] },
        { to: [{ podSelector: { matchLabels: { "app.kubernetes.io/name": "kvmesh" } } }],
          ports: [{ port: 7701, protocol: "TCP" }] },
      ];
    } },
];

async function selfTest(file, flags, series, monitoring) {
  const original = [...readObjects(file), ...monitoring];
  let failed = 0;
  const variants = [...selfTests, ...acceptedVariants].map((t) => {
    const objects = structuredClone(original);
    t.plant(objects);
    return objects;
  });
  const [clean, ...results] = await allProblems([original, ...variants], flags, series);
  const found = results.slice(0, selfTests.length);
  if (clean.length > 0) {
    console.log(`FAIL unchanged manifests: expected no problem, got:\n  ${clean.join("\n  ")}`);
    failed++;
  } else {
    console.log("ok   unchanged manifests pass");
  }
  for (const [i, t] of selfTests.entries()) {
    const problems = found[i];
    const hit = problems.find((p) => p.includes(t.expect));
    if (hit) {
      console.log(`ok   ${t.name}: rejected: ${hit}`);
    } else {
      failed++;
      console.log(`FAIL ${t.name}: expected a problem containing ${JSON.stringify(t.expect)}, got:` +
                  (problems.length ? `\n  ${problems.join("\n  ")}` : " none"));
    }
  }
  for (const [i, t] of acceptedVariants.entries()) {
    const problems = results[selfTests.length + i];
    if (problems.length === 0) {
      console.log(`ok   ${t.name}: accepted`);
    } else {
      failed++;
      console.log(`FAIL ${t.name}: expected no problem, got:\n  ${problems.join("\n  ")}`);
    }
  }
  const passed = selfTests.length + acceptedVariants.length + 1 - failed;
  console.log(`${passed} passed, ${failed} failed`);
  return failed === 0;
}

async function main(argv) {
  let flagsFile = null;
  let metricsFile = null;
  let monitoringFile = null;
  let self = false;
  const inputs = [];
  for (const a of argv) {
    if (a.startsWith("--flags=")) flagsFile = a.slice("--flags=".length);
    else if (a.startsWith("--metrics=")) metricsFile = a.slice("--metrics=".length);
    else if (a.startsWith("--monitoring=")) monitoringFile = a.slice("--monitoring=".length);
    else if (a === "--self-test") self = true;
    else inputs.push(a);
  }
  if (!flagsFile || !metricsFile || !monitoringFile || inputs.length === 0 ||
      (self && inputs.length !== 1)) {
    console.error("usage: validate.mjs --flags=HELPFULL --metrics=METRICS --monitoring=MONITORING.yaml " +
                  "[--self-test] [NAME=]RENDERED.yaml ...");
    return 2;
  }
  const series = parseMetrics(fs.readFileSync(metricsFile, "utf8"));
  const monitoring = readObjects(monitoringFile);
  const flags = parseHelpfull(fs.readFileSync(flagsFile, "utf8"));
  if (!flags.has("listen") || !flags.has("peer_listen")) {
    console.error(`${flagsFile} does not look like kvmesh-node --helpfull (no --listen, --peer-listen)`);
    return 2;
  }
  if (self) return (await selfTest(inputs[0], flags, series, monitoring)) ? 0 : 1;
  let ok = true;
  const named = inputs.map((input) => {
    const eq = input.indexOf("=");
    return eq > 0 ? [input.slice(0, eq), input.slice(eq + 1)] : [input, input];
  });
  const sets = named.map(([, file]) => readObjects(file));
  // The monitoring objects: checked once on their own, and against each overlay.
  named.push(["monitoring", monitoringFile]);
  sets.push(monitoring);
  const results = await allProblems(sets, flags, series, monitoring);
  for (const [n, [name]] of named.entries()) {
    const objects = sets[n];
    const problems = objects.length > 0 ? results[n] : ["no objects: the rendering is empty"];
    const kinds = objects.map(describe).join(", ");
    if (problems.length === 0) {
      console.log(`ok   ${name}: ${objects.length} objects valid (${kinds})`);
    } else {
      ok = false;
      console.log(`FAIL ${name}: ${problems.length} problems in ${objects.length} objects:`);
      for (const p of problems) console.log(`  ${p}`);
    }
  }
  return ok ? 0 : 1;
}

process.exitCode = await main(process.argv.slice(2));

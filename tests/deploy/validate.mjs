// Offline validation of kvmesh's Kubernetes manifests (deploy/k8s), as rendered by kustomize.
//
//   node validate.mjs --flags=HELPFULL OVERLAY=RENDERED.yaml ...   check each rendered overlay
//   node validate.mjs --flags=HELPFULL --self-test RENDERED.yaml   plant errors, expect each found
//
// HELPFULL is what `kvmesh-node --helpfull` printed. Exit status 0 when everything passed, 1 when
// a check failed (each problem is printed), 2 on a usage error.
//
// Three checks, every object of every overlay:
//  1. Schema, at run time: kubernetes-models' validators, compiled (ajv) from the Kubernetes
//     OpenAPI spec: types, required fields, enums and formats (int32, ...). They do not reject
//     unknown fields (the OpenAPI spec does not say additionalProperties: false).
//  2. Schema, unknown fields: each object is type-checked by the TypeScript compiler as an
//     object literal of kubernetes-models' interface for its kind (generated from the same
//     spec). TypeScript rejects a property the interface does not have at every depth of a
//     literal (excess property checks), and wrong types too: the strict check kubeconform
//     -strict makes.
//  3. kvmesh: every flag in the container's args is one kvmesh-node accepts; the ports of
//     --listen, --peer-listen and --health-listen agree with the containerPorts, the Services,
//     the probes and the NetworkPolicy; the probes ask the health services kvmesh-node serves;
//     the grace period outlasts the drain; memory covers the budgets.
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";
import YAML from "yaml";
import ts from "typescript";

const here = path.dirname(fileURLToPath(import.meta.url));

// ---------------------------------------------------------------------------------------------
// 1 and 2: the schemas.

// kubernetes-models' module for an apiVersion: "v1" -> kubernetes-models/v1,
// "apps/v1" -> kubernetes-models/apps/v1.
function modelModule(apiVersion) {
  if (typeof apiVersion !== "string" || !/^([a-z0-9.-]+\/)?v[0-9a-z]+$/.test(apiVersion)) {
    return null;
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
// 3: kvmesh-node's flags and the ports, probes, grace period and memory.

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

function kvmeshProblems(objects, flags) {
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
                          "token_file", "tls_cert", "tls_key", "peer_ca"]) {
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

  // Drain: the kubelet's SIGKILL must come after the drain and the 5 s shutdown grace.
  const drainMs = Number(arg("drain_timeout_ms") ?? 60000);
  const grace = pod.terminationGracePeriodSeconds ?? 30;
  if (!(grace >= drainMs / 1000 + 5 + 10)) {
    bad(`terminationGracePeriodSeconds ${grace} must exceed --drain-timeout-ms (${drainMs / 1000} s) ` +
        "+ 5 s of shutdown grace + 10 s of margin");
  }

  // Files: under read-only Secret mounts.
  const mounts = container.volumeMounts ?? [];
  const volumes = new Map((pod.volumes ?? []).map((v) => [v.name, v]));
  for (const flag of ["token_file", "tls_cert", "tls_key", "peer_ca"]) {
    const file = arg(flag);
    if (file === undefined) continue;
    const mount = mounts.find((m) => file.startsWith(m.mountPath.replace(/\/?$/, "/")));
    if (!mount || !mount.readOnly || !volumes.get(mount.name)?.secret || mount.subPath) {
      bad(`--${flag.replace(/_/g, "-")}=${file} is not under a read-only Secret volume mount (no subPath)`);
    }
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

// The problems of each set of objects.
async function allProblems(objectSets, flags) {
  const typed = typeScriptProblems(objectSets);
  const result = [];
  for (const [set, objects] of objectSets.entries()) {
    result.push([...(await runtimeSchemaProblems(objects)), ...typed[set],
                 ...kvmeshProblems(objects, flags)]);
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
// The self-test: each case plants one error in the host overlay's objects and must be found,
// with a problem that contains `expect`.

const find = (objects, kind, name) =>
    objects.find((o) => o.kind === kind && (name === undefined || o.metadata.name === name));
const node = (objects) => find(objects, "StatefulSet").spec.template.spec.containers[0];
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
    plant: (o) => { find(o, "StatefulSet").spec.template.spec.volumes[0].secret.secretNme = "x"; } },
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
];

async function selfTest(file, flags) {
  const original = readObjects(file);
  let failed = 0;
  const variants = selfTests.map((t) => {
    const objects = structuredClone(original);
    t.plant(objects);
    return objects;
  });
  const [clean, ...found] = await allProblems([original, ...variants], flags);
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
  const passed = selfTests.length + 1 - failed;
  console.log(`${passed} passed, ${failed} failed`);
  return failed === 0;
}

async function main(argv) {
  let flagsFile = null;
  let self = false;
  const inputs = [];
  for (const a of argv) {
    if (a.startsWith("--flags=")) flagsFile = a.slice("--flags=".length);
    else if (a === "--self-test") self = true;
    else inputs.push(a);
  }
  if (!flagsFile || inputs.length === 0 || (self && inputs.length !== 1)) {
    console.error("usage: validate.mjs --flags=HELPFULL [--self-test] [NAME=]RENDERED.yaml ...");
    return 2;
  }
  const flags = parseHelpfull(fs.readFileSync(flagsFile, "utf8"));
  if (!flags.has("listen") || !flags.has("peer_listen")) {
    console.error(`${flagsFile} does not look like kvmesh-node --helpfull (no --listen, --peer-listen)`);
    return 2;
  }
  if (self) return (await selfTest(inputs[0], flags)) ? 0 : 1;
  let ok = true;
  const named = inputs.map((input) => {
    const eq = input.indexOf("=");
    return eq > 0 ? [input.slice(0, eq), input.slice(eq + 1)] : [input, input];
  });
  const sets = named.map(([, file]) => readObjects(file));
  const results = await allProblems(sets, flags);
  for (const [n, [name]] of named.entries()) {
    const objects = sets[n];
    const problems = results[n];
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

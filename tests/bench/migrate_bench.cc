// Migration benchmark: a Llama-3-8B-shaped sequence (32 layers, 8 KV heads, head dim 128, F16;
// 4096 tokens = 512 MiB) migrated between two kvmesh-node processes on 127.0.0.1 over the
// grpc-stream transport, as GB/s and as a ratio to raw loopback TCP measured in the same run.
//
//  - Starts nodes "bench-a" and "bench-b" on ports reserved up front, each naming the other in
//    --peers; creates the cache on both (max_sequences 1, capacity max(--tokens, 4096)), appends
//    --tokens tokens of pattern payload (service/ctl/payload.h) to sequence 0 on bench-a.
//  - Migrates the sequence a -> b -> a ... --reps times with keep_source=false, timing each
//    Migrate call on the client (wall clock) and printing the TransferStats the node reports
//    (bytes of the wire image, micros from the export request to the commit on the receiver).
//    After each call the source must no longer list the sequence; after the last one a Read of
//    it on its holder must match the appended pattern (wrong elements counted, as rpc_bench does).
//  - Then --reps cross-node CopyPrefix calls of the whole sequence from its holder into sequence 1
//    of the other node (emptied first, untimed), timed likewise and verified by a Read.
//  - Targets (issue 17): migrate and CopyPrefix medians >= 0.5 x raw TCP; the first migration
//    (into a cache that never held data on its node) within 2 x the median.
//  - Raw loopback TCP: (1) built in: a sender thread writes the same number of bytes through a
//    TCP socket on 127.0.0.1 to a receiver thread that reads them into a buffer (4 MiB buffers
//    on both sides, SO_SNDBUF/SO_RCVBUF left default), 5 reps on one connection; (2) iperf3 when
//    it is on PATH (`iperf3 -s -1` as a child, `iperf3 -c 127.0.0.1 -t 3 -J`, the receiver's
//    end.sum_received.bits_per_second).
//  - Prints a table: migrate GB/s (median, min, max over reps; payload = TransferStats.bytes)
//    by client wall clock and by the server's micros, raw TCP GB/s, and migrate/raw ratios.
//
// Nodes, client and the TCP threads share the machine's cores (2 on the reference VM).
// A plain main(), like rpc_bench. Exits non-zero on any failed call or wrong element.
//
//   migrate_bench [--reps=5] [--tokens=4096] [--node-flags="--flag=v --flag=v"] [--help]
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cache/spec.h"
#include "cache/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "kvmesh/v1/kvmesh.grpc.pb.h"
#include "service/common/convert.h"
#include "service/ctl/args.h"
#include "service/ctl/payload.h"
#include "tests/bench/tcp_reference.h"
#include "tests/testing/llama_spec.h"
#include "tests/testing/node_process.h"

namespace kvmesh {
namespace {

using Clock = std::chrono::steady_clock;

constexpr absl::string_view kFlags[] = {"reps", "tokens", "node-flags", "help"};
constexpr char kCacheName[] = "migrate-bench";
constexpr char kNodeNames[2][8] = {"bench-a", "bench-b"};
constexpr int64_t kSeq = 0;
constexpr int64_t kCopySeq = 1;  // the destination of the cross-node CopyPrefix phase
constexpr uint64_t kSeed = 7;
constexpr int32_t kAppendBatch = 512;  // tokens per AppendStream while filling node a
// AppendStream / Read chunks of the client (untimed): a message with its header fits the
// nodes' --max-message-bytes down to 256KiB (smaller values cap the migration's chunks too).
constexpr int64_t kChunkBytes = 128 << 10;
constexpr int kTcpReps = 5;  // built-in TCP reps (median)
constexpr int kIperfSeconds = 3;

struct Options {
  int reps = 5;
  int32_t tokens = 4096;
  std::string node_flags_text;
  std::vector<std::string> node_flags;
};

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

void SetDeadline(grpc::ClientContext* context, absl::Duration timeout) {
  context->set_deadline(std::chrono::system_clock::now() + absl::ToChronoMicroseconds(timeout));
}

std::string ErrorText(const grpc::Status& s) {
  return absl::StrCat(absl::StatusCodeToString(static_cast<absl::StatusCode>(s.error_code())), ": ",
                      s.error_message());
}

std::string LoadAverage() {
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  if (!(in >> a >> b >> c)) return "unknown";
  return absl::StrCat(a, " ", b, " ", c);
}

// CPU seconds (user + system) that process `pid` has used so far; -1 when unknown.
double CpuSeconds(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // Fields after the command name (which may hold spaces) start after the last ')'.
  const size_t paren = text.rfind(')');
  if (paren == std::string::npos) return -1;
  std::vector<absl::string_view> fields =
      absl::StrSplit(absl::string_view(text).substr(paren + 2), ' ', absl::SkipEmpty());
  // fields[0] is field 3 (state); utime and stime are fields 14 and 15.
  double utime = 0, stime = 0;
  if (fields.size() < 13 || !absl::SimpleAtod(fields[11], &utime) ||
      !absl::SimpleAtod(fields[12], &stime)) {
    return -1;
  }
  return (utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// ---- the two nodes -------------------------------------------------------------------------

struct Node {
  std::unique_ptr<testutil::NodeProcess> process;
  std::unique_ptr<v1::CacheService::Stub> stub;
  std::string name;
};

absl::Status StartNodes(const Options& o, const CacheSpec& spec, Node nodes[2]) {
  int ports[2];
  for (int i = 0; i < 2; ++i) {
    ports[i] = testutil::ReservePort();
    if (ports[i] == 0) return absl::UnavailableError("no free port on 127.0.0.1");
  }
  if (ports[0] == ports[1]) return absl::UnavailableError("ReservePort gave the same port twice");
  // The cache, plus the sender's snapshot of the sequence (pinned by its export) and the
  // receiver's import, with headroom; both pools allocate lazily on the host device.
  const size_t payload = AppendPayloadBytes(spec, o.tokens, 1);
  const size_t memory_budget = std::max<size_t>(size_t{1} << 30, CacheBytes(spec) + (256 << 20));
  const size_t snapshot_budget = std::max<size_t>(size_t{2} << 30, 2 * payload + (256 << 20));
  for (int i = 0; i < 2; ++i) {
    nodes[i].name = kNodeNames[i];
    testutil::NodeProcess::Options options;
    options.node_name = nodes[i].name;
    options.port = ports[i];
    options.extra_args = {
        absl::StrCat("--peers=", kNodeNames[1 - i], "=127.0.0.1:", ports[1 - i]),
        absl::StrCat("--memory-budget=", memory_budget),
        absl::StrCat("--snapshot-budget=", snapshot_budget),
    };
    // Given last, so that they override the bench's own flags.
    for (const std::string& f : o.node_flags) options.extra_args.push_back(f);
    absl::StatusOr<std::unique_ptr<testutil::NodeProcess>> started =
        testutil::NodeProcess::Start(options);
    if (!started.ok()) {
      return absl::Status(started.status().code(), absl::StrCat("starting ", nodes[i].name, ": ",
                                                                started.status().message()));
    }
    nodes[i].process = *std::move(started);
    nodes[i].stub = nodes[i].process->NewStub();
  }
  return absl::OkStatus();
}

absl::Status CreateCache(Node& node, const CacheSpec& spec) {
  grpc::ClientContext context;
  SetDeadline(&context, absl::Seconds(30));
  v1::CreateCacheRequest request;
  *request.mutable_spec() = SpecToProto(spec);
  v1::CreateCacheResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(node.stub->CreateCache(&context, request, &response)));
  if (!response.created()) {
    return absl::AlreadyExistsError(
        absl::StrCat("cache '", spec.name, "' already exists on ", node.name));
  }
  return absl::OkStatus();
}

// One AppendStream call: the header with the first chunk, then chunks of kChunkBytes.
grpc::Status AppendStream(Node& node, absl::Span<const int32_t> positions,
                          const std::string& payload) {
  grpc::ClientContext context;
  SetDeadline(&context, absl::Seconds(120));
  v1::AppendResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::AppendStreamRequest>> writer =
      node.stub->AppendStream(&context, &response);
  v1::AppendStreamRequest message;
  v1::AppendHeader* header = message.mutable_header();
  header->set_cache(kCacheName);
  for (int32_t p : positions) {
    v1::Token* t = header->add_tokens();
    t->set_seq(kSeq);
    t->set_pos(p);
  }
  header->set_payload_bytes(static_cast<int64_t>(payload.size()));
  size_t off = 0;
  do {
    const size_t n = std::min(payload.size() - off, static_cast<size_t>(kChunkBytes));
    message.set_data(payload.data() + off, n);
    off += n;
    if (!writer->Write(message)) break;  // the server ended the call; Finish says why
    message.clear_header();
  } while (off < payload.size());
  writer->WritesDone();
  return writer->Finish();
}

absl::Status Fill(Node& node, const CacheSpec& spec, int32_t tokens) {
  for (int32_t begin = 0; begin < tokens; begin += spec.max_batch) {
    const int32_t end = std::min(tokens, begin + spec.max_batch);
    std::vector<int32_t> positions;
    for (int32_t p = begin; p < end; ++p) positions.push_back(p);
    const grpc::Status s =
        AppendStream(node, positions, ctl::MakePatternPayload(spec, positions, kSeed));
    if (!s.ok()) {
      return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                          absl::StrCat("AppendStream of [", begin, ", ", end, ") on ", node.name,
                                       ": ", s.error_message()));
    }
  }
  return absl::OkStatus();
}

// Whether `node` lists sequence kSeq.
absl::StatusOr<bool> Holds(Node& node) {
  grpc::ClientContext context;
  SetDeadline(&context, absl::Seconds(30));
  v1::ListSequencesRequest request;
  request.set_cache(kCacheName);
  v1::ListSequencesResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(node.stub->ListSequences(&context, request, &response)));
  for (const v1::SequenceInfo& s : response.sequences()) {
    if (s.seq() == kSeq) return true;
  }
  return false;
}

// ---- migrations ----------------------------------------------------------------------------

struct MigrateRep {
  double wall_s = 0;
  int64_t bytes = 0;
  int64_t micros = 0;
  std::string transport;
};

// A transfer call's outcome: its status, or its wall time and what the node reported.
absl::StatusOr<MigrateRep> Timed(const grpc::Status& s, const std::string& what,
                                 Clock::duration wall, const v1::TransferStats& stats) {
  if (!s.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                        absl::StrCat(what, ": ", s.error_message()));
  }
  MigrateRep rep;
  rep.wall_s = Seconds(wall);
  rep.bytes = stats.bytes();
  rep.micros = stats.micros();
  rep.transport = stats.transport();
  return rep;
}

absl::StatusOr<MigrateRep> MigrateOnce(Node& from, Node& to) {
  grpc::ClientContext context;
  SetDeadline(&context, absl::Seconds(300));
  v1::MigrateRequest request;
  request.set_cache(kCacheName);
  request.set_seq(kSeq);
  request.set_target_node(to.name);
  request.set_target_seq(kSeq);
  request.set_keep_source(false);
  v1::MigrateResponse response;
  const Clock::time_point start = Clock::now();
  const grpc::Status s = from.stub->Migrate(&context, request, &response);
  return Timed(s, absl::StrCat("Migrate ", from.name, " -> ", to.name), Clock::now() - start,
               response.transfer());
}

// A cross-node CopyPrefix of `tokens` tokens of kSeq on `source` into kCopySeq on `dest`, timed
// on the client; kCopySeq is emptied first (untimed), so that the copy finds its cells free.
absl::StatusOr<MigrateRep> CopyOnce(Node& source, Node& dest, int32_t tokens) {
  {
    grpc::ClientContext context;
    SetDeadline(&context, absl::Seconds(60));
    v1::RemoveRequest request;
    request.set_cache(kCacheName);
    request.set_seq(kCopySeq);
    request.set_begin(0);
    v1::RemoveResponse response;
    const grpc::Status s = dest.stub->Remove(&context, request, &response);
    if (!s.ok()) {
      return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                          absl::StrCat("Remove on ", dest.name, ": ", s.error_message()));
    }
  }
  grpc::ClientContext context;
  SetDeadline(&context, absl::Seconds(300));
  v1::CopyPrefixRequest request;
  request.set_cache(kCacheName);
  request.set_src_seq(kSeq);
  request.set_dst_seq(kCopySeq);
  request.set_length(tokens);
  request.set_source_node(source.name);
  v1::CopyPrefixResponse response;
  const Clock::time_point start = Clock::now();
  const grpc::Status s = dest.stub->CopyPrefix(&context, request, &response);
  return Timed(s, absl::StrCat("CopyPrefix ", source.name, " -> ", dest.name), Clock::now() - start,
               response.transfer());
}

// Reads sequence `seq` from `node` and compares it with the pattern; the wrong elements.
absl::StatusOr<ctl::PatternCheck> Verify(Node& node, const CacheSpec& spec, int32_t tokens,
                                         double* read_s, int64_t seq = kSeq) {
  grpc::ClientContext context;
  SetDeadline(&context, absl::Seconds(300));
  v1::ReadRequest request;
  request.set_cache(kCacheName);
  request.set_seq(seq);
  request.set_max_chunk_bytes(static_cast<int32_t>(kChunkBytes));
  std::string received;
  received.reserve(AppendPayloadBytes(spec, tokens, 1));
  v1::ReadResponse message;
  v1::ReadHeader header;
  bool have_header = false;
  const Clock::time_point start = Clock::now();
  auto reader = node.stub->Read(&context, request);
  while (reader->Read(&message)) {
    if (message.has_header()) {
      header = message.header();
      have_header = true;
    }
    received.append(message.data());
  }
  const grpc::Status s = reader->Finish();
  *read_s = Seconds(Clock::now() - start);
  if (!s.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                        absl::StrCat("Read on ", node.name, ": ", s.error_message()));
  }
  if (!have_header) return absl::DataLossError(absl::StrCat("Read on ", node.name, ": no header"));
  std::vector<std::vector<int32_t>> got(spec.groups.size());
  for (const v1::GroupPositions& g : header.groups()) {
    if (g.group() >= 0 && g.group() < static_cast<int>(got.size())) {
      got[g.group()].assign(g.positions().begin(), g.positions().end());
    }
  }
  for (size_t g = 0; g < got.size(); ++g) {
    bool all = got[g].size() == static_cast<size_t>(tokens);
    for (int32_t i = 0; all && i < tokens; ++i) all = got[g][i] == i;
    if (!all) {
      return absl::DataLossError(absl::StrCat("Read on ", node.name, ": group ", g, " returned ",
                                              got[g].size(), " positions, not [0, ", tokens, ")"));
    }
  }
  return ctl::CheckPatternPayload(
      spec, got,
      absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(received.data()), received.size()),
      kSeed);
}

// ---- raw loopback TCP ----------------------------------------------------------------------

// The path of `name` on PATH, or "" when it is not there.
std::string FindOnPath(const std::string& name) {
  const char* path = std::getenv("PATH");
  if (path == nullptr) return "";
  for (absl::string_view dir : absl::StrSplit(path, ':', absl::SkipEmpty())) {
    std::string candidate = absl::StrCat(dir, "/", name);
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

// `iperf3 -s -1 -p PORT` as a child (killed with this process), then the client against it;
// end.sum_received.bits_per_second of the client's JSON, in bytes/s.
absl::StatusOr<double> Iperf3(const std::string& iperf3) {
  const int port = testutil::ReservePort();
  if (port == 0) return absl::UnavailableError("no free port for iperf3");
  const std::string port_text = absl::StrCat(port);
  std::vector<std::string> server_args = {iperf3, "-s", "-1", "-p", port_text};
  std::vector<char*> argv;
  for (std::string& a : server_args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t server = fork();
  if (server < 0) return testutil::ErrnoStatus("fork");
  if (server == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    const int devnull = open("/dev/null", O_RDWR);
    if (devnull >= 0) {
      dup2(devnull, STDIN_FILENO);
      dup2(devnull, STDOUT_FILENO);
      dup2(devnull, STDERR_FILENO);
    }
    execv(argv[0], argv.data());
    _exit(127);
  }
  std::string json;
  absl::Status status;
  const std::string client =
      absl::StrCat(iperf3, " -c 127.0.0.1 -p ", port, " -t ", kIperfSeconds, " -J 2>&1");
  // The server may not listen yet: retry while the client cannot connect.
  for (int attempt = 0; attempt < 50; ++attempt) {
    json.clear();
    FILE* f = popen(client.c_str(), "r");
    if (f == nullptr) {
      status = testutil::ErrnoStatus("popen iperf3 client");
      break;
    }
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof(buf), f)) > 0) json.append(buf, n);
    const int rc = pclose(f);
    if (rc == 0 && json.find("\"sum_received\"") != std::string::npos) break;
    status = absl::InternalError(
        absl::StrCat("iperf3 client exited with status ", rc, ": ", json.substr(0, 400)));
    if (json.find("connect") == std::string::npos) break;  // not "unable to connect": give up
    absl::SleepFor(absl::Milliseconds(100));
  }
  // The server exits after one test; make sure it does.
  int wstatus = 0;
  bool reaped = false;
  for (int i = 0; i < 50 && !reaped; ++i) {
    reaped = waitpid(server, &wstatus, WNOHANG) == server;
    if (!reaped) absl::SleepFor(absl::Milliseconds(100));
  }
  if (!reaped) {
    kill(server, SIGKILL);
    waitpid(server, &wstatus, 0);
  }
  const size_t sum = json.find("\"sum_received\"");
  if (sum == std::string::npos) {
    return status.ok() ? absl::InternalError("iperf3 JSON has no end.sum_received") : status;
  }
  const size_t key = json.find("\"bits_per_second\"", sum);
  const size_t colon = key == std::string::npos ? key : json.find(':', key);
  if (colon == std::string::npos) {
    return absl::InternalError("iperf3 JSON: no bits_per_second in end.sum_received");
  }
  const double bits = std::strtod(json.c_str() + colon + 1, nullptr);
  if (!(bits > 0)) return absl::InternalError("iperf3 JSON: bits_per_second is not positive");
  return bits / 8;
}

// ---- report --------------------------------------------------------------------------------

struct Stats {
  double median = 0, min = 0, max = 0;
};

Stats Summarize(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  Stats s;
  if (v.empty()) return s;
  s.min = v.front();
  s.max = v.back();
  s.median = v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
  return s;
}

std::string Ratio(double num, std::optional<double> den) {
  if (!den.has_value() || *den <= 0 || num <= 0) return "-";
  return absl::StrFormat("%.2f", num / *den);
}

void PrintRow(const char* what, const Stats& s, std::optional<double> tcp_builtin,
              std::optional<double> tcp_iperf) {
  std::printf("%-44s %8.2f %8.2f %8.2f %12s %12s\n", what, s.median, s.min, s.max,
              Ratio(s.median, tcp_builtin).c_str(), Ratio(s.median, tcp_iperf).c_str());
}

absl::StatusOr<Options> ParseOptions(int argc, char** argv) {
  ASSIGN_OR_RETURN(ctl::Args args, ctl::Args::Parse(argc, argv, {}));
  RETURN_IF_ERROR(args.CheckAllowed(kFlags));
  if (!args.command().empty()) {
    return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", args.command(), "'"));
  }
  Options o;
  ASSIGN_OR_RETURN(int64_t reps, args.GetInt("reps", o.reps));
  ASSIGN_OR_RETURN(int64_t tokens, args.GetInt("tokens", o.tokens));
  ASSIGN_OR_RETURN(o.node_flags_text, args.GetString("node-flags", ""));
  if (reps < 1 || reps > 1000) {
    return absl::InvalidArgumentError(absl::StrCat("--reps=", reps, " is not in [1, 1000]"));
  }
  if (tokens < 1 || tokens > 65536) {
    return absl::InvalidArgumentError(absl::StrCat("--tokens=", tokens, " is not in [1, 65536]"));
  }
  o.reps = static_cast<int>(reps);
  o.tokens = static_cast<int32_t>(tokens);
  for (absl::string_view f :
       absl::StrSplit(o.node_flags_text, absl::ByAnyChar(" \t\n"), absl::SkipEmpty())) {
    if (!absl::StartsWith(f, "--")) {
      return absl::InvalidArgumentError(
          absl::StrCat("--node-flags: '", f, "' is not a --flag[=value]"));
    }
    o.node_flags.emplace_back(f);
  }
  return o;
}

constexpr char kUsage[] =
    "usage: migrate_bench [--reps=5] [--tokens=4096] [--node-flags=\"--flag=v ...\"]\n"
    "Starts kvmesh-node bench-a and bench-b on 127.0.0.1, appends --tokens tokens of a\n"
    "Llama-3-8B-shaped sequence (128 KiB per token) on bench-a, migrates it a -> b -> a ...\n"
    "--reps times (keep_source=false) and compares the GB/s with raw loopback TCP (built in,\n"
    "and iperf3 when it is installed). --node-flags are passed to both nodes, after the bench's\n"
    "own (--peers, --memory-budget, --snapshot-budget), e.g. "
    "--node-flags=\"--transport=grpc-stream\".\n";

int Main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (absl::string_view(argv[i]) == "--help" || absl::string_view(argv[i]) == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
  }
  absl::StatusOr<Options> parsed = ParseOptions(argc, argv);
  if (!parsed.ok()) {
    std::fprintf(stderr, "migrate_bench: %s\n%s", std::string(parsed.status().message()).c_str(),
                 kUsage);
    return 2;
  }
  const Options& o = *parsed;
  const CacheSpec spec = testutil::Llama3_8BSpec(kCacheName, /*max_sequences=*/1,
                                                 /*capacity=*/std::max(o.tokens, 4096),
                                                 /*max_batch=*/std::min(o.tokens, kAppendBatch));
  const size_t payload_bytes = AppendPayloadBytes(spec, o.tokens, 1);

  std::printf(
      "kvmesh migrate_bench: 2 kvmesh-node processes on 127.0.0.1, grpc-stream transport\n");
  std::printf(
      "machine: nproc %ld (both nodes, the client and the TCP threads share it); "
      "load average at start: %s\n",
      sysconf(_SC_NPROCESSORS_ONLN), LoadAverage().c_str());
  std::printf(
      "sequence: Llama-3-8B KV shape (32 layers x 8 KV heads x 128, F16), %d tokens x "
      "%zu KiB = %.1f MiB of K/V\n",
      o.tokens, AppendPayloadBytes(spec, 1, 1) >> 10, payload_bytes / 1048576.0);
  std::printf("node flags: %s\n\n",
              o.node_flags.empty() ? "(none beyond the bench's)" : o.node_flags_text.c_str());
  std::fflush(stdout);

  Node nodes[2];
  if (absl::Status s = StartNodes(o, spec, nodes); !s.ok()) {
    std::fprintf(stderr, "migrate_bench: %s\n", s.ToString().c_str());
    return 1;
  }
  bool failed = false;
  auto fail = [&](const absl::Status& s) {
    std::fprintf(stderr, "migrate_bench: %s\n", s.ToString().c_str());
    failed = true;
  };
  for (Node& n : nodes) {
    if (absl::Status s = CreateCache(n, spec); !s.ok()) fail(s);
  }
  if (!failed) {
    const Clock::time_point start = Clock::now();
    if (absl::Status s = Fill(nodes[0], spec, o.tokens); !s.ok()) {
      fail(s);
    } else {
      const double t = Seconds(Clock::now() - start);
      std::printf(
          "filled %s: %d tokens in %.2f s (AppendStream, %d-token calls, %lld KiB chunks)\n\n",
          nodes[0].name.c_str(), o.tokens, t, spec.max_batch,
          static_cast<long long>(kChunkBytes >> 10));
    }
  }

  // Migrations.
  std::vector<double> wall_gbps, server_gbps, wall_ms, server_ms;
  int holder = 0;
  if (!failed) {
    std::printf(
        "wall: the Migrate call on the client; server: TransferStats.micros (export request to "
        "commit on the receiver); other: wall - server (Pull/Restore/Remove, RPC hops); cpu: "
        "CPU time of each node's process during the call\n");
    std::printf("%-4s %-18s %9s %9s %8s %10s %11s %10s %10s %10s\n", "rep", "migrate", "wall ms",
                "server ms", "other ms", "bytes", "GB/s wall", "GB/s srv", "cpu src ms",
                "cpu dst ms");
    for (int rep = 0; rep < o.reps; ++rep) {
      Node& from = nodes[holder];
      Node& to = nodes[1 - holder];
      const double cpu_from = CpuSeconds(from.process->pid());
      const double cpu_to = CpuSeconds(to.process->pid());
      absl::StatusOr<MigrateRep> r = MigrateOnce(from, to);
      if (!r.ok()) {
        fail(r.status());
        break;
      }
      const double used_from = CpuSeconds(from.process->pid()) - cpu_from;
      const double used_to = CpuSeconds(to.process->pid()) - cpu_to;
      holder = 1 - holder;
      const double server_s = r->micros / 1e6;
      std::printf("%-4d %-18s %9.1f %9.1f %8.1f %10" PRId64 " %11.2f %10.2f %10.0f %10.0f  %s\n",
                  rep + 1, absl::StrCat(from.name, " -> ", to.name).c_str(), r->wall_s * 1e3,
                  server_s * 1e3, (r->wall_s - server_s) * 1e3, r->bytes,
                  r->bytes / r->wall_s / 1e9, server_s > 0 ? r->bytes / server_s / 1e9 : 0.0,
                  used_from * 1e3, used_to * 1e3, r->transport.c_str());
      std::fflush(stdout);
      wall_ms.push_back(r->wall_s * 1e3);
      server_ms.push_back(server_s * 1e3);
      wall_gbps.push_back(r->bytes / r->wall_s / 1e9);
      if (server_s > 0) server_gbps.push_back(r->bytes / server_s / 1e9);
      if (r->bytes < static_cast<int64_t>(payload_bytes)) {
        fail(absl::DataLossError(absl::StrCat("TransferStats.bytes = ", r->bytes,
                                              " is less than the K/V payload of ", payload_bytes)));
        break;
      }
      // keep_source=false: the source must not hold the sequence any more.
      absl::StatusOr<bool> still = Holds(from);
      if (!still.ok() || *still) {
        fail(still.ok() ? absl::InternalError(absl::StrCat(from.name, " still lists sequence ",
                                                           kSeq, " after the migration"))
                        : still.status());
        break;
      }
    }
  }

  // Verify what arrived last.
  if (!failed) {
    double read_s = 0;
    absl::StatusOr<ctl::PatternCheck> check = Verify(nodes[holder], spec, o.tokens, &read_s);
    if (!check.ok()) {
      fail(check.status());
    } else {
      const std::string first =
          check->mismatches ? absl::StrCat(" (first at ", check->first_mismatch, ")") : "";
      std::printf("\nverify: Read of sequence %" PRId64
                  " on %s (%.0f ms): wrong elements: %zu of %zu%s\n",
                  kSeq, nodes[holder].name.c_str(), read_s * 1e3, check->mismatches,
                  check->elements, first.c_str());
      if (check->mismatches != 0) failed = true;
    }
  }

  // Cross-node CopyPrefix of the whole sequence from its holder to the other node.
  std::vector<double> copy_gbps, copy_ms;
  if (!failed) {
    Node& source = nodes[holder];
    Node& dest = nodes[1 - holder];
    std::printf(
        "\ncross-node CopyPrefix of %d tokens, %s -> %s (destination emptied first, "
        "untimed)\n",
        o.tokens, source.name.c_str(), dest.name.c_str());
    std::printf("%-4s %9s %9s %10s %11s %10s %10s\n", "rep", "wall ms", "server ms", "bytes",
                "GB/s wall", "cpu src ms", "cpu dst ms");
    for (int rep = 0; rep < o.reps; ++rep) {
      const double cpu_from = CpuSeconds(source.process->pid());
      const double cpu_to = CpuSeconds(dest.process->pid());
      absl::StatusOr<MigrateRep> r = CopyOnce(source, dest, o.tokens);
      if (!r.ok()) {
        fail(r.status());
        break;
      }
      std::printf("%-4d %9.1f %9.1f %10" PRId64 " %11.2f %10.0f %10.0f  %s\n", rep + 1,
                  r->wall_s * 1e3, r->micros / 1e3, r->bytes, r->bytes / r->wall_s / 1e9,
                  (CpuSeconds(source.process->pid()) - cpu_from) * 1e3,
                  (CpuSeconds(dest.process->pid()) - cpu_to) * 1e3, r->transport.c_str());
      std::fflush(stdout);
      copy_ms.push_back(r->wall_s * 1e3);
      copy_gbps.push_back(r->bytes / r->wall_s / 1e9);
    }
    if (!failed) {
      double read_s = 0;
      absl::StatusOr<ctl::PatternCheck> check = Verify(dest, spec, o.tokens, &read_s, kCopySeq);
      if (!check.ok()) {
        fail(check.status());
      } else {
        std::printf("verify: Read of sequence %" PRId64 " on %s: wrong elements: %zu of %zu\n",
                    kCopySeq, dest.name.c_str(), check->mismatches, check->elements);
        if (check->mismatches != 0) failed = true;
      }
    }
  }

  // Raw loopback TCP, in the same run (the nodes stay up, idle).
  std::optional<double> tcp_builtin, tcp_iperf;
  Stats builtin_stats;
  if (!failed) {
    absl::StatusOr<std::vector<double>> tcp = testutil::LoopbackTcpSeconds(payload_bytes, kTcpReps);
    if (!tcp.ok()) {
      fail(absl::Status(tcp.status().code(),
                        absl::StrCat("built-in TCP: ", tcp.status().message())));
    } else {
      std::vector<double> gbps;
      for (double s : *tcp) gbps.push_back(payload_bytes / s / 1e9);
      builtin_stats = Summarize(gbps);
      tcp_builtin = builtin_stats.median;
      std::printf("\nraw TCP, built in: %zu bytes per rep, 4 MiB send/recv buffers, GB/s:",
                  payload_bytes);
      for (double g : gbps) std::printf(" %.2f", g);
      std::printf("\n");
    }
    const std::string iperf3 = FindOnPath("iperf3");
    if (iperf3.empty()) {
      std::printf("raw TCP, iperf3: not installed (scripts/bootstrap.sh installs it)\n");
    } else {
      absl::StatusOr<double> bytes_per_s = Iperf3(iperf3);
      if (!bytes_per_s.ok()) {
        fail(absl::Status(bytes_per_s.status().code(),
                          absl::StrCat("iperf3: ", bytes_per_s.status().message())));
      } else {
        tcp_iperf = *bytes_per_s / 1e9;
        std::printf("raw TCP, iperf3 (%s -c 127.0.0.1 -t %d, end.sum_received): %.2f GB/s\n",
                    iperf3.c_str(), kIperfSeconds, *tcp_iperf);
      }
    }
  }

  if (!wall_gbps.empty()) {
    std::printf("\nsummary: GB/s = 10^9 B/s; migrate payload = TransferStats.bytes; %zu reps\n",
                wall_gbps.size());
    std::printf("%-44s %8s %8s %8s %12s %12s\n", "", "median", "min", "max", "/ TCP built-in",
                "/ iperf3");
    PrintRow("migrate, client wall clock (GB/s)", Summarize(wall_gbps), tcp_builtin, tcp_iperf);
    PrintRow("migrate, server TransferStats.micros (GB/s)", Summarize(server_gbps), tcp_builtin,
             tcp_iperf);
    if (tcp_builtin.has_value()) {
      std::printf("%-44s %8.2f %8.2f %8.2f\n", "raw TCP, built in (GB/s)", builtin_stats.median,
                  builtin_stats.min, builtin_stats.max);
    }
    if (tcp_iperf.has_value()) {
      std::printf("%-44s %8.2f %8s %8s\n", "raw TCP, iperf3 (GB/s)", *tcp_iperf, "-", "-");
    }
    const Stats wall = Summarize(wall_ms), server = Summarize(server_ms);
    std::printf("%-44s %8.1f %8.1f %8.1f\n", "migrate, client wall clock (ms)", wall.median,
                wall.min, wall.max);
    std::printf("%-44s %8.1f %8.1f %8.1f\n", "migrate, server TransferStats.micros (ms)",
                server.median, server.min, server.max);
    if (!copy_gbps.empty()) {
      PrintRow("cross-node CopyPrefix, client wall clock (GB/s)", Summarize(copy_gbps), tcp_builtin,
               tcp_iperf);
      const Stats copy = Summarize(copy_ms);
      std::printf("%-44s %8.1f %8.1f %8.1f\n", "cross-node CopyPrefix, client wall clock (ms)",
                  copy.median, copy.min, copy.max);
    }
    const double migrate = Summarize(wall_gbps).median;
    for (const auto& [name, raw] :
         {std::pair<const char*, std::optional<double>>{"raw TCP built in", tcp_builtin},
          {"iperf3", tcp_iperf}}) {
      if (!raw.has_value()) continue;
      std::printf("target: migrate (wall, median) >= 0.5 x %s: %s (%s)\n", name,
                  migrate >= 0.5 * *raw ? "met" : "NOT met", Ratio(migrate, raw).c_str());
      if (copy_gbps.empty()) continue;
      const double copy = Summarize(copy_gbps).median;
      std::printf("target: cross-node CopyPrefix (wall, median) >= 0.5 x %s: %s (%s)\n", name,
                  copy >= 0.5 * *raw ? "met" : "NOT met", Ratio(copy, raw).c_str());
    }
    // The first migration goes into a cache that has never held data on that node.
    const double first = wall_ms.front();
    std::printf("target: first migration (wall) <= 2 x median: %s (%.2f x, %.1f ms vs %.1f ms)\n",
                first <= 2 * wall.median ? "met" : "NOT met", first / wall.median, first,
                wall.median);
  }
  std::printf("load average at end: %s\n", LoadAverage().c_str());

  for (Node& n : nodes) {
    if (n.process == nullptr) continue;
    grpc::ClientContext context;
    SetDeadline(&context, absl::Seconds(30));
    v1::DeleteCacheRequest request;
    request.set_cache(kCacheName);
    v1::DeleteCacheResponse response;
    const grpc::Status s = n.stub->DeleteCache(&context, request, &response);
    if (!s.ok() && s.error_code() != grpc::StatusCode::NOT_FOUND) {
      fail(absl::InternalError(absl::StrCat("DeleteCache on ", n.name, ": ", ErrorText(s))));
    }
    n.stub.reset();
    n.process->ReleaseChannel();
  }
  for (Node& n : nodes) {
    if (n.process == nullptr) continue;
    const testutil::ExitStatus exit = n.process->Stop();
    if (!exit.clean()) {
      fail(absl::InternalError(
          absl::StrCat("kvmesh-node ", n.name, " did not exit cleanly: ", exit.ToString())));
    }
  }
  return failed ? 1 : 0;
}

}  // namespace
}  // namespace kvmesh

int main(int argc, char** argv) { return kvmesh::Main(argc, argv); }

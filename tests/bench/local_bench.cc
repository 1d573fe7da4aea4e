// The local data path's bandwidth (docs/api.md#local-data-path): a worker writes the KV of a
// Llama-3-8B-shaped prompt (32 layers, 8 KV heads of 128, F16: 128 KiB a token) straight into a
// kvmesh-node's cells and reads it back in place, against a memcpy of the same bytes in the same
// process, and against the same transfer over gRPC (AppendStream and Read), all in one run.
//
//   local_bench [--tokens=N (8192: 1 GiB)] [--reps=N (3)]
//
// Prints, per repetition and as medians:
//   attach: X s                           Attach, which maps every page of the cache at once
//   local write: X GB/s = R of memcpy     BeginAppend, rows copied into the planned cells (one
//                                         local::CopyRows per run of consecutive cells), commit
//   local read: X GB/s = R of memcpy      Pin, rows copied out of the pinned cells
//                                         (local::CopyRows), Unpin
//   grpc append: X GB/s = R of memcpy     AppendStream of the payload (4 MiB messages)
//   grpc read: X GB/s = R of memcpy       Read of the sequence (payload copied out)
// with the bench process's CPU seconds per GiB beside each (the node's for gRPC), and the load
// average. The sequence is removed between repetitions; cells (and their pages) are reused.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "clients/cpp/kvmesh_local.h"
#include "grpcpp/grpcpp.h"
#include "kvmesh/v1/kvmesh.grpc.pb.h"
#include "service/common/bulk_client.h"
#include "tests/testing/node_process.h"

namespace kvmesh {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kLayers = 32;
constexpr int kPlanes = 2 * kLayers;
constexpr size_t kRowBytes = 8 * 128 * 2;  // one plane's row: 8 heads x 128 dims, F16

struct Flags {
  int32_t tokens = 8192;
  int reps = 3;
};

Flags ParseFlags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    int64_t v = 0;
    if (absl::ConsumePrefix(&arg, "--tokens=") && absl::SimpleAtoi(arg, &v) && v > 0 &&
        v <= 65536) {
      f.tokens = static_cast<int32_t>(v);
    } else if (absl::ConsumePrefix(&arg, "--reps=") && absl::SimpleAtoi(arg, &v) && v > 0) {
      f.reps = static_cast<int>(v);
    } else {
      std::fprintf(stderr, "usage: local_bench [--tokens=N (1..65536)] [--reps=N]\n");
      std::exit(2);
    }
  }
  return f;
}

void Check(const absl::Status& status, const char* what) {
  if (status.ok()) return;
  std::fprintf(stderr, "local_bench: %s: %s\n", what, status.ToString().c_str());
  std::exit(1);
}

double CpuSeconds() {
  rusage usage;
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_utime.tv_sec + usage.ru_stime.tv_sec +
         (usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) / 1e6;
}

// utime + stime of `pid` in seconds (/proc/<pid>/stat).
double ProcessCpuSeconds(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return 0;
  std::vector<std::string> fields;
  std::string field;
  for (char c : stat.substr(close + 2)) {
    if (c == ' ') {
      fields.push_back(field);
      field.clear();
    } else {
      field += c;
    }
  }
  // Fields after the name start at 3 (state); utime is field 14, stime 15.
  if (fields.size() < 13) return 0;
  return (std::stod(fields[11]) + std::stod(fields[12])) / sysconf(_SC_CLK_TCK);
}

std::string LoadAverage() {
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  in >> a >> b >> c;
  return absl::StrCat(a, " ", b, " ", c);
}

// Tokens first, first + 1, ... whose cells are cell, cell + 1, ...: one copy each, as an engine
// copies a block of consecutive cells.
struct CellRun {
  int32_t first = 0;
  int32_t cell = 0;
  int32_t length = 0;
};
std::vector<CellRun> Runs(const std::vector<int32_t>& cells) {
  std::vector<CellRun> runs;
  for (int32_t i = 0; i < static_cast<int32_t>(cells.size()); ++i) {
    if (!runs.empty() && cells[i] == runs.back().cell + runs.back().length &&
        i == runs.back().first + runs.back().length) {
      ++runs.back().length;
    } else {
      runs.push_back({i, cells[i], 1});
    }
  }
  return runs;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Measure {
  std::vector<double> gbps;
  std::vector<double> cpu_per_gib;
};

int Run(const Flags& flags) {
  const size_t bytes = static_cast<size_t>(flags.tokens) * kPlanes * kRowBytes;
  const double gib = static_cast<double>(bytes) / (1 << 30);
  std::printf(
      "local_bench: %d tokens of a Llama-3-8B-shaped cache (F16), %.3f GiB, %d reps; "
      "load average %s\n",
      flags.tokens, gib, flags.reps, LoadAverage().c_str());

  char dir_template[] = "/tmp/kvmesh-local-bench-XXXXXX";
  if (mkdtemp(dir_template) == nullptr) return 1;
  const std::string socket_path = absl::StrCat(dir_template, "/local.sock");
  testutil::NodeProcess::Options options;
  options.node_name = "local-bench";
  options.extra_args = {absl::StrCat("--local-socket=", socket_path),
                        absl::StrCat("--memory-budget=", bytes + (size_t{64} << 20)),
                        "--snapshot-budget=64MiB",
                        absl::StrCat("--max-message-bytes=", size_t{16} << 20)};
  absl::StatusOr<std::unique_ptr<testutil::NodeProcess>> node =
      testutil::NodeProcess::Start(options);
  Check(node.status(), "starting kvmesh-node");
  std::shared_ptr<grpc::Channel> channel = (*node)->channel();
  std::unique_ptr<v1::CacheService::Stub> stub = v1::CacheService::NewStub(channel);

  v1::CreateCacheRequest create;
  v1::CacheSpec* spec = create.mutable_spec();
  spec->set_name("llama");
  spec->set_dtype(v1::DTYPE_F16);
  spec->set_max_sequences(1);
  spec->set_capacity(flags.tokens);
  spec->set_max_batch(flags.tokens);
  v1::LayerGroup* group = spec->add_groups();
  group->set_num_layers(kLayers);
  group->mutable_attention()->set_num_kv_heads(8);
  group->mutable_attention()->set_head_dim_k(128);
  group->mutable_attention()->set_head_dim_v(128);
  {
    grpc::ClientContext context;
    v1::CreateCacheResponse response;
    const grpc::Status s = stub->CreateCache(&context, create, &response);
    if (!s.ok()) {
      std::fprintf(stderr, "CreateCache: %s\n", s.error_message().c_str());
      return 1;
    }
  }
  absl::StatusOr<std::unique_ptr<local::Session>> session = local::Session::Connect(socket_path);
  Check(session.status(), "local session");
  const Clock::time_point attach_start = Clock::now();
  absl::StatusOr<std::unique_ptr<local::MappedCache>> cache = (*session)->Attach("llama");
  Check(cache.status(), "Attach");
  const double attach_seconds = std::chrono::duration<double>(Clock::now() - attach_start).count();

  // The payload: for each plane, a row per token (payload layout), every byte written.
  auto source = std::make_shared<std::string>(bytes, '\0');
  for (size_t i = 0; i < bytes; i += 8) {
    const uint64_t v = i * 0x9e3779b97f4a7c15ull;
    std::memcpy(source->data() + i, &v, 8);
  }
  std::string sink(bytes, '\0');
  std::memset(sink.data(), 1, bytes);
  const std::vector<int64_t> seqs(flags.tokens, 0);
  std::vector<int32_t> positions(flags.tokens);
  for (int32_t i = 0; i < flags.tokens; ++i) positions[i] = i;

  auto remove = [&] {
    grpc::ClientContext context;
    v1::RemoveRequest request;
    request.set_cache("llama");
    request.set_seq(0);
    v1::RemoveResponse response;
    (void)stub->Remove(&context, request, &response);
  };

  Measure memcpy_m, write_m, read_m, grpc_append_m, grpc_read_m;
  auto record = [&](Measure* m, double seconds, double cpu) {
    m->gbps.push_back(static_cast<double>(bytes) / seconds / 1e9);
    m->cpu_per_gib.push_back(cpu / gib);
  };
  for (int rep = 0; rep < flags.reps; ++rep) {
    // memcpy of the same bytes, the reference.
    double cpu = CpuSeconds();
    Clock::time_point start = Clock::now();
    std::memcpy(sink.data(), source->data(), bytes);
    record(&memcpy_m, std::chrono::duration<double>(Clock::now() - start).count(),
           CpuSeconds() - cpu);

    // Local write: plan, rows into their cells, commit.
    cpu = CpuSeconds();
    start = Clock::now();
    absl::StatusOr<local::AppendPlan> plan = (*session)->BeginAppend("llama", seqs, positions);
    Check(plan.status(), "BeginAppend");
    const std::vector<int32_t>& cells = plan->cells[0];
    const std::vector<CellRun> write_runs = Runs(cells);
    for (int p = 0; p < kPlanes; ++p) {
      const char* rows = source->data() + static_cast<size_t>(p) * flags.tokens * kRowBytes;
      for (const CellRun& run : write_runs) {
        local::CopyRows((*cache)->Row(0, p, run.cell),
                        rows + static_cast<size_t>(run.first) * kRowBytes,
                        static_cast<size_t>(run.length) * kRowBytes);
      }
    }
    Check((*session)->CommitAppend(plan->id), "CommitAppend");
    record(&write_m, std::chrono::duration<double>(Clock::now() - start).count(),
           CpuSeconds() - cpu);

    // Local read: pin, rows out of their cells, unpin.
    cpu = CpuSeconds();
    start = Clock::now();
    absl::StatusOr<local::Pin> pin = (*session)->PinCells("llama", 0, 0, std::nullopt);
    Check(pin.status(), "Pin");
    const std::vector<CellRun> read_runs = Runs(pin->cells[0]);
    for (int p = 0; p < kPlanes; ++p) {
      char* rows = sink.data() + static_cast<size_t>(p) * flags.tokens * kRowBytes;
      for (const CellRun& run : read_runs) {
        local::CopyRows(rows + static_cast<size_t>(run.first) * kRowBytes,
                        (*cache)->Row(0, p, run.cell), static_cast<size_t>(run.length) * kRowBytes);
      }
    }
    Check((*session)->Unpin(pin->id), "Unpin");
    record(&read_m, std::chrono::duration<double>(Clock::now() - start).count(),
           CpuSeconds() - cpu);
    if (std::memcmp(sink.data(), source->data(), bytes) != 0) {
      std::fprintf(stderr, "local_bench: the bytes read in place differ from those written\n");
      return 1;
    }
    remove();

    // gRPC AppendStream of the same payload; the node's CPU.
    v1::AppendHeader header;
    header.set_cache("llama");
    header.set_payload_bytes(static_cast<int64_t>(bytes));
    v1::TokenRange* range = header.add_token_ranges();
    range->set_seq(0);
    range->set_first(0);
    range->set_count(flags.tokens);
    double node_cpu = ProcessCpuSeconds((*node)->pid());
    start = Clock::now();
    {
      grpc::ClientContext context;
      v1::AppendResponse response;
      Check(SendAppendStream(channel.get(), &context, header, source, size_t{4} << 20, &response),
            "AppendStream");
    }
    record(&grpc_append_m, std::chrono::duration<double>(Clock::now() - start).count(),
           ProcessCpuSeconds((*node)->pid()) - node_cpu);

    // gRPC Read of it.
    node_cpu = ProcessCpuSeconds((*node)->pid());
    start = Clock::now();
    {
      grpc::ClientContext context;
      v1::ReadRequest request;
      request.set_cache("llama");
      request.set_seq(0);
      v1::ReadHeader read_header;
      size_t at = 0;
      Check(ReceiveReadStream(channel.get(), &context, request, &read_header,
                              [&](absl::Span<const uint8_t> piece) {
                                std::memcpy(sink.data() + at, piece.data(), piece.size());
                                at += piece.size();
                              }),
            "Read");
    }
    record(&grpc_read_m, std::chrono::duration<double>(Clock::now() - start).count(),
           ProcessCpuSeconds((*node)->pid()) - node_cpu);
    remove();
    std::printf(
        "rep %d: memcpy %.2f GB/s, local write %.2f, local read %.2f, grpc append %.2f, "
        "grpc read %.2f\n",
        rep + 1, memcpy_m.gbps.back(), write_m.gbps.back(), read_m.gbps.back(),
        grpc_append_m.gbps.back(), grpc_read_m.gbps.back());
  }
  const double reference = Median(memcpy_m.gbps);
  std::printf("attach: %.3f s (maps every page of the fresh cache's %.3f GiB)\n", attach_seconds,
              gib);
  std::printf("memcpy: %.2f GB/s (median of %d; %.2f CPU s/GiB)\n", reference, flags.reps,
              Median(memcpy_m.cpu_per_gib));
  auto line = [&](const char* what, const Measure& m, const char* cpu_of) {
    std::printf("%s: %.2f GB/s = %.2f of memcpy (median of %d; %.2f CPU s/GiB of %s)\n", what,
                Median(m.gbps), Median(m.gbps) / reference, flags.reps, Median(m.cpu_per_gib),
                cpu_of);
  };
  line("local write", write_m, "the worker");
  line("local read", read_m, "the worker");
  line("grpc append", grpc_append_m, "the node");
  line("grpc read", grpc_read_m, "the node");
  std::printf("load average after: %s\n", LoadAverage().c_str());
  session->reset();
  cache->reset();
  stub.reset();
  channel.reset();
  (*node)->ReleaseChannel();
  (*node)->Stop();
  return 0;
}

}  // namespace
}  // namespace kvmesh

int main(int argc, char** argv) { return kvmesh::Run(kvmesh::ParseFlags(argc, argv)); }

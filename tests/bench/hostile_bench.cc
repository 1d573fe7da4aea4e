// Hostile benchmark: what one hostile request, or a few, can make a node hold (docs/security.md,
// "Attacks and their bounds"). Starts one kvmesh-node with a token file and, for each attack,
// resets the node's peak resident set (/proc/PID/clear_refs), makes the attack, and prints the
// node's RSS before, its peak during and its RSS after, beside the bound the docs give:
//
//  - visible-unauth: a 100 MiB Visible of 52M empty queries without a token (the gate refuses it
//    from its metadata, before the body is read);
//  - watch-unauth: a 100 MiB WatchEvents request without a token (the gate refuses it from its
//    metadata too: server streams go through it as the unary methods do);
//  - visible-auth-over: the same Visible with a token (read whole by gRPC, within
//  --max-message-bytes,
//    then refused for Visible's 256 KiB limit before it is parsed);
//  - visible-auth-limit: a Visible at its limit, 256 KiB of empty queries (parsed, then its
//    queries reserved in the in-flight budget, and answered);
//  - lookup-auth-limit: a LookupPrefix at its 8 MiB limit (2M tokens);
//  - watch-long-name: 100 WatchEvents with a 10 KB cache name;
//  - slow-drip: three AppendStreams of one tenant declaring 30 MiB each and sending a byte every
//    two seconds (ended by --stream_min_rate after its grace), while another tenant's 8 MiB
//    Append must succeed; prints when the streams ended and how the Append went.
//
// Then a second node with TLS and a peer plane (--peer-listen, mTLS with a test CA made by
// openssl, one member "node-b" besides it), for the peer plane's gate:
//  - peer-stranger: a 100 MiB PeerService.Export request with a certificate of the cluster CA
//    that names no member (PERMISSION_DENIED before the request is read);
//  - peer-member-over: the same from member node-b's certificate (read whole by gRPC, then
//    refused for Export's 8 MiB + 64 KiB limit before it is parsed);
//  - peer-reference: a NodeInfo from node-b.
//
// The reference measured in the same run: the same node's RSS after a GetCache (a health-check
// sized call), and the peak of a plain authenticated 1 KiB Append.
//
//   hostile_bench [--help]
#include <sys/types.h>

#include <atomic>
#include <cinttypes>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "kvmesh/v1/kvmesh.grpc.pb.h"
#include "service/auth.h"
#include "service/cache_service.h"
#include "service/common/client_channel.h"
#include "tests/testing/certs.h"
#include "tests/testing/node_process.h"

namespace kvmesh {
namespace {

using testutil::NodeProcess;
using testutil::TempDir;

constexpr char kAlice[] = "alice-0123456789abcdef0123456789abcdef";
constexpr char kMallory[] = "mallory-0123456789abcdef0123456789abcdef";
constexpr double kMiB = 1024.0 * 1024.0;

uint64_t Memory(pid_t pid, const char* field) { return testutil::ProcessStatusBytes(pid, field); }

// Resets VmHWM to the current RSS (Linux >= 4.0).
void ResetPeak(pid_t pid) {
  std::ofstream out(absl::StrCat("/proc/", pid, "/clear_refs"));
  out << "5";
}

std::shared_ptr<grpc::Channel> Channel(const std::string& address, const std::string& token) {
  ClientConnectionOptions options;
  options.token = token;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = NewClientChannel(address, options, args);
  if (!channel.ok()) {
    std::fprintf(stderr, "hostile_bench: %s\n", std::string(channel.status().message()).c_str());
    std::exit(1);
  }
  return *channel;
}

// One unary call of `method` with `body` as its request bytes; its status.
grpc::Status RawUnary(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                      const std::string& body) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  grpc::Slice slice(body);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  std::atomic<bool> done{false};
  grpc::Status status;
  stub.UnaryCall(&context, method, grpc::StubOptions(), &request, &response, [&](grpc::Status s) {
    status = std::move(s);
    done.store(true);
  });
  while (!done.load()) absl::SleepFor(absl::Milliseconds(5));
  return status;
}

std::string Varint(uint64_t n) {
  std::string out;
  while (n >= 0x80) {
    out.push_back(static_cast<char>((n & 0x7f) | 0x80));
    n >>= 7;
  }
  out.push_back(static_cast<char>(n));
  return out;
}

struct Row {
  std::string attack;
  uint64_t before = 0, peak = 0, after = 0;
  std::string outcome;
};

void Print(const Row& r) {
  std::printf("%-20s rss %7.1f MiB  peak %+8.1f MiB  after %+7.1f MiB  %s\n", r.attack.c_str(),
              r.before / kMiB, (static_cast<double>(r.peak) - r.before) / kMiB,
              (static_cast<double>(r.after) - r.before) / kMiB, r.outcome.c_str());
  std::fflush(stdout);
}

Row Measure(pid_t pid, const std::string& attack, const std::function<std::string()>& fn) {
  Row row;
  row.attack = attack;
  absl::SleepFor(absl::Milliseconds(300));
  ResetPeak(pid);
  row.before = Memory(pid, "VmRSS");
  row.outcome = fn();
  absl::SleepFor(absl::Milliseconds(500));
  row.peak = Memory(pid, "VmHWM");
  row.after = Memory(pid, "VmRSS");
  Print(row);
  return row;
}

std::string Code(const grpc::Status& status) {
  if (status.ok()) return "OK";
  std::string message = status.error_message().substr(0, 90);
  return absl::StrCat(absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code())),
                      ": ", message);
}

// The peer plane's gate: a node with TLS and --peer-listen, called with `filler` (100 MiB) as an
// unknown field of an Export request by a stranger and by a member.
int PeerPlane(const std::string& filler) {
  absl::StatusOr<std::unique_ptr<TempDir>> dir = TempDir::Create("kvmesh-hostile-bench-tls");
  if (!dir.ok()) return 1;
  absl::StatusOr<std::unique_ptr<testutil::TestCa>> ca =
      testutil::TestCa::Create((*dir)->path(), "ca", "hostile_bench CA");
  if (!ca.ok()) {
    std::fprintf(stderr, "hostile_bench: %s\n", std::string(ca.status().message()).c_str());
    return 1;
  }
  absl::StatusOr<testutil::CertFiles> node_a =
      (*ca)->Issue("node-a", {"node-a", {"DNS:node-a", "IP:127.0.0.1"}});
  absl::StatusOr<testutil::CertFiles> node_b =
      (*ca)->Issue("node-b", {"node-b", {"DNS:node-b", "IP:127.0.0.1"}});
  absl::StatusOr<testutil::CertFiles> stranger =
      (*ca)->Issue("stranger", {"stranger", {"DNS:stranger"}});
  if (!node_a.ok() || !node_b.ok() || !stranger.ok()) {
    std::fprintf(stderr, "hostile_bench: cannot issue the certificates\n");
    return 1;
  }
  const int peer_port = testutil::ReservePort();
  NodeProcess::Options options;
  options.node_name = "node-a";
  options.extra_args = {"--tls-cert=" + node_a->cert, "--tls-key=" + node_a->key,
                        "--peer-ca=" + (*ca)->cert_file(),
                        absl::StrCat("--peer-listen=127.0.0.1:", peer_port),
                        // node-b never starts: it is a member, by name, whose certificate calls.
                        absl::StrCat("--peers=node-b=127.0.0.1:", testutil::ReservePort())};
  options.client.tls.ca_file = (*ca)->cert_file();
  options.client.tls.server_name = "node-a";
  absl::StatusOr<std::unique_ptr<NodeProcess>> node = NodeProcess::Start(options);
  if (!node.ok()) {
    std::fprintf(stderr, "hostile_bench: %s\n", std::string(node.status().message()).c_str());
    return 1;
  }
  auto peer_channel = [&](const testutil::CertFiles& leaf) {
    ClientConnectionOptions client = options.client;
    client.tls.cert_file = leaf.cert;
    client.tls.key_file = leaf.key;
    absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = (*node)->NewPeerChannelWith(client);
    if (!channel.ok()) {
      std::fprintf(stderr, "hostile_bench: %s\n", std::string(channel.status().message()).c_str());
      std::exit(1);
    }
    return *channel;
  };
  const pid_t pid = (*node)->pid();
  std::printf("hostile_bench: kvmesh-node pid %d with TLS, peer plane on 127.0.0.1:%d\n", pid,
              peer_port);
  // Field 15 (unknown to every request type), length-delimited, holding `filler`.
  const std::string body = absl::StrCat("\x7a", Varint(filler.size()), filler);
  auto member = peer_channel(*node_b);
  auto outsider = peer_channel(*stranger);
  Measure(pid, "peer-reference",
          [&] { return Code(RawUnary(member, "/kvmesh.v1.PeerService/NodeInfo", "")); });
  Measure(pid, "peer-stranger",
          [&] { return Code(RawUnary(outsider, "/kvmesh.v1.PeerService/Export", body)); });
  Measure(pid, "peer-member-over",
          [&] { return Code(RawUnary(member, "/kvmesh.v1.PeerService/Export", body)); });
  (*node)->Stop();
  return 0;
}

int Main() {
  absl::StatusOr<std::unique_ptr<TempDir>> dir = TempDir::Create("kvmesh-hostile-bench");
  if (!dir.ok()) return 1;
  const std::string tokens = (*dir)->File("tokens");
  {
    std::ofstream out(tokens);
    out << "token sha256:" << Sha256Hex(kAlice) << " team-a tenant\n"
        << "token sha256:" << Sha256Hex(kMallory) << " mallory tenant\n";
  }
  NodeProcess::Options options;
  options.node_name = "hostile";
  options.extra_args = {absl::StrCat("--token-file=", tokens), "--memory-budget=256MiB"};
  absl::StatusOr<std::unique_ptr<NodeProcess>> node = NodeProcess::Start(options);
  if (!node.ok()) {
    std::fprintf(stderr, "hostile_bench: %s\n", std::string(node.status().message()).c_str());
    return 1;
  }
  const pid_t pid = (*node)->pid();
  const std::string address = (*node)->address();
  auto anonymous = Channel(address, "");
  auto alice = Channel(address, kAlice);
  auto mallory = Channel(address, kMallory);
  auto alice_stub = v1::CacheService::NewStub(alice);
  auto mallory_stub = v1::CacheService::NewStub(mallory);

  // A cache for each tenant: one Attention layer, 1 head, 64 dims, F32 (512 bytes a token).
  auto make_cache = [](v1::CacheService::Stub& stub, const std::string& name) {
    v1::CreateCacheRequest request;
    v1::CacheSpec* spec = request.mutable_spec();
    spec->set_name(name);
    spec->set_dtype(v1::DTYPE_F32);
    spec->set_max_sequences(4);
    spec->set_capacity(65536);
    spec->set_max_batch(32768);
    v1::LayerGroup* group = spec->add_groups();
    group->set_num_layers(1);
    v1::Attention* attention = group->mutable_attention();
    attention->set_num_kv_heads(1);
    attention->set_head_dim_k(64);
    attention->set_head_dim_v(64);
    grpc::ClientContext context;
    v1::CreateCacheResponse response;
    const grpc::Status status = stub.CreateCache(&context, request, &response);
    if (!status.ok())
      std::fprintf(stderr, "CreateCache %s: %s\n", name.c_str(), Code(status).c_str());
  };
  make_cache(*alice_stub, "c");
  make_cache(*mallory_stub, "m");

  std::printf(
      "hostile_bench: kvmesh-node pid %d, default limits (--max-message-bytes=128MiB, "
      "--inflight-budget=1GiB)\n",
      pid);
  Measure(pid, "reference-getcache", [&] {
    v1::GetCacheRequest request;
    request.set_cache("c");
    return Code(RawUnary(alice, "/kvmesh.v1.CacheService/GetCache", request.SerializeAsString()));
  });

  std::string empty_queries;
  empty_queries.reserve(size_t{100} << 20);
  while (empty_queries.size() < (size_t{100} << 20)) empty_queries.append("\x1a\x00", 2);
  Measure(pid, "visible-unauth", [&] {
    return Code(RawUnary(anonymous, "/kvmesh.v1.CacheService/Visible", empty_queries));
  });
  Measure(pid, "watch-unauth", [&] {
    // A server stream's request: refused from the metadata, before it is read.
    grpc::GenericStub stub(anonymous);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    grpc::CompletionQueue cq;
    auto call = stub.PrepareCall(&context, "/kvmesh.v1.CacheService/WatchEvents", &cq);
    void* tag;
    bool ok;
    call->StartCall(reinterpret_cast<void*>(1));
    cq.Next(&tag, &ok);
    grpc::Slice slice(empty_queries);
    grpc::ByteBuffer request(&slice, 1);
    call->WriteLast(request, grpc::WriteOptions(), reinterpret_cast<void*>(2));
    cq.Next(&tag, &ok);
    grpc::Status status;
    call->Finish(&status, reinterpret_cast<void*>(3));
    while (cq.Next(&tag, &ok) && tag != reinterpret_cast<void*>(3)) {
    }
    cq.Shutdown();
    while (cq.Next(&tag, &ok)) {
    }
    return Code(status);
  });
  Measure(pid, "visible-auth-over",
          [&] { return Code(RawUnary(alice, "/kvmesh.v1.CacheService/Visible", empty_queries)); });
  Measure(pid, "visible-auth-over-x6", [&] {
    // Does what the node keeps after one add up over several? RSS after each.
    std::string after;
    for (int i = 0; i < 6; ++i) {
      RawUnary(alice, "/kvmesh.v1.CacheService/Visible", empty_queries);
      absl::SleepFor(absl::Milliseconds(500));
      absl::StrAppend(&after, i == 0 ? "RSS after each: " : ", ",
                      absl::StrFormat("%.0f", Memory(pid, "VmRSS") / kMiB), " MiB");
    }
    return after;
  });
  // cache = "c", then empty queries up to the limit.
  empty_queries =
      absl::StrCat("\x0a\x01", "c", empty_queries.substr(0, kMaxVisibleRequestBytes - 4));
  Measure(pid, "visible-auth-limit",
          [&] { return Code(RawUnary(alice, "/kvmesh.v1.CacheService/Visible", empty_queries)); });
  {
    std::string tokens_field;
    for (int i = 0; i < (2 << 20) - 1024; ++i) tokens_field.append(Varint(100 + (i % 100)));
    std::string lookup =
        absl::StrCat("\x0a\x01", "c", "\x12", Varint(tokens_field.size()), tokens_field);
    Measure(pid, "lookup-auth-limit",
            [&] { return Code(RawUnary(alice, "/kvmesh.v1.CacheService/LookupPrefix", lookup)); });
  }
  Measure(pid, "watch-long-name", [&] {
    std::string last;
    for (int i = 0; i < 100; ++i) {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
      v1::WatchEventsRequest request;
      request.add_caches(std::string(10240, 'n'));
      auto reader = alice_stub->WatchEvents(&context, request);
      v1::WatchEventsResponse response;
      while (reader->Read(&response)) {
      }
      last = Code(reader->Finish());
    }
    return absl::StrCat("x100, last: ", last);
  });
  Measure(pid, "reference-append", [&] {
    v1::AppendRequest request;
    request.set_cache("c");
    v1::Token* t = request.add_tokens();
    t->set_seq(0);
    t->set_pos(0);
    request.set_payload(std::string(512, 'p'));
    return Code(RawUnary(alice, "/kvmesh.v1.CacheService/Append", request.SerializeAsString()));
  });
  Measure(pid, "slow-drip", [&] {
    // Three streams of 30 MiB (61440 tokens of 512 bytes), a byte every two seconds.
    std::vector<std::thread> streams;
    std::vector<std::string> ends(3);
    std::vector<absl::Duration> took(3);
    const absl::Time start = absl::Now();
    for (int s = 0; s < 3; ++s) {
      streams.emplace_back([&, s] {
        grpc::ClientContext context;
        context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
        v1::AppendResponse response;
        auto writer = mallory_stub->AppendStream(&context, &response);
        v1::AppendStreamRequest header;
        v1::AppendHeader* h = header.mutable_header();
        h->set_cache("m");
        v1::TokenRange* range = h->add_token_ranges();
        range->set_seq(s);
        range->set_first(0);
        range->set_count(30720);
        h->set_payload_bytes(int64_t{30720} * 512);
        bool ok = writer->Write(header);
        while (ok && absl::Now() - start < absl::Seconds(60)) {
          absl::SleepFor(absl::Seconds(2));
          v1::AppendStreamRequest data;
          data.set_data("x");
          ok = writer->Write(data);
        }
        ends[s] = Code(writer->Finish());
        took[s] = absl::Now() - start;
      });
    }
    absl::SleepFor(absl::Seconds(1));
    v1::AppendRequest request;
    request.set_cache("c");
    v1::TokenRange* range = request.add_token_ranges();
    range->set_seq(1);
    range->set_first(0);
    range->set_count(16384);
    request.set_payload(std::string(size_t{16384} * 512, 'p'));
    const std::string other =
        Code(RawUnary(alice, "/kvmesh.v1.CacheService/Append", request.SerializeAsString()));
    for (std::thread& t : streams) t.join();
    std::string out = absl::StrCat("other tenant's 8 MiB Append at 1 s: ", other.substr(0, 40));
    for (int s = 0; s < 3; ++s) {
      absl::StrAppend(&out, "\n    stream ", s, " ended after ",
                      absl::FormatDuration(absl::Trunc(took[s], absl::Milliseconds(100))), ": ",
                      ends[s]);
    }
    return out;
  });
  (*node)->Stop();
  return PeerPlane(std::string(size_t{100} << 20, 'x'));
}

}  // namespace
}  // namespace kvmesh

int main(int argc, char** argv) {
  if (argc > 1) {
    std::printf(
        "usage: hostile_bench (see the comment at the top of tests/bench/hostile_bench.cc)\n");
    return argc == 2 && std::string(argv[1]) == "--help" ? 0 : 2;
  }
  return kvmesh::Main();
}

// RPC benchmark of a real kvmesh-node over loopback, in one run:
//
//  - control-plane calls from N client threads over shared channels, each op for --duration
//    after a --warmup: grpc.health.v1.Health/Check (the trivial baseline on the same server),
//    then the scheduler-facing calls on a cache holding a --prefix-tokens sequence and 16 forks of
//    it: CanResume, GetCache, ListSequences, CopyPrefix of the whole prefix, Remove (a truncation
//    of a fork, re-forked untimed before each), Visible of one query (answered as positions,
//    then as ranges), ListMembers, and an Append of a few tokens (a decode step; every thread
//    truncates its sequence, untimed, before it reaches the capacity); requests/s and p50/p99
//    latency per op, and each control call's req/s as a ratio of Health/Check's with "met" when
//    it is >= 0.8;
//  - bulk payloads on one stream: AppendStream, unary Append and Read of --large-tokens tokens
//    (512 x Llama-3-8B shape = 64 MiB), the streams each with the generated stub and with
//    service/common/bulk_client.h (no copies in the client), GB/s; the Read client puts the
//    payload into one 4 MiB buffer, as the reference's receiver does (and, with bulk_client,
//    also into one 64 MiB buffer), after an untimed Read that checks the payload against the
//    pattern that was appended (wrong elements reported, as nccl-tests does); and raw loopback
//    TCP moving the same bytes (4 MiB buffers) in the same run, with "met" where AppendStream
//    or Read reaches 0.5 of it;
//  - isolation: p50/p99 of a 1-token unary Append (a decode step) for --duration alone, then for
//    --duration while another connection appends --large-tokens tokens to another sequence of
//    the same cache back to back (as unary Appends, then as AppendStreams), with "met" when the
//    p99 ratio is <= 2.
//
// The cache has the Llama-3-8B KV shape (32 layers, 8 KV heads, head dim 128, F16, NEOX RoPE).
// Without --addr the bench starts its own kvmesh-node on 127.0.0.1:0 and stops it at the end;
// with --addr it uses that node and creates/deletes the cache --cache there.
//
//   rpc_bench [--addr=HOST:PORT] [--threads=8] [--channels=1] [--duration=3s] [--warmup=0.5s]
//             [--append-tokens=4] [--large-tokens=512] [--large-reps=5] [--chunk-bytes=1MiB]
//             [--prefix-tokens=1024]
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cache/spec.h"
#include "cache/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "kvmesh/v1/kvmesh.grpc.pb.h"
#include "service/common/bulk_client.h"
#include "service/common/convert.h"
#include "service/common/health_client.h"
#include "service/ctl/args.h"
#include "service/ctl/payload.h"
#include "tests/bench/tcp_reference.h"
#include "tests/testing/llama_spec.h"
#include "tests/testing/node_process.h"

namespace kvmesh {
namespace {

using Clock = std::chrono::steady_clock;

constexpr absl::string_view kFlags[] = {
    "addr",         "threads",    "channels",    "duration", "warmup",        "append-tokens",
    "large-tokens", "large-reps", "chunk-bytes", "cache",    "prefix-tokens", "help"};
constexpr int32_t kAppendWindow = 256;  // an Append thread truncates its sequence at this offset
constexpr int64_t kSourceSeq = 0;
constexpr int64_t kBulkSeq = 1;
constexpr int64_t kCopySeqBase = 1000;    // + thread: CopyPrefix destinations
constexpr int64_t kAppendSeqBase = 2000;  // + thread: Append sequences
constexpr int64_t kForkSeqBase = 3000;    // + i: forks of the source, made in the setup
constexpr int kForks = 16;
constexpr double kControlGoal = 0.8;  // of Health/Check's req/s (issue 17)
constexpr uint64_t kSeed = 42;

struct Options {
  std::string addr;  // empty: start a node
  std::string cache = "rpc-bench";
  int threads = 8;
  int channels = 1;
  absl::Duration duration = absl::Seconds(3);
  absl::Duration warmup = absl::Milliseconds(500);
  int32_t append_tokens = 4;
  int32_t large_tokens = 512;
  int32_t prefix_tokens = 1024;  // the source sequence's length (forked and copied whole)
  int large_reps = 5;
  int64_t chunk_bytes = int64_t{1} << 20;
};

CacheSpec BenchSpec(const Options& o) {
  return testutil::Llama3_8BSpec(o.cache, 2 + 2 * o.threads + kForks,
                                 std::max(o.prefix_tokens, o.large_tokens), o.large_tokens);
}

std::shared_ptr<grpc::Channel> NewChannel(const std::string& addr, int index) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  // A private subchannel pool and a distinct argument: every channel gets its own connection.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetInt("kvmesh.bench_channel", index);
  return grpc::CreateCustomChannel(addr, grpc::InsecureChannelCredentials(), args);
}

void SetDeadline(grpc::ClientContext* context, absl::Duration timeout) {
  context->set_deadline(std::chrono::system_clock::now() + absl::ToChronoMicroseconds(timeout));
}

// One client connection: a channel with the stubs that use it. Stubs are thread-safe.
struct Client {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::CacheService::Stub> stub;
  std::unique_ptr<HealthClient> health;
};

// Latencies of one op over all threads, and the first error seen.
struct OpResult {
  std::string name;
  std::vector<double> latencies_us;
  double seconds = 0;
  int64_t errors = 0;
  int64_t side_calls = 0;  // untimed helper calls (truncating Removes)
  std::string first_error;
};

// What one thread does per call: returns the call's status, or sets *timed=false for an
// untimed helper call.
using CallFn = std::function<grpc::Status(int thread, Client& client, bool* timed)>;

OpResult RunOp(const std::string& name, const Options& o, std::vector<Client>& clients,
               const CallFn& call) {
  OpResult result;
  result.name = name;
  absl::Mutex mu;
  absl::Notification go;
  std::atomic<int64_t> side_calls{0};
  Clock::time_point measure_from, measure_to;
  std::vector<std::thread> threads;
  for (int t = 0; t < o.threads; ++t) {
    threads.emplace_back([&, t] {
      Client& client = clients[t % clients.size()];
      std::vector<double> mine;
      int64_t errors = 0;
      std::string first_error;
      go.WaitForNotification();
      for (;;) {
        const Clock::time_point start = Clock::now();
        if (start >= measure_to) break;
        bool timed = true;
        const grpc::Status s = call(t, client, &timed);
        const Clock::time_point end = Clock::now();
        if (!timed) {
          side_calls.fetch_add(1, std::memory_order_relaxed);
          if (s.ok()) continue;
        }
        if (!s.ok()) {
          if (errors++ == 0) {
            first_error = absl::StrCat(
                absl::StatusCodeToString(static_cast<absl::StatusCode>(s.error_code())), ": ",
                s.error_message());
          }
          continue;
        }
        if (start >= measure_from) {
          mine.push_back(std::chrono::duration<double, std::micro>(end - start).count());
        }
      }
      absl::MutexLock lock(&mu);
      result.latencies_us.insert(result.latencies_us.end(), mine.begin(), mine.end());
      result.errors += errors;
      if (result.first_error.empty()) result.first_error = first_error;
    });
  }
  measure_from = Clock::now() + absl::ToChronoNanoseconds(o.warmup);
  measure_to = measure_from + absl::ToChronoNanoseconds(o.duration);
  go.Notify();
  for (std::thread& t : threads) t.join();
  // Calls that started before measure_to finish after it; the rate counts calls started in the
  // window over the window's length.
  result.seconds = absl::ToDoubleSeconds(o.duration);
  result.side_calls = side_calls.load();
  std::sort(result.latencies_us.begin(), result.latencies_us.end());
  return result;
}

double Percentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  const size_t i = std::min(sorted.size() - 1, static_cast<size_t>(p * sorted.size()));
  return sorted[i];
}

// Calls per second. An op that interleaves untimed helper calls spends part of the window on
// them; its rate is then that of its timed calls alone, threads / mean latency (Little's law:
// every thread always has one call in flight).
double Rate(const OpResult& r, int threads) {
  if (r.side_calls == 0) return r.latencies_us.size() / r.seconds;
  double sum = 0;
  for (double v : r.latencies_us) sum += v;
  return sum > 0 ? threads * 1e6 * r.latencies_us.size() / sum : 0;
}

void PrintOp(const OpResult& r, int threads) {
  double sum = 0;
  for (double v : r.latencies_us) sum += v;
  const double mean = r.latencies_us.empty() ? 0 : sum / r.latencies_us.size();
  std::printf("%-46s %9zu %10.0f %9.0f %9.0f %9.0f %7" PRId64 "\n", r.name.c_str(),
              r.latencies_us.size(), Rate(r, threads), Percentile(r.latencies_us, 0.50),
              Percentile(r.latencies_us, 0.99), mean, r.errors);
  if (!r.first_error.empty()) std::printf("    first error: %s\n", r.first_error.c_str());
  if (r.side_calls > 0) {
    std::printf("    (plus %" PRId64 " untimed helper calls; req/s = threads / mean)\n",
                r.side_calls);
  }
}

// Times of one bulk transfer repeated; GB/s from the median.
struct BulkResult {
  std::string name;
  std::vector<double> seconds;
  std::string error;
  std::string note;
  int64_t wrong_elements = 0;  // Read: elements that differ from what was appended
};

double MedianSeconds(std::vector<double> s) {
  std::sort(s.begin(), s.end());
  return s[s.size() / 2];
}

void PrintBulk(const BulkResult& r, int64_t bytes) {
  if (!r.error.empty()) {
    std::printf("%-46s failed: %s\n", r.name.c_str(), r.error.c_str());
    return;
  }
  std::vector<double> s = r.seconds;
  std::sort(s.begin(), s.end());
  const double median = MedianSeconds(s);
  std::printf("%-46s %6zu %10.1f %10.1f %9.2f %9.2f  %s\n", r.name.c_str(), s.size(), median * 1e3,
              s.front() * 1e3, bytes / median / 1e9, bytes / s.front() / 1e9, r.note.c_str());
}

void AddTokens(int64_t seq, absl::Span<const int32_t> positions,
               google::protobuf::RepeatedPtrField<v1::Token>* tokens) {
  for (int32_t p : positions) {
    v1::Token* t = tokens->Add();
    t->set_seq(seq);
    t->set_pos(p);
  }
}

// One AppendStream call: the header with the first chunk, then chunks of `chunk_bytes`.
grpc::Status AppendStream(Client& client, const std::string& cache, int64_t seq,
                          absl::Span<const int32_t> positions, const std::string& payload,
                          int64_t chunk_bytes) {
  grpc::ClientContext context;
  SetDeadline(&context, absl::Seconds(120));
  v1::AppendResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::AppendStreamRequest>> writer =
      client.stub->AppendStream(&context, &response);
  v1::AppendStreamRequest message;
  v1::AppendHeader* header = message.mutable_header();
  header->set_cache(cache);
  AddTokens(seq, positions, header->mutable_tokens());
  header->set_payload_bytes(static_cast<int64_t>(payload.size()));
  size_t off = 0;
  do {
    const size_t n = std::min(payload.size() - off, static_cast<size_t>(chunk_bytes));
    message.set_data(payload.data() + off, n);
    off += n;
    if (!writer->Write(message)) break;  // the server ended the call; Finish says why
    message.clear_header();
  } while (off < payload.size());
  writer->WritesDone();
  return writer->Finish();
}

grpc::Status CopyPrefix(Client& client, const std::string& cache, int64_t src, int64_t dst,
                        int32_t length) {
  grpc::ClientContext context;
  SetDeadline(&context, absl::Seconds(10));
  v1::CopyPrefixRequest request;
  request.set_cache(cache);
  request.set_src_seq(src);
  request.set_dst_seq(dst);
  request.set_length(length);
  v1::CopyPrefixResponse response;
  return client.stub->CopyPrefix(&context, request, &response);
}

absl::Status Setup(const Options& o, Client& client, const CacheSpec& spec) {
  {
    grpc::ClientContext context;
    SetDeadline(&context, absl::Seconds(30));
    v1::CreateCacheRequest request;
    *request.mutable_spec() = SpecToProto(spec);
    v1::CreateCacheResponse response;
    RETURN_IF_ERROR(FromGrpcStatus(client.stub->CreateCache(&context, request, &response)));
    if (!response.created()) {
      return absl::AlreadyExistsError(absl::StrCat(
          "cache '", o.cache, "' already exists on the node; pass another --cache or delete it"));
    }
  }
  // The CopyPrefix source: o.prefix_tokens tokens of seq 0, sent as streams so that the setup
  // works with any --max-message-bytes of the node.
  for (int32_t begin = 0; begin < o.prefix_tokens; begin += spec.max_batch) {
    const int32_t end = std::min(o.prefix_tokens, begin + spec.max_batch);
    std::vector<int32_t> positions;
    for (int32_t p = begin; p < end; ++p) positions.push_back(p);
    RETURN_IF_ERROR(FromGrpcStatus(AppendStream(client, o.cache, kSourceSeq, positions,
                                                ctl::MakePatternPayload(spec, positions, kSeed),
                                                o.chunk_bytes)));
  }
  for (int i = 0; i < kForks; ++i) {
    RETURN_IF_ERROR(
        FromGrpcStatus(CopyPrefix(client, o.cache, kSourceSeq, kForkSeqBase + i, o.prefix_tokens)));
  }
  return absl::OkStatus();
}

grpc::Status Remove(Client& client, const std::string& cache, int64_t seq, int32_t begin) {
  grpc::ClientContext context;
  SetDeadline(&context, absl::Seconds(30));
  v1::RemoveRequest request;
  request.set_cache(cache);
  request.set_seq(seq);
  request.set_begin(begin);
  v1::RemoveResponse response;
  return client.stub->Remove(&context, request, &response);
}

std::string ErrorText(const grpc::Status& s) {
  return absl::StrCat(absl::StatusCodeToString(static_cast<absl::StatusCode>(s.error_code())), ": ",
                      s.error_message());
}

// The client side of a bulk call: the generated stub, or service/common/bulk_client.h's
// streams without copies (the same bytes on the wire).
enum class BulkClient { kStub, kNoCopy };

const char* BulkClientName(BulkClient c) {
  return c == BulkClient::kStub ? "generated stub" : "bulk_client";
}

grpc::Status AppendStreamWith(BulkClient c, Client& client, const std::string& cache, int64_t seq,
                              absl::Span<const int32_t> positions,
                              const std::shared_ptr<const std::string>& payload,
                              int64_t chunk_bytes) {
  if (c == BulkClient::kStub) {
    return AppendStream(client, cache, seq, positions, *payload, chunk_bytes);
  }
  grpc::ClientContext context;
  SetDeadline(&context, absl::Seconds(120));
  v1::AppendHeader header;
  header.set_cache(cache);
  AddTokens(seq, positions, header.mutable_tokens());
  header.set_payload_bytes(static_cast<int64_t>(payload->size()));
  v1::AppendResponse response;
  return ToGrpcStatus(SendAppendStream(client.channel.get(), &context, header, payload,
                                       static_cast<size_t>(chunk_bytes), &response));
}

// One Read of all of `seq`, each piece of its payload handed to `sink` as it arrives.
grpc::Status ReadWith(BulkClient c, Client& client, const v1::ReadRequest& request,
                      v1::ReadHeader* header,
                      absl::FunctionRef<void(absl::Span<const uint8_t>)> sink) {
  grpc::ClientContext context;
  SetDeadline(&context, absl::Seconds(120));
  if (c == BulkClient::kNoCopy) {
    return ToGrpcStatus(ReceiveReadStream(client.channel.get(), &context, request, header, sink));
  }
  v1::ReadResponse message;
  auto reader = client.stub->Read(&context, request);
  while (reader->Read(&message)) {
    if (message.has_header()) *header = message.header();
    sink(absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(message.data().data()),
                             message.data().size()));
  }
  return reader->Finish();
}

// Where a Read's client puts the payload: into one 4 MiB buffer, written over and over (as the
// raw TCP reference's receiver reads into one; a client that stages the payload on its way to a
// GPU), or all of it into one payload-sized buffer.
class ReadDestination {
 public:
  explicit ReadDestination(size_t payload_bytes) { whole_.reserve(payload_bytes); }

  void Reset() { whole_.clear(); }
  void Staged(absl::Span<const uint8_t> piece) {
    while (!piece.empty()) {
      const size_t n = std::min(piece.size(), staging_.size() - at_);
      std::memcpy(staging_.data() + at_, piece.data(), n);
      at_ = (at_ + n) % staging_.size();
      piece.remove_prefix(n);
    }
  }
  void Whole(absl::Span<const uint8_t> piece) {
    whole_.append(reinterpret_cast<const char*>(piece.data()), piece.size());
  }
  absl::Span<const uint8_t> whole() const {
    return absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(whole_.data()), whole_.size());
  }

 private:
  std::vector<char> staging_ = std::vector<char>(testutil::kTcpBufferBytes, 'x');
  size_t at_ = 0;
  std::string whole_;
};

// Bulk transfers of o.large_tokens tokens to/from kBulkSeq, one call at a time.
std::vector<BulkResult> RunBulk(const Options& o, Client& client, const CacheSpec& spec) {
  std::vector<int32_t> positions;
  for (int32_t p = 0; p < o.large_tokens; ++p) positions.push_back(p);
  const auto payload =
      std::make_shared<const std::string>(ctl::MakePatternPayload(spec, positions, kSeed));
  std::vector<BulkResult> results;

  // AppendStream with either client, then unary Append; each rep starts from an empty sequence
  // (untimed Remove).
  for (const int mode : {0, 1, 2}) {
    const bool stream = mode < 2;
    const BulkClient c = mode == 0 ? BulkClient::kStub : BulkClient::kNoCopy;
    BulkResult r;
    r.name = stream ? absl::StrCat("AppendStream (", o.chunk_bytes >> 10, " KiB, ",
                                   BulkClientName(c), ")")
                    : std::string("Append (unary, one message)");
    for (int rep = 0; rep < o.large_reps && r.error.empty(); ++rep) {
      grpc::Status removed = Remove(client, o.cache, kBulkSeq, 0);
      if (!removed.ok()) {
        r.error = absl::StrCat("Remove: ", ErrorText(removed));
        break;
      }
      grpc::Status s;
      Clock::time_point start, end;
      if (stream) {
        start = Clock::now();
        s = AppendStreamWith(c, client, o.cache, kBulkSeq, positions, payload, o.chunk_bytes);
        end = Clock::now();
      } else {
        v1::AppendRequest request;  // built before the clock starts, as a worker would have it
        request.set_cache(o.cache);
        AddTokens(kBulkSeq, positions, request.mutable_tokens());
        request.set_payload(*payload);
        grpc::ClientContext context;
        SetDeadline(&context, absl::Seconds(120));
        v1::AppendResponse response;
        start = Clock::now();
        s = client.stub->Append(&context, request, &response);
        end = Clock::now();
      }
      if (!s.ok()) {
        r.error = ErrorText(s);
        if (!stream && s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
          r.error += " (start the node with a larger --max-message-bytes)";
        }
        break;
      }
      r.seconds.push_back(std::chrono::duration<double>(end - start).count());
    }
    results.push_back(std::move(r));
  }

  // Make sure the sequence holds the payload for the reads, whatever happened above.
  const bool have_data =
      Remove(client, o.cache, kBulkSeq, 0).ok() &&
      AppendStream(client, o.cache, kBulkSeq, positions, *payload, o.chunk_bytes).ok();

  ReadDestination destination(payload->size());
  struct ReadMode {
    BulkClient client;
    bool whole;  // into one payload-sized buffer, else into a 4 MiB one
  };
  for (const ReadMode mode :
       {ReadMode{BulkClient::kStub, false}, ReadMode{BulkClient::kNoCopy, false},
        ReadMode{BulkClient::kNoCopy, true}}) {
    BulkResult read;
    read.name = absl::StrCat("Read (", o.chunk_bytes >> 10, " KiB, ", BulkClientName(mode.client),
                             mode.whole ? ", into 64 MiB" : ", into 4 MiB", ")");
    if (!have_data) read.error = "could not append the payload to read";
    v1::ReadRequest request;
    request.set_cache(o.cache);
    request.set_seq(kBulkSeq);
    request.set_max_chunk_bytes(static_cast<int32_t>(o.chunk_bytes));
    // Rep -1, untimed: the payload read whole and checked against the pattern appended.
    for (int rep = -1; rep < o.large_reps && read.error.empty(); ++rep) {
      v1::ReadHeader header;
      destination.Reset();
      const bool whole = rep < 0 || mode.whole;
      const Clock::time_point start = Clock::now();
      grpc::Status s =
          ReadWith(mode.client, client, request, &header, [&](absl::Span<const uint8_t> piece) {
            if (whole) {
              destination.Whole(piece);
            } else {
              destination.Staged(piece);
            }
          });
      const Clock::time_point end = Clock::now();
      if (!s.ok()) {
        read.error = ErrorText(s);
        break;
      }
      if (rep >= 0) {
        read.seconds.push_back(std::chrono::duration<double>(end - start).count());
        continue;
      }
      std::vector<std::vector<int32_t>> got(spec.groups.size());
      for (const v1::GroupPositions& g : header.groups()) {
        if (g.group() >= 0 && g.group() < static_cast<int>(got.size())) {
          got[g.group()].assign(g.positions().begin(), g.positions().end());
        }
      }
      const ctl::PatternCheck check =
          ctl::CheckPatternPayload(spec, got, destination.whole(), kSeed);
      read.wrong_elements = static_cast<int64_t>(check.mismatches);
      read.note = absl::StrCat("wrong elements: ", check.mismatches, " of ", check.elements);
      if (check.mismatches != 0) {
        read.note += absl::StrCat(" (first at ", check.first_mismatch, ")");
      }
    }
    results.push_back(std::move(read));
  }
  return results;
}

// Goal 2 of issue 17: a decode step (a 1-token unary Append) on its own sequence, for
// o.duration alone, then for o.duration while another connection appends o.large_tokens tokens
// to another sequence of the same cache back to back: as one unary message, then as an
// AppendStream (bulk_client, o.chunk_bytes per message).
struct IsolationResult {
  std::vector<double> alone_us;
  std::vector<double> during_us;         // beside unary prefills
  std::vector<double> during_stream_us;  // beside streamed prefills
  int64_t prefills = 0;                  // large unary Appends done during the second phase
  int64_t stream_prefills = 0;           // large AppendStreams done during the third phase
  std::string error;
};

IsolationResult RunIsolation(const Options& o, const std::string& addr, Client& client,
                             const CacheSpec& spec) {
  IsolationResult result;
  const int64_t decode_seq = kAppendSeqBase;
  const std::string step = ctl::MakePatternPayload(spec, {0}, kSeed);
  int32_t next = 0;
  auto decode = [&](std::vector<double>* out) -> grpc::Status {
    if (next + 1 > kAppendWindow) {  // untimed truncation, as in the Append op
      grpc::Status s = Remove(client, o.cache, decode_seq, 0);
      if (!s.ok()) return s;
      next = 0;
    }
    grpc::ClientContext context;
    SetDeadline(&context, absl::Seconds(30));
    v1::AppendRequest request;
    request.set_cache(o.cache);
    v1::Token* token = request.add_tokens();
    token->set_seq(decode_seq);
    token->set_pos(next);
    request.set_payload(step);
    v1::AppendResponse response;
    const Clock::time_point start = Clock::now();
    grpc::Status s = client.stub->Append(&context, request, &response);
    const Clock::time_point end = Clock::now();
    if (s.ok()) {
      ++next;
      out->push_back(std::chrono::duration<double, std::micro>(end - start).count());
    }
    return s;
  };
  auto run_phase = [&](std::vector<double>* out) {
    const absl::Time stop = absl::Now() + o.duration;
    while (absl::Now() < stop && result.error.empty()) {
      grpc::Status s = decode(out);
      if (!s.ok()) result.error = absl::StrCat("decode Append: ", ErrorText(s));
    }
    std::sort(out->begin(), out->end());
  };
  if (grpc::Status s = Remove(client, o.cache, decode_seq, 0); !s.ok()) {
    result.error = absl::StrCat("Remove: ", ErrorText(s));
    return result;
  }
  run_phase(&result.alone_us);

  // The prefilling client has its own connection, so that its 64 MiB messages do not queue
  // the decode steps' frames behind them on one HTTP/2 connection.
  Client prefill;
  prefill.channel = NewChannel(addr, 1 << 20);
  prefill.stub = v1::CacheService::NewStub(prefill.channel);
  std::vector<int32_t> positions;
  for (int32_t p = 0; p < o.large_tokens; ++p) positions.push_back(p);
  v1::AppendRequest large;
  large.set_cache(o.cache);
  AddTokens(kBulkSeq, positions, large.mutable_tokens());
  large.set_payload(ctl::MakePatternPayload(spec, positions, kSeed));
  const auto payload = std::make_shared<const std::string>(large.payload());
  for (const bool stream : {false, true}) {
    if (!result.error.empty()) break;
    std::atomic<bool> stop{false};
    absl::Notification first_started;
    std::string prefill_error;
    int64_t* done = stream ? &result.stream_prefills : &result.prefills;
    std::thread prefiller([&] {
      while (!stop.load()) {
        grpc::Status s = Remove(prefill, o.cache, kBulkSeq, 0);
        if (s.ok()) {
          if (!first_started.HasBeenNotified()) first_started.Notify();
          if (stream) {
            s = AppendStreamWith(BulkClient::kNoCopy, prefill, o.cache, kBulkSeq, positions,
                                 payload, o.chunk_bytes);
          } else {
            grpc::ClientContext context;
            SetDeadline(&context, absl::Seconds(120));
            v1::AppendResponse response;
            s = prefill.stub->Append(&context, large, &response);
          }
          if (s.ok()) ++*done;
        }
        if (!s.ok()) {
          prefill_error =
              absl::StrCat("prefill ", stream ? "AppendStream" : "Append", ": ", ErrorText(s));
          break;
        }
      }
      if (!first_started.HasBeenNotified()) first_started.Notify();
    });
    first_started.WaitForNotification();
    run_phase(stream ? &result.during_stream_us : &result.during_us);
    stop = true;
    prefiller.join();
    if (result.error.empty()) result.error = prefill_error;
  }
  return result;
}

void PrintIsolation(const IsolationResult& r, const Options& o, int64_t large_bytes) {
  std::printf("\nisolation (issue 17 goal 2): 1-token unary Append on one sequence, %s per phase\n",
              absl::FormatDuration(o.duration).c_str());
  if (!r.error.empty()) {
    std::printf("  ERROR: %s\n", r.error.c_str());
    return;
  }
  std::printf("  %-60s %7s %9s %9s %9s\n", "phase", "calls", "p50 us", "p99 us", "max us");
  auto row = [](const std::string& name, const std::vector<double>& v) {
    std::printf("  %-60s %7zu %9.0f %9.0f %9.0f\n", name.c_str(), v.size(), Percentile(v, 0.5),
                Percentile(v, 0.99), v.empty() ? 0.0 : v.back());
  };
  row("alone", r.alone_us);
  row(absl::StrFormat("beside unary Appends of %.0f MiB (%d calls)", large_bytes / 1048576.0,
                      r.prefills),
      r.during_us);
  row(absl::StrFormat("beside AppendStreams of %.0f MiB, bulk_client (%d calls)",
                      large_bytes / 1048576.0, r.stream_prefills),
      r.during_stream_us);
  const double alone = Percentile(r.alone_us, 0.99);
  for (const bool stream : {false, true}) {
    const double during = Percentile(stream ? r.during_stream_us : r.during_us, 0.99);
    const double ratio = alone > 0 ? during / alone : 0;
    std::printf("  p99 beside %-13s / p99 alone: %.2f (goal <= 2): %s\n",
                stream ? "AppendStreams" : "unary Appends", ratio,
                ratio > 0 && ratio <= 2 ? "met" : "NOT met");
  }
}

absl::StatusOr<Options> ParseOptions(int argc, char** argv) {
  ASSIGN_OR_RETURN(ctl::Args args, ctl::Args::Parse(argc, argv, {}));
  RETURN_IF_ERROR(args.CheckAllowed(kFlags));
  if (!args.command().empty()) {
    return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", args.command(), "'"));
  }
  Options o;
  ASSIGN_OR_RETURN(o.addr, args.GetString("addr", ""));
  ASSIGN_OR_RETURN(o.cache, args.GetString("cache", o.cache));
  ASSIGN_OR_RETURN(int64_t threads, args.GetInt("threads", o.threads));
  ASSIGN_OR_RETURN(int64_t channels, args.GetInt("channels", o.channels));
  ASSIGN_OR_RETURN(o.duration, args.GetDuration("duration", o.duration));
  ASSIGN_OR_RETURN(o.warmup, args.GetDuration("warmup", o.warmup));
  ASSIGN_OR_RETURN(int64_t append_tokens, args.GetInt("append-tokens", o.append_tokens));
  ASSIGN_OR_RETURN(int64_t large_tokens, args.GetInt("large-tokens", o.large_tokens));
  ASSIGN_OR_RETURN(int64_t large_reps, args.GetInt("large-reps", o.large_reps));
  ASSIGN_OR_RETURN(int64_t prefix_tokens, args.GetInt("prefix-tokens", o.prefix_tokens));
  ASSIGN_OR_RETURN(o.chunk_bytes, args.GetBytes("chunk-bytes", o.chunk_bytes));
  if (threads < 1 || threads > 256) {
    return absl::InvalidArgumentError(absl::StrCat("--threads=", threads, " is not in [1, 256]"));
  }
  if (channels < 1 || channels > threads) {
    return absl::InvalidArgumentError(
        absl::StrCat("--channels=", channels, " is not in [1, --threads]"));
  }
  if (append_tokens < 1 || append_tokens > kAppendWindow) {
    return absl::InvalidArgumentError(
        absl::StrCat("--append-tokens=", append_tokens, " is not in [1, ", kAppendWindow, "]"));
  }
  if (large_tokens < 1 || large_tokens > 8192) {
    return absl::InvalidArgumentError(
        absl::StrCat("--large-tokens=", large_tokens, " is not in [1, 8192]"));
  }
  if (large_reps < 1) return absl::InvalidArgumentError("--large-reps must be >= 1");
  if (prefix_tokens < 2 || prefix_tokens > 8192) {
    return absl::InvalidArgumentError(
        absl::StrCat("--prefix-tokens=", prefix_tokens, " is not in [2, 8192]"));
  }
  o.prefix_tokens = static_cast<int32_t>(prefix_tokens);
  if (o.chunk_bytes < 1024 || o.chunk_bytes > (int64_t{64} << 20)) {
    return absl::InvalidArgumentError("--chunk-bytes must be in [1KiB, 64MiB]");
  }
  o.threads = static_cast<int>(threads);
  o.channels = static_cast<int>(channels);
  o.append_tokens = static_cast<int32_t>(append_tokens);
  o.large_tokens = static_cast<int32_t>(large_tokens);
  o.large_reps = static_cast<int>(large_reps);
  return o;
}

constexpr char kUsage[] =
    "usage: rpc_bench [--addr=HOST:PORT] [--threads=8] [--channels=1] [--duration=3s] "
    "[--warmup=0.5s] [--append-tokens=4] [--large-tokens=512] [--large-reps=5] "
    "[--chunk-bytes=1MiB] [--prefix-tokens=1024] [--cache=rpc-bench]\n"
    "Without --addr, starts a kvmesh-node on 127.0.0.1:0 and stops it at the end.\n";

int Main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (absl::string_view(argv[i]) == "--help" || absl::string_view(argv[i]) == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
  }
  absl::StatusOr<Options> parsed = ParseOptions(argc, argv);
  if (!parsed.ok()) {
    std::fprintf(stderr, "rpc_bench: %s\n%s", std::string(parsed.status().message()).c_str(),
                 kUsage);
    return 2;
  }
  const Options& o = *parsed;
  const CacheSpec spec = BenchSpec(o);

  std::unique_ptr<testutil::NodeProcess> node;
  std::string addr = o.addr;
  if (addr.empty()) {
    testutil::NodeProcess::Options node_options;
    node_options.node_name = "rpc-bench";
    // Room for the cache with headroom, and unary Appends of the bulk payload.
    const size_t budget = CacheBytes(spec) + (size_t{1} << 30);
    node_options.extra_args = {
        absl::StrCat("--memory-budget=", budget),
        absl::StrCat(
            "--max-message-bytes=",
            std::max<size_t>(size_t{64} << 20, 2 * AppendPayloadBytes(spec, o.large_tokens, 1)))};
    auto started = testutil::NodeProcess::Start(node_options);
    if (!started.ok()) {
      std::fprintf(stderr, "rpc_bench: cannot start kvmesh-node: %s\n",
                   started.status().ToString().c_str());
      return 1;
    }
    node = std::move(started).value();
    addr = node->address();
  }

  std::vector<Client> clients;
  for (int c = 0; c < o.channels; ++c) {
    Client client;
    client.channel = NewChannel(addr, c);
    client.stub = v1::CacheService::NewStub(client.channel);
    client.health = std::make_unique<HealthClient>(client.channel);
    clients.push_back(std::move(client));
  }
  if (absl::Status s = Setup(o, clients[0], spec); !s.ok()) {
    std::fprintf(stderr, "rpc_bench: setup: %s\n", s.ToString().c_str());
    return 1;
  }

  const size_t token_bytes = AppendPayloadBytes(spec, 1, 1);
  std::printf("kvmesh rpc_bench: node %s (%s), loopback\n", addr.c_str(),
              node ? "started by the bench" : "given by --addr");
  std::printf(
      "machine: nproc %ld (client and node share it); client threads %d over %d "
      "channel(s); %s per op after %s warmup\n",
      sysconf(_SC_NPROCESSORS_ONLN), o.threads, o.channels,
      absl::FormatDuration(o.duration).c_str(), absl::FormatDuration(o.warmup).c_str());
  std::printf("cache: Llama-3-8B KV shape (32 layers x 8 KV heads x 128, F16), %zu KiB/token\n\n",
              token_bytes >> 10);
  std::printf("%-46s %9s %10s %9s %9s %9s %7s\n", "op", "calls", "req/s", "p50 us", "p99 us",
              "mean us", "errors");

  std::vector<OpResult> ops;
  ops.push_back(RunOp("Health/Check (baseline)", o, clients, [](int, Client& c, bool*) {
    grpc::ClientContext context;
    SetDeadline(&context, absl::Seconds(10));
    ServingStatus status;
    return c.health->Check(&context, "", &status);
  }));
  PrintOp(ops.back(), o.threads);
  ops.push_back(RunOp("CanResume", o, clients, [&](int, Client& c, bool*) {
    grpc::ClientContext context;
    SetDeadline(&context, absl::Seconds(10));
    v1::CanResumeRequest request;
    request.set_cache(o.cache);
    request.set_seq(kSourceSeq);
    request.set_pos(o.prefix_tokens);
    v1::CanResumeResponse response;
    return c.stub->CanResume(&context, request, &response);
  }));
  PrintOp(ops.back(), o.threads);
  ops.push_back(RunOp("GetCache", o, clients, [&](int, Client& c, bool*) {
    grpc::ClientContext context;
    SetDeadline(&context, absl::Seconds(10));
    v1::GetCacheRequest request;
    request.set_cache(o.cache);
    v1::GetCacheResponse response;
    return c.stub->GetCache(&context, request, &response);
  }));
  PrintOp(ops.back(), o.threads);
  ops.push_back(RunOp(absl::StrCat("ListSequences (", kForks + 1, " x ", o.prefix_tokens, ")"), o,
                      clients, [&](int, Client& c, bool*) {
                        grpc::ClientContext context;
                        SetDeadline(&context, absl::Seconds(10));
                        v1::ListSequencesRequest request;
                        request.set_cache(o.cache);
                        v1::ListSequencesResponse response;
                        return c.stub->ListSequences(&context, request, &response);
                      }));
  PrintOp(ops.back(), o.threads);
  ops.push_back(RunOp(absl::StrCat("CopyPrefix (", o.prefix_tokens, " tokens)"), o, clients,
                      [&](int t, Client& c, bool*) {
                        return CopyPrefix(c, o.cache, kSourceSeq, kCopySeqBase + t,
                                          o.prefix_tokens);
                      }));
  PrintOp(ops.back(), o.threads);
  {
    // Each thread truncates its fork (a CopyPrefix destination) to half, then forks it again,
    // untimed, so that every timed Remove drops as many positions.
    std::vector<bool> whole(o.threads, true);  // the CopyPrefix op left whole copies
    ops.push_back(RunOp(absl::StrCat("Remove (truncate ", o.prefix_tokens / 2, " of a fork)"), o,
                        clients, [&](int t, Client& c, bool* timed) {
                          const int64_t seq = kCopySeqBase + t;
                          if (!whole[t]) {
                            *timed = false;
                            grpc::Status s =
                                CopyPrefix(c, o.cache, kSourceSeq, seq, o.prefix_tokens);
                            whole[t] = s.ok();
                            return s;
                          }
                          whole[t] = false;
                          return Remove(c, o.cache, seq, o.prefix_tokens / 2);
                        }));
    PrintOp(ops.back(), o.threads);
  }
  // Visible of one query at the prefix's last position, answered as positions and as ranges.
  for (const bool as_ranges : {false, true}) {
    ops.push_back(RunOp(as_ranges ? "Visible (1 query, ranges)" : "Visible (1 query, positions)", o,
                        clients, [&](int, Client& c, bool*) {
                          grpc::ClientContext context;
                          SetDeadline(&context, absl::Seconds(10));
                          v1::VisibleRequest request;
                          request.set_cache(o.cache);
                          request.set_group(0);
                          request.set_as_ranges(as_ranges);
                          v1::Query* query = request.add_queries();
                          query->set_seq(kSourceSeq);
                          query->set_pos(o.prefix_tokens - 1);
                          v1::VisibleResponse response;
                          return c.stub->Visible(&context, request, &response);
                        }));
    PrintOp(ops.back(), o.threads);
  }
  ops.push_back(RunOp("ListMembers", o, clients, [&](int, Client& c, bool*) {
    grpc::ClientContext context;
    SetDeadline(&context, absl::Seconds(10));
    v1::ListMembersRequest request;
    v1::ListMembersResponse response;
    return c.stub->ListMembers(&context, request, &response);
  }));
  PrintOp(ops.back(), o.threads);
  {
    // Each thread appends to its own sequence; the payload content is the same every call.
    std::vector<int32_t> first_positions;
    for (int32_t p = 0; p < o.append_tokens; ++p) first_positions.push_back(p);
    const std::string payload = ctl::MakePatternPayload(spec, first_positions, kSeed);
    std::vector<int32_t> next(o.threads, 0);
    // Threads start from empty sequences (the CopyPrefix op does not touch them).
    ops.push_back(RunOp(absl::StrCat("Append (", o.append_tokens, " tokens, ",
                                     (payload.size() + 1023) >> 10, " KiB)"),
                        o, clients, [&](int t, Client& c, bool* timed) {
                          const int64_t seq = kAppendSeqBase + t;
                          if (next[t] + o.append_tokens > kAppendWindow) {
                            *timed = false;
                            next[t] = 0;
                            return Remove(c, o.cache, seq, 0);
                          }
                          grpc::ClientContext context;
                          SetDeadline(&context, absl::Seconds(10));
                          v1::AppendRequest request;
                          request.set_cache(o.cache);
                          for (int32_t i = 0; i < o.append_tokens; ++i) {
                            v1::Token* token = request.add_tokens();
                            token->set_seq(seq);
                            token->set_pos(next[t] + i);
                          }
                          request.set_payload(payload);
                          v1::AppendResponse response;
                          grpc::Status s = c.stub->Append(&context, request, &response);
                          if (s.ok()) next[t] += o.append_tokens;
                          return s;
                        }));
    PrintOp(ops.back(), o.threads);
  }

  // Goal 1 of issue 17: each scheduler-facing control call at >= 0.8 of Health/Check's rate on
  // the same node, in the same run (the decode-step Append is data, not control).
  std::printf("\ncontrol calls as a ratio of Health/Check's req/s (goal >= %.1f):\n", kControlGoal);
  const double health_rate = Rate(ops.front(), o.threads);
  for (size_t i = 1; i + 1 < ops.size(); ++i) {
    const double ratio = health_rate > 0 ? Rate(ops[i], o.threads) / health_rate : 0;
    std::printf("  %-38s %5.2f  %s\n", ops[i].name.c_str(), ratio,
                ratio >= kControlGoal ? "met" : "NOT met");
  }

  const int64_t bulk_bytes = static_cast<int64_t>(AppendPayloadBytes(spec, o.large_tokens, 1));
  std::printf("\nbulk: one call at a time, %d tokens = %.1f MiB per call, %d reps\n",
              o.large_tokens, bulk_bytes / 1048576.0, o.large_reps);
  std::printf("%-46s %6s %10s %10s %9s %9s\n", "op", "reps", "median ms", "best ms", "GB/s med",
              "GB/s best");
  std::vector<BulkResult> bulk = RunBulk(o, clients[0], spec);
  for (const BulkResult& r : bulk) PrintBulk(r, bulk_bytes);
  // The reference: the same bytes through raw loopback TCP, in this run.
  absl::StatusOr<std::vector<double>> tcp =
      testutil::LoopbackTcpSeconds(static_cast<size_t>(bulk_bytes), o.large_reps);
  if (!tcp.ok()) {
    std::printf("raw loopback TCP: failed: %s\n", tcp.status().ToString().c_str());
  } else {
    const double tcp_gbps = bulk_bytes / MedianSeconds(*tcp) / 1e9;
    std::printf("%-46s %6zu %10.1f %10s %9.2f %9s  (4 MiB buffers)\n", "raw loopback TCP",
                tcp->size(), MedianSeconds(*tcp) * 1e3, "", tcp_gbps, "");
    std::printf("bulk as a ratio of raw loopback TCP's GB/s (goal >= 0.5, issue 17 goal 3):\n");
    for (const BulkResult& r : bulk) {
      if (!r.error.empty() || r.name.rfind("Append (unary", 0) == 0) continue;
      const double ratio = bulk_bytes / MedianSeconds(r.seconds) / 1e9 / tcp_gbps;
      std::printf("  %-46s %5.2f  %s\n", r.name.c_str(), ratio, ratio >= 0.5 ? "met" : "NOT met");
    }
  }
  const IsolationResult isolation = RunIsolation(o, addr, clients[0], spec);
  PrintIsolation(isolation, o, bulk_bytes);

  bool failed = false;
  for (const OpResult& r : ops) failed = failed || r.errors > 0 || r.latencies_us.empty();
  for (const BulkResult& r : bulk) failed = failed || !r.error.empty() || r.wrong_elements != 0;
  failed = failed || !isolation.error.empty();

  {
    grpc::ClientContext context;
    SetDeadline(&context, absl::Seconds(30));
    v1::DeleteCacheRequest request;
    request.set_cache(o.cache);
    v1::DeleteCacheResponse response;
    grpc::Status s = clients[0].stub->DeleteCache(&context, request, &response);
    if (!s.ok()) {
      std::fprintf(stderr, "rpc_bench: DeleteCache: %s\n", ErrorText(s).c_str());
      failed = true;
    }
  }
  clients.clear();
  if (node) {
    const testutil::ExitStatus exit = node->Stop();
    if (!exit.clean()) {
      std::fprintf(stderr, "rpc_bench: kvmesh-node did not exit cleanly: %s\n",
                   exit.ToString().c_str());
      failed = true;
    }
  }
  return failed ? 1 : 0;
}

}  // namespace
}  // namespace kvmesh

int main(int argc, char** argv) { return kvmesh::Main(argc, argv); }

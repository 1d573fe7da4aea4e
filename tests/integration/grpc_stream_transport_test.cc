// The grpc-stream transport end to end over loopback TCP: an in-process gRPC server on
// 127.0.0.1:0 hosts a minimal PeerService whose Fetch is ServeFetch over in-memory leases, and
// GrpcStreamTransport pulls from it. Sizes from 0 bytes to 64 MiB (whose throughput is printed),
// corruption and wrong checksums (DATA_LOSS), unknown leases (NOT_FOUND), request validation,
// a sender that shuts down mid-transfer (UNAVAILABLE), deadlines (DEADLINE_EXCEEDED), sink
// errors (returned unchanged; the sender sees the cancel and drops the payload), lease renewal
// per chunk and concurrent transfers. Chunks that are copied (ReadAt) are read on a pool of the
// test's, standing in for the node's: never on gRPC's threads, a blocked read stalls nothing
// else, a refused read is UNAVAILABLE, and cancellation and shutdown with a read in flight.
#include "transport/grpc_stream_transport.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <malloc.h>
#include <sys/resource.h>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cache/mutex.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvmesh/v1/peer.grpc.pb.h"
#include "transport/checksum.h"

// ThreadSanitizer builds: Server::Shutdown with a deadline that has passed (the sender vanishing
// mid-transfer) makes gRPC cancel its calls with an error whose timestamp libabsl_time parses
// on another thread; that hand-off lies wholly inside the uninstrumented gRPC and Abseil
// libraries, like the races tests/sanitizers/tsan.supp suppresses. Kept here because only this test
// cancels server calls by shutting its server down.
#if defined(__SANITIZE_THREAD__)
#define KVMESH_TEST_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVMESH_TEST_TSAN 1
#endif
#endif
#ifdef KVMESH_TEST_TSAN
extern "C" const char* __tsan_default_suppressions() { return "called_from_lib:libabsl_time.so\n"; }
#endif

namespace kvmesh {
namespace transport {
namespace {

using ::testing::HasSubstr;

constexpr char kSenderName[] = "sender-a";

std::vector<uint8_t> PatternBytes(size_t n, uint64_t seed) {
  std::vector<uint8_t> v(n);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(v.data() + i, &x, 8);
  }
  for (; i < n; ++i) v[i] = static_cast<uint8_t>(i * 131 + seed);
  return v;
}

// How a MemoryPayload offers its bytes to the sender.
enum class Views {
  kWhole,   // View: as long a run as asked for (zero-copy chunks of one slice)
  kPieces,  // View: at most 4096 bytes at a time (chunks of many slices)
  kCrumbs,  // View: at most 100 bytes at a time (too many pieces: chunks are copied)
  kNone,    // no View: every chunk is read with ReadAt (the copy path)
};

// Called first thing in every ReadAt of a payload that has one, on ReadAt's thread.
using ReadHook = std::function<void()>;

class MemoryPayload final : public LeasedPayload {
 public:
  explicit MemoryPayload(std::vector<uint8_t> bytes, Views views = Views::kWhole,
                         ReadHook on_read = nullptr)
      : bytes_(std::move(bytes)), views_(views), on_read_(std::move(on_read)) {}
  size_t size() const override { return bytes_.size(); }
  absl::Span<const uint8_t> View(size_t offset, size_t max_bytes) const override {
    if (views_ == Views::kNone || offset >= bytes_.size()) return {};
    size_t n = std::min(max_bytes, bytes_.size() - offset);
    if (views_ == Views::kPieces) n = std::min<size_t>(n, 4096);
    if (views_ == Views::kCrumbs) n = std::min<size_t>(n, 100);
    return {bytes_.data() + offset, n};
  }
  absl::Status ReadAt(size_t offset, absl::Span<uint8_t> dst) override {
    if (on_read_) on_read_();
    if (offset > bytes_.size() || dst.size() > bytes_.size() - offset) {
      return absl::OutOfRangeError(
          absl::StrCat("ReadAt(", offset, ", ", dst.size(), ") past the end of ", bytes_.size()));
    }
    if (!dst.empty()) std::memcpy(dst.data(), bytes_.data() + offset, dst.size());
    return absl::OkStatus();
  }
  const std::vector<uint8_t>& bytes() const { return bytes_; }

 private:
  const std::vector<uint8_t> bytes_;
  const Views views_;
  const ReadHook on_read_;
};

// Leases held in memory; counts Touch calls per lease.
class FakeLeases final : public LeaseLookup {
 public:
  uint64_t Add(std::vector<uint8_t> bytes, Views views = Views::kWhole,
               ReadHook on_read = nullptr) {
    MutexLock lock(&mu_);
    const uint64_t id = next_id_++;
    leases_[id].payload =
        std::make_shared<MemoryPayload>(std::move(bytes), views, std::move(on_read));
    return id;
  }

  absl::StatusOr<std::shared_ptr<LeasedPayload>> Touch(const std::string& text) override {
    uint64_t id = 0;
    if (!absl::SimpleAtoi(text, &id)) {
      return absl::NotFoundError(absl::StrCat("lease ", text, " is unknown, released or expired"));
    }
    MutexLock lock(&mu_);
    auto it = leases_.find(id);
    if (it == leases_.end()) {
      return absl::NotFoundError(absl::StrCat("lease ", id, " is unknown, released or expired"));
    }
    ++it->second.touches;
    return std::shared_ptr<LeasedPayload>(it->second.payload);
  }

  int touches(uint64_t id) {
    MutexLock lock(&mu_);
    return leases_.at(id).touches;
  }
  // References to the payload beyond this map's own: a reactor that still holds it.
  long extra_refs(uint64_t id) {
    MutexLock lock(&mu_);
    return leases_.at(id).payload.use_count() - 1;
  }
  std::shared_ptr<MemoryPayload> payload(uint64_t id) {
    MutexLock lock(&mu_);
    return leases_.at(id).payload;
  }

 private:
  struct Entry {
    std::shared_ptr<MemoryPayload> payload;
    int touches = 0;
  };
  Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, Entry> leases_ ABSL_GUARDED_BY(mu_);
};

// One worker thread standing in for the node's transfer-read pool (SenderOptions::run_read):
// runs the reads it accepts in order, refuses once `Accept`'s allowance runs out (as a full
// queue does), and runs what it holds before its thread exits (as Executor::Shutdown does).
class ReadPool {
 public:
  ReadPool() : thread_([this] { Loop(); }) {}
  ~ReadPool() {
    {
      MutexLock lock(&mu_);
      stopping_ = true;
    }
    ready_.notify_one();
    thread_.join();
  }

  // SenderOptions::run_read.
  absl::Status Run(std::function<void()> read) {
    {
      MutexLock lock(&mu_);
      if (allowance_ == 0) {
        return absl::UnavailableError(
            absl::StrCat("the test's read pool refuses reads after ", accepted_));
      }
      if (allowance_ > 0) --allowance_;
      ++accepted_;
      queue_.push_back(std::move(read));
    }
    ready_.notify_one();
    return absl::OkStatus();
  }

  // Accept `n` more reads, then refuse them; -1 (the start): accept every read.
  void Accept(int64_t n) {
    MutexLock lock(&mu_);
    allowance_ = n;
  }
  int64_t accepted() {
    MutexLock lock(&mu_);
    return accepted_;
  }
  std::thread::id thread_id() const { return thread_.get_id(); }

 private:
  void Loop() {
    for (;;) {
      std::function<void()> read;
      {
        MutexLock lock(&mu_);
        while (queue_.empty() && !stopping_) ready_.wait(mu_);
        if (queue_.empty()) return;  // stopping, and drained
        read = std::move(queue_.front());
        queue_.pop_front();
      }
      read();
    }
  }

  Mutex mu_;
  std::condition_variable_any ready_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  int64_t allowance_ ABSL_GUARDED_BY(mu_) = -1;
  int64_t accepted_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: it starts once the members above exist
};

// Records the threads a payload's ReadAt runs on; a gated probe holds every ReadAt until Open.
class ReadProbe {
 public:
  explicit ReadProbe(bool gated = false) : gated_(gated) {}

  // The payload's ReadHook. REQUIRES: the probe outlives the payload's reads.
  ReadHook Hook() {
    return [this] {
      MutexLock lock(&mu_);
      threads_.push_back(std::this_thread::get_id());
      changed_.notify_all();
      while (gated_ && !open_) changed_.wait(mu_);
    };
  }

  // Lets every read through, held or to come.
  void Open() {
    {
      MutexLock lock(&mu_);
      open_ = true;
    }
    changed_.notify_all();
  }
  // Waits until `n` reads have begun (true) or `timeout` passes (false).
  bool WaitForReads(size_t n, absl::Duration timeout) {
    const auto deadline = absl::ToChronoTime(absl::Now() + timeout);
    MutexLock lock(&mu_);
    while (threads_.size() < n) {
      if (changed_.wait_until(mu_, deadline) == std::cv_status::timeout) {
        return threads_.size() >= n;
      }
    }
    return true;
  }
  std::vector<std::thread::id> threads() {
    MutexLock lock(&mu_);
    return threads_;
  }

 private:
  const bool gated_;
  Mutex mu_;
  std::condition_variable_any changed_;
  std::vector<std::thread::id> threads_ ABSL_GUARDED_BY(mu_);
  bool open_ ABSL_GUARDED_BY(mu_) = false;
};

// The node's PeerService reduced to Fetch, delegating to ServeFetch as the node does.
class TestPeerService final : public transport::PeerServiceWithRawFetch {
 public:
  TestPeerService(LeaseLookup* leases, SenderOptions options)
      : leases_(leases), options_(options) {}
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Fetch(grpc::CallbackServerContext* context,
                                                    const grpc::ByteBuffer* request) override {
    return ServeFetch(context, request, leases_, options_);
  }

 private:
  LeaseLookup* const leases_;
  const SenderOptions options_;
};

// A sender that streams given raw messages, whatever is asked: for what ServeFetch never sends.
class ScriptedPeerService final : public transport::PeerServiceWithRawFetch {
 public:
  explicit ScriptedPeerService(std::vector<std::string> messages)
      : messages_(std::move(messages)) {}
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Fetch(grpc::CallbackServerContext*,
                                                    const grpc::ByteBuffer*) override {
    class Reactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
     public:
      explicit Reactor(const std::vector<std::string>& messages) : messages_(messages) { Next(); }
      void OnWriteDone(bool ok) override {
        if (!ok) {
          Finish(grpc::Status::CANCELLED);
          return;
        }
        Next();
      }
      void OnDone() override { delete this; }

     private:
      void Next() {
        if (next_ == messages_.size()) {
          Finish(grpc::Status::OK);
          return;
        }
        grpc::Slice slice(messages_[next_++]);
        buffer_ = grpc::ByteBuffer(&slice, 1);
        StartWrite(&buffer_);
      }
      const std::vector<std::string>& messages_;
      size_t next_ = 0;
      grpc::ByteBuffer buffer_;
    };
    return new Reactor(messages_);
  }

 private:
  const std::vector<std::string> messages_;
};

// A serialized Chunk; crc32c left out when `crc` is empty.
std::string ChunkMessage(int64_t offset, const std::string& data, std::optional<uint32_t> crc) {
  v1::Chunk chunk;
  chunk.set_offset(offset);
  chunk.set_data(data);
  if (crc.has_value()) chunk.set_crc32c(*crc);
  return chunk.SerializeAsString();
}

uint32_t Crc32cOf(const std::string& s) {
  return Crc32c(absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.data()), s.size()));
}

// User + system CPU time of this process, sender and receiver together: on a shared machine
// it varies less than the wall time.
double CpuSeconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
         static_cast<double>(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) * 1e-6;
}

// Polls `done` until it holds or `timeout` passes.
template <typename F>
bool WaitFor(F done, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!done()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(2));
  }
  return true;
}

class GrpcStreamTransportTest : public ::testing::Test {
 protected:
  ~GrpcStreamTransportTest() override { StopServer(absl::Seconds(5)); }

  // Chunks that need a copy are read on read_pool_, as the node reads them on its pool, unless
  // `options` brings a runner of its own or `inline_reads` asks for none (reads on gRPC's
  // thread, what a sender without a runner does).
  void StartServer(SenderOptions options = {}, bool inline_reads = false) {
    if (!options.run_read && !inline_reads) {
      options.run_read = [this](std::function<void()> read) {
        return read_pool_.Run(std::move(read));
      };
    }
    service_ = std::make_unique<TestPeerService>(&leases_, options);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port, 0);
    address_ = absl::StrCat("127.0.0.1:", port);
  }

  // Shuts the server down, cancelling calls still running after `grace`.
  void StopServer(absl::Duration grace) {
    if (server_ == nullptr) return;
    server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
    server_->Wait();
    server_.reset();
  }

  Lease MakeLease(uint64_t id) {
    Lease lease;
    lease.sender_name = kSenderName;
    lease.sender_address = address_;
    lease.id = std::to_string(id);
    const std::shared_ptr<MemoryPayload> payload = leases_.payload(id);
    lease.payload_bytes = payload->size();
    lease.has_crc32c = true;
    lease.crc32c = Crc32c(payload->bytes());
    return lease;
  }

  // A transport whose channels carry MakeChannelArguments(options), one per address.
  std::unique_ptr<GrpcStreamTransport> MakeTransport(GrpcStreamTransport::Options options = {}) {
    const grpc::ChannelArguments args = GrpcStreamTransport::MakeChannelArguments(options);
    auto factory = [this, args](const std::string& address) {
      MutexLock lock(&channels_mu_);
      std::shared_ptr<grpc::Channel>& channel = channels_[address];
      if (channel == nullptr) {
        channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
      }
      return channel;
    };
    return std::make_unique<GrpcStreamTransport>(factory, options);
  }

  // Receives `lease` into `out`; returns the status and the number of sink calls.
  absl::Status ReceiveAll(GrpcStreamTransport& transport, const Lease& lease,
                          std::vector<uint8_t>* out, int* sink_calls = nullptr,
                          absl::Duration timeout = absl::Seconds(60)) {
    int calls = 0;
    const absl::Status status = transport.Receive(
        lease,
        [&](absl::Span<const uint8_t> piece) {
          ++calls;
          out->insert(out->end(), piece.begin(), piece.end());
          return absl::OkStatus();
        },
        absl::Now() + timeout);
    if (sink_calls != nullptr) *sink_calls = calls;
    return status;
  }

  // Receives `lease` (its sender fields and id filled in here) from a ScriptedPeerService that
  // streams `messages`, started for this call and shut down after it.
  absl::Status ReceiveScripted(std::vector<std::string> messages, Lease lease,
                               std::vector<uint8_t>* got) {
    ScriptedPeerService service(std::move(messages));
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service);
    std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
    if (server == nullptr) return absl::InternalError("the scripted sender did not start");
    lease.sender_name = kSenderName;
    lease.sender_address = absl::StrCat("127.0.0.1:", port);
    lease.id = "1";
    const absl::Status status = ReceiveAll(*MakeTransport(), lease, got);
    server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    server->Wait();
    return status;
  }

  // Direct Fetch, for what Receive never asks: the chunks (offset, size) or the error.
  grpc::Status RawFetch(const v1::FetchRequest& request,
                        std::vector<std::pair<int64_t, size_t>>* chunks) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);
    auto stub = v1::PeerService::NewStub(
        grpc::CreateCustomChannel(address_, grpc::InsecureChannelCredentials(), args));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    auto reader = stub->Fetch(&context, request);
    v1::Chunk chunk;
    while (reader->Read(&chunk)) {
      // A protobuf parser reads the sender's hand-written fields; each chunk's CRC is its own.
      EXPECT_TRUE(chunk.has_crc32c());
      EXPECT_EQ(chunk.crc32c(), Crc32cOf(chunk.data())) << "chunk at offset " << chunk.offset();
      chunks->emplace_back(chunk.offset(), chunk.data().size());
    }
    return reader->Finish();
  }

  // Moves a 64 MiB lease five times and prints each run's throughput, labelled `label`.
  void Transfer64MiB(const char* label) {
    StartServer();
    constexpr size_t kBytes = size_t{64} << 20;
    const uint64_t id = leases_.Add(PatternBytes(kBytes, 64));
    const Lease lease = MakeLease(id);
    auto transport = MakeTransport();
    std::vector<uint8_t> got(kBytes);
    double best = 0;
    for (int run = 0; run < 5; ++run) {
      size_t at = 0;
      const double cpu_start = CpuSeconds();
      const auto start = std::chrono::steady_clock::now();
      const absl::Status status = transport->Receive(
          lease,
          [&](absl::Span<const uint8_t> piece) {
            std::memcpy(got.data() + at, piece.data(), piece.size());
            at += piece.size();
            return absl::OkStatus();
          },
          absl::Now() + absl::Seconds(120));
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      ASSERT_TRUE(status.ok()) << status;
      ASSERT_EQ(at, kBytes);
      const double cpu = CpuSeconds() - cpu_start;
      const double gbps = static_cast<double>(kBytes) / seconds / 1e9;
      best = std::max(best, gbps);
      std::printf(
          "grpc-stream loopback (%s): %zu bytes in %.1f ms = %.2f GB/s; %.1f ms of CPU "
          "on both sides (run %d)\n",
          label, kBytes, seconds * 1e3, gbps, cpu * 1e3, run);
    }
    std::printf("grpc-stream loopback 64 MiB (%s): best %.2f GB/s\n", label, best);
    EXPECT_TRUE(got == leases_.payload(id)->bytes());
  }

  FakeLeases leases_;
  ReadPool read_pool_;  // outlives the server: the destructor stops the server first
  std::unique_ptr<TestPeerService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  Mutex channels_mu_;
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_ ABSL_GUARDED_BY(channels_mu_);
};

// Sizes around the chunk size: 0 and 1 byte, exactly one chunk, one byte over, many chunks with
// an odd chunk size and an odd tail. Data and CRC arrive intact; the lease is touched once per
// chunk (and once for an empty payload).
TEST_F(GrpcStreamTransportTest, TransfersEverySize) {
  StartServer();
  struct Case {
    size_t bytes;
    int32_t chunk_bytes;
    int chunks;
  };
  const std::vector<Case> cases = {
      {0, 4096, 0},
      {1, 4096, 1},
      {4096, 4096, 1},
      {4097, 4096, 2},
      {100003, 4099, 25},
      {size_t{4} << 20, kDefaultChunkBytes, 1},
      {(size_t{4} << 20) + 1, kDefaultChunkBytes, 2},
      {(size_t{9} << 20) + 7, 0, 3},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat(c.bytes, " bytes in chunks of ", c.chunk_bytes));
    const uint64_t id = leases_.Add(PatternBytes(c.bytes, c.bytes + 1));
    GrpcStreamTransport::Options options;
    options.chunk_bytes = c.chunk_bytes;
    auto transport = MakeTransport(options);
    EXPECT_STREQ(transport->name(), kGrpcStream);
    std::vector<uint8_t> got;
    int sink_calls = 0;
    ASSERT_TRUE(ReceiveAll(*transport, MakeLease(id), &got, &sink_calls).ok());
    EXPECT_EQ(got, leases_.payload(id)->bytes());
    // The sink gets each chunk in the pieces gRPC read it in: at least one per chunk.
    EXPECT_GE(sink_calls, c.chunks);
    EXPECT_EQ(leases_.touches(id), std::max(1, c.chunks));
  }
}

// 64 MiB over loopback with the default 4 MiB chunks (and the transport's channel arguments),
// five times on one channel (the first also connects and grows the HTTP/2 window); prints the
// throughput.
TEST_F(GrpcStreamTransportTest, Transfers64MiB) { Transfer64MiB("default malloc"); }

// A byte flipped on the way (after the sender computed the chunk's CRC-32C): DATA_LOSS naming
// the chunk and both checksums, at that chunk; the sink saw nothing past it.
TEST_F(GrpcStreamTransportTest, CorruptChunkIsDataLoss) {
  SenderOptions sender;
  sender.corrupt_chunk = 2;
  StartServer(sender);
  const uint64_t id = leases_.Add(PatternBytes(10 * 4096 + 5, 7));
  GrpcStreamTransport::Options options;
  options.chunk_bytes = 4096;
  auto transport = MakeTransport(options);
  for (const bool whole : {true, false}) {
    SCOPED_TRACE(whole ? "lease with a whole-payload CRC" : "chunk CRCs only");
    Lease lease = MakeLease(id);
    lease.has_crc32c = whole;
    std::vector<uint8_t> got;
    const absl::Status status = ReceiveAll(*transport, lease, &got);
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
    const std::vector<uint8_t>& want = leases_.payload(id)->bytes();
    ASSERT_EQ(got.size(), 3u * 4096);  // chunks 0, 1 and the corrupted 2
    const auto chunk2 = [](const std::vector<uint8_t>& v) {
      return absl::MakeConstSpan(v).subspan(2 * 4096, 4096);
    };
    EXPECT_THAT(std::string(status.message()),
                HasSubstr(absl::StrCat(
                    "CRC-32C of the 4096 bytes of the chunk at offset 8192 is 0x",
                    absl::Hex(Crc32c(chunk2(got)), absl::kZeroPad8), " but the sender computed 0x",
                    absl::Hex(Crc32c(chunk2(want)), absl::kZeroPad8))));
    EXPECT_THAT(std::string(status.message()), HasSubstr(kSenderName));
    // Exactly one byte, in chunk 2, differs; the payload itself is intact.
    int differing = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      if (got[i] != want[i]) {
        ++differing;
        EXPECT_EQ(i / 4096, 2u);
      }
    }
    EXPECT_EQ(differing, 1);
  }
  std::vector<uint8_t> again;
  SenderOptions clean;
  StopServer(absl::Seconds(5));
  StartServer(clean);
  ASSERT_TRUE(ReceiveAll(*MakeTransport(options), MakeLease(id), &again).ok());
  EXPECT_TRUE(again == leases_.payload(id)->bytes());
}

// Chunks that ServeFetch never sends but a receiver must not trust: no crc32c, a wrong one, a
// truncated message (its crc32c cut short), a field of the wrong wire type, a gap. Each is
// DATA_LOSS naming what is wrong.
TEST_F(GrpcStreamTransportTest, MalformedChunksAreDataLoss) {
  const std::string data = "0123456789";
  struct Case {
    const char* name;
    std::vector<std::string> messages;
    const char* message;
  };
  const std::string good = ChunkMessage(0, data, Crc32cOf(data));
  const std::vector<Case> cases = {
      {"no crc32c", {ChunkMessage(0, data, std::nullopt)}, "chunk at offset 0 carries no crc32c"},
      {"wrong crc32c",
       {good, ChunkMessage(10, data, Crc32cOf(data) ^ 1)},
       "of the chunk at offset 10 is 0x"},
      {"truncated", {good.substr(0, good.size() - 3)}, "does not parse: field 3"},
      {"wire type", {std::string("\x0d\x01\x02\x03\x04", 5)}, "field 1 has wire type 5"},
      {"gap",
       {good, ChunkMessage(20, data, Crc32cOf(data))},
       "chunk at offset 20 but 10 bytes were received before it"},
      {"no data", {good, ChunkMessage(10, "", Crc32cOf(""))}, "chunk at offset 10 carries no data"},
      {"field 0", {std::string("\x00\x01", 2)}, "does not parse: field 0"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Lease lease;
    lease.payload_bytes = 30;
    std::vector<uint8_t> got;
    const absl::Status status = ReceiveScripted(c.messages, lease, &got);
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.message)) << status;
  }
}

// An older sender announced the whole payload's CRC-32C and sent chunks without their own: the
// receiver accepts them when the lease has the whole one, and checks that one.
TEST_F(GrpcStreamTransportTest, ChunksWithoutCrcNeedTheWholeOne) {
  const std::string a = "0123456789", b = "abcdefghij";
  for (const bool right : {true, false}) {
    SCOPED_TRACE(right ? "right whole CRC" : "wrong whole CRC");
    Lease lease;
    lease.payload_bytes = 20;
    lease.has_crc32c = true;
    lease.crc32c = Crc32cOf(a + b) ^ (right ? 0 : 1);
    std::vector<uint8_t> got;
    const absl::Status status = ReceiveScripted(
        {ChunkMessage(0, a, std::nullopt), ChunkMessage(10, b, std::nullopt)}, lease, &got);
    if (right) {
      EXPECT_TRUE(status.ok()) << status;
      EXPECT_EQ(std::string(got.begin(), got.end()), a + b);
    } else {
      EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
      EXPECT_THAT(std::string(status.message()), HasSubstr("but Export announced"));
    }
  }
}

// Payloads in host memory go out as views of it (one slice, or many small ones per chunk, or
// copied when the pieces are too many); others through ReadAt. All arrive intact, with and
// without a whole-payload CRC, whether the copies are read on a pool or inline (a sender
// without a runner).
TEST_F(GrpcStreamTransportTest, ViewsAndReadsArriveAlike) {
  for (const bool inline_reads : {false, true}) {
    StopServer(absl::Seconds(5));
    StartServer({}, inline_reads);
    GrpcStreamTransport::Options options;
    options.chunk_bytes = 64 * 1024;
    auto transport = MakeTransport(options);
    for (const Views views : {Views::kWhole, Views::kPieces, Views::kCrumbs, Views::kNone}) {
      const uint64_t id = leases_.Add(PatternBytes(1000 * 1000 + 7, 21), views);
      for (const bool whole : {true, false}) {
        SCOPED_TRACE(absl::StrCat("views ", static_cast<int>(views), ", whole crc ", whole,
                                  inline_reads ? ", inline reads" : ", reads on the pool"));
        Lease lease = MakeLease(id);
        lease.has_crc32c = whole;
        std::vector<uint8_t> got;
        const absl::Status status = ReceiveAll(*transport, lease, &got);
        ASSERT_TRUE(status.ok()) << status;
        EXPECT_TRUE(got == leases_.payload(id)->bytes());
      }
      // The slices that pointed into the payload are gone once gRPC is done with them.
      EXPECT_TRUE(WaitFor([&] { return leases_.extra_refs(id) == 0; }, absl::Seconds(5)));
      EXPECT_TRUE(AwaitPayloadSlicesReleased(absl::Now() + absl::Seconds(5)));
    }
  }
  // kPieces: 16 slices per 64 KiB chunk; kCrumbs: more pieces than a chunk may have slices
  // (64 KiB / 100 > 64), so those chunks are copied.
}

TEST_F(GrpcStreamTransportTest, WrongChecksumIsDataLoss) {
  StartServer();
  const uint64_t id = leases_.Add(PatternBytes(300000, 8));
  auto transport = MakeTransport();
  Lease lease = MakeLease(id);
  const uint32_t actual = lease.crc32c;
  lease.crc32c ^= 0x00010000;
  std::vector<uint8_t> got;
  const absl::Status status = ReceiveAll(*transport, lease, &got);
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_THAT(std::string(status.message()),
              HasSubstr(absl::StrCat("is 0x", absl::Hex(actual, absl::kZeroPad8),
                                     " but Export announced 0x",
                                     absl::Hex(lease.crc32c, absl::kZeroPad8))));
}

// The lease announces fewer bytes than the sender streams: DATA_LOSS naming the offsets, and
// the stream is cancelled. More bytes than the sender has: DATA_LOSS naming both sizes.
TEST_F(GrpcStreamTransportTest, WrongSizeIsDataLoss) {
  StartServer();
  const uint64_t id = leases_.Add(PatternBytes(10000, 9));
  GrpcStreamTransport::Options options;
  options.chunk_bytes = 4000;
  auto transport = MakeTransport(options);
  {
    Lease lease = MakeLease(id);
    lease.payload_bytes = 9000;
    std::vector<uint8_t> got;
    const absl::Status status = ReceiveAll(*transport, lease, &got);
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
    EXPECT_THAT(std::string(status.message()),
                HasSubstr("chunk at offset 8000 of 2000 bytes runs to offset 10000, past the "
                          "payload's 9000 bytes"));
    EXPECT_EQ(got.size(), 8000u);
  }
  {
    Lease lease = MakeLease(id);
    lease.payload_bytes = 10001;
    std::vector<uint8_t> got;
    const absl::Status status = ReceiveAll(*transport, lease, &got);
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
    EXPECT_THAT(std::string(status.message()),
                HasSubstr("the stream ended after 10000 of 10001 bytes"));
  }
}

TEST_F(GrpcStreamTransportTest, UnknownLeaseIsNotFound) {
  StartServer();
  auto transport = MakeTransport();
  Lease lease;
  lease.sender_name = kSenderName;
  lease.sender_address = address_;
  lease.id = "12345";
  lease.payload_bytes = 10;
  std::vector<uint8_t> got;
  const absl::Status status = ReceiveAll(*transport, lease, &got);
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("lease 12345 is unknown"));
  EXPECT_THAT(std::string(status.message()), HasSubstr(kSenderName));
}

TEST_F(GrpcStreamTransportTest, NoSenderIsUnavailable) {
  StartServer();
  const uint64_t id = leases_.Add(PatternBytes(1000, 10));
  const Lease lease = MakeLease(id);
  StopServer(absl::Seconds(5));  // nothing listens on the address any more
  auto transport = MakeTransport();
  std::vector<uint8_t> got;
  const absl::Status status = ReceiveAll(*transport, lease, &got, nullptr, absl::Seconds(20));
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(kSenderName));

  GrpcStreamTransport no_channel([](const std::string&) { return nullptr; });
  const absl::Status none = no_channel.Receive(
      lease, [](absl::Span<const uint8_t>) { return absl::OkStatus(); }, absl::InfiniteFuture());
  EXPECT_EQ(none.code(), absl::StatusCode::kUnavailable) << none;
  EXPECT_THAT(std::string(none.message()), HasSubstr(kSenderName));
}

// The sender's checks of FetchRequest, and resuming at an offset.
TEST_F(GrpcStreamTransportTest, SenderValidatesRequest) {
  SenderOptions sender;
  sender.default_chunk_bytes = 1000;
  sender.max_chunk_bytes = 3000;
  StartServer(sender);
  const uint64_t id = leases_.Add(PatternBytes(10000, 11));
  std::vector<std::pair<int64_t, size_t>> chunks;
  v1::FetchRequest request;
  request.set_lease_id(std::to_string(id));

  request.set_offset(-1);
  grpc::Status status = RawFetch(request, &chunks);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("offset = -1 is negative"));

  request.set_offset(10001);
  status = RawFetch(request, &chunks);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_THAT(status.error_message(), HasSubstr("offset = 10001 is past the end"));

  request.set_offset(0);
  request.set_chunk_bytes(-5);
  status = RawFetch(request, &chunks);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("chunk_bytes = -5 is negative"));
  EXPECT_TRUE(chunks.empty());

  request.set_offset(10000);  // at the end: nothing to send
  request.set_chunk_bytes(0);
  EXPECT_TRUE(RawFetch(request, &chunks).ok());
  EXPECT_TRUE(chunks.empty());

  request.set_offset(4500);  // chunk_bytes 0: the sender's default
  EXPECT_TRUE(RawFetch(request, &chunks).ok());
  const std::vector<std::pair<int64_t, size_t>> defaults = {
      {4500, 1000}, {5500, 1000}, {6500, 1000}, {7500, 1000}, {8500, 1000}, {9500, 500}};
  EXPECT_EQ(chunks, defaults);

  chunks.clear();
  request.set_offset(0);
  request.set_chunk_bytes(1 << 30);  // clamped to max_chunk_bytes
  EXPECT_TRUE(RawFetch(request, &chunks).ok());
  const std::vector<std::pair<int64_t, size_t>> clamped = {
      {0, 3000}, {3000, 3000}, {6000, 3000}, {9000, 1000}};
  EXPECT_EQ(chunks, clamped);

  chunks.clear();
  request.set_lease_id("999");
  status = RawFetch(request, &chunks);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
}

// Runs Receive of `lease` on a thread; the sink counts bytes. For the fault tests.
class BackgroundReceive {
 public:
  BackgroundReceive(GrpcStreamTransport* transport, const Lease& lease, absl::Time deadline)
      : thread_([this, transport, lease, deadline] {
          const absl::Time start = absl::Now();
          status_ = transport->Receive(
              lease,
              [this](absl::Span<const uint8_t> piece) {
                received_ += piece.size();
                return absl::OkStatus();
              },
              deadline);
          elapsed_ = absl::Now() - start;
          done_.store(true);
        }) {}
  ~BackgroundReceive() { Join(); }

  void Join() {
    if (thread_.joinable()) thread_.join();
  }
  uint64_t received() const { return received_.load(); }
  // Whether Receive has returned (Join then returns at once).
  bool done() const { return done_.load(); }
  // After Join().
  const absl::Status& status() const { return status_; }
  absl::Duration elapsed() const { return elapsed_; }

 private:
  std::atomic<uint64_t> received_{0};
  std::atomic<bool> done_{false};
  absl::Status status_;
  absl::Duration elapsed_;
  std::thread thread_;
};

// The sender's server shuts down while a slow transfer is under way: UNAVAILABLE naming the
// sender, at once, and the sender's reactor lets go of the payload.
TEST_F(GrpcStreamTransportTest, SenderShutdownMidTransferIsUnavailable) {
  SenderOptions sender;
  sender.chunk_delay = absl::Milliseconds(50);
  StartServer(sender);
  const uint64_t id = leases_.Add(PatternBytes(200 * 1024, 12));  // 200 chunks: 10 s
  GrpcStreamTransport::Options options;
  options.chunk_bytes = 1024;
  auto transport = MakeTransport(options);
  BackgroundReceive receive(transport.get(), MakeLease(id), absl::Now() + absl::Seconds(60));
  ASSERT_TRUE(WaitFor([&] { return receive.received() >= 2048; }, absl::Seconds(20)));
  StopServer(absl::ZeroDuration());
  receive.Join();
  EXPECT_EQ(receive.status().code(), absl::StatusCode::kUnavailable) << receive.status();
  EXPECT_THAT(std::string(receive.status().message()), HasSubstr(kSenderName));
  EXPECT_LT(receive.received(), 200u * 1024);
  EXPECT_LT(receive.elapsed(), absl::Seconds(8));
  // Shutdown returned: every reactor is done; the chunks' slices go with the connections.
  EXPECT_TRUE(AwaitPayloadSlicesReleased(absl::Now() + absl::Seconds(5)));
  EXPECT_EQ(leases_.extra_refs(id), 0);
}

// A deadline shorter than a slow transfer: DEADLINE_EXCEEDED soon after the deadline, and the
// sender sees the cancel and lets go of the payload.
TEST_F(GrpcStreamTransportTest, DeadlineShorterThanTransfer) {
  SenderOptions sender;
  sender.chunk_delay = absl::Milliseconds(100);
  StartServer(sender);
  const uint64_t id = leases_.Add(PatternBytes(100 * 1024, 13));  // 100 chunks: 10 s
  GrpcStreamTransport::Options options;
  options.chunk_bytes = 1024;
  auto transport = MakeTransport(options);
  BackgroundReceive receive(transport.get(), MakeLease(id), absl::Now() + absl::Milliseconds(500));
  receive.Join();
  EXPECT_EQ(receive.status().code(), absl::StatusCode::kDeadlineExceeded) << receive.status();
  EXPECT_THAT(std::string(receive.status().message()), HasSubstr(kSenderName));
  EXPECT_LT(receive.elapsed(), absl::Seconds(3));
  EXPECT_TRUE(WaitFor([&] { return leases_.extra_refs(id) == 0; }, absl::Seconds(5)));
  EXPECT_LT(leases_.touches(id), 50);

  // A deadline already past fails at once.
  std::vector<uint8_t> got;
  const absl::Status past = transport->Receive(
      MakeLease(id), [](absl::Span<const uint8_t>) { return absl::OkStatus(); },
      absl::Now() - absl::Seconds(1));
  EXPECT_EQ(past.code(), absl::StatusCode::kDeadlineExceeded) << past;
}

// A sink error stops the transfer and comes back unchanged; the sender sees the cancel and
// drops its reference to the payload long before the transfer would have ended. Once with a
// slow sender (the cancel lands while a chunk_delay alarm is pending) and once at full speed
// (it lands on a write).
TEST_F(GrpcStreamTransportTest, SinkErrorStopsTransfer) {
  for (const bool slow : {true, false}) {
    SCOPED_TRACE(slow ? "slow sender" : "full-speed sender");
    SenderOptions sender;
    if (slow) sender.chunk_delay = absl::Milliseconds(50);
    StartServer(sender);
    const size_t chunks = slow ? 200 : 4096;
    const uint64_t id = leases_.Add(PatternBytes(chunks * 16384, 14));
    GrpcStreamTransport::Options options;
    options.chunk_bytes = 16384;
    auto transport = MakeTransport(options);
    const absl::Status refusal = absl::ResourceExhaustedError("sink is full after two pieces");
    int calls = 0;
    const absl::Status status = transport->Receive(
        MakeLease(id),
        [&](absl::Span<const uint8_t>) { return ++calls == 2 ? refusal : absl::OkStatus(); },
        absl::Now() + absl::Seconds(60));
    EXPECT_EQ(status, refusal);
    EXPECT_EQ(calls, 2);
    EXPECT_TRUE(WaitFor([&] { return leases_.extra_refs(id) == 0; }, absl::Seconds(5)));
    EXPECT_LT(leases_.touches(id), static_cast<int>(chunks));
    StopServer(absl::Seconds(5));
  }
}

// Chunks that are copied (no View, or too many pieces) are read on the sender's runner, never
// on gRPC's callback threads: for a CUDA export each read waits for a device copy. Chunks of
// views never reach the runner.
TEST_F(GrpcStreamTransportTest, CopiedChunksAreReadOffGrpcThreads) {
  StartServer();
  GrpcStreamTransport::Options options;
  options.chunk_bytes = 64 * 1024;
  auto transport = MakeTransport(options);
  constexpr size_t kBytes = 1000 * 1000 + 7;
  constexpr int64_t kChunks = 16;  // 15 of 64 KiB and a tail
  std::vector<std::unique_ptr<ReadProbe>> probes;
  for (const Views views : {Views::kNone, Views::kCrumbs, Views::kWhole}) {
    SCOPED_TRACE(absl::StrCat("views ", static_cast<int>(views)));
    probes.push_back(std::make_unique<ReadProbe>());
    ReadProbe& probe = *probes.back();
    const uint64_t id = leases_.Add(PatternBytes(kBytes, 31), views, probe.Hook());
    const int64_t accepted = read_pool_.accepted();
    std::vector<uint8_t> got;
    const absl::Status status = ReceiveAll(*transport, MakeLease(id), &got);
    ASSERT_TRUE(status.ok()) << status;
    EXPECT_TRUE(got == leases_.payload(id)->bytes());
    const std::vector<std::thread::id> threads = probe.threads();
    if (views == Views::kWhole) {
      EXPECT_TRUE(threads.empty());
      EXPECT_EQ(read_pool_.accepted(), accepted);
      continue;
    }
    EXPECT_EQ(static_cast<int64_t>(threads.size()), kChunks);
    EXPECT_EQ(read_pool_.accepted() - accepted, kChunks);
    for (size_t i = 0; i < threads.size(); ++i) {
      EXPECT_EQ(threads[i], read_pool_.thread_id()) << "the read of chunk " << i;
    }
  }
}

// A read that blocks (a device copy behind a busy GPU stream) holds only the pool's thread:
// while four transfers wait on it (one read held, three queued), the server keeps serving
// other transfers, and the held ones complete once the reads return.
TEST_F(GrpcStreamTransportTest, BlockedReadStallsNothingElse) {
  StartServer();
  GrpcStreamTransport::Options options;
  options.chunk_bytes = 64 * 1024;
  auto transport = MakeTransport(options);
  ReadProbe gate(/*gated=*/true);
  constexpr size_t kHeldBytes = 300 * 1000;
  std::vector<std::unique_ptr<BackgroundReceive>> held;
  for (int i = 0; i < 4; ++i) {
    const uint64_t id = leases_.Add(PatternBytes(kHeldBytes, 40 + i), Views::kNone, gate.Hook());
    held.push_back(std::make_unique<BackgroundReceive>(transport.get(), MakeLease(id),
                                                       absl::Now() + absl::Seconds(60)));
  }
  // Opens the gate on every way out, so that a failure does not leave the receives hanging.
  absl::Cleanup open_gate = [&gate] { gate.Open(); };
  ASSERT_TRUE(gate.WaitForReads(1, absl::Seconds(20)));
  EXPECT_TRUE(WaitFor([&] { return read_pool_.accepted() == 4; }, absl::Seconds(20)));
  for (int i = 0; i < 3; ++i) {
    const uint64_t id = leases_.Add(PatternBytes(kHeldBytes, 50 + i));
    std::vector<uint8_t> got;
    const absl::Status status =
        ReceiveAll(*transport, MakeLease(id), &got, nullptr, absl::Seconds(10));
    EXPECT_TRUE(status.ok()) << "transfer " << i << " while the reads are held: " << status;
    EXPECT_TRUE(got == leases_.payload(id)->bytes());
  }
  for (const auto& receive : held) EXPECT_EQ(receive->received(), 0u);
  gate.Open();
  for (const auto& receive : held) {
    receive->Join();
    EXPECT_TRUE(receive->status().ok()) << receive->status();
    EXPECT_EQ(receive->received(), kHeldBytes);
  }
  const std::vector<std::thread::id> threads = gate.threads();
  EXPECT_EQ(threads.size(), 4u * 5);  // 5 chunks each
  for (const std::thread::id thread : threads) EXPECT_EQ(thread, read_pool_.thread_id());
}

// A receiver whose deadline passes while its stream's read is queued behind a held one returns
// at its deadline; once the pool moves on, the sender finishes that stream (the queued read
// sees the cancellation) and lets go of the payload.
TEST_F(GrpcStreamTransportTest, ReceiverLeavesWhileReadQueued) {
  StartServer();
  GrpcStreamTransport::Options options;
  options.chunk_bytes = 64 * 1024;
  auto transport = MakeTransport(options);
  ReadProbe gate(/*gated=*/true);
  const uint64_t held = leases_.Add(PatternBytes(100 * 1000, 60), Views::kNone, gate.Hook());
  ReadProbe probe;
  const uint64_t queued = leases_.Add(PatternBytes(100 * 1000, 61), Views::kNone, probe.Hook());
  BackgroundReceive holder(transport.get(), MakeLease(held), absl::Now() + absl::Seconds(60));
  absl::Cleanup open_gate = [&gate] { gate.Open(); };  // before holder joins, on every way out
  ASSERT_TRUE(gate.WaitForReads(1, absl::Seconds(20)));
  BackgroundReceive leaver(transport.get(), MakeLease(queued),
                           absl::Now() + absl::Milliseconds(300));
  leaver.Join();
  EXPECT_EQ(leaver.status().code(), absl::StatusCode::kDeadlineExceeded) << leaver.status();
  EXPECT_EQ(leaver.received(), 0u);
  EXPECT_LT(leaver.elapsed(), absl::Seconds(3));
  EXPECT_TRUE(probe.threads().empty());  // its read waits behind the held one
  gate.Open();
  holder.Join();
  EXPECT_TRUE(holder.status().ok()) << holder.status();
  EXPECT_EQ(holder.received(), 100u * 1000);
  EXPECT_TRUE(WaitFor([&] { return leases_.extra_refs(queued) == 0; }, absl::Seconds(5)));
  // Normally none: the server's own deadline cancelled the stream before the pool reached its
  // read. At most the one that was queued, never a second.
  EXPECT_LE(probe.threads().size(), 1u);
}

// A read the pool refuses (its queue full, or the node shutting down) ends the stream with the
// pool's UNAVAILABLE, naming the lease and the offset: at the first chunk or mid-transfer. The
// lease stays whole, so a later attempt gets it.
TEST_F(GrpcStreamTransportTest, RefusedReadIsUnavailable) {
  StartServer();
  const uint64_t id = leases_.Add(PatternBytes(10 * 4096, 35), Views::kNone);
  GrpcStreamTransport::Options options;
  options.chunk_bytes = 4096;
  auto transport = MakeTransport(options);
  for (const int64_t accept : {0, 3}) {
    SCOPED_TRACE(absl::StrCat("the pool accepts ", accept, " reads"));
    read_pool_.Accept(accept);
    std::vector<uint8_t> got;
    const absl::Status status = ReceiveAll(*transport, MakeLease(id), &got);
    EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
    EXPECT_THAT(std::string(status.message()),
                HasSubstr(absl::StrCat("lease ", id, " at offset ", accept * 4096,
                                       ": the chunk's read was refused: the test's read pool "
                                       "refuses reads after ")));
    EXPECT_THAT(std::string(status.message()), HasSubstr(kSenderName));
    EXPECT_EQ(got.size(), static_cast<size_t>(accept) * 4096);
    EXPECT_TRUE(WaitFor([&] { return leases_.extra_refs(id) == 0; }, absl::Seconds(5)));
  }
  read_pool_.Accept(-1);
  std::vector<uint8_t> got;
  ASSERT_TRUE(ReceiveAll(*transport, MakeLease(id), &got).ok());
  EXPECT_TRUE(got == leases_.payload(id)->bytes());
}

// The server shuts down (no grace) while one stream's read is held on the pool and another's
// is queued, the node's order: Server::Shutdown while the pool still runs, the pool after it.
// The receivers see UNAVAILABLE at once; Shutdown returns only once the pool has run both reads
// (gRPC waits for every reactor to finish), and nothing of the payloads is left behind.
TEST_F(GrpcStreamTransportTest, ShutdownWithReadInFlight) {
  StartServer();
  GrpcStreamTransport::Options options;
  options.chunk_bytes = 64 * 1024;
  auto transport = MakeTransport(options);
  ReadProbe gate(/*gated=*/true);
  const uint64_t held = leases_.Add(PatternBytes(100 * 1000, 70), Views::kNone, gate.Hook());
  const uint64_t queued = leases_.Add(PatternBytes(100 * 1000, 71), Views::kNone, gate.Hook());
  BackgroundReceive a(transport.get(), MakeLease(held), absl::Now() + absl::Seconds(60));
  BackgroundReceive b(transport.get(), MakeLease(queued), absl::Now() + absl::Seconds(60));
  absl::Cleanup open_gate = [&gate] { gate.Open(); };  // before a and b join, on every way out
  ASSERT_TRUE(gate.WaitForReads(1, absl::Seconds(20)));
  ASSERT_TRUE(WaitFor([&] { return read_pool_.accepted() == 2; }, absl::Seconds(20)));
  std::atomic<bool> stopped{false};
  std::thread stopper([&] {
    StopServer(absl::ZeroDuration());
    stopped.store(true);
  });
  EXPECT_TRUE(WaitFor([&] { return a.done() && b.done(); }, absl::Seconds(10)));
  EXPECT_FALSE(stopped.load());  // the held read's stream is not finished yet
  gate.Open();
  stopper.join();
  for (BackgroundReceive* receive : {&a, &b}) {
    receive->Join();
    EXPECT_EQ(receive->status().code(), absl::StatusCode::kUnavailable) << receive->status();
    EXPECT_EQ(receive->received(), 0u);
  }
  EXPECT_TRUE(AwaitPayloadSlicesReleased(absl::Now() + absl::Seconds(5)));
  EXPECT_EQ(leases_.extra_refs(held), 0);
  EXPECT_EQ(leases_.extra_refs(queued), 0);
  EXPECT_LE(gate.threads().size(), 2u);
}

TEST_F(GrpcStreamTransportTest, RenewsLeaseEveryChunk) {
  StartServer();
  const uint64_t id = leases_.Add(PatternBytes(10 * 1000, 15));
  GrpcStreamTransport::Options options;
  options.chunk_bytes = 1000;
  auto transport = MakeTransport(options);
  std::vector<int> touches_seen(10, 0);  // per chunk, when its first piece arrived
  size_t received = 0;
  const absl::Status status = transport->Receive(
      MakeLease(id),
      [&](absl::Span<const uint8_t> piece) {
        if (received % 1000 == 0) touches_seen[received / 1000] = leases_.touches(id);
        received += piece.size();
        return absl::OkStatus();
      },
      absl::Now() + absl::Seconds(30));
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(leases_.touches(id), 10);
  // Renewals keep pace with the chunks: chunk i was sent after touch i + 1 (at most one chunk
  // ahead of the receiver, plus what the HTTP/2 window holds).
  for (size_t i = 0; i < touches_seen.size(); ++i) {
    EXPECT_GE(touches_seen[i], static_cast<int>(i) + 1) << "chunk " << i;
  }
}

// Eight threads, each pulling its own leases and a shared one, on one channel.
TEST_F(GrpcStreamTransportTest, ConcurrentTransfers) {
  StartServer();
  const uint64_t shared = leases_.Add(PatternBytes((3 << 20) + 11, 100));
  std::vector<uint64_t> own;
  for (int t = 0; t < 8; ++t) own.push_back(leases_.Add(PatternBytes((1 << 20) + 1000 * t, t)));
  GrpcStreamTransport::Options options;
  options.chunk_bytes = 256 << 10;
  auto transport = MakeTransport(options);
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 3; ++round) {
        for (const uint64_t id : {own[t], shared}) {
          std::vector<uint8_t> got;
          const absl::Status status = ReceiveAll(*transport, MakeLease(id), &got);
          if (!status.ok() || got != leases_.payload(id)->bytes()) {
            ADD_FAILURE() << "thread " << t << " lease " << id << ": " << status;
            ++failures;
          }
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
}

// The same with glibc's malloc told to keep large blocks (mmap threshold 32 MiB, no trimming
// below 1 GiB). By default every multi-megabyte buffer gRPC allocates for a message or a socket
// read is a fresh mmap whose pages fault in on first touch, and that, not the copies, is most
// of the CPU a transfer costs. Last in this file because mallopt changes the whole process.
TEST_F(GrpcStreamTransportTest, Transfers64MiBWithLargeBlocksKept) {
#if defined(__GLIBC__)
  const bool tuned =
      mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 && mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1;
#else
  const bool tuned = false;
#endif
  Transfer64MiB(tuned ? "malloc keeps large blocks" : "mallopt unavailable");
}

}  // namespace
}  // namespace transport
}  // namespace kvmesh

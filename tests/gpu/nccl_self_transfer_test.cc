// The nccl transport's communicator layer (transport/nccl_comm.h) on one GPU, label `gpu`.
//
// A one-rank communicator exchanging bytes with itself runs the same path as a transfer between
// two nodes, minus the network: non-blocking init polled under a deadline, ncclSend and ncclRecv
// posted in one group per piece, pieces staged through pinned and device buffers, completion
// polled with cudaEventQuery and ncclCommGetAsyncError, abort on error, timeout or interrupt,
// and the pool's reuse, re-creation and idle closing. Payloads come from (seed, index) patterns
// and every received byte is compared. Transfers of the sizes the issue names (up to 512 MiB,
// the Llama-3-8B 4K-token payload) print their bandwidth nccl-tests style:
//
//   #  path         bytes   pieces   time(ms)   GB/s   wrong
//
// KVMESH_NCCL_SELF_MAX_BYTES (bytes) leaves out the payloads larger than it in the two sweeps of
// sizes; unset, every size runs. The sanitizer builds set it just above the 64 MiB chunk
// (tests/gpu/CMakeLists.txt): a payload of two pieces runs the same path as one of eight.
//
// Tests run in the order written; UnmatchedSelfRecvIsInvalidUsage comes last because it feeds
// NCCL a group it rejects. NCCL_SOCKET_IFNAME defaults to `lo` here (everything is local; the
// bootstrap needs some interface) and NCCL_DEBUG to WARN, unless the environment sets them.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "cache/device/cuda_device.h"
#include "cache/device/cuda_resources.h"
#include "gtest/gtest.h"
#include "tests/testing/pattern.h"
#include "tests/testing/test_device.h"
#include "transport/nccl_comm.h"

namespace kvmesh {
namespace transport {
namespace {

constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kLlama4kPayload = 512 * kMiB;  // 4096 tokens x 128 KiB (32 layers, K and V)

absl::Time Within(absl::Duration d) { return absl::Now() + d; }

// KVMESH_NCCL_SELF_MAX_BYTES, SIZE_MAX when unset. A value that is not a number stops the test.
size_t MaxPayloadBytes() {
  const char* value = std::getenv("KVMESH_NCCL_SELF_MAX_BYTES");
  if (value == nullptr || *value == '\0') return SIZE_MAX;
  char* end = nullptr;
  const unsigned long long parsed = std::strtoull(value, &end, 10);
  if (*end != '\0') {
    std::fprintf(stderr, "KVMESH_NCCL_SELF_MAX_BYTES=%s: expected a number of bytes\n", value);
    std::abort();
  }
  return static_cast<size_t>(parsed);
}

// Whether a sweep runs a payload of `size` bytes (KVMESH_NCCL_SELF_MAX_BYTES); prints the ones
// it leaves out.
bool SizeRuns(size_t size) {
  if (size <= MaxPayloadBytes()) return true;
  std::printf("  payload of %zu bytes left out (KVMESH_NCCL_SELF_MAX_BYTES=%zu)\n", size,
              MaxPayloadBytes());
  return false;
}

// A lease payload over host bytes; `fail_at` makes the ReadAt that reaches that offset fail.
class VectorPayload : public LeasedPayload {
 public:
  explicit VectorPayload(const std::vector<uint8_t>* bytes, size_t fail_at = SIZE_MAX)
      : bytes_(bytes), fail_at_(fail_at) {}
  size_t size() const override { return bytes_->size(); }
  absl::Status ReadAt(size_t offset, absl::Span<uint8_t> dst) override {
    if (offset + dst.size() > bytes_->size()) {
      return absl::OutOfRangeError(absl::StrCat("read past the end at ", offset));
    }
    if (offset + dst.size() > fail_at_) return absl::DataLossError("planted read failure");
    std::memcpy(dst.data(), bytes_->data() + offset, dst.size());
    return absl::OkStatus();
  }

 private:
  const std::vector<uint8_t>* const bytes_;
  const size_t fail_at_;
};

// What a host sink saw: the bytes in order (written into a buffer sized up front, as an import
// writer would), the number and largest size of the pieces.
struct Received {
  explicit Received(size_t size) : bytes(size, 0) {}
  std::vector<uint8_t> bytes;
  size_t offset = 0;
  size_t pieces = 0;
  size_t largest_piece = 0;
  absl::Status Take(absl::Span<const uint8_t> piece) {
    if (offset + piece.size() > bytes.size()) {
      return absl::OutOfRangeError(
          absl::StrCat("piece of ", piece.size(), " at ", offset, " runs past ", bytes.size()));
    }
    std::memcpy(bytes.data() + offset, piece.data(), piece.size());
    offset += piece.size();
    ++pieces;
    largest_piece = std::max(largest_piece, piece.size());
    return absl::OkStatus();
  }
};

void PrintHeader() {
  std::printf("# %-14s %12s %7s %10s %8s %7s\n", "path", "bytes", "pieces", "time(ms)", "GB/s",
              "wrong");
}
void PrintRow(const char* path, size_t bytes, size_t pieces, absl::Duration time, size_t wrong) {
  const double seconds = absl::ToDoubleSeconds(time);
  const double gbps = seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0.0;
  std::printf("  %-14s %12zu %7zu %10.3f %8.2f %7zu\n", path, bytes, pieces, seconds * 1e3, gbps,
              wrong);
  std::fflush(stdout);
}

class NcclSelfTransferTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    setenv("NCCL_SOCKET_IFNAME", "lo", /*overwrite=*/0);
    setenv("NCCL_DEBUG", "WARN", /*overwrite=*/0);
  }

  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device visible";
    ASSERT_EQ(cudaSetDevice(testutil::TestCudaOrdinal()), cudaSuccess);
  }

  static NcclCommOptions Options(size_t chunk_bytes = kNcclChunkBytes) {
    NcclCommOptions options;
    options.device = testutil::TestCudaOrdinal();
    options.chunk_bytes = chunk_bytes;
    return options;
  }

  // A ready one-rank communicator.
  static absl::StatusOr<std::unique_ptr<NcclComm>> NewSelfComm(const NcclCommOptions& options) {
    absl::StatusOr<std::string> id = NewNcclUniqueId();
    if (!id.ok()) return id.status();
    static uint64_t generation = 0;
    return NcclComm::Create(*id, 1, 0, ++generation, options, Within(absl::Seconds(60)));
  }

  // Host payload -> self -> host sink, timed.
  static absl::Status HostSelfTransfer(NcclComm& comm, const std::vector<uint8_t>& payload,
                                       Received* received, absl::Duration* time) {
    VectorPayload source(&payload);
    const absl::Time start = absl::Now();
    absl::Status status = comm.SendRecv(
        0, NcclSource::Host(&source),
        NcclDestination::Host(
            payload.size(),
            [received](absl::Span<const uint8_t> piece) { return received->Take(piece); }),
        Within(absl::Seconds(120)));
    *time = absl::Now() - start;
    return status;
  }
};

TEST_F(NcclSelfTransferTest, HostPayloadsOfEverySizeReuseOneCommunicator) {
  NcclCommPool pool(Options());
  const NcclComm* first = nullptr;
  PrintHeader();
  const size_t sizes[] = {0, 1, 4097, 64 * kMiB, 64 * kMiB + 1, kLlama4kPayload};
  for (size_t size : sizes) {
    if (!SizeRuns(size)) continue;
    SCOPED_TRACE(absl::StrCat("payload of ", size, " bytes"));
    const std::vector<uint8_t> payload = testutil::PatternBytes(size, /*seed=*/size + 1);
    // Twice: the first run allocates the staging buffers, the second shows the steady state.
    for (int run = 0; run < 2; ++run) {
      absl::StatusOr<std::shared_ptr<NcclComm>> comm =
          pool.GetOrCreate("self", [&] { return NewSelfComm(pool.options()); });
      ASSERT_TRUE(comm.ok()) << comm.status();
      if (first == nullptr) first = comm->get();
      EXPECT_EQ(comm->get(), first) << "the communicator was not reused";
      Received received(size);
      absl::Duration time;
      ASSERT_TRUE(HostSelfTransfer(**comm, payload, &received, &time).ok());
      const size_t wrong = testutil::CountWrongBytes(payload, received.bytes);
      EXPECT_EQ(received.offset, size);
      EXPECT_EQ(wrong, 0u);
      EXPECT_EQ(received.pieces, (size + kNcclChunkBytes - 1) / kNcclChunkBytes);
      EXPECT_LE(received.largest_piece, kNcclChunkBytes);
      if (run == 1) PrintRow("host->host", size, received.pieces, time, wrong);
    }
  }
  EXPECT_EQ(pool.size(), 1u);
  EXPECT_TRUE(first->healthy());
}

TEST_F(NcclSelfTransferTest, DeviceBuffersMoveWithoutStaging) {
  absl::StatusOr<std::unique_ptr<NcclComm>> comm = NewSelfComm(Options());
  ASSERT_TRUE(comm.ok()) << comm.status();
  PrintHeader();
  for (size_t size : {size_t{4097}, 64 * kMiB, kLlama4kPayload}) {
    if (!SizeRuns(size)) continue;
    SCOPED_TRACE(absl::StrCat("payload of ", size, " bytes"));
    const std::vector<uint8_t> payload = testutil::PatternBytes(size, /*seed=*/7 * size);
    absl::StatusOr<cuda::DeviceBuffer> src = cuda::DeviceBuffer::Create(size);
    absl::StatusOr<cuda::DeviceBuffer> dst = cuda::DeviceBuffer::Create(size);
    ASSERT_TRUE(src.ok() && dst.ok());
    ASSERT_EQ(cudaMemcpy(src->data(), payload.data(), size, cudaMemcpyHostToDevice), cudaSuccess);
    absl::Duration time;
    for (int run = 0; run < 2; ++run) {
      ASSERT_EQ(cudaMemset(dst->data(), 0, size), cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const absl::Time start = absl::Now();
      const absl::Status status =
          (*comm)->SendRecv(0, NcclSource::Device(src->data(), size),
                            NcclDestination::Device(dst->data(), size), Within(absl::Seconds(60)));
      time = absl::Now() - start;
      ASSERT_TRUE(status.ok()) << status;
    }
    std::vector<uint8_t> back(size);
    ASSERT_EQ(cudaMemcpy(back.data(), dst->data(), size, cudaMemcpyDeviceToHost), cudaSuccess);
    const size_t wrong = testutil::CountWrongBytes(payload, back);
    EXPECT_EQ(wrong, 0u);
    PrintRow("device->device", size, (size + kNcclChunkBytes - 1) / kNcclChunkBytes, time, wrong);
  }
}

TEST_F(NcclSelfTransferTest, SmallChunksCycleBothStagingSlots) {
  // 1 MiB pieces: 11 of them, the last 5 bytes long, so each slot is reused several times.
  absl::StatusOr<std::unique_ptr<NcclComm>> comm = NewSelfComm(Options(kMiB));
  ASSERT_TRUE(comm.ok()) << comm.status();
  const std::vector<uint8_t> payload = testutil::PatternBytes(10 * kMiB + 5, /*seed=*/99);
  Received received(payload.size());
  absl::Duration time;
  ASSERT_TRUE(HostSelfTransfer(**comm, payload, &received, &time).ok());
  EXPECT_EQ(received.pieces, 11u);
  EXPECT_EQ(received.largest_piece, kMiB);
  EXPECT_EQ(testutil::CountWrongBytes(payload, received.bytes), 0u);

  // Host source into device memory, and back out through the sink path.
  absl::StatusOr<cuda::DeviceBuffer> dst = cuda::DeviceBuffer::Create(payload.size());
  ASSERT_TRUE(dst.ok());
  VectorPayload source(&payload);
  ASSERT_TRUE((*comm)
                  ->SendRecv(0, NcclSource::Host(&source),
                             NcclDestination::Device(dst->data(), payload.size()),
                             Within(absl::Seconds(60)))
                  .ok());
  Received back(payload.size());
  ASSERT_TRUE((*comm)
                  ->SendRecv(0, NcclSource::Device(dst->data(), payload.size()),
                             NcclDestination::Host(payload.size(),
                                                   [&back](absl::Span<const uint8_t> piece) {
                                                     return back.Take(piece);
                                                   }),
                             Within(absl::Seconds(60)))
                  .ok());
  EXPECT_EQ(testutil::CountWrongBytes(payload, back.bytes), 0u);
}

TEST_F(NcclSelfTransferTest, InitThatNobodyJoinsTimesOutAndThePoolRecreates) {
  NcclCommPool pool(Options());
  absl::StatusOr<std::string> id = NewNcclUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  // Rank 0 of 2 with no rank 1 anywhere: init can only end at the deadline, by an abort.
  const absl::Time start = absl::Now();
  absl::StatusOr<std::shared_ptr<NcclComm>> lonely = pool.GetOrCreate("pair", [&] {
    return NcclComm::Create(*id, 2, 0, /*generation=*/1, pool.options(), Within(absl::Seconds(2)));
  });
  const absl::Duration waited = absl::Now() - start;
  ASSERT_EQ(lonely.status().code(), absl::StatusCode::kDeadlineExceeded) << lonely.status();
  EXPECT_NE(lonely.status().message().find("initialization"), absl::string_view::npos)
      << lonely.status();
  EXPECT_GE(waited, absl::Seconds(2));
  EXPECT_LT(waited, absl::Seconds(20)) << "the abort did not end the init promptly";
  EXPECT_EQ(pool.size(), 0u);

  absl::StatusOr<std::shared_ptr<NcclComm>> comm =
      pool.GetOrCreate("pair", [&] { return NewSelfComm(pool.options()); });
  ASSERT_TRUE(comm.ok()) << comm.status();
  const std::vector<uint8_t> payload = testutil::PatternBytes(4097, /*seed=*/5);
  Received received(payload.size());
  absl::Duration time;
  ASSERT_TRUE(HostSelfTransfer(**comm, payload, &received, &time).ok());
  EXPECT_EQ(testutil::CountWrongBytes(payload, received.bytes), 0u);
}

TEST_F(NcclSelfTransferTest, InterruptAbortsAndThePoolReplacesTheDeadCommunicator) {
  NcclCommPool pool(Options());
  absl::StatusOr<std::shared_ptr<NcclComm>> comm =
      pool.GetOrCreate("self", [&] { return NewSelfComm(pool.options()); });
  ASSERT_TRUE(comm.ok()) << comm.status();
  const std::vector<uint8_t> payload = testutil::PatternBytes(4 * kMiB, /*seed=*/11);
  VectorPayload source(&payload);
  Received received(payload.size());
  const absl::Status status = (*comm)->SendRecv(
      0, NcclSource::Host(&source),
      NcclDestination::Host(payload.size(),
                            [&received](absl::Span<const uint8_t> p) { return received.Take(p); }),
      Within(absl::Seconds(60)), [] { return absl::CancelledError("the peer's RPC failed"); });
  EXPECT_EQ(status, absl::CancelledError("the peer's RPC failed"));
  EXPECT_FALSE((*comm)->healthy());

  // A dead communicator refuses further work with UNAVAILABLE...
  const absl::Status again = (*comm)->SendRecv(
      0, NcclSource::Host(&source),
      NcclDestination::Host(payload.size(),
                            [&received](absl::Span<const uint8_t> p) { return received.Take(p); }),
      Within(absl::Seconds(60)));
  EXPECT_EQ(again.code(), absl::StatusCode::kUnavailable) << again;
  // ...and the pool makes a new one.
  absl::StatusOr<std::shared_ptr<NcclComm>> fresh =
      pool.GetOrCreate("self", [&] { return NewSelfComm(pool.options()); });
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_NE(fresh->get(), comm->get());
  Received ok(payload.size());
  absl::Duration time;
  ASSERT_TRUE(HostSelfTransfer(**fresh, payload, &ok, &time).ok());
  EXPECT_EQ(testutil::CountWrongBytes(payload, ok.bytes), 0u);
  EXPECT_EQ(pool.size(), 1u);
}

TEST_F(NcclSelfTransferTest, RequestAbortStopsTheNextTransferWithAborted) {
  NcclCommPool pool(Options());
  absl::StatusOr<std::shared_ptr<NcclComm>> comm =
      pool.GetOrCreate("self", [&] { return NewSelfComm(pool.options()); });
  ASSERT_TRUE(comm.ok()) << comm.status();
  // Put of a replacement asks the old communicator to abort.
  absl::StatusOr<std::unique_ptr<NcclComm>> replacement = NewSelfComm(pool.options());
  ASSERT_TRUE(replacement.ok()) << replacement.status();
  pool.Put("self", std::shared_ptr<NcclComm>(std::move(*replacement)));
  const std::vector<uint8_t> payload = testutil::PatternBytes(4097, /*seed=*/3);
  Received received(payload.size());
  absl::Duration time;
  const absl::Status status = HostSelfTransfer(**comm, payload, &received, &time);
  EXPECT_EQ(status.code(), absl::StatusCode::kAborted) << status;
  EXPECT_FALSE((*comm)->healthy());
  EXPECT_TRUE(pool.Find("self")->healthy());
}

TEST_F(NcclSelfTransferTest, PayloadAndSinkErrorsComeBackAsTheyAre) {
  absl::StatusOr<std::unique_ptr<NcclComm>> comm = NewSelfComm(Options(kMiB));
  ASSERT_TRUE(comm.ok()) << comm.status();
  const std::vector<uint8_t> payload = testutil::PatternBytes(5 * kMiB, /*seed=*/21);
  {
    VectorPayload failing(&payload, /*fail_at=*/3 * kMiB);
    Received received(payload.size());
    const absl::Status status = (*comm)->SendRecv(
        0, NcclSource::Host(&failing),
        NcclDestination::Host(
            payload.size(), [&received](absl::Span<const uint8_t> p) { return received.Take(p); }),
        Within(absl::Seconds(60)));
    EXPECT_EQ(status, absl::DataLossError("planted read failure"));
    EXPECT_FALSE((*comm)->healthy()) << "a transfer cut short must abort the communicator";
  }
  comm = NewSelfComm(Options(kMiB));
  ASSERT_TRUE(comm.ok()) << comm.status();
  {
    VectorPayload source(&payload);
    size_t pieces = 0;
    const absl::Status status = (*comm)->SendRecv(
        0, NcclSource::Host(&source),
        NcclDestination::Host(payload.size(),
                              [&pieces](absl::Span<const uint8_t>) {
                                return ++pieces == 2 ? absl::FailedPreconditionError("sink full")
                                                     : absl::OkStatus();
                              }),
        Within(absl::Seconds(60)));
    EXPECT_EQ(status, absl::FailedPreconditionError("sink full"));
    EXPECT_EQ(pieces, 2u);
  }
}

TEST_F(NcclSelfTransferTest, BadArgumentsLeaveTheCommunicatorUsable) {
  absl::StatusOr<std::unique_ptr<NcclComm>> comm = NewSelfComm(Options());
  ASSERT_TRUE(comm.ok()) << comm.status();
  const std::vector<uint8_t> payload = testutil::PatternBytes(4097, /*seed=*/8);
  VectorPayload source(&payload);
  EXPECT_EQ((*comm)->Send(1, NcclSource::Host(&source), Within(absl::Seconds(5))).code(),
            absl::StatusCode::kInvalidArgument);
  Received received(payload.size() + 1);
  EXPECT_EQ((*comm)
                ->SendRecv(0, NcclSource::Host(&source),
                           NcclDestination::Host(payload.size() + 1,
                                                 [&received](absl::Span<const uint8_t> p) {
                                                   return received.Take(p);
                                                 }),
                           Within(absl::Seconds(5)))
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE((*comm)->healthy());
  EXPECT_EQ(NcclComm::Start("short", 1, 0, 1, Options()).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::string> id = NewNcclUniqueId();
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(NcclComm::Start(*id, 2, 2, 1, Options()).status().code(),
            absl::StatusCode::kInvalidArgument);

  Received ok(payload.size());
  absl::Duration time;
  ASSERT_TRUE(HostSelfTransfer(**comm, payload, &ok, &time).ok());
  EXPECT_EQ(testutil::CountWrongBytes(payload, ok.bytes), 0u);
}

TEST_F(NcclSelfTransferTest, CloseIdleClosesOnlyIdleCommunicators) {
  NcclCommPool pool(Options());
  absl::StatusOr<std::shared_ptr<NcclComm>> comm =
      pool.GetOrCreate("self", [&] { return NewSelfComm(pool.options()); });
  ASSERT_TRUE(comm.ok()) << comm.status();
  const std::vector<uint8_t> payload = testutil::PatternBytes(4097, /*seed=*/4);
  Received received(payload.size());
  absl::Duration time;
  ASSERT_TRUE(HostSelfTransfer(**comm, payload, &received, &time).ok());

  EXPECT_EQ(pool.CloseIdle(absl::Hours(1)), 0u);
  EXPECT_EQ(pool.size(), 1u);
  EXPECT_TRUE((*comm)->healthy());

  // An hour later it has been idle for an hour.
  EXPECT_EQ(pool.CloseIdle(absl::Minutes(5), absl::Now() + absl::Hours(1)), 1u);
  EXPECT_EQ(pool.size(), 0u);
  EXPECT_FALSE((*comm)->healthy());
  EXPECT_TRUE((*comm)->Close(Within(absl::Seconds(5))).ok()) << "Close is idempotent";
  EXPECT_EQ((*comm)->Send(0, NcclSource::Device(nullptr, 0), Within(absl::Seconds(5))).code(),
            absl::StatusCode::kUnavailable);
}

// Last: NCCL refuses a receive from self without the matching send in the same group
// (ncclInvalidUsage). The communicator is aborted; the pool replaces it.
TEST_F(NcclSelfTransferTest, UnmatchedSelfRecvIsInvalidUsage) {
  NcclCommPool pool(Options());
  absl::StatusOr<std::shared_ptr<NcclComm>> comm =
      pool.GetOrCreate("self", [&] { return NewSelfComm(pool.options()); });
  ASSERT_TRUE(comm.ok()) << comm.status();
  Received received(4097);
  const absl::Status status = (*comm)->Recv(
      0,
      NcclDestination::Host(4097,
                            [&received](absl::Span<const uint8_t> p) { return received.Take(p); }),
      Within(absl::Seconds(5)));
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal) << status;
  EXPECT_FALSE((*comm)->healthy());
  EXPECT_EQ(received.offset, 0u);

  absl::StatusOr<std::shared_ptr<NcclComm>> fresh =
      pool.GetOrCreate("self", [&] { return NewSelfComm(pool.options()); });
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_NE(fresh->get(), comm->get());
  const std::vector<uint8_t> payload = testutil::PatternBytes(4097, /*seed=*/6);
  Received ok(payload.size());
  absl::Duration time;
  ASSERT_TRUE(HostSelfTransfer(**fresh, payload, &ok, &time).ok());
  EXPECT_EQ(testutil::CountWrongBytes(payload, ok.bytes), 0u);
}

}  // namespace
}  // namespace transport
}  // namespace kvmesh

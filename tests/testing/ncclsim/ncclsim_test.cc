// The simulated NCCL (nccl_sim.h), label `unit`: loaded by kvmesh's own loader through
// $KVMESH_NCCL_LIBRARY (ctest sets it to the library built next to this test) and driven by
// kvmesh's communicator layer (transport/nccl_comm.h) on the simulated GPU, between two real
// processes: this one is rank 0 and runs the same binary in helper mode as rank 1 (main() at
// the end). Payloads come from (seed, index) patterns and every byte is compared on the side
// that receives it. A few tests call the NCCL API directly for what NcclComm never does
// (abort with an operation pending, misuse).
//
// Faults: a helper killed mid-transfer (UNAVAILABLE), frozen with SIGSTOP or hung by
// KVMESH_NCCLSIM_HANG (DEADLINE_EXCEEDED, the communicator aborted, no hang), errors planted
// with KVMESH_NCCLSIM_ERROR (the status NcclComm maps them to), mismatched sizes (INTERNAL).
#include <dlfcn.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "cache/device/cuda_resources.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/ncclsim/nccl_sim.h"
#include "tests/testing/pattern.h"
#include "transport/nccl_api.h"
#include "transport/nccl_comm.h"

extern char** environ;

namespace kvmesh {
namespace transport {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

constexpr char kHelperFlag[] = "--ncclsim-helper";
constexpr size_t kMiB = size_t{1} << 20;

// The helper's exit codes: 0, or the absl::StatusCode of the Send or Recv that failed, or one
// of these.
constexpr int kExitCloseFailed = 20;   // + the code of Close after a good transfer
constexpr int kExitCreateFailed = 40;  // + the code of NcclComm::Create
constexpr int kExitCudaFailed = 98;
constexpr int kExitBadArguments = 99;
constexpr int kExitWrongBytes = 100;

absl::Time Within(absl::Duration d) { return absl::Now() + d; }

class VectorPayload : public LeasedPayload {
 public:
  explicit VectorPayload(const std::vector<uint8_t>* bytes) : bytes_(bytes) {}
  size_t size() const override { return bytes_->size(); }
  absl::Status ReadAt(size_t offset, absl::Span<uint8_t> dst) override {
    if (offset + dst.size() > bytes_->size()) {
      return absl::OutOfRangeError(absl::StrCat("read past the end at ", offset));
    }
    std::memcpy(dst.data(), bytes_->data() + offset, dst.size());
    return absl::OkStatus();
  }

 private:
  const std::vector<uint8_t>* const bytes_;
};

// What a host sink got, in order; `on_piece` (optional) runs after each piece is taken.
struct Received {
  explicit Received(size_t size) : bytes(size, 0) {}
  Received(const Received&) = delete;
  Received& operator=(const Received&) = delete;

  absl::Status Take(absl::Span<const uint8_t> piece) {
    if (offset + piece.size() > bytes.size()) {
      return absl::OutOfRangeError(absl::StrCat("piece of ", piece.size(), " at ", offset));
    }
    std::memcpy(bytes.data() + offset, piece.data(), piece.size());
    offset += piece.size();
    ++pieces;
    if (on_piece) on_piece();
    return absl::OkStatus();
  }
  // A Sink refers to its callable: this one lives as long as the Received.
  Sink sink() const { return Sink(take); }

  std::vector<uint8_t> bytes;
  size_t offset = 0;
  size_t pieces = 0;
  std::function<void()> on_piece;
  const std::function<absl::Status(absl::Span<const uint8_t>)> take =
      [this](absl::Span<const uint8_t> piece) { return Take(piece); };
};

NcclCommOptions Options(size_t chunk_bytes) {
  NcclCommOptions options;
  options.chunk_bytes = chunk_bytes;
  options.close_timeout = absl::Seconds(5);
  return options;
}

std::string Hex(const std::string& bytes) {
  std::string hex;
  for (unsigned char c : bytes) absl::StrAppend(&hex, absl::Hex(c, absl::kZeroPad2));
  return hex;
}

std::string Unhex(const std::string& hex) {
  std::string bytes;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    bytes.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  }
  return bytes;
}

// ---- the helper process (rank 1) ------------------------------------------------------------

// What the parent asks of a helper: role=send|recv id=HEX bytes=N chunk=N seed=N device=0|1
// timeout_ms=N, each as one argument after kHelperFlag.
struct HelperTask {
  std::string role = "send";
  std::string id;
  size_t bytes = 0;
  size_t chunk = kNcclChunkBytes;
  uint64_t seed = 0;
  bool device = false;
  int64_t timeout_ms = 20000;

  std::vector<std::string> Arguments() const {
    return {kHelperFlag,
            absl::StrCat("role=", role),
            absl::StrCat("id=", Hex(id)),
            absl::StrCat("bytes=", bytes),
            absl::StrCat("chunk=", chunk),
            absl::StrCat("seed=", seed),
            absl::StrCat("device=", device ? 1 : 0),
            absl::StrCat("timeout_ms=", timeout_ms)};
  }
};

bool ParseHelperTask(int argc, char** argv, HelperTask* task) {
  for (int i = 2; i < argc; ++i) {
    const std::pair<std::string, std::string> kv = absl::StrSplit(argv[i], absl::MaxSplits('=', 1));
    const std::string& value = kv.second;
    int device = 0;
    bool ok = true;
    if (kv.first == "role") {
      task->role = value;
    } else if (kv.first == "id") {
      task->id = Unhex(value);
    } else if (kv.first == "bytes") {
      ok = absl::SimpleAtoi(value, &task->bytes);
    } else if (kv.first == "chunk") {
      ok = absl::SimpleAtoi(value, &task->chunk);
    } else if (kv.first == "seed") {
      ok = absl::SimpleAtoi(value, &task->seed);
    } else if (kv.first == "device") {
      ok = absl::SimpleAtoi(value, &device);
      task->device = device != 0;
    } else if (kv.first == "timeout_ms") {
      ok = absl::SimpleAtoi(value, &task->timeout_ms);
    } else {
      ok = false;
    }
    if (!ok) return false;
  }
  return task->role == "send" || task->role == "recv";
}

int Report(const char* what, const absl::Status& status, int base) {
  std::fprintf(stderr, "ncclsim_test helper: %s: %s\n", what, status.ToString().c_str());
  return base + static_cast<int>(status.code());
}

// Rank 1: sends the pattern to rank 0 or receives and checks it, then closes.
int RunHelper(const HelperTask& task) {
  const absl::Time deadline = Within(absl::Milliseconds(task.timeout_ms));
  absl::StatusOr<std::unique_ptr<NcclComm>> comm =
      NcclComm::Create(task.id, 2, 1, /*generation=*/1, Options(task.chunk), deadline);
  if (!comm.ok()) return Report("NcclComm::Create", comm.status(), kExitCreateFailed);
  const std::vector<uint8_t> pattern = testutil::PatternBytes(task.bytes, task.seed);
  absl::Status status;
  bool right = true;
  cuda::DeviceBuffer buffer;
  if (task.device) {
    absl::StatusOr<cuda::DeviceBuffer> created = cuda::DeviceBuffer::Create(task.bytes);
    if (!created.ok()) return Report("DeviceBuffer::Create", created.status(), 0);
    buffer = std::move(*created);
  }
  if (task.role == "send") {
    VectorPayload source(&pattern);
    if (task.device) {
      if (cudaMemcpy(buffer.data(), pattern.data(), task.bytes, cudaMemcpyHostToDevice) !=
          cudaSuccess) {
        return kExitCudaFailed;
      }
      status = (*comm)->Send(0, NcclSource::Device(buffer.data(), task.bytes), deadline);
    } else {
      status = (*comm)->Send(0, NcclSource::Host(&source), deadline);
    }
  } else if (task.device) {
    status = (*comm)->Recv(0, NcclDestination::Device(buffer.data(), task.bytes), deadline);
    std::vector<uint8_t> back(task.bytes);
    if (status.ok() &&
        cudaMemcpy(back.data(), buffer.data(), task.bytes, cudaMemcpyDeviceToHost) != cudaSuccess) {
      return kExitCudaFailed;
    }
    right = testutil::CountWrongBytes(pattern, back) == 0;
  } else {
    Received received(task.bytes);
    status = (*comm)->Recv(0, NcclDestination::Host(task.bytes, received.sink()), deadline);
    right = testutil::CountWrongBytes(pattern, received.bytes) == 0;
  }
  if (!status.ok()) return Report(task.role == "send" ? "Send" : "Recv", status, 0);
  if (!right) return kExitWrongBytes;
  const absl::Status closed = (*comm)->Close(Within(absl::Seconds(10)));
  if (!closed.ok()) return Report("Close", closed, kExitCloseFailed);
  return 0;
}

// ---- the parent side ------------------------------------------------------------------------

// A helper process, killed (SIGKILL) and reaped when this goes out of scope unless Wait reaped
// it already.
class Helper {
 public:
  // Runs this binary as a helper with `task`, the environment plus `env` ("NAME=value").
  static absl::StatusOr<std::unique_ptr<Helper>> Start(const HelperTask& task,
                                                       const std::vector<std::string>& env) {
    // Everything is prepared before fork: after it, only async-signal-safe calls.
    std::vector<std::string> args = task.Arguments();
    args.insert(args.begin(), "/proc/self/exe");
    std::vector<char*> argv;
    for (std::string& arg : args) argv.push_back(arg.data());
    argv.push_back(nullptr);
    std::vector<std::string> variables;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string variable = *e;
      const std::string name = variable.substr(0, variable.find('='));
      const bool replaced = std::any_of(env.begin(), env.end(), [&](const std::string& o) {
        return o.substr(0, o.find('=')) == name;
      });
      if (!replaced) variables.push_back(variable);
    }
    variables.insert(variables.end(), env.begin(), env.end());
    std::vector<char*> envp;
    for (std::string& variable : variables) envp.push_back(variable.data());
    envp.push_back(nullptr);
    const pid_t parent = getpid();
    const pid_t pid = fork();
    if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(126);
      execve(argv[0], argv.data(), envp.data());
      _exit(127);
    }
    return std::unique_ptr<Helper>(new Helper(pid));
  }

  Helper(const Helper&) = delete;
  Helper& operator=(const Helper&) = delete;
  ~Helper() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      int status;
      waitpid(pid_, &status, 0);
    }
  }

  pid_t pid() const { return pid_; }

  // Its exit code (128 + N after signal N), or -1 if it did not exit within `timeout` (it is
  // killed then).
  int Wait(absl::Duration timeout) {
    const absl::Time until = Within(timeout);
    while (true) {
      int status = 0;
      const pid_t done = waitpid(pid_, &status, WNOHANG);
      if (done == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      if (absl::Now() >= until) {
        kill(pid_, SIGKILL);
        waitpid(pid_, &status, 0);
        pid_ = -1;
        return -1;
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
  }

 private:
  explicit Helper(pid_t pid) : pid_(pid) {}
  pid_t pid_;
};

// Rank 0 of a fresh two-rank communicator, initializing, and the helper process that is rank 1.
struct Pair {
  std::unique_ptr<NcclComm> comm;
  std::unique_ptr<Helper> helper;
};

absl::StatusOr<Pair> StartPair(HelperTask task, const std::vector<std::string>& env = {}) {
  absl::StatusOr<std::string> id = NewNcclUniqueId();
  if (!id.ok()) return id.status();
  task.id = *id;
  absl::StatusOr<std::unique_ptr<NcclComm>> comm =
      NcclComm::Start(*id, 2, 0, /*generation=*/1, Options(task.chunk));
  if (!comm.ok()) return comm.status();
  absl::StatusOr<std::unique_ptr<Helper>> helper = Helper::Start(task, env);
  if (!helper.ok()) return helper.status();
  return Pair{std::move(*comm), std::move(*helper)};
}

class NcclSimTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<const NcclApi*> nccl = LoadNccl();
    ASSERT_TRUE(nccl.ok()) << nccl.status();
  }
  void SetUp() override { ASSERT_EQ(cudaSetDevice(0), cudaSuccess); }

  static const NcclApi& Nccl() { return **LoadNccl(); }

  // Receives `bytes` from the helper (which sends from host or device memory) into a host sink
  // and checks them.
  static void ReceiveAndCheck(size_t bytes, size_t chunk, uint64_t seed, bool from_device) {
    const char* path = from_device ? "device->host" : "host->host";
    SCOPED_TRACE(absl::StrCat(path, ", ", bytes, " bytes in pieces of ", chunk));
    HelperTask task;
    task.bytes = bytes;
    task.chunk = chunk;
    task.seed = seed;
    task.device = from_device;
    absl::StatusOr<Pair> pair = StartPair(task);
    ASSERT_TRUE(pair.ok()) << pair.status();
    const absl::Time start = absl::Now();
    Received received(bytes);
    ASSERT_TRUE(pair->comm->WaitReady(Within(absl::Seconds(20))).ok());
    const absl::Status status = pair->comm->Recv(1, NcclDestination::Host(bytes, received.sink()),
                                                 Within(absl::Seconds(60)));
    const absl::Duration took = absl::Now() - start;
    ASSERT_TRUE(status.ok()) << status;
    EXPECT_EQ(received.offset, bytes);
    EXPECT_EQ(received.pieces, (bytes + chunk - 1) / chunk);
    EXPECT_EQ(testutil::CountWrongBytes(testutil::PatternBytes(bytes, seed), received.bytes), 0u);
    EXPECT_TRUE(pair->comm->Close(Within(absl::Seconds(10))).ok());
    EXPECT_EQ(pair->helper->Wait(absl::Seconds(20)), 0);
    std::printf("  %-14s %10zu bytes between processes in %s\n", path, bytes,
                absl::FormatDuration(took).c_str());
  }
};

TEST_F(NcclSimTest, TheLoaderOpensTheSimulator) {
  const NcclApi& nccl = Nccl();
  EXPECT_EQ(nccl.version, NCCL_VERSION_CODE);
  void* handle = dlopen(nccl.path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  ASSERT_NE(handle, nullptr) << nccl.path;
  const auto marker =
      reinterpret_cast<decltype(&kvmesh_ncclsim_version)>(dlsym(handle, "kvmesh_ncclsim_version"));
  ASSERT_NE(marker, nullptr) << nccl.path << " is not the simulator";
  EXPECT_THAT(marker(), HasSubstr("ncclsim"));
  dlclose(handle);  // only drops the reference RTLD_NOLOAD took
  EXPECT_STREQ(nccl.ncclGetErrorString(ncclRemoteError),
               "remote process exited or there was a network error");
}

TEST_F(NcclSimTest, OneRankSendsToItself) {
  absl::StatusOr<std::string> id = NewNcclUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  absl::StatusOr<std::unique_ptr<NcclComm>> comm =
      NcclComm::Create(*id, 1, 0, 1, Options(kMiB), Within(absl::Seconds(10)));
  ASSERT_TRUE(comm.ok()) << comm.status();
  const std::vector<uint8_t> payload = testutil::PatternBytes(3 * kMiB + 5, /*seed=*/1);
  VectorPayload source(&payload);
  Received received(payload.size());
  ASSERT_TRUE((*comm)
                  ->SendRecv(0, NcclSource::Host(&source),
                             NcclDestination::Host(payload.size(), received.sink()),
                             Within(absl::Seconds(10)))
                  .ok());
  EXPECT_EQ(received.pieces, 4u);
  EXPECT_EQ(testutil::CountWrongBytes(payload, received.bytes), 0u);

  // A receive from itself with no send in its group: NCCL refuses it (ncclInvalidUsage).
  Received unmatched(4097);
  const absl::Status status =
      (*comm)->Recv(0, NcclDestination::Host(4097, unmatched.sink()), Within(absl::Seconds(5)));
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal) << status;
  EXPECT_THAT(status.message(), HasSubstr("invalid usage"));
  EXPECT_FALSE((*comm)->healthy());
}

TEST_F(NcclSimTest, TwoRanksInOneProcess) {
  absl::StatusOr<std::string> id = NewNcclUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  const std::vector<uint8_t> payload = testutil::PatternBytes(3 * kMiB + 5, /*seed=*/2);
  absl::Status send_status = absl::UnknownError("not run");
  std::thread sender([&] {
    absl::StatusOr<std::unique_ptr<NcclComm>> comm =
        NcclComm::Create(*id, 2, 1, 1, Options(kMiB), Within(absl::Seconds(10)));
    if (!comm.ok()) {
      send_status = comm.status();
      return;
    }
    VectorPayload source(&payload);
    send_status = (*comm)->Send(0, NcclSource::Host(&source), Within(absl::Seconds(10)));
    if (send_status.ok()) send_status = (*comm)->Close(Within(absl::Seconds(10)));
  });
  absl::StatusOr<std::unique_ptr<NcclComm>> comm =
      NcclComm::Create(*id, 2, 0, 1, Options(kMiB), Within(absl::Seconds(10)));
  ASSERT_TRUE(comm.ok()) << comm.status();
  absl::StatusOr<cuda::DeviceBuffer> dst = cuda::DeviceBuffer::Create(payload.size());
  ASSERT_TRUE(dst.ok());
  EXPECT_TRUE(
      (*comm)
          ->Recv(1, NcclDestination::Device(dst->data(), payload.size()), Within(absl::Seconds(10)))
          .ok());
  EXPECT_TRUE((*comm)->Close(Within(absl::Seconds(10))).ok());
  sender.join();
  EXPECT_TRUE(send_status.ok()) << send_status;
  std::vector<uint8_t> back(payload.size());
  ASSERT_EQ(cudaMemcpy(back.data(), dst->data(), back.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(testutil::CountWrongBytes(payload, back), 0u);
}

TEST_F(NcclSimTest, ToHostBetweenProcesses) {
  ReceiveAndCheck(kMiB, kNcclChunkBytes, /*seed=*/3, /*from_device=*/true);
  // 150 MiB: three pieces of the protocol's 64 MiB chunk, so both staging slots are reused.
  ReceiveAndCheck(150 * kMiB, kNcclChunkBytes, /*seed=*/4, /*from_device=*/false);
}

TEST_F(NcclSimTest, DeviceToDeviceBetweenProcesses) {
  constexpr size_t kBytes = 150 * kMiB;
  HelperTask task;
  task.role = "recv";
  task.device = true;
  task.bytes = kBytes;
  task.seed = 5;
  absl::StatusOr<Pair> pair = StartPair(task);
  ASSERT_TRUE(pair.ok()) << pair.status();
  const std::vector<uint8_t> payload = testutil::PatternBytes(kBytes, task.seed);
  absl::StatusOr<cuda::DeviceBuffer> src = cuda::DeviceBuffer::Create(kBytes);
  ASSERT_TRUE(src.ok());
  ASSERT_EQ(cudaMemcpy(src->data(), payload.data(), kBytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_TRUE(pair->comm->WaitReady(Within(absl::Seconds(20))).ok());
  const absl::Time start = absl::Now();
  const absl::Status status =
      pair->comm->Send(1, NcclSource::Device(src->data(), kBytes), Within(absl::Seconds(60)));
  const absl::Duration took = absl::Now() - start;
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_TRUE(pair->comm->Close(Within(absl::Seconds(10))).ok());
  // The helper checks every byte it received (kExitWrongBytes otherwise).
  EXPECT_EQ(pair->helper->Wait(absl::Seconds(20)), 0);
  std::printf("  %-14s %10zu bytes between processes in %s\n", "device->device", kBytes,
              absl::FormatDuration(took).c_str());
}

// The helper sends 32 MiB in 1 MiB pieces; `on_first_piece` runs when the first one arrives
// (the helper cannot be done by then: the socket buffers hold far less than the payload).
// Returns the status of the receive, how long it took, and the helper.
struct Interrupted {
  absl::Status status;
  absl::Duration took;
  std::unique_ptr<Helper> helper;
  bool healthy = true;
};
Interrupted ReceiveInterrupted(const std::function<void(pid_t)>& on_first_piece,
                               absl::Duration timeout, const std::vector<std::string>& env = {}) {
  Interrupted result;
  HelperTask task;
  task.bytes = 32 * kMiB;
  task.chunk = kMiB;
  task.seed = 6;
  task.timeout_ms = 10000;  // longer than any wait of this side: it gives up first
  absl::StatusOr<Pair> pair = StartPair(task, env);
  if (!pair.ok()) {
    result.status = pair.status();
    return result;
  }
  result.helper = std::move(pair->helper);
  const pid_t pid = result.helper->pid();
  Received received(task.bytes);
  received.on_piece = [&received, &on_first_piece, pid] {
    if (received.pieces == 1 && on_first_piece) on_first_piece(pid);
  };
  result.status = pair->comm->WaitReady(Within(absl::Seconds(20)));
  if (!result.status.ok()) return result;
  const absl::Time start = absl::Now();
  result.status =
      pair->comm->Recv(1, NcclDestination::Host(task.bytes, received.sink()), Within(timeout));
  result.took = absl::Now() - start;
  result.healthy = pair->comm->healthy();
  return result;
}

TEST_F(NcclSimTest, PeerKilledMidTransferIsUnavailable) {
  Interrupted run = ReceiveInterrupted([](pid_t pid) { kill(pid, SIGKILL); }, absl::Seconds(20));
  EXPECT_EQ(run.status.code(), absl::StatusCode::kUnavailable) << run.status;
  EXPECT_THAT(run.status.message(), HasSubstr("closed its connection"));
  EXPECT_LT(run.took, absl::Seconds(5)) << "the receiver noticed the dead peer late";
  EXPECT_FALSE(run.healthy);
  ASSERT_NE(run.helper, nullptr);
  EXPECT_EQ(run.helper->Wait(absl::Seconds(5)), 128 + SIGKILL);
}

TEST_F(NcclSimTest, FrozenPeerHitsTheDeadlineAndTheCommunicatorIsAborted) {
  Interrupted run = ReceiveInterrupted([](pid_t pid) { kill(pid, SIGSTOP); }, absl::Seconds(2));
  EXPECT_EQ(run.status.code(), absl::StatusCode::kDeadlineExceeded) << run.status;
  EXPECT_GE(run.took, absl::Seconds(2) - absl::Milliseconds(100));
  EXPECT_LT(run.took, absl::Seconds(4)) << "the abort did not end the receive promptly";
  EXPECT_FALSE(run.healthy);
  ASSERT_NE(run.helper, nullptr);
  kill(run.helper->pid(), SIGKILL);
  EXPECT_EQ(run.helper->Wait(absl::Seconds(5)), 128 + SIGKILL);
}

TEST_F(NcclSimTest, InjectedHangHitsTheDeadline) {
  // The helper's third ncclSend never moves a byte: this side waits until its deadline (2 s,
  // long before the helper's own) and aborts, which the helper then sees as its peer gone.
  Interrupted run = ReceiveInterrupted(nullptr, absl::Seconds(2), {"KVMESH_NCCLSIM_HANG=send:3"});
  EXPECT_EQ(run.status.code(), absl::StatusCode::kDeadlineExceeded) << run.status;
  EXPECT_LT(run.took, absl::Seconds(4));
  EXPECT_FALSE(run.healthy);
  ASSERT_NE(run.helper, nullptr);
  EXPECT_EQ(run.helper->Wait(absl::Seconds(10)), static_cast<int>(absl::StatusCode::kUnavailable));
}

TEST_F(NcclSimTest, InjectedErrorsBecomeTheMappedStatuses) {
  struct Case {
    std::string error;          // KVMESH_NCCLSIM_ERROR of the helper
    int helper_exit;            // what the helper's NcclComm reported
    absl::StatusCode receiver;  // what this side's Recv reports (the helper aborts its side)
  };
  const int unavailable = static_cast<int>(absl::StatusCode::kUnavailable);
  const int internal = static_cast<int>(absl::StatusCode::kInternal);
  const Case cases[] = {
      {"send:2:ncclRemoteError", unavailable, absl::StatusCode::kUnavailable},
      {"send:1:ncclSystemError", unavailable, absl::StatusCode::kUnavailable},
      {"send:3:ncclUnhandledCudaError", internal, absl::StatusCode::kUnavailable},
      {"ncclGroupEnd:2:ncclInternalError", internal, absl::StatusCode::kUnavailable},
      {"ncclSend:2:ncclInvalidArgument", internal, absl::StatusCode::kUnavailable},
      {"init:1:ncclRemoteError", kExitCreateFailed + unavailable, absl::StatusCode::kUnavailable},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.error);
    Interrupted run =
        ReceiveInterrupted(nullptr, absl::Seconds(10), {"KVMESH_NCCLSIM_ERROR=" + c.error});
    EXPECT_EQ(run.status.code(), c.receiver) << run.status;
    EXPECT_LT(run.took, absl::Seconds(5));
    ASSERT_NE(run.helper, nullptr);
    EXPECT_EQ(run.helper->Wait(absl::Seconds(10)), c.helper_exit);
  }
}

TEST_F(NcclSimTest, MismatchedSizesAreAnError) {
  HelperTask task;
  task.bytes = 1001;
  task.seed = 7;
  absl::StatusOr<Pair> pair = StartPair(task);
  ASSERT_TRUE(pair.ok()) << pair.status();
  Received received(1000);
  ASSERT_TRUE(pair->comm->WaitReady(Within(absl::Seconds(20))).ok());
  const absl::Status status =
      pair->comm->Recv(1, NcclDestination::Host(1000, received.sink()), Within(absl::Seconds(10)));
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal) << status;
  EXPECT_THAT(status.message(),
              HasSubstr("sent 1001 bytes, but the matching receive expects 1000"));
  EXPECT_EQ(received.offset, 0u);
  // The helper's bytes left, but this side aborted: its Send or its Close (whichever polls
  // after the connection closed) reports this side gone.
  const int unavailable = static_cast<int>(absl::StatusCode::kUnavailable);
  EXPECT_THAT(pair->helper->Wait(absl::Seconds(20)),
              AnyOf(unavailable, kExitCloseFailed + unavailable));
}

// ---- the NCCL API directly ------------------------------------------------------------------

// Polls ncclCommGetAsyncError until it is not ncclInProgress (or 10 s pass); returns it.
ncclResult_t Settle(const NcclApi& nccl, ncclComm_t comm) {
  const absl::Time until = Within(absl::Seconds(10));
  ncclResult_t state = ncclInProgress;
  while (state == ncclInProgress && absl::Now() < until) {
    EXPECT_EQ(nccl.ncclCommGetAsyncError(comm, &state), ncclSuccess);
    if (state == ncclInProgress) absl::SleepFor(absl::Microseconds(200));
  }
  return state;
}

// Polls ncclCommGetAsyncError until it is `expected` (or 10 s pass); returns the last state.
ncclResult_t AwaitState(const NcclApi& nccl, ncclComm_t comm, ncclResult_t expected) {
  const absl::Time until = Within(absl::Seconds(10));
  ncclResult_t state = ncclInProgress;
  while (absl::Now() < until) {
    EXPECT_EQ(nccl.ncclCommGetAsyncError(comm, &state), ncclSuccess);
    if (state == expected) break;
    absl::SleepFor(absl::Microseconds(200));
  }
  return state;
}

ncclConfig_t NonBlocking() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

TEST_F(NcclSimTest, AbortReleasesAPendingReceiveSoTheStreamDrains) {
  const NcclApi& nccl = Nccl();
  ncclUniqueId id;
  ASSERT_EQ(nccl.ncclGetUniqueId(&id), ncclSuccess);
  ncclConfig_t config = NonBlocking();
  ncclComm_t rank0 = nullptr;
  ncclComm_t rank1 = nullptr;
  ASSERT_EQ(nccl.ncclCommInitRankConfig(&rank0, 2, id, 0, &config), ncclInProgress);
  // Used before its initialization completed: refused.
  void* buffer = nullptr;
  ASSERT_EQ(cudaMalloc(&buffer, 4096), cudaSuccess);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  EXPECT_EQ(nccl.ncclRecv(buffer, 4096, ncclUint8, 1, rank0, stream), ncclInvalidArgument);
  ASSERT_EQ(nccl.ncclCommInitRankConfig(&rank1, 2, id, 1, &config), ncclInProgress);
  ASSERT_EQ(Settle(nccl, rank0), ncclSuccess);
  ASSERT_EQ(Settle(nccl, rank1), ncclSuccess);

  // 1024 int32 from rank 1, which never sends them.
  EXPECT_EQ(nccl.ncclRecv(buffer, 1024, ncclInt32, 1, rank0, stream), ncclInProgress);
  EXPECT_EQ(Settle(nccl, rank0), ncclSuccess);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(cudaStreamQuery(stream), cudaErrorNotReady);
  EXPECT_EQ(nccl.ncclCommAbort(rank0), ncclSuccess);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  // Rank 1 sees its peer go.
  EXPECT_EQ(AwaitState(nccl, rank1, ncclRemoteError), ncclRemoteError);
  EXPECT_THAT(nccl.ncclGetLastError(rank1), HasSubstr("closed its connection"));
  EXPECT_EQ(nccl.ncclCommAbort(rank1), ncclSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  EXPECT_EQ(cudaFree(buffer), cudaSuccess);
}

// Two non-blocking ranks of one communicator in this process, initialized.
void InitPair(const NcclApi& nccl, ncclComm_t* rank0, ncclComm_t* rank1) {
  ncclUniqueId id;
  ASSERT_EQ(nccl.ncclGetUniqueId(&id), ncclSuccess);
  ncclConfig_t config = NonBlocking();
  ASSERT_EQ(nccl.ncclCommInitRankConfig(rank0, 2, id, 0, &config), ncclInProgress);
  ASSERT_EQ(nccl.ncclCommInitRankConfig(rank1, 2, id, 1, &config), ncclInProgress);
  ASSERT_EQ(Settle(nccl, *rank0), ncclSuccess);
  ASSERT_EQ(Settle(nccl, *rank1), ncclSuccess);
}

TEST_F(NcclSimTest, FinalizeNeedsEveryRank) {
  const NcclApi& nccl = Nccl();
  ncclComm_t rank0 = nullptr;
  ncclComm_t rank1 = nullptr;
  ASSERT_NO_FATAL_FAILURE(InitPair(nccl, &rank0, &rank1));
  EXPECT_EQ(nccl.ncclCommFinalize(rank0), ncclInProgress);
  // Rank 0 stays in progress while rank 1 has not finalized.
  for (int i = 0; i < 20; ++i) {
    ncclResult_t state = ncclSuccess;
    EXPECT_EQ(nccl.ncclCommGetAsyncError(rank0, &state), ncclSuccess);
    EXPECT_EQ(state, ncclInProgress);
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(nccl.ncclCommFinalize(rank0), ncclInvalidArgument) << "finalized twice";
  EXPECT_EQ(nccl.ncclCommFinalize(rank1), ncclInProgress);
  EXPECT_EQ(Settle(nccl, rank0), ncclSuccess);
  EXPECT_EQ(Settle(nccl, rank1), ncclSuccess);
  EXPECT_EQ(nccl.ncclCommDestroy(rank0), ncclSuccess);
  EXPECT_EQ(nccl.ncclCommDestroy(rank1), ncclSuccess);

  // A rank that finalizes while the other still waits for its bytes: that one sees it go.
  ASSERT_NO_FATAL_FAILURE(InitPair(nccl, &rank0, &rank1));
  void* buffer = nullptr;
  ASSERT_EQ(cudaMalloc(&buffer, 4096), cudaSuccess);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  EXPECT_EQ(nccl.ncclRecv(buffer, 4096, ncclUint8, 1, rank0, stream), ncclInProgress);
  EXPECT_EQ(Settle(nccl, rank0), ncclSuccess);
  EXPECT_EQ(cudaStreamQuery(stream), cudaErrorNotReady);  // the first query runs nothing
  EXPECT_EQ(cudaStreamQuery(stream), cudaErrorNotReady);  // the receive starts
  EXPECT_EQ(nccl.ncclCommFinalize(rank1), ncclInProgress);
  EXPECT_EQ(AwaitState(nccl, rank0, ncclRemoteError), ncclRemoteError);
  EXPECT_THAT(nccl.ncclGetLastError(rank0), HasSubstr("finalized its communicator"));
  EXPECT_EQ(nccl.ncclCommAbort(rank0), ncclSuccess);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(AwaitState(nccl, rank1, ncclRemoteError), ncclRemoteError);
  EXPECT_EQ(nccl.ncclCommAbort(rank1), ncclSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  EXPECT_EQ(cudaFree(buffer), cudaSuccess);
}

TEST_F(NcclSimTest, BlockingRanksFinalizeAndDestroy) {
  const NcclApi& nccl = Nccl();
  ncclUniqueId id;
  ASSERT_EQ(nccl.ncclGetUniqueId(&id), ncclSuccess);
  constexpr size_t kCount = 1000;  // doubles
  const std::vector<uint8_t> payload = testutil::PatternBytes(kCount * sizeof(double), /*seed=*/8);
  std::vector<uint8_t> back(payload.size());
  // Blocking init waits for the other rank: one thread per rank.
  // Every CUDA call is checked: a failure is reported as ncclUnhandledCudaError.
  auto rank = [&](int r, ncclResult_t* result) {
    if (cudaSetDevice(0) != cudaSuccess) {
      *result = ncclUnhandledCudaError;
      return;
    }
    ncclComm_t comm = nullptr;
    *result = nccl.ncclCommInitRankConfig(&comm, 2, id, r, nullptr);
    if (*result != ncclSuccess) return;
    void* buffer = nullptr;
    cudaStream_t stream = nullptr;
    if (cudaMalloc(&buffer, payload.size()) != cudaSuccess ||
        cudaStreamCreate(&stream) != cudaSuccess ||
        (r == 1 && cudaMemcpy(buffer, payload.data(), payload.size(), cudaMemcpyHostToDevice) !=
                       cudaSuccess)) {
      *result = ncclUnhandledCudaError;
    } else if (r == 1) {
      *result = nccl.ncclSend(buffer, kCount, ncclFloat64, 0, comm, stream);
    } else {
      *result = nccl.ncclRecv(buffer, kCount, ncclFloat64, 1, comm, stream);
    }
    if (*result == ncclSuccess && cudaStreamSynchronize(stream) != cudaSuccess) {
      *result = ncclUnhandledCudaError;
    }
    if (*result == ncclSuccess && r == 0 &&
        cudaMemcpy(back.data(), buffer, back.size(), cudaMemcpyDeviceToHost) != cudaSuccess) {
      *result = ncclUnhandledCudaError;
    }
    if (*result == ncclSuccess) *result = nccl.ncclCommFinalize(comm);
    if (*result == ncclSuccess) *result = nccl.ncclCommDestroy(comm);
    if (stream != nullptr && cudaStreamDestroy(stream) != cudaSuccess) {
      *result = ncclUnhandledCudaError;
    }
    if (cudaFree(buffer) != cudaSuccess) *result = ncclUnhandledCudaError;
  };
  ncclResult_t results[2] = {ncclInternalError, ncclInternalError};
  std::thread other(rank, 1, &results[1]);
  rank(0, &results[0]);
  other.join();
  EXPECT_EQ(results[0], ncclSuccess) << nccl.ncclGetLastError(nullptr);
  EXPECT_EQ(results[1], ncclSuccess) << nccl.ncclGetLastError(nullptr);
  EXPECT_EQ(testutil::CountWrongBytes(payload, back), 0u);
}

TEST_F(NcclSimTest, MisuseIsRefused) {
  const NcclApi& nccl = Nccl();
  EXPECT_EQ(nccl.ncclGroupEnd(), ncclInvalidUsage);
  EXPECT_THAT(nccl.ncclGetLastError(nullptr), HasSubstr("without ncclGroupStart"));

  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  ncclComm_t comm = nullptr;
  EXPECT_EQ(nccl.ncclCommInitRankConfig(&comm, 1, id, 0, nullptr), ncclInvalidArgument);
  EXPECT_EQ(comm, nullptr);

  // A one-rank communicator; its id is spent once it has joined.
  ASSERT_EQ(nccl.ncclGetUniqueId(&id), ncclSuccess);
  ASSERT_EQ(nccl.ncclCommInitRankConfig(&comm, 1, id, 0, nullptr), ncclSuccess);
  ncclConfig_t config = NonBlocking();
  ncclComm_t again = nullptr;
  ASSERT_EQ(nccl.ncclCommInitRankConfig(&again, 1, id, 0, &config), ncclInProgress);
  EXPECT_EQ(Settle(nccl, again), ncclInvalidArgument);
  EXPECT_THAT(nccl.ncclGetLastError(again), HasSubstr("made no such unique id"));
  EXPECT_EQ(nccl.ncclCommAbort(again), ncclSuccess);

  // Host memory, a rank that does not exist, a type that does not exist.
  std::vector<uint8_t> host(64);
  EXPECT_EQ(nccl.ncclSend(host.data(), host.size(), ncclUint8, 0, comm, nullptr),
            ncclInvalidArgument);
  void* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, 64), cudaSuccess);
  EXPECT_EQ(nccl.ncclSend(device, 64, ncclUint8, 1, comm, nullptr), ncclInvalidArgument);
  EXPECT_EQ(nccl.ncclSend(device, 64, static_cast<ncclDataType_t>(ncclNumTypes), 0, comm, nullptr),
            ncclInvalidArgument);
  // A failed call inside a group fails the group; nothing is posted.
  ASSERT_EQ(nccl.ncclGroupStart(), ncclSuccess);
  EXPECT_EQ(nccl.ncclSend(device, 64, ncclUint8, 0, comm, nullptr), ncclSuccess);
  EXPECT_EQ(nccl.ncclRecv(device, 64, ncclUint8, 1, comm, nullptr), ncclInvalidArgument);
  EXPECT_EQ(nccl.ncclGroupEnd(), ncclInvalidArgument);
  // Sizes of a send to itself and its receive must agree.
  ASSERT_EQ(nccl.ncclGroupStart(), ncclSuccess);
  EXPECT_EQ(nccl.ncclSend(device, 64, ncclUint8, 0, comm, nullptr), ncclSuccess);
  EXPECT_EQ(nccl.ncclRecv(device, 32, ncclUint8, 0, comm, nullptr), ncclSuccess);
  EXPECT_EQ(nccl.ncclGroupEnd(), ncclInvalidUsage);
  // Nested groups post at the outermost end: here a matched pair.
  ASSERT_EQ(nccl.ncclGroupStart(), ncclSuccess);
  ASSERT_EQ(nccl.ncclGroupStart(), ncclSuccess);
  EXPECT_EQ(nccl.ncclSend(device, 16, ncclFloat32, 0, comm, nullptr), ncclSuccess);
  EXPECT_EQ(nccl.ncclGroupEnd(), ncclSuccess);
  EXPECT_EQ(nccl.ncclRecv(device, 16, ncclFloat32, 0, comm, nullptr), ncclSuccess);
  EXPECT_EQ(nccl.ncclGroupEnd(), ncclSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  EXPECT_EQ(nccl.ncclCommFinalize(comm), ncclSuccess);
  EXPECT_EQ(nccl.ncclSend(device, 64, ncclUint8, 0, comm, nullptr), ncclInvalidUsage);
  EXPECT_EQ(nccl.ncclCommDestroy(comm), ncclSuccess);
  EXPECT_EQ(cudaFree(device), cudaSuccess);
}

}  // namespace
}  // namespace transport
}  // namespace kvmesh

// Helper mode (rank 1 of a pair, started by Helper::Start) or the tests.
int main(int argc, char** argv) {
  if (argc >= 2 && std::strcmp(argv[1], kvmesh::transport::kHelperFlag) == 0) {
    kvmesh::transport::HelperTask task;
    if (!kvmesh::transport::ParseHelperTask(argc, argv, &task)) {
      return kvmesh::transport::kExitBadArguments;
    }
    return kvmesh::transport::RunHelper(task);
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}

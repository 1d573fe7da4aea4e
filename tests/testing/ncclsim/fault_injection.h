// The simulator's injected faults ($KVMESH_NCCLSIM_HANG and $KVMESH_NCCLSIM_ERROR, described in
// nccl_sim.h): parsed once, at the first call into the library, and counted process-wide.
//
// Thread safety: thread-safe; Faults() is immutable apart from its atomic counters.
#ifndef KVMESH_TESTS_TESTING_NCCLSIM_FAULT_INJECTION_H_
#define KVMESH_TESTS_TESTING_NCCLSIM_FAULT_INJECTION_H_

#include <nccl.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace ncclsim {

inline constexpr char kHangEnv[] = "KVMESH_NCCLSIM_HANG";
inline constexpr char kErrorEnv[] = "KVMESH_NCCLSIM_ERROR";

// What happens to one posted send or receive.
struct OpFault {
  bool hang = false;                    // never moves a byte
  std::optional<ncclResult_t> failure;  // becomes the communicator's async error when it runs
};

// "ncclRemoteError" for ncclRemoteError; "ncclResult_t N" for a value outside the enum.
std::string ResultName(ncclResult_t result);

class FaultInjection {
 public:
  // Parses `hang` and `error` (the two variables' values; null or "" for none).
  FaultInjection(const char* hang, const char* error);
  FaultInjection(const FaultInjection&) = delete;
  FaultInjection& operator=(const FaultInjection&) = delete;

  // The process's faults, from the environment at the first call. Never destroyed.
  static const FaultInjection& Get();

  // Why the variables could not be parsed; empty when they could.
  const std::string& problem() const { return problem_; }

  // Counts a call of the exported function `function`; the result to return instead of doing
  // the call when this is a call that KVMESH_NCCLSIM_ERROR names.
  std::optional<ncclResult_t> OnCall(const char* function) const;
  // Counts an ncclSend (send = true) or ncclRecv call and returns its operation's faults.
  OpFault OnOp(bool send) const;
  // Counts a communicator initialization; the async error it must end with, if any.
  std::optional<ncclResult_t> OnInit() const;

 private:
  // Every occurrence of one counted thing that has a fault: occurrence number -> result (for
  // hangs the result is unused).
  struct Counted {
    mutable std::atomic<uint64_t> count{0};
    std::map<uint64_t, ncclResult_t> at;
  };
  // The result planned for the next occurrence of `key`, counting it; nullopt when `key` has no
  // faults or this occurrence has none.
  std::optional<ncclResult_t> Next(const std::string& key) const;
  bool ParseHang(const std::string& spec);
  bool ParseError(const std::string& spec);

  // Keys: an exported function's name; "error:send", "error:recv", "error:init";
  // "hang:send", "hang:recv". Filled by the constructor only.
  std::map<std::string, std::unique_ptr<Counted>> faults_;
  std::string problem_;
};

}  // namespace ncclsim

#endif  // KVMESH_TESTS_TESTING_NCCLSIM_FAULT_INJECTION_H_

#include "tests/testing/ncclsim/fault_injection.h"

#include <cstdlib>
#include <cstring>

namespace ncclsim {
namespace {

constexpr const char* kResultNames[] = {
    "ncclSuccess",         "ncclUnhandledCudaError", "ncclSystemError", "ncclInternalError",
    "ncclInvalidArgument", "ncclInvalidUsage",       "ncclRemoteError", "ncclInProgress",
};
static_assert(sizeof(kResultNames) / sizeof(kResultNames[0]) == ncclNumResults);

// The functions of nccl_sim.cc whose calls KVMESH_NCCLSIM_ERROR can fail.
constexpr const char* kFunctions[] = {
    "ncclGetVersion",
    "ncclGetUniqueId",
    "ncclCommInitRankConfig",
    "ncclCommFinalize",
    "ncclCommDestroy",
    "ncclCommAbort",
    "ncclCommGetAsyncError",
    "ncclGroupStart",
    "ncclGroupEnd",
    "ncclSend",
    "ncclRecv",
};

std::vector<std::string> Split(const std::string& text, char separator) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const size_t end = text.find(separator, start);
    parts.push_back(text.substr(start, end == std::string::npos ? end : end - start));
    if (end == std::string::npos) return parts;
    start = end + 1;
  }
}

// A positive decimal number.
std::optional<uint64_t> ParseCount(const std::string& text) {
  if (text.empty() || text.size() > 18) return std::nullopt;
  uint64_t value = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
    value = value * 10 + static_cast<uint64_t>(c - '0');
  }
  if (value == 0) return std::nullopt;
  return value;
}

// An ncclResult_t other than ncclSuccess, by name or number.
std::optional<ncclResult_t> ParseResult(const std::string& text) {
  for (int i = 1; i < ncclNumResults; ++i) {
    if (text == kResultNames[i]) return static_cast<ncclResult_t>(i);
  }
  const std::optional<uint64_t> number = ParseCount(text);
  if (number && *number < ncclNumResults) return static_cast<ncclResult_t>(*number);
  return std::nullopt;
}

bool IsFunction(const std::string& name) {
  for (const char* function : kFunctions) {
    if (name == function) return true;
  }
  return false;
}

}  // namespace

std::string ResultName(ncclResult_t result) {
  const int value = static_cast<int>(result);
  if (value >= 0 && value < ncclNumResults) return kResultNames[value];
  return "ncclResult_t " + std::to_string(value);
}

FaultInjection::FaultInjection(const char* hang, const char* error) {
  if (hang != nullptr && hang[0] != '\0' && !ParseHang(hang)) return;
  if (error != nullptr && error[0] != '\0') ParseError(error);
}

const FaultInjection& FaultInjection::Get() {
  // Immortal: other threads may still call into the library while the process exits.
  static const FaultInjection* const faults =
      new FaultInjection(std::getenv(kHangEnv), std::getenv(kErrorEnv));
  return *faults;
}

bool FaultInjection::ParseHang(const std::string& spec) {
  for (const std::string& item : Split(spec, ',')) {
    const std::vector<std::string> parts = Split(item, ':');
    const std::optional<uint64_t> nth = parts.size() == 2 ? ParseCount(parts[1]) : std::nullopt;
    if (!nth || (parts[0] != "send" && parts[0] != "recv")) {
      problem_ = std::string(kHangEnv) + "='" + spec + "': '" + item +
                 "' is not send:N or recv:N (N counted from 1)";
      return false;
    }
    std::unique_ptr<Counted>& counted = faults_["hang:" + parts[0]];
    if (counted == nullptr) counted = std::make_unique<Counted>();
    counted->at[*nth] = ncclSuccess;
  }
  return true;
}

bool FaultInjection::ParseError(const std::string& spec) {
  for (const std::string& item : Split(spec, ',')) {
    const std::vector<std::string> parts = Split(item, ':');
    const std::optional<uint64_t> nth = parts.size() == 3 ? ParseCount(parts[1]) : std::nullopt;
    const std::optional<ncclResult_t> result =
        parts.size() == 3 ? ParseResult(parts[2]) : std::nullopt;
    const bool kind = parts[0] == "send" || parts[0] == "recv" || parts[0] == "init";
    if (!nth || !result || (!kind && !IsFunction(parts[0]))) {
      problem_ = std::string(kErrorEnv) + "='" + spec + "': '" + item +
                 "' is not WHAT:N:RESULT (WHAT: an exported function, send, recv or init; N "
                 "counted from 1; RESULT: an ncclResult_t other than ncclSuccess)";
      return false;
    }
    std::unique_ptr<Counted>& counted = faults_[kind ? "error:" + parts[0] : parts[0]];
    if (counted == nullptr) counted = std::make_unique<Counted>();
    counted->at[*nth] = *result;
  }
  return true;
}

std::optional<ncclResult_t> FaultInjection::Next(const std::string& key) const {
  const auto it = faults_.find(key);
  if (it == faults_.end()) return std::nullopt;
  const uint64_t nth = it->second->count.fetch_add(1, std::memory_order_relaxed) + 1;
  const auto planned = it->second->at.find(nth);
  if (planned == it->second->at.end()) return std::nullopt;
  return planned->second;
}

std::optional<ncclResult_t> FaultInjection::OnCall(const char* function) const {
  if (faults_.empty()) return std::nullopt;
  return Next(function);
}

OpFault FaultInjection::OnOp(bool send) const {
  OpFault fault;
  if (faults_.empty()) return fault;
  fault.hang = Next(send ? "hang:send" : "hang:recv").has_value();
  fault.failure = Next(send ? "error:send" : "error:recv");
  return fault;
}

std::optional<ncclResult_t> FaultInjection::OnInit() const {
  if (faults_.empty()) return std::nullopt;
  return Next("error:init");
}

}  // namespace ncclsim

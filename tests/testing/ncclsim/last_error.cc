#include "tests/testing/ncclsim/last_error.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace ncclsim {
namespace {

constexpr size_t kMaxMessage = 1024;

// Immortal: a thread may report an error while the process exits.
std::mutex& Mu() {
  static std::mutex* const mu = new std::mutex;
  return *mu;
}
char last_message[kMaxMessage];  // guarded by Mu()

}  // namespace

void RecordError(const std::string& message) {
  {
    std::lock_guard<std::mutex> lock(Mu());
    std::snprintf(last_message, sizeof(last_message), "%s", message.c_str());
  }
  static const bool debug = [] {
    const char* level = std::getenv("NCCL_DEBUG");
    return level != nullptr && level[0] != '\0';
  }();
  if (debug) std::fprintf(stderr, "ncclsim WARN %s\n", message.c_str());
}

const char* LastError() {
  // Plain bytes, so the thread-local needs no destructor.
  thread_local char copy[kMaxMessage];
  std::lock_guard<std::mutex> lock(Mu());
  std::memcpy(copy, last_message, sizeof(copy));
  return copy;
}

}  // namespace ncclsim

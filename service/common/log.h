// The node's log: one line per event on stderr, through spdlog (Debian's libspdlog), as text
// for people or as JSON for a log pipeline (--log-format), from --log-level up.
//
//   text: 2026-11-24T13:05:01.234Z I kvmesh-node n1: rpc done method=Append code=OK ms=0.213
//   json: {"ts":"2026-11-24T13:05:01.234567Z","level":"info","node":"n1","msg":"rpc done",
//          "method":"Append","code":"OK","ms":"0.213"}
//
// Levels: debug (a line per request), info (lifecycle: start, listen, drain, shutdown, reloads),
// warning (every error status a request gets, and trouble the node works around), error (the
// node cannot go on). Fields are key=value pairs, left out when the value is empty; text quotes a
// value with spaces, quotes or '='.
//
// Thread safety: Log may be called from any thread; ConfigureLogging before any thread logs.
#ifndef KVMESH_SERVICE_COMMON_LOG_H_
#define KVMESH_SERVICE_COMMON_LOG_H_

#include <initializer_list>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvmesh {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3, kOff = 4 };

struct LogField {
  absl::string_view key;
  std::string value;
};

// `level`: debug, info, warning, error or off. `format`: text or json. `node`: the node's name,
// in every line. INVALID_ARGUMENT names a bad level or format. Without a call: info, text.
absl::Status ConfigureLogging(absl::string_view level, absl::string_view format,
                              absl::string_view node);

// Whether a line at `level` would be written (to skip building its fields).
bool LogEnabled(LogLevel level);

void Log(LogLevel level, absl::string_view message, std::initializer_list<LogField> fields = {});

}  // namespace kvmesh

#endif  // KVMESH_SERVICE_COMMON_LOG_H_

#include "service/common/log.h"

#include <atomic>
#include <memory>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "spdlog/pattern_formatter.h"
#include "spdlog/sinks/stdout_sinks.h"
#include "spdlog/spdlog.h"

namespace kvmesh {
namespace {

enum class Format { kText, kJson };

struct State {
  std::shared_ptr<spdlog::logger> logger;
  Format format = Format::kText;
  std::string node;
};

// Set once by ConfigureLogging before the node starts threads; read by every Log.
State* g_state = nullptr;
std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};

spdlog::level::level_enum SpdLevel(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug:
      return spdlog::level::debug;
    case LogLevel::kInfo:
      return spdlog::level::info;
    case LogLevel::kWarning:
      return spdlog::level::warn;
    case LogLevel::kError:
      return spdlog::level::err;
    case LogLevel::kOff:
      return spdlog::level::off;
  }
  return spdlog::level::info;
}

std::shared_ptr<spdlog::logger> MakeLogger(Format format) {
  // stderr, unbuffered apart from the line, one lock: lines of different threads never mix.
  auto logger =
      std::make_shared<spdlog::logger>("kvmesh", std::make_shared<spdlog::sinks::stderr_sink_mt>());
  logger->set_level(spdlog::level::trace);  // Log filters by g_level
  logger->flush_on(spdlog::level::trace);
  const std::string pattern = format == Format::kJson
                                  ? R"({"ts":"%Y-%m-%dT%H:%M:%S.%fZ","level":"%l",%v})"
                                  : "%Y-%m-%dT%H:%M:%S.%eZ %L %v";
  logger->set_formatter(
      std::make_unique<spdlog::pattern_formatter>(pattern, spdlog::pattern_time_type::utc));
  return logger;
}

State& GetState() {
  if (g_state == nullptr) {
    // Not configured (a test, a tool): text at info, no node name.
    static State* const fallback = [] {
      auto* s = new State;
      s->logger = MakeLogger(Format::kText);
      return s;
    }();
    return *fallback;
  }
  return *g_state;
}

void AppendJsonString(std::string* out, absl::string_view s) {
  out->push_back('"');
  for (const char c : s) {
    switch (c) {
      case '"':
        out->append("\\\"");
        break;
      case '\\':
        out->append("\\\\");
        break;
      case '\n':
        out->append("\\n");
        break;
      case '\r':
        out->append("\\r");
        break;
      case '\t':
        out->append("\\t");
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          absl::StrAppend(out, absl::StrFormat("\\u%04x", static_cast<unsigned char>(c)));
        } else {
          out->push_back(c);  // UTF-8 passes through
        }
    }
  }
  out->push_back('"');
}

bool NeedsQuotes(absl::string_view value) {
  if (value.empty()) return true;
  for (const char c : value) {
    if (c == ' ' || c == '"' || c == '=' || static_cast<unsigned char>(c) < 0x20) return true;
  }
  return false;
}

void AppendTextValue(std::string* out, absl::string_view value) {
  if (!NeedsQuotes(value)) {
    out->append(value.data(), value.size());
    return;
  }
  AppendJsonString(out, value);  // the same escaping: one line, unambiguous
}

}  // namespace

absl::Status ConfigureLogging(absl::string_view level, absl::string_view format,
                              absl::string_view node) {
  const std::string l = absl::AsciiStrToLower(level);
  LogLevel parsed;
  if (l == "debug") {
    parsed = LogLevel::kDebug;
  } else if (l == "info") {
    parsed = LogLevel::kInfo;
  } else if (l == "warning" || l == "warn") {
    parsed = LogLevel::kWarning;
  } else if (l == "error") {
    parsed = LogLevel::kError;
  } else if (l == "off") {
    parsed = LogLevel::kOff;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "--log-level=", level, " is not a level: use debug, info, warning, error or off"));
  }
  Format f;
  if (format == "text") {
    f = Format::kText;
  } else if (format == "json") {
    f = Format::kJson;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--log-format=", format, " is not a format: use text or json"));
  }
  auto* state = new State;  // lives as long as the process: lines may come until exit
  state->logger = MakeLogger(f);
  state->format = f;
  state->node = std::string(node);
  g_state = state;
  g_level.store(static_cast<int>(parsed));
  return absl::OkStatus();
}

bool LogEnabled(LogLevel level) {
  return level != LogLevel::kOff &&
         static_cast<int>(level) >= g_level.load(std::memory_order_relaxed);
}

void Log(LogLevel level, absl::string_view message, std::initializer_list<LogField> fields) {
  if (!LogEnabled(level)) return;
  State& state = GetState();
  std::string line;
  if (state.format == Format::kJson) {
    line.append("\"node\":");
    AppendJsonString(&line, state.node);
    line.append(",\"msg\":");
    AppendJsonString(&line, message);
    for (const LogField& field : fields) {
      if (field.value.empty()) continue;
      line.push_back(',');
      AppendJsonString(&line, field.key);
      line.push_back(':');
      AppendJsonString(&line, field.value);
    }
  } else {
    line = state.node.empty() ? std::string("kvmesh-node: ")
                              : absl::StrCat("kvmesh-node ", state.node, ": ");
    line.append(message.data(), message.size());
    for (const LogField& field : fields) {
      if (field.value.empty()) continue;
      absl::StrAppend(&line, " ", field.key, "=");
      AppendTextValue(&line, field.value);
    }
  }
  // spdlog would read braces in the line as its format syntax: pass it as an argument.
  state.logger->log(SpdLevel(level), "{}", line);
}

}  // namespace kvmesh

#include "service/ctl/args.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "service/common/flags.h"

namespace kvmesh {
namespace ctl {
namespace {

absl::Status BadValue(absl::string_view name, absl::string_view value, absl::string_view want) {
  return absl::InvalidArgumentError(absl::StrCat("--", name, "='", value, "' is not ", want));
}

}  // namespace

absl::StatusOr<Args> Args::Parse(int argc, const char* const* argv,
                                 absl::Span<const absl::string_view> bool_flags) {
  Args args;
  bool have_command = false;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg.size() > 2 && arg.substr(0, 2) == "--") {
      absl::string_view body = arg.substr(2);
      const size_t eq = body.find('=');
      std::string name(body.substr(0, eq));
      if (eq != absl::string_view::npos) {
        args.flags_.emplace_back(std::move(name), std::string(body.substr(eq + 1)));
      } else if (std::find(bool_flags.begin(), bool_flags.end(), name) != bool_flags.end()) {
        args.flags_.emplace_back(std::move(name), "true");
      } else if (i + 1 < argc) {
        args.flags_.emplace_back(std::move(name), argv[++i]);
      } else {
        args.missing_value_.push_back(std::move(name));
      }
    } else if (arg == "--") {
      return absl::InvalidArgumentError("'--' alone is not an argument");
    } else if (arg == "-h") {
      args.flags_.emplace_back("help", "true");
    } else if (!have_command) {
      args.command_ = std::string(arg);
      have_command = true;
    } else {
      args.positional_.emplace_back(arg);
    }
  }
  return args;
}

bool Args::Has(absl::string_view name) const {
  return std::any_of(flags_.begin(), flags_.end(), [&](const auto& f) { return f.first == name; });
}

std::optional<std::string> Args::Get(absl::string_view name) const {
  for (auto it = flags_.rbegin(); it != flags_.rend(); ++it) {
    if (it->first == name) return it->second;
  }
  return std::nullopt;
}

std::vector<std::string> Args::GetAll(absl::string_view name) const {
  std::vector<std::string> out;
  for (const auto& f : flags_) {
    if (f.first == name) out.push_back(f.second);
  }
  return out;
}

absl::StatusOr<std::string> Args::GetString(absl::string_view name,
                                            std::optional<std::string> fallback) const {
  if (auto v = Get(name)) return *v;
  if (fallback) return *fallback;
  return absl::InvalidArgumentError(absl::StrCat("--", name, " is required"));
}

absl::StatusOr<int64_t> Args::GetInt(absl::string_view name,
                                     std::optional<int64_t> fallback) const {
  std::optional<std::string> v = Get(name);
  if (!v) {
    if (fallback) return *fallback;
    return absl::InvalidArgumentError(absl::StrCat("--", name, " is required"));
  }
  int64_t out;
  if (!absl::SimpleAtoi(*v, &out)) return BadValue(name, *v, "an integer");
  return out;
}

absl::StatusOr<double> Args::GetDouble(absl::string_view name,
                                       std::optional<double> fallback) const {
  std::optional<std::string> v = Get(name);
  if (!v) {
    if (fallback) return *fallback;
    return absl::InvalidArgumentError(absl::StrCat("--", name, " is required"));
  }
  double out;
  if (!absl::SimpleAtod(*v, &out)) return BadValue(name, *v, "a number");
  return out;
}

absl::StatusOr<bool> Args::GetBool(absl::string_view name) const {
  std::optional<std::string> v = Get(name);
  if (!v) return false;
  const std::string lower = absl::AsciiStrToLower(*v);
  if (lower == "true" || lower == "1" || lower == "yes") return true;
  if (lower == "false" || lower == "0" || lower == "no") return false;
  return BadValue(name, *v, "true or false");
}

absl::StatusOr<absl::Duration> Args::GetDuration(absl::string_view name,
                                                 std::optional<absl::Duration> fallback) const {
  std::optional<std::string> v = Get(name);
  if (!v) {
    if (fallback) return *fallback;
    return absl::InvalidArgumentError(absl::StrCat("--", name, " is required"));
  }
  absl::Duration d;
  double seconds;
  if (absl::SimpleAtod(*v, &seconds)) {
    d = absl::Seconds(seconds);
  } else if (!absl::ParseDuration(*v, &d)) {
    return BadValue(name, *v, "a duration (e.g. 10s, 250ms)");
  }
  if (d <= absl::ZeroDuration()) return BadValue(name, *v, "a positive duration");
  return d;
}

absl::StatusOr<int64_t> Args::GetBytes(absl::string_view name,
                                       std::optional<int64_t> fallback) const {
  std::optional<std::string> v = Get(name);
  if (!v) {
    if (fallback) return *fallback;
    return absl::InvalidArgumentError(absl::StrCat("--", name, " is required"));
  }
  absl::StatusOr<uint64_t> bytes = ParseByteSize(*v);
  if (!bytes.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, ": ", bytes.status().message()));
  }
  if (*bytes > static_cast<uint64_t>(INT64_MAX)) {
    return BadValue(name, *v, "a byte count below 2^63");
  }
  return static_cast<int64_t>(*bytes);
}

absl::Status Args::CheckAllowed(absl::Span<const absl::string_view> allowed) const {
  std::vector<absl::string_view> given;
  for (const auto& f : flags_) given.push_back(f.first);
  given.insert(given.end(), missing_value_.begin(), missing_value_.end());
  for (absl::string_view name : given) {
    if (std::find(allowed.begin(), allowed.end(), name) == allowed.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown flag --", name, (command_.empty() ? "" : " for '" + command_ + "'"),
                       "; allowed: --", absl::StrJoin(allowed, ", --")));
    }
  }
  if (!missing_value_.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--", missing_value_[0], " needs a value"));
  }
  return absl::OkStatus();
}

}  // namespace ctl
}  // namespace kvmesh

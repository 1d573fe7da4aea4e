// Args: a hand-rolled command line of the form
//   [--flag[=value]]... [command] [--flag[=value] | --flag value | positional]...
// shared by kvmeshctl and the RPC benchmark. Flags may appear before or after the command and may
// repeat (GetAll returns every value; the typed getters use the last one). Flags listed as
// boolean take no separate value (--json, --json=false); every other flag takes "=value" or the
// next argument.
//
// Thread safety: an immutable value after Parse; safe to read from any thread.
#ifndef KVMESH_SERVICE_CTL_ARGS_H_
#define KVMESH_SERVICE_CTL_ARGS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace kvmesh {
namespace ctl {

class Args {
 public:
  // Parses argv[1..argc). `bool_flags`: names (without "--") that take no separate value.
  // INVALID_ARGUMENT for "--" alone. A value flag at the end of the line without a value is
  // reported by CheckAllowed (after unknown names, so a typo is named as such).
  static absl::StatusOr<Args> Parse(int argc, const char* const* argv,
                                    absl::Span<const absl::string_view> bool_flags);

  // The first positional argument ("" when none) and the rest.
  const std::string& command() const { return command_; }
  const std::vector<std::string>& positional() const { return positional_; }

  bool Has(absl::string_view name) const;
  // The last value given for `name`, if any.
  std::optional<std::string> Get(absl::string_view name) const;
  std::vector<std::string> GetAll(absl::string_view name) const;

  // Typed getters: the last value of `name` or `fallback` when absent (nullopt fallback: the
  // flag is required). INVALID_ARGUMENT names the flag and the value that does not parse.
  absl::StatusOr<std::string> GetString(absl::string_view name,
                                        std::optional<std::string> fallback = std::nullopt) const;
  absl::StatusOr<int64_t> GetInt(absl::string_view name,
                                 std::optional<int64_t> fallback = std::nullopt) const;
  absl::StatusOr<double> GetDouble(absl::string_view name,
                                   std::optional<double> fallback = std::nullopt) const;
  // true for "--name", "--name=true|1|yes"; false for "--name=false|0|no" or absent.
  absl::StatusOr<bool> GetBool(absl::string_view name) const;
  // "10s", "250ms", "1m30s", or a bare number of seconds ("2.5").
  absl::StatusOr<absl::Duration> GetDuration(absl::string_view name,
                                             std::optional<absl::Duration> fallback) const;
  // "1048576", or with a binary suffix: "64KiB", "1MiB", "2GiB" (kvmesh::ParseByteSize).
  absl::StatusOr<int64_t> GetBytes(absl::string_view name,
                                   std::optional<int64_t> fallback = std::nullopt) const;

  // INVALID_ARGUMENT naming the first flag given that is not in `allowed`, else the first value
  // flag given without a value.
  absl::Status CheckAllowed(absl::Span<const absl::string_view> allowed) const;

 private:
  std::string command_;
  std::vector<std::string> positional_;
  std::vector<std::pair<std::string, std::string>> flags_;  // in order given
  std::vector<std::string> missing_value_;  // value flags that ended the line without one
};

}  // namespace ctl
}  // namespace kvmesh

#endif  // KVMESH_SERVICE_CTL_ARGS_H_

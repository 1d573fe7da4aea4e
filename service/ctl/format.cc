#include "service/ctl/format.h"

#include <algorithm>
#include <array>
#include <cstddef>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"

namespace kvmesh {
namespace ctl {
namespace {

std::string OrDash(std::string text) { return text.empty() ? "-" : text; }

}  // namespace

std::string TransferLine(const v1::TransferStats& stats) {
  std::string line = absl::StrCat(stats.transport().empty() ? "?" : stats.transport(), ", ");
  if (stats.bytes() < (int64_t{1} << 20)) {
    absl::StrAppend(&line, stats.bytes(), " B");
  } else {
    absl::StrAppend(&line, absl::StrFormat("%.1f MiB", stats.bytes() / 1048576.0));
  }
  absl::StrAppend(&line, absl::StrFormat(" in %.1f ms", stats.micros() / 1e3));
  if (stats.micros() > 0) {
    // bytes per microsecond = MB/s; / 1e3 = GB/s.
    absl::StrAppend(&line, absl::StrFormat(", %.2f GB/s", stats.bytes() / 1e3 / stats.micros()));
  }
  return line;
}

std::string NodeResultLine(const v1::NodeResult& result) {
  std::string line = absl::StrCat(
      result.node(), ": ", absl::StatusCodeToString(static_cast<absl::StatusCode>(result.code())));
  if (!result.message().empty()) absl::StrAppend(&line, ": ", result.message());
  return line;
}

std::string MemberHealthText(v1::MemberHealth health) {
  switch (health) {
    case v1::MEMBER_HEALTH_SERVING:
      return "SERVING";
    case v1::MEMBER_HEALTH_NOT_SERVING:
      return "NOT_SERVING";
    case v1::MEMBER_HEALTH_UNREACHABLE:
      return "UNREACHABLE";
    default:
      return "UNKNOWN";
  }
}

std::string MembersTable(const v1::ListMembersResponse& response) {
  using Row = std::array<std::string, 6>;
  std::vector<Row> rows = {{"NAME", "ADDRESS", "HEALTH", "BACKEND", "TRANSPORTS", "DETAIL"}};
  for (const v1::Member& m : response.members()) {
    rows.push_back({absl::StrCat(m.name(), m.self() ? " *" : ""), OrDash(m.address()),
                    MemberHealthText(m.health()), OrDash(m.backend()),
                    OrDash(absl::StrJoin(m.transports(), ",")), OrDash(m.detail())});
  }
  std::array<size_t, 6> width = {};
  for (const Row& row : rows) {
    for (size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  }
  std::string out;
  for (const Row& row : rows) {
    std::string line;
    for (size_t c = 0; c + 1 < row.size(); ++c) {
      absl::StrAppend(&line, row[c], std::string(width[c] - row[c].size() + 2, ' '));
    }
    absl::StrAppend(&line, row.back());
    absl::StripTrailingAsciiWhitespace(&line);
    absl::StrAppend(&out, line, "\n");
  }
  return out;
}

absl::StatusOr<v1::RemoveScope> ParseRemoveScope(absl::string_view text) {
  std::string lower = absl::AsciiStrToLower(text);
  absl::string_view name = lower;
  absl::ConsumePrefix(&name, "remove_scope_");
  if (name == "local") return v1::REMOVE_SCOPE_LOCAL;
  if (name == "cluster") return v1::REMOVE_SCOPE_CLUSTER;
  return absl::InvalidArgumentError(
      absl::StrCat("--scope='", text, "': expected local or cluster"));
}

}  // namespace ctl
}  // namespace kvmesh

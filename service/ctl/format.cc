#include "service/ctl/format.h"

#include <algorithm>
#include <array>
#include <cinttypes>
#include <cstddef>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"

namespace kvmesh {
namespace ctl {
namespace {

std::string OrDash(std::string text) { return text.empty() ? "-" : text; }

// ",rope=..." of a group's shorthand.
std::string RopeText(const v1::Rope& r) {
  if (r.type() == v1::ROPE_TYPE_NONE) return ",rope=none";
  std::string out = absl::StrCat(",rope=", r.type() == v1::ROPE_TYPE_NEOX ? "neox" : "normal", ":",
                                 r.dims(), ":", r.base());
  if (r.freq_scale() != 1.0f) absl::StrAppend(&out, ":", r.freq_scale());
  return out;
}

std::string HeadDimText(int32_t k, int32_t v) {
  if (k == v) return absl::StrCat(",head_dim=", k);
  return absl::StrCat(",head_dim_k=", k, ",head_dim_v=", v);
}

}  // namespace

std::string Mib(int64_t bytes) { return absl::StrFormat("%.1f MiB", bytes / 1048576.0); }

std::string Rate(int64_t bytes, absl::Duration elapsed) {
  const double s = absl::ToDoubleSeconds(elapsed);
  if (s <= 0) return "-";
  return absl::StrFormat("%.2f GB/s", bytes / s / 1e9);
}

std::string Ms(absl::Duration d) {
  return absl::StrFormat("%.1f ms", absl::ToDoubleMilliseconds(d));
}

std::string DTypeText(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_F32:
      return "f32";
    case v1::DTYPE_F16:
      return "f16";
    case v1::DTYPE_BF16:
      return "bf16";
    default:
      return v1::DType_Name(dtype);
  }
}

std::string GroupText(const v1::LayerGroup& group) {
  switch (group.kind_case()) {
    case v1::LayerGroup::kAttention: {
      const v1::Attention& a = group.attention();
      std::string out =
          absl::StrCat("attention:layers=", group.num_layers(), ",heads=", a.num_kv_heads(),
                       HeadDimText(a.head_dim_k(), a.head_dim_v()));
      const v1::Window& w = a.window();
      switch (w.kind_case()) {
        case v1::Window::kSliding:
          absl::StrAppend(&out, ",window=sliding:", w.sliding().window());
          if (w.sliding().memory() != 0) absl::StrAppend(&out, ":", w.sliding().memory());
          break;
        case v1::Window::kChunked:
          absl::StrAppend(&out, ",window=chunked:", w.chunked().chunk());
          break;
        default:
          absl::StrAppend(&out, ",window=full");
      }
      return out + RopeText(a.rope());
    }
    case v1::LayerGroup::kRotating: {
      const v1::Rotating& r = group.rotating();
      return absl::StrCat("rotating:layers=", group.num_layers(), ",heads=", r.num_kv_heads(),
                          HeadDimText(r.head_dim_k(), r.head_dim_v()), ",max_size=", r.max_size(),
                          RopeText(r.rope()));
    }
    case v1::LayerGroup::kRecurrent: {
      const v1::Recurrent& r = group.recurrent();
      std::string out = absl::StrCat("recurrent:layers=", group.num_layers(),
                                     ",conv_tail=", r.conv_tail(), ",conv_dim=", r.conv_dim());
      if (r.num_v_heads() != 0) {
        absl::StrAppend(&out, ",v_heads=", r.num_v_heads(), ",head_v_dim=", r.head_v_dim(),
                        ",head_k_dim=", r.head_k_dim());
      }
      return out;
    }
    case v1::LayerGroup::KIND_NOT_SET:
      break;
  }
  return absl::StrCat("layers=", group.num_layers(), " (unknown kind)");
}

v1::LayerGroup::KindCase GroupKindOf(const v1::CacheSpec& spec, int g) {
  if (g < 0 || g >= spec.groups_size()) return v1::LayerGroup::KIND_NOT_SET;
  return spec.groups(g).kind_case();
}

std::string StateText(v1::StateStatus state) {
  switch (state) {
    case v1::STATE_STATUS_VALID:
      return "VALID";
    case v1::STATE_STATUS_INVALID:
      return "INVALID";
    case v1::STATE_STATUS_NONE:
      return "none";
    default:
      return v1::StateStatus_Name(state);
  }
}

std::string UsageText(const v1::CacheUsage& usage, const v1::CacheSpec& spec) {
  std::string out =
      absl::StrFormat("  sequences live %d/%d, bytes held %s, snapshots %d (%s)\n",
                      usage.sequences_live(), spec.max_sequences(), Mib(usage.bytes_held()),
                      usage.snapshots(), Mib(usage.snapshot_bytes()));
  for (const v1::GroupUsage& g : usage.groups()) {
    const double pct =
        g.cells_total() > 0 ? 100.0 * static_cast<double>(g.cells_used()) / g.cells_total() : 0;
    const std::string memory =
        g.memory() == 0 ? std::string("unlimited") : absl::StrCat(g.memory(), " tokens/seq");
    switch (GroupKindOf(spec, g.group())) {
      case v1::LayerGroup::kRotating:
        absl::StrAppendFormat(&out,
                              "  group %d (rotating): ring rows %" PRId64 "/%" PRId64
                              " used (%.1f%%), memory %s, %s\n",
                              g.group(), g.cells_used(), g.cells_total(), pct, memory,
                              Mib(g.bytes()));
        break;
      case v1::LayerGroup::kRecurrent:
        absl::StrAppendFormat(
            &out, "  group %d (recurrent): state slots %" PRId64 "/%" PRId64 " used (%.1f%%), %s\n",
            g.group(), g.cells_used(), g.cells_total(), pct, Mib(g.bytes()));
        break;
      default:
        absl::StrAppendFormat(
            &out, "  group %d: cells %" PRId64 "/%" PRId64 " used (%.1f%%), memory %s, %s\n",
            g.group(), g.cells_used(), g.cells_total(), pct, memory, Mib(g.bytes()));
    }
  }
  return out;
}

std::string InfoText(const v1::CacheInfo& info) {
  const v1::CacheSpec& s = info.spec();
  std::string out = absl::StrFormat("cache %s\n", s.name());
  absl::StrAppendFormat(&out, "  dtype %s, max_sequences %d, capacity %d, max_batch %d\n",
                        DTypeText(s.dtype()), s.max_sequences(), s.capacity(), s.max_batch());
  for (int g = 0; g < s.groups_size(); ++g) {
    absl::StrAppendFormat(&out, "  group %d: %s\n", g, GroupText(s.groups(g)));
  }
  absl::StrAppend(&out, "usage\n", UsageText(info.usage(), s));
  return out;
}

std::string UsageLine(const v1::CacheUsage& usage) {
  std::vector<std::string> groups;
  for (const v1::GroupUsage& g : usage.groups()) {
    groups.push_back(absl::StrCat("g", g.group(), " ", g.cells_used(), "/", g.cells_total()));
  }
  std::string line = absl::StrCat("sequences live ", usage.sequences_live(), ", cells ",
                                  absl::StrJoin(groups, ", "), ", held ", Mib(usage.bytes_held()));
  if (usage.snapshots() != 0) {
    absl::StrAppend(&line, ", snapshots ", usage.snapshots(), " (", Mib(usage.snapshot_bytes()),
                    ")");
  }
  return line;
}

std::string SnapshotLine(const v1::SnapshotInfo& snap, const v1::CacheSpec& spec) {
  std::vector<std::string> groups;
  for (const v1::SnapshotGroup& g : snap.groups()) {
    switch (GroupKindOf(spec, g.group())) {
      case v1::LayerGroup::kRecurrent:
        groups.push_back(absl::StrCat("g", g.group(), ": state ", StateText(g.state())));
        break;
      case v1::LayerGroup::kRotating:
        groups.push_back(
            absl::StrCat("g", g.group(), ": window ", g.stored(), ", ring index ", g.ring_index()));
        break;
      default:
        groups.push_back(absl::StrCat("g", g.group(), ": ", g.stored(), " positions"));
    }
  }
  return absl::StrCat("snapshot ", snap.id(), ": seq ", snap.seq(), " [", snap.from_offset(), ", ",
                      snap.to_offset(), "), ", Mib(snap.bytes()), "; ",
                      absl::StrJoin(groups, ", "));
}

std::string TransferLine(const v1::TransferStats& stats) {
  std::string line = absl::StrCat(stats.transport().empty() ? "?" : stats.transport(), ", ");
  if (stats.bytes() < (int64_t{1} << 20)) {
    absl::StrAppend(&line, stats.bytes(), " B");
  } else {
    absl::StrAppend(&line, Mib(stats.bytes()));
  }
  absl::StrAppend(&line, absl::StrFormat(" in %.1f ms", stats.micros() / 1e3));
  if (stats.micros() > 0) {
    // bytes per microsecond = MB/s; / 1e3 = GB/s.
    absl::StrAppend(&line, absl::StrFormat(", %.2f GB/s", stats.bytes() / 1e3 / stats.micros()));
  }
  return line;
}

std::string ShortageLine(const Shortage& shortage) {
  return absl::StrCat(ShortageReason(shortage.resource),
                      shortage.group >= 0 ? absl::StrCat(" in group ", shortage.group) : "",
                      ": needed ", shortage.needed, ", free ", shortage.free, " of ",
                      shortage.total);
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
  using Row = std::array<std::string, 8>;
  std::vector<Row> rows = {
      {"NAME", "ADDRESS", "HEALTH", "BACKEND", "TRANSPORTS", "BOOT", "STARTED", "DETAIL"}};
  for (const v1::Member& m : response.members()) {
    // The boot id's first 8 hex digits tell restarts apart at a glance; --json has it whole.
    const std::string started =
        m.start_time_unix_ms() == 0
            ? ""
            : absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::FromUnixMillis(m.start_time_unix_ms()),
                               absl::UTCTimeZone());
    rows.push_back({absl::StrCat(m.name(), m.self() ? " *" : ""), OrDash(m.address()),
                    MemberHealthText(m.health()), OrDash(m.backend()),
                    OrDash(absl::StrJoin(m.transports(), ",")), OrDash(m.boot_id().substr(0, 8)),
                    OrDash(started), OrDash(m.detail())});
  }
  std::array<size_t, 8> width = {};
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

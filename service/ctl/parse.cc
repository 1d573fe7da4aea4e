#include "service/ctl/parse.h"

#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace kvmesh {
namespace ctl {
namespace {

absl::Status Bad(absl::string_view what, absl::string_view text) {
  return absl::InvalidArgumentError(absl::StrCat(what, ": '", text, "'"));
}

absl::StatusOr<int32_t> ParseInt(absl::string_view key, absl::string_view text) {
  int32_t v;
  if (!absl::SimpleAtoi(text, &v)) return Bad(absl::StrCat(key, " is not an integer"), text);
  return v;
}

absl::StatusOr<float> ParseFloat(absl::string_view key, absl::string_view text) {
  float v;
  if (!absl::SimpleAtof(text, &v)) return Bad(absl::StrCat(key, " is not a number"), text);
  return v;
}

absl::StatusOr<v1::Window> ParseWindow(absl::string_view text) {
  std::vector<absl::string_view> parts = absl::StrSplit(text, ':');
  v1::Window window;
  const std::string kind = absl::AsciiStrToLower(parts[0]);
  if (kind == "full" && parts.size() == 1) {
    window.mutable_full();
  } else if (kind == "sliding" && (parts.size() == 2 || parts.size() == 3)) {
    auto w = ParseInt("sliding window", parts[1]);
    if (!w.ok()) return w.status();
    window.mutable_sliding()->set_window(*w);
    if (parts.size() == 3) {
      auto m = ParseInt("sliding memory", parts[2]);
      if (!m.ok()) return m.status();
      window.mutable_sliding()->set_memory(*m);
    }
  } else if (kind == "chunked" && parts.size() == 2) {
    auto c = ParseInt("chunk", parts[1]);
    if (!c.ok()) return c.status();
    window.mutable_chunked()->set_chunk(*c);
  } else {
    return Bad("window must be full, sliding:WINDOW[:MEMORY] or chunked:CHUNK", text);
  }
  return window;
}

// DIMS left 0 when not written: ParseGroup fills in head_dim_k once all keys are read.
absl::StatusOr<v1::Rope> ParseRope(absl::string_view text) {
  std::vector<absl::string_view> parts = absl::StrSplit(text, ':');
  v1::Rope rope;
  const std::string type = absl::AsciiStrToLower(parts[0]);
  rope.set_base(10000.0f);
  rope.set_freq_scale(1.0f);
  if (type == "none" && parts.size() == 1) return v1::Rope();
  if (type == "normal") {
    rope.set_type(v1::ROPE_TYPE_NORMAL);
  } else if (type == "neox") {
    rope.set_type(v1::ROPE_TYPE_NEOX);
  } else {
    return Bad("rope must be none or normal|neox[:DIMS[:BASE[:FREQ_SCALE]]]", text);
  }
  if (parts.size() > 4) return Bad("rope has too many parts", text);
  if (parts.size() > 1) {
    auto dims = ParseInt("rope dims", parts[1]);
    if (!dims.ok()) return dims.status();
    rope.set_dims(*dims);
  }
  if (parts.size() > 2) {
    auto base = ParseFloat("rope base", parts[2]);
    if (!base.ok()) return base.status();
    rope.set_base(*base);
  }
  if (parts.size() > 3) {
    auto scale = ParseFloat("rope freq_scale", parts[3]);
    if (!scale.ok()) return scale.status();
    rope.set_freq_scale(*scale);
  }
  return rope;
}

}  // namespace

absl::StatusOr<v1::DType> ParseDType(absl::string_view text) {
  std::string t = absl::AsciiStrToLower(text);
  absl::string_view v = t;
  absl::ConsumePrefix(&v, "dtype_");
  if (v == "f32" || v == "float32") return v1::DTYPE_F32;
  if (v == "f16" || v == "float16") return v1::DTYPE_F16;
  if (v == "bf16" || v == "bfloat16") return v1::DTYPE_BF16;
  return Bad("dtype must be f32, f16 or bf16", text);
}

absl::StatusOr<v1::LayerGroup> ParseGroup(absl::string_view text) {
  const size_t colon = text.find(':');
  const std::string kind =
      absl::AsciiStrToLower(text.substr(0, colon == absl::string_view::npos ? text.size() : colon));
  if (colon == absl::string_view::npos ||
      (kind != "attention" && kind != "rotating" && kind != "recurrent")) {
    return Bad("group must start with 'attention:', 'rotating:' or 'recurrent:'", text);
  }
  const absl::string_view rest = text.substr(colon + 1);
  // Keys of each kind, for the unknown-key message.
  const absl::string_view keys =
      kind == "attention"  ? "layers, heads, head_dim, head_dim_k, head_dim_v, window, rope"
      : kind == "rotating" ? "layers, heads, head_dim, head_dim_k, head_dim_v, max_size, rope"
                           : "layers, conv_tail, conv_dim, v_heads, head_v_dim, head_k_dim";
  v1::LayerGroup group;
  // The fields shared by Attention and Rotating groups land in `att` and are moved into a
  // Rotating message at the end, so both kinds parse their common keys the same way.
  v1::Attention att;
  v1::Rotating rot;
  v1::Recurrent rec;
  std::vector<std::string> seen;
  for (absl::string_view item : absl::StrSplit(rest, ',', absl::SkipEmpty())) {
    if (item.find('=') == absl::string_view::npos) {
      return Bad(absl::StrCat(kind, " group item '", item, "' is not KEY=VALUE (keys: ", keys, ")"),
                 text);
    }
    std::pair<absl::string_view, absl::string_view> kv =
        absl::StrSplit(item, absl::MaxSplits('=', 1));
    const absl::string_view key = kv.first;
    const absl::string_view value = kv.second;
    seen.emplace_back(key);
    const bool kv_kind = kind != "recurrent";
    if (key == "layers") {
      auto v = ParseInt(key, value);
      if (!v.ok()) return v.status();
      group.set_num_layers(*v);
    } else if (kv_kind && (key == "heads" || key == "kv_heads")) {
      auto v = ParseInt(key, value);
      if (!v.ok()) return v.status();
      att.set_num_kv_heads(*v);
    } else if (kv_kind && key == "head_dim") {
      auto v = ParseInt(key, value);
      if (!v.ok()) return v.status();
      att.set_head_dim_k(*v);
      att.set_head_dim_v(*v);
    } else if (kv_kind && key == "head_dim_k") {
      auto v = ParseInt(key, value);
      if (!v.ok()) return v.status();
      att.set_head_dim_k(*v);
    } else if (kv_kind && key == "head_dim_v") {
      auto v = ParseInt(key, value);
      if (!v.ok()) return v.status();
      att.set_head_dim_v(*v);
    } else if (kind == "attention" && key == "window") {
      auto w = ParseWindow(value);
      if (!w.ok()) return w.status();
      *att.mutable_window() = *w;
    } else if (kv_kind && key == "rope") {
      auto r = ParseRope(value);
      if (!r.ok()) return r.status();
      if (r->type() == v1::ROPE_TYPE_NONE) {
        att.clear_rope();
      } else {
        *att.mutable_rope() = *r;
      }
    } else if (kind == "rotating" && key == "max_size") {
      auto v = ParseInt(key, value);
      if (!v.ok()) return v.status();
      rot.set_max_size(*v);
    } else if (kind == "recurrent" && key == "conv_tail") {
      auto v = ParseInt(key, value);
      if (!v.ok()) return v.status();
      rec.set_conv_tail(*v);
    } else if (kind == "recurrent" && key == "conv_dim") {
      auto v = ParseInt(key, value);
      if (!v.ok()) return v.status();
      rec.set_conv_dim(*v);
    } else if (kind == "recurrent" && (key == "v_heads" || key == "num_v_heads")) {
      auto v = ParseInt(key, value);
      if (!v.ok()) return v.status();
      rec.set_num_v_heads(*v);
    } else if (kind == "recurrent" && key == "head_v_dim") {
      auto v = ParseInt(key, value);
      if (!v.ok()) return v.status();
      rec.set_head_v_dim(*v);
    } else if (kind == "recurrent" && key == "head_k_dim") {
      auto v = ParseInt(key, value);
      if (!v.ok()) return v.status();
      rec.set_head_k_dim(*v);
    } else {
      return Bad(absl::StrCat("unknown ", kind, " group key '", key, "' (", keys, ")"), text);
    }
  }
  auto has = [&seen](std::initializer_list<absl::string_view> names) {
    for (const std::string& s : seen) {
      for (absl::string_view n : names) {
        if (s == n) return true;
      }
    }
    return false;
  };
  if (att.has_rope() && att.rope().dims() == 0) att.mutable_rope()->set_dims(att.head_dim_k());
  if (kind == "attention") {
    if (!att.has_window()) att.mutable_window()->mutable_full();
    *group.mutable_attention() = std::move(att);
    return group;
  }
  if (kind == "rotating") {
    if (!has({"max_size"})) return Bad("rotating group needs max_size=TOKENS", text);
    rot.set_num_kv_heads(att.num_kv_heads());
    rot.set_head_dim_k(att.head_dim_k());
    rot.set_head_dim_v(att.head_dim_v());
    if (att.has_rope()) *rot.mutable_rope() = att.rope();
    *group.mutable_rotating() = std::move(rot);
    return group;
  }
  if (!has({"conv_tail"}) || !has({"conv_dim"})) {
    return Bad("recurrent group needs conv_tail=T and conv_dim=C", text);
  }
  if (rec.num_v_heads() == 0 && (rec.head_v_dim() != 0 || rec.head_k_dim() != 0)) {
    return Bad("recurrent head_v_dim and head_k_dim need v_heads > 0", text);
  }
  if (rec.num_v_heads() != 0 && (!has({"head_v_dim"}) || !has({"head_k_dim"}))) {
    return Bad(
        absl::StrCat("recurrent v_heads=", rec.num_v_heads(), " needs head_v_dim and head_k_dim"),
        text);
  }
  *group.mutable_recurrent() = std::move(rec);
  return group;
}

absl::StatusOr<std::vector<int32_t>> ParsePositions(absl::string_view text) {
  std::vector<int32_t> out;
  // Checked before a range is expanded: "0:2000000000" would otherwise take 8 GB here.
  auto too_many = [&out](absl::string_view item, int64_t more) {
    return static_cast<int64_t>(out.size()) + more > kMaxPositions
               ? Bad(absl::StrCat("position list has more than ", kMaxPositions,
                                  " positions (no Append takes more)"),
                     item)
               : absl::OkStatus();
  };
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    std::vector<absl::string_view> range = absl::StrSplit(item, ':');
    if (range.size() == 1) {
      auto p = ParseInt("position", range[0]);
      if (!p.ok()) return p.status();
      if (absl::Status s = too_many(item, 1); !s.ok()) return s;
      out.push_back(*p);
    } else if (range.size() == 2) {
      auto b = ParseInt("range begin", range[0]);
      if (!b.ok()) return b.status();
      auto e = ParseInt("range end", range[1]);
      if (!e.ok()) return e.status();
      if (*b < 0 || *b >= *e) return Bad("range must be BEGIN:END with 0 <= BEGIN < END", item);
      if (absl::Status s = too_many(item, int64_t{*e} - *b); !s.ok()) return s;
      for (int32_t p = *b; p < *e; ++p) out.push_back(p);
    } else {
      return Bad("position list items are P or BEGIN:END", item);
    }
  }
  if (out.empty()) return Bad("empty position list", text);
  return out;
}

namespace {

void AppendRange(int32_t first, int32_t last, std::string* out) {
  if (!out->empty()) *out += ',';
  if (first == last) {
    absl::StrAppend(out, first);
  } else {
    absl::StrAppend(out, first, "-", last);
  }
}

}  // namespace

std::string FormatPositions(const std::vector<int32_t>& positions) {
  if (positions.empty()) return "-";
  std::string out;
  size_t i = 0;
  while (i < positions.size()) {
    size_t j = i;
    while (j + 1 < positions.size() && positions[j + 1] == positions[j] + 1) ++j;
    AppendRange(positions[i], positions[j], &out);
    i = j + 1;
  }
  return out;
}

std::string FormatRanges(const google::protobuf::RepeatedPtrField<v1::PositionRange>& ranges) {
  if (ranges.empty()) return "-";
  std::string out;
  for (const v1::PositionRange& range : ranges) AppendRange(range.first(), range.last(), &out);
  return out;
}

}  // namespace ctl
}  // namespace kvmesh

#include "service/common/flags.h"

#include <algorithm>
#include <limits>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvmesh {
namespace {

struct Suffix {
  absl::string_view name;
  int shift;
};

// Longest first, so that "KiB" is not taken for "B".
constexpr Suffix kSuffixes[] = {{"TiB", 40}, {"GiB", 30}, {"MiB", 20}, {"KiB", 10}, {"B", 0}};

}  // namespace

absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text) {
  absl::string_view digits = text;
  int shift = 0;
  for (const Suffix& suffix : kSuffixes) {
    if (absl::EndsWith(digits, suffix.name)) {
      digits.remove_suffix(suffix.name.size());
      shift = suffix.shift;
      break;
    }
  }
  uint64_t value = 0;
  if (digits.empty() || digits.find_first_not_of("0123456789") != absl::string_view::npos ||
      !absl::SimpleAtoi(digits, &value)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", text, "' is not a byte size: write digits with an optional B, KiB, MiB, GiB or TiB"));
  }
  if (shift > 0 && value > (std::numeric_limits<uint64_t>::max() >> shift)) {
    return absl::InvalidArgumentError(absl::StrCat("'", text, "' is more than 2^64 - 1 bytes"));
  }
  return value << shift;
}

std::string FormatByteSize(uint64_t bytes) {
  for (const Suffix& suffix : kSuffixes) {
    if (suffix.shift == 0) break;
    const uint64_t unit = uint64_t{1} << suffix.shift;
    if (bytes != 0 && bytes % unit == 0) return absl::StrCat(bytes / unit, suffix.name);
  }
  return absl::StrCat(bytes);
}

bool AbslParseFlag(absl::string_view text, ByteSize* out, std::string* error) {
  absl::StatusOr<uint64_t> bytes = ParseByteSize(text);
  if (!bytes.ok()) {
    *error = std::string(bytes.status().message());
    return false;
  }
  out->bytes = *bytes;
  return true;
}

std::string AbslUnparseFlag(ByteSize size) { return FormatByteSize(size.bytes); }

std::vector<char*> NormalizeFlagNames(int argc, char** argv, std::vector<std::string>* storage) {
  storage->assign(argv, argv + argc);
  bool flags_done = false;
  for (int i = 1; i < argc; ++i) {
    std::string& arg = (*storage)[i];
    if (flags_done || arg.size() < 3 || arg[0] != '-' || arg[1] != '-') {
      flags_done = flags_done || arg == "--";
      continue;
    }
    const size_t name_end = std::min(arg.find('='), arg.size());
    for (size_t c = 2; c < name_end; ++c) {
      if (arg[c] == '-') arg[c] = '_';
    }
  }
  std::vector<char*> out;
  out.reserve(argc + 1);
  for (std::string& arg : *storage) out.push_back(arg.data());
  out.push_back(nullptr);
  return out;
}

}  // namespace kvmesh

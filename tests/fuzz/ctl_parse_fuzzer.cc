// Fuzz target: the parsers of what people type. The first byte of an input picks the parser
// (Parser below, modulo their number); the rest is the text:
//   kvmeshctl  ParseGroup (--group shorthands), ParsePositions (--positions, --pos),
//              ParseDType, ParseRemoveScope, the command line (Args: argv split at NUL bytes,
//              then every typed getter: integers, numbers, booleans, durations, byte sizes)
//   the node   ParseByteSize (--memory-budget and the other sizes), Membership::ParsePeers
//              (--peers), TokenTable::Parse (the --token-file's text)
// Invariants: no crash, no sanitizer report, no unbounded allocation; every refusal is
// INVALID_ARGUMENT with a message; and what parses survives a round trip: a group's shorthand as
// kvmeshctl prints it (GroupText) parses to the same group, a position list written out parses
// to the same list, a byte size printed by FormatByteSize parses to the same size, a dtype or
// scope by its printed name to itself, a peer list written out to the same peers. A parsed
// group whose spec the server accepts also gets a pattern payload (payload.h) that its own
// checker verifies without a mismatch.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "cache/spec.h"
#include "service/auth.h"
#include "service/cluster/membership.h"
#include "service/common/convert.h"
#include "service/common/flags.h"
#include "service/ctl/args.h"
#include "service/ctl/format.h"
#include "service/ctl/parse.h"
#include "service/ctl/payload.h"
#include "tests/fuzz/fuzz_support.h"

namespace kvmesh {
namespace fuzz {
namespace {

enum class Parser : uint8_t {
  kGroup,
  kPositions,
  kDType,
  kRemoveScope,
  kByteSize,
  kArgs,
  kPeers,
  kTokenFile,
};
constexpr int kParserCount = static_cast<int>(Parser::kTokenFile) + 1;

// Round trips are checked on results up to this size (a range can expand to millions).
constexpr size_t kRoundTripLimit = 4096;

void CheckRefused(const absl::Status& status, absl::string_view parser, absl::string_view text) {
  KVMESH_FUZZ_CHECK(status.code() == absl::StatusCode::kInvalidArgument,
                    absl::StrCat(parser, "('", text.substr(0, 200), "'): ", status.ToString()));
  KVMESH_FUZZ_CHECK(!status.message().empty(), parser);
}

// A spec with `group` as its only group, for the server's validation and the payload code.
v1::CacheSpec SpecWith(const v1::LayerGroup& group) {
  v1::CacheSpec spec;
  spec.set_name("fuzz");
  spec.set_dtype(v1::DTYPE_BF16);
  spec.set_max_sequences(2);
  spec.set_capacity(8);
  spec.set_max_batch(4);
  *spec.add_groups() = group;
  return spec;
}

void Group(absl::string_view text) {
  absl::StatusOr<v1::LayerGroup> group = ctl::ParseGroup(text);
  if (!group.ok()) return CheckRefused(group.status(), "ParseGroup", text);
  // kvmeshctl prints a group as the shorthand that makes it (get, list): that text parses to
  // the same group. Floats print with six digits, so the comparison is of the printed forms,
  // which also hold every integer field.
  const std::string printed = ctl::GroupText(*group);
  absl::StatusOr<v1::LayerGroup> again = ctl::ParseGroup(printed);
  KVMESH_FUZZ_CHECK(again.ok(),
                    absl::StrCat("'", text, "' prints as '", printed,
                                 "', which does not parse: ", again.status().ToString()));
  KVMESH_FUZZ_CHECK(again->kind_case() == group->kind_case() &&
                        again->num_layers() == group->num_layers() &&
                        ctl::GroupText(*again) == printed,
                    absl::StrCat("'", text, "' prints as '", printed, "', which parses to '",
                                 ctl::GroupText(*again), "'"));
  // What the server does with it.
  absl::StatusOr<CacheSpec> spec = SpecFromProto(SpecWith(*group));
  if (!spec.ok()) return CheckRefused(spec.status(), "SpecFromProto", printed);
  if (CacheBytes(*spec) > (size_t{1} << 20)) return;  // the payload code on small specs only
  // Pattern payloads verify against their own checker: positions 0..3 of one sequence.
  const std::vector<int32_t> positions = {0, 1, 2, 3};
  const std::string payload = ctl::MakePatternPayload(*spec, positions, 7);
  KVMESH_FUZZ_CHECK(payload.size() == AppendPayloadBytes(*spec, 4, 1),
                    absl::StrCat(payload.size(), " payload bytes for '", printed, "'"));
  std::vector<std::vector<int32_t>> read_positions;
  std::vector<std::optional<int32_t>> states;
  for (const GroupSpec& g : spec->groups) {
    if (g.kind == GroupKind::kRecurrent) {
      read_positions.emplace_back();
      states.emplace_back(4);
    } else {
      read_positions.push_back(positions);
      states.emplace_back(std::nullopt);
    }
  }
  // A Read payload is laid out as an Append payload of one sequence (docs/api.md#payload-layout).
  const ctl::PatternCheck check = ctl::CheckPatternPayload(
      *spec, read_positions, states,
      absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(payload.data()), payload.size()), 7);
  KVMESH_FUZZ_CHECK(
      check.mismatches == 0 && check.elements > 0,
      absl::StrCat("'", printed, "': ", check.mismatches, " of ", check.elements,
                   " elements differ from their own pattern, first ", check.first_mismatch));
}

void Positions(absl::string_view text) {
  absl::StatusOr<std::vector<int32_t>> positions = ctl::ParsePositions(text);
  if (!positions.ok()) return CheckRefused(positions.status(), "ParsePositions", text);
  KVMESH_FUZZ_CHECK(!positions->empty(), text);
  KVMESH_FUZZ_CHECK(positions->size() <= static_cast<size_t>(ctl::kMaxPositions),
                    absl::StrCat("'", text.substr(0, 100), "' gave ", positions->size(),
                                 " positions, more than any Append takes"));
  if (positions->size() > kRoundTripLimit) return;
  const std::string written = absl::StrJoin(*positions, ",");
  absl::StatusOr<std::vector<int32_t>> again = ctl::ParsePositions(written);
  KVMESH_FUZZ_CHECK(again.ok() && *again == *positions,
                    absl::StrCat("'", text, "' written as '", written, "' parses differently"));
  std::vector<int32_t> sorted = *positions;
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  KVMESH_FUZZ_CHECK(!ctl::FormatPositions(sorted).empty(), written);
}

void DType(absl::string_view text) {
  absl::StatusOr<v1::DType> dtype = ctl::ParseDType(text);
  if (!dtype.ok()) return CheckRefused(dtype.status(), "ParseDType", text);
  absl::StatusOr<v1::DType> again = ctl::ParseDType(ctl::DTypeText(*dtype));
  KVMESH_FUZZ_CHECK(again.ok() && *again == *dtype, text);
}

void RemoveScope(absl::string_view text) {
  absl::StatusOr<v1::RemoveScope> scope = ctl::ParseRemoveScope(text);
  if (!scope.ok()) return CheckRefused(scope.status(), "ParseRemoveScope", text);
  absl::StatusOr<v1::RemoveScope> again = ctl::ParseRemoveScope(v1::RemoveScope_Name(*scope));
  KVMESH_FUZZ_CHECK(again.ok() && *again == *scope, text);
}

void ByteSize(absl::string_view text) {
  absl::StatusOr<uint64_t> bytes = ParseByteSize(text);
  if (!bytes.ok()) return CheckRefused(bytes.status(), "ParseByteSize", text);
  const std::string printed = FormatByteSize(*bytes);
  absl::StatusOr<uint64_t> again = ParseByteSize(printed);
  KVMESH_FUZZ_CHECK(again.ok() && *again == *bytes,
                    absl::StrCat("'", text, "' = ", *bytes, " prints as '", printed, "'"));
}

void CommandLine(absl::string_view text) {
  std::vector<std::string> words = absl::StrSplit(text, '\0');
  std::vector<const char*> argv = {"kvmeshctl"};
  for (const std::string& w : words) argv.push_back(w.c_str());
  static constexpr absl::string_view kBool[] = {"json", "help", "stream", "speculative"};
  absl::StatusOr<ctl::Args> args =
      ctl::Args::Parse(static_cast<int>(argv.size()), argv.data(), kBool);
  if (!args.ok()) return CheckRefused(args.status(), "Args::Parse", text);
  // Every getter on every flag given, and on some that are not.
  std::vector<std::string> names = {"cache", "seq", "timeout", "chunk-bytes", "json", "missing"};
  for (size_t i = 0; i + 1 < argv.size(); ++i) {
    absl::string_view a = argv[i + 1];
    if (absl::ConsumePrefix(&a, "--")) names.emplace_back(a.substr(0, a.find('=')));
  }
  for (const std::string& name : names) {
    if (auto v = args->GetString(name); !v.ok()) CheckRefused(v.status(), "GetString", name);
    if (auto v = args->GetInt(name, 0); !v.ok()) CheckRefused(v.status(), "GetInt", name);
    if (auto v = args->GetDouble(name, 0); !v.ok()) CheckRefused(v.status(), "GetDouble", name);
    if (auto v = args->GetBool(name); !v.ok()) CheckRefused(v.status(), "GetBool", name);
    absl::StatusOr<absl::Duration> d = args->GetDuration(name, absl::Seconds(1));
    if (!d.ok()) {
      CheckRefused(d.status(), "GetDuration", name);
    } else {
      KVMESH_FUZZ_CHECK(*d > absl::ZeroDuration(),
                        absl::StrCat("--", name, " gave ", absl::FormatDuration(*d)));
    }
    absl::StatusOr<int64_t> b = args->GetBytes(name, 0);
    if (!b.ok()) {
      CheckRefused(b.status(), "GetBytes", name);
    } else {
      KVMESH_FUZZ_CHECK(*b >= 0, *b);
    }
    (void)args->GetAll(name);
  }
  static constexpr absl::string_view kAllowed[] = {"cache", "seq", "timeout", "json"};
  if (absl::Status s = args->CheckAllowed(kAllowed); !s.ok()) CheckRefused(s, "CheckAllowed", text);
}

void Peers(absl::string_view text) {
  absl::StatusOr<std::vector<MemberAddress>> peers = Membership::ParsePeers(text);
  if (!peers.ok()) return CheckRefused(peers.status(), "ParsePeers", text);
  std::vector<std::string> items;
  for (const MemberAddress& m : *peers) {
    KVMESH_FUZZ_CHECK(!m.name.empty() && !m.address.empty(), text);
    items.push_back(absl::StrCat(m.name, "=", m.address));
  }
  const std::string written = absl::StrJoin(items, ",");
  absl::StatusOr<std::vector<MemberAddress>> again = Membership::ParsePeers(written);
  KVMESH_FUZZ_CHECK(again.ok() && *again == *peers,
                    absl::StrCat("'", text, "' written as '", written, "' parses differently"));
}

void TokenFile(absl::string_view text) {
  absl::StatusOr<TokenTable> table = TokenTable::Parse(text);
  if (!table.ok()) return CheckRefused(table.status(), "TokenTable::Parse", text);
  // A token nobody listed is nobody's.
  KVMESH_FUZZ_CHECK(table->Find("not a listed token") == nullptr, text);
}

void Run(const uint8_t* data, size_t size) {
  if (size == 0) return;
  const Parser parser = static_cast<Parser>(data[0] % kParserCount);
  const absl::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  switch (parser) {
    case Parser::kGroup:
      return Group(text);
    case Parser::kPositions:
      return Positions(text);
    case Parser::kDType:
      return DType(text);
    case Parser::kRemoveScope:
      return RemoveScope(text);
    case Parser::kByteSize:
      return ByteSize(text);
    case Parser::kArgs:
      return CommandLine(text);
    case Parser::kPeers:
      return Peers(text);
    case Parser::kTokenFile:
      return TokenFile(text);
  }
}

}  // namespace
}  // namespace fuzz
}  // namespace kvmesh

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvmesh::fuzz::Run(data, size);
  return 0;
}

// kvmeshctl's commands that move payloads in and out of a sequence: append (pattern payloads or
// a file, unary or streamed, in batches) and read (to a file, or checked against a pattern).
#include <algorithm>
#include <cinttypes>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "cache/spec.h"
#include "cache/status_macros.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/grpcpp.h"
#include "kvmesh/v1/kvmesh.pb.h"
#include "service/common/bulk_client.h"
#include "service/common/convert.h"
#include "service/ctl/args.h"
#include "service/ctl/client.h"
#include "service/ctl/commands.h"
#include "service/ctl/format.h"
#include "service/ctl/parse.h"
#include "service/ctl/payload.h"

namespace kvmesh {
namespace ctl {
namespace {

constexpr int64_t kDefaultChunkBytes = int64_t{1} << 20;

// One Append of `positions` of `seq`: unary, or AppendStream in chunks of `chunk_bytes`.
absl::StatusOr<v1::AppendResponse> SendAppend(const Client& client, const std::string& cache,
                                              int64_t seq, absl::Span<const int32_t> positions,
                                              absl::Span<const int32_t> token_ids,
                                              std::string payload, bool stream, int64_t chunk_bytes,
                                              bool speculative) {
  v1::AppendResponse response;
  if (!stream) {
    v1::AppendRequest request;
    request.set_cache(cache);
    AddTokenRanges(seq, positions, request.mutable_token_ranges(), token_ids);
    *request.mutable_payload() = std::move(payload);
    request.set_speculative(speculative);
    RETURN_IF_ERROR(client.Call(&v1::CacheService::Stub::Append, request, &response));
    return response;
  }
  v1::AppendHeader header;
  header.set_cache(cache);
  AddTokenRanges(seq, positions, header.mutable_token_ranges(), token_ids);
  header.set_payload_bytes(static_cast<int64_t>(payload.size()));
  header.set_speculative(speculative);
  auto context = client.Context();
  RETURN_IF_ERROR(SendAppendStream(client.channel(), context.get(), header,
                                   std::make_shared<const std::string>(std::move(payload)),
                                   static_cast<size_t>(chunk_bytes), &response));
  return response;
}

absl::Status Append(const Client& client, const Args& args) {
  ASSIGN_OR_RETURN(std::string cache, GetCacheName(args));
  ASSIGN_OR_RETURN(int64_t seq, args.GetInt("seq"));
  ASSIGN_OR_RETURN(std::vector<int32_t> positions, GetPositions(args, "positions"));
  std::vector<int32_t> token_ids;
  if (args.Has("token-ids")) {
    ASSIGN_OR_RETURN(token_ids, GetPositions(args, "token-ids"));
    if (token_ids.size() != positions.size()) {
      return absl::InvalidArgumentError(absl::StrCat("--token-ids names ", token_ids.size(),
                                                     " ids for ", positions.size(),
                                                     " positions; give one per position"));
    }
  }
  ASSIGN_OR_RETURN(bool stream, args.GetBool("stream"));
  ASSIGN_OR_RETURN(bool speculative, args.GetBool("speculative"));
  ASSIGN_OR_RETURN(int64_t chunk_bytes, args.GetBytes("chunk-bytes", kDefaultChunkBytes));
  if (chunk_bytes <= 0) return absl::InvalidArgumentError("--chunk-bytes must be > 0");
  if (args.Has("seed") && args.Has("payload-file")) {
    return absl::InvalidArgumentError("give --seed or --payload-file, not both");
  }
  ASSIGN_OR_RETURN(int64_t seed, args.GetInt("seed", 0));
  ASSIGN_OR_RETURN(CacheSpec spec, client.FetchSpec(cache));
  ASSIGN_OR_RETURN(int64_t batch, args.GetInt("batch", spec.max_batch));
  if (batch <= 0)
    return absl::InvalidArgumentError(absl::StrCat("--batch=", batch, " must be > 0"));

  std::optional<std::string> file_payload;
  if (auto path = args.Get("payload-file")) {
    ASSIGN_OR_RETURN(file_payload, ReadFile(*path));
    const size_t want =
        AppendPayloadBytes(spec, static_cast<int64_t>(positions.size()), 1, speculative);
    if (file_payload->size() != want) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--payload-file '", *path, "' has ", file_payload->size(), " bytes; ", positions.size(),
          speculative ? " speculative" : "", " tokens of cache ", cache, " need ", want));
    }
    if (!speculative && HasRecurrentGroup(spec) && static_cast<int64_t>(positions.size()) > batch) {
      return absl::InvalidArgumentError(
          absl::StrCat("--payload-file holds one recurrent state (after all ", positions.size(),
                       " tokens), so it cannot be split into Appends of --batch=", batch,
                       " tokens; raise --batch or use --seed"));
    }
  }

  const int64_t n = static_cast<int64_t>(positions.size());
  for (int64_t begin = 0; begin < n; begin += batch) {
    const int64_t end = std::min(n, begin + batch);
    absl::Span<const int32_t> slice = absl::MakeConstSpan(positions).subspan(begin, end - begin);
    std::string payload =
        file_payload ? SliceTokens(spec,
                                   absl::MakeConstSpan(
                                       reinterpret_cast<const uint8_t*>(file_payload->data()),
                                       file_payload->size()),
                                   n, begin, end, speculative)
                     : MakePatternPayload(spec, slice, static_cast<uint64_t>(seed), speculative);
    const int64_t bytes = static_cast<int64_t>(payload.size());
    const absl::Time start = absl::Now();
    const absl::Span<const int32_t> ids =
        token_ids.empty() ? absl::Span<const int32_t>()
                          : absl::MakeConstSpan(token_ids).subspan(begin, end - begin);
    ASSIGN_OR_RETURN(v1::AppendResponse response,
                     SendAppend(client, cache, seq, slice, ids, std::move(payload), stream,
                                chunk_bytes, speculative));
    const absl::Duration elapsed = absl::Now() - start;
    if (client.json()) {
      RETURN_IF_ERROR(PrintJson(response));
      continue;
    }
    std::printf("appended seq %" PRId64 " positions %s (%zu tokens%s, %s%s) in %s, %s\n", seq,
                FormatPositions(std::vector<int32_t>(slice.begin(), slice.end())).c_str(),
                slice.size(), speculative ? ", speculative: pending" : "", Mib(bytes).c_str(),
                stream ? ", stream" : "", Ms(elapsed).c_str(), Rate(bytes, elapsed).c_str());
    if (end == n) std::printf("  %s\n", UsageLine(response.usage()).c_str());
  }
  return absl::OkStatus();
}

// What a Read stream delivered.
struct ReadReply {
  v1::ReadHeader header;
  int64_t received = 0;            // payload bytes
  uint64_t fnv = kFnvOffsetBasis;  // FNV-1a 64 of the payload
  std::string payload;             // empty unless kept
  absl::Duration elapsed;          // from the call's start to its end
};

// Runs the Read stream of `request`, keeping the payload when `keep`. ReceiveReadStream's
// errors: the RPC's status when it fails; DATA_LOSS for a stream without exactly one header,
// leading, or with other than the payload bytes its header announced.
absl::StatusOr<ReadReply> ReceiveRead(const Client& client, const v1::ReadRequest& request,
                                      bool keep) {
  ReadReply reply;
  const absl::Time start = absl::Now();
  auto context = client.Context();
  bool reserved = false;
  RETURN_IF_ERROR(ReceiveReadStream(
      client.channel(), context.get(), request, &reply.header,
      [&](absl::Span<const uint8_t> piece) {
        if (keep && !reserved) {
          reply.payload.reserve(static_cast<size_t>(reply.header.payload_bytes()));
          reserved = true;
        }
        reply.fnv = Fnv1a64(piece, reply.fnv);
        reply.received += static_cast<int64_t>(piece.size());
        if (keep) {
          reply.payload.append(reinterpret_cast<const char*>(piece.data()), piece.size());
        }
      }));
  reply.elapsed = absl::Now() - start;
  return reply;
}

// Compares the payload `reply` kept with the pattern of `seed` for the positions its header
// lists; a Recurrent state with the seed's state at the sequence's offset (fetched once some
// group returned a state). DATA_LOSS when the header names a group `spec` does not have.
absl::StatusOr<PatternCheck> VerifyRead(const Client& client, const v1::ReadRequest& request,
                                        const CacheSpec& spec, const ReadReply& reply,
                                        uint64_t seed) {
  std::vector<std::vector<int32_t>> positions(spec.groups.size());
  std::vector<std::optional<int32_t>> state_offsets(spec.groups.size());
  std::optional<int32_t> offset;  // the sequence's, fetched once a group returned a state
  for (const v1::GroupPositions& g : reply.header.groups()) {
    if (g.group() < 0 || g.group() >= static_cast<int>(positions.size())) {
      return absl::DataLossError(absl::StrCat("read header names group ", g.group(),
                                              " of a cache with ", positions.size()));
    }
    positions[g.group()].assign(g.positions().begin(), g.positions().end());
    if (g.state() == v1::STATE_STATUS_VALID) {
      if (!offset) {
        ASSIGN_OR_RETURN(offset, client.FetchOffset(request.cache(), request.seq()));
      }
      state_offsets[g.group()] = *offset;
    }
  }
  return CheckPatternPayload(
      spec, positions, state_offsets,
      absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(reply.payload.data()),
                          reply.payload.size()),
      seed);
}

// `read --json`: one object with the header, the payload's size and checksum and, after
// --verify-seed, the check.
absl::Status PrintReadJson(const ReadReply& reply, const std::optional<PatternCheck>& check,
                           std::optional<uint64_t> verify_seed) {
  google::protobuf::util::JsonPrintOptions options;
  options.always_print_primitive_fields = true;
  std::string header_json;
  if (!google::protobuf::util::MessageToJsonString(reply.header, &header_json, options).ok()) {
    return absl::InternalError("cannot print the read header as JSON");
  }
  std::string line =
      absl::StrCat("{\"header\":", header_json, ",\"payloadBytes\":\"", reply.received,
                   "\",\"fnv1a64\":\"", absl::StrFormat("%016x", reply.fnv), "\"");
  if (check) {
    absl::StrAppend(&line, ",\"verify\":{\"seed\":\"", *verify_seed,
                    "\",\"match\":", check->mismatches == 0 ? "true" : "false", ",\"elements\":\"",
                    check->elements, "\",\"mismatches\":\"", check->mismatches, "\"}");
  }
  std::printf("%s}\n", line.c_str());
  return absl::OkStatus();
}

// `read`'s text: the range, what each group returned, the payload and, after --out and
// --verify-seed, the file written and the check.
void PrintReadText(const v1::ReadRequest& request, const v1::CacheSpec& spec,
                   const ReadReply& reply, const std::optional<std::string>& out_path,
                   const std::optional<PatternCheck>& check, std::optional<uint64_t> verify_seed) {
  std::printf("read seq %" PRId64 " [%d, %s) of %s\n", request.seq(), request.begin(),
              request.has_end() ? absl::StrCat(request.end()).c_str() : "end",
              request.cache().c_str());
  for (const v1::GroupPositions& g : reply.header.groups()) {
    switch (GroupKindOf(spec, g.group())) {
      case v1::LayerGroup::kRecurrent:
        std::printf("  group %d (recurrent): state %s%s\n", g.group(), StateText(g.state()).c_str(),
                    g.state() == v1::STATE_STATUS_VALID     ? " (in the payload)"
                    : g.state() == v1::STATE_STATUS_INVALID ? " (invalidated; not served)"
                                                            : " (range ends before the offset)");
        break;
      case v1::LayerGroup::kRotating:
        std::printf(
            "  group %d (rotating): %d positions %s\n", g.group(), g.positions_size(),
            FormatPositions(std::vector<int32_t>(g.positions().begin(), g.positions().end()))
                .c_str());
        break;
      default:
        std::printf(
            "  group %d: %d positions %s\n", g.group(), g.positions_size(),
            FormatPositions(std::vector<int32_t>(g.positions().begin(), g.positions().end()))
                .c_str());
    }
  }
  std::printf("  payload %" PRId64 " bytes (%s) in %s, %s, fnv1a64 %016" PRIx64 "\n",
              reply.received, Mib(reply.received).c_str(), Ms(reply.elapsed).c_str(),
              Rate(reply.received, reply.elapsed).c_str(), reply.fnv);
  if (out_path) std::printf("  wrote %s\n", out_path->c_str());
  if (check) {
    if (check->mismatches == 0) {
      std::printf("  verify seed %" PRIu64 ": match (%zu elements)\n", *verify_seed,
                  check->elements);
    } else {
      std::printf("  verify seed %" PRIu64 ": MISMATCH in %zu of %zu elements, first at %s\n",
                  *verify_seed, check->mismatches, check->elements, check->first_mismatch.c_str());
    }
  }
}

absl::Status Read(const Client& client, const Args& args) {
  v1::ReadRequest request;
  ASSIGN_OR_RETURN(*request.mutable_cache(), GetCacheName(args));
  ASSIGN_OR_RETURN(int64_t seq, args.GetInt("seq"));
  request.set_seq(seq);
  ASSIGN_OR_RETURN(int32_t begin, GetInt32(args, "begin", 0));
  request.set_begin(begin);
  if (args.Has("end")) {
    ASSIGN_OR_RETURN(int32_t end, GetInt32(args, "end"));
    request.set_end(end);
  }
  ASSIGN_OR_RETURN(int64_t max_chunk, args.GetBytes("max-chunk-bytes", 0));
  if (max_chunk < 0 || max_chunk > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-chunk-bytes=", max_chunk, " must be in [0, 2GiB)"));
  }
  request.set_max_chunk_bytes(static_cast<int32_t>(max_chunk));
  std::optional<std::string> out_path = args.Get("out");
  std::optional<uint64_t> verify_seed;
  if (args.Has("verify-seed")) {
    ASSIGN_OR_RETURN(int64_t s, args.GetInt("verify-seed"));
    verify_seed = static_cast<uint64_t>(s);
  }
  // The spec: group kinds for the text output, payload arithmetic for --verify-seed.
  std::optional<v1::CacheInfo> info;
  std::optional<CacheSpec> spec;
  if (verify_seed || !client.json()) {
    ASSIGN_OR_RETURN(info, client.FetchInfo(request.cache()));
  }
  if (verify_seed) {
    ASSIGN_OR_RETURN(spec, EngineSpec(info->spec()));
  }

  const bool keep = out_path.has_value() || verify_seed.has_value();
  ASSIGN_OR_RETURN(ReadReply reply, ReceiveRead(client, request, keep));
  if (out_path) RETURN_IF_ERROR(WriteFile(*out_path, reply.payload));
  std::optional<PatternCheck> check;
  if (verify_seed) {
    ASSIGN_OR_RETURN(check, VerifyRead(client, request, *spec, reply, *verify_seed));
  }
  if (client.json()) {
    RETURN_IF_ERROR(PrintReadJson(reply, check, verify_seed));
  } else {
    PrintReadText(request, info->spec(), reply, out_path, check, verify_seed);
  }
  if (check && check->mismatches != 0) {
    return absl::DataLossError(absl::StrCat("payload does not match seed ", *verify_seed, ": ",
                                            check->mismatches, " of ", check->elements,
                                            " elements differ, first at ", check->first_mismatch));
  }
  return absl::OkStatus();
}

constexpr absl::string_view kAppendFlags[] = {
    "cache", "name",   "seq",         "positions",   "seed",     "payload-file",
    "batch", "stream", "chunk-bytes", "speculative", "token-ids"};
constexpr absl::string_view kReadFlags[] = {"cache", "name", "seq",         "begin",
                                            "end",   "out",  "verify-seed", "max-chunk-bytes"};

}  // namespace

const Command kAppendCommand = {
    "append", kAppendFlags,
    R"(  append        --cache=CACHE --seq=N --positions=LIST [--seed=N | --payload-file=FILE]
                [--batch=TOKENS] [--stream [--chunk-bytes=BYTES]] [--speculative]
                [--token-ids=LIST]
                LIST: comma-separated P or half-open BEGIN:END, e.g. 0:512 or 0,1,2,10:20.
                --token-ids: the token id of each position, in the same form (as many as
                positions), kept in the sequence's token chain (docs/api.md#tokens).
                The payload is the pattern of --seed (default 0) for these positions, or FILE
                (the payload of all the tokens as one batch). Tokens go in Appends of --batch
                tokens (default: the cache's max_batch); a failed Append stops the command and
                the earlier ones stay. A unary Append must fit the node's --max-message-bytes
                (default 128MiB); --stream uses AppendStream in chunks of --chunk-bytes
                (default 1MiB) and has no such limit. Recurrent groups get the pattern state
                of --seed at the offset each Append reaches (a plain FILE of such a cache
                must fit one Append). --speculative: the tokens are pending until
                commit-speculation (one Recurrent state per token).)",
    &Append};

const Command kReadCommand = {
    "read", kReadFlags,
    R"(  read          --cache=CACHE --seq=N [--begin=P] [--end=P] [--out=FILE] [--verify-seed=N]
                [--max-chunk-bytes=BYTES]
                prints the positions (or Recurrent state) per group, payload size and FNV-1a
                64 checksum; --verify-seed compares the payload with the pattern of that seed,
                a Recurrent state with that seed's state at the sequence's offset (exit 1,
                DATA_LOSS, on a mismatch))",
    &Read};

}  // namespace ctl
}  // namespace kvmesh

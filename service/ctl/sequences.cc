// kvmeshctl's commands on what a sequence holds and edits of it: visible, copy-prefix (from this
// node or another member), remove (here or cluster-wide), can-resume, list-sequences and
// commit-speculation.
#include <algorithm>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "cache/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "kvmesh/v1/kvmesh.grpc.pb.h"
#include "kvmesh/v1/kvmesh.pb.h"
#include "service/common/convert.h"
#include "service/ctl/args.h"
#include "service/ctl/client.h"
#include "service/ctl/commands.h"
#include "service/ctl/format.h"
#include "service/ctl/parse.h"

namespace kvmesh {
namespace ctl {
namespace {

absl::Status Visible(const Client& client, const Args& args) {
  v1::VisibleRequest request;
  ASSIGN_OR_RETURN(*request.mutable_cache(), GetCacheName(args));
  ASSIGN_OR_RETURN(int32_t group, GetInt32(args, "group", 0));
  request.set_group(group);
  for (const std::string& text : args.GetAll("query")) {
    std::vector<absl::string_view> parts = absl::StrSplit(text, ':');
    v1::Query* q = request.add_queries();
    int64_t seq;
    int32_t pos;
    if (parts.size() < 2 || parts.size() > 3 || !absl::SimpleAtoi(parts[0], &seq) ||
        !absl::SimpleAtoi(parts[1], &pos) || (parts.size() == 3 && parts[2] != "nc")) {
      return absl::InvalidArgumentError(
          absl::StrCat("--query='", text, "' is not SEQ:POS or SEQ:POS:nc"));
    }
    q->set_seq(seq);
    q->set_pos(pos);
    q->set_non_causal(parts.size() == 3);
  }
  if (args.Has("pos")) {
    ASSIGN_OR_RETURN(int64_t seq, args.GetInt("seq"));
    ASSIGN_OR_RETURN(std::vector<int32_t> positions, GetPositions(args, "pos"));
    ASSIGN_OR_RETURN(bool non_causal, args.GetBool("non-causal"));
    for (int32_t pos : positions) {
      v1::Query* q = request.add_queries();
      q->set_seq(seq);
      q->set_pos(pos);
      q->set_non_causal(non_causal);
    }
  }
  if (request.queries().empty()) {
    return absl::InvalidArgumentError("give --query=SEQ:POS[:nc] or --seq=N --pos=LIST");
  }
  // The text answer prints ranges either way, so it asks for them (a long sequence is then a
  // few bytes on the wire); --json prints what was asked for.
  ASSIGN_OR_RETURN(const bool ranges, args.GetBool("ranges"));
  request.set_as_ranges(ranges || !client.json());
  v1::VisibleResponse response;
  RETURN_IF_ERROR(client.Call(&v1::CacheService::Stub::Visible, request, &response));
  if (client.json()) return PrintJson(response);
  for (int i = 0; i < request.queries_size(); ++i) {
    const v1::Query& q = request.queries(i);
    const v1::Visibility empty;
    const v1::Visibility& v = i < response.visible_size() ? response.visible(i) : empty;
    // A node older than as_ranges answers in positions.
    int64_t count = v.positions_size();
    for (const v1::PositionRange& range : v.ranges()) {
      count += int64_t{range.last()} - range.first() + 1;
    }
    const std::string text =
        v.ranges().empty()
            ? FormatPositions(std::vector<int32_t>(v.positions().begin(), v.positions().end()))
            : FormatRanges(v.ranges());
    std::printf("group %d query seq %" PRId64 " pos %d%s: %" PRId64 " visible: %s\n", group,
                q.seq(), q.pos(), q.non_causal() ? " (non-causal)" : "", count, text.c_str());
  }
  return absl::OkStatus();
}

absl::Status CopyPrefix(const Client& client, const Args& args) {
  v1::CopyPrefixRequest request;
  ASSIGN_OR_RETURN(*request.mutable_cache(), GetCacheName(args));
  ASSIGN_OR_RETURN(int64_t src, args.GetInt("src"));
  ASSIGN_OR_RETURN(int64_t dst, args.GetInt("dst"));
  ASSIGN_OR_RETURN(int32_t length, GetInt32(args, "length"));
  request.set_src_seq(src);
  request.set_dst_seq(dst);
  request.set_length(length);
  ASSIGN_OR_RETURN(*request.mutable_source_node(), args.GetString("source-node", ""));
  ASSIGN_OR_RETURN(const int32_t require, GetInt32(args, "require-src-offset", 0));
  request.set_require_src_offset(require);
  v1::CopyPrefixResponse response;
  RETURN_IF_ERROR(client.Call(&v1::CacheService::Stub::CopyPrefix, request, &response));
  if (client.json()) return PrintJson(response);
  std::printf(
      "copied positions < %d of seq %" PRId64 "%s to seq %" PRId64 ": its offset is %d\n", length,
      src,
      request.source_node().empty() ? "" : absl::StrCat(" on node ", request.source_node()).c_str(),
      dst, response.offset());
  if (response.has_transfer()) {
    std::printf("transfer: %s\n", TransferLine(response.transfer()).c_str());
    if (response.kept_positions() > 0) {
      std::printf(
          "kept dst's first %d positions (the same token ids as src): only the rest "
          "moved\n",
          response.kept_positions());
    }
  }
  return absl::OkStatus();
}

absl::Status Remove(const Client& client, const Args& args) {
  v1::RemoveRequest request;
  ASSIGN_OR_RETURN(*request.mutable_cache(), GetCacheName(args));
  ASSIGN_OR_RETURN(int64_t seq, args.GetInt("seq"));
  ASSIGN_OR_RETURN(int32_t begin, GetInt32(args, "begin"));
  request.set_seq(seq);
  request.set_begin(begin);
  if (args.Has("end")) {
    ASSIGN_OR_RETURN(int32_t end, GetInt32(args, "end"));
    request.set_end(end);
  }
  if (auto scope = args.Get("scope")) {
    ASSIGN_OR_RETURN(v1::RemoveScope parsed, ParseRemoveScope(*scope));
    request.set_scope(parsed);
  }
  v1::RemoveResponse response;
  RETURN_IF_ERROR(client.Call(&v1::CacheService::Stub::Remove, request, &response));
  if (client.json()) return PrintJson(response);
  if (request.scope() == v1::REMOVE_SCOPE_CLUSTER) {
    std::printf("%s seq %" PRId64 " on %d nodes:\n",
                request.has_end()
                    ? absl::StrCat("remove [", begin, ", ", request.end(), ") of").c_str()
                    : absl::StrCat("truncate at ", begin, " of").c_str(),
                seq, response.nodes_size());
    for (const v1::NodeResult& node : response.nodes()) {
      std::printf("  %s\n", NodeResultLine(node).c_str());
    }
    return absl::OkStatus();
  }
  if (request.has_end()) {
    std::printf("removed [%d, %d) from seq %" PRId64 "; later positions moved down by %d\n", begin,
                request.end(), seq, request.end() - begin);
  } else {
    std::printf("truncated seq %" PRId64 " at %d\n", seq, begin);
  }
  return absl::OkStatus();
}

absl::Status Reserve(const Client& client, const Args& args) {
  v1::ReserveRequest request;
  ASSIGN_OR_RETURN(*request.mutable_cache(), GetCacheName(args));
  ASSIGN_OR_RETURN(const int64_t seq, args.GetInt("seq"));
  ASSIGN_OR_RETURN(const int32_t positions, GetInt32(args, "positions"));
  ASSIGN_OR_RETURN(const absl::Duration ttl, args.GetDuration("ttl", absl::ZeroDuration()));
  request.set_seq(seq);
  request.set_positions(positions);
  request.set_ttl_ms(absl::ToInt64Milliseconds(ttl));
  v1::ReserveResponse response;
  RETURN_IF_ERROR(client.Call(&v1::CacheService::Stub::Reserve, request, &response));
  if (client.json()) return PrintJson(response);
  int64_t reserved = 0;
  for (const v1::GroupUsage& g : response.usage().groups()) reserved += g.cells_reserved();
  if (positions == 0) {
    std::printf("dropped the reservation of seq %" PRId64, seq);
  } else {
    std::printf("reserved room for %d positions of seq %" PRId64, positions, seq);
  }
  std::printf("; the cache now holds back %" PRId64 " cells and %d sequence slots\n", reserved,
              response.usage().sequences_reserved());
  return absl::OkStatus();
}

absl::Status CanResume(const Client& client, const Args& args) {
  ASSIGN_OR_RETURN(std::string cache, GetCacheName(args));
  ASSIGN_OR_RETURN(int64_t seq, args.GetInt("seq"));
  ASSIGN_OR_RETURN(std::vector<int32_t> positions, GetPositions(args, "pos"));
  for (int32_t pos : positions) {
    v1::CanResumeRequest request;
    request.set_cache(cache);
    request.set_seq(seq);
    request.set_pos(pos);
    v1::CanResumeResponse response;
    RETURN_IF_ERROR(client.Call(&v1::CacheService::Stub::CanResume, request, &response));
    if (client.json()) {
      RETURN_IF_ERROR(PrintJson(response));
    } else {
      std::printf("can-resume seq %" PRId64 " pos %d: %s\n", seq, pos,
                  response.can_resume() ? "true" : "false");
    }
  }
  return absl::OkStatus();
}

absl::Status LookupPrefix(const Client& client, const Args& args) {
  v1::LookupPrefixRequest request;
  ASSIGN_OR_RETURN(*request.mutable_cache(), GetCacheName(args));
  ASSIGN_OR_RETURN(std::vector<int32_t> tokens, GetPositions(args, "tokens"));
  request.mutable_tokens()->Add(tokens.begin(), tokens.end());
  ASSIGN_OR_RETURN(int64_t max_matches, args.GetInt("max-matches", 1));
  request.set_max_matches(static_cast<int32_t>(max_matches));
  const std::string scope = args.Get("scope").value_or("local");
  if (scope == "cluster") {
    request.set_scope(v1::LOOKUP_SCOPE_CLUSTER);
  } else if (scope != "local") {
    return absl::InvalidArgumentError(
        absl::StrCat("--scope='", scope, "' is neither 'local' nor 'cluster'"));
  }
  ASSIGN_OR_RETURN(const bool verify, args.GetBool("verify"));
  request.set_verify(verify);
  v1::LookupPrefixResponse response;
  RETURN_IF_ERROR(client.Call(&v1::CacheService::Stub::LookupPrefix, request, &response));
  if (client.json()) return PrintJson(response);
  if (response.matches().empty()) {
    std::printf("no stored prefix of the %zu tokens (a match is at least one block)\n",
                tokens.size());
  }
  for (const v1::PrefixMatch& m : response.matches()) {
    std::printf("%s%sseq %" PRId64 ": %d of %zu tokens (offset %d)%s\n", m.node().c_str(),
                m.node().empty() ? "" : " ", m.seq(), m.length(), tokens.size(), m.offset(),
                !m.verified()    ? ", by block hash (not verified)"
                : m.can_resume() ? ""
                                 : ", cannot resume there");
  }
  for (const v1::NodeResult& failed : response.unverified()) {
    std::printf("%s could not verify its candidates: %s\n", failed.node().c_str(),
                failed.message().c_str());
  }
  return absl::OkStatus();
}

// Prints the events of a WatchEvents stream, one a line, until --count of them (listing entries
// included) or the end of the stream (its --timeout).
absl::Status WatchEvents(const Client& client, const Args& args) {
  v1::WatchEventsRequest request;
  if (auto cache = args.Get("cache")) request.add_caches(*cache);
  ASSIGN_OR_RETURN(int64_t count, args.GetInt("count", 0));
  if (count < 0) return absl::InvalidArgumentError(absl::StrCat("--count=", count, " is < 0"));
  if (auto boot = args.Get("boot-id")) request.set_boot_id(*boot);
  ASSIGN_OR_RETURN(int64_t next, args.GetInt("next", 0));
  request.set_next(static_cast<uint64_t>(next));
  std::unique_ptr<grpc::ClientContext> context = client.Context();
  std::unique_ptr<grpc::ClientReader<v1::WatchEventsResponse>> reader =
      client.stub().WatchEvents(context.get(), request);
  v1::WatchEventsResponse message;
  int64_t printed = 0;
  while ((count == 0 || printed < count) && reader->Read(&message)) {
    if (client.json()) {
      RETURN_IF_ERROR(PrintJson(message));
      printed += std::max(1, message.events_size());
      continue;
    }
    for (const v1::Event& e : message.events()) {
      std::string what;
      switch (e.kind()) {
        case v1::EVENT_KIND_BLOCKS:
          what = absl::StrCat("seq ", e.seq(), " offset ", e.offset(), ": blocks kept ",
                              e.kept_blocks(), ", added ", e.block_hashes_size());
          break;
        case v1::EVENT_KIND_REMOVED:
          what = absl::StrCat("seq ", e.seq(), " [", e.begin(), ", ",
                              e.end() < 0 ? std::string("end") : absl::StrCat(e.end()), ")");
          break;
        case v1::EVENT_KIND_SNAPSHOT_CREATED:
        case v1::EVENT_KIND_SNAPSHOT_DROPPED:
          what = absl::StrCat("snapshot ", e.snapshot(), " of seq ", e.seq());
          break;
        case v1::EVENT_KIND_MIGRATED_IN:
          what = absl::StrCat("seq ", e.seq(), " from ", e.peer());
          break;
        case v1::EVENT_KIND_MIGRATED_OUT:
          what = absl::StrCat("seq ", e.seq(), " to ", e.peer());
          break;
        case v1::EVENT_KIND_EVICTED:
          what = absl::StrCat("seq ", e.seq(), " offset ", e.offset(), " (", e.reason(), ")");
          break;
        default:
          break;
      }
      std::printf("%s %-16s %s %s\n",
                  e.number() == 0 ? "listed" : absl::StrCat("#", e.number()).c_str(),
                  v1::EventKind_Name(e.kind()).substr(11).c_str(), e.cache().c_str(), what.c_str());
      ++printed;
    }
    if (message.synced()) {
      std::printf("synced: boot_id %s, next %" PRIu64 "\n", message.boot_id().c_str(),
                  message.next());
    }
    std::fflush(stdout);
  }
  if (count > 0 && printed >= count) {
    context->TryCancel();
    while (reader->Read(&message)) {
    }
    (void)reader->Finish();
    return absl::OkStatus();
  }
  return FromGrpcStatus(reader->Finish());
}

absl::Status SetRetention(const Client& client, const Args& args) {
  v1::SetRetentionRequest request;
  ASSIGN_OR_RETURN(*request.mutable_cache(), GetCacheName(args));
  ASSIGN_OR_RETURN(const int64_t seq, args.GetInt("seq"));
  request.set_seq(seq);
  if (args.Has("priority")) {
    ASSIGN_OR_RETURN(const int32_t priority, GetInt32(args, "priority"));
    request.set_priority(priority);
  }
  request.set_pinned(args.Has("pin"));
  ASSIGN_OR_RETURN(const absl::Duration ttl, args.GetDuration("ttl", absl::ZeroDuration()));
  if (ttl != absl::ZeroDuration() && ttl < absl::Milliseconds(1)) {
    return absl::InvalidArgumentError(absl::StrCat("--ttl=", absl::FormatDuration(ttl),
                                                   ": a TTL is at least 1ms (0 or none: no TTL)"));
  }
  request.set_ttl_ms(absl::ToInt64Milliseconds(ttl));
  v1::SetRetentionResponse response;
  RETURN_IF_ERROR(client.Call(&v1::CacheService::Stub::SetRetention, request, &response));
  if (client.json()) return PrintJson(response);
  std::printf(
      "seq %" PRId64 ": priority %d%s, %s\n", seq, response.sequence().priority(),
      response.sequence().pinned() ? ", pinned" : "",
      response.sequence().ttl_ms() > 0
          ? absl::StrCat("removed after ", response.sequence().ttl_ms(), " ms unused").c_str()
          : "no TTL");
  return absl::OkStatus();
}

absl::Status ListSequences(const Client& client, const Args& args) {
  v1::ListSequencesRequest request;
  ASSIGN_OR_RETURN(*request.mutable_cache(), GetCacheName(args));
  ASSIGN_OR_RETURN(const bool one_page, GetPaging(args, kListPageSize, &request));
  v1::ListSequencesResponse response;
  RETURN_IF_ERROR(client.CallPages(&v1::CacheService::Stub::ListSequences, request, &response,
                                   one_page));
  if (client.json()) return PrintJson(response);
  ASSIGN_OR_RETURN(v1::CacheInfo info, client.FetchInfo(request.cache()));
  std::printf("%-8s %7s %7s %11s %9s %9s  %s\n", "SEQ", "OFFSET", "PENDING", "EXACT/IDS", "IDLE",
              "KEEP", "PER GROUP: stored (shared) [first, last] | recurrent: state (shared)");
  for (const v1::SequenceInfo& s : response.sequences()) {
    std::vector<std::string> groups;
    for (const v1::GroupSequence& g : s.groups()) {
      switch (GroupKindOf(info.spec(), g.group())) {
        case v1::LayerGroup::kRecurrent:
          groups.push_back(absl::StrCat("g", g.group(), ": state ", StateText(g.state()),
                                        g.shared() > 0 ? " (shared)" : ""));
          break;
        case v1::LayerGroup::kRotating:
          groups.push_back(absl::StrCat("g", g.group(), ": ring ", g.stored(), " (", g.shared(),
                                        ") [", g.first(), ", ", g.last(), "]"));
          break;
        default:
          groups.push_back(absl::StrCat("g", g.group(), ": ", g.stored(), " (", g.shared(), ") [",
                                        g.first(), ", ", g.last(), "]"));
      }
    }
    const std::string tokens =
        s.tokens() == 0 ? "-" : absl::StrCat(s.exact_tokens(), "/", s.tokens());
    // KEEP: priority, p when pinned, and the TTL ("0", "3p", "1 ttl=60s").
    std::string keep = absl::StrCat(s.priority(), s.pinned() ? "p" : "");
    if (s.ttl_ms() > 0) {
      absl::StrAppend(&keep, ",", absl::FormatDuration(absl::Milliseconds(s.ttl_ms())));
    }
    const std::string idle = absl::FormatDuration(absl::Milliseconds(s.idle_ms()));
    std::printf("%-8" PRId64 " %7d %7d %11s %9s %9s  %s\n", s.seq(), s.offset(), s.pending(),
                tokens.c_str(), idle.c_str(), keep.c_str(), absl::StrJoin(groups, "  ").c_str());
  }
  if (response.sequences().empty()) std::printf("(no sequences)\n");
  PrintNextPage(response.next_page_token());
  return absl::OkStatus();
}

absl::Status CommitSpeculation(const Client& client, const Args& args) {
  v1::CommitSpeculationRequest request;
  ASSIGN_OR_RETURN(*request.mutable_cache(), GetCacheName(args));
  ASSIGN_OR_RETURN(int64_t seq, args.GetInt("seq"));
  ASSIGN_OR_RETURN(int32_t accepted, GetInt32(args, "accepted"));
  request.set_seq(seq);
  request.set_accepted(accepted);
  v1::CommitSpeculationResponse response;
  RETURN_IF_ERROR(client.Call(&v1::CacheService::Stub::CommitSpeculation, request, &response));
  if (client.json()) return PrintJson(response);
  std::printf("committed %d pending tokens of seq %" PRId64 "; offset now %d\n", accepted, seq,
              response.offset());
  return absl::OkStatus();
}

constexpr absl::string_view kVisibleFlags[] = {"cache", "name", "group",      "query",
                                               "seq",   "pos",  "non-causal", "ranges"};
constexpr absl::string_view kCopyPrefixFlags[] = {
    "cache", "name", "src", "dst", "length", "source-node", "require-src-offset"};
constexpr absl::string_view kRemoveFlags[] = {"cache", "name", "seq", "begin", "end", "scope"};
constexpr absl::string_view kCanResumeFlags[] = {"cache", "name", "seq", "pos"};
constexpr absl::string_view kReserveFlags[] = {"cache", "name", "seq", "positions", "ttl"};
constexpr absl::string_view kListSequencesFlags[] = {"cache", "name", "page-size",
                                                     "page-token"};
constexpr absl::string_view kSetRetentionFlags[] = {"cache",    "name", "seq",
                                                    "priority", "pin",  "ttl"};
constexpr absl::string_view kWatchEventsFlags[] = {"cache", "count", "boot-id", "next"};
constexpr absl::string_view kLookupPrefixFlags[] = {"cache",       "name",  "tokens",
                                                    "max-matches", "scope", "verify"};
constexpr absl::string_view kCommitSpeculationFlags[] = {"cache", "name", "seq", "accepted"};

}  // namespace

const Command kVisibleCommand = {
    "visible", kVisibleFlags,
    R"(  visible       --cache=CACHE [--group=G] (--query=SEQ:POS[:nc]... | --seq=N --pos=LIST
                [--non-causal]) [--ranges]  (--ranges: --json prints ranges, not positions))",
    &Visible};

const Command kCopyPrefixCommand = {
    "copy-prefix", kCopyPrefixFlags,
    R"(  copy-prefix   --cache=CACHE --src=N --dst=N --length=TOKENS [--source-node=NODE]
                [--require-src-offset=N]
                with --source-node naming another member: this node (--addr) pulls src's
                positions < TOKENS from NODE into dst; prints the transfer (transport, bytes,
                time, GB/s); --require-src-offset: refused (nothing changes) unless src's
                offset is at least N; prints dst's offset after the copy)",
    &CopyPrefix};

const Command kRemoveCommand = {
    "remove", kRemoveFlags,
    R"(  remove        --cache=CACHE --seq=N --begin=P [--end=P] [--scope=local|cluster]
                no --end: truncate from --begin; --scope=cluster removes on every member and
                prints one line per node (the command succeeds when every member answered))",
    &Remove};

const Command kCanResumeCommand = {"can-resume", kCanResumeFlags,
                                   R"(  can-resume    --cache=CACHE --seq=N --pos=LIST)",
                                   &CanResume};

const Command kLookupPrefixCommand = {
    "lookup-prefix", kLookupPrefixFlags,
    R"(  lookup-prefix --cache=CACHE --tokens=LIST [--max-matches=N (1)] [--scope=local|cluster]
                [--verify]
                the sequences holding the longest prefixes of the prompt LIST (token ids, in
                append's LIST form), verified token by token; --scope=cluster adds the other
                members' from this node's index, by block hash unless --verify asks their
                holders (docs/api.md#lookupprefix))",
    &LookupPrefix};

const Command kWatchEventsCommand = {
    "watch-events", kWatchEventsFlags,
    R"(  watch-events  [--cache=CACHE] [--count=N] [--boot-id=ID --next=N]
                the node's events (docs/api.md#watchevents), one a line: a listing of the
                block hashes first, then changes as they happen, until N (0: until --timeout)
                or the stream ends; --boot-id and --next resume an earlier stream)",
    &WatchEvents};

const Command kReserveCommand = {"reserve", kReserveFlags,
                                 R"(  reserve       --cache=CACHE --seq=N --positions=N [--ttl=60s]
                sets aside room (cells, a sequence slot) for seq to hold N positions until the
                TTL (at most 1h); --positions=0 drops it)",
                                 &Reserve};

const Command kSetRetentionCommand = {
    "set-retention", kSetRetentionFlags,
    R"(  set-retention --cache=CACHE --seq=N [--priority=P (0)] [--pin] [--ttl=DURATION]
                how long a live sequence is kept: under --eviction=lru lower priorities go
                first, --pin never (to make room); --ttl removes it once unused that long;
                each call sets all three (docs/api.md#eviction))",
    &SetRetention};

const Command kListSequencesCommand = {
    "list-sequences", kListSequencesFlags,
    R"(  list-sequences --cache=CACHE [--page-size=N] [--page-token=T]
                offset, pending tokens, token ids (exact/known), idle time, retention
                (priority, p: pinned, TTL), per-group storage/state; every page, N (4096) a
                call, unless --page-token asks for the one page from T (docs/api.md#paging))",
    &ListSequences};

const Command kCommitSpeculationCommand = {
    "commit-speculation", kCommitSpeculationFlags,
    R"(  commit-speculation --cache=CACHE --seq=N --accepted=K  keep the first K pending tokens)",
    &CommitSpeculation};

}  // namespace ctl
}  // namespace kvmesh

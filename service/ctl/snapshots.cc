// kvmeshctl's commands on a cache's snapshot pool: snapshot, restore (from a snapshot or a
// rewind), merge-snapshots, split-snapshot, drop-snapshot and list-snapshots.
#include <cinttypes>
#include <cstdint>
#include <cstdio>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "cache/status_macros.h"
#include "kvmesh/v1/kvmesh.pb.h"
#include "service/common/convert.h"
#include "service/ctl/args.h"
#include "service/ctl/client.h"
#include "service/ctl/commands.h"
#include "service/ctl/format.h"

namespace kvmesh {
namespace ctl {
namespace {

absl::Status Snapshot(const Client& client, const Args& args) {
  v1::SnapshotRequest request;
  ASSIGN_OR_RETURN(*request.mutable_cache(), GetCacheName(args));
  ASSIGN_OR_RETURN(int64_t seq, args.GetInt("seq"));
  ASSIGN_OR_RETURN(int32_t from, GetInt32(args, "from", 0));
  request.set_seq(seq);
  request.set_from_offset(from);
  v1::SnapshotResponse response;
  RETURN_IF_ERROR(client.Call(&v1::CacheService::Stub::Snapshot, request, &response));
  if (client.json()) return PrintJson(response);
  ASSIGN_OR_RETURN(v1::CacheInfo info, client.FetchInfo(request.cache()));
  std::printf("took %s\n", SnapshotLine(response.snapshot(), info.spec()).c_str());
  return absl::OkStatus();
}

absl::Status Restore(const Client& client, const Args& args) {
  v1::RestoreRequest request;
  ASSIGN_OR_RETURN(*request.mutable_cache(), GetCacheName(args));
  ASSIGN_OR_RETURN(int64_t seq, args.GetInt("seq"));
  ASSIGN_OR_RETURN(int32_t target, GetInt32(args, "target"));
  request.set_seq(seq);
  request.set_target(target);
  if (args.Has("snapshot")) {
    ASSIGN_OR_RETURN(uint64_t id, GetSnapshotId(args, "snapshot"));
    request.set_snapshot_id(id);
  }
  v1::RestoreResponse response;
  RETURN_IF_ERROR(client.Call(&v1::CacheService::Stub::Restore, request, &response));
  if (client.json()) return PrintJson(response);
  if (request.has_snapshot_id()) {
    std::printf("restored seq %" PRId64 " from snapshot %" PRIu64 " up to %d\n", seq,
                request.snapshot_id(), target);
  } else {
    std::printf("rewound seq %" PRId64 " to %d\n", seq, target);
  }
  return absl::OkStatus();
}

absl::Status MergeSnapshots(const Client& client, const Args& args) {
  v1::MergeSnapshotsRequest request;
  ASSIGN_OR_RETURN(*request.mutable_cache(), GetCacheName(args));
  ASSIGN_OR_RETURN(uint64_t parent, GetSnapshotId(args, "parent"));
  ASSIGN_OR_RETURN(uint64_t child, GetSnapshotId(args, "child"));
  request.set_parent(parent);
  request.set_child(child);
  v1::MergeSnapshotsResponse response;
  RETURN_IF_ERROR(client.Call(&v1::CacheService::Stub::MergeSnapshots, request, &response));
  if (client.json()) return PrintJson(response);
  ASSIGN_OR_RETURN(v1::CacheInfo info, client.FetchInfo(request.cache()));
  std::printf("merged snapshots %" PRIu64 " + %" PRIu64 " (both consumed) into %s\n", parent, child,
              SnapshotLine(response.snapshot(), info.spec()).c_str());
  return absl::OkStatus();
}

absl::Status SplitSnapshot(const Client& client, const Args& args) {
  v1::SplitSnapshotRequest request;
  ASSIGN_OR_RETURN(*request.mutable_cache(), GetCacheName(args));
  ASSIGN_OR_RETURN(uint64_t id, GetSnapshotId(args, "snapshot"));
  ASSIGN_OR_RETURN(int32_t at, GetInt32(args, "at"));
  request.set_snapshot_id(id);
  request.set_at(at);
  v1::SplitSnapshotResponse response;
  RETURN_IF_ERROR(client.Call(&v1::CacheService::Stub::SplitSnapshot, request, &response));
  if (client.json()) return PrintJson(response);
  ASSIGN_OR_RETURN(v1::CacheInfo info, client.FetchInfo(request.cache()));
  std::printf("split snapshot %" PRIu64 " at %d (consumed)\n", id, at);
  std::printf("  parent: %s\n", response.has_parent()
                                    ? SnapshotLine(response.parent(), info.spec()).c_str()
                                    : "none");
  std::printf("  child:  %s\n",
              response.has_child() ? SnapshotLine(response.child(), info.spec()).c_str() : "none");
  return absl::OkStatus();
}

absl::Status DropSnapshot(const Client& client, const Args& args) {
  v1::DropSnapshotRequest request;
  ASSIGN_OR_RETURN(*request.mutable_cache(), GetCacheName(args));
  ASSIGN_OR_RETURN(uint64_t id, GetSnapshotId(args, "snapshot"));
  request.set_snapshot_id(id);
  v1::DropSnapshotResponse response;
  RETURN_IF_ERROR(client.Call(&v1::CacheService::Stub::DropSnapshot, request, &response));
  if (client.json()) return PrintJson(response);
  std::printf("dropped snapshot %" PRIu64 "\n", id);
  return absl::OkStatus();
}

absl::Status ListSnapshots(const Client& client, const Args& args) {
  v1::ListSnapshotsRequest request;
  ASSIGN_OR_RETURN(*request.mutable_cache(), GetCacheName(args));
  ASSIGN_OR_RETURN(const bool one_page, GetPaging(args, kListPageSize, &request));
  v1::ListSnapshotsResponse response;
  RETURN_IF_ERROR(client.CallPages(&v1::CacheService::Stub::ListSnapshots, request, &response,
                                   one_page));
  if (client.json()) return PrintJson(response);
  ASSIGN_OR_RETURN(v1::CacheInfo info, client.FetchInfo(request.cache()));
  for (const v1::SnapshotInfo& snap : response.snapshots()) {
    std::printf("%s\n", SnapshotLine(snap, info.spec()).c_str());
  }
  if (response.snapshots().empty()) std::printf("(no snapshots)\n");
  PrintNextPage(response.next_page_token());
  std::printf("pool: %d snapshots, %s\n", info.usage().snapshots(),
              Mib(info.usage().snapshot_bytes()).c_str());
  return absl::OkStatus();
}

constexpr absl::string_view kSnapshotFlags[] = {"cache", "name", "seq", "from"};
constexpr absl::string_view kRestoreFlags[] = {"cache", "name", "seq", "snapshot", "target"};
constexpr absl::string_view kMergeSnapshotsFlags[] = {"cache", "name", "parent", "child"};
constexpr absl::string_view kSplitSnapshotFlags[] = {"cache", "name", "snapshot", "at"};
constexpr absl::string_view kDropSnapshotFlags[] = {"cache", "name", "snapshot"};
constexpr absl::string_view kListSnapshotsFlags[] = {"cache", "name", "page-size",
                                                     "page-token"};

}  // namespace

const Command kSnapshotCommand = {
    "snapshot", kSnapshotFlags,
    R"(  snapshot      --cache=CACHE --seq=N [--from=P (0)]   copy [P, offset) of seq into the
                                               snapshot pool; prints the new snapshot id)",
    &Snapshot};

const Command kRestoreCommand = {"restore", kRestoreFlags,
                                 R"(  restore       --cache=CACHE --seq=N --target=P [--snapshot=ID]
                without --snapshot: rewind seq's live data to P; with it: write the snapshot's
                data into seq (any sequence of the cache) and clamp to P)",
                                 &Restore};

const Command kMergeSnapshotsCommand = {
    "merge-snapshots", kMergeSnapshotsFlags,
    R"(  merge-snapshots --cache=CACHE --parent=ID --child=ID   [a,b) + [b,c) -> [a,c) (new id))",
    &MergeSnapshots};

const Command kSplitSnapshotCommand = {
    "split-snapshot", kSplitSnapshotFlags,
    R"(  split-snapshot --cache=CACHE --snapshot=ID --at=P      [a,c) -> [a,P) + [P,c) (new ids))",
    &SplitSnapshot};

const Command kDropSnapshotCommand = {"drop-snapshot", kDropSnapshotFlags,
                                      R"(  drop-snapshot --cache=CACHE --snapshot=ID)",
                                      &DropSnapshot};

const Command kListSnapshotsCommand = {"list-snapshots", kListSnapshotsFlags,
                                       R"(  list-snapshots --cache=CACHE [--page-size=N] [--page-token=T]
                every page, N (4096) a call, unless --page-token asks for the one page from T)", &ListSnapshots};

}  // namespace ctl
}  // namespace kvmesh

// kvmeshctl's commands on the node itself and its cluster: health (grpc.health.v1), and the
// cluster operations the node at --addr runs: list-members, migrate, migrate-snapshot, drain.
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "cache/status_macros.h"
#include "kvmesh/v1/kvmesh.pb.h"
#include "service/common/convert.h"
#include "service/common/health_client.h"
#include "service/ctl/args.h"
#include "service/ctl/client.h"
#include "service/ctl/commands.h"
#include "service/ctl/format.h"

namespace kvmesh {
namespace ctl {
namespace {

absl::Status Health(const Client& client, const Args& args) {
  ASSIGN_OR_RETURN(std::string service, args.GetString("service", ""));
  ServingStatus status;
  RETURN_IF_ERROR(FromGrpcStatus(client.health().Check(client.Context().get(), service, &status)));
  if (client.json()) {
    std::printf("{\"status\":\"%s\"}\n", ServingStatusName(status));
  } else {
    std::printf("%s%s\n", service.empty() ? "" : (service + ": ").c_str(),
                ServingStatusName(status));
  }
  return absl::OkStatus();
}

absl::Status ListMembers(const Client& client, const Args&) {
  v1::ListMembersResponse response;
  RETURN_IF_ERROR(
      client.Call(&v1::CacheService::Stub::ListMembers, v1::ListMembersRequest(), &response));
  if (client.json()) return PrintJson(response);
  std::fputs(MembersTable(response).c_str(), stdout);
  return absl::OkStatus();
}

absl::Status Migrate(const Client& client, const Args& args) {
  v1::MigrateRequest request;
  ASSIGN_OR_RETURN(*request.mutable_cache(), GetCacheName(args));
  ASSIGN_OR_RETURN(int64_t seq, args.GetInt("seq"));
  ASSIGN_OR_RETURN(int64_t target_seq, args.GetInt("target-seq", seq));
  ASSIGN_OR_RETURN(*request.mutable_target_node(), args.GetString("target-node"));
  ASSIGN_OR_RETURN(bool keep_source, args.GetBool("keep-source"));
  request.set_seq(seq);
  request.set_target_seq(target_seq);
  request.set_keep_source(keep_source);
  v1::MigrateResponse response;
  RETURN_IF_ERROR(client.Call(&v1::CacheService::Stub::Migrate, request, &response));
  if (client.json()) return PrintJson(response);
  std::printf("migrated seq %" PRId64 " to node %s as seq %" PRId64 "%s\n", seq,
              request.target_node().c_str(), target_seq,
              keep_source ? " (source kept)" : " (removed here)");
  if (response.has_transfer()) {
    std::printf("transfer: %s\n", TransferLine(response.transfer()).c_str());
  }
  return absl::OkStatus();
}

absl::Status MigrateSnapshot(const Client& client, const Args& args) {
  v1::MigrateSnapshotRequest request;
  ASSIGN_OR_RETURN(*request.mutable_cache(), GetCacheName(args));
  ASSIGN_OR_RETURN(uint64_t id, GetSnapshotId(args, "snapshot"));
  ASSIGN_OR_RETURN(*request.mutable_target_node(), args.GetString("target-node"));
  ASSIGN_OR_RETURN(bool keep_source, args.GetBool("keep-source"));
  request.set_snapshot_id(id);
  request.set_keep_source(keep_source);
  v1::MigrateSnapshotResponse response;
  RETURN_IF_ERROR(client.Call(&v1::CacheService::Stub::MigrateSnapshot, request, &response));
  if (client.json()) return PrintJson(response);
  std::printf("migrated snapshot %" PRIu64 " to node %s as snapshot %" PRIu64 "%s\n", id,
              request.target_node().c_str(), response.snapshot().id(),
              keep_source ? " (source kept)" : " (dropped here)");
  // The snapshot's groups follow the cache's spec, which this node has too.
  auto info = client.FetchInfo(request.cache());
  if (info.ok()) {
    std::printf("  on %s: %s\n", request.target_node().c_str(),
                SnapshotLine(response.snapshot(), info->spec()).c_str());
  }
  if (response.has_transfer()) {
    std::printf("transfer: %s\n", TransferLine(response.transfer()).c_str());
  }
  return absl::OkStatus();
}

absl::Status Drain(const Client& client, const Args& args) {
  v1::DrainRequest request;
  ASSIGN_OR_RETURN(int64_t timeout_ms, args.GetInt("timeout-ms", 0));
  ASSIGN_OR_RETURN(bool resume, args.GetBool("resume"));
  request.set_timeout_ms(timeout_ms);
  request.set_resume(resume);
  // The call lasts as long as the drain: its deadline is the drain's timeout and a margin
  // (the node's --drain-timeout-ms when none is given: 10 minutes leave it room), unless
  // --timeout is longer. The node ends the drain in time to answer within it.
  std::unique_ptr<grpc::ClientContext> context = client.Context();
  if (!resume) {
    const int64_t wait_ms = timeout_ms > 0 ? timeout_ms + 30000 : int64_t{600000};
    const auto at_least =
        std::chrono::system_clock::now() + std::chrono::milliseconds(wait_ms);
    if (context->deadline() < at_least) context->set_deadline(at_least);
  }
  v1::DrainResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(client.stub().Drain(context.get(), request, &response)));
  if (client.json()) return PrintJson(response);
  if (resume) {
    std::printf("resumed: the node takes new caches and sequences again\n");
    return absl::OkStatus();
  }
  for (const v1::DrainedSequence& s : response.sequences()) {
    std::printf("moved   %s/%s seq %" PRId64 " -> %s seq %" PRId64 "  (%s)\n", s.tenant().c_str(),
                s.cache().c_str(), s.seq(), s.node().c_str(), s.target_seq(),
                TransferLine(s.transfer()).c_str());
  }
  for (const v1::DrainedSnapshot& s : response.snapshots()) {
    std::printf("moved   %s/%s snapshot %" PRIu64 " -> %s snapshot %" PRIu64 "  (%s)\n",
                s.tenant().c_str(), s.cache().c_str(), s.snapshot_id(), s.node().c_str(),
                s.target_snapshot_id(), TransferLine(s.transfer()).c_str());
  }
  for (const std::string& created : response.caches_created()) {
    std::printf("created cache %s\n", created.c_str());
  }
  for (const v1::DrainStayed& s : response.stayed()) {
    const std::string what = s.what_case() == v1::DrainStayed::kSnapshotId
                                 ? absl::StrCat("snapshot ", s.snapshot_id())
                                 : absl::StrCat("seq ", s.seq());
    std::printf("stayed  %s/%s %s: %s\n", s.tenant().c_str(), s.cache().c_str(), what.c_str(),
                s.reason().c_str());
  }
  std::printf("drained in %.3f s: %d sequences and %d snapshots moved, %d stayed; %s\n",
              static_cast<double>(response.micros()) / 1e6, response.sequences_size(),
              response.snapshots_size(), response.stayed_size(),
              response.draining() ? "the node stays draining (drain --resume ends it)"
                                  : "the node is not draining");
  return absl::OkStatus();
}

constexpr absl::string_view kHealthFlags[] = {"service"};
constexpr absl::string_view kDrainFlags[] = {"timeout-ms", "resume"};
constexpr absl::string_view kMigrateFlags[] = {"cache",       "name",       "seq",
                                               "target-node", "target-seq", "keep-source"};
constexpr absl::string_view kMigrateSnapshotFlags[] = {"cache", "name", "snapshot", "target-node",
                                                       "keep-source"};

}  // namespace

const Command kHealthCommand = {
    "health", kHealthFlags,
    R"(  health        [--service=NAME]               grpc.health.v1.Health/Check ("" = the server))",
    &Health};

const Command kListMembersCommand = {
    "list-members",
    {},
    R"(  list-members                                 this node (*) and its peers: address, health,
                                               backend, transports, boot id and start time (a
                                               new boot id: restarted, empty), why unreachable)",
    &ListMembers};

const Command kMigrateCommand = {
    "migrate", kMigrateFlags,
    R"(  migrate       --cache=CACHE --seq=N --target-node=NODE [--target-seq=N (--seq)]
                [--keep-source]
                move seq to NODE as --target-seq (replaced there); the source is removed once
                the target has committed unless --keep-source; prints the transfer)",
    &Migrate};

const Command kDrainCommand = {
    "drain", kDrainFlags,
    R"(  drain         [--timeout-ms=N (the node's --drain-timeout-ms)] [--resume]
                admin: stop taking new caches and sequences (readiness NOT_SERVING) and move
                every sequence and snapshot to peers; lists where each went and what stayed.
                The node keeps running, draining, until --resume)",
    &Drain};

const Command kMigrateSnapshotCommand = {
    "migrate-snapshot", kMigrateSnapshotFlags,
    R"(  migrate-snapshot --cache=CACHE --snapshot=ID --target-node=NODE [--keep-source]
                move a snapshot to NODE; prints its id there and the transfer)",
    &MigrateSnapshot};

}  // namespace ctl
}  // namespace kvmesh

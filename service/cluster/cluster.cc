#include "service/cluster/cluster.h"

#include <algorithm>
#include <chrono>
#include <future>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "cache/spec.h"
#include "cache/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "kvmesh/v1/kvmesh.grpc.pb.h"
#include "kvmesh/v1/peer.grpc.pb.h"
#include "service/common/convert.h"
#include "service/common/metrics.h"
#include "transport/checksum.h"

namespace kvmesh {
namespace {

// Pieces in which Export reads the wire image to checksum it.
constexpr size_t kChecksumPiece = size_t{4} << 20;

// The most token ids an incremental pull names (ExportSequence.have_token_ids): 4 MiB.
constexpr int kMaxHaveTokenIds = 1 << 20;

// Whether every group of `spec` is full attention: a receiver that holds a position's token
// id exactly holds its K/V too (a sliding or chunked group drops positions, not their ids).
bool AllFullAttention(const CacheSpec& spec) {
  for (const GroupSpec& g : spec.groups) {
    if (g.kind != GroupKind::kAttention || g.attention.window.kind != WindowKind::kFull) {
      return false;
    }
  }
  return true;
}

// A lease's payload: the engine's export reader, one ReadAt at a time.
class ReaderPayload final : public transport::LeasedPayload {
 public:
  explicit ReaderPayload(std::unique_ptr<SnapshotExportReader> reader)
      : reader_(std::move(reader)), view_reader_(reader_.get()), size_(reader_->size()) {}
  size_t size() const override { return size_; }
  absl::Status ReadAt(size_t offset, absl::Span<uint8_t> dst) override {
    MutexLock lock(&mu_);
    return reader_->ReadAt(offset, dst);
  }
  // Reads no mutable state of the reader: no lock.
  absl::Span<const uint8_t> View(size_t offset, size_t max_bytes) const override {
    return view_reader_->View(offset, max_bytes);
  }

 private:
  Mutex mu_;
  const std::unique_ptr<SnapshotExportReader> reader_ ABSL_PT_GUARDED_BY(mu_);
  const SnapshotExportReader* const view_reader_;  // reader_, for View
  const size_t size_;
};

void SetDeadline(grpc::ClientContext* context, absl::Time deadline) {
  if (deadline != absl::InfiniteFuture()) context->set_deadline(absl::ToChronoTime(deadline));
}

// A peer's status, with the peer named, as the scheduler sees it.
absl::Status PeerError(const grpc::Status& status, const std::string& peer, const char* rpc) {
  const absl::Status s = FromGrpcStatus(status);
  absl::Status named(s.code(), absl::StrCat(rpc, " on node '", peer, "': ", s.message()));
  // What the peer said in numbers (a Shortage) goes on to the scheduler too.
  s.ForEachPayload([&named](absl::string_view url, const absl::Cord& payload) {
    named.SetPayload(url, payload);
  });
  return named;
}

int64_t Micros(absl::Duration d) { return absl::ToInt64Microseconds(d); }

}  // namespace

Cluster::Cluster(Options options, CacheRegistry* registry, Membership* membership,
                 LeaseTable* leases, Reservations* reservations,
                 std::map<std::string, transport::Transport*> transports)
    : options_(std::move(options)),
      registry_(registry),
      membership_(membership),
      leases_(leases),
      reservations_(reservations),
      transports_(std::move(transports)) {}

absl::Time Cluster::Deadline(absl::Time requested) const {
  return std::min(requested, absl::Now() + options_.transfer_timeout);
}

absl::StatusOr<std::shared_ptr<Cache>> Cluster::FindCache(const std::string& tenant,
                                                          const std::string& name) const {
  if (name.empty()) return absl::InvalidArgumentError("cache is empty: name the cache");
  if (tenant.empty() || tenant.find('/') != std::string::npos) {
    return absl::InvalidArgumentError("tenant is empty or malformed: name the cache's tenant");
  }
  return registry_->Get(tenant, name);
}

absl::StatusOr<MemberAddress> Cluster::FindPeer(const std::string& name, const char* field) const {
  if (name.empty()) return absl::InvalidArgumentError(absl::StrCat(field, " is empty"));
  if (name == options_.self_name) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " = '", name, "' is this node; name another member"));
  }
  absl::StatusOr<MemberAddress> member = membership_->Find(name);
  if (!member.ok()) {
    return absl::Status(member.status().code(),
                        absl::StrCat(field, ": ", member.status().message()));
  }
  return member;
}

absl::StatusOr<transport::Transport*> Cluster::ChooseTransport(const MemberAddress& source,
                                                               absl::Time deadline) {
  auto find = [this](const std::string& name) -> absl::StatusOr<transport::Transport*> {
    auto it = transports_.find(name);
    if (it == transports_.end()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "transport '", name, "' is not available on node '", options_.self_name, "'"));
    }
    return it->second;
  };
  if (options_.transport != "auto") return find(options_.transport);
  // nccl when both nodes run on a GPU and both have it.
  if (transports_.count(transport::kNccl) == 0 || options_.backend.rfind("cuda", 0) != 0) {
    return find(transport::kGrpcStream);
  }
  std::unique_ptr<v1::PeerService::Stub> stub =
      v1::PeerService::NewStub(membership_->Channel(source));
  grpc::ClientContext context;
  SetDeadline(&context, std::min(deadline, absl::Now() + options_.control_timeout));
  v1::NodeInfoResponse info;
  const grpc::Status status = stub->NodeInfo(&context, v1::NodeInfoRequest(), &info);
  if (!status.ok()) return PeerError(status, source.name, "NodeInfo");
  const bool peer_nccl = std::find(info.transports().begin(), info.transports().end(),
                                   transport::kNccl) != info.transports().end();
  if (peer_nccl && info.backend().rfind("cuda", 0) == 0) return find(transport::kNccl);
  return find(transport::kGrpcStream);
}

v1::ListMembersResponse Cluster::DescribeMembers() const {
  return membership_->Describe(absl::Now() + options_.control_timeout);
}

// ---- sender side ---------------------------------------------------------------------------

absl::StatusOr<v1::ExportResponse> Cluster::Export(const v1::ExportRequest& request,
                                                   const std::string& caller) {
  // The transport first: a lease for a payload nobody can move is a snapshot-pool leak.
  if (request.transport().empty() || transports_.count(request.transport()) == 0) {
    std::string have;
    for (const auto& [name, t] : transports_)
      absl::StrAppend(&have, have.empty() ? "" : ", ", name);
    return absl::InvalidArgumentError(absl::StrCat(
        "transport = '", request.transport().substr(0, 32), "' is not a transport of node '",
        options_.self_name, "' (it has: ", have, ")"));
  }
  // Data goes to members only.
  if (const absl::Status member = FindPeer(request.receiver(), "receiver").status(); !member.ok()) {
    return absl::PermissionDeniedError(absl::StrCat("export refused: ", member.message()));
  }
  ASSIGN_OR_RETURN(const std::shared_ptr<Cache> cache,
                   FindCache(request.tenant(), request.cache()));
  if (!request.has_spec()) return absl::InvalidArgumentError("spec is missing");
  ASSIGN_OR_RETURN(const CacheSpec spec, SpecFromProto(request.spec()));
  if (!(spec == cache->spec())) {
    return absl::FailedPreconditionError(
        absl::StrCat("cache '", request.cache(), "' has another spec on node '", options_.self_name,
                     "' than on node '", request.receiver(),
                     "': ", DescribeSpecDifference(cache->spec(), spec)));
  }
  if (request.lease_ms() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("lease_ms = ", request.lease_ms(), " is negative"));
  }
  v1::ExportResponse response;
  absl::StatusOr<std::unique_ptr<SnapshotExportReader>> reader;
  if (request.has_sequence()) {
    const v1::ExportSequence& seq = request.sequence();
    if (seq.seq() < 0) {
      return absl::InvalidArgumentError(absl::StrCat("sequence.seq = ", seq.seq(), " is negative"));
    }
    if (seq.length() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence.length = ", seq.length(), " is negative"));
    }
    if (!seq.migration_id().empty() &&
        !reservations_->IsReserved(Reservations::Kind::kSequence,
                                   Reservations::Key(request.tenant(), request.cache()),
                                   seq.seq())) {
      return absl::AbortedError(absl::StrCat("sequence ", seq.seq(), " of cache '", request.cache(),
                                             "' is not reserved for migration ", seq.migration_id(),
                                             " on node '", options_.self_name, "'"));
    }
    RETURN_IF_ERROR(Cache::CheckCopyPrefixCondition(seq.length(), seq.require_offset()));
    // Nothing stored below `length` (or at all): the receiver empties its destination.
    const std::optional<SequenceInfo> info = cache->GetSequence(seq.seq());
    // A CopyPrefix's precondition refuses here already, rather than answering `empty`;
    // OpenSequenceExport checks it again as it takes the data.
    if (seq.require_offset() > 0 && (!info.has_value() || info->offset < seq.require_offset())) {
      return absl::FailedPreconditionError(absl::StrCat(
          "sequence ", seq.seq(), " of cache '", request.cache(), "' has offset ",
          info.has_value() ? info->offset : 0, info.has_value() ? "" : " (it stores nothing)",
          " on node '", options_.self_name, "', below the required ", seq.require_offset()));
    }
    bool empty = !info.has_value();
    if (info.has_value() && seq.length() > 0) {
      empty = true;
      for (const GroupSequenceInfo& g : info->groups) {
        if ((g.first >= 0 && g.first < seq.length()) || g.state != StateStatus::kNone) {
          empty = false;
        }
      }
    }
    if (empty) {
      response.set_empty(true);
      return response;
    }
    // CopyPrefix of an Attention-only cache sends only the positions below `length`, so its
    // cost is the prefix's, whatever the source's length. Such a cache sends them straight from
    // the sequence's cells (pinned while the lease lasts); others through a snapshot.
    bool attention_only = true;
    for (const GroupSpec& g : cache->spec().groups) {
      if (g.kind != GroupKind::kAttention) attention_only = false;
    }
    const std::optional<int32_t> to =
        attention_only && seq.length() > 0 ? std::optional<int32_t>(seq.length()) : std::nullopt;
    // An incremental pull: the positions whose token ids the receiver holds exactly, as the
    // sequence does, stay out. Full attention only: a sliding or chunked group's receiver may
    // not hold the positions its ids cover. The receiver checks the ids again as it commits
    // (Cache::RestoreImport keeps_prefix), against those taken with the data.
    if (seq.have_token_ids_size() > kMaxHaveTokenIds) {
      return absl::InvalidArgumentError(absl::StrCat(
          "have_token_ids has ", seq.have_token_ids_size(), " ids, more than ", kMaxHaveTokenIds));
    }
    int32_t from = 0;
    if (to.has_value() && seq.have_token_ids_size() > 0 && AllFullAttention(cache->spec())) {
      const TokenChain chain = cache->Tokens(seq.seq());
      const int32_t limit =
          std::min({static_cast<int32_t>(seq.have_token_ids_size()), chain.exact(),
                    static_cast<int32_t>(chain.ids().size()), *to - 1, info->offset - 1});
      while (from < limit && chain.ids()[from] == seq.have_token_ids(from)) ++from;
    }
    reader = Cache::OpenSequenceExport(cache, seq.seq(), from, to, seq.require_offset());
  } else if (request.what_case() == v1::ExportRequest::kSnapshotId) {
    reader = cache->OpenSnapshotExport(request.snapshot_id());
  } else {
    return absl::InvalidArgumentError("what is missing: export a sequence or a snapshot_id");
  }
  if (!reader.ok()) return reader.status();
  *response.mutable_snapshot() = SnapshotInfoToProto((*reader)->info());
  auto payload = std::make_shared<ReaderPayload>(*std::move(reader));

  // grpc-stream checksums each chunk as it sends it; nccl checks the whole payload against
  // this one.
  if (request.transport() != transport::kGrpcStream) {
    uint32_t crc = 0;
    std::vector<uint8_t> piece;  // for bytes that are not in host memory
    for (size_t offset = 0; offset < payload->size();) {
      absl::Span<const uint8_t> bytes = payload->View(offset, kChecksumPiece);
      if (bytes.empty()) {
        piece.resize(std::min(kChecksumPiece, payload->size() - offset));
        RETURN_IF_ERROR(payload->ReadAt(offset, absl::MakeSpan(piece)));
        bytes = absl::MakeConstSpan(piece);
      }
      crc = transport::Crc32cExtend(crc, bytes);
      offset += bytes.size();
    }
    response.set_crc32c(crc);
  }
  absl::Duration ttl =
      request.lease_ms() == 0 ? options_.lease_time : absl::Milliseconds(request.lease_ms());
  ttl = std::min(ttl, options_.max_lease_time);
  const size_t bytes = payload->size();
  // The receiver is a member (checked above): its name is a bounded metrics label.
  ASSIGN_OR_RETURN(std::string id, leases_->Grant(std::move(payload), caller, ttl, nullptr,
                                                  request.transport(), request.receiver()));
  response.set_lease_id(std::move(id));
  response.set_payload_bytes(static_cast<int64_t>(bytes));
  response.set_lease_ms(absl::ToInt64Milliseconds(ttl));
  return response;
}

absl::Status Cluster::Release(const v1::ReleaseRequest& request, const std::string& caller,
                              std::function<void()> freed) {
  RETURN_IF_ERROR(leases_->CheckReceiver(request.lease_id(), caller));
  const absl::StatusOr<LeaseTable::Info> lease = leases_->Describe(request.lease_id());
  RETURN_IF_ERROR(leases_->Release(request.lease_id(), std::move(freed)));
  // The sender's view of the transfer: from the export to the receiver's verdict.
  if (options_.metrics != nullptr && lease.ok()) {
    options_.metrics->Transfer(lease->transport, lease->peer, "send",
                               request.committed() ? "OK" : "ABORTED", lease->payload_bytes,
                               absl::Now() - lease->granted);
  }
  return absl::OkStatus();
}

absl::Status Cluster::RemoveLocal(const v1::PeerRemoveRequest& request) {
  const v1::RemoveRequest& remove = request.remove();
  ASSIGN_OR_RETURN(const std::shared_ptr<Cache> cache, FindCache(request.tenant(), remove.cache()));
  const int64_t seqs[] = {remove.seq()};
  ASSIGN_OR_RETURN(const Reservations::Guard guard,
                   reservations_->BeginOperation(
                       Reservations::Kind::kSequence,
                       Reservations::Key(request.tenant(), remove.cache()), seqs, "Remove"));
  const std::optional<int32_t> end =
      remove.has_end() ? std::optional<int32_t>(remove.end()) : std::nullopt;
  return cache->Remove(remove.seq(), remove.begin(), end);
}

absl::StatusOr<v1::PlaceResponse> Cluster::Place(const v1::PlaceRequest& request) {
  if (request.tenant().empty() || request.tenant().find('/') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tenant = '", request.tenant(), "' is empty or malformed (it may not hold '/')"));
  }
  if (!request.has_spec()) return absl::InvalidArgumentError("spec is missing");
  ASSIGN_OR_RETURN(const CacheSpec spec, SpecFromProto(request.spec()));
  v1::PlaceResponse response;
  if (options_.gate != nullptr && options_.gate->draining()) {
    response.set_draining(true);
    return response;
  }
  absl::StatusOr<std::shared_ptr<Cache>> cache = registry_->Get(request.tenant(), spec.name);
  if (!cache.ok() && cache.status().code() != absl::StatusCode::kNotFound) return cache.status();
  if (!cache.ok() && request.create()) {
    DrainGate::Ticket admitted;
    if (options_.gate != nullptr) {
      ASSIGN_OR_RETURN(admitted, options_.gate->Admit(absl::StrCat("new cache '", spec.name, "'")));
    }
    const TenantQuota quota = options_.quota ? options_.quota(request.tenant()) : TenantQuota();
    ASSIGN_OR_RETURN(const CacheRegistry::CreateResult created,
                     registry_->Create(request.tenant(), spec, quota));
    response.set_created(created.created);
    cache = created.cache;
  }
  if (!cache.ok()) return response;  // neither here nor created
  if (!(spec == (*cache)->spec())) {
    return absl::FailedPreconditionError(
        absl::StrCat("cache '", spec.name, "' has another spec on node '", options_.self_name,
                     "': ", DescribeSpecDifference((*cache)->spec(), spec)));
  }
  response.set_exists(true);
  int64_t free_cells = -1;
  for (const GroupUsage& group : (*cache)->Usage().groups) {
    const int64_t free = group.cells_total - group.cells_used;
    if (free_cells < 0 || free < free_cells) free_cells = free;
  }
  response.set_free_cells(std::max<int64_t>(free_cells, 0));
  for (const SequenceInfo& s : (*cache)->ListSequences()) response.add_seqs(s.seq);
  return response;
}

absl::StatusOr<v1::PlaceResponse> Cluster::AskToPlace(const MemberAddress& target,
                                                      const v1::PlaceRequest& request,
                                                      absl::Time deadline) {
  std::unique_ptr<v1::PeerService::Stub> stub =
      v1::PeerService::NewStub(membership_->Channel(target));
  grpc::ClientContext context;
  SetDeadline(&context, std::min(deadline, absl::Now() + options_.control_timeout));
  v1::PlaceResponse response;
  const grpc::Status status = stub->Place(&context, request, &response);
  if (!status.ok()) return PeerError(status, target.name, "Place");
  return response;
}

// ---- receiver side -------------------------------------------------------------------------

absl::StatusOr<Cluster::Pulled> Cluster::PullInto(const std::string& tenant,
                                                  const std::shared_ptr<Cache>& cache,
                                                  const std::string& source,
                                                  const v1::ExportRequest& what,
                                                  absl::Time deadline,
                                                  std::optional<int64_t> into_seq, int32_t length) {
  const absl::Time start = absl::Now();
  ASSIGN_OR_RETURN(const MemberAddress member, FindPeer(source, "source_node"));
  ASSIGN_OR_RETURN(transport::Transport * transport, ChooseTransport(member, deadline));
  std::unique_ptr<v1::PeerService::Stub> stub =
      v1::PeerService::NewStub(membership_->Channel(member));

  v1::ExportRequest request = what;
  request.set_cache(cache->spec().name);
  request.set_tenant(tenant);
  *request.mutable_spec() = SpecToProto(cache->spec());
  request.set_receiver(options_.self_name);
  request.set_lease_ms(absl::ToInt64Milliseconds(options_.requested_lease_time));
  request.set_transport(transport->name());
  v1::ExportResponse exported;
  {
    grpc::ClientContext context;
    SetDeadline(&context, deadline);
    const grpc::Status status = stub->Export(&context, request, &exported);
    if (!status.ok()) return PeerError(status, source, "Export");
  }
  Pulled pulled;
  pulled.stats.set_transport(transport->name());
  if (exported.empty()) {
    pulled.empty = true;
    pulled.stats.set_micros(Micros(absl::Now() - start));
    return pulled;
  }
  auto release = [&](bool committed) {
    grpc::ClientContext context;
    SetDeadline(&context, std::min(deadline, absl::Now() + options_.control_timeout));
    v1::ReleaseRequest r;
    r.set_lease_id(exported.lease_id());
    r.set_committed(committed);
    v1::ReleaseResponse ignored;
    // A failed release costs the sender only until the lease expires.
    (void)stub->Release(&context, r, &ignored);
  };
  if (exported.payload_bytes() < 0) {
    release(false);
    return absl::DataLossError(absl::StrCat("Export on node '", source, "' announced ",
                                            exported.payload_bytes(), " payload bytes"));
  }
  if (into_seq.has_value()) {
    // The positions the restore will take, per group, as the sender counts them. A snapshot
    // that goes past `length` (a ring or a state cannot be cut) is restored in part: its cells
    // are left to Restore's own check.
    const v1::SnapshotInfo& info = exported.snapshot();
    std::vector<int64_t> positions(cache->spec().groups.size(), 0);
    if (length == 0 || info.to_offset() <= length) {
      for (const v1::SnapshotGroup& g : info.groups()) {
        if (g.group() >= 0 && static_cast<size_t>(g.group()) < positions.size()) {
          positions[g.group()] = g.stored();
        }
      }
    }
    const absl::Status room = cache->CheckRoomForSequence(
        *into_seq, positions, absl::StrCat("taking a sequence from node '", source, "'").c_str());
    if (!room.ok()) {
      release(false);
      return room;
    }
  }
  // A sequence pull is received straight into free cells where the cache lends them
  // (Cache::BeginSequenceImport); a snapshot pull becomes a snapshot.
  std::shared_ptr<SequenceImport> import;
  std::unique_ptr<SnapshotImportWriter> snapshot_writer;
  absl::Status begun;
  const size_t payload_bytes = static_cast<size_t>(exported.payload_bytes());
  if (into_seq.has_value()) {
    absl::StatusOr<std::unique_ptr<SequenceImport>> writer =
        Cache::BeginSequenceImport(cache, payload_bytes);
    begun = writer.status();
    if (writer.ok()) import = *std::move(writer);
  } else {
    absl::StatusOr<std::unique_ptr<SnapshotImportWriter>> writer =
        cache->BeginSnapshotImport(payload_bytes);
    begun = writer.status();
    if (writer.ok()) snapshot_writer = *std::move(writer);
  }
  if (!begun.ok()) {
    release(false);
    return begun;
  }
  SnapshotImportWriter* const sink = import != nullptr ? import.get() : snapshot_writer.get();
  transport::Lease lease;
  lease.sender_name = member.name;
  lease.sender_address = member.address;
  lease.id = exported.lease_id();
  lease.payload_bytes = static_cast<uint64_t>(exported.payload_bytes());
  lease.has_crc32c = exported.has_crc32c();
  lease.crc32c = exported.crc32c();
  const absl::Status moved = transport->Receive(
      lease, [sink](absl::Span<const uint8_t> bytes) { return sink->Write(bytes); }, deadline);
  if (options_.metrics != nullptr) {
    options_.metrics->Transfer(transport->name(), member.name, "receive",
                               absl::StatusCodeToString(moved.code()), lease.payload_bytes,
                               absl::Now() - start);
  }
  if (!moved.ok()) {
    release(false);
    return moved;  // the writer is dropped: nothing of it reaches the cache
  }
  absl::StatusOr<SnapshotInfo> committed = sink->Commit();
  release(committed.ok());
  if (!committed.ok()) return committed.status();
  pulled.snapshot = *std::move(committed);
  pulled.import = std::move(import);
  pulled.stats.set_bytes(exported.payload_bytes());
  pulled.stats.set_micros(Micros(absl::Now() - start));
  return pulled;
}

absl::Status Cluster::CommitSequence(const std::string& tenant, const std::shared_ptr<Cache>& cache,
                                     const Pulled& pulled, int64_t dst_seq, int32_t length,
                                     bool must_be_unused, const std::string& commit_key,
                                     const char* what, const DrainGate::Ticket& admitted,
                                     int32_t* offset, const std::optional<Retention>& retention) {
  // The imported snapshot goes whatever happens: it was only the payload's way in.
  struct DropPulled {
    const std::shared_ptr<Cache>& cache;
    const Pulled& pulled;
    ~DropPulled() {
      if (!pulled.empty && pulled.import == nullptr) (void)cache->DropSnapshot(pulled.snapshot.id);
    }
  } drop_pulled{cache, pulled};
  const int64_t dst[] = {dst_seq};
  ASSIGN_OR_RETURN(
      Reservations::Guard guard,
      reservations_->BeginOperation(Reservations::Kind::kSequence,
                                    Reservations::Key(tenant, cache->spec().name), dst, what));
  // A repeated migration that was committed already (its first reply was lost): done.
  if (!commit_key.empty() && Committed(commit_key)) return absl::OkStatus();
  // Checked again under the guard: the sequence may have started while the payload moved.
  if (must_be_unused) RETURN_IF_ERROR(CheckUnused(*cache, dst_seq));
  // Under the guard too: a sequence that stored something when the operation began may have
  // been drained away meanwhile; writing it now would start it again on a draining node. An
  // operation admitted before the drain began goes on: the drain waits for it.
  DrainGate::Ticket readmitted;
  if (options_.gate != nullptr) {
    ASSIGN_OR_RETURN(readmitted, options_.gate->Readmit(admitted, *cache, dst, what));
  }
  absl::Status committed;
  if (pulled.empty) {
    committed = cache->Remove(dst_seq, 0, std::nullopt);
  } else {
    const int32_t target = length > 0 ? std::min(length, pulled.snapshot.to) : pulled.snapshot.to;
    // A pull that left out a prefix dst holds (an incremental CopyPrefix) keeps dst's positions
    // below its start, if they are still what the sender's were.
    RestoreOptions options;
    options.keeps_prefix = true;
    options.retention = retention;
    committed = pulled.import != nullptr
                    ? cache->RestoreImport(dst_seq, *pulled.import, target, options)
                    : cache->Restore(dst_seq, pulled.snapshot.id, target, options);
  }
  if (committed.ok() && !commit_key.empty()) RememberCommitted(commit_key);
  if (committed.ok() && offset != nullptr) {
    const std::optional<SequenceInfo> info = cache->GetSequence(dst_seq);
    *offset = info.has_value() ? info->offset : 0;
  }
  return committed;
}

bool Cluster::Committed(const std::string& commit_key) const {
  ReaderMutexLock lock(&committed_mu_);
  return committed_.count(commit_key) > 0;
}

void Cluster::RememberCommitted(const std::string& commit_key) {
  MutexLock lock(&committed_mu_);
  if (!committed_.insert(commit_key).second) return;
  committed_order_.push_back(commit_key);
  if (committed_order_.size() > kCommittedMigrations) {
    committed_.erase(committed_order_.front());
    committed_order_.pop_front();
  }
}

absl::Status Cluster::CopyPrefixFrom(const std::string& tenant,
                                     const v1::CopyPrefixRequest& request, absl::Time deadline,
                                     v1::CopyPrefixResponse* response) {
  ASSIGN_OR_RETURN(const std::shared_ptr<Cache> cache, FindCache(tenant, request.cache()));
  if (request.src_seq() < 0 || request.dst_seq() < 0 || request.length() < 0 ||
      request.require_src_offset() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "src_seq = ", request.src_seq(), ", dst_seq = ", request.dst_seq(),
        ", length = ", request.length(), ", require_src_offset = ", request.require_src_offset(),
        ": none may be negative"));
  }
  RETURN_IF_ERROR(Cache::CheckCopyPrefixCondition(request.length(), request.require_src_offset()));
  // A new dst_seq is a new sequence here, which a draining node does not take; a drain that
  // begins while the payload moves waits for the copy.
  DrainGate::Ticket admitted;
  if (options_.gate != nullptr) {
    const int64_t dst[] = {request.dst_seq()};
    ASSIGN_OR_RETURN(admitted, options_.gate->AdmitWrite(*cache, dst, "CopyPrefix"));
  }
  v1::ExportRequest what;
  what.mutable_sequence()->set_seq(request.src_seq());
  what.mutable_sequence()->set_length(request.length());
  what.mutable_sequence()->set_require_offset(request.require_src_offset());
  // An incremental pull: the sender leaves out the first positions whose token ids dst holds
  // exactly, as src does.
  if (AllFullAttention(cache->spec())) {
    const TokenChain held = cache->Tokens(request.dst_seq());
    const int32_t n = std::min({held.exact(), static_cast<int32_t>(held.ids().size()),
                                request.length(), kMaxHaveTokenIds});
    what.mutable_sequence()->mutable_have_token_ids()->Add(held.ids().begin(),
                                                           held.ids().begin() + std::max(0, n));
  }
  // A cross-node CopyPrefix of length 0 copies nothing: dst is emptied, as locally (the
  // request was refused above if it also named a precondition).
  Pulled pulled;
  if (request.length() == 0) {
    pulled.empty = true;
    pulled.stats.set_transport(transport::kGrpcStream);
  } else {
    ASSIGN_OR_RETURN(pulled, PullInto(tenant, cache, request.source_node(), what, deadline,
                                      request.dst_seq(), request.length()));
  }
  int32_t offset = 0;
  RETURN_IF_ERROR(CommitSequence(tenant, cache, pulled, request.dst_seq(), request.length(),
                                 /*must_be_unused=*/false, /*commit_key=*/"", "CopyPrefix",
                                 admitted, &offset));
  *response->mutable_transfer() = pulled.stats;
  response->set_offset(offset);
  if (!pulled.empty) response->set_kept_positions(pulled.snapshot.from);
  return absl::OkStatus();
}

absl::Status Cluster::CheckUnused(const Cache& cache, int64_t seq) const {
  if (!cache.IsLive(seq)) return absl::OkStatus();
  return absl::AlreadyExistsError(absl::StrCat("sequence ", seq, " of cache '", cache.spec().name,
                                               "' already stores data on node '",
                                               options_.self_name, "'"));
}

void Cluster::CountMigration(const char* kind, const char* role, const absl::Status& status) const {
  if (options_.metrics == nullptr) return;
  options_.metrics->Migration(kind, role, absl::StatusCodeToString(status.code()));
}

absl::StatusOr<v1::PullResponse> Cluster::Pull(const v1::PullRequest& request,
                                               absl::Time deadline) {
  absl::StatusOr<v1::PullResponse> pulled = PullHere(request, deadline);
  CountMigration(request.has_sequence() ? "sequence" : "snapshot", "target", pulled.status());
  return pulled;
}

absl::StatusOr<v1::PullResponse> Cluster::PullHere(const v1::PullRequest& request,
                                                   absl::Time deadline) {
  // A sequence migration is known by its id and target: one committed here already (its reply
  // was lost, and the sender asks again) is answered as done, before anything else, also on a
  // node that has begun to drain since.
  const std::string commit_key =
      request.has_sequence() && !request.sequence().migration_id().empty()
          ? absl::StrCat(request.tenant(), "/", request.cache(), "/",
                         request.sequence().migration_id(), "->", request.target_seq())
          : "";
  if (!commit_key.empty() && Committed(commit_key)) {
    v1::PullResponse done;
    done.mutable_transfer()->set_transport("none (committed before)");
    return done;
  }
  // A draining node takes no data; the ticket makes a drain that starts meanwhile wait for
  // this pull, and then move what it brought.
  DrainGate::Ticket admitted;
  if (options_.gate != nullptr) {
    ASSIGN_OR_RETURN(admitted,
                     options_.gate->Admit(absl::StrCat("migrated data (a Pull from node '",
                                                       request.source_node().substr(0, 64), "')")));
  }
  ASSIGN_OR_RETURN(const std::shared_ptr<Cache> cache,
                   FindCache(request.tenant(), request.cache()));
  v1::ExportRequest what;
  v1::PullResponse response;
  if (request.has_sequence()) {
    if (request.target_seq() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("target_seq = ", request.target_seq(), " is negative"));
    }
    // Only Migrate asks a node to pull a sequence, and always for a migration the sender has
    // reserved; a Pull without one would let a caller overwrite any sequence here.
    if (request.sequence().migration_id().empty()) {
      return absl::InvalidArgumentError(
          "sequence.migration_id is empty: a Pull of a sequence belongs to a migration");
    }
    if (request.target_seq_unused()) RETURN_IF_ERROR(CheckUnused(*cache, request.target_seq()));
    std::optional<Retention> retention;
    if (request.has_retention()) {
      const v1::PeerRetention& r = request.retention();
      if (r.ttl_ms() < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("retention.ttl_ms = ", r.ttl_ms(), " is negative"));
      }
      retention = Retention{r.priority(), r.pinned(), absl::Milliseconds(r.ttl_ms())};
    }
    *what.mutable_sequence() = request.sequence();
    ASSIGN_OR_RETURN(const Pulled pulled,
                     PullInto(request.tenant(), cache, request.source_node(), what, deadline,
                              request.target_seq(), request.sequence().length()));
    RETURN_IF_ERROR(CommitSequence(request.tenant(), cache, pulled, request.target_seq(),
                                   request.sequence().length(), request.target_seq_unused(),
                                   commit_key, "Migrate", admitted, /*offset=*/nullptr, retention));
    PublishMigration(EventKind::kMigratedIn, request.tenant(), request.cache(),
                     request.target_seq(), request.source_node());
    *response.mutable_transfer() = pulled.stats;
    {
      MutexLock lock(&committed_mu_);
      if (lost_replies_ < options_.testing_lose_pull_replies) {
        ++lost_replies_;
        return absl::UnavailableError(absl::StrCat("testing: node '", options_.self_name,
                                                   "' committed the migration but loses this "
                                                   "reply (--testing-lose-pull-replies)"));
      }
    }
  } else if (request.what_case() == v1::PullRequest::kSnapshotId) {
    what.set_snapshot_id(request.snapshot_id());
    ASSIGN_OR_RETURN(const Pulled pulled,
                     PullInto(request.tenant(), cache, request.source_node(), what, deadline));
    if (pulled.empty) return absl::DataLossError("the sender exported an empty snapshot");
    *response.mutable_snapshot() = SnapshotInfoToProto(pulled.snapshot);
    *response.mutable_transfer() = pulled.stats;
  } else {
    return absl::InvalidArgumentError("what is missing: pull a sequence or a snapshot_id");
  }
  return response;
}

// ---- migrations ------------------------------------------------------------------------------

void Cluster::PublishMigration(EventKind kind, const std::string& tenant, const std::string& cache,
                               int64_t seq, const std::string& peer) {
  if (options_.events == nullptr) return;
  Event event;
  event.kind = kind;
  event.tenant = tenant;
  event.cache = cache;
  event.seq = seq;
  event.peer = peer;
  options_.events->Publish(std::move(event));
}

absl::StatusOr<v1::MigrateResponse> Cluster::Migrate(const std::string& tenant,
                                                     const v1::MigrateRequest& request,
                                                     absl::Time deadline, bool target_seq_unused,
                                                     const std::string& migration_id) {
  absl::StatusOr<v1::MigrateResponse> migrated =
      MigrateSequence(tenant, request, deadline, target_seq_unused, migration_id);
  CountMigration("sequence", "source", migrated.status());
  return migrated;
}

absl::StatusOr<v1::MigrateResponse> Cluster::MigrateSequence(const std::string& tenant,
                                                             const v1::MigrateRequest& request,
                                                             absl::Time deadline,
                                                             bool target_seq_unused,
                                                             const std::string& migration_id) {
  ASSIGN_OR_RETURN(const std::shared_ptr<Cache> cache, FindCache(tenant, request.cache()));
  if (request.seq() < 0 || request.target_seq() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("seq = ", request.seq(),
                                                   ", target_seq = ", request.target_seq(),
                                                   ": neither may be negative"));
  }
  ASSIGN_OR_RETURN(const MemberAddress target, FindPeer(request.target_node(), "target_node"));
  if (!cache->IsLive(request.seq())) {
    return absl::NotFoundError(absl::StrCat("sequence ", request.seq(), " of cache '",
                                            request.cache(), "' stores nothing on node '",
                                            options_.self_name, "'"));
  }
  ASSIGN_OR_RETURN(Reservations::Guard reservation,
                   reservations_->Reserve(Reservations::Kind::kSequence,
                                          Reservations::Key(tenant, request.cache()), request.seq(),
                                          target.name, deadline));
  v1::PullRequest pull;
  pull.set_cache(request.cache());
  pull.set_tenant(tenant);
  pull.set_source_node(options_.self_name);
  pull.mutable_sequence()->set_seq(request.seq());
  pull.mutable_sequence()->set_migration_id(
      !migration_id.empty() ? migration_id
                            : absl::StrCat(options_.self_name, "/", request.cache(), "/",
                                           request.seq(), "@", absl::ToUnixNanos(absl::Now())));
  pull.set_target_seq(request.target_seq());
  pull.set_target_seq_unused(target_seq_unused);
  // The sequence keeps its retention where it goes (read once reserved, from when SetRetention
  // of it is ABORTED here).
  if (const std::optional<SequenceInfo> info = cache->GetSequence(request.seq());
      info.has_value()) {
    v1::PeerRetention* retention = pull.mutable_retention();
    retention->set_priority(info->priority);
    retention->set_pinned(info->pinned);
    retention->set_ttl_ms(absl::ToInt64Milliseconds(info->ttl));
  }
  ASSIGN_OR_RETURN(const v1::PullResponse pulled, AskToPull(target, pull, deadline));
  PublishMigration(EventKind::kMigratedOut, tenant, request.cache(), request.seq(), target.name);
  // The target has committed: the sequence now lives there, and room reserved for it here
  // would only hold a slot and cells back from others until its TTL.
  if (!request.keep_source()) {
    RETURN_IF_ERROR(cache->Remove(request.seq(), 0, std::nullopt));
    (void)cache->Reserve(request.seq(), 0, absl::Now());  // a no-op unless reserved
  }
  v1::MigrateResponse response;
  *response.mutable_transfer() = pulled.transfer();
  return response;
}

absl::StatusOr<v1::PullResponse> Cluster::AskToPull(const MemberAddress& target,
                                                    const v1::PullRequest& pull,
                                                    absl::Time deadline) {
  std::unique_ptr<v1::PeerService::Stub> stub =
      v1::PeerService::NewStub(membership_->Channel(target));
  grpc::ClientContext context;
  SetDeadline(&context, deadline);
  v1::PullResponse pulled;
  const grpc::Status status = stub->Pull(&context, pull, &pulled);
  if (!status.ok()) return PeerError(status, target.name, "Pull");
  return pulled;
}

absl::StatusOr<v1::MigrateSnapshotResponse> Cluster::MigrateSnapshot(
    const std::string& tenant, const v1::MigrateSnapshotRequest& request, absl::Time deadline) {
  absl::StatusOr<v1::MigrateSnapshotResponse> migrated =
      MigrateOneSnapshot(tenant, request, deadline);
  CountMigration("snapshot", "source", migrated.status());
  return migrated;
}

absl::StatusOr<v1::MigrateSnapshotResponse> Cluster::MigrateOneSnapshot(
    const std::string& tenant, const v1::MigrateSnapshotRequest& request, absl::Time deadline) {
  ASSIGN_OR_RETURN(const std::shared_ptr<Cache> cache, FindCache(tenant, request.cache()));
  ASSIGN_OR_RETURN(const MemberAddress target, FindPeer(request.target_node(), "target_node"));
  bool known = false;
  for (const SnapshotInfo& s : cache->ListSnapshots()) known |= s.id == request.snapshot_id();
  if (!known) {
    return absl::NotFoundError(absl::StrCat("snapshot ", request.snapshot_id(), " of cache '",
                                            request.cache(), "' does not exist on node '",
                                            options_.self_name, "'"));
  }
  ASSIGN_OR_RETURN(Reservations::Guard reservation,
                   reservations_->Reserve(
                       Reservations::Kind::kSnapshot, Reservations::Key(tenant, request.cache()),
                       static_cast<int64_t>(request.snapshot_id()), target.name, deadline));
  v1::PullRequest pull;
  pull.set_cache(request.cache());
  pull.set_tenant(tenant);
  pull.set_source_node(options_.self_name);
  pull.set_snapshot_id(request.snapshot_id());
  ASSIGN_OR_RETURN(const v1::PullResponse pulled, AskToPull(target, pull, deadline));
  if (!request.keep_source()) RETURN_IF_ERROR(cache->DropSnapshot(request.snapshot_id()));
  v1::MigrateSnapshotResponse response;
  *response.mutable_snapshot() = pulled.snapshot();
  *response.mutable_transfer() = pulled.transfer();
  return response;
}

absl::StatusOr<v1::RemoveResponse> Cluster::RemoveEverywhere(
    const std::string& tenant, const v1::RemoveRequest& request, absl::Time deadline,
    const std::function<absl::Status()>& local) {
  const std::vector<MemberAddress> peers = membership_->Peers();
  std::vector<std::future<absl::Status>> results;
  results.reserve(peers.size());
  for (const MemberAddress& peer : peers) {
    results.push_back(std::async(std::launch::async, [this, &request, &tenant, deadline, peer] {
      std::unique_ptr<v1::PeerService::Stub> stub =
          v1::PeerService::NewStub(membership_->Channel(peer));
      v1::PeerRemoveRequest one;
      *one.mutable_remove() = request;
      one.mutable_remove()->set_scope(v1::REMOVE_SCOPE_LOCAL);
      one.set_tenant(tenant);
      grpc::ClientContext context;
      SetDeadline(&context, deadline);
      v1::PeerRemoveResponse ignored;
      return FromGrpcStatus(stub->Remove(&context, one, &ignored));
    }));
  }
  v1::RemoveResponse response;
  auto add = [&response](const std::string& node, const absl::Status& status) {
    v1::NodeResult* result = response.add_nodes();
    result->set_node(node);
    result->set_code(static_cast<int>(status.code()));
    result->set_message(std::string(status.message()));
  };
  add(options_.self_name, local());
  for (size_t i = 0; i < peers.size(); ++i) add(peers[i].name, results[i].get());
  return response;
}

}  // namespace kvmesh

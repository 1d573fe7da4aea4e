// Seeds of rpc_fuzzer: sessions of valid calls against the baseline of rpc_format.h, one per
// area of the API, so that mutations start from requests that reach the engine and the cluster.
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cache/spec.h"
#include "cache/status_macros.h"
#include "kvmesh/v1/kvmesh.pb.h"
#include "kvmesh/v1/peer.pb.h"
#include "service/common/convert.h"
#include "tests/fuzz/fuzz_support.h"
#include "tests/fuzz/rpc_format.h"
#include "tests/fuzz/seeds.h"

namespace kvmesh {
namespace fuzz {
namespace {

v1::CacheSpec BaselineSpec(const std::string& name) {
  for (const v1::CacheSpec& s : BaselineSpecs()) {
    if (s.name() == name) return s;
  }
  Fail(absl::StrCat("no baseline cache '", name, "'"));
}

// An Append of `seq` at positions [begin, end) of cache `name` with a payload of the right size.
absl::StatusOr<v1::AppendRequest> MakeAppend(const v1::CacheSpec& proto, int64_t seq, int32_t begin,
                                             int32_t end, bool speculative) {
  ASSIGN_OR_RETURN(CacheSpec spec, SpecFromProto(proto));
  v1::AppendRequest r;
  r.set_cache(proto.name());
  for (int32_t p = begin; p < end; ++p) {
    v1::Token* t = r.add_tokens();
    t->set_seq(seq);
    t->set_pos(p);
  }
  r.set_payload(PrefillPayload(spec, end - begin, 9));
  if (speculative) {
    r.set_speculative(true);
    r.set_payload(std::string(AppendPayloadBytes(spec, end - begin, 1, true), '\x11'));
  }
  return r;
}

template <typename Message>
Message WithCache(const std::string& cache) {
  Message m;
  m.set_cache(cache);
  return m;
}

}  // namespace

absl::Status RpcSeeds(std::vector<Seed>* out) {
  auto add = [&](const std::string& name, const std::string& input) {
    out->push_back(Seed{"rpc_fuzzer", name, input});
  };
  const v1::CacheSpec attn = BaselineSpec("attn");
  const v1::CacheSpec hybrid = BaselineSpec("hybrid");

  {  // A cache's life: create, append, read, inspect, delete.
    std::string in;
    v1::CreateCacheRequest create;
    *create.mutable_spec() = attn;
    create.mutable_spec()->set_name("new");
    AppendRecord(&in, Rpc::kCreateCache, create);
    v1::CacheSpec spec = create.spec();
    ASSIGN_OR_RETURN(v1::AppendRequest append, MakeAppend(spec, 0, 0, 4, false));
    AppendRecord(&in, Rpc::kAppend, append);
    v1::ReadRequest read = WithCache<v1::ReadRequest>("new");
    read.set_max_chunk_bytes(24);
    AppendRecord(&in, Rpc::kRead, read);
    AppendRecord(&in, Rpc::kGetCache, WithCache<v1::GetCacheRequest>("new"));
    AppendRecord(&in, Rpc::kListCaches, v1::ListCachesRequest());
    AppendRecord(&in, Rpc::kListSequences, WithCache<v1::ListSequencesRequest>("new"));
    AppendRecord(&in, Rpc::kDeleteCache, WithCache<v1::DeleteCacheRequest>("new"));
    add("cache-life", in);
  }
  {  // Attention data: append, read a range, visibility, forks, removal with a RoPE shift.
    std::string in;
    ASSIGN_OR_RETURN(v1::AppendRequest append, MakeAppend(attn, 0, 6, 9, false));
    AppendRecord(&in, Rpc::kAppend, append);
    v1::ReadRequest read = WithCache<v1::ReadRequest>("attn");
    read.set_begin(2);
    read.set_end(7);
    AppendRecord(&in, Rpc::kRead, read);
    v1::VisibleRequest visible = WithCache<v1::VisibleRequest>("attn");
    for (int pos : {0, 4, 8}) {
      v1::Query* q = visible.add_queries();
      q->set_seq(0);
      q->set_pos(pos);
    }
    visible.add_queries()->set_seq(1);
    AppendRecord(&in, Rpc::kVisible, visible);
    visible.set_as_ranges(true);
    AppendRecord(&in, Rpc::kVisible, visible);
    v1::CopyPrefixRequest copy = WithCache<v1::CopyPrefixRequest>("attn");
    copy.set_src_seq(0);
    copy.set_dst_seq(2);
    copy.set_length(5);
    AppendRecord(&in, Rpc::kCopyPrefix, copy);
    v1::RemoveRequest remove = WithCache<v1::RemoveRequest>("attn");
    remove.set_seq(2);
    remove.set_begin(1);
    remove.set_end(3);
    AppendRecord(&in, Rpc::kRemove, remove);
    v1::CanResumeRequest resume = WithCache<v1::CanResumeRequest>("attn");
    resume.set_seq(2);
    resume.set_pos(3);
    AppendRecord(&in, Rpc::kCanResume, resume);
    AppendRecord(&in, Rpc::kListSequences, WithCache<v1::ListSequencesRequest>("attn"));
    add("attention-data", in);
  }
  {  // Snapshots: take, restore, merge, split, drop, list.
    std::string in;
    v1::SnapshotRequest snapshot = WithCache<v1::SnapshotRequest>("attn");
    snapshot.set_seq(1);
    AppendRecord(&in, Rpc::kSnapshot, snapshot);  // id 2: [0, 3)
    ASSIGN_OR_RETURN(v1::AppendRequest append, MakeAppend(attn, 1, 3, 5, false));
    AppendRecord(&in, Rpc::kAppend, append);
    snapshot.set_from_offset(3);
    AppendRecord(&in, Rpc::kSnapshot, snapshot);  // id 3: [3, 5)
    v1::MergeSnapshotsRequest merge = WithCache<v1::MergeSnapshotsRequest>("attn");
    merge.set_parent(2);
    merge.set_child(3);
    AppendRecord(&in, Rpc::kMergeSnapshots, merge);  // id 4: [0, 5)
    v1::SplitSnapshotRequest split = WithCache<v1::SplitSnapshotRequest>("attn");
    split.set_snapshot_id(4);
    split.set_at(2);
    AppendRecord(&in, Rpc::kSplitSnapshot, split);
    v1::RestoreRequest restore = WithCache<v1::RestoreRequest>("attn");
    restore.set_seq(3);
    restore.set_snapshot_id(1);
    restore.set_target(4);
    AppendRecord(&in, Rpc::kRestore, restore);
    restore.set_seq(0);
    restore.clear_snapshot_id();
    restore.set_target(2);
    AppendRecord(&in, Rpc::kRestore, restore);
    v1::DropSnapshotRequest drop = WithCache<v1::DropSnapshotRequest>("attn");
    drop.set_snapshot_id(1);
    AppendRecord(&in, Rpc::kDropSnapshot, drop);
    AppendRecord(&in, Rpc::kListSnapshots, WithCache<v1::ListSnapshotsRequest>("attn"));
    add("snapshots", in);
  }
  {  // Speculation: pending tokens, then a commit of part of them.
    std::string in;
    ASSIGN_OR_RETURN(v1::AppendRequest append, MakeAppend(attn, 1, 3, 6, true));
    AppendRecord(&in, Rpc::kAppend, append);
    v1::CommitSpeculationRequest commit = WithCache<v1::CommitSpeculationRequest>("attn");
    commit.set_seq(1);
    commit.set_accepted(2);
    AppendRecord(&in, Rpc::kCommitSpeculation, commit);
    ASSIGN_OR_RETURN(append, MakeAppend(hybrid, 0, 5, 7, true));
    AppendRecord(&in, Rpc::kAppend, append);
    commit = WithCache<v1::CommitSpeculationRequest>("hybrid");
    commit.set_accepted(1);
    AppendRecord(&in, Rpc::kCommitSpeculation, commit);
    add("speculation", in);
  }
  {  // AppendStream: a header, then the payload in two messages.
    std::string in;
    ASSIGN_OR_RETURN(v1::AppendRequest append, MakeAppend(hybrid, 0, 5, 8, false));
    std::vector<v1::AppendStreamRequest> stream(3);
    v1::AppendHeader* header = stream[0].mutable_header();
    header->set_cache("hybrid");
    *header->mutable_tokens() = append.tokens();
    header->set_payload_bytes(static_cast<int64_t>(append.payload().size()));
    const size_t half = append.payload().size() / 2;
    stream[1].set_data(append.payload().substr(0, half));
    stream[2].set_data(append.payload().substr(half));
    AppendStreamRecord(&in, stream);
    v1::ReadRequest read = WithCache<v1::ReadRequest>("hybrid");
    AppendRecord(&in, Rpc::kRead, read);
    v1::VisibleRequest visible = WithCache<v1::VisibleRequest>("hybrid");
    visible.set_group(1);
    v1::Query* q = visible.add_queries();
    q->set_pos(7);
    q->set_non_causal(true);
    AppendRecord(&in, Rpc::kVisible, visible);
    v1::RemoveRequest remove = WithCache<v1::RemoveRequest>("hybrid");  // all of sequence 0
    AppendRecord(&in, Rpc::kRemove, remove);
    add("append-stream", in);
  }
  {  // The cluster: copy from b, migrate to b, remove everywhere, members.
    std::string in;
    v1::CopyPrefixRequest copy = WithCache<v1::CopyPrefixRequest>("attn");
    copy.set_src_seq(0);
    copy.set_dst_seq(3);
    copy.set_length(4);
    copy.set_source_node(kNodeB);
    AppendRecord(&in, Rpc::kCopyPrefix, copy);
    v1::MigrateRequest migrate = WithCache<v1::MigrateRequest>("attn");
    migrate.set_seq(1);
    migrate.set_target_node(kNodeB);
    migrate.set_target_seq(2);
    AppendRecord(&in, Rpc::kMigrate, migrate);
    v1::MigrateSnapshotRequest snapshot = WithCache<v1::MigrateSnapshotRequest>("hybrid");
    snapshot.set_snapshot_id(1);
    snapshot.set_target_node(kNodeB);
    snapshot.set_keep_source(true);
    AppendRecord(&in, Rpc::kMigrateSnapshot, snapshot);
    v1::RemoveRequest remove = WithCache<v1::RemoveRequest>("attn");
    remove.set_seq(0);
    remove.set_begin(4);
    remove.set_scope(v1::REMOVE_SCOPE_CLUSTER);
    AppendRecord(&in, Rpc::kRemove, remove);
    AppendRecord(&in, Rpc::kListMembers, v1::ListMembersRequest());
    add("cluster", in);
  }
  {  // The peer plane as node b uses it: export, fetch, release; pull; nccl refused.
    std::string in;
    AppendRecord(&in, Rpc::kNodeInfo, v1::NodeInfoRequest());
    v1::ExportRequest exported;
    exported.set_cache("attn");
    *exported.mutable_spec() = attn;
    exported.set_receiver(kNodeB);
    exported.mutable_sequence()->set_seq(0);
    exported.mutable_sequence()->set_length(4);
    exported.set_transport("grpc-stream");
    exported.set_tenant("default");
    AppendRecord(&in, Rpc::kExport, exported);
    exported.clear_sequence();
    exported.set_snapshot_id(1);
    exported.set_lease_ms(5000);
    AppendRecord(&in, Rpc::kExport, exported);
    v1::FetchRequest fetch;  // lease "": the first lease of the session (rpc_fuzzer.cc, MapLease)
    fetch.set_chunk_bytes(64);
    AppendRecord(&in, Rpc::kFetch, fetch);
    fetch.set_lease_id(std::string(1, '\1'));  // the second
    fetch.set_offset(40);
    AppendRecord(&in, Rpc::kFetch, fetch);
    v1::ReleaseRequest release;
    release.set_committed(true);
    AppendRecord(&in, Rpc::kRelease, release);
    v1::NcclSendRequest send;
    send.set_to_node(kNodeB);
    send.set_generation(1);
    AppendRecord(&in, Rpc::kNcclSend, send);
    v1::NcclConnectRequest connect;
    connect.set_from_node(kNodeB);
    connect.set_unique_id(std::string(128, '\0'));
    AppendRecord(&in, Rpc::kNcclConnect, connect);
    add("peer-export", in);
  }
  {  // Tenants: each sees its own caches; the refused callers change nothing.
    std::string in;
    AppendRecord(&in, Rpc::kListCaches, v1::ListCachesRequest(), Principal::kTenant1);
    ASSIGN_OR_RETURN(v1::AppendRequest append, MakeAppend(attn, 1, 3, 5, false));
    AppendRecord(&in, Rpc::kAppend, append, Principal::kTenant1);
    AppendRecord(&in, Rpc::kRead, WithCache<v1::ReadRequest>("attn"), Principal::kTenant2);
    v1::CreateCacheRequest create;
    *create.mutable_spec() = hybrid;
    AppendRecord(&in, Rpc::kCreateCache, create, Principal::kTenant2);
    create.mutable_spec()->set_name("second");
    AppendRecord(&in, Rpc::kCreateCache, create, Principal::kTenant2);  // over t2's quota
    AppendRecord(&in, Rpc::kDeleteCache, WithCache<v1::DeleteCacheRequest>("attn"),
                 Principal::kAnonymous);
    AppendRecord(&in, Rpc::kGetCache, WithCache<v1::GetCacheRequest>("attn"),
                 Principal::kUnknownToken);
    AppendRecord(&in, Rpc::kListSequences, WithCache<v1::ListSequencesRequest>("attn"),
                 Principal::kTenant1AsOther);
    v1::CopyPrefixRequest copy = WithCache<v1::CopyPrefixRequest>("attn");
    copy.set_dst_seq(2);
    copy.set_length(4);
    copy.set_source_node(kNodeB);
    AppendRecord(&in, Rpc::kCopyPrefix, copy, Principal::kAdminAsTenant1);
    AppendRecord(&in, Rpc::kListMembers, v1::ListMembersRequest(), Principal::kTenant1);
    add("tenants", in);
  }
  {  // Node b asks a to pull from it (the target side of Migrate and MigrateSnapshot).
    std::string in;
    v1::PullRequest pull;
    pull.set_cache("hybrid");
    pull.set_source_node(kNodeB);
    pull.set_snapshot_id(1);
    pull.set_tenant("default");
    AppendRecord(&in, Rpc::kPull, pull);
    pull.mutable_sequence()->set_seq(0);
    pull.mutable_sequence()->set_migration_id("m1");
    pull.set_target_seq(2);
    AppendRecord(&in, Rpc::kPull, pull);
    v1::PeerRemoveRequest remove;
    remove.mutable_remove()->set_cache("attn");
    remove.mutable_remove()->set_seq(1);
    remove.mutable_remove()->set_begin(1);
    remove.set_tenant("t1");
    AppendRecord(&in, Rpc::kPeerRemove, remove);
    add("peer-pull", in);
  }
  {  // Retention, room and prefixes: keep a sequence, reserve room, look up the shared prefix,
     // migrate the kept sequence (its retention goes along); the peer plane's lookup and Place.
    std::string in;
    v1::SetRetentionRequest keep = WithCache<v1::SetRetentionRequest>("attn");
    keep.set_seq(0);
    keep.set_priority(2);
    keep.set_pinned(true);
    keep.set_ttl_ms(60000);
    AppendRecord(&in, Rpc::kSetRetention, keep);
    v1::ReserveRequest reserve = WithCache<v1::ReserveRequest>("attn");
    reserve.set_seq(3);
    reserve.set_positions(4);
    AppendRecord(&in, Rpc::kReserve, reserve);
    v1::LookupPrefixRequest lookup = WithCache<v1::LookupPrefixRequest>("attn");
    for (int32_t p = 0; p < 6; ++p) lookup.add_tokens(BaselineTokenId(p));
    lookup.set_max_matches(4);
    AppendRecord(&in, Rpc::kLookupPrefix, lookup);
    AppendRecord(&in, Rpc::kLookupPrefix, lookup, Principal::kTenant1);
    v1::MigrateRequest migrate = WithCache<v1::MigrateRequest>("attn");
    migrate.set_seq(0);
    migrate.set_target_node(kNodeB);
    migrate.set_target_seq(2);
    AppendRecord(&in, Rpc::kMigrate, migrate);
    v1::PeerLookupPrefixRequest peer_lookup;
    *peer_lookup.mutable_lookup() = lookup;
    peer_lookup.set_tenant("t1");
    AppendRecord(&in, Rpc::kPeerLookupPrefix, peer_lookup);
    v1::PlaceRequest place;
    place.set_tenant("default");
    *place.mutable_spec() = attn;
    AppendRecord(&in, Rpc::kPlace, place);
    place.mutable_spec()->set_name("placed");
    place.set_create(true);
    AppendRecord(&in, Rpc::kPlace, place);
    add("retention-lookup", in);
  }
  return absl::OkStatus();
}

}  // namespace fuzz
}  // namespace kvmesh

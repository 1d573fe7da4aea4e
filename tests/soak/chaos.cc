// Client: chaos operations on the caches every client shares (see client.h). Their outcomes
// depend on the other clients, so only the status (against the codes the operation may return,
// docs/api.md) and the shape of the answer are checked.
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/integration/client_util.h"
#include "tests/soak/client.h"
#include "tests/testing/pattern.h"

namespace kvmesh {
namespace soak {
namespace {

using grpc::StatusCode;

constexpr int64_t kChaosSeqIds = 20;  // more than the chaos caches' max_sequences (16)
constexpr int kScratchCaches = 4;

// Codes every chaos call may see: the cache may have been deleted by another client. Not
// UNAVAILABLE: chaos calls are honest too, the nodes are up and their queues far from full.
Codes With(Codes codes) {
  codes.push_back(StatusCode::NOT_FOUND);
  return codes;
}

// Cross-node calls may also meet a slow peer.
Codes Remote(Codes codes) {
  codes = With(std::move(codes));
  codes.push_back(StatusCode::DEADLINE_EXCEEDED);
  return codes;
}

const Codes kMutation = {StatusCode::OK, StatusCode::INVALID_ARGUMENT,
                         StatusCode::FAILED_PRECONDITION, StatusCode::RESOURCE_EXHAUSTED,
                         StatusCode::ABORTED};

}  // namespace

int32_t& Client::Hint(const std::string& cache, int node, int64_t seq) {
  return hints_[{cache, node, seq}];
}

std::string Client::CheckReadShape(const v1::CacheSpec& proto, const v1::ReadHeader& header,
                                   size_t payload_size) {
  const CacheSpec spec = testutil::EngineSpec(proto);
  if (header.groups_size() != static_cast<int>(spec.groups.size())) {
    return absl::StrCat("header has ", header.groups_size(), " groups");
  }
  int64_t bytes = 0;
  for (int g = 0; g < header.groups_size(); ++g) {
    const v1::GroupPositions& group = header.groups(g);
    if (!std::is_sorted(group.positions().begin(), group.positions().end()) ||
        std::adjacent_find(group.positions().begin(), group.positions().end()) !=
            group.positions().end()) {
      return absl::StrCat("group ", g, " positions are not strictly ascending");
    }
    if (spec.groups[g].kind == GroupKind::kRecurrent) {
      if (group.state() == v1::STATE_STATUS_VALID) {
        bytes += static_cast<int64_t>(spec.groups[g].num_layers) *
                 testutil::StateLayerBytes(spec, 0, g, 0).size();
      }
      continue;
    }
    bytes += static_cast<int64_t>(group.positions_size()) * spec.groups[g].num_layers *
             (testutil::KRowElements(spec, g) + testutil::VRowElements(spec, g)) *
             testutil::ElementBytes(spec.dtype);
  }
  if (header.payload_bytes() != bytes || static_cast<int64_t>(payload_size) != bytes) {
    return absl::StrCat("payload_bytes ", header.payload_bytes(), ", data ", payload_size,
                        ", header positions make ", bytes);
  }
  return "";
}

void Client::ChaosAppend(const v1::CacheSpec& spec, int node, int64_t seq, bool stream) {
  const bool speculative = Chance(15);
  const std::string kind =
      absl::StrCat("c:", stream ? "AppendStream" : "Append", speculative ? ".speculative" : "");
  int32_t& hint = Hint(spec.name(), node, seq);
  const int32_t count = RandIn(1, std::min<int32_t>(16, spec.max_batch()));
  std::vector<int32_t> positions;
  for (int32_t i = 0; i < count; ++i) positions.push_back(hint + i);
  const uint64_t seed = NextSeed();
  const v1::AppendRequest request =
      speculative ? testutil::MakeSpeculativeAppend(spec, seq, positions, seed)
                  : testutil::MakeAppend(spec, seq, positions, seed);
  v1::AppendResponse response;
  grpc::Status s;
  if (stream) {
    const std::vector<v1::AppendStreamRequest> messages =
        testutil::StreamMessages(request, Rand(64), 1 + Rand(4096));
    s = Rpc(kind, [&](grpc::ClientContext* c) {
      auto writer = cache_[node]->AppendStream(c, &response);
      for (const v1::AppendStreamRequest& m : messages) {
        if (!writer->Write(m)) break;
      }
      writer->WritesDone();
      return writer->Finish();
    });
  } else {
    s = Rpc(kind,
            [&](grpc::ClientContext* c) { return cache_[node]->Append(c, request, &response); });
  }
  Expect(kind, s, With(kMutation),
         absl::StrCat("append [", hint, ", ", hint + count, ") to seq ", seq, " of ", spec.name(),
                      " on ", Where(node)));
  if (s.ok()) {
    hint += count;
  } else if (s.error_code() == StatusCode::INVALID_ARGUMENT) {
    hint = 0;  // another client moved it; ListSequences will tell
  }
}

void Client::ChaosRead(const v1::CacheSpec& spec, int node, int64_t seq) {
  const std::string kind = "c:Read";
  v1::ReadRequest request;
  request.set_cache(spec.name());
  request.set_seq(seq);
  request.set_begin(Chance(50) ? 0 : RandIn(0, Hint(spec.name(), node, seq)));
  if (Chance(40)) request.set_end(request.begin() + RandIn(0, 40));
  request.set_max_chunk_bytes(Chance(50) ? 0 : RandIn(256, 8192));
  v1::ReadHeader header;
  size_t payload = 0;
  const grpc::Status s = Rpc(kind, [&](grpc::ClientContext* c) {
    auto reader = cache_[node]->Read(c, request);
    v1::ReadResponse message;
    bool first = true;
    while (reader->Read(&message)) {
      if (first) header = message.header();
      first = false;
      payload += message.data().size();
    }
    return reader->Finish();
  });
  const std::string what = absl::StrCat("read seq ", seq, " of ", spec.name(), " on ", Where(node));
  if (!Expect(kind, s, With({StatusCode::OK}), what) || !s.ok()) return;
  const std::string diff = CheckReadShape(spec, header, payload);
  if (!diff.empty()) Fail(kind, absl::StrCat(what, ": ", diff));
}

void Client::ChaosScratch(int node) {
  const std::string name = absl::StrCat("soak-scratch-", Rand(kScratchCaches));
  if (Chance(50)) {
    v1::DeleteCacheRequest request;
    request.set_cache(name);
    v1::DeleteCacheResponse response;
    const grpc::Status s = Rpc("c:DeleteCache.scratch", [&](grpc::ClientContext* c) {
      return cache_[node]->DeleteCache(c, request, &response);
    });
    Expect("c:DeleteCache.scratch", s, {StatusCode::OK, StatusCode::NOT_FOUND},
           absl::StrCat("delete ", name, " on ", Where(node)));
    return;
  }
  // Up to an eighth of the memory budget each: the budget runs out only when most scratch
  // caches exist at once. Sometimes one larger than the whole budget.
  testutil::AttentionOptions a;
  a.num_layers = RandIn(1, 4);
  a.num_kv_heads = RandIn(1, 4);
  a.head_dim_k = 64;
  a.head_dim_v = 64;
  const int64_t token_bytes = int64_t{a.num_layers} * a.num_kv_heads * 128 * 2;
  const int64_t budget = shared_->options.memory_budget;
  const int64_t cells = Chance(10) ? budget / token_bytes + 1024
                                   : static_cast<int64_t>(Rand(budget / 8 / token_bytes)) + 1;
  const int32_t max_sequences = RandIn(1, 8);
  const v1::CacheSpec spec = testutil::SpecProto(
      name, max_sequences, static_cast<int32_t>(std::max<int64_t>(1, cells / max_sequences)), 16,
      {testutil::AttentionGroupProto(a)}, v1::DTYPE_F16);
  v1::CreateCacheRequest request;
  *request.mutable_spec() = spec;
  v1::CreateCacheResponse response;
  const grpc::Status s = Rpc("c:CreateCache.scratch", [&](grpc::ClientContext* c) {
    return cache_[node]->CreateCache(c, request, &response);
  });
  // ALREADY_EXISTS: another client made this name with another shape.
  Expect("c:CreateCache.scratch", s,
         {StatusCode::OK, StatusCode::RESOURCE_EXHAUSTED, StatusCode::ALREADY_EXISTS},
         absl::StrCat("create ", name, " (", cells, " cells) on ", Where(node)));
}

void Client::Chaos() {
  const bool hybrid = Chance(50);
  const v1::CacheSpec& spec = hybrid ? shared_->chaos_hybrid_spec : shared_->chaos_attention_spec;
  const std::string& cache = spec.name();
  const int n = static_cast<int>(Rand(2));
  const int m = 1 - n;
  // Mostly a few sequences every client works on, sometimes beyond max_sequences.
  const int64_t seq = static_cast<int64_t>(Chance(90) ? Rand(6) : Rand(kChaosSeqIds));
  const int draw = static_cast<int>(Rand(1000));
  // A fifth of the mutations run with a deadline of a few milliseconds: cancelled mid-way, or
  // not, they must leave a consistent cache (the Reads and the verified clients would see it).
  const bool short_deadline = Chance(20);
  const absl::Duration timeout =
      short_deadline ? absl::Microseconds(static_cast<int64_t>(Rand(3000))) : kCallTimeout;
  const std::string suffix = short_deadline ? ".deadline" : "";
  auto allowed = [&](Codes codes) {
    if (short_deadline) {
      codes.push_back(StatusCode::DEADLINE_EXCEEDED);
      codes.push_back(StatusCode::CANCELLED);
    }
    return codes;
  };
  const std::string where = absl::StrCat(cache, " on ", Where(n));

  if (draw < 200) return ChaosAppend(spec, n, seq, Chance(30));
  if (draw < 300) return ChaosRead(spec, n, seq);
  if (draw < 360) {
    v1::VisibleRequest request;
    request.set_cache(cache);
    request.set_group(static_cast<int32_t>(Rand(spec.groups_size())));
    const int queries = RandIn(1, 16);
    for (int q = 0; q < queries; ++q) {
      v1::Query* query = request.add_queries();
      query->set_seq(static_cast<int64_t>(Rand(kChaosSeqIds)));
      query->set_pos(RandIn(0, 300));
      query->set_non_causal(Chance(20));
    }
    const bool recurrent = spec.groups(request.group()).has_recurrent();
    v1::VisibleResponse response;
    const grpc::Status s = Rpc("c:Visible", [&](grpc::ClientContext* c) {
      return cache_[n]->Visible(c, request, &response);
    });
    const std::string what = absl::StrCat("visible group ", request.group(), " of ", where);
    if (Expect("c:Visible", s, With({recurrent ? StatusCode::INVALID_ARGUMENT : StatusCode::OK}),
               what) &&
        s.ok() && response.visible_size() != queries) {
      Fail("c:Visible",
           absl::StrCat(what, ": ", response.visible_size(), " answers to ", queries, " queries"));
    }
    return;
  }
  if (draw < 450) {
    const bool remote = Chance(40);
    const std::string kind = absl::StrCat("c:CopyPrefix.", remote ? "remote" : "local", suffix);
    v1::CopyPrefixRequest request;
    request.set_cache(cache);
    request.set_src_seq(seq);
    request.set_dst_seq(static_cast<int64_t>(Rand(kChaosSeqIds)));
    request.set_length(RandIn(0, Hint(cache, remote ? m : n, seq) + 4));
    if (remote) request.set_source_node(shared_->nodes[m].name);
    v1::CopyPrefixResponse response;
    const grpc::Status s = Rpc(
        kind, [&](grpc::ClientContext* c) { return cache_[n]->CopyPrefix(c, request, &response); },
        timeout);
    Expect(kind, s, allowed(remote ? Remote(kMutation) : With(kMutation)),
           absl::StrCat("copy ", request.ShortDebugString(), " on ", Where(n)));
    return;
  }
  if (draw < 540) {
    const bool cluster = Chance(20);
    const std::string kind = absl::StrCat("c:Remove", cluster ? ".cluster" : "", suffix);
    const int32_t hint = Hint(cache, n, seq);
    v1::RemoveRequest request;
    request.set_cache(cache);
    request.set_seq(seq);
    request.set_begin(RandIn(0, hint));
    if (Chance(60)) request.set_end(RandIn(request.begin(), hint + 2));
    if (cluster) request.set_scope(v1::REMOVE_SCOPE_CLUSTER);
    v1::RemoveResponse response;
    const grpc::Status s = Rpc(
        kind, [&](grpc::ClientContext* c) { return cache_[n]->Remove(c, request, &response); },
        timeout);
    const std::string what = absl::StrCat("remove ", request.ShortDebugString(), " on ", Where(n));
    if (!Expect(kind, s, allowed(With(kMutation)), what) || !s.ok()) return;
    if (cluster) {
      if (response.nodes_size() != 2) {
        return Fail(kind, absl::StrCat(what, ": ", response.nodes_size(), " node results"));
      }
      for (const v1::NodeResult& r : response.nodes()) {
        const Codes member = Remote(kMutation);
        if (std::find(member.begin(), member.end(), static_cast<StatusCode>(r.code())) ==
            member.end()) {
          Fail(kind, absl::StrCat(what, ": member ", r.node(), " answered ", CodeName(r.code()),
                                  ": ", r.message()));
        }
      }
    }
    Hint(cache, n, seq) = request.begin();
    return;
  }
  if (draw < 580) {
    v1::CanResumeRequest request;
    request.set_cache(cache);
    request.set_seq(seq);
    request.set_pos(RandIn(0, Hint(cache, n, seq) + 2));
    v1::CanResumeResponse response;
    const grpc::Status s = Rpc("c:CanResume", [&](grpc::ClientContext* c) {
      return cache_[n]->CanResume(c, request, &response);
    });
    Expect("c:CanResume", s, With({StatusCode::OK}), absl::StrCat("can-resume on ", where));
    return;
  }
  if (draw < 650) {
    v1::ListSequencesRequest request;
    request.set_cache(cache);
    v1::ListSequencesResponse response;
    const grpc::Status s = Rpc("c:ListSequences", [&](grpc::ClientContext* c) {
      return cache_[n]->ListSequences(c, request, &response);
    });
    if (!Expect("c:ListSequences", s, With({StatusCode::OK}), where) || !s.ok()) return;
    int64_t last = -1;
    for (const v1::SequenceInfo& info : response.sequences()) {
      if (info.seq() <= last) {
        return Fail("c:ListSequences", absl::StrCat(where, ": sequences not ascending"));
      }
      last = info.seq();
      Hint(cache, n, info.seq()) = info.offset() - info.pending();
    }
    return;
  }
  if (draw < 710) {
    const std::string kind = absl::StrCat("c:Snapshot", suffix);
    v1::SnapshotRequest request;
    request.set_cache(cache);
    request.set_seq(seq);
    request.set_from_offset(RandIn(0, std::max(0, Hint(cache, n, seq) - 1)));
    v1::SnapshotResponse response;
    const grpc::Status s = Rpc(
        kind, [&](grpc::ClientContext* c) { return cache_[n]->Snapshot(c, request, &response); },
        timeout);
    Expect(kind, s, allowed(With(kMutation)), absl::StrCat("snapshot seq ", seq, " of ", where));
    if (s.ok()) snapshot_hints_[{cache, n}] = response.snapshot().id();
    return;
  }
  // Snapshot ids are per cache and grow: guesses near the last one seen hit often.
  uint64_t& last_id = snapshot_hints_[{cache, n}];
  const uint64_t snapshot_id =
      last_id == 0 ? 1 + Rand(8)
                   : std::max<int64_t>(1, static_cast<int64_t>(last_id) - 16) + Rand(19);
  if (draw < 760) {
    const std::string kind = absl::StrCat("c:Restore", suffix);
    v1::RestoreRequest request;
    request.set_cache(cache);
    request.set_seq(seq);
    if (Chance(80)) request.set_snapshot_id(snapshot_id);
    request.set_target(RandIn(0, Hint(cache, n, seq) + 2));
    v1::RestoreResponse response;
    const grpc::Status s = Rpc(
        kind, [&](grpc::ClientContext* c) { return cache_[n]->Restore(c, request, &response); },
        timeout);
    Expect(kind, s, allowed(With(kMutation)), absl::StrCat("restore on ", where));
    return;
  }
  if (draw < 800) {
    // Drops outnumber the rest, so that the shared caches' snapshots do not fill the pool.
    const int what = static_cast<int>(Rand(5));
    grpc::Status s;
    std::string kind;
    if (what == 0) {
      kind = "c:MergeSnapshots";
      v1::MergeSnapshotsRequest request;
      request.set_cache(cache);
      request.set_parent(snapshot_id);
      request.set_child(snapshot_id + 1 + Rand(3));
      v1::MergeSnapshotsResponse response;
      s = Rpc(kind, [&](grpc::ClientContext* c) {
        return cache_[n]->MergeSnapshots(c, request, &response);
      });
    } else if (what == 1) {
      kind = "c:SplitSnapshot";
      v1::SplitSnapshotRequest request;
      request.set_cache(cache);
      request.set_snapshot_id(snapshot_id);
      request.set_at(RandIn(0, 64));
      v1::SplitSnapshotResponse response;
      s = Rpc(kind, [&](grpc::ClientContext* c) {
        return cache_[n]->SplitSnapshot(c, request, &response);
      });
    } else if (what <= 3) {
      kind = "c:DropSnapshot";
      v1::DropSnapshotRequest request;
      request.set_cache(cache);
      request.set_snapshot_id(snapshot_id);
      v1::DropSnapshotResponse response;
      s = Rpc(kind, [&](grpc::ClientContext* c) {
        return cache_[n]->DropSnapshot(c, request, &response);
      });
    } else {
      kind = "c:ListSnapshots";
      v1::ListSnapshotsRequest request;
      request.set_cache(cache);
      v1::ListSnapshotsResponse response;
      s = Rpc(kind, [&](grpc::ClientContext* c) {
        return cache_[n]->ListSnapshots(c, request, &response);
      });
      if (s.ok() && response.snapshots_size() > 0) {
        last_id = response.snapshots(response.snapshots_size() - 1).id();
      }
    }
    Expect(kind, s, With({StatusCode::OK, StatusCode::INVALID_ARGUMENT, StatusCode::ABORTED}),
           absl::StrCat("snapshot ", snapshot_id, " of ", where));
    return;
  }
  if (draw < 830) {
    const std::string kind = absl::StrCat("c:CommitSpeculation", suffix);
    v1::CommitSpeculationRequest request;
    request.set_cache(cache);
    request.set_seq(seq);
    request.set_accepted(RandIn(0, 4));
    v1::CommitSpeculationResponse response;
    const grpc::Status s = Rpc(
        kind,
        [&](grpc::ClientContext* c) { return cache_[n]->CommitSpeculation(c, request, &response); },
        timeout);
    Expect(kind, s, allowed(With(kMutation)), absl::StrCat("commit seq ", seq, " of ", where));
    if (s.ok()) Hint(cache, n, seq) = response.offset();
    return;
  }
  if (draw < 900) {
    const std::string kind = absl::StrCat("c:Migrate", suffix);
    v1::MigrateRequest request;
    request.set_cache(cache);
    request.set_seq(seq);
    request.set_target_node(shared_->nodes[m].name);
    request.set_target_seq(static_cast<int64_t>(Rand(kChaosSeqIds)));
    request.set_keep_source(Chance(50));
    v1::MigrateResponse response;
    const grpc::Status s = Rpc(
        kind, [&](grpc::ClientContext* c) { return cache_[n]->Migrate(c, request, &response); },
        timeout);
    Expect(kind, s, allowed(Remote(kMutation)),
           absl::StrCat("migrate ", request.ShortDebugString(), " from ", Where(n)));
    return;
  }
  if (draw < 930) {
    const std::string kind = absl::StrCat("c:MigrateSnapshot", suffix);
    v1::MigrateSnapshotRequest request;
    request.set_cache(cache);
    request.set_snapshot_id(snapshot_id);
    request.set_target_node(shared_->nodes[m].name);
    request.set_keep_source(Chance(50));
    v1::MigrateSnapshotResponse response;
    const grpc::Status s = Rpc(
        kind,
        [&](grpc::ClientContext* c) { return cache_[n]->MigrateSnapshot(c, request, &response); },
        timeout);
    Expect(kind, s, allowed(Remote(kMutation)),
           absl::StrCat("migrate snapshot ", snapshot_id, " of ", where));
    return;
  }
  if (draw < 950) {
    v1::GetCacheRequest request;
    request.set_cache(cache);
    v1::GetCacheResponse response;
    const grpc::Status s = Rpc("c:GetCache", [&](grpc::ClientContext* c) {
      return cache_[n]->GetCache(c, request, &response);
    });
    Expect("c:GetCache", s, With({StatusCode::OK}), where);
    return;
  }
  if (draw < 965) {
    v1::ListCachesResponse response;
    const grpc::Status s = Rpc("c:ListCaches", [&](grpc::ClientContext* c) {
      return cache_[n]->ListCaches(c, v1::ListCachesRequest(), &response);
    });
    Expect("c:ListCaches", s, {StatusCode::OK}, Where(n));
    return;
  }
  if (draw < 975) {
    v1::ListMembersResponse response;
    const grpc::Status s = Rpc("c:ListMembers", [&](grpc::ClientContext* c) {
      return cache_[n]->ListMembers(c, v1::ListMembersRequest(), &response);
    });
    if (Expect("c:ListMembers", s, {StatusCode::OK}, Where(n)) &&
        (response.members_size() != 2 || response.members(0).name() != shared_->nodes[n].name ||
         response.members(1).name() != shared_->nodes[m].name)) {
      Fail("c:ListMembers", absl::StrCat(Where(n), ": ", Short(response.ShortDebugString())));
    }
    return;
  }
  if (draw < 995) return ChaosScratch(n);
  // Rarely, a shared cache goes away and comes back (on one node: cross-node calls meet a
  // missing cache meanwhile).
  if (Chance(50)) {
    v1::DeleteCacheRequest request;
    request.set_cache(cache);
    v1::DeleteCacheResponse response;
    const grpc::Status s = Rpc("c:DeleteCache", [&](grpc::ClientContext* c) {
      return cache_[n]->DeleteCache(c, request, &response);
    });
    Expect("c:DeleteCache", s, {StatusCode::OK, StatusCode::NOT_FOUND}, where);
    return;
  }
  v1::CreateCacheRequest request;
  *request.mutable_spec() = spec;
  v1::CreateCacheResponse response;
  const grpc::Status s = Rpc("c:CreateCache", [&](grpc::ClientContext* c) {
    return cache_[n]->CreateCache(c, request, &response);
  });
  Expect("c:CreateCache", s, {StatusCode::OK, StatusCode::RESOURCE_EXHAUSTED}, where);
}

}  // namespace soak
}  // namespace kvmesh

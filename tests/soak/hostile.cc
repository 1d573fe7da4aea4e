// Client: hostile operations (see client.h). Each has the code docs/api.md (and issue 14's
// bounded-memory and name rules) gives it; the client's own cache must come out unchanged,
// which the verified operations check afterwards.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "tests/integration/client_util.h"
#include "tests/soak/client.h"
#include "tests/testing/pattern.h"

namespace kvmesh {
namespace soak {
namespace {

using grpc::StatusCode;

const Codes kInvalid = {StatusCode::INVALID_ARGUMENT};

// A name of `n` characters that is valid apart from its length.
std::string LongName(size_t n, uint64_t salt) {
  static const char kChars[] = "abcdefghijklmnopqrstuvwxyz0123456789";
  std::string name(n, 'x');
  uint64_t x = salt;
  for (size_t i = 0; i < n; ++i) {
    x = testutil::Mix64(x + i);
    name[i] = kChars[x % 36];
  }
  return name;
}

// 1 MiB of pattern bytes, the data of the hostile streams.
const std::string& Megabyte() {
  static const std::string* bytes = [] {
    const std::vector<uint8_t> b = testutil::PatternBytes(1 << 20, 77);
    return new std::string(b.begin(), b.end());
  }();
  return *bytes;
}

// An AppendStream header for `tokens` tokens of sequence 1 of the stream fixture cache.
v1::AppendStreamRequest StreamHeader(const v1::CacheSpec& spec, int32_t tokens) {
  v1::AppendStreamRequest message;
  v1::AppendHeader* header = message.mutable_header();
  header->set_cache(spec.name());
  for (int32_t p = 0; p < tokens; ++p) {
    v1::Token* token = header->add_tokens();
    token->set_seq(1);
    token->set_pos(p);
  }
  header->set_payload_bytes(TokenBytes(testutil::EngineSpec(spec)) * tokens);
  return message;
}

}  // namespace

void Client::Hostile() {
  const int draw = static_cast<int>(Rand(1000));
  if (draw < 110) return HMalformedSpec();
  if (draw < 230) return HBadAppend();
  if (draw < 330) return HBadStreamInline();
  if (draw < 430) return HUnknownCache();
  if (draw < 590) return HInvalidArguments();
  if (draw < 720) return HLongName();
  if (draw < 745) return HHugeVisible();
  if (draw < 815) return HSlowStream();
  if (draw < 855) return HAbandonRead();
  if (draw < 870) return HStalledRead();
  if (draw < 880) return HOversizedMessage();
  return HPeer();
}

void Client::HMalformedSpec() {
  const std::string kind = "h:CreateCache.malformed";
  const int n = static_cast<int>(Rand(2));
  const std::string name = absl::StrCat("soak-bad-", index_, "-", ++bad_names_);
  v1::CacheSpec spec = ChaosHybridSpec();
  spec.set_name(name);
  v1::LayerGroup& attention = *spec.mutable_groups(0);
  v1::Rope& rope = *attention.mutable_attention()->mutable_rope();
  const int mutation = static_cast<int>(Rand(36));
  bool valid_name = true;
  switch (mutation) {
    case 0:
      spec.set_max_sequences(0);
      break;
    case 1:
      spec.set_max_sequences((1 << 20) + 1);
      break;
    case 2:
      spec.set_capacity(0);
      break;
    case 3:
      spec.set_capacity(-5);
      break;
    case 4:
      spec.set_max_batch(0);
      break;
    case 5:
      spec.set_max_batch((1 << 24) + 1);
      break;
    case 6:
      spec.clear_groups();
      break;
    case 7:
      while (spec.groups_size() <= 64) *spec.add_groups() = spec.groups(0);
      break;
    case 8:
      spec.mutable_groups(1)->clear_kind();
      break;
    case 9:
      attention.set_num_layers(0);
      break;
    case 10:
      attention.set_num_layers(1025);
      break;
    case 11:
      attention.mutable_attention()->set_num_kv_heads(0);
      break;
    case 12:
      attention.mutable_attention()->set_num_kv_heads(4097);
      break;
    case 13:
      attention.mutable_attention()->set_head_dim_k(0);
      break;
    case 14:
      attention.mutable_attention()->set_head_dim_v(8193);
      break;
    case 15:
      rope.set_dims(3);
      break;
    case 16:
      rope.set_dims(attention.attention().head_dim_k() + 2);
      break;
    case 17:
      rope.set_base(0);
      break;
    case 18:
      rope.set_base(std::numeric_limits<float>::quiet_NaN());
      break;
    case 19:
      rope.set_freq_scale(-1);
      break;
    case 20:
      rope.set_freq_scale(std::numeric_limits<float>::infinity());
      break;
    case 21:
      spec.mutable_groups(1)->mutable_attention()->mutable_window()->mutable_sliding()->set_window(
          0);
      break;
    case 22:
      spec.mutable_groups(1)->mutable_attention()->mutable_window()->mutable_sliding()->set_memory(
          3);
      break;
    case 23:
      attention.mutable_attention()->mutable_window()->mutable_chunked()->set_chunk(0);
      break;
    case 24:
      spec.mutable_groups(2)->mutable_rotating()->set_max_size(0);
      break;
    case 25:
      spec.mutable_groups(2)->mutable_rotating()->set_max_size(spec.capacity() + 1);
      break;
    case 26:
      spec.mutable_groups(3)->mutable_recurrent()->set_conv_tail(0);
      break;
    case 27:
      spec.mutable_groups(3)->mutable_recurrent()->set_conv_dim((1 << 20) + 1);
      break;
    case 28:
      spec.mutable_groups(3)->mutable_recurrent()->set_num_v_heads(0);
      break;
    case 29:
      spec.set_dtype(v1::DTYPE_UNSPECIFIED);
      break;
    case 30:
      spec.set_dtype(static_cast<v1::DType>(99));
      break;
    case 31:
      rope.set_type(static_cast<v1::RopeType>(7));
      break;
    case 32:
      spec.set_name("");
      valid_name = false;
      break;
    case 33:
      spec.set_name(absl::StrCat("soak bad/", index_));
      valid_name = false;
      break;
    case 34:
      spec.set_name(LongName(129, NextSeed()));
      valid_name = false;
      break;
    default:
      // 2^24 cells per group at most.
      spec.set_max_sequences(1 << 20);
      spec.set_capacity(1 << 20);
      break;
  }
  v1::CreateCacheRequest request;
  if (!Chance(3)) *request.mutable_spec() = spec;  // else no spec at all
  v1::CreateCacheResponse response;
  const grpc::Status s = Rpc(
      kind, [&](grpc::ClientContext* c) { return hcache_[n]->CreateCache(c, request, &response); });
  const std::string what = absl::StrCat("mutation ", mutation, " (",
                                        Short(request.ShortDebugString(), 200), ") on ", Where(n));
  if (!Expect(kind, s, kInvalid, what) || !valid_name) return;
  // All-or-nothing: nothing was created.
  v1::GetCacheRequest get;
  get.set_cache(name);
  v1::GetCacheResponse got;
  const grpc::Status g = Rpc("h:GetCache.after_malformed", [&](grpc::ClientContext* c) {
    return hcache_[n]->GetCache(c, get, &got);
  });
  Expect("h:GetCache.after_malformed", g, {StatusCode::NOT_FOUND}, what);
}

void Client::CheckUnchanged(int node, const std::string& kind, const std::string& what) {
  // Refused calls change nothing (docs/api.md#all-or-nothing): the own cache's sequences are
  // still those of the model, right after the call that could have changed them.
  if (!own_.nodes[node].exists || needs_resync_) return;
  const std::string list = absl::StrCat(kind.substr(0, 2), "ListSequences.after");
  v1::ListSequencesRequest request;
  request.set_cache(own_.name);
  v1::ListSequencesResponse response;
  const grpc::Status s = Rpc(list, [&](grpc::ClientContext* c) {
    return cache_[node]->ListSequences(c, request, &response);
  });
  if (Ambiguous(s, list) || !Expect(list, s, {StatusCode::OK}, what)) return;
  std::string diff = CheckSequences(own_, own_.nodes[node], response);
  if (diff.empty()) {
    // And its snapshots: cross-node calls import into the snapshot pool before they commit.
    const std::string snaps = absl::StrCat(kind.substr(0, 2), "ListSnapshots.after");
    v1::ListSnapshotsRequest list_snapshots;
    list_snapshots.set_cache(own_.name);
    v1::ListSnapshotsResponse listed;
    const grpc::Status t = Rpc(snaps, [&](grpc::ClientContext* c) {
      return cache_[node]->ListSnapshots(c, list_snapshots, &listed);
    });
    if (Ambiguous(t, snaps) || !Expect(snaps, t, {StatusCode::OK}, what)) return;
    std::vector<uint64_t> got, want;
    for (const v1::SnapshotInfo& info : listed.snapshots()) got.push_back(info.id());
    for (const auto& [id, snap] : own_.nodes[node].snaps) want.push_back(id);
    if (got != want) {
      diff = absl::StrCat("snapshots [", absl::StrJoin(got, ","), "], expected [",
                          absl::StrJoin(want, ","), "]");
    }
  }
  if (!diff.empty()) {
    Fail(kind,
         absl::StrCat(what, ": the refused call changed the cache on ", Where(node), ": ", diff));
    Resync(kind);
  }
}

void Client::HBadAppend() {
  const int n = static_cast<int>(Rand(2));
  NodeModel& node = own_.nodes[n];
  if (!node.exists) return HUnknownCache();
  const int64_t seq = PickSeq(node, 90);
  auto it = node.seqs.find(seq);
  const SeqModel* model = it == node.seqs.end() ? nullptr : &it->second;
  const bool full =
      model == nullptr && static_cast<int32_t>(node.seqs.size()) >= kModelMaxSequences;
  std::vector<int32_t> positions = AppendPositions(model, RandIn(2, 4));
  const int mutation = static_cast<int>(Rand(11));
  std::string label;
  v1::AppendRequest request;
  switch (mutation) {
    case 0:
    case 1:
    case 2: {
      label = mutation == 0 ? "payload_long" : mutation == 1 ? "payload_short" : "payload_empty";
      request = testutil::MakeAppend(own_.spec, seq, positions, NextSeed());
      std::string payload = request.payload();
      const size_t delta = 1 + Rand(64);
      if (mutation == 0) payload.append(delta, 'x');
      if (mutation == 1) payload.resize(payload.size() - std::min(payload.size(), delta));
      if (mutation == 2) payload.clear();
      request.set_payload(payload);
      break;
    }
    case 3:
      label = "negative_pos";
      request = testutil::MakeAppend(own_.spec, seq, positions, NextSeed());
      request.mutable_tokens(0)->set_pos(-1 - static_cast<int32_t>(Rand(100)));
      break;
    case 4:
      label = "negative_seq";
      request = testutil::MakeAppend(own_.spec, seq, positions, NextSeed());
      request.mutable_tokens(1)->set_seq(-1);
      break;
    case 5:
      label = "empty_batch";
      request.set_cache(own_.name);
      break;
    case 6: {
      label = "over_max_batch";
      positions = AppendPositions(model, kModelMaxBatch + 1);
      request = testutil::MakeAppend(own_.spec, seq, positions, NextSeed());
      break;
    }
    case 7:
      label = "duplicate_pos";
      positions[1] = positions[0];
      request = testutil::MakeAppend(own_.spec, seq, positions, NextSeed());
      break;
    case 8:
      label = "decreasing_pos";
      std::swap(positions[0], positions[1]);
      request = testutil::MakeAppend(own_.spec, seq, positions, NextSeed());
      break;
    case 9:
      label = "max_pos";
      positions = {std::numeric_limits<int32_t>::max()};
      request = testutil::MakeAppend(own_.spec, seq, positions, NextSeed());
      break;
    default:
      // A position the sequence stores (attention), or a gap (contiguous hybrid).
      label = "stored_or_gap";
      if (model == nullptr || model->rows.empty()) {
        positions = {own_.hybrid() ? 1 : 0, own_.hybrid() ? 2 : 0};
      } else if (own_.hybrid()) {
        positions = {model->offset() + 1};
      } else {
        positions = {model->rows.begin()->first};
      }
      request = testutil::MakeAppend(own_.spec, seq, positions, NextSeed());
      break;
  }
  const std::string kind = absl::StrCat("h:Append.", label);
  v1::AppendResponse response;
  const grpc::Status s =
      Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->Append(c, request, &response); });
  if (Ambiguous(s, kind)) return;
  // A new sequence beyond max_sequences may be refused for that first.
  Codes allowed = kInvalid;
  if (full) allowed.push_back(StatusCode::RESOURCE_EXHAUSTED);
  const std::string what = absl::StrCat("append ", Short(request.ShortDebugString(), 160), " to ",
                                        own_.name, " on ", Where(n));
  Expect(kind, s, allowed, what);
  CheckUnchanged(n, kind, what);
}

void Client::HBadStreamInline() {
  const int n = static_cast<int>(Rand(2));
  NodeModel& node = own_.nodes[n];
  if (!node.exists) return HUnknownCache();
  const int64_t seq = PickSeq(node, 90);
  auto it = node.seqs.find(seq);
  const SeqModel* model = it == node.seqs.end() ? nullptr : &it->second;
  const bool full =
      model == nullptr && static_cast<int32_t>(node.seqs.size()) >= kModelMaxSequences;
  const v1::AppendRequest append =
      testutil::MakeAppend(own_.spec, seq, AppendPositions(model, RandIn(1, 4)), NextSeed());
  std::vector<v1::AppendStreamRequest> messages =
      testutil::StreamMessages(append, Rand(append.payload().size()), 1 + Rand(2048));
  const int variant = static_cast<int>(Rand(8));
  std::string label;
  switch (variant) {
    case 0:
      label = "no_header";
      messages[0].clear_header();
      break;
    case 1:
      label = "second_header";
      messages.push_back(messages[0]);
      break;
    case 2:
      label = "negative_bytes";
      messages[0].mutable_header()->set_payload_bytes(-1 - static_cast<int64_t>(Rand(1000)));
      break;
    case 3:
      label = "above_max";
      // Above max_batch speculative tokens of distinct sequences: the cache's largest payload.
      messages[0].mutable_header()->set_payload_bytes(
          (TokenBytes(own_.engine) + StateBytes(own_.engine)) * (kModelMaxBatch + 1) + 1);
      break;
    case 4:
      label = "extra_data";
      messages.emplace_back().set_data(std::string(1 + Rand(100), 'x'));
      break;
    case 5:
      label = "short_data";
      messages.back().mutable_data()->resize(messages.back().data().size() / 2);
      if (messages.size() > 1 && messages.back().data().empty()) messages.pop_back();
      if (append.payload().empty()) messages[0].mutable_header()->set_payload_bytes(10);
      break;
    case 6:
      label = "no_message";
      messages.clear();
      break;
    default: {
      label = "bytes_mismatch";
      // payload_bytes and the data agree with each other but not with the tokens.
      const int64_t extra = 2 + static_cast<int64_t>(Rand(62));
      messages[0].mutable_header()->set_payload_bytes(messages[0].header().payload_bytes() + extra);
      messages.emplace_back().set_data(std::string(extra, 'y'));
      break;
    }
  }
  if (label == "short_data") {
    // Recount: the payload must fall short of payload_bytes.
    int64_t sent = 0;
    for (const auto& m : messages) sent += static_cast<int64_t>(m.data().size());
    if (sent >= messages[0].header().payload_bytes()) {
      messages[0].mutable_header()->set_payload_bytes(sent + 1);
    }
  }
  const std::string kind = absl::StrCat("h:AppendStream.", label);
  v1::AppendResponse response;
  const grpc::Status s = Rpc(kind, [&](grpc::ClientContext* c) {
    auto writer = hcache_[n]->AppendStream(c, &response);
    for (const v1::AppendStreamRequest& m : messages) {
      if (!writer->Write(m)) break;
    }
    writer->WritesDone();
    return writer->Finish();
  });
  if (Ambiguous(s, kind)) return;
  Codes allowed = kInvalid;
  if (full && (variant == 1 || variant == 4)) allowed.push_back(StatusCode::RESOURCE_EXHAUSTED);
  std::string what = absl::StrCat("stream to seq ", seq, " of ", own_.name, " on ", Where(n), ":");
  for (const v1::AppendStreamRequest& m : messages) {
    absl::StrAppend(&what, " [", m.has_header() ? Short(m.header().ShortDebugString(), 120) : "",
                    m.has_header() ? " + " : "", m.data().size(), " bytes]");
  }
  Expect(kind, s, allowed, what);
  CheckUnchanged(n, kind, what);
}

void Client::HUnknownCache() {
  const int n = static_cast<int>(Rand(2));
  const std::string cache = absl::StrCat("soak-missing-", index_, "-", Rand(1000000));
  const int op = static_cast<int>(Rand(12));
  grpc::Status s;
  std::string kind;
  switch (op) {
    case 0: {
      kind = "h:GetCache.unknown";
      v1::GetCacheRequest r;
      r.set_cache(cache);
      v1::GetCacheResponse out;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->GetCache(c, r, &out); });
      break;
    }
    case 1: {
      kind = "h:DeleteCache.unknown";
      v1::DeleteCacheRequest r;
      r.set_cache(cache);
      v1::DeleteCacheResponse out;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->DeleteCache(c, r, &out); });
      break;
    }
    case 2: {
      kind = "h:Append.unknown";
      v1::AppendRequest r = testutil::MakeAppend(ModelSpec(cache, Flavour::kAttention), 0, {0, 1});
      v1::AppendResponse out;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->Append(c, r, &out); });
      break;
    }
    case 3: {
      kind = "h:Read.unknown";
      v1::ReadRequest r;
      r.set_cache(cache);
      s = Rpc(kind, [&](grpc::ClientContext* c) {
        auto reader = hcache_[n]->Read(c, r);
        v1::ReadResponse m;
        while (reader->Read(&m)) {
        }
        return reader->Finish();
      });
      break;
    }
    case 4: {
      kind = "h:Visible.unknown";
      v1::VisibleRequest r;
      r.set_cache(cache);
      r.add_queries()->set_pos(3);
      v1::VisibleResponse out;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->Visible(c, r, &out); });
      break;
    }
    case 5: {
      kind = "h:CopyPrefix.unknown";
      v1::CopyPrefixRequest r;
      r.set_cache(cache);
      r.set_dst_seq(1);
      r.set_length(4);
      if (Chance(50)) r.set_source_node(shared_->nodes[1 - n].name);
      v1::CopyPrefixResponse out;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->CopyPrefix(c, r, &out); });
      break;
    }
    case 6: {
      kind = "h:Remove.unknown";
      v1::RemoveRequest r;
      r.set_cache(cache);
      v1::RemoveResponse out;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->Remove(c, r, &out); });
      break;
    }
    case 7: {
      kind = "h:Snapshot.unknown";
      v1::SnapshotRequest r;
      r.set_cache(cache);
      v1::SnapshotResponse out;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->Snapshot(c, r, &out); });
      break;
    }
    case 8: {
      kind = "h:Migrate.unknown";
      v1::MigrateRequest r;
      r.set_cache(cache);
      r.set_target_node(shared_->nodes[1 - n].name);
      v1::MigrateResponse out;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->Migrate(c, r, &out); });
      break;
    }
    case 9: {
      kind = "h:ListSequences.unknown";
      v1::ListSequencesRequest r;
      r.set_cache(cache);
      v1::ListSequencesResponse out;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->ListSequences(c, r, &out); });
      break;
    }
    case 10: {
      kind = "h:CanResume.unknown";
      v1::CanResumeRequest r;
      r.set_cache(cache);
      v1::CanResumeResponse out;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->CanResume(c, r, &out); });
      break;
    }
    default: {
      kind = "h:Export.unknown_cache";
      v1::ExportRequest r;
      r.set_cache(cache);
      *r.mutable_spec() = ModelSpec(cache, Flavour::kAttention);
      r.set_receiver(shared_->nodes[1 - n].name);
      r.mutable_sequence()->set_seq(0);
      r.set_transport("grpc-stream");
      r.set_tenant("default");
      v1::ExportResponse out;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return peer_[n]->Export(c, r, &out); });
      break;
    }
  }
  Expect(kind, s, {StatusCode::NOT_FOUND}, absl::StrCat("cache ", cache, " on ", Where(n)));
}

void Client::HInvalidArguments() {
  const int n = static_cast<int>(Rand(2));
  const int m = 1 - n;
  NodeModel& node = own_.nodes[n];
  if (!node.exists) return HUnknownCache();
  const std::string& cache = own_.name;
  const int64_t seq = PickSeq(node, 80);
  const uint64_t known_snapshot = node.snaps.empty() ? 0 : node.snaps.begin()->first;
  const int op = static_cast<int>(Rand(30));
  grpc::Status s;
  std::string kind;
  Codes expected = kInvalid;
  auto read = [&](const v1::ReadRequest& r) {
    return Rpc(kind, [&](grpc::ClientContext* c) {
      auto reader = hcache_[n]->Read(c, r);
      v1::ReadResponse message;
      while (reader->Read(&message)) {
      }
      return reader->Finish();
    });
  };
  v1::ReadRequest read_request;
  read_request.set_cache(cache);
  read_request.set_seq(seq);
  v1::RemoveRequest remove;
  remove.set_cache(cache);
  remove.set_seq(seq);
  v1::RemoveResponse removed;
  v1::VisibleRequest visible;
  visible.set_cache(cache);
  v1::Query* query = visible.add_queries();
  query->set_seq(seq);
  query->set_pos(1);
  v1::VisibleResponse seen;
  v1::CopyPrefixRequest copy;
  copy.set_cache(cache);
  copy.set_src_seq(seq);
  copy.set_dst_seq(seq + 1);
  copy.set_length(4);
  v1::CopyPrefixResponse copied;
  v1::MigrateRequest migrate;
  migrate.set_cache(cache);
  migrate.set_seq(seq);
  migrate.set_target_node(shared_->nodes[m].name);
  v1::MigrateResponse migrated;
  switch (op) {
    case 0:
      kind = "h:Read.negative_begin";
      read_request.set_begin(-1);
      s = read(read_request);
      break;
    case 1:
      kind = "h:Read.end_before_begin";
      read_request.set_begin(5);
      read_request.set_end(4);
      s = read(read_request);
      break;
    case 2:
      kind = "h:Read.bad_chunk";
      read_request.set_max_chunk_bytes(Chance(50) ? -1 : (64 << 20) + 1);
      s = read(read_request);
      break;
    case 3:
      kind = "h:Read.negative_seq";
      read_request.set_seq(-1);
      s = read(read_request);
      break;
    case 4:
      kind = "h:Remove.negative_begin";
      remove.set_begin(-5);
      s = Rpc(kind,
              [&](grpc::ClientContext* c) { return hcache_[n]->Remove(c, remove, &removed); });
      break;
    case 5:
      kind = "h:Remove.end_before_begin";
      remove.set_begin(6);
      remove.set_end(2);
      s = Rpc(kind,
              [&](grpc::ClientContext* c) { return hcache_[n]->Remove(c, remove, &removed); });
      break;
    case 6:
      kind = "h:Remove.bad_scope";
      remove.set_scope(static_cast<v1::RemoveScope>(7));
      s = Rpc(kind,
              [&](grpc::ClientContext* c) { return hcache_[n]->Remove(c, remove, &removed); });
      break;
    case 7: {
      kind = "h:CanResume.negative";
      v1::CanResumeRequest r;
      r.set_cache(cache);
      r.set_seq(Chance(50) ? -1 : seq);
      r.set_pos(r.seq() < 0 ? 0 : -1);
      v1::CanResumeResponse out;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->CanResume(c, r, &out); });
      break;
    }
    case 8:
      kind = "h:Visible.negative";
      if (Chance(50)) {
        query->set_pos(-1);
      } else {
        query->set_seq(-1);
      }
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->Visible(c, visible, &seen); });
      break;
    case 9:
      kind = "h:Visible.bad_group";
      visible.set_group(Chance(50) ? -1 : own_.spec.groups_size() + static_cast<int32_t>(Rand(5)));
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->Visible(c, visible, &seen); });
      break;
    case 10:
      kind = "h:CopyPrefix.negative";
      if (Chance(33)) {
        copy.set_length(-1);
      } else if (Chance(50)) {
        copy.set_src_seq(-1);
      } else {
        copy.set_dst_seq(-1);
      }
      s = Rpc(kind,
              [&](grpc::ClientContext* c) { return hcache_[n]->CopyPrefix(c, copy, &copied); });
      break;
    case 11:
      kind = "h:CopyPrefix.same_seq";
      copy.set_dst_seq(seq);
      s = Rpc(kind,
              [&](grpc::ClientContext* c) { return hcache_[n]->CopyPrefix(c, copy, &copied); });
      break;
    case 12:
      kind = "h:CopyPrefix.not_member";
      copy.set_source_node("mallory");
      s = Rpc(kind,
              [&](grpc::ClientContext* c) { return hcache_[n]->CopyPrefix(c, copy, &copied); });
      break;
    case 13: {
      kind = "h:Snapshot.negative";
      v1::SnapshotRequest r;
      r.set_cache(cache);
      r.set_seq(Chance(50) ? -1 : seq);
      r.set_from_offset(r.seq() < 0 ? 0 : -1);
      v1::SnapshotResponse out;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->Snapshot(c, r, &out); });
      break;
    }
    case 14: {
      kind = "h:Restore.negative";
      v1::RestoreRequest r;
      r.set_cache(cache);
      r.set_seq(Chance(50) ? -1 : seq);
      r.set_target(r.seq() < 0 ? 0 : -1);
      v1::RestoreResponse out;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->Restore(c, r, &out); });
      break;
    }
    case 15: {
      kind = "h:Restore.unknown_snapshot";
      v1::RestoreRequest r;
      r.set_cache(cache);
      r.set_seq(seq);
      r.set_snapshot_id(max_snapshot_id_[n] + 1000 + Rand(1000));
      r.set_target(0);
      v1::RestoreResponse out;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->Restore(c, r, &out); });
      expected = {StatusCode::NOT_FOUND};
      break;
    }
    case 16: {
      kind = "h:SplitSnapshot.negative";
      v1::SplitSnapshotRequest r;
      r.set_cache(cache);
      r.set_snapshot_id(known_snapshot != 0 ? known_snapshot : 1);
      r.set_at(-1);
      v1::SplitSnapshotResponse out;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->SplitSnapshot(c, r, &out); });
      if (known_snapshot == 0) expected.push_back(StatusCode::NOT_FOUND);
      break;
    }
    case 17: {
      kind = "h:MergeSnapshots.same";
      v1::MergeSnapshotsRequest r;
      r.set_cache(cache);
      r.set_parent(known_snapshot != 0 ? known_snapshot : 1);
      r.set_child(r.parent());
      v1::MergeSnapshotsResponse out;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->MergeSnapshots(c, r, &out); });
      if (known_snapshot == 0) expected.push_back(StatusCode::NOT_FOUND);
      break;
    }
    case 18: {
      kind = "h:CommitSpeculation.negative";
      v1::CommitSpeculationRequest r;
      r.set_cache(cache);
      r.set_seq(seq);
      r.set_accepted(-1);
      v1::CommitSpeculationResponse out;
      s = Rpc(kind,
              [&](grpc::ClientContext* c) { return hcache_[n]->CommitSpeculation(c, r, &out); });
      break;
    }
    case 19: {
      kind = "h:CommitSpeculation.nothing_pending";
      v1::CommitSpeculationRequest r;
      r.set_cache(cache);
      r.set_seq(seq);
      v1::CommitSpeculationResponse out;
      s = Rpc(kind,
              [&](grpc::ClientContext* c) { return hcache_[n]->CommitSpeculation(c, r, &out); });
      expected = {StatusCode::FAILED_PRECONDITION};
      break;
    }
    case 20:
      kind = "h:Migrate.to_self";
      migrate.set_target_node(shared_->nodes[n].name);
      s = Rpc(kind,
              [&](grpc::ClientContext* c) { return hcache_[n]->Migrate(c, migrate, &migrated); });
      break;
    case 21:
      kind = "h:Migrate.not_member";
      migrate.set_target_node(Chance(50) ? "mallory" : "");
      s = Rpc(kind,
              [&](grpc::ClientContext* c) { return hcache_[n]->Migrate(c, migrate, &migrated); });
      break;
    case 22:
      kind = "h:Migrate.negative";
      if (Chance(50)) {
        migrate.set_seq(-1);
      } else {
        migrate.set_target_seq(-1);
      }
      s = Rpc(kind,
              [&](grpc::ClientContext* c) { return hcache_[n]->Migrate(c, migrate, &migrated); });
      break;
    case 23: {
      kind = "h:MigrateSnapshot.to_self";
      v1::MigrateSnapshotRequest r;
      r.set_cache(cache);
      r.set_snapshot_id(known_snapshot != 0 ? known_snapshot : 1);
      r.set_target_node(shared_->nodes[n].name);
      v1::MigrateSnapshotResponse out;
      s = Rpc(kind,
              [&](grpc::ClientContext* c) { return hcache_[n]->MigrateSnapshot(c, r, &out); });
      if (known_snapshot == 0) expected.push_back(StatusCode::NOT_FOUND);
      break;
    }
    case 24: {
      kind = "h:GetCache.empty_name";
      v1::GetCacheRequest r;
      v1::GetCacheResponse out;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->GetCache(c, r, &out); });
      break;
    }
    case 25:
      kind = "h:Read.empty_name";
      read_request.clear_cache();
      s = read(read_request);
      break;
    case 26: {
      kind = "h:DropSnapshot.unknown";
      v1::DropSnapshotRequest r;
      r.set_cache(cache);
      r.set_snapshot_id(max_snapshot_id_[n] + 1000 + Rand(1000));
      v1::DropSnapshotResponse out;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->DropSnapshot(c, r, &out); });
      expected = {StatusCode::NOT_FOUND};
      break;
    }
    case 27: {
      kind = "h:Visible.recurrent_or_many";
      // 2,000 queries of sequences that store little: a small answer, which a cap on the
      // number of queries may refuse.
      visible.clear_queries();
      for (int q = 0; q < 2000; ++q) {
        v1::Query* many = visible.add_queries();
        many->set_seq(static_cast<int64_t>(Rand(10)));
        many->set_pos(static_cast<int32_t>(Rand(300)));
      }
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->Visible(c, visible, &seen); });
      expected = {StatusCode::OK, StatusCode::RESOURCE_EXHAUSTED, StatusCode::INVALID_ARGUMENT};
      if (s.ok() && seen.visible_size() != 2000) {
        Fail(kind, absl::StrCat(seen.visible_size(), " answers to 2000 queries"));
      }
      break;
    }
    case 28: {
      kind = "h:ListSequences.empty_name";
      v1::ListSequencesRequest r;
      v1::ListSequencesResponse out;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->ListSequences(c, r, &out); });
      break;
    }
    default: {
      v1::RestoreRequest r;
      r.set_cache(cache);
      r.set_seq(seq);
      r.set_snapshot_id(known_snapshot != 0 ? known_snapshot : 1);
      r.set_target(-3);
      v1::RestoreResponse out;
      kind = "h:Restore.negative_target";
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->Restore(c, r, &out); });
      break;
    }
  }
  if (Ambiguous(s, kind)) return;
  const std::string what = absl::StrCat("seq ", seq, " of ", cache, " on ", Where(n));
  Expect(kind, s, expected, what);
  CheckUnchanged(n, kind, what);
}

void Client::HLongName() {
  const int n = static_cast<int>(Rand(2));
  const int m = 1 - n;
  const size_t length = Chance(70) ? 10 * 1024 : static_cast<size_t>(RandIn(129, 600));
  const std::string name = LongName(length, NextSeed());
  const std::string& good = own_.name;
  const int op = static_cast<int>(Rand(22));
  grpc::Status s;
  std::string kind;
  auto label = [&](const char* op_name) { kind = absl::StrCat("h:", op_name, ".long_name"); };
  switch (op) {
    case 0: {
      label("CreateCache");
      v1::CreateCacheRequest r;
      *r.mutable_spec() = ModelSpec(name, Flavour::kAttention);
      v1::CreateCacheResponse out;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->CreateCache(c, r, &out); });
      break;
    }
    case 1: {
      label("GetCache");
      v1::GetCacheRequest r;
      r.set_cache(name);
      v1::GetCacheResponse out;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->GetCache(c, r, &out); });
      break;
    }
    case 2: {
      label("DeleteCache");
      v1::DeleteCacheRequest r;
      r.set_cache(name);
      v1::DeleteCacheResponse out;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->DeleteCache(c, r, &out); });
      break;
    }
    case 3: {
      label("Append");
      v1::AppendRequest r = testutil::MakeAppend(ModelSpec(name, Flavour::kAttention), 0, {0});
      v1::AppendResponse out;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->Append(c, r, &out); });
      break;
    }
    case 4: {
      label("AppendStream");
      const std::vector<v1::AppendStreamRequest> messages = testutil::StreamMessages(
          testutil::MakeAppend(ModelSpec(name, Flavour::kAttention), 0, {0}), 100, 1000);
      v1::AppendResponse out;
      s = Rpc(kind, [&](grpc::ClientContext* c) {
        auto writer = hcache_[n]->AppendStream(c, &out);
        for (const auto& message : messages) {
          if (!writer->Write(message)) break;
        }
        writer->WritesDone();
        return writer->Finish();
      });
      break;
    }
    case 5: {
      label("Read");
      v1::ReadRequest r;
      r.set_cache(name);
      s = Rpc(kind, [&](grpc::ClientContext* c) {
        auto reader = hcache_[n]->Read(c, r);
        v1::ReadResponse message;
        while (reader->Read(&message)) {
        }
        return reader->Finish();
      });
      break;
    }
    case 6: {
      label("Visible");
      v1::VisibleRequest r;
      r.set_cache(name);
      r.add_queries()->set_pos(1);
      v1::VisibleResponse out;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->Visible(c, r, &out); });
      break;
    }
    case 7:
    case 8: {
      v1::CopyPrefixRequest r;
      r.set_length(3);
      r.set_dst_seq(1);
      if (op == 7) {
        label("CopyPrefix");
        r.set_cache(name);
      } else {
        kind = "h:CopyPrefix.long_source_node";
        r.set_cache(good);
        r.set_source_node(name);
      }
      v1::CopyPrefixResponse out;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->CopyPrefix(c, r, &out); });
      break;
    }
    case 9: {
      label("Remove");
      v1::RemoveRequest r;
      r.set_cache(name);
      if (Chance(50)) r.set_scope(v1::REMOVE_SCOPE_CLUSTER);
      v1::RemoveResponse out;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->Remove(c, r, &out); });
      break;
    }
    case 10: {
      label("CanResume");
      v1::CanResumeRequest r;
      r.set_cache(name);
      v1::CanResumeResponse out;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->CanResume(c, r, &out); });
      break;
    }
    case 11: {
      label("ListSequences");
      v1::ListSequencesRequest r;
      r.set_cache(name);
      v1::ListSequencesResponse out;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->ListSequences(c, r, &out); });
      break;
    }
    case 12: {
      label("Snapshot");
      v1::SnapshotRequest r;
      r.set_cache(name);
      v1::SnapshotResponse out;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->Snapshot(c, r, &out); });
      break;
    }
    case 13: {
      label("Restore");
      v1::RestoreRequest r;
      r.set_cache(name);
      r.set_snapshot_id(1);
      v1::RestoreResponse out;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->Restore(c, r, &out); });
      break;
    }
    case 14: {
      label("DropSnapshot");
      v1::DropSnapshotRequest r;
      r.set_cache(name);
      r.set_snapshot_id(1);
      v1::DropSnapshotResponse out;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->DropSnapshot(c, r, &out); });
      break;
    }
    case 15: {
      label("ListSnapshots");
      v1::ListSnapshotsRequest r;
      r.set_cache(name);
      v1::ListSnapshotsResponse out;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->ListSnapshots(c, r, &out); });
      break;
    }
    case 16: {
      label("CommitSpeculation");
      v1::CommitSpeculationRequest r;
      r.set_cache(name);
      v1::CommitSpeculationResponse out;
      s = Rpc(kind,
              [&](grpc::ClientContext* c) { return hcache_[n]->CommitSpeculation(c, r, &out); });
      break;
    }
    case 17:
    case 18: {
      v1::MigrateRequest r;
      if (op == 17) {
        label("Migrate");
        r.set_cache(name);
        r.set_target_node(shared_->nodes[m].name);
      } else {
        kind = "h:Migrate.long_target_node";
        r.set_cache(good);
        r.set_target_node(name);
      }
      v1::MigrateResponse out;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->Migrate(c, r, &out); });
      break;
    }
    case 19: {
      label("MigrateSnapshot");
      v1::MigrateSnapshotRequest r;
      r.set_cache(name);
      r.set_snapshot_id(1);
      r.set_target_node(shared_->nodes[m].name);
      v1::MigrateSnapshotResponse out;
      s = Rpc(kind,
              [&](grpc::ClientContext* c) { return hcache_[n]->MigrateSnapshot(c, r, &out); });
      break;
    }
    case 20:
    default: {
      v1::ExportRequest r;
      r.set_transport("grpc-stream");
      r.set_tenant("default");
      r.mutable_sequence()->set_seq(kFixtureSeq);
      if (op == 20) {
        kind = "h:Export.long_cache";
        r.set_cache(name);
        *r.mutable_spec() = ModelSpec(name, Flavour::kAttention);
        r.set_receiver(shared_->nodes[m].name);
      } else {
        kind = "h:Export.long_receiver";
        r.set_cache(kStreamCache);
        *r.mutable_spec() = shared_->stream_spec;
        r.set_receiver(name);
      }
      v1::ExportResponse out;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return peer_[n]->Export(c, r, &out); });
      break;
    }
  }
  const std::string what = absl::StrCat("a ", length, "-byte name on ", Where(n));
  // The node-name variants name the own cache: it must come out unchanged.
  if (own_.nodes[n].exists && (op == 8 || op == 18)) CheckUnchanged(n, kind, what);
  if (!Expect(kind, s, kInvalid, what)) return;
  // The message may quote the start of the name, never the whole of it.
  if (s.error_message().size() > 512 ||
      s.error_message().find(name.substr(0, 64)) != std::string::npos) {
    Fail(kind, absl::StrCat(what, ": the message quotes too much of the name (",
                            s.error_message().size(), " bytes): ", Short(s.error_message(), 200)));
  }
}

void Client::HHugeVisible() {
  const std::string kind = "h:Visible.huge";
  // One at a time in the whole soak: before Visible is capped, each one can take gigabytes.
  if (shared_->huge_visible_in_flight.fetch_add(1) > 0) {
    shared_->huge_visible_in_flight.fetch_sub(1);
    return HInvalidArguments();
  }
  const int n = static_cast<int>(Rand(2));
  v1::VisibleRequest request;
  request.set_cache(kLongCache);
  for (int q = 0; q < shared_->options.visible_queries; ++q) {
    v1::Query* query = request.add_queries();
    query->set_seq(kFixtureSeq);
    query->set_pos(shared_->options.long_positions - 1);
    query->set_non_causal(Chance(50));
  }
  v1::VisibleResponse response;
  const grpc::Status s = Rpc(
      kind, [&](grpc::ClientContext* c) { return hcache_[n]->Visible(c, request, &response); },
      absl::Seconds(120));
  shared_->huge_visible_in_flight.fetch_sub(1);
  // Refused before any work: queries x positions is far beyond any sane answer.
  Expect(kind, s, {StatusCode::RESOURCE_EXHAUSTED, StatusCode::INVALID_ARGUMENT},
         absl::StrCat(shared_->options.visible_queries, " queries over ",
                      shared_->options.long_positions, " positions on ", Where(n)));
}

void Client::HSlowStream() {
  const int n = static_cast<int>(Rand(2));
  const int variant = static_cast<int>(Rand(3));  // 0 idle, 1 unfinished, 2 cancelled
  const int64_t token_bytes = TokenBytes(testutil::EngineSpec(shared_->stream_spec));
  const int32_t max_tokens = static_cast<int32_t>(std::min<int64_t>(
      shared_->stream_spec.max_batch(), shared_->options.stream_bytes / token_bytes));
  // Log-uniform sizes, from one token (16 KiB) to --stream-bytes: small streams fit the
  // in-flight budget and linger, large ones meet it.
  const int32_t tokens = std::max(
      1, static_cast<int32_t>(max_tokens * std::exp2(-std::log2(static_cast<double>(max_tokens)) *
                                                     static_cast<double>(Rand(1001)) / 1000.0)));
  const double fraction = 0.3 + 0.65 * static_cast<double>(Rand(1000)) / 1000.0;
  absl::Duration hold = absl::ZeroDuration();
  const int64_t idle_ms = shared_->options.stream_idle_timeout_ms;
  if (variant == 0) {
    hold =
        shared_->support.stream_idle_timeout
            ? absl::Milliseconds(static_cast<int64_t>(idle_ms * (0.2 + 2.8 * Rand(1000) / 1000.0)))
            : absl::Milliseconds(1000 + static_cast<int64_t>(Rand(19000)));
  }
  Shared* shared = shared_;
  // A connection of its own, as an attacker's would be: whatever the node does to it must not
  // be blamed on (or spare) the honest calls of this client.
  const std::string address = shared_->nodes[n].address;
  const int salt = 100000 + index_ * 1000 + static_cast<int>(Rand(1000));
  const int client = index_;
  const std::string where = Where(n);
  const bool submitted = shared_->slow->TrySubmit([=](Recorder* recorder) {
    Checker check(shared, recorder, client);
    static const char* const kLabels[] = {"idle", "unfinished", "cancelled"};
    const std::string kind = absl::StrCat("h:AppendStream.", kLabels[variant]);
    auto stub = v1::CacheService::NewStub(NewChannel(address, salt));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + hold + absl::Seconds(90)));
    v1::AppendResponse response;
    const absl::Time start = absl::Now();
    auto writer = stub->AppendStream(&context, &response);
    const v1::AppendStreamRequest header = StreamHeader(shared->stream_spec, tokens);
    const int64_t target = static_cast<int64_t>(header.header().payload_bytes() * fraction);
    bool open = writer->Write(header);
    int64_t sent = 0;
    v1::AppendStreamRequest chunk;
    while (open && sent < target && !shared->stop.load()) {
      const int64_t piece = std::min<int64_t>(Megabyte().size(), target - sent);
      chunk.set_data(Megabyte().substr(0, static_cast<size_t>(piece)));
      open = writer->Write(chunk);
      sent += piece;
    }
    const std::string what = absl::StrCat(tokens, " tokens (", header.header().payload_bytes(),
                                          " bytes announced, ", sent, " sent), ", where);
    if (!open) {
      // The node ended the stream while data was still coming: the in-flight budget (or our
      // own deadline, if back-pressure held the writes that long).
      const grpc::Status s = writer->Finish();
      check.Record(absl::StrCat(kind, ".closed_early"), s, start);
      check.Expect(absl::StrCat(kind, ".closed_early"), s,
                   {StatusCode::RESOURCE_EXHAUSTED, StatusCode::DEADLINE_EXCEEDED,
                    StatusCode::CANCELLED, StatusCode::UNAVAILABLE},
                   what);
      return;
    }
    if (variant == 0) {
      const absl::Time until = absl::Now() + hold;
      while (absl::Now() < until && !shared->stop.load()) {
        absl::SleepFor(std::min(absl::Milliseconds(100), until - absl::Now()));
      }
      const absl::Duration idle = absl::Now() - (until - hold);
      // A write tells whether the node has closed the stream meanwhile.
      chunk.set_data(Megabyte().substr(0, 1024));
      if (!writer->Write(chunk)) {
        const grpc::Status s = writer->Finish();
        check.Record(kind, s, start);
        // UNAVAILABLE: the node's gRPC reclaimed the connection's memory and closed it.
        check.Expect(kind, s,
                     {StatusCode::DEADLINE_EXCEEDED, StatusCode::CANCELLED,
                      StatusCode::RESOURCE_EXHAUSTED, StatusCode::UNAVAILABLE},
                     absl::StrCat(what, ", idle ", absl::FormatDuration(idle)));
        return;
      }
      if (shared->support.stream_idle_timeout &&
          idle > absl::Milliseconds(shared->options.stream_idle_timeout_ms) + absl::Seconds(3)) {
        check.Fail(kind, absl::StrCat(what, ": still open after ", absl::FormatDuration(idle),
                                      " without a message (--stream-idle-timeout-ms=",
                                      shared->options.stream_idle_timeout_ms, ")"));
      }
      context.TryCancel();
      const grpc::Status s = writer->Finish();
      check.Record(kind, s, start);
      check.Expect(kind, s,
                   {StatusCode::CANCELLED, StatusCode::DEADLINE_EXCEEDED, StatusCode::UNAVAILABLE},
                   what);
      return;
    }
    if (variant == 1) {
      writer->WritesDone();
      const grpc::Status s = writer->Finish();
      check.Record(kind, s, start);
      check.Expect(
          kind, s,
          {StatusCode::INVALID_ARGUMENT, StatusCode::RESOURCE_EXHAUSTED, StatusCode::UNAVAILABLE},
          what);
      return;
    }
    context.TryCancel();
    const grpc::Status s = writer->Finish();
    check.Record(kind, s, start);
    check.Expect(kind, s, {StatusCode::CANCELLED, StatusCode::UNAVAILABLE}, what);
  });
  if (!submitted) HBadStreamInline();
}

void Client::HAbandonRead() {
  const std::string kind = "h:Read.abandoned";
  const int n = static_cast<int>(Rand(2));
  v1::ReadRequest request;
  request.set_cache(kStreamCache);
  request.set_seq(kFixtureSeq);
  request.set_max_chunk_bytes(64 << 10);
  int messages = 0;
  int32_t listed = 0;
  const grpc::Status s = Rpc(kind, [&](grpc::ClientContext* c) {
    auto reader = hcache_[n]->Read(c, request);
    v1::ReadResponse message;
    const int keep = RandIn(1, 8);
    while (messages < keep && reader->Read(&message)) {
      if (messages == 0) listed = message.header().groups(0).positions_size();
      ++messages;
    }
    c->TryCancel();
    return reader->Finish();
  });
  const std::string what =
      absl::StrCat("read of the stream fixture on ", Where(n), " after ", messages, " messages");
  if (!Expect(kind, s, {StatusCode::CANCELLED, StatusCode::OK}, what)) return;
  if (messages > 0 && listed != kStreamFixtureTokens) {
    Fail(kind, absl::StrCat(what, ": the header lists ", listed, " positions, expected ",
                            kStreamFixtureTokens));
  }
}

void Client::HStalledRead() {
  const int n = static_cast<int>(Rand(2));
  Shared* shared = shared_;
  // A connection of its own, as an attacker's would be: whatever the node does to it must not
  // be blamed on (or spare) the honest calls of this client.
  const std::string address = shared_->nodes[n].address;
  const int salt = 100000 + index_ * 1000 + static_cast<int>(Rand(1000));
  const int client = index_;
  const std::string where = Where(n);
  const bool submitted = shared_->slow->TrySubmit([=](Recorder* recorder) {
    Checker check(shared, recorder, client);
    const std::string kind = "h:Read.stalled";
    auto stub = v1::CacheService::NewStub(NewChannel(address, salt));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
    v1::ReadRequest request;
    request.set_cache(kStreamCache);
    request.set_seq(kFixtureSeq);
    request.set_max_chunk_bytes(16 << 10);
    const absl::Time start = absl::Now();
    auto reader = stub->Read(&context, request);
    v1::ReadResponse message;
    reader->Read(&message);
    // Stops reading: the node's writes wait on flow control until the deadline ends the call.
    absl::SleepFor(absl::Seconds(3));
    const grpc::Status s = reader->Finish();
    check.Record(kind, s, start);
    check.Expect(kind, s, {StatusCode::DEADLINE_EXCEEDED, StatusCode::OK, StatusCode::UNAVAILABLE},
                 absl::StrCat("stalled read of the stream fixture on ", where));
  });
  if (!submitted) HAbandonRead();
}

void Client::HOversizedMessage() {
  const std::string kind = "h:Append.oversized_message";
  const int n = static_cast<int>(Rand(2));
  v1::AppendRequest request;
  request.set_cache(kStreamCache);
  v1::Token* token = request.add_tokens();
  token->set_seq(1);
  token->set_pos(0);
  request.mutable_payload()->assign(
      static_cast<size_t>(shared_->options.max_message_bytes + (1 << 20)), 'z');
  v1::AppendResponse response;
  const grpc::Status s =
      Rpc(kind, [&](grpc::ClientContext* c) { return hcache_[n]->Append(c, request, &response); });
  // gRPC refuses a message above --max-message-bytes (docs/api.md).
  Expect(kind, s, {StatusCode::RESOURCE_EXHAUSTED},
         absl::StrCat(request.payload().size(), "-byte Append on ", Where(n)));
}

void Client::HPeer() {
  const int n = static_cast<int>(Rand(2));
  const int m = 1 - n;
  v1::PeerService::Stub& peer = *hpeer_[n];
  // Without a token file every caller is the tenant "default" (development mode).
  v1::ExportRequest exp;
  exp.set_cache(kStreamCache);
  *exp.mutable_spec() = shared_->stream_spec;
  exp.set_receiver(shared_->nodes[m].name);
  exp.mutable_sequence()->set_seq(kFixtureSeq);
  exp.set_transport("grpc-stream");
  exp.set_tenant("default");
  const int op = static_cast<int>(Rand(10));
  std::string kind;
  Codes expected;
  grpc::Status s;
  v1::ExportResponse exported;
  auto call_export = [&] {
    s = Rpc(kind, [&](grpc::ClientContext* c) { return peer.Export(c, exp, &exported); });
  };
  switch (op) {
    case 0:
      kind = "h:Export.unknown_transport";
      exp.set_transport(Chance(50) ? "carrier-pigeon" : std::string(40, 'q'));
      expected = kInvalid;
      call_export();
      break;
    case 1:
      kind = "h:Export.nccl_on_host";
      exp.set_transport("nccl");
      expected = {StatusCode::INVALID_ARGUMENT, StatusCode::FAILED_PRECONDITION};
      call_export();
      break;
    case 2:
      kind = "h:Export.not_member";
      exp.set_receiver("mallory");
      expected = {StatusCode::INVALID_ARGUMENT, StatusCode::PERMISSION_DENIED,
                  StatusCode::FAILED_PRECONDITION};
      call_export();
      break;
    case 3:
      // A member may export under a lease (development mode: no peer identity to check), but
      // the lease is capped and the pool bounded: never released, it must expire.
      kind = "h:Export.unreleased";
      // The long fixture (512 KiB): the pinned copies take a slice of the snapshot pool, not
      // all of it (members are trusted not to hoard it).
      exp.set_cache(kLongCache);
      *exp.mutable_spec() = shared_->long_spec;
      exp.set_lease_ms(10 * 60 * 1000);
      expected = {StatusCode::OK, StatusCode::RESOURCE_EXHAUSTED};
      call_export();
      if (s.ok() && shared_->support.max_lease &&
          exported.lease_ms() > shared_->options.max_lease_ms) {
        Fail(kind, absl::StrCat("lease of ", exported.lease_ms(), " ms granted on ", Where(n),
                                " with --max-lease-ms=", shared_->options.max_lease_ms));
      }
      break;
    case 4:
      kind = "h:Export.spec_mismatch";
      exp.mutable_spec()->set_max_batch(exp.spec().max_batch() - 1);
      expected = {StatusCode::FAILED_PRECONDITION};
      call_export();
      break;
    case 5:
      kind = "h:Export.unknown_seq";
      exp.mutable_sequence()->set_seq(12345);
      expected = {StatusCode::OK};
      call_export();
      if (s.ok() && (!exported.empty() || !exported.lease_id().empty())) {
        Fail(kind, absl::StrCat("export of a sequence that stores nothing: ",
                                exported.ShortDebugString()));
      }
      break;
    case 6: {
      // Lease ids must not be guessable: small ones (sequential ids) and random ones.
      kind = "h:Fetch.guessed_lease";
      v1::FetchRequest request;
      request.set_lease_id(Chance(50) ? absl::StrCat(1 + Rand(256))
                                      : absl::StrCat(absl::Hex(rng_(), absl::kZeroPad16),
                                                     absl::Hex(rng_(), absl::kZeroPad16)));
      int64_t data = 0;
      s = Rpc(kind, [&](grpc::ClientContext* c) {
        auto reader = peer.Fetch(c, request);
        v1::Chunk chunk;
        while (reader->Read(&chunk)) data += static_cast<int64_t>(chunk.data().size());
        return reader->Finish();
      });
      expected = {StatusCode::NOT_FOUND};
      if (data > 0) {
        Fail(kind, absl::StrCat("lease '", request.lease_id(), "' guessed on ", Where(n), ": ",
                                data, " bytes of another node's export"));
      }
      break;
    }
    case 7: {
      kind = "h:Release.guessed_lease";
      v1::ReleaseRequest request;
      request.set_lease_id(Chance(50) ? absl::StrCat(1 + Rand(256))
                                      : absl::StrCat(absl::Hex(rng_(), absl::kZeroPad16),
                                                     absl::Hex(rng_(), absl::kZeroPad16)));
      v1::ReleaseResponse response;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return peer.Release(c, request, &response); });
      expected = {StatusCode::NOT_FOUND};
      break;
    }
    case 8: {
      kind = "h:Pull.not_member";
      v1::PullRequest request;
      request.set_cache(own_.name);
      request.set_source_node("mallory");
      request.mutable_sequence()->set_seq(0);
      request.set_target_seq(0);
      request.set_tenant("default");
      v1::PullResponse response;
      s = Rpc(kind, [&](grpc::ClientContext* c) { return peer.Pull(c, request, &response); });
      expected = {StatusCode::INVALID_ARGUMENT, StatusCode::PERMISSION_DENIED,
                  StatusCode::FAILED_PRECONDITION};
      break;
    }
    default: {
      kind = "h:NcclConnect.host";
      v1::NcclConnectRequest request;
      request.set_from_node(shared_->nodes[m].name);
      request.set_unique_id(std::string(128, '\0'));
      v1::NcclConnectResponse response;
      s = Rpc(kind,
              [&](grpc::ClientContext* c) { return peer.NcclConnect(c, request, &response); });
      expected = {StatusCode::FAILED_PRECONDITION};
      break;
    }
  }
  Expect(kind, s, expected, absl::StrCat("peer call on ", Where(n)));
  // A Pull names the own cache: it must come out unchanged.
  if (op == 8 && own_.nodes[n].exists) CheckUnchanged(n, kind, "pull from a non-member");
}

}  // namespace soak
}  // namespace kvmesh

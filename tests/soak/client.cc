// Client: the call helpers, the rate loop and the verified operations (see client.h).
#include "tests/soak/client.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "grpcpp/create_channel.h"
#include "service/common/convert.h"
#include "tests/integration/client_util.h"

namespace kvmesh {
namespace soak {
namespace {

using grpc::StatusCode;
using testutil::StateId;
using testutil::TokenId;

// Error messages longer than this are a failure: kvmesh names bad values, but must never echo
// what a client sent (a 10 KB name would no longer fit in gRPC's metadata).
constexpr size_t kMaxMessageBytes = 2048;

constexpr int kMaxSnapshots = 6;  // per node of the client's own cache
constexpr int64_t kSeqIds = 10;   // sequence ids the client uses: more than max_sequences

// `what` with the status that refused it, for failures found after the refusal.
std::string Refused(const std::string& what, const grpc::Status& status) {
  return absl::StrCat(what, " -> ", CodeName(status.error_code()), ": ",
                      Short(status.error_message(), 300));
}

bool Contains(const Codes& codes, StatusCode code) {
  return std::find(codes.begin(), codes.end(), code) != codes.end();
}

std::string CodesText(const Codes& codes) {
  std::vector<std::string> names;
  for (StatusCode c : codes) names.push_back(CodeName(c));
  return absl::StrJoin(names, "|");
}

// A cache whose sequence 0 holds positions [0, n) appended with `seed`, never changed.
CacheModel FixtureModel(const v1::CacheSpec& spec, int32_t n, uint64_t seed) {
  CacheModel model;
  model.name = spec.name();
  model.spec = spec;
  model.engine = testutil::EngineSpec(spec);
  SeqModel seq;
  for (int32_t p = 0; p < n; ++p) seq.rows[p] = Row{TokenId(kFixtureSeq, p, seed), p, 0};
  for (NodeModel& node : model.nodes) {
    node.exists = true;
    node.seqs[kFixtureSeq] = seq;
  }
  return model;
}

// Ambiguous results: the call may or may not have changed the cache.
bool IsAmbiguous(StatusCode code) {
  return code == StatusCode::DEADLINE_EXCEEDED || code == StatusCode::UNAVAILABLE ||
         code == StatusCode::CANCELLED;
}

}  // namespace

const CacheModel& LongFixtureModel(const Shared& shared) {
  static const CacheModel* model = new CacheModel(
      FixtureModel(shared.long_spec, shared.options.long_positions, shared.long_seed));
  return *model;
}

const CacheModel& StreamFixtureModel(const Shared& shared) {
  static const CacheModel* model =
      new CacheModel(FixtureModel(shared.stream_spec, kStreamFixtureTokens, shared.stream_seed));
  return *model;
}

std::string Short(const std::string& text, size_t n) {
  return text.size() <= n ? text : absl::StrCat(text.substr(0, n), "... (", text.size(), " bytes)");
}

std::shared_ptr<grpc::Channel> NewChannel(const std::string& address, int salt) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetInt("kvmesh.soak_client", salt);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

Client::Client(Shared* shared, int index)
    : shared_(shared),
      index_(index),
      rng_(shared->options.seed * 1000003 + static_cast<uint64_t>(index)),
      check_(shared, &recorder_, index) {
  for (int n = 0; n < 2; ++n) {
    channels_[n] = NewChannel(shared->nodes[n].address, index * 4 + n);
    cache_[n] = v1::CacheService::NewStub(channels_[n]);
    peer_[n] = v1::PeerService::NewStub(channels_[n]);
    hostile_channels_[n] = NewChannel(shared->nodes[n].address, index * 4 + 2 + n);
    hcache_[n] = v1::CacheService::NewStub(hostile_channels_[n]);
    hpeer_[n] = v1::PeerService::NewStub(hostile_channels_[n]);
  }
}

// ---- calls and checks -------------------------------------------------------------------------

void Checker::Record(const std::string& kind, const grpc::Status& status, absl::Time start) {
  recorder_->Record(kind, status.error_code(), absl::ToDoubleMicroseconds(absl::Now() - start));
  if (status.error_code() == StatusCode::INTERNAL || status.error_code() == StatusCode::UNKNOWN) {
    Fail(kind, absl::StrCat(CodeName(status.error_code()), ": ", Short(status.error_message())));
  } else if (status.error_message().size() > kMaxMessageBytes) {
    Fail(kind, absl::StrCat("an error message of ", status.error_message().size(),
                            " bytes: ", Short(status.error_message(), 120)));
  }
}

bool InflightRefusal(const grpc::Status& status) {
  if (status.error_code() != StatusCode::RESOURCE_EXHAUSTED) return false;
  const std::string& m = status.error_message();
  // kvmesh's own refusal of a request that fits the budget but not now, and gRPC's, when its
  // quarter of the budget cannot hold a message being received (docs/api.md, "In-flight
  // budget"). A request larger than the whole budget is not one of these.
  return (m.find("in-flight budget") != std::string::npos &&
          m.find("retry later") != std::string::npos) ||
         m.find("RST_STREAM") != std::string::npos;
}

bool Checker::Expect(const std::string& kind, const grpc::Status& status, const Codes& allowed,
                     const std::string& what) {
  if (client_ == shared_->options.trace_client) {
    std::fprintf(stderr, "soak: trace [client %d] %s: %s -> %s %s\n", client_, kind.c_str(),
                 what.c_str(), CodeName(status.error_code()).c_str(),
                 Short(status.error_message(), 200).c_str());
  }
  if (Contains(allowed, status.error_code())) return true;
  if (InflightRefusal(status)) {
    // Hostile streams may hold the node's in-flight budget: any request that carries or returns
    // data may then be refused at once, having changed nothing. Not a match (the caller leaves
    // its model as it is), not a failure.
    shared_->inflight_refusals.fetch_add(1);
    return false;
  }
  // INTERNAL and UNKNOWN are reported by Record already.
  if (status.error_code() != StatusCode::INTERNAL && status.error_code() != StatusCode::UNKNOWN) {
    Fail(kind, absl::StrCat(what, ": got ", CodeName(status.error_code()), ": ",
                            Short(status.error_message()), "; expected ", CodesText(allowed)));
  }
  return false;
}

void Checker::Fail(const std::string& kind, const std::string& what) {
  recorder_->CountUnexpected(kind);
  shared_->failures.Add(absl::StrCat("[client ", client_, "] ", kind, ": ", what));
}

bool Client::Expect(const std::string& kind, const grpc::Status& status, const Codes& allowed,
                    const std::string& what) {
  if (shared_->options.check_every_op && !in_hostile_ && op_calls_.size() < 6) {
    op_calls_.push_back(Refused(absl::StrCat(kind, " ", what), status));
  }
  if (in_hostile_ && status.error_code() == StatusCode::UNAVAILABLE &&
      std::find(allowed.begin(), allowed.end(), StatusCode::UNAVAILABLE) == allowed.end()) {
    // The node (its gRPC) closed the attacker's connection: an acceptable end for a hostile call.
    shared_->hostile_drops.fetch_add(1);
    return false;
  }
  if (!in_hostile_ && status.error_code() == StatusCode::UNAVAILABLE) {
    shared_->honest_unavailable.fetch_add(1);
  }
  if (!in_hostile_ && kind.rfind("v:", 0) == 0 && status.error_code() != StatusCode::OK &&
      status.error_message().find("RST_STREAM") != std::string::npos &&
      !Contains(allowed, status.error_code())) {
    // gRPC's quota cancels calls itself, and nothing says it does so before the handler has
    // run: the caches must be as the model says, as after any refusal.
    shared_->quota_cancels.fetch_add(1);
    check_.Expect(kind, status, allowed, what);  // counts the refusal
    for (int node = 0; node < 2; ++node) {
      CheckUnchanged(
          node, kind,
          absl::StrCat(what, " (cancelled by gRPC: ", Short(status.error_message(), 80), ")"));
    }
    return false;
  }
  return check_.Expect(kind, status, allowed, what);
}

grpc::Status Client::Rpc(const std::string& kind,
                         const std::function<grpc::Status(grpc::ClientContext*)>& call,
                         absl::Duration timeout) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  const absl::Time start = absl::Now();
  const grpc::Status status = call(&context);
  check_.Record(kind, status, start);
  return status;
}

std::string Client::Where(int node) const {
  return absl::StrCat("node ", shared_->nodes[node].name);
}

uint64_t Client::Rand(uint64_t n) { return n == 0 ? 0 : rng_() % n; }

int32_t Client::RandIn(int32_t lo, int32_t hi) {
  return hi <= lo ? lo : lo + static_cast<int32_t>(Rand(static_cast<uint64_t>(hi - lo) + 1));
}

bool Client::Chance(int percent) { return static_cast<int>(Rand(100)) < percent; }

uint64_t Client::NextSeed() {
  return (shared_->options.seed << 48) ^ (static_cast<uint64_t>(index_ + 1) << 36) ^
         ++seed_counter_;
}

void Client::VerifyFixtures() {
  for (int n = 0; n < 2; ++n) {
    for (const CacheModel* fixture : {&LongFixtureModel(*shared_), &StreamFixtureModel(*shared_)}) {
      ReadAndCheck("final:Read.fixture", n, fixture->name, kFixtureSeq, *fixture,
                   &fixture->nodes[n].seqs.at(kFixtureSeq), 0, std::nullopt);
    }
  }
}

void Client::DeleteAllCaches() {
  for (int n = 0; n < 2; ++n) {
    v1::ListCachesResponse list;
    grpc::Status s = Rpc("final:ListCaches", [&](grpc::ClientContext* c) {
      return cache_[n]->ListCaches(c, v1::ListCachesRequest(), &list);
    });
    if (!Expect("final:ListCaches", s, {StatusCode::OK}, Where(n))) continue;
    for (const v1::CacheInfo& info : list.caches()) {
      v1::DeleteCacheRequest request;
      request.set_cache(info.spec().name());
      v1::DeleteCacheResponse response;
      s = Rpc("final:DeleteCache", [&](grpc::ClientContext* c) {
        return cache_[n]->DeleteCache(c, request, &response);
      });
      Expect("final:DeleteCache", s, {StatusCode::OK},
             absl::StrCat("delete ", info.spec().name(), " on ", Where(n)));
    }
    s = Rpc("final:ListCaches", [&](grpc::ClientContext* c) {
      return cache_[n]->ListCaches(c, v1::ListCachesRequest(), &list);
    });
    if (Expect("final:ListCaches", s, {StatusCode::OK}, Where(n)) && list.caches_size() != 0) {
      Fail("final:ListCaches", absl::StrCat(Where(n), " still has ", list.caches_size(),
                                            " caches after deleting every one"));
    }
  }
}

// ---- the rate loop ----------------------------------------------------------------------------

void Client::Run(absl::Time end) {
  const Options& o = shared_->options;
  const absl::Duration interval = absl::Seconds(static_cast<double>(o.clients) / o.rate);
  absl::Time next = absl::Now() + interval * (static_cast<double>(index_) / o.clients);
  Recreate("start");
  while (!shared_->stop.load() && next < end) {
    const absl::Time now = absl::Now();
    if (now < next) {
      absl::SleepFor(next - now);
    } else if (now - next > absl::Seconds(1)) {
      // Fell behind (a slow call): the missed slots are counted, not made up in a burst.
      shared_->slots_missed.fetch_add(static_cast<int64_t>((now - next) / interval));
      next = now;
    }
    shared_->ops_started.fetch_add(1);
    if (needs_resync_) {
      needs_resync_ = false;
      Recreate("resync");
      next += interval;
      continue;
    }
    const int draw = static_cast<int>(Rand(100));
    if (draw < o.hostile_percent) {
      in_hostile_ = true;
      Hostile();
      in_hostile_ = false;
    } else if (draw < o.hostile_percent + o.chaos_percent) {
      Chaos();
    } else {
      Verified();
    }
    next += interval;
  }
}

// ---- verified: the client's own cache ---------------------------------------------------------

void Client::CreateOwn(int node) {
  const std::string kind = "v:CreateCache";
  v1::CreateCacheRequest request;
  *request.mutable_spec() = own_.spec;
  v1::CreateCacheResponse response;
  const grpc::Status s = Rpc(kind, [&](grpc::ClientContext* c) {
    return cache_[node]->CreateCache(c, request, &response);
  });
  if (IsAmbiguous(s.error_code())) {
    // Not a resync (which would create again, and again while a node is down): the next
    // CreateOwn accepts a cache that exists already.
    if (s.error_code() == StatusCode::DEADLINE_EXCEEDED) {
      Fail(kind, absl::StrCat("no answer within ", absl::FormatDuration(kCallTimeout), " from ",
                              Where(node)));
    }
    create_uncertain_[node] = true;
    return;
  }
  // The memory budget is shared with the other clients' caches and the scratch caches.
  if (!Expect(kind, s, {StatusCode::OK, StatusCode::RESOURCE_EXHAUSTED},
              absl::StrCat("create ", own_.name, " on ", Where(node)))) {
    return;
  }
  if (s.ok()) {
    if (!response.created() && !create_uncertain_[node]) {
      Fail(kind, absl::StrCat(own_.name, " on ", Where(node), " existed already"));
    }
    create_uncertain_[node] = false;
    own_.nodes[node] = NodeModel();
    own_.nodes[node].exists = true;
    max_snapshot_id_[node] = 0;
  }
}

void Client::Recreate(const std::string& why) {
  for (int n = 0; n < 2; ++n) {
    if (own_.name.empty()) break;
    const std::string kind = "v:DeleteCache";
    v1::DeleteCacheRequest request;
    request.set_cache(own_.name);
    v1::DeleteCacheResponse response;
    const grpc::Status s = Rpc(kind, [&](grpc::ClientContext* c) {
      return cache_[n]->DeleteCache(c, request, &response);
    });
    // After an ambiguous call the model may be wrong about the cache's existence too; a node
    // that does not answer is left for the sampler to report.
    const Codes allowed = why == "resync" || create_uncertain_[n]
                              ? Codes{StatusCode::OK, StatusCode::NOT_FOUND,
                                      StatusCode::UNAVAILABLE, StatusCode::DEADLINE_EXCEEDED}
                          : own_.nodes[n].exists ? Codes{StatusCode::OK}
                                                 : Codes{StatusCode::NOT_FOUND};
    Expect(kind, s, allowed, absl::StrCat("delete ", own_.name, " on ", Where(n), " (", why, ")"));
  }
  create_uncertain_ = {false, false};
  ++generation_;
  own_ = CacheModel();
  own_.name = absl::StrCat("soak-c", index_, "-g", generation_);
  own_.flavour = Chance(50) ? Flavour::kAttention : Flavour::kHybrid;
  own_.spec = ModelSpec(own_.name, own_.flavour);
  own_.engine = testutil::EngineSpec(own_.spec);
  max_snapshot_id_ = {0, 0};
  for (int n = 0; n < 2; ++n) CreateOwn(n);
}

void Client::Resync(const std::string& why) {
  // Deferred to the rate loop: a resync can be found deep inside an operation (a check after a
  // refusal, a call of Recreate itself), and recreating there would pull the cache from under
  // the callers.
  if (!needs_resync_) shared_->resyncs.fetch_add(1);
  needs_resync_ = true;
  (void)why;
}

bool Client::Ambiguous(const grpc::Status& status, const std::string& kind) {
  if (!IsAmbiguous(status.error_code())) return false;
  if (status.error_code() == StatusCode::UNAVAILABLE) {
    (in_hostile_ ? shared_->hostile_drops : shared_->honest_unavailable).fetch_add(1);
    // Honest calls have connections of their own (hostile ones use others), the node is up (the
    // sampler watches it) and far from its executor queue's limit: nothing should refuse them.
    if (!in_hostile_) {
      Fail(kind, absl::StrCat("UNAVAILABLE from a running node: ", Short(status.error_message()),
                              " (", own_.name, ")"));
    }
  }
  if (shared_->ambiguous_notes.fetch_add(1) < 20) {
    std::fprintf(stderr, "soak: note: [client %d] %s on %s ended %s: %s; recreating the cache\n",
                 index_, kind.c_str(), own_.name.c_str(), CodeName(status.error_code()).c_str(),
                 Short(status.error_message()).c_str());
  }
  // Within kCallTimeout on loopback only a hung node gets here: a failure, then a fresh cache.
  if (status.error_code() == StatusCode::DEADLINE_EXCEEDED) {
    Fail(kind, absl::StrCat("no answer within ", absl::FormatDuration(kCallTimeout), ": ",
                            Short(status.error_message())));
  }
  Resync(kind);
  return true;
}

int64_t Client::PickSeq(const NodeModel& node, int live_percent) {
  if (!node.seqs.empty() && Chance(live_percent)) {
    auto it = node.seqs.begin();
    std::advance(it, static_cast<long>(Rand(node.seqs.size())));
    return it->first;
  }
  return static_cast<int64_t>(Rand(kSeqIds));
}

std::vector<int32_t> Client::AppendPositions(const SeqModel* seq, int32_t count) {
  std::vector<int32_t> positions;
  const int32_t offset = seq == nullptr ? 0 : seq->offset();
  if (own_.hybrid()) {
    for (int32_t i = 0; i < count; ++i) positions.push_back(offset + i);
    return positions;
  }
  // Attention only: any position not stored yet; sometimes the gaps below the offset.
  if (seq != nullptr && Chance(25)) {
    for (int32_t p = 0; p < offset && static_cast<int32_t>(positions.size()) < count; ++p) {
      if (seq->rows.count(p) == 0 && Chance(60)) positions.push_back(p);
    }
  }
  int32_t next = offset + (Chance(30) ? RandIn(1, 3) : 0);
  while (static_cast<int32_t>(positions.size()) < count) {
    positions.push_back(next);
    next += Chance(20) ? RandIn(2, 4) : 1;
  }
  return positions;
}

void Client::Verified() {
  for (int n = 0; n < 2; ++n) {
    if (!own_.nodes[n].exists) {
      CreateOwn(n);
      return;
    }
  }
  op_calls_.clear();
  VerifiedOp();
  if (shared_->options.check_every_op && !op_calls_.empty()) {
    // Pins a divergence on the operation that caused it, at the cost of four calls.
    const std::string op = absl::StrJoin(op_calls_, "; ");
    for (int n = 0; n < 2; ++n) CheckUnchanged(n, "v:check_every_op", op);
  }
}

void Client::VerifiedOp() {
  const int draw = static_cast<int>(Rand(1000));
  // Weights in per mille.
  if (draw < 120) return VAppend(false);
  if (draw < 180) return VAppend(true);
  if (draw < 300) return VRead();
  if (draw < 340) return VReadFixture();
  if (draw < 400) return VVisible();
  if (draw < 460) return VCopyLocal();
  if (draw < 510) return VCopyRemote();
  if (draw < 560) return VRemove(false);
  if (draw < 610) return VRemove(true);
  if (draw < 640) return VCanResume();
  if (draw < 670) return VListSequences();
  if (draw < 690) return VGetCache();
  if (draw < 750) return VSnapshot();
  if (draw < 800) return VRestore();
  if (draw < 815) return VRestoreLive();
  if (draw < 835) return VMerge();
  if (draw < 855) return VSplit();
  if (draw < 875) return VDrop();
  if (draw < 895) return VListSnapshots();
  if (draw < 935) return VMigrate();
  if (draw < 955) return VMigrateSnapshot();
  if (draw < 992) return VSpeculate();
  return Recreate("recreate");
}

void Client::VAppend(bool stream) {
  const std::string kind = stream ? "v:AppendStream" : "v:Append";
  const int n = static_cast<int>(Rand(2));
  NodeModel& node = own_.nodes[n];
  const int64_t seq = PickSeq(node, 70);
  auto it = node.seqs.find(seq);
  SeqModel* model = it == node.seqs.end() ? nullptr : &it->second;
  const int32_t stored = model == nullptr ? 0 : static_cast<int32_t>(model->rows.size());
  if (stored + 1 > kMaxRows || (model != nullptr && model->offset() > 4 * kModelCapacity)) {
    return VRemove(false);  // keep the sequence within the pool's half (model.h)
  }
  const int32_t count = RandIn(1, std::min(kModelMaxBatch, kMaxRows - stored));
  const std::vector<int32_t> positions = AppendPositions(model, count);
  const uint64_t seed = NextSeed();
  const v1::AppendRequest request = testutil::MakeAppend(own_.spec, seq, positions, seed);
  const bool full =
      model == nullptr && static_cast<int32_t>(node.seqs.size()) >= kModelMaxSequences;
  v1::AppendResponse response;
  grpc::Status s;
  if (stream) {
    const size_t size = request.payload().size();
    const std::vector<v1::AppendStreamRequest> messages =
        testutil::StreamMessages(request, Rand(size + 1), 1 + Rand(std::max<size_t>(1, size / 2)));
    s = Rpc(kind, [&](grpc::ClientContext* c) {
      auto writer = cache_[n]->AppendStream(c, &response);
      for (const v1::AppendStreamRequest& m : messages) {
        if (!writer->Write(m)) break;
      }
      writer->WritesDone();
      return writer->Finish();
    });
  } else {
    s = Rpc(kind, [&](grpc::ClientContext* c) { return cache_[n]->Append(c, request, &response); });
  }
  if (Ambiguous(s, kind)) return;
  const std::string what =
      absl::StrCat("append ", positions.size(), " tokens [", absl::StrJoin(positions, ","),
                   "] to seq ", seq, " of ", own_.name, " on ", Where(n));
  if (!Expect(kind, s, {full ? StatusCode::RESOURCE_EXHAUSTED : StatusCode::OK}, what) || !s.ok()) {
    return;
  }
  SeqModel& updated = node.seqs[seq];
  for (int32_t p : positions) updated.rows[p] = Row{TokenId(seq, p, seed), p, 0};
  if (own_.hybrid()) {
    updated.state = State::kValid;
    updated.state_id = StateId(seq, positions.back(), seed);
  }
  if (response.usage().sequences_live() != static_cast<int32_t>(node.seqs.size())) {
    Fail(kind, absl::StrCat(what, ": usage says ", response.usage().sequences_live(),
                            " live sequences, the model ", node.seqs.size()));
  }
}

void Client::ReadAndCheck(const std::string& kind, int node, const std::string& cache, int64_t seq,
                          const CacheModel& cache_model, const SeqModel* model, int32_t begin,
                          std::optional<int32_t> end) {
  static constexpr int32_t kChunks[] = {0, 512, 4096, 65536};
  v1::ReadRequest request;
  request.set_cache(cache);
  request.set_seq(seq);
  request.set_begin(begin);
  if (end.has_value()) request.set_end(*end);
  request.set_max_chunk_bytes(kChunks[Rand(4)]);
  v1::ReadHeader header;
  std::string payload;
  bool later_header = false;
  const grpc::Status s = Rpc(kind, [&](grpc::ClientContext* c) {
    auto reader = cache_[node]->Read(c, request);
    v1::ReadResponse message;
    bool first = true;
    while (reader->Read(&message)) {
      if (first) {
        header = message.header();
      } else if (message.has_header()) {
        later_header = true;
      }
      first = false;
      payload += message.data();
    }
    return reader->Finish();
  });
  if (kind.rfind("v:", 0) == 0 && &cache_model == &own_ && Ambiguous(s, kind)) return;
  const std::string what = absl::StrCat("read seq ", seq, " [", begin, ", ",
                                        end.has_value() ? absl::StrCat(*end) : "end", ") of ",
                                        cache, " on ", Where(node));
  if (!Expect(kind, s, {model == nullptr ? StatusCode::NOT_FOUND : StatusCode::OK}, what) ||
      !s.ok()) {
    return;
  }
  if (later_header) Fail(kind, absl::StrCat(what, ": a later message carried a header"));
  const std::string diff = CheckRead(cache_model, *model, begin, end, header, payload);
  if (!diff.empty()) Fail(kind, absl::StrCat(what, ": ", diff));
}

void Client::VRead() {
  const int n = static_cast<int>(Rand(2));
  const NodeModel& node = own_.nodes[n];
  const int64_t seq = PickSeq(node, 85);
  auto it = node.seqs.find(seq);
  const SeqModel* model = it == node.seqs.end() ? nullptr : &it->second;
  const int32_t offset = model == nullptr ? 0 : model->offset();
  const int32_t begin = Chance(50) ? 0 : RandIn(0, offset + 2);
  std::optional<int32_t> end;
  if (Chance(50)) end = RandIn(begin, offset + 3);
  ReadAndCheck("v:Read", n, own_.name, seq, own_, model, begin, end);
}

void Client::VReadFixture() {
  const int n = static_cast<int>(Rand(2));
  const bool long_fixture = Chance(50);
  const CacheModel& fixture =
      long_fixture ? LongFixtureModel(*shared_) : StreamFixtureModel(*shared_);
  const SeqModel& seq = fixture.nodes[n].seqs.at(kFixtureSeq);
  const int32_t offset = seq.offset();
  const int32_t span = long_fixture ? 512 : 32;
  const int32_t begin = RandIn(0, offset - 1);
  std::optional<int32_t> end = begin + RandIn(1, span);
  if (*end >= offset && Chance(50)) end.reset();
  ReadAndCheck("v:Read.fixture", n, fixture.name, kFixtureSeq, fixture, &seq, begin, end);
}

void Client::VVisible() {
  const std::string kind = "v:Visible";
  const int n = static_cast<int>(Rand(2));
  const NodeModel& node = own_.nodes[n];
  // Group 1 of the hybrid flavour is Recurrent: INVALID_ARGUMENT.
  const int group = static_cast<int>(Rand(2));
  const bool invalid = own_.hybrid() && group == 1;
  v1::VisibleRequest request;
  request.set_cache(own_.name);
  request.set_group(group);
  std::vector<const SeqModel*> models;
  const int queries = RandIn(1, 8);
  for (int q = 0; q < queries; ++q) {
    const int64_t seq = PickSeq(node, 80);
    auto it = node.seqs.find(seq);
    const SeqModel* model = it == node.seqs.end() ? nullptr : &it->second;
    v1::Query* query = request.add_queries();
    query->set_seq(seq);
    query->set_pos(RandIn(0, (model == nullptr ? 0 : model->offset()) + 4));
    query->set_non_causal(Chance(25));
    models.push_back(model);
  }
  v1::VisibleResponse response;
  const grpc::Status s =
      Rpc(kind, [&](grpc::ClientContext* c) { return cache_[n]->Visible(c, request, &response); });
  const std::string what =
      absl::StrCat("visible group ", group, " of ", own_.name, " on ", Where(n));
  if (!Expect(kind, s, {invalid ? StatusCode::INVALID_ARGUMENT : StatusCode::OK}, what) ||
      !s.ok()) {
    return;
  }
  if (response.visible_size() != queries) {
    return Fail(kind, absl::StrCat(what, ": ", response.visible_size(), " answers to ", queries,
                                   " queries"));
  }
  for (int q = 0; q < queries; ++q) {
    const v1::Query& query = request.queries(q);
    const std::vector<int32_t> want =
        ExpectedVisible(own_, group, models[q], query.pos(), query.non_causal());
    const std::vector<int32_t> got(response.visible(q).positions().begin(),
                                   response.visible(q).positions().end());
    if (got != want) {
      return Fail(kind, absl::StrCat(what, ": query (seq ", query.seq(), ", pos ", query.pos(),
                                     query.non_causal() ? ", non-causal" : "", ") sees [",
                                     absl::StrJoin(got, ","), "], expected [",
                                     absl::StrJoin(want, ","), "]"));
    }
  }
}

void Client::VCopyLocal() {
  const std::string kind = "v:CopyPrefix.local";
  const int n = static_cast<int>(Rand(2));
  NodeModel& node = own_.nodes[n];
  const int64_t src = PickSeq(node, 85);
  int64_t dst = PickSeq(node, 40);
  const bool same = dst == src;
  auto it = node.seqs.find(src);
  const SeqModel* model = it == node.seqs.end() ? nullptr : &it->second;
  const int32_t offset = model == nullptr ? 0 : model->offset();
  const int32_t length =
      own_.hybrid() && Chance(70) ? RandIn(offset, offset + 2) : RandIn(0, offset + 2);
  SeqModel result;
  if (model != nullptr) {
    if (own_.hybrid()) {
      if (length >= offset) result = *model;
    } else {
      for (const auto& [p, row] : model->rows) {
        if (p < length) result.rows[p] = row;
      }
    }
  }
  Codes expected;
  if (same) {
    expected = {StatusCode::INVALID_ARGUMENT};
  } else {
    const bool precondition = own_.hybrid() && model != nullptr && length < offset;
    const bool full = !result.rows.empty() && node.seqs.count(dst) == 0 &&
                      static_cast<int32_t>(node.seqs.size()) >= kModelMaxSequences;
    if (precondition) expected.push_back(StatusCode::FAILED_PRECONDITION);
    if (full) expected.push_back(StatusCode::RESOURCE_EXHAUSTED);
    if (expected.empty()) expected.push_back(StatusCode::OK);
  }
  v1::CopyPrefixRequest request;
  request.set_cache(own_.name);
  request.set_src_seq(src);
  request.set_dst_seq(dst);
  request.set_length(length);
  if (Chance(20)) request.set_source_node(shared_->nodes[n].name);  // this node: local
  v1::CopyPrefixResponse response;
  const grpc::Status s = Rpc(
      kind, [&](grpc::ClientContext* c) { return cache_[n]->CopyPrefix(c, request, &response); });
  if (Ambiguous(s, kind)) return;
  const std::string what = absl::StrCat("copy seq ", src, " -> ", dst, " length ", length, " of ",
                                        own_.name, " on ", Where(n));
  if (!Expect(kind, s, expected, what) || !s.ok()) {
    // Refused: nothing may have changed.
    for (int node : {n}) CheckUnchanged(node, kind, Refused(what, s));
    return;
  }
  if (result.rows.empty()) {
    node.seqs.erase(dst);
  } else {
    node.seqs[dst] = result;
  }
}

void Client::VCopyRemote() {
  const std::string kind = "v:CopyPrefix.remote";
  const int n = static_cast<int>(Rand(2));  // destination
  const int m = 1 - n;                      // source
  NodeModel& node = own_.nodes[n];
  const int64_t src = PickSeq(own_.nodes[m], 85);
  const int64_t dst = Chance(30) ? src : PickSeq(node, 40);
  auto it = own_.nodes[m].seqs.find(src);
  const SeqModel* model = it == own_.nodes[m].seqs.end() ? nullptr : &it->second;
  const int32_t offset = model == nullptr ? 0 : model->offset();
  const int32_t length = Chance(5)                     ? 0
                         : own_.hybrid() && Chance(80) ? RandIn(offset, offset + 2)
                                                       : RandIn(0, offset + 2);
  SeqModel result;
  bool precondition = false;
  if (model != nullptr && length > 0) {
    if (own_.hybrid()) {
      precondition = model->state == State::kInvalid || length < offset;
      result = *model;
    } else {
      for (const auto& [p, row] : model->rows) {
        if (p < length) result.rows[p] = row;
      }
    }
  }
  // When both a precondition and max_sequences refuse the copy, either may be reported (the
  // receiver may learn of the length only once the data is there).
  const bool full = !result.rows.empty() && node.seqs.count(dst) == 0 &&
                    static_cast<int32_t>(node.seqs.size()) >= kModelMaxSequences;
  Codes expected;
  if (precondition) expected.push_back(StatusCode::FAILED_PRECONDITION);
  if (full) expected.push_back(StatusCode::RESOURCE_EXHAUSTED);
  if (expected.empty()) expected.push_back(StatusCode::OK);
  // The snapshot pools of both nodes are shared with everyone (exports included).
  if (!precondition && !result.rows.empty()) expected.push_back(StatusCode::RESOURCE_EXHAUSTED);
  v1::CopyPrefixRequest request;
  request.set_cache(own_.name);
  request.set_src_seq(src);
  request.set_dst_seq(dst);
  request.set_length(length);
  request.set_source_node(shared_->nodes[m].name);
  v1::CopyPrefixResponse response;
  const grpc::Status s = Rpc(
      kind, [&](grpc::ClientContext* c) { return cache_[n]->CopyPrefix(c, request, &response); });
  if (Ambiguous(s, kind)) return;
  const std::string what = absl::StrCat("copy seq ", src, " of ", Where(m), " -> seq ", dst, " of ",
                                        Where(n), " length ", length, " (", own_.name, ")");
  if (!Expect(kind, s, expected, what) || !s.ok()) {
    // Refused: nothing may have changed.
    for (int node : {n, m}) CheckUnchanged(node, kind, Refused(what, s));
    return;
  }
  if (result.rows.empty()) {
    node.seqs.erase(dst);
  } else {
    node.seqs[dst] = result;
    if (response.transfer().transport() != "grpc-stream" || response.transfer().bytes() <= 0) {
      Fail(kind, absl::StrCat(what, ": transfer ", response.transfer().ShortDebugString()));
    }
  }
}

void Client::VRemove(bool middle) {
  const std::string kind = middle ? "v:Remove.middle" : "v:Remove.truncate";
  const int n = static_cast<int>(Rand(2));
  NodeModel& node = own_.nodes[n];
  const int64_t seq = PickSeq(node, 90);
  auto it = node.seqs.find(seq);
  const int32_t offset = it == node.seqs.end() ? 0 : it->second.offset();
  const int32_t begin = RandIn(0, std::max(0, offset - 1));
  std::optional<int32_t> end;
  if (middle) {
    end = own_.hybrid() ? RandIn(begin, offset) : RandIn(begin, offset + 3);
    if (own_.hybrid() && *end < begin) end = begin;
  }
  v1::RemoveRequest request;
  request.set_cache(own_.name);
  request.set_seq(seq);
  request.set_begin(begin);
  if (end.has_value()) request.set_end(*end);
  v1::RemoveResponse response;
  const grpc::Status s =
      Rpc(kind, [&](grpc::ClientContext* c) { return cache_[n]->Remove(c, request, &response); });
  if (Ambiguous(s, kind)) return;
  const std::string what =
      absl::StrCat("remove [", begin, ", ", end.has_value() ? absl::StrCat(*end) : "end",
                   ") of seq ", seq, " of ", own_.name, " on ", Where(n));
  if (!Expect(kind, s, {StatusCode::OK}, what)) return;
  if (it != node.seqs.end() && !ApplyRemove(own_.flavour, &it->second, begin, end)) {
    node.seqs.erase(it);
  }
}

void Client::VCanResume() {
  const std::string kind = "v:CanResume";
  const int n = static_cast<int>(Rand(2));
  const NodeModel& node = own_.nodes[n];
  const int64_t seq = PickSeq(node, 80);
  auto it = node.seqs.find(seq);
  const SeqModel* model = it == node.seqs.end() ? nullptr : &it->second;
  const int32_t offset = model == nullptr ? 0 : model->offset();
  const int32_t pos = Chance(40) ? offset : RandIn(0, offset + 2);
  // Full and chunked Attention can always resume; a Recurrent state only at its offset.
  bool want = true;
  if (own_.hybrid()) {
    want = model == nullptr ? pos == 0 : pos == offset && model->state == State::kValid;
  }
  v1::CanResumeRequest request;
  request.set_cache(own_.name);
  request.set_seq(seq);
  request.set_pos(pos);
  v1::CanResumeResponse response;
  const grpc::Status s = Rpc(
      kind, [&](grpc::ClientContext* c) { return cache_[n]->CanResume(c, request, &response); });
  const std::string what =
      absl::StrCat("can-resume seq ", seq, " at ", pos, " of ", own_.name, " on ", Where(n));
  if (!Expect(kind, s, {StatusCode::OK}, what)) return;
  if (response.can_resume() != want) {
    Fail(kind, absl::StrCat(what, ": ", response.can_resume(), ", expected ", want, " (offset ",
                            offset, ")"));
  }
}

void Client::VListSequences() {
  const std::string kind = "v:ListSequences";
  const int n = static_cast<int>(Rand(2));
  v1::ListSequencesRequest request;
  request.set_cache(own_.name);
  v1::ListSequencesResponse response;
  const grpc::Status s = Rpc(kind, [&](grpc::ClientContext* c) {
    return cache_[n]->ListSequences(c, request, &response);
  });
  const std::string what = absl::StrCat("list sequences of ", own_.name, " on ", Where(n));
  if (!Expect(kind, s, {StatusCode::OK}, what)) return;
  const std::string diff = CheckSequences(own_, own_.nodes[n], response);
  if (!diff.empty()) Fail(kind, absl::StrCat(what, ": ", diff));
}

void Client::VGetCache() {
  const std::string kind = "v:GetCache";
  const int n = static_cast<int>(Rand(2));
  v1::GetCacheRequest request;
  request.set_cache(own_.name);
  v1::GetCacheResponse response;
  const grpc::Status s =
      Rpc(kind, [&](grpc::ClientContext* c) { return cache_[n]->GetCache(c, request, &response); });
  const std::string what = absl::StrCat("get ", own_.name, " on ", Where(n));
  if (!Expect(kind, s, {StatusCode::OK}, what)) return;
  const v1::CacheUsage& usage = response.cache().usage();
  const NodeModel& node = own_.nodes[n];
  if (usage.sequences_live() != static_cast<int32_t>(node.seqs.size()) ||
      usage.snapshots() != static_cast<int32_t>(node.snaps.size()) ||
      testutil::EngineSpec(response.cache().spec()) != own_.engine) {
    Fail(kind,
         absl::StrCat(what, ": ", usage.sequences_live(), " live sequences and ", usage.snapshots(),
                      " snapshots, expected ", node.seqs.size(), " and ", node.snaps.size(),
                      "; spec ", Short(response.cache().spec().ShortDebugString())));
  }
}

bool Client::SnapshotIdFresh(int node, uint64_t id, const std::string& kind) {
  if (id <= max_snapshot_id_[node]) {
    Fail(kind, absl::StrCat("snapshot id ", id, " on ", Where(node), " of ", own_.name,
                            " is not above the last one given, ", max_snapshot_id_[node]));
    return false;
  }
  max_snapshot_id_[node] = id;
  return true;
}

void Client::VSnapshot() {
  const std::string kind = "v:Snapshot";
  const int n = static_cast<int>(Rand(2));
  NodeModel& node = own_.nodes[n];
  if (static_cast<int>(node.snaps.size()) >= kMaxSnapshots) return VDrop();
  const int64_t seq = PickSeq(node, 90);
  auto it = node.seqs.find(seq);
  const SeqModel* model = it == node.seqs.end() ? nullptr : &it->second;
  const int32_t offset = model == nullptr ? 0 : model->offset();
  int32_t from = Chance(50) ? 0 : RandIn(0, std::max(0, offset - 1));
  // Chains: start where an earlier snapshot of this sequence ended, so that Merge has pairs.
  for (const auto& [id, snap] : node.snaps) {
    if (snap.seq == seq && snap.to < offset && Chance(50)) from = snap.to;
  }
  if (Chance(8)) from = offset + static_cast<int32_t>(Rand(2));
  Codes expected;
  if (model == nullptr) {
    expected = {StatusCode::NOT_FOUND};
  } else if (from >= offset || model->state == State::kInvalid) {
    expected = {StatusCode::FAILED_PRECONDITION};
  } else {
    expected = {StatusCode::OK, StatusCode::RESOURCE_EXHAUSTED};  // the pool is shared
  }
  v1::SnapshotRequest request;
  request.set_cache(own_.name);
  request.set_seq(seq);
  request.set_from_offset(from);
  v1::SnapshotResponse response;
  const grpc::Status s =
      Rpc(kind, [&](grpc::ClientContext* c) { return cache_[n]->Snapshot(c, request, &response); });
  if (Ambiguous(s, kind)) return;
  const std::string what =
      absl::StrCat("snapshot seq ", seq, " from ", from, " of ", own_.name, " on ", Where(n));
  if (!Expect(kind, s, expected, what) || !s.ok()) {
    // Refused: nothing may have changed.
    for (int node : {n}) CheckUnchanged(node, kind, Refused(what, s));
    return;
  }
  SnapModel snap;
  snap.seq = seq;
  snap.from = from;
  snap.to = offset;
  for (const auto& [p, row] : model->rows) {
    if (p >= from) snap.rows[p] = row;
  }
  snap.state = model->state;
  snap.state_id = model->state_id;
  const v1::SnapshotInfo& info = response.snapshot();
  if (!SnapshotIdFresh(n, info.id(), kind)) return Resync(kind);
  const std::string diff = CheckSnapshotInfo(own_, snap, info);
  if (!diff.empty() || info.seq() != seq) {
    Fail(kind, absl::StrCat(what, ": ", diff, " (seq ", info.seq(), ")"));
  }
  node.snaps[info.id()] = std::move(snap);
}

void Client::VRestore() {
  const std::string kind = "v:Restore";
  const int n = static_cast<int>(Rand(2));
  NodeModel& node = own_.nodes[n];
  if (node.snaps.empty()) return VSnapshot();
  auto sit = node.snaps.begin();
  std::advance(sit, static_cast<long>(Rand(node.snaps.size())));
  const uint64_t id = sit->first;
  const SnapModel& snap = sit->second;
  const int64_t seq = Chance(40) ? snap.seq : PickSeq(node, 60);
  auto it = node.seqs.find(seq);
  const SeqModel* model = it == node.seqs.end() ? nullptr : &it->second;
  const int32_t offset = model == nullptr ? 0 : model->offset();
  int32_t target = own_.hybrid() ? snap.to : RandIn(0, snap.to);
  if (Chance(10)) target = RandIn(0, snap.to + 2);
  SeqModel result;
  if (model != nullptr) {
    for (const auto& [p, row] : model->rows) {
      if (p < std::min(snap.from, target)) result.rows[p] = row;
    }
  }
  for (const auto& [p, row] : snap.rows) {
    if (p < target) result.rows[p] = row;
  }
  if (own_.hybrid()) {
    result.state = snap.state;
    result.state_id = snap.state_id;
  }
  if (static_cast<int32_t>(result.rows.size()) > kMaxRows) return VRead();
  Codes expected;
  if (target > snap.to || offset < snap.from || (own_.hybrid() && target != snap.to)) {
    expected.push_back(StatusCode::FAILED_PRECONDITION);
  }
  if (model == nullptr && !result.rows.empty() &&
      static_cast<int32_t>(node.seqs.size()) >= kModelMaxSequences) {
    expected.push_back(StatusCode::RESOURCE_EXHAUSTED);
  }
  if (expected.empty()) expected.push_back(StatusCode::OK);
  v1::RestoreRequest request;
  request.set_cache(own_.name);
  request.set_seq(seq);
  request.set_snapshot_id(id);
  request.set_target(target);
  v1::RestoreResponse response;
  const grpc::Status s =
      Rpc(kind, [&](grpc::ClientContext* c) { return cache_[n]->Restore(c, request, &response); });
  if (Ambiguous(s, kind)) return;
  const std::string what =
      absl::StrCat("restore snapshot ", id, " [", snap.from, ", ", snap.to, ") into seq ", seq,
                   " (offset ", offset, ") target ", target, " of ", own_.name, " on ", Where(n));
  if (!Expect(kind, s, expected, what) || !s.ok()) {
    // Refused: nothing may have changed.
    for (int node : {n}) CheckUnchanged(node, kind, Refused(what, s));
    return;
  }
  if (result.rows.empty()) {
    node.seqs.erase(seq);
  } else {
    node.seqs[seq] = std::move(result);
  }
}

void Client::VRestoreLive() {
  const std::string kind = "v:Restore.live";
  const int n = static_cast<int>(Rand(2));
  NodeModel& node = own_.nodes[n];
  const int64_t seq = PickSeq(node, 85);
  auto it = node.seqs.find(seq);
  const int32_t offset = it == node.seqs.end() ? 0 : it->second.offset();
  const int32_t target = Chance(30) ? offset : RandIn(0, offset + 2);
  const bool ok = own_.hybrid() ? target == offset : target <= offset;
  v1::RestoreRequest request;
  request.set_cache(own_.name);
  request.set_seq(seq);
  request.set_target(target);
  v1::RestoreResponse response;
  const grpc::Status s =
      Rpc(kind, [&](grpc::ClientContext* c) { return cache_[n]->Restore(c, request, &response); });
  if (Ambiguous(s, kind)) return;
  const std::string what = absl::StrCat("rewind seq ", seq, " (offset ", offset, ") to ", target,
                                        " of ", own_.name, " on ", Where(n));
  if (!Expect(kind, s, {ok ? StatusCode::OK : StatusCode::FAILED_PRECONDITION}, what) || !s.ok() ||
      it == node.seqs.end()) {
    return;
  }
  if (!ApplyRemove(own_.flavour, &it->second, target, std::nullopt)) node.seqs.erase(it);
}

void Client::VMerge() {
  const std::string kind = "v:MergeSnapshots";
  const int n = static_cast<int>(Rand(2));
  NodeModel& node = own_.nodes[n];
  if (node.snaps.size() < 2) return VSnapshot();
  // A pair that meets when there is one (and sometimes one that does not).
  uint64_t parent = 0, child = 0;
  for (const auto& [a, sa] : node.snaps) {
    for (const auto& [b, sb] : node.snaps) {
      if (a != b && sa.to == sb.from) parent = a, child = b;
    }
  }
  if (parent == 0 || Chance(20)) {
    auto a = node.snaps.begin();
    std::advance(a, static_cast<long>(Rand(node.snaps.size())));
    auto b = node.snaps.begin();
    std::advance(b, static_cast<long>(Rand(node.snaps.size())));
    parent = a->first;
    child = b->first;
  }
  const SnapModel& p = node.snaps.at(parent);
  const SnapModel& c = node.snaps.at(child);
  const bool ok = parent != child && p.to == c.from;
  v1::MergeSnapshotsRequest request;
  request.set_cache(own_.name);
  request.set_parent(parent);
  request.set_child(child);
  v1::MergeSnapshotsResponse response;
  const grpc::Status s = Rpc(kind, [&](grpc::ClientContext* context) {
    return cache_[n]->MergeSnapshots(context, request, &response);
  });
  if (Ambiguous(s, kind)) return;
  const std::string what =
      absl::StrCat("merge ", parent, " [", p.from, ", ", p.to, ") + ", child, " [", c.from, ", ",
                   c.to, ") of ", own_.name, " on ", Where(n));
  if (!Expect(kind, s, {ok ? StatusCode::OK : StatusCode::INVALID_ARGUMENT}, what) || !s.ok()) {
    return;
  }
  SnapModel merged;
  merged.seq = c.seq;
  merged.from = p.from;
  merged.to = c.to;
  merged.rows = p.rows;
  for (const auto& [pos, row] : c.rows) merged.rows[pos] = row;
  merged.state = c.state;
  merged.state_id = c.state_id;
  const v1::SnapshotInfo& info = response.snapshot();
  if (!SnapshotIdFresh(n, info.id(), kind)) return Resync(kind);
  const std::string diff = CheckSnapshotInfo(own_, merged, info);
  if (!diff.empty() || info.seq() != merged.seq) {
    Fail(kind, absl::StrCat(what, ": ", diff, " (seq ", info.seq(), ")"));
  }
  node.snaps.erase(parent);
  node.snaps.erase(child);
  node.snaps[info.id()] = std::move(merged);
}

void Client::VSplit() {
  const std::string kind = "v:SplitSnapshot";
  const int n = static_cast<int>(Rand(2));
  NodeModel& node = own_.nodes[n];
  if (node.snaps.empty()) return VSnapshot();
  auto sit = node.snaps.begin();
  std::advance(sit, static_cast<long>(Rand(node.snaps.size())));
  const uint64_t id = sit->first;
  const SnapModel snap = sit->second;
  const int32_t at = RandIn(std::max(0, snap.from - 2), snap.to + 2);
  // A cache with a Recurrent group never has a parent (model.h: the hybrid flavour).
  std::optional<SnapModel> parent, child;
  if (own_.hybrid() || at <= snap.from) {
    child = snap;
  } else if (at >= snap.to) {
    parent = snap;
  } else {
    parent = SnapModel{snap.seq, snap.from, at, {}, State::kNone, 0};
    child = SnapModel{snap.seq, at, snap.to, {}, State::kNone, 0};
    for (const auto& [p, row] : snap.rows) (p < at ? parent->rows : child->rows)[p] = row;
  }
  v1::SplitSnapshotRequest request;
  request.set_cache(own_.name);
  request.set_snapshot_id(id);
  request.set_at(at);
  v1::SplitSnapshotResponse response;
  const grpc::Status s = Rpc(kind, [&](grpc::ClientContext* c) {
    return cache_[n]->SplitSnapshot(c, request, &response);
  });
  if (Ambiguous(s, kind)) return;
  const std::string what = absl::StrCat("split ", id, " [", snap.from, ", ", snap.to, ") at ", at,
                                        " of ", own_.name, " on ", Where(n));
  if (!Expect(kind, s, {StatusCode::OK}, what)) return;
  node.snaps.erase(id);
  if (response.has_parent() != parent.has_value() || response.has_child() != child.has_value()) {
    Fail(kind,
         absl::StrCat(what, ": parent ", response.has_parent(), " child ", response.has_child(),
                      ", expected ", parent.has_value(), " and ", child.has_value()));
    return Resync(kind);
  }
  // Both results get ids above every earlier one, in either order.
  const uint64_t before = max_snapshot_id_[n];
  for (auto [info, model] :
       {std::make_pair(&response.parent(), &parent), std::make_pair(&response.child(), &child)}) {
    if (!model->has_value()) continue;
    if (info->id() <= before || node.snaps.count(info->id()) > 0) {
      Fail(kind, absl::StrCat(what, ": new id ", info->id(), " is not above ", before));
      return Resync(kind);
    }
    max_snapshot_id_[n] = std::max(max_snapshot_id_[n], info->id());
    const std::string diff = CheckSnapshotInfo(own_, **model, *info);
    if (!diff.empty()) Fail(kind, absl::StrCat(what, ": ", diff));
    node.snaps[info->id()] = **model;
  }
}

void Client::VDrop() {
  const std::string kind = "v:DropSnapshot";
  const int n = static_cast<int>(Rand(2));
  NodeModel& node = own_.nodes[n];
  uint64_t id = max_snapshot_id_[n] + 1000 + Rand(1000);  // unknown: NOT_FOUND
  if (!node.snaps.empty() && Chance(90)) {
    auto it = node.snaps.begin();
    std::advance(it, static_cast<long>(Rand(node.snaps.size())));
    id = it->first;
  }
  const bool known = node.snaps.count(id) > 0;
  v1::DropSnapshotRequest request;
  request.set_cache(own_.name);
  request.set_snapshot_id(id);
  v1::DropSnapshotResponse response;
  const grpc::Status s = Rpc(
      kind, [&](grpc::ClientContext* c) { return cache_[n]->DropSnapshot(c, request, &response); });
  if (Ambiguous(s, kind)) return;
  if (!Expect(kind, s, {known ? StatusCode::OK : StatusCode::NOT_FOUND},
              absl::StrCat("drop snapshot ", id, " of ", own_.name, " on ", Where(n)))) {
    return;
  }
  node.snaps.erase(id);
}

void Client::VListSnapshots() {
  const std::string kind = "v:ListSnapshots";
  const int n = static_cast<int>(Rand(2));
  v1::ListSnapshotsRequest request;
  request.set_cache(own_.name);
  v1::ListSnapshotsResponse response;
  const grpc::Status s = Rpc(kind, [&](grpc::ClientContext* c) {
    return cache_[n]->ListSnapshots(c, request, &response);
  });
  const std::string what = absl::StrCat("list snapshots of ", own_.name, " on ", Where(n));
  if (!Expect(kind, s, {StatusCode::OK}, what)) return;
  std::vector<uint64_t> got, want;
  for (const v1::SnapshotInfo& info : response.snapshots()) got.push_back(info.id());
  for (const auto& [id, snap] : own_.nodes[n].snaps) want.push_back(id);
  if (got != want) {
    return Fail(kind, absl::StrCat(what, ": ids [", absl::StrJoin(got, ","), "], expected [",
                                   absl::StrJoin(want, ","), "]"));
  }
  for (const v1::SnapshotInfo& info : response.snapshots()) {
    const std::string diff = CheckSnapshotInfo(own_, own_.nodes[n].snaps.at(info.id()), info);
    if (!diff.empty()) return Fail(kind, absl::StrCat(what, ": ", diff));
  }
}

void Client::VMigrate() {
  const std::string kind = "v:Migrate";
  const int n = static_cast<int>(Rand(2));
  const int m = 1 - n;
  NodeModel& source = own_.nodes[n];
  NodeModel& target = own_.nodes[m];
  const int64_t seq = PickSeq(source, 85);
  const int64_t target_seq = Chance(40) ? seq : PickSeq(target, 40);
  const bool keep = Chance(30);
  auto it = source.seqs.find(seq);
  const SeqModel* model = it == source.seqs.end() ? nullptr : &it->second;
  Codes expected;
  if (model == nullptr) {
    expected = {StatusCode::NOT_FOUND};
  } else if (model->state == State::kInvalid) {
    expected = {StatusCode::FAILED_PRECONDITION};
  } else if (target.seqs.count(target_seq) == 0 &&
             static_cast<int32_t>(target.seqs.size()) >= kModelMaxSequences) {
    expected = {StatusCode::RESOURCE_EXHAUSTED};
  } else {
    expected = {StatusCode::OK, StatusCode::RESOURCE_EXHAUSTED};  // snapshot pools
  }
  v1::MigrateRequest request;
  request.set_cache(own_.name);
  request.set_seq(seq);
  request.set_target_node(shared_->nodes[m].name);
  request.set_target_seq(target_seq);
  request.set_keep_source(keep);
  v1::MigrateResponse response;
  const grpc::Status s =
      Rpc(kind, [&](grpc::ClientContext* c) { return cache_[n]->Migrate(c, request, &response); });
  if (Ambiguous(s, kind)) return;
  const std::string what =
      absl::StrCat("migrate seq ", seq, " of ", Where(n), " to seq ", target_seq, " of ", Where(m),
                   keep ? " (keep)" : "", " (", own_.name, ")");
  if (!Expect(kind, s, expected, what) || !s.ok()) {
    // docs/api.md, "Failure behaviour": after a Migrate error the target may have committed (a
    // lost reply), and then the source may have removed its copy too; never neither.
    if (model != nullptr && s.error_code() != StatusCode::NOT_FOUND &&
        s.error_code() != StatusCode::FAILED_PRECONDITION) {
      return ReconcileMigrate(kind, Refused(what, s), n, seq, target_seq, keep);
    }
    for (int node : {n, m}) CheckUnchanged(node, kind, Refused(what, s));
    return;
  }
  target.seqs[target_seq] = *model;
  if (!keep) source.seqs.erase(seq);
  if (response.transfer().transport() != "grpc-stream" || response.transfer().bytes() <= 0) {
    Fail(kind, absl::StrCat(what, ": transfer ", response.transfer().ShortDebugString()));
  }
}

void Client::VMigrateSnapshot() {
  const std::string kind = "v:MigrateSnapshot";
  const int n = static_cast<int>(Rand(2));
  const int m = 1 - n;
  NodeModel& source = own_.nodes[n];
  if (source.snaps.empty() || own_.nodes[m].snaps.size() >= kMaxSnapshots) return VSnapshot();
  auto it = source.snaps.begin();
  std::advance(it, static_cast<long>(Rand(source.snaps.size())));
  const uint64_t id = it->first;
  const bool keep = Chance(50);
  v1::MigrateSnapshotRequest request;
  request.set_cache(own_.name);
  request.set_snapshot_id(id);
  request.set_target_node(shared_->nodes[m].name);
  request.set_keep_source(keep);
  v1::MigrateSnapshotResponse response;
  const grpc::Status s = Rpc(kind, [&](grpc::ClientContext* c) {
    return cache_[n]->MigrateSnapshot(c, request, &response);
  });
  if (Ambiguous(s, kind)) return;
  const std::string what = absl::StrCat("migrate snapshot ", id, " of ", Where(n), " to ", Where(m),
                                        keep ? " (keep)" : "", " (", own_.name, ")");
  if (!Expect(kind, s, {StatusCode::OK, StatusCode::RESOURCE_EXHAUSTED}, what) || !s.ok()) {
    // As for Migrate: the target may hold the snapshot after an error.
    return ReconcileMigrateSnapshot(kind, Refused(what, s), n, id, keep);
  }
  SnapModel copy = it->second;
  if (!keep) source.snaps.erase(it);
  const v1::SnapshotInfo& info = response.snapshot();
  if (!SnapshotIdFresh(m, info.id(), kind)) return Resync(kind);
  const std::string diff = CheckSnapshotInfo(own_, copy, info);
  if (!diff.empty()) Fail(kind, absl::StrCat(what, ": ", diff));
  own_.nodes[m].snaps[info.id()] = std::move(copy);
}

bool Client::List(int node, const std::string& kind, const std::string& what,
                  v1::ListSequencesResponse* sequences, v1::ListSnapshotsResponse* snapshots) {
  v1::ListSequencesRequest list;
  list.set_cache(own_.name);
  grpc::Status s = Rpc(kind + ".sequences", [&](grpc::ClientContext* c) {
    return cache_[node]->ListSequences(c, list, sequences);
  });
  if (Ambiguous(s, kind) || !Expect(kind + ".sequences", s, {StatusCode::OK}, what)) return false;
  v1::ListSnapshotsRequest list_snapshots;
  list_snapshots.set_cache(own_.name);
  s = Rpc(kind + ".snapshots", [&](grpc::ClientContext* c) {
    return cache_[node]->ListSnapshots(c, list_snapshots, snapshots);
  });
  return !Ambiguous(s, kind) && Expect(kind + ".snapshots", s, {StatusCode::OK}, what);
}

void Client::ReconcileMigrate(const std::string& kind, const std::string& what, int n, int64_t seq,
                              int64_t target_seq, bool keep) {
  const int m = 1 - n;
  v1::ListSequencesResponse source_list, target_list;
  v1::ListSnapshotsResponse ignored;
  if (!List(n, "v:Reconcile", what, &source_list, &ignored) ||
      !List(m, "v:Reconcile", what, &target_list, &ignored)) {
    return;
  }
  NodeModel committed = own_.nodes[m];
  committed.seqs[target_seq] = own_.nodes[n].seqs.at(seq);
  NodeModel removed = own_.nodes[n];
  removed.seqs.erase(seq);
  const bool target_same = CheckSequences(own_, own_.nodes[m], target_list).empty();
  const bool target_committed = CheckSequences(own_, committed, target_list).empty();
  const bool source_same = CheckSequences(own_, own_.nodes[n], source_list).empty();
  const bool source_removed = !keep && CheckSequences(own_, removed, source_list).empty();
  if (source_same && target_same) return;  // nothing happened
  if (target_committed && (source_same || source_removed)) {
    shared_->migrations_after_error.fetch_add(1);
    own_.nodes[m] = std::move(committed);
    if (!source_same) own_.nodes[n] = std::move(removed);
    return;
  }
  Fail(kind, absl::StrCat(what, ": after the error, ", Where(n), " lists ",
                          Short(source_list.ShortDebugString(), 300), " and ", Where(m), " ",
                          Short(target_list.ShortDebugString(), 300),
                          ": neither unchanged nor committed on the target"));
  Resync(kind);
}

void Client::ReconcileMigrateSnapshot(const std::string& kind, const std::string& what, int n,
                                      uint64_t id, bool keep) {
  const int m = 1 - n;
  v1::ListSequencesResponse ignored;
  v1::ListSnapshotsResponse source_list, target_list;
  if (!List(n, "v:Reconcile", what, &ignored, &source_list) ||
      !List(m, "v:Reconcile", what, &ignored, &target_list)) {
    return;
  }
  const SnapModel snap = own_.nodes[n].snaps.at(id);
  std::vector<uint64_t> source_ids, target_new;
  for (const v1::SnapshotInfo& info : source_list.snapshots()) source_ids.push_back(info.id());
  for (const v1::SnapshotInfo& info : target_list.snapshots()) {
    if (own_.nodes[m].snaps.count(info.id()) == 0) target_new.push_back(info.id());
  }
  std::vector<uint64_t> source_want;
  for (const auto& [known, model] : own_.nodes[n].snaps) source_want.push_back(known);
  std::vector<uint64_t> source_dropped = source_want;
  source_dropped.erase(std::find(source_dropped.begin(), source_dropped.end(), id));
  const bool source_same = source_ids == source_want;
  const bool dropped = !keep && source_ids == source_dropped;
  if (target_new.empty() && source_same) return;  // nothing happened
  if (target_new.size() == 1 && (source_same || dropped)) {
    const v1::SnapshotInfo* info = nullptr;
    for (const v1::SnapshotInfo& i : target_list.snapshots()) {
      if (i.id() == target_new[0]) info = &i;
    }
    if (info != nullptr && CheckSnapshotInfo(own_, snap, *info).empty() &&
        info->id() > max_snapshot_id_[m]) {
      shared_->migrations_after_error.fetch_add(1);
      max_snapshot_id_[m] = info->id();
      own_.nodes[m].snaps[info->id()] = snap;
      if (dropped) own_.nodes[n].snaps.erase(id);
      return;
    }
  }
  Fail(kind, absl::StrCat(what, ": after the error, ", Where(n), " has snapshots [",
                          absl::StrJoin(source_ids, ","), "] and ", Where(m), " new ones [",
                          absl::StrJoin(target_new, ","),
                          "]: neither unchanged nor committed on the target"));
  Resync(kind);
}

void Client::VSpeculate() {
  const std::string kind = "v:Append.speculative";
  const int n = static_cast<int>(Rand(2));
  NodeModel& node = own_.nodes[n];
  const int64_t seq = PickSeq(node, 75);
  auto it = node.seqs.find(seq);
  const SeqModel* model = it == node.seqs.end() ? nullptr : &it->second;
  const int32_t stored = model == nullptr ? 0 : static_cast<int32_t>(model->rows.size());
  if (stored + 1 > kMaxRows || (model != nullptr && model->offset() > 4 * kModelCapacity)) {
    return VRemove(false);
  }
  const int32_t count = RandIn(1, std::min(8, kMaxRows - stored));
  // Speculative positions are at or past the offset.
  const int32_t offset = model == nullptr ? 0 : model->offset();
  std::vector<int32_t> positions;
  int32_t next = offset + (!own_.hybrid() && Chance(30) ? RandIn(1, 3) : 0);
  for (int32_t i = 0; i < count; ++i) positions.push_back(next++);
  const uint64_t seed = NextSeed();
  const v1::AppendRequest request =
      testutil::MakeSpeculativeAppend(own_.spec, seq, positions, seed);
  const bool full =
      model == nullptr && static_cast<int32_t>(node.seqs.size()) >= kModelMaxSequences;
  v1::AppendResponse response;
  grpc::Status s =
      Rpc(kind, [&](grpc::ClientContext* c) { return cache_[n]->Append(c, request, &response); });
  if (Ambiguous(s, kind)) return;
  const std::string what = absl::StrCat("speculate [", absl::StrJoin(positions, ","), "] on seq ",
                                        seq, " of ", own_.name, " on ", Where(n));
  if (!Expect(kind, s, {full ? StatusCode::RESOURCE_EXHAUSTED : StatusCode::OK}, what) || !s.ok()) {
    return;
  }
  // Pending tokens are read back like stored ones; a Recurrent state is the last token's.
  SeqModel pending = model == nullptr ? SeqModel() : *model;
  for (int32_t p : positions) pending.rows[p] = Row{TokenId(seq, p, seed), p, 0};
  if (own_.hybrid()) {
    pending.state = State::kValid;
    pending.state_id = StateId(seq, positions.back(), seed);
  }
  ReadAndCheck("v:Read.pending", n, own_.name, seq, own_, &pending, 0, std::nullopt);
  if (needs_resync_) return;  // the Read's outcome was ambiguous

  const int32_t accepted = RandIn(0, count);
  SeqModel committed = model == nullptr ? SeqModel() : *model;
  for (int32_t i = 0; i < accepted; ++i) {
    committed.rows[positions[i]] = Row{TokenId(seq, positions[i], seed), positions[i], 0};
  }
  if (own_.hybrid() && accepted > 0) {
    committed.state = State::kValid;
    committed.state_id = StateId(seq, positions[accepted - 1], seed);
  }
  v1::CommitSpeculationRequest commit;
  commit.set_cache(own_.name);
  commit.set_seq(seq);
  commit.set_accepted(accepted);
  v1::CommitSpeculationResponse committed_response;
  s = Rpc("v:CommitSpeculation", [&](grpc::ClientContext* c) {
    return cache_[n]->CommitSpeculation(c, commit, &committed_response);
  });
  if (Ambiguous(s, "v:CommitSpeculation")) return;
  if (!Expect("v:CommitSpeculation", s, {StatusCode::OK},
              absl::StrCat(what, ", commit ", accepted))) {
    return Resync("v:CommitSpeculation");
  }
  if (committed_response.offset() != committed.offset()) {
    Fail("v:CommitSpeculation",
         absl::StrCat(what, ", commit ", accepted, ": offset ", committed_response.offset(),
                      ", expected ", committed.offset()));
  }
  if (committed.rows.empty()) {
    node.seqs.erase(seq);
  } else {
    node.seqs[seq] = std::move(committed);
  }
}

}  // namespace soak
}  // namespace kvmesh

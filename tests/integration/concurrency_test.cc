// Many client threads against one kvmesh-node at once, mixing every RPC on shared and separate
// caches. Threads that own their sequences keep a model of them and check every answer byte for
// byte, during the run and at the end; threads racing on shared sequences check status codes and
// the shape of what comes back. The node must stay consistent and exit cleanly (also under TSan:
// build with -DKVMESH_SANITIZE=thread).
#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/client_util.h"
#include "tests/integration/node_fixture.h"

namespace kvmesh {
namespace testutil {
namespace {

constexpr int kOwnerThreads = 8;      // cc-full, two private sequences each
constexpr int kSlidingThreads = 4;    // cc-sliding, one private sequence each
constexpr int kLifecycleThreads = 2;  // create / use / delete their own caches, race on one
constexpr int kRacerThreads = 2;      // cc-full, shared sequences, codes only
constexpr int kIterations = 120;
constexpr int32_t kMaxOwnedPosition = 200;
constexpr int64_t kRacedSeqBase = 9000;
constexpr int kRacedSeqs = 4;

// F16, 2 layers x 2 heads x (8 + 8): 128 bytes per token. RoPE NORMAL on 4 of 8 elements.
v1::LayerGroup Group(int32_t sliding_window = 0) {
  AttentionOptions a;
  a.num_layers = 2;
  a.num_kv_heads = 2;
  a.head_dim_k = 8;
  a.head_dim_v = 8;
  a.rope_dims = 4;
  a.sliding_window = sliding_window;
  return AttentionGroupProto(a);
}
constexpr size_t kGroupTokenBytes = 128;

v1::CacheSpec FullSpec() { return SpecProto("cc-full", 64, 256, 16, {Group()}, v1::DTYPE_F16); }
// Sliding memory is raised to window + 1 = 9 (8 sequences): 8 x 9 + 8 = 80 cells, enough for
// every sequence's memory plus one batch.
v1::CacheSpec SlidingSpec() {
  return SpecProto("cc-sliding", 8, 256, 8, {Group(), Group(8)}, v1::DTYPE_F16);
}
v1::CacheSpec SmallSpec(const std::string& name) {
  return SpecProto(name, 2, 32, 8, {Group()}, v1::DTYPE_F16);
}

std::vector<int32_t> Range(int32_t begin, int32_t end) {
  std::vector<int32_t> out;
  for (int32_t p = begin; p < end; ++p) out.push_back(p);
  return out;
}

int32_t Offset(const std::map<int32_t, uint64_t>& group) {
  return group.empty() ? 0 : group.rbegin()->first + 1;
}

// What one thread does; failures are reported with the thread's name and iteration.
class Worker {
 public:
  Worker(std::string name, std::shared_ptr<grpc::Channel> channel, uint64_t seed)
      : name_(std::move(name)), stub_(v1::CacheService::NewStub(channel)), rng_(seed) {}
  virtual ~Worker() = default;

  void Run() {
    for (iteration_ = 0; iteration_ < kIterations; ++iteration_) Step();
  }
  virtual void Step() = 0;
  virtual void VerifyAtEnd() {}

 protected:
  int Uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }

  std::string Where(const std::string& op) const {
    return absl::StrCat(name_, " iteration ", iteration_, " ", op);
  }

  void ExpectCode(const grpc::Status& status, grpc::StatusCode code, const std::string& op) {
    EXPECT_EQ(status.error_code(), code) << Where(op) << ": " << StatusText(status);
  }

  void ExpectCodeIn(const grpc::Status& status, std::set<grpc::StatusCode> codes,
                    const std::string& op) {
    EXPECT_TRUE(codes.count(status.error_code()) > 0) << Where(op) << ": " << StatusText(status);
  }

  // Appends `positions` of `seq` by unary Append or by AppendStream in random chunks.
  grpc::Status AppendSomehow(const v1::CacheSpec& spec, int64_t seq,
                             const std::vector<int32_t>& positions, uint64_t seed) {
    const v1::AppendRequest request = MakeAppend(spec, seq, positions, seed);
    if (Uniform(0, 1) == 0) return Append(*stub_, request);
    const size_t chunk = static_cast<size_t>(Uniform(1, 700));
    return AppendStream(*stub_,
                        StreamMessages(request, static_cast<size_t>(Uniform(0, 300)), chunk));
  }

  // Reads [begin, end) of `seq` and checks it against `model` (group 0 exactly; a sliding
  // group 1, when present, holds a subset of group 0 that includes the last position).
  void CheckRead(const v1::CacheSpec& spec, int64_t seq, const SequenceModel& model, int32_t begin,
                 std::optional<int32_t> end) {
    ReadOutput out;
    const int32_t chunk = Uniform(0, 1) == 0 ? 0 : Uniform(1, 512);
    const grpc::Status status =
        Read(*stub_, ReadRequest(spec.name(), seq, begin, end, chunk), &out);
    if (model[0].empty()) {
      ExpectCode(status, grpc::StatusCode::NOT_FOUND, absl::StrCat("Read of empty ", seq));
      return;
    }
    ExpectCode(status, grpc::StatusCode::OK, absl::StrCat("Read ", seq));
    if (!status.ok()) return;
    const std::vector<std::vector<int32_t>> positions = HeaderPositions(out.header);
    std::vector<int32_t> expected;
    for (const auto& [pos, id] : model[0]) {
      if (pos >= begin && (!end.has_value() || pos < *end)) expected.push_back(pos);
    }
    ASSERT_EQ(positions.size(), model.size()) << Where("Read header");
    EXPECT_EQ(positions[0], expected) << Where(absl::StrCat("Read positions of ", seq));
    if (positions.size() > 1) {
      EXPECT_TRUE(
          std::includes(expected.begin(), expected.end(), positions[1].begin(), positions[1].end()))
          << Where("sliding positions are not a subset");
      if (!end.has_value() && !expected.empty() && expected.back() == model[0].rbegin()->first &&
          !positions[1].empty()) {
        EXPECT_EQ(positions[1].back(), expected.back()) << Where("sliding group lost its last");
      }
    }
    EXPECT_TRUE(out.payload == ExpectedReadPayload(spec, model, positions))
        << Where(absl::StrCat("Read bytes of ", seq));
  }

  const std::string name_;
  std::unique_ptr<Stub> stub_;
  std::mt19937_64 rng_;
  int iteration_ = 0;
};

// Two private sequences of cc-full: every answer is predictable.
class OwnerWorker : public Worker {
 public:
  OwnerWorker(int index, std::shared_ptr<grpc::Channel> channel)
      : Worker(absl::StrCat("owner", index), std::move(channel), 1000 + index),
        spec_(FullSpec()),
        seqs_{100 * (index + 1) + 1, 100 * (index + 1) + 2},
        models_(2, SequenceModel(1)) {}

  void Step() override {
    const int which = Uniform(0, 1);
    const int64_t seq = seqs_[which];
    SequenceModel& model = models_[which];
    switch (Uniform(0, 7)) {
      case 0:
      case 1: {  // append at the offset, or truncate when the sequence is long
        const int32_t offset = Offset(model[0]);
        const int32_t n = Uniform(1, 8);
        if (offset + n > kMaxOwnedPosition) {
          const int32_t at = Uniform(0, offset);
          ExpectCode(Remove(*stub_, spec_.name(), seq, at), grpc::StatusCode::OK, "Remove");
          model[0].erase(model[0].lower_bound(at), model[0].end());
          break;
        }
        const std::vector<int32_t> positions = Range(offset, offset + n);
        const uint64_t seed = rng_();
        ExpectCode(AppendSomehow(spec_, seq, positions, seed), grpc::StatusCode::OK, "Append");
        ModelAppend(spec_, seq, positions, seed, &model);
        break;
      }
      case 2: {
        const int32_t offset = Offset(model[0]);
        const int32_t begin = Uniform(0, offset + 1);
        std::optional<int32_t> end;
        if (Uniform(0, 1) == 0) end = Uniform(begin, offset + 2);
        CheckRead(spec_, seq, model, begin, end);
        break;
      }
      case 3: {  // fork into the other sequence
        const int32_t length = Uniform(0, Offset(model[0]) + 2);
        ExpectCode(CopyPrefix(*stub_, spec_.name(), seq, seqs_[1 - which], length),
                   grpc::StatusCode::OK, "CopyPrefix");
        SequenceModel& dst = models_[1 - which];
        dst[0].clear();
        for (const auto& [pos, id] : model[0]) {
          if (pos < length) dst[0][pos] = id;
        }
        break;
      }
      case 4: {  // truncate
        const int32_t at = Uniform(0, Offset(model[0]) + 1);
        ExpectCode(Remove(*stub_, spec_.name(), seq, at), grpc::StatusCode::OK, "Remove");
        model[0].erase(model[0].lower_bound(at), model[0].end());
        break;
      }
      case 5: {  // unlimited memory: always resumable
        bool can_resume = false;
        ExpectCode(CanResume(*stub_, spec_.name(), seq, Offset(model[0]), &can_resume),
                   grpc::StatusCode::OK, "CanResume");
        EXPECT_TRUE(can_resume) << Where("CanResume");
        break;
      }
      case 6: {
        v1::ListSequencesResponse list;
        ExpectCode(ListSequences(*stub_, spec_.name(), &list), grpc::StatusCode::OK,
                   "ListSequences");
        CheckListed(list);
        break;
      }
      case 7: {
        const int32_t pos = Uniform(0, Offset(model[0]) + 1);
        v1::VisibleRequest request;
        request.set_cache(spec_.name());
        v1::Query* q = request.add_queries();
        q->set_seq(seq);
        q->set_pos(pos);
        v1::VisibleResponse response;
        ExpectCode(Visible(*stub_, request, &response), grpc::StatusCode::OK, "Visible");
        std::vector<int32_t> expected;
        for (const auto& [p, id] : model[0]) {
          if (p <= pos) expected.push_back(p);
        }
        ASSERT_EQ(response.visible_size(), 1) << Where("Visible");
        EXPECT_EQ(std::vector<int32_t>(response.visible(0).positions().begin(),
                                       response.visible(0).positions().end()),
                  expected)
            << Where("Visible");
        break;
      }
    }
  }

  void VerifyAtEnd() override {
    for (int i = 0; i < 2; ++i) CheckRead(spec_, seqs_[i], models_[i], 0, std::nullopt);
    v1::ListSequencesResponse list;
    ExpectCode(ListSequences(*stub_, spec_.name(), &list), grpc::StatusCode::OK, "ListSequences");
    CheckListed(list);
  }

 private:
  // The thread's own sequences are listed exactly as modelled (or absent when empty).
  void CheckListed(const v1::ListSequencesResponse& list) {
    for (int i = 0; i < 2; ++i) {
      const v1::SequenceInfo* found = nullptr;
      for (const v1::SequenceInfo& info : list.sequences()) {
        if (info.seq() == seqs_[i]) found = &info;
      }
      const auto& model = models_[i][0];
      if (model.empty()) {
        EXPECT_EQ(found, nullptr) << Where(absl::StrCat("ListSequences shows empty ", seqs_[i]));
        continue;
      }
      ASSERT_NE(found, nullptr) << Where(absl::StrCat("ListSequences lacks ", seqs_[i]));
      EXPECT_EQ(found->offset(), Offset(model)) << Where("ListSequences offset");
      ASSERT_EQ(found->groups_size(), 1) << Where("ListSequences groups");
      EXPECT_EQ(found->groups(0).stored(), static_cast<int32_t>(model.size()))
          << Where("ListSequences stored");
      EXPECT_EQ(found->groups(0).first(), model.begin()->first) << Where("ListSequences first");
    }
  }

  const v1::CacheSpec spec_;
  const int64_t seqs_[2];
  std::vector<SequenceModel> models_;
};

// One private sequence of cc-sliding: contiguous appends, reads and truncations.
class SlidingWorker : public Worker {
 public:
  SlidingWorker(int index, std::shared_ptr<grpc::Channel> channel)
      : Worker(absl::StrCat("sliding", index), std::move(channel), 2000 + index),
        spec_(SlidingSpec()),
        seq_(10 + index),
        model_(2) {}

  void Step() override {
    switch (Uniform(0, 3)) {
      case 0:
      case 1: {
        const int32_t offset = Offset(model_[0]);
        if (offset + 8 > kMaxOwnedPosition) {
          Truncate(Uniform(0, offset));
          break;
        }
        const std::vector<int32_t> positions = Range(offset, offset + Uniform(1, 8));
        const uint64_t seed = rng_();
        ExpectCode(AppendSomehow(spec_, seq_, positions, seed), grpc::StatusCode::OK, "Append");
        ModelAppend(spec_, seq_, positions, seed, &model_);
        break;
      }
      case 2:
        CheckRead(spec_, seq_, model_, Uniform(0, 10), std::nullopt);
        break;
      case 3: {
        Truncate(Uniform(0, Offset(model_[0]) + 1));
        break;
      }
    }
  }

  void VerifyAtEnd() override { CheckRead(spec_, seq_, model_, 0, std::nullopt); }

 private:
  void Truncate(int32_t at) {
    ExpectCode(Remove(*stub_, spec_.name(), seq_, at), grpc::StatusCode::OK, "Remove");
    for (auto& group : model_) group.erase(group.lower_bound(at), group.end());
  }

  const v1::CacheSpec spec_;
  const int64_t seq_;
  SequenceModel model_;
};

// Creates, uses and deletes caches of its own; races with the other lifecycle thread on one
// shared cache name.
class LifecycleWorker : public Worker {
 public:
  LifecycleWorker(int index, std::shared_ptr<grpc::Channel> channel)
      : Worker(absl::StrCat("lifecycle", index), std::move(channel), 3000 + index), index_(index) {}

  void Step() override {
    if (Uniform(0, 1) == 0) {
      Own();
    } else {
      Race();
    }
  }

  void VerifyAtEnd() override {
    v1::ListCachesResponse list;
    ExpectCode(ListCaches(*stub_, &list), grpc::StatusCode::OK, "ListCaches");
    for (const v1::CacheInfo& info : list.caches()) {
      EXPECT_FALSE(absl::StartsWith(info.spec().name(), absl::StrCat("cc-own", index_, "-")))
          << Where("own cache left behind: ") << info.spec().name();
    }
  }

 private:
  void Own() {
    const v1::CacheSpec spec = SmallSpec(absl::StrCat("cc-own", index_, "-", iteration_));
    v1::CreateCacheResponse created;
    ExpectCode(CreateCache(*stub_, spec, &created), grpc::StatusCode::OK, "CreateCache");
    EXPECT_TRUE(created.created()) << Where("CreateCache");
    const uint64_t seed = rng_();
    const std::vector<int32_t> positions = Range(0, Uniform(1, 8));
    ExpectCode(AppendSomehow(spec, 0, positions, seed), grpc::StatusCode::OK, "Append");
    SequenceModel model;
    ModelAppend(spec, 0, positions, seed, &model);
    CheckRead(spec, 0, model, 0, std::nullopt);
    v1::ListCachesResponse list;
    ExpectCode(ListCaches(*stub_, &list), grpc::StatusCode::OK, "ListCaches");
    std::vector<std::string> names;
    for (const v1::CacheInfo& info : list.caches()) names.push_back(info.spec().name());
    EXPECT_THAT(names, ::testing::IsSupersetOf({spec.name(), std::string("cc-full")}))
        << Where("ListCaches");
    ExpectCode(DeleteCache(*stub_, spec.name()), grpc::StatusCode::OK, "DeleteCache");
    v1::GetCacheResponse got;
    ExpectCode(GetCache(*stub_, spec.name(), &got), grpc::StatusCode::NOT_FOUND, "GetCache");
  }

  void Race() {
    const v1::CacheSpec spec = SmallSpec("cc-racy");
    switch (Uniform(0, 3)) {
      case 0:
        ExpectCode(CreateCache(*stub_, spec), grpc::StatusCode::OK, "racy CreateCache");
        break;
      case 1:
        ExpectCodeIn(DeleteCache(*stub_, spec.name()),
                     {grpc::StatusCode::OK, grpc::StatusCode::NOT_FOUND}, "racy DeleteCache");
        break;
      case 2: {
        const int32_t pos = Uniform(0, 20);
        ExpectCodeIn(AppendSomehow(spec, Uniform(0, 2), {pos}, rng_()),
                     {grpc::StatusCode::OK, grpc::StatusCode::NOT_FOUND,
                      grpc::StatusCode::INVALID_ARGUMENT, grpc::StatusCode::RESOURCE_EXHAUSTED},
                     "racy Append");
        break;
      }
      case 3: {
        ReadOutput out;
        const grpc::Status status = Read(*stub_, ReadRequest(spec.name(), Uniform(0, 2)), &out);
        ExpectCodeIn(status, {grpc::StatusCode::OK, grpc::StatusCode::NOT_FOUND}, "racy Read");
        if (status.ok()) {
          ASSERT_EQ(out.header.groups_size(), 1) << Where("racy Read header");
          EXPECT_EQ(out.payload.size(), out.header.groups(0).positions_size() * kGroupTokenBytes)
              << Where("racy Read size");
        }
        break;
      }
    }
  }

  const int index_;
};

// Random operations on sequences every racer shares: only the codes and shapes are predictable.
class RacerWorker : public Worker {
 public:
  RacerWorker(int index, std::shared_ptr<grpc::Channel> channel)
      : Worker(absl::StrCat("racer", index), std::move(channel), 4000 + index), spec_(FullSpec()) {}

  void Step() override {
    const int64_t seq = kRacedSeqBase + Uniform(0, kRacedSeqs - 1);
    switch (Uniform(0, 5)) {
      case 0: {  // random distinct increasing positions; some may be stored already
        std::set<int32_t> picked;
        const int n = Uniform(1, 8);
        while (static_cast<int>(picked.size()) < n)
          picked.insert(Uniform(0, kMaxOwnedPosition - 1));
        ExpectCodeIn(
            AppendSomehow(spec_, seq, std::vector<int32_t>(picked.begin(), picked.end()), rng_()),
            {grpc::StatusCode::OK, grpc::StatusCode::INVALID_ARGUMENT}, "racy Append");
        break;
      }
      case 1: {
        const int32_t begin = Uniform(0, kMaxOwnedPosition);
        std::optional<int32_t> end;
        if (Uniform(0, 1) == 0) end = begin + Uniform(0, 20);
        ExpectCodeIn(Remove(*stub_, spec_.name(), seq, begin, end),
                     {grpc::StatusCode::OK, grpc::StatusCode::RESOURCE_EXHAUSTED}, "racy Remove");
        break;
      }
      case 2: {
        int64_t dst = kRacedSeqBase + Uniform(0, kRacedSeqs - 1);
        if (dst == seq) dst = kRacedSeqBase + (dst - kRacedSeqBase + 1) % kRacedSeqs;
        ExpectCode(CopyPrefix(*stub_, spec_.name(), seq, dst, Uniform(0, kMaxOwnedPosition)),
                   grpc::StatusCode::OK, "racy CopyPrefix");
        break;
      }
      case 3: {
        ReadOutput out;
        const grpc::Status status =
            Read(*stub_, ReadRequest(spec_.name(), seq, 0, std::nullopt, Uniform(0, 300)), &out);
        ExpectCodeIn(status, {grpc::StatusCode::OK, grpc::StatusCode::NOT_FOUND}, "racy Read");
        if (status.ok()) {
          ASSERT_EQ(out.header.groups_size(), 1) << Where("racy Read header");
          const auto& positions = out.header.groups(0).positions();
          EXPECT_TRUE(std::is_sorted(positions.begin(), positions.end())) << Where("racy Read");
          EXPECT_EQ(out.payload.size(), positions.size() * kGroupTokenBytes)
              << Where("racy Read size");
        }
        break;
      }
      case 4: {
        bool can_resume = false;
        ExpectCode(CanResume(*stub_, spec_.name(), seq, Uniform(0, 300), &can_resume),
                   grpc::StatusCode::OK, "racy CanResume");
        EXPECT_TRUE(can_resume) << Where("racy CanResume");
        break;
      }
      case 5: {
        v1::GetCacheResponse got;
        const grpc::Status status = GetCache(*stub_, spec_.name(), &got);
        ExpectCode(status, grpc::StatusCode::OK, "GetCache");
        if (!status.ok()) break;
        ASSERT_EQ(got.cache().usage().groups_size(), 1) << Where("GetCache");
        const v1::GroupUsage& usage = got.cache().usage().groups(0);
        EXPECT_LE(usage.cells_used(), usage.cells_total()) << Where("GetCache");
        EXPECT_LE(got.cache().usage().sequences_live(), 64) << Where("GetCache");
        break;
      }
    }
  }

 private:
  const v1::CacheSpec spec_;
};

class ConcurrencyTest : public NodeSuite {
 protected:
  static void SetUpTestSuite() { StartNode({"--memory-budget=1GiB"}); }
};

TEST_F(ConcurrencyTest, SixteenThreadsMixingEveryRpc) {
  KVMESH_ASSERT_OK(CreateCache(stub(), FullSpec()));
  KVMESH_ASSERT_OK(CreateCache(stub(), SlidingSpec()));

  std::vector<std::unique_ptr<Worker>> workers;
  // Half the threads share the node's channel; the others have a connection each.
  auto channel = [&](int i) { return i % 2 == 0 ? node().channel() : node().NewChannel(); };
  int i = 0;
  for (int k = 0; k < kOwnerThreads; ++k, ++i) {
    workers.push_back(std::make_unique<OwnerWorker>(k, channel(i)));
  }
  for (int k = 0; k < kSlidingThreads; ++k, ++i) {
    workers.push_back(std::make_unique<SlidingWorker>(k, channel(i)));
  }
  for (int k = 0; k < kLifecycleThreads; ++k, ++i) {
    workers.push_back(std::make_unique<LifecycleWorker>(k, channel(i)));
  }
  for (int k = 0; k < kRacerThreads; ++k, ++i) {
    workers.push_back(std::make_unique<RacerWorker>(k, channel(i)));
  }
  ASSERT_EQ(workers.size(), 16u);

  std::vector<std::thread> threads;
  for (auto& worker : workers) threads.emplace_back([&worker] { worker->Run(); });
  for (std::thread& thread : threads) thread.join();
  for (auto& worker : workers) worker->VerifyAtEnd();

  // The shared caches are still consistent: usage within bounds, live sequences as listed.
  for (const char* cache : {"cc-full", "cc-sliding"}) {
    v1::GetCacheResponse got;
    KVMESH_ASSERT_OK(GetCache(stub(), cache, &got));
    v1::ListSequencesResponse seqs;
    KVMESH_ASSERT_OK(ListSequences(stub(), cache, &seqs));
    EXPECT_EQ(got.cache().usage().sequences_live(), seqs.sequences_size()) << cache;
    for (const v1::GroupUsage& group : got.cache().usage().groups()) {
      EXPECT_LE(group.cells_used(), group.cells_total()) << cache;
    }
  }
}

// Deleting a cache while other threads use it: every call either sees the cache or NOT_FOUND
// (the engine keeps a cache alive until the calls using it end).
TEST_F(ConcurrencyTest, DeleteWhileInUse) {
  constexpr int kRounds = 20;
  const v1::CacheSpec spec = SpecProto("cc-doomed", 4, 64, 16, {Group()}, v1::DTYPE_F16);
  for (int round = 0; round < kRounds; ++round) {
    KVMESH_ASSERT_OK(CreateCache(stub(), spec));
    std::vector<std::thread> users;
    std::vector<grpc::Status> results(4);
    for (int t = 0; t < 4; ++t) {
      users.emplace_back([&, t] {
        std::unique_ptr<Stub> stub = v1::CacheService::NewStub(node().channel());
        for (int k = 0; k < 5; ++k) {
          grpc::Status status = Append(*stub, MakeAppend(spec, t, {k}, round));
          if (!status.ok()) {
            results[t] = status;
            return;
          }
          ReadOutput out;
          status = Read(*stub, ReadRequest(spec.name(), t), &out);
          if (!status.ok()) {
            results[t] = status;
            return;
          }
        }
      });
    }
    KVMESH_EXPECT_OK(DeleteCache(stub(), spec.name()));
    for (std::thread& user : users) user.join();
    for (const grpc::Status& status : results) {
      EXPECT_TRUE(status.ok() || status.error_code() == grpc::StatusCode::NOT_FOUND)
          << StatusText(status);
    }
  }
  v1::ListCachesResponse list;
  KVMESH_ASSERT_OK(ListCaches(stub(), &list));
  for (const v1::CacheInfo& info : list.caches()) EXPECT_NE(info.spec().name(), "cc-doomed");
}

}  // namespace
}  // namespace testutil
}  // namespace kvmesh

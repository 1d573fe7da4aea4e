#include "tests/soak/soak.h"

#include <utility>

#include "tests/integration/client_util.h"

namespace kvmesh {
namespace soak {

SlowPool::SlowPool(int threads) : recorders_(threads) {
  for (int i = 0; i < threads; ++i) {
    threads_.emplace_back([this, recorder = &recorders_[i]] {
      std::unique_lock<std::mutex> lock(mu_);
      for (;;) {
        ++idle_;
        cv_.wait(lock, [this] { return done_ || !jobs_.empty(); });
        --idle_;
        if (jobs_.empty()) return;  // done_
        Job job = std::move(jobs_.front());
        jobs_.pop_front();
        lock.unlock();
        job(recorder);
        lock.lock();
      }
    });
  }
}

SlowPool::~SlowPool() { Finish(); }

bool SlowPool::TrySubmit(Job job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_ || idle_ <= static_cast<int>(jobs_.size())) return false;
    jobs_.push_back(std::move(job));
  }
  cv_.notify_one();
  return true;
}

void SlowPool::Finish() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
  threads_.clear();
}

Recorder SlowPool::Merged() const {
  Recorder all;
  for (const Recorder& r : recorders_) all.Merge(r);
  return all;
}

v1::CacheSpec LongSpec(int32_t positions) {
  // 32 bytes per token: the 16K-position sequence is 512 KiB, but a Visible of every position
  // for each of 20,000 queries would answer 1.3 GB.
  testutil::AttentionOptions a;
  a.num_layers = 1;
  a.num_kv_heads = 1;
  a.head_dim_k = 8;
  a.head_dim_v = 8;
  a.rope = v1::ROPE_TYPE_NEOX;
  a.rope_dims = 8;
  return testutil::SpecProto(kLongCache, 4, positions + 1024, 4096,
                             {testutil::AttentionGroupProto(a)}, v1::DTYPE_F16);
}

v1::CacheSpec StreamSpec() {
  // 16 KiB per token, max_batch 16384: an AppendStream may announce up to 256 MiB, while the
  // cache itself holds 2 x 1024 cells (32 MiB of budget).
  testutil::AttentionOptions a;
  a.num_layers = 4;
  a.num_kv_heads = 8;
  a.head_dim_k = 128;
  a.head_dim_v = 128;
  a.rope = v1::ROPE_TYPE_NEOX;
  a.rope_dims = 128;
  return testutil::SpecProto(kStreamCache, 2, 1024, 16384, {testutil::AttentionGroupProto(a)},
                             v1::DTYPE_F16);
}

v1::CacheSpec ChaosHybridSpec() {
  testutil::AttentionOptions full;
  full.num_layers = 1;
  full.num_kv_heads = 2;
  full.head_dim_k = 32;
  full.head_dim_v = 32;
  full.rope = v1::ROPE_TYPE_NEOX;
  full.rope_dims = 32;
  testutil::AttentionOptions sliding = full;
  sliding.num_kv_heads = 1;
  sliding.sliding_window = 8;
  sliding.rope = v1::ROPE_TYPE_NORMAL;
  sliding.rope_dims = 16;
  testutil::RotatingOptions rotating;
  rotating.num_kv_heads = 1;
  rotating.head_dim_k = 32;
  rotating.head_dim_v = 32;
  rotating.max_size = 16;
  testutil::RecurrentOptions recurrent;
  recurrent.conv_tail = 2;
  recurrent.conv_dim = 16;
  recurrent.num_v_heads = 1;
  recurrent.head_v_dim = 4;
  recurrent.head_k_dim = 4;
  return testutil::SpecProto(
      kChaosHybrid, 16, 256, 32,
      {testutil::AttentionGroupProto(full), testutil::AttentionGroupProto(sliding),
       testutil::RotatingGroupProto(rotating), testutil::RecurrentGroupProto(recurrent)},
      v1::DTYPE_F16);
}

v1::CacheSpec ChaosAttentionSpec() {
  testutil::AttentionOptions sliding;
  sliding.num_layers = 2;
  sliding.num_kv_heads = 2;
  sliding.head_dim_k = 16;
  sliding.head_dim_v = 16;
  sliding.sliding_window = 32;
  sliding.sliding_memory = 64;
  sliding.rope = v1::ROPE_TYPE_NEOX;
  sliding.rope_dims = 16;
  testutil::AttentionOptions chunked = sliding;
  chunked.sliding_window = 0;
  chunked.sliding_memory = 0;
  chunked.chunk = 8;
  return testutil::SpecProto(
      kChaosAttention, 16, 512, 64,
      {testutil::AttentionGroupProto(sliding), testutil::AttentionGroupProto(chunked)},
      v1::DTYPE_BF16);
}

}  // namespace soak
}  // namespace kvmesh

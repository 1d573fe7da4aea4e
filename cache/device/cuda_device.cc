#include "cache/device/cuda_device.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "cache/device/cuda_check.h"
#include "cache/device/cuda_kernels.h"
#include "cache/device/cuda_resources.h"
#include "cache/device/cuda_shared_memory.h"
#include "cache/mutex.h"
#include "cache/status_macros.h"

namespace kvmesh {
namespace {

using cuda::CopyPlane;

// Bytes of one staging set reserved for the parameters of a launch (plane tables, row lists,
// RoPE tables). A launch whose row list does not fit is split into several.
constexpr size_t kParamBytes = size_t{1} << 20;
// Staging sets are created on demand, up to this many; more concurrent operations wait.
constexpr int kMaxStagingSets = 4;
// Planes per launch, so that a plane table always fits beside its row lists.
constexpr size_t kMaxPlanesPerLaunch = 1024;

size_t AlignUp(size_t n, size_t a) { return (n + a - 1) / a * a; }

// The DeviceStream of a cache on a GPU: its stream and the event its operations wait on.
class CudaStreamState final : public DeviceStream {
 public:
  CudaStreamState(int ordinal, cuda::Stream stream, cuda::Event done)
      : ordinal_(ordinal), stream_(std::move(stream)), done_(std::move(done)) {}
  ~CudaStreamState() override {
    // The stream and event belong to this GPU; make it current whatever thread drops the last
    // reference.
    if (cudaSetDevice(ordinal_) != cudaSuccess) (void)cudaGetLastError();
    done_ = cuda::Event();
    stream_ = cuda::Stream();
  }
  int ordinal() const { return ordinal_; }
  cudaStream_t stream() const { return stream_.get(); }
  cudaEvent_t done() const { return done_.get(); }

 private:
  const int ordinal_;
  cuda::Stream stream_;
  cuda::Event done_;
};

// Where one operation runs.
struct Queue {
  cudaStream_t stream;
  cudaEvent_t done;
};

// Records `done` on the stream and blocks until everything enqueued so far has finished. Errors
// of kernels launched earlier surface here.
absl::Status Drain(Queue q) {
  KVMESH_CUDA_RETURN_IF_ERROR(cudaEventRecord(q.done, q.stream));
  KVMESH_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(q.done));
  return absl::OkStatus();
}

// Host and device staging for one operation at a time, split in two halves so that the host
// copy into one half overlaps the transfer and kernel of the other. Each half holds a payload
// part and a parameter part, on the host (pinned) and on the device at the same offsets.
class Staging {
 public:
  struct Half {
    uint8_t* host_payload;
    uint8_t* device_payload;
    uint8_t* host_params;
    uint8_t* device_params;
    cudaEvent_t transferred;  // recorded after the half's last transfer was enqueued
    bool in_use;              // a transfer was enqueued since the half was last waited for
  };

  static absl::StatusOr<std::unique_ptr<Staging>> Create(size_t payload_bytes) {
    auto staging = std::unique_ptr<Staging>(new Staging());
    staging->payload_bytes_ = AlignUp(std::max<size_t>(payload_bytes / 2, 4096), 256);
    const size_t half = staging->payload_bytes_ + kParamBytes;
    ASSIGN_OR_RETURN(staging->host_, cuda::PinnedBuffer::Create(2 * half));
    ASSIGN_OR_RETURN(staging->device_, cuda::DeviceBuffer::Create(2 * half));
    for (int h = 0; h < 2; ++h) {
      ASSIGN_OR_RETURN(staging->events_[h], cuda::Event::Create());
      staging->halves_[h] = Half{staging->host_.data() + h * half,
                                 staging->device_.data() + h * half,
                                 staging->host_.data() + h * half + staging->payload_bytes_,
                                 staging->device_.data() + h * half + staging->payload_bytes_,
                                 staging->events_[h].get(),
                                 false};
    }
    return staging;
  }

  // Payload bytes of one half.
  size_t payload_bytes() const { return payload_bytes_; }

  // The next half to fill, once the transfers last enqueued from it have completed.
  absl::StatusOr<Half*> Next() {
    Half* half = &halves_[next_];
    next_ ^= 1;
    if (half->in_use) {
      KVMESH_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(half->transferred));
      half->in_use = false;
    }
    return half;
  }

  // Records that every transfer reading or writing `half` has been enqueued on `stream`.
  absl::Status Transferred(Half* half, cudaStream_t stream) {
    KVMESH_CUDA_RETURN_IF_ERROR(cudaEventRecord(half->transferred, stream));
    half->in_use = true;
    return absl::OkStatus();
  }

  // Forgets about outstanding transfers: the caller has drained the stream.
  void Reset() {
    halves_[0].in_use = halves_[1].in_use = false;
    next_ = 0;
  }

 private:
  Staging() = default;
  size_t payload_bytes_ = 0;
  cuda::PinnedBuffer host_;
  cuda::DeviceBuffer device_;
  cuda::Event events_[2];
  Half halves_[2];
  int next_ = 0;
};

// Packs launch parameters into a half's parameter area; the same offsets address the device
// copy once it is uploaded.
class ParamWriter {
 public:
  explicit ParamWriter(Staging::Half* half) : half_(half) {}

  // Appends `n` elements and returns their future device address.
  template <typename T>
  const T* Put(const T* data, size_t n) {
    used_ = AlignUp(used_, 16);
    std::memcpy(half_->host_params + used_, data, n * sizeof(T));
    const T* device = reinterpret_cast<const T*>(half_->device_params + used_);
    used_ += n * sizeof(T);
    return device;
  }

  absl::Status Upload(cudaStream_t stream) {
    if (used_ == 0) return absl::OkStatus();
    KVMESH_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(half_->device_params, half_->host_params, used_,
                                                cudaMemcpyHostToDevice, stream));
    return absl::OkStatus();
  }

 private:
  Staging::Half* half_;
  size_t used_ = 0;
};

// Rows per launch such that `planes` plane entries of `plane_entry` bytes, `lists` row lists and
// `extra` bytes fit in the parameter area; 0 when not even a few rows fit (RoPE tables of an
// absurd head_dim), which callers must refuse rather than loop on.
size_t MaxRowsPerLaunch(size_t planes, size_t plane_entry, int lists, size_t extra) {
  const size_t fixed = AlignUp(planes * plane_entry, 16) + AlignUp(extra, 16) + 64;
  const size_t per_row = 4 * size_t(lists);
  if (fixed >= kParamBytes || (kParamBytes - fixed) / per_row <= 4) return 0;
  return (kParamBytes - fixed) / per_row - 4;
}

// INVALID_ARGUMENT unless rows [0, max_row] of a plane at `offset` with rows of `row_bytes` lie
// inside `arena`. HostDevice leaves this to its callers (REQUIRES), but on the GPU a row past the
// arena is an illegal address, which poisons the CUDA context of every cache on the device.
absl::Status CheckRowsFit(const char* op, const DeviceArena& arena, size_t offset, size_t row_bytes,
                          int32_t max_row) {
  if (max_row < 0 || row_bytes == 0) return absl::OkStatus();
  if (offset > arena.size() || (arena.size() - offset) / row_bytes <= size_t(max_row)) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": row ", max_row, " of a plane at offset ", offset, " with rows of ",
                     row_bytes, " bytes ends past the arena's ", arena.size(), " bytes"));
  }
  return absl::OkStatus();
}

int32_t MaxRow(absl::Span<const int32_t> rows) {
  int32_t max_row = -1;
  for (int32_t r : rows) max_row = std::max(max_row, r);
  return max_row;
}

absl::Status CheckPlanesFit(const char* op, const DeviceArena& arena,
                            absl::Span<const Plane> planes, absl::Span<const int32_t> rows) {
  const int32_t max_row = MaxRow(rows);
  for (const Plane& plane : planes) {
    RETURN_IF_ERROR(CheckRowsFit(op, arena, plane.offset, plane.row_bytes, max_row));
  }
  return absl::OkStatus();
}

// A set of non-negative row indices: a bitmap when the rows are dense enough, else a hash set.
class RowSet {
 public:
  RowSet(int32_t max_row, size_t count) {
    if (max_row >= 0 && size_t(max_row) / 64 <= 4 * count + 4096) {
      bits_.assign(size_t(max_row) / 64 + 1, 0);
    }
  }
  bool contains(int32_t r) const {
    return bits_.empty() ? hash_.contains(r) : ((bits_[size_t(r) / 64] >> (r % 64)) & 1) != 0;
  }
  void insert(int32_t r) {
    if (bits_.empty()) {
      hash_.insert(r);
    } else {
      bits_[size_t(r) / 64] |= uint64_t{1} << (r % 64);
    }
  }
  void erase(int32_t r) {
    if (bits_.empty()) {
      hash_.erase(r);
    } else {
      bits_[size_t(r) / 64] &= ~(uint64_t{1} << (r % 64));
    }
  }

 private:
  std::vector<uint64_t> bits_;
  absl::flat_hash_set<int32_t> hash_;
};

// Splits the pairs (src_rows[i] -> dst_rows[i]) into runs [ends[k-1], ends[k]) of at most
// max_rows pairs that one launch can copy concurrently with the result of HostDevice's loop,
// which copies pair after pair. A run ends before a pair that writes a row written earlier in
// the run (the later write wins) or, when `shared` (source and destination rows address the same
// bytes: one arena, the same planes), before a pair that reads a row written earlier in the run
// (it must see the new bytes) or writes a row read earlier (that pair must see the old ones).
// Launches on one stream run in order, so runs reproduce the host's order exactly. RopeShift
// passes its rows as both lists: a row listed twice is rotated twice, as on the host. Negative
// rows move nothing and never conflict. The callers' lists rarely conflict: then this is one
// pass over them and the runs are only the max_rows split.
std::vector<size_t> SequentialRuns(absl::Span<const int32_t> src_rows,
                                   absl::Span<const int32_t> dst_rows, bool shared,
                                   size_t max_rows) {
  const size_t n = dst_rows.size();
  const int32_t max_row = std::max(shared ? MaxRow(src_rows) : -1, MaxRow(dst_rows));
  RowSet read(shared ? max_row : -1, n), written(max_row, n);
  std::vector<size_t> ends;
  size_t begin = 0;
  for (size_t i = 0; i < n; ++i) {
    const int32_t s = src_rows[i], d = dst_rows[i];
    const bool conflict = (d >= 0 && (written.contains(d) || (shared && read.contains(d)))) ||
                          (shared && s >= 0 && written.contains(s));
    if (conflict || i - begin == max_rows) {
      ends.push_back(i);
      for (size_t j = begin; j < i; ++j) {
        if (shared && src_rows[j] >= 0) read.erase(src_rows[j]);
        if (dst_rows[j] >= 0) written.erase(dst_rows[j]);
      }
      begin = i;
    }
    if (shared && s >= 0) read.insert(s);
    if (d >= 0) written.insert(d);
  }
  if (begin < n) ends.push_back(n);
  return ends;
}

// A run of whole planes [plane_begin, plane_end) and rows [row_begin, row_end) of one Scatter or
// Gather that fits in a half's payload area, or (huge) one plane whose rows are larger than it.
struct Piece {
  size_t plane_begin, plane_end;
  size_t row_begin, row_end;
  bool huge;
};

// Cuts planes x rows into pieces in the order of the contiguous host layout (plane after plane,
// rows in order within a plane).
std::vector<Piece> PlanPieces(absl::Span<const Plane> planes, size_t rows, size_t payload_bytes) {
  std::vector<Piece> pieces;
  const size_t max_rows = MaxRowsPerLaunch(kMaxPlanesPerLaunch, sizeof(CopyPlane), 1, 0);
  size_t p = 0;
  while (p < planes.size()) {
    const size_t row_bytes = planes[p].row_bytes;
    if (row_bytes == 0) {
      // Nothing to move (and no batch size to divide by below).
      ++p;
      continue;
    }
    if (row_bytes > payload_bytes) {
      pieces.push_back(Piece{p, p + 1, 0, rows, true});
      ++p;
      continue;
    }
    if (row_bytes * rows <= payload_bytes && rows <= max_rows) {
      // Whole planes, as many as fit.
      size_t end = p + 1, bytes = row_bytes * rows;
      while (end < planes.size() && end - p < kMaxPlanesPerLaunch &&
             bytes + planes[end].row_bytes * rows <= payload_bytes) {
        bytes += planes[end].row_bytes * rows;
        ++end;
      }
      pieces.push_back(Piece{p, end, 0, rows, false});
      p = end;
      continue;
    }
    // Row batches of one plane.
    const size_t batch = std::max<size_t>(1, std::min(payload_bytes / row_bytes, max_rows));
    for (size_t r = 0; r < rows; r += batch) {
      pieces.push_back(Piece{p, p + 1, r, std::min(rows, r + batch), false});
    }
    ++p;
  }
  return pieces;
}

// Host offset, in a plane-major payload of `rows` rows, of row `row` of plane `p`.
std::vector<size_t> PlaneStarts(absl::Span<const Plane> planes, size_t rows) {
  std::vector<size_t> starts(planes.size());
  size_t offset = 0;
  for (size_t p = 0; p < planes.size(); ++p) {
    starts[p] = offset;
    offset += planes[p].row_bytes * rows;
  }
  return starts;
}

class CudaDevice final : public Device {
 public:
  CudaDevice(const CudaDeviceOptions& options, cuda::Stream stream, cuda::Event done,
             std::unique_ptr<CudaSharedMemory> shared)
      : Device(options.budget_bytes, options.snapshot_budget_bytes),
        ordinal_(options.ordinal),
        staging_bytes_(options.staging_bytes),
        name_(absl::StrCat("cuda:", options.ordinal, CudaSimulated() ? " (simulated)" : "")),
        stream_(std::move(stream)),
        done_(std::move(done)),
        shared_(std::move(shared)) {}

  ~CudaDevice() override {
    // Teardown order: wait for the device's own stream, free the staging sets, then the stream
    // and its event. Caches (and their streams and arenas) are gone by now (REQUIRES).
    if (cudaSetDevice(ordinal_) != cudaSuccess) (void)cudaGetLastError();
    if (cudaStreamSynchronize(stream_.get()) != cudaSuccess) (void)cudaGetLastError();
    MutexLock lock(&staging_mu_);
    staging_.clear();
    done_ = cuda::Event();
    stream_ = cuda::Stream();
  }

  std::string name() const override { return name_; }

  absl::StatusOr<std::shared_ptr<DeviceStream>> CreateStream() override {
    KVMESH_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    ASSIGN_OR_RETURN(cuda::Stream stream, cuda::Stream::Create());
    ASSIGN_OR_RETURN(cuda::Event done, cuda::Event::Create());
    return std::make_shared<CudaStreamState>(ordinal_, std::move(stream), std::move(done));
  }

  absl::Status Scatter(const DeviceArena& arena, absl::Span<const Plane> planes,
                       absl::Span<const int32_t> rows, const uint8_t* src) override {
    if (planes.empty() || rows.empty()) return absl::OkStatus();
    RETURN_IF_ERROR(CheckPlanesFit("Scatter", arena, planes, rows));
    return Run(arena, [&](Queue q, Staging& staging) {
      return ScatterOn(q, staging, arena, planes, rows, src);
    });
  }

  absl::Status Gather(const DeviceArena& arena, absl::Span<const Plane> planes,
                      absl::Span<const int32_t> rows, uint8_t* dst) override {
    if (planes.empty() || rows.empty()) return absl::OkStatus();
    RETURN_IF_ERROR(CheckPlanesFit("Gather", arena, planes, rows));
    return Run(arena, [&](Queue q, Staging& staging) {
      return GatherOn(q, staging, arena, planes, rows, dst);
    });
  }

  absl::Status CopyRows(const DeviceArena& arena, absl::Span<const Plane> planes,
                        absl::Span<const int32_t> src_rows,
                        absl::Span<const int32_t> dst_rows) override {
    return CopyRowsBetween(arena, planes, src_rows, arena, planes, dst_rows);
  }

  absl::Status CopyRowsBetween(const DeviceArena& src, absl::Span<const Plane> src_planes,
                               absl::Span<const int32_t> src_rows, const DeviceArena& dst,
                               absl::Span<const Plane> dst_planes,
                               absl::Span<const int32_t> dst_rows) override {
    if (src_planes.size() != dst_planes.size() || src_rows.size() != dst_rows.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("CopyRowsBetween: ", src_planes.size(), " source planes and ",
                       dst_planes.size(), " destination planes, ", src_rows.size(),
                       " source rows and ", dst_rows.size(), " destination rows"));
    }
    if (src_planes.empty() || src_rows.empty()) return absl::OkStatus();
    // Destination rows are src row_bytes apart, as on the host.
    const int32_t max_src = MaxRow(src_rows), max_dst = MaxRow(dst_rows);
    for (size_t p = 0; p < src_planes.size(); ++p) {
      RETURN_IF_ERROR(CheckRowsFit("CopyRowsBetween", src, src_planes[p].offset,
                                   src_planes[p].row_bytes, max_src));
      RETURN_IF_ERROR(CheckRowsFit("CopyRowsBetween", dst, dst_planes[p].offset,
                                   src_planes[p].row_bytes, max_dst));
    }
    // Within one arena a pair may read a row another pair writes: CopyOn keeps the host's order.
    const bool shared = src.data() == dst.data();
    std::vector<CopyPlane> table(src_planes.size());
    for (size_t p = 0; p < table.size(); ++p) {
      table[p] = CopyPlane{src.data() + src_planes[p].offset, dst.data() + dst_planes[p].offset,
                           src_planes[p].row_bytes};
    }
    // Work on the destination's stream: every operation drains its stream before returning,
    // so the source's stream has nothing in flight.
    return Run(dst, [&](Queue q, Staging& staging) {
      return CopyOn(q, staging, table, src_rows, dst_rows, shared);
    });
  }

  absl::Status RopeShift(const DeviceArena& arena, absl::Span<const Plane> planes,
                         absl::Span<const int32_t> rows, const RopeShiftParams& p) override {
    // dims 0 (or 1) rotates nothing on the host either.
    if (planes.empty() || rows.empty() || p.rope.dims / 2 == 0) return absl::OkStatus();
    // Checked here, before the tables are sized by dims (LaunchRopeShift checks the rest).
    if (p.rope.dims < 0 || p.rope.dims > p.head_dim) {
      return absl::InvalidArgumentError(
          absl::StrCat("RopeShift: dims ", p.rope.dims, " not in [0, head_dim ", p.head_dim, "]"));
    }
    RETURN_IF_ERROR(CheckPlanesFit("RopeShift", arena, planes, rows));
    return Run(arena, [&](Queue q, Staging& staging) {
      return RopeShiftOn(q, staging, arena, planes, rows, p);
    });
  }

 public:
  absl::StatusOr<SharedArena> Share(const DeviceArena& arena) const override {
    if (shared_ == nullptr) return Device::Share(arena);
    return shared_->Share(arena.data());
  }

 protected:
  absl::StatusOr<uint8_t*> RawAllocate(size_t bytes, MemoryPool pool, bool shareable) override {
    (void)pool;
    // Shared: a cache group's cells, memory a worker may map (the local data path), never reused.
    if (shared_ != nullptr && shareable) return shared_->Allocate(bytes);
    KVMESH_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    void* data = nullptr;
    const cudaError_t error = cudaMalloc(&data, bytes == 0 ? 1 : bytes);
    if (error != cudaSuccess) {
      (void)cudaGetLastError();
      const std::string message = absl::StrCat("device ", name_, ": cudaMalloc of ", bytes,
                                               " bytes failed: ", cudaGetErrorString(error));
      if (error == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(message);
      return absl::InternalError(message);
    }
    return static_cast<uint8_t*>(data);
  }

  void RawFree(uint8_t* data, size_t bytes, MemoryPool pool) override {
    (void)pool;
    if (shared_ != nullptr && shared_->Owns(data)) {
      shared_->Free(data);
      return;
    }
    // Errors are ignored but cleared, so that the next launch check does not report them.
    if (cudaSetDevice(ordinal_) != cudaSuccess) (void)cudaGetLastError();
    if (cudaFree(data) != cudaSuccess) (void)cudaGetLastError();
  }

 private:
  // Runs `work` on the stream of `arena` (the device's own stream, under a lock, for arenas
  // bound to none) with a staging set, then drains the stream.
  template <typename Work>
  absl::Status Run(const DeviceArena& arena, Work work) {
    KVMESH_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    ASSIGN_OR_RETURN(std::unique_ptr<Staging> staging, AcquireStaging());
    absl::Status status;
    bool idle = true;
    if (arena.stream() == nullptr) {
      MutexLock lock(&own_stream_mu_);
      status = RunOn(Queue{stream_.get(), done_.get()}, *staging, work, &idle);
    } else {
      auto* state = dynamic_cast<CudaStreamState*>(arena.stream().get());
      if (state == nullptr || state->ordinal() != ordinal_) {
        status = absl::InternalError(
            absl::StrCat("device ", name_, ": arena is bound to a stream of another device"));
      } else {
        status = RunOn(Queue{state->stream(), state->done()}, *staging, work, &idle);
      }
    }
    if (idle) {
      ReleaseStaging(std::move(staging));
    } else {
      DiscardStaging(std::move(staging));
    }
    return status;
  }

  // Runs `work` and drains the stream. *idle is false when the stream could not be waited for
  // (a dead context): work enqueued on it may still read the staging set, which must then never
  // be handed to another operation (found by the simulated GPU's fault sweeps: a reused set's
  // new plane table steered a stale kernel's writes past an arena).
  template <typename Work>
  static absl::Status RunOn(Queue q, Staging& staging, Work& work, bool* idle) {
    absl::Status status = work(q, staging);
    // Drain even after an error: nothing may still be reading the staging set or the caller's
    // buffers when the operation returns.
    const absl::Status drained = Drain(q);
    if (!drained.ok()) {
      // The event could not be recorded or waited for: wait for the stream itself.
      if (cudaStreamSynchronize(q.stream) != cudaSuccess) {
        (void)cudaGetLastError();
        *idle = false;
      }
    }
    staging.Reset();
    if (!status.ok()) return status;
    return drained;
  }

  absl::StatusOr<std::unique_ptr<Staging>> AcquireStaging() {
    {
      MutexLock lock(&staging_mu_);
      while (staging_.empty() && staging_created_ >= kMaxStagingSets) {
        staging_released_.wait(staging_mu_);
      }
      if (!staging_.empty()) {
        std::unique_ptr<Staging> staging = std::move(staging_.back());
        staging_.pop_back();
        return staging;
      }
      ++staging_created_;
    }
    absl::StatusOr<std::unique_ptr<Staging>> created = Staging::Create(staging_bytes_);
    if (!created.ok()) {
      MutexLock lock(&staging_mu_);
      --staging_created_;
      staging_released_.notify_one();
    }
    return created;
  }

  void ReleaseStaging(std::unique_ptr<Staging> staging) {
    MutexLock lock(&staging_mu_);
    staging_.push_back(std::move(staging));
    staging_released_.notify_one();
  }

  // Drops a staging set that a stream may still use (RunOn): it is never reused, and its place
  // in the pool goes to a new set. Its memory is freed now (cudaFree waits for the device, or
  // fails on a dead context, when the memory is lost with the context anyway).
  void DiscardStaging(std::unique_ptr<Staging> staging) {
    staging.reset();
    MutexLock lock(&staging_mu_);
    --staging_created_;
    staging_released_.notify_one();
  }

  // Device-to-device row copies, split into launches whose row lists fit a parameter area and
  // whose pairs do not conflict (SequentialRuns; `shared`: one arena, the same planes).
  static absl::Status CopyOn(Queue q, Staging& staging, absl::Span<const CopyPlane> table,
                             absl::Span<const int32_t> src_rows, absl::Span<const int32_t> dst_rows,
                             bool shared) {
    const size_t max_rows = MaxRowsPerLaunch(kMaxPlanesPerLaunch, sizeof(CopyPlane), 2, 0);
    const std::vector<size_t> ends = SequentialRuns(src_rows, dst_rows, shared, max_rows);
    for (size_t p0 = 0; p0 < table.size(); p0 += kMaxPlanesPerLaunch) {
      const size_t planes = std::min(kMaxPlanesPerLaunch, table.size() - p0);
      for (size_t k = 0, r0 = 0; k < ends.size(); r0 = ends[k++]) {
        const size_t n = ends[k] - r0;
        ASSIGN_OR_RETURN(Staging::Half * half, staging.Next());
        ParamWriter params(half);
        const CopyPlane* d_table = params.Put(table.data() + p0, planes);
        const int32_t* d_src = params.Put(src_rows.data() + r0, n);
        const int32_t* d_dst = params.Put(dst_rows.data() + r0, n);
        RETURN_IF_ERROR(params.Upload(q.stream));
        RETURN_IF_ERROR(staging.Transferred(half, q.stream));
        RETURN_IF_ERROR(cuda::LaunchCopyRows(d_table, static_cast<int32_t>(planes), d_src, d_dst,
                                             static_cast<int32_t>(n), q.stream));
      }
    }
    return absl::OkStatus();
  }

  absl::Status ScatterOn(Queue q, Staging& staging, const DeviceArena& arena,
                         absl::Span<const Plane> planes, absl::Span<const int32_t> rows,
                         const uint8_t* src) {
    const std::vector<size_t> starts = PlaneStarts(planes, rows.size());
    for (const Piece& piece : PlanPieces(planes, rows.size(), staging.payload_bytes())) {
      if (piece.huge) {
        RETURN_IF_ERROR(ScatterHugeRows(q, staging, arena, planes[piece.plane_begin], rows,
                                        src + starts[piece.plane_begin]));
        continue;
      }
      ASSIGN_OR_RETURN(Staging::Half * half, staging.Next());
      const size_t n = piece.row_end - piece.row_begin;
      std::vector<CopyPlane> table;
      size_t offset = 0;
      for (size_t p = piece.plane_begin; p < piece.plane_end; ++p) {
        const size_t bytes = planes[p].row_bytes * n;
        std::memcpy(half->host_payload + offset,
                    src + starts[p] + planes[p].row_bytes * piece.row_begin, bytes);
        table.push_back(CopyPlane{half->device_payload + offset, arena.data() + planes[p].offset,
                                  planes[p].row_bytes});
        offset += bytes;
      }
      KVMESH_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(half->device_payload, half->host_payload, offset,
                                                  cudaMemcpyHostToDevice, q.stream));
      ParamWriter params(half);
      const CopyPlane* d_table = params.Put(table.data(), table.size());
      const int32_t* d_rows = params.Put(rows.data() + piece.row_begin, n);
      RETURN_IF_ERROR(params.Upload(q.stream));
      RETURN_IF_ERROR(cuda::LaunchCopyRows(d_table, static_cast<int32_t>(table.size()), nullptr,
                                           d_rows, static_cast<int32_t>(n), q.stream));
      // The kernel reads the device half; the next use of this half is enqueued after it on the
      // same stream, so the event only has to cover the host side.
      RETURN_IF_ERROR(staging.Transferred(half, q.stream));
    }
    return absl::OkStatus();
  }

  // Rows larger than a staging half go straight to their place in the arena, one staging-sized
  // part at a time (a row is contiguous on the device).
  static absl::Status ScatterHugeRows(Queue q, Staging& staging, const DeviceArena& arena,
                                      const Plane& plane, absl::Span<const int32_t> rows,
                                      const uint8_t* src) {
    for (size_t i = 0; i < rows.size(); ++i) {
      if (rows[i] < 0) continue;
      uint8_t* row = arena.data() + plane.offset + size_t(rows[i]) * plane.row_bytes;
      const uint8_t* from = src + i * plane.row_bytes;
      for (size_t done = 0; done < plane.row_bytes; done += staging.payload_bytes()) {
        const size_t bytes = std::min(staging.payload_bytes(), plane.row_bytes - done);
        ASSIGN_OR_RETURN(Staging::Half * half, staging.Next());
        std::memcpy(half->host_payload, from + done, bytes);
        KVMESH_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(row + done, half->host_payload, bytes,
                                                    cudaMemcpyHostToDevice, q.stream));
        RETURN_IF_ERROR(staging.Transferred(half, q.stream));
      }
    }
    return absl::OkStatus();
  }

  // A gathered part waiting for its transfer to the host before it is copied out.
  struct Outbound {
    Staging::Half* half;
    uint8_t* dst;
    size_t bytes;  // from the start of the half's host payload
  };

  static absl::Status Deliver(Outbound& out) {
    KVMESH_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(out.half->transferred));
    out.half->in_use = false;
    if (out.bytes > 0) std::memcpy(out.dst, out.half->host_payload, out.bytes);
    return absl::OkStatus();
  }

  absl::Status GatherOn(Queue q, Staging& staging, const DeviceArena& arena,
                        absl::Span<const Plane> planes, absl::Span<const int32_t> rows,
                        uint8_t* dst) {
    const std::vector<size_t> starts = PlaneStarts(planes, rows.size());
    // One part in flight while the next is enqueued: the device works on part k+1 while the
    // host copies part k out.
    std::optional<Outbound> pending;
    auto flush = [&]() -> absl::Status {
      if (!pending) return absl::OkStatus();
      absl::Status s = Deliver(*pending);
      pending.reset();
      return s;
    };
    for (const Piece& piece : PlanPieces(planes, rows.size(), staging.payload_bytes())) {
      if (piece.huge) {
        RETURN_IF_ERROR(flush());
        RETURN_IF_ERROR(GatherHugeRows(q, staging, arena, planes[piece.plane_begin], rows,
                                       dst + starts[piece.plane_begin]));
        continue;
      }
      ASSIGN_OR_RETURN(Staging::Half * half, staging.Next());
      const size_t n = piece.row_end - piece.row_begin;
      std::vector<CopyPlane> table;
      Outbound out{half, dst, 0};
      size_t offset = 0;
      // Planes of a piece are either whole (then adjacent in dst too: one copy out) or one
      // plane's row batch (one copy out as well).
      uint8_t* first =
          dst + starts[piece.plane_begin] + planes[piece.plane_begin].row_bytes * piece.row_begin;
      for (size_t p = piece.plane_begin; p < piece.plane_end; ++p) {
        table.push_back(CopyPlane{arena.data() + planes[p].offset, half->device_payload + offset,
                                  planes[p].row_bytes});
        offset += planes[p].row_bytes * n;
      }
      out.dst = first;
      out.bytes = offset;
      ParamWriter params(half);
      const CopyPlane* d_table = params.Put(table.data(), table.size());
      const int32_t* d_rows = params.Put(rows.data() + piece.row_begin, n);
      RETURN_IF_ERROR(params.Upload(q.stream));
      RETURN_IF_ERROR(cuda::LaunchCopyRows(d_table, static_cast<int32_t>(table.size()), d_rows,
                                           nullptr, static_cast<int32_t>(n), q.stream));
      KVMESH_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(half->host_payload, half->device_payload, offset,
                                                  cudaMemcpyDeviceToHost, q.stream));
      RETURN_IF_ERROR(staging.Transferred(half, q.stream));
      RETURN_IF_ERROR(flush());
      pending = std::move(out);
    }
    return flush();
  }

  static absl::Status GatherHugeRows(Queue q, Staging& staging, const DeviceArena& arena,
                                     const Plane& plane, absl::Span<const int32_t> rows,
                                     uint8_t* dst) {
    for (size_t i = 0; i < rows.size(); ++i) {
      const uint8_t* row = arena.data() + plane.offset + size_t(rows[i]) * plane.row_bytes;
      uint8_t* to = dst + i * plane.row_bytes;
      for (size_t done = 0; done < plane.row_bytes; done += staging.payload_bytes()) {
        const size_t bytes = std::min(staging.payload_bytes(), plane.row_bytes - done);
        ASSIGN_OR_RETURN(Staging::Half * half, staging.Next());
        KVMESH_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(half->host_payload, row + done, bytes,
                                                    cudaMemcpyDeviceToHost, q.stream));
        RETURN_IF_ERROR(staging.Transferred(half, q.stream));
        KVMESH_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(half->transferred));
        half->in_use = false;
        std::memcpy(to + done, half->host_payload, bytes);
      }
    }
    return absl::OkStatus();
  }

  static absl::Status RopeShiftOn(Queue q, Staging& staging, const DeviceArena& arena,
                                  absl::Span<const Plane> planes, absl::Span<const int32_t> rows,
                                  const RopeShiftParams& p) {
    if (planes.empty() || rows.empty()) return absl::OkStatus();
    const int32_t half_dims = p.rope.dims / 2;
    // The same table as HostDevice: angles in double, rounded once to float.
    std::vector<float> cos_table(half_dims), sin_table(half_dims);
    for (int32_t i = 0; i < half_dims; ++i) {
      const double theta = double(p.delta) * double(p.rope.freq_scale) *
                           std::pow(double(p.rope.base), -2.0 * i / double(p.rope.dims));
      cos_table[i] = static_cast<float>(std::cos(theta));
      sin_table[i] = static_cast<float>(std::sin(theta));
    }
    const cuda::RopeDType dtype = p.dtype == DType::kF32   ? cuda::RopeDType::kF32
                                  : p.dtype == DType::kF16 ? cuda::RopeDType::kF16
                                                           : cuda::RopeDType::kBF16;
    // Planes of a group share a row size (K rows of one group's layers).
    const size_t row_bytes = planes[0].row_bytes;
    std::vector<uint8_t*> bases;
    for (const Plane& plane : planes) {
      if (plane.row_bytes != row_bytes) {
        return absl::InvalidArgumentError(absl::StrCat("RopeShift: planes of ", row_bytes, " and ",
                                                       plane.row_bytes, " bytes per row"));
      }
      bases.push_back(arena.data() + plane.offset);
    }
    const size_t max_rows =
        MaxRowsPerLaunch(kMaxPlanesPerLaunch, sizeof(uint8_t*), 1, 2 * 16 + 8 * size_t(half_dims));
    if (max_rows == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("RopeShift: dims ", p.rope.dims, " too large for one launch's tables"));
    }
    // A row listed twice is rotated twice, in order, as on the host.
    const std::vector<size_t> ends = SequentialRuns(rows, rows, /*shared=*/true, max_rows);
    for (size_t p0 = 0; p0 < bases.size(); p0 += kMaxPlanesPerLaunch) {
      const size_t n_planes = std::min(kMaxPlanesPerLaunch, bases.size() - p0);
      for (size_t k = 0, r0 = 0; k < ends.size(); r0 = ends[k++]) {
        const size_t n = ends[k] - r0;
        ASSIGN_OR_RETURN(Staging::Half * half, staging.Next());
        ParamWriter params(half);
        uint8_t* const* d_planes = params.Put(bases.data() + p0, n_planes);
        const int32_t* d_rows = params.Put(rows.data() + r0, n);
        const float* d_cos = params.Put(cos_table.data(), cos_table.size());
        const float* d_sin = params.Put(sin_table.data(), sin_table.size());
        RETURN_IF_ERROR(params.Upload(q.stream));
        RETURN_IF_ERROR(staging.Transferred(half, q.stream));
        RETURN_IF_ERROR(cuda::LaunchRopeShift(
            d_planes, static_cast<int32_t>(n_planes), row_bytes, d_rows, static_cast<int32_t>(n),
            dtype, p.num_heads, p.head_dim, p.rope.dims, p.rope.type == RopeType::kNeox, d_cos,
            d_sin, q.stream));
      }
    }
    return absl::OkStatus();
  }

  const int ordinal_;
  const size_t staging_bytes_;
  const std::string name_;

  // The device's own stream, for arenas bound to none; one operation at a time.
  Mutex own_stream_mu_;
  cuda::Stream stream_;
  cuda::Event done_;
  // With CudaDeviceOptions::shareable, where every arena comes from; null otherwise.
  const std::unique_ptr<CudaSharedMemory> shared_;

  Mutex staging_mu_;
  std::vector<std::unique_ptr<Staging>> staging_ ABSL_GUARDED_BY(staging_mu_);
  int staging_created_ ABSL_GUARDED_BY(staging_mu_) = 0;
  std::condition_variable_any staging_released_;
};

}  // namespace

bool CudaBuilt() { return true; }

bool CudaSimulated() {
#if defined(KVMESH_CUDA_SIMULATED)
  return true;
#else
  return false;
#endif
}

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no GPU: not an error for the caller
    return 0;
  }
  return count;
}

absl::StatusOr<std::unique_ptr<Device>> CreateCudaDevice(const CudaDeviceOptions& options) {
  const int count = CudaDeviceCount();
  if (options.ordinal < 0 || options.ordinal >= count) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CUDA device ", options.ordinal, " does not exist: ", count, " CUDA devices are visible"));
  }
  KVMESH_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.ordinal));
  size_t free_bytes = 0, total_bytes = 0;
  KVMESH_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
  // Taken from free_bytes one part at a time, so that huge budgets cannot wrap the sum around.
  size_t left = free_bytes;
  auto take = [&left](size_t bytes) {
    if (bytes > left) return false;
    left -= bytes;
    return true;
  };
  bool fits = take(options.budget_bytes) && take(options.snapshot_budget_bytes);
  for (int i = 0; fits && i < kMaxStagingSets; ++i) {
    fits = take(options.staging_bytes) && take(2 * kParamBytes);
  }
  const size_t staging = options.staging_bytes > SIZE_MAX / (2 * kMaxStagingSets)
                             ? SIZE_MAX
                             : size_t(kMaxStagingSets) * (options.staging_bytes + 2 * kParamBytes);
  if (!fits) {
    return absl::ResourceExhaustedError(
        absl::StrCat("CUDA device ", options.ordinal, " has ", free_bytes, " of ", total_bytes,
                     " bytes free, less than the memory budget (", options.budget_bytes,
                     ") plus the snapshot budget (", options.snapshot_budget_bytes,
                     ") plus staging (", staging, ")"));
  }
  ASSIGN_OR_RETURN(cuda::Stream stream, cuda::Stream::Create());
  ASSIGN_OR_RETURN(cuda::Event done, cuda::Event::Create());
  std::unique_ptr<CudaSharedMemory> shared;
  if (options.shareable) {
    ASSIGN_OR_RETURN(shared, CudaSharedMemory::Create(options.ordinal));
  }
  return std::unique_ptr<Device>(
      new CudaDevice(options, std::move(stream), std::move(done), std::move(shared)));
}

}  // namespace kvmesh

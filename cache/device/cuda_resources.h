// Move-only owners of CUDA resources: streams, events, device buffers and pinned host buffers.
//
// Each is created by a StatusOr factory (so a failure is a Status, never a half-built object)
// and released in its destructor; release errors are ignored because nothing can be done about
// them during teardown. They do not select the device: the caller has made the owning device
// current (cudaSetDevice) around creation and destruction. No object of these types may have
// static storage duration (the CUDA runtime may already be gone when statics are destroyed).
//
// Thread safety: none of their own; the objects they manage follow CUDA's rules.
#ifndef KVMESH_CACHE_DEVICE_CUDA_RESOURCES_H_
#define KVMESH_CACHE_DEVICE_CUDA_RESOURCES_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <utility>

#include "absl/status/statusor.h"

namespace kvmesh {
namespace cuda {

// A non-blocking stream (does not synchronize with the legacy default stream).
class Stream {
 public:
  static absl::StatusOr<Stream> Create();
  Stream() = default;
  Stream(Stream&& o) noexcept : stream_(std::exchange(o.stream_, nullptr)) {}
  Stream& operator=(Stream&& o) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream();

  cudaStream_t get() const { return stream_; }

 private:
  explicit Stream(cudaStream_t stream) : stream_(stream) {}
  cudaStream_t stream_ = nullptr;
};

// An event for completion only: no timing, and waiting on it blocks the thread instead of
// spinning (a node runs many callers on few cores).
class Event {
 public:
  static absl::StatusOr<Event> Create();
  Event() = default;
  Event(Event&& o) noexcept : event_(std::exchange(o.event_, nullptr)) {}
  Event& operator=(Event&& o) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event();

  cudaEvent_t get() const { return event_; }

 private:
  explicit Event(cudaEvent_t event) : event_(event) {}
  cudaEvent_t event_ = nullptr;
};

// `bytes` of device memory (cudaMalloc).
class DeviceBuffer {
 public:
  static absl::StatusOr<DeviceBuffer> Create(size_t bytes);
  DeviceBuffer() = default;
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer();

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  DeviceBuffer(uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// `bytes` of page-locked host memory (cudaMallocHost): the only host memory the GPU's copy
// engines can read and write asynchronously at full speed.
class PinnedBuffer {
 public:
  static absl::StatusOr<PinnedBuffer> Create(size_t bytes);
  PinnedBuffer() = default;
  PinnedBuffer(PinnedBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer();

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  PinnedBuffer(uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace cuda
}  // namespace kvmesh

#endif  // KVMESH_CACHE_DEVICE_CUDA_RESOURCES_H_

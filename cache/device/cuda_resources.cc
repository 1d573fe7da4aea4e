#include "cache/device/cuda_resources.h"

#include "absl/strings/str_cat.h"
#include "cache/device/cuda_check.h"

namespace kvmesh {
namespace cuda {

absl::Status CudaError(cudaError_t error, const char* expr, const char* file, int line) {
  const std::string message =
      absl::StrCat(expr, " failed at ", file, ":", line, ": ", cudaGetErrorName(error), " (",
                   cudaGetErrorString(error), ")");
  if (error == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

namespace {

// Release errors are ignored (see the header), but must not stay behind as the thread's last
// error, where the next launch check (cudaGetLastError) would report them as its own.
void Released(cudaError_t error) {
  if (error != cudaSuccess) (void)cudaGetLastError();
}

}  // namespace

absl::StatusOr<Stream> Stream::Create() {
  cudaStream_t stream = nullptr;
  KVMESH_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return Stream(stream);
}

Stream& Stream::operator=(Stream&& o) noexcept {
  if (this != &o) {
    Stream old(std::exchange(stream_, std::exchange(o.stream_, nullptr)));
  }
  return *this;
}

Stream::~Stream() {
  if (stream_ != nullptr) Released(cudaStreamDestroy(stream_));
}

absl::StatusOr<Event> Event::Create() {
  cudaEvent_t event = nullptr;
  KVMESH_CUDA_RETURN_IF_ERROR(
      cudaEventCreateWithFlags(&event, cudaEventDisableTiming | cudaEventBlockingSync));
  return Event(event);
}

Event& Event::operator=(Event&& o) noexcept {
  if (this != &o) {
    Event old(std::exchange(event_, std::exchange(o.event_, nullptr)));
  }
  return *this;
}

Event::~Event() {
  if (event_ != nullptr) Released(cudaEventDestroy(event_));
}

absl::StatusOr<DeviceBuffer> DeviceBuffer::Create(size_t bytes) {
  void* data = nullptr;
  if (bytes > 0) KVMESH_CUDA_RETURN_IF_ERROR(cudaMalloc(&data, bytes));
  return DeviceBuffer(static_cast<uint8_t*>(data), bytes);
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    DeviceBuffer old(std::move(*this));
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() {
  if (data_ != nullptr) Released(cudaFree(data_));
}

absl::StatusOr<PinnedBuffer> PinnedBuffer::Create(size_t bytes) {
  void* data = nullptr;
  if (bytes > 0) KVMESH_CUDA_RETURN_IF_ERROR(cudaMallocHost(&data, bytes));
  return PinnedBuffer(static_cast<uint8_t*>(data), bytes);
}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    PinnedBuffer old(std::move(*this));
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

PinnedBuffer::~PinnedBuffer() {
  if (data_ != nullptr) Released(cudaFreeHost(data_));
}

}  // namespace cuda
}  // namespace kvmesh

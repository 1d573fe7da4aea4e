// SliceReader: protobuf wire-format values read across the slices of a message as gRPC
// received it (grpc::ByteBuffer::Dump), so that a raw handler finds a large bytes field where it
// lies instead of having it copied into a parsed message. Header-only, beside the API's .proto
// files because both transport/ (the grpc-stream transport's Fetch client) and service/common/
// (the raw AppendStream and Read messages of raw_message.h) read that wire format, and neither
// layer may include the other.
#ifndef KVMESH_PROTO_WIRE_SLICE_READER_H_
#define KVMESH_PROTO_WIRE_SLICE_READER_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <grpcpp/support/slice.h>

#include "absl/types/span.h"

namespace kvmesh {

// Reads protobuf wire-format values across a message's slices, which must outlive it. Each
// call returns false, having consumed what it read, when the message ends first.
class SliceReader {
 public:
  explicit SliceReader(const std::vector<grpc::Slice>& slices) : slices_(slices) { SkipEmpty(); }

  bool done() const { return slice_ == slices_.size(); }

  // While `capture` is set (not null), every byte read is also appended to it.
  void set_capture(std::string* capture) { capture_ = capture; }

  bool Byte(uint8_t* b) {
    if (done()) return false;
    *b = slices_[slice_].begin()[pos_];
    if (capture_ != nullptr) capture_->push_back(static_cast<char>(*b));
    Advance(1);
    return true;
  }

  bool Varint(uint64_t* value) {
    *value = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t b;
      if (!Byte(&b)) return false;
      *value |= uint64_t{b & 0x7fu} << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;  // more than 10 bytes
  }

  bool Fixed32(uint32_t* value) {
    uint8_t b[4];
    for (uint8_t& x : b) {
      if (!Byte(&x)) return false;
    }
    *value = uint32_t{b[0]} | uint32_t{b[1]} << 8 | uint32_t{b[2]} << 16 | uint32_t{b[3]} << 24;
    return true;
  }

  // The next n bytes as pieces of the slices (appended to *pieces when not null).
  bool Take(uint64_t n, std::vector<absl::Span<const uint8_t>>* pieces) {
    while (n > 0) {
      if (done()) return false;
      const grpc::Slice& s = slices_[slice_];
      const size_t k = static_cast<size_t>(std::min<uint64_t>(n, s.size() - pos_));
      if (pieces != nullptr) pieces->emplace_back(s.begin() + pos_, k);
      if (capture_ != nullptr) capture_->append(reinterpret_cast<const char*>(s.begin()) + pos_, k);
      Advance(k);
      n -= k;
    }
    return true;
  }

 private:
  void Advance(size_t n) {
    pos_ += n;
    if (pos_ == slices_[slice_].size()) {
      ++slice_;
      pos_ = 0;
      SkipEmpty();
    }
  }
  void SkipEmpty() {
    while (slice_ < slices_.size() && slices_[slice_].size() == 0) ++slice_;
  }

  const std::vector<grpc::Slice>& slices_;
  size_t slice_ = 0;
  size_t pos_ = 0;
  std::string* capture_ = nullptr;
};

}  // namespace kvmesh

#endif  // KVMESH_PROTO_WIRE_SLICE_READER_H_

#include "service/common/bulk_client.h"

#include <algorithm>
#include <utility>
#include <vector>

#include <grpc/slice.h>

#include "absl/strings/str_cat.h"
#include "cache/status_macros.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "grpcpp/impl/codegen/rpc_method.h"
#include "grpcpp/impl/codegen/sync_stream.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "service/common/convert.h"
#include "service/common/raw_message.h"

namespace kvmesh {
namespace {

constexpr char kAppendStreamMethod[] = "/kvmesh.v1.CacheService/AppendStream";
constexpr char kReadMethod[] = "/kvmesh.v1.CacheService/Read";

void AppendVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

// A slice of payload bytes that holds a reference to the payload until gRPC releases it.
grpc::Slice PayloadSlice(const std::shared_ptr<const std::string>& payload, size_t offset,
                         size_t n) {
  auto* owner = new std::shared_ptr<const std::string>(payload);
  grpc_slice slice = grpc_slice_new_with_user_data(
      const_cast<char*>((*owner)->data() + offset), n,
      [](void* p) { delete static_cast<std::shared_ptr<const std::string>*>(p); }, owner);
  return grpc::Slice(slice, grpc::Slice::STEAL_REF);
}

}  // namespace

absl::Status SendAppendStream(grpc::ChannelInterface* channel, grpc::ClientContext* context,
                              const v1::AppendHeader& header,
                              std::shared_ptr<const std::string> payload, size_t chunk_bytes,
                              v1::AppendResponse* response) {
  if (chunk_bytes == 0) return absl::InvalidArgumentError("chunk_bytes must be > 0");
  const grpc::internal::RpcMethod method(kAppendStreamMethod,
                                         grpc::internal::RpcMethod::CLIENT_STREAMING);
  grpc::ByteBuffer response_bytes;
  std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> writer(
      grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(channel, method, context,
                                                                    &response_bytes));
  const std::string& bytes = *payload;
  size_t sent = 0;
  bool first = true;
  // AppendStreamRequest's encoding: field 1 (header) in the first message, field 2 (data).
  do {
    const size_t n = std::min(bytes.size() - sent, chunk_bytes);
    std::string prefix;
    if (first) {
      const std::string encoded = header.SerializeAsString();
      prefix.push_back(static_cast<char>(1 << 3 | 2));
      AppendVarint(encoded.size(), &prefix);
      prefix += encoded;
    }
    prefix.push_back(static_cast<char>(2 << 3 | 2));
    AppendVarint(n, &prefix);
    std::vector<grpc::Slice> slices;
    slices.emplace_back(prefix.data(), prefix.size());
    if (n > 0) slices.push_back(PayloadSlice(payload, sent, n));
    const grpc::ByteBuffer message(slices.data(), slices.size());
    sent += n;
    first = false;
    if (!writer->Write(message)) break;  // the node ended the call; Finish says why
  } while (sent < bytes.size());
  writer->WritesDone();
  RETURN_IF_ERROR(FromGrpcStatus(writer->Finish()));
  std::vector<grpc::Slice> slices;
  std::string encoded;
  if (response_bytes.Dump(&slices).ok()) {
    for (const grpc::Slice& s : slices) {
      encoded.append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
  }
  if (!response->ParseFromString(encoded)) {
    return absl::InternalError("the AppendResponse does not parse");
  }
  return absl::OkStatus();
}

absl::Status ReceiveReadStream(grpc::ChannelInterface* channel, grpc::ClientContext* context,
                               const v1::ReadRequest& request, v1::ReadHeader* header,
                               absl::FunctionRef<void(absl::Span<const uint8_t>)> sink) {
  const grpc::internal::RpcMethod method(kReadMethod, grpc::internal::RpcMethod::SERVER_STREAMING);
  std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
      grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(channel, method, context,
                                                                    request));
  grpc::ByteBuffer message;
  std::vector<grpc::Slice> slices;
  int64_t index = 0;
  uint64_t received = 0;
  absl::Status broken;
  while (broken.ok() && reader->Read(&message)) {
    slices.clear();
    RawReadResponse raw;
    absl::Status parsed = message.Dump(&slices).ok()
                              ? ParseRaw(slices, &raw)
                              : absl::InternalError("its bytes could not be read");
    if (!parsed.ok()) {
      broken = absl::DataLossError(
          absl::StrCat("Read message ", index, " does not parse: ", parsed.message()));
    } else if (raw.has_header != (index == 0)) {
      broken = absl::DataLossError(index == 0 ? "read stream's first message has no header"
                                              : "read stream carried a second header");
    } else {
      if (index == 0) *header = std::move(raw.header);
      for (const absl::Span<const uint8_t> piece : raw.data) sink(piece);
      received += raw.data_bytes;
    }
    ++index;
  }
  if (!broken.ok()) {
    context->TryCancel();
    reader->Finish();
    return broken;
  }
  RETURN_IF_ERROR(FromGrpcStatus(reader->Finish()));
  if (index == 0) return absl::DataLossError("read stream ended without a header");
  if (received != static_cast<uint64_t>(header->payload_bytes())) {
    return absl::DataLossError(absl::StrCat("read stream carried ", received,
                                            " payload bytes, its header announced ",
                                            header->payload_bytes()));
  }
  return absl::OkStatus();
}

}  // namespace kvmesh

#include "service/common/health_client.h"

#include <cstdint>
#include <utility>
#include <vector>

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/wire_format_lite.h"
#include "grpcpp/impl/client_unary_call.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/client_callback.h"

namespace kvmesh {
namespace {

constexpr char kCheckMethod[] = "/grpc.health.v1.Health/Check";

using google::protobuf::internal::WireFormatLite;

// HealthCheckRequest { string service = 1; }
grpc::ByteBuffer EncodeRequest(const std::string& service) {
  std::string bytes;
  if (!service.empty()) {
    google::protobuf::io::StringOutputStream raw(&bytes);
    google::protobuf::io::CodedOutputStream out(&raw);
    WireFormatLite::WriteString(1, service, &out);
  }
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

// HealthCheckResponse { ServingStatus status = 1; }; unknown fields are skipped.
bool DecodeResponse(const grpc::ByteBuffer& buffer, ServingStatus* status) {
  std::vector<grpc::Slice> slices;
  if (!buffer.Dump(&slices).ok()) return false;
  std::string bytes;
  for (const grpc::Slice& s : slices) {
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  google::protobuf::io::CodedInputStream in(reinterpret_cast<const uint8_t*>(bytes.data()),
                                            static_cast<int>(bytes.size()));
  uint32_t value = 0;  // proto3 default: UNKNOWN
  while (uint32_t tag = in.ReadTag()) {
    if (tag == WireFormatLite::MakeTag(1, WireFormatLite::WIRETYPE_VARINT)) {
      if (!in.ReadVarint32(&value)) return false;
    } else if (!WireFormatLite::SkipField(&in, tag)) {
      return false;
    }
  }
  if (!in.ConsumedEntireMessage()) return false;
  *status = value <= 3 ? static_cast<ServingStatus>(value) : ServingStatus::kUnknown;
  return true;
}

grpc::Status ParseError() {
  return grpc::Status(grpc::StatusCode::INTERNAL, "health: response does not parse");
}

}  // namespace

const char* ServingStatusName(ServingStatus status) {
  switch (status) {
    case ServingStatus::kUnknown:
      return "UNKNOWN";
    case ServingStatus::kServing:
      return "SERVING";
    case ServingStatus::kNotServing:
      return "NOT_SERVING";
    case ServingStatus::kServiceUnknown:
      return "SERVICE_UNKNOWN";
  }
  return "UNKNOWN";
}

HealthClient::HealthClient(std::shared_ptr<grpc::Channel> channel)
    : channel_(std::move(channel)),
      check_method_(kCheckMethod, grpc::internal::RpcMethod::NORMAL_RPC, channel_) {}

grpc::Status HealthClient::Check(grpc::ClientContext* context, const std::string& service,
                                 ServingStatus* status) const {
  grpc::ByteBuffer response;
  grpc::Status rpc = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
      channel_.get(), check_method_, context, EncodeRequest(service), &response);
  if (!rpc.ok()) return rpc;
  ServingStatus parsed;
  if (!DecodeResponse(response, &parsed)) return ParseError();
  *status = parsed;
  return grpc::Status::OK;
}

void HealthClient::CheckAsync(grpc::ClientContext* context, const std::string& service,
                              std::function<void(grpc::Status, ServingStatus)> done) const {
  // The messages live until the completion; the channel too (the call holds no reference).
  struct Call {
    std::shared_ptr<grpc::Channel> channel;
    grpc::ByteBuffer request;
    grpc::ByteBuffer response;
    std::function<void(grpc::Status, ServingStatus)> done;
  };
  auto* call = new Call{channel_, EncodeRequest(service), grpc::ByteBuffer(), std::move(done)};
  grpc::internal::CallbackUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
      call->channel.get(), check_method_, context, &call->request, &call->response,
      [call](grpc::Status rpc) {
        ServingStatus parsed = ServingStatus::kUnknown;
        if (rpc.ok() && !DecodeResponse(call->response, &parsed)) rpc = ParseError();
        call->done(std::move(rpc), parsed);
        delete call;
      });
}

}  // namespace kvmesh

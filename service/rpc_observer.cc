#include "service/rpc_observer.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cache/mutex.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/byte_buffer.h"
#include "kvmesh/v1/kvmesh.pb.h"
#include "service/common/convert.h"
#include "service/common/log.h"
#include "service/common/raw_message.h"

namespace kvmesh {
namespace {

using grpc::experimental::InterceptionHookPoints;

constexpr size_t kMaxLoggedValue = 160;
// The largest gated unary request whose names a log line gives.
constexpr size_t kMaxObservedRequestBytes = size_t{64} << 10;

// The services the node serves; a method of any other is "other" in metrics and logs.
bool KnownService(absl::string_view service) {
  return service == "kvmesh.v1.CacheService" || service == "kvmesh.v1.PeerService" ||
         service == "grpc.health.v1.Health" ||
         service == "grpc.reflection.v1alpha.ServerReflection";
}

// How the method's request reaches the interceptor: always as a ByteBuffer, since kvmesh serves
// its methods through RequestGates (and AppendStream raw). CacheService/Append, Read and
// AppendStream have their request or first message's header parsed here for the log; the
// other methods of CacheService and PeerService (kRawUnary) have a small request's slices kept
// and parsed only for a line the observer logs, once the caller is known. Nothing of
// PeerService/Fetch's request is worth logging, and health and reflection are raw inside gRPC
// (kNone).
enum class RequestForm { kNone, kRawRead, kRawAppend, kRawAppendStream, kRawUnary };

RequestForm FormOf(absl::string_view service, absl::string_view method) {
  if (service == "kvmesh.v1.CacheService") {
    if (method == "Read") return RequestForm::kRawRead;
    if (method == "Append") return RequestForm::kRawAppend;
    if (method == "AppendStream") return RequestForm::kRawAppendStream;
    return RequestForm::kRawUnary;
  }
  if (service == "kvmesh.v1.PeerService" && method != "Fetch") return RequestForm::kRawUnary;
  return RequestForm::kNone;
}

std::string GrpcCodeName(grpc::StatusCode code) {
  return std::string(absl::StatusCodeToString(static_cast<absl::StatusCode>(code)));
}

// What a request names, for the log.
struct Named {
  std::string cache;
  std::string seq;
  std::string snapshot;
  std::string node;
};

// Appends field `f` of `m` to `out` ("7", or "src_seq=7,dst_seq=8" when several fields name
// the same thing). Proto3 scalars have no presence: a zero is a value (seq 0); an empty string
// is left out.
void AddScalar(const google::protobuf::Message& m, const google::protobuf::FieldDescriptor* f,
               bool named, std::string* out) {
  using google::protobuf::FieldDescriptor;
  const google::protobuf::Reflection* r = m.GetReflection();
  if (f->is_repeated()) return;
  if (f->has_presence() && !r->HasField(m, f)) return;
  std::string value;
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT64:
      value = absl::StrCat(r->GetInt64(m, f));
      break;
    case FieldDescriptor::CPPTYPE_UINT64:
      value = absl::StrCat(r->GetUInt64(m, f));
      break;
    case FieldDescriptor::CPPTYPE_INT32:
      value = absl::StrCat(r->GetInt32(m, f));
      break;
    case FieldDescriptor::CPPTYPE_STRING:
      value = r->GetString(m, f);
      break;
    default:
      return;
  }
  if (value.empty()) return;
  // A request is logged before the node has checked it: never copy a huge field whole.
  if (value.size() > kMaxLoggedValue) value = absl::StrCat(value.substr(0, kMaxLoggedValue), "...");
  if (!out->empty()) out->push_back(',');
  if (named) absl::StrAppend(out, f->name(), "=");
  out->append(value);
}

// Top-level fields, and those of the messages that carry a request's names: an AppendStream's
// header, a CreateCache's spec, a PeerService Remove's remove, a Pull's sequence.
void Extract(const google::protobuf::Message& m, Named* named) {
  using google::protobuf::FieldDescriptor;
  const google::protobuf::Descriptor* d = m.GetDescriptor();
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    const std::string& name = f->name();
    if (name == "cache" || (name == "name" && d->name() == "CacheSpec")) {
      AddScalar(m, f, false, &named->cache);
    } else if (name == "seq") {
      AddScalar(m, f, false, &named->seq);
    } else if (name == "src_seq" || name == "dst_seq" || name == "target_seq") {
      AddScalar(m, f, true, &named->seq);
    } else if (name == "snapshot_id") {
      AddScalar(m, f, false, &named->snapshot);
    } else if (name == "target_node" || name == "source_node" || name == "receiver" ||
               name == "from_node" || name == "to_node") {
      AddScalar(m, f, false, &named->node);
    } else if ((name == "header" || name == "spec" || name == "remove" || name == "sequence") &&
               f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE && !f->is_repeated() &&
               m.GetReflection()->HasField(m, f)) {
      Extract(m.GetReflection()->GetMessage(m, f), named);
    }
  }
}

class RpcObserver final : public grpc::experimental::Interceptor {
 public:
  RpcObserver(grpc::experimental::ServerRpcInfo* info, Metrics* metrics) : info_(info) {
    const absl::string_view path = info->method();  // "/package.Service/Method"
    const size_t slash = path.rfind('/');
    absl::string_view service = slash == absl::string_view::npos || slash == 0
                                    ? absl::string_view()
                                    : path.substr(1, slash - 1);
    absl::string_view method = slash == absl::string_view::npos ? path : path.substr(slash + 1);
    if (!KnownService(service)) {
      service = "other";
      method = "other";
    } else if (google::protobuf::DescriptorPool::generated_pool()->FindMethodByName(
                   absl::StrCat(service, ".", method)) == nullptr) {
      // A method the service does not have (answered UNIMPLEMENTED): one label for all of them,
      // so that callers cannot grow the metrics with names of their own.
      method = "other";
    }
    form_ = FormOf(service, method);
    service_ = std::string(service);
    const size_t dot = service.rfind('.');
    short_service_ =
        std::string(dot == absl::string_view::npos ? service : service.substr(dot + 1));
    method_ = std::string(method);
    if (metrics != nullptr) {
      rpc_ = metrics->ForRpc(short_service_, method_);
      rpc_->Started();
    }
  }

  ~RpcObserver() override {
    // A call that ends without sending a status (cancelled before its handler finished).
    MutexLock lock(&mu_);
    // The call's context may be gone by now: its address is not asked for.
    if (!finished_) {
      Finish(grpc::StatusCode::CANCELLED, "the call ended without a status",
             /*context_alive=*/false);
    }
  }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    // A stream's read may complete on one thread while another sends its status (an idle
    // AppendStream that the node ends): one hook at a time.
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE)) {
      MutexLock lock(&mu_);
      if (!received_ && !finished_ && form_ != RequestForm::kNone &&
          LogEnabled(LogLevel::kWarning)) {
        received_ = true;
        if (const void* message = methods->GetRecvMessage(); message == nullptr) {
        } else if (form_ == RequestForm::kRawRead) {
          // A copy of the raw bytes (a ReadRequest is small); one that does not parse names
          // nothing, and the handler refuses it.
          v1::ReadRequest request;
          grpc::ByteBuffer raw(*static_cast<const grpc::ByteBuffer*>(message));
          if (grpc::SerializationTraits<v1::ReadRequest>::Deserialize(&raw, &request).ok()) {
            Extract(request, &named_);
          }
        } else if (form_ == RequestForm::kRawUnary) {
          // Only a request small enough to be worth naming in a log line; a larger one is
          // refused or served without the observer holding its bytes.
          const auto* raw = static_cast<const grpc::ByteBuffer*>(message);
          if (raw->Length() > kMaxObservedRequestBytes || !raw->Dump(&unary_slices_).ok()) {
            unary_slices_.clear();
          }
        } else if (form_ == RequestForm::kRawAppend) {
          // Parsed only when the call's line is logged (a success is logged at debug level only):
          // until then the observer holds references to the slices the handler holds anyway.
          if (!static_cast<const grpc::ByteBuffer*>(message)->Dump(&append_slices_).ok()) {
            append_slices_.clear();
          }
        } else {
          // The header only: the data is viewed, never copied.
          std::vector<grpc::Slice> slices;
          RawAppendStreamRequest request;
          if (static_cast<const grpc::ByteBuffer*>(message)->Dump(&slices).ok() &&
              ParseAppendStreamRequest(slices, &request).ok() && request.has_header) {
            Extract(request.header, &named_);
          }
        }
      }
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      MutexLock lock(&mu_);
      if (!finished_) {
        const grpc::Status status = methods->GetSendStatus();
        Finish(status.error_code(), status.error_message(), /*context_alive=*/true);
      }
    }
    methods->Proceed();
  }

 private:
  void Finish(grpc::StatusCode code, const std::string& message, bool context_alive)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    finished_ = true;
    if (!append_slices_.empty()) {
      // A raw Append's fields beside its payload, which is viewed, never copied.
      RawAppendRequest request;
      const LogLevel logged = code == grpc::StatusCode::OK ? LogLevel::kDebug : LogLevel::kWarning;
      if (LogEnabled(logged) && ParseAppendRequest(append_slices_, &request).ok()) {
        Extract(request.request, &named_);
      }
      append_slices_.clear();
    }
    if (!unary_slices_.empty()) {
      // Parsed for the log only when the node knows the caller: an unauthenticated request's
      // body is never parsed.
      const LogLevel logged = code == grpc::StatusCode::OK ? LogLevel::kDebug : LogLevel::kWarning;
      if (LogEnabled(logged) && code != grpc::StatusCode::UNAUTHENTICATED &&
          code != grpc::StatusCode::PERMISSION_DENIED) {
        ExtractUnary(&named_);
      }
      unary_slices_.clear();
    }
    const absl::Duration elapsed = absl::Now() - start_;
    const std::string code_name = GrpcCodeName(code);
    if (rpc_ != nullptr) rpc_->Finished(code_name, elapsed);
    const LogLevel level = code == grpc::StatusCode::OK ? LogLevel::kDebug : LogLevel::kWarning;
    if (!LogEnabled(level)) return;
    std::string client;
    if (context_alive && info_->server_context() != nullptr) {
      client = info_->server_context()->peer();
    }
    const std::string ms = absl::StrFormat("%.3f", absl::ToDoubleMilliseconds(elapsed));
    // Fields a request does not name are left out of the line (and a success has no error).
    const bool ok = code == grpc::StatusCode::OK;
    Log(level, ok ? "rpc" : "rpc failed",
        {{"service", short_service_},
         {"method", method_},
         {"code", code_name},
         {"ms", ms},
         {"cache", named_.cache},
         {"seq", named_.seq},
         {"snapshot", named_.snapshot},
         {"peer", named_.node},
         {"client", client},
         {"error", ok ? std::string() : message}});
  }

  // The names of a gated unary request (unary_slices_), parsed as the method's request type.
  void ExtractUnary(Named* named) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const google::protobuf::MethodDescriptor* method =
        google::protobuf::DescriptorPool::generated_pool()->FindMethodByName(
            absl::StrCat(service_, ".", method_));
    if (method == nullptr) return;
    const google::protobuf::Message* prototype =
        google::protobuf::MessageFactory::generated_factory()->GetPrototype(method->input_type());
    if (prototype == nullptr) return;
    std::unique_ptr<google::protobuf::Message> request(prototype->New());
    std::string wire;
    for (const grpc::Slice& slice : unary_slices_) {
      wire.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
    }
    if (request->ParseFromString(wire)) Extract(*request, named);
  }

  grpc::experimental::ServerRpcInfo* const info_;
  const absl::Time start_ = absl::Now();
  std::string service_;  // "kvmesh.v1.CacheService"
  std::string short_service_;
  std::string method_;
  RequestForm form_ = RequestForm::kNone;
  Metrics::Rpc* rpc_ = nullptr;
  Mutex mu_;
  bool received_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  Named named_ ABSL_GUARDED_BY(mu_);
  std::vector<grpc::Slice> append_slices_ ABSL_GUARDED_BY(mu_);  // a raw Append's request
  std::vector<grpc::Slice> unary_slices_ ABSL_GUARDED_BY(mu_);   // a gated unary request
};

}  // namespace

grpc::experimental::Interceptor* RpcObserverFactory::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  return new RpcObserver(info, metrics_);
}

std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
RpcObserverCreators(Metrics* metrics) {
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
  creators.push_back(std::make_unique<RpcObserverFactory>(metrics));
  return creators;
}

}  // namespace kvmesh

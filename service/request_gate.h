// RequestGate: serves a service's unary and server-streaming methods through gRPC's generic
// callback API, so that the node decides about a call before it has read, let alone parsed, the
// request.
//
// A typed (or raw) callback method has its request read whole by gRPC, and a typed one parsed,
// before the handler runs: a caller without a token could make the node hold and parse up to
// the server's message limit. Through the gate a call goes, in this order:
//   1. its method is looked up (UNIMPLEMENTED for one the gate does not serve);
//   2. it is authenticated from its metadata alone (the gate's Authenticate; its error ends the
//      call, and the node has read nothing of the body but what HTTP/2 flow control let in);
//   3. its request message is read, and refused with RESOURCE_EXHAUSTED when it is larger than
//      the method's own limit (max_request_bytes), before it is parsed;
//   4. a unary method's request is parsed (INVALID_ARGUMENT naming the field whose bytes are not
//      UTF-8, or the type the bytes do not parse as), and the handler runs; it answers with
//      UnaryCall::Answer. A raw method's handler, and a server stream's, get the bytes and
//      parse them with ParseRequest.
// The in-flight budget and validation are the handlers' own steps after that.
//
// Thread safety: Add before the server starts; the rest is gRPC's and thread-safe.
#ifndef KVMESH_SERVICE_REQUEST_GATE_H_
#define KVMESH_SERVICE_REQUEST_GATE_H_

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "cache/mutex.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/byte_buffer.h"
#include "transport/server_stream.h"

namespace kvmesh {

// One unary call let through the gate: its context, and the way to answer it.
class UnaryCall {
 public:
  virtual ~UnaryCall() = default;

  virtual grpc::CallbackServerContext* context() = 0;
  // Ends the call: with the handler's response when `status` is OK, with `status` alone
  // otherwise. Exactly once per call, from any thread; the request and response stay valid
  // until then.
  virtual void Answer(grpc::Status status) = 0;
  // Runs `on_cancel` once when the call is cancelled (the caller went away, or its deadline
  // passed) before it ends; at once, on this thread, when it already was. At most one per
  // call. A handler that waits for something else before it answers uses it to answer early.
  virtual void NotifyOnCancel(std::function<void()> on_cancel) = 0;
};

// A reactor that ends `call` with `status` at once (a stream refused before its first write).
StreamReactor* RefuseStream(StreamCall* call, grpc::Status status);

// The dotted path ("spec.groups.name") of the first string field, in `wire` parsed as
// `descriptor`, whose bytes are not UTF-8; empty when there is none (or the bytes are not a
// message of that type). Nested messages are followed up to a small depth.
std::string FirstNonUtf8Field(const google::protobuf::Descriptor* descriptor,
                              absl::string_view wire);

// Parses `raw`, the request of `method` ("/package.Service/Method"), into `out` once it is
// known to be at most `max_bytes` long: RESOURCE_EXHAUSTED naming the method's limit for a
// larger one (before any parsing), INVALID_ARGUMENT naming the field whose bytes are not UTF-8
// or the type the bytes do not parse as. The one way the node parses a request it has received
// whole.
grpc::Status ParseRequest(const grpc::ByteBuffer& raw, size_t max_bytes, absl::string_view method,
                          google::protobuf::Message* out);

// Gives the heap that large requests freed back to the system, on a thread of its own, once per
// burst of requests: glibc keeps the memory of a request gRPC received in many small slices (and
// of its parse) as free heap, mostly not at the top of an arena where M_TRIM_THRESHOLD would
// return it, so a refused 100 MiB Visible left the node 100 MiB larger for good. malloc_trim(0)
// returns every free page in malloc's free lists (milliseconds for a large heap); at most one a
// second, shared by the requests that come together. Not after an Append (raw methods): its
// payload went into cells and its buffers are what the next Append reuses.
class HeapTrimmer {
 public:
  HeapTrimmer();
  ~HeapTrimmer();
  HeapTrimmer(const HeapTrimmer&) = delete;
  HeapTrimmer& operator=(const HeapTrimmer&) = delete;

  // Asks for a trim about 100 ms from now, or a second after the last one (one for every
  // request until then).
  void Request();

 private:
  void Loop();

  Mutex mu_;
  std::condition_variable_any wake_;
  bool requested_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::chrono::steady_clock::time_point last_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

class RequestGate final : public grpc::CallbackGenericService {
 public:
  // Who may call: OK, or the error that ends the call (UNAUTHENTICATED, PERMISSION_DENIED, ...).
  using Authenticate = std::function<absl::Status(const grpc::CallbackServerContext&)>;

  explicit RequestGate(Authenticate authenticate) : authenticate_(std::move(authenticate)) {}

  RequestGate(const RequestGate&) = delete;
  RequestGate& operator=(const RequestGate&) = delete;

  // Calls of the methods of `service` ("package.Service") are authenticated by `authenticate`
  // instead of the gate's own: a server has one generic service, which serves every gated
  // service of the server (PeerService beside CacheService on a development node's one port).
  void AuthenticateService(std::string service, Authenticate authenticate) {
    service_authenticate_[std::move(service)] = std::move(authenticate);
  }

  // Serves `method` ("/package.Service/Method") with `handler`, which runs with the request
  // parsed and an empty response and answers through the UnaryCall.
  template <typename Request, typename Response>
  void Add(std::string method, size_t max_request_bytes,
           std::function<void(UnaryCall*, const Request*, Response*)> handler) {
    Method m;
    m.max_request_bytes = max_request_bytes;
    using Handler = std::function<void(UnaryCall*, const Request*, Response*)>;
    m.make = [handler = std::make_shared<const Handler>(std::move(handler))]() {
      return std::unique_ptr<Typed>(new TypedCall<Request, Response>(handler));
    };
    methods_[std::move(method)] = std::move(m);
  }

  // The same with a member function of `service` as the handler.
  template <typename Service, typename Request, typename Response>
  void Add(std::string method, size_t max_request_bytes, Service* service,
           void (Service::*handler)(UnaryCall*, const Request*, Response*)) {
    Add<Request, Response>(
        std::move(method), max_request_bytes,
        [service, handler](UnaryCall* call, const Request* request, Response* response) {
          (service->*handler)(call, request, response);
        });
  }

  // Serves `method` raw: the handler gets the request's bytes (read, within the limit, after the
  // caller is known) and writes the response's bytes itself.
  void AddRaw(std::string method, size_t max_request_bytes,
              std::function<void(UnaryCall*, const grpc::ByteBuffer*, grpc::ByteBuffer*)> handler);

  // Serves the server-streaming `method` with the reactor `start` returns for the call (never
  // null), given the request's bytes (read, within the limit, after the caller is known; valid
  // only while `start` runs). The reactor may Finish at once, in its constructor.
  using StartStream = std::function<StreamReactor*(StreamCall*, const grpc::ByteBuffer*)>;
  void AddServerStream(std::string method, size_t max_request_bytes, StartStream start);

  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* context) override;

 private:
  class Reactor;

  // A call's typed request and response, type-erased.
  class Typed {
   public:
    virtual ~Typed() = default;
    // The request message, to parse into.
    virtual google::protobuf::Message* request() = 0;
    virtual void Run(UnaryCall* call) = 0;
    virtual grpc::Status Serialize(grpc::ByteBuffer* response) = 0;
  };

  template <typename Request, typename Response>
  class TypedCall final : public Typed {
   public:
    using Handler = std::function<void(UnaryCall*, const Request*, Response*)>;
    explicit TypedCall(std::shared_ptr<const Handler> handler) : handler_(std::move(handler)) {}
    google::protobuf::Message* request() override { return &request_; }
    void Run(UnaryCall* call) override { (*handler_)(call, &request_, &response_); }
    grpc::Status Serialize(grpc::ByteBuffer* response) override {
      bool own_buffer;
      return grpc::SerializationTraits<Response>::Serialize(response_, response, &own_buffer);
    }

   private:
    const std::shared_ptr<const Handler> handler_;
    Request request_;
    Response response_;
  };

  struct Method {
    size_t max_request_bytes = 0;
    // Set for a typed unary method.
    std::function<std::unique_ptr<Typed>()> make;
    // Set for a raw unary method.
    std::function<void(UnaryCall*, const grpc::ByteBuffer*, grpc::ByteBuffer*)> raw;
    // Set for a server-streaming method.
    StartStream stream;
  };

  // Who may call `method` ("/package.Service/Method"): its service's, or the gate's.
  const Authenticate& AuthenticatorOf(const std::string& method) const;

  const Authenticate authenticate_;
  absl::flat_hash_map<std::string, Authenticate> service_authenticate_;
  absl::flat_hash_map<std::string, Method> methods_;
  HeapTrimmer trimmer_;
};

}  // namespace kvmesh

#endif  // KVMESH_SERVICE_REQUEST_GATE_H_

#include "service/request_gate.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/stubs/common.h"
#include "google/protobuf/wire_format_lite.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "service/common/convert.h"
#include "tests/sanitizers/tsan_handoff.h"

namespace kvmesh {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::internal::WireFormatLite;

// How deep FirstNonUtf8Field follows nested messages (kvmesh's requests nest two or three).
constexpr int kMaxUtf8Depth = 8;

// A call whose request was at least this large (a Visible at its limit parses into about 23 MiB)
// asks the gate's HeapTrimmer to give the heap it freed back to the system.
constexpr size_t kTrimAfterRequestBytes = size_t{128} << 10;

// protobuf's own check, the one that made the parse fail.
bool IsUtf8(absl::string_view s) {
  return google::protobuf::internal::IsStructurallyValidUTF8(s.data(), static_cast<int>(s.size()));
}

std::string FindNonUtf8(const Descriptor* descriptor, absl::string_view wire, int depth) {
  google::protobuf::io::CodedInputStream in(reinterpret_cast<const uint8_t*>(wire.data()),
                                            static_cast<int>(wire.size()));
  for (;;) {
    const uint32_t tag = in.ReadTag();
    if (tag == 0) return std::string();
    if (WireFormatLite::GetTagWireType(tag) != WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
      if (!WireFormatLite::SkipField(&in, tag)) return std::string();
      continue;
    }
    uint32_t length;
    if (!in.ReadVarint32(&length)) return std::string();
    const void* data;
    int size;
    if (!in.GetDirectBufferPointer(&data, &size) || static_cast<uint32_t>(size) < length) {
      return std::string();
    }
    const absl::string_view bytes(static_cast<const char*>(data), length);
    in.Skip(static_cast<int>(length));
    const FieldDescriptor* field =
        descriptor->FindFieldByNumber(static_cast<int>(WireFormatLite::GetTagFieldNumber(tag)));
    if (field == nullptr) continue;
    if (field->type() == FieldDescriptor::TYPE_STRING && !IsUtf8(bytes)) return field->name();
    if (field->type() == FieldDescriptor::TYPE_MESSAGE && depth < kMaxUtf8Depth) {
      const std::string inner = FindNonUtf8(field->message_type(), bytes, depth + 1);
      if (!inner.empty()) return absl::StrCat(field->name(), ".", inner);
    }
  }
}

}  // namespace

std::string FirstNonUtf8Field(const Descriptor* descriptor, absl::string_view wire) {
  return FindNonUtf8(descriptor, wire, 0);
}

namespace {

class RefusedStream final : public StreamReactor {
 public:
  RefusedStream(StreamCall* call, grpc::Status status) : StreamReactor(call) {
    Finish(std::move(status));
  }
  void OnDone() override { delete this; }
};

}  // namespace

StreamReactor* RefuseStream(StreamCall* call, grpc::Status status) {
  return new RefusedStream(call, std::move(status));
}

namespace {

// RESOURCE_EXHAUSTED for a request of `bytes` to `method`, whose limit is `max_bytes`.
grpc::Status TooLarge(absl::string_view method, size_t bytes, size_t max_bytes) {
  return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                      absl::StrCat(method, ": the request of ", bytes,
                                   " bytes is larger than this method's limit of ", max_bytes,
                                   " bytes (docs/api.md, \"Limits on every request\")"));
}

}  // namespace

grpc::Status ParseRequest(const grpc::ByteBuffer& raw, size_t max_bytes, absl::string_view method,
                          google::protobuf::Message* out) {
  const size_t bytes = raw.Length();
  if (bytes > max_bytes) return TooLarge(method, bytes, max_bytes);
  grpc::ByteBuffer copy(raw);  // shares the slices; the reader consumes its buffer
  {
    grpc::ProtoBufferReader reader(&copy);
    if (reader.status().ok() && out->ParseFromZeroCopyStream(&reader)) return grpc::Status::OK;
  }
  // Why not: a string that is not UTF-8 is named; anything else names the type.
  std::string wire;
  std::vector<grpc::Slice> slices;
  if (raw.Dump(&slices).ok()) {
    for (const grpc::Slice& s : slices) {
      wire.append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
  }
  const std::string field = FirstNonUtf8Field(out->GetDescriptor(), wire);
  out->Clear();
  return grpc::Status(
      grpc::StatusCode::INVALID_ARGUMENT,
      field.empty() ? absl::StrCat(method, ": the request of ", bytes, " bytes does not parse as ",
                                   out->GetDescriptor()->full_name())
                    : absl::StrCat(method, ": ", field, " is not valid UTF-8 (a string field)"));
}

// The reactor of one call through the gate: looks the method up and authenticates in its
// constructor, reads the request and checks its size. A unary call's request is parsed and
// handed to the handler, and the answer written; a server stream's bytes go to the reactor its
// method starts, which writes through this one and gets its reactions. Deletes itself in OnDone.
class RequestGate::Reactor final : public grpc::ServerGenericBidiReactor,
                                   public UnaryCall,
                                   public StreamCall {
 public:
  Reactor(RequestGate* gate, grpc::GenericCallbackServerContext* context)
      : gate_(gate), context_(context) {
    auto it = gate->methods_.find(context->method());
    if (it == gate->methods_.end()) {
      HandOff(this);
      Finish(grpc::Status(
          grpc::StatusCode::UNIMPLEMENTED,
          absl::StrCat("method ", QuoteBounded(context->method()), " is not served here")));
      return;
    }
    method_ = &it->second;
    if (const absl::Status status = gate->AuthenticatorOf(context->method())(*context);
        !status.ok()) {
      HandOff(this);
      Finish(ToGrpcStatus(status));
      return;
    }
    HandOff(this);
    StartRead(&request_);
  }

  grpc::CallbackServerContext* context() override { return context_; }

  void Answer(grpc::Status status) override {
    if (status.ok() && typed_ != nullptr) status = typed_->Serialize(&response_);
    if (!status.ok()) {
      HandOff(this);
      Finish(status);
      return;
    }
    HandOff(this);
    StartWriteAndFinish(&response_, grpc::WriteOptions(), grpc::Status::OK);
  }

  void OnReadDone(bool ok) override {
    TakeOver(this);
    const std::string& name = context_->method();
    if (!ok) {
      HandOff(this);
      Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat(name, ": the call ended before its request message")));
      return;
    }
    request_bytes_ = request_.Length();
    if (method_->stream) {
      if (const size_t bytes = request_.Length(); bytes > method_->max_request_bytes) {
        request_.Clear();
        HandOff(this);
        Finish(TooLarge(name, bytes, method_->max_request_bytes));
        return;
      }
      StreamReactor* const stream = method_->stream(this, &request_);
      request_.Clear();
      bool cancelled;
      {
        MutexLock lock(&mu_);
        started_ = true;
        cancelled = cancelled_;
      }
      // A cancel that came before the reactor existed is its first reaction (OnCancel passes on
      // the ones after).
      if (cancelled) stream->OnCancel();
      return;
    }
    if (method_->raw) {
      if (const size_t bytes = request_.Length(); bytes > method_->max_request_bytes) {
        request_.Clear();
        HandOff(this);
        Finish(TooLarge(name, bytes, method_->max_request_bytes));
        return;
      }
      method_->raw(this, &request_, &response_);
      return;
    }
    typed_ = method_->make();
    if (const grpc::Status parsed =
            ParseRequest(request_, method_->max_request_bytes, name, typed_->request());
        !parsed.ok()) {
      typed_.reset();
      request_.Clear();
      HandOff(this);
      Finish(parsed);
      return;
    }
    request_.Clear();
    typed_->Run(this);
  }

  void Write(const grpc::ByteBuffer* message) override {
    HandOff(this);
    StartWrite(message);
  }

  void End(grpc::Status status) override {
    HandOff(this);
    Finish(std::move(status));
  }

  void OnWriteDone(bool ok) override {
    TakeOver(this);
    started()->OnWriteDone(ok);  // only a stream's reactor writes without finishing
    HandOff(this);  // to OnDone, which gRPC runs after this reaction has returned
  }

  void NotifyOnCancel(std::function<void()> on_cancel) override {
    {
      MutexLock lock(&mu_);
      if (!cancelled_) {
        on_cancel_ = std::move(on_cancel);
        return;
      }
    }
    on_cancel();
  }

  void OnCancel() override {
    TakeOver(this);
    StreamReactor* stream;
    std::function<void()> on_cancel;
    {
      MutexLock lock(&mu_);
      cancelled_ = true;
      stream = started_ ? stream_ : nullptr;
      on_cancel = std::move(on_cancel_);
    }
    if (stream != nullptr) stream->OnCancel();
    if (on_cancel) on_cancel();
    // To OnDone, which gRPC runs after this reaction has returned, and which deletes the
    // stream's reactor whose OnCancel ran here.
    HandOff(this);
  }

  void OnDone() override {
    TakeOver(this);
    // Every other reaction has returned (gRPC's promise), the stream's reactor's included.
    if (StreamReactor* const stream = started(); stream != nullptr) stream->OnDone();
    // An Append's payload went into cells, and its buffers are what the next Append reuses:
    // only requests the node parsed (or refused) leave memory worth returning.
    if (request_bytes_ >= kTrimAfterRequestBytes && (method_ == nullptr || !method_->raw)) {
      gate_->trimmer_.Request();
    }
    delete this;
  }

 private:
  void Attach(StreamReactor* reactor) override {
    MutexLock lock(&mu_);
    stream_ = reactor;
  }

  // The stream's reactor; null for a unary call.
  StreamReactor* started() {
    MutexLock lock(&mu_);
    return stream_;
  }

  RequestGate* const gate_;
  grpc::GenericCallbackServerContext* const context_;
  const Method* method_ = nullptr;
  size_t request_bytes_ = 0;
  grpc::ByteBuffer request_;
  grpc::ByteBuffer response_;
  std::unique_ptr<Typed> typed_;
  // A server stream's reactor: attached as it is constructed (it may write at once, from
  // another thread), started once its constructor has returned (OnCancel passes on to it only
  // then: a cancel before that is passed on by OnReadDone).
  Mutex mu_;
  StreamReactor* stream_ ABSL_GUARDED_BY(mu_) = nullptr;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  std::function<void()> on_cancel_ ABSL_GUARDED_BY(mu_);  // a unary handler's (NotifyOnCancel)
};

HeapTrimmer::HeapTrimmer() : thread_([this] { Loop(); }) {}

HeapTrimmer::~HeapTrimmer() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void HeapTrimmer::Request() {
  MutexLock lock(&mu_);
  if (requested_) return;  // the trim already due takes this one's memory too
  requested_ = true;
  wake_.notify_all();
}

void HeapTrimmer::Loop() {
  MutexLock lock(&mu_);
  for (;;) {
    while (!requested_ && !stop_) wake_.wait(mu_);
    if (stop_) return;
    // Let gRPC drop what the call still held (its state goes after OnDone), and let requests
    // that come together share one trim: at most one a second.
    const auto due = std::max(std::chrono::steady_clock::now() + std::chrono::milliseconds(100),
                              last_ + std::chrono::seconds(1));
    while (!stop_ && std::chrono::steady_clock::now() < due) wake_.wait_until(mu_, due);
    if (stop_) return;
    requested_ = false;
    mu_.Unlock();
#if defined(__GLIBC__)
    malloc_trim(0);
#endif
    mu_.Lock();
    last_ = std::chrono::steady_clock::now();
  }
}

void RequestGate::AddRaw(
    std::string method, size_t max_request_bytes,
    std::function<void(UnaryCall*, const grpc::ByteBuffer*, grpc::ByteBuffer*)> handler) {
  Method m;
  m.max_request_bytes = max_request_bytes;
  m.raw = std::move(handler);
  methods_[std::move(method)] = std::move(m);
}

void RequestGate::AddServerStream(std::string method, size_t max_request_bytes, StartStream start) {
  Method m;
  m.max_request_bytes = max_request_bytes;
  m.stream = std::move(start);
  methods_[std::move(method)] = std::move(m);
}

const RequestGate::Authenticate& RequestGate::AuthenticatorOf(const std::string& method) const {
  if (service_authenticate_.empty()) return authenticate_;
  // "/package.Service/Method": the service is between the first and the last '/'.
  const size_t end = method.rfind('/');
  if (end == std::string::npos || end == 0) return authenticate_;
  auto it = service_authenticate_.find(absl::string_view(method).substr(1, end - 1));
  return it == service_authenticate_.end() ? authenticate_ : it->second;
}

grpc::ServerGenericBidiReactor* RequestGate::CreateReactor(
    grpc::GenericCallbackServerContext* context) {
  return new Reactor(this, context);
}

}  // namespace kvmesh

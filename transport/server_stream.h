// StreamCall and StreamReactor: a server-streaming call of bytes that a reactor writes to,
// whichever way the call came in. The node serves its server streams through its RequestGate
// (service/request_gate.h), which reads the request only once the caller is known; the gate
// implements StreamCall, and a reactor written against StreamReactor (the grpc-stream sender's
// Fetch, the event streams) serves such a call as it would serve a grpc::ServerWriteReactor.
// Here, below the service, so that transport/ can serve its stream through the gate without
// depending on the node.
//
// Thread safety: as grpc::ServerWriteReactor's.
#ifndef KVMESH_TRANSPORT_SERVER_STREAM_H_
#define KVMESH_TRANSPORT_SERVER_STREAM_H_

#include <utility>

#include "grpcpp/server_context.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/status.h"

namespace kvmesh {

class StreamReactor;

// One server-streaming call let through the gate, as its StreamReactor writes to it.
class StreamCall {
 public:
  virtual ~StreamCall() = default;

  virtual grpc::CallbackServerContext* context() = 0;
  // As grpc::ServerWriteReactor's StartWrite: one write at a time; `message` stays valid until
  // the reactor's OnWriteDone.
  virtual void Write(const grpc::ByteBuffer* message) = 0;
  // As grpc::ServerWriteReactor's Finish: once per call, from any thread.
  virtual void End(grpc::Status status) = 0;

 private:
  friend class StreamReactor;
  // The reactor that writes to this call, from its constructor on (before it can write).
  virtual void Attach(StreamReactor* reactor) = 0;
};

// What serves a server-streaming method through the gate: a grpc::ServerWriteReactor of bytes
// in all but its base, so a reactor written for one serves as the other. The gate passes on
// each reaction of the call; OnCancel also when the call was cancelled before the reactor
// existed. OnDone is the last, and the reactor may delete itself there.
class StreamReactor {
 public:
  explicit StreamReactor(StreamCall* call) : call_(call) { call->Attach(this); }
  virtual ~StreamReactor() = default;
  StreamReactor(const StreamReactor&) = delete;
  StreamReactor& operator=(const StreamReactor&) = delete;

  virtual void OnWriteDone(bool /*ok*/) {}
  virtual void OnCancel() {}
  virtual void OnDone() = 0;

 protected:
  void StartWrite(const grpc::ByteBuffer* message) { call_->Write(message); }
  void Finish(grpc::Status status) { call_->End(std::move(status)); }

 private:
  StreamCall* const call_;
};

}  // namespace kvmesh

#endif  // KVMESH_TRANSPORT_SERVER_STREAM_H_

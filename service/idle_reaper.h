// IdleReaper: ends client streams that have sent nothing for too long while the node waits for
// their next message (--stream-idle-timeout-ms), so that a stream a client opened and forgot
// does not hold its buffer and its in-flight reservation forever.
//
// One thread per reaper wakes every timeout/4 (at most once a second, at least every 10 ms)
// and asks each registered stream whether it is idle; a stream is thus ended between `timeout`
// and `timeout` plus one tick after its last message. A thread rather than a gRPC alarm per
// stream: one timer for all streams, and no alarm to re-arm from its own callback.
//
// Thread safety: thread-safe. A Stream must be removed (Remove) before it is destroyed, and
// every stream must be removed before the reaper is destroyed.
#ifndef KVMESH_SERVICE_IDLE_REAPER_H_
#define KVMESH_SERVICE_IDLE_REAPER_H_

#include <condition_variable>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/time/time.h"
#include "cache/mutex.h"

namespace kvmesh {

class IdleReaper {
 public:
  class Stream {
   public:
    virtual ~Stream() = default;
    // Called under the reaper's lock: returns true when the stream has waited for a message
    // since `now - timeout` or earlier and commits to being ended: from then on nothing but
    // EndIdle may end it, so it stays alive until EndIdle has run. Must not block.
    virtual bool ExpireIfIdle(absl::Time now, absl::Duration timeout) = 0;
    // Called once, outside the reaper's lock, after ExpireIfIdle returned true: frees the
    // stream's buffers and finishes the call.
    virtual void EndIdle(absl::Duration timeout) = 0;
  };

  // absl::InfiniteDuration() (or a non-positive timeout): streams are never ended, and no
  // thread is started.
  explicit IdleReaper(absl::Duration timeout);
  ~IdleReaper();

  IdleReaper(const IdleReaper&) = delete;
  IdleReaper& operator=(const IdleReaper&) = delete;

  absl::Duration timeout() const { return timeout_; }

  void Add(Stream* stream);
  void Remove(Stream* stream);

 private:
  void Loop();

  const absl::Duration timeout_;
  Mutex mu_;
  std::condition_variable_any wake_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_set<Stream*> streams_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace kvmesh

#endif  // KVMESH_SERVICE_IDLE_REAPER_H_

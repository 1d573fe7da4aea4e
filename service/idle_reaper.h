// IdleReaper: ends client streams that must not go on holding what they hold: those that have
// sent nothing for too long while the node waits for their next message
// (--stream-idle-timeout-ms), so that a stream a client opened and forgot does not hold its
// buffer and its in-flight reservation forever, and those a stream's own checks end (a caller
// whose token was revoked, a stream slower than the node's minimum rate).
//
// One thread per reaper wakes every timeout/4 (at most once a second, at least every 10 ms;
// once a second without a timeout) and asks each registered stream whether it must end; an
// idle stream is thus ended between `timeout` and `timeout` plus one tick after its last
// message. A thread rather than a gRPC alarm per stream: one timer for all streams, and no
// alarm to re-arm from its own callback.
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
    // Called under the reaper's lock at every tick: returns true when the stream must end now
    // (it has waited for a message since `now - timeout` or earlier, or one of its own checks
    // fails) and commits to being ended: from then on nothing but EndExpired may end it, so it
    // stays alive until EndExpired has run. Must not block.
    virtual bool Expire(absl::Time now, absl::Duration timeout) = 0;
    // Called once, outside the reaper's lock, after Expire returned true: frees the stream's
    // buffers and finishes the call.
    virtual void EndExpired(absl::Duration timeout) = 0;
  };

  // absl::InfiniteDuration() (or a non-positive timeout): streams are never ended for being
  // idle (their own checks still run, once a second).
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

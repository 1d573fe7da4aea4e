// Mutex: the lock type of the whole tree, a reader/writer lock with Abseil's thread-safety
// annotations (so clang's -Wthread-safety checks ABSL_GUARDED_BY members).
//
// Why not absl::Mutex: Debian's Abseil is built without ThreadSanitizer, so TSan cannot see
// absl::Mutex's synchronization and reports races on every guarded member. std::shared_mutex
// sits on pthread_rwlock, which TSan intercepts, so the TSan build checks kvmesh's locking for
// real. It also satisfies BasicLockable (lock/unlock) for std::condition_variable_any.
//
// Thread safety: it is the synchronization primitive.
#ifndef KVMESH_CACHE_MUTEX_H_
#define KVMESH_CACHE_MUTEX_H_

#include <shared_mutex>

#include "absl/base/thread_annotations.h"

namespace kvmesh {

class ABSL_LOCKABLE Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }
  void ReaderLock() ABSL_SHARED_LOCK_FUNCTION() { mu_.lock_shared(); }
  void ReaderUnlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock_shared(); }

  // BasicLockable spelling, for std::condition_variable_any.
  void lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }

 private:
  std::shared_mutex mu_;
};

class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

class ABSL_SCOPED_LOCKABLE ReaderMutexLock {
 public:
  explicit ReaderMutexLock(Mutex* mu) ABSL_SHARED_LOCK_FUNCTION(mu) : mu_(mu) { mu_->ReaderLock(); }
  ~ReaderMutexLock() ABSL_UNLOCK_FUNCTION() { mu_->ReaderUnlock(); }
  ReaderMutexLock(const ReaderMutexLock&) = delete;
  ReaderMutexLock& operator=(const ReaderMutexLock&) = delete;

 private:
  Mutex* const mu_;
};

}  // namespace kvmesh

#endif  // KVMESH_CACHE_MUTEX_H_

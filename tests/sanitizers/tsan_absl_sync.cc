// Makes absl::Mutex and absl::CondVar visible to ThreadSanitizer. Compiled only into TSan builds
// (KVMESH_SANITIZE=thread).
//
// Debian's Abseil is not built with TSan, so TSan cannot see the happens-before edges that
// absl::Mutex creates (its fast path is an atomic in uninstrumented code and its slow path a
// futex). gRPC 1.51 synchronizes with absl::Mutex, so without this file every object that gRPC
// hands from one thread to another (reactors, messages, byte buffers) looks like a data race.
//
// The executable defines the public locking entry points of absl::Mutex and absl::CondVar;
// the dynamic linker binds every caller, the shared libraries included, to these definitions,
// which call the real ones (found with dlsym(RTLD_NEXT)) and tell TSan that an unlock
// happens-before the next lock of the same mutex (__tsan_release / __tsan_acquire on the mutex's
// address). Readers are ordered with writers and, conservatively, with each other; TSan still
// checks kvmesh's own locks (kvmesh::Mutex sits on pthread, which TSan intercepts) fully.
//
// Thread safety: as absl::Mutex. The resolved function pointers are set once, racily but to the
// same value by every thread, through relaxed atomics.
#include <dlfcn.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

extern "C" {
void __tsan_acquire(void* addr);
void __tsan_release(void* addr);
}

namespace {

// The mangled names below spell Abseil's inline namespace of Debian 12 ("debian3").
#define KVMESH_STRINGIFY_INNER(x) #x
#define KVMESH_STRINGIFY(x) KVMESH_STRINGIFY_INNER(x)
constexpr bool SameString(const char* a, const char* b) {
  return *a == *b && (*a == '\0' || SameString(a + 1, b + 1));
}
static_assert(SameString(KVMESH_STRINGIFY(ABSL_OPTION_INLINE_NAMESPACE_NAME), "debian3"),
              "Abseil's inline namespace changed: update the mangled names in this file");

template <typename Fn>
Fn Real(std::atomic<void*>* slot, const char* mangled) {
  void* fn = slot->load(std::memory_order_relaxed);
  if (fn == nullptr) {
    fn = dlsym(RTLD_NEXT, mangled);
    if (fn == nullptr) {
      std::fprintf(stderr, "tsan_absl_sync: %s not found: %s\n", mangled, dlerror());
      std::abort();
    }
    slot->store(fn, std::memory_order_relaxed);
  }
  return reinterpret_cast<Fn>(fn);
}

#define KVMESH_REAL(type, mangled)           \
  ([]() -> type {                            \
    static std::atomic<void*> slot{nullptr}; \
    return Real<type>(&slot, mangled);       \
  }())

// absl::Mutex's deadlock detection keeps a global graph under a lock TSan cannot see either;
// TSan has its own lock-order checks, so the TSan build turns Abseil's off.
[[maybe_unused]] const bool kDeadlockDetectionOff =
    (absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore), true);

using absl::Condition;
using absl::CondVar;
using absl::Duration;
using absl::Mutex;
using absl::Time;

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

// ---- acquire ------------------------------------------------------------------------------

void Mutex::Lock() {
  KVMESH_REAL(void (*)(Mutex*), "_ZN4absl7debian35Mutex4LockEv")(this);
  __tsan_acquire(this);
}

void Mutex::ReaderLock() {
  KVMESH_REAL(void (*)(Mutex*), "_ZN4absl7debian35Mutex10ReaderLockEv")(this);
  __tsan_acquire(this);
}

bool Mutex::TryLock() {
  const bool locked = KVMESH_REAL(bool (*)(Mutex*), "_ZN4absl7debian35Mutex7TryLockEv")(this);
  if (locked) __tsan_acquire(this);
  return locked;
}

bool Mutex::ReaderTryLock() {
  const bool locked =
      KVMESH_REAL(bool (*)(Mutex*), "_ZN4absl7debian35Mutex13ReaderTryLockEv")(this);
  if (locked) __tsan_acquire(this);
  return locked;
}

void Mutex::LockWhen(const Condition& cond) {
  KVMESH_REAL(void (*)(Mutex*, const Condition&),
              "_ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE")
  (this, cond);
  __tsan_acquire(this);
}

void Mutex::ReaderLockWhen(const Condition& cond) {
  KVMESH_REAL(void (*)(Mutex*, const Condition&),
              "_ZN4absl7debian35Mutex14ReaderLockWhenERKNS0_9ConditionE")
  (this, cond);
  __tsan_acquire(this);
}

bool Mutex::LockWhenWithTimeout(const Condition& cond, Duration timeout) {
  const bool r = KVMESH_REAL(bool (*)(Mutex*, const Condition&, Duration),
                             "_ZN4absl7debian35Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_"
                             "8DurationE")(this, cond, timeout);
  __tsan_acquire(this);
  return r;
}

bool Mutex::LockWhenWithDeadline(const Condition& cond, Time deadline) {
  const bool r = KVMESH_REAL(bool (*)(Mutex*, const Condition&, Time),
                             "_ZN4absl7debian35Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_"
                             "4TimeE")(this, cond, deadline);
  __tsan_acquire(this);
  return r;
}

bool Mutex::ReaderLockWhenWithTimeout(const Condition& cond, Duration timeout) {
  const bool r = KVMESH_REAL(bool (*)(Mutex*, const Condition&, Duration),
                             "_ZN4absl7debian35Mutex25ReaderLockWhenWithTimeoutERKNS0_"
                             "9ConditionENS0_8DurationE")(this, cond, timeout);
  __tsan_acquire(this);
  return r;
}

bool Mutex::ReaderLockWhenWithDeadline(const Condition& cond, Time deadline) {
  const bool r = KVMESH_REAL(bool (*)(Mutex*, const Condition&, Time),
                             "_ZN4absl7debian35Mutex26ReaderLockWhenWithDeadlineERKNS0_"
                             "9ConditionENS0_4TimeE")(this, cond, deadline);
  __tsan_acquire(this);
  return r;
}

// ---- release ------------------------------------------------------------------------------

void Mutex::Unlock() {
  __tsan_release(this);
  KVMESH_REAL(void (*)(Mutex*), "_ZN4absl7debian35Mutex6UnlockEv")(this);
}

void Mutex::ReaderUnlock() {
  __tsan_release(this);
  KVMESH_REAL(void (*)(Mutex*), "_ZN4absl7debian35Mutex12ReaderUnlockEv")(this);
}

// ---- release, wait, acquire ---------------------------------------------------------------

void Mutex::Await(const Condition& cond) {
  __tsan_release(this);
  KVMESH_REAL(void (*)(Mutex*, const Condition&), "_ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE")
  (this, cond);
  __tsan_acquire(this);
}

bool Mutex::AwaitWithTimeout(const Condition& cond, Duration timeout) {
  __tsan_release(this);
  const bool r = KVMESH_REAL(bool (*)(Mutex*, const Condition&, Duration),
                             "_ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_"
                             "8DurationE")(this, cond, timeout);
  __tsan_acquire(this);
  return r;
}

bool Mutex::AwaitWithDeadline(const Condition& cond, Time deadline) {
  __tsan_release(this);
  const bool r = KVMESH_REAL(bool (*)(Mutex*, const Condition&, Time),
                             "_ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_"
                             "4TimeE")(this, cond, deadline);
  __tsan_acquire(this);
  return r;
}

void CondVar::Wait(Mutex* mu) {
  __tsan_release(mu);
  KVMESH_REAL(void (*)(CondVar*, Mutex*), "_ZN4absl7debian37CondVar4WaitEPNS0_5MutexE")(this, mu);
  __tsan_acquire(mu);
}

bool CondVar::WaitWithTimeout(Mutex* mu, Duration timeout) {
  __tsan_release(mu);
  const bool r = KVMESH_REAL(bool (*)(CondVar*, Mutex*, Duration),
                             "_ZN4absl7debian37CondVar15WaitWithTimeoutEPNS0_5MutexENS0_"
                             "8DurationE")(this, mu, timeout);
  __tsan_acquire(mu);
  return r;
}

bool CondVar::WaitWithDeadline(Mutex* mu, Time deadline) {
  __tsan_release(mu);
  const bool r = KVMESH_REAL(bool (*)(CondVar*, Mutex*, Time),
                             "_ZN4absl7debian37CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE")(
      this, mu, deadline);
  __tsan_acquire(mu);
  return r;
}

ABSL_NAMESPACE_END
}  // namespace absl

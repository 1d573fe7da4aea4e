// gRPC hands a reactor from the thread that starts an operation to the thread that runs its
// reaction through its own (uninstrumented) internals, which ThreadSanitizer cannot see. HandOff
// and TakeOver state that edge on the reactor's address in TSan builds and are no-ops otherwise.
// Header-only and free of gRPC, so that any reactor code (service/, transport/) can use it.
// It lives with the other sanitizer support (tests/sanitizers/CMakeLists.txt): the reactor code
// includes it, and outside TSan builds both functions are empty inline functions.
#ifndef KVMESH_TESTS_SANITIZERS_TSAN_HANDOFF_H_
#define KVMESH_TESTS_SANITIZERS_TSAN_HANDOFF_H_

#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVMESH_TSAN_BUILD 1
#endif
#endif
#if defined(__SANITIZE_THREAD__) && !defined(KVMESH_TSAN_BUILD)
#define KVMESH_TSAN_BUILD 1
#endif

#ifdef KVMESH_TSAN_BUILD
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#endif

namespace kvmesh {

// Called by the thread that hands `reactor` over (before starting the gRPC operation).
inline void HandOff(void* reactor) {
#ifdef KVMESH_TSAN_BUILD
  __tsan_release(reactor);
#else
  (void)reactor;
#endif
}

// Called first thing in the reaction that takes `reactor` over.
inline void TakeOver(void* reactor) {
#ifdef KVMESH_TSAN_BUILD
  __tsan_acquire(reactor);
#else
  (void)reactor;
#endif
}

}  // namespace kvmesh

#endif  // KVMESH_TESTS_SANITIZERS_TSAN_HANDOFF_H_

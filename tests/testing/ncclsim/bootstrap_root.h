// The bootstrap root of the simulator: the process that calls ncclGetUniqueId serves the ids it
// makes, as NCCL's root does, so that the ranks of a communicator (in this process or others)
// find each other (wire.h describes the exchange).
//
// Why one root per process, not one per id: a thread per id would stay forever for an id that
// no rank ever uses (an init that timed out on the other node). One thread serves every id of
// the process; an id is forgotten once all its ranks have joined, so a stale or replayed id is
// refused rather than joined to a communicator that is already complete.
//
// Lifetime: started by the first Get() of a process (a child forked without exec starts its
// own) and never stopped: the listening socket and its thread live until the process exits.
//
// Thread safety: thread-safe.
#ifndef KVMESH_TESTS_TESTING_NCCLSIM_BOOTSTRAP_ROOT_H_
#define KVMESH_TESTS_TESTING_NCCLSIM_BOOTSTRAP_ROOT_H_

#include <nccl.h>
#include <sys/types.h>
#include <unistd.h>

#include <cstdint>
#include <set>
#include <string>

#include "absl/base/thread_annotations.h"
#include "cache/mutex.h"
#include "tests/testing/ncclsim/socket.h"
#include "tests/testing/ncclsim/wire.h"

namespace ncclsim {

class BootstrapRoot {
 public:
  // This process's root, started on first use; null (with *error) when it cannot listen or
  // start its thread (the next call tries again).
  static BootstrapRoot* Get(std::string* error);

  BootstrapRoot(const BootstrapRoot&) = delete;
  BootstrapRoot& operator=(const BootstrapRoot&) = delete;

  // A fresh id naming this root and a random nonce. False (with *error) when no random bytes
  // could be had.
  bool NewId(ncclUniqueId* id, std::string* error);

 private:
  BootstrapRoot(Fd listener, uint16_t port) : listener_(std::move(listener)), port_(port) {}

  // The thread: accepts ranks, collects each id's ranks, answers them when all have come.
  void Serve();
  // Whether this root made `nonce` and still waits for its ranks; Forget drops it.
  bool Issued(const Nonce& nonce);
  void Forget(const Nonce& nonce);

  const Fd listener_;
  const uint16_t port_;
  const pid_t pid_ = getpid();

  kvmesh::Mutex mu_;
  std::set<Nonce> issued_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ncclsim

#endif  // KVMESH_TESTS_TESTING_NCCLSIM_BOOTSTRAP_ROOT_H_

// ncclsim: a simulated NCCL for CPU-only machines, built as a shared library (libnccl_sim.so)
// that kvmesh's run-time loader (transport/nccl_api.h) opens in place of libnccl.so.2 when
// $KVMESH_NCCL_LIBRARY names it. Test tree only: no production binary links it or loads it on
// its own. It runs on cudasim (tests/testing/cudasim/cuda_sim.h), the CPU CUDA runtime of the
// -DKVMESH_CUDA=SIM build, and refuses to initialize a communicator anywhere else.
//
// Why: the nccl transport (transport/nccl_comm.h, nccl_transport.h) can then run between two
// real processes on CI machines without a GPU, with the failures a GPU cluster shows (a peer
// that dies or freezes, a size mismatch, an NCCL error) available on demand.
//
// What it implements: the functions of NcclApi (transport/nccl_api.h), with nccl.h's C
// signatures and NCCL 2.28's semantics as far as kvmesh relies on them:
// - ncclGetVersion reports nccl.h's NCCL_VERSION_CODE, so the loader's major-version check holds.
// - ncclGetUniqueId starts this process's bootstrap root (once; a thread that serves every id the
//   process makes, for its lifetime) and writes its loopback port and a random 128-bit nonce
//   into the id. Ranks register with the root, learn each other's ports and connect pairwise
//   over 127.0.0.1 TCP; a root forgets an id once all its ranks have joined.
// - ncclCommInitRankConfig with config->blocking = 0 returns ncclInProgress at once and the
//   bootstrap runs on the communicator's own thread; ncclCommGetAsyncError turns ncclSuccess
//   when every rank has connected. Blocking communicators (the default) wait in the call.
// - ncclSend / ncclRecv (any ncclDataType_t: bytes = count x the type's size) inside
//   ncclGroupStart / ncclGroupEnd (a depth per thread; outside a group a call is a group of
//   one). At ncclGroupEnd each communicator's operations become one cudasim::AsyncOp per
//   stream, so the sends and receives of a group progress together, as NCCL's fused kernel
//   does. A non-blocking communicator's ncclGroupEnd returns ncclInProgress and its state turns
//   ncclSuccess once the communicator's thread has queued the operations for their peers.
//   Operations move bytes only once their stream has reached them (cudasim runs stream work
//   when someone waits), directly between device memory and the socket. A send completes when
//   its bytes have left the buffer (written to the socket), a receive when they are in it.
//   Matching is per (communicator, peer) in posting order; a receive whose size differs from
//   the matching send's is an async ncclInvalidUsage. A send to and a receive from the own rank
//   are a memcpy, and must pair up, in order and with equal sizes, on one stream within one
//   group (ncclInvalidUsage from ncclGroupEnd otherwise: an unmatched one would hang a GPU).
// - A peer whose connection closes (its process died, or it aborted) makes the async error
//   ncclRemoteError, and so does a peer that finalized while a receive from it is pending (a
//   send that no receive matched before ncclCommFinalize is ncclInvalidUsage); a peer that stops
//   (SIGSTOP) just stops the operations, until the caller's deadline aborts the communicator.
// - ncclCommFinalize (non-blocking for a non-blocking communicator) waits until every
//   operation posted on the communicator has completed, then exchanges a finalize message with
//   every peer; the state is ncclSuccess once all peers have finalized too. ncclCommDestroy
//   frees what is left (finalizing first, blocking, when that was not done; a communicator in
//   error is released like an aborted one).
// - ncclCommAbort completes every pending operation as a no-op (so that the streams drain),
//   stops the communicator's thread and closes its connections; an operation whose stream
//   reaches it later completes without touching memory.
// - Errors are reported as NCCL does: a function's result, the async error of the
//   communicator, and ncclGetLastError's text (process-wide: the last failure any thread saw).
//
// Not simulated (kvmesh does not use them): collectives, more than one communicator per call
// of ncclCommInitRankConfig (ncclCommInitAll, init inside a group), split and shrink, buffer
// registration, and the GPU's concurrency between streams beyond what cudasim gives. In the
// simulator, as on a GPU, finalizing waits for posted operations, and those run only when
// their stream is driven (synchronize the stream, or poll an event after them) first.
//
// Fault injection (environment, read at the first call; a malformed value makes
// ncclGetUniqueId and ncclCommInitRankConfig fail with ncclInvalidUsage naming the problem):
//
//   KVMESH_NCCLSIM_HANG=KIND:N[,KIND:N...]
//       KIND is send or recv. The Nth ncclSend (ncclRecv) call of the process that posts an
//       operation, counted from 1, posts one that never moves a byte and never completes until
//       ncclCommAbort, like an operation whose peer froze. Operations with the same peer behind
//       it wait too.
//
//   KVMESH_NCCLSIM_ERROR=WHAT:N:RESULT[,WHAT:N:RESULT...]
//       RESULT is an ncclResult_t, by name (ncclRemoteError) or number (6). WHAT is
//       - the name of an exported function (ncclGroupEnd, ncclSend, ncclCommFinalize,
//         ncclCommGetAsyncError, ...): its Nth call returns RESULT and does nothing else
//         (except that ncclGroupEnd still closes the group, discarding what it posted);
//       - send or recv: when the Nth posted ncclSend (ncclRecv) is about to move bytes, the
//         communicator's async error becomes RESULT (as if the network failed under it); the
//         operation does not complete until ncclCommAbort;
//       - init: the Nth communicator's initialization ends with async error RESULT after all
//         ranks have connected (so the other ranks do become ready).
//
// Thread safety: every exported function is thread-safe, as NCCL's are: a communicator may be
// used from several threads, one call at a time per communicator for posting operations.
#ifndef KVMESH_TESTS_TESTING_NCCLSIM_NCCL_SIM_H_
#define KVMESH_TESTS_TESTING_NCCLSIM_NCCL_SIM_H_

#ifdef __cplusplus
extern "C" {
#endif

// The simulator's marker: libnccl.so.2 has no such symbol, so a test can tell (dlsym) which
// library the loader opened. Returns a description, e.g. "kvmesh ncclsim (NCCL 2.28.9 API)".
const char* kvmesh_ncclsim_version(void);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // KVMESH_TESTS_TESTING_NCCLSIM_NCCL_SIM_H_

// The simulator's wire formats: what ncclGetUniqueId writes into an ncclUniqueId, the bootstrap
// messages between a rank and the root, and the frames between two ranks. Every process of a
// communicator runs on one machine and loads the same library, so the structs travel as they
// are in memory (host byte order, fixed-width fields, no padding left implicit).
//
// Bootstrap: a rank connects to the root named by the id and sends a RootHello; when all
// `nranks` ranks of that nonce have, the root answers each with a RootReply followed by
// `nranks` RankAddress entries and forgets the nonce (on a refusal: a RootReply with the result
// and a message, no entries). Rank j then connects to every rank i < j at its address and sends
// a PeerHello; rank i accepts one connection from each rank above it.
//
// Transfers: a connection carries Frames in each direction: kData with `bytes` payload bytes
// after it (one ncclSend), then, from ncclCommFinalize, one kFinalize, after which the sender
// sends nothing more.
#ifndef KVMESH_TESTS_TESTING_NCCLSIM_WIRE_H_
#define KVMESH_TESTS_TESTING_NCCLSIM_WIRE_H_

#include <nccl.h>

#include <cstdint>
#include <cstring>

namespace ncclsim {

inline constexpr char kIdMagic[8] = {'k', 'v', 'n', 'c', 's', 'i', 'm', '1'};
inline constexpr uint32_t kMessageMagic = 0x6b76736d;  // "kvsm"

// Two random words that name one communicator: its ranks and its root agree on it.
struct Nonce {
  uint64_t words[2];
  bool operator==(const Nonce& o) const { return words[0] == o.words[0] && words[1] == o.words[1]; }
  bool operator<(const Nonce& o) const {
    return words[0] != o.words[0] ? words[0] < o.words[0] : words[1] < o.words[1];
  }
};

// The content of ncclUniqueId::internal (the rest of it is zero).
struct IdLayout {
  char magic[8];
  uint16_t root_port;  // on 127.0.0.1
  uint16_t reserved;
  int32_t root_pid;  // for messages
  Nonce nonce;
};
static_assert(sizeof(IdLayout) <= NCCL_UNIQUE_ID_BYTES, "the id layout must fit an ncclUniqueId");

inline IdLayout ReadId(const ncclUniqueId& id) {
  IdLayout layout;
  std::memcpy(&layout, id.internal, sizeof(layout));
  return layout;
}

inline bool IsSimulatorId(const IdLayout& layout) {
  return std::memcmp(layout.magic, kIdMagic, sizeof(kIdMagic)) == 0;
}

struct RootHello {
  uint32_t magic;
  int32_t nranks;
  int32_t rank;
  int32_t pid;
  Nonce nonce;
  uint16_t port;  // where this rank accepts its peers (0 for a one-rank communicator)
  uint16_t reserved[3];
};

struct RootReply {
  uint32_t magic;
  int32_t result;  // ncclSuccess, or why the root refused the rank
  int32_t nranks;  // RankAddress entries that follow (0 on a refusal)
  char message[244];
};

struct RankAddress {
  int32_t pid;
  uint16_t port;
  uint16_t reserved;
};

struct PeerHello {
  uint32_t magic;
  int32_t rank;
  Nonce nonce;
};

enum FrameKind : uint32_t { kData = 1, kFinalize = 2 };

struct Frame {
  uint32_t magic;
  uint32_t kind;   // FrameKind
  uint64_t bytes;  // payload bytes that follow (kData)
};

}  // namespace ncclsim

#endif  // KVMESH_TESTS_TESTING_NCCLSIM_WIRE_H_

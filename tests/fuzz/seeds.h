// The seeds make_seeds.cc writes: one file per seed under <dir>/<target>/<name>.
#ifndef KVMESH_TESTS_FUZZ_SEEDS_H_
#define KVMESH_TESTS_FUZZ_SEEDS_H_

#include <string>
#include <vector>

#include "absl/status/status.h"

namespace kvmesh {
namespace fuzz {

struct Seed {
  std::string target;  // the fuzz target, e.g. "rpc_fuzzer"
  std::string name;    // the file name
  std::string bytes;
};

// Sessions of valid calls for rpc_fuzzer (rpc_seeds.cc).
absl::Status RpcSeeds(std::vector<Seed>* out);
// Valid inputs of each parser for ctl_parse_fuzzer (ctl_seeds.cc).
absl::Status CtlSeeds(std::vector<Seed>* out);

}  // namespace fuzz
}  // namespace kvmesh

#endif  // KVMESH_TESTS_FUZZ_SEEDS_H_

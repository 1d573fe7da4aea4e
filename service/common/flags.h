// Command-line helpers shared by the kvmesh binaries (kvmesh-node, kvmeshctl): a byte-size
// flag type that takes binary suffixes, and the spelling of flag names with dashes.
// Stateless; safe from any thread.
#ifndef KVMESH_SERVICE_COMMON_FLAGS_H_
#define KVMESH_SERVICE_COMMON_FLAGS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvmesh {

// A number of bytes, as a flag: "1048576", "512B", "64KiB", "8MiB", "8GiB", "1TiB".
struct ByteSize {
  uint64_t bytes = 0;
};

// INVALID_ARGUMENT naming the text for anything but digits with an optional suffix among
// B, KiB, MiB, GiB, TiB, or a value beyond 2^64 - 1.
absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text);

// The shortest exact spelling: 8589934592 -> "8GiB", 1000 -> "1000".
std::string FormatByteSize(uint64_t bytes);

// Abseil flag marshalling for ByteSize (found by ADL).
bool AbslParseFlag(absl::string_view text, ByteSize* out, std::string* error);
std::string AbslUnparseFlag(ByteSize size);

// Abseil flag names are identifiers (--node_name); kvmesh documents them with dashes
// (--node-name). Returns argv with dashes in the name part of every "--name[=value]" argument
// turned into underscores, up to a bare "--". Values are left alone. The result's pointers
// refer to `storage`, which must outlive their use.
std::vector<char*> NormalizeFlagNames(int argc, char** argv, std::vector<std::string>* storage);

}  // namespace kvmesh

#endif  // KVMESH_SERVICE_COMMON_FLAGS_H_

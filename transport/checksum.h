// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, initial value and final XOR 0xFFFFFFFF):
// the checksum every transfer carries end to end (docs/cluster.md). It is the CRC of iSCSI
// (RFC 3720), ext4 and LevelDB, and x86 computes it in hardware (SSE4.2 `crc32`).
//
// Crc32cExtend picks the fastest implementation once per process: the SSE4.2 instruction on
// three interleaved streams where the CPU has it (about 3 bytes per cycle), else a portable
// slicing-by-8 table (about 1 byte per cycle). Both give identical results.
//
// Thread safety: stateless functions, safe from any thread.
#ifndef KVMESH_TRANSPORT_CHECKSUM_H_
#define KVMESH_TRANSPORT_CHECKSUM_H_

#include <cstdint>

#include "absl/types/span.h"

namespace kvmesh {
namespace transport {

// The CRC-32C of A followed by `data`, given `crc` = Crc32c(A). So Crc32cExtend(0, data) ==
// Crc32c(data), and a checksum can be computed piece by piece as bytes arrive.
uint32_t Crc32cExtend(uint32_t crc, absl::Span<const uint8_t> data);

// The CRC-32C of `data`.
inline uint32_t Crc32c(absl::Span<const uint8_t> data) { return Crc32cExtend(0, data); }

namespace internal {
// The two implementations behind Crc32cExtend, exposed so that tests can compare them.
uint32_t Crc32cExtendPortable(uint32_t crc, absl::Span<const uint8_t> data);
// REQUIRES: Crc32cHardwareAvailable().
uint32_t Crc32cExtendHardware(uint32_t crc, absl::Span<const uint8_t> data);
// True on x86-64 CPUs with SSE4.2.
bool Crc32cHardwareAvailable();
}  // namespace internal

}  // namespace transport
}  // namespace kvmesh

#endif  // KVMESH_TRANSPORT_CHECKSUM_H_

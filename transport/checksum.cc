#include "transport/checksum.h"

#include <cstddef>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace kvmesh {
namespace transport {
namespace {

// CRC-32C's polynomial, bit-reflected.
constexpr uint32_t kPolynomial = 0x82F63B78u;

// kTables.t[k][b]: the raw CRC state (no pre- or post-inversion) of byte b followed by k zero
// bytes, starting from state 0. t[0] is the classic byte-at-a-time table; slicing-by-8 looks up
// the eight bytes of a word in t[7]..t[0] at once.
struct Tables {
  uint32_t t[8][256];
};

constexpr Tables MakeTables() {
  Tables tables{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t c = b;
    for (int bit = 0; bit < 8; ++bit) c = (c & 1) ? (c >> 1) ^ kPolynomial : c >> 1;
    tables.t[0][b] = c;
  }
  for (uint32_t b = 0; b < 256; ++b) {
    for (int k = 1; k < 8; ++k) {
      const uint32_t prev = tables.t[k - 1][b];
      tables.t[k][b] = (prev >> 8) ^ tables.t[0][prev & 0xFF];
    }
  }
  return tables;
}

constexpr Tables kTables = MakeTables();

// The eight bytes at p as a little-endian integer (any alignment).
inline uint64_t LoadLittleEndian64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof(v));
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  v = __builtin_bswap64(v);
#endif
  return v;
}

#if defined(__x86_64__)

// The hardware path runs three independent CRC streams over three adjacent blocks, because the
// `crc32` instruction has a latency of 3 cycles but a throughput of 1 per cycle. The three raw
// states are then combined with the linearity of CRCs:
//   state(s, A || B) = Shift(state(s, A), |B|) ^ state(0, B)
// where Shift(x, n) is the state that x becomes after n zero bytes, a linear map of x that a
// ShiftTable evaluates with four lookups.
constexpr size_t kLongBlock = 8192;  // bytes per stream for large inputs
constexpr size_t kShortBlock = 256;  // bytes per stream for what is left

struct ShiftTable {
  uint32_t t[4][256];
};

ShiftTable MakeShiftTable(size_t bytes) {
  // Shift of each single-bit state, by running it through `bytes` zero bytes.
  uint32_t basis[32];
  for (int i = 0; i < 32; ++i) {
    uint32_t c = uint32_t{1} << i;
    for (size_t n = 0; n < bytes; ++n) c = (c >> 8) ^ kTables.t[0][c & 0xFF];
    basis[i] = c;
  }
  ShiftTable table{};
  for (int k = 0; k < 4; ++k) {
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t v = 0;
      for (int bit = 0; bit < 8; ++bit) {
        if ((b >> bit) & 1) v ^= basis[8 * k + bit];
      }
      table.t[k][b] = v;
    }
  }
  return table;
}

inline uint32_t Shift(const ShiftTable& table, uint32_t state) {
  return table.t[0][state & 0xFF] ^ table.t[1][(state >> 8) & 0xFF] ^
         table.t[2][(state >> 16) & 0xFF] ^ table.t[3][state >> 24];
}

const ShiftTable& LongShift() {
  static const ShiftTable* const table = new ShiftTable(MakeShiftTable(kLongBlock));
  return *table;
}

const ShiftTable& ShortShift() {
  static const ShiftTable* const table = new ShiftTable(MakeShiftTable(kShortBlock));
  return *table;
}

// Runs the three-stream loop over as many blocks of 3 * block bytes as fit.
__attribute__((target("sse4.2"))) inline uint64_t ThreeWay(uint64_t state, size_t block,
                                                           const ShiftTable& shift,
                                                           const uint8_t** p, size_t* n) {
  while (*n >= 3 * block) {
    const uint8_t* a = *p;
    const uint8_t* b = a + block;
    const uint8_t* c = b + block;
    uint64_t s0 = state;
    uint64_t s1 = 0;
    uint64_t s2 = 0;
    for (size_t i = 0; i < block; i += 8) {
      s0 = _mm_crc32_u64(s0, LoadLittleEndian64(a + i));
      s1 = _mm_crc32_u64(s1, LoadLittleEndian64(b + i));
      s2 = _mm_crc32_u64(s2, LoadLittleEndian64(c + i));
    }
    state = Shift(shift, static_cast<uint32_t>(s0)) ^ static_cast<uint32_t>(s1);
    state = Shift(shift, static_cast<uint32_t>(state)) ^ static_cast<uint32_t>(s2);
    *p += 3 * block;
    *n -= 3 * block;
  }
  return state;
}

__attribute__((target("sse4.2"))) uint32_t ExtendSse42(uint32_t crc, const uint8_t* p, size_t n) {
  uint64_t state = static_cast<uint32_t>(~crc);
  if (n >= 3 * kLongBlock) state = ThreeWay(state, kLongBlock, LongShift(), &p, &n);
  if (n >= 3 * kShortBlock) state = ThreeWay(state, kShortBlock, ShortShift(), &p, &n);
  for (; n >= 8; p += 8, n -= 8) state = _mm_crc32_u64(state, LoadLittleEndian64(p));
  uint32_t state32 = static_cast<uint32_t>(state);
  for (; n > 0; ++p, --n) state32 = _mm_crc32_u8(state32, *p);
  return ~state32;
}

#endif  // __x86_64__

using ExtendFn = uint32_t (*)(uint32_t, absl::Span<const uint8_t>);

ExtendFn ChooseExtend() {
  return internal::Crc32cHardwareAvailable() ? internal::Crc32cExtendHardware
                                             : internal::Crc32cExtendPortable;
}

}  // namespace

namespace internal {

uint32_t Crc32cExtendPortable(uint32_t crc, absl::Span<const uint8_t> data) {
  const uint8_t* p = data.data();
  size_t n = data.size();
  uint32_t state = ~crc;
  const auto& t = kTables.t;
  for (; n >= 8; p += 8, n -= 8) {
    const uint64_t word = LoadLittleEndian64(p);
    const uint32_t lo = static_cast<uint32_t>(word) ^ state;
    const uint32_t hi = static_cast<uint32_t>(word >> 32);
    state = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^
            t[3][hi & 0xFF] ^ t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
  }
  for (; n > 0; ++p, --n) state = (state >> 8) ^ t[0][(state ^ *p) & 0xFF];
  return ~state;
}

uint32_t Crc32cExtendHardware(uint32_t crc, absl::Span<const uint8_t> data) {
#if defined(__x86_64__)
  return ExtendSse42(crc, data.data(), data.size());
#else
  return Crc32cExtendPortable(crc, data);
#endif
}

bool Crc32cHardwareAvailable() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("sse4.2");
#else
  return false;
#endif
}

}  // namespace internal

uint32_t Crc32cExtend(uint32_t crc, absl::Span<const uint8_t> data) {
  static const ExtendFn extend = ChooseExtend();
  return extend(crc, data);
}

}  // namespace transport
}  // namespace kvmesh

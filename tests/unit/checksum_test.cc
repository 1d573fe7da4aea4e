// CRC-32C: both implementations against the RFC 3720 vectors, against a bit-at-a-time reference
// written from the definition, and against each other on seeded random data of every length up
// to 300 bytes at every alignment, across the three-stream block boundaries, and split at every
// point (Crc32cExtend).
#include "transport/checksum.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvmesh {
namespace transport {
namespace {

using internal::Crc32cExtendHardware;
using internal::Crc32cExtendPortable;
using internal::Crc32cHardwareAvailable;

// CRC-32C from its definition: reflected, polynomial 0x82F63B78, one bit at a time.
uint32_t ReferenceCrc32c(absl::Span<const uint8_t> data) {
  uint32_t crc = 0xFFFFFFFFu;
  for (const uint8_t byte : data) {
    crc ^= byte;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1)));
  }
  return ~crc;
}

absl::Span<const uint8_t> Bytes(const std::string& s) {
  return absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

std::vector<uint8_t> RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> v(n);
  for (uint8_t& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

struct Impl {
  const char* name;
  uint32_t (*extend)(uint32_t, absl::Span<const uint8_t>);
};

// The implementations this machine can run: the portable one always, the dispatcher, and the
// SSE4.2 one where the CPU has it.
std::vector<Impl> Implementations() {
  std::vector<Impl> impls = {{"portable", Crc32cExtendPortable}, {"dispatch", Crc32cExtend}};
  if (Crc32cHardwareAvailable()) impls.push_back({"sse4.2", Crc32cExtendHardware});
  return impls;
}

TEST(Crc32cTest, ReportsImplementation) {
  std::printf("CRC-32C hardware (SSE4.2) available: %s\n",
              Crc32cHardwareAvailable() ? "yes" : "no");
}

TEST(Crc32cTest, Rfc3720Vectors) {
  const std::vector<uint8_t> zeros(32, 0x00);
  const std::vector<uint8_t> ones(32, 0xFF);
  std::vector<uint8_t> ascending(32);
  std::vector<uint8_t> descending(32);
  for (int i = 0; i < 32; ++i) {
    ascending[i] = static_cast<uint8_t>(i);
    descending[i] = static_cast<uint8_t>(31 - i);
  }
  for (const Impl& impl : Implementations()) {
    SCOPED_TRACE(impl.name);
    EXPECT_EQ(impl.extend(0, {}), 0x00000000u);
    EXPECT_EQ(impl.extend(0, zeros), 0x8A9136AAu);
    EXPECT_EQ(impl.extend(0, ones), 0x62A8AB43u);
    EXPECT_EQ(impl.extend(0, ascending), 0x46DD794Eu);
    EXPECT_EQ(impl.extend(0, descending), 0x113FDB5Cu);
    EXPECT_EQ(impl.extend(0, Bytes("123456789")), 0xE3069283u);
  }
  EXPECT_EQ(Crc32c(Bytes("123456789")), 0xE3069283u);
  EXPECT_EQ(ReferenceCrc32c(Bytes("123456789")), 0xE3069283u);
}

// Every length 0..300 at every misalignment 0..15 of the start: all implementations agree with
// the reference.
TEST(Crc32cTest, AllShortLengthsAndAlignments) {
  const std::vector<uint8_t> data = RandomBytes(300 + 16, 1);
  const std::vector<Impl> impls = Implementations();
  for (size_t align = 0; align < 16; ++align) {
    for (size_t len = 0; len <= 300; ++len) {
      const absl::Span<const uint8_t> span(data.data() + align, len);
      const uint32_t want = ReferenceCrc32c(span);
      for (const Impl& impl : impls) {
        ASSERT_EQ(impl.extend(0, span), want) << impl.name << " len=" << len << " align=" << align;
      }
    }
  }
}

// Lengths around the boundaries of the three-stream blocks (3 x 256 and 3 x 8192 bytes) and a
// few large odd sizes, misaligned.
TEST(Crc32cTest, BlockBoundaries) {
  std::vector<size_t> lengths;
  for (const size_t boundary : {size_t{3 * 256}, size_t{3 * 8192}, size_t{2 * 3 * 8192}}) {
    for (size_t delta = 0; delta <= 17; ++delta) {
      lengths.push_back(boundary + delta);
      lengths.push_back(boundary - delta);
    }
  }
  for (const size_t n : {size_t{3 * 8192 + 3 * 256 + 7}, size_t{100000}, size_t{(1 << 20) + 13}}) {
    lengths.push_back(n);
  }
  const std::vector<uint8_t> data = RandomBytes((1 << 20) + 64, 2);
  const std::vector<Impl> impls = Implementations();
  for (const size_t len : lengths) {
    for (const size_t align : {0, 1, 3, 7}) {
      const absl::Span<const uint8_t> span(data.data() + align, len);
      const uint32_t want = ReferenceCrc32c(span);
      for (const Impl& impl : impls) {
        ASSERT_EQ(impl.extend(0, span), want) << impl.name << " len=" << len << " align=" << align;
      }
    }
  }
}

// Crc32cExtend(Crc32c(a), b) == Crc32c(a || b) for every split of a buffer, in each
// implementation, and pieces of random sizes chain the same way.
TEST(Crc32cTest, ExtendAtEverySplit) {
  const std::vector<uint8_t> data = RandomBytes(1000, 3);
  const absl::Span<const uint8_t> all(data);
  const uint32_t want = ReferenceCrc32c(all);
  for (const Impl& impl : Implementations()) {
    for (size_t split = 0; split <= all.size(); ++split) {
      const uint32_t head = impl.extend(0, all.subspan(0, split));
      ASSERT_EQ(impl.extend(head, all.subspan(split)), want) << impl.name << " split=" << split;
    }
  }

  const std::vector<uint8_t> big = RandomBytes(200000, 4);
  const uint32_t big_want = ReferenceCrc32c(big);
  std::mt19937_64 rng(5);
  for (const Impl& impl : Implementations()) {
    uint32_t crc = 0;
    size_t at = 0;
    while (at < big.size()) {
      const size_t n = std::min<size_t>(big.size() - at, rng() % 40000);
      crc = impl.extend(crc, absl::Span<const uint8_t>(big).subspan(at, n));
      at += n;
    }
    EXPECT_EQ(crc, big_want) << impl.name;
  }
}

// Not a check: prints each implementation's speed on 64 MiB (nccl-tests style), so a
// regression shows in the test log.
TEST(Crc32cTest, Throughput) {
  const std::vector<uint8_t> data = RandomBytes(64 << 20, 6);
  uint32_t first = 0;
  for (const Impl& impl : Implementations()) {
    impl.extend(0, absl::Span<const uint8_t>(data).subspan(0, 1 << 16));  // one-time setup
    const auto start = std::chrono::steady_clock::now();
    const uint32_t crc = impl.extend(0, data);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("CRC-32C %-8s %zu bytes %.3f ms %.2f GB/s\n", impl.name, data.size(), seconds * 1e3,
                static_cast<double>(data.size()) / seconds / 1e9);
    if (first == 0) first = crc;
    EXPECT_EQ(crc, first) << impl.name;
  }
}

}  // namespace
}  // namespace transport
}  // namespace kvmesh

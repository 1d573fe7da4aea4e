// kvmesh_fuzz_seeds: writes the seed corpora of the fuzz targets.
//
//   kvmesh_fuzz_seeds DIR      writes DIR/<target>/<seed> for every target (tests/fuzz/corpus is
//                              the committed copy: regenerate it with this after a change of the
//                              wire format or the protos)
//
// The seeds are meaningful inputs, each a valid case the fuzzer mutates from: real snapshot
// images exported by the engine (prefixes, partial ranges, merged segments, pruned sliding
// windows, wrapped rings, recurrent states) for snapshot_import_fuzzer; sessions of valid requests
// (rpc_seeds.cc) for rpc_fuzzer; valid shorthands for ctl_parse_fuzzer.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cache/cache.h"
#include "cache/device/host_device.h"
#include "cache/status_macros.h"
#include "tests/fuzz/fuzz_support.h"
#include "tests/fuzz/seeds.h"

namespace kvmesh {
namespace fuzz {
namespace {

absl::Status AppendRange(Cache& cache, int64_t seq, int32_t begin, int32_t end, uint8_t salt) {
  std::vector<Token> tokens;
  for (int32_t p = begin; p < end; ++p) tokens.push_back(Token{seq, p});
  const std::string payload =
      PrefillPayload(cache.spec(), static_cast<int32_t>(tokens.size()), salt);
  return cache.Append(tokens, absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(payload.data()),
                                                  payload.size()));
}

absl::StatusOr<std::string> Export(Cache& cache, uint64_t id) {
  ASSIGN_OR_RETURN(std::unique_ptr<SnapshotExportReader> reader, cache.OpenSnapshotExport(id));
  std::string image(reader->size(), '\0');
  RETURN_IF_ERROR(
      reader->ReadAt(0, absl::MakeSpan(reinterpret_cast<uint8_t*>(image.data()), image.size())));
  return image;
}

bool HasKind(const CacheSpec& spec, GroupKind kind) {
  for (const GroupSpec& g : spec.groups) {
    if (g.kind == kind) return true;
  }
  return false;
}

// Images of each wire case: (name, flags, image).
absl::Status WireSeeds(std::vector<Seed>* out) {
  const std::vector<WireCase>& cases = WireCases();
  for (size_t c = 0; c < cases.size(); ++c) {
    const CacheSpec& spec = cases[c].spec;
    HostDevice device(cases[c].cache_budget, cases[c].snapshot_budget);
    auto add = [&](const std::string& what, uint8_t flags, const std::string& image) {
      std::string input;
      input.push_back(static_cast<char>(c));
      input.push_back(static_cast<char>(flags));
      input.push_back(static_cast<char>(out->size() * 41 + 7));
      input += image;
      out->push_back(Seed{"snapshot_import_fuzzer", absl::StrCat(spec.name, "-", what), input});
    };
    ASSIGN_OR_RETURN(std::unique_ptr<Cache> cache, Cache::Create(spec, &device));
    const int32_t n = PrefillTokens(spec);
    RETURN_IF_ERROR(AppendRange(*cache, 0, 0, n, 1));
    // The whole sequence, restored into an empty sequence and into the prefilled one.
    ASSIGN_OR_RETURN(SnapshotInfo whole, cache->Snapshot(0, 0));
    ASSIGN_OR_RETURN(std::string image, Export(*cache, whole.id));
    add("whole", 0, image);
    add("whole-into-prefilled", kRestoreIntoPrefilled, image);
    add("whole-short", kShortDelivery, image);
    add("whole-dropped", kDropWithoutCommit, image);
    // A range that starts inside the sequence.
    ASSIGN_OR_RETURN(SnapshotInfo partial, cache->Snapshot(0, n / 2));
    ASSIGN_OR_RETURN(image, Export(*cache, partial.id));
    add("partial", kRestoreIntoPrefilled, image);
    // Two snapshots merged: an Attention group's data in two segments.
    RETURN_IF_ERROR(AppendRange(*cache, 1, 0, 3, 2));
    ASSIGN_OR_RETURN(SnapshotInfo head, cache->Snapshot(1, 0));
    RETURN_IF_ERROR(AppendRange(*cache, 1, 3, 5, 3));
    ASSIGN_OR_RETURN(SnapshotInfo tail, cache->Snapshot(1, 3));
    ASSIGN_OR_RETURN(SnapshotInfo merged, cache->MergeSnapshots(head.id, tail.id));
    ASSIGN_OR_RETURN(image, Export(*cache, merged.id));
    add("merged", 0, image);
    // A longer sequence: sliding windows prune, rings wrap, chunks fill.
    RETURN_IF_ERROR(AppendRange(*cache, 2, 0, std::min(spec.max_batch, 12), 4));
    RETURN_IF_ERROR(AppendRange(*cache, 2, std::min(spec.max_batch, 12), 20, 5));
    ASSIGN_OR_RETURN(SnapshotInfo longer, cache->Snapshot(2, 0));
    ASSIGN_OR_RETURN(image, Export(*cache, longer.id));
    add("long", 0, image);
    if (!HasKind(spec, GroupKind::kRotating) && !HasKind(spec, GroupKind::kRecurrent)) {
      // Positions with a gap (a sequence that never stored some): only where positions need not
      // be contiguous.
      std::vector<Token> tokens = {{3, 0}, {3, 2}, {3, 5}, {3, 9}};
      const std::string payload = PrefillPayload(spec, 4, 6);
      RETURN_IF_ERROR(cache->Append(
          tokens,
          absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(payload.data()), payload.size())));
      ASSIGN_OR_RETURN(SnapshotInfo sparse, cache->Snapshot(3, 0));
      ASSIGN_OR_RETURN(image, Export(*cache, sparse.id));
      add("sparse", 0, image);
    }
  }
  return absl::OkStatus();
}

absl::Status Write(const std::filesystem::path& dir, const std::vector<Seed>& seeds) {
  for (const Seed& seed : seeds) {
    const std::filesystem::path folder = dir / seed.target;
    std::filesystem::create_directories(folder);
    std::ofstream file(folder / seed.name, std::ios::binary | std::ios::trunc);
    file.write(seed.bytes.data(), static_cast<std::streamsize>(seed.bytes.size()));
    if (!file)
      return absl::DataLossError(absl::StrCat("cannot write ", (folder / seed.name).string()));
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace fuzz
}  // namespace kvmesh

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR   (writes DIR/<target>/<seed>)\n", argv[0]);
    return 2;
  }
  std::vector<kvmesh::fuzz::Seed> seeds;
  absl::Status status = kvmesh::fuzz::WireSeeds(&seeds);
  if (status.ok()) status = kvmesh::fuzz::RpcSeeds(&seeds);
  if (status.ok()) status = kvmesh::fuzz::CtlSeeds(&seeds);
  if (status.ok()) status = kvmesh::fuzz::Write(argv[1], seeds);
  if (!status.ok()) {
    std::fprintf(stderr, "%s: %s\n", argv[0], status.ToString().c_str());
    return 1;
  }
  std::printf("wrote %zu seeds under %s\n", seeds.size(), argv[1]);
  return 0;
}

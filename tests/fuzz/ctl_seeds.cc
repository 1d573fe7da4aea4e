// Seeds of ctl_parse_fuzzer: the first byte picks the parser (ctl_parse_fuzzer.cc, Parser).
#include <initializer_list>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/fuzz/seeds.h"

namespace kvmesh {
namespace fuzz {
namespace {

// A command line as ctl_parse_fuzzer takes it: the arguments separated by NUL bytes.
std::string Argv(std::initializer_list<const char*> words) {
  std::string out;
  for (const char* w : words) {
    if (!out.empty()) out.push_back('\0');
    out += w;
  }
  return out;
}

}  // namespace

absl::Status CtlSeeds(std::vector<Seed>* out) {
  struct Text {
    int parser;
    const char* name;
    std::string text;
  };
  const std::vector<Text> texts = {
      {0, "group-llama",
       "attention:layers=32,heads=8,head_dim=128,window=full,rope=neox:128:500000"},
      {0, "group-sliding",
       "attention:layers=6,heads=8,head_dim_k=64,head_dim_v=32,window=sliding:512:1024,rope=normal:"
       "32"},
      {0, "group-chunked", "attention:layers=2,kv_heads=2,head_dim=16,window=chunked:8,rope=none"},
      {0, "group-rotating",
       "rotating:layers=4,heads=8,head_dim=128,max_size=4096,rope=neox:128:10000:0.5"},
      {0, "group-recurrent", "recurrent:layers=10,conv_tail=2,conv_dim=2048"},
      {0, "group-delta",
       "recurrent:layers=2,conv_tail=3,conv_dim=8,v_heads=2,head_v_dim=4,head_k_dim=4"},
      {0, "group-small", "attention:layers=1,heads=1,head_dim=4,rope=neox"},
      {1, "positions-range", "0:512"},
      {1, "positions-list", "0,1,2,7,9:12"},
      {2, "dtype-bf16", "bf16"},
      {2, "dtype-prefixed", "DTYPE_F32"},
      {3, "scope-cluster", "cluster"},
      {4, "size-gib", "8GiB"},
      {4, "size-plain", "1048576"},
      {5, "args-append",
       Argv(
           {"append", "--cache=llama", "--seq", "0", "--positions=0:512", "--seed=1", "--stream"})},
      {5, "args-read",
       Argv(
           {"--timeout=2.5", "read", "--cache=m", "--seq=3", "--json", "--max-chunk-bytes=64KiB"})},
      {5, "args-duration", Argv({"--timeout=1m30s", "list"})},
      {6, "peers-two", "b=127.0.0.1:7702, c=[::1]:7703"},
      {6, "peers-name", "kvmesh-1=kvmesh-1.kvmesh.default.svc:7700"},
      {7, "tokens",
       "# tenants\n"
       "token sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08 team-a "
       "tenant\n"
       "token sha256:60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752 ops admin\n"
       "quota team-a caches=4 bytes=512MiB\n"},
  };
  for (const Text& t : texts) {
    out->push_back(Seed{"ctl_parse_fuzzer", t.name,
                        absl::StrCat(std::string(1, static_cast<char>(t.parser)), t.text)});
  }
  return absl::OkStatus();
}

}  // namespace fuzz
}  // namespace kvmesh

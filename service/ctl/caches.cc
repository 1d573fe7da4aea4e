// kvmeshctl's commands on a node's caches: create, delete, get, list, usage.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cache/status_macros.h"
#include "google/protobuf/util/json_util.h"
#include "kvmesh/v1/kvmesh.pb.h"
#include "service/common/convert.h"
#include "service/ctl/args.h"
#include "service/ctl/client.h"
#include "service/ctl/commands.h"
#include "service/ctl/format.h"
#include "service/ctl/parse.h"

namespace kvmesh {
namespace ctl {
namespace {

// The spec is --spec-json (inline or @FILE) with the shorthand flags on top.
absl::Status Create(const Client& client, const Args& args) {
  v1::CacheSpec spec;
  if (auto json = args.Get("spec-json")) {
    std::string text = *json;
    if (!text.empty() && text[0] == '@') {
      ASSIGN_OR_RETURN(text, ReadFile(text.substr(1)));
    }
    auto parsed = google::protobuf::util::JsonStringToMessage(text, &spec);
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--spec-json: ", parsed.ToString()));
    }
  }
  if (args.Has("name") || args.Has("cache")) {
    ASSIGN_OR_RETURN(std::string name, GetCacheName(args));
    spec.set_name(name);
  }
  if (auto dtype = args.Get("dtype")) {
    ASSIGN_OR_RETURN(v1::DType d, ParseDType(*dtype));
    spec.set_dtype(d);
  } else if (spec.dtype() == v1::DTYPE_UNSPECIFIED) {
    spec.set_dtype(v1::DTYPE_F16);
  }
  if (args.Has("max-sequences")) {
    ASSIGN_OR_RETURN(int32_t v, GetInt32(args, "max-sequences"));
    spec.set_max_sequences(v);
  }
  if (args.Has("capacity")) {
    ASSIGN_OR_RETURN(int32_t v, GetInt32(args, "capacity"));
    spec.set_capacity(v);
  }
  if (args.Has("max-batch")) {
    ASSIGN_OR_RETURN(int32_t v, GetInt32(args, "max-batch"));
    spec.set_max_batch(v);
  }
  if (auto eviction = args.Get("eviction")) {
    if (*eviction == "none") {
      spec.set_eviction(v1::EVICTION_POLICY_NONE);
    } else if (*eviction == "lru") {
      spec.set_eviction(v1::EVICTION_POLICY_LRU);
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("--eviction=", *eviction, ": expected none or lru"));
    }
  }
  const std::vector<std::string> groups = args.GetAll("group");
  if (!groups.empty()) {
    spec.clear_groups();
    for (const std::string& text : groups) {
      auto group = ParseGroup(text);
      if (!group.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("--group: ", group.status().message()));
      }
      *spec.add_groups() = *group;
    }
  }
  if (spec.name().empty()) return absl::InvalidArgumentError("--name is required");

  v1::CreateCacheRequest request;
  *request.mutable_spec() = spec;
  v1::CreateCacheResponse response;
  RETURN_IF_ERROR(client.Call(&v1::CacheService::Stub::CreateCache, request, &response));
  if (client.json()) return PrintJson(response);
  std::printf("%s cache %s\n",
              response.created() ? "created" : "already exists (same spec):", spec.name().c_str());
  std::fputs(InfoText(response.cache()).c_str(), stdout);
  return absl::OkStatus();
}

absl::Status Delete(const Client& client, const Args& args) {
  v1::DeleteCacheRequest request;
  ASSIGN_OR_RETURN(*request.mutable_cache(), GetCacheName(args));
  v1::DeleteCacheResponse response;
  RETURN_IF_ERROR(client.Call(&v1::CacheService::Stub::DeleteCache, request, &response));
  if (client.json()) return PrintJson(response);
  std::printf("deleted cache %s\n", request.cache().c_str());
  return absl::OkStatus();
}

absl::Status Get(const Client& client, const Args& args) {
  v1::GetCacheRequest request;
  ASSIGN_OR_RETURN(*request.mutable_cache(), GetCacheName(args));
  v1::GetCacheResponse response;
  RETURN_IF_ERROR(client.Call(&v1::CacheService::Stub::GetCache, request, &response));
  if (client.json()) return PrintJson(response);
  std::fputs(InfoText(response.cache()).c_str(), stdout);
  return absl::OkStatus();
}

absl::Status List(const Client& client, const Args& args) {
  v1::ListCachesRequest request;
  ASSIGN_OR_RETURN(const bool one_page, GetPaging(args, kListCachesPageSize, &request));
  v1::ListCachesResponse response;
  RETURN_IF_ERROR(
      client.CallPages(&v1::CacheService::Stub::ListCaches, request, &response, one_page));
  if (client.json()) return PrintJson(response);
  std::printf("%-24s %-16s %-5s %6s %10s %9s %9s %12s\n", "NAME", "TENANT", "DTYPE", "GROUPS",
              "SEQUENCES", "CAPACITY", "MAX_BATCH", "HELD");
  for (const v1::CacheInfo& info : response.caches()) {
    const v1::CacheSpec& s = info.spec();
    std::printf("%-24s %-16s %-5s %6d %10s %9d %9d %12s\n", s.name().c_str(), info.tenant().c_str(),
                DTypeText(s.dtype()).c_str(), s.groups_size(),
                absl::StrCat(info.usage().sequences_live(), "/", s.max_sequences()).c_str(),
                s.capacity(), s.max_batch(), Mib(info.usage().bytes_held()).c_str());
  }
  if (response.caches().empty()) std::printf("(no caches)\n");
  PrintNextPage(response.next_page_token());
  return absl::OkStatus();
}

absl::Status Usage(const Client& client, const Args& args) {
  ASSIGN_OR_RETURN(std::string cache, GetCacheName(args));
  ASSIGN_OR_RETURN(v1::CacheInfo info, client.FetchInfo(cache));
  if (client.json()) return PrintJson(info.usage());
  std::printf("usage of cache %s\n", cache.c_str());
  std::fputs(UsageText(info.usage(), info.spec()).c_str(), stdout);
  return absl::OkStatus();
}

constexpr absl::string_view kCreateFlags[] = {"name",          "cache",     "dtype",
                                              "max-sequences", "capacity",  "max-batch",
                                              "group",         "spec-json", "eviction"};
constexpr absl::string_view kCacheFlags[] = {"cache", "name"};
constexpr absl::string_view kListFlags[] = {"page-size", "page-token"};

}  // namespace

const Command kCreateCommand = {
    "create", kCreateFlags,
    R"(  create        --name=CACHE [--dtype=f32|f16|bf16 (f16)] --max-sequences=N --capacity=TOKENS
                --max-batch=TOKENS --group=GROUP [--group=GROUP]... [--eviction=none|lru]
                |  --spec-json=JSON|@FILE
                GROUP: attention:layers=32,heads=8,head_dim=128,window=WINDOW,rope=ROPE
                  also head_dim_k=, head_dim_v=; WINDOW: full | sliding:W[:MEMORY] | chunked:N
                  ROPE: none | normal|neox[:DIMS[:BASE[:FREQ_SCALE]]]
                GROUP: rotating:layers=N,heads=H,head_dim=D,max_size=TOKENS[,rope=ROPE]
                  a ring of the last max_size tokens per sequence; also head_dim_k=, head_dim_v=
                GROUP: recurrent:layers=N,conv_tail=T,conv_dim=C[,v_heads=V,head_v_dim=DV,
                  head_k_dim=DK]: per-sequence conv state [T][C] (+ delta state [V][DV][DK] f32)
                --eviction=lru: an Append short of room first evicts whole sequences, lowest
                  priority, then least recently used (docs/api.md#eviction); none: refused
                shorthand flags override the fields of --spec-json)",
    &Create};

const Command kDeleteCommand = {"delete", kCacheFlags, R"(  delete        --cache=CACHE)", &Delete};

const Command kGetCommand = {
    "get", kCacheFlags, R"(  get           --cache=CACHE                  spec and usage)", &Get};

const Command kListCommand = {
    "list", kListFlags,
    R"(  list          [--page-size=N] [--page-token=T]  the caller's caches (an admin: all);
                every page, N (1000) a call, unless --page-token asks for the one page from T)",
    &List};

const Command kUsageCommand = {
    "usage", kCacheFlags,
    R"(  usage         --cache=CACHE                  cells used/total per group, bytes, sequences,
                                               snapshots)",
    &Usage};

}  // namespace ctl
}  // namespace kvmesh

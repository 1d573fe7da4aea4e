// Client: what every kvmeshctl command works with. It holds one invocation's connection to the
// node (a CacheService stub and a health client over one channel) and its global options
// (--timeout, --json), and fetches what several commands need besides their own call: a cache's
// info, its spec in the engine's terms, a sequence's offset. Beside it, the helpers the commands
// share: flag getters with kvmeshctl's error texts, protobuf JSON output, whole-file I/O.
//
// Thread safety: Client is not thread-safe (kvmeshctl runs one command on the main thread); the
// free functions are stateless and safe from any thread, PrintJson writes to stdout.
#ifndef KVMESH_SERVICE_CTL_CLIENT_H_
#define KVMESH_SERVICE_CTL_CLIENT_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "cache/spec.h"
#include "cache/status_macros.h"
#include "google/protobuf/message.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/support/status.h"
#include "kvmesh/v1/kvmesh.grpc.pb.h"
#include "kvmesh/v1/kvmesh.pb.h"
#include "service/common/convert.h"
#include "service/common/health_client.h"
#include "service/ctl/args.h"

namespace kvmesh {
namespace ctl {

// The page sizes kvmeshctl asks for: the node's maxima (docs/api.md#paging), so that a whole
// listing takes as few calls as the node allows.
inline constexpr int32_t kListPageSize = 4096;       // sequences, snapshots
inline constexpr int32_t kListCachesPageSize = 1000;  // caches

class Client {
 public:
  // `timeout`: the deadline of every call, from the moment its context is made. `json`: the
  // commands print protobuf JSON instead of text.
  Client(std::shared_ptr<grpc::Channel> channel, absl::Duration timeout, bool json);

  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // The node's CacheService (for the streaming calls; unary ones go through Call) and
  // Health/Check, over the same channel.
  v1::CacheService::Stub& stub() const { return *stub_; }
  // The channel, for the bulk streams without copies (service/common/bulk_client.h).
  grpc::ChannelInterface* channel() const { return channel_.get(); }
  const HealthClient& health() const { return health_; }

  // --json: print responses as protobuf JSON (PrintJson) rather than text.
  bool json() const { return json_; }

  // A fresh context for one call, its deadline --timeout from now.
  std::unique_ptr<grpc::ClientContext> Context() const;

  // Calls the unary CacheService RPC `method` (e.g. &v1::CacheService::Stub::GetCache) with a
  // fresh Context(). Its status, in absl terms (FromGrpcStatus); `*response` is set on OK.
  template <typename Request, typename Response>
  absl::Status Call(grpc::Status (v1::CacheService::Stub::*method)(grpc::ClientContext*,
                                                                   const Request&, Response*),
                    const Request& request, Response* response) const {
    return FromGrpcStatus((stub_.get()->*method)(Context().get(), request, response));
  }

  // Calls the paged List RPC `method` (ListCaches, ListSequences, ListSnapshots) from
  // request.page_token() on and merges the pages' entries into *response in order: every page
  // up to the last, or with `one_page` only the first, whose next_page_token *response keeps
  // (empty otherwise). INTERNAL when the node hands back the token it was given, which would
  // never end.
  template <typename Request, typename Response>
  absl::Status CallPages(grpc::Status (v1::CacheService::Stub::*method)(grpc::ClientContext*,
                                                                        const Request&, Response*),
                         Request request, Response* response, bool one_page) const {
    response->Clear();
    for (;;) {
      Response page;
      RETURN_IF_ERROR(Call(method, request, &page));
      std::string next = std::move(*page.mutable_next_page_token());
      page.clear_next_page_token();
      response->MergeFrom(page);
      if (one_page) {
        response->set_next_page_token(std::move(next));
        return absl::OkStatus();
      }
      if (next.empty()) return absl::OkStatus();
      if (next == request.page_token()) {
        return absl::InternalError("the node returned the page token it was given");
      }
      request.set_page_token(std::move(next));
    }
  }

  // The spec and usage of `cache` (GetCache). The RPC's status on failure (NOT_FOUND for an
  // unknown cache).
  absl::StatusOr<v1::CacheInfo> FetchInfo(const std::string& cache) const;

  // FetchInfo's spec in the engine's terms (EngineSpec), for payload arithmetic.
  absl::StatusOr<CacheSpec> FetchSpec(const std::string& cache) const;

  // The offset of `seq` (pending tokens included), from ListSequences; NOT_FOUND when the cache
  // does not list it.
  absl::StatusOr<int32_t> FetchOffset(const std::string& cache, int64_t seq) const;

 private:
  const std::shared_ptr<grpc::Channel> channel_;
  const std::unique_ptr<v1::CacheService::Stub> stub_;
  const HealthClient health_;
  const absl::Duration timeout_;
  const bool json_;
};

// The engine's view of a spec the node returned. INTERNAL when it does not convert (a node
// newer than this client).
absl::StatusOr<CacheSpec> EngineSpec(const v1::CacheSpec& proto);

// Prints `message` as one line of protobuf JSON on stdout, default-valued fields included.
// INTERNAL when it cannot be printed.
absl::Status PrintJson(const google::protobuf::Message& message);

// The whole content of the file at `path`. NOT_FOUND when it cannot be opened, DATA_LOSS when
// reading fails.
absl::StatusOr<std::string> ReadFile(const std::string& path);

// Replaces the file at `path` with `data`. PERMISSION_DENIED when it cannot be created,
// DATA_LOSS when writing fails.
absl::Status WriteFile(const std::string& path, const std::string& data);

// Flag getters: INVALID_ARGUMENT names the flag when it is missing (and required) or its value
// does not parse.
//
// The cache a command addresses: --cache, or --name as an alias.
absl::StatusOr<std::string> GetCacheName(const Args& args);
// A position list (ParsePositions) in flag `name`.
absl::StatusOr<std::vector<int32_t>> GetPositions(const Args& args, absl::string_view name);
// An integer flag that must fit int32; `fallback` when absent (nullopt: required).
absl::StatusOr<int32_t> GetInt32(const Args& args, absl::string_view name,
                                 std::optional<int64_t> fallback = std::nullopt);
// A snapshot id flag: > 0.
absl::StatusOr<uint64_t> GetSnapshotId(const Args& args, absl::string_view name);

// The flags of the paged listings: --page-size=N (entries per call; default: the node's
// maximum, 4096 sequences or snapshots, 1000 caches) into request.page_size, and --page-token=T
// into request.page_token. Returns whether to list one page only (--page-token given); without
// it a command follows the pages to the end.
template <typename Request>
absl::StatusOr<bool> GetPaging(const Args& args, int32_t default_page_size, Request* request) {
  int32_t page_size = 0;
  {
    absl::StatusOr<int32_t> got = GetInt32(args, "page-size", default_page_size);
    if (!got.ok()) return got.status();
    page_size = *got;
  }
  if (page_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--page-size=", page_size, " must be at least 1"));
  }
  request->set_page_size(page_size);
  const std::optional<std::string> token = args.Get("page-token");
  if (!token.has_value()) return false;
  request->set_page_token(*token);
  return true;
}
// Prints where the next page starts, when a one-page listing has one.
void PrintNextPage(const std::string& next_page_token);

}  // namespace ctl
}  // namespace kvmesh

#endif  // KVMESH_SERVICE_CTL_CLIENT_H_

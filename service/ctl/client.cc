// The connection and global options kvmeshctl's commands share, and their common helpers.
#include "service/ctl/client.h"

#include <chrono>
#include <climits>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cache/status_macros.h"
#include "google/protobuf/util/json_util.h"
#include "service/common/convert.h"
#include "service/ctl/parse.h"

namespace kvmesh {
namespace ctl {

Client::Client(std::shared_ptr<grpc::Channel> channel, absl::Duration timeout, bool json)
    : channel_(channel),
      stub_(v1::CacheService::NewStub(channel)),
      health_(channel),
      timeout_(timeout),
      json_(json) {}

std::unique_ptr<grpc::ClientContext> Client::Context() const {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(std::chrono::system_clock::now() + absl::ToChronoMicroseconds(timeout_));
  return context;
}

absl::StatusOr<v1::CacheInfo> Client::FetchInfo(const std::string& cache) const {
  v1::GetCacheRequest request;
  request.set_cache(cache);
  v1::GetCacheResponse response;
  RETURN_IF_ERROR(Call(&v1::CacheService::Stub::GetCache, request, &response));
  return response.cache();
}

absl::StatusOr<CacheSpec> Client::FetchSpec(const std::string& cache) const {
  ASSIGN_OR_RETURN(v1::CacheInfo info, FetchInfo(cache));
  return EngineSpec(info.spec());
}

absl::StatusOr<int32_t> Client::FetchOffset(const std::string& cache, int64_t seq) const {
  v1::ListSequencesRequest request;
  request.set_cache(cache);
  request.set_page_size(kListPageSize);
  // Page by page, ascending: stop at the page that reaches seq.
  for (;;) {
    v1::ListSequencesResponse response;
    RETURN_IF_ERROR(Call(&v1::CacheService::Stub::ListSequences, request, &response));
    for (const v1::SequenceInfo& s : response.sequences()) {
      if (s.seq() == seq) return s.offset();
      if (s.seq() > seq) break;
    }
    const bool past = !response.sequences().empty() &&
                      response.sequences(response.sequences_size() - 1).seq() >= seq;
    if (past || response.next_page_token().empty() ||
        response.next_page_token() == request.page_token()) {
      break;
    }
    request.set_page_token(response.next_page_token());
  }
  return absl::NotFoundError(
      absl::StrCat("seq ", seq, " is not listed by cache ", cache, " (needed for its offset)"));
}

void PrintNextPage(const std::string& next_page_token) {
  if (next_page_token.empty()) return;
  std::printf("next page: --page-token=%s\n", next_page_token.c_str());
}

absl::StatusOr<CacheSpec> EngineSpec(const v1::CacheSpec& proto) {
  auto spec = SpecFromProto(proto);
  if (!spec.ok()) {
    return absl::InternalError(
        absl::StrCat("node returned a spec this client cannot use: ", spec.status().message()));
  }
  return spec;
}

absl::Status PrintJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.always_print_primitive_fields = true;
  std::string out;
  auto status = google::protobuf::util::MessageToJsonString(message, &out, options);
  if (!status.ok()) {
    return absl::InternalError(absl::StrCat("cannot print JSON: ", status.ToString()));
  }
  std::printf("%s\n", out.c_str());
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open '", path, "'"));
  std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return absl::DataLossError(absl::StrCat("cannot read '", path, "'"));
  return data;
}

absl::Status WriteFile(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::PermissionDeniedError(absl::StrCat("cannot create '", path, "'"));
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
  out.close();
  if (!out) return absl::DataLossError(absl::StrCat("cannot write '", path, "'"));
  return absl::OkStatus();
}

absl::StatusOr<std::string> GetCacheName(const Args& args) {
  if (auto v = args.Get("cache")) return *v;
  if (auto v = args.Get("name")) return *v;
  return absl::InvalidArgumentError("--cache is required");
}

absl::StatusOr<std::vector<int32_t>> GetPositions(const Args& args, absl::string_view name) {
  ASSIGN_OR_RETURN(std::string text, args.GetString(name));
  auto positions = ParsePositions(text);
  if (!positions.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, ": ", positions.status().message()));
  }
  return positions;
}

absl::StatusOr<int32_t> GetInt32(const Args& args, absl::string_view name,
                                 std::optional<int64_t> fallback) {
  ASSIGN_OR_RETURN(int64_t v, args.GetInt(name, fallback));
  if (v < INT32_MIN || v > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, "=", v, " is out of int32 range"));
  }
  return static_cast<int32_t>(v);
}

absl::StatusOr<uint64_t> GetSnapshotId(const Args& args, absl::string_view name) {
  ASSIGN_OR_RETURN(int64_t id, args.GetInt(name));
  if (id <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", name, "=", id, " is not a snapshot id (> 0)"));
  }
  return static_cast<uint64_t>(id);
}

}  // namespace ctl
}  // namespace kvmesh

#include "service/common/client_channel.h"

#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cache/status_macros.h"
#include "grpc/grpc_security_constants.h"
#include "grpcpp/create_channel.h"

namespace kvmesh {
namespace {

bool IsTokenChar(char c) { return c > 0x20 && c < 0x7f; }

// Adds fixed metadata to every call. Not blocking: GetMetadata only copies strings, so gRPC may
// call it inline instead of on a thread of its own.
class FixedMetadataPlugin : public grpc::MetadataCredentialsPlugin {
 public:
  explicit FixedMetadataPlugin(std::multimap<grpc::string, grpc::string> metadata)
      : metadata_(std::move(metadata)) {}

  bool IsBlocking() const override { return false; }
  const char* GetType() const override { return "kvmesh-bearer-token"; }

  grpc::Status GetMetadata(grpc::string_ref /*service_url*/, grpc::string_ref /*method_name*/,
                           const grpc::AuthContext& /*channel_auth_context*/,
                           std::multimap<grpc::string, grpc::string>* metadata) override {
    metadata->insert(metadata_.begin(), metadata_.end());
    return grpc::Status::OK;
  }

  grpc::string DebugString() override { return "kvmesh bearer token (value not shown)"; }

 private:
  const std::multimap<grpc::string, grpc::string> metadata_;
};

}  // namespace

absl::Status ValidateBearerToken(absl::string_view token, absl::string_view what) {
  if (token.empty()) return absl::InvalidArgumentError(absl::StrCat(what, " is empty"));
  for (size_t i = 0; i < token.size(); ++i) {
    if (!IsTokenChar(token[i])) {
      return absl::InvalidArgumentError(absl::StrCat(
          what,
          ": the token has a space or a character outside printable ASCII "
          "(byte ",
          static_cast<int>(static_cast<unsigned char>(token[i])), " at offset ", i, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateTenantMetadata(absl::string_view tenant) {
  if (tenant.empty()) return absl::InvalidArgumentError("--tenant is empty");
  for (char c : tenant) {
    if (!IsTokenChar(c)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--tenant='", tenant.substr(0, 32), tenant.size() > 32 ? "...'" : "'",
                       " has a space or a character outside printable ASCII"));
    }
  }
  return absl::OkStatus();
}

std::shared_ptr<grpc::CallCredentials> TokenCallCredentials(const std::string& token,
                                                            const std::string& tenant) {
  if (token.empty() && tenant.empty()) return nullptr;
  std::multimap<grpc::string, grpc::string> metadata;
  if (!token.empty()) metadata.emplace(kAuthorizationMetadataKey, absl::StrCat("Bearer ", token));
  if (!tenant.empty()) metadata.emplace(kTenantMetadataKey, tenant);
  // GRPC_SECURITY_NONE: also over plaintext (by default gRPC drops call credentials on insecure
  // channels). Whether a node accepts a token over plaintext is the node's decision.
  return grpc::experimental::MetadataCredentialsFromPlugin(
      std::make_unique<FixedMetadataPlugin>(std::move(metadata)), GRPC_SECURITY_NONE);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ClientCredentials(
    const ClientConnectionOptions& options, absl::string_view flag_prefix) {
  if (!options.token.empty())
    RETURN_IF_ERROR(ValidateBearerToken(options.token, "the bearer token"));
  if (!options.tenant.empty()) RETURN_IF_ERROR(ValidateTenantMetadata(options.tenant));
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> channel,
                   ClientChannelCredentials(options.tls, flag_prefix));
  std::shared_ptr<grpc::CallCredentials> call = TokenCallCredentials(options.token, options.tenant);
  if (call == nullptr) return channel;
  return grpc::CompositeChannelCredentials(channel, call);
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> NewClientChannel(
    const std::string& target, const ClientConnectionOptions& options, grpc::ChannelArguments args,
    absl::string_view flag_prefix) {
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials,
                   ClientCredentials(options, flag_prefix));
  AddClientTlsChannelArgs(options.tls, &args);
  return grpc::CreateCustomChannel(target, credentials, args);
}

}  // namespace kvmesh

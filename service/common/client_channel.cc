#include "service/common/client_channel.h"

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache/status_macros.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/support/client_interceptor.h"

namespace kvmesh {
namespace {

bool IsTokenChar(char c) { return c > 0x20 && c < 0x7f; }

// Adds the token and tenant to the initial metadata of every call. The interceptor lives as long
// as its call; the strings are copied into the call's metadata.
class MetadataInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit MetadataInterceptor(const std::vector<std::pair<std::string, std::string>>* metadata)
      : metadata_(metadata) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      std::multimap<std::string, std::string>* sent = methods->GetSendInitialMetadata();
      for (const auto& [key, value] : *metadata_) sent->emplace(key, value);
    }
    methods->Proceed();
  }

 private:
  const std::vector<std::pair<std::string, std::string>>* const metadata_;
};

class MetadataInterceptorFactory : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit MetadataInterceptorFactory(std::vector<std::pair<std::string, std::string>> metadata)
      : metadata_(std::move(metadata)) {}

  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo* /*info*/) override {
    return new MetadataInterceptor(&metadata_);
  }

 private:
  // Owned by the factory, which the channel keeps as long as it has calls.
  const std::vector<std::pair<std::string, std::string>> metadata_;
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

absl::StatusOr<ClientConnector> ClientConnector::Create(const ClientConnectionOptions& options,
                                                        absl::string_view flag_prefix) {
  if (!options.token.empty()) {
    RETURN_IF_ERROR(ValidateBearerToken(options.token, "the bearer token"));
  }
  if (!options.tenant.empty()) RETURN_IF_ERROR(ValidateTenantMetadata(options.tenant));
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials,
                   ClientChannelCredentials(options.tls, flag_prefix));
  return ClientConnector(options, std::move(credentials));
}

std::shared_ptr<grpc::Channel> ClientConnector::NewChannel(const std::string& target,
                                                           grpc::ChannelArguments args) const {
  AddClientTlsChannelArgs(options_.tls, &args);
  std::vector<std::pair<std::string, std::string>> metadata;
  if (!options_.token.empty()) {
    metadata.emplace_back(kAuthorizationMetadataKey, absl::StrCat("Bearer ", options_.token));
  }
  if (!options_.tenant.empty()) metadata.emplace_back(kTenantMetadataKey, options_.tenant);
  if (metadata.empty()) return grpc::CreateCustomChannel(target, credentials_, args);
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(std::make_unique<MetadataInterceptorFactory>(std::move(metadata)));
  return grpc::experimental::CreateCustomChannelWithInterceptors(target, credentials_, args,
                                                                 std::move(interceptors));
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> NewClientChannel(
    const std::string& target, const ClientConnectionOptions& options, grpc::ChannelArguments args,
    absl::string_view flag_prefix) {
  ASSIGN_OR_RETURN(ClientConnector connector, ClientConnector::Create(options, flag_prefix));
  return connector.NewChannel(target, std::move(args));
}

}  // namespace kvmesh

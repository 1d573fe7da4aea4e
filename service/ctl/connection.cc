#include "service/ctl/connection.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "cache/status_macros.h"

namespace kvmesh {
namespace ctl {
namespace {

// The value of a flag that must not be empty when given; nullopt when absent.
absl::StatusOr<std::optional<std::string>> NonEmpty(const Args& args, absl::string_view name) {
  std::optional<std::string> value = args.Get(name);
  if (value.has_value() && value->empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, " is empty"));
  }
  return value;
}

}  // namespace

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  const std::string where = absl::StrCat("--token-file '", path, "'");
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read ", where, ": ", std::strerror(errno)));
  }
  std::string content((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return absl::InvalidArgumentError(absl::StrCat("cannot read ", where));
  const absl::string_view token = absl::StripAsciiWhitespace(content);
  if (token.empty()) return absl::InvalidArgumentError(absl::StrCat(where, " is empty"));
  for (char c : token) {
    if (absl::ascii_isspace(static_cast<unsigned char>(c))) {
      return absl::InvalidArgumentError(
          absl::StrCat(where,
                       " holds more than one word: it must hold only the bearer token (the node's "
                       "--token-file holds hashes of tokens, not tokens)"));
    }
  }
  RETURN_IF_ERROR(ValidateBearerToken(token, where));
  return std::string(token);
}

absl::StatusOr<ClientConnectionOptions> ConnectionFromArgs(const Args& args,
                                                           const char* env_token) {
  ClientConnectionOptions options;
  struct TlsFlag {
    absl::string_view name;
    std::string* field;
  };
  for (const TlsFlag& flag :
       {TlsFlag{"tls-ca", &options.tls.ca_file}, TlsFlag{"tls-cert", &options.tls.cert_file},
        TlsFlag{"tls-key", &options.tls.key_file},
        TlsFlag{"tls-server-name", &options.tls.server_name}}) {
    ASSIGN_OR_RETURN(std::optional<std::string> value, NonEmpty(args, flag.name));
    if (value.has_value()) *flag.field = *std::move(value);
  }
  if (options.tls.cert_file.empty() != options.tls.key_file.empty()) {
    return absl::InvalidArgumentError(options.tls.cert_file.empty()
                                          ? "--tls-key is set but --tls-cert is not: give both"
                                          : "--tls-cert is set but --tls-key is not: give both");
  }
  ASSIGN_OR_RETURN(std::optional<std::string> token_file, NonEmpty(args, "token-file"));
  if (token_file.has_value()) {
    ASSIGN_OR_RETURN(options.token, ReadTokenFile(*token_file));
  } else if (env_token != nullptr && env_token[0] != '\0') {
    const absl::string_view token = absl::StripAsciiWhitespace(env_token);
    RETURN_IF_ERROR(ValidateBearerToken(token, kTokenEnv));
    options.token = std::string(token);
  }
  ASSIGN_OR_RETURN(std::optional<std::string> tenant, NonEmpty(args, "tenant"));
  if (tenant.has_value()) {
    RETURN_IF_ERROR(ValidateTenantMetadata(*tenant));
    options.tenant = *std::move(tenant);
  }
  return options;
}

}  // namespace ctl
}  // namespace kvmesh

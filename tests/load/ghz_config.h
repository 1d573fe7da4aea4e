// The check of the ghz load-test configurations of deploy/load/ (docs/load.md): that each one
// would work against a real kvmesh-node, without running ghz.
//
//  - LoadGhzConfig parses a ghz JSON config file (ghz's JSON config format, ghz.sh/docs/options)
//    with nlohmann-json, strictly (RFC 8259, as Go's encoding/json that ghz uses; a key given
//    twice is refused too), and checks its options: every key is one ghz knows (ghz ignores
//    unknown keys silently, so a typo would change the test unnoticed), "call" names a method,
//    "data" is an object or a non-empty array of objects, durations are Go durations, counts
//    are non-negative integers, and the configs rely on server reflection (no "proto" or
//    "protoset").
//  - RenderCallTemplate renders the ghz call-data template actions the configs use, with sample
//    values: {{.RequestNumber}} and sprig's {{repeat N `s`}}. Any other action is an error, so
//    a config that starts using one makes the check fail until the renderer knows it.
//  - GhzConfigChecker resolves the call through the node's server reflection
//    (grpc.reflection.v1alpha: list the services, fetch the file descriptors, find the method),
//    parses each rendered data object as the request message with protobuf's JSON parser
//    (strict: an unknown field is an error, as in ghz), and makes the call once per data object
//    with grpc::GenericStub; it must succeed.
//
// Thread safety: a GhzConfigChecker is used by one thread at a time; the free functions are
// thread-safe.
#ifndef KVMESH_TESTS_LOAD_GHZ_CONFIG_H_
#define KVMESH_TESTS_LOAD_GHZ_CONFIG_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/descriptor_database.h"
#include "google/protobuf/dynamic_message.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace kvmesh {
namespace loadtest {

// One ghz config file, parsed.
struct GhzConfig {
  std::string path;
  std::string call;     // as written: "package.Service.Method" or "package.Service/Method"
  std::string service;  // fully-qualified
  std::string method;
  // The data objects as JSON text, template actions unrendered: one for an object, one per
  // element for an array (ghz sends element RequestNumber % size to a unary method).
  std::vector<std::string> data;
  std::map<std::string, std::string> metadata;  // template actions unrendered
};

// Parses and checks `path` (see the file comment). INVALID_ARGUMENT naming the file and what is
// wrong; NOT_FOUND when it cannot be read.
absl::StatusOr<GhzConfig> LoadGhzConfig(const std::string& path);

// `text` with ghz's template actions rendered: {{.RequestNumber}} becomes `request_number`,
// {{repeat N `s`}} (or "s") becomes s repeated N times. INVALID_ARGUMENT for any other action
// or an unterminated one.
absl::StatusOr<std::string> RenderCallTemplate(absl::string_view text, int64_t request_number);

class GhzConfigChecker {
 public:
  explicit GhzConfigChecker(std::shared_ptr<grpc::Channel> channel);

  // Resolves, parses and calls as described above. Each call renders the templates with the
  // next sample RequestNumber (0, 1, 2, ... over the checker's life), so configs that append
  // at {{.RequestNumber}} do not collide. The error names the config, the stage (call, data,
  // metadata or the call's status) and the reason.
  absl::Status Check(const GhzConfig& config);

  // The services the node lists through reflection (cached after the first call).
  absl::StatusOr<std::vector<std::string>> ListServices();

  // The method `service`.`method`, resolved through reflection.
  absl::StatusOr<const google::protobuf::MethodDescriptor*> ResolveMethod(
      const std::string& service, const std::string& method);

 private:
  absl::StatusOr<::grpc::reflection::v1alpha::ServerReflectionResponse> Ask(
      const ::grpc::reflection::v1alpha::ServerReflectionRequest& request);
  // Adds the files of `response` (and, through file_by_filename, the files they import that
  // the server did not send) to database_.
  absl::Status AddFiles(const ::grpc::reflection::v1alpha::ServerReflectionResponse& response);

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<::grpc::reflection::v1alpha::ServerReflection::Stub> reflection_;
  std::vector<std::string> services_;
  bool listed_ = false;
  google::protobuf::SimpleDescriptorDatabase database_;
  std::map<std::string, bool> have_files_;
  google::protobuf::DescriptorPool pool_;  // over database_
  google::protobuf::DynamicMessageFactory factory_;
  int64_t next_request_number_ = 0;
};

}  // namespace loadtest
}  // namespace kvmesh

#endif  // KVMESH_TESTS_LOAD_GHZ_CONFIG_H_

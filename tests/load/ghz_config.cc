#include "tests/load/ghz_config.h"

#include <algorithm>
#include <chrono>
#include <fstream>
#include <future>
#include <set>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/descriptor.pb.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/generic/generic_stub.h"
#include "nlohmann/json.hpp"

namespace kvmesh {
namespace loadtest {
namespace {

namespace pb = ::google::protobuf;
namespace rpb = ::grpc::reflection::v1alpha;
using Json = nlohmann::json;

constexpr auto kCallTimeout = std::chrono::seconds(30);

// The keys of ghz's JSON config (runner.Config in github.com/bojand/ghz, the fields' json
// tags; ghz.sh/docs/options). ghz ignores any other key without a word.
// clang-format off
const std::set<std::string>& KnownOptions() {
  static const auto* known = new std::set<std::string>{
      "proto", "protoset", "call", "cacert", "cert", "key", "skipTLS", "skipFirst", "cname",
      "authority", "insecure", "total", "async", "concurrency", "concurrency-schedule",
      "concurrency-start", "concurrency-end", "concurrency-step", "concurrency-step-duration",
      "concurrency-max-duration", "connections", "rps", "duration", "duration-stop",
      "max-duration", "timeout", "data", "data-file", "binary-file", "metadata",
      "metadata-file", "stream-interval", "stream-call-duration", "stream-call-count",
      "stream-dynamic-messages", "output", "format", "connect-timeout", "keepalive", "cpus",
      "import-paths", "name", "tags", "reflect-metadata", "debug", "host",
      "enable-compression", "load-schedule", "load-start", "load-end", "load-step",
      "load-step-duration", "load-max-duration", "lb-strategy", "max-recv-message-size",
      "max-send-message-size", "disable-template-functions", "disable-template-data",
      "count-errors"};
  return *known;
}
// clang-format on

// Options whose value is a Go duration string ("10s", "1m30s", "500ms").
// clang-format off
const std::set<std::string>& DurationOptions() {
  static const auto* durations = new std::set<std::string>{
      "duration", "max-duration", "timeout", "connect-timeout", "keepalive", "stream-interval",
      "stream-call-duration", "concurrency-step-duration", "concurrency-max-duration",
      "load-step-duration", "load-max-duration"};
  return *durations;
}

// Options whose value is a non-negative integer.
const std::set<std::string>& CountOptions() {
  static const auto* counts = new std::set<std::string>{
      "total", "concurrency", "connections", "rps", "skipFirst", "cpus", "concurrency-start",
      "concurrency-end", "load-start", "load-end", "stream-call-count"};
  return *counts;
}
// clang-format on

// Go's time.ParseDuration: an optional sign, then one or more decimal numbers each with a unit
// (ns, us, µs, ms, s, m, h); "0" alone is allowed.
bool IsGoDuration(absl::string_view s) {
  if (!s.empty() && (s[0] == '+' || s[0] == '-')) s.remove_prefix(1);
  if (s == "0") return true;
  if (s.empty()) return false;
  while (!s.empty()) {
    size_t digits = 0;
    bool dot = false;
    while (digits < s.size() && (absl::ascii_isdigit(s[digits]) || (s[digits] == '.' && !dot))) {
      dot = dot || s[digits] == '.';
      ++digits;
    }
    if (digits == 0 || s.substr(0, digits) == ".") return false;
    s.remove_prefix(digits);
    bool matched = false;
    for (absl::string_view unit : {"ns", "us", "\xC2\xB5s", "ms", "s", "m", "h"}) {
      if (absl::StartsWith(s, unit)) {
        // "ms" before "m" and "s": the list is ordered so that the longer unit wins.
        s.remove_prefix(unit.size());
        matched = true;
        break;
      }
    }
    if (!matched) return false;
  }
  return true;
}

absl::Status Invalid(const std::string& path, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", what));
}

// The prefix of `s` up to `n` characters, for error messages that quote big payloads.
std::string Quote(absl::string_view s, size_t n = 80) {
  if (s.size() <= n) return std::string(s);
  return absl::StrCat(s.substr(0, n), "... (", s.size(), " characters)");
}

std::string StatusText(const grpc::Status& s) {
  return absl::StrCat(absl::StatusCodeToString(static_cast<absl::StatusCode>(s.error_code())), ": ",
                      s.error_message());
}

}  // namespace

absl::StatusOr<GhzConfig> LoadGhzConfig(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot be read"));
  std::stringstream text;
  text << in.rdbuf();

  // Strict RFC 8259 (no comments, no trailing commas), as Go's encoding/json that ghz reads
  // the file with; a key given twice in one object is refused too (ghz would keep the last).
  std::vector<std::set<std::string>> keys;
  std::string duplicate;
  const Json::parser_callback_t track = [&](int, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
        keys.emplace_back();
        break;
      case Json::parse_event_t::object_end:
        keys.pop_back();
        break;
      case Json::parse_event_t::key:
        if (!keys.back().insert(parsed.get<std::string>()).second && duplicate.empty()) {
          duplicate = parsed.get<std::string>();
        }
        break;
      default:
        break;
    }
    return true;
  };
  Json root;
  try {
    root = Json::parse(text.str(), track);
  } catch (const Json::parse_error& e) {
    return Invalid(path, absl::StrCat("not valid JSON: ", e.what()));
  }
  if (!duplicate.empty()) {
    return Invalid(path, absl::StrCat("the key \"", duplicate, "\" appears twice in one object"));
  }
  if (!root.is_object()) return Invalid(path, "not a JSON object");

  GhzConfig config;
  config.path = path;
  for (const auto& [key, value] : root.items()) {
    if (KnownOptions().count(key) == 0) {
      return Invalid(path, absl::StrCat("unknown ghz option \"", key,
                                        "\" (ghz would ignore it without a word)"));
    }
    if (DurationOptions().count(key) != 0 &&
        (!value.is_string() || !IsGoDuration(value.get<std::string>()))) {
      return Invalid(path,
                     absl::StrCat("\"", key, "\" must be a Go duration such as \"10s\"; it is ",
                                  Quote(value.dump())));
    }
    if (CountOptions().count(key) != 0 && !value.is_number_unsigned()) {
      return Invalid(path, absl::StrCat("\"", key, "\" must be a non-negative integer; it is ",
                                        Quote(value.dump())));
    }
  }
  for (const char* key : {"proto", "protoset", "import-paths"}) {
    if (root.contains(key)) {
      return Invalid(path, absl::StrCat("\"", key,
                                        "\": the configs use the node's server reflection, not "
                                        ".proto files"));
    }
  }
  for (const char* key : {"data-file", "binary-file"}) {
    if (root.contains(key)) {
      return Invalid(path,
                     absl::StrCat("\"", key, "\": this check validates inline \"data\" only"));
    }
  }
  if (!root.contains("insecure") || root["insecure"] != Json(true)) {
    return Invalid(path,
                   "\"insecure\": true is required (kvmesh-node without --tls-cert speaks "
                   "plaintext; ghz tries TLS otherwise)");
  }
  auto count = [&](const char* key, int64_t absent) -> int64_t {
    return root.contains(key) ? root[key].get<int64_t>() : absent;
  };
  const int64_t concurrency = count("concurrency", 50);  // ghz's defaults
  const int64_t connections = count("connections", 1);
  if (connections > concurrency) {
    return Invalid(
        path, absl::StrCat("\"connections\" (", connections, ") may not exceed \"concurrency\" (",
                           concurrency, "): ghz refuses it"));
  }
  if (!root.contains("duration") && count("skipFirst", 0) > count("total", 200)) {
    return Invalid(path, "\"skipFirst\" exceeds \"total\": ghz refuses it");
  }

  if (!root.contains("call") || !root["call"].is_string()) {
    return Invalid(path, "\"call\" (a string, package.Service.Method) is required");
  }
  config.call = root["call"].get<std::string>();
  const size_t cut =
      config.call.find('/') != std::string::npos ? config.call.rfind('/') : config.call.rfind('.');
  if (cut == std::string::npos || cut == 0 || cut + 1 == config.call.size()) {
    return Invalid(path,
                   absl::StrCat("\"call\": \"", config.call,
                                "\" is not package.Service.Method or package.Service/Method"));
  }
  config.service = config.call.substr(0, cut);
  config.method = config.call.substr(cut + 1);

  if (!root.contains("data")) return Invalid(path, "\"data\" is required");
  const Json& data = root["data"];
  if (data.is_object()) {
    config.data.push_back(data.dump());
  } else if (data.is_array() && !data.empty()) {
    for (const Json& element : data) {
      if (!element.is_object()) {
        return Invalid(path, absl::StrCat("\"data\": an array element is ", element.type_name(),
                                          ", not an object"));
      }
      config.data.push_back(element.dump());
    }
  } else {
    return Invalid(path, absl::StrCat("\"data\" must be an object or a non-empty array of "
                                      "objects; it is ",
                                      Quote(data.dump())));
  }

  if (root.contains("metadata")) {
    const Json& metadata = root["metadata"];
    if (!metadata.is_object()) return Invalid(path, "\"metadata\" must be an object of strings");
    for (const auto& [key, value] : metadata.items()) {
      if (!value.is_string()) {
        return Invalid(path, absl::StrCat("\"metadata\": \"", key, "\" is not a string"));
      }
      config.metadata[key] = value.get<std::string>();
    }
  }
  return config;
}

absl::StatusOr<std::string> RenderCallTemplate(absl::string_view text, int64_t request_number) {
  std::string out;
  out.reserve(text.size());
  while (!text.empty()) {
    const size_t open = text.find("{{");
    if (open == absl::string_view::npos) {
      out.append(text.data(), text.size());
      break;
    }
    out.append(text.data(), open);
    const size_t close = text.find("}}", open + 2);
    if (close == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("unterminated template action: ", Quote(text.substr(open), 40)));
    }
    const absl::string_view action =
        absl::StripAsciiWhitespace(text.substr(open + 2, close - open - 2));
    text.remove_prefix(close + 2);
    if (action == ".RequestNumber") {
      absl::StrAppend(&out, request_number);
      continue;
    }
    // repeat N `s` | repeat N "s" (sprig). Inside the JSON text a "..." argument would be
    // escaped (\"), which Go's template parser rejects: the configs use backquotes.
    if (absl::StartsWith(action, "repeat ")) {
      absl::string_view rest = absl::StripLeadingAsciiWhitespace(action.substr(7));
      const size_t space = rest.find(' ');
      int64_t n = 0;
      if (space != absl::string_view::npos && absl::SimpleAtoi(rest.substr(0, space), &n) &&
          n >= 0 && n <= (int64_t{1} << 30)) {
        const absl::string_view arg = absl::StripAsciiWhitespace(rest.substr(space + 1));
        if (arg.size() >= 2 && ((arg.front() == '`' && arg.back() == '`') ||
                                (arg.front() == '"' && arg.back() == '"'))) {
          const absl::string_view s = arg.substr(1, arg.size() - 2);
          if (s.find_first_of("`\"\\") == absl::string_view::npos) {
            out.reserve(out.size() + s.size() * static_cast<size_t>(n));
            for (int64_t i = 0; i < n; ++i) out.append(s.data(), s.size());
            continue;
          }
        }
      }
    }
    return absl::InvalidArgumentError(
        absl::StrCat("unsupported template action {{", Quote(action, 40),
                     "}}: the check renders {{.RequestNumber}} and {{repeat N `s`}} only (extend "
                     "RenderCallTemplate in tests/load/ghz_config.cc for another)"));
  }
  return out;
}

GhzConfigChecker::GhzConfigChecker(std::shared_ptr<grpc::Channel> channel)
    : channel_(std::move(channel)),
      reflection_(rpb::ServerReflection::NewStub(channel_)),
      pool_(&database_) {}

absl::StatusOr<rpb::ServerReflectionResponse> GhzConfigChecker::Ask(
    const rpb::ServerReflectionRequest& request) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + kCallTimeout);
  std::unique_ptr<
      grpc::ClientReaderWriter<rpb::ServerReflectionRequest, rpb::ServerReflectionResponse>>
      stream = reflection_->ServerReflectionInfo(&context);
  rpb::ServerReflectionResponse response;
  const bool sent = stream->Write(request);
  if (sent) stream->WritesDone();
  const bool got = sent && stream->Read(&response);
  const grpc::Status status = stream->Finish();
  if (!status.ok()) {
    return absl::UnavailableError(
        absl::StrCat("server reflection (grpc.reflection.v1alpha) failed: ", StatusText(status)));
  }
  if (!got) return absl::UnavailableError("server reflection sent no response");
  if (response.has_error_response()) {
    return absl::Status(
        static_cast<absl::StatusCode>(response.error_response().error_code()),
        absl::StrCat("server reflection: ", response.error_response().error_message()));
  }
  return response;
}

absl::StatusOr<std::vector<std::string>> GhzConfigChecker::ListServices() {
  if (listed_) return services_;
  rpb::ServerReflectionRequest request;
  request.set_list_services("*");
  absl::StatusOr<rpb::ServerReflectionResponse> response = Ask(request);
  if (!response.ok()) return response.status();
  if (!response->has_list_services_response()) {
    return absl::InternalError("server reflection answered list_services with something else");
  }
  services_.clear();
  for (const rpb::ServiceResponse& s : response->list_services_response().service()) {
    services_.push_back(s.name());
  }
  std::sort(services_.begin(), services_.end());
  listed_ = true;
  return services_;
}

absl::Status GhzConfigChecker::AddFiles(const rpb::ServerReflectionResponse& response) {
  if (!response.has_file_descriptor_response()) {
    return absl::InternalError("server reflection answered a file request with something else");
  }
  std::vector<std::string> imports;
  for (const std::string& bytes : response.file_descriptor_response().file_descriptor_proto()) {
    pb::FileDescriptorProto file;
    if (!file.ParseFromString(bytes)) {
      return absl::InternalError(
          "server reflection sent a FileDescriptorProto that does not parse");
    }
    if (have_files_[file.name()]) continue;
    have_files_[file.name()] = true;
    for (const std::string& dependency : file.dependency()) imports.push_back(dependency);
    if (!database_.Add(file)) {
      return absl::InternalError(absl::StrCat("file ", file.name(), " conflicts with another"));
    }
  }
  // The files they import, when the server did not send them along.
  for (const std::string& name : imports) {
    if (have_files_[name]) continue;
    rpb::ServerReflectionRequest request;
    request.set_file_by_filename(name);
    absl::StatusOr<rpb::ServerReflectionResponse> more = Ask(request);
    if (!more.ok()) return more.status();
    if (absl::Status s = AddFiles(*more); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<const pb::MethodDescriptor*> GhzConfigChecker::ResolveMethod(
    const std::string& service, const std::string& method) {
  absl::StatusOr<std::vector<std::string>> services = ListServices();
  if (!services.ok()) return services.status();
  if (std::find(services->begin(), services->end(), service) == services->end()) {
    return absl::NotFoundError(absl::StrCat(
        "service ", service,
        " is not served (server reflection lists: ", absl::StrJoin(*services, ", "), ")"));
  }
  const pb::ServiceDescriptor* descriptor = pool_.FindServiceByName(service);
  if (descriptor == nullptr) {
    rpb::ServerReflectionRequest request;
    request.set_file_containing_symbol(service);
    absl::StatusOr<rpb::ServerReflectionResponse> response = Ask(request);
    if (!response.ok()) return response.status();
    if (absl::Status s = AddFiles(*response); !s.ok()) return s;
    descriptor = pool_.FindServiceByName(service);
  }
  if (descriptor == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("service ", service, " is listed, but its file descriptors do not define it"));
  }
  const pb::MethodDescriptor* found = descriptor->FindMethodByName(method);
  if (found == nullptr) {
    std::vector<std::string> methods;
    for (int i = 0; i < descriptor->method_count(); ++i) {
      methods.push_back(descriptor->method(i)->name());
    }
    return absl::NotFoundError(absl::StrCat("service ", service, " has no method '", method,
                                            "' (its methods: ", absl::StrJoin(methods, ", "), ")"));
  }
  return found;
}

absl::Status GhzConfigChecker::Check(const GhzConfig& config) {
  auto fail = [&](absl::string_view stage, const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat(config.path, ": ", stage, ": ", s.message()));
  };
  absl::StatusOr<const pb::MethodDescriptor*> method = ResolveMethod(config.service, config.method);
  if (!method.ok()) return fail(absl::StrCat("call \"", config.call, "\""), method.status());
  if ((*method)->client_streaming() || (*method)->server_streaming()) {
    return fail(absl::StrCat("call \"", config.call, "\""),
                absl::UnimplementedError("a streaming method: this check makes unary calls only"));
  }
  const std::string path =
      absl::StrCat("/", (*method)->service()->full_name(), "/", (*method)->name());
  grpc::GenericStub stub(channel_);
  for (size_t i = 0; i < config.data.size(); ++i) {
    const int64_t request_number = next_request_number_++;
    const std::string stage =
        config.data.size() == 1
            ? absl::StrCat("data (RequestNumber ", request_number, ")")
            : absl::StrCat("data[", i, "] (RequestNumber ", request_number, ")");
    absl::StatusOr<std::string> json = RenderCallTemplate(config.data[i], request_number);
    if (!json.ok()) return fail(stage, json.status());
    std::unique_ptr<pb::Message> request(factory_.GetPrototype((*method)->input_type())->New());
    pb::util::JsonParseOptions strict;
    strict.ignore_unknown_fields = false;
    const pb::util::Status parsed = pb::util::JsonStringToMessage(*json, request.get(), strict);
    if (!parsed.ok()) {
      return fail(stage,
                  absl::InvalidArgumentError(absl::StrCat(
                      "does not parse as ", (*method)->input_type()->full_name(), ": ",
                      std::string(parsed.message()), " (rendered: ", Quote(*json, 200), ")")));
    }

    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + kCallTimeout);
    for (const auto& [key, value] : config.metadata) {
      absl::StatusOr<std::string> rendered = RenderCallTemplate(value, request_number);
      if (!rendered.ok()) return fail(absl::StrCat("metadata \"", key, "\""), rendered.status());
      context.AddMetadata(absl::AsciiStrToLower(key), *rendered);
    }
    const std::string bytes = request->SerializeAsString();
    grpc::Slice slice(bytes);
    grpc::ByteBuffer send(&slice, 1);
    grpc::ByteBuffer receive;
    std::promise<grpc::Status> done;
    stub.UnaryCall(&context, path, grpc::StubOptions(), &send, &receive,
                   [&done](grpc::Status s) { done.set_value(std::move(s)); });
    const grpc::Status status = done.get_future().get();
    if (!status.ok()) {
      return fail(stage,
                  absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                               absl::StrCat("the call ", path, " failed: ", StatusText(status))));
    }
    std::vector<grpc::Slice> slices;
    std::string reply;
    if (receive.Dump(&slices).ok()) {
      for (const grpc::Slice& s : slices) {
        reply.append(reinterpret_cast<const char*>(s.begin()), s.size());
      }
    }
    std::unique_ptr<pb::Message> response(factory_.GetPrototype((*method)->output_type())->New());
    if (!response->ParseFromString(reply)) {
      return fail(stage,
                  absl::InternalError(absl::StrCat("the reply of ", path, " does not parse as ",
                                                   (*method)->output_type()->full_name())));
    }
  }
  return absl::OkStatus();
}

}  // namespace loadtest
}  // namespace kvmesh

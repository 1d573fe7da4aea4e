// ghz_config_check: the check of ghz_configs_test against a node that is already running and
// prepared (deploy/load/prepare.sh), for run.sh and by hand (docs/load.md):
//
//   ghz_config_check [--addr=HOST:PORT] CONFIG.json...
//
// For each config: it parses as a ghz config, its call resolves through the node's server
// reflection, its data (templates rendered, RequestNumber 0, 1, 2, ... over the run) parses
// strictly as the request message, and one call per data object succeeds. Prints one line per
// config; exit status 1 when any fails, 2 for a bad command line. A node with tokens:
// $KVMESH_TOKEN is sent as the bearer token.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "service/common/client_channel.h"
#include "tests/load/ghz_config.h"

int main(int argc, char** argv) {
  std::string addr = "127.0.0.1:7700";
  std::vector<std::string> files;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (absl::StartsWith(arg, "--addr=")) {
      addr = arg.substr(7);
    } else if (arg == "-h" || arg == "--help") {
      std::printf("usage: ghz_config_check [--addr=HOST:PORT] CONFIG.json...\n");
      return 0;
    } else if (absl::StartsWith(arg, "-")) {
      std::fprintf(stderr, "ghz_config_check: unknown flag '%s' (--help)\n", arg.c_str());
      return 2;
    } else {
      files.push_back(arg);
    }
  }
  if (files.empty()) {
    std::fprintf(stderr, "ghz_config_check: no config given (--help)\n");
    return 2;
  }
  kvmesh::ClientConnectionOptions connection;
  if (const char* token = std::getenv("KVMESH_TOKEN"); token != nullptr && *token != '\0') {
    connection.token = token;
  }
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
      kvmesh::NewClientChannel(addr, connection);
  if (!channel.ok()) {
    std::fprintf(stderr, "ghz_config_check: %s\n", channel.status().ToString().c_str());
    return 2;
  }
  kvmesh::loadtest::GhzConfigChecker checker(*channel);
  int failed = 0;
  for (const std::string& file : files) {
    absl::StatusOr<kvmesh::loadtest::GhzConfig> config = kvmesh::loadtest::LoadGhzConfig(file);
    absl::Status status = config.status();
    if (config.ok()) status = checker.Check(*config);
    if (status.ok()) {
      std::printf("ok      %s (%s)\n", file.c_str(), config->call.c_str());
    } else {
      ++failed;
      std::printf("FAILED  %s\n", std::string(status.message()).c_str());
    }
  }
  return failed == 0 ? 0 : 1;
}

// kvmeshctl: calls every RPC of kvmesh.v1.CacheService (and grpc.health.v1.Health/Check) from
// the shell, cluster operations included (list-members, cross-node copy-prefix, migrate,
// migrate-snapshot, cluster-wide remove), with readable output or protobuf JSON (--json).
// `kvmeshctl help` prints the usage; `kvmeshctl COMMAND --help` the entry of one command.
//
// This file holds the global usage, the table of commands and the dispatch; the commands live
// one file per group (commands.h lists them) over the shared Client (client.h).
//
// Exit status: 0 on success; 1 when an RPC fails (stderr: "error: <CODE>: <message>", then
// "shortage: <ShortageLine>" when a RESOURCE_EXHAUSTED carried numbers), when a local step fails (a
// file, a payload that does not verify: DATA_LOSS), or a flag has a bad value; 2 for an unknown
// command or flag.
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "cache/shortage.h"
#include "grpcpp/grpcpp.h"
#include "service/ctl/args.h"
#include "service/ctl/client.h"
#include "service/ctl/commands.h"
#include "service/ctl/connection.h"
#include "service/ctl/format.h"

namespace kvmesh {
namespace ctl {
namespace {

constexpr char kDefaultAddr[] = "127.0.0.1:7700";
constexpr absl::Duration kDefaultTimeout = absl::Seconds(30);

constexpr absl::string_view kBoolFlags[] = {"json",        "stream",      "help",  "non-causal",
                                            "speculative", "keep-source", "resume", "verify",
                                            "pin"};
constexpr absl::string_view kGlobalFlags[] = {"addr", "timeout", "json", "help"};

// The commands in the order `kvmeshctl help` lists them: those of one cache or the node, then
// the cluster commands.
const Command* const kCommands[] = {
    &kCreateCommand,
    &kDeleteCommand,
    &kGetCommand,
    &kListCommand,
    &kUsageCommand,
    &kAppendCommand,
    &kReadCommand,
    &kVisibleCommand,
    &kCopyPrefixCommand,
    &kRemoveCommand,
    &kCanResumeCommand,
    &kReserveCommand,
    &kSetRetentionCommand,
    &kListSequencesCommand,
    &kLookupPrefixCommand,
    &kWatchEventsCommand,
    &kSnapshotCommand,
    &kRestoreCommand,
    &kMergeSnapshotsCommand,
    &kSplitSnapshotCommand,
    &kDropSnapshotCommand,
    &kListSnapshotsCommand,
    &kCommitSpeculationCommand,
    &kHealthCommand,
};
const Command* const kClusterCommands[] = {
    &kListMembersCommand,
    &kMigrateCommand,
    &kMigrateSnapshotCommand,
    &kDrainCommand,
};

constexpr absl::string_view kUsageLine =
    "usage: kvmeshctl [--addr=HOST:PORT] [--timeout=DURATION] [--json] [--tls-ca=FILE ...]\n"
    "                 [--token-file=FILE] [--tenant=NAME] COMMAND [FLAGS]\n";

constexpr absl::string_view kGlobalFlagsUsage = R"(global flags
  --addr=HOST:PORT     node to call (default 127.0.0.1:7700)
  --timeout=DURATION   deadline of every call: 10s, 500ms, or seconds (default 30s)
  --json               print responses as protobuf JSON (one object per line, one per call)

connection flags (a node with TLS or a token file; docs/security.md)
  --tls-ca=FILE        speak TLS; verify the node's certificate against this PEM CA bundle
                       (without it, but with another --tls-* flag: the system's roots)
  --tls-cert=FILE      client certificate (PEM), for a node with --tls-client-ca ...
  --tls-key=FILE       ... and its private key
  --tls-server-name=NAME  the name the node's certificate must carry, instead of the host of
                       --addr (e.g. the node's DNS name when --addr is an IP address)
  --token-file=FILE    file holding the bearer token sent as "authorization: Bearer <token>"
                       on every call; without it, $KVMESH_TOKEN when set
  --tenant=NAME        act for this tenant (admin tokens only): sent as kvmesh-tenant metadata
)";

// `kvmeshctl help`: the global flags, then every command's entry.
std::string Usage() {
  std::string text =
      absl::StrCat("kvmeshctl: command-line client of a kvmesh node (kvmesh.v1.CacheService).\n\n",
                   kUsageLine, "\n", kGlobalFlagsUsage, "\ncommands\n");
  for (const Command* c : kCommands) absl::StrAppend(&text, c->usage, "\n");
  absl::StrAppend(&text, "  help          this text\n",
                  "\ncluster commands (the node at --addr runs them)\n");
  for (const Command* c : kClusterCommands) absl::StrAppend(&text, c->usage, "\n");
  absl::StrAppend(&text, "\nSizes take a suffix: 64KiB, 1MiB, 2GiB.\n");
  return text;
}

// `kvmeshctl COMMAND --help`: the usage line and that command's entry.
std::string CommandUsage(const Command& command) {
  return absl::StrCat(kUsageLine, "\n", command.usage,
                      "\n\nrun 'kvmeshctl help' for the global flags and every command\n");
}

const Command* FindCommand(absl::string_view name) {
  for (const Command* c : kCommands) {
    if (c->name == name) return c;
  }
  for (const Command* c : kClusterCommands) {
    if (c->name == name) return c;
  }
  return nullptr;
}

void PrintError(const absl::Status& status) {
  std::fprintf(stderr, "error: %s: %s\n", absl::StatusCodeToString(status.code()).c_str(),
               std::string(status.message()).c_str());
  if (const std::optional<Shortage> shortage = GetShortage(status)) {
    std::fprintf(stderr, "shortage: %s\n", ShortageLine(*shortage).c_str());
  }
}

int Main(int argc, char** argv) {
  auto parsed = Args::Parse(argc, argv, kBoolFlags);
  if (!parsed.ok()) {
    PrintError(parsed.status());
    std::fprintf(stderr, "run 'kvmeshctl help' for the usage\n");
    return 2;
  }
  const Args& args = *parsed;
  const Command* command = FindCommand(args.command());
  if (args.Has("help") && command != nullptr) {
    std::fputs(CommandUsage(*command).c_str(), stdout);
    return 0;
  }
  if (args.command().empty() || args.command() == "help" || args.Has("help")) {
    const bool asked = !args.command().empty() || args.Has("help");
    std::fputs(Usage().c_str(), asked ? stdout : stderr);
    return asked ? 0 : 2;
  }
  if (command == nullptr) {
    PrintError(absl::InvalidArgumentError(absl::StrCat("unknown command '", args.command(), "'")));
    std::fprintf(stderr, "run 'kvmeshctl help' for the usage\n");
    return 2;
  }
  std::vector<absl::string_view> allowed(std::begin(kGlobalFlags), std::end(kGlobalFlags));
  allowed.insert(allowed.end(), std::begin(kConnectionFlags), std::end(kConnectionFlags));
  allowed.insert(allowed.end(), command->flags.begin(), command->flags.end());
  if (absl::Status s = args.CheckAllowed(allowed); !s.ok()) {
    PrintError(s);
    return 2;
  }
  if (!args.positional().empty()) {
    PrintError(absl::InvalidArgumentError(
        absl::StrCat("unexpected argument '", args.positional()[0], "' (flags are --name=value)")));
    return 2;
  }

  auto addr = args.GetString("addr", kDefaultAddr);
  auto timeout = args.GetDuration("timeout", kDefaultTimeout);
  auto json = args.GetBool("json");
  for (const absl::Status& s : {addr.status(), timeout.status(), json.status()}) {
    if (!s.ok()) {
      PrintError(s);
      return 1;
    }
  }
  absl::StatusOr<ClientConnectionOptions> connection =
      ConnectionFromArgs(args, std::getenv(kTokenEnv));
  if (!connection.ok()) {
    PrintError(connection.status());
    return 1;
  }
  grpc::ChannelArguments channel_args;
  channel_args.SetMaxReceiveMessageSize(-1);  // responses are bounded by the server's chunking
  channel_args.SetMaxSendMessageSize(-1);     // the server enforces its own limit
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
      NewClientChannel(*addr, *connection, channel_args);
  if (!channel.ok()) {
    PrintError(channel.status());
    return 1;
  }
  const Client client(*std::move(channel), *timeout, *json);
  absl::Status status = command->run(client, args);
  std::fflush(stdout);
  if (!status.ok()) {
    PrintError(status);
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace ctl
}  // namespace kvmesh

int main(int argc, char** argv) { return kvmesh::ctl::Main(argc, argv); }

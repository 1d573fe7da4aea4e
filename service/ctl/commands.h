// Command: one kvmeshctl command as main.cc dispatches it: its name, the flags it accepts, its
// entry in `kvmeshctl help` and the function that runs it. Each command is defined in the file
// of its group, listed below; main.cc orders them for the help text.
//
// Thread safety: the definitions are constants, initialized before main() runs; a handler is as
// thread-safe as the Client it is given (not at all).
#ifndef KVMESH_SERVICE_CTL_COMMANDS_H_
#define KVMESH_SERVICE_CTL_COMMANDS_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "service/ctl/args.h"
#include "service/ctl/client.h"

namespace kvmesh {
namespace ctl {

struct Command {
  absl::string_view name;
  // The flags it accepts besides the global ones, in the order an unknown-flag error lists them.
  absl::Span<const absl::string_view> flags;
  // Its entry in `kvmeshctl help`, verbatim: lines aligned to the help's columns, the first
  // starting with "  NAME"; no newline after the last.
  absl::string_view usage;
  // Runs the command; its output goes to stdout. A non-OK status is printed by main ("error:
  // CODE: message") and makes the exit status 1. REQUIRES: `args` holds only allowed flags.
  absl::Status (*run)(const Client& client, const Args& args);
};

// caches.cc: a node's caches.
extern const Command kCreateCommand;
extern const Command kDeleteCommand;
extern const Command kGetCommand;
extern const Command kListCommand;
extern const Command kUsageCommand;

// data.cc: payloads in and out of a sequence.
extern const Command kAppendCommand;
extern const Command kReadCommand;

// sequences.cc: what a sequence holds and edits of it.
extern const Command kVisibleCommand;
extern const Command kCopyPrefixCommand;
extern const Command kRemoveCommand;
extern const Command kCanResumeCommand;
extern const Command kReserveCommand;
extern const Command kSetRetentionCommand;
extern const Command kLookupPrefixCommand;
extern const Command kWatchEventsCommand;
extern const Command kListSequencesCommand;
extern const Command kCommitSpeculationCommand;

// snapshots.cc: the snapshot pool of a cache.
extern const Command kSnapshotCommand;
extern const Command kRestoreCommand;
extern const Command kMergeSnapshotsCommand;
extern const Command kSplitSnapshotCommand;
extern const Command kDropSnapshotCommand;
extern const Command kListSnapshotsCommand;

// cluster.cc: the node's health and its cluster.
extern const Command kHealthCommand;
extern const Command kListMembersCommand;
extern const Command kMigrateCommand;
extern const Command kMigrateSnapshotCommand;
extern const Command kDrainCommand;

}  // namespace ctl
}  // namespace kvmesh

#endif  // KVMESH_SERVICE_CTL_COMMANDS_H_

// kvmeshctl: calls every RPC of kvmesh.v1.CacheService (and grpc.health.v1.Health/Check) from
// the shell, cluster operations included (list-members, cross-node copy-prefix, migrate,
// migrate-snapshot, cluster-wide remove), with readable output or protobuf JSON (--json).
// `kvmeshctl help` prints the usage.
//
// Exit status: 0 on success; 1 when an RPC fails (stderr: "error: <CODE>: <message>"), when a
// local step fails (a file, a payload that does not verify: DATA_LOSS), or a flag has a bad
// value; 2 for an unknown command or flag.
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cache/spec.h"
#include "cache/status_macros.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/grpcpp.h"
#include "kvmesh/v1/kvmesh.grpc.pb.h"
#include "kvmesh/v1/kvmesh.pb.h"
#include "service/common/convert.h"
#include "service/ctl/args.h"
#include "service/ctl/format.h"
#include "service/common/health_client.h"
#include "service/ctl/parse.h"
#include "service/ctl/payload.h"

namespace kvmesh {
namespace ctl {
namespace {

constexpr char kDefaultAddr[] = "127.0.0.1:7700";
constexpr absl::Duration kDefaultTimeout = absl::Seconds(30);
constexpr int64_t kDefaultChunkBytes = int64_t{1} << 20;

constexpr absl::string_view kBoolFlags[] = {"json",       "stream",      "help",
                                            "non-causal", "speculative", "keep-source"};

constexpr char kUsage[] =
    R"(kvmeshctl: command-line client of a kvmesh node (kvmesh.v1.CacheService).

usage: kvmeshctl [--addr=HOST:PORT] [--timeout=DURATION] [--json] COMMAND [FLAGS]

global flags
  --addr=HOST:PORT     node to call (default 127.0.0.1:7700)
  --timeout=DURATION   deadline of every call: 10s, 500ms, or seconds (default 30s)
  --json               print responses as protobuf JSON (one object per line, one per call)

commands
  create        --name=CACHE [--dtype=f32|f16|bf16 (f16)] --max-sequences=N --capacity=TOKENS
                --max-batch=TOKENS --group=GROUP [--group=GROUP]...  |  --spec-json=JSON|@FILE
                GROUP: attention:layers=32,heads=8,head_dim=128,window=WINDOW,rope=ROPE
                  also head_dim_k=, head_dim_v=; WINDOW: full | sliding:W[:MEMORY] | chunked:N
                  ROPE: none | normal|neox[:DIMS[:BASE[:FREQ_SCALE]]]
                GROUP: rotating:layers=N,heads=H,head_dim=D,max_size=TOKENS[,rope=ROPE]
                  a ring of the last max_size tokens per sequence; also head_dim_k=, head_dim_v=
                GROUP: recurrent:layers=N,conv_tail=T,conv_dim=C[,v_heads=V,head_v_dim=DV,
                  head_k_dim=DK]: per-sequence conv state [T][C] (+ delta state [V][DV][DK] f32)
                shorthand flags override the fields of --spec-json
  delete        --cache=CACHE
  get           --cache=CACHE                  spec and usage
  list                                         every cache on the node
  usage         --cache=CACHE                  cells used/total per group, bytes, sequences,
                                               snapshots
  append        --cache=CACHE --seq=N --positions=LIST [--seed=N | --payload-file=FILE]
                [--batch=TOKENS] [--stream [--chunk-bytes=BYTES]] [--speculative]
                LIST: comma-separated P or half-open BEGIN:END, e.g. 0:512 or 0,1,2,10:20.
                The payload is the pattern of --seed (default 0) for these positions, or FILE
                (the payload of all the tokens as one batch). Tokens go in Appends of --batch
                tokens (default: the cache's max_batch); a failed Append stops the command and
                the earlier ones stay. A unary Append must fit the node's --max-message-bytes
                (default 128MiB); --stream uses AppendStream in chunks of --chunk-bytes
                (default 1MiB) and has no such limit. Recurrent groups get the pattern state
                of --seed at the offset each Append reaches (a plain FILE of such a cache
                must fit one Append). --speculative: the tokens are pending until
                commit-speculation (one Recurrent state per token).
  read          --cache=CACHE --seq=N [--begin=P] [--end=P] [--out=FILE] [--verify-seed=N]
                [--max-chunk-bytes=BYTES]
                prints the positions (or Recurrent state) per group, payload size and FNV-1a
                64 checksum; --verify-seed compares the payload with the pattern of that seed,
                a Recurrent state with that seed's state at the sequence's offset (exit 1,
                DATA_LOSS, on a mismatch)
  visible       --cache=CACHE [--group=G] (--query=SEQ:POS[:nc]... | --seq=N --pos=LIST
                [--non-causal])
  copy-prefix   --cache=CACHE --src=N --dst=N --length=TOKENS [--source-node=NODE]
                with --source-node naming another member: this node (--addr) pulls src's
                positions < TOKENS from NODE into dst; prints the transfer (transport, bytes,
                time, GB/s)
  remove        --cache=CACHE --seq=N --begin=P [--end=P] [--scope=local|cluster]
                no --end: truncate from --begin; --scope=cluster removes on every member and
                prints one line per node (the command succeeds when every member answered)
  can-resume    --cache=CACHE --seq=N --pos=LIST
  list-sequences --cache=CACHE                 offset, pending tokens, per-group storage/state
  snapshot      --cache=CACHE --seq=N [--from=P (0)]   copy [P, offset) of seq into the
                                               snapshot pool; prints the new snapshot id
  restore       --cache=CACHE --seq=N --target=P [--snapshot=ID]
                without --snapshot: rewind seq's live data to P; with it: write the snapshot's
                data into seq (any sequence of the cache) and clamp to P
  merge-snapshots --cache=CACHE --parent=ID --child=ID   [a,b) + [b,c) -> [a,c) (new id)
  split-snapshot --cache=CACHE --snapshot=ID --at=P      [a,c) -> [a,P) + [P,c) (new ids)
  drop-snapshot --cache=CACHE --snapshot=ID
  list-snapshots --cache=CACHE
  commit-speculation --cache=CACHE --seq=N --accepted=K  keep the first K pending tokens
  health        [--service=NAME]               grpc.health.v1.Health/Check ("" = the server)
  help          this text

cluster commands (the node at --addr runs them)
  list-members                                 this node (*) and its peers: address, health,
                                               backend, transports, why unreachable
  migrate       --cache=CACHE --seq=N --target-node=NODE [--target-seq=N (--seq)]
                [--keep-source]
                move seq to NODE as --target-seq (replaced there); the source is removed once
                the target has committed unless --keep-source; prints the transfer
  migrate-snapshot --cache=CACHE --snapshot=ID --target-node=NODE [--keep-source]
                move a snapshot to NODE; prints its id there and the transfer

Sizes take a suffix: 64KiB, 1MiB, 2GiB.
)";

// ---- helpers -------------------------------------------------------------------------------

std::string Mib(int64_t bytes) { return absl::StrFormat("%.1f MiB", bytes / 1048576.0); }

std::string Rate(int64_t bytes, absl::Duration elapsed) {
  const double s = absl::ToDoubleSeconds(elapsed);
  if (s <= 0) return "-";
  return absl::StrFormat("%.2f GB/s", bytes / s / 1e9);
}

std::string Ms(absl::Duration d) {
  return absl::StrFormat("%.1f ms", absl::ToDoubleMilliseconds(d));
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

std::string DTypeText(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_F32:
      return "f32";
    case v1::DTYPE_F16:
      return "f16";
    case v1::DTYPE_BF16:
      return "bf16";
    default:
      return v1::DType_Name(dtype);
  }
}

// ",rope=..." of a group's shorthand.
std::string RopeText(const v1::Rope& r) {
  if (r.type() == v1::ROPE_TYPE_NONE) return ",rope=none";
  std::string out = absl::StrCat(",rope=", r.type() == v1::ROPE_TYPE_NEOX ? "neox" : "normal", ":",
                                 r.dims(), ":", r.base());
  if (r.freq_scale() != 1.0f) absl::StrAppend(&out, ":", r.freq_scale());
  return out;
}

std::string HeadDimText(int32_t k, int32_t v) {
  if (k == v) return absl::StrCat(",head_dim=", k);
  return absl::StrCat(",head_dim_k=", k, ",head_dim_v=", v);
}

// The --group shorthand of a group, so `get` output can be pasted back into `create`.
std::string GroupText(const v1::LayerGroup& group) {
  switch (group.kind_case()) {
    case v1::LayerGroup::kAttention: {
      const v1::Attention& a = group.attention();
      std::string out =
          absl::StrCat("attention:layers=", group.num_layers(), ",heads=", a.num_kv_heads(),
                       HeadDimText(a.head_dim_k(), a.head_dim_v()));
      const v1::Window& w = a.window();
      switch (w.kind_case()) {
        case v1::Window::kSliding:
          absl::StrAppend(&out, ",window=sliding:", w.sliding().window());
          if (w.sliding().memory() != 0) absl::StrAppend(&out, ":", w.sliding().memory());
          break;
        case v1::Window::kChunked:
          absl::StrAppend(&out, ",window=chunked:", w.chunked().chunk());
          break;
        default:
          absl::StrAppend(&out, ",window=full");
      }
      return out + RopeText(a.rope());
    }
    case v1::LayerGroup::kRotating: {
      const v1::Rotating& r = group.rotating();
      return absl::StrCat("rotating:layers=", group.num_layers(), ",heads=", r.num_kv_heads(),
                          HeadDimText(r.head_dim_k(), r.head_dim_v()), ",max_size=", r.max_size(),
                          RopeText(r.rope()));
    }
    case v1::LayerGroup::kRecurrent: {
      const v1::Recurrent& r = group.recurrent();
      std::string out = absl::StrCat("recurrent:layers=", group.num_layers(),
                                     ",conv_tail=", r.conv_tail(), ",conv_dim=", r.conv_dim());
      if (r.num_v_heads() != 0) {
        absl::StrAppend(&out, ",v_heads=", r.num_v_heads(), ",head_v_dim=", r.head_v_dim(),
                        ",head_k_dim=", r.head_k_dim());
      }
      return out;
    }
    case v1::LayerGroup::KIND_NOT_SET:
      break;
  }
  return absl::StrCat("layers=", group.num_layers(), " (unknown kind)");
}

// The kind of group `g` of `spec` ("?" when out of range).
v1::LayerGroup::KindCase GroupKindOf(const v1::CacheSpec& spec, int g) {
  if (g < 0 || g >= spec.groups_size()) return v1::LayerGroup::KIND_NOT_SET;
  return spec.groups(g).kind_case();
}

std::string StateText(v1::StateStatus state) {
  switch (state) {
    case v1::STATE_STATUS_VALID:
      return "VALID";
    case v1::STATE_STATUS_INVALID:
      return "INVALID";
    case v1::STATE_STATUS_NONE:
      return "none";
    default:
      return v1::StateStatus_Name(state);
  }
}

void PrintUsage(const v1::CacheUsage& usage, const v1::CacheSpec& spec) {
  std::printf("  sequences live %d/%d, bytes held %s, snapshots %d (%s)\n", usage.sequences_live(),
              spec.max_sequences(), Mib(usage.bytes_held()).c_str(), usage.snapshots(),
              Mib(usage.snapshot_bytes()).c_str());
  for (const v1::GroupUsage& g : usage.groups()) {
    const double pct =
        g.cells_total() > 0 ? 100.0 * static_cast<double>(g.cells_used()) / g.cells_total() : 0;
    const std::string memory =
        g.memory() == 0 ? std::string("unlimited") : absl::StrCat(g.memory(), " tokens/seq");
    switch (GroupKindOf(spec, g.group())) {
      case v1::LayerGroup::kRotating:
        std::printf("  group %d (rotating): ring rows %" PRId64 "/%" PRId64
                    " used (%.1f%%), memory %s, %s\n",
                    g.group(), g.cells_used(), g.cells_total(), pct, memory.c_str(),
                    Mib(g.bytes()).c_str());
        break;
      case v1::LayerGroup::kRecurrent:
        std::printf("  group %d (recurrent): state slots %" PRId64 "/%" PRId64
                    " used (%.1f%%), %s\n",
                    g.group(), g.cells_used(), g.cells_total(), pct, Mib(g.bytes()).c_str());
        break;
      default:
        std::printf("  group %d: cells %" PRId64 "/%" PRId64 " used (%.1f%%), memory %s, %s\n",
                    g.group(), g.cells_used(), g.cells_total(), pct, memory.c_str(),
                    Mib(g.bytes()).c_str());
    }
  }
}

void PrintInfo(const v1::CacheInfo& info) {
  const v1::CacheSpec& s = info.spec();
  std::printf("cache %s\n", s.name().c_str());
  std::printf("  dtype %s, max_sequences %d, capacity %d, max_batch %d\n",
              DTypeText(s.dtype()).c_str(), s.max_sequences(), s.capacity(), s.max_batch());
  for (int g = 0; g < s.groups_size(); ++g) {
    std::printf("  group %d: %s\n", g, GroupText(s.groups(g)).c_str());
  }
  std::printf("usage\n");
  PrintUsage(info.usage(), s);
}

// One line summary of an Append's usage answer.
std::string UsageLine(const v1::CacheUsage& usage) {
  std::vector<std::string> groups;
  for (const v1::GroupUsage& g : usage.groups()) {
    groups.push_back(absl::StrCat("g", g.group(), " ", g.cells_used(), "/", g.cells_total()));
  }
  std::string line = absl::StrCat("sequences live ", usage.sequences_live(), ", cells ",
                                  absl::StrJoin(groups, ", "), ", held ", Mib(usage.bytes_held()));
  if (usage.snapshots() != 0) {
    absl::StrAppend(&line, ", snapshots ", usage.snapshots(), " (", Mib(usage.snapshot_bytes()),
                    ")");
  }
  return line;
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

absl::StatusOr<std::vector<int32_t>> GetPositions(const Args& args, absl::string_view name) {
  ASSIGN_OR_RETURN(std::string text, args.GetString(name));
  auto positions = ParsePositions(text);
  if (!positions.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, ": ", positions.status().message()));
  }
  return positions;
}

absl::StatusOr<int32_t> GetInt32(const Args& args, absl::string_view name,
                                 std::optional<int64_t> fallback = std::nullopt) {
  ASSIGN_OR_RETURN(int64_t v, args.GetInt(name, fallback));
  if (v < INT32_MIN || v > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, "=", v, " is out of int32 range"));
  }
  return static_cast<int32_t>(v);
}

// The cache a command addresses: --cache, or --name as an alias.
absl::StatusOr<std::string> GetCacheName(const Args& args) {
  if (auto v = args.Get("cache")) return *v;
  if (auto v = args.Get("name")) return *v;
  return absl::InvalidArgumentError("--cache is required");
}

// ---- the client ----------------------------------------------------------------------------

// Ctl: one kvmeshctl invocation: a channel to the node and the global options.
// Not thread-safe (used from main only).
class Ctl {
 public:
  Ctl(std::shared_ptr<grpc::Channel> channel, absl::Duration timeout, bool json)
      : stub_(v1::CacheService::NewStub(channel)),
        health_(channel),
        timeout_(timeout),
        json_(json) {}

  absl::Status Create(const Args& args);
  absl::Status Delete(const Args& args);
  absl::Status Get(const Args& args);
  absl::Status List(const Args& args);
  absl::Status Usage(const Args& args);
  absl::Status Append(const Args& args);
  absl::Status Read(const Args& args);
  absl::Status Visible(const Args& args);
  absl::Status CopyPrefix(const Args& args);
  absl::Status Remove(const Args& args);
  absl::Status CanResume(const Args& args);
  absl::Status ListSequences(const Args& args);
  absl::Status Snapshot(const Args& args);
  absl::Status Restore(const Args& args);
  absl::Status MergeSnapshots(const Args& args);
  absl::Status SplitSnapshot(const Args& args);
  absl::Status DropSnapshot(const Args& args);
  absl::Status ListSnapshots(const Args& args);
  absl::Status CommitSpeculation(const Args& args);
  absl::Status Health(const Args& args);
  absl::Status ListMembers(const Args& args);
  absl::Status Migrate(const Args& args);
  absl::Status MigrateSnapshot(const Args& args);

 private:
  // A context whose deadline is --timeout from now.
  std::unique_ptr<grpc::ClientContext> Context() const {
    auto context = std::make_unique<grpc::ClientContext>();
    context->set_deadline(std::chrono::system_clock::now() + absl::ToChronoMicroseconds(timeout_));
    return context;
  }

  absl::StatusOr<v1::CacheInfo> FetchInfo(const std::string& cache) const {
    v1::GetCacheRequest request;
    request.set_cache(cache);
    v1::GetCacheResponse response;
    RETURN_IF_ERROR(FromGrpcStatus(stub_->GetCache(Context().get(), request, &response)));
    return response.cache();
  }

  // The engine's view of a cache's spec, for payload arithmetic.
  static absl::StatusOr<CacheSpec> EngineSpec(const v1::CacheSpec& proto) {
    auto spec = SpecFromProto(proto);
    if (!spec.ok()) {
      return absl::InternalError(
          absl::StrCat("node returned a spec this client cannot use: ", spec.status().message()));
    }
    return spec;
  }

  absl::StatusOr<CacheSpec> FetchSpec(const std::string& cache) const {
    ASSIGN_OR_RETURN(v1::CacheInfo info, FetchInfo(cache));
    return EngineSpec(info.spec());
  }

  absl::StatusOr<v1::AppendResponse> SendAppend(const std::string& cache, int64_t seq,
                                                absl::Span<const int32_t> positions,
                                                std::string payload, bool stream,
                                                int64_t chunk_bytes, bool speculative) const;

  // The offset of `seq` (pending tokens included), from ListSequences; NOT_FOUND when the cache
  // does not list it.
  absl::StatusOr<int32_t> FetchOffset(const std::string& cache, int64_t seq) const;

  std::unique_ptr<v1::CacheService::Stub> stub_;
  HealthClient health_;
  const absl::Duration timeout_;
  const bool json_;
};

absl::Status Ctl::Create(const Args& args) {
  v1::CacheSpec spec;
  if (auto json = args.Get("spec-json")) {
    std::string text = *json;
    if (!text.empty() && text[0] == '@') {
      ASSIGN_OR_RETURN(text, ReadFile(text.substr(1)));
    }
    auto parsed = google::protobuf::util::JsonStringToMessage(text, &spec);
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--spec-json: ", parsed.ToString()));
    }
  }
  if (args.Has("name") || args.Has("cache")) {
    ASSIGN_OR_RETURN(std::string name, GetCacheName(args));
    spec.set_name(name);
  }
  if (auto dtype = args.Get("dtype")) {
    ASSIGN_OR_RETURN(v1::DType d, ParseDType(*dtype));
    spec.set_dtype(d);
  } else if (spec.dtype() == v1::DTYPE_UNSPECIFIED) {
    spec.set_dtype(v1::DTYPE_F16);
  }
  if (args.Has("max-sequences")) {
    ASSIGN_OR_RETURN(int32_t v, GetInt32(args, "max-sequences"));
    spec.set_max_sequences(v);
  }
  if (args.Has("capacity")) {
    ASSIGN_OR_RETURN(int32_t v, GetInt32(args, "capacity"));
    spec.set_capacity(v);
  }
  if (args.Has("max-batch")) {
    ASSIGN_OR_RETURN(int32_t v, GetInt32(args, "max-batch"));
    spec.set_max_batch(v);
  }
  const std::vector<std::string> groups = args.GetAll("group");
  if (!groups.empty()) {
    spec.clear_groups();
    for (const std::string& text : groups) {
      auto group = ParseGroup(text);
      if (!group.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("--group: ", group.status().message()));
      }
      *spec.add_groups() = *group;
    }
  }
  if (spec.name().empty()) return absl::InvalidArgumentError("--name is required");

  v1::CreateCacheRequest request;
  *request.mutable_spec() = spec;
  v1::CreateCacheResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(stub_->CreateCache(Context().get(), request, &response)));
  if (json_) return PrintJson(response);
  std::printf("%s cache %s\n",
              response.created() ? "created" : "already exists (same spec):", spec.name().c_str());
  PrintInfo(response.cache());
  return absl::OkStatus();
}

absl::Status Ctl::Delete(const Args& args) {
  v1::DeleteCacheRequest request;
  ASSIGN_OR_RETURN(*request.mutable_cache(), GetCacheName(args));
  v1::DeleteCacheResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(stub_->DeleteCache(Context().get(), request, &response)));
  if (json_) return PrintJson(response);
  std::printf("deleted cache %s\n", request.cache().c_str());
  return absl::OkStatus();
}

absl::Status Ctl::Get(const Args& args) {
  v1::GetCacheRequest request;
  ASSIGN_OR_RETURN(*request.mutable_cache(), GetCacheName(args));
  v1::GetCacheResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(stub_->GetCache(Context().get(), request, &response)));
  if (json_) return PrintJson(response);
  PrintInfo(response.cache());
  return absl::OkStatus();
}

absl::Status Ctl::Usage(const Args& args) {
  ASSIGN_OR_RETURN(std::string cache, GetCacheName(args));
  ASSIGN_OR_RETURN(v1::CacheInfo info, FetchInfo(cache));
  if (json_) return PrintJson(info.usage());
  std::printf("usage of cache %s\n", cache.c_str());
  PrintUsage(info.usage(), info.spec());
  return absl::OkStatus();
}

absl::Status Ctl::List(const Args& args) {
  v1::ListCachesResponse response;
  RETURN_IF_ERROR(
      FromGrpcStatus(stub_->ListCaches(Context().get(), v1::ListCachesRequest(), &response)));
  if (json_) return PrintJson(response);
  std::printf("%-24s %-5s %6s %10s %9s %9s %12s\n", "NAME", "DTYPE", "GROUPS", "SEQUENCES",
              "CAPACITY", "MAX_BATCH", "HELD");
  for (const v1::CacheInfo& info : response.caches()) {
    const v1::CacheSpec& s = info.spec();
    std::printf("%-24s %-5s %6d %10s %9d %9d %12s\n", s.name().c_str(),
                DTypeText(s.dtype()).c_str(), s.groups_size(),
                absl::StrCat(info.usage().sequences_live(), "/", s.max_sequences()).c_str(),
                s.capacity(), s.max_batch(), Mib(info.usage().bytes_held()).c_str());
  }
  if (response.caches().empty()) std::printf("(no caches)\n");
  return absl::OkStatus();
}

absl::StatusOr<v1::AppendResponse> Ctl::SendAppend(const std::string& cache, int64_t seq,
                                                   absl::Span<const int32_t> positions,
                                                   std::string payload, bool stream,
                                                   int64_t chunk_bytes, bool speculative) const {
  v1::AppendResponse response;
  if (!stream) {
    v1::AppendRequest request;
    request.set_cache(cache);
    for (int32_t pos : positions) {
      v1::Token* t = request.add_tokens();
      t->set_seq(seq);
      t->set_pos(pos);
    }
    *request.mutable_payload() = std::move(payload);
    request.set_speculative(speculative);
    RETURN_IF_ERROR(FromGrpcStatus(stub_->Append(Context().get(), request, &response)));
    return response;
  }
  auto context = Context();
  std::unique_ptr<grpc::ClientWriter<v1::AppendStreamRequest>> writer =
      stub_->AppendStream(context.get(), &response);
  v1::AppendStreamRequest message;
  v1::AppendHeader* header = message.mutable_header();
  header->set_cache(cache);
  for (int32_t pos : positions) {
    v1::Token* t = header->add_tokens();
    t->set_seq(seq);
    t->set_pos(pos);
  }
  header->set_payload_bytes(static_cast<int64_t>(payload.size()));
  header->set_speculative(speculative);
  size_t sent = 0;
  // The header goes with the first chunk; an empty payload still sends the header.
  do {
    const size_t n = std::min(payload.size() - sent, static_cast<size_t>(chunk_bytes));
    message.set_data(payload.substr(sent, n));
    sent += n;
    if (!writer->Write(message)) break;  // the server ended the call; Finish says why
    message.clear_header();
  } while (sent < payload.size());
  writer->WritesDone();
  RETURN_IF_ERROR(FromGrpcStatus(writer->Finish()));
  return response;
}

absl::Status Ctl::Append(const Args& args) {
  ASSIGN_OR_RETURN(std::string cache, GetCacheName(args));
  ASSIGN_OR_RETURN(int64_t seq, args.GetInt("seq"));
  ASSIGN_OR_RETURN(std::vector<int32_t> positions, GetPositions(args, "positions"));
  ASSIGN_OR_RETURN(bool stream, args.GetBool("stream"));
  ASSIGN_OR_RETURN(bool speculative, args.GetBool("speculative"));
  ASSIGN_OR_RETURN(int64_t chunk_bytes, args.GetBytes("chunk-bytes", kDefaultChunkBytes));
  if (chunk_bytes <= 0) return absl::InvalidArgumentError("--chunk-bytes must be > 0");
  if (args.Has("seed") && args.Has("payload-file")) {
    return absl::InvalidArgumentError("give --seed or --payload-file, not both");
  }
  ASSIGN_OR_RETURN(int64_t seed, args.GetInt("seed", 0));
  ASSIGN_OR_RETURN(CacheSpec spec, FetchSpec(cache));
  ASSIGN_OR_RETURN(int64_t batch, args.GetInt("batch", spec.max_batch));
  if (batch <= 0)
    return absl::InvalidArgumentError(absl::StrCat("--batch=", batch, " must be > 0"));

  std::optional<std::string> file_payload;
  if (auto path = args.Get("payload-file")) {
    ASSIGN_OR_RETURN(file_payload, ReadFile(*path));
    const size_t want =
        AppendPayloadBytes(spec, static_cast<int64_t>(positions.size()), 1, speculative);
    if (file_payload->size() != want) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--payload-file '", *path, "' has ", file_payload->size(), " bytes; ", positions.size(),
          speculative ? " speculative" : "", " tokens of cache ", cache, " need ", want));
    }
    if (!speculative && HasRecurrentGroup(spec) && static_cast<int64_t>(positions.size()) > batch) {
      return absl::InvalidArgumentError(
          absl::StrCat("--payload-file holds one recurrent state (after all ", positions.size(),
                       " tokens), so it cannot be split into Appends of --batch=", batch,
                       " tokens; raise --batch or use --seed"));
    }
  }

  const int64_t n = static_cast<int64_t>(positions.size());
  for (int64_t begin = 0; begin < n; begin += batch) {
    const int64_t end = std::min(n, begin + batch);
    absl::Span<const int32_t> slice = absl::MakeConstSpan(positions).subspan(begin, end - begin);
    std::string payload =
        file_payload ? SliceTokens(spec,
                                   absl::MakeConstSpan(
                                       reinterpret_cast<const uint8_t*>(file_payload->data()),
                                       file_payload->size()),
                                   n, begin, end, speculative)
                     : MakePatternPayload(spec, slice, static_cast<uint64_t>(seed), speculative);
    const int64_t bytes = static_cast<int64_t>(payload.size());
    const absl::Time start = absl::Now();
    ASSIGN_OR_RETURN(v1::AppendResponse response, SendAppend(cache, seq, slice, std::move(payload),
                                                             stream, chunk_bytes, speculative));
    const absl::Duration elapsed = absl::Now() - start;
    if (json_) {
      RETURN_IF_ERROR(PrintJson(response));
      continue;
    }
    std::printf("appended seq %" PRId64 " positions %s (%zu tokens%s, %s%s) in %s, %s\n", seq,
                FormatPositions(std::vector<int32_t>(slice.begin(), slice.end())).c_str(),
                slice.size(), speculative ? ", speculative: pending" : "", Mib(bytes).c_str(),
                stream ? ", stream" : "", Ms(elapsed).c_str(), Rate(bytes, elapsed).c_str());
    if (end == n) std::printf("  %s\n", UsageLine(response.usage()).c_str());
  }
  return absl::OkStatus();
}

absl::Status Ctl::Read(const Args& args) {
  v1::ReadRequest request;
  ASSIGN_OR_RETURN(*request.mutable_cache(), GetCacheName(args));
  ASSIGN_OR_RETURN(int64_t seq, args.GetInt("seq"));
  request.set_seq(seq);
  ASSIGN_OR_RETURN(int32_t begin, GetInt32(args, "begin", 0));
  request.set_begin(begin);
  if (args.Has("end")) {
    ASSIGN_OR_RETURN(int32_t end, GetInt32(args, "end"));
    request.set_end(end);
  }
  ASSIGN_OR_RETURN(int64_t max_chunk, args.GetBytes("max-chunk-bytes", 0));
  if (max_chunk < 0 || max_chunk > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-chunk-bytes=", max_chunk, " must be in [0, 2GiB)"));
  }
  request.set_max_chunk_bytes(static_cast<int32_t>(max_chunk));
  std::optional<std::string> out_path = args.Get("out");
  std::optional<uint64_t> verify_seed;
  if (args.Has("verify-seed")) {
    ASSIGN_OR_RETURN(int64_t s, args.GetInt("verify-seed"));
    verify_seed = static_cast<uint64_t>(s);
  }
  // The spec: group kinds for the text output, payload arithmetic for --verify-seed.
  std::optional<v1::CacheInfo> info;
  std::optional<CacheSpec> spec;
  if (verify_seed || !json_) {
    ASSIGN_OR_RETURN(info, FetchInfo(request.cache()));
  }
  if (verify_seed) {
    ASSIGN_OR_RETURN(spec, EngineSpec(info->spec()));
  }
  const bool keep = out_path.has_value() || verify_seed.has_value();

  const absl::Time start = absl::Now();
  auto context = Context();
  std::unique_ptr<grpc::ClientReader<v1::ReadResponse>> reader =
      stub_->Read(context.get(), request);
  v1::ReadResponse message;
  v1::ReadHeader header;
  bool have_header = false;
  int64_t received = 0;
  uint64_t fnv = kFnvOffsetBasis;
  std::string payload;
  while (reader->Read(&message)) {
    if (message.has_header()) {
      if (have_header) {
        context->TryCancel();
        reader->Finish();
        return absl::DataLossError("read stream carried a second header");
      }
      header = message.header();
      have_header = true;
      if (keep) payload.reserve(static_cast<size_t>(header.payload_bytes()));
    }
    const std::string& data = message.data();
    fnv = Fnv1a64(absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(data.data()), data.size()),
                  fnv);
    received += static_cast<int64_t>(data.size());
    if (keep) payload.append(data);
  }
  RETURN_IF_ERROR(FromGrpcStatus(reader->Finish()));
  const absl::Duration elapsed = absl::Now() - start;
  if (!have_header) return absl::DataLossError("read stream ended without a header");
  if (received != header.payload_bytes()) {
    return absl::DataLossError(absl::StrCat("read stream carried ", received,
                                            " payload bytes, its header announced ",
                                            header.payload_bytes()));
  }
  if (out_path) RETURN_IF_ERROR(WriteFile(*out_path, payload));

  std::optional<PatternCheck> check;
  if (verify_seed) {
    std::vector<std::vector<int32_t>> positions(spec->groups.size());
    std::vector<std::optional<int32_t>> state_offsets(spec->groups.size());
    std::optional<int32_t> offset;  // the sequence's, fetched once a group returned a state
    for (const v1::GroupPositions& g : header.groups()) {
      if (g.group() < 0 || g.group() >= static_cast<int>(positions.size())) {
        return absl::DataLossError(absl::StrCat("read header names group ", g.group(),
                                                " of a cache with ", positions.size()));
      }
      positions[g.group()].assign(g.positions().begin(), g.positions().end());
      if (g.state() == v1::STATE_STATUS_VALID) {
        if (!offset) {
          ASSIGN_OR_RETURN(offset, FetchOffset(request.cache(), seq));
        }
        state_offsets[g.group()] = *offset;
      }
    }
    check = CheckPatternPayload(
        *spec, positions, state_offsets,
        absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(payload.data()), payload.size()),
        *verify_seed);
  }

  const std::string checksum = absl::StrFormat("%016x", fnv);
  if (json_) {
    google::protobuf::util::JsonPrintOptions options;
    options.always_print_primitive_fields = true;
    std::string header_json;
    if (!google::protobuf::util::MessageToJsonString(header, &header_json, options).ok()) {
      return absl::InternalError("cannot print the read header as JSON");
    }
    std::string line = absl::StrCat("{\"header\":", header_json, ",\"payloadBytes\":\"", received,
                                    "\",\"fnv1a64\":\"", checksum, "\"");
    if (check) {
      absl::StrAppend(&line, ",\"verify\":{\"seed\":\"", *verify_seed,
                      "\",\"match\":", check->mismatches == 0 ? "true" : "false",
                      ",\"elements\":\"", check->elements, "\",\"mismatches\":\"",
                      check->mismatches, "\"}");
    }
    std::printf("%s}\n", line.c_str());
  } else {
    std::printf("read seq %" PRId64 " [%d, %s) of %s\n", seq, begin,
                request.has_end() ? absl::StrCat(request.end()).c_str() : "end",
                request.cache().c_str());
    for (const v1::GroupPositions& g : header.groups()) {
      switch (GroupKindOf(info->spec(), g.group())) {
        case v1::LayerGroup::kRecurrent:
          std::printf("  group %d (recurrent): state %s%s\n", g.group(),
                      StateText(g.state()).c_str(),
                      g.state() == v1::STATE_STATUS_VALID     ? " (in the payload)"
                      : g.state() == v1::STATE_STATUS_INVALID ? " (invalidated; not served)"
                                                              : " (range ends before the offset)");
          break;
        case v1::LayerGroup::kRotating:
          std::printf(
              "  group %d (rotating): %d positions %s\n", g.group(), g.positions_size(),
              FormatPositions(std::vector<int32_t>(g.positions().begin(), g.positions().end()))
                  .c_str());
          break;
        default:
          std::printf(
              "  group %d: %d positions %s\n", g.group(), g.positions_size(),
              FormatPositions(std::vector<int32_t>(g.positions().begin(), g.positions().end()))
                  .c_str());
      }
    }
    std::printf("  payload %" PRId64 " bytes (%s) in %s, %s, fnv1a64 %s\n", received,
                Mib(received).c_str(), Ms(elapsed).c_str(), Rate(received, elapsed).c_str(),
                checksum.c_str());
    if (out_path) std::printf("  wrote %s\n", out_path->c_str());
    if (check) {
      if (check->mismatches == 0) {
        std::printf("  verify seed %" PRIu64 ": match (%zu elements)\n", *verify_seed,
                    check->elements);
      } else {
        std::printf("  verify seed %" PRIu64 ": MISMATCH in %zu of %zu elements, first at %s\n",
                    *verify_seed, check->mismatches, check->elements,
                    check->first_mismatch.c_str());
      }
    }
  }
  if (check && check->mismatches != 0) {
    return absl::DataLossError(absl::StrCat("payload does not match seed ", *verify_seed, ": ",
                                            check->mismatches, " of ", check->elements,
                                            " elements differ, first at ", check->first_mismatch));
  }
  return absl::OkStatus();
}

absl::Status Ctl::Visible(const Args& args) {
  v1::VisibleRequest request;
  ASSIGN_OR_RETURN(*request.mutable_cache(), GetCacheName(args));
  ASSIGN_OR_RETURN(int32_t group, GetInt32(args, "group", 0));
  request.set_group(group);
  for (const std::string& text : args.GetAll("query")) {
    std::vector<absl::string_view> parts = absl::StrSplit(text, ':');
    v1::Query* q = request.add_queries();
    int64_t seq;
    int32_t pos;
    if (parts.size() < 2 || parts.size() > 3 || !absl::SimpleAtoi(parts[0], &seq) ||
        !absl::SimpleAtoi(parts[1], &pos) || (parts.size() == 3 && parts[2] != "nc")) {
      return absl::InvalidArgumentError(
          absl::StrCat("--query='", text, "' is not SEQ:POS or SEQ:POS:nc"));
    }
    q->set_seq(seq);
    q->set_pos(pos);
    q->set_non_causal(parts.size() == 3);
  }
  if (args.Has("pos")) {
    ASSIGN_OR_RETURN(int64_t seq, args.GetInt("seq"));
    ASSIGN_OR_RETURN(std::vector<int32_t> positions, GetPositions(args, "pos"));
    ASSIGN_OR_RETURN(bool non_causal, args.GetBool("non-causal"));
    for (int32_t pos : positions) {
      v1::Query* q = request.add_queries();
      q->set_seq(seq);
      q->set_pos(pos);
      q->set_non_causal(non_causal);
    }
  }
  if (request.queries().empty()) {
    return absl::InvalidArgumentError("give --query=SEQ:POS[:nc] or --seq=N --pos=LIST");
  }
  v1::VisibleResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(stub_->Visible(Context().get(), request, &response)));
  if (json_) return PrintJson(response);
  for (int i = 0; i < request.queries_size(); ++i) {
    const v1::Query& q = request.queries(i);
    const v1::Visibility empty;
    const v1::Visibility& v = i < response.visible_size() ? response.visible(i) : empty;
    std::printf(
        "group %d query seq %" PRId64 " pos %d%s: %d visible: %s\n", group, q.seq(), q.pos(),
        q.non_causal() ? " (non-causal)" : "", v.positions_size(),
        FormatPositions(std::vector<int32_t>(v.positions().begin(), v.positions().end())).c_str());
  }
  return absl::OkStatus();
}

absl::Status Ctl::CopyPrefix(const Args& args) {
  v1::CopyPrefixRequest request;
  ASSIGN_OR_RETURN(*request.mutable_cache(), GetCacheName(args));
  ASSIGN_OR_RETURN(int64_t src, args.GetInt("src"));
  ASSIGN_OR_RETURN(int64_t dst, args.GetInt("dst"));
  ASSIGN_OR_RETURN(int32_t length, GetInt32(args, "length"));
  request.set_src_seq(src);
  request.set_dst_seq(dst);
  request.set_length(length);
  ASSIGN_OR_RETURN(*request.mutable_source_node(), args.GetString("source-node", ""));
  v1::CopyPrefixResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(stub_->CopyPrefix(Context().get(), request, &response)));
  if (json_) return PrintJson(response);
  std::printf(
      "copied positions < %d of seq %" PRId64 "%s to seq %" PRId64 "\n", length, src,
      request.source_node().empty() ? "" : absl::StrCat(" on node ", request.source_node()).c_str(),
      dst);
  if (response.has_transfer()) {
    std::printf("transfer: %s\n", TransferLine(response.transfer()).c_str());
  }
  return absl::OkStatus();
}

absl::Status Ctl::Remove(const Args& args) {
  v1::RemoveRequest request;
  ASSIGN_OR_RETURN(*request.mutable_cache(), GetCacheName(args));
  ASSIGN_OR_RETURN(int64_t seq, args.GetInt("seq"));
  ASSIGN_OR_RETURN(int32_t begin, GetInt32(args, "begin"));
  request.set_seq(seq);
  request.set_begin(begin);
  if (args.Has("end")) {
    ASSIGN_OR_RETURN(int32_t end, GetInt32(args, "end"));
    request.set_end(end);
  }
  if (auto scope = args.Get("scope")) {
    ASSIGN_OR_RETURN(v1::RemoveScope parsed, ParseRemoveScope(*scope));
    request.set_scope(parsed);
  }
  v1::RemoveResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(stub_->Remove(Context().get(), request, &response)));
  if (json_) return PrintJson(response);
  if (request.scope() == v1::REMOVE_SCOPE_CLUSTER) {
    std::printf("%s seq %" PRId64 " on %d nodes:\n",
                request.has_end()
                    ? absl::StrCat("remove [", begin, ", ", request.end(), ") of").c_str()
                    : absl::StrCat("truncate at ", begin, " of").c_str(),
                seq, response.nodes_size());
    for (const v1::NodeResult& node : response.nodes()) {
      std::printf("  %s\n", NodeResultLine(node).c_str());
    }
    return absl::OkStatus();
  }
  if (request.has_end()) {
    std::printf("removed [%d, %d) from seq %" PRId64 "; later positions moved down by %d\n", begin,
                request.end(), seq, request.end() - begin);
  } else {
    std::printf("truncated seq %" PRId64 " at %d\n", seq, begin);
  }
  return absl::OkStatus();
}

absl::Status Ctl::CanResume(const Args& args) {
  ASSIGN_OR_RETURN(std::string cache, GetCacheName(args));
  ASSIGN_OR_RETURN(int64_t seq, args.GetInt("seq"));
  ASSIGN_OR_RETURN(std::vector<int32_t> positions, GetPositions(args, "pos"));
  for (int32_t pos : positions) {
    v1::CanResumeRequest request;
    request.set_cache(cache);
    request.set_seq(seq);
    request.set_pos(pos);
    v1::CanResumeResponse response;
    RETURN_IF_ERROR(FromGrpcStatus(stub_->CanResume(Context().get(), request, &response)));
    if (json_) {
      RETURN_IF_ERROR(PrintJson(response));
    } else {
      std::printf("can-resume seq %" PRId64 " pos %d: %s\n", seq, pos,
                  response.can_resume() ? "true" : "false");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<int32_t> Ctl::FetchOffset(const std::string& cache, int64_t seq) const {
  v1::ListSequencesRequest request;
  request.set_cache(cache);
  v1::ListSequencesResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(stub_->ListSequences(Context().get(), request, &response)));
  for (const v1::SequenceInfo& s : response.sequences()) {
    if (s.seq() == seq) return s.offset();
  }
  return absl::NotFoundError(
      absl::StrCat("seq ", seq, " is not listed by cache ", cache, " (needed for its offset)"));
}

absl::Status Ctl::ListSequences(const Args& args) {
  v1::ListSequencesRequest request;
  ASSIGN_OR_RETURN(*request.mutable_cache(), GetCacheName(args));
  v1::ListSequencesResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(stub_->ListSequences(Context().get(), request, &response)));
  if (json_) return PrintJson(response);
  ASSIGN_OR_RETURN(v1::CacheInfo info, FetchInfo(request.cache()));
  std::printf("%-8s %7s %7s  %s\n", "SEQ", "OFFSET", "PENDING",
              "PER GROUP: stored (shared) [first, last] | recurrent: state (shared)");
  for (const v1::SequenceInfo& s : response.sequences()) {
    std::vector<std::string> groups;
    for (const v1::GroupSequence& g : s.groups()) {
      switch (GroupKindOf(info.spec(), g.group())) {
        case v1::LayerGroup::kRecurrent:
          groups.push_back(absl::StrCat("g", g.group(), ": state ", StateText(g.state()),
                                        g.shared() > 0 ? " (shared)" : ""));
          break;
        case v1::LayerGroup::kRotating:
          groups.push_back(absl::StrCat("g", g.group(), ": ring ", g.stored(), " (", g.shared(),
                                        ") [", g.first(), ", ", g.last(), "]"));
          break;
        default:
          groups.push_back(absl::StrCat("g", g.group(), ": ", g.stored(), " (", g.shared(), ") [",
                                        g.first(), ", ", g.last(), "]"));
      }
    }
    std::printf("%-8" PRId64 " %7d %7d  %s\n", s.seq(), s.offset(), s.pending(),
                absl::StrJoin(groups, "  ").c_str());
  }
  if (response.sequences().empty()) std::printf("(no sequences)\n");
  return absl::OkStatus();
}

// One line describing a snapshot: id, source, range, bytes and what each group holds.
std::string SnapshotLine(const v1::SnapshotInfo& snap, const v1::CacheSpec& spec) {
  std::vector<std::string> groups;
  for (const v1::SnapshotGroup& g : snap.groups()) {
    switch (GroupKindOf(spec, g.group())) {
      case v1::LayerGroup::kRecurrent:
        groups.push_back(absl::StrCat("g", g.group(), ": state ", StateText(g.state())));
        break;
      case v1::LayerGroup::kRotating:
        groups.push_back(
            absl::StrCat("g", g.group(), ": window ", g.stored(), ", ring index ", g.ring_index()));
        break;
      default:
        groups.push_back(absl::StrCat("g", g.group(), ": ", g.stored(), " positions"));
    }
  }
  return absl::StrCat("snapshot ", snap.id(), ": seq ", snap.seq(), " [", snap.from_offset(), ", ",
                      snap.to_offset(), "), ", Mib(snap.bytes()), "; ",
                      absl::StrJoin(groups, ", "));
}

// A snapshot id flag: > 0.
absl::StatusOr<uint64_t> GetSnapshotId(const Args& args, absl::string_view name) {
  ASSIGN_OR_RETURN(int64_t id, args.GetInt(name));
  if (id <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", name, "=", id, " is not a snapshot id (> 0)"));
  }
  return static_cast<uint64_t>(id);
}

absl::Status Ctl::Snapshot(const Args& args) {
  v1::SnapshotRequest request;
  ASSIGN_OR_RETURN(*request.mutable_cache(), GetCacheName(args));
  ASSIGN_OR_RETURN(int64_t seq, args.GetInt("seq"));
  ASSIGN_OR_RETURN(int32_t from, GetInt32(args, "from", 0));
  request.set_seq(seq);
  request.set_from_offset(from);
  v1::SnapshotResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(stub_->Snapshot(Context().get(), request, &response)));
  if (json_) return PrintJson(response);
  ASSIGN_OR_RETURN(v1::CacheInfo info, FetchInfo(request.cache()));
  std::printf("took %s\n", SnapshotLine(response.snapshot(), info.spec()).c_str());
  return absl::OkStatus();
}

absl::Status Ctl::Restore(const Args& args) {
  v1::RestoreRequest request;
  ASSIGN_OR_RETURN(*request.mutable_cache(), GetCacheName(args));
  ASSIGN_OR_RETURN(int64_t seq, args.GetInt("seq"));
  ASSIGN_OR_RETURN(int32_t target, GetInt32(args, "target"));
  request.set_seq(seq);
  request.set_target(target);
  if (args.Has("snapshot")) {
    ASSIGN_OR_RETURN(uint64_t id, GetSnapshotId(args, "snapshot"));
    request.set_snapshot_id(id);
  }
  v1::RestoreResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(stub_->Restore(Context().get(), request, &response)));
  if (json_) return PrintJson(response);
  if (request.has_snapshot_id()) {
    std::printf("restored seq %" PRId64 " from snapshot %" PRIu64 " up to %d\n", seq,
                request.snapshot_id(), target);
  } else {
    std::printf("rewound seq %" PRId64 " to %d\n", seq, target);
  }
  return absl::OkStatus();
}

absl::Status Ctl::MergeSnapshots(const Args& args) {
  v1::MergeSnapshotsRequest request;
  ASSIGN_OR_RETURN(*request.mutable_cache(), GetCacheName(args));
  ASSIGN_OR_RETURN(uint64_t parent, GetSnapshotId(args, "parent"));
  ASSIGN_OR_RETURN(uint64_t child, GetSnapshotId(args, "child"));
  request.set_parent(parent);
  request.set_child(child);
  v1::MergeSnapshotsResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(stub_->MergeSnapshots(Context().get(), request, &response)));
  if (json_) return PrintJson(response);
  ASSIGN_OR_RETURN(v1::CacheInfo info, FetchInfo(request.cache()));
  std::printf("merged snapshots %" PRIu64 " + %" PRIu64 " (both consumed) into %s\n", parent, child,
              SnapshotLine(response.snapshot(), info.spec()).c_str());
  return absl::OkStatus();
}

absl::Status Ctl::SplitSnapshot(const Args& args) {
  v1::SplitSnapshotRequest request;
  ASSIGN_OR_RETURN(*request.mutable_cache(), GetCacheName(args));
  ASSIGN_OR_RETURN(uint64_t id, GetSnapshotId(args, "snapshot"));
  ASSIGN_OR_RETURN(int32_t at, GetInt32(args, "at"));
  request.set_snapshot_id(id);
  request.set_at(at);
  v1::SplitSnapshotResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(stub_->SplitSnapshot(Context().get(), request, &response)));
  if (json_) return PrintJson(response);
  ASSIGN_OR_RETURN(v1::CacheInfo info, FetchInfo(request.cache()));
  std::printf("split snapshot %" PRIu64 " at %d (consumed)\n", id, at);
  std::printf("  parent: %s\n", response.has_parent()
                                    ? SnapshotLine(response.parent(), info.spec()).c_str()
                                    : "none");
  std::printf("  child:  %s\n",
              response.has_child() ? SnapshotLine(response.child(), info.spec()).c_str() : "none");
  return absl::OkStatus();
}

absl::Status Ctl::DropSnapshot(const Args& args) {
  v1::DropSnapshotRequest request;
  ASSIGN_OR_RETURN(*request.mutable_cache(), GetCacheName(args));
  ASSIGN_OR_RETURN(uint64_t id, GetSnapshotId(args, "snapshot"));
  request.set_snapshot_id(id);
  v1::DropSnapshotResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(stub_->DropSnapshot(Context().get(), request, &response)));
  if (json_) return PrintJson(response);
  std::printf("dropped snapshot %" PRIu64 "\n", id);
  return absl::OkStatus();
}

absl::Status Ctl::ListSnapshots(const Args& args) {
  v1::ListSnapshotsRequest request;
  ASSIGN_OR_RETURN(*request.mutable_cache(), GetCacheName(args));
  v1::ListSnapshotsResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(stub_->ListSnapshots(Context().get(), request, &response)));
  if (json_) return PrintJson(response);
  ASSIGN_OR_RETURN(v1::CacheInfo info, FetchInfo(request.cache()));
  for (const v1::SnapshotInfo& snap : response.snapshots()) {
    std::printf("%s\n", SnapshotLine(snap, info.spec()).c_str());
  }
  if (response.snapshots().empty()) std::printf("(no snapshots)\n");
  std::printf("pool: %d snapshots, %s\n", info.usage().snapshots(),
              Mib(info.usage().snapshot_bytes()).c_str());
  return absl::OkStatus();
}

absl::Status Ctl::CommitSpeculation(const Args& args) {
  v1::CommitSpeculationRequest request;
  ASSIGN_OR_RETURN(*request.mutable_cache(), GetCacheName(args));
  ASSIGN_OR_RETURN(int64_t seq, args.GetInt("seq"));
  ASSIGN_OR_RETURN(int32_t accepted, GetInt32(args, "accepted"));
  request.set_seq(seq);
  request.set_accepted(accepted);
  v1::CommitSpeculationResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(stub_->CommitSpeculation(Context().get(), request, &response)));
  if (json_) return PrintJson(response);
  std::printf("committed %d pending tokens of seq %" PRId64 "; offset now %d\n", accepted, seq,
              response.offset());
  return absl::OkStatus();
}

absl::Status Ctl::Health(const Args& args) {
  ASSIGN_OR_RETURN(std::string service, args.GetString("service", ""));
  ServingStatus status;
  RETURN_IF_ERROR(FromGrpcStatus(health_.Check(Context().get(), service, &status)));
  if (json_) {
    std::printf("{\"status\":\"%s\"}\n", ServingStatusName(status));
  } else {
    std::printf("%s%s\n", service.empty() ? "" : (service + ": ").c_str(),
                ServingStatusName(status));
  }
  return absl::OkStatus();
}

absl::Status Ctl::ListMembers(const Args&) {
  v1::ListMembersResponse response;
  RETURN_IF_ERROR(
      FromGrpcStatus(stub_->ListMembers(Context().get(), v1::ListMembersRequest(), &response)));
  if (json_) return PrintJson(response);
  std::fputs(MembersTable(response).c_str(), stdout);
  return absl::OkStatus();
}

absl::Status Ctl::Migrate(const Args& args) {
  v1::MigrateRequest request;
  ASSIGN_OR_RETURN(*request.mutable_cache(), GetCacheName(args));
  ASSIGN_OR_RETURN(int64_t seq, args.GetInt("seq"));
  ASSIGN_OR_RETURN(int64_t target_seq, args.GetInt("target-seq", seq));
  ASSIGN_OR_RETURN(*request.mutable_target_node(), args.GetString("target-node"));
  ASSIGN_OR_RETURN(bool keep_source, args.GetBool("keep-source"));
  request.set_seq(seq);
  request.set_target_seq(target_seq);
  request.set_keep_source(keep_source);
  v1::MigrateResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(stub_->Migrate(Context().get(), request, &response)));
  if (json_) return PrintJson(response);
  std::printf("migrated seq %" PRId64 " to node %s as seq %" PRId64 "%s\n", seq,
              request.target_node().c_str(), target_seq,
              keep_source ? " (source kept)" : " (removed here)");
  if (response.has_transfer()) {
    std::printf("transfer: %s\n", TransferLine(response.transfer()).c_str());
  }
  return absl::OkStatus();
}

absl::Status Ctl::MigrateSnapshot(const Args& args) {
  v1::MigrateSnapshotRequest request;
  ASSIGN_OR_RETURN(*request.mutable_cache(), GetCacheName(args));
  ASSIGN_OR_RETURN(uint64_t id, GetSnapshotId(args, "snapshot"));
  ASSIGN_OR_RETURN(*request.mutable_target_node(), args.GetString("target-node"));
  ASSIGN_OR_RETURN(bool keep_source, args.GetBool("keep-source"));
  request.set_snapshot_id(id);
  request.set_keep_source(keep_source);
  v1::MigrateSnapshotResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(stub_->MigrateSnapshot(Context().get(), request, &response)));
  if (json_) return PrintJson(response);
  std::printf("migrated snapshot %" PRIu64 " to node %s as snapshot %" PRIu64 "%s\n", id,
              request.target_node().c_str(), response.snapshot().id(),
              keep_source ? " (source kept)" : " (dropped here)");
  // The snapshot's groups follow the cache's spec, which this node has too.
  auto info = FetchInfo(request.cache());
  if (info.ok()) {
    std::printf("  on %s: %s\n", request.target_node().c_str(),
                SnapshotLine(response.snapshot(), info->spec()).c_str());
  }
  if (response.has_transfer()) {
    std::printf("transfer: %s\n", TransferLine(response.transfer()).c_str());
  }
  return absl::OkStatus();
}

// ---- dispatch ------------------------------------------------------------------------------

struct CommandDef {
  absl::string_view name;
  std::vector<absl::string_view> flags;  // besides the global ones
  absl::Status (Ctl::*run)(const Args&);
};

const std::vector<CommandDef>& Commands() {
  static const auto* const kCommands = new std::vector<CommandDef>{
      {"create",
       {"name", "cache", "dtype", "max-sequences", "capacity", "max-batch", "group", "spec-json"},
       &Ctl::Create},
      {"delete", {"cache", "name"}, &Ctl::Delete},
      {"get", {"cache", "name"}, &Ctl::Get},
      {"list", {}, &Ctl::List},
      {"usage", {"cache", "name"}, &Ctl::Usage},
      {"append",
       {"cache", "name", "seq", "positions", "seed", "payload-file", "batch", "stream",
        "chunk-bytes", "speculative"},
       &Ctl::Append},
      {"read",
       {"cache", "name", "seq", "begin", "end", "out", "verify-seed", "max-chunk-bytes"},
       &Ctl::Read},
      {"visible", {"cache", "name", "group", "query", "seq", "pos", "non-causal"}, &Ctl::Visible},
      {"copy-prefix", {"cache", "name", "src", "dst", "length", "source-node"}, &Ctl::CopyPrefix},
      {"remove", {"cache", "name", "seq", "begin", "end", "scope"}, &Ctl::Remove},
      {"can-resume", {"cache", "name", "seq", "pos"}, &Ctl::CanResume},
      {"list-sequences", {"cache", "name"}, &Ctl::ListSequences},
      {"snapshot", {"cache", "name", "seq", "from"}, &Ctl::Snapshot},
      {"restore", {"cache", "name", "seq", "snapshot", "target"}, &Ctl::Restore},
      {"merge-snapshots", {"cache", "name", "parent", "child"}, &Ctl::MergeSnapshots},
      {"split-snapshot", {"cache", "name", "snapshot", "at"}, &Ctl::SplitSnapshot},
      {"drop-snapshot", {"cache", "name", "snapshot"}, &Ctl::DropSnapshot},
      {"list-snapshots", {"cache", "name"}, &Ctl::ListSnapshots},
      {"commit-speculation", {"cache", "name", "seq", "accepted"}, &Ctl::CommitSpeculation},
      {"health", {"service"}, &Ctl::Health},
      {"list-members", {}, &Ctl::ListMembers},
      {"migrate",
       {"cache", "name", "seq", "target-node", "target-seq", "keep-source"},
       &Ctl::Migrate},
      {"migrate-snapshot",
       {"cache", "name", "snapshot", "target-node", "keep-source"},
       &Ctl::MigrateSnapshot},
  };
  return *kCommands;
}

void PrintError(const absl::Status& status) {
  std::fprintf(stderr, "error: %s: %s\n", absl::StatusCodeToString(status.code()).c_str(),
               std::string(status.message()).c_str());
}

int Main(int argc, char** argv) {
  auto parsed = Args::Parse(argc, argv, kBoolFlags);
  if (!parsed.ok()) {
    PrintError(parsed.status());
    std::fprintf(stderr, "run 'kvmeshctl help' for the usage\n");
    return 2;
  }
  const Args& args = *parsed;
  if (args.command().empty() || args.command() == "help" || args.Has("help")) {
    std::fputs(kUsage, args.command().empty() && !args.Has("help") ? stderr : stdout);
    return args.command().empty() && !args.Has("help") ? 2 : 0;
  }
  const CommandDef* command = nullptr;
  for (const CommandDef& c : Commands()) {
    if (c.name == args.command()) command = &c;
  }
  if (command == nullptr) {
    PrintError(absl::InvalidArgumentError(absl::StrCat("unknown command '", args.command(), "'")));
    std::fprintf(stderr, "run 'kvmeshctl help' for the usage\n");
    return 2;
  }
  std::vector<absl::string_view> allowed = {"addr", "timeout", "json", "help"};
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
  grpc::ChannelArguments channel_args;
  channel_args.SetMaxReceiveMessageSize(-1);  // responses are bounded by the server's chunking
  channel_args.SetMaxSendMessageSize(-1);     // the server enforces its own limit
  Ctl ctl(grpc::CreateCustomChannel(*addr, grpc::InsecureChannelCredentials(), channel_args),
          *timeout, *json);
  absl::Status status = (ctl.*(command->run))(args);
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

#include "tests/fuzz/rpc_format.h"

#include <algorithm>

namespace kvmesh {
namespace fuzz {
namespace {

void AppendBytes(std::string* out, const std::string& bytes) {
  const size_t n = std::min<size_t>(bytes.size(), 0xFFFF);
  out->push_back(static_cast<char>(n & 0xFF));
  out->push_back(static_cast<char>(n >> 8));
  out->append(bytes, 0, n);
}

}  // namespace

const char* RpcName(Rpc rpc) {
  static constexpr const char* kNames[kRpcCount] = {"CreateCache",
                                                    "DeleteCache",
                                                    "GetCache",
                                                    "ListCaches",
                                                    "Append",
                                                    "AppendStream",
                                                    "Read",
                                                    "Visible",
                                                    "CopyPrefix",
                                                    "Remove",
                                                    "CanResume",
                                                    "ListSequences",
                                                    "Snapshot",
                                                    "Restore",
                                                    "MergeSnapshots",
                                                    "SplitSnapshot",
                                                    "DropSnapshot",
                                                    "ListSnapshots",
                                                    "CommitSpeculation",
                                                    "Migrate",
                                                    "MigrateSnapshot",
                                                    "ListMembers",
                                                    "Reserve",
                                                    "SetRetention",
                                                    "LookupPrefix",
                                                    "NodeInfo",
                                                    "Export",
                                                    "Fetch",
                                                    "Release",
                                                    "Pull",
                                                    "NcclConnect",
                                                    "NcclSend",
                                                    "PeerService.Remove",
                                                    "PeerService.LookupPrefix",
                                                    "Place"};
  return kNames[static_cast<int>(rpc)];
}

std::vector<v1::CacheSpec> BaselineSpecs() {
  std::vector<v1::CacheSpec> specs(2);
  v1::CacheSpec& attn = specs[0];
  attn.set_name("attn");
  attn.set_dtype(v1::DTYPE_F16);
  attn.set_max_sequences(4);
  attn.set_capacity(16);
  attn.set_max_batch(8);
  attn.set_token_block_size(2);
  v1::LayerGroup* g = attn.add_groups();
  g->set_num_layers(2);
  v1::Attention* a = g->mutable_attention();
  a->set_num_kv_heads(1);
  a->set_head_dim_k(4);
  a->set_head_dim_v(4);
  a->mutable_window()->mutable_full();
  a->mutable_rope()->set_type(v1::ROPE_TYPE_NEOX);
  a->mutable_rope()->set_dims(4);
  a->mutable_rope()->set_base(10000.0f);
  a->mutable_rope()->set_freq_scale(1.0f);

  v1::CacheSpec& hybrid = specs[1];
  hybrid.set_name("hybrid");
  hybrid.set_dtype(v1::DTYPE_BF16);
  hybrid.set_max_sequences(3);
  hybrid.set_capacity(12);
  hybrid.set_max_batch(6);
  hybrid.set_token_block_size(2);
  g = hybrid.add_groups();
  g->set_num_layers(1);
  a = g->mutable_attention();
  a->set_num_kv_heads(1);
  a->set_head_dim_k(2);
  a->set_head_dim_v(2);
  a->mutable_window()->mutable_sliding()->set_window(3);
  g = hybrid.add_groups();
  g->set_num_layers(1);
  v1::Rotating* r = g->mutable_rotating();
  r->set_num_kv_heads(1);
  r->set_head_dim_k(2);
  r->set_head_dim_v(2);
  r->set_max_size(4);
  r->mutable_rope()->set_type(v1::ROPE_TYPE_NORMAL);
  r->mutable_rope()->set_dims(2);
  r->mutable_rope()->set_base(10000.0f);
  r->mutable_rope()->set_freq_scale(1.0f);
  g = hybrid.add_groups();
  g->set_num_layers(1);
  v1::Recurrent* rec = g->mutable_recurrent();
  rec->set_conv_tail(1);
  rec->set_conv_dim(2);
  rec->set_num_v_heads(1);
  rec->set_head_v_dim(2);
  rec->set_head_k_dim(2);
  return specs;
}

std::vector<BaselineCache> BaselineCaches() {
  return {{"default", "attn"}, {"default", "hybrid"}, {"t1", "attn"}};
}

std::vector<BaselineSequence> BaselineSequences() {
  return {{"default", "attn", 0, 0, 6},
          {"default", "attn", 1, 0, 3},
          {"default", "hybrid", 0, 0, 5},
          {"t1", "attn", 0, 0, 6},
          {"t1", "attn", 1, 0, 3}};
}

void AppendRecord(std::string* input, Rpc rpc, const google::protobuf::Message& request,
                  Principal principal) {
  input->push_back(
      static_cast<char>(static_cast<int>(rpc) + kRpcCount * static_cast<int>(principal)));
  AppendBytes(input, request.SerializeAsString());
}

void AppendStreamRecord(std::string* input, const std::vector<v1::AppendStreamRequest>& stream,
                        Principal principal) {
  std::string body;
  for (const v1::AppendStreamRequest& m : stream) AppendBytes(&body, m.SerializeAsString());
  input->push_back(static_cast<char>(static_cast<int>(Rpc::kAppendStream) +
                                     kRpcCount * static_cast<int>(principal)));
  AppendBytes(input, body);
}

}  // namespace fuzz
}  // namespace kvmesh

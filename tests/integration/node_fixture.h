// NodeSuite: a GoogleTest fixture that runs one kvmesh-node for all the tests of a suite and
// checks, when the suite ends, that the node shuts down cleanly on SIGTERM (exit code 0: no
// crash, no sanitizer report). A suite starts its node with its own flags from
// SetUpTestSuite(); one node at a time per test binary.
//
// Thread safety: node() and stub() may be used from any thread of a test.
#ifndef KVMESH_TESTS_INTEGRATION_NODE_FIXTURE_H_
#define KVMESH_TESTS_INTEGRATION_NODE_FIXTURE_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "tests/integration/client_util.h"
#include "tests/testing/node_process.h"

// Asserts that a grpc::Status expression is OK, printing its code and message otherwise.
#define KVMESH_ASSERT_OK(expr)                                                                 \
  do {                                                                                         \
    const ::grpc::Status kvmesh_s_ = (expr);                                                   \
    ASSERT_TRUE(kvmesh_s_.ok()) << #expr << ": " << ::kvmesh::testutil::StatusText(kvmesh_s_); \
  } while (0)
#define KVMESH_EXPECT_OK(expr)                                                                 \
  do {                                                                                         \
    const ::grpc::Status kvmesh_s_ = (expr);                                                   \
    EXPECT_TRUE(kvmesh_s_.ok()) << #expr << ": " << ::kvmesh::testutil::StatusText(kvmesh_s_); \
  } while (0)
#define KVMESH_EXPECT_PROTO_EQ(a, b)                                          \
  EXPECT_TRUE(::google::protobuf::util::MessageDifferencer::Equals((a), (b))) \
      << "first:\n"                                                           \
      << (a).DebugString() << "second:\n"                                     \
      << (b).DebugString()

namespace kvmesh {
namespace testutil {

class NodeSuite : public ::testing::Test {
 protected:
  // Starts the suite's node with `extra_args`; call from SetUpTestSuite.
  static void StartNode(std::vector<std::string> extra_args) {
    NodeProcess::Options options;
    options.node_name = "it-node";
    options.extra_args = std::move(extra_args);
    absl::StatusOr<std::unique_ptr<NodeProcess>> node = NodeProcess::Start(options);
    ASSERT_TRUE(node.ok()) << node.status();
    node_ = std::move(*node).release();
    stub_ = node_->NewStub().release();
  }

  static void StopNode() {
    if (node_ == nullptr) return;
    // Closing the client's connection first lets the node finish its shutdown at once; an
    // idle client channel only answers the server's GOAWAY when gRPC's backup poller runs.
    delete stub_;
    stub_ = nullptr;
    node_->ReleaseChannel();
    const ExitStatus status = node_->Stop();
    EXPECT_TRUE(status.clean()) << "kvmesh-node " << status.ToString() << "; stderr:\n"
                                << node_->ReadStderr();
    delete node_;
    node_ = nullptr;
  }

  static void TearDownTestSuite() { StopNode(); }

  void SetUp() override {
    ASSERT_NE(node_, nullptr) << "the suite's kvmesh-node did not start";
    ASSERT_TRUE(node_->Running()) << "kvmesh-node died; stderr:\n" << node_->ReadStderr();
  }

  static NodeProcess& node() { return *node_; }
  static Stub& stub() { return *stub_; }

 private:
  static inline NodeProcess* node_ = nullptr;
  static inline Stub* stub_ = nullptr;
};

}  // namespace testutil
}  // namespace kvmesh

#endif  // KVMESH_TESTS_INTEGRATION_NODE_FIXTURE_H_

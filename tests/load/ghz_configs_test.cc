// The ghz configs of deploy/load/ against a real kvmesh-node (label load; docs/load.md): the
// node is prepared by deploy/load/prepare.sh, as run.sh does, then every config must parse as
// a ghz config, name a method the node serves through server reflection, carry data that
// parses (templates rendered) as the request message, strictly, and make a call that
// succeeds. A second test plants one error per kind in copies of a config and checks that
// the checker catches each for its reason.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/load/ghz_config.h"
#include "tests/testing/node_process.h"

namespace kvmesh {
namespace loadtest {
namespace {

namespace fs = std::filesystem;
using testutil::NodeProcess;

const fs::path kLoadDir = fs::path(KVMESH_SOURCE_DIR) / "deploy" / "load";

// Runs `command` through the shell; its exit status, and its output (stdout and stderr) in
// *output.
int RunCommand(const std::string& command, std::string* output) {
  output->clear();
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return -1;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof buffer, pipe)) > 0) output->append(buffer, n);
  return pclose(pipe);
}

std::vector<fs::path> ConfigFiles() {
  std::vector<fs::path> files;
  for (const fs::path& dir : {kLoadDir, kLoadDir / "mixed"}) {
    for (const fs::directory_entry& entry : fs::directory_iterator(dir)) {
      if (entry.is_regular_file() && entry.path().extension() == ".json") {
        files.push_back(entry.path());
      }
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

class GhzConfigsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    NodeProcess::Options options;
    options.node_name = "load-node";
    // As run.sh starts its node: the cache of prepare.sh takes 2 GiB of the budget.
    options.extra_args = {"--memory-budget=3GiB"};
    absl::StatusOr<std::unique_ptr<NodeProcess>> node = NodeProcess::Start(options);
    ASSERT_TRUE(node.ok()) << node.status();
    node_ = std::move(*node).release();

    const absl::Time start = absl::Now();
    const std::string command =
        absl::StrCat("bash ", (kLoadDir / "prepare.sh").string(), " --addr=", node_->address(),
                     " --ctl=", KVMESH_CTL_PATH, " --prefix-tokens=", KVMESH_LOAD_PREFIX_TOKENS);
    std::string output;
    const int status = RunCommand(command, &output);
    ASSERT_EQ(status, 0) << command << "\n" << output;
    std::printf("%s(%s)\n", output.c_str(), absl::FormatDuration(absl::Now() - start).c_str());
    prepared_ = true;
  }

  static void TearDownTestSuite() {
    if (node_ == nullptr) return;
    node_->ReleaseChannel();
    const testutil::ExitStatus status = node_->Stop();
    EXPECT_TRUE(status.clean()) << "kvmesh-node " << status.ToString() << "; stderr:\n"
                                << node_->ReadStderr();
    delete node_;
    node_ = nullptr;
  }

  void SetUp() override {
    ASSERT_NE(node_, nullptr) << "kvmesh-node did not start";
    ASSERT_TRUE(prepared_) << "prepare.sh failed";
    ASSERT_TRUE(node_->Running()) << "kvmesh-node died; stderr:\n" << node_->ReadStderr();
  }

  static NodeProcess& node() { return *node_; }

  // Writes `text` as NAME.json in a fresh directory of this test; returns its path.
  std::string WriteConfig(const std::string& name, const std::string& text) {
    const fs::path dir = fs::path(::testing::TempDir()) / "ghz_configs_test";
    fs::create_directories(dir);
    const fs::path path = dir / (name + ".json");
    std::ofstream(path) << text;
    return path.string();
  }

 private:
  static inline NodeProcess* node_ = nullptr;
  static inline bool prepared_ = false;
};

TEST(RenderCallTemplateTest, RendersTheActionsTheConfigsUse) {
  absl::StatusOr<std::string> out = RenderCallTemplate(
      R"({"seq":"{{.RequestNumber}}","pos":"{{ .RequestNumber }}","p":"{{repeat 3 `AB`}}="})", 17);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, R"({"seq":"17","pos":"17","p":"ABABAB="})");
  EXPECT_EQ(*RenderCallTemplate("{{repeat 2 \"x\"}}{{repeat 0 `y`}}", 0), "xx");
  EXPECT_EQ(*RenderCallTemplate("no actions", 5), "no actions");
  for (const char* bad : {"{{.WorkerID}}", "{{repeat `A`}}", "{{repeat 3 A}}", "{{.RequestNumber",
                          "{{- .RequestNumber}}", "{{newUUID}}"}) {
    EXPECT_FALSE(RenderCallTemplate(bad, 0).ok()) << bad;
  }
}

TEST_F(GhzConfigsTest, EveryConfigResolvesParsesAndSucceeds) {
  const std::vector<fs::path> files = ConfigFiles();
  GhzConfigChecker checker(node().NewChannel());
  std::set<std::string> single, mixed;
  for (const fs::path& file : files) {
    SCOPED_TRACE(file.string());
    const absl::Time start = absl::Now();
    absl::StatusOr<GhzConfig> config = LoadGhzConfig(file.string());
    ASSERT_TRUE(config.ok()) << config.status();
    const absl::Status checked = checker.Check(*config);
    EXPECT_TRUE(checked.ok()) << checked;
    (file.parent_path().filename() == "mixed" ? mixed : single).insert(config->method);
    std::printf("%-60s %-45s %zu call(s) %s\n", fs::relative(file, kLoadDir).c_str(),
                config->call.c_str(), config->data.size(),
                absl::FormatDuration(absl::Now() - start).c_str());
  }
  // The scheduler's hot paths, alone and in the mixed profile; alone also the rest of the
  // control calls run.sh compares with Health/Check.
  const std::set<std::string> hot = {"Append", "CanResume", "CopyPrefix", "GetCache",
                                     "ListSequences"};
  std::set<std::string> control = hot;
  control.insert({"ListMembers", "Remove", "Visible"});
  EXPECT_EQ(single, control);
  EXPECT_EQ(mixed, hot);
}

TEST_F(GhzConfigsTest, PlantedErrorsAreCaughtForTheirReason) {
  const std::string good = R"({
    "call": "kvmesh.v1.CacheService.CanResume",
    "insecure": true,
    "data": {"cache": "load-llama3-8b", "seq": 0, "pos": 4096},
    "concurrency": 2,
    "duration": "1s"
  })";
  struct Plant {
    std::string name;
    std::string from, to;  // the edit of `good` (or of the Append config)
    std::string want;      // a part of the error that names the planted mistake
    bool append = false;
  };
  const std::vector<Plant> plants = {
      {"misspelled_method", "CacheService.CanResume", "CacheService.CanResme",
       "has no method 'CanResme'"},
      {"misspelled_service", "CacheService.CanResume", "CacheServce.CanResume",
       "service kvmesh.v1.CacheServce is not served"},
      {"unknown_field", R"("pos": 4096)", R"("position": 4096)",
       "does not parse as kvmesh.v1.CanResumeRequest: position: Cannot find field"},
      {"wrong_type", R"("seq": 0)", R"("seq": "zero")",
       "does not parse as kvmesh.v1.CanResumeRequest: (seq): invalid value \"zero\""},
      {"failing_call", R"("cache": "load-llama3-8b")", R"("cache": "no-such-cache")",
       "the call /kvmesh.v1.CacheService/CanResume failed: NOT_FOUND"},
      {"unknown_option", R"("concurrency": 2)", R"("concurency": 2)",
       "unknown ghz option \"concurency\""},
      {"bad_duration", R"("duration": "1s")", R"("duration": "1 s")", "must be a Go duration"},
      {"plaintext_missing", R"("insecure": true)", R"("insecure": false)", "\"insecure\": true"},
      {"unsupported_template", R"("seq": 0)", R"("seq": "{{.WorkerID}}")",
       "unsupported template action {{.WorkerID}}"},
      {"trailing_comma", R"("duration": "1s")", R"("duration": "1s",)", "not valid JSON"},
      {"duplicate_key", R"("concurrency": 2)", R"("concurrency": 2, "concurrency": 4)",
       "the key \"concurrency\" appears twice"},
      // The Append config with a payload one token short: the node refuses its size.
      {"short_payload", "{{repeat 699051 `A`}}=", "{{repeat 524288 `A`}}",
       "the call /kvmesh.v1.CacheService/Append failed: INVALID_ARGUMENT", true},
  };

  std::string append_text;
  {
    std::ifstream in(kLoadDir / "append.json");
    append_text.assign(std::istreambuf_iterator<char>(in), {});
    ASSERT_TRUE(absl::StrContains(append_text, "{{repeat 699051 `A`}}="));
  }

  GhzConfigChecker checker(node().NewChannel());
  // The control: the unedited config passes, so a planted config fails for its edit alone.
  {
    absl::StatusOr<GhzConfig> config = LoadGhzConfig(WriteConfig("good", good));
    ASSERT_TRUE(config.ok()) << config.status();
    const absl::Status checked = checker.Check(*config);
    ASSERT_TRUE(checked.ok()) << checked;
  }
  for (const Plant& plant : plants) {
    SCOPED_TRACE(plant.name);
    const std::string& base = plant.append ? append_text : good;
    ASSERT_TRUE(absl::StrContains(base, plant.from)) << plant.from;
    const std::string path =
        WriteConfig(plant.name, absl::StrReplaceAll(base, {{plant.from, plant.to}}));
    absl::StatusOr<GhzConfig> config = LoadGhzConfig(path);
    absl::Status status = config.status();
    if (config.ok()) status = checker.Check(*config);
    ASSERT_FALSE(status.ok()) << "the planted " << plant.name << " was not caught";
    EXPECT_TRUE(absl::StrContains(status.message(), plant.want))
        << "caught, but not for the planted reason: " << status;
    std::printf("%-22s caught: %s\n", plant.name.c_str(),
                std::string(status.message().substr(0, 160)).c_str());
  }
}

}  // namespace
}  // namespace loadtest
}  // namespace kvmesh

// Certificates made at test time with the `openssl` command (Debian's openssl package), for the
// TLS tests: a temporary directory, certificate authorities, and leaf certificates they sign
// with the names a test needs (DNS:node-a, IP:127.0.0.1, a non-member "mallory", ...). Keys are
// EC P-256 (fast to make); nothing is committed to the repository and nothing outlives the test.
//
// Thread safety: TempDir is immutable after Create. TestCa::Issue is not thread-safe (it counts
// serial numbers); the free functions are.
#ifndef KVMESH_TESTS_TESTING_CERTS_H_
#define KVMESH_TESTS_TESTING_CERTS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvmesh {
namespace testutil {

// A new directory under $TEST_TMPDIR (or /tmp), removed with its content by the destructor.
class TempDir {
 public:
  static absl::StatusOr<std::unique_ptr<TempDir>> Create(const std::string& prefix = "kvmesh");
  ~TempDir();

  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  // path() + "/" + name.
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  explicit TempDir(std::string path) : path_(std::move(path)) {}
  const std::string path_;
};

// A certificate file and its private key file (PEM).
struct CertFiles {
  std::string cert;
  std::string key;
};

struct LeafOptions {
  std::string common_name;
  // subjectAltName entries as openssl spells them: "DNS:node-a", "IP:127.0.0.1". May be empty.
  std::vector<std::string> sans;
  std::string extended_key_usage = "serverAuth,clientAuth";
  // Validity from now; negative: expired that many days ago.
  int days = 2;
  // The certificate's serial number; 0: a fresh one (distinct within a TestCa).
  uint64_t serial = 0;
};

// A self-signed CA whose key signs leaves. Its files are <dir>/<stem>.crt and <stem>.key.
class TestCa {
 public:
  // INTERNAL with openssl's output when a command fails.
  static absl::StatusOr<std::unique_ptr<TestCa>> Create(const std::string& dir,
                                                        const std::string& stem,
                                                        const std::string& common_name);

  const std::string& cert_file() const { return files_.cert; }
  const std::string& key_file() const { return files_.key; }

  // A leaf signed by this CA, written to <dir>/<stem>.crt and <stem>.key (replacing them).
  absl::StatusOr<CertFiles> Issue(const std::string& stem, const LeafOptions& options);

 private:
  TestCa(std::string dir, CertFiles files) : dir_(std::move(dir)), files_(std::move(files)) {}

  const std::string dir_;
  const CertFiles files_;
  uint64_t next_serial_ = 1000;
};

// How a command ended: its exit code (-1 when a signal killed it) and its stdout and stderr
// together.
struct CommandResult {
  int exit_code = -1;
  std::string output;
};

// Runs `argv` (argv[0] looked up in PATH unless it holds a '/') to completion, with this
// process's environment and `env` ("NAME=value") set or replaced in it ("NAME" alone: removed).
// INTERNAL when it cannot be started.
absl::StatusOr<CommandResult> RunProcess(const std::vector<std::string>& argv,
                                         const std::vector<std::string>& env = {});

// RunProcess, and INTERNAL naming the command and quoting its output when it does not exit
// with 0; its output otherwise.
absl::StatusOr<std::string> RunCommand(const std::vector<std::string>& argv);

// The whole content of a file; NOT_FOUND when it cannot be read.
absl::StatusOr<std::string> ReadTextFile(const std::string& path);

// Replaces `path` with `content` the way certificate rotations do (a new file renamed over the
// old one), so a reader sees the old file or the new one, never a mix.
absl::Status ReplaceFile(const std::string& path, const std::string& content);

}  // namespace testutil
}  // namespace kvmesh

#endif  // KVMESH_TESTS_TESTING_CERTS_H_

#include "tests/testing/certs.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

extern char** environ;

namespace kvmesh {
namespace testutil {
namespace {

std::string TempRoot() {
  const char* tmpdir = std::getenv("TEST_TMPDIR");
  return tmpdir != nullptr && *tmpdir != '\0' ? tmpdir : "/tmp";
}

absl::Status WriteTextFile(const std::string& path, const std::string& content) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << content;
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write '", path, "'"));
  return absl::OkStatus();
}

// An openssl configuration with the sections the commands below name: a request whose subject
// comes from -subj, the extensions of a CA, and those of a leaf.
std::string OpensslConfig(const LeafOptions* leaf) {
  std::string config =
      "[req]\n"
      "distinguished_name = dn\n"
      "prompt = no\n"
      "[dn]\n"
      "CN = unused\n"
      "[ca_ext]\n"
      "basicConstraints = critical,CA:TRUE\n"
      "keyUsage = critical,keyCertSign,cRLSign\n"
      "subjectKeyIdentifier = hash\n";
  if (leaf != nullptr) {
    absl::StrAppend(&config,
                    "[leaf_ext]\n"
                    "basicConstraints = critical,CA:FALSE\n"
                    "keyUsage = critical,digitalSignature,keyEncipherment\n"
                    "extendedKeyUsage = ",
                    leaf->extended_key_usage,
                    "\n"
                    "authorityKeyIdentifier = keyid\n"
                    "subjectKeyIdentifier = hash\n");
    if (!leaf->sans.empty()) {
      absl::StrAppend(&config, "subjectAltName = ", absl::StrJoin(leaf->sans, ","), "\n");
    }
  }
  return config;
}

}  // namespace

absl::StatusOr<std::unique_ptr<TempDir>> TempDir::Create(const std::string& prefix) {
  std::string path = absl::StrCat(TempRoot(), "/", prefix, "-XXXXXX");
  if (mkdtemp(path.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp '", path, "': ", std::strerror(errno)));
  }
  return std::unique_ptr<TempDir>(new TempDir(std::move(path)));
}

TempDir::~TempDir() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

absl::StatusOr<CommandResult> RunProcess(const std::vector<std::string>& argv,
                                         const std::vector<std::string>& env) {
  std::string out_path = absl::StrCat(TempRoot(), "/kvmesh-cmd-XXXXXX");
  const int out_fd = mkostemp(out_path.data(), O_CLOEXEC);
  if (out_fd < 0) return absl::InternalError(absl::StrCat("mkostemp: ", std::strerror(errno)));
  std::vector<std::string> storage = argv;
  std::vector<char*> args;
  for (std::string& a : storage) args.push_back(a.data());
  args.push_back(nullptr);
  // This process's environment with `env` applied.
  std::vector<std::string> variables;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string variable = *entry;
    const std::string name = variable.substr(0, variable.find('='));
    bool replaced = false;
    for (const std::string& e : env) replaced |= e.substr(0, e.find('=')) == name;
    if (!replaced) variables.push_back(variable);
  }
  for (const std::string& e : env) {
    if (e.find('=') != std::string::npos) variables.push_back(e);
  }
  std::vector<char*> envp;
  for (std::string& v : variables) envp.push_back(v.data());
  envp.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, out_fd, STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, out_fd, STDERR_FILENO);
  pid_t pid = 0;
  const int spawned = posix_spawnp(&pid, args[0], &actions, nullptr, args.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  close(out_fd);
  int status = 0;
  if (spawned == 0) {
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
  }
  absl::StatusOr<std::string> output = ReadTextFile(out_path);
  unlink(out_path.c_str());
  if (spawned != 0) {
    return absl::InternalError(
        absl::StrCat("cannot run '", absl::StrJoin(argv, " "), "': ", std::strerror(spawned),
                     argv[0] == "openssl" ? " (install Debian's openssl package)" : ""));
  }
  if (!output.ok()) return output.status();
  CommandResult result;
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  result.output = *std::move(output);
  return result;
}

absl::StatusOr<std::string> RunCommand(const std::vector<std::string>& argv) {
  absl::StatusOr<CommandResult> run = RunProcess(argv);
  if (!run.ok()) return run.status();
  if (run->exit_code != 0) {
    return absl::InternalError(absl::StrCat("'", absl::StrJoin(argv, " "), "' failed (exit ",
                                            run->exit_code, "): ", run->output));
  }
  return std::move(run->output);
}

absl::StatusOr<std::string> ReadTextFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read '", path, "'"));
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

absl::Status ReplaceFile(const std::string& path, const std::string& content) {
  const std::string temporary = path + ".new";
  if (absl::Status s = WriteTextFile(temporary, content); !s.ok()) return s;
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    return absl::InternalError(
        absl::StrCat("rename '", temporary, "' to '", path, "': ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<TestCa>> TestCa::Create(const std::string& dir,
                                                       const std::string& stem,
                                                       const std::string& common_name) {
  const std::string config = absl::StrCat(dir, "/", stem, ".cnf");
  if (absl::Status s = WriteTextFile(config, OpensslConfig(nullptr)); !s.ok()) return s;
  CertFiles files{absl::StrCat(dir, "/", stem, ".crt"), absl::StrCat(dir, "/", stem, ".key")};
  absl::StatusOr<std::string> run =
      RunCommand({"openssl",     "req",      "-x509",
                  "-new",        "-config",  config,
                  "-extensions", "ca_ext",   "-newkey",
                  "ec",          "-pkeyopt", "ec_paramgen_curve:P-256",
                  "-nodes",      "-keyout",  files.key,
                  "-out",        files.cert, "-days",
                  "3",           "-subj",    absl::StrCat("/CN=", common_name)});
  if (!run.ok()) return run.status();
  return std::unique_ptr<TestCa>(new TestCa(dir, std::move(files)));
}

absl::StatusOr<CertFiles> TestCa::Issue(const std::string& stem, const LeafOptions& options) {
  const std::string base = absl::StrCat(dir_, "/", stem);
  const std::string config = base + ".cnf";
  const std::string request = base + ".csr";
  if (absl::Status s = WriteTextFile(config, OpensslConfig(&options)); !s.ok()) return s;
  CertFiles files{base + ".crt", base + ".key"};
  absl::StatusOr<std::string> run =
      RunCommand({"openssl", "req", "-new", "-config", config, "-newkey", "ec", "-pkeyopt",
                  "ec_paramgen_curve:P-256", "-nodes", "-keyout", files.key, "-out", request,
                  "-subj", absl::StrCat("/CN=", options.common_name)});
  if (!run.ok()) return run.status();
  const uint64_t serial = options.serial != 0 ? options.serial : next_serial_++;
  run = RunCommand({"openssl", "x509", "-req", "-in", request, "-CA", files_.cert, "-CAkey",
                    files_.key, "-set_serial", absl::StrCat(serial), "-days",
                    absl::StrCat(options.days), "-extfile", config, "-extensions", "leaf_ext",
                    "-out", files.cert});
  if (!run.ok()) return run.status();
  return files;
}

}  // namespace testutil
}  // namespace kvmesh

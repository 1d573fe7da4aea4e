// The NCCL loader (transport/nccl_api.h): the real library against the header it was built with,
// and the refusals (missing file, missing symbols, another major version) with fake libraries
// built next to this test (fake_nccl.c). Needs no GPU: ncclGetVersion and ncclGetErrorString
// work without one.
#include "transport/nccl_api.h"

#include <sys/stat.h>

#include <cstdlib>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

#ifndef KVMESH_TEST_NCCL_LIBRARY
#error "KVMESH_TEST_NCCL_LIBRARY must be defined by the build (empty: no NCCL library found)"
#endif

namespace kvmesh {
namespace transport {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

// The library the build found (KVMESH_NCCL_LIBRARY), or empty.
std::string RealLibrary() { return KVMESH_TEST_NCCL_LIBRARY; }

bool IsFile(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// Sets an environment variable for its scope and restores the old value after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value != nullptr) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST(NcclVersionTest, DecodesBothVersionCodeSchemes) {
  // NCCL_VERSION(X, Y, Z): X*10000 + Y*100 + Z since 2.9, X*1000 + Y*100 + Z before.
  EXPECT_EQ(FormatNcclVersion(22809), "2.28.9");
  EXPECT_EQ(NcclMajorVersion(22809), 2);
  EXPECT_EQ(FormatNcclVersion(21903), "2.19.3");
  EXPECT_EQ(FormatNcclVersion(2804), "2.8.4");
  EXPECT_EQ(NcclMajorVersion(2804), 2);
  EXPECT_EQ(FormatNcclVersion(30000), "3.0.0");
  EXPECT_EQ(NcclMajorVersion(30000), 3);
  EXPECT_EQ(FormatNcclVersion(NCCL_VERSION_CODE), std::to_string(NCCL_MAJOR) + "." +
                                                      std::to_string(NCCL_MINOR) + "." +
                                                      std::to_string(NCCL_PATCH));
  EXPECT_EQ(NcclMajorVersion(NCCL_VERSION_CODE), NCCL_MAJOR);
}

TEST(NcclApiTest, LibraryNameComesFromTheEnvironment) {
  {
    ScopedEnv env(kNcclLibraryEnv, "/opt/nccl/lib/libnccl.so.2");
    EXPECT_EQ(NcclLibraryName(), "/opt/nccl/lib/libnccl.so.2");
  }
  {
    ScopedEnv env(kNcclLibraryEnv, "");
    EXPECT_EQ(NcclLibraryName(), "libnccl.so.2");
  }
  {
    ScopedEnv env(kNcclLibraryEnv, nullptr);
    EXPECT_EQ(NcclLibraryName(), "libnccl.so.2");
  }
}

TEST(NcclApiTest, RealLibraryMatchesTheHeader) {
  if (RealLibrary().empty()) GTEST_SKIP() << "the build found no libnccl (KVMESH_NCCL_LIBRARY)";
  absl::StatusOr<NcclApi> api = OpenNcclLibrary(RealLibrary());
  ASSERT_TRUE(api.ok()) << api.status();
  EXPECT_EQ(NcclMajorVersion(api->version), NCCL_MAJOR)
      << "library " << FormatNcclVersion(api->version) << ", header "
      << FormatNcclVersion(NCCL_VERSION_CODE);
  EXPECT_EQ(api->library, RealLibrary());
  EXPECT_TRUE(IsFile(api->path)) << api->path;
  // The table calls the library: its answers match what the loader recorded and what nccl.h
  // says, without a GPU.
  int version = 0;
  ASSERT_EQ(api->ncclGetVersion(&version), ncclSuccess);
  EXPECT_EQ(version, api->version);
  const char* text = api->ncclGetErrorString(ncclInvalidUsage);
  ASSERT_NE(text, nullptr);
  EXPECT_THAT(std::string(text), HasSubstr("invalid usage"));
  EXPECT_NE(api->ncclGetUniqueId, nullptr);
  EXPECT_NE(api->ncclCommInitRankConfig, nullptr);
  EXPECT_NE(api->ncclCommFinalize, nullptr);
  EXPECT_NE(api->ncclCommDestroy, nullptr);
  EXPECT_NE(api->ncclCommAbort, nullptr);
  EXPECT_NE(api->ncclCommGetAsyncError, nullptr);
  EXPECT_NE(api->ncclGetLastError, nullptr);
  EXPECT_NE(api->ncclGroupStart, nullptr);
  EXPECT_NE(api->ncclGroupEnd, nullptr);
  EXPECT_NE(api->ncclSend, nullptr);
  EXPECT_NE(api->ncclRecv, nullptr);
}

TEST(NcclApiTest, LoadNcclLoadsOnceFromTheEnvironment) {
  if (RealLibrary().empty()) GTEST_SKIP() << "the build found no libnccl (KVMESH_NCCL_LIBRARY)";
  // Nothing else in this binary calls LoadNccl: this is the first call, and it reads the
  // environment.
  absl::StatusOr<const NcclApi*> first;
  {
    ScopedEnv env(kNcclLibraryEnv, RealLibrary().c_str());
    first = LoadNccl();
  }
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ((*first)->library, RealLibrary());
  EXPECT_EQ(NcclMajorVersion((*first)->version), NCCL_MAJOR);
  // Later calls return the same table, whatever the environment says by then.
  ScopedEnv env(kNcclLibraryEnv, "/nonexistent/libnccl.so.2");
  absl::StatusOr<const NcclApi*> second = LoadNccl();
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(*second, *first);
}

TEST(NcclApiTest, MissingFileIsFailedPreconditionNamingThePath) {
  const std::string path = "/nonexistent-kvmesh-dir/libnccl.so.2";
  absl::StatusOr<NcclApi> api = OpenNcclLibrary(path);
  ASSERT_FALSE(api.ok());
  EXPECT_EQ(api.status().code(), absl::StatusCode::kFailedPrecondition);
  // The path, and dlerror's reason.
  EXPECT_THAT(api.status().message(), AllOf(HasSubstr("cannot load NCCL from " + path),
                                            HasSubstr("No such file or directory")));
}

TEST(NcclApiTest, LibraryWithoutNcclNamesTheMissingSymbol) {
  // zlib is everywhere that gRPC or Abseil is, and has no NCCL symbol: the first one resolved
  // is missing.
  absl::StatusOr<NcclApi> api = OpenNcclLibrary("libz.so.1");
  ASSERT_FALSE(api.ok());
  EXPECT_EQ(api.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(api.status().message(),
              AllOf(HasSubstr("libz.so.1"), HasSubstr("no symbol ncclGetVersion")));
}

TEST(NcclApiTest, EverySymbolIsChecked) {
  // The fake has all symbols but the last one the loader resolves.
  absl::StatusOr<NcclApi> api = OpenNcclLibrary(KVMESH_TEST_FAKE_NCCL_NO_RECV);
  ASSERT_FALSE(api.ok());
  EXPECT_EQ(api.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(api.status().message(),
              AllOf(HasSubstr(KVMESH_TEST_FAKE_NCCL_NO_RECV), HasSubstr("no symbol ncclRecv"),
                    Not(HasSubstr("ncclSend"))));
}

TEST(NcclApiTest, AnotherMajorVersionIsRefused) {
  absl::StatusOr<NcclApi> api = OpenNcclLibrary(KVMESH_TEST_FAKE_NCCL_V3);
  ASSERT_FALSE(api.ok());
  EXPECT_EQ(api.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(api.status().message(),
              AllOf(HasSubstr(KVMESH_TEST_FAKE_NCCL_V3), HasSubstr("it is NCCL 3.0.0"),
                    HasSubstr("nccl.h of NCCL " + FormatNcclVersion(NCCL_VERSION_CODE)),
                    HasSubstr("major versions differ")));
}

TEST(NcclApiTest, AnotherMinorVersionOfTheSameMajorIsAccepted) {
  // 2.19.3: older than the header, but of the same major version and with every symbol.
  static_assert(NCCL_MAJOR == 2, "the fake library reports a 2.x version");
  absl::StatusOr<NcclApi> api = OpenNcclLibrary(KVMESH_TEST_FAKE_NCCL_V2);
  ASSERT_TRUE(api.ok()) << api.status();
  EXPECT_EQ(api->version, 21903);
  EXPECT_EQ(api->path, KVMESH_TEST_FAKE_NCCL_V2);
  // The table points into the fake: its stubs answer ncclInvalidUsage.
  EXPECT_EQ(api->ncclGroupStart(), ncclInvalidUsage);
}

}  // namespace
}  // namespace transport
}  // namespace kvmesh

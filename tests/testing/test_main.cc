// main() of the engine tests: GoogleTest's, plus the environment that selects, announces and
// (without a GPU) skips the device under test (tests/testing/test_device.h).
#include "gtest/gtest.h"
#include "tests/testing/test_device.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  kvmesh::testutil::RegisterTestDevice();
  return RUN_ALL_TESTS();
}

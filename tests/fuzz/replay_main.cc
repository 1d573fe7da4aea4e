// The main() of the fuzz targets in builds without libFuzzer: runs LLVMFuzzerTestOneInput once
// on each file named on the command line, and on every file of each folder named (dot files
// left out), in name order, as `fuzzer -runs=0 FILES...` would. A broken invariant aborts in the
// harness; this exits 0 after the last input and says how many it ran.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <system_error>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) __attribute__((weak));

int main(int argc, char** argv) {
  if (LLVMFuzzerInitialize != nullptr) LLVMFuzzerInitialize(&argc, &argv);
  std::vector<std::filesystem::path> files;
  for (int i = 1; i < argc; ++i) {
    const std::filesystem::path path(argv[i]);
    std::error_code error;
    if (std::filesystem::is_directory(path, error)) {
      std::vector<std::filesystem::path> in_folder;
      for (const auto& entry : std::filesystem::directory_iterator(path)) {
        if (entry.is_regular_file() && entry.path().filename().string()[0] != '.') {
          in_folder.push_back(entry.path());
        }
      }
      std::sort(in_folder.begin(), in_folder.end());
      files.insert(files.end(), in_folder.begin(), in_folder.end());
    } else if (std::filesystem::is_regular_file(path, error)) {
      files.push_back(path);
    } else {
      std::fprintf(stderr, "%s: '%s' is neither a file nor a folder\n", argv[0], argv[i]);
      return 2;
    }
  }
  for (const std::filesystem::path& file : files) {
    std::ifstream in(file, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (!in.good() && !in.eof()) {
      std::fprintf(stderr, "%s: cannot read '%s'\n", argv[0], file.c_str());
      return 2;
    }
    std::fprintf(stderr, "Running: %s (%zu bytes)\n", file.c_str(), bytes.size());
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  }
  std::fprintf(stderr, "Executed %zu inputs\n", files.size());
  return 0;
}

#include "files.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>

namespace emflow::testing {

void FileFolder::SetUp() {
  ScratchFolder::SetUp();
  folder_ = std::filesystem::canonical(folder_);
}

std::string FileFolder::path(const std::string& name) const { return (folder_ / name).string(); }

std::vector<std::string> FileFolder::entries(const std::string& sub) const {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(folder_ / sub)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

void FileFolder::put(const std::string& name, const std::string& text) const {
  std::ofstream(path(name), std::ios::binary) << text;
}

std::string FileFolder::text_of(const std::string& name) const {
  std::ifstream in(path(name), std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace emflow::testing

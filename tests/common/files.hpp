// Test fixtures and helpers for tests that write, read and list files: a canonical scratch folder
// with its file helpers, and the message of an expected emflow::Error.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "common/testing.hpp"
#include "emflow/error.hpp"

namespace emflow::testing {

/// A ScratchFolder, made canonical (so its paths compare equal to the ones emflow resolves), with
/// the helpers of tests that write, read and list files in it.
class FileFolder : public ScratchFolder {
 protected:
  explicit FileFolder(std::string prefix) : ScratchFolder(std::move(prefix)) {}
  void SetUp() override;

  std::string path(const std::string& name) const;
  /// The sorted names in the subfolder `sub` of the folder ("." for the folder itself).
  std::vector<std::string> entries(const std::string& sub) const;
  void put(const std::string& name, const std::string& text) const;
  std::string text_of(const std::string& name) const;
};

/// Runs `body`, which must throw emflow::Error with `code`; returns its message.
template <class Body>
std::string error_of(ErrorCode code, Body&& body) {
  try {
    body();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no emflow::Error";
  return "";
}

}  // namespace emflow::testing

// The visibility rule of every backend, Mask::allows and Mask::visible_keys (emflow/types.hpp),
// held against the definitions of docs/MATH.md §1 written out here case by case: none sees every
// key, causal the keys j <= i, a window of width w the keys i - w < j <= i, and a key length L
// hides keys and queries at or past L.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "emflow/types.hpp"

namespace emflow::testing {
namespace {

// The rule from its definition, independently of the code under test.
bool defined_visible(const Mask& mask, std::int64_t i, std::int64_t j, std::int64_t length) {
  if (i < 0 || j < 0 || i >= length || j >= length) return false;
  switch (mask.kind) {
    case MaskKind::none:
      return true;
    case MaskKind::causal:
      return j <= i;
    case MaskKind::window:
      return j <= i && j > i - mask.window;
  }
  return false;
}

std::vector<Mask> masks() {
  return {Mask::none(),
          Mask::causal(),
          Mask::sliding_window(1),
          Mask::sliding_window(3),
          Mask::sliding_window(9),
          Mask::sliding_window(100)};
}

TEST(MaskRule, VisibleKeysIsExactlyTheDefinedSetOfKeys) {
  for (const Mask& mask : masks()) {
    for (std::int64_t length = 0; length <= 12; ++length) {
      for (std::int64_t i = -1; i <= 13; ++i) {
        const KeyRange keys = mask.visible_keys(i, length);
        std::int64_t count = 0;
        for (std::int64_t j = -2; j <= 14; ++j) {
          const bool expected = defined_visible(mask, i, j, length);
          count += expected;
          ASSERT_EQ(keys.contains(j), expected)
              << to_string(mask) << " L=" << length << " i=" << i << " j=" << j;
        }
        EXPECT_EQ(keys.empty(), count == 0) << to_string(mask) << " L=" << length << " i=" << i;
      }
    }
  }
}

TEST(MaskRule, AllowsIsTheRuleWithoutKeyLengths) {
  for (const Mask& mask : masks()) {
    for (std::int64_t i = 0; i <= 12; ++i) {
      for (std::int64_t j = 0; j <= 12; ++j) {
        ASSERT_EQ(mask.allows(i, j), defined_visible(mask, i, j, 13))
            << to_string(mask) << " i=" << i << " j=" << j;
      }
    }
  }
}

// The tiled backends skip and classify whole key tiles from the first and last query of a block:
// that is exact only because both ends of the interval never decrease with the query.
TEST(MaskRule, BothEndsOfTheIntervalGrowWithTheQuery) {
  for (const Mask& mask : masks()) {
    for (std::int64_t length = 1; length <= 12; ++length) {
      for (std::int64_t i = 1; i < length; ++i) {
        const KeyRange before = mask.visible_keys(i - 1, length);
        const KeyRange after = mask.visible_keys(i, length);
        EXPECT_LE(before.first, after.first) << to_string(mask) << " L=" << length << " i=" << i;
        EXPECT_LE(before.last, after.last) << to_string(mask) << " L=" << length << " i=" << i;
        // A real query always sees itself.
        EXPECT_TRUE(after.contains(i)) << to_string(mask) << " L=" << length << " i=" << i;
      }
    }
  }
}

TEST(MaskRule, HandWorkedIntervals) {
  const KeyRange causal = Mask::causal().visible_keys(3, 10);
  EXPECT_EQ(causal.first, 0);
  EXPECT_EQ(causal.last, 4);
  const KeyRange window = Mask::sliding_window(3).visible_keys(5, 10);
  EXPECT_EQ(window.first, 3);
  EXPECT_EQ(window.last, 6);
  const KeyRange none = Mask::none().visible_keys(2, 7);
  EXPECT_EQ(none.first, 0);
  EXPECT_EQ(none.last, 7);
  EXPECT_TRUE(Mask::none().visible_keys(7, 7).empty());    // a padding query sees nothing
  EXPECT_TRUE(Mask::causal().visible_keys(0, 0).empty());  // an empty cloud
}

// The rule is constexpr, so kernels and host code can evaluate it anywhere, at compile time too.
static_assert(Mask::causal().allows(3, 3) && !Mask::causal().allows(3, 4), "causal");
static_assert(Mask::sliding_window(2).allows(5, 4) && !Mask::sliding_window(2).allows(5, 3),
              "window");
static_assert(Mask::sliding_window(2).visible_keys(5, 10).first == 4 &&
                  Mask::sliding_window(2).visible_keys(5, 10).last == 6,
              "window interval");
static_assert(Mask::none().visible_keys(1, 4).last == 4, "none interval");

}  // namespace
}  // namespace emflow::testing

// visible_keys_at over a block of keys that starts at key_position: the interval is exactly the
// keys allows() admits, its ends lie in [0, length] and grow with the position (a window that
// ends before the block once gave {first, first} with first > length, and the CPU engine,
// joining two rows' ranges, read key panels that do not exist).
TEST(MaskRule, VisibleKeysAtIsTheDefinedSetAndEmptyIsZero) {
  const std::vector<emflow::Mask> masks = {emflow::Mask::none(), emflow::Mask::causal(),
                                           emflow::Mask::sliding_window(1),
                                           emflow::Mask::sliding_window(37)};
  for (const emflow::Mask& mask : masks) {
    for (std::int64_t key_position : {0, 5, 100}) {
      for (std::int64_t length : {0, 1, 20}) {
        for (std::int64_t position = -3; position < 200; ++position) {
          const emflow::KeyRange range = mask.visible_keys_at(position, key_position, length);
          for (std::int64_t j = 0; j < length; ++j) {
            EXPECT_EQ(range.contains(j), mask.allows(position, key_position + j))
                << emflow::to_string(mask) << " position " << position << " key " << j;
          }
          EXPECT_GE(range.first, 0);
          EXPECT_LE(range.first, range.last);
          EXPECT_LE(range.last, length);
          // Both ends non-decreasing in the position (rows' ranges are joined by their ends).
          const emflow::KeyRange next = mask.visible_keys_at(position + 1, key_position, length);
          EXPECT_LE(range.first, next.first);
          EXPECT_LE(range.last, next.last);
        }
      }
    }
  }
}

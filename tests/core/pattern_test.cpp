#include "expage/core/pattern.hpp"

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <unordered_set>
#include <vector>

namespace {

using expage::count_pattern_mismatches;
using expage::fill_pattern;
using expage::pattern_word;

// pattern_word is splitmix64: word i of seed s is the output of a splitmix64
// generator after i + 1 steps from state s. These are the reference outputs
// of splitmix64 seeded with 0, evaluated at compile time.
static_assert(pattern_word(0, 0) == 0xE220A8397B1DCDAFULL);
static_assert(pattern_word(0, 1) == 0x6E789E6AA1B965F4ULL);
static_assert(pattern_word(0, 2) == 0x06C45D188009454FULL);

constexpr std::uint64_t compile_time_word = pattern_word(42, 7);

TEST(Pattern, IsDeterministic) {
  EXPECT_EQ(pattern_word(42, 7), compile_time_word);
  for (std::uint64_t i = 0; i < 1000; ++i) {
    EXPECT_EQ(pattern_word(123, i), pattern_word(123, i));
  }
}

TEST(Pattern, MatchesReferenceSplitmix64) {
  // An independent splitmix64 generator, stepped sequentially.
  const std::uint64_t seed = 0xC0FFEEULL;
  std::uint64_t state = seed;
  for (std::uint64_t i = 0; i < 1000; ++i) {
    state += 0x9E3779B97F4A7C15ULL;
    std::uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    ASSERT_EQ(pattern_word(seed, i), z) << "word " << i;
  }
}

TEST(Pattern, NoCollisionsAmongTheFirst100000WordsOfASeed) {
  std::unordered_set<std::uint64_t> seen;
  seen.reserve(100000);
  for (std::uint64_t i = 0; i < 100000; ++i) {
    ASSERT_TRUE(seen.insert(pattern_word(7, i)).second) << "word " << i;
  }
}

TEST(Pattern, DiffersAcrossSeeds) {
  // Small, adjacent seeds as tests use them: the same index differs.
  for (std::uint64_t seed = 0; seed < 64; ++seed) {
    for (std::uint64_t i = 0; i < 64; ++i) {
      EXPECT_NE(pattern_word(seed, i), pattern_word(seed + 1, i)) << "seed " << seed << " word " << i;
    }
  }
  // Whole blocks from two seeds share no words.
  std::unordered_set<std::uint64_t> seed_one;
  for (std::uint64_t i = 0; i < 4096; ++i) {
    seed_one.insert(pattern_word(1, i));
  }
  for (std::uint64_t i = 0; i < 4096; ++i) {
    EXPECT_EQ(seed_one.count(pattern_word(2, i)), std::size_t{0}) << "word " << i;
  }
}

TEST(Pattern, FillThenCountFindsNoMismatch) {
  std::vector<std::uint64_t> words(4096);
  fill_pattern(words.data(), words.size(), 99);
  EXPECT_EQ(count_pattern_mismatches(words.data(), words.size(), 99), std::size_t{0});
  for (std::size_t i = 0; i < words.size(); ++i) {
    ASSERT_EQ(words[i], pattern_word(99, i)) << "word " << i;
  }
}

TEST(Pattern, EmptyRangeIsANoOp) {
  std::vector<std::uint64_t> words(4, 5);
  fill_pattern(words.data(), 0, 1);
  EXPECT_EQ(words, (std::vector<std::uint64_t>(4, 5)));
  EXPECT_EQ(count_pattern_mismatches(words.data(), 0, 1), std::size_t{0});
}

TEST(Pattern, FillWritesOnlyTheGivenWords) {
  std::vector<std::uint64_t> words(10, 0);
  fill_pattern(words.data() + 2, 6, 3);
  EXPECT_EQ(words[0], std::uint64_t{0});
  EXPECT_EQ(words[1], std::uint64_t{0});
  EXPECT_EQ(words[8], std::uint64_t{0});
  EXPECT_EQ(words[9], std::uint64_t{0});
  EXPECT_EQ(count_pattern_mismatches(words.data() + 2, 6, 3), std::size_t{0});
}

TEST(Pattern, FlippingOneBitGivesOneMismatch) {
  std::vector<std::uint64_t> words(1024);
  fill_pattern(words.data(), words.size(), 5);
  for (const std::size_t at : {std::size_t{0}, std::size_t{511}, std::size_t{1023}}) {
    for (const unsigned bit : {0U, 31U, 63U}) {
      std::vector<std::uint64_t> damaged = words;
      damaged[at] ^= std::uint64_t{1} << bit;
      EXPECT_EQ(count_pattern_mismatches(damaged.data(), damaged.size(), 5), std::size_t{1})
          << "word " << at << " bit " << bit;
    }
  }
}

TEST(Pattern, CountsEveryDamagedWord) {
  std::vector<std::uint64_t> words(100);
  fill_pattern(words.data(), words.size(), 8);
  words[3] = 0;
  words[50] ^= 0xFFULL;
  words[99] = ~words[99];
  EXPECT_EQ(count_pattern_mismatches(words.data(), words.size(), 8), std::size_t{3});
}

TEST(Pattern, WrongSeedOrOffsetMismatchesEveryWord) {
  std::vector<std::uint64_t> words(256);
  fill_pattern(words.data(), words.size(), 11);
  EXPECT_EQ(count_pattern_mismatches(words.data(), words.size(), 12), words.size());
  // A block copied one word off shows up everywhere.
  EXPECT_EQ(count_pattern_mismatches(words.data(), words.size(), 11, 1), words.size());
}

TEST(Pattern, FirstOffsetContinuesTheSamePattern) {
  constexpr std::size_t n = 1000;
  constexpr std::size_t k = 337;
  std::vector<std::uint64_t> whole(n);
  fill_pattern(whole.data(), n, 77, 0);

  std::vector<std::uint64_t> tail(n - k);
  fill_pattern(tail.data(), n - k, 77, k);
  for (std::size_t i = 0; i < n - k; ++i) {
    ASSERT_EQ(tail[i], whole[k + i]) << "word " << i;
  }
  // Checking the tail of the whole block against offset k agrees.
  EXPECT_EQ(count_pattern_mismatches(whole.data() + k, n - k, 77, k), std::size_t{0});
  EXPECT_EQ(count_pattern_mismatches(tail.data(), n - k, 77, k), std::size_t{0});

  // Filling [0, k) and [k, n) separately rebuilds the whole block.
  std::vector<std::uint64_t> pieces(n);
  fill_pattern(pieces.data(), k, 77, 0);
  fill_pattern(pieces.data() + k, n - k, 77, k);
  EXPECT_EQ(pieces, whole);
}

TEST(Pattern, LargeOffsetsWork) {
  const std::uint64_t first = (std::uint64_t{1} << 40) + 3;
  std::vector<std::uint64_t> words(16);
  fill_pattern(words.data(), words.size(), 1, first);
  for (std::size_t i = 0; i < words.size(); ++i) {
    EXPECT_EQ(words[i], pattern_word(1, first + i));
  }
  EXPECT_EQ(count_pattern_mismatches(words.data(), words.size(), 1, first), std::size_t{0});
}

}  // namespace

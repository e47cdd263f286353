#include "expage/sim/kv_sessions.hpp"

#include "expage/cache/decayed_reuse_histogram.hpp"
#include "expage/cache/eviction_policy.hpp"
#include "expage/cache/reuse_distance.hpp"
#include "expage/core/error.hpp"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <list>
#include <random>
#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace expage {
namespace {

using ::testing::HasSubstr;

kv_phase tool_calls(std::uint64_t steps) {
  return {.name = "tool-calls",
          .steps = steps,
          .concurrency = 4,
          .turns = 5,
          .prompt_tokens = 96,
          .append_tokens = 40,
          .decode_tokens = 12,
          .think_steps = 30,
          .shared_prefix_tokens = 64};
}

kv_phase long_context(std::uint64_t steps) {
  return {.name = "long-context",
          .steps = steps,
          .concurrency = 2,
          .turns = 2,
          .prompt_tokens = 900,
          .append_tokens = 100,
          .decode_tokens = 40,
          .think_steps = 10,
          .shared_prefix_tokens = 0};
}

kv_session_options two_phases(std::uint64_t seed = 3) {
  kv_session_options o;
  o.block_tokens = 16;
  o.seed = seed;
  o.phases = {tool_calls(300), long_context(200)};
  return o;
}

TEST(KvSessions, SameSeedSameStreamAnotherSeedAnother) {
  const auto a = generate_kv_sessions(two_phases(3));
  const auto b = generate_kv_sessions(two_phases(3));
  const auto c = generate_kv_sessions(two_phases(4));
  ASSERT_EQ(a.steps(), 500U);
  ASSERT_EQ(a.references(), b.references());
  bool differs = c.references() != a.references();
  for (std::uint64_t s = 0; s < a.steps(); ++s) {
    const auto x = a.blocks(s);
    const auto y = b.blocks(s);
    ASSERT_TRUE(std::equal(x.begin(), x.end(), y.begin(), y.end())) << "step " << s;
    if (!differs && s < c.steps()) {
      const auto z = c.blocks(s);
      differs = !std::equal(x.begin(), x.end(), z.begin(), z.end());
    }
  }
  EXPECT_TRUE(differs);
}

// Every step reads distinct blocks within [0, key_count); phases are labelled in order; the peak is
// the largest step; the phases' blocks are disjoint (a phase starts new sessions).
TEST(KvSessions, StepsReadDistinctBlocksAndPhasesAreDisjoint) {
  const auto kv = generate_kv_sessions(two_phases());
  std::uint64_t peak = 0;
  std::vector<int> phase_of_block(kv.key_count(), -1);
  for (std::uint64_t s = 0; s < kv.steps(); ++s) {
    EXPECT_EQ(kv.phase(s), s < 300 ? 0U : 1U);
    std::unordered_set<std::uint32_t> seen;
    for (const std::uint32_t b : kv.blocks(s)) {
      ASSERT_LT(b, kv.key_count());
      EXPECT_TRUE(seen.insert(b).second) << "block " << b << " read twice in step " << s;
      int& p = phase_of_block[b];
      if (p < 0) p = static_cast<int>(kv.phase(s));
      EXPECT_EQ(p, static_cast<int>(kv.phase(s))) << "block " << b;
    }
    peak = std::max<std::uint64_t>(peak, kv.blocks(s).size());
  }
  EXPECT_EQ(kv.peak_step_blocks(), peak);
}

// One session, one turn, no shared prefix: the prefill reads ⌈prompt/16⌉ blocks, then every decode
// step reads the whole context, one more block each time the context crosses a block boundary.
TEST(KvSessions, ADecodeStepReadsTheWholeContext) {
  kv_session_options o;
  o.block_tokens = 16;
  o.phases = {{.name = "one",
               .steps = 200,
               .concurrency = 1,
               .turns = 1,
               .prompt_tokens = 40,
               .decode_tokens = 100,
               .think_steps = 0}};
  const auto kv = generate_kv_sessions(o);
  std::uint64_t s = 0;
  while (kv.blocks(s).empty()) ++s;    // the staggered start
  ASSERT_EQ(kv.blocks(s).size(), 3U);  // 40 tokens
  std::uint64_t tokens = 40;
  for (std::uint64_t d = 1; d < 50; ++d) {
    ++tokens;
    ASSERT_EQ(kv.blocks(s + d).size(), (tokens + 15) / 16) << "decode step " << d;
    const auto prev = kv.blocks(s + d - 1);
    const auto now = kv.blocks(s + d);
    EXPECT_TRUE(std::equal(prev.begin(), prev.end(), now.begin())) << "the prefix keeps its blocks";
  }
}

// A turn decodes decode_tokens and a session thinks think_steps between turns on average, odd
// means included (they came out half a step low: the draw's top was m + ⌊m/2⌋). One session at a
// time, one token per block: a turn is a step that does not read one block more than the step
// before it (a prefill), then its decode steps; the empty steps between two turns of one session
// (same first block) are its thinking.
TEST(KvSessions, TurnsDecodeAndThinkTheirMeans) {
  for (const auto& [decode, think] : {std::pair{3U, 1U}, std::pair{5U, 7U}, std::pair{4U, 4U}}) {
    kv_session_options o;
    o.block_tokens = 1;
    o.seed = 5;
    o.phases = {{.name = "one",
                 .steps = 100000,
                 .concurrency = 1,
                 .turns = 2,
                 .prompt_tokens = 8,
                 .append_tokens = 4,
                 .decode_tokens = decode,
                 .think_steps = think}};
    const auto kv = generate_kv_sessions(o);
    double turns = 0, decoded = 0, waits = 0, waited = 0;
    std::uint64_t before = 0, idle = 0;
    std::uint32_t first = ~0U;
    for (std::uint64_t s = 0; s < kv.steps(); ++s) {
      const auto blocks = kv.blocks(s);
      if (blocks.empty()) {
        ++idle;
        before = 0;
        continue;
      }
      if (before != 0 && blocks.size() == before + 1 && blocks[0] == first) {
        ++decoded;
      } else {
        ++turns;
        if (blocks[0] == first) {
          ++waits;
          waited += static_cast<double>(idle);
        }
        first = blocks[0];
      }
      idle = 0;
      before = blocks.size();
    }
    ASSERT_GT(waits, 1000);
    EXPECT_NEAR(decoded / turns, decode, 0.1) << "decode_tokens " << decode;
    EXPECT_NEAR(waited / waits, think, 0.1) << "think_steps " << think;
  }
}

// The far mode: a session's next turn re-reads its prefix after waiting; with a pool that holds
// every session's context nothing is recomputed, with one that holds only the running ones the
// waiting sessions' prefixes are.
TEST(KvSessions, CrossTurnReuseIsTheFarMode) {
  kv_session_options o;
  o.phases = {tool_calls(600)};
  const auto kv = generate_kv_sessions(o);
  const auto all = simulate_kv_pool(kv, kv.key_count());
  EXPECT_EQ(all.recomputes, 0U);
  // Cold reads are first reads: one per distinct block read (a session drawn mid-way whose wait
  // outlasts the phase is never read, so that can be fewer than key_count()).
  std::unordered_set<std::uint32_t> read;
  for (std::uint64_t st = 0; st < kv.steps(); ++st) read.insert(kv.blocks(st).begin(), kv.blocks(st).end());
  EXPECT_EQ(all.cold, read.size());
  EXPECT_LE(all.cold, kv.key_count());
  const auto tight = simulate_kv_pool(kv, kv.peak_step_blocks());
  EXPECT_GT(tight.recomputes, 0U);
  EXPECT_EQ(tight.hits + tight.cold + tight.recomputes, tight.references);
}

// Obviously correct LRU over a std::list, with the same resize rule; with release_closed a block
// leaves the list at the end of the step its conversation closes at.
std::vector<std::uint64_t> reference_pool(const kv_block_stream& kv, std::uint64_t capacity,
                                          const std::vector<kv_capacity_change>& schedule,
                                          bool release_closed = false) {
  std::list<std::uint32_t> lru;  // front = most recent
  std::unordered_map<std::uint32_t, std::list<std::uint32_t>::iterator> where;
  std::unordered_set<std::uint32_t> seen;
  std::vector<std::uint64_t> out;
  auto change = schedule.begin();
  for (std::uint64_t s = 0; s < kv.steps(); ++s) {
    if (change != schedule.end() && change->step == s) {
      capacity = change->blocks;
      while (lru.size() > capacity) {
        where.erase(lru.back());
        lru.pop_back();
      }
      ++change;
    }
    std::uint64_t recomputes = 0;
    for (const std::uint32_t b : kv.blocks(s)) {
      if (const auto it = where.find(b); it != where.end()) {
        lru.erase(it->second);
      } else {
        if (!seen.insert(b).second) ++recomputes;
        if (lru.size() == capacity) {
          where.erase(lru.back());
          lru.pop_back();
        }
      }
      lru.push_front(b);
      where[b] = lru.begin();
    }
    out.push_back(recomputes);
    if (!release_closed) continue;
    for (auto it = lru.begin(); it != lru.end();) {
      if (kv.closes_at(*it) == s) {
        where.erase(*it);
        it = lru.erase(it);
      } else {
        ++it;
      }
    }
  }
  return out;
}

// A random starting size and resize schedule, sizes up to three times the largest step.
std::pair<std::uint64_t, std::vector<kv_capacity_change>> random_sizes(const kv_block_stream& kv,
                                                                       std::mt19937_64& rng) {
  const std::uint64_t capacity = 1 + rng() % (kv.peak_step_blocks() * 3);
  std::vector<kv_capacity_change> schedule;
  for (std::uint64_t s = 1 + rng() % 40; s < kv.steps(); s += 1 + rng() % 60) {
    schedule.push_back({.step = s, .blocks = 1 + rng() % (kv.peak_step_blocks() * 3)});
  }
  return {capacity, schedule};
}

TEST(KvSessions, PoolEqualsAReferenceLruUnderRandomResizes) {
  const auto kv = generate_kv_sessions(two_phases());
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 12; ++trial) {
    const auto [capacity, schedule] = random_sizes(kv, rng);
    SCOPED_TRACE(fmt::format("trial {}: capacity {}, {} resizes", trial, capacity, schedule.size()));
    const auto r = simulate_kv_pool(kv, capacity, schedule);
    EXPECT_EQ(r.step_recomputes, reference_pool(kv, capacity, schedule));
    EXPECT_EQ(r.hits + r.cold + r.recomputes, r.references);
  }
}

// A pool that drops closed conversations' blocks equals the list-based reference doing the same,
// and never recomputes more in a step than plain LRU at the same sizes: the blocks it drops are
// never read again, so at every instant it holds every open block plain LRU holds.
TEST(KvSessions, ReleasingClosedBlocksEqualsTheReferenceAndNeverRecomputesMore) {
  const auto kv = generate_kv_sessions(two_phases(5));
  std::mt19937_64 rng(13);
  std::uint64_t fewer = 0;  // trials where dropping helped
  for (int trial = 0; trial < 12; ++trial) {
    const auto [capacity, schedule] = random_sizes(kv, rng);
    SCOPED_TRACE(fmt::format("trial {}: capacity {}, {} resizes", trial, capacity, schedule.size()));
    const auto released = simulate_kv_pool(kv, capacity, schedule, /*release_closed=*/true);
    EXPECT_EQ(released.step_recomputes, reference_pool(kv, capacity, schedule, /*release_closed=*/true));
    EXPECT_EQ(released.hits + released.cold + released.recomputes, released.references);
    EXPECT_GT(released.released, 0U);
    const auto lru = simulate_kv_pool(kv, capacity, schedule);
    EXPECT_EQ(lru.released, 0U);
    for (std::uint64_t s = 0; s < kv.steps(); ++s) {
      ASSERT_LE(released.step_recomputes[s], lru.step_recomputes[s]) << "step " << s;
    }
    fewer += released.recomputes < lru.recomputes ? 1 : 0;
  }
  EXPECT_GT(fewer, 0U) << "some trial should keep an open block only because a closed one left";
}

// closing(s) lists exactly the blocks whose conversation closes at step s, ascending.
TEST(KvSessions, ClosingListsTheBlocksOfEachStep) {
  const auto kv = generate_kv_sessions(two_phases(7));
  std::vector<std::vector<std::uint32_t>> want(kv.steps());
  for (std::uint32_t b = 0; b < kv.key_count(); ++b) {
    if (kv.closes_at(b) < kv.steps()) want[kv.closes_at(b)].push_back(b);
  }
  std::size_t listed = 0;
  for (std::uint64_t s = 0; s < kv.steps(); ++s) {
    const auto got = kv.closing(s);
    ASSERT_TRUE(std::equal(got.begin(), got.end(), want[s].begin(), want[s].end())) << "step " << s;
    listed += got.size();
  }
  EXPECT_FALSE(kv.closing(kv.steps() - 1).empty()) << "the last phase closes its blocks at its end";
  EXPECT_EQ(listed, kv.key_count()) << "every phase closes every block it opened";
}

// At a fixed capacity the pool's recomputes are the warm reads whose LRU stack distance is at
// least the capacity (WiSP Eq. 3 over the block stream).
TEST(KvSessions, StaticPoolMatchesTheExactMissCurve) {
  const auto kv = generate_kv_sessions(two_phases());
  reuse_distance_tracker rd(kv.key_count());
  std::vector<std::size_t> distances;
  for (std::uint64_t s = 0; s < kv.steps(); ++s) {
    for (const std::uint32_t b : kv.blocks(s)) distances.push_back(rd.access(b));
  }
  for (const std::uint64_t n : {1ULL, 7ULL, 50ULL, 200ULL, 333ULL, 1000ULL}) {
    std::uint64_t expected = 0;
    for (const std::size_t d : distances) expected += d != reuse_distance_tracker::cold && d >= n ? 1 : 0;
    EXPECT_EQ(simulate_kv_pool(kv, n).recomputes, expected) << "capacity " << n;
  }
}

// kv_block_pool against a slow LRU list on random reads, releases and resizes: the same result
// of every read and release, the same size, the same totals; a resize to 0 is
// refused and changes nothing.
TEST(KvSessions, BlockPoolMatchesASlowLruList) {
  std::mt19937_64 rng(23);
  for (int trial = 0; trial < 20; ++trial) {
    const auto keys = static_cast<std::uint32_t>(1 + rng() % 40);
    std::uint64_t capacity = 1 + rng() % 12;
    kv_block_pool pool(keys, capacity);
    std::list<std::uint32_t> lru;  // front = most recently read
    std::unordered_set<std::uint32_t> seen;
    kv_pool_result want;
    const auto evict_to = [&](std::uint64_t n) {
      while (lru.size() > n) {
        lru.pop_back();
        ++want.evictions;
      }
    };
    for (int op = 0; op < 400; ++op) {
      const auto block = static_cast<std::uint32_t>(rng() % keys);
      const auto roll = rng() % 10;
      if (roll < 7) {
        const auto it = std::find(lru.begin(), lru.end(), block);
        const kv_read expected = it != lru.end()        ? kv_read::hit
                                 : seen.contains(block) ? kv_read::recompute
                                                        : kv_read::cold;
        ++want.references;
        if (it != lru.end()) {
          ++want.hits;
          lru.erase(it);
        } else {
          ++(expected == kv_read::cold ? want.cold : want.recomputes);
          evict_to(capacity - 1);
        }
        lru.push_front(block);
        seen.insert(block);
        ASSERT_EQ(pool.read(block), expected) << "trial " << trial << " op " << op;
      } else if (roll < 9) {
        const auto it = std::find(lru.begin(), lru.end(), block);
        const bool cached = it != lru.end();
        if (cached) {
          lru.erase(it);
          ++want.released;
        }
        ASSERT_EQ(pool.release(block), cached) << "trial " << trial << " op " << op;
      } else {
        capacity = 1 + rng() % 12;
        evict_to(capacity);
        pool.resize(capacity);
      }
      ASSERT_EQ(pool.size(), lru.size());
      ASSERT_EQ(pool.capacity(), capacity);
    }
    // (The eviction order is checked by the reads: a wrong victim makes a later read differ.)
    const kv_pool_result& got = pool.totals();
    EXPECT_EQ(got.references, want.references);
    EXPECT_EQ(got.hits, want.hits);
    EXPECT_EQ(got.cold, want.cold);
    EXPECT_EQ(got.recomputes, want.recomputes);
    EXPECT_EQ(got.evictions, want.evictions);
    EXPECT_EQ(got.released, want.released);
    EXPECT_THROW(pool.resize(0), invalid_argument);
    EXPECT_EQ(pool.capacity(), capacity) << "a refused resize changes nothing";
  }
  EXPECT_THROW(kv_block_pool(4, 0), invalid_argument);
}

TEST(KvSessions, PresetsCoverTheirStepsAndUnknownNamesAreListed) {
  for (const std::string_view name : kv_session_preset_names()) {
    const auto phases = kv_session_preset(name, 1000);
    std::uint64_t steps = 0;
    for (const auto& p : phases) steps += p.steps;
    EXPECT_EQ(steps, 1000U) << name;
    kv_session_options o;
    o.phases = phases;
    EXPECT_EQ(generate_kv_sessions(o).steps(), 1000U) << name;
  }
  EXPECT_EQ(kv_session_preset("phase-shift", 9).size(), 3U);
  try {
    static_cast<void>(kv_session_preset("chat", 100));
    ADD_FAILURE();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("unknown session mix 'chat' (presets: tool-calls, long-context, phase-shift)"));
  }
  EXPECT_THROW(static_cast<void>(kv_session_preset("tool-calls", 2)), invalid_argument);
}

TEST(KvSessions, BadInputIsNamedWithItsRange) {
  const auto expect_error = [](kv_session_options o, const char* text) {
    try {
      static_cast<void>(generate_kv_sessions(o));
      ADD_FAILURE() << "no error for " << text;
    } catch (const invalid_argument& e) {
      EXPECT_THAT(e.what(), HasSubstr(text));
    }
  };
  kv_session_options o = two_phases();
  o.block_tokens = 0;
  expect_error(o, "block_tokens 0 out of range [1, 65536]");
  o = two_phases();
  o.phases.clear();
  expect_error(o, "no phases");
  o = two_phases();
  o.phases[1].concurrency = 0;
  expect_error(o, "phases[1] ('long-context') concurrency 0 out of range [1, 4096]");
  o = two_phases();
  o.phases[0].steps = 0;
  expect_error(o, "phases[0] ('tool-calls') steps 0");
  o = two_phases();
  o.phases[0].decode_tokens = 0;
  expect_error(o, "decode_tokens 0");
  o = two_phases();
  o.max_references = 1000;
  expect_error(o, "max_references 1000");
  // One context past the guard is refused before its blocks are made (it used to allocate the
  // bookkeeping of all 2^31 blocks first, 32 GiB).
  o = two_phases();
  o.block_tokens = 1;
  o.max_references = 1000;
  o.phases[0].prompt_tokens = 1U << 31;
  expect_error(o, "a context of 2147483712 blocks at step 0 of phases[0] ('tool-calls') passes max_references 1000");
  // In a later phase the step is counted within that phase, as the total's message counts it.
  o = two_phases();
  o.block_tokens = 1;
  o.max_references = 1U << 20;
  o.phases[0].steps = 3;
  o.phases[1].prompt_tokens = 1U << 31;
  expect_error(o, "blocks at step 0 of phases[1] ('long-context') passes max_references 1048576");
  // A session drawn in its steady state at a late turn of huge turns has a context past 2^64
  // tokens: refused, not wrapped into a small stream.
  o = two_phases();
  o.block_tokens = 65536;
  o.max_references = std::uint64_t{1} << 32;
  o.phases[0].turns = 4'294'967'295U;
  o.phases[0].append_tokens = 4'294'967'295U;
  o.phases[0].decode_tokens = 4'294'967'295U;
  expect_error(o, "passes max_references 4294967296");

  const auto kv = generate_kv_sessions(two_phases());
  EXPECT_THROW(static_cast<void>(simulate_kv_pool(kv, 0)), invalid_argument);
  // open_block_depths() refuses a last_read longer than the stream's blocks (it read past them).
  const std::vector<std::uint64_t> too_long(std::size_t{kv.key_count()} + 1, 0);
  try {
    static_cast<void>(open_block_depths(kv, too_long, 0));
    ADD_FAILURE();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr(fmt::format("last_read holds {} blocks, out of range [0, {}]", kv.key_count() + 1,
                                                kv.key_count())));
  }
  const std::vector<kv_capacity_change> backwards{{.step = 5, .blocks = 3}, {.step = 5, .blocks = 4}};
  try {
    static_cast<void>(simulate_kv_pool(kv, 10, backwards));
    ADD_FAILURE();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("schedule[1].step 5 out of range [6, 500)"));
  }
}

// A block opens at the step that first reads it, except a phase's shared prefix and the context of a
// session under way when the phase began, which open at the phase's first step and may be first
// read later (the context when its session returns from its tool); no step reads a block before it
// opens or after it closes.
TEST(KvSessions, ABlockIsReadOnlyWhileItsConversationIsOpen) {
  const auto kv = generate_kv_sessions(two_phases(7));
  std::vector<std::uint64_t> first(kv.key_count(), never);
  std::vector<std::uint64_t> last(kv.key_count(), never);
  for (std::uint64_t step = 0; step < kv.steps(); ++step) {
    for (const std::uint32_t b : kv.blocks(step)) {
      if (first[b] == never) first[b] = step;
      last[b] = step;
    }
  }
  std::size_t under_way = 0;  // blocks opened before their first read
  for (std::uint32_t b = 0; b < kv.key_count(); ++b) {
    ASSERT_LE(kv.opens_at(b), kv.closes_at(b)) << "block " << b;
    if (first[b] == never) continue;  // a session under way whose phase ended before it returned
    ASSERT_LE(kv.opens_at(b), first[b]) << "block " << b;
    ASSERT_LE(last[b], kv.closes_at(b)) << "block " << b;
    if (kv.opens_at(b) == first[b]) continue;
    ++under_way;
    const std::uint32_t phase = kv.phase(kv.opens_at(b));
    EXPECT_TRUE(kv.opens_at(b) == 0 || kv.phase(kv.opens_at(b) - 1) != phase)
        << "block " << b << " opens before its first read at step " << kv.opens_at(b) << ", not a phase's first step";
  }
  EXPECT_GT(under_way, 0U) << "the phases should start with sessions under way";
}

// open_block_depths() against a list-based LRU: after every step, the depth of each cached block
// whose session is open is its position in the recency order; the open blocks never read follow
// the deepest open cached one. With release_closed the list drops a conversation's blocks when it
// closes, as the releasing pool does.
class OpenBlockDepths : public ::testing::TestWithParam<bool> {};

TEST_P(OpenBlockDepths, EqualAListBasedLru) {
  const bool released = GetParam();
  const auto kv = generate_kv_sessions(two_phases(7));
  std::vector<std::uint64_t> last_read(kv.key_count(), never);
  std::uint64_t reads = 0;
  std::list<std::uint32_t> recency;  // most recent first
  std::unordered_map<std::uint32_t, std::list<std::uint32_t>::iterator> where;
  std::unordered_set<std::uint32_t> read;
  for (std::uint64_t step = 0; step < kv.steps(); ++step) {
    for (const std::uint32_t b : kv.blocks(step)) {
      last_read[b] = reads++;
      read.insert(b);
      if (const auto it = where.find(b); it != where.end()) recency.erase(it->second);
      recency.push_front(b);
      where[b] = recency.begin();
    }
    if (released) {
      for (const std::uint32_t b : kv.closing(step)) {
        if (const auto it = where.find(b); it != where.end()) {
          recency.erase(it->second);
          where.erase(it);
        }
      }
    }
    if (step % 37 != 0) continue;
    std::vector<std::uint64_t> want;
    std::uint64_t depth = 0;
    for (const std::uint32_t b : recency) {
      if (kv.closes_at(b) > step) want.push_back(depth);
      ++depth;
    }
    const std::size_t cached = want.size();
    for (std::uint32_t b = 0; b < kv.key_count(); ++b) {
      if (!read.contains(b) && kv.opens_at(b) <= step && kv.closes_at(b) > step) {
        want.push_back(want.empty() ? 0 : want.back() + 1);
      }
    }
    if (step == 0) {
      EXPECT_GT(want.size(), cached) << "sessions under way at the start are open, not yet read";
    }
    ASSERT_EQ(open_block_depths(kv, last_read, step, released), want) << "step " << step;
  }
}

// kv_reuse_observer, step by step, equals its parts run by hand: the reuse distances of a tracker
// over the stream (with released blocks forgotten as they close) and open_block_depths() over the
// last reads.
TEST_P(OpenBlockDepths, TheObserverEqualsItsPartsRunByHand) {
  const bool release = GetParam();
  const auto kv = generate_kv_sessions(two_phases(9));
  kv_reuse_observer observer(kv, release, true);
  const decayed_reuse_histogram::config cfg{.max_capacity = kv.key_count(), .bin_width = 1, .decay = 1.0};
  decayed_reuse_histogram got(cfg);
  decayed_reuse_histogram want(cfg);
  reuse_distance_tracker distances(kv.key_count());
  std::vector<std::uint64_t> last_read(kv.key_count(), never);
  std::uint64_t reads = 0;
  for (std::uint64_t step = 0; step < kv.steps(); ++step) {
    observer.observe(step, got);
    for (const std::uint32_t b : kv.blocks(step)) {
      want.record(distances.access(b));
      last_read[b] = reads++;
    }
    if (release) {
      for (const std::uint32_t b : kv.closing(step)) distances.forget(b);
    }
    if (step % 41 != 0) continue;
    ASSERT_EQ(observer.open_depths(step), open_block_depths(kv, last_read, step, release)) << "step " << step;
    for (const std::size_t n : {std::size_t{1}, std::size_t{16}, std::size_t{64}, std::size_t{256}}) {
      if (n > kv.key_count()) continue;
      ASSERT_EQ(got.predicted_misses(n), want.predicted_misses(n)) << "step " << step << " capacity " << n;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(ClosedBlocks, OpenBlockDepths, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "Released" : "Kept"; });

}  // namespace
}  // namespace expage

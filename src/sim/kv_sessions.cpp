#include "expage/sim/kv_sessions.hpp"

#include "expage/cache/eviction_policy.hpp"
#include "expage/core/error.hpp"
#include "expage/detail/assert.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <random>

namespace expage {

namespace {

void check_phase(const kv_phase& p, std::size_t i) {
  const auto fail = [&](std::string_view field, std::uint64_t value, std::string_view range) {
    throw invalid_argument(
        fmt::format("generate_kv_sessions: phases[{}] ('{}') {} {} out of range {}", i, p.name, field, value, range));
  };
  if (p.steps == 0) fail("steps", p.steps, "[1, 2^64)");
  if (p.concurrency == 0 || p.concurrency > 4096) fail("concurrency", p.concurrency, "[1, 4096]");
  if (p.turns == 0) fail("turns", p.turns, "[1, 2^32)");
  if (p.decode_tokens == 0) fail("decode_tokens", p.decode_tokens, "[1, 2^32)");
}

// A session slot of the continuous-batching scheduler.
struct session {
  bool decoding = false;           // else waiting for its next prefill
  std::uint64_t wait = 0;          // steps left before the next prefill
  std::uint32_t turn = 0;          // turns finished
  std::uint64_t tokens = 0;        // own tokens (after the shared full blocks)
  std::uint64_t decode_left = 0;   // tokens left to decode in this turn
  std::vector<std::uint32_t> own;  // its blocks, in order
};

}  // namespace

class detail::kv_session_generator {
 public:
  explicit kv_session_generator(const kv_session_options& o) : options_(o), rng_(o.seed) {}

  kv_block_stream run() {
    kv_block_stream out;
    out.block_tokens_ = options_.block_tokens;
    out.offset_.push_back(0);
    for (std::size_t i = 0; i < options_.phases.size(); ++i)
      phase(options_.phases[i], static_cast<std::uint32_t>(i), out);
    out.keys_ = next_id_;
    const std::uint64_t steps = out.offset_.size() - 1;
    for (auto& c : close_) c = c == open_ ? steps : c;  // still open at the end
    out.open_ = std::move(opened_);
    out.close_ = std::move(close_);
    // closing(s): the blocks bucketed by closing step (a counting sort; still-open blocks close at
    // steps(), past the last bucket).
    out.closing_offset_.assign(steps + 2, 0);
    for (const std::uint64_t c : out.close_) ++out.closing_offset_[c + 1];
    for (std::uint64_t s = 0; s <= steps; ++s) out.closing_offset_[s + 1] += out.closing_offset_[s];
    out.closing_.resize(out.close_.size());
    std::vector<std::uint64_t> at(out.closing_offset_.begin(), out.closing_offset_.end() - 1);
    for (std::uint32_t b = 0; b < out.close_.size(); ++b) out.closing_[at[out.close_[b]]++] = b;
    out.closing_offset_.resize(steps + 1);
    return out;
  }

 private:
  // Uniform in [lo, 2m − lo], mean m, with lo = ⌊m/2⌋ raised to `least` (≤ m), and at least
  // `least`; raw 64-bit draws only, so a seed gives the same stream on every platform. (The top
  // was m + ⌊m/2⌋: an odd mean came out half a token low; even means, every preset's, draw as
  // before.)
  std::uint64_t draw(std::uint64_t mean, std::uint64_t least) {
    const std::uint64_t lo = std::max(mean / 2, std::min(least, mean));
    const std::uint64_t hi = 2 * mean - lo;
    return std::max(least, lo + rng_() % (hi - lo + 1));
  }

  static constexpr std::uint64_t most_tokens = std::numeric_limits<std::uint64_t>::max();
  static constexpr std::uint64_t most_blocks = std::numeric_limits<std::uint32_t>::max() - 1;

  // Token counts saturate rather than wrap: a context past 2^64 − 1 tokens is far past the
  // limits reserve_blocks() enforces, and is refused there.
  static std::uint64_t add_tokens(std::uint64_t a, std::uint64_t b) noexcept {
    std::uint64_t sum = 0;
    return __builtin_add_overflow(a, b, &sum) ? most_tokens : sum;
  }
  static std::uint64_t multiply_tokens(std::uint64_t a, std::uint64_t b) noexcept {
    std::uint64_t product = 0;
    return __builtin_mul_overflow(a, b, &product) ? most_tokens : product;
  }

  // Refuses, before anything is allocated for them, @p more new blocks (past 2^32 − 2 blocks in
  // all) or a context of @p read blocks that one step reads (past max_references).
  void reserve_blocks(std::uint64_t more, std::uint64_t read) const {
    if (read > options_.max_references) {
      throw invalid_argument(
          fmt::format("generate_kv_sessions: a context of {} blocks at step {} of phases[{}] ('{}') passes "
                      "max_references {}; shorten the phase's contexts, or raise block_tokens",
                      read, step_ - phase_first_step_, phase_index_, phase_name_, options_.max_references));
    }
    if (more > most_blocks - next_id_) {
      throw invalid_argument(fmt::format("generate_kv_sessions: more than {} blocks; raise block_tokens", most_blocks));
    }
  }

  std::uint32_t new_block() {
    EXPAGE_ASSERT(next_id_ < most_blocks, "kv_session_generator: a block not reserved");
    opened_.push_back(step_);
    close_.push_back(open_);
    return next_id_++;
  }

  // Block ids for @p count blocks, checked first.
  std::vector<std::uint32_t> new_blocks(std::uint64_t count) {
    reserve_blocks(count, count);
    std::vector<std::uint32_t> out(static_cast<std::size_t>(count));
    for (auto& b : out) b = new_block();
    return out;
  }

  void grow(session& s, std::uint64_t tokens) {
    const std::uint64_t total = add_tokens(s.tokens, tokens);
    const std::uint64_t bt = options_.block_tokens;
    const std::uint64_t needed = total / bt + (total % bt != 0 ? 1 : 0);
    if (needed > s.own.size()) reserve_blocks(needed - s.own.size(), add_tokens(needed, shared_blocks_));
    s.tokens = total;
    while (s.own.size() < needed) s.own.push_back(new_block());
  }

  void start_session(session& s, const kv_phase& p) {
    close(s.own);
    s.own.clear();
    s.tokens = 0;
    s.turn = 0;
    grow(s, add_tokens(p.shared_prefix_tokens % options_.block_tokens, std::max<std::uint64_t>(p.prompt_tokens, 1)));
  }

  void phase(const kv_phase& p, std::uint32_t index, kv_block_stream& out) {
    step_ = out.offset_.size() - 1;  // the context of the sessions under way opens at the phase's first step
    phase_index_ = index;
    phase_name_ = p.name;
    phase_first_step_ = step_;
    shared_blocks_ = 0;
    const std::vector<std::uint32_t> shared = new_blocks(p.shared_prefix_tokens / options_.block_tokens);
    shared_blocks_ = shared.size();
    std::vector<session> slots(p.concurrency);
    // The phase starts in its steady state rather than with every session at its first turn: each
    // slot holds a session in a uniformly drawn turn, its earlier turns' tokens already in its
    // context, waiting a uniform share of a think time (or of a first start) before its next
    // prefill. Otherwise every session would return at once a think time into the phase, a wave
    // a long-running service never sees.
    for (session& s : slots) {
      const auto turn = static_cast<std::uint32_t>(rng_() % p.turns);
      if (turn == 0) {
        s.turn = p.turns;  // a new session starts after the wait
      } else {
        start_session(s, p);
        s.turn = turn;
        grow(s, add_tokens(multiply_tokens(turn - 1, add_tokens(p.append_tokens, p.decode_tokens)), p.decode_tokens));
      }
      s.wait = rng_() % (std::uint64_t{p.think_steps} + 1);
    }
    for (std::uint64_t step = 0; step < p.steps; ++step) {
      step_ = out.offset_.size() - 1;
      const std::size_t first = out.blocks_.size();
      bool any = false;
      const auto read = [&](session& s) {
        if (!any) {
          out.blocks_.insert(out.blocks_.end(), shared.begin(), shared.end());
          any = true;
        }
        out.blocks_.insert(out.blocks_.end(), s.own.begin(), s.own.end());
      };
      for (session& s : slots) {
        if (!s.decoding) {
          if (s.wait > 0) {
            --s.wait;
            continue;
          }
          if (s.turn >= p.turns) {
            start_session(s, p);
          } else {
            grow(s, p.append_tokens);
          }
          read(s);  // the prefill reads the whole prefix (cached or recomputed) and writes the new tokens
          s.decode_left = draw(p.decode_tokens, 1);
          s.decoding = true;
        } else {
          grow(s, 1);
          read(s);
          if (--s.decode_left == 0) {
            ++s.turn;
            s.decoding = false;
            s.wait = s.turn >= p.turns ? 0 : draw(p.think_steps, 0);
            if (s.turn >= p.turns) close(s.own);  // its last turn ended: the session is closed
          }
        }
      }
      const std::size_t n = out.blocks_.size() - first;
      out.peak_ = std::max<std::uint64_t>(out.peak_, n);
      if (out.blocks_.size() > options_.max_references) {
        throw invalid_argument(fmt::format(
            "generate_kv_sessions: the stream passes max_references {} at step {} of phases[{}] ('{}'); shorten the "
            "phase, its contexts or its concurrency, or raise block_tokens",
            options_.max_references, step, index, p.name));
      }
      out.offset_.push_back(out.blocks_.size());
      out.phase_.push_back(index);
    }
    // The phase ends: its sessions and its shared prefix close.
    step_ = out.offset_.size() - 2;
    for (const session& s : slots) close(s.own);
    close(shared);
  }

  // Records that the blocks @p blocks are closed at the end of the current step (once: the first
  // close stands).
  void close(const std::vector<std::uint32_t>& blocks) {
    for (const std::uint32_t b : blocks) {
      if (close_[b] == open_) close_[b] = step_;
    }
  }

  static constexpr std::uint64_t open_ = std::numeric_limits<std::uint64_t>::max();
  const kv_session_options& options_;
  std::mt19937_64 rng_;
  std::uint32_t next_id_ = 0;
  std::uint64_t step_ = 0;         // the stream's step being generated
  std::uint32_t phase_index_ = 0;  // the phase being generated, for messages
  std::string_view phase_name_;
  std::uint64_t phase_first_step_ = 0;  // its first step in the stream (messages count within the phase)
  std::uint64_t shared_blocks_ = 0;     // its shared prefix's full blocks, read with every session
  std::vector<std::uint64_t> opened_;   // per block: the step it opened at (kv_block_stream::opens_at())
  std::vector<std::uint64_t> close_;    // per block: the step its session closed at (open_ while open)
};

namespace {

constexpr std::string_view preset_list[] = {"tool-calls", "long-context", "phase-shift"};

kv_phase tool_calls_phase(std::uint64_t steps) {
  return {.name = "tool-calls",
          .steps = steps,
          .concurrency = 8,
          .turns = 6,
          .prompt_tokens = 1536,
          .append_tokens = 384,
          .decode_tokens = 24,
          .think_steps = 40,
          .shared_prefix_tokens = 2048};
}

kv_phase long_context_phase(std::uint64_t steps) {
  return {.name = "long-context",
          .steps = steps,
          .concurrency = 12,
          .turns = 4,
          .prompt_tokens = 16000,
          .append_tokens = 1000,
          .decode_tokens = 32,
          .think_steps = 160,
          .shared_prefix_tokens = 0};
}

}  // namespace

std::span<const std::string_view> kv_session_preset_names() noexcept { return preset_list; }

std::vector<kv_phase> kv_session_preset(std::string_view name, std::uint64_t steps) {
  if (steps < 3) throw invalid_argument(fmt::format("kv_session_preset: steps {} out of range [3, 2^64)", steps));
  if (name == "tool-calls") return {tool_calls_phase(steps)};
  if (name == "long-context") return {long_context_phase(steps)};
  if (name == "phase-shift") {
    return {tool_calls_phase(steps / 3), long_context_phase(steps / 3), tool_calls_phase(steps - 2 * (steps / 3))};
  }
  throw invalid_argument(
      fmt::format("kv_session_preset: unknown session mix '{}' (presets: {})", name, fmt::join(preset_list, ", ")));
}

kv_block_stream generate_kv_sessions(const kv_session_options& options) {
  if (options.block_tokens == 0 || options.block_tokens > 65536) {
    throw invalid_argument(
        fmt::format("generate_kv_sessions: block_tokens {} out of range [1, 65536]", options.block_tokens));
  }
  if (options.max_references == 0 || options.max_references > (std::uint64_t{1} << 32)) {
    throw invalid_argument(
        fmt::format("generate_kv_sessions: max_references {} out of range [1, 2^32]", options.max_references));
  }
  if (options.phases.empty()) throw invalid_argument("generate_kv_sessions: no phases (give at least one)");
  for (std::size_t i = 0; i < options.phases.size(); ++i) check_phase(options.phases[i], i);
  return detail::kv_session_generator(options).run();
}

kv_block_pool::kv_block_pool(std::uint32_t keys, std::uint64_t capacity_blocks)
    : sentinel_(keys),
      prev_(std::size_t{keys} + 1, keys),
      next_(std::size_t{keys} + 1, keys),
      state_(keys, unseen),
      capacity_(capacity_blocks) {
  if (capacity_blocks == 0) throw invalid_argument("kv_block_pool: capacity_blocks 0 out of range [1, 2^64)");
}

void kv_block_pool::unlink(std::uint32_t k) noexcept {
  next_[prev_[k]] = next_[k];
  prev_[next_[k]] = prev_[k];
}

void kv_block_pool::push_front(std::uint32_t k) noexcept {
  prev_[k] = sentinel_;
  next_[k] = next_[sentinel_];
  prev_[next_[sentinel_]] = k;
  next_[sentinel_] = k;
}

void kv_block_pool::evict_lru() noexcept {
  const std::uint32_t victim = prev_[sentinel_];
  unlink(victim);
  state_[victim] = evicted;
  --size_;
  ++totals_.evictions;
}

kv_read kv_block_pool::read(std::uint32_t block) {
  EXPAGE_ASSERT(block < sentinel_, "kv_block_pool::read: block out of range");
  ++totals_.references;
  if (state_[block] == cached) {
    ++totals_.hits;
    unlink(block);
    push_front(block);
    return kv_read::hit;
  }
  const kv_read r = state_[block] == unseen ? kv_read::cold : kv_read::recompute;
  ++(r == kv_read::cold ? totals_.cold : totals_.recomputes);
  if (size_ == capacity_) evict_lru();
  state_[block] = cached;
  push_front(block);
  ++size_;
  return r;
}

bool kv_block_pool::release(std::uint32_t block) {
  EXPAGE_ASSERT(block < sentinel_, "kv_block_pool::release: block out of range");
  if (state_[block] != cached) return false;
  unlink(block);
  state_[block] = evicted;
  --size_;
  ++totals_.released;
  return true;
}

void kv_block_pool::resize(std::uint64_t capacity_blocks) {
  if (capacity_blocks == 0) throw invalid_argument("kv_block_pool::resize: capacity_blocks 0 out of range [1, 2^64)");
  capacity_ = capacity_blocks;
  while (size_ > capacity_) evict_lru();
}

kv_pool_result simulate_kv_pool(const kv_block_stream& stream, std::uint64_t capacity_blocks,
                                std::span<const kv_capacity_change> schedule, bool release_closed) {
  if (capacity_blocks == 0) throw invalid_argument("simulate_kv_pool: capacity_blocks 0 out of range [1, 2^64)");
  for (std::size_t i = 0; i < schedule.size(); ++i) {
    const std::uint64_t least = i == 0 ? 0 : schedule[i - 1].step + 1;
    if (schedule[i].step < least || schedule[i].step >= std::max<std::uint64_t>(stream.steps(), 1)) {
      throw invalid_argument(fmt::format("simulate_kv_pool: schedule[{}].step {} out of range [{}, {})", i,
                                         schedule[i].step, least, std::max<std::uint64_t>(stream.steps(), 1)));
    }
    if (schedule[i].blocks == 0) {
      throw invalid_argument(fmt::format("simulate_kv_pool: schedule[{}].blocks 0 out of range [1, 2^64)", i));
    }
  }
  kv_block_pool pool(stream.key_count(), capacity_blocks);
  std::vector<std::uint64_t> step_recomputes;
  step_recomputes.reserve(stream.steps());
  auto change = schedule.begin();
  for (std::uint64_t s = 0; s < stream.steps(); ++s) {
    if (change != schedule.end() && change->step == s) {
      if (change->through != 0) pool.resize(change->through);
      pool.resize(change->blocks);
      ++change;
    }
    const std::uint64_t before = pool.totals().recomputes;
    for (const std::uint32_t k : stream.blocks(s)) (void)pool.read(k);
    step_recomputes.push_back(pool.totals().recomputes - before);
    if (release_closed) {
      for (const std::uint32_t k : stream.closing(s)) (void)pool.release(k);
    }
  }
  kv_pool_result r = pool.totals();
  r.step_recomputes = std::move(step_recomputes);
  return r;
}

std::vector<std::uint64_t> open_block_depths(const kv_block_stream& kv, std::span<const std::uint64_t> last_read,
                                             std::uint64_t step, bool release_closed) {
  if (last_read.size() > kv.key_count()) {
    throw invalid_argument(
        fmt::format("open_block_depths: last_read holds {} blocks, out of range [0, {}] (the "
                    "stream's blocks)",
                    last_read.size(), kv.key_count()));
  }
  std::vector<std::pair<std::uint64_t, std::uint32_t>> seen;  // (last read, block), most recent first
  for (std::uint32_t b = 0; b < last_read.size(); ++b) {
    if (last_read[b] != never) seen.emplace_back(last_read[b], b);
  }
  std::sort(seen.begin(), seen.end(), std::greater<>());
  std::vector<std::uint64_t> depths;
  std::uint64_t depth = 0;
  for (const auto& [read, block] : seen) {
    const bool open = kv.open_after(block, step);
    if (open) depths.push_back(depth);
    if (open || !release_closed) ++depth;  // a released block has left the stack
  }
  // The open blocks never read go below the deepest open one read (see the header).
  std::uint64_t next = depths.empty() ? 0 : depths.back() + 1;
  for (std::uint32_t b = 0; b < kv.key_count(); ++b) {
    const bool unread = b >= last_read.size() || last_read[b] == never;
    if (unread && kv.open_after(b, step)) depths.push_back(next++);
  }
  return depths;
}

kv_reuse_observer::kv_reuse_observer(const kv_block_stream& kv, bool release_closed, bool open_depths)
    : kv_(&kv),
      release_closed_(release_closed),
      open_depths_(open_depths),
      distances_(std::max<std::uint32_t>(kv.key_count(), 1)) {}

void kv_reuse_observer::observe(std::uint64_t s, decayed_reuse_histogram& reuses) {
  for (const std::uint32_t block : kv_->blocks(s)) reuses.record(distances_.access_unchecked(block));
  if (release_closed_) {
    for (const std::uint32_t block : kv_->closing(s)) distances_.forget(block);
  }
}

std::vector<std::uint64_t> kv_reuse_observer::open_depths(std::uint64_t s) const {
  EXPAGE_ASSERT(open_depths_, "kv_reuse_observer: built without open_depths");
  // The stack holds every block read (releasing: less those dropped at the end of the step their
  // conversation closed at, i.e. the blocks read and not open after s), so a block's stack
  // distance is the depth open_block_depths() counts for it.
  std::vector<std::uint64_t> depths;
  std::uint64_t unread = 0;  // open blocks never read
  for (std::uint32_t b = 0; b < kv_->key_count(); ++b) {
    if (!kv_->open_after(b, s)) continue;
    if (distances_.seen(b)) {
      depths.push_back(distances_.distance(b));
    } else {
      ++unread;
    }
  }
  std::sort(depths.begin(), depths.end());
  // As open_block_depths(): the open blocks never read go below the deepest open one read.
  std::uint64_t next = depths.empty() ? 0 : depths.back() + 1;
  for (std::uint64_t i = 0; i < unread; ++i) depths.push_back(next++);
  return depths;
}

}  // namespace expage

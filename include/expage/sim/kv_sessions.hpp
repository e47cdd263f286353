/// @file
/// @brief The KV side of the expert/KV split: a session model that generates the KV block
/// references of a served workload, and an LRU block pool that replays them under a capacity
/// that may change at drained barriers.
///
/// MV-WSA (WiSP §3.3–3.5) trades expert slots against KV blocks, so the simulator needs a KV
/// stream beside the expert one. WiSP's own is not published; this model follows the design of
/// the control-layer notes (Part C(i), item 8):
///
/// - C session slots are served at once (continuous batching); a slot runs sessions back to back;
/// - a session is a sequence of turns; a turn appends tokens (the prompt, then a tool's output or
///   a user message), which the turn's prefill writes, then decodes some tokens, one per step;
/// - between turns the session waits (a tool call) while the others run; its KV stays cached
///   (prefix caching) unless the pool evicts it, and the next turn's prefill reads the whole
///   prefix again: that cross-turn reuse is the far mode of WiSP's bimodal reuse distances;
/// - every step of a running session reads every block of its context: the near mode, which
///   makes the KV LRU curve a step at the working set (WiSP §3.5's claim);
/// - every session of a phase shares a system prompt (the same prefix blocks).
///
/// Step i of a KV stream is forward pass i of the expert stream it is paired with.
/// @code
/// expage::kv_session_options o;
/// o.phases = {{.name = "tool-calls", .steps = 2048, .concurrency = 8, .turns = 6, .prompt_tokens = 512,
///              .append_tokens = 256, .decode_tokens = 48, .think_steps = 96, .shared_prefix_tokens = 1024}};
/// const auto kv = expage::generate_kv_sessions(o);
/// const auto pool = expage::simulate_kv_pool(kv, /*capacity_blocks=*/1200);
/// @endcode
#pragma once

#include "expage/cache/decayed_reuse_histogram.hpp"
#include "expage/cache/reuse_distance.hpp"

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace expage {

namespace detail {
class kv_session_generator;
}  // namespace detail

/// @brief One stationary stretch of a workload: a session mix.
struct kv_phase {
  std::string name;                 ///< For reports ("tool-calls", "long-context").
  std::uint64_t steps = 0;          ///< Scheduler steps (forward passes) it lasts, ≥ 1.
  std::uint32_t concurrency = 1;    ///< Sessions served at once (C), [1, 4096].
  std::uint32_t turns = 1;          ///< Turns per session, ≥ 1.
  std::uint32_t prompt_tokens = 0;  ///< Tokens of a session's first turn after the shared prefix.
  std::uint32_t append_tokens = 0;  ///< Tokens each later turn appends (tool output, user message).
  std::uint32_t decode_tokens = 1;  ///< Mean tokens decoded per turn (uniform in [⌊d/2⌋, 2d − ⌊d/2⌋]), ≥ 1.
  std::uint32_t think_steps = 0;    ///< Mean steps a session waits between turns (same spread).
  std::uint32_t shared_prefix_tokens = 0;  ///< System prompt every session of the phase shares.
};

/// @brief Parameters of generate_kv_sessions().
struct kv_session_options {
  std::uint32_t block_tokens = 16;  ///< Tokens per KV block (vLLM's default 16), [1, 65536].
  std::vector<kv_phase> phases;     ///< In order; at a phase's start every slot begins a new session.
  std::uint64_t seed = 1;           ///< Seed of the length draws (same seed, same stream everywhere).
  /// At most this many block references in all, [1, 2^32]: a guard against a phase whose
  /// contexts would make the stream larger than memory. A context that alone passes it (its
  /// blocks and the shared prefix's, read at one step) is refused before its blocks are made.
  std::uint64_t max_references = std::uint64_t{1} << 30;
};

/// @brief The KV block references of a workload, step by step (one step per forward pass).
/// @threadsafety thread-compatible (immutable after construction).
class kv_block_stream {
 public:
  kv_block_stream() = default;
  /// Steps (forward passes).
  [[nodiscard]] std::uint64_t steps() const noexcept { return offset_.empty() ? 0 : offset_.size() - 1; }
  /// The blocks step @p s reads, each once, in order (a session's prefix first).
  [[nodiscard]] std::span<const std::uint32_t> blocks(std::uint64_t s) const noexcept {
    return std::span(blocks_).subspan(offset_[s], offset_[s + 1] - offset_[s]);
  }
  /// Distinct blocks ever referenced (block ids are [0, key_count())).
  [[nodiscard]] std::uint32_t key_count() const noexcept { return keys_; }
  /// Block references in all.
  [[nodiscard]] std::uint64_t references() const noexcept { return blocks_.size(); }
  /// Tokens per block.
  [[nodiscard]] std::uint32_t block_tokens() const noexcept { return block_tokens_; }
  /// The phase step @p s belongs to.
  [[nodiscard]] std::uint32_t phase(std::uint64_t s) const noexcept { return phase_[s]; }
  /// The largest number of blocks one step reads: the least pool that never thrashes within a step.
  [[nodiscard]] std::uint64_t peak_step_blocks() const noexcept { return peak_; }
  /// The step at whose end the session owning block @p block closed (its last turn ended, or its
  /// phase did; a phase's shared prefix closes with the phase), steps() if it is still open at the
  /// stream's end. No step after it reads the block. A block is open after step s when this is
  /// greater than s: what a session-aware engine knows without seeing the future (which cached
  /// blocks belong to conversations still open, idle ones waiting on a tool included).
  /// @pre block < key_count().
  [[nodiscard]] std::uint64_t closes_at(std::uint32_t block) const noexcept { return close_[block]; }
  /// The first step at which block @p block belongs to a conversation: the step whose prefill or
  /// decode writes it, or the phase's first step for a phase's shared prefix and for the context
  /// of a session already under way when its phase began (a phase starts in its steady state).
  /// Such a block exists before the pool has seen it: an engine knows the length of every open
  /// conversation, cached or not.
  /// @pre block < key_count().
  [[nodiscard]] std::uint64_t opens_at(std::uint32_t block) const noexcept { return open_[block]; }
  /// True when block @p block's conversation is open after step @p step: opens_at() ≤ step <
  /// closes_at(). @pre block < key_count().
  [[nodiscard]] bool open_after(std::uint32_t block, std::uint64_t step) const noexcept {
    return open_[block] <= step && step < close_[block];
  }
  /// The blocks whose conversation closes at the end of step @p s (closes_at() == s), ascending.
  /// @pre s < steps().
  [[nodiscard]] std::span<const std::uint32_t> closing(std::uint64_t s) const noexcept {
    return std::span(closing_).subspan(closing_offset_[s], closing_offset_[s + 1] - closing_offset_[s]);
  }

 private:
  friend class detail::kv_session_generator;
  std::vector<std::uint64_t> offset_;
  std::vector<std::uint32_t> blocks_;
  std::vector<std::uint32_t> phase_;
  std::vector<std::uint64_t> open_;
  std::vector<std::uint64_t> close_;
  std::vector<std::uint64_t> closing_offset_;  // closing(s) is closing_[closing_offset_[s], closing_offset_[s + 1])
  std::vector<std::uint32_t> closing_;
  std::uint32_t keys_ = 0;
  std::uint32_t block_tokens_ = 16;
  std::uint64_t peak_ = 0;
};

/// @brief The built-in session mixes (docs/control.md), each lasting @p steps steps:
/// - "tool-calls": 8 agents calling quick tools behind a shared 2,048-token system prompt
///   (1,536-token task, 384 tokens appended per turn, 24 decoded, 40-step tool calls, 6 turns);
/// - "long-context": 12 agents over 16,000-token documents waiting on slow tools (1,000 tokens
///   appended per turn, 32 decoded, 160-step tool calls, 4 turns): most of their KV sits idle;
/// - "phase-shift": tool-calls, long-context, tool-calls, a third of the steps each.
/// @throws expage::invalid_argument for an unknown name (listing the presets) or steps < 3.
[[nodiscard]] std::vector<kv_phase> kv_session_preset(std::string_view name, std::uint64_t steps);
/// The preset names.
[[nodiscard]] std::span<const std::string_view> kv_session_preset_names() noexcept;

/// @brief The LRU stack depths, ascending, of the blocks of @p kv whose session is still open
/// after step @p step (kv_block_stream::open_after()): what a session-aware engine tells a split
/// controller (kv_predicted_misses(), split_controller::set_kv_open_depths(),
/// four_pool_controller::set_kv_open_depths()). A block's depth is the number of blocks read since
/// it was last read. An open block never read (the context of a session under way when its phase
/// began) is placed below the deepest open block read so far, as if read just before it: the open
/// conversations need the pool to hold them too, and closed blocks, which nothing reads again, go
/// first. O(K log K) for K blocks read so far, plus O(B) for the B blocks of the stream.
/// kv_reuse_observer gives the same depths from its stack-distance tracker, without the sort of
/// every block read (this function is their reference).
/// @param kv the block stream (its sessions and their closing steps).
/// @param step the step after which a session counts as open.
/// @param last_read per block, the position of its last read in the order of all block reads
///        (`never`: not read yet); at most key_count() entries (the blocks past its end unread).
/// @param release_closed the pool drops closed conversations' blocks (simulate_kv_pool()'s
///        release_closed): a depth then counts only the open blocks read since.
/// @throws expage::invalid_argument when @p last_read is longer than the stream's blocks.
[[nodiscard]] std::vector<std::uint64_t> open_block_depths(const kv_block_stream& kv,
                                                           std::span<const std::uint64_t> last_read, std::uint64_t step,
                                                           bool release_closed = false);

/// @brief What a session-aware engine's shadow of its KV pool sees, step by step: each read's LRU
/// reuse distance over the whole history (the input of the split and four-pool controllers' KV
/// histograms) and, at a barrier, the open sessions' depths (open_block_depths()'s, read from the
/// same stack: O(B + O log K) for the B blocks of the stream and the O open ones read). With
/// @p release_closed it follows a pool that drops closed conversations (simulate_kv_pool()'s
/// release_closed): their blocks leave its stack at the end of the step they close at
/// (reuse_distance_tracker::forget()).
/// @threadsafety thread-compatible.
class kv_reuse_observer {
 public:
  /// @param kv the block stream; it must outlive the observer.
  /// @param release_closed follow a pool that drops closed conversations' blocks.
  /// @param open_depths open_depths() will be called (checked in debug builds).
  kv_reuse_observer(const kv_block_stream& kv, bool release_closed, bool open_depths);
  /// Records the reads of step @p s, in order, into @p reuses (a first read's distance is
  /// reuse_distance_tracker::cold), then drops the blocks closing at @p s when releasing.
  /// @pre steps are observed in order, each once; s < kv.steps().
  void observe(std::uint64_t s, decayed_reuse_histogram& reuses);
  /// open_block_depths() after step @p s, the last step observed.
  /// @pre constructed with open_depths.
  [[nodiscard]] std::vector<std::uint64_t> open_depths(std::uint64_t s) const;

 private:
  const kv_block_stream* kv_;
  bool release_closed_;
  [[maybe_unused]] bool open_depths_;  // read by a debug-build check only
  reuse_distance_tracker distances_;   // the LRU stack of the blocks read (and, releasing, not dropped)
};

/// Generates the block references of @p options' phases.
/// @throws expage::invalid_argument naming the first field out of range (phase index, field,
///         value, range), or when the stream would exceed max_references or 2^32 − 1 blocks.
[[nodiscard]] kv_block_stream generate_kv_sessions(const kv_session_options& options);

/// @brief A change of the KV pool's size at a drained barrier.
struct kv_capacity_change {
  std::uint64_t step = 0;    ///< The step before which it applies.
  std::uint64_t blocks = 0;  ///< The pool's blocks from then on.
  /// Not 0: the pool passes through this many blocks first, a shrink whose split was then refused
  /// and undone (its evictions stay: the pool gets its blocks back, emptier).
  std::uint64_t through = 0;
};

/// @brief What a KV pool replay measured.
struct kv_pool_result {
  std::uint64_t references = 0;                ///< Block reads.
  std::uint64_t hits = 0;                      ///< Reads of a cached block.
  std::uint64_t cold = 0;                      ///< First reads: the KV is written then, by the step itself (no cost).
  std::uint64_t recomputes = 0;                ///< Reads of a block evicted earlier: its tokens are prefilled again.
  std::uint64_t evictions = 0;                 ///< Blocks evicted (by a read or by a shrink).
  std::uint64_t released = 0;                  ///< Blocks dropped as their conversation closed (release_closed).
  std::vector<std::uint64_t> step_recomputes;  ///< Recomputes of every step, in order.
};

/// @brief What kv_block_pool::read() found.
enum class kv_read : std::uint8_t {
  hit,        ///< The block was cached.
  cold,       ///< Its first read: the step itself writes the KV (no cost).
  recompute,  ///< It was evicted earlier: its tokens are prefilled again.
};

/// @brief An engine's KV block pool as a cache of block ids: LRU under a capacity in blocks that may
/// change at drained barriers (prefix caching: a block stays cached until evicted; a read pins
/// nothing). simulate_kv_pool() replays a whole stream through one; an engine or an example that
/// runs step by step (`examples/moe_decode --four-pool`) reads each step's blocks into it and
/// resizes it where its split controller decides. The bytes are the caller's to charge: the pool
/// tracks which blocks hold KV, not the KV.
/// @code
/// expage::kv_block_pool pool(kv.key_count(), 1200);
/// for (const std::uint32_t b : kv.blocks(s)) recomputes += pool.read(b) == expage::kv_read::recompute;
/// pool.resize(900);  // at a barrier: evicts the least recently read blocks
/// @endcode
/// @threadsafety thread-compatible.
class kv_block_pool {
 public:
  /// A pool of @p capacity_blocks blocks over block ids [0, @p keys).
  /// @throws expage::invalid_argument for a capacity of 0.
  kv_block_pool(std::uint32_t keys, std::uint64_t capacity_blocks);
  /// Reads block @p block: cached afterwards, the most recently read; evicts the least recently
  /// read block when the pool was full. @pre block < keys.
  kv_read read(std::uint32_t block);
  /// Drops block @p block (its conversation closed); false when it was not cached. @pre block < keys.
  bool release(std::uint32_t block);
  /// Sets the capacity, evicting the least recently read blocks down to it.
  /// @throws expage::invalid_argument for a capacity of 0 (and changes nothing).
  void resize(std::uint64_t capacity_blocks);
  /// Blocks cached.
  [[nodiscard]] std::uint64_t size() const noexcept { return size_; }
  /// The capacity in blocks.
  [[nodiscard]] std::uint64_t capacity() const noexcept { return capacity_; }
  /// Totals since construction (kv_pool_result's, without the per-step series).
  [[nodiscard]] const kv_pool_result& totals() const noexcept { return totals_; }

 private:
  enum : std::uint8_t { unseen, cached, evicted };
  void unlink(std::uint32_t k) noexcept;
  void push_front(std::uint32_t k) noexcept;
  void evict_lru() noexcept;

  // An LRU list over block ids: nodes [0, keys) plus a sentinel at index keys (next of the
  // sentinel = the most recently read).
  std::uint32_t sentinel_;
  std::vector<std::uint32_t> prev_, next_;
  std::vector<std::uint8_t> state_;
  std::uint64_t size_ = 0;
  std::uint64_t capacity_;
  kv_pool_result totals_;
};

/// @brief Replays @p stream against an LRU pool of @p capacity_blocks blocks (prefix caching:
/// a block stays cached until evicted; a step's reads pin nothing, so a step that reads more
/// blocks than the pool holds thrashes, the cliff below WiSP's admission floor).
/// @p schedule resizes the pool before the given steps (increasing); a shrink evicts the least
/// recently used blocks. With @p release_closed the pool drops a conversation's blocks when it
/// closes (kv_block_stream::closing()), as a session-aware engine can: nothing reads them again,
/// and under plain LRU they sit above the idle sessions' blocks until they sink out.
/// @throws expage::invalid_argument for a capacity of 0 or a schedule out of order or range.
[[nodiscard]] kv_pool_result simulate_kv_pool(const kv_block_stream& stream, std::uint64_t capacity_blocks,
                                              std::span<const kv_capacity_change> schedule = {},
                                              bool release_closed = false);

}  // namespace expage

/// @file
/// @brief host_copy_engine: chunked copies run in parallel by a pool of worker threads, fenced by completions.
#pragma once

#include "expage/stream/async_stream.hpp"
#include "expage/stream/host_stream.hpp"

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace expage {

/// @brief One copy of a batch: @p bytes from @p src to @p dst (the ranges must not overlap, and
/// a batch's regions run in parallel: none may write what another writes or reads).
struct copy_region {
  void* dst = nullptr;        ///< Destination; may be null only when bytes is 0.
  const void* src = nullptr;  ///< Source; may be null only when bytes is 0.
  std::size_t bytes = 0;      ///< Bytes to copy.
};

/// @brief Checks a batch of copies before any of it runs, as host_copy_engine and
/// cuda::copy_engine run batches (their regions' chunks in parallel, in no order): no null
/// pointer with bytes > 0, no range that wraps around the address space, no region whose
/// destination overlaps its source, and no region that writes what another writes or reads.
/// O(r log r) for r regions.
/// @throws expage::invalid_argument naming @p who, the region (or both regions) and the ranges.
void check_copy_regions(std::span<const copy_region> regions, std::string_view who);

namespace detail {
struct copy_job;
struct copy_chunk;
}  // namespace detail

/// @brief The completion of one host_copy_engine submission (a copy or a batch).
///
/// Models both `completion` (ready(), wait()) and `stream_event` (query(),
/// synchronize()). Copies share one state, which outlives the engine. A
/// default-constructed one is complete, like an event never recorded. ready()
/// returning true synchronizes with every chunk's copy: the bytes are visible
/// to the observing thread.
///
/// @code
/// expage::copy_completion done = engine.copy_async(page, stored, bytes);
/// /* ... other work ... */
/// done.synchronize();   // waits, then rethrows the first error of a chunk, if any
/// @endcode
/// @threadsafety thread-safe; ready() and query() are lock-free.
class copy_completion {
 public:
  /// A completion of nothing: already complete, without error.
  copy_completion() noexcept = default;

  /// True once every chunk has been copied, failed or skipped. Never blocks, never throws.
  [[nodiscard]] bool ready() const noexcept;
  /// Blocks until ready(); does not report errors (see synchronize()).
  void wait() const noexcept;
  /// Same as ready(): the stream_event spelling.
  [[nodiscard]] bool query() const noexcept { return ready(); }
  /// Blocks until ready(), then rethrows the first exception a chunk's copy threw, if any.
  /// @throws whatever the engine's chunk copier threw.
  void synchronize() const;
  /// The first exception a chunk threw (null while none did). Meaningful once ready().
  [[nodiscard]] std::exception_ptr error() const;

 private:
  friend class host_copy_engine;
  explicit copy_completion(std::shared_ptr<detail::copy_job> job) noexcept : job_(std::move(job)) {}
  std::shared_ptr<detail::copy_job> job_;
};

static_assert(stream_event<copy_completion>);

/// @brief Counters of a host_copy_engine.
struct host_copy_engine_statistics {
  std::uint64_t submissions = 0;     ///< copy_async() calls, blocking and stream-ordered ones included.
  std::uint64_t stream_copies = 0;   ///< Copies enqueued on a host_stream.
  std::uint64_t chunks = 0;          ///< Chunks copied.
  std::uint64_t helped_chunks = 0;   ///< Of those, chunks the waiting thread (copy() or a stream's) copied.
  std::uint64_t bytes = 0;           ///< Bytes those chunks moved.
  std::uint64_t failed_chunks = 0;   ///< Chunks whose copier threw.
  std::uint64_t skipped_chunks = 0;  ///< Chunks not copied because an earlier chunk of their submission failed.
};

/// @brief Construction parameters of a host_copy_engine.
struct host_copy_engine_options {
  /// The function that copies one chunk (`dst`, `src`, `bytes`); empty: std::memcpy. Runs on a
  /// worker thread, or on the thread that waits for the submission (copy(), or a stream's thread);
  /// an exception it throws fails its submission. Hook for a transform (a decode,
  /// non-temporal stores) or a test double.
  using chunk_copier = std::function<void(std::byte* dst, const std::byte* src, std::size_t bytes)>;

  std::size_t threads = 1;                         ///< Worker threads, in [1, 256].
  std::size_t chunk_bytes = std::size_t{2} << 20;  ///< Bytes per chunk, in [64, 2^30].
  chunk_copier copier{};                           ///< Empty: std::memcpy.
  /// Submissions of at least this many bytes are copied (by the default copier) with
  /// non-temporal stores: a page fill is read later by a kernel, not now by this core, and
  /// the stores skip the read-for-ownership of each destination line (glibc's memcpy does the
  /// same above a cache-sized threshold, which chunks never reach). SIZE_MAX: never.
  std::size_t streaming_threshold = std::size_t{2} << 20;
};

/// @brief Chunked parallel copies into mapped pages: the host backend of the
/// copy engine (PreScope §4.4's fine-grained chunked transfers).
///
/// Each submission, one copy or a batch (the tensors of a layer), is split into
/// chunks of at most chunk_bytes, appended to one FIFO queue and copied by
/// threads() workers in parallel; a copy_completion reports when the last chunk
/// is done. Workers take submissions in FIFO order; their chunks run concurrently.
/// Nothing busy-waits: workers sleep on a condition variable, waiters on the
/// completion's atomic counter.
///
/// The waiting thread helps. A thread that would block until its own submission
/// is done (in copy(), or a stream's thread in stream order) copies that
/// submission's untaken chunks itself, beside the workers, before it waits: its
/// copy starts without waiting for a worker to wake up or for earlier submissions
/// to drain, and one more core copies. copy_async() does not help: its caller goes on.
///
/// Stream order. copy(..., host_stream&) enqueues on the stream one task that,
/// when the stream's thread reaches it, submits the copy, helps, and blocks that
/// thread until the completion is ready, then rethrows a chunk's error. So the copy
/// starts only after the work enqueued on the stream before it (its source may
/// be written by an earlier callback, its destination read by an earlier one),
/// and work enqueued after it, including an event record, runs only once every
/// chunk is copied: it is a stream copy, only parallel. A failing chunk becomes
/// the stream's sticky error; on a stream already in error the copy is skipped,
/// as host_stream::copy() would be. That is what a tensor_storage loader needs:
///
/// @code
/// expage::host_copy_engine engine({.threads = 2, .chunk_bytes = 2_MiB});
/// expage::tensor_storage<expage::host_stream> storage(geometry, expage::precision::bf16, host,
///     {.loader = [&](auto stored, auto page, expage::host_stream& s) {
///        engine.copy(page.data(), stored.data(), stored.size(), s);   // in stream order
///      }});
/// expage::copy_completion done = engine.copy_async(dst, src, 256_MiB);   // or without a stream
/// done.synchronize();
/// @endcode
///
/// Shutdown: the destructor first waits until every copy enqueued on a stream
/// has run or been skipped there, then lets the workers drain every queued
/// chunk, then joins them; completions stay valid after it. A chunk copier
/// must not wait on its own engine (deadlock).
///
/// @threadsafety thread-safe: any thread may submit; the engine must not be
/// destroyed while another thread submits to it.
class host_copy_engine {
 public:
  /// Starts the workers.
  /// @throws expage::invalid_argument for threads or chunk_bytes out of range.
  /// @throws std::system_error when a thread cannot be started (nothing is kept).
  explicit host_copy_engine(host_copy_engine_options opts);
  /// One worker, 2 MiB chunks, std::memcpy.
  host_copy_engine() : host_copy_engine(host_copy_engine_options{}) {}
  host_copy_engine(const host_copy_engine&) = delete;
  host_copy_engine& operator=(const host_copy_engine&) = delete;
  /// Waits for stream-ordered copies to run, drains every queued chunk, joins the workers.
  ~host_copy_engine();

  /// Starts copying @p bytes from @p src to @p dst; the caller is not blocked.
  /// @throws expage::invalid_argument for a null pointer with bytes > 0 or overlapping ranges.
  [[nodiscard]] copy_completion copy_async(void* dst, const void* src, std::size_t bytes);
  /// Starts copying every region of @p regions (one completion for all of them).
  /// @throws expage::invalid_argument as above, naming the region's index, or for a region that
  ///         writes what another writes or reads (naming both).
  [[nodiscard]] copy_completion copy_async(std::span<const copy_region> regions);

  /// Copies and waits, as copy_async(@p dst, @p src, @p bytes).synchronize(), except that the
  /// calling thread copies chunks of this submission beside the workers instead of idling.
  /// @throws expage::invalid_argument as copy_async(), or what a chunk copier threw.
  void copy(void* dst, const void* src, std::size_t bytes);
  /// Copies a batch and waits, the calling thread copying beside the workers (see above).
  /// @throws expage::invalid_argument as copy_async(), or what a chunk copier threw.
  void copy(std::span<const copy_region> regions);
  /// Enqueues the copy on @p stream, in stream order (see the class comment). The pointers must stay
  /// valid until the stream has run it.
  /// @throws expage::invalid_argument as copy_async(), at once, on the calling thread.
  void copy(void* dst, const void* src, std::size_t bytes, host_stream& stream);
  /// Enqueues a batch on @p stream, in stream order; one stream task for all its regions.
  /// @throws expage::invalid_argument as copy_async(), at once, on the calling thread.
  void copy(std::span<const copy_region> regions, host_stream& stream);

  [[nodiscard]] std::size_t threads() const noexcept { return workers_.size(); }   ///< Worker threads.
  [[nodiscard]] std::size_t chunk_bytes() const noexcept { return chunk_bytes_; }  ///< Bytes per chunk.
  [[nodiscard]] host_copy_engine_statistics statistics() const;                    ///< A snapshot of the counters.

 private:
  [[nodiscard]] copy_completion submit(std::span<const copy_region> regions, bool helped);
  void submit_and_help(std::span<const copy_region> regions);
  void run_worker();
  void help(detail::copy_job& job);
  void run_chunk(std::unique_lock<std::mutex>& lock, detail::copy_job& job, const detail::copy_chunk& c, bool helping);

  std::size_t chunk_bytes_;
  std::size_t streaming_threshold_;
  host_copy_engine_options::chunk_copier copier_;
  mutable std::mutex mutex_;  // guards queue_ (and each queued job's next chunk), stopping_, stream_tasks_, stats_
  std::condition_variable work_cv_;
  std::condition_variable streams_cv_;                   // stream_tasks_ reached 0
  std::deque<std::shared_ptr<detail::copy_job>> queue_;  // submissions with chunks not yet taken, FIFO
  bool stopping_ = false;
  std::size_t stream_tasks_ = 0;  // stream-ordered copies enqueued and not yet run or skipped
  host_copy_engine_statistics stats_;
  std::vector<std::thread> workers_;
};

}  // namespace expage

#include "expage/stream/host_copy_engine.hpp"

#include "expage/core/error.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <string_view>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace expage {

namespace detail {

// One chunk of a submission.
struct copy_chunk {
  std::byte* dst;
  const std::byte* src;
  std::size_t bytes;
};

// One submission: its chunks, taken in order by the workers, and its completion state.
struct copy_job {
  using chunk = copy_chunk;
  std::vector<chunk> chunks;  // immutable once queued
  bool streaming = false;     // copy with non-temporal stores (a large submission)
  std::size_t next = 0;       // next chunk to take; guarded by the engine's mutex
  // Chunks not yet finished (copied, failed or skipped). Every decrement is a
  // release (acq_rel) RMW, so they all form one release sequence: the acquire
  // load that reads 0 in copy_completion synchronizes with every worker's copy.
  std::atomic<std::size_t> remaining{0};
  // Set once a chunk failed: later chunks of the job are skipped. Relaxed: a
  // hint only; the error itself is published under error_mutex.
  std::atomic<bool> failed{false};
  mutable std::mutex error_mutex;
  std::exception_ptr error;  // guarded by error_mutex
};

}  // namespace detail

namespace {

constexpr std::size_t max_threads = 256;
constexpr std::size_t min_chunk_bytes = 64;
constexpr std::size_t max_chunk_bytes = std::size_t{1} << 30;

// memcpy with non-temporal stores for the 64-byte-aligned body of the destination.
void streaming_copy(std::byte* dst, const std::byte* src, std::size_t bytes) noexcept {
#if defined(__x86_64__)
  const std::size_t head = (64 - reinterpret_cast<std::uintptr_t>(dst) % 64) % 64;
  if (bytes < head + 64) {
    std::memcpy(dst, src, bytes);
    return;
  }
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  bytes -= head;
  const std::size_t body = bytes / 64 * 64;
  for (std::size_t i = 0; i < body; i += 64) {
    const auto* from = reinterpret_cast<const __m128i*>(src + i);
    auto* to = reinterpret_cast<__m128i*>(dst + i);
    const __m128i a = _mm_loadu_si128(from);
    const __m128i b = _mm_loadu_si128(from + 1);
    const __m128i c = _mm_loadu_si128(from + 2);
    const __m128i d = _mm_loadu_si128(from + 3);
    _mm_stream_si128(to, a);
    _mm_stream_si128(to + 1, b);
    _mm_stream_si128(to + 2, c);
    _mm_stream_si128(to + 3, d);
  }
  std::memcpy(dst + body, src + body, bytes - body);
  // Non-temporal stores are weakly ordered: drain them before the chunk is
  // reported done (the acq_rel decrement then publishes them like any store).
  _mm_sfence();
#else
  std::memcpy(dst, src, bytes);
#endif
}

}  // namespace

// --- copy_completion -----------------------------------------------------------------

bool copy_completion::ready() const noexcept {
  // Acquire: pairs with the workers' acq_rel decrements (see copy_job::remaining).
  return job_ == nullptr || job_->remaining.load(std::memory_order_acquire) == 0;
}

void copy_completion::wait() const noexcept {
  if (job_ == nullptr) return;
  // Acquire: pairs with the workers' acq_rel decrements; the last one notifies.
  for (std::size_t left = job_->remaining.load(std::memory_order_acquire); left != 0;
       left = job_->remaining.load(std::memory_order_acquire)) {
    job_->remaining.wait(left, std::memory_order_acquire);
  }
}

void copy_completion::synchronize() const {
  wait();
  if (std::exception_ptr e = error()) std::rethrow_exception(e);
}

std::exception_ptr copy_completion::error() const {
  if (job_ == nullptr) return nullptr;
  const std::lock_guard lock(job_->error_mutex);
  return job_->error;
}

// --- host_copy_engine ----------------------------------------------------------------

host_copy_engine::host_copy_engine(host_copy_engine_options opts)
    : chunk_bytes_(opts.chunk_bytes), streaming_threshold_(opts.streaming_threshold), copier_(std::move(opts.copier)) {
  if (opts.threads < 1 || opts.threads > max_threads) {
    throw invalid_argument(fmt::format("host_copy_engine: threads {} out of range [1, {}]", opts.threads, max_threads));
  }
  if (opts.chunk_bytes < min_chunk_bytes || opts.chunk_bytes > max_chunk_bytes) {
    throw invalid_argument(fmt::format("host_copy_engine: chunk_bytes {} out of range [{}, {}]", opts.chunk_bytes,
                                       min_chunk_bytes, max_chunk_bytes));
  }
  workers_.reserve(opts.threads);
  try {
    for (std::size_t i = 0; i < opts.threads; ++i) workers_.emplace_back([this] { run_worker(); });
  } catch (...) {
    {
      const std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    work_cv_.notify_all();
    for (auto& w : workers_) w.join();
    throw;
  }
}

host_copy_engine::~host_copy_engine() {
  {
    // Stream-ordered copies still queued on a stream reach the engine later:
    // wait until each has run or been skipped, so none outlives the engine.
    std::unique_lock lock(mutex_);
    streams_cv_.wait(lock, [&] { return stream_tasks_ == 0; });
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (auto& w : workers_) w.join();
}

void check_copy_regions(std::span<const copy_region> regions, std::string_view who) {
  for (std::size_t i = 0; i < regions.size(); ++i) {
    const copy_region& r = regions[i];
    if (r.bytes == 0) continue;
    if (r.dst == nullptr || r.src == nullptr) {
      throw invalid_argument(fmt::format("{}: region {} of {} bytes has a null {} (allowed only for 0 bytes)", who, i,
                                         r.bytes, r.dst == nullptr ? "destination" : "source"));
    }
    const auto d = reinterpret_cast<std::uintptr_t>(r.dst);
    const auto s = reinterpret_cast<std::uintptr_t>(r.src);
    const std::uintptr_t limit = std::numeric_limits<std::uintptr_t>::max() - std::max(d, s);
    if (r.bytes > limit) {
      throw invalid_argument(
          fmt::format("{}: region {}: {} bytes out of range [0, {}] (the range would wrap around the address space)",
                      who, i, r.bytes, limit));
    }
    if (d < s + r.bytes && s < d + r.bytes) {
      throw invalid_argument(fmt::format("{}: region {}: destination [{:#x}, {:#x}) overlaps source [{:#x}, {:#x})",
                                         who, i, d, d + r.bytes, s, s + r.bytes));
    }
  }
  if (regions.size() < 2) return;
  // Across regions: their chunks run in parallel, in no order, so no region may write what another
  // writes or reads.
  const auto clash = [who](std::size_t writer, std::uintptr_t begin, std::uintptr_t end, std::size_t other,
                           std::string_view does, std::uintptr_t b, std::uintptr_t e) {
    return invalid_argument(
        fmt::format("{}: region {} writes [{:#x}, {:#x}), which region {} {} ([{:#x}, {:#x})): regions of one batch "
                    "run in parallel and must not overlap",
                    who, writer, begin, end, other, does, b, e));
  };
  const auto span_of = [](const void* p, std::size_t bytes) {
    const auto b = reinterpret_cast<std::uintptr_t>(p);
    return std::pair{b, b + bytes};
  };
  const auto overlap = [](std::pair<std::uintptr_t, std::uintptr_t> x, std::pair<std::uintptr_t, std::uintptr_t> y) {
    return x.first < y.second && y.first < x.second;
  };
  // A few regions (an expert's tensors, the loader's batches): every pair, with no allocation on the
  // load path.
  constexpr std::size_t pairwise_up_to = 8;
  if (regions.size() <= pairwise_up_to) {
    for (std::size_t i = 0; i < regions.size(); ++i) {
      if (regions[i].bytes == 0) continue;
      const auto wi = span_of(regions[i].dst, regions[i].bytes);
      const auto ri = span_of(regions[i].src, regions[i].bytes);
      for (std::size_t j = i + 1; j < regions.size(); ++j) {
        if (regions[j].bytes == 0) continue;
        const auto wj = span_of(regions[j].dst, regions[j].bytes);
        const auto rj = span_of(regions[j].src, regions[j].bytes);
        if (overlap(wi, wj)) throw clash(i, wi.first, wi.second, j, "writes", wj.first, wj.second);
        if (overlap(wi, rj)) throw clash(i, wi.first, wi.second, j, "reads", rj.first, rj.second);
        if (overlap(wj, ri)) throw clash(j, wj.first, wj.second, i, "reads", ri.first, ri.second);
      }
    }
    return;
  }
  // More: the destinations sorted must be disjoint; then each source is checked against the
  // destination that starts last before its end (O(r log r)).
  struct range {
    std::uintptr_t begin, end;
    std::size_t region;
  };
  std::vector<range> writes;
  writes.reserve(regions.size());
  for (std::size_t i = 0; i < regions.size(); ++i) {
    if (regions[i].bytes == 0) continue;
    const auto [b, e] = span_of(regions[i].dst, regions[i].bytes);
    writes.push_back({b, e, i});
  }
  std::ranges::sort(writes, {}, &range::begin);
  for (std::size_t k = 1; k < writes.size(); ++k) {
    const range& w = writes[k - 1];
    if (writes[k].begin < w.end) {
      throw clash(w.region, w.begin, w.end, writes[k].region, "writes", writes[k].begin, writes[k].end);
    }
  }
  for (std::size_t i = 0; i < regions.size(); ++i) {
    if (regions[i].bytes == 0) continue;
    const auto [b, e] = span_of(regions[i].src, regions[i].bytes);
    // The last destination starting before e; disjoint and sorted, only it can reach past b.
    auto it = std::ranges::lower_bound(writes, e, {}, &range::begin);
    if (it == writes.begin()) continue;
    --it;
    if (it->end > b && it->region != i) throw clash(it->region, it->begin, it->end, i, "reads", b, e);
  }
}

copy_completion host_copy_engine::submit(std::span<const copy_region> regions, bool helped) {
  // Everything that may throw happens before the job is shared with the workers.
  auto job = std::make_shared<detail::copy_job>();
  std::size_t count = 0;
  std::size_t total = 0;
  for (const copy_region& r : regions) {
    count += (r.bytes + chunk_bytes_ - 1) / chunk_bytes_;
    total += r.bytes;
  }
  job->streaming = total >= streaming_threshold_;
  job->chunks.reserve(count);
  for (const copy_region& r : regions) {
    auto* dst = static_cast<std::byte*>(r.dst);
    const auto* src = static_cast<const std::byte*>(r.src);
    for (std::size_t offset = 0; offset < r.bytes; offset += chunk_bytes_) {
      job->chunks.push_back({dst + offset, src + offset, std::min(chunk_bytes_, r.bytes - offset)});
    }
  }
  // Relaxed: the job reaches the workers through mutex_, which orders this store.
  job->remaining.store(count, std::memory_order_relaxed);
  {
    const std::lock_guard lock(mutex_);
    if (count > 0) queue_.push_back(job);  // strong guarantee: nothing queued if this throws
    ++stats_.submissions;
  }
  // A caller that helps takes a chunk itself at once: the workers are woken for the others
  // only (a one-chunk copy it waits for wakes none).
  const std::size_t for_workers = helped && count > 0 ? count - 1 : count;
  if (for_workers == 1) {
    work_cv_.notify_one();
  } else if (for_workers > 1) {
    work_cv_.notify_all();
  }
  return copy_completion(std::move(job));
}

copy_completion host_copy_engine::copy_async(void* dst, const void* src, std::size_t bytes) {
  const copy_region region{dst, src, bytes};
  return copy_async(std::span(&region, 1));
}

copy_completion host_copy_engine::copy_async(std::span<const copy_region> regions) {
  check_copy_regions(regions, "host_copy_engine");
  return submit(regions, /*helped=*/false);
}

void host_copy_engine::copy(void* dst, const void* src, std::size_t bytes) {
  const copy_region region{dst, src, bytes};
  copy(std::span(&region, 1));
}

void host_copy_engine::copy(std::span<const copy_region> regions) {
  check_copy_regions(regions, "host_copy_engine");
  submit_and_help(regions);
}

void host_copy_engine::submit_and_help(std::span<const copy_region> regions) {
  const copy_completion done = submit(regions, /*helped=*/true);
  help(*done.job_);
  done.synchronize();
}

void host_copy_engine::copy(void* dst, const void* src, std::size_t bytes, host_stream& stream) {
  const copy_region region{dst, src, bytes};
  copy(std::span(&region, 1), stream);
}

void host_copy_engine::copy(std::span<const copy_region> regions, host_stream& stream) {
  check_copy_regions(regions, "host_copy_engine");
  // Counts the stream task from now until its closure is destroyed, whether
  // the stream ran it or skipped it after an error; the destructor waits for 0.
  // The notify happens under the lock: once it is released the engine may be gone.
  struct stream_task_guard {
    host_copy_engine* engine;
    explicit stream_task_guard(host_copy_engine* e) : engine(e) {
      const std::lock_guard lock(engine->mutex_);
      ++engine->stream_tasks_;
    }
    stream_task_guard(const stream_task_guard&) = delete;
    stream_task_guard& operator=(const stream_task_guard&) = delete;
    ~stream_task_guard() {
      const std::lock_guard lock(engine->mutex_);
      if (--engine->stream_tasks_ == 0) engine->streams_cv_.notify_all();
    }
  };
  std::vector<copy_region> owned(regions.begin(), regions.end());
  auto guard = std::make_shared<stream_task_guard>(this);
  // The stream's thread submits the copy only when it reaches this task (after
  // the earlier work), copies chunks of it beside the workers, and returns once
  // every chunk is done (before the later work); a chunk's error becomes the
  // stream's sticky error.
  stream.enqueue([this, guard = std::move(guard), owned = std::move(owned)] { submit_and_help(owned); });
  const std::lock_guard lock(mutex_);
  ++stats_.stream_copies;  // once enqueued: a copy enqueue() refused (a bad_alloc) is not one
}

void host_copy_engine::run_worker() {
  std::unique_lock lock(mutex_);
  for (;;) {
    work_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, and every queued chunk has been taken
    std::shared_ptr<detail::copy_job> job = queue_.front();
    const detail::copy_job::chunk c = job->chunks[job->next++];
    if (job->next == job->chunks.size()) queue_.pop_front();
    run_chunk(lock, *job, c, false);
  }
}

// The waiting thread takes the chunks of its own submission that no worker has
// taken yet, wherever the submission stands in the queue: a job is queued
// exactly while it has chunks left to take (submit() and run_worker() keep that).
void host_copy_engine::help(detail::copy_job& job) {
  std::unique_lock lock(mutex_);
  while (job.next < job.chunks.size()) {
    const detail::copy_job::chunk c = job.chunks[job.next++];
    if (job.next == job.chunks.size()) {
      queue_.erase(std::find_if(queue_.begin(), queue_.end(), [&](const auto& q) { return q.get() == &job; }));
    }
    run_chunk(lock, job, c, true);
  }
}

void host_copy_engine::run_chunk(std::unique_lock<std::mutex>& lock, detail::copy_job& job,
                                 const detail::copy_job::chunk& c, bool helping) {
  lock.unlock();
  bool copied = false;
  bool failed = false;
  if (!job.failed.load(std::memory_order_relaxed)) {  // relaxed: see copy_job::failed
    try {
      if (copier_) {
        copier_(c.dst, c.src, c.bytes);
      } else if (job.streaming) {
        streaming_copy(c.dst, c.src, c.bytes);
      } else {
        std::memcpy(c.dst, c.src, c.bytes);
      }
      copied = true;
    } catch (...) {
      failed = true;
      const std::lock_guard error_lock(job.error_mutex);
      if (!job.error) job.error = std::current_exception();
      job.failed.store(true, std::memory_order_relaxed);
    }
  }

  lock.lock();
  if (copied) {
    ++stats_.chunks;
    stats_.bytes += c.bytes;
    if (helping) ++stats_.helped_chunks;
  } else if (failed) {
    ++stats_.failed_chunks;
  } else {
    ++stats_.skipped_chunks;
  }
  // Acq_rel: releases this chunk's bytes (and the counters above) to the
  // waiter's acquire load; see copy_job::remaining. The caller still holds
  // the job, so the atomic outlives the notify.
  if (job.remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) job.remaining.notify_all();
}

host_copy_engine_statistics host_copy_engine::statistics() const {
  const std::lock_guard lock(mutex_);
  return stats_;
}

}  // namespace expage

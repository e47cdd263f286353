#include "expage/cuda/copy_engine.hpp"

#include "expage/core/error.hpp"
#include "expage/cuda/pinned_host_memory.hpp"
#include "expage/cuda/runtime.hpp"
#include "expage/stream/host_copy_engine.hpp"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

namespace expage::cuda {

namespace {

constexpr std::size_t max_streams = 32;
constexpr std::size_t max_slots = 256;
constexpr std::size_t min_chunk_bytes = std::size_t{64} << 10;
constexpr std::size_t max_chunk_bytes = std::size_t{256} << 20;
constexpr std::size_t max_staging_threads = 64;

// True when @p p is host memory the runtime has not pinned or registered: the
// DMA engine cannot read it, so it must go through the ring.
bool is_pageable(const void* p) {
  cudaPointerAttributes attributes{};
  EXPAGE_CUDA_CHECK(cudaPointerGetAttributes(&attributes, p));
  return attributes.type == cudaMemoryTypeUnregistered;
}

}  // namespace

copy_engine_options copy_engine::validated(copy_engine_options opts) {
  if (opts.device < 0) {
    throw invalid_argument(fmt::format("cuda::copy_engine: device {} out of range [0, device count)", opts.device));
  }
  if (opts.streams < 1 || opts.streams > max_streams) {
    throw invalid_argument(
        fmt::format("cuda::copy_engine: streams {} out of range [1, {}]", opts.streams, max_streams));
  }
  if (opts.staging_slots < 2 || opts.staging_slots > max_slots) {
    throw invalid_argument(
        fmt::format("cuda::copy_engine: staging_slots {} out of range [2, {}]", opts.staging_slots, max_slots));
  }
  if (opts.chunk_bytes < min_chunk_bytes || opts.chunk_bytes > max_chunk_bytes || opts.chunk_bytes % 4096 != 0) {
    throw invalid_argument(fmt::format("cuda::copy_engine: chunk_bytes {} must be a multiple of 4096 in [{}, {}]",
                                       opts.chunk_bytes, min_chunk_bytes, max_chunk_bytes));
  }
  if (opts.staging_threads < 1 || opts.staging_threads > max_staging_threads) {
    throw invalid_argument(fmt::format("cuda::copy_engine: staging_threads {} out of range [1, {}]",
                                       opts.staging_threads, max_staging_threads));
  }
  return opts;
}

copy_engine::copy_engine(copy_engine_options opts) : options_(validated(opts)) {
  const int devices = device_count();
  if (options_.device >= devices) {
    throw cuda_error(devices == 0 ? static_cast<int>(cudaErrorNoDevice) : static_cast<int>(cudaErrorInvalidDevice),
                     fmt::format("cuda::copy_engine: device {} out of range [0, {}): {}", options_.device, devices,
                                 device_status()));
  }
  const scoped_device on(options_.device);
  // Pinned once, for the engine's life: the ring is the only pinned memory a
  // pageable source needs, however large the expert pool.
  pinned_host_memory pinned({.block_size = options_.chunk_bytes, .portable = true, .write_combined = false});
  std::byte* ring = pinned.allocate(options_.staging_slots);
  ring_ = std::unique_ptr<std::byte, std::function<void(std::byte*)>>(
      ring, [pinned, slots = options_.staging_slots](std::byte* p) mutable { pinned.deallocate(p, slots); });
  streams_.reserve(options_.streams);
  final_events_.reserve(options_.streams);
  // The events are created now, on the engine's device: they are recorded through native().
  for (std::size_t m = 0; m < options_.streams; ++m) {
    streams_.emplace_back();
    final_events_.emplace_back(options_.device);
  }
  slot_events_.reserve(options_.staging_slots);
  for (std::size_t k = 0; k < options_.staging_slots; ++k) slot_events_.emplace_back(options_.device);
  start_.emplace(options_.device);
  slot_used_.assign(options_.staging_slots, false);
  stream_used_.assign(options_.streams, false);
  if (options_.staging_threads > 1) {
    const std::size_t part = (options_.chunk_bytes + options_.staging_threads - 1) / options_.staging_threads;
    // The thread that calls copy() fills parts too (host_copy_engine::copy helps), so
    // staging_threads - 1 workers make staging_threads threads per slot.
    stager_ = std::make_unique<host_copy_engine>(
        host_copy_engine_options{.threads = options_.staging_threads - 1, .chunk_bytes = part, .copier = {}});
  }
}

copy_engine::~copy_engine() {
  // The ring may still be read by copies in flight: wait for each slot's last
  // one (per-slot fences; errors cannot be reported from here).
  for (const cuda_event& e : slot_events_) (void)cudaEventSynchronize(e.native());
}

cudaStream_t copy_engine::next_stream() noexcept {
  const std::size_t m = next_stream_;
  next_stream_ = (next_stream_ + 1) % streams_.size();
  stream_used_[m] = true;
  return streams_[m].native();
}

void copy_engine::enqueue_staged(std::byte* dst, const std::byte* src, std::size_t bytes) {
  const std::size_t chunk = options_.chunk_bytes;
  for (std::size_t offset = 0; offset < bytes; offset += chunk) {
    const std::size_t n = std::min(chunk, bytes - offset);
    const std::size_t k = next_slot_;
    next_slot_ = (next_slot_ + 1) % options_.staging_slots;
    std::byte* slot = ring_.get() + k * chunk;
    if (slot_used_[k]) {
      // The per-slot fence: only this slot's previous copy must have left it.
      EXPAGE_CUDA_CHECK(cudaEventSynchronize(slot_events_[k].native()));
      ++stats_.slot_fences;
    }
    if (stager_) {
      stager_->copy(slot, src + offset, n);
    } else {
      std::memcpy(slot, src + offset, n);
    }
    const cudaStream_t s = next_stream();
    EXPAGE_CUDA_CHECK(cudaMemcpyAsync(dst + offset, slot, n, cudaMemcpyDefault, s));
    if (const cudaError_t rc = cudaEventRecord(slot_events_[k].native(), s); rc != cudaSuccess) {
      // The copy reading the slot is queued but cannot be fenced: wait for it
      // here, or the next use of the slot would overwrite it mid-DMA.
      (void)cudaStreamSynchronize(s);
      slot_used_[k] = false;
      check(rc, "cudaEventRecord (copy_engine staging slot)");
    }
    slot_used_[k] = true;
    ++stats_.staged_chunks;
    stats_.bytes += n;
  }
}

void copy_engine::enqueue_direct(std::byte* dst, const std::byte* src, std::size_t bytes) {
  const std::size_t chunk = options_.chunk_bytes;
  for (std::size_t offset = 0; offset < bytes; offset += chunk) {
    const std::size_t n = std::min(chunk, bytes - offset);
    EXPAGE_CUDA_CHECK(cudaMemcpyAsync(dst + offset, src + offset, n, cudaMemcpyDefault, next_stream()));
    ++stats_.direct_chunks;
    stats_.bytes += n;
  }
}

void copy_engine::run(std::span<const region_route> regions, cuda_stream& stream) {
  // The checks host_copy_engine makes (one owner): the regions' chunks run on parallel streams.
  if (regions.size() == 1) {
    check_copy_regions(std::span(&regions.front().region, 1), "cuda::copy_engine");
  } else {
    std::vector<copy_region> plain;
    plain.reserve(regions.size());
    for (const region_route& r : regions) plain.push_back(r.region);
    check_copy_regions(plain, "cuda::copy_engine");
  }
  // A capture would record the staging copies as graph nodes that replay
  // whatever a reused slot holds then, and the slot fences cannot be captured.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  EXPAGE_CUDA_CHECK(cudaStreamIsCapturing(stream.native(), &capture));
  if (capture != cudaStreamCaptureStatusNone) {
    throw invalid_argument(
        "cuda::copy_engine: the stream is being captured into a CUDA graph; copy before or after the capture");
  }
  const std::lock_guard lock(mutex_);
  const scoped_device on(options_.device);
  ++stats_.submissions;
  // The start fence: every internal stream's chunks follow the caller's earlier work.
  EXPAGE_CUDA_CHECK(cudaEventRecord(start_->native(), stream.native()));
  for (const cuda_stream& s : streams_) EXPAGE_CUDA_CHECK(cudaStreamWaitEvent(s.native(), start_->native(), 0));
  std::fill(stream_used_.begin(), stream_used_.end(), false);
  // The end fence: the caller's later work follows every chunk, also when a
  // call fails halfway (the chunks already enqueued still write the destination).
  // Every used stream is joined even after one fails (the first error is thrown after the loop);
  // a stream whose fence cannot be set is waited for by the host instead. Before, the first
  // failure left the streams after it unjoined, their chunks still writing the destination.
  const auto join = [&] {
    cudaError_t first = cudaSuccess;
    const char* failed = nullptr;
    for (std::size_t m = 0; m < streams_.size(); ++m) {
      if (!stream_used_[m]) continue;
      const char* what = "cudaEventRecord(final_events_[m], streams_[m])";
      cudaError_t e = cudaEventRecord(final_events_[m].native(), streams_[m].native());
      if (e == cudaSuccess) {
        what = "cudaStreamWaitEvent(stream, final_events_[m])";
        e = cudaStreamWaitEvent(stream.native(), final_events_[m].native(), 0);
      }
      if (e == cudaSuccess) continue;
      (void)cudaStreamSynchronize(streams_[m].native());  // the host fence instead
      if (first == cudaSuccess) {
        first = e;
        failed = what;
      }
    }
    if (first != cudaSuccess) check(first, failed);
  };
  try {
    for (const region_route& rr : regions) {
      const copy_region& r = rr.region;
      if (r.bytes == 0) continue;
      auto* dst = static_cast<std::byte*>(r.dst);
      const auto* src = static_cast<const std::byte*>(r.src);
      const bool staged = rr.how == route::staged || (rr.how == route::automatic && is_pageable(src));
      if (staged) {
        enqueue_staged(dst, src, r.bytes);
      } else {
        enqueue_direct(dst, src, r.bytes);
      }
    }
  } catch (...) {
    try {
      join();
    } catch (...) {  // NOLINT(bugprone-empty-catch): the first error is the one to report
    }
    throw;
  }
  join();
}

void copy_engine::copy(void* dst, const void* src, std::size_t bytes, cuda_stream& stream) {
  const region_route r{{dst, src, bytes}, route::automatic};
  run(std::span(&r, 1), stream);
}

void copy_engine::copy(std::span<const copy_region> regions, cuda_stream& stream) {
  std::vector<region_route> routed;
  routed.reserve(regions.size());
  for (const copy_region& r : regions) routed.push_back({r, route::automatic});
  run(routed, stream);
}

void copy_engine::copy_staged(void* dst, const void* src, std::size_t bytes, cuda_stream& stream) {
  const region_route r{{dst, src, bytes}, route::staged};
  run(std::span(&r, 1), stream);
}

void copy_engine::copy_direct(void* dst, const void* src, std::size_t bytes, cuda_stream& stream) {
  const region_route r{{dst, src, bytes}, route::direct};
  run(std::span(&r, 1), stream);
}

copy_engine_statistics copy_engine::statistics() const {
  const std::lock_guard lock(mutex_);
  return stats_;
}

}  // namespace expage::cuda

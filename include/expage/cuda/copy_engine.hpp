/// @file
/// @brief cuda::copy_engine: chunked multi-stream host-to-device copies, from pageable memory through a
/// bounded pinned staging ring, or from pinned memory directly.
#pragma once

#include "expage/cuda/cuda_stream.hpp"
#include "expage/stream/host_copy_engine.hpp"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <vector>

namespace expage::cuda {

/// @brief Construction parameters of a copy_engine.
struct copy_engine_options {
  int device = 0;                 ///< CUDA device ordinal, in [0, device_count()).
  std::size_t streams = 2;        ///< M: internal CUDA streams, in [1, 32].
  std::size_t staging_slots = 4;  ///< K: pinned staging buffers of chunk_bytes, in [2, 256].
  std::size_t chunk_bytes = std::size_t{4}
                            << 20;  ///< Bytes per chunk and per slot: a multiple of 4096 in [64 KiB, 256 MiB].
  /// Host threads filling one slot, in [1, 64]: the calling thread and, above 1, the
  /// staging_threads - 1 workers of an internal host_copy_engine that splits the slot with it.
  std::size_t staging_threads = 1;
};

/// @brief Counters of a copy_engine.
struct copy_engine_statistics {
  std::uint64_t submissions = 0;    ///< copy() calls (a batch counts once).
  std::uint64_t staged_chunks = 0;  ///< Chunks copied from pageable memory through a staging slot.
  std::uint64_t direct_chunks = 0;  ///< Chunks copied straight from pinned (or device) memory.
  std::uint64_t bytes = 0;          ///< Bytes those chunks moved.
  std::uint64_t slot_fences = 0;    ///< Per-slot fences: host waits on a slot's previous copy before reusing it.
};

/// @brief Host-to-device copies split into chunks spread over M CUDA streams;
/// pageable sources go through a ring of K pinned staging slots, so a large
/// host-resident expert pool needs no pinning (PreScope §4.4: chunked
/// multi-stream transfers through pre-registered buffers).
///
/// The ring (K × chunk_bytes of pinned memory) is allocated once at construction. Chunks take the
/// streams in turn, and pageable ones the slots in turn, the turns carried over from one copy to
/// the next (so a copy's first chunk goes where the last one's left off, not to slot 0 and stream
/// 0): the host waits on that slot's event (its previous copy has left the slot: a per-slot fence,
/// never a stream or device synchronization), copies the chunk into the slot, enqueues
/// cudaMemcpyAsync from the slot and records the slot's event. So up to K chunks are in flight
/// while the host fills the next slot. Pinned (and device) sources skip the ring: each chunk is one
/// cudaMemcpyAsync on its stream.
///
/// Stream order with the caller's @p stream: the caller stream records an
/// event that every internal stream waits on before the first chunk (the copy
/// starts after the caller's earlier work), and after the last chunk the
/// caller stream waits on each internal stream's final event (the caller's
/// later work, a kernel or an event record, starts after the last byte
/// landed). The host side is not asynchronous for pageable sources: copy()
/// returns once every chunk has been staged (the last K may still be in
/// flight), as cudaMemcpyAsync from pageable memory does; the source may then
/// be reused. From pinned memory copy() returns at once and the source must
/// stay unchanged until the caller stream has passed the copy.
///
/// On a CUDA error copy() throws; the caller stream still waits on the chunks
/// already enqueued, and the destination's content is unspecified.
///
/// @code
/// expage::cuda::copy_engine engine({.streams = 2, .staging_slots = 4, .chunk_bytes = 4_MiB});
/// expage::cuda::cuda_stream load;
/// engine.copy(device_page, pageable_expert, bytes, load);   // through the ring
/// engine.copy(device_page2, pinned_expert, bytes, load);    // direct, chunked
/// expage::cuda::cuda_event loaded;
/// load.record(loaded);                                      // after every chunk of both
/// // As a tensor_storage<cuda_stream> loader:
/// //   [&](auto stored, auto page, expage::cuda::cuda_stream& s) { engine.copy(page.data(), stored.data(),
/// stored.size(), s); }
/// @endcode
/// @threadsafety thread-safe: calls are serialized on an internal mutex (the ring is shared).
class copy_engine {
 public:
  /// Validates @p opts (default: device 0, 2 streams, 4 slots of 4 MiB), then creates the streams and events and pins
  /// the staging ring on the device.
  /// @throws expage::invalid_argument for an option out of range.
  /// @throws expage::cuda_error without a device (or for a bad ordinal) and for any failing CUDA call.
  /// @throws expage::out_of_memory when the ring cannot be pinned (nothing is kept).
  explicit copy_engine(copy_engine_options opts = {});
  copy_engine(const copy_engine&) = delete;
  copy_engine& operator=(const copy_engine&) = delete;
  /// Waits (per slot event) until no copy reads the ring, then frees it and the streams.
  ~copy_engine();

  /// Copies @p bytes from @p src to @p dst in stream order on @p stream: through the ring when
  /// @p src is pageable, directly when it is pinned or device memory (cudaPointerGetAttributes).
  /// @pre @p stream belongs to device(); @p dst is device memory (or pinned host memory) of bytes bytes.
  /// @throws expage::invalid_argument for a null pointer with bytes > 0, or when @p stream is
  ///         being captured into a CUDA graph (a replay would copy whatever a reused staging
  ///         slot holds then); nothing is enqueued.
  /// @throws expage::cuda_error for a failing CUDA call.
  void copy(void* dst, const void* src, std::size_t bytes, cuda_stream& stream);
  /// Copies every region of @p regions, each as copy() would, under one pair of fences on @p stream.
  /// @throws expage::invalid_argument naming the region (check_copy_regions(): a region overlapping
  ///         itself or another's destination included; nothing is enqueued), or expage::cuda_error.
  void copy(std::span<const copy_region> regions, cuda_stream& stream);
  /// Copies through the staging ring whatever @p src is (e.g. memory the runtime cannot classify).
  /// @throws as copy().
  void copy_staged(void* dst, const void* src, std::size_t bytes, cuda_stream& stream);
  /// Copies directly, chunked over the streams; @p src must be pinned host or device memory.
  /// @throws as copy().
  void copy_direct(void* dst, const void* src, std::size_t bytes, cuda_stream& stream);

  [[nodiscard]] int device() const noexcept { return options_.device; }                        ///< The device ordinal.
  [[nodiscard]] std::size_t streams() const noexcept { return streams_.size(); }               ///< M.
  [[nodiscard]] std::size_t staging_slots() const noexcept { return options_.staging_slots; }  ///< K.
  [[nodiscard]] std::size_t chunk_bytes() const noexcept { return options_.chunk_bytes; }      ///< Bytes per chunk.
  [[nodiscard]] copy_engine_statistics statistics() const;  ///< A snapshot of the counters.

 private:
  enum class route { automatic, staged, direct };
  struct region_route {
    copy_region region;
    route how;
  };
  static copy_engine_options validated(copy_engine_options opts);
  void run(std::span<const region_route> regions, cuda_stream& stream);
  void enqueue_staged(std::byte* dst, const std::byte* src, std::size_t bytes);
  void enqueue_direct(std::byte* dst, const std::byte* src, std::size_t bytes);
  [[nodiscard]] cudaStream_t next_stream() noexcept;

  copy_engine_options options_;
  std::unique_ptr<std::byte, std::function<void(std::byte*)>> ring_;  // K × chunk_bytes, pinned
  std::vector<cuda_stream> streams_;
  std::vector<cuda_event> slot_events_;       // slot k's latest copy out of the ring
  std::vector<cuda_event> final_events_;      // stream m's last chunk of a call
  std::optional<cuda_event> start_;           // the caller stream's point the chunks start after
  std::unique_ptr<host_copy_engine> stager_;  // staging_threads > 1
  mutable std::mutex mutex_;                  // serializes calls; guards everything below
  std::vector<bool> slot_used_;               // slot k holds a copy whose event has been recorded
  std::vector<bool> stream_used_;             // stream m got a chunk in the current call
  std::size_t next_slot_ = 0;
  std::size_t next_stream_ = 0;
  copy_engine_statistics stats_;
};

}  // namespace expage::cuda

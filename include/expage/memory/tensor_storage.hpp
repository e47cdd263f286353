/// @file
/// @brief tensor_storage: the backing store pages are filled from (host memory, plain or pinned, with a decoder hook).
#pragma once

#include "expage/core/error.hpp"
#include "expage/core/moe_geometry.hpp"
#include "expage/formatters.hpp"
#include "expage/memory/physical_memory.hpp"
#include "expage/stream/async_stream.hpp"

#include <fmt/format.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

namespace expage {

/// @brief The persistent copy of every expert tensor, from which a layer
/// pipeline fills the pages it maps (FluxMoE §3.2 "tensor storage").
///
/// One allocation from a physical_memory backend holds a slot per (expert,
/// tensor type): plain host memory (host_memory), or pinned memory
/// (cuda::pinned_host_memory) so a GPU copies it by DMA. By default a load is
/// one stream copy of the stored bytes into the page. A *loader* replaces
/// that: it receives the stored bytes, the page and the loading stream and
/// enqueues whatever fills the page: a decompression kernel for the
/// compressed GPU backend (FluxMoE §4.2), a dequantization, a chunked copy.
/// Slots may then be larger or smaller than the tensor (`slot_bytes`) and each
/// records how many bytes it actually stores.
///
/// @code
/// expage::host_memory host({.block_size = 2_MiB});
/// expage::tensor_storage<expage::host_stream> storage(geometry, expage::precision::bf16, host);
/// std::ranges::copy(weights_of(id), storage.slot(id, expage::expert_tensor::gate_up).begin());
/// storage.load(id, expage::expert_tensor::gate_up, page, load_stream);   // page ← stored bytes
/// @endcode
/// @threadsafety thread-compatible: fill the slots first; load() may then be
/// called from any thread (it only reads).
template <async_stream Stream>
class tensor_storage {
 public:
  /// Fills @p page (the tensor's tensor_bytes() at the start of its mapped page) from @p stored,
  /// asynchronously on @p stream.
  using loader_type = std::function<void(std::span<const std::byte> stored, std::span<std::byte> page, Stream& stream)>;

  /// Construction parameters.
  struct options {
    /// Bytes of each slot, per tensor type (gate_up, down); 0: the tensor's bytes in the format.
    std::array<std::size_t, expert_tensor_count> slot_bytes{0, 0};
    /// Replaces the default copy (empty: stream.copy of the stored bytes).
    loader_type loader;
  };

  /// Allocates the slots of every expert of @p geometry, tensors in @p format, from @p memory.
  /// The storage gives its blocks back to @p memory when destroyed, so @p memory must outlive it
  /// (moved storage included: a factory that returns one must not allocate from a local backend).
  /// @throws expage::invalid_argument when the store's size overflows.
  /// @throws whatever @p memory's allocate() throws (nothing is kept).
  template <physical_memory Memory>
  tensor_storage(const moe_geometry& geometry, precision format, Memory& memory, options opts = {})
      : geometry_(geometry), format_(format), location_(memory.location()), loader_(std::move(opts.loader)) {
    constexpr std::uint64_t limit = std::uint64_t{1} << 50;  // bytes of the whole store
    for (std::size_t t = 0; t < expert_tensor_count; ++t) {
      const std::uint64_t tensor = geometry.tensor_bytes(static_cast<expert_tensor>(t), format);
      tensor_bytes_[t] = static_cast<std::size_t>(tensor);
      const std::size_t asked = opts.slot_bytes[t] == 0 ? tensor_bytes_[t] : opts.slot_bytes[t];
      if (asked > limit) {
        throw invalid_argument(fmt::format("tensor_storage: slot_bytes[{}] = {} out of range [0, 2^50]", t, asked));
      }
      slot_bytes_[t] = align_up(asked);
    }
    const std::uint64_t per_expert = std::uint64_t{slot_bytes_[0]} + slot_bytes_[1];  // ≤ 2^51: no overflow
    const std::uint64_t experts = geometry.expert_count();
    if (per_expert != 0 && experts > limit / per_expert) {
      throw invalid_argument(
          fmt::format("tensor_storage: {} experts × {} bytes overflows the 2^50-byte limit", experts, per_expert));
    }
    const std::uint64_t total = experts * per_expert;
    const std::size_t blocks = static_cast<std::size_t>((total + memory.block_size() - 1) / memory.block_size());
    std::byte* base = memory.allocate(blocks);
    memory_ = std::unique_ptr<std::byte, std::function<void(std::byte*)>>(
        base, [&memory, blocks](std::byte* p) { memory.deallocate(p, blocks); });
    stored_.assign(static_cast<std::size_t>(experts) * expert_tensor_count, 0);
    // Until set_stored_bytes(): the decoded size, or the whole slot when the slot is smaller
    // (compressed slots): never past the slot.
    for (std::size_t i = 0; i < stored_.size(); ++i) {
      const std::size_t t = i % expert_tensor_count;
      stored_[i] = std::min(tensor_bytes_[t], slot_bytes_[t]);
    }
    capacity_ = static_cast<std::size_t>(total);
  }

  /// The decoded size of tensor @p t: what a page receives.
  /// @throws expage::invalid_argument for a value of @p t that is neither tensor.
  [[nodiscard]] std::size_t tensor_bytes(expert_tensor t) const {
    return tensor_bytes_[checked_tensor_index(t, "tensor_storage")];
  }
  /// Bytes of each slot of tensor @p t.
  /// @throws expage::invalid_argument for a value of @p t that is neither tensor.
  [[nodiscard]] std::size_t slot_bytes(expert_tensor t) const {
    return slot_bytes_[checked_tensor_index(t, "tensor_storage")];
  }
  /// Bytes allocated for the whole store.
  [[nodiscard]] std::size_t bytes() const noexcept { return capacity_; }
  /// Whether a loader decodes the stored form into the page (options::loader); else it is copied.
  [[nodiscard]] bool decodes() const noexcept { return static_cast<bool>(loader_); }
  /// Where the stored bytes live.
  [[nodiscard]] memory_location location() const noexcept { return location_; }
  /// The tensors' precision.
  [[nodiscard]] precision format() const noexcept { return format_; }
  /// The geometry whose experts it stores.
  [[nodiscard]] const moe_geometry& geometry() const noexcept { return geometry_; }
  /// Throws unless it stores every expert of @p geometry with tensors in @p format: the same
  /// precision, layers × experts and decoded tensor bytes (what a page of @p geometry receives).
  /// The one check of a storage against its user's geometry (layer_pipeline, transition_manager).
  /// @throws expage::invalid_argument naming @p who, what differs and both values.
  void check_holds(const moe_geometry& geometry, precision format, std::string_view who) const {
    if (format_ != format) {
      throw invalid_argument(
          fmt::format("{}: the storage holds {} tensors, expected {}", who, to_string(format_), to_string(format)));
    }
    if (geometry_.layers() != geometry.layers() || geometry_.experts_per_layer() != geometry.experts_per_layer()) {
      throw invalid_argument(
          fmt::format("{}: the storage holds {} layers × {} experts ('{}'), the geometry '{}' has {} × {}", who,
                      geometry_.layers(), geometry_.experts_per_layer(), geometry_.name(), geometry.name(),
                      geometry.layers(), geometry.experts_per_layer()));
    }
    for (std::size_t t = 0; t < expert_tensor_count; ++t) {
      const auto tensor = static_cast<expert_tensor>(t);
      if (const std::uint64_t want = geometry.tensor_bytes(tensor, format); tensor_bytes_[t] != want) {
        throw invalid_argument(fmt::format(
            "{}: the storage's {} tensors have {} bytes, the geometry '{}''s {} tensors in {} have {}", who,
            to_string(tensor), tensor_bytes_[t], geometry.name(), to_string(tensor), to_string(format), want));
      }
    }
  }

  /// The whole slot of tensor @p t of expert @p id, to write the stored form into.
  /// @throws expage::invalid_argument for an id outside the geometry (or a @p t that is neither tensor, here and
  /// below).
  [[nodiscard]] std::span<std::byte> slot(expert_id id, expert_tensor t) {
    return {memory_.get() + offset(id, t), slot_bytes(t)};
  }
  /// The stored bytes of tensor @p t of expert @p id (the first stored_bytes of its slot).
  /// @throws expage::invalid_argument for an id outside the geometry.
  [[nodiscard]] std::span<const std::byte> stored(expert_id id, expert_tensor t) const {
    return {memory_.get() + offset(id, t), stored_[index(id, t)]};
  }
  /// Records that the slot of (@p id, @p t) holds @p bytes (for stored forms of their own size, e.g. compressed).
  /// Without a loader the stored bytes are copied into the page as they are, so they may not
  /// exceed tensor_bytes(@p t), what a page holds (a slot rounded up to 256 bytes is larger).
  /// @throws expage::invalid_argument for a bad id or @p bytes above the slot size (above
  /// tensor_bytes(@p t) too without a loader).
  void set_stored_bytes(expert_id id, expert_tensor t, std::size_t bytes) {
    const std::size_t most = loader_ ? slot_bytes(t) : std::min(slot_bytes(t), tensor_bytes(t));
    if (bytes > most) {
      throw invalid_argument(fmt::format(
          "tensor_storage::set_stored_bytes({}, {}): {} bytes out of range [0, {}]{}", id, to_string(t), bytes, most,
          loader_ ? "" : " (copied into the page as they are: a loader decodes larger forms)"));
    }
    stored_[index(id, t)] = bytes;
  }

  /// Enqueues on @p stream what fills @p page with tensor @p t of expert @p id: the loader's work
  /// on its first tensor_bytes(@p t), or a copy of the stored bytes (at most that many).
  /// @throws expage::invalid_argument for a bad id or a page shorter than tensor_bytes(@p t).
  /// @throws whatever the stream or the loader throws while enqueuing.
  void load(expert_id id, expert_tensor t, std::span<std::byte> page, Stream& stream) const {
    if (page.size() < tensor_bytes(t)) {
      throw invalid_argument(fmt::format("tensor_storage::load({}, {}): page of {} bytes, the tensor needs {}", id,
                                         to_string(t), page.size(), tensor_bytes(t)));
    }
    const std::span<const std::byte> source = stored(id, t);
    if (loader_) {
      loader_(source, page.first(tensor_bytes(t)), stream);
    } else {
      stream.copy(page.data(), source.data(), source.size());
    }
  }

 private:
  static constexpr std::size_t slot_alignment = 256;  // every slot starts on a DMA- and vector-friendly boundary
  static constexpr std::size_t align_up(std::size_t n) noexcept {
    return (n + slot_alignment - 1) / slot_alignment * slot_alignment;
  }
  [[nodiscard]] std::size_t index(expert_id id, expert_tensor t) const {
    return static_cast<std::size_t>(geometry_.checked_flat_index(id)) * expert_tensor_count +
           checked_tensor_index(t, "tensor_storage");
  }
  [[nodiscard]] std::size_t offset(expert_id id, expert_tensor t) const {
    const std::size_t i = index(id, t);
    return (i / expert_tensor_count) * (slot_bytes_[0] + slot_bytes_[1]) +
           (i % expert_tensor_count == 0 ? 0 : slot_bytes_[0]);
  }

  moe_geometry geometry_;
  precision format_;
  memory_location location_;
  loader_type loader_;
  std::array<std::size_t, expert_tensor_count> tensor_bytes_{};
  std::array<std::size_t, expert_tensor_count> slot_bytes_{};
  std::size_t capacity_ = 0;
  std::vector<std::size_t> stored_;  // stored bytes per (expert, tensor)
  std::unique_ptr<std::byte, std::function<void(std::byte*)>> memory_;
};

}  // namespace expage

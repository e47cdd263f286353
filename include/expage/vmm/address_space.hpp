/// @file
/// @brief address_space: stable virtual addresses for one expert tensor type, pages mapped on demand.
#pragma once

#include "expage/core/error.hpp"
#include "expage/core/moe_geometry.hpp"
#include "expage/detail/assert.hpp"
#include "expage/formatters.hpp"
#include "expage/vmm/virtual_memory.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace expage {

/// Where one expert tensor's page is in its life (FluxMoE §3.2).
enum class page_state : std::uint8_t {
  unmapped,  ///< No physical memory behind the address.
  loading,   ///< Blocks mapped, the copy into them in flight; not yet readable as the expert.
  resident,  ///< Blocks mapped and filled: kernels may read the expert at its address.
  evicting,  ///< Still mapped, being given up (kernels that read it must finish first).
};

/// The lowercase name of @p s.
[[nodiscard]] constexpr std::string_view to_string(page_state s) noexcept {
  switch (s) {
    case page_state::unmapped: return "unmapped";
    case page_state::loading: return "loading";
    case page_state::resident: return "resident";
    case page_state::evicting: return "evicting";
  }
  return "unknown";
}

/// @brief One reserved virtual range holding one tensor type (fused gate/up,
/// or down) of every expert at a fixed address, with the physical blocks
/// behind each expert's page mapped and unmapped on demand.
///
/// FluxMoE's PagedTensor (§3.2): the range is reserved once, sized layers ×
/// experts × σ where σ is the tensor's bytes rounded up to the backend's
/// granularity, and expert (i, j) always lives at
///
///   addr(P_ij) = v0 + (i · E + j) · σ        (Eq. 4, zero-based layer i and expert j),
///
/// so kernels (and captured CUDA graphs) can take its address once. A page
/// maps to at most one set of blocks at a time (Eq. 3) and moves through
/// unmapped → loading → resident → evicting → unmapped; other transitions are
/// rejected. The blocks belong to the caller (typically a vmm_block_pool lease
/// held while the page is mapped); the address space only maps them.
///
/// Strong guarantee: if mapping any block of a page fails, the blocks mapped so
/// far are unmapped and the page stays unmapped.
///
/// @code
/// expage::host_vmm vm({.granularity = 2_MiB});
/// expage::address_space gate_up(vm, geometry, expage::expert_tensor::gate_up, expage::precision::bf16);
/// auto blocks = pool.acquire(gate_up.blocks_per_page());
/// gate_up.begin_load(id, blocks.blocks());   // unmapped -> loading
/// copy_weights(gate_up.address(id), ...);    // the address never changes
/// gate_up.finish_load(id);                   // loading -> resident
/// @endcode
/// @threadsafety thread-compatible: one thread (the pipeline) changes pages; a
/// page's address may be read from any thread at any time.
template <virtual_memory Vmm>
class address_space {
 public:
  /// The backend's physical block handle.
  using block = typename Vmm::physical_block;

  /// Reserves the range for tensor @p tensor of every routed expert of @p geometry in precision @p format.
  /// @throws whatever the backend's reserve() throws (nothing is kept).
  address_space(Vmm& vmm, const moe_geometry& geometry, expert_tensor tensor, precision format)
      : vmm_(&vmm),
        geometry_(geometry),
        tensor_(tensor),
        granularity_(vmm.granularity()),
        page_bytes_(round_up(geometry.tensor_bytes(tensor, format), vmm.granularity())),
        blocks_per_page_(page_bytes_ / vmm.granularity()),
        pages_(geometry.expert_count()),
        state_(pages_, page_state::unmapped),
        blocks_(pages_ * blocks_per_page_) {
    base_ = vmm.reserve(pages_ * page_bytes_);
  }
  address_space(const address_space&) = delete;
  address_space& operator=(const address_space&) = delete;
  /// Unmaps every page still mapped and frees the range (the blocks stay with their owners).
  ~address_space() {
    for (std::size_t p = 0; p < pages_; ++p) {
      if (state_[p] != page_state::unmapped) vmm_->unmap(base_ + p * page_bytes_, page_bytes_);
    }
    vmm_->free(base_);
  }

  [[nodiscard]] std::size_t page_bytes() const noexcept { return page_bytes_; }  ///< σ: bytes per expert page.
  [[nodiscard]] std::size_t blocks_per_page() const noexcept { return blocks_per_page_; }  ///< σ / granularity.
  [[nodiscard]] std::byte* base() const noexcept { return base_; }                         ///< v0.
  [[nodiscard]] std::size_t bytes() const noexcept { return pages_ * page_bytes_; }        ///< The reserved bytes.
  [[nodiscard]] expert_tensor tensor() const noexcept { return tensor_; }                  ///< The tensor type held.

  /// Expert @p id's address (Eq. 4); fixed for the life of the address space.
  /// @throws expage::invalid_argument when @p id is not an expert of the geometry.
  [[nodiscard]] std::byte* address(expert_id id) const { return base_ + page_of(id) * page_bytes_; }

  /// Expert @p id's page state.
  /// @throws expage::invalid_argument when @p id is not an expert of the geometry.
  [[nodiscard]] page_state state(expert_id id) const { return state_[page_of(id)]; }

  /// The blocks behind expert @p id's page (empty when unmapped).
  /// @throws expage::invalid_argument when @p id is not an expert of the geometry.
  [[nodiscard]] std::span<const block> blocks(expert_id id) const {
    const std::size_t p = page_of(id);
    if (state_[p] == page_state::unmapped) return {};
    return std::span<const block>(blocks_).subspan(p * blocks_per_page_, blocks_per_page_);
  }

  /// unmapped → loading: maps @p blocks (blocks_per_page() created blocks) at the page, in order,
  /// and grants read-write access to the whole page in one set_access() call.
  /// @throws expage::invalid_argument for a bad id, a page not unmapped, or the wrong number of blocks.
  /// @throws whatever the backend's map() or set_access() throws; the page then stays unmapped with nothing mapped.
  void begin_load(expert_id id, std::span<const block> blocks) {
    const std::size_t p = expect(id, page_state::unmapped, "begin_load");
    if (blocks.size() != blocks_per_page_) {
      throw invalid_argument(fmt::format("address_space::begin_load of {}: {} blocks given, a {} page needs {}", id,
                                         blocks.size(), to_string(tensor_), blocks_per_page_));
    }
    std::byte* const page = base_ + p * page_bytes_;
    std::size_t mapped = 0;
    try {
      // Blocks are mapped without access and the page's contiguous run gets
      // one access grant: one cuMemSetAccess per page on CUDA, not one per
      // granule (set access is the expensive call: ~36 µs per call, kvcached).
      for (; mapped < blocks.size(); ++mapped) {
        vmm_->map(blocks[mapped], page + mapped * granularity_, access_mode::none);
      }
      vmm_->set_access(page, page_bytes_, access_mode::read_write);
    } catch (...) {
      if (mapped > 0) vmm_->unmap(page, mapped * granularity_);
      throw;
    }
    std::copy(blocks.begin(), blocks.end(), blocks_.begin() + static_cast<std::ptrdiff_t>(p * blocks_per_page_));
    state_[p] = page_state::loading;
  }

  /// loading → resident: the copy into the page completed.
  /// @throws expage::invalid_argument for a bad id or a page not loading.
  void finish_load(expert_id id) { state_[expect(id, page_state::loading, "finish_load")] = page_state::resident; }

  /// loading → unmapped: the copy failed or was cancelled; unmaps the blocks.
  /// @throws expage::invalid_argument for a bad id or a page not loading.
  void cancel_load(expert_id id) { unmap_page(expect(id, page_state::loading, "cancel_load")); }

  /// resident → evicting: the expert is being given up.
  /// @throws expage::invalid_argument for a bad id or a page not resident.
  void begin_evict(expert_id id) { state_[expect(id, page_state::resident, "begin_evict")] = page_state::evicting; }

  /// evicting → unmapped: unmaps the page; its blocks go back to `created`, content intact.
  /// @throws expage::invalid_argument for a bad id or a page not evicting.
  void finish_evict(expert_id id) { unmap_page(expect(id, page_state::evicting, "finish_evict")); }

 private:
  static std::size_t round_up(std::uint64_t bytes, std::size_t granularity) noexcept {
    return static_cast<std::size_t>((bytes + granularity - 1) / granularity * granularity);
  }
  [[nodiscard]] std::size_t page_of(expert_id id) const {
    return static_cast<std::size_t>(geometry_.checked_flat_index(id));
  }
  std::size_t expect(expert_id id, page_state wanted, std::string_view what) const {
    const std::size_t p = page_of(id);
    if (state_[p] != wanted) {
      throw invalid_argument(fmt::format("address_space::{}: page {} ({}) is {}, not {}", what, id, to_string(tensor_),
                                         to_string(state_[p]), to_string(wanted)));
    }
    return p;
  }
  void unmap_page(std::size_t p) noexcept {
    vmm_->unmap(base_ + p * page_bytes_, page_bytes_);
    state_[p] = page_state::unmapped;
  }

  Vmm* vmm_;
  moe_geometry geometry_;
  expert_tensor tensor_;
  std::size_t granularity_;
  std::size_t page_bytes_;
  std::size_t blocks_per_page_;
  std::size_t pages_;
  std::byte* base_ = nullptr;
  std::vector<page_state> state_;
  std::vector<block> blocks_;
};

}  // namespace expage

// The state table every virtual_memory backend shares (not API).
#pragma once

#include "expage/core/error.hpp"
#include "expage/detail/assert.hpp"
#include "expage/vmm/virtual_memory.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <limits>
#include <map>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace expage {

namespace detail {

// The state checks every virtual_memory backend shares: a slot table of
// physical blocks (generation, state, where mapped, a backend payload such as
// a file offset or a CUmemGenericAllocationHandle) and the reservations with
// the granules that hold a block. Not thread-safe: the backend's mutex guards it.
class vmm_table {
 public:
  static constexpr std::uint32_t no_slot = std::numeric_limits<std::uint32_t>::max();

  struct slot_record {
    std::uint64_t payload = 0;
    std::uintptr_t address = 0;  // where mapped (the first mapping still standing); 0 unless state == mapped
    std::uint32_t generation = 0;
    std::vector<std::uintptr_t> aliases;  // mappings beyond `address` (map_alias); mapped until all are gone
    block_state state = block_state::free;
  };

  struct reservation {
    std::size_t bytes = 0;
    std::uintptr_t base = 0;
    std::unordered_map<std::size_t, std::uint32_t> mapped;  // granule index -> slot
  };

  // A validated contiguous run of granules inside one reservation.
  struct run {
    std::uintptr_t base = 0;  // the reservation's base
    reservation* where = nullptr;
    std::size_t first = 0;  // granule index
    std::size_t count = 0;
  };

  vmm_table(std::string_view backend, std::size_t granularity) : backend_(backend), granularity_(granularity) {}

  [[nodiscard]] std::size_t granularity() const noexcept { return granularity_; }
  [[nodiscard]] std::size_t live_blocks() const noexcept { return live_; }
  [[nodiscard]] std::size_t slot_count() const noexcept { return slots_.size(); }
  [[nodiscard]] const std::map<std::uintptr_t, reservation>& reservations() const noexcept { return reservations_; }

  // The slot the next add() uses.
  [[nodiscard]] std::uint32_t next_slot() const noexcept {
    return free_.empty() ? static_cast<std::uint32_t>(slots_.size()) : free_.back();
  }

  // Makes next_slot() a created block. Strong guarantee (may throw bad_alloc).
  template <class Handle>
  [[nodiscard]] Handle add(std::uint64_t payload) {
    if (free_.empty()) {
      if (slots_.size() >= no_slot) {
        throw out_of_memory(fmt::format("{}: block table full ({} blocks)", backend_, slots_.size()));
      }
      free_.reserve(slots_.size() + 1);  // first, so that remove() never allocates
      slots_.emplace_back();
      free_.push_back(static_cast<std::uint32_t>(slots_.size() - 1));
    }
    const std::uint32_t slot = free_.back();
    free_.pop_back();
    slot_record& r = slots_[slot];
    r.generation = r.generation == std::numeric_limits<std::uint32_t>::max() ? 1 : r.generation + 1;
    r.state = block_state::created;
    r.payload = payload;
    r.address = 0;
    r.aliases.clear();
    ++live_;
    return Handle{slot, r.generation};
  }

  // Returns a created block's slot to the free list; its handles become stale.
  void remove(std::uint32_t slot) noexcept {
    slots_[slot].state = block_state::free;
    slots_[slot].address = 0;
    free_.push_back(slot);  // never allocates: add() keeps capacity >= slots_.size()
    --live_;
  }

  [[nodiscard]] slot_record* find(std::uint32_t slot, std::uint32_t generation) noexcept {
    if (slot >= slots_.size() || generation == 0 || slots_[slot].generation != generation ||
        slots_[slot].state == block_state::free) {
      return nullptr;
    }
    return &slots_[slot];
  }
  [[nodiscard]] const slot_record* find(std::uint32_t slot, std::uint32_t generation) const noexcept {
    return const_cast<vmm_table*>(this)->find(slot, generation);
  }
  [[nodiscard]] slot_record& at(std::uint32_t slot) noexcept { return slots_[slot]; }
  /// Records that granule @p granule of @p where no longer holds its block:
  /// the block goes back to `created` (its content intact) once no other
  /// granule maps it. @pre the granule holds a block.
  void mark_unmapped(reservation& where, std::size_t granule) noexcept {
    const auto it = where.mapped.find(granule);
    slot_record& s = slots_[it->second];
    where.mapped.erase(it);
    if (s.aliases.empty()) {
      s.state = block_state::created;
      s.address = 0;
      return;
    }
    const std::uintptr_t here = where.base + granule * granularity_;
    if (s.address == here) {  // the first mapping went first: an alias becomes the reported address
      s.address = s.aliases.back();
    } else {
      *std::find(s.aliases.begin(), s.aliases.end(), here) = s.aliases.back();
    }
    s.aliases.pop_back();
  }
  /// Records that the created, or mapped (require_mapped() reserved room), block @p s is now
  /// also mapped at @p address.
  void mark_mapped(slot_record& s, std::uintptr_t address) noexcept {
    if (s.state == block_state::mapped) {
      s.aliases.push_back(address);  // capacity reserved by require_mapped(): never allocates
      return;
    }
    s.state = block_state::mapped;
    s.address = address;
  }
  /// The block (slot, generation) if release() may free it (live and not mapped), else nullptr.
  /// The backends' release() preconditions: asserted in debug builds, a no-op otherwise.
  [[nodiscard]] slot_record* releasable(std::uint32_t slot, std::uint32_t generation) noexcept {
    slot_record* r = find(slot, generation);
    EXPAGE_ASSERT(r != nullptr, "vmm release: unknown or already released block");
    EXPAGE_ASSERT(r == nullptr || r->state != block_state::mapped, "vmm release: the block is mapped (unmap it first)");
    return r != nullptr && r->state != block_state::mapped ? r : nullptr;
  }
  /// The state of the block (slot, generation): `free` for a released or unknown one.
  [[nodiscard]] block_state state(std::uint32_t slot, std::uint32_t generation) const noexcept {
    const slot_record* s = find(slot, generation);
    return s == nullptr ? block_state::free : s->state;
  }
  /// Where the block (slot, generation) is mapped; 0 when it is not.
  [[nodiscard]] std::uintptr_t mapped_address(std::uint32_t slot, std::uint32_t generation) const noexcept {
    const slot_record* s = find(slot, generation);
    return s == nullptr || s->state != block_state::mapped ? 0 : s->address;
  }

  // The created (not mapped) block, or throws naming the problem.
  slot_record& require_created(const char* op, std::uint32_t slot, std::uint32_t generation) {
    slot_record& r = require_live(op, slot, generation);
    if (r.state == block_state::mapped) {
      throw invalid_argument(fmt::format("{}: block (slot {}, generation {}) is already mapped at {:#x}", op, slot,
                                         generation, r.address));
    }
    return r;
  }
  // The mapped block (a map_alias() source), or throws naming the problem.
  slot_record& require_mapped(const char* op, std::uint32_t slot, std::uint32_t generation) {
    slot_record& r = require_live(op, slot, generation);
    if (r.state != block_state::mapped) {
      throw invalid_argument(fmt::format("{}: block (slot {}, generation {}) is not mapped (map it before aliasing it)",
                                         op, slot, generation));
    }
    r.aliases.reserve(r.aliases.size() + 1);  // may throw bad_alloc: nothing changed yet
    return r;
  }
  // A live block, or throws naming the problem.
  slot_record& require_live(const char* op, std::uint32_t slot, std::uint32_t generation) {
    slot_record* r = find(slot, generation);
    if (r == nullptr) {
      throw invalid_argument(
          fmt::format("{}: unknown or released block (slot {}, generation {})", op, slot, generation));
    }
    return *r;
  }

  void add_reservation(std::uintptr_t base, std::size_t bytes) {
    reservations_.emplace(base, reservation{bytes, base, {}});
  }
  void erase_reservation(std::uintptr_t base) noexcept { reservations_.erase(base); }
  /// The reservation at @p base if free() may return it (known and with nothing mapped), else nullptr.
  /// The backends' free() preconditions: asserted in debug builds, a no-op otherwise.
  [[nodiscard]] reservation* freeable(std::uintptr_t base) noexcept {
    reservation* r = find_reservation(base);
    EXPAGE_ASSERT(r != nullptr, "vmm free: not a reservation's base address (or freed twice)");
    EXPAGE_ASSERT(r == nullptr || r->mapped.empty(),
                  "vmm free: the reservation still has mapped blocks (unmap them first)");
    return r != nullptr && r->mapped.empty() ? r : nullptr;
  }
  [[nodiscard]] reservation* find_reservation(std::uintptr_t base) noexcept {
    const auto it = reservations_.find(base);
    return it == reservations_.end() ? nullptr : &it->second;
  }

  // The run [address, address + bytes) when it is granule-aligned and inside one
  // reservation; otherwise an empty run and a description of the problem in @p why.
  [[nodiscard]] run locate(std::uintptr_t address, std::size_t bytes, std::string* why) noexcept {
    const auto describe = [&](std::string_view format, const auto&... args) {
      if (why != nullptr) {
        try {
          *why = fmt::vformat(format, fmt::make_format_args(args...));
        } catch (...) {  // a description is best effort
        }
      }
      return run{};
    };
    if (bytes == 0 || bytes % granularity_ != 0) {
      return describe("size {} is not a positive multiple of the granularity {}", bytes, granularity_);
    }
    if (address % granularity_ != 0) {
      return describe("address {:#x} is not aligned to the granularity {}", address, granularity_);
    }
    auto it = reservations_.upper_bound(address);
    if (it == reservations_.begin()) {
      return describe("range [{:#x}, +{}) is not inside a reserved range", address, bytes);
    }
    --it;
    const std::uintptr_t base = it->first;
    const std::size_t size = it->second.bytes;
    if (address - base >= size || bytes > size - (address - base)) {
      return describe("range [{:#x}, +{}) is not inside a reserved range (nearest below: [{:#x}, +{}))", address, bytes,
                      base, size);
    }
    return run{base, &it->second, (address - base) / granularity_, bytes / granularity_};
  }

  // locate() that throws expage::invalid_argument.
  run require_run(const char* op, std::uintptr_t address, std::size_t bytes) {
    std::string why;
    const run r = locate(address, bytes, &why);
    if (r.where == nullptr) throw invalid_argument(fmt::format("{}: {}", op, why));
    return r;
  }

  // The first granule of @p r that holds no block, or r.count when all do.
  [[nodiscard]] static std::size_t first_unmapped(const run& r) noexcept {
    for (std::size_t i = 0; i < r.count; ++i) {
      if (!r.where->mapped.contains(r.first + i)) return i;
    }
    return r.count;
  }

  // A run in which every granule holds a block, or throws naming the first that does not.
  run require_mapped_run(const char* op, std::uintptr_t address, std::size_t bytes) {
    const run r = require_run(op, address, bytes);
    if (const std::size_t i = first_unmapped(r); i != r.count) {
      throw invalid_argument(fmt::format("{}: granule at {:#x} in [{:#x}, +{}) holds no block", op,
                                         address + i * granularity_, address, bytes));
    }
    return r;
  }

 private:
  std::string_view backend_;
  std::size_t granularity_;
  std::vector<slot_record> slots_;
  std::vector<std::uint32_t> free_;
  std::size_t live_ = 0;
  std::map<std::uintptr_t, reservation> reservations_;
};

}  // namespace detail

}  // namespace expage

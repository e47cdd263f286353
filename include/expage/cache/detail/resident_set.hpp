// The resident keys of a cache scope as a dense array (not API): O(1) insert
// and erase, cache-friendly scans for policies whose ranking changes with the
// current layer and so cannot be kept sorted.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

namespace expage::detail {

class resident_set {
 public:
  static constexpr std::uint32_t absent = std::numeric_limits<std::uint32_t>::max();

  explicit resident_set(std::uint32_t keys) : position_(keys, absent) { keys_.reserve(keys); }

  void insert(std::uint32_t k) {
    position_[k] = static_cast<std::uint32_t>(keys_.size());
    keys_.push_back(k);
  }
  void erase(std::uint32_t k) noexcept {
    const std::uint32_t at = position_[k];
    keys_[at] = keys_.back();
    position_[keys_[at]] = at;
    keys_.pop_back();
    position_[k] = absent;
  }
  [[nodiscard]] const std::vector<std::uint32_t>& keys() const noexcept { return keys_; }

 private:
  std::vector<std::uint32_t> keys_;
  std::vector<std::uint32_t> position_;
};

}  // namespace expage::detail

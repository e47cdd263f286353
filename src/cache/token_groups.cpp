#include "expage/cache/token_groups.hpp"

#include "expage/core/error.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <unordered_set>

namespace expage {
namespace {

bool contains(const std::vector<std::uint32_t>& v, std::uint32_t x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

}  // namespace

token_grouping group_tokens(std::span<const std::span<const std::uint32_t>> token_experts, std::size_t capacity) {
  if (capacity == 0) {
    throw invalid_argument("group_tokens: capacity 0 out of range [1, ...)");
  }
  token_grouping out;
  std::unordered_set<std::uint32_t> all;
  for (std::size_t t = 0; t < token_experts.size(); ++t) {
    const auto experts = token_experts[t];
    std::vector<std::uint32_t> own;
    for (const std::uint32_t e : experts) {
      if (!contains(own, e)) own.push_back(e);
      all.insert(e);
    }
    if (own.size() > capacity) {
      throw invalid_argument(
          fmt::format("group_tokens: token {} needs {} experts, more than the capacity {}", t, own.size(), capacity));
    }
    bool placed = false;
    for (std::size_t g = 0; g < out.tokens.size() && !placed; ++g) {
      auto& group = out.experts[g];
      const auto extra = static_cast<std::size_t>(
          std::count_if(own.begin(), own.end(), [&](std::uint32_t e) { return !contains(group, e); }));
      if (group.size() + extra <= capacity) {
        for (const std::uint32_t e : own) {
          if (!contains(group, e)) group.push_back(e);
        }
        out.tokens[g].push_back(static_cast<std::uint32_t>(t));
        placed = true;
      }
    }
    if (!placed) {
      out.tokens.push_back({static_cast<std::uint32_t>(t)});
      out.experts.push_back(std::move(own));
    }
  }
  out.lower_bound = (all.size() + capacity - 1) / capacity;
  return out;
}

}  // namespace expage

#include "expage/cache/token_groups.hpp"

#include "expage/core/error.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>

namespace expage {
namespace {

bool contains(const std::vector<std::uint32_t>& v, std::uint32_t x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

// First-fit in token order: each token joins the first group it fits.
token_grouping first_fit(const std::vector<std::vector<std::uint32_t>>& own, std::size_t capacity) {
  token_grouping out;
  for (std::size_t t = 0; t < own.size(); ++t) {
    bool placed = false;
    for (std::size_t g = 0; g < out.tokens.size() && !placed; ++g) {
      auto& group = out.experts[g];
      const auto extra = static_cast<std::size_t>(
          std::count_if(own[t].begin(), own[t].end(), [&](std::uint32_t e) { return !contains(group, e); }));
      if (group.size() + extra <= capacity) {
        for (const std::uint32_t e : own[t]) {
          if (!contains(group, e)) group.push_back(e);
        }
        out.tokens[g].push_back(static_cast<std::uint32_t>(t));
        placed = true;
      }
    }
    if (!placed) {
      out.tokens.push_back({static_cast<std::uint32_t>(t)});
      out.experts.push_back(own[t]);
    }
  }
  return out;
}

// Exact search: can the tokens be packed into `groups` groups? Depth-first,
// tokens with the most experts first, a token never opens a second empty
// group (symmetry), and a node budget bounds the work.
class exact_packer {
 public:
  exact_packer(const std::vector<std::vector<std::uint32_t>>& own, std::size_t capacity, std::size_t budget)
      : own_(own), capacity_(capacity), budget_(budget), order_(own.size()) {
    std::iota(order_.begin(), order_.end(), std::size_t{0});
    std::stable_sort(order_.begin(), order_.end(),
                     [&](std::size_t a, std::size_t b) { return own[a].size() > own[b].size(); });
  }
  enum class outcome { packed, impossible, gave_up };

  outcome pack(std::size_t groups) {
    unions_.assign(groups, {});
    members_.assign(groups, {});
    return place(0);
  }
  [[nodiscard]] const std::vector<std::vector<std::uint32_t>>& members() const noexcept { return members_; }
  [[nodiscard]] const std::vector<std::vector<std::uint32_t>>& unions() const noexcept { return unions_; }

 private:
  outcome place(std::size_t i) {
    if (i == order_.size()) return outcome::packed;
    if (++nodes_ > budget_) return outcome::gave_up;
    const auto& experts = own_[order_[i]];
    bool opened_empty = false;
    for (std::size_t g = 0; g < unions_.size(); ++g) {
      if (unions_[g].empty()) {
        if (opened_empty) continue;  // empty groups are interchangeable
        opened_empty = true;
      }
      const std::size_t before = unions_[g].size();
      for (const std::uint32_t e : experts) {
        if (!contains(unions_[g], e)) unions_[g].push_back(e);
      }
      if (unions_[g].size() <= capacity_) {
        members_[g].push_back(static_cast<std::uint32_t>(order_[i]));
        const outcome r = place(i + 1);
        if (r != outcome::impossible) return r;
        members_[g].pop_back();
      }
      unions_[g].resize(before);
    }
    return outcome::impossible;
  }

  const std::vector<std::vector<std::uint32_t>>& own_;
  std::size_t capacity_;
  std::size_t budget_;
  std::size_t nodes_ = 0;
  std::vector<std::size_t> order_;
  std::vector<std::vector<std::uint32_t>> unions_;
  std::vector<std::vector<std::uint32_t>> members_;
};

}  // namespace

token_grouping group_tokens(std::span<const std::span<const expert_index>> token_experts, std::size_t capacity,
                            std::size_t search_budget) {
  if (capacity == 0) {
    throw invalid_argument("group_tokens: capacity 0 out of range [1, ...)");
  }
  std::vector<std::vector<std::uint32_t>> own(token_experts.size());
  std::vector<std::uint32_t> all;
  for (std::size_t t = 0; t < token_experts.size(); ++t) {
    for (const std::uint32_t e : token_experts[t]) {
      if (!contains(own[t], e)) own[t].push_back(e);
      if (!contains(all, e)) all.push_back(e);
    }
    if (own[t].size() > capacity) {
      throw invalid_argument(fmt::format("group_tokens: token {} needs {} experts, more than the capacity {}", t,
                                         own[t].size(), capacity));
    }
  }
  token_grouping best = first_fit(own, capacity);
  best.lower_bound = all.empty() ? 0 : (all.size() - 1) / capacity + 1;  // ⌈|union|/capacity⌉, no wrap
  best.proven_minimal = best.tokens.size() <= best.lower_bound;
  if (best.proven_minimal) return best;

  // First-fit used more groups than the bound: look for fewer, from one below first-fit's count
  // down. A packing that exists is usually found in few nodes, while proving a count impossible
  // can take the whole budget; searching from the bound up spent it on the bound itself (on a
  // batch of 32 Qwen3-30B-A3B tokens at 16 slots, every call gave up there, at 100,000 nodes each,
  // and returned first-fit's split). Downward, each packing found is kept, and the first count
  // shown impossible proves the last one found minimal.
  exact_packer packer(own, capacity, search_budget);
  for (std::size_t groups = best.tokens.size() - 1; groups >= best.lower_bound; groups = best.tokens.size() - 1) {
    const auto r = packer.pack(groups);
    if (r == exact_packer::outcome::gave_up) return best;  // the best found, not proven minimal
    if (r == exact_packer::outcome::impossible) {
      best.proven_minimal = true;  // one group fewer is impossible, so is every smaller count
      return best;
    }
    // The packing may leave groups empty (it fits in fewer than it was given): only the groups
    // used are kept, and the search goes on from one fewer than those.
    token_grouping exact;
    exact.lower_bound = best.lower_bound;
    for (std::size_t g = 0; g < groups; ++g) {
      if (packer.members()[g].empty()) continue;
      auto members = packer.members()[g];
      std::sort(members.begin(), members.end());
      // The group's union in first-seen token order.
      std::vector<std::uint32_t> experts;
      for (const std::uint32_t t : members) {
        for (const std::uint32_t e : own[t]) {
          if (!contains(experts, e)) experts.push_back(e);
        }
      }
      exact.tokens.push_back(std::move(members));
      exact.experts.push_back(std::move(experts));
    }
    // Groups in order of their first token, as first-fit orders them.
    std::vector<std::size_t> idx(exact.tokens.size());
    std::iota(idx.begin(), idx.end(), std::size_t{0});
    std::sort(idx.begin(), idx.end(),
              [&](std::size_t a, std::size_t b) { return exact.tokens[a][0] < exact.tokens[b][0]; });
    token_grouping sorted;
    sorted.lower_bound = exact.lower_bound;
    for (const std::size_t k : idx) {
      sorted.tokens.push_back(std::move(exact.tokens[k]));
      sorted.experts.push_back(std::move(exact.experts[k]));
    }
    best = std::move(sorted);
    if (best.tokens.size() <= best.lower_bound) {
      best.proven_minimal = true;  // at the bound
      return best;
    }
  }
  return best;
}

}  // namespace expage

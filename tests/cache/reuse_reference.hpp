// Slow, obviously-correct references for the reuse-distance and miss-curve
// property tests, and the random access streams they run on.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <list>
#include <random>
#include <unordered_map>
#include <vector>

namespace expage::test {

inline constexpr std::size_t cold_reference = std::numeric_limits<std::size_t>::max();

/// The LRU stack as a vector, most recent first: a key's distance is its index,
/// and an access moves the key to the front. O(n) per access.
class naive_stack_distance {
 public:
  std::size_t access(std::size_t key) {
    auto it = std::find(stack_.begin(), stack_.end(), key);
    std::size_t distance = cold_reference;
    if (it == stack_.end()) {
      stack_.push_back(key);
      it = stack_.end() - 1;
    } else {
      distance = static_cast<std::size_t>(it - stack_.begin());
    }
    std::rotate(stack_.begin(), it, it + 1);  // move to front
    return distance;
  }
  /// Takes @p key out of the stack (its next access is cold).
  void forget(std::size_t key) { std::erase(stack_, key); }
  [[nodiscard]] std::size_t size() const { return stack_.size(); }

 private:
  std::vector<std::size_t> stack_;
};

/// A textbook LRU cache (std::list + unordered_map) that counts its misses.
class lru_simulation {
 public:
  explicit lru_simulation(std::size_t capacity) : capacity_(capacity) {}
  void access(std::size_t key) {
    const auto it = where_.find(key);
    if (it != where_.end()) {
      order_.splice(order_.begin(), order_, it->second);
      return;
    }
    ++misses_;
    if (capacity_ == 0) return;
    if (order_.size() == capacity_) {
      where_.erase(order_.back());
      order_.pop_back();
    }
    order_.push_front(key);
    where_[key] = order_.begin();
  }
  [[nodiscard]] std::uint64_t misses() const { return misses_; }

 private:
  std::size_t capacity_;
  std::list<std::size_t> order_;
  std::unordered_map<std::size_t, std::list<std::size_t>::iterator> where_;
  std::uint64_t misses_ = 0;
};

/// Misses of an LRU cache of `capacity` slots over `keys`.
inline std::uint64_t lru_misses(const std::vector<std::size_t>& keys, std::size_t capacity) {
  lru_simulation lru(capacity);
  for (const std::size_t k : keys) lru.access(k);
  return lru.misses();
}

/// `length` keys in [0, key_count): Zipf-like popularity with exponent `skew`
/// (0 = uniform) over a random permutation of the keys, with a popularity shift
/// halfway (a new permutation: the hot set changes between phases) and, with
/// probability 1/4, an immediate repeat of one of the last 4 keys (short-range locality).
inline std::vector<std::size_t> zipf_stream(std::size_t key_count, double skew, std::size_t length,
                                            std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<double> weights(key_count);
  for (std::size_t i = 0; i < key_count; ++i) weights[i] = 1.0 / std::pow(static_cast<double>(i + 1), skew);
  std::discrete_distribution<std::size_t> rank(weights.begin(), weights.end());
  std::vector<std::size_t> permutation(key_count);
  for (std::size_t i = 0; i < key_count; ++i) permutation[i] = i;
  std::shuffle(permutation.begin(), permutation.end(), rng);
  std::bernoulli_distribution repeat(0.25);
  std::vector<std::size_t> keys;
  keys.reserve(length);
  for (std::size_t t = 0; t < length; ++t) {
    if (t == length / 2) std::shuffle(permutation.begin(), permutation.end(), rng);
    if (keys.size() >= 4 && repeat(rng)) {
      keys.push_back(keys[keys.size() - 1 - std::uniform_int_distribution<std::size_t>(0, 3)(rng)]);
    } else {
      keys.push_back(permutation[rank(rng)]);
    }
  }
  return keys;
}

inline std::size_t distinct(const std::vector<std::size_t>& keys) {
  std::vector<std::size_t> k = keys;
  std::sort(k.begin(), k.end());
  return static_cast<std::size_t>(std::unique(k.begin(), k.end()) - k.begin());
}

}  // namespace expage::test

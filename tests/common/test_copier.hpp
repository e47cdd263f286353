// Test doubles for host_copy_engine's chunk copier: fail the Nth chunk, or hold
// chunks back behind a gate the test opens.
#pragma once

#include "expage/stream/host_copy_engine.hpp"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <future>
#include <memory>
#include <stdexcept>

namespace expage::testing {

/// The error a failing_copier throws.
class injected_copy_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A copier that memcpy's every chunk but throws injected_copy_error on the @p fail_at-th call (1-based).
inline host_copy_engine_options::chunk_copier failing_copier(std::uint64_t fail_at) {
  auto calls = std::make_shared<std::atomic<std::uint64_t>>(0);
  return [calls, fail_at](std::byte* dst, const std::byte* src, std::size_t bytes) {
    // Relaxed: a call counter; the engine orders the chunks' effects.
    if (calls->fetch_add(1, std::memory_order_relaxed) + 1 == fail_at)
      throw injected_copy_error("injected copy failure");
    std::memcpy(dst, src, bytes);
  };
}

/// A copier whose every chunk waits until open() was called (a one-shot gate), then memcpy's.
class gated_copier {
 public:
  gated_copier() : opened_(gate_.get_future().share()) {}
  /// Lets every chunk, waiting or future, through.
  void open() { gate_.set_value(); }
  /// The copier to put in host_copy_engine_options.
  [[nodiscard]] host_copy_engine_options::chunk_copier copier() const {
    return [opened = opened_](std::byte* dst, const std::byte* src, std::size_t bytes) {
      opened.wait();
      std::memcpy(dst, src, bytes);
    };
  }

 private:
  std::promise<void> gate_;
  std::shared_future<void> opened_;
};

}  // namespace expage::testing

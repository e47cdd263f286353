/// @file
/// @brief The fixture of the tests that run CUDA host code against the fake runtime and driver
/// (fake_cuda_driver.hpp): each test starts from an empty fake, and ends with nothing live (its
/// objects destroyed) and nothing asked of the fake that a real driver would refuse.
#pragma once

#include "cuda/fake_cuda_driver.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

namespace expage::testing::fake_cuda {

/// What the fake holds now, e.g. "2 streams, 1 event" (empty when nothing is live).
inline std::string live_summary() {
  const driver_state& s = state();
  std::string out;
  const auto add = [&](std::size_t n, std::string_view what) {
    if (n != 0) out += fmt::format("{}{} {}", out.empty() ? "" : ", ", n, what);
  };
  add(s.handles.size(), "allocation handles");
  add(s.reservations.size(), "reservations");
  add(s.mapped.size(), "mapped granules");
  add(s.streams.size(), "streams");
  add(s.events.size(), "events");
  add(s.pinned.size(), "pinned allocations");
  add(s.device.size(), "device allocations");
  return out;
}

class fake_cuda_test : public ::testing::Test {
 protected:
  void SetUp() override { reset(); }
  void TearDown() override {
    EXPECT_TRUE(nothing_live()) << "left live: " << live_summary();
    EXPECT_TRUE(state().misuse.empty()) << fmt::format("asked of the fake: {}", fmt::join(state().misuse, "; "));
  }
};

}  // namespace expage::testing::fake_cuda

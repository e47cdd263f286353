// cuda::device_mirror and cuda::device_expert_map against the fake runtime (fake_cuda_driver.hpp):
// construction sets the device arrays and leaves nothing behind when a step fails; updates land
// at their index through a ring of staging slots that fences a slot before reusing it; an update
// that cannot be enqueued is refused (the mirror) or counted and reported (the map, whose update
// cannot throw); a slot whose fence cannot be recorded is waited for and the update stands.
// "Device" memory is host memory here, so the tests read the device arrays directly.
#include "cuda/fake_cuda_test.hpp"
#include "expage/core/error.hpp"
#include "expage/cuda/cuda_stream.hpp"
#include "expage/cuda/device_expert_map.hpp"
#include "expage/cuda/device_mirror.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

namespace fake = expage::testing::fake_cuda;
using expage::version_record;
using expage::version_tier;
using expage::cuda::cuda_stream;
using expage::cuda::device_expert_map;
using expage::cuda::device_mirror;
using call = fake::call;
using ::testing::HasSubstr;

class DeviceMirrorFaults : public fake::fake_cuda_test {
 protected:
  // How many times the log names @p function since entry @p from.
  static std::size_t calls_of(std::string_view function, std::size_t from = 0) {
    std::size_t n = 0;
    const auto& log = fake::state().log;
    for (std::size_t i = from; i < log.size(); ++i) n += log[i].function == function ? 1U : 0U;
    return n;
  }
};

version_record record_of(std::uint64_t number) {
  version_record r;
  r.number = number;
  r.bytes = number * 64;
  r.expert = {.layer = static_cast<std::uint32_t>(number % 3), .expert = static_cast<std::uint32_t>(number)};
  return r;
}

bool same(const version_record& a, const version_record& b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// Entry @p i of tier @p t's device map (INT32_MIN for a tier the map lacks).
std::int32_t entry(const device_expert_map& m, version_tier t, std::size_t i) {
  const std::int32_t* map = m.map(t);
  return map == nullptr ? std::numeric_limits<std::int32_t>::min() : map[i];
}

TEST_F(DeviceMirrorFaults, TheExpertMapStartsAbsentAndEveryUpdateLandsInItsTier) {
  cuda_stream compute;
  {
    device_expert_map map(6, 2, compute.native(), 2);  // two staging slots: the ring wraps
    for (const version_tier t : {version_tier::hi, version_tier::lo}) {
      for (std::size_t i = 0; i < 6; ++i) EXPECT_EQ(entry(map, t, i), -1) << "entry " << i;
    }
    const std::size_t from = fake::state().log.size();
    map.update(version_tier::hi, 0, 7);
    map.update(version_tier::lo, 5, 3);
    map.update(version_tier::hi, 2, 1);
    map.update(version_tier::lo, 4, 2);
    EXPECT_EQ(entry(map, version_tier::hi, 0), 7);
    EXPECT_EQ(entry(map, version_tier::hi, 2), 1);
    EXPECT_EQ(entry(map, version_tier::lo, 5), 3);
    EXPECT_EQ(entry(map, version_tier::lo, 4), 2);
    EXPECT_EQ(entry(map, version_tier::hi, 5), -1) << "a tier's update touches no other tier";
    EXPECT_EQ(calls_of("cudaEventSynchronize", from), 2U) << "the third and fourth updates reuse a slot";
    EXPECT_EQ(map.failed_updates(), 0U);
    EXPECT_NO_THROW(map.throw_if_failed());
  }
}

// The map's update() cannot throw (the runtime has committed its state): a copy that cannot be
// enqueued, a captured stream or an entry out of range is counted and reported by
// throw_if_failed(), naming the first.
TEST_F(DeviceMirrorFaults, TheExpertMapCountsWhatItCouldNotEnqueueAndReportsTheFirst) {
  cuda_stream compute;
  {
    device_expert_map map(4, 1, compute.native(), 4);
    fake::arm(call::memcpy_async, 0);
    map.update(version_tier::hi, 1, 9);
    fake::disarm();
    EXPECT_EQ(entry(map, version_tier::hi, 1), -1) << "the failed copy wrote nothing";
    fake::state().capturing = true;
    map.update(version_tier::hi, 2, 9);
    fake::state().capturing = false;
    map.update(version_tier::lo, 0, 9);  // a tier it does not have
    EXPECT_EQ(map.failed_updates(), 3U);
    EXPECT_THAT([&] { map.throw_if_failed(); }, ::testing::ThrowsMessage<expage::cuda_error>(
                                                    HasSubstr("3 updates failed; the first: cudaMemcpyAsync")));
    map.update(version_tier::hi, 1, 4);
    EXPECT_EQ(entry(map, version_tier::hi, 1), 4) << "the map still works";
  }
}

// A staging slot whose fence cannot be recorded: the copy is queued, so the update stands (a
// kernel after it reads it) and the host waits for the stream instead of fencing the slot.
TEST_F(DeviceMirrorFaults, ASlotWhoseFenceCannotBeRecordedIsWaitedForAndTheUpdateStands) {
  cuda_stream compute;
  {
    device_mirror mirror(4, compute.native(), 2);
    const std::size_t from = fake::state().log.size();
    fake::arm(call::event_record, 0);
    EXPECT_NO_THROW(mirror.update(3, record_of(5)));
    fake::disarm();
    EXPECT_TRUE(same(mirror.records()[3], record_of(5)));
    EXPECT_EQ(calls_of("cudaStreamSynchronize", from), 1U);
    mirror.update(1, record_of(6));  // slot 1
    mirror.update(2, record_of(7));  // slot 0 again: its record failed, nothing to fence
    EXPECT_EQ(calls_of("cudaEventSynchronize", from), 0U);
    EXPECT_TRUE(same(mirror.records()[2], record_of(7)));
  }
}

TEST_F(DeviceMirrorFaults, TheMirrorStartsZeroedRefusesBadUpdatesAndChangesNothingWhenItCannotEnqueue) {
  cuda_stream compute;
  {
    device_mirror mirror(3, compute.native(), 4);
    for (std::size_t i = 0; i < 3; ++i) EXPECT_TRUE(same(mirror.records()[i], version_record{}));
    mirror.update(0, record_of(1));
    EXPECT_TRUE(same(mirror.records()[0], record_of(1)));
    EXPECT_THAT([&] { mirror.update(3, record_of(2)); },
                ::testing::ThrowsMessage<expage::invalid_argument>(HasSubstr("index 3 out of range [0, 3)")));
    fake::state().capturing = true;
    EXPECT_THROW(mirror.update(1, record_of(2)), expage::invalid_argument);
    fake::state().capturing = false;
    fake::arm(call::memcpy_async, 0);
    EXPECT_THROW(mirror.update(1, record_of(2)), expage::cuda_error);
    fake::disarm();
    EXPECT_TRUE(same(mirror.records()[1], version_record{})) << "nothing was written";
  }
}

// Construction fails at the device array or at the pinned staging ring: nothing is kept.
TEST_F(DeviceMirrorFaults, AFailedConstructionKeepsNothing) {
  cuda_stream compute;
  for (const call step : {call::malloc, call::host_alloc}) {
    fake::arm(step, 0);
    EXPECT_THROW(device_mirror(4, compute.native()), expage::cuda_error);
    fake::arm(step, 0);
    EXPECT_THROW(device_expert_map(4, 2, compute.native()), expage::cuda_error);
    fake::disarm();
    EXPECT_TRUE(fake::state().device.empty());
    EXPECT_TRUE(fake::state().pinned.empty());
  }
}

}  // namespace

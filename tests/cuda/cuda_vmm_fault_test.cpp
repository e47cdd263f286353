// cuda_vmm's failure paths against the fake driver (fake_cuda_driver.hpp): every driver call that
// can fail fails once, at each step, and the object, the driver's handles, reservations and
// mappings are as the contract says afterwards; and the destructor leaves nothing live. These
// tests need no GPU: the binary links the fake in place of the CUDA runtime.
#include "cuda/fake_cuda_test.hpp"
#include "expage/core/error.hpp"
#include "expage/cuda/cuda_vmm.hpp"
#include "expage/detail/assert.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

namespace {

namespace fake = expage::testing::fake_cuda;
using expage::access_mode;
using expage::block_state;
using expage::cuda::cuda_vmm;
using call = fake::call;

class CudaVmmFaults : public fake::fake_cuda_test {};

TEST_F(CudaVmmFaults, ConstructionReleasesTheBlocksItMadeWhenACreateFails) {
  for (int k = 0; k < 4; ++k) {
    fake::arm(call::create, k);
    EXPECT_THROW(cuda_vmm({.initial_blocks = 4}), expage::out_of_memory) << "create " << k;
    EXPECT_TRUE(fake::state().handles.empty()) << "create " << k;
    fake::disarm();
  }
}

TEST_F(CudaVmmFaults, AFailedReserveLeavesNoReservation) {
  cuda_vmm v;
  fake::arm(call::reserve);
  EXPECT_THROW((void)v.reserve(4 * v.granularity()), expage::cuda_error);
  EXPECT_TRUE(fake::state().reservations.empty());
  fake::disarm();
  v.free(v.reserve(4 * v.granularity()));
}

TEST_F(CudaVmmFaults, AFailedCreateKeepsEveryOtherBlock) {
  cuda_vmm v;
  const auto b = v.create();
  fake::arm(call::create);
  EXPECT_THROW((void)v.create(), expage::out_of_memory);
  EXPECT_EQ(v.blocks(), 1U);
  EXPECT_EQ(fake::state().handles.size(), 1U);
  EXPECT_EQ(v.state(b), block_state::created);
  v.release(b);
}

TEST_F(CudaVmmFaults, AFailedMapOrAccessGrantLeavesTheBlockCreatedAndTheGranuleFree) {
  for (const call step : {call::map, call::set_access}) {
    cuda_vmm v;
    std::byte* base = v.reserve(v.granularity());
    const auto b = v.create();
    fake::arm(step);
    EXPECT_THROW(v.map(b, base, access_mode::read_write), expage::cuda_error);
    fake::disarm();
    EXPECT_EQ(v.state(b), block_state::created);
    EXPECT_EQ(v.mapped_address(b), nullptr);
    EXPECT_TRUE(fake::state().mapped.empty());
    v.map(b, base, access_mode::read_write);  // the granule is free again
    EXPECT_EQ(v.mapped_address(b), base);
    v.unmap(base, v.granularity());
    v.release(b);
    v.free(base);
  }
}

// The access grant fails, and so does the unmap that would undo the map: the driver keeps the
// mapping, so the table must too (as unmap() does when its cuMemUnmap fails). It used to forget
// it: a later map landed on the mapped granule, release() cached a handle still mapped, and the
// reservation's cuMemAddressFree failed, leaking it and the mapping.
TEST_F(CudaVmmFaults, AnAccessGrantWhoseUndoFailsKeepsTheMapping) {
  {
    cuda_vmm v;
    const std::size_t g = v.granularity();
    std::byte* base = v.reserve(g);
    const auto b = v.create();
    const auto other = v.create();
    fake::arm(call::set_access);
    fake::arm(call::unmap);
    EXPECT_THROW(v.map(b, base, access_mode::read_write), expage::cuda_error);
    fake::disarm();
    EXPECT_EQ(v.state(b), block_state::mapped);
    EXPECT_EQ(v.mapped_address(b), base);
    EXPECT_EQ(fake::state().mapped.size(), 1U);
    EXPECT_THROW(v.map(other, base), expage::invalid_argument) << "the granule holds a block";
    v.release(other);
  }  // the destructor unmaps it
}

TEST_F(CudaVmmFaults, AFailedAliasKeepsTheFirstMapping) {
  cuda_vmm v;
  const std::size_t g = v.granularity();
  std::byte* base = v.reserve(2 * g);
  const auto b = v.create();
  v.map(b, base);
  for (const call step : {call::map, call::set_access}) {
    fake::arm(step);
    EXPECT_THROW(v.map_alias(b, base + g, access_mode::read_write), expage::cuda_error);
    fake::disarm();
    EXPECT_EQ(v.state(b), block_state::mapped);
    EXPECT_EQ(v.mapped_address(b), base);
    EXPECT_EQ(fake::state().mapped.size(), 1U);
  }
  v.map_alias(b, base + g);
  v.unmap(base, g);  // the first mapping goes first: the alias is where the block is now
  EXPECT_EQ(v.mapped_address(b), base + g);
  v.unmap(base + g, g);
  EXPECT_EQ(v.state(b), block_state::created);
  v.release(b);
  v.free(base);
}

TEST_F(CudaVmmFaults, AFailedSetAccessChangesNothing) {
  cuda_vmm v;
  const std::size_t g = v.granularity();
  std::byte* base = v.reserve(g);
  const auto b = v.create();
  v.map(b, base, access_mode::none);
  fake::arm(call::set_access);
  EXPECT_THROW(v.set_access(base, g, access_mode::read_write), expage::cuda_error);
  fake::disarm();
  EXPECT_EQ(v.mapped_address(b), base);
  v.set_access(base, g, access_mode::read_write);
}

// unmap() and free() cannot throw; a driver failure there is asserted in debug builds. In release
// builds the table keeps what the driver kept, and the destructor gives it back.
TEST_F(CudaVmmFaults, AFailedUnmapOrAddressFreeKeepsWhatTheDriverKept) {
  if (EXPAGE_ASSERTIONS_ENABLED) GTEST_SKIP() << "a failed cuMemUnmap or cuMemAddressFree is asserted in this build";
  cuda_vmm v;
  const std::size_t g = v.granularity();
  std::byte* base = v.reserve(g);
  const auto b = v.create();
  v.map(b, base);
  fake::arm(call::unmap);
  v.unmap(base, g);
  fake::disarm();
  EXPECT_EQ(v.mapped_address(b), base);
  EXPECT_EQ(fake::state().mapped.size(), 1U);
  v.unmap(base, g);
  v.release(b);
  fake::arm(call::address_free);
  v.free(base);
  fake::disarm();
  EXPECT_EQ(fake::state().reservations.size(), 1U);
  std::byte* second = v.reserve(g);  // the object still works
  v.free(second);
}  // the destructor frees the reservation it kept

TEST_F(CudaVmmFaults, TheDestructorUnmapsAndReleasesEverything) {
  cuda_vmm v({.initial_blocks = 2});
  const std::size_t g = v.granularity();
  std::byte* base = v.reserve(4 * g);
  (void)v.reserve(g);  // never used
  const auto a = v.create();
  const auto b = v.create();
  const auto c = v.create();
  v.map(a, base);
  v.map_alias(a, base + g);
  v.map(b, base + 3 * g, access_mode::none);
  v.release(c);  // cached
  EXPECT_EQ(fake::state().handles.size(), 3U);
  EXPECT_EQ(fake::state().mapped.size(), 3U);
}

}  // namespace

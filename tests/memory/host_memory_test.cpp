#include "expage/memory/host_memory.hpp"

#include "expage/core/error.hpp"
#include "expage/core/units.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <vector>

namespace expage {
namespace {

using namespace expage::literals;
using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(HostMemory, ValidatesItsOptions) {
  EXPECT_THROW(host_memory({.block_size = 0}), invalid_argument);
  EXPECT_THROW(host_memory({.block_size = 4096 + 8}), invalid_argument);
  EXPECT_THROW(host_memory({.block_size = 2_MiB, .alignment = 3 * 4096}), invalid_argument);
  EXPECT_THROW(host_memory({.block_size = 2_MiB, .alignment = 512}), invalid_argument);
  EXPECT_THROW(host_memory({.block_size = 4_GiB, .alignment = 2_GiB}), invalid_argument);
  try {
    host_memory m({.block_size = 1_MiB, .alignment = 2_MiB});
    FAIL();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("block_size 1048576"), HasSubstr("alignment (2097152)")));
  }
  EXPECT_NO_THROW(host_memory({.block_size = 2_MiB, .alignment = 2_MiB, .huge_pages = true}));
}

TEST(HostMemory, HonoursLargeAlignments) {
  host_memory m({.block_size = 4_MiB, .alignment = 4_MiB});
  std::vector<std::byte*> ps;
  for (int i = 0; i < 8; ++i) {
    ps.push_back(m.allocate(1));
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(ps.back()) % (4_MiB), 0U);
    ps.back()[4_MiB - 1] = std::byte{1};  // the last byte is mapped
  }
  for (std::byte* p : ps) m.deallocate(p, 1);
}

TEST(HostMemory, PopulatedBlocksAreResidentAtOnce) {
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  host_memory m({.block_size = 1_MiB, .populate = true});
  std::byte* p = m.allocate(2);
  std::vector<unsigned char> residency(2_MiB / page);
  ASSERT_EQ(::mincore(p, 2_MiB, residency.data()), 0);
  for (const unsigned char r : residency) EXPECT_TRUE(r & 1U);
  m.deallocate(p, 2);

  host_memory lazy({.block_size = 1_MiB});
  std::byte* q = lazy.allocate(2);
  ASSERT_EQ(::mincore(q, 2_MiB, residency.data()), 0);
  std::size_t resident = 0;
  for (const unsigned char r : residency) resident += r & 1U;
  EXPECT_EQ(resident, 0U) << "without populate nothing is faulted in";
  lazy.deallocate(q, 2);
}

// deallocate() unmaps the blocks (ASan tracks the heap, not mmap: a leaked mapping would not show).
TEST(HostMemory, DeallocateUnmaps) {
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  host_memory m({.block_size = 1_MiB});
  std::byte* p = m.allocate(2);
  p[0] = std::byte{1};
  p[2_MiB - 1] = std::byte{1};
  m.deallocate(p, 2);
  std::vector<unsigned char> residency(2_MiB / page);
  errno = 0;
  EXPECT_EQ(::mincore(p, 2_MiB, residency.data()), -1);
  EXPECT_EQ(errno, ENOMEM);
}

TEST(HostMemory, ReportsExhaustionAsOutOfMemory) {
  host_memory m({.block_size = 1_TiB});
  try {
    std::byte* p = m.allocate(4096);  // 4 PiB: beyond any machine
    m.deallocate(p, 4096);
    FAIL() << "a 4 PiB mapping succeeded";
  } catch (const out_of_memory& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("mmap"), HasSubstr("4096.00 TiB")));
  }
}

}  // namespace
}  // namespace expage

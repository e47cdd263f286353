// host_vmm: the virtual_memory contract, plus what only the host backend can show
// (faults on unmapped granules, punch-hole release, the mapping-count limit).
#include "common/virtual_memory_contract.hpp"

#include "expage/core/units.hpp"
#include "expage/vmm/host_vmm.hpp"

#include <gtest/gtest.h>

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace expage::testing {

using namespace expage::literals;

template <>
struct vmm_traits<host_vmm> {
  // 64 KiB granules: larger than a page, so alignment and offsets are exercised.
  static std::unique_ptr<host_vmm> make() {
    return std::make_unique<host_vmm>(host_vmm::options{.granularity = 64_KiB});
  }
  static std::string unusable() { return {}; }
  static void fill(std::byte* p, std::size_t bytes, std::uint64_t seed) {
    fill_pattern(reinterpret_cast<std::uint64_t*>(p), bytes / 8, seed);
  }
  static std::size_t mismatches(const std::byte* p, std::size_t bytes, std::uint64_t seed) {
    return count_pattern_mismatches(reinterpret_cast<const std::uint64_t*>(p), bytes / 8, seed);
  }
};

using host_backends = ::testing::Types<host_vmm>;
INSTANTIATE_TYPED_TEST_SUITE_P(host, virtual_memory_contract, host_backends);

namespace {

std::size_t page() { return static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)); }

void write_byte(std::byte* p) { *reinterpret_cast<volatile std::byte*>(p) = std::byte{1}; }

TEST(HostVmm, ValidatesOptions) {
  EXPECT_THROW(host_vmm({.granularity = 3000}), invalid_argument);
  EXPECT_THROW(host_vmm({.granularity = 3 * page()}), invalid_argument);
  EXPECT_THROW(host_vmm({.granularity = page() / 2}), invalid_argument);
  EXPECT_THROW(host_vmm({.granularity = 2 * GiB}), invalid_argument);
  try {
    host_vmm bad({.granularity = 3000});
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("granularity 3000"), std::string::npos) << e.what();
  }
  EXPECT_EQ(host_vmm().granularity(), page());
  EXPECT_EQ(host_vmm({.granularity = 2_MiB}).configuration().granularity, 2_MiB);
  EXPECT_EQ(host_vmm().location(), memory_location::host);
}

// A reservation's size is a positive multiple of the granularity, and the range the refusal
// names holds only such sizes: its top was max_bytes − granularity, which is not one.
TEST(HostVmm, AReservationRefusalNamesARangeOfMultiples) {
  host_vmm vm;
  const std::size_t g = vm.granularity();
  for (const std::size_t bytes : {std::size_t{0}, g + 1, std::numeric_limits<std::size_t>::max()}) {
    try {
      (void)vm.reserve(bytes);
      ADD_FAILURE() << bytes;
    } catch (const invalid_argument& e) {
      const std::string what = e.what();
      const auto comma = what.rfind(", ");
      ASSERT_NE(comma, std::string::npos) << what;
      const std::size_t top = std::stoull(what.substr(comma + 2));
      EXPECT_EQ(top % g, 0U) << what;
      EXPECT_GT(top, g) << what;
    }
  }
}

TEST(HostVmm, TwoMiBGranulesAreAligned) {
  host_vmm vm({.granularity = 2_MiB});
  std::byte* base = vm.reserve(8_MiB);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(base) % 2_MiB, 0U);
  const auto b = vm.create();
  vm.map(b, base + 6_MiB);
  fill_pattern(reinterpret_cast<std::uint64_t*>(base + 6_MiB), 2_MiB / 8, 7);
  EXPECT_EQ(vm.block_at(base + 6_MiB + 12345), b);
  EXPECT_FALSE(vm.block_at(base + 4_MiB).has_value());
  EXPECT_EQ(vm.mapped_address(b), base + 6_MiB);
  vm.unmap(base + 6_MiB, 2_MiB);
  EXPECT_EQ(vm.mapped_address(b), nullptr);
  vm.release(b);
  vm.free(base);
}

TEST(HostVmm, NewAndReusedBlocksReadAsZeros) {
  host_vmm vm;
  const std::size_t g = vm.granularity();
  std::byte* base = vm.reserve(g);
  const auto a = vm.create();
  vm.map(a, base);
  EXPECT_EQ(count_pattern_mismatches(reinterpret_cast<const std::uint64_t*>(base), g / 8, 1), g / 8);
  std::memset(base, 0xFF, g);
  vm.unmap(base, g);
  vm.release(a);
  const auto b = vm.create();  // reuses a's offset, whose hole was punched
  vm.map(b, base);
  std::size_t nonzero = 0;
  for (std::size_t i = 0; i < g; ++i) nonzero += base[i] != std::byte{0} ? 1U : 0U;
  EXPECT_EQ(nonzero, 0U);
  vm.unmap(base, g);
  vm.release(b);
  vm.free(base);
}

TEST(HostVmm, ReleasePunchesTheHole) {
  host_vmm vm({.granularity = 2_MiB});
  std::byte* base = vm.reserve(2_MiB);
  const auto b = vm.create();
  vm.map(b, base);
  std::memset(base, 1, 2_MiB);
  EXPECT_GE(vm.physical_bytes(), 2_MiB);
  vm.unmap(base, 2_MiB);
  // Still resident in the file, though nothing maps it.
  EXPECT_GE(vm.physical_bytes(), 2_MiB);
  vm.release(b);
  EXPECT_EQ(vm.physical_bytes(), 0U);
  vm.free(base);
}

TEST(HostVmmDeathTest, TouchingAnUnmappedGranuleFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  host_vmm vm;
  const std::size_t g = vm.granularity();
  std::byte* base = vm.reserve(2 * g);
  EXPECT_DEATH(write_byte(base), "") << "a reserved, never-mapped granule must fault";
  const auto b = vm.create();
  vm.map(b, base);
  write_byte(base);
  vm.unmap(base, g);
  EXPECT_DEATH(write_byte(base), "") << "an unmapped granule must fault";
  vm.map(b, base + g);
  vm.set_access(base + g, g, access_mode::none);
  EXPECT_DEATH(write_byte(base + g), "") << "access none must fault";
  vm.set_access(base + g, g, access_mode::read_write);
  write_byte(base + g);
  vm.unmap(base + g, g);
  vm.release(b);
  vm.free(base);
}

// The memfd's size counts against RLIMIT_FSIZE, and growing it past the limit raises SIGXFSZ,
// which kills the process: create() stops at the limit with out_of_memory naming it. Run in a
// child, which alone gets the limit (exit 0: stopped at block 64 with the message).
TEST(HostVmmDeathTest, CreateStopsAtTheFileSizeLimitInsteadOfRaisingSigxfsz) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        host_vmm vm(host_vmm::options{.granularity = 64_KiB});
        ::rlimit limit{};
        if (::getrlimit(RLIMIT_FSIZE, &limit) != 0) std::_Exit(2);
        limit.rlim_cur = 64 * vm.granularity();
        if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) std::_Exit(2);
        for (int made = 0; made <= 256; ++made) {
          try {
            (void)vm.create();
          } catch (const out_of_memory& e) {
            const bool named = std::string_view(e.what()).find("RLIMIT_FSIZE") != std::string_view::npos;
            std::_Exit(made == 64 && named ? 0 : 3);
          }
        }
        std::_Exit(4);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST(HostVmm, UnmapLeavesNoHole) {
  host_vmm vm;
  const std::size_t g = vm.granularity();
  std::byte* base = vm.reserve(g);
  const auto b = vm.create();
  vm.map(b, base);
  vm.unmap(base, g);
  // A hint at the unmapped granule must not be honoured: the placeholder still owns it.
  void* other = ::mmap(base, g, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(other, MAP_FAILED);
  EXPECT_NE(other, static_cast<void*>(base));
  ::munmap(other, g);
  vm.release(b);
  vm.free(base);
}

TEST(HostVmm, RefusesMappingsPastItsLimitBeforeTheKernelDoes) {
  host_vmm vm({.max_mappings = 4});
  const std::size_t g = vm.granularity();
  std::byte* base = vm.reserve(8 * g);
  EXPECT_EQ(vm.map_count(), 1U);
  const auto a = vm.create();
  const auto b = vm.create();
  const auto c = vm.create();
  const auto d = vm.create();
  vm.map(a, base);  // [a][free run]
  EXPECT_EQ(vm.map_count(), 2U);
  vm.map(b, base + 2 * g);  // [a][free][b][free run]
  EXPECT_EQ(vm.map_count(), 4U);
  try {
    vm.map(c, base + 5 * g);  // would split the last run: 6 mappings
    ADD_FAILURE() << "map past max_mappings succeeded";
  } catch (const out_of_memory& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("limit of 4"), std::string::npos) << what;
    EXPECT_NE(what.find("max_mappings"), std::string::npos) << what;
  }
  EXPECT_EQ(vm.state(c), block_state::created);
  EXPECT_EQ(vm.map_count(), 4U);
  EXPECT_FALSE(vm.block_at(base + 5 * g).has_value());
  EXPECT_THROW((void)vm.reserve(g), out_of_memory);
  EXPECT_EQ(vm.map_count(), 4U);
  vm.map(c, base + g);  // fills a gap between two mapped granules: no new mapping
  EXPECT_EQ(vm.map_count(), 4U);
  EXPECT_THROW(vm.map(d, base + 3 * g), out_of_memory);  // beside b, shortening the last run: 5
  EXPECT_EQ(vm.state(d), block_state::created);
  EXPECT_EQ(vm.map_count(), 4U);
  vm.unmap(base, 3 * g);
  EXPECT_EQ(vm.map_count(), 1U);
  for (const auto& x : {a, b, c, d}) vm.release(x);
  vm.free(base);
  EXPECT_EQ(vm.map_count(), 0U);
}

TEST(HostVmm, ReportsMapCountHeadroom) {
  host_vmm vm;
  std::byte* base = vm.reserve(4 * vm.granularity());
  const map_count_report r = vm.map_counts();
  EXPECT_GT(r.system_limit, 0U);
  EXPECT_GT(r.process_mappings, 0U);
  EXPECT_EQ(r.tracked, 1U);
  EXPECT_GT(r.limit, r.tracked);
  EXPECT_LT(r.limit, r.system_limit) << "the limit keeps a safety margin";
  EXPECT_EQ(r.headroom, r.limit - r.tracked);
  vm.free(base);
}

// The destructor unmaps what is left and hands its mappings back to the process's budget
// (ASan tracks the heap, not mmap: neither leak would show there).
TEST(HostVmm, DestructionFreesLeftovers) {
  const std::size_t limit = host_vmm().map_counts().limit;  // with no other host_vmm alive
  auto vm = std::make_unique<host_vmm>();
  const std::size_t size = 2 * vm->granularity();
  std::byte* base = vm->reserve(size);
  const auto b = vm->create();
  vm->map(b, base);
  write_byte(base);
  EXPECT_LT(host_vmm().map_counts().limit, limit) << "the live one's mappings count against another";
  vm.reset();
  std::vector<unsigned char> residency(size / static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)));
  errno = 0;
  EXPECT_EQ(::mincore(base, size, residency.data()), -1) << "the reserved range is unmapped";
  EXPECT_EQ(errno, ENOMEM);
  EXPECT_EQ(host_vmm().map_counts().limit, limit) << "its mappings are handed back";
}

}  // namespace
}  // namespace expage::testing

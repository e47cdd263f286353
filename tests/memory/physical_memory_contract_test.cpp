// Runs the physical_memory contract on every host backend and test double.
#include "common/physical_memory_contract.hpp"
#include "common/test_memory.hpp"

#include "expage/memory/host_memory.hpp"

namespace expage::testing {

/// Page-aligned 64 KiB blocks.
struct small_host_memory : host_memory {
  small_host_memory() : host_memory({.block_size = 64 * KiB}) {}
};
/// 2 MiB-aligned 2 MiB blocks with transparent huge pages, prefaulted.
struct huge_host_memory : host_memory {
  huge_host_memory()
      : host_memory({.block_size = 2 * MiB, .alignment = 2 * MiB, .huge_pages = true, .populate = true}) {}
};

template <>
struct memory_traits<small_host_memory> : host_touchable_traits<small_host_memory> {
  static small_host_memory make() { return {}; }
};
template <>
struct memory_traits<huge_host_memory> : host_touchable_traits<huge_host_memory> {
  static huge_host_memory make() { return {}; }
};
template <>
struct memory_traits<heap_memory> : host_touchable_traits<heap_memory> {
  static heap_memory make() { return heap_memory(4096); }
};
template <>
struct memory_traits<counting_memory<heap_memory>> : host_touchable_traits<counting_memory<heap_memory>> {
  static counting_memory<heap_memory> make() { return counting_memory<heap_memory>(heap_memory(8192)); }
};
template <>
struct memory_traits<failing_memory<small_host_memory>> : host_touchable_traits<failing_memory<small_host_memory>> {
  static failing_memory<small_host_memory> make() { return failing_memory<small_host_memory>(); }  // never fails
};

using host_backends = ::testing::Types<small_host_memory, huge_host_memory, heap_memory, counting_memory<heap_memory>,
                                       failing_memory<small_host_memory>>;
INSTANTIATE_TYPED_TEST_SUITE_P(host, physical_memory_contract, host_backends);

}  // namespace expage::testing

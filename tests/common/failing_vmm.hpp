// host_vmm with fault injection: the Nth map(), set_access() or create() from
// now on throws expage::out_of_memory (the strong-guarantee tests of the
// address space and the layer pipeline).
#pragma once

#include "expage/core/error.hpp"
#include "expage/vmm/host_vmm.hpp"

#include <optional>

namespace expage::testing {

class failing_vmm : public host_vmm {
 public:
  using host_vmm::host_vmm;
  std::optional<int> fail_map_in;     ///< Calls to map() or map_alias() until one throws.
  std::optional<int> fail_access_in;  ///< Calls to set_access() until one throws.
  std::optional<int> fail_create_in;  ///< Calls to create() until one throws.

  void map(physical_block b, std::byte* p, access_mode a) {
    if (fail_map_in && --*fail_map_in == 0) throw out_of_memory("failing_vmm: injected map failure");
    host_vmm::map(b, p, a);
  }
  void map_alias(physical_block b, std::byte* p, access_mode a) {
    if (fail_map_in && --*fail_map_in == 0) throw out_of_memory("failing_vmm: injected map_alias failure");
    host_vmm::map_alias(b, p, a);
  }
  void set_access(std::byte* p, std::size_t n, access_mode a) {
    if (fail_access_in && --*fail_access_in == 0) throw out_of_memory("failing_vmm: injected set_access failure");
    host_vmm::set_access(p, n, a);
  }
  [[nodiscard]] physical_block create() {
    if (fail_create_in && --*fail_create_in == 0) throw out_of_memory("failing_vmm: injected create failure");
    return host_vmm::create();
  }
  /// Stops injecting failures.
  void heal() noexcept {
    fail_map_in.reset();
    fail_access_in.reset();
    fail_create_in.reset();
  }
};
static_assert(aliasing_virtual_memory<failing_vmm>);

}  // namespace expage::testing

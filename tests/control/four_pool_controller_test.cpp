#include "expage/control/four_pool_controller.hpp"

#include <gtest/gtest.h>

namespace expage {
namespace {}  // namespace
}  // namespace expage

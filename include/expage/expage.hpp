/// @file
/// @brief The umbrella header: every host-only public header of expage.
///
/// CUDA headers (expage/cuda/...) are never included here; include them
/// directly and link expage::cuda.
#pragma once

#include "expage/core/error.hpp"
#include "expage/core/expert_id.hpp"
#include "expage/core/moe_geometry.hpp"
#include "expage/core/pattern.hpp"
#include "expage/core/precision.hpp"
#include "expage/core/units.hpp"
#include "expage/memory/block_pool.hpp"
#include "expage/memory/budget_tracker.hpp"
#include "expage/memory/host_memory.hpp"
#include "expage/memory/physical_memory.hpp"
#include "expage/version.hpp"

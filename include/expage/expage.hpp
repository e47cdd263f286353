/// @file
/// @brief The umbrella header: every host-only public header of expage.
///
/// CUDA headers (expage/cuda/...) are never included here; include them
/// directly and link expage::cuda.
#pragma once

#include "expage/cache/belady_policy.hpp"
#include "expage/cache/decayed_reuse_histogram.hpp"
#include "expage/cache/eviction_policy.hpp"
#include "expage/cache/fmoe_priority_policy.hpp"
#include "expage/cache/layer_decay_policy.hpp"
#include "expage/cache/layered_miss_curves.hpp"
#include "expage/cache/lfu_policy.hpp"
#include "expage/cache/lru_policy.hpp"
#include "expage/cache/miss_ratio_curve.hpp"
#include "expage/cache/next_turn_policy.hpp"
#include "expage/cache/replay.hpp"
#include "expage/cache/reuse_distance.hpp"
#include "expage/cache/slot_cache.hpp"
#include "expage/cache/token_groups.hpp"
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
#include "expage/trace/routing_trace.hpp"
#include "expage/trace/synthetic_trace.hpp"
#include "expage/trace/trace_io.hpp"
#include "expage/version.hpp"
#include "expage/vmm/address_space.hpp"
#include "expage/vmm/host_vmm.hpp"
#include "expage/vmm/virtual_memory.hpp"
#include "expage/vmm/vmm_block_pool.hpp"

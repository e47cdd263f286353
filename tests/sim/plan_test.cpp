#include "expage/sim/plan.hpp"

#include "common/split_workloads.hpp"

#include "expage/core/error.hpp"
#include "expage/trace/synthetic_trace.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace expage {
namespace {

using ::testing::HasSubstr;
using testing::small_geometry;

routing_trace traffic() {
  synthetic_options so;
  so.seed = 4;
  so.sequences = 3;
  so.decode_steps = 40;
  return generate_synthetic(small_geometry(), so);
}

plan_options base() {
  plan_options o;
  const std::uint64_t expert = small_geometry().expert_bytes(precision::bf16);
  o.budget_bytes = 80 * expert;
  o.kv_floor_bytes = 20 * expert;
  o.precisions = {precision::bf16, precision::int4};
  o.transfer_compute_ratio = 2.0;
  o.hardware.links[0].setup_seconds = 0.0;
  o.points = 6;
  o.tolerance = 0.05;
  return o;
}

// Every option fits the budget above the KV floor and equals a direct simulation; the best is the
// least time per token; the recommendation is the least expert memory within the tolerance
// (checked against every option).
TEST(PlanMemory, OptionsFitTheBudgetAndTheKneeIsTheLeastMemoryNearTheBest) {
  const auto g = small_geometry();
  const routing_trace t = traffic();
  const plan_options o = base();
  const plan_result plan = plan_memory(t, g, o);
  ASSERT_GE(plan.options.size(), 8U);
  std::size_t bf16 = 0;
  for (std::size_t i = 0; i < plan.options.size(); ++i) {
    const plan_option& a = plan.options[i];
    SCOPED_TRACE(fmt::format("option {}: {} slots at {}", i, a.slots, to_string(a.format)));
    EXPECT_EQ(a.expert_bytes + a.kv_bytes, o.budget_bytes);
    EXPECT_GE(a.kv_bytes, o.kv_floor_bytes);
    EXPECT_GE(a.slots, g.top_k());
    EXPECT_LE(a.belady_stall_per_token, a.result.stall_seconds_per_token() + 1e-12);
    if (a.format == precision::bf16) ++bf16;
    if (i > 0 && plan.options[i - 1].format == a.format) {
      EXPECT_GT(a.slots, plan.options[i - 1].slots);
    }
    const access_stream s(t, a.slots);
    const sim_result direct = simulate(s, g, o.policy,
                                       {.capacity = a.slots,
                                        .format = a.format,
                                        .hardware = o.hardware,
                                        .transfer_compute_ratio = o.transfer_compute_ratio});
    EXPECT_DOUBLE_EQ(direct.seconds_per_token(), a.result.seconds_per_token());
    EXPECT_GE(a.result.seconds_per_token(), plan.options[plan.best].result.seconds_per_token());
  }
  EXPECT_EQ(bf16, 6U);
  EXPECT_EQ(plan.options.front().slots, g.top_k());
  EXPECT_EQ(plan.options[bf16 - 1].slots, 60U) << "the budget above the floor holds 60 bf16 experts";
  const double bar = 1.05 * plan.options[plan.best].result.seconds_per_token();
  const plan_option& knee = plan.options[plan.recommended];
  EXPECT_LE(knee.result.seconds_per_token(), bar);
  for (const plan_option& a : plan.options) {
    if (a.result.seconds_per_token() <= bar) {
      EXPECT_GE(a.expert_bytes, knee.expert_bytes);
    }
  }
  // With no tolerance the knee is the best.
  plan_options exact = o;
  exact.tolerance = 0.0;
  const plan_result strict = plan_memory(t, g, exact);
  EXPECT_DOUBLE_EQ(strict.options[strict.recommended].result.seconds_per_token(),
                   strict.options[strict.best].result.seconds_per_token());
}

// A precision without room for one step's experts is not dropped without a word: no_room says
// what the budget holds of it.
TEST(PlanMemory, NamesThePrecisionsWithoutRoom) {
  const auto g = small_geometry();
  plan_options o = base();
  EXPECT_TRUE(plan_memory(traffic(), g, o).no_room.empty());
  o.budget_bytes = o.kv_floor_bytes + g.expert_bytes(precision::bf16) + g.expert_bytes(precision::bf16) / 2;
  const plan_result plan = plan_memory(traffic(), g, o);
  ASSERT_EQ(plan.no_room.size(), 1U);
  EXPECT_EQ(plan.no_room[0], fmt::format("bf16: 1 slots of {} bytes", g.expert_bytes(precision::bf16)));
  for (const plan_option& a : plan.options) EXPECT_EQ(a.format, precision::int4);
}

TEST(PlanMemory, RefusesBadInputNamingTheValue) {
  const auto g = small_geometry();
  const routing_trace t = traffic();
  const auto expect_refusal = [&](const plan_options& o, const char* says) {
    try {
      (void)plan_memory(t, g, o);
      ADD_FAILURE() << "accepted: " << says;
    } catch (const invalid_argument& e) {
      EXPECT_THAT(e.what(), HasSubstr(says));
    }
  };
  plan_options o = base();
  o.budget_bytes = 0;
  expect_refusal(o, "budget_bytes 0 out of range");
  o = base();
  o.kv_floor_bytes = o.budget_bytes;
  expect_refusal(o, "out of range [0, 983040) (below the budget)");
  o = base();
  o.points = 1;
  expect_refusal(o, "points 1 out of range [2, 64]");
  o = base();
  o.tolerance = -0.5;
  expect_refusal(o, "tolerance -0.5 out of range [0, 10]");
  o = base();
  o.policy = policy_kind::belady;
  expect_refusal(o, "policy belady is not an online policy");
  o = base();
  o.precisions.clear();
  expect_refusal(o, "0 precisions, out of range [1, 8]");
  o = base();
  o.precisions = {precision::bf16};
  o.kv_floor_bytes = o.budget_bytes - g.expert_bytes(precision::bf16);  // room for one expert; a step needs 2
  expect_refusal(o, "less than one step's 2 experts at every precision (bf16: 1 slots of 12288 bytes)");
}

}  // namespace
}  // namespace expage

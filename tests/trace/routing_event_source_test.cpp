#include "expage/trace/routing_event_source.hpp"

#include "expage/trace/synthetic_trace.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>

namespace expage {
namespace {

TEST(TraceEventSource, DeliversEveryEventInChunksThenStaysAtTheEnd) {
  const auto g = moe_geometry::mixtral_8x7b();
  const routing_trace t = generate_synthetic(g, {.seed = 2, .sequences = 2, .decode_steps = 5, .batch_size = 2});
  for (const std::size_t chunk : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{100000}}) {
    trace_event_source source(t, chunk);
    EXPECT_EQ(source.layers(), 32U);
    EXPECT_EQ(source.experts_per_layer(), 8U);
    EXPECT_EQ(source.top_k(), 2U);
    EXPECT_EQ(source.batch_size(), 2U);
    std::size_t i = 0;
    for (auto events = source.next(); !events.empty(); events = source.next()) {
      EXPECT_LE(events.size(), std::max<std::size_t>(chunk, 1));
      for (const routing_event& e : events) {
        const routing_event want = t[i++];
        EXPECT_EQ(e.sequence, want.sequence);
        EXPECT_EQ(e.step, want.step);
        EXPECT_EQ(e.layer, want.layer);
        EXPECT_EQ(e.experts.data(), want.experts.data()) << "views into the trace, not copies";
      }
    }
    EXPECT_EQ(i, t.size()) << "chunk " << chunk;
    EXPECT_TRUE(source.next().empty());
  }
}

}  // namespace
}  // namespace expage

#include "expage/runtime/event_trace.hpp"
#include "expage/runtime/expert_runtime.hpp"

#include <fmt/format.h>

#include <ostream>

namespace expage {

namespace {

void write_layer(std::ostream& out, const runtime_layer_statistics& s) {
  out << fmt::format(
      R"({{"acquires":{},"hits":{},"misses":{},"bytes_loaded":{},"evictions":{},"prefetches":{},)"
      R"("prefetch_bytes":{},"prefetch_used":{},"prefetch_used_bytes":{},"prefetch_wasted":{},)"
      R"("prefetch_wasted_bytes":{},"load_waits":{},"load_wait_ns":{},"fence_waits":{},"fence_wait_ns":{},)"
      R"("lo_served":{},"promotions":{},"promotion_bytes":{},"demotions":{},"demotion_bytes":{},"switches":{}}})",
      s.acquires, s.hits, s.misses, s.bytes_loaded, s.evictions, s.prefetches, s.prefetch_bytes, s.prefetch_used,
      s.prefetch_used_bytes, s.prefetch_wasted, s.prefetch_wasted_bytes, s.load_waits, s.load_wait_ns, s.fence_waits,
      s.fence_wait_ns, s.lo_served, s.promotions, s.promotion_bytes, s.demotions, s.demotion_bytes, s.switches);
}

}  // namespace

void runtime_statistics::write_json(std::ostream& out) const {
  out << "{\"tier\":";
  write_json_string(out, to_string(tier));
  out << fmt::format(
      R"(,"capacity":{},"resident":{},"pinned":{},"resident_bytes":{},"peak_resident_bytes":{},)"
      R"("prefetch_queued":{},"prefetch_cancelled":{},"prefetch_failed":{},"transitions_queued":{},)"
      R"("transitions_cancelled":{},"transitions_requeued":{},)"
      R"("transitions_failed":{},"failed_acquires":{},"poisoned":{},"trace_dropped":{},"hit_ratio":{:.6f},)"
      R"("hi_coverage":{:.6f},"ranks_by_lru":{},)",
      capacity, resident, pinned, resident_bytes, peak_resident_bytes, prefetch_queued, prefetch_cancelled,
      prefetch_failed, transitions_queued, transitions_cancelled, transitions_requeued, transitions_failed,
      failed_acquires, poisoned, trace_dropped, hit_ratio(), hi_coverage(), ranks_by_lru);
  out << "\"tiers\":[";
  for (std::size_t t = 0; t < tiers.size(); ++t) {
    if (t != 0) out << ',';
    out << fmt::format(R"({{"tier":"{}","format":)", to_string(static_cast<version_tier>(t)));
    write_json_string(out, to_string(tiers[t].format));
    out << fmt::format(R"(,"capacity":{},"resident":{},"resident_bytes":{},"peak_resident_bytes":{},"total":)",
                       tiers[t].capacity, tiers[t].resident, tiers[t].resident_bytes, tiers[t].peak_resident_bytes);
    write_layer(out, tiers[t].total);
    out << ",\"layers\":[";
    for (std::size_t l = 0; l < tiers[t].layers.size(); ++l) {
      if (l != 0) out << ',';
      write_layer(out, tiers[t].layers[l]);
    }
    out << "]}";
  }
  out << "],";
  out << "\"total\":";
  write_layer(out, total);
  out << ",\"layers\":[";
  for (std::size_t l = 0; l < layers.size(); ++l) {
    if (l != 0) out << ',';
    write_layer(out, layers[l]);
  }
  out << "]}";
}

}  // namespace expage

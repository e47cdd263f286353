#include "expage/runtime/event_trace.hpp"
#include "expage/runtime/expert_runtime.hpp"

#include <fmt/format.h>

#include <ostream>

namespace expage {

runtime_layer_statistics& runtime_layer_statistics::operator+=(const runtime_layer_statistics& o) noexcept {
  acquires += o.acquires;
  hits += o.hits;
  misses += o.misses;
  bytes_loaded += o.bytes_loaded;
  evictions += o.evictions;
  prefetches += o.prefetches;
  prefetch_bytes += o.prefetch_bytes;
  prefetch_used += o.prefetch_used;
  prefetch_used_bytes += o.prefetch_used_bytes;
  prefetch_wasted += o.prefetch_wasted;
  prefetch_wasted_bytes += o.prefetch_wasted_bytes;
  load_waits += o.load_waits;
  load_wait_ns += o.load_wait_ns;
  fence_waits += o.fence_waits;
  fence_wait_ns += o.fence_wait_ns;
  return *this;
}

namespace {

void write_layer(std::ostream& out, const runtime_layer_statistics& s) {
  out << fmt::format(
      R"({{"acquires":{},"hits":{},"misses":{},"bytes_loaded":{},"evictions":{},"prefetches":{},)"
      R"("prefetch_bytes":{},"prefetch_used":{},"prefetch_used_bytes":{},"prefetch_wasted":{},)"
      R"("prefetch_wasted_bytes":{},"load_waits":{},"load_wait_ns":{},"fence_waits":{},"fence_wait_ns":{}}})",
      s.acquires, s.hits, s.misses, s.bytes_loaded, s.evictions, s.prefetches, s.prefetch_bytes, s.prefetch_used,
      s.prefetch_used_bytes, s.prefetch_wasted, s.prefetch_wasted_bytes, s.load_waits, s.load_wait_ns, s.fence_waits,
      s.fence_wait_ns);
}

}  // namespace

void runtime_statistics::write_json(std::ostream& out) const {
  out << "{\"tier\":";
  write_json_string(out, to_string(tier));
  out << fmt::format(
      R"(,"capacity":{},"resident":{},"pinned":{},"resident_bytes":{},"peak_resident_bytes":{},)"
      R"("prefetch_queued":{},"prefetch_cancelled":{},"failed_acquires":{},"poisoned":{},"trace_dropped":{},)"
      R"("hit_ratio":{:.6f},)",
      capacity, resident, pinned, resident_bytes, peak_resident_bytes, prefetch_queued, prefetch_cancelled,
      failed_acquires, poisoned, trace_dropped, hit_ratio());
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

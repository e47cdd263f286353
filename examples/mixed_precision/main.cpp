// mixed_precision: DynaExq's versioned expert residency on the host backend.
//
// Every expert of a small MoE model has a bf16 and an int4 version, pre-packed
// in host memory. All experts start resident in int4; a plain top-n policy
// (per layer, by routing counts over the last window) picks which experts
// should be bf16, and a transition_manager promotes and demotes them on a
// migration stream while a reader thread runs the "forward pass": for every
// token it opens a window, resolves each routed expert's handle and checks
// that the version it got is complete (its words match that expert's weights
// in that version's format) and calls the manager's step() after each token. The routing comes from the seeded
// synthetic generator with a workload shift halfway, so the hot set moves and the manager has to follow it.
//
//   mixed_precision            8 layers × 16 experts, 16 sequences × 64 tokens
//   mixed_precision --quick    4 sequences (used as a test)
#include <expage/expage.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <numeric>
#include <string_view>
#include <thread>
#include <vector>

namespace {

using namespace expage::literals;
using expage::expert_id;
using expage::expert_tensor;
using expage::precision;
using expage::residency_state;

constexpr std::uint32_t tokens_per_window = 16;
constexpr std::uint32_t hi_per_layer = 4;

std::uint64_t seed_of(const expage::moe_geometry& g, expert_id id, expert_tensor t, precision p) {
  return (g.flat_index(id) * expage::expert_tensor_count + static_cast<std::uint64_t>(t)) * 16 +
         static_cast<std::uint64_t>(p) + 1;
}

std::size_t round_up(std::uint64_t n) { return static_cast<std::size_t>((n + 4095) / 4096 * 4096); }

// What the reader hands the policy after each window of tokens.
struct window_report {
  std::vector<std::uint32_t> counts;  // routed tokens per expert (flat index)
  std::uint64_t hi_reads = 0, lo_reads = 0, absent = 0, bad_words = 0;
};

class report_queue {
 public:
  void push(window_report r) {
    {
      const std::lock_guard lock(mutex_);
      reports_.push_back(std::move(r));
    }
    cv_.notify_one();
  }
  void finish() {
    {
      const std::lock_guard lock(mutex_);
      done_ = true;
    }
    cv_.notify_one();
  }
  // The next report, or false once the reader finished and everything was taken.
  bool pop(window_report& out) {
    std::unique_lock lock(mutex_);
    cv_.wait(lock, [&] { return done_ || !reports_.empty(); });
    if (reports_.empty()) return false;
    out = std::move(reports_.front());
    reports_.pop_front();
    return true;
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<window_report> reports_;
  bool done_ = false;
};

// The "expert computation": reads every word of the version and checks it against its expert's weights.
std::uint64_t bad_words(const expage::moe_geometry& g, const expage::version_record& v) {
  std::uint64_t bad = 0;
  for (const expert_tensor t : {expert_tensor::gate_up, expert_tensor::down}) {
    bad += expage::count_pattern_mismatches(reinterpret_cast<const std::uint64_t*>(v.tensor(t)),
                                            g.tensor_bytes(t, v.format) / 8, seed_of(g, v.expert, t, v.format));
  }
  return bad;
}

int run(bool quick) {
  const expage::moe_geometry g(expage::moe_geometry::config{.name = "small-moe",
                                                            .layers = 8,
                                                            .experts_per_layer = 16,
                                                            .top_k = 2,
                                                            .hidden_size = 256,
                                                            .intermediate_size = 512,
                                                            .group_size = 64});
  const std::uint32_t sequences = quick ? 4 : 16;
  const expage::routing_trace trace = expage::generate_synthetic(g, {.seed = 11,
                                                                     .sequences = sequences,
                                                                     .decode_steps = 64,
                                                                     .locality = 0.5,
                                                                     .workloads = 2,
                                                                     .shift_every = sequences / 2});

  // The budget: room for hi_per_layer bf16 experts per layer, and every expert in int4.
  const std::size_t hi_block = round_up(g.expert_bytes(precision::bf16));
  const std::size_t lo_block = round_up(g.expert_bytes(precision::int4));
  expage::budget_tracker budget(1_GiB);
  auto& hi = budget.add_account("experts_hi", std::size_t{hi_per_layer} * g.layers() * hi_block);
  auto& lo = budget.add_account("experts_lo", g.expert_count() * lo_block);
  expage::block_pool hi_pool(expage::host_memory({.block_size = hi_block}), hi,
                             {.name = "hi", .max_blocks = hi_per_layer * g.layers() + 8});
  expage::block_pool lo_pool(expage::host_memory({.block_size = lo_block}), lo,
                             {.name = "lo", .max_blocks = g.expert_count() + 8});

  // Pre-packed versions of every expert in host memory (DynaExq: no repacking on promotion).
  expage::host_memory host({.block_size = 64_KiB, .alignment = 64_KiB});
  expage::tensor_storage<expage::host_stream> bf16_store(g, precision::bf16, host),
      int4_store(g, precision::int4, host);
  for (std::uint64_t flat = 0; flat < g.expert_count(); ++flat) {
    const expert_id id = g.expert_at(flat);
    for (const expert_tensor t : {expert_tensor::gate_up, expert_tensor::down}) {
      for (auto* store : {&bf16_store, &int4_store}) {
        expage::fill_pattern(reinterpret_cast<std::uint64_t*>(store->slot(id, t).data()), store->tensor_bytes(t) / 8,
                             seed_of(g, id, t, store->format()));
      }
    }
  }

  expage::handle_table table(g);
  expage::host_stream migration("migration");
  using manager_type = expage::transition_manager<expage::host_stream, expage::host_memory>;
  manager_type manager(table, migration, {.format = precision::bf16, .source = &bf16_store, .pool = &hi_pool},
                       {.format = precision::int4, .source = &int4_store, .pool = &lo_pool},
                       {.max_bytes_per_step = 4 * hi_block, .max_in_flight = 4});

  std::vector<manager_type::target> all_lo;
  for (std::uint64_t flat = 0; flat < g.expert_count(); ++flat) {
    all_lo.push_back({g.expert_at(flat), residency_state::resident_lo});
  }
  manager.set_targets(all_lo);
  manager.step();
  if (const std::size_t left = manager.drain(); left != 0) {  // the initial load, under the per-step cap
    fmt::print(stderr, "mixed_precision: {} initial loads still queued: the lo budget is too small\n", left);
    return 1;
  }
  fmt::print("{}: {} layers × {} experts, bf16 {} / int4 {} per expert; budget: {} bf16 per layer, all int4\n",
             g.name(), g.layers(), g.experts_per_layer(), expage::byte_size{g.expert_bytes(precision::bf16)},
             expage::byte_size{g.expert_bytes(precision::int4)}, hi_per_layer);
  fmt::print("trace: {} sequences × 64 tokens, hot set shifts after sequence {}; a window is {} tokens\n\n", sequences,
             sequences / 2, tokens_per_window);

  // The reader: the forward pass, resolving every routed expert through its handle.
  report_queue reports;
  std::thread reader([&] {
    window_report current{std::vector<std::uint32_t>(g.expert_count(), 0)};
    std::uint32_t tokens = 0;
    std::size_t i = 0;
    while (i < trace.size()) {
      auto window = table.open_window();  // one token's pass over every layer
      const expage::routing_event first = trace[i];
      for (; i < trace.size(); ++i) {
        const expage::routing_event e = trace[i];
        if (e.sequence != first.sequence || e.step != first.step) break;
        for (const std::uint32_t x : e.experts) {
          const expert_id id{e.layer, x};
          ++current.counts[g.flat_index(id)];
          const expage::version_record* v = table.resolve(id);
          if (v == nullptr) {
            ++current.absent;
            continue;
          }
          current.bad_words += bad_words(g, *v) + (v->expert != id);
          ++(v->format == precision::bf16 ? current.hi_reads : current.lo_reads);
        }
      }
      window.close();
      manager.step();  // the engine's once-per-step call: refills the migration byte allowance
      if (++tokens % tokens_per_window == 0) {
        reports.push(std::move(current));
        current = window_report{std::vector<std::uint32_t>(g.expert_count(), 0)};
      }
    }
    reports.finish();
  });

  // The policy: per layer, the hi_per_layer most routed experts of the last window go bf16.
  fmt::print("{:>6} {:>8} {:>9} {:>9} {:>9} {:>10} {:>8} {:>9}\n", "window", "bf16 hit", "bf16 now", "promote",
             "demote", "moved", "queued", "deferred");
  window_report r;
  std::uint64_t total_bad = 0, total_hi = 0, total_reads = 0, total_absent = 0;
  auto last = manager.statistics();
  int w = 0;
  std::vector<std::uint64_t> promoted_before(1, 0);
  while (reports.pop(r)) {
    total_bad += r.bad_words;
    total_absent += r.absent;  // every expert is resident at lo at least: a handle resolving to nothing is a bug
    total_hi += r.hi_reads;
    total_reads += r.hi_reads + r.lo_reads;
    // The plan is the whole bf16 set: every expert listed, hot ones bf16 and the others int4, so
    // set_targets() replaces whatever an earlier plan still has queued. (A plan of only the
    // experts whose observed state differs misses a promotion queued by the previous plan that
    // lands after the states were read: the expert stays bf16 cold, and the last plan's
    // promotions wait for that budget forever.) Listing an expert already there costs nothing.
    std::vector<manager_type::target> plan;
    std::size_t promote = 0, demote = 0;  // against the states observed now, for the table
    for (std::uint32_t l = 0; l < g.layers(); ++l) {
      std::vector<std::uint32_t> order(g.experts_per_layer());
      std::iota(order.begin(), order.end(), 0u);
      const auto count = [&](std::uint32_t e) { return r.counts[g.flat_index({l, e})]; };
      std::stable_sort(order.begin(), order.end(), [&](auto a, auto b) { return count(a) > count(b); });
      for (std::uint32_t rank = 0; rank < g.experts_per_layer(); ++rank) {
        const expert_id id{l, order[rank]};
        const bool hot = rank < hi_per_layer && count(order[rank]) > 0;
        const residency_state now = table.state(id);
        const bool bf16 = now == residency_state::resident_hi || now == residency_state::promoting;
        promote += hot && !bf16;
        demote += !hot && bf16;
        plan.push_back({id, hot ? residency_state::resident_hi : residency_state::resident_lo});
      }
    }
    // Demotions first: they free the bf16 budget the promotions need.
    std::stable_partition(plan.begin(), plan.end(),
                          [](const auto& t) { return t.state == residency_state::resident_lo; });
    manager.set_targets(plan);
    manager.step();
    const auto s = manager.statistics();
    const std::uint64_t reads = r.hi_reads + r.lo_reads;
    std::size_t resident_hi = 0;
    for (std::uint64_t flat = 0; flat < g.expert_count(); ++flat) {
      resident_hi += table.state(g.expert_at(flat)) == residency_state::resident_hi;
    }
    fmt::print("{:>6} {:>7.1f}% {:>9} {:>9} {:>9} {:>10} {:>8} {:>9}\n", ++w,
               reads == 0 ? 0.0 : 100.0 * static_cast<double>(r.hi_reads) / static_cast<double>(reads), resident_hi,
               promote, demote, expage::byte_size{s.bytes_moved - last.bytes_moved}, s.queued,
               s.deferred_budget - last.deferred_budget);
    last = s;
  }
  reader.join();
  const std::size_t left = manager.drain();  // the last plan; a plain wait_idle() loop would spin on a stuck one
  (void)table.collect();

  fmt::print("\nresident bf16 set:\n");
  for (std::uint32_t l = 0; l < g.layers(); ++l) {
    std::vector<std::uint32_t> hot;
    for (std::uint32_t e = 0; e < g.experts_per_layer(); ++e) {
      if (table.state({l, e}) == residency_state::resident_hi) hot.push_back(e);
    }
    fmt::print("  layer {}: {}\n", l, fmt::join(hot, " "));
  }
  const auto s = manager.statistics();
  fmt::print("\ntransitions: {} completed, {} cancelled by newer plans, {} waits for budget, {} failed; {} moved\n",
             s.completed, s.cancelled, s.deferred_budget, s.failed, expage::byte_size{s.bytes_moved});
  fmt::print("reads: {} expert reads through handles, {:.1f}% served by bf16, {} mismatching words, {} absent\n",
             total_reads,
             total_reads == 0 ? 0.0 : 100.0 * static_cast<double>(total_hi) / static_cast<double>(total_reads),
             total_bad, total_absent);
  fmt::print("budget: experts_hi {} of {}, experts_lo {} of {}; {} transitions of the last plan left waiting\n",
             expage::byte_size{hi.used()}, expage::byte_size{hi.capacity()}, expage::byte_size{lo.used()},
             expage::byte_size{lo.capacity()}, left);
  return total_bad == 0 && total_absent == 0 && total_reads > 0 && s.failed == 0 && left == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a(argv[i]);
    if (a == "--quick") {
      quick = true;
    } else if (a == "--help" || a == "-h") {
      std::fputs(
          "mixed_precision [--quick]\n"
          "  8 layers x 16 experts, 16 sequences x 64 tokens; --quick: 4 sequences (the CI test)\n",
          stdout);
      return expage::finish_standard_output("mixed_precision") ? 0 : 1;
    } else {
      fmt::print(stderr, "mixed_precision: unknown flag {} (expected --quick, --help)\n", a);
      return 2;
    }
  }
  int status = 0;
  try {
    status = run(quick);
  } catch (const std::exception& e) {  // the run failed (memory, a transition): not the command line
    fmt::print(stderr, "mixed_precision: {}\n", e.what());
    return 1;
  }
  return expage::finish_standard_output("mixed_precision") ? status : 1;
}

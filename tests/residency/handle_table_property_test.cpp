// Random operation sequences (fixed seeds) against a slow, obviously correct
// reference: plain containers behind one mutex, reclamation by "which windows
// were held when the version was switched away". After every operation the
// table and the model must agree on every expert's state, active version and
// number, on pins, on pending reclamations and on the budget in use.
#include "expage/residency/handle_table.hpp"

#include "residency/test_versions.hpp"

#include <gtest/gtest.h>

#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <vector>

namespace expage {
namespace {

using namespace expage::literals;
using rs = residency_state;

class reference_model {
 public:
  struct expert {
    rs state = rs::absent;
    rs from = rs::absent;
    bool in_flight = false;
    std::optional<std::uint64_t> active, pending;
    std::optional<std::size_t> pending_flag;  // index into flags; nullopt: ready
    std::uint64_t number = 0;
    int pins = 0;
  };
  struct window {
    bool open = true;  // the host has not closed it
    bool held = true;  // still protects versions and pins (open, or closed with an unset flag)
    std::optional<std::size_t> flag;
    std::vector<std::size_t> pins;
  };

  explicit reference_model(std::size_t experts) : experts_(experts) {}

  std::mutex mutex;  // the whole model is one critical section
  std::vector<expert> experts_;
  std::map<int, window> windows;
  std::vector<bool> flags;
  std::set<std::uint64_t> live;  // tags whose storage is alive
  std::vector<std::pair<std::uint64_t, std::set<int>>> retired;
  std::vector<std::pair<std::uint64_t, std::size_t>> discarded;

  [[nodiscard]] bool ready(std::optional<std::size_t> flag) const { return !flag || flags[*flag]; }

  [[nodiscard]] bool can_begin(std::size_t i, rs to) const {
    const expert& e = experts_[i];
    return !e.in_flight && testing::reference_begin_edges().contains({e.state, to}) &&
           !(to == rs::evicting && e.pins > 0);
  }
  void begin(std::size_t i, rs to) {
    experts_[i].from = experts_[i].state;
    experts_[i].state = to;
    experts_[i].in_flight = true;
  }
  [[nodiscard]] bool can_prepare(std::size_t i) const {
    const expert& e = experts_[i];
    return e.in_flight && e.state != rs::evicting && !e.pending;
  }
  void prepare(std::size_t i, std::uint64_t tag, std::optional<std::size_t> flag) {
    experts_[i].pending = tag;
    experts_[i].pending_flag = flag;
    live.insert(tag);
  }
  // 0: throws, 1: not ready, 2: published
  [[nodiscard]] int publish_outcome(std::size_t i) const {
    const expert& e = experts_[i];
    if (!e.in_flight || (e.state != rs::evicting && !e.pending)) return 0;
    return e.pending && !ready(e.pending_flag) ? 1 : 2;
  }
  void publish(std::size_t i) {
    expert& e = experts_[i];
    if (e.active) {
      std::set<int> held;
      for (const auto& [id, w] : windows) {
        if (w.held) held.insert(id);
      }
      retired.emplace_back(*e.active, held);
    }
    e.active = e.pending;
    e.pending.reset();
    e.state = target_of(e.state);
    e.in_flight = false;
    ++e.number;
    collect();
  }
  void abort(std::size_t i) {
    expert& e = experts_[i];
    if (e.pending) {
      if (ready(e.pending_flag)) {
        live.erase(*e.pending);
      } else {
        discarded.emplace_back(*e.pending, *e.pending_flag);
      }
    }
    e.pending.reset();
    e.state = e.from;
    e.in_flight = false;
  }
  void release(window& w) {
    w.held = false;
    for (const std::size_t i : w.pins) --experts_[i].pins;
    w.pins.clear();
  }
  void close(int id) {
    window& w = windows.at(id);
    w.open = false;
    if (ready(w.flag)) release(w);
  }
  void collect() {
    for (auto& [id, w] : windows) {
      if (!w.open && w.held && ready(w.flag)) release(w);
    }
    std::erase_if(retired, [&](const auto& r) {
      for (const int id : r.second) {
        if (windows.at(id).held) return false;
      }
      live.erase(r.first);
      return true;
    });
    std::erase_if(discarded, [&](const auto& d) {
      if (!flags[d.second]) return false;
      live.erase(d.first);
      return true;
    });
  }
  [[nodiscard]] std::size_t held_windows() const {
    std::size_t n = 0;
    for (const auto& [id, w] : windows) {
      if (w.held) ++n;
    }
    return n;
  }
};

void run_sequence(std::uint64_t seed, int operations) {
  constexpr std::size_t block = 256;
  const moe_geometry geometry = testing::tiny_geometry(2, 3);
  const std::size_t n = geometry.expert_count();
  budget_tracker budget(1_MiB);
  auto& account = budget.add_account("experts", 512_KiB);
  testing::small_pool pool(testing::heap_memory(block), account, {.name = "experts", .max_blocks = 2048});
  handle_table table(geometry, {.max_windows = 8});
  reference_model model(n);
  std::map<int, epoch_domain::window> windows;
  std::map<std::size_t, transition> guards;
  std::vector<completion_flag> flags;
  std::mt19937_64 rng(seed);
  std::uint64_t next_tag = 1;
  int next_window = 0;
  const auto pick = [&](std::size_t bound) { return static_cast<std::size_t>(rng() % bound); };
  const auto new_flag = [&]() -> std::optional<std::size_t> {
    if (rng() % 2 == 0) return std::nullopt;
    flags.emplace_back();
    model.flags.push_back(false);
    return flags.size() - 1;
  };
  const auto random_open_window = [&]() -> std::optional<int> {
    std::vector<int> open;
    for (const auto& [id, w] : model.windows) {
      if (w.open) open.push_back(id);
    }
    if (open.empty()) return std::nullopt;
    return open[pick(open.size())];
  };

  for (int step = 0; step < operations; ++step) {
    const std::lock_guard lock(model.mutex);
    const std::size_t i = pick(n);
    const expert_id id = geometry.expert_at(i);
    const int op = static_cast<int>(rng() % 10);
    SCOPED_TRACE(::testing::Message() << "seed " << seed << " step " << step << " op " << op << " expert " << i);
    switch (op) {
      case 0:
      case 1: {  // begin
        constexpr rs targets[] = {rs::promoting, rs::demoting, rs::evicting};
        const rs to = targets[pick(3)];
        const bool expected = model.can_begin(i, to);
        auto t = table.try_begin(id, to);
        ASSERT_EQ(t.has_value(), expected) << model.experts_[i].state << " -> " << to;
        if (t) {
          model.begin(i, to);
          guards[i] = std::move(*t);
        }
        break;
      }
      case 2:
      case 3: {  // prepare
        auto [record, storage] = testing::pooled_version(pool, next_tag);
        const auto flag = new_flag();
        const bool expected = model.can_prepare(i);
        any_completion done;
        if (flag) done = flags[*flag];
        try {
          table.prepare(id, record, std::move(storage), std::move(done));
          ASSERT_TRUE(expected);
          model.prepare(i, next_tag, flag);
        } catch (const invalid_argument&) {
          ASSERT_FALSE(expected);
          ASSERT_TRUE(storage);
        }
        ++next_tag;
        break;
      }
      case 4: {  // publish, by id or through the guard
        const int expected = model.publish_outcome(i);
        bool published = false;
        try {
          if (rng() % 2 == 0 && guards.contains(i)) {
            published = guards.at(i).publish_if_ready();
          } else {
            published = table.publish_if_ready(id);
          }
          ASSERT_NE(expected, 0);
        } catch (const invalid_argument&) {
          ASSERT_EQ(expected, 0);
          break;
        }
        ASSERT_EQ(published, expected == 2);
        if (published) model.publish(i);
        break;
      }
      case 5: {  // abort
        const bool expected = model.experts_[i].in_flight;
        if (expected && rng() % 2 == 0) {
          guards.at(i).abort();
        } else {
          try {
            table.abort(id);
            ASSERT_TRUE(expected);
          } catch (const transition_error&) {
            ASSERT_FALSE(expected);
            break;
          }
        }
        model.abort(i);
        break;
      }
      case 6: {  // open or close a window
        if (model.held_windows() < 6 && rng() % 2 == 0) {
          windows.emplace(next_window, table.open_window());
          model.windows.emplace(next_window, reference_model::window{});
          ++next_window;
        } else if (const auto w = random_open_window()) {
          if (const auto flag = new_flag()) {
            windows.at(*w).attach(flags[*flag]);
            model.windows.at(*w).flag = flag;
          }
          windows.erase(*w);
          model.close(*w);
        }
        break;
      }
      case 7: {  // a copy or a pass completes
        if (!flags.empty()) {
          const std::size_t f = pick(flags.size());
          flags[f].set();
          model.flags[f] = true;
        }
        break;
      }
      case 8: {  // pin
        if (const auto w = random_open_window()) {
          const version_record* v = table.pin(windows.at(*w), id);
          const auto& e = model.experts_[i];
          const bool expected = e.active && e.state != rs::evicting;
          ASSERT_EQ(v != nullptr, expected);
          if (v != nullptr) {
            ASSERT_EQ(testing::read_payload(*v), *e.active);
            model.windows.at(*w).pins.push_back(i);
            ++model.experts_[i].pins;
          }
        }
        break;
      }
      default:
        (void)table.collect();
        model.collect();
        break;
    }

    for (std::size_t j = 0; j < n; ++j) {
      const auto& e = model.experts_[j];
      const expert_id jd = geometry.expert_at(j);
      ASSERT_EQ(table.state(jd), e.state) << "expert " << j;
      const version_record* v = table.resolve(jd);
      ASSERT_EQ(v != nullptr, e.active.has_value()) << "expert " << j;
      if (v != nullptr) {
        ASSERT_EQ(testing::read_payload(*v), *e.active);
        ASSERT_EQ(v->number, e.number);
      }
      ASSERT_EQ(table.pinned(jd), e.pins > 0) << "expert " << j;
    }
    ASSERT_EQ(account.used(), model.live.size() * block);
    const auto s = table.statistics();
    ASSERT_EQ(s.pending, model.retired.size() + model.discarded.size());
  }
  // Drain: finish every pass and copy, close everything.
  guards.clear();
  windows.clear();
  for (auto& f : flags) f.set();
  (void)table.collect();
  EXPECT_EQ(table.statistics().pending, 0U);
}

TEST(HandleTableProperty, AgreesWithTheReferenceModelOnRandomSequences) {
  for (std::uint64_t seed = 1; seed <= 8; ++seed) {
    run_sequence(seed, 3000);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

}  // namespace
}  // namespace expage

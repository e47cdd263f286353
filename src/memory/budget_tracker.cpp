#include "expage/memory/budget_tracker.hpp"

#include "expage/core/error.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

namespace expage {
namespace {

// Builds the message only on failure: reserve() is a hot path.
void check_bytes(std::string_view account, std::size_t bytes) {
  if (bytes == 0 || bytes > max_bytes) [[unlikely]] {
    throw invalid_argument(fmt::format("reserve in budget account '{}': {} bytes out of range [1, {}]{}", account,
                                       bytes, max_bytes,
                                       bytes > max_bytes ? " (a negative size converted to size_t?)" : ""));
  }
}

void check_capacity(std::string_view account, std::size_t capacity) {
  if (capacity > max_bytes) {
    throw invalid_argument(
        fmt::format("budget account '{}': capacity {} out of range [0, {}]", account, capacity, max_bytes));
  }
}

void check_name(std::string_view name) {
  const bool ok = !name.empty() && name.size() <= 64 && std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '.' ||
           c == '-';
  });
  if (!ok) {
    throw invalid_argument(
        fmt::format("budget account name '{}' is invalid: 1 to 64 characters from [A-Za-z0-9_.-]", name));
  }
}

// The closest account that is an ancestor of (or equal to) both; nullptr when
// they belong to different trackers.
const budget_account* common_ancestor(const budget_account* a, const budget_account* b) noexcept {
  if (&a->tracker() != &b->tracker()) {
    return nullptr;
  }
  while (a->depth() > b->depth()) a = a->parent();
  while (b->depth() > a->depth()) b = b->parent();
  while (a != b) {
    a = a->parent();
    b = b->parent();
  }
  return a;
}

}  // namespace

// --- budget_account ------------------------------------------------------------------

budget_account::budget_account(budget_tracker& tracker, budget_account* parent, std::string name, std::size_t capacity)
    : available_(static_cast<std::int64_t>(capacity)),
      capacity_(static_cast<std::int64_t>(capacity)),
      tracker_(&tracker),
      parent_(parent),
      depth_(parent == nullptr ? 0 : parent->depth_ + 1),
      name_(std::move(name)) {}

std::size_t budget_account::headroom() const noexcept {
  std::size_t room = available();
  for (const budget_account* a = parent_; a != nullptr; a = a->parent_) {
    room = std::min(room, a->available());
  }
  return room;
}

reservation budget_account::reserve(std::size_t bytes) {
  check_bytes(name_, bytes);
  if (const budget_account* refuser = take_to_root(static_cast<std::int64_t>(bytes))) {
    failed_.fetch_add(1, std::memory_order_relaxed);
    const std::size_t free = refuser->available();
    const std::string where =
        refuser == this ? std::string("it has") : fmt::format("ancestor account '{}' has", refuser->name());
    throw out_of_budget(
        fmt::format("cannot reserve {} ({} bytes) in budget account '{}': {} {} free of {}", byte_size{bytes}, bytes,
                    name_, where, byte_size{free}, byte_size{refuser->capacity()}),
        bytes, free);
  }
  granted_.fetch_add(1, std::memory_order_relaxed);
  return reservation(this, bytes);
}

capacity_change budget_account::set_capacity(std::size_t bytes) {
  check_capacity(name_, bytes);
  const std::lock_guard lock(tracker_->mutex_);
  // Seqlock write (readers: used(), try_take()): odd version while capacity_
  // and available_ are being changed. The mutex makes this the only writer.
  // acq_rel: the odd version is ordered before the data stores below, which
  // are release so a reader that sees one of them also sees the odd version.
  const auto version = resize_version_.fetch_add(1, std::memory_order_acq_rel);
  struct end_resize {
    std::atomic<std::uint32_t>& v;
    std::uint32_t next;
    ~end_resize() { v.store(next, std::memory_order_release); }
  } const done{resize_version_, version + 2};
  const auto target = static_cast<std::int64_t>(bytes);
  const auto current = capacity_.load(std::memory_order_relaxed);
  if (target >= current) {
    // Raise the cap before the free bytes: used (capacity − available) never
    // reads above capacity.
    capacity_.store(target, std::memory_order_release);
    available_.fetch_add(target - current, std::memory_order_release);
    return {bytes, bytes, 0};
  }
  // Shrinking takes free bytes with the same compare-and-swap reservations
  // use, so the two can never both claim the same bytes.
  const std::int64_t want = current - target;
  auto avail = available_.load(std::memory_order_relaxed);
  std::int64_t take = 0;
  do {
    take = std::clamp<std::int64_t>(avail, 0, want);
  } while (take > 0 && !available_.compare_exchange_weak(avail, avail - take, std::memory_order_acq_rel,
                                                         std::memory_order_relaxed));
  capacity_.store(current - take, std::memory_order_release);
  return {bytes, static_cast<std::size_t>(current - take), static_cast<std::size_t>(want - take)};
}

account_statistics budget_account::statistics() const noexcept {
  account_statistics s;
  s.name = name_;
  s.parent = parent_ != nullptr ? std::string_view(parent_->name_) : std::string_view();
  s.depth = depth_;
  s.capacity = capacity();
  s.used = used();
  s.peak = static_cast<std::size_t>(std::max<std::int64_t>(peak_.load(std::memory_order_relaxed), 0));
  s.reservations = granted_.load(std::memory_order_relaxed);
  s.failed = failed_.load(std::memory_order_relaxed);
  return s;
}

// --- reservation ------------------------------------------------------------------------

void reservation::shrink(std::size_t bytes) {
  if (bytes > bytes_) {
    throw invalid_argument(fmt::format("reservation::shrink: {} bytes out of range [0, {}]", bytes, bytes_));
  }
  if (bytes == 0) {
    release();
    return;
  }
  account_->give_path(static_cast<std::int64_t>(bytes_ - bytes), nullptr);
  bytes_ = bytes;
}

bool reservation::try_grow(std::size_t extra) noexcept {
  if (account_ == nullptr || extra == 0 || extra > max_bytes - bytes_) {
    return false;
  }
  if (account_->take_to_root(static_cast<std::int64_t>(extra)) != nullptr) {
    account_->failed_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  bytes_ += extra;
  return true;
}

reservation reservation::split(std::size_t bytes) {
  if (bytes == 0 || bytes > bytes_) {
    throw invalid_argument(fmt::format("reservation::split: {} bytes out of range [1, {}]", bytes, bytes_));
  }
  bytes_ -= bytes;
  reservation part(account_, bytes);
  if (bytes_ == 0) {
    account_ = nullptr;
  }
  return part;
}

void reservation::merge(reservation&& other) {
  if (&other == this || !other) {
    return;
  }
  if (account_ == nullptr) {
    *this = std::move(other);
    return;
  }
  if (other.account_ != account_) {
    throw invalid_argument(fmt::format("reservation::merge: a reservation on account '{}' cannot absorb one on '{}'",
                                       account_->name(), other.account_->name()));
  }
  bytes_ += std::exchange(other.bytes_, 0);
  other.account_ = nullptr;
}

budget_account* reservation::transfer_path(budget_account& to) noexcept {
  if (account_ == nullptr) {
    return &to;
  }
  if (&to == account_) {
    return nullptr;
  }
  const budget_account* shared = common_ancestor(account_, &to);
  const auto bytes = static_cast<std::int64_t>(bytes_);
  if (budget_account* refuser = to.take_path(bytes, shared)) {
    to.failed_.fetch_add(1, std::memory_order_relaxed);
    return refuser;
  }
  account_->give_path(bytes, shared);
  to.granted_.fetch_add(1, std::memory_order_relaxed);
  account_ = &to;
  return nullptr;
}

void reservation::transfer(budget_account& to) {
  if (account_ == nullptr) {
    throw invalid_argument(fmt::format("reservation::transfer to '{}': the reservation is empty", to.name()));
  }
  if (const budget_account* refuser = transfer_path(to)) {
    const std::size_t free = refuser->available();
    throw out_of_budget(fmt::format("cannot transfer {} ({} bytes) from budget account '{}' to '{}': account '{}' has "
                                    "{} free of {}",
                                    byte_size{bytes_}, bytes_, account_->name(), to.name(), refuser->name(),
                                    byte_size{free}, byte_size{refuser->capacity()}),
                        bytes_, free);
  }
}

// --- budget_tracker ----------------------------------------------------------------------

budget_tracker::budget_tracker(std::size_t capacity, std::string root_name) {
  check_name(root_name);
  check_capacity(root_name, capacity);
  accounts_.push_back(
      std::unique_ptr<budget_account>(new budget_account(*this, nullptr, std::move(root_name), capacity)));
  root_ = accounts_.front().get();
}

budget_tracker::~budget_tracker() {
  for ([[maybe_unused]] const auto& account : accounts_) {
    EXPAGE_ASSERT(account->used() == 0, "budget_tracker destroyed while a reservation is outstanding");
  }
}

budget_account& budget_tracker::add_account(std::string name, std::size_t capacity, budget_account& parent) {
  check_name(name);
  check_capacity(name, capacity);
  if (&parent.tracker() != this) {
    throw invalid_argument(
        fmt::format("budget account '{}': parent '{}' belongs to another tracker", name, parent.name()));
  }
  const std::lock_guard lock(mutex_);
  for (const auto& a : accounts_) {
    if (a->name() == name) {
      throw invalid_argument(fmt::format("budget account '{}' already exists", name));
    }
  }
  accounts_.push_back(std::unique_ptr<budget_account>(new budget_account(*this, &parent, std::move(name), capacity)));
  return *accounts_.back();
}

budget_account* budget_tracker::find(std::string_view name) {
  const std::lock_guard lock(mutex_);
  for (const auto& a : accounts_) {
    if (a->name() == name) {
      return a.get();
    }
  }
  return nullptr;
}

budget_account& budget_tracker::at(std::string_view name) {
  if (budget_account* a = find(name)) {
    return *a;
  }
  std::vector<std::string_view> names;
  {
    const std::lock_guard lock(mutex_);
    for (const auto& a : accounts_) names.emplace_back(a->name());
  }
  throw invalid_argument(fmt::format("no budget account '{}': the accounts are {}", name, fmt::join(names, ", ")));
}

std::vector<account_statistics> budget_tracker::statistics() const {
  const std::lock_guard lock(mutex_);
  std::vector<account_statistics> out;
  out.reserve(accounts_.size());
  // Depth-first from the root; children in creation order. Accounts are
  // created after their parents, so one recursive walk over the flat list works.
  auto visit = [&](auto& self, const budget_account* node) -> void {
    out.push_back(node->statistics());
    for (const auto& a : accounts_) {
      if (a->parent() == node) {
        self(self, a.get());
      }
    }
  };
  visit(visit, accounts_.front().get());
  return out;
}

std::string budget_tracker::to_json() const {
  std::string json = "{\"accounts\":[";
  bool first = true;
  for (const auto& s : statistics()) {
    // Names are restricted to [A-Za-z0-9_.-]: nothing needs escaping.
    fmt::format_to(std::back_inserter(json),
                   "{}{{\"name\":\"{}\",\"parent\":{},\"capacity\":{},\"used\":{},\"peak\":{},\"reservations\":{},"
                   "\"failed\":{}}}",
                   first ? "" : ",", s.name, s.parent.empty() ? std::string("null") : fmt::format("\"{}\"", s.parent),
                   s.capacity, s.used, s.peak, s.reservations, s.failed);
    first = false;
  }
  json += "]}";
  return json;
}

}  // namespace expage

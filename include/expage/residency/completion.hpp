/// @file
/// @brief The completion concept (something that finishes: a copy, a forward pass), a host
/// flag that models it, and a type-erased holder.
#pragma once

#include <atomic>
#include <concepts>
#include <cstddef>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>

namespace expage {

/// @brief Something that finishes asynchronously: a copy on a migration
/// stream, a forward pass on a compute stream, a host thread's work.
///
/// Requirements on a model `C`:
/// - `c.ready()` (const, `noexcept`): true once the work is over; never blocks, never throws.
///   Work that failed is over: ready() returns true and wait() throws the failure, so code that
///   must know the work succeeded (handle_table::publish()) calls wait() even when ready.
/// - `c.wait()`: blocks until ready() would return true; throws if the work failed.
/// - completion must be monotonic: once ready() returned true it stays true.
/// - ready() returning true *synchronizes with* the completion of the work:
///   whatever the work wrote is visible to the thread that observed it.
///
/// Models: completion_flag (host), any_completion; a CUDA backend's event
/// wrapper models it with `cudaEventQuery() == cudaSuccess` and
/// `cudaEventSynchronize()` (DynaExq §3.4: "the worker records a completion
/// event on stream_mig; the expert entry remains in the promoting state until
/// this event is complete").
template <class C>
concept completion = std::move_constructible<C> && requires(const C& c, C& m) {
  { c.ready() } -> std::same_as<bool>;
  m.wait();
} && noexcept(std::declval<const C&>().ready());

/// @brief A host completion: a shared flag the producer sets once its work is done.
///
/// Copies share the flag, so the producer keeps one copy and hands another to
/// the consumer (handle_table::prepare(), epoch_domain::window::attach()).
/// set() is a release store and ready() an acquire load: everything the
/// producer wrote before set() is visible to whoever observes ready().
///
/// @code
/// expage::completion_flag copied;
/// table.prepare(id, record, std::move(storage), copied);
/// std::memcpy(dst, src, n);   // the copy, on any thread
/// copied.set();               // now publish() may switch
/// table.publish(id);
/// @endcode
/// @threadsafety thread-safe; set(), ready() and wait() are lock-free (wait() blocks on an atomic wait).
class completion_flag {
 public:
  /// A flag not yet set.
  /// @throws std::bad_alloc when the shared state cannot be allocated.
  completion_flag() : state_(std::make_shared<std::atomic<bool>>(false)) {}

  /// Marks the work complete and wakes waiters.
  void set() noexcept {
    state_->store(true, std::memory_order_release);  // pairs with the acquire in ready()/wait()
    state_->notify_all();
  }
  /// True once set() was called on any copy.
  [[nodiscard]] bool ready() const noexcept { return state_->load(std::memory_order_acquire); }
  /// Blocks until set() was called on any copy.
  void wait() const noexcept {
    while (!state_->load(std::memory_order_acquire)) {
      state_->wait(false, std::memory_order_acquire);
    }
  }

 private:
  std::shared_ptr<std::atomic<bool>> state_;
};

static_assert(completion<completion_flag>);

/// @brief A move-only holder for any completion; empty means "already complete".
///
/// Lets the handle table and the epoch domain keep completions of any type
/// (a host flag today, a CUDA event later) without templates on their
/// interfaces. A completion of up to 24 bytes that moves without throwing
/// (completion_flag, an event wrapper holding a shared_ptr) is kept inline,
/// without allocating; a larger one costs an allocation. An empty one costs nothing.
///
/// @code
/// expage::any_completion done = expage::completion_flag();   // or a cuda event wrapper
/// if (!done.ready()) done.wait();
/// @endcode
/// @threadsafety single-owner (ready() may be called concurrently if the held completion allows it).
class any_completion {
 public:
  /// An empty holder: ready() is true.
  any_completion() noexcept = default;
  /// Holds @p c.
  /// @throws std::bad_alloc when a completion too large to keep inline cannot be allocated.
  // The self-exclusion comes first: checking completion<any_completion> through this very
  // constructor would recurse (Clang rejects it).
  template <class C>
  requires(!std::same_as<std::remove_cvref_t<C>, any_completion> && completion<C>)
      any_completion(C c)  // NOLINT(google-explicit-constructor): implicit, so callers pass any completion
  {
    if constexpr (fits_inline<C>) {
      held_ = ::new (static_cast<void*>(buffer_)) model<C>(std::move(c));
      inline_ = true;
    } else {
      held_ = new model<C>(std::move(c));
    }
  }
  any_completion(const any_completion&) = delete;
  any_completion& operator=(const any_completion&) = delete;
  /// Takes over @p other's completion; @p other becomes empty.
  any_completion(any_completion&& other) noexcept { take(other); }
  /// Destroys the held completion, then takes over @p other's.
  any_completion& operator=(any_completion&& other) noexcept {
    if (this != &other) {
      reset();
      take(other);
    }
    return *this;
  }
  /// Destroys the held completion.
  ~any_completion() { reset(); }

  /// True when empty or when the held completion is ready.
  [[nodiscard]] bool ready() const noexcept { return held_ == nullptr || held_->ready(); }
  /// Returns at once when empty; otherwise waits for the held completion.
  void wait() {
    if (held_ != nullptr) held_->wait();
  }
  /// True when a completion is held.
  [[nodiscard]] bool has_value() const noexcept { return held_ != nullptr; }

 private:
  struct concept_base {
    concept_base() = default;
    concept_base(const concept_base&) = delete;
    concept_base& operator=(const concept_base&) = delete;
    concept_base(concept_base&&) = delete;
    concept_base& operator=(concept_base&&) = delete;
    virtual ~concept_base() = default;
    [[nodiscard]] virtual bool ready() const noexcept = 0;
    virtual void wait() = 0;
    // Move-constructs the held value into @p buffer (inline completions only).
    virtual concept_base* move_to(void* buffer) noexcept = 0;
  };
  template <class C>
  struct model final : concept_base {
    explicit model(C c) : value(std::move(c)) {}
    [[nodiscard]] bool ready() const noexcept override { return value.ready(); }
    void wait() override { value.wait(); }
    concept_base* move_to(void* buffer) noexcept override {
      if constexpr (std::is_nothrow_move_constructible_v<C>) {
        return ::new (buffer) model(std::move(value));
      } else {
        return nullptr;  // never called: such a completion lives on the heap
      }
    }
    C value;
  };
  static constexpr std::size_t buffer_bytes = 32;
  template <class C>
  static constexpr bool fits_inline =
      sizeof(model<C>) <= buffer_bytes &&
      alignof(model<C>) <= alignof(std::max_align_t) && std::is_nothrow_move_constructible_v<C>;

  void reset() noexcept {
    if (held_ == nullptr) return;
    if (inline_) {
      held_->~concept_base();
    } else {
      delete held_;
    }
    held_ = nullptr;
    inline_ = false;
  }
  void take(any_completion& other) noexcept {
    if (other.held_ == nullptr) return;
    if (other.inline_) {
      held_ = other.held_->move_to(buffer_);
      inline_ = true;
      other.reset();
    } else {
      held_ = std::exchange(other.held_, nullptr);
    }
  }

  alignas(std::max_align_t) std::byte buffer_[buffer_bytes];
  concept_base* held_ = nullptr;
  bool inline_ = false;  // held_ lives in buffer_
};

static_assert(completion<any_completion>);

}  // namespace expage

#include "expage/stream/host_stream.hpp"

#include <algorithm>
#include <cstring>
#include <utility>

namespace expage {

host_event::host_event() : state_(std::make_shared<state>()) {}

bool host_event::state::complete(std::uint64_t g) const {
  return !std::binary_search(pending.begin(), pending.end(), g);
}

bool host_event::query() const {
  const std::lock_guard lock(state_->mutex);
  return state_->complete(state_->recorded);
}

void host_event::synchronize() const {
  std::unique_lock lock(state_->mutex);
  const std::uint64_t target = state_->recorded;
  state_->completed_cv.wait(lock, [&] { return state_->complete(target); });
}

std::uint64_t host_event::records() const {
  const std::lock_guard lock(state_->mutex);
  return state_->count;
}

host_stream::host_stream(std::string name) : name_(std::move(name)) {
  thread_ = std::thread([this] { execute(); });
}

host_stream::~host_stream() {
  {
    const std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  work_cv_.notify_one();
  thread_.join();
}

void host_stream::submit(task t, std::uint64_t host_stream_statistics::*counter) {
  {
    const std::lock_guard lock(mutex_);
    queue_.push_back(std::move(t));  // the only step that can throw: nothing counted yet
    if (counter != nullptr) ++(stats_.*counter);
    ++submitted_;
  }
  work_cv_.notify_one();
}

void host_stream::copy(void* dst, const void* src, std::size_t bytes) {
  // memcpy's pointers must not be null even for 0 bytes; a copy of nothing from nowhere is valid
  // here, as it is for cudaMemcpyAsync.
  submit({[dst, src, bytes] {
            if (bytes != 0) std::memcpy(dst, src, bytes);
          },
          true, bytes});
}

void host_stream::enqueue(std::function<void()> work) { submit({std::move(work), true}); }

void host_stream::record(host_event& event) {
  std::shared_ptr<host_event::state> s = event.state_;
  std::uint64_t generation = 0;
  {
    // The generation is taken now, and pending from now: the executor completes it whenever
    // it runs. The record becomes the event's latest only once submitted (below): a record
    // that fails has no effect, as a failed cudaEventRecord, on what query(), synchronize()
    // and wait() refer to, whichever thread asks meanwhile.
    const std::lock_guard lock(s->mutex);
    generation = ++s->issued;  // generations only grow: pending stays ascending
    s->pending.push_back(generation);
  }
  const auto complete = [](host_event::state& st, std::uint64_t g) {
    const auto at = std::lower_bound(st.pending.begin(), st.pending.end(), g);
    if (at != st.pending.end() && *at == g) st.pending.erase(at);
  };
  try {
    submit({[s, generation, complete] {
              {
                const std::lock_guard lock(s->mutex);
                complete(*s, generation);
              }
              s->completed_cv.notify_all();
            },
            false},
           &host_stream_statistics::records);
  } catch (...) {
    // Not submitted (out of memory): a generation nothing will complete must not stay pending.
    // Its number is never handed out again. (Before, the rollback lowered the latest record
    // and a later record took this number: a wait() that took it meanwhile then waited for
    // that later work, a deadlock in a review's reproducer.)
    {
      const std::lock_guard lock(s->mutex);
      complete(*s, generation);
    }
    s->completed_cv.notify_all();
    throw;
  }
  // The latest from now on: a query() or a wait() issued after this call refers to this record
  // (or to a later one another thread made meanwhile).
  const std::lock_guard lock(s->mutex);
  s->recorded = std::max(s->recorded, generation);
  ++s->count;
}

void host_stream::wait(const host_event& event) {
  std::shared_ptr<host_event::state> s = event.state_;
  std::uint64_t generation = 0;
  {
    const std::lock_guard lock(s->mutex);
    generation = s->recorded;
  }
  if (generation == 0) {  // never recorded: complete, nothing to wait for
    const std::lock_guard lock(mutex_);
    ++stats_.event_waits;
    return;
  }
  submit({[s = std::move(s), generation] {
            std::unique_lock lock(s->mutex);
            s->completed_cv.wait(lock, [&] { return s->complete(generation); });
          },
          false},
         &host_stream_statistics::event_waits);
}

void host_stream::synchronize() {
  std::unique_lock lock(mutex_);
  ++stats_.stream_syncs;
  const std::uint64_t target = submitted_;
  idle_cv_.wait(lock, [&] { return finished_ >= target; });
  if (error_) std::rethrow_exception(error_);
}

void host_stream::check() const {
  const std::lock_guard lock(mutex_);
  if (error_) std::rethrow_exception(error_);
}

host_stream_statistics host_stream::statistics() const {
  const std::lock_guard lock(mutex_);
  return stats_;
}

void host_stream::execute() {
  std::unique_lock lock(mutex_);
  for (;;) {
    work_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, and everything submitted has run
    task t = std::move(queue_.front());
    queue_.pop_front();
    const bool skip = t.fallible && error_ != nullptr;
    lock.unlock();
    std::exception_ptr failure;
    if (!skip) {
      try {
        t.run();
      } catch (...) {
        failure = std::current_exception();
      }
    }
    t.run = nullptr;  // destroy captures outside the lock
    lock.lock();
    if (failure && !error_) error_ = failure;
    if (skip) ++stats_.skipped;
    if (t.copy_bytes && !skip && !failure) {  // counted here, under the lock execute() takes anyway
      ++stats_.copies;
      stats_.bytes_copied += *t.copy_bytes;
    }
    if (!skip) ++stats_.tasks;
    ++finished_;
    idle_cv_.notify_all();
  }
}

}  // namespace expage

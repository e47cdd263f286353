// A stream that fails as a CUDA stream does, for tests of code that must survive a device
// error: host_stream underneath, but a copy can fail on the stream (the call returns; the error
// comes later), and from then on every event recorded on it reports the error, query() and
// synchronize() throwing cuda_error as cuda_event's do after a sticky error, and every call on
// the stream throws it (host_event's never throw: code tested on host streams alone never meets
// this).
#pragma once

#include "expage/core/error.hpp"
#include "expage/stream/async_stream.hpp"
#include "expage/stream/host_stream.hpp"

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>

namespace expage::testing {

class sticky_event {
 public:
  [[nodiscard]] bool query() const {
    if (failed()) throw cuda_error(700, "sticky_event: an illegal memory access was encountered");
    return inner_.query();
  }
  void synchronize() const {
    inner_.synchronize();
    if (failed()) throw cuda_error(700, "sticky_event: an illegal memory access was encountered");
  }

 private:
  friend class cuda_like_stream;
  [[nodiscard]] bool failed() const { return failed_ != nullptr && failed_->load(); }
  host_event inner_;
  std::shared_ptr<const std::atomic<bool>> failed_;
};

class cuda_like_stream {
 public:
  using event_type = sticky_event;
  explicit cuda_like_stream(std::string name) : stream_(std::move(name)) {}
  std::optional<int> fail_copy_in;  // the Nth copy fails on the stream
  // Once the stream has failed, every call reports it, as the CUDA calls behind them do.
  void copy(void* dst, const void* src, std::size_t n) {
    throw_if_failed();
    if (fail_copy_in && --*fail_copy_in == 0) {
      stream_.enqueue([failed = failed_] { failed->store(true); });
      return;
    }
    stream_.copy(dst, src, n);
  }
  void record(sticky_event& e) {
    throw_if_failed();
    e.failed_ = failed_;
    stream_.record(e.inner_);
  }
  void wait(const sticky_event& e) {
    throw_if_failed();
    stream_.wait(e.inner_);
  }
  void enqueue(std::function<void()> f) {
    throw_if_failed();
    stream_.enqueue(std::move(f));
  }
  void synchronize() {
    stream_.synchronize();
    if (failed_->load()) throw cuda_error(700, "cuda_like_stream: an illegal memory access was encountered");
  }
  /// Waits until the stream has run what was submitted, whether or not it failed.
  void drain() {
    try {
      synchronize();
    } catch (const cuda_error&) {
    }
  }
  /// Whether a copy has failed on the stream.
  [[nodiscard]] bool failed() const { return failed_->load(); }

 private:
  void throw_if_failed() const {
    if (failed_->load()) throw cuda_error(700, "cuda_like_stream: an illegal memory access was encountered");
  }
  host_stream stream_;
  std::shared_ptr<std::atomic<bool>> failed_ = std::make_shared<std::atomic<bool>>(false);
};
static_assert(async_stream<cuda_like_stream>);

}  // namespace expage::testing

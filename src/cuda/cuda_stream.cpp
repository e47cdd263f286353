#include "expage/cuda/cuda_stream.hpp"

#include "expage/cuda/runtime.hpp"

#include <utility>

namespace expage::cuda {

cuda_event::cuda_event(int device) : device_(device) {
  const scoped_device on(device);
  EXPAGE_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
}

cuda_event::cuda_event(cuda_event&& other) noexcept
    : event_(std::exchange(other.event_, nullptr)), device_(std::exchange(other.device_, -1)) {}

cuda_event& cuda_event::operator=(cuda_event&& other) noexcept {
  if (this != &other) {
    if (event_ != nullptr) (void)cudaEventDestroy(event_);
    event_ = std::exchange(other.event_, nullptr);
    device_ = std::exchange(other.device_, -1);
  }
  return *this;
}

cuda_event::~cuda_event() {
  if (event_ != nullptr) (void)cudaEventDestroy(event_);
}

bool cuda_event::query() const {
  if (event_ == nullptr) return true;  // never recorded: complete
  const cudaError_t status = cudaEventQuery(event_);
  if (status == cudaErrorNotReady) {
    (void)cudaGetLastError();  // "not ready" is an answer, not an error
    return false;
  }
  EXPAGE_CUDA_CHECK(status);
  return true;
}

void cuda_event::synchronize() const {
  if (event_ != nullptr) EXPAGE_CUDA_CHECK(cudaEventSynchronize(event_));
}

cuda_stream::cuda_stream() {
  EXPAGE_CUDA_CHECK(cudaGetDevice(&device_));
  EXPAGE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
}

cuda_stream::cuda_stream(cuda_stream&& other) noexcept
    : stream_(std::exchange(other.stream_, nullptr)), device_(other.device_) {}

cuda_stream& cuda_stream::operator=(cuda_stream&& other) noexcept {
  if (this != &other) {
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
    stream_ = std::exchange(other.stream_, nullptr);
    device_ = other.device_;
  }
  return *this;
}

cuda_stream::~cuda_stream() {
  if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
}

void cuda_stream::copy(void* dst, const void* src, std::size_t bytes) {
  const scoped_device on(device_);
  EXPAGE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));
}

void cuda_stream::record(cuda_event& event) {
  const scoped_device on(device_);
  // An event is recorded on a stream of its own device (the CUDA Programming Guide, "Stream and
  // Event Behavior"); replacing one recorded elsewhere is safe while its record is pending.
  if (event.native() == nullptr || event.device() != device_) event = cuda_event(device_);
  EXPAGE_CUDA_CHECK(cudaEventRecord(event.native(), stream_));
}

void cuda_stream::wait(const cuda_event& event) {
  if (event.native() == nullptr) return;  // never recorded: complete
  const scoped_device on(device_);
  EXPAGE_CUDA_CHECK(cudaStreamWaitEvent(stream_, event.native(), 0));
}

void cuda_stream::synchronize() { EXPAGE_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

}  // namespace expage::cuda

/// @file
/// @brief expage's exception types.
///
/// Every exception expage throws derives from the matching std class, so an
/// engine that already catches `std::bad_alloc` or `std::invalid_argument` keeps
/// working. Messages name the offending value and its allowed range, e.g.
/// `expert 131 out of range [0, 128) in layer 7`.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <new>
#include <stdexcept>
#include <string>

namespace expage {

/// @brief The most cells a dense table sized by a model's geometry may have: 2^28 (1 GiB of 4-byte
/// cells, 2 GiB of doubles).
///
/// Tables quadratic in the experts per layer (realign_trace's co-occurrence counts,
/// coactivation_predictor's pair counts, next_turn_policy's transitions) check their size against
/// it before they allocate, and name it when they refuse: a geometry, or a trace's metadata line,
/// cannot make them ask for terabytes.
inline constexpr std::uint64_t max_dense_table_cells = std::uint64_t{1} << 28;

/// @brief @p factors multiplied, or UINT64_MAX when the product does not fit in 64 bits: the size
/// of a table, to compare with its bound before anything is allocated.
[[nodiscard]] constexpr std::uint64_t saturating_product(std::initializer_list<std::uint64_t> factors) noexcept {
  std::uint64_t p = 1;
  for (const std::uint64_t f : factors) {
    if (f != 0 && p > UINT64_MAX / f) return UINT64_MAX;
    p *= f;
  }
  return p;
}

/// @brief A caller passed a value outside its documented range (misuse, bad input).
/// @threadsafety thread-compatible.
class invalid_argument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// @brief Malformed external data: a routing trace, a compressed container, a config file.
/// @threadsafety thread-compatible.
class format_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// @brief A CUDA runtime or driver call failed.
///
/// @code
/// try { expage::cuda::check(cudaMalloc(&p, n), "cudaMalloc"); }
/// catch (const expage::cuda_error& e) { log(e.code(), e.what()); }
/// @endcode
/// @threadsafety thread-compatible.
class cuda_error : public std::runtime_error {
 public:
  /// @param code the `cudaError_t` or `CUresult` value, as an int.
  /// @param message what failed, with the error's name and description.
  cuda_error(int code, const std::string& message) : std::runtime_error(message), code_(code) {}

  /// The `cudaError_t` or `CUresult` value that was returned.
  [[nodiscard]] int code() const noexcept { return code_; }

 private:
  int code_;
};

/// @brief A budget account could not admit a reservation (a `std::bad_alloc`).
///
/// Thrown by the throwing twins of `try_reserve`; the message names the account
/// asked, the account whose cap refused, the request and the free bytes.
/// @threadsafety thread-compatible.
class out_of_budget : public std::bad_alloc {
 public:
  /// @param message the full explanation returned by what().
  /// @param requested the bytes that were asked for.
  /// @param available the bytes free in the limiting account at the time of the request.
  out_of_budget(const std::string& message, std::size_t requested, std::size_t available)
      : message_(message), requested_(requested), available_(available) {}

  /// The explanation: account, request and free bytes.
  [[nodiscard]] const char* what() const noexcept override { return message_.what(); }
  /// The bytes that were asked for.
  [[nodiscard]] std::size_t requested() const noexcept { return requested_; }
  /// The bytes the limiting account had free when the request failed.
  [[nodiscard]] std::size_t available() const noexcept { return available_; }

 private:
  std::runtime_error message_;  // a ref-counted string whose copy never throws
  std::size_t requested_;
  std::size_t available_;
};

/// @brief A physical-memory backend could not allocate (a `std::bad_alloc`).
///
/// Distinct from out_of_budget: the budget admitted the request, the backend
/// (mmap, cudaMalloc, cudaHostAlloc, a test double) then failed.
/// @threadsafety thread-compatible.
class out_of_memory : public std::bad_alloc {
 public:
  /// @param message the full explanation returned by what().
  explicit out_of_memory(const std::string& message) : message_(message) {}

  /// The explanation: backend, size and the system's reason.
  [[nodiscard]] const char* what() const noexcept override { return message_.what(); }

 private:
  std::runtime_error message_;
};

}  // namespace expage

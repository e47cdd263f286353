#include "expage/core/error.hpp"

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace {

// Engines catch the std types; each expage exception must be one of them.
static_assert(std::is_base_of_v<std::invalid_argument, expage::invalid_argument>);
static_assert(std::is_base_of_v<std::logic_error, expage::invalid_argument>);
static_assert(std::is_base_of_v<std::runtime_error, expage::format_error>);
static_assert(std::is_base_of_v<std::runtime_error, expage::cuda_error>);
static_assert(std::is_base_of_v<std::bad_alloc, expage::out_of_budget>);
static_assert(std::is_base_of_v<std::bad_alloc, expage::out_of_memory>);

// An exception whose copy can throw terminates the program when it is copied
// during unwinding (std::exception_ptr, rethrow): every copy must be noexcept.
static_assert(std::is_nothrow_copy_constructible_v<expage::invalid_argument>);
static_assert(std::is_nothrow_copy_constructible_v<expage::format_error>);
static_assert(std::is_nothrow_copy_constructible_v<expage::cuda_error>);
static_assert(std::is_nothrow_copy_constructible_v<expage::out_of_budget>);
static_assert(std::is_nothrow_copy_constructible_v<expage::out_of_memory>);
static_assert(std::is_nothrow_copy_assignable_v<expage::cuda_error>);
static_assert(std::is_nothrow_copy_assignable_v<expage::out_of_budget>);
static_assert(std::is_nothrow_copy_assignable_v<expage::out_of_memory>);

TEST(InvalidArgument, IsCaughtAsStdInvalidArgumentWithItsMessage) {
  try {
    throw expage::invalid_argument("expert 131 out of range [0, 128) in layer 7");
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "expert 131 out of range [0, 128) in layer 7");
    return;
  }
  FAIL() << "expage::invalid_argument was not caught as std::invalid_argument";
}

TEST(InvalidArgument, CopyPreservesTheMessage) {
  const expage::invalid_argument original(std::string("bad value 42"));
  const expage::invalid_argument copy(original);
  EXPECT_STREQ(copy.what(), "bad value 42");
  EXPECT_STREQ(original.what(), "bad value 42");
}

TEST(FormatError, IsCaughtAsStdRuntimeErrorWithItsMessage) {
  try {
    throw expage::format_error("trace header: bad magic 0xdeadbeef");
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "trace header: bad magic 0xdeadbeef");
    return;
  }
  FAIL() << "expage::format_error was not caught as std::runtime_error";
}

TEST(FormatError, CopyPreservesTheMessage) {
  const expage::format_error original("truncated block");
  expage::format_error copy(original);
  EXPECT_STREQ(copy.what(), "truncated block");
  copy = expage::format_error("other");
  EXPECT_STREQ(copy.what(), "other");
  EXPECT_STREQ(original.what(), "truncated block");
}

TEST(CudaError, CarriesCodeAndMessage) {
  const expage::cuda_error e(2, "cudaMalloc: cudaErrorMemoryAllocation: out of memory");
  EXPECT_EQ(e.code(), 2);
  EXPECT_STREQ(e.what(), "cudaMalloc: cudaErrorMemoryAllocation: out of memory");
}

TEST(CudaError, IsCaughtAsStdRuntimeErrorAndKeepsItsCode) {
  try {
    throw expage::cuda_error(700, "illegal address");
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "illegal address");
    const auto* cuda = dynamic_cast<const expage::cuda_error*>(&e);
    ASSERT_NE(cuda, nullptr);
    EXPECT_EQ(cuda->code(), 700);
    return;
  }
  FAIL() << "expage::cuda_error was not caught as std::runtime_error";
}

TEST(CudaError, CopyPreservesCodeAndMessage) {
  const expage::cuda_error original(-3, "negative codes are kept as is");
  const expage::cuda_error copy(original);
  EXPECT_EQ(copy.code(), -3);
  EXPECT_STREQ(copy.what(), "negative codes are kept as is");
}

TEST(OutOfBudget, IsCaughtAsStdBadAllocWithItsMessage) {
  try {
    throw expage::out_of_budget("account 'gpu0' refused 4096 bytes: 1024 free", 4096, 1024);
  } catch (const std::bad_alloc& e) {
    // std::bad_alloc's own what() is "std::bad_alloc"; the override must win.
    EXPECT_STREQ(e.what(), "account 'gpu0' refused 4096 bytes: 1024 free");
    return;
  }
  FAIL() << "expage::out_of_budget was not caught as std::bad_alloc";
}

TEST(OutOfBudget, ReportsRequestedAndAvailable) {
  const expage::out_of_budget e("refused", std::size_t{1} << 40, 17);
  EXPECT_EQ(e.requested(), std::size_t{1} << 40);
  EXPECT_EQ(e.available(), std::size_t{17});
}

TEST(OutOfBudget, CopyPreservesMessageAndAmounts) {
  const expage::out_of_budget original("account 'host' refused 10 bytes", 10, 3);
  expage::out_of_budget copy(original);
  EXPECT_STREQ(copy.what(), "account 'host' refused 10 bytes");
  EXPECT_EQ(copy.requested(), std::size_t{10});
  EXPECT_EQ(copy.available(), std::size_t{3});

  copy = expage::out_of_budget("second", 20, 0);
  EXPECT_STREQ(copy.what(), "second");
  EXPECT_EQ(copy.requested(), std::size_t{20});
  EXPECT_EQ(copy.available(), std::size_t{0});
  EXPECT_STREQ(original.what(), "account 'host' refused 10 bytes");
}

TEST(OutOfBudget, MessageOutlivesTheSourceString) {
  std::string message = "a message long enough to defeat the small-string optimisation";
  const expage::out_of_budget e(message, 1, 0);
  message.assign(message.size(), 'x');
  EXPECT_STREQ(e.what(), "a message long enough to defeat the small-string optimisation");
}

TEST(OutOfMemory, IsCaughtAsStdBadAllocWithItsMessage) {
  try {
    throw expage::out_of_memory("mmap of 2097152 bytes failed: Cannot allocate memory");
  } catch (const std::bad_alloc& e) {
    EXPECT_STREQ(e.what(), "mmap of 2097152 bytes failed: Cannot allocate memory");
    return;
  }
  FAIL() << "expage::out_of_memory was not caught as std::bad_alloc";
}

TEST(OutOfMemory, CopyPreservesTheMessage) {
  const expage::out_of_memory original("cudaMalloc failed");
  expage::out_of_memory copy(original);
  EXPECT_STREQ(copy.what(), "cudaMalloc failed");
  copy = expage::out_of_memory("cudaHostAlloc failed");
  EXPECT_STREQ(copy.what(), "cudaHostAlloc failed");
  EXPECT_STREQ(original.what(), "cudaMalloc failed");
}

TEST(OutOfMemory, IsNotAnOutOfBudget) {
  // Callers tell "the budget refused" from "the backend failed" by type.
  try {
    throw expage::out_of_memory("backend failed");
  } catch (const expage::out_of_budget&) {
    FAIL() << "out_of_memory was caught as out_of_budget";
  } catch (const expage::out_of_memory& e) {
    EXPECT_STREQ(e.what(), "backend failed");
  }
}

// A table's size, saturated instead of wrapped, so that a bound check cannot be passed by overflow.
TEST(SaturatingProduct, MultipliesOrSaturates) {
  static_assert(expage::saturating_product({}) == 1);
  static_assert(expage::saturating_product({3, 5, 7}) == 105);
  static_assert(expage::saturating_product({0, UINT64_MAX, UINT64_MAX}) == 0);
  static_assert(expage::saturating_product({UINT64_MAX, 0}) == 0);
  static_assert(expage::saturating_product({std::uint64_t{1} << 32, std::uint64_t{1} << 31}) == std::uint64_t{1} << 63);
  static_assert(expage::saturating_product({std::uint64_t{1} << 32, std::uint64_t{1} << 32}) == UINT64_MAX);
  static_assert(expage::saturating_product({4294967295U, 4294967295U, 4294967295U}) == UINT64_MAX);
  EXPECT_EQ(expage::saturating_product({65536, 4096, 4096}), std::uint64_t{1} << 40);
  EXPECT_EQ(expage::saturating_product({UINT64_MAX, 2}), UINT64_MAX);
}

}  // namespace

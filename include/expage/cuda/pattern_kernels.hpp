/// @file
/// @brief Device-side fill and check of the pattern in expage/core/pattern.hpp (target expage::kernels).
///
/// Used by the GPU tests of every device-memory mechanism (pools, paged
/// tensors, copies) to prove that the bytes behind an address are the ones
/// expected, and by engines to smoke-test a mapping.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace expage::cuda {

/// Writes pattern_word(seed, first + i) to the i-th 64-bit word of @p device_words.
/// Asynchronous on @p stream; launch errors are thrown as expage::cuda_error.
/// @throws expage::cuda_error
void fill_pattern_async(std::uint64_t* device_words, std::size_t words, std::uint64_t seed, std::uint64_t first,
                        cudaStream_t stream);

/// Adds to `*device_mismatches` (device memory) the number of words that
/// differ from the pattern. Asynchronous on @p stream.
/// @throws expage::cuda_error
void count_pattern_mismatches_async(const std::uint64_t* device_words, std::size_t words, std::uint64_t seed,
                                    std::uint64_t first, unsigned long long* device_mismatches, cudaStream_t stream);

}  // namespace expage::cuda

/// @file
/// @brief EXPAGE_SANITIZED: 1 in a build with AddressSanitizer or ThreadSanitizer (GCC or Clang), else 0,
/// unless the build defines it (the tests' CMake does, for every sanitizer build). Test it with
/// `#if EXPAGE_SANITIZED`, never `#if defined(...)`: it is always defined.
#pragma once

#if defined(EXPAGE_SANITIZED)
// Given by the build.
#elif defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define EXPAGE_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define EXPAGE_SANITIZED 1
#else
#define EXPAGE_SANITIZED 0
#endif
#else
#define EXPAGE_SANITIZED 0
#endif

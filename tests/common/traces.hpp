// Locating the real routing traces (read at run time, never copied into the
// repository): $EXPAGE_TRACES_DIR, else ../shared/traces beside the checkout.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <optional>

namespace expage::testing {

/// The traces directory, or nullopt when it is absent (tests then GTEST_SKIP).
inline std::optional<std::filesystem::path> traces_dir() {
  namespace fs = std::filesystem;
  if (const char* env = std::getenv("EXPAGE_TRACES_DIR"); env != nullptr && *env != '\0') {
    fs::path dir(env);
#ifdef EXPAGE_SOURCE_DIR
    // A relative path is taken from the checkout's root, as the CMake tests take it.
    if (dir.is_relative()) dir = fs::path(EXPAGE_SOURCE_DIR) / dir;
#endif
    if (fs::is_directory(dir)) return dir;
  }
#ifdef EXPAGE_SOURCE_DIR
  for (fs::path dir = EXPAGE_SOURCE_DIR; !dir.empty(); dir = dir.parent_path()) {
    if (fs::is_directory(dir / "shared" / "traces")) return dir / "shared" / "traces";
    if (fs::is_directory(dir / ".." / "shared" / "traces"))
      return fs::weakly_canonical(dir / ".." / "shared" / "traces");
    if (dir == dir.parent_path()) break;
  }
#endif
  return std::nullopt;
}

/// The real Mixtral-8x7B HumanEval routing trace, or nullopt.
inline std::optional<std::filesystem::path> mixtral_humaneval_trace() {
  const auto dir = traces_dir();
  if (!dir) return std::nullopt;
  const auto file = *dir / "mixtral8x7b-vllm-humaneval" / "humaneval_2_routing.jsonl";
  if (!std::filesystem::exists(file)) return std::nullopt;
  return file;
}

}  // namespace expage::testing

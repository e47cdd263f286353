#include "expage/core/geometry_io.hpp"

#include "expage/core/error.hpp"

#include <fmt/format.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <string>
#include <vector>

namespace expage {
namespace {

constexpr std::size_t max_geometry_file_bytes = std::size_t{64} << 10;

class flat_json {
 public:
  flat_json(std::string_view text, std::string_view source) : text_(text), source_(source) {}

  moe_geometry parse() {
    moe_geometry::config cfg;
    cfg.hidden_size = 1;
    cfg.intermediate_size = 1;
    bool has_name = false;
    skip_space();
    if (text_.starts_with("\xEF\xBB\xBF")) fail("the file starts with a UTF-8 byte-order mark; save it without one");
    expect('{');
    skip_space();
    if (peek() != '}') {
      for (;;) {
        skip_space();
        const std::string key = parse_string();
        skip_space();
        expect(':');
        skip_space();
        for (const std::string& s : seen_) {
          if (s == key) fail(fmt::format("field '{}' given twice", key));
        }
        seen_.push_back(key);
        if (key == "name") {
          cfg.name = parse_string();
          has_name = true;
        } else if (key == "comment") {
          (void)parse_string();
        } else if (key == "layers") {
          cfg.layers = narrow(key, parse_uint(key));
        } else if (key == "experts_per_layer") {
          cfg.experts_per_layer = narrow(key, parse_uint(key));
        } else if (key == "top_k") {
          cfg.top_k = narrow(key, parse_uint(key));
        } else if (key == "shared_experts") {
          cfg.shared_experts = narrow(key, parse_uint(key));
        } else if (key == "group_size") {
          cfg.group_size = narrow(key, parse_uint(key));
        } else if (key == "hidden_size") {
          cfg.hidden_size = parse_uint(key);
        } else if (key == "intermediate_size") {
          cfg.intermediate_size = parse_uint(key);
        } else if (key == "shared_intermediate_size") {
          cfg.shared_intermediate_size = parse_uint(key);
        } else {
          fail(
              fmt::format("unknown field '{}' (expected name, layers, experts_per_layer, top_k, shared_experts, "
                          "hidden_size, intermediate_size, shared_intermediate_size, group_size, comment)",
                          printable(key)));
        }
        skip_space();
        if (peek() == ',') {
          ++pos_;
          continue;
        }
        break;
      }
    }
    expect('}');
    skip_space();
    if (pos_ != text_.size()) fail("unexpected characters after the closing '}'");
    if (!has_name) fail("field 'name' missing");
    for (const char* required : {"layers", "experts_per_layer", "top_k"}) {
      bool found = false;
      for (const std::string& s : seen_) found = found || s == required;
      if (!found) fail(fmt::format("field '{}' missing", required));
    }
    return moe_geometry(std::move(cfg));
  }

 private:
  [[noreturn]] void fail(std::string_view message) const {
    throw format_error(fmt::format("{}: column {}: {}", source_, pos_ + 1, message));
  }
  static std::string printable(std::string_view s) {
    std::string out;
    for (const char c : s.substr(0, 40)) out += (static_cast<unsigned char>(c) >= 0x20 && c < 0x7f) ? c : '?';
    return out;
  }
  [[nodiscard]] char peek() const noexcept { return pos_ < text_.size() ? text_[pos_] : '\0'; }
  void skip_space() noexcept {
    while (pos_ < text_.size() &&
           (text_[pos_] == ' ' || text_[pos_] == '\t' || text_[pos_] == '\r' || text_[pos_] == '\n')) {
      ++pos_;
    }
  }
  void expect(char c) {
    if (pos_ >= text_.size()) fail(fmt::format("expected '{}' but the input ends", c));
    if (text_[pos_] != c) fail(fmt::format("expected '{}'", c));
    ++pos_;
  }
  std::string parse_string() {
    expect('"');
    std::string out;
    for (;;) {
      if (pos_ >= text_.size()) fail("unterminated string");
      const char c = text_[pos_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in a string");
      if (c == '\\') {
        if (pos_ >= text_.size()) fail("unterminated escape");
        const char e = text_[pos_++];
        if (e != '"' && e != '\\' && e != '/') fail("only the escapes \\\" \\\\ \\/ are accepted in a geometry file");
        out += e;
      } else {
        out += c;
      }
      if (out.size() > 256) fail("string longer than 256 bytes");
    }
  }
  std::uint64_t parse_uint(std::string_view key) {
    const std::size_t start = pos_;
    while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') ++pos_;
    const std::string_view token = text_.substr(start, pos_ - start);
    if (token.empty()) fail(fmt::format("field '{}': expected a non-negative integer", key));
    if (token.size() > 1 && token.front() == '0') fail(fmt::format("field '{}': '{}' has a leading zero", key, token));
    std::uint64_t v = 0;
    const auto [end, ec] = std::from_chars(token.data(), token.data() + token.size(), v);
    if (ec != std::errc() || end != token.data() + token.size()) {
      fail(fmt::format("field '{}': {} out of range [0, 18446744073709551615]", key, printable(token)));
    }
    if (pos_ < text_.size() && (text_[pos_] == '.' || text_[pos_] == 'e' || text_[pos_] == 'E')) {
      fail(fmt::format("field '{}': expected an integer", key));
    }
    return v;
  }
  std::uint32_t narrow(std::string_view key, std::uint64_t v) const {
    if (v > 0xFFFFFFFFULL) fail(fmt::format("field '{}': {} out of range [0, 4294967295]", key, v));
    return static_cast<std::uint32_t>(v);
  }

  std::string_view text_;
  std::string_view source_;
  std::size_t pos_ = 0;
  std::vector<std::string> seen_;
};

}  // namespace

moe_geometry parse_geometry_json(std::string_view text, std::string_view source) {
  return flat_json(text, source).parse();
}

moe_geometry read_geometry(const std::filesystem::path& path) {
  const std::string name = path.string();
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    throw format_error(fmt::format("{}: cannot open the geometry file: {}", name, std::strerror(err)));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw format_error(fmt::format("{}: a geometry file must be a regular file", name));
  }
  if (static_cast<std::uint64_t>(st.st_size) > max_geometry_file_bytes) {
    ::close(fd);
    throw format_error(fmt::format("{}: {} bytes out of range [0, {}] for a geometry file", name, st.st_size,
                                   max_geometry_file_bytes));
  }
  std::string text(static_cast<std::size_t>(st.st_size), '\0');
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t got = ::read(fd, text.data() + done, text.size() - done);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      const int err = errno;
      ::close(fd);
      throw format_error(fmt::format("{}: read error: {}", name, std::strerror(err)));
    }
    if (got == 0) break;
    done += static_cast<std::size_t>(got);
  }
  ::close(fd);
  text.resize(done);
  return parse_geometry_json(text, name);
}

moe_geometry geometry_from_argument(std::string_view name_or_path) {
  for (const std::string_view preset : moe_geometry::preset_names()) {
    if (preset == name_or_path) return moe_geometry::preset(name_or_path);
  }
  if (name_or_path.ends_with(".json") || name_or_path.find('/') != std::string_view::npos) {
    return read_geometry(std::filesystem::path(name_or_path));
  }
  return moe_geometry::preset(name_or_path);  // throws, listing the presets
}

}  // namespace expage

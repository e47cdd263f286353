// Internal: a small, strict JSON reader for expage's configuration files (hardware profiles).
//
// Reads a whole document into a tree of json_value nodes, each remembering the column it started
// at, so that a consumer can say "column 41: field 'gbytes_per_second': -3 out of range (0, inf)".
// Strict on purpose: no byte-order mark, no duplicate keys, no leading zeros, only the escapes
// \" \\ \/, strings of at most 256 bytes, nesting of at most 8 levels, nothing after the document.
// Numbers are kept as their text so the consumer decides integer or real and the range.
#pragma once

#include "expage/core/error.hpp"
#include "expage/detail/utf8.hpp"

#include <fmt/format.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace expage::detail {

struct json_member;

struct json_value {
  enum class kind : unsigned char { object, array, string, number, boolean, null };
  kind type = kind::null;
  std::size_t column = 0;            // 1-based column (byte offset + 1) where the value starts
  std::string text;                  // a string's contents, a number's token
  bool flag = false;                 // a boolean's value
  std::vector<json_member> members;  // an object's fields, in file order
  std::vector<json_value> items;     // an array's elements
};

/// One field of an object. A named struct rather than std::pair: a pair of an incomplete type cannot
/// be a vector's element while json_value is being defined (libc++ and clang reject it; GCC accepts).
struct json_member {
  std::string key;
  json_value value;
};

class json_reader {
 public:
  json_reader(std::string_view text, std::string_view source) : text_(text), source_(source) {}

  json_value parse() {
    if (text_.starts_with("\xEF\xBB\xBF")) fail("the file starts with a UTF-8 byte-order mark; save it without one");
    skip_space();
    json_value v = value(0);
    skip_space();
    if (pos_ != text_.size()) fail("unexpected characters after the document");
    return v;
  }

  /// Throws format_error "source: column C: message".
  [[noreturn]] void fail_at(std::size_t column, std::string_view message) const {
    throw format_error(fmt::format("{}: column {}: {}", source_, column, message));
  }

  /// A real number in [lo, hi] (or (lo, hi] when @p open_low), from a number node.
  double real(const json_value& v, std::string_view key, double lo, double hi, bool open_low = false) const {
    if (v.type != json_value::kind::number) fail_at(v.column, fmt::format("field '{}': expected a number", key));
    double d = 0.0;
    const auto [end, ec] = std::from_chars(v.text.data(), v.text.data() + v.text.size(), d);
    // A JSON number past a double's range: an exponent below zero or no integer digits but 0
    // means it is too small (1e-400), else too large. A tiny one lies inside the printed range,
    // so "out of range" would mislead.
    if (ec == std::errc::result_out_of_range && end == v.text.data() + v.text.size()) {
      const std::size_t e = v.text.find_first_of("eE");
      const bool tiny = (e != std::string::npos && e + 1 < v.text.size() && v.text[e + 1] == '-') ||
                        (e == std::string::npos && (v.text.starts_with("0.") || v.text.starts_with("-0.")));
      if (tiny && (open_low ? lo < 0.0 : lo <= 0.0) && hi >= 0.0) {  // else it is below the range, as said below
        fail_at(v.column, fmt::format("field '{}': {} is too small for a double (it would read as 0): give 0 "
                                      "or a value in {}{}, {}]",
                                      key, v.text, open_low ? "(" : "[", lo, hi));
      }
    }
    const bool in_range = open_low ? (d > lo && d <= hi) : (d >= lo && d <= hi);
    if (ec != std::errc() || end != v.text.data() + v.text.size() || !in_range) {
      fail_at(v.column,
              fmt::format("field '{}': {} out of range {}{}, {}]", key, v.text, open_low ? "(" : "[", lo, hi));
    }
    return d;
  }

  /// A non-negative integer in [0, @p hi], from a number node without sign, fraction or exponent.
  std::uint64_t integer(const json_value& v, std::string_view key, std::uint64_t hi) const {
    return integer(v, key, 0, hi);
  }
  /// A non-negative integer in [@p lo, @p hi], as integer(v, key, hi).
  std::uint64_t integer(const json_value& v, std::string_view key, std::uint64_t lo, std::uint64_t hi) const {
    if (v.type != json_value::kind::number) {
      constexpr std::string_view kinds[] = {"an object", "an array", "a string", "a number", "a boolean", "null"};
      fail_at(v.column, fmt::format("field '{}': {}, expected an integer in [{}, {}]", key,
                                    kinds[static_cast<std::size_t>(v.type)], lo, hi));
    }
    if (v.text.find_first_not_of("0123456789") != std::string::npos) {  // a sign, a fraction or an exponent
      fail_at(v.column, fmt::format("field '{}': {} is not an integer in [{}, {}]", key, v.text, lo, hi));
    }
    std::uint64_t n = 0;
    const auto [end, ec] = std::from_chars(v.text.data(), v.text.data() + v.text.size(), n);
    if (ec != std::errc() || end != v.text.data() + v.text.size() || n < lo || n > hi) {
      fail_at(v.column, fmt::format("field '{}': {} out of range [{}, {}]", key, v.text, lo, hi));
    }
    return n;
  }

  /// A string node's contents.
  const std::string& string(const json_value& v, std::string_view key) const {
    if (v.type != json_value::kind::string) fail_at(v.column, fmt::format("field '{}': expected a string", key));
    return v.text;
  }

 private:
  static constexpr std::size_t max_depth = 8;
  static constexpr std::size_t max_string = 256;

  [[noreturn]] void fail(std::string_view message) const { fail_at(pos_ + 1, message); }
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
  bool literal(std::string_view word) {
    if (text_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }

  json_value value(std::size_t depth) {
    json_value v;
    v.column = pos_ + 1;
    const char c = peek();
    // depth counts the objects and arrays around this value from 0: at most max_depth of them nest.
    if ((c == '{' || c == '[') && depth >= max_depth) fail(fmt::format("nesting deeper than {} levels", max_depth));
    if (c == '{') {
      v.type = json_value::kind::object;
      ++pos_;
      skip_space();
      if (peek() == '}') {
        ++pos_;
        return v;
      }
      for (;;) {
        skip_space();
        const std::size_t key_column = pos_ + 1;
        std::string key = string_token();
        for (const auto& [k, unused] : v.members) {
          if (k == key) fail_at(key_column, fmt::format("field '{}' given twice", key));
        }
        skip_space();
        expect(':');
        skip_space();
        json_value member = value(depth + 1);
        v.members.push_back(json_member{std::move(key), std::move(member)});
        skip_space();
        if (peek() == ',') {
          ++pos_;
          continue;
        }
        expect('}');
        return v;
      }
    }
    if (c == '[') {
      v.type = json_value::kind::array;
      ++pos_;
      skip_space();
      if (peek() == ']') {
        ++pos_;
        return v;
      }
      for (;;) {
        skip_space();
        v.items.push_back(value(depth + 1));
        skip_space();
        if (peek() == ',') {
          ++pos_;
          continue;
        }
        expect(']');
        return v;
      }
    }
    if (c == '"') {
      v.type = json_value::kind::string;
      v.text = string_token();
      return v;
    }
    if (literal("true")) {
      v.type = json_value::kind::boolean;
      v.flag = true;
      return v;
    }
    if (literal("false")) {
      v.type = json_value::kind::boolean;
      return v;
    }
    if (literal("null")) return v;
    if (c == '-' || (c >= '0' && c <= '9')) {
      v.type = json_value::kind::number;
      v.text = number_token();
      return v;
    }
    if (pos_ >= text_.size()) fail("expected a value but the input ends");
    fail("expected a value (object, array, string, number, true, false or null)");
  }

  std::string string_token() {
    expect('"');
    std::string out;
    for (;;) {
      if (pos_ >= text_.size()) fail("unterminated string");
      const char c = text_[pos_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in a string");
      if (static_cast<unsigned char>(c) >= 0x80) {  // a name is shown in JSON and SVG outputs: UTF-8 only
        const std::size_t length = utf8_sequence_length(text_, pos_ - 1);
        if (length == 0) {
          fail(fmt::format("byte 0x{:02x} in a string is not UTF-8",
                           static_cast<unsigned>(static_cast<unsigned char>(c))));
        }
        out.append(text_.substr(pos_ - 1, length));
        pos_ += length - 1;
      } else if (c == '\\') {
        if (pos_ >= text_.size()) fail("unterminated escape");
        const char e = text_[pos_++];
        if (e != '"' && e != '\\' && e != '/') fail("only the escapes \\\" \\\\ \\/ are accepted");
        out += e;
      } else {
        out += c;
      }
      if (out.size() > max_string) fail(fmt::format("string longer than {} bytes", max_string));
    }
  }

  std::string number_token() {  // JSON's grammar: -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
    const std::size_t start = pos_;
    const auto digits = [&] {
      const std::size_t from = pos_;
      while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') ++pos_;
      return pos_ - from;
    };
    if (peek() == '-') ++pos_;
    const std::size_t int_start = pos_;
    const std::size_t n = digits();
    if (n == 0) fail("expected digits");
    if (n > 1 && text_[int_start] == '0') fail("a number with a leading zero");
    if (peek() == '.') {
      ++pos_;
      if (digits() == 0) fail("expected digits after '.'");
    }
    if (peek() == 'e' || peek() == 'E') {
      ++pos_;
      if (peek() == '+' || peek() == '-') ++pos_;
      if (digits() == 0) fail("expected digits in the exponent");
    }
    if (pos_ - start > 64) fail("a number longer than 64 characters");
    return std::string(text_.substr(start, pos_ - start));
  }

  std::string_view text_;
  std::string_view source_;
  std::size_t pos_ = 0;
};

/// The most bytes a configuration file (a geometry, a hardware profile) may have.
inline constexpr std::size_t max_config_file_bytes = std::size_t{64} << 10;

/// Reads the whole configuration file @p path, which must be a regular file of at most
/// max_config_file_bytes (a FIFO, a device or a directory is refused before anything is read);
/// @p what names it in messages ("geometry file"). @throws format_error with the system's reason.
inline std::string read_config_file(const std::filesystem::path& path, std::string_view what) {
  const std::string name = path.string();
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    throw format_error(fmt::format("{}: cannot open the {}: {}", name, what, std::strerror(err)));
  }
  struct closer {
    int fd;
    ~closer() { ::close(fd); }
  } const close_on_exit{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    throw format_error(fmt::format("{}: a {} must be a regular file", name, what));
  }
  if (static_cast<std::uint64_t>(st.st_size) > max_config_file_bytes) {
    throw format_error(
        fmt::format("{}: {} bytes out of range [0, {}] for a {}", name, st.st_size, max_config_file_bytes, what));
  }
  std::string text(static_cast<std::size_t>(st.st_size), '\0');
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t got = ::read(fd, text.data() + done, text.size() - done);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      const int err = errno;
      throw format_error(fmt::format("{}: read error: {}", name, std::strerror(err)));
    }
    if (got == 0) break;
    done += static_cast<std::size_t>(got);
  }
  text.resize(done);
  return text;
}

}  // namespace expage::detail

// What every expage tool does with its outputs: check output paths before any work, write
// files atomically (temporary file, then rename: nothing is left half-written), and exit 0 only
// when standard output was completely written (`> /dev/full` fails). Errors carry strerror.
#pragma once

#include <expage/core/error.hpp>
#include <expage/core/file_output.hpp>
#include <expage/core/geometry_io.hpp>
#include <expage/core/json_string.hpp>
#include <expage/detail/utf8.hpp>

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <initializer_list>
#include <optional>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace expage_tools {

/// An output that cannot be written: exit status 1, like an unreadable input.
struct output_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Checks before any work that @p requested can be created or replaced where a write lands
/// (expage::check_output()). @return where the write lands. @throws output_error naming @p flag,
/// the path and the reason.
inline expage::output_location check_output_path(std::string_view flag, const std::filesystem::path& requested) {
  try {
    return expage::check_output(requested);
  } catch (const expage::invalid_argument& e) {
    throw output_error(requested.empty() ? fmt::format("{}: {}", flag, e.what())
                                         : fmt::format("{} {}", flag, e.what()));
  }
}

/// One output file of a tool: its flag and its path (none when the flag was not given).
struct output_file {
  std::string_view flag;
  const std::optional<std::string>& path;
};
/// One file a tool reads (a trace, a geometry or hardware JSON file): its flag and its path
/// (none when not given, or when the flag named a preset rather than a file).
struct input_file {
  std::string_view flag;
  std::optional<std::string> path;
};

/// True when @p path is standard output (expage::is_standard_output()).
using expage::is_standard_output;

/// The input_file of a flag that names a preset or a JSON file (`--geometry`, `--hardware`): a
/// file only when it names one (expage::names_config_file()); a preset reads nothing.
inline input_file config_input(std::string_view flag, const std::optional<std::string>& value) {
  return {flag, value && expage::names_config_file(*value) ? value : std::nullopt};
}

/// Refuses an output that lands on an input (`--trace t.bin --svg t.bin`, or through a link, or
/// `/dev/stdin` with the input redirected from it): the write would replace the file being read,
/// or append to it. @throws output_error naming both flags.
inline void check_not_an_input(std::string_view flag, const std::filesystem::path& requested,
                               const expage::output_location& where, std::initializer_list<input_file> inputs) {
  std::error_code kind_error;
  // A device replaces nothing; an open regular file written in place is appended to; a pipe that
  // is the input would be opened for writing after the reader has closed it, and wait forever.
  if (where.in_place && !std::filesystem::is_regular_file(requested, kind_error) &&
      !std::filesystem::is_fifo(requested, kind_error)) {
    return;
  }
  for (const input_file& in : inputs) {
    // Compared by device and inode (std::filesystem::equivalent() refuses two pipes).
    struct stat out {};
    struct stat input {};
    if (in.path && ::stat(where.target.c_str(), &out) == 0 && ::stat(in.path->c_str(), &input) == 0 &&
        out.st_dev == input.st_dev && out.st_ino == input.st_ino) {
      throw output_error(fmt::format("{} {} is the input {}{}{}: writing it would replace the file being read", flag,
                                     requested.string(), in.flag, in.flag.empty() ? "" : " ", *in.path));
    }
  }
}

/// check_output_path() for every file given, none of them one of @p inputs
/// (check_not_an_input()), and no two naming the same regular file (the one written last would
/// replace the other: `--json F --svg F`). A device named twice (/dev/null) is fine.
/// @throws output_error naming both flags.
inline void check_output_paths(std::initializer_list<output_file> files,
                               std::initializer_list<input_file> inputs = {}) {
  std::vector<std::optional<expage::output_location>> where;  // where each file checked so far lands
  for (const output_file& f : files) {
    where.emplace_back();
    if (!f.path) continue;
    where.back() = check_output_path(f.flag, *f.path);
    check_not_an_input(f.flag, *f.path, *where.back(), inputs);
    for (std::size_t j = 0; j + 1 < where.size(); ++j) {
      // Compared where the writes land: a dangling link and the file it will create are one file.
      if (where[j] && expage::same_output_file(*where[j], *where.back())) {
        const output_file& e = files.begin()[j];
        throw output_error(fmt::format("{} {} and {} {} name the same file: one would replace the other", e.flag,
                                       *e.path, f.flag, *f.path));
      }
    }
  }
}

/// @p text as a JSON string literal, quotes included (expage::write_json_string()'s escapes): for
/// every string a user can choose (a geometry's or a hardware profile's name) in a JSON output.
inline std::string json_string(std::string_view text) {
  std::ostringstream out;
  expage::write_json_string(out, text);
  return std::move(out).str();
}

/// @p text escaped for SVG (XML) character data and attribute values: & < > " '. XML 1.0 allows no
/// control character but tab, line feed and carriage return, nor U+FFFE or U+FFFF, and the file is
/// UTF-8: those and every byte that is not well-formed UTF-8 become U+FFFD.
inline std::string xml_text(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (std::size_t i = 0; i < text.size();) {
    const char c = text[i];
    const std::size_t length = expage::detail::utf8_sequence_length(text, i);
    if (length == 0 || (static_cast<unsigned char>(c) < 0x20 && c != '\t' && c != '\n' && c != '\r')) {
      out += "&#xFFFD;";
      ++i;
      continue;
    }
    if (length > 1) {
      // U+FFFE and U+FFFF are UTF-8 but not XML characters.
      const std::string_view sequence = text.substr(i, length);
      out += sequence == "\xef\xbf\xbe" || sequence == "\xef\xbf\xbf" ? std::string_view("&#xFFFD;") : sequence;
      i += length;
      continue;
    }
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default: out += c;
    }
    ++i;
  }
  return out;
}

/// Writes @p text to @p path whole or not at all (expage::write_file_atomically()).
/// @throws output_error with the system's reason.
inline void write_atomically(const std::filesystem::path& path, std::string_view text) {
  try {
    expage::write_file_atomically(
        path, [&](std::ostream& out) { out.write(text.data(), static_cast<std::streamsize>(text.size())); });
  } catch (const expage::invalid_argument& e) {
    throw output_error(e.what());
  }
}

/// Keeps a tool's tables and summaries out of an output file that is standard output
/// (expage::report_off_stdout over the files' paths): put_back() before writing the outputs
/// (write_all_atomically()).
class tables_off_stdout : public expage::report_off_stdout {
 public:
  explicit tables_off_stdout(std::initializer_list<output_file> files) : report_off_stdout(paths_of(files)) {}

 private:
  static std::vector<std::filesystem::path> paths_of(std::initializer_list<output_file> files) {
    std::vector<std::filesystem::path> out;
    for (const output_file& f : files) {
      if (f.path) out.emplace_back(*f.path);
    }
    return out;
  }
};

/// What a tool does with its outputs before any work: check_output_paths() over @p files and
/// @p inputs, then tables_off_stdout over the same files, returned for the tool to put_back()
/// before it writes them.
/// @throws output_error as check_output_paths() does.
[[nodiscard]] inline tables_off_stdout prepare_outputs(std::initializer_list<output_file> files,
                                                       std::initializer_list<input_file> inputs = {}) {
  check_output_paths(files, inputs);
  return tables_off_stdout(files);
}

/// One file a tool writes: where, and its whole text.
struct output_text {
  std::string path;
  std::string text;
};

/// Writes every file of @p outputs or none of them (expage::write_files_atomically()), after what
/// the tool printed so far (flushed first; a tool whose output is standard output has sent that to
/// standard error, tables_off_stdout).
/// @throws output_error with the system's reason.
inline void write_all_atomically(const std::vector<output_text>& outputs) {
  std::fflush(stdout);
  std::vector<expage::file_output> files;
  files.reserve(outputs.size());
  for (const output_text& o : outputs) {
    files.push_back(
        {o.path, [&o](std::ostream& out) { out.write(o.text.data(), static_cast<std::streamsize>(o.text.size())); }});
  }
  try {
    expage::write_files_atomically(files);
  } catch (const expage::invalid_argument& e) {
    throw output_error(e.what());
  }
}

}  // namespace expage_tools

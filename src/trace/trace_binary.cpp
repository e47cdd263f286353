#include "expage/trace/trace_io.hpp"

#include "expage/core/file_output.hpp"
#include "expage/detail/utf8.hpp"
#include "expage/format/crc32.hpp"
#include "record_check.hpp"
#include "trace_input.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <ostream>
#include <semaphore>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

namespace expage {
namespace {

using detail::fail;
using detail::source_position;
using detail::staged_record;

constexpr std::array<char, 8> binary_magic = {'E', 'X', 'P', 'G', 'T', 'R', 'C', '1'};
constexpr std::size_t header_size = 64;     // version 1
constexpr std::size_t header_size_v2 = 72;  // versions 2 and 3 (and 4 before its name): + sketch_dims, record_size
// Version 4: version 3's fields, then the model name padded with zeros to a multiple of 8 bytes,
// then the header checksum; name_bytes (at 52, version 3's reserved field) gives its length.
constexpr std::size_t name_offset = 64;
constexpr std::size_t max_header_size = header_size_v2 + max_binary_geometry_name;
constexpr std::uint32_t flag_probabilities = 1;
constexpr std::uint32_t flag_sketch = 2;  // from version 2
constexpr std::size_t record_fixed_bytes = 16;
// Version 3: each block of block_records records is followed by its CRC-32C. The reader holds
// one block, so a header may not ask for more than max_block_bytes of records per block (a
// record larger than that is a block of its own); the writer aims at written_block_bytes.
constexpr std::size_t block_checksum_bytes = 4;
constexpr std::uint64_t max_block_bytes = std::uint64_t{16} << 20;
constexpr std::uint64_t written_block_bytes = std::uint64_t{64} << 10;

std::uint64_t fnv1a(std::span<const std::byte> bytes, std::uint64_t h = 0xcbf29ce484222325ULL) noexcept {
  for (const std::byte b : bytes) {
    h ^= std::to_integer<std::uint64_t>(b);
    h *= 0x100000001b3ULL;
  }
  return h;
}

template <class T>
T load_le(std::span<const std::byte> bytes, std::size_t offset) noexcept {
  static_assert(std::is_unsigned_v<T>);
  T value = 0;
  for (std::size_t i = 0; i < sizeof(T); ++i) {
    value = static_cast<T>(value | static_cast<T>(std::to_integer<T>(bytes[offset + i]) << (8 * i)));
  }
  return value;
}

template <class T>
void store_le(std::string& out, T value) {
  static_assert(std::is_unsigned_v<T>);
  for (std::size_t i = 0; i < sizeof(T); ++i) out += static_cast<char>((std::uint64_t{value} >> (8 * i)) & 0xFFU);
}

float load_f32(std::span<const std::byte> bytes, std::size_t offset) noexcept {
  const std::uint32_t bits = load_le<std::uint32_t>(bytes, offset);
  float f = 0.0F;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

void store_f32(std::string& out, float f) {
  std::uint32_t bits = 0;
  std::memcpy(&bits, &f, sizeof f);
  store_le(out, bits);
}

template <class T>
void patch_le(std::string& out, std::size_t offset, T value) {
  for (std::size_t i = 0; i < sizeof(T); ++i)
    out[offset + i] = static_cast<char>((std::uint64_t{value} >> (8 * i)) & 0xFFU);
}

std::span<const std::byte> as_bytes(std::string_view s) noexcept {
  return std::as_bytes(std::span<const char>(s.data(), s.size()));
}

// The checksum of block @p index of a version 3 payload: the CRC-32C of the index (8 bytes,
// little-endian) followed by the block's records, so a block moved or repeated elsewhere in
// the file does not match.
std::uint32_t block_checksum(std::uint64_t index, std::span<const std::byte> records) noexcept {
  std::array<std::byte, 8> at{};
  for (std::size_t i = 0; i < at.size(); ++i) at[i] = static_cast<std::byte>((index >> (8 * i)) & 0xFFU);
  return crc32c(records, crc32c(at));
}

// Versions 2 to 4 have the header with the record size; their records carry their optional
// fields.
constexpr bool wide_header(std::uint16_t version) noexcept {
  return version == binary_trace_version_with_fields || version == binary_trace_version_blocked ||
         version == binary_trace_version_named;
}
// Versions 3 and 4 check their records in blocks, each followed by its CRC-32C.
constexpr bool blocked(std::uint16_t version) noexcept {
  return version == binary_trace_version_blocked || version == binary_trace_version_named;
}
// The header's size: 64 bytes (version 1), 72 (versions 2 and 3), 72 and the model name of
// @p name_bytes padded to a multiple of 8 (version 4).
constexpr std::size_t header_size_of(std::uint16_t version, std::uint64_t name_bytes) noexcept {
  if (version == binary_trace_version_named) return header_size_v2 + (name_bytes + 7) / 8 * 8;
  return wide_header(version) ? header_size_v2 : header_size;
}

}  // namespace

// Outside the anonymous namespace, as the reader's state that holds it (detail::binary_stream).
struct binary_header {
  std::uint16_t version = 1;
  std::size_t size = header_size;   // header bytes (header_size_of())
  std::uint32_t sketch_dims = 0;    // versions 2 to 4
  std::uint32_t record_size = 0;    // versions 2 to 4: as declared
  std::uint32_t block_records = 0;  // versions 3 and 4: records per checksummed block; 0 before
  std::uint32_t flags = 0;
  std::uint32_t batch_size = 0;
  std::uint64_t events = 0;
  std::uint64_t vectors = 0;
  std::uint64_t payload_sum = 0;  // versions 1 and 2: FNV-1a 64 of the whole payload
  trace_metadata meta;
};

namespace {

// Reads the header: 64 bytes, then the rest its version (and in version 4 its name_bytes, when
// in range) implies. Returns what was read (a short input yields a short span, which
// parse_header() refuses).
std::span<const std::byte> read_header_bytes(detail::byte_input& in, std::array<std::byte, max_header_size>& buffer) {
  std::size_t got = in.read_fully(reinterpret_cast<char*>(buffer.data()), header_size);
  if (got == header_size) {
    const auto version = load_le<std::uint16_t>(buffer, 8);
    const std::uint32_t name_bytes = load_le<std::uint32_t>(buffer, 52);
    const std::size_t size = header_size_of(version, name_bytes <= max_binary_geometry_name ? name_bytes : 0);
    got += in.read_fully(reinterpret_cast<char*>(buffer.data() + header_size), size - header_size);
  }
  return std::span<const std::byte>(buffer).first(got);
}

// Validates the header @p bytes (checksum, magic, version, flags, counts); the dimensions are
// returned in meta, not compared.
binary_header parse_header(std::span<const std::byte> bytes, std::string_view source) {
  const auto at = [&](std::uint64_t offset) { return source_position{source, offset, true}; };
  if (bytes.size() < header_size) {
    fail(at(bytes.size()), "header",
         fmt::format("file of {} bytes is shorter than the {}-byte header", bytes.size(), header_size));
  }
  if (std::memcmp(bytes.data(), binary_magic.data(), binary_magic.size()) != 0) {
    fail(at(0), "magic", "not an expage binary trace (expected \"EXPGTRC1\")");
  }
  binary_header h;
  h.version = load_le<std::uint16_t>(bytes, 8);
  if (h.version != binary_trace_version && !wide_header(h.version)) {
    fail(at(8), "version",
         fmt::format("version {} unsupported (this reader reads versions {} to {})", h.version, binary_trace_version,
                     binary_trace_version_named));
  }
  const bool v2 = wide_header(h.version);
  std::uint32_t name_bytes = 0;
  if (h.version == binary_trace_version_named) {
    name_bytes = load_le<std::uint32_t>(bytes, 52);
    if (name_bytes > max_binary_geometry_name) {
      fail(at(52), "name_bytes",
           fmt::format("{} out of range [0, {}] (max_binary_geometry_name)", name_bytes, max_binary_geometry_name));
    }
  }
  h.size = header_size_of(h.version, name_bytes);
  if (bytes.size() < h.size) {
    fail(
        at(bytes.size()), "header",
        fmt::format("file of {} bytes is shorter than the {}-byte version {} header", bytes.size(), h.size, h.version));
  }
  const auto declared_header = load_le<std::uint16_t>(bytes, 10);
  if (declared_header != h.size) {
    const std::string name =
        h.version == binary_trace_version_named ? fmt::format(" with a {}-byte model name", name_bytes) : "";
    fail(at(10), "header_size", fmt::format("{} where version {}{} has {}", declared_header, h.version, name, h.size));
  }
  const std::size_t sum_at = h.size - 8;  // the header checksum is the header's last 8 bytes
  const std::uint64_t header_sum = load_le<std::uint64_t>(bytes, sum_at);
  if (const std::uint64_t actual = fnv1a(bytes.first(sum_at)); actual != header_sum) {
    fail(at(sum_at), "header_checksum",
         fmt::format("{:#018x} does not match the header's {:#018x}", header_sum, actual));
  }
  h.flags = load_le<std::uint32_t>(bytes, 12);
  const std::uint32_t known_flags = v2 ? flag_probabilities | flag_sketch : flag_probabilities;
  if ((h.flags & ~known_flags) != 0) {
    fail(at(12), "flags", fmt::format("unknown flags {:#x} (version {} knows {:#x})", h.flags, h.version, known_flags));
  }
  h.meta.layers = load_le<std::uint32_t>(bytes, 16);
  h.meta.experts_per_layer = load_le<std::uint32_t>(bytes, 20);
  h.meta.top_k = load_le<std::uint32_t>(bytes, 24);
  // A geometry's ranges (moe_geometry), named here with the byte offset: a header that could not
  // describe a model is refused before a geometry is made of it.
  if (h.meta.layers == 0 || h.meta.layers > moe_geometry::max_layers) {
    fail(at(16), "layers", fmt::format("{} out of range [1, {}]", h.meta.layers, moe_geometry::max_layers));
  }
  if (h.meta.experts_per_layer == 0 || h.meta.experts_per_layer > moe_geometry::max_experts_per_layer) {
    fail(at(20), "experts_per_layer",
         fmt::format("{} out of range [1, {}]", h.meta.experts_per_layer, moe_geometry::max_experts_per_layer));
  }
  if (h.meta.top_k == 0 || h.meta.top_k > h.meta.experts_per_layer) {
    fail(at(24), "top_k",
         fmt::format("{} out of range [1, {}] (experts_per_layer)", h.meta.top_k, h.meta.experts_per_layer));
  }
  h.batch_size = load_le<std::uint32_t>(bytes, 28);
  h.meta.batch_size = h.batch_size;
  if (h.batch_size == 0) fail(at(28), "batch_size", "0 out of range [1, 4294967295]");
  h.events = load_le<std::uint64_t>(bytes, 32);
  h.vectors = load_le<std::uint64_t>(bytes, 40);
  if (blocked(h.version)) {
    h.block_records = load_le<std::uint32_t>(bytes, 48);  // its range depends on the record size: read_layout()
    if (const auto reserved = load_le<std::uint32_t>(bytes, 52);
        h.version == binary_trace_version_blocked && reserved != 0) {
      fail(at(52), "reserved", fmt::format("{} where 0 is required", reserved));
    }
  } else {
    h.payload_sum = load_le<std::uint64_t>(bytes, 48);
  }
  if (v2) {
    h.sketch_dims = load_le<std::uint32_t>(bytes, 56);
    h.record_size = load_le<std::uint32_t>(bytes, 60);
    if (h.sketch_dims > max_sketch_dims) {
      fail(at(56), "sketch_dims",
           fmt::format("{} out of range [0, {}] (max_sketch_dims)", h.sketch_dims, max_sketch_dims));
    }
    if (((h.flags & flag_sketch) != 0) != (h.sketch_dims > 0)) {
      fail(at(12), "flags",
           fmt::format("sketch flag {} contradicts sketch_dims {}", (h.flags & flag_sketch) >> 1U, h.sketch_dims));
    }
    h.meta.fields = trace_fields{.probabilities = (h.flags & flag_probabilities) != 0, .sketch_dims = h.sketch_dims};
  } else if (h.vectors > 0) {
    h.meta.fields = trace_fields{.probabilities = true, .sketch_dims = 0};
  }
  // Version 4: the model name as every writer records it (trace_model_name(): UTF-8 without a
  // control character), then zeros. Refused otherwise rather than repaired: what this reader
  // returns, its writer writes back byte for byte (a repaired name could outgrow the header).
  const std::string_view name(reinterpret_cast<const char*>(bytes.data() + name_offset), name_bytes);
  for (std::size_t i = 0; i < name.size();) {
    const auto c = static_cast<unsigned char>(name[i]);
    const std::size_t length = detail::utf8_sequence_length(name, i);
    if (length == 0) {
      fail(at(name_offset + i), "geometry",
           fmt::format("byte {:#04x} in the model name, which is not UTF-8 (a writer records it as U+FFFD)", c));
    }
    if (c < 0x20) {
      fail(at(name_offset + i), "geometry",
           fmt::format("byte {:#04x} in the model name, where a name has no control character", c));
    }
    i += length;
  }
  for (std::size_t i = name_offset + name_bytes; i + 8 < h.size; ++i) {
    if (bytes[i] != std::byte{0}) {
      fail(at(i), "geometry",
           fmt::format("padding byte {:#04x} after the model name, where 0 is required",
                       std::to_integer<unsigned>(bytes[i])));
    }
  }
  h.meta.geometry = name;
  return h;
}

}  // namespace

// Outside the anonymous namespace, as the reader's state that holds it (detail::binary_stream).
// A binary trace's header, checked against the geometry and the input's size, and what follows
// from it. Memory is allocated only after the counts were bounded by the bytes present.
struct binary_layout {
  binary_header h;
  std::uint64_t k = 0;             // top-k
  std::uint64_t record_bytes = 0;  // per record, with its optional fields in version 2
  std::uint64_t vector_bytes = 0;  // per probability vector
  trace_fields fields{};           // declared by the header
  std::uint64_t blocks = 0;        // version 3: checksummed blocks, ⌈events / block_records⌉
  std::uint64_t expected_size = 0;

  // The file offset of record @p i (version 3 counts the checksums of the blocks before it).
  [[nodiscard]] std::uint64_t record_offset(std::uint64_t i) const noexcept {
    return h.size + i * record_bytes + (h.block_records == 0 ? 0 : i / h.block_records * block_checksum_bytes);
  }
};

namespace {

binary_layout read_layout(detail::byte_input& in, const moe_geometry& geometry) {
  const std::string_view source = in.name();
  const auto at = [&](std::uint64_t offset) { return source_position{source, offset, true}; };
  std::array<std::byte, max_header_size> header_bytes{};
  binary_layout l;
  l.h = parse_header(read_header_bytes(in, header_bytes), source);
  const binary_header& h = l.h;
  const std::array<std::pair<std::string_view, std::uint32_t>, 3> dims = {
      {{"layers", geometry.layers()},
       {"experts_per_layer", geometry.experts_per_layer()},
       {"top_k", geometry.top_k()}}};
  const std::array<std::uint32_t, 3> recorded = {h.meta.layers, h.meta.experts_per_layer, h.meta.top_k};
  for (std::size_t i = 0; i < dims.size(); ++i) {
    if (recorded[i] != dims[i].second) {
      fail(at(16 + 4 * i), dims[i].first,
           fmt::format("{}{} but the geometry '{}' has {}: refusing a geometry mismatch", recorded[i],
                       h.meta.geometry.empty() ? std::string() : fmt::format(" ({})", h.meta.geometry), geometry.name(),
                       dims[i].second));
    }
  }
  const bool v2 = wide_header(h.version);
  l.k = geometry.top_k();
  l.vector_bytes = 4ULL * geometry.experts_per_layer();
  l.fields = h.meta.fields.value_or(trace_fields{});
  l.record_bytes = record_fixed_bytes + 6 * l.k;
  if (v2) l.record_bytes += (l.fields.probabilities ? l.vector_bytes : 0) + 4ULL * l.fields.sketch_dims;
  if (h.events == 0 || h.events > max_trace_events) {
    fail(at(32), "event_count",
         fmt::format("{} out of range [1, {}] (max_trace_events){}", h.events, max_trace_events,
                     h.events == 0 ? ": the trace has no records (an empty trace is refused)" : ""));
  }
  if (h.vectors > h.events) {
    fail(at(40), "probability_vectors",
         fmt::format("{} vectors out of range [0, {}] (the event count)", h.vectors, h.events));
  }
  if (((h.flags & flag_probabilities) != 0) != (h.vectors > 0)) {
    fail(
        at(12), "flags",
        fmt::format("probability flag {} contradicts {} probability vectors", h.flags & flag_probabilities, h.vectors));
  }
  // Every version (version 1's records each say has_probabilities, but the reader keeps all or
  // none; without this header check a v1 file declaring a few vectors for many events was sized
  // as all of them before its records were read: 52 GB for a 4.66 MB file).
  if (h.vectors != 0 && h.vectors != h.events) {
    fail(
        at(40), "probability_vectors",
        fmt::format("{} vectors for {} events: a trace has the field on every record or on none", h.vectors, h.events));
  }
  if (v2 && h.record_size != l.record_bytes) {
    fail(at(60), "record_size",
         fmt::format("{} where top_k = {}, experts_per_layer = {}, the probability flag and sketch_dims = {} imply {}",
                     h.record_size, l.k, geometry.experts_per_layer(), l.fields.sketch_dims, l.record_bytes));
  }
  if (blocked(h.version)) {
    const std::uint64_t most = std::max<std::uint64_t>(1, max_block_bytes / l.record_bytes);
    if (h.block_records == 0 || h.block_records > most) {
      fail(at(48), "block_records",
           fmt::format("{} out of range [1, {}] (a block holds at most {} bytes of {}-byte records, or one record)",
                       h.block_records, most, max_block_bytes, l.record_bytes));
    }
    l.blocks = h.events / h.block_records + (h.events % h.block_records != 0 ? 1 : 0);
  }
  // Version 1 keeps its vectors in a section after the records; versions 2 to 4 inside each
  // record; versions 3 and 4 add a checksum after each block.
  const std::uint64_t section_vectors = v2 ? 0 : h.vectors;
  l.expected_size =
      h.size + h.events * l.record_bytes + section_vectors * l.vector_bytes + l.blocks * block_checksum_bytes;
  if (const std::optional<std::uint64_t> size = in.known_size()) {
    const std::uint64_t payload = *size - h.size;
    // Bound the counts by the bytes present before anything is allocated.
    if (h.events > payload / l.record_bytes) {
      fail(at(32), "event_count",
           fmt::format("{} events of {} bytes do not fit in the {} payload bytes (truncated)", h.events, l.record_bytes,
                       payload));
    }
    if (section_vectors > (payload - h.events * l.record_bytes) / l.vector_bytes) {
      fail(at(40), "probability_vectors",
           fmt::format("{} vectors of {} bytes out of range for {} events and {} payload bytes", h.vectors,
                       l.vector_bytes, h.events, payload));
    }
    if (*size != l.expected_size) {
      fail(at(std::min<std::uint64_t>(*size, l.expected_size)), "payload",
           fmt::format("{} bytes where the header implies {} (truncated or trailing data)", *size, l.expected_size));
    }
  }
  return l;
}

// The fixed fields of the record at @p o of @p bytes (file offset @p offset), checked: phase in
// [0, 1], has_probabilities equal to @p vectors (the header's declaration: a trace has the field
// on every record or on none), reserved 0; into @p r (cleared first), experts and weights
// included. Returns whether a probability vector belongs to the record.
bool decode_record(std::span<const std::byte> bytes, std::size_t o, std::uint64_t offset, std::uint64_t k,
                   std::string_view source, bool vectors, staged_record& r) {
  const auto at = [&](std::uint64_t where) { return source_position{source, where, true}; };
  r.clear();
  r.has_experts = true;
  r.has_weights = true;
  r.sequence = load_le<std::uint32_t>(bytes, o);
  r.step = load_le<std::uint32_t>(bytes, o + 4);
  r.layer = load_le<std::uint32_t>(bytes, o + 8);
  const auto phase = load_le<std::uint8_t>(bytes, o + 12);
  if (phase > 1) fail(at(offset + 12), "phase", fmt::format("{} out of range [0, 1]", phase));
  r.phase = static_cast<routing_phase>(phase);
  const auto has_vector = load_le<std::uint8_t>(bytes, o + 13);
  if (has_vector > 1) fail(at(offset + 13), "has_probabilities", fmt::format("{} out of range [0, 1]", has_vector));
  if ((has_vector == 1) != vectors) {
    fail(at(offset + 13), "has_probabilities",
         fmt::format("{} where the header declares {} (a trace has the field on every record or on none)", has_vector,
                     vectors ? "a probability vector on every record" : "no probability vectors"));
  }
  if (const auto reserved = load_le<std::uint16_t>(bytes, o + 14); reserved != 0) {
    fail(at(offset + 14), "reserved", fmt::format("{} where 0 is required", reserved));
  }
  for (std::size_t j = 0; j < k; ++j) r.experts.push_back(load_le<std::uint16_t>(bytes, o + 16 + 2 * j));
  for (std::size_t j = 0; j < k; ++j) r.weights.push_back(load_f32(bytes, o + 16 + 2 * k + 4 * j));
  return has_vector == 1;
}

// The @p out.size() floats at @p o of @p bytes (a version 2 or 3 record's optional fields).
void decode_floats(std::span<const std::byte> bytes, std::size_t o, std::span<float> out) noexcept {
  for (std::size_t j = 0; j < out.size(); ++j) out[j] = load_f32(bytes, o + 4 * j);
}

// The plain records (no optional field delivered, has_probabilities 0) at @p bytes, decoded into
// @p events, @p experts and @p weights from their first element on, up to the first record this
// quick test cannot vouch for; returns how many were decoded. The test is a sufficient condition
// for what decode_record() and detail::check_record() accept (layer in range, phase 0 or 1, a
// prefill step below 2^32 - 1, has_probabilities and reserved 0, distinct experts in range,
// weights finite and ≥ 0, where a weight's sign bit must be clear: -0.0 is left to them); the
// record it stops at goes to them,
// which name the problem or accept it, so every rule and message keeps one owner.
// @p K is the top-k when known at compile time (the loops unroll), else 0 and @p k decides.
template <std::size_t K>
std::size_t decode_plain(std::span<const std::byte> bytes, std::size_t count, std::size_t k, std::uint32_t layers,
                         std::uint32_t experts_per_layer, routing_event* events, std::uint32_t* experts,
                         float* weights) noexcept {
  const std::size_t top_k = K != 0 ? K : k;
  const std::size_t record_bytes = record_fixed_bytes + 6 * top_k;
  for (std::size_t i = 0; i < count; ++i) {
    const std::size_t o = i * record_bytes;
    const auto layer = load_le<std::uint32_t>(bytes, o + 8);
    // phase (byte 12) in {0, 1}; has_probabilities (13) and reserved (14-15) 0.
    const auto phase_word = load_le<std::uint32_t>(bytes, o + 12);
    bool ok = layer < layers && (phase_word & ~std::uint32_t{1}) == 0;
    // A prefill step of 2^32 - 1 has no next step (check_record()): left to decode_checked().
    ok &= !(phase_word == 1 && load_le<std::uint32_t>(bytes, o + 4) == std::numeric_limits<std::uint32_t>::max());
    std::uint32_t* x = experts + i * top_k;
    float* w = weights + i * top_k;
    for (std::size_t j = 0; j < top_k; ++j) {
      x[j] = load_le<std::uint16_t>(bytes, o + 16 + 2 * j);
      ok &= x[j] < experts_per_layer;
      for (std::size_t m = 0; m < j; ++m) ok &= x[m] != x[j];
      const auto bits = load_le<std::uint32_t>(bytes, o + 16 + 2 * top_k + 4 * j);
      ok &= bits < 0x7F800000U;  // sign clear, exponent not all ones: finite and ≥ +0
      std::memcpy(&w[j], &bits, sizeof bits);
    }
    if (!ok) return i;
    // The optional fields' spans are left as they are: empty, since a plain trace's events are
    // value-initialised and only ever given empty ones (decode_checked() included).
    routing_event& e = events[i];
    e.sequence = load_le<std::uint32_t>(bytes, o);
    e.step = load_le<std::uint32_t>(bytes, o + 4);
    e.layer = layer;
    e.phase = static_cast<routing_phase>(std::to_integer<std::uint8_t>(bytes[o + 12]));
    e.experts = std::span<const std::uint32_t>(x, top_k);
    e.weights = std::span<const float>(w, top_k);
  }
  return count;
}

}  // namespace

// Hashes a version 1 or 2 payload on a second thread while the caller decodes it. FNV-1a is a
// serial chain (xor, then a 64-bit multiply, per byte: 1.1 ns a byte on an idle core of
// docs/performance.md, 3 ns under load), the largest single cost of reading such a trace, and
// decoding needs none of its result until the end. Chunks rotate through `depth` buffers (a few
// scheduler time slices of slack on a busy machine) and are hashed in submission order; the
// caller refills a buffer only after its hash completed (acquire()), and reads the sum only after
// finish(). Every hand-over goes through a semaphore (release/acquire), which orders the buffer's
// bytes, the queue entry and the running sum between the two threads.
class checksum_worker {
 public:
  static constexpr std::size_t depth = 4;  // buffers in flight

  explicit checksum_worker(std::uint64_t seed) : sum_(seed), thread_([this] { run(); }) {}
  checksum_worker(const checksum_worker&) = delete;
  checksum_worker& operator=(const checksum_worker&) = delete;
  ~checksum_worker() {
    (void)finish();
    stop_.store(true, std::memory_order_relaxed);  // published by the release below
    submitted_.release();
    thread_.join();
  }
  // Waits until buffer @p b (< depth) may be overwritten.
  void acquire(std::size_t b) { free_[b].acquire(); }
  // Queues @p bytes, which lie in buffer @p b; @pre acquire(b) since b's last submit().
  void submit(std::size_t b, std::span<const std::byte> bytes) {
    queue_[b] = bytes;
    submitted_.release();
  }
  // Waits for every queued hash; the sum of everything submitted.
  [[nodiscard]] std::uint64_t finish() {
    for (auto& f : free_) f.acquire();
    for (auto& f : free_) f.release();
    return sum_;
  }

 private:
  void run() {
    for (std::size_t k = 0;; k = (k + 1) % depth) {
      submitted_.acquire();
      if (stop_.load(std::memory_order_relaxed)) return;  // ordered by the acquire above
      sum_ = fnv1a(queue_[k], sum_);
      free_[k].release();
    }
  }
  std::uint64_t sum_;
  std::array<std::span<const std::byte>, depth> queue_{};
  std::array<std::binary_semaphore, depth> free_{std::binary_semaphore(1), std::binary_semaphore(1),
                                                 std::binary_semaphore(1), std::binary_semaphore(1)};
  std::counting_semaphore<depth> submitted_{0};
  std::atomic<bool> stop_{false};
  std::thread thread_;  // last: started once everything it reads exists
};

// Payloads from this size on are hashed by a checksum_worker (when there is a second core):
// below it a thread costs more than it saves. The same bound decides when a version 3 or 4
// stream is decoded ahead (decode_ahead).
constexpr std::uint64_t threaded_checksum_bytes = std::uint64_t{4} << 20;

// One chunk's events and the arrays their spans point into.
struct decoded_chunk {
  std::vector<routing_event> events;
  std::vector<std::uint32_t> experts;
  std::vector<float> weights;
  std::vector<float> probabilities;  // versions 2 to 4: delivered with the events
  std::vector<float> sketch;         // versions 2 to 4: delivered with the events
};

// Reads, checks and decodes a version 3 or 4 payload on a second thread, up to `depth` chunks
// ahead of the consumer. Reading the file, the blocks' CRC-32C and decoding the records are about
// a third of a streamed replay (docs/performance.md) and need nothing from the consumer; each
// chunk has its own decoded_chunk, so the producer fills the next while the consumer reads one.
// The producer runs the same code as a synchronous stream, chunk after chunk, in order; an
// exception it throws (a corrupt block, a bad record) is rethrown by next() in the chunk's place,
// after every chunk before it, and again by any later call. The chunks are large (about 1,300
// hand-overs for a 10 M-event trace), so a mutex and two condition variables order them: the
// producer writes a slot, then counts it under the mutex; the consumer reads it after seeing the
// count under the same mutex, and frees it the same way.
class decode_ahead {
 public:
  static constexpr std::size_t depth = 4;  // chunks in flight, the consumer's one included
  // Fills chunk slot @p slot (< depth) and returns its events; empty at the end.
  using producer = std::function<std::span<const routing_event>(std::size_t slot)>;

  // @throws std::system_error when no thread can be started.
  explicit decode_ahead(producer produce) : produce_(std::move(produce)), thread_([this] { run(); }) {}
  decode_ahead(const decode_ahead&) = delete;
  decode_ahead& operator=(const decode_ahead&) = delete;
  ~decode_ahead() {
    {
      const std::lock_guard lock(mutex_);
      stop_ = true;
    }
    freed_cv_.notify_one();
    thread_.join();
  }

  // The next chunk, in the producer's order; the previous one's slot may be refilled from here on.
  // @throws what the producer threw for this chunk (and for every call after it).
  std::span<const routing_event> next() {
    if (error_) std::rethrow_exception(error_);
    if (ended_) return {};
    {
      std::unique_lock lock(mutex_);
      if (holding_) {
        ++freed_;
        holding_ = false;
        freed_cv_.notify_one();
      }
      made_cv_.wait(lock, [&] { return made_ > taken_; });
    }
    const std::size_t k = taken_++ % depth;
    if (errors_[k]) {
      error_ = errors_[k];
      std::rethrow_exception(error_);
    }
    ended_ = chunks_[k].empty();
    holding_ = !ended_;
    return chunks_[k];
  }

 private:
  void run() {
    for (std::size_t k = 0;; k = (k + 1) % depth) {
      {
        std::unique_lock lock(mutex_);
        freed_cv_.wait(lock, [&] { return stop_ || made_ - freed_ < depth; });
        if (stop_) return;
      }
      bool end = false;
      try {
        chunks_[k] = produce_(k);
        end = chunks_[k].empty();
      } catch (...) {
        errors_[k] = std::current_exception();
        end = true;
      }
      {
        const std::lock_guard lock(mutex_);
        ++made_;
      }
      made_cv_.notify_one();
      if (end) return;
    }
  }

  producer produce_;
  std::array<std::span<const routing_event>, depth> chunks_{};  // written by the producer only
  std::array<std::exception_ptr, depth> errors_{};              // written by the producer only
  std::mutex mutex_;
  std::condition_variable made_cv_;   // made_ rose
  std::condition_variable freed_cv_;  // freed_ rose, or stop_
  std::size_t made_ = 0;              // chunks produced (under mutex_)
  std::size_t freed_ = 0;             // chunks the consumer is done with (under mutex_)
  bool stop_ = false;                 // under mutex_
  // The consumer's own.
  std::size_t taken_ = 0;
  bool holding_ = false;  // the consumer holds the chunk it was last given
  bool ended_ = false;
  std::exception_ptr error_;
  std::thread thread_;  // last: started once everything it reads exists
};

// Versions 3 and 4 read about this many bytes of blocks at a time (at least one block) and deliver
// at most this many events per chunk when decoding on the caller's thread (they stay in its
// first-level cache until read), and these when decoding ahead (about 1,300 hand-overs for 10 M
// events; the events cross to the other core's caches either way): 0.5 MiB of blocks and four
// chunks of at most 8,192 events or about 1 MiB of decoded events and fields in flight.
constexpr std::size_t blocked_read_bytes = std::size_t{1} << 16;
constexpr std::size_t blocked_chunk_events = 512;
constexpr std::size_t ahead_read_bytes = std::size_t{1} << 19;
constexpr std::size_t ahead_chunk_events = 8192;
constexpr std::size_t ahead_chunk_bytes = std::size_t{1} << 20;

// The streaming reader's state: the input, the header, the running checksum and the chunks' arrays.
namespace detail {
struct binary_stream {
  std::unique_ptr<detail::byte_input> owned;
  detail::byte_input* in = nullptr;
  binary_layout layout;
  std::uint32_t batch_size = 1;
  std::uint32_t experts_per_layer = 0;
  std::uint64_t sum = 0xcbf29ce484222325ULL;
  std::uint64_t delivered = 0;     // records delivered so far
  std::uint64_t vectors_seen = 0;  // records whose has_probabilities is 1
  bool finished = false;
  std::vector<std::byte> chunk;
  std::size_t buffered = 0;          // versions 3 and 4: records in `chunk` not yet delivered
  std::uint64_t buffer_first = 0;    // versions 3 and 4: the index of the first record in `chunk`
  std::size_t buffered_records = 0;  // versions 3 and 4: the records `chunk` was read for
  std::size_t chunk_bytes_read = 0;  // versions 3 and 4: the bytes of `chunk` the input had
  std::exception_ptr read_error;     // versions 3 and 4: the read that failed after chunk_bytes_read
  std::size_t checked_blocks = 0;    // versions 3 and 4: `chunk`'s blocks checked (check_block())
  std::size_t good = 0;              // the chunk's events decoded before the one being decoded
  std::exception_ptr pending;        // the error after a partly delivered chunk
  // The buffers the worker hashes are declared before it, so it is joined (destroyed) first.
  std::array<std::vector<std::byte>, checksum_worker::depth> buffers;
  std::optional<checksum_worker> worker;  // hashes the records while they are decoded (large traces)
  std::size_t buffer = 0;                 // the buffer the next chunk goes to
  // The chunks' arrays: one per chunk decode_ahead may hold in flight; slots[0] otherwise.
  std::array<decoded_chunk, decode_ahead::depth> slots;
  decoded_chunk* cur = slots.data();                // the chunk being decoded
  std::size_t chunk_events = blocked_chunk_events;  // versions 3 and 4: most events per chunk
  std::size_t read_bytes = blocked_read_bytes;      // versions 3 and 4: bytes of blocks per read
  std::exception_ptr failed;                        // what next() threw, thrown again
  staged_record r;

  binary_stream(std::unique_ptr<detail::byte_input> input, detail::byte_input& i, const moe_geometry& geometry,
                const trace_read_options& options)
      : owned(std::move(input)), in(&i), layout(read_layout(i, geometry)) {
    batch_size = options.batch_size != 0 ? options.batch_size : layout.h.batch_size;
    layers = geometry.layers();
    experts_per_layer = geometry.experts_per_layer();
    top_k = geometry.top_k();
    const bool helper = options.read_ahead && layout.h.events * layout.record_bytes >= threaded_checksum_bytes &&
                        std::thread::hardware_concurrency() > 1;
    // Versions 3 and 4 are decoded ahead instead (from the first next()), checksums included; not
    // from a pipe, read as it comes: a thread blocked on it would hold up the destructor.
    may_read_ahead = helper && blocked(layout.h.version) && i.known_size();
    if (!blocked(layout.h.version) && helper) {
      try {
        worker.emplace(sum);
      } catch (const std::system_error&) {  // no thread to be had: hash on this one
      }
    }
  }

  // Takes the running sum back from the worker: from here on this thread hashes.
  void join_checksum() {
    if (worker) {
      sum = worker->finish();
      worker.reset();
    }
  }
  // Reads the next @p n record bytes (versions 1 and 2): into a buffer hashed by the worker, or
  // hashed here. Fewer when the input ends or a read fails: the bytes read (hashed too), with the
  // truncation or the read's error in @p short_read, so that the records before it are delivered
  // whatever the size of the reads (read_ahead's are larger).
  std::span<const std::byte> read_records(std::size_t n, std::exception_ptr& short_read) {
    std::byte* out = nullptr;
    std::size_t got = 0;
    if (!worker) {
      chunk.resize(n);
      out = chunk.data();
      got = in->read_fully(reinterpret_cast<char*>(out), n, short_read);
      sum = fnv1a(std::span<const std::byte>(out, got), sum);
    } else {
      const std::size_t b = buffer;
      buffer = (buffer + 1) % checksum_worker::depth;
      worker->acquire(b);
      try {  // a read error is kept in short_read; anything else (a bad_alloc) gets here
        buffers[b].resize(n);
        out = buffers[b].data();
        got = in->read_fully(reinterpret_cast<char*>(out), n, short_read);
      } catch (...) {
        worker->submit(b, {});  // hand the buffer back: finish() and the destructor wait for every one
        throw;
      }
      worker->submit(b, std::span<const std::byte>(out, got));
    }
    if (got != n && !short_read) short_read = truncated();
    return {out, got};
  }
  // The input ended before the size the header implies: the error, named where it ended.
  [[noreturn]] void fail_truncated() const {
    fail(at(in->offset()), "payload",
         fmt::format("input ends at byte {} where the header implies {} bytes (truncated)", in->offset(),
                     layout.expected_size));
  }
  [[nodiscard]] std::exception_ptr truncated() const {
    std::exception_ptr e;
    try {
      fail_truncated();
    } catch (...) {
      e = std::current_exception();
    }
    return e;
  }

  // Reads the @p n records of the next whole blocks (versions 3 and 4) with their checksums into
  // `chunk`: each block_records records (the last block fewer) followed by 4 checksum bytes. The
  // blocks are checked one by one as decoding reaches them (check_block()), so the first fault in
  // the file's order is the one reported, whatever the size of the reads.
  void read_blocks(std::size_t n) {
    const std::uint64_t per_block = layout.h.block_records;
    const std::size_t blocks = (n + per_block - 1) / per_block;
    const auto record_bytes = static_cast<std::size_t>(layout.record_bytes);
    chunk.resize(n * record_bytes + blocks * block_checksum_bytes);
    read_error = nullptr;
    chunk_bytes_read = in->read_fully(reinterpret_cast<char*>(chunk.data()), chunk.size(), read_error);
    buffered_records = n;
    checked_blocks = 0;
  }
  // Checks block @p b of `chunk` (the buffer's b-th): whole, and its CRC-32C, before any of its
  // records is decoded, so no event of a corrupt block is ever delivered.
  // @throws format_error naming the truncation or the block.
  void check_block(std::size_t b) {
    const std::uint64_t per_block = layout.h.block_records;
    const auto record_bytes = static_cast<std::size_t>(layout.record_bytes);
    const std::size_t stride = per_block * record_bytes + block_checksum_bytes;
    const std::size_t records = std::min<std::size_t>(per_block, buffered_records - b * per_block);
    if (b * stride + records * record_bytes + block_checksum_bytes > chunk_bytes_read) {
      if (read_error) std::rethrow_exception(read_error);  // the read failed there, after the blocks before
      fail_truncated();
    }
    const std::span<const std::byte> block = std::span<const std::byte>(chunk).subspan(b * stride);
    const std::uint64_t first = buffer_first + b * per_block;  // buffer_first is a multiple of per_block
    const std::uint64_t index = first / per_block;
    const auto stored = load_le<std::uint32_t>(block, records * record_bytes);
    if (const std::uint32_t actual = block_checksum(index, block.first(records * record_bytes)); actual != stored) {
      fail(at(layout.record_offset(first) + records * record_bytes), "block_checksum",
           fmt::format("{:#010x} does not match the {:#010x} of block {} (events {} to {}): the file is corrupt",
                       stored, actual, index, first, first + records - 1));
    }
  }

  // Decodes the @p count records at @p bytes into the chunk's events from @p first on: the plain
  // ones through decode_plain(), any other through decode_checked().
  void decode(std::span<const std::byte> bytes, std::size_t first, std::size_t count, bool plain) {
    const auto record_bytes = static_cast<std::size_t>(layout.record_bytes);
    for (std::size_t i = 0; i < count; ++i) {
      if (plain) {
        const std::span<const std::byte> rest = bytes.subspan(i * record_bytes);
        const std::size_t j = first + i;
        i += top_k == 2 ? decode_plain<2>(rest, count - i, 2, layers, experts_per_layer, &cur->events[j],
                                          &cur->experts[j * 2], &cur->weights[j * 2])
                        : decode_plain<0>(rest, count - i, top_k, layers, experts_per_layer, &cur->events[j],
                                          &cur->experts[j * top_k], &cur->weights[j * top_k]);
        if (i == count) break;
      }
      good = first + i;
      decode_checked(bytes, i * record_bytes, first + i);
    }
  }

  // Decodes record @p index of the chunk, at @p o of @p bytes, through decode_record() and
  // detail::check_record(), with its optional fields (versions 2 and 3).
  // @throws format_error naming the record's byte offset and the field.
  void decode_checked(std::span<const std::byte> bytes, std::size_t o, std::size_t index) {
    const std::uint64_t offset = layout.record_offset(delivered + index);
    const bool delivers_fields = wide_header(layout.h.version);
    const trace_fields f = delivers_fields ? layout.fields : trace_fields{};
    const std::size_t p = f.probabilities ? experts_per_layer : 0;
    const std::size_t d = f.sketch_dims;
    if (decode_record(bytes, o, offset, layout.k, in->name(), layout.h.vectors > 0, r)) ++vectors_seen;
    if (vectors_seen > layout.h.vectors) {
      fail(at(offset + 13), "has_probabilities",
           fmt::format("more events carry probabilities than the {} the header declares", layout.h.vectors));
    }
    decoded_chunk& c = *cur;
    std::copy(r.experts.begin(), r.experts.end(), c.experts.begin() + static_cast<std::ptrdiff_t>(index * top_k));
    std::copy(r.weights.begin(), r.weights.end(), c.weights.begin() + static_cast<std::ptrdiff_t>(index * top_k));
    const std::span<float> vector = std::span(c.probabilities).subspan(index * p, p);
    const std::span<float> sketch_values = std::span(c.sketch).subspan(index * d, d);
    const std::size_t fixed = record_fixed_bytes + 6 * top_k;
    decode_floats(bytes, o + fixed, vector);
    decode_floats(bytes, o + fixed + 4 * p, sketch_values);
    c.events[index] = {.sequence = *r.sequence,
                       .step = *r.step,
                       .layer = *r.layer,
                       .phase = r.phase,
                       .experts = std::span<const std::uint32_t>(c.experts).subspan(index * top_k, top_k),
                       .weights = std::span<const float>(c.weights).subspan(index * top_k, top_k),
                       .probabilities = vector,
                       .sketch = sketch_values};
    if (const auto problem = detail::check_record(c.events[index], layers, experts_per_layer, top_k, f)) {
      fail(at(offset), detail::to_string(problem->field), problem->message);
    }
  }

  [[nodiscard]] source_position at(std::uint64_t offset) const noexcept { return {in->name(), offset, true}; }

  // Reads exactly @p n payload bytes into @p out, hashing them.
  void take(std::byte* out, std::size_t n) {
    const std::size_t got = in->read_fully(reinterpret_cast<char*>(out), n);
    sum = fnv1a(std::span<const std::byte>(out, got), sum);
    if (got != n) fail_truncated();
  }
  // Versions 1 and 2: the payload's FNV-1a (versions 3 and 4 check every block as it is read).
  void check_sum() const {
    if (blocked(layout.h.version)) return;
    if (sum != layout.h.payload_sum) {
      fail(at(48), "payload_checksum",
           fmt::format("{:#018x} does not match the payload's {:#018x}", layout.h.payload_sum, sum));
    }
  }
  // After a record error: hash the rest; a checksum mismatch explains the error better (versions
  // 1 and 2; a version 3 or 4 block was checked before its records were decoded).
  [[noreturn]] void drain_and_rethrow() {
    if (blocked(layout.h.version)) throw;
    join_checksum();
    std::array<std::byte, 1 << 16> rest{};
    for (;;) {
      const std::size_t n = in->read(reinterpret_cast<char*>(rest.data()), rest.size());
      if (n == 0) break;
      sum = fnv1a(std::span<const std::byte>(rest.data(), n), sum);
    }
    check_sum();
    throw;
  }
  // The end: the vectors (hashed, counted and checked, not kept), no trailing data, the checksum.
  void finish() {
    join_checksum();
    const binary_header& h = layout.h;
    if (vectors_seen != h.vectors) {
      fail(at(40), "probability_vectors",
           fmt::format("header declares {} vectors but {} events carry one", h.vectors, vectors_seen));
    }
    const std::uint64_t section_vectors = wide_header(h.version) ? 0 : h.vectors;
    std::vector<std::byte> vector(static_cast<std::size_t>(layout.vector_bytes));
    std::vector<float> values(experts_per_layer);
    for (std::uint64_t v = 0; v < section_vectors; ++v) {
      const std::uint64_t offset = in->offset();
      take(vector.data(), vector.size());
      for (std::size_t j = 0; j < experts_per_layer; ++j) values[j] = load_f32(vector, 4 * j);
      if (const auto problem = detail::check_probabilities(values, experts_per_layer)) {
        fail(at(offset), "probabilities", fmt::format("vector {}: {}", v, problem->message));
      }
    }
    std::byte extra{};
    if (in->read(reinterpret_cast<char*>(&extra), 1) != 0) {
      fail(at(layout.expected_size), "payload",
           fmt::format("trailing data after the {} bytes the header implies (truncated or trailing data)",
                       layout.expected_size));
    }
    check_sum();
    finished = true;
  }

  std::uint32_t layers = 0;
  std::uint32_t top_k = 0;
  bool may_read_ahead = false;  // versions 3 and 4 from a file or memory, large, two cores, read_ahead

  // The next chunk: decode_ahead's, or produced here. After an exception, every call throws it
  // again (the stream cannot resume past a bad block or record).
  std::span<const routing_event> next() {
    if (failed) std::rethrow_exception(failed);
    try {
      if (ahead) return ahead->next();
      if (may_read_ahead) {  // the first call: nothing produced yet
        may_read_ahead = false;
        if (start_reading_ahead()) return ahead->next();
      }
      return produce(0);
    } catch (...) {
      failed = std::current_exception();
      throw;
    }
  }
  // Decodes the next chunk into slots[@p slot]; empty at the end, after finish().
  std::span<const routing_event> produce(std::size_t slot);

  // Versions 3 and 4 (when may_read_ahead): starts decode_ahead, which from here on is the only
  // caller of produce() (and so of everything above). False when it does not apply or no thread
  // can be started.
  bool start_reading_ahead() {
    if (!blocked(layout.h.version)) return false;
    const auto restore = [this] {
      chunk_events = blocked_chunk_events;
      read_bytes = blocked_read_bytes;
    };
    // A chunk's decoded events and fields take about ahead_chunk_bytes (wide records: fewer
    // events, never fewer than on this thread).
    const trace_fields f = layout.fields;  // versions 3 and 4 deliver them
    const std::size_t event_bytes =
        sizeof(routing_event) + 8 * std::size_t{top_k} +
        4 * ((f.probabilities ? std::size_t{experts_per_layer} : 0) + std::size_t{f.sketch_dims});
    chunk_events = std::clamp(ahead_chunk_bytes / event_bytes, blocked_chunk_events, ahead_chunk_events);
    read_bytes = ahead_read_bytes;
    try {
      ahead.emplace([this](std::size_t slot) { return produce(slot); });
    } catch (...) {  // no thread (or no memory for one) to be had: decode on this one
      restore();
      return false;
    }
    return true;
  }

  // Last: joined (destroyed) before anything its thread uses.
  std::optional<decode_ahead> ahead;
};
}  // namespace detail

std::span<const routing_event> detail::binary_stream::produce(std::size_t slot) {
  if (pending) std::rethrow_exception(pending);
  cur = &slots[slot];
  std::vector<routing_event>& events = cur->events;
  if (finished) {
    events.clear();
    return events;
  }
  const std::uint64_t remaining = layout.h.events - delivered;
  if (remaining == 0) {
    events.clear();
    finish();
    return events;
  }
  const std::uint64_t record_bytes = layout.record_bytes;
  const bool in_blocks = blocked(layout.h.version);
  std::size_t n = 0;
  if (in_blocks) {
    // Whole blocks are read (about read_bytes, at least one), then checked and decoded in chunks
    // of up to chunk_events (blocked_chunk_events on this thread: a chunk's events, about 80 bytes
    // each, stay in the core's first-level cache until the consumer has read them).
    if (buffered == 0) {
      const std::size_t per_block = layout.h.block_records;
      const std::size_t want = std::max<std::size_t>(1, read_bytes / record_bytes / per_block) * per_block;
      buffered = static_cast<std::size_t>(std::min<std::uint64_t>(want, remaining));
      buffer_first = delivered;
      read_blocks(buffered);
    }
    n = std::min(buffered, chunk_events);
  } else {
    // 64 KiB chunks; 256 KiB when hashed on the helper thread (fewer hand-overs).
    const std::size_t chunk_bytes = std::size_t{1} << (worker ? 18 : 16);
    n = static_cast<std::size_t>(
        std::min<std::uint64_t>(std::max<std::size_t>(1, chunk_bytes / record_bytes), remaining));
  }
  // Versions 2 to 4 deliver the optional fields with the events; version 1 keeps its vectors
  // after all records (checked in finish(), not delivered).
  const trace_fields delivered_fields = wide_header(layout.h.version) ? layout.fields : trace_fields{};
  const std::size_t p = delivered_fields.probabilities ? experts_per_layer : 0;
  const std::size_t d = delivered_fields.sketch_dims;
  // Sized once per chunk and never reallocated below: the events' spans point into them.
  events.resize(n);
  cur->experts.resize(n * top_k);
  cur->weights.resize(n * top_k);
  cur->probabilities.resize(n * p);
  cur->sketch.resize(n * d);
  const bool plain = !delivered_fields.any() && layout.h.vectors == 0;
  good = 0;
  try {
    if (in_blocks) {
      // Records [delivered, delivered + n) of the blocks in `chunk`, block by block, each block
      // checked when the first of its records is reached.
      const std::size_t per_block = layout.h.block_records;
      const std::size_t stride = per_block * record_bytes + block_checksum_bytes;
      for (std::size_t i = 0; i < n;) {
        const auto at = static_cast<std::size_t>(delivered - buffer_first) + i;  // in the buffer
        if (at / per_block == checked_blocks) {
          good = i;
          check_block(checked_blocks++);
        }
        const std::size_t count = std::min(n - i, per_block - at % per_block);
        decode(std::span<const std::byte>(chunk).subspan(at / per_block * stride + at % per_block * record_bytes), i,
               count, plain);
        i += count;
      }
    } else {
      std::exception_ptr short_read;
      const std::span<const std::byte> got = read_records(n * record_bytes, short_read);
      if (short_read) {  // the whole records read first (a bad one among them is the first fault)
        const std::size_t whole = got.size() / record_bytes;
        decode(got, 0, whole, plain);
        good = whole;
        std::rethrow_exception(short_read);
      }
      decode(got, 0, n, plain);
    }
  } catch (const format_error&) {
    // The events before the fault are delivered, the error with the next call, so a consumer
    // sees every good event before it whatever the size of its chunks (which for versions 1 and
    // 2 depends on read_ahead). Versions 1 and 2: a checksum mismatch explains the error better,
    // and is known only at the end, so the rest is hashed now and that is the error if it fails.
    std::exception_ptr error = std::current_exception();
    if (!in_blocks) {
      try {
        drain_and_rethrow();
      } catch (...) {
        error = std::current_exception();
      }
    }
    if (good == 0) std::rethrow_exception(error);
    pending = error;
    n = good;
    events.resize(n);
  }
  if (in_blocks) buffered -= n;
  delivered += n;
  return events;
}

binary_trace_reader::binary_trace_reader(const std::filesystem::path& path, const moe_geometry& geometry,
                                         const trace_read_options& options) {
  auto input = std::make_unique<detail::byte_input>(path);
  detail::byte_input& i = *input;
  state_ = std::make_unique<detail::binary_stream>(std::move(input), i, geometry, options);
}

binary_trace_reader::binary_trace_reader(std::span<const std::byte> bytes, const moe_geometry& geometry,
                                         std::string_view source_name, const trace_read_options& options) {
  auto input = std::make_unique<detail::byte_input>(
      std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()), source_name);
  detail::byte_input& i = *input;
  state_ = std::make_unique<detail::binary_stream>(std::move(input), i, geometry, options);
}

binary_trace_reader::~binary_trace_reader() = default;

std::span<const routing_event> binary_trace_reader::next() { return state_->next(); }
std::uint32_t binary_trace_reader::layers() const noexcept { return state_->layers; }
std::uint32_t binary_trace_reader::experts_per_layer() const noexcept { return state_->experts_per_layer; }
std::uint32_t binary_trace_reader::top_k() const noexcept { return state_->top_k; }
std::uint32_t binary_trace_reader::batch_size() const noexcept { return state_->batch_size; }
std::uint64_t binary_trace_reader::events() const noexcept { return state_->layout.h.events; }
std::uint64_t binary_trace_reader::probability_vectors() const noexcept { return state_->layout.h.vectors; }
std::uint16_t binary_trace_reader::version() const noexcept { return state_->layout.h.version; }
const std::string& binary_trace_reader::geometry_name() const noexcept { return state_->layout.h.meta.geometry; }
std::uint32_t binary_trace_reader::block_records() const noexcept { return state_->layout.h.block_records; }
trace_fields binary_trace_reader::fields() const noexcept { return state_->layout.fields; }

namespace {

// Reads a whole binary trace. Without probability vectors it is the streaming reader's chunks
// appended to a trace_builder (one validation, one checksum); with vectors, which follow all
// records, the records are kept until their vectors arrive.
routing_trace read_binary_from(std::unique_ptr<detail::byte_input> input, const moe_geometry& geometry,
                               const trace_read_options& options) {
  detail::byte_input& in = *input;
  detail::binary_stream st(std::move(input), in, geometry, options);
  const binary_header& h = st.layout.h;
  const std::string_view source = in.name();
  detail::trace_builder builder(geometry, source, true);
  if (h.meta.fields) builder.declare_fields(*h.meta.fields, 12);
  if (in.known_size()) builder.trace().reserve(static_cast<std::size_t>(h.events), h.vectors > 0);
  if (h.vectors == 0 || wide_header(h.version)) {
    std::uint64_t i = 0;
    for (auto chunk = st.next(); !chunk.empty(); chunk = st.next()) {
      for (const routing_event& e : chunk) builder.append(e, st.layout.record_offset(i++));
    }
    routing_trace out = builder.finish(st.batch_size);
    if (options.metadata != nullptr) *options.metadata = h.meta;
    return out;
  }
  st.join_checksum();  // the records are kept whole until their vectors: nothing to overlap
  const std::uint64_t record_bytes = st.layout.record_bytes;
  const std::size_t chunk_records = std::max<std::size_t>(1, (std::size_t{1} << 16) / record_bytes);
  std::vector<std::byte> records;
  std::vector<std::byte> vector(static_cast<std::size_t>(st.layout.vector_bytes));
  std::uint64_t vectors_used = 0;
  staged_record r;
  try {
    for (std::uint64_t first = 0; first < h.events; first += chunk_records) {
      const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(chunk_records, h.events - first));
      const std::size_t old = records.size();
      records.resize(old + n * record_bytes);
      st.take(records.data() + old, n * record_bytes);
    }
    for (std::uint64_t i = 0; i < h.events; ++i) {
      const auto o = static_cast<std::size_t>(i * record_bytes);
      const std::uint64_t offset = header_size + i * record_bytes;
      if (decode_record(records, o, offset, st.layout.k, source, true, r)) {
        if (vectors_used == h.vectors) {
          fail(st.at(offset + 13), "has_probabilities",
               fmt::format("more events carry probabilities than the {} the header declares", h.vectors));
        }
        const std::uint64_t vector_offset = in.offset();
        st.take(vector.data(), vector.size());
        for (std::size_t j = 0; j < geometry.experts_per_layer(); ++j)
          r.probabilities.push_back(load_f32(vector, 4 * j));
        // Named at the vector, as the streaming reader names it (not at its record).
        if (const auto problem = detail::check_probabilities(r.probabilities, geometry.experts_per_layer())) {
          fail(st.at(vector_offset), "probabilities", fmt::format("vector {}: {}", vectors_used, problem->message));
        }
        ++vectors_used;
      }
      builder.append(r, offset);
    }
    if (vectors_used != h.vectors) {
      fail(st.at(40), "probability_vectors",
           fmt::format("header declares {} vectors but {} events carry one", h.vectors, vectors_used));
    }
  } catch (const format_error&) {
    st.drain_and_rethrow();
  }
  std::byte extra{};
  if (in.read(reinterpret_cast<char*>(&extra), 1) != 0) {
    fail(st.at(st.layout.expected_size), "payload",
         fmt::format("trailing data after the {} bytes the header implies (truncated or trailing data)",
                     st.layout.expected_size));
  }
  st.check_sum();
  routing_trace out = builder.finish(st.batch_size);
  if (options.metadata != nullptr) *options.metadata = h.meta;
  return out;
}

}  // namespace

namespace detail {

std::optional<trace_metadata> read_binary_metadata(byte_input& in) {
  std::array<std::byte, max_header_size> header_bytes{};
  return parse_header(read_header_bytes(in, header_bytes), in.name()).meta;
}

}  // namespace detail

namespace {

// The header's first 48 bytes, the same in every version: magic to probability_vectors.
void encode_header_start(std::string& out, std::uint16_t version, std::size_t size, const routing_trace& trace) {
  const trace_fields& f = trace.fields();
  out.append(binary_magic.data(), binary_magic.size());
  store_le<std::uint16_t>(out, version);
  store_le<std::uint16_t>(out, static_cast<std::uint16_t>(size));
  store_le<std::uint32_t>(out, (f.probabilities ? flag_probabilities : 0U) | (f.sketch_dims > 0 ? flag_sketch : 0U));
  store_le<std::uint32_t>(out, trace.layers());
  store_le<std::uint32_t>(out, trace.experts_per_layer());
  store_le<std::uint32_t>(out, trace.top_k());
  store_le<std::uint32_t>(out, trace.batch_size());
  store_le<std::uint64_t>(out, trace.size());
  store_le<std::uint64_t>(out, trace.probability_vectors());
}

// One record, followed by its optional fields (none in version 1, which is written only for a
// trace without them).
void encode_record(std::string& out, const routing_event& e, const trace_fields& f) {
  store_le<std::uint32_t>(out, e.sequence);
  store_le<std::uint32_t>(out, e.step);
  store_le<std::uint32_t>(out, e.layer);
  store_le<std::uint8_t>(out, static_cast<std::uint8_t>(e.phase));
  store_le<std::uint8_t>(out, f.probabilities ? 1 : 0);  // has_probabilities
  store_le<std::uint16_t>(out, 0);
  // experts_per_layer ≤ 65536, so every expert id fits 16 bits.
  for (const std::uint32_t x : e.experts) store_le<std::uint16_t>(out, static_cast<std::uint16_t>(x));
  for (const float w : e.weights) store_f32(out, w);
  for (const float p : e.probabilities) store_f32(out, p);
  for (const float x : e.sketch) store_f32(out, x);
}

// Versions 2 and 3: a record with its fields, ≤ 16 + 6·65536 + 4·65536 + 4·4096 bytes.
std::size_t record_size_of(const routing_trace& trace) noexcept {
  const trace_fields& f = trace.fields();
  return record_fixed_bytes + 6 * std::size_t{trace.top_k()} +
         (f.probabilities ? 4 * std::size_t{trace.experts_per_layer()} : 0) + 4 * std::size_t{f.sketch_dims};
}

// Version 1: what expage wrote before version 3, byte for byte, for a trace without optional
// fields: one FNV-1a over the whole payload.
std::string encode_binary_v1(const routing_trace& trace) {
  std::string out;
  out.reserve(header_size + trace.size() * record_size_of(trace));
  encode_header_start(out, binary_trace_version, header_size, trace);
  store_le<std::uint64_t>(out, 0);  // payload checksum, patched below
  store_le<std::uint64_t>(out, 0);  // header checksum, patched below
  for (const routing_event& e : trace) encode_record(out, e, {});
  patch_le<std::uint64_t>(out, 48, fnv1a(as_bytes(std::string_view(out).substr(header_size))));
  patch_le<std::uint64_t>(out, 56, fnv1a(as_bytes(std::string_view(out).substr(0, 56))));
  return out;
}

// Version 2: the version 1 header plus sketch_dims and record_size; each record is followed by
// its probability vector and its sketch, so a stream delivers them with their events.
std::string encode_binary_v2(const routing_trace& trace) {
  const std::size_t record_size = record_size_of(trace);
  std::string out;
  out.reserve(header_size_v2 + trace.size() * record_size);
  encode_header_start(out, binary_trace_version_with_fields, header_size_v2, trace);
  store_le<std::uint64_t>(out, 0);  // payload checksum, patched below
  store_le<std::uint32_t>(out, trace.fields().sketch_dims);
  store_le<std::uint32_t>(out, static_cast<std::uint32_t>(record_size));
  store_le<std::uint64_t>(out, 0);  // header checksum, patched below
  for (const routing_event& e : trace) encode_record(out, e, trace.fields());
  patch_le<std::uint64_t>(out, 48, fnv1a(as_bytes(std::string_view(out).substr(header_size_v2))));
  patch_le<std::uint64_t>(out, 64, fnv1a(as_bytes(std::string_view(out).substr(0, 64))));
  return out;
}

// Versions 3 and 4: version 2's header and records, with block_records where version 2 has its
// payload checksum, and the records in blocks of about 64 KiB, each followed by its CRC-32C;
// version 4 records the model name @p name (its length at 52, the name after the fields).
std::string encode_binary_blocked(const routing_trace& trace, std::uint16_t version, std::string_view name) {
  const std::size_t record_size = record_size_of(trace);
  const std::size_t per_block = std::max<std::size_t>(1, written_block_bytes / record_size);
  const std::size_t blocks = (trace.size() + per_block - 1) / per_block;
  const std::size_t size = header_size_of(version, name.size());
  std::string out;
  out.reserve(size + trace.size() * record_size + blocks * block_checksum_bytes);
  encode_header_start(out, version, size, trace);
  store_le<std::uint32_t>(out, static_cast<std::uint32_t>(per_block));
  store_le<std::uint32_t>(out, static_cast<std::uint32_t>(name.size()));  // version 3: reserved, 0
  store_le<std::uint32_t>(out, trace.fields().sketch_dims);
  store_le<std::uint32_t>(out, static_cast<std::uint32_t>(record_size));
  out += name;
  out.resize(size - 8, '\0');       // the name's padding
  store_le<std::uint64_t>(out, 0);  // header checksum, patched below
  for (std::size_t b = 0; b < blocks; ++b) {
    const std::size_t start = out.size();
    const std::size_t end = std::min(trace.size(), (b + 1) * per_block);
    for (std::size_t i = b * per_block; i < end; ++i) encode_record(out, trace[i], trace.fields());
    store_le<std::uint32_t>(out, block_checksum(b, as_bytes(std::string_view(out).substr(start))));
  }
  patch_le<std::uint64_t>(out, size - 8, fnv1a(as_bytes(std::string_view(out).substr(0, size - 8))));
  return out;
}

}  // namespace

std::string encode_binary(const routing_trace& trace, const binary_write_options& options) {
  detail::check_has_records(trace, "encode_binary");
  switch (options.version) {
    case binary_trace_version:
      if (trace.fields().any()) {
        throw invalid_argument(
            "encode_binary: version 1 cannot carry this trace's optional fields (probability vectors or a sketch); "
            "write version 2, 3 or 4");
      }
      return encode_binary_v1(trace);
    case binary_trace_version_with_fields: return encode_binary_v2(trace);
    case binary_trace_version_blocked: return encode_binary_blocked(trace, options.version, {});
    case binary_trace_version_named: {
      const std::string name = metadata_of(trace, options.geometry).geometry;  // as every format records it
      if (name.size() > max_binary_geometry_name) {
        // The recorded form may be longer than the name given (U+FFFD is three bytes).
        throw invalid_argument(fmt::format(
            "encode_binary: a model name of {} bytes out of range [0, {}] (max_binary_geometry_name){}: '{}...'",
            name.size(), max_binary_geometry_name,
            name.size() != options.geometry.size()
                ? fmt::format(", as recorded from the {} bytes given (trace_model_name(): control characters "
                              "dropped, U+FFFD for each byte that is not UTF-8)",
                              options.geometry.size())
                : std::string(),
            detail::printable(options.geometry)));
      }
      return encode_binary_blocked(trace, options.version, name);
    }
    default: break;
  }
  throw invalid_argument(fmt::format("encode_binary: version {} out of range [{}, {}]", options.version,
                                     binary_trace_version, binary_trace_version_named));
}

routing_trace parse_binary(std::span<const std::byte> bytes, const moe_geometry& geometry,
                           std::string_view source_name) {
  return read_binary_from(std::make_unique<detail::byte_input>(
                              std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()), source_name),
                          geometry, {});
}

routing_trace read_binary(const std::filesystem::path& path, const moe_geometry& geometry,
                          const trace_read_options& options) {
  return read_binary_from(std::make_unique<detail::byte_input>(path), geometry, options);
}

void write_binary(const std::filesystem::path& path, const routing_trace& trace, const binary_write_options& options) {
  const std::string bytes = encode_binary(trace, options);
  write_file_atomically(
      path, [&](std::ostream& out) { out.write(bytes.data(), static_cast<std::streamsize>(bytes.size())); });
}

}  // namespace expage

/// @file
/// @brief version_record (what a resolved handle gives a kernel), version_storage (what keeps
/// a version's memory alive) and mirror_hook (how the table's mirror reaches a device).
///
/// Free of fmt, so kernels include it and read version_record itself; expage/formatters.hpp
/// formats a version_encoding.
#pragma once

#include "expage/core/expert_id.hpp"
#include "expage/core/moe_geometry.hpp"
#include "expage/core/precision.hpp"
#include "expage/detail/host_device.hpp"
#include "expage/residency/completion.hpp"

#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>
#include <type_traits>
#include <utility>

namespace expage {

/// @brief How a version's weights are encoded on top of their precision.
///
/// Kept apart from expage::precision: a compressed bf16 version still
/// computes in bf16, its kernel only decodes first.
enum class version_encoding : std::uint8_t {
  raw,         ///< Weights stored as the precision says; kernels read them directly.
  compressed,  ///< Losslessly compressed (e.g. FluxMoE §4.2 exponent coding); kernels decode first.
};

/// The lowercase name of @p e: "raw" or "compressed" ("invalid" for a value of neither).
[[nodiscard]] constexpr std::string_view to_string(version_encoding e) noexcept {
  switch (e) {
    case version_encoding::raw: return "raw";
    case version_encoding::compressed: return "compressed";
  }
  return "invalid";
}

/// @brief One complete version of one expert: where its tensors are and how
/// to read them (DynaExq §3.2: "the compute path resolves the handle to obtain
/// the active pointer and the associated quantization parameters").
///
/// Plain and trivially copyable, so an array of them (the handle table's
/// mirror) can be copied to a device and read by kernels. The pointers are in
/// whatever address space the version's storage lives in (device pointers for
/// a device pool). A record reached through a handle is immutable: the table
/// never writes a record after publishing it.
///
/// @code
/// const expage::version_record* v = handle.resolve();
/// if (v != nullptr && v->format == expage::precision::int4) {
///   moe_int4(x, v->tensor(expage::expert_tensor::gate_up), v->scale(expage::expert_tensor::gate_up), ...);
/// }
/// @endcode
/// @threadsafety thread-compatible.
struct version_record {
  std::array<std::byte*, expert_tensor_count> data{};  ///< Weights of gate_up and down, indexed by expert_tensor.
  std::array<std::byte*, expert_tensor_count>
      scales{};  ///< Per-group scales of each tensor; nullptr for 16-bit formats.
  std::array<std::byte*, expert_tensor_count> zeros{};  ///< Per-group zero points; nullptr unless integer formats.
  std::uint64_t bytes = 0;                              ///< Bytes of the whole version (weights and metadata).
  std::uint64_t number = 0;  ///< Version number, set by the table: 1 for an expert's first version, +1 per publish.
  expert_id expert{};        ///< The expert this is a version of (set by the table).
  precision format = precision::bf16;                 ///< Precision of the weights.
  version_encoding encoding = version_encoding::raw;  ///< Raw or compressed.

  /// The weights of tensor @p t.
  [[nodiscard]] EXPAGE_HOST_DEVICE std::byte* tensor(expert_tensor t) const noexcept {
    return data[static_cast<std::size_t>(t)];
  }
  /// The scales of tensor @p t, or nullptr.
  [[nodiscard]] EXPAGE_HOST_DEVICE std::byte* scale(expert_tensor t) const noexcept {
    return scales[static_cast<std::size_t>(t)];
  }
  /// The zero points of tensor @p t, or nullptr.
  [[nodiscard]] EXPAGE_HOST_DEVICE std::byte* zero(expert_tensor t) const noexcept {
    return zeros[static_cast<std::size_t>(t)];
  }
};

static_assert(std::is_trivially_copyable_v<version_record> && std::is_standard_layout_v<version_record>,
              "version_record is copied byte-wise to devices");
// The layout is an ABI: the device mirror copies records byte-wise and the CUDA kernels
// (kernels/expert_ffn.cu) read them in place, compiled by nvcc from this same header.
static_assert(sizeof(void*) != 8 || (sizeof(version_record) == 80 && offsetof(version_record, data) == 0 &&
                                     offsetof(version_record, scales) == 16 && offsetof(version_record, zeros) == 32 &&
                                     offsetof(version_record, bytes) == 48 && offsetof(version_record, number) == 56 &&
                                     offsetof(version_record, expert) == 64 && offsetof(version_record, format) == 72 &&
                                     offsetof(version_record, encoding) == 73),
              "version_record's layout changed: the device mirror and the kernels read it as laid out");

namespace detail {

/// A heap node that owns a version's memory and doubles as an intrusive
/// retire-list entry, so retiring a version never allocates (publish cannot
/// fail after its switch).
struct storage_node {
  storage_node() = default;
  storage_node(const storage_node&) = delete;
  storage_node& operator=(const storage_node&) = delete;
  storage_node(storage_node&&) = delete;
  storage_node& operator=(storage_node&&) = delete;
  virtual ~storage_node() = default;
  storage_node* next = nullptr;  // retire list link (guarded by the epoch_domain's mutex)
  std::uint64_t epoch = 0;       // retired in this epoch: windows opened at ≤ epoch may read it
  any_completion done;           // work that must finish first (a copy still in flight)
};

template <class T>
struct storage_holder final : storage_node {
  explicit storage_holder(T v) : value(std::move(v)) {}
  T value;
};

}  // namespace detail

/// @brief Move-only owner of whatever keeps a version's memory: a block_pool
/// span (which holds its budget reservation), a reservation and a physical
/// allocation, a tuple of those.
///
/// Destroying (or reset()ing) it destroys what it holds, which returns blocks
/// to their pool and bytes to their budget account (RAII, never throws). The
/// handle table keeps a version's storage until the epoch domain has proved
/// no window can still read it.
///
/// @code
/// auto span = pool.acquire(std::move(reservation));       // blocks + budget
/// expage::version_storage storage(std::move(span));      // owned by the version from now on
/// @endcode
/// @threadsafety single-owner.
class version_storage {
 public:
  /// Holds nothing.
  version_storage() noexcept = default;
  /// Takes ownership of @p owned.
  /// @throws std::bad_alloc when the holder cannot be allocated (@p owned is then destroyed).
  template <class T>
  requires(std::move_constructible<T>&& std::is_nothrow_destructible_v<T> &&
           !std::same_as<std::remove_cvref_t<T>, version_storage>) explicit version_storage(T owned)
      : node_(std::make_unique<detail::storage_holder<T>>(std::move(owned))) {}

  version_storage(const version_storage&) = delete;
  version_storage& operator=(const version_storage&) = delete;
  /// Takes over @p other's contents.
  version_storage(version_storage&& other) noexcept = default;
  /// Destroys the current contents, then takes over @p other's.
  version_storage& operator=(version_storage&& other) noexcept = default;
  /// Destroys the contents.
  ~version_storage() = default;

  /// True when something is held.
  [[nodiscard]] explicit operator bool() const noexcept { return node_ != nullptr; }
  /// Destroys the contents now.
  void reset() noexcept { node_.reset(); }

  /// Adopts an already built node (for the table and the epoch domain; not for users).
  [[nodiscard]] static version_storage adopt(std::unique_ptr<detail::storage_node> node) noexcept {
    version_storage s;
    s.node_ = std::move(node);
    return s;
  }
  /// Gives up the node (for the epoch domain's retire list; not for users).
  [[nodiscard]] std::unique_ptr<detail::storage_node> release_node() noexcept { return std::move(node_); }

 private:
  std::unique_ptr<detail::storage_node> node_;
};

/// @brief Where the handle table's mirror goes beyond the host array: the
/// interface a device backend implements to keep a device copy in step.
///
/// The host backend needs none: the table's host array is the mirror. A CUDA
/// backend implements update() by writing the record into pinned staging and
/// enqueueing a `cudaMemcpyAsync` of that one entry into the device copy **on
/// the compute stream**, so kernels launched after the publish (in stream
/// order) read the new version and kernels already queued read the old one,
/// whose storage the epoch domain keeps alive until their window's completion.
///
/// @code
/// struct device_mirror final : expage::mirror_hook {
///   void update(std::size_t index, const expage::version_record& r) override {
///     staging[index] = r;
///     check(cudaMemcpyAsync(device + index, staging + index, sizeof r, cudaMemcpyHostToDevice, compute));
///   }
/// };
/// @endcode
/// @threadsafety update() is called with the table's lock held, one call at a time.
class mirror_hook {
 public:
  mirror_hook() = default;
  mirror_hook(const mirror_hook&) = delete;
  mirror_hook& operator=(const mirror_hook&) = delete;
  mirror_hook(mirror_hook&&) = delete;
  mirror_hook& operator=(mirror_hook&&) = delete;
  /// Destroys the hook.
  virtual ~mirror_hook() = default;

  /// Entry @p index (moe_geometry::flat_index) becomes @p record. Called by
  /// publish() before the switch; if it throws, the publish fails and nothing
  /// changed (the transition stays in flight).
  virtual void update(std::size_t index, const version_record& record) = 0;
};

}  // namespace expage

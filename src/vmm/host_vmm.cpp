#include "expage/vmm/host_vmm.hpp"

#include "../detail/system.hpp"

#include "expage/core/error.hpp"
#include "expage/core/units.hpp"
#include "expage/detail/assert.hpp"

#include <fmt/format.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>

namespace expage {
namespace {

using detail::is_power_of_two;
using detail::page_size;

int protection(access_mode a) noexcept { return a == access_mode::read_write ? PROT_READ | PROT_WRITE : PROT_NONE; }

std::uintptr_t address_of(const std::byte* p) noexcept { return reinterpret_cast<std::uintptr_t>(p); }
std::byte* to_pointer(std::uintptr_t a) noexcept { return reinterpret_cast<std::byte*>(a); }

// The placeholder every unmapped granule holds: no access, no memory, no commit charge.
constexpr int placeholder_flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;

bool put_placeholder(std::byte* address, std::size_t bytes) noexcept {
  return ::mmap(address, bytes, PROT_NONE, placeholder_flags | MAP_FIXED, -1, 0) != MAP_FAILED;
}

// 0 when the file cannot be read.
std::size_t read_max_map_count() noexcept {
  std::FILE* f = std::fopen("/proc/sys/vm/max_map_count", "re");
  if (f == nullptr) return 0;
  unsigned long long v = 0;
  const int n = std::fscanf(f, "%llu", &v);
  std::fclose(f);
  return n == 1 ? static_cast<std::size_t>(v) : 0;
}

std::size_t count_process_mappings() noexcept {
  std::FILE* f = std::fopen("/proc/self/maps", "re");
  if (f == nullptr) return 0;
  std::size_t lines = 0;
  char buffer[4096];
  std::size_t n = 0;
  while ((n = std::fread(buffer, 1, sizeof buffer, f)) != 0) {
    lines += static_cast<std::size_t>(std::count(buffer, buffer + n, '\n'));
  }
  std::fclose(f);
  return lines;
}

// The process-wide budget of mappings shared by every host_vmm: vm.max_map_count
// less what the process held when the first host_vmm was built (libraries,
// heaps, stacks) less a margin for what it maps later (an eighth of the limit,
// at least 1024: thread stacks and malloc arenas, CUDA's own mappings).
struct process_budget {
  std::size_t system_limit = read_max_map_count();
  std::size_t baseline = count_process_mappings();
  std::size_t margin = 0;
  std::size_t limit = 0;
  std::atomic<std::size_t> used{0};  // sum of every host_vmm's estimate

  process_budget() noexcept {
    if (system_limit == 0) system_limit = 65530;  // the kernel's default (DEFAULT_MAX_MAP_COUNT)
    margin = std::max<std::size_t>(system_limit / 8, 1024);
    limit = system_limit > baseline + margin ? system_limit - baseline - margin : 0;
  }
};

process_budget& process_mappings_budget() noexcept {
  static process_budget b;  // thread-safe static initialization
  return b;
}

std::size_t validated_granularity(std::size_t requested) {
  const std::size_t g = requested == 0 ? page_size() : requested;
  if (!is_power_of_two(g) || g < page_size() || g > GiB) {
    throw invalid_argument(
        fmt::format("host_vmm: granularity {} must be 0 or a power of two in [{}, {}]", requested, page_size(), GiB));
  }
  return g;
}

}  // namespace

host_vmm::host_vmm(options opts)
    : options_(opts), granularity_(validated_granularity(opts.granularity)), table_("host_vmm", granularity_) {
  options_.granularity = granularity_;
  (void)process_mappings_budget();  // measure the process's baseline before it maps anything of ours
  fd_ = ::memfd_create("expage.host_vmm", MFD_CLOEXEC);
  if (fd_ < 0) {
    const int err = errno;
    throw out_of_memory(fmt::format("host_vmm: memfd_create failed: {}", std::strerror(err)));
  }
}

host_vmm::~host_vmm() {
  const std::lock_guard lock(mutex_);
  for (const auto& [base, r] : table_.reservations()) {
    ::munmap(to_pointer(base), r.bytes);
  }
  process_mappings_budget().used.fetch_sub(mappings_, std::memory_order_relaxed);
  ::close(fd_);
}

void host_vmm::charge_mappings(std::ptrdiff_t delta, const char* op) {
  if (delta <= 0) {
    adjust_mappings(delta);
    return;
  }
  const auto more = static_cast<std::size_t>(delta);
  if (options_.max_mappings != 0 && mappings_ + more > options_.max_mappings) {
    throw out_of_memory(
        fmt::format("{}: would use {} memory mappings, over this host_vmm's limit of {} (options::max_mappings)", op,
                    mappings_ + more, options_.max_mappings));
  }
  process_budget& b = process_mappings_budget();
  // Relaxed: a counter that publishes nothing; each compare-exchange sees the
  // latest total, so concurrent host_vmm objects never jointly pass the limit.
  std::size_t used = b.used.load(std::memory_order_relaxed);
  do {
    if (used + more > b.limit) {
      throw out_of_memory(fmt::format(
          "{}: would take the process's host_vmm mappings to {}, over the limit of {} (vm.max_map_count {} less "
          "{} mappings held at start and a safety margin of {}); unmap blocks, map fewer and larger ones (a "
          "granularity above this host_vmm's {} bytes: options::granularity) or raise vm.max_map_count",
          op, used + more, b.limit, b.system_limit, b.baseline, b.margin, granularity_));
    }
  } while (!b.used.compare_exchange_weak(used, used + more, std::memory_order_relaxed));
  mappings_ += more;
}

void host_vmm::adjust_mappings(std::ptrdiff_t delta) noexcept {
  // Unsigned wrap-around makes adding a negative delta a subtraction.
  const auto change = static_cast<std::size_t>(delta);
  mappings_ += change;
  process_mappings_budget().used.fetch_add(change, std::memory_order_relaxed);
}

std::byte* host_vmm::reserve(std::size_t bytes) {
  // The largest multiple of the granularity that leaves a granule of headroom below max_bytes.
  const std::size_t largest = (max_bytes - granularity_) / granularity_ * granularity_;
  if (bytes == 0 || bytes % granularity_ != 0 || bytes > largest) {
    throw invalid_argument(
        fmt::format("host_vmm::reserve: {} bytes is not a positive multiple of the granularity {} "
                    "in [{}, {}]",
                    bytes, granularity_, granularity_, largest));
  }
  const std::lock_guard lock(mutex_);
  charge_mappings(1, "host_vmm::reserve");
  // mmap promises page alignment only: over-reserve by a granule less a page and trim.
  const std::size_t slack = granularity_ - page_size();
  void* raw = ::mmap(nullptr, bytes + slack, PROT_NONE, placeholder_flags, -1, 0);
  if (raw == MAP_FAILED) {
    const int err = errno;
    adjust_mappings(-1);
    throw out_of_memory(fmt::format("host_vmm::reserve: mmap of {} ({} bytes) failed: {}", byte_size{bytes + slack},
                                    bytes + slack, std::strerror(err)));
  }
  auto* first = static_cast<std::byte*>(raw);
  const std::size_t head = (granularity_ - address_of(first) % granularity_) % granularity_;
  if (head != 0) ::munmap(first, head);
  if (slack - head != 0) ::munmap(first + head + bytes, slack - head);
  std::byte* base = first + head;
  try {
    table_.add_reservation(address_of(base), bytes);
  } catch (...) {
    ::munmap(base, bytes);
    adjust_mappings(-1);
    throw;
  }
  return base;
}

void host_vmm::free(std::byte* base) noexcept {
  const std::lock_guard lock(mutex_);
  const detail::vmm_table::reservation* r = table_.freeable(address_of(base));
  if (r == nullptr) return;
  [[maybe_unused]] const int rc = ::munmap(base, r->bytes);
  EXPAGE_ASSERT(rc == 0, "host_vmm::free: munmap failed");
  table_.erase_reservation(address_of(base));
  adjust_mappings(-1);
}

host_vmm::physical_block host_vmm::create() {
  const std::lock_guard lock(mutex_);
  const std::uint32_t slot = table_.next_slot();
  if (slot >= file_slots_) {
    // Grow geometrically: the file is sparse, so its size costs nothing. Its size counts against
    // RLIMIT_FSIZE, and growing past that limit raises SIGXFSZ (which kills the process unless
    // handled): stay within it and say so instead.
    std::size_t max_slots = std::min<std::size_t>(
        detail::vmm_table::no_slot - 1, static_cast<std::size_t>(std::numeric_limits<off_t>::max()) / granularity_);
    ::rlimit file_size{};
    const bool limited = ::getrlimit(RLIMIT_FSIZE, &file_size) == 0 && file_size.rlim_cur != RLIM_INFINITY;
    if (limited) {
      max_slots = std::min<std::size_t>(max_slots, static_cast<std::size_t>(file_size.rlim_cur / granularity_));
    }
    if (file_slots_ >= max_slots) {
      throw out_of_memory(
          limited ? fmt::format("host_vmm::create: {} blocks of {} already exist, the most the file size limit "
                                "(RLIMIT_FSIZE, {} bytes) lets one memfd hold",
                                file_slots_, granularity_, file_size.rlim_cur)
                  : fmt::format("host_vmm::create: {} blocks of {} already exist (the most one memfd holds)",
                                file_slots_, granularity_));
    }
    const std::size_t grown = std::min(max_slots, std::max<std::size_t>(16, file_slots_ * 2));
    if (::ftruncate(fd_, static_cast<off_t>(grown * granularity_)) != 0) {
      const int err = errno;
      throw out_of_memory(fmt::format("host_vmm::create: growing the memfd to {} failed: {}",
                                      byte_size{grown * granularity_}, std::strerror(err)));
    }
    file_slots_ = grown;
  }
  return table_.add<physical_block>(std::uint64_t{slot} * granularity_);
}

void host_vmm::release(physical_block block) noexcept {
  const std::lock_guard lock(mutex_);
  const detail::vmm_table::slot_record* r = table_.releasable(block.slot, block.generation);
  if (r == nullptr) return;
  // Punch the hole first: the offset must hold no memory when create() reuses it
  // (a new block reads as zeros).
  [[maybe_unused]] const int rc = ::fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                                              static_cast<off_t>(r->payload), static_cast<off_t>(granularity_));
  EXPAGE_ASSERT(rc == 0, "host_vmm::release: fallocate(FALLOC_FL_PUNCH_HOLE) failed");
  table_.remove(block.slot);
}

namespace {

// Mapping-count model (see the class comment): per reservation, one mapping per
// mapped granule plus one per maximal run of unmapped granules (adjacent
// anonymous PROT_NONE placeholders with equal flags merge; adjacent file
// mappings merge only when their offsets are contiguous, so they are counted
// apart). Mapping granule g adds itself and splits its unmapped run in two
// (+1), shortens it (0) or removes it (-1); unmapping g is the reverse. Neither
// depends on g's own state, only on its neighbours'.
std::ptrdiff_t map_delta(const detail::vmm_table::reservation& r, std::size_t granules, std::size_t g) {
  const bool left_free = g > 0 && !r.mapped.contains(g - 1);
  const bool right_free = g + 1 < granules && !r.mapped.contains(g + 1);
  if (left_free && right_free) return 2;
  return left_free || right_free ? 1 : 0;
}

}  // namespace

void host_vmm::map(physical_block block, std::byte* address, access_mode access) {
  map_granule(block, address, access, false);
}

void host_vmm::map_alias(physical_block block, std::byte* address, access_mode access) {
  map_granule(block, address, access, true);
}

void host_vmm::map_granule(physical_block block, std::byte* address, access_mode access, bool alias) {
  const char* const op = alias ? "host_vmm::map_alias" : "host_vmm::map";
  check_access_mode(access, op);
  const std::lock_guard lock(mutex_);
  detail::vmm_table::slot_record& s = alias ? table_.require_mapped(op, block.slot, block.generation)
                                            : table_.require_created(op, block.slot, block.generation);
  const detail::vmm_table::run r = table_.require_run(op, address_of(address), granularity_);
  if (const auto it = r.where->mapped.find(r.first); it != r.where->mapped.end()) {
    const detail::vmm_table::slot_record& other = table_.at(it->second);
    throw invalid_argument(fmt::format("{}: the granule at {} already holds block (slot {}, generation {})", op,
                                       fmt::ptr(address), it->second, other.generation));
  }
  const std::ptrdiff_t delta = map_delta(*r.where, r.where->bytes / granularity_, r.first);
  const auto [it, inserted] = r.where->mapped.emplace(r.first, block.slot);  // may throw: nothing changed yet
  try {
    charge_mappings(delta, op);
  } catch (...) {
    r.where->mapped.erase(it);
    throw;
  }
  if (::mmap(address, granularity_, protection(access), MAP_SHARED | MAP_FIXED, fd_, static_cast<off_t>(s.payload)) ==
      MAP_FAILED) {
    const int err = errno;
    // A failed MAP_FIXED mmap may already have unmapped the old range: put the
    // placeholder back so that no hole is left for another mmap to take.
    [[maybe_unused]] const bool restored = put_placeholder(address, granularity_);
    EXPAGE_ASSERT(restored, "host_vmm::map: could not restore the placeholder after a failed mmap");
    r.where->mapped.erase(it);
    adjust_mappings(-delta);
    throw out_of_memory(fmt::format("{}: mmap of a {} block at {} failed: {}", op, byte_size{granularity_},
                                    fmt::ptr(address), std::strerror(err)));
  }
  table_.mark_mapped(s, address_of(address));
}

void host_vmm::unmap(std::byte* address, std::size_t bytes) noexcept {
  const std::lock_guard lock(mutex_);
  const detail::vmm_table::run r = table_.locate(address_of(address), bytes, nullptr);
  EXPAGE_ASSERT(r.where != nullptr, "host_vmm::unmap: the range is not granule-aligned inside one reservation");
  if (r.where == nullptr) return;
  const bool all_mapped = detail::vmm_table::first_unmapped(r) == r.count;
  EXPAGE_ASSERT(all_mapped, "host_vmm::unmap: a granule of the range holds no block (unmapped twice?)");
  if (!all_mapped) return;
  if (!put_placeholder(address, bytes)) {
    // The kernel refused a new mapping (ENOMEM past vm.max_map_count): keep the
    // file mappings but make them inaccessible. No hole either way; a later
    // map() replaces them, and release() punches the memory out from under them.
    [[maybe_unused]] const int rc = ::mprotect(address, bytes, PROT_NONE);
    EXPAGE_ASSERT(rc == 0, "host_vmm::unmap: neither the placeholder mmap nor mprotect(PROT_NONE) succeeded");
  }
  const std::size_t granules = r.where->bytes / granularity_;
  std::ptrdiff_t delta = 0;
  for (std::size_t i = 0; i < r.count; ++i) {
    table_.mark_unmapped(*r.where, r.first + i);
    delta -= map_delta(*r.where, granules, r.first + i);
  }
  adjust_mappings(delta);
}

void host_vmm::set_access(std::byte* address, std::size_t bytes, access_mode access) {
  check_access_mode(access, "host_vmm::set_access");
  const std::lock_guard lock(mutex_);
  (void)table_.require_mapped_run("host_vmm::set_access", address_of(address), bytes);
  if (::mprotect(address, bytes, protection(access)) != 0) {
    const int err = errno;
    throw out_of_memory(fmt::format("host_vmm::set_access: mprotect of [{}, +{}) to {} failed: {}", fmt::ptr(address),
                                    bytes, to_string(access), std::strerror(err)));
  }
}

block_state host_vmm::state(physical_block block) const {
  const std::lock_guard lock(mutex_);
  return table_.state(block.slot, block.generation);
}

std::byte* host_vmm::mapped_address(physical_block block) const {
  const std::lock_guard lock(mutex_);
  const std::uintptr_t address = table_.mapped_address(block.slot, block.generation);
  return address == 0 ? nullptr : to_pointer(address);
}

std::optional<host_vmm::physical_block> host_vmm::block_at(const std::byte* address) const {
  const std::lock_guard lock(mutex_);
  const std::uintptr_t a = address_of(address) - address_of(address) % granularity_;
  const detail::vmm_table::run r = const_cast<detail::vmm_table&>(table_).locate(a, granularity_, nullptr);
  if (r.where == nullptr) return std::nullopt;
  const auto it = r.where->mapped.find(r.first);
  if (it == r.where->mapped.end()) return std::nullopt;
  return physical_block{it->second, const_cast<detail::vmm_table&>(table_).at(it->second).generation};
}

std::size_t host_vmm::blocks() const {
  const std::lock_guard lock(mutex_);
  return table_.live_blocks();
}

std::size_t host_vmm::physical_bytes() const {
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    const int err = errno;
    throw out_of_memory(fmt::format("host_vmm::physical_bytes: fstat failed: {}", std::strerror(err)));
  }
  return static_cast<std::size_t>(st.st_blocks) * 512;  // st_blocks counts 512-byte units (POSIX)
}

std::size_t host_vmm::map_count() const {
  const std::lock_guard lock(mutex_);
  return mappings_;
}

std::size_t host_vmm::map_count_limit() const {
  const std::lock_guard lock(mutex_);
  const process_budget& b = process_mappings_budget();
  const std::size_t others = b.used.load(std::memory_order_relaxed) - mappings_;
  std::size_t limit = b.limit > others ? b.limit - others : 0;
  if (options_.max_mappings != 0) limit = std::min(limit, options_.max_mappings);
  return limit;
}

map_count_report host_vmm::map_counts() const {
  map_count_report r;
  r.system_limit = read_max_map_count();
  r.process_mappings = count_process_mappings();
  r.tracked = map_count();
  r.limit = map_count_limit();
  r.headroom = r.limit > r.tracked ? r.limit - r.tracked : 0;
  r.system_headroom = r.system_limit > r.process_mappings ? r.system_limit - r.process_mappings : 0;
  return r;
}

}  // namespace expage

#include "expage/memory/host_memory.hpp"

#include "../detail/system.hpp"

#include "expage/core/error.hpp"
#include "expage/core/units.hpp"
#include "expage/detail/assert.hpp"

#include <fmt/format.h>

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

namespace expage {
namespace {

using detail::is_power_of_two;
using detail::page_size;

}  // namespace

host_memory::host_memory(options opts) : options_(opts) {
  const std::size_t page = page_size();
  if (!is_power_of_two(opts.alignment) || opts.alignment < page || opts.alignment > GiB) {
    throw invalid_argument(
        fmt::format("host_memory: alignment {} must be a power of two in [{}, {}]", opts.alignment, page, GiB));
  }
  if (opts.block_size == 0 || opts.block_size > max_bytes || opts.block_size % page != 0 ||
      opts.block_size % opts.alignment != 0) {
    throw invalid_argument(fmt::format(
        "host_memory: block_size {} must be a positive multiple of the page size ({}) and of the alignment ({})",
        opts.block_size, page, opts.alignment));
  }
}

std::byte* host_memory::allocate(std::size_t blocks) {
  if (blocks == 0 || blocks > max_bytes / options_.block_size) {
    throw invalid_argument(
        fmt::format("host_memory::allocate: {} blocks out of range [1, {}]", blocks, max_bytes / options_.block_size));
  }
  const std::size_t bytes = blocks * options_.block_size;
  // Over-map by the alignment minus a page, then trim both ends: mmap only
  // promises page alignment.
  const std::size_t slack = options_.alignment - page_size();
  int flags = MAP_PRIVATE | MAP_ANONYMOUS;
  if (options_.populate && slack == 0) {
    flags |= MAP_POPULATE;
  }
  void* raw = ::mmap(nullptr, bytes + slack, PROT_READ | PROT_WRITE, flags, -1, 0);
  if (raw == MAP_FAILED) {
    const int err = errno;
    throw out_of_memory(fmt::format("host_memory: mmap of {} ({} bytes) failed: {}", byte_size{bytes + slack},
                                    bytes + slack, std::strerror(err)));
  }
  auto* base = static_cast<std::byte*>(raw);
  const auto addr = reinterpret_cast<std::uintptr_t>(base);
  const std::size_t head = (options_.alignment - addr % options_.alignment) % options_.alignment;
  if (head != 0) {
    ::munmap(base, head);
  }
  if (slack - head != 0) {
    ::munmap(base + head + bytes, slack - head);
  }
  std::byte* p = base + head;
  if (options_.huge_pages) {
    ::madvise(p, bytes, MADV_HUGEPAGE);  // a hint: failure (THP disabled) is not an error
  }
  if (options_.populate && slack != 0) {
    ::madvise(p, bytes, MADV_WILLNEED);
    const std::size_t page = page_size();
    for (std::size_t off = 0; off < bytes; off += page) {
      *reinterpret_cast<volatile std::byte*>(p + off) = std::byte{0};
    }
  }
  return p;
}

void host_memory::deallocate(std::byte* p, std::size_t blocks) noexcept {
  EXPAGE_ASSERT(p != nullptr && blocks != 0, "host_memory::deallocate: null pointer or zero blocks");
  [[maybe_unused]] const int rc = ::munmap(p, blocks * options_.block_size);
  EXPAGE_ASSERT(rc == 0, "host_memory::deallocate: munmap failed (not a range allocate() returned?)");
}

}  // namespace expage

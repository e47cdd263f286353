#include "expage/vmm/layer_pipeline.hpp"

#include "common/cuda_like_stream.hpp"
#include "common/failing_vmm.hpp"
#include "expage/core/pattern.hpp"
#include "expage/format/bf16_codec.hpp"
#include "expage/memory/host_memory.hpp"
#include "expage/stream/host_stream.hpp"
#include "expage/vmm/host_vmm.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <future>
#include <map>
#include <optional>
#include <stdexcept>

namespace expage {
namespace {

using namespace expage::literals;
using ::testing::HasSubstr;

// 6 layers × 4 experts; gate_up bf16 = 2·48·32·2 = 6 KiB, down = 3 KiB: one 64 KiB granule per page.
moe_geometry small(std::uint32_t layers = 6) {
  return moe_geometry(moe_geometry::config{.name = "small",
                                           .layers = layers,
                                           .experts_per_layer = 4,
                                           .top_k = 2,
                                           .hidden_size = 32,
                                           .intermediate_size = 48});
}

using expage::testing::failing_vmm;

std::uint64_t seed_of(const moe_geometry& g, expert_id id, expert_tensor t) {
  return 0x9e37'79b9'7f4a'7c15ULL ^ (g.flat_index(id) * expert_tensor_count + static_cast<std::uint64_t>(t));
}

// Everything a pipeline needs, on the host backend: weights filled with a per-tensor pattern.
template <class Vmm = host_vmm>
struct rig {
  explicit rig(std::uint32_t window, std::uint32_t layers = 6, tensor_storage<host_stream>::loader_type loader = {})
      : geometry(small(layers)),
        vm({.granularity = 64_KiB}),
        budget(1_GiB),
        host({.block_size = 64_KiB, .alignment = 64_KiB}),
        storage(geometry, precision::bf16, host, {.loader = std::move(loader)}),
        compute("compute"),
        load_gate_up("load.gate_up"),
        load_down("load.down"),
        pipe(vm, geometry, precision::bf16, budget.root(), storage, compute, load_gate_up, load_down,
             {.window = window}) {
    for (std::uint64_t flat = 0; flat < geometry.expert_count(); ++flat) {
      const expert_id id = geometry.expert_at(flat);
      for (const expert_tensor t : {expert_tensor::gate_up, expert_tensor::down}) {
        const auto slot = storage.slot(id, t);
        fill_pattern(reinterpret_cast<std::uint64_t*>(slot.data()), storage.tensor_bytes(t) / 8,
                     seed_of(geometry, id, t));
      }
    }
  }

  // The "compute" of a layer: on the compute stream, checks every expert tensor of the layer
  // through its stable address against the pattern of the weights it must hold.
  void forward(std::uint32_t layer) {
    pipe.forward(layer, [&, layer](host_stream& stream) {
      stream.enqueue([this, layer] {
        for (std::uint32_t e = 0; e < geometry.experts_per_layer(); ++e) {
          const expert_id id{layer, e};
          for (const expert_tensor t : {expert_tensor::gate_up, expert_tensor::down}) {
            const auto* words = reinterpret_cast<const std::uint64_t*>(pipe.address(id, t));
            mismatches.fetch_add(count_pattern_mismatches(words, storage.tensor_bytes(t) / 8, seed_of(geometry, id, t)),
                                 std::memory_order_relaxed);
            checked.fetch_add(1, std::memory_order_relaxed);
          }
        }
      });
    });
  }

  // Runs `iterations` forward passes, prefetching W − 1 layers ahead of the compute.
  void run(int iterations) {
    const std::uint32_t n = geometry.layers();
    const std::uint32_t ahead = std::min(pipe.window() - 1, n);
    for (std::uint32_t k = 0; k < ahead; ++k) pipe.materialize(k);
    for (int it = 0; it < iterations; ++it) {
      for (std::uint32_t i = 0; i < n; ++i) {
        forward(i);
        pipe.materialize((i + ahead) % n);
      }
    }
  }

  std::uint64_t stream_syncs() const {
    return compute.statistics().stream_syncs + load_gate_up.statistics().stream_syncs +
           load_down.statistics().stream_syncs;
  }
  std::size_t page_bytes() const {
    return pipe.space(expert_tensor::gate_up).page_bytes() + pipe.space(expert_tensor::down).page_bytes();
  }

  moe_geometry geometry;
  Vmm vm;
  budget_tracker budget;
  host_memory host;
  tensor_storage<host_stream> storage;
  host_stream compute, load_gate_up, load_down;
  std::atomic<std::uint64_t> mismatches{0}, checked{0};
  layer_pipeline<Vmm, host_stream> pipe;
};

TEST(LayerPipeline, StreamsEveryLayerThroughATwoLayerWindowWithOnlyEventFences) {
  // The TSan acceptance test: thousands of iterations, real asynchronous copies
  // on two loading streams, a compute stream that checks every tensor it reads
  // through its stable address. A missing WAR fence unmaps or overwrites a page
  // under the compute (a fault or mismatches); a missing RAW fence reads a page
  // before its copy (mismatches).
  constexpr int iterations = 2000;
  rig r(2, 4);
  r.run(iterations);
  r.pipe.drain();
  EXPECT_EQ(r.mismatches.load(), 0u);
  EXPECT_EQ(r.checked.load(), std::uint64_t{iterations} * 4 * 4 * expert_tensor_count);
  EXPECT_EQ(r.stream_syncs(), 0u) << "the protocol must never wait for a whole stream";
  const auto& s = r.pipe.statistics();
  EXPECT_EQ(s.cold_starts, 2u);
  EXPECT_EQ(s.layers_materialized, std::uint64_t{iterations} * 4 + 1);
  EXPECT_EQ(s.war_fences + s.war_already_done, s.layers_recycled);
  EXPECT_EQ(s.raw_fences, std::uint64_t{iterations} * 4 * expert_tensor_count);
  EXPECT_EQ(s.peak_bytes_mapped, 2 * 4 * r.page_bytes()) << "never more than W layers mapped";
  EXPECT_EQ(r.budget.root().used(), s.bytes_mapped);
  EXPECT_EQ(r.load_gate_up.statistics().copies + r.load_down.statistics().copies, s.pages_loaded);
}

TEST(LayerPipeline, RecyclesAlgorithmOnesTargetLayerAcrossIterations) {
  rig r(2, 6);
  const std::uint32_t n = 6;
  r.pipe.materialize(0);
  for (int it = 0; it < 3; ++it) {
    for (std::uint32_t k = 0; k < n; ++k) {
      r.forward(k);
      const std::uint32_t next = (k + 1) % n;
      const std::vector<std::uint32_t> before = r.pipe.window_layers();
      r.pipe.materialize(next);
      if (it == 0 && next == 1) {
        EXPECT_EQ(before.size(), next) << "cold start: nothing to recycle";
        continue;
      }
      // FluxMoE Algorithm 1, line 4, in its 1-based numbering: target = ((i − 3 + N) mod N) + 1.
      const std::uint32_t i1 = next + 1;
      const std::uint32_t target1 = ((i1 + n - 3) % n) + 1;
      ASSERT_EQ(before.size(), 2u);
      EXPECT_EQ(before.front() + 1, target1) << "materializing layer " << next << " in iteration " << it;
      EXPECT_EQ(r.pipe.window_layers(), (std::vector<std::uint32_t>{k, next}));
      for (std::uint32_t e = 0; e < 4; ++e) {
        EXPECT_EQ(r.pipe.state({before.front(), e}, expert_tensor::gate_up), page_state::unmapped);
      }
    }
  }
  r.pipe.drain();
  EXPECT_EQ(r.mismatches.load(), 0u);
}

TEST(LayerPipeline, AddressesNeverChange) {
  rig r(2, 4);
  std::map<std::pair<std::uint64_t, int>, std::byte*> first;
  for (std::uint64_t flat = 0; flat < r.geometry.expert_count(); ++flat) {
    for (const expert_tensor t : {expert_tensor::gate_up, expert_tensor::down}) {
      first[{flat, static_cast<int>(t)}] = r.pipe.address(r.geometry.expert_at(flat), t);
    }
  }
  r.run(3);
  r.pipe.drain();
  for (const auto& [key, address] : first) {
    EXPECT_EQ(r.pipe.address(r.geometry.expert_at(key.first), static_cast<expert_tensor>(key.second)), address);
  }
  EXPECT_EQ(r.mismatches.load(), 0u);
}

TEST(LayerPipeline, AWindowCoveringTheModelLoadsEachExpertOnce) {
  rig r(8, 4);
  r.run(5);
  r.pipe.drain();
  EXPECT_EQ(r.pipe.statistics().pages_loaded, 4u * 4 * expert_tensor_count);
  EXPECT_EQ(r.pipe.statistics().layers_recycled, 0u);
  EXPECT_EQ(r.pipe.state({3, 3}, expert_tensor::down), page_state::resident);
  EXPECT_EQ(r.mismatches.load(), 0u);
}

TEST(LayerPipeline, TheWindowGrowsAndShrinksBetweenIterations) {
  rig r(2, 6);
  r.run(2);
  EXPECT_EQ(r.pipe.statistics().peak_bytes_mapped, 2 * 4 * r.page_bytes());
  r.pipe.set_window(4);
  // The loop prefetches W − 1 = 3 layers ahead now.
  for (std::uint32_t i = 0; i < 6; ++i) {
    r.forward(i);
    r.pipe.materialize((i + 1) % 6);
    r.pipe.materialize((i + 2) % 6);
    r.pipe.materialize((i + 3) % 6);
  }
  EXPECT_EQ(r.pipe.statistics().peak_bytes_mapped, 4 * 4 * r.page_bytes());
  const std::size_t created_wide = r.pipe.pool(expert_tensor::gate_up).created();
  r.pipe.set_window(2);  // recycles the oldest forwarded layers now and trims the pools
  EXPECT_LE(r.pipe.window_layers().size(), 3u);
  EXPECT_LT(r.pipe.pool(expert_tensor::gate_up).created(), created_wide);
  EXPECT_EQ(r.budget.root().used(), r.pipe.statistics().bytes_mapped);
  for (std::uint32_t i = 0; i < 6; ++i) {
    r.forward(i);
    r.pipe.materialize((i + 1) % 6);
  }
  r.pipe.drain();
  EXPECT_EQ(r.mismatches.load(), 0u);
  EXPECT_THROW(r.pipe.set_window(1), invalid_argument);
}

TEST(LayerPipeline, PinnedExpertsStayResidentAndAreNotReloaded) {
  rig r(2, 4);
  r.pipe.pin({1, 2});
  r.pipe.pin({3, 0});
  r.pipe.pin({3, 0});  // idempotent
  EXPECT_TRUE(r.pipe.pinned({1, 2}));
  std::byte* const pinned_page = r.pipe.address({1, 2}, expert_tensor::gate_up);
  r.run(10);
  r.pipe.drain();
  EXPECT_EQ(r.mismatches.load(), 0u);
  EXPECT_EQ(r.pipe.state({1, 2}, expert_tensor::gate_up), page_state::resident);
  EXPECT_EQ(r.pipe.address({1, 2}, expert_tensor::gate_up), pinned_page);
  // Pinning loaded 2 experts (4 pages); then 41 materializations loaded only unpinned pages:
  // layer 0 eleven times (8 pages), layers 1 and 3 ten times (6), layer 2 ten times (8).
  EXPECT_EQ(r.pipe.statistics().pages_loaded, 4u + 11 * 8 + 10 * (6 + 8 + 6));
  EXPECT_EQ(r.pipe.statistics().pinned_experts, 2u);
  EXPECT_EQ(r.budget.root().used(), r.pipe.statistics().bytes_mapped);
  // Layer 1 is not in the window now: unpinning unmaps its page behind the layer's events.
  ASSERT_EQ(r.pipe.window_layers(), (std::vector<std::uint32_t>{3, 0}));
  r.pipe.unpin({1, 2});
  EXPECT_EQ(r.pipe.state({1, 2}, expert_tensor::gate_up), page_state::unmapped);
  // Layer 3 is in the window: its page stays until the layer is recycled.
  r.pipe.unpin({3, 0});
  EXPECT_NE(r.pipe.state({3, 0}, expert_tensor::gate_up), page_state::unmapped);
  EXPECT_EQ(r.budget.root().used(), r.pipe.statistics().bytes_mapped);
}

TEST(LayerPipeline, AWhollyPinnedLayerNeedsNoMaterialization) {
  rig r(2, 4);
  for (std::uint32_t e = 0; e < 4; ++e) r.pipe.pin({2, e});
  r.run(3);
  r.pipe.drain();
  EXPECT_EQ(r.mismatches.load(), 0u);
  EXPECT_EQ(r.checked.load(), 3u * 4 * 4 * expert_tensor_count);
}

TEST(LayerPipeline, RejectsMisuseWithoutChangingAnything) {
  rig r(2, 4);
  EXPECT_THROW(r.pipe.materialize(4), invalid_argument);
  EXPECT_THROW(r.forward(0), invalid_argument);  // not materialized
  EXPECT_THROW(r.pipe.pin({0, 4}), invalid_argument);
  r.pipe.materialize(0);
  r.pipe.materialize(1);
  try {
    r.pipe.materialize(2);  // the window is full of layers not yet forwarded
    ADD_FAILURE() << "materialize past an unforwarded window did not throw";
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("layer 0 has not been forwarded"));
  }
  EXPECT_EQ(r.pipe.window_layers(), (std::vector<std::uint32_t>{0, 1}));
  EXPECT_EQ(r.budget.root().used(), 2 * 4 * r.page_bytes());
  const auto bad = static_cast<expert_tensor>(2);  // neither tensor: it indexed past the spaces
  EXPECT_THAT(
      [&] {
        (void)r.pipe.address({0, 0}, bad);
      },
      ::testing::ThrowsMessage<invalid_argument>(HasSubstr("expert_tensor 2 out of range {gate_up, down}")));
  EXPECT_THROW((void)r.pipe.state({0, 0}, bad), invalid_argument);
  EXPECT_THROW((void)r.pipe.pool(bad), invalid_argument);
  EXPECT_THROW((layer_pipeline<host_vmm, host_stream>(r.vm, r.geometry, precision::bf16, r.budget.root(), r.storage,
                                                      r.compute, r.load_gate_up, r.load_down, {.window = 1})),
               invalid_argument);
  EXPECT_THROW((layer_pipeline<host_vmm, host_stream>(r.vm, r.geometry, precision::int4, r.budget.root(), r.storage,
                                                      r.compute, r.load_gate_up, r.load_down, {})),
               invalid_argument);
  // A storage of another precision of the same size, or of another model whose tensors have the
  // same bytes: both were accepted (the first filled bf16 pages with fp16 weights, the second
  // failed at its first missing layer, naming the storage's geometry).
  using pipeline = layer_pipeline<host_vmm, host_stream>;
  tensor_storage<host_stream> fp16(r.geometry, precision::fp16, r.host);
  EXPECT_THAT(
      [&] {
        pipeline(r.vm, r.geometry, precision::bf16, r.budget.root(), fp16, r.compute, r.load_gate_up, r.load_down, {});
      },
      ::testing::ThrowsMessage<invalid_argument>(HasSubstr("the storage holds fp16 tensors, expected bf16")));
  tensor_storage<host_stream> shorter(small(2), precision::bf16, r.host);
  EXPECT_THAT(
      [&] {
        pipeline(r.vm, r.geometry, precision::bf16, r.budget.root(), shorter, r.compute, r.load_gate_up, r.load_down,
                 {});
      },
      ::testing::ThrowsMessage<invalid_argument>(
          HasSubstr("the storage holds 2 layers × 4 experts ('small'), the geometry 'small' has 4 × 4")));
}

// A launch that throws after enqueuing work: the layer counts as not forwarded (materialize()
// refuses to recycle it) and its compute event covers the queued work, so that the page stays
// mapped until that work has run. An earlier forward's event and mark were kept: the next
// materialize() recycled the layer and unmapped its pages under the queued kernel.
TEST(LayerPipeline, ALaunchThatThrowsLeavesItsLayerUnforwardedAndFenced) {
  rig r(2, 4);
  r.pipe.materialize(0);
  r.forward(0);
  std::promise<void> gate;
  std::atomic<bool> mapped_when_run{false};
  const expert_id id{0, 1};
  EXPECT_THROW(r.pipe.forward(0,
                              [&](host_stream& stream) {
                                stream.enqueue([&, opened = gate.get_future().share()] {
                                  opened.wait();
                                  mapped_when_run =
                                      r.vm.block_at(r.pipe.address(id, expert_tensor::gate_up)).has_value();
                                });
                                throw std::runtime_error("the launch failed after enqueuing a kernel");
                              }),
               std::runtime_error);
  r.pipe.materialize(1);
  EXPECT_THAT([&] { r.pipe.materialize(2); },
              ::testing::ThrowsMessage<invalid_argument>(HasSubstr("layer 0 has not been forwarded")));
  EXPECT_EQ(r.pipe.window_layers(), (std::vector<std::uint32_t>{0, 1}));
  gate.set_value();
  r.forward(0);
  r.pipe.materialize(2);  // recycles layer 0 behind its compute event
  r.pipe.drain();
  EXPECT_TRUE(mapped_when_run);
  EXPECT_EQ(r.mismatches, 0U);
}

TEST(LayerPipeline, ACompressedStorageIsDecodedIntoThePagesByItsLoader) {
  // The decompressor hook (FluxMoE §4.2's compressed backend, on the host): the
  // storage holds each tensor as a bf16 exponent-coded container, the loader
  // decodes it into the page on the loading stream.
  const moe_geometry g = small(4);
  host_vmm vm({.granularity = 64_KiB});
  budget_tracker budget(1_GiB);
  host_memory host({.block_size = 64_KiB, .alignment = 64_KiB});
  const auto decode = [](std::span<const std::byte> stored, std::span<std::byte> page, host_stream& stream) {
    stream.enqueue([stored, page] {
      decode_bf16(stored, {reinterpret_cast<std::uint16_t*>(page.data()), page.size() / 2});
    });
  };
  // Slots sized for the worst case of a container (a little over the raw tensor).
  const std::size_t gu = g.tensor_bytes(expert_tensor::gate_up, precision::bf16);
  const std::size_t dn = g.tensor_bytes(expert_tensor::down, precision::bf16);
  tensor_storage<host_stream> storage(g, precision::bf16, host, {.slot_bytes = {2 * gu, 2 * dn}, .loader = decode});
  std::vector<std::vector<std::uint16_t>> weights;
  std::uint64_t compressed = 0, raw = 0;
  for (std::uint64_t flat = 0; flat < g.expert_count(); ++flat) {
    for (const expert_tensor t : {expert_tensor::gate_up, expert_tensor::down}) {
      const expert_id id = g.expert_at(flat);
      std::vector<std::uint16_t> w(storage.tensor_bytes(t) / 2);
      std::uint64_t x = seed_of(g, id, t);
      for (auto& v : w) {  // bf16 of small normal-ish weights: exponents cluster, so they compress
        x = x * 6364136223846793005ULL + 1442695040888963407ULL;
        v = static_cast<std::uint16_t>(0x3c00u + ((x >> 33) % 0x0400u) + ((x >> 20) & 1u ? 0x8000u : 0u));
      }
      const std::vector<std::byte> blob = encode_bf16(w);
      ASSERT_LE(blob.size(), storage.slot_bytes(t));
      std::memcpy(storage.slot(id, t).data(), blob.data(), blob.size());
      storage.set_stored_bytes(id, t, blob.size());
      compressed += blob.size();
      raw += storage.tensor_bytes(t);
      weights.push_back(std::move(w));
    }
  }
  EXPECT_LT(compressed, raw);
  host_stream compute("compute"), load_gate_up("load.gate_up"), load_down("load.down");
  std::atomic<std::uint64_t> bad{0};
  {
    layer_pipeline pipe(vm, g, precision::bf16, budget.root(), storage, compute, load_gate_up, load_down);
    pipe.materialize(0);
    for (int it = 0; it < 3; ++it) {
      for (std::uint32_t i = 0; i < 4; ++i) {
        pipe.forward(i, [&, i](host_stream& s) {
          s.enqueue([&, i] {
            for (std::uint32_t e = 0; e < 4; ++e) {
              for (const expert_tensor t : {expert_tensor::gate_up, expert_tensor::down}) {
                const auto& w = weights[g.flat_index({i, e}) * expert_tensor_count + static_cast<std::size_t>(t)];
                bad += std::memcmp(pipe.address({i, e}, t), w.data(), w.size() * 2) != 0;
              }
            }
          });
        });
        pipe.materialize((i + 1) % 4);
      }
    }
    pipe.drain();
  }
  EXPECT_EQ(bad.load(), 0u);
}

// Slots smaller than the decoded tensor (a compressed store): until set_stored_bytes() a tensor's
// stored bytes are its whole slot, never past it (they were the decoded size, reading into the
// next slot and, for the last expert, past the store); sizes beyond 2^50 are refused.
TEST(TensorStorage, StoredBytesNeverRunPastTheSlot) {
  const moe_geometry g = small(2);
  host_memory host({.block_size = 64_KiB, .alignment = 64_KiB});
  const std::size_t gu = g.tensor_bytes(expert_tensor::gate_up, precision::bf16);
  tensor_storage<host_stream> storage(g, precision::bf16, host, {.slot_bytes = {1024, 512}, .loader = {}});
  ASSERT_LT(1024U, gu);
  const expert_id last = g.expert_at(g.expert_count() - 1);
  for (const expert_tensor t : {expert_tensor::gate_up, expert_tensor::down}) {
    EXPECT_EQ(storage.stored(last, t).size(), storage.slot_bytes(t));
    EXPECT_LE(storage.stored(last, t).data() + storage.stored(last, t).size(),
              storage.slot(g.expert_at(0), expert_tensor::gate_up).data() + storage.bytes());
  }
  EXPECT_EQ(storage.slot_bytes(expert_tensor::gate_up), 1024U);
  // An integer cast to expert_tensor that is neither tensor: slot() handed out a span past the store.
  const auto bad = static_cast<expert_tensor>(2);
  EXPECT_THAT([&] { (void)storage.slot(last, bad); },
              ::testing::ThrowsMessage<invalid_argument>(HasSubstr("expert_tensor 2 out of range {gate_up, down}")));
  EXPECT_THROW((void)storage.stored(last, bad), invalid_argument);
  EXPECT_THROW((void)storage.slot_bytes(bad), invalid_argument);
  EXPECT_THROW((void)storage.tensor_bytes(bad), invalid_argument);
  EXPECT_THROW(storage.set_stored_bytes(last, bad, 0), invalid_argument);
  try {
    tensor_storage<host_stream> huge(g, precision::bf16, host,
                                     {.slot_bytes = {~std::size_t{0} - 1, 1 << 21}, .loader = {}});
    FAIL() << "a slot of 2^64 - 2 bytes accepted";
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("slot_bytes[0] = 18446744073709551614 out of range [0, 2^50]"));
  }
}

// Without a loader the stored bytes are copied into the page as they are: more than the tensor
// (a slot rounded up to 256 bytes, or a larger slot_bytes) is refused where it is recorded, and a
// load never writes past a page of tensor_bytes (it did: a heap overflow under ASan).
TEST(TensorStorage, CopiedStoredBytesNeverExceedThePage) {
  const moe_geometry g = small(2);
  host_memory host({.block_size = 64_KiB, .alignment = 64_KiB});
  const std::size_t gu = g.tensor_bytes(expert_tensor::gate_up, precision::bf16);
  tensor_storage<host_stream> storage(g, precision::bf16, host, {.slot_bytes = {gu + 4096, 0}, .loader = {}});
  const expert_id id = g.expert_at(0);
  EXPECT_THAT(
      [&] { storage.set_stored_bytes(id, expert_tensor::gate_up, gu + 1); },
      ::testing::ThrowsMessage<invalid_argument>(HasSubstr(fmt::format("{} bytes out of range [0, {}]", gu + 1, gu))));
  EXPECT_EQ(storage.stored(id, expert_tensor::gate_up).size(), gu) << "unchanged";
  storage.set_stored_bytes(id, expert_tensor::gate_up, gu);  // the whole tensor: allowed
  std::vector<std::byte> page(gu);
  std::ranges::fill(storage.slot(id, expert_tensor::gate_up), std::byte{7});
  host_stream s("load");
  storage.load(id, expert_tensor::gate_up, page, s);
  s.synchronize();
  EXPECT_TRUE(std::ranges::all_of(page, [](std::byte b) { return b == std::byte{7}; }));
  // With a loader, the stored form may fill the slot: the loader reads all of it and writes the
  // page's tensor_bytes.
  std::vector<std::pair<std::size_t, std::size_t>> calls;  // (stored bytes, page bytes) per load
  tensor_storage<host_stream> coded(
      g, precision::bf16, host,
      {.slot_bytes = {gu + 4096, 0},
       .loader = [&](std::span<const std::byte> in, std::span<std::byte> out, host_stream&) {
         calls.emplace_back(in.size(), out.size());
         std::ranges::fill(out, std::byte{9});
       }});
  const std::size_t whole = coded.slot_bytes(expert_tensor::gate_up);
  ASSERT_GT(whole, gu);
  coded.set_stored_bytes(id, expert_tensor::gate_up, whole);
  coded.load(id, expert_tensor::gate_up, page, s);
  s.synchronize();
  EXPECT_EQ(calls, (std::vector<std::pair<std::size_t, std::size_t>>{{whole, gu}}));
  EXPECT_TRUE(std::ranges::all_of(page, [](std::byte b) { return b == std::byte{9}; }));
}

// Fault injection: whatever step of a materialization fails, the layer's pages
// are unmapped, their blocks are back in the pools and the budget is unchanged.
class LayerPipelineFaults : public ::testing::TestWithParam<int> {};

void expect_layer_clean(rig<failing_vmm>& r, std::uint32_t layer, std::uint64_t budget_before) {
  for (std::uint32_t e = 0; e < 4; ++e) {
    for (const expert_tensor t : {expert_tensor::gate_up, expert_tensor::down}) {
      EXPECT_EQ(r.pipe.state({layer, e}, t), page_state::unmapped) << "expert " << e;
    }
  }
  EXPECT_EQ(r.budget.root().used(), budget_before);
  EXPECT_EQ(r.pipe.pool(expert_tensor::gate_up).leased() * 64_KiB + r.pipe.pool(expert_tensor::down).leased() * 64_KiB,
            budget_before);
}

TEST_P(LayerPipelineFaults, AFailingMapAccessOrCreateLeavesTheLayerUnmapped) {
  const int n = GetParam();  // fail the n-th call of the layer's 8 pages
  for (int which = 0; which < 3; ++which) {
    rig<failing_vmm> r(2, 4);
    r.pipe.materialize(0);
    r.forward(0);
    const std::uint64_t before = r.budget.root().used();
    (which == 0 ? r.vm.fail_map_in : which == 1 ? r.vm.fail_access_in : r.vm.fail_create_in) = n;
    EXPECT_THROW(r.pipe.materialize(1), out_of_memory) << "step " << which << ", call " << n;
    expect_layer_clean(r, 1, before);
    EXPECT_EQ(r.pipe.window_layers(), (std::vector<std::uint32_t>{0}));
    // The pipeline goes on as if the failure had not happened.
    r.vm.heal();
    r.pipe.materialize(1);
    r.forward(1);
    r.pipe.materialize(2);
    r.forward(2);
    r.pipe.drain();
    EXPECT_EQ(r.mismatches.load(), 0u);
  }
}

TEST_P(LayerPipelineFaults, AFailingCopyLeavesTheLayerUnmapped) {
  const int n = GetParam();
  int loads = 0;
  std::optional<int> fail_at;
  // A loader that enqueues half of its copy, then fails to enqueue the rest (a
  // decompressor whose second launch fails): the pipeline must wait for the
  // half already in flight before it unmaps the page.
  rig<failing_vmm> r(2, 4, [&](std::span<const std::byte> stored, std::span<std::byte> page, host_stream& stream) {
    const std::size_t half = stored.size() / 2;
    stream.copy(page.data(), stored.data(), half);
    if (fail_at && ++loads == *fail_at) throw out_of_memory("injected copy failure");
    stream.copy(page.data() + half, stored.data() + half, stored.size() - half);
  });
  r.pipe.materialize(0);
  r.forward(0);
  const std::uint64_t before = r.budget.root().used();
  fail_at = n;
  EXPECT_THROW(r.pipe.materialize(1), out_of_memory);
  expect_layer_clean(r, 1, before);
  fail_at.reset();
  r.pipe.materialize(1);
  r.forward(1);
  r.pipe.drain();
  EXPECT_EQ(r.mismatches.load(), 0u);
}

TEST_P(LayerPipelineFaults, AFailedPinLeavesTheExpertUnmapped) {
  rig<failing_vmm> r(2, 4);
  const std::uint64_t before = r.budget.root().used();
  r.vm.fail_map_in = GetParam() % 2 + 1;  // the gate_up or the down page
  EXPECT_THROW(r.pipe.pin({2, 1}), out_of_memory);
  EXPECT_FALSE(r.pipe.pinned({2, 1}));
  EXPECT_EQ(r.pipe.state({2, 1}, expert_tensor::gate_up), page_state::unmapped);
  EXPECT_EQ(r.pipe.state({2, 1}, expert_tensor::down), page_state::unmapped);
  EXPECT_EQ(r.budget.root().used(), before);
}

INSTANTIATE_TEST_SUITE_P(EveryPage, LayerPipelineFaults, ::testing::Range(1, 9));

TEST(LayerPipelineFaults, ABudgetRefusalLeavesTheLayerUnmapped) {
  rig r(2, 4);
  r.pipe.materialize(0);
  r.forward(0);
  const std::uint64_t before = r.budget.root().used();
  (void)r.budget.root().set_capacity(before + 3 * r.page_bytes());  // room for 3 of the layer's 4 experts
  EXPECT_THROW(r.pipe.materialize(1), out_of_budget);
  for (std::uint32_t e = 0; e < 4; ++e) EXPECT_EQ(r.pipe.state({1, e}, expert_tensor::gate_up), page_state::unmapped);
  EXPECT_EQ(r.budget.root().used(), before);
}

// A stream with CUDA's sticky errors: once a copy on it fails, every later call on it fails.
struct sticky_stream {
  struct event_type {
    [[nodiscard]] bool query() const { return true; }
    void synchronize() const {}
  };
  void copy(void* dst, const void* src, std::size_t n) {
    if (fail_next_copy) failed = true;
    if (failed) throw std::runtime_error("sticky_stream: copy failed");
    std::memcpy(dst, src, n);
  }
  void record(event_type&) const {
    if (failed) throw std::runtime_error("sticky_stream: record after a failed copy");
  }
  void wait(const event_type&) const {
    if (failed) throw std::runtime_error("sticky_stream: wait after a failed copy");
  }
  bool fail_next_copy = false;
  bool failed = false;
};

// A failed copy whose stream then refuses the fence too (a CUDA stream's sticky error): the page
// is unmapped all the same and its blocks and bytes go back; once the stream works again the
// layer loads. (The fence's failure used to skip the unmap: the page stayed "loading" and its
// mapped block went back to the pool.)
TEST(LayerPipelineFaults, AStreamThatFailsTheFenceToo) {
  const moe_geometry g = small(4);
  host_vmm vm({.granularity = 64_KiB});
  budget_tracker budget(1_GiB);
  host_memory host({.block_size = 64_KiB, .alignment = 64_KiB});
  tensor_storage<sticky_stream> storage(g, precision::bf16, host);
  sticky_stream compute, load_gate_up, load_down;
  {
    layer_pipeline<host_vmm, sticky_stream> pipe(vm, g, precision::bf16, budget.root(), storage, compute, load_gate_up,
                                                 load_down, {.window = 2});
    load_gate_up.fail_next_copy = true;
    EXPECT_THROW(pipe.materialize(0), std::runtime_error);
    for (std::uint32_t e = 0; e < 4; ++e) {
      EXPECT_EQ(pipe.state({0, e}, expert_tensor::gate_up), page_state::unmapped) << "expert " << e;
      EXPECT_EQ(pipe.state({0, e}, expert_tensor::down), page_state::unmapped) << "expert " << e;
    }
    EXPECT_EQ(budget.root().used(), 0U);
    EXPECT_EQ(pipe.pool(expert_tensor::gate_up).leased(), 0U);
    EXPECT_FALSE(vm.block_at(pipe.address({0, 0}, expert_tensor::gate_up)).has_value());
    load_gate_up = sticky_stream{};  // the device recovers
    pipe.materialize(0);
    EXPECT_NE(pipe.state({0, 0}, expert_tensor::gate_up), page_state::unmapped) << "loaded again";
  }
  EXPECT_EQ(vm.blocks(), 0U) << "no block leaked";
}

// unpin() waits for the layer's events before it changes anything: when a wait throws (a copy
// that failed on a CUDA-like stream, whose events then throw), the pin stays and nothing moves.
// It used to drop the pin first, leaving the page mapped and charged with nothing to unmap it.
TEST(LayerPipelineFaults, AnUnpinWhoseWaitThrowsKeepsThePin) {
  const moe_geometry g = small(4);
  host_vmm vm({.granularity = 64_KiB});
  budget_tracker budget(1_GiB);
  host_memory host({.block_size = 64_KiB, .alignment = 64_KiB});
  tensor_storage<testing::cuda_like_stream> storage(g, precision::bf16, host);
  testing::cuda_like_stream compute("compute"), load_gate_up("load.gate_up"), load_down("load.down");
  layer_pipeline<host_vmm, testing::cuda_like_stream> pipe(vm, g, precision::bf16, budget.root(), storage, compute,
                                                           load_gate_up, load_down, {.window = 2});
  const expert_id id{.layer = 2, .expert = 1};
  std::promise<void> gate;  // the copy fails once pin() has returned, as on a device
  load_gate_up.enqueue([opened = gate.get_future().share()] { opened.wait(); });
  load_gate_up.fail_copy_in = 1;
  pipe.pin(id);
  gate.set_value();
  load_gate_up.drain();
  const std::size_t used = budget.root().used();
  const auto stats = pipe.statistics();
  EXPECT_THROW(pipe.unpin(id), cuda_error);
  EXPECT_TRUE(pipe.pinned(id));
  EXPECT_EQ(budget.root().used(), used);
  EXPECT_EQ(pipe.statistics().pinned_experts, stats.pinned_experts);
  EXPECT_EQ(pipe.statistics().war_fences + pipe.statistics().war_already_done,
            stats.war_fences + stats.war_already_done);
}

}  // namespace
}  // namespace expage

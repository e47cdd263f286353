// moe_decode: a real MoE decode loop on the host backend, every expert weight read through an
// expert_runtime under a budget that is a fraction of the experts' bytes.
//
// Per token and layer: router top-k on the hidden state (moe/routing.hpp), or the routing of a
// recorded trace (--trace FILE); group the (token, k) pairs by expert; acquire the routed experts
// from the runtime (hits at once, misses loaded on the copy stream); run the reference SwiGLU
// expert FFN on the compute stream, reading the weights through one of the runtime's views
// (--view records|stable|slots); release the lease after the FFN, in stream order. Every layer's
// output is checked bit for bit against the same FFN over all-resident weights in the precision
// each expert was served at (read from the generator or the --weights file, not through the
// runtime); below bf16 the distance to all-bf16 weights is printed beside it.
//
// On a GPU (--backend cuda, in a build with CUDA): the same loop with
// expert_runtime<cuda::cuda_vmm, cuda::cuda_stream, Policy>, the experts' stored bytes in pinned host
// memory (tensor_storage) copied raw into the pages on the copy stream (bf16, or the group_quant
// packing of int4/int8, which the kernel dequantizes as it reads), the records view mirrored on the
// device (cuda::device_mirror, updated on the compute stream) and the FFN run by
// cuda::expert_ffn_async() on the compute stream. Routing stays on the host. Every layer is checked
// against the host FFN over all-resident weights in the precision each expert was served at,
// within the device FFN's documented bound (not bit for bit: the kernel sums in another order).
// Without a device it says so and exits with status 2, as for unusable options.
//
// Weights come from seeds: held in host memory when they fit (--host-limit), otherwise generated
// by the loader itself (the full-size model needs no full-size memory); or from a safetensors
// file (--weights FILE, written by --write-weights FILE). Held weights are copied into the pages
// by a host_copy_engine in the copy stream's order (--copy-threads workers, 1 by default, beside
// the copy stream's own thread; 0: host_stream::copy on that thread alone).
//
// Mixed precision (--lo-precision int4): the runtime holds two tiers under the one budget
// (--hi-share of it for bf16 versions, the rest for int4 ones). A miss loads the int4 version and
// is served at once; DynaExq's hot_set_controller (EMA hotness, per-layer top-n with hysteresis,
// control/hot_set_controller.hpp) picks each layer's hi set every --interval tokens and the
// runtime promotes and demotes in the background (update_targets(), publish-then-switch). Every
// layer is then checked bit-exact against all-resident weights in the precision each expert was
// served at, and its distance to the all-bf16 output is reported.
//
// Four pools (--lo-precision int4 --four-pool): hi and lo versions and a KV cache under one
// budget; the four-pool controller (control/four_pool_controller.hpp) decides the split at a
// drained barrier every --burst passes and the hi sets every --interval passes, four_pool_driver
// applies them to the runtime and to a KV block pool fed by a session preset (four_pool_side
// below; docs/control.md, "The runtime's side").
//
//   moe_decode                                   OLMoE-1B-7B at 1/8 scale, 25% budget, 32 tokens
//   moe_decode --geometry mixtral-8x7b --scale 16 --trace ../shared/traces/.../humaneval_2_routing.jsonl
//   moe_decode --quick                           a short run (the CI test)
//   moe_decode --lo-precision int4 --hi-share 50%  two tiers, the hot set in bf16
//   moe_decode --lo-precision int4 --four-pool   hi, lo and KV split online under one budget
//   moe_decode --trace-out trace.json --json stats.json
//   moe_decode --backend cuda --geometry mixtral-8x7b --scale 16 --tokens 16   on a GPU
#include <expage/expage.hpp>
#include <expage/runtime/expert_runtime.hpp>
#include <expage/runtime/runtime_prefetcher.hpp>

#if EXPAGE_MOE_DECODE_CUDA
#include <expage/cuda/cuda_stream.hpp>
#include <expage/cuda/cuda_vmm.hpp>
#include <expage/cuda/device_mirror.hpp>
#include <expage/cuda/expert_ffn.hpp>
#include <expage/cuda/pinned_host_memory.hpp>
#include <expage/cuda/runtime.hpp>

#include <cuda_runtime_api.h>
#endif

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <limits>
#include <map>
#include <memory>
#include <new>
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <typeinfo>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace {

using namespace expage::literals;
using expage::expert_id;
using expage::expert_tensor;
using expage::precision;
using clock_type = std::chrono::steady_clock;

struct usage_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct options {
  std::string geometry = "olmoe-1b-7b";
  std::uint32_t scale = 8;
  std::uint32_t tokens = 0;      // 0: 32 tokens routed by the model, or the whole trace
  bool tokens_by_quick = false;  // `tokens` is --quick's 4, not given
  double budget = 0.25;
  std::string trace;
  std::string trace_out;
  std::string json;
  std::string weights;
  std::string write_weights;
  std::string view = "records";
  std::string backend = "host";
  precision format = precision::bf16;
  std::optional<precision> lo_format;  // two tiers: --lo-precision
  double hi_share = 0.5;               // of the budget, for the hi tier
  std::uint32_t hi_per_layer = 0;      // the hot set's size per layer; 0: what the hi tier holds
  std::uint32_t interval = 2;          // forward passes per hot-set interval
  bool interval_given = false;         // --interval was on the command line
  std::string policy = "lru";
  std::string prefetch = "none";
  std::optional<expage::coactivation_pooling> pooling;  // --pooling, for --prefetch coactivation
  std::uint32_t duel_passes = 16;  // with --prefetch and a policy other than lru: the eviction duel's window
  bool duel_passes_given = false;  // --duel-passes was on the command line (refused where no duel runs)
  std::uint64_t host_limit = 4_GiB;
  bool check = true;
  bool physics = false;
  std::uint32_t copy_threads = 1;   // host: the copy engine's workers beside the copy stream's thread; 0: no engine
  bool copy_threads_given = false;  // --copy-threads was on the command line (refused with --backend cuda)
  std::uint32_t problem = std::numeric_limits<std::uint32_t>::max();
  // --four-pool: hi, lo and KV under one budget, split by the four-pool controller.
  bool four_pool = false;
  std::string kv_sessions = "phase-shift";  // the KV workload's session preset
  std::uint32_t burst = 8;                  // passes between drained barriers
  bool burst_given = false;                 // --burst was on the command line
  std::string hardware = "pcie4";           // the costs the controller decides with
  std::uint64_t kv_per_token = 0;           // 0: a quarter of the budget for the busiest step's KV
  std::string_view four_pool_option;        // the last option given that only --four-pool reads
};

[[noreturn]] void usage(const std::string& why) { throw usage_error(why); }

std::uint64_t parse_uint(std::string_view flag, std::string_view v, std::uint64_t lo, std::uint64_t hi) {
  std::uint64_t x = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
  if (ec != std::errc{} || end != v.data() + v.size() || x < lo || x > hi) {
    usage(fmt::format("{} '{}' is not an integer in [{}, {}]", flag, v, lo, hi));
  }
  return x;
}

// @p v when it is one of @p choices; else the refusal names them ("is not a, b or c").
std::string_view one_of(std::string_view flag, std::string_view v, std::initializer_list<std::string_view> choices) {
  if (std::find(choices.begin(), choices.end(), v) != choices.end()) return v;
  std::string names;
  std::size_t i = 0;
  for (const std::string_view c : choices) {
    names += fmt::format("{}{}", i == 0 ? "" : i + 1 == choices.size() ? " or " : ", ", c);
    ++i;
  }
  usage(fmt::format("{} '{}' is not {}", flag, v, names));
}

// A whole percentage in [1%, 100%] (@p example in the message), as a share.
double parse_percent(std::string_view flag, std::string_view v, std::string_view example) {
  if (v.empty() || v.back() != '%') {
    usage(fmt::format("{} '{}' must be a whole percentage in [1%, 100%], e.g. {}", flag, v, example));
  }
  const std::string_view digits = v.substr(0, v.size() - 1);
  std::uint64_t percent = 0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), percent);
  if (ec != std::errc{} || end != digits.data() + digits.size() || percent < 1 || percent > 100) {
    usage(fmt::format("{} '{}' is not a whole percentage in [1%, 100%]", flag, v));
  }
  return static_cast<double>(percent) / 100.0;
}

options parse(int argc, char** argv) {
  options o;
  std::string_view tier_option;         // the last of --hi-share, --hi-per-layer, --interval given
  std::string_view sizing_option;       // the last of --hi-share, --hi-per-layer given
  std::vector<std::string_view> given;  // every flag, in order
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    given.push_back(a);
    const auto value = [&]() -> std::string_view {
      if (i + 1 >= argc) usage(fmt::format("{} needs a value", a));
      const std::string_view v = argv[i + 1];
      // An empty value would read as "not given" (every option's default is empty or its own),
      // and a flag as a value is a value forgotten (./--x names such a file).
      if (v.empty()) usage(fmt::format("{} needs a value, not an empty one", a));
      if (v.starts_with("--")) usage(fmt::format("{} needs a value, not the flag {} (./{} for a file)", a, v, v));
      return argv[++i];
    };
    if (a == "--geometry") {
      o.geometry = value();
    } else if (a == "--scale") {
      o.scale = static_cast<std::uint32_t>(parse_uint(a, value(), 1, 1024));
    } else if (a == "--tokens") {
      o.tokens = static_cast<std::uint32_t>(parse_uint(a, value(), 1, 1U << 24));
    } else if (a == "--budget") {
      o.budget = parse_percent(a, value(), "25%");
    } else if (a == "--trace") {
      o.trace = value();
    } else if (a == "--problem") {
      o.problem = static_cast<std::uint32_t>(parse_uint(a, value(), 0, 1U << 30));
    } else if (a == "--trace-out") {
      o.trace_out = value();
    } else if (a == "--json") {
      o.json = value();
    } else if (a == "--weights") {
      o.weights = value();
    } else if (a == "--write-weights") {
      o.write_weights = value();
    } else if (a == "--view") {
      o.view = one_of(a, value(), {"records", "stable", "slots"});
    } else if (a == "--backend") {
      o.backend = one_of(a, value(), {"host", "cuda"});
    } else if (a == "--precision") {
      o.format = one_of(a, value(), {"bf16", "int4"}) == "bf16" ? precision::bf16 : precision::int4;
    } else if (a == "--lo-precision") {
      o.lo_format = one_of(a, value(), {"int4", "int8"}) == "int4" ? precision::int4 : precision::int8;
    } else if (a == "--hi-share") {
      tier_option = sizing_option = a;
      o.hi_share = parse_percent(a, value(), "50%");  // from 1%: 0% would leave the hot set no hi slot
    } else if (a == "--hi-per-layer") {
      tier_option = sizing_option = a;
      o.hi_per_layer = static_cast<std::uint32_t>(parse_uint(a, value(), 1, 1U << 20));
    } else if (a == "--interval") {
      tier_option = a;
      o.interval = static_cast<std::uint32_t>(parse_uint(a, value(), 1, 1U << 20));
      o.interval_given = true;
    } else if (a == "--policy") {
      o.policy = one_of(a, value(), {"lru", "lfu", "next-turn"});
    } else if (a == "--prefetch") {
      o.prefetch = one_of(a, value(), {"none", "coactivation", "frequency", "previous", "fmoe"});
    } else if (a == "--pooling") {
      try {
        o.pooling = expage::parse_coactivation_pooling(value());
      } catch (const expage::invalid_argument& e) {
        usage(fmt::format("--pooling: {}", e.what()));
      }
    } else if (a == "--duel-passes") {
      o.duel_passes = static_cast<std::uint32_t>(parse_uint(a, value(), 0, expage::eviction_duel::max_passes));
      o.duel_passes_given = true;
    } else if (a == "--copy-threads") {
      o.copy_threads = static_cast<std::uint32_t>(parse_uint(a, value(), 0, 64));
      o.copy_threads_given = true;
    } else if (a == "--host-limit") {
      o.host_limit = parse_uint(a, value(), 0, 1ULL << 50);
    } else if (a == "--four-pool") {
      o.four_pool = true;
    } else if (a == "--kv-sessions") {
      o.four_pool_option = a;
      o.kv_sessions = value();
      const auto names = expage::kv_session_preset_names();
      if (std::ranges::find(names, std::string_view(o.kv_sessions)) == names.end()) {
        usage(fmt::format("--kv-sessions '{}' is not one of {}", o.kv_sessions, fmt::join(names, ", ")));
      }
    } else if (a == "--burst") {
      o.four_pool_option = a;
      o.burst = static_cast<std::uint32_t>(parse_uint(a, value(), 1, 1U << 20));
      o.burst_given = true;
    } else if (a == "--hardware") {
      o.four_pool_option = a;
      o.hardware = value();
      const auto names = expage::hardware_profile::preset_names();
      if (std::ranges::find(names, std::string_view(o.hardware)) == names.end()) {
        usage(fmt::format("--hardware '{}' is not one of {}", o.hardware, fmt::join(names, ", ")));
      }
    } else if (a == "--kv-per-token") {
      o.four_pool_option = a;
      o.kv_per_token = parse_uint(a, value(), 1, 1ULL << 40);
    } else if (a == "--no-check") {
      o.check = false;
    } else if (a == "--physics") {
      o.physics = true;
    } else if (a == "--quick") {
      quick = true;  // defaults for what is not given, below
    } else if (a == "--help" || a == "-h") {
      std::puts(
          "moe_decode [--backend host|cuda] [--geometry NAME|FILE] [--scale N] [--tokens N] [--budget P%]\n"
          "           [--trace FILE [--problem ID]]\n"
          "           [--precision bf16|int4] [--view records|stable|slots] [--policy lru|lfu|next-turn]\n"
          "           [--lo-precision int4|int8 [--hi-share P%] [--hi-per-layer N] [--interval PASSES]]\n"
          "           [--lo-precision int4|int8 --four-pool [--kv-sessions NAME] [--burst PASSES]\n"
          "            [--hardware pcie4|pcie5|c2c] [--kv-per-token BYTES] [--interval PASSES]]\n"
          "           [--prefetch none|coactivation|frequency|previous|fmoe [--duel-passes N]\n"
          "            [--pooling log-odds|mean]]  (co-activation's pooling: log-odds, the default, or WiSP's\n"
          "            mean with its decay of 0.5, the default before log-odds)\n"
          "           [--weights FILE] [--write-weights FILE] [--trace-out FILE] [--json FILE]\n"
          "           [--host-limit BYTES] [--copy-threads N] [--no-check] [--physics] [--quick]\n"
          "--tokens N: tokens routed by the model (default 32), or with --trace the first N forward passes\n"
          "(default: all; a batched trace's pass decodes one token of each of its sequences)\n"
          "Defaults: --backend host, --geometry olmoe-1b-7b, --scale 8 (in [1, 1024]), --budget 25%, --precision\n"
          "bf16, --view records, --policy lru, --hi-share 50%, --interval 2, --duel-passes 16 (0: no duel),\n"
          "--host-limit 4294967296, --copy-threads 1; --quick sets --tokens 4 --scale 16 where not given.\n"
          "BYTES is a whole number of bytes (no suffix).\n"
          "On the host, a run that needs more memory than the machine has available (the experts --budget\n"
          "maps, the weights --host-limit holds, the output check's copies) is refused before it starts.\n"
          "--four-pool: --budget is B for hi and lo versions and the KV cache together; the four-pool\n"
          "controller splits it every --burst passes (default 8) for the modelled --hardware (default\n"
          "pcie4) and a KV workload of the --kv-sessions preset (phase-shift, tool-calls, long-context;\n"
          "default phase-shift), a token's KV taking --kv-per-token bytes (default: the busiest pass's KV\n"
          "is a quarter of B)\n"
          "A flag given twice takes its last value (tools/dev/demo.sh passes its arguments after its own).");
      std::exit(expage::finish_standard_output("moe_decode") ? 0 : 1);
    } else {
      usage(fmt::format("unknown option '{}' (see --help)", a));
    }
  }
  const auto was_given = [&](std::string_view flag) { return std::ranges::find(given, flag) != given.end(); };
  if (quick) {  // a smaller default, never over a value given (in any order)
    if (!was_given("--tokens")) {
      o.tokens = 4;
      o.tokens_by_quick = true;
    }
    if (!was_given("--scale")) o.scale = 16;
  }
  if (!o.write_weights.empty()) {  // a mode of its own: it writes the weights of the model and exits
    for (const std::string_view flag : given) {
      if (flag.starts_with("--") && flag != "--write-weights" && flag != "--geometry" && flag != "--scale" &&
          flag != "--quick") {
        usage(
            fmt::format("--write-weights writes the model's weights and exits: {} would be ignored (give "
                        "--geometry and --scale only)",
                        flag));
      }
    }
  }
  if (!tier_option.empty() && !o.lo_format) usage(fmt::format("{} needs --lo-precision (two tiers)", tier_option));
  if (o.four_pool && !o.lo_format) usage("--four-pool needs --lo-precision (two tiers)");
  if (o.four_pool && !sizing_option.empty()) {
    usage(fmt::format("{} conflicts with --four-pool (the four-pool controller sizes the tiers)", sizing_option));
  }
  if (!o.four_pool && !o.four_pool_option.empty()) usage(fmt::format("{} needs --four-pool", o.four_pool_option));
  if (!o.trace_out.empty() && !o.json.empty()) {  // the JSON written last would replace the trace
    if (expage::same_output_file(expage::locate_output(o.trace_out), expage::locate_output(o.json))) {
      usage(fmt::format("--trace-out {} and --json {} name the same file: one would replace the other", o.trace_out,
                        o.json));
    }
  }
  // Inputs the outputs must not replace (through links too).
  for (const auto& [flag, out] : {std::pair{"--trace-out", &o.trace_out}, std::pair{"--json", &o.json},
                                  std::pair{"--write-weights", &o.write_weights}}) {
    for (const auto& [in_flag, in] : {std::pair{"--trace", &o.trace}, std::pair{"--weights", &o.weights}}) {
      std::error_code ec;
      if (!out->empty() && !in->empty() && std::filesystem::equivalent(*out, *in, ec) && !ec) {
        usage(fmt::format("{} {} is the input {} {}: writing it would replace the file being read", flag, *out, in_flag,
                          *in));
      }
    }
  }
  if (o.problem != std::numeric_limits<std::uint32_t>::max() && o.trace.empty()) {
    usage("--problem selects a sequence of a --trace");
  }
  std::uint32_t experts_per_layer = 0;
  try {
    experts_per_layer = expage::geometry_from_argument(o.geometry).experts_per_layer();
  } catch (const std::exception& e) {  // an unknown preset, or a geometry file that does not read
    usage(fmt::format("--geometry: {}", e.what()));
  }
  if (o.hi_per_layer > experts_per_layer) {  // it was clamped silently
    usage(fmt::format("--hi-per-layer {} out of range [1, {}] (the experts of a layer of {})", o.hi_per_layer,
                      experts_per_layer, o.geometry));
  }
  if (o.lo_format && o.format != precision::bf16) {
    usage(fmt::format("--lo-precision needs --precision bf16 for the hi tier, not {}", o.format));
  }
  if (o.physics && o.backend != "host") usage("--physics measures the host backend only (memcpy bandwidth)");
  if (o.copy_threads_given && o.backend != "host") usage("--copy-threads sets the host backend's loader only");
  if (o.pooling && o.prefetch != "coactivation") usage("--pooling needs --prefetch coactivation");
  if (o.duel_passes_given && (o.prefetch == "none" || o.policy == "lru")) {
    usage("--duel-passes needs --prefetch and a --policy other than lru (the duel hands that policy's victims to LRU)");
  }
  return o;
}

// --- the model ------------------------------------------------------------------------------

expage::moe_geometry scaled(const expage::moe_geometry& g, std::uint32_t scale) {
  auto c = g.configuration();
  c.hidden_size = std::max<std::uint64_t>(1, c.hidden_size / scale);
  c.intermediate_size = std::max<std::uint64_t>(1, c.intermediate_size / scale);
  c.group_size = static_cast<std::uint32_t>(std::min<std::uint64_t>(c.group_size, c.hidden_size));
  if (scale != 1) c.name += fmt::format("/{}", scale);
  return expage::moe_geometry(c);
}

std::uint64_t mix(std::uint64_t x) {  // splitmix64
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}
// A weight in [-a, a] from a seed and an index, as bf16.
std::uint16_t weight_bf16(std::uint64_t seed, std::uint64_t i, float a) {
  const double u = static_cast<double>(mix(seed * 0x100000001B3ULL + i) >> 11) * 0x1.0p-53;
  return expage::float_to_bf16(static_cast<float>((2.0 * u - 1.0) * static_cast<double>(a)));
}

// Generates tensor t of expert id in bf16 (the model's "true" weights).
void generate_bf16(const expage::moe_geometry& g, expert_id id, expert_tensor t, std::span<std::uint16_t> out) {
  const std::uint64_t seed = g.flat_index(id) * expage::expert_tensor_count + static_cast<std::uint64_t>(t) + 1;
  const float a = 1.0F / std::sqrt(static_cast<float>(g.shape(t).cols));
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = weight_bf16(seed, i, a);
}

// The stored form of tensor t in `format` (bf16 bytes, or group_quant packing).
std::vector<std::byte> stored_tensor(const expage::moe_geometry& g, expert_id id, expert_tensor t, precision format) {
  std::vector<std::uint16_t> w(g.shape(t).elements());
  generate_bf16(g, id, t, w);
  if (format == precision::bf16) {
    std::vector<std::byte> out(w.size() * 2);
    std::memcpy(out.data(), w.data(), out.size());
    return out;
  }
  std::vector<float> f(w.size());
  for (std::size_t i = 0; i < w.size(); ++i) f[i] = expage::bf16_to_float(w[i]);
  return expage::quantize_groups(f, expage::group_quant_layout(format, g.shape(t), g.group_size()));
}

// --- safetensors -----------------------------------------------------------------------------

std::string tensor_name(expert_id id, expert_tensor t) {
  return fmt::format("model.layers.{}.mlp.experts.{}.{}", id.layer, id.expert, to_string(t));
}

// Writes every expert's bf16 tensors as a safetensors file (8-byte header length, JSON header, data).
void write_safetensors(const std::filesystem::path& path, const expage::moe_geometry& g) {
  std::string header = "{";
  std::uint64_t offset = 0;
  for (std::uint64_t f = 0; f < g.expert_count(); ++f) {
    for (const expert_tensor t : {expert_tensor::gate_up, expert_tensor::down}) {
      const auto s = g.shape(t);
      const std::uint64_t bytes = s.elements() * 2;
      header += fmt::format(R"({}"{}":{{"dtype":"BF16","shape":[{},{}],"data_offsets":[{},{}]}})",
                            header.size() > 1 ? "," : "", tensor_name(g.expert_at(f), t), s.rows, s.cols, offset,
                            offset + bytes);
      offset += bytes;
    }
  }
  header += R"(,"__metadata__":{"format":"pt","model":")" + g.name() + "\"}}";
  while (header.size() % 8 != 0) header += ' ';
  expage::write_file_atomically(path, [&](std::ostream& out) {
    const std::uint64_t n = header.size();
    out.write(reinterpret_cast<const char*>(&n), 8);
    out.write(header.data(), static_cast<std::streamsize>(header.size()));
    for (std::uint64_t f = 0; f < g.expert_count(); ++f) {
      for (const expert_tensor t : {expert_tensor::gate_up, expert_tensor::down}) {
        std::vector<std::uint16_t> w(g.shape(t).elements());
        generate_bf16(g, g.expert_at(f), t, w);
        out.write(reinterpret_cast<const char*>(w.data()), static_cast<std::streamsize>(w.size() * 2));
      }
    }
  });
}

// A read-only mapping of a safetensors file and the byte range of every tensor named in its header.
class safetensors_file {
 public:
  explicit safetensors_file(const std::filesystem::path& path) : path_(path.string()) {
    const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw std::runtime_error(fmt::format("cannot open {}: {}", path_, std::strerror(errno)));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size < 8) {
      ::close(fd);
      throw std::runtime_error(fmt::format("{}: not a safetensors file (a regular file of at least 8 bytes)", path_));
    }
    size_ = static_cast<std::size_t>(st.st_size);
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) throw std::runtime_error(fmt::format("cannot map {}: {}", path_, std::strerror(errno)));
    base_ = static_cast<const std::byte*>(p);
    try {  // a file refused leaves no mapping behind
      std::uint64_t n = 0;
      std::memcpy(&n, base_, 8);
      if (n > size_ - 8) throw std::runtime_error(fmt::format("{}: header of {} bytes past the file's end", path_, n));
      parse_header(std::string_view(reinterpret_cast<const char*>(base_ + 8), n));
      data_ = base_ + 8 + n;
      data_bytes_ = size_ - 8 - n;
      check_data_covered();
    } catch (...) {
      ::munmap(p, size_);
      throw;
    }
  }
  safetensors_file(const safetensors_file&) = delete;
  safetensors_file& operator=(const safetensors_file&) = delete;
  ~safetensors_file() { ::munmap(const_cast<std::byte*>(base_), size_); }

  // The bytes of tensor @p name, checked against the dtype and shape the caller expects.
  [[nodiscard]] std::span<const std::byte> tensor(const std::string& name, expage::tensor_shape shape) const {
    const auto it = tensors_.find(name);
    if (it == tensors_.end()) throw std::runtime_error(fmt::format("{}: no tensor {}", path_, name));
    const entry& e = it->second;
    if (e.dtype != "BF16" || e.shape != std::vector<std::uint64_t>{shape.rows, shape.cols}) {
      throw std::runtime_error(fmt::format("{}: tensor {} is {} {}, expected BF16 [{}, {}]", path_, name, e.dtype,
                                           fmt::join(e.shape, "×"), shape.rows, shape.cols));
    }
    if (e.end < e.begin || e.end > data_bytes_ || e.end - e.begin != shape.elements() * 2) {
      throw std::runtime_error(fmt::format("{}: tensor {} has data offsets [{}, {}) in {} data bytes", path_, name,
                                           e.begin, e.end, data_bytes_));
    }
    return {data_ + e.begin, e.end - e.begin};
  }

 private:
  struct entry {
    std::string dtype;
    std::vector<std::uint64_t> shape;
    std::uint64_t begin = 0, end = 0;
  };
  // The format's rule (safetensors' README): the byte buffer is entirely indexed, without holes,
  // so no bytes hide between or after the tensors (a polyglot file); overlaps are refused too.
  void check_data_covered() const {
    std::vector<std::pair<const std::string*, const entry*>> by_offset;
    by_offset.reserve(tensors_.size());
    for (const auto& [name, e] : tensors_) by_offset.emplace_back(&name, &e);
    std::sort(by_offset.begin(), by_offset.end(), [](const auto& a, const auto& b) {
      return std::pair(a.second->begin, a.second->end) < std::pair(b.second->begin, b.second->end);
    });
    std::uint64_t at = 0;
    for (const auto& [name, e] : by_offset) {
      if (e->begin != at || e->end < e->begin) {
        throw std::runtime_error(
            fmt::format("{}: tensor {} has data offsets [{}, {}), expected it to start at {} "
                        "(the tensors cover the data bytes without holes or overlaps)",
                        path_, *name, e->begin, e->end, at));
      }
      at = e->end;
    }
    if (at > data_bytes_) {
      throw std::runtime_error(
          fmt::format("{}: the tensors need {} data bytes, the file has {}", path_, at, data_bytes_));
    }
    if (at < data_bytes_) {
      throw std::runtime_error(
          fmt::format("{}: {} data bytes after the last tensor, which ends at {}", path_, data_bytes_ - at, at));
    }
  }

  // The header is one JSON object of objects; this reads exactly what safetensors writers emit.
  void parse_header(std::string_view h) {
    std::size_t i = 0;
    const auto fail = [&](std::string_view what) -> void {
      throw std::runtime_error(fmt::format("{}: bad header at byte {}: {}", path_, 8 + i, what));
    };
    const auto ws = [&] {
      while (i < h.size() && (h[i] == ' ' || h[i] == '\n' || h[i] == '\t' || h[i] == '\r')) ++i;
    };
    const auto expect = [&](char c) {
      ws();
      if (i >= h.size() || h[i] != c) fail(fmt::format("expected '{}'", c));
      ++i;
    };
    const auto string = [&] {
      expect('"');
      std::string s;
      while (i < h.size() && h[i] != '"') {
        if (h[i] == '\\') fail("escapes are not supported in names");
        s += h[i++];
      }
      expect('"');
      return s;
    };
    const auto number = [&] {
      ws();
      std::uint64_t x = 0;
      const auto [end, ec] = std::from_chars(h.data() + i, h.data() + h.size(), x);
      if (ec != std::errc{}) fail("expected an unsigned integer");
      i = static_cast<std::size_t>(end - h.data());
      return x;
    };
    const auto numbers = [&] {
      std::vector<std::uint64_t> v;
      expect('[');
      ws();
      if (i < h.size() && h[i] == ']') {
        ++i;
        return v;
      }
      for (;;) {
        v.push_back(number());
        ws();
        if (i < h.size() && h[i] == ',') {
          ++i;
          continue;
        }
        expect(']');
        return v;
      }
    };
    const auto skip_object = [&] {  // __metadata__: string to string
      expect('{');
      ws();
      if (i < h.size() && h[i] == '}') {
        ++i;
        return;
      }
      for (;;) {
        (void)string();
        expect(':');
        (void)string();
        ws();
        if (i < h.size() && h[i] == ',') {
          ++i;
          continue;
        }
        expect('}');
        return;
      }
    };
    expect('{');
    for (;;) {
      const std::string name = string();
      expect(':');
      if (name == "__metadata__") {
        skip_object();
      } else {
        entry e;
        expect('{');
        for (;;) {
          const std::string key = string();
          expect(':');
          if (key == "dtype") {
            e.dtype = string();
          } else if (key == "shape") {
            e.shape = numbers();
          } else if (key == "data_offsets") {
            const auto o = numbers();
            if (o.size() != 2) fail("data_offsets needs two values");
            e.begin = o[0];
            e.end = o[1];
          } else {
            fail(fmt::format("unknown key '{}'", key));
          }
          ws();
          if (i < h.size() && h[i] == ',') {
            ++i;
            continue;
          }
          expect('}');
          break;
        }
        if (!tensors_.emplace(name, std::move(e)).second) fail(fmt::format("tensor '{}' named twice", name));
      }
      ws();
      if (i < h.size() && h[i] == ',') {
        ++i;
        continue;
      }
      expect('}');
      break;
    }
    ws();  // the format pads the header with spaces; nothing else may follow the object
    if (i != h.size()) fail(fmt::format("{} bytes after the header's object", h.size() - i));
  }

  std::string path_;
  const std::byte* base_ = nullptr;
  std::size_t size_ = 0;
  const std::byte* data_ = nullptr;
  std::size_t data_bytes_ = 0;
  std::map<std::string, entry> tensors_;
};

// --- where the runtime's loads come from -------------------------------------------------

// Every expert's stored bytes in host memory (generated, or read from safetensors), or nothing
// when they do not fit: the loader then generates each tensor as it loads it.
class weight_store {
 public:
  // Whether a store of @p format holds every expert in memory: when they all fit --host-limit.
  [[nodiscard]] static bool holds_all(const expage::moe_geometry& g, precision format, const options& o) {
    return g.total_expert_bytes(format) <= o.host_limit;
  }
  weight_store(const expage::moe_geometry& g, precision format, const options& o) : g_(g), format_(format) {
    if (!o.weights.empty()) file_.emplace(o.weights);
    if (!holds_all(g, format, o)) return;
    tensors_.reserve(g.expert_count() * 2);
    for (std::uint64_t f = 0; f < g.expert_count(); ++f) {
      for (const expert_tensor t : {expert_tensor::gate_up, expert_tensor::down}) {
        tensors_.push_back(read(g.expert_at(f), t));
      }
    }
  }
  [[nodiscard]] bool in_memory() const { return !tensors_.empty(); }
  [[nodiscard]] precision format() const { return format_; }

  // The tensor's stored bytes: from memory, the file, or the generator.
  [[nodiscard]] std::vector<std::byte> read(expert_id id, expert_tensor t) const {
    if (!file_) return stored_tensor(g_, id, t, format_);
    const auto bytes = file_->tensor(tensor_name(id, t), g_.shape(t));
    if (format_ == precision::bf16) return {bytes.begin(), bytes.end()};
    std::vector<float> f(g_.shape(t).elements());
    for (std::size_t i = 0; i < f.size(); ++i) {
      std::uint16_t b = 0;
      std::memcpy(&b, bytes.data() + 2 * i, 2);
      f[i] = expage::bf16_to_float(b);
    }
    return expage::quantize_groups(f, expage::group_quant_layout(format_, g_.shape(t), g_.group_size()));
  }

  // A loader that copies stored bytes through @p engine in the stream's order (the host's
  // fastest raw copy, docs/runtime.md), or with host_stream::copy when it is null.
  [[nodiscard]] expage::expert_source<expage::host_stream> source(expage::host_copy_engine* engine = nullptr) const {
    return {.format = format_,
            .load = [this, engine](expert_id id, expert_tensor t, std::span<std::byte> page, expage::host_stream& s) {
              if (in_memory()) {
                const auto& w = tensors_[g_.flat_index(id) * expage::expert_tensor_count + static_cast<std::size_t>(t)];
                if (engine != nullptr) {
                  engine->copy(page.data(), w.data(), w.size(), s);  // a real copy, as a DMA would do
                } else {
                  s.copy(page.data(), w.data(), w.size());
                }
                return w.size();
              }
              const std::size_t bytes = static_cast<std::size_t>(g_.tensor_bytes(t, format_));
              s.enqueue([this, id, t, page] {  // the decompressor hook: generate (or read) into the page
                const auto w = read(id, t);
                std::memcpy(page.data(), w.data(), w.size());
              });
              return bytes;
            }};
  }

 private:
  expage::moe_geometry g_;
  precision format_;
  std::optional<safetensors_file> file_;
  std::vector<std::vector<std::byte>> tensors_;
};

// --- the decode loop ---------------------------------------------------------------------------

// Resident experts a budget fraction buys (at least one layer's routed experts).
std::uint64_t experts_for(double budget, const expage::moe_geometry& g) {
  const auto share = static_cast<std::uint64_t>(std::floor(budget * static_cast<double>(g.expert_count())));
  return std::max<std::uint64_t>(g.top_k(), share);
}

// One token-layer step: the routing of each token of the group.
struct step_routing {
  std::uint32_t layer = 0;
  std::vector<std::uint32_t> tokens;  // slots of the tokens' hidden states
  std::vector<std::int32_t> ids;      // [tokens × top_k]
  std::vector<float> weights;         // [tokens × top_k]
};

// Step s ends a forward pass: the next step is an earlier layer (a new pass) or there is none. A
// batched trace's layer split by load_trace() is its pieces in a row, the same layer; a pass whose
// last layer lost its row (the Mixtral trace's problem 0) still ends. Without a trace (@p replay
// empty) the model routes every layer of every pass in order.
bool ends_pass(std::span<const step_routing> replay, std::uint32_t layers, std::uint64_t s) {
  if (replay.empty()) return s % layers + 1 == layers;
  return s + 1 == replay.size() || replay[s + 1].layer < replay[s].layer;
}
// The forward passes a decode runs: --tokens (32 by default) routed by the model, or the trace's.
std::uint64_t passes_of(const options& o, std::span<const step_routing> replay, std::uint32_t layers) {
  if (replay.empty()) return o.tokens == 0 ? 32 : o.tokens;
  std::uint64_t passes = 0;
  for (std::uint64_t s = 0; s < replay.size(); ++s) {
    if (ends_pass(replay, layers, s)) ++passes;
  }
  return passes;
}

double relative_rms(std::span<const float> a, std::span<const float> ref) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - static_cast<double>(ref[i]);
    num += d * d;
    den += static_cast<double>(ref[i]) * static_cast<double>(ref[i]);
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// max |a − ref| / max |ref|: the error relative to the output's scale (the measure the FFN kernels'
// tests bound, tests/common/expert_ffn_case.hpp); NaN counts as infinitely far.
double max_relative_error(std::span<const float> a, std::span<const float> ref) {
  double worst = 0, scale = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i])) return std::numeric_limits<double>::infinity();
    worst = std::max(worst, std::abs(static_cast<double>(a[i]) - static_cast<double>(ref[i])));
    scale = std::max(scale, std::abs(static_cast<double>(ref[i])));
  }
  return scale == 0 ? worst : worst / scale;
}

// How far the device FFN may be from the host FFN over the same stored weights, as
// max_relative_error(): ExpertFfnKernel holds the device within 1e-5 of the fp64 reference and
// ExpertFfn holds the host within 2e-6 (tests/common/expert_ffn_case.hpp), so within their sum,
// at the size those bounds were set at; wider for longer sums (expert_ffn_rounding_scale()).
double device_tolerance(const expage::expert_ffn_shape& shape) {
  return 1.2e-5 * expage::expert_ffn_rounding_scale(shape);
}

// Every byte the runtime copied into pages: demand loads, prefetches, promotions and demotions.
std::uint64_t bytes_moved(const expage::runtime_layer_statistics& t) {
  return t.bytes_loaded + t.prefetch_bytes + t.promotion_bytes + t.demotion_bytes;
}

// One barrier's decision, for the report.
struct four_pool_burst {
  std::uint64_t passes = 0;  // passes decoded before the barrier
  expage::four_pool_split from, split;
  bool applied = true;
  double current_cost = 0, target_cost = 0;  // the controller's prediction over its window, seconds
};

struct four_pool_report {
  expage::four_pool_model model;
  expage::four_pool_split initial;
  std::vector<four_pool_burst> moves;  // the bursts whose decision moved the split
  std::uint64_t bursts = 0;
  expage::four_pool_statistics stats;
  expage::kv_pool_result kv;
  std::uint64_t kv_per_token = 0, kv_blocks_final = 0;
  std::uint64_t budget_peak = 0;
  std::string sessions, hardware;
};

struct run_result {
  std::uint64_t tokens = 0;
  double wall_s = 0;
  double compute_s = 0;  // FFN time on the compute stream
  double wait_s = 0;     // the compute stream's wait on loads
  double check_s = 0;
  std::uint64_t mismatching_layers = 0;
  double worst_error = 0;
  double worst_bf16_error = 0;  // two tiers: the output against all-bf16 weights
  double sum_bf16_error = 0;
  std::uint64_t hi_capacity = 0, lo_capacity = 0;
  std::uint32_t hi_per_layer = 0;
  expage::runtime_statistics stats;
  expage::runtime_prefetch_statistics prefetcher;
  std::optional<four_pool_report> four_pool;
  std::optional<expage::hot_set_statistics> hot_set;  // two tiers without --four-pool
  std::string chrome_trace;  // --trace-out's JSON (at most trace_events events), written with --json's
};

// What one layer step's FFN reads and writes (host spans; the host vectors stay untouched until
// the backend's wait() returns).
struct ffn_step {
  std::uint32_t layer = 0;
  std::uint32_t tokens = 0;
  std::span<const float> x;
  std::span<const std::uint32_t> offsets, order;
  std::span<const float> weights;
  std::span<const expage::version_record> records;  // empty: the backend reads the runtime's own records
  std::span<float> out;
};

// --- the backends: memory, streams and the FFN; the decode loop is the same for both ------------

// The host backend's granules: small enough that rounding a page up wastes little, large enough
// to keep mappings few (the largest of 2 MiB, 64 KiB and 4 KiB that rounds no tensor of any tier
// up by more than 1/16).
std::size_t host_granularity(const options& o, const expage::moe_geometry& g, bool two_tiers) {
  std::vector<precision> formats{o.format};
  if (two_tiers) formats.push_back(*o.lo_format);
  const auto wastes_little = [&](std::size_t granule) {
    for (const precision f : formats) {
      for (const expert_tensor t : {expert_tensor::gate_up, expert_tensor::down}) {
        const std::uint64_t bytes = g.tensor_bytes(t, f);
        if ((bytes + granule - 1) / granule * granule - bytes > bytes / 16) return false;
      }
    }
    return true;
  };
  return wastes_little(2_MiB) ? 2_MiB : wastes_little(64_KiB) ? 64_KiB : 4_KiB;
}

// One version of an expert in @p f as the runtime holds it: both tensors' pages, each rounded up
// to @p granularity (expert_runtime::expert_bytes()).
std::uint64_t version_bytes(const expage::moe_geometry& g, precision f, std::size_t granularity) {
  const auto page = [&](expert_tensor t) {
    return (g.tensor_bytes(t, f) + granularity - 1) / granularity * granularity;
  };
  return page(expert_tensor::gate_up) + page(expert_tensor::down);
}

// The memory this machine has for the run now: MemAvailable (/proc/meminfo), else the free
// physical pages; nullopt when neither can be read.
std::optional<std::uint64_t> available_host_memory() {
  if (std::FILE* f = std::fopen("/proc/meminfo", "r")) {
    char line[256];
    unsigned long long kib = 0;
    bool found = false;
    while (!found && std::fgets(line, sizeof line, f) != nullptr) {
      found = std::sscanf(line, "MemAvailable: %llu kB", &kib) == 1;
    }
    (void)std::fclose(f);
    if (found) return std::uint64_t{kib} * 1024;
  }
  const long pages = sysconf(_SC_AVPHYS_PAGES);
  const long page = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) return static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page);
  return std::nullopt;
}

// The most experts one layer step routes (the union of its tokens' experts), at least top-k: a
// demand tier must hold them.
std::uint32_t largest_group(const expage::moe_geometry& g, std::span<const step_routing> replay) {
  std::uint32_t group = g.top_k();
  for (const step_routing& s : replay) {
    std::vector<std::int32_t> ids = s.ids;
    std::ranges::sort(ids);
    group = std::max(
        group, static_cast<std::uint32_t>(std::ranges::distance(ids.begin(), std::unique(ids.begin(), ids.end()))));
  }
  return group;
}

// On the host backend a run holds, at most: the budget's experts mapped by the runtime (all of
// them in --physics' all-resident run, which runs first and ends before the paged one), the
// weight stores when every expert fits --host-limit, and, with the output check, the reference's
// copy of each expert it reads, in each precision it checks (the served ones, and bf16 for the
// distance when nothing is served in bf16), up to every expert one of the run's passes routes.
// Refused, before any of it is made, when that is more than the machine has available, where the
// kernel would otherwise kill the run part-way (a review ran --geometry of 1,000,000 × 1,000,000
// experts, 21.8 GiB each, and Mixtral-8x7B at --scale 1).
void check_host_memory(const options& o, const expage::moe_geometry& g, std::span<const step_routing> replay) {
  using real = long double;
  const std::size_t granule = host_granularity(o, g, o.lo_format.has_value());
  const std::uint64_t resident = o.physics ? g.expert_count() : experts_for(o.budget, g);
  const real mapped = static_cast<real>(resident) * static_cast<real>(version_bytes(g, o.format, granule));
  real held = 0.0L;
  real reference = 0.0L;
  // The experts the reference may read: every expert a pass's layer routes, in every pass.
  const real routed =
      std::min(static_cast<real>(g.expert_count()), static_cast<real>(passes_of(o, replay, g.layers())) * g.layers() *
                                                        std::min(g.experts_per_layer(), largest_group(g, replay)));
  std::vector<precision> checked{o.format};
  if (o.lo_format) checked.push_back(*o.lo_format);
  if (std::ranges::find(checked, precision::bf16) == checked.end()) checked.push_back(precision::bf16);
  for (const precision f : checked) {
    const bool stored = f == o.format || (o.lo_format && f == *o.lo_format);
    if (stored && weight_store::holds_all(g, f, o)) held += static_cast<real>(g.total_expert_bytes(f));
    if (o.check) reference += routed * static_cast<real>(g.expert_bytes(f));
  }
  const std::optional<std::uint64_t> available = available_host_memory();
  if (!available || mapped + held + reference <= static_cast<real>(*available)) return;
  const auto size = [](real b) {
    return b >= 0x1p64L ? std::string("over 16 EiB")
                        : fmt::format("{}", expage::byte_size{static_cast<std::uint64_t>(b)});
  };
  usage(fmt::format(
      "{} at --budget {:.0f}% needs up to {} of host memory: {} mapped by the runtime ({} experts{}), {} of weights "
      "held (--host-limit {}) and {} read by the output check; this machine has {} available: raise --scale, lower "
      "--budget or --host-limit, or add --no-check",
      g.name(), o.budget * 100, size(mapped + held + reference), size(mapped), resident,
      o.physics ? ", every one in --physics' all-resident run" : "", size(held), expage::byte_size{o.host_limit},
      size(reference), expage::byte_size{*available}));
}

// The host: host_vmm, host streams (executor threads), the loader reading weight_store (through
// a host_copy_engine of --copy-threads workers, which the copy stream's thread helps), and the
// reference expert_ffn() run on the compute stream, bit-exact against the same FFN on the host.
class host_backend {
 public:
  using vmm_type = expage::host_vmm;
  using stream_type = expage::host_stream;
  static constexpr bool bit_exact = true;

  host_backend(const options& o, const expage::moe_geometry& g, const weight_store& store, const weight_store* lo_store,
               std::uint32_t /*max_tokens*/)
      : store_(store),
        lo_store_(lo_store),
        engine_(o.copy_threads == 0 ? nullptr
                                    : std::make_unique<expage::host_copy_engine>(expage::host_copy_engine_options{
                                          .threads = o.copy_threads, .chunk_bytes = 2_MiB})),
        vmm_({.granularity = host_granularity(o, g, lo_store != nullptr)}) {}

  [[nodiscard]] std::size_t granularity() const { return vmm_.granularity(); }
  [[nodiscard]] vmm_type& vmm() { return vmm_; }
  [[nodiscard]] stream_type& copy() { return copy_; }
  [[nodiscard]] stream_type& compute() { return compute_; }
  [[nodiscard]] stream_type& prefetch() { return prefetch_; }
  [[nodiscard]] expage::expert_source<stream_type> source(expage::version_tier tier) const {
    return tier == expage::version_tier::lo ? lo_store_->source(engine_.get()) : store_.source(engine_.get());
  }
  [[nodiscard]] expage::mirror_hook* record_mirror() { return nullptr; }
  // The runtime measures the compute stream's wait itself (load_wait_ns): it runs host work.
  void before_acquire() {}
  void after_acquire() {}

  void launch(const ffn_step& s, const expage::expert_ffn_shape& shape, std::uint32_t top_k) {
    compute_.enqueue([this, s, shape, top_k] {
      const auto c0 = clock_type::now();
      expage::expert_ffn(s.x, top_k, s.offsets, s.order, s.weights, s.records, shape, s.out);
      compute_ns_ += static_cast<std::uint64_t>((clock_type::now() - c0).count());
    });
  }
  // After the lease's release: the event the check waits for.
  void record_done() { compute_.record(done_); }
  void wait(const ffn_step& /*s*/) { done_.synchronize(); }

  [[nodiscard]] double compute_seconds() const { return static_cast<double>(compute_ns_.load()) * 1e-9; }
  [[nodiscard]] double wait_seconds(const expage::runtime_statistics& stats) const {
    return static_cast<double>(stats.total.load_wait_ns) * 1e-9;
  }

 private:
  const weight_store& store_;
  const weight_store* lo_store_;
  std::unique_ptr<expage::host_copy_engine> engine_;  // null: --copy-threads 0
  std::atomic<std::uint64_t> compute_ns_{0};          // written on the compute stream, read after it drained
  expage::host_event done_;
  vmm_type vmm_;
  // Last, so they are destroyed (drained) first: their work reads the members above.
  stream_type copy_{"copy"}, compute_{"compute"}, prefetch_{"prefetch"};
};

#if EXPAGE_MOE_DECODE_CUDA
// Memory from cudaMalloc (device) or cudaMallocHost (pinned), freed at scope exit.
template <class T, bool Pinned>
class cuda_array {
 public:
  explicit cuda_array(std::size_t n) {
    void* p = nullptr;
    const std::size_t bytes = std::max<std::size_t>(1, n) * sizeof(T);
    if constexpr (Pinned) {
      EXPAGE_CUDA_CHECK(cudaMallocHost(&p, bytes));
    } else {
      EXPAGE_CUDA_CHECK(cudaMalloc(&p, bytes));
    }
    p_ = static_cast<T*>(p);
    size_ = n;
  }
  cuda_array(const cuda_array&) = delete;
  cuda_array& operator=(const cuda_array&) = delete;
  ~cuda_array() {
    if constexpr (Pinned) {
      (void)cudaFreeHost(p_);
    } else {
      (void)cudaFree(p_);
    }
  }
  [[nodiscard]] T* data() const noexcept { return p_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }

 private:
  T* p_ = nullptr;
  std::size_t size_ = 0;
};
template <class T>
using device_array = cuda_array<T, false>;
template <class T>
using pinned_array = cuda_array<T, true>;

// A cudaEvent_t with timing (cuda_event has none: it only orders work).
class timing_event {
 public:
  timing_event() { EXPAGE_CUDA_CHECK(cudaEventCreate(&event_)); }
  timing_event(const timing_event&) = delete;
  timing_event& operator=(const timing_event&) = delete;
  ~timing_event() { (void)cudaEventDestroy(event_); }
  void record(cudaStream_t s) { EXPAGE_CUDA_CHECK(cudaEventRecord(event_, s)); }
  // Seconds from @p start to this event, both completed.
  [[nodiscard]] double since(const timing_event& start) const {
    float ms = 0;
    EXPAGE_CUDA_CHECK(cudaEventElapsedTime(&ms, start.event_, event_));
    return static_cast<double>(ms) * 1e-3;
  }

 private:
  cudaEvent_t event_ = nullptr;
};

// The GPU: cuda_vmm pages, CUDA streams, every expert's stored bytes in pinned host memory copied
// raw into its pages on the copy stream (the int4/int8 packing stays packed: the FFN kernel
// dequantizes as it reads, so no decode or dequant kernel is needed on the way in), the records
// view mirrored on the device, and cuda::expert_ffn_async() on the compute stream.
class cuda_backend {
 public:
  using vmm_type = expage::cuda::cuda_vmm;
  using stream_type = expage::cuda::cuda_stream;
  static constexpr bool bit_exact = false;

  cuda_backend(const options& o, const expage::moe_geometry& g, const weight_store& store, const weight_store* lo_store,
               std::uint32_t max_tokens)
      : g_(g),
        hi_(stage(g, store, pinned_)),
        lo_(lo_store == nullptr ? nullptr : stage(g, *lo_store, pinned_)),
        mirror_(o.view == "records" ? std::make_unique<expage::cuda::device_mirror>(g.expert_count(), compute_.native())
                                    : nullptr),
        shape_(expage::expert_ffn_shape::of(g)),
        workspace_bytes_(expage::cuda::expert_ffn_workspace_bytes(max_tokens, g.top_k(), shape_)),
        workspace_(workspace_bytes_),
        h_x_(std::size_t{max_tokens} * g.hidden_size()),
        h_out_(h_x_.size()),
        h_offsets_(g.experts_per_layer() + 1),
        h_order_(std::size_t{max_tokens} * g.top_k()),
        h_weights_(h_order_.size()),
        h_records_(g.experts_per_layer()),
        d_x_(h_x_.size()),
        d_out_(h_x_.size()),
        d_offsets_(h_offsets_.size()),
        d_order_(h_order_.size()),
        d_weights_(h_order_.size()),
        d_records_(h_records_.size()) {}

  [[nodiscard]] std::size_t granularity() const { return vmm_.granularity(); }
  [[nodiscard]] vmm_type& vmm() { return vmm_; }
  [[nodiscard]] stream_type& copy() { return copy_; }
  [[nodiscard]] stream_type& compute() { return compute_; }
  [[nodiscard]] stream_type& prefetch() { return prefetch_; }
  [[nodiscard]] expage::expert_source<stream_type> source(expage::version_tier tier) const {
    return expage::expert_source<stream_type>::from(tier == expage::version_tier::lo ? *lo_ : *hi_);
  }
  [[nodiscard]] expage::mirror_hook* record_mirror() { return mirror_.get(); }
  // The compute stream's wait on loads happens on the device: timed between two events around
  // acquire() (nothing else is queued between them but the mirror's record copies).
  void before_acquire() { wait_start_.record(compute_.native()); }
  void after_acquire() { wait_end_.record(compute_.native()); }

  void launch(const ffn_step& s, const expage::expert_ffn_shape& shape, std::uint32_t top_k) {
    const cudaStream_t stream = compute_.native();
    const auto upload = [&](auto* device, auto* pinned, const auto& host) {
      std::ranges::copy(host, pinned);
      EXPAGE_CUDA_CHECK(cudaMemcpyAsync(device, pinned, host.size_bytes(), cudaMemcpyHostToDevice, stream));
    };
    upload(d_x_.data(), h_x_.data(), s.x);
    upload(d_offsets_.data(), h_offsets_.data(), s.offsets);
    upload(d_order_.data(), h_order_.data(), s.order);
    upload(d_weights_.data(), h_weights_.data(), s.weights);
    // The records view: the device mirror of the layer's records, updated on this stream by every
    // publish. The other views: records built on the host from their device addresses.
    const expage::version_record* records = nullptr;
    if (s.records.empty()) {
      records = mirror_->records() + g_.flat_index({s.layer, 0});
    } else {
      upload(d_records_.data(), h_records_.data(), s.records);
      records = d_records_.data();
    }
    kernel_start_.record(stream);
    expage::cuda::expert_ffn_async({.x = d_x_.data(),
                                    .out = d_out_.data(),
                                    .offsets = d_offsets_.data(),
                                    .order = d_order_.data(),
                                    .topk_weights = d_weights_.data(),
                                    .records = records,
                                    .tokens = s.tokens,
                                    .top_k = top_k,
                                    .experts = g_.experts_per_layer(),
                                    .shape = shape},
                                   workspace_.data(), workspace_bytes_, stream);
    kernel_end_.record(stream);
    EXPAGE_CUDA_CHECK(
        cudaMemcpyAsync(h_out_.data(), d_out_.data(), s.out.size_bytes(), cudaMemcpyDeviceToHost, stream));
  }
  void record_done() { compute_.record(done_); }
  void wait(const ffn_step& s) {
    done_.synchronize();
    compute_s_ += kernel_end_.since(kernel_start_);
    wait_s_ += wait_end_.since(wait_start_);
    std::copy_n(h_out_.data(), s.out.size(), s.out.begin());
  }

  [[nodiscard]] double compute_seconds() const { return compute_s_; }
  [[nodiscard]] double wait_seconds(const expage::runtime_statistics& /*stats*/) const { return wait_s_; }

 private:
  // Every expert's stored form (weight_store::read) in one pinned tensor_storage, so loads are DMA.
  static std::unique_ptr<expage::tensor_storage<stream_type>> stage(const expage::moe_geometry& g,
                                                                    const weight_store& store,
                                                                    expage::cuda::pinned_host_memory& pinned) {
    auto storage = std::make_unique<expage::tensor_storage<stream_type>>(g, store.format(), pinned);
    for (std::uint64_t f = 0; f < g.expert_count(); ++f) {
      for (const expert_tensor t : {expert_tensor::gate_up, expert_tensor::down}) {
        const std::vector<std::byte> w = store.read(g.expert_at(f), t);
        const std::span<std::byte> slot = storage->slot(g.expert_at(f), t);
        if (w.size() != storage->tensor_bytes(t)) {
          throw std::logic_error(fmt::format("{} {}: {} stored bytes, the geometry says {}", g.expert_at(f),
                                             to_string(t), w.size(), storage->tensor_bytes(t)));
        }
        std::ranges::copy(w, slot.begin());
      }
    }
    return storage;
  }

  expage::moe_geometry g_;
  expage::cuda::pinned_host_memory pinned_;
  vmm_type vmm_;
  stream_type copy_, compute_, prefetch_;
  std::unique_ptr<expage::tensor_storage<stream_type>> hi_, lo_;
  std::unique_ptr<expage::cuda::device_mirror> mirror_;  // the records view only
  expage::expert_ffn_shape shape_;
  std::size_t workspace_bytes_;
  device_array<std::byte> workspace_;
  pinned_array<float> h_x_, h_out_;
  pinned_array<std::uint32_t> h_offsets_, h_order_;
  pinned_array<float> h_weights_;
  pinned_array<expage::version_record> h_records_;
  device_array<float> d_x_, d_out_;
  device_array<std::uint32_t> d_offsets_, d_order_;
  device_array<float> d_weights_;
  device_array<expage::version_record> d_records_;
  expage::cuda::cuda_event done_;
  timing_event wait_start_, wait_end_, kernel_start_, kernel_end_;
  double compute_s_ = 0, wait_s_ = 0;
};
#endif

// --- four pools: hi and lo expert versions and the KV cache under one budget (--four-pool) ------

// The engine's side of the four-pool controller (control/four_pool_controller.hpp, issue 12): one
// budget B over the runtime's hi and lo tiers and a KV pool, the controller deciding the split at
// drained barriers every --burst passes and the hi set every --interval passes, four_pool_driver
// applying both to the runtime (runtime/four_pool_driver.hpp). The KV side is the served workload
// of a session preset (sim/kv_sessions.hpp): pass s of the decode is step s of the KV stream,
// whose blocks are read into a kv_block_pool (LRU) whose bytes are reserved under B as an engine's
// preallocated pool is; a read of an evicted block is a recompute, priced by the controller's
// model but not run. The decisions are made for the modelled hardware (--hardware), whatever the
// backend the mechanism runs on.
// The KV workload of a --four-pool run of @p passes passes (pass s is step s of the stream), checked
// against the flags: called before the weights are made (a bad command line costs nothing), and by
// four_pool_side. @throws expage::invalid_argument when the sessions read no KV block or --burst
// is not below the run's passes.
expage::kv_block_stream four_pool_sessions(const options& o, std::uint64_t passes) {
  expage::kv_session_options sessions;
  sessions.phases = expage::kv_session_preset(o.kv_sessions, std::max<std::uint64_t>(passes, 3));
  expage::kv_block_stream kv = expage::generate_kv_sessions(sessions);
  if (kv.peak_step_blocks() == 0) {
    throw expage::invalid_argument(fmt::format(
        "the {} sessions read no KV block over {} passes (their first turns start later): decode more passes "
        "(--tokens, or a longer --trace)",
        o.kv_sessions, passes));
  }
  if (o.burst >= passes) {
    // A barrier runs after every burst-th pass: one after the last pass splits nothing the run uses.
    throw expage::invalid_argument(
        fmt::format("--burst {}{} out of range [1, {}] (the run has {} passes: no barrier would run before its end)",
                    o.burst, o.burst_given ? "" : " (the default)", passes - 1, passes));
  }
  return kv;
}

// The four-pool controller's model of a --four-pool run (issue 12), from the flags, the device
// budget @p budget_bytes, one hi and one lo version's page-rounded bytes and the KV workload; sets
// @p kv_per_token (the flag's, or by default a quarter of the budget for the busiest step's
// blocks: KV and experts then compete for the rest). One owner: the check before the weights are
// made and four_pool_side. @throws expage::invalid_argument naming the flags behind a model the
// controller refuses.
expage::four_pool_model four_pool_model_of(const options& o, const expage::moe_geometry& g, std::uint64_t budget_bytes,
                                           std::uint64_t hi_expert_bytes, std::uint64_t lo_expert_bytes,
                                           const expage::kv_block_stream& kv, std::uint32_t group,
                                           std::uint64_t& kv_per_token) {
  // The busiest step's blocks are the admission floor (WiSP Eq. 6).
  kv_per_token = o.kv_per_token != 0
                     ? o.kv_per_token
                     : std::max<std::uint64_t>(1, budget_bytes / (4 * kv.peak_step_blocks() * kv.block_tokens()));
  const std::uint64_t block_bytes = std::uint64_t{kv.block_tokens()} * kv_per_token;
  const expage::hardware_profile hw = expage::hardware_profile::preset(o.hardware);
  const expage::cost_model hi = expage::make_cost_model(g, hw, o.format);
  const expage::cost_model lo = expage::make_cost_model(g, hw, *o.lo_format);
  expage::four_pool_model m;
  m.budget_bytes = budget_bytes;
  m.layers = g.layers();
  m.experts_per_layer = g.experts_per_layer();
  m.hi_expert_bytes = hi_expert_bytes;  // page-rounded, what the tiers hold
  m.lo_expert_bytes = lo_expert_bytes;
  m.block_bytes = block_bytes;
  m.kv_floor_bytes = std::max<std::uint64_t>(1, kv.peak_step_blocks()) * block_bytes;
  m.hi_miss_seconds = *std::ranges::min_element(hi.transfer_seconds);
  m.lo_miss_seconds = *std::ranges::min_element(lo.transfer_seconds);
  m.kv_miss_seconds = hi.recompute_seconds_per_token * kv.block_tokens();
  m.lo_activation_seconds = m.hi_miss_seconds / 4;  // λ_q = t_hi/4, as docs/control.md's four-pool runs
  m.min_group = group;
  m.members_load_hi = true;  // the runtime's targets_load_hi
  try {
    (void)expage::admissible_splits(m);  // the model, and a budget that holds one split at least
  } catch (const expage::invalid_argument& e) {
    throw expage::invalid_argument(
        fmt::format("{} (B is --budget of the experts' bytes at --precision; the KV floor is the busiest pass's "
                    "blocks at --kv-per-token)",
                    e.what()));
  }
  return m;
}

template <class Runtime>
class four_pool_side {
 public:
  four_pool_side(const options& o, const expage::moe_geometry& g, Runtime& rt, expage::budget_tracker& budget,
                 expage::budget_account& experts, std::uint32_t group, std::uint64_t passes)
      : rt_(&rt),
        budget_(&budget),
        experts_(&experts),
        kv_account_(&budget.add_account("kv", 0)),
        burst_(o.burst),
        interval_(o.interval),
        kv_(four_pool_sessions(o, passes)) {
    const std::uint64_t b = budget.root().capacity();
    report_.model = four_pool_model_of(o, g, b, rt.expert_bytes(expage::version_tier::hi),
                                       rt.expert_bytes(expage::version_tier::lo), kv_, group, report_.kv_per_token);
    const expage::four_pool_model& m = report_.model;
    // The first split: what a static configuration would set, the KV half of the budget and the
    // experts' half shared by bytes between the tiers (the admissible split nearest to it).
    const auto candidates = expage::admissible_splits(m);
    const auto distance = [&](const expage::four_pool_split& s) {
      const auto d = [](std::uint64_t x, std::uint64_t y) { return x > y ? x - y : y - x; };
      return d(expage::hi_pool_bytes(m, s), b / 4) + d(expage::lo_pool_bytes(m, s), b / 4);
    };
    report_.initial = *std::ranges::min_element(candidates, {}, distance);
    report_.sessions = o.kv_sessions;
    report_.hardware = o.hardware;
    controller_.emplace(m, expage::four_pool_config{}, report_.initial);
    pool_.emplace(kv_.key_count(), 1);
    observer_.emplace(kv_, /*release_closed=*/false, /*open_depths=*/true);
    driver_.emplace(rt, *controller_, experts, [this](std::uint64_t bytes) { return resize_kv(bytes); });
    check_split("at the start");
    track_ = rt.trace().add_track("four-pool controller");
  }

  // After acquire(): the layer-step's routed experts.
  void on_routed(std::uint32_t layer, std::span<const std::uint32_t> routed) { driver_->on_routed(layer, routed); }

  // After the last layer of pass @p s: its KV reads; the hi set every --interval passes; a
  // barrier every --burst passes, after @p drain has waited for every stream.
  template <class Drain>
  void end_pass(std::uint64_t s, Drain&& drain) {
    for (const std::uint32_t block : kv_.blocks(s)) (void)pool_->read(block);
    observer_->observe(s, controller_->kv());
    if ((s + 1) % interval_ == 0) driver_->end_interval();
    if ((s + 1) % burst_ != 0) return;
    expage::event_trace& trace = rt_->trace();
    const double t0 = trace.now_us();
    drain();
    controller_->set_kv_open_depths(observer_->open_depths(s));
    const expage::four_pool_split from = controller_->current();
    const auto [d, applied] = driver_->at_barrier();
    ++report_.bursts;
    // The barrier (drain, decision, resizes) as a span of the controller's track in the Chrome trace.
    trace.span(!d.moved  ? "barrier"
               : applied ? fmt::format("barrier: split {} hi + {} lo per layer, KV {}", d.split.hi_slots,
                                       d.split.lo_slots, expage::byte_size{d.split.kv_bytes})
                         : "barrier: move refused",
               "four-pool", track_, t0, trace.now_us() - t0);
    if (d.moved) {
      report_.moves.push_back({.passes = s + 1,
                               .from = from,
                               .split = d.split,
                               .applied = applied,
                               .current_cost = d.current_cost,
                               .target_cost = d.target_cost});
    }
    check_split(fmt::format("after the barrier at pass {}", s + 1));
  }

  four_pool_side(const four_pool_side&) = delete;  // the driver's KV callback holds `this`
  four_pool_side& operator=(const four_pool_side&) = delete;

  [[nodiscard]] four_pool_report report() const {
    four_pool_report r = report_;
    r.stats = controller_->statistics();
    r.kv = pool_->totals();
    r.kv_blocks_final = pool_->capacity();
    r.budget_peak = budget_->root().statistics().peak;
    return r;
  }

 private:
  // The KV pool to @p bytes (whole blocks), its reservation with it; false (nothing changed) when
  // the budget refuses the growth.
  bool resize_kv(std::uint64_t bytes) {
    const std::uint64_t blocks = bytes / report_.model.block_bytes;
    if (blocks == 0) return false;
    const std::size_t held = kv_held_.bytes();
    if (bytes > held) {
      if (bytes > kv_account_->capacity()) (void)kv_account_->set_capacity(bytes);
      const bool grown =
          kv_held_ ? kv_held_.try_grow(bytes - held) : static_cast<bool>(kv_held_ = kv_account_->try_reserve(bytes));
      if (!grown) {
        (void)kv_account_->set_capacity(held);
        return false;
      }
    } else if (bytes < held) {
      kv_held_.shrink(bytes);
      (void)kv_account_->set_capacity(bytes);
    }
    pool_->resize(blocks);
    return true;
  }

  // The runtime's tiers and demand tier, the experts' account, the KV pool and its reservation are
  // the controller's split, and the accounts' capacities fit B: a broken promise is a bug, not a
  // figure. (Use above B cannot happen: the root account refuses it.)
  void check_split(const std::string& when) const {
    const expage::four_pool_split& s = controller_->current();
    const expage::four_pool_model& m = report_.model;
    const std::uint64_t hi = rt_->capacity(expage::version_tier::hi), lo = rt_->capacity(expage::version_tier::lo);
    const std::uint64_t experts = expage::hi_pool_bytes(m, s) + expage::lo_pool_bytes(m, s);
    const expage::version_tier demand = s.tiered() ? expage::version_tier::lo : expage::version_tier::hi;
    if (hi != std::uint64_t{s.hi_slots} * m.layers || lo != std::uint64_t{s.lo_slots} * m.layers ||
        rt_->demand_tier() != demand || experts_->capacity() != experts || kv_held_.bytes() != s.kv_bytes ||
        pool_->capacity() != s.kv_bytes / m.block_bytes || experts + s.kv_bytes > m.budget_bytes) {
      throw std::logic_error(fmt::format(
          "four-pool {}: the split is {} hi + {} lo slots per layer and {} KV bytes; the runtime holds {} hi and {} "
          "lo versions, the experts' account {} bytes, the KV pool {} blocks and {} bytes, the budget {} bytes",
          when, s.hi_slots, s.lo_slots, s.kv_bytes, hi, lo, experts_->capacity(), pool_->capacity(), kv_held_.bytes(),
          m.budget_bytes));
    }
  }

  Runtime* rt_;
  expage::budget_tracker* budget_;
  expage::budget_account* experts_;
  expage::budget_account* kv_account_;
  std::uint64_t burst_, interval_;
  std::uint32_t track_ = 0;  // the controller's track in the runtime's Chrome trace
  expage::kv_block_stream kv_;
  four_pool_report report_;
  std::optional<expage::four_pool_controller> controller_;
  std::optional<expage::kv_block_pool> pool_;
  std::optional<expage::kv_reuse_observer> observer_;
  expage::reservation kv_held_;  // the KV pool's bytes (before the driver, which resizes it)
  std::optional<expage::four_pool_driver<Runtime>> driver_;
};

template <class Backend, class Policy>
run_result decode(const options& o, const expage::moe_geometry& g, const weight_store& store,
                  const weight_store* lo_store, double budget, std::span<const step_routing> replay, bool quiet) {
  std::uint32_t max_tokens = 1;
  for (const step_routing& s : replay) max_tokens = std::max(max_tokens, static_cast<std::uint32_t>(s.tokens.size()));
  Backend backend(o, g, store, lo_store, max_tokens);
  const std::size_t granularity = backend.granularity();
  const auto page_of = [&](precision f) { return version_bytes(g, f, granularity); };
  const std::uint64_t page = page_of(o.format);
  const std::uint64_t capacity = experts_for(budget, g);
  // With --four-pool the budget is B for both expert tiers and the KV pool, each an account of it.
  const bool four_pool = o.four_pool && lo_store != nullptr;
  expage::budget_tracker tracker(capacity * page, four_pool ? "device" : "experts");
  const auto ends_pass = [&](std::uint64_t s) { return ::ends_pass(replay, g.layers(), s); };
  const std::uint32_t group = largest_group(g, replay);
  const std::uint64_t passes_total = passes_of(o, replay, g.layers());
  auto& copy = backend.copy();
  auto& compute = backend.compute();
  auto& prefetch = backend.prefetch();
  using stream_type = typename Backend::stream_type;
  using runtime_type = expage::expert_runtime<typename Backend::vmm_type, stream_type, Policy>;
  expage::expert_runtime_options runtime_options{
      // Each view alone: a records-only runtime keeps its versions in slot mappings that live as
      // long as the slot (no stable page to map per load; on a host that saves its page faults).
      .views = {.stable_tensors = o.view == "stable", .slots = o.view == "slots", .records = o.view == "records"},
      .trace_events = o.trace_out.empty() || quiet ? 0 : std::size_t{1} << 20,
      .record_mirror = backend.record_mirror()};
  run_result r;
  // Two tiers: hi_share of the bytes for bf16 versions, the rest for lo ones (at least top-k of them).
  std::optional<runtime_type> tiered;
  std::optional<runtime_type> single;
  expage::budget_account* experts_account = nullptr;  // --four-pool: the tiers' account under B
  if (four_pool) {
    // The driver gives the tiers the controller's first split; until then, one group of lo versions.
    experts_account = &tracker.add_account("experts", group * page_of(*o.lo_format));
    runtime_options.capacity = 0;
    runtime_options.lo_capacity = group;
    runtime_options.demand_tier = expage::version_tier::lo;
    runtime_options.targets_load_hi = true;  // the controller's serve rule (four_pool_model::members_load_hi)
    tiered.emplace(g, *experts_account, backend.vmm(), copy, compute,
                   expage::tiered_source<stream_type>{.hi = backend.source(expage::version_tier::hi),
                                                      .lo = backend.source(expage::version_tier::lo)},
                   runtime_options, &prefetch);
  } else if (lo_store != nullptr) {
    const std::uint64_t total = capacity * page;
    const std::uint64_t lo_page = page_of(*o.lo_format);
    std::uint64_t hi = std::min<std::uint64_t>(
        static_cast<std::uint64_t>(o.hi_share * static_cast<double>(total)) / page, g.expert_count());
    while (hi > 0 && (total - hi * page) / lo_page < g.top_k()) --hi;
    r.hi_capacity = hi;
    r.lo_capacity = std::min<std::uint64_t>((total - hi * page) / lo_page, g.expert_count());
    runtime_options.capacity = static_cast<std::uint32_t>(r.hi_capacity);
    runtime_options.lo_capacity = static_cast<std::uint32_t>(r.lo_capacity);
    runtime_options.demand_tier = expage::version_tier::lo;
    tiered.emplace(g, tracker.root(), backend.vmm(), copy, compute,
                   expage::tiered_source<stream_type>{.hi = backend.source(expage::version_tier::hi),
                                                      .lo = backend.source(expage::version_tier::lo)},
                   runtime_options, &prefetch);
  } else {
    single.emplace(g, tracker.root(), backend.vmm(), copy, compute, backend.source(expage::version_tier::hi),
                   runtime_options, o.prefetch == "none" ? nullptr : &prefetch);
  }
  runtime_type& rt = tiered ? *tiered : *single;
  // DynaExq's hot set (§3.5): EMA hotness per expert, each layer's top-n with hysteresis; the
  // runtime promotes and demotes in the background (its hi tier holds the sets).
  // The controller's planning account (DynaExq §3.3 admission): the hi tier's versions, so it never
  // plans more members than the tier holds (an explicit --hi-per-layer beyond that is deferred,
  // not queued in the runtime for good). Declared first: it outlives the reservations the
  // controller holds on it.
  std::optional<expage::budget_tracker> hot_budget;
  std::optional<expage::hot_set_controller> hot;
  std::optional<four_pool_side<runtime_type>> pools;
  if (four_pool) {
    try {
      pools.emplace(o, g, rt, tracker, *experts_account, group, passes_total);
    } catch (const expage::invalid_argument& e) {
      usage(fmt::format("--four-pool: {}", e.what()));
    }
  } else if (tiered) {
    r.hi_per_layer = o.hi_per_layer != 0
                         ? o.hi_per_layer
                         : static_cast<std::uint32_t>(std::max<std::uint64_t>(1, r.hi_capacity / g.layers()));
    r.hi_per_layer = std::min(r.hi_per_layer, g.experts_per_layer());
    hot_budget.emplace(static_cast<std::size_t>(r.hi_capacity * page), "hot_set_plan");
    hot.emplace(expage::hot_set_config{.layers = g.layers(),
                                       .experts_per_layer = g.experts_per_layer(),
                                       .hi_per_layer = r.hi_per_layer,
                                       .hi_bytes = page});
  }
  // The predictor-driven prefetcher: told each layer's routing after its acquire(), it requests
  // the next layer's likely experts on the prefetch stream (docs/prefetch.md).
  std::optional<expage::runtime_prefetcher<runtime_type>> prefetcher;
  if (o.prefetch != "none") {
    // WiSP's mean is run with the decay it was tuned with (docs/prefetch.md, "Pooling the layers").
    auto predictor =
        o.pooling == expage::coactivation_pooling::mean
            ? std::make_unique<expage::coactivation_predictor>(
                  g.layers(), g.experts_per_layer(), g.top_k(), expage::coactivation_predictor::default_window,
                  expage::coactivation_predictor::mean_decay, expage::coactivation_pooling::mean)
            : expage::make_predictor(o.prefetch, g.layers(), g.experts_per_layer(), g.top_k());
    prefetcher.emplace(rt, std::move(predictor), expage::runtime_prefetch_options{.duel_passes = o.duel_passes});
  }

  const std::uint64_t H = g.hidden_size();
  const std::uint32_t E = g.experts_per_layer(), K = g.top_k();
  const auto shape = expage::expert_ffn_shape::of(g);
  // Router weights [E × H] per layer (synthetic mode) and hidden states per token.
  std::vector<std::vector<float>> router(g.layers());
  for (std::uint32_t l = 0; l < g.layers(); ++l) {
    router[l].resize(E * H);
    for (std::size_t i = 0; i < router[l].size(); ++i) {
      router[l][i] = expage::bf16_to_float(weight_bf16(0xA0 + l, i, 1.0F));
    }
  }
  std::map<std::uint32_t, std::vector<float>> hidden;  // token slot → state
  const auto state_of = [&](std::uint32_t token) -> std::vector<float>& {
    auto [it, fresh] = hidden.try_emplace(token);
    if (fresh) {
      it->second.resize(H);
      for (std::size_t i = 0; i < H; ++i) it->second[i] = expage::bf16_to_float(weight_bf16(0x70 + token, i, 1.0F));
    }
    return it->second;
  };
  // The all-resident reference: every expert's weights in a precision, read on demand from the
  // source the runtime loads from (the generator, or the --weights file) but not through it.
  std::optional<weight_store> bf16_source;  // a single int4 tier's bf16 weights, for the distance
  if (store.format() != precision::bf16) {
    options direct = o;
    direct.host_limit = 0;  // read each tensor when asked, keep nothing
    bf16_source.emplace(g, precision::bf16, direct);
  }
  std::map<std::pair<std::uint64_t, precision>, std::array<std::vector<std::byte>, 2>> reference_weights;
  const auto reference_record = [&](expert_id id, precision f) {
    auto& w = reference_weights[{g.flat_index(id), f}];
    if (w[0].empty()) {
      const weight_store& from = f == store.format()                              ? store
                                 : lo_store != nullptr && f == lo_store->format() ? *lo_store
                                                                                  : *bf16_source;
      for (std::size_t t = 0; t < 2; ++t) w[t] = from.read(id, static_cast<expert_tensor>(t));
    }
    return expage::packed_version_record(f, w[0].data(), w[1].data(), shape);
  };

  std::vector<float> x, out, ref;
  std::vector<std::uint32_t> offsets(E + 1), order, position;
  std::vector<std::int32_t> ids;
  std::vector<float> weights;
  std::vector<expage::version_record> records(E), reference(E), bf16_reference(E);
  std::vector<precision> served(E, o.format);
  std::vector<float> ref_bf16;
  const bool below_bf16 = lo_store != nullptr || o.format != precision::bf16;  // some expert served below bf16
  std::uint64_t passes = 0;
  // The tokens of the pass under way: per layer the sum over its pieces (load_trace() splits a
  // batched layer into pieces of at most E rows), over the pass the most of any layer (a layer's
  // rows may be missing).
  std::uint32_t pass_tokens = 0;
  std::uint32_t layer_tokens = 0;
  constexpr std::uint32_t no_layer = std::numeric_limits<std::uint32_t>::max();
  std::uint32_t pieces_of = no_layer;  // the layer layer_tokens counts
  std::vector<std::uint32_t> token_experts(K);
  const auto t0 = clock_type::now();
  const std::uint32_t tokens_asked = o.tokens == 0 ? 32 : o.tokens;
  const std::uint64_t steps = replay.empty() ? std::uint64_t{tokens_asked} * g.layers() : replay.size();
  for (std::uint64_t s = 0; s < steps; ++s) {
    const std::uint32_t layer = replay.empty() ? static_cast<std::uint32_t>(s % g.layers()) : replay[s].layer;
    std::vector<std::uint32_t> tokens = replay.empty() ? std::vector<std::uint32_t>{0} : replay[s].tokens;
    const auto n = static_cast<std::uint32_t>(tokens.size());
    x.resize(n * H);
    for (std::uint32_t i = 0; i < n; ++i)
      std::ranges::copy(state_of(tokens[i]), x.begin() + static_cast<std::ptrdiff_t>(i * H));
    ids.resize(n * K);
    weights.resize(n * K);
    if (replay.empty()) {
      std::vector<float> logits(n * E);
      for (std::uint32_t i = 0; i < n; ++i) {
        for (std::uint32_t e = 0; e < E; ++e) {
          double acc = 0;
          for (std::uint64_t h = 0; h < H; ++h)
            acc += static_cast<double>(router[layer][e * H + h]) * static_cast<double>(x[i * H + h]);
          logits[i * E + e] = static_cast<float>(acc);
        }
      }
      std::vector<std::uint32_t> counts(E);
      expage::router_top_k(logits, {.tokens = n, .experts = E, .top_k = K}, expage::router_gating::softmax_renormalized,
                           ids, weights, counts);
    } else {
      ids = replay[s].ids;
      weights = replay[s].weights;
    }
    order.resize(n * K);
    position.resize(n * K);
    expage::group_by_expert(ids, E, offsets, order, position);
    std::vector<std::uint32_t> routed;
    for (std::uint32_t e = 0; e < E; ++e) {
      if (offsets[e + 1] > offsets[e]) routed.push_back(e);
    }
    backend.before_acquire();
    auto lease = rt.acquire(layer, routed);
    backend.after_acquire();
    if (prefetcher) prefetcher->on_routed(layer, routed);
    if (pools) pools->on_routed(layer, routed);
    for (std::size_t i = 0; i < routed.size(); ++i) served[routed[i]] = rt.format(lease.tiers()[i]);
    if (hot) {
      for (std::uint32_t i = 0; i < n; ++i) {
        for (std::uint32_t k = 0; k < K; ++k) token_experts[k] = static_cast<std::uint32_t>(ids[i * K + k]);
        hot->record(layer, token_experts);
      }
    }
    // The FFN reads the weights through the chosen view; the lease's experts' entries are fixed.
    // (On a device the records view is the runtime's own mirror there: nothing to copy.)
    const bool own_records = Backend::bit_exact || o.view != "records";
    if (o.view == "records") {
      if (own_records) std::ranges::copy(rt.records(layer), records.begin());
    } else {
      for (std::size_t i = 0; i < routed.size(); ++i) {  // each expert in the tier that serves it
        const std::uint32_t e = routed[i];
        const expage::version_tier tier = lease.tiers()[i];
        std::byte* gu = nullptr;
        std::byte* dn = nullptr;
        if (o.view == "stable") {
          gu = rt.stable_tensor(layer, expert_tensor::gate_up, tier) + e * rt.page_bytes(expert_tensor::gate_up, tier);
          dn = rt.stable_tensor(layer, expert_tensor::down, tier) + e * rt.page_bytes(expert_tensor::down, tier);
        } else {
          const std::int32_t slot = rt.expert_map(layer, tier)[e];
          gu = rt.slot_address(slot, expert_tensor::gate_up, tier);
          dn = rt.slot_address(slot, expert_tensor::down, tier);
        }
        records[e] = expage::packed_version_record(rt.format(tier), gu, dn, shape);
      }
    }
    out.assign(n * H, 0.0F);
    const ffn_step step{.layer = layer,
                        .tokens = n,
                        .x = x,
                        .offsets = offsets,
                        .order = order,
                        .weights = weights,
                        .records = own_records ? std::span<const expage::version_record>(records)
                                               : std::span<const expage::version_record>(),
                        .out = out};
    backend.launch(step, shape, K);
    lease.release();  // after the FFN, in compute-stream order
    backend.record_done();
    if (o.check) {
      // Against the weights each expert was served in: bit-exact on the host, within
      // device_tolerance on a device. Below bf16 (int4 or int8 versions served), the distance to
      // all-bf16 weights is reported beside it.
      const auto c0 = clock_type::now();
      for (const std::uint32_t e : routed) reference[e] = reference_record({layer, e}, served[e]);
      ref.assign(n * H, 0.0F);
      expage::expert_ffn(x, K, offsets, order, weights, reference, shape, ref);
      if (below_bf16) {
        for (const std::uint32_t e : routed) bf16_reference[e] = reference_record({layer, e}, precision::bf16);
        ref_bf16.assign(n * H, 0.0F);
        expage::expert_ffn(x, K, offsets, order, weights, bf16_reference, shape, ref_bf16);
      }
      backend.wait(step);
      if constexpr (Backend::bit_exact) {
        r.worst_error = std::max(r.worst_error, relative_rms(out, ref));
        if (std::memcmp(out.data(), ref.data(), out.size() * sizeof(float)) != 0) ++r.mismatching_layers;
      } else {
        const double err = max_relative_error(out, ref);
        r.worst_error = std::max(r.worst_error, err);
        if (!(err <= device_tolerance(shape))) ++r.mismatching_layers;
      }
      if (below_bf16) {
        const double to_bf16 = relative_rms(out, ref_bf16);
        r.worst_bf16_error = std::max(r.worst_bf16_error, to_bf16);
        r.sum_bf16_error += to_bf16;
      }
      r.check_s += std::chrono::duration<double>(clock_type::now() - c0).count();
    } else {
      backend.wait(step);
    }
    // Residual update and a norm, so the states stay in range over many layers.
    for (std::uint32_t i = 0; i < n; ++i) {
      auto& st = state_of(tokens[i]);
      double sq = 0;
      for (std::uint64_t h = 0; h < H; ++h) {
        st[h] += out[i * H + h];
        sq += static_cast<double>(st[h]) * static_cast<double>(st[h]);
      }
      const auto inv = static_cast<float>(1.0 / std::sqrt(sq / static_cast<double>(H) + 1e-6));
      for (std::uint64_t h = 0; h < H; ++h) st[h] *= inv;
    }
    if (pieces_of != layer) layer_tokens = 0;
    pieces_of = layer;
    layer_tokens += n;
    pass_tokens = std::max(pass_tokens, layer_tokens);
    if (ends_pass(s)) {
      r.tokens += std::exchange(pass_tokens, 0U);  // a pass whose last layer lost a row still counts
      pieces_of = no_layer;
      ++passes;
      // Every `interval` passes the hot sets move (demotions first) and the runtime follows.
      if (hot && passes % o.interval == 0) {
        const expage::hot_set_plan plan = hot->end_interval(&hot_budget->root());
        const auto targets = expage::to_transition_targets<expage::residency_target>(plan);
        rt.update_targets(targets);  // the plan lists what changed: a promotion still queued stays
      }
      // Four pools: the pass's KV reads, the hi sets, and every --burst passes a drained barrier.
      if (pools) {
        pools->end_pass(passes - 1, [&] {
          compute.synchronize();
          prefetch.synchronize();
        });
      }
    }
  }
  compute.synchronize();
  prefetch.synchronize();
  rt.poll();
  r.wall_s = std::chrono::duration<double>(clock_type::now() - t0).count();
  r.compute_s = backend.compute_seconds();
  r.stats = rt.statistics();
  if (prefetcher) r.prefetcher = prefetcher->statistics();
  if (pools) r.four_pool = pools->report();
  if (hot) r.hot_set = hot->statistics();
  r.wait_s = backend.wait_seconds(r.stats);
  if (!quiet && !o.trace_out.empty()) {
    std::ostringstream trace;
    rt.trace().write_json(trace);
    r.chrome_trace = std::move(trace).str();
  }
  return r;
}

std::vector<step_routing> load_trace(const options& o, const expage::moe_geometry& g) {
  expage::routing_trace trace = expage::read_trace(o.trace, g);
  std::vector<step_routing> steps;
  std::map<std::uint32_t, std::uint32_t> token_slot;  // sequence → hidden state
  std::uint64_t tokens = 0;
  for (const expage::routing_event e : trace) {
    if (o.problem != std::numeric_limits<std::uint32_t>::max() && e.sequence != o.problem) continue;
    if (steps.empty() || steps.back().layer != e.layer || steps.back().tokens.size() == g.experts_per_layer()) {
      // A pass starts at an earlier layer than the step before, as ends_pass() ends one (a split
      // layer is one pass, not several; a pass whose layer 0 lost its row still starts).
      const bool new_pass = steps.empty() || e.layer < steps.back().layer;
      if (new_pass && o.tokens != 0 && ++tokens > o.tokens) break;
      steps.push_back({.layer = e.layer, .tokens = {}, .ids = {}, .weights = {}});
    }
    steps.back().tokens.push_back(
        token_slot.try_emplace(e.sequence, static_cast<std::uint32_t>(token_slot.size())).first->second);
    for (std::size_t k = 0; k < e.experts.size(); ++k) {
      steps.back().ids.push_back(static_cast<std::int32_t>(e.experts[k]));
      steps.back().weights.push_back(e.weights[k]);
    }
  }
  // The loop ended before --tokens passes: say so (not for an empty problem, which is refused).
  if (o.tokens != 0 && tokens < o.tokens && !steps.empty()) {
    fmt::print(stderr, "moe_decode: {} {}: {} has {} forward passes{}; running them all\n",
               o.tokens_by_quick ? "--quick's tokens" : "--tokens", o.tokens, o.trace, tokens,
               o.problem != std::numeric_limits<std::uint32_t>::max() ? " in that problem" : "");
  }
  return steps;
}

// The four-pool run: the splits the controller chose, the KV pool's reads and the budget.
void print_four_pool(const four_pool_report& f, const expage::runtime_statistics& stats, const options& o) {
  const expage::four_pool_model& m = f.model;
  const auto split = [&](const expage::four_pool_split& s) {
    return fmt::format("{} hi + {} lo per layer, KV {}", s.hi_slots, s.lo_slots, expage::byte_size{s.kv_bytes});
  };
  fmt::print(
      "  four pools under one budget of {}: hi {} ({}), lo {} ({}), KV of the {} sessions ({} per token, blocks "
      "of {}, floor {}); costs of {}: hi miss {:.2f} µs, lo miss {:.2f} µs, KV block recompute {:.2f} µs, a lo "
      "activation {:.2f} µs\n",
      expage::byte_size{m.budget_bytes}, o.format, expage::byte_size{m.hi_expert_bytes}, *o.lo_format,
      expage::byte_size{m.lo_expert_bytes}, f.sessions, expage::byte_size{f.kv_per_token},
      expage::byte_size{m.block_bytes}, expage::byte_size{m.kv_floor_bytes}, f.hardware, 1e6 * m.hi_miss_seconds,
      1e6 * m.lo_miss_seconds, 1e6 * m.kv_miss_seconds, 1e6 * m.lo_activation_seconds);
  fmt::print("    start: {}\n", split(f.initial));
  for (const four_pool_burst& b : f.moves) {
    fmt::print("    after pass {}: {} (predicted {:.1f} µs → {:.1f} µs over the window){}\n", b.passes, split(b.split),
               1e6 * b.current_cost, 1e6 * b.target_cost, b.applied ? "" : ", refused: the previous split stays");
  }
  const auto& t = stats.total;
  fmt::print(
      "  four-pool: {} barriers, {} moves ({} reversals, {} refused, {} session-mix changes); budget peak {} of {}; "
      "served hi {:.1f}% (lo {}), promotions {}, demotions {}, switches {}\n",
      f.bursts, f.stats.moves, f.stats.reversals, f.stats.failed_resizes, f.stats.mix_changes,
      expage::byte_size{f.budget_peak}, expage::byte_size{m.budget_bytes}, 100 * stats.hi_coverage(), t.lo_served,
      t.promotions, t.demotions, t.switches);
  fmt::print(
      "  KV pool: {} block reads, {} hits, {} cold, {} recomputes ({:.3f} s modelled), {} evictions; a pool of {} "
      "blocks at the end\n",
      f.kv.references, f.kv.hits, f.kv.cold, f.kv.recomputes, static_cast<double>(f.kv.recomputes) * m.kv_miss_seconds,
      f.kv.evictions, f.kv_blocks_final);
}

void write_four_pool_json(std::ostream& f, const four_pool_report& r) {
  const auto split = [](const expage::four_pool_split& s) {
    return fmt::format(R"({{"hi_slots":{},"lo_slots":{},"kv_bytes":{}}})", s.hi_slots, s.lo_slots, s.kv_bytes);
  };
  const expage::four_pool_model& m = r.model;
  f << fmt::format(
      R"({{"budget_bytes":{},"budget_peak_bytes":{},"hi_expert_bytes":{},"lo_expert_bytes":{},"block_bytes":{},)"
      R"("kv_floor_bytes":{},"hi_miss_s":{},"lo_miss_s":{},"kv_miss_s":{},"lo_activation_s":{},"initial":{},)",
      m.budget_bytes, r.budget_peak, m.hi_expert_bytes, m.lo_expert_bytes, m.block_bytes, m.kv_floor_bytes,
      m.hi_miss_seconds, m.lo_miss_seconds, m.kv_miss_seconds, m.lo_activation_seconds, split(r.initial));
  f << "\"moves\":[";
  for (std::size_t i = 0; i < r.moves.size(); ++i) {
    const four_pool_burst& b = r.moves[i];
    f << (i == 0 ? "" : ",")
      << fmt::format(R"({{"passes":{},"from":{},"to":{},"applied":{},"predicted_s":{},"target_predicted_s":{}}})",
                     b.passes, split(b.from), split(b.split), b.applied, b.current_cost, b.target_cost);
  }
  f << fmt::format(R"(],"barriers":{},"kv":{{"reads":{},"hits":{},"cold":{},"recomputes":{},"evictions":{},)"
                   R"("blocks_final":{}}},"controller":)",
                   r.bursts, r.kv.references, r.kv.hits, r.kv.cold, r.kv.recomputes, r.kv.evictions, r.kv_blocks_final);
  r.stats.write_json(f);
  f << '}';
}

template <class Policy>
int run(const options& o) {
  // An output that is standard output (--json /dev/stdout, or the file it is redirected to) gets
  // it alone: the report goes to standard error, until the outputs are written and after.
  std::vector<std::filesystem::path> outputs_named;
  for (const std::string* path : {&o.json, &o.trace_out, &o.write_weights}) {
    if (!path->empty()) outputs_named.emplace_back(*path);
  }
  expage::report_off_stdout report(outputs_named);
  std::FILE* const after_outputs = report.names_standard_output() ? stderr : stdout;
  const expage::moe_geometry g = scaled(expage::geometry_from_argument(o.geometry), o.scale);
  if (!o.write_weights.empty()) {
    report.put_back();
    write_safetensors(o.write_weights, g);
    fmt::print(after_outputs, "wrote {} experts of {} ({} bf16) to {}\n", g.expert_count(), g.name(),
               expage::byte_size{g.total_expert_bytes(precision::bf16)}, o.write_weights);
    return 0;
  }
  std::vector<step_routing> replay;
  if (!o.trace.empty()) {
    replay = load_trace(o, expage::geometry_from_argument(o.geometry));
    if (replay.empty()) {  // never fall back to the model's routing when a trace was asked for
      usage(fmt::format("--problem {}: no event of {} belongs to this sequence", o.problem, o.trace));
    }
  }
  if (o.four_pool) {  // what the flags decide, before the weights are made
    try {
      const expage::kv_block_stream kv = four_pool_sessions(o, passes_of(o, replay, g.layers()));
      // The model too, on the host, where the granules are known before the backend exists (a
      // device's come from its driver: checked once it is up).
      if (o.backend != "cuda") {
        const std::size_t granule = host_granularity(o, g, true);
        std::uint64_t kv_per_token = 0;
        (void)four_pool_model_of(o, g, experts_for(o.budget, g) * version_bytes(g, o.format, granule),
                                 version_bytes(g, o.format, granule), version_bytes(g, *o.lo_format, granule), kv,
                                 largest_group(g, replay), kv_per_token);
      }
    } catch (const expage::invalid_argument& e) {
      usage(fmt::format("--four-pool: {}", e.what()));
    }
  }
  if (o.lo_format) {
    // The hot sets move after every interval-th pass: a move after the last pass changes nothing the
    // run serves, so an interval as long as the run leaves --lo-precision's hot set as it started.
    if (const std::uint64_t passes = passes_of(o, replay, g.layers()); o.interval >= passes) {
      const std::string interval = fmt::format("--interval {}{}", o.interval, o.interval_given ? "" : " (the default)");
      usage(passes < 2 ? fmt::format("{}: the run has {} pass, so the hot set would never move (decode at least 2: "
                                     "--tokens, or a longer --trace)",
                                     interval, passes)
                       : fmt::format("{} out of range [1, {}] (the run has {} passes: the hot set would never move)",
                                     interval, passes - 1, passes));
    }
  }
  // On a device every expert's stored bytes are staged in pinned host memory (cuda_backend), read
  // from the generator or the file once: the store itself then keeps nothing in memory.
  const bool on_device = o.backend == "cuda";
  if (!on_device) check_host_memory(o, g, replay);
  options store_options = o;
  if (on_device) {
    const std::uint64_t pinned =
        g.total_expert_bytes(o.format) + (o.lo_format ? g.total_expert_bytes(*o.lo_format) : 0);
    if (pinned > o.host_limit) {
      usage(fmt::format("--backend cuda holds every expert in pinned host memory: {} over --host-limit {}",
                        expage::byte_size{pinned}, expage::byte_size{o.host_limit}));
    }
    store_options.host_limit = 0;
  }
  const weight_store store(g, o.format, store_options);
  fmt::print(
      "moe_decode: {} ({} layers × {} experts, top-{}, {} per expert in {}), budget {:.0f}% ({} experts), {}, "
      "view {}, policy {}, weights {}\n",
      g.name(), g.layers(), g.experts_per_layer(), g.top_k(), expage::byte_size{g.expert_bytes(o.format)}, o.format,
      o.budget * 100, experts_for(o.budget, g),
      replay.empty() ? fmt::format("{} tokens routed by the model", o.tokens == 0 ? 32 : o.tokens)
                     : fmt::format("{} layer steps replayed from {}", replay.size(), o.trace),
      o.view, o.policy,
      !o.weights.empty()  ? o.weights
      : on_device         ? "generated, in pinned host memory"
      : store.in_memory() ? "generated, in host memory"
                          : "generated by the loader");
  std::optional<weight_store> lo_store;
  if (o.lo_format) lo_store.emplace(g, *o.lo_format, store_options);
  const auto run_decode = [&](const options& with, const weight_store* lo, double budget, bool quiet) {
#if EXPAGE_MOE_DECODE_CUDA
    if (with.backend == "cuda") return decode<cuda_backend, Policy>(with, g, store, lo, budget, replay, quiet);
#endif
    return decode<host_backend, Policy>(with, g, store, lo, budget, replay, quiet);
  };
#if EXPAGE_MOE_DECODE_CUDA
  if (on_device) {
    fmt::print("  backend cuda: {}; pages on cuda_vmm, loads copied raw from pinned memory, FFN on the device\n",
               expage::cuda::device_status());
  }
#endif
  const run_result r = run_decode(o, lo_store ? &*lo_store : nullptr, o.budget, false);
  const auto& t = r.stats.total;
  // With the output check the loop also runs the host reference FFN of every layer, overlapped
  // with the compute stream's: the figure says so (--no-check for the decode alone).
  fmt::print("  tokens {}  in {:.2f} s  ({:.1f} tokens/s{})\n", r.tokens, r.wall_s,
             static_cast<double>(r.tokens) / r.wall_s, o.check ? ", the output check included" : "");
  if (r.stats.tiers.size() > 1) {
    fmt::print("  all tiers: hits {}  misses {}  hit rate {:.1f}%  evictions {}\n", t.hits, t.misses,
               100 * r.stats.hit_ratio(), t.evictions);
    for (const expage::runtime_tier_statistics& tier : r.stats.tiers) {
      const auto& s = tier.total;
      fmt::print(
          "  tier {}: hits {}  misses {}  hit rate {:.1f}%  evictions {}\n", tier.format, s.hits, s.misses,
          s.hits + s.misses == 0 ? 0.0 : 100.0 * static_cast<double>(s.hits) / static_cast<double>(s.hits + s.misses),
          s.evictions);
    }
  } else {
    fmt::print("  tier {}: hits {}  misses {}  hit rate {:.1f}%  evictions {}\n", r.stats.tier, t.hits, t.misses,
               100 * r.stats.hit_ratio(), t.evictions);
  }
  if (r.four_pool) {
    print_four_pool(*r.four_pool, r.stats, o);
  } else if (o.lo_format) {
    fmt::print(
        "  tiers: {} hi ({}) + {} lo ({}) versions; hot set {} per layer every {} passes; served hi {:.1f}% "
        "(lo {}), promotions {} ({}), demotions {} ({}), switches {}, transitions cancelled {}\n",
        r.hi_capacity, o.format, r.lo_capacity, *o.lo_format, r.hi_per_layer, o.interval, 100 * r.stats.hi_coverage(),
        t.lo_served, t.promotions, expage::byte_size{t.promotion_bytes}, t.demotions,
        expage::byte_size{t.demotion_bytes}, t.switches, r.stats.transitions_cancelled);
  }
  if (o.prefetch != "none") {
    fmt::print("  prefetch ({}{}): {} issued ({}), used {} ({}), wasted {} ({}), cancelled {}\n", o.prefetch,
               o.pooling == expage::coactivation_pooling::mean ? ", mean pooling" : "", t.prefetches,
               expage::byte_size{t.prefetch_bytes}, t.prefetch_used, expage::byte_size{t.prefetch_used_bytes},
               t.prefetch_wasted, expage::byte_size{t.prefetch_wasted_bytes}, r.stats.prefetch_cancelled);
    fmt::print(
        "  guards: requests paused after {} of {} layer steps ({} by the stall guard); demand loading alone: {} "
        "loads ({}) by LRU{}\n",
        r.prefetcher.paused, r.prefetcher.layers, r.prefetcher.stall_paused, r.prefetcher.shadow_misses,
        expage::byte_size{r.prefetcher.shadow_bytes},
        r.prefetcher.policy_shadow_misses != 0 ? fmt::format(", {} by {}", r.prefetcher.policy_shadow_misses, o.policy)
                                               : std::string());
    if (o.policy != "lru" && o.duel_passes != 0) {
      fmt::print("  eviction duel over {} passes: LRU ranked the victims after {} of {} layer steps ({} switches)\n",
                 o.duel_passes, r.prefetcher.lru_layers, r.prefetcher.layers, r.prefetcher.duel_switches);
    }
  }
  fmt::print(
      "  bytes moved {} (demand {}, prefetch {}, transitions {})  compute {:.3f} s  waiting on loads {:.3f} s  "
      "checking {:.3f} s\n",
      expage::byte_size{bytes_moved(t)}, expage::byte_size{t.bytes_loaded}, expage::byte_size{t.prefetch_bytes},
      expage::byte_size{t.promotion_bytes + t.demotion_bytes}, r.compute_s, r.wait_s, r.check_s);
  if (o.check && on_device) {
    fmt::print(
        "  check against all-resident weights in the served precision (host FFN): {} of {} layer steps differ (max "
        "error ≤ {:.1e} of the output's scale required, the device FFN's bound), worst {:.2e}\n",
        r.mismatching_layers, t.acquires, device_tolerance(expage::expert_ffn_shape::of(g)), r.worst_error);
    if (o.lo_format || o.format != precision::bf16) {
      fmt::print("  against all-bf16: relative RMS mean {:.2e}, worst {:.2e}\n",
                 r.sum_bf16_error / static_cast<double>(std::max<std::uint64_t>(1, t.acquires)), r.worst_bf16_error);
    }
  } else if (o.check && (o.lo_format || o.format != precision::bf16)) {
    fmt::print(
        "  check against all-resident weights in the served precision: {} of {} layer steps differ (bit-exact "
        "required); against all-bf16: relative RMS mean {:.2e}, worst {:.2e}\n",
        r.mismatching_layers, t.acquires,
        r.sum_bf16_error / static_cast<double>(std::max<std::uint64_t>(1, t.acquires)), r.worst_bf16_error);
  } else if (o.check) {
    fmt::print("  check against all-resident weights: {} of {} layer steps differ (bit-exact required)\n",
               r.mismatching_layers, t.acquires);
  }
  if (o.physics) {
    // The physics: all-resident compute + bytes moved / memcpy bandwidth, measured now.
    options all = o;
    all.check = false;
    all.lo_format.reset();  // the physics: one tier, all resident
    const run_result resident = run_decode(all, nullptr, 1.0, true);
    std::vector<std::byte> a(64_MiB, std::byte{1}), b(64_MiB);
    const auto m0 = clock_type::now();
    for (int i = 0; i < 8; ++i) std::memcpy(b.data(), a.data(), a.size());
    const double bw =
        8.0 * static_cast<double>(a.size()) / std::chrono::duration<double>(clock_type::now() - m0).count();
    options timed = o;
    timed.check = false;
    const run_result paged = run_decode(timed, lo_store ? &*lo_store : nullptr, o.budget, true);
    const std::uint64_t moved = bytes_moved(paged.stats.total);
    // The resident run starts empty: its first use of each expert loads it. Its time without that
    // wait is the all-resident compute; the paged run's bytes are all charged at memcpy speed.
    const double resident_compute = resident.wall_s - resident.wait_s;
    const double physics = resident_compute + static_cast<double>(moved) / bw;
    fmt::print(
        "  physics: all-resident {:.3f} s ({:.3f} s less its first loads' {:.3f} s) + {} / {:.1f} GB/s = {:.3f} s; "
        "paged {:.3f} s: {:.3f}× the physics\n",
        resident_compute, resident.wall_s, resident.wait_s, expage::byte_size{moved}, bw * 1e-9, physics, paged.wall_s,
        paged.wall_s / physics);
  }
  // The outputs, every file or none: the Chrome trace and {"runtime": ..., "prefetcher", "hot_set",
  // "four_pool": ... or null}.
  std::vector<expage::file_output> outputs;
  if (!o.trace_out.empty()) {
    outputs.push_back({o.trace_out, [&](std::ostream& f) { f << r.chrome_trace; }});
  }
  if (!o.json.empty()) {
    outputs.push_back({o.json, [&](std::ostream& f) {
                         f << "{\"runtime\":";
                         r.stats.write_json(f);
                         f << ",\"prefetcher\":";
                         if (o.prefetch != "none") {
                           r.prefetcher.write_json(f);
                         } else {
                           f << "null";
                         }
                         f << ",\"hot_set\":";
                         if (r.hot_set) {
                           r.hot_set->write_json(f);
                         } else {
                           f << "null";
                         }
                         f << ",\"four_pool\":";
                         if (r.four_pool) {
                           write_four_pool_json(f, *r.four_pool);
                         } else {
                           f << "null";
                         }
                         f << "}\n";
                       }});
  }
  report.put_back();
  expage::write_files_atomically(outputs);
  if (!o.trace_out.empty()) fmt::print(after_outputs, "  Chrome trace: {}\n", o.trace_out);
  return o.check && r.mismatching_layers != 0 ? 1 : 0;
}

int run_main(int argc, char** argv) {
  try {
    const options o = parse(argc, argv);
    // Every output checked before the work that produces it (its directory exists and is writable).
    for (const auto& [flag, path] : {std::pair{"--json", &o.json}, std::pair{"--trace-out", &o.trace_out},
                                     std::pair{"--write-weights", &o.write_weights}}) {
      if (path->empty()) continue;
      try {
        (void)expage::check_output(*path);
      } catch (const expage::invalid_argument& e) {
        fmt::print(stderr, "moe_decode: {} {}\n", flag, e.what());
        return 1;
      }
    }
    if (o.backend == "cuda") {
#if EXPAGE_MOE_DECODE_CUDA
      if (!expage::cuda::device_available()) {
        fmt::print(stderr, "moe_decode: no CUDA device: {} (--backend cuda needs one)\n",
                   expage::cuda::device_status());
        return 2;
      }
#else
      fmt::print(stderr,
                 "moe_decode: --backend cuda: built without CUDA (EXPAGE_ENABLE_CUDA=OFF or no nvcc found); "
                 "use --backend host\n");
      return 2;
#endif
    }
    // A predicting policy runs inside a duel_policy: with --prefetch, the prefetcher's eviction
    // duel hands its victims to LRU order while LRU demand loading has been missing less.
    if (o.policy == "lfu") return run<expage::duel_policy<expage::lfu_policy>>(o);
    if (o.policy == "next-turn") return run<expage::duel_policy<expage::next_turn_policy>>(o);
    return run<expage::lru_policy>(o);
  } catch (const usage_error& e) {
    fmt::print(stderr, "moe_decode: {}\n", e.what());
    return 2;
  } catch (const std::bad_alloc& e) {
    // A bare bad_alloc names nothing (the budget's own out_of_budget / out_of_memory name the request).
    fmt::print(stderr, "moe_decode: {}{}\n", e.what(),
               typeid(e) == typeid(std::bad_alloc)
                   ? ": out of memory: lower --host-limit (0 holds no weights: the loader generates them), raise "
                     "--scale, or raise the process's memory limit"
                   : "");
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "moe_decode: {}\n", e.what());
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  // Past `ulimit -f`, or into a pipe whose reader has gone, a write then fails (EFBIG, EPIPE) and
  // is reported, its temporary file removed; SIGXFSZ or SIGPIPE would end the process and leave it.
  std::signal(SIGXFSZ, SIG_IGN);
  std::signal(SIGPIPE, SIG_IGN);
  expage::remove_staged_files_on_signals();  // Ctrl-C or `timeout` during the write: the same
  const int status = run_main(argc, argv);
  return expage::finish_standard_output("moe_decode") ? status : std::max(status, 1);
}

// cuda::copy_engine against the fake runtime (fake_cuda_driver.hpp): every byte arrives through
// both routes and across chunk boundaries; a chunk copy or a fence that fails still joins every
// internal stream that took a chunk to the caller's stream before the error is thrown; a slot
// whose fence cannot be recorded is waited for; nothing is left live. No GPU needed: "device"
// memory is host memory and a stream runs its work at once, so these tests check what is asked
// of the runtime and in which order, not concurrency.
#include "cuda/fake_cuda_test.hpp"
#include "expage/core/error.hpp"
#include "expage/cuda/copy_engine.hpp"
#include "expage/cuda/pinned_host_memory.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <set>
#include <vector>

namespace {

namespace fake = expage::testing::fake_cuda;
using expage::cuda::copy_engine;
using expage::cuda::cuda_stream;
using call = fake::call;

constexpr std::size_t chunk = std::size_t{64} << 10;  // the engine's smallest chunk

std::vector<std::byte> pattern(std::size_t bytes, unsigned seed) {
  std::vector<std::byte> v(bytes);
  for (std::size_t i = 0; i < bytes; ++i) v[i] = static_cast<std::byte>((i * 131 + seed * 7 + (i >> 12)) & 0xFF);
  return v;
}

class CopyEngineFaults : public fake::fake_cuda_test {
 protected:
  // The internal streams that took a chunk copy since log entry @p from.
  static std::set<cudaStream_t> copied_on(std::size_t from) {
    std::set<cudaStream_t> out;
    const auto& log = fake::state().log;
    for (std::size_t i = from; i < log.size(); ++i) {
      if (log[i].function == "cudaMemcpyAsync") out.insert(log[i].stream);
    }
    return out;
  }

  // Whether @p internal is joined to @p caller after log entry @p after: an event recorded on
  // it and then waited for by the caller's stream, or the host waiting for the stream.
  static bool joined(cudaStream_t internal, cudaStream_t caller, std::size_t after) {
    const auto& log = fake::state().log;
    for (std::size_t i = after; i < log.size(); ++i) {
      if (log[i].function == "cudaStreamSynchronize" && log[i].stream == internal) return true;
      if (log[i].function != "cudaEventRecord" || log[i].stream != internal || log[i].failed) continue;
      for (std::size_t j = i + 1; j < log.size(); ++j) {
        if (log[j].function == "cudaStreamWaitEvent" && log[j].stream == caller && log[j].event == log[i].event &&
            !log[j].failed) {
          return true;
        }
      }
    }
    return false;
  }

  // The last chunk copy's log entry.
  static std::size_t last_copy() {
    const auto& log = fake::state().log;
    std::size_t last = 0;
    for (std::size_t i = 0; i < log.size(); ++i) {
      if (log[i].function == "cudaMemcpyAsync") last = i;
    }
    return last;
  }
};

TEST_F(CopyEngineFaults, EveryByteArrivesThroughBothRoutesAcrossChunkBoundaries) {
  copy_engine engine({.streams = 3, .staging_slots = 2, .chunk_bytes = chunk});
  cuda_stream stream;
  expage::cuda::pinned_host_memory pinned({.block_size = chunk * 8});
  std::byte* pinned_source = pinned.allocate(1);
  std::uint64_t staged = 0, direct = 0;
  for (const std::size_t bytes : {std::size_t{1}, chunk - 1, chunk, chunk + 1, 5 * chunk + 3}) {
    const std::vector<std::byte> source = pattern(bytes, static_cast<unsigned>(bytes));
    std::vector<std::byte> dst(bytes);
    engine.copy(dst.data(), source.data(), bytes, stream);  // pageable: through the ring
    EXPECT_EQ(dst, source) << bytes << " bytes, staged";
    staged += (bytes + chunk - 1) / chunk;
    std::copy(source.begin(), source.end(), pinned_source);
    std::vector<std::byte> dst2(bytes);
    engine.copy(dst2.data(), pinned_source, bytes, stream);  // pinned: straight
    EXPECT_EQ(dst2, source) << bytes << " bytes, direct";
    direct += (bytes + chunk - 1) / chunk;
  }
  EXPECT_EQ(engine.statistics().staged_chunks, staged);
  EXPECT_EQ(engine.statistics().direct_chunks, direct);
  // A batch of regions, one of them empty.
  const std::vector<std::byte> a = pattern(3 * chunk + 5, 1), b = pattern(chunk / 2, 2);
  std::vector<std::byte> da(a.size()), db(b.size());
  const expage::copy_region regions[] = {
      {da.data(), a.data(), a.size()}, {nullptr, nullptr, 0}, {db.data(), b.data(), b.size()}};
  engine.copy(regions, stream);
  EXPECT_EQ(da, a);
  EXPECT_EQ(db, b);
  pinned.deallocate(pinned_source, 1);
}

// The k-th chunk copy fails: the copy throws, and every internal stream that took a chunk is
// joined to the caller's stream first (its chunks would still be writing the destination).
TEST_F(CopyEngineFaults, AFailedChunkCopyJoinsEveryStreamUsedBeforeItThrows) {
  for (const bool staged : {true, false}) {
    for (int k = 0; k < 5; ++k) {
      SCOPED_TRACE(fmt::format("{} route, chunk {} fails", staged ? "staged" : "direct", k));
      {
        copy_engine engine({.streams = 3, .staging_slots = 2, .chunk_bytes = chunk});
        cuda_stream stream;
        const std::vector<std::byte> source = pattern(5 * chunk, 3);
        std::vector<std::byte> dst(source.size());
        const std::size_t from = fake::state().log.size();
        fake::arm(call::memcpy_async, k);
        if (staged) {
          EXPECT_THROW(engine.copy_staged(dst.data(), source.data(), source.size(), stream), expage::cuda_error);
        } else {
          EXPECT_THROW(engine.copy_direct(dst.data(), source.data(), source.size(), stream), expage::cuda_error);
        }
        fake::disarm();
        const std::set<cudaStream_t> used = copied_on(from);
        EXPECT_EQ(used.size(), static_cast<std::size_t>(std::min(k + 1, 3)));
        for (const cudaStream_t s : used) EXPECT_TRUE(joined(s, stream.native(), last_copy()));
        engine.copy(dst.data(), source.data(), source.size(), stream);  // the engine still works
        EXPECT_EQ(dst, source);
      }
      fake::reset();
    }
  }
}

// The join itself fails for one stream (its event cannot be recorded, or the caller's stream
// cannot wait on it): the host waits for that stream, the others are still joined, and the first
// error is thrown.
TEST_F(CopyEngineFaults, AJoinThatFailsIsAHostWaitAndTheOtherStreamsAreStillJoined) {
  for (const call step : {call::event_record, call::stream_wait_event}) {
    SCOPED_TRACE(step == call::event_record ? "record fails" : "wait fails");
    {
      copy_engine engine({.streams = 3, .staging_slots = 4, .chunk_bytes = chunk});
      cuda_stream stream;
      expage::cuda::pinned_host_memory pinned({.block_size = chunk * 4});
      std::byte* source = pinned.allocate(1);
      std::vector<std::byte> dst(4 * chunk);
      const std::size_t from = fake::state().log.size();
      // Direct chunks record no slot event: the records are the start fence (1) and the joins.
      fake::arm(step, step == call::event_record ? 2 : 3 + 1);  // the second stream's join
      EXPECT_THROW(engine.copy_direct(dst.data(), source, dst.size(), stream), expage::cuda_error);
      fake::disarm();
      const std::set<cudaStream_t> used = copied_on(from);
      EXPECT_EQ(used.size(), 3U);
      for (const cudaStream_t s : used) EXPECT_TRUE(joined(s, stream.native(), last_copy()));
      pinned.deallocate(source, 1);
    }
    fake::reset();
  }
}

// A staging slot's fence cannot be recorded: the copy that reads the slot is waited for on the
// host (its stream synchronized) before the error, and the slot is not fenced on a record that
// never happened when it is reused.
TEST_F(CopyEngineFaults, ASlotWhoseFenceCannotBeRecordedIsWaitedFor) {
  copy_engine engine({.streams = 2, .staging_slots = 2, .chunk_bytes = chunk});
  cuda_stream stream;
  const std::vector<std::byte> source = pattern(chunk, 4);
  std::vector<std::byte> dst(chunk);
  const std::size_t from = fake::state().log.size();
  fake::arm(call::event_record, 1);  // after the start fence: the slot's
  EXPECT_THROW(engine.copy_staged(dst.data(), source.data(), chunk, stream), expage::cuda_error);
  fake::disarm();
  const auto& log = fake::state().log;
  std::size_t copy_at = 0;
  for (std::size_t i = from; i < log.size(); ++i) {
    if (log[i].function == "cudaMemcpyAsync") copy_at = i;
  }
  bool waited = false;
  for (std::size_t i = copy_at + 1; i < log.size(); ++i) {
    waited = waited || (log[i].function == "cudaStreamSynchronize" && log[i].stream == log[copy_at].stream);
  }
  EXPECT_TRUE(waited) << "the copy reading the slot was not waited for";
  const std::uint64_t fences = engine.statistics().slot_fences;
  for (int i = 0; i < 3; ++i) engine.copy(dst.data(), source.data(), chunk, stream);
  EXPECT_EQ(dst, source);
  EXPECT_EQ(engine.statistics().slot_fences, fences + 1)
      << "slot 1 needs no fence, slot 0 (its record failed) none, slot 1 one";
}

TEST_F(CopyEngineFaults, ACapturedStreamIsRefusedBeforeAnything) {
  copy_engine engine({.streams = 2, .staging_slots = 2, .chunk_bytes = chunk});
  cuda_stream stream;
  const std::vector<std::byte> source = pattern(chunk, 5);
  std::vector<std::byte> dst(chunk);
  fake::state().capturing = true;
  const std::size_t from = fake::state().log.size();
  EXPECT_THROW(engine.copy(dst.data(), source.data(), chunk, stream), expage::invalid_argument);
  fake::state().capturing = false;
  EXPECT_TRUE(copied_on(from).empty());
  EXPECT_EQ(engine.statistics().submissions, 0U);
}

// Construction fails when the staging ring cannot be pinned, and leaves nothing behind; the
// destructor waits for every slot's last copy before the ring goes.
TEST_F(CopyEngineFaults, ConstructionAndDestructionLeaveNothingLive) {
  fake::arm(call::host_alloc, 0);
  EXPECT_THROW(copy_engine({.streams = 2, .staging_slots = 2, .chunk_bytes = chunk}), expage::out_of_memory);
  fake::disarm();
  EXPECT_TRUE(fake::nothing_live());
  std::size_t from = 0;
  {
    copy_engine engine({.streams = 2, .staging_slots = 3, .chunk_bytes = chunk});
    cuda_stream stream;
    const std::vector<std::byte> source = pattern(3 * chunk, 6);
    std::vector<std::byte> dst(source.size());
    engine.copy(dst.data(), source.data(), source.size(), stream);
    from = fake::state().log.size();
  }
  std::size_t slot_waits = 0;
  const auto& log = fake::state().log;
  for (std::size_t i = from; i < log.size(); ++i) {
    if (log[i].function == "cudaEventSynchronize") ++slot_waits;
  }
  EXPECT_EQ(slot_waits, 3U) << "one wait per staging slot";
}

}  // namespace

// Work units dealt out as one contiguous share per thread, with stealing at the end.
//
// A kernel that splits its work statically (each thread streams its own part of a
// weight, in order, and fetches its own next panel ahead) waits at the closing barrier
// for its slowest thread. On a 2-vCPU VM the two halves of a matmul rarely finish
// together: the hypervisor takes a vCPU away for a while, or one thread's part of the
// weight comes from memory more slowly. Measured inside decode steps on AMD EPYC model
// 17 (rdtsc at each thread's end, docs/results/issue17/genoa5/gemm_work_shares.txt):
// the threads finished 5-11% of the call's time apart at 1-16 rows, 3-4% at 64 and
// 2-4% in prefill, one of them idle all that while; with stealing (the GEMM's units
// are two row tiles against a panel) 1.6%, 0.6-1.1% and 0.1%.
//
// So each thread walks its own share from the front, and a thread whose share is done
// takes units one at a time from the back of the share with the most left. The owner
// keeps its order and its fetching ahead until the shares meet; which thread computes
// a unit never changes a result (a unit's arithmetic does not depend on who runs it).
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>

namespace kvloom_work {

struct Unit {
  int share;      // the share the unit belongs to
  int64_t index;  // its position in that share, 0 .. size - 1
  bool stolen;    // taken from the back of another thread's share
};

class WorkShares {
 public:
  // Share s holds units [0, sizes(s)); sizes(s) < 2^31.
  template <class Sizes>
  WorkShares(int count, Sizes sizes) : count_(count), shares_(new Share[count]) {
    for (int s = 0; s < count; ++s) shares_[s].bounds.store(pack(0, sizes(s)), std::memory_order_relaxed);
  }

  // The calling thread's next unit: its own share's front, else the back of the share
  // with the most units left. False when every share is empty.
  bool next(int self, Unit& unit) {
    if (take_front(self, unit.index)) {
      unit.share = self;
      unit.stolen = false;
      return true;
    }
    for (;;) {
      int victim = -1;
      int64_t most = 0;
      for (int s = 0; s < count_; ++s) {
        const uint64_t b = shares_[s].bounds.load(std::memory_order_relaxed);
        if (back(b) - front(b) > most) most = back(b) - front(b), victim = s;
      }
      if (victim < 0) return false;
      if (take_back(victim, unit.index)) {
        unit.share = victim;
        unit.stolen = true;
        return true;
      }
    }
  }

 private:
  // One cache line per share: the owner's takes do not bounce the others' lines.
  struct alignas(64) Share {
    std::atomic<uint64_t> bounds;  // front << 32 | back: the units [front, back) left
  };
  static uint64_t pack(int64_t front, int64_t back) { return static_cast<uint64_t>(front) << 32 | static_cast<uint64_t>(back); }
  static int64_t front(uint64_t b) { return static_cast<int64_t>(b >> 32); }
  static int64_t back(uint64_t b) { return static_cast<int64_t>(b & 0xffffffffu); }

  bool take_front(int s, int64_t& index) {
    uint64_t b = shares_[s].bounds.load(std::memory_order_relaxed);
    while (front(b) < back(b))
      if (shares_[s].bounds.compare_exchange_weak(b, pack(front(b) + 1, back(b)), std::memory_order_relaxed)) {
        index = front(b);
        return true;
      }
    return false;
  }
  bool take_back(int s, int64_t& index) {
    uint64_t b = shares_[s].bounds.load(std::memory_order_relaxed);
    while (front(b) < back(b))
      if (shares_[s].bounds.compare_exchange_weak(b, pack(front(b), back(b) - 1), std::memory_order_relaxed)) {
        index = back(b) - 1;
        return true;
      }
    return false;
  }

  int count_;
  std::unique_ptr<Share[]> shares_;
};

}  // namespace kvloom_work

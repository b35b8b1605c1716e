// Collectives between the tensor-parallel ranks of one host, through one shared
// memory region (kvloom/distributed/shm.py maps it in every rank).
//
// Region: kMaxRanks header lines, one per rank, then 2 parities x size slots of
// slot_bytes each. A collective is numbered: every rank runs the same collectives in
// the same order, so its own counter names the same one everywhere. For collective
// `seq` a rank writes its slot of parity seq % 2, then publishes `arrived = seq`
// (release); a reader waits until every rank's `arrived >= seq` (acquire), reads,
// then publishes `done = seq`. A writer first waits until every rank's `done >= seq - 2`:
// nobody still reads the slot it is about to overwrite. So no lock, and no wait at
// all where the ranks are in step.
//
// Waiting spins (pause) for 50 us, then sleeps in growing steps from 10 us up to 1 ms:
// the ranks of a step usually meet within microseconds, and a longer spin only burns a
// core that its neighbours (the other rank, rank 0's event loop) may want; an idle
// engine's ranks wait for the next step at no real cost. Every few milliseconds of
// waiting it checks that the ranks it waits for are alive (their pid): a rank that
// died makes the others fail at once (-2) rather than hang; past `timeout` seconds
// (0: none) a wait fails with -1.
//
// The all-reduce sums the ranks' slots in rank order in float32 and rounds once: every
// rank computes the same bits (same code, same order), and bf16 loses nothing between
// ranks. Built without -ffast-math (kvloom/native.py EXACT_SOURCES): that order is a promise.

#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#define KVLOOM_PAUSE() __builtin_ia32_pause()
#else
#define KVLOOM_PAUSE() std::this_thread::yield()
#endif

namespace {

constexpr int64_t kMaxRanks = 64;
// A wait spins for kSpinSeconds, yields the core until kYieldSeconds (equal here: no
// yielding phase), then sleeps (see the top of the file).
constexpr double kSpinSeconds = 50e-6;
constexpr double kYieldSeconds = 50e-6;
constexpr int64_t kLine = 64;

struct alignas(kLine) RankLine {
  int64_t arrived;
  int64_t done;
  int64_t pid;
};

inline RankLine* lines(uint8_t* region) { return reinterpret_cast<RankLine*>(region); }

inline uint8_t* slot(uint8_t* region, int64_t size, int64_t seq, int64_t rank, int64_t slot_bytes) {
  return region + kMaxRanks * kLine + ((seq & 1) * size + rank) * slot_bytes;
}

inline double now_seconds() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// A rank is dead when its pid is gone, or is a zombie that nobody has reaped yet (a
// parent blocked reading the dead rank's pipes, which this rank holds open, would
// otherwise keep it "alive" for ever).
inline bool alive(int64_t pid) {
  if (pid <= 0) return true;
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return false;
  char path[64];
  snprintf(path, sizeof path, "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* file = fopen(path, "r");
  if (file == nullptr) return true;  // no /proc here: kill's answer stands
  char text[512];
  const size_t length = fread(text, 1, sizeof text - 1, file);
  fclose(file);
  text[length] = '\0';
  const char* name_end = strrchr(text, ')');  // "pid (name) STATE ..."
  return name_end == nullptr || name_end[1] != ' ' || (name_end[2] != 'Z' && name_end[2] != 'X');
}

// Wait until field `done` (or `arrived`) of every rank is >= target. 0, -1 (timeout), -2 (a rank died).
int32_t wait_all(uint8_t* region, int64_t size, int64_t target, bool done, float timeout) {
  RankLine* line = lines(region);
  int64_t spins = 0;
  double started = 0.0, last_check = 0.0;
  long sleep_ns = 10000;
  for (;;) {
    bool ready = true;
    for (int64_t r = 0; r < size && ready; ++r) {
      const int64_t value = __atomic_load_n(done ? &line[r].done : &line[r].arrived, __ATOMIC_ACQUIRE);
      ready = value >= target;
    }
    if (ready) return 0;
    KVLOOM_PAUSE();
    if (++spins % 256 != 0) continue;  // the clock and the pids, now and then
    const double t = now_seconds();
    if (started == 0.0) started = last_check = t;
    if (t - last_check > 0.005) {
      last_check = t;
      for (int64_t r = 0; r < size; ++r) {
        if (!alive(__atomic_load_n(&line[r].pid, __ATOMIC_ACQUIRE))) return -2;
      }
    }
    if (timeout > 0 && t - started > timeout) return -1;
    if (t - started < kSpinSeconds) continue;  // a step's waits: spin, the other rank is near
    if (t - started < kYieldSeconds) {
      sched_yield();
      continue;
    }
    timespec pause_for = {0, sleep_ns};  // idle: the next step may be far off
    nanosleep(&pause_for, nullptr);
    if (sleep_ns < 1000000) sleep_ns *= 2;
  }
}

inline float to_float(float x) { return x; }

inline float to_float(uint16_t x) {  // bfloat16 -> float: the high half of a float
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float out;
  memcpy(&out, &bits, 4);
  return out;
}

inline void from_float(float x, float* out) { *out = x; }

inline void from_float(float x, uint16_t* out) {  // round to nearest even; NaN stays a quiet NaN
  uint32_t bits;
  memcpy(&bits, &x, 4);
  const uint32_t rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16;
  *out = static_cast<uint16_t>(x != x ? (bits >> 16) | 0x40 : rounded);  // branch-free: vectorizes
}

template <typename T>
int32_t all_reduce(uint8_t* region, T* data, int64_t numel, int64_t rank, int64_t size, int64_t seq,
                   int64_t slot_bytes, float timeout) {
  int32_t status = wait_all(region, size, seq - 2, true, timeout);
  if (status != 0) return status;
  memcpy(slot(region, size, seq, rank, slot_bytes), data, numel * sizeof(T));
  __atomic_store_n(&lines(region)[rank].arrived, seq, __ATOMIC_RELEASE);
  status = wait_all(region, size, seq, false, timeout);
  if (status != 0) return status;
  const T* parts[kMaxRanks];
  for (int64_t r = 0; r < size; ++r) parts[r] = reinterpret_cast<const T*>(slot(region, size, seq, r, slot_bytes));
  // Block by block, one simple loop per rank (each vectorizes): every element still
  // sums rank 0, 1, ... in that order.
  constexpr int64_t kBlock = 512;
  float sum[kBlock];
  for (int64_t base = 0; base < numel; base += kBlock) {
    const int64_t count = numel - base < kBlock ? numel - base : kBlock;
    for (int64_t i = 0; i < count; ++i) sum[i] = to_float(parts[0][base + i]);
    for (int64_t r = 1; r < size; ++r) {
      const T* part = parts[r] + base;
      for (int64_t i = 0; i < count; ++i) sum[i] += to_float(part[i]);
    }
    for (int64_t i = 0; i < count; ++i) from_float(sum[i], data + base + i);
  }
  __atomic_store_n(&lines(region)[rank].done, seq, __ATOMIC_RELEASE);
  return 0;
}

}  // namespace

extern "C" {

int64_t kvloom_shm_header_bytes() { return kMaxRanks * kLine; }

int64_t kvloom_shm_max_ranks() { return kMaxRanks; }

// Claim this rank's header line: its pid, nothing arrived or read yet.
void kvloom_shm_join(uint8_t* region, int64_t rank, int64_t pid) {
  RankLine* line = &lines(region)[rank];
  __atomic_store_n(&line->arrived, 0, __ATOMIC_RELAXED);
  __atomic_store_n(&line->done, 0, __ATOMIC_RELAXED);
  __atomic_store_n(&line->pid, pid, __ATOMIC_RELEASE);
}

// Write nbytes of src into this rank's slot of collective seq and publish it.
int kvloom_shm_publish(uint8_t* region, const uint8_t* src, int64_t nbytes, int64_t rank, int64_t size,
                       int64_t seq, int64_t slot_bytes, float timeout) {
  const int32_t status = wait_all(region, size, seq - 2, true, timeout);
  if (status != 0) return status;
  if (nbytes > 0) memcpy(slot(region, size, seq, rank, slot_bytes), src, nbytes);
  __atomic_store_n(&lines(region)[rank].arrived, seq, __ATOMIC_RELEASE);
  return 0;
}

// Wait until every rank has published collective seq; its slots may then be read.
int kvloom_shm_wait(uint8_t* region, int64_t size, int64_t seq, float timeout) {
  return wait_all(region, size, seq, false, timeout);
}

// This rank has read every slot of collective seq that it needs.
void kvloom_shm_done(uint8_t* region, int64_t rank, int64_t seq) {
  __atomic_store_n(&lines(region)[rank].done, seq, __ATOMIC_RELEASE);
}

// The decoder stack's all-reduce (csrc/decoder_stack.cpp calls it between its kernels).
// context, int64 [9]: region address, rank, size, seq (the next collective's number is
// seq + 1; advanced here, and shared with kvloom/distributed/shm.py), slot bytes,
// timeout in milliseconds (0: none), then what this adds to: calls, bytes, nanoseconds.
// data: [numel] bf16, summed in place, in slot-sized pieces. Returns 0, -1 or -2.
int kvloom_shm_all_reduce_stack(int64_t* context, uint16_t* data, int64_t numel) {
  uint8_t* region = reinterpret_cast<uint8_t*>(context[0]);
  const int64_t rank = context[1], size = context[2], slot_bytes = context[4];
  const float timeout = static_cast<float>(context[5]) / 1000.0f;
  const int64_t step = slot_bytes / static_cast<int64_t>(sizeof(uint16_t));
  const double started = now_seconds();
  for (int64_t start = 0; start < numel; start += step) {
    const int64_t count = numel - start < step ? numel - start : step;
    const int64_t seq = ++context[3];
    const int32_t status = all_reduce(region, data + start, count, rank, size, seq, slot_bytes, timeout);
    if (status != 0) return status;
  }
  context[6] += 1;
  context[7] += numel * static_cast<int64_t>(sizeof(uint16_t));
  context[8] += static_cast<int64_t>((now_seconds() - started) * 1e9);
  return 0;
}

int kvloom_shm_all_reduce_f32(uint8_t* region, float* data, int64_t numel, int64_t rank, int64_t size,
                              int64_t seq, int64_t slot_bytes, float timeout) {
  return all_reduce(region, data, numel, rank, size, seq, slot_bytes, timeout);
}

int kvloom_shm_all_reduce_bf16(uint8_t* region, uint16_t* data, int64_t numel, int64_t rank, int64_t size,
                               int64_t seq, int64_t slot_bytes, float timeout) {
  return all_reduce(region, data, numel, rank, size, seq, slot_bytes, timeout);
}

}  // extern "C"

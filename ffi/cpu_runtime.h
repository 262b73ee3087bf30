// What every CPU FFI handler file shares: the runner the loops are split over
// (an XLA-free interface; the handlers adapt XLA's thread pool to it), the
// denormal mode XLA's CPU runtime uses, buffer checks, and the registry
// through which each file hands its handlers to the nanobind module.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#define JAXCOMP_X86 1
#endif

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "jaxcomp/registry.h"
#include "kernel_table.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomp {

namespace ffi = xla::ffi;

// XLA's CPU runtime computes with denormals flushed (FTZ and DAZ); the
// kernels do the same so that they agree bit for bit with the jnp twins.
class FlushDenormals {
 public:
#if defined(JAXCOMP_X86)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#endif
};

// Where the CPU loops run their tasks. The kernels see only this interface,
// never XLA's types; handlers pass a PoolRunner.
class Runner {
 public:
  // Worker threads besides the calling one.
  virtual int64_t threads() const = 0;
  // Runs task on a worker, at some later time.
  virtual void schedule(std::function<void()> task) = 0;

 protected:
  ~Runner() = default;
};

// Runs fn(i0, i1) over [0, n) in chunks, on the calling thread and on the
// runner's workers. Chunks are claimed from a shared counter, so the caller
// never waits on a task that has not started; late tasks find no work and
// only touch the shared state they keep alive.
template <typename F>
inline void parallel_for(Runner& runner, int64_t n, int64_t min_per_task, const F& fn) {
  const int64_t threads = runner.threads();
  const int64_t by_size = min_per_task > 0 ? n / min_per_task : n;
  const int64_t tasks = std::min<int64_t>(threads + 1, by_size);
  if (tasks <= 1) {
    FlushDenormals fd;
    if (n > 0) fn(int64_t{0}, n);
    return;
  }
  const int64_t chunks = std::min<int64_t>(n, tasks * 4);
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto st = std::make_shared<State>();
  const F* f = &fn;
  auto run = [st, chunks, n, f]() {
    FlushDenormals fd;
    for (;;) {
      const int64_t c = st->next.fetch_add(1);
      if (c >= chunks) return;
      (*f)(c * n / chunks, (c + 1) * n / chunks);
      if (st->done.fetch_add(1) + 1 == chunks) {
        { std::lock_guard<std::mutex> lock(st->mu); }
        st->cv.notify_all();
      }
    }
  };
  for (int64_t t = 0; t + 1 < tasks; ++t) {
    runner.schedule(run);
  }
  run();
  std::unique_lock<std::mutex> lock(st->mu);
  st->cv.wait(lock, [&] { return st->done.load() == chunks; });
}

// A large output is usually a fresh allocation, and first-touch page faults
// then cost more than the kernel itself. On Linux, ask for transparent huge
// pages over the whole-2-MiB part of the buffer (a hint; harmless if refused
// or if the memory is already mapped).
inline void hint_huge_pages(void* p, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (bytes < 4 * static_cast<int64_t>(kHuge)) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes)) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

// Below this many elements per task, threading costs more than it saves.
constexpr int64_t kElementsPerTask = 1 << 16;

inline bool to_dtype(ffi::DataType t, DType* out) {
  switch (t) {
    case ffi::DataType::F32: *out = DType::kF32; return true;
    case ffi::DataType::BF16: *out = DType::kBF16; return true;
    case ffi::DataType::F16: *out = DType::kF16; return true;
    default: return false;
  }
}

// XLA's FFI thread pool as a Runner: the handlers' side.
class PoolRunner final : public Runner {
 public:
  explicit PoolRunner(ffi::ThreadPool& pool) : pool_(pool) {}
  int64_t threads() const override { return pool_.num_threads(); }
  void schedule(std::function<void()> task) override { pool_.Schedule(std::move(task)); }

 private:
  ffi::ThreadPool& pool_;
};

inline ffi::Error invalid(const char* op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + what);
}

inline int64_t num_buckets(int64_t n, int64_t bucket) { return (n + bucket - 1) / bucket; }

inline bool valid_bucket(int64_t b) { return b >= 8 && b <= (1 << 16) && (b & (b - 1)) == 0; }


}  // namespace jaxcomp

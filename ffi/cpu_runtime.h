// What every CPU family file shares. The first part is free of XLA types and
// is all the loops see: the runner their tasks go to, parallel_for and the
// batch loop over it, the denormal mode XLA's CPU runtime uses, the huge-page
// hint and the one switch that picks the instruction set. The last part is
// the handlers' side: XLA's thread pool as a runner.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#define JAXCOMP_X86 1
#endif

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace jaxcomp {

// ---------------------------------------------------------------------------
// The instruction set: GCC/Clang function multiversioning. A hot per-range
// loop marked JC_CPU_LOOP is compiled twice, for AVX2 and for the baseline
// x86-64, with everything it calls inlined into it (flatten), so each copy
// vectorizes with its own vector width; the dynamic loader picks one copy on
// the first call (an ifunc on __builtin_cpu_supports), once for the process.
// Everything else is compiled once, for the baseline: no out-of-line copy of
// an inline or library function exists in two builds that the linker could
// mix up (as with the former second compilation of the kernels with -mavx2).
//
// Loops with hand-written AVX2 intrinsic paths are defined through
// JC_CPU_LOOP_WITH_AVX2_PATHS instead: the same two versions, written out,
// whose AVX2 version runs body<true> and may call functions marked JC_AVX2.
// Elsewhere (another architecture, another OS) there is one build, the
// baseline. The module's isa() reports the version the loader picked.
// ---------------------------------------------------------------------------
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
#define JC_CPU_AVX2 1
#define JC_CPU_LOOP __attribute__((target_clones("avx2", "default"), flatten))
#define JC_AVX2 __attribute__((target("avx2")))
// The two versions are name##_versions; name itself is a plain function that
// calls them, so that the loops' address can be taken (passed to the
// thread pool): GCC at -O0 leaves the address of a multiversioned function
// of internal linkage unresolved at link time.
#define JC_CPU_LOOP_WITH_AVX2_PATHS(name, Args, body)                                                 \
  __attribute__((target("avx2"), flatten)) void name##_versions(const Args& a, int64_t i0,           \
                                                                int64_t i1) {                         \
    body<true>(a, i0, i1);                                                                            \
  }                                                                                                   \
  __attribute__((target("default"), flatten)) void name##_versions(const Args& a, int64_t i0,        \
                                                                   int64_t i1) {                      \
    body<false>(a, i0, i1);                                                                           \
  }                                                                                                   \
  void name(const Args& a, int64_t i0, int64_t i1) { name##_versions(a, i0, i1); }
#else
#define JC_CPU_AVX2 0
#define JC_CPU_LOOP
#define JC_CPU_LOOP_WITH_AVX2_PATHS(name, Args, body) \
  void name(const Args& a, int64_t i0, int64_t i1) { body<false>(a, i0, i1); }
#endif

// ---------------------------------------------------------------------------
// Threads
// ---------------------------------------------------------------------------
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

// Everything on the calling thread: the runner of one entry of a batch whose
// entries run in parallel.
class InlineRunner final : public Runner {
 public:
  int64_t threads() const override { return 0; }
  void schedule(std::function<void()> task) override { task(); }
};

// Below this many elements per task, threading costs more than it saves.
constexpr int64_t kElementsPerTask = 1 << 16;

// Tasks of whole buckets of `bucket` elements, about kElementsPerTask each.
inline int64_t buckets_per_task(int64_t bucket) { return std::max<int64_t>(1, kElementsPerTask / bucket); }

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
  for (int64_t t = 0; t + 1 < tasks; ++t) runner.schedule(run);
  run();
  std::unique_lock<std::mutex> lock(st->mu);
  st->cv.wait(lock, [&] { return st->done.load() == chunks; });
}

// Runs range(a, b0, b1) over the buckets [b0, b1) of one tensor (a.n
// elements in buckets of a.bucket), in tasks of whole buckets.
template <typename Args>
inline void for_buckets(Runner& runner, const Args& a, void (*range)(const Args&, int64_t, int64_t)) {
  parallel_for(runner, (a.n + a.bucket - 1) / a.bucket, buckets_per_task(a.bucket),
               [&](int64_t b0, int64_t b1) { range(a, b0, b1); });
}

// Runs fn(i, runner) for the entries i in [0, batch) of a batched call, each
// entry `work` elements: one entry after the other, each split across the
// threads, when an entry is large enough to pay for them; otherwise the
// entries themselves in parallel, each on one thread (an InlineRunner).
template <typename F>
inline void for_each_item(Runner& runner, int64_t batch, int64_t work, const F& fn) {
  if (batch == 1 || work >= kElementsPerTask || runner.threads() == 0) {
    for (int64_t i = 0; i < batch; ++i) fn(i, runner);
    return;
  }
  parallel_for(runner, batch, std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(1, work)),
               [&](int64_t i0, int64_t i1) {
                 InlineRunner one_thread;
                 for (int64_t i = i0; i < i1; ++i) fn(i, one_thread);
               });
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

}  // namespace jaxcomp

// ---------------------------------------------------------------------------
// The handlers' side
// ---------------------------------------------------------------------------
#include "handler.h"

namespace jaxcomp {

// XLA's FFI thread pool as a Runner.
class PoolRunner final : public Runner {
 public:
  explicit PoolRunner(ffi::ThreadPool& pool) : pool_(pool) {}
  int64_t threads() const override { return pool_.num_threads(); }
  void schedule(std::function<void()> task) override { pool_.Schedule(std::move(task)); }

 private:
  ffi::ThreadPool& pool_;
};

// The end of every CPU handler: the buffers must form one batch and pass the
// family's check (`error`: nullptr when they do); then run(i, runner) runs
// entry i, of `work` elements, for every entry (for_each_item).
template <size_t N, typename Run>
ffi::Error run_batch(ffi::ThreadPool& pool, const Batch<N>& batch, const char* error, int64_t work, const Run& run) {
  if (const char* e = batch.check(error)) return invalid(e);
  PoolRunner runner(pool);
  for_each_item(runner, batch.size(), work, run);
  return ffi::Error::Success();
}

// The CPU as handler.h's PairHandlers see it: the families' functions run on
// a Runner, and a large result is hinted to huge pages first.
struct CpuPlatform {
  using Context = ffi::ThreadPool;
  using Work = Runner&;
  static void hint(void* data, size_t bytes) { hint_huge_pages(data, static_cast<int64_t>(bytes)); }
  template <size_t N, typename Run>
  static ffi::Error run(ffi::ThreadPool& pool, const Batch<N>& batch, const char* error, int64_t work,
                        const Run& run) {
    return run_batch(pool, batch, error, work, run);
  }
};

}  // namespace jaxcomp

// TopK sparsification on the CPU (Renggli et al., "SparCML", SC19): the
// handlers of kTopkEncode and kTopkDecode. The targets, selection rules, sizes
// and checks are include/jaxcomp/topk.h's; here they run without sorting the
// tensor. Twin: jaxcomp/codecs/topk.py.
//
// Whole-tensor mode: a key bound from a sample, one pass collecting the
// elements at or above it, and an exact selection among those
// (select_whole); where that does not apply, a radix select on the keys in
// two parallel passes over the input (select_exact): a histogram of the high
// key bits, then one pass that sets aside the elements above the threshold
// bin and the candidates inside it; the candidates' low bits settle the
// threshold.
//
// k_per_bucket mode: per bucket, a 256-bin histogram of the top key bits
// finds the bin of the k-th largest key and nth_element among that bin's keys
// finds T; then one scan in index order emits. Buckets run in parallel.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <cstring>
#include <vector>

#include "cpu_buckets.h"
#include "cpu_runtime.h"
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include "jaxcomp/topk.h"

namespace jaxcomp {
namespace {

constexpr int64_t kChunk = int64_t{1} << 16;  // elements per counting chunk

// Runs fn(g) for g in [0, groups), one call per group, across the runner.
template <typename F>
void for_each_group(Runner& runner, int64_t groups, const F& fn) {
  parallel_for(runner, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) fn(g);
  });
}

// Whole-tensor selection of k of n (0 < k <= n), in two reads of the input.
//
// Pass 1 histograms the high key bits per group of chunks; the bin holding
// the k-th largest key follows. Pass 2 (per group) copies the elements of
// higher bins to an "above" list and the indices of the elements in that bin
// to a candidate list, both in index order and at offsets known from the
// per-group histograms. The candidates' low key bits (float32) give the exact
// threshold; the chosen candidates are merged with the above list of each
// group into the output. The candidate list is as long as the threshold bin
// (at most n, for an input of one repeated value).
template <typename W, typename I>
void select_exact(Runner& runner, const W* x, int64_t n, int64_t k, I* idx, W* val) {
  if (k == n) {
    parallel_for(runner, n, kElementsPerTask, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        idx[i] = static_cast<I>(i);
        val[i] = x[i];
      }
    });
    return;
  }
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  const int64_t groups = std::min<int64_t>(chunks, runner.threads() + 1);
  auto group_range = [&](int64_t g, int64_t* i0, int64_t* i1) {
    *i0 = std::min(n, (g * chunks / groups) * kChunk);
    *i1 = std::min(n, ((g + 1) * chunks / groups) * kChunk);
  };

  // Pass 1: high bits.
  std::vector<std::vector<uint32_t>> hists(groups);
  for_each_group(runner, groups, [&](int64_t g) {
    std::vector<uint32_t>& h = hists[g];
    h.assign(kTopkHiBins, 0);
    int64_t i0, i1;
    group_range(g, &i0, &i1);
    for (int64_t i = i0; i < i1; ++i) ++h[topk_hi<W>(topk_key(x[i]))];
  });
  std::vector<int64_t> hist(kTopkHiBins, 0);
  for (const auto& h : hists)
    for (int b = 0; b < kTopkHiBins; ++b) hist[b] += h[b];
  int64_t above = 0;
  const int64_t bin = topk_find_bin(hist.data(), kTopkHiBins, k, &above);
  const int64_t need_bin = k - above;

  // Pass 2: the above lists and the candidates, per group.
  std::vector<int64_t> a_off(groups + 1, 0), c_off(groups + 1, 0);
  for (int64_t g = 0; g < groups; ++g) {
    int64_t a = 0;
    for (int64_t b = bin + 1; b < kTopkHiBins; ++b) a += hists[g][b];
    a_off[g + 1] = a_off[g] + a;
    c_off[g + 1] = c_off[g] + hists[g][bin];
  }
  std::vector<uint32_t> a_idx(above), cand(hist[bin]);
  std::vector<W> a_val(above);
  const uint32_t b32 = static_cast<uint32_t>(bin);
  for_each_group(runner, groups, [&](int64_t g) {
    int64_t i0, i1;
    group_range(g, &i0, &i1);
    int64_t pa = a_off[g], pc = c_off[g];
    auto visit = [&](int64_t i) {
      const uint32_t hi = topk_hi<W>(topk_key(x[i]));
      if (hi > b32) {
        a_idx[pa] = static_cast<uint32_t>(i);
        a_val[pa++] = x[i];
      } else if (hi == b32) {
        cand[pc++] = static_cast<uint32_t>(i);
      }
    };
    // Most blocks hold nothing at or above the bin: a branch-free (vector)
    // test per block, the element loop only where it finds something.
    constexpr int64_t kBlock = 16;
    int64_t i = i0;
    for (; i + kBlock <= i1; i += kBlock) {
      uint32_t hit = 0;
      for (int64_t j = 0; j < kBlock; ++j) hit |= static_cast<uint32_t>(topk_hi<W>(topk_key(x[i + j])) >= b32);
      if (hit)
        for (int64_t j = 0; j < kBlock; ++j) visit(i + j);
    }
    for (; i < i1; ++i) visit(i);
  });

  // The threshold inside the bin: low key bits (always 0 for 16-bit keys).
  auto lo_of = [&](uint32_t i) -> uint32_t { return sizeof(W) == 4 ? topk_key(x[i]) & 0xffffu : 0u; };
  int64_t t_lo = 0, need_eq = need_bin;
  if (sizeof(W) == 4 && need_bin < static_cast<int64_t>(cand.size())) {
    std::vector<int64_t> lo(kTopkLoBins, 0);
    for (uint32_t i : cand) ++lo[lo_of(i)];
    int64_t above_lo = 0;
    t_lo = topk_find_bin(lo.data(), kTopkLoBins, need_bin, &above_lo);
    need_eq = need_bin - above_lo;
  } else if (sizeof(W) == 4) {
    t_lo = -1;  // the whole bin is taken
    need_eq = 0;
  }
  // Chosen candidates, compacted in place (still in index order), per group.
  std::vector<int64_t> ch_off(groups + 1, 0);
  {
    int64_t p = 0, eq = 0;
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t c = c_off[g]; c < c_off[g + 1]; ++c) {
        const int64_t lo = lo_of(cand[c]);
        if (lo < t_lo) continue;
        if (lo == t_lo && eq++ >= need_eq) continue;
        cand[p++] = cand[c];
      }
      ch_off[g + 1] = p;
    }
  }
  // Merge, per group, the above list with the chosen candidates.
  for_each_group(runner, groups, [&](int64_t g) {
    int64_t o = a_off[g] + ch_off[g];
    int64_t a = a_off[g], c = ch_off[g];
    const int64_t ae = a_off[g + 1], ce = ch_off[g + 1];
    while (a < ae || c < ce) {
      if (c == ce || (a < ae && a_idx[a] < cand[c])) {
        idx[o] = static_cast<I>(a_idx[a]);
        val[o++] = a_val[a++];
      } else {
        idx[o] = static_cast<I>(cand[c]);
        val[o++] = x[cand[c++]];
      }
    }
  });
}

// Whole-tensor selection of k of n (0 < k <= n), usually in one read.
//
// On a large input, a sample of 256 evenly spaced blocks of 256 elements
// gives a key bound L that about 1.1 k + a margin elements reach; one pass
// collects the indices of every element with key >= L (a vector test per 16
// elements, the element loop only where it finds one); if there are at least
// k and not many more, the exact k-th largest key among them gives the
// selection. Otherwise (a sample that misjudged the input, or many equal
// keys) select_exact decides. Both paths give the same bytes: the sample
// only picks the path.
constexpr int64_t kSampleBlocks = 256, kSampleBlock = 256;
constexpr int64_t kSampleMin = int64_t{1} << 20;

// Bit j set where element j of the 16 at x has key >= bound (bound >= 1).
template <typename W>
inline uint32_t block_hits(const W* x, uint32_t bound) {
  uint32_t hits = 0;
  for (int j = 0; j < 16; ++j) hits |= static_cast<uint32_t>(topk_key(x[j]) >= bound) << j;
  return hits;
}

#if defined(__SSE2__)
// float32: keys < 2^31, so a signed compare with bound - 1 decides key >= bound.
template <>
inline uint32_t block_hits<uint32_t>(const uint32_t* x, uint32_t bound) {
  const __m128i mask = _mm_set1_epi32(0x7fffffff);
  const __m128i b = _mm_set1_epi32(static_cast<int32_t>(bound - 1));
  uint32_t hits = 0;
  for (int q = 0; q < 4; ++q) {
    const __m128i v = _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 4 * q)), mask);
    hits |= static_cast<uint32_t>(_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpgt_epi32(v, b)))) << (4 * q);
  }
  return hits;
}

// 16-bit floats: keys < 2^15, a signed 16-bit compare.
template <>
inline uint32_t block_hits<uint16_t>(const uint16_t* x, uint32_t bound) {
  const __m128i mask = _mm_set1_epi16(0x7fff);
  const __m128i b = _mm_set1_epi16(static_cast<int16_t>(bound - 1));
  const __m128i lo = _mm_cmpgt_epi16(_mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)), mask), b);
  const __m128i hi = _mm_cmpgt_epi16(_mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 8)), mask), b);
  // One bit per element: pack the 16-bit lanes' masks to bytes.
  return static_cast<uint32_t>(_mm_movemask_epi8(_mm_packs_epi16(lo, hi)));
}
#endif

// The elements of x[i0, i1) whose key is at least bound, in index order,
// into f (indices) and fv (values); stops early once f holds more than
// limit. Out of line on purpose: inlined into the task closure that
// parallel_for hands the runner, the loop kept `hits` and `i` on the stack
// (the regression this fixed: docs/benchmarks.md).
template <typename W>
__attribute__((noinline)) void collect(const W* x, int64_t i0, int64_t i1, uint32_t bound, int64_t limit,
                                       size_t expect, std::vector<uint32_t>& f, std::vector<W>& fv) {
  f.reserve(expect);
  fv.reserve(expect);
  constexpr int64_t kBlock = 16;
  int64_t i = i0;
  for (; i + kBlock <= i1; i += kBlock) {
    uint32_t hits = block_hits(x + i, bound);
    if (!hits) continue;
    while (hits) {
      const int j = __builtin_ctz(hits);
      hits &= hits - 1;
      f.push_back(static_cast<uint32_t>(i + j));
      fv.push_back(x[i + j]);
    }
    if (static_cast<int64_t>(f.size()) > limit) return;  // give up early: too many
  }
  for (; i < i1; ++i) {
    if (topk_key(x[i]) >= bound) {
      f.push_back(static_cast<uint32_t>(i));
      fv.push_back(x[i]);
    }
  }
}

template <typename W, typename I>
void select_whole(Runner& runner, const W* x, int64_t n, int64_t k, I* idx, W* val) {
  if (k == n || n < kSampleMin) return select_exact<W, I>(runner, x, n, k, idx, val);
  const int64_t m = kSampleBlocks * kSampleBlock;
  std::vector<uint32_t> sample(m);
  const int64_t stride = n / kSampleBlocks;
  for (int64_t b = 0; b < kSampleBlocks; ++b)
    for (int64_t j = 0; j < kSampleBlock; ++j) sample[b * kSampleBlock + j] = topk_key(x[b * stride + j]);
  const double expect = static_cast<double>(m) * static_cast<double>(k) / static_cast<double>(n);
  const int64_t r = std::min<int64_t>(m - 1, static_cast<int64_t>(1.1 * expect + 4.0 * std::sqrt(expect) + 8.0));
  std::nth_element(sample.begin(), sample.begin() + r, sample.end(), std::greater<uint32_t>());
  const uint32_t bound = sample[r];
  if (bound == 0) return select_exact<W, I>(runner, x, n, k, idx, val);  // mostly zeros

  const int64_t chunks = (n + kChunk - 1) / kChunk;
  const int64_t groups = std::min<int64_t>(chunks, runner.threads() + 1);
  const int64_t limit = 2 * k + 65536;  // beyond this, select_exact is cheaper
  // Indices and values of the elements found, per group: the values are
  // copied while in cache (reading them back later would miss on every one).
  std::vector<std::vector<uint32_t>> found(groups);
  std::vector<std::vector<W>> found_val(groups);
  for_each_group(runner, groups, [&](int64_t g) {
    const int64_t i0 = std::min(n, (g * chunks / groups) * kChunk);
    const int64_t i1 = std::min(n, ((g + 1) * chunks / groups) * kChunk);
    const size_t expect_here = static_cast<size_t>(1.5 * expect * static_cast<double>(i1 - i0) / m) + 64;
    collect<W>(x, i0, i1, bound, limit, expect_here, found[g], found_val[g]);
  });
  int64_t total = 0;
  for (const auto& f : found) total += static_cast<int64_t>(f.size());
  if (total < k || total > limit) return select_exact<W, I>(runner, x, n, k, idx, val);

  // The k-th largest key among the found: a histogram of their high key
  // bits, then nth_element inside the bin that holds it.
  std::vector<int64_t> hist(kTopkHiBins, 0);
  for (const auto& fv : found_val)
    for (W v : fv) ++hist[topk_hi<W>(topk_key(v))];
  int64_t above_bin = 0;
  const int64_t bin = topk_find_bin(hist.data(), kTopkHiBins, k, &above_bin);
  std::vector<uint32_t> in_bin;
  in_bin.reserve(hist[bin]);
  for (const auto& fv : found_val)
    for (W v : fv)
      if (topk_hi<W>(topk_key(v)) == static_cast<uint32_t>(bin)) in_bin.push_back(topk_key(v));
  const int64_t r_bin = k - above_bin - 1;
  std::nth_element(in_bin.begin(), in_bin.begin() + r_bin, in_bin.end(), std::greater<uint32_t>());
  const uint32_t t = in_bin[r_bin];
  int64_t above = above_bin;
  for (uint32_t key : in_bin) above += key > t;
  const int64_t need_eq = k - above;

  // Emit per group, at offsets from per-group counts.
  std::vector<int64_t> gt(groups), eq(groups);
  for_each_group(runner, groups, [&](int64_t g) {
    int64_t a = 0, e = 0;
    for (W v : found_val[g]) {
      const uint32_t key = topk_key(v);
      a += key > t;
      e += key == t;
    }
    gt[g] = a;
    eq[g] = e;
  });
  std::vector<int64_t> out0(groups), eq0(groups);
  int64_t pos = 0, seen = 0;
  for (int64_t g = 0; g < groups; ++g) {
    out0[g] = pos;
    eq0[g] = seen;
    pos += static_cast<int64_t>(topk_part_emits(gt[g], eq[g], need_eq, seen));
    seen += eq[g];
  }
  for_each_group(runner, groups, [&](int64_t g) {
    const std::vector<uint32_t>& f = found[g];
    const std::vector<W>& fv = found_val[g];
    int64_t p = out0[g], e = eq0[g];
    for (size_t j = 0; j < f.size(); ++j) {
      const uint32_t key = topk_key(fv[j]);
      const bool chosen = topk_chosen(key, t, e, need_eq);
      e += key == t;
      if (!chosen) continue;
      idx[p] = static_cast<I>(f[j]);
      val[p++] = fv[j];
    }
  });
}

// k of one bucket's len values xb into ib and vb (k entries); a bucket of
// length len < k emits its len elements and then padding entries with local
// indices len .. k-1 and value 0. keys and cand hold len words each.
template <typename W, typename I>
void select_bucket(const W* xb, int64_t len, int64_t k, uint32_t* keys, uint32_t* cand, I* ib, W* vb) {
  const int64_t kb = std::min(k, len);
  if (kb == len) {
    for (int64_t i = 0; i < len; ++i) {
      ib[i] = static_cast<I>(i);
      vb[i] = xb[i];
    }
    for (int64_t i = len; i < k; ++i) {
      ib[i] = static_cast<I>(i);
      vb[i] = 0;
    }
    return;
  }
  // The bin of the kb-th largest key in a 256-bin histogram of the top
  // key bits, then nth_element among that bin's keys only.
  constexpr int kShift = sizeof(W) == 4 ? 23 : 7;
  uint32_t hist[256] = {0};
  for (int64_t i = 0; i < len; ++i) {
    keys[i] = topk_key(xb[i]);
    ++hist[keys[i] >> kShift];
  }
  uint32_t above_bin = 0;
  const int bin = topk_find_bin<uint32_t>(hist, 256, static_cast<uint32_t>(kb), &above_bin);
  int64_t above = above_bin;
  int64_t m = 0;
  for (int64_t i = 0; i < len; ++i)
    if ((keys[i] >> kShift) == static_cast<uint32_t>(bin)) cand[m++] = keys[i];
  const int64_t r = kb - above - 1;
  std::nth_element(cand, cand + r, cand + m, std::greater<uint32_t>());
  const uint32_t t = cand[r];
  for (int64_t j = 0; j < m; ++j) above += cand[j] > t;
  const int64_t need_eq = kb - above;
  int64_t p = 0, ties = 0;
  for (int64_t i = 0; i < len && p < kb; ++i) {
    const uint32_t key = keys[i];
    const bool chosen = topk_chosen(key, t, ties, need_eq);
    ties += key == t;
    if (!chosen) continue;
    ib[p] = static_cast<I>(i);
    vb[p] = xb[i];
    ++p;
  }
}

// k of every bucket (select_bucket); buckets run in parallel.
template <typename W, typename I>
void select_buckets(Runner& runner, const W* x, int64_t n, int64_t k, int64_t bucket, I* idx, W* val) {
  const int64_t nb = num_buckets(n, bucket);
  parallel_for(runner, nb, buckets_per_task(bucket), [&](int64_t b0, int64_t b1) {
    std::vector<uint32_t> keys(bucket), cand(bucket);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t len = std::min(bucket, n - b * bucket);
      select_bucket<W, I>(x + b * bucket, len, k, keys.data(), cand.data(), idx + b * k, val + b * k);
    }
  });
}

// The payload of x (n elements) into idx and val; n > 0.
template <typename W, typename I>
void encode(Runner& runner, const W* x, int64_t n, int64_t k, int64_t bucket, I* idx, W* val) {
  if (bucket == 0) {
    select_whole<W, I>(runner, x, n, k, idx, val);
  } else {
    select_buckets<W, I>(runner, x, n, k, bucket, idx, val);
  }
}

// Zeros, then the entries' values at their global indices; padding entries
// (global index >= n) are skipped, as the twin's scatter drops them. A
// malformed payload (topk_entry_ok) decodes to NaN everywhere instead.
template <typename W, typename I>
void decode(Runner& runner, const I* idx, const W* val, int64_t entries, int64_t n, int64_t k, int64_t bucket,
            W nan, W* out) {
  std::atomic<bool> bad{false};
  parallel_for(runner, entries, kElementsPerTask, [&](int64_t j0, int64_t j1) {
    bool ok = true;
    for (int64_t j = j0; j < j1; ++j) {
      const uint32_t prev = j > 0 ? static_cast<uint32_t>(idx[j - 1]) : 0u;
      ok &= topk_entry_ok(j, static_cast<uint32_t>(idx[j]), prev, n, k, bucket);
    }
    if (!ok) bad.store(true, std::memory_order_relaxed);
  });
  const bool malformed = bad.load();
  const W fill = malformed ? nan : W{0};
  parallel_for(runner, n, kElementsPerTask * 4, [&](int64_t i0, int64_t i1) {
    if (fill == W{0}) {
      std::memset(out + i0, 0, (i1 - i0) * sizeof(W));
    } else {
      std::fill(out + i0, out + i1, fill);
    }
  });
  if (malformed) return;
  // Indices are now strictly ascending within each range: every output
  // element has at most one writer.
  parallel_for(runner, entries, kElementsPerTask, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t g = topk_global_index(j, idx[j], k, bucket);
      if (g < n) out[g] = val[j];
    }
  });
}

// ---------------------------------------------------------------------------
// Error feedback in one pass
// ---------------------------------------------------------------------------
// acc = float32(x) + residual (one float32 add per element) goes straight
// into the new residual; the payload is the selection of acc, its values
// float32 words; each chosen element's new residual is then acc - acc, what
// acc - decode(payload) is there (0; NaN for an infinity or a NaN), and every
// other element keeps acc (acc - 0). No decoded tensor is written.
// A chosen element's new residual: acc - decoded, where decoded is acc.
inline float chosen_kept(uint32_t word) {
  const float a = bits_f32(word);
  return a - a;
}

// k of every bucket: each bucket's acc is made, selected and corrected while
// it is in cache.
template <typename I>
void feedback_buckets(Runner& runner, DType dt, const void* x, const float* residual, int64_t n, int64_t k,
                      int64_t bucket, I* idx, uint32_t* val, float* out) {
  const int64_t nb = num_buckets(n, bucket);
  parallel_for(runner, nb, buckets_per_task(bucket), [&](int64_t b0, int64_t b1) {
    std::vector<uint32_t> words(bucket), keys(bucket), cand(bucket);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t start = b * bucket, len = std::min(bucket, n - start);
      cpu::sum_range(dt, x, residual, start, start + len, out);
      std::memcpy(words.data(), out + start, static_cast<size_t>(len) * sizeof(float));
      I* ib = idx + b * k;
      uint32_t* vb = val + b * k;
      select_bucket<uint32_t, I>(words.data(), len, k, keys.data(), cand.data(), ib, vb);
      for (int64_t j = 0; j < std::min(k, len); ++j) out[start + static_cast<int64_t>(ib[j])] = chosen_kept(vb[j]);
    }
  });
}

// k of the whole tensor: acc in one parallel pass, then select_whole reads it
// (usually once) and the k chosen elements are corrected.
template <typename I>
void feedback_whole(Runner& runner, DType dt, const void* x, const float* residual, int64_t n, int64_t k, I* idx,
                    uint32_t* val, float* out) {
  parallel_for(runner, n, kElementsPerTask,
               [&](int64_t i0, int64_t i1) { cpu::sum_range(dt, x, residual, i0, i1, out); });
  select_whole<uint32_t, I>(runner, reinterpret_cast<const uint32_t*>(out), n, k, idx, val);
  parallel_for(runner, k, kElementsPerTask, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) out[static_cast<int64_t>(idx[j])] = chosen_kept(val[j]);
  });
}

// ---------------------------------------------------------------------------
// Handlers
// ---------------------------------------------------------------------------
ffi::Error EncodeImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> indices,
                      ffi::Result<ffi::AnyBuffer> values, int64_t k, int64_t bucket) {
  const Batch b(x, *indices, *values);
  const DType dt = dtype_of(x.element_type());
  const int ibytes = index_bytes(indices->element_type());
  const int64_t n = b.count(0);
  const char* error =
      topk_check_encode(dt, dtype_of(values->element_type()), ibytes, n, k, bucket, b.count(1), b.count(2));
  return run_batch(pool, b, error, n, [&](int64_t i, Runner& runner) {
    if (n == 0) return;
    topk_with_types(dt, ibytes, [&](auto w, auto ix) {
      using W = decltype(w);
      using I = decltype(ix);
      encode<W, I>(runner, b.at<W>(0, i), n, k, bucket, b.at<I>(1, i), b.at<W>(2, i));
    });
  });
}

ffi::Error DecodeImpl(ffi::ThreadPool pool, ffi::AnyBuffer indices, ffi::AnyBuffer values,
                      ffi::Result<ffi::AnyBuffer> out, int64_t k, int64_t bucket) {
  const Batch b(indices, values, *out);
  const DType dt = dtype_of(out->element_type());
  const int ibytes = index_bytes(indices.element_type());
  const int64_t n = b.count(2), entries = b.count(0);
  const char* error = topk_check_decode(dt, dtype_of(values.element_type()), ibytes, n, k, bucket, entries, b.count(1));
  hint_huge_pages(out->untyped_data(), static_cast<int64_t>(out->size_bytes()));
  return run_batch(pool, b, error, n, [&](int64_t i, Runner& runner) {
    if (n == 0) return;
    topk_with_types(dt, ibytes, [&](auto w, auto ix) {
      using W = decltype(w);
      using I = decltype(ix);
      decode<W, I>(runner, b.at<I>(0, i), b.at<W>(1, i), entries, n, k, bucket,
                   static_cast<W>(topk_nan_word(dt)), b.at<W>(2, i));
    });
  });
}

ffi::Error EncodeFeedbackImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> residual,
                              ffi::Result<ffi::AnyBuffer> indices, ffi::Result<ffi::AnyBuffer> values,
                              ffi::ResultBuffer<ffi::F32> out, int64_t k, int64_t bucket) {
  const Batch b(x, residual, *indices, *values, *out);
  const DType dt = dtype_of(x.element_type());
  const int ibytes = index_bytes(indices->element_type());
  const int64_t n = b.count(0);
  const char* error = topk_check_feedback(dt, dtype_of(values->element_type()), ibytes, n, k, bucket, b.count(1),
                                          b.count(2), b.count(3), b.count(4));
  hint_huge_pages(out->untyped_data(), static_cast<int64_t>(out->size_bytes()));
  return run_batch(pool, b, error, n, [&](int64_t i, Runner& runner) {
    if (n == 0) return;
    topk_with_types(DType::kF32, ibytes, [&](auto, auto ix) {
      using I = decltype(ix);
      if (bucket == 0) {
        feedback_whole<I>(runner, dt, b.at<void>(0, i), b.at<const float>(1, i), n, k, b.at<I>(2, i),
                          b.at<uint32_t>(3, i), b.at<float>(4, i));
      } else {
        feedback_buckets<I>(runner, dt, b.at<void>(0, i), b.at<const float>(1, i), n, k, bucket, b.at<I>(2, i),
                            b.at<uint32_t>(3, i), b.at<float>(4, i));
      }
    });
  });
}

JAXCOMP_REGISTER(kTopkEncode, EncodeImpl);
JAXCOMP_REGISTER(kTopkEncodeFeedback, EncodeFeedbackImpl);
JAXCOMP_REGISTER(kTopkDecode, DecodeImpl);

}  // namespace
}  // namespace jaxcomp

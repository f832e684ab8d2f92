// Attention on the CPU, two ops (executor/model/attention.py, TorchAttention):
//
// - decode attention: one query per request over its paged keys and values, read in
//   place through its block table (no gather), for the fused decode step (cpu_decode.cpp)
//   and, as `paged_decode_attention`, for the decodes of the torch path's steps;
// - `prefill_attention`: a prompt's queries over its keys, causal (at the end of the
//   file).
//
// Why: the torch path gathered each decode's blocks into a padded [B, L] batch
// (index_select), zeroed its stale rows and ran SDPA with an additive mask: at 48
// requests on a 2-core CPU that was a third of SmolLM2-135M's fp32 offline time (12.5 s
// of 37: SDPA 6.6, the gathers 4.4), for arithmetic that is a few MFLOP per layer.
//
// For request b (context length L_b, query q_b) and query head h, with G = H / H_kv
// query heads per KV head:
//
//   s_j = scale * q_b[h] . k_j[h / G]          (softcap c: c * tanh(s_j / c))
//   o_b[h] = sum_j exp(s_j - m) v_j[h / G] / (sum_j exp(s_j - m) [+ exp(sink_h - m)])
//
// with m = max s (and sink_h: gpt-oss's attention sinks, a learned logit per head that
// joins the denominator only, so a head may attend to nothing; none by default),
// over keys first <= j < L_b (first = L_b - window under a sliding window, else 0),
// key j at cache[table_b[j / block_size], j % block_size]. In fp32 throughout; a bf16
// cache's weights exp(...) are rounded to bf16 before they weigh the values (SDPA's
// bf16 P).

#include "cpu_ops.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using PAGELLM_NS::bf16;
using PAGELLM_NS::dot;
using PAGELLM_NS::PagedKV;
using PAGELLM_NS::widen;
#if PAGELLM_AVX512
using PAGELLM_NS::load16;
#endif

// e[i] = exp(e[i] - top) for i < n; returns their sum. AVX-512: 16 at a time (exp16,
// within 2 ulp of glibc's expf: tests/kernels/test_cpu_attention.py), where glibc's
// scalar expf made the softmax the biggest part of attention at a few hundred keys.
float exp_sum(float* e, int64_t n, float top) {
  float sum = 0.f;
  int64_t i = 0;
#if PAGELLM_AVX512
  const __m512 lo = _mm512_set1_ps(-87.3f), t = _mm512_set1_ps(top);
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 y = PAGELLM_NS::exp16(_mm512_max_ps(_mm512_sub_ps(_mm512_loadu_ps(e + i), t), lo));
    _mm512_storeu_ps(e + i, y);
    acc = _mm512_add_ps(acc, y);
  }
  sum = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) sum += (e[i] = std::exp(e[i] - top));
  return sum;
}

// s[j] *= scale for j < n; returns the largest (16 at a time where the CPU has AVX-512:
// the scalar loop was a tenth of a decode attention's samples).
float scaled_max(float* s, int64_t n, float scale) {
  float top = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
#if PAGELLM_AVX512
  const __m512 k = _mm512_set1_ps(scale);
  __m512 best = _mm512_set1_ps(top);
  for (; j + 16 <= n; j += 16) {
    const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(s + j), k);
    _mm512_storeu_ps(s + j, v);
    best = _mm512_max_ps(v, best);  // (a NaN score is passed over, as std::max does)
  }
  top = _mm512_reduce_max_ps(best);
#endif
  for (; j < n; ++j) top = std::max(top, s[j] *= scale);
  return top;
}

// s[j] = c * tanh(s[j] * scale / c) for j < n (a softcap c); returns the largest.
float capped_max(float* s, int64_t n, float scale, float c) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) top = std::max(top, s[j] = std::tanh(s[j] * (scale / c)) * c);
  return top;
}

// o[0:D] += sum_j w[j] * v[j * stride : j * stride + D] for j < n: one head's weighted
// values of a block's keys, for any D (the fallback of `accumulate_heads`).
template <typename T>
void accumulate(float* o, const T* v, int64_t stride, const float* w, int64_t n, int64_t D) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < D; ++d) o[d] += w[j] * widen(v[j * stride + d]);
}

#if PAGELLM_AVX512
// The sums of 16 vectors as one vector (lane k: the sum of v[k]'s lanes), by a tree of
// adds that transposes as it goes: 45 instructions where 16 separate reductions take
// about 130.
inline __m512 reduce16(const __m512 (&v)[16]) {
  __m512 s2[8];  // per 128-bit lane: [a0 + a2, b0 + b2, a1 + a3, b1 + b3] of v[2i], v[2i + 1]
  for (int i = 0; i < 8; ++i)
    s2[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                          _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  __m512 s4[4];  // per 128-bit lane L: the sums of lane L of v[4i], ..., v[4i + 3]
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(s2[2 * i]), b = _mm512_castps_pd(s2[2 * i + 1]);
    s4[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                          _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  __m512 t[2];  // lanes [x.L0 + x.L1, x.L2 + x.L3, y.L0 + y.L1, y.L2 + y.L3] of s4 pairs
  for (int i = 0; i < 2; ++i)
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s4[2 * i], s4[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(s4[2 * i], s4[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// q . k for 16 keys k (rows `stride` apart), D a multiple of 16: 16 independent chains
// of multiply-adds, then one transposing reduction (a dot product per key, each ending
// in its own reduction, took ~45 cycles a key and head).
template <typename T>
inline __m512 dot16(const float* q, const T* keys, int64_t stride, int64_t D) {
  __m512 acc[16];
  for (int k = 0; k < 16; ++k) acc[k] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 qv = _mm512_loadu_ps(q + d);
    for (int k = 0; k < 16; ++k)
      acc[k] = _mm512_fmadd_ps(qv, load16(keys + k * stride + d), acc[k]);
  }
  return reduce16(acc);
}

#if PAGELLM_AVX512_BF16
// dot16 for bf16 keys and a bf16 query (D a multiple of 32) with AVX512-BF16's dot
// products of pairs: exact products summed in fp32, half the instructions of widening
// each key to fp32 first.
inline __m512 dot16(const bf16* q, const bf16* keys, int64_t stride, int64_t D) {
  __m512 acc[16];
  for (int k = 0; k < 16; ++k) acc[k] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 32) {
    const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + d);
    for (int k = 0; k < 16; ++k)
      acc[k] = _mm512_dpbf16_ps(acc[k], qv, (__m512bh)_mm512_loadu_si512(keys + k * stride + d));
  }
  return reduce16(acc);
}
#endif

// o[h] += sum_j w[h][j] v[j] for HEADS heads sharing the values (o rows D = 16 * CHUNKS
// apart, w rows w_stride apart): each value vector is loaded once for all of them, and
// the sums stay in registers over the block.
template <typename T, int HEADS, int CHUNKS>
void accumulate_heads(float* o, const T* v, int64_t stride, const float* w, int64_t w_stride,
                      int64_t n) {
  constexpr int64_t D = 16 * CHUNKS;
  __m512 acc[HEADS][CHUNKS];
  for (int h = 0; h < HEADS; ++h)
    for (int c = 0; c < CHUNKS; ++c) acc[h][c] = _mm512_loadu_ps(o + h * D + 16 * c);
  for (int64_t j = 0; j < n; ++j) {
    __m512 vv[CHUNKS];
    for (int c = 0; c < CHUNKS; ++c) vv[c] = load16(v + j * stride + 16 * c);
    for (int h = 0; h < HEADS; ++h) {
      const __m512 wj = _mm512_set1_ps(w[h * w_stride + j]);
      for (int c = 0; c < CHUNKS; ++c) acc[h][c] = _mm512_fmadd_ps(wj, vv[c], acc[h][c]);
    }
  }
  for (int h = 0; h < HEADS; ++h)
    for (int c = 0; c < CHUNKS; ++c) _mm512_storeu_ps(o + h * D + 16 * c, acc[h][c]);
}

// accumulate_heads for the last `heads` (< HEADS) heads of accumulate_all: all of them in
// one pass over the values (GQA's 3 query heads a KV head took three passes, each value
// loaded and widened once per head).
template <typename T, int HEADS, int CHUNKS>
void accumulate_rest(float* o, const T* v, int64_t stride, const float* w, int64_t w_stride,
                     int64_t n, int64_t heads) {
  if constexpr (HEADS > 0) {
    if (heads == HEADS) return accumulate_heads<T, HEADS, CHUNKS>(o, v, stride, w, w_stride, n);
    accumulate_rest<T, HEADS - 1, CHUNKS>(o, v, stride, w, w_stride, n, heads);
  }
}

// accumulate_heads for `heads` heads, as many at a time as 16 registers of sums hold.
template <typename T, int CHUNKS>
void accumulate_all(float* o, const T* v, int64_t stride, const float* w, int64_t w_stride,
                    int64_t n, int64_t heads) {
  constexpr int kHeads = CHUNKS >= 16 ? 1 : 16 / CHUNKS;
  int64_t h = 0;
  for (; h + kHeads <= heads; h += kHeads)
    accumulate_heads<T, kHeads, CHUNKS>(o + h * 16 * CHUNKS, v, stride, w + h * w_stride,
                                        w_stride, n);
  accumulate_rest<T, kHeads - 1, CHUNKS>(o + h * 16 * CHUNKS, v, stride, w + h * w_stride,
                                         w_stride, n, heads - h);
}
#endif

// Asks for `rows` rows of `width` elements, `stride` apart, into L2 (into L1 the
// prefetches of a whole block queued behind each other: a fifth of a bf16 attention's
// samples sat on them, and 48 requests of 500-token contexts ran 10-20% slower).
template <typename T>
void prefetch(const T* p, int64_t rows, int64_t stride, int64_t width) {
#if PAGELLM_AVX512
  const int64_t bytes = width * static_cast<int64_t>(sizeof(T));
  for (int64_t r = 0; r < rows; ++r) {
    const char* line = reinterpret_cast<const char*>(p + r * stride);
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(line + b, _MM_HINT_T1);
  }
#else
  (void)p, (void)rows, (void)stride, (void)width;
#endif
}

// Of `heads` query heads sharing one KV head (q and o rows D apart, w rows w_stride
// apart): o[h] += sum_j w[h][j] v[j] for the n values of a block.
template <typename T>
void weigh_values(float* o, const T* v, int64_t stride, const float* w, int64_t w_stride,
                  int64_t n, int64_t heads, int64_t D) {
#if PAGELLM_AVX512
  switch (D) {
    case 32: return accumulate_all<T, 2>(o, v, stride, w, w_stride, n, heads);
    case 64: return accumulate_all<T, 4>(o, v, stride, w, w_stride, n, heads);
    case 96: return accumulate_all<T, 6>(o, v, stride, w, w_stride, n, heads);
    case 128: return accumulate_all<T, 8>(o, v, stride, w, w_stride, n, heads);
    case 256: return accumulate_all<T, 16>(o, v, stride, w, w_stride, n, heads);
    default: break;
  }
#endif
  for (int64_t h = 0; h < heads; ++h) accumulate(o + h * D, v, stride, w + h * w_stride, n, D);
}

// Splits items 0 .. count - 1 into `parts` contiguous runs of about equal work (the
// sum of work(u)): run r is bounds[r] .. bounds[r + 1] - 1.
template <typename F>
std::vector<int64_t> balanced_runs(int64_t count, int64_t parts, F&& work) {
  std::vector<int64_t> cum(count + 1, 0);
  for (int64_t u = 0; u < count; ++u) cum[u + 1] = cum[u] + work(u);
  std::vector<int64_t> bounds(parts + 1, count);
  bounds[0] = 0;
  for (int64_t r = 1; r < parts; ++r)  // the first item past r / parts of the work
    bounds[r] = std::upper_bound(cum.begin(), cum.end(), cum[count] * r / parts) - cum.begin() - 1;
  return bounds;
}

// Work items: a request's query heads, all of them where that leaves at least 4 items
// a thread (each block of keys and values then streams in whole, once), else those that
// share a KV head (batch 2-7 or so), else one head each (batch 1-2: the threads share
// the work evenly). Each thread takes a run of items of about equal keys: requests'
// contexts differ, and an equal count of them each left a thread idle at the end.
template <typename T>
void attend(const float* q_all, int64_t q_stride, bool bf16_queries, const PagedKV& kv,
            int64_t B, int64_t H, int64_t H_kv, int64_t D, std::optional<int64_t> window,
            float scale, std::optional<float> softcap, const float* sinks, float* out) {
  const T* cache = static_cast<const T*>(kv.cache);
  const int64_t group = H / H_kv, row = H_kv * D, block_size = kv.block_size;
  const int64_t enough = 4 * at::get_num_threads();
  const int64_t per_item = B >= enough ? H : B * H_kv >= enough ? group : 1;
  const std::vector<int64_t> bounds =
      balanced_runs(B * H / per_item, at::get_num_threads(), [&](int64_t u) {
        const int64_t len = kv.seq_lens[u * per_item / H];
        return window ? std::min(len, *window) : len;
      });
  // Item v's first block of keys (plane 0) or values (kv.plane), from its first KV head.
  auto first_block = [&](int64_t v, int64_t plane) {
    const int64_t b = v * per_item / H, g = v * per_item % H / group, len = kv.seq_lens[b];
    const int64_t first = window ? std::max<int64_t>(0, len - *window) : 0;
    return cache + plane + kv.tables[b * kv.table_stride + first / block_size] * block_size * row +
           g * D;
  };
  at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> p;  // [per_item, n]: the item's heads' scores, then weights
    std::vector<float> sums(per_item);
    std::vector<bf16> qb;  // [per_item, D]: q in bf16, for a bf16 cache's dot products
    for (int64_t u = bounds[r0]; u < bounds[r1]; ++u) {
      const int64_t b = u * per_item / H, h0 = u * per_item % H;
      const int64_t g0 = h0 / group, g1 = (h0 + per_item - 1) / group + 1;  // its KV heads
      const int64_t len = kv.seq_lens[b];
      const int64_t first = window ? std::max<int64_t>(0, len - *window) : 0, n = len - first;
      const int32_t* table = kv.tables + b * kv.table_stride;
      const float* q = q_all + b * q_stride + h0 * D;  // [per_item, D]
      float* o = out + b * H * D + h0 * D;  // [per_item, D]
      p.resize(per_item * n);
#if PAGELLM_AVX512_BF16
      // Dot products of bf16 pairs where the queries hold bf16 values (a bf16 model's;
      // an fp32 model's queries against a bf16 cache stay fp32).
      const bool pairs = std::is_same_v<T, bf16> && bf16_queries;
      if (pairs && D % 32 == 0) qb.assign(q, q + per_item * D);  // exact: q holds bf16 values
#endif
      // The item's heads i0 .. i0 + count - 1 (from h0) that KV head g serves.
      auto heads_of = [&](int64_t g) {
        const int64_t a = std::max(h0, g * group), z = std::min(h0 + per_item, (g + 1) * group);
        return std::pair<int64_t, int64_t>(a - h0, z - a);
      };
      // Keys j = blk * block_size + off, block by block (no division per key).
      // The next block's keys (plane 0) or values of the item's KV heads are fetched
      // while this one's are used: the blocks lie anywhere in the cache, so the CPU's
      // own prefetchers start over at each. At the last block, `then`: the block the
      // next pass starts on (this item's first values, the next item's first keys).
      auto blocks = [&](int64_t plane, const T* then, auto&& visit) {
        const int64_t last = (len - 1) / block_size;
        for (int64_t blk = first / block_size; blk <= last; ++blk) {
          if (blk < last)
            prefetch(cache + plane + table[blk + 1] * block_size * row + g0 * D, block_size,
                     row, (g1 - g0) * D);
          else if (then != nullptr)
            prefetch(then, block_size, row, (g1 - g0) * D);
          visit(table[blk] * block_size * row,  // the block's first key
                std::max<int64_t>(first - blk * block_size, 0),
                std::min<int64_t>(block_size, len - blk * block_size),
                blk * block_size - first);  // where its keys' scores start in p
        }
      };
      blocks(0, first_block(u, kv.plane), [&](int64_t base, int64_t lo, int64_t hi, int64_t at) {
        for (int64_t g = g0; g < g1; ++g) {
          const T* keys = cache + base + g * D;
          const auto [i0, count] = heads_of(g);
          for (int64_t i = i0; i < i0 + count; ++i) {
            float* scores = p.data() + i * n + at;
            int64_t off = lo;
#if PAGELLM_AVX512_BF16
            if constexpr (std::is_same_v<T, bf16>) {
              if (pairs && D % 32 == 0)
                for (; off + 16 <= hi; off += 16)
                  _mm512_storeu_ps(scores + off, dot16(qb.data() + i * D, keys + off * row, row, D));
            }
#endif
#if PAGELLM_AVX512
            if (D % 16 == 0)
              for (; off + 16 <= hi; off += 16)
                _mm512_storeu_ps(scores + off, dot16(q + i * D, keys + off * row, row, D));
#endif
            for (; off < hi; ++off) scores[off] = dot(q + i * D, keys + off * row, D);
          }
        }
      });
      for (int64_t i = 0; i < per_item; ++i) {
        float* s = p.data() + i * n;
        float top = softcap ? capped_max(s, n, scale, *softcap) : scaled_max(s, n, scale);
        if (sinks != nullptr) top = std::max(top, sinks[h0 + i]);
        sums[i] = exp_sum(s, n, top);
        if (sinks != nullptr) sums[i] += std::exp(sinks[h0 + i] - top);
        if (bf16_queries)  // a bf16 model's SDPA weighs the values with bf16 weights
          PAGELLM_NS::round_to_bf16(s, n);
      }
      std::fill(o, o + per_item * D, 0.f);
      blocks(kv.plane, u + 1 < bounds[r1] ? first_block(u + 1, 0) : nullptr,
             [&](int64_t base, int64_t lo, int64_t hi, int64_t at) {
        for (int64_t g = g0; g < g1; ++g) {
          const auto [i0, count] = heads_of(g);
          weigh_values(o + i0 * D, cache + kv.plane + base + g * D + lo * row, row,
                       p.data() + i0 * n + at + lo, n, hi - lo, count, D);
        }
      });
      for (int64_t i = 0; i < per_item; ++i) {
        const float inv = 1.f / sums[i];
        for (int64_t d = 0; d < D; ++d) o[i * D + d] *= inv;
      }
    }
  });
}

// ---- Prefill attention ---------------------------------------------------------------
//
// The last Q of a prompt's L positions (a whole fresh prompt: Q == L; a later chunk:
// Q < L) attend causally: query i sits at position L - Q + i and sees keys j <= that.
//
// Why not torch's SDPA, which the torch path called per prompt: its CPU flash kernel
// computes whole 512-key blocks under the causal mask (half of a 136-token prompt's
// products thrown away) through small MKL GEMM calls, and ran SmolLM2's prompts at
// 44-86 GFLOP/s on a 2-core AMD EPYC (a quarter of a bf16 48-request run's prefill).
//
// A work item is a tile of kPromptTile queries of one KV head: its G query heads each,
// G * kPromptTile rows sharing every key and value, which the decode kernels' loops take
// (`dot16` for 16 keys of a row, `weigh_values` for the rows' weighted values). Scores
// are computed for whole 16-key tiles past the diagonal (then masked: exp gives them 0),
// so no row runs a scalar tail. Two passes, scores then values, as torch's kernel does for
// prompts of up to 512 keys: the weights are exp(s - max s), rounded to bf16 for bf16
// inputs before they weigh the values, as there.
constexpr int64_t kPromptTile = 16;

#if PAGELLM_AVX512
// dst [16, 16] = the transpose of 16 rows of 16 floats (row i at src + i * stride).
inline void transpose16(const float* src, int64_t stride, float* dst) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * stride);
  for (int i = 0; i < 16; i += 2) {  // pairs of rows interleaved: a0 b0 a1 b1 | ...
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // then pairs of pairs: a0 b0 c0 d0 | ...
    for (int j = 0; j < 2; ++j) {
      const __m512d x = _mm512_castps_pd(t[i + j]), y = _mm512_castps_pd(t[i + j + 2]);
      r[i + 2 * j] = _mm512_castpd_ps(_mm512_unpacklo_pd(x, y));
      r[i + 2 * j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(x, y));
    }
  }
  // r[4q + c] lane block L holds column 4L + c of rows 4q .. 4q + 3; gather the 128-bit
  // blocks: column 4L + c of all rows from r[c], r[4 + c], r[8 + c], r[12 + c]
  for (int c = 0; c < 4; ++c) {
    const __m512 lo = _mm512_shuffle_f32x4(r[c], r[4 + c], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 hi = _mm512_shuffle_f32x4(r[c], r[4 + c], _MM_SHUFFLE(3, 1, 3, 1));
    const __m512 lo2 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 hi2 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], _MM_SHUFFLE(3, 1, 3, 1));
    _mm512_storeu_ps(dst + (0 + c) * 16, _mm512_shuffle_f32x4(lo, lo2, _MM_SHUFFLE(2, 0, 2, 0)));
    _mm512_storeu_ps(dst + (8 + c) * 16, _mm512_shuffle_f32x4(lo, lo2, _MM_SHUFFLE(3, 1, 3, 1)));
    _mm512_storeu_ps(dst + (4 + c) * 16, _mm512_shuffle_f32x4(hi, hi2, _MM_SHUFFLE(2, 0, 2, 0)));
    _mm512_storeu_ps(dst + (12 + c) * 16, _mm512_shuffle_f32x4(hi, hi2, _MM_SHUFFLE(3, 1, 3, 1)));
  }
}

// s[r][0 .. 15] (rows s_row apart, `kept` lanes) = q[r] . the 16 keys whose transpose is
// kt [D, 16], for R rows of q (D apart): each key vector loaded once for R rows, each
// query element broadcast by its multiply-add (dot16's 16 chains and transposing sum
// per row took 2.5x the instructions).
template <int R>
inline void scores_of_rows(const float* q, int64_t D, const float* kt, float* s, int64_t s_row,
                           __mmask16 kept) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m512 k = _mm512_loadu_ps(kt + d * 16);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * D + d]), k, acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(s + r * s_row, kept, acc[r]);
}

// scores_of_rows for `rows` rows, 8 at a time (8 independent chains keep both FMA pipes
// busy).
inline void scores_of(const float* q, int64_t D, int64_t rows, const float* kt, float* s,
                      int64_t s_row, __mmask16 kept) {
  int64_t r = 0;
  for (; r + 8 <= rows; r += 8) scores_of_rows<8>(q + r * D, D, kt, s + r * s_row, s_row, kept);
  switch (rows - r) {
    case 7: return scores_of_rows<7>(q + r * D, D, kt, s + r * s_row, s_row, kept);
    case 6: return scores_of_rows<6>(q + r * D, D, kt, s + r * s_row, s_row, kept);
    case 5: return scores_of_rows<5>(q + r * D, D, kt, s + r * s_row, s_row, kept);
    case 4: return scores_of_rows<4>(q + r * D, D, kt, s + r * s_row, s_row, kept);
    case 3: return scores_of_rows<3>(q + r * D, D, kt, s + r * s_row, s_row, kept);
    case 2: return scores_of_rows<2>(q + r * D, D, kt, s + r * s_row, s_row, kept);
    case 1: return scores_of_rows<1>(q + r * D, D, kt, s + r * s_row, s_row, kept);
    default: return;
  }
}
#endif

template <typename T>
void attend_prompt(const T* q, int64_t q_row, const T* k, int64_t k_row, const T* v,
                   int64_t v_row, int64_t Q, int64_t L, int64_t H, int64_t H_kv, int64_t D,
                   float scale, T* out) {
  const int64_t G = H / H_kv, tiles = (Q + kPromptTile - 1) / kPromptTile;
  at::parallel_for(0, H_kv * tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, p, o, inv;  // [rows, D], [rows, n_max], [rows, D], [rows]
    std::vector<float> kt;  // [D, 16]: a tile of 16 keys transposed (fp32)
    std::vector<int64_t> n;  // [rows]: the keys each row sees
    for (int64_t u = begin; u < end; ++u) {
      // Tiles zigzag (0, last, 1, last - 1, ...): later ones see more keys, and a thread's
      // contiguous share of items then holds as many long tiles as short.
      const int64_t g = u / tiles, z = u % tiles;
      const int64_t tile = z % 2 == 0 ? z / 2 : tiles - 1 - z / 2;
      const int64_t i0 = tile * kPromptTile, queries = std::min(kPromptTile, Q - i0);
      const int64_t rows = queries * G, n_max = L - Q + i0 + queries;
      // (p's first n[r] entries of row r are all written below, the rest zeroed)
      qf.resize(rows * D), p.resize(rows * n_max), o.assign(rows * D, 0.f);
      n.resize(rows), inv.resize(rows);
      auto q_of = [&](int64_t r) {  // row r: query i0 + r / G, head g * G + r % G
        return q + (i0 + r / G) * q_row + (g * G + r % G) * D;
      };
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t d = 0; d < D; ++d) qf[r * D + d] = widen(q_of(r)[d]);
        n[r] = L - Q + i0 + r / G + 1;
      }
      const T* keys = k + g * D;
      for (int64_t off = 0; off < n_max; off += 16) {  // a 16-key tile for every row
        const bool whole = off + 16 <= L;  // 16 keys to read (past n_max: not stored)
#if PAGELLM_AVX512
        if constexpr (std::is_same_v<T, float>) {
          if (whole && D % 16 == 0) {  // fp32: the tile transposed once, all rows against it
            const __mmask16 kept = n_max - off >= 16 ? 0xFFFF : (1u << (n_max - off)) - 1;
            kt.resize(D * 16);
            for (int64_t d = 0; d < D; d += 16)
              transpose16(keys + off * k_row + d, k_row, kt.data() + d * 16);
            scores_of(qf.data(), D, rows, kt.data(), p.data() + off, n_max, kept);
            continue;
          }
        }
#endif
        for (int64_t r = 0; r < rows; ++r) {
          float* s = p.data() + r * n_max + off;
#if PAGELLM_AVX512
          if (whole && D % 16 == 0) {
            const __mmask16 kept = n_max - off >= 16 ? 0xFFFF : (1u << (n_max - off)) - 1;
#if PAGELLM_AVX512_BF16
            if constexpr (std::is_same_v<T, bf16>) {
              if (D % 32 == 0) {  // bf16 pairs: the query's own bf16 values
                _mm512_mask_storeu_ps(s, kept, dot16(q_of(r), keys + off * k_row, k_row, D));
                continue;
              }
            }
#endif
            _mm512_mask_storeu_ps(s, kept, dot16(qf.data() + r * D, keys + off * k_row, k_row, D));
            continue;
          }
#endif
          (void)whole;
          for (int64_t j = off; j < std::min(n[r], off + 16); ++j)
            s[j - off] = dot(qf.data() + r * D, keys + j * k_row, D);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {  // softmax over the row's own keys
        float* s = p.data() + r * n_max;
        inv[r] = 1.f / exp_sum(s, n[r], scaled_max(s, n[r], scale));
        if constexpr (std::is_same_v<T, bf16>) PAGELLM_NS::round_to_bf16(s, n[r]);
        std::fill(s + n[r], s + n_max, 0.f);  // the keys past its position weigh nothing
      }
      weigh_values(o.data(), v + g * D, v_row, p.data(), n_max, n_max, rows, D);
      for (int64_t r = 0; r < rows; ++r) {
        T* dst = out + (i0 + r / G) * H * D + (g * G + r % G) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(o[r * D + d] * inv[r]);
      }
    }
  });
}

}  // namespace

namespace PAGELLM_NS {

void attend_decodes(const float* q, int64_t q_stride, bool bf16_queries, const PagedKV& kv,
                    int64_t B, int64_t H, int64_t H_kv, int64_t D,
                    std::optional<int64_t> window, float scale, std::optional<float> softcap,
                    const float* sinks, float* out) {
  const auto run = kv.bf16 ? attend<bf16> : attend<float>;
  run(q, q_stride, bf16_queries, kv, B, H, H_kv, D, window, scale, softcap, sinks, out);
}

void check_block_tables(const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t B,
                        int64_t num_blocks, int64_t block_size) {
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.numel() == B &&
                  seq_lens.is_contiguous() && seq_lens.device().is_cpu() &&
                  block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.size(0) >= B && block_tables.stride(1) == 1 &&
                  block_tables.device().is_cpu(),
              "seq_lens must be int32 [", B, "] (one query per request) and block_tables "
              "int32 [>= ", B, ", max_blocks] with contiguous rows, on the CPU");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t max_blocks = block_tables.size(1);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1, "seq_len ", lens[b], " (a query sees at least itself)");
    const int64_t blocks_needed = (lens[b] + block_size - 1) / block_size;
    TORCH_CHECK(blocks_needed <= max_blocks, "seq_len ", lens[b],
                " needs more blocks than the block table holds");
    const int32_t* table = block_tables.data_ptr<int32_t>() + b * block_tables.stride(0);
    for (int64_t j = 0; j < blocks_needed; ++j)
      TORCH_CHECK(table[j] >= 0 && table[j] < num_blocks, "block ", table[j],
                  " outside the KV cache");
  }
}

// q [B, H, D] fp32 or bf16 (one query per request; heads contiguous), kv_cache
// [2, num_blocks, block_size, H_kv, D] of q's dtype (or bf16 under fp32 queries:
// kv_cache_dtype="bfloat16"), block_tables [>= B, max_blocks] int32, seq_lens [B] int32
// and sinks [H] fp32 or none -> [B, H, D] of q's dtype (the file's header).
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                  double scale, std::optional<int64_t> window,
                                  std::optional<double> softcap,
                                  const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK((q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) &&
                  q.dim() == 3 && q.device().is_cpu(),
              "q must be an fp32 or bf16 CPU tensor [B, H, D]");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  // (values at kv_cache.stride(0) from the keys: 0 where one plane is its own value,
  // DeepSeek's latent, expanded to two views)
  TORCH_CHECK((kv_cache.scalar_type() == q.scalar_type() ||
               kv_cache.scalar_type() == at::kBFloat16) &&
                  kv_cache.device().is_cpu() && kv_cache.dim() == 5 && kv_cache.size(0) == 2 &&
                  kv_cache.size(4) == D && kv_cache.select(0, 0).is_contiguous() &&
                  (kv_cache.stride(0) == 0 || kv_cache.is_contiguous()),
              "kv_cache must be a contiguous CPU tensor [2, num_blocks, block_size, H_kv, ", D,
              "] of q's dtype or bf16 (or one plane expanded to two)");
  const int64_t H_kv = kv_cache.size(3);
  TORCH_CHECK(H_kv > 0 && H % H_kv == 0, "q's ", H, " heads must be a multiple of the ",
              H_kv, " KV heads");
  TORCH_CHECK(!window || *window >= 1, "a sliding window must be at least 1, got ", *window);
  TORCH_CHECK(!softcap || *softcap > 0, "softcap must be positive, got ", *softcap);
  TORCH_CHECK(!sinks || (sinks->scalar_type() == at::kFloat && sinks->dim() == 1 &&
                         sinks->size(0) == H && sinks->is_contiguous() &&
                         sinks->device().is_cpu()),
              "sinks must be a contiguous fp32 CPU tensor [", H, "]");
  check_block_tables(block_tables, seq_lens, B, kv_cache.size(1), kv_cache.size(2));
  const at::Tensor q32 = q.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({B, H, D}, q32.options());
  if (B == 0) return out.to(q.scalar_type());
  const PagedKV kv{kv_cache.data_ptr(), kv_cache.scalar_type() == at::kBFloat16,
                   kv_cache.stride(0), kv_cache.size(2), block_tables.data_ptr<int32_t>(),
                   block_tables.stride(0), seq_lens.data_ptr<int32_t>()};
  attend_decodes(q32.data_ptr<float>(), H * D, q.scalar_type() == at::kBFloat16, kv, B, H,
                 H_kv, D, window,
                 static_cast<float>(scale),
                 softcap ? std::optional<float>(static_cast<float>(*softcap)) : std::nullopt,
                 sinks ? sinks->data_ptr<float>() : nullptr, out.data_ptr<float>());
  return out.to(q.scalar_type());
}

// q [Q, H, D], k and v [L, H_kv, D] (L >= Q; rows of any stride, heads contiguous), all
// fp32 or all bf16 -> [Q, H, D] of their dtype: the causal attention of the last Q of L
// positions (`attend_prompt`).
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             double scale) {
  TORCH_CHECK((q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) &&
                  k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "q, k and v must all be fp32 or all bf16");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q.device().is_cpu() &&
                  k.device().is_cpu() && v.device().is_cpu(),
              "q, k and v must be CPU tensors [tokens, heads, head_dim]");
  const int64_t Q = q.size(0), H = q.size(1), D = q.size(2), L = k.size(0), H_kv = k.size(1);
  TORCH_CHECK(v.sizes() == k.sizes() && k.size(2) == D && L >= Q && H_kv > 0 && H % H_kv == 0,
              "k and v must be [L, H_kv, ", D, "] with L >= ", Q, " queries and H_kv dividing ",
              H, " heads");
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == D, "q, k and v need contiguous heads "
                "within each row");
  at::Tensor out = at::empty({Q, H, D}, q.options());
  if (Q == 0) return out;
  const float s = static_cast<float>(scale);
  if (q.scalar_type() == at::kBFloat16)
    attend_prompt<bf16>(q.data_ptr<bf16>(), q.stride(0), k.data_ptr<bf16>(), k.stride(0),
                        v.data_ptr<bf16>(), v.stride(0), Q, L, H, H_kv, D, s,
                        out.data_ptr<bf16>());
  else
    attend_prompt<float>(q.data_ptr<float>(), q.stride(0), k.data_ptr<float>(), k.stride(0),
                         v.data_ptr<float>(), v.stride(0), Q, L, H, H_kv, D, s,
                         out.data_ptr<float>());
  return out;
}

}  // namespace PAGELLM_NS

TORCH_LIBRARY_FRAGMENT(PAGELLM_NS, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
  m.impl("prefill_attention", c10::DispatchKey::CPU, &PAGELLM_NS::prefill_attention);
  m.def("paged_decode_attention(Tensor q, Tensor kv_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, int? window, float? softcap, Tensor? sinks=None) "
        "-> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &PAGELLM_NS::paged_decode_attention);
}

// What pagellm's C++ CPU ops share across their files (kernels/cpu_ops.py builds them
// into one library): the op namespace, the vector helpers, and the int kernel's, the bf16
// GEMV's and the decode attention's entry points, which the fused decode step
// (cpu_decode.cpp) calls.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#if defined(__AVX512F__) && !defined(PAGELLM_PORTABLE)
#include <immintrin.h>
#define PAGELLM_AVX512 1
#else
#define PAGELLM_AVX512 0
#endif
#if PAGELLM_AVX512 && defined(__AVX512BF16__)
#define PAGELLM_AVX512_BF16 1  // VDPBF16PS: dot products of bf16 pairs, summed in fp32
#else
#define PAGELLM_AVX512_BF16 0
#endif

// torch.ops.<PAGELLM_NS>: pagellm_cpu, or pagellm_cpu_portable for the plain-loop build
// the tests load beside the native one (-DPAGELLM_PORTABLE -DPAGELLM_NS=...). The C++
// functions live in a namespace of the same name, so the two libraries never share a
// symbol.
#ifndef PAGELLM_NS
#define PAGELLM_NS pagellm_cpu
#endif

namespace PAGELLM_NS {

using bf16 = c10::BFloat16;

inline float widen(float v) { return v; }
inline float widen(bf16 v) { return static_cast<float>(v); }

// v rounded to the nearest bf16 (ties to even), as a float: what a bf16 tensor holds.
inline float to_bf16(float v) { return static_cast<float>(bf16(v)); }

#if PAGELLM_AVX512
// 16 floats rounded to the nearest bf16 (ties to even, c10's NaN), as floats.
inline __m512 round16_to_bf16(__m512 x) {
  const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7FFF);
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const __m512i nan = _mm512_set1_epi32(0x7FC00000);  // c10's NaN
  __m512i b = _mm512_castps_si512(x);  // + 0x7FFF + the kept part's lowest bit: ties to even
  b = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(b, 16), one), bias));
  b = _mm512_mask_mov_epi32(_mm512_and_si512(b, high), _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                            nan);
  return _mm512_castsi512_ps(b);
}
#endif

// p[i] = to_bf16(p[i]) for i < n, 16 at a time where the CPU has AVX-512 (c10's rounding,
// one element at a time, took a fifth of a bf16 decode attention's time).
inline void round_to_bf16(float* p, int64_t n) {
  int64_t i = 0;
#if PAGELLM_AVX512
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(p + i, round16_to_bf16(_mm512_loadu_ps(p + i)));
#endif
  for (; i < n; ++i) p[i] = to_bf16(p[i]);
}

#if PAGELLM_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {  // a bf16's bits are a float's high half
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// exp(x) for 16 floats x >= -87.3 (below, the caller clamps), Cephes' expf: 2^k * e^r,
// |r| <= ln2 / 2, a degree-6 polynomial; within 2 ulp of glibc's expf; x above ~88.7
// gives inf.
inline __m512 exp16(__m512 x) {
  const float c[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                      4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(c[0]);
  for (int j = 1; j < 6; ++j) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(c[j]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(y, k);  // * 2^k
}
#endif

// a . b for n elements of a (fp32) and b (fp32 or bf16, a KV cache's keys).
template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  float s = 0.f;
  int64_t i = 0;
#if PAGELLM_AVX512
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), load16(b + i), acc);
  s = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) s += a[i] * widen(b[i]);
  return s;
}

// A paged KV cache [2, num_blocks, block_size, H_kv, D] of T (fp32 or bf16: `bf16`) and
// the block tables and context lengths of B requests with one query each
// (cpu_attention.cpp).
struct PagedKV {
  const void* cache;  // the keys; the values `plane` elements further
  bool bf16;
  int64_t plane, block_size;
  const int32_t* tables;  // [B, table_stride]: row b, request b's blocks
  int64_t table_stride;
  const int32_t* seq_lens;  // [B]: request b's context, its query's key included
};

// out [B, H * D] fp32 = softmax(q k^T * scale) v for each request b's one query q[b]
// (row b of q [B, q_stride], heads of D contiguous) over its keys j with
// seq_len - window <= j < seq_len (all j < seq_len without a window); with a softcap c,
// scores s become c * tanh(s / c) first; sinks [H] (or nullptr): one more logit per head
// in the softmax's denominator (gpt-oss). bf16_queries (a bf16 model: q holds bf16
// values, and so does the cache): the attention weights are rounded to bf16 before they
// weigh the values, as torch's SDPA and transformers do. An fp32 model's queries may
// read a bf16 cache (kv_cache_dtype="bfloat16"): widened, in fp32 throughout.
void attend_decodes(const float* q, int64_t q_stride, bool bf16_queries, const PagedKV& kv,
                    int64_t B, int64_t H, int64_t H_kv, int64_t D,
                    std::optional<int64_t> window, float scale, std::optional<float> softcap,
                    const float* sinks, float* out);

// Checks every block id of B requests' tables [>= B, max_blocks] int32 against a cache of
// num_blocks, and their seq_lens [B] int32 (>= 1, within the table): the attention's
// loops trust them.
void check_block_tables(const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t B,
                        int64_t num_blocks, int64_t block_size);

// out = w * (v * rsqrt(mean(v^2) + eps)) for one row v of n: RMSNorm.reference's order
// (the weight multiplies last), the normed row rounded to bf16 first where x is bf16
// (bf16_normed) and the product where the output is (bf16_out); out may be v
// (cpu_elementwise.cpp; the fused decode step's norms too).
void rms_norm_row(const float* v, const float* w, float* out, int64_t n, float eps,
                  bool bf16_normed, bool bf16_out);

// out[i] = F.silu(gate[i]) * up[i] for i < n, as torch computes it in fp32 (bf16: the
// SiLU and the product each rounded to bf16, as a bf16 tensor's ops round them); out may
// be gate (cpu_elementwise.cpp).
void silu_and_mul_row(const float* gate, const float* up, float* out, int64_t n, bool bf16);

// x [M, K] fp32 @ W^T -> [M, out_features] fp32, W in the int kernel's tiled layout
// (cpu_int_gemm.cpp's header).
at::Tensor int_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                    const at::Tensor& zeros, int64_t bits, int64_t group_size,
                    int64_t out_features);

// Whether int_gemm_silu_and_mul takes a [gate | up] weight of out_features rows: its
// halves must start on a tile of 16 rows.
inline bool pairs_gate_and_up(int64_t out_features) { return out_features % (2 * 16) == 0; }

// int_gemm of a fused [gate | up] weight, then F.silu(gate) * up -> [M, out_features / 2]
// fp32, in one pass (cpu_int_gemm.cpp).
at::Tensor int_gemm_silu_and_mul(const at::Tensor& x, const at::Tensor& codes,
                                 const at::Tensor& scales, const at::Tensor& zeros,
                                 int64_t bits, int64_t group_size, int64_t out_features);

// y [M, N] fp32 = x [M, K] @ w [N, K]^T, both bf16, summed in fp32 (cpu_bf16.cpp's GEMV,
// on torch's thread pool); 1 <= M <= 4.
void bf16_gemv(const c10::BFloat16* x, const c10::BFloat16* w, float* y, int64_t M, int64_t K,
               int64_t N);

// A GEMV of M (1-4) rows of x against the N rows of w, on torch's thread pool: each task
// calls gemv.template operator()<M>(n0, n1) for its rows n0 <= n < n1 of w, in units of
// 4 (the GEMVs' step) and 64 rows at least.
template <typename Gemv>
void split_rows(int64_t M, int64_t N, const Gemv& gemv) {
  at::parallel_for(0, (N + 3) / 4, 16, [&](int64_t begin, int64_t end) {
    const int64_t n0 = begin * 4, n1 = std::min(N, end * 4);
    switch (M) {
      case 1: gemv.template operator()<1>(n0, n1); break;
      case 2: gemv.template operator()<2>(n0, n1); break;
      case 3: gemv.template operator()<3>(n0, n1); break;
      default: gemv.template operator()<4>(n0, n1); break;
    }
  });
}

}  // namespace PAGELLM_NS

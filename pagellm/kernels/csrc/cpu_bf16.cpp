// A bf16 GEMV for the CPU: x [M <= 4, K] bf16 @ w [N, K]^T bf16 -> [M, N] bf16, summed
// in fp32 and rounded once (to nearest even), as torch's bf16 GEMMs round
// (executor/model/linear.py takes it for bf16 projections of up to 4 rows).
//
// Why: at batch 1 a bf16 model's projections went through torch.mm(W, x^T), which read
// SmolLM2-135M's bf16 weights at ~10 GB/s on a 2-core AMD EPYC (26 ms of a 42 ms token,
// where fp32's GEMV streams twice the bytes in 15 ms): a bf16 model on the CPU, the
// default for a bf16 checkpoint, decoded at a third of fp32's speed. Here w is streamed
// once, four rows at a time, with AVX512-BF16's dot products of bf16 pairs (VDPBF16PS:
// exact products, fp32 sums) where the CPU has them, else bf16 widened to fp32 (its
// bits are a float's high half) and fused multiply-adds: the same sums either way, up
// to their order.

#include "cpu_ops.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using PAGELLM_NS::bf16;

constexpr int64_t kMaxRows = 4;  // rows of x this GEMV takes (more: a GEMM's job)
constexpr int64_t kStep = 32;  // bf16 weights per load (one 512-bit register)
constexpr int64_t kPrefetch = 2048;  // how far ahead (weights: 4 KB) one row's stream prefetches

#if PAGELLM_AVX512
// 32 bf16 (masked) as two vectors of 16 fp32: elements 0-15 and 16-31.
inline void widen32(const bf16* p, __mmask32 m, __m512& lo, __m512& hi) {
  const __m512i v = _mm512_maskz_loadu_epi16(m, p);
  lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
  hi = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
}
#endif

// y[r, n] = sum_k x[r, k] w[n, k] in fp32 for rows r < ROWS of x and n0 <= n < n1 (y is
// [ROWS, N]): four rows of w per pass, each 32 columns of x loaded once per pass.
template <int ROWS>
void gemv(const bf16* x, const bf16* w, float* y, int64_t K, int64_t N, int64_t n0,
          int64_t n1) {
  int64_t n = n0;
#if PAGELLM_AVX512_BF16
  if (ROWS == 1 && K % 64 == 0) {  // one row: w is one stream, prefetched ahead
    for (; n < n1; ++n) {
      const bf16* wr = w + n * K;
      __m512 a0 = _mm512_setzero_ps(), a1 = a0;
      for (int64_t k = 0; k < K; k += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(wr + kPrefetch + k), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(wr + kPrefetch + k + 32), _MM_HINT_T0);
        a0 = _mm512_dpbf16_ps(a0, reinterpret_cast<__m512bh>(_mm512_loadu_si512(wr + k)),
                              reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + k)));
        a1 = _mm512_dpbf16_ps(a1, reinterpret_cast<__m512bh>(_mm512_loadu_si512(wr + k + 32)),
                              reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + k + 32)));
      }
      y[n] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    }
    return;
  }
#endif
#if PAGELLM_AVX512
  for (; n + 4 <= n1; n += 4) {
    __m512 acc[4][ROWS];
    for (int j = 0; j < 4; ++j)
      for (int r = 0; r < ROWS; ++r) acc[j][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += kStep) {
      const int64_t left = K - k;
      const __mmask32 m = left >= kStep ? ~__mmask32{0} : (__mmask32{1} << left) - 1;
      for (int j = 0; j < 4; ++j)  // the next four rows' line (never faults past the end)
        _mm_prefetch(reinterpret_cast<const char*>(w + (n + 4 + j) * K + k), _MM_HINT_T0);
#if PAGELLM_AVX512_BF16
      __m512bh xv[ROWS];
      for (int r = 0; r < ROWS; ++r)
        xv[r] = reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(m, x + r * K + k));
      for (int j = 0; j < 4; ++j) {
        const __m512bh wv =
            reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(m, w + (n + j) * K + k));
        for (int r = 0; r < ROWS; ++r) acc[j][r] = _mm512_dpbf16_ps(acc[j][r], wv, xv[r]);
      }
#else
      __m512 xlo[ROWS], xhi[ROWS];
      for (int r = 0; r < ROWS; ++r) widen32(x + r * K + k, m, xlo[r], xhi[r]);
      for (int j = 0; j < 4; ++j) {
        __m512 wlo, whi;
        widen32(w + (n + j) * K + k, m, wlo, whi);
        for (int r = 0; r < ROWS; ++r)
          acc[j][r] = _mm512_fmadd_ps(whi, xhi[r], _mm512_fmadd_ps(wlo, xlo[r], acc[j][r]));
      }
#endif
    }
    for (int j = 0; j < 4; ++j)
      for (int r = 0; r < ROWS; ++r) y[r * N + n + j] = _mm512_reduce_add_ps(acc[j][r]);
  }
#endif
  for (; n < n1; ++n)
    for (int r = 0; r < ROWS; ++r) {
      float sum = 0.f;
      for (int64_t k = 0; k < K; ++k)
        sum += static_cast<float>(x[r * K + k]) * static_cast<float>(w[n * K + k]);
      y[r * N + n] = sum;
    }
}

}  // namespace

namespace PAGELLM_NS {

void bf16_gemv(const bf16* x, const bf16* w, float* y, int64_t M, int64_t K, int64_t N) {
  TORCH_CHECK(M >= 1 && M <= kMaxRows, "bf16_linear takes 1 to ", kMaxRows, " rows, got ", M);
  split_rows(M, N, [&]<int ROWS>(int64_t n0, int64_t n1) { gemv<ROWS>(x, w, y, K, N, n0, n1); });
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "bf16_linear: x [M, K] and w [N, K], got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 &&
                  x.is_contiguous() && w.is_contiguous() && x.device().is_cpu() &&
                  w.device().is_cpu(),
              "bf16_linear: x and w must be contiguous bf16 CPU tensors");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  std::vector<float> sums(static_cast<size_t>(M * N));
  bf16_gemv(x.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(), sums.data(), M, K, N);
  at::Tensor y = at::empty({M, N}, x.options());
  bf16* out = y.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < M * N; ++i) out[i] = bf16(sums[i]);  // round to nearest even
  return y;
}

}  // namespace PAGELLM_NS

TORCH_LIBRARY_FRAGMENT(PAGELLM_NS, m) {
  m.def("bf16_linear(Tensor x, Tensor w) -> Tensor");
  m.impl("bf16_linear", c10::DispatchKey::CPU, &PAGELLM_NS::bf16_linear);
}

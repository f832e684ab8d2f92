// The sampler's argmax on the CPU (executor/worker/sampler.py, `argmax_rows`): each row's
// first maximal index, as torch's argmax and max(dim) give it (the first NaN where a row
// has one; ties and all--inf rows: the first).
//
// Why: torch's CPU max(dim) compares one element at a time: over the logits of a
// 48-request decode step ([48, 49152] fp32) it took 0.6 ms on 2 cores, ~2% of the step,
// while the other thread waited. Here a row is two vector passes: its maximum (and
// whether it holds a NaN), then the first index that equals it.

#include "cpu_ops.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>

namespace {

// x[0 .. n - 1] (n >= 1) -> the first index of its maximum, or of its first NaN.
int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0;
  float top = -std::numeric_limits<float>::infinity();
#if PAGELLM_AVX512
  __m512 best = _mm512_set1_ps(top);
  __mmask16 nan = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    best = _mm512_max_ps(best, v);
  }
  top = _mm512_reduce_max_ps(best);
  if (nan) i = 0;  // (found below, one by one: rare)
#endif
  for (; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    top = std::max(top, x[i]);
  }
  i = 0;
#if PAGELLM_AVX512
  const __m512 t = _mm512_set1_ps(top);
  for (; i + 16 <= n; i += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), t, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
#endif
  for (; i < n; ++i)
    if (x[i] == top) return i;
  return 0;  // (unreachable: top is one of the row's values)
}

}  // namespace

namespace PAGELLM_NS {

// x [rows, n] fp32 (rows of any stride, elements contiguous, n >= 1) -> [rows] int64.
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.device().is_cpu() &&
                  x.stride(1) == 1 && x.size(1) >= 1,
              "x must be an fp32 CPU tensor [rows, n >= 1] with contiguous rows");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * stride, n);
  });
  return out;
}

}  // namespace PAGELLM_NS

TORCH_LIBRARY_FRAGMENT(PAGELLM_NS, m) {
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.impl("argmax_rows", c10::DispatchKey::CPU, &PAGELLM_NS::argmax_rows);
}

// The decoder's elementwise steps on the CPU, one pass each (kernels/cpu_fused.py): the
// RMSNorm with the residual add before it, SiLU-and-mul, and the rotary embedding.
//
// Why: written as torch ops, a prompt step's RMSNorm is 5-9 passes over [T, hidden]
// (add, pow, mean, rsqrt, mul, cast, mul), the rotary embedding 4 over q and k (two
// products, a concatenation, a sum) and SiLU-and-mul 2, each allocating its output; at
// 2048 prompt tokens they were a tenth of an int8 prefill's samples (perf).
//
// Each keeps the torch version's arithmetic (layers.RMSNorm.reference, rope.rotate,
// F.silu(gate) * up): fp32 inside, rounded to bf16 where a bf16 tensor holds a value
// there, in the same order. So the residual add and the rotary embedding equal torch's
// to the bit (their products are not fused into multiply-adds: fp-contract is off
// below), the RMSNorm up to its mean's summation order, SiLU up to its exp (exp16, within
// 2 ulp).

#include "cpu_ops.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace {

using PAGELLM_NS::bf16;

constexpr int64_t kRowsPerTask = 16;  // a parallel region costs more than a few rows

// An fp32 or bf16 tensor's elements, read and written as fp32 (offsets in elements).
struct Elements {
  void* data;
  bool is_bf16;

  void load(int64_t at, int64_t n, float* out) const {
    if (is_bf16) {
      const bf16* p = static_cast<const bf16*>(data) + at;
      int64_t i = 0;
#if PAGELLM_AVX512
      for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, PAGELLM_NS::load16(p + i));
#endif
      for (; i < n; ++i) out[i] = static_cast<float>(p[i]);
    } else {
      const float* p = static_cast<const float*>(data) + at;
      for (int64_t i = 0; i < n; ++i) out[i] = p[i];
    }
  }
  // v must hold values of this tensor's dtype already (rounded to bf16 for a bf16 one).
  void store(int64_t at, int64_t n, const float* v) const {
    if (is_bf16) {
      uint16_t* p = static_cast<uint16_t*>(data) + at;
      int64_t i = 0;
#if PAGELLM_AVX512
      for (; i + 16 <= n; i += 16) {  // the high halves
        const __m512i bits = _mm512_castps_si512(_mm512_loadu_ps(v + i));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + i),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
      }
#endif
      for (; i < n; ++i) {
        uint32_t bits;
        std::memcpy(&bits, v + i, 4);
        p[i] = static_cast<uint16_t>(bits >> 16);  // exact: v is a bf16 value
      }
    } else {
      float* p = static_cast<float*>(data) + at;
      for (int64_t i = 0; i < n; ++i) p[i] = v[i];
    }
  }
};

void round_if(bool bf16, float* v, int64_t n) {
  if (bf16) PAGELLM_NS::round_to_bf16(v, n);
}

Elements elements_of(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.stride(-1) == 1 &&
                  (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16),
              name, " must be an fp32 or bf16 CPU tensor with a contiguous last dimension");
  return Elements{t.data_ptr(), t.scalar_type() == at::kBFloat16};
}

}  // namespace

namespace PAGELLM_NS {

void rms_norm_row(const float* v, const float* w, float* out, int64_t n, float eps,
                  bool bf16_normed, bool bf16_out) {
  const float inv = 1.f / std::sqrt(dot(v, v, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = v[i] * inv;
  round_if(bf16_normed, out, n);  // h.to(x.dtype)
  for (int64_t i = 0; i < n; ++i) out[i] *= w[i];
  round_if(bf16_out, out, n);
}

// (weight * norm(x + residual), x + residual): x, residual [T, N] of one dtype, weight
// [N] -> out [T, N] in weight's and x's promoted dtype, the sum [T, N] in x's (x itself
// without a residual).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& weight,
                                                double eps,
                                                const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2, "x must be [T, N]");
  const int64_t T = x.size(0), N = x.size(1);
  const Elements in = elements_of(x, "x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == N && weight.is_contiguous(),
              "weight must be a contiguous [", N, "]");
  const Elements w = elements_of(weight, "weight");
  const bool has_residual = residual.has_value() && residual->defined();
  at::Tensor total = x;
  Elements res{nullptr, false}, sum{nullptr, false};
  if (has_residual) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "residual must be x's shape and dtype");
    res = elements_of(*residual, "residual");
    total = at::empty({T, N}, x.options());
    sum = elements_of(total, "the sum");
  }
  at::Tensor out = at::empty({T, N}, x.options().dtype(c10::promoteTypes(
                                        weight.scalar_type(), x.scalar_type())));
  const Elements o = elements_of(out, "out");
  std::vector<float> wf(N);
  w.load(0, N, wf.data());
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, T, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> h(N), r(N);
    for (int64_t t = begin; t < end; ++t) {
      in.load(t * x.stride(0), N, h.data());
      if (has_residual) {
        res.load(t * residual->stride(0), N, r.data());
        for (int64_t i = 0; i < N; ++i) h[i] += r[i];
        round_if(in.is_bf16, h.data(), N);
        sum.store(t * N, N, h.data());
      }
      rms_norm_row(h.data(), wf.data(), h.data(), N, feps, in.is_bf16, o.is_bf16);
      o.store(t * N, N, h.data());
    }
  });
  return {out, total};
}

void silu_and_mul_row(const float* gate, const float* up, float* out, int64_t n, bool bf16) {
  int64_t i = 0;
#if PAGELLM_AVX512
  // g / (1 + exp(-g)), torch's silu; exp16 takes arguments >= -87.3, and below that
  // exp(-g) is 0 to fp32 (g > 87.3: silu(g) = g)
  const __m512 lo = _mm512_set1_ps(-87.3f), one = _mm512_set1_ps(1.f);
  for (; i + 16 <= n; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    const __m512 e = exp16(_mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), lo));
    __m512 y = _mm512_div_ps(g, _mm512_add_ps(one, e));
    if (bf16) y = round16_to_bf16(y);
    y = _mm512_mul_ps(y, _mm512_loadu_ps(up + i));
    _mm512_storeu_ps(out + i, bf16 ? round16_to_bf16(y) : y);
  }
#endif
  for (; i < n; ++i) {
    const float g = gate[i];
    float y = g / (1.f + std::exp(-g));
    if (bf16) y = to_bf16(y);
    y *= up[i];
    out[i] = bf16 ? to_bf16(y) : y;
  }
}

// F.silu(gate) * up for gate_up = [gate | up] [T, 2N] -> [T, N] in its dtype.
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [T, 2N]");
  const int64_t T = gate_up.size(0), N = gate_up.size(1) / 2;
  const Elements in = elements_of(gate_up, "gate_up");
  at::Tensor out = at::empty({T, N}, gate_up.options());
  const Elements o = elements_of(out, "out");
  at::parallel_for(0, T, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> g(N), u(N);
    for (int64_t t = begin; t < end; ++t) {
      in.load(t * gate_up.stride(0), N, g.data());
      in.load(t * gate_up.stride(0) + N, N, u.data());
      silu_and_mul_row(g.data(), u.data(), g.data(), N, in.is_bf16);
      o.store(t * N, N, g.data());
    }
  });
  return out;
}

// rope.rotate: x [T, H, D] (D contiguous, any token and head strides), cos and
// signed_sin [T, 1, D] of x's dtype (signed_sin's first half negated) -> x * cos +
// cat(x2, x1) * signed_sin [T, H, D] contiguous, each product and the sum rounded to x's
// dtype.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin) {
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0, "x must be [T, H, D], D even");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  const Elements in = elements_of(x, "x");
  for (const at::Tensor* t : {&cos, &signed_sin}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == T && t->size(1) == 1 && t->size(2) == D &&
                    t->scalar_type() == x.scalar_type(),
                "cos and signed_sin must be [", T, ", 1, ", D, "] of x's dtype");
  }
  const Elements c = elements_of(cos, "cos"), s = elements_of(signed_sin, "signed_sin");
  const bool bf = in.is_bf16;
  at::Tensor out = at::empty({T, H, D}, x.options());
  const Elements o{out.data_ptr(), bf};
  const int64_t W = H * D;  // a token's heads, contiguous in out
  at::parallel_for(0, T, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> cf(D), sf(D), v(W), a(W);
    for (int64_t t = begin; t < end; ++t) {
      c.load(t * cos.stride(0), D, cf.data());
      s.load(t * signed_sin.stride(0), D, sf.data());
      for (int64_t h = 0; h < H; ++h) in.load(t * x.stride(0) + h * x.stride(1), D, v.data() + h * D);
      // each product and the sum rounded to x's dtype, as torch's ops round them
      const auto r1 = [bf](float y) { return bf ? to_bf16(y) : y; };
      for (int64_t h = 0; h < H; ++h) {
        const float* vh = v.data() + h * D;
        float* ah = a.data() + h * D;
        int64_t i = 0;
#if PAGELLM_AVX512
        const auto r = [bf](__m512 y) { return bf ? round16_to_bf16(y) : y; };
        for (; i + 16 <= half; i += 16) {
          const __m512 x1 = _mm512_loadu_ps(vh + i), x2 = _mm512_loadu_ps(vh + half + i);
          _mm512_storeu_ps(ah + i, r(_mm512_add_ps(r(_mm512_mul_ps(x1, _mm512_loadu_ps(&cf[i]))),
                                                   r(_mm512_mul_ps(x2, _mm512_loadu_ps(&sf[i]))))));
          _mm512_storeu_ps(ah + half + i,
                           r(_mm512_add_ps(r(_mm512_mul_ps(x2, _mm512_loadu_ps(&cf[half + i]))),
                                           r(_mm512_mul_ps(x1, _mm512_loadu_ps(&sf[half + i]))))));
        }
#endif
        for (; i < half; ++i) {
          const float x1 = vh[i], x2 = vh[half + i];
          ah[i] = r1(r1(x1 * cf[i]) + r1(x2 * sf[i]));
          ah[half + i] = r1(r1(x2 * cf[half + i]) + r1(x1 * sf[half + i]));
        }
      }
      o.store(t * W, W, a.data());
    }
  });
  return out;
}

}  // namespace PAGELLM_NS

TORCH_LIBRARY_FRAGMENT(PAGELLM_NS, m) {
  m.def("add_rms_norm(Tensor x, Tensor weight, float eps, Tensor? residual) -> "
        "(Tensor, Tensor)");
  m.impl("add_rms_norm", c10::DispatchKey::CPU, &PAGELLM_NS::add_rms_norm);
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &PAGELLM_NS::silu_and_mul);
  m.def("rotary(Tensor x, Tensor cos, Tensor signed_sin) -> Tensor");
  m.impl("rotary", c10::DispatchKey::CPU, &PAGELLM_NS::rotary);
}

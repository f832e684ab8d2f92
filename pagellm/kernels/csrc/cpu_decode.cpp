// A decode step of a Llama-family decoder on the CPU in one call (executor/worker/cpu_decode.py
// gathers its operands; kernels/cpu_ops.py builds it).
//
// At batch 1 on a 2-core CPU, SmolLM2-135M's projections take 4.7 ms per token as int4
// and 17 ms as fp32, and the torch ops between them (norms, rotary, KV writes, paged
// attention, activations: ~20 per layer, each a few microseconds of dispatch on a row
// of 576 numbers) took another 9 ms. Here every layer runs in C++: the same arithmetic
// as the decoder's torch path (executor/model/decoder.py), in the same order, in fp32,
// with no dispatch between the parts.
//
// For T tokens, one per request (a decode-only step), and each layer l:
//
//   residual = h + residual          (layer 0: residual = the embeddings)
//   a   = rms(residual) * w_in
//   qkv = a @ Wqkv^T (+ b)           [T, (H + 2 H_kv) D]; per-head q/k RMSNorm (Qwen3)
//   q, k rotated (neox halves, the first R dimensions); k, v written to slot_mapping
//   o   = attend(q, paged keys/values of the request) @ Wo^T (+ b)   (cpu_attention.cpp)
//   residual = o + residual; a = rms(residual) * w_post
//   h   = (silu(a @ Wg^T) * (a @ Wu^T)) @ Wd^T   (an int [gate | up]: int_gemm_silu_and_mul)
//
// or, in a mixture-of-experts layer (executor/model/moe.py), the router's softmax over
// its experts and their top k (ATen's own softmax and topk, as the torch path calls
// them: the same experts, the same weights), each chosen expert's SwiGLU MLP over the
// rows of the tokens that chose it (its rows of the stacked weights: a slice of the
// codes, or one [N, K] of the dense [E, N, K]), and h[t] the sum of token t's experts'
// outputs times their weights, in ascending expert order (moe.experts_grouped's), plus
// sigmoid(a @ Wsg^T) times a shared expert's SwiGLU where the layer has one (Qwen2-MoE).
//
// and rms(h + residual) * w_final at the end. Projections are dense fp32 (a GEMV for up
// to 4 rows, else oneDNN's linear: `dense_gemm`) or the int kernel's tiled int4/int8
// (int_gemm).
//
// A bf16 model (x, the weights, norms, biases and the KV cache in bf16; the RoPE tables
// in fp32) runs the same code in fp32 with every value rounded to bf16 where the torch
// path holds a bf16 tensor (`Round`): the residual sum, the norm before and after its
// weight, each projection's output and its bias sum, the rotation's two products and
// their sum, the attention's weights (SDPA's bf16 P) and output, SiLU and its product.
// Its dense projections are cpu_bf16.cpp's GEMV up to 4 rows (fp32 sums, rounded once,
// as torch's), else at::linear or oneDNN's linear on the loader's packed copy.

#include "cpu_ops.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/div.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kGemvRows = 4;  // rows of x up to which a dense projection is a GEMV
// How far ahead (floats) the one-row GEMV prefetches its weight row: 4 KB ahead it read
// SmolLM2's projections as fast as torch's W @ x^T (15.4 against 15.8 ms for 30
// layers), without it 8% slower.
constexpr int64_t kPrefetch = 1024;
// per layer: qkv, o, gate_up, down, and a MoE layer's shared expert's gate_up and down
// (empty without one)
constexpr int64_t kLinears = 6;
constexpr int64_t kNorms = 4;  // per layer: input, post-attention, q (per head), k
constexpr int64_t kBiases = 2;  // per layer: qkv, o
constexpr int64_t kMoe = 3;  // per layer: experts (0: a dense MLP), top k, flags below
constexpr int64_t kRenormalize = 1;  // the top k weights divided by their sum
constexpr int64_t kWeightsInModelDtype = 2;  // and rounded to the model's dtype
// gpt-oss: top k of the router's logits, then the softmax over those k (not over all)
constexpr int64_t kTopkSoftmax = 4;
constexpr int64_t kExpertBiases = 3;  // per layer: router [E], gate_up [E, 2I], down [E, H]
// Tokens per task of the per-token loops (norms, rotary, the activation): at batch 1-3
// one thread does them all (a parallel region costs more than a row of 576 floats).
constexpr int64_t kRowsPerTask = 4;

using PAGELLM_NS::bf16;
using PAGELLM_NS::dot;
using PAGELLM_NS::PagedKV;
using PAGELLM_NS::to_bf16;
using PAGELLM_NS::widen;

// Rounds to bf16 where the model is bf16, else passes values through (fp32 models).
struct Round {
  bool bf16;
  float operator()(float v) const { return bf16 ? to_bf16(v) : v; }
  void all(float* p, int64_t n) const {
    if (bf16) PAGELLM_NS::round_to_bf16(p, n);
  }
};

// A norm's weight or a bias as the model holds it (fp32 or bf16: read in place, so that
// a write to the parameter, a trainer's in-process load_weights, is seen at once).
struct Param {
  const void* data;
  bool is_bf16;
  float operator[](int64_t i) const {
    return is_bf16 ? widen(static_cast<const bf16*>(data)[i])
                   : static_cast<const float*>(data)[i];
  }
};

// y[r, n] = x[r, :] . w[n, :] for rows r < ROWS and n0 <= n < n1 (y's rows are N wide);
// w is read once, the whole point. One row of x: a row of w at a time, 4 accumulators,
// prefetched ahead (the loads are the limit, at the memory's bandwidth). More: four
// rows of w at a time, so each 16 columns of x are loaded once per four rows of w.
template <int ROWS>
void gemv(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t n0,
          int64_t n1) {
  int64_t n = n0;
#if PAGELLM_AVX512
  if (ROWS == 1 && K % 64 == 0) {
    for (; n < n1; ++n) {
      const float* wr = w + n * K;
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t k = 0; k < K; k += 64) {  // (a prefetch past the weight's end never faults)
        _mm_prefetch(reinterpret_cast<const char*>(wr + kPrefetch + k), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(wr + kPrefetch + k + 16), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(wr + kPrefetch + k + 32), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(wr + kPrefetch + k + 48), _MM_HINT_T0);
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(wr + k), _mm512_loadu_ps(x + k), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(wr + k + 16), _mm512_loadu_ps(x + k + 16), a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(wr + k + 32), _mm512_loadu_ps(x + k + 32), a2);
        a3 = _mm512_fmadd_ps(_mm512_loadu_ps(wr + k + 48), _mm512_loadu_ps(x + k + 48), a3);
      }
      y[n] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    }
    return;
  }
  const int64_t full = K / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (K - full)) - 1);
  for (; n + 4 <= n1; n += 4) {
    __m512 acc[4][ROWS];
    for (int j = 0; j < 4; ++j)
      for (int r = 0; r < ROWS; ++r) acc[j][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 m = k < full ? static_cast<__mmask16>(0xffff) : tail;
      __m512 xv[ROWS];
      for (int r = 0; r < ROWS; ++r) xv[r] = _mm512_maskz_loadu_ps(m, x + r * K + k);
      for (int j = 0; j < 4; ++j) {
        const __m512 wv = _mm512_maskz_loadu_ps(m, w + (n + j) * K + k);
        for (int r = 0; r < ROWS; ++r) acc[j][r] = _mm512_fmadd_ps(wv, xv[r], acc[j][r]);
      }
    }
    for (int j = 0; j < 4; ++j)
      for (int r = 0; r < ROWS; ++r) y[r * N + n + j] = _mm512_reduce_add_ps(acc[j][r]);
  }
#endif
  for (; n < n1; ++n)
    for (int r = 0; r < ROWS; ++r) y[r * N + n] = dot(x + r * K, w + n * K, K);
}

// One projection's operands: a dense weight [N, K] (bits 0) and, for a bf16 one, oneDNN's
// packed copy of it or an empty tensor (in `scales`' place: GEMMs of more rows than the
// GEMV's take it), or the int kernel's codes, scales and zeros (bits 4 or 8, group_size G).
struct Projection {
  const at::Tensor& weight;
  const at::Tensor& scales;
  const at::Tensor& zeros;
  int64_t bits, group_size, out_features;
};

// Expert e's rows of a mixture-of-experts layer's stacked projection `p` (bits 0: a
// dense [E, N, K] weight, out_features N; else the int kernel's codes, scales and zeros
// of all E * N rows, out_features N, expert e's the tiles from e * N / 16): views that
// `get` returns as a Projection while this lives.
struct ExpertSlice {
  at::Tensor weight, scales, zeros;
  int64_t bits, group_size, out_features;

  ExpertSlice(const Projection& p, int64_t e, int64_t E)
      : bits(p.bits), group_size(p.group_size), out_features(p.out_features) {
    if (p.bits == 0) {
      TORCH_CHECK(p.weight.dim() == 3 && p.weight.size(0) == E &&
                      p.weight.size(1) == p.out_features,
                  "dense experts must be a stacked [", E, ", ", p.out_features, ", K] weight");
      weight = p.weight.select(0, e);
      return;
    }
    const int64_t tiles = p.out_features / 16;
    TORCH_CHECK(p.out_features % 16 == 0 && p.weight.dim() == 3 && p.weight.size(0) == E * tiles,
                "integer experts must be ", E, " experts of whole tiles of 16 rows");
    weight = p.weight.narrow(0, e * tiles, tiles);
    scales = p.scales.narrow(0, e * tiles, tiles);
    zeros = p.zeros.narrow(0, e * tiles, tiles);
  }

  Projection get() const { return {weight, scales, zeros, bits, group_size, out_features}; }
};

// x [M, K] @ w [N, K]^T (+ bias), for more rows than the GEMV takes: oneDNN's linear,
// on fp32's plain weights where this torch has it (linear.py's ONEDNN way: at 48 rows
// 1.1-1.5x MKL's, which at::linear runs), else at::linear; or on a bf16 weight's packed
// copy, an opaque oneDNN tensor (linear.py's PACKED way).
at::Tensor dense_gemm(const at::Tensor& x, const at::Tensor& w,
                      const std::optional<at::Tensor>& bias) {
  using Signature = at::Tensor(const at::Tensor&, const at::Tensor&,
                               const std::optional<at::Tensor>&, c10::string_view,
                               c10::List<std::optional<c10::Scalar>>,
                               std::optional<c10::string_view>);
  static const std::optional<c10::TypedOperatorHandle<Signature>> onednn =
      []() -> std::optional<c10::TypedOperatorHandle<Signature>> {
    const auto handle = c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
    if (!handle || !handle->hasKernelForDispatchKey(c10::DispatchKey::CPU)) return std::nullopt;
    return handle->typed<Signature>();
  }();
  TORCH_CHECK(onednn || !w.is_mkldnn(), "a packed weight without oneDNN's linear");
  if (!onednn) return at::linear(x, w, bias);
  return onednn->call(x, w, bias, "none", c10::List<std::optional<c10::Scalar>>(), std::nullopt);
}

Param param(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.scalar_type() == dtype && t.is_contiguous() && t.device().is_cpu(), name,
              " must be a contiguous CPU tensor of the model's dtype");
  return Param{t.data_ptr(), dtype == at::kBFloat16};
}

// x [M, K] fp32 contiguous -> x @ W^T (+ bias, in the model's dtype) [M, N] fp32, rounded
// as the model's dtype rounds (a bf16 model: the product, then its sum with the bias).
at::Tensor project(const Projection& p, const at::Tensor& x, const at::Tensor& bias,
                   const Round& round) {
  const int64_t M = x.size(0), K = x.size(1), N = p.out_features;
  const bool has_bias = bias.defined() && bias.numel() != 0;
  const Param b = has_bias ? param(bias, round.bf16 ? at::kBFloat16 : at::kFloat, "a bias")
                           : Param{nullptr, false};
  TORCH_CHECK(!has_bias || bias.numel() == N, "a bias must have ", N, " elements");
  // A GEMM of more rows than the GEMV's adds the bias itself, as the torch path's does
  // (in bf16: one rounding of product and bias together).
  const bool gemm = p.bits == 0 && M > kGemvRows;
  const auto gemm_bias = has_bias ? std::optional<at::Tensor>(bias) : std::nullopt;
  at::Tensor y;
  if (p.bits != 0) {
    y = PAGELLM_NS::int_gemm(x, p.weight, p.scales, p.zeros, p.bits, p.group_size, N);
  } else if (p.weight.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(p.weight.dim() == 2 && p.weight.is_contiguous() && p.weight.size(0) == N &&
                    p.weight.size(1) == K,
                "a dense bf16 projection must be a contiguous [", N, ", ", K, "] weight");
    if (gemm) {
      const bool packed = p.scales.defined() && p.scales.numel() != 0;  // linear.py's PACKED
      y = packed ? dense_gemm(x.to(at::kBFloat16), p.scales, gemm_bias).to(at::kFloat)
                 : at::linear(x.to(at::kBFloat16), p.weight, gemm_bias).to(at::kFloat);
    } else {  // (x to bf16 here, not through a torch op: 120 of them a token at batch 1)
      const float* xp = x.data_ptr<float>();
      std::vector<bf16> xb(xp, xp + M * K);  // exact: x holds bf16 values
      y = at::empty({M, N}, x.options());
      PAGELLM_NS::bf16_gemv(xb.data(), p.weight.data_ptr<at::BFloat16>(), y.data_ptr<float>(),
                            M, K, N);
    }
  } else {
    TORCH_CHECK(p.weight.dim() == 2 && p.weight.scalar_type() == at::kFloat &&
                    p.weight.is_contiguous() && p.weight.size(0) == N && p.weight.size(1) == K,
                "a dense projection must be a contiguous fp32 [", N, ", ", K, "] weight");
    if (gemm) {
      const bool packed = p.scales.defined() && p.scales.numel() != 0;  // linear.py's PACKED
      y = dense_gemm(x, packed ? p.scales : p.weight, gemm_bias);
    } else {
      y = at::empty({M, N}, x.options());
      const float* xp = x.data_ptr<float>();
      const float* wp = p.weight.data_ptr<float>();
      float* yp = y.data_ptr<float>();
      PAGELLM_NS::split_rows(M, N, [&]<int ROWS>(int64_t n0, int64_t n1) {
        gemv<ROWS>(xp, wp, yp, K, N, n0, n1);
      });
    }
  }
  float* yp = y.data_ptr<float>();
  round.all(yp, M * N);
  if (has_bias && !gemm) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) yp[m * N + n] = round(yp[m * N + n] + b[n]);
  }
  return y;
}

// A norm's weight in fp32, read from the parameter at each step (so that a write to it,
// a trainer's in-process load_weights, is seen at once).
std::vector<float> norm_weight(const at::Tensor& w, at::ScalarType dtype, const char* name) {
  const Param p = param(w, dtype, name);
  std::vector<float> out(w.numel());
  for (int64_t i = 0; i < w.numel(); ++i) out[i] = p[i];
  return out;
}

// Neox rotation of the first R dimensions of a head x [D] at a position whose table
// rows are cos, sin [R]: x[i] cos[i] - x[i + R/2] sin[i] for i < R/2, x[i] cos[i] +
// x[i - R/2] sin[i] above (transformers' x * cos + rotate_half(x) * sin).
// A bf16 model rounds the tables, each product and the sum (the torch path's bf16 ops).
void rotate(float* x, const float* cos, const float* sin, int64_t R, const Round& round) {
  const int64_t half = R / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = round(round(a * round(cos[i])) - round(b * round(sin[i])));
    x[i + half] = round(round(b * round(cos[i + half])) + round(a * round(sin[i + half])));
  }
}

struct Heads {
  int64_t H, H_kv, D;
};

void check_fp32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu(), name,
              " must be a contiguous fp32 CPU tensor");
}

}  // namespace

namespace PAGELLM_NS {

// The layers of a decode step: x [T, hidden] (the embeddings) -> the final norm's output
// [T, hidden]; writes each layer's keys and values into kv_caches[l]
// [2, num_blocks, block_size, H_kv, D]. Per layer l: weights[18 l + 3 p + i] and
// linear_meta[18 l + 3 p + i] for projection p (qkv, o, gate_up, down, shared gate_up,
// shared down) as (weight or codes, scales, zeros) and (bits, group_size,
// out_features); norms[4 l + i] (input, post-attention, q, k: the last two empty
// without per-head norms); biases[2 l + i] (qkv, o; empty: none); in a
// mixture-of-experts layer routers[2 l] [E, hidden] and moe_meta[3 l + i] (E, top k,
// the kRenormalize and kWeightsInModelDtype flags), its gate_up and down projections
// then its stacked experts (ExpertSlice), and where it has a shared expert (Qwen2-MoE)
// routers[2 l + 1] its gate [1, hidden] and projections 4 and 5 its gate_up and down
// (else empty, and E 0 in a dense layer); windows[l] (0: full attention); scales[l];
// sinks[l] the attention sinks [H] fp32 (gpt-oss; empty: none); expert_biases[3 l + i]
// the router's, the experts' gate_up and down biases (gpt-oss; empty: none) and
// swiglu[2 l], swiglu[2 l + 1] the experts' clamped SwiGLU's alpha and limit (gpt-oss:
// (up + 1) * gate * sigmoid(alpha * gate), gate <= limit, |up| <= limit; limit 0:
// silu(gate) * up).
at::Tensor decode_layers(const at::Tensor& x, const at::Tensor& positions,
                         const at::Tensor& cos_cache, const at::Tensor& sin_cache,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& seq_lens, at::TensorList weights,
                         at::IntArrayRef linear_meta, at::TensorList norms,
                         at::TensorList biases, at::TensorList routers,
                         at::IntArrayRef moe_meta, at::TensorList kv_caches,
                         at::IntArrayRef windows, at::ArrayRef<double> scales,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         double eps, const at::Tensor& final_norm, at::TensorList sinks,
                         at::TensorList expert_biases, at::ArrayRef<double> swiglu) {
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous fp32 or bf16 CPU tensor");
  const Round round{x.scalar_type() == at::kBFloat16};
  check_fp32(cos_cache, "cos_cache");
  check_fp32(sin_cache, "sin_cache");
  const int64_t T = x.size(0), hidden = x.size(1), L = static_cast<int64_t>(kv_caches.size());
  const Heads s{num_heads, num_kv_heads, head_dim};
  TORCH_CHECK(x.dim() == 2 && final_norm.numel() == hidden, "x must be [T, hidden]");
  TORCH_CHECK(s.H > 0 && s.H_kv > 0 && s.H % s.H_kv == 0 && s.D > 0,
              "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == L * kLinears * 3 &&
                  static_cast<int64_t>(linear_meta.size()) == L * kLinears * 3 &&
                  static_cast<int64_t>(norms.size()) == L * kNorms &&
                  static_cast<int64_t>(biases.size()) == L * kBiases &&
                  static_cast<int64_t>(routers.size()) == 2 * L &&
                  static_cast<int64_t>(moe_meta.size()) == L * kMoe &&
                  static_cast<int64_t>(windows.size()) == L &&
                  static_cast<int64_t>(scales.size()) == L &&
                  static_cast<int64_t>(sinks.size()) == L &&
                  static_cast<int64_t>(expert_biases.size()) == L * kExpertBiases &&
                  static_cast<int64_t>(swiglu.size()) == 2 * L,
              "per-layer lists of the wrong length for ", L, " layers");
  const int64_t R = cos_cache.size(1);
  TORCH_CHECK(cos_cache.dim() == 2 && sin_cache.sizes() == cos_cache.sizes() && R % 2 == 0 &&
                  R <= s.D,
              "cos_cache and sin_cache must be [rows, rotary_dim <= head_dim]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == T &&
                  positions.is_contiguous() && slot_mapping.scalar_type() == at::kLong &&
                  slot_mapping.numel() == T && slot_mapping.is_contiguous(),
              "positions and slot_mapping must be contiguous int64 [T]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t rows = cos_cache.size(0);
  // Every layer's cache has the first one's shape; every index into them is checked
  // here, once, against it (the loops below trust them).
  at::IntArrayRef cache_shape = L > 0 ? kv_caches[0].sizes() : at::IntArrayRef();
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor& cache = kv_caches[l];
    TORCH_CHECK((cache.scalar_type() == x.scalar_type() ||
                 cache.scalar_type() == at::kBFloat16) && cache.is_contiguous() &&
                    cache.device().is_cpu(),
                "a KV cache must be a contiguous CPU tensor of x's dtype or bf16");
    TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.size(3) == s.H_kv &&
                    cache.size(4) == s.D && cache.sizes() == cache_shape,
                "kv_caches[", l, "] must be [2, num_blocks, block_size, H_kv, D], as the "
                "first layer's");
  }
  const int64_t num_blocks = L > 0 ? cache_shape[1] : 0, block_size = L > 0 ? cache_shape[2] : 1;
  const int64_t num_slots = num_blocks * block_size;
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < rows, "position ", pos[t], " outside the RoPE tables");
    TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " outside the KV cache");
  }
  PAGELLM_NS::check_block_tables(block_tables, seq_lens, T, num_blocks, block_size);

  const int64_t q_size = s.H * s.D, kv_size = s.H_kv * s.D, qkv_size = q_size + 2 * kv_size;
  const float feps = static_cast<float>(eps);
  // layer 0: the embeddings themselves (in fp32: a bf16 model's are exact there)
  at::Tensor residual = round.bf16 ? x.to(at::kFloat) : x.clone();
  const auto fp32 = x.options().dtype(at::kFloat);
  at::Tensor a = at::empty({T, hidden}, fp32);  // the normed input of a GEMM
  at::Tensor attn = at::empty({T, q_size}, fp32);
  at::Tensor h;  // a layer's output, added to the residual by the next norm
  float* res = residual.data_ptr<float>();
  float* ap = a.data_ptr<float>();
  const float* cosp = cos_cache.data_ptr<float>();
  const float* sinp = sin_cache.data_ptr<float>();

  // residual (+= h unless first) -> a = rms(residual) * w, row by row
  auto add_norm = [&](const at::Tensor& w, bool first) {
    TORCH_CHECK(w.numel() == hidden, "a norm's weight must be [hidden]");
    const std::vector<float> wf = norm_weight(w, x.scalar_type(), "a norm's weight");
    const float* hp = first ? nullptr : h.data_ptr<float>();
    at::parallel_for(0, T, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        float* r = res + t * hidden;
        if (hp != nullptr)
          for (int64_t i = 0; i < hidden; ++i) r[i] = round(hp[t * hidden + i] + r[i]);
        PAGELLM_NS::rms_norm_row(r, wf.data(), ap + t * hidden, hidden, feps, round.bf16,
                                 round.bf16);
      }
    });
  };
  auto projection = [&](int64_t l, int64_t p) {
    const int64_t i = (l * kLinears + p) * 3;
    return Projection{weights[i], weights[i + 1], weights[i + 2], linear_meta[i],
                      linear_meta[i + 1], linear_meta[i + 2]};
  };
  // gate_up [M, 2I] (gate's columns, then up's) -> [M, I], row by row through
  // row(gate, up, out, I): the one loop both activations below share
  auto activate = [&](const at::Tensor& gate_up, auto&& row) {
    const int64_t M = gate_up.size(0), inter = gate_up.size(1) / 2;
    at::Tensor act = at::empty({M, inter}, fp32);
    const float* gu = gate_up.data_ptr<float>();
    float* actp = act.data_ptr<float>();
    at::parallel_for(0, M, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        row(gu + t * 2 * inter, gu + t * 2 * inter + inter, actp + t * inter, inter);
    });
    return act;
  };
  // x [M, hidden] -> silu(x @ Wg^T) * (x @ Wu^T) [M, inter] through the [gate | up]
  // projection: in one pass for an int one of an fp32 model (int_gemm_silu_and_mul, the
  // same values)
  auto gated = [&](const Projection& p, const at::Tensor& x) {
    if (p.bits != 0 && !round.bf16 && PAGELLM_NS::pairs_gate_and_up(p.out_features))
      return PAGELLM_NS::int_gemm_silu_and_mul(x, p.weight, p.scales, p.zeros, p.bits,
                                               p.group_size, p.out_features);
    return activate(project(p, x, at::Tensor(), round),
                    [&](const float* gate, const float* up, float* out, int64_t n) {
                      PAGELLM_NS::silu_and_mul_row(gate, up, out, n, round.bf16);
                    });
  };
  // gate_up -> gpt-oss's clamped SwiGLU, in transformers' order of operations (fp32
  // models only)
  auto clamped = [&](const at::Tensor& gate_up, float alpha, float limit) {
    return activate(gate_up, [&](const float* gate, const float* up, float* out, int64_t n) {
      for (int64_t i = 0; i < n; ++i) {
        const float g = std::min(gate[i], limit), u = std::clamp(up[i], -limit, limit);
        out[i] = (u + 1.f) * (g * (1.f / (1.f + std::exp(-(g * alpha)))));
      }
    });
  };
  // a -> layer l's experts' sum [T, hidden] (the header's mixture-of-experts layer). A
  // bf16 model rounds where the torch path's bf16 tensors do: the logits, each expert's
  // output times its weight, and each partial sum.
  auto sparse = [&](int64_t l) {
    const int64_t E = moe_meta[l * kMoe], top_k = moe_meta[l * kMoe + 1];
    const int64_t flags = moe_meta[l * kMoe + 2];
    TORCH_CHECK(top_k >= 1 && top_k <= E, "top_k ", top_k, " of ", E, " experts");
    const float alpha = static_cast<float>(swiglu[2 * l]);
    const float limit = static_cast<float>(swiglu[2 * l + 1]);
    TORCH_CHECK(!round.bf16 || (limit <= 0.f && !(flags & kTopkSoftmax)),
                "gpt-oss's experts run in fp32 only");
    // Expert e's row of expert_biases[3 l + i] (i 1: gate_up, 2: down), or none.
    auto expert_bias = [&](int64_t i, int64_t e) {
      const at::Tensor& b = expert_biases[l * kExpertBiases + i];
      if (b.numel() == 0) return at::Tensor();
      TORCH_CHECK(b.dim() == 2 && b.size(0) == E, "an expert bias must be [", E, ", N]");
      return b.select(0, e);
    };
    const at::Tensor& router = routers[2 * l];
    TORCH_CHECK(router.dim() == 2 && router.size(0) == E && router.size(1) == hidden,
                "a router must be [", E, ", ", hidden, "]");
    const at::Tensor none;
    const at::Tensor logits = project(Projection{router, none, none, 0, 0, E}, a,
                                      expert_biases[l * kExpertBiases], round);  // (+ bias)
    at::Tensor weights, ids;  // [T, k]
    if (flags & kTopkSoftmax) {
      std::tie(weights, ids) = at::topk(logits, top_k, -1);
      weights = at::softmax(weights, -1);
    } else {
      std::tie(weights, ids) = at::topk(at::softmax(logits, -1), top_k, -1);
    }
    if (flags & kRenormalize) weights = at::div(weights, weights.sum(-1, true));
    if ((flags & kWeightsInModelDtype) && round.bf16)
      weights = weights.to(at::kBFloat16).to(at::kFloat);
    weights = weights.contiguous();
    ids = ids.contiguous();
    const float* wp = weights.data_ptr<float>();
    const int64_t* ip = ids.data_ptr<int64_t>();
    std::vector<std::vector<std::pair<int64_t, float>>> chosen(E);  // (token, weight)
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t j = 0; j < top_k; ++j)
        chosen[ip[t * top_k + j]].emplace_back(t, wp[t * top_k + j]);
    }
    at::Tensor out = at::zeros({T, hidden}, fp32);
    float* outp = out.data_ptr<float>();
    for (int64_t e = 0; e < E; ++e) {
      const auto& rows = chosen[e];
      if (rows.empty()) continue;
      const int64_t n = static_cast<int64_t>(rows.size());
      at::Tensor xe = a;  // the rows of the tokens that chose e (all of them: a itself)
      if (n != T) {
        xe = at::empty({n, hidden}, fp32);
        for (int64_t r = 0; r < n; ++r)
          std::memcpy(xe.data_ptr<float>() + r * hidden, ap + rows[r].first * hidden,
                      hidden * sizeof(float));
      }
      const ExpertSlice gate_up(projection(l, 2), e, E), down(projection(l, 3), e, E);
      const at::Tensor y =
          limit > 0.f
              ? project(down.get(), clamped(project(gate_up.get(), xe, expert_bias(1, e),
                                                    round), alpha, limit),
                        expert_bias(2, e), round)
              : project(down.get(), gated(gate_up.get(), xe), none, round);
      TORCH_CHECK(y.size(1) == hidden, "an expert's down projection must have ", hidden,
                  " outputs");
      const float* yp = y.data_ptr<float>();
      for (int64_t r = 0; r < n; ++r) {
        float* o = outp + rows[r].first * hidden;
        const float w = rows[r].second;
        for (int64_t i = 0; i < hidden; ++i) o[i] = round(o[i] + round(yp[r * hidden + i] * w));
      }
    }
    const at::Tensor& shared_gate = routers[2 * l + 1];
    if (shared_gate.numel() != 0) {  // + sigmoid(gate(a)) * shared(a), transformers' order
      TORCH_CHECK(shared_gate.dim() == 2 && shared_gate.size(0) == 1 &&
                      shared_gate.size(1) == hidden,
                  "a shared expert's gate must be [1, ", hidden, "]");
      const at::Tensor g = project(Projection{shared_gate, none, none, 0, 0, 1}, a, none, round);
      const at::Tensor y = project(projection(l, 5), gated(projection(l, 4), a), none, round);
      TORCH_CHECK(y.size(1) == hidden, "a shared expert must have ", hidden, " outputs");
      const float* gp = g.data_ptr<float>();
      const float* yp = y.data_ptr<float>();
      for (int64_t t = 0; t < T; ++t) {
        const float sig = round(1.f / (1.f + std::exp(-gp[t])));
        for (int64_t i = 0; i < hidden; ++i)
          outp[t * hidden + i] = round(outp[t * hidden + i] + round(sig * yp[t * hidden + i]));
      }
    }
    return out;
  };

  // Layer l's attention sinks (gpt-oss), or nullptr.
  auto sink_of = [&](int64_t l) -> const float* {
    const at::Tensor& t = sinks[l];
    if (t.numel() == 0) return nullptr;
    check_fp32(t, "sinks");
    TORCH_CHECK(t.numel() == s.H, "sinks must be [", s.H, "]");
    return t.data_ptr<float>();
  };
  for (int64_t l = 0; l < L; ++l) {
    add_norm(norms[l * kNorms], l == 0);
    at::Tensor qkv = project(projection(l, 0), a, biases[l * kBiases], round);
    TORCH_CHECK(qkv.size(1) == qkv_size, "the qkv projection must have ", qkv_size, " outputs");
    float* qp = qkv.data_ptr<float>();
    const at::Tensor& q_norm = norms[l * kNorms + 2];
    const at::Tensor& k_norm = norms[l * kNorms + 3];
    const bool head_norms = q_norm.numel() != 0;  // per-head RMSNorm of q and k (Qwen3)
    std::vector<float> qn, kn;  // their weights in fp32
    if (head_norms) {
      TORCH_CHECK(q_norm.numel() == s.D && k_norm.numel() == s.D, "q/k norms must be [D]");
      qn = norm_weight(q_norm, x.scalar_type(), "q_norm");
      kn = norm_weight(k_norm, x.scalar_type(), "k_norm");
    }
    // Norms and rotation of q and k and the KV write; the cache's element type Elem is
    // the model's (fp32 or bf16) or bf16 under an fp32 model (kv_cache_dtype="bfloat16":
    // rounded to nearest on the way in, as the torch path's .to(bfloat16)).
    auto rotate_and_write = [&](auto* kv) {
      using Elem = std::remove_pointer_t<decltype(kv)>;
      at::parallel_for(0, T, kRowsPerTask, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          float* row = qp + t * qkv_size;
          for (int64_t head = 0; head < s.H + s.H_kv; ++head) {
            float* v = row + head * s.D;
            if (head_norms)  // before the rotation
              PAGELLM_NS::rms_norm_row(v, (head < s.H ? qn : kn).data(), v, s.D, feps,
                                       round.bf16, round.bf16);
            rotate(v, cosp + pos[t] * R, sinp + pos[t] * R, R, round);
          }
          if (slots[t] >= 0) {  // negative: padding, written nowhere
            Elem* k_dst = kv + slots[t] * kv_size;
            Elem* v_dst = kv + (num_slots + slots[t]) * kv_size;
            for (int64_t i = 0; i < kv_size; ++i) {
              k_dst[i] = static_cast<Elem>(row[q_size + i]);
              v_dst[i] = static_cast<Elem>(row[q_size + kv_size + i]);
            }
          }
        }
      });
    };
    const bool bf16_cache = kv_caches[l].scalar_type() == at::kBFloat16;
    if (bf16_cache)
      rotate_and_write(kv_caches[l].data_ptr<at::BFloat16>());
    else
      rotate_and_write(kv_caches[l].data_ptr<float>());
    const PagedKV kv{kv_caches[l].data_ptr(), bf16_cache, num_slots * kv_size, block_size,
                     block_tables.data_ptr<int32_t>(), block_tables.stride(0),
                     seq_lens.data_ptr<int32_t>()};
    PAGELLM_NS::attend_decodes(
        qp, qkv_size, round.bf16, kv, T, s.H, s.H_kv, s.D,
        windows[l] > 0 ? std::optional<int64_t>(windows[l]) : std::nullopt,
        static_cast<float>(scales[l]), std::nullopt, sink_of(l), attn.data_ptr<float>());
    round.all(attn.data_ptr<float>(), T * q_size);
    h = project(projection(l, 1), attn, biases[l * kBiases + 1], round);

    add_norm(norms[l * kNorms + 1], false);
    h = routers[2 * l].numel() != 0
            ? sparse(l)
            : project(projection(l, 3), gated(projection(l, 2), a), at::Tensor(), round);
  }
  add_norm(final_norm, L == 0);
  return round.bf16 ? a.to(at::kBFloat16) : a;
}

// x [M, K] fp32 @ w [N, K]^T -> [M, N]: a dense projection as the decode step runs it
// (the GEMV up to 4 rows), for tests and benchmarks.
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w) {
  check_fp32(x, "x");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "x and w must be 2-D");
  const at::Tensor none;
  return project(Projection{w, none, none, 0, 0, w.size(0)}, x, none, Round{false});
}

}  // namespace PAGELLM_NS

TORCH_LIBRARY_FRAGMENT(PAGELLM_NS, m) {
  m.def("dense_linear(Tensor x, Tensor w) -> Tensor");
  m.impl("dense_linear", c10::DispatchKey::CPU, &PAGELLM_NS::dense_linear);
  m.def("decode_layers(Tensor x, Tensor positions, Tensor cos_cache, Tensor sin_cache, "
        "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor[] weights, "
        "int[] linear_meta, Tensor[] norms, Tensor[] biases, Tensor[] routers, int[] moe_meta, "
        "Tensor[] kv_caches, "
        "int[] windows, float[] scales, int num_heads, int num_kv_heads, int head_dim, "
        "float eps, Tensor final_norm, Tensor[] sinks, Tensor[] expert_biases, float[] swiglu) "
        "-> Tensor");
  m.impl("decode_layers", c10::DispatchKey::CPU, &PAGELLM_NS::decode_layers);
  // A bf16 model's weights may hold oneDNN's packed copies (opaque MkldnnCPU tensors).
  m.impl("decode_layers", c10::DispatchKey::MkldnnCPU, &PAGELLM_NS::decode_layers);
}

// Weight-only int4/int8 GEMM for the CPU with int8 dot products (kernels/cpu_int_gemm.py).
//
//   y[m, n] = sum_b  s[g(b), n] * xs[m, b] * (sum_{k in b} code[n, k] * a[m, k]
//                                             - z[g(b), n] * sum_{k in b} a[m, k])
//
// over blocks b of 32 input columns inside weight groups g of G (G % 32 == 0), where
// W[n, k] = s[g, n] * (code[n, k] - z[g, n]) (codes unsigned, 4 or 8 bits) and the
// activations are quantized per token and block, x[m, k] ~ xs[m, b] * a[m, k] (a int8,
// symmetric), as llama.cpp quantizes them to Q8_0 for its Q4_0 / Q8_0 dot products. The
// inner sums are exact in int32; only each block's scales are floats.
//
// Weight layout, one tile of 16 output rows (n0 .. n0 + 15) at a time (cpu_int_gemm.py packs it):
//
//   codes  [N / 16, K / 4, 16 * BITS / 2] uint8: for each tile and each 4 input columns
//          (a "quad"), 64 codes c = 4 * row + kk (row 0..15, kk 0..3); 8 bits: byte c is
//          code c; 4 bits: byte c (0..31) holds code c in its low nibble and code c + 32
//          in its high nibble.
//   scales [N / 16, K / G, 16] fp32, zeros [N / 16, K / G, 16] fp32 (zero points in codes)
//
// so one 512-bit register holds a quad of 16 rows: lane r is row r's 4 codes, and
// AVX-512 VNNI's vpdpbusd (unsigned bytes x signed bytes, 4 products summed into each
// int32 lane) adds the 4 products of 16 rows at once against a broadcast of a[m, 4q..4q+3].
// A tile's codes are streamed once per 4 rows of x and stay in L1 between them.
//
// Without AVX-512 VNNI (or on another architecture) the same arithmetic runs as plain
// loops: correct everywhere, fast only with VNNI (cpu_int_gemm.fast_on_this_cpu). The
// tests also build that path on a VNNI CPU: -DPAGELLM_PORTABLE, registered as
// torch.ops.pagellm_cpu_portable (PAGELLM_NS) beside the native torch.ops.pagellm_cpu.

#include "cpu_ops.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    !defined(PAGELLM_PORTABLE)
#include <immintrin.h>
#define PAGELLM_VNNI 1
#else
#define PAGELLM_VNNI 0
#endif

namespace {

#if PAGELLM_VNNI
// acc += 4-byte dot products of u (unsigned) and s (signed) per int32 lane, in place. As
// inline assembly because GCC (13) copied every accumulator through another register
// around _mm512_dpbusd_epi32 in the loops below, twice as many vector instructions as
// dot products, which halved the rate at many rows.
inline void dpbusd(__m512i& acc, __m512i u, __m512i s) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
}
#endif

constexpr int64_t kTile = 16;  // output rows per tile
constexpr int64_t kRowsPerPass = 4;  // rows of x sharing one pass over a tile's codes
constexpr int64_t kBlock = 32;  // input columns per activation scale (llama.cpp's Q8_0)

// x [M, K] fp32 -> a [M, K] int8, xs [M, K / 32] fp32, asum [M, K / 32] int32.
void quantize_activations(const float* x, int64_t M, int64_t K, int8_t* a, float* xs,
                          int32_t* asum) {
  const int64_t blocks = K / kBlock;
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t b = 0; b < blocks; ++b) {
        const float* xb = x + m * K + b * kBlock;
        float amax = 0.f;
        for (int64_t k = 0; k < kBlock; ++k) amax = std::max(amax, std::fabs(xb[k]));
        const float scale = amax > 0.f ? amax / 127.f : 1.f;
        const float inv = 1.f / scale;
        int32_t sum = 0;
        int8_t* ab = a + m * K + b * kBlock;
        for (int64_t k = 0; k < kBlock; ++k) {
          const int32_t q = static_cast<int32_t>(std::nearbyint(xb[k] * inv));
          ab[k] = static_cast<int8_t>(std::min(127, std::max(-127, q)));
          sum += ab[k];
        }
        xs[m * blocks + b] = scale;
        asum[m * blocks + b] = sum;
      }
    }
  });
}

// One tile's 16 outputs for rows m0 .. m0 + ROWS - 1. ROWS is a template argument so
// that the accumulators live in registers (a run-time row count left them on the stack:
// 0.8x fp32 at 32 rows); each row keeps CHAINS independent int32 sums (quads
// round-robin) so that at least 4 dot products are in flight whatever ROWS is
// (vpdpbusd's latency is ~4 cycles).
template <int BITS, int ROWS>
void tile_rows(const uint8_t* codes,  // [K / 4, 8 * BITS]: this tile's
               const float* scales,   // [K / G, 16]: this tile's
               const float* zeros,    // [K / G, 16]: this tile's
               const int8_t* a,       // [M, K]: the quantized activations
               const float* xs,       // [M, K / G]: their steps
               const int32_t* asum,   // [M, K / G]: their sums per group
               int64_t K, int64_t G, int64_t m0,
               float* out) {          // [ROWS, 16]
  constexpr int64_t kQuadBytes = kTile * BITS / 2;
  constexpr int CHAINS = ROWS >= 4 ? 1 : 4 / ROWS;
  // Blocks of 32 input columns, each with its own activation scale, inside weight groups
  // of G (G % 32 == 0): 8 quads a block, whole chains.
  const int64_t blocks = K / kBlock, quads_per_block = kBlock / 4;
  const int64_t blocks_per_group = G / kBlock;
#if PAGELLM_VNNI
  __m512 accf[ROWS];
  for (int r = 0; r < ROWS; ++r) accf[r] = _mm512_setzero_ps();
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  for (int64_t g = 0; g < blocks; ++g) {
    __m512i acci[ROWS][CHAINS];
    for (int r = 0; r < ROWS; ++r) {
      for (int c = 0; c < CHAINS; ++c) acci[r][c] = _mm512_setzero_si512();
    }
    const uint8_t* cg = codes + g * quads_per_block * kQuadBytes;
    for (int64_t q0 = 0; q0 < quads_per_block; q0 += CHAINS) {
      for (int c = 0; c < CHAINS; ++c) {
        const int64_t q = q0 + c;
        __m512i w;
        if constexpr (BITS == 4) {
          const __m256i packed = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(cg + q * kQuadBytes));
          const __m256i lo = _mm256_and_si256(packed, low_nibbles);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibbles);
          w = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        } else {
          w = _mm512_loadu_si512(cg + q * kQuadBytes);
        }
        const int64_t k = g * kBlock + 4 * q;
        for (int r = 0; r < ROWS; ++r) {
          int32_t four;
          std::memcpy(&four, a + (m0 + r) * K + k, 4);
          dpbusd(acci[r][c], w, _mm512_set1_epi32(four));
        }
      }
    }
    const __m512 s = _mm512_loadu_ps(scales + (g / blocks_per_group) * kTile);
    const __m512 z = _mm512_loadu_ps(zeros + (g / blocks_per_group) * kTile);
    for (int r = 0; r < ROWS; ++r) {
      __m512i sum = acci[r][0];
      for (int c = 1; c < CHAINS; ++c) sum = _mm512_add_epi32(sum, acci[r][c]);
      const int64_t mg = (m0 + r) * blocks + g;
      const __m512 centred = _mm512_fnmadd_ps(
          z, _mm512_set1_ps(static_cast<float>(asum[mg])), _mm512_cvtepi32_ps(sum));
      accf[r] = _mm512_fmadd_ps(_mm512_mul_ps(s, _mm512_set1_ps(xs[mg])), centred, accf[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) _mm512_storeu_ps(out + r * kTile, accf[r]);
#else
  (void)CHAINS;
  for (int r = 0; r < ROWS; ++r) {
    for (int64_t lane = 0; lane < kTile; ++lane) out[r * kTile + lane] = 0.f;
  }
  for (int64_t g = 0; g < blocks; ++g) {
    int32_t acci[ROWS][kTile] = {};
    const uint8_t* cg = codes + g * quads_per_block * kQuadBytes;
    for (int64_t q = 0; q < quads_per_block; ++q) {
      uint8_t w[kTile * 4];
      const uint8_t* src = cg + q * kQuadBytes;
      for (int64_t c = 0; c < kQuadBytes; ++c) {
        if constexpr (BITS == 4) {
          w[c] = src[c] & 0x0F;
          w[c + 32] = src[c] >> 4;
        } else {
          w[c] = src[c];
        }
      }
      const int64_t k = g * kBlock + 4 * q;
      for (int r = 0; r < ROWS; ++r) {
        const int8_t* ak = a + (m0 + r) * K + k;
        for (int64_t lane = 0; lane < kTile; ++lane) {
          const uint8_t* wl = w + 4 * lane;
          acci[r][lane] += wl[0] * ak[0] + wl[1] * ak[1] + wl[2] * ak[2] + wl[3] * ak[3];
        }
      }
    }
    const int64_t w = (g / blocks_per_group) * kTile;  // the block's weight group
    for (int r = 0; r < ROWS; ++r) {
      const int64_t mg = (m0 + r) * blocks + g;
      for (int64_t lane = 0; lane < kTile; ++lane) {
        const float centred = static_cast<float>(acci[r][lane]) -
                              zeros[w + lane] * static_cast<float>(asum[mg]);
        out[r * kTile + lane] += scales[w + lane] * xs[mg] * centred;
      }
    }
  }
#endif
}

// tile_rows for a run-time row count (1 .. kRowsPerPass).
template <int BITS>
void tile(int64_t rows, const uint8_t* codes, const float* scales, const float* zeros,
          const int8_t* a, const float* xs, const int32_t* asum, int64_t K, int64_t G,
          int64_t m0, float* out) {  // pointers as tile_rows
  switch (rows) {
    case 1: return tile_rows<BITS, 1>(codes, scales, zeros, a, xs, asum, K, G, m0, out);
    case 2: return tile_rows<BITS, 2>(codes, scales, zeros, a, xs, asum, K, G, m0, out);
    case 3: return tile_rows<BITS, 3>(codes, scales, zeros, a, xs, asum, K, G, m0, out);
    default: return tile_rows<BITS, 4>(codes, scales, zeros, a, xs, asum, K, G, m0, out);
  }
}

// x [M, K] fp32 contiguous; codes [N / 16, K / 4, 8 * BITS] uint8; scales, zeros
// [N / 16, K / G, 16] fp32 -> y [M, out_features] fp32 (out_features <= 16 * tiles: the
// last tile's padding rows are not written).
}  // namespace

namespace PAGELLM_NS {

at::Tensor int_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                    const at::Tensor& zeros, int64_t bits, int64_t group_size,
                    int64_t out_features) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous fp32 [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1), G = group_size;
  TORCH_CHECK(G > 0 && G % kBlock == 0 && K % G == 0, "K ", K,
              " must be a multiple of the group size ", G, ", itself a multiple of 32");
  const int64_t tiles = codes.size(0);
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.size(1) == K / 4 && codes.size(2) == kTile * bits / 2,
              "codes must be contiguous uint8 [N / 16, K / 4, ", kTile * bits / 2, "]");
  for (const at::Tensor* t : {&scales, &zeros}) {
    TORCH_CHECK(t->dim() == 3 && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    t->size(0) == tiles && t->size(1) == K / G && t->size(2) == kTile,
                "scales and zeros must be contiguous fp32 [N / 16, K / G, 16]");
  }
  TORCH_CHECK(out_features > (tiles - 1) * kTile && out_features <= tiles * kTile,
              "out_features ", out_features, " does not fit ", tiles, " tiles of 16 rows");
  at::Tensor y = at::empty({M, out_features}, x.options());
  if (M == 0) return y;
  at::Tensor a = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor xs = at::empty({M, K / kBlock}, x.options());
  at::Tensor asum = at::empty({M, K / kBlock}, x.options().dtype(at::kInt));
  quantize_activations(x.data_ptr<float>(), M, K, a.data_ptr<int8_t>(), xs.data_ptr<float>(),
                       asum.data_ptr<int32_t>());
  const int8_t* a_ptr = a.data_ptr<int8_t>();
  const float* xs_ptr = xs.data_ptr<float>();
  const int32_t* asum_ptr = asum.data_ptr<int32_t>();
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  const float* z = zeros.data_ptr<float>();
  float* out = y.data_ptr<float>();
  const int64_t tile_bytes = (K / 4) * kTile * bits / 2, tile_groups = (K / G) * kTile;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    float buf[kRowsPerPass * kTile];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t width = std::min(kTile, out_features - t * kTile);
      for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass) {
        const int64_t rows = std::min(kRowsPerPass, M - m0);
        const auto run = bits == 4 ? tile<4> : tile<8>;
        run(rows, c + t * tile_bytes, s + t * tile_groups, z + t * tile_groups, a_ptr, xs_ptr,
            asum_ptr, K, G, m0, buf);
        for (int64_t r = 0; r < rows; ++r) {
          std::memcpy(out + (m0 + r) * out_features + t * kTile, buf + r * kTile,
                      width * sizeof(float));
        }
      }
    }
  });
  return y;
}

}  // namespace PAGELLM_NS

namespace {

bool vnni() { return PAGELLM_VNNI; }

}  // namespace

#define PAGELLM_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)  // expands PAGELLM_NS first

PAGELLM_LIBRARY(PAGELLM_NS, m) {
  m.def("int_gemm(Tensor x, Tensor codes, Tensor scales, Tensor zeros, int bits, "
        "int group_size, int out_features) -> Tensor");
  m.impl("int_gemm", c10::DispatchKey::CPU, &PAGELLM_NS::int_gemm);
  m.def("vnni() -> bool", &vnni);
}

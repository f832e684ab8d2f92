// Weight-only int4/int8 GEMM for the CPU with int8 dot products (kernels/cpu_int_gemm.py).
//
//   y[m, n] = sum_g s[g, n] * (sum_{b in g} xs[m, b] * sum_{k in b} code[n, k] * a[m, k]
//                              - z[g, n] * zc[m, g]),  zc[m, g] = sum_{b in g} xs[m, b] * asum[m, b]
//
// over weight groups g of G input columns and the blocks b of 32 inside them (G % 32 ==
// 0), where W[n, k] = s[g, n] * (code[n, k] - z[g, n]) (codes unsigned, 4 or 8 bits) and
// the activations are quantized per token and block, x[m, k] ~ xs[m, b] * a[m, k] (a
// int8, symmetric, asum[m, b] its block's sum), as llama.cpp quantizes them to Q8_0 for
// its Q4_0 / Q8_0 dot products. The inner sums are exact in int32; only each block's
// scales are floats. The zero points' term is folded per group (zc), once per group and
// not per block.
//
// Weight layout, one tile of 16 output rows (n0 .. n0 + 15) at a time (cpu_int_gemm.py packs it):
//
//   codes  [N / 16, K / 4, 16 * BITS / 2] uint8: for each tile and each 4 input columns
//          (a "quad"), 64 codes c = 4 * row + kk (row 0..15, kk 0..3); 8 bits: byte c of
//          quad q is code c; 4 bits: the 64 bytes of a pair of quads (2p, 2p + 1) hold
//          quad 2p's code c in byte c's low nibble and quad 2p + 1's in its high nibble.
//   scales [N / 16, K / G, 16] fp32, zeros [N / 16, K / G, 16] fp32 (zero points in codes)
//
// so one 512-bit register holds a quad of 16 rows (4 bits: one load, one AND, and one
// shift and AND give two quads): lane r is row r's 4 codes, and AVX-512 VNNI's vpdpbusd
// (unsigned bytes x signed bytes, 4 products summed into each int32 lane) adds the 4
// products of 16 rows at once against a[m, 4q..4q+3] broadcast to every lane. The
// register block is kRows rows of x by kPair tiles: each loaded quad of codes serves
// kRows rows, each broadcast activation kPair tiles (one broadcast into a register, two
// dot products from it: with the broadcast folded into each dot product's memory operand
// instead, twice the loads, the block ran 0.83-0.89x at 2048 rows).
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
// acc += per int32 lane, the dot product of w's 4 unsigned bytes with the 4 signed bytes
// at a (broadcast to every lane by the instruction: {1to16}). As inline assembly because
// GCC (13) copied every accumulator through another register around
// _mm512_dpbusd_epi32, twice as many vector instructions as dot products.
inline void dpbusd(__m512i& acc, __m512i w, const int8_t* a) {
  asm("vpdpbusd %2%{1to16%}, %1, %0"
      : "+v"(acc)
      : "v"(w), "m"(*reinterpret_cast<const int32_t*>(a)));
}

// The same with the 4 activation bytes already broadcast into a register (`broadcast`).
inline void dpbusd(__m512i& acc, __m512i w, __m512i a) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(a));
}

inline __m512i broadcast(const int8_t* a) {
  return _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(a));
}
#endif

// A cache line into L2 (a no-op where there is no such instruction).
inline void prefetch(const uint8_t* p) { __builtin_prefetch(p, 0, 2); }

constexpr int64_t kTile = 16;  // output rows per tile
static_assert(kTile == 16, "cpu_ops.h's pairs_gate_and_up counts tiles of 16 rows");
// Rows of x per register block: at 6 the 12 fp32 sums no longer fitted beside the int32
// ones, the broadcasts and the codes (GCC spilled them to the stack); 5 ran 1.05-1.08x
// faster at 2048 rows, 4 rows (by 2 or 3 tiles) within noise of 6.
constexpr int64_t kRows = 5;
constexpr int64_t kPair = 2;  // tiles per register block
constexpr int64_t kStreamed = 16 << 20;  // codes bytes above which tiles go one by one,
constexpr int64_t kPairedRows = 20;      // unless x has this many rows


constexpr int64_t kBlock = 32;  // input columns per activation scale (llama.cpp's Q8_0)

// The quantized activations of x [M, K] (quantize).
struct Activations {
  const int8_t* a;   // [M, K]
  const float* xs;   // [M, K / 32]: each block's step
  const float* zc;   // [M, K / G]: sum over the group's blocks of step * (sum of codes)
  int64_t K, blocks, groups;
};

// One row x [K] fp32 -> a [K] int8, xs [K / 32], zc [K / G] (Activations). Both builds
// compute the same values: the step is max |x| / 127 (1 for an all-zero block), the codes
// x * (1 / step) rounded half to even and clamped to +-127.
void quantize_row(const float* x, int64_t K, int64_t G, int8_t* a, float* xs, float* zc) {
  const int64_t per_group = G / kBlock;
  for (int64_t g = 0; g < K / G; ++g) {
    float corr = 0.f;
    for (int64_t j = 0; j < per_group; ++j) {
      const int64_t b = g * per_group + j;
      const float* xb = x + b * kBlock;
      int8_t* ab = a + b * kBlock;
#if PAGELLM_VNNI
      const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
      const float amax =
          _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
#else
      float amax = 0.f;
      for (int64_t k = 0; k < kBlock; ++k) amax = std::max(amax, std::fabs(xb[k]));
#endif
      const float step = amax > 0.f ? amax / 127.f : 1.f;
      const float inv = 1.f / step;
      int32_t sum = 0;
#if PAGELLM_VNNI
      const __m512 vinv = _mm512_set1_ps(inv);
      const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
      // (cvtps rounds half to even, as nearbyint in the default rounding mode)
      const __m512i q0 = _mm512_min_epi32(
          _mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v0, vinv)), lo), hi);
      const __m512i q1 = _mm512_min_epi32(
          _mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v1, vinv)), lo), hi);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(ab), _mm512_cvtepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(ab + 16), _mm512_cvtepi32_epi8(q1));
      sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#else
      for (int64_t k = 0; k < kBlock; ++k) {
        const int32_t q = static_cast<int32_t>(std::nearbyint(xb[k] * inv));
        ab[k] = static_cast<int8_t>(std::min(127, std::max(-127, q)));
        sum += ab[k];
      }
#endif
      xs[b] = step;
      corr += step * static_cast<float>(sum);
    }
    zc[g] = corr;
  }
}

// y[m0 .. m0 + R - 1, the NT tiles' rows] for R rows of x and NT tiles of W (the register
// block). R and NT are template arguments so that the accumulators live in registers;
// with few rows each (row, tile) keeps C independent int32 sums (quads round-robin) so
// that enough dot products are in flight (vpdpbusd's latency is ~4 cycles).
template <int BITS, int R, int NT>
void block(const uint8_t* codes, int64_t tile_bytes,   // the first tile's; the next ones'
                                                       // tile_bytes further each
           const float* scales, const float* zeros,    // the first tile's [K / G, 16]
           int64_t tile_groups,                        // floats between tiles' scales
           const Activations& act, int64_t G, int64_t m0,
           float* y, int64_t ldy, int64_t last_width) {  // y: row m0's first output;
                                                         // last_width: the last tile's rows
  constexpr int C = R * NT >= 8 ? 1 : (R * NT >= 4 ? 2 : 4);
  constexpr int64_t kQuadBytes = kTile * BITS / 2;  // 64 (8 bits) or 32 (4 bits)
  const int64_t K = act.K, per_group = G / kBlock;
#if PAGELLM_VNNI
  __m512 accf[R][NT];
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < NT; ++t) accf[r][t] = _mm512_setzero_ps();
  }
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < act.groups; ++g) {
    __m512 s[NT];
    for (int t = 0; t < NT; ++t) s[t] = _mm512_loadu_ps(scales + t * tile_groups + g * kTile);
    for (int64_t j = 0; j < per_group; ++j) {
      const int64_t b = g * per_group + j, k0 = b * kBlock;
      __m512i acc[R][NT][C];
      for (int r = 0; r < R; ++r) {
        for (int t = 0; t < NT; ++t) {
          for (int c = 0; c < C; ++c) acc[r][t][c] = _mm512_setzero_si512();
        }
      }
      const uint8_t* cb = codes + k0 / 4 * kQuadBytes;  // this block's 8 quads
      const int8_t* ab = act.a + m0 * K + k0;
      // (Unrolled so that acc[r][t][q % C] is a register: as a loop GCC kept the sums on
      // the stack, 0.4x the speed.)
      if constexpr (BITS == 8) {
#pragma GCC unroll 8
        for (int q = 0; q < 8; ++q) {
          __m512i w[NT];
          for (int t = 0; t < NT; ++t) w[t] = _mm512_loadu_si512(cb + t * tile_bytes + q * 64);
          for (int r = 0; r < R; ++r) {
            if constexpr (NT > 1) {
              const __m512i a = broadcast(ab + r * K + 4 * q);
              for (int t = 0; t < NT; ++t) dpbusd(acc[r][t][q % C], w[t], a);
            } else {  // (one use: the dot product's own broadcast saves the register)
              dpbusd(acc[r][0][q % C], w[0], ab + r * K + 4 * q);
            }
          }
        }
      } else {
#pragma GCC unroll 4
        for (int p = 0; p < 4; ++p) {  // pairs of quads, 64 bytes each
          __m512i lo[NT], hi[NT];
          for (int t = 0; t < NT; ++t) {
            const __m512i packed = _mm512_loadu_si512(cb + t * tile_bytes + p * 64);
            lo[t] = _mm512_and_si512(packed, low_nibbles);
            hi[t] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibbles);
          }
          for (int r = 0; r < R; ++r) {
            if constexpr (NT > 1) {
              const __m512i a0 = broadcast(ab + r * K + 8 * p);
              const __m512i a1 = broadcast(ab + r * K + 8 * p + 4);
              for (int t = 0; t < NT; ++t) {
                dpbusd(acc[r][t][(2 * p) % C], lo[t], a0);
                dpbusd(acc[r][t][(2 * p + 1) % C], hi[t], a1);
              }
            } else {
              dpbusd(acc[r][0][(2 * p) % C], lo[0], ab + r * K + 8 * p);
              dpbusd(acc[r][0][(2 * p + 1) % C], hi[0], ab + r * K + 8 * p + 4);
            }
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m512 step = _mm512_set1_ps(act.xs[(m0 + r) * act.blocks + b]);
        for (int t = 0; t < NT; ++t) {
          __m512i sum = acc[r][t][0];
          for (int c = 1; c < C; ++c) sum = _mm512_add_epi32(sum, acc[r][t][c]);
          accf[r][t] = _mm512_fmadd_ps(_mm512_mul_ps(s[t], step), _mm512_cvtepi32_ps(sum),
                                       accf[r][t]);
        }
      }
    }
    for (int t = 0; t < NT; ++t) {
      const __m512 sz = _mm512_mul_ps(s[t], _mm512_loadu_ps(zeros + t * tile_groups + g * kTile));
      for (int r = 0; r < R; ++r) {
        accf[r][t] = _mm512_fnmadd_ps(sz, _mm512_set1_ps(act.zc[(m0 + r) * act.groups + g]),
                                      accf[r][t]);
      }
    }
  }
  const __mmask16 last = static_cast<__mmask16>((1u << last_width) - 1);
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < NT; ++t) {
      float* out = y + r * ldy + t * kTile;
      if (t == NT - 1 && last_width < kTile) {
        _mm512_mask_storeu_ps(out, last, accf[r][t]);
      } else {
        _mm512_storeu_ps(out, accf[r][t]);
      }
    }
  }
#else
  (void)C;
  for (int t = 0; t < NT; ++t) {
    const uint8_t* ct = codes + t * tile_bytes;
    const float* st = scales + t * tile_groups;
    const float* zt = zeros + t * tile_groups;
    const int64_t width = t == NT - 1 ? last_width : kTile;
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      float accf[kTile] = {};
      for (int64_t g = 0; g < act.groups; ++g) {
        for (int64_t j = 0; j < per_group; ++j) {
          const int64_t b = g * per_group + j;
          int32_t acc[kTile] = {};
          for (int64_t q = 0; q < kBlock / 4; ++q) {
            const int64_t quad = b * kBlock / 4 + q;  // 4 bits: pairs share 64 bytes
            for (int64_t lane = 0; lane < kTile; ++lane) {
              for (int64_t kk = 0; kk < 4; ++kk) {
                const int64_t c = 4 * lane + kk;
                int32_t code;
                if constexpr (BITS == 4) {
                  const uint8_t byte = ct[quad / 2 * 64 + c];
                  code = quad % 2 ? byte >> 4 : byte & 0x0F;
                } else {
                  code = ct[quad * 64 + c];
                }
                acc[lane] += code * act.a[m * K + 4 * quad + kk];
              }
            }
          }
          const float step = act.xs[m * act.blocks + b];
          for (int64_t lane = 0; lane < kTile; ++lane) {
            accf[lane] += st[g * kTile + lane] * step * static_cast<float>(acc[lane]);
          }
        }
        for (int64_t lane = 0; lane < kTile; ++lane) {
          accf[lane] -= st[g * kTile + lane] * zt[g * kTile + lane] * act.zc[m * act.groups + g];
        }
      }
      std::memcpy(y + r * ldy + t * kTile, accf, width * sizeof(float));
    }
  }
#endif
}

// block<BITS, R, NT> for run-time counts (1 .. kRows rows, 1 .. kPair tiles).
template <int BITS>
void run_block(int64_t rows, int64_t tiles, const uint8_t* codes, int64_t tile_bytes,
               const float* scales, const float* zeros, int64_t tile_groups,
               const Activations& act, int64_t G, int64_t m0, float* y, int64_t ldy,
               int64_t last_width) {  // arguments as block's
#define PAGELLM_BLOCK(R, NT)                                                               \
  return block<BITS, R, NT>(codes, tile_bytes, scales, zeros, tile_groups, act, G, m0, y, \
                            ldy, last_width)
  if (tiles == kPair) {
    switch (rows) {
      case 1: PAGELLM_BLOCK(1, 2);
      case 2: PAGELLM_BLOCK(2, 2);
      case 3: PAGELLM_BLOCK(3, 2);
      case 4: PAGELLM_BLOCK(4, 2);
      default: PAGELLM_BLOCK(5, 2);
    }
  }
  switch (rows) {
    case 1: PAGELLM_BLOCK(1, 1);
    case 2: PAGELLM_BLOCK(2, 1);
    case 3: PAGELLM_BLOCK(3, 1);
    case 4: PAGELLM_BLOCK(4, 1);
    default: PAGELLM_BLOCK(5, 1);
  }
#undef PAGELLM_BLOCK
}

// int_gemm's operands, checked (x [M, K] fp32 contiguous; codes [N / 16, K / 4, 8 * BITS]
// uint8; scales, zeros [N / 16, K / G, 16] fp32; out_features <= 16 * tiles).
struct Operands {
  int64_t M, K, G, tiles, tile_bytes, tile_groups;
  const uint8_t* codes;
  const float* scales;
  const float* zeros;
};

Operands check(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
               const at::Tensor& zeros, int64_t bits, int64_t group_size, int64_t out_features) {
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
  return {M, K, G, tiles, (K / 4) * kTile * bits / 2, (K / G) * kTile,
          codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), zeros.data_ptr<float>()};
}

// x's rows quantized (quantize_row) into a, xs and zc, which must outlive the result.
Activations quantize(const at::Tensor& x, int64_t G, at::Tensor& a, at::Tensor& xs,
                     at::Tensor& zc) {
  const int64_t M = x.size(0), K = x.size(1);
  a = at::empty({M, K}, x.options().dtype(at::kChar));
  xs = at::empty({M, K / kBlock}, x.options());
  zc = at::empty({M, K / G}, x.options());
  const float* x_ptr = x.data_ptr<float>();
  int8_t* a_ptr = a.data_ptr<int8_t>();
  float* xs_ptr = xs.data_ptr<float>();
  float* zc_ptr = zc.data_ptr<float>();
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      quantize_row(x_ptr + m * K, K, G, a_ptr + m * K, xs_ptr + m * (K / kBlock),
                   zc_ptr + m * (K / G));
    }
  });
  return {a_ptr, xs_ptr, zc_ptr, K, K / kBlock, K / G};
}

// A call's checked operands, x's rows quantized (a, xs and zc hold them for the call)
// and the register blocks for its bits: what int_gemm and int_gemm_silu_and_mul share.
struct Prepared {
  Operands w;
  at::Tensor a, xs, zc;
  Activations act;
  decltype(&run_block<8>) run;
};

Prepared prepare(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                 const at::Tensor& zeros, int64_t bits, int64_t group_size,
                 int64_t out_features) {
  const Operands w = check(x, codes, scales, zeros, bits, group_size, out_features);
  at::Tensor a, xs, zc;
  const Activations act = quantize(x, w.G, a, xs, zc);
  return {w, a, xs, zc, act, bits == 4 ? run_block<4> : run_block<8>};
}

// Runs `block(m0, rows)` for the register blocks down the M rows of x (kRows at a time)
// over one group of tiles, first asking for `next`'s `lines` cache lines (the next
// group's codes: in a decode step they come from memory, 1.1-1.3x on an LM head at 48
// rows) into L2 in equal shares over the passes.
template <typename Block>
void down_the_rows(int64_t M, const uint8_t* const* next, int64_t streams, int64_t lines,
                   Block&& block) {
  const int64_t passes = (M + kRows - 1) / kRows, share = (lines + passes - 1) / passes;
  for (int64_t m0 = 0; m0 < M; m0 += kRows) {
    const int64_t first = m0 / kRows * share;
    for (int64_t l = first; l < std::min(lines, first + share); ++l) {
      for (int64_t i = 0; i < streams; ++i) prefetch(next[i] + l * 64);
    }
    block(m0, std::min(kRows, M - m0));
  }
}

}  // namespace

namespace PAGELLM_NS {

// x [M, K] fp32 contiguous; codes [N / 16, K / 4, 8 * BITS] uint8; scales, zeros
// [N / 16, K / G, 16] fp32 -> y [M, out_features] fp32 (out_features <= 16 * tiles: the
// last tile's padding rows are not written).
at::Tensor int_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                    const at::Tensor& zeros, int64_t bits, int64_t group_size,
                    int64_t out_features) {
  const Prepared c = prepare(x, codes, scales, zeros, bits, group_size, out_features);
  const Operands& w = c.w;
  const int64_t M = w.M, tiles = w.tiles, tile_bytes = w.tile_bytes;
  at::Tensor y = at::empty({M, out_features}, x.options());
  if (M == 0) return y;
  float* out = y.data_ptr<float>();
  // One tile at a time for one or two rows (memory bound: one stream of codes) and, below
  // kPairedRows rows, for weights far larger than the caches (an LM head's int8 copy:
  // tile pairs in two streams from memory ran 0.91-0.98x at 8-16 rows, 1.27-1.31x at
  // 48); pairs otherwise (1.1-1.6x).
  const bool streamed = M <= 2 || (tiles * tile_bytes > kStreamed && M < kPairedRows);
  const int64_t pair = streamed ? 1 : kPair;
  // Each thread takes a run of tiles, a pair at a time through all rows of x: the pair's
  // codes stay in L1 while x's rows stream past them (rows in chunks that fit L2 instead
  // measured slower: 0.9x at 512 rows).
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t += pair) {
      const int64_t nt = std::min(pair, end - t);
      const int64_t last_width = std::min(kTile, out_features - (t + nt - 1) * kTile);
      // (Not for one or two rows, whose one stream of codes the hardware's prefetcher
      // follows.)
      const int64_t lines =
          t + nt < end && M > 2 ? std::min(pair, end - t - nt) * tile_bytes / 64 : 0;
      const uint8_t* next = w.codes + (t + nt) * tile_bytes;
      down_the_rows(M, &next, 1, lines, [&](int64_t m0, int64_t rows) {
        c.run(rows, nt, w.codes + t * tile_bytes, tile_bytes, w.scales + t * w.tile_groups,
              w.zeros + t * w.tile_groups, w.tile_groups, c.act, w.G, m0,
              out + m0 * out_features + t * kTile, out_features, last_width);
      });
    }
  });
  return y;
}

// A gated MLP's gate_up projection and its activation in one pass: x [M, K] @ W^T for
// W = [gate | up] [2 I, K] (I a multiple of 16) -> F.silu(gate) * up [M, I] fp32, bit
// for bit what int_gemm and then silu_and_mul_row give. A register block takes gate tile
// p with up tile p (tiles I / 16 apart, where int_gemm's blocks take neighbours), so a
// block's two halves are one 16-wide slice of both, which `silu_and_mul_row` combines
// while they are in L1: no [M, 2 I] product written to memory and read back, one parallel
// region less.
at::Tensor int_gemm_silu_and_mul(const at::Tensor& x, const at::Tensor& codes,
                                 const at::Tensor& scales, const at::Tensor& zeros,
                                 int64_t bits, int64_t group_size, int64_t out_features) {
  TORCH_CHECK(pairs_gate_and_up(out_features), "a fused gate_up projection needs 2 x a "
              "multiple of 16 output rows, got ", out_features);
  const Prepared c = prepare(x, codes, scales, zeros, bits, group_size, out_features);
  const Operands& w = c.w;
  const int64_t M = w.M, I = out_features / 2, half = I / kTile;
  at::Tensor y = at::empty({M, I}, x.options());
  if (M == 0) return y;
  float* out = y.data_ptr<float>();
  const int64_t apart = half * w.tile_bytes, groups_apart = half * w.tile_groups;
  at::parallel_for(0, half, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* next[2] = {w.codes + (p + 1) * w.tile_bytes,
                                w.codes + (p + 1) * w.tile_bytes + apart};
      const int64_t lines = p + 1 < end && M > 2 ? w.tile_bytes / 64 : 0;
      down_the_rows(M, next, 2, lines, [&](int64_t m0, int64_t rows) {
        float both[kRows * 2 * kTile];  // [rows, gate's 16 | up's 16]
        c.run(rows, 2, w.codes + p * w.tile_bytes, apart, w.scales + p * w.tile_groups,
              w.zeros + p * w.tile_groups, groups_apart, c.act, w.G, m0, both, 2 * kTile, kTile);
        for (int64_t r = 0; r < rows; ++r)
          silu_and_mul_row(both + r * 2 * kTile, both + r * 2 * kTile + kTile,
                           out + (m0 + r) * I + p * kTile, kTile, false);
      });
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
  m.def("int_gemm_silu_and_mul(Tensor x, Tensor codes, Tensor scales, Tensor zeros, int bits, "
        "int group_size, int out_features) -> Tensor");
  m.impl("int_gemm_silu_and_mul", c10::DispatchKey::CPU, &PAGELLM_NS::int_gemm_silu_and_mul);
  m.def("vnni() -> bool", &vnni);
}

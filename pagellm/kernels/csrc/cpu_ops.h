// What pagellm's C++ CPU ops share across their files (kernels/cpu_ops.py builds them
// into one library): the op namespace and the int kernel's and the bf16 GEMV's entry
// points, which the fused decode step (cpu_decode.cpp) calls for its projections.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>

// torch.ops.<PAGELLM_NS>: pagellm_cpu, or pagellm_cpu_portable for the plain-loop build
// the tests load beside the native one (-DPAGELLM_PORTABLE -DPAGELLM_NS=...). The C++
// functions live in a namespace of the same name, so the two libraries never share a
// symbol.
#ifndef PAGELLM_NS
#define PAGELLM_NS pagellm_cpu
#endif

namespace PAGELLM_NS {

// x [M, K] fp32 @ W^T -> [M, out_features] fp32, W in the int kernel's tiled layout
// (cpu_int_gemm.cpp's header).
at::Tensor int_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                    const at::Tensor& zeros, int64_t bits, int64_t group_size,
                    int64_t out_features);

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

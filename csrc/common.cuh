// Shared helpers for the angle_kernels CUDA kernels.
//
// Everything in csrc/*.cu is plain CUDA C++: no torch, c10 or ATen headers, so every kernel file can be
// compiled (and register-checked with -Xptxas -v) by nvcc alone on a machine without CUDA torch.
// The torch bindings (csrc/<op>.cpp, one per op) are the only files that see tensors.
//
// Conventions shared by all kernels:
//   * Element types: float, double, __half, __nv_bfloat16 inputs. The accumulation ("compute") type is
//     double for double inputs and float for everything else (AccType below).
//   * Sizes, strides and flat indices are int64_t: a [2N, D] input with N * D > 2^31 must not overflow.
//   * Norms follow F.normalize: |x| is replaced by max(|x|, kNormEps), and the derivative of the norm is
//     dropped where the clamp is active (the clamp is flat there).
//   * Row scaling: finite rows can have squared norms and dot products beyond the compute type (float rows
//     around 1.8e19, double around 1.3e154). Cosines are invariant under a positive scaling of either row, so
//     the kernels compute on x_s = s x with one power of two per row: s = 1 for rows whose largest magnitude is
//     below 2 (bit for bit the unscaled computation), else 2^-floor(log2 max|x|) (the rule of the Triton and
//     torch backends: angle_kernels/torch_ops/common.py). Exact: |x| = |x_s| / s, the clamp becomes
//     max(|x_s|, eps s), and dL/dx = s dL/dx_s. A kernel that reads a row in pieces finds s online: a running
//     exponent, with the sums of the pieces before multiplied by 2^(old - new) when a later piece raises it.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "launcher_types.h"  // acc_t and the launchers' parameter types, shared with the bindings

namespace angle_kernels {

constexpr double kNormEps = 1e-12;  // F.normalize's default epsilon
constexpr int kWarpSize = 32;

// ---- conversions ----------------------------------------------------------------------------------------
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename acc, typename scalar_t>
__device__ __forceinline__ acc load_as(const scalar_t* p) {
  return static_cast<acc>(to_float(*p));
}
template <>
__device__ __forceinline__ double load_as<double, double>(const double* p) {
  return *p;
}

template <typename scalar_t>
__device__ __forceinline__ scalar_t from_acc(float x);
template <>
__device__ __forceinline__ float from_acc<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_acc<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <typename scalar_t>
__device__ __forceinline__ scalar_t from_acc(double x);
template <>
__device__ __forceinline__ double from_acc<double>(double x) { return x; }

// ---- math in the compute type (explicit overloads: no reliance on implicit float->double promotion) ----
__device__ __forceinline__ float exp_acc(float x) { return expf(x); }
__device__ __forceinline__ double exp_acc(double x) { return exp(x); }
__device__ __forceinline__ float log_acc(float x) { return logf(x); }
__device__ __forceinline__ double log_acc(double x) { return log(x); }
__device__ __forceinline__ float sqrt_acc(float x) { return sqrtf(x); }
__device__ __forceinline__ double sqrt_acc(double x) { return sqrt(x); }
__device__ __forceinline__ float max_acc(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double max_acc(double a, double b) { return fmax(a, b); }
__device__ __forceinline__ float abs_acc(float x) { return fabsf(x); }
__device__ __forceinline__ double abs_acc(double x) { return fabs(x); }

template <typename acc>
__device__ __forceinline__ acc neg_inf() {
  return -static_cast<acc>(INFINITY);
}

// ---- row scaling (see the conventions above) ------------------------------------------------------------
// max(0, floor(log2(largest))) for largest >= 0, read from the bits (exact), at most bias - 1 so that the scale
// 2^-exponent stays a normal number.
__device__ __forceinline__ int row_exponent(float largest) {
  const int e = ((__float_as_int(largest) >> 23) & 0xFF) - 127;
  return min(max(e, 0), 126);
}
__device__ __forceinline__ int row_exponent(double largest) {
  const int e = static_cast<int>((__double_as_longlong(largest) >> 52) & 0x7FF) - 1023;
  return min(max(e, 0), 1022);
}
// 2^e for an integer e <= bias - 1, built from its bits (exact); 0 below the normal range.
template <typename acc>
__device__ __forceinline__ acc pow2(int e);
template <>
__device__ __forceinline__ float pow2<float>(int e) {
  return __int_as_float(max(e + 127, 0) << 23);
}
template <>
__device__ __forceinline__ double pow2<double>(int e) {
  return __longlong_as_double(static_cast<long long>(max(e + 1023, 0)) << 52);
}
// The clamp of a row scaled by `scale`: kNormEps * scale, floored at the smallest normal number (so that a zero
// part of a huge row divides by a positive number).
template <typename acc>
__device__ __forceinline__ acc scaled_eps(acc scale) {
  const acc tiny = sizeof(acc) == sizeof(double) ? static_cast<acc>(2.2250738585072014e-308)
                                                 : static_cast<acc>(1.1754943508222875e-38f);
  return max_acc(scale * static_cast<acc>(kNormEps), tiny);
}
// Online step of a running exponent: raises it to cover a piece whose largest magnitude is `largest`; returns
// the factor 2^(old - new) <= 1 that brings what was summed at the old scale to the new one (1 if unchanged).
template <typename acc>
__device__ __forceinline__ acc raise_exponent(int* exponent, acc largest) {
  const int raised = max(*exponent, row_exponent(largest));
  if (raised == *exponent) return acc(1);
  const acc factor = pow2<acc>(*exponent - raised);
  *exponent = raised;
  return factor;
}

// 1 / max(|x|, eps): the factor that turns a raw dot product into a cosine. With `scale`, the norm is that of
// the scaled row s x: 1 / max(|x_s|, eps s), for dot products of scaled rows.
template <typename acc>
__device__ __forceinline__ acc inv_clamped_norm(acc norm) {
  return acc(1) / max_acc(norm, static_cast<acc>(kNormEps));
}
template <typename acc>
__device__ __forceinline__ acc inv_clamped_norm(acc norm, acc scale) {
  return acc(1) / max_acc(norm, scaled_eps(scale));
}
// 1 / |x|^2 where the norm is not clamped, else 0: the weight of the norm-derivative term (with `scale`: of the
// scaled row, 1 / |x_s|^2 where |x_s| > eps s).
template <typename acc>
__device__ __forceinline__ acc inv_sq_norm_or_zero(acc norm) {
  return norm > static_cast<acc>(kNormEps) ? acc(1) / (norm * norm) : acc(0);
}
template <typename acc>
__device__ __forceinline__ acc inv_sq_norm_or_zero(acc norm, acc scale) {
  return norm > scaled_eps(scale) ? acc(1) / (norm * norm) : acc(0);
}

// ---- warp reductions ----------------------------------------------------------------------------------
template <typename acc>
__device__ __forceinline__ acc warp_sum(acc v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}
__device__ __forceinline__ int warp_max(int v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v = max(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// ---- online logsumexp state: (running max m, sum of exp(x - m)) ---------------------------------------
template <typename acc>
struct OnlineLse {
  acc max;
  acc sum;
  __device__ __forceinline__ void init() {
    max = neg_inf<acc>();
    sum = acc(0);
  }
  __device__ __forceinline__ void add(acc x) {
    if (x > max) {
      // exp(-inf - x) == 0, so the first element rescales the empty sum to 0 correctly.
      sum = sum * exp_acc(max - x) + acc(1);
      max = x;
    } else {
      sum += exp_acc(x - max);
    }
  }
  __device__ __forceinline__ void merge(acc other_max, acc other_sum) {
    const acc m = max_acc(max, other_max);
    if (m == neg_inf<acc>()) return;  // both empty: avoid exp(-inf - -inf) = NaN
    sum = sum * exp_acc(max - m) + other_sum * exp_acc(other_max - m);
    max = m;
  }
  // Merge with the states held by the other `width` lanes of an aligned lane group (width: power of 2).
  __device__ __forceinline__ void merge_lanes(int width) {
    for (int offset = width / 2; offset > 0; offset /= 2) {
      const acc other_max = __shfl_xor_sync(0xffffffffu, max, offset);
      const acc other_sum = __shfl_xor_sync(0xffffffffu, sum, offset);
      merge(other_max, other_sum);
    }
  }
  __device__ __forceinline__ acc value() const { return sum > acc(0) ? max + log_acc(sum) : neg_inf<acc>(); }
};

}  // namespace angle_kernels

// Pair scores: the cosine and the sum-pooled "angle" score of every (anchor, other) pair.
//
// What it computes (the contract in angle_kernels/dispatch.py):
//   x is [G, K, D] (any strides). For group g the anchor is u = x[g, 0] and the pairs are (u, v = x[g, k]),
//   k = 1 .. K-1. With P = max(|u|, eps) * max(|v|, eps), and a, b (c, d) the first and second halves of u (v):
//     cos[g, k-1]   = u.v / P
//     angle[g, k-1] = (u.v + b.c - a.d) / P          (= cos + w with w = (b.c - a.d) / P)
//   with_angle = false: angle is all zeros and D may be odd.
//   Backward, with gs = grad_cos + grad_angle and ga = grad_angle:
//     du = [gs v + ga (-d, c)] / P - [gs cos + ga w] u / |u|^2
//     dv = [gs u + ga (b, -a)] / P - [gs cos + ga w] v / |v|^2
//   where the |.|^2 term is dropped for a norm clamped to eps; the anchor sums du over its K-1 pairs.
//
// The floor: forward reads x once (G*K*D elements) and writes 2*G*(K-1) scores plus 4 saved scalars per
// pair; backward reads x once and writes dx once (G*K*D each). Both are memory bound: a handful of FLOPs
// per element. (The forward kernel below gives each pair its own warp, so for K > 2 the anchor row is read
// K-1 times; those re-reads are of the same row within a few microseconds and come from L2.)
//
// Saved per pair (stats[g, k-1, 0..5]): |u_s|, |v_s|, cos, w, s_u, s_v, with u_s = s_u u the rows scaled by their
// powers of two (common.cuh, row scaling: 1 for ordinary rows). The backward needs nothing else from the forward.
//
// Huge rows: each lane keeps a running scale exponent per row (its elements may raise it; its partial sums are
// then rescaled), the warp agrees on the largest before its reductions, and the formulas above run on the scaled
// rows: backward multiplies each loaded element by its row's scale and each gradient element by it again
// (dL/dx = s dL/dx_s). Extra per element: an abs, a max and a multiply forward, two multiplies backward.

#include "common.cuh"

namespace angle_kernels {

constexpr int kPairScoresThreads = 256;  // 8 warps per block
constexpr int kPairScoresWarps = kPairScoresThreads / kWarpSize;
constexpr int kPairStats = 6;  // |u_s|, |v_s|, cos, w, s_u, s_v
constexpr int kPairCoefs = 5;  // the backward's per-pair coefficients in shared memory: alpha, beta, gamma_u, gamma_v, s_v

// ---------------------------------------------------------------------------------------------------------
// Forward: one warp per pair. Each lane walks D (or D/2 element pairs when the angle is needed) with a
// stride of 32, accumulating |u|^2, |v|^2, u.v and b.c - a.d in the compute type; one warp reduction each.
// ---------------------------------------------------------------------------------------------------------
template <typename scalar_t>
__global__ void __launch_bounds__(kPairScoresThreads)
    _pair_scores_fwd_kernel(const scalar_t* __restrict__ x, int64_t num_groups, int64_t group_size, int64_t dim,
                            int64_t stride_g, int64_t stride_k, int64_t stride_d, bool with_angle,
                            acc_t<scalar_t>* __restrict__ cos_out, acc_t<scalar_t>* __restrict__ angle_out,
                            acc_t<scalar_t>* __restrict__ stats_out) {
  using acc = acc_t<scalar_t>;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t pairs_per_group = group_size - 1;
  const int64_t pair = static_cast<int64_t>(blockIdx.x) * kPairScoresWarps + threadIdx.x / kWarpSize;
  if (pair >= num_groups * pairs_per_group) return;  // whole warp exits together
  const int64_t g = pair / pairs_per_group;
  const int64_t k = 1 + pair % pairs_per_group;
  const scalar_t* u = x + g * stride_g;
  const scalar_t* v = x + g * stride_g + k * stride_k;

  acc uu = 0, vv = 0, uv = 0, cross = 0;  // cross = b.c - a.d, all of the scaled rows
  int exp_u = 0, exp_v = 0;              // this lane's running scale exponents of u and v
  acc s_u = 1, s_v = 1;
  // A lane's elements may raise its exponents: the sums so far are brought to the new scales.
  const auto rescale = [&](acc largest_u, acc largest_v) {
    const acc fu = raise_exponent(&exp_u, largest_u), fv = raise_exponent(&exp_v, largest_v);
    if (fu != acc(1) || fv != acc(1)) {
      uu *= fu * fu;
      vv *= fv * fv;
      uv *= fu * fv;
      cross *= fu * fv;
      s_u = pow2<acc>(-exp_u);
      s_v = pow2<acc>(-exp_v);
    }
  };
  if (with_angle) {
    const int64_t half = dim / 2;
    for (int64_t i = lane; i < half; i += kWarpSize) {
      acc a = load_as<acc>(u + i * stride_d), b = load_as<acc>(u + (i + half) * stride_d);
      acc c = load_as<acc>(v + i * stride_d), d = load_as<acc>(v + (i + half) * stride_d);
      rescale(max_acc(abs_acc(a), abs_acc(b)), max_acc(abs_acc(c), abs_acc(d)));
      a *= s_u;
      b *= s_u;
      c *= s_v;
      d *= s_v;
      uu += a * a + b * b;
      vv += c * c + d * d;
      uv += a * c + b * d;
      cross += b * c - a * d;
    }
  } else {
    for (int64_t i = lane; i < dim; i += kWarpSize) {
      acc a = load_as<acc>(u + i * stride_d), c = load_as<acc>(v + i * stride_d);
      rescale(abs_acc(a), abs_acc(c));
      a *= s_u;
      c *= s_v;
      uu += a * a;
      vv += c * c;
      uv += a * c;
    }
  }
  // The warp's scales: every lane's sums brought to the largest exponent before the reductions.
  const int warp_exp_u = warp_max(exp_u), warp_exp_v = warp_max(exp_v);
  {
    const acc fu = pow2<acc>(exp_u - warp_exp_u), fv = pow2<acc>(exp_v - warp_exp_v);
    uu *= fu * fu;
    vv *= fv * fv;
    uv *= fu * fv;
    cross *= fu * fv;
  }
  uu = warp_sum(uu);
  vv = warp_sum(vv);
  uv = warp_sum(uv);
  cross = warp_sum(cross);

  if (lane == 0) {
    const acc scale_u = pow2<acc>(-warp_exp_u), scale_v = pow2<acc>(-warp_exp_v);
    const acc norm_u = sqrt_acc(uu), norm_v = sqrt_acc(vv);
    const acc inv_p = inv_clamped_norm(norm_u, scale_u) * inv_clamped_norm(norm_v, scale_v);
    const acc cos = uv * inv_p;
    const acc w = with_angle ? cross * inv_p : acc(0);
    cos_out[pair] = cos;
    angle_out[pair] = with_angle ? cos + w : acc(0);
    acc* stats = stats_out + pair * kPairStats;
    stats[0] = norm_u;
    stats[1] = norm_v;
    stats[2] = cos;
    stats[3] = w;
    stats[4] = scale_u;
    stats[5] = scale_v;
  }
}

// ---------------------------------------------------------------------------------------------------------
// Backward: one warp per group, so the anchor's gradient (a sum over the group's pairs) is formed in
// registers and written once, with no atomics. The per-pair scalars, of the scaled rows,
//   alpha = gs / P, beta = ga / P, gamma_u = (gs cos + ga w) / |u|^2, gamma_v = (gs cos + ga w) / |v|^2
// and the partner's scale s_v are computed once per pair into this warp's slice of shared memory; then each lane
// walks D, on the scaled elements (u_s = s_u u, v_s = s_v v):
//   du += s_u [alpha v_s + beta rot(v_s) - gamma_u u_s],    dv = s_v [alpha u_s + beta rot'(u_s) - gamma_v v_s].
// ---------------------------------------------------------------------------------------------------------
template <typename scalar_t>
__global__ void __launch_bounds__(kPairScoresThreads)
    _pair_scores_bwd_kernel(const acc_t<scalar_t>* __restrict__ grad_cos, const acc_t<scalar_t>* __restrict__ grad_angle,
                            const scalar_t* __restrict__ x, const acc_t<scalar_t>* __restrict__ stats,
                            int64_t num_groups, int64_t group_size, int64_t dim, int64_t stride_g, int64_t stride_k,
                            int64_t stride_d, bool with_angle, scalar_t* __restrict__ dx) {
  using acc = acc_t<scalar_t>;
  extern __shared__ __align__(16) unsigned char pair_coef_smem[];
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int64_t pairs_per_group = group_size - 1;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarpSize) + warp;
  if (g >= num_groups) return;  // whole warp exits; no block-wide barrier follows

  // This warp's coefficients: kPairCoefs per pair (alpha, beta, gamma_u, gamma_v, s_v).
  acc* coef = reinterpret_cast<acc*>(pair_coef_smem) + static_cast<int64_t>(warp) * pairs_per_group * kPairCoefs;
  for (int64_t p = lane; p < pairs_per_group; p += kWarpSize) {
    const int64_t pair = g * pairs_per_group + p;
    const acc* s = stats + pair * kPairStats;
    const acc norm_u = s[0], norm_v = s[1], cos = s[2], w = s[3], scale_u = s[4], scale_v = s[5];
    const acc ga = with_angle ? grad_angle[pair] : acc(0);  // with_angle = false: angle does not depend on x
    const acc gs = grad_cos[pair] + ga;
    const acc inv_p = inv_clamped_norm(norm_u, scale_u) * inv_clamped_norm(norm_v, scale_v);
    const acc projection = gs * cos + ga * w;
    coef[kPairCoefs * p + 0] = gs * inv_p;
    coef[kPairCoefs * p + 1] = ga * inv_p;
    coef[kPairCoefs * p + 2] = projection * inv_sq_norm_or_zero(norm_u, scale_u);
    coef[kPairCoefs * p + 3] = projection * inv_sq_norm_or_zero(norm_v, scale_v);
    coef[kPairCoefs * p + 4] = scale_v;
  }
  __syncwarp();
  const acc s_u = stats[g * pairs_per_group * kPairStats + 4];  // the anchor's scale (the same in every pair)

  const scalar_t* u = x + g * stride_g;
  scalar_t* du_out = dx + g * group_size * dim;  // dx is contiguous [G, K, D]
  if (with_angle) {
    const int64_t half = dim / 2;
    for (int64_t i = lane; i < half; i += kWarpSize) {
      const acc a = load_as<acc>(u + i * stride_d) * s_u, b = load_as<acc>(u + (i + half) * stride_d) * s_u;
      acc du_a = 0, du_b = 0;
      for (int64_t p = 0; p < pairs_per_group; ++p) {
        const acc* cp = coef + kPairCoefs * p;
        const acc alpha = cp[0], beta = cp[1], gamma_u = cp[2], gamma_v = cp[3], s_v = cp[4];
        const scalar_t* v = u + (p + 1) * stride_k;
        const acc c = load_as<acc>(v + i * stride_d) * s_v, d = load_as<acc>(v + (i + half) * stride_d) * s_v;
        du_a += alpha * c - beta * d - gamma_u * a;
        du_b += alpha * d + beta * c - gamma_u * b;
        scalar_t* dv_out = du_out + (p + 1) * dim;
        dv_out[i] = from_acc<scalar_t>((alpha * a + beta * b - gamma_v * c) * s_v);
        dv_out[i + half] = from_acc<scalar_t>((alpha * b - beta * a - gamma_v * d) * s_v);
      }
      du_out[i] = from_acc<scalar_t>(du_a * s_u);
      du_out[i + half] = from_acc<scalar_t>(du_b * s_u);
    }
  } else {
    for (int64_t i = lane; i < dim; i += kWarpSize) {
      const acc a = load_as<acc>(u + i * stride_d) * s_u;
      acc du = 0;
      for (int64_t p = 0; p < pairs_per_group; ++p) {
        const acc* cp = coef + kPairCoefs * p;
        const acc alpha = cp[0], gamma_u = cp[2], gamma_v = cp[3], s_v = cp[4];
        const acc c = load_as<acc>(u + (p + 1) * stride_k + i * stride_d) * s_v;
        du += alpha * c - gamma_u * a;
        du_out[(p + 1) * dim + i] = from_acc<scalar_t>((alpha * a - gamma_v * c) * s_v);
      }
      du_out[i] = from_acc<scalar_t>(du * s_u);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Launchers. Return cudaSuccess, the launch error, or cudaErrorInvalidValue for arguments the kernels
// cannot handle (the binding turns that into a readable message first).
// ---------------------------------------------------------------------------------------------------------
constexpr int64_t kMaxBlocks = 2147483647;
constexpr size_t kMaxStaticSmem = 48 * 1024;

template <typename scalar_t>
cudaError_t pair_scores_fwd(const scalar_t* x, int64_t num_groups, int64_t group_size, int64_t dim, int64_t stride_g,
                            int64_t stride_k, int64_t stride_d, bool with_angle, acc_t<scalar_t>* cos_out,
                            acc_t<scalar_t>* angle_out, acc_t<scalar_t>* stats_out, cudaStream_t stream) {
  if (group_size < 2 || dim < 1 || num_groups < 0 || (with_angle && dim % 2 != 0)) return cudaErrorInvalidValue;
  const int64_t pairs = num_groups * (group_size - 1);
  if (pairs == 0) return cudaSuccess;
  const int64_t blocks = (pairs + kPairScoresWarps - 1) / kPairScoresWarps;
  if (blocks > kMaxBlocks) return cudaErrorInvalidValue;
  _pair_scores_fwd_kernel<scalar_t><<<static_cast<unsigned>(blocks), kPairScoresThreads, 0, stream>>>(
      x, num_groups, group_size, dim, stride_g, stride_k, stride_d, with_angle, cos_out, angle_out, stats_out);
  return cudaGetLastError();
}

// Largest K the backward supports: the coefficients of one group must fit in shared memory.
template <typename scalar_t>
int64_t pair_scores_bwd_max_group_size() {
  return 1 + static_cast<int64_t>(kMaxStaticSmem / (kPairCoefs * sizeof(acc_t<scalar_t>)));
}

template <typename scalar_t>
cudaError_t pair_scores_bwd(const acc_t<scalar_t>* grad_cos, const acc_t<scalar_t>* grad_angle, const scalar_t* x,
                            const acc_t<scalar_t>* stats, int64_t num_groups, int64_t group_size, int64_t dim,
                            int64_t stride_g, int64_t stride_k, int64_t stride_d, bool with_angle, scalar_t* dx,
                            cudaStream_t stream) {
  if (group_size < 2 || dim < 1 || num_groups < 0 || (with_angle && dim % 2 != 0)) return cudaErrorInvalidValue;
  if (num_groups == 0) return cudaSuccess;
  const size_t coef_bytes_per_group = static_cast<size_t>(group_size - 1) * kPairCoefs * sizeof(acc_t<scalar_t>);
  if (coef_bytes_per_group > kMaxStaticSmem) return cudaErrorInvalidValue;
  // As many warps (groups) per block as the coefficients allow, at most 8.
  int warps = kPairScoresWarps;
  while (warps > 1 && coef_bytes_per_group * warps > kMaxStaticSmem) warps /= 2;
  const int64_t blocks = (num_groups + warps - 1) / warps;
  if (blocks > kMaxBlocks) return cudaErrorInvalidValue;
  _pair_scores_bwd_kernel<scalar_t><<<static_cast<unsigned>(blocks), warps * kWarpSize, coef_bytes_per_group * warps,
                                      stream>>>(grad_cos, grad_angle, x, stats, num_groups, group_size, dim, stride_g,
                                                stride_k, stride_d, with_angle, dx);
  return cudaGetLastError();
}

// Explicit instantiations: the binding (csrc/pair_scores.cpp) declares these and links against them.
#define ANGLE_KERNELS_INSTANTIATE_PAIR_SCORES(T)                                                                  \
  template cudaError_t pair_scores_fwd<T>(const T*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool,    \
                                          acc_t<T>*, acc_t<T>*, acc_t<T>*, cudaStream_t);                          \
  template cudaError_t pair_scores_bwd<T>(const acc_t<T>*, const acc_t<T>*, const T*, const acc_t<T>*, int64_t,    \
                                          int64_t, int64_t, int64_t, int64_t, int64_t, bool, T*, cudaStream_t);    \
  template int64_t pair_scores_bwd_max_group_size<T>();
ANGLE_KERNELS_INSTANTIATE_PAIR_SCORES(float)
ANGLE_KERNELS_INSTANTIATE_PAIR_SCORES(double)
ANGLE_KERNELS_INSTANTIATE_PAIR_SCORES(__half)
ANGLE_KERNELS_INSTANTIATE_PAIR_SCORES(__nv_bfloat16)
#undef ANGLE_KERNELS_INSTANTIATE_PAIR_SCORES

}  // namespace angle_kernels

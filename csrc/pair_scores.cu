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
// The floor: forward reads x once (G*K*D elements) and writes 2*G*(K-1) scores plus 6 saved scalars per pair;
// backward reads x once (and 8 scalars per pair) and writes dx once (G*K*D each). Both are memory bound: a handful of
// FLOPs per element. Zigzag pairs (K = 2) of bf16 rows at D = 768: 3,072 bytes read forward, 3,072 read and 3,072
// written backward per pair, beside 32 bytes of scalars written forward and 32 read backward.
//
// Design: two paths per direction, chosen by the launchers (every argument the kernels accept goes to one of them).
//   * The vector path, where every 16-byte load and store is aligned: the rows contiguous (stride_d == 1); x, stride_k
//     and (for G > 1) stride_g multiples of 16 bytes; D a multiple of the vector width (8 bf16/fp16, 4 fp32, 2 fp64
//     elements), and with the angle of twice it, so that the second half starts on a vector too; backward, dx 16-byte
//     aligned (torch's allocations are). A team of T lanes (T a power of two dividing the warp) owns a pair (forward)
//     or a group (backward); lane r of a team takes the vectors r, r + T, r + 2T, ... of the swept length (D/2 with
//     the angle, the halves at the same offsets so that the cross term needs no shuffle; D without), so one load
//     instruction reads T * 16 contiguous bytes of each row. T is the largest power of two up to 32 that leaves every
//     lane at least 8 of a row's vectors (1 for rows of fewer than 16; D = 768 bf16: T = 8, 4 pairs per warp): the
//     team reductions (log2 T shuffles per sum) and the per-pair scalars amortise over several vectors per lane, and
//     short rows leave no lane idle. A lane issues all the loads of a step before it uses any (8 vectors, 128 bytes;
//     backward, the next partner's while the current one's arithmetic runs), so enough bytes are in flight per SM to
//     cover DRAM latency at 2-3 blocks per SM, and it issues 3-4 instructions per byte moved (sm_90, bf16).
//   * The general path (any strides, odd D, misaligned views): one warp per pair (forward) or per group (backward),
//     each lane loading single elements with a stride of 32 elements. Correct for every layout, but ~11 instructions
//     per byte with 4 bytes per lane in flight: about half the copy bandwidth (H100, bf16).
//   K > 2. Forward: each pair has its own team (warp), so the anchor is read once per pair; the teams of one group sit
//   side by side in a warp, where their anchor loads are the same instructions (one request for all of them), or are
//   L2 hits across a warp boundary. Backward: a group has one team (warp), so the anchor's gradient (a sum over the
//   group's pairs) is formed in the registers of the lane that owns those columns and written once, with no atomics.
//
// Saved per pair (stats[g, k-1, 0..5]): |u_s|, |v_s|, cos, w, s_u, s_v, with u_s = s_u u the rows scaled by their
// powers of two (common.cuh, row scaling: 1 for ordinary rows). The backward needs nothing else from the forward.
//
// Huge rows: each lane keeps a running scale exponent per row, raised by the largest magnitude of each piece it loads
// (vector path: one vector position, the row's two vectors there with the angle, one without; general path: one
// element); the sums gathered at the old scale are then rescaled by 2^(old - new). The team agrees on the largest
// exponent before its reductions: the exponent of the row's largest magnitude however the row was cut, so s is exactly
// common.cuh's, and ordinary rows compute unscaled. The formulas above run on the scaled rows: backward multiplies each
// loaded element by its row's scale and each gradient element by it again (dL/dx = s dL/dx_s). Extra per element: a
// max (with the abs folded in) and a multiply forward, two multiplies backward; the exponent check runs once a piece.
// The vector backward evaluates the general backward's expressions element for element: given the same stats, both
// paths write the same dx bits.

#include "common.cuh"

namespace angle_kernels {

constexpr int kPairScoresThreads = 256;  // 8 warps per block
constexpr int kPairScoresWarps = kPairScoresThreads / kWarpSize;
constexpr int kPairStats = 6;  // |u_s|, |v_s|, cos, w, s_u, s_v
constexpr int kPairCoefs = 5;  // the backward's per-pair coefficients in shared memory: alpha, beta, gamma_u, gamma_v, s_v

// ---------------------------------------------------------------------------------------------------------
// What both paths share: a pair's outputs from its reduced sums (forward), its backward coefficients.
// ---------------------------------------------------------------------------------------------------------
// cos, angle and the saved stats of one pair from the sums over its scaled rows (|u_s|^2, |v_s|^2, u_s.v_s and
// b.c - a.d) and the rows' scale exponents.
template <typename acc>
__device__ __forceinline__ void finish_pair(int64_t pair, acc uu, acc vv, acc uv, acc cross, int exp_u, int exp_v,
                                            bool with_angle, acc* __restrict__ cos_out, acc* __restrict__ angle_out,
                                            acc* __restrict__ stats_out) {
  const acc scale_u = pow2<acc>(-exp_u), scale_v = pow2<acc>(-exp_v);
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

// The backward's coefficients of one pair, coef[0..4] = (alpha, beta, gamma_u, gamma_v, s_v), from its saved stats
// and its output gradients (see the backward kernels).
template <typename acc>
__device__ __forceinline__ void pair_coefficients(int64_t pair, const acc* __restrict__ stats,
                                                  const acc* __restrict__ grad_cos, const acc* __restrict__ grad_angle,
                                                  bool with_angle, acc* coef) {
  const acc* s = stats + pair * kPairStats;
  const acc norm_u = s[0], norm_v = s[1], cos = s[2], w = s[3], scale_u = s[4], scale_v = s[5];
  const acc ga = with_angle ? grad_angle[pair] : acc(0);  // with_angle = false: angle does not depend on x
  const acc gs = grad_cos[pair] + ga;
  const acc inv_p = inv_clamped_norm(norm_u, scale_u) * inv_clamped_norm(norm_v, scale_v);
  const acc projection = gs * cos + ga * w;
  coef[0] = gs * inv_p;
  coef[1] = ga * inv_p;
  coef[2] = projection * inv_sq_norm_or_zero(norm_u, scale_u);
  coef[3] = projection * inv_sq_norm_or_zero(norm_v, scale_v);
  coef[4] = scale_v;
}

// ---------------------------------------------------------------------------------------------------------
// General path, forward: one warp per pair. Each lane walks D (or D/2 element pairs when the angle is needed) with a
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

  if (lane == 0) finish_pair(pair, uu, vv, uv, cross, warp_exp_u, warp_exp_v, with_angle, cos_out, angle_out, stats_out);
}

// ---------------------------------------------------------------------------------------------------------
// General path, backward: one warp per group, so the anchor's gradient (a sum over the group's pairs) is formed in
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
    pair_coefficients(g * pairs_per_group + p, stats, grad_cos, grad_angle, with_angle, coef + kPairCoefs * p);
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
// Vector path: 16-byte loads and stores (the conditions: the header and use_vector_path below).
// ---------------------------------------------------------------------------------------------------------
// One 16-byte vector of scalar_t as kSize compute-type values: loaded as raw bits (uint4) and unpacked from them
// (bf16 -> fp32 is an exact widening of the bits; fp16 through __half2float), packed back with the round-to-nearest
// conversions of from_acc. Element i of the vector is the element at the lower address, as in memory.
template <typename scalar_t>
struct Vec16;
template <>
struct Vec16<float> {
  static constexpr int kSize = 4;
  __device__ __forceinline__ static void unpack(const uint4& r, float (&o)[kSize]) {
    o[0] = __uint_as_float(r.x);
    o[1] = __uint_as_float(r.y);
    o[2] = __uint_as_float(r.z);
    o[3] = __uint_as_float(r.w);
  }
  __device__ __forceinline__ static uint4 pack(const float (&o)[kSize]) {
    return make_uint4(__float_as_uint(o[0]), __float_as_uint(o[1]), __float_as_uint(o[2]), __float_as_uint(o[3]));
  }
};
template <>
struct Vec16<double> {
  static constexpr int kSize = 2;
  __device__ __forceinline__ static void unpack(const uint4& r, double (&o)[kSize]) {
    o[0] = __hiloint2double(static_cast<int>(r.y), static_cast<int>(r.x));
    o[1] = __hiloint2double(static_cast<int>(r.w), static_cast<int>(r.z));
  }
  __device__ __forceinline__ static uint4 pack(const double (&o)[kSize]) {
    return make_uint4(static_cast<unsigned>(__double2loint(o[0])), static_cast<unsigned>(__double2hiint(o[0])),
                      static_cast<unsigned>(__double2loint(o[1])), static_cast<unsigned>(__double2hiint(o[1])));
  }
};
// The two 16-bit types: a 32-bit word holds elements 2i (low half) and 2i + 1 (high half).
__device__ __forceinline__ void unpack_word(unsigned w, __nv_bfloat16, float& lo, float& hi) {
  lo = __uint_as_float(w << 16);
  hi = __uint_as_float(w & 0xffff0000u);
}
__device__ __forceinline__ void unpack_word(unsigned w, __half, float& lo, float& hi) {
  lo = __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu)));
  hi = __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
}
__device__ __forceinline__ unsigned pack_word(float lo, float hi, __nv_bfloat16) {
  return static_cast<unsigned>(__bfloat16_as_ushort(from_acc<__nv_bfloat16>(lo))) |
         (static_cast<unsigned>(__bfloat16_as_ushort(from_acc<__nv_bfloat16>(hi))) << 16);
}
__device__ __forceinline__ unsigned pack_word(float lo, float hi, __half) {
  return static_cast<unsigned>(__half_as_ushort(from_acc<__half>(lo))) |
         (static_cast<unsigned>(__half_as_ushort(from_acc<__half>(hi))) << 16);
}
template <typename half_t>
struct Vec16Half {
  static constexpr int kSize = 8;
  __device__ __forceinline__ static void unpack(const uint4& r, float (&o)[kSize]) {
    unpack_word(r.x, half_t{}, o[0], o[1]);
    unpack_word(r.y, half_t{}, o[2], o[3]);
    unpack_word(r.z, half_t{}, o[4], o[5]);
    unpack_word(r.w, half_t{}, o[6], o[7]);
  }
  __device__ __forceinline__ static uint4 pack(const float (&o)[kSize]) {
    return make_uint4(pack_word(o[0], o[1], half_t{}), pack_word(o[2], o[3], half_t{}),
                      pack_word(o[4], o[5], half_t{}), pack_word(o[6], o[7], half_t{}));
  }
};
template <>
struct Vec16<__nv_bfloat16> : Vec16Half<__nv_bfloat16> {};
template <>
struct Vec16<__half> : Vec16Half<__half> {};

// The vector at p, which must be 16-byte aligned (the launchers' conditions make every p below so), each a single
// 16-byte instruction: __ldg (ld.global.nc.v4: the read-only path; x is never written here) and st.global.v4 in
// inline PTX, because NVVM split some plain uint4 stores into four 4-byte ones (and __stwb's st.global.wb becomes a
// STRONG.SM store on sm_90).
template <typename scalar_t>
__device__ __forceinline__ uint4 load16(const scalar_t* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}
template <typename scalar_t>
__device__ __forceinline__ void store16(scalar_t* p, const uint4& bits) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(bits.x), "r"(bits.y), "r"(bits.z), "r"(bits.w)
               : "memory");
}

// Reductions over the aligned team of `team` lanes (a power of two <= 32) holding this lane. Every lane of the warp
// must call them (full mask): teams without work join with zeros.
template <typename acc>
__device__ __forceinline__ acc team_sum(acc v, int team) {
  for (int offset = team / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}
__device__ __forceinline__ int team_max(int v, int team) {
  for (int offset = team / 2; offset > 0; offset /= 2) v = max(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Vector positions per lane per step: all of a step's loads are issued before any is used, 8 vectors (128 bytes) per
// lane in flight. With the angle a position has 4 vectors (a, b, c, d), without it 2 (u, v), so twice the positions.
// The backward loads the next partner's vectors while the current partner's arithmetic runs (K > 2).
constexpr int kFwdAngleStep = 2;
constexpr int kFwdPlainStep = 4;
constexpr int kBwdAngleStep = 2;
constexpr int kBwdPlainStep = 4;

// ---------------------------------------------------------------------------------------------------------
// Vector path, forward: one team per pair. `vectors` is the number of 16-byte vectors of the swept length (D/2 with
// the angle, D without), `half` = D/2 in elements (with the angle). Each lane accumulates |u|^2, |v|^2, u.v and
// b.c - a.d over its vectors in the compute type; one team reduction each.
// ---------------------------------------------------------------------------------------------------------
template <typename scalar_t>
__global__ void __launch_bounds__(kPairScoresThreads)
    _pair_scores_fwd_vec_kernel(const scalar_t* __restrict__ x, int64_t num_groups, int64_t group_size,
                                int64_t vectors, int64_t half, int64_t stride_g, int64_t stride_k, bool with_angle,
                                int log2_team, acc_t<scalar_t>* __restrict__ cos_out,
                                acc_t<scalar_t>* __restrict__ angle_out, acc_t<scalar_t>* __restrict__ stats_out) {
  using acc = acc_t<scalar_t>;
  using Vec = Vec16<scalar_t>;
  constexpr int V = Vec::kSize;
  const int team = 1 << log2_team;
  const int rank = static_cast<int>(threadIdx.x) & (team - 1);  // this lane's place in its team
  const int64_t pairs_per_group = group_size - 1;
  const int64_t num_pairs = num_groups * pairs_per_group;
  const int64_t block_first_pair = static_cast<int64_t>(blockIdx.x) * (kPairScoresThreads >> log2_team);
  // A warp none of whose teams has a pair exits whole; any other warp stays whole for the team shuffles.
  if (block_first_pair + ((threadIdx.x & ~(kWarpSize - 1)) >> log2_team) >= num_pairs) return;
  const int64_t pair = block_first_pair + (threadIdx.x >> log2_team);
  const bool active = pair < num_pairs;
  const int64_t g = active ? pair / pairs_per_group : 0;
  const int64_t k = active ? 1 + pair % pairs_per_group : 1;
  const int64_t end = active ? vectors : 0;  // an idle team sweeps nothing and reduces zeros
  const scalar_t* u = x + g * stride_g;
  const scalar_t* v = u + k * stride_k;

  acc uu = 0, vv = 0, uv = 0, cross = 0;  // cross = b.c - a.d, all of the scaled rows
  int exp_u = 0, exp_v = 0;              // this lane's running scale exponents of u and v
  acc s_u = 1, s_v = 1;
  // A step's largest magnitudes may raise the exponents: the sums so far are brought to the new scales.
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
    for (int64_t base = rank; base < end; base += static_cast<int64_t>(team) * kFwdAngleStep) {
      uint4 raw[kFwdAngleStep][4];  // a, b, c, d of each position; zeros past the end (they add nothing)
#pragma unroll
      for (int j = 0; j < kFwdAngleStep; ++j) {
        const int64_t pos = base + static_cast<int64_t>(j) * team;
        raw[j][0] = raw[j][1] = raw[j][2] = raw[j][3] = make_uint4(0u, 0u, 0u, 0u);
        if (pos < end) {
          const int64_t col = pos * V;
          raw[j][0] = load16(u + col);
          raw[j][1] = load16(u + half + col);
          raw[j][2] = load16(v + col);
          raw[j][3] = load16(v + half + col);
        }
      }
      // Position by position: the row-scale check per 16 elements of each row, the unpacked values short-lived.
#pragma unroll
      for (int j = 0; j < kFwdAngleStep; ++j) {
        acc a[V], b[V], c[V], d[V];
        Vec::unpack(raw[j][0], a);
        Vec::unpack(raw[j][1], b);
        Vec::unpack(raw[j][2], c);
        Vec::unpack(raw[j][3], d);
        acc largest_u = 0, largest_v = 0;
#pragma unroll
        for (int e = 0; e < V; ++e) {
          largest_u = max_acc(largest_u, max_acc(abs_acc(a[e]), abs_acc(b[e])));
          largest_v = max_acc(largest_v, max_acc(abs_acc(c[e]), abs_acc(d[e])));
        }
        rescale(largest_u, largest_v);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          // One product per accumulation (one FMA each).
          const acc ae = a[e] * s_u, be = b[e] * s_u, ce = c[e] * s_v, de = d[e] * s_v;
          uu += ae * ae;
          uu += be * be;
          vv += ce * ce;
          vv += de * de;
          uv += ae * ce;
          uv += be * de;
          cross += be * ce;
          cross -= ae * de;
        }
      }
    }
  } else {
    for (int64_t base = rank; base < end; base += static_cast<int64_t>(team) * kFwdPlainStep) {
      uint4 raw[kFwdPlainStep][2];  // u, v of each position; zeros past the end
#pragma unroll
      for (int j = 0; j < kFwdPlainStep; ++j) {
        const int64_t pos = base + static_cast<int64_t>(j) * team;
        raw[j][0] = raw[j][1] = make_uint4(0u, 0u, 0u, 0u);
        if (pos < end) {
          const int64_t col = pos * V;
          raw[j][0] = load16(u + col);
          raw[j][1] = load16(v + col);
        }
      }
#pragma unroll
      for (int j = 0; j < kFwdPlainStep; ++j) {
        acc a[V], c[V];
        Vec::unpack(raw[j][0], a);
        Vec::unpack(raw[j][1], c);
        acc largest_u = 0, largest_v = 0;
#pragma unroll
        for (int e = 0; e < V; ++e) {
          largest_u = max_acc(largest_u, abs_acc(a[e]));
          largest_v = max_acc(largest_v, abs_acc(c[e]));
        }
        rescale(largest_u, largest_v);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const acc ae = a[e] * s_u, ce = c[e] * s_v;
          uu += ae * ae;
          vv += ce * ce;
          uv += ae * ce;
        }
      }
    }
  }
  // The team's scales: every lane's sums brought to the largest exponent before the reductions.
  const int team_exp_u = team_max(exp_u, team), team_exp_v = team_max(exp_v, team);
  {
    const acc fu = pow2<acc>(exp_u - team_exp_u), fv = pow2<acc>(exp_v - team_exp_v);
    uu *= fu * fu;
    vv *= fv * fv;
    uv *= fu * fv;
    cross *= fu * fv;
  }
  uu = team_sum(uu, team);
  vv = team_sum(vv, team);
  uv = team_sum(uv, team);
  cross = team_sum(cross, team);

  if (active && rank == 0) {
    finish_pair(pair, uu, vv, uv, cross, team_exp_u, team_exp_v, with_angle, cos_out, angle_out, stats_out);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Vector path, backward: one team per group (the general backward's scheme, with teams for warps). The team's
// lanes compute its pairs' coefficients into its slice of shared memory; then lane r walks the vector positions
// r, r + T, ...: it loads the anchor's vectors there once, and for each partner loads the partner's (the next
// partner's before the current one's arithmetic), stores dv and adds to du in registers; du is stored after the last
// partner. Every dx vector is written by exactly one lane.
// ---------------------------------------------------------------------------------------------------------
template <typename scalar_t>
__global__ void __launch_bounds__(kPairScoresThreads)
    _pair_scores_bwd_vec_kernel(const acc_t<scalar_t>* __restrict__ grad_cos,
                                const acc_t<scalar_t>* __restrict__ grad_angle, const scalar_t* __restrict__ x,
                                const acc_t<scalar_t>* __restrict__ stats, int64_t num_groups, int64_t group_size,
                                int64_t dim, int64_t vectors, int64_t half, int64_t stride_g, int64_t stride_k,
                                bool with_angle, int log2_team, scalar_t* __restrict__ dx) {
  using acc = acc_t<scalar_t>;
  using Vec = Vec16<scalar_t>;
  constexpr int V = Vec::kSize;
  extern __shared__ __align__(16) unsigned char pair_coef_vec_smem[];
  const int team = 1 << log2_team;
  const int rank = static_cast<int>(threadIdx.x) & (team - 1);
  const int team_in_block = static_cast<int>(threadIdx.x) >> log2_team;
  const int64_t pairs_per_group = group_size - 1;
  const int64_t block_first_group = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> log2_team);
  // A warp none of whose teams has a group exits whole; any other warp stays whole for the __syncwarp below.
  if (block_first_group + ((threadIdx.x & ~(kWarpSize - 1)) >> log2_team) >= num_groups) return;
  const int64_t g = block_first_group + team_in_block;
  const bool active = g < num_groups;

  // This team's coefficients: kPairCoefs per pair (alpha, beta, gamma_u, gamma_v, s_v), as in the general backward.
  acc* coef = reinterpret_cast<acc*>(pair_coef_vec_smem) +
              static_cast<int64_t>(team_in_block) * pairs_per_group * kPairCoefs;
  for (int64_t p = rank; active && p < pairs_per_group; p += team) {
    pair_coefficients(g * pairs_per_group + p, stats, grad_cos, grad_angle, with_angle, coef + kPairCoefs * p);
  }
  __syncwarp();  // a team lies within one warp: its coefficients are visible to all its lanes
  if (!active) return;  // no warp-wide operation follows
  const acc s_u = stats[g * pairs_per_group * kPairStats + 4];  // the anchor's scale (the same in every pair)

  const scalar_t* u = x + g * stride_g;
  scalar_t* du_out = dx + g * group_size * dim;  // dx is contiguous [G, K, D]
  if (with_angle) {
    constexpr int S = kBwdAngleStep;
    for (int64_t base = rank; base < vectors; base += static_cast<int64_t>(team) * S) {
      bool in[S];
      int64_t col[S];
      uint4 raw_a[S], raw_b[S], raw_c[S], raw_d[S];  // raw_c, raw_d: the partner whose turn is next
#pragma unroll
      for (int j = 0; j < S; ++j) {
        const int64_t pos = base + static_cast<int64_t>(j) * team;
        in[j] = pos < vectors;
        col[j] = pos * V;
        raw_a[j] = raw_b[j] = raw_c[j] = raw_d[j] = make_uint4(0u, 0u, 0u, 0u);
        if (in[j]) {
          raw_a[j] = load16(u + col[j]);
          raw_b[j] = load16(u + half + col[j]);
          raw_c[j] = load16(u + stride_k + col[j]);
          raw_d[j] = load16(u + stride_k + half + col[j]);
        }
      }
      // The anchor stays packed (4 registers a vector, not 8) and is unpacked again for each partner: once for K = 2.
      acc du_a[S][V], du_b[S][V];
#pragma unroll
      for (int j = 0; j < S; ++j) {
#pragma unroll
        for (int e = 0; e < V; ++e) {
          du_a[j][e] = 0;
          du_b[j][e] = 0;
        }
      }
      for (int64_t p = 0; p < pairs_per_group; ++p) {
        uint4 cur_c[S], cur_d[S];
#pragma unroll
        for (int j = 0; j < S; ++j) {
          cur_c[j] = raw_c[j];
          cur_d[j] = raw_d[j];
        }
        if (p + 1 < pairs_per_group) {
          const scalar_t* next = u + (p + 2) * stride_k;
#pragma unroll
          for (int j = 0; j < S; ++j) {
            if (in[j]) {
              raw_c[j] = load16(next + col[j]);
              raw_d[j] = load16(next + half + col[j]);
            }
          }
        }
        const acc* cp = coef + kPairCoefs * p;
        const acc alpha = cp[0], beta = cp[1], gamma_u = cp[2], gamma_v = cp[3], s_v = cp[4];
        scalar_t* dv_out = du_out + (p + 1) * dim;
#pragma unroll
        for (int j = 0; j < S; ++j) {
          acc a[V], b[V], c[V], d[V], dv_c[V], dv_d[V];
          Vec::unpack(raw_a[j], a);
          Vec::unpack(raw_b[j], b);
          Vec::unpack(cur_c[j], c);
          Vec::unpack(cur_d[j], d);
#pragma unroll
          for (int e = 0; e < V; ++e) {
            a[e] *= s_u;
            b[e] *= s_u;
            c[e] *= s_v;
            d[e] *= s_v;
            du_a[j][e] += alpha * c[e] - beta * d[e] - gamma_u * a[e];
            du_b[j][e] += alpha * d[e] + beta * c[e] - gamma_u * b[e];
            dv_c[e] = (alpha * a[e] + beta * b[e] - gamma_v * c[e]) * s_v;
            dv_d[e] = (alpha * b[e] - beta * a[e] - gamma_v * d[e]) * s_v;
          }
          if (in[j]) {
            store16(dv_out + col[j], Vec::pack(dv_c));
            store16(dv_out + half + col[j], Vec::pack(dv_d));
          }
        }
      }
#pragma unroll
      for (int j = 0; j < S; ++j) {
#pragma unroll
        for (int e = 0; e < V; ++e) {
          du_a[j][e] *= s_u;
          du_b[j][e] *= s_u;
        }
        if (in[j]) {
          store16(du_out + col[j], Vec::pack(du_a[j]));
          store16(du_out + half + col[j], Vec::pack(du_b[j]));
        }
      }
    }
  } else {
    constexpr int S = kBwdPlainStep;
    for (int64_t base = rank; base < vectors; base += static_cast<int64_t>(team) * S) {
      bool in[S];
      int64_t col[S];
      uint4 raw_a[S], raw_c[S];
#pragma unroll
      for (int j = 0; j < S; ++j) {
        const int64_t pos = base + static_cast<int64_t>(j) * team;
        in[j] = pos < vectors;
        col[j] = pos * V;
        raw_a[j] = raw_c[j] = make_uint4(0u, 0u, 0u, 0u);
        if (in[j]) {
          raw_a[j] = load16(u + col[j]);
          raw_c[j] = load16(u + stride_k + col[j]);
        }
      }
      acc a[S][V], du[S][V];
#pragma unroll
      for (int j = 0; j < S; ++j) {
        Vec::unpack(raw_a[j], a[j]);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          a[j][e] *= s_u;
          du[j][e] = 0;
        }
      }
      for (int64_t p = 0; p < pairs_per_group; ++p) {
        uint4 cur_c[S];
#pragma unroll
        for (int j = 0; j < S; ++j) cur_c[j] = raw_c[j];
        if (p + 1 < pairs_per_group) {
          const scalar_t* next = u + (p + 2) * stride_k;
#pragma unroll
          for (int j = 0; j < S; ++j) {
            if (in[j]) raw_c[j] = load16(next + col[j]);
          }
        }
        const acc* cp = coef + kPairCoefs * p;
        const acc alpha = cp[0], gamma_u = cp[2], gamma_v = cp[3], s_v = cp[4];
        scalar_t* dv_out = du_out + (p + 1) * dim;
#pragma unroll
        for (int j = 0; j < S; ++j) {
          acc c[V], dv[V];
          Vec::unpack(cur_c[j], c);
#pragma unroll
          for (int e = 0; e < V; ++e) {
            c[e] *= s_v;
            du[j][e] += alpha * c[e] - gamma_u * a[j][e];
            dv[e] = (alpha * a[j][e] - gamma_v * c[e]) * s_v;
          }
          if (in[j]) store16(dv_out + col[j], Vec::pack(dv));
        }
      }
#pragma unroll
      for (int j = 0; j < S; ++j) {
#pragma unroll
        for (int e = 0; e < V; ++e) du[j][e] *= s_u;
        if (in[j]) store16(du_out + col[j], Vec::pack(du[j]));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Launchers. Return cudaSuccess, the launch error, or cudaErrorInvalidValue for arguments the kernels
// cannot handle (the binding turns that into a readable message first).
// ---------------------------------------------------------------------------------------------------------
constexpr int64_t kMaxBlocks = 2147483647;
constexpr size_t kMaxStaticSmem = 48 * 1024;
// The vector path's teams: each lane takes at least this many of a row's 16-byte vectors (see the header).
constexpr int64_t kMinVectorsPerLane = 8;

// Whether every 16-byte access of the vector kernels is aligned and in the row: the row starts (x + g stride_g +
// k stride_k, g < G, k < K) on 16 bytes, the rows contiguous, and the swept length split into whole vectors (with the
// angle, D/2 too: the second half's vectors start at D/2). Strides in elements: a multiple of the vector width is a
// multiple of 16 bytes. stride_g is never used when G == 1 (torch leaves any stride on a size-1 dimension), stride_k
// always is (K >= 2).
template <typename scalar_t>
bool use_vector_path(const scalar_t* x, int64_t num_groups, int64_t dim, int64_t stride_g, int64_t stride_k,
                     int64_t stride_d, bool with_angle) {
  constexpr int64_t V = Vec16<scalar_t>::kSize;
  return stride_d == 1 && dim % (with_angle ? 2 * V : V) == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
         stride_k % V == 0 && (num_groups <= 1 || stride_g % V == 0);
}

// log2 of the team size: the largest power of two T <= 32 with T * kMinVectorsPerLane <= D / V (1 for short rows).
inline int vector_team_log2(int64_t row_vectors) {
  int log2_team = 0;
  while (log2_team < 5 && (int64_t{2} << log2_team) * kMinVectorsPerLane <= row_vectors) ++log2_team;
  return log2_team;
}

template <typename scalar_t>
cudaError_t pair_scores_fwd(const scalar_t* x, int64_t num_groups, int64_t group_size, int64_t dim, int64_t stride_g,
                            int64_t stride_k, int64_t stride_d, bool with_angle, acc_t<scalar_t>* cos_out,
                            acc_t<scalar_t>* angle_out, acc_t<scalar_t>* stats_out, cudaStream_t stream) {
  if (group_size < 2 || dim < 1 || num_groups < 0 || (with_angle && dim % 2 != 0)) return cudaErrorInvalidValue;
  const int64_t pairs = num_groups * (group_size - 1);
  if (pairs == 0) return cudaSuccess;
  if (use_vector_path(x, num_groups, dim, stride_g, stride_k, stride_d, with_angle)) {
    constexpr int64_t V = Vec16<scalar_t>::kSize;
    const int log2_team = vector_team_log2(dim / V);
    const int64_t teams_per_block = kPairScoresThreads >> log2_team;
    const int64_t blocks = (pairs + teams_per_block - 1) / teams_per_block;
    if (blocks > kMaxBlocks) return cudaErrorInvalidValue;
    const int64_t half = with_angle ? dim / 2 : 0;
    _pair_scores_fwd_vec_kernel<scalar_t><<<static_cast<unsigned>(blocks), kPairScoresThreads, 0, stream>>>(
        x, num_groups, group_size, (with_angle ? half : dim) / V, half, stride_g, stride_k, with_angle, log2_team,
        cos_out, angle_out, stats_out);
    return cudaGetLastError();
  }
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
  // dx rows start at multiples of D elements, whole vectors when use_vector_path holds: dx itself must be aligned.
  if (use_vector_path(x, num_groups, dim, stride_g, stride_k, stride_d, with_angle) &&
      reinterpret_cast<uintptr_t>(dx) % 16 == 0) {
    constexpr int64_t V = Vec16<scalar_t>::kSize;
    int log2_team = vector_team_log2(dim / V);
    // As many teams per block as the coefficients allow: fewer warps first, then fewer (larger) teams per warp. One
    // team of a warp always fits (coef_bytes_per_group <= kMaxStaticSmem).
    int threads = kPairScoresThreads;
    while (coef_bytes_per_group * static_cast<size_t>(threads >> log2_team) > kMaxStaticSmem) {
      if (threads > kWarpSize) {
        threads /= 2;
      } else {
        ++log2_team;
      }
    }
    const int64_t teams_per_block = threads >> log2_team;
    const int64_t blocks = (num_groups + teams_per_block - 1) / teams_per_block;
    if (blocks > kMaxBlocks) return cudaErrorInvalidValue;
    const int64_t half = with_angle ? dim / 2 : 0;
    _pair_scores_bwd_vec_kernel<scalar_t>
        <<<static_cast<unsigned>(blocks), threads, coef_bytes_per_group * teams_per_block, stream>>>(
            grad_cos, grad_angle, x, stats, num_groups, group_size, dim, (with_angle ? half : dim) / V, half,
            stride_g, stride_k, with_angle, log2_team, dx);
    return cudaGetLastError();
  }
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

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
//
// Nested prefixes (dims = d_1 < ... < d_k <= D, the contract's Matryoshka widths): cos, angle [k, G, K-1] and stats
// [k, G, K-1, 6], prefix i being the scores of x[..., :d_i] with its own norms, scales and halves, from one read of
// each row. The slices [d_{i-1}, d_i) partition the prefixes: the forward sweeps them in order, adding each slice's
// |u|^2, |v|^2 and u.v to running totals (the totals after slice i are prefix i's), with one running scale exponent
// per row (prefix i's scale is its value after slice i: the exponent of the prefix's largest magnitude, as a call on
// x[..., :d_i] finds it). With the angle, prefix i's cross term pairs j with j + d_i/2, a shift of its own: a second
// sweep over the prefix's halves after its slice, which re-reads the pair's rows from cache. The backward writes each
// dx element once: a column of slice s takes the sum over the prefixes i >= s of their terms, whose coefficients are
// summed per slice (one width's arithmetic per element), plus with the angle one rotated term per prefix containing
// it. The same teams and 16-byte vectors as above where every prefix is a multiple of the vector width (of twice it
// with the angle, so that no vector straddles a slice boundary or a prefix's middle), else one element per lane
// position (any strides and widths): kernels written once on "chunks" of either width (see Chunk).
// The floor is one width's at d_k: the forward reads G*K*d_k elements and writes 8 scalars per pair and prefix
// (cos, angle and the 6 stats), the backward reads the rows once and writes dx once (columns past d_k: zeros).
// Zigzag bf16 pairs at D = 768 with dims (64, 128, 256, 512, 768): 3,072 bytes read forward and 3,072 read + 3,072
// written backward per pair, as at one width, and 160 bytes of scalars written forward (32 at one width), 160 read
// backward. FLOPs per element pair: forward 3 FMAs (|u|^2, |v|^2, u.v) as at one width; with the angle the cross
// sweeps add 2 FMAs on sum(d_i) = 1,728 columns' halves (2.25 row-lengths, from L1/L2, not DRAM); backward 4 FMAs
// (du, dv) per element and partner as at one width, plus with the angle 2 FMAs and 2 cached twin loads per prefix
// containing the column (2.25 on average here). k calls on the truncated rows instead read sum(d_i) columns (2.25x,
// from DRAM once the rows exceed L2) and run every prefix's arithmetic from column 0.

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
// Nested prefixes (dims): every prefix x[..., :d_i] of a pair in one read of each row.
// ---------------------------------------------------------------------------------------------------------
// The prefix widths d_1 < ... < d_k, passed by value (a __grid_constant__ parameter: read in place, indexed at run
// time without a local copy). The slices [d_{i-1}, d_i) (d_0 = 0) partition the prefixes: prefix i is slices 1 .. i.
constexpr int kMaxPrefixes = 32;  // more prefixes: the op makes one call per group of 32 (cuda_ops/pair_scores.py)
struct PrefixWidths {
  int64_t width[kMaxPrefixes];
  int count;
};
constexpr int kSliceCoefs = 4;  // per pair and slice: A, B, C, the partner's scale at the slice's prefix
constexpr int kRotCoefs = 3;    // per pair and prefix: r beta, t beta, s_v of the prefix (the rotated terms)

// A chunk: the W consecutive elements of a row one lane takes at a position. The vector path's chunk is a 16-byte
// vector (W = Vec16::kSize, rows contiguous and aligned: the full path's use_vector_path), the general path's one
// element (W = 1, any stride). The prefix kernels are written once on chunks, so both paths run the same code.
template <typename scalar_t, bool kVec>
struct Chunk;
template <typename scalar_t>
struct Chunk<scalar_t, true> {
  using acc = acc_t<scalar_t>;
  using Raw = uint4;
  static constexpr int kWidth = Vec16<scalar_t>::kSize;
  __device__ __forceinline__ static Raw zero() { return make_uint4(0u, 0u, 0u, 0u); }
  __device__ __forceinline__ static Raw load(const scalar_t* row, int64_t col, int64_t) { return load16(row + col); }
  __device__ __forceinline__ static void unpack(const Raw& r, acc (&o)[kWidth]) { Vec16<scalar_t>::unpack(r, o); }
  __device__ __forceinline__ static void store(scalar_t* row, int64_t col, const acc (&o)[kWidth]) {
    store16(row + col, Vec16<scalar_t>::pack(o));
  }
};
template <typename scalar_t>
struct Chunk<scalar_t, false> {
  using acc = acc_t<scalar_t>;
  using Raw = acc;  // the element, already in the compute type
  static constexpr int kWidth = 1;
  __device__ __forceinline__ static Raw zero() { return acc(0); }
  __device__ __forceinline__ static Raw load(const scalar_t* row, int64_t col, int64_t stride_d) {
    return load_as<acc>(row + col * stride_d);
  }
  __device__ __forceinline__ static void unpack(const Raw& r, acc (&o)[1]) { o[0] = r; }
  __device__ __forceinline__ static void store(scalar_t* row, int64_t col, const acc (&o)[1]) {
    row[col] = from_acc<scalar_t>(o[0]);  // dx is contiguous
  }
};

// Chunk positions per lane per step, loads issued before use as in the full path: the slice sweep loads u and v
// (4 positions: 8 vectors in flight), the cross sweep a, b, c, d (2 positions), the backward the anchor and each
// partner (2 positions; the rotated terms' twins are cache hits, loaded where used). Unlike the full backward, the
// prefixes' backward does not load the next partner ahead (K > 2): a first version, to be profiled on a GPU.
constexpr int kDimsSliceStep = 4;
constexpr int kDimsCrossStep = 2;
constexpr int kDimsBwdStep = 2;

// ---------------------------------------------------------------------------------------------------------
// Prefixes, forward: one team per pair (the vector forward's teams). For each slice in order, each lane sums |u|^2,
// |v|^2 and u.v over its chunks of the slice, its running exponents starting at the totals' (so no lane lowers
// them); the team agrees on the largest exponent, reduces, and adds the slice to the running totals (brought to the
// new exponent first). The totals after slice i are prefix i's sums, at the scale a call on x[..., :d_i] computes
// (the exponent of the largest magnitude of the prefix): the row has one running exponent, each prefix reads it
// where its slice ends. With the angle, prefix i's cross term pairs column j with j + d_i/2, a shift of its own:
// after slice i a second sweep over the prefix's halves, at its final scales (no rescaling), reads the pair's rows
// again: cache hits (the team has just read them), not DRAM. Prefix i's outputs go to [i, G, K-1] (stats: 6 each).
// ---------------------------------------------------------------------------------------------------------
template <typename scalar_t, bool kVec>
__global__ void __launch_bounds__(kPairScoresThreads)
    _pair_scores_dims_fwd_kernel(const scalar_t* __restrict__ x, int64_t num_groups, int64_t group_size,
                                 int64_t stride_g, int64_t stride_k, int64_t stride_d,
                                 const __grid_constant__ PrefixWidths dims, bool with_angle, int log2_team,
                                 acc_t<scalar_t>* __restrict__ cos_out, acc_t<scalar_t>* __restrict__ angle_out,
                                 acc_t<scalar_t>* __restrict__ stats_out) {
  using acc = acc_t<scalar_t>;
  using C = Chunk<scalar_t, kVec>;
  constexpr int W = C::kWidth;
  const int team = 1 << log2_team;
  const int rank = static_cast<int>(threadIdx.x) & (team - 1);
  const int64_t pairs_per_group = group_size - 1;
  const int64_t num_pairs = num_groups * pairs_per_group;
  const int64_t block_first_pair = static_cast<int64_t>(blockIdx.x) * (kPairScoresThreads >> log2_team);
  // A warp none of whose teams has a pair exits whole; any other warp stays whole for the team shuffles.
  if (block_first_pair + ((threadIdx.x & ~(kWarpSize - 1)) >> log2_team) >= num_pairs) return;
  const int64_t pair = block_first_pair + (threadIdx.x >> log2_team);
  const bool active = pair < num_pairs;  // an idle team sweeps nothing and reduces zeros
  const int64_t g = active ? pair / pairs_per_group : 0;
  const int64_t k = active ? 1 + pair % pairs_per_group : 1;
  const scalar_t* u = x + g * stride_g;
  const scalar_t* v = u + k * stride_k;

  acc uu_total = 0, vv_total = 0, uv_total = 0;  // the prefix so far, at the exponents below (the team agrees)
  int exp_u_total = 0, exp_v_total = 0;
  int64_t lo = 0;
  for (int i = 0; i < dims.count; ++i) {
    const int64_t hi = dims.width[i];
    acc uu = 0, vv = 0, uv = 0;
    int exp_u = exp_u_total, exp_v = exp_v_total;
    acc s_u = pow2<acc>(-exp_u), s_v = pow2<acc>(-exp_v);
    const int64_t end = active ? hi / W : 0;
    for (int64_t base = lo / W + rank; base < end; base += static_cast<int64_t>(team) * kDimsSliceStep) {
      typename C::Raw raw[kDimsSliceStep][2];  // u, v of each position; zeros past the slice (they add nothing)
#pragma unroll
      for (int j = 0; j < kDimsSliceStep; ++j) {
        const int64_t pos = base + static_cast<int64_t>(j) * team;
        raw[j][0] = raw[j][1] = C::zero();
        if (pos < end) {
          raw[j][0] = C::load(u, pos * W, stride_d);
          raw[j][1] = C::load(v, pos * W, stride_d);
        }
      }
#pragma unroll
      for (int j = 0; j < kDimsSliceStep; ++j) {
        acc a[W], c[W];
        C::unpack(raw[j][0], a);
        C::unpack(raw[j][1], c);
        acc largest_u = 0, largest_v = 0;
#pragma unroll
        for (int e = 0; e < W; ++e) {
          largest_u = max_acc(largest_u, abs_acc(a[e]));
          largest_v = max_acc(largest_v, abs_acc(c[e]));
        }
        const acc fu = raise_exponent(&exp_u, largest_u), fv = raise_exponent(&exp_v, largest_v);
        if (fu != acc(1) || fv != acc(1)) {
          uu *= fu * fu;
          vv *= fv * fv;
          uv *= fu * fv;
          s_u = pow2<acc>(-exp_u);
          s_v = pow2<acc>(-exp_v);
        }
#pragma unroll
        for (int e = 0; e < W; ++e) {
          const acc ae = a[e] * s_u, ce = c[e] * s_v;
          uu += ae * ae;
          vv += ce * ce;
          uv += ae * ce;
        }
      }
    }
    // The slice's sums at the team's exponents, then added to the totals brought to them (every lane holds the
    // totals: the reductions leave the same values in all lanes of the team).
    const int team_exp_u = team_max(exp_u, team), team_exp_v = team_max(exp_v, team);
    {
      const acc fu = pow2<acc>(exp_u - team_exp_u), fv = pow2<acc>(exp_v - team_exp_v);
      uu *= fu * fu;
      vv *= fv * fv;
      uv *= fu * fv;
    }
    uu = team_sum(uu, team);
    vv = team_sum(vv, team);
    uv = team_sum(uv, team);
    {
      const acc fu = pow2<acc>(exp_u_total - team_exp_u), fv = pow2<acc>(exp_v_total - team_exp_v);
      uu_total = uu_total * (fu * fu) + uu;
      vv_total = vv_total * (fv * fv) + vv;
      uv_total = uv_total * (fu * fv) + uv;
    }
    exp_u_total = team_exp_u;
    exp_v_total = team_exp_v;

    acc cross = 0;  // b.c - a.d of the prefix's halves, at its final scales
    if (with_angle) {
      const int64_t half = hi / 2;
      const acc su = pow2<acc>(-exp_u_total), sv = pow2<acc>(-exp_v_total);
      const int64_t half_end = active ? half / W : 0;
      for (int64_t base = rank; base < half_end; base += static_cast<int64_t>(team) * kDimsCrossStep) {
        typename C::Raw raw[kDimsCrossStep][4];  // a, b, c, d of each position
#pragma unroll
        for (int j = 0; j < kDimsCrossStep; ++j) {
          const int64_t pos = base + static_cast<int64_t>(j) * team;
          raw[j][0] = raw[j][1] = raw[j][2] = raw[j][3] = C::zero();
          if (pos < half_end) {
            raw[j][0] = C::load(u, pos * W, stride_d);
            raw[j][1] = C::load(u, half + pos * W, stride_d);
            raw[j][2] = C::load(v, pos * W, stride_d);
            raw[j][3] = C::load(v, half + pos * W, stride_d);
          }
        }
#pragma unroll
        for (int j = 0; j < kDimsCrossStep; ++j) {
          acc a[W], b[W], c[W], d[W];
          C::unpack(raw[j][0], a);
          C::unpack(raw[j][1], b);
          C::unpack(raw[j][2], c);
          C::unpack(raw[j][3], d);
#pragma unroll
          for (int e = 0; e < W; ++e) {
            cross += (b[e] * su) * (c[e] * sv);
            cross -= (a[e] * su) * (d[e] * sv);
          }
        }
      }
      cross = team_sum(cross, team);
    }
    if (active && rank == 0) {
      finish_pair(static_cast<int64_t>(i) * num_pairs + pair, uu_total, vv_total, uv_total, cross, exp_u_total,
                  exp_v_total, with_angle, cos_out, angle_out, stats_out);
    }
    lo = hi;
  }
}

// ---------------------------------------------------------------------------------------------------------
// Prefixes, backward: one team per group, dx written once per element. A column j of slice s belongs to the
// prefixes i >= s; in the frame of prefix s (u_s = su_s u, v_s = sv_s v: every element of the slice below 2) the
// terms of the single-width formulas summed over those prefixes are, with r_i = su_i / su_s and t_i = sv_i / sv_s
// (exact powers of two <= 1) and prefix i's coefficients alpha, beta, gamma_u, gamma_v (pair_coefficients):
//   du = su_s [sum_p (A_p v_s - B_p u_s) + sum_p sum_{i >= s} sign_i r_i beta_ip (sv_ip v_p[twin_i])]
//   dv_p = sv_s [A_p u_s - C_p v_s - sum_{i >= s} sign_i t_ip beta_ip (su_i u[twin_i])]
//   A_p = sum_{i >= s} r_i t_ip alpha_ip,  B_p = sum_{i >= s} r_i^2 gamma_u_ip,  C_p = sum_{i >= s} t_ip^2 gamma_v_ip
// where twin_i = j + d_i/2, sign_i = -1 in prefix i's first half, j - d_i/2 and +1 in its second (the rotated terms,
// with the angle only). At the start of each slice the team's lanes compute A, B, C and the rotated coefficients of
// its pairs into the team's slice of shared memory; every element then takes one width's arithmetic plus, with the
// angle, one twin per prefix containing it (cache hits: the group's rows are being read). Columns past d_k get 0.
// ---------------------------------------------------------------------------------------------------------
template <typename scalar_t, bool kVec>
__global__ void __launch_bounds__(kPairScoresThreads)
    _pair_scores_dims_bwd_kernel(const acc_t<scalar_t>* __restrict__ grad_cos,
                                 const acc_t<scalar_t>* __restrict__ grad_angle, const scalar_t* __restrict__ x,
                                 const acc_t<scalar_t>* __restrict__ stats, int64_t num_groups, int64_t group_size,
                                 int64_t dim, int64_t stride_g, int64_t stride_k, int64_t stride_d,
                                 const __grid_constant__ PrefixWidths dims, bool with_angle, int log2_team,
                                 scalar_t* __restrict__ dx) {
  using acc = acc_t<scalar_t>;
  using C = Chunk<scalar_t, kVec>;
  constexpr int W = C::kWidth;
  extern __shared__ __align__(16) unsigned char pair_dims_smem[];
  const int team = 1 << log2_team;
  const int rank = static_cast<int>(threadIdx.x) & (team - 1);
  const int team_in_block = static_cast<int>(threadIdx.x) >> log2_team;
  const int64_t pairs_per_group = group_size - 1;
  const int64_t num_pairs = num_groups * pairs_per_group;
  const int64_t block_first_group = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> log2_team);
  // A warp none of whose teams has a group exits whole; any other warp stays whole for the __syncwarp below.
  if (block_first_group + ((threadIdx.x & ~(kWarpSize - 1)) >> log2_team) >= num_groups) return;
  const int64_t g = block_first_group + team_in_block;
  const bool active = g < num_groups;

  // The team's shared memory: kSliceCoefs per pair (A, B, C, sv_s), kRotCoefs per prefix and pair, su per prefix.
  const int64_t per_team = pairs_per_group * (kSliceCoefs + static_cast<int64_t>(dims.count) * kRotCoefs) + dims.count;
  acc* slice_coef = reinterpret_cast<acc*>(pair_dims_smem) + team_in_block * per_team;
  acc* rot_coef = slice_coef + pairs_per_group * kSliceCoefs;
  acc* prefix_su = rot_coef + pairs_per_group * dims.count * kRotCoefs;

  const scalar_t* u = x + g * stride_g;
  scalar_t* du_out = dx + g * group_size * dim;  // dx is contiguous [G, K, D]
  int64_t lo = 0;
  for (int s = 0; s < dims.count; ++s) {
    const int64_t hi = dims.width[s];
    __syncwarp();  // the previous slice's coefficients are no longer read (a team lies within one warp)
    for (int64_t p = rank; active && p < pairs_per_group; p += team) {
      const acc* own = stats + (static_cast<int64_t>(s) * num_pairs + g * pairs_per_group + p) * kPairStats;
      const acc su_s = own[4], sv_s = own[5];
      acc sum_a = 0, sum_b = 0, sum_c = 0;
      for (int i = s; i < dims.count; ++i) {
        const int64_t prefix_pair = static_cast<int64_t>(i) * num_pairs + g * pairs_per_group + p;
        acc coef[kPairCoefs];  // alpha, beta, gamma_u, gamma_v, s_v of prefix i
        pair_coefficients(prefix_pair, stats, grad_cos, grad_angle, with_angle, coef);
        const acc su_i = stats[prefix_pair * kPairStats + 4];
        const acc r = su_i / su_s, t = coef[4] / sv_s;  // powers of two: exact
        sum_a += (r * t) * coef[0];
        sum_b += (r * r) * coef[2];
        sum_c += (t * t) * coef[3];
        acc* rot = rot_coef + (static_cast<int64_t>(i) * pairs_per_group + p) * kRotCoefs;
        rot[0] = r * coef[1];
        rot[1] = t * coef[1];
        rot[2] = coef[4];
        if (p == 0) prefix_su[i] = su_i;  // the anchor's scale, the same in every pair
      }
      acc* own_coef = slice_coef + p * kSliceCoefs;
      own_coef[0] = sum_a;
      own_coef[1] = sum_b;
      own_coef[2] = sum_c;
      own_coef[3] = sv_s;
    }
    __syncwarp();
    if (active) {
      const acc su_s = prefix_su[s];
      const int64_t end = hi / W;
      for (int64_t base = lo / W + rank; base < end; base += static_cast<int64_t>(team) * kDimsBwdStep) {
        bool in[kDimsBwdStep];
        int64_t col[kDimsBwdStep];
        acc a[kDimsBwdStep][W], du[kDimsBwdStep][W];
#pragma unroll
        for (int j = 0; j < kDimsBwdStep; ++j) {
          const int64_t pos = base + static_cast<int64_t>(j) * team;
          in[j] = pos < end;
          col[j] = pos * W;
          typename C::Raw raw = C::zero();
          if (in[j]) raw = C::load(u, col[j], stride_d);
          C::unpack(raw, a[j]);
#pragma unroll
          for (int e = 0; e < W; ++e) {
            a[j][e] *= su_s;
            du[j][e] = 0;
          }
        }
        for (int64_t p = 0; p < pairs_per_group; ++p) {
          const scalar_t* v = u + (p + 1) * stride_k;
          scalar_t* dv_out = du_out + (p + 1) * dim;
          const acc* cp = slice_coef + p * kSliceCoefs;
          const acc coef_a = cp[0], coef_b = cp[1], coef_c = cp[2], sv_s = cp[3];
          typename C::Raw raw_c[kDimsBwdStep];
#pragma unroll
          for (int j = 0; j < kDimsBwdStep; ++j) {
            raw_c[j] = C::zero();
            if (in[j]) raw_c[j] = C::load(v, col[j], stride_d);
          }
#pragma unroll
          for (int j = 0; j < kDimsBwdStep; ++j) {
            acc c[W], dv[W];
            C::unpack(raw_c[j], c);
#pragma unroll
            for (int e = 0; e < W; ++e) {
              c[e] *= sv_s;
              du[j][e] += coef_a * c[e] - coef_b * a[j][e];
              dv[e] = coef_a * a[j][e] - coef_c * c[e];
            }
            if (with_angle && in[j]) {
              // The rotated terms: a chunk lies in one half of every prefix (the vector path's prefixes are
              // multiples of two vectors), so its twin is one chunk.
              for (int i = s; i < dims.count; ++i) {
                const int64_t half = dims.width[i] / 2;
                const bool first = col[j] < half;
                const int64_t twin = first ? col[j] + half : col[j] - half;
                const acc* rot = rot_coef + (static_cast<int64_t>(i) * pairs_per_group + p) * kRotCoefs;
                const acc sign = first ? acc(-1) : acc(1);
                const acc rb = sign * rot[0], tb = sign * rot[1], sv_i = rot[2], su_i = prefix_su[i];
                acc tu[W], tv[W];
                C::unpack(C::load(u, twin, stride_d), tu);
                C::unpack(C::load(v, twin, stride_d), tv);
#pragma unroll
                for (int e = 0; e < W; ++e) {
                  du[j][e] += rb * (tv[e] * sv_i);
                  dv[e] -= tb * (tu[e] * su_i);
                }
              }
            }
#pragma unroll
            for (int e = 0; e < W; ++e) dv[e] *= sv_s;
            if (in[j]) C::store(dv_out, col[j], dv);
          }
        }
#pragma unroll
        for (int j = 0; j < kDimsBwdStep; ++j) {
#pragma unroll
          for (int e = 0; e < W; ++e) du[j][e] *= su_s;
          if (in[j]) C::store(du_out, col[j], du[j]);
        }
      }
    }
    lo = hi;
  }
  // The columns no prefix contains.
  if (active) {
    acc zeros[W];
#pragma unroll
    for (int e = 0; e < W; ++e) zeros[e] = 0;
    for (int64_t pos = lo / W + rank; pos < dim / W; pos += team) {
      for (int64_t row = 0; row < group_size; ++row) C::store(du_out + row * dim, pos * W, zeros);
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

// ---- nested prefixes (dims) ----
// The prefixes' launchers take the widths as a host array (dims[0..num_dims), ascending, at most dim; with the angle
// even) of at most kMaxPrefixes.
inline bool fill_prefix_widths(const int64_t* dims, int64_t num_dims, int64_t dim, bool with_angle,
                               PrefixWidths* widths) {
  if (num_dims < 1 || num_dims > kMaxPrefixes) return false;
  widths->count = static_cast<int>(num_dims);
  for (int i = 0; i < kMaxPrefixes; ++i) widths->width[i] = i < num_dims ? dims[i] : 0;
  for (int64_t i = 0; i < num_dims; ++i) {
    if (dims[i] < 1 || dims[i] > dim || (i > 0 && dims[i] <= dims[i - 1]) || (with_angle && dims[i] % 2 != 0)) {
      return false;
    }
  }
  return true;
}

// The vector path with prefixes: the full path's conditions for the whole row (without the angle's: the halves that
// matter are the prefixes'), and every prefix a multiple of the vector width (with the angle of twice it, so that
// each prefix's second half starts on a vector). Then no chunk straddles a slice boundary or a prefix's middle,
// every chunk of a slice takes the slice's coefficients, and a rotated term's twin is one aligned vector. Matryoshka
// widths are multiples of 16 or 32 in practice; any other widths take the general path (per-element chunks).
template <typename scalar_t>
bool use_dims_vector_path(const scalar_t* x, int64_t num_groups, int64_t dim, int64_t stride_g, int64_t stride_k,
                          int64_t stride_d, const PrefixWidths& widths, bool with_angle) {
  constexpr int64_t V = Vec16<scalar_t>::kSize;
  if (!use_vector_path(x, num_groups, dim, stride_g, stride_k, stride_d, false)) return false;
  for (int i = 0; i < widths.count; ++i) {
    if (widths.width[i] % (with_angle ? 2 * V : V) != 0) return false;
  }
  return true;
}

template <typename scalar_t>
cudaError_t pair_scores_dims_fwd(const scalar_t* x, int64_t num_groups, int64_t group_size, int64_t dim,
                                 int64_t stride_g, int64_t stride_k, int64_t stride_d, const int64_t* dims,
                                 int64_t num_dims, bool with_angle, acc_t<scalar_t>* cos_out,
                                 acc_t<scalar_t>* angle_out, acc_t<scalar_t>* stats_out, cudaStream_t stream) {
  PrefixWidths widths;
  if (group_size < 2 || dim < 1 || num_groups < 0 || !fill_prefix_widths(dims, num_dims, dim, with_angle, &widths)) {
    return cudaErrorInvalidValue;
  }
  const int64_t pairs = num_groups * (group_size - 1);
  if (pairs == 0) return cudaSuccess;
  const bool vec = use_dims_vector_path(x, num_groups, dim, stride_g, stride_k, stride_d, widths, with_angle);
  const int log2_team = vector_team_log2(widths.width[widths.count - 1] / (vec ? Vec16<scalar_t>::kSize : 1));
  const int64_t teams_per_block = kPairScoresThreads >> log2_team;
  const int64_t blocks = (pairs + teams_per_block - 1) / teams_per_block;
  if (blocks > kMaxBlocks) return cudaErrorInvalidValue;
  const auto kernel =
      vec ? _pair_scores_dims_fwd_kernel<scalar_t, true> : _pair_scores_dims_fwd_kernel<scalar_t, false>;
  kernel<<<static_cast<unsigned>(blocks), kPairScoresThreads, 0, stream>>>(
      x, num_groups, group_size, stride_g, stride_k, stride_d, widths, with_angle, log2_team, cos_out, angle_out,
      stats_out);
  return cudaGetLastError();
}

// The backward's shared memory per group (team): kSliceCoefs per pair, kRotCoefs per prefix and pair, one scale per
// prefix.
template <typename scalar_t>
size_t pair_scores_dims_coef_bytes(int64_t group_size, int64_t num_dims) {
  const int64_t pairs = group_size - 1;
  return static_cast<size_t>(pairs * (kSliceCoefs + num_dims * kRotCoefs) + num_dims) * sizeof(acc_t<scalar_t>);
}

// Largest K the prefixes' backward supports with num_dims prefixes: one group's coefficients in shared memory.
template <typename scalar_t>
int64_t pair_scores_dims_bwd_max_group_size(int64_t num_dims) {
  const int64_t values = static_cast<int64_t>(kMaxStaticSmem / sizeof(acc_t<scalar_t>)) - num_dims;
  return 1 + values / (kSliceCoefs + num_dims * kRotCoefs);
}

template <typename scalar_t>
cudaError_t pair_scores_dims_bwd(const acc_t<scalar_t>* grad_cos, const acc_t<scalar_t>* grad_angle,
                                 const scalar_t* x, const acc_t<scalar_t>* stats, int64_t num_groups,
                                 int64_t group_size, int64_t dim, int64_t stride_g, int64_t stride_k,
                                 int64_t stride_d, const int64_t* dims, int64_t num_dims, bool with_angle,
                                 scalar_t* dx, cudaStream_t stream) {
  PrefixWidths widths;
  if (group_size < 2 || dim < 1 || num_groups < 0 || !fill_prefix_widths(dims, num_dims, dim, with_angle, &widths)) {
    return cudaErrorInvalidValue;
  }
  if (num_groups == 0) return cudaSuccess;
  const size_t coef_bytes_per_group = pair_scores_dims_coef_bytes<scalar_t>(group_size, num_dims);
  if (coef_bytes_per_group > kMaxStaticSmem) return cudaErrorInvalidValue;
  const bool vec = use_dims_vector_path(x, num_groups, dim, stride_g, stride_k, stride_d, widths, with_angle) &&
                   reinterpret_cast<uintptr_t>(dx) % 16 == 0;
  int log2_team = vector_team_log2(widths.width[widths.count - 1] / (vec ? Vec16<scalar_t>::kSize : 1));
  // As many teams per block as the coefficients allow: fewer warps first, then fewer (larger) teams per warp.
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
  const auto kernel =
      vec ? _pair_scores_dims_bwd_kernel<scalar_t, true> : _pair_scores_dims_bwd_kernel<scalar_t, false>;
  kernel<<<static_cast<unsigned>(blocks), threads, coef_bytes_per_group * teams_per_block, stream>>>(
      grad_cos, grad_angle, x, stats, num_groups, group_size, dim, stride_g, stride_k, stride_d, widths, with_angle,
      log2_team, dx);
  return cudaGetLastError();
}

// Explicit instantiations: the binding (csrc/pair_scores.cpp) declares these and links against them.
#define ANGLE_KERNELS_INSTANTIATE_PAIR_SCORES(T)                                                                  \
  template cudaError_t pair_scores_fwd<T>(const T*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool,    \
                                          acc_t<T>*, acc_t<T>*, acc_t<T>*, cudaStream_t);                          \
  template cudaError_t pair_scores_bwd<T>(const acc_t<T>*, const acc_t<T>*, const T*, const acc_t<T>*, int64_t,    \
                                          int64_t, int64_t, int64_t, int64_t, int64_t, bool, T*, cudaStream_t);    \
  template int64_t pair_scores_bwd_max_group_size<T>();                                                           \
  template cudaError_t pair_scores_dims_fwd<T>(const T*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,     \
                                               const int64_t*, int64_t, bool, acc_t<T>*, acc_t<T>*, acc_t<T>*,     \
                                               cudaStream_t);                                                      \
  template cudaError_t pair_scores_dims_bwd<T>(const acc_t<T>*, const acc_t<T>*, const T*, const acc_t<T>*,       \
                                               int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,              \
                                               const int64_t*, int64_t, bool, T*, cudaStream_t);                   \
  template int64_t pair_scores_dims_bwd_max_group_size<T>(int64_t);
ANGLE_KERNELS_INSTANTIATE_PAIR_SCORES(float)
ANGLE_KERNELS_INSTANTIATE_PAIR_SCORES(double)
ANGLE_KERNELS_INSTANTIATE_PAIR_SCORES(__half)
ANGLE_KERNELS_INSTANTIATE_PAIR_SCORES(__nv_bfloat16)
#undef ANGLE_KERNELS_INSTANTIATE_PAIR_SCORES

}  // namespace angle_kernels

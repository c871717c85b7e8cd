// Similarity cross-entropy: in-batch negatives, contrastive-with-negatives and ArcCon, flash-style.
//
// What it computes (the contract in angle_kernels/dispatch.py):
//   l[i, j] = scale * cos(q_i, c_j), except at the target column t_i (t_i = i xor 1 "partner", or i
//   "diagonal") where the cosine is replaced by cos(min(arccos(cos) + margin, pi)), evaluated as
//   cos*cos(m) - sqrt(max(1 - cos^2, 1e-6)) * sin(m), and by -1 once arccos(cos) + m passes pi.
//   Columns C_i: all j < Mc, minus j == i with exclude_diagonal. Positives P_i: t_i, plus (group_ids given)
//   every j in C_i with gid[j] == gid[i] or gid[j] == gid[t_i].
//   loss = (1/M) sum_i w_i (logsumexp_{C_i} l[i, :] - logsumexp_{P_i} l[i, :]).
//
// Memory: O(M + Mc) state. The forward walks column tiles with an online logsumexp per row (for C_i and
// for P_i) and saves only the row norms and the two logsumexps per row. The backward recomputes every
// tile: with H[i, j] = dL/dcos[i, j] = (g w_i / M) (softmax_C - softmax_P)[i, j] * scale * (dcos_eff/dcos),
//   dq_i = sum_j H_ij c_j / (|q_i| |c_j|) - (sum_j H_ij cos_ij) q_i / |q_i|^2      (norm term dropped if
//   dc_j = sum_i H_ij q_i / (|q_i| |c_j|) - (sum_i H_ij cos_ij) c_j / |c_j|^2       the norm is clamped)
// The tile kernel accumulates the bracketed sums into float32 (float64) scratch with atomics; a final
// elementwise kernel applies the norms and casts to the input dtype. The normalisation's backward is thus
// applied once at the end, never materialising normalised copies of q or c.
//
// The floor: forward 2 M Mc D FLOPs (the dot tiles), backward 2 M Mc D (recomputed tiles) + 4 M Mc D
// (dq and dc); reads of q and c are O((M + Mc) D) per pass when tiles stay in L2. For D >= ~128 this is
// compute bound.
//
// Precision and tensor cores:
//   * bf16 / fp16 inputs: the dot tiles use tensor cores through WMMA (16x16x16, operands in the input
//     dtype, fp32 accumulation). The operands are the raw (unnormalised) inputs, so no extra rounding is
//     introduced; cosines are formed in fp32 from the dots and fp32 row norms.
//   * float32 inputs: CUDA-core fp32 FMA tiles (TF32 tensor cores would cost ~1e-3 relative error, outside
//     the float32 tolerance; they are not used). float64 inputs: the same tile code in double.
//   * The backward's dq / dc products run on CUDA cores in fp32 (fp64) and are added to the scratch with
//     atomics: simple and exact to rounding, but not deterministic bit-for-bit and not tensor-core speed.
//     A faster backward (per-block dq ownership, WMMA for the gradient products) is future work.
//   * Huge rows (common.cuh, row scaling): the row-norm pass also finds each row's scale s (a power of two, 1 for
//     ordinary rows and for every __half row, whose products cannot overflow the fp32 accumulation), online, and
//     the norm buffers hold [the scaled rows' norms | the scales] (2 * rows values). The tiles are dot products
//     of the scaled rows: each operand element is multiplied by its row's scale as it is staged into shared
//     memory (exact; one multiply per staged element, which 64 multiply-adds of the tile then use; a barrier
//     per tile publishes the scales first), and the gradient chunks take x_hat = (s x) / max(|x_s|, eps s).
//     The finish kernel applies s once more: dx = s * (acc * inv_s - coef * inv_s^2 * x_s).

#include <mma.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "common.cuh"

namespace angle_kernels {

constexpr int kXentThreads = 256;
constexpr int kXentGradChunk = 32;  // D columns handled per step of the backward's gradient products
constexpr double kSinSqFloor = 1e-6;

// Tile shapes per input type. BM x BN is the (rows of q) x (rows of c) tile; BK the D step of the dot tile.
template <typename scalar_t>
struct XentTile {  // float: CUDA cores
  static constexpr int BM = 64, BN = 64, BK = 16, KPAD = 1;
  static constexpr bool kUseWmma = false;
  using operand_t = float;
};
template <>
struct XentTile<double> {  // double: CUDA cores, smaller tiles so shared memory stays under 48 KB
  static constexpr int BM = 32, BN = 32, BK = 16, KPAD = 1;
  static constexpr bool kUseWmma = false;
  using operand_t = double;
};
template <>
struct XentTile<__half> {  // tensor cores; KPAD keeps rows 16-byte aligned and spreads banks
  static constexpr int BM = 64, BN = 64, BK = 32, KPAD = 8;
  static constexpr bool kUseWmma = true;
  using operand_t = __half;
};
template <>
struct XentTile<__nv_bfloat16> {
  static constexpr int BM = 64, BN = 64, BK = 32, KPAD = 8;
  static constexpr bool kUseWmma = true;
  using operand_t = __nv_bfloat16;
};

// Everything a block keeps in shared memory. `dots` holds the raw dot tile, then (backward) H in place.
template <typename scalar_t>
struct XentShared {
  using Tile = XentTile<scalar_t>;
  using acc = acc_t<scalar_t>;
  using operand_t = typename Tile::operand_t;
  static constexpr int kDotsLd = Tile::BN + 4;  // multiple of 4 (WMMA float store), breaks bank aliasing
  alignas(128) acc dots[Tile::BM][kDotsLd];
  alignas(128) operand_t q_tile[Tile::BM][Tile::BK + Tile::KPAD];
  alignas(128) operand_t c_tile[Tile::BN][Tile::BK + Tile::KPAD];
  acc row_inv_norm[Tile::BM];  // 1 / max(|q_s|, eps s): of the scaled rows
  acc col_inv_norm[Tile::BN];
  acc row_scale[Tile::BM];  // the rows' scales (powers of two)
  acc col_scale[Tile::BN];
  int64_t row_target[Tile::BM];
  int64_t row_group[Tile::BM];     // gid[i]
  int64_t target_group[Tile::BM];  // gid[t_i]
  int64_t col_group[Tile::BN];
  // Backward only.
  acc row_lse_all[Tile::BM];
  acc row_lse_pos[Tile::BM];
  acc row_grad_scale[Tile::BM];  // g * w_i / M
  acc col_sum[Tile::BN];         // sum_i H_ij cos_ij for this tile
  acc q_chunk[Tile::BM][kXentGradChunk];
  acc c_chunk[Tile::BN][kXentGradChunk];
};

// Kernel-side view of the problem (the host's XentProblem plus derived constants in the compute type).
template <typename scalar_t>
struct XentParams {
  using acc = acc_t<scalar_t>;
  const scalar_t* q;
  int64_t rows_q, q_stride_row, q_stride_dim;
  const scalar_t* c;
  int64_t rows_c, c_stride_row, c_stride_dim;
  int64_t dim;
  acc scale;
  int target;
  bool exclude_diagonal;
  bool has_margin;
  acc cos_margin, sin_margin;
  const int64_t* group_ids;
  const acc* row_weights;
};

// ---------------------------------------------------------------------------------------------------------
// Row norms: one warp per row. norms[row] = |x_s|, the norm of the scaled row, and norms[rows + row] = s, its
// scale, found online (each lane's running exponent, then the warp's largest).
// ---------------------------------------------------------------------------------------------------------
template <typename scalar_t>
__global__ void __launch_bounds__(kXentThreads)
    _row_norms_kernel(const scalar_t* __restrict__ x, int64_t rows, int64_t dim, int64_t stride_row,
                      int64_t stride_dim, acc_t<scalar_t>* __restrict__ norms) {
  using acc = acc_t<scalar_t>;
  constexpr bool kScaleRows = !std::is_same<scalar_t, __half>::value;  // __half: no product can overflow
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kXentThreads / kWarpSize) + threadIdx.x / kWarpSize;
  if (row >= rows) return;
  const int lane = threadIdx.x % kWarpSize;
  acc sum_sq = 0;
  int exponent = 0;
  acc scale = 1;
  for (int64_t d = lane; d < dim; d += kWarpSize) {
    acc v = load_as<acc>(x + row * stride_row + d * stride_dim);
    if (kScaleRows) {
      const acc factor = raise_exponent(&exponent, abs_acc(v));
      if (factor != acc(1)) {
        sum_sq *= factor * factor;
        scale = pow2<acc>(-exponent);
      }
      v *= scale;
    }
    sum_sq += v * v;
  }
  const int row_exp = warp_max(exponent);
  const acc factor = pow2<acc>(exponent - row_exp);
  sum_sq = warp_sum(sum_sq * (factor * factor));
  if (lane == 0) {
    norms[row] = sqrt_acc(sum_sq);
    norms[rows + row] = pow2<acc>(-row_exp);
  }
}

// ---------------------------------------------------------------------------------------------------------
// The target cosine with the additive angular margin, and its derivative with respect to cos.
// ---------------------------------------------------------------------------------------------------------
template <typename acc>
__device__ __forceinline__ acc margin_cos(acc cos, const acc cos_m, const acc sin_m, acc* dcos_out) {
  if (cos < -cos_m) {  // arccos(cos) + m > pi: clamped to pi, cos(pi) = -1, flat
    *dcos_out = acc(0);
    return acc(-1);
  }
  const acc one_minus_sq = acc(1) - cos * cos;
  const bool floored = !(one_minus_sq > static_cast<acc>(kSinSqFloor));
  const acc sin = sqrt_acc(floored ? static_cast<acc>(kSinSqFloor) : one_minus_sq);
  *dcos_out = floored ? cos_m : cos_m + sin_m * cos / sin;
  return cos * cos_m - sin * sin_m;
}

// ---------------------------------------------------------------------------------------------------------
// The dot tile of the scaled rows S[r][j] = q_s[row0 + r] . c_s[col0 + j] over all of D (zero outside the
// matrices). Reads the rows' scales from the tile's metadata, which must be in shared memory (and published by a
// barrier) before the call. Ends with the tile in shared memory; the caller synchronises before reading it.
// ---------------------------------------------------------------------------------------------------------
// One element of a scaled row as an operand: s x in the operand type, exact (s is a power of two; always 1 for
// __half, whose rows are never scaled).
__device__ __forceinline__ float scaled_operand(const float* p, float scale) { return *p * scale; }
__device__ __forceinline__ double scaled_operand(const double* p, double scale) { return *p * scale; }
__device__ __forceinline__ __half scaled_operand(const __half* p, float) { return *p; }
__device__ __forceinline__ __nv_bfloat16 scaled_operand(const __nv_bfloat16* p, float scale) {
  return scale == 1.0f ? *p : __float2bfloat16_rn(__bfloat162float(*p) * scale);
}

template <typename scalar_t>
__device__ __forceinline__ void load_operand_tiles(const XentParams<scalar_t>& p, XentShared<scalar_t>& sh,
                                                   int64_t row0, int64_t col0, int64_t k0) {
  using Tile = XentTile<scalar_t>;
  using operand_t = typename Tile::operand_t;
  for (int idx = threadIdx.x; idx < Tile::BM * Tile::BK; idx += kXentThreads) {
    const int r = idx / Tile::BK, k = idx % Tile::BK;
    const int64_t row = row0 + r, d = k0 + k;
    operand_t v{};  // zero (value-initialised); operand_t(0.0f) does not exist for __half/bf16 in torch's build
    if (row < p.rows_q && d < p.dim) v = scaled_operand(p.q + row * p.q_stride_row + d * p.q_stride_dim, sh.row_scale[r]);
    sh.q_tile[r][k] = v;
  }
  for (int idx = threadIdx.x; idx < Tile::BN * Tile::BK; idx += kXentThreads) {
    const int j = idx / Tile::BK, k = idx % Tile::BK;
    const int64_t col = col0 + j, d = k0 + k;
    operand_t v{};
    if (col < p.rows_c && d < p.dim) v = scaled_operand(p.c + col * p.c_stride_row + d * p.c_stride_dim, sh.col_scale[j]);
    sh.c_tile[j][k] = v;
  }
}

template <typename scalar_t>
__device__ __forceinline__ void compute_dot_tile(const XentParams<scalar_t>& p, XentShared<scalar_t>& sh,
                                                 int64_t row0, int64_t col0) {
  using Tile = XentTile<scalar_t>;
  using acc = acc_t<scalar_t>;
  if constexpr (Tile::kUseWmma) {
    namespace wmma = nvcuda::wmma;
    static_assert(Tile::BM == 64 && Tile::BN == 64 && Tile::BK % 16 == 0, "WMMA warp layout assumes 64x64 tiles");
    // 8 warps over a 4 x 4 grid of 16 x 16 fragments: warp w owns fragment row w % 4, columns 2(w/4), 2(w/4)+1.
    const int warp = threadIdx.x / kWarpSize;
    const int frag_row = warp % 4, frag_col = (warp / 4) * 2;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc0, acc1;
    wmma::fill_fragment(acc0, 0.0f);
    wmma::fill_fragment(acc1, 0.0f);
    for (int64_t k0 = 0; k0 < p.dim; k0 += Tile::BK) {
      load_operand_tiles(p, sh, row0, col0, k0);
      __syncthreads();
#pragma unroll
      for (int ks = 0; ks < Tile::BK; ks += 16) {
        // A = q tile (row major); B = c tile transposed: element (k, n) lives at c_tile[n][k] = column major.
        wmma::fragment<wmma::matrix_a, 16, 16, 16, scalar_t, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, scalar_t, wmma::col_major> b0, b1;
        constexpr int ld = Tile::BK + Tile::KPAD;
        wmma::load_matrix_sync(a, &sh.q_tile[frag_row * 16][ks], ld);
        wmma::load_matrix_sync(b0, &sh.c_tile[frag_col * 16][ks], ld);
        wmma::load_matrix_sync(b1, &sh.c_tile[(frag_col + 1) * 16][ks], ld);
        wmma::mma_sync(acc0, a, b0, acc0);
        wmma::mma_sync(acc1, a, b1, acc1);
      }
      __syncthreads();  // operand tiles are overwritten by the next step
    }
    constexpr int ld_dots = XentShared<scalar_t>::kDotsLd;
    wmma::store_matrix_sync(&sh.dots[frag_row * 16][frag_col * 16], acc0, ld_dots, wmma::mem_row_major);
    wmma::store_matrix_sync(&sh.dots[frag_row * 16][(frag_col + 1) * 16], acc1, ld_dots, wmma::mem_row_major);
  } else {
    // 16 x 16 threads; thread (ty, tx) owns rows ty + 16 a and columns tx + 16 b of the tile.
    constexpr int TM = Tile::BM / 16, TN = Tile::BN / 16;
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    acc sums[TM][TN];
#pragma unroll
    for (int a = 0; a < TM; ++a)
#pragma unroll
      for (int b = 0; b < TN; ++b) sums[a][b] = acc(0);
    for (int64_t k0 = 0; k0 < p.dim; k0 += Tile::BK) {
      load_operand_tiles(p, sh, row0, col0, k0);
      __syncthreads();
#pragma unroll
      for (int k = 0; k < Tile::BK; ++k) {
        acc q_vals[TM], c_vals[TN];
#pragma unroll
        for (int a = 0; a < TM; ++a) q_vals[a] = sh.q_tile[ty + 16 * a][k];
#pragma unroll
        for (int b = 0; b < TN; ++b) c_vals[b] = sh.c_tile[tx + 16 * b][k];
#pragma unroll
        for (int a = 0; a < TM; ++a)
#pragma unroll
          for (int b = 0; b < TN; ++b) sums[a][b] += q_vals[a] * c_vals[b];
      }
      __syncthreads();
    }
#pragma unroll
    for (int a = 0; a < TM; ++a)
#pragma unroll
      for (int b = 0; b < TN; ++b) sh.dots[ty + 16 * a][tx + 16 * b] = sums[a][b];
  }
}

// Per-row and per-column metadata of a tile. Rows/columns outside the matrices get harmless values.
template <typename scalar_t>
__device__ __forceinline__ void load_row_meta(const XentParams<scalar_t>& p, const acc_t<scalar_t>* q_norm,
                                              XentShared<scalar_t>& sh, int64_t row0) {
  using Tile = XentTile<scalar_t>;
  for (int r = threadIdx.x; r < Tile::BM; r += kXentThreads) {
    const int64_t i = row0 + r;
    const bool valid = i < p.rows_q;
    const int64_t t = p.target == kTargetPartner ? (i ^ 1) : i;
    const acc_t<scalar_t> scale = valid ? q_norm[p.rows_q + i] : acc_t<scalar_t>(1);  // [norms | scales]
    sh.row_scale[r] = scale;
    sh.row_inv_norm[r] = valid ? inv_clamped_norm(q_norm[i], scale) : acc_t<scalar_t>(0);
    sh.row_target[r] = valid ? t : -1;
    sh.row_group[r] = (valid && p.group_ids) ? p.group_ids[i] : 0;
    sh.target_group[r] = (valid && p.group_ids) ? p.group_ids[t] : 0;  // t < rows_c = rows_q (checked by the binding)
  }
}

template <typename scalar_t>
__device__ __forceinline__ void load_col_meta(const XentParams<scalar_t>& p, const acc_t<scalar_t>* c_norm,
                                              XentShared<scalar_t>& sh, int64_t col0) {
  using Tile = XentTile<scalar_t>;
  for (int j = threadIdx.x; j < Tile::BN; j += kXentThreads) {
    const int64_t col = col0 + j;
    const bool valid = col < p.rows_c;
    const acc_t<scalar_t> scale = valid ? c_norm[p.rows_c + col] : acc_t<scalar_t>(1);  // [norms | scales]
    sh.col_scale[j] = scale;
    sh.col_inv_norm[j] = valid ? inv_clamped_norm(c_norm[col], scale) : acc_t<scalar_t>(0);
    sh.col_group[j] = (valid && p.group_ids) ? p.group_ids[col] : 0;
  }
}

// ---------------------------------------------------------------------------------------------------------
// Forward: one block per tile of BM rows, walking every column tile. In the epilogue of a tile,
// TPR = 256 / BM consecutive threads share a row, each taking every TPR-th column, and keep two online
// logsumexps (all columns, positives) that are merged across the TPR lanes at the end.
// ---------------------------------------------------------------------------------------------------------
template <typename scalar_t>
__global__ void __launch_bounds__(kXentThreads)
    _similarity_xent_fwd_kernel(const XentParams<scalar_t> p, const acc_t<scalar_t>* __restrict__ q_norm,
                                const acc_t<scalar_t>* __restrict__ c_norm, acc_t<scalar_t>* __restrict__ lse_all_out,
                                acc_t<scalar_t>* __restrict__ lse_pos_out, acc_t<scalar_t>* __restrict__ row_loss_out) {
  using Tile = XentTile<scalar_t>;
  using acc = acc_t<scalar_t>;
  constexpr int TPR = kXentThreads / Tile::BM;
  __shared__ XentShared<scalar_t> sh;

  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * Tile::BM;
  const int r = threadIdx.x / TPR, sub = threadIdx.x % TPR;
  const int64_t i = row0 + r;
  load_row_meta(p, q_norm, sh, row0);

  OnlineLse<acc> lse_all, lse_pos;
  lse_all.init();
  lse_pos.init();
  for (int64_t col0 = 0; col0 < p.rows_c; col0 += Tile::BN) {
    load_col_meta(p, c_norm, sh, col0);
    __syncthreads();  // the tile's loads read the rows' scales from the metadata
    compute_dot_tile(p, sh, row0, col0);
    __syncthreads();
    if (i < p.rows_q) {
      const int64_t t = sh.row_target[r];
      for (int jj = sub; jj < Tile::BN; jj += TPR) {
        const int64_t j = col0 + jj;
        if (j >= p.rows_c || (p.exclude_diagonal && j == i)) continue;  // not in C_i
        const acc cos = sh.dots[r][jj] * sh.row_inv_norm[r] * sh.col_inv_norm[jj];
        const bool is_target = j == t;
        acc dcos_unused;
        const acc logit =
            p.scale * ((is_target && p.has_margin) ? margin_cos(cos, p.cos_margin, p.sin_margin, &dcos_unused) : cos);
        lse_all.add(logit);
        const bool same_group =
            p.group_ids && (sh.col_group[jj] == sh.row_group[r] || sh.col_group[jj] == sh.target_group[r]);
        if (is_target || same_group) lse_pos.add(logit);
      }
    }
    __syncthreads();  // dots and column metadata are overwritten by the next tile
  }
  lse_all.merge_lanes(TPR);
  lse_pos.merge_lanes(TPR);
  if (sub == 0 && i < p.rows_q) {
    const acc all = lse_all.value(), pos = lse_pos.value();
    const acc weight = p.row_weights ? p.row_weights[i] : acc(1);
    lse_all_out[i] = all;
    lse_pos_out[i] = pos;
    row_loss_out[i] = weight == acc(0) ? acc(0) : weight * (all - pos);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Backward: one block per (row tile, column tile). Recompute the dot tile, turn it into H in place, add the
// row and column sums of H * cos to q_coef / c_coef, then walk D in chunks of 32 columns:
//   dq_acc[i, d] += sum_j H_ij c_jd / |c_j|,   dc_acc[j, d] += sum_i H_ij q_id / |q_i|.
// ---------------------------------------------------------------------------------------------------------
template <typename scalar_t>
__global__ void __launch_bounds__(kXentThreads)
    _similarity_xent_bwd_kernel(const XentParams<scalar_t> p, const acc_t<scalar_t>* __restrict__ grad_loss,
                                const acc_t<scalar_t>* __restrict__ q_norm, const acc_t<scalar_t>* __restrict__ c_norm,
                                const acc_t<scalar_t>* __restrict__ lse_all, const acc_t<scalar_t>* __restrict__ lse_pos,
                                int64_t col_tiles, acc_t<scalar_t>* dq_acc, acc_t<scalar_t>* dc_acc,
                                acc_t<scalar_t>* q_coef, acc_t<scalar_t>* c_coef) {
  // dq_acc/dc_acc and q_coef/c_coef alias each other in the symmetric case: no __restrict__ on them.
  using Tile = XentTile<scalar_t>;
  using acc = acc_t<scalar_t>;
  constexpr int TPR = kXentThreads / Tile::BM;
  constexpr int kRowsPerPass = kXentThreads / kXentGradChunk;
  __shared__ XentShared<scalar_t> sh;

  const int64_t tile = blockIdx.x;
  const int64_t row0 = (tile / col_tiles) * Tile::BM, col0 = (tile % col_tiles) * Tile::BN;
  const int r = threadIdx.x / TPR, sub = threadIdx.x % TPR;
  const int64_t i = row0 + r;

  load_row_meta(p, q_norm, sh, row0);
  load_col_meta(p, c_norm, sh, col0);
  const acc grad_over_rows = grad_loss[0] / static_cast<acc>(p.rows_q);
  for (int rr = threadIdx.x; rr < Tile::BM; rr += kXentThreads) {
    const int64_t row = row0 + rr;
    const bool valid = row < p.rows_q;
    sh.row_lse_all[rr] = valid ? lse_all[row] : acc(0);
    sh.row_lse_pos[rr] = valid ? lse_pos[row] : acc(0);
    sh.row_grad_scale[rr] = valid ? grad_over_rows * (p.row_weights ? p.row_weights[row] : acc(1)) : acc(0);
  }
  for (int j = threadIdx.x; j < Tile::BN; j += kXentThreads) sh.col_sum[j] = acc(0);
  __syncthreads();  // the tile's loads read the rows' scales from the metadata
  compute_dot_tile(p, sh, row0, col0);
  __syncthreads();

  // H in place of the dots; row sums of H * cos to q_coef, column sums via shared atomics to c_coef.
  acc row_part = 0;
  {
    const int64_t t = sh.row_target[r];
    const acc row_scale = sh.row_grad_scale[r];
    for (int jj = sub; jj < Tile::BN; jj += TPR) {
      const int64_t j = col0 + jj;
      acc h = 0;
      const acc cos = sh.dots[r][jj] * sh.row_inv_norm[r] * sh.col_inv_norm[jj];
      const bool in_columns = i < p.rows_q && j < p.rows_c && !(p.exclude_diagonal && j == i);
      if (in_columns && row_scale != acc(0)) {
        const bool is_target = j == t;
        acc dlogit_dcos = p.scale;
        acc effective_cos = cos;
        if (is_target && p.has_margin) {
          acc dmargin;
          effective_cos = margin_cos(cos, p.cos_margin, p.sin_margin, &dmargin);
          dlogit_dcos *= dmargin;
        }
        const acc logit = p.scale * effective_cos;
        const bool same_group =
            p.group_ids && (sh.col_group[jj] == sh.row_group[r] || sh.col_group[jj] == sh.target_group[r]);
        const acc softmax_all = exp_acc(logit - sh.row_lse_all[r]);
        const acc softmax_pos = (is_target || same_group) ? exp_acc(logit - sh.row_lse_pos[r]) : acc(0);
        h = row_scale * (softmax_all - softmax_pos) * dlogit_dcos;
      }
      sh.dots[r][jj] = h;  // this thread is the only reader and writer of this element here
      if (h != acc(0)) {
        row_part += h * cos;
        atomicAdd(&sh.col_sum[jj], h * cos);
      }
    }
  }
  for (int offset = TPR / 2; offset > 0; offset /= 2) row_part += __shfl_xor_sync(0xffffffffu, row_part, offset);
  if (sub == 0 && i < p.rows_q && row_part != acc(0)) atomicAdd(&q_coef[i], row_part);
  __syncthreads();
  for (int j = threadIdx.x; j < Tile::BN; j += kXentThreads) {
    if (col0 + j < p.rows_c && sh.col_sum[j] != acc(0)) atomicAdd(&c_coef[col0 + j], sh.col_sum[j]);
  }

  // Gradient products, 32 columns of D at a time. Lane = d within the chunk, so the H reads are broadcasts
  // and the chunk reads and the atomics are contiguous.
  const int d_lane = threadIdx.x % kXentGradChunk;
  for (int64_t d0 = 0; d0 < p.dim; d0 += kXentGradChunk) {
    for (int idx = threadIdx.x; idx < Tile::BM * kXentGradChunk; idx += kXentThreads) {
      const int rr = idx / kXentGradChunk, dd = idx % kXentGradChunk;
      const int64_t row = row0 + rr, d = d0 + dd;
      // q_hat = q / max(|q|, eps) = (s q) / max(|q_s|, eps s): the scaled row times its inverse norm
      sh.q_chunk[rr][dd] = (row < p.rows_q && d < p.dim)
                               ? load_as<acc>(p.q + row * p.q_stride_row + d * p.q_stride_dim) * sh.row_scale[rr] *
                                     sh.row_inv_norm[rr]
                               : acc(0);
    }
    for (int idx = threadIdx.x; idx < Tile::BN * kXentGradChunk; idx += kXentThreads) {
      const int jj = idx / kXentGradChunk, dd = idx % kXentGradChunk;
      const int64_t col = col0 + jj, d = d0 + dd;
      sh.c_chunk[jj][dd] = (col < p.rows_c && d < p.dim)
                               ? load_as<acc>(p.c + col * p.c_stride_row + d * p.c_stride_dim) * sh.col_scale[jj] *
                                     sh.col_inv_norm[jj]
                               : acc(0);
    }
    __syncthreads();
    const int64_t d = d0 + d_lane;
    if (d < p.dim) {
      for (int rr = threadIdx.x / kXentGradChunk; rr < Tile::BM; rr += kRowsPerPass) {
        if (row0 + rr >= p.rows_q) break;
        acc sum = 0;
#pragma unroll 8
        for (int jj = 0; jj < Tile::BN; ++jj) sum += sh.dots[rr][jj] * sh.c_chunk[jj][d_lane];
        if (sum != acc(0)) atomicAdd(&dq_acc[(row0 + rr) * p.dim + d], sum);
      }
      for (int jj = threadIdx.x / kXentGradChunk; jj < Tile::BN; jj += kRowsPerPass) {
        if (col0 + jj >= p.rows_c) break;
        acc sum = 0;
#pragma unroll 8
        for (int rr = 0; rr < Tile::BM; ++rr) sum += sh.dots[rr][jj] * sh.q_chunk[rr][d_lane];
        if (sum != acc(0)) atomicAdd(&dc_acc[(col0 + jj) * p.dim + d], sum);
      }
    }
    __syncthreads();  // chunks are overwritten by the next step
  }
}

// ---------------------------------------------------------------------------------------------------------
// Finish: dx[i, d] = acc[i, d] / max(|x_i|, eps) - coef[i] x[i, d] / |x_i|^2, cast to the input dtype; on the
// scaled rows (norms: [|x_s| | s]): dx = s (acc / max(|x_s|, eps s) - coef x_s / |x_s|^2).
// ---------------------------------------------------------------------------------------------------------
template <typename scalar_t>
__global__ void __launch_bounds__(kXentThreads)
    _similarity_xent_finish_kernel(const scalar_t* __restrict__ x, int64_t rows, int64_t dim, int64_t stride_row,
                                   int64_t stride_dim, const acc_t<scalar_t>* __restrict__ norms,
                                   const acc_t<scalar_t>* __restrict__ grad_acc, const acc_t<scalar_t>* __restrict__ coef,
                                   scalar_t* __restrict__ dx) {
  using acc = acc_t<scalar_t>;
  const int64_t total = rows * dim;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * kXentThreads + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * kXentThreads) {
    const int64_t row = idx / dim, d = idx % dim;
    const acc norm = norms[row], scale = norms[rows + row];
    const acc xv = load_as<acc>(x + row * stride_row + d * stride_dim) * scale;
    dx[idx] = from_acc<scalar_t>(
        (grad_acc[idx] * inv_clamped_norm(norm, scale) - coef[row] * inv_sq_norm_or_zero(norm, scale) * xv) * scale);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Launchers.
// ---------------------------------------------------------------------------------------------------------
constexpr int64_t kXentMaxBlocks = 2147483647;

template <typename scalar_t>
static bool make_params(const XentProblem<scalar_t>& problem, XentParams<scalar_t>* out) {
  using acc = acc_t<scalar_t>;
  if (problem.rows_q < 0 || problem.rows_c < 0 || problem.dim < 1) return false;
  if (problem.target != kTargetPartner && problem.target != kTargetDiagonal) return false;
  if (!(problem.margin >= 0.0)) return false;
  if (problem.group_ids && !problem.symmetric) return false;
  XentParams<scalar_t> p;
  p.q = problem.q;
  p.rows_q = problem.rows_q;
  p.q_stride_row = problem.q_stride_row;
  p.q_stride_dim = problem.q_stride_dim;
  p.c = problem.c;
  p.rows_c = problem.rows_c;
  p.c_stride_row = problem.c_stride_row;
  p.c_stride_dim = problem.c_stride_dim;
  p.dim = problem.dim;
  p.scale = static_cast<acc>(problem.scale);
  p.target = problem.target;
  p.exclude_diagonal = problem.exclude_diagonal;
  p.has_margin = problem.margin > 0.0;
  p.cos_margin = static_cast<acc>(std::cos(problem.margin));
  p.sin_margin = static_cast<acc>(std::sin(problem.margin));
  p.group_ids = problem.group_ids;
  p.row_weights = problem.row_weights;
  *out = p;
  return true;
}

template <typename scalar_t>
static cudaError_t launch_row_norms(const scalar_t* x, int64_t rows, int64_t dim, int64_t stride_row,
                                    int64_t stride_dim, acc_t<scalar_t>* norms, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  constexpr int warps = kXentThreads / kWarpSize;
  const int64_t blocks = (rows + warps - 1) / warps;
  if (blocks > kXentMaxBlocks) return cudaErrorInvalidValue;
  _row_norms_kernel<scalar_t><<<static_cast<unsigned>(blocks), kXentThreads, 0, stream>>>(x, rows, dim, stride_row,
                                                                                         stride_dim, norms);
  return cudaGetLastError();
}

template <typename scalar_t>
cudaError_t similarity_xent_fwd(const XentProblem<scalar_t>& problem, acc_t<scalar_t>* q_norm,
                                acc_t<scalar_t>* c_norm, acc_t<scalar_t>* lse_all, acc_t<scalar_t>* lse_pos,
                                acc_t<scalar_t>* row_loss, cudaStream_t stream) {
  using Tile = XentTile<scalar_t>;
  XentParams<scalar_t> p;
  if (!make_params(problem, &p)) return cudaErrorInvalidValue;
  if (p.rows_q == 0) return cudaSuccess;
  cudaError_t err = launch_row_norms(p.q, p.rows_q, p.dim, p.q_stride_row, p.q_stride_dim, q_norm, stream);
  if (err != cudaSuccess) return err;
  if (!problem.symmetric) {
    err = launch_row_norms(p.c, p.rows_c, p.dim, p.c_stride_row, p.c_stride_dim, c_norm, stream);
    if (err != cudaSuccess) return err;
  }
  const int64_t blocks = (p.rows_q + Tile::BM - 1) / Tile::BM;
  if (blocks > kXentMaxBlocks) return cudaErrorInvalidValue;
  _similarity_xent_fwd_kernel<scalar_t><<<static_cast<unsigned>(blocks), kXentThreads, 0, stream>>>(
      p, q_norm, problem.symmetric ? q_norm : c_norm, lse_all, lse_pos, row_loss);
  return cudaGetLastError();
}

template <typename scalar_t>
cudaError_t similarity_xent_bwd(const XentProblem<scalar_t>& problem, const acc_t<scalar_t>* grad_loss,
                                const acc_t<scalar_t>* q_norm, const acc_t<scalar_t>* c_norm,
                                const acc_t<scalar_t>* lse_all, const acc_t<scalar_t>* lse_pos,
                                acc_t<scalar_t>* dq_acc, acc_t<scalar_t>* dc_acc, acc_t<scalar_t>* q_coef,
                                acc_t<scalar_t>* c_coef, scalar_t* dq, scalar_t* dc, cudaStream_t stream) {
  using Tile = XentTile<scalar_t>;
  XentParams<scalar_t> p;
  if (!make_params(problem, &p)) return cudaErrorInvalidValue;
  if (p.rows_q == 0) return cudaSuccess;
  const acc_t<scalar_t>* col_norm = problem.symmetric ? q_norm : c_norm;
  const int64_t row_tiles = (p.rows_q + Tile::BM - 1) / Tile::BM;
  const int64_t col_tiles = (p.rows_c + Tile::BN - 1) / Tile::BN;
  if (col_tiles > 0) {
    if (row_tiles > kXentMaxBlocks / col_tiles) return cudaErrorInvalidValue;
    _similarity_xent_bwd_kernel<scalar_t><<<static_cast<unsigned>(row_tiles * col_tiles), kXentThreads, 0, stream>>>(
        p, grad_loss, q_norm, col_norm, lse_all, lse_pos, col_tiles, dq_acc, dc_acc, q_coef, c_coef);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  // The elementwise finish: a grid-stride loop, so a modest grid covers any size.
  auto finish = [&](const scalar_t* x, int64_t rows, int64_t stride_row, int64_t stride_dim, const acc_t<scalar_t>* norms,
                    const acc_t<scalar_t>* grad_acc, const acc_t<scalar_t>* coef, scalar_t* out) -> cudaError_t {
    const int64_t total = rows * p.dim;
    if (total == 0) return cudaSuccess;
    const int64_t blocks = std::min<int64_t>((total + kXentThreads - 1) / kXentThreads, 65536);
    _similarity_xent_finish_kernel<scalar_t><<<static_cast<unsigned>(blocks), kXentThreads, 0, stream>>>(
        x, rows, p.dim, stride_row, stride_dim, norms, grad_acc, coef, out);
    return cudaGetLastError();
  };
  cudaError_t err = finish(p.q, p.rows_q, p.q_stride_row, p.q_stride_dim, q_norm, dq_acc, q_coef, dq);
  if (err != cudaSuccess || problem.symmetric) return err;
  return finish(p.c, p.rows_c, p.c_stride_row, p.c_stride_dim, c_norm, dc_acc, c_coef, dc);
}

// Explicit instantiations: the binding (csrc/similarity_xent.cpp) declares these and links against them.
#define ANGLE_KERNELS_INSTANTIATE_XENT(T)                                                                           \
  template cudaError_t similarity_xent_fwd<T>(const XentProblem<T>&, acc_t<T>*, acc_t<T>*, acc_t<T>*, acc_t<T>*,     \
                                              acc_t<T>*, cudaStream_t);                                             \
  template cudaError_t similarity_xent_bwd<T>(const XentProblem<T>&, const acc_t<T>*, const acc_t<T>*,               \
                                              const acc_t<T>*, const acc_t<T>*, const acc_t<T>*, acc_t<T>*,          \
                                              acc_t<T>*, acc_t<T>*, acc_t<T>*, T*, T*, cudaStream_t);
ANGLE_KERNELS_INSTANTIATE_XENT(float)
ANGLE_KERNELS_INSTANTIATE_XENT(double)
ANGLE_KERNELS_INSTANTIATE_XENT(__half)
ANGLE_KERNELS_INSTANTIATE_XENT(__nv_bfloat16)
#undef ANGLE_KERNELS_INSTANTIATE_XENT

}  // namespace angle_kernels

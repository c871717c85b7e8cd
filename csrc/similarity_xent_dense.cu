// similarity_xent by the dense scheme: the tile kernels of one row block, on dot products cuBLAS made.
//
// What it computes (the contract in angle_kernels/dispatch.py, similarity_xent): for row i with target t_i (i ^ 1
// or i), columns C_i (every j, without j == i with exclude_diagonal) and positives P_i ({t_i}, with group ids also
// the columns of C_i in i's or t_i's group),
//   l_ij  = scale * cos_ij, at the target scale * cos(min(arccos(cos_it) + margin, pi))
//           (sin(theta) = sqrt(max(1 - cos^2, kXentSinSqFloor)): the contract's MARGIN_SIN_SQUARED_FLOOR)
//   loss  = (1 / M) sum_i w_i (logsumexp_{C_i} l_ij - logsumexp_{P_i} l_ij)
//
// The scheme (angle_kernels/cuda_ops/similarity_xent_dense.py orchestrates it, as triton_ops/
// similarity_xent_dense.py and _similarity_xent_dense_dims.py do for the Triton backend): per block of b rows,
// torch products (cuBLAS, 16-bit operands accumulated in fp32, fp64 in fp64) write the [b, Mc] tile P of raw dot
// products of the rows scaled by their powers of two (huge rows), and the kernels here read it:
//   _xent_dense_stats_kernel (forward)  one block per row: the row's online logsumexps over C_i and over P_i
//                                       (without groups the target logit itself).
//   _xent_dense_grad_kernel  (the gradient tile) a 16 x 256 tile per block: G_ij = coef_i scale (softmax_ij over
//                            C_i - softmax_ij over P_i), times the margin's slope at the target, 0 off C_i, rounded
//                            to the products' operand dtype; with `radial` the radial sums sum_j G_ij cos_ij (per
//                            row) and sum_i G_ij cos_ij (per column) of the normalisation's backward, one partial
//                            per tile.
// G carries neither 1 / M nor an inverse norm, and coef_i = w_i / max|w| (times grad_loss_j / max|grad_loss| with
// dims) is at most 1: its 16-bit copy neither underflows nor overflows; the Python side multiplies the fp32 products
// dq_hat = G c_unit, dc_hat += G^T q_unit by max|w| / M. At one width it forms them in forward for grad_loss = 1
// (nothing recomputed: 6 M Mc D FLOPs). With dims (every prefix d_1 < ... < d_k) the same kernels run once per
// prefix on its tile P_i (a running sum of slice products, each prefix with its own norms and lse), and backward,
// from the widest prefix down, also folds the running sum R_j = G_j + (q_inv_j+1 / q_inv_j) (c_inv_j+1 / c_inv_j)
// R_j+1 (DenseRunning): the tile the products of slice j take.
//
// Determinism: no atomics. Each row's statistics come from one block in a fixed reduction order; the radial sums
// are written per tile and reduced by the binding (at::sum); the products are cuBLAS's.
//
// The floor (per logit, fp32 tiles, 16-bit operands; the products' 6 M Mc D FLOPs at one width are cuBLAS's):
// 18 bytes at one width, the Triton dense scheme's: P written by the product and read by both kernels (12), G
// written in 2 bytes and read by the two products (6); against 6 D FLOPs, 256 FLOPs per byte at D = 768 and 1,365 at
// D = 4,096 (an H100 balances about 265). Each prefix of dims about 12 forward and 34 backward (the tile copied and
// added to; the running sum read and written in fp32). The kernels do ~40 instructions and two exps per logit read:
// bandwidth bound at these bytes.

#include <cmath>
#include <type_traits>

#include "common.cuh"
#include "dense_tiles.cuh"
#include "similarity_xent_dense_types.h"

namespace angle_kernels {

constexpr int kXentStatsThreads = 256;  // one block per row of the tile
constexpr int kXentGradThreads = kXentGradCols;
constexpr double kXentSinSqFloor = 1e-6;  // contract.MARGIN_SIN_SQUARED_FLOOR

__device__ __forceinline__ float rsqrt_acc(float x) { return rsqrtf(x); }
__device__ __forceinline__ double rsqrt_acc(double x) { return rsqrt(x); }

// ---------------------------------------------------------------------------------------------------------
// The logit of one element, shared by both kernels so that backward keeps exactly the columns forward kept.
// ---------------------------------------------------------------------------------------------------------
template <typename acc>
struct XentRow {
  int64_t row, target;
  acc inv;
  int64_t group, group_target;  // i's and t_i's group (with groups; a target past the rows counts as group 0)
};

template <typename acc>
__device__ __forceinline__ XentRow<acc> xent_row(const XentTiles<acc>& t, int64_t row) {
  XentRow<acc> r;
  r.row = row;
  r.target = t.partner_target ? (row ^ 1) : row;
  r.inv = t.row_inv[row];
  r.group = t.groups != nullptr ? t.groups[row] : row;
  r.group_target = t.groups != nullptr ? (r.target < t.rows ? t.groups[r.target] : 0) : row;
  return r;
}

// cos(min(arccos(cos) + m, pi)) and its derivative in cos: 0 past pi, the sin term's share dropped where 1 - cos^2
// is clamped.
template <typename acc>
__device__ __forceinline__ acc margin_logit(acc cos, acc cos_m, acc sin_m, acc* slope) {
  const acc floor = static_cast<acc>(kXentSinSqFloor);
  const acc sin_sq = acc(1) - cos * cos;
  const acc clamped = max_acc(sin_sq, floor);
  const acc inv_sin = rsqrt_acc(clamped);  // no division: a double one would spill (its slow path is a call)
  if (cos < -cos_m) {  // theta + m > pi: pinned at cos(pi) = -1
    *slope = acc(0);
    return acc(-1);
  }
  *slope = cos_m + (sin_sq > floor ? cos * sin_m * inv_sin : acc(0));
  return cos * cos_m - clamped * inv_sin * sin_m;
}

// Whether column `col` of local row `local` is in C_i; its cosine, logit, whether it is the target and a positive,
// and the margin's slope at the target (1 elsewhere).
template <typename acc>
__device__ __forceinline__ bool xent_logit(const XentTiles<acc>& t, const XentRow<acc>& r, int64_t local,
                                           int64_t col, acc col_inv, acc* cos, acc* logit, bool* is_target,
                                           bool* positive, acc* slope) {
  const acc c = t.dots[local * t.ld_dots + col] * r.inv * col_inv;
  const bool valid = !(t.exclude_diagonal && col == r.row);
  const bool target = valid && col == r.target;
  const acc scale = static_cast<acc>(t.scale);
  acc l = valid ? c * scale : neg_inf<acc>();
  *slope = acc(1);
  if (t.has_margin && target) {
    l = margin_logit(c, static_cast<acc>(t.cos_margin), static_cast<acc>(t.sin_margin), slope) * scale;
  }
  bool pos = target;
  if (t.groups != nullptr && valid) {
    const int64_t group_col = t.groups[col];
    pos = pos || group_col == r.group || group_col == r.group_target;
  }
  *cos = c;
  *logit = l;
  *is_target = target;
  *positive = pos;
  return valid;
}

// ---------------------------------------------------------------------------------------------------------
// Forward: one block per row of the tile. Thread x reads columns x, x + 256, ... (coalesced) and keeps its online
// states over C_i and P_i (without groups: the target logit, held by one thread); the warps merge theirs (shuffles,
// offsets 16 .. 1) and thread 0 merges the warps' in order (shared memory). Writes lse_all and lse_pos at the
// block's local row: max + log(max(sum, 1)), the Triton tile library's _final_lse.
// ---------------------------------------------------------------------------------------------------------
// At least 2 blocks per SM: without a minimum the compiler aims at 64 registers and the double variant spills.
template <typename acc>
__global__ void __launch_bounds__(kXentStatsThreads, 2)
    _xent_dense_stats_kernel(const XentTiles<acc> t, acc* __restrict__ lse_all, acc* __restrict__ lse_pos) {
  constexpr int kWarps = kXentStatsThreads / kWarpSize;
  __shared__ acc warp_state[5][kWarps];
  const int64_t local = blockIdx.x;
  const XentRow<acc> r = xent_row(t, t.row0 + local);
  OnlineLse<acc> all, pos;
  all.init();
  pos.init();
  acc target_logit = acc(0);
  const bool groups = t.groups != nullptr;
  for (int64_t col = threadIdx.x; col < t.cols; col += kXentStatsThreads) {
    acc cos, logit, slope;
    bool is_target, positive;
    if (!xent_logit(t, r, local, col, t.col_inv[col], &cos, &logit, &is_target, &positive, &slope)) continue;
    all.add(logit);
    if (groups) {
      if (positive) pos.add(logit);
    } else if (is_target) {
      target_logit += logit;
    }
  }
  all.merge_lanes(kWarpSize);
  pos.merge_lanes(kWarpSize);
  target_logit = warp_sum(target_logit);
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  if (lane == 0) {
    warp_state[0][warp] = all.max;
    warp_state[1][warp] = all.sum;
    warp_state[2][warp] = pos.max;
    warp_state[3][warp] = pos.sum;
    warp_state[4][warp] = target_logit;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    all.max = warp_state[0][0];
    all.sum = warp_state[1][0];
    pos.max = warp_state[2][0];
    pos.sum = warp_state[3][0];
    target_logit = warp_state[4][0];
    for (int other = 1; other < kWarps; ++other) {
      all.merge(warp_state[0][other], warp_state[1][other]);
      pos.merge(warp_state[2][other], warp_state[3][other]);
      target_logit += warp_state[4][other];
    }
    lse_all[local] = all.max + log_acc(max_acc(all.sum, acc(1)));
    lse_pos[local] = groups ? pos.max + log_acc(max_acc(pos.sum, acc(1))) : target_logit;
  }
}

// ---------------------------------------------------------------------------------------------------------
// The gradient tile. Block (x, y) covers columns [256 x, 256 x + 256) (one per thread) and local rows
// [16 y, 16 y + 16). G_ij = coef_i scale (exp(l_ij - lse_all_i) - p_ij), p_ij = exp(l_ij - lse_pos_i) on P_i with
// groups, [j == t_i] without, times the margin's slope at the target; 0 off C_i. With dims (DenseRunning),
// R = G + row_ratio_i col_ratio_j R_previous is the running sum over the prefixes from the widest down, written in
// acc to `next` (where a narrower prefix follows); R (G at one width) is rounded to out_t and stored in `grad`
// (skipped when null: the products then take `next`). With `radial`, the radial sums of G_j cos_ij: each thread's
// column sum over its 16 rows -> col_partial[y, col]; each row's sum over the block's 256 columns (warp shuffles,
// then the 8 warps in order) -> row_partial[x, local].
// ---------------------------------------------------------------------------------------------------------
template <typename acc, typename out_t>
__global__ void __launch_bounds__(kXentGradThreads)
    _xent_dense_grad_kernel(const XentTiles<acc> t, const acc* __restrict__ lse_all, const acc* __restrict__ lse_pos,
                            const acc* __restrict__ coef, const DenseRunning<acc> running, bool radial,
                            out_t* __restrict__ grad, int64_t ld_grad, acc* __restrict__ row_partial,
                            acc* __restrict__ col_partial) {
  constexpr int kWarps = kXentGradThreads / kWarpSize;
  __shared__ acc row_sums[kWarps][kXentGradRows];
  // The block's 16 rows' state, loaded once (not per element): XentRow, then lse_all, lse_pos, coef, the ratio.
  __shared__ XentRow<acc> row_state[kXentGradRows];
  __shared__ acc row_values[4][kXentGradRows];
  if (threadIdx.x < kXentGradRows) {
    const int64_t local = static_cast<int64_t>(blockIdx.y) * kXentGradRows + threadIdx.x;
    if (local < t.n_rows) {
      const int64_t row = t.row0 + local;
      row_state[threadIdx.x] = xent_row(t, row);
      row_values[0][threadIdx.x] = lse_all[row];
      row_values[1][threadIdx.x] = lse_pos[row];
      row_values[2][threadIdx.x] = coef[row];
      row_values[3][threadIdx.x] = running.previous != nullptr ? running.row_ratio[row] : acc(0);
    }
  }
  __syncthreads();
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kXentGradCols + threadIdx.x;
  const bool col_ok = col < t.cols;
  const acc col_inv = col_ok ? t.col_inv[col] : acc(0);
  const acc col_ratio = col_ok && running.previous != nullptr ? running.col_ratio[col] : acc(0);
  const acc scale = static_cast<acc>(t.scale);
  const bool groups = t.groups != nullptr;
  acc col_sum = acc(0);
  acc row_terms[kXentGradRows];
#pragma unroll
  for (int k = 0; k < kXentGradRows; ++k) {
    const int64_t local = static_cast<int64_t>(blockIdx.y) * kXentGradRows + k;
    acc term = acc(0);
    if (local < t.n_rows && col_ok) {
      acc cos, logit, slope;
      bool is_target, positive;
      acc g = acc(0);
      if (xent_logit(t, row_state[k], local, col, col_inv, &cos, &logit, &is_target, &positive, &slope)) {
        const acc p_pos = groups ? (positive ? exp_acc(logit - row_values[1][k]) : acc(0))
                                 : (is_target ? acc(1) : acc(0));
        g = row_values[2][k] * scale * (exp_acc(logit - row_values[0][k]) - p_pos);
        if (is_target) g *= slope;
        term = g * cos;
      }
      const acc h = dense_running_sum(running, local, col, g, row_values[3][k], col_ratio);
      if (grad != nullptr) grad[local * ld_grad + col] = from_acc<out_t>(h);
    }
    col_sum += term;
    row_terms[k] = term;
  }
  if (!radial) return;  // uniform over the grid: no barrier is skipped by part of a block
  dense_radial_partials<kXentGradRows, kXentGradThreads>(row_terms, col_sum, col_ok, col, t.n_rows, t.cols,
                                                          row_sums, row_partial, col_partial);
}

// ---------------------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------------------
namespace {

template <typename acc, typename out_t>
cudaError_t launch_grad(const XentTiles<acc>& t, const acc* lse_all, const acc* lse_pos, const acc* coef,
                        const DenseRunning<acc>& running, bool radial, void* grad, int64_t ld_grad, acc* row_partial,
                        acc* col_partial, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((t.cols + kXentGradCols - 1) / kXentGradCols),
                  static_cast<unsigned>((t.n_rows + kXentGradRows - 1) / kXentGradRows));
  _xent_dense_grad_kernel<acc, out_t><<<grid, kXentGradThreads, 0, stream>>>(
      t, lse_all, lse_pos, coef, running, radial, static_cast<out_t*>(grad), ld_grad, row_partial, col_partial);
  return cudaGetLastError();
}

}  // namespace

// The row statistics of one row block: lse_all and lse_pos [n_rows] at local rows (see _xent_dense_stats_kernel).
template <typename acc>
cudaError_t similarity_xent_dense_stats(const XentTiles<acc>& tiles, acc* lse_all, acc* lse_pos,
                                        cudaStream_t stream) {
  if (!dense_tiles_ok(tiles.n_rows, tiles.cols, kXentGradRows, kXentGradCols)) return cudaErrorInvalidValue;
  _xent_dense_stats_kernel<acc><<<static_cast<unsigned>(tiles.n_rows), kXentStatsThreads, 0, stream>>>(
      tiles, lse_all, lse_pos);
  return cudaGetLastError();
}

// The gradient tile of one row block (with dims, the running sum `running`), rounded to `operand` (DenseOperand)
// into grad [n_rows, cols] (rows ld_grad apart; may be null with running.next), and with `radial` the partial
// radial sums row_partial [column tiles, n_rows], col_partial [row tiles, cols] (see _xent_dense_grad_kernel).
// lse_all, lse_pos, coef: [rows], by global row.
template <typename acc>
cudaError_t similarity_xent_dense_grad(const XentTiles<acc>& tiles, const acc* lse_all, const acc* lse_pos,
                                       const acc* coef, const DenseRunning<acc>& running, bool radial, int operand,
                                       void* grad, int64_t ld_grad, acc* row_partial, acc* col_partial,
                                       cudaStream_t stream) {
  if (!dense_tiles_ok(tiles.n_rows, tiles.cols, kXentGradRows, kXentGradCols) ||
      (grad == nullptr && running.next == nullptr)) {
    return cudaErrorInvalidValue;
  }
  return dense_launch_for_operand<acc>(operand, [&](auto tag) {
    using out_t = typename decltype(tag)::type;
    return launch_grad<acc, out_t>(tiles, lse_all, lse_pos, coef, running, radial, grad, ld_grad, row_partial,
                                   col_partial, stream);
  });
}

template cudaError_t similarity_xent_dense_stats<float>(const XentTiles<float>&, float*, float*, cudaStream_t);
template cudaError_t similarity_xent_dense_stats<double>(const XentTiles<double>&, double*, double*, cudaStream_t);
template cudaError_t similarity_xent_dense_grad<float>(const XentTiles<float>&, const float*, const float*,
                                                       const float*, const DenseRunning<float>&, bool, int, void*,
                                                       int64_t, float*, float*, cudaStream_t);
template cudaError_t similarity_xent_dense_grad<double>(const XentTiles<double>&, const double*, const double*,
                                                        const double*, const DenseRunning<double>&, bool, int, void*,
                                                        int64_t, double*, double*, cudaStream_t);

}  // namespace angle_kernels

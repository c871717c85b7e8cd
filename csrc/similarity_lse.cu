// similarity_lse by the dense scheme: the tile kernels of one row block, on dot products cuBLAS made.
//
// What it computes (the contract in angle_kernels/dispatch.py): for row i with target column t_i = i +
// target_offset and own columns O_i (j % period == t_i with period > 0, else j == t_i),
//   l_ij  = scale * s_ij + penalty * stop_gradient(s_ij) * [j in H_i]    (H_i: penalty_on "other", "own", "all")
//   lse_i = logsumexp over the kept columns K_i of l_ij                  (-inf when K_i is empty)
// K_i: every column, minus the target or the own columns (exclude), minus the columns whose filter score exceeds
// filter_threshold[i] (but the target with filter_keeps_target). s_ij is the cosine, or the raw dot product.
//
// The scheme (angle_kernels/cuda_ops/similarity_lse.py orchestrates it, as triton_ops/_similarity_lse_dense.py
// does for the Triton backend): per block of b rows, torch products (cuBLAS, 16-bit operands accumulated in fp32,
// fp64 in fp64) write the [b, Mc] tile P of raw dot products of the rows scaled by their powers of two (huge rows,
// common.cuh), and a second tile F for a filter on other embeddings. The kernels here read those tiles:
//   _lse_stats_kernel  (forward)  one block per row: the row's online logsumexp over its kept columns.
//   _lse_grad_kernel   (backward) a 16 x 256 tile per block: G_ij = coef_i * scale * softmax_ij over K_i, rounded
//                      to the products' operand dtype, and the radial sums sum_j G_ij s_ij (per row) and
//                      sum_i G_ij s_ij (per column) of the normalisation's backward, one partial per tile.
// The Python side then forms dq_hat = G c_unit and dc_hat += G^T q_unit with torch products and applies the
// normalisation's backward once. coef_i = grad_i / max|grad| (at most 1): G never carries the upstream
// gradient's magnitude nor an inverse norm, so its 16-bit copy neither underflows nor overflows. With dims (every
// prefix d_1 < ... < d_k in one pass) the same kernels run once per prefix on its tile P_i (a running sum of slice
// products), and backward, from the widest prefix down, also folds the running sum H_j = G_j + (q_inv_j+1 /
// q_inv_j) (c_inv_j+1 / c_inv_j) H_j+1 (DenseRunning): the tile the products of slice j take.
//
// Scores and huge rows (LseTiles in similarity_lse_types.h): the score is v_ij = P_ij row_inv_i col_inv_j. For
// cosines row_inv, col_inv are the inverse clamped norms of the scaled rows and row_unscale is 1. For raw dot
// products col_inv_j = 1 / s_j and row_inv_i = 1, so v_ij = s_i (q_i . c_j): the score in its anchor row's scale,
// bounded whatever the rows' size; row_unscale_i = 1 / s_i brings the logits back, l_ij = w_ij / s_i with
// w_ij = scale v_ij + penalty v_ij [hard]. The row's state is (m_i = max over K_i of w_ij, sum_j exp((w_ij - m_i)
// / s_i)), and lse_i = m_i / s_i + log(sum): exactly torch_ops/similarity_lse.py's row_values, never inf - inf.
//
// Determinism: no atomics. Each row's statistics come from one block in a fixed reduction order; the radial
// sums are written per tile and reduced by the binding (at::sum); the products are cuBLAS's.
//
// The floor (per logit, fp32 tiles, 16-bit operands; the products' 2 M Mc D forward and 6 M Mc D backward
// FLOPs are cuBLAS's): forward 8 bytes (P written by the product, read here once); backward 14 (P written again
// and read once, G written in 2 bytes and read by the two products); a separate filter adds 8 each way; each
// further prefix of dims about 12 forward and 34 backward (the tile copied and added to; the running sum read and
// written in fp32). The kernels do ~30 instructions and one exp per logit read: bandwidth bound at these bytes.

#include <cmath>
#include <type_traits>

#include "common.cuh"
#include "dense_tiles.cuh"
#include "similarity_lse_types.h"

namespace angle_kernels {

constexpr int kLseStatsThreads = 256;  // one block per row of the tile
constexpr int kLseGradThreads = kLseGradCols;

// ---------------------------------------------------------------------------------------------------------
// The logit of one element, shared by both kernels so that backward keeps exactly the columns forward kept.
// ---------------------------------------------------------------------------------------------------------
template <typename acc, typename facc>
struct LseRow {
  int64_t target;  // t_i (may lie past the columns: then no column is the target)
  acc row_inv, unscale;
  facc frow_inv, threshold;
};

template <typename acc, typename facc>
__device__ __forceinline__ LseRow<acc, facc> lse_row(const LseTiles<acc>& t, int64_t row) {
  LseRow<acc, facc> r;
  r.target = row + t.target_offset;
  r.row_inv = t.row_inv[row];
  r.unscale = t.row_unscale[row];
  r.frow_inv = t.filter == kLseFilterSeparate ? static_cast<const facc*>(t.filter_row_inv)[row] : facc(1);
  r.threshold = t.filter != kLseFilterNone ? static_cast<const facc*>(t.threshold)[row] : facc(0);
  return r;
}

// Whether column `col` of local row `local` is kept; its score v and anchor-scale logit w. col_mod: col % period
// (unused without a period); fcol_inv: the filter's column factor (separate filter only).
template <typename acc, typename facc>
__device__ __forceinline__ bool lse_logit(const LseTiles<acc>& t, const LseRow<acc, facc>& r, int64_t local,
                                          int64_t col, int64_t col_mod, acc col_inv, facc fcol_inv, acc* v,
                                          acc* w) {
  const acc score = t.dots[local * t.ld_dots + col] * r.row_inv * col_inv;
  const bool is_target = col == r.target;
  const bool own = t.period > 0 ? col_mod == r.target : is_target;
  bool kept = !((t.exclude == kLseExcludeTarget && is_target) || (t.exclude == kLseExcludeOwn && own));
  if (t.filter != kLseFilterNone) {
    bool dropped;
    if (t.filter == kLseFilterOwnScores) {  // facc is acc here (the launcher's choice)
      dropped = static_cast<facc>(score) > r.threshold;
    } else {
      const facc guide = static_cast<const facc*>(t.filter_dots)[local * t.ld_filter + col];
      dropped = guide * r.frow_inv * fcol_inv > r.threshold;
    }
    if (t.filter_keeps_target) dropped = dropped && !is_target;
    kept = kept && !dropped;
  }
  acc logit = score * static_cast<acc>(t.scale);
  bool hard = false;
  if (t.penalty_on == kLsePenaltyOther) hard = !own;
  else if (t.penalty_on == kLsePenaltyOwn) hard = own && !is_target;
  else if (t.penalty_on == kLsePenaltyAll) hard = !is_target;
  if (hard) logit += static_cast<acc>(t.penalty) * score;
  *v = score;
  *w = logit;
  return kept;
}

// exp((x - m) a), 1 where x == m (both +inf included: no inf - inf).
template <typename acc>
__device__ __forceinline__ acc lse_exp(acc x, acc m, acc a) {
  return x == m ? acc(1) : exp_acc((x - m) * a);
}

// The online state of a row in the anchor scale: (m, sum of exp((w - m) a)), a = row_unscale.
template <typename acc>
__device__ __forceinline__ void lse_add(acc* m, acc* s, acc w, acc a) {
  if (w > *m) {
    *s = *s * lse_exp(*m, w, a) + acc(1);
    *m = w;
  } else {
    *s += lse_exp(w, *m, a);
  }
}
template <typename acc>
__device__ __forceinline__ void lse_merge(acc* m, acc* s, acc other_m, acc other_s, acc a) {
  const acc top = max_acc(*m, other_m);
  if (top == neg_inf<acc>()) return;  // both empty
  *s = (*m == neg_inf<acc>() ? acc(0) : *s * lse_exp(*m, top, a)) +
       (other_m == neg_inf<acc>() ? acc(0) : other_s * lse_exp(other_m, top, a));
  *m = top;
}

// ---------------------------------------------------------------------------------------------------------
// Forward: one block per row of the tile. Thread x reads columns x, x + 256, ... (coalesced), keeps its online
// state, then the warps merge theirs (shuffles, offsets 16 .. 1) and warp 0 merges the warps' (shared memory).
// Writes lse, m and log(sum) at the block's local row (top = -inf, log_sum = 0 and lse = -inf for an empty row).
// ---------------------------------------------------------------------------------------------------------
template <typename acc, typename facc>
__global__ void __launch_bounds__(kLseStatsThreads)
    _lse_stats_kernel(const LseTiles<acc> t, acc* __restrict__ lse, acc* __restrict__ top,
                      acc* __restrict__ log_sum) {
  __shared__ acc warp_m[kLseStatsThreads / kWarpSize];
  __shared__ acc warp_s[kLseStatsThreads / kWarpSize];
  const int64_t local = blockIdx.x;
  const int64_t row = t.row0 + local;
  const LseRow<acc, facc> r = lse_row<acc, facc>(t, row);
  const acc a = r.unscale;
  acc m = neg_inf<acc>(), s = acc(0);
  // col % period, advanced by the stride's remainder (no modulo per element)
  const int64_t stride = kLseStatsThreads;
  const int64_t step = t.period > 0 ? stride % t.period : 0;
  int64_t col = threadIdx.x;
  int64_t col_mod = t.period > 0 ? col % t.period : 0;
  for (; col < t.cols; col += stride) {
    const acc col_inv = t.col_inv[col];
    const facc fcol_inv =
        t.filter == kLseFilterSeparate ? static_cast<const facc*>(t.filter_col_inv)[col] : facc(1);
    acc v, w;
    if (lse_logit<acc, facc>(t, r, local, col, col_mod, col_inv, fcol_inv, &v, &w) && w > neg_inf<acc>()) {
      lse_add(&m, &s, w, a);
    }
    if (t.period > 0) {
      col_mod += step;
      if (col_mod >= t.period) col_mod -= t.period;
    }
  }
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const acc other_m = __shfl_xor_sync(0xffffffffu, m, offset);
    const acc other_s = __shfl_xor_sync(0xffffffffu, s, offset);
    lse_merge(&m, &s, other_m, other_s, a);
  }
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  if (lane == 0) {
    warp_m[warp] = m;
    warp_s[warp] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    m = warp_m[0];
    s = warp_s[0];
    for (int other = 1; other < kLseStatsThreads / kWarpSize; ++other) {
      lse_merge(&m, &s, warp_m[other], warp_s[other], a);
    }
    const bool empty = m == neg_inf<acc>();
    const acc spread = empty ? acc(0) : log_acc(s);
    top[local] = m;
    log_sum[local] = spread;
    lse[local] = empty ? neg_inf<acc>() : m * a + spread;
  }
}

// ---------------------------------------------------------------------------------------------------------
// Backward: the gradient tile. Block (x, y) covers columns [256 x, 256 x + 256) (one per thread) and local rows
// [16 y, 16 y + 16). G_ij = coef_i scale exp((w_ij - m_i) a_i - log_sum_i) on kept columns, else 0 (and 0 on
// rows whose m is -inf). With dims (DenseRunning), H = G + row_ratio_i col_ratio_j H_previous is the running sum
// over the prefixes from the widest down, written in acc to `next` (where a narrower prefix follows); H (G with
// one width) is rounded to out_t and stored in `grad` (skipped when null: the products then take `next`). With
// `radial`, the radial sums of G times the score (the rounded G with one width, the tile its products take):
// each thread's column sum over its 16 rows -> col_partial[y, col]; each row's sum over the block's 256 columns
// (warp shuffles, then the 8 warps in order) -> row_partial[x, local].
// ---------------------------------------------------------------------------------------------------------
template <typename acc, typename facc, typename out_t>
__global__ void __launch_bounds__(kLseGradThreads)
    _lse_grad_kernel(const LseTiles<acc> t, const acc* __restrict__ top, const acc* __restrict__ log_sum,
                     const acc* __restrict__ coef, const DenseRunning<acc> running, bool radial,
                     out_t* __restrict__ grad, int64_t ld_grad, acc* __restrict__ row_partial,
                     acc* __restrict__ col_partial) {
  constexpr int kWarps = kLseGradThreads / kWarpSize;
  __shared__ acc row_sums[kWarps][kLseGradRows];
  // The block's 16 rows' state, loaded once (not per element): LseRow, then m, log(sum), coef, the running ratio.
  __shared__ LseRow<acc, facc> row_state[kLseGradRows];
  __shared__ acc row_values[4][kLseGradRows];
  if (threadIdx.x < kLseGradRows) {
    const int64_t local = static_cast<int64_t>(blockIdx.y) * kLseGradRows + threadIdx.x;
    if (local < t.n_rows) {
      const int64_t row = t.row0 + local;
      row_state[threadIdx.x] = lse_row<acc, facc>(t, row);
      row_values[0][threadIdx.x] = top[row];
      row_values[1][threadIdx.x] = log_sum[row];
      row_values[2][threadIdx.x] = coef[row];
      row_values[3][threadIdx.x] = running.previous != nullptr ? running.row_ratio[row] : acc(0);
    }
  }
  __syncthreads();
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kLseGradCols + threadIdx.x;
  const bool col_ok = col < t.cols;
  const acc col_inv = col_ok ? t.col_inv[col] : acc(0);
  const facc fcol_inv =
      col_ok && t.filter == kLseFilterSeparate ? static_cast<const facc*>(t.filter_col_inv)[col] : facc(1);
  const int64_t col_mod = t.period > 0 ? col % t.period : 0;
  const acc col_ratio = col_ok && running.previous != nullptr ? running.col_ratio[col] : acc(0);
  const acc scale = static_cast<acc>(t.scale);
  acc col_sum = acc(0);
  acc row_terms[kLseGradRows];
#pragma unroll
  for (int k = 0; k < kLseGradRows; ++k) {
    const int64_t local = static_cast<int64_t>(blockIdx.y) * kLseGradRows + k;
    acc g = acc(0), term = acc(0);
    if (local < t.n_rows && col_ok) {
      const LseRow<acc, facc> r = row_state[k];
      const acc m = row_values[0][k];
      acc v, w;
      if (lse_logit<acc, facc>(t, r, local, col, col_mod, col_inv, fcol_inv, &v, &w) && m > neg_inf<acc>()) {
        g = row_values[2][k] * scale * exp_acc((w - m) * r.unscale - row_values[1][k]);
      }
      const acc h = dense_running_sum(running, local, col, g, row_values[3][k], col_ratio);
      out_t rounded{};
      if (grad != nullptr) {
        rounded = from_acc<out_t>(h);
        grad[local * ld_grad + col] = rounded;
      }
      // the radial sums of one width take the rounded tile its products take; of a prefix, its own tile G_j
      // (0 off the kept columns: g is 0 there)
      const bool one_width = running.previous == nullptr && running.next == nullptr;
      if (radial && g != acc(0)) term = (one_width ? load_as<acc>(&rounded) : g) * v;
    }
    col_sum += term;
    row_terms[k] = term;
  }
  if (!radial) return;  // uniform over the grid: no barrier is skipped by part of a block
  dense_radial_partials<kLseGradRows, kLseGradThreads>(row_terms, col_sum, col_ok, col, t.n_rows, t.cols,
                                                        row_sums, row_partial, col_partial);
}

// ---------------------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------------------
namespace {

template <typename acc, typename facc>
cudaError_t launch_stats(const LseTiles<acc>& t, acc* lse, acc* top, acc* log_sum, cudaStream_t stream) {
  _lse_stats_kernel<acc, facc><<<static_cast<unsigned>(t.n_rows), kLseStatsThreads, 0, stream>>>(t, lse, top, log_sum);
  return cudaGetLastError();
}

template <typename acc, typename facc, typename out_t>
cudaError_t launch_grad(const LseTiles<acc>& t, const acc* top, const acc* log_sum, const acc* coef,
                        const DenseRunning<acc>& running, bool radial, void* grad, int64_t ld_grad, acc* row_partial,
                        acc* col_partial, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((t.cols + kLseGradCols - 1) / kLseGradCols),
                  static_cast<unsigned>((t.n_rows + kLseGradRows - 1) / kLseGradRows));
  _lse_grad_kernel<acc, facc, out_t><<<grid, kLseGradThreads, 0, stream>>>(
      t, top, log_sum, coef, running, radial, static_cast<out_t*>(grad), ld_grad, row_partial, col_partial);
  return cudaGetLastError();
}

template <typename acc, typename facc>
cudaError_t launch_grad_for(const LseTiles<acc>& t, const acc* top, const acc* log_sum, const acc* coef,
                            const DenseRunning<acc>& running, bool radial, int operand, void* grad, int64_t ld_grad,
                            acc* row_partial, acc* col_partial, cudaStream_t stream) {
  return dense_launch_for_operand<acc>(operand, [&](auto tag) {
    using out_t = typename decltype(tag)::type;
    return launch_grad<acc, facc, out_t>(t, top, log_sum, coef, running, radial, grad, ld_grad, row_partial,
                                         col_partial, stream);
  });
}

}  // namespace

// The row statistics of one row block: lse, m and log(sum) [n_rows] at local rows (see _lse_stats_kernel). A
// filter on the model's own scores compares in acc (its threshold is acc); a separate filter in its own type.
template <typename acc>
cudaError_t similarity_lse_stats(const LseTiles<acc>& tiles, acc* lse, acc* top, acc* log_sum,
                                 cudaStream_t stream) {
  if (!dense_tiles_ok(tiles.n_rows, tiles.cols, kLseGradRows, kLseGradCols)) return cudaErrorInvalidValue;
  const bool fp64 = tiles.filter == kLseFilterSeparate ? tiles.filter_fp64 : std::is_same<acc, double>::value;
  return fp64 ? launch_stats<acc, double>(tiles, lse, top, log_sum, stream)
              : launch_stats<acc, float>(tiles, lse, top, log_sum, stream);
}

// The gradient tile of one row block (with dims, the running sum `running`), rounded to `operand` (DenseOperand)
// into grad [n_rows, cols] (rows ld_grad apart; may be null with running.next), and with `radial` the partial
// radial sums row_partial [column tiles, n_rows], col_partial [row tiles, cols] (see _lse_grad_kernel). top,
// log_sum, coef: [rows], by global row.
template <typename acc>
cudaError_t similarity_lse_grad(const LseTiles<acc>& tiles, const acc* top, const acc* log_sum, const acc* coef,
                                const DenseRunning<acc>& running, bool radial, int operand, void* grad,
                                int64_t ld_grad, acc* row_partial, acc* col_partial, cudaStream_t stream) {
  if (!dense_tiles_ok(tiles.n_rows, tiles.cols, kLseGradRows, kLseGradCols) ||
      (grad == nullptr && running.next == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const bool fp64 = tiles.filter == kLseFilterSeparate ? tiles.filter_fp64 : std::is_same<acc, double>::value;
  return fp64 ? launch_grad_for<acc, double>(tiles, top, log_sum, coef, running, radial, operand, grad, ld_grad,
                                             row_partial, col_partial, stream)
              : launch_grad_for<acc, float>(tiles, top, log_sum, coef, running, radial, operand, grad, ld_grad,
                                            row_partial, col_partial, stream);
}

template cudaError_t similarity_lse_stats<float>(const LseTiles<float>&, float*, float*, float*, cudaStream_t);
template cudaError_t similarity_lse_stats<double>(const LseTiles<double>&, double*, double*, double*, cudaStream_t);
template cudaError_t similarity_lse_grad<float>(const LseTiles<float>&, const float*, const float*, const float*,
                                                const DenseRunning<float>&, bool, int, void*, int64_t, float*, float*,
                                                cudaStream_t);
template cudaError_t similarity_lse_grad<double>(const LseTiles<double>&, const double*, const double*,
                                                 const double*, const DenseRunning<double>&, bool, int, void*, int64_t,
                                                 double*, double*, cudaStream_t);

}  // namespace angle_kernels

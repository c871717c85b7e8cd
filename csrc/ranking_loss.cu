// Ranking loss (CoSENT / AnglE Eq. 1): forward and backward in O(N) memory after one sort.
//
// What it computes (the contract in angle_kernels/dispatch.py):
//   L = log(1 + S),  S = sum over (i, j) with label_i < label_j of exp(s_i - s_j)      (ties contribute 0)
// Sorting by label factorises S = sum_j exp(-s_j) * A_j with A_j = sum_{i: label_i < label_j} exp(s_i), a
// prefix sum over the tie groups strictly before j's group. The gradient is
//   dL/ds_k = (exp(s_k) * B_k - exp(-s_k) * A_k) / (1 + S),   B_k = sum_{j: label_j > label_k} exp(-s_j),
// a suffix sum over the tie groups strictly after k's group.
//
// Division of labour: the binding sorts the labels with torch (at::sort; CUB radix sort underneath) and
// finds each sorted position's tie group with at::searchsorted: order[p] is the original index of sorted
// position p, and [group_first[p], group_past[p]) the sorted positions sharing its label. Doing that in the
// binding keeps the labels' dtype out of the kernels (exact comparisons for any real dtype) and leaves no
// CUB temporary-storage plumbing in the launchers. The kernels here do the rest:
//   * all scans run in float64 in log space (logaddexp as the scan operator): no overflow for any scores,
//     and no float32 drift at millions of pairs;
//   * A_p = prefix[group_first[p] - 1], B_p = suffix[group_past[p]]: a tie group simply reads the scan
//     value just outside itself, which is how ties are skipped.
//
// The floor: O(N) reads and writes (N scores + 3 index arrays), a few transcendental ops per element. The
// kernels run as a single block of 512 threads walking N in tiles of 2048 with a carried prefix: simple
// and exact, and sub-millisecond for the N (pairs per batch) of embedding training; at millions of pairs a
// multi-block decoupled look-back scan would be faster (not done).

#include <cub/block/block_scan.cuh>

#include "common.cuh"

namespace angle_kernels {

constexpr int kRankingThreads = 512;
constexpr int kRankingItemsPerThread = 4;
constexpr int kRankingTile = kRankingThreads * kRankingItemsPerThread;

// log(exp(a) + exp(b)) in float64; -inf is the identity.
struct LogAddExp {
  __device__ __forceinline__ double operator()(double a, double b) const {
    const double m = fmax(a, b);
    if (m == -INFINITY) return -INFINITY;
    return m + log1p(exp(-fabs(a - b)));
  }
};

// Carries the scan value of all previous tiles into the next one (CUB's block-prefix callback protocol:
// called by the first warp with the tile's aggregate; lane 0's return value is the tile's prefix).
struct RunningLogPrefix {
  double running;
  __device__ double operator()(double tile_aggregate) {
    const double prefix = running;
    running = LogAddExp()(running, tile_aggregate);
    return prefix;
  }
};

using RankingBlockScan = cub::BlockScan<double, kRankingThreads>;

// Inclusive log-cumsum-exp over the scores in label order (reverse = false: prefix of +s from the lowest
// label up), or over -s from the highest label down (reverse = true: suffix). out[p] is indexed by
// sorted position p in both cases.
template <typename scalar_t>
__device__ __forceinline__ void log_cumsumexp_sorted(const scalar_t* __restrict__ scores, int64_t stride, const int64_t* __restrict__ order,
                                     int64_t n, bool reverse, double* __restrict__ out,
                                     typename RankingBlockScan::TempStorage& temp) {
  RunningLogPrefix carry{-INFINITY};
  for (int64_t tile = 0; tile < n; tile += kRankingTile) {
    double items[kRankingItemsPerThread];
#pragma unroll
    for (int it = 0; it < kRankingItemsPerThread; ++it) {
      const int64_t rank = tile + static_cast<int64_t>(threadIdx.x) * kRankingItemsPerThread + it;  // scan order
      if (rank < n) {
        const int64_t p = reverse ? n - 1 - rank : rank;
        const double s = static_cast<double>(scores[order[p] * stride]);
        items[it] = reverse ? -s : s;
      } else {
        items[it] = -INFINITY;
      }
    }
    RankingBlockScan(temp).InclusiveScan(items, items, LogAddExp(), carry);
#pragma unroll
    for (int it = 0; it < kRankingItemsPerThread; ++it) {
      const int64_t rank = tile + static_cast<int64_t>(threadIdx.x) * kRankingItemsPerThread + it;
      if (rank < n) out[reverse ? n - 1 - rank : rank] = items[it];
    }
    __syncthreads();  // temp storage is reused by the next tile
  }
}

// T = log S = logsumexp_p (-s_p + log A_p), reduced over the block; every thread gets the result.
template <typename scalar_t>
__device__ __forceinline__ double log_pair_sum(const scalar_t* __restrict__ scores, int64_t stride, const int64_t* __restrict__ order,
                               const int64_t* __restrict__ group_first, int64_t n, const double* __restrict__ prefix) {
  __shared__ double warp_max[kRankingThreads / kWarpSize];
  __shared__ double warp_sum_exp[kRankingThreads / kWarpSize];
  __shared__ double result;
  OnlineLse<double> state;
  state.init();
  for (int64_t p = threadIdx.x; p < n; p += kRankingThreads) {
    const int64_t first = group_first[p];
    if (first == 0) continue;  // nothing ranks strictly below this label: A_p = 0
    state.add(-static_cast<double>(scores[order[p] * stride]) + prefix[first - 1]);
  }
  state.merge_lanes(kWarpSize);
  const int warp = threadIdx.x / kWarpSize;
  if (threadIdx.x % kWarpSize == 0) {
    warp_max[warp] = state.max;
    warp_sum_exp[warp] = state.sum;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    OnlineLse<double> total;
    total.init();
    for (int w = 0; w < kRankingThreads / kWarpSize; ++w) total.merge(warp_max[w], warp_sum_exp[w]);
    result = total.value();  // -inf when no pair has label_i < label_j
  }
  __syncthreads();
  return result;
}

// log(1 + exp(t)) without overflow; exactly 0 for t = -inf.
__device__ __forceinline__ double softplus(double t) { return t > 0 ? t + log1p(exp(-t)) : log1p(exp(t)); }

// ---------------------------------------------------------------------------------------------------------
// Forward: prefix scan, then L = softplus(T).
// ---------------------------------------------------------------------------------------------------------
template <typename scalar_t>
__global__ void __launch_bounds__(kRankingThreads, 1)
    _ranking_fwd_kernel(const scalar_t* __restrict__ scores, int64_t stride, const int64_t* __restrict__ order,
                        const int64_t* __restrict__ group_first, int64_t n, double* __restrict__ prefix,
                        scalar_t* __restrict__ loss_out) {
  __shared__ typename RankingBlockScan::TempStorage scan_temp;
  log_cumsumexp_sorted(scores, stride, order, n, /*reverse=*/false, prefix, scan_temp);
  __syncthreads();  // prefix[] (global memory) written by other threads of this block is read below
  const double log_s = log_pair_sum(scores, stride, order, group_first, n, prefix);
  if (threadIdx.x == 0) loss_out[0] = static_cast<scalar_t>(softplus(log_s));
}

// ---------------------------------------------------------------------------------------------------------
// Backward: prefix and suffix scans, T again (in float64, rather than trusting a rounded saved loss), then
// grad[order[p]] = g * (exp(s_p + log B_p - log Z) - exp(-s_p + log A_p - log Z)),  log Z = softplus(T).
// ---------------------------------------------------------------------------------------------------------
template <typename scalar_t>
__global__ void __launch_bounds__(kRankingThreads, 1)
    _ranking_bwd_kernel(const scalar_t* __restrict__ grad_loss, const scalar_t* __restrict__ scores, int64_t stride,
                        const int64_t* __restrict__ order, const int64_t* __restrict__ group_first,
                        const int64_t* __restrict__ group_past, int64_t n, double* __restrict__ prefix,
                        double* __restrict__ suffix, scalar_t* __restrict__ grad_scores) {
  __shared__ typename RankingBlockScan::TempStorage scan_temp;
  log_cumsumexp_sorted(scores, stride, order, n, /*reverse=*/false, prefix, scan_temp);
  log_cumsumexp_sorted(scores, stride, order, n, /*reverse=*/true, suffix, scan_temp);
  __syncthreads();
  const double log_z = softplus(log_pair_sum(scores, stride, order, group_first, n, prefix));
  const double g = static_cast<double>(grad_loss[0]);
  for (int64_t p = threadIdx.x; p < n; p += kRankingThreads) {
    const int64_t first = group_first[p], past = group_past[p];
    const double s = static_cast<double>(scores[order[p] * stride]);
    const double log_a = first > 0 ? prefix[first - 1] : -INFINITY;  // labels strictly below
    const double log_b = past < n ? suffix[past] : -INFINITY;        // labels strictly above
    const double grad = exp(s + log_b - log_z) - exp(-s + log_a - log_z);
    grad_scores[order[p]] = static_cast<scalar_t>(g * grad);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Launchers. prefix and suffix are float64 scratch of n elements each; grad_scores is contiguous [n].
// ---------------------------------------------------------------------------------------------------------
template <typename scalar_t>
cudaError_t ranking_fwd(const scalar_t* scores, int64_t stride, const int64_t* order, const int64_t* group_first,
                        int64_t n, double* prefix_scratch, scalar_t* loss_out, cudaStream_t stream) {
  if (n < 0) return cudaErrorInvalidValue;
  _ranking_fwd_kernel<scalar_t>
      <<<1, kRankingThreads, 0, stream>>>(scores, stride, order, group_first, n, prefix_scratch, loss_out);
  return cudaGetLastError();
}

template <typename scalar_t>
cudaError_t ranking_bwd(const scalar_t* grad_loss, const scalar_t* scores, int64_t stride, const int64_t* order,
                        const int64_t* group_first, const int64_t* group_past, int64_t n, double* prefix_scratch,
                        double* suffix_scratch, scalar_t* grad_scores, cudaStream_t stream) {
  if (n < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  _ranking_bwd_kernel<scalar_t><<<1, kRankingThreads, 0, stream>>>(
      grad_loss, scores, stride, order, group_first, group_past, n, prefix_scratch, suffix_scratch, grad_scores);
  return cudaGetLastError();
}

// Explicit instantiations: the binding (csrc/ranking_loss.cpp) declares these and links against them.
#define ANGLE_KERNELS_INSTANTIATE_RANKING(T)                                                                   \
  template cudaError_t ranking_fwd<T>(const T*, int64_t, const int64_t*, const int64_t*, int64_t, double*, T*, \
                                      cudaStream_t);                                                          \
  template cudaError_t ranking_bwd<T>(const T*, const T*, int64_t, const int64_t*, const int64_t*,             \
                                      const int64_t*, int64_t, double*, double*, T*, cudaStream_t);
ANGLE_KERNELS_INSTANTIATE_RANKING(float)
ANGLE_KERNELS_INSTANTIATE_RANKING(double)
#undef ANGLE_KERNELS_INSTANTIATE_RANKING

}  // namespace angle_kernels

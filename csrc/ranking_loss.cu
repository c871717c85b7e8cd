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
// binding keeps the labels' dtype out of the kernels (exact comparisons for any real dtype). The binding also
// allocates one float64 scratch buffer of ranking_{fwd,bwd}_scratch_size(n) elements, which the launchers
// carve up (the layout is private to this file). The kernels here do the rest:
//   * all scans run in float64 in log space (logaddexp as the scan operator): no overflow for any scores,
//     and no float32 drift at millions of pairs;
//   * A_p = prefix[group_first[p] - 1], B_p = suffix[group_past[p]]: a tie group simply reads the scan
//     value just outside itself, which is how ties are skipped.
//
// Design: a classic three-phase parallel scan over tiles of kRankingTile sorted positions, one block per tile,
// so every SM takes part (the Triton backend's sort path does the same):
//   1. _ranking_tile_scan_kernel (ceil(n / tile) blocks): gathers the tile's scores through `order` into a
//      float64 array in sorted order, scans the tile locally (inclusive prefix of s; in backward also the
//      inclusive suffix of -s) and writes each tile's total;
//   2. _ranking_totals_scan_kernel (1 block): scans the tile totals in place (n / 2048 values: at 4M scores
//      one block-wide scan), so that the global scan value at sorted position q is
//          prefix(q) = logaddexp(local_prefix[q], prefix_totals[tile(q) - 1])   (nothing before tile 0)
//          suffix(q) = logaddexp(local_suffix[q], suffix_totals[tile(q) + 1])   (nothing after the last tile)
//      (read, never written back: positions of one tile are read by blocks of other tiles in phase 3, so a
//      write-back in place would race with them);
//   3. _ranking_pair_sum_kernel (one block per tile): each block's partial logsumexp of -s_p + log A_p, as an
//      (max, sum of exp) pair;
//   4. _ranking_finish_kernel (1 block): merges the partials into T = log S and writes softplus(T) (the loss
//      in forward, log(1 + S) in float64 for backward);
//   5. backward only, _ranking_grad_kernel (grid-stride over positions): the gradient, scattered through
//      `order`.
// Values written by one block and read by another cross a kernel boundary (all launches are on one stream).
//
// The floor: O(N) reads and writes and a few transcendental ops per element; the sort in the binding costs
// more than everything here. Per element, forward: order 8 B, one random score read (a 32 B sector), writes
// of the sorted scores and the local prefix (16 B), then group_first, the sorted score and local_prefix at
// the group's bound (24 B, the last almost always cached): about 50 B plus the gather. Backward adds the
// local suffix (8 B) and the gradient pass (sorted score, both group bounds, order, both local scans: 48 B,
// plus the random gradient write): about 105 B plus the gather and the scatter. The float64 log-space
// operator (exp and log1p) is about 50 FP64 ops; an element meets it about twice per scan (a thread reduce
// and a thread scan over 8 items; the warp-level steps are shared by 8 items) and once per carry added: a few
// hundred FP64 ops per element, microseconds per million elements at an H100's FP64 rate.

#include <cub/block/block_scan.cuh>

#include "common.cuh"

namespace angle_kernels {

constexpr int kRankingThreads = 256;
constexpr int kRankingItemsPerThread = 8;
constexpr int kRankingTile = kRankingThreads * kRankingItemsPerThread;  // sorted positions per tile (2048)
constexpr int kRankingWarps = kRankingThreads / kWarpSize;
// The gradient kernel's grid (grid-stride loop): a few times what an H100 keeps resident (132 SMs x 8 blocks).
constexpr int64_t kRankingMaxGradBlocks = 8192;

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

// Number of tiles (blocks of phases 1 and 3, tile totals, partials) for n sorted positions.
__host__ __device__ __forceinline__ int64_t ranking_tiles(int64_t n) {
  return n / kRankingTile + (n % kRankingTile != 0 ? 1 : 0);
}

// The tile kernel stages a tile in shared memory to move between the coalesced order of global memory (thread t
// touches positions t, t + 256, ...) and CUB's blocked order (thread t holds positions 8t .. 8t + 7). Blocked
// reads of doubles at a stride of 8 would put 8 lanes of a half-warp on one bank pair; one padding double after every
// 16 (a 128-byte row of banks) spreads the blocked, reversed-blocked and coalesced orders over distinct banks.
constexpr int kRankingStaged = kRankingTile + kRankingTile / 16;
__device__ __forceinline__ int staged_index(int k) { return k + k / 16; }

// The global scan values at sorted position q, from the tile-local scans and the scanned tile totals (see the
// header: phase 2).
__device__ __forceinline__ double global_prefix(int64_t q, const double* __restrict__ local_prefix,
                                                const double* __restrict__ prefix_totals) {
  const int64_t tile = q / kRankingTile;
  const double before = tile > 0 ? prefix_totals[tile - 1] : -INFINITY;
  return LogAddExp()(local_prefix[q], before);
}
__device__ __forceinline__ double global_suffix(int64_t q, const double* __restrict__ local_suffix,
                                                const double* __restrict__ suffix_totals, int64_t tiles) {
  const int64_t tile = q / kRankingTile;
  const double after = tile + 1 < tiles ? suffix_totals[tile + 1] : -INFINITY;
  return LogAddExp()(local_suffix[q], after);
}

// Merges the OnlineLse states of all threads of the block; the result is valid in thread 0. Call at most once per
// kernel (its shared memory is not synchronised for reuse), from every thread (shuffles and __syncthreads).
__device__ __forceinline__ OnlineLse<double> block_merge_lse(OnlineLse<double> state) {
  __shared__ double warp_max[kRankingWarps];
  __shared__ double warp_sum_exp[kRankingWarps];
  state.merge_lanes(kWarpSize);
  const int warp = threadIdx.x / kWarpSize;
  if (threadIdx.x % kWarpSize == 0) {
    warp_max[warp] = state.max;
    warp_sum_exp[warp] = state.sum;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    state.init();
    for (int w = 0; w < kRankingWarps; ++w) state.merge(warp_max[w], warp_sum_exp[w]);
  }
  return state;
}

// log(1 + exp(t)) without overflow; exactly 0 for t = -inf.
__device__ __forceinline__ double softplus(double t) { return t > 0 ? t + log1p(exp(-t)) : log1p(exp(t)); }

// ---------------------------------------------------------------------------------------------------------
// Phase 1: one block per tile [start, start + len) of sorted positions.
//   sorted_scores[p] = s_p = scores[order[p] * stride] in float64;
//   local_prefix[p]  = logsumexp of s_q over start <= q <= p;          prefix_totals[tile] = over the tile;
//   with kSuffix:
//   local_suffix[p]  = logsumexp of -s_q over p <= q < start + len;    suffix_totals[tile] = over the tile.
// ---------------------------------------------------------------------------------------------------------
template <typename scalar_t, bool kSuffix>
__global__ void __launch_bounds__(kRankingThreads)
    _ranking_tile_scan_kernel(const scalar_t* __restrict__ scores, int64_t stride, const int64_t* __restrict__ order,
                              int64_t n, double* __restrict__ sorted_scores, double* __restrict__ local_prefix,
                              double* __restrict__ prefix_totals, double* __restrict__ local_suffix,
                              double* __restrict__ suffix_totals) {
  __shared__ double staged_scores[kRankingStaged];
  __shared__ double staged_scan[kRankingStaged];
  __shared__ typename RankingBlockScan::TempStorage scan_temp;
  const int64_t tile = blockIdx.x;
  const int64_t start = tile * kRankingTile;
  // 1 <= len <= kRankingTile: the grid has exactly ranking_tiles(n) blocks; the last tile may be partial.
  const int len = n - start < kRankingTile ? static_cast<int>(n - start) : kRankingTile;

  // Gather (coalesced over positions; the score reads themselves are random: order is a permutation). A fixed
  // trip count, unrolled, so that each thread has its 8 independent reads in flight at once.
#pragma unroll
  for (int it = 0; it < kRankingItemsPerThread; ++it) {
    const int k = it * kRankingThreads + threadIdx.x;
    if (k < len) {
      const int64_t p = start + k;
      const double s = static_cast<double>(scores[order[p] * stride]);
      sorted_scores[p] = s;
      staged_scores[staged_index(k)] = s;
    }
  }
  __syncthreads();  // staged_scores is read below in the blocked order, by other threads

  // Prefix of s. Offsets past the end of a partial tile hold the identity -inf (they come after every valid
  // offset in this scan order, so they change no stored value and no total).
  double items[kRankingItemsPerThread];
  double total;
#pragma unroll
  for (int it = 0; it < kRankingItemsPerThread; ++it) {
    const int k = threadIdx.x * kRankingItemsPerThread + it;
    items[it] = k < len ? staged_scores[staged_index(k)] : -INFINITY;
  }
  RankingBlockScan(scan_temp).InclusiveScan(items, items, LogAddExp(), total);
#pragma unroll
  for (int it = 0; it < kRankingItemsPerThread; ++it) {
    staged_scan[staged_index(threadIdx.x * kRankingItemsPerThread + it)] = items[it];
  }
  if (threadIdx.x == 0) prefix_totals[tile] = total;
  __syncthreads();  // staged_scan is stored below in the coalesced order, by other threads
  for (int k = threadIdx.x; k < len; k += kRankingThreads) local_prefix[start + k] = staged_scan[staged_index(k)];

  if constexpr (kSuffix) {
    __syncthreads();  // staged_scan is overwritten below, and scan_temp reused, while others may still read them
    // Suffix of -s: the scan runs over reversed offsets, thread t holding offsets kRankingTile - 1 - (8t + it).
    // The offsets past the end of a partial tile now come first in scan order, as the identity.
#pragma unroll
    for (int it = 0; it < kRankingItemsPerThread; ++it) {
      const int k = kRankingTile - 1 - (threadIdx.x * kRankingItemsPerThread + it);
      items[it] = k < len ? -staged_scores[staged_index(k)] : -INFINITY;
    }
    RankingBlockScan(scan_temp).InclusiveScan(items, items, LogAddExp(), total);
#pragma unroll
    for (int it = 0; it < kRankingItemsPerThread; ++it) {
      staged_scan[staged_index(kRankingTile - 1 - (threadIdx.x * kRankingItemsPerThread + it))] = items[it];
    }
    if (threadIdx.x == 0) suffix_totals[tile] = total;
    __syncthreads();
    for (int k = threadIdx.x; k < len; k += kRankingThreads) local_suffix[start + k] = staged_scan[staged_index(k)];
  }
}

// ---------------------------------------------------------------------------------------------------------
// Phase 2: one block scans the tile totals in place, walking them in tiles with a carried prefix; reverse =
// true scans from the last element down (the suffix totals). In place is safe: each thread rewrites only the
// elements it read, and the tiles of this walk are disjoint.
// ---------------------------------------------------------------------------------------------------------
__device__ __forceinline__ void log_scan_in_place(double* __restrict__ values, int64_t count, bool reverse,
                                                  typename RankingBlockScan::TempStorage& temp) {
  RunningLogPrefix carry{-INFINITY};
  for (int64_t tile = 0; tile < count; tile += kRankingTile) {
    double items[kRankingItemsPerThread];
#pragma unroll
    for (int it = 0; it < kRankingItemsPerThread; ++it) {
      const int64_t rank = tile + static_cast<int64_t>(threadIdx.x) * kRankingItemsPerThread + it;  // scan order
      items[it] = rank < count ? values[reverse ? count - 1 - rank : rank] : -INFINITY;
    }
    RankingBlockScan(temp).InclusiveScan(items, items, LogAddExp(), carry);
#pragma unroll
    for (int it = 0; it < kRankingItemsPerThread; ++it) {
      const int64_t rank = tile + static_cast<int64_t>(threadIdx.x) * kRankingItemsPerThread + it;
      if (rank < count) values[reverse ? count - 1 - rank : rank] = items[it];
    }
    __syncthreads();  // temp storage is reused by the next tile (and by the next call)
  }
}

// suffix_totals is nullptr in forward (no suffix scan).
__global__ void __launch_bounds__(kRankingThreads, 1)
    _ranking_totals_scan_kernel(double* __restrict__ prefix_totals, double* __restrict__ suffix_totals,
                                int64_t tiles) {
  __shared__ typename RankingBlockScan::TempStorage scan_temp;
  log_scan_in_place(prefix_totals, tiles, /*reverse=*/false, scan_temp);
  if (suffix_totals != nullptr) log_scan_in_place(suffix_totals, tiles, /*reverse=*/true, scan_temp);
}

// ---------------------------------------------------------------------------------------------------------
// Phase 3: one block per tile: (max, sum of exp) over the tile's positions p of -s_p + log A_p, where
// log A_p = prefix(group_first[p] - 1) (no term where group_first[p] == 0: nothing ranks below p's label).
// ---------------------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(kRankingThreads)
    _ranking_pair_sum_kernel(const double* __restrict__ sorted_scores, const int64_t* __restrict__ group_first,
                             int64_t n, const double* __restrict__ local_prefix,
                             const double* __restrict__ prefix_totals, double* __restrict__ partial_max,
                             double* __restrict__ partial_sum_exp) {
  const int64_t start = static_cast<int64_t>(blockIdx.x) * kRankingTile;
  const int len = n - start < kRankingTile ? static_cast<int>(n - start) : kRankingTile;
  OnlineLse<double> state;
  state.init();
#pragma unroll
  for (int it = 0; it < kRankingItemsPerThread; ++it) {  // fixed trip count, unrolled: reads overlap
    const int k = it * kRankingThreads + threadIdx.x;
    if (k >= len) continue;
    const int64_t p = start + k;
    const int64_t first = group_first[p];
    if (first == 0) continue;
    state.add(-sorted_scores[p] + global_prefix(first - 1, local_prefix, prefix_totals));
  }
  state = block_merge_lse(state);
  if (threadIdx.x == 0) {
    partial_max[blockIdx.x] = state.max;  // (-inf, 0) for a tile with no term
    partial_sum_exp[blockIdx.x] = state.sum;
  }
}

// ---------------------------------------------------------------------------------------------------------
// Phase 4: one block: T = log S from the partials (-inf when no pair has label_i < label_j, e.g. all labels
// equal, or count == 0), out[0] = softplus(T) = log(1 + S) (exactly 0 for T = -inf).
// ---------------------------------------------------------------------------------------------------------
template <typename out_t>
__global__ void __launch_bounds__(kRankingThreads, 1)
    _ranking_finish_kernel(const double* __restrict__ partial_max, const double* __restrict__ partial_sum_exp,
                           int64_t count, out_t* __restrict__ out) {
  OnlineLse<double> state;
  state.init();
  for (int64_t b = threadIdx.x; b < count; b += kRankingThreads) state.merge(partial_max[b], partial_sum_exp[b]);
  state = block_merge_lse(state);
  if (threadIdx.x == 0) out[0] = static_cast<out_t>(softplus(state.value()));
}

// ---------------------------------------------------------------------------------------------------------
// Phase 5 (backward): grad[order[p]] = g * (exp(s_p + log B_p - log Z) - exp(-s_p + log A_p - log Z)), with
// log Z = log(1 + S) from phase 4 in float64 (rather than trusting a rounded saved loss). Both exponentials
// are shares of S / (1 + S), at most 1. order is a permutation: every output element is written once.
// ---------------------------------------------------------------------------------------------------------
template <typename scalar_t>
__global__ void __launch_bounds__(kRankingThreads)
    _ranking_grad_kernel(const scalar_t* __restrict__ grad_loss, const double* __restrict__ sorted_scores,
                         const int64_t* __restrict__ order, const int64_t* __restrict__ group_first,
                         const int64_t* __restrict__ group_past, int64_t n, const double* __restrict__ local_prefix,
                         const double* __restrict__ prefix_totals, const double* __restrict__ local_suffix,
                         const double* __restrict__ suffix_totals, int64_t tiles, const double* __restrict__ log_z_in,
                         scalar_t* __restrict__ grad_scores) {
  const double log_z = log_z_in[0];
  const double g = static_cast<double>(grad_loss[0]);
  const int64_t step = static_cast<int64_t>(gridDim.x) * kRankingThreads;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * kRankingThreads + threadIdx.x; p < n; p += step) {
    const int64_t first = group_first[p], past = group_past[p];
    const double s = sorted_scores[p];
    // One share at a time: with both logs live at once, ptxas (CUDA 13, sm_90) spilled 8 bytes here.
    const double log_b = past < n ? global_suffix(past, local_suffix, suffix_totals, tiles) : -INFINITY;  // above
    const double up_share = exp(s + log_b - log_z);
    const double log_a = first > 0 ? global_prefix(first - 1, local_prefix, prefix_totals) : -INFINITY;  // below
    const double grad = up_share - exp(-s + log_a - log_z);
    grad_scores[order[p]] = static_cast<scalar_t>(g * grad);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Scratch (float64, one buffer from the binding). Forward: sorted_scores [n] | local_prefix [n] |
// prefix_totals [tiles] | partial_max [tiles] | partial_sum_exp [tiles]. Backward adds local_suffix [n] and
// suffix_totals [tiles] and log_z [1].
// ---------------------------------------------------------------------------------------------------------
int64_t ranking_fwd_scratch_size(int64_t n) { return n < 0 ? 0 : 2 * n + 3 * ranking_tiles(n); }
int64_t ranking_bwd_scratch_size(int64_t n) { return n < 0 ? 0 : 3 * n + 4 * ranking_tiles(n) + 1; }

namespace {
// The grid of phases 1 and 3 is one block per tile: within the grid's x limit for n below 4.3e12.
bool tiles_fit_grid(int64_t tiles) { return tiles <= 0x7fffffff; }
}  // namespace

// ---------------------------------------------------------------------------------------------------------
// Launchers. scratch: ranking_{fwd,bwd}_scratch_size(n) doubles; grad_scores is contiguous [n]. n == 0:
// forward writes loss 0 (phase 4 over no partials), backward does nothing.
// ---------------------------------------------------------------------------------------------------------
template <typename scalar_t>
cudaError_t ranking_fwd(const scalar_t* scores, int64_t stride, const int64_t* order, const int64_t* group_first,
                        int64_t n, double* scratch, scalar_t* loss_out, cudaStream_t stream) {
  if (n < 0) return cudaErrorInvalidValue;
  const int64_t tiles = ranking_tiles(n);
  if (!tiles_fit_grid(tiles)) return cudaErrorInvalidValue;
  double* sorted_scores = scratch;
  double* local_prefix = sorted_scores + n;
  double* prefix_totals = local_prefix + n;
  double* partial_max = prefix_totals + tiles;
  double* partial_sum_exp = partial_max + tiles;
  if (n > 0) {
    const dim3 grid(static_cast<unsigned>(tiles));
    _ranking_tile_scan_kernel<scalar_t, false><<<grid, kRankingThreads, 0, stream>>>(
        scores, stride, order, n, sorted_scores, local_prefix, prefix_totals, nullptr, nullptr);
    if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
    _ranking_totals_scan_kernel<<<1, kRankingThreads, 0, stream>>>(prefix_totals, nullptr, tiles);
    if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
    _ranking_pair_sum_kernel<<<grid, kRankingThreads, 0, stream>>>(sorted_scores, group_first, n, local_prefix,
                                                                   prefix_totals, partial_max, partial_sum_exp);
    if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  }
  _ranking_finish_kernel<scalar_t>
      <<<1, kRankingThreads, 0, stream>>>(partial_max, partial_sum_exp, tiles, loss_out);
  return cudaGetLastError();
}

template <typename scalar_t>
cudaError_t ranking_bwd(const scalar_t* grad_loss, const scalar_t* scores, int64_t stride, const int64_t* order,
                        const int64_t* group_first, const int64_t* group_past, int64_t n, double* scratch,
                        scalar_t* grad_scores, cudaStream_t stream) {
  if (n < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  const int64_t tiles = ranking_tiles(n);
  if (!tiles_fit_grid(tiles)) return cudaErrorInvalidValue;
  double* sorted_scores = scratch;
  double* local_prefix = sorted_scores + n;
  double* local_suffix = local_prefix + n;
  double* prefix_totals = local_suffix + n;
  double* suffix_totals = prefix_totals + tiles;
  double* partial_max = suffix_totals + tiles;
  double* partial_sum_exp = partial_max + tiles;
  double* log_z = partial_sum_exp + tiles;
  const dim3 grid(static_cast<unsigned>(tiles));
  _ranking_tile_scan_kernel<scalar_t, true><<<grid, kRankingThreads, 0, stream>>>(
      scores, stride, order, n, sorted_scores, local_prefix, prefix_totals, local_suffix, suffix_totals);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  _ranking_totals_scan_kernel<<<1, kRankingThreads, 0, stream>>>(prefix_totals, suffix_totals, tiles);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  _ranking_pair_sum_kernel<<<grid, kRankingThreads, 0, stream>>>(sorted_scores, group_first, n, local_prefix,
                                                                 prefix_totals, partial_max, partial_sum_exp);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  _ranking_finish_kernel<double><<<1, kRankingThreads, 0, stream>>>(partial_max, partial_sum_exp, tiles, log_z);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  const int64_t blocks = (n + kRankingThreads - 1) / kRankingThreads;
  const dim3 grad_grid(static_cast<unsigned>(blocks < kRankingMaxGradBlocks ? blocks : kRankingMaxGradBlocks));
  _ranking_grad_kernel<scalar_t><<<grad_grid, kRankingThreads, 0, stream>>>(
      grad_loss, sorted_scores, order, group_first, group_past, n, local_prefix, prefix_totals, local_suffix,
      suffix_totals, tiles, log_z, grad_scores);
  return cudaGetLastError();
}

// Explicit instantiations: the binding (csrc/ranking_loss.cpp) declares these and links against them.
#define ANGLE_KERNELS_INSTANTIATE_RANKING(T)                                                                   \
  template cudaError_t ranking_fwd<T>(const T*, int64_t, const int64_t*, const int64_t*, int64_t, double*, T*, \
                                      cudaStream_t);                                                          \
  template cudaError_t ranking_bwd<T>(const T*, const T*, int64_t, const int64_t*, const int64_t*,             \
                                      const int64_t*, int64_t, double*, T*, cudaStream_t);
ANGLE_KERNELS_INSTANTIATE_RANKING(float)
ANGLE_KERNELS_INSTANTIATE_RANKING(double)
#undef ANGLE_KERNELS_INSTANTIATE_RANKING

}  // namespace angle_kernels

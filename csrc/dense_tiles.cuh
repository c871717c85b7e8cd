// What the dense schemes' tile kernels (csrc/similarity_lse.cu, csrc/similarity_xent_dense.cu) have in common: the
// grid bounds of a row block's tiles, the gradient kernel's running sum over the prefixes (DenseRunning), its radial
// partial sums (warp sums, then the warps in order: no atomics), and the launch at the operand type. Torch-free.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common.cuh"
#include "dense_types.h"

namespace angle_kernels {

// Whether a row block's [n_rows, cols] tile fits the kernels' grids: one stats block per row, and the gradient's
// grid of grad_rows x grad_cols tiles (y at most 65535).
inline bool dense_tiles_ok(int64_t n_rows, int64_t cols, int grad_rows, int grad_cols) {
  return n_rows >= 1 && cols >= 1 && n_rows <= 0x7fffffff && (n_rows + grad_rows - 1) / grad_rows <= 65535 &&
         (cols + grad_cols - 1) / grad_cols <= 0x7fffffff;
}

// H_j = G_j + (q_inv_j+1 / q_inv_j) (c_inv_j+1 / c_inv_j) H_j+1: the running sum over the wider prefixes at one
// element (g: G_j; row_ratio, col_ratio: the element's ratios), written to running.next when it is kept.
template <typename acc>
__device__ __forceinline__ acc dense_running_sum(const DenseRunning<acc>& running, int64_t local, int64_t col, acc g,
                                                 acc row_ratio, acc col_ratio) {
  acc h = g;
  if (running.previous != nullptr) {
    h += running.previous[local * running.ld + col] * row_ratio * col_ratio;
  }
  if (running.next != nullptr) running.next[local * running.ld + col] = h;
  return h;
}

// The gradient block's radial partials: its column sums col_sum (each thread's, in row order) to
// col_partial[blockIdx.y, col], and its rows' sums of row_terms (warp shuffles, then the kThreads / kWarpSize warps
// in order through row_sums, the kernel's shared memory) to row_partial[blockIdx.x, local]. Every thread of the
// block calls it (a barrier).
template <int kRows, int kThreads, typename acc>
__device__ __forceinline__ void dense_radial_partials(const acc (&row_terms)[kRows], acc col_sum, bool col_ok,
                                                      int64_t col, int64_t n_rows, int64_t cols,
                                                      acc (*row_sums)[kRows], acc* __restrict__ row_partial,
                                                      acc* __restrict__ col_partial) {
  constexpr int kWarps = kThreads / kWarpSize;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int k = 0; k < kRows; ++k) {
    const acc sum = warp_sum(row_terms[k]);
    if (lane == 0) row_sums[warp][k] = sum;
  }
  if (col_ok) col_partial[static_cast<int64_t>(blockIdx.y) * cols + col] = col_sum;
  __syncthreads();
  if (threadIdx.x < kRows) {
    const int64_t local = static_cast<int64_t>(blockIdx.y) * kRows + threadIdx.x;
    acc sum = row_sums[0][threadIdx.x];
    for (int other = 1; other < kWarps; ++other) sum += row_sums[other][threadIdx.x];
    if (local < n_rows) row_partial[static_cast<int64_t>(blockIdx.x) * n_rows + local] = sum;
  }
}

template <typename T>
struct DenseOutTag {
  using type = T;
};

// launch(DenseOutTag<out_t>{}) with the gradient tile's element type out_t of `operand` (DenseOperand): double for
// double tiles, float, __half or __nv_bfloat16 for float tiles; cudaErrorInvalidValue for any other pairing.
template <typename acc, typename Launch>
cudaError_t dense_launch_for_operand(int operand, Launch&& launch) {
  if constexpr (std::is_same<acc, double>::value) {
    if (operand != kDenseOperandDouble) return cudaErrorInvalidValue;
    return launch(DenseOutTag<double>{});
  } else {
    switch (operand) {
      case kDenseOperandFloat:
        return launch(DenseOutTag<float>{});
      case kDenseOperandHalf:
        return launch(DenseOutTag<__half>{});
      case kDenseOperandBFloat16:
        return launch(DenseOutTag<__nv_bfloat16>{});
      default:
        return cudaErrorInvalidValue;
    }
  }
}

}  // namespace angle_kernels

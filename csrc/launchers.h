// Host-side declarations of the CUDA launchers in csrc/*.cu, shared by the kernels and the torch binding.
//
// Host-safe: this header is included by csrc/bindings.cpp, compiled by the host C++ compiler, so it holds
// no device code. Every launcher takes raw pointers, sizes and strides in elements (int64_t) and a stream,
// and returns cudaSuccess, a launch error, or cudaErrorInvalidValue for arguments it cannot handle.
// Element types: float, double, __half, __nv_bfloat16 (layout-identical to at::Half / at::BFloat16).
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

namespace angle_kernels {

// Compute ("accumulation") type: double for double inputs, float for float, half and bfloat16.
template <typename scalar_t>
struct AccType {
  using type = float;
};
template <>
struct AccType<double> {
  using type = double;
};
template <typename scalar_t>
using acc_t = typename AccType<scalar_t>::type;

// ---- pair_scores.cu -------------------------------------------------------------------------------------
// x: [G, K, D] with strides (stride_g, stride_k, stride_d). Outputs cos, angle: [G*(K-1)]; stats: [G*(K-1), 4].
template <typename scalar_t>
cudaError_t pair_scores_fwd(const scalar_t* x, int64_t num_groups, int64_t group_size, int64_t dim, int64_t stride_g,
                            int64_t stride_k, int64_t stride_d, bool with_angle, acc_t<scalar_t>* cos_out,
                            acc_t<scalar_t>* angle_out, acc_t<scalar_t>* stats_out, cudaStream_t stream);
// grad_cos, grad_angle: contiguous [G*(K-1)]; dx: contiguous [G, K, D] (fully overwritten).
template <typename scalar_t>
cudaError_t pair_scores_bwd(const acc_t<scalar_t>* grad_cos, const acc_t<scalar_t>* grad_angle, const scalar_t* x,
                            const acc_t<scalar_t>* stats, int64_t num_groups, int64_t group_size, int64_t dim,
                            int64_t stride_g, int64_t stride_k, int64_t stride_d, bool with_angle, scalar_t* dx,
                            cudaStream_t stream);
template <typename scalar_t>
int64_t pair_scores_bwd_max_group_size();

// ---- ranking.cu ------------------------------------------------------------------------------------------
// scores: [n] with element stride `stride` (float or double). order, group_first, group_past: contiguous [n]
// int64 from the binding's sort (see ranking.cu). prefix/suffix: float64 scratch [n]. loss_out: [1].
template <typename scalar_t>
cudaError_t ranking_fwd(const scalar_t* scores, int64_t stride, const int64_t* order, const int64_t* group_first,
                        int64_t n, double* prefix_scratch, scalar_t* loss_out, cudaStream_t stream);
// grad_loss: [1] on the device; grad_scores: contiguous [n], fully overwritten.
template <typename scalar_t>
cudaError_t ranking_bwd(const scalar_t* grad_loss, const scalar_t* scores, int64_t stride, const int64_t* order,
                        const int64_t* group_first, const int64_t* group_past, int64_t n, double* prefix_scratch,
                        double* suffix_scratch, scalar_t* grad_scores, cudaStream_t stream);

// ---- similarity_xent.cu ----------------------------------------------------------------------------------
enum XentTarget : int { kTargetPartner = 0, kTargetDiagonal = 1 };

// One similarity cross-entropy problem (see similarity_xent.cu). q: [rows_q, dim]; c: [rows_c, dim]. In the
// symmetric case (the contract's c = None) c, rows_c and the c strides repeat q's and `symmetric` is true.
template <typename scalar_t>
struct XentProblem {
  const scalar_t* q;
  int64_t rows_q, q_stride_row, q_stride_dim;
  const scalar_t* c;
  int64_t rows_c, c_stride_row, c_stride_dim;
  int64_t dim;
  bool symmetric;
  double scale;
  int target;  // XentTarget
  bool exclude_diagonal;
  double margin;                           // radians, >= 0
  const int64_t* group_ids;                // [rows_q] or nullptr; only with symmetric
  const acc_t<scalar_t>* row_weights;      // [rows_q] or nullptr (all ones)
};

// Forward. Writes the row norms (q_norm [rows_q]; c_norm [rows_c], may equal q_norm when symmetric), the
// per-row logsumexps over all columns and over the positives, and row_loss[i] = w_i (lse_all - lse_pos).
// The loss is sum(row_loss) / rows_q (the binding reduces it).
template <typename scalar_t>
cudaError_t similarity_xent_fwd(const XentProblem<scalar_t>& problem, acc_t<scalar_t>* q_norm,
                                acc_t<scalar_t>* c_norm, acc_t<scalar_t>* lse_all, acc_t<scalar_t>* lse_pos,
                                acc_t<scalar_t>* row_loss, cudaStream_t stream);
// Backward. grad_loss: [1] on the device. Scratch that must be ZERO on entry: dq_acc [rows_q, dim],
// q_coef [rows_q], and (non-symmetric only) dc_acc [rows_c, dim], c_coef [rows_c]; when symmetric pass
// dc_acc = dq_acc and c_coef = q_coef. dq: contiguous [rows_q, dim]; dc: contiguous [rows_c, dim] or
// nullptr when symmetric.
template <typename scalar_t>
cudaError_t similarity_xent_bwd(const XentProblem<scalar_t>& problem, const acc_t<scalar_t>* grad_loss,
                                const acc_t<scalar_t>* q_norm, const acc_t<scalar_t>* c_norm,
                                const acc_t<scalar_t>* lse_all, const acc_t<scalar_t>* lse_pos,
                                acc_t<scalar_t>* dq_acc, acc_t<scalar_t>* dc_acc, acc_t<scalar_t>* q_coef,
                                acc_t<scalar_t>* c_coef, scalar_t* dq, scalar_t* dc, cudaStream_t stream);

}  // namespace angle_kernels

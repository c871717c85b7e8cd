// What the CUDA launchers (csrc/<op>.cu) and their torch bindings (csrc/<op>.cpp) share: the compute type and
// the parameter types of the launchers' signatures. The launchers themselves are declared in the binding that
// calls them (csrc/<op>.cpp, which also says what catches a declaration that differs from its definition).
//
// Host-safe and torch-free: the kernels include this header (through common.cuh) and are compiled by nvcc
// alone, and the bindings, compiled by the host C++ compiler, include it too; so it holds no device code and
// no torch, c10 or ATen headers.
//
// The launchers' conventions: every launcher takes raw pointers, sizes and strides in elements (int64_t) and a
// cudaStream_t, and returns cudaError_t: cudaSuccess, a launch error, or cudaErrorInvalidValue for arguments it
// cannot handle. Element types: float, double, __half, __nv_bfloat16 (layout-identical to at::Half and
// at::BFloat16).
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

// ---- similarity_xent ------------------------------------------------------------------------------------
// The target column of each row: both sides name it (the binding parses the op's `target` string into it).
enum XentTarget : int { kTargetPartner = 0, kTargetDiagonal = 1 };

// One similarity cross-entropy problem (see similarity_xent.cu), the first parameter of its launchers: a type
// of the launchers' signatures, so it is defined once, here, for both sides. q: [rows_q, dim]; c: [rows_c, dim].
// In the symmetric case (the contract's c = None) c, rows_c and the c strides repeat q's and `symmetric` is true.
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

}  // namespace angle_kernels

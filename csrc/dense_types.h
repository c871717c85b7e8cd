// The parameter types that the dense schemes' launchers (csrc/similarity_lse.cu, csrc/similarity_xent_dense.cu)
// have in common, included by each op's types header: one definition of the operand codes and of the running sum,
// so that the two ops and their bindings (csrc/dense_binding.h parses the codes for both) cannot disagree on them.
// Host-safe and torch-free, like launcher_types.h.
#pragma once

#include <cstdint>

namespace angle_kernels {

// The element type the gradient kernel rounds its tile to: the products' operand dtype.
enum DenseOperand : int {
  kDenseOperandFloat = 0,
  kDenseOperandDouble = 1,
  kDenseOperandHalf = 2,
  kDenseOperandBFloat16 = 3
};

// With dims, the gradient kernel's running sum over the prefixes, from the widest down (each op's
// cuda_ops/<op>.py): H_j = G_j + row_ratio_i col_ratio_j H_j+1 read from `previous` (null for the widest prefix)
// and written to `next` (null for the narrowest), both [n_rows, cols] rows ld apart; the ratios
// q_inv_j+1 / q_inv_j [rows] and c_inv_j+1 / c_inv_j [cols] take H_j+1 into prefix j's frame. All null with one
// width.
template <typename acc>
struct DenseRunning {
  const acc* previous;
  acc* next;
  int64_t ld;
  const acc* row_ratio;
  const acc* col_ratio;
};

}  // namespace angle_kernels

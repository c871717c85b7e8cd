// The torch side that the dense schemes' bindings (csrc/similarity_lse.cpp, csrc/similarity_xent_dense.cpp) have in
// common: the operand codes (dense_types.h) parsed from the schemas' strings, the gradient step's row state and
// running sum checked, its outputs allocated and its radial partials reduced. Included after binding.h, which it
// builds on; `op` names the op in the messages.
#pragma once

#include <ATen/ops/empty.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>

#include <optional>
#include <string>
#include <tuple>

#include "binding.h"
#include "dense_types.h"

namespace angle_kernels::dense_binding {

using namespace angle_kernels::binding;

// The tile of dot products the kernels read: [n_rows >= 1, cols >= 1] float32 or float64 with unit column stride on
// a CUDA device, its rows row0 .. row0 + n_rows within the `rows` rows.
inline void check_dots(const at::Tensor& dots, int64_t row0, int64_t rows, const char* op) {
  check_cuda_tensor(dots, "dots");
  const at::ScalarType acc_dtype = dots.scalar_type();
  TORCH_CHECK_TYPE(acc_dtype == at::kFloat || acc_dtype == at::kDouble,
                   "angle_kernels (cuda): ", op, " dots must be float32 or float64, got ", acc_dtype);
  TORCH_CHECK_VALUE(dots.dim() == 2 && dots.size(0) >= 1 && dots.size(1) >= 1 && dots.stride(1) == 1 &&
                        dots.stride(0) >= dots.size(1),
                    "angle_kernels (cuda): ", op, " dots must be [n_rows >= 1, cols >= 1] with unit column stride, "
                    "got shape ", dots.sizes(), " strides ", dots.strides());
  const int64_t n_rows = dots.size(0);
  TORCH_CHECK_VALUE(row0 >= 0 && row0 + n_rows <= rows, "angle_kernels (cuda): ", op, " rows ", row0, " .. ",
                    row0 + n_rows, " of the block lie past the ", rows, " rows");
}

// A vector the kernels index: contiguous [n] of `type`, on the tile's device.
inline void check_vector(const at::Tensor& t, int64_t n, at::ScalarType type, const char* name,
                         const at::Tensor& dots, const char* op) {
  check_same_device(t, name, dots);
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == n && t.is_contiguous() && t.scalar_type() == type,
                    "angle_kernels (cuda): ", op, " ", name, " must be a contiguous [", n, "] ", type,
                    " tensor, got ", t.scalar_type(), " of shape ", t.sizes());
}

// The DenseOperand code of an operand dtype string; a 16-bit or float32 operand goes with float tiles, float64
// with double tiles.
inline int parse_operand(c10::string_view operand, at::ScalarType acc_dtype, const char* op) {
  int code = -1;
  if (operand == "float32") code = kDenseOperandFloat;
  if (operand == "float64") code = kDenseOperandDouble;
  if (operand == "float16") code = kDenseOperandHalf;
  if (operand == "bfloat16") code = kDenseOperandBFloat16;
  const bool fits = acc_dtype == at::kDouble ? code == kDenseOperandDouble : code >= 0 && code != kDenseOperandDouble;
  TORCH_CHECK_VALUE(fits, "angle_kernels (cuda): ", op, " operand_dtype '", std::string(operand),
                    "' does not go with tiles of ", acc_dtype);
  return code;
}

inline at::ScalarType operand_type(int code) {
  switch (code) {
    case kDenseOperandDouble:
      return at::kDouble;
    case kDenseOperandHalf:
      return at::kHalf;
    case kDenseOperandBFloat16:
      return at::kBFloat16;
    default:
      return at::kFloat;
  }
}

// A per-row state the gradient kernel indexes by global row: contiguous [rows] in the tile's type, on its device.
inline void check_row_state(const at::Tensor& t, const char* name, const at::Tensor& dots, int64_t rows,
                            const char* op) {
  check_same_device(t, name, dots);
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == rows && t.is_contiguous() && t.scalar_type() == dots.scalar_type(),
                    "angle_kernels (cuda): ", op, " ", name, " must be a contiguous [", rows, "] ",
                    dots.scalar_type(), " tensor");
}

// With dims: running [n_rows, cols], row_ratio [rows] and col_ratio [cols], all or none, contiguous, in the tile's
// type, on its device.
inline void check_running(const at::Tensor& dots, int64_t rows, const std::optional<at::Tensor>& running,
                          const std::optional<at::Tensor>& row_ratio, const std::optional<at::Tensor>& col_ratio,
                          const char* op) {
  const at::ScalarType acc_dtype = dots.scalar_type();
  const int64_t n_rows = dots.size(0), cols = dots.size(1);
  TORCH_CHECK_VALUE(running.has_value() == row_ratio.has_value() && running.has_value() == col_ratio.has_value(),
                    "angle_kernels (cuda): ", op, " running, row_ratio and col_ratio go together");
  if (!running.has_value()) return;
  check_same_device(*running, "running", dots);
  TORCH_CHECK_VALUE(running->dim() == 2 && running->size(0) == n_rows && running->size(1) == cols &&
                        running->is_contiguous() && running->scalar_type() == acc_dtype,
                    "angle_kernels (cuda): ", op, " running must be a contiguous [n_rows, cols] tensor of the "
                    "tile's type");
  check_row_state(*row_ratio, "row_ratio", dots, rows, op);
  check_same_device(*col_ratio, "col_ratio", dots);
  TORCH_CHECK_VALUE(col_ratio->dim() == 1 && col_ratio->size(0) == cols && col_ratio->is_contiguous() &&
                        col_ratio->scalar_type() == acc_dtype,
                    "angle_kernels (cuda): ", op, " col_ratio must be a contiguous [cols] tensor of the tile's type");
}

// What the gradient step writes: the tile rounded to the operand type ([0] rows when keep_running and the operand is
// the tile's type: the products then take `next`), `next` ([0] rows without keep_running), and the per-tile radial
// partials [column tiles, n_rows] and [row tiles, cols] of grad_rows x grad_cols tiles ([0] rows without radial),
// reduced by results() in a fixed order (no atomics: deterministic).
struct GradOutputs {
  at::Tensor grad, next, row_partial, col_partial;
  bool rounded;

  GradOutputs(const at::Tensor& dots, int operand, bool radial, bool keep_running, int grad_rows, int grad_cols) {
    const int64_t n_rows = dots.size(0), cols = dots.size(1);
    const int64_t col_tiles = (cols + grad_cols - 1) / grad_cols;
    const int64_t row_tiles = (n_rows + grad_rows - 1) / grad_rows;
    rounded = !keep_running || operand_type(operand) != dots.scalar_type();
    grad = at::empty({rounded ? n_rows : 0, cols}, dots.options().dtype(operand_type(operand)));
    next = at::empty({keep_running ? n_rows : 0, cols}, dots.options());
    row_partial = at::empty({radial ? col_tiles : 0, n_rows}, dots.options());
    col_partial = at::empty({radial ? row_tiles : 0, cols}, dots.options());
  }

  // The running sum the kernel folds in and writes (DenseRunning), row stride the tile's columns.
  template <typename acc>
  DenseRunning<acc> running(const std::optional<at::Tensor>& previous, const std::optional<at::Tensor>& row_ratio,
                            const std::optional<at::Tensor>& col_ratio, bool keep_running) {
    DenseRunning<acc> sums{};
    if (previous.has_value()) {
      sums.previous = data_of<acc>(*previous);
      sums.row_ratio = data_of<acc>(*row_ratio);
      sums.col_ratio = data_of<acc>(*col_ratio);
    }
    sums.next = keep_running ? mutable_data_of<acc>(next) : nullptr;
    sums.ld = next.size(1);
    return sums;
  }

  void* grad_data() { return rounded ? grad.mutable_data_ptr() : nullptr; }
  template <typename acc>
  acc* row_partial_data(bool radial) {
    return radial ? mutable_data_of<acc>(row_partial) : nullptr;
  }
  template <typename acc>
  acc* col_partial_data(bool radial) {
    return radial ? mutable_data_of<acc>(col_partial) : nullptr;
  }

  // (grad, next, row radial sums [n_rows], column radial sums [cols]); zeros without radial.
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> results(const at::Tensor& dots, bool radial) const {
    const int64_t n_rows = dots.size(0), cols = dots.size(1);
    if (!radial) return {grad, next, at::zeros({n_rows}, dots.options()), at::zeros({cols}, dots.options())};
    return {grad, next, row_partial.sum(0), col_partial.sum(0)};
  }
};

// fn(TypeTag<acc>{}) with the tiles' accumulation type acc: double for double tiles, else float.
template <typename Fn>
void dispatch_tile_type(at::ScalarType acc_dtype, Fn&& fn) {
  if (acc_dtype == at::kDouble) {
    fn(TypeTag<double>{});
  } else {
    fn(TypeTag<float>{});
  }
}

// The gradient step of one block on dots' device and current stream: the outputs allocated (GradOutputs, tiles of
// grad_rows x grad_cols), then launch(TypeTag<acc>{}, sums, grad, row_partial, col_partial, stream) with the running
// sum (DenseRunning) and the outputs' pointers, and the radial partials reduced (GradOutputs::results).
template <typename Launch>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> run_grad(
    const at::Tensor& dots, int operand, bool radial, bool keep_running, int grad_rows, int grad_cols,
    const std::optional<at::Tensor>& running, const std::optional<at::Tensor>& row_ratio,
    const std::optional<at::Tensor>& col_ratio, Launch&& launch) {
  const c10::cuda::CUDAGuard guard(dots.device());
  GradOutputs out(dots, operand, radial, keep_running, grad_rows, grad_cols);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dots.device().index()).stream();
  dispatch_tile_type(dots.scalar_type(), [&](auto tag) {
    using acc = typename decltype(tag)::type;
    launch(tag, out.running<acc>(running, row_ratio, col_ratio, keep_running), out.grad_data(),
           out.row_partial_data<acc>(radial), out.col_partial_data<acc>(radial), stream);
  });
  return out.results(dots, radial);
}

}  // namespace angle_kernels::dense_binding

// Torch binding of csrc/similarity_xent_dense.cu: the CUDA kernels of the ops
// angle_kernels::cuda_similarity_xent_dense_stats and cuda_similarity_xent_dense_grad, the tile steps of one row
// block of the dense scheme (schemas, fake implementations and the orchestration with torch products:
// angle_kernels/cuda_ops/similarity_xent_dense.py). What every binding function does: csrc/binding.h.

// ---- the launchers this file calls ---------------------------------------------------------------------------
// Declared here (and only here), defined and explicitly instantiated (float, double) in
// csrc/similarity_xent_dense.cu; their parameter structs are in similarity_xent_dense_types.h, shared by both sides.
// A declaration that differs from its definition fails to link (tests/test_csrc_compile.py checks the symbols
// without torch). So keep this part torch-free.
#include "similarity_xent_dense_types.h"

namespace angle_kernels {

// Forward: lse_all and lse_pos of the block's rows, [n_rows].
template <typename acc>
cudaError_t similarity_xent_dense_stats(const XentTiles<acc>& tiles, acc* lse_all, acc* lse_pos,
                                        cudaStream_t stream);
// The gradient tile (with dims, the running sum over the prefixes: XentRunning) rounded to `operand`
// (XentOperand) into grad [n_rows, cols] (rows ld_grad apart; null when the products take running.next), and with
// `radial` the partial radial sums row_partial [column tiles, n_rows] and col_partial [row tiles, cols]
// (kXentGradCols, kXentGradRows). lse_all, lse_pos, coef: [rows], by global row.
template <typename acc>
cudaError_t similarity_xent_dense_grad(const XentTiles<acc>& tiles, const acc* lse_all, const acc* lse_pos,
                                       const acc* coef, const XentRunning<acc>& running, bool radial, int operand,
                                       void* grad, int64_t ld_grad, acc* row_partial, acc* col_partial,
                                       cudaStream_t stream);

}  // namespace angle_kernels

// ---- the binding ---------------------------------------------------------------------------------------------
#include "binding.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>

#include <cmath>
#include <optional>
#include <string>
#include <tuple>

namespace {

using namespace angle_kernels::binding;

bool parse_partner(c10::string_view target) {
  TORCH_CHECK_VALUE(target == "partner" || target == "diagonal",
                    "angle_kernels (cuda): similarity_xent target must be 'partner' or 'diagonal', got '",
                    std::string(target), "'");
  return target == "partner";
}

int parse_operand(c10::string_view operand, at::ScalarType acc_dtype) {
  int code = -1;
  if (operand == "float32") code = angle_kernels::kXentOperandFloat;
  if (operand == "float64") code = angle_kernels::kXentOperandDouble;
  if (operand == "float16") code = angle_kernels::kXentOperandHalf;
  if (operand == "bfloat16") code = angle_kernels::kXentOperandBFloat16;
  const bool fits = acc_dtype == at::kDouble ? code == angle_kernels::kXentOperandDouble
                                             : code >= 0 && code != angle_kernels::kXentOperandDouble;
  TORCH_CHECK_VALUE(fits, "angle_kernels (cuda): similarity_xent operand_dtype '", std::string(operand),
                    "' does not go with tiles of ", acc_dtype);
  return code;
}

at::ScalarType operand_type(int code) {
  switch (code) {
    case angle_kernels::kXentOperandDouble:
      return at::kDouble;
    case angle_kernels::kXentOperandHalf:
      return at::kHalf;
    case angle_kernels::kXentOperandBFloat16:
      return at::kBFloat16;
    default:
      return at::kFloat;
  }
}

// Checks what the kernels index: the tile [n_rows, cols] with unit column stride, row_inv [rows] with
// row0 + n_rows <= rows, col_inv [cols], groups [rows] int64 (columns are rows then: cols == rows), all contiguous,
// on the tile's device, in the tile's type.
void check_tiles(const at::Tensor& dots, const at::Tensor& row_inv, const at::Tensor& col_inv,
                 const std::optional<at::Tensor>& groups, int64_t row0) {
  check_cuda_tensor(dots, "dots");
  const at::ScalarType acc_dtype = dots.scalar_type();
  TORCH_CHECK_TYPE(acc_dtype == at::kFloat || acc_dtype == at::kDouble,
                   "angle_kernels (cuda): similarity_xent dots must be float32 or float64, got ", acc_dtype);
  TORCH_CHECK_VALUE(dots.dim() == 2 && dots.size(0) >= 1 && dots.size(1) >= 1 && dots.stride(1) == 1 &&
                        dots.stride(0) >= dots.size(1),
                    "angle_kernels (cuda): similarity_xent dots must be [n_rows >= 1, cols >= 1] with unit column "
                    "stride, got shape ", dots.sizes(), " strides ", dots.strides());
  const int64_t n_rows = dots.size(0), cols = dots.size(1), rows = row_inv.numel();
  TORCH_CHECK_VALUE(row0 >= 0 && row0 + n_rows <= rows, "angle_kernels (cuda): similarity_xent rows ", row0, " .. ",
                    row0 + n_rows, " of the block lie past the ", rows, " rows");
  const auto vector = [&](const at::Tensor& t, int64_t n, at::ScalarType type, const char* name) {
    check_same_device(t, name, dots);
    TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == n && t.is_contiguous() && t.scalar_type() == type,
                      "angle_kernels (cuda): similarity_xent ", name, " must be a contiguous [", n, "] ", type,
                      " tensor, got ", t.scalar_type(), " of shape ", t.sizes());
  };
  vector(row_inv, rows, acc_dtype, "row_inv");
  vector(col_inv, cols, acc_dtype, "col_inv");
  if (groups.has_value()) {
    TORCH_CHECK_VALUE(cols == rows, "angle_kernels (cuda): similarity_xent group ids need the columns to be the rows");
    vector(*groups, rows, at::kLong, "groups");
  }
}

template <typename acc>
angle_kernels::XentTiles<acc> make_tiles(const at::Tensor& dots, const at::Tensor& row_inv, const at::Tensor& col_inv,
                                         const std::optional<at::Tensor>& groups, int64_t row0, double scale,
                                         c10::string_view target, bool exclude_diagonal, double margin) {
  angle_kernels::XentTiles<acc> t;
  t.dots = data_of<acc>(dots);
  t.ld_dots = dots.stride(0);
  t.row_inv = data_of<acc>(row_inv);
  t.col_inv = data_of<acc>(col_inv);
  t.groups = groups.has_value() ? data_of<int64_t>(*groups) : nullptr;
  t.row0 = row0;
  t.n_rows = dots.size(0);
  t.rows = row_inv.size(0);
  t.cols = dots.size(1);
  t.scale = scale;
  t.cos_margin = std::cos(margin);
  t.sin_margin = std::sin(margin);
  t.partner_target = parse_partner(target);
  t.exclude_diagonal = exclude_diagonal;
  t.has_margin = margin != 0.0;
  return t;
}

std::tuple<at::Tensor, at::Tensor> similarity_xent_dense_stats(
    const at::Tensor& dots, const at::Tensor& row_inv, const at::Tensor& col_inv,
    const std::optional<at::Tensor>& groups, int64_t row0, double scale, c10::string_view target,
    bool exclude_diagonal, double margin) {
  check_tiles(dots, row_inv, col_inv, groups, row0);
  const c10::cuda::CUDAGuard guard(dots.device());
  const int64_t n_rows = dots.size(0);
  at::Tensor lse_all = at::empty({n_rows}, dots.options());
  at::Tensor lse_pos = at::empty({n_rows}, dots.options());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dots.device().index()).stream();
  const auto run = [&](auto tag) {
    using acc = typename decltype(tag)::type;
    const auto tiles = make_tiles<acc>(dots, row_inv, col_inv, groups, row0, scale, target, exclude_diagonal, margin);
    check_launch(angle_kernels::similarity_xent_dense_stats<acc>(tiles, mutable_data_of<acc>(lse_all),
                                                                 mutable_data_of<acc>(lse_pos), stream),
                 "similarity_xent row statistics");
  };
  if (dots.scalar_type() == at::kDouble) {
    run(TypeTag<double>{});
  } else {
    run(TypeTag<float>{});
  }
  return {lse_all, lse_pos};
}

// The gradient tile of one block; with dims, `running` (R of the next wider prefix, [n_rows, cols] in the tile's
// type) and the ratios row_ratio [rows], col_ratio [cols] fold it in, and keep_running returns this prefix's R in
// the tile's type (the second result; [0] without it). The first result, R rounded to operand_dtype, is [0] when
// keep_running and operand_dtype is the tile's type (the products then take the second). The radial sums are zeros
// without `radial`.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> similarity_xent_dense_grad(
    const at::Tensor& dots, const at::Tensor& row_inv, const at::Tensor& col_inv,
    const std::optional<at::Tensor>& groups, const at::Tensor& lse_all, const at::Tensor& lse_pos,
    const at::Tensor& coef, const std::optional<at::Tensor>& running, const std::optional<at::Tensor>& row_ratio,
    const std::optional<at::Tensor>& col_ratio, int64_t row0, double scale, c10::string_view target,
    bool exclude_diagonal, double margin, bool radial, bool keep_running, c10::string_view operand_dtype) {
  check_tiles(dots, row_inv, col_inv, groups, row0);
  const at::ScalarType acc_dtype = dots.scalar_type();
  const int64_t rows = row_inv.numel(), n_rows = dots.size(0), cols = dots.size(1);
  const auto check_row_state = [&](const at::Tensor& t, const char* name) {
    check_same_device(t, name, dots);
    TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == rows && t.is_contiguous() && t.scalar_type() == acc_dtype,
                      "angle_kernels (cuda): similarity_xent ", name, " must be a contiguous [", rows, "] ",
                      acc_dtype, " tensor");
  };
  check_row_state(lse_all, "lse_all");
  check_row_state(lse_pos, "lse_pos");
  check_row_state(coef, "coef");
  TORCH_CHECK_VALUE(running.has_value() == row_ratio.has_value() && running.has_value() == col_ratio.has_value(),
                    "angle_kernels (cuda): similarity_xent running, row_ratio and col_ratio go together");
  if (running.has_value()) {
    check_same_device(*running, "running", dots);
    TORCH_CHECK_VALUE(running->dim() == 2 && running->size(0) == n_rows && running->size(1) == cols &&
                          running->is_contiguous() && running->scalar_type() == acc_dtype,
                      "angle_kernels (cuda): similarity_xent running must be a contiguous [n_rows, cols] tensor of "
                      "the tile's type");
    check_row_state(*row_ratio, "row_ratio");
    check_same_device(*col_ratio, "col_ratio", dots);
    TORCH_CHECK_VALUE(col_ratio->dim() == 1 && col_ratio->size(0) == cols && col_ratio->is_contiguous() &&
                          col_ratio->scalar_type() == acc_dtype,
                      "angle_kernels (cuda): similarity_xent col_ratio must be a contiguous [cols] tensor of the "
                      "tile's type");
  }
  const int operand = parse_operand(operand_dtype, acc_dtype);
  const c10::cuda::CUDAGuard guard(dots.device());
  const int64_t col_tiles = (cols + angle_kernels::kXentGradCols - 1) / angle_kernels::kXentGradCols;
  const int64_t row_tiles = (n_rows + angle_kernels::kXentGradRows - 1) / angle_kernels::kXentGradRows;
  const bool rounded = !keep_running || operand_type(operand) != acc_dtype;
  at::Tensor grad = at::empty({rounded ? n_rows : 0, cols}, dots.options().dtype(operand_type(operand)));
  at::Tensor next = at::empty({keep_running ? n_rows : 0, cols}, dots.options());
  // the per-tile radial partials, reduced below in a fixed order (no atomics: deterministic)
  at::Tensor row_partial = at::empty({radial ? col_tiles : 0, n_rows}, dots.options());
  at::Tensor col_partial = at::empty({radial ? row_tiles : 0, cols}, dots.options());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dots.device().index()).stream();
  const auto run = [&](auto tag) {
    using acc = typename decltype(tag)::type;
    const auto tiles = make_tiles<acc>(dots, row_inv, col_inv, groups, row0, scale, target, exclude_diagonal, margin);
    angle_kernels::XentRunning<acc> sums{};
    if (running.has_value()) {
      sums.previous = data_of<acc>(*running);
      sums.row_ratio = data_of<acc>(*row_ratio);
      sums.col_ratio = data_of<acc>(*col_ratio);
    }
    sums.next = keep_running ? mutable_data_of<acc>(next) : nullptr;
    sums.ld = cols;
    check_launch(angle_kernels::similarity_xent_dense_grad<acc>(
                     tiles, data_of<acc>(lse_all), data_of<acc>(lse_pos), data_of<acc>(coef), sums, radial, operand,
                     rounded ? grad.mutable_data_ptr() : nullptr, cols,
                     radial ? mutable_data_of<acc>(row_partial) : nullptr,
                     radial ? mutable_data_of<acc>(col_partial) : nullptr, stream),
                 "similarity_xent gradient tile");
  };
  if (acc_dtype == at::kDouble) {
    run(TypeTag<double>{});
  } else {
    run(TypeTag<float>{});
  }
  if (!radial) return {grad, next, at::zeros({n_rows}, dots.options()), at::zeros({cols}, dots.options())};
  return {grad, next, row_partial.sum(0), col_partial.sum(0)};
}

}  // namespace

TORCH_LIBRARY_IMPL(angle_kernels, CUDA, m) {
  m.impl("cuda_similarity_xent_dense_stats", &similarity_xent_dense_stats);
  m.impl("cuda_similarity_xent_dense_grad", &similarity_xent_dense_grad);
}

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
// The gradient tile (with dims, the running sum over the prefixes: DenseRunning) rounded to `operand`
// (DenseOperand) into grad [n_rows, cols] (rows ld_grad apart; null when the products take running.next), and with
// `radial` the partial radial sums row_partial [column tiles, n_rows] and col_partial [row tiles, cols]
// (kXentGradCols, kXentGradRows). lse_all, lse_pos, coef: [rows], by global row.
template <typename acc>
cudaError_t similarity_xent_dense_grad(const XentTiles<acc>& tiles, const acc* lse_all, const acc* lse_pos,
                                       const acc* coef, const DenseRunning<acc>& running, bool radial, int operand,
                                       void* grad, int64_t ld_grad, acc* row_partial, acc* col_partial,
                                       cudaStream_t stream);

}  // namespace angle_kernels

// ---- the binding ---------------------------------------------------------------------------------------------
#include "binding.h"
#include "dense_binding.h"

#include <ATen/ops/empty.h>

#include <cmath>
#include <optional>
#include <string>
#include <tuple>

namespace {

using namespace angle_kernels::binding;
using namespace angle_kernels::dense_binding;

bool parse_partner(c10::string_view target) {
  TORCH_CHECK_VALUE(target == "partner" || target == "diagonal",
                    "angle_kernels (cuda): similarity_xent target must be 'partner' or 'diagonal', got '",
                    std::string(target), "'");
  return target == "partner";
}

// Checks what the kernels index: the tile [n_rows, cols] with unit column stride, row_inv [rows] with
// row0 + n_rows <= rows, col_inv [cols], groups [rows] int64 (columns are rows then: cols == rows), all contiguous,
// on the tile's device, in the tile's type.
void check_tiles(const at::Tensor& dots, const at::Tensor& row_inv, const at::Tensor& col_inv,
                 const std::optional<at::Tensor>& groups, int64_t row0) {
  const int64_t rows = row_inv.numel();
  check_dots(dots, row0, rows, "similarity_xent");
  const int64_t cols = dots.size(1);
  const at::ScalarType acc_dtype = dots.scalar_type();
  const auto vector = [&](const at::Tensor& t, int64_t n, at::ScalarType type, const char* name) {
    check_vector(t, n, type, name, dots, "similarity_xent");
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
  dispatch_tile_type(dots.scalar_type(), run);
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
  const int64_t rows = row_inv.numel();
  check_row_state(lse_all, "lse_all", dots, rows, "similarity_xent");
  check_row_state(lse_pos, "lse_pos", dots, rows, "similarity_xent");
  check_row_state(coef, "coef", dots, rows, "similarity_xent");
  check_running(dots, rows, running, row_ratio, col_ratio, "similarity_xent");
  const int operand = parse_operand(operand_dtype, acc_dtype, "similarity_xent");
  const auto launch = [&](auto tag, const auto& sums, void* grad, auto* row_partial, auto* col_partial,
                          cudaStream_t stream) {
    using acc = typename decltype(tag)::type;
    const auto tiles = make_tiles<acc>(dots, row_inv, col_inv, groups, row0, scale, target, exclude_diagonal, margin);
    check_launch(angle_kernels::similarity_xent_dense_grad<acc>(tiles, data_of<acc>(lse_all), data_of<acc>(lse_pos),
                                                                data_of<acc>(coef), sums, radial, operand, grad,
                                                                dots.size(1), row_partial, col_partial, stream),
                 "similarity_xent gradient tile");
  };
  return run_grad(dots, operand, radial, keep_running, angle_kernels::kXentGradRows, angle_kernels::kXentGradCols,
                  running, row_ratio, col_ratio, launch);
}

}  // namespace

TORCH_LIBRARY_IMPL(angle_kernels, CUDA, m) {
  m.impl("cuda_similarity_xent_dense_stats", &similarity_xent_dense_stats);
  m.impl("cuda_similarity_xent_dense_grad", &similarity_xent_dense_grad);
}

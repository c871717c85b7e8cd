// Torch binding of csrc/similarity_lse.cu: the CUDA kernels of the ops angle_kernels::cuda_similarity_lse_stats
// and cuda_similarity_lse_grad, the tile steps of one row block of the dense scheme (schemas, fake implementations
// and the orchestration with torch products: angle_kernels/cuda_ops/similarity_lse.py). What every binding
// function does: csrc/binding.h.

// ---- the launchers this file calls ---------------------------------------------------------------------------
// Declared here (and only here), defined and explicitly instantiated (float, double) in csrc/similarity_lse.cu;
// their parameter struct LseTiles and the option values are in similarity_lse_types.h, shared by both sides. A
// declaration that differs from its definition fails to link (see csrc/similarity_xent.cpp; tests/
// test_csrc_compile.py checks the symbols without torch). So keep this part torch-free.
#include "similarity_lse_types.h"

namespace angle_kernels {

// Forward: lse, m (the largest kept logit in the anchor row's scale) and log(sum) of the block's rows, [n_rows].
template <typename acc>
cudaError_t similarity_lse_stats(const LseTiles<acc>& tiles, acc* lse, acc* top, acc* log_sum,
                                 cudaStream_t stream);
// Backward: the gradient tile (with dims, the running sum over the prefixes: DenseRunning) rounded to `operand`
// (DenseOperand) into grad [n_rows, cols] (rows ld_grad apart; null when the products take running.next), and with
// `radial` the partial radial sums row_partial [column tiles, n_rows] and col_partial [row tiles, cols]
// (kLseGradCols, kLseGradRows). top, log_sum, coef: [rows], by global row.
template <typename acc>
cudaError_t similarity_lse_grad(const LseTiles<acc>& tiles, const acc* top, const acc* log_sum, const acc* coef,
                                const DenseRunning<acc>& running, bool radial, int operand, void* grad,
                                int64_t ld_grad, acc* row_partial, acc* col_partial, cudaStream_t stream);

}  // namespace angle_kernels

// ---- the binding ---------------------------------------------------------------------------------------------
#include "binding.h"
#include "dense_binding.h"

#include <ATen/ops/empty.h>

#include <optional>
#include <string>
#include <tuple>

namespace {

using namespace angle_kernels::binding;
using namespace angle_kernels::dense_binding;

int parse_exclude(c10::string_view exclude) {
  if (exclude == "none") return angle_kernels::kLseExcludeNone;
  if (exclude == "target") return angle_kernels::kLseExcludeTarget;
  if (exclude == "own") return angle_kernels::kLseExcludeOwn;
  TORCH_CHECK_VALUE(false, "angle_kernels (cuda): similarity_lse exclude must be 'none', 'target' or 'own', got '",
                    std::string(exclude), "'");
  return -1;
}

int parse_penalty_on(c10::string_view penalty_on) {
  if (penalty_on == "none") return angle_kernels::kLsePenaltyNone;
  if (penalty_on == "other") return angle_kernels::kLsePenaltyOther;
  if (penalty_on == "own") return angle_kernels::kLsePenaltyOwn;
  if (penalty_on == "all") return angle_kernels::kLsePenaltyAll;
  TORCH_CHECK_VALUE(false, "angle_kernels (cuda): similarity_lse penalty_on must be 'none', 'other', 'own' or 'all', "
                    "got '", std::string(penalty_on), "'");
  return -1;
}

// The checked tensors of one call, kept alive while the kernels read them.
struct LseInputs {
  at::Tensor dots, row_inv, col_inv, row_unscale, filter_dots, filter_row_inv, filter_col_inv, threshold;
  int filter = angle_kernels::kLseFilterNone;
};

// Checks what the kernels index: the tiles [n_rows, cols] with unit column stride, the per-row vectors [rows] with
// row0 + n_rows <= rows, the per-column ones [cols], all contiguous, on the tile's device, in the tile's type (a
// separate filter's in its own float type).
LseInputs prepare_lse(const at::Tensor& dots, const at::Tensor& row_inv, const at::Tensor& col_inv,
                      const at::Tensor& row_unscale, const std::optional<at::Tensor>& filter_dots,
                      const std::optional<at::Tensor>& filter_row_inv, const std::optional<at::Tensor>& filter_col_inv,
                      const std::optional<at::Tensor>& threshold, int64_t row0) {
  LseInputs in;
  const int64_t rows = row_inv.numel();
  check_dots(dots, row0, rows, "similarity_lse");
  const int64_t n_rows = dots.size(0), cols = dots.size(1);
  const at::ScalarType acc_dtype = dots.scalar_type();
  const auto vector = [&](const at::Tensor& t, int64_t n, at::ScalarType type, const char* name) {
    check_vector(t, n, type, name, dots, "similarity_lse");
    return t;
  };
  in.dots = dots;
  in.row_inv = vector(row_inv, rows, acc_dtype, "row_inv");
  in.col_inv = vector(col_inv, cols, acc_dtype, "col_inv");
  in.row_unscale = vector(row_unscale, rows, acc_dtype, "row_unscale");
  const bool separate = filter_dots.has_value();
  TORCH_CHECK_VALUE(separate == filter_row_inv.has_value() && separate == filter_col_inv.has_value() &&
                        (!separate || threshold.has_value()),
                    "angle_kernels (cuda): similarity_lse filter_dots, filter_row_inv, filter_col_inv go together, "
                    "with a threshold");
  if (separate) {
    check_same_device(*filter_dots, "filter_dots", dots);
    const at::ScalarType filter_dtype = filter_dots->scalar_type();
    TORCH_CHECK_TYPE(filter_dtype == at::kFloat || filter_dtype == at::kDouble,
                     "angle_kernels (cuda): similarity_lse filter_dots must be float32 or float64");
    TORCH_CHECK_VALUE(filter_dots->dim() == 2 && filter_dots->size(0) == n_rows && filter_dots->size(1) == cols &&
                          filter_dots->stride(1) == 1 && filter_dots->stride(0) >= cols,
                      "angle_kernels (cuda): similarity_lse filter_dots must be [n_rows, cols] like dots, with unit "
                      "column stride");
    in.filter_dots = *filter_dots;
    in.filter_row_inv = vector(*filter_row_inv, rows, filter_dtype, "filter_row_inv");
    in.filter_col_inv = vector(*filter_col_inv, cols, filter_dtype, "filter_col_inv");
    in.threshold = vector(*threshold, rows, filter_dtype, "threshold");
    in.filter = angle_kernels::kLseFilterSeparate;
  } else if (threshold.has_value()) {  // a filter on the block's own scores: compared in the tile's type
    in.threshold = vector(*threshold, rows, acc_dtype, "threshold");
    in.filter = angle_kernels::kLseFilterOwnScores;
  }
  return in;
}

template <typename acc>
angle_kernels::LseTiles<acc> make_tiles(const LseInputs& in, int64_t row0, int64_t target_offset, int64_t period,
                                        double scale, double penalty, c10::string_view exclude,
                                        c10::string_view penalty_on, bool filter_keeps_target) {
  TORCH_CHECK_VALUE(target_offset >= 0 && period >= 0,
                    "angle_kernels (cuda): similarity_lse target_offset and period must be >= 0");
  angle_kernels::LseTiles<acc> t;
  t.dots = data_of<acc>(in.dots);
  t.ld_dots = in.dots.stride(0);
  t.row_inv = data_of<acc>(in.row_inv);
  t.col_inv = data_of<acc>(in.col_inv);
  t.row_unscale = data_of<acc>(in.row_unscale);
  t.filter = in.filter;
  t.filter_fp64 = in.filter_dots.defined() && in.filter_dots.scalar_type() == at::kDouble;
  t.filter_keeps_target = filter_keeps_target && in.filter != angle_kernels::kLseFilterNone;
  t.filter_dots = in.filter_dots.defined() ? in.filter_dots.const_data_ptr() : nullptr;
  t.ld_filter = in.filter_dots.defined() ? in.filter_dots.stride(0) : 0;
  t.filter_row_inv = in.filter_row_inv.defined() ? in.filter_row_inv.const_data_ptr() : nullptr;
  t.filter_col_inv = in.filter_col_inv.defined() ? in.filter_col_inv.const_data_ptr() : nullptr;
  t.threshold = in.threshold.defined() ? in.threshold.const_data_ptr() : nullptr;
  t.row0 = row0;
  t.n_rows = in.dots.size(0);
  t.rows = in.row_inv.size(0);
  t.cols = in.dots.size(1);
  t.target_offset = target_offset;
  t.period = period;
  t.scale = scale;
  t.penalty = penalty;
  t.exclude = parse_exclude(exclude);
  t.penalty_on = penalty == 0.0 ? angle_kernels::kLsePenaltyNone : parse_penalty_on(penalty_on);
  return t;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> similarity_lse_stats(
    const at::Tensor& dots, const at::Tensor& row_inv, const at::Tensor& col_inv, const at::Tensor& row_unscale,
    const std::optional<at::Tensor>& filter_dots, const std::optional<at::Tensor>& filter_row_inv,
    const std::optional<at::Tensor>& filter_col_inv, const std::optional<at::Tensor>& threshold, int64_t row0,
    int64_t target_offset, int64_t period, double scale, double penalty, c10::string_view exclude,
    c10::string_view penalty_on, bool filter_keeps_target) {
  const LseInputs in =
      prepare_lse(dots, row_inv, col_inv, row_unscale, filter_dots, filter_row_inv, filter_col_inv, threshold, row0);
  const c10::cuda::CUDAGuard guard(dots.device());
  const int64_t n_rows = dots.size(0);
  at::Tensor lse = at::empty({n_rows}, dots.options());
  at::Tensor top = at::empty({n_rows}, dots.options());
  at::Tensor log_sum = at::empty({n_rows}, dots.options());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dots.device().index()).stream();
  const auto run = [&](auto tag) {
    using acc = typename decltype(tag)::type;
    const auto tiles = make_tiles<acc>(in, row0, target_offset, period, scale, penalty, exclude, penalty_on,
                                       filter_keeps_target);
    check_launch(angle_kernels::similarity_lse_stats<acc>(tiles, mutable_data_of<acc>(lse), mutable_data_of<acc>(top),
                                                          mutable_data_of<acc>(log_sum), stream),
                 "similarity_lse row statistics");
  };
  dispatch_tile_type(dots.scalar_type(), run);
  return {lse, top, log_sum};
}

// The gradient tile of one block; with dims, `running` (H of the next wider prefix, [n_rows, cols] in the tile's
// type) and the ratios row_ratio [rows], col_ratio [cols] fold it in, and keep_running returns this prefix's H in
// the tile's type (the second result; [0] without it). The first result, H rounded to operand_dtype, is [0] when
// keep_running and operand_dtype is the tile's type (the products then take the second).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> similarity_lse_grad(
    const at::Tensor& dots, const at::Tensor& row_inv, const at::Tensor& col_inv, const at::Tensor& row_unscale,
    const std::optional<at::Tensor>& filter_dots, const std::optional<at::Tensor>& filter_row_inv,
    const std::optional<at::Tensor>& filter_col_inv, const std::optional<at::Tensor>& threshold,
    const at::Tensor& top, const at::Tensor& log_sum, const at::Tensor& coef, const std::optional<at::Tensor>& running,
    const std::optional<at::Tensor>& row_ratio, const std::optional<at::Tensor>& col_ratio, int64_t row0,
    int64_t target_offset, int64_t period, double scale, double penalty, c10::string_view exclude,
    c10::string_view penalty_on, bool filter_keeps_target, bool radial, bool keep_running,
    c10::string_view operand_dtype) {
  const LseInputs in =
      prepare_lse(dots, row_inv, col_inv, row_unscale, filter_dots, filter_row_inv, filter_col_inv, threshold, row0);
  const at::ScalarType acc_dtype = dots.scalar_type();
  const int64_t rows = row_inv.numel();
  check_row_state(top, "top", dots, rows, "similarity_lse");
  check_row_state(log_sum, "log_sum", dots, rows, "similarity_lse");
  check_row_state(coef, "coef", dots, rows, "similarity_lse");
  check_running(dots, rows, running, row_ratio, col_ratio, "similarity_lse");
  const int operand = parse_operand(operand_dtype, acc_dtype, "similarity_lse");
  const auto launch = [&](auto tag, const auto& sums, void* grad, auto* row_partial, auto* col_partial,
                          cudaStream_t stream) {
    using acc = typename decltype(tag)::type;
    const auto tiles = make_tiles<acc>(in, row0, target_offset, period, scale, penalty, exclude, penalty_on,
                                       filter_keeps_target);
    check_launch(angle_kernels::similarity_lse_grad<acc>(tiles, data_of<acc>(top), data_of<acc>(log_sum),
                                                         data_of<acc>(coef), sums, radial, operand, grad,
                                                         dots.size(1), row_partial, col_partial, stream),
                 "similarity_lse gradient tile");
  };
  return run_grad(dots, operand, radial, keep_running, angle_kernels::kLseGradRows, angle_kernels::kLseGradCols,
                  running, row_ratio, col_ratio, launch);
}

}  // namespace

TORCH_LIBRARY_IMPL(angle_kernels, CUDA, m) {
  m.impl("cuda_similarity_lse_stats", &similarity_lse_stats);
  m.impl("cuda_similarity_lse_grad", &similarity_lse_grad);
}

// Torch binding of csrc/similarity_xent.cu: the CUDA kernels of the ops angle_kernels::cuda_similarity_xent_fwd
// and cuda_similarity_xent_bwd (schemas, fake implementations and autograd:
// angle_kernels/cuda_ops/similarity_xent.py). What every binding function does: csrc/binding.h.

// ---- the launchers this file calls ---------------------------------------------------------------------------
// Declared here (and only here): defined and explicitly instantiated (float, double, __half, __nv_bfloat16) in
// csrc/similarity_xent.cu, which never sees these declarations; their parameter struct XentProblem and the
// XentTarget values are in launcher_types.h, shared by both sides. What keeps the two in step: C++ mangles the
// parameter types (and, for a template specialization, the return type) into the symbol, so a declaration that
// differs from the definition asks the linker for a symbol the .cu does not define, and the extension fails to
// load with "undefined symbol: <that name>" (scripts/check_cuda_build.sh loads it without a GPU).
// tests/test_csrc_compile.py catches it earlier, with nvcc and no torch: it compiles everything above
// `#include "binding.h"` and checks that the compiled .cu defines every launcher symbol these declarations ask
// for. So keep this part torch-free.
#include "launcher_types.h"

namespace angle_kernels {

// Forward. Writes the row norms and scales (q_norm [2 * rows_q]: the norms of the rows scaled by their powers of
// two, then the scales; c_norm [2 * rows_c] likewise, may equal q_norm when symmetric), the
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

// ---- the binding ---------------------------------------------------------------------------------------------
#include "binding.h"

#include <ATen/Context.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <optional>
#include <string>
#include <tuple>

namespace {

using angle_kernels::acc_t;
using namespace angle_kernels::binding;

int parse_target(c10::string_view target) {
  if (target == "partner") return angle_kernels::kTargetPartner;
  if (target == "diagonal") return angle_kernels::kTargetDiagonal;
  TORCH_CHECK_VALUE(false, "angle_kernels (cuda): similarity_xent target must be 'partner' or 'diagonal', got '",
                    std::string(target), "'");
  return -1;
}

// Validates the inputs and returns the optional tensors in the layout the kernels read.
struct XentInputs {
  at::Tensor q, c;  // c is q when symmetric
  bool symmetric;
  int target;
  at::Tensor row_weights, group_ids;  // undefined when absent
};

XentInputs prepare_xent(const at::Tensor& q, const std::optional<at::Tensor>& c, c10::string_view target,
                        const std::optional<at::Tensor>& row_weights, bool exclude_diagonal, double margin,
                        const std::optional<at::Tensor>& group_ids) {
  XentInputs in;
  check_cuda_tensor(q, "q");
  TORCH_CHECK_VALUE(q.dim() == 2 && q.size(0) >= 1 && q.size(1) >= 1,
                    "angle_kernels (cuda): similarity_xent q must be [M >= 1, D >= 1], got shape ", q.sizes());
  in.q = q;
  in.symmetric = !c.has_value();
  in.c = in.symmetric ? q : *c;
  if (!in.symmetric) {
    check_cuda_tensor(in.c, "c");
    TORCH_CHECK_VALUE(in.c.dim() == 2 && in.c.size(1) == q.size(1) && in.c.size(0) >= 1,
                      "angle_kernels (cuda): similarity_xent c must be [Mc >= 1, D] with q's D, got shape ",
                      in.c.sizes());
    TORCH_CHECK_TYPE(in.c.scalar_type() == q.scalar_type(), "angle_kernels (cuda): similarity_xent c must have q's dtype");
    TORCH_CHECK_VALUE(in.c.device() == q.device(), "angle_kernels (cuda): similarity_xent c must be on q's device");
  }
  in.target = parse_target(target);
  const int64_t rows = q.size(0), cols = in.c.size(0);
  // The largest target index: partner -> (M - 1) xor 1, diagonal -> M - 1.
  const int64_t last_target = in.target == angle_kernels::kTargetPartner ? ((rows - 1) ^ 1) : rows - 1;
  TORCH_CHECK_VALUE(last_target < cols, "angle_kernels (cuda): similarity_xent target '", std::string(target),
                    "' needs column ", last_target, " but c has ", cols, " rows");
  TORCH_CHECK_VALUE(!(exclude_diagonal && in.target == angle_kernels::kTargetDiagonal),
                    "angle_kernels (cuda): similarity_xent cannot exclude the diagonal when it is the target");
  TORCH_CHECK_VALUE(margin >= 0.0 && margin <= 3.141592653589793, "angle_kernels (cuda): similarity_xent margin must be in [0, pi] radians, got ", margin);
  const at::ScalarType acc_dtype = compute_dtype(q.scalar_type());
  if (row_weights.has_value()) {
    TORCH_CHECK_VALUE(row_weights->dim() == 1 && row_weights->size(0) == rows,
                      "angle_kernels (cuda): similarity_xent row_weights must be [M]");
    in.row_weights = row_weights->to(q.device(), acc_dtype).contiguous();
  }
  if (group_ids.has_value()) {
    TORCH_CHECK_VALUE(in.symmetric, "angle_kernels (cuda): similarity_xent group_ids needs c=None");
    TORCH_CHECK_VALUE(group_ids->dim() == 1 && group_ids->size(0) == rows,
                      "angle_kernels (cuda): similarity_xent group_ids must be [M]");
    in.group_ids = group_ids->to(q.device(), at::kLong).contiguous();
  }
  return in;
}

template <typename scalar_t>
angle_kernels::XentProblem<scalar_t> make_problem(const XentInputs& in, double scale, bool exclude_diagonal,
                                                  double margin) {
  angle_kernels::XentProblem<scalar_t> p;
  p.q = data_of<scalar_t>(in.q);
  p.rows_q = in.q.size(0);
  p.q_stride_row = in.q.stride(0);
  p.q_stride_dim = in.q.stride(1);
  p.c = data_of<scalar_t>(in.c);
  p.rows_c = in.c.size(0);
  p.c_stride_row = in.c.stride(0);
  p.c_stride_dim = in.c.stride(1);
  p.dim = in.q.size(1);
  p.symmetric = in.symmetric;
  p.scale = scale;
  p.target = in.target;
  p.exclude_diagonal = exclude_diagonal;
  p.margin = margin;
  p.group_ids = in.group_ids.defined() ? data_of<int64_t>(in.group_ids) : nullptr;
  p.row_weights = in.row_weights.defined() ? data_of<acc_t<scalar_t>>(in.row_weights) : nullptr;
  return p;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> similarity_xent_fwd(
    const at::Tensor& q, const std::optional<at::Tensor>& c, double scale, c10::string_view target,
    const std::optional<at::Tensor>& row_weights, bool exclude_diagonal, double margin,
    const std::optional<at::Tensor>& group_ids) {
  const XentInputs in = prepare_xent(q, c, target, row_weights, exclude_diagonal, margin, group_ids);
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t rows = q.size(0), cols = in.c.size(0);
  const auto opts = q.options().dtype(compute_dtype(q.scalar_type()));
  // [the scaled rows' norms | the rows' scales] (csrc/similarity_xent.cu, huge rows)
  at::Tensor q_norm = at::empty({2 * rows}, opts);
  at::Tensor c_norm = at::empty({in.symmetric ? 0 : 2 * cols}, opts);  // the symmetric case reuses q_norm
  at::Tensor lse_all = at::empty({rows}, opts);
  at::Tensor lse_pos = at::empty({rows}, opts);
  at::Tensor row_loss = at::empty({rows}, opts);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  dispatch_float_types(q.scalar_type(), "q", [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    using acc = acc_t<scalar_t>;
    const auto problem = make_problem<scalar_t>(in, scale, exclude_diagonal, margin);
    check_launch(angle_kernels::similarity_xent_fwd<scalar_t>(
                     problem, mutable_data_of<acc>(q_norm), in.symmetric ? nullptr : mutable_data_of<acc>(c_norm),
                     mutable_data_of<acc>(lse_all), mutable_data_of<acc>(lse_pos), mutable_data_of<acc>(row_loss),
                     stream),
                 "similarity_xent forward");
  });
  at::Tensor loss = row_loss.sum() / static_cast<double>(rows);
  return {loss, lse_all, lse_pos, q_norm, c_norm};
}

std::tuple<at::Tensor, at::Tensor> similarity_xent_bwd(const at::Tensor& grad_loss, const at::Tensor& q,
                                                       const std::optional<at::Tensor>& c, const at::Tensor& lse_all,
                                                       const at::Tensor& lse_pos, const at::Tensor& q_norm,
                                                       const at::Tensor& c_norm, double scale,
                                                       c10::string_view target,
                                                       const std::optional<at::Tensor>& row_weights,
                                                       bool exclude_diagonal, double margin,
                                                       const std::optional<at::Tensor>& group_ids) {
  const XentInputs in = prepare_xent(q, c, target, row_weights, exclude_diagonal, margin, group_ids);
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t rows = q.size(0), cols = in.c.size(0), dim = q.size(1);
  const at::ScalarType acc_dtype = compute_dtype(q.scalar_type());
  const auto check_saved = [&](const at::Tensor& t, int64_t n, const char* name) {
    TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == n && t.scalar_type() == acc_dtype && t.is_contiguous(),
                      "angle_kernels (cuda): similarity_xent saved ", name, " does not match the inputs");
    check_same_device(t, name, q);
  };
  check_scalar_grad(grad_loss, q);
  // float atomics add the tiles' contributions in whatever order the blocks run: not bit-reproducible
  at::globalContext().alertNotDeterministic("angle_kernels::cuda_similarity_xent_bwd");
  check_saved(lse_all, rows, "lse_all");
  check_saved(lse_pos, rows, "lse_pos");
  check_saved(q_norm, 2 * rows, "q_norm");
  if (!in.symmetric) check_saved(c_norm, 2 * cols, "c_norm");
  const auto acc_opts = q.options().dtype(acc_dtype);
  const at::Tensor g = grad_loss.to(acc_dtype).contiguous();
  at::Tensor dq_acc = at::zeros({rows, dim}, acc_opts);
  at::Tensor q_coef = at::zeros({rows}, acc_opts);
  at::Tensor dc_acc = in.symmetric ? dq_acc : at::zeros({cols, dim}, acc_opts);
  at::Tensor c_coef = in.symmetric ? q_coef : at::zeros({cols}, acc_opts);
  at::Tensor dq = at::empty({rows, dim}, q.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor dc = in.symmetric ? at::empty({0}, q.options())
                               : at::empty({cols, dim}, in.c.options().memory_format(at::MemoryFormat::Contiguous));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  dispatch_float_types(q.scalar_type(), "q", [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    using acc = acc_t<scalar_t>;
    const auto problem = make_problem<scalar_t>(in, scale, exclude_diagonal, margin);
    check_launch(angle_kernels::similarity_xent_bwd<scalar_t>(
                     problem, data_of<acc>(g), data_of<acc>(q_norm), in.symmetric ? nullptr : data_of<acc>(c_norm),
                     data_of<acc>(lse_all), data_of<acc>(lse_pos), mutable_data_of<acc>(dq_acc),
                     mutable_data_of<acc>(dc_acc), mutable_data_of<acc>(q_coef), mutable_data_of<acc>(c_coef),
                     mutable_data_of<scalar_t>(dq), in.symmetric ? nullptr : mutable_data_of<scalar_t>(dc), stream),
                 "similarity_xent backward");
  });
  return {dq, dc};
}

}  // namespace

TORCH_LIBRARY_IMPL(angle_kernels, CUDA, m) {
  m.impl("cuda_similarity_xent_fwd", &similarity_xent_fwd);
  m.impl("cuda_similarity_xent_bwd", &similarity_xent_bwd);
}

// Torch binding of the CUDA launchers: the CUDA implementations of the angle_kernels::cuda_* ops.
//
// The op schemas are defined in Python (angle_kernels/cuda_ops/<op>.py, through _library) so that they, their fake
// implementations and their autograd formulas exist on machines without CUDA too. This file only
// registers CUDA kernels for them (TORCH_LIBRARY_IMPL), so it is built only where CUDA torch exists.
//
// Each function: checks what the kernels rely on (device, dtype, shape, sizes), allocates outputs and
// scratch with torch's allocator on the inputs' device, launches on the current stream, and turns a
// launcher's error into a RuntimeError naming the op.

#include <torch/extension.h>
#include <torch/library.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <optional>
#include <string>
#include <tuple>

#include "launchers.h"

namespace {

using angle_kernels::acc_t;

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls fn(TypeTag<scalar_t>{}) with the CUDA element type matching `dtype`.
template <typename Fn>
void dispatch_float_types(at::ScalarType dtype, const char* arg, Fn&& fn) {
  switch (dtype) {
    case at::kFloat:
      fn(TypeTag<float>{});
      break;
    case at::kDouble:
      fn(TypeTag<double>{});
      break;
    case at::kHalf:
      fn(TypeTag<__half>{});
      break;
    case at::kBFloat16:
      fn(TypeTag<__nv_bfloat16>{});
      break;
    default:
      TORCH_CHECK_TYPE(false, "angle_kernels (cuda): ", arg, " must be float32, float64, float16 or bfloat16, got ",
                       dtype);
  }
}

at::ScalarType compute_dtype(at::ScalarType input) { return input == at::kDouble ? at::kDouble : at::kFloat; }

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "angle_kernels (cuda): ", op, " failed: ", cudaGetErrorString(err));
}

void check_cuda_tensor(const at::Tensor& t, const char* arg) {
  TORCH_CHECK_VALUE(t.is_cuda(), "angle_kernels (cuda): ", arg, " must be a CUDA tensor, got device ", t.device());
}

template <typename scalar_t>
const scalar_t* data_of(const at::Tensor& t) {
  return reinterpret_cast<const scalar_t*>(t.const_data_ptr());
}
template <typename scalar_t>
scalar_t* mutable_data_of(at::Tensor& t) {
  return reinterpret_cast<scalar_t*>(t.mutable_data_ptr());
}

// ---------------------------------------------------------------------------------------------------------
// pair_scores
// ---------------------------------------------------------------------------------------------------------
std::tuple<at::Tensor, at::Tensor, at::Tensor> pair_scores_fwd(const at::Tensor& x, bool with_angle) {
  check_cuda_tensor(x, "x");
  TORCH_CHECK_VALUE(x.dim() == 3, "angle_kernels (cuda): pair_scores x must be [G, K, D], got shape ", x.sizes());
  const int64_t groups = x.size(0), group_size = x.size(1), dim = x.size(2);
  TORCH_CHECK_VALUE(group_size >= 2, "angle_kernels (cuda): pair_scores x needs K >= 2 rows per group, got ", group_size);
  TORCH_CHECK_VALUE(dim >= 1, "angle_kernels (cuda): pair_scores x needs D >= 1");
  TORCH_CHECK_VALUE(!with_angle || dim % 2 == 0, "angle_kernels (cuda): the angle score needs an even D, got ", dim);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto opts = x.options().dtype(compute_dtype(x.scalar_type()));
  at::Tensor cos = at::empty({groups, group_size - 1}, opts);
  at::Tensor angle = at::empty({groups, group_size - 1}, opts);
  at::Tensor stats = at::empty({groups, group_size - 1, 4}, opts);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  dispatch_float_types(x.scalar_type(), "x", [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    using acc = acc_t<scalar_t>;
    check_launch(angle_kernels::pair_scores_fwd<scalar_t>(
                     data_of<scalar_t>(x), groups, group_size, dim, x.stride(0), x.stride(1), x.stride(2), with_angle,
                     mutable_data_of<acc>(cos), mutable_data_of<acc>(angle), mutable_data_of<acc>(stats), stream),
                 "pair_scores forward");
  });
  return {cos, angle, stats};
}

at::Tensor pair_scores_bwd(const at::Tensor& grad_cos, const at::Tensor& grad_angle, const at::Tensor& x,
                           const at::Tensor& stats, bool with_angle) {
  check_cuda_tensor(x, "x");
  TORCH_CHECK_VALUE(x.dim() == 3 && x.size(1) >= 2, "angle_kernels (cuda): pair_scores x must be [G, K>=2, D]");
  const int64_t groups = x.size(0), group_size = x.size(1), dim = x.size(2);
  TORCH_CHECK_VALUE(!with_angle || dim % 2 == 0, "angle_kernels (cuda): the angle score needs an even D, got ", dim);
  const at::ScalarType acc_dtype = compute_dtype(x.scalar_type());
  const std::vector<int64_t> pair_shape{groups, group_size - 1};
  TORCH_CHECK_VALUE(grad_cos.sizes() == at::IntArrayRef(pair_shape) && grad_angle.sizes() == at::IntArrayRef(pair_shape),
                    "angle_kernels (cuda): pair_scores gradients must be [G, K-1]");
  TORCH_CHECK_VALUE(stats.sizes() == at::IntArrayRef({groups, group_size - 1, 4}) && stats.scalar_type() == acc_dtype,
                    "angle_kernels (cuda): pair_scores saved stats do not match x");
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor gc = grad_cos.to(acc_dtype).contiguous();
  const at::Tensor ga = grad_angle.to(acc_dtype).contiguous();
  const at::Tensor st = stats.contiguous();
  at::Tensor dx = at::empty({groups, group_size, dim}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  dispatch_float_types(x.scalar_type(), "x", [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    using acc = acc_t<scalar_t>;
    const int64_t max_group = angle_kernels::pair_scores_bwd_max_group_size<scalar_t>();
    TORCH_CHECK_VALUE(group_size <= max_group, "angle_kernels (cuda): pair_scores backward supports K <= ", max_group,
                      " rows per group, got ", group_size, "; use backend='torch' or 'triton'");
    check_launch(angle_kernels::pair_scores_bwd<scalar_t>(data_of<acc>(gc), data_of<acc>(ga), data_of<scalar_t>(x),
                                                          data_of<acc>(st), groups, group_size, dim, x.stride(0),
                                                          x.stride(1), x.stride(2), with_angle,
                                                          mutable_data_of<scalar_t>(dx), stream),
                 "pair_scores backward");
  });
  return dx;
}

// ---------------------------------------------------------------------------------------------------------
// ranking_loss: the sort and the tie groups with torch, the scans in the kernels (see csrc/ranking.cu).
// ---------------------------------------------------------------------------------------------------------
void check_ranking_scores(const at::Tensor& scores) {
  check_cuda_tensor(scores, "scores");
  TORCH_CHECK_VALUE(scores.dim() == 1, "angle_kernels (cuda): ranking_loss scores must be 1-D, got shape ",
                    scores.sizes());
  TORCH_CHECK_TYPE(scores.scalar_type() == at::kFloat || scores.scalar_type() == at::kDouble,
                   "angle_kernels (cuda): ranking_loss scores must be float32 or float64, got ", scores.scalar_type());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> ranking_fwd(const at::Tensor& scores,
                                                                       const at::Tensor& labels) {
  check_ranking_scores(scores);
  check_cuda_tensor(labels, "labels");
  TORCH_CHECK_VALUE(labels.dim() == 1 && labels.size(0) == scores.size(0),
                    "angle_kernels (cuda): ranking_loss labels must be [N] like scores, got ", labels.sizes());
  TORCH_CHECK_TYPE(labels.scalar_type() != at::kBool && !at::isComplexType(labels.scalar_type()),
                   "angle_kernels (cuda): ranking_loss labels must be real numbers, got ", labels.scalar_type());
  const c10::cuda::CUDAGuard guard(scores.device());
  const int64_t n = scores.size(0);
  const auto [sorted_labels, order] = at::sort(labels.contiguous());
  // [group_first[p], group_past[p]): the sorted positions whose label equals sorted_labels[p].
  at::Tensor group_first = at::searchsorted(sorted_labels, sorted_labels, /*out_int32=*/false, /*right=*/false);
  at::Tensor group_past = at::searchsorted(sorted_labels, sorted_labels, /*out_int32=*/false, /*right=*/true);
  at::Tensor prefix = at::empty({n}, scores.options().dtype(at::kDouble));
  at::Tensor loss = at::empty({}, scores.options());
  const at::Tensor order_c = order.contiguous();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(scores.device().index()).stream();
  dispatch_float_types(scores.scalar_type(), "scores", [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double>) {
      check_launch(angle_kernels::ranking_fwd<scalar_t>(data_of<scalar_t>(scores), scores.stride(0),
                                                        data_of<int64_t>(order_c), data_of<int64_t>(group_first), n,
                                                        mutable_data_of<double>(prefix), mutable_data_of<scalar_t>(loss),
                                                        stream),
                   "ranking_loss forward");
    }
  });
  return {loss, order_c, group_first, group_past};
}

at::Tensor ranking_bwd(const at::Tensor& grad_loss, const at::Tensor& scores, const at::Tensor& order,
                       const at::Tensor& group_first, const at::Tensor& group_past) {
  check_ranking_scores(scores);
  const int64_t n = scores.size(0);
  TORCH_CHECK_VALUE(order.numel() == n && group_first.numel() == n && group_past.numel() == n &&
                        order.scalar_type() == at::kLong && group_first.scalar_type() == at::kLong &&
                        group_past.scalar_type() == at::kLong,
                    "angle_kernels (cuda): ranking_loss saved sort does not match scores");
  const c10::cuda::CUDAGuard guard(scores.device());
  const at::Tensor g = grad_loss.to(scores.scalar_type()).contiguous();
  const at::Tensor order_c = order.contiguous(), first_c = group_first.contiguous(), past_c = group_past.contiguous();
  at::Tensor prefix = at::empty({n}, scores.options().dtype(at::kDouble));
  at::Tensor suffix = at::empty({n}, scores.options().dtype(at::kDouble));
  at::Tensor grad = at::empty({n}, scores.options().memory_format(at::MemoryFormat::Contiguous));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(scores.device().index()).stream();
  dispatch_float_types(scores.scalar_type(), "scores", [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double>) {
      check_launch(angle_kernels::ranking_bwd<scalar_t>(
                       data_of<scalar_t>(g), data_of<scalar_t>(scores), scores.stride(0), data_of<int64_t>(order_c),
                       data_of<int64_t>(first_c), data_of<int64_t>(past_c), n, mutable_data_of<double>(prefix),
                       mutable_data_of<double>(suffix), mutable_data_of<scalar_t>(grad), stream),
                   "ranking_loss backward");
    }
  });
  return grad;
}

// ---------------------------------------------------------------------------------------------------------
// similarity_xent
// ---------------------------------------------------------------------------------------------------------
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
  at::Tensor q_norm = at::empty({rows}, opts);
  at::Tensor c_norm = at::empty({in.symmetric ? 0 : cols}, opts);  // the symmetric case reuses q_norm
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
  };
  check_saved(lse_all, rows, "lse_all");
  check_saved(lse_pos, rows, "lse_pos");
  check_saved(q_norm, rows, "q_norm");
  if (!in.symmetric) check_saved(c_norm, cols, "c_norm");
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
  m.impl("cuda_pair_scores_fwd", &pair_scores_fwd);
  m.impl("cuda_pair_scores_bwd", &pair_scores_bwd);
  m.impl("cuda_ranking_fwd", &ranking_fwd);
  m.impl("cuda_ranking_bwd", &ranking_bwd);
  m.impl("cuda_similarity_xent_fwd", &similarity_xent_fwd);
  m.impl("cuda_similarity_xent_bwd", &similarity_xent_bwd);
}

// Importing the module (angle_kernels._C, or the JIT-built library) runs the registration above.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "CUDA kernels of angle_kernels; the ops are torch.ops.angle_kernels.cuda_*";
}

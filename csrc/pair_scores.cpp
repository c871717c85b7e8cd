// Torch binding of csrc/pair_scores.cu: the CUDA kernels of the ops angle_kernels::cuda_pair_scores_fwd,
// cuda_pair_scores_bwd and their nested-prefix (dims) versions cuda_pair_scores_dims_fwd and cuda_pair_scores_dims_bwd
// (schemas, fake implementations and autograd: angle_kernels/cuda_ops/pair_scores.py).
// What every binding function does: csrc/binding.h.

// ---- the launchers this file calls ---------------------------------------------------------------------------
// Declared here (and only here): defined and explicitly instantiated (float, double, __half, __nv_bfloat16) in
// csrc/pair_scores.cu, which never sees these declarations. What keeps the two in step: C++ mangles the parameter
// types (and, for a template specialization, the return type) into the symbol, so a declaration that differs
// from the definition asks the linker for a symbol the .cu does not define, and the extension fails to load with
// "undefined symbol: <that name>" (scripts/check_cuda_build.sh loads it without a GPU). tests/test_csrc_compile.py
// catches it earlier, with nvcc and no torch: it compiles everything above `#include "binding.h"` and checks that
// the compiled .cu defines every launcher symbol these declarations ask for. So keep this part torch-free.
#include "launcher_types.h"

namespace angle_kernels {

// x: [G, K, D] with strides (stride_g, stride_k, stride_d). Outputs cos, angle: [G*(K-1)]; stats: [G*(K-1), 6]
// (the scaled rows' norms, cos, w and the rows' scales: csrc/pair_scores.cu).
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
// Nested prefixes: dims is a host array of num_dims ascending widths (at most 32, each <= D, even with the angle).
// Outputs cos, angle: [k*G*(K-1)]; stats: [k*G*(K-1), 6], prefix i's block at i*G*(K-1).
template <typename scalar_t>
cudaError_t pair_scores_dims_fwd(const scalar_t* x, int64_t num_groups, int64_t group_size, int64_t dim,
                                 int64_t stride_g, int64_t stride_k, int64_t stride_d, const int64_t* dims,
                                 int64_t num_dims, bool with_angle, acc_t<scalar_t>* cos_out,
                                 acc_t<scalar_t>* angle_out, acc_t<scalar_t>* stats_out, cudaStream_t stream);
// grad_cos, grad_angle: contiguous [k*G*(K-1)]; dx: contiguous [G, K, D] (fully overwritten: 0 past d_k).
template <typename scalar_t>
cudaError_t pair_scores_dims_bwd(const acc_t<scalar_t>* grad_cos, const acc_t<scalar_t>* grad_angle,
                                 const scalar_t* x, const acc_t<scalar_t>* stats, int64_t num_groups,
                                 int64_t group_size, int64_t dim, int64_t stride_g, int64_t stride_k,
                                 int64_t stride_d, const int64_t* dims, int64_t num_dims, bool with_angle,
                                 scalar_t* dx, cudaStream_t stream);
template <typename scalar_t>
int64_t pair_scores_dims_bwd_max_group_size(int64_t num_dims);

}  // namespace angle_kernels

// ---- the binding ---------------------------------------------------------------------------------------------
#include "binding.h"

#include <ATen/ops/empty.h>

#include <tuple>
#include <vector>

namespace {

using angle_kernels::acc_t;
using namespace angle_kernels::binding;

constexpr int64_t kPairStats = 6;  // saved per pair: csrc/pair_scores.cu's kPairStats, cuda_ops/pair_scores.PAIR_STATS

// x [G, K, D] on a CUDA device, K >= 2 and D >= 1, checked (every entry point's first check; the ops are public).
void check_groups(const at::Tensor& x) {
  check_cuda_tensor(x, "x");
  TORCH_CHECK_VALUE(x.dim() == 3, "angle_kernels (cuda): pair_scores x must be [G, K, D], got shape ", x.sizes());
  TORCH_CHECK_VALUE(x.size(1) >= 2, "angle_kernels (cuda): pair_scores x needs K >= 2 rows per group, got ", x.size(1));
  TORCH_CHECK_VALUE(x.size(2) >= 1, "angle_kernels (cuda): pair_scores x needs D >= 1");
}

// The backward's inputs, checked against x (the gradients [leading..., G, K-1], the forward's saved stats) and in the
// launchers' layout, with dx allocated; under the caller's device guard.
struct GradInputs {
  at::Tensor grad_cos, grad_angle, stats, dx;
  cudaStream_t stream;
};

GradInputs grad_inputs(const at::Tensor& grad_cos, const at::Tensor& grad_angle, const at::Tensor& x,
                       const at::Tensor& stats, std::vector<int64_t> pair_shape, const char* shape_name) {
  const at::ScalarType acc_dtype = compute_dtype(x.scalar_type());
  pair_shape.push_back(x.size(0));
  pair_shape.push_back(x.size(1) - 1);
  TORCH_CHECK_VALUE(
      grad_cos.sizes() == at::IntArrayRef(pair_shape) && grad_angle.sizes() == at::IntArrayRef(pair_shape),
      "angle_kernels (cuda): pair_scores gradients must be ", shape_name);
  std::vector<int64_t> stats_shape = pair_shape;
  stats_shape.push_back(kPairStats);
  TORCH_CHECK_VALUE(stats.sizes() == at::IntArrayRef(stats_shape) && stats.scalar_type() == acc_dtype,
                    "angle_kernels (cuda): pair_scores saved stats do not match x");
  check_same_device(grad_cos, "grad_cos", x);
  check_same_device(grad_angle, "grad_angle", x);
  check_same_device(stats, "stats", x);
  return {grad_cos.to(acc_dtype).contiguous(), grad_angle.to(acc_dtype).contiguous(), stats.contiguous(),
          at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous)),
          c10::cuda::getCurrentCUDAStream(x.device().index()).stream()};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> pair_scores_fwd(const at::Tensor& x, bool with_angle) {
  check_groups(x);
  const int64_t groups = x.size(0), group_size = x.size(1), dim = x.size(2);
  TORCH_CHECK_VALUE(!with_angle || dim % 2 == 0, "angle_kernels (cuda): the angle score needs an even D, got ", dim);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto opts = x.options().dtype(compute_dtype(x.scalar_type()));
  at::Tensor cos = at::empty({groups, group_size - 1}, opts);
  at::Tensor angle = at::empty({groups, group_size - 1}, opts);
  at::Tensor stats = at::empty({groups, group_size - 1, kPairStats}, opts);
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
  check_groups(x);
  const int64_t groups = x.size(0), group_size = x.size(1), dim = x.size(2);
  TORCH_CHECK_VALUE(!with_angle || dim % 2 == 0, "angle_kernels (cuda): the angle score needs an even D, got ", dim);
  const c10::cuda::CUDAGuard guard(x.device());
  GradInputs in = grad_inputs(grad_cos, grad_angle, x, stats, {}, "[G, K-1]");
  dispatch_float_types(x.scalar_type(), "x", [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    using acc = acc_t<scalar_t>;
    const int64_t max_group = angle_kernels::pair_scores_bwd_max_group_size<scalar_t>();
    TORCH_CHECK_VALUE(group_size <= max_group, "angle_kernels (cuda): pair_scores backward supports K <= ", max_group,
                      " rows per group, got ", group_size, "; use backend='torch' or 'triton'");
    check_launch(angle_kernels::pair_scores_bwd<scalar_t>(data_of<acc>(in.grad_cos), data_of<acc>(in.grad_angle),
                                                          data_of<scalar_t>(x), data_of<acc>(in.stats), groups,
                                                          group_size, dim, x.stride(0), x.stride(1), x.stride(2),
                                                          with_angle, mutable_data_of<scalar_t>(in.dx), in.stream),
                 "pair_scores backward");
  });
  return in.dx;
}

constexpr int64_t kMaxPrefixes = 32;  // csrc/pair_scores.cu's kMaxPrefixes, cuda_ops/pair_scores.MAX_PREFIXES

// The prefix widths as the launchers take them, checked as the contract checks them (the ops are public).
void check_dims(const std::vector<int64_t>& dims, int64_t dim, bool with_angle) {
  TORCH_CHECK_VALUE(!dims.empty() && static_cast<int64_t>(dims.size()) <= kMaxPrefixes,
                    "angle_kernels (cuda): pair_scores takes 1 to ", kMaxPrefixes, " prefix widths per call, got ",
                    dims.size());
  for (size_t i = 0; i < dims.size(); ++i) {
    TORCH_CHECK_VALUE(dims[i] >= 1 && dims[i] <= dim && (i == 0 || dims[i] > dims[i - 1]),
                      "angle_kernels (cuda): pair_scores dims must be strictly increasing widths in 1..", dim);
    TORCH_CHECK_VALUE(!with_angle || dims[i] % 2 == 0,
                      "angle_kernels (cuda): the angle score needs even prefix widths, got ", dims[i]);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> pair_scores_dims_fwd(const at::Tensor& x, bool with_angle,
                                                                    at::IntArrayRef dims) {
  const std::vector<int64_t> widths = dims.vec();
  check_groups(x);
  const int64_t groups = x.size(0), group_size = x.size(1), dim = x.size(2);
  check_dims(widths, dim, with_angle);
  const int64_t num_dims = static_cast<int64_t>(widths.size());
  const c10::cuda::CUDAGuard guard(x.device());
  const auto opts = x.options().dtype(compute_dtype(x.scalar_type()));
  at::Tensor cos = at::empty({num_dims, groups, group_size - 1}, opts);
  at::Tensor angle = at::empty({num_dims, groups, group_size - 1}, opts);
  at::Tensor stats = at::empty({num_dims, groups, group_size - 1, kPairStats}, opts);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  dispatch_float_types(x.scalar_type(), "x", [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    using acc = acc_t<scalar_t>;
    check_launch(angle_kernels::pair_scores_dims_fwd<scalar_t>(
                     data_of<scalar_t>(x), groups, group_size, dim, x.stride(0), x.stride(1), x.stride(2),
                     widths.data(), num_dims, with_angle, mutable_data_of<acc>(cos), mutable_data_of<acc>(angle),
                     mutable_data_of<acc>(stats), stream),
                 "pair_scores forward (dims)");
  });
  return {cos, angle, stats};
}

at::Tensor pair_scores_dims_bwd(const at::Tensor& grad_cos, const at::Tensor& grad_angle, const at::Tensor& x,
                                const at::Tensor& stats, bool with_angle, at::IntArrayRef dims) {
  const std::vector<int64_t> widths = dims.vec();
  check_groups(x);
  const int64_t groups = x.size(0), group_size = x.size(1), dim = x.size(2);
  check_dims(widths, dim, with_angle);
  const int64_t num_dims = static_cast<int64_t>(widths.size());
  const c10::cuda::CUDAGuard guard(x.device());
  GradInputs in = grad_inputs(grad_cos, grad_angle, x, stats, {num_dims}, "[k, G, K-1]");
  dispatch_float_types(x.scalar_type(), "x", [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    using acc = acc_t<scalar_t>;
    const int64_t max_group = angle_kernels::pair_scores_dims_bwd_max_group_size<scalar_t>(num_dims);
    TORCH_CHECK_VALUE(group_size <= max_group, "angle_kernels (cuda): pair_scores backward with ", num_dims,
                      " prefixes supports K <= ", max_group, " rows per group, got ", group_size,
                      "; use backend='torch' or 'triton'");
    check_launch(angle_kernels::pair_scores_dims_bwd<scalar_t>(
                     data_of<acc>(in.grad_cos), data_of<acc>(in.grad_angle), data_of<scalar_t>(x),
                     data_of<acc>(in.stats), groups, group_size, dim, x.stride(0), x.stride(1), x.stride(2),
                     widths.data(), num_dims, with_angle, mutable_data_of<scalar_t>(in.dx), in.stream),
                 "pair_scores backward (dims)");
  });
  return in.dx;
}

}  // namespace

TORCH_LIBRARY_IMPL(angle_kernels, CUDA, m) {
  m.impl("cuda_pair_scores_fwd", &pair_scores_fwd);
  m.impl("cuda_pair_scores_bwd", &pair_scores_bwd);
  m.impl("cuda_pair_scores_dims_fwd", &pair_scores_dims_fwd);
  m.impl("cuda_pair_scores_dims_bwd", &pair_scores_dims_bwd);
}

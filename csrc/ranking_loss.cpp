// Torch binding of csrc/ranking_loss.cu: the CUDA kernels of the ops angle_kernels::cuda_ranking_fwd and
// cuda_ranking_bwd (schemas, fake implementations and autograd: the ranking_loss module of angle_kernels/cuda_ops/).
// The sort and the tie groups are done with torch here, the scans in the kernels (see csrc/ranking_loss.cu).
// What every binding function does: csrc/binding.h.

// ---- the launchers this file calls ---------------------------------------------------------------------------
// Declared here (and only here): defined and explicitly instantiated (float, double) in csrc/ranking_loss.cu,
// which never sees these declarations. What keeps the two in step: C++ mangles the parameter types (and, for a
// template specialization, the return type) into the symbol, so a declaration that differs from the definition
// asks the linker for a symbol the .cu does not define, and the extension fails to load with "undefined symbol:
// <that name>" (scripts/check_cuda_build.sh loads it without a GPU). tests/test_csrc_compile.py catches it
// earlier, with nvcc and no torch: it compiles everything above `#include "binding.h"` and checks that the
// compiled .cu defines every launcher symbol these declarations ask for. So keep this part torch-free.
#include "launcher_types.h"

namespace angle_kernels {

// scores: [n] with element stride `stride` (float or double). order, group_first, group_past: contiguous [n]
// int64 from the binding's sort (see ranking_loss.cu). scratch: float64, ranking_fwd_scratch_size(n) elements
// (ranking_bwd_scratch_size(n) for backward), laid out by the launcher. loss_out: [1].
int64_t ranking_fwd_scratch_size(int64_t n);
int64_t ranking_bwd_scratch_size(int64_t n);
template <typename scalar_t>
cudaError_t ranking_fwd(const scalar_t* scores, int64_t stride, const int64_t* order, const int64_t* group_first,
                        int64_t n, double* scratch, scalar_t* loss_out, cudaStream_t stream);
// grad_loss: [1] on the device; grad_scores: contiguous [n], fully overwritten.
template <typename scalar_t>
cudaError_t ranking_bwd(const scalar_t* grad_loss, const scalar_t* scores, int64_t stride, const int64_t* order,
                        const int64_t* group_first, const int64_t* group_past, int64_t n, double* scratch,
                        scalar_t* grad_scores, cudaStream_t stream);

}  // namespace angle_kernels

// ---- the binding ---------------------------------------------------------------------------------------------
#include "binding.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/searchsorted.h>
#include <ATen/ops/sort.h>

#include <tuple>
#include <type_traits>

namespace {

using namespace angle_kernels::binding;

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
  check_same_device(labels, "labels", scores);
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
  at::Tensor scratch = at::empty({angle_kernels::ranking_fwd_scratch_size(n)}, scores.options().dtype(at::kDouble));
  at::Tensor loss = at::empty({}, scores.options());
  const at::Tensor order_c = order.contiguous();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(scores.device().index()).stream();
  dispatch_float_types(scores.scalar_type(), "scores", [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double>) {
      check_launch(angle_kernels::ranking_fwd<scalar_t>(data_of<scalar_t>(scores), scores.stride(0),
                                                        data_of<int64_t>(order_c), data_of<int64_t>(group_first), n,
                                                        mutable_data_of<double>(scratch),
                                                        mutable_data_of<scalar_t>(loss), stream),
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
  check_scalar_grad(grad_loss, scores);
  check_same_device(order, "order", scores);
  check_same_device(group_first, "group_first", scores);
  check_same_device(group_past, "group_past", scores);
  const c10::cuda::CUDAGuard guard(scores.device());
  const at::Tensor g = grad_loss.to(scores.scalar_type()).contiguous();
  const at::Tensor order_c = order.contiguous(), first_c = group_first.contiguous(), past_c = group_past.contiguous();
  at::Tensor scratch = at::empty({angle_kernels::ranking_bwd_scratch_size(n)}, scores.options().dtype(at::kDouble));
  at::Tensor grad = at::empty({n}, scores.options().memory_format(at::MemoryFormat::Contiguous));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(scores.device().index()).stream();
  dispatch_float_types(scores.scalar_type(), "scores", [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double>) {
      check_launch(angle_kernels::ranking_bwd<scalar_t>(
                       data_of<scalar_t>(g), data_of<scalar_t>(scores), scores.stride(0), data_of<int64_t>(order_c),
                       data_of<int64_t>(first_c), data_of<int64_t>(past_c), n, mutable_data_of<double>(scratch),
                       mutable_data_of<scalar_t>(grad), stream),
                   "ranking_loss backward");
    }
  });
  return grad;
}

}  // namespace

TORCH_LIBRARY_IMPL(angle_kernels, CUDA, m) {
  m.impl("cuda_ranking_fwd", &ranking_fwd);
  m.impl("cuda_ranking_bwd", &ranking_bwd);
}

// What the torch bindings of the CUDA launchers (csrc/<op>.cpp, one per op) share: the dtype dispatch, the
// compute dtype, the launch and device checks, and typed data pointers.
//
// Host-only: included by the bindings, never by a .cu file (the kernels stay torch-free, see common.cuh).
// Each binding registers its CUDA kernels for the schemas that angle_kernels/cuda_ops/<op>.py defines in
// Python (TORCH_LIBRARY_IMPL(angle_kernels, CUDA, m): one block per binding file, which torch allows across
// translation units); csrc/module.cpp is the Python module whose import loads them all.
//
// Every binding function: checks what the kernels rely on (device, dtype, shape, sizes: the torch.ops entry
// points are public, so these checks keep the kernels' memory accesses in bounds), allocates outputs and scratch
// with torch's allocator on the inputs' device, launches on the current stream, and turns a launcher's error
// into a RuntimeError naming the op.
//
// Lean includes (no torch/extension.h: it brings pybind11 and Python, which only module.cpp needs). A binding
// includes the ATen/ops/<name>.h header of each at:: function it calls.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "launcher_types.h"

namespace angle_kernels::binding {

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

inline at::ScalarType compute_dtype(at::ScalarType input) { return input == at::kDouble ? at::kDouble : at::kFloat; }

inline void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "angle_kernels (cuda): ", op, " failed: ", cudaGetErrorString(err));
}

inline void check_cuda_tensor(const at::Tensor& t, const char* arg) {
  TORCH_CHECK_VALUE(t.is_cuda(), "angle_kernels (cuda): ", arg, " must be a CUDA tensor, got device ", t.device());
}

// `t` on `ref`'s device: a kernel launched on ref's device that reads another GPU's memory faults, or races with
// that GPU's stream where peer access is on. (dispatch checks the public ops' inputs; the torch.ops entry points are
// public too.)
inline void check_same_device(const at::Tensor& t, const char* arg, const at::Tensor& ref) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), "angle_kernels (cuda): ", arg, " must be on ", ref.device(), ", got ",
                    t.device());
}

// The upstream gradient of a scalar loss: one element, on the loss's device (every block reads element 0).
inline void check_scalar_grad(const at::Tensor& grad, const at::Tensor& ref) {
  check_same_device(grad, "grad_loss", ref);
  TORCH_CHECK_VALUE(grad.numel() == 1, "angle_kernels (cuda): grad_loss must have one element, got shape ",
                    grad.sizes());
}

template <typename scalar_t>
const scalar_t* data_of(const at::Tensor& t) {
  return reinterpret_cast<const scalar_t*>(t.const_data_ptr());
}
template <typename scalar_t>
scalar_t* mutable_data_of(at::Tensor& t) {
  return reinterpret_cast<scalar_t*>(t.mutable_data_ptr());
}

}  // namespace angle_kernels::binding

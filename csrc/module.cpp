// The Python module of the CUDA extension (angle_kernels._C, or the JIT-built library): importing it loads the
// shared library, which runs the TORCH_LIBRARY_IMPL registrations of every binding (csrc/<op>.cpp). It defines
// nothing itself: the ops are torch.ops.angle_kernels.cuda_*.
//
// The op schemas are defined in Python (angle_kernels/cuda_ops/<op>.py, through _library) so that they, their
// fake implementations and their autograd formulas exist on machines without CUDA too. The bindings only register
// CUDA kernels for them, so the extension is built only where CUDA torch exists.
//
// The one file that needs pybind11 (torch/extension.h); the bindings include lean torch headers (binding.h).

#include <torch/extension.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "CUDA kernels of angle_kernels; the ops are torch.ops.angle_kernels.cuda_*";
}

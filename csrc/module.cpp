// The Python module of the CUDA extension (angle_kernels._C, or the JIT-built library): importing it loads the
// shared library, which runs the TORCH_LIBRARY_IMPL registrations of every binding (csrc/<op>.cpp). It defines
// nothing itself: the ops are torch.ops.angle_kernels.cuda_*.
//
// The op schemas are defined in Python (angle_kernels/cuda_ops/<op>.py, through _library) so that they, their
// fake implementations and their autograd formulas exist on machines without CUDA too. The bindings only register
// CUDA kernels for them, so the extension is built only where CUDA torch exists.
//
// The one file that needs pybind11 (torch/extension.h); the bindings include lean torch headers (binding.h).

//
// csrc_hash() tells which sources a build came from: the builds (setup.py, the JIT build) define
// ANGLE_KERNELS_CSRC_HASH as 16 hex digits of SHA-256 over csrc/ (angle_kernels/cuda_ops/_extension.py,
// csrc_fingerprint), and angle_kernels.verified matches GPU verifications of the CUDA backend against it. A build
// without it answers 0, which matches none.

#include <torch/extension.h>

#include <cstdint>

#ifndef ANGLE_KERNELS_CSRC_HASH
#define ANGLE_KERNELS_CSRC_HASH 0ULL
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "CUDA kernels of angle_kernels; the ops are torch.ops.angle_kernels.cuda_*";
  m.def("csrc_hash", []() { return static_cast<std::uint64_t>(ANGLE_KERNELS_CSRC_HASH); },
        "the fingerprint of the csrc/ sources this extension was built from (0: unknown)");
}

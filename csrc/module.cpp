// The Python module of the CUDA extension (angle_kernels._C, or the JIT-built library): importing it loads the
// shared library, which runs the TORCH_LIBRARY_IMPL registrations of every binding (csrc/<op>.cpp). It defines
// nothing itself: the ops are torch.ops.angle_kernels.cuda_*.
//
// The op schemas are defined in Python (angle_kernels/cuda_ops/<op>.py, through _library) so that they, their
// fake implementations and their autograd formulas exist on machines without CUDA too. The bindings only register
// CUDA kernels for them, so the extension is built only where CUDA torch exists.
//
// The one file that needs pybind11; it includes pybind11 alone (torch's copy, on the include path every build
// passes), not torch/extension.h, which adds all of torch's headers for nothing here (a compile of about 30 s of
// one core instead of a few); the bindings include lean torch headers (binding.h).

//
// op_fingerprints() tells which sources a build came from, per op: the builds (setup.py, the JIT build) define
// ANGLE_KERNELS_FINGERPRINT_<OP> as 16 hex digits of SHA-256 over the op's sources (csrc/<op>.cu, csrc/<op>.cpp
// and the headers they include, without comments: angle_kernels/fingerprints.py, csrc_fingerprint), and
// angle_kernels.verified matches GPU verifications of the CUDA backend's op against it. A build without one
// answers 0 for that op, which matches none. A new op adds its line below, and so do the sources some code paths of
// an op run instead of the op's (csrc/similarity_xent_dense.*: fingerprints.CSRC_SOURCES), under their own name.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <map>
#include <string>

#ifndef ANGLE_KERNELS_FINGERPRINT_PAIR_SCORES
#define ANGLE_KERNELS_FINGERPRINT_PAIR_SCORES 0ULL
#endif
#ifndef ANGLE_KERNELS_FINGERPRINT_RANKING_LOSS
#define ANGLE_KERNELS_FINGERPRINT_RANKING_LOSS 0ULL
#endif
#ifndef ANGLE_KERNELS_FINGERPRINT_SIMILARITY_XENT
#define ANGLE_KERNELS_FINGERPRINT_SIMILARITY_XENT 0ULL
#endif
#ifndef ANGLE_KERNELS_FINGERPRINT_SIMILARITY_LSE
#define ANGLE_KERNELS_FINGERPRINT_SIMILARITY_LSE 0ULL
#endif
#ifndef ANGLE_KERNELS_FINGERPRINT_SIMILARITY_XENT_DENSE
#define ANGLE_KERNELS_FINGERPRINT_SIMILARITY_XENT_DENSE 0ULL
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "CUDA kernels of angle_kernels; the ops are torch.ops.angle_kernels.cuda_*";
  m.def("op_fingerprints", []() {
    return std::map<std::string, std::uint64_t>{
        {"pair_scores", static_cast<std::uint64_t>(ANGLE_KERNELS_FINGERPRINT_PAIR_SCORES)},
        {"ranking_loss", static_cast<std::uint64_t>(ANGLE_KERNELS_FINGERPRINT_RANKING_LOSS)},
        {"similarity_xent", static_cast<std::uint64_t>(ANGLE_KERNELS_FINGERPRINT_SIMILARITY_XENT)},
        {"similarity_lse", static_cast<std::uint64_t>(ANGLE_KERNELS_FINGERPRINT_SIMILARITY_LSE)},
        {"similarity_xent_dense", static_cast<std::uint64_t>(ANGLE_KERNELS_FINGERPRINT_SIMILARITY_XENT_DENSE)},
    };
  }, "op -> the fingerprint of the CUDA sources this extension built it from (0: unknown)");
}

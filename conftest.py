"""Pytest setup shared by tests/ and bench/: the Triton interpreter is on for the whole CPU test session.

The Triton kernels are tested on CPU through the Triton interpreter, which has to be on before triton is first
imported in the process: triton decorates its own language functions (tl.zeros, tl.sum, ...) in the mode in
force when it is imported, and any test may import it first (torch.compile's inductor does). A kernel run
under the interpreter with a compiled-mode triton fails with "Cannot call @triton.jit'd outside of the scope
of a kernel". Turning the interpreter on changes nothing for the other backends: dispatch uses Triton only for
CUDA tensors or when asked. On a GPU, ANGLE_KERNELS_TRITON_TEST_DEVICE=cuda keeps the real compiler.
"""

import os

if os.environ.get("ANGLE_KERNELS_TRITON_TEST_DEVICE", "cpu") != "cuda":
    os.environ["TRITON_INTERPRET"] = "1"

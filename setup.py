"""Build hook for the optional CUDA extension `angle_kernels._C` (metadata lives in pyproject.toml).

The extension (csrc/: per op the kernels <op>.cu and their torch binding <op>.cpp, plus module.cpp, the Python
module) is built only where it can be: `import torch` works, torch is a CUDA build (torch.version.cuda is set)
and nvcc is found under torch's CUDA_HOME. Otherwise, and also when the compile itself fails, the build prints
why and installs the pure-Python package, whose Triton and PyTorch backends need no compiled code (a source
checkout can still JIT-build the extension later with backend="cuda"; see angle_kernels/cuda_ops/_extension.py,
which also holds the source list and the flags).

torch is deliberately not a build requirement, so a CUDA build needs the torch already installed:
    pip install --no-build-isolation .          (or -e . for development)

Environment:
    ANGLE_KERNELS_BUILD_CUDA=0      never build the extension
    ANGLE_KERNELS_BUILD_CUDA=1      require it: fail the install if it cannot be built or does not compile
    TORCH_CUDA_ARCH_LIST            target GPUs (default "8.0;8.6;8.9;9.0": A100; A10, A40, RTX 30xx; L4, L40,
                                    RTX 40xx; H100/H200)
    MAX_JOBS                        parallel compile jobs for ninja (torch's variable)
"""

from __future__ import annotations

import importlib.util
import os
import sys

from setuptools import setup

DEFAULT_ARCH_LIST = "8.0;8.6;8.9;9.0"


def _log(message: str) -> None:
    print(f"angle_kernels setup: {message}", file=sys.stderr)


def _extension_settings():
    """angle_kernels/cuda_ops/_extension.py, loaded by path: the one list of sources and flags (the package
    itself is not importable yet while it is being built)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "angle_kernels", "cuda_ops", "_extension.py")
    spec = importlib.util.spec_from_file_location("_angle_kernels_extension_settings", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def optional_build_ext(base: type, required: bool) -> type:
    """`base` (a build_ext command class) whose compile failure skips the extensions with a warning instead of
    failing the install, unless `required`. The Triton and PyTorch backends work without the extension, and a
    failed optional build must not cost the user the whole package."""

    class OptionalBuildExt(base):
        def build_extensions(self):
            try:
                super().build_extensions()
            except Exception as exc:  # CompileError, ninja's RuntimeError, a missing compiler, ...
                if required:
                    raise
                names = ", ".join(ext.name for ext in self.extensions)
                _log(f"WARNING: compiling {names} failed ({type(exc).__name__}: {exc}); installing without it. "
                     "The Triton and PyTorch backends need no compiled code; set ANGLE_KERNELS_BUILD_CUDA=1 to "
                     "make this failure fatal and see the compiler's output above.")
                self.extensions = []  # nothing to copy into the source tree or to install

    return OptionalBuildExt


def cuda_objects_apart(base: type) -> type:
    """`base` (a build_ext command class) that compiles `x.cu` to `x.cuda.o`, as torch's JIT build
    (cpp_extension.load) does, instead of setuptools' `x.o`.

    setuptools names an object after its source without the suffix, so csrc/<op>.cu (the kernels) and
    csrc/<op>.cpp (their binding) would both compile to <op>.o: ninja refuses such a build ("multiple rules
    generate .../<op>.o"), and torch's BuildExtension does not rename them."""

    class CudaObjectsApart(base):
        def build_extensions(self):
            object_filenames = self.compiler.object_filenames

            def cuda_apart(source_filenames, strip_dir=False, output_dir=""):
                sources = [os.fspath(s) for s in source_filenames]
                objects = object_filenames(sources, strip_dir=strip_dir, output_dir=output_dir)
                return [f"{os.path.splitext(obj)[0]}.cuda{os.path.splitext(obj)[1]}" if src.endswith(".cu") else obj
                        for src, obj in zip(sources, objects)]

            # What the compile step (setuptools' or torch's ninja writer) asks for each source's object path.
            self.compiler.object_filenames = cuda_apart
            super().build_extensions()

    return CudaObjectsApart


def _cuda_extension() -> tuple[list, dict]:
    """(ext_modules, cmdclass) for the CUDA extension, or ([], {}) when it is skipped."""
    mode = os.environ.get("ANGLE_KERNELS_BUILD_CUDA", "auto").strip().lower()
    if mode in ("0", "false", "no", "off"):
        _log("ANGLE_KERNELS_BUILD_CUDA=0: not building the CUDA extension")
        return [], {}
    required = mode in ("1", "true", "yes", "on")

    def skip(reason: str) -> tuple[list, dict]:
        if required:
            raise RuntimeError(f"ANGLE_KERNELS_BUILD_CUDA=1 but the CUDA extension cannot be built: {reason}")
        _log(f"not building the CUDA extension ({reason}); the Triton and PyTorch backends need no compiled code")
        return [], {}

    try:
        import torch
        from torch.utils import cpp_extension
    except Exception as exc:  # isolated build environments have no torch
        return skip(f"torch is not importable here: {type(exc).__name__}: {exc}; "
                    "use pip install --no-build-isolation to build against the installed torch")
    if torch.version.cuda is None:
        return skip(f"torch {torch.__version__} is a CPU-only build")
    cuda_home = cpp_extension.CUDA_HOME
    nvcc = os.path.join(cuda_home, "bin", "nvcc") if cuda_home else None
    if nvcc is None or not os.path.exists(nvcc):
        return skip("nvcc was not found (set CUDA_HOME to the CUDA toolkit)")
    settings = _extension_settings()
    sources = [f"csrc/{name}" for name in settings.SOURCES]
    missing = [s for s in sources if not os.path.exists(s)]
    if missing:
        return skip(f"sources missing: {', '.join(missing)}")

    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
    _log(f"building angle_kernels._C with {nvcc} for TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}")
    extension = cpp_extension.CUDAExtension(
        name="angle_kernels._C",
        sources=sources,
        include_dirs=[os.path.abspath("csrc")],
        extra_compile_args={"cxx": settings.cxx_flags(), "nvcc": list(settings.NVCC_FLAGS)},
    )
    build_ext = optional_build_ext(cuda_objects_apart(cpp_extension.BuildExtension.with_options(use_ninja=True)),
                                   required)
    return [extension], {"build_ext": build_ext}


if __name__ == "__main__":  # setuptools runs this file as __main__; tests import it for optional_build_ext
    ext_modules, cmdclass = _cuda_extension()
    setup(ext_modules=ext_modules, cmdclass=cmdclass)

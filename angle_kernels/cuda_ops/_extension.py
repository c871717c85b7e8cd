"""Finding the compiled CUDA kernels: a prebuilt `angle_kernels._C`, else a JIT build of csrc/.

`load(allow_build)` returns (True, "") or (False, why). It never raises: an optional backend must not break
`import angle_kernels`. Order of attempts:

1. torch must be a CUDA build (torch.version.cuda set) and see a GPU; otherwise there is nothing to run on.
2. `import angle_kernels._C`: built by setup.py (`pip install .` on a machine with CUDA torch and nvcc).
3. A JIT build with torch.utils.cpp_extension.load from the source checkout's csrc/, attempted only when nvcc
   is found, and only with allow_build=True: it runs nvcc for minutes, so backend="auto" (which passes
   allow_build=False) never starts it inside a loss call; an explicit backend="cuda" or
   `cuda_ops.is_available()` does. A build is attempted at most once per process, and once it succeeded
   load(allow_build=False) reports the kernels available too. Builds land in TORCH_EXTENSIONS_DIR (torch's
   default cache dir when unset). Set ANGLE_KERNELS_CUDA_JIT=0 to never attempt it.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

import torch


# The one statement of what the extension is built from and with: setup.py (the install-time build) loads this
# file for them, and tests/test_csrc_compile.py compiles csrc/ with NVCC_FLAGS on top of torch's own flags.
NVCC_FLAGS = ["-O3", "-lineinfo"]  # the C++ standard is left to torch (c++17 or c++20)
CXX_FLAGS = ["-O3"]
CSRC_DIR = Path(__file__).resolve().parents[2] / "csrc"
# Every .cu and .cpp in csrc/, so adding an op edits no list: per op csrc/<op>.cu (kernels and launchers,
# torch-free) and csrc/<op>.cpp (its torch binding), plus the Python module, named so that a tree without csrc/
# (an installed wheel) reports it missing instead of building nothing.
MODULE_SOURCE = "module.cpp"
SOURCES = tuple(sorted({MODULE_SOURCE, *(path.name for ext in ("cu", "cpp") for path in CSRC_DIR.glob(f"*.{ext}"))}))
# The kernel sources csrc/ holds (csrc/<name>.cu: an op's, named after it, or one some code paths of an op run
# instead, fingerprints.CSRC_SOURCES), and the macro through which a build tells, for each, the fingerprint of the
# sources it was built from (module.cpp exposes them as op_fingerprints()): what angle_kernels.verified matches a GPU
# verification of this backend's code path against.
CSRC_OPS = tuple(sorted(path.stem for path in CSRC_DIR.glob("*.cu")))
FINGERPRINT_MACRO = "ANGLE_KERNELS_FINGERPRINT_"


def _fingerprints():
    """angle_kernels.fingerprints (standard library only), loaded by path when this file is (setup.py loads it by
    path while the package is being built and cannot be imported)."""
    if __package__:
        from .. import fingerprints

        return fingerprints
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[1] / "fingerprints.py"
    spec = importlib.util.spec_from_file_location("_angle_kernels_fingerprints", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def cxx_flags(csrc_dir: Path = CSRC_DIR) -> list[str]:
    """The host compiler's flags of a build: CXX_FLAGS and each op's source fingerprint
    (`fingerprints.csrc_fingerprint`), as integer literals, which survive every layer of quoting between setuptools,
    ninja and the compiler."""
    fingerprints = _fingerprints()
    tree = fingerprints.folder_tree(csrc_dir.parent)
    ops = sorted(path.stem for path in csrc_dir.glob("*.cu"))
    return [*CXX_FLAGS, *(f"-D{FINGERPRINT_MACRO}{op.upper()}=0x{fingerprints.csrc_fingerprint(op, tree)}ULL"
                          for op in ops)]


def _find_nvcc() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").exists():
        return str(Path(cuda_home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _jit_build() -> tuple[bool, str]:
    if os.environ.get("ANGLE_KERNELS_CUDA_JIT", "1") == "0":
        return False, "the JIT build is disabled (ANGLE_KERNELS_CUDA_JIT=0)"
    sources = [CSRC_DIR / name for name in SOURCES]
    missing = [str(s) for s in sources if not s.exists()]
    if missing:
        return False, f"no CUDA sources to JIT-build ({', '.join(missing)} missing)"
    if _find_nvcc() is None:
        return False, "nvcc was not found (set CUDA_HOME), so the CUDA sources cannot be JIT-built"
    from torch.utils import cpp_extension

    global _jit_module
    try:
        _jit_module = cpp_extension.load(
            name="angle_kernels_cuda_jit",
            sources=[str(s) for s in sources],
            extra_include_paths=[str(CSRC_DIR)],
            extra_cflags=cxx_flags(),
            extra_cuda_cflags=NVCC_FLAGS,
            is_python_module=True,
            verbose=os.environ.get("ANGLE_KERNELS_CUDA_VERBOSE", "0") == "1",
        )
    except Exception as exc:  # a failed build must leave the backend unavailable, not crash
        return False, f"the JIT build of csrc/ failed: {type(exc).__name__}: {exc}"
    return True, ""


def _missing_requirement() -> str:
    """Why this process has nothing to run CUDA kernels on, or "" when it has."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} was built without CUDA (torch.version.cuda is None)"
    if not torch.cuda.is_available():
        return "torch sees no CUDA GPU (torch.cuda.is_available() is False)"
    return ""


def define_schemas() -> None:
    """Import the op modules (those `cuda_ops.load_ops` returns): they define the schemas the kernels attach to."""
    from . import pair_scores, ranking_loss, similarity_lse, similarity_xent_paths  # noqa: F401  (their definitions)


@functools.lru_cache(maxsize=None)
def _import_prebuilt() -> tuple[bool, str]:
    """Import the extension setup.py built, if there is one (a fact about the install: cached)."""
    try:
        import angle_kernels._C  # noqa: F401
    except ImportError as exc:
        return False, f"no prebuilt angle_kernels._C ({exc})"
    return True, ""


# The outcome of this process's JIT build of csrc/; None until one is attempted (at most one is). Kept apart
# from the answers of load(allow_build=False), which must not stand in for a build that was never tried.
_jit_outcome: tuple[bool, str] | None = None
_jit_module = None  # the JIT-built Python module, once built


def build_fingerprints() -> dict[str, str] | None:
    """op -> the fingerprint of the op's CUDA sources the loaded extension was built from (its op_fingerprints()),
    or None when no extension is loaded in this process; an op built without one is left out."""
    module = _jit_module
    if module is None and _import_prebuilt()[0]:
        import angle_kernels._C as module
    if module is None:
        return None
    reported = getattr(module, "op_fingerprints", dict)()
    return {op: f"{value:016x}" for op, value in reported.items() if value}


def load(allow_build: bool = True) -> tuple[bool, str]:
    """Make the CUDA kernels of the angle_kernels::cuda_* ops available; (ok, reason if not).

    allow_build=False never compiles: the kernels are available only if a prebuilt extension imports or this
    process has already JIT-built them.
    """
    global _jit_outcome
    missing = _missing_requirement()
    if missing:
        return False, missing
    try:
        define_schemas()  # before the kernels attach to them
    except Exception as exc:  # noqa: BLE001  (load never raises: the reason is the answer)
        return False, f"defining the angle_kernels::cuda_* ops failed: {type(exc).__name__}: {exc}"
    prebuilt, prebuilt_why = _import_prebuilt()
    if prebuilt:
        return True, ""
    if _jit_outcome is None:
        if not allow_build:
            return False, (
                f"{prebuilt_why}; the JIT build of csrc/ (minutes of nvcc) was not attempted: it runs only "
                "for an explicit backend='cuda' or angle_kernels.cuda_ops.is_available()"
            )
        _jit_outcome = _jit_build()
    built, build_why = _jit_outcome
    return (True, "") if built else (False, f"{prebuilt_why}; {build_why}")

"""Compile every Triton kernel of this package for a real GPU target, without a GPU.

The interpreter tolerates things a GPU compile rejects (layout conversions, dot shapes and dtypes, fp64 math
lowering, scan/reduce combine functions), so CI compiles each kernel for sm_90 with Triton's own ptxas:
`triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32))`. What to compile comes
from each kernel module of the package (one per op of `contract.OPS`, and the modules they launch kernels from,
such as similarity_xent_dense): `compile_cases(full)` lists the specialisations its launcher uses, and every
`_..._kernel` it defines must appear in some module's cases. It must run with TRITON_INTERPRET unset (under the
interpreter @triton.jit returns interpreted functions that cannot be compiled). Run as a script to print each
kernel's registers, spills and shared memory:

    env -u TRITON_INTERPRET python -m angle_kernels.triton_ops._compile_check [--arch 90]
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ..contract import OPS
from ._common import CompileCase


@dataclass
class CompiledKernel:
    name: str
    variant: str
    n_regs: int | None
    n_spills: int | None
    shared_bytes: int


def _kernel_modules() -> list:
    """Every module of this package but this one: the op modules (`contract.OPS`) and the modules they launch
    kernels from (e.g. similarity_xent_dense)."""
    package = importlib.import_module("angle_kernels.triton_ops")
    names = {info.name for info in pkgutil.iter_modules(package.__path__)} - {"_compile_check"}
    missing = set(OPS) - names
    if missing:
        raise RuntimeError(f"op modules missing from angle_kernels.triton_ops: {sorted(missing)}")
    return [importlib.import_module(f"{package.__name__}.{name}") for name in sorted(names)]


# A launch specialises the integer arguments it may (those not in do_not_specialize) on their values: == 1 becomes
# a constant, a multiple of 16 gets a divisibility hint. Both change the compiled kernel (contiguous, vectorised and
# pipelined loads: more shared memory, other registers), so the compile check specialises as the usual launch does:
# contiguous rows (the inner strides, stride_*d, are 1) and a width D and outer strides that are multiples of 16
# (768, 1024, 4096, ...). Any other integer stays a plain i32.
_INNER_STRIDE = re.compile(r"^stride_\w*d$")


def _signature(case: CompileCase) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) of the case, as a typical launch specialises them (see above)."""
    pointers = case.pointers or {}
    signature, constexprs, attrs = {}, dict(case.constexprs), {}
    for index, (name, param) in enumerate(zip(case.kernel.arg_names, case.kernel.params)):
        if param.is_constexpr:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*" + pointers.get(name, case.pointer_dtype)
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif not param.do_not_specialize and _INNER_STRIDE.match(name):
            signature[name] = "constexpr"
            constexprs[name] = 1
        else:  # float parameters travel in small tensors (the float64 path keeps them exact): the rest are i32
            signature[name] = "i32"
            if not param.do_not_specialize and (name == "D" or name.startswith("stride_")):
                attrs[(index,)] = [["tt.divisibility", 16]]
    missing = [n for n, p in zip(case.kernel.arg_names, case.kernel.params) if p.is_constexpr
               and n not in case.constexprs]
    if missing:
        raise ValueError(f"{case.kernel.__name__}: no value for constexpr(s) {missing}")
    return signature, constexprs, attrs


def _resource_usage(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers, spill stores) read from the cubin with the cuobjdump Triton ships, if it is there."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        tool = shutil.which("cuobjdump")
    if tool is None:
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", out)
    spills = re.search(r"STACK:(\d+)", out)
    return (int(regs.group(1)) if regs else None), (int(spills.group(1)) if spills else None)


def _compile(case: CompileCase, arch: int):
    signature, constexprs, attrs = _signature(case)
    src = ASTSource(fn=case.kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": case.num_warps, "num_stages": case.num_stages}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def _launched_kernels(module) -> set[str]:
    """The kernels a module launches: its @triton.jit functions named _<...>_kernel (not the jit helpers)."""
    return {name for name, value in vars(module).items()
            if name.endswith("_kernel") and isinstance(value, triton.runtime.jit.JITFunction)}


def compile_all(arch: int = 90, full: bool = False) -> list[CompiledKernel]:
    """Compile every module's `compile_cases(full)` for sm_<arch>; raises on the first failure, and when a kernel
    of the package has no case (full=False is the CI subset, under 90 s on 2 cores)."""
    modules = _kernel_modules()
    cases = [case for module in modules if hasattr(module, "compile_cases") for case in module.compile_cases(full)]
    uncovered = set().union(*map(_launched_kernels, modules)) - {case.kernel.__name__ for case in cases}
    if uncovered:
        raise RuntimeError(f"kernels with no compile case (add them to their module's compile_cases): "
                           f"{sorted(uncovered)}")
    results = []
    for case in cases:
        compiled = _compile(case, arch)
        regs, spills = _resource_usage(compiled.asm["cubin"])
        results.append(CompiledKernel(case.kernel.__name__, case.label, regs, spills, int(compiled.metadata.shared)))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80, 90, 100")
    parser.add_argument("--full", action="store_true", help="every variant and autotune config (minutes)")
    args = parser.parse_args()
    for r in compile_all(args.arch, args.full):
        print(f"{r.name:36s} {r.variant:58s} regs={r.n_regs} stack={r.n_spills} shared={r.shared_bytes}")


if __name__ == "__main__":
    main()

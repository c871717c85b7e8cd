"""Compile every Triton kernel of this package for a real GPU target, without a GPU.

The interpreter tolerates things a GPU compile rejects (layout conversions, dot shapes and dtypes, fp64 math
lowering, scan/reduce combine functions), so CI compiles each kernel for sm_90 with Triton's own ptxas:
`triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32))`. It must run with
TRITON_INTERPRET unset (under the interpreter @triton.jit returns interpreted functions that cannot be
compiled). Run as a script to print each kernel's registers, spills and shared memory:

    env -u TRITON_INTERPRET python -m angle_kernels.triton_ops._compile_check [--arch 90]
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ..contract import MARGIN_SIN_SQUARED_FLOOR, NORM_EPS

# importlib, not `from . import pair_scores`: the package binds those names to the ops, not the modules.
ps = importlib.import_module("angle_kernels.triton_ops.pair_scores")
rk = importlib.import_module("angle_kernels.triton_ops.ranking")
sx = importlib.import_module("angle_kernels.triton_ops.similarity_xent")

# Runtime scalars that are floats (none at present: float parameters travel in small tensors so that the
# float64 path keeps them exact); every other non-pointer, non-constexpr argument is an i32.
_FLOAT_ARGS: set[str] = set()
_INT64_POINTER_ARGS = {"group_start_ptr", "group_end_ptr", "order_ptr"}


@dataclass
class CompiledKernel:
    name: str
    variant: str
    n_regs: int | None
    n_spills: int | None
    shared_bytes: int


def _signature(fn, pointer_dtype: str, constexprs: dict, pointer_overrides: dict | None = None):
    overrides = pointer_overrides or {}
    signature, attrs = {}, {}
    for index, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        if param.is_constexpr:
            signature[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            dtype = overrides.get(name, "i64" if name in _INT64_POINTER_ARGS else pointer_dtype)
            signature[name] = "*" + dtype
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name in _FLOAT_ARGS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    missing = [n for n, p in zip(fn.arg_names, fn.params) if p.is_constexpr and n not in constexprs]
    if missing:
        raise ValueError(f"{fn.__name__}: no value for constexpr(s) {missing}")
    return signature, attrs


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


def _compile(fn, pointer_dtype, constexprs, arch, num_warps, num_stages=3, pointer_overrides=None):
    signature, attrs = _signature(fn, pointer_dtype, constexprs, pointer_overrides)
    target = GPUTarget("cuda", arch, 32)
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=target, options={"num_warps": num_warps, "num_stages": num_stages})


def _variants(full: bool):
    """(kernel, label, pointer dtype, constexprs, num_warps, num_stages, pointer overrides) to compile.

    full=False is the CI subset (under 90 s on 2 cores): every kernel at least once, for fp32 and bf16 inputs,
    with the first autotune config of each dtype class. full=True adds K = 2/3, with/without angle, fp16, and
    every autotune config.
    """
    out = []
    acc_of = {"fp32": tl.float32, "bf16": tl.float32, "fp16": tl.float32, "fp64": tl.float64}
    pair_variants = [("fp32", 2, True), ("bf16", 3, True), ("bf16", 2, False)]
    if full:
        pair_variants = [(x, k, a) for x in ("fp32", "bf16", "fp64") for k in (2, 3) for a in (True, False)]
    for x_dtype, k, with_angle in pair_variants:
        cfg = ps.launch_config(k, 768, with_angle)
        warps = cfg.pop("num_warps")
        const = dict(WITH_ANGLE=with_angle, ACC=acc_of[x_dtype], EPS=NORM_EPS, **cfg)
        label = f"x={x_dtype} K={k} angle={with_angle} D=768"
        over = {"x_ptr": x_dtype}
        scalars = "fp64" if x_dtype == "fp64" else "fp32"
        out.append((ps._pair_scores_fwd_kernel, label, scalars, const, warps, 3, over))
        out.append((ps._pair_scores_bwd_kernel, label, scalars, const, warps, 3, {**over, "dx_ptr": x_dtype}))
    for scores_dtype, acc in (("fp32", tl.float32), ("fp64", tl.float64)):
        out.append((rk._ranking_pairwise_fwd_kernel, f"scores={scores_dtype}", "fp64",
                    dict(ACC=acc, BLOCK_ROWS=rk._PAIRWISE_BLOCK_ROWS, BLOCK_COLS=rk._PAIRWISE_BLOCK_COLS),
                    rk._PAIRWISE_WARPS, 3, {"scores_ptr": scores_dtype, "labels_ptr": "i64"}))
        out.append((rk._ranking_bwd_kernel, f"grad={scores_dtype}", "fp64",
                    dict(HAS_ORDER=True, BLOCK=rk._BWD_BLOCK), 4, 3, {"grad_ptr": scores_dtype}))
    out.append((rk._ranking_block_scan_kernel, "fp64", "fp64", dict(BLOCK=rk._SCAN_BLOCK), 8, 3, None))
    out.append((rk._ranking_gather_fwd_kernel, "fp64", "fp64",
                dict(SCAN_BLOCK=rk._SCAN_BLOCK, BLOCK=rk._SCAN_BLOCK), 8, 3, None))

    sim_variants = [("bf16", tl.bfloat16, True, False), ("fp32", tl.float32, False, True)]
    if full:
        sim_variants = [(x, op, g, not g) for x, op in (("fp32", tl.float32), ("bf16", tl.bfloat16),
                                                        ("fp16", tl.float16), ("fp64", tl.float64))
                        for g in (True, False)]
    for x_dtype, operand, has_groups, has_margin in sim_variants:
        configs = sx._GPU_CONFIGS_32BIT if x_dtype in ("fp32", "fp64") else sx._GPU_CONFIGS_16BIT
        acc = tl.float64 if x_dtype == "fp64" else tl.float32
        pointer_dtype = "fp64" if x_dtype == "fp64" else "fp32"
        for config in configs if full else configs[:1]:
            const = dict(PARTNER_TARGET=has_groups, EXCLUDE_DIAGONAL=has_groups, HAS_MARGIN=has_margin,
                         HAS_GROUPS=has_groups, ACC=acc, OPERAND=operand, PRECISION="ieee",
                         EPS=NORM_EPS, SIN_SQ_FLOOR=MARGIN_SIN_SQUARED_FLOOR, **config.kwargs)
            blocks = "x".join(str(v) for v in config.kwargs.values())
            label = f"x={x_dtype} groups={has_groups} margin={has_margin} tile={blocks} w={config.num_warps}"
            over = {"q_ptr": x_dtype, "c_ptr": x_dtype, "group_ptr": "i64"}
            for fn in sx._TILE_KERNELS:
                out.append((fn, label, pointer_dtype, const, config.num_warps, config.num_stages, over))
        out.append((sx._similarity_xent_bwd_finish_kernel, f"x={x_dtype}", pointer_dtype,
                    dict(HAS_B=True, ACC=acc, EPS=NORM_EPS, BLOCK_D=1024), 4, 3,
                    {"x_ptr": x_dtype, "dx_ptr": x_dtype}))
    return out


def compile_all(arch: int = 90, full: bool = False) -> list[CompiledKernel]:
    """Compile the kernel variants (see _variants) for sm_<arch>; raises on the first failure."""
    results = []
    for fn, label, pointer_dtype, const, warps, stages, over in _variants(full):
        compiled = _compile(fn, pointer_dtype, const, arch, warps, num_stages=stages, pointer_overrides=over)
        regs, spills = _resource_usage(compiled.asm["cubin"])
        results.append(CompiledKernel(fn.__name__, label, regs, spills, int(compiled.metadata.shared)))
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

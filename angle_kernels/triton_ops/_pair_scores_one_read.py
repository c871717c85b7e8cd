"""Pair scores of every nested prefix in one read of each row: the "dims_one_read" path beside pair_scores.py's.

Computes pair_scores(x, with_angle, dims) (angle_kernels.dispatch.pair_scores) for dims = d_1 < ... < d_k: outputs
[k, G, K-1], prefix i being the scores of x[..., :d_i], the same values as pair_scores.py's prefix kernels by
another schedule. The slices s_i = [d_{i-1}, d_i) (d_0 = 0) partition the prefixes: prefix i is s_1 .. s_i.

Forward, one program per group, the slices in order: each slice is read once, in vectors as wide as the slice (the
next power of two of its width, up to 1024 lanes: the full-width path's vector loads, pair_scores.py), and its
partial sums u.u, v.v, u.v are reduced and added to the running totals of the prefixes before it; prefix i's
scores are stored right after slice i. Its row scale (pair_scores.py, huge rows) is the running exponent after
slice i: a slice that raises it rescales the totals, as the chunks of one sweep do. With the angle, prefix i's cross
term b.c - a.d pairs column j with j + d_i / 2, a shift of its own per prefix: after slice i, a sweep over the
prefix's halves (in half-width vectors, at the prefix's now final scale) reads the group's rows again, which the
program has just read: cache hits, DRAM still sees one read.

Backward writes each column of dx once. A column of slice s belongs to the prefixes i >= s; with (u, v) scaled by
prefix s's scales (su_s, sv_s) and r_i = su_i / su_s, t_i = sv_i / sv_s (powers of two, at most 1: a longer prefix
has the larger scale exponent), the terms of pair_scores.py's formulas summed over those prefixes are

    du = su_s [sum_p A_p v_p - B u],    dv_p = sv_s [A_p u - C_p v_p]
    A_p = sum_{i >= s} r_i t_ip along_ip,  B = sum_{i >= s} r_i^2 anchor_shrink_i,  C_p = sum_{i >= s} t_ip^2 shrink_ip

(along, shrink: the per-pair coefficients of prefix i, pair_scores._pair_coefficients): the coefficients are summed
over the prefixes once per slice block, and every element takes one width's arithmetic. With the angle each prefix
adds its rotated terms, whose twin column j +- d_i / 2 is again a cache hit. Columns past d_k get 0.

The floor is one width's: forward reads x once and writes O(k G K) scalars, backward reads x once and writes dx
once. Against pair_scores.py's prefix kernels: the same DRAM bytes, but one width's vector lanes and arithmetic for
the norms and dots (the prefix forward with the angle sweeps every prefix from column 0: sum(d_i) elements; its
backward rebuilds every prefix's coefficients in every 128-column block and adds each prefix's terms per element).
Compiled for sm_90 with dims (64, 128, 256, 512, 768), specialised as launched (triton 3.9, `_compile_check`):
float32 and bfloat16 forward 32-48 registers, backward 64-168 (the prefix kernels' 40-255), the backward's blocks
capped at 512 lanes (80-177 at D = 4,096, dims 256 to 4,096); float64 K = 3 with the angle 255 with a 120-byte spill
(theirs 96). Not timed on a GPU yet: pair_scores_paths.py sends it the dims calls from 768 up.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from ..contract import NORM_EPS
from ._common import CompileCase, acc_dtype_of, new_output, pow2, scaled_eps
from .pair_scores import (
    _MAX_BLOCK,
    _empty_sums,
    _group_rows,
    _load_block,
    _new_scores,
    _pair_coefficients,
    _save_for_backward,
    _sweep_columns,
    _upstream,
)


@triton.jit
def _sweep_cross(anchor_ptr, partner_ptr, partner_ok, half, su, sv, stride_d, PARTNERS_PAD: tl.constexpr,
                 BLOCK: tl.constexpr, ACC: tl.constexpr):
    """b.c - a.d ([P]) of the first 2 * half features of the rows scaled by su (scalar) and sv ([P]): a, b =
    u[j], u[j + half]; c, d = v[j], v[j + half]."""
    offs = tl.arange(0, BLOCK)
    cross = tl.zeros([PARTNERS_PAD, BLOCK], dtype=ACC)
    for start in range(0, half, BLOCK):
        cols = (start + offs).to(tl.int64)
        col_ok = cols < half
        tile_ok = partner_ok[:, None] & col_ok[None, :]
        a, c = _load_block(anchor_ptr, partner_ptr, cols, col_ok, tile_ok, stride_d, ACC)
        b, d = _load_block(anchor_ptr, partner_ptr, cols + half, col_ok, tile_ok, stride_d, ACC)
        cross += (b * su)[None, :] * (c * sv[:, None]) - (a * su)[None, :] * (d * sv[:, None])
    return tl.sum(cross, axis=1)


@triton.jit
def _store_prefix_scores(uu, vv, uv, cross, exp_u, exp_v, cos_ptr, angle_ptr, norms_ptr, scales_ptr, cross_ptr,
                         pair_out, norm_out, partner, partner_ok, WITH_ANGLE: tl.constexpr, ACC: tl.constexpr,
                         EPS: tl.constexpr):
    """pair_scores._store_scores for sums already reduced: uu (scalar), vv, uv, cross ([P])."""
    su = pow2(-exp_u, ACC)
    sv = pow2(-exp_v, ACC)
    norm_u = tl.sqrt(uu)
    norm_v = tl.sqrt(vv)
    inv_p = 1.0 / (tl.maximum(norm_u, scaled_eps(su, EPS, ACC)) * tl.maximum(norm_v, scaled_eps(sv, EPS, ACC)))
    cos = uv * inv_p
    w = cross * inv_p
    tl.store(cos_ptr + pair_out + partner, cos, mask=partner_ok)
    tl.store(cross_ptr + pair_out + partner, w, mask=partner_ok)
    if WITH_ANGLE:
        tl.store(angle_ptr + pair_out + partner, cos + w, mask=partner_ok)
    tl.store(norms_ptr + norm_out, norm_u)
    tl.store(norms_ptr + norm_out + 1 + partner, norm_v, mask=partner_ok)
    tl.store(scales_ptr + norm_out, su)
    tl.store(scales_ptr + norm_out + 1 + partner, sv, mask=partner_ok)


@triton.jit
def _one_read_prefix_fwd_kernel(
    x_ptr,  # [G, K, D], any strides
    cos_ptr,  # [k, G, K-1] out, compute dtype
    angle_ptr,  # [k, G, K-1] out (written only WITH_ANGLE)
    norms_ptr,  # [k, G, K] out: norms of every prefix of the scaled rows, for backward
    scales_ptr,  # [k, G, K] out: the scale of every prefix of the rows, for backward
    cross_ptr,  # [k, G, K-1] out: w of every prefix, for backward
    G,
    K,
    stride_g,
    stride_k,
    stride_d,
    DIMS: tl.constexpr,  # the prefix widths, ascending (a tuple: the loops over them unroll)
    SLICE_BLOCKS: tl.constexpr,  # each slice's vector width (launch_blocks)
    HALF_BLOCKS: tl.constexpr,  # each prefix's half-width vector (with the angle)
    N_DIMS: tl.constexpr,
    WITH_ANGLE: tl.constexpr,
    PARTNERS_PAD: tl.constexpr,
    ACC: tl.constexpr,
    EPS: tl.constexpr,
):
    group, partner, partner_ok, anchor_ptr, partner_ptr = _group_rows(x_ptr, stride_g, stride_k, K, PARTNERS_PAD)
    # the running totals of the prefixes so far, at the running scale exponents exp_u (scalar) and exp_v ([P])
    uu_total = tl.sum(tl.zeros([PARTNERS_PAD], dtype=ACC), axis=0)
    vv_total = tl.zeros([PARTNERS_PAD], dtype=ACC)
    uv_total = tl.zeros([PARTNERS_PAD], dtype=ACC)
    exp_u = tl.max(tl.zeros([PARTNERS_PAD], dtype=tl.int32), axis=0)
    exp_v = tl.zeros([PARTNERS_PAD], dtype=tl.int32)
    lo = 0
    for i in tl.static_range(N_DIMS):
        uu, vv, uv, _cross, slice_exp_u, slice_exp_v = _empty_sums(PARTNERS_PAD, SLICE_BLOCKS[i], ACC)
        uu, vv, uv, slice_exp_u, slice_exp_v = _sweep_columns(anchor_ptr, partner_ptr, partner_ok, lo, DIMS[i],
                                                              stride_d, uu, vv, uv, exp_u, exp_v, SLICE_BLOCKS[i],
                                                              ACC)
        fu = pow2(exp_u - slice_exp_u, ACC)  # the totals so far, brought to the slice's scale
        fv = pow2(exp_v - slice_exp_v, ACC)
        uu_total = uu_total * (fu * fu) + tl.sum(uu, axis=0)
        vv_total = vv_total * (fv * fv) + tl.sum(vv, axis=1)
        uv_total = uv_total * (fu * fv) + tl.sum(uv, axis=1)
        exp_u = slice_exp_u
        exp_v = slice_exp_v
        lo = DIMS[i]
        cross = tl.zeros([PARTNERS_PAD], dtype=ACC)
        if WITH_ANGLE:
            cross = _sweep_cross(anchor_ptr, partner_ptr, partner_ok, DIMS[i] // 2, pow2(-exp_u, ACC),
                                 pow2(-exp_v, ACC), stride_d, PARTNERS_PAD, HALF_BLOCKS[i], ACC)
        _store_prefix_scores(uu_total, vv_total, uv_total, cross, exp_u, exp_v, cos_ptr, angle_ptr, norms_ptr,
                             scales_ptr, cross_ptr, (i * G + group) * (K - 1), (i * G + group) * K, partner,
                             partner_ok, WITH_ANGLE, ACC, EPS)


@triton.jit
def _one_read_prefix_bwd_kernel(
    x_ptr,  # [G, K, D], any strides
    dx_ptr,  # [G, K, D] out, contiguous, x's dtype
    grad_cos_ptr,  # [k, G, K-1] contiguous, compute dtype
    grad_angle_ptr,  # [k, G, K-1] contiguous (read only WITH_ANGLE)
    norms_ptr,  # [k, G, K] from forward
    scales_ptr,  # [k, G, K] from forward
    cos_ptr,  # [k, G, K-1] from forward
    cross_ptr,  # [k, G, K-1] from forward
    G,
    K,
    D,
    stride_g,
    stride_k,
    stride_d,
    DIMS: tl.constexpr,
    SLICE_BLOCKS: tl.constexpr,
    TAIL_BLOCK: tl.constexpr,  # the vector width of the columns past d_k (zeros)
    N_DIMS: tl.constexpr,
    WITH_ANGLE: tl.constexpr,
    PARTNERS_PAD: tl.constexpr,
    ACC: tl.constexpr,
    EPS: tl.constexpr,
):
    group, partner, partner_ok, anchor_ptr, partner_ptr = _group_rows(x_ptr, stride_g, stride_k, K, PARTNERS_PAD)
    d_anchor_ptr = dx_ptr + group * K * D  # dx is contiguous
    d_partner_ptr = d_anchor_ptr + (partner + 1).to(tl.int64)[:, None] * D
    out_ty = dx_ptr.dtype.element_ty
    lo = 0
    for s in tl.static_range(N_DIMS):
        norm_in = (s * G + group) * K
        su_s = tl.load(scales_ptr + norm_in).to(ACC)
        sv_s = tl.load(scales_ptr + norm_in + 1 + partner, mask=partner_ok, other=1.0).to(ACC)[:, None]
        offs = tl.arange(0, SLICE_BLOCKS[s])
        for start in range(lo, DIMS[s], SLICE_BLOCKS[s]):
            cols = (start + offs).to(tl.int64)
            col_ok = cols < DIMS[s]
            tile_ok = partner_ok[:, None] & col_ok[None, :]
            u_raw, v_raw = _load_block(anchor_ptr, partner_ptr, cols, col_ok, tile_ok, stride_d, ACC)
            u = u_raw * su_s
            v = v_raw * sv_s
            along_sum = tl.zeros([PARTNERS_PAD, 1], dtype=ACC)  # A
            anchor_shrink_sum = tl.sum(tl.zeros([PARTNERS_PAD], dtype=ACC), axis=0)  # B
            partner_shrink_sum = tl.zeros([PARTNERS_PAD, 1], dtype=ACC)  # C
            # zeros_like: a shape list in a kernel takes constexprs only, and SLICE_BLOCKS[s] is a plain int
            du = tl.zeros_like(u)
            dv = tl.zeros_like(v)
            for i in tl.static_range(s, N_DIMS):
                along_2d, rotated_2d, anchor_shrink, partner_shrink_2d, su, sv_2d = _pair_coefficients(
                    grad_cos_ptr, grad_angle_ptr, norms_ptr, scales_ptr, cos_ptr, cross_ptr,
                    (i * G + group) * (K - 1) + partner, (i * G + group) * K, partner, partner_ok, WITH_ANGLE,
                    PARTNERS_PAD, ACC, EPS)
                r = su / su_s
                t = sv_2d / sv_s
                along_sum += (r * t) * along_2d
                anchor_shrink_sum += (r * r) * anchor_shrink
                partner_shrink_sum += (t * t) * partner_shrink_2d
                if WITH_ANGLE:
                    # the rotated halves, as in pair_scores._prefix_pair_scores_bwd_kernel, on prefix i's scaled
                    # twins; r and t bring them to slice s's frame
                    half = DIMS[i] // 2
                    first = cols < half
                    twin = tl.where(first, cols + half, cols - half)
                    twin_u, twin_v = _load_block(anchor_ptr, partner_ptr, twin, col_ok, tile_ok, stride_d, ACC)
                    sign = tl.where(first, -1.0, 1.0).to(ACC)
                    du += (r * sign) * tl.sum(rotated_2d * (twin_v * sv_2d), axis=0)
                    dv -= t * (sign[None, :] * rotated_2d * (twin_u * su)[None, :])
            du += tl.sum(along_sum * v, axis=0) - anchor_shrink_sum * u
            dv += along_sum * u[None, :] - partner_shrink_sum * v
            tl.store(d_anchor_ptr + cols, (du * su_s).to(out_ty), mask=col_ok)
            tl.store(d_partner_ptr + cols[None, :], (dv * sv_s).to(out_ty), mask=tile_ok)
        lo = DIMS[s]
    # the columns no prefix contains
    tail = tl.arange(0, TAIL_BLOCK)
    for start in range(lo, D, TAIL_BLOCK):
        cols = (start + tail).to(tl.int64)
        col_ok = cols < D
        tl.store(d_anchor_ptr + cols, tl.zeros([TAIL_BLOCK], dtype=out_ty), mask=col_ok)
        tl.store(d_partner_ptr + cols[None, :], tl.zeros([PARTNERS_PAD, TAIL_BLOCK], dtype=out_ty),
                 mask=partner_ok[:, None] & col_ok[None, :])


# The backward holds a slice block of the rows, their twins and both gradients at once: at most 512 lanes (the
# single-width backward's with the angle at D = 768) keep K = 3 at D = 4,096 below 255 registers.
_MAX_BWD_BLOCK = 512


def _vector(width: int, max_block: int = _MAX_BLOCK) -> int:
    """The vector width (lanes) of a sweep over `width` columns: the next power of two, 16 to max_block."""
    return max(16, min(triton.next_power_of_2(max(width, 1)), max_block))


def launch_config(k: int, d: int, dims: tuple[int, ...], with_angle: bool, max_block: int = _MAX_BLOCK) -> dict:
    """Per-slice and per-half vector widths, partners padded, warps (8 from 1024 lanes, as pair_scores.py)."""
    bounds = (0, *dims)
    slice_blocks = tuple(_vector(hi - lo, max_block) for lo, hi in zip(bounds, bounds[1:]))
    half_blocks = tuple(_vector(width // 2, max_block) for width in dims) if with_angle else tuple(16 for _ in dims)
    return {"PARTNERS_PAD": triton.next_power_of_2(k - 1), "SLICE_BLOCKS": slice_blocks, "HALF_BLOCKS": half_blocks,
            "TAIL_BLOCK": _vector(d - dims[-1], max_block),
            "num_warps": 8 if max(slice_blocks + half_blocks) >= 1024 else 4}


class OneReadPrefixPairScoresFunction(torch.autograd.Function):
    """pair_scores on every prefix x[..., :d_i] in one read of each row; outputs [k, G, K-1]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, with_angle: bool, dims: tuple[int, ...]):
        groups, k, d = x.shape
        cos, angle, norms, scales, cross = _new_scores((len(dims), groups), x, with_angle)
        cfg = launch_config(k, d, dims, with_angle)
        cfg.pop("TAIL_BLOCK")
        if groups > 0:
            _one_read_prefix_fwd_kernel[(groups,)](
                x, cos, angle, norms, scales, cross, groups, k, x.stride(0), x.stride(1), x.stride(2),
                DIMS=tuple(dims), N_DIMS=len(dims), WITH_ANGLE=with_angle, ACC=acc_dtype_of(x.dtype), EPS=NORM_EPS,
                **cfg,
            )
        ctx.dims = tuple(dims)
        return _save_for_backward(ctx, x, norms, scales, cos, cross, angle, with_angle)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_cos: torch.Tensor, grad_angle: torch.Tensor):
        x, norms, scales, cos, cross = ctx.saved_tensors
        groups, k, d = x.shape
        grad_cos, grad_angle, with_angle = _upstream(ctx, cos, grad_cos, grad_angle)
        dx = new_output((groups, k, d), x.dtype, x.device)
        cfg = launch_config(k, d, ctx.dims, with_angle, _MAX_BWD_BLOCK)
        cfg.pop("HALF_BLOCKS")
        if groups > 0:
            _one_read_prefix_bwd_kernel[(groups,)](
                x, dx, grad_cos, grad_angle, norms, scales, cos, cross, groups, k, d, x.stride(0), x.stride(1),
                x.stride(2),
                DIMS=ctx.dims, N_DIMS=len(ctx.dims), WITH_ANGLE=with_angle, ACC=acc_dtype_of(x.dtype), EPS=NORM_EPS,
                **cfg,
            )
        return dx, None, None


def pair_scores(x: torch.Tensor, with_angle: bool, dims) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, angle) of every prefix x[..., :d] (d in dims), outputs [k, G, K-1]; see angle_kernels.dispatch for the
    contract (pair_scores_paths.py calls it for the dims calls it sends here)."""
    return OneReadPrefixPairScoresFunction.apply(x, with_angle, tuple(dims))


# ----------------------------------------------------------------------------------------------------------
# The specialisations CI compiles for sm_90 without a GPU (triton_ops._compile_check)
# ----------------------------------------------------------------------------------------------------------
def compile_cases(full: bool) -> list[CompileCase]:
    """The Matryoshka widths of a 768-wide model (k = 5): fp32 and bf16 inputs, K = 2 and 3, with and without the
    angle; full=True: every combination and fp64."""
    variants = [("fp32", 2, True), ("bf16", 3, True), ("bf16", 2, False)]
    if full:
        variants = [(x, k, a) for x in ("fp32", "bf16", "fp64") for k in (2, 3) for a in (True, False)]
    dims = (64, 128, 256, 512, 768)
    cases = []
    for x_dtype, k, with_angle in variants:
        acc = tl.float64 if x_dtype == "fp64" else tl.float32
        scalars = "fp64" if x_dtype == "fp64" else "fp32"
        label = f"x={x_dtype} K={k} angle={with_angle} dims={dims}"
        for kernel, max_block, pointers in ((_one_read_prefix_fwd_kernel, _MAX_BLOCK, {"x_ptr": x_dtype}),
                                            (_one_read_prefix_bwd_kernel, _MAX_BWD_BLOCK,
                                             {"x_ptr": x_dtype, "dx_ptr": x_dtype})):
            config = launch_config(k, dims[-1], dims, with_angle, max_block)
            warps = config.pop("num_warps")
            config.pop("TAIL_BLOCK" if kernel is _one_read_prefix_fwd_kernel else "HALF_BLOCKS")  # the other's
            constexprs = dict(DIMS=dims, N_DIMS=len(dims), WITH_ANGLE=with_angle, ACC=acc, EPS=NORM_EPS, **config)
            cases.append(CompileCase(kernel, label, scalars, constexprs, warps, pointers=pointers))
    return cases

"""Pair scores as one fused Triton pass: the cosine and the AnglE complex-division score of every pair.

x is [G, K, D] with arbitrary strides (zigzag rows are y_pred.view(N, 2, D), format C is x.view(B, 3, D)).
Pair k of group g is (u, v) = (x[g, 0], x[g, k]), k = 1 .. K-1; a, b are the halves of u, c, d those of v:

    cos   = u.v / P                       P = max(|u|, eps) * max(|v|, eps)
    angle = (u.v + b.c - a.d) / P = cos + w,   w = (b.c - a.d) / P

Backward, per pair, with gc, ga the upstream gradients (the |.|^2 terms vanish where a norm was clamped):

    du = [(gc + ga) v + ga (-d, c)] / P - [(gc + ga) cos + ga w] u / |u|^2
    dv = [(gc + ga) u + ga (b, -a)] / P - [(gc + ga) cos + ga w] v / |v|^2

The anchor u of a group with K = 3 accumulates the terms of both its pairs.

The floor. This op is pure bandwidth: forward reads the G*K*D elements of x once and writes O(G*K) scalars;
backward reads x once more and writes dx (G*K*D elements) once. At bf16, 1M pairs of D = 768:
forward 3.1 GB, backward 6.3 GB: 0.7 ms + 1.5 ms at 4.3 TB/s. FLOPs (about 8 per element forward, 12
backward) are two orders of magnitude below the H200's rate and do not matter. dx is allocated uninitialised
(`_common.new_output`): filling it first would add a full write, half the backward's floor again.

Kernel shape. One program per group: it streams the anchor row and its K-1 partner rows (a [K-1 padded, BLOCK]
tile) through registers in BLOCK-element chunks (the halves a, b, c, d are read at the same offsets so the
angle's cross term needs no shuffle), keeps elementwise partial sums and reduces them once at the end. For
the backward it reads the few per-pair scalars the forward saved (raw norms, cos, w), so dx is one pass:
no second sweep over x to recompute norms. Each program moves 2*D elements (3 KB at D = 768 bf16); a
million programs give the H200's 132 SMs plenty of independent loads in flight. BLOCK is the next power of
two of the swept length (D/2 with the angle, D without) capped at 1024, so D = 768 takes a single iteration
(25% of lanes idle, no extra bytes); num_warps = 4 up to 512 elements, 8 for 1024 (at most 8 elements per
thread per live vector). Compiled for sm_90 at D = 768: 32-64 registers, no spills, at most 64 bytes of
shared memory (the final reductions), so occupancy is limited by neither.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from ..contract import NORM_EPS, compute_dtype
from ._common import CompileCase, acc_dtype_of, new_output

_MAX_BLOCK = 1024


@triton.jit
def _load_block(anchor_ptr, partner_ptr, cols, col_ok, tile_ok, stride_d, ACC: tl.constexpr):
    """Columns `cols` of the anchor ([BLOCK]) and of its partners ([PARTNERS_PAD, BLOCK]), in ACC."""
    anchor = tl.load(anchor_ptr + cols * stride_d, mask=col_ok, other=0.0).to(ACC)
    partners = tl.load(partner_ptr + cols[None, :] * stride_d, mask=tile_ok, other=0.0).to(ACC)
    return anchor, partners


@triton.jit
def _pair_scores_fwd_kernel(
    x_ptr,  # [G, K, D], any strides
    cos_ptr,  # [G, K-1] out, compute dtype
    angle_ptr,  # [G, K-1] out (written only WITH_ANGLE)
    norms_ptr,  # [G, K] out: raw (unclamped) row norms, for backward
    cross_ptr,  # [G, K-1] out: w = (b.c - a.d) / P, for backward
    K,
    D,
    HALF,
    stride_g,
    stride_k,
    stride_d,
    WITH_ANGLE: tl.constexpr,
    PARTNERS_PAD: tl.constexpr,  # next power of two >= K - 1
    BLOCK: tl.constexpr,
    ACC: tl.constexpr,  # tl.float32 or tl.float64
    EPS: tl.constexpr,
):
    group = tl.program_id(0).to(tl.int64)
    anchor_ptr = x_ptr + group * stride_g
    partner = tl.arange(0, PARTNERS_PAD)
    partner_ok = partner < K - 1
    partner_ptr = anchor_ptr + (partner + 1).to(tl.int64)[:, None] * stride_k  # [P, 1]
    offs = tl.arange(0, BLOCK)

    uu = tl.zeros([BLOCK], dtype=ACC)
    vv = tl.zeros([PARTNERS_PAD, BLOCK], dtype=ACC)
    uv = tl.zeros([PARTNERS_PAD, BLOCK], dtype=ACC)
    cross = tl.zeros([PARTNERS_PAD, BLOCK], dtype=ACC)
    if WITH_ANGLE:
        # Sweep the halves together: a, b = u[i], u[i + D/2]; c, d = v[i], v[i + D/2].
        for start in range(0, HALF, BLOCK):
            cols = (start + offs).to(tl.int64)
            col_ok = cols < HALF
            tile_ok = partner_ok[:, None] & col_ok[None, :]
            a, c = _load_block(anchor_ptr, partner_ptr, cols, col_ok, tile_ok, stride_d, ACC)
            b, d = _load_block(anchor_ptr, partner_ptr, cols + HALF, col_ok, tile_ok, stride_d, ACC)
            uu += a * a + b * b
            vv += c * c + d * d
            uv += a[None, :] * c + b[None, :] * d
            cross += b[None, :] * c - a[None, :] * d
    else:
        for start in range(0, D, BLOCK):
            cols = (start + offs).to(tl.int64)
            col_ok = cols < D
            tile_ok = partner_ok[:, None] & col_ok[None, :]
            u, v = _load_block(anchor_ptr, partner_ptr, cols, col_ok, tile_ok, stride_d, ACC)
            uu += u * u
            vv += v * v
            uv += u[None, :] * v

    norm_u = tl.sqrt(tl.sum(uu, axis=0))
    norm_v = tl.sqrt(tl.sum(vv, axis=1))  # [P]
    inv_p = 1.0 / (tl.maximum(norm_u, EPS) * tl.maximum(norm_v, EPS))
    cos = tl.sum(uv, axis=1) * inv_p
    w = tl.sum(cross, axis=1) * inv_p

    pair_out = group * (K - 1) + partner
    tl.store(cos_ptr + pair_out, cos, mask=partner_ok)
    tl.store(cross_ptr + pair_out, w, mask=partner_ok)
    if WITH_ANGLE:
        tl.store(angle_ptr + pair_out, cos + w, mask=partner_ok)
    tl.store(norms_ptr + group * K, norm_u)
    tl.store(norms_ptr + group * K + 1 + partner, norm_v, mask=partner_ok)


@triton.jit
def _pair_scores_bwd_kernel(
    x_ptr,  # [G, K, D], any strides
    dx_ptr,  # [G, K, D] out, contiguous, x's dtype
    grad_cos_ptr,  # [G, K-1] contiguous, compute dtype
    grad_angle_ptr,  # [G, K-1] contiguous (read only WITH_ANGLE)
    norms_ptr,  # [G, K] from forward
    cos_ptr,  # [G, K-1] from forward
    cross_ptr,  # [G, K-1] from forward
    K,
    D,
    HALF,
    stride_g,
    stride_k,
    stride_d,
    WITH_ANGLE: tl.constexpr,
    PARTNERS_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
    ACC: tl.constexpr,
    EPS: tl.constexpr,
):
    group = tl.program_id(0).to(tl.int64)
    anchor_ptr = x_ptr + group * stride_g
    partner = tl.arange(0, PARTNERS_PAD)
    partner_ok = partner < K - 1
    partner_ptr = anchor_ptr + (partner + 1).to(tl.int64)[:, None] * stride_k
    d_anchor_ptr = dx_ptr + group * K * D
    d_partner_ptr = d_anchor_ptr + (partner + 1).to(tl.int64)[:, None] * D

    # Per-pair coefficients (padded partners get 0 everywhere, so they add nothing to the anchor).
    pair_in = group * (K - 1) + partner
    gc = tl.load(grad_cos_ptr + pair_in, mask=partner_ok, other=0.0).to(ACC)
    if WITH_ANGLE:
        ga = tl.load(grad_angle_ptr + pair_in, mask=partner_ok, other=0.0).to(ACC)
    else:
        ga = tl.zeros([PARTNERS_PAD], dtype=ACC)
    cos = tl.load(cos_ptr + pair_in, mask=partner_ok, other=0.0).to(ACC)
    w = tl.load(cross_ptr + pair_in, mask=partner_ok, other=0.0).to(ACC)
    norm_u = tl.load(norms_ptr + group * K).to(ACC)
    norm_v = tl.load(norms_ptr + group * K + 1 + partner, mask=partner_ok, other=1.0).to(ACC)
    inv_u = 1.0 / tl.maximum(norm_u, EPS)
    inv_v = 1.0 / tl.maximum(norm_v, EPS)
    # d(1/max(|x|, eps))/dx = -x/|x|^3 only where the norm was not clamped.
    radial_u = tl.where(norm_u > EPS, inv_u * inv_u, 0.0)
    radial_v = tl.where(norm_v > EPS, inv_v * inv_v, 0.0)
    g_sum = gc + ga
    along = g_sum * inv_u * inv_v  # coefficient of the other row
    rotated = ga * inv_u * inv_v  # coefficient of the other row's rotated halves
    shrink = g_sum * cos + ga * w  # coefficient of the row's own radial term
    anchor_shrink = tl.sum(shrink, axis=0) * radial_u
    partner_shrink = shrink * radial_v
    along_2d = along[:, None]
    rotated_2d = rotated[:, None]
    partner_shrink_2d = partner_shrink[:, None]

    offs = tl.arange(0, BLOCK)
    if WITH_ANGLE:
        for start in range(0, HALF, BLOCK):
            cols = (start + offs).to(tl.int64)
            col_ok = cols < HALF
            tile_ok = partner_ok[:, None] & col_ok[None, :]
            a, c = _load_block(anchor_ptr, partner_ptr, cols, col_ok, tile_ok, stride_d, ACC)
            b, d = _load_block(anchor_ptr, partner_ptr, cols + HALF, col_ok, tile_ok, stride_d, ACC)
            da = tl.sum(along_2d * c - rotated_2d * d, axis=0) - anchor_shrink * a
            db = tl.sum(along_2d * d + rotated_2d * c, axis=0) - anchor_shrink * b
            dc = along_2d * a[None, :] + rotated_2d * b[None, :] - partner_shrink_2d * c
            dd = along_2d * b[None, :] - rotated_2d * a[None, :] - partner_shrink_2d * d
            out_ty = dx_ptr.dtype.element_ty
            tl.store(d_anchor_ptr + cols, da.to(out_ty), mask=col_ok)
            tl.store(d_anchor_ptr + cols + HALF, db.to(out_ty), mask=col_ok)
            tl.store(d_partner_ptr + cols[None, :], dc.to(out_ty), mask=tile_ok)
            tl.store(d_partner_ptr + (cols + HALF)[None, :], dd.to(out_ty), mask=tile_ok)
    else:
        for start in range(0, D, BLOCK):
            cols = (start + offs).to(tl.int64)
            col_ok = cols < D
            tile_ok = partner_ok[:, None] & col_ok[None, :]
            u, v = _load_block(anchor_ptr, partner_ptr, cols, col_ok, tile_ok, stride_d, ACC)
            du = tl.sum(along_2d * v, axis=0) - anchor_shrink * u
            dv = along_2d * u[None, :] - partner_shrink_2d * v
            out_ty = dx_ptr.dtype.element_ty
            tl.store(d_anchor_ptr + cols, du.to(out_ty), mask=col_ok)
            tl.store(d_partner_ptr + cols[None, :], dv.to(out_ty), mask=tile_ok)


def launch_config(k: int, d: int, with_angle: bool) -> dict:
    """Block size and warps for one group per program (see the module docstring for the reasoning)."""
    swept = d // 2 if with_angle else d
    block = min(triton.next_power_of_2(max(swept, 1)), _MAX_BLOCK)
    block = max(block, 16)
    return dict(
        PARTNERS_PAD=triton.next_power_of_2(k - 1),
        BLOCK=block,
        num_warps=8 if block >= 1024 else 4,
    )


class PairScoresFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, with_angle: bool):
        groups, k, d = x.shape
        dtype = compute_dtype(x.dtype)
        cos = new_output((groups, k - 1), dtype, x.device)
        cross = new_output((groups, k - 1), dtype, x.device)
        norms = new_output((groups, k), dtype, x.device)
        if with_angle:
            angle = new_output((groups, k - 1), dtype, x.device)
        else:  # zeros by contract: the kernel does not write it
            angle = torch.zeros((groups, k - 1), dtype=dtype, device=x.device)
        cfg = launch_config(k, d, with_angle)
        if groups > 0:
            _pair_scores_fwd_kernel[(groups,)](
                x, cos, angle, norms, cross, k, d, d // 2, x.stride(0), x.stride(1), x.stride(2),
                WITH_ANGLE=with_angle, ACC=acc_dtype_of(x.dtype), EPS=NORM_EPS, **cfg,
            )
        ctx.save_for_backward(x, norms, cos, cross)
        ctx.with_angle = with_angle
        if not with_angle:
            ctx.mark_non_differentiable(angle)
        return cos, angle

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_cos: torch.Tensor, grad_angle: torch.Tensor):
        x, norms, cos, cross = ctx.saved_tensors
        groups, k, d = x.shape
        dtype = cos.dtype
        grad_cos = torch.zeros_like(cos) if grad_cos is None else grad_cos.to(dtype).contiguous()
        with_angle = ctx.with_angle and grad_angle is not None
        grad_angle = grad_angle.to(dtype).contiguous() if with_angle else grad_cos
        dx = new_output((groups, k, d), x.dtype, x.device)
        cfg = launch_config(k, d, with_angle)
        if groups > 0:
            _pair_scores_bwd_kernel[(groups,)](
                x, dx, grad_cos, grad_angle, norms, cos, cross, k, d, d // 2,
                x.stride(0), x.stride(1), x.stride(2),
                WITH_ANGLE=with_angle, ACC=acc_dtype_of(x.dtype), EPS=NORM_EPS, **cfg,
            )
        return dx, None


def pair_scores(x: torch.Tensor, with_angle: bool, dims=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, angle) of every pair of x [G, K, D]; see angle_kernels.dispatch for the contract."""
    return PairScoresFunction.apply(x, with_angle)


# ----------------------------------------------------------------------------------------------------------
# The specialisations CI compiles for sm_90 without a GPU (triton_ops._compile_check)
# ----------------------------------------------------------------------------------------------------------
def compile_cases(full: bool) -> list[CompileCase]:
    """CI: fp32 and bf16 inputs, K = 2 and 3, with and without the angle; full=True: every combination and fp64."""
    variants = [("fp32", 2, True), ("bf16", 3, True), ("bf16", 2, False)]
    if full:
        variants = [(x, k, a) for x in ("fp32", "bf16", "fp64") for k in (2, 3) for a in (True, False)]
    cases = []
    for x_dtype, k, with_angle in variants:
        config = launch_config(k, 768, with_angle)
        warps = config.pop("num_warps")
        acc = tl.float64 if x_dtype == "fp64" else tl.float32
        constexprs = dict(WITH_ANGLE=with_angle, ACC=acc, EPS=NORM_EPS, **config)
        label = f"x={x_dtype} K={k} angle={with_angle} D=768"
        scalars = "fp64" if x_dtype == "fp64" else "fp32"
        cases.append(CompileCase(_pair_scores_fwd_kernel, label, scalars, constexprs, warps,
                                 pointers={"x_ptr": x_dtype}))
        cases.append(CompileCase(_pair_scores_bwd_kernel, label, scalars, constexprs, warps,
                                 pointers={"x_ptr": x_dtype, "dx_ptr": x_dtype}))
    return cases

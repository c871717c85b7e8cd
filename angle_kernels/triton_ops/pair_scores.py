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
thread per live vector). Compiled for sm_90 at D = 768 as a launch specialises it (contiguous rows, D a multiple
of 16; triton 3.9, `_compile_check --full`): 28-94 registers (fp64 forward up to 122), no spills, at most 4 KB of
shared memory, so occupancy is limited by neither.

Huge rows. Finite rows whose squared norms overflow the accumulator (float32/bf16 rows around 1.8e19, float64
around 1.3e154) are scaled by a power of two per row in the same sweep that reads them (_common's row scaling):
each chunk's largest magnitude may raise the row's running exponent, and the partial sums gathered at the old
scale are multiplied by 2^(old - new), as an online softmax rescales its sum. The forward saves the scaled rows'
norms and the scales; the backward multiplies each loaded element by its row's scale, applies the formulas above
(the gradient with respect to the scaled rows) and multiplies the result by the scale again (dL/dx = s dL/dx_s).
Ordinary rows (largest magnitude below 2) have scale 1 and compute bit for bit as unscaled. The price, no extra
pass: per element about 2 FLOPs forward (an abs and a max for the chunk's largest magnitude, a multiply by the
scale) plus the rescale of the partial sums once per chunk, and 2 multiplies per element backward: next to nothing
in a bandwidth-bound op. Registers (sm_90, D = 768): forward 40-79, backward 32-88, prefix backward up to 246.

Nested prefixes (dims = d_1 < ... < d_k, Matryoshka): outputs [k, G, K-1], prefix i being the scores of
x[..., :d_i]. The floor is the same bytes as one width: read x once forward, once backward, write dx once; the
per-prefix outputs are O(k * G * K) scalars. Forward, one program per group: without the angle, the sweep walks
the slices [d_{i-1}, d_i) in order with running partial sums and stores prefix i's scores after its slice (one
read of the rows); with the angle, the halves of each prefix pair feature j with j + d_i/2, so each prefix
sweeps its own first d_i/2 columns (about sum(d_i) elements read instead of D, but the group's rows, a few KB,
stay in L1/L2: DRAM still sees one read). Backward writes each column block of dx once: for every prefix that
contains the block it adds the prefix's terms (its per-pair coefficients from the saved norms, cos and w; the
angle's rotated terms read the twin columns c +- d_i/2, again cache hits), and columns past d_k get 0. The
widths are a constexpr tuple: the loops over prefixes unroll, and each distinct dims compiles once per process
(a run uses one; sampled dims, sentence-transformers' n_dims_per_step, at most 2^k - 1 subsets). Compiled for sm_90
with dims (64, 128, 256, 512, 768), specialised as launched: forward 32-59 registers; backward 32-236 with its
block capped at 128 (236 for K = 3 with the angle: two programs per SM; fp64 255 with a 40-byte spill).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from ..contract import NORM_EPS, compute_dtype
from ._common import CompileCase, acc_dtype_of, new_output, pow2, raise_exponent, scaled_eps

_MAX_BLOCK = 1024
# The nested backward keeps a column block of every prefix's terms and twin columns live at once: smaller blocks
# (more loop iterations) keep it in registers (see the module docstring).
_MAX_PREFIX_BWD_BLOCK = 128

FEATURES = ("dims",)  # the optional features this op implements (contract.OPTIONAL_FEATURES)
# The code paths a call can take, each verified on GPUs on its own (angle_kernels.verified).
PATHS = ("full", "dims")


def code_path(x, with_angle, dims=None) -> str:
    """The one of PATHS that computes this call: the prefix kernels with dims, else the single-width ones."""
    return "full" if dims is None else "dims"



@triton.jit
def _group_rows(x_ptr, stride_g, stride_k, K, PARTNERS_PAD: tl.constexpr):
    """This program's group: its index, the partner slots (1 .. K-1, padded to PARTNERS_PAD) and which are real,
    and the pointers to the anchor row ([1]) and the partner rows ([P, 1])."""
    group = tl.program_id(0).to(tl.int64)
    anchor_ptr = x_ptr + group * stride_g
    partner = tl.arange(0, PARTNERS_PAD)
    partner_ok = partner < K - 1
    partner_ptr = anchor_ptr + (partner + 1).to(tl.int64)[:, None] * stride_k
    return group, partner, partner_ok, anchor_ptr, partner_ptr


@triton.jit
def _load_block(anchor_ptr, partner_ptr, cols, col_ok, tile_ok, stride_d, ACC: tl.constexpr):
    """Columns `cols` of the anchor ([BLOCK]) and of its partners ([PARTNERS_PAD, BLOCK]), in ACC."""
    anchor = tl.load(anchor_ptr + cols * stride_d, mask=col_ok, other=0.0).to(ACC)
    partners = tl.load(partner_ptr + cols[None, :] * stride_d, mask=tile_ok, other=0.0).to(ACC)
    return anchor, partners


@triton.jit
def _sweep_halves(anchor_ptr, partner_ptr, partner_ok, half, stride_d, uu, vv, uv, cross, exp_u, exp_v,
                  BLOCK: tl.constexpr, ACC: tl.constexpr):
    """Accumulate the elementwise partial sums of the first 2 * half features of the scaled rows, halves swept
    together: a, b = u[i], u[i + half]; c, d = v[i], v[i + half]. exp_u (scalar) and exp_v ([P]) are the rows'
    running scale exponents (_common.raise_exponent): a chunk that raises one rescales what was summed before."""
    offs = tl.arange(0, BLOCK)
    for start in range(0, half, BLOCK):
        cols = (start + offs).to(tl.int64)
        col_ok = cols < half
        tile_ok = partner_ok[:, None] & col_ok[None, :]
        a, c = _load_block(anchor_ptr, partner_ptr, cols, col_ok, tile_ok, stride_d, ACC)
        b, d = _load_block(anchor_ptr, partner_ptr, cols + half, col_ok, tile_ok, stride_d, ACC)
        exp_u, fu, su = raise_exponent(exp_u, tl.max(tl.maximum(tl.abs(a), tl.abs(b)), axis=0), ACC)
        exp_v, fv, sv = raise_exponent(exp_v, tl.max(tl.maximum(tl.abs(c), tl.abs(d)), axis=1), ACC)
        fuv = (fu * fv)[:, None]
        uu = uu * (fu * fu)
        vv = vv * (fv * fv)[:, None]
        uv = uv * fuv
        cross = cross * fuv
        a = a * su
        b = b * su
        c = c * sv[:, None]
        d = d * sv[:, None]
        uu += a * a + b * b
        vv += c * c + d * d
        uv += a[None, :] * c + b[None, :] * d
        cross += b[None, :] * c - a[None, :] * d
    return uu, vv, uv, cross, exp_u, exp_v


@triton.jit
def _sweep_columns(anchor_ptr, partner_ptr, partner_ok, lo, hi, stride_d, uu, vv, uv, exp_u, exp_v,
                   BLOCK: tl.constexpr, ACC: tl.constexpr):
    """Accumulate the elementwise partial sums of the features [lo, hi) of the scaled rows (no angle cross terms);
    exp_u, exp_v: the running scale exponents, as in _sweep_halves."""
    offs = tl.arange(0, BLOCK)
    for start in range(lo, hi, BLOCK):
        cols = (start + offs).to(tl.int64)
        col_ok = cols < hi
        tile_ok = partner_ok[:, None] & col_ok[None, :]
        u, v = _load_block(anchor_ptr, partner_ptr, cols, col_ok, tile_ok, stride_d, ACC)
        exp_u, fu, su = raise_exponent(exp_u, tl.max(tl.abs(u), axis=0), ACC)
        exp_v, fv, sv = raise_exponent(exp_v, tl.max(tl.abs(v), axis=1), ACC)
        uu = uu * (fu * fu)
        vv = vv * (fv * fv)[:, None]
        uv = uv * (fu * fv)[:, None]
        u = u * su
        v = v * sv[:, None]
        uu += u * u
        vv += v * v
        uv += u[None, :] * v
    return uu, vv, uv, exp_u, exp_v


@triton.jit
def _store_scores(uu, vv, uv, cross, exp_u, exp_v, cos_ptr, angle_ptr, norms_ptr, scales_ptr, cross_ptr, pair_out,
                  norm_out, partner, partner_ok, WITH_ANGLE: tl.constexpr, ACC: tl.constexpr, EPS: tl.constexpr):
    """Reduce the partial sums and store cos, w = (b.c - a.d) / P, cos + w (WITH_ANGLE) of the pairs at
    pair_out + partner, and the scaled rows' norms and their scales, of the anchor (norm_out) and partners
    (norm_out + 1 + partner)."""
    su = pow2(-exp_u, ACC)
    sv = pow2(-exp_v, ACC)
    norm_u = tl.sqrt(tl.sum(uu, axis=0))
    norm_v = tl.sqrt(tl.sum(vv, axis=1))  # [P]
    inv_p = 1.0 / (tl.maximum(norm_u, scaled_eps(su, EPS, ACC)) * tl.maximum(norm_v, scaled_eps(sv, EPS, ACC)))
    cos = tl.sum(uv, axis=1) * inv_p
    w = tl.sum(cross, axis=1) * inv_p
    tl.store(cos_ptr + pair_out + partner, cos, mask=partner_ok)
    tl.store(cross_ptr + pair_out + partner, w, mask=partner_ok)
    if WITH_ANGLE:
        tl.store(angle_ptr + pair_out + partner, cos + w, mask=partner_ok)
    tl.store(norms_ptr + norm_out, norm_u)
    tl.store(norms_ptr + norm_out + 1 + partner, norm_v, mask=partner_ok)
    tl.store(scales_ptr + norm_out, su)
    tl.store(scales_ptr + norm_out + 1 + partner, sv, mask=partner_ok)


@triton.jit
def _empty_sums(PARTNERS_PAD: tl.constexpr, BLOCK: tl.constexpr, ACC: tl.constexpr):
    """(uu, vv, uv, cross, exp_u, exp_v) before the first chunk: zero sums, scale exponents 0 (scale 1)."""
    return (tl.zeros([BLOCK], dtype=ACC), tl.zeros([PARTNERS_PAD, BLOCK], dtype=ACC),
            tl.zeros([PARTNERS_PAD, BLOCK], dtype=ACC), tl.zeros([PARTNERS_PAD, BLOCK], dtype=ACC),
            tl.max(tl.zeros([PARTNERS_PAD], dtype=tl.int32), axis=0), tl.zeros([PARTNERS_PAD], dtype=tl.int32))


@triton.jit
def _pair_scores_fwd_kernel(
    x_ptr,  # [G, K, D], any strides
    cos_ptr,  # [G, K-1] out, compute dtype
    angle_ptr,  # [G, K-1] out (written only WITH_ANGLE)
    norms_ptr,  # [G, K] out: norms of the scaled rows (unclamped), for backward
    scales_ptr,  # [G, K] out: the rows' scales (powers of two), for backward
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
    group, partner, partner_ok, anchor_ptr, partner_ptr = _group_rows(x_ptr, stride_g, stride_k, K, PARTNERS_PAD)

    uu, vv, uv, cross, exp_u, exp_v = _empty_sums(PARTNERS_PAD, BLOCK, ACC)
    if WITH_ANGLE:
        uu, vv, uv, cross, exp_u, exp_v = _sweep_halves(anchor_ptr, partner_ptr, partner_ok, HALF, stride_d, uu, vv,
                                                        uv, cross, exp_u, exp_v, BLOCK, ACC)
    else:
        uu, vv, uv, exp_u, exp_v = _sweep_columns(anchor_ptr, partner_ptr, partner_ok, 0, D, stride_d, uu, vv, uv,
                                                  exp_u, exp_v, BLOCK, ACC)
    _store_scores(uu, vv, uv, cross, exp_u, exp_v, cos_ptr, angle_ptr, norms_ptr, scales_ptr, cross_ptr,
                  group * (K - 1), group * K, partner, partner_ok, WITH_ANGLE, ACC, EPS)


@triton.jit
def _pair_coefficients(grad_cos_ptr, grad_angle_ptr, norms_ptr, scales_ptr, cos_ptr, cross_ptr, pair_in, norm_in,
                       partner, partner_ok, WITH_ANGLE: tl.constexpr, PARTNERS_PAD: tl.constexpr, ACC: tl.constexpr,
                       EPS: tl.constexpr):
    """The per-pair coefficients of the backward formulas on the scaled rows (module docstring), from the
    forward's saved norms, scales, cos and w and the upstream gradients of the pairs at pair_in: (along [P, 1],
    rotated [P, 1], the anchor's radial coefficient (scalar), the partners' [P, 1], the anchor's scale (scalar),
    the partners' [P, 1]). Padded partners get 0 everywhere (scale 1), so they add nothing."""
    gc = tl.load(grad_cos_ptr + pair_in, mask=partner_ok, other=0.0).to(ACC)
    if WITH_ANGLE:
        ga = tl.load(grad_angle_ptr + pair_in, mask=partner_ok, other=0.0).to(ACC)
    else:
        ga = tl.zeros([PARTNERS_PAD], dtype=ACC)
    cos = tl.load(cos_ptr + pair_in, mask=partner_ok, other=0.0).to(ACC)
    w = tl.load(cross_ptr + pair_in, mask=partner_ok, other=0.0).to(ACC)
    norm_u = tl.load(norms_ptr + norm_in).to(ACC)
    norm_v = tl.load(norms_ptr + norm_in + 1 + partner, mask=partner_ok, other=1.0).to(ACC)
    su = tl.load(scales_ptr + norm_in).to(ACC)
    sv = tl.load(scales_ptr + norm_in + 1 + partner, mask=partner_ok, other=1.0).to(ACC)
    eps_u = scaled_eps(su, EPS, ACC)
    eps_v = scaled_eps(sv, EPS, ACC)
    inv_u = 1.0 / tl.maximum(norm_u, eps_u)
    inv_v = 1.0 / tl.maximum(norm_v, eps_v)
    # d(1/max(|x|, eps))/dx = -x/|x|^3 only where the norm was not clamped.
    radial_u = tl.where(norm_u > eps_u, inv_u * inv_u, 0.0)
    radial_v = tl.where(norm_v > eps_v, inv_v * inv_v, 0.0)
    g_sum = gc + ga
    along = g_sum * inv_u * inv_v  # coefficient of the other row
    rotated = ga * inv_u * inv_v  # coefficient of the other row's rotated halves
    shrink = g_sum * cos + ga * w  # coefficient of the row's own radial term
    anchor_shrink = tl.sum(shrink, axis=0) * radial_u
    partner_shrink = shrink * radial_v
    return along[:, None], rotated[:, None], anchor_shrink, partner_shrink[:, None], su, sv[:, None]


@triton.jit
def _pair_scores_bwd_kernel(
    x_ptr,  # [G, K, D], any strides
    dx_ptr,  # [G, K, D] out, contiguous, x's dtype
    grad_cos_ptr,  # [G, K-1] contiguous, compute dtype
    grad_angle_ptr,  # [G, K-1] contiguous (read only WITH_ANGLE)
    norms_ptr,  # [G, K] from forward (scaled rows)
    scales_ptr,  # [G, K] from forward
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
    group, partner, partner_ok, anchor_ptr, partner_ptr = _group_rows(x_ptr, stride_g, stride_k, K, PARTNERS_PAD)
    d_anchor_ptr = dx_ptr + group * K * D  # dx is contiguous
    d_partner_ptr = d_anchor_ptr + (partner + 1).to(tl.int64)[:, None] * D
    along_2d, rotated_2d, anchor_shrink, partner_shrink_2d, su, sv_2d = _pair_coefficients(
        grad_cos_ptr, grad_angle_ptr, norms_ptr, scales_ptr, cos_ptr, cross_ptr, group * (K - 1) + partner,
        group * K, partner, partner_ok, WITH_ANGLE, PARTNERS_PAD, ACC, EPS)

    # The formulas give dL/dx_s on the scaled rows x_s = s x; dL/dx is s times it.
    offs = tl.arange(0, BLOCK)
    out_ty = dx_ptr.dtype.element_ty
    if WITH_ANGLE:
        for start in range(0, HALF, BLOCK):
            cols = (start + offs).to(tl.int64)
            col_ok = cols < HALF
            tile_ok = partner_ok[:, None] & col_ok[None, :]
            a, c = _load_block(anchor_ptr, partner_ptr, cols, col_ok, tile_ok, stride_d, ACC)
            b, d = _load_block(anchor_ptr, partner_ptr, cols + HALF, col_ok, tile_ok, stride_d, ACC)
            a = a * su
            b = b * su
            c = c * sv_2d
            d = d * sv_2d
            da = (tl.sum(along_2d * c - rotated_2d * d, axis=0) - anchor_shrink * a) * su
            db = (tl.sum(along_2d * d + rotated_2d * c, axis=0) - anchor_shrink * b) * su
            dc = (along_2d * a[None, :] + rotated_2d * b[None, :] - partner_shrink_2d * c) * sv_2d
            dd = (along_2d * b[None, :] - rotated_2d * a[None, :] - partner_shrink_2d * d) * sv_2d
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
            u = u * su
            v = v * sv_2d
            du = (tl.sum(along_2d * v, axis=0) - anchor_shrink * u) * su
            dv = (along_2d * u[None, :] - partner_shrink_2d * v) * sv_2d
            tl.store(d_anchor_ptr + cols, du.to(out_ty), mask=col_ok)
            tl.store(d_partner_ptr + cols[None, :], dv.to(out_ty), mask=tile_ok)


# ----------------------------------------------------------------------------------------------------------
# Nested prefixes (dims): every prefix x[..., :d_i] of a group from one program
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _prefix_pair_scores_fwd_kernel(
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
    N_DIMS: tl.constexpr,
    WITH_ANGLE: tl.constexpr,
    PARTNERS_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
    ACC: tl.constexpr,
    EPS: tl.constexpr,
):
    group, partner, partner_ok, anchor_ptr, partner_ptr = _group_rows(x_ptr, stride_g, stride_k, K, PARTNERS_PAD)

    uu, vv, uv, cross, exp_u, exp_v = _empty_sums(PARTNERS_PAD, BLOCK, ACC)
    lo = 0
    for i in tl.static_range(N_DIMS):
        if WITH_ANGLE:  # the halves of each prefix pair other features: a sweep of its own (reads hit the cache)
            uu, vv, uv, cross, exp_u, exp_v = _empty_sums(PARTNERS_PAD, BLOCK, ACC)
            uu, vv, uv, cross, exp_u, exp_v = _sweep_halves(anchor_ptr, partner_ptr, partner_ok, DIMS[i] // 2,
                                                            stride_d, uu, vv, uv, cross, exp_u, exp_v, BLOCK, ACC)
        else:  # running sums: prefix i adds the slice [d_{i-1}, d_i) to prefix i - 1's (and its scale follows)
            uu, vv, uv, exp_u, exp_v = _sweep_columns(anchor_ptr, partner_ptr, partner_ok, lo, DIMS[i], stride_d,
                                                      uu, vv, uv, exp_u, exp_v, BLOCK, ACC)
            lo = DIMS[i]
        _store_scores(uu, vv, uv, cross, exp_u, exp_v, cos_ptr, angle_ptr, norms_ptr, scales_ptr, cross_ptr,
                      (i * G + group) * (K - 1), (i * G + group) * K, partner, partner_ok, WITH_ANGLE, ACC, EPS)


@triton.jit
def _prefix_pair_scores_bwd_kernel(
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
    N_DIMS: tl.constexpr,
    WITH_ANGLE: tl.constexpr,
    PARTNERS_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
    ACC: tl.constexpr,
    EPS: tl.constexpr,
):
    group, partner, partner_ok, anchor_ptr, partner_ptr = _group_rows(x_ptr, stride_g, stride_k, K, PARTNERS_PAD)
    d_anchor_ptr = dx_ptr + group * K * D  # dx is contiguous
    d_partner_ptr = d_anchor_ptr + (partner + 1).to(tl.int64)[:, None] * D

    # dx is written once: each column block adds the terms of every prefix that contains it (0 past d_k), each on
    # the rows scaled by that prefix's scales and multiplied by them at the end (dL/dx = s dL/dx_s)
    offs = tl.arange(0, BLOCK)
    out_ty = dx_ptr.dtype.element_ty
    for start in range(0, D, BLOCK):
        cols = (start + offs).to(tl.int64)
        col_ok = cols < D
        tile_ok = partner_ok[:, None] & col_ok[None, :]
        u_raw, v_raw = _load_block(anchor_ptr, partner_ptr, cols, col_ok, tile_ok, stride_d, ACC)
        du = tl.zeros([BLOCK], dtype=ACC)
        dv = tl.zeros([PARTNERS_PAD, BLOCK], dtype=ACC)
        for i in tl.static_range(N_DIMS):
            along_2d, rotated_2d, anchor_shrink, partner_shrink_2d, su, sv_2d = _pair_coefficients(
                grad_cos_ptr, grad_angle_ptr, norms_ptr, scales_ptr, cos_ptr, cross_ptr,
                (i * G + group) * (K - 1) + partner, (i * G + group) * K, partner, partner_ok, WITH_ANGLE,
                PARTNERS_PAD, ACC, EPS)
            inside = cols < DIMS[i]
            u = u_raw * su
            v = v_raw * sv_2d
            du_i = tl.sum(along_2d * v, axis=0) - anchor_shrink * u
            dv_i = along_2d * u[None, :] - partner_shrink_2d * v
            if WITH_ANGLE:
                # the rotated halves J: a column of the first half pairs with the one half a prefix further on
                # (anchor: -rotated * d, partner: +rotated * b), one of the second half with the one before it
                # (anchor: +rotated * c, partner: -rotated * a)
                half = DIMS[i] // 2
                first = cols < half
                twin = tl.where(first, cols + half, cols - half)
                twin_u, twin_v = _load_block(anchor_ptr, partner_ptr, twin, inside, tile_ok & inside[None, :],
                                             stride_d, ACC)
                twin_u = twin_u * su
                twin_v = twin_v * sv_2d
                sign = tl.where(first, -1.0, 1.0).to(ACC)
                du_i += sign * tl.sum(rotated_2d * twin_v, axis=0)
                dv_i -= sign[None, :] * rotated_2d * twin_u[None, :]
            du += tl.where(inside, du_i * su, 0.0)
            dv += tl.where(inside[None, :], dv_i * sv_2d, 0.0)
        tl.store(d_anchor_ptr + cols, du.to(out_ty), mask=col_ok)
        tl.store(d_partner_ptr + cols[None, :], dv.to(out_ty), mask=tile_ok)


def launch_config(k: int, d: int, with_angle: bool, max_block: int = _MAX_BLOCK) -> dict:
    """Block size and warps for one group per program (see the module docstring for the reasoning)."""
    swept = d // 2 if with_angle else d
    block = min(triton.next_power_of_2(max(swept, 1)), max_block)
    block = max(block, 16)
    return dict(
        PARTNERS_PAD=triton.next_power_of_2(k - 1),
        BLOCK=block,
        num_warps=8 if block >= 1024 else 4,
    )


def _new_scores(lead: tuple[int, ...], x: torch.Tensor, with_angle: bool):
    """(cos, angle, norms of the scaled rows, the rows' scales, w) outputs of shape lead + (K-1,) (norms and scales
    lead + (K,)) in the compute dtype, for the kernels to write; without the angle, angle is zeros by contract (the
    kernels do not write it)."""
    k, dtype = x.shape[1], compute_dtype(x.dtype)
    cos, cross = (new_output((*lead, k - 1), dtype, x.device) for _ in range(2))
    norms, scales = (new_output((*lead, k), dtype, x.device) for _ in range(2))
    angle = new_output((*lead, k - 1), dtype, x.device) if with_angle else torch.zeros_like(cos)
    return cos, angle, norms, scales, cross


def _save_for_backward(ctx, x, norms, scales, cos, cross, angle, with_angle: bool):
    ctx.save_for_backward(x, norms, scales, cos, cross)
    ctx.with_angle = with_angle
    if not with_angle:
        ctx.mark_non_differentiable(angle)
    return cos, angle


def _upstream(ctx, cos: torch.Tensor, grad_cos, grad_angle):
    """The upstream gradients, contiguous in the compute dtype (zeros for a missing one), and whether the angle
    receives any (the kernels then skip its terms)."""
    grad_cos = torch.zeros_like(cos) if grad_cos is None else grad_cos.to(cos.dtype).contiguous()
    with_angle = ctx.with_angle and grad_angle is not None
    return grad_cos, grad_angle.to(cos.dtype).contiguous() if with_angle else grad_cos, with_angle


class PairScoresFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, with_angle: bool):
        groups, k, d = x.shape
        cos, angle, norms, scales, cross = _new_scores((groups,), x, with_angle)
        cfg = launch_config(k, d, with_angle)
        if groups > 0:
            _pair_scores_fwd_kernel[(groups,)](
                x, cos, angle, norms, scales, cross, k, d, d // 2, x.stride(0), x.stride(1), x.stride(2),
                WITH_ANGLE=with_angle, ACC=acc_dtype_of(x.dtype), EPS=NORM_EPS, **cfg,
            )
        return _save_for_backward(ctx, x, norms, scales, cos, cross, angle, with_angle)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_cos: torch.Tensor, grad_angle: torch.Tensor):
        x, norms, scales, cos, cross = ctx.saved_tensors
        groups, k, d = x.shape
        grad_cos, grad_angle, with_angle = _upstream(ctx, cos, grad_cos, grad_angle)
        dx = new_output((groups, k, d), x.dtype, x.device)
        cfg = launch_config(k, d, with_angle)
        if groups > 0:
            _pair_scores_bwd_kernel[(groups,)](
                x, dx, grad_cos, grad_angle, norms, scales, cos, cross, k, d, d // 2,
                x.stride(0), x.stride(1), x.stride(2),
                WITH_ANGLE=with_angle, ACC=acc_dtype_of(x.dtype), EPS=NORM_EPS, **cfg,
            )
        return dx, None


class PrefixPairScoresFunction(torch.autograd.Function):
    """pair_scores on every prefix x[..., :d_i] at once; outputs [k, G, K-1]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, with_angle: bool, dims: tuple[int, ...]):
        groups, k, d = x.shape
        cos, angle, norms, scales, cross = _new_scores((len(dims), groups), x, with_angle)
        cfg = launch_config(k, dims[-1], with_angle)
        if groups > 0:
            _prefix_pair_scores_fwd_kernel[(groups,)](
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
        cfg = launch_config(k, d, False, _MAX_PREFIX_BWD_BLOCK)  # it sweeps the whole width in column blocks
        if groups > 0:
            _prefix_pair_scores_bwd_kernel[(groups,)](
                x, dx, grad_cos, grad_angle, norms, scales, cos, cross, groups, k, d, x.stride(0), x.stride(1),
                x.stride(2),
                DIMS=ctx.dims, N_DIMS=len(ctx.dims), WITH_ANGLE=with_angle, ACC=acc_dtype_of(x.dtype), EPS=NORM_EPS,
                **cfg,
            )
        return dx, None, None


def pair_scores(x: torch.Tensor, with_angle: bool, dims=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, angle) of every pair of x [G, K, D], or of every prefix x[..., :d] (d in dims, outputs [k, G, K-1]);
    see angle_kernels.dispatch for the contract."""
    if dims is not None:
        return PrefixPairScoresFunction.apply(x, with_angle, tuple(dims))
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
    # nested prefixes: the Matryoshka widths of a 768-wide model (k = 5)
    dims = (64, 128, 256, 512, 768)
    for x_dtype, k, with_angle in variants:
        acc = tl.float64 if x_dtype == "fp64" else tl.float32
        scalars = "fp64" if x_dtype == "fp64" else "fp32"
        label = f"x={x_dtype} K={k} angle={with_angle} dims={dims}"
        for kernel, swept_angle, pointers in (
                (_prefix_pair_scores_fwd_kernel, with_angle, {"x_ptr": x_dtype}),
                (_prefix_pair_scores_bwd_kernel, False, {"x_ptr": x_dtype, "dx_ptr": x_dtype})):
            config = launch_config(k, dims[-1], swept_angle,
                                   _MAX_BLOCK if kernel is _prefix_pair_scores_fwd_kernel else _MAX_PREFIX_BWD_BLOCK)
            warps = config.pop("num_warps")
            constexprs = dict(DIMS=dims, N_DIMS=len(dims), WITH_ANGLE=with_angle, ACC=acc, EPS=NORM_EPS, **config)
            cases.append(CompileCase(kernel, label, scalars, constexprs, warps, pointers=pointers))
    return cases

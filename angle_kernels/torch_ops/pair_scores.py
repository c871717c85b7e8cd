"""Pair scores in pure PyTorch: the cosine and the AnglE complex-division score of every pair.

x is [G, K, D]; pair k of group g is (u, v) = (x[g, 0], x[g, k]). With a, b the halves of u and c, d those of v:
    cos   = u.v / P                      P = max(|u|, eps) * max(|v|, eps)
    angle = (u.v + b.c - a.d) / P        the reference's sum-pooled complex division, before abs() and tau
Everything comes from small per-group Gram matrices: x[g] @ x[g]^T (K x K) holds the norms and dots, and
first_half(x[g]) @ second_half(x[g])^T holds the cross terms. Batched matrix products compute them without
any [G, K, D] temporary; only O(G * K^2) numbers are kept for backward.

Backward, per pair, with s = g_cos + g_angle, w = (b.c - a.d) / P, t = s * cos + g_angle * w:
    du = s/P * v + g_angle/P * (-d, c) - t * u / |u|^2
    dv = s/P * u - g_angle/P * (-b, a) - t * v / |v|^2
(the |.|^2 terms vanish where a norm was clamped to eps). Writing J(x) = (-second half, first half), the
gradient of a whole group is dx[g] = A[g] @ x[g] + B[g] @ J(x[g]) with K x K "star" matrices A, B: two more
batched matrix products per chunk of groups.

Nested prefixes (dims = d_1 < ... < d_k, Matryoshka): the Gram of prefix i is the running sum of the slice Grams
x[..., s_j] @ x[..., s_j]^T over the slices s_j = [d_{j-1}, d_j), j <= i, so every prefix's dots and norms come
from one read of x; the angle's cross terms pair the halves of each prefix, a product per prefix. Backward: the
slice s_j of dx gets (sum over i >= j of A_i) @ x[..., s_j] (suffix sums of the star matrices: one product per
slice), and each prefix its own B_i term on its halves.

Huge rows (torch_ops/common.py, row scaling): a chunk is taken in its scaled form x_s = s x (one power of two per
row, 1 for ordinary rows), so the Gram matrices hold scaled norms and dots that cannot overflow, and the norm
clamp is eps s; on CPU a chunk whose squared norms are all safe is computed as it is (_scaled_forward). Forward
saves s [G, K]; backward rebuilds x_s from x and s and folds s into the rows of the star matrices (dx = s dL/dx_s:
A and B times s row by row). The cost off the CPU: a max-reduction over each chunk in forward and the scaled copy
in both passes (folded into the float32 copy bf16/fp16 inputs make anyway; one more pass for float32/float64).

Memory: a chunk holds `common.chunk_elements(device)` elements of x (CPU: 1 << 22; other devices: 1 << 25, 128 MB
as float32: at K = 2, D = 768 that is 21,845 groups, 13 chunks for 262,144 pairs); at most two chunk-sized
temporaries in the compute dtype are alive at once (the chunk's scaled copy and, for 16-bit inputs with dims, its
gradient before it is cast into dx), next to dx itself and O(G * K^2) numbers.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..contract import compute_dtype
from .common import inverse_norms_from_squares, may_skip_scaling, rows_per_chunk, scaled_rows, unscaled_is_exact

FEATURES = ("dims",)


def _chunk_bounds(x: torch.Tensor):
    """(start, end) of the chunks of x's groups, about common.chunk_elements(x.device) elements each."""
    groups, k, d = x.shape
    step = rows_per_chunk(k * d, x.device)
    for start in range(0, groups, step):
        yield start, min(groups, start + step)


def _chunk_rows(x_chunk: torch.Tensor, scale: torch.Tensor | None):
    """A chunk of groups in the compute dtype as the formulas take it: scaled row by row by `scale` [g, K] (a copy;
    for bf16/fp16 inputs the compute-dtype copy they need anyway), or as it is when scale is None (scales of 1)."""
    if scale is None:
        return x_chunk.to(compute_dtype(x_chunk.dtype))
    return scaled_rows(x_chunk, scale)[0]


def _scaled_forward(x: torch.Tensor, scale: torch.Tensor, compute):
    """Run compute(start, end, chunk, its scales) over the chunks of x, each chunk scaled by its rows' powers of two,
    which are written into `scale` [G, K]; returns whether any chunk was scaled (else every scale is 1). On CPU
    (common.may_skip_scaling) a chunk is first computed unscaled, and kept so when the squared norms compute()
    returns pass common.unscaled_is_exact (then bit for bit what the scaled rows give, with no copy); elsewhere
    every chunk is scaled without asking (asking costs a host sync or a graph break)."""
    any_scaled = False
    for start, end in _chunk_bounds(x):
        chunk = x[start:end]
        if may_skip_scaling(x):
            ones = scale[start:end].fill_(1)
            if unscaled_is_exact(compute(start, end, _chunk_rows(chunk, None), ones)):
                continue
        xc, scale[start:end] = scaled_rows(chunk)
        compute(start, end, xc, scale[start:end])
        del xc  # before the next chunk's copy is made
        any_scaled = True
    return any_scaled


def _new_scales(x: torch.Tensor) -> torch.Tensor:
    """The [G, K] buffer forward fills with the rows' scales (_scaled_forward)."""
    return torch.empty(x.shape[:2], dtype=compute_dtype(x.dtype), device=x.device)


def _scores_of_gram(gram: torch.Tensor, xc: torch.Tensor, scale: torch.Tensor, width: int, with_angle: bool):
    """(inverse norms, has-norm-gradient mask, cos, cross) of a chunk of groups from its Gram [g, K, K] of the
    first `width` features of the scaled rows xc (scales [g, K]); cross = (b.c - a.d) / P from the halves of those
    features (zeros without the angle)."""
    r, mask = inverse_norms_from_squares(torch.diagonal(gram, dim1=1, dim2=2), scale)
    inv_p = r[:, :1] * r[:, 1:]  # 1 / P for each pair (anchor, k)
    cos = gram[:, 0, 1:] * inv_p
    cross = torch.zeros_like(cos)
    if with_angle:
        # halves[g, i, j] = first_half(x_i) . second_half(x_j): b.c = halves[k, 0], a.d = halves[0, k]
        half = width // 2
        halves = torch.bmm(xc[..., :half], xc[..., half:width].transpose(1, 2))
        cross = (halves[:, 1:, 0] - halves[:, 0, 1:]) * inv_p
    return r, mask, cos, cross


def _save_and_output(ctx, x, scale, inv_norm, has_norm_grad, cos, cross, with_angle: bool):
    """Save what backward needs and return (cos, angle); without the angle, angle is zeros and not differentiable."""
    ctx.save_for_backward(x, scale, inv_norm, has_norm_grad, cos, cross)
    ctx.with_angle = with_angle
    angle = cos + cross if with_angle else torch.zeros_like(cos)  # a fresh tensor: cross is saved for backward
    ctx.mark_non_differentiable(*(() if with_angle else (angle,)))
    return cos, angle


def _upstream(grad_cos, grad_angle, cos: torch.Tensor, with_angle: bool):
    """The upstream gradients in the compute dtype, zeros for an output that received none."""
    grad_cos = grad_cos.to(cos.dtype) if grad_cos is not None else torch.zeros_like(cos)
    angle_flows = with_angle and grad_angle is not None
    return grad_cos, grad_angle.to(cos.dtype) if angle_flows else torch.zeros_like(cos), angle_flows


class PairScoresFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, with_angle: bool):
        groups, k, d = x.shape
        dtype = compute_dtype(x.dtype)
        inv_norm = torch.empty(groups, k, dtype=dtype, device=x.device)
        has_norm_grad = torch.empty(groups, k, dtype=torch.bool, device=x.device)
        cos = torch.empty(groups, k - 1, dtype=dtype, device=x.device)
        cross = torch.empty(groups, k - 1, dtype=dtype, device=x.device)  # (b.c - a.d) / P
        scale = _new_scales(x)

        def compute(start, end, xc, sc):
            gram = torch.bmm(xc, xc.transpose(1, 2))  # [g, K, K]
            (inv_norm[start:end], has_norm_grad[start:end], cos[start:end],
             cross[start:end]) = _scores_of_gram(gram, xc, sc, d, with_angle)
            return torch.diagonal(gram, dim1=1, dim2=2)  # the squared norms

        ctx.any_scaled = _scaled_forward(x, scale, compute)
        return _save_and_output(ctx, x, scale, inv_norm, has_norm_grad, cos, cross, with_angle)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_cos: torch.Tensor, grad_angle: torch.Tensor):
        x, scale, inv_norm, has_norm_grad, cos, cross = ctx.saved_tensors
        groups, k, d = x.shape
        grad_cos, grad_angle, _ = _upstream(grad_cos, grad_angle, cos, ctx.with_angle)
        use_angle = ctx.with_angle and d % 2 == 0
        a, b = _star_matrices(grad_cos, grad_angle, inv_norm, has_norm_grad, cos, cross, use_angle, scale)

        dx = torch.empty_like(x)
        half = d // 2
        for start, end in _chunk_bounds(x):
            xc = _chunk_rows(x[start:end], scale[start:end] if ctx.any_scaled else None)
            a_c = a[start:end]
            if not use_angle:
                dx[start:end] = torch.bmm(a_c, xc)
                del xc  # before the next chunk's copy is made
                continue
            b_c = b[start:end]
            first, second = xc[..., :half], xc[..., half:]
            # dx = A x + B J(x), J(x) = (-second, first)
            dx[start:end, :, :half] = torch.bmm(a_c, first).baddbmm_(b_c, second, alpha=-1)
            dx[start:end, :, half:] = torch.bmm(a_c, second).baddbmm_(b_c, first)
            del xc, first, second  # before the next chunk's copy is made
        return dx, None


# The non-zero entries (row r, column m) of the star matrices: A couples each row with the anchor and itself,
# B only the anchor with the partners.
def _A_PATTERN(r: int, m: int) -> bool:
    return r == 0 or m == 0 or r == m


def _B_PATTERN(r: int, m: int) -> bool:
    return (r == 0) != (m == 0)


def _add_star_product(star: torch.Tensor, x: torch.Tensor, out: torch.Tensor, pattern, accumulate: bool = False,
                      sign: float = 1.0) -> None:
    """out[:, r] (+)= sign * sum_m star[:, r, m] * x[:, m] over the entries `pattern` allows, for star [g, K, K],
    x and out [g, K, w] (out may be a strided view: written in place). K is 2 or 3 in practice: a few fused
    multiply-adds per row. On the column slices of nested prefixes this is 2-3x faster on CPU than batched
    products of K x K matrices (which copy strided operands and results); on whole rows bmm is faster for K = 2."""
    k = star.shape[1]
    for r in range(k):
        terms = [m for m in range(k) if pattern(r, m)]
        for n, m in enumerate(terms):
            coefficient = star[:, r, m:m + 1] if sign == 1.0 else star[:, r, m:m + 1] * sign
            if n == 0 and not accumulate:
                torch.mul(x[:, m], coefficient, out=out[:, r])
            else:
                out[:, r].addcmul_(x[:, m], coefficient)


def _chunk_output(dx: torch.Tensor, start: int, end: int, xc: torch.Tensor) -> torch.Tensor:
    """Where a chunk's gradient terms add up: dx's own rows when dx has the compute dtype, else (bf16/fp16
    inputs) a chunk in the compute dtype, copied into dx once complete."""
    return dx[start:end] if dx.dtype == xc.dtype else torch.empty_like(xc)


def _star_matrices(grad_cos, grad_angle, inv_norm, has_norm_grad, cos, cross, use_angle: bool, scale):
    """The K x K matrices A, B of every group ([G, K, K] each; B None without the angle) such that
    dx[g] = A[g] @ x_s[g] + B[g] @ J(x_s[g]), from the saved scores and (scaled) norms of one width: the formulas
    give the gradient with respect to the scaled rows x_s, and the rows of A and B carry the scales [G, K] that
    make it the gradient with respect to x."""
    groups, k = inv_norm.shape
    inv_p = inv_norm[:, :1] * inv_norm[:, 1:]
    s = grad_cos + grad_angle
    t = s * cos + grad_angle * cross
    # where, not a product with the mask: a clamped norm of a huge row's zero prefix (scaled_eps) has an inverse
    # whose square is inf, and inf * 0 was NaN
    no_radial = torch.zeros((), dtype=inv_norm.dtype, device=inv_norm.device)
    radial = -t.unsqueeze(-1) * torch.where(has_norm_grad.unsqueeze(1), inv_norm.unsqueeze(1) ** 2, no_radial)
    # A: row 0 (anchor) gets s/P on the partners and -sum_k t_k/|u|^2 on itself; row k gets s/P on the
    # anchor and -t_k/|v_k|^2 on itself. B: +g_angle/P on row 0, -g_angle/P on the anchor column.
    a = torch.zeros(groups, k, k, dtype=cos.dtype, device=cos.device)
    a[:, 0, 1:] = s * inv_p
    a[:, 1:, 0] = s * inv_p
    a[:, 0, 0] = radial[:, :, 0].sum(1)
    idx = torch.arange(1, k, device=cos.device)
    a[:, idx, idx] = radial[:, torch.arange(k - 1, device=cos.device), idx]
    b = None
    if use_angle:
        b = torch.zeros(groups, k, k, dtype=cos.dtype, device=cos.device)
        b[:, 0, 1:] = grad_angle * inv_p
        b[:, 1:, 0] = -grad_angle * inv_p
        b.mul_(scale[:, :, None])
    return a.mul_(scale[:, :, None]), b


class PrefixPairScoresFunction(torch.autograd.Function):
    """pair_scores on every prefix x[..., :d_i] at once (see the module docstring); outputs [k, G, K-1]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, with_angle: bool, dims: tuple[int, ...]):
        groups, k, _ = x.shape
        n_dims = len(dims)
        dtype = compute_dtype(x.dtype)
        inv_norm = torch.empty(n_dims, groups, k, dtype=dtype, device=x.device)
        has_norm_grad = torch.empty(n_dims, groups, k, dtype=torch.bool, device=x.device)
        cos = torch.empty(n_dims, groups, k - 1, dtype=dtype, device=x.device)
        cross = torch.empty(n_dims, groups, k - 1, dtype=dtype, device=x.device)
        bounds = (0, *dims)
        scale = _new_scales(x)  # one per row for all its prefixes: its largest magnitude over the whole width

        def compute(start, end, xc, sc):
            gram = torch.zeros(end - start, k, k, dtype=dtype, device=x.device)
            for i, d in enumerate(dims):
                piece = xc[..., bounds[i]:d]
                gram.baddbmm_(piece, piece.transpose(1, 2))  # the running Gram of prefix i
                (inv_norm[i, start:end], has_norm_grad[i, start:end], cos[i, start:end],
                 cross[i, start:end]) = _scores_of_gram(gram, xc, sc, d, with_angle)
            return torch.diagonal(gram, dim1=1, dim2=2)  # the widest prefix's squared norms

        ctx.dims = dims
        ctx.any_scaled = _scaled_forward(x, scale, compute)
        return _save_and_output(ctx, x, scale, inv_norm, has_norm_grad, cos, cross, with_angle)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_cos: torch.Tensor, grad_angle: torch.Tensor):
        x, scale, inv_norm, has_norm_grad, cos, cross = ctx.saved_tensors
        dims = ctx.dims
        grad_cos, grad_angle, use_angle = _upstream(grad_cos, grad_angle, cos, ctx.with_angle)
        stars = [_star_matrices(grad_cos[i], grad_angle[i], inv_norm[i], has_norm_grad[i], cos[i], cross[i],
                                use_angle, scale) for i in range(len(dims))]
        dx = torch.empty_like(x)
        bounds = (0, *dims)
        for start, end in _chunk_bounds(x):
            xc = _chunk_rows(x[start:end], scale[start:end] if ctx.any_scaled else None)
            out = _chunk_output(dx, start, end, xc)
            if dims[-1] < x.shape[-1]:
                out[..., dims[-1]:] = 0  # in no prefix
            # slice j: (sum over the prefixes i >= j of A_i) @ x[..., s_j], the sums built from the widest down
            suffix = torch.zeros_like(stars[0][0][start:end])
            for j in reversed(range(len(dims))):
                suffix += stars[j][0][start:end]
                lo, hi = bounds[j], dims[j]
                _add_star_product(suffix, xc[..., lo:hi], out[..., lo:hi], _A_PATTERN)
            if use_angle:
                for i, d in enumerate(dims):  # B_i J(x[..., :d]), J(x) = (-second half, first half)
                    b_c, half = stars[i][1][start:end], d // 2
                    _add_star_product(b_c, xc[..., half:d], out[..., :half], _B_PATTERN, accumulate=True, sign=-1.0)
                    _add_star_product(b_c, xc[..., :half], out[..., half:d], _B_PATTERN, accumulate=True)
            if out.dtype != dx.dtype:
                dx[start:end] = out
            del xc, out  # before the next chunk's copies are made
        return dx, None, None


def pair_scores(x: torch.Tensor, with_angle: bool, dims=None) -> tuple[torch.Tensor, torch.Tensor]:
    if dims is not None:
        return PrefixPairScoresFunction.apply(x, with_angle, dims)
    return PairScoresFunction.apply(x, with_angle)

"""The CUDA backend's Python side on a machine without CUDA (runs in CPU-only CI).

Checks: the module imports and reports itself unavailable with a reason; the torch.library schemas exist;
the fake implementations give the right shapes and dtypes (FakeTensorMode, and a make_fx trace of forward
+ backward through the registered autograd formulas); the wrappers reject bad inputs with ValueError /
TypeError; dispatch refuses backend="cuda" for CPU tensors.

"Kernel mirror" tests: each CUDA kernel's algorithm, transcribed line for line into PyTorch below, is
registered as a temporary CPU kernel of the op (a scoped torch.library, removed after the test), and the
public wrappers, with autograd, are compared with the pure-PyTorch backend in float64. This verifies the
op protocol (saved state, autograd wiring, which output feeds which backward) and the kernels' formulas.
It does NOT run the CUDA code: tests/gpu/test_cuda_backend.py does that on a GPU.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import angle_kernels.cuda_ops as cuda_ops
from angle_kernels.cuda_ops import _library

EPS = 1e-12
NS = "angle_kernels"


def _op(name):
    return getattr(torch.ops.angle_kernels, name).default


# ---------------------------------------------------------------------------------------------------------
# Availability, schemas, dispatch
# ---------------------------------------------------------------------------------------------------------
def test_import_and_unavailable_reason():
    ok, why = cuda_ops.is_available()
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: availability depends on the build, see tests/gpu")
    assert ok is False
    assert "CUDA" in why or "GPU" in why, why


def test_schemas_exist():
    for name, schema in _library.SCHEMAS.items():
        op = _op(name)
        assert str(op._schema) == f"{NS}::{name}{schema}"
    fwd = _op("cuda_similarity_xent_fwd")._schema
    assert [a.name for a in fwd.arguments] == [
        "q", "c", "scale", "target", "row_weights", "exclude_diagonal", "margin", "group_ids"
    ]


def test_dispatch_rejects_cuda_backend_for_cpu_tensors():
    from angle_kernels.dispatch import resolve_backend

    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="cuda"):
        resolve_backend("cuda", x)


def test_public_loss_rejects_cuda_backend_for_cpu_tensors():
    import angle_kernels

    y_true = torch.tensor([1.0, 1.0, 0.0, 0.0])
    y_pred = torch.randn(4, 8)
    with pytest.raises(ValueError, match="cuda"):
        angle_kernels.cosine_loss(y_true, y_pred, backend="cuda")


# ---------------------------------------------------------------------------------------------------------
# Fake implementations
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_fake_shapes_pair_scores(dtype):
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    with FakeTensorMode():
        x = torch.empty(5, 3, 10, dtype=dtype)
        cos, angle, stats = _op("cuda_pair_scores_fwd")(x, True)
        assert cos.shape == angle.shape == (5, 2) and stats.shape == (5, 2, 4)
        assert cos.dtype == angle.dtype == stats.dtype == acc
        dx = _op("cuda_pair_scores_bwd")(cos, angle, x, stats, True)
        assert dx.shape == x.shape and dx.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fake_shapes_ranking(dtype):
    with FakeTensorMode():
        scores = torch.empty(7, dtype=dtype)
        labels = torch.empty(7, dtype=torch.int64)
        loss, order, first, past = _op("cuda_ranking_fwd")(scores, labels)
        assert loss.shape == () and loss.dtype == dtype
        assert order.shape == first.shape == past.shape == (7,) and order.dtype == torch.int64
        grad = _op("cuda_ranking_bwd")(loss, scores, order, first, past)
        assert grad.shape == (7,) and grad.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("with_c", [False, True])
def test_fake_shapes_similarity_xent(dtype, with_c):
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    with FakeTensorMode():
        q = torch.empty(6, 12, dtype=dtype)
        c = torch.empty(9, 12, dtype=dtype) if with_c else None
        loss, lse_all, lse_pos, q_norm, c_norm = _op("cuda_similarity_xent_fwd")(
            q, c, 20.0, "diagonal" if with_c else "partner", None, not with_c, 0.0, None
        )
        assert loss.shape == () and loss.dtype == acc
        assert lse_all.shape == lse_pos.shape == q_norm.shape == (6,)
        assert c_norm.shape == ((9,) if with_c else (0,))
        dq, dc = _op("cuda_similarity_xent_bwd")(
            loss, q, c, lse_all, lse_pos, q_norm, c_norm, 20.0, "partner", None, False, 0.0, None
        )
        assert dq.shape == q.shape and dq.dtype == dtype
        assert dc.shape == ((9, 12) if with_c else (0,))


def test_make_fx_traces_forward_and_backward():
    """Forward + autograd backward traced with fake tensors: the registered formulas call the _bwd ops."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def loss_and_grads(x, q):
        x = x.requires_grad_()
        q = q.requires_grad_()
        cos, angle = cuda_ops.pair_scores(x, True)
        scores = (cos * 20.0).reshape(-1)
        labels = torch.arange(scores.shape[0], device=x.device) % 2
        loss = cuda_ops.ranking_loss(scores, labels) + angle.sum()
        loss = loss + cuda_ops.similarity_xent(q, None, 20.0, "partner", None, True, 0.0, None)
        return torch.autograd.grad(loss, (x, q))

    graph = make_fx(loss_and_grads, tracing_mode="fake")(torch.randn(4, 2, 6), torch.randn(6, 6))
    text = str(graph.graph)
    for name in _library.SCHEMAS:
        assert f"{NS}.{name}" in text, f"{name} missing from the traced graph"


# ---------------------------------------------------------------------------------------------------------
# Wrapper validation (raised before any kernel is reached)
# ---------------------------------------------------------------------------------------------------------
def test_wrappers_reject_bad_inputs():
    with pytest.raises(ValueError, match="even"):
        cuda_ops.pair_scores(torch.randn(2, 2, 5), True)
    with pytest.raises(ValueError, match="K >= 2"):
        cuda_ops.pair_scores(torch.randn(2, 1, 4), False)
    with pytest.raises(TypeError, match="x must be"):
        cuda_ops.pair_scores(torch.randn(2, 2, 4).to(torch.int32), False)
    with pytest.raises(TypeError, match="scores"):
        cuda_ops.ranking_loss(torch.randn(4).half(), torch.zeros(4))
    with pytest.raises(ValueError, match="labels"):
        cuda_ops.ranking_loss(torch.randn(4), torch.zeros(5))
    q = torch.randn(6, 8)
    with pytest.raises(ValueError, match="target"):
        cuda_ops.similarity_xent(q, None, 20.0, "bogus")
    with pytest.raises(ValueError, match="column"):
        cuda_ops.similarity_xent(torch.randn(5, 8), None, 20.0, "partner")
    with pytest.raises(ValueError, match="exclude_diagonal"):
        cuda_ops.similarity_xent(q, None, 20.0, "diagonal", exclude_diagonal=True)
    with pytest.raises(ValueError, match="group_ids"):
        cuda_ops.similarity_xent(q, torch.randn(6, 8), 20.0, "diagonal", group_ids=torch.zeros(6, dtype=torch.long))
    with pytest.raises(ValueError, match="margin"):
        cuda_ops.similarity_xent(q, None, 20.0, "partner", margin=-0.1)
    with pytest.raises(ValueError, match="c must be"):
        cuda_ops.similarity_xent(q, torch.randn(6, 7), 20.0, "diagonal")


# ---------------------------------------------------------------------------------------------------------
# Kernel mirrors: csrc/*.cu transcribed into PyTorch (same saved state, same formulas).
# ---------------------------------------------------------------------------------------------------------
def _acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _inv_clamped(norm):
    return 1.0 / norm.clamp_min(EPS)


def _inv_sq_or_zero(norm):
    return torch.where(norm > EPS, 1.0 / (norm * norm), torch.zeros_like(norm))


def _mirror_pair_scores_fwd(x, with_angle):  # _pair_scores_fwd_kernel
    xf = x.to(_acc(x.dtype))
    u, v = xf[:, :1, :], xf[:, 1:, :]
    if with_angle:
        half = x.shape[2] // 2
        a, b, c, d = u[..., :half], u[..., half:], v[..., :half], v[..., half:]
        uu, vv = (a * a + b * b).sum(-1), (c * c + d * d).sum(-1)
        uv, cross = (a * c + b * d).sum(-1), (b * c - a * d).sum(-1)
    else:
        uu, vv, uv = (u * u).sum(-1), (v * v).sum(-1), (u * v).sum(-1)
        cross = torch.zeros_like(uv)
    norm_u, norm_v = uu.sqrt().expand_as(vv), vv.sqrt()
    inv_p = _inv_clamped(norm_u) * _inv_clamped(norm_v)
    cos = uv * inv_p
    w = cross * inv_p if with_angle else torch.zeros_like(cos)
    angle = cos + w if with_angle else torch.zeros_like(cos)
    return cos, angle, torch.stack([norm_u, norm_v, cos, w], dim=-1)


def _mirror_pair_scores_bwd(grad_cos, grad_angle, x, stats, with_angle):  # _pair_scores_bwd_kernel
    norm_u, norm_v, cos, w = stats.unbind(-1)
    ga = grad_angle if with_angle else torch.zeros_like(grad_angle)
    gs = grad_cos + ga
    inv_p = _inv_clamped(norm_u) * _inv_clamped(norm_v)
    projection = gs * cos + ga * w
    alpha, beta = (gs * inv_p)[..., None], (ga * inv_p)[..., None]
    gamma_u = (projection * _inv_sq_or_zero(norm_u))[..., None]
    gamma_v = (projection * _inv_sq_or_zero(norm_v))[..., None]
    xf = x.to(stats.dtype)
    u, v = xf[:, :1, :], xf[:, 1:, :]
    if with_angle:
        half = x.shape[2] // 2
        a, b, c, d = u[..., :half], u[..., half:], v[..., :half], v[..., half:]
        du = torch.cat([(alpha * c - beta * d - gamma_u * a).sum(1, keepdim=True),
                        (alpha * d + beta * c - gamma_u * b).sum(1, keepdim=True)], dim=-1)
        dv = torch.cat([alpha * a + beta * b - gamma_v * c, alpha * b - beta * a - gamma_v * d], dim=-1)
    else:
        du = (alpha * v - gamma_u * u).sum(1, keepdim=True)
        dv = alpha * u - gamma_v * v
    return torch.cat([du, dv], dim=1).to(x.dtype)


def _mirror_ranking_sort(labels):  # bindings.cpp ranking_fwd
    sorted_labels, order = torch.sort(labels)
    first = torch.searchsorted(sorted_labels, sorted_labels, right=False)
    past = torch.searchsorted(sorted_labels, sorted_labels, right=True)
    return order, first, past


def _mirror_log_terms(scores, order, first, past):  # log_cumsumexp_sorted + log_pair_sum
    s = scores[order].double()
    n = s.shape[0]
    neg_inf = torch.tensor(float("-inf"), dtype=torch.float64)
    prefix = torch.logcumsumexp(s, 0)
    suffix = torch.logcumsumexp(-s.flip(0), 0).flip(0)
    log_a = torch.where(first > 0, prefix[(first - 1).clamp_min(0)], neg_inf)
    log_b = torch.where(past < n, suffix[past.clamp_max(n - 1)], neg_inf)
    log_s = torch.logsumexp(-s + log_a, 0)
    return s, log_a, log_b, torch.logaddexp(log_s, torch.zeros_like(log_s))  # softplus


def _mirror_ranking_fwd(scores, labels):  # _ranking_fwd_kernel
    order, first, past = _mirror_ranking_sort(labels)
    _, _, _, log_z = _mirror_log_terms(scores, order, first, past)
    return log_z.to(scores.dtype), order, first, past


def _mirror_ranking_bwd(grad_loss, scores, order, first, past):  # _ranking_bwd_kernel
    s, log_a, log_b, log_z = _mirror_log_terms(scores, order, first, past)
    grad_sorted = grad_loss.double() * (torch.exp(s + log_b - log_z) - torch.exp(-s + log_a - log_z))
    grad = torch.empty_like(scores)
    grad[order] = grad_sorted.to(scores.dtype)
    return grad


def _mirror_margin_cos(cos, margin):  # margin_cos in similarity_xent.cu
    cos_m, sin_m = math.cos(margin), math.sin(margin)
    one_minus_sq = 1 - cos * cos
    floored = ~(one_minus_sq > 1e-6)
    sin = torch.where(floored, torch.full_like(cos, 1e-6), one_minus_sq).sqrt()
    dcos = torch.where(floored, torch.full_like(cos, cos_m), cos_m + sin_m * cos / sin)
    value = cos * cos_m - sin * sin_m
    past_pi = cos < -cos_m
    return torch.where(past_pi, -torch.ones_like(cos), value), torch.where(past_pi, torch.zeros_like(cos), dcos)


def _mirror_xent_tiles(q, c, scale, target, exclude_diagonal, margin, group_ids):
    """Everything the fwd/bwd tile epilogues compute, for the whole matrix at once (tests are tiny)."""
    acc = _acc(q.dtype)
    cc = q if c is None else c
    qf, cf = q.to(acc), cc.to(acc)
    q_norm, c_norm = qf.norm(dim=1), cf.norm(dim=1)
    cos = (qf @ cf.T) * _inv_clamped(q_norm)[:, None] * _inv_clamped(c_norm)[None, :]
    rows = torch.arange(q.shape[0])
    cols = torch.arange(cc.shape[0])
    t = rows ^ 1 if target == "partner" else rows
    is_target = cols[None, :] == t[:, None]
    dlogit_dcos = torch.full_like(cos, scale)
    effective = cos
    if margin > 0:
        m_cos, m_dcos = _mirror_margin_cos(cos, margin)
        effective = torch.where(is_target, m_cos, cos)
        dlogit_dcos = torch.where(is_target, scale * m_dcos, dlogit_dcos)
    logits = scale * effective
    in_c = torch.ones_like(cos, dtype=torch.bool)
    if exclude_diagonal:
        in_c &= cols[None, :] != rows[:, None]
    positive = is_target.clone()
    if group_ids is not None:
        g = group_ids
        positive |= (g[None, :] == g[:, None]) | (g[None, :] == g[t][:, None])
    positive &= in_c
    return q_norm, c_norm, cos, logits, in_c, positive, dlogit_dcos


def _masked_lse(logits, mask):
    return torch.logsumexp(logits.masked_fill(~mask, float("-inf")), dim=1)


def _mirror_xent_fwd(q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids):
    q_norm, c_norm, _, logits, in_c, positive, _ = _mirror_xent_tiles(
        q, c, scale, target, exclude_diagonal, margin, group_ids)
    lse_all, lse_pos = _masked_lse(logits, in_c), _masked_lse(logits, positive)
    w = torch.ones_like(lse_all) if row_weights is None else row_weights.to(lse_all.dtype)
    row_loss = torch.where(w == 0, torch.zeros_like(w), w * (lse_all - lse_pos))
    c_norm_out = c_norm.new_empty(0) if c is None else c_norm
    return row_loss.sum() / q.shape[0], lse_all, lse_pos, q_norm, c_norm_out


def _mirror_xent_bwd(grad_loss, q, c, lse_all, lse_pos, q_norm, c_norm, scale, target, row_weights,
                     exclude_diagonal, margin, group_ids):
    _, _, cos, logits, in_c, positive, dlogit_dcos = _mirror_xent_tiles(
        q, c, scale, target, exclude_diagonal, margin, group_ids)
    acc = cos.dtype
    w = torch.ones_like(lse_all) if row_weights is None else row_weights.to(acc)
    row_scale = grad_loss.to(acc) / q.shape[0] * w
    softmax_all = torch.where(in_c, torch.exp(logits - lse_all[:, None]), torch.zeros_like(cos))
    softmax_pos = torch.where(positive, torch.exp(logits - lse_pos[:, None]), torch.zeros_like(cos))
    h = row_scale[:, None] * (softmax_all - softmax_pos) * dlogit_dcos
    h = torch.where(in_c, h, torch.zeros_like(h))
    cc = q if c is None else c
    col_norm = q_norm if c is None else c_norm
    qf, cf = q.to(acc), cc.to(acc)
    dq_acc = h @ (cf * _inv_clamped(col_norm)[:, None])
    dc_acc = h.T @ (qf * _inv_clamped(q_norm)[:, None])
    q_coef, c_coef = (h * cos).sum(1), (h * cos).sum(0)
    if c is None:  # the symmetric case accumulates both into one buffer
        dq_acc, q_coef = dq_acc + dc_acc, q_coef + c_coef

    def finish(x, norm, grad_acc, coef):  # _similarity_xent_finish_kernel
        return (grad_acc * _inv_clamped(norm)[:, None] - (coef * _inv_sq_or_zero(norm))[:, None] * x.to(acc)).to(
            x.dtype)

    dq = finish(q, q_norm, dq_acc, q_coef)
    dc = q.new_empty(0) if c is None else finish(c, c_norm, dc_acc, c_coef)
    return dq, dc


MIRRORS = {
    "cuda_pair_scores_fwd": _mirror_pair_scores_fwd,
    "cuda_pair_scores_bwd": _mirror_pair_scores_bwd,
    "cuda_ranking_fwd": _mirror_ranking_fwd,
    "cuda_ranking_bwd": _mirror_ranking_bwd,
    "cuda_similarity_xent_fwd": _mirror_xent_fwd,
    "cuda_similarity_xent_bwd": _mirror_xent_bwd,
}


@pytest.fixture
def mirrored_ops():
    """Registers the mirrors as CPU kernels of the cuda_* ops for the duration of one test."""
    scoped_library = getattr(torch.library, "_scoped_library", None)
    if scoped_library is None:
        pytest.skip("this torch has no torch.library._scoped_library")
    with scoped_library(NS, "IMPL") as lib:
        for name, fn in MIRRORS.items():
            lib.impl(name, fn, "CPU")
        yield


def _rel(a, b):
    a, b = a.detach().double().reshape(-1), b.detach().double().reshape(-1)
    scale = b.norm()
    return float((a - b).norm() / scale) if scale > 0 else float((a - b).norm())


@pytest.mark.parametrize("group_size,with_angle,dim", [(2, True, 6), (3, True, 10), (2, False, 7), (3, False, 4)])
def test_mirror_pair_scores_matches_torch_backend(mirrored_ops, group_size, with_angle, dim):
    from angle_kernels import torch_ops

    gen = torch.Generator().manual_seed(100 + group_size * 10 + dim)
    x = torch.randn(5, group_size, dim, dtype=torch.float64, generator=gen)
    x[1, 0] = 0.0  # a zero anchor: clamped norm, no NaN
    weights = torch.randn(5, group_size - 1, 2, dtype=torch.float64, generator=gen)
    outs = {}
    for name, backend in (("cuda", cuda_ops), ("torch", torch_ops)):
        xx = x.clone().requires_grad_()
        cos, angle = backend.pair_scores(xx, with_angle)
        loss = (cos * weights[..., 0]).sum() + (angle * weights[..., 1]).sum()
        outs[name] = (cos, angle, torch.autograd.grad(loss, xx)[0])
    for got, ref in zip(outs["cuda"], outs["torch"]):
        assert _rel(got, ref) < 1e-12
        assert torch.isfinite(got).all()


@pytest.mark.parametrize("n,num_labels", [(1, 1), (9, 3), (40, 5), (25, 25), (12, 1)])
def test_mirror_ranking_matches_torch_backend(mirrored_ops, n, num_labels):
    from angle_kernels import torch_ops

    gen = torch.Generator().manual_seed(200 + n + num_labels)
    scores = 10 * torch.randn(n, dtype=torch.float64, generator=gen)
    labels = torch.randint(0, num_labels, (n,), generator=gen).to(torch.float32)
    outs = {}
    for name, backend in (("cuda", cuda_ops), ("torch", torch_ops)):
        s = scores.clone().requires_grad_()
        loss = backend.ranking_loss(s, labels)
        outs[name] = (loss, torch.autograd.grad(3.0 * loss, s)[0])
    assert _rel(outs["cuda"][0], outs["torch"][0]) < 1e-12
    assert _rel(outs["cuda"][1], outs["torch"][1]) < 1e-12
    if num_labels == 1:
        assert outs["cuda"][0].item() == 0.0


XENT_CASES = {
    "ibn": dict(c=False, target="partner", exclude_diagonal=True, margin=0.0, weights=True, groups=False),
    "ibn_groups": dict(c=False, target="partner", exclude_diagonal=True, margin=0.0, weights=True, groups=True),
    "contrastive": dict(c=True, target="diagonal", exclude_diagonal=False, margin=0.0, weights=False, groups=False),
    "arccon": dict(c=True, target="diagonal", exclude_diagonal=False, margin=0.6, weights=False, groups=False),
}


@pytest.mark.parametrize("case", sorted(XENT_CASES))
def test_mirror_similarity_xent_matches_torch_backend(mirrored_ops, case):
    from angle_kernels import torch_ops

    cfg = XENT_CASES[case]
    gen = torch.Generator().manual_seed(300 + len(case))
    m, d = 8, 6
    q = torch.randn(m, d, dtype=torch.float64, generator=gen)
    c = torch.randn(2 * m, d, dtype=torch.float64, generator=gen) if cfg["c"] else None
    if cfg["c"]:
        c[0] = -q[0]  # cos = -1 on a target: exercises the margin's pi clamp and sin floor
    row_weights = (torch.arange(m) % 3 != 0).to(torch.float64) if cfg["weights"] else None
    group_ids = torch.tensor([0, 1, 2, 3, 0, 1, 6, 7]) if cfg["groups"] else None
    outs = {}
    for name, backend in (("cuda", cuda_ops), ("torch", torch_ops)):
        qq = q.clone().requires_grad_()
        cc = c.clone().requires_grad_() if c is not None else None
        loss = backend.similarity_xent(qq, cc, 5.0, cfg["target"], row_weights, cfg["exclude_diagonal"],
                                       cfg["margin"], group_ids)
        inputs = (qq,) if cc is None else (qq, cc)
        outs[name] = (loss, *torch.autograd.grad(2.0 * loss, inputs))
    for got, ref in zip(outs["cuda"], outs["torch"]):
        assert torch.isfinite(got).all()
        assert _rel(got, ref) < 1e-10, case


def test_mirror_ops_compile_fullgraph(mirrored_ops):
    """torch.compile(fullgraph=True) through the ops' fake implementations and autograd formulas (AOT
    autograd traces forward and backward), executed by the CPU mirrors: must equal eager."""

    def losses(x, q, c):
        cos, angle = cuda_ops.pair_scores(x, True)
        labels = torch.arange(cos.shape[0]) % 3
        total = cuda_ops.ranking_loss(20.0 * cos[:, 0], labels) + cuda_ops.ranking_loss(20.0 * angle[:, 0], labels)
        total = total + cuda_ops.similarity_xent(q, None, 20.0, "partner", None, True, 0.0, None)
        return total + cuda_ops.similarity_xent(q, c, 20.0, "diagonal", None, False, 0.2, None)

    gen = torch.Generator().manual_seed(400)
    inputs = [torch.randn(*shape, dtype=torch.float64, generator=gen) for shape in ((6, 2, 8), (6, 8), (12, 8))]
    results = []
    torch._dynamo.reset()
    for fn in (losses, torch.compile(losses, fullgraph=True, backend="aot_eager")):
        leaves = [t.clone().requires_grad_() for t in inputs]
        loss = fn(*leaves)
        results.append((loss, *torch.autograd.grad(loss, leaves)))
    for got, ref in zip(results[1], results[0]):
        assert _rel(got, ref) < 1e-12

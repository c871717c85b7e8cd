"""The CUDA C++ backend (csrc/) on a GPU: every op against the pure-PyTorch backend, forward and backward.

Skipped without CUDA. On a GPU machine the extension must load (prebuilt angle_kernels._C or the JIT build,
which needs nvcc): test_extension_loads fails, with the reason, when it does not.

Reference: angle_kernels.torch_ops in float64 on the same (already rounded) inputs, on the same device.
Tolerances: float64 1e-10 (values) / 1e-8 (gradients); float32 1e-5 / 1e-4; bfloat16 and float16 inputs
accumulate in float32, so the losses must match to 1e-4, while gradients are rounded to the input dtype on
output (bf16 keeps 8 bits: 1e-2; fp16 11 bits: 2e-3).

Outputs are "poisoned": before each op the caching allocator is handed NaN-filled blocks, so memory a
kernel forgot to write shows up as NaN (best effort: it relies on the allocator reusing those blocks).
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

if torch.cuda.is_available():
    import angle_kernels
    import angle_kernels.cuda_ops as cuda_ops
    from angle_kernels import torch_ops

VALUE_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-4, torch.float16: 1e-4}
GRAD_TOL = {torch.float64: 1e-8, torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def _require_extension():
    ok, why = cuda_ops.is_available()
    if not ok:
        pytest.fail(f"the CUDA extension does not load on this GPU machine: {why}")


def _gen(*parts) -> torch.Generator:
    """A generator seeded from the test's parameters (stable across processes, unlike hash())."""
    return torch.Generator().manual_seed(zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF)


def _randn(gen, *shape, dtype, scale=1.0):
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype).cuda()


def _poison_allocator(nbytes: int = 1 << 26) -> None:
    """Fill a large block with NaN and free it: the next allocations come from it."""
    block = torch.full((nbytes // 4,), float("nan"), dtype=torch.float32, device="cuda")
    del block


def _check(out, ref, tol, what):
    assert torch.isfinite(out).all(), f"{what}: non-finite values (unwritten output?)"
    out64, ref64 = out.detach().double().reshape(-1), ref.detach().double().reshape(-1)
    assert out64.shape == ref64.shape, f"{what}: shape {tuple(out.shape)} vs {tuple(ref.shape)}"
    scale = float(ref64.norm())
    err = float((out64 - ref64).norm()) / (scale if scale > 0 else 1.0)
    assert err < tol, f"{what}: relative error {err:.3e} >= {tol:.1e}"


def _run(backend, fn, inputs, grad_weights):
    """(outputs, gradients of sum(out * weight) with respect to the float inputs)."""
    leaves = [t.detach().clone().requires_grad_() if t is not None and t.is_floating_point() else t for t in inputs]
    _poison_allocator()
    outs = fn(backend, *leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    total = sum((o.double() * w).sum() for o, w in zip(outs, grad_weights))
    diff_leaves = [t for t in leaves if t is not None and t.is_floating_point() and t.requires_grad]
    grads = torch.autograd.grad(total, diff_leaves)
    return outs, grads


def test_extension_loads():
    _require_extension()


# ---------------------------------------------------------------------------------------------------------
# pair_scores
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("groups,group_size,dim,with_angle",
                         [(1, 2, 2, True), (37, 2, 130, True), (5, 3, 768, True), (16, 2, 7, False), (1000, 3, 6, True)])
def test_pair_scores(dtype, groups, group_size, dim, with_angle):
    _require_extension()
    gen = _gen("pair", dtype, groups, group_size, dim)
    x = _randn(gen, groups, group_size, dim, dtype=dtype)
    x[0, -1] = 0  # a zero row: clamped norm, cosine 0
    weights = [_randn(gen, groups, group_size - 1, dtype=torch.float64) for _ in range(2)]
    fn = lambda b, x: b.pair_scores(x, with_angle)  # noqa: E731
    (cos, angle), (dx,) = _run(cuda_ops, fn, [x], weights)
    (cos_ref, angle_ref), (dx_ref,) = _run(torch_ops, fn, [x.double()], weights)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert cos.dtype == angle.dtype == acc and dx.dtype == dtype and dx.shape == x.shape
    _check(cos, cos_ref, VALUE_TOL[dtype], "cos")
    _check(angle, angle_ref, VALUE_TOL[dtype], "angle")
    if dtype == torch.float16:
        # The zero row's true gradient is about |g| / eps = 1e12, beyond fp16's range: +-inf is the right
        # answer there (README, deviations), NaN never is. Every other row is checked as usual.
        _check_overflowing_row(dx[0, -1], dx_ref[0, -1], "dx of the zero row")
        others = torch.ones(dx.shape[:2], dtype=torch.bool, device=dx.device)
        others[0, -1] = False
        _check(dx[others], dx_ref[others], GRAD_TOL[dtype], "dx")
    else:
        _check(dx, dx_ref, GRAD_TOL[dtype], "dx")


def _check_overflowing_row(out, ref, what):
    """Elements whose float64 reference exceeds out's dtype range must be inf of the same sign; the rest match."""
    assert not torch.isnan(out).any(), f"{what}: NaN"
    overflow = ref.abs() > torch.finfo(out.dtype).max
    assert overflow.any(), f"{what}: expected values beyond {out.dtype}'s range in the reference"
    expected = torch.where(ref > 0, float("inf"), float("-inf"))[overflow]
    assert torch.equal(out[overflow].double(), expected), f"{what}: overflowing elements are not +-inf"
    if (~overflow).any():
        _check(out[~overflow], ref[~overflow], GRAD_TOL[out.dtype], what)


def test_pair_scores_strided_input():
    _require_extension()
    gen = _gen("pair_strided")
    base = _randn(gen, 2 * 33, 3, 64, dtype=torch.float32)
    x = base[::2].transpose(0, 1).contiguous().transpose(0, 1)  # non-contiguous in every dimension
    weights = [_randn(gen, 33, 2, dtype=torch.float64) for _ in range(2)]
    fn = lambda b, x: b.pair_scores(x, True)  # noqa: E731
    (cos, angle), (dx,) = _run(cuda_ops, fn, [x], weights)
    (cos_ref, angle_ref), (dx_ref,) = _run(torch_ops, fn, [x.double()], weights)
    _check(cos, cos_ref, 1e-5, "cos")
    _check(angle, angle_ref, 1e-5, "angle")
    _check(dx, dx_ref, 1e-4, "dx")


# ---------------------------------------------------------------------------------------------------------
# ranking_loss
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n,num_labels", [(1, 1), (3, 2), (37, 3), (1000, 5), (1000, 1000), (100_000, 7), (5000, 1)])
def test_ranking_loss(dtype, n, num_labels):
    _require_extension()
    gen = _gen("rank", dtype, n, num_labels)
    scores = _randn(gen, n, dtype=dtype, scale=20.0)
    labels = torch.randint(0, num_labels, (n,), generator=gen).to(torch.float32).cuda()
    weight = [torch.tensor(1.7, dtype=torch.float64, device="cuda")]
    fn = lambda b, s: b.ranking_loss(s, labels)  # noqa: E731
    (loss,), (grad,) = _run(cuda_ops, fn, [scores], weight)
    (loss_ref,), (grad_ref,) = _run(torch_ops, fn, [scores.double()], weight)
    assert loss.dtype == dtype and loss.shape == ()
    if num_labels == 1:
        assert loss.item() == 0.0 and torch.count_nonzero(grad) == 0
    else:
        _check(loss, loss_ref, VALUE_TOL[dtype], "loss")
        _check(grad, grad_ref, GRAD_TOL[dtype], "grad")


def test_ranking_loss_integer_labels_and_strided_scores():
    _require_extension()
    gen = _gen("rank_int")
    scores = _randn(gen, 2 * 777, dtype=torch.float32)[::2]
    labels = torch.randint(-3, 3, (777,), generator=gen).cuda()
    weight = [torch.tensor(1.0, dtype=torch.float64, device="cuda")]
    fn = lambda b, s: b.ranking_loss(s, labels)  # noqa: E731
    (loss,), (grad,) = _run(cuda_ops, fn, [scores], weight)
    (loss_ref,), (grad_ref,) = _run(torch_ops, fn, [scores.double()], weight)
    _check(loss, loss_ref, 1e-5, "loss")
    _check(grad, grad_ref, 1e-4, "grad")


# ---------------------------------------------------------------------------------------------------------
# similarity_xent
# ---------------------------------------------------------------------------------------------------------
XENT_CASES = {
    "ibn": dict(c_rows=None, target="partner", exclude_diagonal=True, margin=0.0, weights=True, groups=False),
    "ibn_groups": dict(c_rows=None, target="partner", exclude_diagonal=True, margin=0.0, weights=True, groups=True),
    "contrastive": dict(c_rows=1, target="diagonal", exclude_diagonal=False, margin=0.0, weights=False, groups=False),
    "contrastive_neg": dict(c_rows=2, target="diagonal", exclude_diagonal=False, margin=0.0, weights=False,
                            groups=False),
    "arccon": dict(c_rows=1, target="diagonal", exclude_diagonal=False, margin=math.radians(10), weights=False,
                   groups=False),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(2, 2), (38, 6), (130, 130), (1000, 768)])
@pytest.mark.parametrize("case", sorted(XENT_CASES))
def test_similarity_xent(dtype, rows, dim, case):
    _require_extension()
    cfg = XENT_CASES[case]
    gen = _gen("xent", dtype, rows, dim, case)
    q = _randn(gen, rows, dim, dtype=dtype)
    c = _randn(gen, cfg["c_rows"] * rows, dim, dtype=dtype) if cfg["c_rows"] else None
    row_weights = (torch.rand(rows, generator=gen) > 0.3).double().cuda() if cfg["weights"] else None
    group_ids = torch.randint(0, max(1, rows // 3), (rows,), generator=gen).cuda() if cfg["groups"] else None
    scale = 20.0 if cfg["margin"] == 0 else 1 / 0.05

    def fn(b, q, c):
        return b.similarity_xent(q, c, scale, cfg["target"], row_weights, cfg["exclude_diagonal"], cfg["margin"],
                                 group_ids)

    weight = [torch.tensor(1.3, dtype=torch.float64, device="cuda")]
    (loss,), grads = _run(cuda_ops, fn, [q, c], weight)
    (loss_ref,), grads_ref = _run(torch_ops, fn, [q.double(), None if c is None else c.double()], weight)
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32) and loss.shape == ()
    _check(loss, loss_ref, VALUE_TOL[dtype], "loss")
    for name, g, g_ref, x in zip(("dq", "dc"), grads, grads_ref, (q, c)):
        assert g.dtype == dtype and g.shape == x.shape
        _check(g, g_ref, GRAD_TOL[dtype], name)


def test_similarity_xent_memory_is_linear():
    """No M x M matrix: the extra memory of forward + backward at M = 16384 stays far below M^2 floats."""
    _require_extension()
    rows, dim = 16384, 256
    gen = _gen("xent_memory")
    q = _randn(gen, rows, dim, dtype=torch.bfloat16).requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = cuda_ops.similarity_xent(q, None, 20.0, "partner", None, True, 0.0, None)
    loss.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    # Expected: fp32 gradient scratch (4 M D bytes) + the bf16 gradient + O(M); one fp32 M x M matrix is 1 GiB.
    assert extra < rows * rows, f"extra memory {extra / 2**20:.1f} MiB: more than 1/4 of an M x M fp32 matrix"


# ---------------------------------------------------------------------------------------------------------
# The public losses through backend="cuda", eager and under torch.compile(fullgraph=True)
# ---------------------------------------------------------------------------------------------------------
def _losses(gen, n_pairs=48, dim=64, dtype=torch.float32):
    y_pred = _randn(gen, 2 * n_pairs, dim, dtype=dtype)
    y_true = torch.randint(0, 3, (n_pairs,), generator=gen).float().repeat_interleave(2).cuda()
    y_bin = (y_true > 0).float()
    h2 = _randn(gen, n_pairs, dim, dtype=dtype)
    neg = _randn(gen, n_pairs, dim, dtype=dtype)
    return {
        "cosine": (lambda x, b: angle_kernels.cosine_loss(y_true, x, backend=b), y_pred),
        "angle": (lambda x, b: angle_kernels.angle_loss(y_true, x, tau=20.0, backend=b), y_pred),
        "ibn": (lambda x, b: angle_kernels.in_batch_negative_loss(y_bin, x, backend=b), y_pred),
        "contrastive": (lambda x, b: angle_kernels.contrastive_with_negative_loss(x, h2, neg, backend=b),
                        y_pred[:n_pairs]),
        "arccon": (lambda x, b: angle_kernels.arccon_loss(x, h2, backend=b), y_pred[:n_pairs]),
    }


@pytest.mark.parametrize("name", ["cosine", "angle", "ibn", "contrastive", "arccon"])
def test_public_losses_match_torch_backend(name):
    _require_extension()
    fn, x = _losses(_gen("public", name))[name]
    xc = x.detach().clone().requires_grad_()
    xt = x.detach().clone().requires_grad_()
    loss_cuda = fn(xc, "cuda")
    loss_torch = fn(xt, "torch")
    loss_cuda.backward()
    loss_torch.backward()
    _check(loss_cuda, loss_torch, 1e-5, f"{name} loss")
    _check(xc.grad, xt.grad, 1e-4, f"{name} grad")


@pytest.mark.parametrize("name", ["cosine", "angle", "ibn", "contrastive", "arccon"])
def test_public_losses_compile_fullgraph(name):
    _require_extension()
    fn, x = _losses(_gen("compile", name))[name]
    torch._dynamo.reset()
    with angle_kernels.input_checks(False):  # the NaN/Inf checks synchronise with the host: not traceable
        compiled = torch.compile(lambda t: fn(t, "cuda"), fullgraph=True)
        xc = x.detach().clone().requires_grad_()
        xe = x.detach().clone().requires_grad_()
        loss_compiled = compiled(xc)
        loss_eager = fn(xe, "cuda")
    loss_compiled.backward()
    loss_eager.backward()
    _check(loss_compiled, loss_eager, 1e-6, f"{name} compiled loss")
    _check(xc.grad, xe.grad, 1e-5, f"{name} compiled grad")

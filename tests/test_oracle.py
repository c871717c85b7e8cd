"""Our losses against the float64 oracle (tests/oracle.py): values and gradients.

* float64 inputs: 1e-10 (values) / 1e-8 (gradients), relative over the whole tensor.
* float32 inputs: the oracle evaluated in float64 on the same float32 values; 1e-5 / 1e-4 (the project guide shared/docs/measuring.md).
* bfloat16 / float16 inputs: our error against the float64 oracle (on the same half-precision values) must be
  at most 2x the error of eager PyTorch computing the same loss in that dtype (the reference's own code,
  angle_emb.loss, run on the half tensors), and never below what storing the gradient in that dtype costs
  (half an ulp). Eager fp16 overflows once a norm exceeds 256, so the baseline uses moderate norms; a
  separate test shows ours stays finite and correct above 256, where the reference's angle loss is NaN.
* Output contract: a 0-dim tensor, float64 for float64 inputs and float32 otherwise; y_true of shape [2N] and
  [2N, 1] give the same result.
"""

from __future__ import annotations

import pytest
import torch

import oracle
from ak_testing import assert_close, check_against_oracle, grads_of, randn, rel_err, zigzag_labels

DTYPES = [torch.float32, torch.float64]
HALF_DTYPES = [torch.bfloat16, torch.float16]
SIZES = [(1, 2), (3, 6), (37, 130), (1000, 768)]
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-9, torch.float16: 2.0**-12}


def rounding_error(exact: torch.Tensor, dtype: torch.dtype) -> float:
    """The relative error of the correctly rounded tensor: the best any result stored in dtype can do."""
    return rel_err(exact.to(dtype), exact)


def _vs_oracle(ours_fn, oracle_fn, inputs, dtype, what, value_tol=None, grad_tol=None):
    return check_against_oracle(ours_fn, oracle_fn, inputs, dtype, what, value_tol, grad_tol)


# --------------------------------------------------------------------------------------------------------
# float64 / float32 against the oracle
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["graded", "ties", "binary", "equal"])
@pytest.mark.parametrize("n,d", SIZES)
def test_ranking_losses(ak, gen, n, d, kind, dtype):
    y = zigzag_labels(gen, n, kind)
    x = randn(gen, 2 * n, d)
    taus = (0.05, 1.0, 20.0) if n < 1000 else (20.0,)
    for tau in taus:
        for y_shape in ([2 * n], [2 * n, 1]) if n < 1000 else ([2 * n, 1],):
            labels = y.reshape(y_shape)
            _vs_oracle(lambda x: ak.cosine_loss(labels, x, tau), lambda x: oracle.cosine_loss(y, x, tau), [x], dtype,
                       f"cosine tau={tau} y{y_shape}")
            for pooling in ("sum", "mean"):
                _vs_oracle(lambda x: ak.angle_loss(labels, x, tau, pooling),
                           lambda x: oracle.angle_loss(y, x, tau, pooling), [x], dtype,
                           f"angle {pooling} tau={tau} y{y_shape}")


@pytest.mark.parametrize("label_dtype", [torch.int64, torch.int32, torch.float64, torch.float16])
def test_ranking_losses_accept_any_real_label_dtype(ak, gen, label_dtype):
    y = zigzag_labels(gen, 37, "ties")
    x = randn(gen, 74, 6)
    _vs_oracle(lambda x: ak.cosine_loss(y.to(label_dtype), x), lambda x: oracle.cosine_loss(y, x, 20.0), [x],
               torch.float32, f"cosine labels {label_dtype}")
    _vs_oracle(lambda x: ak.angle_loss(y.to(label_dtype)[:, None], x), lambda x: oracle.angle_loss(y, x, 1.0), [x],
               torch.float32, f"angle labels {label_dtype}")


def test_ranking_loss_large_n_graded(ak, gen):
    """3,000 pairs with continuous labels and with 3 heavy tie groups: the sort/prefix-sum path against the
    oracle's 3,000 x 3,000 matrix."""
    n, d = 3000, 32
    x = randn(gen, 2 * n, d)
    for kind in ("graded", "ties"):
        y = zigzag_labels(gen, n, kind)
        _vs_oracle(lambda x: ak.cosine_loss(y, x), lambda x: oracle.cosine_loss(y, x, 20.0), [x], torch.float32,
                   f"cosine N={n} {kind}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,d", [(1, 2), (3, 6), (37, 130), (300, 768)])
def test_in_batch_negative_loss(ak, gen, n, d, dtype):
    x = randn(gen, 2 * n, d)
    for kind in ("binary", "ones", "zeros"):
        y = zigzag_labels(gen, n, kind)
        for tau in (1.0, 20.0):
            _vs_oracle(lambda x: ak.in_batch_negative_loss(y, x, tau),
                       lambda x: oracle.in_batch_negative_loss(y, x, tau), [x], dtype, f"ibn {kind} tau={tau}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,d", [(2, 6), (3, 6), (37, 130), (300, 64)])
def test_in_batch_negative_loss_group_ids(ak, gen, n, d, dtype):
    """Identical texts (equal group ids) count as positives: random duplicates across pairs, duplicates of the
    partner's text, and a pair whose two texts are identical."""
    rows = 2 * n
    ids = torch.randint(0, max(2, rows // 2), (rows,), generator=gen)  # many collisions
    ids[0] = ids[1]  # pair 0: both texts identical
    ids[2] = ids[0]  # row 2 repeats row 0's text
    if n > 2:
        ids[4] = ids[3]  # row 4 repeats row 3's text (a duplicate of another pair's partner)
    x = randn(gen, rows, d)
    x[ids == ids[0]] = x[0].clone()  # identical texts have identical embeddings, as a real encoder gives them
    y = zigzag_labels(gen, n, "binary")
    y[:2] = 1.0
    for tau in (1.0, 20.0):
        _vs_oracle(lambda x: ak.in_batch_negative_loss(y, x, tau, group_ids=ids),
                   lambda x: oracle.in_batch_negative_loss(y, x, tau, group_ids=ids), [x], dtype,
                   f"ibn group_ids tau={tau}")
    # and group ids really change the loss whenever some row has an extra positive
    plain = ak.in_batch_negative_loss(y, x.to(dtype), 20.0)
    grouped = ak.in_batch_negative_loss(y, x.to(dtype), 20.0, group_ids=ids)
    assert not torch.equal(plain, grouped)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("b,d,neg_rows", [(1, 2, 1), (3, 6, 3), (37, 130, 37), (37, 130, 5), (300, 768, 300)])
def test_contrastive_with_negative_loss(ak, gen, b, d, neg_rows, dtype):
    text, pos, neg = randn(gen, b, d), randn(gen, b, d), randn(gen, neg_rows, d)
    for tau in (1.0, 20.0):
        _vs_oracle(lambda t, p: ak.contrastive_with_negative_loss(t, p, tau=tau),
                   lambda t, p: oracle.contrastive_with_negative_loss(t, p, None, tau), [text, pos], dtype,
                   f"contrastive tau={tau}")
        _vs_oracle(lambda t, p, n: ak.contrastive_with_negative_loss(t, p, n, tau),
                   lambda t, p, n: oracle.contrastive_with_negative_loss(t, p, n, tau), [text, pos, neg], dtype,
                   f"contrastive with negatives tau={tau}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,d", [(1, 2), (3, 6), (37, 130), (300, 768)])
@pytest.mark.parametrize("margin_degrees", [0.0, 10.0, 90.0, 179.0])
def test_arccon_loss(ak, gen, n, d, margin_degrees, dtype):
    h1 = randn(gen, n, d)
    h2 = h1 + 2.0 * randn(gen, n, d)  # correlated views (positive cosine ~0.45), well inside (-1, 1)
    for tau in (0.05, 1.0):
        _vs_oracle(lambda a, b: ak.arccon_loss(a, b, margin_degrees, tau),
                   lambda a, b: oracle.arccon_loss(a, b, margin_degrees, tau), [h1, h2], dtype,
                   f"arccon margin={margin_degrees} tau={tau}")


def test_arccon_default_margin_is_ten_degrees(ak, gen):
    h1, h2 = randn(gen, 37, 64), randn(gen, 37, 64)
    assert_close(ak.arccon_loss(h1, h2), oracle.arccon_loss(h1, h2, 10.0, 0.05), 1e-5, "arccon defaults")
    assert rel_err(ak.arccon_loss(h1, h2), oracle.arccon_loss(h1, h2, 0.0, 0.05)) > 1e-3  # the margin acts


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_arccon_margin_past_pi(ak, gen, dtype):
    """theta + margin > pi pins the positive logit at cos(pi) = -1 (and its gradient at 0)."""
    h1 = randn(gen, 37, 64)
    h2 = -h1 + 0.01 * randn(gen, 37, 64)  # theta within ~1 degree of 180
    h2[::2] = randn(gen, 19, 64)  # half the rows ordinary
    _vs_oracle(lambda a, b: ak.arccon_loss(a, b, 10.0, 0.05), lambda a, b: oracle.arccon_loss(a, b, 10.0, 0.05),
               [h1, h2], dtype, "arccon past pi")


def test_arccon_identical_views_finite_gradient(ak, gen):
    """h2 == h1: cos = 1, theta = 0, where arccos has an infinite slope; ours stays finite."""
    h1 = randn(gen, 37, 64, dtype=torch.float64)
    value, (g1, g2) = grads_of(lambda a, b: ak.arccon_loss(a, b, 10.0, 0.05), h1, h1.clone())
    assert torch.isfinite(g1).all() and torch.isfinite(g2).all()
    # against the contract's form (sin^2 floored at 1e-6), which is what differs from arccos at cos = 1
    true_value, (t1, t2) = grads_of(lambda a, b: oracle.arccon_loss(a, b, 10.0, 0.05, sin_squared_floor=1e-6),
                                    h1, h1.clone())
    assert_close(value, true_value, 1e-10, "arccon identical views value")
    assert_close(g1, t1, 1e-8, "arccon identical views grad h1")
    assert_close(g2, t2, 1e-8, "arccon identical views grad h2")
    # and the floor changes the exact value by at most sin(m) * 1e-3 / tau in the positive logit
    assert rel_err(value, oracle.arccon_loss(h1, h1, 10.0, 0.05)) < 1e-2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,d", [(1, 2), (3, 6), (37, 130), (1000, 768)])
def test_triplet_loss(ak, gen, n, d, dtype):
    anchor, weak, strong = randn(gen, n, d), randn(gen, n, d), randn(gen, n, d)
    for margin in (0.0, 0.1, 0.5, -0.2):
        _vs_oracle(lambda a, w, s: ak.triplet_loss(a, w, s, margin),
                   lambda a, w, s: oracle.triplet_loss(a, w, s, margin), [anchor, weak, strong], dtype,
                   f"triplet margin={margin}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", ["A", "B", "C"])
@pytest.mark.parametrize("groups,d", [(1, 6), (37, 130)])
def test_angle_loss_module(ak, gen, groups, d, fmt, dtype):
    rows = {"A": 2, "B": 2, "C": 3}[fmt] * groups
    labels = zigzag_labels(gen, groups, "binary") if fmt == "A" else torch.ones(rows)
    x = randn(gen, rows, d)
    for kwargs in ({}, dict(cosine_w=0.5, angle_w=1.0, angle_pooling_strategy="mean", cln_w=0.3, ibn_tau=5.0)):
        _vs_oracle(lambda x: ak.AngleLoss(dataset_format=fmt, **kwargs)(labels, x),
                   lambda x: oracle.angle_loss_module(labels, x, dataset_format=fmt, **kwargs), [x], dtype,
                   f"AngleLoss {fmt} {kwargs}")


# --------------------------------------------------------------------------------------------------------
# bfloat16 / float16: at most 2x eager PyTorch's own error in the same dtype
# --------------------------------------------------------------------------------------------------------
def _half_cases(ak, ref, y, y2d, binary, binary2d):
    """(name, ours, eager reference, oracle, number of tensor inputs)."""
    return [
        ("cosine", lambda x: ak.cosine_loss(y, x), lambda x: ref.cosine_loss(y2d, x),
         lambda x: oracle.cosine_loss(y, x, 20.0)),
        ("angle_sum", lambda x: ak.angle_loss(y, x, 20.0), lambda x: ref.angle_loss(y2d, x, 20.0),
         lambda x: oracle.angle_loss(y, x, 20.0)),
        ("angle_mean", lambda x: ak.angle_loss(y, x, 20.0, "mean"), lambda x: ref.angle_loss(y2d, x, 20.0, "mean"),
         lambda x: oracle.angle_loss(y, x, 20.0, "mean")),
        ("ibn", lambda x: ak.in_batch_negative_loss(binary, x), lambda x: ref.in_batch_negative_loss(binary2d, x),
         lambda x: oracle.in_batch_negative_loss(binary, x)),
        ("contrastive", lambda x: ak.contrastive_with_negative_loss(x[0::2], x[1::2]),
         lambda x: ref.contrastive_with_negative_loss(x[0::2], x[1::2]),
         lambda x: oracle.contrastive_with_negative_loss(x[0::2], x[1::2])),
    ]


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("n,d", [(37, 64), (200, 128)])
def test_half_precision_within_2x_of_eager(ak, ref_loss, gen, n, d, dtype):
    y = zigzag_labels(gen, n, "ties")
    binary = zigzag_labels(gen, n, "binary")
    x = randn(gen, 2 * n, d, dtype=dtype)  # norms ~ sqrt(d) <= 16: no fp16 overflow in the eager baseline
    floor = UNIT_ROUNDOFF[dtype]
    for name, ours_fn, eager_fn, oracle_fn in _half_cases(ak, ref_loss, y, y[:, None], binary, binary[:, None]):
        ours_value, (ours_grad,) = grads_of(ours_fn, x)
        eager_value, (eager_grad,) = grads_of(eager_fn, x)
        true_value, (true_grad,) = grads_of(oracle_fn, x.to(torch.float64))
        assert ours_value.dtype == torch.float32 and ours_value.dim() == 0, f"{name}: {ours_value.dtype}"
        assert ours_grad.dtype == dtype
        assert torch.isfinite(ours_value) and torch.isfinite(ours_grad).all(), name
        value_err, eager_value_err = rel_err(ours_value, true_value), rel_err(eager_value, true_value)
        grad_err, eager_grad_err = rel_err(ours_grad, true_grad), rel_err(eager_grad, true_grad)
        # the loss is returned in float32: its error may not exceed 2x eager's, nor float32 rounding
        assert value_err <= max(2 * eager_value_err, 1e-6), (
            f"{name} {dtype}: value error {value_err:.2e} > 2 x eager {eager_value_err:.2e}")
        # the gradient is returned in the input dtype: rounding it costs up to half an ulp
        assert grad_err <= max(2 * eager_grad_err, 2 * floor, 2 * rounding_error(true_grad, dtype)), (
            f"{name} {dtype}: grad error {grad_err:.2e} > 2 x eager {eager_grad_err:.2e}")


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_half_precision_module_and_arccse(ak, gen, dtype):
    """AngleLoss, arccon and triplet on half inputs: float32 loss, gradient in the input dtype, close to the
    float64 oracle (loss within float32-accumulation error, gradient within a few ulps of the half dtype)."""
    x = randn(gen, 74, 64, dtype=dtype)
    labels = zigzag_labels(gen, 37, "binary")
    floor = UNIT_ROUNDOFF[dtype]
    cases = [
        (lambda x: ak.AngleLoss(dataset_format="A", cosine_w=1.0)(labels, x),
         lambda x: oracle.angle_loss_module(labels, x, dataset_format="A", cosine_w=1.0)),
        (lambda x: ak.arccon_loss(x[0::2], x[1::2]), lambda x: oracle.arccon_loss(x[0::2], x[1::2])),
        (lambda x: ak.triplet_loss(x[:24], x[24:48], x[48:72], 0.1),
         lambda x: oracle.triplet_loss(x[:24], x[24:48], x[48:72], 0.1)),
    ]
    for ours_fn, oracle_fn in cases:
        value, (grad,) = grads_of(ours_fn, x)
        true_value, (true_grad,) = grads_of(oracle_fn, x.to(torch.float64))
        assert value.dtype == torch.float32 and value.dim() == 0 and grad.dtype == dtype
        assert_close(value, true_value, 1e-5, f"{dtype} value")
        assert_close(grad, true_grad, max(4 * rounding_error(true_grad, dtype), 8 * floor), f"{dtype} grad")


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_fp16_large_norms_finite_and_correct(ak, ref_loss, gen, pooling):
    """fp16 inputs with norms ~800 (> 256): c^2 + d^2 overflows fp16 in the reference's angle loss (NaN);
    ours accumulates in float32 and matches the float64 oracle."""
    n, d = 37, 64
    y = zigzag_labels(gen, n, "ties")
    x = randn(gen, 2 * n, d, dtype=torch.float16, scale=100.0)  # norms ~ 800
    assert x.float().norm(dim=1).min() > 256
    with torch.no_grad():
        assert not torch.isfinite(ref_loss.angle_loss(y[:, None], x, 20.0, pooling)), "reference expected to overflow"
    for ours_fn, oracle_fn in [
        (lambda x: ak.angle_loss(y, x, 20.0, pooling), lambda x: oracle.angle_loss(y, x, 20.0, pooling)),
        (lambda x: ak.cosine_loss(y, x), lambda x: oracle.cosine_loss(y, x, 20.0)),
        (lambda x: ak.in_batch_negative_loss((y > 0.5).float(), x),
         lambda x: oracle.in_batch_negative_loss((y > 0.5).float(), x)),
    ]:
        value, (grad,) = grads_of(ours_fn, x)
        true_value, (true_grad,) = grads_of(oracle_fn, x.to(torch.float64))
        assert value.dtype == torch.float32
        assert_close(value, true_value, 1e-5, "fp16 large-norm value")
        # gradients scale as 1/|x| (~1e-5 per element here, partly subnormal in fp16): allow a few times the
        # error of the correctly rounded gradient
        tol = max(4 * rounding_error(true_grad, torch.float16), 8 * UNIT_ROUNDOFF[torch.float16])
        assert_close(grad, true_grad, tol, "fp16 large-norm grad")


# --------------------------------------------------------------------------------------------------------
# output contract
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_output_dtype_and_shape(ak, gen, dtype):
    expected = torch.float64 if dtype == torch.float64 else torch.float32
    x = randn(gen, 12, 8, dtype=dtype)
    y = zigzag_labels(gen, 6, "binary")
    results = {
        "cosine": ak.cosine_loss(y, x),
        "angle": ak.angle_loss(y, x),
        "ibn": ak.in_batch_negative_loss(y, x),
        "contrastive": ak.contrastive_with_negative_loss(x[:4], x[4:8], x[8:]),
        "arccon": ak.arccon_loss(x[:6], x[6:]),
        "triplet": ak.triplet_loss(x[:4], x[4:8], x[8:]),
        "AngleLoss A": ak.AngleLoss(dataset_format="A", cosine_w=1.0)(y, x),
        "AngleLoss B": ak.AngleLoss(dataset_format="B")(y, x),
        "AngleLoss C": ak.AngleLoss(dataset_format="C", cosine_w=1.0)(y, x),
    }
    for name, value in results.items():
        assert value.dim() == 0, f"{name}: shape {tuple(value.shape)}"
        assert value.dtype == expected, f"{name}: {value.dtype} for {dtype} inputs, expected {expected}"
        assert torch.isfinite(value), name


def test_y_true_1d_and_2d_agree(ak, gen):
    x = randn(gen, 74, 130)
    y = zigzag_labels(gen, 37, "binary")
    for fn in (ak.cosine_loss, ak.angle_loss, ak.in_batch_negative_loss,
               lambda y, x: ak.AngleLoss(dataset_format="A", cosine_w=1.0)(y, x)):
        flat_value, (flat_grad,) = grads_of(lambda x: fn(y, x), x)
        col_value, (col_grad,) = grads_of(lambda x: fn(y[:, None], x), x)
        assert torch.equal(flat_value, col_value) and torch.equal(flat_grad, col_grad)


def test_functions_are_reexported(ak):
    from angle_kernels import functional, modules

    for name in ("cosine_loss", "angle_loss", "in_batch_negative_loss", "contrastive_with_negative_loss",
                 "arccon_loss", "triplet_loss"):
        assert getattr(ak, name) is getattr(functional, name)
    assert ak.AngleLoss is modules.AngleLoss

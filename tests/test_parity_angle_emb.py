"""Parity with the reference itself: angle-emb 0.6.1's `angle_emb.loss` functions and `angle_emb.AngleLoss`.

Fresh random inputs (seeded per test), values and gradients, every function and every dataset format, several
taus, both poolings, heavy label ties, all-equal labels, N = 1 and odd sizes, float32 and float64.

float64: ours against the reference in float64 (only summation order differs): 1e-10 / 1e-8.
float32: ours on float32 inputs against the reference evaluated in float64 on the same values: the issue's
criterion, values < 1e-5 and gradients < 1e-4 (relative, over the whole tensor). The reference is run in
float64 here because in float32 its own log(1 + S) (a logsumexp over [0, ...]) loses relative precision on
small losses (percent-level at L ~ 2e-6, which well-ranked batches at tau = 20 reach); comparing with it
would measure the reference's rounding, not ours.

The reference needs y_true of shape [2N, 1] (it indexes y_true[::2, 0]); ours is given [2N, 1] here too
(test_oracle.py covers [2N]). Inputs where the reference misbehaves (zero vectors, fp16 norms above 256,
labels outside {0, 1} for in-batch negatives) are not parity cases: see test_bad_inputs.py / test_oracle.py.
The first test checks the oracle (tests/oracle.py) against the reference, so the oracle can be trusted
where the reference cannot be run.
"""

from __future__ import annotations

import pytest
import torch

import oracle
from ak_testing import GRAD_TOL, VALUE_TOL, assert_close, grads_of, randn, rel_err, zigzag_labels

DTYPES = [torch.float32, torch.float64]
# (N pairs, D): N = 1, 3, 37, 1000 and D = 2, 6, 130, 768, combined to keep the run short.
SIZES = [(1, 2), (1, 768), (3, 6), (3, 2), (37, 130), (37, 6), (1000, 768), (1000, 2)]
# The softmax losses are O(N^2 D) in the reference (and in the float64 oracle): their largest case runs once.
XENT_SIZES = [(1, 2), (1, 768), (3, 6), (37, 130), (1000, 6)]
LABEL_KINDS = ["graded", "ties", "binary", "equal"]
TAUS = [0.05, 1.0, 20.0]
# The reference computes log(1 + S) as logsumexp([0, ...]): an absolute rounding error of ~1e-16 in float64
# however small the loss (a well-ranked batch at tau = 20 has L ~ 1e-6).
REF_ATOL = 1e-15


def _taus(n: int) -> list[float]:
    """Every tau on small batches; the default 20 on the 1000-pair ones (the reference is slow there)."""
    return TAUS if n < 1000 else [20.0]


def _both(ours_fn, ref_fn, inputs, dtype, what):
    """Values and gradients of ours (inputs in `dtype`) vs the reference on the same values in float64.

    In float32 a case that the formulas cannot resolve in float32 at all (the reference's own float32 run
    misses the tolerance too: e.g. a contrastive loss of 1e-14, which is logsumexp(l) - l_target of logits
    ~20, has an absolute rounding floor of ~1e-6) passes at the flash-attention rule: at most 2x the
    reference's own float32 error.
    """
    inputs = [x.to(dtype) for x in inputs]
    ours_value, ours_grads = grads_of(ours_fn, *inputs)
    ref_value, ref_grads = grads_of(ref_fn, *[x.to(torch.float64) for x in inputs])
    assert ours_value.dim() == 0, f"{what}: loss must be 0-dim, got shape {tuple(ours_value.shape)}"
    assert ours_value.dtype == dtype, f"{what}: loss dtype {ours_value.dtype}, expected {dtype}"
    checks = [("value", ours_value, ref_value, VALUE_TOL[dtype], REF_ATOL)]
    for k, (g, r) in enumerate(zip(ours_grads, ref_grads)):
        checks.append((f"grad of input {k}", g, r, GRAD_TOL[dtype], 0.0))
    for g in ours_grads:
        assert g.dtype == dtype, f"{what}: grad dtype {g.dtype}, expected {dtype}"
    ref32 = None
    for name, out, ref, tol, atol in checks:
        if dtype == torch.float32 and not _close(out, ref, tol, atol):
            if ref32 is None:
                value32, grads32 = grads_of(ref_fn, *inputs)
                ref32 = [value32, *grads32]
            eager_err = rel_err(ref32[[c[0] for c in checks].index(name)], ref)
            if eager_err > tol:  # float32 cannot resolve this case: hold ours to 2x the reference's own error
                assert torch.isfinite(out).all() and rel_err(out, ref) <= 2 * eager_err, (
                    f"{what} {name}: relative error {rel_err(out, ref):.3e}, reference float32 {eager_err:.3e}")
                continue
        assert_close(out, ref, tol, f"{what} {name}", atol=atol)
    return ours_value, ref_value


def _close(out, ref, tol, atol):
    diff = float(torch.linalg.vector_norm(out.detach().double() - ref.detach().double()))
    scale = float(torch.linalg.vector_norm(ref.detach().double()))
    return bool(torch.isfinite(out).all()) and diff <= tol * scale + atol


# --------------------------------------------------------------------------------------------------------
# the oracle agrees with the reference (so the oracle-based tests mean parity too)
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,d", [(1, 2), (3, 6), (37, 130)])
@pytest.mark.parametrize("kind", LABEL_KINDS)
def test_oracle_matches_reference(ref_loss, gen, n, d, kind):
    y = zigzag_labels(gen, n, kind).double()
    x = randn(gen, 2 * n, d, dtype=torch.float64)
    binary = zigzag_labels(gen, n, "binary").double()
    for tau in TAUS:
        cases = [
            (lambda x: oracle.cosine_loss(y, x, tau), lambda x: ref_loss.cosine_loss(y[:, None], x, tau)),
            (lambda x: oracle.angle_loss(y, x, tau, "sum"), lambda x: ref_loss.angle_loss(y[:, None], x, tau, "sum")),
            (lambda x: oracle.angle_loss(y, x, tau, "mean"), lambda x: ref_loss.angle_loss(y[:, None], x, tau, "mean")),
            (
                lambda x: oracle.in_batch_negative_loss(binary, x, tau),
                lambda x: ref_loss.in_batch_negative_loss(binary[:, None], x, tau),
            ),
        ]
        for oracle_fn, ref_fn in cases:
            o_value, o_grads = grads_of(oracle_fn, x)
            r_value, r_grads = grads_of(ref_fn, x)
            assert_close(o_value, r_value, 1e-12, "oracle vs reference value", atol=REF_ATOL)
            assert_close(o_grads[0], r_grads[0], 1e-10, "oracle vs reference grad")


def test_oracle_matches_reference_contrastive_and_formats(ref_loss, ref_angle_loss_class, gen):
    text, pos, neg = (randn(gen, 5, 8, dtype=torch.float64) for _ in range(3))
    for negatives in (None, neg):
        assert_close(
            oracle.contrastive_with_negative_loss(text, pos, negatives, 7.0),
            ref_loss.contrastive_with_negative_loss(text, pos, negatives, 7.0),
            1e-12,
            "oracle contrastive",
        )
    weights = dict(cosine_w=0.3, ibn_w=1.0, cln_w=0.5, angle_w=0.02, angle_tau=10.0)
    for fmt, rows in (("A", 10), ("B", 10), ("C", 15)):
        x = randn(gen, rows, 8, dtype=torch.float64)
        labels = zigzag_labels(gen, rows // 2, "binary") if fmt == "A" else torch.ones(rows)
        labels = labels.double()
        o_value, o_grads = grads_of(lambda x: oracle.angle_loss_module(labels, x, dataset_format=fmt, **weights), x)
        reference = ref_angle_loss_class(dataset_format=fmt, **weights)
        r_value, r_grads = grads_of(lambda x: reference(labels[:, None], x), x)
        assert_close(o_value, r_value, 1e-12, f"oracle format {fmt} value")
        assert_close(o_grads[0], r_grads[0], 1e-10, f"oracle format {fmt} grad")


# --------------------------------------------------------------------------------------------------------
# ranking losses: cosine_loss, angle_loss (sum and mean)
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", LABEL_KINDS)
@pytest.mark.parametrize("n,d", SIZES)
def test_cosine_loss_parity(ak, ref_loss, gen, n, d, kind, dtype):
    y = zigzag_labels(gen, n, kind).to(dtype)[:, None]
    x = randn(gen, 2 * n, d)
    for tau in _taus(n):
        ours, ref = _both(
            lambda x: ak.cosine_loss(y, x, tau),
            lambda x: ref_loss.cosine_loss(y, x, tau),
            [x],
            dtype,
            f"cosine tau={tau}",
        )
        if kind == "equal" or n == 1:
            assert ours.item() == 0.0 and ref.item() == 0.0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("kind", LABEL_KINDS)
@pytest.mark.parametrize("n,d", SIZES)
def test_angle_loss_parity(ak, ref_loss, gen, n, d, kind, pooling, dtype):
    y = zigzag_labels(gen, n, kind).to(dtype)[:, None]
    x = randn(gen, 2 * n, d)
    for tau in _taus(n):
        ours, ref = _both(
            lambda x: ak.angle_loss(y, x, tau, pooling),
            lambda x: ref_loss.angle_loss(y, x, tau, pooling),
            [x],
            dtype,
            f"angle {pooling} tau={tau}",
        )
        if kind == "equal" or n == 1:
            assert ours.item() == 0.0 and ref.item() == 0.0


def test_default_taus_match_reference(ak, ref_loss, gen):
    """Defaults: cosine tau 20, angle tau 1.0 and 'sum' pooling, ibn tau 20, contrastive tau 20."""
    y = zigzag_labels(gen, 9, "binary")[:, None]
    x = randn(gen, 18, 8)
    assert_close(ak.cosine_loss(y, x), ref_loss.cosine_loss(y, x), 1e-5, "cosine default tau")
    assert_close(ak.angle_loss(y, x), ref_loss.angle_loss(y, x), 1e-5, "angle default tau")
    assert_close(ak.in_batch_negative_loss(y, x), ref_loss.in_batch_negative_loss(y, x), 1e-5, "ibn default tau")
    assert_close(
        ak.contrastive_with_negative_loss(x[:9], x[9:]), ref_loss.contrastive_with_negative_loss(x[:9], x[9:]), 1e-5,
        "contrastive default tau",
    )


# --------------------------------------------------------------------------------------------------------
# in-batch negatives
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["binary", "ones", "zeros"])
@pytest.mark.parametrize("n,d", XENT_SIZES)
def test_in_batch_negative_loss_parity(ak, ref_loss, gen, n, d, kind, dtype):
    y = zigzag_labels(gen, n, kind).to(dtype)[:, None]
    x = randn(gen, 2 * n, d)
    for tau in _taus(n):
        ours, _ = _both(
            lambda x: ak.in_batch_negative_loss(y, x, tau),
            lambda x: ref_loss.in_batch_negative_loss(y, x, tau),
            [x],
            dtype,
            f"ibn tau={tau}",
        )
        if kind == "zeros" or n == 1:  # no targets, or each row's only candidate is its partner
            assert abs(ours.item()) < 1e-6


def test_in_batch_negative_loss_parity_large(ak, ref_loss, gen):
    """N = 1000 pairs, D = 768, float32, tau 20."""
    y = zigzag_labels(gen, 1000, "binary")[:, None]
    _both(
        lambda x: ak.in_batch_negative_loss(y, x, 20.0),
        lambda x: ref_loss.in_batch_negative_loss(y, x, 20.0),
        [randn(gen, 2000, 768)],
        torch.float32,
        "ibn N=1000 D=768",
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_in_batch_negative_loss_negative_weights_parity(ak, ref_loss, gen, dtype):
    """negative_weights only touches rows without a target in the reference: a no-op there, and here."""
    y = zigzag_labels(gen, 37, "binary").to(dtype)[:, None]
    x = randn(gen, 74, 130)
    for weight in (0.0, 0.5, 3.0):
        _both(
            lambda x: ak.in_batch_negative_loss(y, x, 20.0, weight),
            lambda x: ref_loss.in_batch_negative_loss(y, x, 20.0, weight),
            [x],
            dtype,
            f"ibn negative_weights={weight}",
        )
    plain = ref_loss.in_batch_negative_loss(y, x.to(dtype), 20.0, 0.0)
    weighted = ref_loss.in_batch_negative_loss(y, x.to(dtype), 20.0, 3.0)
    assert plain.item() == weighted.item(), "the reference's negative_weights is expected to be a no-op"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_in_batch_negative_loss_distinct_group_ids_parity(ak, ref_loss, gen, dtype):
    """group_ids with every text distinct adds no positive: same as the reference."""
    y = zigzag_labels(gen, 37, "binary").to(dtype)[:, None]
    x = randn(gen, 74, 6)
    ids = torch.randperm(74, generator=gen)
    _both(
        lambda x: ak.in_batch_negative_loss(y, x, 20.0, group_ids=ids),
        lambda x: ref_loss.in_batch_negative_loss(y, x, 20.0),
        [x],
        dtype,
        "ibn distinct group_ids",
    )


# --------------------------------------------------------------------------------------------------------
# contrastive with (and without) negatives
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_neg", [False, True])
@pytest.mark.parametrize("b,d", [(1, 2), (3, 6), (37, 130), (1000, 768)])
def test_contrastive_with_negative_loss_parity(ak, ref_loss, gen, b, d, with_neg, dtype):
    text, pos, neg = randn(gen, b, d), randn(gen, b, d), randn(gen, b, d)
    inputs = [text, pos, neg] if with_neg else [text, pos]
    for tau in _taus(b):
        _both(
            lambda *t: ak.contrastive_with_negative_loss(*t, tau=tau),
            lambda *t: ref_loss.contrastive_with_negative_loss(*t, tau=tau),
            inputs,
            dtype,
            f"contrastive neg={with_neg} tau={tau}",
        )


# --------------------------------------------------------------------------------------------------------
# AngleLoss, formats A, B, C
# --------------------------------------------------------------------------------------------------------
CONFIGS = {
    "defaults": {},
    "all_terms": dict(cosine_w=0.5, ibn_w=1.0, cln_w=1.0, angle_w=1.0, cosine_tau=20.0, ibn_tau=20.0, angle_tau=20.0),
    "paper": dict(cosine_w=1.0, ibn_w=1.0, cln_w=1.0, angle_w=1.0, angle_tau=1.0),
    "mean_pooling": dict(cosine_w=0.1, angle_w=0.5, angle_pooling_strategy="mean", angle_tau=5.0, ibn_tau=7.0),
    "no_ibn": dict(ibn_w=0.0, cosine_w=1.0, angle_w=0.5),
    "no_cln": dict(cln_w=0.0, angle_w=0.5),
    "only_angle": dict(ibn_w=0.0, cln_w=0.0, angle_w=1.0),
}


def _format_inputs(gen, fmt, groups, d, kind="binary"):
    if fmt == "A":
        return zigzag_labels(gen, groups, kind)[:, None], randn(gen, 2 * groups, d)
    rows = 2 * groups if fmt == "B" else 3 * groups
    return torch.ones(rows, 1), randn(gen, rows, d)  # labels unused by formats B and C


# every weight configuration on small batches; the 200-group batch (the reference is slow there) with the
# default and the all-terms weights
MODULE_CASES = [(g, d, c) for g, d in [(1, 6), (3, 2), (37, 130)] for c in CONFIGS]
MODULE_CASES += [(200, 768, c) for c in ("defaults", "all_terms")]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", ["A", "B", "C"])
@pytest.mark.parametrize("groups,d,config", MODULE_CASES)
def test_angle_loss_module_parity(ak, ref_angle_loss_class, gen, groups, d, config, fmt, dtype):
    kwargs = CONFIGS[config]
    labels, outputs = _format_inputs(gen, fmt, groups, d)
    labels = labels.to(dtype)
    ours_module = ak.AngleLoss(dataset_format=fmt, **kwargs)
    assert isinstance(ours_module, torch.nn.Module)
    ref_module = ref_angle_loss_class(dataset_format=fmt, **kwargs)
    _both(
        lambda x: ours_module(labels, x), lambda x: ref_module(labels, x), [outputs], dtype, f"AngleLoss {fmt} {config}"
    )


@pytest.mark.parametrize("kind", ["ones", "zeros"])
def test_angle_loss_module_format_a_all_equal_labels(ak, ref_angle_loss_class, gen, kind):
    """All-equal labels: the ranking terms are exactly 0; only in-batch negatives remain (0 for all zeros)."""
    labels, outputs = _format_inputs(gen, "A", 37, 130, kind)
    kwargs = CONFIGS["all_terms"]
    ours, ref = _both(
        lambda x: ak.AngleLoss(dataset_format="A", **kwargs)(labels, x),
        lambda x: ref_angle_loss_class(dataset_format="A", **kwargs)(labels, x),
        [outputs],
        torch.float32,
        f"AngleLoss A labels all {kind}",
    )
    if kind == "zeros":
        assert ours.item() == 0.0


def test_angle_loss_module_defaults_match_reference(ak, ref_angle_loss_class):
    ours, ref = ak.AngleLoss(), ref_angle_loss_class()
    names = ("cosine_w", "ibn_w", "cln_w", "angle_w", "cosine_tau", "ibn_tau", "angle_tau")
    for name in names + ("angle_pooling_strategy", "dataset_format"):
        assert getattr(ours, name) == getattr(ref, name), name

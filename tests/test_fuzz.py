"""Hypothesis-driven fuzzing against the float64 oracle: batch sizes, dimensions, label structures (continuous,
heavy ties, all equal, few distinct levels, integer and float label dtypes, [2N] and [2N, 1]), taus, scales of the
embeddings and input dtypes.

Bounded for CI: derandomized (the same examples every run), no example database, a fixed number of examples
per test; the whole file runs in well under a minute on two cores.

Tolerances: float64 1e-10 / 1e-8; float32 1e-5 / 1e-4 (values / gradients; see check_against_oracle in
conftest.py for the cases float32 cannot resolve at all). bfloat16/float16 inputs: the
loss (accumulated and returned in float32) within 1e-5 of the oracle evaluated on the same half values, and
the gradient (returned in the input dtype) within 4x the error of simply rounding the true gradient to that
dtype (which also covers float16 subnormals), or 4 units of roundoff. (Losses float32 cannot resolve, like
logsumexp(l) - l_target = 1e-3 for logits ~20, pass at 2x eager float32's error on the same values.)
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import oracle
from ak_testing import check_against_oracle, grads_of, rel_err

FUZZ = settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-9, torch.float16: 2.0**-12}


@st.composite
def label_sets(draw, n):
    """One label per pair, repeated on both rows: [2N] float, with a structure hypothesis picks."""
    kind = draw(st.sampled_from(["continuous", "levels", "equal", "binary"]))
    if kind == "continuous":
        values = draw(st.lists(st.floats(-5, 5, allow_nan=False, width=32), min_size=n, max_size=n))
    elif kind == "levels":
        levels = draw(st.integers(2, 6))
        values = draw(st.lists(st.integers(0, levels - 1), min_size=n, max_size=n))
    elif kind == "binary":
        values = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
    else:
        values = [draw(st.floats(-3, 3, allow_nan=False, width=32))] * n
    return torch.tensor(values, dtype=torch.float64).repeat_interleave(2)


def _embeddings(seed, rows, dim, scale, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=g, dtype=torch.float64) * scale
    if rows > 2 and seed % 5 == 0:
        x[1] = x[0] * 0.5  # an exactly collinear pair now and then
    return x.to(dtype)


def _compare(ours_fn, oracle_fn, inputs, dtype, what):
    if dtype in (torch.float64, torch.float32):
        check_against_oracle(ours_fn, oracle_fn, inputs, dtype, what)
        return
    ours_value, ours_grads = grads_of(ours_fn, *inputs)
    true_value, true_grads = grads_of(oracle_fn, *[x.to(torch.float64) for x in inputs])
    assert ours_value.dim() == 0 and ours_value.dtype == torch.float32, what
    value_err = rel_err(ours_value, true_value)
    if not value_err <= 1e-5:  # a case float32 cannot resolve: at most 2x eager float32 on the same values
        with oracle.computing_in(torch.float32):
            eager_value = oracle_fn(*[x.detach().float() for x in inputs])
        eager_err = rel_err(eager_value, true_value)
        assert value_err <= 2 * eager_err, f"{what} value ({dtype}): {value_err:.2e}, eager float32 {eager_err:.2e}"
    for g_ours, g_true in zip(ours_grads, true_grads):
        assert g_ours.dtype == dtype and torch.isfinite(g_ours).all(), what
        best = rel_err(g_true.to(dtype), g_true)  # the error of the correctly rounded gradient
        err = rel_err(g_ours, g_true)
        assert err <= max(4 * best, 4 * UNIT_ROUNDOFF[dtype]), f"{what} grad ({dtype}): {err:.2e}, rounding {best:.2e}"


@st.composite
def ranking_cases(draw):
    n = draw(st.integers(1, 48))
    dim = 2 * draw(st.integers(1, 40))
    return dict(
        n=n,
        dim=dim,
        labels=draw(label_sets(n)),
        label_dtype=draw(st.sampled_from([torch.float32, torch.float64, torch.int64])),
        column=draw(st.booleans()),
        tau=draw(st.sampled_from([0.05, 1.0, 20.0]) | st.floats(0.01, 50.0)),
        scale=draw(st.sampled_from([1e-3, 1.0, 30.0])),
        dtype=draw(st.sampled_from(DTYPES)),
        pooling=draw(st.sampled_from(["sum", "mean"])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@FUZZ
@given(case=ranking_cases())
def test_fuzz_ranking_losses(ak, case):
    labels = case["labels"]
    if case["label_dtype"] == torch.int64:
        labels = labels.round()
    ours_labels = labels.to(case["label_dtype"])
    if case["column"]:
        ours_labels = ours_labels[:, None]
    x = _embeddings(case["seed"], 2 * case["n"], case["dim"], case["scale"], case["dtype"])
    tau, pooling = case["tau"], case["pooling"]
    _compare(lambda x: ak.cosine_loss(ours_labels, x, tau), lambda x: oracle.cosine_loss(labels, x, tau), [x],
             case["dtype"], f"cosine {case}")
    _compare(lambda x: ak.angle_loss(ours_labels, x, tau, pooling),
             lambda x: oracle.angle_loss(labels, x, tau, pooling), [x], case["dtype"], f"angle {case}")


@FUZZ
@given(
    n=st.integers(1, 40),
    dim=st.integers(2, 48),  # D = 1: every direction is +-1, the true gradient is 0 and any result is rounding noise
    positive_fraction=st.sampled_from([0.0, 0.5, 1.0]),
    tau=st.sampled_from([1.0, 20.0]) | st.floats(0.05, 30.0),
    duplicates=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_fuzz_in_batch_negative_loss(ak, n, dim, positive_fraction, tau, duplicates, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    labels = (torch.rand(n, generator=g) < positive_fraction).double().repeat_interleave(2)
    x = _embeddings(seed, 2 * n, dim, 1.0, dtype)
    group_ids = None
    if duplicates:
        group_ids = torch.randint(0, max(1, n), (2 * n,), generator=g)
    _compare(lambda x: ak.in_batch_negative_loss(labels, x, tau, group_ids=group_ids),
             lambda x: oracle.in_batch_negative_loss(labels, x, tau, group_ids=group_ids), [x], dtype,
             f"ibn n={n} dim={dim} tau={tau} dup={duplicates}")


@FUZZ
@given(
    b=st.integers(1, 40),
    neg_rows=st.integers(0, 50),
    dim=st.integers(2, 48),  # D = 1: every direction is +-1, the true gradient is 0 and any result is rounding noise
    tau=st.floats(0.05, 30.0),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_fuzz_contrastive(ak, b, neg_rows, dim, tau, dtype, seed):
    text = _embeddings(seed, b, dim, 1.0, dtype)
    pos = _embeddings(seed + 1, b, dim, 1.0, dtype)
    if neg_rows:
        neg = _embeddings(seed + 2, neg_rows, dim, 1.0, dtype)
        _compare(lambda t, p, n: ak.contrastive_with_negative_loss(t, p, n, tau),
                 lambda t, p, n: oracle.contrastive_with_negative_loss(t, p, n, tau), [text, pos, neg], dtype,
                 f"contrastive b={b} neg={neg_rows}")
    else:
        _compare(lambda t, p: ak.contrastive_with_negative_loss(t, p, tau=tau),
                 lambda t, p: oracle.contrastive_with_negative_loss(t, p, None, tau), [text, pos], dtype,
                 f"contrastive b={b}")


@FUZZ
@given(
    n=st.integers(1, 32),
    dim=st.integers(2, 48),
    margin_degrees=st.sampled_from([0.0, 10.0]) | st.floats(0.0, 120.0),
    tau=st.sampled_from([0.05]) | st.floats(0.05, 2.0),
    noise=st.sampled_from([0.3, 1.0, 3.0]),
    dtype=st.sampled_from([torch.float64, torch.float32]),
    seed=st.integers(0, 2**31 - 1),
)
def test_fuzz_arccon(ak, n, dim, margin_degrees, tau, noise, dtype, seed):
    h1 = _embeddings(seed, n, dim, 1.0, torch.float64)
    h2 = (h1 + noise * _embeddings(seed + 1, n, dim, 1.0, torch.float64)).to(dtype)
    h1 = h1.to(dtype)
    cos_positive = torch.nn.functional.cosine_similarity(h1.double(), h2.double())
    theta = torch.rad2deg(torch.arccos(cos_positive.clamp(-1, 1)))
    # keep away from the margin's clamp at pi, where the value has a kink
    assume(not ((theta + margin_degrees - 180.0).abs() < 0.5).any())
    _compare(lambda a, b: ak.arccon_loss(a, b, margin_degrees, tau),
             lambda a, b: oracle.arccon_loss(a, b, margin_degrees, tau), [h1, h2], dtype,
             f"arccon n={n} m={margin_degrees} tau={tau}")


@FUZZ
@given(
    n=st.integers(1, 40),
    dim=st.integers(2, 48),  # D = 1: every direction is +-1, the true gradient is 0 and any result is rounding noise
    margin=st.floats(-0.5, 0.5),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_fuzz_triplet(ak, n, dim, margin, dtype, seed):
    anchor, weak, strong = (_embeddings(seed + k, n, dim, 1.0, dtype) for k in range(3))
    per_triplet = oracle.triplet_loss  # hinge kinks are measure-zero for random inputs
    _compare(lambda a, w, s: ak.triplet_loss(a, w, s, margin), lambda a, w, s: per_triplet(a, w, s, margin),
             [anchor, weak, strong], dtype, f"triplet n={n} margin={margin}")


@FUZZ
@given(
    fmt=st.sampled_from(["A", "B", "C"]),
    groups=st.integers(1, 24),
    half_dim=st.integers(1, 24),
    weights=st.tuples(*(st.sampled_from([0.0, 0.02, 0.5, 1.0]) for _ in range(4))),
    pooling=st.sampled_from(["sum", "mean"]),
    dtype=st.sampled_from([torch.float64, torch.float32]),
    seed=st.integers(0, 2**31 - 1),
)
def test_fuzz_angle_loss_module(ak, fmt, groups, half_dim, weights, pooling, dtype, seed):
    cosine_w, ibn_w, cln_w, angle_w = weights
    rows = (3 if fmt == "C" else 2) * groups
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (groups,), generator=g).double().repeat_interleave(2)
    if fmt != "A":
        labels = torch.ones(rows)  # formats B and C ignore labels
    x = _embeddings(seed, rows, 2 * half_dim, 1.0, dtype)
    kwargs = dict(cosine_w=cosine_w, ibn_w=ibn_w, cln_w=cln_w, angle_w=angle_w, angle_pooling_strategy=pooling)
    _compare(lambda x: ak.AngleLoss(dataset_format=fmt, **kwargs)(labels, x),
             lambda x: oracle.angle_loss_module(labels, x, dataset_format=fmt, **kwargs), [x], dtype,
             f"AngleLoss {fmt} {kwargs}")

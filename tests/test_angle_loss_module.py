"""AngleLoss, the module that weighs the AnglE terms, in its three dataset formats.

Format A: zigzag pairs with labels (cosine + in-batch negatives + angle); B: [query, positive] rows (contrastive
only); C: [query, positive, negative] rows (contrastive with and without negatives, plus the angle and cosine
terms on (q, pos) pairs labelled 1 and (q, neg) pairs labelled 0). Against the float64 oracle
(angle_kernels.testing.oracle, assembled as angle_emb 0.6.1's AngleLoss.__call__) on every backend (under the
Triton interpreter one dtype per format, in turn: in_turn) and over weight settings on the default
backend, float32 and float64, and bf16/fp16 at the half rule; parity with angle_emb.AngleLoss (skipped when
angle-emb is not installed); gradcheck in float64 and hypothesis fuzzing.
The options of the in-batch-negative terms (ibn_partition "gte", the false-negative filter) against the oracle's
dense formulas in float64, every format, with label-0 pairs and odd N; the defaults bitwise the reference's terms
as the package computes them; a margin that filters nothing, a planted duplicate that must be filtered; bad
options refused.
Tolerances and the half-precision rule: angle_kernels.testing.helpers.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from torch.autograd import gradcheck

import angle_kernels as ak
from angle_kernels.testing import oracle
from angle_kernels.testing.helpers import (
    FUZZ, HALF_DTYPES, REFERENCE_ATOL, across_backends, assert_close, check_against_oracle, float64_cannot_resolve,
    fuzz_embeddings, generator, grads_of, in_turn, leaf_like, outputs_and_grads, randn, skip_unless_implemented,
    zigzag_labels,
)

DTYPES = [torch.float64, torch.float32]
FORMATS = ["A", "B", "C"]
ROWS_PER_GROUP = {"A": 2, "B": 2, "C": 3}

CONFIGS = {
    "defaults": {},
    "all_terms": dict(cosine_w=0.5, ibn_w=1.0, cln_w=1.0, angle_w=1.0, cosine_tau=20.0, ibn_tau=20.0, angle_tau=20.0),
    "paper": dict(cosine_w=1.0, ibn_w=1.0, cln_w=1.0, angle_w=1.0, angle_tau=1.0),
    "mean_pooling": dict(cosine_w=0.1, angle_w=0.5, angle_pooling_strategy="mean", angle_tau=5.0, ibn_tau=7.0),
    "no_ibn": dict(ibn_w=0.0, cosine_w=1.0, angle_w=0.5),
    "no_cln": dict(cln_w=0.0, angle_w=0.5),
    "only_angle": dict(ibn_w=0.0, cln_w=0.0, angle_w=1.0),
}


def _inputs(gen, fmt, groups, d, kind="binary", dtype=torch.float32):
    """(labels [rows, 1], outputs [rows, D]); formats B and C ignore the labels."""
    rows = ROWS_PER_GROUP[fmt] * groups
    labels = zigzag_labels(gen, groups, kind) if fmt == "A" else torch.ones(rows)
    return labels[:, None], randn(gen, rows, d, dtype=dtype)


def _module_and_oracle(fmt, labels, kwargs, backend=None):
    module = ak.AngleLoss(dataset_format=fmt, backend=None if backend is None else backend.name, **kwargs)
    device_labels = labels.to("cpu" if backend is None else backend.device)
    return (lambda x: module(device_labels, x),
            lambda x: oracle.angle_loss_module(labels, x, dataset_format=fmt, **kwargs))


# --------------------------------------------------------------------------------------------------------
# against the oracle
# --------------------------------------------------------------------------------------------------------
# Under the Triton interpreter (seconds a case), each format in one dtype, in turn (in_turn): a format's weighing of
# the terms is front-end code, the same on every backend, which the torch backend's cases check in every dtype; what
# the Triton backend adds are its ops, held to the oracle in every dtype (with every option of similarity_lse) in
# tests/ops. There, too, a case takes 5 groups where it takes 12 elsewhere: each group is a program of the pair-score
# kernels, and both sizes are one row block of the similarity kernels (up to 16 rows through the interpreter); format
# A's labels still hold both values and the filter still drops columns (test_ibn_options_every_backend checks).
BACKEND_DTYPES = (torch.float64, torch.float32, torch.bfloat16)
BACKEND_GROUPS = 12
INTERPRETED_GROUPS = 5


def _groups_on(backend):
    return INTERPRETED_GROUPS if backend.interpreted else BACKEND_GROUPS


@pytest.mark.parametrize("backend, fmt, dtype", across_backends(
    [(fmt, dtype) for fmt in FORMATS for dtype in BACKEND_DTYPES], in_turn(FORMATS, BACKEND_DTYPES)),
    indirect=["backend"])
def test_every_backend(backend, fmt, dtype):
    labels, x = _inputs(generator("module_backends", fmt, dtype), fmt, _groups_on(backend), 32, dtype=dtype)
    ours, exact = _module_and_oracle(fmt, labels, CONFIGS["all_terms"], backend)
    check_against_oracle(ours, exact, [x], f"AngleLoss {fmt} on {backend.name}", device=backend.device)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("groups,d", [(1, 6), (37, 130)])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_against_oracle(gen, groups, d, fmt, config, dtype):
    labels, x = _inputs(gen, fmt, groups, d, dtype=dtype)
    ours, exact = _module_and_oracle(fmt, labels, CONFIGS[config])
    check_against_oracle(ours, exact, [x], f"AngleLoss {fmt} {config}")


def test_label_shapes_give_identical_results(gen):
    """Format A's labels of shape [2N] and [2N, 1]: bitwise the same loss and gradient."""
    labels, x = _inputs(gen, "A", 37, 130)
    module = ak.AngleLoss(dataset_format="A", cosine_w=1.0)
    flat = outputs_and_grads(lambda x: module(labels[:, 0], x), [leaf_like(x)])
    column = outputs_and_grads(lambda x: module(labels, x), [leaf_like(x)])
    assert all(torch.equal(a, b) for a, b in zip(flat[0] + flat[1], column[0] + column[1]))


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_half_precision(gen, fmt, dtype):
    labels, x = _inputs(gen, fmt, 37, 64, dtype=dtype)
    ours, exact = _module_and_oracle(fmt, labels, CONFIGS["all_terms"])
    check_against_oracle(ours, exact, [x], f"AngleLoss {fmt} {dtype}")


# --------------------------------------------------------------------------------------------------------
# parity with angle-emb 0.6.1's AngleLoss
# --------------------------------------------------------------------------------------------------------
# every weight configuration on small batches; the 200-group batch with the default and the all-terms weights
PARITY_CASES = [(g, d, c) for g, d in [(1, 6), (3, 2), (37, 130)] for c in CONFIGS]
PARITY_CASES += [(200, 768, c) for c in ("defaults", "all_terms")]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("groups,d,config", PARITY_CASES)
def test_parity_with_reference(ref_angle_loss_class, gen, groups, d, config, fmt, dtype):
    labels, x = _inputs(gen, fmt, groups, d, dtype=dtype)
    labels = labels.to(dtype)
    ours = ak.AngleLoss(dataset_format=fmt, **CONFIGS[config])
    reference = ref_angle_loss_class(dataset_format=fmt, **CONFIGS[config])
    check_against_oracle(lambda x: ours(labels, x), lambda x: reference(labels, x), [x], f"AngleLoss {fmt} {config}",
                         value_atol=REFERENCE_ATOL)


@pytest.mark.parametrize("kind", ["ones", "zeros"])
def test_parity_with_all_equal_labels(ref_angle_loss_class, gen, kind):
    """All-equal labels: the ranking terms are exactly 0; only in-batch negatives remain (0 for all zeros)."""
    labels, x = _inputs(gen, "A", 37, 130, kind)
    kwargs = CONFIGS["all_terms"]
    (value,), _ = check_against_oracle(lambda x: ak.AngleLoss(dataset_format="A", **kwargs)(labels, x),
                                       lambda x: ref_angle_loss_class(dataset_format="A", **kwargs)(labels, x), [x],
                                       f"AngleLoss A labels all {kind}", value_atol=REFERENCE_ATOL)
    if kind == "zeros":
        assert value.item() == 0.0


def test_what_a_term_does_not_compute_is_not_checked(gen):
    """Format B has no angle term: its prefixes may be odd (Espresso with an odd ese_compression_size: "the angle
    score splits each prefix in halves and needs even widths" before), and its value is that of angle_w = 0; a
    pooling strategy no term uses (angle_w = 0, or format B) is not read, as angle-emb never reads it. Where the
    angle term runs, both are refused as before."""
    x = randn(gen, 12, 32)
    with_angle = ak.AngleLoss(dataset_format="B", dims=(7, 32))(None, x)
    assert torch.equal(with_angle, ak.AngleLoss(dataset_format="B", dims=(7, 32), angle_w=0.0)(None, x))
    labels = zigzag_labels(gen, 6, "binary")
    plain = ak.AngleLoss(dataset_format="A", angle_w=0.0)(labels, x)
    assert torch.equal(ak.AngleLoss(dataset_format="A", angle_w=0.0, angle_pooling_strategy="avg")(labels, x), plain)
    ak.AngleLoss(dataset_format="B", angle_pooling_strategy="cls")(None, x)
    with pytest.raises(ValueError, match="even widths"):
        ak.AngleLoss(dataset_format="A", dims=(7, 32))(labels, x)
    odd = randn(gen, 12, 31)
    ak.AngleLoss(dataset_format="B")(None, odd)
    for fmt in ("A", "C"):
        with pytest.raises(ValueError, match="outputs needs an even number of columns; got 31"):
            ak.AngleLoss(dataset_format=fmt)(labels, odd)
    with pytest.raises(ValueError, match="angle_pooling_strategy"):
        ak.AngleLoss(dataset_format="A", angle_pooling_strategy="avg")


def test_defaults_match_reference(ref_angle_loss_class):
    ours, reference = ak.AngleLoss(), ref_angle_loss_class()
    assert isinstance(ours, torch.nn.Module)
    for name in ("cosine_w", "ibn_w", "cln_w", "angle_w", "cosine_tau", "ibn_tau", "angle_tau",
                 "angle_pooling_strategy", "dataset_format"):
        assert getattr(ours, name) == getattr(reference, name), name


# --------------------------------------------------------------------------------------------------------
# gradcheck and fuzzing
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_gradcheck(gen, fmt):
    labels, x = _inputs(gen, fmt, 4 if fmt != "C" else 3, 6, dtype=torch.float64)
    if fmt == "A":
        labels[:2] = 1.0
    module = ak.AngleLoss(dataset_format=fmt, cosine_w=0.5, angle_w=0.5, angle_tau=2.0, ibn_tau=3.0, cosine_tau=2.0)
    assert gradcheck(lambda x: module(labels, x), (leaf_like(x),), eps=1e-6, atol=1e-6, rtol=1e-4)


@FUZZ
@given(
    fmt=st.sampled_from(FORMATS),
    groups=st.integers(1, 24),
    half_dim=st.integers(1, 24),
    weights=st.tuples(*(st.sampled_from([0.0, 0.02, 0.5, 1.0]) for _ in range(4))),
    pooling=st.sampled_from(["sum", "mean"]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_fuzz(fmt, groups, half_dim, weights, pooling, dtype, seed):
    cosine_w, ibn_w, cln_w, angle_w = weights
    rows = ROWS_PER_GROUP[fmt] * groups
    labels = torch.ones(rows)  # formats B and C ignore labels
    if fmt == "A":
        labels = torch.randint(0, 2, (groups,), generator=torch.Generator().manual_seed(seed)).double()
        labels = labels.repeat_interleave(2)
    x = fuzz_embeddings(seed, rows, 2 * half_dim, 1.0, dtype)
    kwargs = dict(cosine_w=cosine_w, ibn_w=ibn_w, cln_w=cln_w, angle_w=angle_w, angle_pooling_strategy=pooling)
    ours, exact = _module_and_oracle(fmt, labels, kwargs)
    assume(dtype != torch.float64 or not float64_cannot_resolve(exact(x)))
    check_against_oracle(ours, exact, [x], f"AngleLoss {fmt} {kwargs}")


# --------------------------------------------------------------------------------------------------------
# the in-batch-negative options: ibn_partition and the false-negative filter
# --------------------------------------------------------------------------------------------------------
FILTERS = {"off": {}, "absolute": dict(false_negative_margin=0.2),
           "relative": dict(false_negative_margin=0.5, false_negative_strategy="relative")}
PARTITIONS = ["angle", "gte"]


def _paired_inputs(gen, fmt, groups, d=16, noise=1.5, dtype=torch.float64):
    """(labels [rows], outputs [rows, D]) whose second row of a group lies near its first (noise 1.5: cos ~ 0.55;
    random rows: 0 +- 0.25), so that the FILTERS drop some in-batch columns but not all; format C's negatives
    are random. Format A's labels mix 1 and 0 (pair 0 labelled 1, pair 1 labelled 0, the rest random)."""
    query = randn(gen, groups, d, dtype=torch.float64)
    rows = [query, query + noise * randn(gen, groups, d, dtype=torch.float64)]
    if fmt == "C":
        rows.append(randn(gen, groups, d, dtype=torch.float64))
    outputs = torch.stack(rows, dim=1).reshape(-1, d).to(dtype)
    if fmt != "A":
        return torch.ones(outputs.shape[0]), outputs
    labels = torch.randint(0, 2, (groups,), generator=gen).double()
    labels[:2] = torch.tensor([1.0, 0.0])[:groups]
    return labels.repeat_interleave(2), outputs


@pytest.mark.parametrize("groups", [2, 7])
@pytest.mark.parametrize("filtering", sorted(FILTERS))
@pytest.mark.parametrize("partition", PARTITIONS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_ibn_options_against_oracle(gen, fmt, partition, filtering, groups):
    """Values and gradients in float64 against the oracle's dense formulas, with every term weighted in (an
    ibn_tau of 5 keeps the contrastive terms O(1)); on the larger batch the filter cases are checked to drop
    columns (the oracle's value changes)."""
    labels, x = _paired_inputs(gen, fmt, groups)
    unfiltered = dict(CONFIGS["all_terms"], ibn_tau=5.0, ibn_partition=partition)
    ours, exact = _module_and_oracle(fmt, labels, dict(unfiltered, **FILTERS[filtering]))
    check_against_oracle(ours, exact, [x], f"AngleLoss {fmt} {partition} filter {filtering}")
    if filtering != "off" and groups > 2:
        unfiltered = oracle.angle_loss_module(labels, x, dataset_format=fmt, **unfiltered)
        assert float(exact(x)) < float(unfiltered) - 1e-3, "the filter drops nothing in this case"


IBN_BACKEND_DTYPES = (torch.float32, torch.bfloat16)


@pytest.mark.parametrize("backend, fmt, dtype", across_backends(
    [(fmt, dtype) for fmt in FORMATS for dtype in IBN_BACKEND_DTYPES], in_turn(FORMATS, IBN_BACKEND_DTYPES)),
    indirect=["backend"])
def test_ibn_options_every_backend(backend, fmt, dtype):
    skip_unless_implemented(backend, "similarity_lse")
    labels, x = _paired_inputs(generator("ibn_options_backends", fmt, dtype), fmt, _groups_on(backend), 32,
                               dtype=dtype)
    kwargs = dict(ibn_partition="gte", **FILTERS["relative"])
    ours, exact = _module_and_oracle(fmt, labels, kwargs, backend)
    check_against_oracle(ours, exact, [x], f"AngleLoss {fmt} gte, filtered, on {backend.name}", device=backend.device)
    unfiltered = oracle.angle_loss_module(labels, x.double(), dataset_format=fmt, ibn_partition="gte")
    assert float(exact(x.double())) < float(unfiltered) - 1e-3, "the filter drops nothing in this case"


@pytest.mark.parametrize("fmt", FORMATS)
def test_default_ibn_options_are_the_reference_terms_bitwise(gen, fmt):
    """ibn_partition="angle" without a filter: bit for bit the package's reference terms (the public functions
    angle-emb's AngleLoss is assembled from), value and gradient."""
    labels, x = _paired_inputs(gen, fmt, 9, dtype=torch.float32)
    module = ak.AngleLoss(dataset_format=fmt, angle_w=0.0, ibn_partition="angle", false_negative_margin=None)

    def reference_terms(x):
        if fmt == "A":
            return ak.in_batch_negative_loss(labels, x, tau=20.0)
        if fmt == "B":
            return ak.contrastive_with_negative_loss(x[0::2], x[1::2], tau=20.0)
        q, p, n = x[0::3], x[1::3], x[2::3]
        return (ak.contrastive_with_negative_loss(q, p, tau=20.0) + ak.contrastive_with_negative_loss(q, p, n)) / 2

    value, grads = grads_of(lambda x: module(labels, x), x)
    expected, expected_grads = grads_of(reference_terms, x)
    assert torch.equal(value, expected) and torch.equal(grads[0], expected_grads[0])


@pytest.mark.parametrize("strategy, margin", [("absolute", -2.5), ("relative", -1e3)])
@pytest.mark.parametrize("partition", PARTITIONS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_margin_that_filters_nothing_changes_nothing(gen, fmt, partition, strategy, margin):
    """Thresholds above every cosine: the filtered path (similarity_lse blocks) equals the unfiltered one (for
    "angle", the similarity_xent path of the reference's terms)."""
    labels, x = _paired_inputs(gen, fmt, 7)
    options = dict(dataset_format=fmt, angle_w=0.0, ibn_partition=partition)
    filtered = grads_of(lambda x: ak.AngleLoss(**options, false_negative_margin=margin,
                                               false_negative_strategy=strategy)(labels, x), x)
    unfiltered = grads_of(lambda x: ak.AngleLoss(**options)(labels, x), x)
    assert_close(filtered[0], unfiltered[0], 1e-10, "value")
    assert_close(filtered[1][0], unfiltered[1][0], 1e-10, "gradient")


@pytest.mark.parametrize("partition", PARTITIONS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_planted_duplicate_is_filtered(gen, fmt, partition):
    """A negative column equal to a positive (format A: the first text of a label-0 pair repeats pair 0's second
    text; B: pair 1's positive repeats pair 0's; C: group 0's negative repeats its positive) scores the positive's
    cosine, so a margin of 1e-4 drops it (any margin above contract.FILTER_TIE_ALLOWANCE, which keeps ties). The
    same margin changes nothing without the duplicate (no other column comes that close), so the change it makes
    with the duplicate is the duplicate's, and it matches the oracle."""
    labels, clean = _paired_inputs(gen, fmt, 7, noise=0.3)
    planted = clean.clone()
    target, source = {"A": (2, 1), "B": (3, 1), "C": (2, 1)}[fmt]
    planted[target] = planted[source]
    kwargs = dict(angle_w=0.0, ibn_partition=partition)
    loss = ak.AngleLoss(dataset_format=fmt, **kwargs)
    filtered = ak.AngleLoss(dataset_format=fmt, false_negative_margin=1e-4, **kwargs)
    # This batch's in-batch loss is small (~1e-5): a logsumexp of logits up to the scale, 20, less a logit, which
    # float64 rounds to a few ulps of 20 (3.6e-15) in any order of operations: the filtered call (similarity_lse),
    # the unfiltered one (similarity_xent) and the float64 oracle agree to that, not to 1e-10 of the loss.
    rounding = 16 * 20 * 2.0**-52
    assert_close(filtered(labels, clean), loss(labels, clean), 1e-10, "clean batch", atol=rounding)
    assert float(filtered(labels, planted)) < float(loss(labels, planted)) - 1e-3
    ours, exact = _module_and_oracle(fmt, labels, dict(kwargs, false_negative_margin=1e-4))
    check_against_oracle(ours, exact, [planted], f"AngleLoss {fmt} {partition} with a planted duplicate",
                         value_atol=rounding)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(ibn_partition="joint"), ValueError, "ibn_partition"),
    (dict(ibn_partition=None), ValueError, "ibn_partition"),
    (dict(false_negative_margin="0.1"), TypeError, "false_negative_margin"),
    (dict(false_negative_margin=True), TypeError, "false_negative_margin"),
    (dict(false_negative_margin=float("nan")), ValueError, "false_negative_margin"),
    (dict(false_negative_strategy="percent"), ValueError, "false_negative_strategy"),
])
def test_bad_ibn_options_raise(kwargs, error, match):
    with pytest.raises(error, match=match):
        ak.AngleLoss(dataset_format="A", **kwargs)


def test_ibn_options_in_repr():
    text = repr(ak.AngleLoss(dataset_format="B", ibn_partition="gte", false_negative_margin=0.05,
                             false_negative_strategy="relative"))
    assert "ibn_partition='gte'" in text and "false_negative_margin=0.05" in text
    assert "false_negative_strategy='relative'" in text


def test_a_pooling_strategy_set_after_construction_is_checked_at_the_call(gen):
    """angle-emb reads its attributes at each call and raises for an unknown pooling strategy there; ours had checked
    it at construction only and computed 'sum' for anything else set afterwards. With angle_w = 0 it is not read."""
    outputs = torch.randn(8, 16, generator=gen, dtype=torch.float64)
    labels = torch.tensor([1.0, 0.0, 1.0, 0.0]).repeat_interleave(2)
    loss = ak.AngleLoss(dataset_format="A", cosine_w=1.0, angle_w=1.0)
    loss.angle_pooling_strategy = "max"
    with pytest.raises(ValueError, match="angle_pooling_strategy"):
        loss(labels, outputs)
    loss.angle_w = 0.0
    assert torch.isfinite(loss(labels, outputs))


@pytest.mark.parametrize("fmt", ["A", "C"])  # format B's one term has no weight
def test_every_weight_zero_gives_a_zero_that_backward_takes(fmt):
    """Every term's weight 0: a zero connected to the embeddings (zero gradients), as every other zero loss of the
    package; it had no graph, and loss.backward() raised."""
    gen = torch.Generator().manual_seed(0)
    labels, x = _inputs(gen, fmt, 3, 6)
    x.requires_grad_(True)
    loss = ak.AngleLoss(dataset_format=fmt, cosine_w=0.0, ibn_w=0.0, cln_w=0.0, angle_w=0.0)(labels, x)
    loss.backward()
    assert loss.item() == 0.0 and loss.dtype == torch.float32 and torch.equal(x.grad, torch.zeros_like(x))


@pytest.mark.parametrize("fmt, name", [(fmt, name) for fmt, names in (
    ("A", ("cosine_w", "ibn_w", "angle_w")), ("C", ("cosine_w", "ibn_w", "cln_w", "angle_w"))) for name in names])
def test_a_term_weight_past_the_compute_dtypes_range_is_refused_by_name(fmt, name):
    """A term's weight multiplies it in float32 for 32- and 16-bit embeddings: cosine_w=1e300 was inf there (an inf
    loss and NaN gradients, as angle-emb gives). Refused at the call (the embeddings' dtype decides the range),
    naming the weight and the range; float64 embeddings take it, the loss the term times the weight. A weight
    that computes nothing (format A's cln_w, format B's weights, a negative weight) is not refused."""
    labels, x = _inputs(torch.Generator().manual_seed(0), fmt, 3, 6, dtype=torch.float64)
    zero = dict(cosine_w=0.0, ibn_w=0.0, cln_w=0.0, angle_w=0.0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        with pytest.raises(ValueError, match=rf"^{name} must be within \+-3\.40282e\+38 \(float32's range: the loss "
                                             rf"of {str(dtype)[6:]} embeddings is computed in float32"):
            ak.AngleLoss(dataset_format=fmt, **{**zero, name: 1e300})(labels, x.to(dtype))
        ak.AngleLoss(dataset_format=fmt, **{**zero, "ibn_w": 1.0, name: -1e300})(labels, x.to(dtype))
    term = ak.AngleLoss(dataset_format=fmt, **{**zero, name: 1.0})(labels, x)
    torch.testing.assert_close(ak.AngleLoss(dataset_format=fmt, **{**zero, name: 1e300})(labels, x), 1e300 * term,
                               rtol=1e-12, atol=0)
    if fmt == "A":  # format B reads the same zigzag rows
        for unused in ("A", dict(cln_w=1e300)), ("B", dict(cosine_w=1e300, ibn_w=1e300, angle_w=1e300)):
            assert torch.isfinite(ak.AngleLoss(dataset_format=unused[0], **unused[1])(labels, x.float()))


@pytest.mark.parametrize("fmt, name", [(fmt, name) for fmt, names in (
    ("A", ("cosine_w", "ibn_w", "angle_w")), ("C", ("cosine_w", "ibn_w", "cln_w", "angle_w"))) for name in names])
def test_a_term_weight_times_its_tau_past_the_compute_dtypes_range_is_refused_by_name(fmt, name):
    """The term's backward multiplies its weight by its logits' tau in float32 for 32- and 16-bit embeddings:
    cosine_w=3e37 with cosine_tau 20 gave a finite loss and NaN gradients (24 of 64 entries; angle-emb gives NaN
    too). Refused at the call, naming both; just inside the range every gradient is the float64 one (or inf where
    that is past float32's range), none NaN."""
    tau_name = {"cosine_w": "cosine_tau", "ibn_w": "ibn_tau", "cln_w": "ibn_tau", "angle_w": "angle_tau"}[name]
    labels, x = _inputs(torch.Generator().manual_seed(0), fmt, 3, 6, dtype=torch.float64)
    zero = dict(cosine_w=0.0, ibn_w=0.0, cln_w=0.0, angle_w=0.0)
    tau = getattr(ak.AngleLoss(dataset_format=fmt), tau_name)
    with pytest.raises(ValueError, match=rf"^{name} x {tau_name} must be within 3\.40282e\+38 \(float32's range: the "
                                         r"backward of the loss of float32 embeddings multiplies .*got 5\.1\d*e\+38$"):
        ak.AngleLoss(dataset_format=fmt, **{**zero, name: 1.5 * 3.4028e38 / tau})(labels, x.float())
    weight = 0.99 * 3.4028e38 / tau
    grads = []
    for dtype in (torch.float64, torch.float32):
        leaf = x.to(dtype).detach().clone().requires_grad_()
        ak.AngleLoss(dataset_format=fmt, **{**zero, name: weight})(labels, leaf).backward()
        grads.append(leaf.grad.double())
    exact, single = grads
    assert not single.isnan().any()
    fits = exact.abs() < 3.4e38
    assert torch.equal(single[~fits].abs(), torch.full_like(single[~fits], float("inf")))
    torch.testing.assert_close(single[fits], exact[fits], rtol=1e-3, atol=1e-6 * float(exact[fits].abs().max()))


@pytest.mark.parametrize("name, value, said", [
    ("angle_tau", float("inf"), "angle_tau must be finite"), ("cosine_tau", 0.0, "cosine_tau must be > 0"),
    ("ibn_w", float("nan"), "ibn_w must be finite"), ("ibn_partition", "bogus", "ibn_partition must be one of"),
    ("false_negative_strategy", "bogus", "false_negative_strategy must be one of"),
    ("false_negative_margin", float("nan"), "false_negative_margin must be finite")])
def test_a_setting_assigned_after_construction_is_checked_at_the_call(name, value, said):
    """angle-emb sets AngleLoss's attributes after construction; one set to a value the constructor refuses was
    computed with (angle_tau = inf: a NaN loss; cosine_tau = -20: a finite wrong one); now refused at the call."""
    labels, x = _inputs(torch.Generator().manual_seed(0), "A", 3, 6)
    module = ak.AngleLoss(dataset_format="A")
    setattr(module, name, value)
    with pytest.raises(ValueError, match=said):
        module(labels, x)
    module = ak.AngleLoss(dataset_format="A")
    module.angle_tau = 5.0  # a valid one takes effect
    assert module(labels, x).item() == ak.AngleLoss(dataset_format="A", angle_tau=5.0)(labels, x).item()


def test_keywords_the_constructor_does_not_take_are_ignored_with_a_warning():
    """Taken, as angle-emb's AngleLoss takes them, but said: `AngleLoss(layer_weights=...)` (an argument of forward)
    or a misspelt keyword changed nothing, in silence."""
    import warnings

    with pytest.warns(UserWarning, match=r"AngleLoss ignores the keyword argument\(s\) \['dimz', 'layer_weights'\].*"
                                         r"layer_weights is an argument of forward.*; did you mean dims \(for "
                                         r"dimz\)\?$"):
        ak.AngleLoss(dataset_format="B", dimz=(8,), layer_weights=[1.0])
    with pytest.warns(UserWarning, match=r"\['cosine_weight', 'zzz'\], .* not take; did you mean cosine_w \(for "
                                         r"cosine_weight\)\?$"):  # nothing close to zzz
        ak.AngleLoss(cosine_weight=1.0, zzz=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ak.AngleLoss(dataset_format="B", dims=(8, 16))


@pytest.mark.parametrize("fmt, weights, options, said", [
    ("A", dict(ibn_w=0.0, cosine_w=1.0), dict(false_negative_margin=0.1),
     "AngleLoss's false_negative_margin=0.1 has no effect: format A computes no in-batch term where ibn_w is 0"),
    ("C", dict(ibn_w=0.0, cln_w=0.0, cosine_w=1.0), dict(ibn_partition="gte", false_negative_margin=0.1),
     "false_negative_margin=0.1 and ibn_partition='gte' have no effect: format C computes no in-batch term where "
     "ibn_w and cln_w are 0"),
])
def test_in_batch_options_without_an_in_batch_term_are_said_to_do_nothing(gen, monkeypatch, fmt, weights, options,
                                                                          said):
    """The false-negative filter and the partition qualify the in-batch terms: given where their weights are 0 they
    change nothing, which a warning says (once per process: every step checks), where it passed in silence; with
    an in-batch term on (or in format B, whose contrastive term always runs) no warning."""
    import warnings

    from angle_kernels import inputs

    monkeypatch.setattr(inputs, "_said_no_effect", set())
    x = randn(gen, 12, 32)
    labels = zigzag_labels(gen, 6, "binary") if fmt == "A" else None
    with pytest.warns(UserWarning, match=re.escape(said)):
        loss = ak.AngleLoss(dataset_format=fmt, **weights, **options)(labels, x)
    assert torch.equal(loss, ak.AngleLoss(dataset_format=fmt, **weights)(labels, x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ak.AngleLoss(dataset_format=fmt, **weights, **options)(labels, x)  # said once
        ak.AngleLoss(dataset_format=fmt, **options)(labels, x)  # the default ibn_w: the options act
        ak.AngleLoss(dataset_format="B", **weights, **options)(None, x)

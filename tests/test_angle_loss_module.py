"""AngleLoss, the module that weighs the AnglE terms, in its three dataset formats.

Format A: zigzag pairs with labels (cosine + in-batch negatives + angle); B: [query, positive] rows
(contrastive only); C: [query, positive, negative] rows (contrastive with and without negatives, plus the angle
and cosine terms on (q, pos) pairs labelled 1 and (q, neg) pairs labelled 0). Against the float64 oracle
(tests/oracle.py, assembled as angle_emb 0.6.1's AngleLoss.__call__) on every backend and over weight settings
on the default backend, float32 and float64, and bf16/fp16 at the half rule; parity with angle_emb.AngleLoss
(skipped when angle-emb is not installed); gradcheck in float64 and hypothesis fuzzing.
Tolerances and the half-precision rule: tests/ak_testing.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from torch.autograd import gradcheck

import angle_kernels as ak
import oracle
from ak_testing import (
    FUZZ, HALF_DTYPES, REFERENCE_ATOL, check_against_oracle, float64_cannot_resolve, fuzz_embeddings, generator,
    leaf_like, outputs_and_grads, randn, zigzag_labels,
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
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_backend(backend, fmt, dtype):
    labels, x = _inputs(generator("module_backends", fmt, dtype), fmt, 12, 32, dtype=dtype)
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

"""in_batch_negative_loss and contrastive_with_negative_loss, the softmax cross-entropy losses over cosines.

* against the float64 oracle (angle_kernels.testing.oracle) on every backend, then over sizes, label sets (binary, all
  ones, all zeros), taus and group ids (identical texts as extra positives) on the default backend, float32
  and float64, and bf16/fp16 at the half rule;
* parity with angle-emb 0.6.1's angle_emb.loss (skipped when it is not installed), including its
  negative_weights argument, which provably changes nothing;
* gradcheck in float64 and hypothesis fuzzing against the oracle.
Tolerances and the half-precision rule: angle_kernels.testing.helpers.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from torch.autograd import gradcheck

import angle_kernels as ak
from angle_kernels.testing import oracle
from angle_kernels.testing.helpers import (
    FUZZ, HALF_DTYPES, REFERENCE_ATOL, assert_half_rule, check_against_oracle, float64_cannot_resolve,
    fuzz_embeddings, generator, leaf_like, outputs_and_grads, randn, zigzag_labels,
)

DTYPES = [torch.float64, torch.float32]
# The reference's softmax losses are O(N^2 D), like the oracle: the largest batch runs once.
PARITY_SIZES = [(1, 2), (1, 768), (3, 6), (37, 130), (1000, 6)]


def _duplicated_group_ids(gen, rows):
    """Group ids with many collisions: a pair whose two texts are identical (rows 0 and 1), a row repeating
    another pair's text (row 2 = row 0) and, with more than two pairs, one repeating another pair's partner."""
    ids = torch.randint(0, max(2, rows // 2), (rows,), generator=gen)
    ids[0] = ids[1]
    ids[2] = ids[0]
    if rows > 4:
        ids[4] = ids[3]
    return ids


# --------------------------------------------------------------------------------------------------------
# against the oracle
# --------------------------------------------------------------------------------------------------------
# (pairs, texts): 2 * pairs rows, which the contrastive cases split into texts, as many positives and fewer negatives.
# Through the Triton interpreter the backward's finishing kernel runs one program per row: there a case takes 16 rows
# (6 texts, 6 positives, 4 negatives) where it takes 32 elsewhere (13, 13, 6); either is one row block of the
# similarity tiles (up to 64 rows through the interpreter).
BACKEND_SIZE = (16, 13)
INTERPRETED_SIZE = (8, 6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_every_backend(backend, dtype):
    gen = generator("contrastive_backends", dtype)
    pairs, texts = INTERPRETED_SIZE if backend.interpreted else BACKEND_SIZE
    y_true = zigzag_labels(gen, pairs, "binary")
    group_ids = _duplicated_group_ids(gen, 2 * pairs)
    x = randn(gen, 2 * pairs, 40, dtype=dtype)
    device, name = backend.device, backend.name
    check_against_oracle(
        lambda x: ak.in_batch_negative_loss(y_true.to(device), x, 20.0, group_ids=group_ids.to(device), backend=name),
        lambda x: oracle.in_batch_negative_loss(y_true, x, 20.0, group_ids=group_ids), [x],
        f"in_batch_negative_loss on {name}", device=device)
    text, pos, neg = x[:texts], x[texts:2 * texts], x[2 * texts:]
    check_against_oracle(lambda t, p: ak.contrastive_with_negative_loss(t, p, tau=20.0, backend=name),
                         lambda t, p: oracle.contrastive_with_negative_loss(t, p, None, 20.0), [text, pos],
                         f"contrastive on {name}", device=device)
    check_against_oracle(lambda t, p, n: ak.contrastive_with_negative_loss(t, p, n, 20.0, backend=name),
                         lambda t, p, n: oracle.contrastive_with_negative_loss(t, p, n, 20.0), [text, pos, neg],
                         f"contrastive with negatives on {name}", device=device)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,d", [(1, 2), (3, 6), (37, 130), (300, 768)])
def test_in_batch_negative_loss(gen, n, d, dtype):
    x = randn(gen, 2 * n, d, dtype=dtype)
    for kind in ("binary", "ones", "zeros", "mixed"):
        y_true = zigzag_labels(gen, n, kind)
        for tau in (1.0, 20.0):
            check_against_oracle(lambda x: ak.in_batch_negative_loss(y_true, x, tau),
                                 lambda x: oracle.in_batch_negative_loss(y_true, x, tau), [x], f"ibn {kind} tau={tau}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,d", [(2, 6), (3, 6), (37, 130), (300, 64)])
def test_in_batch_negative_loss_group_ids(gen, n, d, dtype):
    """Identical texts (equal group ids) have identical embeddings, as a real encoder gives them, and count as
    positives; with some row gaining a positive, group ids must change the loss."""
    ids = _duplicated_group_ids(gen, 2 * n)
    x = randn(gen, 2 * n, d)
    for group in ids.unique():
        x[ids == group] = x[ids == group][0]
    x = x.to(dtype)
    y_true = zigzag_labels(gen, n, "binary")
    y_true[:2] = 1.0
    for tau in (1.0, 20.0):
        check_against_oracle(lambda x: ak.in_batch_negative_loss(y_true, x, tau, group_ids=ids),
                             lambda x: oracle.in_batch_negative_loss(y_true, x, tau, group_ids=ids), [x],
                             f"ibn group_ids tau={tau}")
    assert not torch.equal(ak.in_batch_negative_loss(y_true, x, 20.0),
                           ak.in_batch_negative_loss(y_true, x, 20.0, group_ids=ids))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("b,d,neg_rows", [(1, 2, 1), (3, 6, 3), (37, 130, 37), (37, 130, 5), (300, 768, 300)])
def test_contrastive_with_negative_loss(gen, b, d, neg_rows, dtype):
    text, pos, neg = randn(gen, b, d, dtype=dtype), randn(gen, b, d, dtype=dtype), randn(gen, neg_rows, d, dtype=dtype)
    for tau in (1.0, 20.0):
        check_against_oracle(lambda t, p: ak.contrastive_with_negative_loss(t, p, tau=tau),
                             lambda t, p: oracle.contrastive_with_negative_loss(t, p, None, tau), [text, pos],
                             f"contrastive tau={tau}")
        check_against_oracle(lambda t, p, n: ak.contrastive_with_negative_loss(t, p, n, tau),
                             lambda t, p, n: oracle.contrastive_with_negative_loss(t, p, n, tau), [text, pos, neg],
                             f"contrastive with negatives tau={tau}")


def test_label_shapes_give_identical_results(gen):
    """y_true of shape [2N] and [2N, 1] are the same labels: bitwise the same loss and gradient."""
    y_true = zigzag_labels(gen, 37, "binary")
    x = randn(gen, 74, 130)
    flat = outputs_and_grads(lambda x: ak.in_batch_negative_loss(y_true, x), [leaf_like(x)])
    column = outputs_and_grads(lambda x: ak.in_batch_negative_loss(y_true[:, None], x), [leaf_like(x)])
    assert all(torch.equal(a, b) for a, b in zip(flat[0] + flat[1], column[0] + column[1]))


# --------------------------------------------------------------------------------------------------------
# bfloat16 / float16
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("n,d", [(37, 64), (200, 128)])
def test_half_precision(gen, n, d, dtype):
    y_true = zigzag_labels(gen, n, "binary")
    x = randn(gen, 2 * n, d, dtype=dtype)
    check_against_oracle(lambda x: ak.in_batch_negative_loss(y_true, x),
                         lambda x: oracle.in_batch_negative_loss(y_true, x), [x], f"ibn {dtype}")
    check_against_oracle(lambda x: ak.contrastive_with_negative_loss(x[0::2], x[1::2]),
                         lambda x: oracle.contrastive_with_negative_loss(x[0::2], x[1::2]), [x],
                         f"contrastive {dtype}")


def test_float16_norms_above_256(gen):
    """Norms ~800 overflow eager float16's squared norms: the half rule's baseline is then correct rounding."""
    y_true = zigzag_labels(gen, 37, "binary")
    x = randn(gen, 74, 64, dtype=torch.float16, scale=100.0)
    assert x.float().norm(dim=1).min() > 256
    (value,), (grad,) = outputs_and_grads(lambda x: ak.in_batch_negative_loss(y_true, x), [leaf_like(x)])
    (exact_value,), (exact_grad,) = outputs_and_grads(lambda x: oracle.in_batch_negative_loss(y_true, x),
                                                      [leaf_like(x, dtype=torch.float64)])
    assert value.dtype == torch.float32 and grad.dtype == torch.float16
    assert_half_rule(value, None, exact_value, "ibn value")
    assert_half_rule(grad, None, exact_grad, "ibn gradient")


# --------------------------------------------------------------------------------------------------------
# parity with angle-emb 0.6.1
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["binary", "ones", "zeros", "mixed"])  # mixed: a pair's rows may disagree
@pytest.mark.parametrize("n,d", PARITY_SIZES)
def test_in_batch_negative_loss_parity(ref_loss, gen, n, d, kind, dtype):
    y_true = zigzag_labels(gen, n, kind).to(dtype)[:, None]
    x = randn(gen, 2 * n, d, dtype=dtype)
    for tau in (0.05, 1.0, 20.0) if n < 1000 else (20.0,):
        (value,), _ = check_against_oracle(lambda x: ak.in_batch_negative_loss(y_true, x, tau),
                                           lambda x: ref_loss.in_batch_negative_loss(y_true, x, tau), [x],
                                           f"ibn tau={tau}", value_atol=REFERENCE_ATOL)
        if kind == "zeros" or n == 1:  # no targets, or each row's only candidate is its partner
            assert abs(value.item()) < 1e-6


def test_in_batch_negative_loss_parity_large(ref_loss, gen):
    """N = 1000 pairs, D = 768, float32, tau 20."""
    y_true = zigzag_labels(gen, 1000, "binary")[:, None]
    check_against_oracle(lambda x: ak.in_batch_negative_loss(y_true, x, 20.0),
                         lambda x: ref_loss.in_batch_negative_loss(y_true, x, 20.0), [randn(gen, 2000, 768)],
                         "ibn N=1000 D=768", value_atol=REFERENCE_ATOL)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_negative_weights_change_nothing_as_in_the_reference(ref_loss, gen, dtype):
    """negative_weights only touches rows without a target in the reference: a no-op there, and here."""
    y_true = zigzag_labels(gen, 37, "binary").to(dtype)[:, None]
    x = randn(gen, 74, 130, dtype=dtype)
    for weight in (0.0, 0.5, 3.0):
        check_against_oracle(lambda x: ak.in_batch_negative_loss(y_true, x, 20.0, weight),
                             lambda x: ref_loss.in_batch_negative_loss(y_true, x, 20.0, weight), [x],
                             f"ibn negative_weights={weight}", value_atol=REFERENCE_ATOL)
    plain = ref_loss.in_batch_negative_loss(y_true, x, 20.0, 0.0)
    weighted = ref_loss.in_batch_negative_loss(y_true, x, 20.0, 3.0)
    assert plain.item() == weighted.item(), "the reference's negative_weights is expected to be a no-op"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_distinct_group_ids_match_the_reference(ref_loss, gen, dtype):
    """group_ids with every text distinct adds no positive: the reference's loss, which has no group ids."""
    y_true = zigzag_labels(gen, 37, "binary").to(dtype)[:, None]
    ids = torch.randperm(74, generator=gen)
    check_against_oracle(lambda x: ak.in_batch_negative_loss(y_true, x, 20.0, group_ids=ids),
                         lambda x: ref_loss.in_batch_negative_loss(y_true, x, 20.0), [randn(gen, 74, 6, dtype=dtype)],
                         "ibn distinct group_ids", value_atol=REFERENCE_ATOL)


@pytest.mark.parametrize("with_neg", [False, True])
def test_more_positives_than_queries_are_more_candidates_as_in_the_reference(ref_loss, gen, with_neg):
    """angle-emb's contrastive_with_negative_loss takes pos with more rows than text (rows past B are candidates
    like neg's); ours refused it ("pos must have the shape of text"). Fewer rows than text leave a query without its
    positive: refused."""
    inputs = [randn(gen, 4, 8), randn(gen, 6, 8)] + ([randn(gen, 3, 8)] if with_neg else [])
    check_against_oracle(lambda *t: ak.contrastive_with_negative_loss(*t, tau=20.0),
                         lambda *t: ref_loss.contrastive_with_negative_loss(*t, tau=20.0), inputs,
                         f"contrastive, 6 positives for 4 queries, neg={with_neg}", value_atol=REFERENCE_ATOL)
    with pytest.raises(ValueError, match="pos must have at least text's 4 rows"):
        ak.contrastive_with_negative_loss(inputs[0], inputs[1][:3])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_neg", [False, True])
@pytest.mark.parametrize("b,d", [(1, 2), (3, 6), (37, 130), (1000, 768)])
def test_contrastive_with_negative_loss_parity(ref_loss, gen, b, d, with_neg, dtype):
    inputs = [randn(gen, b, d, dtype=dtype) for _ in range(3 if with_neg else 2)]
    for tau in (0.05, 1.0, 20.0) if b < 1000 else (20.0,):
        check_against_oracle(lambda *t: ak.contrastive_with_negative_loss(*t, tau=tau),
                             lambda *t: ref_loss.contrastive_with_negative_loss(*t, tau=tau), inputs,
                             f"contrastive neg={with_neg} tau={tau}", value_atol=REFERENCE_ATOL)


def test_default_taus_match_reference(ref_loss, gen):
    """Defaults: in-batch negatives tau 20, contrastive tau 20."""
    y_true = zigzag_labels(gen, 9, "binary")[:, None]
    x = randn(gen, 18, 8, dtype=torch.float64)
    check_against_oracle(lambda x: ak.in_batch_negative_loss(y_true, x),
                         lambda x: ref_loss.in_batch_negative_loss(y_true, x), [x], "ibn default tau",
                         value_atol=REFERENCE_ATOL)
    check_against_oracle(lambda t, p: ak.contrastive_with_negative_loss(t, p),
                         lambda t, p: ref_loss.contrastive_with_negative_loss(t, p), [x[:9], x[9:]],
                         "contrastive default tau", value_atol=REFERENCE_ATOL)


# --------------------------------------------------------------------------------------------------------
# gradcheck and fuzzing
# --------------------------------------------------------------------------------------------------------
def test_gradcheck(gen):
    y_true = zigzag_labels(gen, 6, "binary")
    y_true[:2] = 1.0
    x = leaf_like(randn(gen, 12, 6, dtype=torch.float64))
    assert gradcheck(lambda x: ak.in_batch_negative_loss(y_true, x, 5.0), (x,), eps=1e-6, atol=1e-6, rtol=1e-4)
    group_ids = torch.tensor([0, 1, 2, 3, 0, 4, 5, 5, 6, 7, 8, 9])
    assert gradcheck(lambda x: ak.in_batch_negative_loss(y_true, x, 5.0, group_ids=group_ids), (x,),
                     eps=1e-6, atol=1e-6, rtol=1e-4)
    text, pos, neg = (leaf_like(randn(gen, rows, 6, dtype=torch.float64)) for rows in (4, 4, 3))
    assert gradcheck(lambda t, p: ak.contrastive_with_negative_loss(t, p, tau=5.0), (text, pos),
                     eps=1e-6, atol=1e-6, rtol=1e-4)
    assert gradcheck(lambda t, p, n: ak.contrastive_with_negative_loss(t, p, n, 5.0), (text, pos, neg),
                     eps=1e-6, atol=1e-6, rtol=1e-4)


@FUZZ
@given(
    n=st.integers(1, 40),
    dim=st.integers(2, 48),  # D = 1: every direction is +-1, the true gradient is 0 and any result is rounding noise
    positive_fraction=st.sampled_from([0.0, 0.5, 1.0]),
    tau=st.sampled_from([1.0, 20.0]) | st.floats(0.05, 30.0),
    duplicates=st.booleans(),
    dtype=st.sampled_from(DTYPES + list(HALF_DTYPES)),
    seed=st.integers(0, 2**31 - 1),
)
def test_fuzz_in_batch_negative_loss(n, dim, positive_fraction, tau, duplicates, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    y_true = (torch.rand(n, generator=gen) < positive_fraction).double().repeat_interleave(2)
    x = fuzz_embeddings(seed, 2 * n, dim, 1.0, dtype)
    group_ids = torch.randint(0, max(1, n), (2 * n,), generator=gen) if duplicates else None
    exact = oracle.in_batch_negative_loss(y_true, x, tau, group_ids=group_ids)
    assume(dtype != torch.float64 or not float64_cannot_resolve(exact))
    check_against_oracle(lambda x: ak.in_batch_negative_loss(y_true, x, tau, group_ids=group_ids),
                         lambda x: oracle.in_batch_negative_loss(y_true, x, tau, group_ids=group_ids), [x],
                         f"ibn n={n} dim={dim} tau={tau} duplicates={duplicates}")


@FUZZ
@given(
    b=st.integers(1, 40),
    neg_rows=st.integers(0, 50),
    dim=st.integers(2, 48),
    tau=st.floats(0.05, 30.0),
    dtype=st.sampled_from(DTYPES + list(HALF_DTYPES)),
    seed=st.integers(0, 2**31 - 1),
)
def test_fuzz_contrastive_with_negative_loss(b, neg_rows, dim, tau, dtype, seed):
    text, pos = fuzz_embeddings(seed, b, dim, 1.0, dtype), fuzz_embeddings(seed + 1, b, dim, 1.0, dtype)
    neg = fuzz_embeddings(seed + 2, neg_rows, dim, 1.0, dtype) if neg_rows else None
    exact = oracle.contrastive_with_negative_loss(text, pos, neg, tau)
    assume(dtype != torch.float64 or not float64_cannot_resolve(exact))
    if neg_rows:
        check_against_oracle(lambda t, p, n: ak.contrastive_with_negative_loss(t, p, n, tau),
                             lambda t, p, n: oracle.contrastive_with_negative_loss(t, p, n, tau), [text, pos, neg],
                             f"contrastive b={b} negatives={neg_rows}")
    else:
        check_against_oracle(lambda t, p: ak.contrastive_with_negative_loss(t, p, tau=tau),
                             lambda t, p: oracle.contrastive_with_negative_loss(t, p, None, tau), [text, pos],
                             f"contrastive b={b}")

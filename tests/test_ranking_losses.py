"""cosine_loss and angle_loss, CoSENT's ranking term on cosine or angle scores of zigzag pairs.

* against the float64 oracle (angle_kernels.testing.oracle) on every backend, then over sizes (N = 1, 3, 37, 1000 pairs;
  D = 2, 6, 130, 768), label structures (continuous, heavy ties, binary, all equal), taus, label dtypes and
  shapes ([2N] and [2N, 1]) on the default backend, float32 and float64, and bf16/fp16 at the half rule;
* parity with the reference itself, angle-emb 0.6.1's angle_emb.loss (skipped when it is not installed):
  the reference evaluated in float64 on the same values is the exact result there;
* gradcheck in float64 and hypothesis fuzzing against the oracle.
Tolerances and the half-precision rule: angle_kernels.testing.helpers.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.autograd import gradcheck

import angle_kernels as ak
from angle_kernels.testing import oracle
from angle_kernels.testing.helpers import (
    FUZZ, HALF_DTYPES, REFERENCE_ATOL, across_backends, assert_half_rule, check_against_oracle, fuzz_embeddings,
    generator, label_sets, leaf_like, outputs_and_grads, randn, zigzag_labels,
)

DTYPES = [torch.float64, torch.float32]
# (N pairs, D): N = 1, 3, 37, 1000 and D = 2, 6, 130, 768, combined to keep the run short.
SIZES = [(1, 2), (1, 768), (3, 6), (3, 2), (37, 130), (37, 6), (1000, 768), (1000, 2)]
LABEL_KINDS = ["graded", "ties", "binary", "equal"]
TAUS = [0.05, 1.0, 20.0]


def _taus(n: int) -> list[float]:
    """Every tau on small batches; the default 20 on the 1000-pair ones (the oracle and reference are N^2)."""
    return TAUS if n < 1000 else [20.0]


def _losses(y_true, tau, backend=None):
    """name -> (ours, oracle) for cosine_loss and angle_loss with both poolings, on labels y_true."""
    device = "cpu" if backend is None else backend.device
    name = None if backend is None else backend.name
    labels = y_true.to(device)
    return {
        "cosine": (lambda x: ak.cosine_loss(labels, x, tau, backend=name),
                   lambda x: oracle.cosine_loss(y_true, x, tau)),
        "angle_sum": (lambda x: ak.angle_loss(labels, x, tau, "sum", backend=name),
                      lambda x: oracle.angle_loss(y_true, x, tau, "sum")),
        "angle_mean": (lambda x: ak.angle_loss(labels, x, tau, "mean", backend=name),
                       lambda x: oracle.angle_loss(y_true, x, tau, "mean")),
    }


# --------------------------------------------------------------------------------------------------------
# against the oracle
# --------------------------------------------------------------------------------------------------------
def _interpreted_triton_runs(dtype):
    """Under the Triton interpreter (seconds a case) float64 and bfloat16, not float32: the losses' front end is the
    same code on every backend (the torch backend's cases check it in every dtype), and the Triton ops (pair_scores,
    ranking_loss) are one kernel per op whose dtype is a compile-time parameter, held to the oracle in float32 too
    by tests/ops (test_pair_scores.py, test_ranking_loss.py). Between them the two kept cases meet both
    accumulators (float64; float32, as a float32 batch) and both kinds of row loads (full width; half precision)."""
    return dtype != torch.float32


def _pairs_on(backend):
    """24 pairs, or 6 through the Triton interpreter: the pair-score kernels run one program per pair, the same work
    each (testing.helpers.pair_groups), and there they took nine tenths of a case's time; 6 pairs on 3 label levels
    still give the ranking term tied pairs and ordered ones (asserted)."""
    return 6 if backend.interpreted else 24


@pytest.mark.parametrize("backend, dtype", across_backends(
    [(dtype,) for dtype in (torch.float64, torch.float32, torch.bfloat16)], _interpreted_triton_runs),
    indirect=["backend"])
def test_every_backend(backend, dtype):
    gen, n = generator("ranking_backends", dtype), _pairs_on(backend)
    y_true = zigzag_labels(gen, n, "ties")
    assert 1 < y_true.unique().numel() < n  # tied pairs and pairs the ranking term orders
    x = randn(gen, 2 * n, 66, dtype=dtype)
    for name, (ours, exact) in _losses(y_true, 20.0, backend).items():
        check_against_oracle(ours, exact, [x], f"{name} on {backend.name}", device=backend.device)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", LABEL_KINDS)
@pytest.mark.parametrize("n,d", SIZES)
def test_against_oracle(gen, n, d, kind, dtype):
    y_true = zigzag_labels(gen, n, kind)
    x = randn(gen, 2 * n, d, dtype=dtype)
    for tau in _taus(n):
        for shape in ([2 * n], [2 * n, 1]) if n < 1000 else ([2 * n, 1],):
            for name, (ours, exact) in _losses(y_true.reshape(shape), tau).items():
                check_against_oracle(ours, exact, [x], f"{name} tau={tau} y{shape}")


@pytest.mark.parametrize("label_dtype", [torch.int64, torch.int32, torch.float64, torch.float16], ids=str)
def test_any_real_label_dtype(gen, label_dtype):
    y_true = zigzag_labels(gen, 37, "ties")
    x = randn(gen, 74, 6)
    check_against_oracle(lambda x: ak.cosine_loss(y_true.to(label_dtype), x),
                         lambda x: oracle.cosine_loss(y_true, x), [x], f"cosine labels {label_dtype}")
    check_against_oracle(lambda x: ak.angle_loss(y_true.to(label_dtype)[:, None], x),
                         lambda x: oracle.angle_loss(y_true, x), [x], f"angle labels {label_dtype}")


@pytest.mark.parametrize("label_dtype", [torch.uint8, torch.uint16, torch.uint32, torch.float8_e4m3fn,
                                         torch.float8_e5m2], ids=str)
def test_labels_torch_does_not_rank_are_ranked_exactly(gen, label_dtype):
    """uint16, uint32 and float8 labels (torch's searchsorted and sort take none of them) failed after the pair
    scores, with torch's NotImplementedError ("searchsorted_out_cpu" not implemented for 'UInt32'): ranked as int64
    or float32, exactly, before any work; uint64, which int64 cannot hold, is refused naming the argument."""
    y_true = torch.randint(0, 5, (37,), generator=gen).repeat_interleave(2)  # whole numbers: exact in each dtype
    x = randn(gen, 74, 6)
    check_against_oracle(lambda x: ak.cosine_loss(y_true.to(label_dtype), x),
                         lambda x: oracle.cosine_loss(y_true, x), [x], f"cosine labels {label_dtype}")
    check_against_oracle(lambda x: ak.angle_loss(y_true.to(label_dtype), x),
                         lambda x: oracle.angle_loss(y_true, x), [x], f"angle labels {label_dtype}")
    with pytest.raises(TypeError, match=r"^y_true must be a float, bool or integer tensor other than uint64 .*"
                                        r"pass y_true.long\(\) or y_true.double\(\)$"):
        ak.cosine_loss(y_true.to(torch.uint64), x)


def test_large_batch(gen):
    """3,000 pairs with continuous labels and with 3 heavy tie groups: against the oracle's 3,000 x 3,000."""
    x = randn(gen, 6000, 32)
    for kind in ("graded", "ties"):
        y_true = zigzag_labels(gen, 3000, kind)
        check_against_oracle(lambda x: ak.cosine_loss(y_true, x), lambda x: oracle.cosine_loss(y_true, x), [x],
                             f"cosine N=3000 {kind}")


def test_label_shapes_give_identical_results(gen):
    """y_true of shape [2N] and [2N, 1] are the same labels: bitwise the same loss and gradient."""
    y_true = zigzag_labels(gen, 37, "graded")
    x = randn(gen, 74, 130)
    for name, loss in (("cosine", ak.cosine_loss), ("angle", ak.angle_loss)):
        flat = outputs_and_grads(lambda x: loss(y_true, x), [leaf_like(x)])
        column = outputs_and_grads(lambda x: loss(y_true[:, None], x), [leaf_like(x)])
        assert all(torch.equal(a, b) for a, b in zip(flat[0] + flat[1], column[0] + column[1])), name


# --------------------------------------------------------------------------------------------------------
# bfloat16 / float16
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("n,d", [(37, 64), (200, 128)])
def test_half_precision(gen, n, d, dtype):
    """Norms ~ sqrt(D) <= 16: eager fp16 (the rule's baseline) does not overflow its squared norms."""
    y_true = zigzag_labels(gen, n, "ties")
    x = randn(gen, 2 * n, d, dtype=dtype)
    for name, (ours, exact) in _losses(y_true, 20.0).items():
        check_against_oracle(ours, exact, [x], f"{name} {dtype}")


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_float16_norms_above_256(ref_loss, gen, pooling):
    """Norms ~800: c^2 + d^2 overflows float16 in the reference's angle loss (NaN) and in any eager float16
    computation, so the half rule's baseline is correct rounding; ours accumulates in float32."""
    y_true = zigzag_labels(gen, 37, "ties")
    x = randn(gen, 74, 64, dtype=torch.float16, scale=100.0)
    assert x.float().norm(dim=1).min() > 256
    with torch.no_grad():
        assert not torch.isfinite(ref_loss.angle_loss(y_true[:, None], x, 20.0, pooling)), "expected to overflow"
    for name, (ours, exact) in _losses(y_true, 20.0).items():
        if name.startswith("angle") and not name.endswith(pooling):
            continue
        (value,), (grad,) = outputs_and_grads(ours, [leaf_like(x)])
        (exact_value,), (exact_grad,) = outputs_and_grads(exact, [leaf_like(x, dtype=torch.float64)])
        assert value.dtype == torch.float32 and grad.dtype == torch.float16
        assert_half_rule(value, None, exact_value, f"{name} value")
        assert_half_rule(grad, None, exact_grad, f"{name} gradient")


# --------------------------------------------------------------------------------------------------------
# parity with angle-emb 0.6.1
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", LABEL_KINDS)
@pytest.mark.parametrize("n,d", SIZES)
def test_parity_with_reference(ref_loss, gen, n, d, kind, dtype):
    """The reference needs y_true of shape [2N, 1] (it reads y_true[::2, 0]); ours is given the same."""
    y_true = zigzag_labels(gen, n, kind).to(dtype)[:, None]
    x = randn(gen, 2 * n, d, dtype=dtype)
    for tau in _taus(n):
        cases = {
            "cosine": (lambda x: ak.cosine_loss(y_true, x, tau), lambda x: ref_loss.cosine_loss(y_true, x, tau)),
            "angle_sum": (lambda x: ak.angle_loss(y_true, x, tau, "sum"),
                          lambda x: ref_loss.angle_loss(y_true, x, tau, "sum")),
            "angle_mean": (lambda x: ak.angle_loss(y_true, x, tau, "mean"),
                           lambda x: ref_loss.angle_loss(y_true, x, tau, "mean")),
        }
        for name, (ours, reference) in cases.items():
            (value,), (exact,) = check_against_oracle(ours, reference, [x], f"{name} tau={tau}",
                                                      value_atol=REFERENCE_ATOL)
            if kind == "equal" or n == 1:  # no pair has label_i < label_j
                assert value.item() == 0.0 and exact.item() == 0.0


def test_default_taus_match_reference(ref_loss, gen):
    """Defaults: cosine tau 20, angle tau 1.0 with 'sum' pooling."""
    y_true = zigzag_labels(gen, 9, "graded")[:, None]
    x = randn(gen, 18, 8, dtype=torch.float64)
    check_against_oracle(lambda x: ak.cosine_loss(y_true, x), lambda x: ref_loss.cosine_loss(y_true, x), [x],
                         "cosine default tau", value_atol=REFERENCE_ATOL)
    check_against_oracle(lambda x: ak.angle_loss(y_true, x), lambda x: ref_loss.angle_loss(y_true, x), [x],
                         "angle default tau", value_atol=REFERENCE_ATOL)


# --------------------------------------------------------------------------------------------------------
# gradcheck and fuzzing
# --------------------------------------------------------------------------------------------------------
def test_gradcheck(gen):
    """Finite differences in float64 through the public functions (random inputs: no ties of |angle| at 0)."""
    y_true = zigzag_labels(gen, 6, "ties")
    x = leaf_like(randn(gen, 12, 6, dtype=torch.float64))
    for loss in (lambda x: ak.cosine_loss(y_true, x, 20.0), lambda x: ak.angle_loss(y_true, x, 1.0, "sum"),
                 lambda x: ak.angle_loss(y_true[:, None], x, 20.0, "mean")):
        assert gradcheck(loss, (x,), eps=1e-6, atol=1e-6, rtol=1e-4)


@FUZZ
@given(
    n=st.integers(1, 48),
    half_dim=st.integers(1, 40),
    labels=st.data(),
    label_dtype=st.sampled_from([torch.float32, torch.float64, torch.int64]),
    column=st.booleans(),
    tau=st.sampled_from([0.05, 1.0, 20.0]) | st.floats(0.01, 50.0),
    scale=st.sampled_from([1e-3, 1.0, 30.0]),
    dtype=st.sampled_from(DTYPES + list(HALF_DTYPES)),
    pooling=st.sampled_from(["sum", "mean"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_fuzz(n, half_dim, labels, label_dtype, column, tau, scale, dtype, pooling, seed):
    """Batch sizes, even dimensions, label structures and dtypes, [2N] and [2N, 1], taus, embedding scales
    (half precision at scale 1 only: larger norms overflow eager float16, the rule's baseline)."""
    y_true = labels.draw(label_sets(n))
    if label_dtype == torch.int64:
        y_true = y_true.round()
    ours_labels = y_true.to(label_dtype)[:, None] if column else y_true.to(label_dtype)
    x = fuzz_embeddings(seed, 2 * n, 2 * half_dim, 1.0 if dtype in HALF_DTYPES else scale, dtype)
    check_against_oracle(lambda x: ak.cosine_loss(ours_labels, x, tau), lambda x: oracle.cosine_loss(y_true, x, tau),
                         [x], f"cosine n={n} tau={tau}")
    check_against_oracle(lambda x: ak.angle_loss(ours_labels, x, tau, pooling),
                         lambda x: oracle.angle_loss(y_true, x, tau, pooling), [x], f"angle n={n} tau={tau}")

"""ranking_loss(scores, labels) on every backend against the float64 oracle: the loss and its gradient.

Heavy label ties, all labels equal, a single element, label dtypes (integers, floats, bool), scores at the
scale tau = 20 gives and far beyond it, non-contiguous scores and labels, sizes on both sides of the Triton backend's
switch from its tiled kernel to the sort-and-scan path. Scores are float32 or float64 only (the contract):
there is no half-precision case.
"""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
from torch.autograd import gradcheck

from angle_kernels.testing import oracle
from angle_kernels.testing.helpers import (
    backend_or_skip, check_against_oracle, generator, leaf_like, outputs_and_grads, randn
)

# The Triton scans take log(0) = -inf of two empty sums on purpose; NumPy warns about it under the interpreter.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")


# The tiled kernel runs one program per 32 rows, each looping over the scores in 128-column blocks; its branches and
# constexprs come from the dtype, never from N. Through the interpreter every (row block, column block) tile runs in
# Python, so there the cases of more scores run on 300 (ten row blocks and three column blocks, the last of each
# partial, as at 777 or 1,000 scores: 10 x 3 tiles instead of up to 32 x 8); compiled, a case keeps its size.
INTERPRETED_TILED_N = 300


def _tiled_n(backend, n):
    """How many scores a tiled-path case runs on: n, or at most INTERPRETED_TILED_N through the interpreter."""
    return min(n, INTERPRETED_TILED_N) if backend.interpreted else n


def _check(backend, scores, labels, what):
    return check_against_oracle(lambda s: backend.ops.ranking_loss(s, labels.to(backend.device)),
                                lambda s: oracle.ranking_loss(s, labels), [scores], what, device=backend.device)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("n,levels", [(1, 1), (3, 2), (37, 4), (64, 4), (1000, 5), (1000, 1000)])
def test_against_oracle(backend, n, levels, dtype):
    """Scores at the scale of tau = 20; `levels` distinct labels (few levels: heavy ties)."""
    gen, n = generator("ranking", n, levels, dtype), _tiled_n(backend, n)
    scores = randn(gen, n, dtype=dtype, scale=20.0)
    labels = torch.randint(0, levels, (n,), generator=gen).to(torch.float32)
    _check(backend, scores, labels, f"ranking n={n} levels={levels}")


def test_beyond_the_triton_tiled_path(backend, monkeypatch):
    """5,000 elements: above the Triton backend's SMALL_N_MAX (4,096), where it sorts and scans. Through the
    interpreter, which scans one score at a time (a second per 1,024-score block), the selector is asked at the
    threshold itself and the sort path runs on 2,100 scores below a switch lowered to 2,048: the same scan blocks of
    1,024 scores, three of them (the first, a middle one with both carries, the last one partial), not five."""
    n = 5000
    if backend.interpreted:
        ranking = importlib.import_module("angle_kernels.triton_ops.ranking_loss")
        at_the_switch = torch.empty(ranking.SMALL_N_MAX)
        assert ranking.code_path(at_the_switch, at_the_switch) == "pairwise"
        assert ranking.code_path(torch.empty(n), torch.empty(n)) == "sort"
        n = 2100
        monkeypatch.setattr(ranking, "SMALL_N_MAX", 2048)
        assert 2 * ranking._SCAN_BLOCK < n < 3 * ranking._SCAN_BLOCK
    gen = generator("ranking_large")
    scores = randn(gen, n, scale=20.0)
    labels = torch.randint(0, 7, (n,), generator=gen)
    _check(backend, scores, labels, f"ranking n={n}")


@pytest.mark.parametrize("label_dtype", [torch.int64, torch.int32, torch.float16, torch.float64, torch.bool], ids=str)
def test_label_dtypes(backend, label_dtype):
    gen = generator("label_dtype", label_dtype)
    scores = randn(gen, 50, scale=20.0)
    if label_dtype == torch.bool:
        labels = torch.rand(50, generator=gen) > 0.5
    else:
        labels = torch.randint(-3, 3, (50,), generator=gen).to(label_dtype)  # negative labels too
    _check(backend, scores, labels, f"ranking labels {label_dtype}")


def test_float_labels_and_extreme_scores(backend):
    """Scores of size 300 (exp(600) overflows float64 unless every sum stays in log space)."""
    gen = generator("extreme")
    scores = randn(gen, 50, dtype=torch.float64, scale=300.0)
    labels = torch.rand(50, generator=gen, dtype=torch.float64).round(decimals=1)
    _check(backend, scores, labels, "ranking extreme scores")


def test_non_contiguous_scores(backend):
    gen, n = generator("strided"), _tiled_n(backend, 777)
    scores = randn(gen, 2 * n, scale=20.0)[::2]
    assert not scores.is_contiguous()
    labels = torch.randint(-3, 3, (n,), generator=gen)
    _check(backend, scores, labels, "ranking strided scores")


def test_non_contiguous_labels_are_exact_and_raise_no_warning(backend):
    """Labels taken as a column of a table (strided) give the oracle's loss, and no performance warning from inside
    the op (torch.searchsorted warns on non-contiguous values, once per process)."""
    gen = generator("strided_labels")
    scores = randn(gen, 333, scale=20.0)
    labels = torch.randint(-3, 3, (333, 2), generator=gen)[:, 0]
    assert not labels.is_contiguous()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _check(backend, scores, labels, "ranking strided labels")


@pytest.mark.parametrize("n", [1, 40])
def test_all_labels_equal_is_exactly_zero(backend, n):
    scores = randn(generator("equal", n), n, scale=20.0)
    (loss,), (grad,) = outputs_and_grads(lambda s: backend.ops.ranking_loss(s, torch.full((n,), 3.0, device=s.device)),
                                         [leaf_like(scores, device=backend.device)])
    assert loss.item() == 0.0
    assert torch.equal(grad, torch.zeros(n))


@pytest.mark.parametrize("kind", ["distinct", "ties", "binary", "equal"])
@pytest.mark.parametrize("n", [2, 7, 40])
def test_gradcheck(backend, n, kind):
    gen = generator("gradcheck", n, kind)
    levels = {"distinct": n, "ties": 3, "binary": 2, "equal": 1}[kind]
    labels = torch.randperm(n, generator=gen) % levels
    scores = leaf_like(randn(gen, n, dtype=torch.float64, scale=20.0 if kind == "ties" else 3.0), device=backend.device)
    assert gradcheck(lambda s: backend.ops.ranking_loss(s, labels.to(s.device)), (scores,), eps=1e-6, atol=1e-6,
                     rtol=1e-4, fast_mode=backend.name == "triton")


# ---------------------------------------------------------------------------------------------------------
# The Triton backend's sort-and-scan path at test sizes (its internals: the switch and the scan block size)
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture
def triton_sort_path(monkeypatch):
    """The Triton backend forced onto its sort path, with 16-element scan blocks so that the carries between
    blocks (and tie groups that straddle them) are exercised at test sizes."""
    triton_backend = backend_or_skip("triton")
    ranking = importlib.import_module("angle_kernels.triton_ops.ranking_loss")
    monkeypatch.setattr(ranking, "SMALL_N_MAX", 0)
    monkeypatch.setattr(ranking, "_SCAN_BLOCK", 16)
    return triton_backend


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("n,levels", [(1, 1), (3, 2), (37, 4), (64, 4), (100, 100)])
def test_triton_sort_path_against_oracle(triton_sort_path, n, levels, dtype):
    gen = generator("sorted", n, levels, dtype)
    scores = randn(gen, n, dtype=dtype, scale=20.0)
    labels = torch.randint(0, levels, (n,), generator=gen)
    _check(triton_sort_path, scores, labels, f"triton sort path n={n}")


def test_triton_sort_path_bool_labels_and_equal_labels(triton_sort_path):
    gen = generator("sorted_special")
    scores = randn(gen, 30, dtype=torch.float64)
    _check(triton_sort_path, scores, torch.rand(30, generator=gen) > 0.5, "triton sort path bool labels")
    (loss,), (grad,) = outputs_and_grads(
        lambda s: triton_sort_path.ops.ranking_loss(s, torch.full((30,), 2.0, device=s.device)),
        [leaf_like(scores, device=triton_sort_path.device)])
    assert loss.item() == 0.0 and torch.equal(grad, torch.zeros(30, dtype=torch.float64))


def test_a_million_float32_scores_keep_their_gradients_digits():
    """The torch backend runs the ranking term's prefix and suffix logsumexp scans in float64 whatever the scores'
    dtype: in float32 they drift with N, and at a million scores (tau * cos as the losses pass them) some gradient
    entries were 23% off, where float64 scans keep every entry within float32's rounding of the float64 result."""
    from angle_kernels.dispatch import resolve_backend

    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(1_000_000, generator=gen) * 4.0
    labels = torch.rand(1_000_000, generator=gen, dtype=torch.float64) * 5
    ops = resolve_backend("torch", scores)
    grads = []
    for dtype in (torch.float64, torch.float32):
        leaf = scores.to(dtype).requires_grad_()
        ops.ranking_loss(leaf, labels).backward()
        grads.append(leaf.grad.double())
    exact, ours = grads
    assert ((ours - exact).abs() / exact.abs().clamp_min(1e-30)).max() < 1e-6

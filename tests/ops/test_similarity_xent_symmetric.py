"""The triangular schedule of similarity_xent's rows against themselves on the CPU
(angle_kernels/torch_ops/_similarity_xent_symmetric.py): which calls take it, its values and gradients against the
float64 oracle on every option it takes (tests/ops/test_similarity_xent.py runs the op's cases on it too, as
"torch-triangle"), a small loss's digits, its matrix products (4 M^2 D + 2 M T D with gradients, M^2 D + M T D
without, against the softmax form's 6 M^2 D) and its tiles (no tensor of more than T rows and columns).
Tiles are shrunk to a few rows (common.CHUNK_ELEMENTS) so that small calls span many, the last one partial."""

from __future__ import annotations

import pytest
import torch

from angle_kernels.dispatch import raw_backend
from angle_kernels.testing import oracle
from angle_kernels.testing.helpers import ShapeRecorder, check_against_oracle, flop_counter, generator, randn
from angle_kernels.torch_ops import _similarity_xent_symmetric as symmetric
from angle_kernels.torch_ops import common


def similarity_xent(q, **kwargs):
    return raw_backend("torch").similarity_xent(q, None, **kwargs)


@pytest.fixture
def tiles_of(monkeypatch):
    """tiles_of(t): the schedule in tiles of t rows at any width (MIN_WIDTH 1)."""
    monkeypatch.setattr(symmetric, "MIN_WIDTH", 1)

    def shrink(t: int) -> None:
        monkeypatch.setattr(common, "CHUNK_ELEMENTS", t * t)
        assert symmetric.tile_rows("cpu") == t

    return shrink


def _took_the_schedule(loss: torch.Tensor) -> bool:
    return type(loss.grad_fn).__name__.startswith("SymmetricSimilarityXentFunction")


def test_the_calls_it_takes():
    """At the default budget (tiles of 512 rows): rows against themselves from 2,048 rows of D >= 64 on, with no
    margin and |scale| <= 40; everything else in the softmax form."""
    assert symmetric.tile_rows("cpu") == 512
    gen = generator("symmetric_xent", "calls")
    x = randn(gen, 2048, 64).requires_grad_(True)
    base = dict(scale=20.0, target="partner", exclude_diagonal=True)
    assert _took_the_schedule(similarity_xent(x, **base))
    assert _took_the_schedule(similarity_xent(x, **dict(base, scale=40.0)))
    assert not _took_the_schedule(similarity_xent(x[:2046], **base))
    assert not _took_the_schedule(similarity_xent(x[:, :63], **base))
    assert not _took_the_schedule(similarity_xent(x, **dict(base, scale=40.5)))
    assert not _took_the_schedule(similarity_xent(x, **dict(base, margin=0.1)))
    assert not _took_the_schedule(raw_backend("torch").similarity_xent(x, x.detach(), **base))


def test_compiled_calls_keep_the_softmax_form(monkeypatch):
    """Inside a torch.compile trace the schedule would unroll every tile into the graph: `applies` says no there."""
    x = torch.zeros(2048, 64)
    assert symmetric.applies(x, None, 20.0, "partner", True, 0.0)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not symmetric.applies(x, None, 20.0, "partner", True, 0.0)


# (rows, width, options): targets, own columns in or out, row weights (0, 1/2, 1; negative fractional), groups, a
# scale other than 20, in tiles of 4 rows, the last one partial where 4 does not divide the rows.
OPTIONS = {
    "in_batch_negatives": (30, 24, dict(target="partner", exclude_diagonal=True, weights=True, groups=True)),
    "partner_with_own_column": (22, 16, dict(target="partner")),
    "partner_groups_with_own_column": (24, 16, dict(target="partner", groups=True)),
    "diagonal": (19, 12, dict(target="diagonal", scale=5.0)),
    "diagonal_with_groups": (21, 12, dict(target="diagonal", groups=True, weights="negative fractional")),
    "scale_40": (26, 8, dict(target="partner", exclude_diagonal=True, scale=40.0)),
}


def _options_inputs(name, dtype):
    rows, width, options = OPTIONS[name]
    gen = generator("symmetric_xent", name, dtype)
    q = randn(gen, rows, width, dtype=dtype)
    kwargs = dict(scale=options.get("scale", 20.0), target=options["target"],
                  exclude_diagonal=options.get("exclude_diagonal", False))
    if options.get("weights") == "negative fractional":
        kwargs["row_weights"] = -torch.rand(rows, generator=gen)
    elif options.get("weights"):
        kwargs["row_weights"] = torch.randint(0, 3, (rows,), generator=gen).to(torch.float32) / 2
    if options.get("groups"):
        kwargs["group_ids"] = torch.randint(0, rows // 3, (rows,), generator=gen)
    return q, kwargs


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_against_oracle(tiles_of, name, dtype):
    tiles_of(4)
    q, kwargs = _options_inputs(name, dtype)
    with torch.no_grad():
        assert symmetric.applies(q, None, kwargs["scale"], kwargs["target"], kwargs["exclude_diagonal"], 0.0)
    check_against_oracle(lambda q: similarity_xent(q, **kwargs), lambda q: oracle.similarity_xent(q, None, **kwargs),
                         [q], f"{name} {dtype}")


def test_a_small_loss_keeps_its_digits(tiles_of):
    """Pairs of nearly equal rows: every row's loss is about 1e-7 (its partner dominates its softmax), which the
    schedule's log1p(o / p) keeps in float32 (a difference of two logsumexps near 20 would round it to 0 or to
    float32's step there, 2e-6); so does the gradient, formed without a difference of two softmaxes."""
    tiles_of(4)
    gen = generator("symmetric_xent", "small loss")
    base = randn(gen, 16, 128, dtype=torch.float64)
    x = torch.stack((base, base + 1e-4 * randn(gen, 16, 128, dtype=torch.float64)), dim=1).reshape(32, 128)
    kwargs = dict(scale=20.0, target="partner", exclude_diagonal=True)
    ours, exact = check_against_oracle(lambda q: similarity_xent(q, **kwargs),
                                       lambda q: oracle.similarity_xent(q, None, **kwargs), [x.float()], "small loss")
    assert 1e-9 < exact[0].item() < 1e-6
    assert abs(ours[0].item() / exact[0].item() - 1) < 1e-5


def test_without_gradients_the_loss_is_the_same(tiles_of):
    tiles_of(4)
    q, kwargs = _options_inputs("in_batch_negatives", torch.float32)
    with torch.no_grad():
        without = similarity_xent(q, **kwargs)
    assert torch.equal(without, similarity_xent(q.requires_grad_(True), **kwargs).detach())


@pytest.mark.parametrize("gradients", [True, False], ids=["forward+backward", "no_grad"])
def test_matrix_product_flops(tiles_of, gradients):
    """M = 64 rows of D = 16 in tiles of T = 8: with gradients 4 M^2 D + 2 M T D (pass 1 over the triangle, pass 2
    three products per tile pair and two per diagonal tile), without M^2 D + M T D; the softmax form takes 6 M^2 D."""
    m, d, t = 64, 16, 8
    tiles_of(t)
    x = randn(generator("symmetric_xent", "flops"), m, d).requires_grad_(gradients)
    kwargs = dict(scale=20.0, target="partner", exclude_diagonal=True)
    counter = flop_counter()
    with counter, torch.set_grad_enabled(gradients):
        loss = similarity_xent(x, **kwargs)
        if gradients:
            loss.backward()
    expected = 4 * m * m * d + 2 * m * t * d if gradients else m * m * d + m * t * d
    assert counter.get_total_flops() == expected


def test_no_tensor_larger_than_a_tile(tiles_of):
    """Forward and backward at M = 96 rows of D = 6 with group_ids, in tiles of 8 rows: every tensor made is a row
    tensor ([M, D], [M], [M, 1]), a tile (at most 8 x 8) or smaller; nothing M x M, no block of rows against every
    column."""
    tiles_of(8)
    gen = generator("symmetric_xent", "memory")
    x = randn(gen, 96, 6).requires_grad_(True)
    groups = torch.randint(0, 30, (96,), generator=gen)
    recorder = ShapeRecorder()
    with recorder.mode:
        similarity_xent(x, scale=20.0, target="partner", exclude_diagonal=True, group_ids=groups).backward()
    two_d = {shape for _, shape in recorder.shapes if len(shape) == 2}
    assert (8, 8) in two_d
    assert all(shape[1] == 6 or min(shape) == 1 or max(shape) <= 8 for shape in two_d), sorted(two_d)
    assert max(max(shape) for _, shape in recorder.shapes if len(shape) == 1) <= 96

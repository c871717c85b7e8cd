"""The Triton backend's dense dims scheme of similarity_xent (triton_ops/_similarity_xent_dense_dims.py).

The scheme takes dims calls from the dense scheme's MIN_WIDTH (768) up; here MIN_WIDTH is lowered to 1 so that the
tiny cases reach it through the backend's own choice (triton_ops/similarity_xent_paths.code_path), and its row
blocks are shrunk to a few rows so that most cases span several. Each case holds its [k] losses and the gradients
to the float64 oracle's k calls on the truncated inputs, in every dtype; in float64 the results also equal the torch
backend's dims path (the same cumulative products and running sums over the prefixes) to rounding.
"""

from __future__ import annotations

import math

import pytest
import torch

from angle_kernels.testing import oracle
from angle_kernels.testing.helpers import (
    HALF_DTYPES, ShapeRecorder, assert_close, backend_or_skip, check_against_oracle, generator, leaf_like, moved_to,
    randn,
)

BLOCK_ROWS = 16  # the scheme's row blocks here: most cases span several, the last one partial

# name -> (M, Mc or None for c = None, D, dims, options); "weights" puts row weights in {0, 0.5, 1}, "groups" draws
# group ids with many duplicates. The prefixes: one of width 1, ends at D or short of it, a single prefix, widths
# that are not multiples of any tile.
CASES = {
    "in_batch_negatives": (38, None, 130, (1, 33, 64, 130),
                           dict(target="partner", exclude_diagonal=True, weights=True, groups=True)),
    "contrastive_with_negatives": (37, 74, 33, (5, 17, 33), dict(target="diagonal")),
    "arccon_one_prefix": (20, 20, 64, (32,), dict(target="diagonal", margin=math.radians(10))),
    "margin_on_partners": (12, None, 16, (3, 10, 16), dict(target="partner", exclude_diagonal=True, weights=True,
                                                          groups=True, margin=math.radians(10))),
    "one_row": (1, 1, 5, (1, 2), dict(target="diagonal")),
}


@pytest.fixture
def dense_dims(monkeypatch):
    """The triton backend, its dense dims scheme taking every dims call, in blocks of BLOCK_ROWS rows."""
    backend = backend_or_skip("triton")
    from angle_kernels.triton_ops import _similarity_xent_dense_dims, similarity_xent_dense, similarity_xent_paths

    monkeypatch.setattr(similarity_xent_dense, "MIN_WIDTH", 1)
    monkeypatch.setattr(similarity_xent_paths, "DENSE_DIMS_MIN_WIDTH", 1)
    monkeypatch.setattr(_similarity_xent_dense_dims, "MAX_BLOCK_ROWS", BLOCK_ROWS)
    return backend


def _inputs(name, dtype):
    rows, c_rows, dim, dims, options = CASES[name]
    gen = generator("similarity_xent_dense_dims", name, dtype)
    q = randn(gen, rows, dim, dtype=dtype)
    c = None if c_rows is None else randn(gen, c_rows, dim, dtype=dtype)
    kwargs = dict(scale=20.0, target=options["target"], exclude_diagonal=options.get("exclude_diagonal", False),
                  margin=options.get("margin", 0.0), dims=dims)
    if options.get("weights"):
        kwargs["row_weights"] = torch.randint(0, 3, (rows,), generator=gen).to(torch.float32) / 2
    if options.get("groups"):
        kwargs["group_ids"] = torch.randint(0, max(1, rows // 3), (rows,), generator=gen)
    return q, c, kwargs


def _prefix_oracle(q, c=None, dims=None, **kwargs):
    """The oracle's k calls on the truncated inputs, stacked: what the contract says dims is."""
    return torch.stack([oracle.similarity_xent(q[:, :d], None if c is None else c[:, :d], **kwargs) for d in dims])


def _check(backend, q, c, kwargs, what):
    on_device = moved_to(backend.device, kwargs)
    args = (q.to(backend.device), None if c is None else c.to(backend.device), 20.0, kwargs["target"])
    assert backend.ops.computes("similarity_xent", *args, **{k: v for k, v in on_device.items()
                                                             if k not in ("scale", "target")}) == (
        "triton", "dense_dims"), what
    if c is None:
        return check_against_oracle(lambda q: backend.ops.similarity_xent(q, None, **on_device),
                                    lambda q: _prefix_oracle(q, None, **kwargs), [q], what, device=backend.device)
    return check_against_oracle(lambda q, c: backend.ops.similarity_xent(q, c, **on_device),
                                lambda q, c: _prefix_oracle(q, c, **kwargs), [q, c], what, device=backend.device)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("name", sorted(CASES))
def test_against_oracle(dense_dims, name, dtype):
    q, c, kwargs = _inputs(name, dtype)
    _check(dense_dims, q, c, kwargs, f"{name} dims={kwargs['dims']} {dtype}")


# 16 bits: in_batch_negatives with a first prefix of 8, not 1. A prefix of width 1 has no gradient (its cosines are
# +-1), so its tiles' tangential and radial parts must cancel exactly; the running sum over the prefixes is rounded
# to 16 bits for the slice products while the radial sums take it unrounded, and the residue, bf16's rounding of
# the prefix's gradient tile, can exceed twice eager bf16's error on that slice (the torch backend's mixed path,
# the same arithmetic, gives the same results there).
HALF_DIMS = {"in_batch_negatives": (8, 33, 64, 130)}


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("name", ["in_batch_negatives", "contrastive_with_negatives", "arccon_one_prefix"])
def test_half_precision(dense_dims, name, dtype):
    q, c, kwargs = _inputs(name, dtype)
    kwargs["dims"] = HALF_DIMS.get(name, kwargs["dims"])
    _check(dense_dims, q, c, kwargs, f"{name} dims={kwargs['dims']} {dtype}")


def test_float16_gradient_of_a_small_upstream_gradient_does_not_underflow(dense_dims):
    """The gradient of 1e-6 x (the prefixes' losses, weighted 1 and 0.25) is 1e-6 x the gradient: the gradient
    tiles carry grad_loss_j / max|grad_loss| (and w_i / max|w|), never the upstream gradient's magnitude nor 1/M,
    so their fp16 rounding loses nothing (with them inside, entries of 1e-6 x scale x p_ij / M, about 3e-8, would
    fall below fp16's smallest subnormal; tests/ops/test_similarity_xent.py's test of the same name). Short rows
    (|q| ~ 4e-3), so that the gradient itself is a normal float16 number."""
    q = (1e-3 * randn(generator("fp16_small_upstream_dense_dims"), 24, 16)).to(torch.float16)
    upstream = torch.tensor([1.0, 0.25], dtype=torch.float32)
    grads = []
    for factor in (1.0, 1e-6):
        leaf = leaf_like(q, device=dense_dims.device)
        loss = dense_dims.ops.similarity_xent(leaf, None, 20.0, "partner", exclude_diagonal=True, dims=(8, 16))
        (factor * (loss * upstream.to(loss.device)).sum()).backward()
        grads.append(leaf.grad.double().cpu() / factor)
    assert torch.isfinite(grads[1]).all()
    assert_close(grads[1], grads[0], 2e-3, "dq of 1e-6 x loss, / 1e-6")


@pytest.mark.parametrize("name", ["in_batch_negatives", "contrastive_with_negatives"])
def test_equals_the_torch_backends_dims(dense_dims, name):
    """In float64 the scheme and the torch backend's dims path (torch_ops/similarity_xent.py) agree to rounding:
    the losses and the gradients for an upstream gradient that weights the prefixes differently."""
    torch_backend = backend_or_skip("torch")
    q, c, kwargs = _inputs(name, torch.float64)
    inputs = [q] if c is None else [q, c]
    upstream = torch.linspace(0.5, 2.0, len(kwargs["dims"]), dtype=torch.float64)

    def run(backend):
        on_device = moved_to(backend.device, kwargs)
        leaves = [leaf_like(x, device=backend.device) for x in inputs]
        loss = backend.ops.similarity_xent(leaves[0], leaves[1] if len(leaves) > 1 else None, **on_device)
        loss.backward(upstream.to(backend.device))
        return [loss.detach().cpu()] + [x.grad.cpu() for x in leaves]

    for ours, theirs in zip(run(dense_dims), run(torch_backend)):
        assert_close(ours, theirs, 1e-12, f"{name}: dense dims against the torch backend's dims")


@pytest.mark.parametrize("symmetric", [True, False], ids=["c=None", "c"])
def test_holds_one_block_of_tiles(monkeypatch, dense_dims, symmetric):
    """The scheme's largest tensors are one row block's tiles (k of them in backward, [k, b, Mc]), whatever M is:
    with blocks of 4 rows and k = 3, nothing of forward or backward reaches M x Mc elements."""
    from angle_kernels.triton_ops import _similarity_xent_dense_dims

    monkeypatch.setattr(_similarity_xent_dense_dims, "MAX_BLOCK_ROWS", 4)
    rows, c_rows, dims = 32, 32 if symmetric else 48, (3, 7, 12)
    gen = generator("dense_dims_memory", symmetric)
    # D = 12: the inputs, [M, D] and [Mc, D], are smaller than M x Mc
    leaves = [leaf_like(randn(gen, rows, 12), device=dense_dims.device)]
    if not symmetric:
        leaves.append(leaf_like(randn(gen, c_rows, 12), device=dense_dims.device))
    kwargs = moved_to(dense_dims.device, dict(
        scale=20.0, target="partner", exclude_diagonal=symmetric, margin=0.1, dims=dims,
        row_weights=torch.rand(rows, generator=gen),
        group_ids=torch.randint(0, 10, (rows,), generator=gen) if symmetric else None))
    recorder = ShapeRecorder()
    with recorder.mode:
        loss = dense_dims.ops.similarity_xent(leaves[0], leaves[1] if len(leaves) > 1 else None, **kwargs)
        recorder.phase = "backward"
        loss.backward(torch.ones(len(dims), device=loss.device))
    # (tensors of 2 or more dimensions: the Triton interpreter passes each kernel argument as a 1-D copy of its bytes)
    largest = max((entry for entry in recorder.shapes if len(entry[1]) >= 2), key=lambda entry: math.prod(entry[1]))
    assert math.prod(largest[1]) <= len(dims) * 4 * c_rows < rows * c_rows, (
        f"{largest}: more than one block's k tiles of 4 x {c_rows}")


def test_the_backend_takes_the_scheme_where_it_says(monkeypatch):
    """Verified and timed (DENSE_DIMS_MIN_WIDTH 768, the dense scheme's MIN_WIDTH): triton's similarity_xent sends
    it dims calls from that width up while a block of MIN_BLOCK_ROWS rows of its k + 1.5 tiles fits; narrower ones,
    and more columns, to the prefix kernels; the full-width loss as before. Switched off (None: a path awaiting
    its verification), every dims call stays on the prefix kernels."""
    pytest.importorskip("triton")
    from angle_kernels.triton_ops import _similarity_xent_dense_dims, similarity_xent_dense, similarity_xent_paths

    def path(width, columns, dims):
        q = torch.empty(2, width, device="meta")
        c = torch.empty(columns, width, device="meta")
        return similarity_xent_paths.code_path(q, c, 20.0, "diagonal", dims=dims)

    from angle_kernels.triton_ops import awaiting_verification_on

    five = (64, 128, 256, 512, 768)
    assert similarity_xent_paths.DENSE_DIMS_MIN_WIDTH == similarity_xent_dense.MIN_WIDTH == 768
    with awaiting_verification_on():  # verify's checks and the op sweep: at its PROPOSED width
        assert similarity_xent_paths.DENSE_DIMS_MIN_WIDTH == similarity_xent_paths.PROPOSED_DENSE_DIMS_MIN_WIDTH
    monkeypatch.setattr(similarity_xent_paths, "DENSE_DIMS_MIN_WIDTH", None)
    assert path(768, 32768, five) == path(4096, 32768, five[:-1] + (4096,)) == "dims"
    monkeypatch.setattr(similarity_xent_paths, "DENSE_DIMS_MIN_WIDTH", 768)
    assert path(768, 32768, five) == "dense_dims"
    assert path(4096, 32768, five[:-1] + (4096,)) == "dense_dims"
    assert path(512, 32768, (64, 128, 256, 512)) == "dims"
    fits = int(_similarity_xent_dense_dims.TILE_ELEMENTS // (_similarity_xent_dense_dims.MIN_BLOCK_ROWS * 6.5))
    assert path(768, fits, five) == "dense_dims"
    assert path(768, fits + 1, five) == "dims"
    assert path(768, 32768, None) == "dense"
    assert path(512, 32768, None) == "fused"
    monkeypatch.setattr(similarity_xent_dense, "MIN_WIDTH", 16)
    monkeypatch.setattr(similarity_xent_paths, "DENSE_DIMS_MIN_WIDTH", 16)
    assert path(16, 8, (4, 16)) == "dense_dims"

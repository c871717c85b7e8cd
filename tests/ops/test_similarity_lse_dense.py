"""The Triton backend's dense similarity_lse scheme (triton_ops/_similarity_lse_dense.py) and the dims fallback.

Three paths of triton_ops/similarity_lse_paths.py: "dense" (one width), "dense_dims" (every prefix of dims in one
pass) and "fused_prefixes" (the verified fused kernels once per prefix: the dims calls the dense scheme does not
take). The dense paths take calls from widths the GPU runs set; here the widths are lowered to 1 so that the tiny
cases reach them through the backend's own choice, and the row blocks are shrunk to a few rows so that the cases span
several. Each case holds its values and gradients to the float64 oracle (with dims: its k one-width calls on the
truncated inputs, stacked), in every dtype; in float64 the dense dims results also equal the dense path's per prefix.
"""

from __future__ import annotations

import pytest
import torch

from angle_kernels.testing import oracle
from angle_kernels.testing.helpers import (
    HUGE_OP_MAGNITUDES, assert_close, backend_or_skip, check_against_oracle, generator, huge_magnitude_id,
    huge_row_factors, leaf_like, moved_to, randn,
)

BLOCK_ROWS = 4  # the dense scheme's row blocks here: every case spans several, the last one partial

# name -> (M, Mc, D, dims, options). "filter": (D' of separate filter embeddings, threshold offset; at least the
# widest prefix wide); "self_filter": the model's own rows as the filter (a false-negative filter), its threshold
# the target's score minus the offset. Widths and row counts are not multiples of any tile; one prefix of width 1.
CASES = {
    "query_to_doc_hard": (10, 30, 40, (1, 17, 40), dict(period=10, exclude="target", penalty=5.0,
                                                        penalty_on="other")),
    "doc_to_doc_own": (9, 27, 33, (5, 33), dict(period=9, exclude="own", penalty=3.0, penalty_on="own")),
    "guided": (7, 21, 24, (8, 20), dict(target_offset=2, penalty=2.0, penalty_on="all",
                                       filter=(28, 0.02), filter_keeps_target=True, scale=1 / 0.05)),
    "false_negative_filter": (10, 30, 40, (16, 40), dict(period=10, self_filter=0.1, filter_keeps_target=True)),
    "dot_products": (9, 18, 24, (8, 24), dict(target_offset=3, penalty=0.2, penalty_on="all", self_filter=2.0,
                                             filter_keeps_target=True, normalize=False, scale=0.3)),
    "one_row": (1, 1, 5, (2, 5), dict()),
    # more columns than one column tile of the tile kernels (128 here)
    "several_tiles": (13, 150, 33, (5, 20, 33), dict(period=50, exclude="own", penalty=2.0, penalty_on="other")),
}
PATHS = ("dense", "dense_dims", "fused_prefixes")


@pytest.fixture
def triton_lse(monkeypatch):
    """The triton backend with the dense paths taking every call they can, in blocks of BLOCK_ROWS rows."""
    backend = backend_or_skip("triton")
    from angle_kernels.triton_ops import _similarity_lse_dense, similarity_lse_paths

    monkeypatch.setattr(similarity_lse_paths, "DENSE_MIN_WIDTH", 1)
    monkeypatch.setattr(similarity_lse_paths, "DENSE_DIMS_MIN_WIDTH", 1)
    monkeypatch.setattr(_similarity_lse_dense, "MAX_BLOCK_ROWS", BLOCK_ROWS)
    return backend


def _held_to(path, monkeypatch):
    """fused_prefixes is what dims calls take with the dense dims scheme off."""
    from angle_kernels.triton_ops import similarity_lse_paths

    if path == "fused_prefixes":
        monkeypatch.setattr(similarity_lse_paths, "DENSE_DIMS_MIN_WIDTH", None)


def _threshold(fq, fc, target_offset, offset, normalize):
    """Each row's filter score of its target column (0.2 without one) minus the offset, float64 [M]."""
    fq, fc = fq.double(), fc.double()
    scores = oracle.cosine_matrix(fq, fc) if normalize else fq @ fc.T
    rows = torch.arange(fq.shape[0])
    targets = rows + target_offset
    has = targets < fc.shape[0]
    at_target = torch.full((fq.shape[0],), 0.2, dtype=torch.float64)
    at_target[has] = scores[rows[has], targets[has]]
    return at_target - offset


def _inputs(name, dtype, with_dims=True):
    """(q, c, op keyword arguments): with dims, the threshold [k, M], each prefix's from its own filter scores."""
    rows, cols, dim, dims, options = CASES[name]
    gen = generator("similarity_lse_dense", name, dtype)
    q, c = randn(gen, rows, dim, dtype=dtype), randn(gen, cols, dim, dtype=dtype)
    kwargs = dict(scale=options.get("scale", 20.0), target_offset=options.get("target_offset", 0),
                  period=options.get("period", 0), exclude=options.get("exclude", "none"),
                  penalty=options.get("penalty", 0.0), penalty_on=options.get("penalty_on", "none"),
                  filter_keeps_target=options.get("filter_keeps_target", False),
                  normalize=options.get("normalize", True), dims=dims if with_dims else None)
    widths = dims if with_dims else (dim,)
    fq = fc = offset = None
    if "filter" in options:
        filter_dim, offset = options["filter"]
        # a guide that agrees with the model in part, so that the filter drops some but not all columns
        fq = torch.cat([q.float(), randn(gen, rows, filter_dim - dim)], dim=1) if filter_dim > dim else None
        fc = torch.cat([c.float(), randn(gen, cols, filter_dim - dim)], dim=1) if filter_dim > dim else None
    elif "self_filter" in options:
        fq, fc, offset = q.detach(), c.detach(), options["self_filter"]
    if fq is not None:
        thresholds = [_threshold(fq[:, :d], fc[:, :d], kwargs["target_offset"], offset, kwargs["normalize"])
                      for d in widths]
        kwargs.update(filter_q=fq, filter_c=fc, filter_threshold=(torch.stack(thresholds) if with_dims
                                                                  else thresholds[0]).to(torch.float32))
    return q, c, kwargs


def _prefix_oracle(q, c, dims=None, filter_q=None, filter_c=None, filter_threshold=None, **kwargs):
    """The oracle's k calls on the truncated inputs, stacked: what the contract says dims is."""
    if dims is None:
        return oracle.similarity_lse(q, c, filter_q=filter_q, filter_c=filter_c, filter_threshold=filter_threshold,
                                     **kwargs)
    return torch.stack([oracle.similarity_lse(
        q[:, :d], c[:, :d], filter_q=None if filter_q is None else filter_q[:, :d],
        filter_c=None if filter_c is None else filter_c[:, :d],
        filter_threshold=None if filter_threshold is None else filter_threshold[i], **kwargs)
        for i, d in enumerate(dims)])


def _own_rows(kwargs, q, c):
    """The keyword arguments with a false-negative filter on the leaves' own rows (as the losses pass it)."""
    if kwargs.get("filter_q") is not None and kwargs["filter_q"].shape == q.shape and kwargs["filter_q"].dtype == \
            q.dtype and torch.equal(kwargs["filter_q"], q.detach()):
        return dict(kwargs, filter_q=q.detach(), filter_c=c.detach())
    return kwargs


def _check(backend, path, name, dtype, wrap=None):
    q, c, kwargs = _inputs(name, dtype, with_dims=path != "dense")
    on_device = moved_to(backend.device, kwargs)
    taken = backend.ops.computes("similarity_lse", q.to(backend.device), c.to(backend.device), **on_device)
    assert taken == ("triton", path), f"{name}: {taken}"
    wrap = wrap or (lambda x: x)

    def ours(q, c):
        return backend.ops.similarity_lse(wrap(q), wrap(c), **_own_rows(on_device, q, c))

    return check_against_oracle(ours, lambda q, c: _prefix_oracle(q, c, **_own_rows(kwargs, q, c)), [q, c],
                                f"{path} {name} {dtype}", device=backend.device)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_against_oracle_float64(triton_lse, monkeypatch, path, name):
    _held_to(path, monkeypatch)
    _check(triton_lse, path, name, torch.float64)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", ["guided", "doc_to_doc_own", "dot_products", "several_tiles"])
def test_against_oracle_float32(triton_lse, monkeypatch, path, name):
    _held_to(path, monkeypatch)
    _check(triton_lse, path, name, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("path, name", [("dense", "false_negative_filter"), ("dense_dims", "guided"),
                                        ("dense_dims", "doc_to_doc_own"), ("fused_prefixes", "query_to_doc_hard")])
def test_half_precision(triton_lse, monkeypatch, path, name, dtype):
    _held_to(path, monkeypatch)
    _check(triton_lse, path, name, dtype)


@pytest.mark.parametrize("dtype, factor", HUGE_OP_MAGNITUDES, ids=[huge_magnitude_id(c) for c in HUGE_OP_MAGNITUDES])
@pytest.mark.parametrize("path", ["dense", "dense_dims"])
def test_huge_rows(triton_lse, path, dtype, factor):
    """Rows around 1.8e19 (float32: their squared norms and dots overflow; 2^100 in bfloat16, 2^996 in float64),
    mixed with ordinary ones, in q, c and a filter on the model's own rows: the oracle's results on the ordinary
    rows (cosines are scale-invariant)."""
    def huge(x):
        return x * huge_row_factors(x, factor)

    q, c, kwargs = _inputs("false_negative_filter", dtype, with_dims=path != "dense")
    on_device = moved_to(triton_lse.device, kwargs)

    def ours(q, c):
        big_q, big_c = huge(q), huge(c)
        return triton_lse.ops.similarity_lse(big_q, big_c, **dict(on_device, filter_q=big_q.detach(),
                                                                   filter_c=big_c.detach()))

    check_against_oracle(ours, lambda q, c: _prefix_oracle(q, c, **dict(kwargs, filter_q=q.detach(),
                                                                          filter_c=c.detach())),
                         [q, c], f"{path} huge rows {dtype} x{factor:g}", device=triton_lse.device)


@pytest.mark.parametrize("path", PATHS)
def test_rows_that_keep_no_column(triton_lse, monkeypatch, path):
    """A row whose every column is filtered has lse = -inf and no gradient; the other rows are exact, no NaN."""
    _held_to(path, monkeypatch)
    q, c, kwargs = _inputs("guided", torch.float64, with_dims=path != "dense")
    threshold = kwargs["filter_threshold"].clone()
    threshold[..., [1, 4]] = -2.0  # every filter cosine is above -2: rows 1 and 4 keep nothing
    kwargs.update(filter_threshold=threshold, filter_keeps_target=False)
    on_device = moved_to(triton_lse.device, kwargs)
    leaves = [leaf_like(q, device=triton_lse.device), leaf_like(c, device=triton_lse.device)]
    lse = triton_lse.ops.similarity_lse(*leaves, **on_device)
    exact_leaves = [leaf_like(q), leaf_like(c)]
    exact = _prefix_oracle(*exact_leaves, **kwargs)
    weights = torch.linspace(0.5, 1.5, exact.numel(), dtype=torch.float64).reshape(exact.shape)
    for value, leaves_of, w in ((lse, leaves, weights.to(triton_lse.device)), (exact, exact_leaves, weights)):
        torch.where(torch.isfinite(value), value, torch.zeros_like(value)).mul(w).sum().backward()
    empty = torch.isneginf(exact.detach())
    assert empty[..., [1, 4]].all() and not empty.all()
    assert torch.equal(torch.isneginf(lse.detach().cpu()), empty)
    assert_close(lse.detach().cpu()[~empty], exact.detach()[~empty], 1e-10, "finite rows")
    for ours, ref, what in zip(leaves, exact_leaves, ("dq", "dc")):
        assert torch.isfinite(ours.grad).all(), what
        assert_close(ours.grad.cpu(), ref.grad, 1e-8, what)


@pytest.mark.parametrize("name", ["guided", "query_to_doc_hard"])
def test_dense_dims_equals_the_dense_path_per_prefix(triton_lse, name):
    """In float64 the one-pass dims scheme and the one-width dense path on each truncated input agree to rounding:
    the values and the gradients for an upstream gradient that weights the prefixes differently."""
    from angle_kernels.triton_ops import similarity_lse_paths

    q, c, kwargs = _inputs(name, torch.float64)
    kwargs = moved_to(triton_lse.device, kwargs)
    dims = kwargs["dims"]
    args = (kwargs["scale"], kwargs["target_offset"], kwargs["period"], kwargs["exclude"], kwargs["penalty"],
            kwargs["penalty_on"])
    fq, fc, threshold = (kwargs.get(key) for key in ("filter_q", "filter_c", "filter_threshold"))
    upstream = torch.randn(len(dims), q.shape[0], generator=generator("upstream", name), dtype=torch.float64)
    upstream = upstream.to(triton_lse.device)

    leaves = [leaf_like(q, device=triton_lse.device), leaf_like(c, device=triton_lse.device)]
    together = similarity_lse_paths.similarity_lse(*leaves, *args, fq, fc, threshold, kwargs["filter_keeps_target"],
                                                   kwargs["normalize"], dims=dims, path="dense_dims")
    (together * upstream).sum().backward()
    apart_leaves = [leaf_like(q, device=triton_lse.device), leaf_like(c, device=triton_lse.device)]
    apart = torch.stack([similarity_lse_paths.similarity_lse(
        apart_leaves[0][:, :d], apart_leaves[1][:, :d], *args, None if fq is None else fq[:, :d].double(),
        None if fc is None else fc[:, :d].double(), None if threshold is None else threshold[i].double(),
        kwargs["filter_keeps_target"], kwargs["normalize"], path="dense") for i, d in enumerate(dims)])
    (apart * upstream).sum().backward()
    assert_close(together.detach(), apart.detach(), 1e-12, f"{name}: lse")
    for ours, theirs, what in zip(leaves, apart_leaves, ("dq", "dc")):
        assert_close(ours.grad, theirs.grad, 1e-11, f"{name}: {what}")


def test_the_backend_takes_the_paths_where_it_says(monkeypatch):
    """One width: the dense scheme (verified, timed) from DENSE_MIN_WIDTH (2,048) up, the fused kernels below. Dims:
    the dense dims scheme (verified, timed) from DENSE_DIMS_MIN_WIDTH (768) up while a block of MIN_BLOCK_ROWS rows
    of its tiles fits, the fused kernels per prefix otherwise. The checks' switch (awaiting_verification_on: verify,
    the GPU op sweep) puts both schemes at their PROPOSED width, 768."""
    pytest.importorskip("triton")
    from angle_kernels.triton_ops import _similarity_lse_dense, awaiting_verification_on, similarity_lse_paths

    def path(width, columns, dims=None, filtered=False):
        q = torch.empty(2, width, device="meta")
        c = torch.empty(columns, width, device="meta")
        threshold = torch.empty(2, device="meta") if filtered else None
        return similarity_lse_paths.code_path(q, c, 20.0, filter_q=q if filtered else None,
                                              filter_c=c if filtered else None, filter_threshold=threshold,
                                              dims=dims)

    five = (64, 128, 256, 512, 768)
    assert similarity_lse_paths.DENSE_MIN_WIDTH == 2048 and similarity_lse_paths.DENSE_DIMS_MIN_WIDTH == 768
    assert path(2047, 32768) == "fused" and path(2048, 32768) == path(4096, 32768) == "dense"
    assert path(768, 32768, five) == path(4096, 32768, five[:-1] + (4096,)) == "dense_dims"
    assert path(767, 32768, five[:-1] + (767,)) == "fused_prefixes"
    dims_fit = int(_similarity_lse_dense.TILE_ELEMENTS // (_similarity_lse_dense.MIN_BLOCK_ROWS * 5.5))
    assert path(768, dims_fit, five) == "dense_dims" and path(768, dims_fit + 1, five) == "fused_prefixes"
    fits = int(_similarity_lse_dense.TILE_ELEMENTS // (_similarity_lse_dense.MIN_BLOCK_ROWS * 2.5))  # a filter's tile
    assert path(2048, fits, filtered=True) == "dense" and path(2048, fits + 1, filtered=True) == "fused"
    assert path(2048, fits + 1) == "dense"
    with awaiting_verification_on():
        assert similarity_lse_paths.DENSE_MIN_WIDTH == 768  # the checks' cases are laid out around it
        assert path(768, 32768) == "dense" and path(768, 32768, five) == "dense_dims"
        assert path(512, 32768) == "fused" and path(512, 32768, five[:-1]) == "fused_prefixes"
        fits = int(_similarity_lse_dense.TILE_ELEMENTS // (_similarity_lse_dense.MIN_BLOCK_ROWS * 5.5))
        assert path(768, fits, five) == "dense_dims" and path(768, fits + 1, five) == "fused_prefixes"
        fits = int(_similarity_lse_dense.TILE_ELEMENTS // (_similarity_lse_dense.MIN_BLOCK_ROWS * 10.5))
        assert path(768, fits, five, True) == "dense_dims" and path(768, fits + 1, five, True) == "fused_prefixes"
    assert similarity_lse_paths.DENSE_MIN_WIDTH == 2048 and similarity_lse_paths.DENSE_DIMS_MIN_WIDTH == 768


def test_filtered_dims_calls_take_the_dense_dims_scheme_only_where_its_passes_block_the_filter_alike():
    """The dense dims scheme's forward holds one tile per row block, its backward k: past a size the two take the
    filter's products in row blocks of different sizes, where cuBLAS may round a score at its threshold differently
    in the two (a duplicate text's guide score in a GIST batch: kept in forward, dropped in backward). There a
    filtered dims call takes the fused kernels per prefix, whose passes compute the filter alike; unfiltered calls,
    and filtered ones whose blocks agree (a GIST batch of 4,096 queries against 8,192 texts), the dense dims
    scheme."""
    pytest.importorskip("triton")
    from angle_kernels.triton_ops import _similarity_lse_dense, similarity_lse_paths

    five = (64, 128, 256, 512, 768)

    def path(rows, columns, filtered):
        q = torch.empty(rows, 768, device="meta")
        c = torch.empty(columns, 768, device="meta")
        guide = (q, c, torch.empty(len(five), rows, device="meta")) if filtered else (None, None, None)
        return similarity_lse_paths.code_path(q, c, 20.0, filter_q=guide[0], filter_c=guide[1],
                                              filter_threshold=guide[2], dims=five)

    blocks = _similarity_lse_dense.block_rows
    assert blocks(4096, 8192, 1, True) == blocks(4096, 8192, 5, True) == _similarity_lse_dense.MAX_BLOCK_ROWS
    assert path(4096, 8192, filtered=True) == path(4096, 8192, filtered=False) == "dense_dims"
    assert blocks(8192, 16384, 1, True) != blocks(8192, 16384, 5, True)
    assert path(8192, 16384, filtered=True) == "fused_prefixes"
    assert path(8192, 16384, filtered=False) == "dense_dims"
    assert blocks(8192, 16384, 1, False) == blocks(8192, 16384, 5, False)  # the model's own rows alone would agree
    assert path(2, 8192, filtered=True) == "dense_dims"  # one block of every row in both


@pytest.mark.parametrize("path", ["dense", "dense_dims"])
def test_float16_gradient_of_a_small_upstream_gradient_does_not_underflow(triton_lse, path):
    """The gradient of 1e-6 x lse is 1e-6 x the gradient: the gradient tiles carry grad / max|grad|, never the
    upstream gradient's magnitude, so their fp16 rounding loses nothing (tests/ops/test_similarity_lse.py's test of
    the same name: short rows, so that the gradient itself is a normal float16 number)."""
    q = (1e-3 * randn(generator("lse_dense_fp16_small_upstream"), 24, 16)).to(torch.float16)
    c = (1e-3 * randn(generator("lse_dense_fp16_small_upstream_c"), 30, 16)).to(torch.float16)
    dims = None if path == "dense" else (8, 16)
    grads = []
    for factor in (1.0, 1e-6):
        leaves = [leaf_like(q, device=triton_lse.device), leaf_like(c, device=triton_lse.device)]
        lse = triton_lse.ops.similarity_lse(*leaves, 20.0, period=12, penalty=2.0, penalty_on="other", dims=dims)
        (factor * lse.sum() / 24).backward()
        grads.append([leaf.grad.double().cpu() / factor for leaf in leaves])
    for small, full, name in zip(grads[1], grads[0], ("dq", "dc")):
        assert torch.isfinite(small).all()
        assert_close(small, full, 2e-3, f"{name} of 1e-6 x lse, / 1e-6")


@pytest.mark.parametrize("path", ["dense", "dense_dims"])
def test_one_side_without_gradient(triton_lse, path):
    """A detached c (a memory bank) gets no gradient and q's is the one of the full call; and the other way round."""
    q, c, kwargs = _inputs("doc_to_doc_own", torch.float64, with_dims=path != "dense")
    on_device = moved_to(triton_lse.device, kwargs)
    weights = torch.randn(kwargs["dims"] and (len(kwargs["dims"]), q.shape[0]) or (q.shape[0],),
                          generator=generator("one side", path), dtype=torch.float64).to(triton_lse.device)

    def grads(q_grad, c_grad):
        leaves = [leaf_like(q, device=triton_lse.device), leaf_like(c, device=triton_lse.device)]
        leaves[0].requires_grad_(q_grad)
        leaves[1].requires_grad_(c_grad)
        (triton_lse.ops.similarity_lse(*leaves, **on_device) * weights).sum().backward()
        return [leaf.grad for leaf in leaves]

    both = grads(True, True)
    only_q, only_c = grads(True, False), grads(False, True)
    assert only_q[1] is None and only_c[0] is None
    assert_close(only_q[0], both[0], 1e-14, "dq alone")
    assert_close(only_c[1], both[1], 1e-14, "dc alone")


@pytest.mark.parametrize("path, dims", [("dense", (4, 8)), ("fused", (4, 8)), ("dense_dims", None),
                                        ("fused_prefixes", None), ("dims", None)])
def test_a_code_path_that_cannot_compute_the_call_is_refused(path, dims):
    """A path the op has not, a one-width path for a dims call or a dims path for a one-width call (a backend held
    to one path) is a ValueError naming it, before any kernel runs, not another path's result."""
    pytest.importorskip("triton")
    import re

    from angle_kernels.triton_ops import similarity_lse_paths

    q = torch.zeros(4, 8)
    with pytest.raises(ValueError, match=re.escape(f"has no code path {path!r} for dims={dims!r}")):
        similarity_lse_paths.similarity_lse(q, q, 20.0, 0, 0, "none", 0.0, "none", None, None, None, False, True,
                                            dims=dims, path=path)

"""similarity_lse on every backend that implements it against the float64 oracle: lse and the gradients of q, c.

The cases are the blocks the in-batch-negative family is assembled from (sentence-transformers'
MultipleNegativesRankingLoss directions with their exclusions and hardness modes, GIST's guided filter, the
false-negative filter on the model's own scores), the same with raw dot products (normalize=False,
util.dot_score's logits), and the corners around them: targets past the last column,
a period that lays out hard negatives, a filter that empties whole rows (lse = -inf, no gradient, no NaN),
odd sizes, a single row or column, more rows and columns than one tile.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
from torch.autograd import gradcheck

from angle_kernels.float64_ops import GRAD_TOL, VALUE_TOL
from angle_kernels.testing import oracle
from angle_kernels.testing.helpers import (
    BACKEND_NAMES, HALF_DTYPES, HUGE_OP_MAGNITUDES, Backend, assert_close, backend_or_skip, check_against_oracle,
    generator, huge_magnitude_id, huge_row_factors, leaf_like, moved_to, randn, skip_unless_feature,
    skip_unless_implemented,
)

# name -> (M, Mc, D, options). "filter": (D' of the filter embeddings, threshold offset): the threshold of row
# i is the filter cosine of its target column (or 0.2 when it has none) minus the offset, as GIST's
# absolute margin; "self_filter": the filter is the model's own q and c (a false-negative filter), its threshold
# the target's score (cosine, or dot product with normalize=False) minus the offset.
CASES = {
    "query_to_doc": (12, 36, 40, dict(period=12)),
    "query_to_doc_gathered": (6, 36, 40, dict(target_offset=6, period=18)),
    "query_to_query": (12, 12, 40, dict(exclude="target")),
    "doc_to_doc": (12, 36, 40, dict(period=12, exclude="own")),
    "hard_in_batch_negatives": (12, 36, 40, dict(period=12, penalty=5.0, penalty_on="other")),
    "hard_own_negatives": (12, 36, 40, dict(period=12, penalty=9.0, penalty_on="own")),
    "hard_all_negatives": (6, 36, 40, dict(target_offset=6, period=18, penalty=2.0, penalty_on="all")),
    "guided": (12, 24, 40, dict(filter=(24, 0.0), filter_keeps_target=True)),
    "guided_no_target_kept": (12, 12, 40, dict(filter=(24, 0.05))),
    "false_negative_filter": (12, 36, 40, dict(period=12, self_filter=0.1, filter_keeps_target=True)),
    "everything": (9, 45, 33, dict(target_offset=3, period=15, exclude="target", penalty=3.0, penalty_on="all",
                                   filter=(17, 0.02), filter_keeps_target=True, scale=1 / 0.05)),
    "targets_past_the_columns": (10, 4, 8, dict(target_offset=2, exclude="target", penalty=1.0,
                                                penalty_on="all")),
    "filtered_targets_past_the_columns": (10, 4, 8, dict(target_offset=2, exclude="target", filter=(6, 0.0),
                                                         filter_keeps_target=True)),
    "one_row": (1, 1, 5, dict()),
    "one_column": (7, 1, 5, dict(penalty=1.0, penalty_on="other")),
    "several_tiles": (150, 300, 130, dict(period=100, exclude="own", penalty=2.0, penalty_on="other")),
    # raw dot products: unit-variance entries make dots of size ~sqrt(D), hence the small scales
    "dot_query_to_doc": (12, 36, 40, dict(period=12, normalize=False, scale=0.5)),
    "dot_everything": (9, 45, 33, dict(target_offset=3, period=15, exclude="target", penalty=0.2, penalty_on="all",
                                       self_filter=2.0, filter_keeps_target=True, normalize=False, scale=0.3)),
    "dot_guided_several_tiles": (70, 140, 130, dict(filter=(24, 0.5), filter_keeps_target=True, normalize=False,
                                                    scale=0.1)),
}
# several_tiles where the Triton kernels run through the interpreter, which costs per program and per tile step (not
# per element): the same layout at half the size, rows 1.5 and columns 3 periods (past the period a row has no own
# column), still 2 x 3 of the interpreter's tiles (triton_ops/_similarity_tiles.py, _interpreter_blocks: 64 x 64),
# each last one partial, in half the programs (its finish kernels run one program a row: 225 for 450). Compiled,
# the case above runs.
INTERPRETER_CASES = {"several_tiles": (75, 150, 130, dict(CASES["several_tiles"][3], period=50))}
# The width of the cases' gradchecks on the CPU: finite differences take two evaluations per input element, and no
# code path of the torch forms or of the interpreter's tiles (one K-step either way) depends on D.
CPU_GRADCHECK_WIDTH = 8


def _filter_threshold(fq, fc, target_offset, offset, normalize=True):
    cos = oracle.cosine_matrix(fq.double(), fc.double()) if normalize else fq.double() @ fc.double().T
    rows = torch.arange(fq.shape[0])
    targets = rows + target_offset
    has = targets < fc.shape[0]
    at_target = torch.full((fq.shape[0],), 0.2, dtype=torch.float64)
    at_target[has] = cos[rows[has], targets[has]]
    return (at_target - offset).to(torch.float32)


def _inputs(name, dtype, interpreter=False, dim=None):
    """(q, c, op keyword arguments) of a case, drawn from the case's own generator; with `interpreter` its
    INTERPRETER_CASES entry where it has one; `dim`: q and c that wide instead of the case's D."""
    rows, cols, dim_of_case, options = (INTERPRETER_CASES if interpreter and name in INTERPRETER_CASES else CASES)[name]
    dim = dim or dim_of_case
    gen = generator("similarity_lse", name, dtype)
    q, c = randn(gen, rows, dim, dtype=dtype), randn(gen, cols, dim, dtype=dtype)
    kwargs = dict(scale=options.get("scale", 20.0), target_offset=options.get("target_offset", 0),
                  period=options.get("period", 0), exclude=options.get("exclude", "none"),
                  penalty=options.get("penalty", 0.0), penalty_on=options.get("penalty_on", "none"),
                  filter_keeps_target=options.get("filter_keeps_target", False),
                  normalize=options.get("normalize", True))
    if "filter" in options:
        filter_dim, offset = options["filter"]
        # a guide that agrees with the model in part, so that the filter drops some but not all columns
        fq = torch.cat([q.float(), randn(gen, rows, filter_dim)], dim=1)
        fc = torch.cat([c.float(), randn(gen, cols, filter_dim)], dim=1)
        kwargs.update(filter_q=fq, filter_c=fc,
                      filter_threshold=_filter_threshold(fq, fc, kwargs["target_offset"], offset, kwargs["normalize"]))
    if "self_filter" in options:
        kwargs.update(filter_q=q.detach(), filter_c=c.detach(),
                      filter_threshold=_filter_threshold(q, c, kwargs["target_offset"], options["self_filter"],
                                                         kwargs["normalize"]))
    return q, c, kwargs


def torch_blocked_backend() -> Backend:
    """The torch backend with similarity_lse computed in the blocked form (torch_ops/similarity_lse.py, what its
    calls on a GPU run) on the CPU, where its router sends cosines at full width to the softmax form."""
    from angle_kernels.dispatch import Ops, raw_backend
    from angle_kernels.torch_ops import similarity_lse as blocked

    held = types.SimpleNamespace(**dict(vars(raw_backend("torch")), similarity_lse=blocked.similarity_lse))
    return Backend("torch-blocked", Ops("torch-blocked", held), torch.device("cpu"))


@pytest.fixture(params=BACKEND_NAMES + ("torch-blocked", "torch-row-blocks"))
def backend(request, monkeypatch) -> Backend:
    """The backends that implement similarity_lse: all three (the CUDA backend's cases run on a GPU; on CPU its
    kernels are emulated, tests/ops/test_cuda_similarity_lse_emulation.py), and two more forms of the torch backend,
    held to the same oracle: "torch-blocked", the blocked form its GPU calls compute by (its CPU calls of cosines at
    full width compute in the softmax form, torch_ops/_similarity_lse_softmax.py), and "torch-row-blocks", the torch
    backend with a tile budget of a few rows (common.CHUNK_ELEMENTS): the softmax form over several row blocks,
    which keeps no softmax for backward (at the default budget every case here is one block, whose softmax
    backward reuses)."""
    if request.param == "torch-blocked":
        return torch_blocked_backend()
    if request.param == "torch-row-blocks":
        from angle_kernels.torch_ops import common

        monkeypatch.setattr(common, "CHUNK_ELEMENTS", 256)
        found = backend_or_skip("torch")
        return Backend("torch-row-blocks", found.ops, found.device)
    found = backend_or_skip(request.param)
    skip_unless_implemented(found, "similarity_lse")
    return found


def test_the_cases_drop_some_columns_and_keep_others():
    """The filter cases are only worth something if the filter really drops part of each block."""
    for name in ("guided", "guided_no_target_kept", "false_negative_filter", "everything", "dot_everything",
                 "dot_guided_several_tiles"):
        q, c, kwargs = _inputs(name, torch.float64)
        unfiltered = {k: v for k, v in kwargs.items() if not k.startswith("filter_")}
        full, filtered = oracle.similarity_lse(q, c, **unfiltered), oracle.similarity_lse(q, c, **kwargs)
        assert (filtered < full - 1e-9).any() and torch.isfinite(filtered).any(), name


@pytest.mark.parametrize("name", [name for name in CASES if CASES[name][3].get("normalize", True)])
def test_the_softmax_forms_masks_are_the_blocked_forms(name):
    """The softmax form's masked logits (its target columns written through the block's diagonal where the masks are
    the targets' alone: _NamedFilterTiles.masked_logits) are the blocked form's (_Tiles.masked_logits), bit for bit,
    logits and target logits, for the whole block and for a block of middle rows."""
    from angle_kernels.torch_ops._cpu_rows import normalised_rows
    from angle_kernels.torch_ops._similarity_lse_softmax import _NamedFilterTiles, _filter_unit_rows, _unit_rows
    from angle_kernels.torch_ops.similarity_lse import _Tiles

    q, c, kwargs = _inputs(name, torch.float32)
    own = "self_filter" in CASES[name][3]
    (qf, _, q_inv, _), (cf, _, c_inv, _) = normalised_rows(q, c)
    tiles = _NamedFilterTiles(q, c, qf, cf, q_inv, c_inv, kwargs["scale"], kwargs["target_offset"],
                              kwargs["period"], kwargs["exclude"], kwargs["penalty"], kwargs["penalty_on"],
                              kwargs.get("filter_threshold"), kwargs["filter_keeps_target"], own)
    cos = _unit_rows(qf, q_inv) @ _unit_rows(cf, c_inv).T
    guide = None
    if "filter" in CASES[name][3]:
        guide = _filter_unit_rows(kwargs["filter_q"]) @ _filter_unit_rows(kwargs["filter_c"]).T
    for start, end in [(0, q.shape[0]), (q.shape[0] // 3, q.shape[0] - 1)]:
        if start >= end:
            continue
        block_guide = None if guide is None else guide[start:end]
        ours = tiles.masked_logits(cos[start:end], start, end, kwargs.get("filter_threshold"), block_guide)
        blocked = _Tiles.masked_logits(tiles, cos[start:end], start, end, kwargs.get("filter_threshold"), block_guide)
        for mine, theirs in zip(ours, blocked):
            assert torch.equal(mine, theirs), (name, start, end)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, *HALF_DTYPES], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_against_oracle(backend, name, dtype):
    q, c, kwargs = _inputs(name, dtype, interpreter=backend.interpreted)
    if not torch.isfinite(oracle.similarity_lse(q.double(), c.double(), **kwargs)).all():
        pytest.skip("a row keeps no column in this dtype's draw: see test_rows_that_keep_no_column")
    on_device = moved_to(backend.device, kwargs)
    check_against_oracle(lambda q, c: backend.ops.similarity_lse(q, c, **on_device),
                         lambda q, c: oracle.similarity_lse(q, c, **kwargs), [q, c], f"{name} {dtype}",
                         device=backend.device)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_a_filter_on_the_models_queries_and_a_guides_columns(backend, dtype):
    """filter_q the op's own q, filter_c other embeddings (a guide's documents): not a filter on the model's own
    scores, which the torch backend recognises to reuse its score tiles; taken for one (q's side alone compared),
    its q . c tile stood in for q . guide and the lse was off by up to 12.6."""
    q, c, kwargs = _inputs("query_to_doc", dtype)
    guide_c = (0.5 * c.float() + randn(generator("similarity_lse", "a guide's columns", dtype), *c.shape)).to(dtype)
    kwargs.update(filter_q=q.detach(), filter_c=guide_c, filter_keeps_target=True,
                  filter_threshold=_filter_threshold(q, guide_c, kwargs["target_offset"], 0.05, True))
    if not torch.isfinite(oracle.similarity_lse(q.double(), c.double(), **kwargs)).all():
        pytest.skip("a row keeps no column in this dtype's draw: see test_rows_that_keep_no_column")
    on_device = moved_to(backend.device, kwargs)

    def ours(q, c):
        return backend.ops.similarity_lse(q, c, **dict(on_device, filter_q=q.detach()))  # the op's own q

    check_against_oracle(ours, lambda q, c: oracle.similarity_lse(q, c, **kwargs), [q, c], f"half own {dtype}",
                         device=backend.device)


def test_float16_gradient_of_a_small_upstream_gradient_does_not_underflow(backend):
    """As similarity_xent's test: the gradient tile of 1e-6 x lse must not flush to zero in float16 (short rows, so
    that the gradient itself is a normal float16 number)."""
    q = (1e-3 * randn(generator("lse_fp16_small_upstream"), 24, 16)).to(torch.float16)
    c = (1e-3 * randn(generator("lse_fp16_small_upstream_c"), 30, 16)).to(torch.float16)
    grads = []
    for factor in (1.0, 1e-6):
        leaves = [leaf_like(q, device=backend.device), leaf_like(c, device=backend.device)]
        lse = backend.ops.similarity_lse(*leaves, 20.0)
        (factor * lse.sum() / 24).backward()
        grads.append([leaf.grad.double().cpu() / factor for leaf in leaves])
    for small, full, name in zip(grads[1], grads[0], ("dq", "dc")):
        assert torch.isfinite(small).all()
        assert_close(small, full, 2e-3, f"{name} of 1e-6 x lse, / 1e-6")


def test_rows_that_keep_no_column(backend):
    """A row whose every column is excluded or filtered has lse = -inf and contributes no gradient; the
    other rows are exact, and nothing is NaN."""
    q, c, kwargs = _inputs("guided_no_target_kept", torch.float64)
    kwargs["filter_threshold"] = kwargs["filter_threshold"].clone()
    kwargs["filter_threshold"][[1, 4]] = -2.0  # every filter cosine is above -2: rows 1 and 4 keep nothing
    on_device = moved_to(backend.device, kwargs)
    weights = torch.linspace(0.5, 1.5, q.shape[0], dtype=torch.float64)

    def finite_part(lse, w):
        return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)) @ w

    leaves = [leaf_like(q, device=backend.device), leaf_like(c, device=backend.device)]
    lse = backend.ops.similarity_lse(*leaves, **on_device)
    finite_part(lse, weights.to(backend.device)).backward()
    leaves_exact = [leaf_like(q), leaf_like(c)]
    exact = oracle.similarity_lse(*leaves_exact, **kwargs)
    finite_part(exact, weights).backward()

    empty = torch.isneginf(exact.detach())
    assert empty[[1, 4]].all() and not empty.all()
    assert torch.equal(torch.isneginf(lse.detach().cpu()), empty)
    assert_close(lse.detach().cpu()[~empty], exact.detach()[~empty], 1e-10, "finite rows")
    for ours, ref, what in zip(leaves, leaves_exact, ("dq", "dc")):
        assert torch.isfinite(ours.grad).all(), what
        assert_close(ours.grad.cpu(), ref.grad, 1e-8, what)
    assert torch.count_nonzero(leaves[0].grad[empty.to(backend.device)]) == 0


@pytest.mark.parametrize("dims", [None, (3, 6)], ids=["full", "dims"])
@pytest.mark.parametrize("form", ["torch", "torch-blocked"])
def test_a_row_that_keeps_no_column_gives_its_reference_no_gradient(form, dims):
    """Raw dot products with reference rows (MNRL's similarity="dot"), on the torch backend (its CPU softmax form, and
    the blocked form its GPU calls and every dims call take): a row whose only column is excluded has the value -inf
    and, as every such row, no gradient, its reference row's included (its reference term kept its weight, g * scale:
    dq and dr of that row were not 0; the blocked form's softmax of such a row was 0 / 0); the other rows' values and
    gradients are float64 autograd's, and with dims short of D no gradient reaches the columns past the widest
    prefix."""
    from angle_kernels.dispatch import resolve_backend

    gen = generator("similarity_lse", "empty row reference")
    q, c, r = (randn(gen, rows, 8).double() for rows in (5, 1, 5))
    ops = torch_blocked_backend().ops if form == "torch-blocked" else resolve_backend("torch", q)
    options = dict(exclude="target", normalize=False, dims=dims)  # row 0's only column is its target, excluded
    leaves = [leaf_like(x) for x in (q, c, r)]
    value = ops.similarity_lse(leaves[0], leaves[1], 0.5, reference=leaves[2], **options)
    assert torch.isneginf(value[..., 0]).all() and torch.isfinite(value[..., 1:]).all()
    dq, dc, dr = torch.autograd.grad(value, leaves, torch.ones_like(value))  # its upstream gradient too: 1
    assert torch.count_nonzero(dq[0]) == 0 and torch.count_nonzero(dr[0]) == 0
    assert torch.count_nonzero(dq[1:]) > 0 and torch.count_nonzero(dr[1:]) > 0

    exact_leaves = [leaf_like(x) for x in (q, c, r)]
    widths = [8] if dims is None else dims
    references = torch.stack([(exact_leaves[0][:, :d] * exact_leaves[2][:, :d]).sum(dim=1) for d in widths])
    exact = oracle.similarity_lse(*exact_leaves[:2], 0.5, **options) - 0.5 * references.reshape(value.shape)
    finite = torch.isfinite(exact.detach())
    assert torch.equal(finite, torch.isfinite(value.detach()))
    assert_close(value.detach()[finite], exact.detach()[finite], 1e-12, "finite rows")
    for got, want, what in zip((dq, dc, dr), torch.autograd.grad(torch.where(finite, exact, 0.0).sum(), exact_leaves),
                               ("dq", "dc", "dr")):
        assert_close(got, want, 1e-10, what)


@pytest.mark.parametrize("magnitude", [1.0, 1e20], ids=["ordinary", "huge"])
@pytest.mark.parametrize("form", ["torch", "torch-row-blocks", "torch-blocked"])
def test_a_dominant_positive_given_as_reference_gives_exactly_zero(monkeypatch, form, magnitude):
    """Raw dot products whose reference rows are the rows of their target columns (how the MNRL family passes its
    positives), each query a multiple of its positive so that the positive's logit dominates its row (every other
    exponential underflows): every value is exactly 0, the reference logit read from the score tile the target
    column's comes from (one taken from other products differs from it in the last bits), also where the logits
    overflow float32 (rows of 1e20, which the blocked form takes)."""
    from angle_kernels.dispatch import resolve_backend
    from angle_kernels.torch_ops import common

    if form == "torch-row-blocks":
        monkeypatch.setattr(common, "CHUNK_ELEMENTS", 3 * 12)  # blocks of 3 rows
    c = randn(generator("similarity_lse", "dominant reference"), 12, 64) * magnitude
    q = 8.0 * c[:6]
    ops = torch_blocked_backend().ops if form == "torch-blocked" else resolve_backend("torch", q)
    value = ops.similarity_lse(q, c, 1.0, normalize=False, reference=c[:6].clone())
    assert torch.equal(value, torch.zeros_like(value)), value


@pytest.mark.parametrize("target_offset, block_rows", [(2, 3), (3, 2)], ids=["offset2-blocks3", "offset3-blocks2"])
def test_reference_rows_of_targets_past_the_columns_in_row_blocks(monkeypatch, target_offset, block_rows):
    """Raw dot products with reference rows and a false-negative filter that keeps the target, on the torch backend's
    CPU softmax form in blocks of a few rows, the targets of all but the first rows past the 4 columns: the first
    block holds one or two rows whose target lies within the columns, the others none, and every row's value and
    gradients are float64 autograd's (each row's target logit is read through the block's diagonal, the rows past
    the columns from the last column, one per row; the filter keeps every target within the columns)."""
    from angle_kernels.dispatch import resolve_backend
    from angle_kernels.torch_ops import common

    monkeypatch.setattr(common, "CHUNK_ELEMENTS", block_rows * 4)
    gen = generator("similarity_lse", "reference past the columns", target_offset)
    q, c, r = (randn(gen, rows, 8, dtype=torch.float64) for rows in (12, 4, 12))
    threshold = _filter_threshold(q, c, target_offset, 0.1, normalize=False)  # each target's score less 0.1
    options = dict(target_offset=target_offset, exclude="none", normalize=False, filter_threshold=threshold,
                   filter_keeps_target=True)
    ops = resolve_backend("torch", q)

    def ours(q, c, r):
        return ops.similarity_lse(q, c, 0.3, reference=r, filter_q=q.detach(), filter_c=c.detach(), **options)

    def exact(q, c, r):
        return (oracle.similarity_lse(q, c, 0.3, filter_q=q.detach(), filter_c=c.detach(), **options)
                - 0.3 * (q * r).sum(dim=1))

    leaves, exact_leaves = [leaf_like(x) for x in (q, c, r)], [leaf_like(x) for x in (q, c, r)]
    value, expected = ours(*leaves), exact(*exact_leaves)
    assert_close(value, expected, VALUE_TOL[torch.float64], "reference lse")
    weights = torch.linspace(0.5, 1.5, 12, dtype=torch.float64)
    for name, g, e in zip("qcr", torch.autograd.grad(value @ weights, leaves),
                          torch.autograd.grad(expected @ weights, exact_leaves)):
        assert_close(g, e, GRAD_TOL[torch.float64], f"d{name}")


def test_a_retained_graph_gives_the_same_gradients_twice(backend):
    """backward twice through one forward (retain_graph=True), with different upstream gradients: each is the
    oracle's. On the torch backend's CPU calls of one tile the softmax forward kept is backward's: it must come out
    of the first backward unchanged."""
    q, c, kwargs = _inputs("guided", torch.float64)
    on_device = moved_to(backend.device, kwargs)
    leaves = [leaf_like(q, device=backend.device), leaf_like(c, device=backend.device)]
    lse = backend.ops.similarity_lse(*leaves, **on_device)
    exact_leaves = [leaf_like(q), leaf_like(c)]
    exact = oracle.similarity_lse(*exact_leaves, **kwargs)
    for seed in ("first", "second"):
        weights = randn(generator("retained graph", seed), q.shape[0], dtype=torch.float64)
        ours = torch.autograd.grad(lse @ weights.to(backend.device), leaves, retain_graph=True)
        wanted = torch.autograd.grad(exact @ weights, exact_leaves, retain_graph=True)
        for got, want, what in zip(ours, wanted, ("dq", "dc")):
            assert_close(got.cpu(), want, 1e-8, f"{what}, {seed} backward")


# No penalty in these cases: it is a stop-gradient, which finite differences see.
@pytest.mark.parametrize("name", ["guided", "query_to_doc_gathered", "doc_to_doc", "dot_query_to_doc"])
def test_gradcheck_float64(backend, name):
    q, c, kwargs = _inputs(name, torch.float64, dim=CPU_GRADCHECK_WIDTH if backend.device.type == "cpu" else None)
    on_device = moved_to(backend.device, kwargs)
    leaves = [q.to(backend.device).requires_grad_(), c.to(backend.device).requires_grad_()]
    # fast_mode for the Triton interpreter (a random projection of the Jacobian: 30-45 s -> seconds per case); the
    # full Jacobian is checked on the torch backend, and both against the float64 oracle above
    assert gradcheck(lambda q, c: backend.ops.similarity_lse(q, c, **on_device), leaves, eps=1e-6, atol=1e-6,
                     fast_mode=backend.name == "triton")


def test_the_penalty_changes_probabilities_not_slopes(backend):
    """The hardness penalty is a stop-gradient: d lse / d cos_ij = scale * p_ij with p from the penalised
    logits. At penalty = -scale the penalised columns have logit 0 whatever their cosine, yet still carry the
    gradient scale * p_ij."""
    q, c, kwargs = _inputs("hard_in_batch_negatives", torch.float64)
    kwargs.update(penalty=-kwargs["scale"])
    on_device = moved_to(backend.device, kwargs)
    check_against_oracle(lambda q, c: backend.ops.similarity_lse(q, c, **on_device),
                         lambda q, c: oracle.similarity_lse(q, c, **kwargs), [q, c], "penalty = -scale",
                         device=backend.device)
    lse = oracle.similarity_lse(q, c, **kwargs)
    assert not math.isclose(float(lse.sum()), float(oracle.similarity_lse(q, c, scale=kwargs["scale"],
                                                                          period=kwargs["period"]).sum()))


def test_dot_products_are_not_cosines(backend):
    """normalize=False scores raw dot products: scaling a row of q by 3 scales its logits by 3 (cosines would not
    move), and the result still matches the oracle."""
    q, c, kwargs = _inputs("dot_query_to_doc", torch.float64)
    q_scaled = q.clone()
    q_scaled[0] *= 3.0
    on_device = moved_to(backend.device, kwargs)
    lse, lse_scaled = (backend.ops.similarity_lse(x.to(backend.device), c.to(backend.device), **on_device).cpu()
                       for x in (q, q_scaled))
    assert_close(lse_scaled[1:], lse[1:], 1e-12, "rows left alone")
    assert abs(float(lse_scaled[0] - lse[0])) > 0.1
    assert_close(lse_scaled, oracle.similarity_lse(q_scaled, c, **kwargs), 1e-10, "scaled row")


@pytest.mark.parametrize("dtype, magnitude", HUGE_OP_MAGNITUDES, ids=[huge_magnitude_id(c) for c in HUGE_OP_MAGNITUDES])
@pytest.mark.parametrize("name", ["everything", "false_negative_filter", "doc_to_doc"])
def test_huge_rows(backend, name, dtype, magnitude):
    """Rows around 1.8e19 (float32, bfloat16: squared norms and dots overflow) and 1e300 (float64), mixed with
    ordinary ones, in q, c and the filter's embeddings: the oracle's lse and gradients of the ordinary rows
    (cosines are scale-invariant per row; raw dot products are not, and are left out)."""
    q, c, kwargs = _inputs(name, dtype)
    on_device = moved_to(backend.device, kwargs)
    for key in ("filter_q", "filter_c"):  # float32 guide embeddings: at most 2^100 (huge_row_factors)
        if key in on_device:
            guide = on_device[key]
            on_device[key] = guide * huge_row_factors(guide, magnitude if guide.dtype == torch.float64 else 2.0**100)

    def huge(x):
        return x * huge_row_factors(x, magnitude)

    def ours(q, c):
        options = dict(on_device)
        if name == "false_negative_filter":  # the filter is the model's own rows
            options.update(filter_q=huge(q).detach(), filter_c=huge(c).detach())
        return backend.ops.similarity_lse(huge(q), huge(c), **options)

    check_against_oracle(ours, lambda q, c: oracle.similarity_lse(q, c, **kwargs), [q, c],
                         f"{name} {dtype} x{magnitude:g}", device=backend.device)


def test_cpu_dot_products_take_the_softmax_form_where_it_is_exact():
    """The torch backend's CPU calls of raw dot products compute in the softmax form (takes_dot_products) without a
    filter or with one on the model's own scores, for rows whose products cannot overflow; a filter on other
    embeddings, rows near the float32 range, a scale or a hardness penalty that would take the logits there and rows
    that are not finite go to the blocked form, whose rows are scaled by powers of two."""
    from angle_kernels.torch_ops._similarity_lse_softmax import takes_dot_products

    def takes(name, dtype=torch.float32, factor=1.0, scale=None, penalty=None):
        q, c, kwargs = _inputs(name, dtype)
        q = q * factor
        if "self_filter" in CASES[name][3]:
            kwargs.update(filter_q=q.detach())
        return takes_dot_products(q, c, None, kwargs["scale"] if scale is None else scale,
                                  kwargs["penalty"] if penalty is None else penalty, kwargs.get("filter_q"),
                                  kwargs.get("filter_c"), kwargs.get("filter_threshold"))

    assert takes("dot_query_to_doc") and takes("dot_everything") and takes("dot_everything", torch.bfloat16)
    assert not takes("dot_guided_several_tiles")  # a guide: the blocked form
    assert not takes("dot_query_to_doc", factor=2.0**40)  # squared norms past 2^80
    assert takes("dot_query_to_doc", torch.float64, factor=2.0**40)
    assert not takes("dot_query_to_doc", scale=1e37)
    assert not takes("dot_everything", penalty=1e37)  # the penalised logits would be as far out
    assert not takes("dot_query_to_doc", factor=float("nan"))  # NaN rows (value checks off): the blocked form


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_a_filter_on_transposed_views_of_q_and_c(backend, dtype):
    """filter_q and filter_c the transposes of square q and c (their storage and shape, other strides): a filter on
    other embeddings than q and c, not on the model's own scores, which the torch backend recognises to reuse its
    score tiles; taken for one, the q . c tile stood in for q^T . c^T."""
    gen = generator("similarity_lse", "transposed filter", dtype)
    q, c = randn(gen, 12, 12, dtype=dtype), randn(gen, 12, 12, dtype=dtype)
    kwargs = dict(scale=20.0, filter_q=q.T, filter_c=c.T, filter_keeps_target=True,
                  filter_threshold=_filter_threshold(q.T, c.T, 0, 0.05))
    on_device = moved_to(backend.device, {k: v for k, v in kwargs.items() if not k.startswith("filter_")})
    on_device.update(filter_keeps_target=True, filter_threshold=kwargs["filter_threshold"].to(backend.device))

    def ours(q, c):
        return backend.ops.similarity_lse(q, c, **dict(on_device, filter_q=q.detach().T, filter_c=c.detach().T))

    check_against_oracle(ours, lambda q, c: oracle.similarity_lse(q, c, **kwargs), [q, c], f"transposed {dtype}",
                         device=backend.device)


@pytest.mark.parametrize("form", ["torch", "torch-row-blocks", "torch-blocked"])
@pytest.mark.parametrize("same_as_target", [False, True], ids=["other_rows", "target_rows"])
def test_reference_rows(same_as_target, form, monkeypatch):
    """The optional `reference` (raw dot products): lse_i - scale * q_i . r_i and the gradients of q, c and r, on the
    torch backend (the one that declares it) against float64 autograd, and float64 gradcheck; with r_i the row of
    row i's target column (how the MNRL family passes its positives) and with other rows. Its three forms: on the
    CPU the softmax form (one tile, whose softmax backward reuses; "torch-row-blocks": several), and the blocked
    form its GPU calls and huge rows take."""
    from angle_kernels.dispatch import resolve_backend
    from angle_kernels.torch_ops import common

    gen = generator("reference", same_as_target)
    q, c = randn(gen, 7, 12, dtype=torch.float64), randn(gen, 20, 12, dtype=torch.float64)
    r = c[3:10].clone() if same_as_target else randn(gen, 7, 12, dtype=torch.float64)
    options = dict(target_offset=3, period=10, exclude="own", normalize=False)  # no penalty: its detached part
    # is not what gradcheck differentiates
    ops = torch_blocked_backend().ops if form == "torch-blocked" else resolve_backend("torch", q)
    if form == "torch-row-blocks":
        monkeypatch.setattr(common, "CHUNK_ELEMENTS", 60)  # blocks of 3 rows

    def ours(q, c, r):
        return ops.similarity_lse(q, c, 0.3, reference=r, **options)

    def exact(q, c, r):
        return oracle.similarity_lse(q, c, 0.3, **options) - 0.3 * (q * r).sum(dim=1)

    for dtype in (torch.float32, torch.float64):
        leaves = [t.to(dtype).requires_grad_() for t in (q, c, r)]
        value = ours(*leaves)
        grads = torch.autograd.grad(value.sum(), leaves)
        exact_leaves = [t.detach().double().requires_grad_() for t in leaves]
        expected = exact(*exact_leaves)
        expected_grads = torch.autograd.grad(expected.sum(), exact_leaves)
        assert_close(value, expected, VALUE_TOL[dtype], "reference lse")
        for name, g, e in zip("qcr", grads, expected_grads):
            assert_close(g, e, GRAD_TOL[dtype], f"d{name}")
    assert gradcheck(ours, [t.requires_grad_() for t in (q, c, r)])


# ---------------------------------------------------------------------------------------------------------
# dims: every prefix in one call, [k, M], against the oracle's k calls on the truncated inputs
# ---------------------------------------------------------------------------------------------------------
# name -> the CASES entry it extends, and its prefixes (one of width 1, one short of D, D itself)
DIMS_CASES = {
    "query_to_doc": (1, 17, 40),
    "doc_to_doc": (8, 40),
    "hard_all_negatives": (3, 20, 39),
    "guided": (5, 24, 40),  # the guide's rows (64 wide) cut to each prefix too
    "false_negative_filter": (2, 16, 40),
    "everything": (12, 20, 33),
    "several_tiles": (64, 100, 130),
    "dot_everything": (20, 28, 33),
}


# The prefixes of the dims gradchecks (torch backend, CPU), q and c as wide as the last (CPU_GRADCHECK_WIDTH, and 12
# for dot_everything, whose false-negative filter drops every column 1.9 below a row's target score: at width 8 it
# empties rows, whose gradients would go unchecked), a prefix of width 1 or one short of the width among them.
GRADCHECK_DIMS = {"guided": (1, 5, CPU_GRADCHECK_WIDTH), "doc_to_doc": (3, CPU_GRADCHECK_WIDTH),
                  "dot_everything": (6, 11, 12)}


def _dims_inputs(name, dtype, dims=None):
    """A case of CASES with dims (DIMS_CASES', or `dims`, q and c then dims[-1] wide): its filter's threshold one row
    per prefix, from the truncated embeddings, 0.1 higher than the case's (narrow prefixes score more alike: rows
    would keep no column)."""
    q, c, kwargs = _inputs(name, dtype, dim=None if dims is None else dims[-1])
    dims = dims or DIMS_CASES[name]
    if "filter_q" in kwargs:
        _, _, _, options = CASES[name]
        offset = (options["filter"][1] if "filter" in options else options["self_filter"]) - 0.1
        fq, fc = kwargs["filter_q"], kwargs["filter_c"]
        kwargs["filter_threshold"] = torch.stack([_filter_threshold(
            fq[:, :d], fc[:, :d], kwargs["target_offset"], offset, kwargs["normalize"]) for d in dims])
    return q, c, dict(kwargs, dims=dims)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, *HALF_DTYPES], ids=str)
@pytest.mark.parametrize("name", list(DIMS_CASES))
def test_dims_against_oracle(backend, name, dtype):
    skip_unless_feature(backend, "similarity_lse", "dims")
    if backend.name == "triton" and name == "several_tiles":
        pytest.skip("the interpreter's slowest case: Triton's dims paths span several tiles in "
                    "test_similarity_lse_dense.py, its fused kernels in test_against_oracle")
    q, c, kwargs = _dims_inputs(name, dtype)
    if not torch.isfinite(oracle.similarity_lse(q.double(), c.double(), **kwargs)).all():
        pytest.skip("a row keeps no column in this dtype's draw: see test_rows_that_keep_no_column")
    on_device = moved_to(backend.device, kwargs)

    def ours(q, c):
        options = dict(on_device)
        if "self_filter" in CASES[name][3]:  # the filter on the model's own scores: the op's own inputs
            options.update(filter_q=q.detach(), filter_c=c.detach())
        return backend.ops.similarity_lse(q, c, **options)

    check_against_oracle(ours, lambda q, c: oracle.similarity_lse(q, c, **kwargs), [q, c], f"{name} {dtype} dims",
                         device=backend.device)


@pytest.mark.parametrize("form", ["torch", "torch-blocked"])
def test_dims_in_blocks_equal_one_width_calls(monkeypatch, form):
    """The torch backend's dims paths over several row blocks (its CPU router's, which takes a filtered call's
    prefixes one by one, and the blocked form's prefix walk, what its GPU calls run): each prefix equal, to
    rounding, to the one-width path on the truncated inputs, values and gradients (float64), rows that keep no
    column included (-inf, no gradient)."""
    from angle_kernels.dispatch import resolve_backend
    from angle_kernels.torch_ops import common

    monkeypatch.setattr(common, "CHUNK_ELEMENTS", 200)  # blocks of a few rows
    q, c, kwargs = _dims_inputs("everything", torch.float64)
    kwargs["filter_threshold"][1, :3] = -2.0  # the filter drops every column of three rows of the second prefix
    ops = torch_blocked_backend().ops if form == "torch-blocked" else resolve_backend("torch", q)
    leaves = [q.clone().requires_grad_(), c.clone().requires_grad_()]
    value = ops.similarity_lse(*leaves, **kwargs)
    assert torch.isneginf(value[1, :2]).all() and torch.isfinite(value[0]).all()
    weights = torch.randn(value.shape, generator=generator("dims weights"), dtype=torch.float64)
    grads = torch.autograd.grad(torch.where(torch.isinf(value), 0.0, value * weights).sum(), leaves)
    per_prefix, cut_grads = [], [torch.zeros_like(q), torch.zeros_like(c)]
    for p, d in enumerate(kwargs["dims"]):
        cut = [t[:, :d].clone().requires_grad_() for t in (q, c)]
        options = {k: v for k, v in kwargs.items() if k != "dims"}
        options.update(filter_q=options["filter_q"][:, :d], filter_c=options["filter_c"][:, :d],
                       filter_threshold=options["filter_threshold"][p])
        one = ops.similarity_lse(*cut, **options)
        per_prefix.append(one)
        for total, g in zip(cut_grads, torch.autograd.grad(torch.where(torch.isinf(one), 0.0, one * weights[p]).sum(),
                                                           cut)):
            total[:, :d] += g
    torch.testing.assert_close(value, torch.stack(per_prefix).detach(), rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, cut_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", list(GRADCHECK_DIMS))
def test_dims_gradcheck_float64(name):
    from angle_kernels.dispatch import resolve_backend

    q, c, kwargs = _dims_inputs(name, torch.float64, GRADCHECK_DIMS[name])
    if name == "dot_everything":  # the penalty's detached part is not what gradcheck differentiates
        kwargs.update(penalty=0.0, penalty_on="none")
    assert torch.isfinite(oracle.similarity_lse(q, c, **kwargs)).all()  # every row keeps a column: all are checked
    ops = resolve_backend("torch", q)

    def ours(q, c):
        options = dict(kwargs)
        if "self_filter" in CASES[name][3]:
            options.update(filter_q=q.detach(), filter_c=c.detach())
        value = ops.similarity_lse(q, c, **options)
        return torch.where(torch.isinf(value), 0.0, value)

    assert gradcheck(ours, [q.clone().requires_grad_(), c.clone().requires_grad_()], eps=1e-6, atol=1e-6)


def test_dims_reference_rows():
    """reference with dims: row p is lse_p - scale * q_i[:d_p] . r_i[:d_p], gradients of q, c and r included, on
    the torch backend (which implements both) and through dispatch's subtraction for a backend without reference
    (the same values)."""
    from angle_kernels.dispatch import resolve_backend

    gen = generator("reference dims")
    q, c = randn(gen, 7, 12, dtype=torch.float64), randn(gen, 20, 12, dtype=torch.float64)
    r = c[3:10].clone()
    dims = (3, 8, 12)
    options = dict(target_offset=3, period=10, exclude="own", normalize=False, dims=dims)
    ops = resolve_backend("torch", q)

    def ours(q, c, r):
        return ops.similarity_lse(q, c, 0.3, reference=r, **options)

    def exact(q, c, r):
        return oracle.similarity_lse(q, c, 0.3, **options) - 0.3 * torch.stack([(q[:, :d] * r[:, :d]).sum(dim=1)
                                                                                for d in dims])

    leaves = [t.clone().requires_grad_() for t in (q, c, r)]
    exact_leaves = [t.clone().requires_grad_() for t in (q, c, r)]
    value, expected = ours(*leaves), exact(*exact_leaves)
    assert_close(value, expected, VALUE_TOL[torch.float64], "reference lse with dims")
    for name, g, e in zip("qcr", torch.autograd.grad(value.sum(), leaves),
                          torch.autograd.grad(expected.sum(), exact_leaves)):
        assert_close(g, e, GRAD_TOL[torch.float64], f"d{name}")
    assert gradcheck(ours, [t.clone().requires_grad_() for t in (q, c, r)])


def test_dims_checks_name_the_argument():
    from angle_kernels.dispatch import resolve_backend

    q, c, kwargs = _dims_inputs("guided", torch.float32)
    ops = resolve_backend("torch", q)
    with pytest.raises(ValueError, match=r"filter_threshold must be a float \[k=3, M=12\]"):
        ops.similarity_lse(q, c, **dict(kwargs, filter_threshold=kwargs["filter_threshold"][0]))
    with pytest.raises(ValueError, match="at least 40 wide"):
        ops.similarity_lse(q, c, **dict(kwargs, filter_q=kwargs["filter_q"][:, :30],
                                        filter_c=kwargs["filter_c"][:, :30]))
    with pytest.raises(ValueError, match="strictly increasing"):
        ops.similarity_lse(q, c, **dict(kwargs, dims=(24, 5, 40)))


@pytest.mark.parametrize("magnitude", [1e13, 1e15, 1e18])
def test_torch_cpu_huge_rows_keep_their_gradients(magnitude):
    """float32 rows of norms 1e13 to 1e18 (past 2^40) are scaled before their norms' backward (the softmax form's
    _cpu_rows.normalised_rows): unscaled, 1 / |x|^3 underflows and the gradients are 30-50% off."""
    from angle_kernels.torch_ops import similarity_lse_paths

    gen = torch.Generator().manual_seed(1)
    q, c = (magnitude * torch.randn(8, 32, generator=gen, dtype=torch.float64) for _ in range(2))
    options = dict(scale=20.0, target_offset=0, period=0, exclude="none", penalty=0.0, penalty_on="none",
                   filter_q=None, filter_c=None, filter_threshold=None, filter_keeps_target=False, normalize=True)
    leaves64 = [leaf_like(x) for x in (q, c)]
    want_grads = torch.autograd.grad(oracle.similarity_lse(*leaves64, **options).sum(), leaves64)
    leaves32 = [leaf_like(x.float()) for x in (q, c)]
    got = similarity_lse_paths.similarity_lse(*leaves32, 20.0, 0, 0, "none", 0.0, "none", None, None, None, False,
                                              True)
    for grad, ref in zip(torch.autograd.grad(got.sum(), leaves32), want_grads):
        assert float((grad.double() - ref).norm() / ref.norm()) < 1e-5


def test_the_torch_backend_computes_each_call_in_its_form(monkeypatch):
    """CPU cosines at full width take the softmax form, CPU cosines with dims and a filter the softmax form once per
    prefix, CPU dot products it takes its dot-product form; dims without a filter, and every call on another
    device (a GPU), the blocked form, the code the GPU op sweeps timed."""
    from angle_kernels.torch_ops import _similarity_lse_softmax, similarity_lse_paths
    from angle_kernels.torch_ops import similarity_lse as blocked

    taken = []

    def form(name):
        def compute(q, *args, **kwargs):
            taken.append((name, q.shape[1]))
            return torch.zeros(q.shape[0])
        return compute

    monkeypatch.setattr(_similarity_lse_softmax, "similarity_lse", form("softmax"))
    monkeypatch.setattr(_similarity_lse_softmax, "dot_similarity_lse", form("dot softmax"))
    monkeypatch.setattr(_similarity_lse_softmax, "takes_dot_products", lambda *args: True)
    monkeypatch.setattr(blocked, "similarity_lse", form("blocked"))

    def forms(device, normalize=True, dims=None, filtered=False):
        taken.clear()
        q = torch.zeros(4, 8, device=device)
        threshold = torch.zeros((4,) if dims is None else (len(dims), 4), device=device) if filtered else None
        similarity_lse_paths.similarity_lse(q, q, 20.0, 0, 0, "none", 0.0, "none", q if filtered else None,
                                            q if filtered else None, threshold, False, normalize, dims=dims)
        return taken

    assert forms("cpu") == forms("cpu", filtered=True) == [("softmax", 8)]
    assert forms("cpu", dims=(4, 8), filtered=True) == [("softmax", 4), ("softmax", 8)]
    assert forms("cpu", dims=(4, 8)) == [("blocked", 8)]
    assert forms("cpu", normalize=False) == [("dot softmax", 8)]
    assert forms("cpu", normalize=False, dims=(4, 8)) == [("blocked", 8)]
    for options in ({}, dict(filtered=True), dict(dims=(4, 8), filtered=True), dict(normalize=False)):
        assert forms("meta", **options) == [("blocked", 8)], options

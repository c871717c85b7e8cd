"""multiple_negatives_ranking_loss (every option of sentence-transformers 6.2's MultipleNegativesRankingLoss) and
gist_loss (its GISTEmbedLoss), fused.

* the grid: directions x partition_mode x hardness_mode x number of hard-negative columns x similarity_fct
  (util.cos_sim at scale 20, util.dot_score at scale 1), each against
  sentence-transformers' own compute_loss_from_embeddings on the same float64 embeddings (value and gradient
  of every input, to rounding), and against the float64 oracle (angle_kernels.testing.oracle);
* the false-negative filter (no sentence-transformers counterpart) against the oracle, on every backend;
* every backend on representative combinations (dot products included), float32 and bf16 at the half rule
  (under the Triton interpreter, one dtype per combination, in turn: in_turn);
  gradcheck in float64;
* gist_loss against the oracle on every backend (its parity with sentence-transformers' GISTEmbedLoss runs on a
  tiny model in tests/integrations/test_sentence_transformers.py);
* bad options refused with the parent's messages.
The cross-device path (gather_across_devices) is tested with 2 and 3 processes in
tests/integrations/test_cross_device.py.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch.autograd import gradcheck

import angle_kernels as ak
from angle_kernels.testing import oracle
from angle_kernels.testing.helpers import (
    ShapeRecorder, across_backends, assert_close, check_against_oracle, generator, in_turn, leaf_like,
    outputs_and_grads, randn, skip_unless_implemented,
)

ALL = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
DIRECTIONS = {  # (directions, partition modes sentence-transformers accepts for them)
    "q2d": (("query_to_doc",), ("joint", "per_direction")),
    "symmetric": (("query_to_doc", "doc_to_query"), ("joint", "per_direction")),
    "q2d+q2q": (("query_to_doc", "query_to_query"), ("joint",)),
    "q2d+d2d": (("query_to_doc", "doc_to_doc"), ("joint",)),
    "gte": (ALL, ("joint",)),
}
HARDNESS = (None, "in_batch_negatives", "hard_negatives", "all_negatives")
# similarity_fct -> (the functional API's similarity, the scale the grid uses with it)
SIMILARITIES = {"cos_sim": ("cosine", 20.0), "dot_score": ("dot", 1.0)}
GRID = [(name, mode, hardness, k, similarity) for name, (_, modes) in DIRECTIONS.items() for mode in modes
        for hardness in HARDNESS for k in (0, 1, 2) for similarity in SIMILARITIES]


def _embeddings(tag, k, dtype=torch.float64, rows=6, dim=16):
    gen = generator("multiple_negatives", tag, k, dtype)
    return [randn(gen, rows, dim, dtype=dtype) for _ in range(2 + k)]


def _options(name, mode, hardness):
    return dict(directions=DIRECTIONS[name][0], partition_mode=mode, hardness_mode=hardness,
                hardness_strength=3.0 if hardness else 0.0)


@pytest.fixture(scope="module")
def reference_loss():
    """sentence-transformers' loss class (its compute_loss_from_embeddings never touches the model)."""
    losses = pytest.importorskip("sentence_transformers.sentence_transformer.losses")
    from sentence_transformers import util

    def make(similarity_fct, scale, **options):
        return losses.MultipleNegativesRankingLoss(torch.nn.Identity(), scale=scale,
                                                   similarity_fct=getattr(util, similarity_fct), **options)

    return make


@pytest.mark.parametrize("name, mode, hardness, k, similarity_fct", GRID,
                         ids=[f"{n}-{m}-{h}-{k}neg-{s}" for n, m, h, k, s in GRID])
def test_grid_against_sentence_transformers_and_the_oracle(reference_loss, name, mode, hardness, k, similarity_fct):
    columns = _embeddings((name, mode, hardness, similarity_fct), k)
    options = _options(name, mode, hardness)
    similarity, scale = SIMILARITIES[similarity_fct]
    (ours,), ours_grads = outputs_and_grads(lambda *e: ak.multiple_negatives_ranking_loss(
        e[0], e[1], e[2:], scale=scale, similarity=similarity, **options), columns)
    (theirs,), their_grads = outputs_and_grads(
        lambda *e: reference_loss(similarity_fct, scale, **options).compute_loss_from_embeddings(list(e), None),
        columns)
    (exact,), exact_grads = outputs_and_grads(lambda *e: oracle.multiple_negatives_ranking_loss(
        e[0], e[1], e[2:], scale, **options, similarity=similarity), columns)
    assert_close(ours, theirs, 1e-12, "value vs sentence-transformers")
    assert_close(exact, theirs, 1e-12, "oracle vs sentence-transformers")
    for g, ref in zip(ours_grads, their_grads):
        assert_close(g, ref, 1e-10, "gradient vs sentence-transformers")


FILTER_CASES = [("q2d", "joint", None, 1, "absolute", 0.1), ("gte", "joint", "all_negatives", 1, "relative", 0.2),
                ("symmetric", "per_direction", "hard_negatives", 2, "absolute", -0.05),
                ("q2d+d2d", "joint", None, 2, "relative", 0.0)]


# (directions, partition mode, hardness, hard-negative columns, filter strategy, margin) with dot products, scale 1
DOT_CASES = [("q2d", "joint", None, 0, None, None), ("gte", "joint", "all_negatives", 1, "relative", 0.2)]


DTYPES = (torch.float64, torch.float32, torch.bfloat16)
BACKEND_CASES = [c + ("cosine",) for c in FILTER_CASES + [("gte", "joint", "in_batch_negatives", 1, None, None)]] + [
    c + ("dot",) for c in DOT_CASES]


# Under the Triton interpreter (seconds a case), each case in one dtype, in turn (in_turn): each case's options are
# front-end code, the same on every backend, which the torch backend's cases check in every dtype; what the Triton
# backend adds is similarity_lse, held to the oracle with every option (filters, guides, penalties, exclusions, dot
# products) in every dtype in tests/ops/test_similarity_lse.py. There, too, a case takes INTERPRETED_ROWS rows where
# it takes BACKEND_ROWS elsewhere: each row is a program of the pair-score kernel (the positives' scores), and both
# sizes are one row block of the similarity kernels (up to 16 rows through the interpreter).
BACKEND_ROWS = 10
INTERPRETED_ROWS = 4


def _rows_on(backend):
    return INTERPRETED_ROWS if backend.interpreted else BACKEND_ROWS


@pytest.mark.parametrize("backend, case, dtype", across_backends(
    [(case, dtype) for case in BACKEND_CASES for dtype in DTYPES], in_turn(BACKEND_CASES, DTYPES),
    case_id=lambda case, dtype: "-".join(map(str, case + (dtype,)))), indirect=["backend"])
def test_every_backend_against_the_oracle(backend, case, dtype):
    skip_unless_implemented(backend, "similarity_lse")  # the filter and hardness blocks
    name, mode, hardness, k, strategy, margin, similarity = case
    columns = _embeddings(("backends",) + case[:-1], k, dtype=dtype, rows=_rows_on(backend), dim=24)
    options = _options(name, mode, hardness)
    scale = 20.0 if similarity == "cosine" else 1.0
    if strategy is not None:
        options.update(false_negative_strategy=strategy, false_negative_margin=margin)
    check_against_oracle(
        lambda *e: ak.multiple_negatives_ranking_loss(e[0], e[1], e[2:], scale=scale, similarity=similarity,
                                                      backend=backend.name, **options),
        lambda *e: oracle.multiple_negatives_ranking_loss(e[0], e[1], e[2:], scale, **options,
                                                          similarity=similarity),
        columns, f"{case} on {backend.name}", device=backend.device)


@pytest.mark.parametrize("rows", [BACKEND_ROWS, INTERPRETED_ROWS])
def test_the_filter_drops_columns_in_these_cases(rows):
    """A filter case is only worth something if the filter changes the loss (at either size a backend case takes)."""
    cases = [c + ("cosine",) for c in FILTER_CASES] + [c + ("dot",) for c in DOT_CASES if c[4] is not None]
    for name, mode, hardness, k, strategy, margin, similarity in cases:
        columns = _embeddings(("backends", name, mode, hardness, k, strategy, margin), k, rows=rows, dim=24)
        options = dict(_options(name, mode, hardness), similarity=similarity)
        scale = 20.0 if similarity == "cosine" else 1.0
        plain = oracle.multiple_negatives_ranking_loss(columns[0], columns[1], columns[2:], scale, **options)
        filtered = oracle.multiple_negatives_ranking_loss(columns[0], columns[1], columns[2:], scale, **options,
                                                          false_negative_strategy=strategy,
                                                          false_negative_margin=margin)
        assert float(filtered) < float(plain) - 1e-6, (name, strategy, margin)


MEMORY_CASES = {
    "gte_joint": dict(directions=ALL),
    "gte_hardness": dict(directions=ALL, hardness_mode="in_batch_negatives", hardness_strength=5.0),
    "symmetric_hard_negatives": dict(directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction",
                                     hardness_mode="hard_negatives", hardness_strength=5.0),
    "false_negative_filter": dict(directions=("query_to_doc", "doc_to_doc"), false_negative_margin=0.1),
    "dot_products": dict(similarity="dot", scale=1.0),
    "standard": dict(),
}


def _largest_tensor(loss_of, inputs: list[torch.Tensor]) -> int:
    """The most elements of any tensor that loss_of(*leaves) makes in forward and backward."""
    leaves = [leaf_like(x) for x in inputs]
    recorder = ShapeRecorder()
    with recorder.mode:
        loss = loss_of(*leaves)
        recorder.phase = "backward"
        loss.backward()
    return max(math.prod(shape) for _, shape in recorder.shapes)


@pytest.mark.parametrize("name", list(MEMORY_CASES))
def test_extra_memory_grows_linearly_with_every_option(monkeypatch, name):
    """No tensor holds a score matrix: every option's largest tensor is an embedding-sized one or one tile, so
    it grows 4x when the batch does (an N x N tensor would grow 16x)."""
    import angle_kernels.torch_ops.common as torch_common

    monkeypatch.setattr(torch_common, "CHUNK_ELEMENTS", 96)  # the torch backend's tile

    def loss_of(q, p, n):
        return ak.multiple_negatives_ranking_loss(q, p, (n,), backend="torch", **MEMORY_CASES[name])

    small, large = (_largest_tensor(loss_of, _embeddings(("memory", rows), 1, rows=rows, dim=5)) for rows in (16, 64))
    documents = 2 * 64  # positives and one hard-negative column
    assert large < 64 * documents, f"{name}: a {large}-element tensor at B = 64 (the score matrix has {64 * documents})"
    assert large <= 4 * small, f"{name}: largest tensor {small} elements at B = 16, {large} at B = 64"


def test_gradcheck_float64():
    columns = [leaf_like(x) for x in _embeddings("gradcheck", 1, rows=4, dim=6)]
    assert gradcheck(lambda q, p, n: ak.multiple_negatives_ranking_loss(
        q, p, (n,), directions=ALL, false_negative_margin=0.3), columns, eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("options, message", [
    (dict(directions=("doc_to_query",)), "must include 'query_to_doc'"),
    (dict(directions=("query_to_doc", "sideways")), "directions must be"),
    (dict(directions=ALL, partition_mode="per_direction"), "per_direction"),
    (dict(directions=("query_to_doc", "query_to_query"), partition_mode="per_direction"), "per_direction"),
    (dict(partition_mode="both"), "partition_mode"),
    (dict(hardness_mode="hardest"), "hardness_mode"),
    (dict(hardness_mode="hard_negatives", hardness_strength=-1.0), "hardness_strength"),
    (dict(false_negative_margin=0.1, false_negative_strategy="percent"), "false_negative_strategy"),
    (dict(false_negative_margin=float("nan")), "false_negative_margin"),
    (dict(similarity="euclidean"), "similarity"),
])
def test_bad_options_are_refused(options, message):
    q, p = _embeddings("bad", 0)
    with pytest.raises(ValueError, match=message):
        ak.multiple_negatives_ranking_loss(q, p, **options)


@pytest.mark.parametrize("options, said", [
    (dict(hardness_strength=5.0), "hardness_strength=5 has no effect without hardness_mode"),
    (dict(false_negative_strategy="relative"), "false_negative_strategy='relative' has no effect without "
                                               "false_negative_margin"),
])
def test_an_option_without_the_one_it_qualifies_is_said_to_do_nothing(options, said, monkeypatch):
    """A hardness strength without a mode, or a filter strategy without a margin, changes nothing: said in a
    warning (the loss is the plain one), where it passed in silence, once per process (every training step checks
    the options); with its partner option, no warning."""
    import warnings

    from angle_kernels import inputs

    monkeypatch.setattr(inputs, "_said_no_effect", set())
    q, p = _embeddings("no_effect", 0)
    with pytest.warns(UserWarning, match=said):
        loss = ak.multiple_negatives_ranking_loss(q, p, **options)
    assert torch.equal(loss, ak.multiple_negatives_ranking_loss(q, p))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: the next step's call is quiet
        ak.multiple_negatives_ranking_loss(q, p, **options)
    partner = dict(hardness_mode="in_batch_negatives") if "hardness_strength" in options else dict(
        false_negative_margin=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ak.multiple_negatives_ranking_loss(q, p, **options, **partner)


def test_directions_given_as_a_list_are_the_same_directions():
    """directions may be a list (as read from a config file): the same loss as the tuple."""
    q, p, n = _embeddings("list", 1)
    for directions in (["query_to_doc", "doc_to_query"], list(ALL)):
        assert torch.equal(ak.multiple_negatives_ranking_loss(q, p, (n,), directions=directions),
                           ak.multiple_negatives_ranking_loss(q, p, (n,), directions=tuple(directions)))


def test_negative_columns_must_match_the_queries():
    q, p, n = _embeddings("bad", 1)
    with pytest.raises(ValueError, match="negatives"):
        ak.multiple_negatives_ranking_loss(q, p, (n[:3],))


GIST_CASES = {
    "default": (0, dict()),
    "relative_one_negative": (1, dict(margin_strategy="relative", margin=0.05, temperature=0.05)),
    "no_anchor_block_two_negatives": (2, dict(contrast_anchors=False, margin=-0.05, temperature=0.05)),
}


def _gist_inputs(name, dtype, rows=BACKEND_ROWS, dim=24, guide_dim=12):
    """Model embeddings and a guide that agrees with them in part (so it drops some columns, not all)."""
    k, options = GIST_CASES[name]
    model_side = _embeddings(("gist", name), k, dtype=dtype, rows=rows, dim=dim)
    gen = generator("gist_guide", name)
    guide = [torch.cat([x[:, :guide_dim].float(), 0.7 * randn(gen, rows, guide_dim)], dim=1) for x in model_side]
    return model_side, guide, options


@pytest.mark.parametrize("backend, name, dtype", across_backends(
    [(name, dtype) for name in GIST_CASES for dtype in DTYPES], in_turn(GIST_CASES, DTYPES)), indirect=["backend"])
def test_gist_on_every_backend_against_the_oracle(backend, name, dtype):
    skip_unless_implemented(backend, "similarity_lse")
    model_side, guide, options = _gist_inputs(name, dtype, rows=_rows_on(backend))
    on_device = [g.to(backend.device) for g in guide]
    check_against_oracle(
        lambda *e: ak.gist_loss(e[0], e[1], on_device[0], on_device[1], e[2:], on_device[2:], backend=backend.name,
                                **options),
        lambda *e: oracle.gist_loss(e[0], e[1], guide[0], guide[1], e[2:], guide[2:], **options), model_side,
        f"gist {name} on {backend.name}", device=backend.device)


@pytest.mark.parametrize("margin", [1e30, 1e39, -1e39])
def test_a_relative_margin_past_float32s_range_filters_as_in_exact_arithmetic(margin):
    """A relative false-negative margin past float32's largest number was inf in the float32 threshold, and a row
    whose positive cosine is 0 got 0 x inf, NaN: a threshold no column exceeds, its filter silently off (1e39:
    3.99 where 1e30 gave 1.42). Its threshold is 0 (plus the tie allowance) for every margin, as in float64."""
    gen = torch.Generator().manual_seed(0)
    queries, positives = torch.eye(8)[:4], torch.eye(8)[4:]  # every positive cosine exactly 0
    negatives = torch.randn(4, 8, generator=gen)
    options = dict(false_negative_margin=margin, false_negative_strategy="relative")
    value = ak.multiple_negatives_ranking_loss(queries, positives, (negatives,), **options)
    exact = oracle.multiple_negatives_ranking_loss(queries.double(), positives.double(), [negatives.double()],
                                                   **options)
    assert torch.isfinite(exact) and float(value) == pytest.approx(float(exact), rel=1e-6)


@pytest.mark.parametrize("guide_dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_guide_filters_as_its_embeddings_in_float32_do(guide_dtype):
    """A 16-bit guide's scores are compared in float32 (sentence-transformers' GISTEmbedLoss compares them in the
    guide's 16 bits, the documented difference of the drop-ins): the loss and gradients of a 16-bit guide are
    those of its embeddings converted to float32, bit for bit."""
    model_side, guide, options = _gist_inputs("relative_one_negative", torch.float32)
    results = []
    for converted in ([g.to(guide_dtype) for g in guide], [g.to(guide_dtype).float() for g in guide]):
        leaves = [x.detach().clone().requires_grad_() for x in model_side]
        value = ak.gist_loss(leaves[0], leaves[1], converted[0], converted[1], leaves[2:], converted[2:], **options)
        value.backward()
        results.append((value.detach(), [x.grad for x in leaves]))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


@pytest.mark.parametrize("block", ["anchors", "positives"])
def test_gist_leaves_each_rows_own_column_out_unless_self_negatives(backend, block):
    """A negative margin lifts the filter's threshold to g_i + |margin|; where that reaches 1, the filter keeps row
    i's own column of the anchor-anchor (positive-positive) block, whose guide similarity is 1. sentence-transformers
    6.3 leaves it out regardless, as gist_loss does by default; self_negatives=True keeps it subject to the filter,
    as sentence-transformers before 6.3 did (its logit, cos 1 / temperature = 20, then in the partition)."""
    skip_unless_implemented(backend, "similarity_lse")
    gen = torch.Generator().manual_seed(0)
    anchors, positives = (torch.randn(6, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    guide_anchors = torch.randn(6, 8, generator=gen, dtype=torch.float64)
    guide_positives = guide_anchors + 0.3 * torch.randn(6, 8, generator=gen, dtype=torch.float64)  # g ~ 0.95
    options = dict(temperature=0.05, margin=-0.5, contrast_anchors=block == "anchors",
                   contrast_positives=block == "positives")
    values = {}
    for self_negatives in (False, True):
        values[self_negatives] = float(oracle.gist_loss(anchors, positives, guide_anchors, guide_positives,
                                                        self_negatives=self_negatives, **options))
        check_against_oracle(
            lambda a, p: ak.gist_loss(a, p, guide_anchors.to(backend.device), guide_positives.to(backend.device),
                                      self_negatives=self_negatives, backend=backend.name, **options),
            lambda a, p: oracle.gist_loss(a, p, guide_anchors, guide_positives, self_negatives=self_negatives,
                                          **options),
            [anchors, positives], f"gist self_negatives={self_negatives} on {backend.name}", device=backend.device)
    assert values[True] > values[False] + 1.0  # each row's own column (logit 20) in the partition


def test_the_oracles_gist_leaves_out_exactly_the_own_columns():
    """oracle.gist_loss without self_negatives is the one with them, minus the diagonal of the anchor-anchor and
    positive-positive blocks: the own columns dropped by hand from the oracle's logits with self_negatives."""
    gen = torch.Generator().manual_seed(1)
    a, p = (torch.randn(5, 12, generator=gen, dtype=torch.float64) for _ in range(2))
    unit_a, unit_p = torch.nn.functional.normalize(a, dim=1), torch.nn.functional.normalize(p, dim=1)
    eye = torch.eye(5, dtype=torch.bool)
    by_hand = torch.cat([unit_a @ unit_p.T, (unit_a @ unit_a.T).masked_fill(eye, -math.inf),
                         (unit_p @ unit_p.T).masked_fill(eye, -math.inf)], dim=1) / 0.05
    expected = torch.nn.functional.cross_entropy(by_hand, torch.arange(5))  # margin -10: the filter drops nothing
    got = oracle.gist_loss(a, p, a, p, temperature=0.05, margin=-10.0)
    assert oracle.rel_err(got, expected) < 1e-14
    kept = oracle.gist_loss(a, p, a, p, temperature=0.05, margin=-10.0, self_negatives=True)
    assert float(kept) > float(got) + 1.0


@pytest.mark.parametrize("rows", [BACKEND_ROWS, INTERPRETED_ROWS])
def test_the_gist_guide_filters_in_these_cases(rows):
    for name in GIST_CASES:
        model_side, guide, options = _gist_inputs(name, torch.float64, rows=rows)
        filtered = oracle.gist_loss(model_side[0], model_side[1], guide[0], guide[1], model_side[2:], guide[2:],
                                    **options)
        everything = oracle.gist_loss(model_side[0], model_side[1], guide[0], guide[1], model_side[2:], guide[2:],
                                      **{**options, "margin_strategy": "absolute", "margin": -10.0})
        assert torch.isfinite(filtered) and abs(float(filtered - everything)) > 1e-6, name


def test_gist_memory_grows_linearly(monkeypatch):
    import angle_kernels.torch_ops.common as torch_common

    monkeypatch.setattr(torch_common, "CHUNK_ELEMENTS", 96)  # the torch backend's tile
    largest = []
    for rows in (16, 64):
        model_side, guide, options = _gist_inputs("relative_one_negative", torch.float64, rows=rows, dim=5,
                                                  guide_dim=3)
        largest.append(_largest_tensor(lambda a, p, n: ak.gist_loss(a, p, guide[0], guide[1], (n,), guide[2:],
                                                                    backend="torch", **options), model_side))
    assert largest[1] < 64 * 64 and largest[1] <= 4 * largest[0], largest


def test_gist_refuses_negatives_without_guide_embeddings():
    model_side, guide, _ = _gist_inputs("relative_one_negative", torch.float64)
    with pytest.raises(ValueError, match="guide_negatives"):
        ak.gist_loss(model_side[0], model_side[1], guide[0], guide[1], model_side[2:], ())
    with pytest.raises(ValueError, match="margin_strategy"):
        ak.gist_loss(model_side[0], model_side[1], guide[0], guide[1], margin_strategy="percent")


def test_gist_names_the_guide_on_another_device():
    """A guide model on another device than the model (its embeddings stay on its device): refused naming
    guide_anchors and the anchors, not the op's filter arguments ('meta' stands in for the other device)."""
    model_side, guide, _ = _gist_inputs("relative_one_negative", torch.float64)
    with pytest.raises(ValueError, match=r"^anchors is on cpu but guide_anchors is on meta: all inputs must be on one"):
        ak.gist_loss(model_side[0], model_side[1], guide[0].to("meta"), guide[1].to("meta"), model_side[2:],
                     [t.to("meta") for t in guide[2:]])


def test_gist_names_the_guide_tensor_of_the_wrong_size():
    """A guide tensor with the wrong number of rows is the one the error names: guide_anchors against the anchors,
    the guide's other tensors against guide_anchors."""
    model_side, guide, _ = _gist_inputs("relative_one_negative", torch.float64)
    with pytest.raises(ValueError, match=r"guide_anchors must have the anchors' \d+ rows"):
        ak.gist_loss(model_side[0], model_side[1], guide[0][1:], guide[1])
    with pytest.raises(ValueError, match="guide_positives must have the shape of guide_anchors"):
        ak.gist_loss(model_side[0], model_side[1], guide[0], guide[1][1:])


# A text repeated in the batch: its column ties with the positive's score in exact arithmetic, and a strict filter
# keeps it (sentence-transformers' GISTEmbedLoss does, its threshold being an entry of the same score matrix). Ours
# takes the threshold from a pair score and the columns from tiles of products, which round apart by a few ulps: the
# allowance contract.FILTER_TIE_ALLOWANCE keeps the tie, whatever the rounding (without it, about half of these
# batches dropped the duplicate).


def _strict_filter_mnrl(q, p, scale, margin, similarity):
    """MNRL with a false-negative filter, the threshold taken from the score matrix's own diagonal (float64)."""
    q, p = q.double(), p.double()
    if similarity == "cosine":
        q, p = torch.nn.functional.normalize(q, dim=1), torch.nn.functional.normalize(p, dim=1)
    scores = q @ p.T
    positive = scores.diagonal()
    drop = (scores > (positive - margin)[:, None]) & ~torch.eye(len(q), dtype=torch.bool)
    logits = (scale * scores).masked_fill(drop, -math.inf)
    return (torch.logsumexp(logits, dim=1) - scale * positive).mean()


@pytest.mark.parametrize("similarity", ["cosine", "dot"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_the_filter_keeps_a_duplicate_of_the_positive(dtype, similarity):
    scale = 20.0 if similarity == "cosine" else 1.0
    gen = generator("duplicate positive", str(dtype), similarity)
    for _ in range(40):
        q = randn(gen, 6, 48)
        p = q + randn(gen, 6, 48)
        p[2] = p[0]  # row 0's positive is also row 2's: column 2 of row 0 ties with its positive
        q, p = q.to(dtype), p.to(dtype)
        ours = ak.multiple_negatives_ranking_loss(q, p, false_negative_margin=0.0, similarity=similarity, scale=scale)
        exact = _strict_filter_mnrl(q, p, scale, 0.0, similarity)
        assert abs(float(ours) - float(exact)) < 1e-4 * max(1.0, abs(float(exact))), (float(ours), float(exact))


def _sentence_transformers_gist(a, p, guide_a, guide_p, temperature):
    """sentence-transformers' GISTEmbedLoss (absolute margin 0: the filter drops each row's own column), in float64."""
    a, p, guide_a, guide_p = (torch.nn.functional.normalize(t.double(), dim=1) for t in (a, p, guide_a, guide_p))
    guide_ap = guide_a @ guide_p.T
    threshold = guide_ap.diagonal()[:, None]
    eye = torch.eye(len(a), dtype=torch.bool)
    blocks = [(a @ p.T).masked_fill((guide_ap > threshold) & ~eye, -math.inf),
              (a @ a.T).masked_fill(guide_a @ guide_a.T > threshold, -math.inf),
              (p @ p.T).masked_fill(guide_p @ guide_p.T > threshold, -math.inf)]
    return torch.nn.functional.cross_entropy(torch.cat(blocks, dim=1) / temperature, torch.arange(len(a)))


def test_each_prefix_filters_dot_products_with_its_own_tie_allowance(backend):
    """With dims, the filter's allowance for ties (2^-16 |q_i| |p_i| for dot products) is each prefix's own: a column
    1e-4 above a narrow prefix's threshold leaves it, as in the loss of the truncated rows (the full rows' norms,
    100x larger here, once gave every prefix a 100x wider allowance, and the column stayed)."""
    skip_unless_implemented(backend, "similarity_lse")
    q = torch.tensor([[1.0, 0.0, 10.0, 0.0], [0.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    p = torch.tensor([[1.0, 0.0, 0.0, 10.0], [0.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    n = torch.tensor([[0.9501, 0.0, 0.0, 0.0], [0.0, -1.0, 0.0, 0.0]], dtype=torch.float64)  # row 0: 0.9501 > 0.95
    _assert_dot_filter_per_prefix(backend, q, p, n, dims=(2, 4), margin=0.05)


def test_the_dot_product_tie_allowance_scales_with_the_query_and_positive_norms(backend):
    """Without dims, a row's allowance for ties with dot products is 2^-16 |q_i| |p_i| (the scale of its scores'
    rounding), not |q_i|^2: row 0's query is 10^4 times longer than its positive, so a column at 0.96, above the
    threshold 0.95 + 2^-16, leaves the partition function (an allowance of 2^-16 |q_0|^2 = 0.15 kept it)."""
    skip_unless_implemented(backend, "similarity_lse")
    q = torch.tensor([[100.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    p = torch.tensor([[0.01, 0.0], [0.0, 1.0]], dtype=torch.float64)  # row 0: positive 1.0, |q_0| |p_0| = 1
    n = torch.tensor([[0.0096, 0.0], [0.0, -1.0]], dtype=torch.float64)  # row 0: 0.96 > 0.95 + 2^-16
    options = dict(scale=1.0, similarity="dot", false_negative_margin=0.05)
    ours = ak.multiple_negatives_ranking_loss(q.to(backend.device), p.to(backend.device), (n.to(backend.device),),
                                              backend=backend.name, **options)
    exact = oracle.multiple_negatives_ranking_loss(q, p, (n,), **options)
    scores = q @ torch.cat([p, n]).T
    logits = scores.masked_fill(torch.tensor([[False, False, True, False], [False] * 4]), -math.inf)
    direct = torch.nn.functional.cross_entropy(logits, torch.arange(2))  # row 0's column 0.96 dropped
    assert abs(float(ours) - float(direct)) < 1e-9 and abs(float(exact) - float(direct)) < 1e-9


def _assert_dot_filter_per_prefix(backend, q, p, n, dims, margin):
    """MNRL with dot products, a false-negative filter and dims equals the sum of its calls on the truncated rows,
    and the oracle's."""
    options = dict(scale=1.0, similarity="dot", false_negative_margin=margin)
    q, p, n = (t.to(backend.device) for t in (q, p, n))
    nested = ak.multiple_negatives_ranking_loss(q, p, (n,), dims=dims, backend=backend.name, **options)
    per_prefix = [ak.multiple_negatives_ranking_loss(q[:, :d], p[:, :d], (n[:, :d],), backend=backend.name,
                                                     **options) for d in dims]
    exact = sum(oracle.multiple_negatives_ranking_loss(q[:, :d].cpu(), p[:, :d].cpu(), (n[:, :d].cpu(),), **options)
                for d in dims)
    assert abs(float(nested) - float(sum(per_prefix))) < 1e-9 and abs(float(nested) - float(exact)) < 1e-9


@pytest.mark.parametrize("options", [dict(directions=("query_to_doc", "query_to_query")),
                                     dict(hardness_mode="all_negatives", hardness_strength=2.0),
                                     dict(false_negative_margin=0.1, similarity="dot", scale=1.0)],
                         ids=["gte", "hardness", "dot-filter"])
def test_one_call_per_prefix_where_the_backend_lacks_dims_is_the_same_loss(monkeypatch, options):
    """Where the backend that would compute similarity_lse at one width has no dims for it (a GPU path not yet
    verified with dims), the loss makes one call per prefix on the truncated rows, negatives included: the same
    values and gradients as the one call with dims."""
    from angle_kernels.dispatch import Ops

    gen = generator("per prefix fallback", sorted(options))
    rows = [leaf_like(randn(gen, 6, 8, dtype=torch.float64)) for _ in range(3)]
    weights = (1.0, 0.5)

    def loss_and_grads():
        for x in rows:
            x.grad = None
        loss = ak.multiple_negatives_ranking_loss(rows[0], rows[1], (rows[2],), dims=(3, 8), dim_weights=weights,
                                                  **options)
        loss.backward()
        return loss.detach(), [x.grad.clone() for x in rows]

    one_call = loss_and_grads()
    monkeypatch.setattr(Ops, "takes_in_one_call", lambda self, op, *args, **kwargs: False)
    per_prefix = loss_and_grads()
    assert torch.allclose(one_call[0], per_prefix[0], rtol=1e-12, atol=0)
    for a, b in zip(one_call[1], per_prefix[1]):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-14)


def test_each_prefix_filters_dot_products_against_its_own_positive_score(backend):
    """With dims and dot products, each prefix's filter threshold is its own positive's dot product (the truncated
    rows'), not the full rows': the nested loss is the sum of the per-prefix losses and of the oracle's."""
    skip_unless_implemented(backend, "similarity_lse")
    gen = generator("dot filter per prefix")
    q, p, n = (randn(gen, 6, 8, dtype=torch.float64) for _ in range(3))
    _assert_dot_filter_per_prefix(backend, q, p, n, dims=(3, 8), margin=0.5)


@pytest.mark.parametrize("options", [{}, {"directions": ("query_to_doc", "query_to_query")},
                                     {"false_negative_strategy": "relative"}], ids=["plain", "gte", "relative"])
def test_the_dot_product_filter_holds_on_float32_rows_whose_norm_overflows(options):
    """A float32 row of norm ~5e19 (its squared norm overflows; every dot product is finite): its tie allowance
    (2^-16 |q_i| |p_i|) was taken in float32, became inf, and switched the row's filter off (loss 2.4e18 against
    0.148). The norms are taken in float64: the float32 loss is the float64 one, rounded."""
    gen = generator("dot filter huge row")
    q, p = randn(gen, 4, 8, dtype=torch.float64), randn(gen, 4, 8, dtype=torch.float64)
    p[2] *= 2.0 ** 64  # |p_2| ~ 5e19: its float32 squared norm overflows
    kwargs = dict(scale=1.0, similarity="dot", false_negative_margin=0.1, **options)
    exact = ak.multiple_negatives_ranking_loss(q, p, **kwargs)
    got = ak.multiple_negatives_ranking_loss(q.float(), p.float(), **kwargs)
    assert math.isfinite(float(exact)) and abs(float(got) - float(exact)) <= 1e-5 * abs(float(exact)) + 1e-6


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_gist_keeps_a_duplicate_of_the_positive(dtype):
    gen = generator("gist duplicate positive", str(dtype))
    for _ in range(40):
        a = randn(gen, 6, 48)
        p = a + 0.8 * randn(gen, 6, 48)
        a[2], p[2] = a[0], p[0]  # row 2 repeats row 0's pair: row 0's column 2 ties with its positive in the guide
        a, p = a.to(dtype), p.to(dtype)
        ours = ak.gist_loss(a, p, a, p)  # the model as its own guide
        exact = _sentence_transformers_gist(a, p, a, p, temperature=0.01)
        assert abs(float(ours) - float(exact)) < 1e-3, (float(ours), float(exact))


# Small losses in bf16 on the losses whose terms come from several ops (similarity_lse's log partitions, pair_scores'
# positive scores, each returning its gradient in bf16): where the positive's softmax weight is ~1 its two terms
# nearly cancel, and with the positive inside the partitions each was rounded to bf16 before they met: 80-450%
# relative error on the Triton backend (plain MNRL, one op: 0.2%). retrieval.loss_over_the_positive leaves it out.
# Eager bf16 is no yardstick here (its bf16 logits give it 350-3,700% error on these batches): the bound is the
# exact gradient correctly rounded to bf16, times 4 (each op of the loss rounds its own term once; measured:
# 1.0-3.4x). The PyTorch backend adds the terms in float32 on the CPU (retrieval._rows_for); the Triton backend,
# under the interpreter, reads the bf16 rows as on a GPU.
SMALL_LOSS_CALLS = {
    "hardness": dict(hardness_mode="all_negatives", hardness_strength=1.0),
    "gte": dict(directions=ALL),
    "symmetric": dict(directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction",
                      hardness_mode="in_batch_negatives", hardness_strength=1.0),
    "filter": dict(false_negative_margin=0.1),
    "dot": dict(similarity="dot", scale=1.0, hardness_mode="all_negatives", hardness_strength=0.5),
    "gist": dict(temperature=0.05),
}


@pytest.mark.parametrize("name", list(SMALL_LOSS_CALLS))
def test_bf16_gradients_of_a_small_loss_are_within_4x_correct_rounding(backend, name):
    skip_unless_implemented(backend, "similarity_lse")
    gen = generator("small loss", name)
    spread = 0.6 if name == "dot" else 1.0  # dot products at scale 1: smaller rows keep the loss small, not 0
    q = randn(gen, 8, 64, scale=spread)
    rows = [t.to(torch.bfloat16) for t in (q, q + randn(gen, 8, 64, scale=spread), randn(gen, 8, 64))]
    options = SMALL_LOSS_CALLS[name]
    if name == "gist":  # the model as its own guide
        def ours(a, p, n):
            return ak.gist_loss(a, p, a.detach(), p.detach(), (n,), (n.detach(),), backend=backend.name, **options)

        def exact(a, p, n):
            return oracle.gist_loss(a, p, a.detach(), p.detach(), (n,), (n.detach(),), **options)
    else:
        def ours(q, p, n):
            return ak.multiple_negatives_ranking_loss(q, p, (n,), backend=backend.name, **options)

        def exact(q, p, n):
            return oracle.multiple_negatives_ranking_loss(q, p, (n,), **options)
    (loss,), ours_grads = outputs_and_grads(ours, [leaf_like(x, device=backend.device) for x in rows])
    (want,), exact_grads = outputs_and_grads(exact, [leaf_like(x, dtype=torch.float64) for x in rows])
    assert float(want) < 0.01 or name == "gte", float(want)  # small (gte: log 2, two blocks hold the positive)
    assert abs(float(loss) - float(want)) <= 1e-3 * float(want) + 1e-6, (float(loss), float(want))
    for k, (got, ref) in enumerate(zip(ours_grads, exact_grads)):
        err, rounded = oracle.rel_err(got.cpu(), ref), oracle.rel_err(ref.to(torch.bfloat16), ref)
        assert err <= 4 * rounded, f"{name} on {backend.name}, gradient {k}: {err:.2e} against rounding's {rounded:.2e}"


@pytest.mark.parametrize("name", ["hardness", "filter", "dot", "gist", "angle_filter"])
def test_a_small_loss_keeps_its_digits(backend, name):
    """A batch whose positives dominate (each positive 0.05 of noise away from its query, D = 384: losses 1e-7 to
    1e-5) in float32: the joint recombination of the blocks' log partitions took logsumexp([log m, x_b, ...]), which
    rounds 1 + e^x before its log, so the loss came out in steps of float32's 1.2e-7 (10-100% off); logaddexp keeps
    its digits (AngleLoss format A's filter: 2.38e-7 for 2.177e-7). Through the Triton interpreter, where each row is
    a program of the pair-score kernels, 8 rows: fewer columns, a loss a few times smaller, further below the steps."""
    skip_unless_implemented(backend, "similarity_lse")
    gen = generator("small loss digits", name)
    batch = 8 if backend.interpreted else 32
    q = randn(gen, batch, 384)
    p, n = q + randn(gen, batch, 384, scale=0.05), randn(gen, batch, 384)
    if name == "angle_filter":
        rows = torch.stack([q, p], dim=1).reshape(2 * batch, 384)
        labels = torch.ones(2 * batch)

        def loss_of(x, exact):
            if exact:
                return oracle.in_batch_negative_loss(labels, x, false_negative_margin=0.1)
            return ak.AngleLoss(dataset_format="A", ibn_w=1.0, angle_w=0.0, false_negative_margin=0.1,
                                backend=backend.name)(labels.to(x.device), x)
        inputs = [rows]
    else:
        # dot products of rows of norm ~20 (~384 with the positive) at scale 0.05: the loss small, not 0
        options = dict(similarity="dot", scale=0.05) if name == "dot" else SMALL_LOSS_CALLS[name]

        def loss_of(q, p, n, exact):
            if name == "gist":
                call = oracle.gist_loss if exact else functools.partial(ak.gist_loss, backend=backend.name)
                return call(q, p, q.detach(), p.detach(), (n,), (n.detach(),), **options)
            call = oracle.multiple_negatives_ranking_loss if exact else functools.partial(
                ak.multiple_negatives_ranking_loss, backend=backend.name)
            return call(q, p, (n,), **options)
        inputs = [q, p, n]
    want = float(loss_of(*[x.double() for x in inputs], exact=True))
    got = float(loss_of(*[x.to(backend.device) for x in inputs], exact=False))
    assert 0 < want < 1e-4, want
    assert abs(got - want) <= 1e-4 * want, (got, want)

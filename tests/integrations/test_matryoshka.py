"""MatryoshkaLoss over angle_kernels' fused drop-ins against sentence-transformers' MatryoshkaLoss over its own
losses: the same value and parameter gradients on the same tiny model and batch (float64), for all
dimensions, for weighted ones, for n_dims_per_step sampling under the same seed, and for the cached loss; the
fused path computes every dimension in one call of the loss's computing half (the parent's loop calls the
inner loss once per dimension), and the configurations it cannot express run the parent's loop.
"""

from __future__ import annotations

import copy
import inspect
import random
import warnings

import pytest
import torch

pytest.importorskip("sentence_transformers")

import numpy as np  # noqa: E402  (a dependency of sentence-transformers)

from angle_kernels import terms  # noqa: E402
from angle_kernels.integrations import sentence_transformers as ours  # noqa: E402
from sentence_transformers import util as st_util  # noqa: E402
from test_sentence_transformers import (ALL_DIRECTIONS, GRADED, batch_columns, compare, st_losses,  # noqa: E402
                                        value_and_grads)

SYMMETRIC = {"directions": ("query_to_doc", "doc_to_query"), "partition_mode": "per_direction"}

# (inner class, its kwargs, text columns, labels, matryoshka_dims, matryoshka_weights, n_dims_per_step, fused);
# the tiny model's embeddings are 32 wide
CASES = [
    ("CoSENTLoss", {}, 2, GRADED, (32, 16, 8, 4), None, -1, True),
    ("CoSENTLoss", {"similarity_fct": st_util.pairwise_angle_sim}, 2, GRADED, (32, 8, 6), (1.0, 0.5, 2.0), -1, True),
    ("CoSENTLoss", {"similarity_fct": st_util.pairwise_angle_sim}, 2, GRADED, (32, 7), None, -1, False),
    ("AnglELoss", {}, 3, None, (8, 32, 16), (0.5, 1.0, 2.0), -1, True),
    ("MultipleNegativesRankingLoss", {}, 3, None, (32, 16, 8, 4), (1, 1, 0.5, 0.25), -1, True),
    ("MultipleNegativesRankingLoss", {"similarity_fct": st_util.dot_score, "scale": 1.0}, 2, None, (32, 8), None,
     -1, True),
    ("MultipleNegativesRankingLoss", SYMMETRIC, 2, None, (32, 16), None, -1, True),
    ("MultipleNegativesRankingLoss", {"directions": ALL_DIRECTIONS, "hardness_mode": "hard_negatives",
                                      "hardness_strength": 2.0}, 3, None, (32, 16, 8), None, -1, True),
    ("MultipleNegativesRankingLoss", {}, 2, None, (32, 24, 16, 8, 4), None, 2, True),
    ("MultipleNegativesRankingLoss", {}, 2, None, (32, 16, 8), None, 0, True),  # 0, as -1: every dimension
    ("MultipleNegativesRankingLoss", {"similarity_fct": st_util.euclidean_sim}, 2, None, (32, 16), None, -1, False),
    ("CachedMultipleNegativesRankingLoss", {"mini_batch_size": 4}, 3, None, (32, 16, 8), None, -1, True),
    ("CachedMultipleNegativesRankingLoss", {"mini_batch_size": 3}, 2, None, (32, 16, 8, 4), (4, 3, 2, 1), 2, True),
    # a cached loss that runs the parent's computation: the parent's loop over the dimensions, backward included
    ("CachedMultipleNegativesRankingLoss", {"mini_batch_size": 4, "similarity_fct": st_util.euclidean_sim}, 2, None,
     (32, 16), None, -1, False),
    # a dimension listed twice: one weighted term per entry, as the parent sums them
    ("MultipleNegativesRankingLoss", {}, 2, None, (32, 16, 16), None, -1, True),
    ("CoSENTLoss", {}, 2, GRADED, (32, 8, 8, 4), (1.0, 0.5, 2.0, 1.0), 3, True),
    ("CachedMultipleNegativesRankingLoss", {"mini_batch_size": 4}, 2, None, (16, 32, 16), (1.0, 1.0, 0.5), -1, True),
    # dims as numpy's integers and as a tensor's elements (list(np.array(...)), list(torch.tensor(...)))
    ("MultipleNegativesRankingLoss", {}, 2, None, list(np.array([32, 16, 8])), None, -1, True),
    ("CachedMultipleNegativesRankingLoss", {"mini_batch_size": 4}, 2, None, list(torch.tensor([32, 8])), None, -1,
     True),
    ("CoSENTLoss", {}, 2, GRADED, list(np.array([32, 8])), None, -1, True),
]


class Seeded:
    """Calls the loss right after random.seed(seed), so both sides draw the same n_dims_per_step dimensions."""

    def __init__(self, loss, seed: int = 7):
        self.loss, self.seed = loss, seed

    def __call__(self, *args):
        random.seed(self.seed)
        return self.loss(*args)


@pytest.mark.parametrize("inner, kwargs, columns, labels, dims, weights, per_step, fused", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_same_value_and_gradients_as_sentence_transformers(model64, fused_calls, inner, kwargs, columns, labels,
                                                           dims, weights, per_step, fused):
    original = st_losses.MatryoshkaLoss(model64, getattr(st_losses, inner)(model64, **kwargs), dims, weights,
                                        n_dims_per_step=per_step)
    replacement = ours.MatryoshkaLoss(model64, getattr(ours, inner)(model64, **kwargs), dims, weights,
                                      n_dims_per_step=per_step)
    assert isinstance(replacement, st_losses.MatryoshkaLoss)
    assert replacement.uses_fused_path is fused
    assert replacement.get_config_dict() == original.get_config_dict()

    compare(model64, Seeded(original), Seeded(replacement), columns, labels, value_tol=1e-12, grad_tol=1e-10)
    calls = fused_calls["ranking_terms"] + fused_calls["multiple_negatives"]  # the losses' entry halves
    if fused:
        assert calls == 1, f"one fused call for every dimension, got {fused_calls}"
    elif replacement.loss.uses_fused_path:
        used = min(len(dims), per_step) if per_step > 0 else len(dims)
        assert calls == used, f"the parent's loop calls the inner loss once per dimension, got {fused_calls}"
    else:
        assert calls == 0, f"an inner loss running unfused never reaches the fused functions, got {fused_calls}"


# every weight 0, or a step whose sampled dimensions all weigh 0: (inner class, kwargs, columns, labels, dims,
# weights, n_dims_per_step)
ZERO_WEIGHT_CASES = [
    ("CoSENTLoss", {}, 2, GRADED, (32, 16), (0.0, 0.0), -1),
    ("AnglELoss", {}, 2, GRADED, (32, 16, 8), (0.0, 0.0, 0.0), 2),
    ("MultipleNegativesRankingLoss", {}, 2, None, (32, 16), (0.0, 0.0), -1),
    ("CachedMultipleNegativesRankingLoss", {"mini_batch_size": 4}, 2, None, (32, 16), (0.0, 0.0), -1),
]


@pytest.mark.parametrize("inner, kwargs, columns, labels, dims, weights, per_step", ZERO_WEIGHT_CASES,
                         ids=[c[0] for c in ZERO_WEIGHT_CASES])
def test_weights_that_are_all_zero_give_the_parents_zero_loss_and_zero_gradients(model64, inner, kwargs, columns,
                                                                                  labels, dims, weights, per_step):
    """The parent sums weight * loss over the dimensions: 0, with zero gradients (a trainer steps on it). Ours gave
    None for the pair-score losses (CoSENT, AnglE), which no backward takes."""
    for module in (st_losses, ours):
        loss = module.MatryoshkaLoss(model64, getattr(module, inner)(model64, **kwargs), dims, weights,
                                     n_dims_per_step=per_step)
        value, grads = value_and_grads(model64, Seeded(loss), columns, labels)
        assert float(value) == 0.0, (module.__name__, value)
        assert len(grads) > 10 and all(not g.any() for g in grads.values()), module.__name__


def test_an_odd_width_with_the_angle_similarity_warns_once_when_built_and_matches_the_parent(model64):
    """An odd width is valid for AnglE (each prefix is padded with a zero feature, as util.pairwise_angle_sim pads
    it) but the fused call needs even widths, so the set runs the parent's per-width loop: that was silent (only
    `uses_fused_path` said so). Now one warning when built names matryoshka_dims, the odd widths and why; even
    widths, other similarities and inner losses that run the parent's computation anyway do not warn."""
    with pytest.warns(UserWarning) as caught:
        loss = ours.MatryoshkaLoss(model64, ours.AnglELoss(model64), [32, 7, 15])
    messages = [str(w.message) for w in caught if "matryoshka_dims" in str(w.message)]
    assert len(messages) == 1, messages
    assert messages[0].startswith("matryoshka_dims [32, 7, 15] include the odd width(s) [7, 15] with the angle "
                                  "similarity: the fused call splits every width into real and imaginary halves")
    assert "per-width loop" in messages[0] and "the same values, slower" in messages[0]
    assert not loss.uses_fused_path
    # the warning points at the line that built the loss, through Matryoshka2dLoss's MatryoshkaLoss too
    with pytest.warns(UserWarning, match="matryoshka_dims") as caught:
        ours.Matryoshka2dLoss(model64, ours.AnglELoss(model64), [32, 7])
    assert {(w.filename, w.lineno) for w in caught if "matryoshka_dims" in str(w.message)} == {
        (__file__, inspect.currentframe().f_lineno - 2)}
    original = st_losses.MatryoshkaLoss(model64, st_losses.AnglELoss(model64), [32, 7, 15])
    compare(model64, original, loss, 2, GRADED, value_tol=1e-12, grad_tol=1e-10)
    quiet = [
        lambda: ours.MatryoshkaLoss(model64, ours.AnglELoss(model64), [32, 8]),
        lambda: ours.MatryoshkaLoss(model64, ours.CoSENTLoss(model64), [32, 7]),
        lambda: ours.MatryoshkaLoss(model64, ours.MultipleNegativesRankingLoss(model64), [32, 7]),
        lambda: ours.MatryoshkaLoss(model64, st_losses.AnglELoss(model64), [32, 7]),
    ]
    for build in quiet:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            build()
        assert not [w for w in caught if "matryoshka_dims" in str(w.message)]


# (class, matryoshka_dims, matryoshka_weights, error, message): the entries are named as the constructor names them
BAD_ENTRY_CASES = [
    ("MatryoshkaLoss", (32, 16), (float("nan"), 1.0), ValueError, r"matryoshka_weights\[0\] must be finite, got nan"),
    ("MatryoshkaLoss", (32, 16), (1.0, float("inf")), ValueError, r"matryoshka_weights\[1\] must be finite, got inf"),
    ("MatryoshkaLoss", (32, 16), ("1", 1.0), TypeError, r"matryoshka_weights\[0\] must be a real number, got str"),
    ("MatryoshkaLoss", (32, 16), (True, 1.0), TypeError, r"matryoshka_weights\[0\] must be a real number, got bool"),
    ("MatryoshkaLoss", (32.0, 16), None, TypeError, r"matryoshka_dims\[0\] must be an int, got float"),
    ("MatryoshkaLoss", (32, True), None, TypeError, r"matryoshka_dims\[1\] must be an int, got bool"),
    ("Matryoshka2dLoss", (32, 16), (1.0, float("nan")), ValueError, r"matryoshka_weights\[1\] must be finite"),
]


@pytest.mark.parametrize("cls, dims, weights, error, message", BAD_ENTRY_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD_ENTRY_CASES)])
def test_bad_entries_are_refused_when_built_naming_them(model64, monkeypatch, cls, dims, weights, error, message):
    """The fused call checked the entries at the first step, after the model had embedded the batch, under the
    functional losses' names (dims[i], dim_weights[i]), and a weight that is not a number failed in float(); the
    parent computes NaN from a NaN weight and takes True as 1; a float n_dims_per_step failed in random.sample. Now
    refused at construction, named."""
    with pytest.raises(error, match=message):
        getattr(ours, cls)(model64, ours.MultipleNegativesRankingLoss(model64), dims, weights)
    with pytest.raises(TypeError, match="n_dims_per_step must be an int, got float"):
        getattr(ours, cls)(model64, ours.MultipleNegativesRankingLoss(model64), (32, 16), n_dims_per_step=1.5)
    # learned weights (the parent's loop trains them) and numpy's numbers are still taken
    learned = [torch.nn.Parameter(torch.tensor(w, dtype=torch.float64)) for w in (1.0, 0.5)]
    assert not ours.MatryoshkaLoss(model64, ours.MultipleNegativesRankingLoss(model64), (32, 16),
                                   learned).uses_fused_path
    assert ours.MatryoshkaLoss(model64, ours.MultipleNegativesRankingLoss(model64), list(np.array([32, 16])),
                               np.array([1.0, 0.5])).uses_fused_path


@pytest.mark.parametrize("inner", ["MultipleNegativesRankingLoss", "CachedMultipleNegativesRankingLoss"])
def test_a_weight_past_float32s_range_is_refused_by_name_before_the_model_embeds(model64, inner):
    """A weight multiplies its dimension's loss in float32 for a 32- or 16-bit model: the parent and the fused call
    gave an inf loss and NaN gradients for 1e39 (the fused call would have named it dim_weights[1], had it been
    checked). Refused at the call, before the model embeds, named as the constructor names it; the entries of a
    dimension listed twice weigh one prefix by their sum, which is refused by both names (once the batch is
    embedded: the draw decides which entries count). A float64 model takes such weights."""
    model = copy.deepcopy(model64).to(torch.float32)
    embedded = []
    model[0].register_forward_pre_hook(lambda *_: embedded.append(True))
    loss = ours.MatryoshkaLoss(model, getattr(ours, inner)(model), (32, 16), (1.0, 1e39))
    with pytest.raises(ValueError, match=r"^matryoshka_weights\[1\] must be within \+-3\.40282e\+38 \(float32's "
                                         r"range: the loss of float32 embeddings is computed in float32"):
        loss(batch_columns(model, 2), None)
    assert not embedded
    summed = ours.MatryoshkaLoss(model, getattr(ours, inner)(model), (32, 16, 16), (1.0, 2e38, 2e38))
    with pytest.raises(ValueError, match=r"^matryoshka_weights\[1\] \+ matryoshka_weights\[2\] must be within "
                                         r"\+-3\.40282e\+38 .*; got 4e\+38$"):
        summed(batch_columns(model, 2), None)
    value = ours.MatryoshkaLoss(model64, getattr(ours, inner)(model64), (32, 16), (1.0, 1e39))(
        batch_columns(model64, 2), None)
    assert torch.isfinite(value) and value > 1e38


@pytest.mark.parametrize("inner", ["CoSENTLoss", "MultipleNegativesRankingLoss"])
def test_a_weight_times_the_scale_past_float32s_range_is_refused_before_the_loss_computes(model64, inner):
    """A matryoshka weight inside float32's range whose product with the inner loss's scale (20) is past it: the
    backward forms that product in float32, and a float32 model got NaN gradients with a finite loss. Refused at the
    call, before any loss compute, naming the factors; a float64 model takes it."""
    model = copy.deepcopy(model64).to(torch.float32)
    loss = ours.MatryoshkaLoss(model, getattr(ours, inner)(model), (32, 16), (3e37, 1.0))
    labels = torch.tensor([0.1, 0.5, 0.5, 0.9, 0.3, 0.1]) if inner == "CoSENTLoss" else None
    with pytest.raises(ValueError, match=r"^the largest dims or layer weight x scale must be within 3\.40282e\+38 "
                                         r"\(float32's range: .*; got 6e\+38$"):
        loss(batch_columns(model, 2), labels)
    taken = ours.MatryoshkaLoss(model64, getattr(ours, inner)(model64), (32, 16), (3e37, 1.0))
    assert torch.isfinite(taken(batch_columns(model64, 2), labels))


@pytest.mark.parametrize("as_tensor", [False, True], ids=["parameters", "one_tensor"])
def test_learned_weights_run_the_parents_loop_which_trains_them(model64, as_tensor):
    """matryoshka_weights that require grad (the parent trains them: its sum multiplies each dimension's loss by its
    weight): the fused call took them as constants (float()), so they never got a gradient; now the parent's loop
    runs, with its value and the weights' gradients."""
    results = []
    for module in (st_losses, ours):
        if as_tensor:
            weights = torch.tensor([1.0, 0.5], dtype=torch.float64, requires_grad=True)
            leaves = [weights]
        else:
            weights = [torch.nn.Parameter(torch.tensor(w, dtype=torch.float64)) for w in (1.0, 0.5)]
            leaves = weights
        loss = module.MatryoshkaLoss(model64, module.MultipleNegativesRankingLoss(model64), (32, 16), weights)
        value, _ = value_and_grads(model64, loss, 2, None)
        results.append((float(value), [float(g) for leaf in leaves for g in leaf.grad.reshape(-1)]))
        if module is ours:
            assert not loss.uses_fused_path
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-12)
    assert results[0][1] == pytest.approx(results[1][1], rel=1e-10) and all(results[1][1])


def test_the_sampled_dimensions_change_with_the_seed(model64):
    """n_dims_per_step draws from Python's random module as the parent does: different seeds, different losses
    (so the seeded parity above is not comparing one fixed draw)."""
    loss = ours.MatryoshkaLoss(model64, ours.MultipleNegativesRankingLoss(model64), (32, 24, 16, 8, 4),
                               n_dims_per_step=1)
    from test_sentence_transformers import batch_columns

    values = {Seeded(loss, seed)(batch_columns(model64, 2), None).item() for seed in range(6)}
    assert len(values) > 1


@pytest.mark.parametrize("module", ["sentence-transformers", "ours"])
def test_every_dimension_a_step_draws_no_random_number(model64, module):
    """n_dims_per_step equal to the number of dimensions takes them all without drawing, as the parent does: a
    draw would move Python's random state, and every later draw (the next step's dimensions, layers) would differ
    from the parent's under the same seed."""
    from test_sentence_transformers import batch_columns

    losses = st_losses if module == "sentence-transformers" else ours
    loss = losses.MatryoshkaLoss(model64, losses.MultipleNegativesRankingLoss(model64), (32, 16), n_dims_per_step=2)
    random.seed(0)
    expected = random.random()
    random.seed(0)
    loss(batch_columns(model64, 2), None)
    assert random.random() == expected


def test_the_fused_functions_are_the_ones_counted(fused_calls):
    assert {"ranking_terms", "multiple_negatives"} <= set(fused_calls)
    assert all(hasattr(terms, name) for name in fused_calls)


@pytest.mark.parametrize("inner, kwargs", [("GISTEmbedLoss", {}), ("CachedGISTEmbedLoss", {"mini_batch_size": 4})])
def test_gist_under_matryoshka_runs_the_parents_loop(model64, guide64, inner, kwargs):
    """GIST has no nested path: the parent's per-dimension loop runs (each dimension our fused GIST), with the
    model's embeddings truncated and the guide's not, exactly as in sentence-transformers."""
    dims = (32, 16, 8)
    original = st_losses.MatryoshkaLoss(model64, getattr(st_losses, inner)(model64, guide64, **kwargs), dims)
    replacement = ours.MatryoshkaLoss(model64, getattr(ours, inner)(model64, guide64, **kwargs), dims)
    assert not replacement.uses_fused_path
    compare(model64, original, replacement, 2, None, value_tol=1e-12, grad_tol=1e-10)


try:  # sentence-transformers >= 6.3 decorates the calculate_loss of the loss a `.loss` wrapper holds
    from sentence_transformers.base.losses.gradcache import resolve_gradient_cache_loss  # noqa: F401
    PARENT_RESOLVES_WRAPPERS = True
except ImportError:  # earlier releases decorate the wrapper's own calculate_loss
    PARENT_RESOLVES_WRAPPERS = False


class PassThrough(torch.nn.Module):
    """A loss wrapper as users write them (to log or reweigh the loss it holds): the inner loss as `.loss`, its
    gradient-cache flag reported, and no calculate_loss of its own."""

    def __init__(self, loss):
        super().__init__()
        self.loss = loss
        self.uses_gradient_cache = loss.uses_gradient_cache

    def forward(self, sentence_features, labels):
        return self.loss(sentence_features, labels)


def test_a_wrapped_cached_loss_is_decorated_through_the_wrapper_as_the_parent_does(model64, fused_calls):
    def build(losses):
        inner = losses.CachedMultipleNegativesRankingLoss(model64, mini_batch_size=4)
        return losses.MatryoshkaLoss(model64, PassThrough(inner), (32, 16, 8))

    if not PARENT_RESOLVES_WRAPPERS:  # the parent fails when built: so does ours, the same way
        for losses in (st_losses, ours):
            with pytest.raises(AttributeError, match="calculate_loss"):
                build(losses)
        return
    original, replacement = build(st_losses), build(ours)
    assert replacement.uses_fused_path
    compare(model64, original, replacement, 2, None, value_tol=1e-12, grad_tol=1e-10)
    assert fused_calls["multiple_negatives"] == 1, f"one fused call for every dimension, got {fused_calls}"


def _with_penalty(parent, method: str):
    """A user's subclass of the loss class `parent` that adds 10 to what `method` returns (an added regulariser)."""
    def penalised(self, *args, **kwargs):
        return getattr(super(subclass, self), method)(*args, **kwargs) + 10.0

    subclass = type(f"Penalised{parent.__name__}", (parent,), {method: penalised})
    return subclass


@pytest.mark.parametrize("inner, kwargs, method, columns, labels", [
    ("MultipleNegativesRankingLoss", {}, "compute_loss_from_embeddings", 2, None),
    ("CoSENTLoss", {}, "forward", 2, GRADED),
    ("CachedMultipleNegativesRankingLoss", {"mini_batch_size": 4}, "calculate_loss", 2, None),
])
def test_a_subclass_overriding_what_the_parent_loops_over_keeps_its_override(model64, fused_calls, inner, kwargs,
                                                                            method, columns, labels):
    """The parent calls the inner loss's forward (compute_loss_from_embeddings), or a cached loss's calculate_loss,
    once per dimension: a subclass's override of them counts once per dimension. The fused call computed from the
    drop-in's own code and skipped it in silence (2.40 where the parent gives 22.40, uses_fused_path True); such a
    subclass runs the parent's loop now."""
    original = st_losses.MatryoshkaLoss(model64, _with_penalty(getattr(st_losses, inner), method)(model64, **kwargs),
                                        (32, 16))
    replacement = ours.MatryoshkaLoss(model64, _with_penalty(getattr(ours, inner), method)(model64, **kwargs), (32, 16))
    assert not replacement.uses_fused_path
    compare(model64, original, replacement, columns, labels, value_tol=1e-12, grad_tol=1e-10)


def test_settings_changed_after_construction_count_on_both_paths_over_a_cached_loss(model64):
    """matryoshka_dims, matryoshka_weights and n_dims_per_step set after construction are read at each call by the
    fused call, as the parent's non-cached loop reads them; over a cached loss that runs unfused (the parent's
    decorator, which keeps the settings it was built with) they were ignored: the same loss gave two values."""
    def configured(inner):
        loss = ours.MatryoshkaLoss(model64, inner, (32, 16, 8))
        loss.matryoshka_dims, loss.matryoshka_weights = (32, 4), (1.0, 3.0)
        return loss

    fused = configured(ours.CachedMultipleNegativesRankingLoss(model64, mini_batch_size=4))
    unfused = configured(ours.CachedMultipleNegativesRankingLoss(model64, mini_batch_size=4))
    unfused.loss.similarity_fct = lambda a, b: st_util.cos_sim(a, b)  # the same scores, by the parent's computation
    assert fused.uses_fused_path and not unfused.uses_fused_path
    reference = configured(ours.MultipleNegativesRankingLoss(model64))  # non-cached: the parent reads them per call
    compare(model64, reference, fused, 2, None, value_tol=1e-12, grad_tol=1e-10)
    compare(model64, reference, unfused, 2, None, value_tol=1e-12, grad_tol=1e-10)

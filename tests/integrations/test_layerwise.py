"""AdaptiveLayerLoss and Matryoshka2dLoss over angle_kernels' fused drop-ins against sentence-transformers' own
(over its own losses): the same value and parameter gradients on the same tiny 4-layer model and batch
(float64), for every layer and for sampled layers under the same seed, with its layer weightings and KL terms,
with and without Matryoshka dimensions; the fused path computes every (layer, dimension) term in one call of
the loss's computing half (the parents call the inner loss once per layer and dimension), and the
configurations it cannot express run the parents' loops.
"""

from __future__ import annotations

import copy

import pytest
import torch

from angle_kernels import terms
from angle_kernels.testing.helpers import patch_formula  # noqa: E402

pytest.importorskip("sentence_transformers")

from angle_kernels.integrations import sentence_transformers as ours  # noqa: E402
from sentence_transformers import util as st_util  # noqa: E402
from test_matryoshka import Seeded, _with_penalty  # noqa: E402
from test_sentence_transformers import ALL_DIRECTIONS, GRADED, batch_columns, compare, st_losses  # noqa: E402
from angle_kernels.testing.tiny_model import build_tiny_model_dir, load_sentence_transformer  # noqa: E402

LAYERS = 4  # hidden layers: the parents sample from the embedding output and the first 3 (the 4th is the final)
HARD = {"directions": ALL_DIRECTIONS, "hardness_mode": "hard_negatives", "hardness_strength": 2.0}

# (inner class, its kwargs, text columns, labels, layer-wise kwargs, fused)
ADAPTIVE_CASES = [
    ("CoSENTLoss", {}, 2, GRADED, {"n_layers_per_step": -1}, True),
    ("CoSENTLoss", {"similarity_fct": st_util.pairwise_angle_sim}, 2, GRADED,
     {"n_layers_per_step": 2, "layer_weighting": "log", "last_layer_weight": 2.0, "prior_layers_weight": 0.5}, True),
    ("AnglELoss", {}, 3, None, {"layer_weighting": "linear", "kl_div_weight": 3.0}, True),
    ("MultipleNegativesRankingLoss", {}, 3, None, {"n_layers_per_step": -1, "kl_temperature": 0.0}, True),
    ("MultipleNegativesRankingLoss", {"similarity_fct": st_util.dot_score, "scale": 1.0}, 2, None,
     {"n_layers_per_step": 2, "layer_weighting": lambda i: 0.5 + i}, True),
    ("MultipleNegativesRankingLoss", HARD, 3, None, {"n_layers_per_step": -1}, True),
    ("MultipleNegativesRankingLoss", {"similarity_fct": st_util.euclidean_sim}, 2, None, {}, False),
    # stacked layers do not combine with gathering (one process here: the parent's loop gathers nothing)
    ("MultipleNegativesRankingLoss", {"gather_across_devices": True}, 2, None, {}, False),
]

# (inner class, its kwargs, text columns, labels, dims, dim weights, layer-wise kwargs, fused)
MATRYOSHKA_2D_CASES = [
    ("CoSENTLoss", {}, 2, GRADED, (32, 16, 8), None, {"n_layers_per_step": -1, "n_dims_per_step": -1}, True),
    ("AnglELoss", {}, 2, GRADED, (32, 16, 8, 4), (1.0, 0.5, 0.25, 2.0), {}, True),  # one layer, one dim a step
    ("MultipleNegativesRankingLoss", {}, 3, None, (32, 24, 16, 8), None,
     {"n_layers_per_step": 2, "n_dims_per_step": 2, "layer_weighting": "log"}, True),
    ("MultipleNegativesRankingLoss", HARD, 3, None, (32, 16), (2.0, 1.0), {"n_layers_per_step": -1,
                                                                          "n_dims_per_step": -1}, True),
    ("CoSENTLoss", {"similarity_fct": st_util.pairwise_angle_sim}, 2, GRADED, (32, 7), None, {}, False),
    ("MultipleNegativesRankingLoss", {}, 2, None, (32, 16), None, {"n_layers_per_step": -1, "kl_temperature": 2.0,
                                                                  "kl_div_weight": 2.0}, True),
    ("MultipleNegativesRankingLoss", {}, 2, None, (32, 16), None, {"n_layers_per_step": -1, "last_layer_weight": 2.0,
                                                                  "prior_layers_weight": 0.5}, True),
]


@pytest.fixture(scope="module")
def deep_model64(tmp_path_factory):
    pytest.importorskip("transformers")
    return load_sentence_transformer(build_tiny_model_dir(tmp_path_factory.mktemp("deep_bert"), seed=3,
                                                          layers=LAYERS)).to(torch.float64)


@pytest.fixture
def entry_calls(monkeypatch):
    """Count the integration's calls into angle_kernels' computing layer: ranking_terms (CoSENT, AnglE) and
    multiple_negatives (whose stacked layers run one similarity pass per layer inside, by calling itself once per
    layer: only the outermost call is the integration's)."""
    calls, depth = [], [0]
    for name in ("ranking_terms", "multiple_negatives"):
        def counting(*args, _original=getattr(terms, name), _name=name, **kwargs):
            if not depth[0]:
                calls.append(_name)
            depth[0] += 1
            try:
                return _original(*args, **kwargs)
            finally:
                depth[0] -= 1

        patch_formula(monkeypatch, name, counting)
    return calls


def _check_calls(calls, fused: bool, inner_calls: list) -> None:
    if fused:
        assert len(calls) == 1, f"one fused call for every layer and dimension, got {calls}"
        assert not inner_calls, "the fused path never calls the inner loss's forward"
    else:
        assert len(inner_calls) >= 2, "the parent's loop calls the inner loss once per layer"


def _counting_inner_forward(loss) -> list:
    """Record the calls of loss.loss's forward (the parents' per-layer loop calls it)."""
    calls, original = [], loss.loss.forward

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    loss.loss.forward = counting
    return calls


@pytest.mark.parametrize("inner, kwargs, columns, labels, options, fused", ADAPTIVE_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(ADAPTIVE_CASES)])
def test_adaptive_layer_loss_matches_sentence_transformers(deep_model64, entry_calls, inner, kwargs, columns, labels,
                                                           options, fused):
    original = st_losses.AdaptiveLayerLoss(deep_model64, getattr(st_losses, inner)(deep_model64, **kwargs), **options)
    replacement = ours.AdaptiveLayerLoss(deep_model64, getattr(ours, inner)(deep_model64, **kwargs), **options)
    assert isinstance(replacement, st_losses.AdaptiveLayerLoss)
    assert replacement.uses_fused_path is fused
    assert replacement.get_config_dict() == original.get_config_dict()
    inner_calls = _counting_inner_forward(replacement)
    compare(deep_model64, Seeded(original), Seeded(replacement), columns, labels, value_tol=1e-12, grad_tol=1e-10)
    _check_calls(entry_calls, fused, inner_calls)


@pytest.mark.parametrize("inner, kwargs, columns, labels, dims, weights, options, fused", MATRYOSHKA_2D_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(MATRYOSHKA_2D_CASES)])
def test_matryoshka_2d_loss_matches_sentence_transformers(deep_model64, entry_calls, inner, kwargs, columns, labels,
                                                          dims, weights, options, fused):
    original = st_losses.Matryoshka2dLoss(deep_model64, getattr(st_losses, inner)(deep_model64, **kwargs), dims,
                                          weights, **options)
    replacement = ours.Matryoshka2dLoss(deep_model64, getattr(ours, inner)(deep_model64, **kwargs), dims, weights,
                                        **options)
    assert isinstance(replacement, st_losses.Matryoshka2dLoss)
    assert isinstance(replacement.loss, ours.MatryoshkaLoss)
    assert replacement.uses_fused_path is fused
    assert replacement.get_config_dict() == original.get_config_dict()
    inner_calls = _counting_inner_forward(replacement)
    compare(deep_model64, Seeded(original), Seeded(replacement), columns, labels, value_tol=1e-12, grad_tol=1e-10)
    _check_calls(entry_calls, fused, inner_calls)


def test_the_sampled_layers_change_with_the_seed(deep_model64):
    """The layers (and dimensions) are drawn from Python's random module as the parents draw them: different
    seeds give different losses, so the seeded parity above does not compare one fixed draw."""
    loss = ours.Matryoshka2dLoss(deep_model64, ours.MultipleNegativesRankingLoss(deep_model64), (32, 16, 8, 4))
    values = {Seeded(loss, seed)(batch_columns(deep_model64, 2), None).item() for seed in range(6)}
    assert len(values) > 1


def test_the_model_is_restored_after_the_fused_forward(deep_model64):
    """The parent's decorators come off the model, and the inner loss is back in place, after a step (also when
    the loss raises)."""
    inner = ours.CoSENTLoss(deep_model64)
    loss = ours.AdaptiveLayerLoss(deep_model64, inner, n_layers_per_step=-1)
    forwards = (deep_model64.forward, deep_model64[0].forward)
    loss(batch_columns(deep_model64, 2), torch.tensor(GRADED))
    with pytest.raises(ValueError, match="labels"):
        loss(batch_columns(deep_model64, 2), torch.tensor(GRADED[:3]))
    assert (deep_model64.forward, deep_model64[0].forward) == forwards
    assert loss.loss is inner
    with pytest.raises(ValueError, match="input_ids"):  # raised inside the parent's forward, by the model
        loss([{"attention_mask": features["attention_mask"]} for features in batch_columns(deep_model64, 2)],
             torch.tensor(GRADED))
    assert (deep_model64.forward, deep_model64[0].forward) == forwards
    assert loss.loss is inner


def test_float32_within_float32_tolerances(deep_model64):
    """The three wrappers on the model in float32 (the tolerances of the float32 parity test of the plain drop-ins)."""
    model = copy.deepcopy(deep_model64).to(torch.float32)
    for make_original, make_replacement, columns, labels in (
            (lambda: st_losses.MatryoshkaLoss(model, st_losses.CoSENTLoss(model), (32, 16, 8)),
             lambda: ours.MatryoshkaLoss(model, ours.CoSENTLoss(model), (32, 16, 8)), 2, GRADED),
            (lambda: st_losses.AdaptiveLayerLoss(model, st_losses.AnglELoss(model), n_layers_per_step=-1),
             lambda: ours.AdaptiveLayerLoss(model, ours.AnglELoss(model), n_layers_per_step=-1), 2, GRADED),
            (lambda: st_losses.Matryoshka2dLoss(model, st_losses.MultipleNegativesRankingLoss(model), (32, 16, 8),
                                                n_layers_per_step=-1, n_dims_per_step=-1),
             lambda: ours.Matryoshka2dLoss(model, ours.MultipleNegativesRankingLoss(model), (32, 16, 8),
                                           n_layers_per_step=-1, n_dims_per_step=-1), 3, None)):
        replacement = make_replacement()
        assert replacement.uses_fused_path
        compare(model, Seeded(make_original()), Seeded(replacement), columns, labels, value_tol=1e-5, grad_tol=1e-4)


def test_weights_that_are_all_zero_leave_every_layer_a_zero_gradient(deep_model64):
    """Every layer weight 0 (AdaptiveLayerLoss's last_layer_weight and prior_layers_weight, Matryoshka2dLoss's dims'
    weights): the parent's 0 * loss gives every parameter a zero gradient, and so does the fused call (it returned
    None: those parameters' gradients stayed None, which AdamW skips where it moves zero-gradient ones by their
    momentum, so training parted from step 3)."""
    model = deep_model64
    for make_original, make_replacement, columns in (
            (lambda: st_losses.AdaptiveLayerLoss(model, st_losses.MultipleNegativesRankingLoss(model),
                                                 last_layer_weight=0.0, prior_layers_weight=0.0),
             lambda: ours.AdaptiveLayerLoss(model, ours.MultipleNegativesRankingLoss(model), last_layer_weight=0.0,
                                            prior_layers_weight=0.0), 2),
            (lambda: st_losses.Matryoshka2dLoss(model, st_losses.MultipleNegativesRankingLoss(model), (32, 16, 8),
                                                matryoshka_weights=(0, 0, 0)),
             lambda: ours.Matryoshka2dLoss(model, ours.MultipleNegativesRankingLoss(model), (32, 16, 8),
                                           matryoshka_weights=(0, 0, 0)), 2)):
        replacement = make_replacement()
        assert replacement.uses_fused_path
        compare(model, Seeded(make_original()), Seeded(replacement), columns, None, value_tol=1e-12, grad_tol=1e-10)


# (setting, value, error, message): AdaptiveLayerLoss's and Matryoshka2dLoss's numbers, named as they take them
BAD_SETTINGS = [
    ("last_layer_weight", float("nan"), ValueError, "last_layer_weight must be finite, got nan"),
    ("prior_layers_weight", float("inf"), ValueError, "prior_layers_weight must be finite, got inf"),
    ("kl_div_weight", float("nan"), ValueError, "kl_div_weight must be finite, got nan"),
    ("kl_temperature", float("nan"), ValueError, "kl_temperature must be finite, got nan"),
    ("last_layer_weight", True, TypeError, "last_layer_weight must be a real number, got bool"),
    ("n_layers_per_step", 2.5, TypeError, "n_layers_per_step must be an int, got float"),  # failed in random.sample
]


@pytest.mark.parametrize("setting, value, error, message", BAD_SETTINGS,
                         ids=[f"{c[0]}-{c[1]}" for c in BAD_SETTINGS])
@pytest.mark.parametrize("cls", ["AdaptiveLayerLoss", "Matryoshka2dLoss"])
def test_bad_weights_are_refused_when_built_naming_them(deep_model64, cls, setting, value, error, message):
    """The parents take any weight and return NaN or inf (a NaN kl_temperature turned the KL terms off; True weighed
    1); the fused call refused a bad one at the first step, after every layer was embedded, as `layer_weights[0]`, an
    argument these classes do not take."""
    model = deep_model64
    dims = {"matryoshka_dims": (32, 16)} if cls == "Matryoshka2dLoss" else {}
    with pytest.raises(error, match=message):
        getattr(ours, cls)(model, ours.MultipleNegativesRankingLoss(model), **dims, **{setting: value})


@pytest.mark.parametrize("setting, value, fused", [("last_layer_weight", 1.5, False),
                                                   ("prior_layers_weight", 0.7, False),
                                                   ("kl_div_weight", 2.0, True), ("kl_temperature", 0.3, True)])
@pytest.mark.parametrize("cls", ["AdaptiveLayerLoss", "Matryoshka2dLoss"])
def test_a_learned_weight_is_trained_as_the_parent_trains_it(deep_model64, cls, setting, value, fused):
    """A weight given as an nn.Parameter (the parents train it, and sentence-transformers' trainer optimises a loss's
    parameters): refused when built ("must be a real number, got a Parameter that requires grad"). Now a learned
    last_layer_weight or prior_layers_weight, which multiplies the inner losses' values, runs the parent's loop;
    the KL terms' weight and temperature are the parent's code on the fused path too. The parent's value, model
    gradients and the weight's gradient."""
    model = deep_model64
    dims = {"matryoshka_dims": (32, 16)} if cls == "Matryoshka2dLoss" else {}
    results = []
    for module in (st_losses, ours):
        weight = torch.nn.Parameter(torch.tensor(value, dtype=torch.float64))
        loss = getattr(module, cls)(model, module.MultipleNegativesRankingLoss(model), n_layers_per_step=2, **dims,
                                    **{setting: weight})
        model.zero_grad(set_to_none=True)
        loss_value = Seeded(loss)(batch_columns(model, 2), None)
        loss_value.backward()
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
        results.append((float(loss_value), grads, float(weight.grad)))
        if module is ours:
            assert loss.uses_fused_path is fused
    (value_p, grads_p, weight_grad_p), (value_o, grads_o, weight_grad_o) = results
    assert value_o == pytest.approx(value_p, rel=1e-12) and weight_grad_o == pytest.approx(weight_grad_p, rel=1e-10)
    assert weight_grad_p != 0 and float((grads_o - grads_p).norm() / grads_p.norm()) < 1e-10


def test_a_bad_weight_set_later_or_given_by_layer_weighting_is_named_by_the_fused_call(deep_model64):
    model = deep_model64
    loss = ours.AdaptiveLayerLoss(model, ours.MultipleNegativesRankingLoss(model), n_layers_per_step=-1,
                                  layer_weighting=lambda layer: float("nan") if layer == 1 else 1.0)
    assert loss.uses_fused_path
    with pytest.raises(ValueError, match=r"layer_weighting\(1\) must be finite, got nan"):
        loss(batch_columns(model, 2), None)
    loss.layer_weighting, loss.prior_layers_weight = "uniform", float("inf")
    with pytest.raises(ValueError, match="prior_layers_weight must be finite, got inf"):
        loss(batch_columns(model, 2), None)


# (class, layer-wise kwargs, the message's start, whether it is checked once the layers are embedded): weights past
# float32's range on a float32 model, each named as the classes take it
WEIGHTS_PAST_FLOAT32 = [
    ("AdaptiveLayerLoss", {"last_layer_weight": 1e39}, "last_layer_weight", False),
    ("AdaptiveLayerLoss", {"prior_layers_weight": 1e39}, "prior_layers_weight", False),
    ("AdaptiveLayerLoss", {"kl_div_weight": 1e39}, "kl_div_weight", False),
    ("AdaptiveLayerLoss", {"kl_temperature": 1e39}, "kl_temperature", False),  # divides and multiplies: NaN
    ("Matryoshka2dLoss", {"matryoshka_weights": (1e39, 1.0)}, r"matryoshka_weights\[0\]", False),
    # a layer_weighting callable's values and a layer's weight times a dimension's: known once the layers are drawn
    ("AdaptiveLayerLoss", {"n_layers_per_step": -1, "layer_weighting": lambda layer: 1e39}, r"layer_weighting\(0\)",
     True),
    ("Matryoshka2dLoss", {"matryoshka_weights": (1e20, 1.0), "n_dims_per_step": -1, "last_layer_weight": 1e20},
     r"last_layer_weight x matryoshka_weights\[0\]", True),
]


@pytest.mark.parametrize("cls, kwargs, name, once_embedded", WEIGHTS_PAST_FLOAT32,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(WEIGHTS_PAST_FLOAT32)])
def test_a_weight_past_float32s_range_is_refused_by_name_before_any_loss_compute(deep_model64, cls, kwargs, name,
                                                                                 once_embedded):
    """The parents and the fused call multiply the layers' losses (and the KL terms) by these weights in float32
    for a 32- or 16-bit model: past its largest number (3.4e38) an inf or NaN loss, NaN gradients (the fused call
    would have named the weight layer_weights[l][i], an argument these classes do not take). Refused at the call,
    named, before any layer is embedded where the numbers alone decide it; a float64 model takes them, and a
    kl_div_weight with the KL terms off (kl_temperature 0) is not computed, so it is taken."""
    model = copy.deepcopy(deep_model64).to(torch.float32)
    embedded = []
    model[0].register_forward_pre_hook(lambda *_: embedded.append(True))
    dims = {"matryoshka_dims": (32, 16)} if cls == "Matryoshka2dLoss" else {}
    loss = getattr(ours, cls)(model, ours.MultipleNegativesRankingLoss(model), **dims, **kwargs)
    with pytest.raises(ValueError, match=rf"^{name} must be within \+-3\.40282e\+38 \(float32's range: the loss of "
                                         r"float32 embeddings is computed in float32, where a larger weight is inf\)"):
        loss(batch_columns(model, 2), None)
    assert bool(embedded) == once_embedded
    if not once_embedded:
        value = getattr(ours, cls)(deep_model64, ours.MultipleNegativesRankingLoss(deep_model64), **dims,
                                   **kwargs)(batch_columns(deep_model64, 2), None)
        assert torch.isfinite(value)
    if kwargs == {"kl_div_weight": 1e39}:
        off = ours.AdaptiveLayerLoss(model, ours.MultipleNegativesRankingLoss(model), kl_temperature=0.0, **kwargs)
        assert torch.isfinite(off(batch_columns(model, 2), None))


@pytest.mark.parametrize("method", ["compute_loss_from_embeddings", "forward"])
@pytest.mark.parametrize("layerwise, args", [("AdaptiveLayerLoss", ()), ("Matryoshka2dLoss", ((32, 16),))])
def test_a_subclass_overriding_what_the_parent_loops_over_keeps_its_override(deep_model64, layerwise, args, method):
    """The parents call the inner loss once per layer (and dimension): a subclass's override of forward or
    compute_loss_from_embeddings counts in each call. The fused call skipped it in silence (2.31 where the parent
    gives 22.31); such a subclass runs the parent's loop now."""
    original = getattr(st_losses, layerwise)(
        deep_model64, _with_penalty(st_losses.MultipleNegativesRankingLoss, method)(deep_model64), *args)
    replacement = getattr(ours, layerwise)(
        deep_model64, _with_penalty(ours.MultipleNegativesRankingLoss, method)(deep_model64), *args)
    assert not replacement.uses_fused_path
    compare(deep_model64, Seeded(original), Seeded(replacement), 2, None, value_tol=1e-12, grad_tol=1e-10)

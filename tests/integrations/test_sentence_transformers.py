"""angle_kernels.integrations.sentence_transformers against the sentence-transformers losses it replaces.

On the same tiny model and batch, each subclass must give the parent's loss value and the same gradients
on every model parameter; configurations our losses cannot express must run the parent's computation.
The model runs in float64 here, so both sides agree to rounding (relative error ~1e-15); one case runs in
float32 with the float32 tolerances of angle_kernels.float64_ops.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from angle_kernels.testing.oracle import rel_err

pytest.importorskip("sentence_transformers")

import numpy as np  # noqa: E402  (a dependency of sentence-transformers)

from angle_kernels.integrations import sentence_transformers as ours  # noqa: E402
from sentence_transformers import util as st_util  # noqa: E402

try:
    from sentence_transformers.sentence_transformer import losses as st_losses
except ImportError:  # pragma: no cover
    from sentence_transformers import losses as st_losses

from angle_kernels.testing.tiny_model import SENTENCES, load_sentence_transformer  # noqa: E402

GRADED = [0.1, 0.5, 0.5, 0.9, 0.3, 0.1]  # with ties
ALL_DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")

# (class name, constructor kwargs, number of text columns, labels, whether our fused path must run)
CASES = [
    ("CoSENTLoss", {}, 2, GRADED, True),
    ("CoSENTLoss", {"scale": 7.5}, 2, GRADED, True),
    ("CoSENTLoss", {"similarity_fct": st_util.pairwise_angle_sim}, 2, GRADED, True),
    ("CoSENTLoss", {"similarity_fct": st_util.pairwise_dot_score, "scale": 1.0}, 2, GRADED, False),
    ("AnglELoss", {}, 2, GRADED, True),
    ("AnglELoss", {"scale": 3.0}, 3, None, True),
    ("AnglELoss", {}, 4, [1.0, 0.8, 1.0, 0.6, 0.9, 1.0], True),
    ("MultipleNegativesRankingLoss", {}, 2, None, True),
    ("MultipleNegativesRankingLoss", {"scale": 10.0}, 3, None, True),
    ("MultipleNegativesRankingLoss",
     {"directions": ("query_to_doc", "doc_to_query"), "partition_mode": "per_direction"}, 3, None, True),
    ("MultipleNegativesRankingLoss", {"directions": ALL_DIRECTIONS, "partition_mode": "joint"}, 3, None, True),
    ("MultipleNegativesRankingLoss", {"hardness_mode": "in_batch_negatives", "hardness_strength": 5.0}, 3, None, True),
    ("MultipleNegativesRankingLoss", {"similarity_fct": st_util.dot_score, "scale": 1.0}, 2, None, True),
    ("MultipleNegativesRankingLoss", {"similarity_fct": st_util.dot_score, "scale": 1.0,
                                      "directions": ALL_DIRECTIONS, "hardness_mode": "hard_negatives",
                                      "hardness_strength": 0.5}, 3, None, True),
    ("MultipleNegativesRankingLoss", {"similarity_fct": st_util.euclidean_sim, "scale": 1.0}, 2, None, False),
    ("MultipleNegativesRankingLoss", {}, 4, None, True),  # two hard-negative columns
    # flags the parent reads by truth value: numpy's bool, 0 and 1
    ("MultipleNegativesRankingLoss", {"gather_across_devices": np.bool_(False)}, 2, None, True),
    ("CachedMultipleNegativesRankingLoss", {"mini_batch_size": 4, "gather_across_devices": 0}, 2, None, True),
    ("CachedMultipleNegativesRankingLoss", {"mini_batch_size": 4}, 2, None, True),
    ("CachedMultipleNegativesRankingLoss", {"mini_batch_size": 4}, 3, None, True),
    ("CachedMultipleNegativesRankingLoss", {"mini_batch_size": 3, "directions": ("query_to_doc", "doc_to_query"),
                                            "partition_mode": "per_direction"}, 3, None, True),
    ("CachedMultipleNegativesRankingLoss", {"mini_batch_size": 4, "hardness_mode": "all_negatives",
                                            "hardness_strength": 2.0}, 3, None, True),
    ("CachedMultipleNegativesRankingLoss", {"mini_batch_size": 4, "similarity_fct": st_util.dot_score,
                                            "scale": 1.0}, 3, None, True),
    ("CachedMultipleNegativesRankingLoss", {"mini_batch_size": 4, "similarity_fct": st_util.euclidean_sim,
                                            "scale": 1.0}, 2, None, False),
    ("MultipleNegativesSymmetricRankingLoss", {}, 2, None, True),
    ("MultipleNegativesSymmetricRankingLoss", {"scale": 10.0}, 3, None, True),
    ("MultipleNegativesSymmetricRankingLoss", {"similarity_fct": st_util.dot_score, "scale": 1.0}, 2, None, True),
    ("CachedMultipleNegativesSymmetricRankingLoss", {"mini_batch_size": 4}, 2, None, True),
    ("CachedMultipleNegativesSymmetricRankingLoss", {"mini_batch_size": 3, "scale": 10.0}, 3, None, True),
    # the cached classes' defaults (mini_batch_size) and a token budget per mini-batch, in the config dict too
    ("CachedMultipleNegativesRankingLoss", {}, 2, None, True),
    ("CachedMultipleNegativesRankingLoss", {"mini_batch_num_tokens": 64}, 2, None, True),
    ("CachedMultipleNegativesSymmetricRankingLoss", {}, 2, None, True),
    ("CachedMultipleNegativesSymmetricRankingLoss", {"mini_batch_num_tokens": 64}, 2, None, True),
]

def batch_columns(model, columns: int):
    """Fresh feature dicts (the model writes its outputs into them, so they are never reused): six texts
    per column."""
    return [model.preprocess(SENTENCES[6 * c: 6 * (c + 1)]) for c in range(columns)]


def value_and_grads(model, loss, columns: int, labels):
    model.zero_grad(set_to_none=True)
    label_tensor = None if labels is None else torch.tensor(labels, dtype=torch.float32)
    value = loss(batch_columns(model, columns), label_tensor)
    value.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return value.detach(), grads


def compare(model, original, replacement, columns, labels, value_tol, grad_tol):
    ref_value, ref_grads = value_and_grads(model, original, columns, labels)
    value, grads = value_and_grads(model, replacement, columns, labels)
    assert torch.isfinite(value)
    assert rel_err(value, ref_value) < value_tol, (value.item(), ref_value.item())
    assert set(grads) == set(ref_grads) and len(grads) > 10
    # Per parameter, relative to its own gradient, except for gradients that are zero in exact arithmetic
    # and only rounding noise here (attention key biases: softmax ignores a per-row constant): those are
    # measured against the whole model's gradient.
    overall = torch.linalg.vector_norm(torch.cat([g.reshape(-1).double() for g in ref_grads.values()]))
    errors = {}
    for name, ref in ref_grads.items():
        scale = max(float(torch.linalg.vector_norm(ref.double())), 1e-6 * float(overall))
        errors[name] = float(torch.linalg.vector_norm((grads[name] - ref).double())) / scale
    worst = max(errors, key=errors.get)
    assert errors[worst] < grad_tol, f"parameter-gradient relative error {errors[worst]:.2e} on {worst}"
    return value


@pytest.mark.parametrize("class_name, kwargs, columns, labels, fused", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_same_value_and_gradients_as_sentence_transformers(model64, fused_calls, class_name, kwargs, columns,
                                                           labels, fused):
    original = getattr(st_losses, class_name)(model64, **kwargs)
    replacement = getattr(ours, class_name)(model64, **kwargs)
    assert isinstance(replacement, type(original))
    assert replacement.uses_fused_path is fused
    assert replacement.get_config_dict() == original.get_config_dict()

    compare(model64, original, replacement, columns, labels, value_tol=1e-12, grad_tol=1e-10)
    if fused:
        assert sum(fused_calls.values()) > 0, "the fused path did not run"
    else:
        assert sum(fused_calls.values()) == 0, "an unsupported configuration must run the parent's code"


class _Embed(torch.nn.Module):
    """The identity as a sentence "model": the feature "x" is the embedding."""

    def forward(self, features):
        return {"sentence_embedding": features["x"] * 1.0}


def test_a_cached_loss_backpropagates_to_its_cache_outside_autocast():
    """GradCache's backward to the cached embeddings runs inside the loss call, so inside the AMP recipe's autocast
    region: it runs with autocast off, as a backward outside the region does (the similarity_lse path's backward
    products, under a bf16 autocast, gave gradients 6e-3 off). The value is returned detached, as the parent's."""
    gen = torch.Generator().manual_seed(0)
    columns = [torch.randn(64, 256, generator=gen) for _ in range(3)]
    options = {"hardness_mode": "in_batch_negatives", "hardness_strength": 2.0,
               "directions": ("query_to_doc", "query_to_query")}

    def gradients(autocast: bool) -> torch.Tensor:
        loss = ours.CachedMultipleNegativesRankingLoss(torch.nn.Sequential(_Embed()), mini_batch_size=4,
                                                       backend="torch", **options)
        leaves = [c.clone().requires_grad_(True) for c in columns]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            value = loss([{"x": x} for x in leaves], None)
        value.backward()
        return torch.cat([x.grad for x in leaves])

    assert torch.equal(gradients(True), gradients(False))
    loss = ours.CachedMultipleNegativesRankingLoss(torch.nn.Sequential(_Embed()), mini_batch_size=3)
    reps = [[c[:3, :8].clone().requires_grad_(), c[3:6, :8].clone().requires_grad_()] for c in columns[:2]]
    assert not loss.calculate_loss(reps, with_backward=True).requires_grad
    assert reps[0][0].grad is not None


@pytest.mark.parametrize("class_name", ["CoSENTLoss", "AnglELoss", "MultipleNegativesRankingLoss"])
def test_a_backward_inside_autocast_gives_the_gradients_of_one_after_it(class_name):
    """The forward and backward in one autocast region (the parents compute there): the AnglELoss drop-in raised a
    dtype mismatch and CoSENTLoss's gradients were rounded to bf16 (a relative error 50 times its parent's); the
    loss's backward now runs as it runs after the region (GISTEmbedLoss's: gist_loss in tests/test_loss_entry.py)."""
    gen = torch.Generator().manual_seed(1)
    columns = [torch.randn(8, 16, generator=gen) for _ in range(2)]
    labels = torch.rand(8, generator=gen) if class_name in ("CoSENTLoss", "AnglELoss") else None

    def gradients(backward_inside: bool) -> torch.Tensor:
        loss = getattr(ours, class_name)(torch.nn.Sequential(_Embed()))
        leaves = [c.clone().requires_grad_(True) for c in columns]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            value = loss([{"x": x} for x in leaves], labels)
            if backward_inside:
                value.backward()
        if not backward_inside:
            value.backward()
        return torch.cat([x.grad for x in leaves])

    assert torch.equal(gradients(True), gradients(False))


@pytest.mark.parametrize("class_name", ["MultipleNegativesSymmetricRankingLoss",
                                        "CachedMultipleNegativesSymmetricRankingLoss"])
def test_the_deprecated_symmetric_losses_warn_like_their_parents(model64, class_name):
    with pytest.warns(DeprecationWarning) as parent_warnings:
        getattr(st_losses, class_name)(model64)
    with pytest.warns(DeprecationWarning) as our_warnings:
        getattr(ours, class_name)(model64)
    assert [str(w.message) for w in our_warnings] == [str(w.message) for w in parent_warnings]
    # attributed to the line that builds the loss (a training script), as the parent's: not to angle_kernels
    assert [w.filename for w in our_warnings] == [w.filename for w in parent_warnings] == [__file__]


def test_the_symmetric_loss_sets_its_directions_where_an_older_parent_has_none(model64):
    """sentence-transformers 6.x releases before `directions` compute MultipleNegativesSymmetricRankingLoss without
    the attributes: the drop-in then sets the per-direction symmetric directions itself, and computes the
    parent's loss (not the one-direction default of the fused call)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        original = st_losses.MultipleNegativesSymmetricRankingLoss(model64)
        replacement = ours.MultipleNegativesSymmetricRankingLoss(model64)
    del replacement.directions, replacement.partition_mode  # as an older parent leaves the loss
    with pytest.warns(DeprecationWarning):
        ours._become_symmetric(replacement, st_losses.MultipleNegativesSymmetricRankingLoss)
    compare(model64, original, replacement, 2, None, value_tol=1e-12, grad_tol=1e-10)


def test_float32_within_float32_tolerances(tiny_model_dir):
    model = load_sentence_transformer(tiny_model_dir)
    for name, columns, labels in (("CoSENTLoss", 2, GRADED), ("AnglELoss", 3, None),
                                  ("MultipleNegativesRankingLoss", 3, None)):
        original = getattr(st_losses, name)(model)
        replacement = getattr(ours, name)(model)
        compare(model, original, replacement, columns, labels, value_tol=1e-5, grad_tol=1e-4)


def test_odd_dimension_angle_matches_the_padding_of_pairwise_angle_sim():
    """pairwise_angle_sim pads an odd dimension with a zero column; the subclass must too."""
    gen = torch.Generator().manual_seed(11)
    u = torch.randn(7, 9, generator=gen, dtype=torch.float64)
    v = torch.randn(7, 9, generator=gen, dtype=torch.float64)
    labels = torch.tensor([0.0, 1.0, 2.0, 1.0, 0.0, 2.0, 2.0])
    results = []
    for loss in (st_losses.AnglELoss(None), ours.AnglELoss(None)):
        a, b = u.clone().requires_grad_(), v.clone().requires_grad_()
        value = loss.compute_loss_from_embeddings([a, b], labels)
        value.backward()
        results.append((value.detach(), a.grad, b.grad))
    for got, ref in zip(results[1], results[0]):
        assert rel_err(got, ref) < 1e-12


def test_bad_label_count_fails_like_the_parent():
    u = torch.randn(4, 8)
    for cls in (ours.CoSENTLoss, ours.AnglELoss):
        with pytest.raises(ValueError, match="expects 4 labels"):
            cls(None).compute_loss_from_embeddings([u, u.clone()], torch.ones(3))
    # pairs without labels (a dataset without a label column): CoSENTLoss failed on labels.numel() with an
    # AttributeError, in its fused path and in the parent's alike
    for loss in (ours.CoSENTLoss(None), ours.AnglELoss(None),
                 ours.CoSENTLoss(None, similarity_fct=torch.cosine_similarity)):
        with pytest.raises(ValueError, match=rf"{type(loss).__name__} requires labels: a float similarity score per "
                                             r"pair \(the dataset's 'label' or 'score' column\); got labels=None"):
            loss.compute_loss_from_embeddings([u, u.clone()], None)
    # (anchor, positive, negative) triplets; the parent checks the count from sentence-transformers 6.2 on
    checking = [ours.AnglELoss(None)] + ([st_losses.AnglELoss(None)] if ours._release(ours._st_version) >= (6, 2)
                                         else [])
    for loss in checking:
        with pytest.raises(ValueError, match="AnglELoss expects 4 labels .* got 3 labels"):
            loss.compute_loss_from_embeddings([u, u.clone(), u.clone()], torch.ones(3))


def test_pairs_without_labels_are_refused_before_the_model_embeds(model64):
    """CoSENTLoss(model)(features, None), a dataset without a label column: the ValueError naming labels came once
    the model had embedded every column (and, under AdaptiveLayerLoss, every sampled layer, its KL terms computed);
    now at the start of the forward, for the pair losses and the Matryoshka and layer-wise losses over them.
    AnglELoss's (anchor, positive, negative) triplets default their labels and still embed and compute."""
    embedded = []
    hook = model64[0].register_forward_pre_hook(lambda *_: embedded.append(True))
    try:
        for build in (lambda: ours.CoSENTLoss(model64), lambda: ours.AnglELoss(model64),
                      lambda: ours.CoSENTLoss(model64, similarity_fct=torch.cosine_similarity),
                      lambda: ours.MatryoshkaLoss(model64, ours.CoSENTLoss(model64), [32, 16]),
                      lambda: ours.MatryoshkaLoss(model64, ours.AnglELoss(model64), [32, 16], [1.0, 0.5]),
                      lambda: ours.AdaptiveLayerLoss(model64, ours.CoSENTLoss(model64)),
                      lambda: ours.Matryoshka2dLoss(model64, ours.AnglELoss(model64), [32, 16])):
            loss = build()
            name = type(loss.loss.loss if isinstance(loss, ours.Matryoshka2dLoss) else getattr(loss, "loss", loss))
            with pytest.raises(ValueError, match=rf"^{name.__name__} requires labels: a float similarity score per "
                                                 r"pair \(the dataset's 'label' or 'score' column\); got labels=None"):
                loss(iter(batch_columns(model64, 2)), None)
            assert not embedded, type(loss).__name__
        value = ours.AnglELoss(model64)(batch_columns(model64, 3), None)
        assert torch.isfinite(value) and embedded
    finally:
        hook.remove()


@pytest.mark.parametrize("labels", [[0.7], [0.5, 0.5, 0.5]], ids=["one_pair", "all_equal"])
def test_a_batch_with_nothing_to_rank_gives_zero_with_zero_gradients_as_the_parent(labels):
    """One pair, or every label equal: no ordered pair, so log(1 + 0) = 0 with zero gradients in the parents and
    here (documented, no warning): the step trains nothing, as it does in sentence-transformers."""
    gen = torch.Generator().manual_seed(1)
    u, v = torch.randn(len(labels), 8, generator=gen), torch.randn(len(labels), 8, generator=gen)
    for name in ("CoSENTLoss", "AnglELoss"):
        for module in (st_losses, ours):
            a, b = u.clone().requires_grad_(), v.clone().requires_grad_()
            value = getattr(module, name)(None).compute_loss_from_embeddings([a, b], torch.tensor(labels))
            value.backward()
            assert float(value) == 0.0, (module.__name__, name)
            assert not a.grad.any() and not b.grad.any(), (module.__name__, name)


def test_the_pair_losses_refuse_nan_labels_and_columns_of_different_shapes():
    """A NaN or Inf label raises a ValueError naming the labels (the parents return NaN), and two columns of
    different shapes a ValueError naming the second (not a RuntimeError from inside the computation)."""
    gen = torch.Generator().manual_seed(0)
    u, v = torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)
    for name in ("CoSENTLoss", "AnglELoss"):
        loss = getattr(ours, name)(None)
        for bad in (float("nan"), float("inf")):
            with pytest.raises(ValueError, match="labels contains NaN or Inf"):
                loss.compute_loss_from_embeddings([u, v], torch.tensor([0.1, bad, 0.5, 0.9]))
        with pytest.raises(ValueError, match=r"embeddings_b must have the shape of embeddings_a \(4, 8\)"):
            loss.compute_loss_from_embeddings([u, torch.randn(5, 8, generator=gen)], torch.rand(4))


def test_labels_on_another_device_name_the_first_column():
    """Labels on another device than the embeddings ('meta' stands in for a GPU): the pair losses' message names the
    labels and the first column as their other messages do (it said "the embeddings is on ...")."""
    gen = torch.Generator().manual_seed(0)
    u, v, w = (torch.randn(4, 8, generator=gen) for _ in range(3))
    calls = (
        lambda labels: ours.CoSENTLoss(None).compute_loss_from_embeddings([u, v], labels),
        lambda labels: ours.AnglELoss(None).compute_loss_from_embeddings([u, v], labels),
        lambda labels: ours.AnglELoss(None).compute_loss_from_embeddings([u, v, w], labels),  # (a, p, n) triplets
    )
    for call in calls:
        with pytest.raises(ValueError, match=r"^labels is on meta but embeddings_a is on cpu: all inputs must be on "):
            call(torch.rand(4, device="meta"))


def test_labels_of_any_shape_with_one_per_pair_are_taken_as_the_parent_takes_them():
    """The parents take B labels of any shape (view(-1), from sentence-transformers 6.2 on; before, [1, B] labels
    failed to broadcast there); the pair path of ours refused [1, B]. Ours on [1, B] is the parent on [B]."""
    gen = torch.Generator().manual_seed(0)
    u, v = torch.randn(6, 8, generator=gen), torch.randn(6, 8, generator=gen)
    labels = torch.tensor([GRADED])  # [1, 6]
    for name in ("CoSENTLoss", "AnglELoss"):
        ref = getattr(st_losses, name)(None).compute_loss_from_embeddings([u, v], labels.view(-1))
        got = getattr(ours, name)(None).compute_loss_from_embeddings([u, v], labels)
        assert rel_err(got, ref) < 1e-6, name


def test_a_backend_is_checked_at_construction(model64, guide64):
    """backend="tritn" was accepted by every drop-in and refused at the first training step, after the model and
    data had loaded."""
    for make in (lambda **kw: ours.CoSENTLoss(model64, **kw), lambda **kw: ours.AnglELoss(model64, **kw),
                 lambda **kw: ours.MultipleNegativesRankingLoss(model64, **kw),
                 lambda **kw: ours.CachedMultipleNegativesRankingLoss(model64, **kw),
                 lambda **kw: ours.GISTEmbedLoss(model64, guide64, **kw),
                 lambda **kw: ours.CachedGISTEmbedLoss(model64, guide64, **kw)):
        with pytest.raises(ValueError, match="backend must be None or one of 'auto'.*got 'tritn'"):
            make(backend="tritn")
        assert make(backend="torch").backend == "torch"


def test_the_backend_variable_is_checked_at_construction(model64, guide64, monkeypatch):
    """A bad ANGLE_KERNELS_BACKEND was refused at the first loss call, after the model's forward passes (a cached
    loss's many): each drop-in without a backend argument now refuses it when built, with the dispatcher's message.
    An explicit backend does not read the variable; set but empty, it counts as unset."""
    makers = (lambda **kw: ours.CoSENTLoss(model64, **kw), lambda **kw: ours.AnglELoss(model64, **kw),
              lambda **kw: ours.MultipleNegativesRankingLoss(model64, **kw),
              lambda **kw: ours.CachedMultipleNegativesRankingLoss(model64, **kw),
              lambda **kw: ours.MultipleNegativesSymmetricRankingLoss(model64, **kw),
              lambda **kw: ours.CachedMultipleNegativesSymmetricRankingLoss(model64, **kw),
              lambda **kw: ours.GISTEmbedLoss(model64, guide64, **kw),
              lambda **kw: ours.CachedGISTEmbedLoss(model64, guide64, **kw))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the symmetric parents are deprecated upstream
        for make in makers:
            monkeypatch.setenv("ANGLE_KERNELS_BACKEND", "tritn")
            with pytest.raises(ValueError, match="ANGLE_KERNELS_BACKEND must be one of 'auto'.*got 'tritn'"):
                make()
            assert make(backend="torch").backend == "torch"
            for unset in ("", "  "):
                monkeypatch.setenv("ANGLE_KERNELS_BACKEND", unset)
                assert make().backend is None


def test_the_backend_given_to_a_drop_in_computes_its_loss(model64, guide64):
    """backend= reaches the fused computation of every drop-in: "cuda" on CPU embeddings is refused by that backend
    (a drop-in that dropped it would compute on the automatic choice instead, in silence)."""
    gen = torch.Generator().manual_seed(0)
    u, v, w = (torch.randn(4, 8, generator=gen) for _ in range(3))
    labels = torch.rand(4, generator=gen)
    calls = {
        "CoSENTLoss": lambda: ours.CoSENTLoss(None, backend="cuda").compute_loss_from_embeddings([u, v], labels),
        "AnglELoss pairs": lambda: ours.AnglELoss(None, backend="cuda").compute_loss_from_embeddings([u, v], labels),
        "AnglELoss triplets": lambda: ours.AnglELoss(None, backend="cuda").compute_loss_from_embeddings([u, v, w],
                                                                                                       None),
        "MultipleNegativesRankingLoss": lambda: ours.MultipleNegativesRankingLoss(
            None, backend="cuda").compute_loss_from_embeddings([u, v], None),
        "CachedMultipleNegativesRankingLoss": lambda: ours.CachedMultipleNegativesRankingLoss(
            torch.nn.Sequential(_Embed()), backend="cuda").calculate_loss([[u], [v]]),
        "GISTEmbedLoss": lambda: value_and_grads(model64, ours.GISTEmbedLoss(model64, guide64, backend="cuda"), 2,
                                                 None),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match="backend 'cuda' needs CUDA tensors"):
            call()
            pytest.fail(f"{name} computed without its backend")


def test_the_config_dict_names_a_given_backend_for_every_drop_in_that_takes_one(model64, guide64):
    """get_config_dict (what sentence-transformers' model cards print as a loss's settings) is the parent's with the
    default backend, and names the backend where one is given, for every drop-in that takes one (it was the parent's
    whatever the backend: a card did not say what computed the loss). The wrappers, which take none, keep the parent's,
    which names their inner loss by its class alone."""
    import inspect

    with_backend = [name for name in ours.__all__
                    if "backend" in inspect.signature(getattr(ours, name).__init__).parameters]
    assert len(with_backend) == 8 and "MatryoshkaLoss" not in with_backend
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the symmetric parents are deprecated upstream
        for name in with_backend:
            models = (model64, guide64) if "GIST" in name else (model64,)
            parent = getattr(st_losses, name)(*models).get_config_dict()
            assert getattr(ours, name)(*models).get_config_dict() == parent, name
            for backend in ("torch", "auto"):
                assert getattr(ours, name)(*models, backend=backend).get_config_dict() == {**parent,
                                                                                          "backend": backend}, name
    wrapped = ours.MatryoshkaLoss(model64, ours.MultipleNegativesRankingLoss(model64, backend="torch"), [32, 16])
    assert wrapped.get_config_dict() == st_losses.MatryoshkaLoss(
        model64, st_losses.MultipleNegativesRankingLoss(model64), [32, 16]).get_config_dict()


@pytest.mark.parametrize("name", ["CoSENTLoss", "AnglELoss", "MultipleNegativesRankingLoss"])
def test_a_learned_scale_runs_the_parents_computation_which_trains_it(name):
    """A scale set to an nn.Parameter (the parents train it): ours raised "scale must be a real number" while
    uses_fused_path said True; now the parent's computation runs, with the parent's value and scale gradient."""
    gen = torch.Generator().manual_seed(1)
    u, v = torch.randn(6, 8, generator=gen), torch.randn(6, 8, generator=gen)
    labels = torch.tensor(GRADED)
    results = []
    for module in (st_losses, ours):
        loss = getattr(module, name)(None)
        loss.scale = torch.nn.Parameter(torch.tensor(20.0))
        value = loss.compute_loss_from_embeddings([u, v], labels)
        value.backward()
        results.append((float(value), float(loss.scale.grad)))
        if module is ours:
            assert not loss.uses_fused_path
    assert results[0] == results[1] and results[0][1] != 0


@pytest.mark.parametrize("class_name, columns, labels", [("CoSENTLoss", 2, True),
                                                         ("CachedMultipleNegativesRankingLoss", 2, False)])
def test_sentence_transformer_trainer_runs_with_our_loss(tiny_model_dir, tmp_path, class_name, columns, labels):
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

    model = load_sentence_transformer(tiny_model_dir)
    data = {"sentence1": SENTENCES[0:12:2], "sentence2": SENTENCES[1:12:2]}
    if labels:
        data["score"] = [0.9, 0.2, 0.7, 0.4, 0.1, 0.8]
    dataset = Dataset.from_dict(data)
    kwargs = {"mini_batch_size": 2} if class_name.startswith("Cached") else {}
    loss = getattr(ours, class_name)(model, **kwargs)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=3, learning_rate=1e-2,
        report_to="none", save_strategy="no", logging_steps=1, use_cpu=True, dataloader_num_workers=0,
        seed=0, disable_tqdm=True,
    )
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=dataset, loss=loss)
    result = trainer.train()
    assert result.global_step == 2
    assert torch.isfinite(torch.tensor(result.training_loss))
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert logged and all(torch.isfinite(torch.tensor(x)) for x in logged)
    changed = sum(not torch.equal(before[name], p.detach()) for name, p in model.named_parameters())
    assert changed > 10, "training did not update the model"



def test_the_trainer_logs_the_parents_loss_at_every_step(tiny_model_dir, tmp_path):
    """A migrated training script: several datasets with a loss each (a Matryoshka wrapper, a cached loss, a cached GIST
    loss with a guide), round-robin over the datasets, the no-duplicates batch sampler and a prompt. Trained in float64
    with the drop-ins and with sentence-transformers' losses from the same seed, every step's loss agrees to rounding
    (the trainer's own rounding of its logs would hide a difference: the losses' outputs are recorded instead), and the
    model card names the drop-ins by their module, as it names any loss from outside sentence-transformers."""
    from datasets import Dataset, DatasetDict
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from sentence_transformers.base.sampler import BatchSamplers, MultiDatasetBatchSamplers

    scores = [0.9, 0.2, 0.7, 0.4, 0.1, 0.8, 0.5, 0.3]
    data = DatasetDict({
        "sts": Dataset.from_dict({"sentence1": SENTENCES[0:16:2], "sentence2": SENTENCES[1:16:2], "score": scores}),
        "triplets": Dataset.from_dict({"anchor": SENTENCES[0:16:2], "positive": SENTENCES[1:16:2],
                                       "negative": SENTENCES[8:24:2]}),
        "duplicates": Dataset.from_dict({"anchor": SENTENCES[0:8:2] * 2, "positive": SENTENCES[1:8:2] * 2}),
    })
    steps = {}
    for module in (st_losses, ours):
        torch.manual_seed(0)
        model = load_sentence_transformer(tiny_model_dir).to(torch.float64)
        guide = load_sentence_transformer(tiny_model_dir).to(torch.float64)
        with torch.no_grad():
            for p in guide.parameters():
                p.mul_(1.1)
        losses = {"sts": module.MatryoshkaLoss(model, module.CoSENTLoss(model), [32, 16]),
                  "triplets": module.CachedMultipleNegativesRankingLoss(model, mini_batch_size=3),
                  "duplicates": module.CachedGISTEmbedLoss(model, guide, mini_batch_size=3, margin=0.05)}
        values = steps[module.__name__] = []
        for loss in losses.values():
            loss.register_forward_hook(lambda _module, _inputs, output: values.append(output.item()))
        args = SentenceTransformerTrainingArguments(
            output_dir=str(tmp_path / module.__name__), max_steps=6, per_device_train_batch_size=3, learning_rate=1e-3,
            report_to="none", save_strategy="no", logging_steps=1, use_cpu=True, dataloader_num_workers=0, seed=0,
            disable_tqdm=True, batch_sampler=BatchSamplers.NO_DUPLICATES,
            multi_dataset_batch_sampler=MultiDatasetBatchSamplers.ROUND_ROBIN, prompts={"triplets": {"anchor": "a "}})
        trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=data, loss=losses)
        trainer.train()
        model.save_pretrained(str(tmp_path / module.__name__ / "model"))
        card = (tmp_path / module.__name__ / "model" / "README.md").read_text()
        if module is ours:
            assert "<code>angle_kernels.integrations.sentence_transformers.CachedGISTEmbedLoss</code>" in card
    parent, ours_ = steps.values()
    assert len(parent) == len(ours_) == 6
    assert max(abs(a - b) for a, b in zip(parent, ours_)) < 1e-6, (parent, ours_)

def test_arguments_an_older_parent_lacks_are_dropped_at_their_default_and_refused_otherwise():
    def older_init(self, model, scale=20.0, similarity_fct=None, gather_across_devices=False):
        pass

    given = {"gather_across_devices": True, "directions": ("query_to_doc",), "hardness_mode": None}
    assert ours._parent_kwargs(older_init, given, ours._MNRL_DEFAULTS) == {"gather_across_devices": True}
    with pytest.raises(TypeError, match="directions"):
        ours._parent_kwargs(older_init, {"directions": ("query_to_doc", "doc_to_query")}, ours._MNRL_DEFAULTS)


# --------------------------------------------------------------------------------------------------------
# GISTEmbed: the guide filters the in-batch negatives
# --------------------------------------------------------------------------------------------------------
# (a temperature of 0.01 makes these tiny batches' losses ~1e-3, whose float64 rounding is then 1e-12 relative:
# the cases with 0.05 keep the comparison at the 1e-12 of the others)
GIST_CASES = [
    ("GISTEmbedLoss", {}, 2),
    ("GISTEmbedLoss", {"margin_strategy": "relative", "margin": -0.05, "contrast_anchors": False,
                       "temperature": 0.05}, 3),
    ("GISTEmbedLoss", {"margin": -0.02, "contrast_positives": False, "temperature": 0.05}, 3),
    ("CachedGISTEmbedLoss", {"mini_batch_size": 4}, 2),
    ("CachedGISTEmbedLoss", {"mini_batch_size": 3, "margin_strategy": "relative", "margin": 0.05,
                             "temperature": 0.05}, 4),
    # flags the parent reads by truth value: 0, 1 and numpy's bool
    ("GISTEmbedLoss", {"contrast_anchors": 0, "contrast_positives": np.bool_(True), "temperature": 0.05}, 2),
    ("CachedGISTEmbedLoss", {"mini_batch_size": 4, "contrast_positives": 1, "gather_across_devices": 0}, 2),
    ("CachedGISTEmbedLoss", {}, 2),
    ("CachedGISTEmbedLoss", {"mini_batch_num_tokens": 64}, 2),
]


@pytest.mark.parametrize("class_name, kwargs, columns", GIST_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(GIST_CASES)])
def test_gist_same_value_and_gradients_as_sentence_transformers(model64, guide64, fused_calls, class_name, kwargs,
                                                                columns):
    original = getattr(st_losses, class_name)(model64, guide64, **kwargs)
    replacement = getattr(ours, class_name)(model64, guide64, **kwargs)
    assert isinstance(replacement, type(original)) and replacement.uses_fused_path
    assert replacement.get_config_dict() == original.get_config_dict()
    value = compare(model64, original, replacement, columns, None, value_tol=1e-12, grad_tol=1e-10)
    assert fused_calls["gist"] > 0, "the fused path did not run"
    unfiltered = getattr(ours, class_name)(model64, guide64, **{**kwargs, "margin_strategy": "absolute",
                                                                "margin": -10.0})  # the guide drops nothing
    assert abs(float(value) - float(value_and_grads(model64, unfiltered, columns, None)[0])) > 1e-9, (
        "the guide filtered nothing in this case: it does not test the filter")


@pytest.mark.parametrize("class_name, kwargs", [("GISTEmbedLoss", {}), ("CachedGISTEmbedLoss", {"mini_batch_size": 4})])
def test_gist_own_columns_kept_by_the_filter_follow_the_installed_parent(model64, guide64, monkeypatch, class_name,
                                                                        kwargs):
    """margin -0.5 lifts rows' thresholds past 1, where the guide's filter keeps a row's own anchor (positive) in the
    anchor-anchor (positive-positive) block: sentence-transformers 6.3 leaves them out regardless, earlier releases
    keep them. The drop-ins compute what the installed release computes, and the other rule gives another value (so
    this case decides between them)."""
    options = dict(margin=-0.5, temperature=0.05, **kwargs)
    original = getattr(st_losses, class_name)(model64, guide64, **options)
    compare(model64, original, getattr(ours, class_name)(model64, guide64, **options), 2, None, value_tol=1e-12,
            grad_tol=1e-10)
    monkeypatch.setattr(ours, "_PARENT_GIST_SELF_NEGATIVES", not ours._PARENT_GIST_SELF_NEGATIVES)
    other_rule = getattr(ours, class_name)(model64, guide64, **options)
    other_value, parent_value = (value_and_grads(model64, loss, 2, None)[0] for loss in (other_rule, original))
    assert rel_err(other_value, parent_value) > 1e-3


def test_gist_with_a_guide_that_must_retokenise(model64, guide64, fused_calls):
    """A guide with a shorter maximum length embeds the decoded texts re-tokenised for it, as the parent does (4
    tokens: shorter than every text, so the guide's embeddings differ from those of the model's token ids)."""
    short = load_sentence_transformer_like(guide64, max_seq_length=4)
    original, replacement = st_losses.GISTEmbedLoss(model64, short), ours.GISTEmbedLoss(model64, short)
    assert replacement.must_retokenize
    compare(model64, original, replacement, 3, None, value_tol=1e-12, grad_tol=1e-10)
    assert fused_calls["gist"] > 0


@pytest.mark.parametrize("class_name, kwargs", [("GISTEmbedLoss", {}), ("CachedGISTEmbedLoss", {"mini_batch_size": 4})])
def test_gist_refuses_a_similarity_fct_put_in_after_construction(model64, guide64, class_name, kwargs):
    """The parent scores with self.similarity_fct (its own nn.CosineSimilarity, not an argument): a module put in its
    place changed the parent's loss (82.9 against 3.99 in the review's dot-product case), while ours computed
    cosines in silence. Refused, naming the parent to use."""
    class DotProduct(torch.nn.Module):
        def forward(self, a, b):
            return (a * b).sum(-1)

    for replaced in (DotProduct(), torch.nn.CosineSimilarity(dim=0)):  # dim 0: cosines across the batch
        loss = getattr(ours, class_name)(model64, guide64, **kwargs)
        loss.similarity_fct = replaced
        with pytest.raises(ValueError, match=f"{class_name} computes cosine similarities.*similarity_fct was "
                                             "replaced"):
            value_and_grads(model64, loss, 2, None)
    # over dim 1, the last of the [rows, D] embeddings: the parent's own similarity, accepted with the same loss
    loss = getattr(ours, class_name)(model64, guide64, **kwargs)
    expected = value_and_grads(model64, loss, 2, None)[0]
    loss.similarity_fct = torch.nn.CosineSimilarity(dim=1)
    assert float(value_and_grads(model64, loss, 2, None)[0]) == pytest.approx(float(expected), rel=1e-12)


@pytest.mark.parametrize("class_name, kwargs", [("GISTEmbedLoss", {}), ("CachedGISTEmbedLoss", {"mini_batch_size": 4})])
def test_gist_refuses_a_subclass_that_overrides_sim_matrix(model64, guide64, class_name, kwargs):
    """The parent scores every block with self.sim_matrix, a hook a subclass may override: the fused loss never calls
    it and gave the unchanged loss in silence (0.37 where the parent's doubled scores give 0.21). Refused, naming the
    parent to subclass; a subclass overriding anything else is computed fused as before."""
    class Sharpened(getattr(ours, class_name)):
        def sim_matrix(self, embed1, embed2):
            return 2.0 * super().sim_matrix(embed1, embed2)

    class Named(getattr(ours, class_name)):
        def __repr__(self):
            return "named"

    with pytest.raises(ValueError, match=f"Sharpened overrides sim_matrix.*subclass sentence-transformers' "
                                         f"{class_name} to score"):
        value_and_grads(model64, Sharpened(model64, guide64, **kwargs), 2, None)
    compare(model64, getattr(st_losses, class_name)(model64, guide64, **kwargs), Named(model64, guide64, **kwargs), 2,
            None, value_tol=1e-12, grad_tol=1e-10)


def test_gist_retokenises_packed_sequences_text_by_text(model64, guide64):
    """Packed features (every text in one row, cut at cu_seq_lens_q) give the guide the same texts as padded
    features, when the guide must re-tokenise them."""
    from angle_kernels.testing.tiny_model import SENTENCES

    # a guide shorter than the model (so it re-tokenises) and longer than these texts (so it sees them whole)
    loss = ours.GISTEmbedLoss(model64, load_sentence_transformer_like(guide64, max_seq_length=16))
    assert loss.must_retokenize
    texts = SENTENCES[:3]
    ids = [model64.tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    cuts = torch.tensor([0, *np.cumsum([len(row) for row in ids])])
    packed = {"input_ids": torch.tensor([[token for row in ids for token in row]]), "cu_seq_lens_q": cuts}
    got, = loss._guide_features([packed])
    expected = loss.guide.preprocess(texts)
    assert torch.equal(got["input_ids"], expected["input_ids"])


def load_sentence_transformer_like(model, max_seq_length: int):
    import copy

    shorter = copy.deepcopy(model)
    shorter.max_seq_length = max_seq_length
    return shorter


# --------------------------------------------------------------------------------------------------------
# The number of input columns: a ValueError naming the loss, the count and what it takes (not an IndexError)
# --------------------------------------------------------------------------------------------------------
# (class name, constructor kwargs, column counts it refuses, the counts it takes as the message says them); the
# valid counts are those of the cases above
WRONG_COLUMNS = [("CoSENTLoss", {}, (1, 3), "2"), ("AnglELoss", {}, (1,), "2 or more"),
                 ("MultipleNegativesRankingLoss", {}, (1,), "2 or more"),
                 ("MultipleNegativesSymmetricRankingLoss", {}, (1,), "2 or more"),
                 # a similarity that runs the parent's computation (which ignores a third column): refused too
                 ("CoSENTLoss", {"similarity_fct": st_util.pairwise_dot_score}, (1, 3), "2")]


def test_a_wrong_number_of_columns_names_the_loss_and_what_it_expects():
    u = torch.randn(4, 8)
    for class_name, kwargs, counts, takes in WRONG_COLUMNS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            loss = getattr(ours, class_name)(None, **kwargs)
        for count in counts:
            columns = "column" if count == 1 else "columns"
            expected = rf"^{class_name} got {count} input {columns}; it expects {takes}: \((anchor|input_A)"
            with pytest.raises(ValueError, match=expected):
                loss.compute_loss_from_embeddings([u.clone() for _ in range(count)], torch.ones(4))


@pytest.mark.parametrize("scale", [0.0, -20.0, float("nan"), float("inf")])
def test_the_pair_losses_take_the_scale_rule_of_every_loss(scale):
    """scale must be finite and > 0 (angle_kernels.checks.check_scale), as in every angle_kernels loss; the parents
    accept it (a scale <= 0 flips or flattens the ranking, NaN / inf give NaN). Refused when the loss is built, and
    at the call for a scale set afterwards."""
    u, v = torch.randn(4, 8), torch.randn(4, 8)
    for class_name in ("CoSENTLoss", "AnglELoss"):
        with pytest.raises(ValueError, match="^scale must be"):
            getattr(ours, class_name)(None, scale=scale)
        loss = getattr(ours, class_name)(None)
        loss.scale = scale
        with pytest.raises(ValueError, match="^scale must be"):
            loss.compute_loss_from_embeddings([u, v], torch.rand(4))


# (class name, its scale-like argument, whether it takes mini_batch_size): every drop-in built with numbers
BUILT_WITH_NUMBERS = [("CoSENTLoss", "scale", False), ("AnglELoss", "scale", False),
                      ("MultipleNegativesRankingLoss", "scale", False),
                      ("CachedMultipleNegativesRankingLoss", "scale", True),
                      ("MultipleNegativesSymmetricRankingLoss", "scale", False),
                      ("CachedMultipleNegativesSymmetricRankingLoss", "scale", True),
                      ("GISTEmbedLoss", "temperature", False), ("CachedGISTEmbedLoss", "temperature", True)]


def test_a_drop_in_refuses_bad_numbers_when_built_before_any_model_runs(model64, guide64):
    """The parents take any scale, temperature or mini_batch_size: a bad one failed at the first loss call, after
    the model's forward passes (12 of them for CachedGISTEmbedLoss), or as GradCache's "range() arg 3 must not be
    zero". Each drop-in refuses them when built, naming the argument; a learned (tensor) scale is still taken."""
    for class_name, name, cached in BUILT_WITH_NUMBERS:
        cls = getattr(ours, class_name)
        models = (model64, guide64) if "GIST" in class_name else (model64,)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            for value in (0.0, -1.0, float("nan"), 1e39 if name == "scale" else 1e-39):
                with pytest.raises(ValueError, match=f"^{name} must be"):
                    cls(*models, **{name: value})
            if cached:
                for rows in (0, -3, 2.0, True):
                    with pytest.raises(ValueError, match=rf"^mini_batch_size must be an int >= 1 .*got {rows!r}$"):
                        cls(*models, mini_batch_size=rows)
            if name == "scale":
                cls(*models, scale=torch.nn.Parameter(torch.tensor(20.0)))


@pytest.mark.parametrize("class_name", ["MultipleNegativesRankingLoss", "CachedMultipleNegativesRankingLoss"])
def test_a_hardness_strength_that_is_not_a_finite_number_is_refused_when_built(model64, class_name):
    """The parents refuse a hardness_strength < 0 only: NaN, inf and True were taken, and the fused loss refused
    them at the first step, after the model's forward passes. Refused when built, naming the argument; a
    non-negative int is taken, as the parent takes it."""
    cls = getattr(ours, class_name)
    for value, error in ((float("nan"), ValueError), (float("inf"), ValueError), (True, TypeError)):
        with pytest.raises(error, match="^hardness_strength must be"):
            cls(model64, hardness_mode="in_batch_negatives", hardness_strength=value)
    assert cls(model64, hardness_mode="in_batch_negatives", hardness_strength=2).hardness_strength == 2


@pytest.mark.parametrize("class_name", ["MultipleNegativesRankingLoss", "CachedMultipleNegativesRankingLoss"])
def test_a_learned_hardness_strength_runs_the_parents_computation_which_trains_it(model64, class_name):
    """A hardness_strength given as an nn.Parameter (the parent trains it): refused when built ("must be a real
    number, got a Parameter that requires grad"). Now the parent's computation runs, as for a learned scale, with
    its value, model gradients and the strength's gradient; a bad current value is still refused when built."""
    results = []
    for module in (st_losses, ours):
        strength = torch.nn.Parameter(torch.tensor(2.0, dtype=torch.float64))
        loss = getattr(module, class_name)(model64, hardness_mode="all_negatives", hardness_strength=strength)
        value, grads = value_and_grads(model64, loss, 3, None)
        results.append((float(value), grads, float(strength.grad)))
        if module is ours:
            assert not loss.uses_fused_path
    (value_p, grads_p, strength_grad_p), (value_o, grads_o, strength_grad_o) = results
    assert value_o == pytest.approx(value_p, rel=1e-12) and strength_grad_o == pytest.approx(strength_grad_p, rel=1e-10)
    assert strength_grad_p != 0 and all(torch.allclose(grads_o[name], grads_p[name], rtol=1e-10, atol=1e-14)
                                        for name in grads_p)
    with pytest.raises(ValueError, match="^hardness_strength must be finite, got nan"):
        getattr(ours, class_name)(model64, hardness_mode="all_negatives",
                                  hardness_strength=torch.nn.Parameter(torch.tensor(float("nan"))))


@pytest.mark.parametrize("class_name", ["CachedMultipleNegativesRankingLoss",
                                        "CachedMultipleNegativesSymmetricRankingLoss", "CachedGISTEmbedLoss"])
def test_a_numpy_integer_mini_batch_size_is_taken_as_the_parent_takes_it(model64, guide64, class_name):
    """A mini_batch_size from a numpy array or a pandas table (np.int64): the parents take it; the drop-ins refused
    it ("must be an int >= 1") while taking numpy's integers for n_dims_per_step and n_layers_per_step."""
    models = (model64, guide64) if "GIST" in class_name else (model64,)
    values = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the symmetric parent is deprecated upstream
        for module in (st_losses, ours):
            loss = getattr(module, class_name)(*models, mini_batch_size=np.int64(2))
            values.append(float(value_and_grads(model64, loss, 2, None)[0]))
    assert values[1] == pytest.approx(values[0], rel=1e-12)


@pytest.mark.parametrize("class_name", ["GISTEmbedLoss", "CachedGISTEmbedLoss"])
def test_a_gist_margin_that_is_not_finite_is_refused_when_built(model64, guide64, class_name):
    """The parents take any margin (their filter keeps every column for NaN and -inf, drops every one for +inf);
    the fused loss refused a non-finite one at the first step, after the model and the guide had embedded the batch
    (every mini-batch of the cached loss). Refused when built, naming it; a huge finite margin is taken."""
    cls = getattr(ours, class_name)
    for margin in (float("nan"), float("-inf"), float("inf")):
        with pytest.raises(ValueError, match=f"^margin must be finite, got {margin}$"):
            cls(model64, guide64, margin=margin)
    assert cls(model64, guide64, margin=-1e30).margin == -1e30


@pytest.mark.parametrize("class_name", ["MultipleNegativesRankingLoss", "CachedMultipleNegativesRankingLoss"])
def test_unknown_directions_are_named_in_a_fixed_order_when_built(model64, class_name):
    """The parents listed the unknown directions and the valid ones as sets, in an order that changed between
    processes: named in the order given, with the four in theirs."""
    cls = getattr(ours, class_name)
    with pytest.raises(ValueError, match=r"^directions: 'doc2doc', 'query_to_docs' are not directions; the directions "
                                         r"are 'query_to_doc', 'query_to_query', 'doc_to_query', 'doc_to_doc'$"):
        cls(model64, directions=("query_to_doc", "doc2doc", "query_to_docs"))
    with pytest.raises(ValueError, match=r"^directions: 'q2d' is not a direction; "):
        cls(model64, directions=["q2d"])


@pytest.mark.parametrize("class_name", ["MultipleNegativesRankingLoss", "CachedMultipleNegativesRankingLoss"])
def test_hardness_strength_and_scale_past_the_logit_bound_together_are_refused_when_built(model64, class_name):
    """With a hardness_mode the penalised logits are multiplied by hardness_strength + scale: past 8.5e37 they
    overflow float32. Each was checked alone when built, their sum only at the first step, after the model's
    forward passes; now when built too, with the call's message. Without a hardness_mode the sum is no factor,
    and a learned (tensor) scale is the parent's to compute with: both are taken."""
    cls = getattr(ours, class_name)
    with pytest.raises(ValueError, match=r"^hardness_strength \+ scale must be <= 8\.5e\+37: the penalised logits "
                                         r"are multiplied by their sum.*got hardness_strength 8e\+37 with "
                                         r"scale 2e\+37$"):
        cls(model64, scale=2e37, hardness_mode="hard_negatives", hardness_strength=8e37)
    assert cls(model64, scale=2e37, hardness_strength=8e37).hardness_strength == 8e37
    assert cls(model64, scale=torch.nn.Parameter(torch.tensor(2e37)), hardness_mode="hard_negatives",
               hardness_strength=8e37).hardness_strength == 8e37


def test_a_wrong_number_of_columns_with_a_model(model64, guide64):
    """The cached losses and GISTEmbed refuse before embedding anything; the wrappers refuse as their inner loss."""
    cases = [(ours.CachedMultipleNegativesRankingLoss(model64), 1, "CachedMultipleNegativesRankingLoss", "2 or more"),
             (ours.GISTEmbedLoss(model64, guide64), 1, "GISTEmbedLoss", "2 or 3"),
             (ours.GISTEmbedLoss(model64, guide64), 4, "GISTEmbedLoss", "2 or 3"),
             (ours.CachedGISTEmbedLoss(model64, guide64), 1, "CachedGISTEmbedLoss", "2 or more"),
             (ours.MatryoshkaLoss(model64, ours.CoSENTLoss(model64), [32, 16]), 3, "CoSENTLoss", "2"),
             (ours.AdaptiveLayerLoss(model64, ours.AnglELoss(model64)), 1, "AnglELoss", "2 or more")]
    for loss, count, name, takes in cases:
        with pytest.raises(ValueError, match=rf"^{name} got {count} input columns?; it expects {takes}: \("):
            loss(batch_columns(model64, count), torch.ones(6))


def test_options_an_older_parent_lacks_are_dropped_at_their_defaults_only():
    """With a sentence-transformers 6.x whose loss lacks the newer options (directions, partition_mode, hardness, a
    token budget, ...), each is dropped while it has its default (the parent behaves as that default) and refused
    otherwise: the defaults that rule reads are our classes' own."""
    import inspect

    for cls in (ours.MultipleNegativesRankingLoss, ours.CachedMultipleNegativesRankingLoss,
                ours.CachedMultipleNegativesSymmetricRankingLoss, ours.CachedGISTEmbedLoss):
        parameters = inspect.signature(cls.__init__).parameters
        for name, default in ours._MNRL_DEFAULTS.items():
            if name in parameters:
                assert parameters[name].default == default, (cls.__name__, name)

    def older_init(self, model, scale=20.0, similarity_fct=None):
        pass

    assert ours._parent_kwargs(older_init, dict(ours._MNRL_DEFAULTS, scale=10.0), ours._MNRL_DEFAULTS) == {
        "scale": 10.0}
    with pytest.raises(TypeError, match="hardness_strength=0.5 needs a newer sentence-transformers"):
        ours._parent_kwargs(older_init, dict(ours._MNRL_DEFAULTS, hardness_strength=0.5), ours._MNRL_DEFAULTS)


@pytest.mark.parametrize("class_name", ["CachedMultipleNegativesRankingLoss",
                                        "CachedMultipleNegativesSymmetricRankingLoss", "CachedGISTEmbedLoss"])
def test_the_cached_losses_keep_show_progress_bar(model64, guide64, class_name):
    """show_progress_bar (the embedding passes' progress bars) reaches the parent as given; it is not in the config
    dict that the cases above compare."""
    models = (model64, guide64) if "GIST" in class_name else (model64,)
    for shown in (True, False):
        original = getattr(st_losses, class_name)(*models, show_progress_bar=shown)
        replacement = getattr(ours, class_name)(*models, show_progress_bar=shown)
        assert replacement.show_progress_bar is original.show_progress_bar is shown

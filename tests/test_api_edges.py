"""Mistakes at the edges of the loss API, refused where they are made with a message that says what to pass: an
unknown AngleLoss format at construction (not at the first call), negatives given as a bare tensor rather than a
tuple of columns, and backend="triton" where the triton package is not installed (what to install, not a setting
that cannot help)."""

from __future__ import annotations

import re
import sys

import pytest
import torch

import angle_kernels as ak


@pytest.mark.parametrize("fmt", ["D", "a", 1])
def test_angle_loss_refuses_an_unknown_format_at_construction(fmt):
    """The message lists the formats and names the value given, so a user sees what was passed."""
    with pytest.raises(ValueError, match=r"dataset_format .*'A'.*'B'.*'C'.*got " + re.escape(repr(fmt))):
        ak.AngleLoss(dataset_format=fmt)


def test_angle_loss_without_a_format_still_constructs():
    """angle-emb builds AngleLoss() and sets the format later: None stays accepted until the call."""
    loss = ak.AngleLoss()
    loss.dataset_format = "B"
    assert torch.isfinite(loss(torch.ones(8), torch.randn(8, 16)))


@pytest.mark.parametrize("loss", [
    lambda q, p, n: ak.multiple_negatives_ranking_loss(q, p, n),
    lambda q, p, n: ak.gist_loss(q, p, q, p, n, n),
])
def test_negatives_as_a_bare_tensor_say_to_pass_a_tuple(loss):
    queries, positives, negatives = torch.randn(3, 4, 8).unbind(0)
    with pytest.raises(TypeError, match=r"negatives must be a tuple .*\(negatives,\)"):
        loss(queries, positives, negatives)
    assert torch.isfinite(loss(queries, positives, (negatives,)))


@pytest.mark.parametrize("loss", [
    lambda q, p, n: ak.multiple_negatives_ranking_loss(q, p, n),
    lambda q, p, n: ak.gist_loss(q, p, q, p, n, n),
])
def test_negatives_of_another_kind_are_refused(loss):
    """Columns given as a generator or a dict (of column names to tensors) are refused with a TypeError naming
    negatives and the kind given: only a tuple or list is read as the hard-negative columns."""
    queries, positives, negatives = torch.randn(3, 4, 8).unbind(0)
    for columns, named in (((n for n in (negatives,)), "generator"), ({"hard": negatives}, "dict")):
        with pytest.raises(TypeError, match=rf"negatives must be a tuple or list .*; got {named}"):
            loss(queries, positives, columns)
    assert torch.isfinite(loss(queries, positives, [negatives]))


@pytest.mark.parametrize("interpreting", ["0", "1"])
def test_backend_triton_without_triton_says_what_to_install(interpreting, monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` fails, as where it is not installed
    monkeypatch.setenv("TRITON_INTERPRET", interpreting)
    y_pred, y_true = torch.randn(8, 16), torch.rand(4).repeat_interleave(2)
    with pytest.raises(RuntimeError, match=r"pip install 'angle_kernels\[triton\]'.*backend='torch'") as raised:
        ak.cosine_loss(y_true, y_pred, backend="triton")
    assert "TRITON_INTERPRET" not in str(raised.value)  # a setting cannot help without the package


def test_the_former_modules_of_the_checks_still_export_them():
    """angle_kernels.checks and angle_kernels.options, where the losses' checks lived before angle_kernels.inputs,
    still export each of them: code that imports them from there keeps working."""
    from angle_kernels import checks, inputs, options

    exported = {
        checks: ("check_binary_labels", "check_choice", "check_columns", "check_embedding_group", "check_embeddings",
                 "check_finite", "check_labels", "check_same_device", "check_same_shape", "check_scalar",
                 "check_scale", "input_checks", "input_checks_enabled", "promote_embeddings", "set_input_checks"),
        options: ("DIRECTIONS", "DimWeights", "Dims", "HARDNESS_MODES", "IBN_PARTITIONS", "LayerWeights",
                  "MARGIN_STRATEGIES", "MultipleNegativesCall", "Nested", "PARTITION_MODES", "POOLING_STRATEGIES",
                  "SIMILARITIES", "check_angle_dim", "check_arccon_options", "check_false_negative_filter",
                  "check_group_ids", "check_in_batch_options", "check_layer_stack", "check_multiple_negatives",
                  "check_nested", "check_triplets", "check_two_views", "check_zigzag", "espresso_layer_weights"),
    }
    for module, names in exported.items():
        for name in names:
            assert getattr(module, name, None) is getattr(inputs, name), f"{module.__name__}.{name}"

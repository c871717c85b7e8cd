"""Bad inputs raise a ValueError/TypeError that names the argument; value checks can be switched off;
zero vectors (where the reference's angle loss returns NaN) give finite, correct results; so do finite rows whose
squared norms overflow the compute dtype (every backend scales rows by powers of two); every tau, scale and
temperature follows one rule (finite, > 0); mixed float dtypes are promoted; meta tensors give meta outputs.

Value checks (NaN/Inf, label values) read the data and so force a device sync on GPUs: they are switchable
with angle_kernels.set_input_checks(False), the context manager angle_kernels.input_checks(False) and the
environment variable ANGLE_KERNELS_CHECK_INPUTS=0 (read at import). Shape, dtype and device checks are free
and always run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from angle_kernels.testing import oracle
from angle_kernels.testing.oracle import rel_err
from angle_kernels.testing.helpers import (
    GRAD_TOL, HUGE_MAGNITUDES, VALUE_TOL, assert_close, check_against_oracle, grads_of, huge_magnitude_id,
    huge_row_factors, randn, zigzag_labels,
)
from angle_kernels import inputs

BAD_VALUES = [float("nan"), float("inf"), float("-inf")]


def _poisoned(t: torch.Tensor, value: float, row: int = -1) -> torch.Tensor:
    t = t.clone()
    t[row, 0] = value
    return t


def _embedding_calls(ak, gen, d=8):
    """(argument name, position, callable taking the argument list) for every embedding input of every loss."""
    y = zigzag_labels(gen, 3, "binary")
    x = randn(gen, 6, d)
    b = [randn(gen, 3, d) for _ in range(3)]
    return [
        ("y_pred", [y, x], lambda a: ak.cosine_loss(*a), 1),
        ("y_pred", [y, x], lambda a: ak.angle_loss(*a), 1),
        ("y_pred", [y, x], lambda a: ak.in_batch_negative_loss(*a), 1),
        ("text", list(b), lambda a: ak.contrastive_with_negative_loss(*a), 0),
        ("pos", list(b), lambda a: ak.contrastive_with_negative_loss(*a), 1),
        ("neg", list(b), lambda a: ak.contrastive_with_negative_loss(*a), 2),
        ("h1", b[:2], lambda a: ak.arccon_loss(*a), 0),
        ("h2", b[:2], lambda a: ak.arccon_loss(*a), 1),
        ("anchor", list(b), lambda a: ak.triplet_loss(*a), 0),
        ("weak", list(b), lambda a: ak.triplet_loss(*a), 1),
        ("strong", list(b), lambda a: ak.triplet_loss(*a), 2),
        ("outputs", [y, x], lambda a: ak.AngleLoss(dataset_format="A")(*a), 1),
        ("outputs", [y, x], lambda a: ak.AngleLoss(dataset_format="B")(*a), 1),
        ("outputs", [torch.ones(9), randn(gen, 9, d)], lambda a: ak.AngleLoss(dataset_format="C")(*a), 1),
    ]


def _call_ids(calls):
    return [f"{name}@{k}" for k, (name, *_rest) in enumerate(calls)]


# --------------------------------------------------------------------------------------------------------
# NaN / Inf
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", BAD_VALUES, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_non_finite_embeddings_raise(ak, gen, bad, dtype):
    for name, args, call, position in _embedding_calls(ak, gen):
        args = [a.to(dtype) for a in args]
        args[position] = _poisoned(args[position], bad)
        with pytest.raises(ValueError, match=name):
            call(args)


@pytest.mark.parametrize("bad", BAD_VALUES, ids=["nan", "inf", "-inf"])
def test_non_finite_labels_raise(ak, gen, bad):
    x = randn(gen, 6, 8)
    y = zigzag_labels(gen, 3, "binary")
    y[2] = bad
    for call in (ak.cosine_loss, ak.angle_loss, ak.in_batch_negative_loss):
        with pytest.raises(ValueError, match="y_true"):
            call(y, x)
        with pytest.raises(ValueError, match="y_true"):
            call(y[:, None], x)
    with pytest.raises(ValueError, match="y_true|labels"):
        ak.AngleLoss(dataset_format="A")(y, x)


def test_non_finite_scalars_raise(ak, gen):
    x, y = randn(gen, 6, 8), zigzag_labels(gen, 3, "binary")
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="tau"):
            ak.cosine_loss(y, x, bad)
        with pytest.raises(ValueError, match="tau"):
            ak.angle_loss(y, x, bad)
        with pytest.raises(ValueError, match="tau"):
            ak.in_batch_negative_loss(y, x, bad)
        with pytest.raises(ValueError, match="negative_weights"):
            ak.in_batch_negative_loss(y, x, 20.0, bad)
        with pytest.raises(ValueError, match="tau"):
            ak.contrastive_with_negative_loss(x[:3], x[3:], tau=bad)
        with pytest.raises(ValueError, match="margin"):
            ak.triplet_loss(x[:2], x[2:4], x[4:], bad)
        with pytest.raises(ValueError, match="margin_degrees"):
            ak.arccon_loss(x[:3], x[3:], bad)
    with pytest.raises(ValueError, match="tau"):
        ak.arccon_loss(x[:3], x[3:], 10.0, 0.0)
    with pytest.raises(ValueError, match="margin_degrees"):
        ak.arccon_loss(x[:3], x[3:], -5.0)


def test_wrong_kinds_of_options_are_named(ak, gen):
    """Options of the wrong kind raised Python's own TypeError, naming no argument: negatives=None ("Value after *
    must be an iterable"), dim_weights=1.0 ("'float' object is not iterable"), a 0-d layer_weights ("len() of a 0-d
    tensor")."""
    x, y = randn(gen, 6, 8), zigzag_labels(gen, 3, "binary")
    with pytest.raises(TypeError, match=r"negatives must be a tuple or list .* got NoneType"):
        ak.multiple_negatives_ranking_loss(x[:3], x[3:], None)
    with pytest.raises(TypeError, match="dim_weights must be None or a sequence of one weight per dim, got 1.0"):
        ak.cosine_loss(y, x, dims=[2, 8], dim_weights=1.0)
    with pytest.raises(ValueError, match=r"layer_weights must have one entry per layer of the stack \(1\)"):
        ak.cosine_loss(y, x[None], layer_weights=torch.tensor(1.0))
    # a stack of no layers (an IndexError of the first layer's checks otherwise)
    with pytest.raises(ValueError, match=r"y_pred: every stack needs the same number L >= 1 of layers"):
        ak.cosine_loss(y, x[None][:0], layer_weights=[])
    with pytest.raises(ValueError, match=r"queries: every stack needs the same number L >= 1 of layers"):
        ak.multiple_negatives_ranking_loss(x[None, :3][:0], x[None, 3:][:0], layer_weights=[])


def test_integers_of_other_kinds_are_widths_and_numpys_bool_a_flag(ak, gen):
    """dims taken from numpy or a tensor (list(np.array([8, 4])), list(torch.tensor([8, 4]))) raised "dims[0] must
    be a Python int, got int64"; they are the same widths as Python ints. Bools and floats are not widths. numpy's
    bool is a flag; 0 and 1 are not, and a refused flag's type is named with its module (a numpy bool was reported
    as "got bool")."""
    np = pytest.importorskip("numpy")
    q, p = randn(gen, 5, 8), randn(gen, 5, 8)
    expected = ak.multiple_negatives_ranking_loss(q, p, dims=[8, 4])
    for dims in (list(np.array([8, 4])), list(torch.tensor([8, 4])), [np.int32(8), np.uint8(4)]):
        assert torch.equal(ak.multiple_negatives_ranking_loss(q, p, dims=dims), expected), dims
    for bad, named in ((8.0, "float"), (True, "bool"), (np.float64(8), "numpy.float64"), (np.bool_(True), "numpy.bool"),
                       (torch.tensor(8.0), "torch.Tensor"), (torch.tensor(True), "torch.Tensor")):
        with pytest.raises(TypeError, match=rf"dims\[0\] must be an int, got {named}"):
            ak.multiple_negatives_ranking_loss(q, p, dims=[bad, 4])
    unfiltered = ak.gist_loss(q, p, q, p, contrast_anchors=False)
    assert torch.equal(ak.gist_loss(q, p, q, p, contrast_anchors=np.bool_(False)), unfiltered)
    with pytest.raises(TypeError, match="contrast_positives must be a bool, got int"):
        ak.gist_loss(q, p, q, p, contrast_positives=1)
    # the negatives given before the guide's embeddings: named where they went, not as negatives that are no tuple
    for args, named in (((q, p, (q,), q, p), "guide_anchors must be a \\[B, D\\] tensor; got tuple"),
                        ((q, p, q, [p], (q,), (q,)), "guide_positives must be a \\[B, D\\] tensor; got list"),
                        ((q, (p,), q, p), "positives must be a \\[B, D\\] tensor; got tuple")):
        with pytest.raises(TypeError, match=named + r": gist_loss takes \(anchors, positives, guide_anchors, "):
            ak.gist_loss(*args)
    with pytest.raises(TypeError, match="gather_across_devices must be a bool, got numpy.float64"):
        ak.multiple_negatives_ranking_loss(q, p, gather_across_devices=np.float64(0.0))
    # numpy's arrays: a 0-d one is its number, a 1-d one of widths or weights a sequence (a misleading "must have
    # one entry per layer of the stack (3), got array([...])" before)
    assert torch.equal(ak.multiple_negatives_ranking_loss(q, p, scale=np.array(20.0)),
                       ak.multiple_negatives_ranking_loss(q, p, scale=20.0))
    assert torch.equal(ak.multiple_negatives_ranking_loss(q, p, dims=np.array([8, 4])), expected)
    assert torch.equal(ak.multiple_negatives_ranking_loss(q, p, dims=torch.tensor([8, 4])), expected)
    stack = torch.stack([q, q.flip(0), q * 2])
    weights = [0.2, 0.3, 1.0]
    assert torch.equal(ak.multiple_negatives_ranking_loss(stack, stack.flip(1), layer_weights=np.array(weights)),
                       ak.multiple_negatives_ranking_loss(stack, stack.flip(1), layer_weights=weights))
    for bad, named in ((True, "bool"), (np.bool_(True), "numpy.bool")):
        with pytest.raises(TypeError, match=f"scale must be a real number, got {named}"):
            ak.multiple_negatives_ranking_loss(q, p, scale=bad)


def test_numbers_of_every_kind_take_the_same_checks(ak, gen):
    """Python's floats and ints take a short path through the number checks (inputs.check_scalar, the contract's):
    a subclass of float, numpy's numbers and one-element tensors take the full one to the same value, and bools
    (numpy's too) are still refused, by the public checks and by the ops' contract."""
    np = pytest.importorskip("numpy")
    from angle_kernels import dispatch

    class Scale(float):
        pass

    q, p = randn(gen, 5, 8), randn(gen, 5, 8)
    expected = ak.multiple_negatives_ranking_loss(q, p, scale=20.0)
    for same in (20, Scale(20.0), np.float32(20.0), np.int64(20), torch.tensor(20.0)):
        assert torch.equal(ak.multiple_negatives_ranking_loss(q, p, scale=same), expected), same
    for bad, named in ((True, "bool"), (np.bool_(False), "numpy.bool")):
        with pytest.raises(TypeError, match=f"hardness_strength must be a real number, got {named}"):
            ak.multiple_negatives_ranking_loss(q, p, hardness_strength=bad)
    with pytest.raises(TypeError, match="margin must be a real Python number, got bool"):
        dispatch.similarity_xent(q, p, 20.0, "diagonal", margin=False)
    with pytest.raises(TypeError, match="period must be a Python int, got bool"):
        dispatch.similarity_lse(q, p, 20.0, period=False)


# --------------------------------------------------------------------------------------------------------
# shapes, emptiness, layouts
# --------------------------------------------------------------------------------------------------------
def test_empty_batches_raise(ak):
    empty = torch.zeros(0, 8)
    for call in (ak.cosine_loss, ak.angle_loss, ak.in_batch_negative_loss):
        with pytest.raises(ValueError, match="y_pred"):
            call(torch.zeros(0), empty)
    with pytest.raises(ValueError, match="text"):
        ak.contrastive_with_negative_loss(empty, empty)
    with pytest.raises(ValueError, match="neg"):
        ak.contrastive_with_negative_loss(torch.ones(2, 8), torch.ones(2, 8), empty)
    with pytest.raises(ValueError, match="h1"):
        ak.arccon_loss(empty, empty)
    with pytest.raises(ValueError, match="anchor"):
        ak.triplet_loss(empty, empty, empty)
    for fmt in "ABC":
        with pytest.raises(ValueError, match="outputs|labels"):
            ak.AngleLoss(dataset_format=fmt)(torch.zeros(0), empty)
    with pytest.raises(ValueError, match="y_pred"):  # zero columns is empty too
        ak.cosine_loss(torch.ones(4), torch.zeros(4, 0))


def test_odd_number_of_zigzag_rows_raises(ak, gen):
    x = randn(gen, 7, 8)
    for call in (ak.cosine_loss, ak.angle_loss, ak.in_batch_negative_loss):
        with pytest.raises(ValueError, match="y_pred"):
            call(torch.ones(7), x)
    for fmt in "AB":
        with pytest.raises(ValueError, match=r"outputs must have a multiple of 2 rows .*got 7 rows"):
            ak.AngleLoss(dataset_format=fmt)(torch.ones(7), x)
    # format C needs groups of three rows, and says so
    with pytest.raises(ValueError, match=r"outputs must have a multiple of 3 rows \(format C: query, positive"):
        ak.AngleLoss(dataset_format="C")(torch.ones(8), randn(gen, 8, 8))


def test_mismatched_shapes_raise(ak, gen):
    x = randn(gen, 6, 8)
    for call in (ak.cosine_loss, ak.angle_loss, ak.in_batch_negative_loss):
        for y in (torch.ones(4), torch.ones(6, 2), torch.ones(3), torch.ones(1, 6), torch.ones(6, 1, 1)):
            with pytest.raises(ValueError, match="y_true"):
                call(y, x)
        for bad_x in (randn(gen, 6), randn(gen, 6, 8, 1)):  # not 2-D
            with pytest.raises(ValueError, match="y_pred"):
                call(torch.ones(6), bad_x)
    with pytest.raises(ValueError, match="pos"):  # fewer positives than queries (more are candidates, as angle-emb's)
        ak.contrastive_with_negative_loss(randn(gen, 4, 8), randn(gen, 3, 8))
    with pytest.raises(ValueError, match="pos"):
        ak.contrastive_with_negative_loss(randn(gen, 3, 8), randn(gen, 3, 6))
    with pytest.raises(ValueError, match="neg"):
        ak.contrastive_with_negative_loss(randn(gen, 3, 8), randn(gen, 3, 8), randn(gen, 3, 6))
    with pytest.raises(ValueError, match="h2"):
        ak.arccon_loss(randn(gen, 3, 8), randn(gen, 4, 8))
    with pytest.raises(ValueError, match="weak"):
        ak.triplet_loss(randn(gen, 3, 8), randn(gen, 2, 8), randn(gen, 3, 8))
    with pytest.raises(ValueError, match="strong"):
        ak.triplet_loss(randn(gen, 3, 8), randn(gen, 3, 8), randn(gen, 3, 7))
    with pytest.raises(ValueError, match="labels|y_true"):
        ak.AngleLoss(dataset_format="A")(torch.ones(4), x)


def test_group_ids_validated(ak, gen):
    x, y = randn(gen, 6, 8), zigzag_labels(gen, 3, "ones")
    with pytest.raises(TypeError, match="group_ids"):
        ak.in_batch_negative_loss(y, x, group_ids=torch.arange(6).float())
    # a mask passed for ids (read as ids 0 and 1, most negatives became positives: the loss 0.0 on 8 rows)
    with pytest.raises(TypeError, match="group_ids must be an integer .* got a torch.bool tensor"):
        ak.in_batch_negative_loss(y, x, group_ids=torch.arange(6) % 2 == 0)
    with pytest.raises(TypeError, match="group_ids must be an integer .* got list"):
        ak.in_batch_negative_loss(y, x, group_ids=[0, 1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="group_ids"):
        ak.in_batch_negative_loss(y, x, group_ids=torch.arange(4))
    with pytest.raises(ValueError, match="group_ids"):
        ak.in_batch_negative_loss(y, x, group_ids=torch.arange(6, device="meta"))


# --------------------------------------------------------------------------------------------------------
# devices and dtypes
# --------------------------------------------------------------------------------------------------------
def test_mismatched_devices_raise(ak, gen):
    """'meta' stands in for a second device: the check must fire before anything reads the data."""
    x, y = randn(gen, 6, 8), zigzag_labels(gen, 3, "binary")
    for call in (ak.cosine_loss, ak.angle_loss, ak.in_batch_negative_loss):
        with pytest.raises(ValueError, match="y_true"):
            call(y.to("meta"), x)
    b = [randn(gen, 3, 8) for _ in range(3)]
    cases = [
        ("pos", lambda m: ak.contrastive_with_negative_loss(b[0], m, b[2]), b[1]),
        ("neg", lambda m: ak.contrastive_with_negative_loss(b[0], b[1], m), b[2]),
        ("h2", lambda m: ak.arccon_loss(b[0], m), b[1]),
        ("weak", lambda m: ak.triplet_loss(b[0], m, b[2]), b[1]),
        ("strong", lambda m: ak.triplet_loss(b[0], b[1], m), b[2]),
    ]
    for name, call, tensor in cases:
        with pytest.raises(ValueError, match=name):
            call(tensor.to("meta"))


def test_labels_on_another_device_name_the_embeddings_argument(ak, gen):
    """Labels left on the CPU next to GPU embeddings (or the reverse): the message names both arguments, as the
    caller calls them, not "the embeddings"."""
    x, y = randn(gen, 6, 8), zigzag_labels(gen, 3, "binary")
    for call in (ak.cosine_loss, ak.angle_loss, ak.in_batch_negative_loss):
        with pytest.raises(ValueError, match=r"^y_true is on meta but y_pred is on cpu: all inputs must be on one "):
            call(y.to("meta"), x)
        with pytest.raises(ValueError, match=r"^y_true is on cpu but y_pred is on meta"):
            call(y, x.to("meta"))
    with pytest.raises(ValueError, match=r"^labels is on meta but outputs is on cpu"):
        ak.AngleLoss(dataset_format="A")(y.to("meta"), x)
    with pytest.raises(ValueError, match=r"^labels must have shape \[6\] or \[6, 1\] to match the rows of outputs"):
        ak.AngleLoss(dataset_format="A")(y[:4], x)


def test_two_gpus_of_one_kind_are_different_devices():
    """Tensors on cuda:0 and cuda:1 are on different devices (not one device because both are CUDA): refused with
    the names of both, as a CPU tensor next to a GPU tensor is."""
    with pytest.raises(ValueError, match="y_pred is on cuda:0 but group_ids is on cuda:1"):
        inputs.check_same_device(("y_pred", torch.device("cuda", 0)), ("group_ids", "cuda:1"))
    inputs.check_same_device(("y_pred", torch.device("cuda", 1)), ("group_ids", "cuda:1"))


def test_integer_embeddings_raise_type_error(ak):
    xi = torch.ones(6, 8, dtype=torch.int64)
    y = torch.ones(6)
    for call in (ak.cosine_loss, ak.angle_loss, ak.in_batch_negative_loss):
        with pytest.raises(TypeError, match="y_pred"):
            call(y, xi)
        with pytest.raises(TypeError, match="y_pred"):
            call(y, xi.to(torch.int32))
        with pytest.raises(TypeError, match="y_pred"):
            call(y, xi.bool())
    with pytest.raises(TypeError, match="text"):
        ak.contrastive_with_negative_loss(xi[:3], torch.ones(3, 8))
    with pytest.raises(TypeError, match="pos"):
        ak.contrastive_with_negative_loss(torch.ones(3, 8), xi[:3])
    with pytest.raises(TypeError, match="h1"):
        ak.arccon_loss(xi[:3], torch.ones(3, 8))
    with pytest.raises(TypeError, match="anchor"):
        ak.triplet_loss(xi[:3], torch.ones(3, 8), torch.ones(3, 8))
    with pytest.raises(TypeError, match="outputs"):
        ak.AngleLoss(dataset_format="A")(y, xi)
    # next to embeddings of two float dtypes (which are promoted to one), an integer tensor is still refused, not cast
    with pytest.raises(TypeError, match="neg must be a floating-point tensor"):
        ak.contrastive_with_negative_loss(torch.ones(3, 8), torch.ones(3, 8, dtype=torch.float64), xi[:3])


def test_float8_embeddings_are_refused_naming_the_argument(ak):
    """float8 tensors are floating point, so they passed the dtype check and failed inside, naming an op's argument
    (q, x) rather than the caller's."""
    x8 = torch.ones(4, 8).to(torch.float8_e4m3fn)
    cases = [("queries", lambda: ak.multiple_negatives_ranking_loss(x8, x8)), ("y_pred", lambda: ak.cosine_loss(
        torch.ones(4), x8)), ("h1", lambda: ak.arccon_loss(x8, x8)), ("anchors", lambda: ak.gist_loss(x8, x8, x8, x8))]
    for name, call in cases:
        with pytest.raises(TypeError, match=rf"^{name} must be a floating-point tensor \(float32, float64, bfloat16, "
                                            r"float16\), got torch.float8_e4m3fn$"):
            call()


@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr"])
def test_sparse_inputs_are_refused_naming_the_argument(ak, gen, layout):
    """A sparse embedding or label tensor failed inside a torch op, naming neither the argument nor the layout
    ("reshape is not implemented for sparse tensors", a 100-line NotImplementedError for linalg_vector_norm)."""
    def sparse(t):
        return t.to_sparse() if layout == "sparse_coo" else t.to_sparse_csr()  # every embedding tensor is 2-D

    calls = [*_embedding_calls(ak, gen),
             ("queries", [randn(gen, 3, 8), randn(gen, 3, 8)],
              lambda a: ak.multiple_negatives_ranking_loss(*a, dims=(8, 4)), 0),
             ("positives", [randn(gen, 3, 8), randn(gen, 3, 8)],
              lambda a: ak.multiple_negatives_ranking_loss(*a, false_negative_margin=0.1), 1),
             ("guide_anchors", [randn(gen, 3, 8) for _ in range(4)], lambda a: ak.gist_loss(*a), 2)]
    for name, args, call, position in calls:
        args = list(args)
        args[position] = sparse(args[position])
        with pytest.raises(TypeError, match=rf"^{name} must be a dense \(strided\) tensor, got a {layout} one: "
                                            rf"pass {name}.to_dense\(\)$"):
            call(args)
    if layout == "sparse_coo":  # a CSR tensor is 2-D at least
        with pytest.raises(TypeError, match=r"^y_true must be a dense \(strided\) tensor"):
            ak.cosine_loss(torch.rand(6).to_sparse(), randn(gen, 6, 8))


def test_non_tensor_inputs_raise_type_error(ak):
    with pytest.raises(TypeError, match="y_pred"):
        ak.cosine_loss(torch.ones(4), [[1.0, 2.0]] * 4)
    with pytest.raises(TypeError, match="y_true"):
        ak.cosine_loss([1.0] * 4, torch.ones(4, 2))
    with pytest.raises(TypeError, match="y_true"):
        ak.cosine_loss(torch.ones(4, dtype=torch.complex64), torch.ones(4, 2))


# --------------------------------------------------------------------------------------------------------
# argument values
# --------------------------------------------------------------------------------------------------------
def test_odd_dimension_for_angle_loss_raises(ak, gen):
    y = zigzag_labels(gen, 3, "graded")
    for d in (1, 3, 129):
        x = randn(gen, 6, d)
        with pytest.raises(ValueError, match="y_pred"):
            ak.angle_loss(y, x)
        with pytest.raises(ValueError, match="even"):
            ak.AngleLoss(dataset_format="A", angle_w=0.02)(zigzag_labels(gen, 3, "binary"), x)
        ak.cosine_loss(y, x)  # odd D is fine where no angle is computed
        ak.AngleLoss(dataset_format="A", angle_w=0.0, cosine_w=1.0)(zigzag_labels(gen, 3, "binary"), x)


@pytest.mark.parametrize("labels", [[0.5, 0.5, 1, 1], [2, 2, 0, 0], [-1, -1, 1, 1], [1, 1, 3, 3]], ids=str)
def test_non_binary_ibn_labels_raise(ak, ref_loss, gen, labels):
    """The reference truncates 0.5 to 0 and builds wrong targets for 2: we raise and say why."""
    y = torch.tensor(labels, dtype=torch.float32)
    x = randn(gen, 4, 8)
    # what the reference does instead: a finite number that silently ignores the bad labels' meaning
    assert torch.isfinite(ref_loss.in_batch_negative_loss(y[:, None], x))
    if labels[0] == 0.5:  # 0.5 is read as 0: the pair silently loses its target
        truncated = torch.tensor([0.0, 0.0, 1.0, 1.0])[:, None]
        assert ref_loss.in_batch_negative_loss(y[:, None], x) == ref_loss.in_batch_negative_loss(truncated, x)
    with pytest.raises(ValueError, match="y_true.*0 or 1|0 or 1.*y_true"):
        ak.in_batch_negative_loss(y, x)
    offending = [float(v) for v in labels if v not in (0, 1)]  # the message shows the values at fault
    with pytest.raises(ValueError, match=re.escape(f"got values such as {offending}")):
        ak.in_batch_negative_loss(y, x)
    with pytest.raises(ValueError, match="0 or 1"):
        ak.AngleLoss(dataset_format="A")(y, x)
    # graded labels stay fine where only the ranking terms read them
    ak.AngleLoss(dataset_format="A", ibn_w=0.0, cosine_w=1.0)(y, x)
    ak.in_batch_negative_loss(y.long().clamp(0, 1), x)  # integer 0/1 labels are valid


def test_bad_pooling_strategy_raises(ak, gen):
    x, y = randn(gen, 6, 8), zigzag_labels(gen, 3, "graded")
    for bad in ("max", "SUM", "", None):
        with pytest.raises(ValueError, match="pooling_strategy"):
            ak.angle_loss(y, x, 1.0, bad)
    with pytest.raises(ValueError, match="angle_pooling_strategy"):
        ak.AngleLoss(angle_pooling_strategy="max")


def test_bad_dataset_format_raises(ak, gen):
    x, y = randn(gen, 6, 8), zigzag_labels(gen, 3, "binary")
    for bad in ("D", "a", None, ""):
        with pytest.raises(ValueError, match="dataset_format"):
            ak.AngleLoss(dataset_format=bad)(y, x)


def test_bad_backend_raises(ak, gen, monkeypatch):
    x, y = randn(gen, 6, 8), zigzag_labels(gen, 3, "binary")
    calls = [
        lambda **kw: ak.cosine_loss(y, x, **kw),
        lambda **kw: ak.angle_loss(y, x, **kw),
        lambda **kw: ak.in_batch_negative_loss(y, x, **kw),
        lambda **kw: ak.contrastive_with_negative_loss(x[:3], x[3:], **kw),
        lambda **kw: ak.arccon_loss(x[:3], x[3:], **kw),
        lambda **kw: ak.triplet_loss(x[:2], x[2:4], x[4:], **kw),
        lambda **kw: ak.AngleLoss(dataset_format="A", **kw)(y, x),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="backend"):
            call(backend="tpu")
        with pytest.raises(ValueError, match="backend|cuda|CUDA"):
            call(backend="cuda")  # CPU tensors
        call(backend="torch")
        call(backend="auto")
    # the modules check theirs where it is given, not at the first step of a training run
    for module in (lambda **kw: ak.AngleLoss(**kw), lambda **kw: ak.ArcCSELoss(**kw)):
        for bad in ("tritn", 123):
            with pytest.raises(ValueError, match="backend must be None or one of 'auto'"):
                module(backend=bad)
        assert module(backend=" Torch ").backend == " Torch "  # as resolve_backend takes it
    monkeypatch.setenv("ANGLE_KERNELS_BACKEND", "bogus")
    with pytest.raises(ValueError, match="ANGLE_KERNELS_BACKEND must be one of 'auto'.*got 'bogus'"):
        ak.cosine_loss(y, x)
    for module in (lambda: ak.AngleLoss(), lambda: ak.ArcCSELoss()):  # the variable their None stands for, too
        with pytest.raises(ValueError, match="ANGLE_KERNELS_BACKEND must be one of 'auto'.*got 'bogus'"):
            module()
    monkeypatch.setenv("ANGLE_KERNELS_BACKEND", "torch")
    ak.cosine_loss(y, x)
    for unset in ("", "  "):  # set but empty counts as unset ("auto"), as ANGLE_KERNELS_CHECK_INPUTS does
        monkeypatch.setenv("ANGLE_KERNELS_BACKEND", unset)
        assert ak.resolve_backend(None, x).name == "torch"  # auto's choice for CPU tensors
        ak.cosine_loss(y, x)


def test_triton_backend_on_cpu_without_interpreter_raises(ak, gen, monkeypatch):
    # dispatch reads TRITON_INTERPRET at call time; the test session itself runs with the interpreter on
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, y = randn(gen, 6, 8), zigzag_labels(gen, 3, "binary")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        ak.cosine_loss(y, x, backend="triton")


def test_a_gpu_backend_from_the_variable_is_refused_naming_the_variable(ak, gen, monkeypatch):
    """ANGLE_KERNELS_BACKEND exported for GPU jobs reaches a CPU run that passes no backend argument: the refusal
    names the variable, and a backend argument's refusal names only the argument."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, y = randn(gen, 6, 8), zigzag_labels(gen, 3, "binary")
    monkeypatch.setenv("ANGLE_KERNELS_BACKEND", "cuda")
    with pytest.raises(ValueError, match=r"^backend 'cuda' \(from ANGLE_KERNELS_BACKEND\) needs CUDA tensors"):
        ak.cosine_loss(y, x)
    with pytest.raises(ValueError, match=r"^backend 'cuda' needs CUDA tensors"):
        ak.cosine_loss(y, x, backend="cuda")
    monkeypatch.setenv("ANGLE_KERNELS_BACKEND", "triton")
    with pytest.raises(ValueError, match=r"^backend 'triton' \(from ANGLE_KERNELS_BACKEND\) on CPU tensors"):
        ak.multiple_negatives_ranking_loss(x, x)


# --------------------------------------------------------------------------------------------------------
# switching the value checks off
# --------------------------------------------------------------------------------------------------------
def _nan_batch(gen):
    x = randn(gen, 6, 8)
    x[1, 3] = float("nan")
    return zigzag_labels(gen, 3, "binary"), x


def test_set_input_checks_off_skips_value_checks(ak, gen, monkeypatch):
    y, x = _nan_batch(gen)
    finiteness_scans = []
    original = inputs._all_finite  # the one NaN/Inf scan: watched, so that a scan with the checks off shows
    monkeypatch.setattr(inputs, "_all_finite", lambda *ts: finiteness_scans.append(len(ts)) or original(*ts))
    previous = ak.set_input_checks(False)
    try:
        out = ak.cosine_loss(y, x)  # returns without raising (garbage in, NaN out: the caller opted out)
        assert out.dim() == 0
        ak.angle_loss(y, x)
        ak.in_batch_negative_loss(y, x)
        ak.in_batch_negative_loss(torch.tensor([0.5, 0.5, 2.0, 2.0, 1.0, 1.0]), randn(gen, 6, 8))  # labels unchecked
        ak.contrastive_with_negative_loss(x[:3], x[3:])
        ak.AngleLoss(dataset_format="B")(y, x)  # formats B and C check their rows' layout themselves
        ak.AngleLoss(dataset_format="C", cosine_w=1.0)(torch.ones(9), torch.cat([x, x[:3]]))
        ak.cosine_loss(y, torch.stack([randn(gen, 6, 8), x]), layer_weights=[1.0, 1.0])  # NaN in the 2nd layer
        assert finiteness_scans == [], "a NaN scan ran although input checks are off"
        # the free checks still run
        with pytest.raises(ValueError, match="y_pred"):
            ak.cosine_loss(torch.ones(5), randn(gen, 5, 8))
        with pytest.raises(TypeError, match="y_pred"):
            ak.cosine_loss(torch.ones(6), torch.ones(6, 8, dtype=torch.int64))
    finally:
        ak.set_input_checks(previous)
    with pytest.raises(ValueError, match="y_pred"):  # back on
        ak.cosine_loss(y, x)
    assert finiteness_scans, "the NaN scan is expected to run when checks are on"


def _value_check_syncs(call) -> int:
    """The device-to-host syncs (aten._local_scalar_dense) the input checks make during call(): those made outside
    the backend's op (the torch backend makes its own on CPU, which are not the checks')."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from angle_kernels.dispatch import resolve_backend

    counted = []

    class Syncs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                counted.append(func)
            return func(*args, **(kwargs or {}))

    backend = resolve_backend("torch", torch.empty(0)).backend
    op_syncs = []

    def watched(op):  # the backend's own syncs, taken out of the count
        def run(*args, **kwargs):
            before = len(counted)
            result = op(*args, **kwargs)
            op_syncs.append(len(counted) - before)
            return result
        return run

    originals = {name: getattr(backend, name) for name in ("pair_scores", "ranking_loss", "similarity_xent",
                                                            "similarity_lse")}
    try:
        for name, op in originals.items():
            setattr(backend, name, watched(op))
        with Syncs():
            call()
    finally:
        for name, op in originals.items():
            setattr(backend, name, op)
    return len(counted) - sum(op_syncs)


def test_value_checks_sync_once_per_group_of_tensors(ak, gen):
    """A device sync stalls a GPU's queue: the value checks scan a loss's embeddings (and its labels) in one
    reduction per group, one sync; the in-batch-negative loss adds one for its label values; none when off."""
    q, p = randn(gen, 16, 8).requires_grad_(), randn(gen, 16, 8).requires_grad_()
    y = randn(gen, 32, 8).requires_grad_()
    labels = torch.ones(32)
    calls = {"multiple_negatives_ranking_loss": (lambda: ak.multiple_negatives_ranking_loss(q, p), 1),
             "cosine_loss": (lambda: ak.cosine_loss(torch.rand(16).repeat_interleave(2), y), 1),
             "in_batch_negative_loss": (lambda: ak.in_batch_negative_loss(labels, y), 2)}
    for name, (call, syncs) in calls.items():
        assert _value_check_syncs(call) == syncs, name
        with ak.input_checks(False):
            assert _value_check_syncs(call) == 0, name


def test_the_checks_switch_takes_only_a_bool(ak, gen):
    """set_input_checks and input_checks take True or False: 0, 1 or "off" (a count or a word passed by mistake)
    raise a TypeError naming the argument and leave the setting as it was."""
    y, x = _nan_batch(gen)
    for bad, named in ((0, "int"), (1, "int"), ("off", "str"), (None, "NoneType")):
        with pytest.raises(TypeError, match=f"enabled must be a bool, got {named}"):
            ak.set_input_checks(bad)
        with pytest.raises(TypeError, match=f"enabled must be a bool, got {named}"), ak.input_checks(bad):
            pass
        assert ak.input_checks_enabled()
    with pytest.raises(ValueError, match="y_pred"):  # still on
        ak.cosine_loss(y, x)


def test_input_checks_context_manager(ak, gen):
    y, x = _nan_batch(gen)
    with ak.input_checks(False):
        ak.cosine_loss(y, x)
        ak.AngleLoss(dataset_format="A")(y, x)
    with pytest.raises(ValueError, match="y_pred"):
        ak.cosine_loss(y, x)
    with pytest.raises(RuntimeError):  # restored even when the block raises
        with ak.input_checks(False):
            raise RuntimeError("boom")
    with pytest.raises(ValueError, match="y_pred"):
        ak.cosine_loss(y, x)


def test_an_input_checks_block_decides_in_its_thread_alone(ak, gen):
    """The block's setting is its thread's (as torch.no_grad's): one process-wide value, saved and restored by each
    block, turned the checks off in every thread while one thread was inside, and left them off for good when two
    threads' blocks overlapped (enter A, enter B, leave A, leave B restored B's saved 'off'); a NaN then went
    through in silence. set_input_checks stays the whole process's."""
    import threading

    y, x = _nan_batch(gen)
    inside, done = threading.Barrier(2), threading.Barrier(2)
    seen, errors = {}, []

    def block(name, leave_first):
        try:
            with ak.input_checks(False):
                inside.wait(timeout=30)  # both threads inside their blocks
                seen[name] = ak.input_checks_enabled()
                if not leave_first:
                    done.wait(timeout=30)  # the other thread has left its block
            if leave_first:
                done.wait(timeout=30)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=block, args=(name, name == "a")) for name in ("a", "b")]
    with ak.input_checks(True):  # the main thread's own block is not the workers'
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert ak.input_checks_enabled()
    assert not errors and seen == {"a": False, "b": False}
    assert ak.input_checks_enabled()
    with pytest.raises(ValueError, match="y_pred"):  # on again after both blocks
        ak.cosine_loss(y, x)
    previous = ak.set_input_checks(False)
    try:
        worker = threading.Thread(target=lambda: seen.update(worker=ak.input_checks_enabled()))
        worker.start()
        worker.join(timeout=60)
        assert seen["worker"] is False  # the process's setting reaches every thread
        with ak.input_checks(True):  # and a block decides inside it
            assert ak.input_checks_enabled()
    finally:
        ak.set_input_checks(previous)


def test_environment_variable_switches_checks_off(ak):
    # One interpreter (each start re-imports torch, ~5 s): ANGLE_KERNELS_CHECK_INPUTS=0 at import lets a NaN
    # through; then, in the same process, the checks switched back on refuse the very same inputs, so "returned"
    # was the variable's doing. That "1" and the other switch words read as on is test_check_inputs_setting_*'s.
    script = (
        "import torch, angle_kernels as ak\n"
        "x = torch.randn(6, 8); x[1, 3] = float('nan')\n"
        "y = torch.tensor([1., 1., 0., 0., 1., 1.])\n"
        "assert not ak.input_checks_enabled()\n"
        "ak.cosine_loss(y, x); ak.in_batch_negative_loss(y, x)\n"
        "print('returned')\n"
        "ak.set_input_checks(True)\n"
        "for loss in (ak.cosine_loss, ak.in_batch_negative_loss):\n"
        "    try:\n"
        "        loss(y, x)\n"
        "    except ValueError as exc:\n"
        "        assert 'y_pred' in str(exc), exc\n"
        "    else:\n"
        "        raise AssertionError(f'{loss.__name__} took a NaN with the checks on')\n"
        "print('refused')\n"
    )
    package_root = str(Path(ak.__file__).resolve().parents[1])  # wherever the package under test lives
    env = dict(os.environ, ANGLE_KERNELS_CHECK_INPUTS="0", PYTHONPATH=os.pathsep.join([package_root] + sys.path))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["returned", "refused"], done.stderr[-2000:]


@pytest.mark.parametrize("value, enabled", [(None, True), ("", True), (" On ", True), ("TRUE", True), ("1", True),
                                            ("yes", True),
                                            ("off", False), (" 0", False), ("No", False), ("false", False)])
def test_check_inputs_setting_reads_every_switch_word(ak, monkeypatch, value, enabled):
    from angle_kernels import inputs
    if value is None:
        monkeypatch.delenv(inputs.CHECK_INPUTS_ENV, raising=False)
    else:
        monkeypatch.setenv(inputs.CHECK_INPUTS_ENV, value)
    assert inputs._value_checks_setting() is enabled


@pytest.mark.parametrize("value", ["flase", "2", "disabled", "0.0"])
def test_check_inputs_setting_refuses_what_it_cannot_read(ak, monkeypatch, value):
    """A typo must not decide whether inputs are checked: an error naming the variable (at import)."""
    from angle_kernels import inputs
    monkeypatch.setenv(inputs.CHECK_INPUTS_ENV, value)
    with pytest.raises(ValueError, match=f"ANGLE_KERNELS_CHECK_INPUTS must be .*got '{value}'"):
        inputs._value_checks_setting()

# --------------------------------------------------------------------------------------------------------
# zero vectors: finite and equal to the oracle's F.normalize-epsilon semantics (the reference gives NaN)
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_zero_vectors_give_finite_correct_losses(ak, ref_loss, gen, dtype):
    n, d = 37, 130
    y = zigzag_labels(gen, n, "ties")
    binary = zigzag_labels(gen, n, "binary")
    x = randn(gen, 2 * n, d)
    x[0] = 0.0  # the u of pair 0
    x[5] = 0.0  # the v of pair 2
    x[8:10] = 0.0  # both rows of pair 4
    with torch.no_grad():
        assert torch.isnan(ref_loss.angle_loss(y[:, None], x.double(), 20.0)), "reference expected to give NaN"
    cases = [
        ("cosine", lambda x: ak.cosine_loss(y, x), lambda x: oracle.cosine_loss(y, x, 20.0)),
        ("angle sum", lambda x: ak.angle_loss(y, x, 20.0), lambda x: oracle.angle_loss(y, x, 20.0)),
        ("angle mean", lambda x: ak.angle_loss(y, x, 20.0, "mean"), lambda x: oracle.angle_loss(y, x, 20.0, "mean")),
        ("ibn", lambda x: ak.in_batch_negative_loss(binary, x), lambda x: oracle.in_batch_negative_loss(binary, x)),
        ("contrastive", lambda x: ak.contrastive_with_negative_loss(x[0::2], x[1::2]),
         lambda x: oracle.contrastive_with_negative_loss(x[0::2], x[1::2])),
        ("arccon", lambda x: ak.arccon_loss(x[0::2], x[1::2]), lambda x: oracle.arccon_loss(x[0::2], x[1::2])),
        # margin 0.1: a zero anchor puts the hinge exactly at 0 + margin, away from its kink
        ("triplet", lambda x: ak.triplet_loss(x[:24], x[24:48], x[48:72], 0.1),
         lambda x: oracle.triplet_loss(x[:24], x[24:48], x[48:72], 0.1)),
        ("AngleLoss A", lambda x: ak.AngleLoss(dataset_format="A", cosine_w=1.0)(binary, x),
         lambda x: oracle.angle_loss_module(binary, x, dataset_format="A", cosine_w=1.0)),
    ]
    for name, ours_fn, oracle_fn in cases:
        value, (grad,) = grads_of(ours_fn, x.to(dtype))
        assert torch.isfinite(value) and torch.isfinite(grad).all(), f"{name}: non-finite with zero vectors"
        true_value, (true_grad,) = grads_of(oracle_fn, x.double())
        assert_close(value, true_value, VALUE_TOL[dtype], f"{name} zero-vector value")
        assert_close(grad, true_grad, GRAD_TOL[dtype], f"{name} zero-vector grad")


def test_all_zero_batch_is_finite(ak):
    x = torch.zeros(8, 6)
    y = torch.tensor([0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0])
    for fn in (ak.cosine_loss, ak.angle_loss, lambda y, x: ak.in_batch_negative_loss((y > 1).float(), x)):
        value, (grad,) = grads_of(lambda x: fn(y, x), x)
        assert torch.isfinite(value) and torch.isfinite(grad).all()
    # every score is 0: log(1 + number of ordered pairs) = log(1 + 6)
    assert abs(ak.cosine_loss(y, x).item() - torch.log(torch.tensor(7.0)).item()) < 1e-6


# --------------------------------------------------------------------------------------------------------
# the logit scale / temperature: one rule for every loss (finite and > 0)
# --------------------------------------------------------------------------------------------------------
def _scale_sites(ak, gen):
    """(argument name, call(value)) for every public loss and module argument that scales or divides logits."""
    x, y = randn(gen, 6, 8), zigzag_labels(gen, 3, "binary")
    b = [randn(gen, 3, 8) for _ in range(3)]
    return [
        ("tau", lambda v: ak.cosine_loss(y, x, tau=v)),
        ("tau", lambda v: ak.angle_loss(y, x, tau=v)),
        ("tau", lambda v: ak.in_batch_negative_loss(y, x, tau=v)),
        ("tau", lambda v: ak.contrastive_with_negative_loss(*b, tau=v)),
        ("tau", lambda v: ak.arccon_loss(b[0], b[1], tau=v)),
        ("scale", lambda v: ak.multiple_negatives_ranking_loss(b[0], b[1], [b[2]], scale=v)),
        ("temperature", lambda v: ak.gist_loss(b[0], b[1], b[0], b[1], temperature=v)),
        ("cosine_tau", lambda v: ak.AngleLoss(cosine_tau=v, dataset_format="A")),
        ("ibn_tau", lambda v: ak.AngleLoss(ibn_tau=v, dataset_format="A")),
        ("angle_tau", lambda v: ak.AngleLoss(angle_tau=v, dataset_format="A")),
        ("tau", lambda v: ak.ArcCSELoss(tau=v)),
    ]


SCALE_VALUES = [0.0, -1.0, float("nan"), float("inf")]


def test_scales_and_temperatures_must_be_finite_and_positive(ak, gen):
    """tau, scale and temperature: one rule for every loss and module, inputs.check_scale (angle-emb accepts
    tau <= 0 in cosine/angle/in-batch-negative/contrastive losses and AngleLoss: README deviations)."""
    sites = _scale_sites(ak, gen)
    for name, call in sites:
        for value in SCALE_VALUES:
            with pytest.raises(ValueError, match=rf"\b{name}\b.*(> 0|finite)"):
                call(value)
        call(0.5)  # a positive value is fine
    assert len(sites) * len(SCALE_VALUES) == 44  # the README's count of bad-scale cases


def test_a_scale_past_float32s_range_is_refused_and_the_largest_allowed_is_finite(ak, gen):
    """A finite scale whose logits overflow float32 (scale 3.5e38, or a temperature of 1e-38) gave a silent NaN (inf -
    inf); each site refuses the side that overflows, naming the argument and the bound, and takes the other (a huge
    temperature, a tiny scale: logits near 0). At the bound itself, every loss is finite."""
    from angle_kernels.inputs import LARGEST_LOGIT_FACTOR

    sites = _scale_sites(ak, gen)
    dividing = {4, 6, 10}  # arccon_loss's tau, gist_loss's temperature, ArcCSELoss's tau: logits / value
    assert len(sites) == 11
    for index, (name, call) in enumerate(sites):
        refused = []
        for value in (1e38, 1e-38):
            try:
                call(value)
            except ValueError as exc:
                assert re.match(rf"^{name} must be [<>]= [0-9.e+-]+: the logits are (multiplied|divided) by it, and "
                                r"past that they overflow float32; got ", str(exc)), exc
                refused.append(value)
        assert refused == ([1e-38] if index in dividing else [1e38]), (name, refused)
        bound = LARGEST_LOGIT_FACTOR if refused == [1e38] else 1 / LARGEST_LOGIT_FACTOR
        out = call(bound)
        if isinstance(out, torch.Tensor):
            assert torch.isfinite(out), (name, out)



@pytest.mark.parametrize("hardness_mode", ["in_batch_negatives", "hard_negatives", "all_negatives"])
def test_a_hardness_strength_past_float32s_range_is_refused_and_the_largest_allowed_is_finite(ak, gen, hardness_mode):
    """MNRL's hardness adds hardness_strength x the similarity to the penalised columns' logits, so their factor is
    scale + hardness_strength: a strength of 1e300 with scale 20 gave a silent NaN (loss and gradients), scale and
    strength 8e37 each an infinite loss. Refused by check_scale's bound on the sum, naming both; at it, finite."""
    from angle_kernels.inputs import LARGEST_LOGIT_FACTOR

    q, p, n = (randn(gen, 4, 8).requires_grad_() for _ in range(3))
    call = lambda scale, strength: ak.multiple_negatives_ranking_loss(  # noqa: E731
        q, p, (n,), scale=scale, hardness_mode=hardness_mode, hardness_strength=strength)
    for scale, strength in ((20.0, 1e300), (8e37, 8e37)):
        with pytest.raises(ValueError, match=r"^hardness_strength \+ scale must be <= 8\.5e\+37: .* overflow float32; "
                                             + re.escape(f"got hardness_strength {strength:g} with scale {scale:g}")
                                             + "$"):
            call(scale, strength)
    loss = call(LARGEST_LOGIT_FACTOR / 2, LARGEST_LOGIT_FACTOR / 2)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(t.grad).all() for t in (q, p, n))

def test_a_learned_scale_is_refused_with_the_reason(ak, gen):
    """A scale or temperature that requires grad (an nn.Parameter, as sentence-transformers' losses allow): the
    losses take it as a constant, so it would never train; the error says so and how to pass its value (before:
    "scale must be a real number, got Parameter"). A one-element tensor without grad is its value."""
    for name, call in _scale_sites(ak, gen):
        with pytest.raises(TypeError, match=rf"^{name} must be a real number, got a Parameter that requires grad: "
                                            rf".*a learned {name} would never change.*float\({name}\)"):
            call(torch.nn.Parameter(torch.tensor(0.5)))
        call(torch.tensor(0.5))
        with pytest.raises(TypeError, match=rf"^{name} must be a real number, got torch.Tensor$"):  # not one number
            call(torch.full((2,), 0.5, requires_grad=True))


# --------------------------------------------------------------------------------------------------------
# embeddings of different float dtypes in one loss: promoted (torch's type promotion), never silently narrowed
# --------------------------------------------------------------------------------------------------------
def _mixed_dtype_cases(ak, gen):
    """(name, ours(*tensors), oracle(*tensors), tensors): every loss taking several embedding tensors."""
    b = [randn(gen, 4, 8, dtype=torch.float64) for _ in range(5)]
    return [
        ("contrastive", lambda t, p, n: ak.contrastive_with_negative_loss(t, p, n),
         oracle.contrastive_with_negative_loss, b[:3]),
        ("arccon", lambda h1, h2: ak.arccon_loss(h1, h2), oracle.arccon_loss, b[:2]),
        ("triplet", lambda a, w, s: ak.triplet_loss(a, w, s, 0.1), lambda a, w, s: oracle.triplet_loss(a, w, s, 0.1),
         b[:3]),
        ("mnrl", lambda q, p, n: ak.multiple_negatives_ranking_loss(q, p, [n]),
         lambda q, p, n: oracle.multiple_negatives_ranking_loss(q, p, [n]), b[:3]),
        ("gist", lambda a, p, ga, gp: ak.gist_loss(a, p, ga, gp, temperature=0.05),
         lambda a, p, ga, gp: oracle.gist_loss(a, p, ga, gp, temperature=0.05), b[:4]),
        ("ArcCSELoss", lambda h1, h2, a, w, s: ak.ArcCSELoss()(h1, h2, a, w, s), oracle.arccse_loss, b[:5]),
    ]


@pytest.mark.parametrize("first", [torch.float32, torch.float64], ids=str)
def test_mixed_float32_float64_embeddings_are_promoted_to_float64(ak, gen, first):
    """float32 with float64 computes in float64 (inputs.promote_embeddings: torch's type promotion), whichever
    comes first; each gradient comes back in its own input's dtype."""
    second = torch.float64 if first == torch.float32 else torch.float32
    for name, ours, exact, tensors in _mixed_dtype_cases(ak, gen):
        inputs = [t.to(first if k % 2 == 0 else second) for k, t in enumerate(tensors)]
        value, grads = grads_of(ours, *inputs)
        assert value.dtype == torch.float64, f"{name}: computed in {value.dtype}, not promoted to float64"
        assert [g.dtype for g in grads] == [t.dtype for t in inputs], f"{name}: gradient dtypes"
        true_value, true_grads = grads_of(exact, *[t.double() for t in inputs])
        assert_close(value, true_value, VALUE_TOL[torch.float64], f"{name} mixed value")
        for k, (g, true_g) in enumerate(zip(grads, true_grads)):
            if name == "gist" and k >= 2:
                continue  # the guide carries no gradient
            assert_close(g, true_g, GRAD_TOL[inputs[k].dtype], f"{name} mixed grad {k}")


def test_bfloat16_with_float16_embeddings_compute_in_float32(ak, gen):
    """bfloat16 next to float16 (neither holds the other's values) computes in float32, torch's promotion of the
    two: the loss of the same values given in float32, rather than one input narrowed to the other's 8 or 11
    significant bits; each gradient in its input's dtype."""
    for name, ours, exact, tensors in _mixed_dtype_cases(ak, gen):
        half = [t.to(torch.bfloat16 if k % 2 == 0 else torch.float16) for k, t in enumerate(tensors)]
        value, grads = grads_of(ours, *half)
        assert value.dtype == torch.float32, f"{name}: computed in {value.dtype}, not promoted to float32"
        assert torch.equal(value, ours(*[t.float() for t in half])), f"{name}: not the float32 loss of its inputs"
        assert [g.dtype for g in grads] == [t.dtype for t in half], f"{name}: gradient dtypes"


# --------------------------------------------------------------------------------------------------------
# meta tensors: shape-only inputs give shape-only outputs, as torch ops do (the value checks skip them)
# --------------------------------------------------------------------------------------------------------
def _meta_calls(ak):
    x = torch.empty(6, 8, device="meta", requires_grad=True)
    y = torch.empty(6, device="meta")
    b = [torch.empty(3, 8, device="meta", requires_grad=True) for _ in range(3)]
    return [
        ("cosine_loss", lambda: ak.cosine_loss(y, x)),
        ("angle_loss", lambda: ak.angle_loss(y, x)),
        ("in_batch_negative_loss", lambda: ak.in_batch_negative_loss(y, x)),
        ("in_batch_negative_loss group_ids", lambda: ak.in_batch_negative_loss(
            y, x, group_ids=torch.empty(6, dtype=torch.int64, device="meta"))),
        ("contrastive_with_negative_loss", lambda: ak.contrastive_with_negative_loss(*b)),
        ("arccon_loss", lambda: ak.arccon_loss(b[0], b[1])),
        ("triplet_loss", lambda: ak.triplet_loss(*b)),
        ("multiple_negatives_ranking_loss", lambda: ak.multiple_negatives_ranking_loss(b[0], b[1], [b[2]])),
        ("multiple_negatives_ranking_loss gte", lambda: ak.multiple_negatives_ranking_loss(
            b[0], b[1], [b[2]], directions=("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"))),
        ("gist_loss", lambda: ak.gist_loss(b[0], b[1], b[0].detach(), b[1].detach())),
        ("AngleLoss A", lambda: ak.AngleLoss(dataset_format="A", cosine_w=1.0)(y, x)),
        ("AngleLoss B", lambda: ak.AngleLoss(dataset_format="B")(y, x)),
        ("AngleLoss C", lambda: ak.AngleLoss(dataset_format="C", cosine_w=1.0)(
            torch.empty(9, device="meta"), torch.empty(9, 8, device="meta", requires_grad=True))),
        ("ArcCSELoss", lambda: ak.ArcCSELoss()(b[0], b[1], *b)),
    ]


def test_meta_inputs_give_meta_outputs(ak):
    for name, call in _meta_calls(ak):
        out = call()
        assert out.device.type == "meta" and out.shape == () and out.dtype == torch.float32, name
        assert out.requires_grad, name


# --------------------------------------------------------------------------------------------------------
# finite inputs whose squares or dot products overflow the compute dtype: rows are scaled by powers of two
# --------------------------------------------------------------------------------------------------------
def _huge_cases(ak, gen):
    """(name, ours(*tensors), oracle(*tensors), tensors at ordinary magnitude): every loss."""
    n, d = 6, 10
    graded, binary = zigzag_labels(gen, n, "ties"), zigzag_labels(gen, n, "binary")
    binary[:2] = 1.0  # at least one positive pair for the in-batch-negative terms
    groups = torch.tensor([0, 1, 2, 3, 0, 5, 6, 7, 8, 9, 10, 11])
    x = randn(gen, 2 * n, d)
    t = [randn(gen, 5, d) for _ in range(5)]
    format_c = torch.ones(9)
    gte = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
    dims = (4, 10)
    return [
        ("cosine_loss", lambda x: ak.cosine_loss(graded, x), lambda x: oracle.cosine_loss(graded, x), [x]),
        ("angle_loss sum", lambda x: ak.angle_loss(graded, x, 20.0), lambda x: oracle.angle_loss(graded, x, 20.0),
         [x]),
        ("angle_loss mean", lambda x: ak.angle_loss(graded, x, 20.0, "mean"),
         lambda x: oracle.angle_loss(graded, x, 20.0, "mean"), [x]),
        ("in_batch_negative_loss", lambda x: ak.in_batch_negative_loss(binary, x, group_ids=groups),
         lambda x: oracle.in_batch_negative_loss(binary, x, group_ids=groups), [x]),
        ("contrastive_with_negative_loss", lambda a, b, c: ak.contrastive_with_negative_loss(a, b, c),
         oracle.contrastive_with_negative_loss, t[:3]),
        ("arccon_loss", lambda a, b: ak.arccon_loss(a, b), oracle.arccon_loss, t[:2]),
        ("triplet_loss", lambda a, b, c: ak.triplet_loss(a, b, c, 0.1),
         lambda a, b, c: oracle.triplet_loss(a, b, c, 0.1), t[:3]),
        ("multiple_negatives_ranking_loss", lambda a, b, c: ak.multiple_negatives_ranking_loss(a, b, [c]),
         lambda a, b, c: oracle.multiple_negatives_ranking_loss(a, b, [c]), t[:3]),
        ("multiple_negatives_ranking_loss gte+hardness", lambda a, b, c: ak.multiple_negatives_ranking_loss(
            a, b, [c], directions=gte, hardness_mode="all_negatives", hardness_strength=2.0),
         lambda a, b, c: oracle.multiple_negatives_ranking_loss(
             a, b, [c], directions=gte, hardness_mode="all_negatives", hardness_strength=2.0), t[:3]),
        ("multiple_negatives_ranking_loss filter", lambda a, b, c: ak.multiple_negatives_ranking_loss(
            a, b, [c], false_negative_margin=0.3),
         lambda a, b, c: oracle.multiple_negatives_ranking_loss(a, b, [c], false_negative_margin=0.3), t[:3]),
        ("gist_loss", lambda a, b, c: ak.gist_loss(a, b, a.detach() + c.detach(), b.detach(), [c], [c.detach()],
                                                   temperature=0.05, margin=0.05),
         lambda a, b, c: oracle.gist_loss(a, b, a + c, b, [c], [c], temperature=0.05, margin=0.05), t[:3]),
        ("AngleLoss A", lambda x: ak.AngleLoss(dataset_format="A", cosine_w=1.0, angle_w=1.0)(binary, x),
         lambda x: oracle.angle_loss_module(binary, x, dataset_format="A", cosine_w=1.0, angle_w=1.0), [x]),
        ("AngleLoss B", lambda x: ak.AngleLoss(dataset_format="B")(binary, x),
         lambda x: oracle.angle_loss_module(binary, x, dataset_format="B"), [x]),
        ("AngleLoss C", lambda x: ak.AngleLoss(dataset_format="C", cosine_w=1.0)(format_c, x[:9]),
         lambda x: oracle.angle_loss_module(format_c, x[:9], dataset_format="C", cosine_w=1.0), [x]),
        ("ArcCSELoss", lambda a, b, c, w, s: ak.ArcCSELoss()(a, b, c, w, s), oracle.arccse_loss, t[:5]),
        ("cosine_loss dims", lambda x: ak.cosine_loss(graded, x, dims=dims),
         lambda x: sum(oracle.cosine_loss(graded, x[:, :w]) for w in dims), [x]),
        ("in_batch_negative_loss dims", lambda x: ak.in_batch_negative_loss(binary, x, dims=dims),
         lambda x: sum(oracle.in_batch_negative_loss(binary, x[:, :w]) for w in dims), [x]),
        ("contrastive dims", lambda a, b: ak.contrastive_with_negative_loss(a, b, dims=dims),
         lambda a, b: sum(oracle.contrastive_with_negative_loss(a[:, :w], b[:, :w]) for w in dims), t[:2]),
    ]


@pytest.mark.parametrize("dtype, magnitude", HUGE_MAGNITUDES, ids=[huge_magnitude_id(c) for c in HUGE_MAGNITUDES])
def test_huge_finite_embeddings_give_the_reference_values(ak, gen, dtype, magnitude):
    """Rows whose squared norms and dot products overflow the compute dtype (the inputs themselves are finite):
    every loss returns the reference's finite value and gradients. Cosines are scale-invariant per row, so the
    float64 reference on the rows before they were multiplied by powers of two
    (angle_kernels.testing.helpers.huge_row_factors) is the exact answer, and the gradient with respect to those
    rows (the factors are applied inside the differentiated function) is held to the usual tolerances (bfloat16:
    the half-precision rule against eager bfloat16 on the ordinary rows). Most rows are huge, every fifth is not,
    so scaled and unscaled rows meet."""
    cases = _huge_cases(ak, gen)
    for name, ours, exact, tensors in cases:
        factors = [huge_row_factors(t.to(dtype), magnitude) for t in tensors]

        def huge(*leaves, ours=ours, factors=factors):
            big = [leaf * f for leaf, f in zip(leaves, factors)]
            assert all(torch.isfinite(b).all() for b in big)
            return ours(*big)

        check_against_oracle(huge, exact, [t.to(dtype) for t in tensors], f"{name} {dtype} x{magnitude:g}")
    assert len(cases) == 18  # the README's count: 18 losses x 5 (dtype, magnitude)


def test_a_parsed_nested_is_checked_against_the_embeddings_it_comes_with():
    """The sentence-transformers MNRL family passes its Nested parsed once per call to the shared check
    (inputs.check_multiple_negatives) rather than dims: one wider than the embeddings is refused there, as is a
    call that passes both forms."""

    q, p = torch.randn(4, 8), torch.randn(4, 8)
    kwargs = dict(scale=20.0, directions=("query_to_doc",), partition_mode="joint", hardness_mode=None,
                  hardness_strength=0.0, false_negative_margin=None, false_negative_strategy="absolute",
                  similarity="cosine", gather_across_devices=False)
    fits = inputs.check_nested((4, 8), None, 8)
    assert inputs.check_multiple_negatives(q, p, [], nested=fits, **kwargs).nested is fits
    too_wide = inputs.check_nested((4, 16), None, 16)
    with pytest.raises(ValueError, match="16"):
        inputs.check_multiple_negatives(q, p, [], nested=too_wide, **kwargs)
    with pytest.raises(ValueError, match="either a parsed nested or dims"):
        inputs.check_multiple_negatives(q, p, [], nested=fits, dims=(4, 8), **kwargs)


@pytest.mark.parametrize("options", [
    {},
    {"directions": ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")},
    {"directions": ("query_to_doc", "doc_to_query"), "partition_mode": "per_direction"},
    {"hardness_mode": "all_negatives", "hardness_strength": 2.0},
], ids=["plain", "gte", "symmetric", "hardness"])
def test_dot_product_logits_beyond_the_dtype(ak, gen, options):
    """MNRL with similarity="dot" on float32 rows whose logits exceed float32 (rows of size 2^66: dot products
    near 2^132 > 3.4e38): the float64 reference's value and gradients, never inf - inf. Half the pairs are huge,
    with a dominant positive (their loss is exactly 0), the rest ordinary rows that meet huge columns (losses near
    1e21). The huge rows are scaled basis vectors, so that float64 forms their products exactly and the reference
    is exact too (on random huge rows its own rounding, about 1e25, would exceed the losses)."""
    queries, positives = torch.randn(2, 6, 8, generator=gen)
    negatives = torch.randn(6, 8, generator=gen)
    for row in (0, 2, 4):
        queries[row] = torch.eye(8)[row] * 2.0 ** 66
        positives[row] = (torch.eye(8)[row] + 0.5 * torch.eye(8)[row + 1]) * 2.0 ** 66
    leaves = [t.requires_grad_() for t in (queries, positives, negatives)]
    loss = ak.multiple_negatives_ranking_loss(queries, positives, (negatives,), scale=20.0, similarity="dot",
                                              **options)
    grads = torch.autograd.grad(loss, leaves)
    exact_leaves = [t.detach().double().requires_grad_() for t in leaves]
    exact_rows = oracle.multiple_negatives_ranking_loss(*exact_leaves[:2], [exact_leaves[2]], scale=20.0,
                                                        similarity="dot", reduction="none", **options)
    exact = exact_rows.mean()
    # row by row: a huge pair's own terms (~1e21, cancelling exactly) would absorb, in one float64 backward, what the
    # ordinary rows add to the same entries of its gradient (the positive's entry along its query: ~7 in 2.5e21)
    per_row = [torch.autograd.grad(row / len(exact_rows), exact_leaves, retain_graph=True) for row in exact_rows]
    exact_grads = [sum(row[k] for row in per_row) for k in range(3)]
    assert 1e20 < exact.item() < 1e23
    assert torch.isfinite(loss) and rel_err(loss, exact) < VALUE_TOL[torch.float32]
    for name, ours, theirs in zip(("queries", "positives", "negatives"), grads, exact_grads):
        assert torch.isfinite(ours).all(), name
        # GTE's doc_to_query entry of a huge pair ties its positive: the exact row loss is log 2, but float64 rounds
        # max + log 2 to max and the reference's softmax there sums to 2 (its gradient is off by the positive row)
        if "query_to_query" not in options.get("directions", ()):
            assert rel_err(ours, theirs) < GRAD_TOL[torch.float32], name


def test_the_finiteness_scan_reads_one_total_and_looks_closer_only_when_it_is_not_finite():
    """inputs._all_finite adds the tensors' sums into one number: NaN or Inf in any tensor makes it non-finite; finite
    tensors whose sums (or the sum of their sums) overflow are then looked at element by element, and pass."""
    big = torch.full((2, 3), 3e37)  # a sum of 1.8e38; two of them past float32's 3.4e38
    bigger = torch.full((4, 3), 3e37)  # its own sum overflows
    assert inputs._all_finite(big) and inputs._all_finite(big, big) and inputs._all_finite(bigger)
    assert inputs._all_finite(big, bigger.double())
    for bad in (float("nan"), float("inf"), float("-inf")):
        spoiled = big.clone()
        spoiled[1, 2] = bad
        assert not inputs._all_finite(big, spoiled) and not inputs._all_finite(spoiled.double(), big)
    assert inputs._all_finite(torch.ones(3), torch.zeros(0))

"""The op contract (angle_kernels.contract), checked once by dispatch for every backend.

Each bad input must raise the same TypeError/ValueError, naming the argument, whichever backend was asked for:
the check runs in `dispatch.Ops` before any backend sees the inputs (backends trust them). Checked here for the
backends that take CPU tensors (torch, and triton under the interpreter); the cuda backend is reached through
the same `dispatch.Ops`.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from angle_kernels.testing.helpers import moved_to

from angle_kernels import contract, dispatch, verified

REPO = Path(__file__).resolve().parents[2]


def _x(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


PAIR_SCORES_CASES = [
    # (args, error type, message fragment)
    (([1.0, 2.0], False), TypeError, "x must be a torch.Tensor"),
    ((_x(4, 8), False), ValueError, "x must have 3 dimensions"),
    ((_x(4, 1, 8), False), ValueError, "K >= 2"),
    ((_x(4, 2, 0), False), ValueError, "D >= 1"),
    ((torch.zeros(4, 2, 8, dtype=torch.int64), False), TypeError, "x must be one of float32"),
    ((_x(4, 2, 7), True), ValueError, "even D"),
    ((_x(4, 2, 8), 1), TypeError, "with_angle must be a bool"),
]

RANKING_CASES = [
    ((_x(5), [1, 2, 3, 4, 5]), TypeError, "labels must be a torch.Tensor"),
    ((_x(5, 1), torch.arange(5)), ValueError, "scores must have 1 dimensions"),
    ((_x(5, dtype=torch.bfloat16), torch.arange(5)), TypeError, "scores must be one of float32, float64"),
    ((_x(5), torch.arange(4)), ValueError, "labels must have the shape of scores"),
    ((_x(5), torch.arange(5) * 1j), TypeError, "labels must be real"),
]


def _xent(**overrides):
    args = dict(q=_x(6, 8), c=None, scale=20.0, target="partner", row_weights=None, exclude_diagonal=True,
                margin=0.0, group_ids=None)
    args.update(overrides)
    return args


SIMILARITY_CASES = [
    (_xent(q=torch.zeros(6, 8, dtype=torch.int32)), TypeError, "q must be one of"),
    (_xent(q=_x(0, 8)), ValueError, "q must be a non-empty"),
    (_xent(q=_x(6, 0)), ValueError, "q must be a non-empty"),
    (_xent(c=_x(0, 8), exclude_diagonal=False), ValueError, "c must be a non-empty [Mc, D=8]"),
    (_xent(c=_x(6, 7), exclude_diagonal=False), ValueError, "c must be a non-empty [Mc, D=8]"),
    (_xent(c=_x(6, 8, dtype=torch.float64), exclude_diagonal=False), TypeError, "c must have q's dtype"),
    (_xent(scale="20"), TypeError, "scale must be a real Python number"),
    (_xent(scale=True), TypeError, "scale must be a real Python number"),
    (_xent(scale=math.inf), ValueError, "scale must be finite"),
    (_xent(scale=-math.inf), ValueError, "scale must be finite"),
    (_xent(margin=4.0), ValueError, "margin must be between 0 and pi"),
    (_xent(margin=-0.1), ValueError, "margin must be between 0 and pi"),
    (_xent(target="rows"), ValueError, "target must be 'partner' or 'diagonal'"),
    (_xent(exclude_diagonal=1), TypeError, "exclude_diagonal must be a bool"),
    (_xent(q=_x(5, 8)), ValueError, "target='partner' needs an even M"),
    (_xent(c=_x(4, 8), exclude_diagonal=False), ValueError, "target='partner' needs an even M <= Mc"),
    (_xent(target="diagonal", c=_x(4, 8), exclude_diagonal=False), ValueError, "target='diagonal' needs M <= Mc"),
    (_xent(target="diagonal", c=_x(5, 8), exclude_diagonal=False), ValueError, "target='diagonal' needs M <= Mc"),
    (_xent(target="diagonal"), ValueError, "would exclude every target column"),
    (_xent(row_weights=torch.ones(6, dtype=torch.int64)), TypeError, "row_weights must be floating point"),
    (_xent(row_weights=torch.ones(5)), ValueError, "row_weights must be [M=6]"),
    (_xent(row_weights=torch.ones(6, 1)), ValueError, "row_weights must have 1 dimensions"),
    (_xent(row_weights=torch.ones(6, requires_grad=True)), TypeError, "row_weights must not require grad"),
    (_xent(group_ids=torch.zeros(6)), TypeError, "group_ids must be an integer tensor"),
    (_xent(group_ids=torch.zeros(6, dtype=torch.bool)), TypeError, "group_ids must be an integer tensor"),
    (_xent(group_ids=torch.zeros(5, dtype=torch.int64)), ValueError, "group_ids must be [M=6]"),
    (_xent(group_ids=torch.zeros(7, dtype=torch.int64)), ValueError, "group_ids must be [M=6]"),
    (_xent(c=_x(6, 8), exclude_diagonal=False, group_ids=torch.arange(6)), ValueError, "only in the symmetric case"),
]


def _lse(**overrides):
    args = dict(q=_x(6, 8), c=_x(10, 8), scale=20.0)
    args.update(overrides)
    return args


def _filtered(**overrides):
    """A similarity_lse call with a false-negative filter (filter_q [6, 4], filter_c [10, 4], threshold [6])."""
    return _lse(**dict(dict(filter_q=_x(6, 4), filter_c=_x(10, 4), filter_threshold=torch.zeros(6)), **overrides))


SIMILARITY_LSE_CASES = [
    (_lse(q=_x(6, 0), c=_x(10, 0)), ValueError, "q and c must be non-empty"),
    (_lse(c=_x(0, 8)), ValueError, "q and c must be non-empty"),
    (_lse(c=_x(10, 7)), ValueError, "q and c must be non-empty"),
    (_lse(c=_x(10, 8, dtype=torch.float64)), TypeError, "c must have q's dtype"),
    (_lse(scale=True), TypeError, "scale must be a real Python number"),
    (_lse(scale=-math.inf), ValueError, "scale must be finite"),
    (_lse(target_offset=-1), ValueError, "target_offset must be >= 0"),
    (_lse(target_offset=True), TypeError, "target_offset must be a Python int"),
    (_lse(period=-1), ValueError, "period must be >= 0"),
    (_lse(period=2.0), TypeError, "period must be a Python int"),
    (_lse(exclude="all"), ValueError, "exclude must be one of"),
    (_lse(penalty="1"), TypeError, "penalty must be a real Python number"),
    (_lse(penalty=math.nan), ValueError, "penalty must be finite"),
    (_lse(penalty_on="target"), ValueError, "penalty_on must be one of"),
    (_lse(filter_keeps_target=1), TypeError, "filter_keeps_target must be a bool"),
    (_lse(normalize=0), TypeError, "normalize must be a bool"),
    (_lse(filter_q=_x(6, 4), filter_c=_x(10, 4)), ValueError, "give all three or none"),
    (_filtered(filter_q=_x(5, 4)), ValueError, "filter_q and filter_c must be [M=6, D'] and [Mc=10, D']"),
    (_filtered(filter_c=_x(10, 5)), ValueError, "filter_q and filter_c must be [M=6, D'] and [Mc=10, D']"),
    (_filtered(filter_threshold=torch.zeros(6, dtype=torch.int64)), ValueError, "filter_threshold must be a float"),
    (_filtered(filter_threshold=torch.zeros(5)), ValueError, "filter_threshold must be a float [M=6]"),
    (_lse(reference=_x(6, 8)), ValueError, "reference is for raw dot products"),
    (_lse(reference=_x(6, 4), normalize=False), ValueError, "reference must have q's shape"),
    (_lse(reference=_x(6, 8, dtype=torch.float64), normalize=False), TypeError, "reference must have q's dtype"),
]


# Every backend, each on its own device (Triton compiled takes CUDA tensors): the checks are the contract's, so
# every backend must refuse alike.
@pytest.mark.parametrize("args, error, fragment", PAIR_SCORES_CASES)
def test_pair_scores_rejects(backend, args, error, fragment):
    with pytest.raises(error, match=re.escape(fragment)):
        dispatch.pair_scores(*moved_to(backend.device, args), backend=backend.name)


@pytest.mark.parametrize("args, error, fragment", RANKING_CASES)
def test_ranking_loss_rejects(backend, args, error, fragment):
    with pytest.raises(error, match=re.escape(fragment)):
        dispatch.ranking_loss(*moved_to(backend.device, args), backend=backend.name)


@pytest.mark.parametrize("kwargs, error, fragment", SIMILARITY_CASES)
def test_similarity_xent_rejects(backend, kwargs, error, fragment):
    with pytest.raises(error, match=re.escape(fragment)):
        dispatch.similarity_xent(**moved_to(backend.device, kwargs), backend=backend.name)


@pytest.mark.parametrize("kwargs, error, fragment", SIMILARITY_LSE_CASES)
def test_similarity_lse_rejects(backend, kwargs, error, fragment):
    with pytest.raises(error, match=re.escape(fragment)):
        dispatch.similarity_lse(**moved_to(backend.device, kwargs), backend=backend.name)


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


DEVICE_CASES = [
    # (op, arguments with one tensor on the meta device, message fragment)
    ("ranking_loss", dict(scores=_x(4), labels=_meta(4)), "labels must be on scores's device cpu"),
    ("similarity_xent", _xent(c=_meta(6, 8), exclude_diagonal=False), "c must be on q's device cpu"),
    ("similarity_xent", _xent(row_weights=_meta(6)), "row_weights must be on q's device cpu"),
    ("similarity_xent", _xent(group_ids=_meta(6, dtype=torch.int64)), "group_ids must be on q's device cpu"),
    ("similarity_lse", _lse(c=_meta(10, 8)), "c must be on q's device cpu"),
    ("similarity_lse", _filtered(filter_q=_meta(6, 4)), "filter_q must be on q's device cpu"),
    ("similarity_lse", _filtered(filter_c=_meta(10, 4)), "filter_c must be on q's device cpu"),
    ("similarity_lse", _filtered(filter_threshold=_meta(6)), "filter_threshold must be on q's device cpu"),
    ("similarity_lse", _lse(reference=_meta(6, 8), normalize=False), "reference must be on q's device cpu"),
]


@pytest.mark.parametrize("op, kwargs, fragment", DEVICE_CASES)
def test_a_tensor_on_another_device_is_refused_by_name(op, kwargs, fragment):
    """A second tensor on another device than the first (a CUDA batch with CPU labels or guide embeddings) is a
    ValueError naming it and both devices, not an error from deep inside a backend."""
    with pytest.raises(ValueError, match=re.escape(fragment) + ", got meta"):
        getattr(dispatch, op)(**kwargs, backend="torch")


def test_the_backend_gets_inputs_in_normal_form(monkeypatch):
    """What the backends may assume: bool labels arrive as int64, group ids as int64, options as Python
    floats and bools."""
    seen = {}

    class Recorder:
        def ranking_loss(self, scores, labels):
            seen["labels"] = labels.dtype
            return scores.sum()

        def similarity_xent(self, q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids, dims):
            seen.update(scale=type(scale), margin=type(margin), group_ids=group_ids.dtype)
            return q.sum()

    recorder = Recorder()
    recorder.features = {"ranking_loss": frozenset(), "similarity_xent": frozenset()}
    ops = dispatch.Ops("recorder", recorder)
    ops.ranking_loss(_x(4), torch.tensor([True, False, True, False]))
    ops.similarity_xent(_x(4, 8), None, 20, "partner", exclude_diagonal=True, margin=0,
                        group_ids=torch.arange(4, dtype=torch.int32))
    assert seen == dict(labels=torch.int64, scale=float, margin=float, group_ids=torch.int64)


def test_similarity_lse_backend_gets_inputs_in_normal_form():
    """What the backends may assume of similarity_lse: its options as Python ints and floats (numpy's integers
    too), the filter embeddings detached (the filter carries no gradient), and the threshold contiguous in the
    filter's compute dtype."""
    import numpy as np

    seen = {}

    class Recorder:
        features = {"similarity_lse": frozenset()}

        def similarity_lse(self, q, c, scale, target_offset, period, exclude, penalty, penalty_on, filter_q,
                           filter_c, filter_threshold, filter_keeps_target, normalize, dims):
            seen.update(scale=type(scale), target_offset=type(target_offset), period=type(period),
                        penalty=type(penalty), filter_requires_grad=(filter_q.requires_grad, filter_c.requires_grad),
                        threshold=(filter_threshold.dtype, filter_threshold.is_contiguous()))
            return q.sum(dim=1)

    q, c = _x(4, 8).requires_grad_(), _x(6, 8).requires_grad_()
    threshold = torch.zeros(4, 2, dtype=torch.float64)[:, 0]
    assert not threshold.is_contiguous()
    dispatch.Ops("recorder", Recorder()).similarity_lse(
        q, c, 20, target_offset=np.int64(1), period=np.int64(2), penalty=1, penalty_on="other", filter_q=q,
        filter_c=c, filter_threshold=threshold)
    assert seen == dict(scale=float, target_offset=int, period=int, penalty=float,
                        filter_requires_grad=(False, False), threshold=(torch.float32, True))


@pytest.mark.parametrize("margin", [0.0, math.pi])
def test_the_margin_may_reach_either_end_of_its_range(margin):
    """margin is in radians, from 0 to pi inclusive: pi pushes every target to cos(pi) = -1."""
    q = _x(6, 8, dtype=torch.float64)
    loss = dispatch.similarity_xent(q, None, 20.0, "partner", exclude_diagonal=True, margin=margin, backend="torch")
    assert torch.isfinite(loss)


def test_resolve_backend_rejects_a_non_tensor():
    with pytest.raises(TypeError, match="torch.Tensors, got list"):
        dispatch.resolve_backend("torch", [[1.0]])


def _csrc_constant(path: str, name: str) -> float:
    text = (REPO / path).read_text()
    match = re.search(rf"constexpr\s+\w+\s+{name}\s*=\s*([0-9.eE+-]+)\s*;", text)
    assert match, f"{name} not found in {path}"
    return float(match.group(1))


def test_the_cuda_sources_use_the_contract_constants():
    """csrc/ cannot import Python: its two copies of the contract's numbers are held equal to them here."""
    assert _csrc_constant("csrc/common.cuh", "kNormEps") == contract.NORM_EPS
    assert _csrc_constant("csrc/similarity_xent.cu", "kSinSqFloor") == contract.MARGIN_SIN_SQUARED_FLOOR


def test_an_optional_feature_the_backend_lacks_goes_elsewhere_under_auto_or_raises(monkeypatch):
    """dims (contract.OPTIONAL_FEATURES) on a backend whose op does not declare it: an explicit backend raises a
    ValueError naming the op and the feature; "auto" computes it on the torch backend even where the backend is
    verified for the op; calls without the feature stay on the backend."""
    calls = []

    class Lacking:
        features = {"pair_scores": frozenset()}
        paths = {"pair_scores": ("full",)}
        code_paths = {"pair_scores": None}

        def pair_scores(self, x, with_angle, dims):
            calls.append(("lacking", dims))
            return x[:, 0, :1], x[:, 0, :1]

    x = _x(3, 2, 8)
    with pytest.raises(ValueError, match="does not implement pair_scores with dims="):
        dispatch.Ops("lacking", Lacking()).pair_scores(x, False, dims=(4, 8))
    monkeypatch.setattr(verified, "is_verified", lambda *args: True)
    monkeypatch.setattr(dispatch, "_warned_auto_on_gpu", True)
    auto = dispatch.AutoOps([dispatch.Ops("lacking", Lacking())], {})
    cos, _ = auto.pair_scores(x, False, dims=[4, 8])
    assert cos.shape == (2, 3, 1) and calls == []  # torch's nested prefixes
    auto.pair_scores(x, False)
    assert calls == [("lacking", None)]
    assert auto.computes("pair_scores", x, False, dims=(4, 8)) == ("torch", "default")


@pytest.mark.parametrize("dims, error, message", [
    ((), TypeError, "non-empty tuple"), ("8", TypeError, "non-empty tuple"), ((4, 4), ValueError, "increasing"),
    ((0, 8), ValueError, r"dims\[0\] must be >= 1"), ((4, 16), ValueError, "width 8"), ((4, 9), ValueError, "width 8"),
    ((3, 8), ValueError, "even widths"), ((4.0, 8), TypeError, "int"),
])
def test_bad_dims_are_refused(dims, error, message):
    with pytest.raises(error, match=message):
        dispatch.pair_scores(_x(3, 2, 8), True, dims, backend="torch")


def test_a_calls_args_are_a_tuple_in_the_fields_order_whatever_their_number():
    """Call.args hands the backends their positional arguments through one attrgetter per class, which gives a
    value, not a tuple, for one name: a call class of one field gets a tuple of one too."""
    from angle_kernels import contract

    class OneField(contract.Call, op="one_field_probe"):
        rows: torch.Tensor

    class TwoFields(contract.Call, op="two_fields_probe"):
        rows: torch.Tensor
        scale: float

    rows = torch.zeros(2)
    assert OneField(rows).args == (rows,)
    one, two = TwoFields(rows, 3.0).args
    assert one is rows and two == 3.0

"""The oracle's judging rule and two of its semantics, pinned by value (angle_kernels/float64_ops.py): every backend
test and `python -m angle_kernels.verify` judge results by `rel_err` against `allowed_error`, so a looser rule or a
blind spot there would pass wrong results everywhere at once."""

from __future__ import annotations

import math

import pytest
import torch

from angle_kernels import float64_ops
from angle_kernels.float64_ops import GRAD_TOL, HALF_RULE_FLOOR, VALUE_TOL, allowed_error, rel_err
from angle_kernels.testing.helpers import generator, randn


def test_rel_err_against_a_zero_reference_is_the_absolute_error_and_nan_fails():
    """A zero reference (a zero gradient, a zero loss) measures ||out||, so a nonzero result fails there; NaN in the
    result gives NaN, which fails every `<=`."""
    assert rel_err(torch.ones(3), torch.zeros(3)) == pytest.approx(math.sqrt(3))
    assert rel_err(torch.zeros(3), torch.zeros(3)) == 0.0
    assert rel_err(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 0.0])) == pytest.approx(4.0 / 3.0)
    assert math.isnan(rel_err(torch.tensor([float("nan"), 1.0]), torch.ones(2)))


def test_allowed_error_is_the_tolerance_or_twice_eagers_error():
    """float64: the tolerance. float32: the tolerance while eager float32 meets it, else the half rule (twice eager's
    error plus the floor). 16-bit: the half rule, which needs eager's error."""
    assert allowed_error(torch.float64, "value", 0.5) == VALUE_TOL[torch.float64]
    assert allowed_error(torch.float32, "value", 8e-6) == VALUE_TOL[torch.float32]
    assert allowed_error(torch.float32, "grad") == GRAD_TOL[torch.float32]
    assert allowed_error(torch.float32, "value", 3e-5) == pytest.approx(2 * 3e-5 + HALF_RULE_FLOOR)
    assert allowed_error(torch.bfloat16, "value", 1e-3) == pytest.approx(2e-3 + HALF_RULE_FLOOR)
    assert allowed_error(torch.float16, "grad", 1e-4) == pytest.approx(2e-4 + HALF_RULE_FLOOR)
    with pytest.raises(ValueError, match="needs eager PyTorch's error"):
        allowed_error(torch.bfloat16, "value")


def test_the_float64_and_float32_tolerances_are_pinned():
    """The tolerances every backend test is judged by, by value: float64 results within a relative 1e-10 (values)
    and 1e-8 (gradients), float32 within 1e-5 and 1e-4; a float64 loss off by a relative 1e-9 fails."""
    assert allowed_error(torch.float64, "value") == 1e-10
    assert allowed_error(torch.float64, "grad") == 1e-8
    assert allowed_error(torch.float32, "value") == 1e-5
    assert allowed_error(torch.float32, "grad") == 1e-4
    reference = torch.tensor([1.5, -0.25, 3.0], dtype=torch.float64)
    assert rel_err(reference * (1 + 1e-11), reference) <= allowed_error(torch.float64, "value")
    assert not rel_err(reference * (1 + 1e-9), reference) <= allowed_error(torch.float64, "value")


def test_the_oracle_computes_in_float64_again_after_computing_in_another_dtype():
    """Eager PyTorch's own error in bf16 (the half rule's baseline) is the oracle's formulas run inside
    computing_in(bf16): after the block, raising or not, they are float64 again (else every later reference were bf16
    and every later check judged against it)."""
    x = randn(generator("computing_in"), 8, 4, dtype=torch.float64)
    exact = float64_ops.similarity_xent(x, None, 20.0, "partner")
    with float64_ops.computing_in(torch.bfloat16):
        assert float64_ops.similarity_xent(x, None, 20.0, "partner").dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="a check failed"), float64_ops.computing_in(torch.bfloat16):
        raise RuntimeError("a check failed")
    again = float64_ops.similarity_xent(x, None, 20.0, "partner")
    assert again.dtype == torch.float64 and torch.equal(again, exact)


@pytest.mark.parametrize("symmetric", [True, False], ids=["c=q", "c given"])
def test_the_oracles_dims_are_its_calls_on_the_truncated_rows_with_every_option(symmetric):
    """similarity_xent with dims is, by the contract, one call per prefix on the truncated rows, every option kept
    (the margin, row weights, group ids, the excluded diagonal)."""
    gen = generator("oracle dims options", symmetric)
    q = randn(gen, 8, 12, dtype=torch.float64)
    c = None if symmetric else randn(gen, 8, 12, dtype=torch.float64)
    options = dict(scale=5.0, target="partner" if symmetric else "diagonal", margin=0.3,
                   row_weights=torch.tensor([1.0, 0.5, 0.0, 1.0, 1.0, 0.5, 1.0, 1.0], dtype=torch.float64),
                   exclude_diagonal=symmetric, group_ids=torch.tensor([0, 1, 2, 0, 3, 3, 4, 5]) if symmetric else None)
    nested = float64_ops.similarity_xent(q, c, dims=(4, 12), **options)
    truncated = [float64_ops.similarity_xent(q[:, :d], None if c is None else c[:, :d], **options) for d in (4, 12)]
    assert torch.equal(nested, torch.stack(truncated))


def test_the_oracles_filter_keeps_a_column_at_its_threshold():
    """similarity_lse's filter removes the columns whose guide score is above the threshold, strictly: a column
    exactly at it stays (guide cosines 1, 0.6 and 0 against a threshold of 0.6: the first column leaves)."""
    q = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    c = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.6, 0.8]], dtype=torch.float64)
    guide_c = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0]], dtype=torch.float64)
    threshold = torch.tensor([0.6], dtype=torch.float64)
    lse = float64_ops.similarity_lse(q, c, 2.0, filter_q=q, filter_c=guide_c, filter_threshold=threshold)
    logits = 2.0 * torch.tensor([1.0, 0.6], dtype=torch.float64)  # the columns at guide cosines 0.6 and 0
    assert float(lse[0]) == pytest.approx(float(torch.logsumexp(logits, 0)), abs=1e-12)


def test_the_reference_module_still_offers_the_float64_ops_and_the_judging_rule():
    """`angle_kernels.reference`, the float64 ops' former home, gives the same functions and rule as float64_ops."""
    from angle_kernels import reference

    for name in ("pair_scores", "ranking_loss", "similarity_xent", "similarity_lse", "allowed_error", "rel_err",
                 "computing_in", "VALUE_TOL", "GRAD_TOL", "HALF_RULE_FLOOR"):
        assert getattr(reference, name) is getattr(float64_ops, name), name

"""The checks every op and loss test judges by, held to their rule with results of known errors:
check_against_oracle (every output and every gradient, the float64 and float32 tolerances, eager
float32's reach, the half-precision rule, the result dtypes, the random weights of the backward), assert_close,
assert_half_rule (infinities beyond a dtype's range, correct rounding as the baseline), and the input functions the
tests draw with. A check that passed a wrong result here would pass it in every test at once."""

from __future__ import annotations

import pytest
import torch

from angle_kernels.testing import oracle
from angle_kernels.testing.helpers import (
    GRAD_TOL,
    VALUE_TOL,
    IgnoresIncomingGradient,
    assert_close,
    assert_half_rule,
    check_against_oracle,
    float64_cannot_resolve,
    fuzz_embeddings,
    generator,
    grads_of,
    huge_row_factors,
    leaf_like,
    randn,
)


def _scores(x):
    """The oracle of these checks: the pair scores (cos, angle) of x [G, K, D]."""
    return oracle.pair_scores(x, True)


def _ours(value_error=0.0, grad_error=0.0, result_dtype=None):
    """An implementation of _scores: the exact scores with a relative error of value_error on every output (its
    gradients exact) and of grad_error on the gradient of x (its values exact), in the compute dtype (float64 for
    float64 inputs, else float32) or `result_dtype`."""
    def ours(x):
        x64 = x.double()
        x64 = x64 + grad_error * (x64 - x64.detach())  # the same values, the gradient times 1 + grad_error
        dtype = result_dtype or (torch.float64 if x.dtype == torch.float64 else torch.float32)
        return tuple((o + value_error * o.detach()).to(dtype) for o in oracle.pair_scores(x64, True))
    return ours


def _inputs(dtype):
    return [randn(generator("check_against_oracle", str(dtype)), 3, 2, 8, dtype=dtype)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_check_against_oracle_passes_the_exact_result(dtype):
    check_against_oracle(_ours(), _scores, _inputs(dtype), "exact")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", ["value", "grad"])
def test_check_against_oracle_fails_a_value_or_a_gradient_beyond_the_tolerance(dtype, kind):
    """A result off by 3x the tolerance fails, whether in its values or in its gradients alone (eager float32 meets
    the float32 tolerances here, so they hold)."""
    tolerance = (VALUE_TOL if kind == "value" else GRAD_TOL)[dtype]
    error = {f"{kind}_error": 3 * tolerance}
    with pytest.raises(AssertionError, match="output" if kind == "value" else "gradient of input 0"):
        check_against_oracle(_ours(**error), _scores, _inputs(dtype), f"{kind} off")
    check_against_oracle(_ours(**{f"{kind}_error": 0.3 * tolerance}), _scores, _inputs(dtype), f"{kind} within")


def _with_eager_float32_error(error):
    """_scores, but computed in float32 (inside computing_in(float32): eager float32) with a relative error
    `error`: an eager float32 whose own error is known."""
    def scores(x):
        cos, angle = oracle.pair_scores(x, True)
        if oracle.current_dtype() == torch.float32:
            return cos * (1 + error), angle * (1 + error)
        return cos, angle
    return scores


def test_check_against_oracle_holds_float32_to_the_tolerance_that_eager_float32_meets():
    """Eager float32 within the value tolerance (8e-6 of 1e-5): a result off by 1.5e-5 fails, though twice eager's
    error would allow it; the half-precision rule applies in float32 only where eager float32 misses the tolerance
    too (then a result within twice its error passes)."""
    x = _inputs(torch.float32)
    with pytest.raises(AssertionError, match="which eager float32 meets"):
        check_against_oracle(_ours(value_error=1.5e-5), _with_eager_float32_error(8e-6), x, "eager within")
    check_against_oracle(_ours(value_error=3e-5), _with_eager_float32_error(2e-5), x, "eager beyond")
    with pytest.raises(AssertionError, match="exceeds 2x the error of eager"):
        check_against_oracle(_ours(value_error=5e-5), _with_eager_float32_error(2e-5), x, "beyond twice eager")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_check_against_oracle_holds_16_bit_results_to_twice_eagers_error(dtype):
    """A 16-bit result passes within twice eager PyTorch's own error in that dtype (its outputs' smallest: 1.5x),
    and fails beyond it (3x its largest)."""
    x = _inputs(dtype)
    exact = _scores(x[0].double())
    with oracle.computing_in(dtype):
        eager = _scores(x[0])
    errors = [oracle.rel_err(e, w) for e, w in zip(eager, exact)]
    assert min(errors) > 1e-5
    check_against_oracle(_ours(value_error=1.5 * min(errors)), _scores, x, "1.5x eager")
    with pytest.raises(AssertionError, match="exceeds 2x the error of eager"):
        check_against_oracle(_ours(value_error=3 * max(errors)), _scores, x, "3x eager")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_check_against_oracle_fails_a_result_in_another_dtype(dtype):
    """Outputs come in the compute dtype: float64 for float64 inputs, float32 for the others."""
    other = torch.float32 if dtype == torch.float64 else torch.float64
    with pytest.raises(AssertionError, match=f"output 0: {other} for {dtype} inputs"):
        check_against_oracle(_ours(result_dtype=other), _scores, _inputs(dtype), "dtype")


def test_check_against_oracle_fails_a_backward_that_ignores_its_incoming_gradient():
    """Each output is weighted by fixed random weights before the backward: a backward right only for a plain
    sum of the outputs (loss.backward()) fails."""
    def ours(x):
        return tuple(IgnoresIncomingGradient.apply(o) for o in oracle.pair_scores(x, True))

    with pytest.raises(AssertionError, match="gradient of input 0"):
        check_against_oracle(ours, _scores, _inputs(torch.float64), "cotangent")


def test_assert_close_holds_the_relative_tolerance_and_the_shape():
    ref = torch.tensor([1.5, -0.25, 3.0], dtype=torch.float64)
    assert_close(ref * (1 + 0.5e-6), ref, 1e-6, "within")
    with pytest.raises(AssertionError, match="relative error"):
        assert_close(ref * (1 + 2e-6), ref, 1e-6, "beyond")
    assert_close(ref + 1e-9, ref, 0.0, "atol", atol=1e-8)
    with pytest.raises(AssertionError, match="shape mismatch"):
        assert_close(torch.full((3,), 2.0), torch.tensor([2.0]), 1e-6, "broadcast")


def test_assert_half_rule_wants_infinities_beyond_the_dtypes_range():
    """An exact value beyond float16's range (1e6) must come back as an infinity of its sign, not as the largest
    finite float16."""
    exact = torch.tensor([1e6, -1e6, 1.0], dtype=torch.float64)
    assert_half_rule(torch.tensor([float("inf"), float("-inf"), 1.0], dtype=torch.float16), None, exact, "inf")
    with pytest.raises(AssertionError, match="infinities of the exact value's sign"):
        assert_half_rule(torch.tensor([65504.0, -65504.0, 1.0], dtype=torch.float16), None, exact, "finite")


def test_assert_half_rule_without_eager_takes_correct_rounding_to_the_outputs_dtype():
    """Without an eager baseline, a float16 result is held to float16's own rounding: 1 + 2^-9 is a float16 value,
    so 1.0 (within bfloat16's rounding of it) fails."""
    exact = torch.tensor([1.0 + 2.0**-9], dtype=torch.float64)
    assert_half_rule(exact.to(torch.float16), None, exact, "rounded")
    with pytest.raises(AssertionError, match="correct rounding to torch.float16"):
        assert_half_rule(torch.tensor([1.0], dtype=torch.float16), None, exact, "bfloat16's rounding")


def test_leaf_like_keeps_the_strides_and_values_of_its_input():
    """The op tests' non-contiguous inputs reach the op as they are: a transposed input stays transposed."""
    x = randn(generator("leaf_like"), 4, 3, dtype=torch.float32).t()
    leaf = leaf_like(x)
    assert leaf.stride() == x.stride() and torch.equal(leaf, x) and leaf.requires_grad and leaf.is_leaf
    wide = leaf_like(x, dtype=torch.float64)
    assert wide.dtype == torch.float64 and wide.stride() == x.stride()


def test_grads_of_gives_each_inputs_gradient_and_zeros_for_an_unused_one():
    x, y = torch.tensor([1.0, -2.0]), torch.tensor([3.0])
    value, (gx, gy) = grads_of(lambda a, b: (a * a).sum(), x, y)
    assert float(value) == 5.0 and torch.equal(gx, 2 * x) and torch.equal(gy, torch.zeros(1))


def test_the_inputs_drawn_hold_collinear_pairs_and_unscaled_rows():
    """fuzz_embeddings makes row 1 row 0 halved for one seed in five; huge_row_factors leaves every fifth row at 1,
    so that huge and ordinary rows meet; float64_cannot_resolve flags only losses in (0, 1e-6)."""
    collinear = fuzz_embeddings(10, 4, 6, 1.0, torch.float64)
    assert torch.equal(collinear[1], collinear[0] * 0.5)
    assert not torch.equal(fuzz_embeddings(11, 4, 6, 1.0, torch.float64)[1], collinear[0] * 0.5)
    factors = huge_row_factors(torch.zeros(7, 3), 2.0**64)
    assert factors.shape == (7, 1) and factors[:, 0].tolist() == [1.0, 2.0**64, 2.0**64, 2.0**64, 2.0**64, 1.0,
                                                                  2.0**64]
    assert [float64_cannot_resolve(torch.tensor(v)) for v in (0.0, 1e-7, 1e-5)] == [False, True, False]

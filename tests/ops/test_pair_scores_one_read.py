"""The Triton pair scores of every prefix in one read (triton_ops/_pair_scores_one_read.py) against the float64
oracle: outputs and gradients, through the interpreter on CPU (on the GPU when there is one).

Every dtype (float64, float32 at the suite's tolerances, bfloat16 and float16 at the half-precision rule), with and
without the angle, at odd widths, prefixes that are not multiples of the vector width, a single prefix, dims ending
before D (zero gradient past d_k) and at D, slices wider than one vector (1,024 lanes), and rows whose squares
overflow the compute dtype with their largest entries in a later slice (the running scale). Tiny sizes: the
interpreter runs each program in Python, and there a case runs on two of its groups (testing.helpers.pair_groups: one
program per group, each the same work) with its own K, D, dims and dtype, the compiled run's kernel specialisations.
"""

from __future__ import annotations

import pytest
import torch

from angle_kernels.testing import oracle
from angle_kernels.testing.helpers import (
    HALF_DTYPES,
    HUGE_OP_MAGNITUDES,
    TRITON_DEVICE,
    check_against_oracle,
    generator,
    huge_magnitude_id,
    huge_row_factors,
    pair_groups,
    randn,
)

pytest.importorskip("triton")

from angle_kernels.triton_ops._pair_scores_one_read import pair_scores as pair_scores_one_read

INTERPRETED = TRITON_DEVICE.type == "cpu"

CASES = [  # (G, K, D, dims)
    (1, 2, 2, (2,)),  # a single prefix, the full width, the smallest even D
    (6, 2, 30, (6, 18, 30)),  # zigzag pairs, prefixes not multiples of the 16-lane vector
    (5, 3, 20, (2, 4, 6, 10, 20)),  # format C triples, k = 5, slices of width 2
    (4, 4, 22, (8, 14)),  # K = 4, the last columns in no prefix: zero gradient
    (2, 2, 2100, (20, 2060)),  # a slice wider than one vector (1,024 lanes), 40 columns past d_k
]


def _groups(groups):
    return pair_groups(groups, INTERPRETED)


def _ours(with_angle, dims):
    return lambda x: pair_scores_one_read(x, with_angle, dims)


def _oracle(with_angle, dims):
    """k truncated oracle calls, stacked: ([k, G, K-1], [k, G, K-1])."""
    def scores(x):
        per_prefix = [oracle.pair_scores(x[..., :d], with_angle) for d in dims]
        return torch.stack([c for c, _ in per_prefix]), torch.stack([a for _, a in per_prefix])
    return scores


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, *HALF_DTYPES], ids=str)
@pytest.mark.parametrize("with_angle", [True, False], ids=["angle", "cos_only"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_prefixes_against_oracle(case, with_angle, dtype):
    groups, k, width, dims = case
    x = randn(generator("one_read", case, dtype), _groups(groups), k, width, dtype=dtype)
    check_against_oracle(_ours(with_angle, dims), _oracle(with_angle, dims), [x], f"one read {case}",
                         device=TRITON_DEVICE)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, *HALF_DTYPES], ids=str)
@pytest.mark.parametrize("dims", [(1, 3), (3, 5, 9), (7,)])
def test_odd_widths_without_angle(dims, dtype):
    x = randn(generator("one_read_odd", dims, dtype), _groups(6), 3, 9, dtype=dtype)
    outputs, _ = check_against_oracle(_ours(False, dims), _oracle(False, dims), [x], f"one read dims={dims}",
                                      device=TRITON_DEVICE)
    assert torch.count_nonzero(outputs[1]) == 0  # the angle output is zeros without the angle


def test_equals_the_prefix_kernels():
    """The same scores and gradients as pair_scores.py's prefix kernels, to rounding (float64)."""
    from angle_kernels.triton_ops.pair_scores import PrefixPairScoresFunction

    dims = (4, 10, 24)
    x = randn(generator("one_read_vs_prefix"), _groups(5), 3, 26, dtype=torch.float64).to(TRITON_DEVICE)
    results = []
    for function in (lambda t: pair_scores_one_read(t, True, dims),
                     lambda t: PrefixPairScoresFunction.apply(t, True, dims)):
        leaf = x.clone().requires_grad_()
        cos, angle = function(leaf)
        weights = torch.linspace(-1, 1, cos.numel(), dtype=cos.dtype, device=cos.device).view_as(cos)
        (cos * weights + 0.5 * angle).sum().backward()
        results.append((cos.detach(), angle.detach(), leaf.grad))
    for ours, theirs in zip(*results):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)


def _huge_base(shape, dtype):
    """Ordinary rows whose last slice is 2^10 larger: a later slice raises the running scale exponent."""
    x = randn(generator("one_read_huge", shape, dtype), *shape, dtype=torch.float64)
    x[..., -4:] *= 2.0**10
    x[..., 2:3] *= 2.0**5
    return x.to(dtype)


@pytest.mark.parametrize("dtype, magnitude", HUGE_OP_MAGNITUDES, ids=[huge_magnitude_id(c) for c in HUGE_OP_MAGNITUDES])
@pytest.mark.parametrize("with_angle", [True, False], ids=["angle", "cos_only"])
def test_huge_rows(with_angle, dtype, magnitude):
    """Rows around 1.8e19 (float32, bfloat16) and 1e300 (float64): the oracle's scores of the ordinary rows and
    gradients (the factors inside the function)."""
    dims = (2, 6, 12)
    x = _huge_base((_groups(5), 3, 12), dtype)
    check_against_oracle(lambda t: pair_scores_one_read(t * huge_row_factors(t, magnitude), with_angle, dims),
                         _oracle(with_angle, dims), [x], f"one read huge x{magnitude:g}", device=TRITON_DEVICE)


def test_no_groups():
    x = torch.zeros(0, 2, 8, device=TRITON_DEVICE, requires_grad=True)
    cos, angle = pair_scores_one_read(x, True, (4, 8))
    assert cos.shape == angle.shape == (2, 0, 1)
    (cos.sum() + angle.sum()).backward()
    assert x.grad.shape == x.shape

"""pair_scores(x, with_angle[, dims]) on every backend against the float64 oracle: outputs and gradients.

The backward gets fixed random cotangents for both outputs (angle_kernels.testing.helpers.cotangent). float64 and
float32 at the tolerances of angle_kernels.testing.helpers, bfloat16 and float16 at the half-precision rule.
Shapes: one group, zigzag pairs, format C triples, K = 4, odd and non-power-of-two D, D longer than one Triton
block, more groups than one chunk of the torch backend. Every output must be finite: under pytest the Triton
launchers fill their outputs with NaN before the kernels run, so an element never written fails. Through the Triton
interpreter a case runs on two of its groups (testing.helpers.pair_groups: one program per group, each the same
work), with its own K, D, dims and dtype: the same kernel specialisations as the compiled run's full case.
"""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck

from angle_kernels.testing import oracle
from angle_kernels.testing.helpers import (
    GRAD_TOL, HALF_DTYPES, HUGE_OP_MAGNITUDES, VALUE_TOL, assert_close, assert_half_rule, check_against_oracle,
    generator, huge_magnitude_id, huge_row_factors, leaf_like, outputs_and_grads, pair_groups, randn,
    skip_unless_feature,
)

SHAPES = [  # (G, K, D)
    (1, 2, 2),  # a single pair, the smallest even D
    (37, 2, 130),  # zigzag pairs, D not a power of two
    (5, 3, 6),  # format C: [query, positive, negative]
    (7, 4, 18),  # K = 4: the anchor accumulates three pairs' gradients
    (3, 2, 2060),  # D / 2 = 1030 > 1024: the Triton kernels loop over two blocks
    (5, 3, 64),  # the CUDA kernels' vector path (contiguous rows, D a multiple of twice the 16-byte vector)
]


def _here(backend, shape):
    """`shape` (G, K, D) with the number of groups the backend runs it on (pair_groups)."""
    groups, *rest = shape
    return (pair_groups(groups, backend.interpreted), *rest)


def _ops(backend, with_angle):
    return lambda x: backend.ops.pair_scores(x, with_angle)


def _oracle(with_angle):
    return lambda x: oracle.pair_scores(x, with_angle)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("with_angle", [True, False], ids=["angle", "cos_only"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_against_oracle(backend, shape, with_angle, dtype):
    x = randn(generator("pair_scores", shape, dtype), *_here(backend, shape), dtype=dtype)
    check_against_oracle(_ops(backend, with_angle), _oracle(with_angle), [x], f"pair_scores{shape}",
                         device=backend.device)


@pytest.mark.parametrize("dim", [3, 33, 1025])  # not D = 1: every cosine is +-1, its gradient is 0
def test_odd_dimension_without_angle_on_zigzag_rows(backend, dim):
    """Odd D is legal without the angle (the angle output is then all zeros); zigzag rows [2N, D] as a view."""
    pairs = pair_groups(11, backend.interpreted)
    y_pred = randn(generator("odd_dim", dim), 2 * pairs, dim)
    outputs, _ = check_against_oracle(lambda y: backend.ops.pair_scores(y.view(pairs, 2, dim), False),
                                      lambda y: oracle.pair_scores(y.view(pairs, 2, dim), False), [y_pred],
                                      f"pair_scores D={dim}", device=backend.device)
    assert torch.count_nonzero(outputs[1]) == 0


# The CUDA kernels take 16-byte vector loads where the rows are contiguous and D is a multiple of twice the vector
# (8 bf16/fp16 elements): D = 130 takes their strided path, 128 and 2,064 (258 vectors, not a multiple of a warp's
# step) the vector path.
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("with_angle", [True, False], ids=["angle", "cos_only"])
@pytest.mark.parametrize("shape", [(32, 3, 130), (32, 3, 128), (3, 2, 2064)], ids=str)
def test_half_precision(backend, shape, with_angle, dtype):
    """bf16/fp16 inputs: float32 scores, gradients in the input dtype, within 2x eager's own error."""
    x = randn(generator("half", dtype, shape), *_here(backend, shape), dtype=dtype)
    check_against_oracle(_ops(backend, with_angle), _oracle(with_angle), [x], f"pair_scores {dtype}",
                         device=backend.device)


@pytest.mark.parametrize("layout", ["strided_d", "group_minor", "every_dim"])
def test_non_contiguous_input(backend, layout):
    gen, groups = generator("layout", layout), pair_groups(9, backend.interpreted)
    if layout == "strided_d":  # every other element of a wider tensor
        x = randn(gen, groups, 3, 68)[:, :, ::2]
    elif layout == "group_minor":  # groups move fastest after D
        x = randn(gen, 3, groups, 34).transpose(0, 1)
    else:  # no dimension has its contiguous stride
        x = randn(gen, 2 * groups, 3, 34)[::2].transpose(0, 1).contiguous().transpose(0, 1)
    assert not x.is_contiguous()
    check_against_oracle(_ops(backend, True), _oracle(True), [x], f"pair_scores {layout}", device=backend.device)


def test_more_groups_than_one_chunk(backend):
    """4.2M elements: the torch backend works through the groups in several chunks of 4M elements."""
    if backend.interpreted:
        pytest.skip("about 45 s in the Triton interpreter (2,048 programs of D = 1030): runs when compiled")
    x = randn(generator("chunks"), 2048, 2, 1030)
    check_against_oracle(_ops(backend, True), _oracle(True), [x], "pair_scores in chunks", device=backend.device)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_zero_vectors(backend, dtype):
    """A zero vector has cosine 0 with everything (its norm is clamped to eps) and a finite gradient: about
    |g| / eps = 1e12 for a zero vector paired with a non-zero one, 0 in an all-zero group. The huge rows and the
    others are compared apart (one error over the whole tensor would only see the huge rows)."""
    x = randn(generator("zero", dtype), 6, 3, 8, dtype=dtype)
    x[1, 0] = 0.0  # a zero anchor
    x[3, 2] = 0.0  # a zero partner
    x[4] = 0.0  # an all-zero group
    (cos, angle), (dx,) = outputs_and_grads(_ops(backend, True), [leaf_like(x, device=backend.device)])
    (exact_cos, exact_angle), (exact_dx,) = outputs_and_grads(_oracle(True), [leaf_like(x, dtype=torch.float64)])
    assert_close(cos, exact_cos, VALUE_TOL[dtype], "cos")
    assert_close(angle, exact_angle, VALUE_TOL[dtype], "angle")
    huge = torch.zeros(6, 3, dtype=torch.bool)
    huge[1, 0] = huge[3, 2] = True
    assert_close(dx[huge], exact_dx[huge], GRAD_TOL[dtype], "dx of the zero vectors beside non-zero ones")
    assert_close(dx[~huge], exact_dx[~huge], GRAD_TOL[dtype], "dx of the other rows")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_rows_shorter_than_eps(backend, dtype):
    """Rows of norm 5e-13 and 3e-13, below eps = 1e-12 but not zero: their norm is clamped to eps, so the norm's own
    gradient (the radial term) is 0 for them and not for their partners: a gradient that kept their radial term was
    6.7% off the oracle (the zero rows of test_zero_vectors have no radial term either way)."""
    x = randn(generator("below eps", dtype), 4, 3, 8, dtype=dtype)
    x[1, 2] *= 5e-13 / x[1, 2].norm()  # a partner
    x[2, 0] *= 3e-13 / x[2, 0].norm()  # an anchor
    (cos, angle), (dx,) = outputs_and_grads(_ops(backend, True), [leaf_like(x, device=backend.device)])
    (exact_cos, exact_angle), (exact_dx,) = outputs_and_grads(_oracle(True), [leaf_like(x, dtype=torch.float64)])
    assert_close(cos, exact_cos, VALUE_TOL[dtype], "cos")
    assert_close(angle, exact_angle, VALUE_TOL[dtype], "angle")
    for group, row in ((1, 2), (2, 0)):
        assert_close(dx[group, row], exact_dx[group, row], GRAD_TOL[dtype], f"dx of row {row} of group {group}")
    assert_close(dx, exact_dx, GRAD_TOL[dtype], "dx")


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # NumPy, under the interpreter
def test_float16_zero_partner_overflows_to_infinity_not_nan(backend):
    """In float16 a zero partner's true gradient (~1e12) is beyond the dtype's range: +-inf is the right answer
    there, NaN never is; every other row keeps its precision. Eager float16 cannot compute this input at all (its
    epsilon underflows to 0 and gives NaN), so the rule's baseline is correct rounding (see assert_half_rule)."""
    x = randn(generator("fp16_zero"), *_here(backend, (16, 2, 64)), dtype=torch.float16)
    x[0, 1] = 0.0
    (cos, angle), (dx,) = outputs_and_grads(_ops(backend, True), [leaf_like(x, device=backend.device)])
    (exact_cos, exact_angle), (exact_dx,) = outputs_and_grads(_oracle(True), [leaf_like(x, dtype=torch.float64)])
    assert torch.isinf(dx[0, 1]).any(), "the zero partner's gradient is expected to overflow float16"
    assert_half_rule(dx, None, exact_dx, "dx")
    assert_half_rule(cos, None, exact_cos, "cos")
    assert_half_rule(angle, None, exact_angle, "angle")


@pytest.mark.parametrize("k,dim,with_angle", [(2, 6, True), (3, 8, True), (2, 6, False), (3, 9, False)])
def test_gradcheck(backend, k, dim, with_angle):
    """Finite differences in float64 against the backward pass (random inputs: no zero vectors, where the
    norm's clamp is not differentiable)."""
    x = leaf_like(randn(generator("gradcheck", k, dim), *_here(backend, (4, k, dim)), dtype=torch.float64),
                  device=backend.device)
    assert gradcheck(_ops(backend, with_angle), (x,), eps=1e-6, atol=1e-6, rtol=1e-4,
                     fast_mode=backend.name == "triton")


# ---- nested prefixes (dims, Matryoshka): every prefix from one call, exactly k calls on the truncated inputs
PREFIX_CASES = [  # (G, K, D, dims)
    (1, 2, 2, (2,)),  # a single prefix, the full width
    (11, 2, 130, (8, 64, 130)),  # pairs, D not a power of two (Triton: a program per group, each the same work)
    (5, 3, 20, (2, 4, 6, 10, 20)),  # format C triples, many prefixes, width 2
    (7, 4, 18, (6, 12)),  # K = 4, the last columns in no prefix: zero gradient
    (3, 2, 2060, (256, 1030, 2060)),  # prefixes longer than one Triton block
]


def _prefix_ops(backend, with_angle, dims):
    return lambda x: backend.ops.pair_scores(x, with_angle, dims)


def _prefix_oracle(with_angle, dims):
    """The oracle of k truncated calls, stacked: ([k, G, K-1], [k, G, K-1])."""
    def scores(x):
        per_prefix = [oracle.pair_scores(x[..., :d], with_angle) for d in dims]
        return torch.stack([c for c, _ in per_prefix]), torch.stack([a for _, a in per_prefix])
    return scores


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, *HALF_DTYPES], ids=str)
@pytest.mark.parametrize("with_angle", [True, False], ids=["angle", "cos_only"])
@pytest.mark.parametrize("case", PREFIX_CASES, ids=str)
def test_prefixes_against_oracle(backend, case, with_angle, dtype):
    skip_unless_feature(backend, "pair_scores", "dims")
    groups, k, width, dims = case
    x = randn(generator("pair_scores_dims", case, dtype), *_here(backend, (groups, k, width)), dtype=dtype)
    check_against_oracle(_prefix_ops(backend, with_angle, dims), _prefix_oracle(with_angle, dims), [x],
                         f"pair_scores{case}", device=backend.device)


@pytest.mark.parametrize("dims", [(1, 3), (3, 5, 9)])
def test_prefixes_of_odd_width_without_angle(backend, dims):
    skip_unless_feature(backend, "pair_scores", "dims")
    x = randn(generator("pair_scores_dims_odd", dims), *_here(backend, (6, 2, 9)), dtype=torch.float64)
    check_against_oracle(_prefix_ops(backend, False, dims), _prefix_oracle(False, dims), [x], f"dims={dims}",
                         device=backend.device)


def test_prefixes_gradcheck(backend):
    skip_unless_feature(backend, "pair_scores", "dims")
    x = randn(generator("pair_scores_dims_gradcheck"), *_here(backend, (3, 3, 8)),
              dtype=torch.float64).to(backend.device)
    assert gradcheck(lambda t: backend.ops.pair_scores(t, True, (2, 4, 8)), [x.requires_grad_()], eps=1e-6,
                     atol=1e-6, fast_mode=backend.name == "triton")  # the interpreter: a projection, not 13 s


# ---- rows whose squared norms overflow the compute dtype (finite inputs): scaled by powers of two, same answers
def _huge_base(shape, dtype, key):
    """Ordinary rows whose last columns are 2^10 larger, so that a row's largest entries come in a later block of
    the kernels' sweep (the online rescale of what the earlier blocks summed)."""
    x = randn(generator("huge", key, shape, dtype), *shape, dtype=torch.float64)
    width = shape[-1]
    x[..., min(1024, width // 2):width // 2] *= 2.0**10  # the last columns of the first half (angle: halves swept)
    x[..., -max(1, width % 1024 if width > 1024 else width // 3):] *= 2.0**10  # the last block of the row
    return x.to(dtype)


def _huge(fn, magnitude):
    """fn on its input multiplied row by row by huge powers of two (huge_row_factors), inside the function."""
    return lambda x: fn(x * huge_row_factors(x, magnitude))


@pytest.mark.parametrize("dtype, magnitude", HUGE_OP_MAGNITUDES, ids=[huge_magnitude_id(c) for c in HUGE_OP_MAGNITUDES])
@pytest.mark.parametrize("with_angle", [True, False], ids=["angle", "cos_only"])
@pytest.mark.parametrize("shape", [(5, 3, 6), (3, 2, 2060), (5, 3, 64)], ids=str)
def test_huge_rows(backend, shape, with_angle, dtype, magnitude):
    """Rows around 1.8e19 (float32, bfloat16: their squares overflow) and 1e300 (float64) give the oracle's scores
    of the ordinary rows (cosines are scale-invariant per row) and gradients (the factors inside the function)."""
    x = _huge_base(_here(backend, shape), dtype, "full")
    check_against_oracle(_huge(_ops(backend, with_angle), magnitude), _oracle(with_angle), [x],
                         f"pair_scores{shape} x{magnitude:g}", device=backend.device)


@pytest.mark.parametrize("with_angle", [True, False], ids=["angle", "cos_only"])
def test_a_zero_prefix_of_a_huge_row(backend, with_angle):
    """A float64 row whose last 4 of 8 entries are near 2^1000 and whose first 4 (the first prefix) are zero: its
    scores are 0 and its gradients finite (the torch backend's were NaN: the clamped norm's inverse squared is inf,
    and the mask multiplied it), against the same rows with that row's tail ordinary: every score equal (cosines are
    scale-invariant), and the zero prefix's gradient the clamped row's, u_hat / eps, whatever the rest of the row
    holds, on the backends that scale each prefix by its own power of two (Triton's kernels). The torch backend
    scales the row once for every prefix, and clamps the prefix's norm to eps times that scale floored at the
    smallest normal (normalisation.scaled_eps; eps * 2^-1000 is subnormal): 2^-22 rather than 1e-12, a gradient
    2.4e5 times smaller (docs/gpu-runs.md, "dims on rows whose tail dwarfs the prefix")."""
    skip_unless_feature(backend, "pair_scores", "dims")
    ordinary = randn(generator("zero prefix", "huge"), 3, 2, 8, dtype=torch.float64)
    ordinary[1, 1, :4] = 0.0
    huge = ordinary.clone()
    huge[1, 1, 4:] *= 2.0**1000
    results = []
    for x in (ordinary, huge):
        (cos, angle), (dx,) = outputs_and_grads(_prefix_ops(backend, with_angle, (4, 8)),
                                                [leaf_like(x, device=backend.device)])
        results.append((cos.cpu(), angle.cpu(), dx.cpu()))
    (cos, angle, dx), (huge_cos, huge_angle, huge_dx) = results
    assert torch.isfinite(huge_dx).all()
    assert_close(huge_cos, cos, 1e-12, "scores")
    assert_close(huge_angle, angle, 1e-12, "angle scores")
    if backend.name == "torch":
        pytest.xfail("one scale per row for every prefix: the zero prefix's clamp is 2^-22, not eps")
    assert_close(huge_dx[1, 1, :4], dx[1, 1, :4], 1e-12, "the zero prefix's gradient")


@pytest.mark.parametrize("dtype, magnitude", HUGE_OP_MAGNITUDES[:2], ids=[huge_magnitude_id(c) for c in
                                                                          HUGE_OP_MAGNITUDES[:2]])
@pytest.mark.parametrize("with_angle", [True, False], ids=["angle", "cos_only"])
def test_prefixes_of_huge_rows(backend, with_angle, dtype, magnitude):
    skip_unless_feature(backend, "pair_scores", "dims")
    x = _huge_base(_here(backend, (5, 3, 12)), dtype, "dims")
    dims = (2, 6, 12)
    check_against_oracle(_huge(_prefix_ops(backend, with_angle, dims), magnitude), _prefix_oracle(with_angle, dims),
                         [x], f"pair_scores dims={dims} x{magnitude:g}", device=backend.device)

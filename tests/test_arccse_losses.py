"""ArcCSE: arccon_loss (ArcCon, an additive angular margin on the positive), triplet_loss and ArcCSELoss.

No reference code exists: the oracle (angle_kernels.testing.oracle) transcribes the paper, ArcCon with arccos directly.
Against it on every backend, then over sizes, margins (0 to 179 degrees, and past pi), taus on the default
backend in float32 and float64, bf16/fp16 at the half rule; gradcheck in float64 and hypothesis fuzzing.
Tolerances and the half-precision rule: angle_kernels.testing.helpers.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from torch.autograd import gradcheck

import angle_kernels as ak
from angle_kernels.testing import oracle
from angle_kernels.testing.helpers import (
    FUZZ, HALF_DTYPES, check_against_oracle, float64_cannot_resolve, fuzz_embeddings, generator, leaf_like, randn,
)

DTYPES = [torch.float64, torch.float32]


def _views(gen, n, d, dtype=torch.float32, noise=2.0):
    """Two correlated views of n sentences (positive cosine ~0.45 at noise 2): well inside (-1, 1)."""
    h1 = randn(gen, n, d, dtype=torch.float64)
    h2 = h1 + noise * randn(gen, n, d, dtype=torch.float64)
    return h1.to(dtype), h2.to(dtype)


# --------------------------------------------------------------------------------------------------------
# against the oracle
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_every_backend(backend, dtype):
    gen = generator("arccse_backends", dtype)
    h1, h2 = _views(gen, 13, 34, dtype)
    anchor, weak, strong = (randn(gen, 11, 34, dtype=dtype) for _ in range(3))
    device, name = backend.device, backend.name
    check_against_oracle(lambda a, b: ak.arccon_loss(a, b, 10.0, 0.05, backend=name),
                         lambda a, b: oracle.arccon_loss(a, b, 10.0, 0.05), [h1, h2], f"arccon on {name}",
                         device=device)
    check_against_oracle(lambda a, w, s: ak.triplet_loss(a, w, s, 0.1, backend=name),
                         lambda a, w, s: oracle.triplet_loss(a, w, s, 0.1), [anchor, weak, strong],
                         f"triplet on {name}", device=device)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,d", [(1, 2), (3, 6), (37, 130), (300, 768)])
@pytest.mark.parametrize("margin_degrees", [0.0, 10.0, 90.0, 179.0, 180.0])  # the range is 0 to 180, inclusive
def test_arccon_loss(gen, n, d, margin_degrees, dtype):
    h1, h2 = _views(gen, n, d, dtype)
    for tau in (0.05, 1.0):
        check_against_oracle(lambda a, b: ak.arccon_loss(a, b, margin_degrees, tau),
                             lambda a, b: oracle.arccon_loss(a, b, margin_degrees, tau), [h1, h2],
                             f"arccon margin={margin_degrees} tau={tau}")


def test_arccon_defaults_are_ten_degrees_and_tau_005(gen):
    h1, h2 = _views(gen, 37, 64)
    check_against_oracle(lambda a, b: ak.arccon_loss(a, b), lambda a, b: oracle.arccon_loss(a, b, 10.0, 0.05),
                         [h1, h2], "arccon defaults")
    without_margin = oracle.arccon_loss(h1, h2, 0.0, 0.05)
    assert abs(ak.arccon_loss(h1, h2).item() - without_margin.item()) > 1e-3 * without_margin.item()  # it acts


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_arccon_margin_past_pi(gen, dtype):
    """theta + margin > pi pins the positive logit at cos(pi) = -1 (and its gradient at 0)."""
    h1 = randn(gen, 37, 64, dtype=torch.float64)
    h2 = -h1 + 0.01 * randn(gen, 37, 64, dtype=torch.float64)  # theta within ~1 degree of 180
    h2[::2] = randn(gen, 19, 64, dtype=torch.float64)  # half the rows ordinary
    check_against_oracle(lambda a, b: ak.arccon_loss(a, b, 10.0, 0.05),
                         lambda a, b: oracle.arccon_loss(a, b, 10.0, 0.05), [h1.to(dtype), h2.to(dtype)],
                         "arccon past pi")


def test_arccon_identical_views_have_a_finite_gradient(gen):
    """h2 == h1: cos = 1, theta = 0, where arccos has an infinite slope. The contract floors sin^2 at 1e-6
    (the op oracle's form); that changes the exact value by at most sin(m) * 1e-3 / tau in the positive logit."""
    h1 = randn(gen, 37, 64, dtype=torch.float64)
    check_against_oracle(lambda a, b: ak.arccon_loss(a, b, 10.0, 0.05),
                         lambda a, b: oracle.similarity_xent(a, b, 1 / 0.05, "diagonal", margin=math.radians(10.0)),
                         [h1, h1.clone()], "arccon identical views")
    assert abs(ak.arccon_loss(h1, h1).item() / oracle.arccon_loss(h1, h1).item() - 1) < 1e-2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,d", [(1, 2), (3, 6), (37, 130), (1000, 768)])
def test_triplet_loss(gen, n, d, dtype):
    anchor, weak, strong = (randn(gen, n, d, dtype=dtype) for _ in range(3))
    for margin in (0.0, 0.1, 0.5, -0.2):
        check_against_oracle(lambda a, w, s: ak.triplet_loss(a, w, s, margin),
                             lambda a, w, s: oracle.triplet_loss(a, w, s, margin), [anchor, weak, strong],
                             f"triplet margin={margin}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_triplet_exactly_at_its_margin_takes_no_gradient(gen, dtype):
    """max(0, x) has no derivative at x = 0: the losses take relu's (0: the triplet counts as met), and so does the
    oracle, which took clamp(min=0)'s (1) and gave weak and strong a gradient the losses never compute. Rows 0-3:
    weak and strong equal with margin 0, a hinge of exactly 0 in any dtype; rows 4-7 random."""
    anchor, weak, strong = (randn(gen, 8, 16, dtype=dtype) for _ in range(3))
    strong[:4] = weak[:4]
    check_against_oracle(lambda a, w, s: ak.triplet_loss(a, w, s, 0.0),
                         lambda a, w, s: oracle.triplet_loss(a, w, s, 0.0), [anchor, weak, strong],
                         "triplet at its margin")
    leaves = [leaf_like(x) for x in (anchor, weak, strong)]
    ak.triplet_loss(*leaves, 0.0).backward()
    assert all(torch.equal(leaf.grad[:4], torch.zeros_like(leaf.grad[:4])) for leaf in leaves)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_triplets", [False, True])
def test_arccse_loss_module(gen, with_triplets, dtype):
    h1, h2 = _views(gen, 20, 32, dtype)
    triplets = [randn(gen, 12, 32, dtype=dtype) for _ in range(3)] if with_triplets else []
    settings = dict(margin_degrees=15.0, tau=0.1, triplet_weight=0.3, triplet_margin=0.05)
    module = ak.ArcCSELoss(**settings)
    assert isinstance(module, torch.nn.Module)
    check_against_oracle(lambda *inputs: module(*inputs), lambda *inputs: oracle.arccse_loss(*inputs, **settings),
                         [h1, h2, *triplets], f"ArcCSELoss triplets={with_triplets}")


def test_arccse_loss_defaults_follow_the_paper(gen):
    """margin 10 degrees, tau 0.05, lambda = 0.1, triplet margin 0."""
    h1, h2 = _views(gen, 20, 32)
    anchor, weak, strong = (randn(gen, 12, 32) for _ in range(3))
    check_against_oracle(lambda *inputs: ak.ArcCSELoss()(*inputs), lambda *inputs: oracle.arccse_loss(*inputs),
                         [h1, h2, anchor, weak, strong], "ArcCSELoss defaults")


def test_arccse_loss_needs_all_three_triplet_inputs_or_none(gen):
    h1, h2 = _views(gen, 4, 8)
    with pytest.raises(ValueError, match="anchor, weak and strong"):
        ak.ArcCSELoss()(h1, h2, anchor=h1, weak=h2)


def test_triplet_weight_is_at_least_zero_and_the_triplets_are_checked_whatever_it_is(gen):
    """ArcCSELoss took triplet_weight = -1 (angle-train's --triplet-w refuses it): a negative weight rewards the
    strongly masked view for being the closer one. With a weight of 0, triplets of the wrong shape passed silently."""
    h1, h2 = _views(gen, 4, 8)
    with pytest.raises(ValueError, match="triplet_weight must be >= 0"):
        ak.ArcCSELoss(triplet_weight=-1.0)
    module = ak.ArcCSELoss(triplet_weight=0.0)
    assert torch.equal(module(h1, h2, h1, h2, h2), ak.ArcCSELoss(triplet_weight=0.0)(h1, h2))
    with pytest.raises(ValueError, match="strong"):
        module(h1, h2, h1, h2, h2[:3])
    module.triplet_weight = -0.5  # an attribute set later is read and checked at the call
    with pytest.raises(ValueError, match="triplet_weight must be >= 0"):
        module(h1, h2)


def test_a_triplet_weight_past_the_compute_dtypes_range_is_refused_before_arccon_runs(gen):
    """triplet_weight multiplies the triplet term in float32 for 32- and 16-bit views: 1e300 was inf there, an inf
    loss and NaN gradients after both terms ran. Refused first, naming the weight and the range; float64 views take
    it, the loss ArcCon's plus the weight times the triplet term's."""
    h1, h2 = _views(gen, 4, 8, torch.float64)
    module = ak.ArcCSELoss(triplet_weight=1e300)
    for dtype in (torch.float32, torch.float16):
        with pytest.raises(ValueError, match=r"^triplet_weight must be within \+-3\.40282e\+38 \(float32's range"):
            module(*(t.to(dtype) for t in (h1, h2, h1, h2, h2)))
    expected = ak.arccon_loss(h1, h2) + 1e300 * ak.triplet_loss(h1, h2, h2, 0.0)
    torch.testing.assert_close(module(h1, h2, h1, h2, h2), expected, rtol=1e-12, atol=0)


def test_a_triplet_margin_whose_mean_overflows_is_refused_by_name(gen):
    """The margin is added to each row's cosine difference (within +-2) and the mean sums the rows' hinge terms in
    float32 for 32- and 16-bit embeddings: a margin of 1e38 on 64 rows was an inf loss (finite gradients). Refused
    past half of float32's largest number over the rows, naming the argument, the rows and the bound; at the bound
    the loss is finite; float64 embeddings take 1e38; a negative margin only turns terms off, so any is taken."""
    anchor, weak, strong = (randn(gen, 64, 8, dtype=torch.float64) for _ in range(3))
    bound = float(torch.finfo(torch.float32).max) / (2 * 64) - 2.0
    for dtype in (torch.float32, torch.bfloat16):
        triplets = [t.to(dtype) for t in (anchor, weak, strong)]
        with pytest.raises(ValueError, match=rf"^margin must be <= 2\.65846e\+36 for 64 rows of {str(dtype)[6:]} "
                                             r"embeddings: each row's hinge term is up to margin \+ 2"):
            ak.triplet_loss(*triplets, 1e38)
        assert torch.isfinite(ak.triplet_loss(*triplets, bound))
        assert ak.triplet_loss(*triplets, -1e300) == 0.0
    assert ak.triplet_loss(anchor, weak, strong, 1e38) == pytest.approx(1e38, rel=1e-12)
    h1, h2 = _views(gen, 4, 8)
    with pytest.raises(ValueError, match=r"^triplet_margin must be <= 2\.65846e\+36 for 64 rows of float32"):
        ak.ArcCSELoss(triplet_margin=1e38)(h1, h2, *(t.float() for t in (anchor, weak, strong)))


# --------------------------------------------------------------------------------------------------------
# bfloat16 / float16


@pytest.mark.parametrize("dims", [None, (8, 3)], ids=["full_width", "dims"])
def test_the_triplets_must_have_the_width_of_the_views_before_anything_is_computed(gen, dims, monkeypatch):
    """One encoder embeds all five inputs and dims truncate both terms alike. Triplets of another width were scored
    at their own width without a word, and with dims failed inside the triplet term's op, after ArcCon had run, with a
    message naming neither input. Any number of triplets is still taken."""
    from angle_kernels.dispatch import Ops

    h1, h2 = _views(gen, 4, 8)
    module = ak.ArcCSELoss(dims=dims)
    computed = []
    original = Ops.similarity_xent
    monkeypatch.setattr(Ops, "similarity_xent", lambda self, *a, **k: computed.append(1) or original(self, *a, **k))
    for width in (4, 12):
        anchor, weak, strong = randn(gen, 3, 4, width).unbind(0)
        with pytest.raises(ValueError, match=f"anchor must have 8 columns like h1, got shape \\(4, {width}\\)"):
            module(h1, h2, anchor, weak, strong)
    assert not computed, "refused before ArcCon ran"
    anchor, weak, strong = randn(gen, 3, 6, 8).unbind(0)
    assert torch.isfinite(module(h1, h2, anchor, weak, strong)) and computed  # (the count sees ArcCon's call)
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_half_precision(gen, dtype):
    h1, h2 = _views(gen, 37, 64, dtype)
    check_against_oracle(lambda a, b: ak.arccon_loss(a, b), lambda a, b: oracle.arccon_loss(a, b), [h1, h2],
                         f"arccon {dtype}")
    anchor, weak, strong = (randn(gen, 24, 64, dtype=dtype) for _ in range(3))
    check_against_oracle(lambda a, w, s: ak.triplet_loss(a, w, s, 0.1),
                         lambda a, w, s: oracle.triplet_loss(a, w, s, 0.1), [anchor, weak, strong],
                         f"triplet {dtype}")


# --------------------------------------------------------------------------------------------------------
# gradcheck and fuzzing
# --------------------------------------------------------------------------------------------------------
def test_gradcheck(gen):
    """Away from the margin's clamp at pi and the triplet hinge's kink, where finite differences mean nothing."""
    h1, h2 = (leaf_like(t) for t in _views(gen, 5, 6, torch.float64, noise=0.8))
    assert gradcheck(lambda a, b: ak.arccon_loss(a, b, 10.0, 0.5), (h1, h2), eps=1e-6, atol=1e-6, rtol=1e-4)
    anchor, weak, strong = (leaf_like(randn(gen, 6, 5, dtype=torch.float64)) for _ in range(3))
    assert gradcheck(lambda a, w, s: ak.triplet_loss(a, w, s, 0.1), (anchor, weak, strong),
                     eps=1e-6, atol=1e-6, rtol=1e-4)


@FUZZ
@given(
    n=st.integers(1, 32),
    dim=st.integers(2, 48),
    margin_degrees=st.sampled_from([0.0, 10.0]) | st.floats(0.0, 120.0),
    tau=st.sampled_from([0.05]) | st.floats(0.05, 2.0),
    noise=st.sampled_from([0.3, 1.0, 3.0]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_fuzz_arccon(n, dim, margin_degrees, tau, noise, dtype, seed):
    h1 = fuzz_embeddings(seed, n, dim, 1.0, torch.float64)
    h2 = h1 + noise * fuzz_embeddings(seed + 1, n, dim, 1.0, torch.float64)
    theta = torch.rad2deg(torch.arccos(torch.nn.functional.cosine_similarity(h1, h2).clamp(-1, 1)))
    assume(not ((theta + margin_degrees - 180.0).abs() < 0.5).any())  # away from the kink at the clamp to pi
    # and from theta = 0, where the contract floors sin^2(theta) at 1e-6 and the paper's arccos form differs
    assume(bool((theta > 0.5).all()))
    assume(dtype != torch.float64 or not float64_cannot_resolve(oracle.arccon_loss(h1, h2, margin_degrees, tau)))
    check_against_oracle(lambda a, b: ak.arccon_loss(a, b, margin_degrees, tau),
                         lambda a, b: oracle.arccon_loss(a, b, margin_degrees, tau), [h1.to(dtype), h2.to(dtype)],
                         f"arccon n={n} margin={margin_degrees} tau={tau}")


@FUZZ
@given(
    n=st.integers(1, 40),
    dim=st.integers(2, 48),  # D = 1: every direction is +-1, the true gradient is 0 and any result is rounding noise
    margin=st.floats(-0.5, 0.5),
    dtype=st.sampled_from(DTYPES + list(HALF_DTYPES)),
    seed=st.integers(0, 2**31 - 1),
)
def test_fuzz_triplet(n, dim, margin, dtype, seed):
    """Hinge kinks are measure-zero for random inputs."""
    anchor, weak, strong = (fuzz_embeddings(seed + k, n, dim, 1.0, dtype) for k in range(3))
    check_against_oracle(lambda a, w, s: ak.triplet_loss(a, w, s, margin),
                         lambda a, w, s: oracle.triplet_loss(a, w, s, margin), [anchor, weak, strong],
                         f"triplet n={n} margin={margin}")


def test_settings_assigned_after_construction_take_effect_or_are_refused():
    """ArcCSELoss kept the margin in radians from construction: margin_degrees set later showed in repr and was
    ignored (10 degrees' loss for 40), and tau = -1 was computed with. Both are read and checked at each call."""
    gen = torch.Generator().manual_seed(0)
    h1, h2 = torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)
    module = ak.ArcCSELoss(10.0)
    module.margin_degrees = 40.0
    assert module(h1, h2).item() == ak.ArcCSELoss(40.0)(h1, h2).item() != ak.ArcCSELoss(10.0)(h1, h2).item()
    for name, value, said in (("tau", -1.0, "tau must be > 0"), ("margin_degrees", 200.0, "between 0 and 180"),
                              ("triplet_weight", float("nan"), "triplet_weight must be finite")):
        module = ak.ArcCSELoss()
        setattr(module, name, value)
        with pytest.raises(ValueError, match=said):
            module(h1, h2, h1, h2, h2)

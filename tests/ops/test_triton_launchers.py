"""The Triton backend's launchers (internals, not the op semantics that test_<op>.py checks on every backend).

Output allocation. Every kernel writes each element of its outputs, so production allocates them with
torch.empty: a NaN fill would be one more full write (for the bandwidth-bound pair-score backward, about 50%
over its floor). With ANGLE_KERNELS_POISON_OUTPUTS=1 (on under pytest) `_common.new_output` fills them with NaN
instead, so an element a kernel forgets to write fails the op tests. Checked here: the switch, that no launch
fills with NaN when it is off (torch.full / full_like / Tensor.fill_ are watched during forward and backward
of every op), and that the results do not depend on it.

pair_scores with dims (nested prefixes): one launch of each prefix kernel per forward / backward, whatever the
number of prefixes, and no detour through the torch backend.

Routing. Each router (the *_paths modules, similarity_xent.py's entry function) runs the launcher of the path its
code_path names.

Autotuning. similarity_xent's tile kernels are autotuned per power-of-two bucket of the row counts, so a new
batch size does not re-tune: the bucket function and the keys each launch passes.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from angle_kernels.testing.helpers import TRITON_DEVICE, backend_or_skip, generator, pair_groups, randn

pytest.importorskip("triton")  # a third-party dependency: without it there is nothing to test here

import angle_kernels.torch_ops.pair_scores as torch_pair  # noqa: E402  (after the importorskip)
import angle_kernels.triton_ops._common as common  # noqa: E402
import angle_kernels.triton_ops.pair_scores as pair  # noqa: E402
import angle_kernels.triton_ops.ranking_loss as ranking  # noqa: E402
import angle_kernels.triton_ops.similarity_xent as similarity  # noqa: E402
from angle_kernels import dispatch, verified  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")


@pytest.fixture
def triton_backend():
    return backend_or_skip("triton")


def _is_nan(value) -> bool:
    return isinstance(value, (int, float)) and math.isnan(value)


@pytest.fixture
def nan_fills(monkeypatch):
    """A list that records every NaN fill made through torch.full, torch.full_like or Tensor.fill_."""
    seen: list[str] = []
    full, full_like, fill_ = torch.full, torch.full_like, torch.Tensor.fill_

    def watched_full(size, fill_value, *args, **kwargs):
        if _is_nan(fill_value):
            seen.append(f"torch.full({tuple(size)})")
        return full(size, fill_value, *args, **kwargs)

    def watched_full_like(t, fill_value, *args, **kwargs):
        if _is_nan(fill_value):
            seen.append(f"torch.full_like({tuple(t.shape)})")
        return full_like(t, fill_value, *args, **kwargs)

    def watched_fill_(t, value):
        if _is_nan(value):
            seen.append(f"Tensor.fill_({tuple(t.shape)})")
        return fill_(t, value)

    monkeypatch.setattr(torch, "full", watched_full)
    monkeypatch.setattr(torch, "full_like", watched_full_like)
    monkeypatch.setattr(torch.Tensor, "fill_", watched_fill_)
    return seen


def _outputs_and_grads(outputs, leaves):
    """The outputs (detached) and the gradients of a fixed weighting of them."""
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    total = sum((o.double() * (1.0 + torch.arange(o.numel(), device=o.device).reshape(o.shape))).sum()
                for o in outputs if o.requires_grad)
    return (*(o.detach() for o in outputs), *torch.autograd.grad(total, leaves))


# The pair-score kernels run one program per group: under the interpreter two groups (pair_groups) already show a
# second program writing at a later group's offsets; on a GPU the sizes as ever.
PAIR_GROUPS = pair_groups(9, interpreted=TRITON_DEVICE.type == "cpu")


def _pair_scores(backend, with_angle):
    x = randn(generator("alloc_pair"), PAIR_GROUPS, 3, 34).to(backend.device).requires_grad_()
    return _outputs_and_grads(backend.ops.pair_scores(x, with_angle), [x])


def _pair_scores_dims(backend, with_angle):
    """Prefixes ending inside a block and before the last columns (30 < D = 34: dx there is 0, still written)."""
    x = randn(generator("alloc_pair_dims"), PAIR_GROUPS, 3, 34).to(backend.device).requires_grad_()
    return _outputs_and_grads(backend.ops.pair_scores(x, with_angle, (6, 20, 30)), [x])


def _ranking(backend):
    gen = generator("alloc_ranking")
    scores = randn(gen, 70, scale=5.0).to(backend.device).requires_grad_()
    labels = torch.randint(0, 6, (70,), generator=gen).to(backend.device)
    return _outputs_and_grads(backend.ops.ranking_loss(scores, labels), [scores])


# Sizes above the interpreter's 64-row/column tiles: the backward kernels accumulate into their gradient
# buffers block after block (read-modify-write), and the first block must store without reading the
# uninitialised (here: NaN) buffer.
def _similarity_symmetric(backend):
    gen = generator("alloc_symmetric")
    q = randn(gen, 80, 24).to(backend.device).requires_grad_()
    groups = torch.randint(0, 27, (80,), generator=gen).to(backend.device)
    loss = backend.ops.similarity_xent(q, None, 20.0, "partner", exclude_diagonal=True, group_ids=groups)
    return _outputs_and_grads(loss, [q])


def _similarity_rectangular(backend):
    gen = generator("alloc_rectangular")
    q = randn(gen, 70, 24).to(backend.device).requires_grad_()
    c = randn(gen, 140, 24).to(backend.device).requires_grad_()
    return _outputs_and_grads(backend.ops.similarity_xent(q, c, 20.0, "diagonal", margin=0.2), [q, c])


def _similarity_lse(backend):
    gen = generator("alloc_lse")
    q = randn(gen, 70, 24).to(backend.device).requires_grad_()
    c = randn(gen, 140, 24).to(backend.device).requires_grad_()
    fq, fc = randn(gen, 70, 12).to(backend.device), randn(gen, 140, 12).to(backend.device)
    threshold = torch.full((70,), 0.3, device=backend.device)  # drops some columns; every row keeps its target
    lse = backend.ops.similarity_lse(q, c, 20.0, period=70, penalty=2.0, penalty_on="other", filter_q=fq,
                                     filter_c=fc, filter_threshold=threshold, filter_keeps_target=True)
    return _outputs_and_grads(lse, [q, c])


OPS = {
    "pair_scores_angle": lambda backend: _pair_scores(backend, True),
    "pair_scores_cos_only": lambda backend: _pair_scores(backend, False),
    "pair_scores_dims_angle": lambda backend: _pair_scores_dims(backend, True),
    "pair_scores_dims_cos_only": lambda backend: _pair_scores_dims(backend, False),
    "ranking_tiled": _ranking,
    "ranking_sorted": _ranking,
    "similarity_symmetric_groups": _similarity_symmetric,
    "similarity_rectangular_margin": _similarity_rectangular,
    "similarity_lse_filtered": _similarity_lse,
}


def test_new_output_is_nan_only_when_poisoning(triton_backend, monkeypatch, nan_fills):
    device = triton_backend.device
    monkeypatch.setenv(common.POISON_OUTPUTS_ENV, "1")
    poisoned = common.new_output((3, 5), torch.float32, device)
    assert poisoned.shape == (3, 5) and poisoned.dtype == torch.float32 and torch.isnan(poisoned).all()
    assert len(nan_fills) == 1
    for off in ("0", ""):
        monkeypatch.setenv(common.POISON_OUTPUTS_ENV, off)
        plain = common.new_output((4,), torch.float64, device)
        assert plain.shape == (4,) and plain.dtype == torch.float64
    monkeypatch.delenv(common.POISON_OUTPUTS_ENV)
    common.new_output((4,), torch.float64, device)
    assert len(nan_fills) == 1  # off (unset, "0" or ""): torch.empty, no fill


@pytest.mark.parametrize("op", sorted(OPS))
def test_launches_fill_nothing_unless_poisoning(triton_backend, op, monkeypatch, nan_fills):
    if op == "ranking_sorted":  # the sort path at test size, with several scan blocks
        monkeypatch.setattr(ranking, "SMALL_N_MAX", 0)
        monkeypatch.setattr(ranking, "_SCAN_BLOCK", 16)
    monkeypatch.setenv(common.POISON_OUTPUTS_ENV, "0")
    production = OPS[op](triton_backend)
    assert nan_fills == [], f"{op} filled outputs with NaN in production: {nan_fills}"

    monkeypatch.setenv(common.POISON_OUTPUTS_ENV, "1")
    poisoned = OPS[op](triton_backend)
    assert nan_fills, "the poisoning switch is on but no NaN fill was seen"
    for got, ref in zip(production, poisoned):
        assert torch.isfinite(ref).all()  # every element of every poisoned output was written
        assert torch.equal(got, ref)


@pytest.mark.parametrize("poison", ["0", "1"])
def test_angle_without_angle_is_zeros_either_way(triton_backend, poison, monkeypatch):
    monkeypatch.setenv(common.POISON_OUTPUTS_ENV, poison)
    _, angle = triton_backend.ops.pair_scores(torch.randn(5, 2, 7, device=triton_backend.device), False)
    assert torch.equal(angle, torch.zeros_like(angle))


def test_autotune_bucket_is_the_next_power_of_two():
    assert {similarity._autotune_bucket(rows) for rows in range(513, 1025)} == {1024}
    assert [similarity._autotune_bucket(rows) for rows in (1, 2, 3, 512, 1025, 65536, 65537)] == [
        1, 2, 4, 512, 2048, 65536, 131072]


def test_launches_pass_bucketed_row_counts_as_the_autotune_keys(triton_backend, monkeypatch):
    """The tile kernels get M and Mc exactly (for masking) and their buckets under the autotune key's names."""
    launches = []
    launch = similarity._tile_launch

    def recording_launch(kernel, grid_of, blocks, *args, **constexprs):
        launches.append({**dict(zip(kernel.kernel.arg_names, args)), **constexprs})
        return launch(kernel, grid_of, blocks, *args, **constexprs)

    monkeypatch.setattr(similarity, "_tile_launch", recording_launch)
    q = torch.randn(37, 16, device=triton_backend.device, requires_grad=True)
    c = torch.randn(74, 16, device=triton_backend.device, requires_grad=True)
    triton_backend.ops.similarity_xent(q, c, 20.0, "diagonal").backward()
    assert len(launches) == 3  # forward, dq, dc
    for named in launches:
        assert (named["M"], named["Mc"], named["D"]) == (37, 74, 16)
        assert (named["M_BUCKET"], named["Mc_BUCKET"]) == (64, 128)
        assert set(similarity._TUNE_KEY) <= set(named)


class _RecordingKernel:
    """A stand-in for a @triton.jit kernel that records each launch's name and grid, then launches it."""

    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        self.launches.append((self.kernel.__name__, grid))
        return self.kernel[grid]


_PAIR_KERNELS = ("_pair_scores_fwd_kernel", "_pair_scores_bwd_kernel", "_prefix_pair_scores_fwd_kernel",
                 "_prefix_pair_scores_bwd_kernel")


@pytest.mark.parametrize("with_angle", [True, False], ids=["angle", "cos_only"])
def test_pair_scores_dims_launch_one_kernel_per_pass_not_per_prefix(triton_backend, with_angle, monkeypatch):
    launches = []
    for name in _PAIR_KERNELS:
        monkeypatch.setattr(pair, name, _RecordingKernel(getattr(pair, name), launches))
    x = randn(generator("launch_pair_dims"), 5, 3, 24).to(triton_backend.device).requires_grad_()
    cos, angle = triton_backend.ops.pair_scores(x, with_angle, (4, 8, 16, 24))
    assert cos.shape == angle.shape == (4, 5, 2)
    (cos.sum() + angle.sum()).backward()
    assert launches == [("_prefix_pair_scores_fwd_kernel", (5,)), ("_prefix_pair_scores_bwd_kernel", (5,))]


def test_pair_scores_dims_run_on_triton_not_on_the_torch_fallback(triton_backend, monkeypatch):
    """Under "auto", with the Triton backend verified for it, a dims call stays on the Triton kernels: no warning,
    no torch op."""
    dims = (4, 10, 16)
    x = randn(generator("no_fallback_pair_dims"), 6, 3, 20, dtype=torch.float64).to(triton_backend.device)
    torch_ops = dispatch.resolve_backend("torch", x)
    reference = x.clone().requires_grad_()
    expected = _outputs_and_grads(torch_ops.pair_scores(reference, True, dims), [reference])

    def refuse(*args, **kwargs):
        raise AssertionError("the torch backend computed a Triton pair_scores call")

    for function in (torch_pair.PairScoresFunction, torch_pair.PrefixPairScoresFunction):
        monkeypatch.setattr(function, "apply", refuse)
    monkeypatch.setattr(verified, "is_verified", lambda backend, op, path, device: backend == "triton")
    auto = dispatch.AutoOps([dispatch.Ops("triton", triton_backend.ops.backend)], {})
    leaf = x.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = _outputs_and_grads(auto.pair_scores(leaf, True, dims), [leaf])
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def _route(monkeypatch, launchers: dict) -> None:
    """Each launcher (module, attribute) of `launchers` replaced by a stand-in that returns its label."""
    for label, (module, name) in launchers.items():
        monkeypatch.setattr(module, name, lambda *args, label=label, **kwargs: label)


def test_each_router_runs_the_launcher_of_the_path_it_names(monkeypatch):
    """The Triton routers (pair_scores_paths, similarity_xent_paths, similarity_xent.py's own entry function and
    similarity_lse_paths) call the launcher of the path their code_path names, for every path: a router that ran
    another exact path would give the same numbers, while the verified-path bookkeeping trusted and timed the named
    one. (Only shapes matter here: the stand-ins launch nothing.)"""
    from angle_kernels.triton_ops import (
        _pair_scores_one_read, _similarity_lse_dense, _similarity_xent_dense_dims, pair_scores_paths,
        similarity_lse_paths, similarity_xent_dense, similarity_xent_paths,
    )
    import angle_kernels.triton_ops.similarity_lse as fused_lse

    monkeypatch.setattr(pair_scores_paths, "ONE_READ_MIN_WIDTH", pair_scores_paths.PROPOSED_ONE_READ_MIN_WIDTH)
    monkeypatch.setattr(similarity_lse_paths, "DENSE_DIMS_MIN_WIDTH",
                        similarity_lse_paths.PROPOSED_DENSE_DIMS_MIN_WIDTH)
    wide, narrow = torch.empty(8, 2048), torch.empty(8, 16)
    wide_dims, narrow_dims = (256, 2048), (8, 16)

    def check(router, code_path, paths, launcher_of, calls):
        named = {code_path(*args, **kwargs): router(*args, **kwargs) for args, kwargs in calls}
        assert set(named) == set(paths)  # every path reached by one of the calls
        assert named == {path: launcher_of[path] for path in paths}

    _route(monkeypatch, {"single": (pair, "pair_scores"), "one_read": (_pair_scores_one_read, "pair_scores")})
    check(pair_scores_paths.pair_scores, pair_scores_paths.code_path, pair_scores_paths.PATHS,
          {"full": "single", "dims": "single", "dims_one_read": "one_read"},
          [((torch.empty(2, 3, 16), True), {}), ((torch.empty(2, 3, 16), True), {"dims": narrow_dims}),
           ((torch.empty(2, 3, 2048), True), {"dims": wide_dims})])

    xent_calls = [((q, None, 20.0, "diagonal"), {"dims": dims})
                  for q, dims in ((narrow, None), (wide, None), (narrow, narrow_dims), (wide, wide_dims))]
    _route(monkeypatch, {"dense": (similarity_xent_dense, "similarity_xent"),
                         "kernels": (similarity.SimilarityXentFunction, "apply")})
    check(similarity.similarity_xent, similarity.code_path, similarity.PATHS,
          {"fused": "kernels", "dims": "kernels", "dense": "dense"}, xent_calls[:3])
    _route(monkeypatch, {"own": (similarity, "similarity_xent"),
                         "dense_dims": (_similarity_xent_dense_dims, "similarity_xent")})
    check(similarity_xent_paths.similarity_xent, similarity_xent_paths.code_path, similarity_xent_paths.PATHS,
          {"fused": "own", "dims": "own", "dense": "own", "dense_dims": "dense_dims"}, xent_calls)

    _route(monkeypatch, {"fused": (fused_lse, "similarity_lse"), "dense": (_similarity_lse_dense, "similarity_lse"),
                         "dense_dims": (_similarity_lse_dense, "similarity_lse_dims"),
                         "fused_prefixes": (similarity_lse_paths, "fused_prefixes")})
    lse_args = dict(target_offset=0, period=0, exclude="none", penalty=0.0, penalty_on="none", filter_q=None,
                    filter_c=None, filter_threshold=None, filter_keeps_target=False, normalize=True)
    check(similarity_lse_paths.similarity_lse, similarity_lse_paths.code_path, similarity_lse_paths.PATHS,
          {path: path for path in similarity_lse_paths.PATHS},
          [((q, q, 20.0), {**lse_args, "dims": dims})
           for q, dims in ((narrow, None), (wide, None), (narrow, narrow_dims), (wide, wide_dims))])

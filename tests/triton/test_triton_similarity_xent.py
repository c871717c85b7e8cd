"""Triton similarity_xent under the interpreter against the float64 oracle (and torch_ops when present)."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

import triton_oracle as oracle
from angle_kernels.triton_ops import similarity_xent

sx = importlib.import_module("angle_kernels.triton_ops.similarity_xent")

# (name, M, Mc or None for the symmetric case, D, options)
CASES = [
    ("in_batch_negatives", 38, None, 130,
     dict(target="partner", exclude_diagonal=True, weights=True, groups=True, scale=20.0)),
    ("contrastive_with_negatives", 37, 74, 33, dict(target="diagonal", scale=20.0)),
    ("arccon_margin", 20, 20, 64, dict(target="diagonal", margin=math.radians(10), scale=20.0)),
    ("tiny_partner", 2, None, 6, dict(target="partner", exclude_diagonal=True, scale=20.0)),
]


def _inputs(name, m, mc, d, dtype):
    gen = torch.Generator().manual_seed(oracle.seed(name, m, mc, d, str(dtype)))
    q = torch.randn(m, d, generator=gen)
    c = None if mc is None else torch.randn(mc, d, generator=gen)
    if m > 2:
        q[1] = 0.0  # a zero row: finite, cosine 0 with everything
    return q.to(dtype), (None if c is None else c.to(dtype)), gen


def _options(opts, m, gen):
    kwargs = dict(scale=opts["scale"], target=opts["target"], exclude_diagonal=opts.get("exclude_diagonal", False),
                  margin=opts.get("margin", 0.0))
    if opts.get("weights"):
        kwargs["row_weights"] = (torch.rand(m, generator=gen) > 0.3).float()
    if opts.get("groups"):
        kwargs["group_ids"] = torch.randint(0, m // 3, (m,), generator=gen)  # plenty of duplicates
    return kwargs


def _loss_and_grads(fn, q, c, kwargs, dtype=None, device="cpu"):
    """fn on `device` (the oracle and torch_ops stay on CPU); (loss, dq, dc) back on CPU."""

    def leaf(t):
        return (t if dtype is None else t.to(dtype)).detach().clone().to(device).requires_grad_()

    q_leaf = leaf(q)
    c_leaf = None if c is None else leaf(c)
    kwargs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    loss = fn(q_leaf, c_leaf, **kwargs)
    loss.backward()
    return loss.detach().cpu(), q_leaf.grad.cpu(), None if c is None else c_leaf.grad.cpu()


def _kernel(q, c, kwargs):
    return _loss_and_grads(similarity_xent, q, c, kwargs, device=oracle.DEVICE)


@pytest.mark.parametrize("name,m,mc,d,opts", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_against_oracle(name, m, mc, d, opts, dtype):
    q, c, gen = _inputs(name, m, mc, d, dtype)
    kwargs = _options(opts, m, gen)
    loss, dq, dc = _kernel(q, c, kwargs)
    ref, ref_dq, ref_dc = _loss_and_grads(oracle.similarity_xent, q, c, kwargs, torch.float64)
    value_tol, grad_tol = (1e-6, 1e-5) if dtype == torch.float32 else (1e-13, 1e-12)
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32) and loss.dim() == 0
    assert dq.dtype == dtype and torch.isfinite(dq).all()
    assert oracle.rel_err(loss, ref) <= value_tol
    assert oracle.rel_err(dq, ref_dq) <= grad_tol
    if c is not None:
        assert dc.dtype == dtype and torch.isfinite(dc).all()
        assert oracle.rel_err(dc, ref_dc) <= grad_tol


@pytest.mark.parametrize("name,m,mc,d,opts", CASES[:3], ids=[c[0] for c in CASES[:3]])
def test_bf16_within_twice_eager_error(name, m, mc, d, opts):
    q, c, gen = _inputs(name, m, mc, d, torch.bfloat16)
    kwargs = _options(opts, m, gen)
    loss, dq, dc = _kernel(q, c, kwargs)
    ref, ref_dq, ref_dc = _loss_and_grads(oracle.similarity_xent, q, c, kwargs, torch.float64)
    eager_kwargs = dict(kwargs)
    if "row_weights" in eager_kwargs:
        eager_kwargs["row_weights"] = eager_kwargs["row_weights"].to(torch.bfloat16)
    eager, eager_dq, eager_dc = _loss_and_grads(oracle.similarity_xent, q, c, eager_kwargs, torch.bfloat16)
    assert dq.dtype == torch.bfloat16
    assert oracle.rel_err(loss, ref) <= 2 * oracle.rel_err(eager, ref)
    assert oracle.rel_err(dq, ref_dq) <= 2 * oracle.rel_err(eager_dq, ref_dq)
    if c is not None:
        assert oracle.rel_err(dc, ref_dc) <= 2 * oracle.rel_err(eager_dc, ref_dc)


def test_margin_past_pi_pins_the_target_logit():
    # q_0 and c_0 antiparallel: theta = pi, so theta + margin is clamped to pi and the slope is zero.
    q = torch.randn(4, 8, dtype=torch.float64)
    c = torch.randn(4, 8, dtype=torch.float64)
    c[0] = -q[0]
    kwargs = dict(scale=5.0, target="diagonal", margin=0.5)
    loss, dq, dc = _kernel(q, c, kwargs)
    ref, ref_dq, ref_dc = _loss_and_grads(oracle.similarity_xent, q, c, kwargs)
    assert oracle.rel_err(loss, ref) < 1e-12
    assert oracle.rel_err(dq, ref_dq) < 1e-10
    assert oracle.rel_err(dc, ref_dc) < 1e-10


def test_bad_inputs_raise():
    dev = oracle.DEVICE
    q = torch.randn(6, 4, device=dev)
    with pytest.raises(ValueError, match="target must be"):
        similarity_xent(q, None, 20.0, "rows")
    with pytest.raises(ValueError, match="even M"):
        similarity_xent(torch.randn(5, 4, device=dev), None, 20.0, "partner")
    with pytest.raises(ValueError, match="c must be"):
        similarity_xent(q, torch.randn(6, 3, device=dev), 20.0, "diagonal")
    with pytest.raises(ValueError, match="group_ids is supported only"):
        similarity_xent(q, torch.randn(6, 4, device=dev), 20.0, "diagonal",
                        group_ids=torch.zeros(6, dtype=torch.int64, device=dev))
    with pytest.raises(ValueError, match="exclude every target"):
        similarity_xent(q, None, 20.0, "diagonal", exclude_diagonal=True)
    with pytest.raises(TypeError, match="q must be"):
        similarity_xent(q.to(torch.int32), None, 20.0, "partner")


def test_matches_torch_ops():
    ops = oracle.torch_ops_or_none()
    if ops is None or not hasattr(ops, "similarity_xent"):
        pytest.skip("angle_kernels.torch_ops.similarity_xent is not there yet")
    name, m, mc, d, opts = CASES[0]
    q, c, gen = _inputs(name, m, mc, d, torch.float32)
    kwargs = _options(opts, m, gen)
    try:
        ref, ref_dq, _ = _loss_and_grads(ops.similarity_xent, q, c, kwargs)
    except NotImplementedError:
        pytest.skip("angle_kernels.torch_ops.similarity_xent is not finished yet")
    loss, dq, _ = _kernel(q, c, kwargs)
    assert oracle.rel_err(loss, ref) < 1e-6
    assert oracle.rel_err(dq, ref_dq) < 1e-5


def test_strided_inputs_and_fp16():
    gen = torch.Generator().manual_seed(31)
    q = torch.randn(18, 40, generator=gen).T  # [40, 18] with strides (1, 40)
    c = torch.randn(60, 36, generator=gen)[:, ::2]  # [60, 18] with strides (36, 2)
    assert not q.is_contiguous() and not c.is_contiguous()
    kwargs = dict(scale=20.0, target="diagonal")
    for dtype, value_tol, grad_tol in ((torch.float32, 1e-6, 1e-5), (torch.float16, None, None)):
        # Fresh leaves with the same (non-contiguous) strides, on the kernel's device.
        q_leaf = torch.empty_strided(q.shape, q.stride(), dtype=dtype, device=oracle.DEVICE).copy_(q)
        c_leaf = torch.empty_strided(c.shape, c.stride(), dtype=dtype, device=oracle.DEVICE).copy_(c)
        assert not q_leaf.is_contiguous() and not c_leaf.is_contiguous()
        q_leaf.requires_grad_()
        c_leaf.requires_grad_()
        loss = similarity_xent(q_leaf, c_leaf, **kwargs)
        loss.backward()
        ref, ref_dq, ref_dc = _loss_and_grads(oracle.similarity_xent, q.to(dtype), c.to(dtype), kwargs, torch.float64)
        if value_tol is None:  # fp16: within twice eager PyTorch's own fp16 error
            eager, eager_dq, eager_dc = _loss_and_grads(oracle.similarity_xent, q, c, kwargs, torch.float16)
            value_tol = 2 * oracle.rel_err(eager, ref)
            grad_tol = 2 * max(oracle.rel_err(eager_dq, ref_dq), oracle.rel_err(eager_dc, ref_dc))
        assert oracle.rel_err(loss.cpu(), ref) <= value_tol
        assert oracle.rel_err(q_leaf.grad.cpu(), ref_dq) <= grad_tol
        assert oracle.rel_err(c_leaf.grad.cpu(), ref_dc) <= grad_tol


def test_fp16_zero_and_tiny_rows_never_give_nan():
    """Regression: the backward once scaled the gradient tile by 1/|c| before casting it to the fp16 operand;
    1/|c| = 1e12 for a zero row overflowed to inf and inf * 0 spread NaN over whole gradient rows. Now only the
    exactly-zero row's own gradient is non-finite (its true value, ~1/eps, exceeds fp16), as in the torch path."""
    from angle_kernels import torch_ops

    torch.manual_seed(0)
    q = torch.randn(8, 16, device=oracle.DEVICE).half()
    q[3] = 0
    q[5] *= 1e-3
    weights = torch.ones(8, device=oracle.DEVICE)
    grads = []
    for op in (similarity_xent, torch_ops.similarity_xent):
        x = q.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(op(x, None, 20.0, "partner", weights, True), x)
        grads.append(grad.float().cpu())
    ours, reference = grads
    assert not torch.isnan(ours).any()
    assert (~torch.isfinite(ours)).any(1).nonzero().flatten().tolist() == [3]
    finite_rows = [i for i in range(8) if i != 3]
    assert torch.allclose(ours[finite_rows], reference[finite_rows], rtol=2e-2, atol=1e-2)


def test_autotune_bucket_is_the_next_power_of_two():
    assert {sx._autotune_bucket(rows) for rows in range(513, 1025)} == {1024}
    assert [sx._autotune_bucket(rows) for rows in (1, 2, 3, 512, 1025, 65536, 65537)] == [
        1, 2, 4, 512, 2048, 65536, 131072]


def test_launches_pass_bucketed_row_counts_as_the_autotune_keys(monkeypatch):
    """The tile kernels get M and Mc exactly (for masking) and their buckets under the autotune key's names."""
    launches = []
    launch = sx._tile_launch

    def recording_launch(kernel, grid_of, blocks, *args, **constexprs):
        launches.append({**dict(zip(kernel.arg_names, args)), **constexprs})
        return launch(kernel, grid_of, blocks, *args, **constexprs)

    monkeypatch.setattr(sx, "_tile_launch", recording_launch)
    q = torch.randn(37, 16, device=oracle.DEVICE, requires_grad=True)
    c = torch.randn(74, 16, device=oracle.DEVICE, requires_grad=True)
    similarity_xent(q, c, 20.0, "diagonal").backward()
    assert len(launches) == 3  # forward, dq, dc
    for named in launches:
        assert (named["M"], named["Mc"], named["D"]) == (37, 74, 16)
        assert (named["M_BUCKET"], named["Mc_BUCKET"]) == (64, 128)
        assert set(sx._TUNE_KEY) <= set(named)

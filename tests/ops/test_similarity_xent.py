"""similarity_xent on every backend against the float64 oracle: the loss and the gradients of q and c.

The cases cover what the public losses ask of the op (in-batch negatives: c = None, partner targets, the
diagonal excluded, rows without a target weighted 0, identical texts as extra positives; contrastive with
negatives: rectangular, diagonal targets; ArcCon: an angular margin on the target logit) and the corners
around them: a single row, odd and non-power-of-two sizes, more rows, columns and D than one Triton tile,
fractional weights, a margin past pi and at |cos| = 1, non-contiguous inputs, zero rows in float16.

Nested prefixes (dims) on the backends that declare them: the [k] losses against the oracle's k calls on the
truncated inputs, stacked, with a random upstream gradient [k], over the same options.

The triton backend computes the full-width loss by two schemes: its fused kernels, and for wide embeddings the
dense scheme (cuBLAS products and Triton tile kernels, triton_ops/similarity_xent_dense.py). Here the `backend`
fixture adds "triton-dense", the dense scheme called directly at every width, in blocks of a few rows, so that
every case below holds it to the same oracle.

The torch backend computes 16-bit calls on a GPU by its "mixed" path (16-bit operands, float32 accumulation:
torch_ops/similarity_xent.py). The `backend` fixture adds "torch-mixed", the torch backend held to that path on
the CPU, where each product converts its 16-bit operands to float32 (the values a GPU's mixed-dtype products take,
accumulated in another order): every case below holds its arithmetic to the oracle, the 16-bit ones under the
half-precision rule, the float32 and float64 ones (operands and tiles then stay in that dtype) as an exact check of
its algebra. Its "default" path computes CPU calls in the softmax form (torch_ops/_similarity_xent_softmax.py, the
"torch" backend here) and GPU calls in the blocked form (torch_ops/similarity_xent.py): the fixture adds
"torch-blocked", that form on the CPU, and "torch-triangle", the softmax form's calls of rows against themselves
in the triangular schedule of torch_ops/_similarity_xent_symmetric.py (which the default tile budget keeps for
calls of 2,048 rows or more).
"""

from __future__ import annotations

import functools
import math
import types

import pytest
import torch
from torch.autograd import gradcheck

from angle_kernels.testing import oracle
from angle_kernels.testing.helpers import (
    BACKEND_NAMES, HALF_DTYPES, HUGE_OP_MAGNITUDES, Backend, ShapeRecorder, assert_close, backend_or_skip,
    check_against_oracle, generator, huge_magnitude_id, huge_row_factors, leaf_like, moved_to, outputs_and_grads,
    randn, skip_unless_feature,
)

DENSE_TEST_BLOCK_ROWS = 16  # the dense scheme's row blocks here: most cases span several, the last one partial


def dense_scheme_backend(monkeypatch, block_rows: int = DENSE_TEST_BLOCK_ROWS) -> Backend:
    """The triton backend with its similarity_xent replaced by the dense scheme (whatever the width; no dims), in
    blocks of `block_rows` rows; skipped where the triton backend is."""
    from angle_kernels.dispatch import Ops

    triton_backend = backend_or_skip("triton")
    from angle_kernels.triton_ops import similarity_xent_dense

    monkeypatch.setattr(similarity_xent_dense, "MAX_BLOCK_ROWS", block_rows)
    raw = triton_backend.ops.backend
    features = dict(raw.features, similarity_xent=frozenset(similarity_xent_dense.FEATURES))
    dense = types.SimpleNamespace(**dict(vars(raw), similarity_xent=similarity_xent_dense.similarity_xent,
                                         features=features))
    return Backend("triton-dense", Ops("triton-dense", dense), triton_backend.device)


def torch_path_backend(path: str) -> Backend:
    """The torch backend with its similarity_xent computed by torch_ops/similarity_xent.py on the code path `path`
    (module docstring), on the CPU: "mixed", or "default" in the blocked form a GPU runs."""
    from angle_kernels.dispatch import Ops, raw_backend
    from angle_kernels.torch_ops import similarity_xent as torch_xent

    name = {"mixed": "torch-mixed", "default": "torch-blocked"}[path]
    raw = raw_backend("torch")
    held = types.SimpleNamespace(**dict(vars(raw), similarity_xent=functools.partial(torch_xent.similarity_xent,
                                                                                     path=path)))
    return Backend(name, Ops(name, held), torch.device("cpu"))


def torch_mixed_backend() -> Backend:
    """The torch backend with its similarity_xent held to the "mixed" path (module docstring), on the CPU."""
    return torch_path_backend("mixed")


@pytest.fixture(params=BACKEND_NAMES + ("triton-dense", "torch-mixed", "torch-blocked", "torch-row-blocks",
                        "torch-triangle"))
def backend(request, monkeypatch) -> Backend:
    """tests/conftest.py's backends, the triton backend's dense scheme, the torch backend's mixed path and blocked
    form (module docstring), "torch-row-blocks": the torch backend with a tile budget of a few rows
    (common.CHUNK_ELEMENTS), its CPU softmax form over several row blocks (at the default budget every case here is
    one block), where a block's diagonal targets and own columns start past its first column, and "torch-triangle":
    the torch backend with tiles of 4 rows and no least width, so that its calls of rows against themselves from 16
    rows on take the triangular schedule (module docstring), the last tile partial where 4 does not divide M."""
    if request.param == "triton-dense":
        return dense_scheme_backend(monkeypatch)
    if request.param == "torch-triangle":
        from angle_kernels.torch_ops import _similarity_xent_symmetric, common

        monkeypatch.setattr(common, "CHUNK_ELEMENTS", 16)
        monkeypatch.setattr(_similarity_xent_symmetric, "MIN_WIDTH", 1)
        found = backend_or_skip("torch")
        return Backend("torch-triangle", found.ops, found.device)
    if request.param == "torch-row-blocks":
        from angle_kernels.torch_ops import common

        monkeypatch.setattr(common, "CHUNK_ELEMENTS", 256)
        found = backend_or_skip("torch")
        return Backend("torch-row-blocks", found.ops, found.device)
    if request.param in ("torch-mixed", "torch-blocked"):
        return torch_path_backend({"torch-mixed": "mixed", "torch-blocked": "default"}[request.param])
    return backend_or_skip(request.param)

# name -> (M, Mc or None for c = None, D, options). Options: scale, target, exclude_diagonal, margin (radians);
# "weights" puts row weights in {0, 0.5, 1} ("negative fractional": in (-1, 0], every digit of a float32 used),
# "groups" draws group ids with many duplicates.
CASES = {
    "in_batch_negatives": (38, None, 130, dict(target="partner", exclude_diagonal=True, weights=True, groups=True)),
    "in_batch_negatives_plain": (38, None, 64, dict(target="partner", exclude_diagonal=True, weights=True)),
    "partner_with_self_column": (10, None, 8, dict(target="partner")),
    "contrastive": (37, 37, 33, dict(target="diagonal")),
    "contrastive_with_negatives": (37, 74, 33, dict(target="diagonal")),
    "arccon": (20, 20, 64, dict(target="diagonal", margin=math.radians(10))),
    "arccon_wide_margin": (9, 9, 16, dict(target="diagonal", margin=math.radians(90), scale=1 / 0.05)),
    "margin_on_partners": (12, None, 16, dict(target="partner", exclude_diagonal=True, weights=True, groups=True,
                                              margin=math.radians(10))),
    "diagonal_with_groups": (20, None, 16, dict(target="diagonal", groups=True, scale=2.0)),  # own column: target
    "one_row": (1, 1, 5, dict(target="diagonal")),
    "one_query_many_candidates": (1, 9, 7, dict(target="diagonal")),
    "one_pair": (2, None, 6, dict(target="partner", exclude_diagonal=True)),
    "negative_fractional_weights": (21, 30, 24, dict(target="diagonal", weights="negative fractional")),
    "several_tiles": (150, 300, 300, dict(target="diagonal", margin=0.2)),
}
# The cases' shapes where the Triton kernels run through the interpreter, which costs per program and per tile step
# (not per element): several_tiles still spans more than one of the interpreter's tiles on every side
# (triton_ops/_similarity_tiles.py, _interpreter_blocks: 64 rows, 64 columns, 256 of D; here 2 row tiles, 3 column
# tiles, 2 K-steps, each last one partial) and of the dense scheme's (blocks of DENSE_TEST_BLOCK_ROWS rows, column
# tiles of 128: 5 and 2), in a fraction of the programs (the finish kernels run one program a row: 200 for 450; the
# tile kernels 7 programs of 2 or 3 tile steps for 11 of 3 or 5). Compiled, the cases above run.
INTERPRETER_SHAPES = {"several_tiles": (70, 130, 260)}


def _inputs(name, dtype, interpreter=False, shapes=INTERPRETER_SHAPES):
    """(q, c or None, op keyword arguments) of a case, drawn from the case's own generator; with `interpreter` in
    its `shapes` shape where it has one."""
    rows, c_rows, dim, options = CASES[name]
    if interpreter and name in shapes:
        rows, c_rows, dim = shapes[name]
    gen = generator("similarity_xent", name, dtype)
    q = randn(gen, rows, dim, dtype=dtype)
    c = None if c_rows is None else randn(gen, c_rows, dim, dtype=dtype)
    kwargs = dict(scale=options.get("scale", 20.0), target=options["target"],
                  exclude_diagonal=options.get("exclude_diagonal", False), margin=options.get("margin", 0.0))
    if options.get("weights") == "negative fractional":
        kwargs["row_weights"] = -torch.rand(rows, generator=gen)
    elif options.get("weights"):
        kwargs["row_weights"] = torch.randint(0, 3, (rows,), generator=gen).to(torch.float32) / 2
    if options.get("groups"):
        kwargs["group_ids"] = torch.randint(0, max(1, rows // 3), (rows,), generator=gen)
    return q, c, kwargs


def _prefix_oracle(q, c=None, dims=None, **kwargs):
    """The oracle, or with dims its k calls on the truncated inputs, stacked: what the contract says dims is."""
    if dims is None:
        return oracle.similarity_xent(q, c, **kwargs)
    return torch.stack([oracle.similarity_xent(q[:, :d], None if c is None else c[:, :d], **kwargs) for d in dims])


def _check(backend, q, c, kwargs, what, magnitude=None):
    """ours and the oracle on (q, c), differentiating both when c is given. magnitude: ours sees the rows
    multiplied by huge powers of two (angle_kernels.testing.helpers.huge_row_factors, inside the differentiated
    function), which no cosine sees."""
    on_device = moved_to(backend.device, kwargs)

    def huge(x):
        return x if magnitude is None else x * huge_row_factors(x, magnitude)

    if c is None:
        return check_against_oracle(lambda q: backend.ops.similarity_xent(huge(q), None, **on_device),
                                    lambda q: _prefix_oracle(q, None, **kwargs), [q], what, device=backend.device)
    return check_against_oracle(lambda q, c: backend.ops.similarity_xent(huge(q), huge(c), **on_device),
                                lambda q, c: _prefix_oracle(q, c, **kwargs), [q, c], what, device=backend.device)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("name", sorted(CASES))
def test_against_oracle(backend, name, dtype):
    q, c, kwargs = _inputs(name, dtype, backend.interpreted)
    _check(backend, q, c, kwargs, name)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("name", ["in_batch_negatives", "contrastive_with_negatives", "arccon"])
def test_half_precision(backend, name, dtype):
    """bf16/fp16 inputs: a float32 loss and gradients in the input dtype, within 2x eager's own error."""
    q, c, kwargs = _inputs(name, dtype)
    _check(backend, q, c, kwargs, f"{name} {dtype}")


def test_without_weights_or_groups_every_row_counts(backend):
    """row_weights=None means every row weighs 1 (the case above draws weights): c = None, partner targets."""
    q = randn(generator("no_weights"), 16, 12)
    _check(backend, q, None, dict(scale=20.0, target="partner", exclude_diagonal=True), "no weights")


def test_margin_past_pi_pins_the_target_logit(backend):
    """q_0 and c_0 antiparallel: theta + margin > pi, so the target logit is cos(pi) = -1 with zero slope."""
    gen = generator("past_pi")
    q, c = randn(gen, 4, 8, dtype=torch.float64), randn(gen, 4, 8, dtype=torch.float64)
    c[0] = -q[0]
    _check(backend, q, c, dict(scale=5.0, target="diagonal", margin=0.5), "margin past pi")


def test_margin_at_identical_rows_has_a_finite_gradient(backend):
    """c = q: every target cosine is 1, where arccos has an infinite slope; the contract floors sin^2 at 1e-6."""
    q = randn(generator("identical"), 6, 10, dtype=torch.float64)
    _check(backend, q, q.clone(), dict(scale=20.0, target="diagonal", margin=math.radians(10)), "identical rows")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_non_contiguous_inputs(backend, dtype):
    gen = generator("strided", dtype)
    q = randn(gen, 18, 40, dtype=dtype).T  # [40, 18], strides (1, 40)
    c = randn(gen, 60, 36, dtype=dtype)[:, ::2]  # [60, 18], strides (36, 2)
    assert not q.is_contiguous() and not c.is_contiguous()
    _check(backend, q, c, dict(scale=20.0, target="diagonal"), f"strided {dtype}")


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # NumPy, under the interpreter
def test_float16_zero_and_tiny_rows_never_give_nan(backend):
    """A zero row's true gradient (~1/eps) is beyond float16's range: infinities there, and only there, never NaN.
    (Regression: the Triton backward once scaled the gradient tile by 1/|c| before casting it to a float16
    operand, and inf * 0 spread NaN over whole rows.) The other rows only get a sanity bound here: eager float16
    cannot compute this input (its epsilon underflows to 0), and their precision at the half rule is
    test_half_precision's subject."""
    q = randn(generator("fp16_zero"), 8, 16, dtype=torch.float16)
    q[3] = 0.0
    q[5] *= 1e-3
    kwargs = dict(scale=20.0, target="partner", row_weights=torch.ones(8), exclude_diagonal=True)
    on_device = moved_to(backend.device, kwargs)
    (loss,), (dq,) = outputs_and_grads(lambda q: backend.ops.similarity_xent(q, None, **on_device),
                                       [leaf_like(q, device=backend.device)])
    (exact_loss,), (exact_dq,) = outputs_and_grads(lambda q: oracle.similarity_xent(q, None, **kwargs),
                                                   [leaf_like(q, dtype=torch.float64)])
    assert not torch.isnan(dq).any()
    assert (~torch.isfinite(dq)).any(dim=1).nonzero().flatten().tolist() == [3]
    overflows = torch.isinf(exact_dq.to(torch.float16))
    assert torch.equal(dq[overflows].double(), exact_dq.sign()[overflows] * math.inf)
    others = torch.arange(8) != 3
    assert_close(dq[others], exact_dq[others], 1e-2, "dq of the other rows")
    assert_close(loss, exact_loss, 1e-3, "loss")


@pytest.mark.parametrize("dims", [None, (8, 16)], ids=["full", "dims"])
def test_float16_gradient_of_a_small_upstream_gradient_does_not_underflow(backend, dims):
    """The gradient of 1e-6 x loss is 1e-6 x the gradient. A backward that rounds its gradient tile to float16
    with the upstream gradient (or 1/M) inside loses it: here the tile entries are ~3e-8, below float16's smallest
    subnormal (6e-8), as they are at M = 131,072 with an upstream gradient of 1 (scale / M^2 ~ 1e-9). The rows
    are short (|q| ~ 4e-3: cosines do not care), so that the gradient itself, ~1/|q| times the tile's sums, is a
    normal float16 number and the test sees the tile, not the output's rounding."""
    if dims is not None:
        skip_unless_feature(backend, "similarity_xent", "dims")
    q = (1e-3 * randn(generator("fp16_small_upstream"), 24, 16)).to(torch.float16)
    grads = []
    for factor in (1.0, 1e-6):
        leaf = leaf_like(q, device=backend.device)
        loss = backend.ops.similarity_xent(leaf, None, 20.0, "partner", exclude_diagonal=True, dims=dims)
        (factor * loss.sum()).backward()
        grads.append(leaf.grad.double().cpu() / factor)
    assert torch.isfinite(grads[1]).all()
    assert_close(grads[1], grads[0], 2e-3, "dq of 1e-6 x loss, / 1e-6")


def test_more_rows_than_one_block_of_the_torch_backend(backend, monkeypatch):
    """M x Mc above 4M logits: the torch backend walks the rows in blocks, each block's gradient tiles added into
    the same gradients of q and c (here one shared buffer: q = c). On the CPU the torch forms take the two blocks
    of the budget's 2050 rows (2046 + 4) as 128 + 2 of 130 rows, the budget shrunk to 128 rows of 130 columns
    (common.CHUNK_ELEMENTS, read at each call; 2050 rows cost seconds for the same walk); "torch-row-blocks" keeps
    its budget of a few elements (blocks of one row)."""
    if backend.interpreted:
        pytest.skip("about 30 s in the Triton interpreter (33 x 33 tiles of 64 x 64; the dense scheme's 129 blocks "
                    "of 16 rows): runs when compiled")
    if backend.name == "torch-mixed":
        pytest.skip("the torch backend's walk over its blocks, which both paths share; the mixed path's sums across "
                    "blocks: test_torch_mixed_path_in_row_blocks")
    rows, groups = 2050, 1500
    if backend.device.type == "cpu":  # the torch forms (the triton ones skipped above)
        rows, groups = 130, 95
        if backend.name != "torch-row-blocks":
            from angle_kernels.torch_ops import common

            monkeypatch.setattr(common, "CHUNK_ELEMENTS", 128 * rows)
    gen = generator("blocks")
    q = randn(gen, rows, 16)
    kwargs = dict(scale=20.0, target="partner", exclude_diagonal=True,
                  row_weights=(torch.rand(rows, generator=gen) > 0.2).float(),
                  group_ids=torch.randint(0, groups, (rows,), generator=gen))
    _check(backend, q, None, kwargs, "several row blocks")


@pytest.mark.parametrize("scheme", ["torch", "torch-blocked", "triton-dense"])
@pytest.mark.parametrize("symmetric", [True, False], ids=["c=None", "c"])
def test_three_matrix_products_per_block(monkeypatch, symmetric, scheme):
    """The torch backend (both forms of its default path) and the triton backend's dense scheme compute a block's
    gradient while they hold the block's logits: forward takes three matrix products per row block (logits, dq, dc)
    and backward none, as eager code does (recomputing the logits in backward would take four); without gradients
    (no_grad, or no input that requires them) one per block."""
    import angle_kernels.torch_ops.common as torch_common
    from angle_kernels.dispatch import raw_backend
    from torch.utils._python_dispatch import TorchDispatchMode

    class MatmulCounter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_)
            return func(*args, **(kwargs or {}))

    if scheme.startswith("torch"):
        monkeypatch.setattr(torch_common, "CHUNK_ELEMENTS", 8 * 40)  # 40 columns: blocks of 8 rows
        ops = raw_backend("torch") if scheme == "torch" else torch_path_backend("default").ops.backend
        device = torch.device("cpu")
    else:
        dense = dense_scheme_backend(monkeypatch, block_rows=8)
        ops, device = dense.ops.backend, dense.device
    gen = generator("matmul_count", symmetric)
    rows, blocks = (40, 5) if symmetric else (24, 3)
    q = randn(gen, rows, 16, dtype=torch.float64).to(device)
    c = None if symmetric else randn(gen, 40, 16, dtype=torch.float64).to(device)
    kwargs = dict(scale=20.0, target="partner" if symmetric else "diagonal", exclude_diagonal=symmetric)

    def counted(grad_mode, inputs_require_grad):
        leaves = [q, c] if c is not None else [q]
        if inputs_require_grad:
            leaves = [leaf_like(x) for x in leaves]
        forward, backward = MatmulCounter(), MatmulCounter()
        with torch.set_grad_enabled(grad_mode), forward:
            loss = ops.similarity_xent(leaves[0], leaves[1] if c is not None else None, **kwargs)
        if loss.requires_grad:
            with backward:
                loss.backward(torch.tensor(1.5, dtype=torch.float64, device=device))
        return loss.detach(), [leaf.grad for leaf in leaves], forward.count, backward.count

    loss, grads, forward, backward = counted(grad_mode=True, inputs_require_grad=True)
    assert (forward, backward) == (3 * blocks, 0)
    for grad_mode, inputs_require_grad in ((False, True), (True, False)):
        plain = counted(grad_mode, inputs_require_grad)
        assert plain[2:] == (blocks, 0), (grad_mode, inputs_require_grad)
        assert torch.equal(plain[0], loss)
    leaves = [leaf_like(q)] + ([] if c is None else [leaf_like(c)])
    (oracle.similarity_xent(leaves[0], leaves[1] if c is not None else None, **kwargs) * 1.5).backward()
    for ours, leaf in zip(grads, leaves):
        assert_close(ours, leaf.grad, 1e-12, "the gradient for grad_loss = 1.5 (kept from forward, scaled)")


@pytest.mark.parametrize("symmetric", [True, False], ids=["c=None", "c"])
def test_dense_scheme_holds_one_block_of_logits(monkeypatch, symmetric):
    """The dense scheme's largest tensors are its row block's logits and gradient tile, block x Mc, whatever M is:
    with blocks of 8 rows, nothing of forward or backward reaches M x Mc elements, and the tiles are 8 x Mc."""
    dense = dense_scheme_backend(monkeypatch, block_rows=8)
    ops, device = dense.ops.backend, dense.device
    rows, c_rows = 40, 40 if symmetric else 56
    gen = generator("dense_memory", symmetric)
    # D = 4: the inputs, [M, D] and [Mc, D], are smaller than the tile
    leaves = [leaf_like(randn(gen, rows, 4), device=device)]
    if not symmetric:
        leaves.append(leaf_like(randn(gen, c_rows, 4), device=device))
    kwargs = moved_to(device, dict(scale=20.0, target="partner", exclude_diagonal=symmetric, margin=0.1,
                              row_weights=torch.rand(rows, generator=gen),
                              group_ids=torch.randint(0, 10, (rows,), generator=gen) if symmetric else None))
    recorder = ShapeRecorder()
    with recorder.mode:
        loss = ops.similarity_xent(leaves[0], leaves[1] if len(leaves) > 1 else None, **kwargs)
        recorder.phase = "backward"
        loss.backward()
    # (2-D tensors: the Triton interpreter passes each kernel argument as a 1-D copy of its bytes)
    largest = max(math.prod(shape) for _, shape in recorder.shapes if len(shape) == 2)
    assert largest == 8 * c_rows, f"largest tensor {largest} elements; the tile is 8 x {c_rows}"


def test_a_sum_into_its_own_output_is_recognised_through_another_view():
    """products._mixed_product_into adds into out without overwriting it first when `add` holds out's elements,
    whether it is out itself or another view object of them (a block's tile taken twice, tile[:n])."""
    from angle_kernels.products import _same_elements

    tile = torch.zeros(6, 4)
    assert _same_elements(tile[:3], tile[:3]) and _same_elements(tile, tile)
    assert not _same_elements(tile[:3], tile[1:4]) and not _same_elements(tile[:, :2], tile[:, 2:])
    assert not _same_elements(tile, tile.T.contiguous())


@pytest.mark.parametrize("offered", [(True, True), (True, False), (False, False)],
                         ids=["mixed-addmm", "mixed-mm-only", "converted"])
@pytest.mark.parametrize("accumulate", [False, True], ids=["write", "accumulate"])
def test_dense_scheme_products_take_every_torch_route(monkeypatch, offered, accumulate):
    """The dense scheme's products on each route a CUDA torch may offer (similarity_xent_dense.mixed_products):
    bf16 operands, an fp32 result of the right shape, the output written in place. Without a CUDA device, on the
    meta device, which runs torch's real argument checks for the mixed-dtype overloads that CPU lacks (torch
    2.11's meta decomposition of addmm with out_dtype is broken, but CI's torch is newer); with one, on it, for
    the routes it offers, against the fp32 product."""
    pytest.importorskip("triton")
    from angle_kernels.triton_ops import similarity_xent_dense as dense

    if torch.cuda.is_available():
        device = torch.device("cuda", 0)
        if any(wanted and not has for wanted, has in zip(offered, dense.mixed_products(device))):
            pytest.skip(f"torch {torch.__version__} does not offer this route on {device}")
    else:
        device = torch.device("meta")
    monkeypatch.setitem(dense._mixed_products, device, dense.MixedProducts(*offered))
    gen = generator("products", *offered, accumulate)
    a = randn(gen, 8, 5).to(device, torch.bfloat16)
    b = randn(gen, 6, 5).to(device, torch.bfloat16).T
    out = randn(gen, 12, 6).to(device)[2:10]
    expected = a.float() @ b.float() + (out if accumulate else 0)
    dense._product_into(out, a, b, accumulate)
    assert out.shape == (8, 6) and out.dtype == torch.float32
    if device.type != "meta":
        torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("width, rows, dims, scheme", [
    (16, 8, None, "Dense"), (15, 8, None, ""), (16, 8, (8, 16), "DenseDims"), (15, 8, (8, 15), ""),
    (16, 10, None, "")],
    ids=["wide", "narrow", "wide-with-dims", "narrow-with-dims", "wide-but-too-many-columns"])
def test_triton_backend_takes_the_dense_scheme_where_it_says(monkeypatch, width, rows, dims, scheme):
    """triton's similarity_xent sends the full-width loss to the dense scheme from its MIN_WIDTH up while a tile of
    MIN_BLOCK_ROWS rows fits, else to the fused kernels; dims from the same width up to the dense dims scheme
    (its own tile limit: tests/ops/test_similarity_xent_dense_dims.py), else to the fused prefix kernels (the
    grad_fn says which computed the loss). Here the limits are shrunk: width 16, tiles of 256 rows within 2,048
    logits (8 columns fit, 10 do not)."""
    from angle_kernels.triton_ops import similarity_xent_dense

    from angle_kernels.triton_ops import similarity_xent_paths

    backend = backend_or_skip("triton")
    monkeypatch.setattr(similarity_xent_dense, "MIN_WIDTH", 16)
    monkeypatch.setattr(similarity_xent_paths, "DENSE_DIMS_MIN_WIDTH", 16)
    monkeypatch.setattr(similarity_xent_dense, "TILE_ELEMENTS", 2048)
    monkeypatch.setattr(similarity_xent_dense, "MIN_BLOCK_ROWS", 256)
    q = leaf_like(randn(generator("scheme", width, rows), rows, width), device=backend.device)
    loss = backend.ops.similarity_xent(q, None, 20.0, "partner", exclude_diagonal=True, dims=dims)
    assert type(loss.grad_fn).__name__ == f"{scheme}SimilarityXentFunctionBackward"


def test_extra_memory_is_linear_in_rows(backend):
    """No M x M matrix: the extra CUDA memory of forward + backward at M = 16384 stays far below M^2 floats."""
    if backend.device.type != "cuda":
        pytest.skip("measures CUDA memory: needs the backend on a CUDA device")
    rows = 16384
    q = randn(generator("memory"), rows, 256, dtype=torch.bfloat16).to(backend.device).requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    backend.ops.similarity_xent(q, None, 20.0, "partner", None, True, 0.0, None).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    # Expected: float32 gradient scratch (4 M D bytes), the bf16 gradient and O(M); an fp32 M x M matrix is 1 GiB.
    assert extra < rows * rows, f"extra memory {extra / 2**20:.1f} MiB: more than 1/4 of an M x M fp32 matrix"


# name -> (a case of CASES, dims): a single prefix, the full width, odd widths, width 1, several tiles.
DIMS_CASES = {
    "in_batch_negatives": ("in_batch_negatives", (1, 33, 64, 130)),
    "in_batch_negatives_plain": ("in_batch_negatives_plain", (16, 32)),
    "partner_with_self_column": ("partner_with_self_column", (8,)),
    "contrastive_with_negatives": ("contrastive_with_negatives", (5, 17, 33)),
    "arccon": ("arccon", (32,)),
    "margin_on_partners": ("margin_on_partners", (3, 10, 16)),
    "one_row": ("one_row", (1, 2)),
    "several_tiles": ("several_tiles", (64, 129, 300)),
}
# Under the interpreter (see INTERPRETER_SHAPES): the dims cases' shapes and prefixes. The prefix kernels have no
# dense scheme to cross and take each prefix's columns in one K-step of 256 at either width: several_tiles needs
# 2 x 2 of the 64 x 64 tiles (the last ones partial), 146 finish programs (of 3 prefixes each) for 450.
INTERPRETER_DIMS_SHAPES = {"several_tiles": (66, 80, 260)}
INTERPRETER_DIMS = {"several_tiles": (64, 129, 260)}


def _dims_inputs(name, dtype, interpreter=False):
    case, dims = DIMS_CASES[name]
    q, c, kwargs = _inputs(case, dtype, interpreter, INTERPRETER_DIMS_SHAPES)
    if interpreter:
        dims = INTERPRETER_DIMS.get(name, dims)
    return q, c, dict(kwargs, dims=dims)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("name", sorted(DIMS_CASES))
def test_dims_against_oracle(backend, name, dtype):
    skip_unless_feature(backend, "similarity_xent", "dims")
    q, c, kwargs = _dims_inputs(name, dtype, backend.interpreted)
    _check(backend, q, c, kwargs, f"{name} dims={kwargs['dims']}")


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("name", ["in_batch_negatives", "contrastive_with_negatives", "arccon"])
def test_dims_half_precision(backend, name, dtype):
    skip_unless_feature(backend, "similarity_xent", "dims")
    q, c, kwargs = _dims_inputs(name, dtype)
    _check(backend, q, c, kwargs, f"{name} dims={kwargs['dims']} {dtype}")


def test_dims_on_non_contiguous_inputs(backend):
    skip_unless_feature(backend, "similarity_xent", "dims")
    gen = generator("strided_dims")
    q = randn(gen, 18, 40).T  # [40, 18], strides (1, 40)
    c = randn(gen, 60, 36)[:, ::2]  # [60, 18], strides (36, 2)
    _check(backend, q, c, dict(scale=20.0, target="diagonal", margin=0.1, dims=(7, 18)), "strided dims")


def test_dims_in_row_blocks_of_the_torch_backend(monkeypatch):
    """Several row blocks of the torch backend (its tile shrunk to 4 rows): every prefix's gradient tiles are
    summed across blocks, and the symmetric case adds the row and column halves into one gradient."""
    import angle_kernels.torch_ops.common as torch_common

    monkeypatch.setattr(torch_common, "CHUNK_ELEMENTS", 4 * 38 * 5)  # 38 columns, k + 1 = 5 tiles per block
    q, c, kwargs = _dims_inputs("in_batch_negatives", torch.float64)
    _check(backend_or_skip("torch"), q, c, kwargs, "in_batch_negatives dims, blocks of 4 rows")


@pytest.mark.parametrize("symmetric", [True, False], ids=["c=None", "c"])
def test_dims_torch_memory_stays_within_tiles(monkeypatch, symmetric):
    """The torch backend with dims never makes an M x Mc tensor (nor k of them stacked): with its tile shrunk to
    a few rows, every tensor of forward and backward is below M x Mc elements (the inputs are smaller)."""
    import angle_kernels.torch_ops.common as torch_common
    from angle_kernels.dispatch import raw_backend

    monkeypatch.setattr(torch_common, "CHUNK_ELEMENTS", 4 * 48 * 4)  # blocks of 4 rows with k = 3
    rows, c_rows, dims = 32, 32 if symmetric else 48, (3, 7, 12)
    gen = generator("dims_memory", symmetric)
    leaves = [leaf_like(randn(gen, rows, 12, dtype=torch.float64))]
    if not symmetric:
        leaves.append(leaf_like(randn(gen, c_rows, 12, dtype=torch.float64)))
    kwargs = dict(scale=20.0, target="partner", exclude_diagonal=symmetric, margin=0.1, dims=dims,
                  row_weights=torch.rand(rows, generator=gen),
                  group_ids=torch.randint(0, 10, (rows,), generator=gen) if symmetric else None)
    recorder = ShapeRecorder()
    with recorder.mode:
        loss = raw_backend("torch").similarity_xent(leaves[0], leaves[1] if len(leaves) > 1 else None, **kwargs)
        recorder.phase = "backward"
        loss.backward(torch.ones(len(dims), dtype=torch.float64))
    largest = max(recorder.shapes, key=lambda entry: math.prod(entry[1]))
    assert math.prod(largest[1]) < rows * c_rows, f"{largest}: an M x Mc = {rows} x {c_rows} sized tensor"


GRADCHECK_CASES = {
    "partner": (10, None, dict(scale=5.0, target="partner", exclude_diagonal=True)),
    "partner_weights": (10, None, dict(scale=5.0, target="partner", exclude_diagonal=True,
                                       row_weights=torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.5, 1.0, 1.0]))),
    "groups": (12, None, dict(scale=4.0, target="partner", exclude_diagonal=True,
                              group_ids=torch.tensor([0, 1, 2, 0, 3, 4, 5, 1, 6, 6, 7, 8]))),
    "rectangular": (5, 10, dict(scale=7.0, target="diagonal")),
    "square": (5, 5, dict(scale=7.0, target="diagonal")),
    "margin_10": (6, 6, dict(scale=2.0, target="diagonal", margin=math.radians(10))),
    "margin_60": (6, 6, dict(scale=2.0, target="diagonal", margin=math.radians(60))),
    "margin_on_partners": (8, None, dict(scale=3.0, target="partner", exclude_diagonal=True, margin=math.radians(10),
                                         row_weights=torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.5]))),
}


@pytest.mark.parametrize("dims", [None, (1, 4, 6)], ids=["full", "dims"])
@pytest.mark.parametrize("name", sorted(GRADCHECK_CASES))
def test_gradcheck(backend, name, dims):
    """Finite differences in float64 against the backward pass. With a margin, c is drawn near q (target
    cosines away from the clamp at pi, where the logit has a kink)."""
    if dims is not None:
        skip_unless_feature(backend, "similarity_xent", "dims")
    rows, c_rows, kwargs = GRADCHECK_CASES[name]
    kwargs = dict(kwargs, dims=dims)
    gen = generator("gradcheck", name)
    q = randn(gen, rows, 6, dtype=torch.float64)
    inputs = [leaf_like(q, device=backend.device)]
    if c_rows is not None:
        c = randn(gen, c_rows, 6, dtype=torch.float64)
        if kwargs.get("margin"):
            c = q + 0.8 * c
        inputs.append(leaf_like(c, device=backend.device))
    on_device = moved_to(backend.device, kwargs)

    def op(q, c=None):
        return backend.ops.similarity_xent(q, c, **on_device)

    # The CUDA backward accumulates with float atomics (docs/gpu-hazards.md): two backward passes may differ in
    # the last bits, which gradcheck's reentrancy check would call a failure at its default tolerance of 0.
    nondet_tol = 1e-12 if backend.name == "cuda" else 0.0
    # Both Triton schemes in fast_mode (a random projection of the Jacobian: the full one through the interpreter
    # takes 3-6 s a case), and the torch backend's mixed path (CI time); the full Jacobian is checked on the torch
    # backend, and every scheme against the float64 oracle above.
    assert gradcheck(op, tuple(inputs), eps=1e-6, atol=1e-6, rtol=1e-4, nondet_tol=nondet_tol,
                     fast_mode=backend.name in ("triton", "triton-dense", "torch-mixed"))


@pytest.mark.parametrize("dtype, magnitude", HUGE_OP_MAGNITUDES, ids=[huge_magnitude_id(c) for c in HUGE_OP_MAGNITUDES])
@pytest.mark.parametrize("name", ["in_batch_negatives", "contrastive_with_negatives", "arccon",
                                  "dims:in_batch_negatives", "dims:contrastive_with_negatives"])
def test_huge_rows(backend, name, dtype, magnitude):
    """Rows around 1.8e19 (float32, bfloat16: squared norms and dots overflow) and 1e300 (float64), mixed with
    ordinary ones: the oracle's loss and gradients of the ordinary rows (cosines are scale-invariant per row)."""
    if name.startswith("dims:"):
        skip_unless_feature(backend, "similarity_xent", "dims")
        q, c, kwargs = _dims_inputs(name[5:], dtype)
    else:
        q, c, kwargs = _inputs(name, dtype)
    _check(backend, q, c, kwargs, f"{name} {dtype} x{magnitude:g}", magnitude)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_rows_in_the_dtypes_largest_binade(backend, dtype):
    """Rows whose largest entries lie in the dtype's largest binade (float32: 1.5 x 2^127 = 2.6e38; float64:
    1.5 x 2^1023), mixed with ordinary ones: each row's power-of-two scale is the largest the scale's exponent field
    holds (normalisation.row_scales clamps the exponent below the bias; one more made the scale 0: such rows lost
    their cosines, a loss of 7.98 against the oracle's 7.63)."""
    q, c, kwargs = _inputs("contrastive_with_negatives", dtype)
    # every row's largest |entry| 1.5: times 2^127 (2^1023) inside the differentiated function, in the top binade
    q, c = (x / x.abs().amax(dim=1, keepdim=True) * 1.5 for x in (q, c))
    _check(backend, q, c, kwargs, f"top binade {dtype}", 2.0**127 if dtype == torch.float32 else 2.0**1023)


def test_rows_whose_largest_entries_are_negative(backend):
    """A float32 row whose negative entries are 1e30 times its positive ones: its scale comes from its largest
    magnitude, negative entries included (taken from its largest positive entry alone, the row stayed unscaled and
    its squared norm overflowed: a loss of 7.98 against the oracle's 7.63)."""
    q, c, kwargs = _inputs("contrastive_with_negatives", torch.float32)
    q[1] = torch.where(c[1] < 0, c[1] * 1e30, c[1])  # its target's direction, stretched along the negative entries
    on_device = moved_to(backend.device, kwargs)
    (loss,), grads = outputs_and_grads(lambda q, c: backend.ops.similarity_xent(q, c, **on_device),
                                       [leaf_like(q, device=backend.device), leaf_like(c, device=backend.device)])
    (exact,), exact_grads = outputs_and_grads(lambda q, c: _prefix_oracle(q, c, **kwargs),
                                              [leaf_like(q, dtype=torch.float64), leaf_like(c, dtype=torch.float64)])
    # held to float64 at float32's tolerance, not to eager float32's error (eager's squared norms overflow here)
    assert_close(loss.cpu(), exact, 1e-5, "loss")
    for grad, want, name in zip(grads, exact_grads, ("dq", "dc")):
        assert_close(grad.cpu(), want, 1e-4, name)


# ---------------------------------------------------------------------------------------------------------
# The torch backend's "mixed" path (16-bit products on a GPU), beyond the fixture's cases (module docstring)
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(CASES) + [f"dims:{name}" for name in sorted(DIMS_CASES)])
def test_torch_mixed_path_on_every_case_in_16_bits(name, dtype):
    """Every option (groups, weights, margins, the excluded diagonal, c given or not, several tiles, single rows)
    and every dims case, in bfloat16 and float16, under the half-precision rule."""
    q, c, kwargs = _dims_inputs(name[5:], dtype) if name.startswith("dims:") else _inputs(name, dtype)
    _check(torch_mixed_backend(), q, c, kwargs, f"mixed {name} {dtype}")


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("name", ["in_batch_negatives", "contrastive_with_negatives", "dims:in_batch_negatives",
                                  "dims:contrastive_with_negatives"])
def test_torch_mixed_path_in_row_blocks(monkeypatch, name, dtype):
    """Blocks of a few rows (the tile shrunk): the gradients summed over blocks (c's, and q's shared with c's when c
    is q), and with dims the running sum carried from one prefix's frame to the next in every block."""
    import angle_kernels.torch_ops.common as torch_common

    monkeypatch.setattr(torch_common, "CHUNK_ELEMENTS", 3 * 74 * 5)  # blocks of 3 to 29 rows (38 or 74 columns)
    q, c, kwargs = _dims_inputs(name[5:], dtype) if name.startswith("dims:") else _inputs(name, dtype)
    _check(torch_mixed_backend(), q, c, kwargs, f"mixed {name} {dtype} in blocks")


@pytest.mark.parametrize("dims", [None, (8, 16, 24)], ids=["full", "dims"])
@pytest.mark.parametrize("symmetric", [True, False], ids=["c=None", "c"])
def test_torch_mixed_path_multiplies_16_bit_operands_only(monkeypatch, symmetric, dims):
    """Every matrix product of the mixed path takes 16-bit operands into a float32 result (common.product_into's
    mixed branch, the one a GPU runs with cuBLAS): at full width three per block in forward (the logits, dq, dc)
    and none in backward; with dims k per block in forward and 3k in backward. The default path on the same
    bfloat16 inputs takes none (it multiplies float32 copies)."""
    import angle_kernels.products as shared_products
    import angle_kernels.torch_ops.common as torch_common
    from angle_kernels.dispatch import raw_backend

    taken = []
    real = shared_products._mixed_product_into

    def recorded(out, a, b, add):
        taken.append((a.dtype, b.dtype, out.dtype))
        real(out, a, b, add)

    monkeypatch.setattr(shared_products, "_mixed_product_into", recorded)
    monkeypatch.setattr(torch_common, "CHUNK_ELEMENTS", 8 * 40 * (1 if dims is None else 4))  # blocks of 8 rows
    gen = generator("mixed_products", symmetric, dims)
    rows, blocks = (40, 5) if symmetric else (24, 3)
    leaves = [leaf_like(randn(gen, rows, 24, dtype=torch.bfloat16))]
    if not symmetric:
        leaves.append(leaf_like(randn(gen, 40, 24, dtype=torch.bfloat16)))
    kwargs = dict(scale=20.0, target="partner" if symmetric else "diagonal", exclude_diagonal=symmetric, dims=dims)
    c = leaves[1] if len(leaves) > 1 else None
    raw_backend("torch").similarity_xent(leaves[0], c, **kwargs).sum().backward()
    assert taken == []  # the CPU's code path is "default"
    loss = torch_mixed_backend().ops.similarity_xent(leaves[0], c, **kwargs)
    forward = len(taken)
    loss.sum().backward()
    k = 1 if dims is None else len(dims)
    assert (forward, len(taken) - forward) == ((3 * blocks, 0) if dims is None else (k * blocks, 3 * k * blocks))
    assert set(taken) == {(torch.bfloat16, torch.bfloat16, torch.float32)}


@pytest.mark.parametrize("offered", [(True, True), (True, False), (False, False)],
                         ids=["mixed-addmm", "mixed-mm-only", "converted"])
@pytest.mark.parametrize("add", ["none", "out", "out_view", "other"])
def test_torch_mixed_products_take_every_torch_route(monkeypatch, offered, add):
    """products._mixed_product_into on each route a CUDA torch may offer (products.mixed_products), for a fresh product,
    one added into its output and one added to another tensor: bf16 operands, a float32 result of the right shape
    written in place (a row slice, as the backends' gradient slices are). Without a CUDA device, on the meta device
    (torch's real argument checks for the mixed-dtype overloads, which the CPU lacks; its own route, converting,
    is every test's above); with one, on it, against the float32 product."""
    import angle_kernels.products as shared_products

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("meta")
    if device.type == "cuda" and any(want and not has
                                     for want, has in zip(offered, shared_products.mixed_products(device))):
        pytest.skip(f"torch {torch.__version__} does not offer this route on {device}")
    monkeypatch.setitem(shared_products._mixed_products, device, shared_products.MixedProducts(*offered))
    monkeypatch.setattr(shared_products, "TEMPORARY_ELEMENTS", 3 * 6)  # the last route: pieces of 3 rows
    gen = generator("torch_products", *offered, add)
    a = randn(gen, 8, 5).to(device, torch.bfloat16)
    b = randn(gen, 6, 5).to(device, torch.bfloat16).T
    out = randn(gen, 12, 6).to(device)[2:10]
    other = randn(gen, 8, 6).to(device)
    added = {"none": None, "out": out, "out_view": out[:], "other": other}[add]  # out_view: out's elements
    expected = a.float() @ b.float() + (0 if added is None else added)
    shared_products._mixed_product_into(out, a, b, added)
    assert out.shape == (8, 6) and out.dtype == torch.float32
    if device.type != "meta":
        torch.testing.assert_close(out, expected)


def test_the_torch_backends_code_path_is_mixed_only_for_16_bits_with_mixed_products(monkeypatch):
    """code_path: "default" on the CPU (no mixed-dtype products) and for float32 / float64 anywhere; "mixed" for
    bfloat16 and float16 rows on a device that offers them (the meta device standing in for a GPU). The op refuses
    a path it does not have."""
    import angle_kernels.torch_ops.common as torch_common
    from angle_kernels.torch_ops import similarity_xent as torch_xent

    def path(dtype, device):
        return torch_xent.code_path(torch.empty(4, 8, dtype=dtype, device=device), None, 20.0, "partner")

    every = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
    assert {path(dtype, "cpu") for dtype in every} == {path(dtype, "meta") for dtype in every} == {"default"}
    monkeypatch.setitem(torch_common._mixed_products, torch.device("meta"), torch_common.MixedProducts(True, False))
    assert [path(dtype, "meta") for dtype in every] == ["mixed", "mixed", "default", "default"]
    with pytest.raises(ValueError, match="no code path 'fused'"):
        torch_xent.similarity_xent(torch.randn(4, 8), None, 20.0, "partner", path="fused")


def test_the_softmax_form_keeps_the_digits_of_small_losses():
    """Rows whose target dominates have losses near 1e-6 that lse - l_target rounds away at the logits' magnitude
    (scale 20, float32 ulp 2e-6): the softmax form takes them as -log1p(-r) from the softmax's mass off the target
    (torch_ops/_similarity_xent_softmax.py). ArcCon in float32 against the float64 reference: the softmax form
    within 5e-6 of it (1.5e-6 measured; the blocked form, like eager code, 2.3e-5 on this machine: the mean of
    seven rows' roundings at half an ulp of 20, so not asserted)."""
    from angle_kernels.testing.helpers import fuzz_embeddings

    h1 = fuzz_embeddings(1, 7, 14, 1.0, torch.float64)
    h2 = h1 + 0.3 * fuzz_embeddings(2, 7, 14, 1.0, torch.float64)
    kwargs = dict(scale=20.0, target="diagonal", margin=math.radians(10.0))
    reference = oracle.similarity_xent(h1, h2, **kwargs).item()
    loss = backend_or_skip("torch").ops.similarity_xent(h1.float(), h2.float(), **kwargs).item()
    assert abs(loss / reference - 1) < 5e-6


def test_torch_cpu_full_width_keeps_the_digits_of_a_small_loss_and_its_gradients():
    """Without a margin, at full width: rows whose positive sits 0.02 of noise away (a loss near 4e-7 at scale 20),
    float32 against the float64 reference, the loss to 1e-5 and both gradients to 1e-4 of their norms (log(1 - r)
    for log1p(-r) put the loss 4e-3 off, exp(-loss) - 1 for expm1 the gradients 8e-4)."""
    from angle_kernels.torch_ops import similarity_xent_paths

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(16, 64, generator=gen, dtype=torch.float64)
    c = q + 0.02 * torch.randn(16, 64, generator=gen, dtype=torch.float64)
    leaves64 = [leaf_like(x) for x in (q, c)]
    want = oracle.similarity_xent(*leaves64, scale=20.0, target="diagonal")
    want_grads = torch.autograd.grad(want, leaves64)
    assert 0 < want.item() < 1e-5
    leaves32 = [leaf_like(x.float()) for x in (q, c)]
    got = similarity_xent_paths.similarity_xent(*leaves32, 20.0, "diagonal")
    assert abs(got.item() / want.item() - 1) < 1e-5
    for grad, ref in zip(torch.autograd.grad(got, leaves32), want_grads):
        assert float((grad.double() - ref).norm() / ref.norm()) < 1e-4


@pytest.mark.parametrize("magnitude", [1e13, 1e15, 1e18])
def test_torch_cpu_huge_rows_keep_their_gradients(magnitude):
    """float32 rows of norms 1e13 to 1e18 (past 2^40) are scaled before their norms' backward: unscaled, 1 / |x|^3
    underflows and the normalisation's radial term is lost (gradients 30% off), while the value stays right."""
    from angle_kernels.torch_ops import similarity_xent_paths

    gen = torch.Generator().manual_seed(1)
    q, c = (magnitude * torch.randn(8, 32, generator=gen, dtype=torch.float64) for _ in range(2))
    leaves64 = [leaf_like(x) for x in (q, c)]
    want_grads = torch.autograd.grad(oracle.similarity_xent(*leaves64, scale=20.0, target="diagonal"), leaves64)
    leaves32 = [leaf_like(x.float()) for x in (q, c)]
    grads = torch.autograd.grad(similarity_xent_paths.similarity_xent(*leaves32, 20.0, "diagonal"), leaves32)
    for grad, ref in zip(grads, want_grads):
        assert float((grad.double() - ref).norm() / ref.norm()) < 1e-5


@pytest.mark.parametrize("target", ["diagonal", "partner"])
def test_dims_keep_the_digits_of_small_losses(target):
    """Every prefix of a dims call keeps a small loss's digits as a full-width call does: rows whose positive sits
    0.02 of noise away (losses near 1e-7 at D = 64 and 128, where lse_all - lse_pos at the logits' magnitude, 20,
    rounds to a multiple of float32's 1.9e-6: 0 or 100% off) in float32 against the float64 reference's k calls on
    the truncated inputs, the loss and the gradients (whose positive column is softmax_all - softmax_pos, the same
    cancellation); with row weights and group ids for the partner target (two softmaxes per tile)."""
    gen = generator("small dims losses", target)
    q = randn(gen, 16, 128, dtype=torch.float64)
    if target == "diagonal":
        c = q + 0.02 * randn(gen, 16, 128, dtype=torch.float64)
        kwargs = dict(scale=20.0, target="diagonal", margin=math.radians(1.0), dims=(64, 128))
    else:
        q = torch.stack([q[:8], q[:8] + 0.02 * randn(gen, 8, 128, dtype=torch.float64)], dim=1).reshape(16, 128)
        c = None
        kwargs = dict(scale=20.0, target="partner", exclude_diagonal=True, row_weights=torch.rand(16, generator=gen),
                      group_ids=torch.arange(16) // 2, dims=(64, 128))
    upstream = torch.tensor([0.5, 1.0], dtype=torch.float64)
    leaves64 = [leaf_like(x) for x in (q, c) if x is not None]
    want = _prefix_oracle(leaves64[0], None if c is None else leaves64[1], **kwargs)
    want_grads = torch.autograd.grad(want, leaves64, upstream)
    assert 0 < want.max() < 1e-5, want
    leaves = [leaf_like(x.float()) for x in (q, c) if x is not None]
    got = backend_or_skip("torch").ops.similarity_xent(leaves[0], None if c is None else leaves[1], **kwargs)
    got_grads = torch.autograd.grad(got, leaves, upstream.float())
    assert torch.all((got.double() / want - 1).abs() < 1e-4), (got, want)
    for got_grad, want_grad in zip(got_grads, want_grads):
        assert (got_grad.double() - want_grad).norm() <= 1e-4 * want_grad.norm()


@pytest.mark.parametrize("form", ["cpu-softmax", "blocked"])
@pytest.mark.parametrize("dims", [None, (4, 8)], ids=["full", "dims"])
def test_torch_gradient_of_c_alone(form, dims):
    """Only c requiring gradients (a frozen query encoder): the forward still forms them and backward gives c the
    oracle's gradient, in the CPU softmax form and in the blocked form a GPU runs."""
    from angle_kernels.torch_ops import similarity_xent as blocked
    from angle_kernels.torch_ops import similarity_xent_paths

    gen = generator("gradient_of_c_alone", form, dims)
    q, c = randn(gen, 6, 8, dtype=torch.float64), leaf_like(randn(gen, 6, 8, dtype=torch.float64))
    compute = similarity_xent_paths.similarity_xent if form == "cpu-softmax" else blocked.similarity_xent
    compute(q, c, 20.0, "diagonal", dims=dims, path="default").sum().backward()
    exact = leaf_like(c)
    _prefix_oracle(q, exact, dims=dims, scale=20.0, target="diagonal").sum().backward()
    assert_close(c.grad, exact.grad, 1e-12, "dc")

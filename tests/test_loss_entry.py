"""What every loss call does around its computation (contract.loss_entry): it computes the same inside a
torch.autocast region as outside it, and it refuses second derivatives with a clear error.

Autocast (the AMP recipe puts the loss inside a region) would run the ops' products in 16 bits, mixing dtypes inside
the backends' autograd Functions (it raised: `KeyError: torch.bfloat16`, "mat1 and mat2 must have the same dtype"),
round loss terms to 16 bits, and refuse to stack bfloat16 rows in a float16 region. The losses, their formulas and
the ops run with autocast off (contract.outside_autocast), so a call inside a region gives the value and gradients of
the same call outside it, bit for bit: float32 embeddings stay float32, 16-bit embeddings compute as 16-bit
embeddings do anywhere. Backward called inside the region (PyTorch's recipe calls it after) gives the same
gradients: the loss's own autograd nodes run their backward with autocast off (contract.backward_outside_autocast).

The backends' backward passes are not differentiable (gradients formed in forward, kernels): a second derivative
(create_graph=True, a gradient penalty) silently took their gradients as constants; it now raises.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

import angle_kernels as ak
from angle_kernels import dispatch
from angle_kernels.dispatch import resolve_backend

GTE = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
GRADED = torch.tensor([0.1, 0.5, 0.5, 0.9]).repeat_interleave(2)
BINARY = torch.tensor([1.0, 0.0, 1.0, 1.0]).repeat_interleave(2)


def _laid_out(y: torch.Tensor) -> dict[str, torch.Tensor]:
    """The rows the calls take, made from y [6, 8, D] before the region (stacking them is the caller's work): y's
    six groups of rows, four pairs (y[0, k], y[1, k]) on rows 2k and 2k + 1 ("pairs", [8, D]), and (query,
    positive, negative) triples in groups of three ("triples", [24, D])."""
    return {"y": y, "pairs": torch.stack((y[0, :4], y[1, :4]), dim=1).reshape(8, -1),
            "triples": torch.stack((y[0], y[1], y[2]), dim=1).reshape(24, -1)}


CALLS = {
    "cosine_loss": lambda r: ak.cosine_loss(GRADED, r["pairs"]),
    "cosine_loss dims": lambda r: ak.cosine_loss(GRADED, r["pairs"], dims=(16, 8, 4), dim_weights=(1.0, 0.5, 2.0)),
    "angle_loss": lambda r: ak.angle_loss(GRADED, r["pairs"]),
    "in_batch_negative_loss": lambda r: ak.in_batch_negative_loss(BINARY, r["pairs"]),
    "contrastive_with_negative_loss": lambda r: ak.contrastive_with_negative_loss(r["y"][0], r["y"][1], r["y"][2]),
    "arccon_loss": lambda r: ak.arccon_loss(r["y"][0], r["y"][1]),
    "triplet_loss": lambda r: ak.triplet_loss(r["y"][0], r["y"][1], r["y"][2]),
    "mnrl": lambda r: ak.multiple_negatives_ranking_loss(r["y"][0], r["y"][1], (r["y"][2],)),
    "mnrl dims": lambda r: ak.multiple_negatives_ranking_loss(r["y"][0], r["y"][1], dims=(16, 8)),
    "mnrl gte hardness": lambda r: ak.multiple_negatives_ranking_loss(
        r["y"][0], r["y"][1], (r["y"][2],), directions=GTE, hardness_mode="all_negatives", hardness_strength=2.0),
    "mnrl filter dims": lambda r: ak.multiple_negatives_ranking_loss(
        r["y"][0], r["y"][1], (r["y"][2],), false_negative_margin=0.1, dims=(16, 8)),
    "mnrl dot": lambda r: ak.multiple_negatives_ranking_loss(r["y"][0], r["y"][1], (r["y"][2],), similarity="dot",
                                                             scale=1.0),
    "mnrl dot dims": lambda r: ak.multiple_negatives_ranking_loss(r["y"][0], r["y"][1], similarity="dot", scale=1.0,
                                                                  dims=(16, 8)),
    "gist_loss": lambda r: ak.gist_loss(r["y"][0], r["y"][1], r["y"][3].detach(), r["y"][4].detach(), (r["y"][2],),
                                        (r["y"][5].detach(),)),
    "AngleLoss A": lambda r: ak.AngleLoss(dataset_format="A", cosine_w=1.0)(BINARY, r["pairs"]),
    "AngleLoss B": lambda r: ak.AngleLoss(dataset_format="B")(None, r["pairs"]),
    "AngleLoss C gte": lambda r: ak.AngleLoss(dataset_format="C", ibn_partition="gte")(None, r["triples"]),
    "ArcCSELoss": lambda r: ak.ArcCSELoss()(r["y"][0], r["y"][1], r["y"][2], r["y"][3], r["y"][4]),
}


def _value_and_grad(call, y: torch.Tensor, autocast_dtype: torch.dtype | None = None):
    """The call's loss and the gradient of y, the call inside an autocast region of that dtype (None: none)."""
    leaf = y.detach().clone().requires_grad_()
    rows = _laid_out(leaf)
    region = (torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None
              else torch.autocast("cpu", enabled=False))
    with region:
        loss = call(rows)
    loss.backward()
    return loss.detach(), leaf.grad


@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize("embedding_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
def test_a_loss_inside_autocast_computes_as_outside(name, embedding_dtype, autocast_dtype):
    y = torch.randn(6, 8, 16, generator=torch.Generator().manual_seed(0)).to(embedding_dtype)
    value, grad = _value_and_grad(CALLS[name], y)
    value_inside, grad_inside = _value_and_grad(CALLS[name], y, autocast_dtype)
    assert value_inside.dtype == value.dtype == torch.float32
    assert torch.equal(value_inside, value), f"{name}: {value_inside.item()!r} inside autocast, {value.item()!r}"
    assert grad_inside.dtype == grad.dtype == embedding_dtype
    assert torch.equal(grad_inside, grad), f"{name}: gradients differ by {(grad_inside - grad).abs().max().item()}"


@pytest.mark.parametrize("op", ["pair_scores", "similarity_xent", "similarity_lse"])
def test_an_op_called_inside_autocast_computes_as_outside(op):
    ops = resolve_backend(None, torch.zeros(1))
    q, c = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1)).unbind(0)
    calls = {"pair_scores": lambda: ops.pair_scores(torch.stack((q, c), dim=1), True)[0].sum(),
             "similarity_xent": lambda: ops.similarity_xent(q, c, 20.0, "diagonal"),
             "similarity_lse": lambda: ops.similarity_lse(q, c, 20.0, penalty=1.0, penalty_on="other").sum()}
    outside = calls[op]()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = calls[op]()
    assert torch.equal(inside, outside)


def test_the_losses_leave_the_region_as_they_found_it():
    y = torch.randn(4, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ak.multiple_negatives_ranking_loss(y[:2], y[2:])
        assert torch.is_autocast_enabled("cpu")
        assert torch.mm(y, y.T).dtype == torch.bfloat16  # the caller's own products still autocast


@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize("embedding_dtype", [torch.float32, torch.bfloat16])
def test_backward_inside_autocast_computes_as_after_the_region(name, embedding_dtype):
    """The loss and its backward in one region (PyTorch advises backward after it; both inside are common): the
    backends' backward passes ran their products under autocast, which raised a dtype mismatch in angle_loss's
    ("Input dtypes must be the same"; AngleLoss, the AnglELoss drop-in) and rounded the others' gradients to 16 bits
    (1.9e-2 relative error for the CoSENTLoss drop-in, 5.4e-2 for GISTEmbedLoss, against their parents' 4e-4).
    Each node the loss made now runs its backward with autocast off: the gradient of the same call with backward
    after the region, bit for bit."""
    y = torch.randn(6, 8, 16, generator=torch.Generator().manual_seed(0)).to(embedding_dtype)
    _, grad = _value_and_grad(CALLS[name], y, torch.bfloat16)
    leaf = y.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing to warn about: the loss's backward leaves the region
            CALLS[name](_laid_out(leaf)).backward()
        assert torch.is_autocast_enabled("cpu")
    assert leaf.grad.dtype == embedding_dtype
    assert torch.equal(leaf.grad, grad), f"{name}: gradients differ by {(leaf.grad - grad).abs().max().item()}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["angle_loss", "cosine_loss dims", "mnrl gte hardness", "mnrl filter dims",
                                  "gist_loss", "ArcCSELoss"])
def test_backward_inside_autocast_on_cuda_computes_as_after_the_region(name, monkeypatch):
    """The case above on a GPU, where autograd runs a CUDA node on its device's own thread and the backends' GPU
    Functions compute (the pre-hook that leaves the region must reach them there too). Compared within 1e-5, not bit
    for bit: a GPU backward may add in another order; gradients rounded to bf16 would be ~1e-2 off."""
    monkeypatch.setitem(globals(), "GRADED", GRADED.cuda())  # the calls' labels, looked up when they run
    monkeypatch.setitem(globals(), "BINARY", BINARY.cuda())
    y = torch.randn(6, 8, 16, generator=torch.Generator().manual_seed(0)).cuda()
    after, inside = y.detach().clone().requires_grad_(), y.detach().clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = CALLS[name](_laid_out(after))
    loss.backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            CALLS[name](_laid_out(inside)).backward()
    assert not [w for w in caught if "autocast" in str(w.message)]
    torch.testing.assert_close(inside.grad, after.grad, rtol=1e-5, atol=1e-7)


PUBLIC_OPS = {
    "pair_scores": lambda q, c: sum(t.sum() for t in dispatch.pair_scores(torch.stack((q, c), dim=1), True)),
    "pair_scores dims": lambda q, c: dispatch.pair_scores(torch.stack((q, c), dim=1), True, dims=(8, 16))[1].sum(),
    "ranking_loss": lambda q, c: dispatch.ranking_loss(20.0 * (q.float() * c.float()).sum(1), GRADED),
    "similarity_xent": lambda q, c: dispatch.similarity_xent(q, c, 20.0, "diagonal", margin=0.1),
    "similarity_lse": lambda q, c: dispatch.similarity_lse(q, c, 20.0, penalty=1.0, penalty_on="other").sum(),
    "similarity_lse reference dims": lambda q, c: dispatch.similarity_lse(
        q, c, 1.0, exclude="target", normalize=False, dims=(8, 16), reference=c).sum(),
}


@pytest.mark.parametrize("name", list(PUBLIC_OPS))
@pytest.mark.parametrize("embedding_dtype", [torch.float32, torch.bfloat16])
def test_backward_inside_autocast_of_a_public_op_computes_as_after_the_region(name, embedding_dtype, monkeypatch):
    """The public ops (dispatch.pair_scores, ...) leave the region in backward as the losses do: their backward
    passes ran under autocast, with a warning, which raised a dtype mismatch in pair_scores' ("Input dtypes must be
    the same") and rounded similarity_lse's gradients to 16 bits (1.2e-2 off for float32 rows)."""
    from angle_kernels import contract
    monkeypatch.setattr(contract, "_warned_backward_inside_autocast", False)  # each case: nothing to warn about
    q, c = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(7)).to(embedding_dtype).unbind(0)
    after = [t.clone().requires_grad_() for t in (q, c)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = PUBLIC_OPS[name](*after)
    loss.backward()
    inside = [t.clone().requires_grad_() for t in (q, c)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing to warn about: the op's backward leaves the region
            PUBLIC_OPS[name](*inside).backward()
        assert torch.is_autocast_enabled("cpu")
    for t, u in zip(inside, after):
        assert t.grad.dtype == embedding_dtype
        assert torch.equal(t.grad, u.grad), f"{name}: gradients differ by {(t.grad - u.grad).abs().max().item()}"


def test_backward_inside_autocast_leaves_the_models_backward_in_the_region():
    """Only the loss's own nodes leave the region: the encoder's backward runs under it, as eager autograd runs the
    backward of ops recorded under autocast when backward is called inside the region."""
    encoder = torch.nn.Linear(16, 16)
    seen = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        embeddings = encoder(torch.randn(8, 16, generator=torch.Generator().manual_seed(5)))
        embeddings.grad_fn.register_prehook(lambda grad_outputs: seen.append(torch.is_autocast_enabled("cpu")))
        ak.angle_loss(GRADED, embeddings).backward()
    assert seen == [True] and torch.isfinite(encoder.weight.grad).all()


def test_backward_inside_autocast_of_a_loss_computed_outside_warns_once(monkeypatch):
    """A loss computed outside a region whose backward is called inside one: its backward passes run their products
    under autocast (16-bit gradients, or a dtype-mismatch error naming nothing), so it warns, once."""
    from angle_kernels import contract
    monkeypatch.setattr(contract, "_warned_backward_inside_autocast", False)
    y = torch.randn(8, 16, requires_grad=True)
    losses = [ak.cosine_loss(GRADED, y), ak.cosine_loss(GRADED, y)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.warns(UserWarning, match=r"inside a torch.autocast region.*Call backward\(\) after the region"):
            losses[0].backward()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            losses[1].backward()  # once per process
    monkeypatch.setattr(contract, "_warned_backward_inside_autocast", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ak.cosine_loss(GRADED, y)
        loss.backward()  # after the region: nothing to say


def test_a_loss_whose_tensors_come_in_a_list_computes_outside_autocast_too():
    """A loss taking its rows as a list (the sentence-transformers integration's columns) leaves the region for the
    list's first tensor: the products between its ops run in float32, not in the region's 16 bits."""
    from angle_kernels.contract import loss_entry

    products = loss_entry(lambda model, rows: rows[0] @ rows[1].T)
    a, b = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(6)).unbind(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = products(None, [a, b])
    assert inside.dtype == torch.float32 and torch.equal(inside, a @ b.T)


@pytest.mark.parametrize("name", list(CALLS))
def test_a_second_derivative_is_refused(name):
    y = torch.randn(6, 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).requires_grad_()
    loss = CALLS[name](_laid_out(y))
    with pytest.raises(RuntimeError, match="first derivatives only.*create_graph=True"):
        torch.autograd.grad(loss + (y**2).sum(), y, create_graph=True)
    (grad,) = torch.autograd.grad(CALLS[name](_laid_out(y)), y)  # first derivatives as before
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("name", list(CALLS))
def test_a_batched_backward_is_refused_saying_what_to_use(name):
    """autograd's batched backward (is_grads_batched=True; jacobian's vectorize=True) vmaps every node's backward over
    the upstream gradients: the backends' backward passes failed inside ("vmap: aten::copy_ ... is not possible",
    "Batching rule not implemented for aten::detach"), naming nothing of the loss, or, for a few losses on the
    PyTorch backend only, computed. Refused by the loss's first node, whichever backend computes it."""
    y = torch.randn(6, 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).requires_grad_()
    refusal = r"one upstream gradient per backward: a batched backward .*jacobian's default vectorize=False"
    with pytest.raises(RuntimeError, match=refusal):
        torch.autograd.grad(CALLS[name](_laid_out(y)), y, grad_outputs=torch.tensor([1.0, 2.0], dtype=torch.float64),
                            is_grads_batched=True)
    with pytest.raises(RuntimeError, match=refusal):
        torch.autograd.functional.jacobian(lambda leaf: CALLS[name](_laid_out(leaf)), y, vectorize=True)
    jacobian = torch.autograd.functional.jacobian(lambda leaf: CALLS[name](_laid_out(leaf)), y)  # one at a time
    torch.testing.assert_close(jacobian, torch.autograd.grad(CALLS[name](_laid_out(y)), y)[0], rtol=0, atol=0)


@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_a_torch_func_transform_is_refused_saying_what_to_use(name, transform):
    """torch.func's transforms need autograd Functions with setup_context, which the backends' do not have: grad
    failed inside an op naming setup_context, and vmap in the value checks ("calling .item() on a Tensor")."""
    y = torch.randn(6, 8, 16, generator=torch.Generator().manual_seed(7))
    call = (lambda leaf: CALLS[name](_laid_out(leaf))) if transform == "grad" else (
        lambda batch: CALLS[name](_laid_out(batch)))
    transformed = torch.func.grad(call) if transform == "grad" else torch.func.vmap(call)
    with pytest.raises(RuntimeError, match=r"torch\.func transforms .*loss\.backward\(\) or torch\.autograd\.grad"):
        transformed(y if transform == "grad" else y[None].expand(2, -1, -1, -1))


@pytest.mark.parametrize("name", list(CALLS))
def test_forward_mode_ad_is_refused_naming_the_dual_argument(name):
    """A dual tensor of torch.autograd.forward_ad reached the backends' autograd Functions, which have no jvp: torch's
    NotImplementedError there named neither the loss nor what to use. Plain tensors inside a dual level still
    compute."""
    import torch.autograd.forward_ad as forward_ad

    y = torch.randn(6, 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    with forward_ad.dual_level():
        assert torch.isfinite(CALLS[name](_laid_out(y)))
        dual = forward_ad.make_dual(y, torch.ones_like(y))
        with pytest.raises(RuntimeError, match=r"is a dual tensor .*forward-mode AD.*loss\.backward\(\) or "
                                               r"torch\.autograd\.grad"):
            CALLS[name](_laid_out(dual))


def test_a_torch_without_forward_ads_level_global_still_computes(monkeypatch):
    """The dual-tensor refusal asks forward_ad's private module global _current_level whether a dual level is entered
    (torch has no public way): a torch without it must still compute every loss, not raise AttributeError."""
    import torch.autograd.forward_ad as forward_ad

    monkeypatch.delattr(forward_ad, "_current_level")
    y = torch.randn(6, 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    for call in CALLS.values():
        assert torch.isfinite(call(_laid_out(y)))


def test_a_loss_without_autograd_is_a_plain_tensor():
    y = torch.randn(4, 8, requires_grad=True)
    with torch.no_grad():
        assert ak.multiple_negatives_ranking_loss(y[:2], y[2:]).grad_fn is None
    assert ak.multiple_negatives_ranking_loss(y[:2].detach(), y[2:].detach()).grad_fn is None


def test_inference_tensors_as_the_side_that_does_not_train():
    """Positives or a guide's embeddings from SentenceTransformer.encode (made under torch.inference_mode) beside
    queries that train: the backends save their inputs for backward, and autograd refused ("Inference tensors
    cannot be saved for backward") where eager formulas compute; the loss takes a copy of such a tensor."""
    y = torch.randn(6, 8, 16, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        frozen = y.clone()
    assert frozen.is_inference()
    calls = {
        "mnrl gte": lambda q, side: ak.multiple_negatives_ranking_loss(q, side[1], (side[2],), directions=GTE),
        "gist_loss": lambda q, side: ak.gist_loss(q, side[1], side[3], side[4], (side[2],), (side[5],)),
        "cosine_loss": lambda q, side: ak.cosine_loss(GRADED, torch.stack((q[:4], side[1, :4]), 1).reshape(8, -1)),
    }
    for name, call in calls.items():
        grads = []
        for side in (y, frozen):
            q = y[0].clone().requires_grad_()
            loss = call(q, side)
            loss.backward()
            grads.append((loss.detach(), q.grad))
        assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1]), name


@pytest.mark.parametrize("op", ["pair_scores", "ranking_loss", "similarity_xent", "similarity_lse"])
def test_the_public_ops_refuse_a_second_derivative(op):
    """The ops' backward passes are not differentiable: through the public ops (angle_kernels.dispatch), a gradient
    penalty took their gradients as constants (0.95 relative error in its gradient) where the losses refused."""
    q, c = torch.randn(2, 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4)).unbind(0)
    q.requires_grad_()
    calls = {"pair_scores": lambda: dispatch.pair_scores(torch.stack((q, c), dim=1), True)[1].sum(),
             "ranking_loss": lambda: dispatch.ranking_loss(q[:, 0], GRADED.double()),
             "similarity_xent": lambda: dispatch.similarity_xent(q, c, 20.0, "diagonal"),
             "similarity_lse": lambda: dispatch.similarity_lse(q, c, 20.0).sum()}
    with pytest.raises(RuntimeError, match="first derivatives only.*create_graph=True"):
        torch.autograd.grad(calls[op](), q, create_graph=True)
    (grad,) = torch.autograd.grad(calls[op](), q)
    assert torch.isfinite(grad).all()


def test_the_guard_is_a_pre_hook_on_the_node_that_made_the_result():
    """The second-derivative guard sits on the result's autograd node, not on the tensor (Tensor.register_hook adds
    Python to every call). A public op's outputs share one node, so either output's second derivative is
    refused."""
    q, c = torch.randn(2, 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(5)).unbind(0)
    q.requires_grad_()
    loss = ak.multiple_negatives_ranking_loss(q, c)
    scores = dispatch.pair_scores(torch.stack((q, c), dim=1), True)
    assert loss._backward_hooks is None and all(t._backward_hooks is None for t in scores)
    for result in (loss, scores[0].sum(), scores[1].sum()):
        with pytest.raises(RuntimeError, match="first derivatives only.*create_graph=True"):
            torch.autograd.grad(result, q, create_graph=True, retain_graph=True)


def test_a_non_reentrant_checkpoint_recomputes_calls_that_kept_their_tiles(monkeypatch):
    """The PyTorch backend's similarity_lse keeps a call's softmax tile for backward while the tiles kept at once fit
    their budget: torch.utils.checkpoint(use_reentrant=False) recomputes the forward while the first forward's tiles
    are still reserved, so the recomputation kept fewer, saved fewer tensors, and the checkpoint raised
    CheckpointError. The budget made small here (four 8 x 8 tiles) so that MNRL's four GTE directions fill it."""
    from torch.utils.checkpoint import checkpoint

    from angle_kernels.torch_ops import _similarity_lse_softmax

    monkeypatch.setattr(_similarity_lse_softmax, "chunk_elements", lambda device: 16)
    encoder = torch.nn.Linear(16, 16, dtype=torch.float64)
    x = torch.randn(2, 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(5)).requires_grad_()

    def loss_of(rows):
        embedded = encoder(rows)
        return ak.multiple_negatives_ranking_loss(embedded[0], embedded[1], directions=GTE, backend="torch")

    def weight_gradient(loss):
        encoder.zero_grad()
        loss.backward()  # the reentrant checkpoint takes backward(), not autograd.grad
        return encoder.weight.grad

    held = _similarity_lse_softmax._KEPT.elements  # by graphs of earlier tests that are not yet collected, if any
    expected = weight_gradient(loss_of(x)).clone()
    for reentrant in (False, True):
        grad = weight_gradient(checkpoint(loss_of, x, use_reentrant=reentrant))
        torch.testing.assert_close(grad, expected, rtol=1e-12, atol=0)
    assert _similarity_lse_softmax._KEPT.elements == held  # every reservation given back


# Torch calls (every read of a tensor's shape, dtype or device is one) that a small call of each loss makes outside
# its backend op, forward: the checks, dispatch and the formula between the ops. Each one is a cost of every training
# step that the eager formula the loss replaces does not pay; a check that reads what it has read before shows here.
# gist_loss's guide on the model's device is checked where the guide is (2 reads), so a mistake names guide_anchors;
# in_batch_negative_loss reads its row weights' requires_grad once (similarity_xent takes them as constants); each
# tensor's layout is read once (a sparse one is refused by name: inputs.check_dense).
FRONT_END_TORCH_CALLS = {"multiple_negatives_ranking_loss": 43, "cosine_loss": 50, "in_batch_negative_loss": 54,
                         "gist_loss": 191}
_BACKEND_FILES = ("torch_ops/", "triton_ops/", "cuda_ops/", "normalisation.py", "formed_gradients.py")


class _FrontEndTorchCalls(torch.overrides.TorchFunctionMode):
    """Counts the torch calls made directly by angle_kernels' files other than the backends'."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.root = str(dispatch.__file__).rsplit("/", 1)[0] + "/"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        caller = sys._getframe(1).f_code.co_filename
        if caller.startswith(self.root) and not caller[len(self.root):].startswith(_BACKEND_FILES):
            self.count += 1
        with torch._C.DisableTorchFunction():
            return func(*args, **(kwargs or {}))


def test_a_small_loss_call_reads_each_fact_of_its_inputs_once_per_check():
    """Forward of each loss at 32 pairs of D = 8: at most FRONT_END_TORCH_CALLS[loss] torch calls outside the backend
    ops (the op checks once read q's shape five times and the filter tensors' six; promote_embeddings each dtype
    twice: 49, 54, 54 and 255 calls then)."""
    gen = torch.Generator().manual_seed(0)
    q, p, guide_q, guide_p = (torch.randn(32, 8, generator=gen, requires_grad=i < 2) for i in range(4))
    rows = torch.randn(64, 8, generator=gen, requires_grad=True)
    calls = {"multiple_negatives_ranking_loss": lambda: ak.multiple_negatives_ranking_loss(q, p),
             "cosine_loss": lambda: ak.cosine_loss(torch.rand(32, generator=gen).repeat_interleave(2), rows),
             "in_batch_negative_loss": lambda: ak.in_batch_negative_loss(torch.ones(64), rows),
             "gist_loss": lambda: ak.gist_loss(q, p, guide_q, guide_p)}
    for name, call in calls.items():
        call()  # the first call's one-off work (backend loading, first warnings) is no call's cost
        counting = _FrontEndTorchCalls()
        with counting:
            call()
        assert counting.count <= FRONT_END_TORCH_CALLS[name], f"{name}: {counting.count} torch calls"

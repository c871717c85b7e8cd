"""torch.compile on CPU (the PyTorch backend): every functional loss and AngleLoss is captured as one graph,
with no graph break, and the compiled forward + backward equals eager.

Each loss is compiled with fullgraph=True (a graph break raises; the test then reports
torch._dynamo.explain's reasons) and the "aot_eager" backend, which traces forward and backward through
AOTAutograd (our autograd.Functions included) without generating C++. The same check with the default inductor backend
takes 15-25 s per loss on a 2-core machine: opt in with ANGLE_KERNELS_TEST_INDUCTOR=1. What does not trace whole
yet (BREAKING: Matryoshka dims, the false-negative filter with dot products) is compiled without fullgraph=True
and must equal eager all the same.

On a GPU with the CUDA extension built, the same losses with backend="cuda" go through inductor too (the
extension's ops must trace through their fake implementations and autograd formulas).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import angle_kernels as ak
from angle_kernels.testing.helpers import backend_or_skip
from angle_kernels.testing.oracle import rel_err

PAIRS = 6
GRADED = torch.tensor([0.0, 2.0, 1.0, 1.0, 3.0, 0.5]).repeat_interleave(2)
BINARY = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0]).repeat_interleave(2)


def loss_functions(backend: str) -> dict:
    """name -> loss of one [12, D] tensor on `backend` (the rows are split where a loss takes several inputs)."""
    return {
        "cosine_loss": lambda x: ak.cosine_loss(GRADED.to(x), x, 20.0, backend=backend),
        "angle_loss": lambda x: ak.angle_loss(GRADED.to(x), x, 20.0, pooling_strategy="sum", backend=backend),
        "angle_loss_mean": lambda x: ak.angle_loss(GRADED.to(x), x, 1.0, pooling_strategy="mean", backend=backend),
        "in_batch_negative_loss": lambda x: ak.in_batch_negative_loss(BINARY.to(x), x, 20.0, backend=backend),
        "in_batch_negative_loss_groups": lambda x: ak.in_batch_negative_loss(
            BINARY.to(x), x, 20.0, group_ids=torch.tensor([0, 1, 2, 3, 4, 5, 0, 7, 8, 9, 10, 11], device=x.device),
            backend=backend),
        "contrastive_with_negative_loss": lambda x: ak.contrastive_with_negative_loss(x[0:4], x[4:8], x[8:12], 20.0,
                                                                                      backend=backend),
        "arccon_loss": lambda x: ak.arccon_loss(x[0:6], x[6:12], backend=backend),
        "triplet_loss": lambda x: ak.triplet_loss(x[0:4], x[4:8], x[8:12], margin=0.1, backend=backend),
        "AngleLoss_A": lambda x: ak.AngleLoss(cosine_w=1.0, dataset_format="A", backend=backend)(BINARY.to(x), x),
        "AngleLoss_B": lambda x: ak.AngleLoss(dataset_format="B", backend=backend)(None, x),
        "AngleLoss_C": lambda x: ak.AngleLoss(cosine_w=0.5, dataset_format="C", backend=backend)(None, x),
    }


GUIDE = torch.randn(2 * PAIRS, 24, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
ALL_DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")


def similarity_lse_losses(backend: str) -> dict:
    """name -> loss of one [12, D] tensor: the losses computed from similarity_lse blocks, with the options that
    make a block take one tensor twice (a query block against itself, GIST's anchors against themselves) or filter
    by the model's own scores or by a guide's."""
    return {
        "mnrl_all_directions": lambda x: ak.multiple_negatives_ranking_loss(x[0:6], x[6:12], directions=ALL_DIRECTIONS,
                                                                            backend=backend),
        "mnrl_hardness": lambda x: ak.multiple_negatives_ranking_loss(
            x[0:6], x[6:12], hardness_mode="in_batch_negatives", hardness_strength=2.0, backend=backend),
        "mnrl_false_negative_filter": lambda x: ak.multiple_negatives_ranking_loss(
            x[0:6], x[6:12], false_negative_margin=0.1, backend=backend),
        "gist_loss": lambda x: ak.gist_loss(x[0:6], x[6:12], GUIDE[0:6].to(x), GUIDE[6:12].to(x), backend=backend),
    }


# On the torch backend; on a GPU, test_cuda_backend_one_graph_and_equal_to_eager runs loss_functions("cuda").
LOSSES = {**loss_functions("torch"), **similarity_lse_losses("torch")}


def embeddings(name: str, dtype=torch.float64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sorted(LOSSES).index(name))
    return torch.randn(2 * PAIRS, 16, generator=gen, dtype=dtype)


def eager_and_compiled(fn, x, compiled):
    results = []
    for f in (fn, compiled):
        leaf = x.clone().requires_grad_()
        value = f(leaf)
        value.backward()
        results.append((value.detach(), leaf.grad))
    return results


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_one_graph_and_equal_to_eager(name):
    """fullgraph=True raises at the first graph break; torch._dynamo.explain then says where and why."""
    torch._dynamo.reset()
    compiled = torch.compile(LOSSES[name], backend="aot_eager", fullgraph=True)
    try:
        (ref_value, ref_grad), (value, grad) = eager_and_compiled(LOSSES[name], embeddings(name), compiled)
    except torch._dynamo.exc.Unsupported:
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(LOSSES[name])(embeddings(name))
        reasons = [f"{r.reason} at {r.user_stack[-1] if r.user_stack else '?'}" for r in explanation.break_reasons]
        pytest.fail(f"{name}: {explanation.graph_break_count} graph break(s): {reasons}")
    assert torch.isfinite(value) and rel_err(value, ref_value) < 1e-12
    assert rel_err(grad, ref_grad) < 1e-10


# Losses whose graphs break on the CPU (README, torch.compile): Matryoshka dims (the torch backend's dims paths write
# into column views with out=, and similarity_xent's compares the upstream gradient with the one its forward formed
# gradients for) and the false-negative filter with dot products (the blocked form compares data pointers).
BREAKING = {
    "cosine_loss_dims": lambda x: ak.cosine_loss(GRADED.to(x), x, 20.0, dims=(16, 8), backend="torch"),
    "in_batch_negative_loss_dims": lambda x: ak.in_batch_negative_loss(BINARY.to(x), x, 20.0, dims=(16, 8, 4),
                                                                       backend="torch"),
    "mnrl_dims": lambda x: ak.multiple_negatives_ranking_loss(x[0:6], x[6:12], dims=(16, 8), backend="torch"),
    "mnrl_all_directions_dims": lambda x: ak.multiple_negatives_ranking_loss(
        x[0:6], x[6:12], directions=ALL_DIRECTIONS, dims=(16, 8), backend="torch"),
    "mnrl_false_negative_filter_dot": lambda x: ak.multiple_negatives_ranking_loss(
        x[0:6], x[6:12], false_negative_margin=0.1, similarity="dot", scale=1.0, backend="torch"),
}


@pytest.mark.parametrize("name", sorted(BREAKING))
def test_with_graph_breaks_equal_to_eager(name):
    """What does not trace whole yet still compiles (without fullgraph=True: dynamo runs the op eagerly between
    graphs) and equals eager, values and gradients."""
    torch._dynamo.reset()
    fn = BREAKING[name]
    x = torch.randn(2 * PAIRS, 16, generator=torch.Generator().manual_seed(sorted(BREAKING).index(name)),
                    dtype=torch.float64)
    (ref_value, ref_grad), (value, grad) = eager_and_compiled(fn, x, torch.compile(fn, backend="aot_eager"))
    assert torch.isfinite(value) and rel_err(value, ref_value) < 1e-12
    assert rel_err(grad, ref_grad) < 1e-10


@pytest.mark.parametrize("operands", [torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("into_out", [False, True], ids=["add-another-tensor", "add-out-itself"])
def test_a_compiled_sum_of_products_into_a_column_slice_equals_eager(operands, into_out):
    """The backends' matrix products summed into a column slice of a larger tensor (a prefix's columns of a
    gradient), traced whole: out = add + a @ b in the slice, the columns around it untouched, as in eager; `add`
    another tensor or the slice itself."""
    from angle_kernels.products import product_into

    compute = torch.float64 if operands == torch.float64 else torch.float32
    gen = torch.Generator().manual_seed(int(into_out))
    a, b = (torch.randn(shape, generator=gen, dtype=torch.float64).to(operands) for shape in ((5, 4), (4, 3)))
    base, addend = (torch.randn(shape, generator=gen, dtype=torch.float64).to(compute) for shape in ((5, 8), (5, 3)))

    def summed(base, a, b, addend):
        result = base.clone()
        out = result[:, 2:5]
        product_into(out, a, b, add=out if into_out else addend)
        return result

    torch._dynamo.reset()
    ref = summed(base, a, b, addend)
    value = torch.compile(summed, backend="aot_eager", fullgraph=True)(base, a, b, addend)
    expected = base.clone()
    expected[:, 2:5] = (base[:, 2:5] if into_out else addend) + a.to(compute) @ b.to(compute)
    tolerance = 1e-12 if compute == torch.float64 else 1e-6  # float32 sums may round apart in another order
    assert rel_err(ref, expected) < tolerance and rel_err(value, ref) < tolerance


@pytest.mark.parametrize("name", ["cosine_loss", "in_batch_negative_loss"])
def test_a_new_batch_size_recompiles_without_a_graph_break(name):
    """The second size makes dynamo recompile with symbolic shapes; that graph must be whole too."""
    torch._dynamo.reset()
    compiled = torch.compile(LOSSES_OF_SIZE[name], backend="aot_eager", fullgraph=True)
    for pairs in (6, 11):
        gen = torch.Generator().manual_seed(pairs)
        x = torch.randn(2 * pairs, 16, generator=gen, dtype=torch.float64)
        labels = torch.randint(0, 3, (pairs,), generator=gen).to(torch.float64).repeat_interleave(2)
        fn = LOSSES_OF_SIZE[name]
        results = []
        for f in (fn, compiled):
            leaf = x.clone().requires_grad_()
            value = f(labels, leaf)
            value.backward()
            results.append((value.detach(), leaf.grad))
        (ref_value, ref_grad), (value, grad) = results
        assert rel_err(value, ref_value) < 1e-12 and rel_err(grad, ref_grad) < 1e-10, pairs


def test_a_float_setting_that_changes_between_calls_traces_whole():
    """Two AngleLoss modules that differ only in a tau, each compiled with fullgraph=True: the second call makes
    dynamo treat the float as symbolic, and the settings' finiteness check must trace on it (math.isfinite did not:
    `Unsupported: torch.* op returned non-Tensor` at the second module, with nothing naming the setting)."""
    torch._dynamo.reset()
    x = torch.randn(2 * PAIRS, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    labels = BINARY.to(x)
    for tau in (20.0, 10.0, 5.0):
        module = ak.AngleLoss(dataset_format="A", ibn_tau=tau, backend="torch")
        compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
        # compiled first: a module's first call parses its settings (an eager call before would take that out)
        (value, grad), (ref_value, ref_grad) = eager_and_compiled(lambda x: compiled(labels, x), x,
                                                                  lambda x: module(labels, x))
        assert rel_err(value, ref_value) < 1e-12 and rel_err(grad, ref_grad) < 1e-10, tau


@pytest.mark.parametrize("fullgraph", [False, True])
def test_bad_input_to_a_compiled_loss_still_raises_with_the_losss_message(fullgraph):
    """Mismatched shapes and a wrong option reach a compiled loss's checks as they do an eager one's: without
    fullgraph the loss's ValueError itself propagates; with fullgraph=True dynamo raises its own error, which carries
    the loss's message (README, limits of compiled losses). Nothing computes a value."""
    for shape, directions, message in [((5, 16), ("query_to_doc",), "positives must have the shape of queries"),
                                       ((6, 16), ("query_to_bogus",), "query_to_bogus")]:
        torch._dynamo.reset()
        compiled = torch.compile(
            lambda q, p: ak.multiple_negatives_ranking_loss(q, p, directions=directions, backend="torch"),
            backend="aot_eager", fullgraph=fullgraph)
        expected = ValueError if not fullgraph else torch._dynamo.exc.Unsupported
        with pytest.raises(expected) as raised:
            compiled(torch.randn(*shape, requires_grad=True), torch.randn(6, 16, requires_grad=True))
        assert message in str(raised.value)


LOSSES_OF_SIZE = {
    "cosine_loss": lambda labels, x: ak.cosine_loss(labels, x, backend="torch"),
    "in_batch_negative_loss": lambda labels, x: ak.in_batch_negative_loss((labels > 0).to(x.dtype), x, backend="torch"),
}


@pytest.mark.skipif(os.environ.get("ANGLE_KERNELS_TEST_INDUCTOR", "0") in ("", "0"),
                    reason="inductor compiles C++ (15-25 s per loss on 2 cores): set ANGLE_KERNELS_TEST_INDUCTOR=1")
@pytest.mark.parametrize("name", ["cosine_loss", "in_batch_negative_loss"])
def test_inductor_float32(name):
    torch._dynamo.reset()
    compiled = torch.compile(LOSSES[name], fullgraph=True)
    x = embeddings(name, torch.float32)
    (ref_value, ref_grad), (value, grad) = eager_and_compiled(LOSSES[name], x, compiled)
    assert rel_err(value, ref_value) < 1e-5
    assert rel_err(grad, ref_grad) < 1e-4


def test_inductor_float32_on_the_softmax_form_of_the_similarity_softmax():
    """One inductor case whatever ANGLE_KERNELS_TEST_INDUCTOR says: the CPU softmax form of similarity_xent (unweighted
    rows: MNRL, contrastive, ArcCon) under the default backend. Its dq once added a product with `alpha`, which
    inductor (torch 2.13) fuses into an addmm that drops alpha: the queries' gradient came out times B / scale."""
    name = "contrastive_with_negative_loss"
    torch._dynamo.reset()
    compiled = torch.compile(LOSSES[name], fullgraph=True)
    x = embeddings(name, torch.float32)
    (ref_value, ref_grad), (value, grad) = eager_and_compiled(LOSSES[name], x, compiled)
    assert rel_err(value, ref_value) < 1e-5
    assert rel_err(grad, ref_grad) < 1e-4


@pytest.mark.parametrize("name", sorted(loss_functions("cuda")))
def test_cuda_backend_one_graph_and_equal_to_eager(name):
    """The CUDA extension's ops through torch.compile(fullgraph=True) (their fake implementations and autograd
    formulas) with the default inductor backend: one graph, equal to eager. Needs the built extension on a GPU."""
    cuda = backend_or_skip("cuda")
    fn = loss_functions("cuda")[name]
    x = embeddings(name, torch.float32).to(cuda.device)
    torch._dynamo.reset()
    with ak.input_checks(False):  # the NaN/Inf checks synchronise with the host: not traceable
        (ref_value, ref_grad), (value, grad) = eager_and_compiled(fn, x, torch.compile(fn, fullgraph=True))
    assert torch.isfinite(value) and rel_err(value, ref_value) < 1e-6
    assert rel_err(grad, ref_grad) < 1e-5


# --------------------------------------------------------------------------------------------------------
# Compiled inside a torch.autocast region (PyTorch's AMP recipe: the forward and the loss inside it, backward
# outside). AOTAutograd traces backward under the forward's autocast by default, which the backends' backward
# passes do not support (their products would run in 16 bits: 16-bit gradients, or a dtype mismatch between the
# operands), so the losses and ops compute outside the graph there: equal to eager all the same.
# --------------------------------------------------------------------------------------------------------
AUTOCAST_LOSSES = ("cosine_loss", "angle_loss", "triplet_loss", "mnrl_all_directions", "gist_loss")


def _encoded_loss(fn):
    """A step of the AMP recipe on the CPU: a Linear encoder and the loss inside a bfloat16 autocast region."""
    encoder = torch.nn.Linear(24, 16)
    torch.nn.init.normal_(encoder.weight, generator=torch.Generator().manual_seed(5))

    def step(features):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fn(encoder(features))

    return encoder, step


def _value_and_weight_grad(encoder, step, features):
    encoder.zero_grad()
    value = step(features)
    value.backward()  # outside the region, as PyTorch advises
    return value.detach(), encoder.weight.grad.clone()


@pytest.mark.parametrize("name", AUTOCAST_LOSSES)
def test_compiled_inside_autocast_equals_eager(name, monkeypatch):
    """Before: cosine_loss's and triplet_loss's weight gradients came back rounded to 16 bits (3.4e-3 and 2.4e-3
    from eager's), angle_loss, MNRL with directions and gist_loss raised a dtype mismatch."""
    from angle_kernels import contract
    monkeypatch.setattr(contract, "_warned_autocast_backward", False)
    torch._dynamo.reset()
    encoder, step = _encoded_loss(LOSSES[name])
    features = torch.randn(2 * PAIRS, 24, generator=torch.Generator().manual_seed(1))
    ref_value, ref_grad = _value_and_weight_grad(encoder, step, features)
    with pytest.warns(UserWarning, match="backward_pass_autocast = 'off'"):
        value, grad = _value_and_weight_grad(encoder, torch.compile(step, backend="aot_eager"), features)
    assert torch.isfinite(value) and rel_err(value, ref_value) < 1e-6
    assert rel_err(grad, ref_grad) < 1e-6


def test_computing_outside_the_compiled_graph_gives_its_advice_once(monkeypatch):
    """The advice (set backward_pass_autocast = 'off') comes with the first call computed outside the compiled graph,
    not at every training step; each call still computes."""
    from angle_kernels import contract
    monkeypatch.setattr(contract, "_warned_autocast_backward", False)
    with pytest.warns(UserWarning, match="backward_pass_autocast = 'off'"):
        assert contract.call_outside_the_graph(torch.add, torch.ones(2), 1.0).tolist() == [2.0, 2.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert contract.call_outside_the_graph(torch.add, torch.ones(2), 2.0).tolist() == [3.0, 3.0]


def test_compiled_inside_autocast_with_fullgraph_names_the_setting():
    torch._dynamo.reset()
    encoder, step = _encoded_loss(LOSSES["angle_loss"])
    with pytest.raises(torch._dynamo.exc.Unsupported, match="backward_pass_autocast"):
        torch.compile(step, backend="aot_eager", fullgraph=True)(torch.randn(2 * PAIRS, 24))


# A fresh process: angle_kernels imported before torch._dynamo, the loss compiled inside autocast before any eager
# call, so the trace itself is what first asks for contract.call_outside_the_graph (made at first use).
_COMPILED_FIRST = """
import sys, warnings
import torch
import angle_kernels as ak
from angle_kernels import contract
assert "torch._dynamo" not in sys.modules, "import angle_kernels imported torch._dynamo"
assert "call_outside_the_graph" not in vars(contract)
encoder = torch.nn.Linear(24, 16)
labels = torch.rand(6).repeat_interleave(2)
def step(features):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return ak.functional.angle_loss(labels, encoder(features))
features = torch.randn(12, 24)
try:
    torch.compile(step, backend="aot_eager", fullgraph=True)(features)
except torch._dynamo.exc.Unsupported as error:
    assert "backward_pass_autocast" in str(error), str(error)
else:
    raise AssertionError("fullgraph=True compiled a loss inside autocast whole")
torch._dynamo.reset()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    value = torch.compile(step, backend="aot_eager")(features)
assert any("backward_pass_autocast = 'off'" in str(w.message) for w in caught), [str(w.message) for w in caught]
assert torch.allclose(value, step(features)), (value, step(features))
print("ok")
"""


def test_the_import_leaves_dynamo_out_and_a_first_compile_still_breaks_the_graph():
    """`import angle_kernels` does not import torch._dynamo (1.5-2.5 s, more than torch's own import): the
    function that runs a loss outside a compiled graph is made at its first use, which a trace reaches before any
    eager call, with the same outcome: fullgraph=True raises with the advice, without it a graph break and a
    warning, the value eager's."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _COMPILED_FIRST], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-4000:]


@pytest.mark.parametrize("name", ["angle_loss", "mnrl_all_directions"])
def test_compiled_inside_autocast_traces_whole_with_backward_autocast_off(name):
    """backward_pass_autocast = 'off' traces backward as eager autograd runs a backward called outside the region:
    then the loss is part of the graph (fullgraph=True) and equal to eager."""
    torch._dynamo.reset()
    encoder, step = _encoded_loss(LOSSES[name])
    features = torch.randn(2 * PAIRS, 24, generator=torch.Generator().manual_seed(2))
    ref_value, ref_grad = _value_and_weight_grad(encoder, step, features)
    with torch._functorch.config.patch(backward_pass_autocast="off"):
        value, grad = _value_and_weight_grad(encoder, torch.compile(step, backend="aot_eager", fullgraph=True),
                                             features)
    assert rel_err(value, ref_value) < 1e-6 and rel_err(grad, ref_grad) < 1e-6


def test_an_op_compiled_inside_autocast_equals_eager(monkeypatch):
    """The public ops take the same way out of the graph (dispatch.Ops): similarity_lse over every column."""
    from angle_kernels import contract, dispatch
    monkeypatch.setattr(contract, "_warned_autocast_backward", False)
    torch._dynamo.reset()
    encoder, step = _encoded_loss(lambda x: dispatch.similarity_lse(x[0:6], x[6:12], 20.0, backend="torch").sum())
    features = torch.randn(2 * PAIRS, 24, generator=torch.Generator().manual_seed(3))
    ref_value, ref_grad = _value_and_weight_grad(encoder, step, features)
    with pytest.warns(UserWarning, match="outside the compiled graph"):
        value, grad = _value_and_weight_grad(encoder, torch.compile(step, backend="aot_eager"), features)
    assert rel_err(value, ref_value) < 1e-6 and rel_err(grad, ref_grad) < 1e-6


def test_compiled_inside_autocast_without_a_backward_traces_whole():
    """No backward to trace (no_grad, as a compiled evaluation loop under AMP runs, or no input requiring grad): the
    loss stays in the graph (fullgraph=True), without the warning, equal to eager."""
    torch._dynamo.reset()
    features = torch.randn(2 * PAIRS, 24, generator=torch.Generator().manual_seed(4))
    encoder, step = _encoded_loss(LOSSES["mnrl_all_directions"])
    with torch.no_grad():
        expected = step(features)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with torch.no_grad():
            value = torch.compile(step, backend="aot_eager", fullgraph=True)(features)
        torch._dynamo.reset()
        frozen = torch.compile(lambda x: step(x).detach(), backend="aot_eager", fullgraph=True)
        encoder.requires_grad_(False)
        assert rel_err(frozen(features), expected) < 1e-6
    assert rel_err(value, expected) < 1e-6
    assert not [w for w in said if "outside the compiled graph" in str(w.message)]


def test_a_list_of_autocast_arguments_for_backward_also_computes_outside_the_graph(monkeypatch):
    """backward_pass_autocast's third form (autocast arguments for the backward pass) turns autocast on in backward
    too: outside the graph, as with the default (it raised a dtype mismatch in compilation)."""
    from angle_kernels import contract
    monkeypatch.setattr(contract, "_warned_autocast_backward", False)
    torch._dynamo.reset()
    encoder, step = _encoded_loss(LOSSES["angle_loss"])
    features = torch.randn(2 * PAIRS, 24, generator=torch.Generator().manual_seed(5))
    ref_value, ref_grad = _value_and_weight_grad(encoder, step, features)
    with torch._functorch.config.patch(backward_pass_autocast=[{"device_type": "cpu"}]):
        with pytest.warns(UserWarning, match="outside the compiled graph"):
            value, grad = _value_and_weight_grad(encoder, torch.compile(step, backend="aot_eager"), features)
    assert rel_err(value, ref_value) < 1e-6 and rel_err(grad, ref_grad) < 1e-6


def test_older_torch_without_the_setting_or_a_reason(monkeypatch):
    """torch before 2.9 has no backward_pass_autocast (it traces backward under the forward's autocast), and
    torch.compiler.disable takes a reason from 2.8 on: the package imported and compiled with neither."""
    import types

    from angle_kernels import contract
    monkeypatch.setattr(torch._functorch, "config", types.SimpleNamespace())
    assert contract._backward_pass_autocast() == "same_as_forward"
    calls = []

    def disable(fn=None, recursive=True):  # torch 2.7's signature
        calls.append(fn)
        return fn

    monkeypatch.setattr(torch.compiler, "disable", disable)
    assert contract._never_compiled(len, "why")("abc") == 3 and calls == [len]

"""angle_kernels.integrations.angle_emb: patch() makes angle-emb compute with angle_kernels, with the same
results, and unpatch() puts back exactly the objects it replaced."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch

from angle_kernels.testing.oracle import rel_err

import angle_kernels
from angle_kernels.integrations import angle_emb as integration

NAMES = integration.PATCHED_NAMES
MODULES = ("angle_emb.loss", "angle_emb.angle", "angle_emb")


def assert_same_gradients(grads: dict, ref_grads: dict, tolerance: float) -> None:
    """The same parameters got gradients, each within `tolerance` of the reference's relative to its norm (or to a
    millionth of all the gradients' norm, for a parameter whose own gradient is about 0)."""
    assert set(grads) == set(ref_grads) and grads
    overall = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in ref_grads.values()]))
    for name, ref in ref_grads.items():
        scale = max(float(torch.linalg.vector_norm(ref)), 1e-6 * float(overall))
        assert float(torch.linalg.vector_norm(grads[name] - ref)) / scale < tolerance, name


def patched_equals_reference(loss_and_grads) -> dict:
    """loss_and_grads() (-> the loss, {parameter name: gradient}) run as angle-emb computes it, then patched: the same
    loss and gradients to float64's precision. Returns the patched run's gradients."""
    ref_value, ref_grads = loss_and_grads()
    with integration.patched():
        value, grads = loss_and_grads()
    assert rel_err(value, ref_value) < 1e-12, (value.item(), ref_value.item())
    assert_same_gradients(grads, ref_grads, tolerance=1e-10)
    return grads


@pytest.fixture
def ae(angle_emb_package):
    """The angle_emb modules, with a guarantee that no test leaves them patched."""
    import importlib

    modules = {name: importlib.import_module(name) for name in MODULES}
    yield modules
    integration.unpatch()


def snapshot(modules):
    return {(m, n): getattr(modules[m], n) for m in MODULES for n in NAMES if hasattr(modules[m], n)}


def test_patch_swaps_every_name_and_unpatch_restores_the_originals(ae):
    originals = snapshot(ae)
    assert ("angle_emb.angle", "cosine_loss") in originals and ("angle_emb", "AngleLoss") in originals
    assert not integration.is_patched()

    integration.patch()
    assert integration.is_patched()
    for (module, name), original in originals.items():
        current = getattr(ae[module], name)
        assert current is not original
        expected = angle_kernels.AngleLoss if name == "AngleLoss" else getattr(angle_kernels.functional, name)
        assert current is expected, (module, name)

    integration.patch(backend="torch")  # re-patching must not save our objects as "originals"
    assert ae["angle_emb.loss"].cosine_loss.keywords == {"backend": "torch"}
    integration.unpatch()
    assert not integration.is_patched()
    assert snapshot(ae) == originals
    for key, original in originals.items():
        assert snapshot(ae)[key] is original
    integration.unpatch()  # a second unpatch is a no-op
    assert snapshot(ae) == originals


def test_context_manager(ae):
    originals = snapshot(ae)
    with integration.patched():
        assert ae["angle_emb.angle"].AngleLoss is angle_kernels.AngleLoss
    assert snapshot(ae) == originals

    integration.patch()
    with integration.patched():  # nested in an explicit patch: stays patched afterwards
        pass
    assert integration.is_patched()
    integration.unpatch()

    with pytest.raises(RuntimeError, match="boom"):
        with integration.patched():
            raise RuntimeError("boom")
    assert snapshot(ae) == originals


def _inputs(gen, n_pairs=6, dim=16):
    outputs = torch.randn(2 * n_pairs, dim, generator=gen, dtype=torch.float64)
    binary = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0][:n_pairs], dtype=torch.float64).repeat_interleave(2)
    graded = torch.tensor([0.0, 2.0, 1.0, 1.0, 3.0, 0.5][:n_pairs], dtype=torch.float64).repeat_interleave(2)
    return outputs, binary.unsqueeze(1), graded.unsqueeze(1)


CALLS = {
    "cosine_loss": lambda f, out, binary, graded: f(graded, out, 20.0),
    "angle_loss": lambda f, out, binary, graded: f(graded, out, 1.0, pooling_strategy="sum"),
    "in_batch_negative_loss": lambda f, out, binary, graded: f(binary, out, 20.0),
    "contrastive_with_negative_loss": lambda f, out, binary, graded: f(out[0:4], out[4:8], out[8:12], tau=20.0),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_patched_functions_compute_the_same_losses(ae, name):
    gen = torch.Generator().manual_seed(sorted(CALLS).index(name))
    outputs, binary, graded = _inputs(gen)

    def run():
        x = outputs.clone().requires_grad_()
        value = CALLS[name](getattr(ae["angle_emb.loss"], name), x, binary, graded)
        value.backward()
        return value.detach(), x.grad

    ref_value, ref_grad = run()
    with integration.patched():
        value, grad = run()
    assert rel_err(value, ref_value) < 1e-12
    assert rel_err(grad, ref_grad) < 1e-10


def _trainer_inputs(tokenizer, texts, labels):
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    batch = dict(batch)
    if labels is not None:
        batch["labels"] = labels
    return batch


@pytest.mark.parametrize("dataset_format, loss_kwargs", [
    ("A", {}),                                                   # 0.6.1 defaults: ibn + 0.02 * angle
    ("A", {"cosine_w": 1.0, "ibn_w": 0.0, "angle_w": 1.0}),      # graded labels: cosine + angle
    ("B", {}),
    ("C", {"cosine_w": 0.5, "angle_w": 0.02}),
])
def test_patched_trainer_computes_the_same_loss(ae, tiny_model_dir, tmp_path, dataset_format, loss_kwargs):
    """AngleTrainer.compute_loss on a tiny BERT: same loss and parameter gradients, patched or not."""
    from transformers import AutoTokenizer, BertModel, TrainingArguments

    from angle_kernels.testing.tiny_model import SENTENCES

    angle_mod = ae["angle_emb.angle"]
    model = BertModel.from_pretrained(tiny_model_dir).to(torch.float64)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    pooler = angle_mod.Pooler(model, pooling_strategy="cls")
    texts = SENTENCES[:12]
    if dataset_format == "A":
        graded = "ibn_w" in loss_kwargs
        per_pair = [0.0, 2.0, 1.0, 1.0, 3.0, 0.5] if graded else [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
        labels = torch.tensor(per_pair, dtype=torch.float64).repeat_interleave(2).unsqueeze(1)
    else:
        labels = None
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, disable_tqdm=True)

    def loss_and_grads():
        trainer = angle_mod.AngleTrainer(pooler=pooler, model=model, args=args, dataset_format=dataset_format,
                                         loss_kwargs=dict(loss_kwargs))
        model.zero_grad(set_to_none=True)
        value = trainer.compute_loss(model, _trainer_inputs(tokenizer, texts, labels))
        value.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        return trainer.loss_fct, value.detach(), grads

    ref_fn, ref_value, ref_grads = loss_and_grads()
    with integration.patched():
        fn, value, grads = loss_and_grads()
    assert not isinstance(ref_fn, angle_kernels.AngleLoss)
    assert isinstance(fn, angle_kernels.AngleLoss)
    assert torch.isfinite(value) and rel_err(value, ref_value) < 1e-12
    assert_same_gradients(grads, ref_grads, tolerance=1e-10)


def test_trainer_built_before_patch_still_reaches_the_patched_functions(ae):
    """A reference AngleLoss object created before patch() looks its functions up in angle_emb.angle at call
    time, so it computes with angle_kernels while patched (and raises our errors, e.g. on graded ibn labels)."""
    loss = ae["angle_emb.angle"].AngleLoss(dataset_format="A")
    outputs = torch.randn(8, 6, dtype=torch.float64)
    graded = torch.tensor([0.0, 0.0, 2.0, 2.0, 1.0, 1.0, 3.0, 3.0], dtype=torch.float64).unsqueeze(1)
    with integration.patched():
        with pytest.raises(ValueError, match="must be 0 or 1"):
            loss(graded, outputs)
    loss(graded, outputs)  # the reference itself truncates silently


def test_patch_without_angle_emb_raises_a_clear_error(monkeypatch):
    def missing(name):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(integration.importlib, "import_module", missing)
    with pytest.raises(ImportError, match="needs the angle-emb package"):
        integration.patch()
    assert not integration.is_patched()


@pytest.fixture(scope="module")
def deep_model_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    from angle_kernels.testing.tiny_model import build_tiny_model_dir

    return build_tiny_model_dir(tmp_path_factory.mktemp("deep_bert_ese"), seed=5, layers=4)


@pytest.mark.parametrize("dataset_format, loss_kwargs, compression, pca, dtype", [
    ("A", {}, 8, True, torch.float64),                                          # 0.6.1 defaults: ibn + 0.02 * angle
    ("A", {"cosine_w": 1.0, "ibn_w": 0.0, "angle_w": 1.0}, 16, False, torch.float64),
    ("B", {}, 8, True, torch.float64),
    ("C", {"cosine_w": 0.5, "angle_w": 0.02}, 12, True, torch.float64),
    ("A", {"cosine_w": 1.0, "ibn_w": 0.0, "angle_w": 1.0}, 64, True, torch.float64),  # compression >= width
    ("A", {"cosine_w": 1.0, "ibn_w": 0.0, "angle_w": 1.0}, 32, True, torch.float64),  # compression = width
    ("A", {"cosine_w": 1.0, "ibn_w": 0.0, "angle_w": 1.0}, 8, True, torch.float32),
    ("B", {}, 8, True, torch.float32),
    ("B", {}, 7, True, torch.float64),  # format B has no angle term: an odd compression size (refused before)
    ("C", {"cosine_w": 0.5}, np.int64(12), True, torch.float64),  # numpy's int (refused before), as a config gives
])
def test_patched_ese_trainer_computes_the_same_loss_in_one_call(ae, deep_model_dir, tmp_path, monkeypatch,
                                                                 dataset_format, loss_kwargs, compression, pca, dtype):
    """AngleESETrainer.compute_loss (Espresso) on a 4-layer tiny BERT: the same loss and parameter gradients
    patched or not (float64: to rounding; float32: within float32 tolerances); patched, one AngleLoss call
    computes the terms of every layer (the reference: L + 1 calls)."""
    from transformers import AutoTokenizer, BertModel, TrainingArguments

    from angle_kernels.testing.tiny_model import SENTENCES

    angle_mod = ae["angle_emb.angle"]
    model = BertModel.from_pretrained(deep_model_dir).to(dtype)
    tokenizer = AutoTokenizer.from_pretrained(deep_model_dir)
    pooler = angle_mod.Pooler(model, pooling_strategy="cls")
    texts = SENTENCES[:12]
    labels = None
    if dataset_format == "A":
        graded = "ibn_w" in loss_kwargs
        per_pair = [0.0, 2.0, 1.0, 1.0, 3.0, 0.5] if graded else [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
        labels = torch.tensor(per_pair, dtype=dtype).repeat_interleave(2).unsqueeze(1)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, disable_tqdm=True)
    calls = []
    forward = angle_kernels.AngleLoss.forward
    monkeypatch.setattr(angle_kernels.AngleLoss, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))

    def loss_and_grads():
        trainer = angle_mod.AngleESETrainer(pooler=pooler, model=model, args=args, dataset_format=dataset_format,
                                            loss_kwargs=dict(loss_kwargs), ese_compression_size=compression,
                                            apply_ese_pca=pca)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(11)  # the PCA compression's torch.svd_lowrank draws random projections
        value = trainer.compute_loss(model, _trainer_inputs(tokenizer, texts, labels))
        value.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        return value.detach(), grads

    ref_value, ref_grads = loss_and_grads()
    assert not calls
    with integration.patched():
        value, grads = loss_and_grads()
    assert len(calls) == 1, f"one fused loss call for every layer, got {len(calls)}"
    value_tol, grad_tol = (1e-12, 1e-10) if dtype == torch.float64 else (1e-5, 1e-4)
    assert torch.isfinite(value) and rel_err(value, ref_value) < value_tol, (value.item(), ref_value.item())
    assert_same_gradients(grads, ref_grads, tolerance=grad_tol)


@pytest.mark.parametrize("teacher_pooling", ["cls", "all"])
def test_patched_ese_trainer_with_a_teacher_gives_the_same_loss_and_gradients(ae, deep_model_dir, tmp_path,
                                                                             teacher_pooling):
    """Espresso with a teacher model (teacher_name_or_path): its alignment term adds to the loss's value without a
    gradient, as angle-emb's in-place `loss +=` inside no_grad; the patched trainer once rebound the loss inside
    no_grad, so it had no graph and backward raised. The teacher is another model (another seed): with the
    student's own weights the term's gradient is 0 whether or not it is taken. Both teacher_pooling_strategy branches:
    "all" aligns the teacher's outputs with the student's last layer as it comes, "cls" with its pooled outputs."""
    from transformers import AutoTokenizer, BertModel, TrainingArguments

    from angle_kernels.testing.tiny_model import SENTENCES, build_tiny_model_dir

    teacher_dir = build_tiny_model_dir(tmp_path / "teacher", seed=9, layers=4)

    angle_mod = ae["angle_emb.angle"]
    model = BertModel.from_pretrained(deep_model_dir).to(torch.float64)
    tokenizer = AutoTokenizer.from_pretrained(deep_model_dir)
    pooler = angle_mod.Pooler(model, pooling_strategy="cls")
    labels = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0], dtype=torch.float64).repeat_interleave(2).unsqueeze(1)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, disable_tqdm=True)

    def loss_and_grads():
        trainer = angle_mod.AngleESETrainer(pooler=pooler, model=model, args=args, dataset_format="A",
                                            loss_kwargs=dict(cosine_w=1.0, ibn_w=1.0, angle_w=1.0),
                                            ese_compression_size=8, teacher_name_or_path=str(teacher_dir),
                                            teacher_pooling_strategy=teacher_pooling, model_kwargs={})
        trainer.teacher_pooler.model = trainer.teacher_pooler.model.to(torch.float64)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(11)
        value = trainer.compute_loss(model, _trainer_inputs(tokenizer, SENTENCES[:12], labels))
        value.backward()
        return value.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    patched_equals_reference(loss_and_grads)


def test_an_ese_trainer_that_overrides_its_student_loss_keeps_it(ae, deep_model_dir, tmp_path):
    """compute_student_loss is angle-emb's hook for the earlier layers' terms; the fused call does not make it, so a
    trainer class that overrides it computes by the reference's method (it was ignored: 26.94 against 17.16 for a
    subclass whose students add nothing)."""
    from transformers import AutoTokenizer, BertModel, TrainingArguments

    from angle_kernels.testing.tiny_model import SENTENCES

    angle_mod = ae["angle_emb.angle"]

    class LastLayerOnly(angle_mod.AngleESETrainer):
        def compute_student_loss(self, *args, **kwargs):
            return 0.0

    model = BertModel.from_pretrained(deep_model_dir).to(torch.float64)
    tokenizer = AutoTokenizer.from_pretrained(deep_model_dir)
    labels = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0], dtype=torch.float64).repeat_interleave(2).unsqueeze(1)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, disable_tqdm=True)

    def loss():
        trainer = LastLayerOnly(pooler=angle_mod.Pooler(model, pooling_strategy="cls"), model=model, args=args,
                                dataset_format="A", ese_compression_size=8)
        torch.manual_seed(0)
        return float(trainer.compute_loss(model, _trainer_inputs(tokenizer, SENTENCES[:12], labels)))

    reference = loss()
    with integration.patched():
        assert loss() == pytest.approx(reference, rel=1e-12)


def _ese_case(ae, deep_model_dir, tmp_path):
    """(angle_emb.angle, the 4-layer tiny BERT in float64, its tokenizer, format A labels of 6 pairs, the training
    arguments) for an AngleESETrainer whose compute_loss is compared with angle-emb's own method."""
    from transformers import AutoTokenizer, BertModel, TrainingArguments

    model = BertModel.from_pretrained(deep_model_dir).to(torch.float64)
    labels = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0], dtype=torch.float64).repeat_interleave(2).unsqueeze(1)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, disable_tqdm=True)
    return ae["angle_emb.angle"], model, AutoTokenizer.from_pretrained(deep_model_dir), labels, args


def test_an_ese_trainer_whose_loss_has_dims_of_its_own_keeps_them(ae, deep_model_dir, tmp_path):
    """Patched, AngleLoss is angle_kernels' (angle-emb's takes no dims: its **kwargs drop them), so a trainer's loss
    may have Matryoshka dims of its own (loss_kwargs dims=[4, 8]): the patched AngleESETrainer then computes by the
    reference's method (angle-emb's compute_loss: one call of that loss per layer, with its dims), not by the fused
    call, which would replace them with Espresso's (compression size, width): 16.10 against 32.20."""
    from angle_kernels.testing.tiny_model import SENTENCES

    angle_mod, model, tokenizer, labels, args = _ese_case(ae, deep_model_dir, tmp_path)
    reference_method = angle_mod.AngleESETrainer.compute_loss  # angle-emb's own, taken before patching
    with integration.patched(backend="torch"):
        trainer = angle_mod.AngleESETrainer(pooler=angle_mod.Pooler(model, pooling_strategy="cls"), model=model,
                                            args=args, dataset_format="A", ese_compression_size=8,
                                            apply_ese_pca=False,
                                            loss_kwargs=dict(cosine_w=1.0, ibn_w=1.0, angle_w=1.0, dims=[4, 8]))
        assert list(trainer.loss_fct.dims) == [4, 8]  # angle_kernels' AngleLoss, with dims
        with torch.no_grad():
            expected, expected_outputs = reference_method(
                trainer, model, _trainer_inputs(tokenizer, SENTENCES[:12], labels), return_outputs=True)
            got, outputs = trainer.compute_loss(model, _trainer_inputs(tokenizer, SENTENCES[:12], labels),
                                                return_outputs=True)
    assert float(got) == pytest.approx(float(expected), rel=1e-12)
    assert torch.equal(outputs, expected_outputs)


@pytest.mark.parametrize("change", ["subclass", "forward_hook"])
def test_an_ese_trainer_whose_loss_computes_more_keeps_the_reference_calls(ae, deep_model_dir, tmp_path, change):
    """A subclass of AngleLoss whose forward adds a term, or a forward hook that changes the loss: the fused call
    (one call on a stack of every layer, with layer weights) gives them other inputs than the reference's L + 1 calls
    of one layer each, and changed the loss silently (17.09 against 17.20 for a subclass adding 0.01 |outputs|^2):
    the patched trainer computes by the reference's method for them."""
    from angle_kernels.testing.tiny_model import SENTENCES

    class WithPenalty(angle_kernels.AngleLoss):
        def forward(self, labels, outputs, **kwargs):
            return super().forward(labels, outputs, **kwargs) + 0.01 * outputs.pow(2).sum()

    angle_mod, model, tokenizer, labels, args = _ese_case(ae, deep_model_dir, tmp_path)
    reference_method = angle_mod.AngleESETrainer.compute_loss  # angle-emb's own, taken before patching
    with integration.patched(backend="torch"):
        trainer = angle_mod.AngleESETrainer(pooler=angle_mod.Pooler(model, pooling_strategy="cls"), model=model,
                                            args=args, dataset_format="A", ese_compression_size=8,
                                            apply_ese_pca=False)
        if change == "subclass":
            trainer.loss_fct = WithPenalty(dataset_format="A", backend="torch")
        else:
            trainer.loss_fct.register_forward_hook(lambda module, inputs, out: out + 0.01 * inputs[1].pow(2).sum())
        with torch.no_grad():
            expected = float(reference_method(trainer, model, _trainer_inputs(tokenizer, SENTENCES[:12], labels)))
            got = float(trainer.compute_loss(model, _trainer_inputs(tokenizer, SENTENCES[:12], labels)))
    assert got == pytest.approx(expected, rel=1e-12)


def test_a_backend_is_checked_at_patch_and_the_patched_loss_pickles(ae):
    """patch(backend=...) refuses an unknown backend before changing anything (it failed at the first loss, mid
    training), and the AngleLoss it binds is an importable class: a trainer's loss pickles, as angle-emb's does."""
    import pickle

    with pytest.raises(ValueError, match="backend must be None or one of 'auto'.*got 'bogus'"):
        integration.patch(backend="bogus")
    assert not integration.is_patched()
    with integration.patched(backend="torch"):
        loss = ae["angle_emb.angle"].AngleLoss(cosine_w=1.0, angle_w=1.0, dataset_format="A")
        assert loss.backend == "torch"
        copy = pickle.loads(pickle.dumps(loss))
    assert type(copy) is type(loss) and copy.backend == "torch"


def test_unpatch_restores_the_ese_trainer(ae):
    trainer = ae["angle_emb.angle"].AngleESETrainer
    original = trainer.compute_loss
    integration.patch()
    assert trainer.compute_loss is not original
    integration.patch(backend="torch")  # patching again keeps the reference's method as the original
    integration.unpatch()
    assert trainer.compute_loss is original


def test_espresso_layer_weights_follow_the_reference():
    dims, rows = angle_kernels.inputs.espresso_layer_weights(4, 8, 32)
    assert dims == (8, 32)
    assert rows[-1] == [1.0, 1.0]
    assert rows[:3] == [[1.0 / (1.0 + math.log(1 + i)) / 3, 0.0] for i in range(3)]


@pytest.mark.parametrize("n_layers, compression_size, named", [(1, 8, "n_layers"), (0, 8, "n_layers"),
                                                               (4, 0, "compression_size"), (4, -8, "compression_size")])
def test_espresso_layer_weights_refuse_a_single_layer_or_an_empty_compression(n_layers, compression_size, named):
    """Espresso weighs the earlier layers against the last one and compresses to a positive width: a model of
    fewer than 2 layers or a compression_size < 1 raises a ValueError naming it (not weights of no earlier layer,
    or a prefix of width 0)."""
    with pytest.raises(ValueError, match=rf"^{named}"):
        angle_kernels.inputs.espresso_layer_weights(n_layers, compression_size, 32)


def test_an_ese_trainer_whose_loss_has_a_forward_pre_hook_keeps_the_reference_calls(ae, deep_model_dir, tmp_path):
    """A forward pre-hook on the trainer's loss sees what the reference passes it, one layer per call: the patched
    trainer keeps the reference's calls (a hook that is not element-wise, here adding the outputs' mean, would give
    another loss on the layers stacked into one call)."""
    from angle_kernels.testing.tiny_model import SENTENCES

    angle_mod, model, tokenizer, labels, args = _ese_case(ae, deep_model_dir, tmp_path)
    reference_method = angle_mod.AngleESETrainer.compute_loss
    with integration.patched(backend="torch"):
        trainer = angle_mod.AngleESETrainer(pooler=angle_mod.Pooler(model, pooling_strategy="cls"), model=model,
                                            args=args, dataset_format="A", ese_compression_size=8,
                                            apply_ese_pca=False)
        trainer.loss_fct.register_forward_pre_hook(lambda module, inputs: (inputs[0], inputs[1] + inputs[1].mean()))
        with torch.no_grad():
            expected = float(reference_method(trainer, model, _trainer_inputs(tokenizer, SENTENCES[:12], labels)))
            got = float(trainer.compute_loss(model, _trainer_inputs(tokenizer, SENTENCES[:12], labels)))
    assert got == pytest.approx(expected, rel=1e-12)


def test_an_ese_trainer_patched_with_a_backend_computes_every_step_in_one_call(ae, deep_model_dir, tmp_path,
                                                                               monkeypatch):
    """patch(backend=...) makes the trainer's loss angle_kernels' AngleLoss bound to that backend, which Espresso's
    fused call takes too: one loss call a step, step after step (the trainer's own loss keeps no dims), with the
    reference's value, and compute_loss(return_outputs=True) returns the loss with the final layer's pooled
    embeddings, as the reference's does (the trainer's evaluation asks for them)."""
    from angle_kernels.testing.tiny_model import SENTENCES

    angle_mod, model, tokenizer, labels, args = _ese_case(ae, deep_model_dir, tmp_path)
    reference_method = angle_mod.AngleESETrainer.compute_loss
    calls = []
    forward = angle_kernels.AngleLoss.forward
    monkeypatch.setattr(angle_kernels.AngleLoss, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    with integration.patched(backend="torch"):
        trainer = angle_mod.AngleESETrainer(pooler=angle_mod.Pooler(model, pooling_strategy="cls"), model=model,
                                            args=args, dataset_format="A", ese_compression_size=8,
                                            apply_ese_pca=False)
        with torch.no_grad():
            expected, expected_outputs = reference_method(
                trainer, model, _trainer_inputs(tokenizer, SENTENCES[:12], labels), return_outputs=True)
            calls.clear()
            steps = [trainer.compute_loss(model, _trainer_inputs(tokenizer, SENTENCES[:12], labels),
                                          return_outputs=True) for _ in range(2)]
    assert len(calls) == 2, f"one loss call a step, got {len(calls)} in two steps"
    assert trainer.loss_fct.dims is None
    for got, outputs in steps:
        assert float(got) == pytest.approx(float(expected), rel=1e-12)
        assert torch.equal(outputs, expected_outputs)


def test_patched_ese_trainer_adds_the_masked_language_model_term(ae, deep_model_dir, tmp_path):
    """With mask_target_labels in the batch (a masked-LM backbone, angle-emb's load_mlm_model=True), Espresso adds
    the MLM cross-entropy to its loss: the patched trainer gives the reference's loss and gradients."""
    from transformers import AutoTokenizer, BertForMaskedLM, TrainingArguments

    from angle_kernels.testing.tiny_model import SENTENCES

    angle_mod = ae["angle_emb.angle"]
    torch.manual_seed(0)  # the MLM head the checkpoint lacks
    model = BertForMaskedLM.from_pretrained(deep_model_dir).to(torch.float64)
    tokenizer = AutoTokenizer.from_pretrained(deep_model_dir)
    labels = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0], dtype=torch.float64).repeat_interleave(2).unsqueeze(1)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, disable_tqdm=True)

    def loss_and_grads():
        trainer = angle_mod.AngleESETrainer(pooler=angle_mod.Pooler(model, pooling_strategy="cls"), model=model,
                                            args=args, dataset_format="A", ese_compression_size=8,
                                            apply_ese_pca=False)
        inputs = _trainer_inputs(tokenizer, SENTENCES[:12], labels)
        inputs["mask_target_labels"] = inputs["input_ids"].clone()
        model.zero_grad(set_to_none=True)
        value = trainer.compute_loss(model, inputs)
        value.backward()
        return value.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    grads = patched_equals_reference(loss_and_grads)
    assert any("cls.predictions" in name for name in grads), "the MLM head took no part in the loss"


@pytest.mark.parametrize("setting, match", [
    (dict(ese_compression_size=7), r"ese_compression_size must be even where the angle term runs .*got 7"),
    (dict(ese_compression_size=8, pooling_strategy="all"),
     r"one pooled embedding per text, but the pooler's pooling_strategy 'all' gives outputs of shape \(12, \d+, 32\)"),
], ids=["odd_compression", "pooling_all"])
def test_an_ese_trainer_refuses_its_own_settings_by_their_names(ae, deep_model_dir, tmp_path, setting, match):
    """Settings of the trainer that the fused call cannot take are refused naming them: an odd ese_compression_size
    with the angle term on (the error named `dims`, which the trainer's user never passed) and a pooler that keeps
    every token (pooling_strategy 'all': the error named `layer_weights`). angle-emb fails on both too, with a tensor
    size mismatch."""
    from angle_kernels.testing.tiny_model import SENTENCES

    angle_mod, model, tokenizer, labels, args = _ese_case(ae, deep_model_dir, tmp_path)
    pooling = setting.pop("pooling_strategy", "cls")
    with integration.patched(backend="torch"):
        trainer = angle_mod.AngleESETrainer(pooler=angle_mod.Pooler(model, pooling_strategy=pooling), model=model,
                                            args=args, dataset_format="A", apply_ese_pca=False, **setting)
        with pytest.raises(ValueError, match=match):
            trainer.compute_loss(model, _trainer_inputs(tokenizer, SENTENCES[:12], labels))


def test_a_nested_patched_block_restores_the_backend_it_found(ae):
    """patched(backend=...) inside patch(backend=...) or another patched() block binds its backend for its own
    extent: on exit the functions and the AngleLoss a trainer builds compute on the backend in effect on entry (the
    inner block's backend stayed bound, so training after it ran on a backend the user had set for one block)."""
    loss_module, angle_module = ae["angle_emb.loss"], ae["angle_emb.angle"]
    integration.patch(backend="torch")
    with integration.patched(backend="auto"):
        assert loss_module.cosine_loss.keywords == {"backend": "auto"}
        with integration.patched():
            assert loss_module.cosine_loss is angle_kernels.functional.cosine_loss
        assert loss_module.cosine_loss.keywords == {"backend": "auto"}
        assert angle_module.AngleLoss(dataset_format="A").backend == "auto"
    assert loss_module.cosine_loss.keywords == {"backend": "torch"}
    assert angle_module.AngleLoss(dataset_format="A").backend == "torch"
    integration.unpatch()

    with integration.patched(backend="torch"):
        with integration.patched(backend="auto"):
            integration.unpatch()  # an unpatch() inside a block is not undone by the block's exit
        assert not integration.is_patched()
    assert not integration.is_patched()


def second_thread_keeps_its_patch(ae, first_block, *, enter_after, entered, first_ended) -> bool:
    """Runs `first_block` in a thread named first and, once `enter_after` is set, a patched(backend="auto") block in a
    second thread, which sets `entered` inside and, once `first_ended` is set, looks whether angle-emb is still
    patched with its backend; returns what it found."""
    import threading

    seen = {}

    def second_block():
        enter_after.wait(10)
        with integration.patched(backend="auto"):
            entered.set()
            first_ended.wait(10)
            seen["inside"] = (integration.is_patched()
                              and ae["angle_emb.loss"].cosine_loss.keywords == {"backend": "auto"})

    threads = [threading.Thread(target=first_block, name="first"), threading.Thread(target=second_block, name="second")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    return seen.get("inside", False)


def test_patched_blocks_in_two_threads_keep_the_patch_until_the_last_one_ends(ae):
    """angle-emb is patched process-wide: a block in one thread that ended while another thread's block (entered
    after it) was open unpatched angle-emb under that thread, which went on training with angle-emb's own losses.
    The last block to end restores what the first one found."""
    import threading

    first_entered, second_entered, first_ended = threading.Event(), threading.Event(), threading.Event()

    def first_block():
        with integration.patched(backend="torch"):
            first_entered.set()
            second_entered.wait(10)
        first_ended.set()

    assert second_thread_keeps_its_patch(ae, first_block, enter_after=first_entered, entered=second_entered,
                                         first_ended=first_ended)
    assert not integration.is_patched()


def test_a_patched_block_entered_while_another_threads_block_restores_keeps_the_patch(ae, monkeypatch):
    """A block that enters while the last open block (another thread's) is restoring what it found waits for the
    restore and patches after it: it entered between the hand-over and the unpatch, found angle-emb patched, and was
    unpatched under it (its thread trained on angle-emb's own losses, and its exit patched angle-emb for good)."""
    import threading

    restoring, second_inside, first_ended = threading.Event(), threading.Event(), threading.Event()
    unpatch = integration.unpatch

    def unpatch_slowly():  # the first block's restore gives another thread's block the time to enter
        if threading.current_thread().name == "first" and not restoring.is_set():
            restoring.set()
            second_inside.wait(0.5)  # a block cannot enter during a restore: the wait runs out
        unpatch()

    monkeypatch.setattr(integration, "unpatch", unpatch_slowly)

    def first_block():
        with integration.patched(backend="torch"):
            pass
        first_ended.set()

    assert second_thread_keeps_its_patch(ae, first_block, enter_after=restoring, entered=second_inside,
                                         first_ended=first_ended)
    assert not integration.is_patched()


def test_an_angle_emb_loss_made_before_patch_pickles_while_patched(ae):
    """A trainer built before patch() holds angle-emb's AngleLoss; pickle finds a class by its name, which holds
    ours while patched, and refused the object ("not the same object as angle_emb.angle.AngleLoss"). It pickles as
    angle-emb's class with its settings, and loads patched or not (here after unpatch(), as another process
    would); after unpatch() it pickles as angle-emb's own code does."""
    import copy
    import copyreg
    import pickle

    reference_class = ae["angle_emb.angle"].AngleLoss
    loss = reference_class(cosine_w=1.0, ibn_w=0.0, angle_w=1.0, angle_tau=5.0, dataset_format="A")
    outputs = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    graded = torch.tensor([0.0, 0.0, 2.0, 2.0, 1.0, 1.0, 3.0, 3.0], dtype=torch.float64).unsqueeze(1)
    with integration.patched():
        data = pickle.dumps(loss)
        assert type(copy.deepcopy(loss)) is reference_class
        patched_copy = pickle.loads(data)
    assert type(patched_copy) is reference_class
    restored = pickle.loads(data)
    assert type(restored) is reference_class and vars(restored) == vars(loss)
    assert float(restored(graded, outputs)) == float(loss(graded, outputs))
    assert reference_class not in copyreg.dispatch_table  # unpatch() takes the rule back
    assert type(pickle.loads(pickle.dumps(loss))) is reference_class


def test_an_angle_emb_loss_pickled_unpatched_loads_as_ours_in_a_patched_process(ae):
    """A pickle of angle-emb's AngleLoss written without the patch names the class angle_emb.angle.AngleLoss, which
    is ours where the patch is in effect: it loaded as our class with angle-emb's attributes and no nn.Module state,
    and calling it raised AttributeError ('_backward_hooks'). It loads as our loss built from those settings,
    computing what angle-emb's does."""
    import pickle

    from angle_kernels.modules import AngleLoss

    reference_class = ae["angle_emb.angle"].AngleLoss
    loss = reference_class(cosine_w=1.0, ibn_w=0.0, angle_w=1.0, cosine_tau=10.0, angle_tau=5.0, dataset_format="A")
    data = pickle.dumps(loss)
    outputs = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    graded = torch.tensor([0.0, 0.0, 2.0, 2.0, 1.0, 1.0, 3.0, 3.0], dtype=torch.float64).unsqueeze(1)
    for backend in (None, "torch"):
        with integration.patched(backend=backend):
            restored = pickle.loads(data)
            assert isinstance(restored, AngleLoss) and type(restored) is ae["angle_emb.angle"].AngleLoss
            settings = (restored.cosine_w, restored.cosine_tau, restored.angle_w, restored.angle_tau)
            assert settings == (1.0, 10.0, 1.0, 5.0) and restored.dataset_format == "A"
            torch.testing.assert_close(restored(graded, outputs), loss(graded, outputs), rtol=1e-12, atol=0)
    ours = AngleLoss(cosine_w=1.0, angle_tau=5.0)  # our own pickles keep their module state, as before
    again = pickle.loads(pickle.dumps(ours))
    assert type(again) is AngleLoss and again.angle_tau == 5.0 and again.training == ours.training


def _fit_dataset(dataset_format: str):
    from datasets import Dataset

    from angle_kernels.testing.tiny_model import SENTENCES

    if dataset_format == "A":
        return Dataset.from_dict({"text1": SENTENCES[0:24:2], "text2": SENTENCES[1:24:2],
                                  "label": [1, 0, 1, 1, 0, 1, 1, 1, 0, 1, 0, 1]})
    return Dataset.from_dict({"query": SENTENCES[0:24:3], "positive": SENTENCES[1:24:3],
                              "negative": SENTENCES[2:24:3]})


@pytest.mark.parametrize("dataset_format, angle_kwargs, fit_kwargs", [
    ("A", dict(pooling_strategy="avg"), dict(loss_kwargs=dict(cosine_w=1.0, ibn_w=1.0, angle_w=1.0))),
    ("C", dict(pooling_strategy="last", tokenizer_padding_side="left"),
     dict(apply_ese=True, padding="max_length", loss_kwargs=dict(cosine_w=0.5),
          trainer_kwargs=dict(ese_compression_size=8, ese_kl_temperature=0.5))),
], ids=["format_A", "format_C_espresso"])
def test_angle_fit_trains_the_same_patched(ae, deep_model_dir, tmp_path, dataset_format, angle_kwargs, fit_kwargs):
    """AnglE.fit, angle-emb's own training entry (its collator, trainer and loss_kwargs), on the 4-layer tiny BERT in
    float64 with plain SGD for 2 epochs: patched (the model built before patch()), every step's loss equals
    angle-emb's own to rounding and so do the trained weights (but the attention keys' biases, whose gradient is 0
    up to rounding)."""
    angle_mod = ae["angle_emb.angle"]
    trainer_class = angle_mod.AngleESETrainer if fit_kwargs.get("apply_ese") else angle_mod.AngleTrainer

    def fit(patched: bool):
        angle = angle_mod.AnglE(str(deep_model_dir), max_length=32, device="cpu", **angle_kwargs)
        angle.backbone.to(torch.float64)
        losses = []
        with integration.patched(backend="torch") if patched else contextlib.nullcontext():
            compute_loss = trainer_class.__dict__["compute_loss"]  # the patched one when patched

            def recording(self, *args, **kwargs):
                assert isinstance(self.loss_fct, angle_kernels.AngleLoss) is patched
                torch.manual_seed(len(losses))  # Espresso's PCA draws random projections
                value = compute_loss(self, *args, **kwargs)
                losses.append(float((value[0] if isinstance(value, tuple) else value).detach()))
                return value

            trainer_class.compute_loss = recording
            try:
                angle.fit(train_ds=_fit_dataset(dataset_format), batch_size=4, output_dir=str(tmp_path / str(patched)),
                          epochs=2, learning_rate=0.5, warmup_steps=0, save_steps=10_000, logging_steps=10_000,
                          argument_kwargs=dict(report_to=[], use_cpu=True, disable_tqdm=True, optim="sgd", seed=0),
                          **fit_kwargs)
            finally:
                trainer_class.compute_loss = compute_loss
        return losses, {n: p.detach().clone() for n, p in angle.backbone.named_parameters() if "key.bias" not in n}

    ref_losses, ref_weights = fit(patched=False)
    losses, weights = fit(patched=True)
    assert len(losses) == len(ref_losses) >= 4
    assert losses == pytest.approx(ref_losses, rel=1e-12)
    for name, ref in ref_weights.items():
        assert rel_err(weights[name], ref) < 1e-10, name

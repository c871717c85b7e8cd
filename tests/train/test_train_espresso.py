"""Espresso (ESE) training in angle_train: --espresso makes the encoder return every layer's pooled embeddings
for the loss (and only for the loss: evaluation and export see the last layer), the loss is angle-emb's
AngleESETrainer weighting (computed here from per-layer AngleLoss calls, the reference's structure), the
gradient cache equals plain backprop, a run trains and evaluates at the compressed width, and bad settings are
refused naming the flag. (DDP with --espresso: test_train_distributed.py.)"""

import json
import math
import os

import pytest
import torch
from train_helpers import demo_batch, make_encoder, param_grads, run_config

from angle_train.cli import config_from_args
from angle_train.data import pad_batch
from angle_train.grad_cache import grad_cache_step, plain_step
from angle_train.models import pool
from angle_train.tiny import demo_examples, demo_sts_examples
from angle_train.trainer import build_loss, setup, train

LAYERS = 3
RANKING = ["--cosine-w", "1", "--ibn-w", "0", "--angle-w", "1"]  # graded format-A labels: the ranking terms


def _padded(encoder, batch):
    return pad_batch(batch.seqs, encoder.pad_token_id, encoder.padding_side)


@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_the_layer_stack_holds_every_layer_and_only_inside_the_context(arch):
    encoder, tokenizer = make_encoder(arch, layers=LAYERS)
    ids, mask = _padded(encoder, demo_batch(tokenizer, 5, "B"))
    with torch.no_grad():
        final = encoder(ids, mask)
        with encoder.all_layers_out():
            stack = encoder(ids, mask)
        after = encoder(ids, mask)
    assert stack.shape == (LAYERS, *final.shape)
    torch.testing.assert_close(stack[-1], final, rtol=0, atol=0)
    torch.testing.assert_close(after, final, rtol=0, atol=0)
    if arch == "bert":  # hidden states 0 (the embedding layer's output) .. L - 2, pooled like the last
        with torch.no_grad():
            hidden = encoder.backbone(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        for layer in range(LAYERS - 1):
            torch.testing.assert_close(stack[layer], pool(hidden[layer].float(), mask, encoder.pooling),
                                       rtol=0, atol=0)
        assert not torch.allclose(stack[0], stack[1])


@pytest.mark.parametrize("fmt, flags, width", [("A", RANKING, 8), ("B", [], 8), ("B", [], 64)])
def test_the_loss_is_angle_emb_espresso_weighting(fmt, flags, width):
    """One fused call on the stack = angle-emb 0.6.1's AngleESETrainer loss without its PCA term: the last layer
    at the full and the compressed width, earlier layer i at the compressed width / (1 + ln(1 + i)), averaged
    over the earlier layers; a compressed width >= the embeddings' is the full width."""
    encoder, tokenizer = make_encoder("bert", layers=LAYERS)
    batch = demo_batch(tokenizer, 6, fmt)
    with torch.no_grad(), encoder.all_layers_out():
        stack = encoder(*_padded(encoder, batch)).double()  # the encoder gives float32: compare in float64
    espresso = build_loss(config_from_args([*flags, "--espresso", "--espresso-dim", str(width)]), fmt, encoder)
    per_layer = build_loss(config_from_args(flags), fmt)  # AngleLoss on one layer's embeddings
    size = min(width, stack.shape[-1])
    expected = per_layer(batch.labels, stack[-1]) + per_layer(batch.labels, stack[-1][:, :size])
    earlier = sum(per_layer(batch.labels, stack[i][:, :size]) / (1 + math.log(1 + i)) for i in range(LAYERS - 1))
    expected = expected + earlier / (LAYERS - 1)
    torch.testing.assert_close(espresso(batch.labels, stack), expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("arch, fmt, flags", [("bert", "A", RANKING), ("llama", "B", [])])
def test_espresso_grad_cache_equals_plain_backprop(arch, fmt, flags):
    """The gradient cache joins the chunks' layer stacks along the rows: the same loss and gradients as plain
    backprop, dropout included."""
    encoder, tokenizer = make_encoder(arch, dropout=0.2, layers=LAYERS)
    encoder.train()
    batch = demo_batch(tokenizer, 10, fmt)
    loss_fn = build_loss(config_from_args([*flags, "--espresso", "--espresso-dim", "8"]), fmt, encoder)
    chunks = [pad_batch(c, encoder.pad_token_id, encoder.padding_side) for c in batch.chunks(3)]
    results = []
    for step in (plain_step, grad_cache_step):
        encoder.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        with encoder.all_layers_out():
            loss = step(encoder, chunks, batch.labels, loss_fn)
        results.append((loss, param_grads(encoder)))
    (loss_p, plain), (loss_c, cached) = results
    torch.testing.assert_close(loss_c, loss_p, rtol=1e-12, atol=0)
    assert plain.keys() == cached.keys() and plain
    for name in plain:
        torch.testing.assert_close(cached[name], plain[name], rtol=1e-9, atol=1e-12, msg=name)


def test_a_run_trains_every_layer_and_reports_the_compressed_width(tmp_path):
    """A short --espresso run with the gradient cache: finite losses, the dev Spearman reported at --espresso-dim
    too (evaluation embeds with the last layer), and the export records the two widths."""
    encoder, tokenizer = make_encoder("bert", layers=LAYERS, dtype=torch.float32)
    cfg = run_config(tmp_path, batch_size=8, max_steps=2, chunk_size=6, espresso=True, espresso_dim=8, lr=1e-3,
                     save_final=True)
    seen = []
    result = train(cfg, model=(encoder, tokenizer), train_examples=(demo_examples(32), "B"),
                   dev_examples=demo_sts_examples(24), on_step=lambda step, row: seen.append(row["loss"]))
    assert len(seen) == 2 and all(math.isfinite(v) for v in seen)
    assert {"dev_spearman", "dev_spearman@8"} <= result.evals[-1].keys()
    with open(os.path.join(result.final_path, "angle_train.json")) as f:
        assert json.load(f)["matryoshka_dims"] == [32, 8]


@pytest.mark.parametrize("argv, message", [
    (["--espresso", "--matryoshka-dims", "16"], "leave out --matryoshka-dims"),
    (["--espresso", "--espresso-dim", "0"], "--espresso-dim must be >= 1"),
])
def test_bad_settings_are_refused(capsys, argv, message):
    with pytest.raises(SystemExit):
        config_from_args(argv)
    assert message in capsys.readouterr().err


def test_settings_that_do_not_fit_the_model_fail_in_setup(tmp_path):
    argv = ["--output-dir", str(tmp_path), "--device", "cpu", "--progress", "0", "--batch-size", "8", "--espresso"]
    graded = ["--cosine-w", "1", "--ibn-w", "0"]  # format A with the angle term, whose score halves each width
    with pytest.raises(ValueError, match=r"--espresso-dim 7 .*even"):
        setup(config_from_args([*argv, *graded, "--espresso-dim", "7"]), model=make_encoder(layers=LAYERS),
              train_examples=(demo_sts_examples(16), "A"))
    # format B has no angle term: an odd width trains (it was refused unless --angle-w 0 was given)
    run = setup(config_from_args([*argv, "--espresso-dim", "7"]), model=make_encoder(layers=LAYERS),
                train_examples=(demo_examples(16), "B"))
    run.log.close()
    with pytest.raises(ValueError, match=r"--espresso .*1 layers.*at least 2 layers"):
        setup(config_from_args(argv), model=make_encoder(layers=1), train_examples=(demo_examples(16), "B"))


def test_an_espresso_dim_as_wide_as_the_model_is_said(tmp_path, capsys):
    """--espresso-dim at or past the model's width trains no compressed width (Espresso's own rule, below): the
    set-up says so and the width to give, where the run went on as if it trained one."""
    argv = ["--output-dir", str(tmp_path), "--device", "cpu", "--progress", "0", "--batch-size", "8", "--espresso"]
    encoder, tokenizer = make_encoder(layers=LAYERS)
    for dim, said in ((encoder.embedding_dim, True), (encoder.embedding_dim - 2, False)):
        run = setup(config_from_args([*argv, "--espresso-dim", str(dim), "--overwrite", "1"]),
                    model=(encoder, tokenizer), train_examples=(demo_examples(16), "B"))
        run.log.close()
        note = (f"note: --espresso-dim {dim} is not narrower than the model's {encoder.embedding_dim}-dimensional "
                f"embeddings: no compressed width is trained")
        assert (note in capsys.readouterr().out) == said


def test_the_widths_trained_never_pass_the_models():
    """An --espresso-dim at or past the model's embedding width trains, evaluates and exports the full width alone
    (Espresso's own rule), not a width the model does not have."""
    assert config_from_args(["--espresso", "--espresso-dim", "64"]).trained_widths(32) == [32]
    assert config_from_args(["--espresso", "--espresso-dim", "32"]).trained_widths(32) == [32]
    assert config_from_args(["--espresso", "--espresso-dim", "8"]).trained_widths(32) == [8, 32]
    assert config_from_args(["--matryoshka-dims", "16", "8"]).trained_widths(32) == [16, 8]

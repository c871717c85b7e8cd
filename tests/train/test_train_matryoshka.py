"""Matryoshka training in angle_train: --matryoshka-dims / --matryoshka-weights reach AngleLoss, bad values are
refused naming the flag, evaluation reports dev Spearman at every narrower width, encode(dim=) truncates, and
the export records the widths. (The gradient cache and DDP with dims: test_train_grad_cache.py and
test_train_distributed.py.)"""

import json

import pytest
import torch
from train_helpers import make_encoder, run_config

from angle_train.cli import config_from_args
from angle_train.config import TrainConfig
from angle_train.export import load_pretrained, save_pretrained
from angle_train.tiny import demo_examples, demo_sts_examples
from angle_train.evaluate import sts_spearman
from angle_train.trainer import setup, train

TEXTS = ["a small red car", "the dog is black and big", "it was a golden kite , very long", "box"]
WIDTH = 32  # make_encoder's hidden size
MATRYOSHKA = ["--matryoshka-dims", "32", "8", "16", "--matryoshka-weights", "1", "0.5", "2"]


def _setup(tmp_path, flags, fmt="B"):
    argv = ["--output-dir", str(tmp_path), "--device", "cpu", "--progress", "0", *flags]
    examples = demo_examples(64) if fmt == "B" else demo_sts_examples(64)
    run = setup(config_from_args(argv), model=make_encoder(), train_examples=(examples, fmt))
    run.log.close()
    return run


def test_flags_reach_angle_loss(tmp_path):
    """Off by default; the widths in the order given (AngleLoss sorts them itself) with their weights; a config
    file's numbers work like the flags' words."""
    loss = _setup(tmp_path, []).loss_fn
    assert (loss.dims, loss.dim_weights) == (None, None)
    loss = _setup(tmp_path, MATRYOSHKA).loss_fn
    assert (loss.dims, loss.dim_weights) == ((32, 8, 16), (1.0, 0.5, 2.0))
    loss = _setup(tmp_path, ["--matryoshka-dims", "8", "16"]).loss_fn
    assert (loss.dims, loss.dim_weights) == ((8, 16), None)  # weights default to 1 each (AngleLoss's None)
    config = tmp_path / "run.yaml"
    config.write_text("matryoshka_dims: [16, 8]\nmatryoshka-weights: [1, 0.5]\n")
    cfg = config_from_args(["--config", str(config)])
    assert (cfg.matryoshka_dims, cfg.matryoshka_weights) == ([16, 8], [1.0, 0.5])


@pytest.mark.parametrize("argv, message", [
    (["--matryoshka-dims", "abc"], "--matryoshka-dims: expected integers; got 'abc'"),
    (["--matryoshka-dims", "1.5"], "--matryoshka-dims: expected integers; got '1.5'"),
    (["--matryoshka-dims", "16", "0"], "--matryoshka-dims must be positive widths"),
    (["--matryoshka-dims", "16", "8", "16"], "--matryoshka-dims must be distinct"),
    (["--matryoshka-weights", "1"], "--matryoshka-weights needs --matryoshka-dims"),
    (["--matryoshka-dims", "16", "8", "--matryoshka-weights", "1"], "one weight per --matryoshka-dims width"),
    (["--matryoshka-dims", "16", "--matryoshka-weights", "heavy"], "--matryoshka-weights: expected numbers"),
    (["--matryoshka-dims", "16", "--matryoshka-weights", "nan"], "--matryoshka-weights must be finite and > 0"),
    (["--matryoshka-dims", "16", "--matryoshka-weights", "-1"], "--matryoshka-weights must be finite and > 0"),
])
def test_bad_values_are_rejected_naming_the_flag(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        config_from_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("dims, message", [([16.0], "expected integers"), ([True], "expected numbers"),
                                           (["8", None], "expected numbers"), ("16 8", "expected integers")])
def test_config_values_are_not_silently_coerced(dims, message):
    """From a config file or the Python API: a float or a bool is refused, not truncated to an int; a string is one
    value (as the flag's one word), not read as a list of characters."""
    with pytest.raises(ValueError, match=f"--matryoshka-dims: {message}"):
        TrainConfig(matryoshka_dims=dims).validate()


def test_widths_are_checked_against_the_model_before_training(tmp_path):
    """A width beyond the embeddings (or an odd one while the angle term needs halves) fails in setup, before any
    step, with the flag and the model's width in the message. Format B has no angle term: its odd widths train
    whatever --angle-w says (they were refused unless --angle-w 0 was given)."""
    with pytest.raises(ValueError, match=r"--matryoshka-dims 64 16 does not fit .* 32 dimensions.*exceed"):
        _setup(tmp_path, ["--matryoshka-dims", "64", "16"])
    with pytest.raises(ValueError, match=r"--matryoshka-dims 32 15 .*--angle-w > 0.*even"):
        _setup(tmp_path, ["--matryoshka-dims", "32", "15", "--cosine-w", "1", "--ibn-w", "0"], fmt="A")
    assert _setup(tmp_path, ["--matryoshka-dims", "32", "15", "--cosine-w", "1", "--ibn-w", "0", "--angle-w", "0"],
                  fmt="A").loss_fn.dims == (32, 15)
    assert _setup(tmp_path, ["--matryoshka-dims", "32", "15"]).loss_fn.dims == (32, 15)  # format B


def test_encode_dim_truncates_before_normalising():
    encoder, tokenizer = make_encoder(dtype=torch.float64)
    full = encoder.encode(TEXTS, tokenizer, batch_size=3)
    torch.testing.assert_close(encoder.encode(TEXTS, tokenizer, batch_size=3, dim=8), full[:, :8], rtol=0, atol=0)
    unit = encoder.encode(TEXTS, tokenizer, batch_size=3, dim=8, normalize=True)
    torch.testing.assert_close(unit, torch.nn.functional.normalize(full[:, :8], dim=-1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(unit.norm(dim=-1), torch.ones(len(TEXTS)))  # encode returns float32
    # normalising first and cutting after would not give unit vectors: the order above is what was tested
    assert (torch.nn.functional.normalize(full, dim=-1)[:, :8].norm(dim=-1) < 0.99).all()
    torch.testing.assert_close(encoder.encode(TEXTS, tokenizer, dim=WIDTH), full, rtol=0, atol=0)
    for bad in (0, WIDTH + 1, True, 8.0):
        with pytest.raises(ValueError, match="dim must be None or an int from 1 to the embedding width 32"):
            encoder.encode(TEXTS, tokenizer, dim=bad)


def test_encode_refuses_a_batch_size_below_one_and_takes_no_texts():
    """A negative batch_size made no batch and returned the uninitialised output as embeddings; an empty list crashed
    inside the tokenizer."""
    encoder, tokenizer = make_encoder(dtype=torch.float64)
    for bad in (-1, 0, True, 2.0):
        with pytest.raises(ValueError, match="batch_size must be an int of at least 1"):
            encoder.encode(TEXTS, tokenizer, batch_size=bad)
    assert encoder.encode([], tokenizer).shape == (0, WIDTH) and encoder.encode([], tokenizer, dim=8).shape == (0, 8)


def test_sts_spearman_at_a_width():
    from scipy.stats import spearmanr

    encoder, tokenizer = make_encoder(dtype=torch.float64)
    examples = demo_sts_examples(48)
    first = encoder.encode([ex.texts[0] for ex in examples], tokenizer)
    second = encoder.encode([ex.texts[1] for ex in examples], tokenizer)
    cosine = torch.nn.functional.cosine_similarity(first[:, :8], second[:, :8], dim=-1)
    expected = spearmanr(cosine.numpy(), [ex.label for ex in examples]).statistic
    at_8 = sts_spearman(encoder, tokenizer, examples, dim=8)
    assert at_8 == pytest.approx(expected, abs=1e-12)
    assert abs(at_8 - sts_spearman(encoder, tokenizer, examples)) > 1e-3  # the width changes the score
    assert sts_spearman(encoder, tokenizer, examples, dim=WIDTH) == sts_spearman(encoder, tokenizer, examples)


def test_export_records_the_widths_and_sentence_transformers_truncates(tmp_path):
    encoder, tokenizer = make_encoder(dtype=torch.float32, pooling="avg")
    path = save_pretrained(encoder, tokenizer, str(tmp_path / "m"), max_length=32, matryoshka_dims=[8, 32, 16])
    assert load_pretrained(path)[2]["matryoshka_dims"] == [32, 16, 8]  # largest first, as sentence-transformers lists
    plain = save_pretrained(encoder, tokenizer, str(tmp_path / "plain"), max_length=32)
    assert load_pretrained(plain)[2]["matryoshka_dims"] is None
    st = pytest.importorskip("sentence_transformers")
    theirs = st.SentenceTransformer(path, device="cpu", truncate_dim=8).encode(TEXTS, convert_to_tensor=True)
    torch.testing.assert_close(theirs, encoder.encode(TEXTS, tokenizer, dim=8), rtol=1e-4, atol=1e-5)


def test_training_reports_dev_spearman_at_every_width(tmp_path):
    """Needs AngleLoss(dims=...) on the CPU (the torch backend's dims feature)."""
    cfg = run_config(tmp_path, batch_size=16, max_steps=6, eval_every=3, lr=3e-3, warmup=0, max_length=16,
                     pooling="avg", cosine_w=1.0, ibn_w=0.0, angle_w=1.0, matryoshka_dims=["32", "16", "8"],
                     save_final=True)
    result = train(cfg, model=make_encoder(), train_examples=(demo_sts_examples(200, seed=4), "A"),
                   dev_examples=demo_sts_examples(64))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "dev_spearman" in r]
    assert [r["step"] for r in evals] == [3, 6] and evals == result.evals
    for row in evals:  # the full width is dev_spearman itself, not repeated as dev_spearman@32
        assert sorted(k for k in row if k.startswith("dev_spearman@")) == ["dev_spearman@16", "dev_spearman@8"]
    for dim in (16, 8):  # the last evaluation saw the final weights
        assert evals[-1][f"dev_spearman@{dim}"] == pytest.approx(
            sts_spearman(result.encoder, result.tokenizer, demo_sts_examples(64), max_length=16, dim=dim), abs=1e-6)
    assert result.best_spearman == max(r["dev_spearman"] for r in evals)  # the best model by the full width
    for folder in ("best", "final"):
        assert load_pretrained(str(tmp_path / folder))[2]["matryoshka_dims"] == [32, 16, 8]
    card = (tmp_path / "final" / "README.md").read_text()  # the narrower widths, largest first, as evaluated
    assert f"embeddings of {WIDTH} dimensions (trained truncatable to 16, 8)" in card and "truncate_dim=8" in card


@pytest.mark.parametrize("flags", [{"matryoshka_dims": [str(WIDTH)]}, {"espresso": True, "espresso_dim": 2 * WIDTH}])
def test_a_run_of_the_full_width_alone_offers_no_prefix_in_its_model_card(tmp_path, flags):
    """--matryoshka-dims of the model's width alone, or an --espresso-dim not narrower than it, trains no narrower
    width: the card offered the whole embedding as "a Matryoshka prefix" (truncate_dim=32, a 32-wide model) and
    called the model truncatable."""
    cfg = run_config(tmp_path, batch_size=8, max_steps=1, max_length=16, save_final=True, **flags)
    train(cfg, model=make_encoder(layers=2), train_examples=(demo_examples(16), "B"))
    card = (tmp_path / "final" / "README.md").read_text()
    assert f"embeddings of {WIDTH} dimensions\n" in card
    assert "truncat" not in card and "Matryoshka prefix" not in card and "SentenceTransformer(" in card


def test_widths_that_leave_out_the_full_one_say_so(tmp_path, capsys):
    """best/ is chosen by the full width's dev score: widths without it leave that width untrained as an embedding of
    its own, which the start-up line now notes (sentence-transformers' MatryoshkaLoss warns the same)."""
    def start(dims):
        cfg = run_config(tmp_path / "-".join(dims), batch_size=8, max_steps=1, eval_every=1, max_length=16,
                         matryoshka_dims=dims)
        train(cfg, model=make_encoder(), train_examples=(demo_examples(16), "B"), dev_examples=demo_sts_examples(16))
        return capsys.readouterr().out

    assert f"--matryoshka-dims 16 8 leaves out the full width ({WIDTH})" in start(["16", "8"])
    assert "leaves out the full width" not in start([str(WIDTH), "8"])

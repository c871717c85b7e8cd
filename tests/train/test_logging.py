"""What a run reports, as the Hugging Face Trainer reports it: the logged loss is the mean over the steps since the
last row (not the last step's), the dev set is scored before the first step (the score training has to beat), the
learning-rate curve shows the warmup from step 0, the dev axis does not blow noise up into a trend, and with
--progress 0 no progress bar prints (transformers' weight loading and saving included). Tiny models: seconds."""

from __future__ import annotations

import json
import re

import pytest
import torch
from train_helpers import make_encoder, run_config

from angle_train import tracking
from angle_train.config import TrainConfig
from angle_train.tiny import demo_examples, demo_sts_examples
from angle_train.trainer import train


def _train(out, **settings):
    cfg = run_config(out, **{"batch_size": 8, "max_steps": 6, "log_every": 3, "warmup": 3, "lr": 1e-3, **settings})
    result = train(cfg, model=make_encoder("bert"), train_examples=(demo_examples(64), "B"),
                   dev_examples=demo_sts_examples(16))
    return result, tracking.read_metrics(str(out / "metrics.jsonl"))


def test_the_logged_loss_is_the_mean_over_its_interval(tmp_path, capsys):
    """Each metrics row's loss is the mean over the steps since the row before, and so is the summary line's."""
    result, rows = _train(tmp_path)
    logged = [row for row in rows if "loss" in row]
    losses = [row["loss"] for row in result.history]  # every step's own
    assert [row["step"] for row in logged] == [3, 6]
    assert logged[0]["loss"] == pytest.approx(sum(losses[:3]) / 3, rel=1e-12)
    assert logged[1]["loss"] == pytest.approx(sum(losses[3:]) / 3, rel=1e-12)
    assert logged[1]["loss"] != pytest.approx(losses[5], rel=1e-9)
    printed = capsys.readouterr().out
    done = re.search(rf"done: 6 steps \| loss {logged[1]['loss']:.4f} \(mean of the last 3 steps\) \| ([0-9.]+) "
                     r"pairs/s, ([0-9]+) tokens/s \(over the 6 steps trained\) \| peak memory [0-9.]+ GiB \(process "
                     r"RSS\)", printed)
    assert done, printed
    # the whole run's rates, not the last row's: its pairs over its rows' training time (each row's pairs / rate)
    seconds = sum(24 / row["pairs_per_s"] for row in logged)  # 3 steps of 8 pairs a row
    assert float(done[1]) == pytest.approx(48 / seconds, abs=0.051)
    assert float(done[2]) == pytest.approx(sum(24 * row["tokens_per_s"] / row["pairs_per_s"] for row in logged)
                                           / seconds, abs=0.51)


def test_the_dev_set_is_scored_before_the_first_step(tmp_path):
    assert TrainConfig().eval_on_start  # on by default
    result, rows = _train(tmp_path / "on", eval_every=3, eval_on_start=True)
    assert [row["step"] for row in result.evals] == [0, 3, 6]
    assert [row["step"] for row in rows if "dev_spearman" in row] == [0, 3, 6]
    result, _ = _train(tmp_path / "off", eval_every=3, eval_on_start=False)
    assert [row["step"] for row in result.evals] == [3, 6]


def test_the_curves_show_the_warmup_and_a_calm_dev_axis(tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image

    result, rows = _train(tmp_path, eval_every=3, eval_on_start=True, log_every=3, max_steps=6, warmup=3)
    with Image.open(tmp_path / "curves.png") as image:
        drawn = json.loads(image.text[tracking.CURVES_METADATA_KEY])
    assert drawn["lr_steps"] == [0, 1, 2, 3, 4, 5, 6]  # every step, the warmup's first ones too
    lr = drawn["lr"]
    assert lr[:4] == pytest.approx([1e-3 * k / 4 for k in (1, 2, 3, 4)]) and lr[-1] == pytest.approx(0.0)
    low, high = drawn["dev_ylim"]
    scores = [row["dev_spearman"] for row in result.evals]
    assert high - low >= tracking.MIN_SCORE_SPAN and low <= min(scores) and max(scores) <= high


def test_progress_0_prints_no_bar(tmp_path, capsys):
    cfg = run_config(tmp_path, batch_size=8, max_steps=1, save_final=True, progress=False)
    train(cfg, model=make_encoder("bert", dtype=torch.float32), train_examples=(demo_examples(16), "B"))
    err = capsys.readouterr().err
    assert "Writing model shards" not in err and "%|" not in err, err


def test_the_closing_lines_print_below_the_finished_progress_bar(tmp_path, capsys):
    """The bar (stderr) is closed, at its last step, before the final export and the summary line (stdout): closed at
    the run's end, it was drawn again below them, and in a terminal the summary line began on the bar's own line."""
    import tqdm

    order = []
    closing, printing = tqdm.tqdm.close, print

    def close(bar):
        if not bar.disable:
            order.append("bar closed")
        closing(bar)

    def said(*args, **kwargs):
        if args and str(args[0]).startswith("done: "):
            order.append("summary")
        printing(*args, **kwargs)

    cfg = run_config(tmp_path, batch_size=8, max_steps=2, progress=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tqdm.tqdm, "close", close)
        patch.setattr("builtins.print", said)
        train(cfg, model=make_encoder("bert", dtype=torch.float32), train_examples=(demo_examples(16), "B"))
    assert order == ["bar closed", "summary"], order
    assert "train: 100%" in capsys.readouterr().err


def test_pairs_per_second_leave_out_evaluation_and_checkpoints(tmp_path, monkeypatch):
    """pairs/s and tokens/s measure the training steps: the dev evaluation (at step 0 and after every step here) and
    the checkpoints do not count (they had fallen into the next row's window: 176 pairs/s reported for 867 measured
    with a 20k-pair dev set). A clock that jumps an hour inside every evaluation and save shows it exactly."""
    import time
    from types import SimpleNamespace

    from angle_train import trainer

    jumps = [0.0]
    clock = SimpleNamespace(perf_counter=lambda: time.perf_counter() + jumps[0])
    monkeypatch.setattr(trainer, "time", clock)
    for name in ("evaluate", "save"):
        real = getattr(trainer, name)
        monkeypatch.setattr(trainer, name, lambda run, real=real: (jumps.__setitem__(0, jumps[0] + 3600.0),
                                                                   real(run))[1])
    result, rows = _train(tmp_path, eval_every=1, eval_on_start=True, save_every=2, log_every=1)
    assert jumps[0] >= 10 * 3600.0  # 7 evaluations and 3 checkpoints jumped the clock
    logged = [row for row in rows if "pairs_per_s" in row]
    assert len(logged) == 6 and all(row["pairs_per_s"] > 8 / 60 for row in logged)  # under a minute per step


def test_the_header_says_how_many_examples_each_epoch_leaves_out(tmp_path, capsys):
    """A step takes grad_accum whole batches: the rest of each epoch is left out, and a run that reaches an epoch's
    end says so. A run that ends within its first epoch (--max-steps 3 of an epoch's 5) reaches none of them, and
    was told of them all the same."""
    from angle_train.trainer import examples_left_out, left_out_note

    assert examples_left_out(TrainConfig(batch_size=3000), 4096) == 1096
    assert examples_left_out(TrainConfig(batch_size=32768, grad_accum=4), 200_000) == 68_928
    assert examples_left_out(TrainConfig(batch_size=8), 64) == 0
    # 64 examples in steps of 12 (or 6 x 2): 5 steps an epoch, 4 examples left out
    for cfg in (TrainConfig(batch_size=12), TrainConfig(batch_size=6, grad_accum=2)):
        assert left_out_note(cfg, 64, total_steps=4, unit="examples") is None
        assert left_out_note(cfg, 64, total_steps=5, unit="examples").startswith(
            "angle_train: each epoch leaves out 4 of the 64 examples (6.2%")
    assert left_out_note(TrainConfig(batch_size=8), 64, total_steps=100, unit="examples") is None
    _train(tmp_path / "a", batch_size=60, max_steps=1)  # one step an epoch
    out = capsys.readouterr().out
    assert "each epoch leaves out 4 of the 64 examples (6.2%" in out and "closer to a divisor" in out
    _train(tmp_path / "b", batch_size=12, max_steps=1)  # ends within its first epoch
    assert "leaves out" not in capsys.readouterr().out


def test_the_header_says_when_max_steps_overrides_the_epochs_given(tmp_path, capsys):
    """--max-steps sets the run's length over a given --epochs (as Hugging Face's Trainer does): where the two
    disagree, the start says so once, instead of a run stopping partway through its epochs in silence."""
    from angle_train.trainer import max_steps_note

    # 64 examples in batches of 8: 8 steps an epoch
    assert max_steps_note(TrainConfig(batch_size=8, epochs=0.25, max_steps=3), 64, 1) == (
        "angle_train: note: --max-steps 3 runs the training past --epochs 0.25's 2 steps: --max-steps sets the "
        "run's length when both are given")
    assert max_steps_note(TrainConfig(batch_size=8, epochs=2, max_steps=16), 64, 1) is None  # they agree
    assert max_steps_note(TrainConfig(batch_size=8, max_steps=3), 64, 1) is None  # --epochs not given
    assert max_steps_note(TrainConfig(batch_size=8, epochs=2), 64, 1) is None  # --max-steps not given
    _train(tmp_path / "a", epochs=2, max_steps=3)
    out = capsys.readouterr().out
    assert out.count("note: --max-steps") == 1
    assert "--max-steps 3 ends the run before --epochs 2's 16 steps" in out
    _train(tmp_path / "b", max_steps=3)
    assert "note: --max-steps" not in capsys.readouterr().out


def test_an_epochs_given_with_its_default_value_is_given_with_max_steps(tmp_path):
    """--epochs 1 given with --max-steps is given, as --epochs 2 is: the note says --max-steps overrides it, from the
    command line, a --config file and Python alike, and the recorded command, config.json and a validation again keep
    it. It was taken for --epochs left out, being the default: the run stopped partway through the epoch given, in
    silence. Left out with --max-steps it stays None (not given); without --max-steps it is 1, as before."""
    import dataclasses
    import json
    import shlex

    from angle_train.cli import config_from_args
    from angle_train.trainer import max_steps_note

    said = ("angle_train: note: --max-steps 3 ends the run before --epochs 1's 8 steps: --max-steps sets the run's "
            "length when both are given")
    cfg = config_from_args(["--batch-size", "8", "--max-steps", "3", "--epochs", "1"])
    assert cfg == TrainConfig(batch_size=8, max_steps=3, epochs=1.0).validate() == cfg.validate()
    assert max_steps_note(cfg, 64, 1) == said  # 64 examples in batches of 8: 8 steps an epoch
    assert config_from_args(shlex.split(cfg.command_line())[1:]) == cfg
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dataclasses.asdict(cfg)))
    assert max_steps_note(config_from_args(["--config", str(path)]), 64, 1) == said
    left_out = config_from_args(["--batch-size", "8", "--max-steps", "3"])
    assert left_out.epochs is None and max_steps_note(left_out, 64, 1) is None
    assert "--epochs" not in left_out.command_line()
    path.write_text(json.dumps(dataclasses.asdict(left_out)))  # its config.json: "epochs": null
    assert config_from_args(["--config", str(path)]) == left_out
    assert config_from_args(["--batch-size", "8"]).epochs == TrainConfig().validate().epochs == 1.0


def test_a_run_says_what_it_tokenises_before_it_does(tmp_path, capsys):
    """Tokenising the training texts is most of the start-up with a lot of data (about 30 s of the 42 s to the first
    step at a million short pairs on 2 cores), and nothing was printed until it was done: a line before it says how
    many texts, and how long reading and checking the data took."""
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"query": ex.texts[0], "positive": ex.texts[1]}) + "\n"
                            for ex in demo_examples(64)))
    train(run_config(tmp_path / "a", train_data=str(path), batch_size=8, max_steps=1, max_length=16),
          model=make_encoder("bert"))
    lines = capsys.readouterr().out.splitlines()
    said = [i for i, line in enumerate(lines) if line.startswith("angle_train: tokenising ")]
    header = [i for i, line in enumerate(lines) if "128 texts" not in line and " | 64 examples (format B" in line]
    assert len(said) == 1 and len(header) == 1 and said[0] < header[0], lines
    assert re.fullmatch(r"angle_train: tokenising 128 texts at --max-length 16 \(64 examples, read and checked in "
                        r"\d+\.\d s\)", lines[said[0]])
    sentences = [" ".join(ex.texts) for ex in demo_examples(16)]
    train(run_config(tmp_path / "b", objective="arccse", batch_size=8, max_steps=1, max_length=16),
          model=make_encoder("bert"), train_examples=sentences)  # given, not read
    assert "angle_train: tokenising 16 texts at --max-length 16 (16 sentences)\n" in capsys.readouterr().out


def test_the_header_says_how_many_rows_repeat_an_earlier_one(tmp_path, capsys):
    """Rows given twice were kept without a word, and a copy in its original's batch is a false in-batch negative for
    the in-batch terms: the run says how many rows repeat an earlier one exactly and trains every row as given.
    Rows that share a text but not all of it (another positive, another label) are not repeats."""
    from angle_train.data import Example, repeated_items

    rows = demo_examples(60)
    twice = rows + rows[:3] + [rows[0]]  # 4 repeats
    near = [Example(rows[0].texts[:1] + ("another positive",)), Example(rows[1].texts, 0.5)]
    assert repeated_items(twice + near) == 4 and repeated_items(rows) == 0
    assert repeated_items(["a", "b", "a", "c", "b", "a"]) == 3
    # a label by its value (1 and 1.0, 0.0 and -0.0), the texts by where each ends ("ab" + "c" is not "a" + "bc")
    same = [Example(("a", "b"), 1), Example(("a", "b"), 1.0), Example(("a", "b"), 0.0), Example(("a", "b"), -0.0)]
    assert repeated_items(same) == 2 and repeated_items([Example(("ab", "c")), Example(("a", "bc"))]) == 0
    assert repeated_items([]) == repeated_items(["a"]) == 0 and repeated_items(["a", "a"]) == 1
    train(run_config(tmp_path / "a", batch_size=8, max_steps=1), model=make_encoder("bert"),
          train_examples=(twice, "B"))
    assert ("angle_train: note: 4 of the 64 examples repeat an earlier one exactly (the same query and positive); "
            "they are trained as given, and a copy in the same batch as its original is a false in-batch negative for "
            "the contrastive term: remove the copies to avoid it\n" in capsys.readouterr().out)
    train(run_config(tmp_path / "b", batch_size=8, max_steps=1), model=make_encoder("bert"),
          train_examples=(rows + near + rows[:2], "B"))
    assert "repeat an earlier one" in capsys.readouterr().out  # 2 of 64
    train(run_config(tmp_path / "c", batch_size=8, max_steps=1), model=make_encoder("bert"),
          train_examples=(demo_examples(64), "B"))
    assert "repeat an earlier one" not in capsys.readouterr().out
    sentences = [" ".join(ex.texts) for ex in demo_examples(15)]
    train(run_config(tmp_path / "d", objective="arccse", batch_size=8, max_steps=1, max_length=16),
          model=make_encoder("bert"), train_examples=sentences + sentences[:1])
    assert "angle_train: note: 1 of the 16 sentences repeats an earlier one exactly; they are trained" in (
        capsys.readouterr().out)


def test_the_repeats_note_names_the_in_batch_terms_the_loss_has_on():
    """A copy in its original's batch is a false negative only of a term whose negatives are the batch's other rows:
    format A's in-batch-negative term, C's in-batch and hard-negative terms (each where its weight is above 0), B's
    contrastive term (always on) and ArcCon. Format A's ranking terms alone (--ibn-w 0) were warned of all the same,
    and format B's examples, which have no label, were said to repeat "the same texts and label"."""
    from angle_train.trainer import repeats_note

    def note(fmt, loss_name="AngleLoss", **weights):
        return repeats_note(TrainConfig(**weights), fmt, loss_name, 4, 64)

    head = "angle_train: note: 4 of the 64 examples repeat an earlier one exactly"
    false_negative = ", and a copy in the same batch as its original is a false in-batch negative for "
    assert note("A") == (f"{head} (the same text1, text2 and label); they are trained as given{false_negative}the "
                         "in-batch-negative term (--ibn-w): remove the copies to avoid it")
    assert note("A", ibn_w=0, cosine_w=1) == (f"{head} (the same text1, text2 and label); they are trained as given "
                                              "(a copy weighs as one more example)")
    assert note("B", ibn_w=0).startswith(f"{head} (the same query and positive); they are trained as given"
                                         f"{false_negative}the contrastive term: ")
    assert f"{false_negative}the contrastive terms (--ibn-w, --cln-w): " in note("C")
    assert f"{false_negative}the contrastive term (--cln-w): " in note("C", ibn_w=0)
    assert note("C", ibn_w=0, cln_w=0).endswith("(the same query, positive and negative); they are trained as given "
                                                "(a copy weighs as one more example)")
    assert f"{false_negative}a loss with in-batch negatives: " in note("A", "my_loss", ibn_w=0)
    assert repeats_note(TrainConfig(), None, "ArcCSELoss", 1, 16) == (
        "angle_train: note: 1 of the 16 sentences repeats an earlier one exactly; they are trained as given"
        f"{false_negative}ArcCon: remove the copies to avoid it")
    assert repeats_note(TrainConfig(), "B", "AngleLoss", 0, 64) is None

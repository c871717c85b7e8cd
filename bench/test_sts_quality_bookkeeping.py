"""bench/sts_quality.py's bookkeeping, without the STS Benchmark or the model: what it needs, what each run trains
with, the difference it reports and where the results go (the fine-tuning itself: tests/train/test_sts_quality.py)."""

from __future__ import annotations

import json
import sys
import types

import pytest

import angle_train.config
import angle_train.data
import angle_train.evaluate
import angle_train.export
import angle_train.models
import angle_train.trainer
import sts_quality


def test_each_missing_requirement_is_named(tmp_path, monkeypatch):
    """Without sts-dev.csv (dev evaluation picks the best checkpoint) or the model, the check says what is missing."""
    monkeypatch.setenv("ANGLE_STSB_DIR", str(tmp_path))
    monkeypatch.setattr(sts_quality, "minilm_dir", lambda: "/models/minilm")
    for name in ("sts-train.csv", "sts-test.csv"):
        (tmp_path / name).write_text("")
    assert sts_quality.missing_requirements() == (f"STS Benchmark not found: {tmp_path / 'sts-dev.csv'} "
                                                   "(set ANGLE_STSB_DIR)")
    (tmp_path / "sts-dev.csv").write_text("")
    assert sts_quality.missing_requirements() is None
    monkeypatch.setattr(sts_quality, "minilm_dir", lambda: None)
    assert "all-MiniLM-L6-v2 not found" in sts_quality.missing_requirements()


def test_the_model_folder_counts_only_with_its_config(tmp_path, monkeypatch):
    spec = types.SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(sts_quality.importlib.util, "find_spec", lambda name: spec)
    (tmp_path / "model").mkdir()
    assert sts_quality.minilm_dir() is None
    (tmp_path / "model" / "config.json").write_text("{}")
    assert sts_quality.minilm_dir() == str(tmp_path / "model")


def test_both_runs_train_alike_but_for_the_loss_and_their_difference_is_reported(monkeypatch):
    """Ours trains with angle_train's own loss, the reference with angle-emb's; each run's sts-test score is that of
    its best checkpoint, and abs_diff is the size of the difference."""
    pytest.importorskip("angle_emb")
    trained, scores = [], {"encoder": 0.80, "best-angle_kernels": 0.84, "best-reference": 0.86}
    monkeypatch.setattr(sts_quality, "missing_requirements", lambda: None)
    monkeypatch.setattr(sts_quality, "minilm_dir", lambda: "/models/minilm")
    monkeypatch.setattr(angle_train.config, "TrainConfig", lambda **settings: settings)
    monkeypatch.setattr(angle_train.data, "load_examples", lambda path: (["a test pair"], None))
    monkeypatch.setattr(angle_train.models, "load_encoder", lambda model, pooling: ("encoder", "tokenizer"))
    monkeypatch.setattr(angle_train.export, "load_pretrained", lambda path: (path, "tokenizer", None))
    monkeypatch.setattr(angle_train.evaluate, "sts_spearman",
                        lambda encoder, tokenizer, test, max_length: scores[encoder])

    def train(cfg, loss_fn):
        impl = "angle_kernels" if loss_fn is None else "reference"
        trained.append((impl, cfg["ibn_w"], cfg["epochs"], cfg["seed"]))
        history = [{"loss": 1.0 - step / 10, "pairs_per_s": 100.0 + step} for step in range(7)]
        return types.SimpleNamespace(best_path=f"best-{impl}", best_spearman=0.9, history=history, evals=[{}, {}])

    monkeypatch.setattr(angle_train.trainer, "train", train)
    results = sts_quality.run(epochs=0.25, seed=7, verbose=False)
    assert trained == [("angle_kernels", 0.0, 0.25, 7), ("reference", 0.0, 0.25, 7)]
    assert results["before"] == 0.80
    assert results["angle_kernels"]["after"] == 0.84 and results["reference"]["after"] == 0.86
    assert results["abs_diff"] == pytest.approx(0.02)
    assert results["reference"]["steps"] == 7 and results["reference"]["last_loss"] == pytest.approx(0.4)
    assert results["reference"]["first_losses"] == pytest.approx([1.0, 0.9, 0.8, 0.7, 0.6])


def test_the_script_runs_what_it_is_asked_and_writes_its_results(tmp_path, monkeypatch, capsys):
    runs = []

    def run(**options):
        runs.append(options["impls"])
        return {"before": 0.8, "reference": {"after": 0.85}}

    monkeypatch.setattr(sts_quality, "missing_requirements", lambda: None)
    monkeypatch.setattr(sts_quality, "run", run)
    out = tmp_path / "results.json"
    monkeypatch.setattr(sys, "argv", ["sts_quality.py", "--only", "reference", "--out", str(out)])
    assert sts_quality.main() == 0
    assert runs == [("reference",)]
    assert json.loads(out.read_text()) == {"before": 0.8, "reference": {"after": 0.85}}


def test_the_script_skips_when_a_requirement_is_missing(monkeypatch, capsys):
    monkeypatch.setattr(sts_quality, "missing_requirements", lambda: "STS Benchmark not found: here")
    monkeypatch.setattr(sts_quality, "run", lambda **options: pytest.fail("ran without its requirements"))
    monkeypatch.setattr(sys, "argv", ["sts_quality.py"])
    assert sts_quality.main() == 0
    assert capsys.readouterr().out == "skipped: STS Benchmark not found: here\n"


def test_without_angle_emb_the_check_runs_ours_alone_and_says_why(monkeypatch, capsys):
    """angle-emb is optional: without it the reference run raised ImportError after ours had trained for minutes."""
    ran = []
    monkeypatch.setattr(sts_quality, "missing_requirements", lambda: None)
    monkeypatch.setattr(sts_quality, "reference_unavailable", lambda: "ModuleNotFoundError: no module 'angle_emb'")
    monkeypatch.setattr(sts_quality, "run", lambda **settings: ran.append(settings["impls"]) or {"settings": {}})
    assert sts_quality.main([]) == 0 and ran == [("angle_kernels",)]
    assert "# the reference run is left out: angle-emb's loss cannot be loaded" in capsys.readouterr().out
    assert sts_quality.main(["--only", "reference"]) == 0 and ran == [("angle_kernels",)]
    assert capsys.readouterr().out.startswith("skipped: angle-emb's loss cannot be loaded")


@pytest.mark.parametrize("flags, message", [
    (["--epochs", "0"], "--epochs must be more than 0"), (["--lr", "0"], "--lr must be more than 0"),
    (["--batch-size", "0"], "--batch-size must be a positive integer"),
    (["--eval-every", "0"], "--eval-every must be a positive integer"),
    (["--threads", "0"], "--threads must be a positive integer"),
])
def test_bad_flags_are_refused_naming_the_flag_before_anything_loads(monkeypatch, capsys, flags, message):
    monkeypatch.setattr(sts_quality, "missing_requirements", lambda: pytest.fail("checked requirements first"))
    with pytest.raises(SystemExit):
        sts_quality.main(flags)
    assert message in capsys.readouterr().err


"""bench_data_prep.py: its batches are the pairs it asks for, and the script prints its table."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

import bench_data_prep


def test_the_synthetic_texts_have_the_asked_lengths():
    dataset = bench_data_prep.make_dataset(200, min_tokens=5, max_tokens=9)
    lengths = dataset.lengths_of(list(range(200)))
    assert len(dataset) == 200 and min(lengths) == 5 and max(lengths) == 9


def test_the_script_prints_its_table(capsys):
    assert bench_data_prep.main(["--pairs", "40", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 7 and "| 40 pairs |" in out and "| one packed pass |" in out
    assert bench_data_prep.main(["--pairs", "40", "--rounds", "3", "--json"]) == 0
    times = json.loads(capsys.readouterr().out)
    assert list(times) == list(bench_data_prep.SETTINGS) and all(len(t) == 3 for t in times.values())


@pytest.mark.parametrize("flags, message", [(["--rounds", "0"], "--rounds must be a positive integer"),
                                            (["--threads", "0"], "--threads must be a positive integer"),
                                            (["--pairs", "0"], "--pairs must be a positive integer"),
                                            (["--min-tokens", "9", "--max-tokens", "5"], "3 <= min <= max"),
                                            (["--min-tokens", "2", "--max-tokens", "5"], "3 <= min <= max"),
                                            (["--checkout", "/nonexistent"], "holds no angle_train/data.py")])
def test_bad_flags_are_refused(capsys, flags, message):
    with pytest.raises(SystemExit):
        bench_data_prep.main(flags)
    assert message in capsys.readouterr().err


def test_every_setting_prepares_the_whole_batch_every_round(monkeypatch):
    """Each round, each setting cuts the whole batch (every pair, in one shuffled order) with its own options, and
    makes its tensors and its token counts: what the trainer does every step."""
    calls = []

    class Plan:
        def __init__(self, indices, options):
            self.indices, self.options = indices, options

        def tensors(self, pad_id, side):
            calls.append(("tensors", pad_id, side))

        def token_counts(self):
            calls.append(("token_counts",))

    class Dataset:
        def batch(self, indices):
            return types.SimpleNamespace(plan=lambda **options: calls.append(("plan", sorted(indices), options))
                                         or Plan(indices, options))

    monkeypatch.setattr(bench_data_prep, "make_dataset", lambda pairs, min_tokens, max_tokens: Dataset())
    times = bench_data_prep.measure(pairs=6, rounds=2, min_tokens=5, max_tokens=9)
    assert list(times) == list(bench_data_prep.SETTINGS) and all(len(each) == 2 for each in times.values())
    expected = [call for options in bench_data_prep.SETTINGS.values()
                for call in (("plan", list(range(6)), options), ("tensors", 0, "right"), ("token_counts",))]
    assert calls == expected * 2


def test_each_setting_cuts_the_passes_it_is_named_for():
    """'chunks of 512 texts' cuts 1,200 texts into passes of at most 512, the token settings stay within 16,384
    tokens a pass, and the 'one ... pass' settings make one pass."""
    dataset = bench_data_prep.make_dataset(600, min_tokens=8, max_tokens=52)
    batch = dataset.batch(list(range(600)))
    passes = {name: batch.plan(**options).passes for name, options in bench_data_prep.SETTINGS.items()}
    assert [len(rows) for rows, _ in passes["chunks of 512 texts"]] == [512, 512, 176]
    assert len(passes["one padded pass"]) == len(passes["one packed pass"]) == 1
    for name in ("16,384-token passes", "packed, 16,384-token passes"):
        assert len(passes[name]) > 1, name
    assert bench_data_prep.SETTINGS["packed, 16,384-token passes"]["pack_width"] == 128


def test_the_table_gives_each_settings_median_and_range():
    lines = bench_data_prep.table({"one padded pass": [0.1, 0.6, 0.2]}, pairs=32768).splitlines()
    assert lines == ["| 32,768 pairs | median s | fastest-slowest s |", "|---|---|---|",
                     "| one padded pass | 0.200 | 0.100-0.600 |"]


def test_the_flags_reach_the_measurement(monkeypatch, capsys):
    seen, threads = [], []
    monkeypatch.setattr(bench_data_prep, "measure", lambda *args: seen.append(args) or {"one padded pass": [0.5]})
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    assert bench_data_prep.main(["--pairs", "12", "--rounds", "2", "--threads", "3", "--min-tokens", "4",
                                 "--max-tokens", "6"]) == 0
    assert seen == [(12, 2, 4, 6)] and threads == [3]
    assert "| one padded pass | 0.500 | 0.500-0.500 |" in capsys.readouterr().out


def test_a_checkout_is_refused_once_angle_train_is_imported(capsys):
    """Timing another checkout needs a fresh process: this one would time the angle_train it already imported."""
    import angle_train  # noqa: F401

    with pytest.raises(SystemExit):
        bench_data_prep.main(["--checkout", str(Path(__file__).resolve().parent.parent)])
    assert "--checkout: angle_train is already imported in this process" in capsys.readouterr().err

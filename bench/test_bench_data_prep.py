"""bench_data_prep.py: its batches are the pairs it asks for, and the script prints its table."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
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


def _strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_the_json_output_is_strict_with_null_for_a_time_that_is_not_finite(monkeypatch, capsys):
    """--json prints through bench/'s JSON writer (harness.json_text): a time that is not finite is null, where
    json.dumps printed NaN or Infinity, which jq and other strict parsers refuse."""
    monkeypatch.setattr(bench_data_prep, "measure", lambda *args: {"one padded pass": [0.5, math.inf, math.nan]})
    assert bench_data_prep.main(["--json"]) == 0
    assert _strict_json(capsys.readouterr().out) == {"one padded pass": [0.5, None, None]}


def test_an_older_checkout_s_json_is_written_by_bench_s_own_writer(tmp_path):
    """--checkout DIR imports DIR's angle_train, which may predate the writer's helper (tracking.finite_or_none): the
    --json output is still written, with bench/'s own. In a fresh process, where angle_train is not yet imported."""
    package = tmp_path / "old" / "angle_train"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "tracking.py").write_text("# an angle_train from before finite_or_none\n")
    (package / "data.py").write_text("raise ImportError('the stand-in data module is not timed here')\n")
    script = textwrap.dedent(f"""
        import math, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
        import bench_data_prep
        bench_data_prep.measure = lambda *args: {{"one padded pass": [math.nan, 0.25]}}
        code = bench_data_prep.main(["--checkout", {str(tmp_path / "old")!r}, "--json"])
        import angle_train.tracking
        assert not hasattr(angle_train.tracking, "finite_or_none"), angle_train.tracking.__file__
        sys.exit(code)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _strict_json(proc.stdout) == {"one padded pass": [None, 0.25]}


def test_every_flag_says_what_it_does_and_its_default(flags_without_default):
    """--help listed most flags bare (no text, no default) where the docstring's usage line did not name them."""
    assert flags_without_default(bench_data_prep.main) == []

"""bench_data_prep.py: its batches are the pairs it asks for, and the script prints its table."""

from __future__ import annotations

import json

import pytest

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
                                            (["--min-tokens", "9", "--max-tokens", "5"], "3 <= min <= max"),
                                            (["--checkout", "/nonexistent"], "holds no angle_train/data.py")])
def test_bad_flags_are_refused(capsys, flags, message):
    with pytest.raises(SystemExit):
        bench_data_prep.main(flags)
    assert message in capsys.readouterr().err

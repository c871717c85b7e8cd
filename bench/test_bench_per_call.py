"""bench_per_call.py: each of our rows computes the loss its eager row does (the table compares like with like),
and the script prints its table."""

from __future__ import annotations

import json

import pytest

import bench_per_call


def test_ours_and_the_eager_formula_agree():
    rows = bench_per_call.contenders(pairs=12, dim=8)
    for ours, eager in (("cosine_loss", "eager cosine"), ("in_batch_negative_loss", "eager in-batch"),
                        ("mnrl", "eager mnrl"), ("gist_loss", "eager gist")):
        assert float(rows[ours][0]().detach()) == pytest.approx(float(rows[eager][0]().detach()), rel=1e-5), ours


def test_the_script_prints_its_table(capsys):
    assert bench_per_call.main(["--pairs", "8", "--dim", "4", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 6 and "| mnrl |" in out


def test_a_subset_of_families_is_timed_alone(capsys):
    assert bench_per_call.main(["--pairs", "8", "--dim", "4", "--rounds", "2", "--losses", "mnrl", "--json"]) == 0
    assert sorted(json.loads(capsys.readouterr().out)) == ["eager mnrl", "mnrl"]
    assert bench_per_call.main(["--pairs", "8", "--dim", "4", "--rounds", "2", "--losses", "gist_loss,mnrl"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 4 and "| mnrl |" in out and "| gist_loss |" in out


@pytest.mark.parametrize("flags, message", [(["--rounds", "0"], "--rounds must be a positive integer"),
                                            (["--losses", "mnrl,ranking"], "--losses takes a comma-separated subset"),
                                            (["--losses", ","], "--losses takes a comma-separated subset")])
def test_bad_flags_are_refused(capsys, flags, message):
    with pytest.raises(SystemExit):
        bench_per_call.main(flags)
    assert message in capsys.readouterr().err

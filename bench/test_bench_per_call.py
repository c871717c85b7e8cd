"""bench_per_call.py: each of our rows computes the loss its eager row does (the table compares like with like),
and the script prints its table."""

from __future__ import annotations

import json
import math
import types

import pytest
import torch

import bench_per_call


def test_ours_and_the_eager_formula_agree():
    rows = bench_per_call.contenders(pairs=12, dim=8)
    for ours, eager in (("cosine_loss", "eager cosine"), ("in_batch_negative_loss", "eager in-batch"),
                        ("mnrl", "eager mnrl"), ("gist_loss", "eager gist")):
        assert float(rows[ours][0]().detach()) == pytest.approx(float(rows[eager][0]().detach()), rel=1e-5), ours


def test_the_script_prints_its_table(capsys):
    assert bench_per_call.main(["--pairs", "8", "--dim", "4", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("8 pairs, D = 4, 1 thread(s), forward + backward: 2 rounds, the first 1 not counted\n\n")
    assert out.count("\n") == 8 and "| mnrl |" in out


def test_a_subset_of_families_is_timed_alone(capsys):
    assert bench_per_call.main(["--pairs", "8", "--dim", "4", "--rounds", "2", "--losses", "mnrl", "--json"]) == 0
    assert sorted(json.loads(capsys.readouterr().out)) == ["eager mnrl", "mnrl"]
    assert bench_per_call.main(["--pairs", "8", "--dim", "4", "--rounds", "2", "--losses", "gist_loss,mnrl"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 6 and "| mnrl |" in out and "| gist_loss |" in out


@pytest.mark.parametrize("flags, message", [(["--rounds", "0"], "--rounds must be a positive integer"),
                                            (["--threads", "0"], "--threads must be a positive integer"),
                                            (["--losses", "mnrl,ranking"], "--losses takes a comma-separated subset"),
                                            (["--losses", ","], "--losses takes a comma-separated subset")])
def test_bad_flags_are_refused(capsys, flags, message):
    with pytest.raises(SystemExit):
        bench_per_call.main(flags)
    assert message in capsys.readouterr().err


class _StandIn:
    """Rows whose calls take set stand-in seconds on a stand-in clock (one value per call, in order)."""

    def __init__(self, seconds: dict[str, list[float]]):
        self.now, self.calls, self.seconds = 0.0, [], {name: list(each) for name, each in seconds.items()}
        self.leaf = torch.ones(2, requires_grad=True)

    def rows(self, pairs, dim):
        def row(name):
            def call():
                self.calls.append(name)
                self.now += self.seconds[name].pop(0)
                return (self.leaf * 2.0).sum()
            return call, [self.leaf]
        return {name: row(name) for name in (*bench_per_call.FAMILIES, *bench_per_call.FAMILIES.values())}


def test_medians_are_milliseconds_of_the_rounds_after_the_warm_ones(monkeypatch):
    """A row's figure is its median over the rounds after the warm ones, in ms, and only the asked families run."""
    stand_in = _StandIn({"mnrl": [1.0, 1.0, 0.002, 0.003, 0.001], "eager mnrl": [1.0, 1.0, 0.004, 0.006, 0.005]})
    monkeypatch.setattr(bench_per_call, "contenders", stand_in.rows)
    monkeypatch.setattr(bench_per_call, "time", types.SimpleNamespace(perf_counter=lambda: stand_in.now))
    medians = bench_per_call.measure(pairs=8, dim=4, rounds=5, warm_rounds=2, losses=("mnrl",))
    assert medians == pytest.approx({"mnrl": 2.0, "eager mnrl": 5.0})
    assert stand_in.calls == ["mnrl", "eager mnrl"] * 5


def test_the_table_gives_the_eager_formula_over_ours_with_spreads():
    """Each family's line: our median and the eager one with their interquartile ranges, and eager ÷ ours, above 1
    where ours is faster, the direction of bench_losses.py's ratios (it printed ours / eager: the inverse)."""
    lines = bench_per_call.table({"mnrl": [1.0, 2.0, 2.0, 3.0, 9.0], "eager mnrl": [8.0, 8.0, 8.0, 8.0, 8.0],
                                  "gist_loss": [3.0], "eager gist": [1.5]}).splitlines()
    assert lines[0] == ("| loss | ours ms: median (IQR) | eager ms: median (IQR) | eager ÷ ours (above 1: ours is "
                        "faster) |")
    assert lines[2:] == ["| mnrl | 2.000 (2.000-3.000) | 8.000 (8.000-8.000) | 4.00x |",
                         "| gist_loss | 3.000 (3.000-3.000) | 1.500 (1.500-1.500) | 0.50x |"]


def test_the_flags_reach_the_measurement(monkeypatch, capsys):
    """--pairs, --dim, --rounds (all but the first ten warm, fewer with fewer rounds), --threads and --losses are the
    ones measured; the defaults are those of the module docstring."""
    seen, threads = [], []

    def timings(pairs, dim, rounds, warm_rounds, losses):
        seen.append((pairs, dim, rounds, warm_rounds, losses))
        return {name: [1.0] for name in (*losses, *(bench_per_call.FAMILIES[family] for family in losses))}

    monkeypatch.setattr(bench_per_call, "timings", timings)
    monkeypatch.setattr(bench_per_call.torch, "set_num_threads", threads.append)
    assert bench_per_call.main([]) == 0
    assert bench_per_call.main(["--pairs", "16", "--dim", "8", "--rounds", "4", "--threads", "3",
                                "--losses", "mnrl"]) == 0
    assert seen == [(256, 64, 80, 10, tuple(bench_per_call.FAMILIES)), (16, 8, 4, 3, ("mnrl",))]
    assert threads == [1, 3]
    assert "| mnrl | 1.000 (1.000-1.000) | 1.000 (1.000-1.000) | 1.00x |" in capsys.readouterr().out


def test_the_json_output_is_strict_with_null_for_a_time_that_is_not_finite(monkeypatch, capsys):
    """--json prints through bench/'s JSON writer (harness.json_text): a median that is not finite is null, where
    json.dumps printed NaN, which jq and other strict parsers refuse."""
    monkeypatch.setattr(bench_per_call, "timings", lambda *args, **kwargs: {"mnrl": [math.nan], "eager mnrl": [2.0]})
    assert bench_per_call.main(["--losses", "mnrl", "--json"]) == 0

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    assert json.loads(capsys.readouterr().out, parse_constant=refuse) == {"mnrl": None, "eager mnrl": 2.0}


def test_every_flag_says_what_it_does_and_its_default(flags_without_default):
    """--help listed most flags bare (no text, no default) where the docstring's usage line did not name them."""
    assert flags_without_default(bench_per_call.main) == []

"""bench_matryoshka_ratios.py: every row of a table computes the loss it claims (the fused call, our separate
calls and sentence-transformers' agree, per group of rows), and the script writes its table."""

from __future__ import annotations

import types

import pytest
import torch

import bench_matryoshka_ratios as ratios
import providers as P


@pytest.mark.parametrize("make", [ratios.cosine_rows, ratios.mnrl_rows], ids=["cosine", "mnrl"])
def test_rows_of_a_group_compute_the_same_loss(make):
    rows = make(16, 24, 3, torch.float64, "cpu", torch.Generator().manual_seed(0), P.sentence_transformers_losses())
    assert list(rows) == ["single", "fused k=5", "ours k calls", "ST Matryoshka", "fused L x k", "ours L x k calls",
                          "ST L x Matryoshka"]  # the table's order, for both losses
    values = {name: float(run().detach()) for name, (run, _) in rows.items()}
    for group in (("fused k=5", "ours k calls", "ST Matryoshka"),
                  ("fused L x k", "ours L x k calls", "ST L x Matryoshka")):
        for name in group[1:]:
            assert values[name] == pytest.approx(values[group[0]], rel=1e-12), (name, values)
    assert values["fused k=5"] != pytest.approx(values["single"])  # the widths do add terms


@pytest.mark.parametrize("options", ["GTE_OPTIONS", "FILTER_OPTIONS"])
def test_similarity_lse_rows_of_a_group_compute_the_same_loss(options):
    """The "mnrl-gte" and "mnrl-filter" rows (similarity_lse blocks): the fused call equals our per-width calls."""
    rows = ratios.mnrl_rows(16, 24, 3, torch.float64, "cpu", torch.Generator().manual_seed(0),
                            P.sentence_transformers_losses(), options=getattr(ratios, options))
    values = {name: float(run().detach()) for name, (run, _) in rows.items()}
    assert not any(name.startswith("ST") for name in values)
    assert values["ours k calls"] == pytest.approx(values["fused k=5"], rel=1e-12)
    assert values["ours L x k calls"] == pytest.approx(values["fused L x k"], rel=1e-12)


def test_script_writes_its_table(tmp_path):
    assert ratios.main(["--d", "16", "--pairs", "8", "--queries", "8", "--layers", "2", "--repeats", "1",
                        "--time-per-case", "0", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "table.md").read_text()
    assert text.count("| fused L x k |") == 2 and "MultipleNegativesRankingLoss" in text


def test_rows_without_single_still_make_the_table(tmp_path, capsys):
    """The table's ratios are to the single row: measured whenever --rows leaves it out (it raised KeyError after
    measuring every row); an unknown row is refused naming the rows there are."""
    assert ratios.main(["--d", "16", "--pairs", "8", "--layers", "2", "--losses", "cosent", "--repeats", "1",
                        "--time-per-case", "0", "--rows", "fused k=5", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "table.md").read_text()
    assert "| single |" in text and "| fused k=5 |" in text and "| ST Matryoshka |" not in text
    with pytest.raises(SystemExit):
        ratios.main(["--d", "16", "--pairs", "8", "--losses", "cosent", "--rows", "nope", "--out", str(tmp_path)])
    assert "no row 'nope' for cosent; its rows: 'single'" in capsys.readouterr().err


def test_interleaved_rounds_give_medians_and_spreads(tmp_path):
    assert ratios.main(["--d", "16", "--queries", "8", "--layers", "2", "--losses", "mnrl", "--rows", "single",
                        "fused k=5", "--interleave", "3", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "table.md").read_text()
    assert "(3 interleaved rounds)" in text and "| spread (min - max) | / single |" in text
    assert "| single |" in text and "| fused k=5 |" in text and "CoSENT" not in text and "ST Matryoshka" not in text


def test_interleaved_rounds_rotate_the_order_and_sort_each_rows_times(monkeypatch):
    """Each round starts one row later (a drifting machine slows every row alike); each row's times come back sorted,
    the stand-in seconds of its timed runs (two warm runs each are not counted)."""
    clock, calls = {"now": 0.0}, []
    seconds = {"a": [9, 9, 3, 1, 2], "b": [9, 9, 5, 4, 6], "c": [9, 9, 8, 7, 9]}
    leaf = torch.ones(2, requires_grad=True)

    def row(name):
        def run():
            calls.append(name)
            clock["now"] += seconds[name].pop(0)
            return (leaf * 2.0).sum()
        return run, [leaf]

    monkeypatch.setattr(ratios, "time", types.SimpleNamespace(perf_counter=lambda: clock["now"]))
    times = ratios.measure_interleaved({name: row(name) for name in "abc"}, "cpu", rounds=3)
    assert calls[6:] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert times == {"a": [1, 2, 3], "b": [4, 5, 6], "c": [7, 8, 9]}


def test_interleaved_table_gives_medians_spreads_and_ratios_to_the_first_row():
    lines = ratios.interleaved_table("CoSENT", "N = 8 pairs", 16, {"single": [0.001, 0.002, 0.004],
                                                                    "fused k=5": [0.002, 0.003, 0.010]})
    assert lines[0] == "### CoSENT, N = 8 pairs, D = 16, dims (16, 10, 4, 2) (3 interleaved rounds)"
    assert "| single | 2 ms | 1 ms - 4 ms | 1.00x |" in lines
    assert "| fused k=5 | 3 ms | 2 ms - 10 ms | 1.50x |" in lines


def test_table_ratios_are_to_the_single_loss_and_layer_rows_to_l_times_it():
    row = {"extra_bytes": 2**20}
    lines = ratios.table("CoSENT", "N = 8 pairs", 16, 4, {"single": dict(row, min_s=0.002),
                                                           "fused k=5": dict(row, min_s=0.003),
                                                           "fused L x k": dict(row, min_s=0.016)})
    assert "| single | 2 ms | 1.00x | 1.00x | 1.0 MB |" in lines
    assert "| fused k=5 | 3 ms | 1.50x | 1.50x | 1.0 MB |" in lines
    assert "| fused L x k | 16 ms | 8.00x | 2.00x | 1.0 MB |" in lines


def test_each_loss_is_timed_on_its_own_size_dtype_and_options(tmp_path, monkeypatch):
    """CoSENT on --pairs pairs, MNRL on --queries queries, in --dtype, the GTE and filter rows with their options;
    --repeats and --time-per-case reach every measurement, each row is warmed once first, and the table lands in
    --out, which is made if missing."""
    measured, warmed, options_seen = [], [], []
    real_mnrl_rows = ratios.mnrl_rows

    def measure_fwd_bwd(run, leaves, device, repeats, time_per_case):
        measured.append(([(tuple(leaf.shape), leaf.dtype) for leaf in leaves], repeats, time_per_case))
        return {"min_s": 0.001, "extra_bytes": 0}

    def mnrl_rows(*args, options=None):
        options_seen.append(options)
        return real_mnrl_rows(*args, options=options)

    monkeypatch.setattr(ratios.harness, "measure_fwd_bwd", measure_fwd_bwd)
    monkeypatch.setattr(ratios.harness, "fwd_bwd", lambda run, leaves: warmed.append(len(measured)))
    monkeypatch.setattr(ratios, "mnrl_rows", mnrl_rows)
    out = tmp_path / "new" / "folder"
    assert ratios.main(["--d", "16", "--pairs", "8", "--queries", "6", "--layers", "2", "--dtype", "bfloat16",
                        "--repeats", "3", "--time-per-case", "0.25", "--losses", "cosent", "mnrl", "mnrl-gte",
                        "mnrl-filter", "--out", str(out)]) == 0
    assert [len(leaves) for leaves, _, _ in measured] == [1] * 7 + [3] * (7 + 5 + 5)
    assert measured[0][0] == [((16, 16), torch.bfloat16)]  # 8 pairs: 16 rows
    assert measured[7][0] == [((6, 16), torch.bfloat16)] * 3  # 6 queries, their positives and negatives
    assert {(repeats, time_per_case) for _, repeats, time_per_case in measured} == {(3, 0.25)}
    assert warmed == [0] * 7 + [7] * 7 + [14] * 5 + [19] * 5  # every row of a table warmed before the first is timed
    assert options_seen == [None, ratios.GTE_OPTIONS, ratios.FILTER_OPTIONS]
    text = (out / "table.md").read_text()
    assert "### MultipleNegativesRankingLoss, GTE directions and hardness, N = 6 queries" in text


def test_interleaved_rows_are_the_ones_asked_for(tmp_path):
    """With --interleave the ratios are to the first row asked for: no single row is added."""
    assert ratios.main(["--d", "16", "--pairs", "8", "--layers", "2", "--losses", "cosent", "--rows", "fused k=5",
                        "ours k calls", "--interleave", "2", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "table.md").read_text()
    assert "| / fused k=5 |" in text and "| single |" not in text and "| ours k calls |" in text


@pytest.mark.parametrize("flags, message", [
    (["--d", "0"], "--d takes positive widths"),
    (["--layers", "0"], "--layers must be a positive integer"),
    (["--pairs", "-5"], "--pairs must be a positive integer"),
    (["--repeats", "0"], "--repeats must be a positive integer"),
    (["--interleave", "-2", "--rows", "single"], "--interleave takes a number of rounds"),
    (["--losses", "cosent", "mnrl-gte", "--rows", "single", "ST Matryoshka"],
     "no row 'ST Matryoshka' for mnrl-gte"),
])
def test_bad_flags_are_refused_before_anything_is_measured(monkeypatch, capsys, flags, message):
    """Each was taken: a size of 0 or less or --interleave -2 ended in a traceback, --repeats 0 made ratios of one
    cold run, and a row that a later loss lacks was refused only after the earlier losses were measured."""
    measured = []
    monkeypatch.setattr(ratios, "measure", lambda *args, **kwargs: measured.append(args) or {})
    monkeypatch.setattr(ratios, "measure_interleaved", lambda *args, **kwargs: measured.append(args) or {})
    with pytest.raises(SystemExit):
        ratios.main(["--d", "16", "--pairs", "8", "--queries", "8", "--layers", "2", *flags])
    assert message in capsys.readouterr().err and measured == []


def test_every_flag_says_what_it_does_and_its_default(flags_without_default):
    """--help listed most flags bare (no text, no default) where the docstring's usage line did not name them."""
    assert flags_without_default(ratios.main, switches=()) == []


def test_without_sentence_transformers_the_table_keeps_our_rows_and_says_why(tmp_path, monkeypatch, capsys):
    """sentence-transformers is optional: without it the script ended in a ModuleNotFoundError traceback before any
    row was timed."""
    for make in (ratios.cosine_rows, ratios.mnrl_rows):
        rows = make(8, 16, 2, torch.float64, "cpu", torch.Generator().manual_seed(0), None)
        assert list(rows) == [name for name in ratios.ROWS if not name.startswith("ST")]

    def missing():
        raise ModuleNotFoundError("No module named 'sentence_transformers'")
    monkeypatch.setattr(P, "sentence_transformers_losses", missing)
    assert ratios.main(["--d", "16", "--pairs", "8", "--layers", "2", "--losses", "cosent", "--repeats", "1",
                        "--out", str(tmp_path)]) == 0
    assert "# sentence-transformers is not available (ModuleNotFoundError: " in capsys.readouterr().out
    table = (tmp_path / "table.md").read_text()
    assert "| ours L x k calls |" in table and "ST Matryoshka" not in table and "no ST rows." in table
    with pytest.raises(SystemExit):
        ratios.main(["--d", "16", "--losses", "cosent", "--rows", "ST Matryoshka"])
    assert "--rows: no row 'ST Matryoshka' for cosent" in capsys.readouterr().err


def test_cuda_asked_for_where_there_is_none_is_refused_naming_the_flag(monkeypatch, capsys):
    """It was a RuntimeError traceback from torch.Generator(device="cuda")."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        ratios.main(["--device", "cuda", "--d", "16"])
    assert "--device cuda: CUDA is not available here" in capsys.readouterr().err


def test_an_out_that_cannot_take_the_table_is_refused_before_any_row_is_timed(tmp_path, capsys, monkeypatch):
    """--out naming a file failed in mkdir's traceback after every row had been timed (minutes at the defaults)."""
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    monkeypatch.setattr(ratios, "measure", lambda *a, **k: pytest.fail("timed a row before checking --out"))
    with pytest.raises(SystemExit):
        ratios.main(["--d", "16", "--pairs", "8", "--losses", "cosent", "--out", str(a_file)])
    assert f"--out {a_file}: is a file, not a folder" in capsys.readouterr().err

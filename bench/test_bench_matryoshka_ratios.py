"""bench_matryoshka_ratios.py: every row of a table computes the loss it claims (the fused call, our separate
calls and sentence-transformers' agree, per group of rows), and the script writes its table."""

from __future__ import annotations

import pytest
import torch

import bench_matryoshka_ratios as ratios
import providers as P


@pytest.mark.parametrize("make", [ratios.cosine_rows, ratios.mnrl_rows], ids=["cosine", "mnrl"])
def test_rows_of_a_group_compute_the_same_loss(make):
    rows = make(16, 24, 3, torch.float64, "cpu", torch.Generator().manual_seed(0), P.sentence_transformers_losses())
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

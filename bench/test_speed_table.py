"""bench/speed_table.py against the committed GPU runs: the points it reads from their op sweeps are the points
`angle_kernels.measured` holds, so the table auto chooses by is the evidence committed beside it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import speed_table
from angle_kernels import measured

RESULTS = Path(__file__).resolve().parent / "results"
H100_RUNS = [RESULTS / "h100-80gb-hbm3-2026-11-26" / "second" / "second.json",  # Triton, torch
             RESULTS / "h100-80gb-hbm3-2026-11-26b" / "gpu" / "second.json"]  # CUDA


def test_the_measured_table_is_what_the_committed_h100_runs_measured():
    read = speed_table.points([str(path) for path in H100_RUNS])
    assert sorted(read) == [("9.0", "bfloat16"), ("9.0", "float32")]
    for (capability, dtype), rows in read.items():
        held = measured.MEASURED[(capability, getattr(torch, dtype))]
        assert sorted(held) == sorted(rows), (capability, dtype)


def test_points_need_two_backends_and_the_ranking_term_is_keyed_by_its_float32_scores(tmp_path):
    run = {"steps": {"preflight": {"environment": {"capability": "8.0"}},
                     "op_sweep": {"rows": [
                         {"op": "ranking_loss", "n": 10, "d": 1, "dtype": "bfloat16", "backend": "triton",
                          "status": "ok", "ms": 1.23456},
                         {"op": "ranking_loss", "n": 10, "d": 1, "dtype": "bfloat16", "backend": "torch",
                          "status": "ok", "ms": 2.0},
                         {"op": "pair_scores", "n": 10, "d": 8, "dtype": "bfloat16", "backend": "torch",
                          "status": "ok", "ms": 2.0},  # alone: no point
                         {"op": "pair_scores", "n": 10, "d": 8, "dtype": "bfloat16", "backend": "triton",
                          "status": "error"}]}}}
    path = tmp_path / "second.json"
    path.write_text(json.dumps(run))
    assert speed_table.points([str(path)]) == {
        ("8.0", "float32"): [("ranking_loss", "full", 10, 1, {"triton": 1.23, "torch": 2.0})]}


def test_help_and_no_arguments(capsys):
    assert speed_table.main(["--help"]) == 0 and "measured.py" in capsys.readouterr().out
    assert speed_table.main([]) == 2
    with pytest.raises(FileNotFoundError):
        speed_table.main(["/nonexistent/second.json"])

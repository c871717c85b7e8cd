"""bench/bench_first_use.py: the first-use check's cost, and its dry run on CPU (the Triton interpreter)."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("triton")

import bench_first_use  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not INTERPRETING, reason="the dry run: Triton's interpreter on CPU tensors")
def test_the_dry_run_checks_the_first_call_of_each_op_and_none_after(tmp_path):
    """Every op's first `auto` call, as on a GPU the table does not cover, is checked (a record with its seconds,
    passed) and the next call is not (one record per op); the stand-in is undone after (the table and the cache
    setting as they were)."""
    from angle_kernels import user_cache, verified

    identity, cache = verified.identity, os.environ.get(user_cache.CACHE_ENV)
    assert bench_first_use.main(["--device", "cpu", "--out", str(tmp_path), "--runs", "1"]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["op"], r["n"]) for r in rows] == [(name, n) for name, n, _ in bench_first_use.CPU_CASES]
    for row in rows:
        assert "error" not in row and "note" not in row, row
        assert len(row["checks"]) == 1 and row["checks"][0]["pass"] and row["checks"][0]["backend"] == "triton"
        assert row["check_s"] > 0 and row["first_s"] > 0 and row["warm_s"] > 0 and row["after_s"] > 0
    table = (tmp_path / "table.md").read_text()
    assert table.count("| pass") == 0 and table.count(", pass)") == len(rows)
    assert verified.identity is identity and os.environ.get(user_cache.CACHE_ENV) == cache


def test_bad_arguments_are_refused_before_any_work(tmp_path, capsys, monkeypatch):
    for argv, says in ((["--out", str(tmp_path), "--runs", "0"], "--runs must be at least 1"),
                       (["--out", str(tmp_path), "--time-budget", "-1"], "--time-budget must be a positive"),):
        with pytest.raises(SystemExit):
            bench_first_use.main(argv)
        assert says in capsys.readouterr().err
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit):
        bench_first_use.main(["--device", "cpu", "--out", str(tmp_path)])
    assert "set TRITON_INTERPRET=1" in capsys.readouterr().err

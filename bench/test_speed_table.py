"""bench/speed_table.py against the committed GPU runs: the points it reads from their op sweeps, with the code
path and the fingerprint of the code each time measured, are the points `angle_kernels.measured` holds, so the
table auto chooses by is the evidence committed beside it; and which of those times this checkout's code still
matches."""

from __future__ import annotations

import ast
import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

import speed_table
from angle_kernels import fingerprints, measured

RESULTS = Path(__file__).resolve().parent / "results"
# Each committed run with the commit its sources were at (the runs' READMEs): they did not record fingerprints.
H100_RUNS = [(RESULTS / "h100-80gb-hbm3-2026-11-26" / "second" / "second.json", "7ab8295"),  # Triton, torch
             (RESULTS / "h100-80gb-hbm3-2026-11-26b" / "gpu" / "second.json", "a0dd5ba")]  # CUDA
# The H200's op sweeps, in the order they ran, recorded their paths and fingerprints.
H200_RUNS = [RESULTS / "h200-2026-11-28" / "second-op-sweep" / "second.json",  # Triton, torch
             RESULTS / "h200-2026-12-04" / "second-ops" / "second.json",  # Triton, torch: two ops with dims
             RESULTS / "h200-2026-12-04" / "second-cuda" / "second.json",  # CUDA
             RESULTS / "h200-2026-12-04b" / "second-pair-scores" / "second.json"]  # Triton, torch: pair scores


def _has_commits(*commits: str) -> bool:
    return all(subprocess.run(["git", "-C", str(speed_table.REPO), "cat-file", "-e", f"{c}^{{commit}}"],
                              capture_output=True).returncode == 0 for c in commits)


@pytest.mark.skipif(not _has_commits(*(c for _, c in H100_RUNS)), reason="the git history of the runs' commits")
def test_the_measured_table_is_what_the_committed_runs_measured():
    """The H200's points, and the H100's where the H200 did not measure (the same compute capability)."""
    h100 = speed_table.points([(str(path), commit) for path, commit in H100_RUNS])
    h200 = speed_table.points([(str(path), None) for path in H200_RUNS])
    assert sorted(h100) == sorted(h200) == [("9.0", "bfloat16"), ("9.0", "float32")]
    for (capability, dtype), rows in h100.items():
        newer = h200[(capability, dtype)]
        measured_again = {point[:4] for point in newer}
        expected = newer + [point for point in rows if point[:4] not in measured_again]
        held = measured.MEASURED[(capability, getattr(torch, dtype))]
        assert sorted(held) == sorted(expected), (capability, dtype)


def test_the_times_of_code_changed_since_no_longer_count():
    """Two recorded times measured code changed since, so auto does not use them: of the H100's points the H200 left
    (the largest sizes), the torch similarity_xent's (the torch backend's GPU blocks) and the CUDA ranking term's
    (its rewritten scan). (The H200's first torch full-width pair scores, older than their backward's radial mask,
    were timed again: h200-2026-12-04b.) Every path the table names has times of this checkout's code.
    (The CUDA paths' sources: csrc/, present in a checkout.)"""
    recorded = {(key.partition("/")[0], op, key.partition("/")[2], fingerprint)
                for points in measured.MEASURED.values() for op, *_, times, prints in points
                for key, fingerprint in prints.items()}
    assert all(set(point[5]) == set(point[4]) for points in measured.MEASURED.values() for point in points)
    tree = fingerprints.folder_tree()
    here = {(backend, op, path): speed_table.fingerprint_at(backend, op, path, tree)
            for backend, op, path, _ in recorded}
    changed = {(backend, op, fingerprint) for backend, op, path, fingerprint in recorded
               if fingerprint != here[backend, op, path]}
    assert changed == {("torch", "similarity_xent", "30bf9959ddb60941"),
                       ("cuda", "ranking_loss", "4b85a09f9216361e+249cdc38bcd80eed")}
    current = {(backend, op, path) for backend, op, path, fingerprint in recorded
               if fingerprint == here[backend, op, path]}
    assert current == {(backend, op, path) for backend, op, path, _ in recorded}
    assert {backend for backend, *_ in current} == {"triton", "torch", "cuda"}


def _run(tmp_path, rows, name="second.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"steps": {"preflight": {"environment": {"capability": "8.0"}},
                                          "op_sweep": {"rows": rows}}}))
    return str(path)


def _row(op, n, d, backend, ms, status="ok", **recorded):
    return {"op": op, "n": n, "d": d, "dtype": "bfloat16", "backend": backend, "status": status, "ms": ms,
            **recorded}


def test_a_run_that_recorded_its_paths_and_fingerprints_needs_no_commit(tmp_path):
    """Points need two backends; the ranking term is keyed by its float32 scores; every time by the path it timed,
    with the fingerprint the sweep recorded for it."""
    path = _run(tmp_path, [
        _row("ranking_loss", 10, 1, "triton", 1.23456, path="pairwise", fingerprint="p1"),
        _row("ranking_loss", 10, 1, "torch", 2.0, path="default", fingerprint="t1"),
        _row("pair_scores", 10, 8, "torch", 2.0, path="default", fingerprint="t2"),  # alone: no point
        _row("pair_scores", 10, 8, "triton", None, status="error")])
    assert speed_table.points([(path, None)]) == {("8.0", "float32"): [
        ("ranking_loss", "full", 10, 1, {"triton/pairwise": 1.23, "torch/default": 2.0},
         {"triton/pairwise": "p1", "torch/default": "t1"})]}


def test_runs_of_one_backend_each_give_their_points_together(tmp_path, capsys):
    """A CUDA op sweep alone (one backend) gives no point, and says so with exit status 1; with the Triton and torch
    sweep of the same GPU beside it, the points hold all three, a later run's time replacing an earlier one's."""
    cuda_only = _run(tmp_path, [_row("ranking_loss", 10, 1, "cuda", 3.0, path="sort", fingerprint="c1")], "cuda.json")
    assert speed_table.main([cuda_only]) == 1
    assert "no point" in capsys.readouterr().err
    others = _run(tmp_path, [_row("ranking_loss", 10, 1, "triton", 1.0, path="pairwise", fingerprint="p1"),
                             _row("ranking_loss", 10, 1, "torch", 2.0, path="default", fingerprint="t1")], "ops.json")
    later = _run(tmp_path, [_row("ranking_loss", 10, 1, "torch", 1.5, path="default", fingerprint="t1")], "later.json")
    ((*_, times, _),) = speed_table.points([(others, None), (cuda_only, None), (later, None)])[("8.0", "float32")]
    assert times == {"triton/pairwise": 1.0, "torch/default": 1.5, "cuda/sort": 3.0}
    assert speed_table.main([others, cuda_only]) == 0 and "cuda/sort" in capsys.readouterr().out


def test_a_run_without_fingerprints_needs_the_commit_it_measured(tmp_path):
    path = _run(tmp_path, [_row("ranking_loss", 10, 1, "triton", 1.0), _row("ranking_loss", 10, 1, "torch", 2.0)])
    with pytest.raises(ValueError, match="--commit"):
        speed_table.points([(path, None)])
    with pytest.raises(ValueError, match="not a commit"):
        speed_table.points([(path, "0" * 40)])


def test_the_path_of_a_row_that_did_not_record_it():
    """The Triton ranking term: pairwise up to the tree's SMALL_N_MAX, sort above it (so a sort-path call is never
    decided by a pairwise time); forced schemes, one-path backends and dims by their label or variant."""
    tree = fingerprints.Tree(lambda relative: "SMALL_N_MAX = 4096\n" if relative.endswith("ranking_loss.py") else None,
                             "a tree")
    assert speed_table.derived_path("triton", "ranking_loss", "full", 4096, tree) == "pairwise"
    assert speed_table.derived_path("triton", "ranking_loss", "full", 4097, tree) == "sort"
    assert speed_table.derived_path("triton-dense", "similarity_xent", "full", 9, tree) == "dense"
    assert speed_table.derived_path("triton", "similarity_xent", "dims", 9, tree) == "dims"
    assert speed_table.derived_path("triton", "pair_scores", "full", 9, tree) == "full"
    assert speed_table.derived_path("cuda", "ranking_loss", "full", 9, tree) == "sort"
    assert speed_table.derived_path("torch", "similarity_xent", "margin", 9, tree) == "default"
    with pytest.raises(ValueError, match="must record"):  # which scheme ran is not in the row
        speed_table.derived_path("triton", "similarity_xent", "full", 9, tree)


def test_the_printed_points_are_the_literals_within_120_columns():
    for points in measured.MEASURED.values():
        for point in points:
            text = speed_table.point_text(point)
            assert ast.literal_eval(text.strip().rstrip(",")) == point
            assert max(map(len, text.splitlines())) <= 120


def _triton_path_taken(op: str, variant: str, size: int, width: int, listed: str) -> str:
    """The Triton path a call at this point takes, as the backend's own selectors choose it with this checkout's
    switches (the similarity ops at the sweep's shapes: 2N x 2N logits at full width and with a margin, N x 2N with
    dims and for similarity_lse; five prefixes, for the pair scores too; the ranking term's path as the decision
    lists it)."""
    if op == "ranking_loss":
        return listed
    pytest.importorskip("triton")
    from angle_kernels.triton_ops import pair_scores_paths, similarity_lse_paths, similarity_xent_paths

    dims = tuple(width // 2**i for i in (4, 3, 2, 1, 0)) if variant == "dims" else None
    if op == "pair_scores":
        return pair_scores_paths.code_path(torch.empty(1, 2, width, device="meta"), True, dims)
    square = op == "similarity_xent" and variant in ("full", "margin")
    q = torch.empty(2, width, device="meta")
    c = torch.empty(math.isqrt(size if square else 2 * size), width, device="meta")
    if op == "similarity_xent":
        return similarity_xent_paths.code_path(q, c, 20.0, "partner", dims=dims)
    return similarity_lse_paths.code_path(q, c, 20.0, dims=dims)


def test_the_decisions_the_table_makes_against_the_fixed_order(capsys):
    """What measured.py's docstring says the table is worth: with this checkout's code, against the Triton paths calls
    take, CUDA (where verified) for the full-width pair scores at every timed size (16,384 to 1M pairs, D = 768 and
    4,096: over Triton's kernel, since both were timed with this code), for the pair scores with dims at 262,144
    pairs, D = 768 (over the prefix kernels), for similarity_lse with dims from 4,096 x 8,192 logits at D = 4,096
    and at 16,384 x 32,768 (over the dense dims scheme) and for the ranking term at 65,536 and 1M scores (over
    Triton's sort path); torch for Matryoshka in-batch negatives at D = 4,096 and 1,024 x 2,048 logits (its 16-bit
    products, over the dense dims scheme) and, without CUDA, for the ranking term at 65,536 scores. Where the fixed
    order puts CUDA first (before torch: its pair scores and ranking term, outside measured.AFTER_TORCH), no time of
    this checkout's code prefers another backend; the one such decision listed is the H100's time of the CUDA
    ranking term's old code."""
    found = speed_table.decisions()
    today = {(d["op"], d["size"], d["fixed_order"], d["table"]) for d in found if d["matches_this_code"]
             and d["fixed_order"].startswith("triton/") and d["fixed_order"].partition("/")[2] == _triton_path_taken(
                 d["op"], d["variant"], d["size"], d["width"], d["fixed_order"].partition("/")[2])}
    assert today == {("pair_scores", 16384, "triton/full", "cuda/full"),
                     ("pair_scores", 262144, "triton/full", "cuda/full"),
                     ("pair_scores", 1048576, "triton/full", "cuda/full"),
                     ("pair_scores", 262144, "triton/dims", "cuda/dims"),
                     ("similarity_lse", 33554432, "triton/dense_dims", "cuda/dense_dims"),
                     ("similarity_lse", 536870912, "triton/dense_dims", "cuda/dense_dims"),
                     ("similarity_xent", 2097152, "triton/dense_dims", "torch/mixed"),
                     ("ranking_loss", 65536, "triton/sort", "torch/default"),
                     ("ranking_loss", 65536, "triton/sort", "cuda/sort"),
                     ("ranking_loss", 1048576, "triton/sort", "cuda/sort")}
    assert [(d["op"], d["size"], d["matches_this_code"]) for d in found if d["fixed_order"].startswith("cuda/")] == [
        ("ranking_loss", 4194304, False)]
    assert max(d["saves_ms"] for d in found if (d["op"], d["size"], d["fixed_order"], d["table"]) in today) < 17
    assert speed_table.main(["--decisions"]) == 0
    assert "torch/default rather than triton/sort" in capsys.readouterr().out


def test_decisions_follow_the_order_auto_follows(monkeypatch):
    """A CUDA path measured faster than torch where the fixed order puts torch first (measured.AFTER_TORCH): auto
    (measured.fastest) takes it over its fixed order, torch, and --decisions lists that; the reverse is no decision.
    Each against measured.fastest on the same point."""
    from angle_kernels import contract

    monkeypatch.setattr(measured, "AFTER_TORCH", {("cuda", "ranking_loss")})

    def here(backend, op, path):
        return "same"

    def table(cuda_ms):
        point = ("ranking_loss", "full", 4096, 1, {"torch/default": 1.0, "cuda/sort": cuda_ms},
                 {"torch/default": "same", "cuda/sort": "same"})
        return {("9.0", torch.float32): (point,)}

    faster = speed_table.decisions(table(0.5), here=here)
    assert [(d["fixed_order"], d["table"]) for d in faster] == [("torch/default", "cuda/sort")]
    assert faster[0]["saves_ms"] == 0.5 and faster[0]["matches_this_code"] is True
    # torch's time measured on code that has changed since (a fingerprint alike in its first 12 characters only)
    old_point = ("ranking_loss", "full", 4096, 1, {"torch/default": 1.0, "cuda/sort": 0.5},
                 {"torch/default": "abcdefabcdef-OLD", "cuda/sort": "same"})
    stale = speed_table.decisions({("9.0", torch.float32): (old_point,)},
                                  here=lambda backend, op, path: "same" if backend == "cuda" else "abcdefabcdef-NEW")
    assert [(d["saves_ms"], d["matches_this_code"]) for d in stale] == [(0.5, False)]
    assert speed_table.decisions(table(2.0), here=here) == []

    class Backend:
        def __init__(self, name):
            self.name = name

    cuda, torch_backend = Backend("cuda"), Backend("torch")
    scores = torch.zeros(4096)
    call = contract.check_ranking_loss(scores, scores)
    for cuda_ms, expected in ((0.5, cuda), (2.0, torch_backend)):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(measured, "MEASURED", table(cuda_ms))
            patch.setattr(measured, "code_fingerprint", lambda *args: "same")
            patch.setattr(measured, "capability", lambda device: "9.0")  # the point's GPU, for these CPU tensors
            chosen = measured.fastest("ranking_loss", call, {cuda: "sort", torch_backend: "default"})
        assert chosen is expected


def test_help_and_no_arguments(capsys):
    assert speed_table.main(["--help"]) == 0 and "measured.py" in capsys.readouterr().out
    assert speed_table.main([]) == 2
    assert speed_table.main(["--commit"]) == 2


def test_a_run_file_that_is_missing_or_no_stage_record_and_an_unknown_option_are_refused(tmp_path, capsys):
    """Each was a traceback (FileNotFoundError, JSONDecodeError, KeyError: 'steps'; an option taken for a file)."""
    not_json, other_json = tmp_path / "table.md", tmp_path / "results.json"
    not_json.write_text("| N |\n")
    other_json.write_text('{"results": []}')
    for argv, said in ((["/nonexistent/second.json"], "No such file"), ([str(not_json)], "table.md: not JSON"),
                       ([str(other_json)], "results.json: not a stage record of bench/gpu_suite.py"),
                       (["--decision"], "--decision: unknown option")):
        assert speed_table.main(argv) == 2
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err



def test_a_time_recorded_without_a_fingerprint_never_matches_this_code(monkeypatch):
    """A fingerprint the run's tree could not compute (None) says nothing of the code timed: the decision it backs
    must not read as matching this checkout, even where this checkout lacks that path's code too."""
    monkeypatch.setattr(measured, "AFTER_TORCH", {("cuda", "ranking_loss")})  # torch first: cuda's time decides
    point = ("ranking_loss", "full", 4096, 1, {"torch/default": 1.0, "cuda/sort": 0.5},
             {"torch/default": None, "cuda/sort": None})
    found = speed_table.decisions({("9.0", torch.float32): (point,)}, here=lambda backend, op, path: None)
    assert [d["matches_this_code"] for d in found] == [False]


@pytest.mark.skipif(not _has_commits("HEAD"), reason="a git checkout")
def test_the_commit_given_on_the_command_line_applies_to_the_runs_after_it(tmp_path, capsys):
    """`--commit COMMIT RUN.json`: the run's rows recorded no fingerprints, which are computed at that commit."""
    path = _run(tmp_path, [_row("ranking_loss", 10, 1, "triton", 1.0), _row("ranking_loss", 10, 1, "torch", 2.0)])
    assert speed_table.main(["--commit", "HEAD", path]) == 0
    assert '"triton/pairwise": 1.0, "torch/default": 2.0' in capsys.readouterr().out


def test_decisions_with_other_arguments_is_refused_as_such(capsys):
    """`--decisions --commit X` was refused as "--decisions: unknown option", in a list of options naming it."""
    assert speed_table.main(["--decisions", "--commit", "abc1234"]) == 2
    err = capsys.readouterr().err
    assert "--decisions takes no other argument" in err and "unknown option" not in err

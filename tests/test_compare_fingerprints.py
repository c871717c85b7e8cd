"""scripts/compare_fingerprints.py, which says which GPU verifications still hold (docs/verification-history.md):
an entry is confirmed only by the whole fingerprints it recorded, and counts as verified today only when its code,
and for the CUDA backend its CUDA sources and build flags, are unchanged since. Needs the repository's git history
(the entries are read against a commit's files)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

from angle_kernels import fingerprints

ROOT = Path(__file__).resolve().parents[1]


def _head() -> str | None:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


HEAD = _head()
pytestmark = pytest.mark.skipif(HEAD is None, reason="reads a commit's files: needs the repository's git history")


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("compare_fingerprints", ROOT / "scripts" / "compare_fingerprints.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# a Triton path, a CUDA path, and a CUDA path with CUDA sources of its own (fingerprints.CSRC_SOURCES), each with the
# fingerprints a run at HEAD would have recorded (filled in below)
KEYS = (("triton", "pair_scores", "full"), ("cuda", "pair_scores", "full"), ("cuda", "similarity_xent", "dense"))


def _entries(tree) -> list[dict]:
    entries = []
    for backend, op, path in KEYS:
        entry = {"backend": backend, "op": op, "path": path,
                 "fingerprint": fingerprints.path_closure(backend, op, path, tree=tree).fingerprint}
        if backend == "cuda":
            entry["build"] = fingerprints.csrc_fingerprint(fingerprints.csrc_source(op, path), tree)
        entries.append(entry)
    return entries


def _run(script, monkeypatch, tmp_path, entries) -> list[dict]:
    """compare() over one run at HEAD holding `entries`."""
    (tmp_path / "verified.json").write_text(json.dumps({"passed": entries}))
    monkeypatch.setattr(script, "RUNS", ((str(tmp_path), "verified.json", HEAD),))
    return script.compare()


def test_an_entry_recorded_at_a_commit_is_confirmed_and_verified_where_its_code_is_unchanged(script, monkeypatch,
                                                                                              tmp_path):
    entries = _entries(script.git_tree(HEAD))
    rows = _run(script, monkeypatch, tmp_path, entries)
    assert [(r["backend"], r["op"], r["confirmed"]) for r in rows] == [
        ("triton", "pair_scores", True), ("cuda", "pair_scores", True), ("cuda", "similarity_xent", True)]
    for row in rows:  # this checkout may hold changes: verified today exactly where nothing differs
        unchanged = row["then"] == row["now"] and row.get("build_then") == row.get("build_now")
        assert row["equal"] == unchanged and (row["differs"] == []) == unchanged, row
    assert rows[1]["build_then"] == entries[1]["build"]
    # the dense scheme's build is csrc/similarity_xent_dense.*, not the op's csrc/similarity_xent.*
    assert rows[2]["build_then"] == entries[2]["build"] != fingerprints.csrc_fingerprint("similarity_xent")
    table = script.render(rows)
    assert table.count("| yes |") >= 3 and f"| {HEAD} |" in table


def test_a_changed_cuda_build_is_not_verified_today(script, monkeypatch, tmp_path):
    """The CUDA sources or build flags changed since the run (their fingerprint here differs), the path's Python
    code did not: the entry is confirmed, but not verified today."""
    entries = _entries(script.git_tree(HEAD))
    here = fingerprints.folder_tree(ROOT)
    monkeypatch.setattr(fingerprints, "folder_tree", lambda root=ROOT: here)
    real = fingerprints.csrc_fingerprint
    monkeypatch.setattr(fingerprints, "csrc_fingerprint",
                        lambda op, tree=None: real(op, tree)[::-1] if tree is here else real(op, tree))
    cuda = _run(script, monkeypatch, tmp_path, entries)[1]
    assert cuda["confirmed"] and cuda["build_then"] != cuda["build_now"] and not cuda["equal"]
    assert "| no |" in script.render([cuda])


def test_changed_python_code_is_not_verified_today_and_its_definition_is_named(script, monkeypatch, tmp_path):
    """The Triton path's Python code changed since the run (a constant of launch_config, which it executes): the
    entry is still confirmed by the commit it ran, but its fingerprint then and now differ, it is not verified
    today, and the table names the edited definition."""
    entries = _entries(script.git_tree(HEAD))
    checkout = fingerprints.folder_tree(ROOT)
    edited = "angle_kernels/triton_ops/pair_scores.py"

    def read(relative):
        text = checkout.read(relative)
        if relative == edited:
            assert "block = max(block, 16)" in text
            text = text.replace("block = max(block, 16)", "block = max(block, 32)")
        return text

    here = fingerprints.Tree(read, "this checkout, launch_config edited")
    monkeypatch.setattr(fingerprints, "folder_tree", lambda root=ROOT: here)
    triton = _run(script, monkeypatch, tmp_path, entries)[0]
    assert triton["backend"] == "triton" and triton["confirmed"]
    assert triton["then"] == entries[0]["fingerprint"] != triton["now"] and not triton["equal"]
    assert "launch_config" in triton["differs"]
    assert "`launch_config`" in script.render([triton])


def test_an_entry_of_the_whole_file_rule_is_confirmed_by_its_cuda_build_too(script, monkeypatch, tmp_path):
    """Entries of the runs before the path fingerprints (a whole-file "source" fingerprint, no "fingerprint"
    field) are confirmed by the fingerprints the commit's own rule computes: for the CUDA backend its source and
    its csrc build, so a recorded build the commit's files do not give is not confirmed."""
    monkeypatch.setattr(script, "old_rule", lambda commit, pairs: {
        **{f"{backend}/{op}": f"source of {backend}/{op}" for backend, op in pairs}, "csrc": "the csrc build"})
    old = {"backend": "cuda", "op": "pair_scores", "path": "full", "source": "source of cuda/pair_scores"}
    rows = _run(script, monkeypatch, tmp_path, [{**old, "build": "the csrc build"}, {**old, "build": "another"}])
    assert [r["confirmed"] for r in rows] == [True, False]


@pytest.mark.parametrize("field", ["fingerprint", "build"])
def test_a_recorded_fingerprint_is_compared_whole(script, monkeypatch, tmp_path, capsys, field):
    """A recorded fingerprint alike in its first characters only (another commit's code) is not confirmed, and the
    script exits 1: the run did not check this code."""
    entries = _entries(script.git_tree(HEAD))
    cuda = entries[1]
    cuda[field] = cuda[field][:12] + ("0000" if cuda[field][12:] != "0000" else "1111")
    rows = _run(script, monkeypatch, tmp_path, entries)
    assert [r["confirmed"] for r in rows] == [True, False, True] and not rows[1]["equal"]
    assert script.main([]) == 1
    assert "| NO |" in capsys.readouterr().out

"""angle_kernels.verified: the match rule, the user's cache, the fingerprints, and the project's table.

Identities are made up here (there is no GPU); dispatch's use of the answers is tests/test_backend_choice.py's
subject, the checks that produce them tests/ops/test_verify.py's.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from angle_kernels import verified
from angle_kernels.cuda_ops import _extension

TRITON_ID = {"capability": "9.0", "torch": "2.11", "triton": "3.6", "source": "0123456789abcdef", "gpu": "H100"}
CUDA_ID = {"capability": "9.0", "torch": "2.11", "cuda": "13.0", "build": "fedcba9876543210",
           "source": "00112233aabbccdd", "gpu": "H100"}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh user cache directory, and a process that has read and decided nothing yet."""
    monkeypatch.setenv(verified.CACHE_ENV, str(tmp_path / "cache"))
    verified.forget()
    yield tmp_path / "cache" / verified.CACHE_FILE
    verified.forget()


@pytest.mark.parametrize("backend, ident", [("triton", TRITON_ID), ("cuda", CUDA_ID)])
def test_an_entry_covers_exactly_its_path_on_the_same_identity(backend, ident):
    made = verified.entry(backend, "similarity_xent", "dims", ident, "test", ["bfloat16"])
    assert verified.covers(made, backend, "similarity_xent", "dims", ident)
    assert not verified.covers(made, backend, "similarity_xent", "fused", ident)  # another path
    assert not verified.covers(made, backend, "pair_scores", "dims", ident)
    other = "cuda" if backend == "triton" else "triton"
    assert not verified.covers(made, other, "similarity_xent", "dims", {**TRITON_ID, **CUDA_ID})
    for field in verified.MATCH_FIELDS[backend]:  # every field of the rule matters ...
        assert not verified.covers(made, backend, "similarity_xent", "dims", {**ident, field: "other"}), field
        assert not verified.covers(made, backend, "similarity_xent", "dims", {**ident, field: None}), field
    # ... and nothing else does (the GPU's name is informative: the capability is what is matched)
    assert verified.covers(made, backend, "similarity_xent", "dims", {**ident, "gpu": "H200"})


def test_an_extension_built_without_its_fingerprint_matches_nothing():
    made = verified.entry("cuda", "ranking_loss", "sort", CUDA_ID, "test")
    assert not verified.covers(made, "cuda", "ranking_loss", "sort", {**CUDA_ID, "build": None})


def test_the_cache_records_passes_and_revokes_failures(cache):
    fused = verified.entry("triton", "similarity_xent", "fused", TRITON_ID, "run 1")
    dims = verified.entry("triton", "similarity_xent", "dims", TRITON_ID, "run 1")
    verified.write_cache([fused, dims], [])
    assert verified.read_cache() == [fused, dims]
    # a second run on the same GPU and software: dims fails now, fused passes again (replaced, not doubled)
    again = {**fused, "evidence": "run 2"}
    on_h200 = verified.entry("triton", "similarity_xent", "dims", {**TRITON_ID, "capability": "9.0", "gpu": "H200",
                                                                    "triton": "3.7"}, "run 3")
    verified.write_cache([again, on_h200], [dims])
    assert verified.read_cache() == [again, on_h200]
    data = json.loads(cache.read_text())
    assert data["format"] == verified.CACHE_FORMAT
    assert not list(cache.parent.glob(".verified-*"))  # the temporary file of the atomic write is gone


def test_a_broken_cache_is_ignored_with_a_warning(cache):
    cache.parent.mkdir(parents=True)
    cache.write_text("{not json")
    with pytest.warns(RuntimeWarning, match="ignoring the verification cache"):
        assert verified.read_cache() == []
    cache.write_text(json.dumps({"format": 99, "entries": []}))
    with pytest.warns(RuntimeWarning, match="not format 1"):
        assert verified.read_cache() == []


def test_is_verified_reads_the_table_and_the_cache(cache, monkeypatch):
    device = torch.device("cuda", 0)
    monkeypatch.setattr(verified, "identity", lambda backend, op, dev: TRITON_ID if backend == "triton" else CUDA_ID)
    monkeypatch.setattr(verified, "VERIFIED", (verified.entry("triton", "pair_scores", "full", TRITON_ID, "table"),))
    verified.write_cache([verified.entry("cuda", "ranking_loss", "sort", CUDA_ID, "cache")], [])
    verified.forget()
    assert verified.is_verified("triton", "pair_scores", "full", device)  # from the table
    assert verified.is_verified("cuda", "ranking_loss", "sort", device)  # from the user's cache
    assert not verified.is_verified("triton", "pair_scores", "dims", device)
    assert not verified.is_verified("cuda", "pair_scores", "full", device)


def test_the_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(verified.CACHE_ENV, str(tmp_path / "mine"))
    assert verified.cache_dir() == tmp_path / "mine"
    monkeypatch.delenv(verified.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert verified.cache_dir() == tmp_path / "xdg" / "angle_kernels"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert verified.cache_dir() == tmp_path / "home" / ".cache" / "angle_kernels"


def test_a_source_fingerprint_covers_the_op_module_and_what_it_imports_from_its_backend(tmp_path, monkeypatch):
    names = {path.name for path in verified._backend_modules("triton", "similarity_lse")}
    assert names == {"similarity_lse.py", "_similarity_tiles.py", "_common.py", "_runtime.py"}
    names = {path.name for path in verified._backend_modules("triton", "similarity_xent")}
    assert {"similarity_xent_dense.py", "normalisation.py", "formed_gradients.py"} <= names  # the dense scheme's
    assert {path.name for path in verified._backend_modules("triton", "pair_scores")} == {"pair_scores.py",
                                                                                          "_common.py"}
    assert {path.name for path in verified._backend_modules("cuda", "ranking_loss")} == {"ranking_loss.py",
                                                                                         "_library.py"}
    copy = tmp_path / "angle_kernels"
    shutil.copytree(verified._PACKAGE_DIR / "triton_ops", copy / "triton_ops")
    monkeypatch.setattr(verified, "_PACKAGE_DIR", copy)
    before = {op: verified.source_fingerprint("triton", op) for op in ("pair_scores", "similarity_lse")}
    helper = copy / "triton_ops" / "_similarity_tiles.py"
    helper.write_text(helper.read_text() + "\n# an edit\n")
    after = {op: verified.source_fingerprint("triton", op) for op in ("pair_scores", "similarity_lse")}
    assert after["pair_scores"] == before["pair_scores"]  # not among its modules
    assert after["similarity_lse"] != before["similarity_lse"]  # the tile library it imports


def test_the_extensions_fingerprint_changes_with_any_csrc_file(tmp_path):
    copy = tmp_path / "csrc"
    shutil.copytree(_extension.CSRC_DIR, copy)
    before = _extension.csrc_fingerprint(copy)
    assert before == _extension.csrc_fingerprint()
    header = copy / "common.cuh"
    header.write_text(header.read_text() + "\n")
    assert _extension.csrc_fingerprint(copy) != before
    assert f"-D{_extension.HASH_MACRO}=0x{before}ULL" in _extension.cxx_flags()


def test_the_projects_table_matches_this_checkout():
    """Every entry of verified.VERIFIED names a GPU backend, an op and a path it declares, every field of the rule,
    and the source fingerprint of this checkout: an edit to a verified kernel voids its entry, and this test says
    which entries to re-verify on a GPU (scripts/gpu_check.sh first) or remove."""
    for made in verified.VERIFIED:
        assert made["backend"] in verified.GPU_BACKENDS
        assert made["path"] in verified.paths_of(made["backend"])[made["op"]], made
        assert all(made.get(field) for field in verified.MATCH_FIELDS[made["backend"]]), made
        assert made.get("evidence"), made
    stale = verified.stale_entries()
    assert not stale, ("these verifications no longer match the code (re-verify on a GPU or remove them): "
                       + ", ".join(f"{e['backend']} {e['op']} {e['path']}" for e in stale))


def test_stale_entries_are_reported():
    made = verified.entry("triton", "pair_scores", "full", {**TRITON_ID, "source": "0" * 16}, "old run")
    assert verified.stale_entries([made]) == [made]
    current = {**made, "source": verified.source_fingerprint("triton", "pair_scores")}
    assert verified.stale_entries([current]) == []
    # cuda: its op module and the csrc/ sources the extension is built from
    from angle_kernels.cuda_ops import _extension

    cuda_current = verified.entry("cuda", "pair_scores", "full", {
        **CUDA_ID, "source": verified.source_fingerprint("cuda", "pair_scores"),
        "build": _extension.csrc_fingerprint()}, "run")
    assert verified.stale_entries([cuda_current]) == []
    old_build = {**cuda_current, "build": "0" * 16}
    assert verified.stale_entries([old_build]) == [old_build]


def test_a_process_that_cannot_tell_its_identity_has_nothing_verified(cache, monkeypatch):
    def broken(backend, op, device):
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(verified, "identity", broken)
    monkeypatch.setattr(verified, "VERIFIED", (verified.entry("triton", "pair_scores", "full", TRITON_ID, "table"),))
    assert not verified.is_verified("triton", "pair_scores", "full", torch.device("cuda", 0))
    assert "identity is unknown" in verified.describe("triton", "pair_scores", torch.device("cuda", 0))

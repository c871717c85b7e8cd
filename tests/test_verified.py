"""angle_kernels.verified: the match rule, the user's verifications, the project's table and its fingerprints.

Identities are made up here (there is no GPU); dispatch's use of the answers is tests/test_backend_choice.py's
subject, the checks that produce them tests/ops/test_verify.py's, the first-use checks tests/ops/test_first_use.py's,
the cache file itself tests/test_user_cache.py's, and what a fingerprint covers tests/test_fingerprints.py's.
"""

from __future__ import annotations

import pytest
import torch

from angle_kernels import fingerprints, user_cache, verified
from angle_kernels.cuda_ops import _extension

TRITON_ID = {"capability": "9.0", "torch": "2.11", "triton": "3.6", "fingerprint": "0123456789abcdef",
             "gpu": "H100"}
CUDA_ID = {"capability": "9.0", "torch": "2.11", "cuda": "13.0", "fingerprint": "00112233aabbccdd",
           "build": "fedcba9876543210", "gpu": "H100"}
TORCH_ID = {"capability": "9.0", "torch": "2.11", "fingerprint": "0f1e2d3c4b5a6978", "gpu": "H100"}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh user cache directory, and a process that has read and decided nothing yet."""
    monkeypatch.setenv(user_cache.CACHE_ENV, str(tmp_path / "cache"))
    verified.forget()
    yield tmp_path / "cache" / user_cache.CACHE_FILE
    verified.forget()


@pytest.mark.parametrize("backend, ident", [("triton", TRITON_ID), ("cuda", CUDA_ID), ("torch", TORCH_ID)])
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


def test_the_code_fields_are_the_fingerprints_and_every_other_field_says_where():
    for backend, fields in verified.MATCH_FIELDS.items():
        assert set(verified.CODE_FIELDS[backend]) <= set(fields)
        assert "fingerprint" in verified.CODE_FIELDS[backend] and "capability" not in verified.CODE_FIELDS[backend]
    assert verified.CODE_FIELDS["cuda"] == ("fingerprint", "build")


def test_the_torch_backends_default_path_needs_no_verification(cache, monkeypatch):
    """The torch backend's default path (float32/float64 products, verified by the CPU suite) is verified anywhere,
    whatever the table, the cache and the identity say; its GPU path ("mixed") only by an entry, as any GPU
    backend's path; its identity is the GPU's, torch's and the path's fingerprint, no compiler."""
    device = torch.device("cuda", 0)
    monkeypatch.setattr(verified, "identity", lambda backend, op, path, dev: TORCH_ID)
    monkeypatch.setattr(verified, "VERIFIED", ())
    assert not verified.needs_verification("torch", "default") and verified.needs_verification("torch", "mixed")
    assert verified.needs_verification("triton", "default")  # no other backend has a path allowed everywhere
    assert verified.is_verified("torch", "similarity_xent", "default", device)
    assert verified.is_verified("torch", "pair_scores", "default", device)
    assert not verified.is_verified("torch", "similarity_xent", "mixed", device)
    verified.write_cache([verified.entry("torch", "similarity_xent", "mixed", TORCH_ID, "verify")], [])
    verified.forget()
    assert verified.is_verified("torch", "similarity_xent", "mixed", device)
    assert verified.paths_of("torch") == {"pair_scores": ("default",), "ranking_loss": ("default",),
                                          "similarity_xent": ("default", "mixed"), "similarity_lse": ("default",)}
    assert set(verified.MATCH_FIELDS["torch"]) == {"capability", "torch", "fingerprint"}


def test_an_extension_built_without_its_fingerprint_matches_nothing():
    made = verified.entry("cuda", "ranking_loss", "sort", CUDA_ID, "test")
    assert not verified.covers(made, "cuda", "ranking_loss", "sort", {**CUDA_ID, "build": None})
    assert not verified.same_code(made, "cuda", "ranking_loss", "sort", {**CUDA_ID, "build": None})


def test_the_cache_records_passes_and_revokes_failures(cache):
    fused = verified.entry("triton", "similarity_xent", "fused", TRITON_ID, "run 1")
    dims = verified.entry("triton", "similarity_xent", "dims", TRITON_ID, "run 1")
    verified.write_cache([fused, dims], [])
    assert verified.read_cache() == [fused, dims]
    # a second run on the same GPU and software: dims fails now, fused passes again (replaced, not doubled)
    again = {**fused, "evidence": "run 2"}
    on_h200 = verified.entry("triton", "similarity_xent", "dims", {**TRITON_ID, "gpu": "H200", "triton": "3.7"},
                             "run 3")
    verified.write_cache([again, on_h200], [dims])
    assert verified.read_cache() == [again, on_h200]
    assert user_cache.read()["checks"] == []  # the other section untouched


def test_is_verified_reads_the_table_and_the_cache(cache, monkeypatch):
    device = torch.device("cuda", 0)
    monkeypatch.setattr(verified, "identity",
                        lambda backend, op, path, dev: TRITON_ID if backend == "triton" else CUDA_ID)
    monkeypatch.setattr(verified, "VERIFIED", (verified.entry("triton", "pair_scores", "full", TRITON_ID, "table"),))
    verified.write_cache([verified.entry("cuda", "ranking_loss", "sort", CUDA_ID, "cache")], [])
    verified.forget()
    assert verified.is_verified("triton", "pair_scores", "full", device)  # from the table
    assert verified.is_verified("cuda", "ranking_loss", "sort", device)  # from the user's cache
    assert not verified.is_verified("triton", "pair_scores", "dims", device)
    assert not verified.is_verified("cuda", "pair_scores", "full", device)


def test_a_path_checked_at_large_size_elsewhere_may_be_checked_here(cache, monkeypatch):
    """checked_elsewhere: the table's large-size entry for the same code (CODE_FIELDS) on any GPU and versions; not
    an entry of another path or code, and not one checked only at the standard sizes."""
    device = torch.device("cuda", 0)
    here = {**TRITON_ID, "capability": "10.0", "torch": "2.13", "triton": "3.9"}  # nothing in the table matches
    monkeypatch.setattr(verified, "identity", lambda backend, op, path, dev: here)
    large = verified.entry("triton", "similarity_xent", "fused", TRITON_ID, "table", sizes="large")
    standard = verified.entry("triton", "similarity_xent", "dims", TRITON_ID, "table")
    other_code = verified.entry("triton", "pair_scores", "full", {**TRITON_ID, "fingerprint": "f" * 16}, "table",
                                sizes="large")
    monkeypatch.setattr(verified, "VERIFIED", (large, standard, other_code))
    assert not verified.is_verified("triton", "similarity_xent", "fused", device)
    assert verified.checked_elsewhere("triton", "similarity_xent", "fused", device)
    assert not verified.checked_elsewhere("triton", "similarity_xent", "dims", device)  # standard sizes only
    assert not verified.checked_elsewhere("triton", "pair_scores", "full", device)  # other code
    assert not verified.checked_elsewhere("triton", "similarity_xent", "dense", device)  # never checked
    # the user's own standard-size verifications never make a path checkable elsewhere
    verified.write_cache([verified.entry("triton", "pair_scores", "dims", TRITON_ID, "verify", sizes="large")], [])
    verified.forget()
    assert not verified.checked_elsewhere("triton", "pair_scores", "dims", device)


def test_the_identity_of_a_path_is_its_fingerprint_and_the_loaded_build(monkeypatch):
    assert verified.code_identity("triton", "similarity_xent", "dense") == {
        "fingerprint": fingerprints.path_fingerprint("triton", "similarity_xent", "dense")}
    monkeypatch.setattr(_extension, "build_fingerprints", lambda: {"ranking_loss": "ab" * 8})
    assert verified.code_identity("cuda", "ranking_loss", "sort") == {
        "fingerprint": fingerprints.path_fingerprint("cuda", "ranking_loss", "sort"), "build": "ab" * 8}
    monkeypatch.setattr(_extension, "build_fingerprints", lambda: None)  # no extension loaded
    assert verified.code_identity("cuda", "ranking_loss", "sort")["build"] is None


def test_a_cuda_path_with_sources_of_its_own_is_identified_by_their_build(monkeypatch):
    """The CUDA similarity_xent's dense scheme runs csrc/similarity_xent_dense.* (fingerprints.CSRC_SOURCES): its
    identity is the build of those sources, its fused path's the build of the op's."""
    monkeypatch.setattr(_extension, "build_fingerprints", lambda: {"similarity_xent": "ab" * 8,
                                                                   "similarity_xent_dense": "cd" * 8})
    assert verified.code_identity("cuda", "similarity_xent", "dense")["build"] == "cd" * 8
    assert verified.code_identity("cuda", "similarity_xent", "fused")["build"] == "ab" * 8


def test_the_projects_table_matches_this_checkout():
    """Every entry of verified.VERIFIED names a GPU backend, an op and a path it declares, every field of the rule,
    its evidence, the large sizes, and this checkout's code fields: an edit to the code a verified path runs voids
    its entry, and this test says which entries to re-verify on a GPU (scripts/gpu_check.sh first) or remove."""
    for made in verified.VERIFIED:
        assert made["backend"] in verified.GPU_BACKENDS
        assert made["path"] in verified.paths_of(made["backend"])[made["op"]], made
        assert all(made.get(field) for field in verified.MATCH_FIELDS[made["backend"]]), made
        assert made.get("evidence") and made.get("sizes") == "large", made
    stale = verified.stale_entries()
    assert not stale, ("these verifications no longer match the code (re-verify on a GPU or remove them): "
                       + ", ".join(f"{e['backend']} {e['op']} {e['path']}" for e in stale))


def test_stale_entries_are_reported():
    current = verified.entry("triton", "pair_scores", "full", {
        **TRITON_ID, "fingerprint": fingerprints.path_fingerprint("triton", "pair_scores", "full")}, "run")
    old = {**current, "fingerprint": "0" * 16}
    assert verified.stale_entries([old, current]) == [old]
    # cuda: the path's Python code and the op's CUDA sources
    cuda_current = verified.entry("cuda", "pair_scores", "full", {
        **CUDA_ID, "fingerprint": fingerprints.path_fingerprint("cuda", "pair_scores", "full"),
        "build": fingerprints.csrc_fingerprint("pair_scores")}, "run")
    assert verified.stale_entries([cuda_current]) == []
    old_build = {**cuda_current, "build": "0" * 16}
    assert verified.stale_entries([old_build]) == [old_build]


def test_an_installation_without_csrc_judges_cuda_entries_by_their_python_code(monkeypatch):
    """An installed package has no csrc/ to fingerprint: a CUDA entry is stale only when its path's Python code
    changed (the loaded extension reports the build a match compares)."""
    def no_csrc(name):
        raise FileNotFoundError(f"csrc/{name}.cu")

    monkeypatch.setattr(fingerprints, "csrc_fingerprint", no_csrc)
    current = verified.entry("cuda", "pair_scores", "full", {
        **CUDA_ID, "fingerprint": fingerprints.path_fingerprint("cuda", "pair_scores", "full")}, "run")
    old = {**current, "fingerprint": "0" * 16}
    assert verified.stale_entries([current, old]) == [old]


def test_a_warning_names_the_gpu_and_each_version_a_verification_must_match(cache, monkeypatch):
    """describe, the identity a warning shows: the GPU with its sm_ number, then torch's and the backend's versions
    and the path's fingerprint."""
    monkeypatch.setattr(verified, "identity", lambda backend, op, path, dev: TRITON_ID)
    assert verified.describe("triton", "pair_scores", "full", torch.device("cuda", 0)) == \
        "H100 (sm_90), torch 2.11, triton 3.6, fingerprint 0123456789abcdef"


def test_a_process_that_cannot_tell_its_identity_has_nothing_verified(cache, monkeypatch):
    def broken(backend, op, path, device):
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(verified, "identity", broken)
    monkeypatch.setattr(verified, "VERIFIED", (verified.entry("triton", "pair_scores", "full", TRITON_ID, "table",
                                                              sizes="large"),))
    device = torch.device("cuda", 0)
    assert not verified.is_verified("triton", "pair_scores", "full", device)
    assert not verified.checked_elsewhere("triton", "pair_scores", "full", device)
    assert "identity is unknown" in verified.describe("triton", "pair_scores", "full", device)

"""What `auto` trusts, field by field: each part of a verification's match (versions to the minor, the capability, the
Triton version, a missing build, one answer per device), each part of a first-use kind (precision, layout, columns,
normalize, device, a record's missing fields), which measured point decides a choice (width, span, table
precedence, dtype, per-op fingerprints, the call's variant and size), where the user cache lives, and what an
explicit backend and its warnings do. Each pins a rule a loosened version of the code broke without another test
noticing (tests/test_verified.py, tests/ops/test_first_use.py and tests/test_backend_choice.py loop over the rules'
own tables, or replace identity() with a stand-in)."""

from __future__ import annotations

import sys
import warnings
from types import ModuleType, SimpleNamespace

import pytest
import torch

from angle_kernels import contract, dispatch, first_use, measured, user_cache, verified

TRITON_ID = {"capability": "9.0", "torch": "2.11", "triton": "3.6", "fingerprint": "0123456789abcdef", "gpu": "H100"}
CUDA_ID = {"capability": "9.0", "torch": "2.11", "cuda": "13.0", "fingerprint": "00112233aabbccdd",
           "build": "ab" * 8, "gpu": "H100"}


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(user_cache.CACHE_ENV, str(tmp_path / "cache"))
    verified.forget()
    yield
    verified.forget()


# ------------------------------------------------------------------------------------------------ verifications


def test_each_field_of_a_match_counts():
    assert verified.MATCH_FIELDS["triton"] == ("capability", "torch", "triton", "fingerprint")
    made = verified.entry("triton", "pair_scores", "full", TRITON_ID, "a run", sizes="large")
    assert verified.covers(made, "triton", "pair_scores", "full", TRITON_ID)
    for field, other in (("triton", "3.7"), ("torch", "2.12"), ("capability", "8.9"), ("fingerprint", "f" * 16)):
        assert not verified.covers(made, "triton", "pair_scores", "full", {**TRITON_ID, field: other}), field


def test_versions_and_capabilities_are_compared_to_the_minor(monkeypatch):
    assert verified._major_minor("2.12.0+cu130") == "2.12" and verified._major_minor("3.7.1") == "3.7"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "stand-in")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(verified, "code_identity", lambda backend, op, path: {"fingerprint": "f" * 16,
                                                                              "build": "b" * 16})
    ident = verified.identity("cuda", "ranking_loss", "sort", torch.device("cuda", 0))
    assert ident["capability"] == "8.9" and ident["cuda"] == "12.8"


def test_a_patch_release_of_torch_or_triton_keeps_the_minor_versions_identity(monkeypatch):
    """torch 2.11.0+cu130 and Triton 3.6.0 are torch 2.11 and Triton 3.6 to the match rule, as the table records
    them: a patch release or another CUDA build of torch keeps the verifications of its minor version."""
    triton = ModuleType("triton")
    triton.__version__ = "3.6.0"
    monkeypatch.setitem(sys.modules, "triton", triton)
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "stand-in")
    monkeypatch.setattr(verified, "code_identity", lambda backend, op, path: {"fingerprint": "f" * 16})
    ident = verified.identity("triton", "pair_scores", "full", torch.device("cuda", 0))
    assert ident["torch"] == "2.11" and ident["triton"] == "3.6"


def test_an_entry_of_unknown_code_covers_nothing_that_is_unknown_too():
    """A cache entry `verify` wrote while the extension reported no build fingerprint matches no process, one whose
    extension reports none either included: unknown code is never trusted."""
    unknown = {**CUDA_ID, "build": None}
    made = verified.entry("cuda", "ranking_loss", "sort", unknown, "verify without a build fingerprint")
    assert not verified.covers(made, "cuda", "ranking_loss", "sort", unknown)


def test_each_device_of_a_process_gets_its_own_answer(monkeypatch):
    """Two GPUs in one process, an sm_90 (verified) and an sm_80: the second does not reuse the first's answer."""
    monkeypatch.setattr(verified, "identity", lambda backend, op, path, device: {
        **TRITON_ID, "capability": "9.0" if device.index == 0 else "8.0", "gpu": f"GPU {device.index}"})
    monkeypatch.setattr(verified, "VERIFIED", (verified.entry("triton", "pair_scores", "full", TRITON_ID, "table",
                                                              sizes="large"),))
    verified.forget()
    assert [verified.is_verified("triton", "pair_scores", "full", torch.device("cuda", i)) for i in (0, 1)] == \
        [True, False]


def test_verifying_here_keeps_another_machines_entries():
    """A cache shared by two machines (a home folder on nodes with other GPUs): verify on one replaces its own
    entries of a path, never the other's."""
    other = {**TRITON_ID, "capability": "8.0", "gpu": "A100"}
    verified.write_cache([verified.entry("triton", "similarity_xent", "fused", TRITON_ID, "the H100 node")], [])
    verified.write_cache([verified.entry("triton", "similarity_xent", "fused", other, "the A100 node")], [])
    verified.write_cache([], [verified.entry("triton", "similarity_xent", "fused", other, "the A100 node, failed")])
    assert any(verified.covers(e, "triton", "similarity_xent", "fused", TRITON_ID) for e in verified.read_cache())


# ------------------------------------------------------------------------------------------------ first use


def test_each_part_of_a_first_use_kind_counts(monkeypatch):
    """One check covers the calls of its kind only: float32 with TF32 products is not float32 with IEEE ones, a
    strided unaligned x is not a contiguous one, 4,096 columns are not 64, dot products are not cosines."""
    q = torch.randn(64, 32)
    call = contract.check_similarity_xent(q, None, 20.0, "partner", None, False, 0.0, None, None)
    monkeypatch.setattr(first_use, "triton_interpreting", lambda: False)  # as on a GPU: the suite interprets
    monkeypatch.setenv("ANGLE_KERNELS_ALLOW_TF32", "0")
    ieee = first_use.bucket("triton", "similarity_xent", "fused", call)
    monkeypatch.setenv("ANGLE_KERNELS_ALLOW_TF32", "1")
    assert first_use.bucket("triton", "similarity_xent", "fused", call) != ieee
    monkeypatch.setenv("ANGLE_KERNELS_ALLOW_TF32", "0")

    aligned = contract.check_pair_scores(torch.randn(8, 2, 8), True, None)
    strided = contract.check_pair_scores(torch.randn(9, 2, 9)[1:, :, 1:], True, None)  # [8, 2, 8], other strides
    assert first_use.bucket("triton", "pair_scores", "full", aligned) != \
        first_use.bucket("triton", "pair_scores", "full", strided)

    def xent(columns):
        return contract.check_similarity_xent(torch.randn(64, 8), torch.randn(columns, 8), 20.0, "diagonal", None,
                                              False, 0.0, None, None)

    assert first_use.bucket("triton", "similarity_xent", "fused", xent(64)) != \
        first_use.bucket("triton", "similarity_xent", "fused", xent(4096))

    q, c = torch.randn(16, 8), torch.randn(16, 8)

    def lse(normalize):
        return contract.check_similarity_lse(q, c, 20.0, 0, 0, "none", 0.0, "none", None, None, None, False,
                                             normalize, None)

    assert first_use.bucket("triton", "similarity_lse", "fused", lse(True)) != \
        first_use.bucket("triton", "similarity_lse", "fused", lse(False))


def test_a_margin_prefixes_and_a_score_count_class_are_parts_of_a_first_use_kind():
    """Calls the kernels compile or branch on differently get checks of their own: similarity_xent with a margin
    (margin 0.2 is not margin 0), with four prefixes (dims (8, 16, 32, 64) is not (8, 16): another power-of-two
    count of prefixes), and the Triton ranking term on 64 scores (a multiple of 16) and on 63 (neither)."""
    q = torch.randn(64, 64)

    def xent(margin=0.0, dims=None):
        return contract.check_similarity_xent(q, None, 20.0, "partner", None, False, margin, None, dims)

    assert first_use.bucket("triton", "similarity_xent", "fused", xent(margin=0.0)) != \
        first_use.bucket("triton", "similarity_xent", "fused", xent(margin=0.2))
    assert first_use.bucket("triton", "similarity_xent", "dims", xent(dims=(8, 16))) != \
        first_use.bucket("triton", "similarity_xent", "dims", xent(dims=(8, 16, 32, 64)))

    def ranking(n):
        return contract.check_ranking_loss(torch.randn(n), torch.randint(0, 2, (n,)))

    assert first_use.bucket("triton", "ranking_loss", "pairwise", ranking(64)) != \
        first_use.bucket("triton", "ranking_loss", "pairwise", ranking(63))


def test_a_first_use_outcome_is_one_devices(monkeypatch):
    monkeypatch.setattr(first_use, "bucket", lambda *args: {"M": 64})
    calls = [SimpleNamespace(dtype=torch.bfloat16, device=torch.device("cuda", i)) for i in (0, 1)]
    candidate = SimpleNamespace(name="triton")
    assert first_use._key(candidate, "similarity_xent", calls[0], "fused") != \
        first_use._key(candidate, "similarity_xent", calls[1], "fused")


def test_a_record_lacking_a_field_of_the_kind_or_a_true_pass_lets_nothing_compute():
    kind = {"backend": "triton", "op": "similarity_xent", "path": "fused", "dtype": "bfloat16", "bucket": {"M": 1024},
            "checker": first_use.CHECKER, "capability": "9.0", "torch": "2.11", "triton": "3.6",
            "fingerprint": "45d6ada46e5358f5"}
    assert first_use._matches({**kind, "pass": True}, kind)
    for missing in ("checker", "fingerprint", "triton"):
        record = {k: v for k, v in kind.items() if k != missing} | {"pass": True}
        assert not first_use._matches(record, kind), missing
    for malformed in ("no", 1, "true"):
        assert not first_use._from_record({"path": "fused", "pass": malformed, "gpu": "H100"},
                                          recorded=False).computes, malformed


# ------------------------------------------------------------------------------------------------ measured points


def _xent_call(m, mc, d, dims=None, margin=0.0, dtype=torch.bfloat16, filter_threshold=None):
    return SimpleNamespace(q=torch.empty(m, d, dtype=dtype, device="meta"),
                           c=torch.empty(mc, d, dtype=dtype, device="meta"), dims=dims, margin=margin,
                           device=torch.device("cuda", 0), dtype=dtype, filter_threshold=filter_threshold)


class _Candidate:
    """A backend as measured.fastest sees it: a name, hashable by identity."""

    def __init__(self, name: str):
        self.name = name


def _candidates(*names):
    return [_Candidate(name) for name in names]


def _on_a_gpu_measured(monkeypatch, points, dtype=torch.bfloat16):
    """measured's table replaced by `points` ((op, variant, size, width, {key: ms})) timed on the installed code."""
    monkeypatch.setattr(measured, "capability", lambda device: "stand-in")
    monkeypatch.setattr(measured, "code_fingerprint", lambda backend, op, path: "installed")
    monkeypatch.setattr(measured, "MEASURED", {("stand-in", dtype): tuple(
        (*point, {key: "installed" for key in point[4]}) for point in points)})


SLOW_TRITON = {"triton/fused": 10.0, "torch/default": 1.0}


def test_a_point_decides_within_its_span_of_size_and_of_width(monkeypatch):
    triton, torch_default = _candidates("triton", "torch")
    paths = {triton: "fused", torch_default: "default"}  # the fixed order: Triton first
    _on_a_gpu_measured(monkeypatch, [("similarity_xent", "full", 256 * 256 * 8, 768, SLOW_TRITON)])
    assert measured.fastest("similarity_xent", _xent_call(256, 256, 768), paths) is torch_default  # 8x: within
    _on_a_gpu_measured(monkeypatch, [("similarity_xent", "full", 256 * 256 * 32, 768, SLOW_TRITON)])
    assert measured.fastest("similarity_xent", _xent_call(256, 256, 768), paths) is triton  # 32x: too far
    _on_a_gpu_measured(monkeypatch, [("similarity_xent", "full", 1024 * 1024, 4096, SLOW_TRITON)])
    assert measured.fastest("similarity_xent", _xent_call(1024, 1024, 64), paths) is triton  # 64x the width
    # of two points at the call's size, the one at its width decides
    _on_a_gpu_measured(monkeypatch, [("similarity_xent", "full", 1024 * 1024, 768, SLOW_TRITON),
                                     ("similarity_xent", "full", 1024 * 1024, 4096,
                                      {"triton/fused": 1.0, "torch/default": 10.0})])
    assert measured.fastest("similarity_xent", _xent_call(1024, 1024, 768), paths) is torch_default


def test_a_point_exactly_span_times_away_still_decides(monkeypatch):
    """A point speaks for sizes and widths up to SPAN times its own, that factor included: at 16x fewer logits, or
    at a 16th of the call's width, its times still choose."""
    triton, torch_default = _candidates("triton", "torch")
    paths = {triton: "fused", torch_default: "default"}
    span = int(measured.SPAN)
    _on_a_gpu_measured(monkeypatch, [("similarity_xent", "full", 256 * 256 // span, 768, SLOW_TRITON)])
    assert measured.fastest("similarity_xent", _xent_call(256, 256, 768), paths) is torch_default
    _on_a_gpu_measured(monkeypatch, [("similarity_xent", "full", 256 * 256, 768 // span, SLOW_TRITON)])
    assert measured.fastest("similarity_xent", _xent_call(256, 256, 768), paths) is torch_default


def test_a_time_exactly_at_the_tie_factor_counts_as_a_tie(monkeypatch):
    """A time of exactly (1 + TIE) times the fastest counts as equal to it, and equals go by the fixed order:
    Triton, though torch measured that much faster."""
    triton, torch_default = _candidates("triton", "torch")
    paths = {triton: "fused", torch_default: "default"}
    at_the_tie = {"triton/fused": 1.0 * (1 + measured.TIE), "torch/default": 1.0}
    _on_a_gpu_measured(monkeypatch, [("similarity_xent", "full", 256 * 256, 768, at_the_tie)])
    assert measured.fastest("similarity_xent", _xent_call(256, 256, 768), paths) is triton


def test_a_backend_without_a_time_behind_a_timed_one_leaves_the_comparison_standing(monkeypatch):
    """A backend the point did not time (or timed on code changed since) counts as no faster than the backends before
    it in the fixed order: behind Triton, CUDA without a time leaves torch, measured 5x faster than Triton, to take
    the call (it once sent every such call to Triton, a path measured slower than another auto may use); first in
    the fixed order, a backend without a time takes the call, as the fixed order does where nothing was measured."""
    triton, cuda, torch_default = _candidates("triton", "cuda", "torch")
    _on_a_gpu_measured(monkeypatch, [("similarity_xent", "full", 256 * 256, 768,
                                      {"triton/fused": 5.0, "torch/default": 1.0})])
    call = _xent_call(256, 256, 768)
    assert measured.fastest("similarity_xent", call, {triton: "fused", cuda: "dense", torch_default: "default"}) \
        is torch_default
    # on a path the point did not time, Triton first in the fixed order: the fixed order decides
    assert measured.fastest("similarity_xent", call, {triton: "dense", cuda: "dense", torch_default: "default"}) \
        is triton
    # the point's own rule, on times directly: the first of the fixed order without a time, else the quickest
    assert measured.point_choice([("a", None), ("b", 1.0)]) == "a"
    assert measured.point_choice([("a", 3.0), ("b", None), ("c", 1.0)]) == "c"
    assert measured.point_choice([("a", 1.0 * (1 + measured.TIE)), ("b", None), ("c", 1.0)]) == "a"  # a tie


def test_retiring_the_torch_backends_times_keeps_the_h200s_cuda_pair_scores(monkeypatch):
    """An edit to the torch backend's pair scores retires its times (its fingerprint changes): on the H200's points,
    CUDA's full-width pair scores, measured faster than Triton's with the code installed, still take the call; an
    edit to Triton's pair scores instead retires Triton's time, first in the fixed order: the fixed order (Triton)."""
    monkeypatch.setattr(measured, "capability", lambda device: "9.0")
    point = next(p for p in measured.MEASURED[("9.0", torch.bfloat16)] if p[:4] == ("pair_scores", "full", 262144, 768))
    triton, cuda, torch_default = _candidates("triton", "cuda", "torch")
    paths = {triton: "full", cuda: "full", torch_default: "default"}
    call = SimpleNamespace(x=torch.empty(262144, 2, 768, dtype=torch.bfloat16, device="meta"), dims=None,
                           device=torch.device("cuda", 0), dtype=torch.bfloat16)
    assert point[4]["cuda/full"] < point[4]["triton/full"] / (1 + measured.TIE)
    for edited, expected in (("torch", cuda), ("triton", triton), (None, cuda)):
        monkeypatch.setattr(measured, "code_fingerprint", lambda backend, op, path: (
            "edited" if backend == edited else point[5][f"{backend}/{path}"]))
        assert measured.fastest("pair_scores", call, paths) is expected, edited


def test_a_calls_place_among_the_points(monkeypatch):
    monkeypatch.setattr(measured, "capability", lambda device: "9.0")
    assert measured.call_point("pair_scores", SimpleNamespace(x=torch.empty(8192, 2, 768, device="meta"),
                                                              dims=None)) == ("full", 8192, 768)
    assert measured.call_point("similarity_xent", _xent_call(1024, 1024, 768, dims=(256, 768), margin=0.2)) == \
        ("dims", 1024 * 1024, 768)
    # M queries against Mc candidates: M x Mc logits
    assert measured.call_point("similarity_xent", _xent_call(1024, 2048, 768)) == ("full", 1024 * 2048, 768)
    assert measured.call_point("similarity_lse", _xent_call(1024, 2048, 768)) == ("full", 1024 * 2048, 768)
    assert measured.nearest_points("similarity_xent", _xent_call(1024, 2048, 4096, dtype=torch.float16)) == []


def test_filtered_similarity_lse_calls_have_no_point_and_keep_the_fixed_order(monkeypatch):
    """A filtered dims call (MNRL's false-negative filter, GIST, with Matryoshka) is a variant of its own that no
    point measured, so the fixed order decides it, Triton first, though the H200's points of unfiltered dims calls at
    16,384 x 32,768 logits, D = 4,096, measured the CUDA dense dims scheme faster (126 ms against Triton's 142): the
    CUDA scheme computes the filter in row blocks of other sizes in forward and backward there. A filtered one-width
    call, whose passes block the rows alike, keeps the one-width points."""
    monkeypatch.setattr(measured, "capability", lambda device: "9.0")
    threshold = torch.empty(5, 16384, device="meta")
    dims = (256, 512, 1024, 2048, 4096)
    filtered = _xent_call(16384, 32768, 4096, dims=dims, filter_threshold=threshold)
    plain = _xent_call(16384, 32768, 4096, dims=dims)
    assert measured.call_point("similarity_lse", filtered) == ("dims filtered", 16384 * 32768, 4096)
    assert measured.call_point("similarity_lse", _xent_call(64, 128, 768, filter_threshold=threshold[0, :64])) == (
        "full", 64 * 128, 768)
    assert measured.nearest_points("similarity_lse", filtered) == []
    assert measured.nearest_points("similarity_lse", plain)
    triton, cuda, torch_default = _candidates("triton", "cuda", "torch")
    paths = {triton: "dense_dims", cuda: "dense_dims", torch_default: "default"}
    (recorded,) = [prints for *where, _, prints in measured.MEASURED[("9.0", torch.bfloat16)]
                   if tuple(where) == ("similarity_lse", "dims", 16384 * 32768, 4096)]
    monkeypatch.setattr(measured, "code_fingerprint", lambda backend, op, path: recorded[f"{backend}/{path}"])
    assert measured.fastest("similarity_lse", plain, paths) is cuda
    assert measured.fastest("similarity_lse", filtered, paths) is triton


def test_the_newer_gpus_points_decide_where_both_measured(monkeypatch):
    """The H200's run replaces the H100's points where both measured: on sm_90 a bf16 Matryoshka call at 1,024 x
    2,048, D = 4,096 computes on PyTorch's mixed path (5.35 ms on the H200, Triton's dense_dims 6.62 ms), where the
    H100's older points said Triton."""
    monkeypatch.setattr(measured, "capability", lambda device: "9.0")
    triton, torch_mixed, torch_default = _candidates("triton", "torch", "torch")
    paths = {triton: "dense_dims", torch_mixed: "mixed", torch_default: "default"}
    call = _xent_call(1024, 2048, 4096, dims=(512, 1024, 2048, 4096))
    if measured.code_fingerprint("torch", "similarity_xent", "mixed") is None:
        pytest.skip("this checkout's code identity cannot be told")
    assert measured.fastest("similarity_xent", call, paths) is torch_mixed


def test_each_ops_code_fingerprint_is_its_own():
    measured._installed.clear()
    measured.code_fingerprint("triton", "pair_scores", "dims")
    assert measured.code_fingerprint("triton", "similarity_xent", "dims") == measured.joined_fingerprint(
        "triton", verified.code_identity("triton", "similarity_xent", "dims"))
    assert measured.code_fingerprint("triton", "similarity_xent", "dims") != \
        measured.code_fingerprint("triton", "pair_scores", "dims")


# ------------------------------------------------------------------------------------------------ cache, dispatch


def test_the_packages_cache_variable_wins_over_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv(user_cache.CACHE_ENV, str(tmp_path / "job-cache"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert user_cache.cache_dir() == tmp_path / "job-cache"


def test_a_backend_name_is_read_as_check_backend_reads_it(monkeypatch):
    assert dispatch.resolve_backend(" Torch ", torch.zeros(2)).name == "torch"
    monkeypatch.setenv("ANGLE_KERNELS_BACKEND", "TORCH")
    assert dispatch.resolve_backend(None, torch.zeros(2)).name == "torch"


def test_every_unverified_path_an_explicit_backend_runs_is_named_once(monkeypatch):
    """An explicit backend on paths no run verified warns once per path, each warning naming its path (a second
    path of the same op was once silent)."""
    monkeypatch.setattr(dispatch, "_warned_unverified", set())
    monkeypatch.setattr(verified, "describe", lambda backend, op, path, device: "this GPU")
    monkeypatch.setattr(first_use, "may_check", lambda *args: False)
    ops, call = SimpleNamespace(name="triton"), SimpleNamespace(device=torch.device("cuda", 0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for path in ("fused", "dense", "fused"):
            dispatch._warn_unverified(ops, "similarity_xent", call, path)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2 and "'fused'" in messages[0] and "'dense'" in messages[1]


def test_an_explicit_backends_warning_says_what_auto_would_do(monkeypatch):
    """The warning tells the user what backend="auto" would do with the path: compute with the PyTorch backend,
    or, where its code passed the large-size checks on another GPU, check the first call of each kind here."""
    monkeypatch.setattr(verified, "describe", lambda backend, op, path, device: "this GPU")
    ops, call = SimpleNamespace(name="triton"), SimpleNamespace(device=torch.device("cuda", 0))
    for may_check, says in ((False, "would compute it with the PyTorch backend"),
                            (True, "would compute it after a check of the first call of each kind here")):
        monkeypatch.setattr(dispatch, "_warned_unverified", set())
        monkeypatch.setattr(first_use, "may_check", lambda *args, answer=may_check: answer)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dispatch._warn_unverified(ops, "similarity_xent", call, "fused")
        assert len(caught) == 1 and says in str(caught[0].message), may_check


def test_an_explicit_torch_takes_its_gpu_path_only_where_verified(monkeypatch):
    """backend="torch" never runs a path on a first-use check's word: unverified, its GPU path is not taken even where
    auto would check it."""
    monkeypatch.setattr(first_use, "may_check", lambda *args: True)
    monkeypatch.setattr(dispatch._TORCH_GPU_OPS, "is_verified", lambda op, call: False)
    call = contract.check_pair_scores(torch.randn(8, 2, 8), True, None)
    assert dispatch.TorchOps()._choose("pair_scores", call) is dispatch._TORCH_OPS

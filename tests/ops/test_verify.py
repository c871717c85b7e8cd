"""`python -m angle_kernels.verify` on CPU: its checks of the Triton backend, through the interpreter, at tiny sizes.

What a user's GPU run does is what runs here, minus the GPU: every code path of every op the backend declares,
forward and backward against angle_kernels.float64_ops, twice per case, judged by the reference's rule (each case in
bfloat16 or float64, an op's cases taking them in turn). Checked:
the Triton backend passes on every path (the dense scheme's cases with its MIN_WIDTH lowered to their width);
the checks cover every path the backend declares; and the checks catch the autotuner bug of the dims backward
when the autotuner's first call is replayed (tests/ops/autotune_replay.py) without the kernels' declarations.
The torch backend's GPU path ("mixed", 16-bit products) passes its checks too, its selector taking it on the CPU.
The verification records and the match rule: tests/test_verified.py.
"""

from __future__ import annotations

import pytest
import torch

from angle_kernels.testing.helpers import TRITON_DEVICE

pytest.importorskip("triton")

from angle_kernels import verify  # noqa: E402
from angle_kernels.triton_ops import (  # noqa: E402
    _common, pair_scores_paths, ranking_loss, similarity_lse_paths, similarity_xent_dense, similarity_xent_paths,
)
from autotune_replay import ReplayedAutotuner, install  # noqa: E402

DTYPES = (torch.bfloat16, torch.float64)


TINY_WIDE = 64  # the width of verify.cases("tiny")'s dense cases
TINY_SORT_MIN = 128  # below the 150 scores of verify.cases("tiny")'s ranking sort case, above its pairwise case
TINY_SCAN_BLOCK = 64  # the 150 scores in three scan blocks, the last one partial


@pytest.fixture
def tiny_dense(monkeypatch):
    """The dense scheme taken from the tiny cases' wide width, not from its MIN_WIDTH (768), and so the one-read pair
    scores (ONE_READ_MIN_WIDTH, 768) and the dense similarity_lse scheme; the ranking term's sort path from the tiny
    sort case's size, not from SMALL_N_MAX (4,096), in scan blocks of 64 scores, not 1,024 (the same kernels, a
    constexpr apart: the interpreter scans one score at a time, and three blocks of 1,024 took a quarter of the
    test's time)."""
    monkeypatch.setattr(similarity_xent_dense, "MIN_WIDTH", TINY_WIDE)
    monkeypatch.setattr(ranking_loss, "SMALL_N_MAX", TINY_SORT_MIN)
    monkeypatch.setattr(ranking_loss, "_SCAN_BLOCK", TINY_SCAN_BLOCK)
    for name in ("ONE_READ_MIN_WIDTH", "PROPOSED_ONE_READ_MIN_WIDTH"):
        monkeypatch.setattr(pair_scores_paths, name, TINY_WIDE)
    for name in ("DENSE_DIMS_MIN_WIDTH", "PROPOSED_DENSE_DIMS_MIN_WIDTH"):
        monkeypatch.setattr(similarity_xent_paths, name, TINY_WIDE)
    for name in ("DENSE_MIN_WIDTH", "PROPOSED_DENSE_MIN_WIDTH", "DENSE_DIMS_MIN_WIDTH",
                 "PROPOSED_DENSE_DIMS_MIN_WIDTH"):
        monkeypatch.setattr(similarity_lse_paths, name, TINY_WIDE)


@pytest.mark.slow  # about 12 s through the interpreter
# On a GPU its first compiles of every path's kernels take longer than the GPU run's per-test limit (90 s on an
# H200), and that run's large-size checks (`python -m angle_kernels.verify --sizes large`) run these paths anyway.
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the large-size checks run every path")
def test_the_triton_backend_passes_on_every_code_path(tiny_dense):
    in_turn = _each_case_in_one_dtype(verify.cases("tiny"))
    results = [result for dtype, cases in in_turn.items()
               for result in verify.run_checks("triton", TRITON_DEVICE, cases, (dtype,))]
    assert {r["case"].split(" D=")[-1] for r in results if r["path"] == "dense"} == {str(TINY_WIDE)}
    assert [r["case"] for r in results if r["path"] == "sort"] == ["N=150"]
    assert ranking_loss._SCAN_BLOCK < 150 < 3 * ranking_loss._SCAN_BLOCK  # three blocks, the last one partial
    several = {(r["op"], r["path"]) for r in results if r["op"] != "ranking_loss"} - {
        (case.op, case.path) for case in _single_cases(verify.cases("tiny"))}
    for op, path in several:  # a path with two cases or more is checked in both dtypes
        assert {r["dtype"] for r in results if (r["op"], r["path"]) == (op, path)} == {"bfloat16", "float64"}, path
    failed = [verify._row(r) for r in results if r["pass"] is not True]
    assert not failed, "\n".join(failed)
    checked = {(op, path) for _, op, path in verify.outcomes(results)}
    declared = {(op, path) for op, paths in verify.verified.paths_of("triton").items() for path in paths}
    assert checked == declared  # every code path the backend declares has a check
    assert {r["dtype"] for r in results} == {"bfloat16", "float64"}
    # bf16 and fp64 alone: every path is incomplete until fp32 and fp16 ran too (runs merge: one per dtype); shown
    # on pair_scores' paths (the others' fp32 and fp16 checks run in the GPU run, and cost time here)
    assert set(verify.outcomes(results).values()) == {"incomplete"}
    # one case per path in fp32 and fp16 (its last, the fewest groups): a path's outcome merges its dtypes over all of
    # its cases (verify.outcomes), so one case per path shows the merge; each further case would rerun the same kernels
    pairs = {case.path: case for case in verify.cases("tiny") if case.op == "pair_scores"}
    others = verify.run_checks("triton", TRITON_DEVICE, list(pairs.values()), (torch.float32, torch.float16))
    assert {r["path"] for r in others} == {"full", "dims", "dims_one_read"} and len(others) == 6
    assert all(r["pass"] for r in others), [verify._row(r) for r in others if not r["pass"]]
    merged = verify.outcomes(results + others)
    assert {path: merged[("triton", "pair_scores", path)] for path in ("full", "dims", "dims_one_read")} == {
        "full": "passed", "dims": "passed", "dims_one_read": "passed"}


def _each_case_in_one_dtype(cases):
    """dtype -> cases: each case in one of DTYPES, an op's cases taking them in turn (a case that lacks one, as the
    ranking term's cases lack bfloat16, takes the other). As the loss-level tests do under the interpreter, where a
    case costs seconds: the ops' own tests (tests/ops/test_<op>.py) hold every path to the oracle in every dtype,
    and here each path with two cases or more meets both dtypes (asserted by the test), the single-case paths of
    similarity_lse ("fused" and "fused_prefixes", the same kernels) one each."""
    in_turn = {dtype: [] for dtype in DTYPES}
    turns: dict = {}
    for case in cases:
        usable = [dtype for dtype in DTYPES if dtype in case.dtypes]
        turn = turns[case.op] = turns.get(case.op, -1) + 1
        in_turn[usable[turn % len(usable)]].append(case)
    return in_turn


def _single_cases(cases):
    paths = [(case.op, case.path) for case in cases]
    return [case for case in cases if paths.count((case.op, case.path)) == 1]


@pytest.fixture
def meta_mixed_products(monkeypatch):
    """The meta device offering mixed-dtype products, as a GPU with a recent torch does: there 16-bit calls have the
    torch backend's "mixed" path."""
    import angle_kernels.torch_ops.common as torch_common

    monkeypatch.setitem(torch_common._mixed_products, torch.device("meta"), torch_common.MixedProducts(True, True))


@pytest.mark.parametrize("sizes", ["standard", "large"])
def test_every_gpu_case_takes_the_code_path_it_verifies(sizes, meta_mixed_products):
    """The GPU run's cases (shapes only: meta tensors) each take the path they are named for, with the thresholds
    as they are (no tiny_dense), on the backend that declares it (the torch backend's "mixed" in every dtype its
    case takes): a case that took another path would leave its own unverifiable."""
    from angle_kernels.triton_ops import awaiting_verification_on

    # the backend is resolved for a tensor of the device the cases run on: a GPU where there is one, else the
    # interpreter's CPU (outside the interpreter the Triton backend takes CPU tensors for no call)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with awaiting_verification_on():  # as run_checks takes them: the paths awaiting a verification switched on
        _every_case_takes_its_path(sizes, torch.empty(0, device=device))


def _every_case_takes_its_path(sizes, probe):
    for case in verify.cases(sizes):
        backend = "torch" if case.path == "mixed" else "triton"
        ops = verify.path_ops(backend, probe)
        for dtype in case.dtypes if backend == "torch" else case.dtypes[:1]:
            leaves, arguments = case.build(torch.Generator().manual_seed(0), dtype, "meta")
            args, kwargs = arguments(*leaves)
            assert ops.computes(case.op, *args, **kwargs) == (backend, case.path), case.name


@pytest.mark.parametrize("sizes", ["standard", "large"])
def test_the_cuda_pair_scores_paths_have_cases_in_every_dtype(sizes):
    """The CUDA backend's pair_scores paths each have cases that take them (its selector asked directly: the backend
    loads only on a GPU), in every dtype; the dims cases on both of its kernels' paths (16-byte vectors and per
    element, by the prefixes' widths)."""
    from angle_kernels.cuda_ops import pair_scores as cuda_pair_scores

    taken = {}
    for case in verify.cases(sizes):
        if case.op != "pair_scores" or case.path not in cuda_pair_scores.PATHS:
            continue
        leaves, arguments = case.build(torch.Generator().manual_seed(0), torch.bfloat16, "meta")
        args, kwargs = arguments(*leaves)
        assert cuda_pair_scores.code_path(*args, **kwargs) == case.path, case.name
        assert case.dtypes == verify.DTYPES, case.name
        taken.setdefault(case.path, []).append(kwargs.get("dims"))
    assert set(taken) == set(cuda_pair_scores.PATHS)
    vector_widths = {dims is not None and all(d % 16 == 0 for d in dims) for dims in taken["dims"]}
    assert vector_widths == {True, False}  # 16: twice bf16's vector width, the angle's condition


def test_the_torch_backends_gpu_path_passes_its_checks(monkeypatch):
    """The torch backend's checks: its "mixed" path alone (the path that needs a verification), in bfloat16 and
    float16, every case passing; on the CPU its products convert their 16-bit operands (the same values), and here
    its selector takes "mixed" on the CPU, where it would take "default" (no mixed-dtype products there)."""
    from angle_kernels.torch_ops import similarity_xent as torch_xent

    monkeypatch.setattr(torch_xent, "takes_mixed_products", lambda x: x.dtype in verify.HALF_DTYPES)
    results = verify.run_checks("torch", torch.device("cpu"), verify.cases("tiny"))
    failed = [verify._row(r) for r in results if r["pass"] is not True]
    assert not failed, "\n".join(failed)
    assert verify.outcomes(results) == {("torch", "similarity_xent", "mixed"): "passed"}
    assert {r["dtype"] for r in results} == {"bfloat16", "float16"} and len(results) == 8
    declared = {(op, path) for op, paths in verify.verified.paths_of("torch").items() for path in paths
                if verify.verified.needs_verification("torch", path)}
    assert declared == {("similarity_xent", "mixed")}  # every torch path that needs a verification has its checks


def test_a_case_that_misses_its_path_fails_instead_of_checking_another():
    """Without the lowered MIN_WIDTH the dense cases take the fused kernels: a failure, not a pass for 'dense'."""
    dense = [case for case in verify.cases("tiny") if case.path == "dense"][:1]
    (result,) = verify.run_checks("triton", TRITON_DEVICE, dense, (torch.float64,))
    assert result["pass"] is False and "take the code path 'fused', not 'dense'" in result["error"]


@pytest.mark.skipif(TRITON_DEVICE.type != "cpu", reason="the replay runs under the interpreter")
def test_the_checks_catch_an_autotuner_that_accumulates(monkeypatch):
    """The first call of every key replayed as the autotuner runs it, with the kernels' declarations stripped:
    the dims path, whose backward adds into zeroed buffers, fails; the full-width fused path (which writes its
    first block without reading) still passes. With the declarations, both pass (test_autotune_side_effects)."""
    # The first config of each kernel's GPU list alone (its RUNS_PER_CONFIG runs and the final launch: four launches
    # on the same buffers, not ten): the undeclared buffers sum every run whichever configs ran, so one config shows
    # the sum (a gradient about four times the reference's); every config's replay, with the declarations, runs in
    # tests/ops/test_autotune_side_effects.py.
    install(monkeypatch, lambda t: t._replace(launcher=ReplayedAutotuner(
        t._replace(tuning=_common.Tuning(), configs=t.configs[:1]))))
    # The in-batch negatives case of each path: one failing case fails its path's outcome, which is what the checks
    # must show (the contrastive cases, failing as well, took more than half of the replay's time).
    wanted = [c for c in verify.cases("tiny") if c.op == "similarity_xent" and c.path in ("fused", "dims")
              and c.name.startswith("ibn ")]
    results = verify.run_checks("triton", TRITON_DEVICE, wanted, (torch.float64,))
    assert sorted(r["path"] for r in results) == ["dims", "fused"]
    outcome = verify.outcomes(results)
    assert outcome[("triton", "similarity_xent", "dims")] == "failed"
    assert all(r["pass"] for r in results if r["path"] == "fused")  # (incomplete: float64 alone ran)
    dims_grad_errors = [r["first"]["grad"] for r in results if r["path"] == "dims"]
    assert min(dims_grad_errors) > 1.0  # the gradient is a sum of runs, not a rounding error


def test_a_time_limit_leaves_checks_out_and_their_paths_unrecorded():
    results = verify.run_checks("triton", TRITON_DEVICE, verify.cases("tiny")[:2], (torch.float64,), deadline=0.0)
    assert [r["pass"] for r in results] == [None, None]
    assert set(verify.outcomes(results).values()) == {"incomplete"}
    assert verify.entries_from(results, lambda backend, op, path: {}, "test", "standard") == ([], [])


def test_without_a_gpu_the_command_says_so_and_exits_with_nothing_verifieds_status(capsys, monkeypatch, tmp_path):
    """Without a GPU the command exited 0, which a script took for a verification, after making --out's folder: it
    exits 69 (nothing could be verified here), neither 0 nor a failed check's 1, and writes nothing."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "new" / "verify.json"
    assert verify.main(["--out", str(out)]) == verify.NOTHING_VERIFIED == 69
    assert "no CUDA device: nothing to verify" in capsys.readouterr().out
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("sizes", ["standard", "large"])
def test_the_cuda_similarity_lse_paths_have_cases_in_every_dtype(sizes):
    """The CUDA backend's similarity_lse paths (the dense scheme at one width and with dims) each have cases that take
    them (its selector asked directly: the backend loads only on a GPU), in every dtype, among them raw dot products
    with a guide's filter."""
    from angle_kernels.cuda_ops import similarity_lse as cuda_lse

    taken = {}
    for case in verify.cases(sizes):
        if case.op != "similarity_lse" or case.path not in cuda_lse.PATHS:
            continue
        leaves, arguments = case.build(torch.Generator().manual_seed(0), torch.bfloat16, "meta")
        args, kwargs = arguments(*leaves)
        assert cuda_lse.code_path(*args, **kwargs) == case.path, case.name
        assert case.dtypes == verify.DTYPES, case.name
        taken.setdefault(case.path, []).append(kwargs.get("normalize", True))
    assert set(taken) == set(cuda_lse.PATHS)
    assert set(taken["dense"]) == {True, False}


@pytest.mark.parametrize("sizes", ["standard", "large"])
def test_the_cuda_similarity_xent_paths_have_cases_in_every_dtype(sizes):
    """The CUDA backend's similarity_xent paths (the fused kernels, the dense scheme switched on as run_checks
    switches it, the dense dims scheme) each have cases that take them (its selector asked directly: the backend
    loads only on a GPU), in every dtype; the dense schemes with and without c, over several row blocks at large
    sizes."""
    from angle_kernels.cuda_ops import awaiting_verification_on, similarity_xent_dense, similarity_xent_paths

    taken = {}
    with awaiting_verification_on():
        for case in verify.cases(sizes):
            if case.op != "similarity_xent" or case.path not in similarity_xent_paths.PATHS:
                continue
            leaves, arguments = case.build(torch.Generator().manual_seed(0), torch.bfloat16, "meta")
            args, kwargs = arguments(*leaves)
            assert similarity_xent_paths.code_path(*args, **kwargs) == case.path, case.name
            assert case.dtypes == verify.DTYPES, case.name
            taken.setdefault(case.path, []).append((args[1] is None, args[0].shape[0]))
    assert set(taken) == set(similarity_xent_paths.PATHS)
    for path in ("dense", "dense_dims"):
        assert {symmetric for symmetric, _ in taken[path]} == {True, False}, path
        if sizes == "large":
            assert max(rows for _, rows in taken[path]) > similarity_xent_dense.MAX_BLOCK_ROWS, path


def test_unverified_only_leaves_out_the_paths_the_table_covers_here(monkeypatch):
    """--unverified-only (the project's GPU run): a path the table covers on this GPU with this code is left out
    and named; an entry for other code (another fingerprint) covers nothing, so its path is checked."""
    from angle_kernels import verified

    here = {"capability": "9.0", "torch": "2.11", "triton": "3.6", "gpu": "H200"}
    monkeypatch.setattr(verified, "identity", lambda backend, op, path, device: {
        **here, "fingerprint": f"code of {op} {path}"})
    table = ({"backend": "triton", "op": "pair_scores", "path": "full", **here,
              "fingerprint": "code of pair_scores full"},
             {"backend": "triton", "op": "pair_scores", "path": "dims", **here, "fingerprint": "older code"})
    every = verify.cases("large")
    kept, covered = verify.unverified_cases("triton", every, None, table)
    assert covered == ["triton pair_scores full"]
    assert [c for c in every if (c.op, c.path) != ("pair_scores", "full")] == kept
    assert any((c.op, c.path) == ("pair_scores", "dims") for c in kept)


@pytest.mark.parametrize("backend", ["torch", "triton", "cuda"])
def test_unverified_only_takes_every_backends_cases(monkeypatch, backend):
    """The cases name Triton's paths; a backend that lacks one of them (the torch backend's pair scores compute on
    "default", not "full") keeps the case for run_checks to leave out instead of asking for a fingerprint the path
    does not have."""
    from angle_kernels import fingerprints, verified

    monkeypatch.setattr(verified, "identity", lambda backend, op, path, device: {
        "capability": "9.0", "torch": "2.11", "fingerprint": fingerprints.path_fingerprint(backend, op, path)})
    every = verify.cases("large")
    kept, covered = verify.unverified_cases(backend, every, None, ())
    assert kept == every and covered == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_lse_cases_filter_scores_keep_clear_of_their_thresholds(dtype):
    """similarity_lse's filtered cases (not the guided ones, whose dot products are integers): every prefix's cosine
    of the model's own embeddings, as the backend computes it in float32 from the inputs' dtype, is at least half
    a grid step (1 / (2 width)) from that prefix's threshold, so the backend and the float64 reference keep the
    same columns (random embeddings put some of the GPU run's 250M scores within float32 rounding of it)."""
    lse = [case for case in verify.cases("tiny") + verify.cases("standard")
           if case.op == "similarity_lse" and not case.name.startswith("guided")]
    assert lse
    for case in lse:
        (q, c), arguments = case.build(torch.Generator().manual_seed(0), dtype, "cpu")
        q, c = q[:256], c[:512]  # enough rows to see the grid, few enough to compare exactly here
        _, kwargs = arguments(q, c)
        widths = kwargs.get("dims") or (q.shape[1],)
        thresholds = kwargs["filter_threshold"].reshape(len(widths), -1)[:, 0]
        for width, threshold in zip(widths, thresholds.tolist()):
            a, b = q[:, :width].float(), c[:, :width].float()
            cosines = (a @ b.T) / (a.norm(dim=1)[:, None] * b.norm(dim=1)[None, :])
            assert (cosines - threshold).abs().min() >= 0.5 / width, (case.name, width)
            assert 0 < (cosines > threshold).float().mean() < 0.5, (case.name, width)  # the filter drops some

"""angle_kernels.verify's judgement, which turns a GPU run's checks into verified entries (or revokes them): every
output and every call judged against its allowed error itself, a case that took another code path failing, eager
PyTorch's own error measured below float64 (the half-precision rule's basis), a failure outranking a check left out,
every required dtype needed, checks run only in their dtypes and on the backend's paths, a deadline that leaves
checks out, a raising check a failure, a lost CUDA context stopping the run, and the command's records and exit
status. Stand-in backends: the float64 reference with injected errors."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from angle_kernels import float64_ops, verify
from angle_kernels.testing.helpers import IgnoresIncomingGradient


class _SkewedOps:
    """A backend whose pair_scores is the float64 reference with its outputs scaled by 1 + skew[call][k] on its
    call number `call` (0: the first, 1: the second) and output k (0: cos, 1: angle); computes() names `path`."""

    def __init__(self, skew, path="full"):
        self.skew, self.path, self.calls = skew, path, 0

    def computes(self, op, *args, **kwargs):
        return None, self.path

    def pair_scores(self, *args, **kwargs):
        outs = float64_ops.pair_scores(*args, **kwargs)
        factors = self.skew[min(self.calls, len(self.skew) - 1)]
        self.calls += 1
        return tuple(o * (1 + f) for o, f in zip(outs, factors))


def _pair_case():
    return verify._pair_case("full", 6, 2, 8)


def _check(skew, path="full"):
    return verify.check(_SkewedOps(skew, path), _pair_case(), torch.float64, torch.device("cpu"))


def test_check_passes_an_exact_backend_and_fails_one_whose_second_call_is_off():
    """Both calls are judged: a backend right on its first call (compile + autotune) and wrong on its second fails."""
    assert _check([(0.0, 0.0)])["pass"] is True
    result = _check([(0.0, 0.0), (1e-3, 1e-3)])
    assert result["pass"] is False and result["second"]["value"] > result["allowed"]["value"]


def test_check_judges_every_output_not_the_best_one():
    """An op of two outputs (cos, angle) with the angle off fails: the error is the largest over the outputs."""
    result = _check([(0.0, 1e-3)])
    assert result["pass"] is False and result["first"]["value"] == pytest.approx(1e-3, rel=1e-6)


def test_check_holds_errors_to_the_allowed_error_itself():
    """An error of 1.5x the allowed one fails; half of it passes."""
    allowed = float64_ops.allowed_error(torch.float64, "value")
    assert _check([(1.5 * allowed, 1.5 * allowed)])["pass"] is False
    assert _check([(0.5 * allowed, 0.5 * allowed)])["pass"] is True


def test_check_fails_a_case_whose_inputs_take_another_path():
    result = _check([(0.0, 0.0)], path="dims")
    assert result["pass"] is False and "not 'full'" in result["error"]


def _result(path, dtype, ok, required=("float32", "float64"), op="pair_scores"):
    return {"backend": "triton", "op": op, "path": path, "case": "c", "dtype": dtype, "pass": ok,
            "dtypes_required": list(required)}


def test_outcomes_a_failure_outranks_a_check_left_out():
    """A path that failed one check and had another left out by the time limit failed (its record is revoked),
    whichever came first; one with a check left out and the rest passed is incomplete."""
    for results in ([_result("full", "float32", False), _result("full", "float64", None)],
                    [_result("full", "float64", None), _result("full", "float32", False)]):
        assert verify.outcomes(results) == {("triton", "pair_scores", "full"): "failed"}
    assert verify.outcomes([_result("full", "float32", True), _result("full", "float64", None)]) == {
        ("triton", "pair_scores", "full"): "incomplete"}


def test_outcomes_a_path_passes_only_when_every_required_dtype_passed():
    only_float32 = [_result("full", "float32", True)]
    assert verify.outcomes(only_float32) == {("triton", "pair_scores", "full"): "incomplete"}
    both = only_float32 + [_result("full", "float64", True)]
    assert verify.outcomes(both) == {("triton", "pair_scores", "full"): "passed"}


def test_entries_from_never_records_an_incomplete_or_failed_path_as_passed():
    results = [_result("full", "float32", True), _result("full", "float64", True),  # passed
               _result("dims", "float32", False), _result("dims", "float64", True),  # failed
               _result("one", "float32", True), _result("one", "float64", None)]  # incomplete
    passed, failed = verify.entries_from(results, lambda backend, op, path: {"gpu": "X", "capability": "9.0"},
                                         "test", "standard")
    assert [e["path"] for e in passed] == ["full"] and [e["path"] for e in failed] == ["dims"]


class _BackendOps(_SkewedOps):
    """_SkewedOps as _run_checks sees a backend: its op table and paths."""

    def __init__(self, skew, path="full", raises=None):
        super().__init__(skew, path)
        self.raises = raises
        self.backend = SimpleNamespace(pair_scores=True, paths={"pair_scores": ("full", "dims")})

    def computes(self, op, *args, **kwargs):
        if self.raises is not None:
            raise self.raises
        return super().computes(op, *args, **kwargs)


def test_run_checks_past_the_deadline_leaves_checks_out_and_runs_them_before_it():
    cpu, case = torch.device("cpu"), _pair_case()
    late = verify._run_checks(_BackendOps([(0.0, 0.0)]), "triton", cpu, [case], (torch.float64,),
                              time.monotonic() - 1.0, None)
    assert [(r["pass"], r["error"]) for r in late] == [(None, "not run: time limit")]
    assert verify.outcomes(late) == {("triton", "pair_scores", "full"): "incomplete"}
    early = verify._run_checks(_BackendOps([(0.0, 0.0)]), "triton", cpu, [case], (torch.float64,),
                               time.monotonic() + 600.0, None)
    assert [r["pass"] for r in early] == [True]


def test_run_checks_a_check_that_raises_is_a_failure():
    """A kernel that raises (a compile error, a launch failure) fails its check, so its path is revoked, not left
    as "incomplete" (neither recorded nor revoked)."""
    results = verify._run_checks(_BackendOps([(0.0, 0.0)], raises=RuntimeError("boom")), "triton",
                                 torch.device("cpu"), [_pair_case()], (torch.float64,), None, None)
    assert [r["pass"] for r in results] == [False] and "RuntimeError: boom" in results[0]["error"]
    assert verify.outcomes(results) == {("triton", "pair_scores", "full"): "failed"}


@pytest.mark.parametrize("outcome", ["passed", "failed"])
def test_verify_main_records_passed_and_failed_paths_and_exits_1_on_a_failure(monkeypatch, capsys, outcome):
    """`python -m angle_kernels.verify` on a (faked) GPU: a failed path is recorded (its earlier record revoked)
    even when nothing passed, and the exit status says a check failed."""
    from angle_kernels import verified

    ok = outcome == "passed"
    results = [{"backend": "triton", "op": "pair_scores", "path": "full", "case": "c", "dtype": d, "pass": ok,
                "dtypes_required": ["float64"]} for d in ("float64",)]
    recorded = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(verify, "_runnable_backends", lambda wanted: (["triton"], {}))
    monkeypatch.setattr(verify, "run_checks", lambda *a, **k: list(results))
    monkeypatch.setattr(verified, "identity", lambda b, o, p, d: {"gpu": "Fake GPU", "capability": "9.0"})
    monkeypatch.setattr(verified, "write_cache", lambda passed, failed: recorded.append((passed, failed)) or "c")
    assert verify.main(["--dtypes", "float64"]) == (0 if ok else 1)
    (passed, failed), = recorded
    assert [e["path"] for e in (passed if ok else failed)] == ["full"] and (failed if ok else passed) == []
    assert f"{'passed' if ok else 'FAILED'}: triton pair_scores full on Fake GPU (sm_90)" in capsys.readouterr().out


@pytest.mark.parametrize("limit", ["0", "-5", "nan"])
def test_verify_refuses_a_time_limit_that_is_not_a_positive_number(limit, capsys):
    """--time-limit 0 would leave every check out (and record nothing, after the GPU's start-up); nan would be no
    limit at all."""
    with pytest.raises(SystemExit):
        verify.main(["--time-limit", limit])
    assert "--time-limit must be a positive number" in capsys.readouterr().err


def test_run_checks_runs_a_case_only_in_its_dtypes_and_on_the_backends_paths():
    """A case of float64 only is not run in float32 (the torch backend's half-only cases would fail there and
    revoke its path); a case of a path the backend lacks is left out (not failed)."""
    cpu = torch.device("cpu")
    only64 = verify.Case("pair_scores", "full", "x", _pair_case().build, (torch.float64,))
    results = verify._run_checks(_BackendOps([(0.0, 0.0)]), "triton", cpu, [only64], (torch.float32, torch.float64),
                                 None, None)
    assert [(r["dtype"], r["pass"]) for r in results] == [("float64", True)]
    lacking = verify.Case("pair_scores", "one_read", "x", _pair_case().build, (torch.float64,))
    assert verify._run_checks(_BackendOps([(0.0, 0.0)], path="one_read"), "triton", cpu, [lacking],
                              (torch.float64,), None, None) == []


def test_run_checks_stops_at_a_lost_cuda_context():
    """After "CUDA error" every later call of the process fails too: the checks stop there, instead of recording
    every later path as failed (revoking its verification) for a fault of the one that broke the context."""
    results = verify._run_checks(_BackendOps([(0.0, 0.0)], raises=RuntimeError("CUDA error: an illegal memory "
                                                                                "access was encountered")),
                                 "triton", torch.device("cpu"), [_pair_case(), _pair_case()], (torch.float64,),
                                 None, None)
    assert len(results) == 1 and results[0]["pass"] is False


def test_check_measures_eager_pytorchs_error_below_float64():
    """Below float64 the allowed error is judged against eager PyTorch's own error in that dtype: it is measured."""
    result = verify.check(_SkewedOps([(0.0, 0.0)]), _pair_case(), torch.float32, torch.device("cpu"))
    assert result["eager"] is not None and result["eager"]["value"] > 0 and result["pass"] is True


def test_check_fails_a_backend_whose_first_call_is_off():
    """The first call (the one that compiles and autotunes) is judged too: right only on its second call fails."""
    result = _check([(1e-3, 1e-3), (0.0, 0.0)])
    assert result["pass"] is False and result["second"]["value"] == 0.0
    assert result["first"]["value"] > result["allowed"]["value"]


class _GradientSkewedOps:
    """A backend computing `op` as the float64 reference does, but with the gradient of its leaf number `leaf` scaled
    by 1 + skew (its values exact): a backward kernel that is off while the forward is right."""

    def __init__(self, path, skew, leaf=0):
        self.path, self.skew, self.leaf = path, skew, leaf

    def computes(self, op, *args, **kwargs):
        return None, self.path

    def _skewed(self, op, *args, **kwargs):
        args = list(args)
        x = args[self.leaf]
        args[self.leaf] = x + self.skew * (x - x.detach())  # the same values, the gradient times 1 + skew
        return getattr(float64_ops, op)(*args, **kwargs)

    def pair_scores(self, *args, **kwargs):
        return self._skewed("pair_scores", *args, **kwargs)

    def similarity_xent(self, *args, **kwargs):
        return self._skewed("similarity_xent", *args, **kwargs)


def test_check_fails_a_backend_whose_gradients_alone_are_off():
    """A backward kernel off by 1e-3 with a right forward fails its check: the gradients are judged, not only the
    values."""
    result = verify.check(_GradientSkewedOps("full", 1e-3), _pair_case(), torch.float64, torch.device("cpu"))
    assert result["first"]["value"] == 0.0 and result["first"]["grad"] == pytest.approx(1e-3, rel=1e-6)
    assert result["pass"] is False


def test_check_judges_the_gradient_of_every_input():
    """The contrastive case's two inputs (queries and candidates): a backend whose candidates' gradient alone is off
    fails, as one whose queries' gradient is."""
    case = verify._xent_case("fused", 6, 8, 8)
    for leaf in (0, 1):
        result = verify.check(_GradientSkewedOps("fused", 1e-3, leaf), case, torch.float64, torch.device("cpu"))
        assert result["pass"] is False and result["first"]["grad"] == pytest.approx(1e-3, rel=1e-6), leaf


class _CotangentBlindOps(_SkewedOps):
    """pair_scores right in value, its backward computing as though every output's incoming gradient were 1."""

    def pair_scores(self, *args, **kwargs):
        return tuple(IgnoresIncomingGradient.apply(o) for o in float64_ops.pair_scores(*args, **kwargs))


def test_check_fails_a_backward_that_ignores_its_incoming_gradient():
    """The outputs are weighted by random weights before the backward: a backward that treats its incoming gradient
    as ones (right only for loss.backward() of a plain sum) fails."""
    result = verify.check(_CotangentBlindOps([(0.0, 0.0)]), _pair_case(), torch.float64, torch.device("cpu"))
    assert result["first"]["value"] == 0.0 and result["first"]["grad"] > 1e-3 and result["pass"] is False


def test_a_ranking_case_is_judged_against_the_reference_up_to_its_largest_matrix():
    """The ranking term is checked against the float64 reference (and so eager PyTorch's error in 16-bit dtypes),
    and only beyond REFERENCE_MAX_ELEMENTS entries of its N x N matrix against the torch backend in float64."""
    case = verify._ranking_case("sort", 6000)
    within = int(verify.REFERENCE_MAX_ELEMENTS ** 0.5)
    assert verify._reference_for(case, [torch.zeros(within)]) == (float64_ops, "reference")
    ops, against = verify._reference_for(case, [torch.zeros(within + 1)])
    assert against == "torch float64" and ops.name == "torch"
    pairs = _pair_case()
    assert verify._reference_for(pairs, [torch.zeros(within + 1, 2, 8)]) == (float64_ops, "reference")


@pytest.mark.parametrize("message", ["CUDA error: unspecified launch failure",
                                     "Triton Error [CUDA]: an illegal memory access was encountered"])
def test_run_checks_stops_at_either_report_of_a_lost_cuda_context(message):
    """Triton reports a lost context without the words "CUDA error": its "illegal memory access" stops the checks
    too, instead of failing (and revoking) every later path."""
    results = verify._run_checks(_BackendOps([(0.0, 0.0)], raises=RuntimeError(message)), "triton",
                                 torch.device("cpu"), [_pair_case(), _pair_case()], (torch.float64,), None, None)
    assert len(results) == 1 and results[0]["pass"] is False


def test_entries_from_records_the_dtypes_each_path_was_checked_in():
    results = [_result("full", "float64", True), _result("full", "float32", True)]
    (entry,), failed = verify.entries_from(results, lambda backend, op, path: {"gpu": "X", "capability": "9.0"},
                                           "test", "standard")
    assert entry["dtypes"] == ["float32", "float64"] and entry["sizes"] == "standard" and failed == []


@pytest.mark.parametrize("sizes", ["tiny", "standard"])
def test_the_cases_run_in_the_dtypes_their_op_takes_and_compute_a_loss(sizes):
    """The ranking term takes its scores in SCORE_DTYPES only (a bfloat16 case would fail, revoking its path); every
    in-batch case weights some rows and leaves some out (all weights 0 would compare zero losses, verifying
    nothing); the filtered similarity_lse cases' embeddings have entries of magnitude 1/2, 1 or 2."""
    from angle_kernels.contract import SCORE_DTYPES

    every = verify.cases(sizes)
    assert {case.dtypes for case in every if case.op == "ranking_loss"} == {SCORE_DTYPES}
    for case in every:
        if case.op == "similarity_xent" and case.name.startswith("ibn") and sizes == "tiny":
            (q,), arguments = case.build(torch.Generator().manual_seed(0), torch.float64, "cpu")
            weights = arguments(q)[1]["row_weights"]
            assert 0 < int((weights > 0).sum()) < len(weights), case.name
        if case.op == "similarity_lse" and not case.name.startswith("guided") and sizes == "tiny":
            (q, c), _ = case.build(torch.Generator().manual_seed(0), torch.float64, "cpu")
            assert set(q.abs().unique().tolist()) <= {0.5, 1.0, 2.0} and set(c.abs().unique().tolist()) <= {
                0.5, 1.0, 2.0}, case.name


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_run_checks_switches_on_the_paths_awaiting_their_first_verification(monkeypatch, backend):
    """The checks run with the backend's paths that await a verification taking their calls (else their cases
    would take the verified paths and fail as "the inputs take the code path ..."); after the run they are off
    again."""
    import importlib

    package = importlib.import_module(f"angle_kernels.{backend}_ops")
    # every path is verified and switched on today: switch one off, as a new path awaiting its verification is
    (module, width), *_ = package.AWAITING_VERIFICATION.values()
    monkeypatch.setattr(importlib.import_module(f"angle_kernels.{backend}_ops.{module}"), width, None)
    awaiting = package.paths_awaiting_verification()  # off outside the checks
    assert awaiting
    seen = []
    monkeypatch.setattr(verify, "path_ops", lambda name, probe: None)
    monkeypatch.setattr(verify, "_run_checks", lambda *args: seen.append(package.paths_awaiting_verification()) or [])
    assert verify.run_checks(backend, torch.device("cpu"), []) == []
    assert seen == [set()] and package.paths_awaiting_verification() == awaiting


def test_the_backends_to_check_are_every_gpu_backend_that_can_run_here():
    """--backend all (the default) takes every GPU backend: each either checked or named with why not (the torch
    backend's GPU path always runs); a named backend alone is checked."""
    from angle_kernels import verified

    usable, why_not = verify._runnable_backends(["all"])
    assert "torch" in usable and set(usable) | set(why_not) == set(verified.GPU_BACKENDS)
    assert not set(usable) & set(why_not) and all(why_not.values())
    assert verify._runnable_backends(["torch"]) == (["torch"], {})


def test_verify_takes_comma_separated_backends_and_refuses_another_name(capsys):
    assert verify._backend_names("triton, torch") == ["triton", "torch"]
    with pytest.raises(SystemExit):
        verify.main(["--backend", "triton,tpu"])
    assert "not a GPU backend: 'tpu'" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["int8", "complex64"])
def test_verify_refuses_a_dtype_it_does_not_check(name, capsys):
    with pytest.raises(SystemExit):
        verify.main(["--dtypes", f"float32,{name}"])
    assert f"--dtypes: {name!r} is not one of bfloat16, float32, float16, float64" in capsys.readouterr().err


def _on_a_fake_gpu(monkeypatch, results, why_not=None):
    """verify.main's GPU run faked: the triton backend usable (the others not, as why_not says), run_checks
    returning `results`; returns the list of run_checks' calls (backend, cases, dtypes, deadline) and the list of
    write_cache's (passed, failed)."""
    from angle_kernels import verified

    calls, recorded = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(verify, "_runnable_backends", lambda wanted: (["triton"], dict(why_not or {})))

    def run_checks(backend, device, case_list, dtypes, deadline=None, on_result=None):
        calls.append((backend, case_list, dtypes, deadline))
        return list(results)

    monkeypatch.setattr(verify, "run_checks", run_checks)
    monkeypatch.setattr(verified, "identity", lambda b, o, p, d: {"gpu": "Fake GPU", "capability": "9.0"})
    monkeypatch.setattr(verified, "write_cache", lambda passed, failed: recorded.append((passed, failed)) or "c")
    return calls, recorded


def test_verify_checks_the_standard_cases_in_every_dtype_by_default_and_names_what_it_leaves_out(monkeypatch, capsys):
    """Without options: the standard sizes, every dtype in DTYPES' order, no time limit; a backend that cannot run
    is named with why."""
    calls, _ = _on_a_fake_gpu(monkeypatch, [_result("full", "float64", True, ("float64",))],
                              why_not={"cuda": "the extension is not built"})
    assert verify.main([]) == 0
    ((backend, case_list, dtypes, deadline),) = calls
    assert backend == "triton" and dtypes == list(verify.DTYPES) and deadline is None
    assert [(c.op, c.path, c.name) for c in case_list] == [(c.op, c.path, c.name) for c in verify.cases("standard")]
    assert "not checked: cuda: the extension is not built" in capsys.readouterr().out


def test_verify_with_no_backend_that_can_run_exits_with_nothing_verifieds_status(monkeypatch, capsys, tmp_path):
    """A GPU where none of the backends asked for can run (--backend cuda, its extension not built) verified nothing
    and exited 0 as a verification does: it exits 69, as without a GPU, runs no check and writes no --out."""
    calls, recorded = _on_a_fake_gpu(monkeypatch, [])
    monkeypatch.setattr(verify, "_runnable_backends", lambda wanted: ([], {"cuda": "the extension is not built"}))
    out = tmp_path / "new" / "verify.json"
    assert verify.main(["--backend", "cuda", "--out", str(out)]) == verify.NOTHING_VERIFIED
    assert calls == [] and recorded == [] and not (tmp_path / "new").exists()
    printed = capsys.readouterr().out
    assert "not checked: cuda: the extension is not built" in printed
    assert "nothing to verify: none of the backends asked for can run here; exit status 69" in printed


def test_verify_time_limit_no_record_and_out(monkeypatch, capsys, tmp_path):
    """--time-limit 60 ends the checks 60 s from the start, --no-record leaves the user's cache alone, --out holds
    every check and the passed and failed entries; a path whose checks were left out is named as not verified."""
    import json

    results = [_result("full", "float64", True, ("float64",)), _result("dims", "float64", None, ("float64",))]
    calls, recorded = _on_a_fake_gpu(monkeypatch, results)
    out = tmp_path / "verify.json"
    before = time.monotonic()
    assert verify.main(["--time-limit", "60", "--no-record", "--out", str(out)]) == 0
    after = time.monotonic()
    ((_, _, _, deadline),) = calls
    assert before + 60 <= deadline <= after + 60
    assert recorded == []
    report = json.loads(out.read_text())
    assert report["results"] == results and [e["path"] for e in report["passed"]] == ["full"]
    assert report["failed"] == [] and report["gpu"] == "Fake GPU"
    assert "not verified (checks left out by the time limit): triton pair_scores dims" in capsys.readouterr().out


def test_verify_unverified_only_leaves_out_what_the_table_covers(monkeypatch, capsys):
    calls, _ = _on_a_fake_gpu(monkeypatch, [])
    monkeypatch.setattr(verify, "unverified_cases", lambda backend, case_list, device: ([], [
        f"{backend} pair_scores full"]))
    assert verify.main(["--unverified-only"]) == 0
    assert calls[0][1] == []
    assert "already verified (the project's table): triton pair_scores full" in capsys.readouterr().out


def test_verify_forget_that_cannot_remove_the_cache_exits_1(monkeypatch, capsys):
    from angle_kernels import user_cache

    def refuse():
        raise OSError("read-only file system")

    monkeypatch.setattr(user_cache, "forget", refuse)
    assert verify.main(["--forget"]) == 1
    assert "cannot remove the cache: read-only file system" in capsys.readouterr().err

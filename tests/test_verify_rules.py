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

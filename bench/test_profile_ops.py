"""bench/profile_ops.py: where a call's time goes; its dry run on CPU and its reading of a GPU profile."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tarfile
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

import profile_ops  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not INTERPRETING, reason="the dry run: Triton's interpreter on CPU tensors")
def test_the_dry_run_profiles_every_case_on_every_backend(tmp_path):
    """Every case of the plan on each of its backends (the cosine loss beside angle-emb's and sentence-transformers'):
    times, ops and top ops per call, the path each op row took, one trace per row."""
    import providers

    try:  # by path, as the reference rows load it (the package's own import needs more than its loss.py)
        providers.find_reference_loss_file()
    except FileNotFoundError:
        pytest.skip("the reference rows need angle-emb's loss.py (scripts/setup.sh installs angle-emb)")
    pytest.importorskip("sentence_transformers")
    assert profile_ops.main(["--device", "cpu", "--out", str(tmp_path), "--runs", "1"]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    expected = [(case[0], backend) for case, backends in profile_ops.CPU_PLAN for backend in backends]
    assert [(r["case"], r["backend"]) for r in rows] == expected
    for row in rows:
        assert "error" not in row, row
        assert row["wall_s"] >= row["host_s"] > 0 and row["queued_s"] > 0 and row["cold_s"] > 0
        assert row["ops"] >= 1 and row["top"] and all(t["ms"] >= 0 for t in row["top"])
        assert row["launches"] == row["d2h"] == row["syncs"] == 0 and row["bound"] == ""  # no GPU, nothing to tell
        if not row["case"].startswith(profile_ops.LOSS_PREFIX):  # the op sweep's rows name the path they took
            assert row["path"]
    with tarfile.open(tmp_path / profile_ops.TRACE_ARCHIVE) as tar:
        assert len(tar.getnames()) == len(rows)
    table = (tmp_path / "table.md").read_text()
    assert "| similarity_xent(ibn) | 16 | 32 | float32 | triton (fused) |" in table
    assert "| loss:cosine | 64 | 32 | float32 | reference |" in table


def _event(name, start=0.0, end=0.0, on_device=False, parent=None, cpu_us=0.0):
    device = torch.autograd.DeviceType.CUDA if on_device else torch.autograd.DeviceType.CPU
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                           cpu_parent=parent, cpu_time_total=cpu_us)


def test_a_gpu_profile_is_read_per_call():
    """Two calls: busy is the union of the device's intervals (overlaps once), kernels count as launches and copies
    not, a device-to-host copy and the calls' own syncs count, the profiler's own syncs do not; top-level torch ops
    count, not those dispatched inside them; the top kernels by time."""
    outer, node = _event("aten::mm"), _event("autograd::engine::evaluate_function: MmBackward0")
    events = [
        outer, _event("aten::addmm", parent=outer), _event("angle_kernels::cuda_pair_scores"), node,
        _event("aten::mm", parent=node),
        _event("cudaLaunchKernel"), _event("cudaStreamSynchronize"), _event("cudaDeviceSynchronize"),
        _event("gemm", 0, 100, on_device=True), _event("gemm", 50, 150, on_device=True),  # overlapping: 150 us
        _event("reduce", 200, 210, on_device=True), _event("Memcpy DtoH (Device -> Pinned)", 300, 302, True),
        _event("Memset (Device)", 400, 401, on_device=True)]
    figures = profile_ops.summarize_events(events, calls=2, device="cuda", own_syncs=1)
    assert figures["busy_s"] == pytest.approx((150 + 10 + 2 + 1) / 1e6 / 2)
    assert figures["launches"] == 1.5 and figures["d2h"] == 0.5 and figures["syncs"] == 0.5
    # aten::mm, the package's op and the backward's aten::mm; aten::addmm ran inside aten::mm, and the autograd
    # engine's evaluation of a node is not an op
    assert figures["ops"] == 1.5
    assert [t["name"] for t in figures["top"]] == ["gemm", "reduce"]
    assert figures["top"][0] == {"name": "gemm", "ms": pytest.approx(0.1), "count": 1.0}


def test_a_gpu_profile_without_device_events_tells_nothing_rather_than_an_idle_gpu():
    """No kernel, copy or memset recorded on a GPU (the profiler's CUPTI missing): busy unknown, no verdict, not a GPU
    busy 0% of the time (which would read as host-bound)."""
    figures = profile_ops.summarize_events([_event("aten::mm"), _event("cudaDeviceSynchronize")], calls=1,
                                           device="cuda", own_syncs=1)
    assert figures["busy_s"] is None and figures["launches"] == 0
    row = {"case": "pair_scores", "n": 8, "d": 8, "dtype": "bfloat16", "backend": "cuda", "device": "cuda",
           "wall_s": 1e-3, "host_s": 1e-3, "queued_s": 1e-3, **figures}
    row["bound"] = profile_ops.bound(row)
    assert row["bound"] == ""
    row["note"] = "no GPU activity"
    assert profile_ops.row_line(row).endswith("| no GPU activity |")


def test_a_call_is_host_bound_where_the_gpu_idles_most_of_it():
    assert profile_ops.bound({"device": "cuda", "busy_s": 0.4, "wall_s": 1.0}) == "host"
    assert profile_ops.bound({"device": "cuda", "busy_s": 0.6, "wall_s": 1.0}) == "device"
    assert profile_ops.bound({"device": "cpu", "busy_s": 0.0, "wall_s": 1.0}) == ""


def test_cases_are_parsed_and_bad_ones_named():
    assert profile_ops.parse_case("similarity_xent(ibn):1024:768") == ("similarity_xent(ibn)", 1024, 768, "bfloat16")
    assert profile_ops.parse_case("loss:cosine:8192:768:float32") == ("loss:cosine", 8192, 768, "float32")
    for text, says in (("pair_scores:1024", "NAME:N:D[:DTYPE]"), ("nothing:8:8", "unknown benchmark"),
                       ("loss:nothing:8:8", "unknown benchmark"), ("pair_scores:8:8:int8", "the dtype must be"),
                       ("pair_scores:0:8", "at least 1"), ("pair_scores:x:8", "whole numbers")):
        with pytest.raises(ValueError, match=re.escape(says)):
            profile_ops.parse_case(text)


def test_bad_arguments_are_refused_before_any_work(tmp_path, capsys, monkeypatch):
    out = ["--out", str(tmp_path / "out")]
    for argv, says in ((["--device", "cpu"], "--out is required"),
                       ([*out, "--runs", "0"], "--runs must be at least 1"),
                       ([*out, "--time-budget", "0"], "--time-budget must be a positive"),
                       ([*out, "--cases", "pair_scores:8"], "--cases: a case is"),
                       ([*out, "--cases", "pair_scores:8:8", "--backends", "triton,gpu"], "--backends: unknown gpu"),
                       ([*out, "--backends", "triton"], "--backends applies to --cases")):
        with pytest.raises(SystemExit):
            profile_ops.main(argv)
        assert says in capsys.readouterr().err
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit):
        profile_ops.main(["--device", "cpu", *out])
    assert "set TRITON_INTERPRET=1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_default_gpu_cases_are_known_benchmarks():
    plan = profile_ops.default_cases("cuda")
    for (name, n, d, dtype), backends in plan:
        assert profile_ops.parse_case(f"{name}:{n}:{d}:{dtype}") == (name, n, d, dtype)
        assert all(profile_ops.known_backend(b) for b in backends)
    # the losses first, ours beside the references that provide each; then the CUDA backend's 18 gaps on both
    assert [backends for case, backends in plan[:3]] == [("auto", "reference", "sentence-transformers"),
                                                         ("auto", "reference", "sentence-transformers"),
                                                         ("auto", "sentence-transformers")]
    assert len(plan) == 3 + 18 and all(backends == ("triton", "cuda") for _, backends in plan[3:])


def test_an_op_on_auto_computes_on_autos_choice_not_a_recording_copy(monkeypatch):
    """auto's Ops choose per call (on a GPU, AutoOps): the op runs on them as they are, with no path recorded."""
    from angle_kernels import dispatch

    chosen = dispatch.resolve_backend("auto", torch.empty(0))
    monkeypatch.setattr(dispatch, "resolve_backend", lambda name, *tensors: chosen if name == "auto" else None)
    seen = []
    bench = dataclasses.replace(profile_ops.op_benches()["pair_scores"],
                                setup=lambda ops, *args: (seen.append(ops), (None, [], {}))[1])
    monkeypatch.setattr(profile_ops, "op_benches", lambda: {"pair_scores": bench})
    assert profile_ops.build_call("pair_scores", 4, 8, torch.float32, "auto", "cpu") == (None, [], None)
    assert seen == [chosen]


def test_a_reference_is_no_backend_of_an_op_and_a_loss_it_lacks_is_named():
    with pytest.raises(ValueError, match="reference for the losses, not a backend of the op pair_scores"):
        profile_ops.build_call("pair_scores", 4, 8, torch.float32, "reference", "cpu")
    with pytest.raises(ValueError, match="reference provides no mnrl_hardness loss"):
        profile_ops.build_call("loss:mnrl_hardness", 4, 8, torch.float32, "reference", "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the answer of a machine without a CUDA device")
def test_without_a_cuda_device_it_says_how_to_dry_run_and_does_nothing(tmp_path, capsys):
    assert profile_ops.main(["--out", str(tmp_path / "out")]) == 0
    assert "skipped: no CUDA device" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()

"""The first-use check (angle_kernels.first_use) on a GPU the table does not cover, played on CPU.

backend="auto" is driven with the Triton backend's real kernels (through the interpreter on CPU tensors; compiled on
CUDA tensors where the session has a GPU) on a stand-in GPU: `verified.identity` reports a compute capability and
versions no entry matches, with this checkout's fingerprints, and the table holds large-size entries of those
fingerprints from another GPU for every Triton path but pair_scores' dims path. So nothing is verified here, every
path but that one may compute after a check, and the user's cache is a temporary folder. Checked: one check per kind
of call (a new bucket or dtype checks again); a planted wrong result (value or gradient) is refused, the PyTorch
backend computes, one warning, a failing record; records are reused by another process, and a record another
process made while this one waited for the lock is used; no check while tracing (records only); SELF_CHECK=0 and a
path outside the table never check; an oversized call is checked on a part in the same code path and bucket.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from angle_kernels.testing.helpers import TRITON_DEVICE, runtime_warnings

pytest.importorskip("triton")

from angle_kernels import contract, dispatch, first_use, measured, user_cache, verified

DEVICE = TRITON_DEVICE
NOT_IN_THE_TABLE = ("pair_scores", "dims")


def stand_in_identity(backend: str, op: str, path: str, device: torch.device) -> dict:
    """A GPU and versions no entry covers, running this checkout's code."""
    return {"capability": "0.1", "torch": "0.0", "triton": "0.0", "cuda": "0.0", "gpu": "a stand-in GPU",
            **verified.code_identity(backend, op, path)}


def stand_in_table() -> tuple[dict, ...]:
    """Large-size entries from another GPU (sm_90) for this checkout's Triton paths, but pair_scores' dims path."""
    return tuple(
        verified.entry("triton", op, path, {**stand_in_identity("triton", op, path, DEVICE), "capability": "9.0"},
                       "another GPU's large-size run", sizes="large")
        for op, paths in verified.paths_of("triton").items() for path in paths if (op, path) != NOT_IN_THE_TABLE)


@pytest.fixture
def gpu(monkeypatch, tmp_path):
    """`auto` on the stand-in GPU, with a fresh cache and process state; `.checks` lists the (op, path, dtype) of
    every check run, `.triton` is auto's Triton candidate."""
    monkeypatch.setattr(verified, "identity", stand_in_identity)
    monkeypatch.setattr(verified, "VERIFIED", stand_in_table())
    monkeypatch.setattr(measured, "capability", lambda device: None)  # no measured speeds: the fixed order
    monkeypatch.setenv(user_cache.CACHE_ENV, str(tmp_path / "cache"))
    for name in (first_use.ENV, "ANGLE_KERNELS_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(dispatch, "_warned_auto_on_gpu", False)
    monkeypatch.setattr(dispatch, "_auto_ops", {})
    checks = []
    real_check = first_use.run_check

    def counted(candidate, op, call):
        checks.append((op, candidate.code_path(op, call), str(call.dtype).replace("torch.", "")))
        return real_check(candidate, op, call)

    monkeypatch.setattr(first_use, "run_check", counted)
    verified.forget()
    first_use.forget()
    # auto for CUDA tensors; on CPU it is asked with a stand-in (it reads only is_cuda), then called with CPU tensors
    on_gpu = torch.empty(0, device=DEVICE) if DEVICE.type == "cuda" else SimpleNamespace(
        is_cuda=True, device=torch.device("cuda", 0))
    auto = dispatch.resolve_backend("auto", on_gpu)
    triton = next(c for c in auto.candidates if c.name == "triton")
    yield SimpleNamespace(auto=auto, triton=triton, checks=checks, cache=tmp_path / "cache" / user_cache.CACHE_FILE)
    verified.forget()
    first_use.forget()


def _q(rows: int, dtype=torch.float32, width: int = 16) -> torch.Tensor:
    return torch.randn(rows, width, dtype=dtype, device=DEVICE)


def _records() -> list[dict]:
    return user_cache.read()["checks"]


def test_the_first_call_of_each_kind_is_checked_once(gpu):
    q = _q(8).requires_grad_()
    loss, warned = runtime_warnings(gpu.auto.similarity_xent, q, None, 20.0, "partner", exclude_diagonal=True)
    assert warned == [] and gpu.checks == [("similarity_xent", "fused", "float32")]
    assert gpu.auto.computes("similarity_xent", q, None, 20.0, "partner", exclude_diagonal=True) == ("triton", "fused")
    loss.backward()
    want = dispatch.similarity_xent(q.detach(), None, 20.0, "partner", exclude_diagonal=True, backend="torch")
    assert torch.allclose(loss.detach(), want, rtol=1e-5)
    # 6 rows share 8's bucket and class: the same kind, no check; 12 rows (bucket 16), bf16, another op: checked
    gpu.auto.similarity_xent(_q(6), None, 20.0, "partner", exclude_diagonal=True)
    assert len(gpu.checks) == 1
    gpu.auto.similarity_xent(_q(12), None, 20.0, "partner", exclude_diagonal=True)
    gpu.auto.similarity_xent(_q(8, torch.bfloat16), None, 20.0, "partner", exclude_diagonal=True)
    gpu.auto.similarity_xent(_q(8, torch.bfloat16), None, 20.0, "partner", exclude_diagonal=True)
    x = torch.randn(5, 2, 16, device=DEVICE)
    assert gpu.auto.computes("pair_scores", x, True) == ("triton", "full")
    assert gpu.checks[1:] == [("similarity_xent", "fused", "float32"), ("similarity_xent", "fused", "bfloat16"),
                              ("pair_scores", "full", "float32")]
    records = _records()
    assert [(r["op"], r["dtype"], r["pass"]) for r in records] == [
        ("similarity_xent", "float32", True), ("similarity_xent", "float32", True),
        ("similarity_xent", "bfloat16", True), ("pair_scores", "float32", True)]
    assert [r["bucket"]["M"] for r in records[:3]] == [8, 16, 8]
    first = records[0]
    assert first["gpu"] == "a stand-in GPU" and first["capability"] == "0.1" and first["part"] is None
    assert first["fingerprint"] == verified.code_identity("triton", "similarity_xent", "fused")["fingerprint"]
    assert first["errors"]["grad"] <= first["allowed"]["grad"] and records[2]["eager"] is not None


class _Skewed(torch.autograd.Function):
    """The identity forward, a gradient 1 % too large backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.01


@pytest.mark.parametrize("wrong", ["value", "grad"])
def test_a_wrong_result_is_refused_and_recorded(gpu, monkeypatch, wrong):
    real = gpu.triton.backend.similarity_xent
    planted = []

    def wrong_op(q, c, *rest):
        planted.append(1)
        if wrong == "grad":
            return real(_Skewed.apply(q), c, *rest)
        return real(q, c, *rest) * 1.01

    monkeypatch.setattr(gpu.triton.backend, "similarity_xent", wrong_op)
    q = _q(8)
    first, warned = runtime_warnings(gpu.auto.similarity_xent, q, None, 20.0, "partner")
    second, again = runtime_warnings(gpu.auto.similarity_xent, q, None, 20.0, "partner")
    assert planted == [1]  # the check's call: torch computed both
    want = dispatch.similarity_xent(q, None, 20.0, "partner", backend="torch")
    assert torch.equal(first, want) and torch.equal(second, want)
    assert gpu.auto.computes("similarity_xent", q, None, 20.0, "partner") == ("torch", "default")
    told = [w for w in warned if "for calls like this one" in w]
    assert len(told) == 1 and f"{wrong} error" in told[0] and "failed its first-use check" in told[0]
    assert "--forget-failed" in told[0] and again == []
    auto_on_torch = [w for w in warned if "as it does every op" in w]
    assert len(auto_on_torch) == 1 and "triton: its code path 'fused' failed its first-use check" in auto_on_torch[0]
    (record,) = _records()
    assert record["pass"] is False and record["checker"] == first_use.CHECKER
    assert record["errors"][wrong] > record["allowed"][wrong]
    # a new process (this one, forgetting what it decided) reads the failure: no check, torch, told again
    first_use.forget()
    _, told_again = runtime_warnings(gpu.auto.similarity_xent, q, None, 20.0, "partner")
    assert planted == [1] and len(gpu.checks) == 1 and len(told_again) == 1
    # the records of failed checks removed (verify --forget-failed): the next process checks again
    assert user_cache.forget_failed_checks() == 1 and _records() == []
    first_use.forget()
    runtime_warnings(gpu.auto.similarity_xent, q, None, 20.0, "partner")
    assert planted == [1, 1]


def test_a_path_that_raises_computes_on_torch_in_this_process_and_is_checked_again_by_the_next(gpu, monkeypatch):
    """A GPU path that raises (a missing C compiler, out of memory while loading a kernel: perhaps the environment,
    not the code) is refused for this process, with the warning, and not recorded: the next process checks again."""
    planted = []

    def raising_op(q, c, *rest):
        planted.append(1)
        raise RuntimeError("Triton Error [CUDA]: out of memory")

    monkeypatch.setattr(gpu.triton.backend, "similarity_xent", raising_op)
    q = _q(8)
    first, warned = runtime_warnings(gpu.auto.similarity_xent, q, None, 20.0, "partner")
    second, again = runtime_warnings(gpu.auto.similarity_xent, q, None, 20.0, "partner")
    want = dispatch.similarity_xent(q, None, 20.0, "partner", backend="torch")
    assert torch.equal(first, want) and torch.equal(second, want) and planted == [1] and again == []
    told = [w for w in warned if "for calls like this one" in w]
    assert len(told) == 1 and "it raised RuntimeError: Triton Error [CUDA]: out of memory" in told[0]
    assert "not recorded: an error is this process's alone" in told[0] and "--forget-failed" not in told[0]
    assert _records() == []
    first_use.forget()  # a new process
    runtime_warnings(gpu.auto.similarity_xent, q, None, 20.0, "partner")
    assert planted == [1, 1]


@pytest.mark.parametrize("where", ["scan", "reference"])
def test_a_check_that_cannot_run_leaves_the_call_on_torch_and_records_nothing(gpu, monkeypatch, where):
    """The check's own work raising (out of memory in the finiteness scan, a float64 product failing in the
    reference) never reaches the loss call: the PyTorch backend computes it, the warning says why, nothing is
    recorded."""
    if where == "scan":
        def failing(*_args):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (planted)")
        monkeypatch.setattr(first_use, "_checkable", failing)
    else:
        def failing(*_args, **_kwargs):
            raise RuntimeError("CUBLAS_STATUS_ALLOC_FAILED (planted)")
        monkeypatch.setattr(first_use, "_torch_op", lambda op: failing)
    q = _q(8)
    value, warned = runtime_warnings(gpu.auto.similarity_xent, q, None, 20.0, "partner")
    assert torch.equal(value, dispatch.similarity_xent(q, None, 20.0, "partner", backend="torch"))
    told = [w for w in warned if "for calls like this one" in w]
    what = "ran out of GPU memory" if where == "scan" else "could not run (RuntimeError: CUBLAS_STATUS_ALLOC_FAILED"
    assert len(told) == 1 and what in told[0] and "nothing is recorded" in told[0]
    assert _records() == []


def test_records_of_an_older_check_are_not_used(gpu):
    """A record written by an earlier version of the check (no `checker`, or another one) does not match: the kind
    is checked again and recorded anew."""
    q = _q(8)
    gpu.auto.similarity_xent(q, None, 20.0, "partner")
    (record,) = _records()
    failed_by_an_older_check = {**record, "pass": False, "checker": first_use.CHECKER - 1}
    user_cache.update(lambda contents: contents.update(checks=[failed_by_an_older_check]))
    first_use.forget()
    gpu.auto.similarity_xent(q, None, 20.0, "partner")
    assert len(gpu.checks) == 2 and gpu.auto.computes("similarity_xent", q, None, 20.0, "partner")[0] == "triton"
    assert [r["pass"] for r in _records()] == [False, True]


def test_the_torch_backends_gpu_path_is_checked_on_first_use(gpu, monkeypatch):
    """The torch backend's "mixed" path (16-bit products; its selector here taking it for 16-bit rows on any
    device), verified at large size on another GPU and the only path the table holds: the first bfloat16 call of
    each kind (full width, dims) is checked against the float64 torch backend and recorded, and computes on it; a
    float32 call has no such path and is never checked."""
    from angle_kernels.torch_ops import similarity_xent as torch_xent

    monkeypatch.setattr(torch_xent, "takes_mixed_products", lambda x: x.dtype in (torch.bfloat16, torch.float16))
    here = stand_in_identity("torch", "similarity_xent", "mixed", DEVICE)
    monkeypatch.setattr(verified, "VERIFIED", (verified.entry(
        "torch", "similarity_xent", "mixed", {**here, "capability": "9.0"}, "another GPU's large-size run",
        sizes="large"),))
    verified.forget()
    q = _q(8, torch.bfloat16)
    _, warned = runtime_warnings(gpu.auto.similarity_xent, q, None, 20.0, "partner", exclude_diagonal=True)
    assert warned == [] and gpu.auto.computes("similarity_xent", q, None, 20.0, "partner", exclude_diagonal=True) == (
        "torch", "mixed")
    gpu.auto.similarity_xent(q, None, 20.0, "partner", exclude_diagonal=True, dims=(8, 16))
    assert gpu.checks == 2 * [("similarity_xent", "mixed", "bfloat16")]
    records = _records()
    assert [(r["backend"], r["bucket"]["dims"], r["pass"]) for r in records] == [("torch", False, True),
                                                                                 ("torch", True, True)]
    assert records[0]["fingerprint"] == here["fingerprint"] and "triton" not in records[0]
    assert gpu.auto.computes("similarity_xent", _q(8), None, 20.0, "partner") == ("torch", "default")
    assert len(gpu.checks) == 2


_ANOTHER_PROCESS = """
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, {tests!r})
import test_first_use as here
from angle_kernels import dispatch, first_use, verified

verified.identity = here.stand_in_identity
verified.VERIFIED = here.stand_in_table()


def no_check(*args):
    raise AssertionError("checked again")


first_use.run_check = no_check
on_gpu = torch.empty(0, device=here.DEVICE) if here.DEVICE.type == "cuda" else SimpleNamespace(
    is_cuda=True, device=torch.device("cuda", 0))
auto = dispatch.resolve_backend("auto", on_gpu)
print(auto.computes("similarity_xent", here._q(8), None, 20.0, "partner"))
"""


def test_a_record_is_reused_by_another_process(gpu):
    assert gpu.auto.computes("similarity_xent", _q(8), None, 20.0, "partner") == ("triton", "fused")
    assert len(gpu.checks) == 1 and len(_records()) == 1
    script = _ANOTHER_PROCESS.format(tests=str(Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "('triton', 'fused')"
    assert len(_records()) == 1


def test_a_record_made_while_waiting_for_the_lock_is_used(gpu, monkeypatch):
    """Another process of the job checked the same kind while this one waited for the lock: its record wins."""
    q = _q(8)
    call = contract.check_similarity_xent(q, None, 20.0, "partner", None, False, 0.0, None)
    theirs = {**first_use.kind_of(gpu.triton, "similarity_xent", call), "gpu": "another process", "pass": True}
    real_locked = user_cache.locked

    @contextlib.contextmanager
    def recorded_meanwhile(path=None):
        with real_locked(path):
            contents = user_cache.read()
            contents["checks"].append(theirs)
            user_cache.write_json_atomic(user_cache.cache_file(), contents)
            yield

    monkeypatch.setattr(user_cache, "locked", recorded_meanwhile)
    assert gpu.auto.computes("similarity_xent", q, None, 20.0, "partner") == ("triton", "fused")
    assert gpu.checks == [] and _records() == [theirs]


def test_a_recorded_pass_is_used_when_the_lock_cannot_be_taken(gpu, monkeypatch):
    """A later process whose cache lock cannot be taken (held past the wait by a stopped process, a folder that
    became read-only) still reads the record: the kind computes on the GPU path without being checked again."""
    q = _q(8)
    assert gpu.auto.computes("similarity_xent", q, None, 20.0, "partner") == ("triton", "fused")
    assert len(gpu.checks) == 1 and len(_records()) == 1
    first_use.forget()  # a later process: only the record remains

    def cannot_lock(*args, **kwargs):
        raise OSError("the lock has been held by another process for too long")

    monkeypatch.setattr(user_cache, "locked", cannot_lock)
    assert gpu.auto.computes("similarity_xent", q, None, 20.0, "partner") == ("triton", "fused")
    assert len(gpu.checks) == 1 and len(_records()) == 1


def test_no_check_while_tracing_only_records_count(gpu, monkeypatch):
    q = _q(8)
    monkeypatch.setattr(first_use, "tracing", lambda device: True)
    assert gpu.auto.computes("similarity_xent", q, None, 20.0, "partner") == ("torch", "default")
    assert gpu.checks == [] and not gpu.cache.exists()
    monkeypatch.setattr(first_use, "tracing", lambda device: False)
    assert gpu.auto.computes("similarity_xent", q, None, 20.0, "partner") == ("triton", "fused")  # checked, recorded
    first_use.forget()  # what this process decided: gone; the record stays
    monkeypatch.setattr(first_use, "tracing", lambda device: True)
    assert gpu.auto.computes("similarity_xent", q, None, 20.0, "partner") == ("triton", "fused")
    assert len(gpu.checks) == 1


def test_self_check_0_keeps_verified_paths_only_and_other_values_raise(gpu, monkeypatch):
    monkeypatch.setenv(first_use.ENV, "0")
    q = _q(8)
    _, warned = runtime_warnings(gpu.auto.similarity_xent, q, None, 20.0, "partner")
    assert gpu.auto.computes("similarity_xent", q, None, 20.0, "partner") == ("torch", "default")
    assert gpu.checks == [] and not gpu.cache.exists()
    assert len(warned) == 1 and f"first-use checks are off: {first_use.ENV}=0" in warned[0]
    monkeypatch.setenv(first_use.ENV, "yes")
    first_use.forget()
    with pytest.raises(ValueError, match=first_use.ENV):
        gpu.auto.similarity_xent(q, None, 20.0, "partner")


def test_a_path_no_gpu_verified_at_large_size_is_never_checked(gpu):
    x = torch.randn(4, 2, 16, device=DEVICE)
    _, warned = runtime_warnings(gpu.auto.pair_scores, x, True, (8, 16))
    assert gpu.auto.computes("pair_scores", x, True, (8, 16)) == ("torch", "default")
    assert gpu.checks == [] and not gpu.cache.exists()
    assert len(warned) == 1 and "its code path 'dims' has not passed a correctness run on a stand-in GPU" in warned[0]
    assert "first-use" not in warned[0].split("(", 1)[1]


def test_an_oversized_call_is_checked_on_a_part_of_the_same_bucket(gpu, monkeypatch):
    monkeypatch.setattr(first_use, "ELEMENT_BUDGET", 18 * 16)  # 24 rows of 16 are too many, 18 fit
    q = _q(24, torch.bfloat16)
    assert gpu.auto.computes("similarity_xent", q, None, 20.0, "partner") == ("triton", "fused")
    (record,) = _records()
    assert record["part"] == "the first 18 of 24 rows" and record["pass"] is True and record["bucket"]["M"] == 32
    monkeypatch.setattr(first_use, "ELEMENT_BUDGET", 16 * 16)  # 16 rows would leave the bucket: not checked
    _, warned = runtime_warnings(gpu.auto.similarity_xent, _q(24), None, 20.0, "partner")
    assert len(gpu.checks) == 1 and len(_records()) == 1
    assert len(warned) == 2 and all("too large for a first-use check" in w for w in warned)


def _bucket_and_path(triton, op, call):
    path = triton.code_path(op, call)
    return first_use.bucket("triton", op, path, call), path


@pytest.mark.parametrize("call, part_shapes, what", [
    # in-batch negatives at the target size: D = 768 whole, D = 4,096 on just over half the rows (bucket 32,768)
    (("similarity_xent", (32768, 768), None, "partner"), None, None),
    (("similarity_xent", (32768, 4096), None, "partner"), [(16400, 4096)], "the first 16,400 of 32,768 rows"),
    # Matryoshka at D = 4,096: N queries against 2N candidates, rows of both
    (("similarity_xent", (16384, 4096), (32768, 4096), "diagonal", (512, 1024, 2048, 4096)),
     [(8208, 4096), (16400, 4096)], "the first 8,208 of 16,384 rows of q and 16,400 of 32,768 rows of c"),
    (("pair_scores", (1 << 20, 2, 4096)), [(16384, 2, 4096)], "the first 16,384 of 1,048,576 groups"),
    (("ranking_loss", ((1 << 28) + 3,)), [((1 << 27) - 1,)], "the first 134,217,727 of 268,435,459 scores"),
])
def test_the_part_of_an_oversized_call_keeps_its_code_path_and_bucket(call, part_shapes, what):
    triton = dispatch.Ops("triton", dispatch.raw_backend("triton"))
    meta = {"device": "meta", "dtype": torch.bfloat16}
    op = call[0]
    if op == "similarity_xent":
        q, c = torch.empty(call[1], **meta), None if call[2] is None else torch.empty(call[2], **meta)
        dims = call[4] if len(call) > 4 else None
        checked = contract.check_similarity_xent(q, c, 20.0, call[3], None, c is None, 0.0, None, dims)
    elif op == "pair_scores":
        checked = contract.check_pair_scores(torch.empty(call[1], **meta), True)
    else:
        scores = torch.empty(call[1], device="meta", dtype=torch.float32)
        checked = contract.check_ranking_loss(scores, torch.empty(call[1], device="meta", dtype=torch.int64))
    part, described = first_use.checked_part(triton, op, checked)
    assert described == what
    if part_shapes is None:
        assert part is checked
        return
    leaves = [getattr(part, name) for name in first_use.LEAVES[op] if getattr(part, name) is not None]
    assert [tuple(leaf.shape) for leaf in leaves] == part_shapes
    assert _bucket_and_path(triton, op, part) == _bucket_and_path(triton, op, checked)
    elements, flops = first_use._cost(op, part)
    assert elements <= first_use.ELEMENT_BUDGET and flops <= first_use.FLOP_BUDGET


def test_no_part_when_even_the_smallest_leaves_the_budget(monkeypatch):
    triton = dispatch.Ops("triton", dispatch.raw_backend("triton"))
    q = torch.empty(32768, 4096, device="meta", dtype=torch.bfloat16)
    call = contract.check_similarity_xent(q, None, 20.0, "partner", None, True, 0.0, None)
    monkeypatch.setattr(first_use, "ELEMENT_BUDGET", 16384 * 4096)  # the bucket needs more than 16,384 rows
    assert first_use.checked_part(triton, "similarity_xent", call) is None


def test_a_cache_that_cannot_be_written_still_checks_for_the_process(gpu, monkeypatch, tmp_path):
    not_a_folder = tmp_path / "a file"
    not_a_folder.write_text("")
    monkeypatch.setenv(user_cache.CACHE_ENV, str(not_a_folder))
    q = _q(8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert gpu.auto.computes("similarity_xent", q, None, 20.0, "partner") == ("triton", "fused")
        assert gpu.auto.computes("similarity_xent", q, None, 20.0, "partner") == ("triton", "fused")
        assert gpu.auto.computes("similarity_xent", _q(64), None, 20.0, "partner") == ("triton", "fused")
    assert len(gpu.checks) == 2 and not_a_folder.read_text() == ""
    # a passing check that cannot be recorded says so once, naming the file and the way out (before: nothing, and
    # every process paid the checks again)
    unrecorded = [str(w.message) for w in caught if "not recorded" in str(w.message)]
    assert len(unrecorded) == 1 and str(not_a_folder / user_cache.CACHE_FILE) in unrecorded[0]
    assert user_cache.CACHE_ENV in unrecorded[0]
    # under tracing (torch.compile, CUDA-graph capture) the process's own eager decision holds, recorded or not
    monkeypatch.setattr(first_use, "tracing", lambda device: True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert gpu.auto.computes("similarity_xent", q, None, 20.0, "partner") == ("triton", "fused")


# ---------------------------------------------------------------------------------------------------------
# The check as the caller's mode and inputs would not change it
# ---------------------------------------------------------------------------------------------------------
def _first_calls(auto, q, c):
    """A first call of every op and of similarity_xent's and similarity_lse's tensor options (row weights, group
    ids, a filter on the model's own scores with its thresholds), each a kind of its own."""
    rows = q.shape[0]
    yield lambda: auto.similarity_xent(q, None, 20.0, "partner", row_weights=torch.ones(rows, device=DEVICE))
    yield lambda: auto.similarity_xent(q, None, 20.0, "partner", exclude_diagonal=True,
                                       group_ids=torch.arange(rows, device=DEVICE))
    yield lambda: auto.similarity_lse(q, c, 20.0, filter_q=q.detach(), filter_c=c.detach(),
                                      filter_threshold=torch.full((rows,), 0.5, device=DEVICE))
    yield lambda: auto.pair_scores(q.reshape(rows // 2, 2, -1), True)[0].sum()
    yield lambda: auto.ranking_loss(q[:, 0] * 5, torch.arange(rows, device=DEVICE).float())


def test_a_first_call_in_inference_mode_checks_as_any_other(gpu):
    """Inside torch.inference_mode (a validation step) the call's other tensors are inference tensors, which an
    autograd Function cannot save: the check makes them outside inference mode (before: 'Inference tensors cannot
    be saved for backward', recorded as the path's failure, and every later process kept off it)."""
    q, c = _q(8), _q(8)
    with torch.inference_mode():
        results = [call() for call in _first_calls(gpu.auto, q, c)]
    assert all(torch.isfinite(r).all() for r in results)
    assert [(r["op"], r["pass"], r.get("error")) for r in _records()] == [
        ("similarity_xent", True, None), ("similarity_xent", True, None), ("similarity_lse", True, None),
        ("pair_scores", True, None), ("ranking_loss", True, None)]


def test_a_first_call_inside_activation_checkpointing_saves_what_later_calls_save(gpu):
    """Non-reentrant torch.utils.checkpoint counts the tensors a region saves and compares the count when it
    recomputes the region: the check (its autograd and its input checks) saves nothing under the caller's hooks
    (before: the check's backward started the region's recomputation, both failed and were recorded, and the
    caller's backward raised CheckpointError)."""
    from torch.utils.checkpoint import checkpoint

    q, c = _q(8).requires_grad_(), _q(8).requires_grad_()
    for call in _first_calls(gpu.auto, q, c):
        saved = []
        for _ in range(2):  # the first call of its kind (checked) and the second
            count = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(1) or t, lambda t: t)
            with count:
                call()
            saved.append("|")
        assert "".join(map(str, saved)).split("|")[:2] == ["1" * saved.index("|")] * 2
    first_use.forget()
    user_cache.forget()
    loss = checkpoint(lambda x: gpu.auto.similarity_xent(x * 2, None, 20.0, "partner"), q, use_reentrant=False)
    loss.backward()
    assert [(r["op"], r["pass"]) for r in _records()] == [("similarity_xent", True)] and q.grad.isfinite().all()


def test_the_check_runs_the_calls_layout_and_filter_route(gpu, monkeypatch):
    """The kernels are specialised on the strides and the 16-byte alignment of their inputs (the bucket holds
    them), and similarity_lse takes a route of its own for a filter on the model's own rows (a filter that is q and
    c): the check runs the candidate on copies in the call's layout and with its filter as the copies' rows (before:
    contiguous aligned clones, and a filter of other rows)."""
    seen = []
    real = gpu.triton.backend.similarity_lse

    def spy(q, c, *args):
        names = contract.SimilarityLseCall._names
        filter_q, filter_c = (args[names.index(name) - 2] for name in ("filter_q", "filter_c"))
        seen.append((first_use._layout(q), filter_q.data_ptr() == q.data_ptr(), filter_c.data_ptr() == c.data_ptr()))
        return real(q, c, *args)

    monkeypatch.setattr(gpu.triton.backend, "similarity_lse", spy)
    threshold = torch.full((8,), 0.5, device=DEVICE)
    base = _q(8, width=40)
    q, c = base[:, 1:33], _q(8, width=32)  # a row stride of 40 (neither 1 nor 16k), 4 bytes past alignment
    gpu.auto.similarity_lse(q, c, 20.0, filter_q=q, filter_c=c, filter_threshold=threshold)
    assert len(gpu.checks) == 1 and seen == [("n.1.unaligned", True, True)] * 2  # the check's call, the caller's
    # a query_to_query block: q is c, and each filter is its own side's rows
    seen.clear()
    q = _q(12)
    gpu.auto.similarity_lse(q, q, 20.0, filter_q=q, filter_c=q, filter_threshold=torch.full((12,), 0.5,
                                                                                             device=DEVICE))
    assert len(gpu.checks) == 2 and seen == [("16.1", True, True)] * 2
    # a Matryoshka prefix of wide rows is copied in strides of its classes, not with the rows' whole width
    wide = _q(64, width=1024)[:, :32]
    fresh = first_use._fresh(wide)
    assert first_use._layout(fresh) == first_use._layout(wide) and torch.equal(fresh, wide)
    assert fresh.untyped_storage().nbytes() <= 2 * wide.numel() * wide.element_size()


def test_a_call_with_a_nan_in_any_of_its_tensors_is_not_checked(gpu):
    """A NaN row weight or filter threshold is the caller's: the call is not checked and nothing is recorded (the
    next call of its kind is checked); before, only the leaves were looked at and the failure was recorded."""
    q, c = _q(8), _q(8)
    weights = torch.ones(8, device=DEVICE)
    weights[3] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpu.auto.similarity_xent(q, None, 20.0, "partner", row_weights=weights)
        gpu.auto.similarity_lse(q, c, 20.0, filter_q=q, filter_c=c,
                                filter_threshold=torch.tensor([float("nan")] * 8, device=DEVICE))
    assert gpu.checks == [] and _records() == []


def test_tf32_is_part_of_the_kind_on_every_path_whose_products_torch_makes():
    """The dense schemes' products are torch.mm's, which torch's TF32 switch governs (dense_dims had followed the
    fused kernels' ANGLE_KERNELS_ALLOW_TF32: a check in IEEE products covered TF32 runs)."""
    saved = torch.backends.cuda.matmul.allow_tf32  # a property of torch's module: no monkeypatch
    try:
        for path in first_use.TORCH_PRODUCT_PATHS:
            precisions = []
            for allowed in (False, True):
                torch.backends.cuda.matmul.allow_tf32 = allowed
                precisions.append(first_use._precision(torch.float32, path))
            assert precisions == ["ieee", "tf32"], path
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    assert set(first_use.TORCH_PRODUCT_PATHS) >= {"dense", "dense_dims"}


def test_a_record_of_another_shape_is_read_as_a_failure_not_an_error():
    """Reading never raises: a record whose errors are not an object (another version's, a hand edit)."""
    outcome = first_use._from_record({"pass": False, "path": "fused", "errors": [1.0], "allowed": "x"})
    assert not outcome.computes and "failed" in outcome.why


def test_every_op_names_its_differentiable_fields():
    """A new op's first-use check reads LEAVES[op] (docs/adding-a-loss.md lists it among the tables every op joins)."""
    assert set(first_use.LEAVES) == set(contract.OPS)
    calls = {call.op: call for call in contract.Call.__subclasses__()}
    for op, fields in first_use.LEAVES.items():
        assert set(fields) <= set(calls[op]._names), op

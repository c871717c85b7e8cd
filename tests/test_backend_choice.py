"""How backend="auto" chooses for CUDA tensors, on a CPU-only machine: the default is the verified path.

resolve_backend only reads `is_cuda` (and `device` for messages) from its tensors, so a tiny stand-in object
plays a CUDA tensor there, and `PretendCuda` (a CPU tensor that says it is on CUDA) where an op must run; the
optional backends are fake modules whose is_available() records how it was asked and whose ops record their
calls before computing with the torch backend's; `verified.is_verified` is replaced by a set of verified (backend,
op, path) (the match rule itself: tests/test_verified.py). Checked: auto on CPU tensors is torch without probing;
on CUDA tensors it computes each call on the first GPU backend verified for its op and code path, and on torch
otherwise with one warning per process that names the reasons and `python -m angle_kernels.verify`; an explicit
GPU backend runs unverified code with one warning per (backend, op, path); auto never asks the CUDA backend for its
JIT build, an explicit backend="cuda" does, and the answers of the two kinds of request are cached apart. Then the
same rule one level down: cuda_ops.is_available / _extension.load with allow_build=False never build.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

import angle_kernels.cuda_ops as cuda_ops
from angle_kernels import contract, dispatch, first_use, measured, path_switches, user_cache, verified
from angle_kernels.cuda_ops import _extension
from angle_kernels.testing.helpers import runtime_warnings

FAKE_CUDA_TENSOR = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))


class PretendCuda(torch.Tensor):
    """A CPU tensor that answers is_cuda=True: an op's CUDA-only bookkeeping runs, its maths runs on CPU."""

    @property
    def is_cuda(self):
        return True


def pretend_cuda(t: torch.Tensor) -> torch.Tensor:
    return torch.Tensor._make_subclass(PretendCuda, t)


class FakeBackend(ModuleType):
    """A backend module whose is_available() answers `answer` and records the allow_build it was given."""

    def __init__(self, name: str, answer: tuple[bool, str], takes_allow_build: bool):
        super().__init__(name)
        self.answer = answer
        self.calls: list[bool | None] = []
        if takes_allow_build:
            self.is_available = self._is_available_with_build
        else:
            self.is_available = self._is_available

    def _is_available(self):
        self.calls.append(None)
        return self.answer

    def _is_available_with_build(self, allow_build: bool = True):
        self.calls.append(allow_build)
        return (True, "") if allow_build and self.answer[0] is None else self.answer


def _fake_op_module(backend: str, op: str, computed: list) -> ModuleType:
    """The backend's module for `op`: records (backend, op) and computes with the torch backend's op. Its code
    paths are those of the real Triton similarity_xent's kind: "dims" with dims, else "fused"."""
    module = ModuleType(f"{backend}.{op}")
    torch_op = getattr(dispatch.raw_backend("torch"), op)

    def run(*args):
        computed.append((backend, op))
        return torch_op(*args)

    setattr(module, op, run)
    if op in ("pair_scores", "similarity_xent"):
        module.FEATURES = ("dims",)
        module.PATHS = ("fused", "dims")
        module.code_path = lambda *args: "fused" if args[-1] is None else "dims"
    else:
        module.PATHS = ("fused",)
    return module


@pytest.fixture
def backends(monkeypatch):
    """Fresh dispatch caches, fake triton / cuda backends (set `.answer` on them before resolving) and a set of
    verified (backend, op, path), `.verified` (empty: nothing has passed on a GPU).

    The fake cuda backend's answer (None, why) means "compiled only if a build is allowed": without one it
    answers (False, why), with one it builds and is available. `.computed` lists the (backend, op) of every call.
    """
    computed: list = []
    triton = FakeBackend("fake_triton_backend", (True, ""), takes_allow_build=False)
    cuda = FakeBackend("fake_cuda_backend", (None, "no prebuilt angle_kernels._C (fake)"), takes_allow_build=True)
    for module, name in ((triton, "triton"), (cuda, "cuda")):
        monkeypatch.setitem(sys.modules, module.__name__, module)
        module.op_modules = {op: _fake_op_module(name, op, computed) for op in contract.OPS}
        module.load_ops = lambda module=module: dict(module.op_modules)  # what a backend package's __init__ names
    monkeypatch.setattr(dispatch, "_PACKAGES", {"torch": "angle_kernels.torch_ops", "triton": triton.__name__,
                                                "cuda": cuda.__name__})
    monkeypatch.setattr(dispatch, "_loaded", {"torch": (dispatch._TORCH_OPS, "")})
    monkeypatch.setattr(dispatch, "_loaded_without_build", {})
    monkeypatch.setattr(dispatch, "_warned_unverified", set())
    monkeypatch.setattr(dispatch, "_warned_auto_on_gpu", False)
    monkeypatch.setattr(dispatch, "_auto_ops", {})
    monkeypatch.delenv("ANGLE_KERNELS_BACKEND", raising=False)
    passed: set = set()
    monkeypatch.setattr(verified, "is_verified", lambda backend, op, path, device: (backend, op, path) in passed)
    monkeypatch.setattr(verified, "describe", lambda backend, op, path, device: "a fake GPU (sm_90)")
    monkeypatch.setattr(measured, "capability", lambda device: "fake")  # no measured speeds: the fixed order
    # the fixed order's mechanism with one exception (the real table's:
    # test_cuda_similarity_ops_wait_behind_torch_where_no_time_decides)
    monkeypatch.setattr(measured, "AFTER_TORCH", {("cuda", "similarity_xent")})
    return SimpleNamespace(triton=triton, cuda=cuda, verified=passed, computed=computed)


def _scores():
    return pretend_cuda(torch.randn(6, dtype=torch.float64)), torch.arange(6) % 3


def _embeddings():
    return pretend_cuda(torch.randn(6, 8, dtype=torch.float64))


def test_auto_on_cpu_tensors_is_torch_without_probing_or_warning(backends):
    ops, warned = runtime_warnings(dispatch.resolve_backend, "auto", torch.zeros(2, 3))
    assert ops.name == "torch"
    assert warned == []
    assert backends.triton.calls == [] and backends.cuda.calls == []


def test_resolve_backend_without_tensors_says_it_needs_them():
    """The README's way to ask which backend computes a call starts from resolve_backend(requested, *tensors): called
    without the tensors, whose device decides, it says so rather than failing on an empty tuple's index."""
    with pytest.raises(TypeError, match=r"takes the tensors the ops will compute on .* got none"):
        dispatch.resolve_backend("auto")


def test_auto_on_cuda_computes_with_torch_until_a_gpu_backend_is_verified(backends):
    """Triton loads and implements every op, but nothing has passed on this GPU: every call is torch's, with one
    warning per process naming why and how to verify."""
    auto = dispatch.resolve_backend(None, FAKE_CUDA_TENSOR)
    assert auto.name == "auto"
    (first, warned) = runtime_warnings(auto.ranking_loss, *_scores())
    assert backends.computed == []  # the fakes record only GPU calls: torch's own op computed it
    assert len(warned) == 1
    message = warned[0]
    assert "PyTorch backend" in message and "python -m angle_kernels.verify" in message
    assert "triton: its code path 'fused' has not passed a correctness run on a fake GPU (sm_90)" in message
    assert "cuda: no prebuilt angle_kernels._C (fake)" in message  # not loaded, with the reason
    assert "ANGLE_KERNELS_BACKEND" in message
    for call in (lambda: auto.ranking_loss(*_scores()), lambda: auto.similarity_xent(_embeddings(), None, 20.0,
                                                                                        "partner")):
        _, warned = runtime_warnings(call)
        assert warned == []  # once per process
    assert backends.computed == []
    assert backends.cuda.calls == [False]  # asked without building, once


def test_auto_uses_a_gpu_backend_for_exactly_the_verified_ops_and_paths(backends):
    backends.cuda.answer = (True, "")  # a prebuilt extension
    backends.verified.update({("triton", "similarity_xent", "dims"), ("cuda", "similarity_xent", "fused"),
                              ("cuda", "ranking_loss", "fused")})
    auto = dispatch.resolve_backend("auto", FAKE_CUDA_TENSOR)
    q = _embeddings()
    auto.similarity_xent(q, None, 20.0, "partner", dims=(4, 8))  # triton, verified for dims
    # triton's fused path is not verified, cuda's is, and its scheme comes after torch (measured.AFTER_TORCH)
    auto.similarity_xent(q, None, 20.0, "partner")
    auto.ranking_loss(*_scores())  # cuda
    _, warned = runtime_warnings(auto.pair_scores, q.view(3, 2, 8), True)  # nobody's: torch, warning
    assert backends.computed == [("triton", "similarity_xent"), ("cuda", "ranking_loss")]
    assert len(warned) == 1 and "pair_scores" in warned[0]
    assert auto.computes("similarity_xent", q, None, 20.0, "partner", dims=(4, 8)) == ("triton", "dims")
    assert auto.computes("similarity_xent", q, None, 20.0, "partner") == ("torch", "default")
    assert auto.computes("pair_scores", q.view(3, 2, 8), True) == ("torch", "default")


def test_explicit_gpu_backend_runs_unverified_code_with_one_warning_per_op_and_path(backends):
    backends.verified.add(("triton", "similarity_xent", "dims"))
    triton = dispatch.resolve_backend("triton", FAKE_CUDA_TENSOR)
    q = _embeddings()
    messages = []
    for dims in (None, None, (4, 8), (4, 8)):
        _, warned = runtime_warnings(triton.similarity_xent, q, None, 20.0, "partner", dims=dims)
        messages.append(warned)
    _, on_cpu = runtime_warnings(triton.similarity_xent, torch.randn(6, 8, dtype=torch.float64), None, 20.0,
                                    "partner")
    assert backends.computed == 5 * [("triton", "similarity_xent")]  # it runs what it is asked, every time
    assert len(messages[0]) == 1 and messages[1:] == [[], [], []]  # fused: once; dims: verified, never
    assert "backend='triton' computes similarity_xent on its code path 'fused'" in messages[0][0]
    assert "a fake GPU (sm_90)" in messages[0][0] and "python -m angle_kernels.verify" in messages[0][0]
    assert on_cpu == []  # CPU tensors (the interpreter): no verification applies


def test_an_explicit_backend_warns_about_the_code_path_the_call_takes(backends):
    """The warning is about the path the call runs, not the op's first: with the fused path verified, a call with
    dims runs the unverified dims path and warns, naming it."""
    backends.verified.add(("triton", "similarity_xent", "fused"))
    triton = dispatch.resolve_backend("triton", FAKE_CUDA_TENSOR)
    q = _embeddings()
    _, fused = runtime_warnings(triton.similarity_xent, q, None, 20.0, "partner")
    _, dims = runtime_warnings(triton.similarity_xent, q, None, 20.0, "partner", dims=(4, 8))
    assert fused == [] and len(dims) == 1
    assert "backend='triton' computes similarity_xent on its code path 'dims'" in dims[0]


def test_explicit_triton_on_cpu_tensors_never_warns_of_a_gpu_verification(backends):
    """CPU tensors under the Triton interpreter: no GPU verification applies, so even the first call of a path
    verified nowhere computes silently."""
    triton = dispatch.resolve_backend("triton", FAKE_CUDA_TENSOR)
    _, warned = runtime_warnings(triton.similarity_xent, torch.randn(6, 8, dtype=torch.float64), None, 20.0,
                                    "partner")
    assert warned == [] and backends.computed == [("triton", "similarity_xent")]


def test_a_path_verified_here_computes_without_a_first_use_check(backends, monkeypatch):
    """A first-use check is for paths not verified here: a verified path computes unchecked even where its code
    could be checked (it passed the large-size checks elsewhere), while the unverified path of the same op is
    checked on its first call."""
    checked = []
    monkeypatch.setattr(first_use, "may_check", lambda *args: True)
    monkeypatch.setattr(first_use, "decide", lambda candidate, op, call, path: (
        checked.append((candidate.name, op, path)) or first_use.Outcome(True)))
    backends.verified.add(("triton", "similarity_xent", "fused"))
    auto = dispatch.resolve_backend("auto", FAKE_CUDA_TENSOR)
    q = _embeddings()
    auto.similarity_xent(q, None, 20.0, "partner")
    assert checked == [] and backends.computed == [("triton", "similarity_xent")]
    auto.similarity_xent(q, None, 20.0, "partner", dims=(4, 8))
    assert checked == [("triton", "similarity_xent", "dims")]
    assert backends.computed == 2 * [("triton", "similarity_xent")]


@pytest.fixture
def torch_gpu_path(monkeypatch):
    """The torch similarity_xent's selector answering "mixed" for 16-bit rows on any device, so that PretendCuda
    bfloat16 calls have the torch backend's GPU path (which on the CPU converts its operands to float32 for each
    product: the same values)."""
    from angle_kernels.torch_ops import similarity_xent as torch_xent

    monkeypatch.setattr(torch_xent, "takes_mixed_products", lambda x: x.dtype in (torch.bfloat16, torch.float16))


def test_the_torch_backends_gpu_path_computes_only_where_it_may(backends, torch_gpu_path):
    """A bfloat16 call on a GPU has the torch backend's "mixed" path (16-bit products), which needs a verification;
    its "default" path (float32 products) never does. Unverified: auto computes on the default path, its one
    warning naming the torch path's reason too; an explicit "torch" computes there silently; what verify checks
    (path_ops) takes "mixed". Verified: auto and an explicit "torch" take "mixed", silently, for full-width and dims
    calls alike; a float64 call stays on "default"."""
    backends.triton.answer = (False, "no triton here (fake)")
    q16, q64 = pretend_cuda(torch.randn(6, 8).bfloat16()), _embeddings()
    auto = dispatch.resolve_backend("auto", FAKE_CUDA_TENSOR)
    explicit = dispatch.resolve_backend("torch", FAKE_CUDA_TENSOR)
    assert dispatch.resolve_backend("torch", torch.zeros(2)) is dispatch._TORCH_OPS  # CPU tensors: default only
    for ops in (auto, explicit):
        assert ops.computes("similarity_xent", q16, None, 20.0, "partner") == ("torch", "default")
    default_loss, warned = runtime_warnings(auto.similarity_xent, q16, None, 20.0, "partner")
    assert len(warned) == 1 and "torch: its code path 'mixed' has not passed a correctness run" in warned[0]
    assert runtime_warnings(explicit.similarity_xent, q16, None, 20.0, "partner")[1] == []
    assert dispatch.path_ops("torch", FAKE_CUDA_TENSOR).computes("similarity_xent", q16, None, 20.0, "partner") == (
        "torch", "mixed")

    backends.verified.add(("torch", "similarity_xent", "mixed"))
    for ops in (auto, explicit):
        assert ops.computes("similarity_xent", q16, None, 20.0, "partner") == ("torch", "mixed")
        assert ops.computes("similarity_xent", q16, None, 20.0, "partner", dims=(4, 8)) == ("torch", "mixed")
        assert ops.computes("similarity_xent", q64, None, 20.0, "partner") == ("torch", "default")
        assert ops.computes("pair_scores", q16.view(3, 2, 8), True) == ("torch", "default")
        mixed_loss, warned = runtime_warnings(ops.similarity_xent, q16, None, 20.0, "partner")
        assert warned == [] and torch.allclose(mixed_loss, default_loss, rtol=1e-5)
    assert backends.computed == []  # the fake GPU backends computed nothing


def test_the_torch_backends_gpu_path_comes_after_the_gpu_backends(backends, torch_gpu_path):
    """Where Triton's path and the torch backend's GPU path are both verified, the fixed order takes Triton; where
    the CUDA scheme comes after torch (measured.AFTER_TORCH), it comes after both of torch's paths."""
    backends.cuda.answer = (True, "")
    backends.verified.update({("torch", "similarity_xent", "mixed"), ("cuda", "similarity_xent", "fused")})
    auto = dispatch.resolve_backend("auto", FAKE_CUDA_TENSOR)
    q16 = pretend_cuda(torch.randn(6, 8).bfloat16())
    assert auto.computes("similarity_xent", q16, None, 20.0, "partner") == ("torch", "mixed")
    backends.verified.add(("triton", "similarity_xent", "fused"))
    assert auto.computes("similarity_xent", q16, None, 20.0, "partner") == ("triton", "fused")
    torch_paths = [dispatch._TORCH_GPU_OPS, dispatch._TORCH_OPS]
    cuda = next(c for c in auto.candidates if c.name == "cuda")
    assert measured.fixed_order("similarity_xent", [cuda, *torch_paths]) == [*torch_paths, cuda]


def test_the_fixed_order_traces_in_one_graph():
    """`auto` orders its candidates inside a compiled model's graph on a GPU: torch.compile(fullgraph=True) must
    trace measured.fixed_order (before: max() over a generator, which dynamo cannot trace, failed every fullgraph
    compile of a loss with backend="auto" on a GPU)."""
    import torch._dynamo

    class Candidate:  # as dispatch.Ops: a Python object with a name (SimpleNamespace compares in C, untraced)
        def __init__(self, name):
            self.name = name

    triton, cuda, torch_gpu, torch_default = (Candidate(name) for name in ("triton", "cuda", "torch", "torch"))
    allowed = [triton, cuda, torch_gpu, torch_default]

    def ordered_scale(x):
        order = measured.fixed_order("similarity_xent", allowed)
        return x * (order.index(cuda) + 1)

    torch._dynamo.reset()
    compiled = torch.compile(ordered_scale, fullgraph=True, backend="eager")
    assert float(compiled(torch.ones(()))) == 4.0  # cuda behind both of torch's paths
    assert measured.fixed_order("similarity_xent", allowed) == [triton, torch_gpu, torch_default, cuda]


def test_auto_warns_with_the_reason_a_backend_is_unavailable_and_never_builds(backends):
    backends.triton.answer = (False, "triton does not import: ImportError: fake libcuda mismatch")
    auto = dispatch.resolve_backend("auto", FAKE_CUDA_TENSOR)
    _, warned = runtime_warnings(auto.ranking_loss, *_scores())
    assert len(warned) == 1 and "fake libcuda mismatch" in warned[0] and "no prebuilt angle_kernels._C" in warned[0]
    for _ in range(3):  # cached: neither probed again nor warned again
        assert dispatch.resolve_backend("auto", FAKE_CUDA_TENSOR) is auto
        assert runtime_warnings(auto.ranking_loss, *_scores())[1] == []
    assert backends.triton.calls == [None] and backends.cuda.calls == [False]


def test_auto_reports_a_backend_that_raises_while_probed(backends):
    def broken():
        raise OSError("libtriton.so: cannot open shared object file")

    backends.triton.is_available = broken
    auto = dispatch.resolve_backend("auto", FAKE_CUDA_TENSOR)
    assert auto.candidates == []
    _, warned = runtime_warnings(auto.ranking_loss, *_scores())
    assert "OSError" in warned[0] and "libtriton.so" in warned[0]


def test_a_backend_whose_op_module_fails_to_import_is_reported(backends, monkeypatch):
    """An available backend whose kernels do not import (a Triton API change, a missing dependency) is passed
    over with the import error as the reason, and an explicit request for it raises with that reason."""
    monkeypatch.setitem(sys.modules, "fake_kernel_dependency", None)  # what the op module imports is missing

    def load_ops():  # as a backend's load_ops() fails when its `from . import ranking_loss` does
        import fake_kernel_dependency  # noqa: F401

    monkeypatch.setattr(backends.triton, "load_ops", load_ops)
    auto = dispatch.resolve_backend("auto", FAKE_CUDA_TENSOR)
    _, warned = runtime_warnings(auto.ranking_loss, *_scores())
    assert "fake_kernel_dependency" in warned[0], warned
    with pytest.raises(RuntimeError, match="backend .triton. is not available here: .*fake_kernel_dependency"):
        dispatch.resolve_backend("triton", FAKE_CUDA_TENSOR)


def test_an_op_a_backend_lacks_goes_to_torch_under_auto_and_is_refused_when_explicit(backends, monkeypatch):
    """A backend without a module for an op (an op it does not implement yet) still serves its other ops; "auto"
    computes the missing one elsewhere even where everything is verified; an explicit request raises a ValueError
    naming the op."""
    monkeypatch.delitem(backends.triton.op_modules, "ranking_loss")  # load_ops() names no such module
    backends.verified.update({("triton", "ranking_loss", "fused"), ("triton", "similarity_xent", "fused")})
    auto = dispatch.resolve_backend("auto", FAKE_CUDA_TENSOR)
    scores, labels = _scores()
    first, warned = runtime_warnings(auto.ranking_loss, scores, labels)
    auto.similarity_xent(_embeddings(), None, 20.0, "partner")
    assert backends.computed == [("triton", "similarity_xent")]
    assert len(warned) == 1 and "triton: it does not implement ranking_loss yet" in warned[0]
    assert torch.equal(first, dispatch.ranking_loss(scores, labels, backend="torch"))
    explicit = dispatch.resolve_backend("triton", FAKE_CUDA_TENSOR)
    with pytest.raises(ValueError, match="backend 'triton' does not implement ranking_loss"):
        explicit.ranking_loss(scores, labels)


def test_a_feature_never_moves_a_call_from_a_gpu_backend_to_torch(backends, monkeypatch):
    """takes_in_one_call: a loss uses an optional feature (similarity_lse's dims) in one call only where that call
    stays on the backend the call without it would take; else it makes one call per prefix (terms.py)."""
    q, c = _embeddings(), pretend_cuda(torch.randn(9, 8, dtype=torch.float64))

    def one_call(ops):
        return ops.takes_in_one_call("similarity_lse", q, c, 20.0, dims=(4, 8))

    auto = dispatch.resolve_backend("auto", FAKE_CUDA_TENSOR)
    assert one_call(auto)  # nothing verified: torch with or without dims
    backends.verified.add(("triton", "similarity_lse", "fused"))
    assert not one_call(auto)  # triton lacks dims: the per-prefix calls stay on its verified kernels
    module = backends.triton.op_modules["similarity_lse"]
    monkeypatch.setattr(module, "FEATURES", ("dims",), raising=False)
    monkeypatch.setattr(module, "PATHS", ("fused", "dims"))
    monkeypatch.setattr(module, "code_path", lambda *args: "fused" if args[-1] is None else "dims", raising=False)
    for cache in ("_loaded_without_build", "_auto_ops"):  # the backend loaded again, with its new declarations
        monkeypatch.setattr(dispatch, cache, {})
    auto = dispatch.resolve_backend("auto", FAKE_CUDA_TENSOR)
    assert not one_call(auto)  # its dims path is not verified: with dims the call would go to torch
    backends.verified.add(("triton", "similarity_lse", "dims"))
    assert one_call(auto)
    assert one_call(dispatch.resolve_backend("torch", torch.zeros(1)))
    assert one_call(auto) and auto.takes_in_one_call("similarity_lse", q, c, 20.0)  # no feature: nothing moves


def test_auto_uses_a_prebuilt_cuda_extension_without_building(backends):
    backends.triton.answer = (False, "no triton (fake)")
    backends.cuda.answer = (True, "")
    backends.verified.add(("cuda", "ranking_loss", "fused"))
    auto = dispatch.resolve_backend("auto", FAKE_CUDA_TENSOR)
    assert [c.name for c in auto.candidates] == ["cuda"]
    _, warned = runtime_warnings(auto.ranking_loss, *_scores())
    assert warned == [] and backends.computed == [("cuda", "ranking_loss")]
    assert backends.cuda.calls == [False]


def test_explicit_cuda_builds_even_after_auto_found_it_unbuilt(backends):
    backends.triton.answer = (False, "no triton (fake)")
    assert dispatch.resolve_backend("auto", FAKE_CUDA_TENSOR).candidates == []
    assert backends.cuda.calls == [False]
    # auto's "not compiled" answer must not stand in for the explicit request, which may build ...
    assert dispatch.resolve_backend("cuda", FAKE_CUDA_TENSOR).name == "cuda"
    assert backends.cuda.calls == [False, True]
    # ... and once built in this process, auto has it as a candidate without asking again.
    assert [c.name for c in dispatch.resolve_backend("auto", FAKE_CUDA_TENSOR).candidates] == ["cuda"]
    assert backends.cuda.calls == [False, True]


def test_explicit_cuda_that_cannot_run_raises_with_the_reason(backends):
    backends.cuda.answer = (False, "the JIT build of csrc/ failed: fake nvcc error")
    with pytest.raises(RuntimeError, match="fake nvcc error"):
        dispatch.resolve_backend("cuda", FAKE_CUDA_TENSOR)
    assert backends.cuda.calls == [True]


def test_the_real_gpu_backends_declare_their_code_paths():
    """Every op module of the GPU backends declares PATHS, and code_path (when it has several) names one of them."""
    for name in ("triton", "cuda"):
        backend = dispatch.raw_backend(name)
        for op in contract.OPS:
            if getattr(backend, op) is None:
                continue
            assert backend.paths[op] != ("default",), f"{name}'s {op} declares no PATHS"
            assert (backend.code_paths[op] is None) == (len(backend.paths[op]) == 1), (name, op)
    triton = dispatch.raw_backend("triton")
    assert triton.paths["similarity_xent"] == ("fused", "dense", "dims", "dense_dims")
    x, q = torch.randn(4, 2, 8), torch.randn(8, 8)
    assert triton.code_paths["pair_scores"](x, True, None) == "full"
    assert triton.code_paths["pair_scores"](x, True, (4, 8)) == "dims"
    assert triton.code_paths["ranking_loss"](torch.randn(4096), None) == "pairwise"
    assert triton.code_paths["ranking_loss"](torch.randn(4097), None) == "sort"
    assert triton.code_paths["similarity_xent"](q, None, 20.0, "partner", None, True, 0.0, None, (4, 8)) == "dims"
    assert triton.code_paths["similarity_xent"](q, None, 20.0, "partner") == "fused"
    wide = torch.empty(8, 4096, device="meta")
    assert triton.code_paths["similarity_xent"](wide, None, 20.0, "partner") == "dense"
    wide_dims = (wide, None, 20.0, "partner", None, True, 0.0, None, (64, 4096))
    assert triton.code_paths["similarity_xent"](*wide_dims) == "dense_dims"  # verified and timed: on from 768
    from angle_kernels.triton_ops import awaiting_verification_on

    assert triton.paths["similarity_lse"] == ("fused", "dense", "dense_dims", "fused_prefixes")
    lse_wide = (wide, torch.empty(16, 4096, device="meta"), 20.0, 0, 0, "none", 0.0, "none", None, None, None, False,
                True)
    assert triton.code_paths["similarity_lse"](*lse_wide) == "dense"  # verified and timed: on from 2,048
    assert triton.code_paths["similarity_lse"](*lse_wide, (64, 4096)) == "dense_dims"  # verified, timed: from 768
    lse_narrow = (torch.empty(8, 512, device="meta"), torch.empty(16, 512, device="meta"), *lse_wide[2:])
    assert triton.code_paths["similarity_lse"](*lse_narrow, (64, 512)) == "fused_prefixes"
    assert triton.code_paths["pair_scores"](torch.randn(4, 2, 2048), True, (64, 2048)) == "dims_one_read"  # from 2,048
    assert triton.code_paths["pair_scores"](torch.randn(4, 2, 2047), True, (64, 2047)) == "dims"
    with awaiting_verification_on():
        assert triton.code_paths["similarity_xent"](*wide_dims) == "dense_dims"
        assert triton.code_paths["pair_scores"](torch.randn(4, 2, 768), True, (64, 768)) == "dims_one_read"
        assert triton.code_paths["similarity_lse"](*lse_wide) == "dense"
        assert triton.code_paths["similarity_lse"](*lse_wide, (64, 4096)) == "dense_dims"
        assert triton.code_paths["pair_scores"](torch.randn(4, 2, 768), True, None) == "full"  # one width: as before
        assert triton.code_paths["pair_scores"](torch.randn(4, 2, 768), True, (64, 512)) == "dims"  # narrower dims
    assert triton.code_paths["pair_scores"](torch.randn(4, 2, 768), True, (64, 768)) == "dims"


def test_switched_on_paths_are_switched_off_again_when_the_block_raises(monkeypatch):
    """A check that raises inside the block that switches on the paths awaiting verification (verify's, the GPU op
    sweep's) leaves the process's later calls on the paths verified before: the widths go back whatever the block
    does."""
    selector = ModuleType("fake_switched_backend.selector")
    selector.MIN_WIDTH, selector.PROPOSED_MIN_WIDTH = None, 768
    monkeypatch.setitem(sys.modules, "fake_switched_backend", ModuleType("fake_switched_backend"))
    monkeypatch.setitem(sys.modules, selector.__name__, selector)
    table = {("similarity_xent", "dense"): ("selector", "MIN_WIDTH")}
    with pytest.raises(RuntimeError, match="a check failed"):
        with path_switches.switched_on("fake_switched_backend", table):
            assert selector.MIN_WIDTH == 768 and path_switches.switched_off("fake_switched_backend", table) == set()
            raise RuntimeError("a check failed")
    assert selector.MIN_WIDTH is None
    assert path_switches.switched_off("fake_switched_backend", table) == {("similarity_xent", "dense")}


# ---------------------------------------------------------------------------------------------------------
# One level down: cuda_ops.is_available and _extension.load
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture
def extension_without_prebuilt(monkeypatch):
    """_extension on a pretend CUDA machine with no prebuilt _C; the JIT build is a fake that counts calls."""
    build = SimpleNamespace(calls=0, result=(True, ""))

    def fake_jit_build():
        build.calls += 1
        return build.result

    monkeypatch.setattr(_extension, "_missing_requirement", lambda: "")
    monkeypatch.setattr(_extension, "_import_prebuilt", lambda: (False, "no prebuilt angle_kernels._C (fake)"))
    monkeypatch.setattr(_extension, "_jit_build", fake_jit_build)
    monkeypatch.setattr(_extension, "_jit_outcome", None)
    return build


def test_load_without_build_never_builds_and_is_not_cached_as_final(extension_without_prebuilt):
    build = extension_without_prebuilt
    for _ in range(2):
        ok, why = _extension.load(allow_build=False)
        assert not ok
        assert "no prebuilt" in why and "backend='cuda'" in why
    assert build.calls == 0
    assert _extension.load(allow_build=True) == (True, "")
    assert build.calls == 1
    assert _extension.load(allow_build=False) == (True, "")  # built in this process: usable without building
    assert _extension.load() == (True, "")
    assert build.calls == 1  # at most one build per process


def test_a_failed_build_is_not_retried(extension_without_prebuilt):
    build = extension_without_prebuilt
    build.result = (False, "the JIT build of csrc/ failed: fake")
    for allow_build in (True, True, False):
        ok, why = _extension.load(allow_build=allow_build)
        assert not ok and "no prebuilt" in why and "failed: fake" in why
    assert build.calls == 1


def test_cuda_ops_is_available_passes_allow_build_through(monkeypatch):
    _extension.define_schemas()  # the cuda_* ops must be defined on every machine, CPU-only ones too
    asked = []
    monkeypatch.setattr(_extension, "load", lambda allow_build=True: asked.append(allow_build) or (False, "x"))
    cuda_ops.is_available(allow_build=False)
    cuda_ops.is_available()
    assert asked == [False, True]


_REAL_IS_VERIFIED = verified.is_verified


def test_auto_follows_the_table_and_the_users_cache_through_the_match_rule(backends, monkeypatch, tmp_path):
    """End to end through angle_kernels.verified's own rule: a table entry for Triton's dims path and a cache entry
    for its fused path (made by `verify` on this identity) send exactly those calls to Triton; an entry for another
    GPU (sm_80) sends nothing."""
    ident = {"capability": "9.0", "torch": "2.11", "triton": "3.6", "fingerprint": "0123456789abcdef", "gpu": "H100"}
    monkeypatch.setattr(verified, "is_verified", _REAL_IS_VERIFIED)
    monkeypatch.setattr(verified, "identity", lambda backend, op, path, device: ident)
    monkeypatch.setenv(user_cache.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(verified, "VERIFIED", (
        verified.entry("triton", "similarity_xent", "dims", ident, "bench/results/h100/first"),
        verified.entry("triton", "pair_scores", "full", {**ident, "capability": "8.0"}, "an A100 run")))
    verified.write_cache([verified.entry("triton", "ranking_loss", "fused", ident, "python -m angle_kernels.verify")],
                         [])
    verified.forget()
    try:
        auto = dispatch.resolve_backend("auto", FAKE_CUDA_TENSOR)
        q = _embeddings()
        assert auto.computes("similarity_xent", q, None, 20.0, "partner", dims=(4, 8)) == ("triton", "dims")
        assert auto.computes("similarity_xent", q, None, 20.0, "partner") == ("torch", "default")
        assert auto.computes("ranking_loss", *_scores()) == ("triton", "fused")
        assert auto.computes("pair_scores", q.view(3, 2, 8), True) == ("torch", "default")  # verified on sm_80
    finally:
        verified.forget()


# ---------------------------------------------------------------------------------------------------------
# Among the backends auto may use, the one measured fastest (angle_kernels.measured)
# ---------------------------------------------------------------------------------------------------------
REAL_AFTER_TORCH = measured.AFTER_TORCH


def _measured_here(monkeypatch, points, changed=()):
    """This fake GPU (capability "fake") measured `points` ((op, variant, size, width, {backend/path: ms})) in
    float64, the dtype of the tests' inputs, each time on the code installed here but those of the (op,
    backend/path) in `changed`, which measured code that has changed since."""
    monkeypatch.setattr(measured, "code_fingerprint", lambda backend, op, path: "installed")
    full = [(*point, {key: "older" if (point[0], key) in changed else "installed" for key in point[4]})
            for point in points]
    monkeypatch.setattr(measured, "MEASURED", {("fake", torch.float64): tuple(full)})


def test_auto_takes_the_backend_measured_fastest_among_those_it_may_use(backends, monkeypatch):
    """Verified CUDA measured slower than torch: torch computes, and without the one-per-process warning (a GPU
    backend was verified; torch is simply faster). Each backend's time is that of the code path the call takes."""
    backends.cuda.answer = (True, "")
    backends.verified.update({("cuda", "similarity_xent", "fused"), ("cuda", "ranking_loss", "fused")})
    _measured_here(monkeypatch, [
        ("similarity_xent", "full", 36, 8,
         {"triton/fused": 1.0, "triton/dims": 9.0, "torch/default": 2.0, "cuda/fused": 5.0}),
        ("ranking_loss", "full", 6, 1, {"triton/fused": 9.0, "torch/default": 2.0, "cuda/fused": 1.0}),
    ])
    auto = dispatch.resolve_backend("auto", FAKE_CUDA_TENSOR)
    q = _embeddings()  # M = Mc = 6: 36 logits, D = 8
    _, warned = runtime_warnings(auto.similarity_xent, q, None, 20.0, "partner")
    assert warned == [] and backends.computed == []  # torch computed it
    auto.ranking_loss(*_scores())
    assert backends.computed == [("cuda", "ranking_loss")]  # cuda measured fastest there
    assert auto.computes("similarity_xent", q, None, 20.0, "partner") == ("torch", "default")
    backends.verified.add(("triton", "similarity_xent", "fused"))  # now triton may: "triton/fused" is fastest
    assert auto.computes("similarity_xent", q, None, 20.0, "partner") == ("triton", "fused")


def test_similarity_lse_calls_are_decided_by_their_points_too(backends, monkeypatch):
    """similarity_lse's points (M x Mc logits, width D: bench/speed_table.py's sizes) decide its calls as the other
    ops' do: torch where it measured faster than Triton's path, Triton where Triton did."""
    backends.verified.add(("triton", "similarity_lse", "fused"))
    auto = dispatch.resolve_backend("auto", FAKE_CUDA_TENSOR)
    q, c = _embeddings(), pretend_cuda(torch.randn(12, 8, dtype=torch.float64))  # 72 logits, D = 8
    for triton_ms, expected in ((9.0, "torch"), (1.0, "triton")):
        _measured_here(monkeypatch, [("similarity_lse", "full", 72, 8, {"triton/fused": triton_ms,
                                                                         "torch/default": 2.0})])
        assert auto.computes("similarity_lse", q, c, 20.0)[0] == expected


def test_auto_keeps_the_fixed_order_within_a_tie_and_where_nothing_near_was_measured(backends, monkeypatch):
    backends.cuda.answer = (True, "")
    backends.verified.update({("triton", "ranking_loss", "fused"), ("cuda", "ranking_loss", "fused"),
                              ("cuda", "pair_scores", "fused")})
    auto = dispatch.resolve_backend("auto", FAKE_CUDA_TENSOR)
    scores, labels = _scores()
    x = _embeddings().view(3, 2, 8)  # 3 pairs, D = 8
    ranking = {"triton/fused": 1.0, "cuda/fused": 0.95, "torch/default": 3.0}
    # cuda within TIE of triton: a tie, which goes to triton; torch measured slower than both
    _measured_here(monkeypatch, [("ranking_loss", "full", 6, 1, ranking)])
    assert auto.computes("ranking_loss", scores, labels)[0] == "triton"
    # cuda clearly faster: cuda
    _measured_here(monkeypatch, [("ranking_loss", "full", 6, 1, {**ranking, "cuda/fused": 0.8})])
    assert auto.computes("ranking_loss", scores, labels)[0] == "cuda"
    # the only point is more than SPAN times the call's size away: the fixed order (triton first)
    far = int(6 * measured.SPAN * 2)
    _measured_here(monkeypatch, [("ranking_loss", "full", far, 1, {**ranking, "cuda/fused": 0.1})])
    assert auto.computes("ranking_loss", scores, labels)[0] == "triton"
    # a point that did not time the first backend of the fixed order (CUDA: Triton's pair scores are not verified
    # here) compares nothing: the fixed order
    _measured_here(monkeypatch, [("pair_scores", "full", 3, 8, {"torch/default": 0.1, "triton/fused": 1.0})])
    assert auto.computes("pair_scores", x, True)[0] == "cuda"
    # another variant (dims) or another dtype: not measured
    _measured_here(monkeypatch, [("pair_scores", "dims", 3, 8, {"torch/default": 0.1, "cuda/fused": 1.0})])
    assert auto.computes("pair_scores", x, True)[0] == "cuda"
    monkeypatch.setattr(measured, "MEASURED", {("fake", torch.bfloat16): (
        ("pair_scores", "full", 3, 8, {"torch/default": 0.1, "cuda/fused": 1.0},
         {"torch/default": "installed", "cuda/fused": "installed"}),)})
    assert auto.computes("pair_scores", x, True)[0] == "cuda"


def test_times_of_code_changed_since_they_were_measured_are_not_used(backends, monkeypatch):
    """A time counts only while the code it measured is the code installed here (its fingerprint): one measured on
    code changed since is as if never measured: a backend without a usable time first in the fixed order takes the
    call, one behind a timed backend counts as no faster than it (measured.point_choice)."""
    backends.cuda.answer = (True, "")
    backends.verified.update({("cuda", "ranking_loss", "fused")})
    auto = dispatch.resolve_backend("auto", FAKE_CUDA_TENSOR)
    point = ("ranking_loss", "full", 6, 1, {"cuda/fused": 5.0, "torch/default": 1.0})
    _measured_here(monkeypatch, [point])
    assert auto.computes(*(("ranking_loss",) + _scores()))[0] == "torch"
    _measured_here(monkeypatch, [point], changed={("ranking_loss", "torch/default")})
    assert auto.computes(*(("ranking_loss",) + _scores()))[0] == "cuda"
    _measured_here(monkeypatch, [point], changed={("ranking_loss", "cuda/fused")})
    assert auto.computes(*(("ranking_loss",) + _scores()))[0] == "cuda"
    # a nearer point of changed code does not hand the call to a farther one: the fixed order
    times = {"cuda/fused": 5.0, "torch/default": 1.0}
    monkeypatch.setattr(measured, "MEASURED", {("fake", torch.float64): (
        ("ranking_loss", "full", 6, 1, times, {"cuda/fused": "installed", "torch/default": "older"}),
        ("ranking_loss", "full", 12, 1, times, {"cuda/fused": "installed", "torch/default": "installed"}))})
    assert auto.computes(*(("ranking_loss",) + _scores()))[0] == "cuda"


def test_the_installed_code_of_a_path_no_module_declares_has_no_fingerprint():
    """code_fingerprint never raises: a path without code here (or a cuda path without a loaded extension) has
    none, so no time counts for it; a real path's is this checkout's (angle_kernels.fingerprints)."""
    from angle_kernels import fingerprints

    assert measured.code_fingerprint("triton", "ranking_loss", "no-such-path") is None
    assert measured.code_fingerprint("torch", "ranking_loss", "default") == fingerprints.path_fingerprint(
        "torch", "ranking_loss", "default")
    assert measured.joined_fingerprint("cuda", {"fingerprint": "a", "build": "b"}) == "a+b"
    assert measured.joined_fingerprint("cuda", {"fingerprint": "a", "build": None}) is None


def test_a_sort_path_call_is_not_decided_by_a_time_of_the_pairwise_path(backends, monkeypatch):
    """Times are per code path: a Triton ranking call that takes the sort path finds at the nearest point only the
    pairwise path's time (measured below the crossover): no time of its own path, so the fixed order (triton), not
    torch, which beat the pairwise tiles there."""
    backends.verified.update({("triton", "ranking_loss", "sort")})
    auto = dispatch.resolve_backend("auto", FAKE_CUDA_TENSOR)
    triton = next(c for c in auto.candidates if c.name == "triton")
    monkeypatch.setattr(triton, "code_path", lambda op, call: "sort")
    _measured_here(monkeypatch, [("ranking_loss", "full", 6, 1, {"triton/pairwise": 9.0, "torch/default": 1.0}),
                                 ("ranking_loss", "full", 48, 1, {"triton/sort": 9.0, "torch/default": 1.0})])
    assert auto.computes(*(("ranking_loss",) + _scores())) == ("triton", "sort")
    monkeypatch.setattr(triton, "code_path", lambda op, call: "pairwise")
    backends.verified.add(("triton", "ranking_loss", "pairwise"))
    assert auto.computes(*(("ranking_loss",) + _scores()))[0] == "torch"


def test_equally_near_points_decide_only_when_they_agree_whatever_their_order(backends, monkeypatch):
    """6 scores lie as near 3 as 12 (log distance): both points decide; when they disagree, the fixed order, in
    either order of the table; when they agree, their choice."""
    backends.verified.update({("triton", "ranking_loss", "fused")})
    auto = dispatch.resolve_backend("auto", FAKE_CUDA_TENSOR)
    torch_faster = {"triton/fused": 2.0, "torch/default": 1.0}
    triton_faster = {"triton/fused": 1.0, "torch/default": 2.0}
    for sizes in ((3, 12), (12, 3)):
        _measured_here(monkeypatch, [("ranking_loss", "full", sizes[0], 1, torch_faster),
                                     ("ranking_loss", "full", sizes[1], 1, triton_faster)])
        assert auto.computes(*(("ranking_loss",) + _scores()))[0] == "triton"
        _measured_here(monkeypatch, [("ranking_loss", "full", sizes[1], 1, triton_faster),
                                     ("ranking_loss", "full", sizes[0], 1, torch_faster)])
        assert auto.computes(*(("ranking_loss",) + _scores()))[0] == "triton"
    _measured_here(monkeypatch, [("ranking_loss", "full", 3, 1, torch_faster),
                                 ("ranking_loss", "full", 12, 1, {"triton/fused": 3.0, "torch/default": 1.0})])
    assert auto.computes(*(("ranking_loss",) + _scores()))[0] == "torch"
    # a nearer point alone decides
    _measured_here(monkeypatch, [("ranking_loss", "full", 5, 1, torch_faster),
                                 ("ranking_loss", "full", 12, 1, triton_faster)])
    assert auto.computes(*(("ranking_loss",) + _scores()))[0] == "torch"


def test_the_measured_points_name_real_backends_and_code_paths():
    """Every time of every point is keyed backend/path, with a path the real op module declares (the torch
    backend's one: "default") and a fingerprint recorded under the same key (16 hex digits; cuda: the Python
    path's and the CUDA sources', joined by "+"); every point compares at least two backends; sizes and widths are
    positive."""
    import re

    from angle_kernels import fingerprints

    for (capability, dtype), points in measured.MEASURED.items():
        assert capability.count(".") == 1 and dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64)
        for op, variant, size, width, times, prints in points:
            assert op in contract.OPS and variant in ("full", "dims", "margin")
            assert size > 0 and width > 0 and len({key.partition("/")[0] for key in times}) >= 2
            assert set(prints) == set(times)
            for key, ms in times.items():
                backend, _, path = key.partition("/")
                assert backend in dispatch.BACKENDS and ms > 0, key
                assert (backend, op, path) in fingerprints.PATH_CODE, key
                pattern = r"[0-9a-f]{16}\+[0-9a-f]{16}" if backend == "cuda" else r"[0-9a-f]{16}"
                assert re.fullmatch(pattern, prints[key]), key


def test_on_the_h100_table_only_times_of_unchanged_code_decide(backends, monkeypatch):
    """The committed H100 points with this checkout's code. The ranking term at 65,536 scores goes to torch (1.01
    ms against Triton's sort path, 1.29: neither changed since), at 1M to Triton. In-batch negatives at 2N = 32,768
    rows, D = 768, with only CUDA's fused path verified: the torch time measured the torch backend before its GPU
    blocks changed, so no time decides and the fixed order does, where the CUDA similarity_xent comes after torch
    (measured.AFTER_TORCH); with the torch code it measured (203 ms against 535), torch by its time. With the
    exception removed, the stale time would have sent the call to the slower CUDA scheme. (The H100's points alone:
    the H200's replace some of them in the table auto reads.)"""
    monkeypatch.setattr(measured, "capability", lambda device: "9.0")
    monkeypatch.setattr(measured, "MEASURED", {("9.0", torch.bfloat16): measured._H100_BF16_EMBEDDINGS,
                                               ("9.0", torch.float32): measured._H100_FP32_SCORES})
    backends.cuda.answer = (True, "")
    backends.verified.update({("cuda", "similarity_xent", "fused"), ("triton", "ranking_loss", "sort")})
    auto = dispatch.resolve_backend("auto", FAKE_CUDA_TENSOR)
    triton = next(c for c in auto.candidates if c.name == "triton")
    cuda = next(c for c in auto.candidates if c.name == "cuda")
    monkeypatch.setattr(triton, "code_path", lambda op, call: "sort")
    monkeypatch.setattr(cuda, "code_path", lambda op, call: "fused")
    for n, expected in ((1 << 20, "triton"), (1 << 16, "torch")):
        scores = torch.empty(n, dtype=torch.float32, device="meta")
        assert auto._choose("ranking_loss", contract.check_ranking_loss(scores, scores)).name == expected
    recorded = next(prints for op, variant, size, width, _, prints in measured.MEASURED[("9.0", torch.bfloat16)]
                    if (op, variant, size, width) == ("similarity_xent", "full", 32768 * 32768, 768))
    installed = measured.code_fingerprint
    monkeypatch.setattr(measured, "code_fingerprint", lambda backend, op, path: (
        recorded["cuda/fused"] if backend == "cuda" else installed(backend, op, path)))  # as if built from csrc/
    q = torch.empty(32768, 768, dtype=torch.bfloat16, device="meta")
    call = contract.check_similarity_xent(q, None, 20.0, "partner", None, True, 0.0, None)
    assert auto._choose("similarity_xent", call).name == "torch"
    monkeypatch.setattr(measured, "AFTER_TORCH", set())
    assert auto._choose("similarity_xent", call).name == "cuda"
    monkeypatch.setattr(measured, "code_fingerprint", lambda backend, op, path: recorded[f"{backend}/{path}"])
    assert auto._choose("similarity_xent", call).name == "torch"


def test_cuda_similarity_ops_wait_behind_torch_where_no_time_decides(backends, monkeypatch):
    """The real exceptions (measured.AFTER_TORCH): the CUDA similarity ops, verified, come after torch where no time
    of their current code decides (they measured slower than torch at the smallest points), and a point that times
    them faster sends the call to them; the CUDA pair scores and ranking term (measured faster than torch at every
    point) come before it."""
    monkeypatch.setattr(measured, "AFTER_TORCH", REAL_AFTER_TORCH)
    assert REAL_AFTER_TORCH == {("cuda", "similarity_xent"), ("cuda", "similarity_lse")}
    backends.cuda.answer = (True, "")
    backends.verified.update({("cuda", op, "fused") for op in contract.OPS})
    auto = dispatch.resolve_backend("auto", FAKE_CUDA_TENSOR)
    q = _embeddings()
    assert auto.computes("ranking_loss", *_scores())[0] == "cuda"
    assert auto.computes("pair_scores", q.view(3, 2, 8), True)[0] == "cuda"
    assert auto.computes("similarity_xent", q, None, 20.0, "partner")[0] == "torch"
    assert auto.computes("similarity_lse", q, q, 20.0)[0] == "torch"
    _measured_here(monkeypatch, [("similarity_lse", "full", 36, 8, {"torch/default": 2.0, "cuda/fused": 1.0})])
    assert auto.computes("similarity_lse", q, q, 20.0)[0] == "cuda"


def test_an_empty_call_keeps_the_fixed_order(backends, monkeypatch):
    """No size to compare (an empty ranking term): the fixed order, not a log of zero."""
    backends.cuda.answer = (True, "")
    backends.verified.update({("triton", "ranking_loss", "fused"), ("cuda", "ranking_loss", "fused")})
    _measured_here(monkeypatch, [("ranking_loss", "full", 6, 1,
                                  {"triton/fused": 9.0, "cuda/fused": 1.0, "torch/default": 1.0})])
    auto = dispatch.resolve_backend("auto", FAKE_CUDA_TENSOR)
    empty = pretend_cuda(torch.empty(0, dtype=torch.float64))
    assert auto.computes("ranking_loss", empty, torch.empty(0, dtype=torch.int64))[0] == "triton"


@pytest.mark.parametrize("name, value, expected", [
    ("ANGLE_KERNELS_ALLOW_TF32", "false", "must be 1 .* or 0 or unset"),  # its reader would take "false" as on
    ("ANGLE_KERNELS_ALLOW_TF32", "0 ", "must be 1"),  # so would it "0 "
    ("ANGLE_KERNELS_POISON_OUTPUTS", "off", "must be 1 .* or 0 or unset"),  # a NaN fill, ~50% on a backward
    ("ANGLE_KERNELS_AUTOTUNE", "firts", "must be 'all' .* or 'first'"),  # Triton's import raised: auto took torch
    ("ANGLE_KERNELS_SELF_CHECK", "yes", "must be 0 .* or 1"),  # read before only where a path was unverified
])
def test_a_gpu_setting_its_reader_would_misread_is_an_error_at_the_first_gpu_call(monkeypatch, name, value, expected):
    from angle_kernels import _runtime

    monkeypatch.setattr(_runtime, "_settings_checked", None)
    monkeypatch.setenv(name, value)
    for backend in ("auto", "triton"):
        with pytest.raises(ValueError, match=f"{name} {expected}"):
            dispatch.resolve_backend(backend, FAKE_CUDA_TENSOR)
    assert dispatch.resolve_backend("auto", torch.zeros(1)).name == "torch"  # CPU calls read none of them
    # an explicit backend that reads none of them (torch; cuda, whose sources read no environment) is not refused
    assert dispatch.resolve_backend("torch", FAKE_CUDA_TENSOR) is dispatch._TORCH_ON_GPU


@pytest.mark.parametrize("values", [{}, {"ANGLE_KERNELS_ALLOW_TF32": "1", "ANGLE_KERNELS_AUTOTUNE": " First",
                                         "ANGLE_KERNELS_SELF_CHECK": "0", "ANGLE_KERNELS_POISON_OUTPUTS": "1"},
                                    {"ANGLE_KERNELS_ALLOW_TF32": "1 ", "ANGLE_KERNELS_POISON_OUTPUTS": "0"},
                                    {"ANGLE_KERNELS_ALLOW_TF32": "", "ANGLE_KERNELS_AUTOTUNE": "all"},
                                    {"ANGLE_KERNELS_ALLOW_TF32": "0", "ANGLE_KERNELS_SELF_CHECK": "1 "}])
def test_the_gpu_settings_their_readers_understand_pass(monkeypatch, values):
    from angle_kernels import _runtime

    monkeypatch.setattr(_runtime, "_settings_checked", None)
    for name in ("ANGLE_KERNELS_ALLOW_TF32", "ANGLE_KERNELS_AUTOTUNE", "ANGLE_KERNELS_SELF_CHECK",
                 "ANGLE_KERNELS_POISON_OUTPUTS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    _runtime.check_gpu_settings()


def test_a_gpu_setting_changed_after_a_call_is_checked_at_the_next(monkeypatch):
    """The settings are read at every call: one changed, after a call that passed, to a value its reader would
    misread is an error at the next call, the first-use checks' switch included."""
    from angle_kernels import _runtime

    monkeypatch.setattr(_runtime, "_settings_checked", None)
    names = ("ANGLE_KERNELS_ALLOW_TF32", "ANGLE_KERNELS_AUTOTUNE", "ANGLE_KERNELS_SELF_CHECK",
             "ANGLE_KERNELS_POISON_OUTPUTS")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    for name, misread in zip(names, ("true", "none", "yes", "on")):
        _runtime.check_gpu_settings()
        monkeypatch.setenv(name, misread)
        with pytest.raises(ValueError, match=name):
            _runtime.check_gpu_settings()
        monkeypatch.delenv(name)


def test_the_settings_checked_are_the_ones_the_gpu_paths_read():
    pytest.importorskip("triton")
    from angle_kernels import _runtime, first_use
    from angle_kernels.triton_ops import _common, _similarity_tiles

    assert _runtime.ALLOW_TF32_ENV == _similarity_tiles._TF32_ENV
    assert _runtime.AUTOTUNE_ENV == _common.AUTOTUNE_ENV and _runtime.SELF_CHECK_ENV == first_use.ENV
    assert _runtime.POISON_OUTPUTS_ENV == _common.POISON_OUTPUTS_ENV


def test_the_jit_build_says_why_it_did_not_run_or_failed(monkeypatch):
    """The JIT build's answer names what stopped it (the switch, missing sources, no nvcc, the compiler's error), and
    a build that starts compiles every csrc/ source with the fingerprint flags a verification is matched against."""
    from torch.utils import cpp_extension

    asked = []

    def fake_load(**kwargs):
        asked.append(kwargs)
        raise RuntimeError("fake nvcc error")

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(_extension, "_find_nvcc", lambda: "/fake/cuda/bin/nvcc")
    monkeypatch.setattr(_extension, "_jit_module", None)
    monkeypatch.setenv("ANGLE_KERNELS_CUDA_JIT", "0")
    assert _extension._jit_build() == (False, "the JIT build is disabled (ANGLE_KERNELS_CUDA_JIT=0)")
    monkeypatch.setenv("ANGLE_KERNELS_CUDA_JIT", "1")
    sources = _extension.SOURCES
    monkeypatch.setattr(_extension, "SOURCES", (*sources, "no_such_op.cu"))
    ok, why = _extension._jit_build()
    assert not ok and why.startswith("no CUDA sources to JIT-build") and "no_such_op.cu missing" in why
    monkeypatch.setattr(_extension, "SOURCES", sources)
    monkeypatch.delenv("ANGLE_KERNELS_CUDA_JIT")
    monkeypatch.setattr(_extension, "_find_nvcc", lambda: None)
    ok, why = _extension._jit_build()
    assert not ok and "nvcc was not found (set CUDA_HOME)" in why
    assert asked == []  # nothing stopped by the checks above reached the compiler
    monkeypatch.setattr(_extension, "_find_nvcc", lambda: "/fake/cuda/bin/nvcc")
    assert _extension._jit_build() == (False, "the JIT build of csrc/ failed: RuntimeError: fake nvcc error")
    (kwargs,) = asked
    assert [Path(source).name for source in kwargs["sources"]] == list(_extension.SOURCES)
    assert "module.cpp" in _extension.SOURCES and "similarity_xent.cu" in _extension.SOURCES
    assert kwargs["extra_cflags"] == _extension.cxx_flags() and kwargs["extra_cuda_cflags"] == _extension.NVCC_FLAGS
    assert any(flag.startswith("-DANGLE_KERNELS_FINGERPRINT_SIMILARITY_XENT=0x") for flag in kwargs["extra_cflags"])
    assert _extension._jit_module is None


def test_nvcc_is_looked_for_under_cuda_home_first(monkeypatch, tmp_path):
    """CUDA_HOME (else CUDA_PATH) names the toolkit whose bin/nvcc builds the kernels; without one there, the PATH's."""
    monkeypatch.setattr(_extension.shutil, "which", lambda name: "/on/the/path/nvcc")
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "nvcc").touch()
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("CUDA_HOME", str(home))
    assert _extension._find_nvcc() == str(home / "bin" / "nvcc")
    monkeypatch.delenv("CUDA_HOME")
    monkeypatch.setenv("CUDA_PATH", str(home))
    assert _extension._find_nvcc() == str(home / "bin" / "nvcc")
    monkeypatch.setenv("CUDA_PATH", str(tmp_path / "no_toolkit"))
    assert _extension._find_nvcc() == "/on/the/path/nvcc"


def test_the_cuda_backend_names_what_this_process_lacks(monkeypatch):
    """A CPU build of torch and a machine without a GPU are told apart in the reason the backend gives."""
    monkeypatch.setattr(torch.version, "cuda", None)
    ok, why = _extension.load(allow_build=False)
    assert not ok and "was built without CUDA (torch.version.cuda is None)" in why
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _extension.load(allow_build=False) == (False, "torch sees no CUDA GPU (torch.cuda.is_available() is False)")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _extension._missing_requirement() == ""


def test_a_failed_build_reports_both_reasons(extension_without_prebuilt):
    """Without a prebuilt extension and with a failed JIT build, the reason names both."""
    extension_without_prebuilt.result = (False, "nvcc was not found (set CUDA_HOME)")
    assert _extension.load() == (False, "no prebuilt angle_kernels._C (fake); nvcc was not found (set CUDA_HOME)")


def test_the_build_fingerprints_are_those_the_loaded_extension_reports(monkeypatch):
    """op -> 16 hex digits of the fingerprint the loaded build reports, an op built without one (0) left out; a
    build that reports none has none; without a loaded extension, None."""
    reported = {"similarity_xent": 0xAB, "ranking_loss": 0, "pair_scores": 2**64 - 1}
    monkeypatch.setattr(_extension, "_jit_module", SimpleNamespace(op_fingerprints=lambda: reported))
    assert _extension.build_fingerprints() == {"similarity_xent": "00000000000000ab", "pair_scores": "f" * 16}
    monkeypatch.setattr(_extension, "_jit_module", SimpleNamespace())
    assert _extension.build_fingerprints() == {}
    monkeypatch.setattr(_extension, "_jit_module", None)
    monkeypatch.setattr(_extension, "_import_prebuilt", lambda: (False, "no prebuilt angle_kernels._C (fake)"))
    assert _extension.build_fingerprints() is None


def test_a_prebuilt_extension_is_used_without_building(extension_without_prebuilt, monkeypatch):
    """An installed angle_kernels._C makes the kernels available at once: no JIT build is started, even where one
    is allowed."""
    monkeypatch.setattr(_extension, "_import_prebuilt", lambda: (True, ""))
    assert _extension.load(allow_build=True) == (True, "") and _extension.load(allow_build=False) == (True, "")
    assert extension_without_prebuilt.calls == 0


def test_computes_of_an_unknown_op_and_a_tensor_for_the_backend_are_refused_naming_the_argument():
    """computes() with a misspelt op raised "type object 'Ops' has no attribute 'similarity_xnet'", naming neither
    the argument nor the ops; resolve_backend(embeddings), the tensor given as the backend, printed the whole tensor
    in its message."""
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"^op must be one of 'pair_scores', 'ranking_loss', 'similarity_xent', "
                                         r"'similarity_lse'; got 'similarity_xnet'$"):
        dispatch.resolve_backend("torch", x).computes("similarity_xnet", x, None, 20.0, "partner")
    with pytest.raises(ValueError, match=r"^backend must be None or one of 'auto', 'torch', 'triton', 'cuda'; got a "
                                         r"tensor of shape \(4, 8\)$"):
        dispatch.resolve_backend(x)
    assert dispatch.resolve_backend("torch", x).computes("similarity_xent", x, None, 20.0, "partner") == \
        ("torch", "default")

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
import warnings
from types import ModuleType, SimpleNamespace

import pytest
import torch

import angle_kernels.cuda_ops as cuda_ops
from angle_kernels import contract, dispatch, measured, verified
from angle_kernels.cuda_ops import _extension

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
    monkeypatch.setattr(verified, "describe", lambda backend, op, device: "a fake GPU (sm_90)")
    monkeypatch.setattr(measured, "capability", lambda device: "fake")  # no measured speeds: the fixed order
    return SimpleNamespace(triton=triton, cuda=cuda, verified=passed, computed=computed)


def _recording_warnings(fn, *args, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args, **kwargs)
    return result, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def _scores():
    return pretend_cuda(torch.randn(6, dtype=torch.float64)), torch.arange(6) % 3


def _embeddings():
    return pretend_cuda(torch.randn(6, 8, dtype=torch.float64))


def test_auto_on_cpu_tensors_is_torch_without_probing_or_warning(backends):
    ops, warned = _recording_warnings(dispatch.resolve_backend, "auto", torch.zeros(2, 3))
    assert ops.name == "torch"
    assert warned == []
    assert backends.triton.calls == [] and backends.cuda.calls == []


def test_auto_on_cuda_computes_with_torch_until_a_gpu_backend_is_verified(backends):
    """Triton loads and implements every op, but nothing has passed on this GPU: every call is torch's, with one
    warning per process naming why and how to verify."""
    auto = dispatch.resolve_backend(None, FAKE_CUDA_TENSOR)
    assert auto.name == "auto"
    (first, warned) = _recording_warnings(auto.ranking_loss, *_scores())
    assert backends.computed == []  # the fakes record only GPU calls: torch's own op computed it
    assert len(warned) == 1
    message = warned[0]
    assert "PyTorch backend" in message and "python -m angle_kernels.verify" in message
    assert "triton: its code path 'fused' has not passed a correctness run on a fake GPU (sm_90)" in message
    assert "cuda: no prebuilt angle_kernels._C (fake)" in message  # not loaded, with the reason
    assert "ANGLE_KERNELS_BACKEND" in message
    for call in (lambda: auto.ranking_loss(*_scores()), lambda: auto.similarity_xent(_embeddings(), None, 20.0,
                                                                                        "partner")):
        _, warned = _recording_warnings(call)
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
    auto.similarity_xent(q, None, 20.0, "partner")  # triton's fused path is not verified: cuda's is
    auto.ranking_loss(*_scores())  # cuda
    _, warned = _recording_warnings(auto.pair_scores, q.view(3, 2, 8), True)  # nobody's: torch, warning
    assert backends.computed == [("triton", "similarity_xent"), ("cuda", "similarity_xent"), ("cuda", "ranking_loss")]
    assert len(warned) == 1 and "pair_scores" in warned[0]
    assert auto.computes("similarity_xent", q, None, 20.0, "partner", dims=(4, 8)) == ("triton", "dims")
    assert auto.computes("similarity_xent", q, None, 20.0, "partner") == ("cuda", "fused")
    assert auto.computes("pair_scores", q.view(3, 2, 8), True) == ("torch", "default")


def test_explicit_gpu_backend_runs_unverified_code_with_one_warning_per_op_and_path(backends):
    backends.verified.add(("triton", "similarity_xent", "dims"))
    triton = dispatch.resolve_backend("triton", FAKE_CUDA_TENSOR)
    q = _embeddings()
    messages = []
    for dims in (None, None, (4, 8), (4, 8)):
        _, warned = _recording_warnings(triton.similarity_xent, q, None, 20.0, "partner", dims=dims)
        messages.append(warned)
    _, on_cpu = _recording_warnings(triton.similarity_xent, torch.randn(6, 8, dtype=torch.float64), None, 20.0,
                                    "partner")
    assert backends.computed == 5 * [("triton", "similarity_xent")]  # it runs what it is asked, every time
    assert len(messages[0]) == 1 and messages[1:] == [[], [], []]  # fused: once; dims: verified, never
    assert "backend='triton' computes similarity_xent on its code path 'fused'" in messages[0][0]
    assert "a fake GPU (sm_90)" in messages[0][0] and "python -m angle_kernels.verify" in messages[0][0]
    assert on_cpu == []  # CPU tensors (the interpreter): no verification applies


def test_auto_warns_with_the_reason_a_backend_is_unavailable_and_never_builds(backends):
    backends.triton.answer = (False, "triton does not import: ImportError: fake libcuda mismatch")
    auto = dispatch.resolve_backend("auto", FAKE_CUDA_TENSOR)
    _, warned = _recording_warnings(auto.ranking_loss, *_scores())
    assert len(warned) == 1 and "fake libcuda mismatch" in warned[0] and "no prebuilt angle_kernels._C" in warned[0]
    for _ in range(3):  # cached: neither probed again nor warned again
        assert dispatch.resolve_backend("auto", FAKE_CUDA_TENSOR) is auto
        assert _recording_warnings(auto.ranking_loss, *_scores())[1] == []
    assert backends.triton.calls == [None] and backends.cuda.calls == [False]


def test_auto_reports_a_backend_that_raises_while_probed(backends):
    def broken():
        raise OSError("libtriton.so: cannot open shared object file")

    backends.triton.is_available = broken
    auto = dispatch.resolve_backend("auto", FAKE_CUDA_TENSOR)
    assert auto.candidates == []
    _, warned = _recording_warnings(auto.ranking_loss, *_scores())
    assert "OSError" in warned[0] and "libtriton.so" in warned[0]


def test_a_backend_whose_op_module_fails_to_import_is_reported(backends, monkeypatch):
    """An available backend whose kernels do not import (a Triton API change, a missing dependency) is passed
    over with the import error as the reason, and an explicit request for it raises with that reason."""
    monkeypatch.setitem(sys.modules, "fake_kernel_dependency", None)  # what the op module imports is missing

    def load_ops():  # as a backend's load_ops() fails when its `from . import ranking_loss` does
        import fake_kernel_dependency  # noqa: F401

    monkeypatch.setattr(backends.triton, "load_ops", load_ops)
    auto = dispatch.resolve_backend("auto", FAKE_CUDA_TENSOR)
    _, warned = _recording_warnings(auto.ranking_loss, *_scores())
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
    first, warned = _recording_warnings(auto.ranking_loss, scores, labels)
    auto.similarity_xent(_embeddings(), None, 20.0, "partner")
    assert backends.computed == [("triton", "similarity_xent")]
    assert len(warned) == 1 and "triton: it does not implement ranking_loss yet" in warned[0]
    assert torch.equal(first, dispatch.ranking_loss(scores, labels, backend="torch"))
    explicit = dispatch.resolve_backend("triton", FAKE_CUDA_TENSOR)
    with pytest.raises(ValueError, match="backend 'triton' does not implement ranking_loss"):
        explicit.ranking_loss(scores, labels)


def test_auto_uses_a_prebuilt_cuda_extension_without_building(backends):
    backends.triton.answer = (False, "no triton (fake)")
    backends.cuda.answer = (True, "")
    backends.verified.add(("cuda", "ranking_loss", "fused"))
    auto = dispatch.resolve_backend("auto", FAKE_CUDA_TENSOR)
    assert [c.name for c in auto.candidates] == ["cuda"]
    _, warned = _recording_warnings(auto.ranking_loss, *_scores())
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
    assert triton.paths["similarity_xent"] == ("fused", "dense", "dims")
    x, q = torch.randn(4, 2, 8), torch.randn(8, 8)
    assert triton.code_paths["pair_scores"](x, True, None) == "full"
    assert triton.code_paths["pair_scores"](x, True, (4, 8)) == "dims"
    assert triton.code_paths["ranking_loss"](torch.randn(4096), None) == "pairwise"
    assert triton.code_paths["ranking_loss"](torch.randn(4097), None) == "sort"
    assert triton.code_paths["similarity_xent"](q, None, 20.0, "partner", None, True, 0.0, None, (4, 8)) == "dims"
    assert triton.code_paths["similarity_xent"](q, None, 20.0, "partner") == "fused"
    wide = torch.empty(8, 4096, device="meta")
    assert triton.code_paths["similarity_xent"](wide, None, 20.0, "partner") == "dense"


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
    ident = {"capability": "9.0", "torch": "2.11", "triton": "3.6", "source": "0123456789abcdef", "gpu": "H100"}
    monkeypatch.setattr(verified, "is_verified", _REAL_IS_VERIFIED)
    monkeypatch.setattr(verified, "identity", lambda backend, op, device: ident)
    monkeypatch.setenv(verified.CACHE_ENV, str(tmp_path))
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
def _measured_here(monkeypatch, points):
    """This fake GPU (capability "fake") measured `points` in float64, the dtype of the tests' inputs."""
    monkeypatch.setattr(measured, "MEASURED", {("fake", torch.float64): tuple(points)})


def test_auto_takes_the_backend_measured_fastest_among_those_it_may_use(backends, monkeypatch):
    """Verified CUDA measured slower than torch: torch computes, and without the one-per-process warning (a GPU
    backend was verified; torch is simply faster). The Triton code path's own time is looked up first."""
    backends.cuda.answer = (True, "")
    backends.verified.update({("cuda", "similarity_xent", "fused"), ("cuda", "ranking_loss", "fused")})
    _measured_here(monkeypatch, [
        ("similarity_xent", "full", 36, 8, {"triton/fused": 1.0, "triton/dims": 9.0, "torch": 2.0, "cuda": 5.0}),
        ("ranking_loss", "full", 6, 1, {"triton": 9.0, "torch": 2.0, "cuda": 1.0}),
    ])
    auto = dispatch.resolve_backend("auto", FAKE_CUDA_TENSOR)
    q = _embeddings()  # M = Mc = 6: 36 logits, D = 8
    _, warned = _recording_warnings(auto.similarity_xent, q, None, 20.0, "partner")
    assert warned == [] and backends.computed == []  # torch computed it
    auto.ranking_loss(*_scores())
    assert backends.computed == [("cuda", "ranking_loss")]  # cuda measured fastest there
    assert auto.computes("similarity_xent", q, None, 20.0, "partner") == ("torch", "default")
    backends.verified.add(("triton", "similarity_xent", "fused"))  # now triton may: "triton/fused" is fastest
    assert auto.computes("similarity_xent", q, None, 20.0, "partner") == ("triton", "fused")


def test_auto_keeps_the_fixed_order_within_a_tie_and_where_nothing_near_was_measured(backends, monkeypatch):
    backends.cuda.answer = (True, "")
    backends.verified.update({("triton", "ranking_loss", "fused"), ("cuda", "ranking_loss", "fused"),
                              ("cuda", "pair_scores", "fused")})
    auto = dispatch.resolve_backend("auto", FAKE_CUDA_TENSOR)
    scores, labels = _scores()
    x = _embeddings().view(3, 2, 8)  # 3 pairs, D = 8
    # cuda within TIE of triton: a tie, which goes to triton; torch measured slower than both
    _measured_here(monkeypatch, [("ranking_loss", "full", 6, 1, {"triton": 1.0, "cuda": 0.95, "torch": 3.0})])
    assert auto.computes("ranking_loss", scores, labels)[0] == "triton"
    # cuda clearly faster: cuda
    _measured_here(monkeypatch, [("ranking_loss", "full", 6, 1, {"triton": 1.0, "cuda": 0.8, "torch": 3.0})])
    assert auto.computes("ranking_loss", scores, labels)[0] == "cuda"
    # the only point is more than SPAN times the call's size away: the fixed order (triton first)
    far = int(6 * measured.SPAN * 2)
    _measured_here(monkeypatch, [("ranking_loss", "full", far, 1, {"triton": 1.0, "cuda": 0.1, "torch": 3.0})])
    assert auto.computes("ranking_loss", scores, labels)[0] == "triton"
    # a point that did not time every backend auto may use compares nothing: the fixed order
    _measured_here(monkeypatch, [("pair_scores", "full", 3, 8, {"torch": 0.1, "triton": 1.0})])
    assert auto.computes("pair_scores", x, True)[0] == "cuda"
    # another variant (dims) or another dtype: not measured
    _measured_here(monkeypatch, [("pair_scores", "dims", 3, 8, {"torch": 0.1, "cuda": 1.0})])
    assert auto.computes("pair_scores", x, True)[0] == "cuda"
    monkeypatch.setattr(measured, "MEASURED", {("fake", torch.bfloat16): (
        ("pair_scores", "full", 3, 8, {"torch": 0.1, "cuda": 1.0}),)})
    assert auto.computes("pair_scores", x, True)[0] == "cuda"


def test_the_measured_points_name_real_backends_and_code_paths():
    """Every key of every point is a backend, or backend/path with a path the real op module declares; every point
    compares at least two; sizes and widths are positive."""
    paths = {("triton", "similarity_xent"): ("fused", "dense", "dims")}
    for (capability, dtype), points in measured.MEASURED.items():
        assert capability.count(".") == 1 and dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64)
        for op, variant, size, width, times in points:
            assert op in contract.OPS and variant in ("full", "dims", "margin")
            assert size > 0 and width > 0 and len(times) >= 2
            for key, ms in times.items():
                backend, _, path = key.partition("/")
                assert backend in dispatch.BACKENDS and ms > 0, key
                if path:
                    assert path in paths[(backend, op)], key
    import angle_kernels.triton_ops.similarity_xent as triton_xent

    assert tuple(triton_xent.PATHS) == paths[("triton", "similarity_xent")]


def test_on_the_h100_table_verified_cuda_yields_to_faster_torch_and_triton(backends, monkeypatch):
    """The committed H100 bf16 points: in-batch negatives at 2N = 32,768 rows, D = 768, with only CUDA's fused
    path verified, computes on torch (203 vs 535 ms); with Triton's dense path verified too, on Triton (16.8 ms);
    the ranking term at 1M scores with both verified goes to Triton (0.93 vs 44.4 ms), at 65,536 to torch."""
    monkeypatch.setattr(measured, "capability", lambda device: "9.0")
    backends.cuda.answer = (True, "")
    backends.verified.update({("cuda", "similarity_xent", "fused"), ("cuda", "ranking_loss", "fused"),
                              ("triton", "ranking_loss", "fused")})
    auto = dispatch.resolve_backend("auto", FAKE_CUDA_TENSOR)
    q = torch.empty(32768, 768, dtype=torch.bfloat16, device="meta")
    args = contract.check_similarity_xent(q, None, 20.0, "partner", None, True, 0.0, None)
    assert auto._choose("similarity_xent", args, ()).name == "torch"
    triton_ops = next(c for c in auto.candidates if c.name == "triton")
    monkeypatch.setattr(triton_ops, "code_path", lambda op, args: "dense" if op == "similarity_xent" else "fused")
    backends.verified.add(("triton", "similarity_xent", "dense"))
    assert auto._choose("similarity_xent", args, ()).name == "triton"
    for n, expected in ((1 << 20, "triton"), (1 << 16, "torch")):
        scores = torch.empty(n, dtype=torch.float32, device="meta")
        assert auto._choose("ranking_loss", (scores, scores), ()).name == expected


def test_an_empty_call_keeps_the_fixed_order(backends, monkeypatch):
    """No size to compare (an empty ranking term): the fixed order, not a log of zero."""
    backends.cuda.answer = (True, "")
    backends.verified.update({("triton", "ranking_loss", "fused"), ("cuda", "ranking_loss", "fused")})
    _measured_here(monkeypatch, [("ranking_loss", "full", 6, 1, {"triton": 9.0, "cuda": 1.0, "torch": 1.0})])
    auto = dispatch.resolve_backend("auto", FAKE_CUDA_TENSOR)
    empty = pretend_cuda(torch.empty(0, dtype=torch.float64))
    assert auto.computes("ranking_loss", empty, torch.empty(0, dtype=torch.int64))[0] == "triton"

"""How backend="auto" chooses for CUDA tensors, on a CPU-only machine.

resolve_backend only reads `is_cuda` (and `device` for messages) from its tensors, so a tiny stand-in object
plays a CUDA tensor; the optional backends are replaced by fake modules whose is_available() records how it
was asked. Checked: auto warns (RuntimeWarning, once per process and backend, with the reason) when it passes
over a GPU backend for CUDA tensors and never for CPU tensors; auto never asks the CUDA backend for its JIT
build, an explicit backend="cuda" does; and the answers of the two kinds of request are cached apart. Then the
same rule one level down: cuda_ops.is_available / _extension.load with allow_build=False never build.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType, SimpleNamespace

import pytest
import torch

import angle_kernels.cuda_ops as cuda_ops
from angle_kernels import contract, dispatch
from angle_kernels.cuda_ops import _extension

FAKE_CUDA_TENSOR = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))


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


@pytest.fixture
def backends(monkeypatch):
    """Fresh dispatch caches and fake triton / cuda backends: set `.answer` on them before resolving.

    The fake cuda backend's answer (None, why) means "compiled only if a build is allowed": without one it
    answers (False, why), with one it builds and is available.
    """
    triton = FakeBackend("fake_triton_backend", (True, ""), takes_allow_build=False)
    cuda = FakeBackend("fake_cuda_backend", (None, "no prebuilt angle_kernels._C (fake)"), takes_allow_build=True)
    for module in (triton, cuda):
        monkeypatch.setitem(sys.modules, module.__name__, module)
        for op in contract.OPS:  # one module per op, named after it (the convention dispatch relies on)
            op_module = ModuleType(f"{module.__name__}.{op}")
            setattr(op_module, op, getattr(dispatch.raw_backend("torch"), op))
            monkeypatch.setitem(sys.modules, op_module.__name__, op_module)
    monkeypatch.setattr(dispatch, "_PACKAGES", {"torch": "angle_kernels.torch_ops", "triton": triton.__name__,
                                                "cuda": cuda.__name__})
    monkeypatch.setattr(dispatch, "_loaded", {"torch": (dispatch._TORCH_OPS, "")})
    monkeypatch.setattr(dispatch, "_loaded_without_build", {})
    monkeypatch.setattr(dispatch, "_warned_fallbacks", set())
    monkeypatch.setattr(dispatch, "_auto_ops", {})
    monkeypatch.delenv("ANGLE_KERNELS_BACKEND", raising=False)
    return SimpleNamespace(triton=triton, cuda=cuda)


def _resolve_recording_warnings(requested, tensor):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ops = dispatch.resolve_backend(requested, tensor)
    return ops, [w for w in caught if issubclass(w.category, RuntimeWarning)]


def test_auto_on_cpu_tensors_is_torch_without_probing_or_warning(backends):
    module, warned = _resolve_recording_warnings("auto", torch.zeros(2, 3))
    assert module.name == "torch"
    assert warned == []
    assert backends.triton.calls == [] and backends.cuda.calls == []


def test_auto_uses_working_triton_silently(backends):
    module, warned = _resolve_recording_warnings(None, FAKE_CUDA_TENSOR)
    assert module.name == "triton"
    assert warned == []
    assert backends.cuda.calls == []  # never probed, let alone built


def test_auto_warns_once_per_backend_with_the_reason_and_never_builds(backends):
    backends.triton.answer = (False, "triton does not import: ImportError: fake libcuda mismatch")
    module, warned = _resolve_recording_warnings("auto", FAKE_CUDA_TENSOR)
    assert module.name == "torch"
    assert len(warned) == 2  # one for triton, one for cuda
    triton_message, cuda_message = (str(w.message) for w in warned)
    assert "the 'triton' backend" in triton_message and "fake libcuda mismatch" in triton_message
    assert "the 'cuda' backend" in cuda_message and "no prebuilt angle_kernels._C (fake)" in cuda_message
    for message in (triton_message, cuda_message):
        assert "backend=" in message and "ANGLE_KERNELS_BACKEND" in message
    assert warned[0].filename == __file__  # points at the caller of resolve_backend (here, this test)
    assert backends.cuda.calls == [False]  # asked without building, once

    for _ in range(3):  # cached: neither probed again nor warned again
        module, warned = _resolve_recording_warnings("auto", FAKE_CUDA_TENSOR)
        assert module.name == "torch" and warned == []
    assert backends.triton.calls == [None] and backends.cuda.calls == [False]


def test_auto_reports_a_backend_that_raises_while_probed(backends):
    def broken():
        raise OSError("libtriton.so: cannot open shared object file")

    backends.triton.is_available = broken
    module, warned = _resolve_recording_warnings("auto", FAKE_CUDA_TENSOR)
    assert module.name == "torch"
    assert "OSError" in str(warned[0].message) and "libtriton.so" in str(warned[0].message)


def test_a_backend_whose_op_module_fails_to_import_is_reported(backends, monkeypatch):
    """An available backend whose kernels do not import (a Triton API change, a missing dependency) is passed
    over with the import error as the reason, and an explicit request for it raises with that reason."""
    broken = f"{backends.triton.__name__}.ranking_loss"
    monkeypatch.delitem(sys.modules, broken)
    monkeypatch.setitem(sys.modules, "fake_kernel_dependency", None)  # what the op module imports is missing

    class Loader(importlib.abc.Loader):
        def create_module(self, spec):
            return None

        def exec_module(self, module):
            import fake_kernel_dependency  # noqa: F401

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            return importlib.util.spec_from_loader(name, Loader()) if name == broken else None

    monkeypatch.setattr(sys, "meta_path", [Finder(), *sys.meta_path])
    monkeypatch.setattr(backends.triton, "__path__", [], raising=False)  # a package, so its submodules are found
    module, warned = _resolve_recording_warnings("auto", FAKE_CUDA_TENSOR)
    assert module.name == "torch"
    assert "fake_kernel_dependency" in str(warned[0].message), warned[0].message
    with pytest.raises(RuntimeError, match="backend .triton. is not available here: .*fake_kernel_dependency"):
        dispatch.resolve_backend("triton", FAKE_CUDA_TENSOR)


def test_an_op_a_backend_lacks_goes_to_torch_under_auto_and_is_refused_when_explicit(backends, monkeypatch):
    """A backend without a module for an op (an op it does not implement yet) still serves its other ops;
    "auto" computes the missing one with the torch backend, saying so once; an explicit request raises a
    ValueError naming the op."""
    monkeypatch.setitem(sys.modules, f"{backends.triton.__name__}.ranking_loss", None)  # no such module
    scores, labels = torch.randn(6, dtype=torch.float64), torch.arange(6) % 3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ops = dispatch.resolve_backend("auto", FAKE_CUDA_TENSOR)
        assert ops.name == "triton"
        first = ops.ranking_loss(scores, labels)
        ops.ranking_loss(scores, labels)
    notes = [str(w.message) for w in caught if "does not implement ranking_loss" in str(w.message)]
    assert len(notes) == 1 and "'torch' backend" in notes[0]
    assert torch.equal(first, dispatch.ranking_loss(scores, labels, backend="torch"))
    explicit = dispatch.resolve_backend("triton", FAKE_CUDA_TENSOR)
    with pytest.raises(ValueError, match="backend 'triton' does not implement ranking_loss"):
        explicit.ranking_loss(scores, labels)


def test_auto_uses_a_prebuilt_cuda_extension(backends):
    backends.triton.answer = (False, "no triton (fake)")
    backends.cuda.answer = (True, "")
    module, warned = _resolve_recording_warnings("auto", FAKE_CUDA_TENSOR)
    assert module.name == "cuda"
    assert len(warned) == 1 and "no triton (fake)" in str(warned[0].message)  # only triton was passed over
    assert backends.cuda.calls == [False]


def test_explicit_cuda_builds_even_after_auto_found_it_unbuilt(backends):
    backends.triton.answer = (False, "no triton (fake)")
    with pytest.warns(RuntimeWarning):
        assert dispatch.resolve_backend("auto", FAKE_CUDA_TENSOR).name == "torch"
    assert backends.cuda.calls == [False]
    # auto's "not compiled" answer must not stand in for the explicit request, which may build ...
    assert dispatch.resolve_backend("cuda", FAKE_CUDA_TENSOR).name == "cuda"
    assert backends.cuda.calls == [False, True]
    # ... and once built in this process, auto uses it without asking again.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.resolve_backend("auto", FAKE_CUDA_TENSOR).name == "cuda"
    assert backends.cuda.calls == [False, True]


def test_explicit_cuda_that_cannot_run_raises_with_the_reason(backends):
    backends.cuda.answer = (False, "the JIT build of csrc/ failed: fake nvcc error")
    with pytest.raises(RuntimeError, match="fake nvcc error"):
        dispatch.resolve_backend("cuda", FAKE_CUDA_TENSOR)
    assert backends.cuda.calls == [True]


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

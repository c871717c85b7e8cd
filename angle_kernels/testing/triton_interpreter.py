"""The Triton interpreter without its repeated patching of triton.language inside a kernel (a test-speed switch).

Under TRITON_INTERPRET=1, Triton (3.x) patches triton.language when a kernel starts (every builtin of tl, tl.core,
tl.tensor and tl.math replaced by an interpreted one, each module walked with inspect.getmembers), runs the grid,
and restores the modules when the kernel ends. It also patches them again at every call of a @triton.jit helper
inside the kernel, and never restores those: a helper called in a loop walks the modules at every call. Inside a
running kernel that second patch changes nothing (the builtins are already replaced, so the walk skips them, and the
rest is set again to the same stateless functions), yet it was a quarter to two fifths of the interpreter's time on
this package's kernels, whose helpers are small and many. `skip_repatching_inside_kernels()` skips it when the
helper sees no language module the running kernel's patch did not cover, and leaves every other call to Triton: a
helper called outside a kernel, a kernel's own patch and its restore.

Only the interpreter's speed changes, never a value (tests/ops/test_triton_interpreter.py compares both ways); the
compiled kernels never pass through here. The root conftest.py switches it on for every test session that runs the
kernels through the interpreter; it refuses (returns False, changes nothing) when the installed Triton lacks the
functions it wraps.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect

# While a kernel runs under the interpreter: [the language modules (ids) its patch covers, None until the kernel's
# own patch]; None outside a kernel.
_running_kernel: list | None = None
_originals: tuple | None = None  # (interpreter module, its _patch_lang, GridExecutor.__call__) while switched on


def _language_modules(interpreter, fn) -> set[int]:
    """The language modules Triton patches for fn: triton.language and triton.language.core, where fn's module sees
    them."""
    language = (interpreter.tl, interpreter.tl.core)
    return {id(value) for value in fn.__globals__.values() if inspect.ismodule(value) and value in language}


def skip_repatching_inside_kernels() -> bool:
    """Switch the skip on (see the module's docstring); True when it is on, False when this Triton has no interpreter
    functions of the shape it wraps."""
    global _originals
    if _originals is not None:
        return True
    try:
        interpreter = importlib.import_module("triton.runtime.interpreter")
        patch_lang, grid_call = interpreter._patch_lang, interpreter.GridExecutor.__call__
        empty_scope = interpreter._LangPatchScope
    except (ImportError, AttributeError):
        return False

    def run_kernel(self, *args, **kwargs):
        global _running_kernel
        _running_kernel = [None]
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            _running_kernel = None

    def patch_unless_patched(fn):
        if _running_kernel is None:  # a helper called outside a kernel
            return patch_lang(fn)
        modules = _language_modules(interpreter, fn)
        if _running_kernel[0] is None:  # the kernel's own patch, which the kernel restores when it ends
            _running_kernel[0] = modules
            return patch_lang(fn)
        if modules <= _running_kernel[0]:  # a helper inside the kernel: its modules are patched already
            return empty_scope()
        _running_kernel[0] = _running_kernel[0] | modules  # a module the kernel did not see: Triton patches it
        return patch_lang(fn)

    _originals = (interpreter, patch_lang, grid_call)
    interpreter._patch_lang = patch_unless_patched
    interpreter.GridExecutor.__call__ = run_kernel
    return True


@contextlib.contextmanager
def repatching_inside_kernels():
    """Triton's own behaviour for the duration (the skip switched off, then on again if it was on)."""
    global _originals
    saved = _originals
    if saved is not None:
        interpreter, patch_lang, grid_call = saved
        interpreter._patch_lang, interpreter.GridExecutor.__call__ = patch_lang, grid_call
        _originals = None
    try:
        yield
    finally:
        if saved is not None:
            skip_repatching_inside_kernels()


def is_skipping() -> bool:
    """True while the skip is switched on."""
    return _originals is not None

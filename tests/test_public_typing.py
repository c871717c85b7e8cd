"""The public API is typed (PEP 561): angle_kernels ships py.typed and annotates what users call.

* Every callable a user reaches (angle_kernels.__all__, angle_kernels.functional.__all__, the modules' and the
  integrations' public classes and functions) annotates every parameter and its return (inspect, no mypy).
* tests/data/typed_usage.py, a user's script written the way the README uses the API, passes mypy with the
  strict flags below, run in a subprocess (skipped when mypy is not installed: it is in the [test] extra). The
  script's `_misuses` are calls the annotations must reject; with --warn-unused-ignores a parameter whose
  annotation stops rejecting its misuse (unannotated, or Any) fails the check.
* The script's torch-only part runs, so the calls it type-checks are real, valid calls.

mypy's flags: --strict (which includes --disallow-untyped-calls, --disallow-incomplete-defs,
--check-untyped-defs, --warn-unused-ignores and --warn-return-any) with --follow-imports=silent (only the script's
own errors count, not those inside torch or sentence-transformers) and two exceptions for third-party code:
calls into torch may be untyped (torch's Tensor.backward has no annotations: --untyped-calls-exclude=torch), and
angle-emb ships no type information (ignore_missing_imports). transformers, datasets, huggingface_hub, peft and a
few more that sentence-transformers imports (Pillow, rich, httpx and theirs) are not analysed (follow_imports=skip:
their types are Any): they would triple mypy's time, and the script does not touch them. Nor are torch's compiler,
export, quantisation and distributed packages (torch._dynamo, torch._inductor, torch.fx, torch.export, torch.ao,
torch.distributed, ...), which torch/__init__.py imports and the script never calls: with them (and those above)
mypy analysed 2,400 modules in 18 s of CPU time, without them 1,000 in 8 s. The tensor, nn and optim API that the
script uses is analysed, and --warn-unused-ignores keeps it so: a misuse let through by a skipped module's Any fails.
Time: about 8-15 s with a cold cache on a 2-core machine, 1-3 s warm; the cache lives in pytest's cache directory
(.pytest_cache/d/angle_kernels_mypy, ignored by git), or in a temporary folder when pytest's cache is off.

mypy reads the source tree (cwd and mypy_path are the checkout): an editable install (`pip install -e .`) is an
import hook that mypy does not follow.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
USAGE = REPO / "tests" / "data" / "typed_usage.py"
MYPY_TIMEOUT_S = 300

MYPY_CONFIG = """\
[mypy]
strict = True
follow_imports = silent
warn_unused_ignores = True
untyped_calls_exclude = torch
mypy_path = {repo}

[mypy-transformers.*,datasets.*,huggingface_hub.*,peft.*,accelerate.*,tokenizers.*,sklearn.*,scipy.*,pandas.*,pyarrow.*,PIL.*,rich.*,httpx.*,httpcore.*,anyio.*,idna.*,markdown_it.*,click.*,h11.*]
follow_imports = skip

[mypy-torch._inductor.*,torch._dynamo.*,torch._export.*,torch._functorch.*,torch._higher_order_ops.*,torch.ao.*,torch.distributed.*,torch.distributions.*,torch.export.*,torch.fx.*,torch.jit.*,torch.onnx.*]
follow_imports = skip

[mypy-angle_emb,angle_emb.*]
ignore_missing_imports = True
"""

# The public modules whose __all__ users import from, and whether a missing optional library skips them.
PUBLIC_MODULES = (
    ("angle_kernels", None),
    ("angle_kernels.functional", None),
    ("angle_kernels.modules", None),
    ("angle_kernels.integrations.angle_emb", None),
    ("angle_kernels.integrations.sentence_transformers", "sentence_transformers"),
)
# Gaps in files outside the typed front ends, listed so that this test still guards everything else:
# angle_kernels.input_checks (inputs.py) is a @contextmanager without a return annotation (Iterator[None]).
KNOWN_GAPS = {"angle_kernels.inputs.input_checks: return"}


def _public_module(name: str, needs: str | None) -> ModuleType | None:
    if needs is not None and importlib.util.find_spec(needs) is None:
        return None
    return importlib.import_module(name)


def _missing_annotations(func: object, qualname: str) -> list[str]:
    """'qualname: parameter' for each unannotated parameter (self/cls aside) and 'qualname: return'."""
    signature = inspect.signature(func)  # follows __wrapped__ (contextmanager, functools.wraps)
    missing = [f"{qualname}: {name}" for i, (name, p) in enumerate(signature.parameters.items())
               if p.annotation is inspect.Parameter.empty and not (i == 0 and name in ("self", "cls"))]
    if signature.return_annotation is inspect.Signature.empty:
        missing.append(f"{qualname}: return")
    return missing


def _public_members(cls: type) -> list[tuple[str, object]]:
    """(qualified name, function) of the public methods and properties angle_kernels defines for `cls`
    (its own and its angle_kernels mixins'; what it inherits from sentence-transformers is not ours)."""
    out = []
    for klass in cls.__mro__:
        if not klass.__module__.startswith("angle_kernels"):
            continue
        for attr, value in vars(klass).items():
            if attr.startswith("_") and attr not in ("__init__", "__call__"):
                continue
            if isinstance(value, property):
                value = value.fget
            if inspect.isfunction(value):
                out.append((f"{klass.__module__}.{klass.__qualname__}.{attr}", value))
    return out


def test_py_typed_ships_with_the_package():
    assert (REPO / "angle_kernels" / "py.typed").is_file()
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '[tool.setuptools.package-data]\n' in pyproject and 'angle_kernels = ["py.typed"]' in pyproject
    assert "include angle_kernels/py.typed" in (REPO / "MANIFEST.in").read_text().splitlines()


def test_every_public_signature_is_annotated():
    missing, checked, skipped = set(), 0, []
    for module_name, needs in PUBLIC_MODULES:
        module = _public_module(module_name, needs)
        if module is None:
            skipped.append(module_name)
            continue
        names = getattr(module, "__all__", None) or [n for n, v in vars(module).items() if not n.startswith("_")
                                                     and getattr(v, "__module__", None) == module_name]
        for name in names:
            value = getattr(module, name)
            if inspect.isclass(value):
                members = _public_members(value)
            elif callable(value):
                members = [(f"{value.__module__}.{value.__qualname__}", value)]
            else:  # constants: BACKENDS, __version__, PATCHED_NAMES
                continue
            for qualname, func in members:
                checked += 1
                missing.update(_missing_annotations(func, qualname))
    assert checked > 30, f"only {checked} public callables found"
    unexpected = sorted(missing - KNOWN_GAPS)
    assert not unexpected, "public callables with unannotated parameters or returns:\n  " + "\n  ".join(unexpected)
    if skipped:
        pytest.skip(f"checked {checked} callables; not installed, so not checked: {', '.join(skipped)}")


def _mypy_cache(pytestconfig, tmp_path_factory) -> Path:
    cache = getattr(pytestconfig, "cache", None)  # None with -p no:cacheprovider
    return cache.mkdir("angle_kernels_mypy") if cache is not None else tmp_path_factory.mktemp("mypy_cache")


def test_a_users_script_type_checks_strictly(pytestconfig, tmp_path, tmp_path_factory):
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (pip install mypy, or the [test] extra)")
    if importlib.util.find_spec("sentence_transformers") is None:
        pytest.skip("sentence-transformers is not installed: the script's integration part cannot be checked")
    config = tmp_path / "mypy.ini"
    config.write_text(MYPY_CONFIG.format(repo=REPO))
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(config),
           "--cache-dir", str(_mypy_cache(pytestconfig, tmp_path_factory)), str(USAGE)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=MYPY_TIMEOUT_S)
    seconds = time.perf_counter() - start
    print(f"mypy --strict on {USAGE.name}: {seconds:.1f} s")
    assert proc.returncode == 0, (
        f"mypy found type errors in {USAGE.relative_to(REPO)} (exit {proc.returncode}, {seconds:.1f} s); an "
        f"'unused \"type: ignore\" comment' means an annotation no longer rejects that misuse:\n"
        f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}")


def test_the_users_script_runs():
    spec = importlib.util.spec_from_file_location("typed_usage", USAGE)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    import torch

    values = script.functional_losses() + script.modules()
    assert len(values) >= 30
    assert all(v.dim() == 0 and torch.isfinite(v) for v in values)
    script.switches()

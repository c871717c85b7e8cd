"""The developer docs name files and definitions that exist.

Every repository path the docs name (`angle_kernels/...`, `tests/...`, `bench/...`, `scripts/...`, `csrc/...`,
`docs/...`, `angle_train/...`, ending in a source or document suffix) is a file of this checkout, and every dotted
name in backticks whose first part is a module of the package (`verified.paths_of`, `measured.AFTER_TORCH`,
`angle_kernels.first_use.CHECKER`) resolves to a module or attribute. Templates (`<op>`, `{a,b}`, `*`) are skipped.
CHANGELOG.md is history and names what has since moved; it is not read.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import angle_kernels

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", ROOT / "bench" / "README.md", ROOT / "angle_train" / "README.md",
               *(ROOT / "docs").glob("*.md")])

PATH = re.compile(r"(?<![\w./-])((?:angle_kernels|angle_train|tests|bench|scripts|csrc|docs)/[\w./<>{},*-]*"
                  r"\.(?:py|md|sh|cu|cpp|h|cuh|json))")
DOTTED = re.compile(r"(?<![\w/.])([a-z_]\w*(?:\.[A-Za-z_]\w*)+)")
FILE_SUFFIXES = (".py", ".md", ".json", ".sh", ".cu", ".cpp", ".h", ".cuh", ".lock", ".log", ".csv", ".txt")


def _modules() -> dict[str, list[str]]:
    """Short module name -> the full names of the package's modules of that name (`similarity_xent` is one module in
    each backend's folder); the integrations' modules, named after the packages they integrate (`angle_emb.loss` is
    angle-emb's), only as `integrations.<name>`."""
    found: dict[str, list[str]] = {}
    for info in pkgutil.walk_packages(angle_kernels.__path__, "angle_kernels."):
        if not info.name.startswith("angle_kernels.integrations."):
            found.setdefault(info.name.rsplit(".", 1)[-1], []).append(info.name)
    return {**found, "angle_kernels": ["angle_kernels"]}


def _resolves_in(module: str, rest: list[str]) -> bool | None:
    """Whether `rest` names a submodule or attribute path of `module`; None where the module cannot be imported here
    (an optional dependency missing): not known."""
    try:
        obj = importlib.import_module(module)
    except ImportError:
        return None
    for part in rest:
        try:
            obj = importlib.import_module(f"{module}.{part}")
            module = f"{module}.{part}"
            continue
        except ImportError:
            pass
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def _resolves(name: str, modules: dict[str, list[str]]) -> bool | None:
    """None: not a name of the package, or not known here; else whether it resolves in one of the modules its first
    part may be (a short name shared by several modules is right where it resolves in any)."""
    first, *rest = name.split(".")
    if first not in modules:
        return None
    outcomes = [_resolves_in(module, rest) for module in modules[first]]
    return True if True in outcomes else (False if False in outcomes else None)


def stale_names(text: str, modules: dict[str, str]) -> list[str]:
    """The paths and package names of `text` that do not exist, as 'line N: name'."""
    stale = []
    for number, line in enumerate(text.splitlines(), 1):
        for path in PATH.findall(line):
            if not any(c in path for c in "<>{}*") and not (ROOT / path).exists():
                stale.append(f"line {number}: {path}")
        for code in re.findall(r"`([^`]+)`", line):
            for name in DOTTED.findall(code):
                if not name.endswith(FILE_SUFFIXES) and _resolves(name, modules) is False:
                    stale.append(f"line {number}: {name}")
    return stale


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_docs_name_only_what_exists(doc):
    assert stale_names(doc.read_text(), _modules()) == []


def test_the_check_sees_a_stale_path_and_a_stale_name():
    text = ("`angle_kernels/no_such_module.py` and docs/no-such-page.md; `verified.NO_SUCH_TABLE`, "
            "`angle_kernels.first_use.CHECKER`, `csrc/<op>.cu`, `angle_emb.loss.cosine_loss`")
    assert stale_names(text, _modules()) == ["line 1: angle_kernels/no_such_module.py", "line 1: docs/no-such-page.md",
                                             "line 1: verified.NO_SUCH_TABLE"]

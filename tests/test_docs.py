"""The developer docs name files and definitions that exist.

Every repository path the docs name (`angle_kernels/...`, `tests/...`, `bench/...`, `scripts/...`, `csrc/...`,
`docs/...`, `angle_train/...`, ending in a source or document suffix) is a file of this checkout, every dotted
name in backticks whose first part is a module of angle_kernels or angle_train (`verified.paths_of`,
`measured.AFTER_TORCH`, `angle_kernels.first_use.CHECKER`, `sharding.load_sharded`) resolves to a module or
attribute, and every test the docs name (`test_a_zero_prefix_of_a_huge_row`, or `tests/ops/test_x.py::test_y`, in
that file) is a test function of tests/ or bench/, or a test module's name. Every flag angle_train/README.md names
is one of `angle-train` or `angle-eval`, or one of another program's it names (`FOREIGN_FLAGS`). Templates (`<op>`,
`{a,b}`, `*`) are skipped. CHANGELOG.md is history and names what has since moved; it is not read.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import angle_kernels
import angle_train

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", ROOT / "bench" / "README.md", ROOT / "angle_train" / "README.md",
               *(ROOT / "docs").glob("*.md")])

PATH = re.compile(r"(?<![\w./-])((?:angle_kernels|angle_train|tests|bench|scripts|csrc|docs)/[\w./<>{},*-]*"
                  r"\.(?:py|md|sh|cu|cpp|h|cuh|json))")
DOTTED = re.compile(r"(?<![\w/.])([a-z_]\w*(?:\.[A-Za-z_]\w*)+)")
FILE_SUFFIXES = (".py", ".md", ".json", ".sh", ".cu", ".cpp", ".h", ".cuh", ".lock", ".log", ".csv", ".txt")
# A test named by itself (not a test module's file name), and a test named in its file (the name may start the next
# line of a wrapped `path::name`).
TEST_NAME = re.compile(r"(?<![\w/<>])(test_\w+)\b(?!\.py|[<>{*])")
TEST_IN_FILE = re.compile(r"((?:tests|bench)/[\w/]+\.py)::\s*(test_\w+)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][\w-]*[a-z0-9])")
# The flags angle_train/README.md gives to programs other than angle-train and angle-eval: each is checked to occur
# there, so that one the README no longer names leaves this list.
FOREIGN_FLAGS = {
    "--nproc-per-node": "torchrun",
    "--shutdown-timeout": "torchrun",
    "--local-dir": "huggingface-cli download",
    "--pretrained_lora_path": "angle-emb's training script",
    "--gpu": "bench/bench_training.py",
    "--train-bench": "bench/gpu_suite.py",
    "--bach-size": "angle_train/README's misspelt flag, which angle-train answers with the one meant",
}
TEST_SOURCES = sorted([*(ROOT / "tests").rglob("test_*.py"), *(ROOT / "bench").glob("test_*.py")])


def _modules() -> dict[str, list[str]]:
    """Short module name -> the full names of the packages' modules of that name (`similarity_xent` is one module in
    each backend's folder, `distributed` one of angle_kernels and one of angle_train); the integrations' modules,
    named after the packages they integrate (`angle_emb.loss` is angle-emb's), only as `integrations.<name>`."""
    found: dict[str, list[str]] = {}
    for package in (angle_kernels, angle_train):
        for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            if not info.name.startswith("angle_kernels.integrations."):
                found.setdefault(info.name.rsplit(".", 1)[-1], []).append(info.name)
    return {**found, "angle_kernels": ["angle_kernels"], "angle_train": ["angle_train"]}


def _tests() -> dict[str, set[str]]:
    """The test functions of the suite by file (relative to the checkout), and the test modules' names under "",
    read from the sources (a test is named by its definition; importing every test module would take long)."""
    found = {str(path.relative_to(ROOT)): set(re.findall(r"^\s*(?:async\s+)?def (test_\w+)", path.read_text(), re.M))
             for path in TEST_SOURCES}
    return {**found, "": {path.stem for path in TEST_SOURCES}}


def stale_tests(text: str, tests: dict[str, set[str]]) -> list[str]:
    """The tests `text` names that the suite does not define, as 'line N: name' (or 'line N: path::name' for one
    that its file does not define)."""
    anywhere = set().union(*tests.values())
    stale, reported = [], set()
    for match in TEST_IN_FILE.finditer(text):
        path, name = match.groups()
        if name not in tests.get(path, ()):
            stale.append(f"line {text.count(chr(10), 0, match.start()) + 1}: {path}::{name}")
            reported.add(name)
    for number, line in enumerate(text.splitlines(), 1):
        stale += [f"line {number}: {name}" for name in TEST_NAME.findall(line)
                  if name not in anywhere and name not in reported]
    return stale


def _cli_flags() -> set[str]:
    """Every option string of `angle-train` and `angle-eval`, aliases included."""
    from angle_train import cli, evaluate

    return {flag for module in (cli, evaluate) for flag in module.build_parser()._option_string_actions}


def unknown_flags(text: str, flags: set[str]) -> list[str]:
    """The flags of `text` that are not in `flags`, as 'line N: flag'."""
    return [f"line {number}: {flag}" for number, line in enumerate(text.splitlines(), 1)
            for flag in FLAG.findall(line) if flag not in flags]


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


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_docs_name_only_tests_that_exist(doc):
    assert stale_tests(doc.read_text(), _tests()) == []


def test_the_training_readme_names_only_flags_that_exist():
    text, flags = (ROOT / "angle_train" / "README.md").read_text(), _cli_flags()
    assert unknown_flags(text, flags | set(FOREIGN_FLAGS)) == []
    assert set(FOREIGN_FLAGS) <= set(FLAG.findall(text)) and not set(FOREIGN_FLAGS) & flags


def test_the_check_sees_a_stale_path_and_a_stale_name():
    text = ("`angle_kernels/no_such_module.py` and docs/no-such-page.md; `verified.NO_SUCH_TABLE`, "
            "`angle_kernels.first_use.CHECKER`, `csrc/<op>.cu`, `angle_emb.loss.cosine_loss`,\n"
            "`sharding.load_sharded`, `sharding.NO_SUCH_LOADER`, `angle_train.no_such_function`")
    assert stale_names(text, _modules()) == ["line 1: angle_kernels/no_such_module.py", "line 1: docs/no-such-page.md",
                                             "line 1: verified.NO_SUCH_TABLE", "line 2: sharding.NO_SUCH_LOADER",
                                             "line 2: angle_train.no_such_function"]


def test_the_check_sees_a_renamed_flag():
    text = "`angle-train --max-length 64 --max-lenght 64`,\n--lora-r 8 (`--mask-rates 0.2`); `--no-such-flag`, --config"
    assert unknown_flags(text, _cli_flags()) == ["line 1: --max-lenght", "line 2: --no-such-flag"]


def test_the_check_sees_a_renamed_test():
    text = ("`test_the_check_sees_a_renamed_test` in tests/test_docs.py, `test_no_such_test`, `tests/test_docs.py::\n"
            "  test_the_check_sees_a_renamed_test`, `tests/test_docs.py::test_a_zero_prefix_of_a_huge_row`, "
            "`test_bad_inputs`, `test_<op>_rejects`, `tests/test_<area>_losses.py`")
    assert stale_tests(text, _tests()) == ["line 2: tests/test_docs.py::test_a_zero_prefix_of_a_huge_row",
                                           "line 1: test_no_such_test"]

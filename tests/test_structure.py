"""The architecture's import rules, read from the source (every import statement, at module level or inside a
function; `if TYPE_CHECKING:` blocks excluded, since they never run):

* backends are siblings over the contract: no module of `torch_ops`, `triton_ops` or `cuda_ops` imports the
  dispatcher or another backend;
* Triton op modules import shared tiles downward: none imports another op module's private (`_`) names;
* no import cycle among the modules of `angle_kernels` and `angle_train`;
* no two test modules of the suite share a file name (pytest imports them by it).

A negative control for each rule runs the same checker over a small tree written here, so a checker that stopped
seeing imports would fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("angle_kernels", "angle_train")
BACKENDS = ("torch_ops", "triton_ops", "cuda_ops")


def module_files(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every module of `packages` under `root` (a package is its __init__)."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _runs(node: ast.AST, parents: dict) -> bool:
    """False for an import inside `if TYPE_CHECKING:` (annotations only: it never executes)."""
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return False
    return True


def imports_of(name: str, path: Path, modules: dict) -> list[tuple[str, tuple[str, ...]]]:
    """(imported module, names taken from it) for every import in the file that reaches `modules`. `from P
    import x` where P.x is a module imports P.x (and the package P, whose __init__ runs)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or not _runs(node, parents):
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, ()) for alias in node.names if alias.name in modules]
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")
            anchor = anchor[: len(anchor) - node.level + 1]
            base = ".".join(anchor + ([base] if base else []))
        taken = []
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            if submodule in modules:
                found.append((submodule, ()))
            else:
                taken.append(alias.name)
        if taken and base in modules:
            found.append((base, tuple(taken)))
    return found


def import_graph(modules: dict) -> dict[str, list[tuple[str, tuple[str, ...]]]]:
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def backend_violations(graph: dict) -> list[str]:
    bad = []
    for name, edges in graph.items():
        parts = name.split(".")
        if len(parts) < 2 or parts[0] != "angle_kernels" or parts[1] not in BACKENDS:
            continue
        for target, _ in edges:
            tparts = target.split(".")
            if target == "angle_kernels.dispatch" or (len(tparts) > 1 and tparts[1] in BACKENDS
                                                     and tparts[1] != parts[1]):
                bad.append(f"{name} imports {target}")
    return bad


def private_name_violations(graph: dict) -> list[str]:
    """A Triton op module (a public module of triton_ops) taking `_names` from another op module."""
    def is_op(module: str) -> bool:
        parts = module.split(".")
        return parts[:2] == ["angle_kernels", "triton_ops"] and len(parts) == 3 and not parts[2].startswith("_")

    return [f"{name} takes {', '.join(n for n in names if n.startswith('_'))} from {target}"
            for name, edges in graph.items() if is_op(name)
            for target, names in edges
            if is_op(target) and target != name and any(n.startswith("_") for n in names)]


def cycles(graph: dict) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan), or a module importing itself."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target, _ in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or any(t == node for t, _ in graph.get(node, ())):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.fixture(scope="module")
def graph():
    return import_graph(module_files(REPO))


def test_no_backend_imports_the_dispatcher_or_another_backend(graph):
    assert not backend_violations(graph)


def test_no_triton_op_module_takes_another_ops_private_names(graph):
    assert not private_name_violations(graph)


def test_no_import_cycle_in_the_packages(graph):
    assert not cycles(graph)


def test_the_checker_sees_each_violation(tmp_path):
    """Negative controls: a tree that breaks every rule once, each found."""
    files = {
        "angle_kernels/__init__.py": "",
        "angle_kernels/dispatch.py": "from .torch_ops import ops\n",
        "angle_kernels/torch_ops/__init__.py": "",
        "angle_kernels/torch_ops/ops.py": "def f():\n    from ..triton_ops.b import g\n",
        "angle_kernels/triton_ops/__init__.py": "",
        "angle_kernels/triton_ops/a.py": "from ..dispatch import x\nfrom .b import _tile, public\n",
        "angle_kernels/triton_ops/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import y\n",
        "angle_kernels/triton_ops/_tiles.py": "",
        "angle_kernels/triton_ops/c.py": "from ._tiles import _fine\n",
        "angle_train/__init__.py": "",
        "angle_train/one.py": "from angle_train import two\n",
        "angle_train/two.py": "def f():\n    import angle_train.one\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    made = import_graph(module_files(tmp_path))
    assert sorted(backend_violations(made)) == [
        "angle_kernels.torch_ops.ops imports angle_kernels.triton_ops.b",
        "angle_kernels.triton_ops.a imports angle_kernels.dispatch"]
    assert private_name_violations(made) == ["angle_kernels.triton_ops.a takes _tile from angle_kernels.triton_ops.b"]
    # a.py -> b.py only under TYPE_CHECKING, so no cycle there; one.py <-> two.py is one (a function-level import)
    assert cycles(made) == [["angle_train.one", "angle_train.two"]]


def test_no_module_reads_an_ops_arguments_by_position():
    """The ops' validated arguments travel as calls read by name (contract.check_<op> returns the op's dataclass;
    only the backends receive `call.args`, positionally): no top-level module of angle_kernels (angle_kernels/*.py,
    not the backends' packages, testing/ or another subpackage) subscripts `args` or `.args` with an integer
    (args[0], args[-1]). Negative control: a small source that does, each read found, and the reads that are not by
    position (args[i], args[1:]) not."""
    def positional_reads(source: str, name: str) -> list[str]:
        found = []
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.Subscript):
                continue
            target = node.value
            if not ((isinstance(target, ast.Name) and target.id == "args")
                    or (isinstance(target, ast.Attribute) and target.attr == "args")):
                continue
            index = node.slice
            if isinstance(index, ast.UnaryOp) and isinstance(index.op, ast.USub):
                index = index.operand
            if isinstance(index, ast.Constant) and isinstance(index.value, int):
                found.append((node.lineno, node.col_offset, f"{name}:{node.lineno}: {ast.unparse(node)}"))
        return [read for _, _, read in sorted(found)]  # in source order (ast.walk goes breadth first)

    modules = sorted((REPO / "angle_kernels").glob("*.py"))  # the package's own modules, not its subpackages
    assert any(path.name == "dispatch.py" for path in modules)
    assert [read for path in modules for read in positional_reads(path.read_text(), path.name)] == []
    control = "def f(args, call, i):\n    return args[0] + args[-1] + call.args[2] + args[i] + args[1:]\n"
    assert positional_reads(control, "control.py") == [
        "control.py:2: args[0]", "control.py:2: args[-1]", "control.py:2: call.args[2]"]


# ---------------------------------------------------------------------------------------------------------
# A loss call reaches its backend op through few package files
# ---------------------------------------------------------------------------------------------------------
MAX_FILES_BEFORE_THE_OP = 4


def files_before_the_op(call) -> list[str]:
    """The files of angle_kernels (relative paths) whose code runs while `call()` makes its first backend op call,
    in the order they are entered, up to the op module of the backend (torch_ops/, triton_ops/, cuda_ops/)."""
    import sys

    import angle_kernels

    root = str(Path(angle_kernels.__file__).parent)
    entered: list[str] = []
    reached = []

    def profile(frame, event, arg):
        if event != "call" or reached:
            return
        name = frame.f_code.co_filename
        if not name.startswith(root):
            return
        relative = Path(name).relative_to(root).as_posix()
        if relative.split("/")[0] in BACKENDS:
            reached.append(relative)
        elif relative not in entered:
            entered.append(relative)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(previous)
    assert reached, "the call never reached a backend op"
    return entered


def test_a_loss_call_reaches_its_backend_op_through_at_most_four_files():
    """in_batch_negative_loss and multiple_negatives_ranking_loss on CPU: the family's module, the input checks,
    dispatch and the op's contract, nothing more (traced)."""
    import torch

    import angle_kernels as ak

    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(16, 8, generator=gen, requires_grad=True)
    labels = torch.tensor([1.0, 1.0, 0.0, 0.0] * 4)
    calls = {
        "in_batch_negative_loss": lambda: ak.in_batch_negative_loss(labels, rows),
        "multiple_negatives_ranking_loss": lambda: ak.multiple_negatives_ranking_loss(rows[:8], rows[8:]),
        "cosine_loss": lambda: ak.cosine_loss(labels, rows),
    }
    for name, call in calls.items():
        files = files_before_the_op(call)
        assert len(files) <= MAX_FILES_BEFORE_THE_OP, f"{name}: {files}"


def test_the_file_count_sees_every_file_entered():
    """The negative control: the same loss call after a call into one more package file counts one file more."""
    import torch

    import angle_kernels as ak
    from angle_kernels import distributed

    labels, rows = torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.randn(4, 6)
    alone = files_before_the_op(lambda: ak.cosine_loss(labels, rows))

    def after_one_more():
        distributed.rank_and_world_size()
        ak.cosine_loss(labels, rows)

    assert files_before_the_op(after_one_more) == ["distributed.py", *alone]


def test_no_two_test_modules_share_a_file_name():
    """pytest imports each test module by its file name (the test folders are no packages): two test_x.py in
    different folders fail the whole run at collection, which a run of either file alone never shows."""
    seen: dict[str, Path] = {}
    for folder in ("tests", "bench"):  # pyproject.toml's testpaths
        for path in sorted((REPO / folder).rglob("test_*.py")):
            assert path.name not in seen, f"{path} and {seen[path.name]} share a name"
            seen[path.name] = path
    assert "test_structure.py" in seen and "test_harness.py" in seen  # both folders were read

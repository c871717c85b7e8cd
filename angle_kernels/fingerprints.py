"""Fingerprints of the code a GPU code path executes: what a verification on a GPU is matched against.

A verification (`angle_kernels.verified`) says that one code path of one op of a GPU backend computed the contract
correctly on some GPU. It stays valid exactly as long as the code that path executes is unchanged, so its
fingerprint covers that code and nothing else:

    * Python (the Triton kernels and every launcher): the path's roots (`PATH_CODE`: the backend's op function,
      minus what other paths of the op run) and every first-party definition they reach, followed name by name
      through imports and `module.attribute` references: `@triton.jit` kernels, autograd Functions, grids and
      strides, autotune configs and keys, `reset_to_zero`, constexpr values, the torch products of the dense scheme,
      helpers and constants of any module of the package. Each definition enters as its syntax tree without
      docstrings (comments are not in the tree), keyed by its own name, not its module: editing a docstring or a
      comment, reformatting, or moving a function to another module (imported by name) changes nothing; any edit
      to what a definition executes changes the fingerprint of exactly the paths that reach it.
    * A module's registrations (top-level statements that are not definitions, such as
      `torch.library.register_autograd`, and functions registered by a decorator other than Triton's) run whenever
      the module is used: they enter with the first definition of their module that a path reaches.
    * CUDA C++ (`csrc_fingerprint`): per op, csrc/<op>.cu and csrc/<op>.cpp with the csrc/ headers they include,
      comments and blank lines removed, and the compiler flags of the build; a code path whose kernels live in
      sources of their own (`CSRC_SOURCES`: the CUDA similarity_xent's dense scheme, csrc/similarity_xent_dense.*)
      takes those instead, so that editing them voids its verifications and not those of the op's other paths. The
      extension is built with every source's fingerprint compiled in and reports them
      (`cuda_ops._extension.build_fingerprints`).

Which path a call takes is not part of any path: each op's selector (`SELECTORS`, e.g. the Triton similarity_xent's
`code_path`, with the dense scheme's MIN_WIDTH) only decides which inputs reach which path (and a router,
`ROUTERS`, only calls the launcher of the path it names); every path computes
the whole contract for any input it receives (the CPU tests run every path on every case, the selector's thresholds
lowered), so moving a threshold changes no path's code. docs/verification.md has the reasoning and the evidence
this relies on.

The sources are read from a `Tree`: this installation's files, or (scripts/compare_fingerprints.py) a commit of
the repository, so that a fingerprint of the same rule can be computed for old code.
"""

from __future__ import annotations

import ast
import hashlib
import pickle
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator

PACKAGE = "angle_kernels"
_ROOT = Path(__file__).resolve().parent.parent  # the folder holding the package (and, in a checkout, csrc/)


# ---------------------------------------------------------------------------------------------------------
# What each path runs
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PathCode:
    """A code path's roots ("module:name", module relative to the package) and the definitions it never runs
    although its roots name them (another path's kernels behind a branch): "module:name", or a bare name for a
    definition wherever it lives. The op's selector is skipped on every path (module docstring)."""

    roots: tuple[str, ...]
    skips: tuple[str, ...] = ()


# The function of each (backend, op) that decides which path a call takes.
SELECTORS: dict[tuple[str, str], str] = {
    ("triton", "pair_scores"): "triton_ops.pair_scores_paths:code_path",
    ("triton", "ranking_loss"): "triton_ops.ranking_loss:code_path",
    ("triton", "similarity_xent"): "triton_ops.similarity_xent_paths:code_path",
    ("triton", "similarity_lse"): "triton_ops.similarity_lse_paths:code_path",
    ("torch", "similarity_xent"): "torch_ops.similarity_xent:code_path",
    ("cuda", "pair_scores"): "cuda_ops.pair_scores:code_path",
    ("cuda", "similarity_xent"): "cuda_ops.similarity_xent_paths:code_path",
    ("cuda", "similarity_lse"): "cuda_ops.similarity_lse:code_path",
}

# The op functions that only call the launcher of the path their op's selector names (an op whose paths live in
# several modules: the Triton similarity_xent's, similarity_xent_paths.py), part of no path as the selectors are.
# tests/ops/test_fingerprint_completeness.py traces each path through them: a router that called another path's
# launcher would run code outside the path's fingerprint.
ROUTERS: dict[tuple[str, str], str] = {
    ("triton", "similarity_xent"): "triton_ops.similarity_xent_paths:similarity_xent",
    ("triton", "pair_scores"): "triton_ops.pair_scores_paths:pair_scores",
    ("triton", "similarity_lse"): "triton_ops.similarity_lse_paths:similarity_lse",
    ("cuda", "similarity_xent"): "cuda_ops.similarity_xent_paths:similarity_xent",
    # On CPU tensors its "default" path computes in the softmax form (_similarity_xent_softmax.py): no GPU runs that,
    # so it is in no fingerprint; on a GPU the router calls the root of both paths below.
    ("torch", "similarity_xent"): "torch_ops.similarity_xent_paths:similarity_xent",
    # Likewise: on CPU tensors it computes cosines at full width in the softmax form (_similarity_lse_softmax.py).
    ("torch", "similarity_lse"): "torch_ops.similarity_lse_paths:similarity_lse",
}

_XENT = "triton_ops.similarity_xent:similarity_xent"
# similarity_xent.py's own selector, which its entry function (the root of its three paths) calls: skipped by them
# as the op's selector is (the op's is triton_ops.similarity_xent_paths:code_path, which calls it).
_XENT_SELECTOR = "triton_ops.similarity_xent:code_path"
_TORCH_XENT = "torch_ops.similarity_xent:similarity_xent"
PATH_CODE: dict[tuple[str, str, str], PathCode] = {
    ("triton", "pair_scores", "full"): PathCode(("triton_ops.pair_scores:pair_scores",),
                                                ("PrefixPairScoresFunction",)),
    ("triton", "pair_scores", "dims"): PathCode(("triton_ops.pair_scores:pair_scores",), ("PairScoresFunction",)),
    ("triton", "pair_scores", "dims_one_read"): PathCode(("triton_ops._pair_scores_one_read:pair_scores",)),
    ("triton", "ranking_loss", "pairwise"): PathCode(("triton_ops.ranking_loss:ranking_loss",), ("_log_sums_sorted",)),
    ("triton", "ranking_loss", "sort"): PathCode(("triton_ops.ranking_loss:ranking_loss",), ("_log_sums_tiled",)),
    ("triton", "similarity_xent", "fused"): PathCode(
        (_XENT,), (_XENT_SELECTOR, "triton_ops.similarity_xent_dense:similarity_xent", "_PREFIX_TUNED",
                   "_similarity_xent_prefix_bwd_finish_kernel")),
    ("triton", "similarity_xent", "dense"): PathCode((_XENT,), (_XENT_SELECTOR, "SimilarityXentFunction")),
    ("triton", "similarity_xent", "dims"): PathCode(
        (_XENT,), (_XENT_SELECTOR, "triton_ops.similarity_xent_dense:similarity_xent", "_TUNED",
                   "_similarity_xent_bwd_finish_kernel")),
    ("triton", "similarity_xent", "dense_dims"): PathCode(("triton_ops._similarity_xent_dense_dims:similarity_xent",)),
    ("triton", "similarity_lse", "fused"): PathCode(("triton_ops.similarity_lse:similarity_lse",)),
    ("triton", "similarity_lse", "dense"): PathCode(("triton_ops._similarity_lse_dense:similarity_lse",)),
    ("triton", "similarity_lse", "dense_dims"): PathCode(("triton_ops._similarity_lse_dense:similarity_lse_dims",)),
    ("triton", "similarity_lse", "fused_prefixes"): PathCode(("triton_ops.similarity_lse_paths:fused_prefixes",)),
    ("cuda", "pair_scores", "full"): PathCode(("cuda_ops.pair_scores:pair_scores",), ("_prefixes",)),
    ("cuda", "pair_scores", "dims"): PathCode(("cuda_ops.pair_scores:pair_scores",), ("_single_width",)),
    ("cuda", "ranking_loss", "sort"): PathCode(("cuda_ops.ranking_loss:ranking_loss",)),
    ("cuda", "similarity_xent", "fused"): PathCode(("cuda_ops.similarity_xent:similarity_xent",)),
    ("cuda", "similarity_xent", "dense"): PathCode(("cuda_ops.similarity_xent_dense:similarity_xent",)),
    ("cuda", "similarity_xent", "dense_dims"): PathCode(("cuda_ops.similarity_xent_dense:similarity_xent_dims",)),
    ("cuda", "similarity_lse", "dense"): PathCode(("cuda_ops.similarity_lse:similarity_lse",)),
    ("cuda", "similarity_lse", "dense_dims"): PathCode(("cuda_ops.similarity_lse:similarity_lse",)),
    # The PyTorch backend: its default paths need no verification (the CPU tests verify them everywhere), but the
    # speed table (angle_kernels.measured) records what it timed by these fingerprints too; its GPU path "mixed"
    # (16-bit products) is verified like the GPU backends' paths.
    **{("torch", op, "default"): PathCode((f"torch_ops.{op}:{op}",))
       for op in ("pair_scores", "ranking_loss", "similarity_lse")},
    ("torch", "similarity_xent", "default"): PathCode(
        (_TORCH_XENT,), ("MixedSimilarityXentFunction", "MixedPrefixSimilarityXentFunction", "_mixed_product_into")),
    ("torch", "similarity_xent", "mixed"): PathCode(
        (_TORCH_XENT,), ("SimilarityXentFunction", "PrefixSimilarityXentFunction")),
}

# The CUDA sources (csrc/<name>.cu, csrc/<name>.cpp and their headers) of the CUDA code paths whose kernels are not
# their op's (csrc/<op>.*): (op, path) -> name. Every other CUDA path runs its op's.
CSRC_SOURCES: dict[tuple[str, str], str] = {
    ("similarity_xent", "dense"): "similarity_xent_dense",
    ("similarity_xent", "dense_dims"): "similarity_xent_dense",
}


def csrc_source(op: str, path: str) -> str:
    """The name of the CUDA sources a CUDA code path runs (csrc_fingerprint's argument): CSRC_SOURCES', else the
    op's."""
    return CSRC_SOURCES.get((op, path), op)


# Decorators that only wrap the function they decorate (a kernel, a method): anything else registers it somewhere
# (torch.library.register_fake, ...), which makes it run without being named.
_WRAPPING_DECORATORS = ("triton.jit", "triton.autotune", "triton.heuristics", "staticmethod", "classmethod",
                        "property", "once_differentiable", "functools.wraps")


# ---------------------------------------------------------------------------------------------------------
# Sources: a tree of files
# ---------------------------------------------------------------------------------------------------------
class Tree:
    """Files by their path relative to the folder holding the package ("angle_kernels/x.py", "csrc/x.cu")."""

    def __init__(self, read: Callable[[str], "str | None"], name: str):
        self._read = read
        self.name = name
        self.parsed: _Source | None = None  # its modules, parsed once (a tree's files do not change)

    def read(self, relative: str) -> str | None:
        return self._read(relative)


def folder_tree(root: Path = _ROOT) -> Tree:
    """The files under `root` (by default this installation: the package's parent folder)."""

    def read(relative: str) -> str | None:
        path = root / relative
        return path.read_text(encoding="utf-8") if path.is_file() else None

    return Tree(read, str(root))


# ---------------------------------------------------------------------------------------------------------
# Canonical form of a definition: its syntax tree without docstrings, stable across Python versions
# ---------------------------------------------------------------------------------------------------------
def _normalised(node: ast.AST) -> ast.AST:
    """The definition without its docstrings and import statements (in place). An import only binds a name; what
    it binds is followed by the closure (a first-party definition enters on its own), so where a function imports
    something, at module level or inside itself, changes nothing that runs."""
    for child in ast.walk(node):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(child, field, None)
            if not isinstance(block, list) or not block:
                continue
            if (field == "body" and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                    and isinstance(block[0], ast.Expr) and isinstance(block[0].value, ast.Constant)
                    and isinstance(block[0].value.value, str)):
                block = block[1:]
            block = [s for s in block if not isinstance(s, (ast.Import, ast.ImportFrom))]
            setattr(child, field, block or [ast.Pass()])
    return node


def canonical(node: ast.AST) -> str:
    """The syntax tree as text: node types and fields, without positions, docstrings, empty lists and None (so
    fields a newer Python adds empty, such as 3.12's type_params, leave it unchanged)."""
    if isinstance(node, ast.AST):
        fields = []
        for name, value in ast.iter_fields(node):
            if value is None or value == []:
                continue
            fields.append(f"{name}={canonical(value)}")
        return f"{type(node).__name__}({','.join(fields)})"
    if isinstance(node, list):
        return "[" + ",".join(canonical(item) for item in node) + "]"
    return f"{type(node).__name__}:{node!r}"


# ---------------------------------------------------------------------------------------------------------
# A module's definitions and imports
# ---------------------------------------------------------------------------------------------------------
_REGISTRATIONS = "<registrations>"


@dataclass
class _Module:
    name: str  # relative to the package: "triton_ops._common"
    defs: dict  # name -> [statements]
    imports: dict  # name -> ("module", dotted) | ("from", dotted module, name)
    is_package: bool
    # Per statement of defs (by id: this object holds them), what closures need of it, computed once: the paths
    # share most of their definitions.
    _canonical_texts: dict = field(default_factory=dict)
    _statement_references: dict = field(default_factory=dict)

    def canonical_text(self, statement: ast.AST) -> str:
        """The statement's canonical form without docstrings and imports (of a copy: pickling copies a syntax
        tree several times faster than copy.deepcopy)."""
        key = id(statement)
        if key not in self._canonical_texts:
            self._canonical_texts[key] = canonical(_normalised(pickle.loads(pickle.dumps(statement))))
        return self._canonical_texts[key]

    def references(self, statement: ast.AST) -> tuple[dict, tuple]:
        """(the names the statement's own imports bind, the names it references: _references)."""
        key = id(statement)
        if key not in self._statement_references:
            self._statement_references[key] = (_bindings(self.name, self.is_package, [statement]),
                                               tuple(_references(statement)))
        return self._statement_references[key]


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Call):
        node = node.func
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _registers(statement: ast.AST) -> bool:
    """A top-level definition whose decorator registers it (it runs without being named)."""
    decorators = getattr(statement, "decorator_list", [])
    return any(not _dotted(d).startswith(_WRAPPING_DECORATORS) for d in decorators)


def _absolute(module: str, is_package: bool, level: int, target: str | None) -> str | None:
    """The package-relative dotted name of an import's module, or None when it is not first-party."""
    if level == 0:
        if target is None or not (target == PACKAGE or target.startswith(PACKAGE + ".")):
            return None
        return target[len(PACKAGE) + 1:]
    parts = module.split(".") if module else []
    if not is_package:
        parts = parts[:-1]
    if level > 1:
        if level - 1 > len(parts):
            return None
        parts = parts[:len(parts) - (level - 1)]
    if target:
        parts += target.split(".")
    return ".".join(parts)


def _bindings(module: str, is_package: bool, statements) -> dict:
    """Names bound by the import statements among `statements` (anywhere inside them)."""
    found = {}
    for statement in statements:
        for node in ast.walk(statement):
            if isinstance(node, ast.ImportFrom):
                base = _absolute(module, is_package, node.level, node.module)
                if base is None:
                    continue
                for alias in node.names:
                    found[alias.asname or alias.name] = ("from", base, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    target = _absolute(module, is_package, 0, alias.name)
                    if target is not None and alias.asname:
                        found[alias.asname] = ("module", target)
                    elif target is not None:  # import angle_kernels.x binds the package itself
                        found[PACKAGE] = ("module", "")
    return found


def _bound_names(statement: ast.AST) -> list[str]:
    """The module-level names a top-level statement defines (assignment targets, or the base of a subscript or
    attribute it assigns to: a mutation counts as a definition)."""
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [statement.name]
    targets = []
    if isinstance(statement, ast.Assign):
        targets = list(statement.targets)
    elif isinstance(statement, (ast.AnnAssign, ast.AugAssign)):
        targets = [statement.target]
    names = []
    while targets:
        target = targets.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            targets.extend(target.elts)
        elif isinstance(target, ast.Starred):
            targets.append(target.value)
        elif isinstance(target, (ast.Subscript, ast.Attribute)):  # X[k] = v, X.a = v: X, not k
            base = target.value
            while isinstance(base, (ast.Subscript, ast.Attribute)):
                base = base.value
            targets.append(base)
        elif isinstance(target, ast.Name):
            names.append(target.id)
    return names


class _Source:
    """The modules of the package in a tree, parsed once."""

    def __init__(self, tree: Tree):
        self.tree = tree
        self._modules: dict[str, _Module | None] = {}

    def module(self, name: str) -> _Module | None:
        if name not in self._modules:
            self._modules[name] = self._parse(name)
        return self._modules[name]

    def _parse(self, name: str) -> _Module | None:
        base = PACKAGE + ("/" + name.replace(".", "/") if name else "")
        is_package = False
        text = self.tree.read(base + ".py") if name else None
        if text is None:
            text, is_package = self.tree.read(base + "/__init__.py"), True
        if text is None:
            return None
        return _parsed_module(name, text, is_package)

    def resolve(self, module: _Module, name: str, local_imports: dict, depth: int = 0):
        """What `name` means in `module` (with a definition's own imports): ("def", module, name), ("module",
        dotted), or None (not first-party, a builtin, or a local variable)."""
        if depth > 20:
            return None
        if name in local_imports:
            binding = local_imports[name]
        elif name in module.defs and name != _REGISTRATIONS:
            return ("def", module.name, name)
        elif name in module.imports:
            binding = module.imports[name]
        else:
            return None
        if binding[0] == "module":
            return ("module", binding[1]) if self.module(binding[1]) is not None else None
        _, source, imported = binding
        return self.attribute(source, imported, depth + 1)

    def attribute(self, module_name: str, name: str, depth: int = 0):
        """What `module.name` means: a definition of the module, a name it imports, or a submodule."""
        target = self.module(module_name)
        if target is not None:
            found = self.resolve(target, name, {}, depth)
            if found is not None:
                return found
        submodule = f"{module_name}.{name}" if module_name else name
        if self.module(submodule) is not None:
            return ("module", submodule)
        return None


@lru_cache(maxsize=256)
def _parsed_module(name: str, text: str, is_package: bool) -> _Module:
    """A module's definitions and imports, parsed once per text: trees sharing a file (a copy of the package with
    one file edited) share its _Module and what closures computed of its statements."""
    parsed = ast.parse(text)
    defs: dict = {}
    body = parsed.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the module docstring
    for statement in body:
        if isinstance(statement, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign,
                                  ast.AugAssign)):
            names = _bound_names(statement)
            for bound in names:
                defs.setdefault(bound, []).append(statement)
            if _registers(statement) or not names:
                defs.setdefault(_REGISTRATIONS, []).append(statement)
            continue
        # anything else at top level (a call, an if/try holding definitions): it runs at import, and it binds
        # every name defined inside it at module level
        for bound in _module_level_names(statement):
            defs.setdefault(bound, []).append(statement)
        defs.setdefault(_REGISTRATIONS, []).append(statement)
    imports = _bindings(name, is_package, [s for s in parsed.body if isinstance(s, (ast.Import, ast.ImportFrom))])
    return _Module(name, defs, imports, is_package)


def _module_level_names(statement: ast.AST) -> list[str]:
    """The names a compound top-level statement (if, try, with, for) binds at module level: those of the
    statements in its blocks, not inside the functions or classes it defines."""
    names = []
    for field in ("body", "orelse", "finalbody", "handlers"):
        for child in getattr(statement, field, []):
            names += _bound_names(child)
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names += _module_level_names(child)
    return names


def _references(statement: ast.AST) -> Iterator[tuple[str, tuple[str, ...]]]:
    """(name, attribute chain) of every name a statement loads, annotations left out (they never run: every
    module has `from __future__ import annotations`)."""
    skip = set()
    for node in ast.walk(statement):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.returns is not None:
                skip.update(id(a) for a in ast.walk(node.returns))
            for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs, node.args.vararg,
                        node.args.kwarg]:
                if arg is not None and arg.annotation is not None:
                    skip.update(id(a) for a in ast.walk(arg.annotation))
        elif isinstance(node, ast.AnnAssign):
            skip.update(id(a) for a in ast.walk(node.annotation))
    for node in ast.walk(statement):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            chain, base = [], node
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name):
                yield base.id, tuple(reversed(chain))
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            yield node.id, ()


# ---------------------------------------------------------------------------------------------------------
# The closure of a path
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Closure:
    """The definitions a path executes: (module, name) pairs, and the fingerprint of their canonical forms."""

    members: frozenset
    fingerprint: str


def _split(spec: str) -> tuple[str | None, str]:
    module, _, name = spec.rpartition(":")
    return (module or None), name


def closure(roots, skips=(), tree: Tree | None = None) -> Closure:
    """Every first-party definition reachable from `roots` ("module:name"), not entering `skips`."""
    tree = tree or folder_tree()
    if tree.parsed is None:
        tree.parsed = _Source(tree)
    source = tree.parsed
    skip_specs = [_split(s) for s in skips]

    def skipped(module: str, name: str) -> bool:
        return any(name == s_name and (s_module is None or s_module == module) for s_module, s_name in skip_specs)

    todo = []
    for root in roots:
        module_name, name = _split(root)
        module = source.module(module_name or "")
        if module is None or name not in module.defs:
            raise KeyError(f"fingerprint root {root!r} is not defined in {tree.name}")
        todo.append((module_name, name))
    members: set = set()
    modules_seen: set = set()
    while todo:
        module_name, name = todo.pop()
        if (module_name, name) in members or skipped(module_name, name):
            continue
        members.add((module_name, name))
        module = source.module(module_name)
        if module_name not in modules_seen:
            modules_seen.add(module_name)
            if _REGISTRATIONS in module.defs:
                todo.append((module_name, _REGISTRATIONS))
        for statement in module.defs[name]:
            local, references = module.references(statement)
            for base, chain in references:
                found = source.resolve(module, base, local)
                for attr in chain:
                    if found is None or found[0] != "module":
                        break
                    found = source.attribute(found[1], attr)
                if found is not None and found[0] == "def":
                    todo.append((found[1], found[2]))
    items = set()
    for module_name, name in members:
        module = source.module(module_name)
        for statement in module.defs[name]:
            key = "<registrations>" if name == _REGISTRATIONS else name
            items.add((key, module.canonical_text(statement)))
    digest = hashlib.sha256()
    for key, text in sorted(items):
        digest.update(key.encode() + b"\1" + text.encode() + b"\0")
    return Closure(frozenset(members), digest.hexdigest()[:16])


def path_closure(backend: str, op: str, path: str, tree: Tree | None = None) -> Closure:
    """The closure of a GPU code path (PATH_CODE), its op's selector and router skipped."""
    code = PATH_CODE[(backend, op, path)]
    choosers = tuple(found for found in (SELECTORS.get((backend, op)), ROUTERS.get((backend, op))) if found)
    return closure(code.roots, code.skips + choosers, tree)


@lru_cache(maxsize=None)
def path_fingerprint(backend: str, op: str, path: str) -> str:
    """The fingerprint of this installation's code for a GPU code path (16 hex digits)."""
    return path_closure(backend, op, path).fingerprint


# ---------------------------------------------------------------------------------------------------------
# CUDA C++: per op, its sources and the headers they include, without comments, with the build's flags
# ---------------------------------------------------------------------------------------------------------
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
_C_TOKENS = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.DOTALL)


def strip_c_comments(text: str) -> str:
    """C/C++/CUDA source without comments (string and character literals kept), each line stripped of surrounding
    spaces, without blank lines."""
    def replace(match):
        token = match.group(0)
        if token.startswith("/*"):
            return " " if "\n" not in token else "\n" * token.count("\n")
        return "" if token.startswith("//") else token

    lines = (line.strip() for line in _C_TOKENS.sub(replace, text).splitlines())
    return "\n".join(line for line in lines if line)


def csrc_files(op: str, tree: Tree | None = None) -> dict[str, str]:
    """csrc/<op>.cu, csrc/<op>.cpp and the csrc/ headers they include (transitively): name -> text. `op` is an op's
    name or a name of CSRC_SOURCES."""
    tree = tree or folder_tree()
    todo, found = [f"{op}.cu", f"{op}.cpp"], {}
    while todo:
        name = todo.pop()
        if name in found:
            continue
        text = tree.read(f"csrc/{name}")
        if text is None:
            if name in (f"{op}.cu", f"{op}.cpp"):
                raise FileNotFoundError(f"csrc/{name} is not in {tree.name}")
            continue  # a system header
        found[name] = text
        todo += _INCLUDE.findall(strip_c_comments(text))
    return found


def build_flags(tree: Tree | None = None) -> tuple[list, list]:
    """(NVCC_FLAGS, CXX_FLAGS) as cuda_ops/_extension.py states them in the tree."""
    tree = tree or folder_tree()
    text = tree.read(f"{PACKAGE}/cuda_ops/_extension.py") or ""
    values = {}
    for statement in ast.parse(text).body:
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
            target = statement.targets[0]
            if isinstance(target, ast.Name) and target.id in ("NVCC_FLAGS", "CXX_FLAGS"):
                values[target.id] = ast.literal_eval(statement.value)
    return values.get("NVCC_FLAGS", []), values.get("CXX_FLAGS", [])


def csrc_fingerprint(op: str, tree: Tree | None = None) -> str:
    """16 hex digits over the op's CUDA sources (csrc_files, comments removed) and the build's flags."""
    digest = hashlib.sha256()
    for name, text in sorted(csrc_files(op, tree).items()):
        digest.update(name.encode() + b"\1" + strip_c_comments(text).encode() + b"\0")
    nvcc, cxx = build_flags(tree)
    digest.update(repr((nvcc, cxx)).encode())
    return digest.hexdigest()[:16]

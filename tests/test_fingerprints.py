"""angle_kernels.fingerprints: what each GPU code path's fingerprint covers.

Controls in both directions, on a copy of the package and csrc/: edits that cannot change what runs (a docstring,
a comment, reformatting, moving a function to another module, a path-selection threshold) leave every fingerprint
unchanged; edits that can (a constant inside a kernel, an autotune config, a grid, a helper, a build flag) change
the fingerprints of exactly the paths that run the edited code. That every function a path really runs is inside
its fingerprint is tests/ops/test_fingerprint_completeness.py's subject (a trace under the interpreter).
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

from angle_kernels import fingerprints

ROOT = Path(fingerprints.__file__).resolve().parent.parent
TRITON_PATHS = sorted(key for key in fingerprints.PATH_CODE if key[0] == "triton")
EVERY_PATH = sorted(fingerprints.PATH_CODE)


@pytest.fixture(scope="module")
def baseline():
    return {key: fingerprints.path_closure(*key).fingerprint for key in EVERY_PATH}


@pytest.fixture
def copy(tmp_path):
    """A copy of the package and csrc/, and a function that edits one of its files: edit(relative, old, new)."""
    shutil.copytree(ROOT / "angle_kernels", tmp_path / "angle_kernels",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copytree(ROOT / "csrc", tmp_path / "csrc")

    def edit(relative: str, old: str, new: str, after: str = "") -> None:
        """Replace the first `old` after `after` (a definition's header, say) by `new`."""
        path = tmp_path / relative
        text = path.read_text()
        start = text.index(after)
        assert old in text[start:], f"{old!r} not in {relative} after {after!r}"
        path.write_text(text[:start] + text[start:].replace(old, new, 1))
        edit.tree = fingerprints.folder_tree(tmp_path)  # a fresh tree: one is parsed once

    edit.tree = fingerprints.folder_tree(tmp_path)
    edit.root = tmp_path
    return edit


def changed(baseline, tree, keys=EVERY_PATH) -> set:
    """The paths (of `keys`) whose fingerprint differs from this checkout's in `tree`."""
    return {key for key in keys if fingerprints.path_closure(*key, tree=tree).fingerprint != baseline[key]}


def triton(op: str, *paths: str) -> set:
    return {("triton", op, path) for path in paths}


# ---------------------------------------------------------------------------------------------------------
# Edits that change nothing that runs
# ---------------------------------------------------------------------------------------------------------
def test_the_copy_has_this_checkouts_fingerprints(baseline, copy):
    assert changed(baseline, copy.tree) == set()


def test_docstrings_comments_and_layout_change_nothing(baseline, copy):
    copy("angle_kernels/triton_ops/_similarity_tiles.py", '    """The autotune key of a row count',
         '    """A reworded docstring.\n\n    The autotune key of a row count')
    copy("angle_kernels/triton_ops/similarity_xent.py", "_TUNED = autotuned(_TILE_KERNELS, _TUNE_KEY)",
         "# a comment about the tuning\n_TUNED = autotuned(\n    _TILE_KERNELS,\n    _TUNE_KEY,  # trailing\n)")
    copy("angle_kernels/triton_ops/pair_scores.py", "def launch_config(", "\n\n# a comment\ndef launch_config(")
    copy("angle_kernels/triton_ops/ranking_loss.py", '"""', '"""An edited module docstring. ')
    assert changed(baseline, copy.tree) == set()


def test_moving_a_function_to_another_module_changes_nothing(baseline, copy):
    """_online_lse_update (a leaf: it calls no other definition) moves from the tile library to _common and is
    imported from there by name."""
    tiles = copy.root / "angle_kernels/triton_ops/_similarity_tiles.py"
    tree = ast.parse(tiles.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_online_lse_update")
    lines = tiles.read_text().splitlines(keepends=True)
    start = node.decorator_list[0].lineno - 1
    moved = "".join(lines[start:node.end_lineno])
    tiles.write_text("".join(lines[:start] + lines[node.end_lineno:]).replace(
        "from ._common import Tuning,", "from ._common import _online_lse_update\nfrom ._common import Tuning,"))
    common = copy.root / "angle_kernels/triton_ops/_common.py"
    common.write_text(common.read_text() + "\n\n" + moved)
    copy.tree = fingerprints.folder_tree(copy.root)
    defined = {d.name for d in ast.parse(tiles.read_text()).body if isinstance(d, ast.FunctionDef)}
    assert "_online_lse_update" not in defined
    assert changed(baseline, copy.tree) == set()


def test_an_import_moved_into_a_function_changes_nothing(baseline, copy):
    copy("angle_kernels/triton_ops/similarity_xent.py", "from . import similarity_xent_dense\n", "")
    copy("angle_kernels/triton_ops/similarity_xent.py",
         '''    if code_path(q, c, scale, target, dims=dims) == "dense":''',
         '''    from . import similarity_xent_dense

    if code_path(q, c, scale, target, dims=dims) == "dense":''')
    copy("angle_kernels/triton_ops/similarity_xent.py", '''    if dims is not None:
        return "dims"''', '''    from . import similarity_xent_dense

    if dims is not None:
        return "dims"''')
    assert changed(baseline, copy.tree) == set()


def test_a_path_selection_threshold_belongs_to_no_path(baseline, copy):
    """MIN_WIDTH decides which inputs the dense scheme receives, not what it runs (docs/verification.md); the torch
    similarity_xent's selector (code_path, takes_mixed_products) which calls take its 16-bit products."""
    copy("angle_kernels/triton_ops/similarity_xent_dense.py", "MIN_WIDTH = 768", "MIN_WIDTH = 1024")
    copy("angle_kernels/triton_ops/ranking_loss.py", "SMALL_N_MAX = 4096", "SMALL_N_MAX = 8192")
    copy("angle_kernels/torch_ops/similarity_xent.py", 'return "mixed" if takes_mixed_products(q) else "default"',
         'return "default" if not takes_mixed_products(q) else "mixed"')
    copy("angle_kernels/torch_ops/common.py", "return x.dtype in MIXED_DTYPES and mixed_products(x.device).mm",
         "return mixed_products(x.device).mm and x.dtype in MIXED_DTYPES")
    # the Triton similarity_xent's selector (similarity_xent_paths.code_path and the dense dims scheme's `takes`,
    # with its tile limit) and its router (similarity_xent_paths.similarity_xent), which calls the chosen launcher
    copy("angle_kernels/triton_ops/_similarity_xent_dense_dims.py", "MIN_BLOCK_ROWS = 512", "MIN_BLOCK_ROWS = 256")
    copy("angle_kernels/triton_ops/similarity_xent_paths.py", 'if code_path(q, c, scale, target, dims=dims) == '
         '"dense_dims":', 'if "dense_dims" == code_path(q, c, scale, target, dims=dims):')
    assert changed(baseline, copy.tree) == set()


# ---------------------------------------------------------------------------------------------------------
# Edits that change what runs: exactly the paths that run them
# ---------------------------------------------------------------------------------------------------------
def test_a_constant_inside_a_kernel(baseline, copy):
    text = (copy.root / "angle_kernels/triton_ops/similarity_xent_dense.py").read_text()
    kernel = text[text.index("def _dense_xent_grad_kernel("):]
    body_line = next(line for line in kernel.splitlines()[1:] if "tl.program_id(0)" in line)
    copy("angle_kernels/triton_ops/similarity_xent_dense.py", body_line, body_line.replace(
        "tl.program_id(0)", "(tl.program_id(0) + 0)"), after="def _dense_xent_grad_kernel(")
    assert changed(baseline, copy.tree) == triton("similarity_xent", "dense")


def test_the_dense_dims_scheme_changes_only_its_path(baseline, copy):
    """The dense dims scheme's host code and its kernel are its path's alone; its kernel's epilogue is the dense
    similarity_lse scheme's too; the dense scheme's forward kernel, which it launches per prefix, is both
    schemes'."""
    relative = "angle_kernels/triton_ops/_similarity_xent_dense_dims.py"
    copy(relative, "q_ratio = q_inv[1:] / q_inv[:-1]", "q_ratio = q_inv[1:] / q_inv[:-1] * 1")
    assert changed(baseline, copy.tree) == triton("similarity_xent", "dense_dims")
    copy(relative, "g_cos = g * tl.where(ok, cos, 0.0)", "g_cos = tl.where(ok, cos, 0.0) * g")
    assert changed(baseline, copy.tree) == triton("similarity_xent", "dense_dims")
    text = (copy.root / "angle_kernels/triton_ops/similarity_xent_dense.py").read_text()
    kernel = text[text.index("def _dense_xent_stats_kernel("):]
    body_line = next(line for line in kernel.splitlines()[1:] if "tl.program_id(0)" in line)
    copy("angle_kernels/triton_ops/similarity_xent_dense.py", body_line, body_line.replace(
        "tl.program_id(0)", "(tl.program_id(0) + 0)"), after="def _dense_xent_stats_kernel(")
    assert changed(baseline, copy.tree) == triton("similarity_xent", "dense", "dense_dims")
    # the gradient kernels' epilogue, shared with the dense similarity_lse scheme: every path running it (edits
    # accumulate in the copy: the dense scheme's too)
    copy(relative, "g = g + previous * q_ratio[:, None] * c_ratio[None, :]",
         "g = g + previous * c_ratio[None, :] * q_ratio[:, None]")
    assert changed(baseline, copy.tree) == triton("similarity_xent", "dense", "dense_dims") | triton(
        "similarity_lse", "dense", "dense_dims")


def test_the_dense_similarity_lse_scheme_changes_only_its_paths(baseline, copy):
    """The dense similarity_lse scheme's host code and kernels are its two paths' (one width is the scheme at one
    prefix); the fused kernels per prefix are the fallback's and the fused path's; the selector's widths and tile
    limit belong to no path."""
    relative = "angle_kernels/triton_ops/_similarity_lse_dense.py"
    copy(relative, "MIN_BLOCK_ROWS = 512", "MIN_BLOCK_ROWS = 256")
    copy("angle_kernels/triton_ops/similarity_lse_paths.py", "PROPOSED_DENSE_MIN_WIDTH = 768",
         "PROPOSED_DENSE_MIN_WIDTH = 1024")
    assert changed(baseline, copy.tree) == set()
    copy(relative, "q_ratio = q_inv[1:] / q_inv[:-1]", "q_ratio = q_inv[1:] / q_inv[:-1] * 1")
    assert changed(baseline, copy.tree) == triton("similarity_lse", "dense", "dense_dims")
    copy("angle_kernels/triton_ops/similarity_lse_paths.py", "return None if x is None else x[:, :d]",
         "return x if x is None else x[:, :d]")
    assert changed(baseline, copy.tree) == triton("similarity_lse", "dense", "dense_dims", "fused_prefixes")


def test_a_prefix_kernel_changes_only_the_dims_path(baseline, copy):
    text = (copy.root / "angle_kernels/triton_ops/similarity_xent.py").read_text()
    kernel = text[text.index("def _similarity_xent_prefix_fwd_kernel("):]
    line = next(line for line in kernel.splitlines()[1:] if "tl.program_id(0)" in line)
    copy("angle_kernels/triton_ops/similarity_xent.py", line,
         line.replace("tl.program_id(0)", "(tl.program_id(0) * 1)"),
         after="def _similarity_xent_prefix_fwd_kernel(")
    assert changed(baseline, copy.tree) == triton("similarity_xent", "dims")


def test_an_autotune_config(baseline, copy):
    """The tile library's 16-bit configs: the fused kernels of similarity_xent (full width and dims) and of
    similarity_lse (once, and per prefix for dims); the dense schemes launch with fixed blocks and do not use them."""
    text = (copy.root / "angle_kernels/triton_ops/_similarity_tiles.py").read_text()
    start = text.index("_GPU_CONFIGS_16BIT = [")
    config = text[start:text.index("]\n", start)]
    copy("angle_kernels/triton_ops/_similarity_tiles.py", config, config.replace("num_stages=3", "num_stages=4", 1))
    assert changed(baseline, copy.tree) == (triton("similarity_xent", "fused", "dims")
                                            | triton("similarity_lse", "fused", "fused_prefixes"))


def test_a_grid_expression(baseline, copy):
    copy("angle_kernels/triton_ops/pair_scores.py", "            _pair_scores_fwd_kernel[(groups,)](",
         "            _pair_scores_fwd_kernel[(groups + 0,)](")
    assert changed(baseline, copy.tree) == triton("pair_scores", "full")


def test_a_helper_shared_by_every_triton_path(baseline, copy):
    text = (copy.root / "angle_kernels/triton_ops/_common.py").read_text()
    body = text[text.index("def new_output("):]
    line = next(line for line in body.splitlines() if line.strip().startswith("return"))
    copy("angle_kernels/triton_ops/_common.py", line, line.replace("return", "return (", 1) + ")",
         after="def new_output(")
    assert changed(baseline, copy.tree) == set()  # parentheses only: the same tree
    copy("angle_kernels/triton_ops/_common.py", "def poison_outputs() -> bool:",
         "def poison_outputs() -> bool:\n    os.environ.get('ANOTHER')")
    assert changed(baseline, copy.tree) == set(TRITON_PATHS)


def test_a_constant_of_the_contract_changes_the_paths_that_read_it(baseline, copy):
    copy("angle_kernels/contract.py", "MARGIN_SIN_SQUARED_FLOOR = ", "MARGIN_SIN_SQUARED_FLOOR = 2 * ")
    assert changed(baseline, copy.tree) == (triton("similarity_xent", "fused", "dense", "dims", "dense_dims")
                                            | {("torch", "similarity_xent", "default"), ("torch", "similarity_xent",
                                                                                        "mixed")})


TORCH_XENT, PRODUCTS = "angle_kernels/torch_ops/similarity_xent.py", "angle_kernels/products.py"


@pytest.mark.parametrize("relative, old, new, paths", [
    (TORCH_XENT, "tile = products(self.qf[start:end], self.cf.T)", "tile = products(self.qf[start:end], self.cf.T) * 1",
     ("default", "mixed")),
    (PRODUCTS, "a, b = a.to(out.dtype), b.to(out.dtype)", "a, b = a.to(out.dtype) * 1, b.to(out.dtype)",
     ("mixed",)),
    (TORCH_XENT, "tile_scale = weights / weight_max * scale", "tile_scale = weights * scale / weight_max", ("mixed",)),
    (TORCH_XENT, "d_qhat[start:end].addmm_(grad * c_inv[None, :], cf)", "d_qhat[start:end].addmm_(c_inv * grad, cf)",
     ("default",))], ids=["shared-tiles", "mixed-products", "mixed-tile-scale", "default-products"])
def test_the_torch_backends_paths_share_their_tiles_and_not_their_products(baseline, copy, relative, old, new, paths):
    """The torch similarity_xent's two paths: the tile code is both paths', the 16-bit products and the mixed
    Functions only "mixed"'s, the default Functions' products only "default"'s. (Among the torch backend's paths:
    no other backend's code imports torch_ops, tests/test_structure.py.)"""
    copy(relative, old, new)
    torch_paths = [key for key in EVERY_PATH if key[0] == "torch"]
    assert changed(baseline, copy.tree, torch_paths) == {("torch", "similarity_xent", path) for path in paths}


def test_the_other_paths_code_behind_a_branch_is_not_in_a_path(baseline, copy):
    """The full-width pair-score path runs PairScoresFunction, never PrefixPairScoresFunction."""
    text = (copy.root / "angle_kernels/triton_ops/pair_scores.py").read_text()
    start = text.index("class PrefixPairScoresFunction")
    line = next(line for line in text[start:].splitlines() if "cfg = launch_config(k, dims[-1], with_angle)" in line)
    copy("angle_kernels/triton_ops/pair_scores.py", line, line.replace("dims[-1]", "dims[-1] + 0"),
         after="class PrefixPairScoresFunction")
    assert changed(baseline, copy.tree) == triton("pair_scores", "dims")


def test_the_cuda_python_side_and_its_registrations(baseline, copy):
    """The autograd formula is registered at import, never named by the op: it is part of the path."""
    copy("angle_kernels/cuda_ops/similarity_xent.py", "    if grad_loss is None:\n        return (None,) * 8",
         "    if grad_loss is None:\n        return (None,) * 8 + ()")
    assert changed(baseline, copy.tree) == {("cuda", "similarity_xent", "fused")}


def test_the_cuda_dense_similarity_xent_scheme_changes_only_its_paths(baseline, copy):
    """The CUDA backend's dense similarity_xent scheme (cuda_ops/similarity_xent_dense.py): its one-width host code
    is the dense path's, its dims host code the dense dims path's, a helper both run both's; the selector's width
    belongs to no path, and the verified fused path is in none of it."""
    relative = "angle_kernels/cuda_ops/similarity_xent_dense.py"
    cuda_xent = {("cuda", "similarity_xent", path) for path in ("dense", "dense_dims")}
    copy("angle_kernels/cuda_ops/similarity_xent_paths.py", "PROPOSED_DENSE_MIN_WIDTH = 768",
         "PROPOSED_DENSE_MIN_WIDTH = 1024")
    copy(relative, "MIN_BLOCK_ROWS = 512", "MIN_BLOCK_ROWS = 256")  # read by the selector alone (takes)
    assert changed(baseline, copy.tree) == set()
    copy(relative, "coef = (weights / weight_max).contiguous()", "coef = (weights / weight_max * 1).contiguous()")
    assert changed(baseline, copy.tree) == {("cuda", "similarity_xent", "dense")}
    copy(relative, "q_ratio = (q_rows.inv[1:] / q_rows.inv[:-1]).contiguous()",
         "q_ratio = (q_rows.inv[1:] / q_rows.inv[:-1] * 1).contiguous()")
    assert changed(baseline, copy.tree) == cuda_xent
    # a helper shared with the CUDA similarity_lse's dense scheme (cuda_ops/_dense_tiles.py): every path running it
    copy("angle_kernels/cuda_ops/_dense_tiles.py", "out = torch.empty_like(rows.scaled)",
         "out = torch.zeros_like(rows.scaled)", after="def unit_slices(")
    cuda_lse = {("cuda", "similarity_lse", path) for path in ("dense", "dense_dims")}
    assert changed(baseline, copy.tree) == cuda_xent | cuda_lse


# ---------------------------------------------------------------------------------------------------------
# CUDA sources
# ---------------------------------------------------------------------------------------------------------
def csrc_changed(tree) -> set:
    return {op for op in ("pair_scores", "ranking_loss", "similarity_xent")
            if fingerprints.csrc_fingerprint(op, tree) != fingerprints.csrc_fingerprint(op)}


def test_cuda_comments_change_nothing_code_changes_its_op(copy):
    copy("csrc/similarity_xent.cu", "#include \"common.cuh\"", "#include \"common.cuh\"  // the shared helpers\n/* a\n"
         " block comment */\n\n")
    assert csrc_changed(copy.tree) == set()
    text = (copy.root / "csrc/ranking_loss.cu").read_text()
    line = next(line for line in text.splitlines() if "__global__" in line)
    copy("csrc/ranking_loss.cu", line, "  " + line + " ")  # spaces only
    assert csrc_changed(copy.tree) == set()
    copy("csrc/ranking_loss.cu", line, "__device__ int an_added_function() { return 1; }\n" + line)
    assert csrc_changed(copy.tree) == {"ranking_loss"}


def cuda_builds(tree) -> dict:
    """(op, path) -> the fingerprint of the CUDA sources each CUDA code path runs (fingerprints.csrc_source)."""
    from angle_kernels import verified

    return {(op, path): fingerprints.csrc_fingerprint(fingerprints.csrc_source(op, path), tree)
            for op, paths in verified.paths_of("cuda").items() for path in paths}


def test_the_dense_similarity_xent_kernels_change_only_the_dense_paths(copy):
    """csrc/similarity_xent_dense.* (and its types header) are the CUDA dense scheme's own sources
    (fingerprints.CSRC_SOURCES): an edit there changes the sources' fingerprint of its two paths and of no other
    path, the verified fused path's included; an edit of the op's own sources leaves them alone."""
    before = cuda_builds(copy.tree)
    dense = {("similarity_xent", "dense"), ("similarity_xent", "dense_dims")}
    text = (copy.root / "csrc/similarity_xent_dense.cu").read_text()
    line = next(line for line in text.splitlines() if "__global__" in line)
    copy("csrc/similarity_xent_dense.cu", line, "__device__ int an_added_function() { return 1; }\n" + line)
    after = cuda_builds(copy.tree)
    assert {key for key in before if before[key] != after[key]} == dense
    copy("csrc/similarity_xent_dense_types.h", "constexpr int kXentGradRows = 16;", "constexpr int kXentGradRows = 8;")
    again = cuda_builds(copy.tree)
    assert {key for key in before if after[key] != again[key]} == dense
    fused_text = (copy.root / "csrc/similarity_xent.cu").read_text()
    fused_line = next(line for line in fused_text.splitlines() if "__global__" in line)
    copy("csrc/similarity_xent.cu", fused_line, "__device__ int an_added_function() { return 1; }\n" + fused_line)
    last = cuda_builds(copy.tree)
    assert {key for key in before if again[key] != last[key]} == {("similarity_xent", "fused")}


def test_a_shared_header_or_a_build_flag_changes_every_op(copy):
    copy("csrc/common.cuh", "#include \"launcher_types.h\"", "#include \"launcher_types.h\"\n#define AN_ADDED_MACRO 1")
    assert csrc_changed(copy.tree) == {"pair_scores", "ranking_loss", "similarity_xent"}


def test_build_flags_enter_every_op(copy):
    copy("angle_kernels/cuda_ops/_extension.py", 'NVCC_FLAGS = ["-O3", "-lineinfo"]',
         'NVCC_FLAGS = ["-O2", "-lineinfo"]')
    assert csrc_changed(copy.tree) == {"pair_scores", "ranking_loss", "similarity_xent"}


def test_comments_are_stripped_but_strings_are_kept():
    text = 'a = "// not a comment"; // a comment\n/* gone */ b = \'/\'; /* also\n gone */ c = 1;\n'
    assert fingerprints.strip_c_comments(text) == 'a = "// not a comment";\nb = \'/\';\nc = 1;'


# ---------------------------------------------------------------------------------------------------------
# The table of paths
# ---------------------------------------------------------------------------------------------------------
def test_every_declared_gpu_path_has_its_code_and_nothing_else():
    from angle_kernels import verified

    declared = {(backend, op, path) for backend in verified.GPU_BACKENDS
                for op, paths in verified.paths_of(backend).items() for path in paths}
    assert set(fingerprints.PATH_CODE) == declared  # the torch backend's default paths too (the speed table's keys)


def test_the_canonical_form_ignores_fields_a_newer_python_adds_empty():
    node = ast.parse("def f(x):\n    return x\n").body[0]
    before = fingerprints.canonical(node)
    node.type_params = []  # Python 3.12's field, empty
    assert fingerprints.canonical(node) == before


def test_an_unknown_root_is_an_error_naming_it():
    with pytest.raises(KeyError, match="triton_ops.pair_scores:no_such_function"):
        fingerprints.closure(["triton_ops.pair_scores:no_such_function"])

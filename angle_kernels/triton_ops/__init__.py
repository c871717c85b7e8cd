"""The Triton backend: fused kernels for the ops of angle_kernels.dispatch.

Each kernel file reads top to bottom: what it computes, the bytes and FLOPs it must move, the kernels, the
autograd.Function, the launcher.

One module per op, named after it (`contract.OPS`; similarity_xent's is similarity_xent_paths, which chooses
among the paths of similarity_xent.py and _similarity_xent_dense_dims.py, pair_scores' is pair_scores_paths,
which chooses among those of pair_scores.py and _pair_scores_one_read.py, and similarity_lse's is
similarity_lse_paths, which chooses among those of similarity_lse.py and _similarity_lse_dense.py), plus the modules
an op launches from (similarity_xent_dense: the dense scheme of similarity_xent; _similarity_xent_dense_dims: the
dense scheme with dims, which launches the dense scheme's kernels; _similarity_lse_dense: the dense scheme of
similarity_lse, at one width and with dims; _similarity_tiles: the tile library of the similarity family, see
docs/triton-similarity.md). `load_ops()` names the op modules; `dispatch` calls it only once `is_available()` says
the kernels can run here (CUDA, or CPU tensors under TRITON_INTERPRET=1), so importing this package never fails and
costs nothing without triton. Inputs arrive validated by `angle_kernels.dispatch`.

Autotuning results persist across processes: the op modules build their autotuners when `load_ops()` imports them,
with Triton's own autotune disk cache on (TRITON_CACHE_AUTOTUNING, read when an autotuner is built; the files go to
Triton's cache folder, TRITON_CACHE_DIR or ~/.triton/cache), so a second process on the same machine pays no
autotuning for the shapes a first one tuned (the compiled kernels are in that folder already, by Triton's default),
and both run the same configs. A user who set TRITON_CACHE_AUTOTUNING (to anything, "0" included) or
`triton.knobs.autotuning.cache` keeps their choice. Triton keys each result by the kernel's source, its configs,
the GPU architecture and the Triton version, so an edit or an upgrade tunes again. Triton 3.6 (the H100 runs') and
3.9 have the cache; a Triton whose `triton.autotune` lacks `cache_results` tunes again in every process (keeping
results in angle_kernels' user cache instead would mean building the autotuners differently, in triton_ops/_common.py,
which every Triton path's fingerprint covers).
"""

from __future__ import annotations

import contextlib
import inspect
import os
from types import ModuleType

import torch

from .. import path_switches
from .._runtime import triton_interpreting


def is_available() -> tuple[bool, str]:
    """(True, "") when triton imports and there is a CUDA device or TRITON_INTERPRET=1; else (False, why)."""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # a broken or missing triton must not break `import angle_kernels`
        return False, f"triton does not import: {type(exc).__name__}: {exc}"
    if triton_interpreting():
        return True, ""
    if torch.cuda.is_available():
        return True, ""
    return False, "no CUDA device (set TRITON_INTERPRET=1 to run the kernels on CPU through the interpreter)"


AUTOTUNE_CACHE_ENV = "TRITON_CACHE_AUTOTUNING"


@contextlib.contextmanager
def autotuning_results_kept():
    """Within the block, autotuners Triton builds keep their results on disk (the module docstring): the
    environment variable it reads set to "1" unless the user chose, and removed again after the block, so that
    other libraries' autotuners and this process's subprocesses are left as the user set them."""
    import triton

    knobs = getattr(triton, "knobs", None)
    chosen = AUTOTUNE_CACHE_ENV in os.environ or (knobs is not None and "cache" in vars(knobs.autotuning))
    if chosen or "cache_results" not in inspect.signature(triton.autotune).parameters:
        yield
        return
    os.environ[AUTOTUNE_CACHE_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(AUTOTUNE_CACHE_ENV, None)


# The op modules not named after their op (`load_ops`; angle_kernels.verified.paths_of reads the paths they declare
# without loading the backend).
OP_MODULES = {"similarity_xent": "similarity_xent_paths", "pair_scores": "pair_scores_paths",
              "similarity_lse": "similarity_lse_paths"}


# The code paths switched off until a GPU run has verified them and the op sweep has timed them against the paths
# they replace, then on from the width the sweep measured them faster (similarity_xent's dense_dims and
# similarity_lse's dense: on since the H200 run of 2026-11-28; dims_one_read and similarity_lse's dense_dims: since
# that of 2026-12-04): (op, path) -> (the module of the op's selector, the width from
# which the selector sends calls to the path: None, off; the module's PROPOSED_<width> is the one the checks and
# the op sweep switch it on at). A new path that takes calls without a switch (similarity_lse's
# "fused_prefixes", the dims calls the dense scheme does not take) is not here: calls take it from the start, so it
# counts among the paths a backend must have verified to cover every path (verified.covers_every_path), and
# backend="auto" sends its calls elsewhere until it is verified.
AWAITING_VERIFICATION = {
    ("pair_scores", "dims_one_read"): ("pair_scores_paths", "ONE_READ_MIN_WIDTH"),
    ("similarity_xent", "dense_dims"): ("similarity_xent_paths", "DENSE_DIMS_MIN_WIDTH"),
    ("similarity_lse", "dense"): ("similarity_lse_paths", "DENSE_MIN_WIDTH"),
    ("similarity_lse", "dense_dims"): ("similarity_lse_paths", "DENSE_DIMS_MIN_WIDTH"),
}


def awaiting_verification_on():
    """Within the block, the paths of AWAITING_VERIFICATION take the calls they are meant for (switched on at their
    PROPOSED widths), so that `angle_kernels.verify` checks them and the GPU op sweep times them; outside it, every
    call keeps the paths verified before them (angle_kernels.path_switches)."""
    return path_switches.switched_on(__name__, AWAITING_VERIFICATION)


def paths_awaiting_verification() -> set[tuple[str, str]]:
    """(op, path) of the code paths that await their first GPU verification and are switched off: no call takes
    them outside `awaiting_verification_on`."""
    return path_switches.switched_off(__name__, AWAITING_VERIFICATION)


def load_ops() -> dict[str, ModuleType]:
    """This backend's op modules by op name (`contract.OPS`): each defines the function named after its op (the
    launcher), its PATHS and, with several, code_path. Importing them builds their autotuners, with their results
    kept on disk (`autotuning_results_kept`)."""
    with autotuning_results_kept():
        from . import pair_scores_paths, ranking_loss, similarity_lse_paths, similarity_xent_paths

    return {"pair_scores": pair_scores_paths, "ranking_loss": ranking_loss, "similarity_xent": similarity_xent_paths,
            "similarity_lse": similarity_lse_paths}

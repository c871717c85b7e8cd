"""The CUDA C++ backend: the ops of angle_kernels.dispatch as torch.library custom ops backed by the kernels in
csrc/, organised by op like the other backends.

One module per op, named after it (`contract.OPS`): `cuda_ops/<op>.py` defines the op's schemas (`_library`),
their fake implementations and autograd formula, and the op; `csrc/<op>.cu` holds its kernels and launcher and
`csrc/<op>.cpp` its torch binding. similarity_xent's op module is similarity_xent_paths (OP_MODULES), which chooses
between the fused kernels of similarity_xent.py and the dense scheme of similarity_xent_dense.py (its kernels:
csrc/similarity_xent_dense.cu). `load_ops()` names the op modules; `dispatch` calls it. Inputs arrive validated by
`angle_kernels.dispatch`, as CUDA tensors (float32 / float64 / float16 / bfloat16; float32 accumulation, float64
stays float64). The ops are `torch.ops.angle_kernels.cuda_*`; they have fake implementations and autograd
formulas, so they work under torch.compile(fullgraph=True), and they are defined on every machine (CPU-only ones
too). Importing this package never fails: `is_available()` says why the backend cannot run here.
"""

from __future__ import annotations

from types import ModuleType

from .. import path_switches

# The op modules not named after their op (`load_ops`; angle_kernels.verified.paths_of reads the paths they declare
# without loading the backend).
OP_MODULES = {"similarity_xent": "similarity_xent_paths"}

# The code paths that await their first GPU verification: (op, path) -> (the module of the op's selector, the width
# from which the selector sends calls to the path: None, off, until a GPU run has verified it; the module's
# PROPOSED_<width> is the one it is switched on at), as triton_ops.AWAITING_VERIFICATION. A path that takes calls
# without a switch (the dense dims scheme, similarity_lse's dense scheme: the only paths for their calls) is not
# here: it counts among the paths the backend must have verified to cover every path.
AWAITING_VERIFICATION = {
    ("similarity_xent", "dense"): ("similarity_xent_paths", "DENSE_MIN_WIDTH"),
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
    """This backend's op modules by op name (`contract.OPS`). Importing them defines the angle_kernels::cuda_*
    schemas; `_extension.define_schemas` imports the same modules."""
    from . import pair_scores, ranking_loss, similarity_lse, similarity_xent_paths

    return {"pair_scores": pair_scores, "ranking_loss": ranking_loss, "similarity_xent": similarity_xent_paths,
            "similarity_lse": similarity_lse}


def is_available(allow_build: bool = True) -> tuple[bool, str]:
    """(True, "") when the CUDA kernels can run here, else (False, the reason).

    With allow_build=True (the default) this JIT-builds them from a source checkout when there is no prebuilt
    extension (minutes of nvcc, once per process); allow_build=False answers without compiling, as
    backend="auto" asks (see `_extension`).
    """
    from . import _extension

    return _extension.load(allow_build=allow_build)

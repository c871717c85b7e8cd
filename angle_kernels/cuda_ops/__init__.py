"""The CUDA C++ backend: the ops of angle_kernels.dispatch as torch.library custom ops backed by the kernels in
csrc/, organised by op like the other backends.

One module per op, named after it (`contract.OPS`): `cuda_ops/<op>.py` defines the op's schemas (`_library`),
their fake implementations and autograd formula, and the op; `csrc/<op>.cu` holds its kernels and launcher and
`csrc/<op>.cpp` its torch binding. `load_ops()` names the op modules; `dispatch` calls it. Inputs arrive validated by
`angle_kernels.dispatch`, as CUDA tensors (float32 / float64 / float16 / bfloat16; float32 accumulation, float64
stays float64). The ops are `torch.ops.angle_kernels.cuda_*`; they have fake implementations and autograd
formulas, so they work under torch.compile(fullgraph=True), and they are defined on every machine (CPU-only ones
too). Importing this package never fails: `is_available()` says why the backend cannot run here.
"""

from __future__ import annotations

from types import ModuleType


def load_ops() -> dict[str, ModuleType]:
    """This backend's op modules by op name (`contract.OPS`). Importing them defines the angle_kernels::cuda_*
    schemas; `_extension.define_schemas` imports the same modules."""
    from . import pair_scores, ranking_loss, similarity_lse, similarity_xent

    return {"pair_scores": pair_scores, "ranking_loss": ranking_loss, "similarity_xent": similarity_xent,
            "similarity_lse": similarity_lse}


def is_available(allow_build: bool = True) -> tuple[bool, str]:
    """(True, "") when the CUDA kernels can run here, else (False, the reason).

    With allow_build=True (the default) this JIT-builds them from a source checkout when there is no prebuilt
    extension (minutes of nvcc, once per process); allow_build=False answers without compiling, as
    backend="auto" asks (see `_extension`).
    """
    from . import _extension

    return _extension.load(allow_build=allow_build)

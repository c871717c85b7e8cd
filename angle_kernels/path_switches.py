"""Code paths that await their first GPU verification, switched off until then: the one mechanism of the GPU
backends (triton_ops, cuda_ops).

A backend package lists its switched paths in a table, (op, path) -> (the module of the op's selector, within the
package, and the name of the width from which the selector sends calls to the path: None, off, until a GPU run has
verified it; the module's PROPOSED_<width> is the one it is switched on at; once verified, the width the op sweep
measured it faster from). `switched_on` sets every one to its PROPOSED width for a block (`angle_kernels.verify`
checks them, its cases laid out around those widths whatever a speed measurement set; the GPU op sweep times them);
`switched_off` names those that are off.
"""

from __future__ import annotations

import contextlib
import importlib


def _switches(package: str, table: dict) -> dict:
    """(the selector's module, its width's name) of each path of the table, the modules imported."""
    return {path: (importlib.import_module(f"{package}.{module}"), width) for path, (module, width) in table.items()}


@contextlib.contextmanager
def switched_on(package: str, table: dict):
    """Within the block, the table's paths take the calls they are meant for (each at its module's PROPOSED width);
    outside it, every call takes the paths as the modules' widths say."""
    switches = list(_switches(package, table).values())
    saved = [getattr(module, width) for module, width in switches]
    for module, width in switches:
        setattr(module, width, getattr(module, f"PROPOSED_{width}"))
    try:
        yield
    finally:
        for (module, width), value in zip(switches, saved):
            setattr(module, width, value)


def switched_off(package: str, table: dict) -> set[tuple[str, str]]:
    """(op, path) of the table's paths that are switched off: no call takes them outside `switched_on`."""
    return {path for path, (module, width) in _switches(package, table).items() if getattr(module, width) is None}

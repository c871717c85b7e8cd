"""Reading checkpoint files without running code from them (checkpoint.py's module docstring says why).

Shared by checkpoint.py (state.pt, rng-rank{r}.pt, manifests) and sharding.py (--fsdp's DCP files): the error a
refused file raises, the rule for names a manifest or DCP metadata may use, and torch.load restricted to tensors
and plain Python values.
"""

from __future__ import annotations

import os
import pickle

import torch


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holding objects that only running code from the file could rebuild."""


UNTRUSTED = ("angle_train never writes such a file, so it was written or changed by something else; resume only from "
             "checkpoints you trust")  # the end of an UnsafeCheckpointError's message


def is_file_name(name) -> bool:
    """Whether `name` names a file of a folder itself: not a path (../x, /x, sub/x), nor the folder or its parent."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "\0" not in name
            and not any(sep and sep in name for sep in ("/", os.sep, os.altsep)))


def read_tensors_and_plain_values(file, name: str | None = None):
    """torch.load that rebuilds only tensors and plain Python values, so reading the file cannot run code. `file`: a
    path, or a stream cut from the file `name` (an entry of a DCP shard file: sharding.py)."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise refusal(name or file, exc) from None


def refusal(file: str, exc: pickle.UnpicklingError) -> UnsafeCheckpointError:
    """The error for a file (or an entry of one) that torch.load(weights_only=True) refused with `exc`."""
    # torch names what it refused in the lines that mention GLOBAL (the pickle opcode that imports a callable)
    found = "; ".join(line.strip() for line in str(exc).splitlines() if "GLOBAL" in line)
    return UnsafeCheckpointError(
        f"refusing to load {file}: it holds Python objects other than tensors and plain values"
        f"{f' ({found})' if found else ''}, and rebuilding them would run code that came with the file. "
        f"{UNTRUSTED}")

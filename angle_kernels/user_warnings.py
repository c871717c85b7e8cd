"""Warnings that point at the line of code that called into the package.

Python files a warning under the line `stacklevel` frames up, and its default filter shows a warning once per line.
A fixed `stacklevel` names a line of the package itself wherever a call reaches the warning through more or fewer of
the package's frames than it counts (a loss's option checks, a module's forward, the dispatcher, a first-use check, a
backward hook), which tells a user nothing about which of their calls it concerns. `warn` walks out of the package
and out of torch (nn.Module's call, autograd's backward, torch.compile's wrappers) to the first frame of other code:
the user's line, or the line of the library (a trainer) that called the loss. It imports nothing of the package.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

# The folders whose frames a warning walks past: this package's and torch's.
_PASSED_FOLDERS = tuple(os.path.dirname(os.path.realpath(module_file)) + os.sep
                        for module_file in (__file__, torch.__file__))


def _passed(filename: str) -> bool:
    return os.path.realpath(filename).startswith(_PASSED_FOLDERS)


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """warnings.warn(message, category) filed under the first frame, from this function's caller outwards, that is
    neither the package's nor torch's (the outermost frame where every frame is: a backward hook run by autograd's
    device threads has no caller of the user's on its stack)."""
    frame, level = sys._getframe(1), 2  # stacklevel 2: the caller of this function
    while frame.f_back is not None and _passed(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)

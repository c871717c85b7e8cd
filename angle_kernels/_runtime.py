"""Facts about this process that the dispatcher and the backends both read.

Below the backends and `dispatch` (it imports nothing of the package), so a backend asks here instead of reaching
up into the dispatcher.
"""

from __future__ import annotations

import os


def triton_interpreting() -> bool:
    """True when TRITON_INTERPRET asks Triton to run kernels through its interpreter (CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

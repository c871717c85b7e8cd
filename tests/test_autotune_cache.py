"""Autotuning results persist across processes (angle_kernels.triton_ops' docstring): the Triton backend's
autotuners are built with Triton's autotune disk cache on, unless the user chose otherwise, without the setting
leaking into the rest of the process; and what turns it on is outside every GPU code path's fingerprint (an edit
there voids no verification).

The autotuners exist only outside the interpreter (under it the kernels are launched directly), so the check runs
in a subprocess without TRITON_INTERPRET: it builds them on CPU (nothing launches) and asks each whether it will
cache its results, as Triton decided when it built it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from angle_kernels import fingerprints

pytest.importorskip("triton")

_PROBE = """
import json, os, sys
import triton
import angle_kernels.triton_ops as triton_ops

before = os.environ.get("TRITON_CACHE_AUTOTUNING")
if sys.argv[1] == "knob":
    triton.knobs.autotuning.cache = False
    os.environ.pop("TRITON_CACHE_AUTOTUNING")  # the knob alone says what the user chose
triton_ops.load_ops()
# the fused kernels' modules (load_ops names the routers of their ops)
from angle_kernels.triton_ops import similarity_lse, similarity_xent
autotuners = [kernel.launcher for module in (similarity_xent, similarity_lse)
              for kernel in module._TUNED["16bit"] + module._TUNED["32bit"]
              if isinstance(kernel.launcher, triton.runtime.Autotuner)]
print(json.dumps({"caching": sorted({a.cache_results for a in autotuners}), "count": len(autotuners),
                  "env_after": os.environ.get("TRITON_CACHE_AUTOTUNING"), "env_before": before}))
"""


def _probe(mode: str, **env: str) -> dict:
    environment = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_CACHE_AUTOTUNING")}
    environment.update(env)
    done = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, env=environment,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_autotuners_keep_their_results_unless_the_user_chose():
    default = _probe("default")
    assert default["count"] > 0 and default["caching"] == [True]
    assert default["env_after"] is None  # the rest of the process (and its subprocesses) as the user left it
    assert _probe("default", TRITON_CACHE_AUTOTUNING="0") == {"caching": [False], "count": default["count"],
                                                              "env_after": "0", "env_before": "0"}
    assert _probe("knob")["caching"] == [False]


def test_what_turns_the_cache_on_is_in_no_code_paths_fingerprint():
    modules = {module for key in fingerprints.PATH_CODE for module, _ in fingerprints.path_closure(*key).members}
    assert "triton_ops" not in modules  # the package's __init__: load_ops and autotuning_results_kept
    assert "triton_ops._common" in modules  # the autotuners' own construction is (so it stays untouched)

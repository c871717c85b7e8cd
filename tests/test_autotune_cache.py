"""Autotuning results persist across processes (angle_kernels.triton_ops' docstring): the Triton backend's
autotuners are built with Triton's autotune disk cache on, unless the user chose otherwise, without the setting
leaking into the rest of the process; and what turns it on is outside every GPU code path's fingerprint (an edit
there voids no verification).

The autotuners exist only outside the interpreter (under it the kernels are launched directly), so the check runs
in a subprocess without TRITON_INTERPRET (forked once for each setting probed: _PROBES): it builds them on CPU
(nothing launches) and asks each whether it will cache its results, as Triton decided when it built it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from angle_kernels import fingerprints

pytest.importorskip("triton")

# Each probe in a process of its own, forked after the imports every one of them makes (torch, torch._dynamo, which
# angle_kernels' front end imports, and triton): they cost seconds a process, and read no setting of the cache.
# What each probe sets (TRITON_CACHE_AUTOTUNING, the knob) comes before angle_kernels and its autotuners are built.
_PROBES = """
import json, os, sys, traceback
import torch, torch._dynamo, triton


def probe(mode, env):
    os.environ.update(env)
    import angle_kernels.triton_ops as triton_ops

    before = os.environ.get("TRITON_CACHE_AUTOTUNING")
    if mode == "knob":
        triton.knobs.autotuning.cache = False
        os.environ.pop("TRITON_CACHE_AUTOTUNING")  # the knob alone says what the user chose
    triton_ops.load_ops()
    # the fused kernels' modules (load_ops names the routers of their ops)
    from angle_kernels.triton_ops import similarity_lse, similarity_xent
    autotuners = [kernel.launcher for module in (similarity_xent, similarity_lse)
                  for kernel in module._TUNED["16bit"] + module._TUNED["32bit"]
                  if isinstance(kernel.launcher, triton.runtime.Autotuner)]
    return {"caching": sorted({a.cache_results for a in autotuners}), "count": len(autotuners),
            "env_after": os.environ.get("TRITON_CACHE_AUTOTUNING"), "env_before": before}


for mode, env in json.loads(sys.argv[1]):
    pid = os.fork()
    if pid == 0:
        try:
            print(json.dumps(probe(mode, env)), flush=True)
            os._exit(0)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
    if os.waitpid(pid, 0)[1] != 0:
        sys.exit(f"the probe of {mode} {env} failed")
"""


def _probes(*probes: tuple[str, dict]) -> list[dict]:
    """What each probe (mode, environment) found, each in a process of its own (_PROBES)."""
    environment = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_CACHE_AUTOTUNING")}
    done = subprocess.run([sys.executable, "-c", _PROBES, json.dumps(probes)], capture_output=True, text=True,
                          env=environment, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    found = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(found) == len(probes), done.stdout[-2000:]
    return found


def test_the_autotuners_keep_their_results_unless_the_user_chose():
    default, chosen_off, knob = _probes(("default", {}), ("default", {"TRITON_CACHE_AUTOTUNING": "0"}), ("knob", {}))
    assert default["count"] > 0 and default["caching"] == [True]
    assert default["env_after"] is None  # the rest of the process (and its subprocesses) as the user left it
    assert chosen_off == {"caching": [False], "count": default["count"], "env_after": "0", "env_before": "0"}
    assert knob["caching"] == [False]


def test_what_turns_the_cache_on_is_in_no_code_paths_fingerprint():
    modules = {module for key in fingerprints.PATH_CODE for module, _ in fingerprints.path_closure(*key).members}
    assert "triton_ops" not in modules  # the package's __init__: load_ops and autotuning_results_kept
    assert "triton_ops._common" in modules  # the autotuners' own construction is (so it stays untouched)

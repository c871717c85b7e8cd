"""Compile every Triton kernel for a real GPU target (sm_90) without a GPU, and check the autotuning setup.

The interpreter tests (the triton cases of tests/ops) accept code that a GPU compile rejects: dot operand layouts and
dtypes, fp64 math lowering, scan/reduce combine functions, register allocation. This test compiles each kernel with
Triton's own ptxas for sm_90 (fp32 and bf16 signatures, plus fp64 for the ranking scans; the CI subset of
`angle_kernels.triton_ops._compile_check`: 62 compiles, each a distinct kernel specialisation, about 100 s of one
core, nearly all of it Triton's lowering and ptxas) and checks that nothing failed and that no kernel of an op
module was left out.

It must run without TRITON_INTERPRET (interpreted kernels cannot be compiled), so it runs in a subprocess
with that variable removed, which also keeps it independent of tests/ops' interpreter setup. The autotuner
objects exist only in that mode too, so the checks of similarity_xent's and similarity_lse's autotune keys run the
same way, all of them in one process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parent.parent


def _compiled_mode_env(tmp_path) -> dict:
    """The environment of a subprocess in which triton compiles (no interpreter) into a fresh cache."""
    # (and without the GPU run's ANGLE_KERNELS_AUTOTUNE=first: the autotuner checks below state the defaults)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "ANGLE_KERNELS_AUTOTUNE")}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compile for real, not from a cache
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


@pytest.mark.slow  # about 100 s of one core (62 cold compiles, see above)
def test_every_kernel_compiles_for_sm90(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "angle_kernels.triton_ops._compile_check", "--arch", "90"],
        cwd=REPO, env=_compiled_mode_env(tmp_path), capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"sm_90 compile failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("_")]
    assert lines, proc.stdout  # (compile_all itself fails when an op module has a kernel without a compile case)
    for line in lines:
        assert "regs=" in line and "shared=" in line, line


_DESCRIBE_AUTOTUNERS = """
import importlib, json, os, sys
from angle_kernels.triton_ops._common import AUTOTUNE_ENV

def describe(tables):
    described = {}
    for op, table in tables:
        module = importlib.import_module("angle_kernels.triton_ops." + op)
        described[op + "." + table] = [
            {"kernel": tuner.fn.__name__, "keys": list(tuner.keys), "args": list(tuner.arg_names),
             "not_specialized": [p.name for p in tuner.fn.params if p.do_not_specialize],
             "reset_to_zero": list(tuner.reset_to_zero), "restore_value": list(tuner.restore_value),
             "declared": [list(tuned.tuning.reset_to_zero), list(tuned.tuning.restore_value)],
             "configs": len(tuner.configs)}
            for kernels in getattr(module, table).values() for tuned in kernels for tuner in [tuned.launcher]]
    return described

tables, first_tables = json.loads(sys.argv[1])
described = {"default": describe(tables)}
# The modules build their autotuners when they are imported: import the ones read with AUTOTUNE_ENV=first again
# under it (the same module code as a fresh process's import, without a second start of Python, torch and triton).
os.environ[AUTOTUNE_ENV] = "first"
for op in dict.fromkeys(op for op, _ in first_tables):
    importlib.reload(importlib.import_module("angle_kernels.triton_ops." + op))
described["first"] = describe(first_tables)
print(json.dumps(described))
"""
# The TunedKernel tables whose autotuners the tests below read: (op module, table name).
TABLES = (("similarity_xent", "_TUNED"), ("similarity_xent", "_PREFIX_TUNED"), ("similarity_lse", "_TUNED"))
# The tables read again with ANGLE_KERNELS_AUTOTUNE=first.
FIRST_CONFIG_TABLES = (("similarity_xent", "_PREFIX_TUNED"),)


@pytest.fixture(scope="module")
def described_autotuners(tmp_path_factory) -> dict:
    """{"default": {"op.table": [each autotuner's keys, arguments, declarations, configs]} for TABLES, "first": the
    same for FIRST_CONFIG_TABLES with ANGLE_KERNELS_AUTOTUNE=first}, read in one compiled-mode process (its start,
    importing torch, triton and the kernels, is most of what a description costs)."""
    proc = subprocess.run(
        [sys.executable, "-c", _DESCRIBE_AUTOTUNERS, json.dumps([TABLES, FIRST_CONFIG_TABLES])],
        cwd=REPO, env=_compiled_mode_env(tmp_path_factory.mktemp("autotuners")), capture_output=True, text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-8000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def autotuners(described_autotuners):
    """The default settings' descriptions: autotuners(op, table) -> its list."""
    return lambda op, table="_TUNED": described_autotuners["default"][f"{op}.{table}"]


def test_similarity_xent_autotunes_on_row_count_buckets(autotuners):
    """A new batch size must neither re-tune (the key holds power-of-two buckets of M and Mc, not M and Mc)
    nor recompile (M, Mc and the buckets are not specialised on their values)."""
    tuners = autotuners("similarity_xent")
    assert sorted(t["kernel"] for t in tuners) == sorted(
        2 * ["_similarity_xent_fwd_kernel", "_similarity_xent_bwd_dq_kernel", "_similarity_xent_bwd_dc_kernel"])
    for tuner in tuners:
        assert tuner["keys"] == ["M_BUCKET", "Mc_BUCKET", "D", "PARTNER_TARGET", "EXCLUDE_DIAGONAL", "HAS_GROUPS",
                                 "HAS_MARGIN", "PRECISION"], tuner["kernel"]
        # triton 3.6 silently drops a key that is not an argument name (3.9 raises): check it here.
        assert set(tuner["keys"]) <= set(tuner["args"]), tuner["kernel"]
        assert tuner["not_specialized"] == ["M", "Mc", "M_BUCKET", "Mc_BUCKET"], tuner["kernel"]


def test_similarity_xent_prefix_kernels_autotune_on_row_count_buckets(autotuners):
    """The dims kernels (nested prefixes) likewise, with the number of prefixes rounded up to a power of two (KP,
    a constexpr) in the key; the number of prefixes itself is not specialised (the widths are in a tensor)."""
    tuners = autotuners("similarity_xent", "_PREFIX_TUNED")
    assert sorted(t["kernel"] for t in tuners) == sorted(2 * [
        "_similarity_xent_prefix_fwd_kernel", "_similarity_xent_prefix_bwd_dq_kernel",
        "_similarity_xent_prefix_bwd_dc_kernel"])
    for tuner in tuners:
        assert tuner["keys"] == ["M_BUCKET", "Mc_BUCKET", "D", "PARTNER_TARGET", "EXCLUDE_DIAGONAL", "HAS_GROUPS",
                                 "HAS_MARGIN", "PRECISION", "KP"], tuner["kernel"]
        assert set(tuner["keys"]) <= set(tuner["args"]), tuner["kernel"]
        assert tuner["not_specialized"] == ["M", "Mc", "M_BUCKET", "Mc_BUCKET", "K"], tuner["kernel"]
        # the gradient kernels add into zeroed buffers: the autotuner zeroes them before each of its runs
        resets = {"_similarity_xent_prefix_fwd_kernel": [], "_similarity_xent_prefix_bwd_dq_kernel": ["dq_raw_ptr"],
                  "_similarity_xent_prefix_bwd_dc_kernel": ["dc_raw_ptr"]}[tuner["kernel"]]
        assert tuner["reset_to_zero"] == resets and tuner["declared"] == [resets, []], tuner


def test_the_autotuners_get_exactly_what_the_launches_declare(autotuners, described_autotuners):
    """triton.autotune receives each TunedKernel's own Tuning (what tests/ops/test_autotune_side_effects.py
    replays under the interpreter), every config by default, and only the first with ANGLE_KERNELS_AUTOTUNE=first."""
    for op, table in TABLES:
        for tuner in autotuners(op, table):
            assert [tuner["reset_to_zero"], tuner["restore_value"]] == tuner["declared"], tuner
            assert tuner["configs"] == 3, tuner
    first = described_autotuners["first"]["similarity_xent._PREFIX_TUNED"]
    assert {t["configs"] for t in first} == {1}


def test_similarity_lse_autotunes_on_row_count_buckets(autotuners):
    """As similarity_xent's; besides the batch sizes, a rank's target offset and the period vary from call to
    call and are not specialised either."""
    tuners = autotuners("similarity_lse")
    assert sorted(t["kernel"] for t in tuners) == sorted(
        2 * ["_similarity_lse_fwd_kernel", "_similarity_lse_bwd_dq_kernel", "_similarity_lse_bwd_dc_kernel"])
    for tuner in tuners:
        assert tuner["keys"] == ["M_BUCKET", "Mc_BUCKET", "D", "DF", "PENALTY_ON", "HAS_FILTER", "PRECISION",
                                 "FILTER_PRECISION"], tuner["kernel"]
        assert set(tuner["keys"]) <= set(tuner["args"]), tuner["kernel"]
        assert tuner["not_specialized"] == ["M", "Mc", "target_offset", "period", "M_BUCKET", "Mc_BUCKET"], \
            tuner["kernel"]

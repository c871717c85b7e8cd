"""Triton's autotuner, replayed under the interpreter: what its first call of a new key does to a kernel's buffers.

On a GPU, `triton.autotune` runs every config several times on the call's own buffers, then resets the declared
buffers and launches the chosen config for the result (triton/runtime/autotuner.py, `Autotuner.run` and
`_bench`: before each run its pre_hook zeroes `reset_to_zero` and copies `restore_value`, after it the post_hook
copies `restore_value` back). `ReplayedAutotuner` does the same under the interpreter from a TunedKernel's own
declarations; `install` swaps it (or, on a CUDA device, a real autotuner over every config) in for the Triton
backend's autotuned kernels. Used by tests/ops/test_autotune_side_effects.py and tests/ops/test_verify.py.
"""

from __future__ import annotations

from angle_kernels.triton_ops import _common
from angle_kernels.triton_ops import similarity_lse as lse_module
from angle_kernels.triton_ops import similarity_xent as xent_module
from angle_kernels.testing.helpers import TRITON_DEVICE

RUNS_PER_CONFIG = 3
# Every table of TunedKernels the launchers read at call time: (module, attribute).
TUNED_TABLES = ((xent_module, "_TUNED"), (xent_module, "_PREFIX_TUNED"), (lse_module, "_TUNED"))


class ReplayedAutotuner:
    """Stands in for triton.autotune(...)(kernel) under the interpreter and replays what it does on a key's first
    call (see the module docstring); counts the launches."""

    def __init__(self, tuned: _common.TunedKernel):
        self.tuned = tuned
        self.launches = 0

    def __getitem__(self, grid):
        kernel, tuning, configs = self.tuned.kernel, self.tuned.tuning, self.tuned.configs

        def launch(config, args, constexprs):
            self.launches += 1
            kernel[grid](*args, **constexprs, **config.kwargs, num_warps=config.num_warps)

        def run(*args, **constexprs):
            named = dict(zip(kernel.arg_names, args))
            for config in configs:
                for _ in range(RUNS_PER_CONFIG):
                    for name in tuning.reset_to_zero:
                        named[name].zero_()
                    saved = {name: named[name].clone() for name in tuning.restore_value}
                    launch(config, args, constexprs)
                    for name, value in saved.items():
                        named[name].copy_(value)
            for name in tuning.reset_to_zero:
                named[name].zero_()
            launch(configs[-1], args, constexprs)

        return run


def like_a_first_call(tuned: _common.TunedKernel) -> _common.TunedKernel:
    """`tuned` as a first call of a new key runs it: replayed under the interpreter, or on a CUDA device a real
    autotuner over every config (a fresh one: every key is new to it)."""
    if TRITON_DEVICE.type == "cpu":
        return tuned._replace(launcher=ReplayedAutotuner(tuned))
    return tuned._replace(launcher=_common.autotuner(tuned.kernel, tuned.configs, tuned.key, tuned.tuning))


def install(monkeypatch, make) -> list:
    """Swap every TunedKernel of the launchers' tables for make(tuned); returns the new ones."""
    installed = []
    for module, attribute in TUNED_TABLES:
        table = {name: tuple(make(tuned) for tuned in kernels) for name, kernels in getattr(module, attribute).items()}
        monkeypatch.setattr(module, attribute, table)
        installed += [tuned for kernels in table.values() for tuned in kernels]
    return installed

"""Settings for the benchmark cases in this folder (the OpenMP wait policy is set in the root conftest.py).

Without pytest-benchmark installed, a stand-in `benchmark` fixture runs each case once (untimed), so the
cases still check that every provider runs.
"""

import re

import pytest


class _RunOnce:
    """The part of pytest-benchmark's fixture that the cases use, running the function once, untimed."""

    def __init__(self):
        self.extra_info = {}

    def __call__(self, fn, *args, **kwargs):
        return fn(*args, **kwargs)

    def pedantic(self, fn, args=(), kwargs=None, setup=None, rounds=1, warmup_rounds=0, iterations=1):
        if setup is not None:
            setup()
        return fn(*args, **(kwargs or {}))


@pytest.fixture
def flags_without_default(capsys):
    """A bench script's flags whose --help entry gives no default (no text, or a text that names none): a function
    of the script's main; -h and the switches in `switches` (flags that take no value) are not asked for one."""
    def listed(main, switches=("--json",)) -> list[str]:
        with pytest.raises(SystemExit):
            main(["--help"])
        entries = re.split(r"\n  (?=-)", capsys.readouterr().out.split("options:")[1])[1:]
        assert entries, "--help lists no flags"
        return [entry.split()[0] for entry in entries
                if not entry.startswith(("-h", *switches)) and "default" not in entry]

    return listed


class _FallbackBenchmarkPlugin:
    @pytest.fixture
    def benchmark(self):
        return _RunOnce()


def pytest_configure(config):
    if not config.pluginmanager.hasplugin("benchmark"):  # pytest-benchmark missing or disabled
        config.pluginmanager.register(_FallbackBenchmarkPlugin(), "angle-kernels-benchmark-fallback")

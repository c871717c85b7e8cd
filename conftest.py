"""Pytest setup shared by tests/ and bench/: where the Triton kernels run, the debug switches tests rely on, the
garbage collector, and torch's thread count.

Triton interpreter. The Triton kernels run through the interpreter (TRITON_INTERPRET=1, CPU tensors) exactly
when the session has no CUDA device, and with the real compiler on CUDA tensors when it has one, so that
`pytest tests/ops` on a GPU machine tests the compiled kernels. ANGLE_KERNELS_TRITON_TEST_DEVICE=cpu forces
the interpreter (=cuda forces the compiler). The choice is made here, before anything imports triton: triton
decorates its own language functions (tl.zeros, tl.sum, ...) in the mode in force when it is first imported,
and any test may import it first (torch.compile's inductor does); a kernel run under the interpreter with a
compiled-mode triton fails with "Cannot call @triton.jit'd outside of the scope of a kernel". Turning the
interpreter on changes nothing for the other backends: dispatch uses Triton only for CUDA tensors or when
asked.

Poisoned outputs. ANGLE_KERNELS_POISON_OUTPUTS=1 makes the Triton launchers fill every output with NaN before
a kernel writes it (production allocates with torch.empty), so an element a kernel forgets to write fails the
tests that check outputs are finite.

OpenMP. GNU OpenMP's threads spin while they wait for each other; on a machine shared with other jobs that
turns every parallel op into a wait for a descheduled thread (see bench/bench_losses.py). libgomp reads
OMP_WAIT_POLICY when torch loads it, so it is set here, before the `import torch` below; an explicit value
in the environment wins.

Garbage collection. Once the tests are collected, everything alive then (the modules collection imported,
torch's and transformers' among them: about 700,000 objects) is moved out of the collector's sight (gc.freeze):
each full collection would otherwise walk it again, a third of a second each, and the benchmark harness collects
before every memory measurement. Objects freed by reference counting still are; only a reference cycle among
what was frozen stays, until the session ends.

Threads. Every test runs torch on one thread (an autouse fixture): the tests' tensors and models are small, where a
second thread saves little, and a loaded CI machine punishes oversubscription. The thread count is process-wide
state, so a test (or fixture) that changed it would change it for every test after it: each test starts from one
thread and leaves the count as it found it. Tests with large work (the STS-B fine-tuning and evaluation) opt out
with @pytest.mark.all_threads and run on torch's default count (ALL_THREADS). Processes a test starts set their own.
"""

import gc
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("ANGLE_KERNELS_POISON_OUTPUTS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402  (after OMP_WAIT_POLICY)

TEST_DEVICE_ENV = "ANGLE_KERNELS_TRITON_TEST_DEVICE"


def use_triton_interpreter(environ=os.environ, cuda_available=torch.cuda.is_available) -> bool:
    """True when this test session must run the Triton kernels through the interpreter (see above)."""
    forced = environ.get(TEST_DEVICE_ENV, "").strip().lower()
    if forced not in ("", "cpu", "cuda"):
        raise ValueError(f"{TEST_DEVICE_ENV} must be 'cpu' or 'cuda', got {forced!r}")
    if forced:
        return forced == "cpu"
    return not cuda_available()


if use_triton_interpreter():
    os.environ["TRITON_INTERPRET"] = "1"
else:
    os.environ.pop("TRITON_INTERPRET", None)


def pytest_collection_finish(session):
    gc.collect()  # what is garbage now is freed, not frozen
    gc.freeze()


def pytest_unconfigure(config):
    gc.unfreeze()  # in sight again for the collection at exit (nanobind's modules, triton's, report what it misses)


ALL_THREADS = torch.get_num_threads()  # torch's default here (OMP_NUM_THREADS, else the cores), before any test


@pytest.fixture(autouse=True)
def one_thread(request):
    """One torch thread for the test, or ALL_THREADS for a test marked all_threads; the count it found afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(ALL_THREADS if request.node.get_closest_marker("all_threads") else 1)
    yield
    torch.set_num_threads(before)

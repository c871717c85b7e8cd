"""Pytest setup shared by tests/ and bench/: where the Triton kernels run, the debug switches tests rely on, the
garbage collector, and torch's thread count.

Triton interpreter. The Triton kernels run through the interpreter (TRITON_INTERPRET=1, CPU tensors) exactly
when the session has no CUDA device, and with the real compiler on CUDA tensors when it has one, so that
`pytest tests/ops` on a GPU machine tests the compiled kernels. Under the interpreter, Triton's repatching of
triton.language at every helper call inside a kernel is skipped (angle_kernels.testing.triton_interpreter: a quarter
to two fifths of the interpreter's time, no value changed). ANGLE_KERNELS_TRITON_TEST_DEVICE=cpu forces
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
thread and leaves the count as it found it. Tests with large work (the STS-B fine-tuning and evaluation) are marked
@pytest.mark.all_threads and run on torch's default count (ALL_THREADS) shared among the pytest-xdist workers: all of
it in a single process, one thread each with two workers on two cores. (The STS-B recipe took 150 s on two threads
of two idle cores and 199 s on one: a second thread saves a quarter of the time for twice the cores, and beside a busy
worker each of torch's parallel regions waits for the thread that shares a core.) Processes a test starts set their
own, on that share by default (an xdist worker sets OMP_NUM_THREADS to it for them); the memory measurements'
processes take it explicitly (the `thread_share` fixture).

The Hugging Face Hub. The tests run offline (HF_HUB_OFFLINE=1, set before anything imports huggingface_hub).

Order. The files holding a test marked all_threads (the STS-B recipe, 3.5 minutes on one thread) are handed out
first, then the others as xdist orders them (--loadscope-reorder: most tests first). xdist's order alone put the recipe,
a file of one test, near the end, where one worker ran it while the other had nothing left (150 s of a run's 855 s).
Moving every long file first (the nvcc and Triton compile checks, the memory measurements) made them run at once, with
their subprocesses' threads on the two cores, and the run took longer. scripts/test.sh passes --no-loadscope-reorder
so that this order is the one xdist hands out; it changes nothing else.
"""

import collections
import gc
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("ANGLE_KERNELS_POISON_OUTPUTS", "1")
# No test reaches the Hugging Face Hub: offline, a name never downloaded fails at once, where online the loaders retry
# for about 25 s first. huggingface_hub reads these when first imported, and any test module may import it first
# (sentence-transformers', transformers' and datasets' do): set here, before any of them is collected.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

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
    from angle_kernels.testing.triton_interpreter import skip_repatching_inside_kernels  # noqa: E402

    skip_repatching_inside_kernels()  # the interpreter's speed only (see that module)
else:
    os.environ.pop("TRITON_INTERPRET", None)


def pytest_collection_modifyitems(items):
    """The files holding an all_threads test first, then the rest with the most tests first (see Order above); the
    sort is stable, so a file's tests (collected together) keep their order, and files of as many tests theirs."""
    first = {item.path for item in items if item.get_closest_marker("all_threads")}
    tests_in = collections.Counter(item.path for item in items)
    items.sort(key=lambda item: (item.path not in first, -tests_in[item.path]))


def pytest_collection_finish(session):
    gc.collect()  # what is garbage now is freed, not frozen
    gc.freeze()


def pytest_unconfigure(config):
    gc.unfreeze()  # in sight again for the collection at exit (nanobind's modules, triton's, report what it misses)


def shared_threads(environ=os.environ, default: int | None = None) -> int:
    """This worker's share of torch's default thread count (`default`: OMP_NUM_THREADS, else the cores) among the
    pytest-xdist workers (PYTEST_XDIST_WORKER_COUNT; none: all of it), at least one."""
    default = torch.get_num_threads() if default is None else default
    return max(1, default // int(environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


ALL_THREADS = shared_threads()  # before any test changed the count
if "PYTEST_XDIST_WORKER" in os.environ:
    # the processes this worker's tests start (CLI runs, README blocks, benchmarks) run torch on the same share;
    # this process's own torch has already read its default
    os.environ["OMP_NUM_THREADS"] = str(ALL_THREADS)


@pytest.fixture(scope="session")
def thread_share() -> int:
    """ALL_THREADS, for a test whose subprocesses do its large work (tests/test_memory.py's measuring processes)."""
    return ALL_THREADS


@pytest.fixture(autouse=True)
def one_thread(request):
    """One torch thread for the test, or ALL_THREADS for a test marked all_threads; the count it found afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(ALL_THREADS if request.node.get_closest_marker("all_threads") else 1)
    yield
    torch.set_num_threads(before)

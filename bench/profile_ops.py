"""Where a call's time goes: each backend's forward + backward of an op (or one of our losses), profiled on a GPU.

The op sweep says how long a call takes; this says why. For each case and backend it reports, per call
(forward + backward, warm, the inputs' gradients reset before each):

    wall       the median of the call waited for (the GPU idle before it, synchronised after), ms
    host       the median time until the call returns, the GPU idle before it: what the host spends on Python,
               dispatch and launches (a call that waits on the GPU inside, a sync, counts the wait too)
    queued     calls issued back to back and waited for once at the end, per call: a training step's view, where
               the host runs ahead of the GPU
    busy       the GPU's time in kernels and copies per call (torch.profiler: the union of their intervals)
    launches   kernels per call; d2h and syncs: the call's own device-to-host copies and synchronisations (each
               stalls the host until the GPU has caught up)
    ops        torch ops dispatched per call at top level (aten:: and the package's own, not those inside them)
    top        the kernels (on CPU: the torch ops) with the most time per call

A call whose busy time is under half its wall time is host-bound: its time is Python, dispatch and launches, and a
faster kernel would not show (the fix is fewer launches, syncs and ops); device-bound otherwise, and the top kernels
say which to work on. The cases by default are the losses that measured launch-bound on an H200
(bench/results/h200-2026-12-04b/), ours on `auto` beside the references, then the points where the CUDA backend
missed its target of 1.2x Triton's time there (bench/results/h200-2026-12-04/README.md), largest gap first, on both;
each case's backends run one after the other, so a run cut by --time-budget keeps whole comparisons. A chrome trace
of each row is packed into traces.tar.gz (open it in https://ui.perfetto.dev).

    python bench/profile_ops.py --out DIR [--cases NAME:N:D[:DTYPE],... --backends triton,cuda]   on a GPU
    TRITON_INTERPRET=1 python bench/profile_ops.py --device cpu --out DIR    the dry run: tiny sizes, CPU ops

NAME is an op sweep benchmark (`similarity_xent(ibn)`, `pair_scores(dims)`, ...; `--list` prints them) or
`loss:<name>` for one of our losses as the loss sweep calls it (`loss:cosine`, `loss:mnrl_gte`, ...); a backend is
triton, cuda, torch, auto, or a scheme label of the op sweep (triton-fused, triton-dense, cuda-fused, cuda-dense),
which forces that scheme, and for a loss also `reference` (angle-emb's) or `sentence-transformers`. The CUDA
backend's rows need its extension: built in place by the GPU check's first stage (run this after it, in the same
command), else JIT-built here at the first CUDA row (about a minute).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import harness  # first: sets OMP_WAIT_POLICY before torch loads; the atomic writes

# Issue 46's points where the CUDA backend's time was more than 1.2x Triton's (bf16; the ranking term in float32):
# bench/results/h200-2026-12-04/README.md, "The CUDA backend against Triton". (name, N, D, dtype); N is the op
# sweep's size (pairs, scores, or the N of its N x N / N x 2N logits).
CUDA_GAP_CASES = (
    ("similarity_xent(arccon)", 1024, 768, "bfloat16"),  # 2.45x
    ("similarity_lse", 1024, 768, "bfloat16"),  # 2.21x
    ("similarity_xent(ibn)", 1024, 4096, "bfloat16"),  # 1.84x
    ("ranking_loss", 4096, 1, "float32"),  # 1.74x
    ("similarity_xent(arccon)", 4096, 768, "bfloat16"),  # 1.65x
    ("similarity_lse(dims)", 1024, 768, "bfloat16"),  # 1.59x
    ("similarity_xent(ibn)", 4096, 768, "bfloat16"),  # 1.56x
    ("similarity_xent(dims)", 1024, 768, "bfloat16"),  # 1.52x
    ("similarity_lse", 1024, 4096, "bfloat16"),  # 1.51x
    ("similarity_lse(dims)", 4096, 768, "bfloat16"),  # 1.48x
    ("pair_scores(dims)", 16384, 4096, "bfloat16"),  # 1.47x
    ("pair_scores(dims)", 262144, 4096, "bfloat16"),  # 1.45x (21.1 against 14.6 ms: not a launch-bound size)
    ("similarity_xent(ibn)", 1024, 768, "bfloat16"),  # 1.45x
    ("pair_scores", 16384, 4096, "bfloat16"),  # 1.40x
    ("pair_scores(dims)", 16384, 768, "bfloat16"),  # 1.39x
    ("similarity_lse", 4096, 4096, "bfloat16"),  # 1.33x
    ("similarity_xent(dims)", 4096, 768, "bfloat16"),  # 1.23x
    ("similarity_lse", 4096, 768, "bfloat16"),  # 1.22x
)
GPU_BACKENDS = ("triton", "cuda")
# Issue 40's launch-bound losses (bench/results/h200-2026-12-04b/): the cosine loss at 8,192 pairs took 2.71 ms
# where its pair scores take under 0.65; at 4,096 the contrastive loss and MNRL with hardness were slower than the
# references'. Ours on `auto`, as users call them, beside each reference that provides the loss.
LOSS_CASES = (("loss:cosine", 8192, 768, "bfloat16"), ("loss:contrastive", 4096, 768, "bfloat16"),
              ("loss:mnrl_hardness", 4096, 768, "bfloat16"))
# The references a loss case may name as its backends (the loss sweep's provider families): angle-emb's loss.py
# (--angle-emb-loss, else the wheel scripts/gpu_bring.sh brings, else the installed package) and
# sentence-transformers' losses fed the embeddings.
REFERENCES = ("reference", "sentence-transformers")
# The dry run on CPU: tiny sizes, the torch backend, and Triton's kernels through the interpreter where it is quick
# (its pair-score kernels take seconds a call there); (case, backends).
CPU_PLAN = ((("similarity_xent(ibn)", 16, 32, "float32"), ("torch", "triton")),
            (("pair_scores", 64, 32, "float32"), ("torch",)),
            (("loss:cosine", 64, 32, "float32"), ("torch", "reference", "sentence-transformers")))
CPU_BACKENDS = ("torch", "triton")  # --cases on cpu without --backends

PROFILED_CALLS = 5  # calls under the profiler per row (its per-call figures are their mean)
TRACE_ARCHIVE = "traces.tar.gz"
TOP = 6  # kernels (ops) listed per row
LOSS_PREFIX = "loss:"
# The backends' own waits on the GPU, as the CUDA runtime names them (the profiler's runtime events)
SYNC_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")


def op_benches() -> dict:
    import bench_losses

    return bench_losses.OPS


def loss_benches() -> dict:
    import bench_losses

    return bench_losses.LOSSES


def parse_case(text: str) -> tuple[str, int, int, str]:
    """NAME:N:D[:DTYPE] (NAME may be loss:<name>) -> (name, n, d, dtype name); a ValueError naming what is wrong."""
    parts = text.strip().split(":")
    if parts[0] == LOSS_PREFIX[:-1] and len(parts) > 1:
        parts = [LOSS_PREFIX + parts[1], *parts[2:]]
    if len(parts) == 3:
        parts.append("bfloat16")
    if len(parts) != 4:
        raise ValueError(f"a case is NAME:N:D[:DTYPE], got {text!r}")
    name, n, d, dtype = parts
    known = (loss_benches() if name.startswith(LOSS_PREFIX) else op_benches())
    if name.removeprefix(LOSS_PREFIX) not in known:
        raise ValueError(f"case {text!r}: unknown benchmark {name!r}; --list prints the known ones")
    if dtype not in harness.DTYPES:
        raise ValueError(f"case {text!r}: the dtype must be one of {', '.join(harness.DTYPES)}, got {dtype!r}")
    if not (n.isdigit() and d.isdigit() and int(n) >= 1 and int(d) >= 1):
        raise ValueError(f"case {text!r}: N and D must be whole numbers of at least 1")
    return name, int(n), int(d), dtype


def reference_context(family: str, angle_emb_loss: str | None):
    """What a reference family's implementations are made with (providers.py): angle-emb's loss module, or
    sentence-transformers' losses module."""
    import gpu_suite
    import providers

    if family == "reference":
        return providers.load_reference_module(gpu_suite.angle_emb_loss_file(angle_emb_loss))
    return providers.sentence_transformers_losses()


def build_call(name: str, n: int, d: int, dtype, label: str, device: str, angle_emb_loss: str | None = None):
    """(run, leaves, ops or None) of a case on the backend of `label` (a backend, or a scheme label of the op sweep,
    harness.TRITON_SCHEMES and CUDA_SCHEMES, computing on its backend; for a loss, also a reference family): the op
    sweep's setup with Ops that record the paths they take (auto's: None, its choice is per call), or the loss sweep's
    inputs and that provider's implementation of the loss (None)."""
    import gpu_suite
    import torch

    from angle_kernels.dispatch import resolve_backend

    generator = torch.Generator(device=device).manual_seed(n)
    if name.startswith(LOSS_PREFIX):
        loss = loss_benches()[name.removeprefix(LOSS_PREFIX)]
        family = label if label in REFERENCES else "ours"
        if family not in loss.implementations:
            raise ValueError(f"{family} provides no {loss.name} loss")
        inputs = loss.build_inputs(n, d, dtype, device, seed=n)
        context = reference_context(family, angle_emb_loss) if family in REFERENCES else label
        return loss.implementations[family].make(context, inputs), harness.grad_leaves(inputs), None
    if label in REFERENCES:
        raise ValueError(f"{label} is a reference for the losses, not a backend of the op {name}")
    backend = resolve_backend(label.partition("-")[0], torch.empty(0, device=device))
    # auto's choice is its own per call: its Ops compute as they are (a recording copy would compute on torch)
    ops = backend if label == "auto" else gpu_suite.recording_ops(backend)
    run, leaves, _ = op_benches()[name].setup(ops, label, n, d, dtype, device, generator)
    return run, leaves, None if label == "auto" else ops


def _synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def wall_and_host(run, leaves, device: str, runs: int) -> dict:
    """Medians over `runs` calls of their wall time (waited for) and host time (until the call returns), each
    started with the GPU idle; then `runs` calls back to back, waited for once (queued, per call). Seconds."""
    walls, hosts = [], []
    for _ in range(runs):
        _synchronize(device)
        started = time.perf_counter()
        harness.fwd_bwd(run, leaves)
        returned = time.perf_counter()
        _synchronize(device)
        walls.append(time.perf_counter() - started)
        hosts.append(returned - started)
    _synchronize(device)
    started = time.perf_counter()
    for _ in range(runs):
        harness.fwd_bwd(run, leaves)
    _synchronize(device)
    queued = (time.perf_counter() - started) / runs
    return {"wall_s": statistics.median(walls), "wall_min_s": min(walls), "host_s": statistics.median(hosts),
            "queued_s": queued}


def _interval_union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -float("inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def _is_device_event(event) -> bool:
    import torch

    return getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA


def _is_torch_op(name: str) -> bool:
    """A dispatched op (aten::, the package's angle_kernels::): not the autograd engine's evaluation of a backward
    node, whose ops are the backward's own top level, nor a runtime call."""
    return "::" in name and not name.startswith(("autograd::", "profiler::"))


def summarize_events(events, calls: int, device: str, own_syncs: int) -> dict:
    """Per-call figures from a profile of `calls` calls (module docstring): busy, launches, d2h, syncs, ops, top."""
    kernels: dict[str, list[float]] = {}
    device_intervals, launches, d2h, syncs, ops = [], 0, 0, 0, 0
    cpu_ops: dict[str, list[float]] = {}
    for event in events:
        name = event.name
        if _is_device_event(event):
            start, stop = event.time_range.start, event.time_range.end
            device_intervals.append((start, stop))
            if name.startswith("Memcpy"):
                d2h += "DtoH" in name
            elif not name.startswith("Memset"):
                launches += 1
                kernels.setdefault(name, []).append(stop - start)
            continue
        if name in SYNC_CALLS:
            syncs += 1
        if _is_torch_op(name):
            parent = event.cpu_parent
            while parent is not None and not _is_torch_op(parent.name):
                parent = parent.cpu_parent
            if parent is None:  # top level: not dispatched from inside another torch op
                ops += 1
                cpu_ops.setdefault(name, []).append(event.cpu_time_total)
    by_time = kernels if device == "cuda" else cpu_ops
    top = sorted(by_time.items(), key=lambda item: -sum(item[1]))[:TOP]
    # a GPU profile without a single device event saw nothing (CUPTI missing or failing), not an idle GPU
    busy = _interval_union_us(device_intervals) / 1e6 / calls if device_intervals or device != "cuda" else None
    return {"busy_s": busy, "launches": launches / calls,
            "d2h": d2h / calls, "syncs": max(0, syncs - own_syncs) / calls, "ops": ops / calls,
            "top": [{"name": name[:120], "ms": sum(times) / 1e3 / calls, "count": len(times) / calls}
                    for name, times in top]}


def profile_calls(run, leaves, device: str, trace: Path | None) -> dict:
    """PROFILED_CALLS calls under torch.profiler, each waited for; their per-call figures, and the chrome trace."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    _synchronize(device)
    with profile(activities=activities) as prof:
        for _ in range(PROFILED_CALLS):
            harness.fwd_bwd(run, leaves)
            _synchronize(device)
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    own_syncs = PROFILED_CALLS if device == "cuda" else 0
    return summarize_events(prof.events(), PROFILED_CALLS, device, own_syncs)


def bound(row: dict) -> str:
    """host: the GPU busy under half the wall time; device otherwise; "" without a GPU or a GPU profile (nothing to
    tell)."""
    if row.get("device") != "cuda" or row.get("busy_s") is None:
        return ""
    return "host" if row["busy_s"] < 0.5 * row["wall_s"] else "device"


def profile_row(name: str, n: int, d: int, dtype_name: str, label: str, device: str, runs: int,
                trace: Path | None, angle_emb_loss: str | None = None) -> dict:
    """One case on one backend: its first call (compiles, autotuning), then wall_and_host and profile_calls."""
    row = {"case": name, "n": n, "d": d, "dtype": dtype_name, "backend": label, "device": device}
    dtype = harness.DTYPES[dtype_name]
    with harness.forced_scheme(label):
        run, leaves, ops = build_call(name, n, d, dtype, label, device, angle_emb_loss)
        if ops is not None:
            ops.taken = []
        row["cold_s"] = harness.cold_call(run, leaves, device)
        if ops is not None:
            paths = sorted({path for _, path in ops.taken})
            ops.taken = None
            row["path"] = ",".join(paths)
        row.update(wall_and_host(run, leaves, device, runs))
        row.update(profile_calls(run, leaves, device, trace))
    row["bound"] = bound(row)
    if device == "cuda" and row["busy_s"] is None:
        row["note"] = "the profiler recorded no GPU activity (CUPTI unavailable?): busy, launches and top unknown"
    return row


def _ms(seconds) -> str:
    return "" if seconds is None else f"{1e3 * seconds:.3f}"


def row_line(r: dict) -> str:
    head = f"| {r['case']} | {r['n']:,} | {r['d']} | {r['dtype']} | {r['backend']}"
    if "error" in r:
        return head + f" | {r['error']} | | | | | | | |"
    path = f" ({r['path']})" if r.get("path") else ""
    top = r.get("note") or "; ".join(f"{t['name'][:60]} {t['ms']:.3f} x{t['count']:g}" for t in r["top"][:3])
    return (head + f"{path} | {_ms(r['wall_s'])} | {_ms(r['host_s'])} | {_ms(r['queued_s'])} | "
            f"{_ms(r['busy_s']) if r['device'] == 'cuda' else ''} | {r['launches']:g} / {r['d2h']:g} / "
            f"{r['syncs']:g} | {r['ops']:g} | {r['bound']} | {top} |")


def markdown(rows: list[dict], env: dict, runs: int) -> str:
    lines = ["# Where a call's time goes", "",
             f"- {env.get('gpu') or env.get('cpu')}, torch {env.get('torch')}, triton {env.get('triton')}, "
             f"angle_kernels at {env.get('angle_kernels_commit')}; forward + backward, warm; wall, host and queued "
             f"the medians of {runs} calls, the profile's figures the mean of {PROFILED_CALLS} "
             "(bench/profile_ops.py: what each column means)", "",
             "| case | N | D | dtype | backend (path) | wall ms | host ms | queued ms | busy ms | launches / d2h / "
             "syncs | ops | bound | top (ms per call x count) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [row_line(r) for r in rows]
    return "\n".join(lines) + "\n"


def pack_traces(folder: Path, archive: Path) -> None:
    """Every trace written so far into one archive (rewritten whole, atomically: a cut run keeps the last one)."""
    partial = archive.with_name(archive.name + ".partial")
    with tarfile.open(partial, "w:gz") as tar:
        for trace in sorted(folder.glob("*.json")):
            tar.add(trace, arcname=trace.name)
    os.replace(partial, archive)


def default_cases(device: str) -> list[tuple[tuple, tuple[str, ...]]]:
    """(case, backends) to profile when --cases is not given."""
    if device == "cpu":
        return list(CPU_PLAN)
    return [(case, loss_contenders(case[0])) for case in LOSS_CASES] + [(case, GPU_BACKENDS) for case in CUDA_GAP_CASES]


def loss_contenders(name: str) -> tuple[str, ...]:
    """Ours on auto, then each reference that provides the loss."""
    implementations = loss_benches()[name.removeprefix(LOSS_PREFIX)].implementations
    return ("auto", *(family for family in REFERENCES if family in implementations))


def known_backend(label: str) -> bool:
    return label in ("triton", "cuda", "torch", "auto", *REFERENCES) or label in {**harness.TRITON_SCHEMES,
                                                                                  **harness.CUDA_SCHEMES}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default), or cpu: the dry run (TRITON_INTERPRET=1, tiny sizes)")
    parser.add_argument("--out", help="folder for results.json, table.md and traces.tar.gz (created)")
    parser.add_argument("--cases", default="",
                        help="comma-separated NAME:N:D[:DTYPE] (dtype default bfloat16); default: the launch-bound "
                             "losses on auto (LOSS_CASES), then the CUDA backend's gaps to Triton (CUDA_GAP_CASES) on "
                             "triton and cuda")
    parser.add_argument("--backends", default="",
                        help="comma-separated backends for --cases (default: triton,cuda; on cpu torch,triton)")
    parser.add_argument("--runs", type=int, default=20, help="calls whose medians are wall and host (default 20)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds: no row starts after them (default: none)")
    parser.add_argument("--angle-emb-loss", default=None,
                        help="angle-emb's loss.py or its wheel, for the reference rows (default: .whl/'s wheel where "
                             "scripts/gpu_bring.sh put it, else the installed package)")
    parser.add_argument("--no-traces", action="store_true", help="write no chrome traces")
    parser.add_argument("--list", action="store_true", help="print the benchmark names a case may take, and exit")
    args = parser.parse_args(argv)
    if args.list:
        print("ops:", ", ".join(op_benches()))
        print("losses:", ", ".join(LOSS_PREFIX + name for name in loss_benches()))
        return 0
    if not args.out:
        parser.error("--out is required: the folder for the results")
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if args.time_budget is not None and args.time_budget <= 0:
        parser.error("--time-budget must be a positive number of seconds")
    backends = tuple(b for b in (part.strip() for part in args.backends.split(",")) if b)
    unknown = [b for b in backends if not known_backend(b)]
    if unknown:
        parser.error(f"--backends: unknown {', '.join(unknown)}; expected triton, cuda, torch, auto, a scheme label "
                     f"({', '.join({**harness.TRITON_SCHEMES, **harness.CUDA_SCHEMES})}) or, for losses, a "
                     f"reference ({', '.join(REFERENCES)})")
    if backends and not args.cases:
        parser.error("--backends applies to --cases: give the cases too")
    try:
        cases = [parse_case(text) for text in args.cases.split(",") if text.strip()]
    except ValueError as exc:
        parser.error(f"--cases: {exc}")
    if not harness.gpu_or_dry_run(parser, args.device, "profile_ops.py"):
        return 0
    plan = ([(case, backends or (GPU_BACKENDS if args.device == "cuda" else CPU_BACKENDS)) for case in cases]
            if cases else default_cases(args.device))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = harness.describe_environment(args.device)
    started = time.monotonic()
    rows: list[dict] = []
    import gpu_suite

    # the GPU backends' paths that await their first verification are profiled too, as the op sweep times them
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory(prefix="profile_ops_") as scratch:
        stack.enter_context(gpu_suite._awaiting_verification_on())
        stack.enter_context(gpu_suite._cuda_awaiting_verification_on())
        for (name, n, d, dtype_name), labels in plan:
            for label in labels:
                if args.time_budget is not None and time.monotonic() - started > args.time_budget:
                    row = {"case": name, "n": n, "d": d, "dtype": dtype_name, "backend": label,
                           "error": "skipped: --time-budget spent"}
                else:
                    trace = None if args.no_traces else Path(scratch) / f"{len(rows):02d}_{label}.json"
                    try:
                        row = profile_row(name, n, d, dtype_name, label, args.device, args.runs, trace,
                                          args.angle_emb_loss)
                    except Exception as exc:  # noqa: BLE001 (one row's failure is its row; the others still run)
                        row = {"case": name, "n": n, "d": d, "dtype": dtype_name, "backend": label,
                               "error": f"{type(exc).__name__}: {exc}"[:300]}
                    if trace is not None and trace.exists():
                        pack_traces(Path(scratch), out / TRACE_ARCHIVE)
                    harness.free_cuda_memory()
                rows.append(row)
                print(row_line(row), flush=True)
                harness.write_json_atomic(out / "results.json", {
                    "environment": env, "argv": sys.argv[1:] if argv is None else list(argv), "rows": rows})
    table = markdown(rows, env, args.runs)
    harness.write_text_atomic(out / "table.md", table)
    print(table)
    return 0 if all("error" not in r or r["error"].startswith("skipped") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

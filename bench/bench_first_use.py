"""The first-use check's cost: what the first call of a kind pays on a GPU the project's table does not cover.

On such a GPU (another model, or other torch and Triton versions) `auto` computes a call on a Triton path whose code
passed the large-size checks on some GPU only after the first call of its kind passed a check against float64
(angle_kernels.first_use); later calls of the kind, in the process or, through the user's cache, in later ones, pay
nothing. This benchmark stands in for such a GPU on the one it runs on: the table's entries count as made elsewhere
(`verified.identity` answers with a GPU and versions no entry has; the code's fingerprints are this checkout's),
the user's cache is a fresh folder, and no measured speeds apply (the fixed order: Triton first). Per op, at one
size, forward + backward:

    compile   the first call on Triton (backend="triton", no check): its kernels' compiles and autotuning, which a
              first call pays with or without the check
    warm      the same call again on Triton (the median of --runs calls, each waited for)
    first     the first `auto` call of the kind: its check, recorded in the fresh cache, then the call
    check     the check's own seconds as recorded (first_use.run_check), and the part of the call it checked
    after     the next `auto` call (no check: the kind is recorded)

so first - warm is what the check costs a first call, compiles excluded. The sizes are the op sweep's; a call larger
than the check's budgets is checked on a part of it (the record's `part`).

    python bench/bench_first_use.py --out DIR                 # on a GPU (bf16; the ranking term in float32)
    python bench/bench_first_use.py --device cpu --out DIR    # the dry run: TRITON_INTERPRET=1, tiny sizes
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import harness  # first: sets OMP_WAIT_POLICY before torch loads; the atomic writes

# (op benchmark, N, D) on a GPU: the sizes users train at, from the op sweep's; on the CPU dry run, tiny ones
GPU_CASES = (("pair_scores", 262144, 768), ("ranking_loss", 1048576, 1), ("similarity_xent(ibn)", 4096, 768),
             ("similarity_xent(ibn)", 16384, 768), ("similarity_lse", 4096, 768))
CPU_CASES = (("pair_scores", 64, 32), ("ranking_loss", 64, 1), ("similarity_xent(ibn)", 16, 32),
             ("similarity_lse", 16, 32))
GPU_DTYPE = "bfloat16"


def op_benches() -> dict:
    import bench_losses

    return bench_losses.OPS


@contextlib.contextmanager
def elsewhere_verified(cache_folder: Path):
    """`auto` as on a GPU the table does not cover, with the user's cache in `cache_folder`: every entry of the
    table counts as made on another GPU (the first-use checks' condition), no measured speed applies, and the
    processes' first-use and auto state start afresh; all undone after."""
    from angle_kernels import dispatch, first_use, measured, user_cache, verified

    def stand_in(backend: str, op: str, path: str, device):
        return {"capability": "0.0", "torch": "0.0", "triton": "0.0", "cuda": "0.0", "gpu": "a GPU no entry covers",
                **verified.code_identity(backend, op, path)}

    saved = (verified.identity, measured.capability, dispatch._auto_ops, os.environ.get(user_cache.CACHE_ENV),
             os.environ.get(first_use.ENV))
    verified.identity = stand_in
    measured.capability = lambda device: None
    dispatch._auto_ops = {}
    os.environ[user_cache.CACHE_ENV] = str(cache_folder)
    os.environ.pop(first_use.ENV, None)  # checks on, the default
    verified.forget()
    first_use.forget()
    try:
        yield
    finally:
        verified.identity, measured.capability, dispatch._auto_ops = saved[:3]
        for name, value in ((user_cache.CACHE_ENV, saved[3]), (first_use.ENV, saved[4])):
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        verified.forget()
        first_use.forget()


def measure(bench, n: int, d: int, dtype, device: str, runs: int, cache_folder: Path) -> dict:
    """One case (module docstring): compile, warm, first, check, after."""
    import torch

    from angle_kernels import dispatch, user_cache

    # what the ops are resolved for: the device's tensors (on the CPU dry run, a stand-in that says CUDA, as the
    # first-use tests do: the kernels then run on CPU tensors through the interpreter)
    probe = (torch.empty(0, device=device) if device == "cuda" else
             SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0)))
    op = bench.name.partition("(")[0]
    triton = dispatch.resolve_backend("triton", probe)
    run, leaves, _ = bench.setup(triton, "triton", n, d, dtype, device, torch.Generator(device=device).manual_seed(n))
    row = {"op": bench.name, "n": n, "d": d, "dtype": str(dtype).replace("torch.", "")}
    row["compile_s"] = harness.cold_call(run, leaves, device)
    row["warm_s"] = statistics.median(harness.cold_call(run, leaves, device) for _ in range(runs))
    with elsewhere_verified(cache_folder):
        auto = dispatch.resolve_backend("auto", probe)
        run, leaves, _ = bench.setup(auto, "auto", n, d, dtype, device,
                                     torch.Generator(device=device).manual_seed(n))
        row["first_s"] = harness.cold_call(run, leaves, device)
        row["after_s"] = statistics.median(harness.cold_call(run, leaves, device) for _ in range(runs))
        records = [r for r in user_cache.read()["checks"] if r.get("op") == op]
    row["checks"] = [{key: r.get(key) for key in ("backend", "path", "pass", "seconds", "part", "errors", "allowed")}
                     for r in records]
    row["check_s"] = sum(r.get("seconds") or 0.0 for r in records)
    row["first_minus_warm_s"] = row["first_s"] - row["warm_s"]
    if not records or not all(r.get("pass") for r in records):
        row["note"] = ("no check recorded: the call was not checked (its path verified nowhere, or too large even "
                       "in part)" if not records else "a check failed: the kind computes on PyTorch")
    return row


def markdown(rows: list[dict], env: dict) -> str:
    lines = ["# The first-use check's cost", "",
             f"- {env.get('gpu') or env.get('cpu')}, torch {env.get('torch')}, triton {env.get('triton')}; "
             f"forward + backward; `auto` as on a GPU the table does not cover (bench/bench_first_use.py)", "",
             "| op | N | D | dtype | compile s | warm ms | first auto call s | its check s (part checked) | "
             "first - warm s | next auto call ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['op']} | {r['n']:,} | {r['d']} | {r['dtype']} | {r['error']} | | | | | |")
            continue
        parts = "; ".join(f"{c['seconds']:.3f} ({c.get('part') or 'all'}, {'pass' if c['pass'] else 'FAIL'})"
                          for c in r["checks"]) or r.get("note", "")
        lines.append(f"| {r['op']} | {r['n']:,} | {r['d']} | {r['dtype']} | {r['compile_s']:.2f} | "
                     f"{1e3 * r['warm_s']:.2f} | {r['first_s']:.3f} | {parts} | {r['first_minus_warm_s']:.3f} | "
                     f"{1e3 * r['after_s']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default), or cpu: the dry run through the Triton interpreter at tiny sizes")
    parser.add_argument("--out", required=True, help="folder for results.json and table.md (created)")
    parser.add_argument("--runs", type=int, default=5, help="calls whose median is a warm time (default 5)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds: no case starts after them (its first call compiles: ~15 s on a GPU)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if args.time_budget is not None and args.time_budget <= 0:
        parser.error("--time-budget must be a positive number of seconds")
    if not harness.gpu_or_dry_run(parser, args.device, "bench_first_use.py"):
        return 0
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    benches = op_benches()
    env = harness.describe_environment(args.device)
    rows = []
    with tempfile.TemporaryDirectory(prefix="angle_kernels_first_use_") as scratch:
        for number, (name, n, d) in enumerate(GPU_CASES if args.device == "cuda" else CPU_CASES):
            if args.time_budget is not None and time.monotonic() - started > args.time_budget:
                rows.append({"op": name, "n": n, "d": d, "dtype": "", "error": "skipped: --time-budget spent"})
                continue
            dtype = torch.float32 if args.device == "cpu" or name == "ranking_loss" else getattr(torch, GPU_DTYPE)
            try:
                row = measure(benches[name], n, d, dtype, args.device, args.runs, Path(scratch) / f"cache{number}")
            except Exception as exc:  # noqa: BLE001 (one case's failure is its row; the others still run)
                row = {"op": name, "n": n, "d": d, "dtype": str(dtype).replace("torch.", ""),
                       "error": f"{type(exc).__name__}: {exc}"[:300]}
            rows.append(row)
            print(markdown([row], env).splitlines()[-1], flush=True)
            harness.write_json_atomic(out / "results.json", {"environment": env, "argv": sys.argv[1:] if argv is None
                                                             else list(argv), "rows": rows})
    table = markdown(rows, env)
    harness.write_text_atomic(out / "table.md", table)
    print(table)
    return 0 if all("error" not in r or r["error"].startswith("skipped") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

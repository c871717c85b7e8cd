#!/usr/bin/env python
"""The one GPU script: build, correctness on CUDA, then the benchmark sweep, for the Triton backend.

    python bench/gpu_suite.py OUT_DIR [--angle-emb-loss WHEEL_OR_LOSS_PY] [--quick] [--skip ...]

Runs only where CUDA is available (it exits with a message otherwise; `--help` works anywhere). Stages, each
recorded in OUT_DIR and none stopping the others:

1. environment: GPU name, driver, torch / triton / CUDA versions, the command line (environment.json).
2. build: warms every Triton kernel with a small call of each op (JIT compile time), tries the CUDA C++
   extension, and compiles every Triton kernel for this GPU's architecture through
   angle_kernels.triton_ops._compile_check to read registers, spills and shared memory (build.json).
3. correctness on CUDA: pytest on tests/triton with the interpreter off (ANGLE_KERNELS_TRITON_TEST_DEVICE=cuda),
   then large-size checks of every op against the pure-PyTorch backend in float64 (and bf16 against float64
   next to eager PyTorch's own bf16 error) at sizes the interpreter cannot reach (correctness.json,
   pytest_triton.log).
4. op-level sweep of our Triton kernels against our torch backend: N from 1k to 1M pairs, D in {768, 4096},
   fp32 and bf16; time (triton.testing.do_bench median of forward + backward), peak extra memory, and the
   achieved fraction of the device copy bandwidth (pair scores) or bf16/fp32 matmul rate (similarity),
   both measured at the start of the same run (ops.json, ops.md).
5. loss-level sweep with every provider side by side (ours-triton, ours-torch, angle-emb eager loaded by
   file path from a carried wheel, sentence-transformers): bench/bench_losses.py with GPU sizes, written to
   OUT_DIR/losses.

The summary table (correctness verdicts and the op-level sweep) is printed last and written to summary.md.
Expect 10-20 minutes on an H200 for the full run; --quick trims the sizes to about 3 minutes.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for path in (str(REPO), str(HERE)):
    if path not in sys.path:
        sys.path.insert(0, path)

GB = 1e9


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="folder for the results (created)")
    parser.add_argument("--angle-emb-loss", default=None,
                        help="angle-emb 0.6.1 wheel or its angle_emb/loss.py, for the reference provider")
    parser.add_argument("--quick", action="store_true", help="fewer, smaller sizes (about 3 minutes)")
    parser.add_argument("--skip", default="", help="comma-separated stages to skip: build,tests,checks,ops,losses")
    parser.add_argument("--max-run-seconds", type=float, default=20.0,
                        help="loss sweep: skip a size predicted to take longer per run")
    parser.add_argument("--max-ref-gb", type=float, default=60.0,
                        help="loss sweep: skip a baseline whose estimated extra memory exceeds this")
    args = parser.parse_args(argv)
    args.skip = {s for s in args.skip.split(",") if s}
    return args


# --------------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------------


def rel_err(out, ref) -> float:
    import torch

    out = out.detach().to(torch.float64).reshape(-1)
    ref = ref.detach().to(torch.float64).reshape(-1)
    scale = torch.linalg.vector_norm(ref)
    diff = torch.linalg.vector_norm(out - ref)
    return float(diff / scale) if scale > 0 else float(diff)


def free_cuda():
    import torch

    gc.collect()
    torch.cuda.empty_cache()


def stage(name, results, fn):
    """Run one stage; record its result or its error and keep going."""
    print(f"\n=== {name} ===", flush=True)
    started = time.perf_counter()
    try:
        results[name] = {"status": "ok", **(fn() or {})}
    except Exception as exc:  # noqa: BLE001 (a stage's failure is a result, not the end of the run)
        results[name] = {"status": "error", "error": f"{type(exc).__name__}: {exc}",
                         "traceback": traceback.format_exc()}
        print(results[name]["traceback"], flush=True)
    results[name]["seconds"] = round(time.perf_counter() - started, 1)
    free_cuda()


# --------------------------------------------------------------------------------------------------------
# Stages
# --------------------------------------------------------------------------------------------------------


def environment(argv) -> dict:
    import torch
    import triton

    env = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "command": " ".join([sys.executable, "bench/gpu_suite.py"] + list(argv if argv is not None else sys.argv[1:])),
        "gpu": torch.cuda.get_device_name(0),
        "capability": list(torch.cuda.get_device_capability(0)),
        "memory_GB": round(torch.cuda.get_device_properties(0).total_memory / GB, 1),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }
    try:
        env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception as exc:  # noqa: BLE001
        env["driver"] = f"unknown ({exc})"
    return env


def build() -> dict:
    import torch

    import angle_kernels.triton_ops as tops

    out = {}
    ok, why = tops.is_available()
    out["triton_available"] = ok
    if not ok:
        raise RuntimeError(f"triton backend unavailable: {why}")
    t0 = time.perf_counter()
    x = torch.randn(64, 2, 768, device="cuda", requires_grad=True)
    cos, angle = tops.pair_scores(x, True)
    (cos.sum() + angle.sum()).backward()
    s = torch.randn(64, device="cuda", requires_grad=True)
    tops.ranking_loss(s, torch.randint(0, 4, (64,), device="cuda")).backward()
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(128, 768, device="cuda", dtype=dtype, requires_grad=True)
        tops.similarity_xent(q, None, 20.0, "partner", exclude_diagonal=True).backward()
    torch.cuda.synchronize()
    out["triton_warmup_seconds"] = round(time.perf_counter() - t0, 1)
    try:
        import angle_kernels.cuda_ops as cuda_ops

        out["cuda_extension"] = list(cuda_ops.is_available())
    except Exception as exc:  # noqa: BLE001
        out["cuda_extension"] = [False, f"{type(exc).__name__}: {exc}"]
    major, minor = torch.cuda.get_device_capability(0)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "angle_kernels.triton_ops._compile_check", "--arch",
                           str(major * 10 + minor)], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    out["compile_check_rc"] = proc.returncode
    out["kernel_resources"] = [line for line in proc.stdout.splitlines() if line.startswith("_")]
    if proc.returncode != 0:
        out["compile_check_stderr"] = proc.stderr[-4000:]
    return out


def pytest_triton(out_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["ANGLE_KERNELS_TRITON_TEST_DEVICE"] = "cuda"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/triton",
                           "tests/test_triton_compile.py"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=1800)
    (out_dir / "pytest_triton.log").write_text(proc.stdout + "\n" + proc.stderr)
    last = [line for line in proc.stdout.splitlines() if line.strip()][-1:] or ["(no output)"]
    print(last[0], flush=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pytest failed (rc {proc.returncode}): {last[0]}; see pytest_triton.log")
    return {"pytest": last[0]}


def large_checks() -> dict:
    """Every op at sizes the interpreter cannot reach, against the torch backend (float64 on both sides)."""
    import torch

    import angle_kernels.torch_ops as T
    import angle_kernels.triton_ops as K

    checks = {}
    gen = torch.Generator(device="cuda").manual_seed(0)

    def record(name, errs, tol):
        worst = max(errs.values())
        checks[name] = {"errors": errs, "tolerance": tol, "pass": worst <= tol}
        print(f"  {name:<44} worst rel err {worst:.2e} (tol {tol:.0e}) {'ok' if worst <= tol else 'FAIL'}",
              flush=True)

    # pair scores: fp64 on both sides, zigzag and format C
    for g, k, d in ((262144, 2, 768), (16384, 3, 4096)):
        x = torch.randn(g, k, d, device="cuda", dtype=torch.float64, generator=gen)
        gc_ = torch.randn(g, k - 1, device="cuda", dtype=torch.float64, generator=gen)
        ga_ = torch.randn(g, k - 1, device="cuda", dtype=torch.float64, generator=gen)
        res = []
        for ops in (K, T):
            leaf = x.clone().requires_grad_()
            cos, angle = ops.pair_scores(leaf, True)
            ((cos * gc_).sum() + (angle * ga_).sum()).backward()
            res.append((cos.detach(), angle.detach(), leaf.grad))
        record(f"pair_scores fp64 G={g} K={k} D={d}",
               {"cos": rel_err(res[0][0], res[1][0]), "angle": rel_err(res[0][1], res[1][1]),
                "dx": rel_err(res[0][2], res[1][2])}, 1e-10)
        del x, res
        free_cuda()

    # ranking: the tiled path (small N) and the sort path (large N), fp64 and fp32 scores (vs fp64 torch)
    for n in (3000, 2_000_000):
        for dtype in (torch.float64, torch.float32):
            s = 20 * torch.randn(n, device="cuda", dtype=torch.float64, generator=gen)
            labels = torch.randint(0, 6, (n,), device="cuda", generator=gen)
            a = s.to(dtype).requires_grad_()
            loss = K.ranking_loss(a, labels)
            loss.backward()
            b = s.to(dtype).double().requires_grad_()
            ref = T.ranking_loss(b, labels)
            ref.backward()
            tol = 1e-10 if dtype == torch.float64 else 1e-5
            errs = {"loss": rel_err(loss, ref), "grad": rel_err(a.grad, b.grad)}
            record(f"ranking {str(dtype)[6:]} N={n}", errs, tol)
    free_cuda()

    # similarity: in-batch negatives (groups, weights), rectangular contrastive, ArcCon margin; fp64
    cases = [
        ("ibn M=8192 D=768", 8192, None, 768, dict(target="partner", exclude_diagonal=True), True),
        ("contrastive M=4096 Mc=8192 D=1024", 4096, 8192, 1024, dict(target="diagonal"), False),
        ("arccon M=4096 D=4096", 4096, 4096, 4096, dict(target="diagonal", margin=0.1745), False),
    ]
    for name, m, mc, d, kw, groups in cases:
        q = torch.randn(m, d, device="cuda", dtype=torch.float64, generator=gen)
        c = None if mc is None else torch.randn(mc, d, device="cuda", dtype=torch.float64, generator=gen)
        extra = dict(kw)
        if groups:
            extra["group_ids"] = torch.randint(0, m // 2, (m,), device="cuda", generator=gen)
            extra["row_weights"] = (torch.rand(m, device="cuda", generator=gen) > 0.2).double()
        res = []
        for ops in (K, T):
            ql = q.clone().requires_grad_()
            cl = None if c is None else c.clone().requires_grad_()
            loss = ops.similarity_xent(ql, cl, 20.0, **extra)
            loss.backward()
            res.append((loss.detach(), ql.grad, None if cl is None else cl.grad))
        errs = {"loss": rel_err(res[0][0], res[1][0]), "dq": rel_err(res[0][1], res[1][1])}
        if c is not None:
            errs["dc"] = rel_err(res[0][2], res[1][2])
        record(f"similarity fp64 {name}", errs, 1e-9)
        # bf16 inputs: our error vs float64 must be at most 2x eager PyTorch's own bf16 error
        qb = q.to(torch.bfloat16)
        cb = None if c is None else c.to(torch.bfloat16)
        ql = qb.clone().requires_grad_()
        cl = None if cb is None else cb.clone().requires_grad_()
        ours = K.similarity_xent(ql, cl, 20.0, **extra)
        ours.backward()
        ref_q = qb.double().requires_grad_()
        ref_c = None if cb is None else cb.double().requires_grad_()
        ref = T.similarity_xent(ref_q, ref_c, 20.0, **extra)
        ref.backward()
        eager_q = qb.clone().requires_grad_()
        eager_c = None if cb is None else cb.clone().requires_grad_()
        eager = _eager_similarity_xent(eager_q, eager_c, 20.0, **extra)
        eager.backward()
        bf16 = {"loss": (rel_err(ours, ref), rel_err(eager, ref)), "dq": (rel_err(ql.grad, ref_q.grad),
                                                                          rel_err(eager_q.grad, ref_q.grad))}
        checks[f"similarity bf16 {name}"] = {"ours_vs_eager": bf16,
                                             "pass": all(o <= 2 * e for o, e in bf16.values())}
        print(f"  similarity bf16 {name:<29} ours/eager loss {bf16['loss'][0]:.1e}/{bf16['loss'][1]:.1e}, "
              f"dq {bf16['dq'][0]:.1e}/{bf16['dq'][1]:.1e}", flush=True)
        del q, c, res
        free_cuda()
    if not all(v["pass"] for v in checks.values()):
        failed = [k for k, v in checks.items() if not v["pass"]]
        raise RuntimeError(f"large-size checks failed: {failed}; details: {json.dumps(checks, default=str)[:2000]}")
    return {"checks": checks}


def _eager_similarity_xent(q, c, scale, target, row_weights=None, exclude_diagonal=False, margin=0.0, group_ids=None):
    """The contract in eager PyTorch, in the inputs' dtype (the error baseline for bf16): full matrix."""
    import math

    import torch
    import torch.nn.functional as F

    symmetric = c is None
    c = q if symmetric else c
    qn, cn = F.normalize(q, dim=1), F.normalize(c, dim=1)
    cos = qn @ cn.T
    m = q.shape[0]
    rows = torch.arange(m, device=q.device)
    t = rows ^ 1 if target == "partner" else rows
    logits = scale * cos
    if margin:
        ct = cos[rows, t]
        st = (1 - ct * ct).clamp_min(1e-6).sqrt()
        val = torch.where(ct < -math.cos(margin), -torch.ones_like(ct), ct * math.cos(margin) - st * math.sin(margin))
        logits = logits.index_put((rows, t), scale * val)
    if exclude_diagonal:
        logits = logits.index_put((rows, rows), torch.tensor(float("-inf"), device=q.device, dtype=logits.dtype))
    pos = torch.zeros_like(logits, dtype=torch.bool)
    pos[rows, t] = True
    if group_ids is not None:
        g = group_ids
        pos |= ((g[None, :] == g[:, None]) | (g[None, :] == g[t][:, None])) & torch.isfinite(logits)
    lse_all = torch.logsumexp(logits, 1)
    lse_pos = torch.logsumexp(logits.masked_fill(~pos, float("-inf")), 1)
    w = torch.ones_like(lse_all) if row_weights is None else row_weights.to(lse_all.dtype)
    return (w * (lse_all - lse_pos)).sum() / m


def measure_limits() -> dict:
    import torch
    from triton.testing import do_bench

    src = torch.empty(2**28, dtype=torch.float32, device="cuda").normal_()  # 1 GiB
    dst = torch.empty_like(src)
    limits = {"copy_GBps": 2 * src.numel() * 4 / (do_bench(lambda: dst.copy_(src), return_mode="median") / 1e3) / GB}
    del src, dst
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        a = torch.randn(8192, 8192, device="cuda").to(dtype)
        b = torch.randn(8192, 8192, device="cuda").to(dtype)
        ms = do_bench(lambda: a @ b, return_mode="median")
        limits[f"matmul_{name}_TFLOPs"] = 2 * 8192**3 / (ms / 1e3) / 1e12
        del a, b
    torch.backends.cuda.matmul.allow_tf32 = prev
    free_cuda()
    print("  " + ", ".join(f"{k} {v:.0f}" for k, v in limits.items()), flush=True)
    return limits


def _time_and_memory(fn, leaves):
    """(median ms, peak extra bytes) of fn() + backward, do_bench's median, warm-up excluded."""
    import torch
    from triton.testing import do_bench

    def step():
        for leaf in leaves:
            leaf.grad = None
        fn()

    step()
    torch.cuda.synchronize()
    for leaf in leaves:
        leaf.grad = None
    free_cuda()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    ms = do_bench(step, grad_to_none=leaves, return_mode="median")
    return ms, extra


def op_sweep(args, limits) -> dict:
    import torch

    import angle_kernels.torch_ops as T
    import angle_kernels.triton_ops as K

    rows = []
    backends = (("triton", K), ("torch", T))
    pair_sizes = [1024, 16384, 262144, 1048576] if args.quick else [1024, 4096, 16384, 65536, 262144, 1048576]
    sim_sizes = [1024, 4096, 16384] if args.quick else [1024, 4096, 16384, 65536]
    rank_sizes = [1024, 4096, 65536, 1048576] if args.quick else [1024, 4096, 16384, 65536, 1048576, 4194304]
    dims = [768, 4096]
    dtypes = [("float32", torch.float32), ("bfloat16", torch.bfloat16)]

    def add(op, n, d, dtype_name, backend, fn, leaves, floor_kind, floor_amount):
        row = {"op": op, "n": n, "d": d, "dtype": dtype_name, "backend": backend}
        try:
            ms, extra = _time_and_memory(fn, leaves)
            rate = floor_amount / (ms / 1e3)
            peak = limits["copy_GBps"] * GB if floor_kind == "bytes" else \
                limits.get(f"matmul_{'bfloat16' if dtype_name == 'bfloat16' else 'float32'}_TFLOPs", 0) * 1e12
            row.update(status="ok", ms=ms, extra_bytes=extra, rate=rate, fraction=rate / peak if peak else None,
                       floor_kind=floor_kind)
        except Exception as exc:  # noqa: BLE001
            status = "OOM" if "out of memory" in str(exc).lower() else "error"
            row.update(status=status, note=f"{type(exc).__name__}: {exc}"[:300])
        rows.append(row)
        print("  " + _op_row_text(row), flush=True)
        free_cuda()

    free_bytes = torch.cuda.mem_get_info()[0]
    for dtype_name, dtype in dtypes:
        elem = torch.finfo(dtype).bits // 8
        for d in dims:
            for n in pair_sizes:
                if 6 * n * d * elem > 0.4 * free_bytes:
                    continue
                x = torch.randn(n, 2, d, device="cuda").to(dtype).requires_grad_()
                w = torch.randn(n, 1, device="cuda")
                for name, ops in backends:
                    def fn(ops=ops):
                        cos, angle = ops.pair_scores(x, True)
                        ((cos + angle) * w).sum().backward()
                    add("pair_scores", n, d, dtype_name, name, fn, [x], "bytes", 3 * 2 * n * d * elem)
                del x
            for n in sim_sizes:
                m = 2 * n
                if 3 * m * d * 4 > 0.4 * free_bytes:
                    continue
                x = torch.randn(m, d, device="cuda").to(dtype).requires_grad_()
                weights = (torch.rand(m, device="cuda") > 0.2).float()
                for name, ops in backends:
                    def fn(ops=ops):
                        ops.similarity_xent(x, None, 20.0, "partner", row_weights=weights,
                                            exclude_diagonal=True).backward()
                    add("similarity_xent(ibn)", n, d, dtype_name, name, fn, [x], "flops", 6 * m * m * d)
                del x
    for n in rank_sizes:
        s = (20 * torch.randn(n, device="cuda")).requires_grad_()
        labels = torch.randint(0, 6, (n,), device="cuda")
        for name, ops in backends:
            def fn(ops=ops):
                ops.ranking_loss(s, labels).backward()
            add("ranking_loss", n, 1, "float32", name, fn, [s], "bytes", n * (4 + 8 + 4))
    return {"rows": rows}


def _op_row_text(row) -> str:
    head = f"{row['op']:<22} N={row['n']:<8} D={row['d']:<5} {row['dtype']:<9} {row['backend']:<7}"
    if row["status"] != "ok":
        return head + f" {row['status']}: {row.get('note', '')}"
    frac = f"{100 * row['fraction']:.0f}% of {'copy BW' if row['floor_kind'] == 'bytes' else 'matmul'}" \
        if row.get("fraction") else ""
    return head + f" {row['ms']:9.3f} ms  +{row['extra_bytes'] / 1e6:9.1f} MB  {frac}"


def loss_sweep(args, out_dir: Path) -> dict:
    import bench_losses

    argv = ["--device", "cuda", "--out", str(out_dir / "losses"), "--d", "768,4096", "--dtypes", "float32,bfloat16",
            "--max-run-seconds", str(args.max_run_seconds), "--max-ref-gb", str(args.max_ref_gb)]
    if args.quick:
        argv += ["--n", "1024,16384,262144", "--n-quadratic", "1024,4096", "--d", "768"]
    else:
        argv += ["--n", "1024,4096,16384,65536,262144,1048576", "--n-quadratic", "1024,4096,16384,65536"]
    if args.angle_emb_loss:
        argv += ["--angle-emb-loss", args.angle_emb_loss]
    rc = bench_losses.main(argv)
    if rc != 0:
        raise RuntimeError(f"bench_losses.py returned {rc}")
    return {"folder": str(out_dir / "losses"), "argv": argv}


# --------------------------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------------------------


def summary_markdown(results: dict) -> str:
    env = results.get("environment", {})
    lines = [f"# angle_kernels GPU suite: {env.get('gpu', '?')} (driver {env.get('driver', '?')}), "
             f"torch {env.get('torch', '?')}, triton {env.get('triton', '?')}, {env.get('date_utc', '')}", "",
             f"command: `{env.get('command', '')}`", "", "| stage | status | seconds | note |", "|---|---|---|---|"]
    for name in ("build", "tests", "checks", "limits", "ops", "losses"):
        r = results.get(name)
        if r is None:
            lines.append(f"| {name} | skipped | | |")
            continue
        note = r.get("error", r.get("pytest", ""))
        lines.append(f"| {name} | {r['status']} | {r.get('seconds', '')} | {str(note)[:120]} |")
    ops = results.get("ops", {}).get("rows", [])
    if ops:
        lines += ["", "| op | N | D | dtype | triton ms | torch ms | speed-up | triton extra MB | torch extra MB | "
                  "triton fraction |", "|---|---|---|---|---|---|---|---|---|---|"]
        keyed = {(r["op"], r["n"], r["d"], r["dtype"], r["backend"]): r for r in ops}
        for (op, n, d, dt, backend), r in keyed.items():
            if backend != "triton":
                continue
            t = keyed.get((op, n, d, dt, "torch"), {})

            def ms(row):
                return f"{row['ms']:.3f}" if row.get("status") == "ok" else row.get("status", "-")

            def mb(row):
                return f"{row['extra_bytes'] / 1e6:.1f}" if row.get("status") == "ok" else "-"

            speed = f"{t['ms'] / r['ms']:.2f}x" if r.get("status") == "ok" and t.get("status") == "ok" else "-"
            frac = f"{100 * r['fraction']:.0f}%" if r.get("fraction") else "-"
            lines.append(f"| {op} | {n} | {d} | {dt} | {ms(r)} | {ms(t)} | {speed} | {mb(r)} | {mb(t)} | {frac} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench/gpu_suite.py needs a CUDA GPU (torch.cuda.is_available() is False here). On a CPU machine run "
              "the interpreter tests (pytest tests/triton) and bench/bench_losses.py instead.", file=sys.stderr)
        return 2
    os.environ.pop("TRITON_INTERPRET", None)  # real kernels, not the interpreter
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"environment": environment(argv)}
    print(json.dumps(results["environment"], indent=1), flush=True)

    def save():
        (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")

    if "build" not in args.skip:
        stage("build", results, build)
        save()
    if "tests" not in args.skip:
        stage("tests", results, lambda: pytest_triton(out_dir))
        save()
    if "checks" not in args.skip:
        stage("checks", results, large_checks)
        save()
    if "ops" not in args.skip:
        limits = {}
        stage("limits", results, lambda: limits.update(measure_limits()) or dict(limits))
        stage("ops", results, lambda: op_sweep(args, limits))
        save()
    if "losses" not in args.skip:
        stage("losses", results, lambda: loss_sweep(args, out_dir))
        save()

    summary = summary_markdown(results)
    (out_dir / "summary.md").write_text(summary + "\n")
    save()
    print("\n" + summary)
    failed = [k for k in ("build", "tests", "checks") if results.get(k, {}).get("status") == "error"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

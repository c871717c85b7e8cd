"""The torch backend's similarity_xent before and after it formed the gradients in forward, side by side in one
process: "before" is the module as of commit eb371e8 (logits recomputed in backward when the rows take more than
one block of 4M logits), loaded from git; "after" is the working tree's. Forward + backward, float32, D = 768,
median of 3 interleaved runs; the two must agree. Run from the repository root:

    python bench/results/cpu-2026-11-25-fused-xent/before_after.py
"""

import statistics
import subprocess
import time
import types

import torch

import angle_kernels.torch_ops.similarity_xent as after

BEFORE_COMMIT = "eb371e8"
source = subprocess.run(["git", "show", f"{BEFORE_COMMIT}:angle_kernels/torch_ops/similarity_xent.py"],
                        check=True, capture_output=True, text=True).stdout
before = types.ModuleType("angle_kernels.torch_ops.similarity_xent_before")
before.__package__ = "angle_kernels.torch_ops"
exec(compile(source, "similarity_xent_before.py", "exec"), before.__dict__)

D = 768
CASES = [("in-batch negatives", 2048, None), ("in-batch negatives", 4096, None), ("in-batch negatives", 8192, None),
         ("contrastive with negatives", 2048, 4096), ("contrastive with negatives", 4096, 8192)]


def fwd_bwd(module, q, c, options):
    q = q.detach().requires_grad_()
    c = None if c is None else c.detach().requires_grad_()
    start = time.perf_counter()
    loss = module.similarity_xent(q, c, **options)
    loss.backward()
    return time.perf_counter() - start, loss.item(), q.grad


torch.manual_seed(0)
print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; float32, D = {D}; forward + backward, "
      "median of 3 interleaved runs\n")
print("| case | rows x columns | before | after | before / after | after, GFLOP/s (6 M Mc D) |")
print("|---|---|---|---|---|---|")
for name, m, mc in CASES:
    q, c = torch.randn(m, D), None if mc is None else torch.randn(mc, D)
    options = (dict(scale=20.0, target="partner", exclude_diagonal=True) if c is None
               else dict(scale=20.0, target="diagonal"))
    times = {before: [], after: []}
    for _ in range(3):
        results = {}
        for module in (before, after):
            seconds, loss, grad = fwd_bwd(module, q, c, options)
            times[module].append(seconds)
            results[module] = (loss, grad)
        (loss_b, grad_b), (loss_a, grad_a) = results[before], results[after]
        assert abs(loss_a - loss_b) <= 1e-5 * abs(loss_b) and torch.allclose(grad_a, grad_b, rtol=1e-4, atol=1e-9)
    t_before, t_after = statistics.median(times[before]), statistics.median(times[after])
    columns = mc or m
    print(f"| {name} | {m:,} x {columns:,} | {t_before * 1e3:.0f} ms | {t_after * 1e3:.0f} ms | "
          f"{t_before / t_after:.2f}x | {6 * m * columns * D / t_after / 1e9:.0f} |", flush=True)

"""Half-precision error of similarity_xent's backends against float64, on CPU (the Triton kernels through the
interpreter, whose 16-bit products the dense scheme emulates exactly: operands converted to fp32, fp32 sums).

In-batch negatives, M rows (c = q, partner targets, the diagonal excluded, 20 % of rows weighted 0, identical-text
groups), scale 20. For bf16 and fp16 inputs: rel_err (tests/oracle.py) of the loss and of dq against the float64
oracle, for eager PyTorch (the oracle's formulas computing in the input dtype), the triton backend's dense scheme,
its fused kernels (M <= 4096: the interpreter takes minutes there), and the torch backend.

    python bench/results/cpu-2026-11-25-dense-xent/precision.py M D
"""

import os
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the kernels run on CPU tensors
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))

import torch  # noqa: E402

import oracle  # noqa: E402
from angle_kernels.dispatch import raw_backend  # noqa: E402
from angle_kernels.triton_ops import similarity_xent as fused, similarity_xent_dense as dense  # noqa: E402


def loss_and_grad(fn, x):
    x = x.detach().clone().requires_grad_()
    loss = fn(x)
    loss.backward()
    return loss.detach(), x.grad


def main(m: int, d: int) -> None:
    gen = torch.Generator().manual_seed(0)
    x64 = torch.randn(m, d, generator=gen, dtype=torch.float64)
    weights = (torch.rand(m, generator=gen) > 0.2).double()
    groups = torch.randint(0, m // 2, (m,), generator=gen)
    options = dict(scale=20.0, target="partner", exclude_diagonal=True, group_ids=groups)
    exact = loss_and_grad(lambda x: oracle.similarity_xent(x, None, row_weights=weights, **options), x64)
    ours = {
        "triton dense": lambda x: dense.similarity_xent(x, None, row_weights=weights.float(), **options),
        "triton fused": lambda x: fused.SimilarityXentFunction.apply(x, None, 20.0, "partner", weights.float(), True,
                                                                     0.0, groups, None),
        "torch": lambda x: raw_backend("torch").similarity_xent(x, None, row_weights=weights.float(), **options),
    }
    print(f"M = {m}, D = {d}: rel_err against float64 (loss, dq)")
    for dtype in (torch.bfloat16, torch.float16):
        x = x64.to(dtype)
        with oracle.computing_in(dtype):
            eager = loss_and_grad(lambda x: oracle.similarity_xent(x, None, row_weights=weights, **options), x)
        print(f"  {str(dtype):15s} eager        {oracle.rel_err(eager[0], exact[0]):.2e}  "
              f"{oracle.rel_err(eager[1], exact[1]):.2e}")
        for name, fn in ours.items():
            if name == "triton fused" and m > 4096:
                continue
            started = time.time()
            loss, grad = loss_and_grad(fn, x)
            print(f"  {str(dtype):15s} {name:12s} {oracle.rel_err(loss, exact[0]):.2e}  "
                  f"{oracle.rel_err(grad, exact[1]):.2e}  ({time.time() - started:.1f} s)")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))

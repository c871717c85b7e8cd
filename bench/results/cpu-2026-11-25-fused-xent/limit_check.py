# Which is wrong in cpu-2026-11-25-fused-xent/table.md (achieved above 100% of the matmul limit): the limit or the
# FLOP count? The harness's limit (a square 2048 float32 matmul, fastest of its runs) against square 4096 and the
# shapes the torch path's similarity_xent runs (row block x D against D x 2N), same timing rule (harness.time_run).
import sys, torch
sys.path.insert(0, "bench")
import harness
torch.set_num_threads(2)
def rate(m, k, n):
    a, b = torch.randn(m, k), torch.randn(k, n)
    s = harness.time_run("cpu", lambda: a @ b).min_s
    return 2 * m * k * n / s / 1e9
print("limit as measured (harness.measure_limits):", round(harness.measure_limits("cpu", ["float32"])["matmul_float32_TFLOPs"] * 1e3, 1), "GFLOP/s")
for shape in [(2048, 2048, 2048), (4096, 4096, 4096), (1024, 768, 8192), (512, 768, 8192), (8192, 512, 768), (768, 1024, 8192)]:
    print(shape, round(rate(*shape), 1), "GFLOP/s")

# Output on 2026-11-26 (Intel Xeon, 2 cores, quiet; run from the repository root, before harness.py took the best
# of two sizes):
#   limit as measured (harness.measure_limits): 261.6 GFLOP/s
#   (2048, 2048, 2048) 268.7 GFLOP/s
#   (4096, 4096, 4096) 255.2 GFLOP/s
#   (1024, 768, 8192) 205.8 GFLOP/s
#   (512, 768, 8192) 240.9 GFLOP/s
#   (8192, 512, 768) 233.8 GFLOP/s
#   (768, 1024, 8192) 250.4 GFLOP/s

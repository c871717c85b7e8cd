# Issue 30, item 2: which --pack width on CPU. Forward + backward of all-MiniLM-L6-v2 (dropout off) on 6 random STS-B
# batches through angle_train's own pass plans and plain_step (CoSENT + angle loss): length-sorted padded sub-batches
# of 512 tokens (--pack 0, the CPU default before) against packed rows of W tokens (--pack W), interleaved in every
# repetition; per-batch milliseconds, median (min-max) over the repetitions, and the real-token fraction.
# Run from the repository root:  python bench/results/cpu-2026-11-26-training/packing/pack_width.py PAIRS W1,W2,.. REPS
import random, statistics, sys, time, torch
sys.path.insert(0, "bench")
from sts_quality import minilm_dir
from angle_train.models import load_encoder
from angle_train.data import load_examples, TokenizedPairs
from angle_train.grad_cache import plain_step
from angle_kernels import AngleLoss
B = int(sys.argv[1]); widths = [int(w) for w in sys.argv[2].split(",")]
enc, tok = load_encoder(minilm_dir(), pooling="avg")
for m in enc.modules():
    if isinstance(m, torch.nn.Dropout): m.p = 0.0
enc.train()
examples, fmt = load_examples("../shared/data/stsbenchmark/sts-train.csv")
ds = TokenizedPairs(examples, fmt, tok, max_length=64)
rng = random.Random(0)
batches = [ds.batch(rng.sample(range(len(ds)), B)) for _ in range(6)]
loss_fn = AngleLoss(cosine_w=1, ibn_w=0, angle_w=0.02, dataset_format="A")
def plans(b):
    out = {"sorted512": b.plan(tokens=512)}
    for w in widths: out[f"pack{w}"] = b.plan(pack_width=w)
    return out
times = {k: [] for k in plans(batches[0])}
for rep in range(int(sys.argv[3]) if len(sys.argv) > 3 else 3):
    for k in times:
        t = time.perf_counter(); real = proc = 0
        for b in batches:
            p = plans(b)[k]
            chunks, restore = p.tensors(enc.pad_token_id, enc.padding_side)
            plain_step(enc, chunks, b.labels, loss_fn, restore=restore); enc.zero_grad(set_to_none=True)
            r, q = p.token_counts(); real += r; proc += q
        times[k].append((time.perf_counter() - t) / len(batches) * 1e3)
        frac = real / proc
    print(rep, {k: round(v[-1]) for k, v in times.items()}, flush=True)
for k, v in times.items():
    real = sum(plans(b)[k].token_counts()[0] for b in batches); proc = sum(plans(b)[k].token_counts()[1] for b in batches)
    print(f"{k:10s} {statistics.median(v):7.1f} ms ({min(v):.1f}-{max(v):.1f})  real tokens {real/proc:.0%}")

# Issue 30, item 3: is `torch.compile` of the encoder worth a --compile flag on CPU? all-MiniLM-L6-v2's backbone,
# forward + backward of 6 STS-B plain steps of 16 pairs through angle-train's pass plans (packed rows of 128 tokens,
# the CPU default), eager and compiled (dynamic shapes) interleaved; the first compiled pass (the compile) timed
# apart. Run from the repository root:  python bench/results/cpu-2026-11-26-training/packing/compile_probe.py 16 3
import random, statistics, sys, time, torch
sys.path.insert(0, "bench")
from sts_quality import minilm_dir
from angle_train.models import load_encoder
from angle_train.data import load_examples, TokenizedPairs
from angle_train.grad_cache import plain_step
from angle_kernels import AngleLoss
B = int(sys.argv[1]); reps = int(sys.argv[2])
enc, tok = load_encoder(minilm_dir(), pooling="avg")
for m in enc.modules():
    if isinstance(m, torch.nn.Dropout): m.p = 0.0
enc.train()
examples, fmt = load_examples("../shared/data/stsbenchmark/sts-train.csv")
ds = TokenizedPairs(examples, fmt, tok, max_length=64)
rng = random.Random(0)
batches = [ds.batch(rng.sample(range(len(ds)), B)) for _ in range(6)]
loss_fn = AngleLoss(cosine_w=1, ibn_w=0, angle_w=0.02, dataset_format="A")
eager_backbone = enc.backbone
compiled_backbone = torch.compile(enc.backbone, dynamic=True)
def run(backbone):
    enc.backbone = backbone
    t = time.perf_counter()
    for b in batches:
        p = b.plan(pack_width=128)
        chunks, restore = p.tensors(enc.pad_token_id, enc.padding_side)
        plain_step(enc, chunks, b.labels, loss_fn, restore=restore); enc.zero_grad(set_to_none=True)
    return (time.perf_counter() - t) / len(batches) * 1e3
t = time.perf_counter(); first = run(compiled_backbone); print(f"first compiled pass (compiles): {first * len(batches) / 1e3:.1f} s", flush=True)
times = {"eager": [], "compiled": []}
for rep in range(reps):
    times["eager"].append(run(eager_backbone)); times["compiled"].append(run(compiled_backbone))
    print(rep, {k: round(v[-1]) for k, v in times.items()}, flush=True)
for k, v in times.items(): print(f"{k:9s} {statistics.median(v):7.1f} ms ({min(v):.1f}-{max(v):.1f})")

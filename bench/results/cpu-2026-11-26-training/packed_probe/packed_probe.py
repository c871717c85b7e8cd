# A probe for the next step (issue 30, item 2), not product code: MiniLM forward + backward of STS-B batches as
# one padded pass, length-sorted sub-batches of <= 512 tokens (what angle-train does on CPU), and packed rows of
# <= 512 tokens (no padding; a block-diagonal 4D mask through sdpa, positions restarting per text, mean pooling
# per text); dropout off, so the three embed alike (printed). Run from the repository root:
#     python bench/results/cpu-2026-11-26-training/packed_probe/packed_probe.py 16
import time, random, statistics, sys, torch
sys.path.insert(0, "bench")
from sts_quality import minilm_dir
from transformers import AutoModel
from angle_train.data import load_examples, TokenizedPairs, pad_batch
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(minilm_dir())
model = AutoModel.from_pretrained(minilm_dir(), attn_implementation="sdpa")
model.train()
for m in model.modules():
    if isinstance(m, torch.nn.Dropout): m.p = 0.0
examples, fmt = load_examples("../shared/data/stsbenchmark/sts-train.csv")
ds = TokenizedPairs(examples, fmt, tok, max_length=64)

def padded_embed(seqs):
    ids, mask = pad_batch(seqs, tok.pad_token_id, "right")
    h = model(input_ids=ids, attention_mask=mask).last_hidden_state
    m = mask.unsqueeze(-1).float()
    return (h * m).sum(1) / m.sum(1)

def sorted_embed(seqs, budget=512):
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    outs, i = [], 0
    while i < len(order):
        j = i + 1
        while j < len(order) and (j - i + 1) * len(seqs[order[i]]) <= budget: j += 1
        outs.append(padded_embed([seqs[k] for k in order[i:j]])); i = j
    e = torch.cat(outs)
    restore = torch.empty(len(order), dtype=torch.long)
    restore[torch.tensor(order)] = torch.arange(len(order))
    return e[restore]

def packed_embed(seqs, budget=512):
    packs, cur = [], []
    for k, s in enumerate(seqs):
        if cur and sum(len(seqs[x]) for x in cur) + len(s) > budget: packs.append(cur); cur = []
        cur.append(k)
    packs.append(cur)
    width = max(sum(len(seqs[x]) for x in p) for p in packs)
    n = len(packs)
    ids = torch.full((n, width), tok.pad_token_id); pos = torch.zeros((n, width), dtype=torch.long)
    seg = torch.full((n, width), -1)
    for r, p in enumerate(packs):
        o = 0
        for k in p:
            L = len(seqs[k])
            ids[r, o:o+L], pos[r, o:o+L], seg[r, o:o+L] = torch.tensor(seqs[k]), torch.arange(L), k
            o += L
    same = (seg.unsqueeze(2) == seg.unsqueeze(1)) & (seg.unsqueeze(2) >= 0)
    eye = torch.eye(width, dtype=torch.bool).unsqueeze(0)
    mask4 = (same | eye).unsqueeze(1)  # pad rows attend to themselves (no NaN)
    h = model(input_ids=ids, attention_mask=mask4, position_ids=pos,
              token_type_ids=torch.zeros_like(ids)).last_hidden_state
    onehot = (seg.unsqueeze(-1) == torch.arange(len(seqs))).float()  # [n, width, N]
    summed = torch.einsum("nwd,nwk->kd", h, onehot); counts = onehot.sum((0, 1)).unsqueeze(-1)
    return summed / counts

rng = random.Random(0)
B = int(sys.argv[1])
batches = [ds.batch(rng.sample(range(len(ds)), B)).seqs for _ in range(8)]
with torch.no_grad():
    a = padded_embed(batches[0]); b = packed_embed(batches[0]); c = sorted_embed(batches[0])
print("max |packed - padded|", float((a - b).abs().max()), "sorted", float((a - c).abs().max()))
fns = {"one pass": padded_embed, "sorted 512": sorted_embed, "packed 512": packed_embed}
times = {k: [] for k in fns}
for rep in range(3):
    for k, f in fns.items():
        t = time.perf_counter()
        for s in batches:
            f(s).sum().backward(); model.zero_grad(set_to_none=True)
        times[k].append((time.perf_counter() - t) / len(batches) * 1e3)
for k, v in times.items(): print(f"{k:12s} {statistics.median(v):7.1f} ms ({min(v):.1f}-{max(v):.1f})")

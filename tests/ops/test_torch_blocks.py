"""How the torch backend cuts its work into pieces, per device (angle_kernels/torch_ops/common.py): the CPU keeps
its budget of CHUNK_ELEMENTS elements (pieces near the caches); any other device takes ACCELERATOR_CHUNK_ELEMENTS,
8x more, so that on a GPU a block's matrix products outlast its kernel launches, while the extra memory stays a
few tiles of at most 128 MiB (float32).

The ops run here on the meta device, which stands for a GPU: it is not the CPU (so it takes the accelerator
budget and the GPU's code path, rows always scaled), and it computes nothing, so GPU-sized calls cost only their
dispatches. What is checked, at 2N = 16,384 columns:
* every op that blocks (similarity_xent, similarity_lse and pair_scores, each with and without dims) makes its
  tiles as many rows as the accelerator budget gives, 8x the rows of its CPU tiles;
* the peak of the memory it allocates (every storage an op returns, tracked until freed; temporaries inside a
  single ATen op, such as logsumexp's, are not seen) stays within a few budgets plus a few embedding-sized
  buffers, as the op modules' docstrings state;
* the dims path of similarity_xent makes, per block in forward, the same number of ops whatever k beyond its k
  matrix products (the per-prefix small ops that made it launch-bound on a GPU are done once per block);
* similarity_xent's "mixed" path (16-bit products, the meta device offering them) takes the same blocks and holds
  no more than the default path;
* the softmax form in which the default path computes CPU calls (torch_ops/_similarity_xent_softmax.py), run here
  on the meta device directly, takes the same blocks and holds two tiles (the logits and their softmax; with
  group_ids the positives' softmax and masks besides); so does similarity_lse's softmax form
  (torch_ops/_similarity_lse_softmax.py), within the blocked form's budget; on CPU tensors, a call of one block
  keeps its softmax for backward, which then makes only its two gradient products; a CPU similarity_xent call of
  one block makes its three products and a bounded number of other ops (a small call's fixed cost).
* with a CUDA device, the mixed-dtype products that have no addmm into float32 still add their addend.
The CPU side: its budget and the rows it gives are pinned, and the ops still cut CPU tensors by CHUNK_ELEMENTS.
"""

from __future__ import annotations

import collections
import gc

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import angle_kernels.torch_ops.common as torch_common
from angle_kernels.dispatch import raw_backend
from angle_kernels.testing.helpers import ShapeRecorder, generator, leaf_like, randn

META = torch.device("meta")
COLUMNS, WIDTH = 16_384, 64
MIB = 2**20


def test_the_cpu_budget_is_unchanged():
    """The CPU's pieces are those the CPU results and timings were made with: 1 << 22 elements."""
    assert torch_common.CHUNK_ELEMENTS == 1 << 22
    assert torch_common.chunk_elements("cpu") == torch_common.chunk_elements(torch.device("cpu")) == 1 << 22
    assert torch_common.rows_per_chunk(32_768, torch.device("cpu")) == 128  # in-batch negatives, N = 16,384
    assert torch_common.rows_per_chunk(32_768 * 4, "cpu") == 32  # with dims, k = 3
    assert torch_common.rows_per_chunk(1 << 30, "cpu") == 1  # never zero rows


@pytest.mark.parametrize("device", [torch.device("cuda"), torch.device("cuda", 1), "cuda:0", META],
                         ids=["cuda", "cuda:1", "str", "meta"])
def test_other_devices_take_larger_bounded_pieces(device):
    """Off the CPU, 8x the CPU's rows per block (at 2N = 32,768 columns: 1,024 rows instead of 128; with dims,
    k = 3: 256 instead of 32), and a tile of at most 128 MiB in float32. (A torch.device object for CUDA needs no
    GPU: this is the rule itself.)"""
    budget = torch_common.chunk_elements(device)
    assert budget == 8 * torch_common.CHUNK_ELEMENTS
    assert 4 * budget <= 128 * MIB
    assert torch_common.rows_per_chunk(32_768, device) == 1024
    assert torch_common.rows_per_chunk(32_768 * 4, device) == 256
    assert torch_common.rows_per_chunk(1 << 30, device) == 1


class _PeakMemory(TorchDispatchMode):
    """The peak, in bytes, of the storages the ops inside return (those of `existing` tensors excluded), each
    counted until it is freed."""

    def __init__(self, existing):
        super().__init__()
        self.existing = {StorageWeakRef(t.untyped_storage()).cdata for t in existing}
        self.live, self.peak = {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live = {key: entry for key, entry in self.live.items() if not entry[0].expired()}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ref = StorageWeakRef(storage)
                if ref.cdata not in self.existing and ref.cdata not in self.live:
                    self.live[ref.cdata] = (ref, storage.nbytes())
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def _run(call, leaves):
    """Forward + backward of call(*leaves) on the meta device: (shapes of every tensor made, peak bytes)."""
    recorder, peak = ShapeRecorder(), _PeakMemory(leaves)
    with peak, recorder.mode:
        out = call(*leaves)
        if isinstance(out, tuple):
            out = sum(o.sum() for o in out)
        recorder.phase = "backward"
        out.sum().backward()
    return recorder.shapes, peak.peak


def _meta_leaf(*shape):
    return torch.empty(*shape, device=META, dtype=torch.bfloat16).requires_grad_()


def _similarity_cases(ops=None):
    """name -> (leaves, call, rows M, columns Mc, tiles of Mc logits per block row, tile budgets the peak may
    reach): the first walk's tile holds `parts` x Mc logits per row (similarity_xent with dims: k + 1;
    similarity_lse with dims: k + 2, 2k + 2 with a guide). ops: the torch backend's raw ops by default."""
    ops = raw_backend("torch") if ops is None else ops
    m, mc = COLUMNS // 2, COLUMNS
    groups = torch.zeros(mc, dtype=torch.long, device=META)
    guide_q, guide_c = torch.empty(m, WIDTH, device=META), torch.empty(mc, WIDTH, device=META)  # GIST's guide
    threshold = torch.empty(m, device=META)
    return {
        "xent_in_batch": (lambda: [_meta_leaf(mc, WIDTH)], lambda x: ops.similarity_xent(
            x, None, 20.0, "partner", exclude_diagonal=True), mc, mc, 1, 3),
        "xent_groups": (lambda: [_meta_leaf(mc, WIDTH)], lambda x: ops.similarity_xent(
            x, None, 20.0, "partner", exclude_diagonal=True, group_ids=groups), mc, mc, 1, 5),
        "xent_arccon": (lambda: [_meta_leaf(m, WIDTH), _meta_leaf(mc, WIDTH)], lambda q, c: ops.similarity_xent(
            q, c, 20.0, "diagonal", margin=0.1), m, mc, 1, 3),
        "xent_dims": (lambda: [_meta_leaf(m, WIDTH), _meta_leaf(mc, WIDTH)], lambda q, c: ops.similarity_xent(
            q, c, 20.0, "diagonal", dims=(8, 32, 64)), m, mc, 4, 2),
        "xent_dims_groups": (lambda: [_meta_leaf(mc, WIDTH)], lambda x: ops.similarity_xent(
            x, None, 20.0, "partner", exclude_diagonal=True, margin=0.1, group_ids=groups, dims=(8, 32, 64)),
            mc, mc, 4, 2),
        "lse": (lambda: [_meta_leaf(m, WIDTH), _meta_leaf(mc, WIDTH)], lambda q, c: ops.similarity_lse(
            q, c, 20.0, 0, m, "own", 2.0, "other", None, None, None, False, True), m, mc, 1, 4),
        "lse_guided": (lambda: [_meta_leaf(m, WIDTH), _meta_leaf(mc, WIDTH)], lambda q, c: ops.similarity_lse(
            q, c, 20.0, 0, 0, "none", 0.0, "none", guide_q, guide_c, threshold, True, True), m, mc, 1, 4),
        "lse_dims": (lambda: [_meta_leaf(m, WIDTH), _meta_leaf(mc, WIDTH)], lambda q, c: ops.similarity_lse(
            q, c, 20.0, 0, m, "own", 2.0, "other", None, None, None, False, True, dims=(8, 32, 64)), m, mc, 5, 2),
        "lse_dims_guided": (lambda: [_meta_leaf(m, WIDTH), _meta_leaf(mc, WIDTH)], lambda q, c: ops.similarity_lse(
            q, c, 20.0, 0, 0, "none", 0.0, "none", guide_q, guide_c, threshold.expand(3, m), True, True,
            dims=(8, 32, 64)), m, mc, 8, 2),
    }


SIMILARITY_CASES = sorted(_similarity_cases())


@pytest.mark.parametrize("name", SIMILARITY_CASES)
def test_similarity_ops_take_the_accelerator_blocks(name):
    """The block tiles ([b, Mc], or [k, b, Mc] with dims) have the rows rows_per_chunk gives the device, 8x the
    CPU's, and the peak stays within the op's tile budgets (each of ACCELERATOR_CHUNK_ELEMENTS float32 logits)
    plus 8 embedding-sized float32 buffers."""
    make, call, m, mc, parts, budgets = _similarity_cases()[name]
    leaves = make()
    shapes, peak = _run(call, leaves)
    rows = {shape[-2] for _, shape in shapes if len(shape) >= 2 and shape[-1] == mc and shape[-2] < m}
    expected = torch_common.rows_per_chunk(mc * parts, META)
    assert 8 * torch_common.rows_per_chunk(mc * parts, "cpu") <= expected < m
    assert max(rows) == expected, f"{name}: tiles of {sorted(rows)} rows, expected {expected}"
    embeddings = 8 * (m + mc) * WIDTH * 4
    bound = budgets * 4 * torch_common.ACCELERATOR_CHUNK_ELEMENTS + embeddings
    assert peak <= bound, f"{name}: peak {peak / MIB:.0f} MiB, bound {bound / MIB:.0f} MiB"


@pytest.mark.parametrize("dims", [None, (64, 256, 768)], ids=["full", "dims"])
def test_pair_scores_takes_the_accelerator_chunks(dims):
    """pair_scores cuts its groups into chunks of rows_per_chunk(K * D) groups on the device (8x the CPU's), and
    its peak stays within 3 chunks of float32 plus 4 input-sized float32 buffers."""
    groups, k, d = 65_536, 2, 768
    x = _meta_leaf(groups, k, d)
    shapes, peak = _run(lambda x: raw_backend("torch").pair_scores(x, True, dims), [x])
    chunk = {shape[0] for _, shape in shapes if len(shape) == 3 and shape[1:] == (k, d) and shape[0] < groups}
    expected = torch_common.rows_per_chunk(k * d, META)
    assert 8 * torch_common.rows_per_chunk(k * d, "cpu") <= expected < groups
    assert max(chunk) == expected, f"chunks of {sorted(chunk)} groups, expected {expected}"
    bound = 3 * 4 * torch_common.ACCELERATOR_CHUNK_ELEMENTS + 4 * x.numel() * 4
    assert peak <= bound, f"peak {peak / MIB:.0f} MiB, bound {bound / MIB:.0f} MiB"


@pytest.mark.parametrize("symmetric", [True, False], ids=["c=None", "c"])
def test_the_cpu_still_cuts_by_its_own_budget(monkeypatch, symmetric):
    """On CPU tensors the ops read CHUNK_ELEMENTS (shrunk here to 8 rows of 40 logits), not the accelerator's."""
    monkeypatch.setattr(torch_common, "CHUNK_ELEMENTS", 8 * 40)
    monkeypatch.setattr(torch_common, "ACCELERATOR_CHUNK_ELEMENTS", 1 << 40)
    gen = generator("cpu_blocks", symmetric)
    rows = 40 if symmetric else 24
    leaves = [leaf_like(randn(gen, rows, 48, dtype=torch.float64))]
    if not symmetric:
        leaves.append(leaf_like(randn(gen, 40, 48, dtype=torch.float64)))
    kwargs = {"target": "partner" if symmetric else "diagonal", "exclude_diagonal": symmetric}
    recorder = ShapeRecorder()
    with recorder.mode:
        loss = raw_backend("torch").similarity_xent(leaves[0], leaves[1] if len(leaves) > 1 else None, 20.0,
                                                    **kwargs)
        loss.backward()
    assert max(shape[0] for _, shape in recorder.shapes if len(shape) == 2 and shape[1] == 40 and shape[0] < rows) == 8


def _check_a_softmax_form(ops, name: str, budgets: float, gradients: bool) -> None:
    """Case `name` of _similarity_cases on `ops` (a softmax form), with backward or under no_grad: its tiles have the
    rows of the blocked form's, and its peak stays within `budgets` tiles of float32 logits plus 8 embedding-sized
    float32 buffers (the rows' float32 copies, unit rows and gradients)."""
    make, call, m, mc, _, _ = _similarity_cases(ops)[name]
    if gradients:
        shapes, peak = _run(call, make())
    else:
        leaves = [leaf.detach() for leaf in make()]
        recorder, peak_memory = ShapeRecorder(), _PeakMemory(leaves)
        with torch.no_grad(), peak_memory, recorder.mode:
            call(*leaves)
        shapes, peak = recorder.shapes, peak_memory.peak
    rows = {shape[-2] for _, shape in shapes if len(shape) >= 2 and shape[-1] == mc and shape[-2] < m}
    assert max(rows) == torch_common.rows_per_chunk(mc, META), f"{name}: tiles of {sorted(rows)} rows"
    bound = budgets * 4 * torch_common.ACCELERATOR_CHUNK_ELEMENTS + 8 * (m + mc) * WIDTH * 4
    assert peak <= bound, f"{name}: peak {peak / MIB:.0f} MiB, bound {bound / MIB:.0f} MiB"


@pytest.mark.parametrize("gradients", [True, False], ids=["forward+backward", "no_grad"])
@pytest.mark.parametrize("name, budgets", [("xent_in_batch", 2), ("xent_groups", 3.75), ("xent_arccon", 2)])
def test_the_softmax_form_holds_two_tiles(name, budgets, gradients):
    """The softmax form of the default path (what CPU calls compute by) on the blocked form's calls: its blocks are
    the blocked form's, and its peak stays within two tiles of float32 logits (the logits and their softmax), with
    group_ids three and the boolean positives masks (a quarter tile each); under no_grad too (a block's softmax
    freed before the next block's tiles)."""
    from angle_kernels.torch_ops import _similarity_xent_softmax

    softmax_ops = type("SoftmaxOps", (), {"similarity_xent": staticmethod(_similarity_xent_softmax.similarity_xent)})
    _check_a_softmax_form(softmax_ops, name, budgets, gradients)


@pytest.mark.parametrize("gradients", [True, False], ids=["forward+backward", "no_grad"])
@pytest.mark.parametrize("name", ["lse", "lse_guided"])
def test_the_lse_softmax_form_holds_the_blocked_forms_tiles(name, gradients):
    """similarity_lse's softmax form (what CPU calls of cosines at full width compute by) on the blocked form's
    calls: its blocks are the blocked form's, and its peak stays within the blocked form's tile budget (the
    cosines, the logits and the penalty's or the filter's tile, then the logits and their softmax, with the boolean
    masks)."""
    from angle_kernels.torch_ops import _similarity_lse_softmax

    def softmax_lse(*args):  # the blocked form's arguments, whose last, normalize, is True here
        assert args[-1] is True
        return _similarity_lse_softmax.similarity_lse(*args[:-1])

    softmax_ops = type("SoftmaxOps", (), {"similarity_lse": staticmethod(softmax_lse)})
    _check_a_softmax_form(softmax_ops, name, _similarity_cases()[name][-1], gradients)


# ATen ops that launch nothing (views, allocations), and the matrix products.
_VIEWS = frozenset({"t", "transpose", "slice", "select", "unsqueeze", "expand", "alias", "view", "_unsafe_view",
                    "diagonal", "detach", "as_strided", "permute", "squeeze", "empty", "empty_like", "empty_strided"})
_PRODUCTS = frozenset({"mm", "addmm", "addmm_", "bmm", "baddbmm_"})


class _OpCounter(TorchDispatchMode):
    """ATen ops dispatched (views excluded: they launch nothing), and the matrix products among them."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in _VIEWS:
            self.ops["products" if name in _PRODUCTS else "other"] += 1
        return func(*args, **(kwargs or {}))


def _forward_ops_per_block(monkeypatch, dims, rows: int = 64, columns: int = 96) -> dict:
    """The ops per block of one forward of the dims path (no gradient wanted), from calls with 2 and 8 blocks:
    {"products": matrix products, "other": every other op that is not a view}."""
    gen = generator("dims_ops", dims)
    q, c = randn(gen, rows, 32).to(META), randn(gen, columns, 32).to(META)
    counts = {}
    for blocks in (2, 8):
        monkeypatch.setattr(torch_common, "ACCELERATOR_CHUNK_ELEMENTS", (rows // blocks) * columns * (len(dims) + 1))
        counter = _OpCounter()
        with counter:
            raw_backend("torch").similarity_xent(q, c, 20.0, "diagonal", margin=0.1, dims=dims)
        counts[blocks] = counter.ops
    return {kind: (counts[8][kind] - counts[2][kind]) / 6 for kind in ("products", "other")}


def test_dims_forward_ops_per_block_do_not_grow_with_k(monkeypatch):
    """Per block, the dims forward makes its k matrix products and a fixed number of other ops, the same for
    k = 2 and k = 5: its logits, target columns (here with a margin) and logsumexps are computed for all prefixes
    at once (before, about 11 ops per prefix, 30 with a margin)."""
    two = _forward_ops_per_block(monkeypatch, (8, 32))
    five = _forward_ops_per_block(monkeypatch, (4, 8, 16, 24, 32))
    assert (two["products"], five["products"]) == (2, 5)
    assert two["other"] == five["other"], (two, five)


def test_the_lse_softmax_form_keeps_a_one_block_calls_softmax(monkeypatch):
    """similarity_lse's softmax form with a guide (GIST's blocks), on CPU tensors: a call whose rows make one block
    keeps its softmax, so backward makes only the two gradient products (eager code's count); over B blocks backward
    makes each block's score and guide tiles again, 4 products per block. Forward makes 2 per block either way (the
    rest, in both passes, are the row norms' and the normalisation backward's, the same for any B)."""
    from angle_kernels.torch_ops import _similarity_lse_softmax

    gen = generator("lse_softmax_kept")
    q, c = leaf_like(randn(gen, 24, 16)), leaf_like(randn(gen, 40, 16))
    guide_q, guide_c, threshold = randn(gen, 24, 8), randn(gen, 40, 8), torch.full((24,), 0.3)
    counts = {}
    for blocks, budget in ((1, torch_common.CHUNK_ELEMENTS), (3, 8 * 40)):
        monkeypatch.setattr(torch_common, "CHUNK_ELEMENTS", budget)
        forward, backward = _OpCounter(), _OpCounter()
        with forward:
            lse = _similarity_lse_softmax.similarity_lse(q, c, 20.0, 0, 0, "none", 0.0, "none", guide_q, guide_c,
                                                         threshold, True)
        with backward:
            lse.sum().backward()
        counts[blocks] = forward.ops["products"], backward.ops["products"]
    (forward_one, backward_one), (forward_three, backward_three) = counts[1], counts[3]
    assert forward_three - forward_one == 2 * (3 - 1), counts
    assert backward_three - backward_one == 4 * 3 - 2, counts


def test_the_kept_softmax_tiles_of_all_calls_fit_their_budget_and_are_given_back(monkeypatch):
    """Every call of one block kept its softmax until its backward, whatever the number of calls awaiting theirs (a
    layer stack times GTE's directions: 32 tiles of 16 MiB at 2,048 rows). The tiles kept at once fit KEPT_TILES
    tile budgets in all; the calls past it make their tiles again in backward, with the same values and gradients;
    backward gives each kept tile's share back, and so does a graph dropped without a backward."""
    from angle_kernels.torch_ops import _similarity_lse_softmax

    kept = _similarity_lse_softmax._KEPT
    gen = generator("lse_softmax_budget")
    q, c = randn(gen, 24, 16).double(), randn(gen, 40, 16).double()
    guide_q, guide_c, threshold = randn(gen, 24, 8).double(), randn(gen, 40, 8).double(), torch.full((24,), 0.3)
    monkeypatch.setattr(torch_common, "CHUNK_ELEMENTS", 24 * 40)  # each call one block, the budget one tile
    results, held = {}, {}
    for tiles in (0, 2, 10):
        monkeypatch.setattr(_similarity_lse_softmax, "KEPT_TILES", tiles)
        qs = [leaf_like(q * (1 + k / 10)) for k in range(6)]  # six calls awaiting their backward together
        values = [_similarity_lse_softmax.similarity_lse(x, c, 20.0, 0, 0, "none", 0.0, "none", guide_q, guide_c,
                                                         threshold, True) for x in qs]
        held[tiles] = kept.elements
        torch.stack(values).sum().backward()
        assert kept.elements == 0, "backward gave every kept tile back"
        results[tiles] = [(v.detach(), x.grad) for v, x in zip(values, qs)]
    assert held == {0: 0, 2: 2 * 24 * 40, 10: 6 * 24 * 40}
    for tiles in (2, 10):
        for (value, grad), (want_value, want_grad) in zip(results[tiles], results[0]):
            torch.testing.assert_close(value, want_value, rtol=1e-13, atol=1e-13)
            torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-13)
    monkeypatch.setattr(_similarity_lse_softmax, "KEPT_TILES", 2)
    dropped = _similarity_lse_softmax.similarity_lse(leaf_like(q), c, 20.0, 0, 0, "none", 0.0, "none", guide_q,
                                                     guide_c, threshold, True)
    assert kept.elements == 24 * 40
    del dropped
    gc.collect()
    assert kept.elements == 0, "a graph dropped without a backward gave its kept tile back"


@pytest.mark.parametrize("with_reference", [False, True], ids=["dot", "dot_reference"])
def test_the_dot_products_kept_tile_is_given_back(with_reference):
    """Raw dot products (normalize=False: MNRL's similarity="dot", with its reference rows) keep their one block's
    softmax as cosines do, and their backward gives the tile's share of the budget back (it kept it: every later
    call of the process made its tiles again in backward)."""
    from angle_kernels.dispatch import similarity_lse
    from angle_kernels.torch_ops import _similarity_lse_softmax

    kept = _similarity_lse_softmax._KEPT
    gen = generator("dot kept tile", str(with_reference))
    q, c, r = (leaf_like(randn(gen, rows, 16).double()) for rows in (24, 40, 24))
    before = kept.elements
    value = similarity_lse(q, c, 0.5, normalize=False, reference=r if with_reference else None, backend="torch")
    assert kept.elements == before + 24 * 40
    value.sum().backward()
    assert kept.elements == before


def _meta_addmm_into_fp32_runs() -> bool:
    """Whether torch.addmm(c, a, b, out_dtype=float32, out=c) on meta tensors runs under a dispatch mode, as the
    peak-memory test runs it."""
    out = torch.zeros(2, 2, device=META)
    a = torch.zeros(2, 2, device=META, dtype=torch.bfloat16)
    try:
        with _PeakMemory([out, a]):
            torch.addmm(out, a, a, out_dtype=torch.float32, out=out)
    except (TypeError, RuntimeError):
        return False
    return True


@pytest.mark.parametrize("name, addmm", [("xent_in_batch", True), ("xent_in_batch", False), ("xent_groups", True),
                                         ("xent_arccon", False), ("xent_dims", True), ("xent_dims", False)],
                         ids=lambda value: {True: "addmm-into-fp32", False: "mm-then-add"}.get(value, value))
def test_the_mixed_path_holds_no_more_than_the_default_path(monkeypatch, name, addmm):
    """similarity_xent's "mixed" path (16-bit products: torch_ops/similarity_xent.py) on the same bfloat16 calls,
    the meta device offering mixed-dtype products (with fp32 accumulation into an addmm's output, or without it:
    then products of a piece of rows added in): the same blocks, and a peak at most the default path's but for a
    few numbers per row (with dims, the ratios of consecutive prefixes' inverse norms). Its 16-bit operands (the
    scaled rows and unit rows, 2 + 2 bytes an element) take the place of the float32 copy (4), its 16-bit gradient
    tile that of a float32 product operand."""
    if addmm and not _meta_addmm_into_fp32_runs():
        pytest.skip("this torch's meta addmm with out_dtype fails under a dispatch mode (torch 2.11: its "
                    "decomposition takes out_dtype for beta); the meta device cannot model the call")
    make, call, m, mc, _, _ = _similarity_cases()[name]
    default_shapes, default_peak = _run(call, make())
    import angle_kernels.products as shared_products

    monkeypatch.setitem(shared_products._mixed_products, META, shared_products.MixedProducts(True, addmm))
    products = []
    real = shared_products._mixed_product_into
    monkeypatch.setattr(shared_products, "_mixed_product_into", lambda *args: products.append(1) or real(*args))
    mixed_shapes, mixed_peak = _run(call, make())
    assert products, "the call did not take the mixed path"
    per_row = 4 * 4 * (m + mc)  # four float32 numbers per row of q and of c
    assert mixed_peak <= default_peak + per_row, f"{name}: mixed {mixed_peak} B, default {default_peak} B"

    def tile_rows(shapes):
        return max(shape[-2] for _, shape in shapes if len(shape) >= 2 and shape[-1] == mc and shape[-2] < m)

    assert tile_rows(mixed_shapes) == tile_rows(default_shapes)


@pytest.mark.parametrize("into_out", [False, True], ids=["add-another-tensor", "add-out-itself"])
def test_mixed_products_without_addmm_into_fp32_still_add_the_addend(monkeypatch, into_out):
    """On a GPU whose torch has mixed-dtype matrix products but no addmm into a float32 output, a sum of bf16
    products into a float32 result is the product plus the addend: out = add + a @ b, with `add` another tensor
    (the product written into out, then added) or out itself (products of pieces of rows added in). CUDA only: the
    CPU has no mixed-dtype mm."""
    if not torch.cuda.is_available():
        pytest.skip("mixed-dtype matrix products need a CUDA device")
    import angle_kernels.products as shared_products

    device = torch.device("cuda", 0)
    if not shared_products.mixed_products(device).mm:
        pytest.skip(f"torch {torch.__version__} has no mixed-dtype mm on {device}")
    monkeypatch.setitem(shared_products._mixed_products, device, shared_products.MixedProducts(True, False))
    gen = generator("mixed products with an addend", into_out)
    a = randn(gen, 8, 5).to(device, torch.bfloat16)
    b = randn(gen, 5, 6).to(device, torch.bfloat16)
    out = randn(gen, 8, 6).to(device)
    add = out if into_out else randn(gen, 8, 6).to(device)
    expected = add + a.float() @ b.float()
    shared_products.product_into(out, a, b, add=add)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize(("case", "most"), [("mnrl", 38), ("in_batch", 42), ("row_weights", 43)])
def test_a_one_block_softmax_xent_call_makes_few_small_ops(case, most):
    """A CPU similarity_xent call whose rows fit one block (every small call), forward and backward, makes its three
    matrix products and at most `most` other ops (views excluded): at 256 pairs of D = 64 each such op costs ~2 us
    against ~80 us per product, so they are the call's fixed cost beside the eager formula's (the code before made
    54, 47 and 59: zeroed gradient buffers and slices of them, each tensor's norms apart, a split). A new op here is a
    cost every small call pays: count it in bench/bench_per_call.py before raising the bound."""
    gen = generator("one_block_ops", case)
    q = leaf_like(randn(gen, 24, 16))
    c = None if case == "in_batch" else leaf_like(randn(gen, 24, 16))
    options = {"in_batch": dict(target="partner", exclude_diagonal=True), "mnrl": dict(target="diagonal"),
               "row_weights": dict(target="diagonal", row_weights=torch.rand(24, generator=gen))}[case]
    counter = _OpCounter()
    with counter:
        raw_backend("torch").similarity_xent(q, c, 20.0, **options).backward()
    assert counter.ops["products"] == 3 and counter.ops["other"] <= most, dict(counter.ops)

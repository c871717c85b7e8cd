"""The CUDA backend's torch.library ops on any machine, CPU-only CI included (the kernels themselves run in the
"cuda" cases of test_<op>.py, on a GPU).

Checked here: without a GPU the backend says why it cannot run; every op's schema matches the C++ function that
csrc/ binds to it (argument names and kinds, number of results), which a schema edited on one side only would
break on the GPU alone; the fake implementations give the shapes and dtypes torch.compile relies on; a make_fx
trace of forward + backward goes through the registered autograd formulas to the backward ops.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from angle_kernels import dispatch

CUDA = dispatch.raw_backend("cuda")  # imports the op modules, which define the torch.ops.angle_kernels.cuda_* ops

CSRC = Path(__file__).resolve().parents[2] / "csrc"
NAMESPACE = "angle_kernels"


def _op(name):
    return getattr(torch.ops.angle_kernels, name).default


def _registered_op_names() -> set[str]:
    """The ops defined in the angle_kernels namespace (by importing the cuda_ops op modules)."""
    return {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith(NAMESPACE + "::")}


def test_unavailable_without_a_gpu_says_why():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: availability depends on the build (the op tests' cuda cases say)")
    available, why = CUDA.is_available()
    assert available is False
    assert "CUDA" in why or "GPU" in why, why


def _schema_kind(schema_type) -> str:
    return {"Tensor": "Tensor", "Optional[Tensor]": "Tensor?", "float": "float", "bool": "bool", "str": "str",
            "int": "int", "List[int]": "int[]"}[str(schema_type)]


def _cpp_kind(parameter: str) -> str:
    if "Tensor" in parameter:
        return "Tensor?" if "optional" in parameter else "Tensor"
    for cpp, kind in (("IntArrayRef", "int[]"), ("double", "float"), ("bool", "bool"), ("string", "str"),
                      ("int64_t", "int")):
        if cpp in parameter:
            return kind
    raise AssertionError(f"unexpected C++ parameter type in {parameter!r}")


def _bound_cpp_signatures() -> dict[str, tuple[int, list[tuple[str, str]]]]:
    """op name -> (number of results, [(parameter name, kind)]) of the C++ function csrc/ binds to it."""
    sources = "\n".join(path.read_text() for path in sorted(CSRC.glob("*.c*")))
    signatures = {}
    for op_name, function in re.findall(r'm\.impl\("(\w+)",\s*&(\w+)\)', sources):
        definition = re.search(rf"^([\w:<>, ]+?)\s+{function}\(([^)]*)\)\s*{{", sources, flags=re.M)
        assert definition, f"csrc/ binds {op_name} to {function}, whose definition was not found"
        result_type, parameters = definition.groups()
        results = result_type.count("Tensor")
        params = [" ".join(p.split()) for p in parameters.split(",")]
        signatures[op_name] = (results, [(p.split()[-1].lstrip("&*"), _cpp_kind(p)) for p in params])
    return signatures


def test_schemas_match_the_bound_cpp_functions():
    bound = _bound_cpp_signatures()
    registered = _registered_op_names()
    assert registered, "importing angle_kernels.cuda_ops defined no op"
    assert set(bound) == registered, (
        f"defined but not bound in csrc/: {sorted(registered - set(bound))}; "
        f"bound but not defined: {sorted(set(bound) - registered)}")
    for name in sorted(registered):
        schema = _op(name)._schema
        arguments = [(a.name, _schema_kind(a.type)) for a in schema.arguments]
        results, parameters = bound[name]
        assert arguments == parameters, f"{name}: schema {arguments} but C++ {parameters}"
        assert len(schema.returns) == results, f"{name}: {len(schema.returns)} results in the schema, C++ {results}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_fake_shapes_pair_scores(dtype):
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    with FakeTensorMode():
        x = torch.empty(5, 3, 10, dtype=dtype)
        cos, angle, stats = _op("cuda_pair_scores_fwd")(x, True)
        assert cos.shape == angle.shape == (5, 2) and stats.shape == (5, 2, 6)  # norms, cos, w, scales
        assert cos.dtype == angle.dtype == stats.dtype == acc
        dx = _op("cuda_pair_scores_bwd")(cos, angle, x, stats, True)
        assert dx.shape == x.shape and dx.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dims", [[4], [2, 6, 10], [2, 4, 6, 8, 10]], ids=str)
def test_fake_shapes_pair_scores_dims(dtype, dims):
    """The prefix ops: a leading axis of k on every output, dx as x."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    k = len(dims)
    with FakeTensorMode():
        x = torch.empty(5, 3, 10, dtype=dtype)
        cos, angle, stats = _op("cuda_pair_scores_dims_fwd")(x, True, dims)
        assert cos.shape == angle.shape == (k, 5, 2) and stats.shape == (k, 5, 2, 6)
        assert cos.dtype == angle.dtype == stats.dtype == acc
        dx = _op("cuda_pair_scores_dims_bwd")(cos, angle, x, stats, True, dims)
        assert dx.shape == x.shape and dx.dtype == dtype


def test_pair_scores_code_paths():
    assert CUDA.paths["pair_scores"] == ("full", "dims") and CUDA.features["pair_scores"] == frozenset({"dims"})
    x = torch.empty(2, 2, 8)
    assert CUDA.code_paths["pair_scores"](x, True) == "full"
    assert CUDA.code_paths["pair_scores"](x, True, (4, 8)) == "dims"


def test_make_fx_traces_the_prefix_ops():
    """pair_scores with dims traced with fake tensors, forward and backward through the dims ops; more prefixes
    than one call takes are split into calls of MAX_PREFIXES."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from angle_kernels.cuda_ops import pair_scores as cuda_pair_scores

    dims = tuple(range(2, 2 * cuda_pair_scores.MAX_PREFIXES + 4, 2))  # MAX_PREFIXES + 1 widths

    def grads(x):
        x = x.requires_grad_()
        cos, angle = CUDA.pair_scores(x, True, dims)
        assert cos.shape == angle.shape == (len(dims), 4, 1)
        return torch.autograd.grad(cos.sum() + angle.sum(), (x,))

    graph = make_fx(grads, tracing_mode="fake")(torch.randn(4, 2, dims[-1]))
    text = str(graph.graph)
    assert text.count(f"{NAMESPACE}.cuda_pair_scores_dims_fwd") == 2
    assert text.count(f"{NAMESPACE}.cuda_pair_scores_dims_bwd") == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_fake_shapes_ranking(dtype):
    with FakeTensorMode():
        scores = torch.empty(7, dtype=dtype)
        labels = torch.empty(7, dtype=torch.int64)
        loss, order, first, past = _op("cuda_ranking_fwd")(scores, labels)
        assert loss.shape == () and loss.dtype == dtype
        assert order.shape == first.shape == past.shape == (7,) and order.dtype == torch.int64
        grad = _op("cuda_ranking_bwd")(loss, scores, order, first, past)
        assert grad.shape == (7,) and grad.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_c", [False, True])
def test_fake_shapes_similarity_xent(dtype, with_c):
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    with FakeTensorMode():
        q = torch.empty(6, 12, dtype=dtype)
        c = torch.empty(9, 12, dtype=dtype) if with_c else None
        loss, lse_all, lse_pos, q_norm, c_norm = _op("cuda_similarity_xent_fwd")(
            q, c, 20.0, "diagonal" if with_c else "partner", None, not with_c, 0.0, None
        )
        assert loss.shape == () and loss.dtype == acc
        assert lse_all.shape == lse_pos.shape == (6,)
        assert q_norm.shape == (12,)  # the scaled rows' norms, then the rows' scales
        assert c_norm.shape == ((18,) if with_c else (0,))
        dq, dc = _op("cuda_similarity_xent_bwd")(
            loss, q, c, lse_all, lse_pos, q_norm, c_norm, 20.0, "partner", None, False, 0.0, None
        )
        assert dq.shape == q.shape and dq.dtype == dtype
        assert dc.shape == ((9, 12) if with_c else (0,))


def test_make_fx_traces_forward_and_backward():
    """Forward + autograd backward traced with fake tensors: the registered formulas call the _bwd ops."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def loss_and_grads(x, q):
        x = x.requires_grad_()
        q = q.requires_grad_()
        cos, angle = CUDA.pair_scores(x, True)
        scores = (cos * 20.0).reshape(-1)
        labels = torch.arange(scores.shape[0], device=x.device) % 2
        loss = CUDA.ranking_loss(scores, labels) + angle.sum()
        loss = loss + CUDA.similarity_xent(q, None, 20.0, "partner", None, True, 0.0, None)
        return torch.autograd.grad(loss, (x, q))

    graph = make_fx(loss_and_grads, tracing_mode="fake")(torch.randn(4, 2, 6), torch.randn(6, 6))
    text = str(graph.graph)
    for op in ("pair_scores", "ranking", "similarity_xent"):
        for step in ("fwd", "bwd"):
            assert f"{NAMESPACE}.cuda_{op}_{step}" in text, f"cuda_{op}_{step} missing from the traced graph"


@pytest.mark.parametrize("filter_kind", ["none", "own", "separate"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_fake_shapes_similarity_lse(dtype, filter_kind):
    """The tile ops of one row block: per-row statistics [b]; the gradient tile [b, Mc] in the operand dtype and the
    radial sums [b], [Mc]."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    rows, b, mc = 11, 5, 9
    with FakeTensorMode():
        dots = torch.empty(b, mc, dtype=acc)
        row_inv, col_inv = torch.empty(rows, dtype=acc), torch.empty(mc, dtype=acc)
        filter_dots = torch.empty(b, mc, dtype=torch.float64) if filter_kind == "separate" else None
        filter_row_inv = torch.empty(rows, dtype=torch.float64) if filter_kind == "separate" else None
        filter_col_inv = torch.empty(mc, dtype=torch.float64) if filter_kind == "separate" else None
        threshold = None if filter_kind == "none" else torch.empty(
            rows, dtype=torch.float64 if filter_kind == "separate" else acc)
        tiles = (dots, row_inv, col_inv, row_inv, filter_dots, filter_row_inv, filter_col_inv, threshold)
        options = (0, 3, 20.0, 1.0, "own", "other", True)
        lse, top, log_sum = _op("cuda_similarity_lse_stats")(*tiles, 4, *options)
        assert lse.shape == top.shape == log_sum.shape == (b,) and lse.dtype == top.dtype == log_sum.dtype == acc
        per_row = torch.empty(rows, dtype=acc)
        operand = str(dtype).replace("torch.", "")
        grad, following, row_radial, col_radial = _op("cuda_similarity_lse_grad")(
            *tiles, per_row, per_row, per_row, None, None, None, 4, *options, True, False, operand)
        assert grad.shape == (b, mc) and grad.dtype == dtype and following.shape == (0, mc)
        assert row_radial.shape == (b,) and col_radial.shape == (mc,) and row_radial.dtype == col_radial.dtype == acc
        # with dims: the running sum over the prefixes in and out (the tile's type); the rounded copy only where
        # the operand dtype is not the tile's
        running = torch.empty(b, mc, dtype=acc)
        grad, following, _, _ = _op("cuda_similarity_lse_grad")(
            *tiles, per_row, per_row, per_row, running, per_row, col_inv, 4, *options, True, True, operand)
        assert following.shape == (b, mc) and following.dtype == acc
        assert grad.shape == ((0, mc) if dtype == acc else (b, mc)) and grad.dtype == dtype


def test_similarity_lse_code_paths():
    assert CUDA.paths["similarity_lse"] == ("dense", "dense_dims")
    assert CUDA.features["similarity_lse"] == frozenset({"dims"})
    q, c = torch.empty(3, 8), torch.empty(5, 8)
    assert CUDA.code_paths["similarity_lse"](q, c, 20.0) == "dense"
    assert CUDA.code_paths["similarity_lse"](q, c, 20.0, dims=(4, 8)) == "dense_dims"


@pytest.mark.parametrize("dims", [None, (2, 4, 8)], ids=str)
@pytest.mark.parametrize("normalize", [True, False])
def test_make_fx_traces_similarity_lse(normalize, dims):
    """similarity_lse traced with fake tensors: forward calls the statistics op once per row block and prefix,
    backward the gradient op as often (a filter on other embeddings, so both tiles are formed)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    k = 1 if dims is None else len(dims)

    def grads(q, c, fq, fc, threshold):
        q, c = q.requires_grad_(), c.requires_grad_()
        lse = CUDA.similarity_lse(q, c, 20.0, 0, 0, "none", 1.0, "other", fq, fc, threshold, True, normalize, dims)
        assert lse.shape == ((6,) if dims is None else (k, 6))
        return torch.autograd.grad(lse.sum(), (q, c))

    threshold = torch.randn(6) if dims is None else torch.randn(k, 6)
    graph = make_fx(grads, tracing_mode="fake")(torch.randn(6, 8, dtype=torch.bfloat16),
                                                torch.randn(10, 8, dtype=torch.bfloat16), torch.randn(6, 8),
                                                torch.randn(10, 8), threshold)
    text = str(graph.graph)
    assert text.count(f"{NAMESPACE}.cuda_similarity_lse_stats") == k
    assert text.count(f"{NAMESPACE}.cuda_similarity_lse_grad") == k


def test_the_prefix_limit_is_the_kernels():
    """cuda_ops/pair_scores.MAX_PREFIXES (how many widths one call of the dims ops takes) is the kernels' and the
    binding's kMaxPrefixes."""
    from angle_kernels.cuda_ops import pair_scores as cuda_pair_scores

    for name in ("pair_scores.cu", "pair_scores.cpp"):
        found = re.search(r"constexpr\s+\w+\s+kMaxPrefixes\s*=\s*(\d+)\s*;", (CSRC / name).read_text())
        assert found and int(found.group(1)) == cuda_pair_scores.MAX_PREFIXES, name


@pytest.mark.parametrize("groups", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_fake_shapes_similarity_xent_dense(dtype, groups):
    """The dense similarity_xent scheme's tile ops of one row block: lse_all and lse_pos [b]; the gradient tile
    [b, Mc] in the operand dtype and the radial sums [b], [Mc]; with dims the running sum in and out."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    rows, b = 11, 5
    with FakeTensorMode():
        dots = torch.empty(b, rows, dtype=acc)
        inv = torch.empty(rows, dtype=acc)
        tiles = (dots, inv, inv, torch.empty(rows, dtype=torch.int64) if groups else None)
        options = (20.0, "partner", True, 0.1)
        lse_all, lse_pos = _op("cuda_similarity_xent_dense_stats")(*tiles, 4, *options)
        assert lse_all.shape == lse_pos.shape == (b,) and lse_all.dtype == lse_pos.dtype == acc
        operand = str(dtype).replace("torch.", "")
        grad, following, row_radial, col_radial = _op("cuda_similarity_xent_dense_grad")(
            *tiles, inv, inv, inv, None, None, None, 4, *options, False, False, operand)
        assert grad.shape == (b, rows) and grad.dtype == dtype and following.shape == (0, rows)
        assert row_radial.shape == (b,) and col_radial.shape == (rows,) and row_radial.dtype == col_radial.dtype == acc
        running = torch.empty(b, rows, dtype=acc)
        grad, following, _, _ = _op("cuda_similarity_xent_dense_grad")(
            *tiles, inv, inv, inv, running, inv, inv, 4, *options, True, True, operand)
        assert following.shape == (b, rows) and following.dtype == acc
        assert grad.shape == ((0, rows) if dtype == acc else (b, rows)) and grad.dtype == dtype


def test_similarity_xent_code_paths():
    """One width: the dense scheme from D = 768 (switched on by the H200's op sweep), the fused kernels below; dims on
    the dense dims scheme."""
    assert CUDA.paths["similarity_xent"] == ("fused", "dense", "dense_dims")
    assert CUDA.features["similarity_xent"] == frozenset({"dims"})
    q = torch.empty(6, 1024)
    assert CUDA.code_paths["similarity_xent"](q, None, 20.0, "partner") == "dense"
    assert CUDA.code_paths["similarity_xent"](q[:, :767], None, 20.0, "partner") == "fused"
    assert CUDA.code_paths["similarity_xent"](q, None, 20.0, "partner", dims=(8, 1024)) == "dense_dims"


@pytest.mark.parametrize("path, dims", [("dims", None), ("dense", (8, 16)), ("fused", (8, 16)), ("dense_dims", None)])
def test_similarity_xent_refuses_a_code_path_that_cannot_compute_the_call(path, dims):
    """A path the op has not, a one-width path for a dims call or the dims path for a one-width call (a backend
    held to one path) is a ValueError naming it, before any kernel runs, not another path's result."""
    from angle_kernels.cuda_ops import similarity_xent_paths

    q = torch.zeros(6, 16)
    with pytest.raises(ValueError, match=re.escape(f"has no code path {path!r} for dims={dims!r}")):
        similarity_xent_paths.similarity_xent(q, None, 20.0, "partner", dims=dims, path=path)


@pytest.mark.parametrize("dims", [None, (2, 4, 8)], ids=str)
def test_make_fx_traces_similarity_xent_dense(dims):
    """The dense scheme traced with fake tensors: at one width forward calls the statistics and gradient ops once
    per row block (the gradients formed in forward); with dims forward the statistics op once per prefix and
    backward the gradient op as often."""
    from torch.fx.experimental.proxy_tensor import make_fx

    k = 1 if dims is None else len(dims)

    def grads(q, c):
        q, c = q.requires_grad_(), c.requires_grad_()
        loss = CUDA.similarity_xent(q, c, 20.0, "diagonal", None, False, 0.1, None, dims,
                                    path="dense" if dims is None else "dense_dims")
        assert loss.shape == (() if dims is None else (k,))
        return torch.autograd.grad(loss.sum(), (q, c))

    graph = make_fx(grads, tracing_mode="fake")(torch.randn(6, 8, dtype=torch.bfloat16),
                                                torch.randn(10, 8, dtype=torch.bfloat16))
    text = str(graph.graph)
    assert text.count(f"{NAMESPACE}.cuda_similarity_xent_dense_stats") == k
    assert text.count(f"{NAMESPACE}.cuda_similarity_xent_dense_grad") == k

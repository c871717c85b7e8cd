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
            "int": "int"}[str(schema_type)]


def _cpp_kind(parameter: str) -> str:
    if "Tensor" in parameter:
        return "Tensor?" if "optional" in parameter else "Tensor"
    for cpp, kind in (("double", "float"), ("bool", "bool"), ("string", "str"), ("int64_t", "int")):
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

"""The providers the benchmarks compare, defined in one place.

A *provider* is one implementation of a loss: ours (angle_kernels, one provider per usable backend), the
reference's eager code (angle-emb 0.6.1, `angle_emb/loss.py`) and sentence-transformers' losses. Every
provider of a loss is handed the same input tensors (built by `build_inputs`) and returns a closure that
computes the scalar loss; the harness calls `closure().backward()` and times / measures that.

The four benchmarked losses, with the tensors they take (N = number of pairs / queries, D = embedding size):

    cosine       y_true [2N, 1] graded labels (6 levels, heavy ties), y_pred [2N, D] zigzag pairs
    angle        same inputs as cosine; angle score with sum pooling, tau 20 (AnglELoss's scale)
    ibn          y_true [2N, 1] 0/1 labels (about 80 % ones), y_pred [2N, D]: in-batch negatives over 2N rows
    contrastive  text, pos, neg [N, D] each: query -> [pos; neg] cross-entropy (format C's hard-negative term)

Who provides what:

    loss         ours                                   angle-emb (reference)              sentence-transformers
    cosine       cosine_loss(tau=20)                    loss.cosine_loss(tau=20)           CoSENTLoss(scale=20)
    angle        angle_loss(tau=20, 'sum')              loss.angle_loss(tau=20, 'sum')     AnglELoss(scale=20)
    ibn          in_batch_negative_loss(tau=20)         loss.in_batch_negative_loss        (no equivalent loss)
    contrastive  contrastive_with_negative_loss(20)     loss.contrastive_with_negative_... MultipleNegativesRankingLoss(scale=20)
                                                                                           on (anchor, positive, negative)

sentence-transformers' losses normally take a SentenceTransformer and tokenised features. Here they get
`PrecomputedEmbeddings`, a module that plays the model's part and hands back the embedding tensor stored in
each feature dict, so their own `forward` (and scoring code) runs unchanged on our precomputed inputs.
`check_agreement` verifies that every provider computes the same value and gradients on a small input.

The reference is loaded by file path (`importlib.util.spec_from_file_location`) from the installed package's
`angle_emb/loss.py`, from a `.py` path, or from an angle-emb wheel: that file needs only torch, while
importing the `angle_emb` package pulls in datasets, bitsandbytes and more (absent on the GPU image).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch
from torch import nn

LOSSES = ("cosine", "angle", "ibn", "contrastive")
TAU = 20.0  # every provider uses the same temperature/scale: AngleLoss's and sentence-transformers' default

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Losses whose cost (time and the baselines' memory) grows as N^2; cosine and angle grow as N (ours and
# sentence-transformers) or N^2 (the reference's memory).
QUADRATIC_LOSSES = ("ibn", "contrastive")


# --------------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------------


def build_inputs(loss: str, n: int, d: int, dtype: torch.dtype, device: str | torch.device, seed: int = 0) -> dict:
    """The inputs of one benchmark case: random (never zeros), seeded, built directly on `device`.

    Embeddings are leaves with requires_grad=True; labels are float32 without grad. Returns a dict whose
    keys are the loss's argument names.
    """
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}; got {loss!r}")
    gen = torch.Generator(device=device).manual_seed(seed)

    def embeddings(rows: int) -> torch.Tensor:
        x = torch.randn(rows, d, generator=gen, device=device, dtype=torch.float32)
        return x.to(dtype).requires_grad_(True)

    if loss in ("cosine", "angle"):
        per_pair = torch.randint(0, 6, (n,), generator=gen, device=device).to(torch.float32)
        return {"y_true": per_pair.repeat_interleave(2).unsqueeze(1), "y_pred": embeddings(2 * n)}
    if loss == "ibn":
        per_pair = (torch.rand(n, generator=gen, device=device) < 0.8).to(torch.float32)
        return {"y_true": per_pair.repeat_interleave(2).unsqueeze(1), "y_pred": embeddings(2 * n)}
    return {"text": embeddings(n), "pos": embeddings(n), "neg": embeddings(n)}


def grad_leaves(inputs: dict) -> list[torch.Tensor]:
    """The input tensors that receive gradients (to reset `.grad` between runs and to compare gradients)."""
    return [t for t in inputs.values() if isinstance(t, torch.Tensor) and t.requires_grad]


def input_bytes(inputs: dict) -> int:
    return sum(t.numel() * t.element_size() for t in inputs.values() if isinstance(t, torch.Tensor))


def work_floor(loss: str, n: int, d: int, dtype: torch.dtype) -> dict:
    """The work a forward + backward pass cannot avoid (the project guide shared/docs/measuring.md), to turn a time into a rate.

    cosine/angle (pair scores): read the 2N x D embeddings twice (forward, backward), write their gradient
    once: memory bound. ibn: M = 2N rows against each other, 2 M^2 D FLOPs forward and twice that in the
    backward pass (which recomputes the logits): compute bound. contrastive: N queries against 2N
    candidates, 2 N (2N) D forward, twice that backward.
    """
    elem = torch.empty((), dtype=dtype).element_size()
    if loss in ("cosine", "angle"):
        return {"kind": "bytes", "amount": 3 * (2 * n) * d * elem}
    if loss == "ibn":
        m = 2 * n
        return {"kind": "flops", "amount": 6 * m * m * d}
    return {"kind": "flops", "amount": 6 * n * (2 * n) * d}


# --------------------------------------------------------------------------------------------------------
# Providers
# --------------------------------------------------------------------------------------------------------


@dataclass
class Provider:
    """One implementation of (some of) the losses.

    name: the column label ("ours-torch", "angle-emb", "sentence-transformers").
    family: "ours" | "reference" | "sentence-transformers"; ratios are taken against the primary "ours".
    calls: loss -> what is called (for the README/table legend); a loss missing here is not provided.
    make: (loss, inputs) -> a closure computing the scalar loss from `inputs`.
    """

    name: str
    family: str
    calls: dict[str, str]
    make: Callable[[str, dict], Callable[[], torch.Tensor]]
    notes: dict[str, str] = field(default_factory=dict)

    def provides(self, loss: str) -> bool:
        return loss in self.calls


# ---- ours -----------------------------------------------------------------------------------------------


def make_ours(backend: str) -> Provider:
    """angle_kernels' public functional API with an explicit backend."""
    import angle_kernels as ak

    def make(loss: str, inputs: dict) -> Callable[[], torch.Tensor]:
        if loss == "cosine":
            return lambda: ak.cosine_loss(inputs["y_true"], inputs["y_pred"], tau=TAU, backend=backend)
        if loss == "angle":
            return lambda: ak.angle_loss(
                inputs["y_true"], inputs["y_pred"], tau=TAU, pooling_strategy="sum", backend=backend
            )
        if loss == "ibn":
            return lambda: ak.in_batch_negative_loss(inputs["y_true"], inputs["y_pred"], tau=TAU, backend=backend)
        if loss == "contrastive":
            return lambda: ak.contrastive_with_negative_loss(
                inputs["text"], inputs["pos"], inputs["neg"], tau=TAU, backend=backend
            )
        raise ValueError(loss)

    calls = {
        "cosine": "angle_kernels.cosine_loss",
        "angle": "angle_kernels.angle_loss",
        "ibn": "angle_kernels.in_batch_negative_loss",
        "contrastive": "angle_kernels.contrastive_with_negative_loss",
    }
    return Provider(name=f"ours-{backend}", family="ours", calls=calls, make=make)


def ours_backends(device: str, probe: bool = True, only=None) -> tuple[list[str], dict[str, str]]:
    """The backends of angle_kernels that run on `device`: (usable, {unusable: why}).

    Each candidate is probed with a tiny cosine_loss call through the public API (probe=False: only
    check that angle_kernels imports). On CPU only 'torch' is benchmarked: 'triton' on CPU tensors means
    the Triton interpreter (NumPy, orders of magnitude slower).
    """
    candidates = ("torch",) if device == "cpu" else ("triton", "cuda", "torch")
    if only is not None:  # the others are not even probed: a backend left out may be one that crashes
        candidates = tuple(name for name in candidates if name in only)
    try:
        import angle_kernels as ak
    except Exception as exc:
        return [], {name: f"angle_kernels does not import: {type(exc).__name__}: {exc}" for name in candidates}
    if not probe:
        return list(candidates), {}
    usable, why_not = [], {}
    for name in candidates:
        try:
            y = torch.randn(4, 8, device=device)
            labels = torch.tensor([0.0, 0.0, 1.0, 1.0], device=device)
            ak.cosine_loss(labels, y, backend=name)
            usable.append(name)
        except Exception as exc:
            why_not[name] = f"{type(exc).__name__}: {exc}"
    return usable, why_not


# ---- the reference: angle_emb/loss.py loaded by path ------------------------------------------------------


def find_reference_loss_file(given: str | None = None) -> Path:
    """The path of angle-emb's loss.py: `given` (a .py file or an angle-emb wheel), else the installed package's.

    A wheel is a zip: its angle_emb/loss.py is extracted to a temporary file. Raises FileNotFoundError
    with a hint when nothing is found.
    """
    if given:
        path = Path(given).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"--angle-emb-loss: {path} does not exist")
        if path.suffix == ".whl":
            with zipfile.ZipFile(path) as wheel:
                try:
                    source = wheel.read("angle_emb/loss.py")
                except KeyError:
                    raise FileNotFoundError(f"--angle-emb-loss: {path} holds no angle_emb/loss.py") from None
            extracted = Path(tempfile.mkdtemp(prefix="angle_emb_ref_")) / "loss.py"
            extracted.write_bytes(source)
            return extracted
        return path
    spec = importlib.util.find_spec("angle_emb")  # locates the package without importing it
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / "loss.py"
        if path.exists():
            return path
    raise FileNotFoundError(
        "angle-emb is not installed: `pip install --no-deps angle-emb==0.6.1`, or pass --angle-emb-loss with "
        "the path of its loss.py or of the wheel"
    )


def load_reference_module(given: str | None = None) -> ModuleType:
    """Execute angle-emb's loss.py as a stand-alone module (it imports only torch)."""
    path = find_reference_loss_file(given)
    spec = importlib.util.spec_from_file_location("angle_emb_reference_loss", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.__bench_source__ = str(path)
    return module


def make_reference(module: ModuleType) -> Provider:
    def make(loss: str, inputs: dict) -> Callable[[], torch.Tensor]:
        if loss == "cosine":
            return lambda: module.cosine_loss(inputs["y_true"], inputs["y_pred"], tau=TAU)
        if loss == "angle":
            return lambda: module.angle_loss(inputs["y_true"], inputs["y_pred"], tau=TAU, pooling_strategy="sum")
        if loss == "ibn":
            return lambda: module.in_batch_negative_loss(inputs["y_true"], inputs["y_pred"], tau=TAU)
        if loss == "contrastive":
            return lambda: module.contrastive_with_negative_loss(inputs["text"], inputs["pos"], inputs["neg"], tau=TAU)
        raise ValueError(loss)

    calls = {name: f"angle_emb.loss.{fn}" for name, fn in (
        ("cosine", "cosine_loss"), ("angle", "angle_loss"), ("ibn", "in_batch_negative_loss"),
        ("contrastive", "contrastive_with_negative_loss"))}
    return Provider(name="angle-emb", family="reference", calls=calls, make=make,
                    notes={"source": getattr(module, "__bench_source__", "?")})


# ---- sentence-transformers fed precomputed embeddings -----------------------------------------------------


class PrecomputedEmbeddings(nn.Module):
    """Plays a SentenceTransformer's part for its losses: returns the embedding stored in each feature dict.

    sentence-transformers' losses call `model(features)["sentence_embedding"]` once per input column
    (through `embed_columns`); with this module the column's "features" are just {"embedding": tensor}, so
    the loss's own forward and scoring code run unchanged, and gradients flow to the given tensor.
    """

    def forward(self, features: dict) -> dict:
        return {"sentence_embedding": features["embedding"]}


def columns(*embeddings: torch.Tensor) -> list[dict]:
    """One feature dict per input column, as PrecomputedEmbeddings expects."""
    return [{"embedding": e} for e in embeddings]


def make_sentence_transformers() -> Provider:
    try:  # sentence-transformers >= 6.1 moved the losses; the old path still works with a warning
        from sentence_transformers.sentence_transformer import losses as st_losses
    except ImportError:
        from sentence_transformers import losses as st_losses

    model = PrecomputedEmbeddings()
    cosent = st_losses.CoSENTLoss(model, scale=TAU)
    angle = st_losses.AnglELoss(model, scale=TAU)
    mnrl = st_losses.MultipleNegativesRankingLoss(model, scale=TAU)

    def make(loss: str, inputs: dict) -> Callable[[], torch.Tensor]:
        if loss in ("cosine", "angle"):
            y_pred = inputs["y_pred"]
            labels = inputs["y_true"][0::2, 0]  # one label per pair
            module = cosent if loss == "cosine" else angle
            return lambda: module(columns(y_pred[0::2], y_pred[1::2]), labels)
        if loss == "contrastive":
            return lambda: mnrl(columns(inputs["text"], inputs["pos"], inputs["neg"]), None)
        raise ValueError(f"sentence-transformers has no equivalent of the {loss!r} loss")

    import sentence_transformers

    version = sentence_transformers.__version__
    calls = {
        "cosine": f"sentence_transformers {version} CoSENTLoss",
        "angle": f"sentence_transformers {version} AnglELoss",
        "contrastive": f"sentence_transformers {version} MultipleNegativesRankingLoss (anchor, positive, negative)",
    }
    return Provider(name="sentence-transformers", family="sentence-transformers", calls=calls, make=make)


# ---- all of them ---------------------------------------------------------------------------------------


def available_providers(device: str, angle_emb_loss: str | None = None, include=None,
                        probe: bool = True) -> tuple[list[Provider], dict]:
    """Every provider that loads here, in table order (ours first), and {name: why} for those that do not.

    include: optional iterable of families to keep ("ours", "reference", "sentence-transformers"), where "ours"
    may also be narrowed to some of our backends by name ("ours-triton", "ours-torch", ...).
    probe: run a tiny loss through each of our backends to see that it works (False: imports only, so
    that nothing is computed; see bench_losses.py on why its parent process must not compute).
    """
    wanted = set(include) if include else {"ours", "reference", "sentence-transformers"}
    ours_named = {name for name in wanted if name.startswith("ours-")}
    providers, missing = [], {}
    if "ours" in wanted or ours_named:
        only = None if "ours" in wanted else {name[len("ours-"):] for name in ours_named}
        usable, why_not = ours_backends(device, probe=probe, only=only)
        providers += [make_ours(backend) for backend in usable]
        missing.update({f"ours-{name}": why for name, why in why_not.items()})
    if "reference" in wanted:
        try:
            providers.append(make_reference(load_reference_module(angle_emb_loss)))
        except Exception as exc:
            missing["angle-emb"] = f"{type(exc).__name__}: {exc}"
    if "sentence-transformers" in wanted:
        try:
            providers.append(make_sentence_transformers())
        except Exception as exc:
            missing["sentence-transformers"] = f"{type(exc).__name__}: {exc}"
    return providers, missing


def primary_ours(providers: list[Provider]) -> Provider | None:
    """The provider the ratios are taken against: the backend 'auto' would choose (triton, cuda, torch)."""
    ours = {p.name: p for p in providers if p.family == "ours"}
    for name in ("ours-triton", "ours-cuda", "ours-torch"):
        if name in ours:
            return ours[name]
    return None


# --------------------------------------------------------------------------------------------------------
# Memory estimates (to skip a size before it can exhaust the machine)
# --------------------------------------------------------------------------------------------------------

# Bytes of peak extra memory per element of the N x N (cosine/angle), 2N x 2N (ibn) or N x 2N
# (contrastive) matrices that the eager implementations build for forward + backward (float32), rounded up
# from bench_losses.py on CPU at D = 768 (2026-11-21): the reference's cosine/angle losses needed +306 MB /
# +363 MB at N = 4096 (about 14-18 bytes per N^2 element after the linear part), its in-batch-negative loss
# +356 MB at N = 2048 (21 bytes per (2N)^2 element), the cross-entropy losses +139 MB (reference) and
# +179 MB (sentence-transformers) at N = 2048 (10-16 bytes per N x 2N element). shared/docs/measuring.md quotes
# +4.1 GB for the reference's cosine loss at N = 16384, where this estimate gives 5.1 GB: it errs high.
QUADRATIC_BYTES_PER_ELEMENT = {
    ("reference", "cosine"): 16.0,
    ("reference", "angle"): 20.0,
    ("reference", "ibn"): 22.0,
    ("reference", "contrastive"): 12.0,
    ("sentence-transformers", "contrastive"): 16.0,
}


def quadratic_elements(loss: str, n: int) -> int:
    if loss in ("cosine", "angle"):
        return n * n
    if loss == "ibn":
        return (2 * n) ** 2
    return n * 2 * n


def estimate_extra_bytes(provider: Provider, loss: str, n: int, d: int, dtype: torch.dtype) -> int:
    """A rough upper estimate of the peak extra memory of one forward + backward pass.

    For the eager baselines this is dominated by their N^2 matrices (see QUADRATIC_BYTES_PER_ELEMENT);
    for ours and sentence-transformers' sort-based CoSENT/AnglE it is a few copies of the embeddings.
    """
    elem = max(torch.empty((), dtype=dtype).element_size(), 4)
    rows = 3 * n if loss == "contrastive" else 2 * n
    linear = 8 * rows * d * elem
    per_element = QUADRATIC_BYTES_PER_ELEMENT.get((provider.family, loss))
    if per_element is None:
        return linear
    return int(per_element * quadratic_elements(loss, n)) + linear


# --------------------------------------------------------------------------------------------------------
# Agreement check
# --------------------------------------------------------------------------------------------------------


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.detach().to(torch.float64).reshape(-1)
    ref = ref.detach().to(torch.float64).reshape(-1)
    scale = torch.linalg.vector_norm(ref)
    diff = torch.linalg.vector_norm(out - ref)
    return float(diff / scale) if scale > 0 else float(diff)


def value_and_grads(provider: Provider, loss: str, inputs: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Run provider on fresh leaf copies of `inputs`; return (loss value, gradients of the leaves)."""
    copies = {k: (v.detach().clone().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v)
              for k, v in inputs.items()}
    value = provider.make(loss, copies)()
    value.backward()
    return value.detach(), [leaf.grad for leaf in grad_leaves(copies)]


def check_agreement(providers: list[Provider], loss: str, device: str = "cpu", n: int = 24, d: int = 32,
                    dtype: torch.dtype = torch.float64, seed: int = 1234) -> dict[str, dict[str, float]]:
    """Relative error of each provider's value and gradients against the first provider of `loss`.

    Returns {provider name: {"value": err, "grad": max err over the inputs}}. In float64 the providers
    differ only in the order of summation (errors around 1e-15).
    """
    inputs = build_inputs(loss, n, d, dtype, device, seed)
    active = [p for p in providers if p.provides(loss)]
    if not active:
        return {}
    base_value, base_grads = value_and_grads(active[0], loss, inputs)
    errors = {}
    for provider in active[1:]:
        try:
            value, grads = value_and_grads(provider, loss, inputs)
        except Exception as exc:  # reported (as infinitely wrong) instead of stopping the whole run
            errors[provider.name] = {"value": float("inf"), "grad": float("inf"), "against": active[0].name,
                                     "error": f"{type(exc).__name__}: {exc}"}
            continue
        grad_err = max(rel_err(g, b) for g, b in zip(grads, base_grads))
        errors[provider.name] = {"value": rel_err(value, base_value), "grad": grad_err,
                                 "against": active[0].name}
    return errors


def describe_environment(device: str) -> dict:
    """What the numbers depend on: hardware, threads, library versions."""
    info = {"torch": torch.__version__, "device": device, "threads": torch.get_num_threads()}
    if device == "cpu":
        info["cpu"] = cpu_model()
        info["logical_cpus"] = os.cpu_count()
    else:
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_memory_gb"] = round(props.total_memory / 1e9, 1)
        info["cuda"] = torch.version.cuda
        try:
            import subprocess

            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20,
            ).stdout.strip()
        except Exception:
            info["driver"] = "unknown"
    for name in ("triton", "sentence_transformers", "angle_kernels"):
        try:
            info[name] = importlib.import_module(name).__version__
        except Exception:
            info[name] = None
    return info


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"

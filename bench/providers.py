"""Who computes the benchmarked losses: the providers, loaded in one place.

A *provider* is one implementation of some of the losses, in one of four families:

    ours                   angle_kernels' public losses, one provider per usable backend (ours-torch,
                           ours-triton, ours-cuda)
    reference              angle-emb 0.6.1's eager code: its `angle_emb/loss.py`, loaded by file path
    sentence-transformers  its losses, fed precomputed embeddings (`PrecomputedEmbeddings`)
    eager                  eager PyTorch: angle_kernels.testing.oracle's N x N formulas computing in the inputs'
                           dtype (`oracle.computing_in`), for the ArcCSE losses, which neither package has

What a family calls for each loss is written next to the loss, in its family's module (bench_ranking.py,
bench_similarity.py, bench_arccse.py: `LossBench.implementations`). Every provider of a loss is handed the
same input tensors and returns a closure computing the scalar loss; the harness times and measures
`closure().backward()`. `check_agreement` verifies that all providers compute the same value and gradients.

The reference is executed as a module of its own from the installed package's `angle_emb/loss.py`, from a `.py`
path, or from an angle-emb wheel (read from the zip): that file needs only torch, while importing the `angle_emb`
package pulls in datasets, bitsandbytes and more (absent on the GPU image).
"""

from __future__ import annotations

import importlib
import importlib.util
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import harness
import torch
from torch import nn

from angle_kernels.testing.oracle import rel_err  # the one error measure

# The temperature (scale) of the AnglE losses for every provider: AngleLoss's and sentence-transformers' default.
TAU = 20.0

FAMILIES = ("ours", "reference", "sentence-transformers", "eager")


@dataclass(frozen=True)
class Provider:
    """One provider: `name` is its column in the tables, `context` what its implementations are handed
    (our backend's name, angle-emb's loss module, sentence-transformers' losses module, or
    angle_kernels.testing.oracle), `losses` the ones it computes. Ratios are taken against the primary "ours"
    (`primary_ours`)."""

    name: str
    family: str
    context: Any
    losses: dict[str, harness.LossBench]
    notes: dict[str, str] = field(default_factory=dict)

    def provides(self, loss: str) -> bool:
        return loss in self.losses

    def calls(self, loss: str) -> str:
        return self.losses[loss].implementations[self.family].calls

    def make(self, loss: str, inputs: dict) -> Callable[[], torch.Tensor]:
        return self.losses[loss].implementations[self.family].make(self.context, inputs)


def _provider(name: str, family: str, context, losses, notes=None) -> Provider:
    provided = {loss.name: loss for loss in losses if family in loss.implementations}
    return Provider(name, family, context, provided, notes or {})


# ---- ours -----------------------------------------------------------------------------------------------


def ours_backends(device: str, probe: bool = True, only=None) -> tuple[list[str], dict[str, str]]:
    """The backends of angle_kernels that run on `device`: (usable, {unusable: why}).

    Each candidate is probed with a tiny cosine_loss call through the public API (probe=False: only
    check that angle_kernels imports). On CPU only 'torch' is benchmarked: 'triton' on CPU tensors means
    the Triton interpreter (NumPy, orders of magnitude slower).
    """
    candidates = ("torch",) if device == "cpu" else ("triton", "cuda", "torch")
    # A backend asked for by name that is never benchmarked on this device is said, not dropped without a word.
    not_here = {name: f"not benchmarked on {device}" + (": triton on CPU tensors runs in its interpreter"
                                                        if name == "triton" else "")
                for name in sorted(set(only or ()) - set(candidates))}
    if only is not None:  # the others are not even probed: a backend left out may be one that crashes
        candidates = tuple(name for name in candidates if name in only)
    try:
        import angle_kernels as ak
    except Exception as exc:
        return [], {**not_here,
                    **{name: f"angle_kernels does not import: {type(exc).__name__}: {exc}" for name in candidates}}
    if not probe:
        return list(candidates), not_here
    usable, why_not = [], dict(not_here)
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


WHEEL_MEMBER = "angle_emb/loss.py"


def find_reference_loss_file(given: str | None = None) -> Path:
    """The file that holds angle-emb's loss.py: `given` (a .py file, or an angle-emb wheel holding
    angle_emb/loss.py), else (None) the installed package's. Raises FileNotFoundError with a hint when nothing is
    found, naming --angle-emb-loss where `given` is no such file."""
    if given is not None:
        path = Path(given).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"--angle-emb-loss: {path} " + ("is a folder, not angle-emb's loss.py or its wheel"
                                                                     if path.is_dir() else "does not exist"))
        if path.suffix == ".whl":
            try:
                with zipfile.ZipFile(path) as wheel:
                    members = wheel.namelist()
            except zipfile.BadZipFile as exc:
                raise FileNotFoundError(f"--angle-emb-loss: {path} is no wheel ({exc})") from exc
            if WHEEL_MEMBER not in members:
                raise FileNotFoundError(f"--angle-emb-loss: {path} holds no {WHEEL_MEMBER}")
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
    """Execute angle-emb's loss.py as a stand-alone module (it imports only torch); from a wheel, read from the zip
    (nothing is extracted to disk)."""
    path = find_reference_loss_file(given)
    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as wheel:
            source, origin = wheel.read(WHEEL_MEMBER), f"{path}!{WHEEL_MEMBER}"
    else:
        source, origin = path.read_bytes(), str(path)
    module = ModuleType("angle_emb_reference_loss")
    module.__file__ = origin
    exec(compile(source, origin, "exec"), module.__dict__)
    module.__bench_source__ = origin
    return module


# ---- sentence-transformers fed precomputed embeddings -----------------------------------------------------


class PrecomputedEmbeddings(nn.Module):
    """Plays a SentenceTransformer's part for its losses: returns the embedding stored in each feature dict.

    sentence-transformers' losses call `model(features)["sentence_embedding"]` once per input column
    (through `embed_columns`); with this module the column's "features" are just {"embedding": tensor}, so
    the loss's own forward and scoring code run unchanged, and gradients flow to the given tensor.
    """

    def forward(self, features: dict) -> dict:
        return {"sentence_embedding": features["embedding"]}

    def get_embedding_dimension(self) -> None:
        """Unknown until the embeddings arrive (MatryoshkaLoss asks, to check its dims; None skips the check)."""
        return None

    def _get_untruncated_embedding_dimension(self) -> None:
        """What sentence-transformers >= 6.3's MatryoshkaLoss asks instead (the width before any truncate_dim)."""
        return None


def columns(*embeddings: torch.Tensor) -> list[dict]:
    """One feature dict per input column, as PrecomputedEmbeddings expects."""
    return [{"embedding": e} for e in embeddings]


def sentence_transformers_losses() -> ModuleType:
    """sentence-transformers' losses module (>= 6.1 moved it; the old path still works with a warning)."""
    try:
        from sentence_transformers.sentence_transformer import losses
    except ImportError:
        from sentence_transformers import losses
    return losses


# ---- all of them ---------------------------------------------------------------------------------------


def available_providers(device: str, losses: list[harness.LossBench], angle_emb_loss: str | None = None,
                        include=None, probe: bool = True) -> tuple[list[Provider], dict]:
    """Every provider of `losses` that loads here, in table order (ours first), and {name: why} for those that
    do not. A family that provides none of `losses` is left out without a word.

    include: optional iterable of families to keep (see FAMILIES), where "ours" may also be narrowed to some
    of our backends by name ("ours-triton", "ours-torch", ...).
    probe: run a tiny loss through each of our backends to see that it works (False: imports only, so
    that nothing is computed; see harness.call_in_fork on why the CPU sweep's parent must not compute).
    """
    wanted = set(include) if include else set(FAMILIES)
    ours_named = {name for name in wanted if name.startswith("ours-")}
    providers, missing = [], {}

    def provides_any(family: str) -> bool:
        return any(family in loss.implementations for loss in losses)

    if "ours" in wanted or ours_named:
        only = None if "ours" in wanted else {name[len("ours-"):] for name in ours_named}
        usable, why_not = ours_backends(device, probe=probe, only=only)
        providers += [_provider(f"ours-{backend}", "ours", backend, losses) for backend in usable]
        missing.update({f"ours-{name}": why for name, why in why_not.items()})
    loaders = (
        ("reference", "angle-emb", lambda: load_reference_module(angle_emb_loss)),
        ("sentence-transformers", "sentence-transformers", sentence_transformers_losses),
        ("eager", "eager-pytorch", lambda: importlib.import_module("angle_kernels.testing.oracle")),
    )
    for family, name, load in loaders:
        if family not in wanted or not provides_any(family):
            continue
        try:
            context = load()
        except Exception as exc:
            missing[name] = f"{type(exc).__name__}: {exc}"
            continue
        notes = {"source": getattr(context, "__bench_source__", None) or getattr(context, "__file__", "?")}
        providers.append(_provider(name, family, context, losses, notes))
    return providers, missing


def primary_ours(providers: list[Provider], device: str = "cpu") -> Provider | None:
    """The provider the ratios are taken against: what backend='auto' computes with here. That is a GPU backend
    only on CUDA and only where it is verified for every op and code path (angle_kernels.verified), else the
    torch backend; failing that (not among the providers), the first of ours."""
    ours = {p.name: p for p in providers if p.family == "ours"}
    if device == "cuda":
        from angle_kernels import verified

        for backend in ("triton", "cuda"):
            if f"ours-{backend}" in ours and verified.covers_every_path(backend, torch.device("cuda", 0)):
                return ours[f"ours-{backend}"]
    return ours.get("ours-torch") or next(iter(ours.values()), None)


# --------------------------------------------------------------------------------------------------------
# Agreement check
# --------------------------------------------------------------------------------------------------------


def value_and_grads(provider: Provider, loss: str, inputs: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Run provider on fresh leaf copies of `inputs`; return (loss value, gradients of the leaves)."""
    copies = {k: (v.detach().clone().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v)
              for k, v in inputs.items()}
    value = provider.make(loss, copies)()
    value.backward()
    return value.detach(), [leaf.grad for leaf in harness.grad_leaves(copies)]


def check_agreement(providers: list[Provider], loss: harness.LossBench, device: str = "cpu", n: int = 24,
                    d: int = 32, dtype: torch.dtype = torch.float64, seed: int = 1234) -> dict[str, dict]:
    """Relative error of each provider's value and gradients against the first provider of `loss`.

    Returns {provider name: {"value": err, "grad": max err over the inputs, "against": name}}. In float64 the
    providers differ only in the order of summation (errors around 1e-15).
    """
    inputs = loss.build_inputs(n, d, dtype, device, seed)
    active = [p for p in providers if p.provides(loss.name)]
    if not active:
        return {}
    base_value, base_grads = value_and_grads(active[0], loss.name, inputs)
    errors = {}
    for provider in active[1:]:
        try:
            value, grads = value_and_grads(provider, loss.name, inputs)
        except Exception as exc:  # reported (as infinitely wrong) instead of stopping the whole run
            errors[provider.name] = {"value": float("inf"), "grad": float("inf"), "against": active[0].name,
                                     "error": f"{type(exc).__name__}: {exc}"}
            continue
        grad_err = max(rel_err(g, b) for g, b in zip(grads, base_grads))
        errors[provider.name] = {"value": rel_err(value, base_value), "grad": grad_err, "against": active[0].name}
    return errors

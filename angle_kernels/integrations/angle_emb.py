"""Make the angle-emb trainer (angle-emb 0.6.1) compute its losses with angle_kernels, reversibly.

    from angle_kernels.integrations import angle_emb as ak_angle_emb

    ak_angle_emb.patch()                  # from now on AnglE.fit / AngleTrainer use angle_kernels
    angle.fit(train_ds=..., ...)
    ak_angle_emb.unpatch()                # the originals are back

    with ak_angle_emb.patched(backend="torch"):   # or for one block
        angle.fit(...)

What `patch()` swaps (and `unpatch()` restores, object for object):

* the four loss functions `cosine_loss`, `angle_loss`, `in_batch_negative_loss` and
  `contrastive_with_negative_loss` in `angle_emb.loss`, in `angle_emb.angle` (which imported them by name
  and whose `AngleLoss.__call__` looks them up there at call time) and in the `angle_emb` package namespace;
* `AngleLoss` in `angle_emb.angle` and `angle_emb`, replaced by `angle_kernels.AngleLoss` (same arguments,
  also accepts and ignores extra keyword arguments). `AngleTrainer.__init__` builds its loss from
  `angle_emb.angle.AngleLoss`, so trainers created while patched hold ours; a trainer created before
  `patch()` keeps the reference's AngleLoss object, whose calls still reach the patched functions.

* `AngleESETrainer.compute_loss` (Espresso: the final layer at full and compressed width, every earlier layer
  at the compressed width weighted 1 / (1 + ln(1 + i)), then averaged): the reference calls the loss once per
  layer plus twice for the final one; patched, one angle_kernels call computes every term on the layers'
  pooled embeddings stacked [L, rows, D] with dims (compression size, D) (see `_fused_ese_compute_loss`). Its
  PCA-KL compression terms, the teacher alignment and the MLM term stay the reference's code.

Not reached: names that user code imported before `patch()` (`from angle_emb.loss import cosine_loss`
binds the original function to that name). Import the module (`angle_emb.loss.cosine_loss`) or patch first.
While patched, such an original function cannot be pickled (pickle finds a function by its name, which holds ours),
and an angle-emb AngleLoss made before `patch()` is no instance of `angle_emb.AngleLoss` (ours); it pickles, as
angle-emb's class. A process started with "spawn" (multiprocessing's default on macOS and Windows, DataLoader
workers there) imports angle-emb afresh, unpatched: call `patch()` in it too, or use the "fork" start method.

The results equal the reference's on valid inputs (values and gradients, to floating-point rounding). Where
the reference silently misbehaves, angle_kernels raises instead (README, "Deviations from the reference"):
labels outside {0, 1} with the in-batch-negative term (ibn_w > 0), NaN/Inf inputs, an odd embedding size
for the angle term. Zero vectors give finite losses instead of NaN.
"""

from __future__ import annotations

import contextlib
import copy
import copyreg
import functools
import importlib
import math
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch

from .. import functional as _functional
from .. import inputs as _inputs
from ..dispatch import check_backend
from ..modules import AngleLoss as _AngleLoss
from ..modules import computes_angle_term

__all__ = ["patch", "unpatch", "patched", "is_patched", "PATCHED_NAMES"]

LOSS_FUNCTIONS = ("cosine_loss", "angle_loss", "in_batch_negative_loss", "contrastive_with_negative_loss")
PATCHED_NAMES = LOSS_FUNCTIONS + ("AngleLoss",)
ESE_TRAINER = ("angle_emb.angle", "AngleESETrainer")  # whose compute_loss patch() replaces
# where angle-emb 0.6.1 holds those names: its loss module, the trainer's module, the package namespace
_MODULES = ("angle_emb.loss", "angle_emb.angle", "angle_emb")

# re-entrant: patched() holds it across patch() and unpatch(), which take it too, so that no other thread's block
# enters or ends between what a block finds and what it changes
_lock = threading.RLock()
_originals: dict[tuple[str, str], object] = {}  # (module name, attribute) -> the object patch() replaced
_ese_original: list[Any] = []  # AngleESETrainer.compute_loss as patch() found it (empty when not patched)
_ese_student_loss: list[Any] = []  # and its compute_student_loss, the hook a subclass overrides
_backend: list[str | None] = []  # the backend patch() bound (empty when not patched), which patched() restores
# the patched() blocks now open, in order of entry, in every thread: each holds what it restores on exit (_backend as
# the block found it); see patched()
_open_blocks: list[list[list[str | None]]] = []


class AngleLossOnBackend(_AngleLoss):
    """angle_kernels' AngleLoss whose backend, unless given, is the one patch(backend=...) set (an importable class:
    a trainer's loss pickles, as angle-emb's does)."""

    patched_backend: str | None = None

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("backend", type(self).patched_backend)
        super().__init__(*args, **kwargs)


# the loss classes whose forward is AngleLoss.forward itself: the fused Espresso call computes what it would
_ANGLE_LOSS_CLASSES = (_AngleLoss, AngleLossOnBackend)


def _import_angle_emb() -> list[ModuleType]:
    try:
        return [importlib.import_module(name) for name in _MODULES]
    except ImportError as exc:
        raise ImportError(
            "angle_kernels.integrations.angle_emb needs the angle-emb package (pip install --no-deps "
            f"angle-emb==0.6.1 plus its import-time dependencies): {exc}"
        ) from exc


def _replacements(backend: str | None) -> dict[str, object]:
    """Our objects for each patched name, with `backend` bound when one is given."""
    out: dict[str, object] = {}
    for name in LOSS_FUNCTIONS:
        ours = getattr(_functional, name)
        if backend is None:
            out[name] = ours
        else:
            out[name] = functools.wraps(ours)(functools.partial(ours, backend=backend))
    if backend is None:
        out["AngleLoss"] = _AngleLoss
    else:
        AngleLossOnBackend.patched_backend = backend
        out["AngleLoss"] = AngleLossOnBackend
    return out


def is_patched() -> bool:
    """Whether angle-emb currently computes with angle_kernels (patch() is in effect)."""
    return bool(_originals)


def patch(backend: str | None = None) -> None:
    """Make angle-emb's losses and AngleLoss those of angle_kernels (see the module docstring).

    Args:
        backend: angle_kernels backend for every patched loss ("auto", "torch", "triton", "cuda"); None
            (default) means each call chooses ("auto", or the ANGLE_KERNELS_BACKEND environment variable).

    Calling patch() again while patched re-binds the backend; the saved originals stay the reference's.
    Raises ImportError when angle-emb is not installed, ValueError for an unknown backend (with None, an unknown
    ANGLE_KERNELS_BACKEND) before anything changes.
    """
    check_backend(backend)
    modules = _import_angle_emb()
    replacements = _replacements(backend)
    with _lock:
        for module in modules:
            for name in PATCHED_NAMES:
                if not hasattr(module, name):
                    continue
                _originals.setdefault((module.__name__, name), getattr(module, name))
                setattr(module, name, replacements[name])
        _backend[:] = [backend]
        reference_loss = _originals.get((_MODULES[1], "AngleLoss"))
        if isinstance(reference_loss, type):
            copyreg.pickle(reference_loss, _reduce_reference_angle_loss)
        trainer = getattr(importlib.import_module(ESE_TRAINER[0]), ESE_TRAINER[1], None)
        if trainer is not None and not _ese_original:
            _ese_original.append(trainer.compute_loss)
            _ese_student_loss[:] = [getattr(trainer, "compute_student_loss", None)]
            trainer.compute_loss = _fused_ese_compute_loss


def unpatch() -> None:
    """Restore every object patch() replaced; a no-op when not patched."""
    with _lock:
        for (module_name, name), original in _originals.items():
            setattr(importlib.import_module(module_name), name, original)
        copyreg.dispatch_table.pop(_originals.get((_MODULES[1], "AngleLoss")), None)
        _originals.clear()
        _backend.clear()
        if _ese_original:
            getattr(importlib.import_module(ESE_TRAINER[0]), ESE_TRAINER[1]).compute_loss = _ese_original.pop()


def _reduce_reference_angle_loss(loss: Any) -> tuple[Any, tuple[()], dict[str, Any]]:
    """How an angle-emb AngleLoss made before patch() pickles while patched: pickle finds a class by its name, which
    then holds ours, and refused the object ("not the same object as angle_emb.angle.AngleLoss"). It is rebuilt as
    angle-emb's class (`_reference_angle_loss`), with its attributes."""
    return _reference_angle_loss, (), dict(vars(loss))


def _reference_angle_loss() -> Any:
    """An empty angle-emb AngleLoss, the class patch() replaced (angle-emb's own where not patched: another process
    unpickling it)."""
    cls = _originals.get((_MODULES[1], "AngleLoss")) or getattr(importlib.import_module(_MODULES[1]), "AngleLoss")
    return cls.__new__(cls)


@contextlib.contextmanager
def patched(backend: str | None = None) -> Iterator[None]:
    """Context manager: angle-emb uses angle_kernels inside the block.

    On exit angle-emb is as the block found it: the originals come back, or, where patch() was already in effect
    on entry, it stays patched with the backend it had then (a block nested in another, or in patch(), sets its
    backend for its own extent only). Blocks open at once in several threads end in any order: one that ends while a
    block entered after it (in another thread) is still open leaves the patch to that block, which restores on exit
    what the earlier block found (angle-emb is patched process-wide, so the first block to end unpatched it under
    the other thread's training, which went on with angle-emb's own losses).
    """
    # one step: another thread's block entering between the look and the patch found what this one found, and the
    # first of the two to end unpatched angle-emb under the other
    with _lock:
        block = [list(_backend)]  # what the block restores: [backend] when patched on entry, [] when not
        patch(backend)
        _open_blocks.append(block)
    try:
        yield
    finally:
        _end_block(block)


def _end_block(block: list[list[str | None]]) -> None:
    """A patched() block's exit: it restores what it found unless a block entered after it is still open (another
    thread's), which then restores that instead."""
    # held while restoring: a block entering in another thread between the hand-over and the restore was unpatched
    # under it
    with _lock:
        position = next(i for i, open_block in enumerate(_open_blocks) if open_block is block)
        del _open_blocks[position]
        if position < len(_open_blocks):
            _open_blocks[position][0] = block[0]
            return
        previous = block[0]
        if not previous:
            unpatch()
        elif is_patched():  # unpatch() called inside the block stays in effect
            patch(previous[0])


# ------------------------------------------------------------------------------------------------------------
# Espresso (AngleESETrainer): every layer's loss in one fused call
# ------------------------------------------------------------------------------------------------------------
def _fused_ese_compute_loss(self: Any, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                            **kwargs: Any) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """AngleESETrainer.compute_loss with the AnglE loss of every layer in one angle_kernels call.

    Same value as the reference (up to floating-point rounding): the pooler's forward, the PCA-KL compression
    terms (in the reference's order, so torch.svd_lowrank draws the same random projections), the teacher
    alignment and the MLM term are the reference's code; only its L + 1 calls of the loss become one
    `AngleLoss(dims=(compression size, D))` call with Espresso's layer weights. Falls back to the reference's
    method when the trainer's loss is not angle_kernels' AngleLoss itself (a trainer created before patch(), or a
    subclass, whose forward may add terms or see the 2-D slices the reference passes it), has forward hooks (they would
    see one stack instead of L + 1 calls), already has dims of its own, or the trainer's class overrides
    compute_student_loss (angle-emb's hook for the earlier layers' terms, which the fused call does not make).
    """
    loss_fct = self.loss_fct
    overridden = getattr(type(self), "compute_student_loss", None) is not _ese_student_loss[0]
    hooked = isinstance(loss_fct, torch.nn.Module) and bool(loss_fct._forward_hooks or loss_fct._forward_pre_hooks)
    if type(loss_fct) not in _ANGLE_LOSS_CLASSES or hooked or loss_fct.dims is not None or overridden:
        return _ese_original[0](self, model, inputs, return_outputs=return_outputs, **kwargs)
    from angle_emb.angle import get_pooling

    labels = inputs.pop("labels", None)
    mask_target_labels = inputs.pop("mask_target_labels", None)
    if mask_target_labels is not None:
        all_layer_outputs, mlm_logits = self.pooler(inputs, layer_index=-1, return_all_layer_outputs=True,
                                                    return_mlm_logits=True)
    else:
        all_layer_outputs = self.pooler(inputs, layer_index=-1, return_all_layer_outputs=True)
    strategy, side = self.pooler.pooling_strategy, self.pooler.padding_side
    teacher_outputs = get_pooling(all_layer_outputs[-1], inputs, strategy, side)
    students = [get_pooling(all_layer_outputs[i], inputs, strategy, side) for i in range(self.n_layers - 1)]

    if teacher_outputs.dim() != 2:  # the stack below would be 4-D, and the error would name layer_weights
        raise ValueError(f"Espresso needs one pooled embedding per text, but the pooler's pooling_strategy "
                         f"{strategy!r} gives outputs of shape {tuple(teacher_outputs.shape)}")
    size, width = self.ese_compression_size, teacher_outputs.shape[-1]
    dims, rows = _inputs.espresso_layer_weights(self.n_layers, size, width)
    # the angle term splits the compressed prefix in halves; the loss would refuse it as odd `dims`, which the
    # trainer's user never passed (an odd full width is the embeddings' own, refused by the loss as such)
    if len(dims) > 1 and dims[0] % 2 and computes_angle_term(loss_fct.settings().angle_w, loss_fct.dataset_format):
        raise ValueError(f"AngleESETrainer's ese_compression_size must be even where the angle term runs (angle_w > 0, "
                         f"formats A and C: it splits the compressed embeddings in halves), got {size!r}")
    layered = copy.copy(self.loss_fct)  # the trainer's loss configuration, with Espresso's two widths
    layered.dims, layered.dim_weights = dims, None
    loss = layered(labels, torch.stack(students + [teacher_outputs]), layer_weights=rows)
    if self.apply_ese_pca:
        temperature = self.ese_kl_temperature
        loss = loss + self.compute_distillation_loss(teacher_outputs[:, :size],
                                                     self.pca_compress(teacher_outputs, size),
                                                     kl_temperature=temperature)
        compression = 0.0
        for i, student in enumerate(students):
            compression += self.compute_distillation_loss(student[:, :size], self.pca_compress(student, size),
                                                          kl_temperature=temperature) / (1.0 + math.log(1 + i))
        loss = loss + compression / (self.n_layers - 1)

    if self.teacher_name_or_path is not None:
        with torch.no_grad():  # the term's value only, as angle-emb's in-place `loss +=` gives it (no gradient)
            self.teacher_pooler.model = self.teacher_pooler.model.to(self.pooler.model.device)
            align_outputs = self.teacher_pooler(inputs)
            alignment = self.compute_distillation_loss(
                all_layer_outputs[-1] if self.teacher_pooling_strategy == "all" else teacher_outputs, align_outputs,
                mse_weight=0.0, kl_temperature=1.0)
        loss = loss + alignment  # outside no_grad: the loss keeps its graph
    if mask_target_labels is not None:
        loss = loss + self.compute_mlm_loss(mlm_logits, mask_target_labels)
    return (loss, teacher_outputs) if return_outputs else loss

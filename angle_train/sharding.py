"""`--fsdp`: full fine-tuning with weights, gradients and AdamW state sharded over the processes (PyTorch's FSDP2,
`torch.distributed.fsdp.fully_shard`), for models too large for a full copy on every GPU as DDP keeps.

    shard(encoder)                   each transformer block (the model's `_no_split_modules`), then the whole
    full_value / local_value         a DTensor's whole value (a collective) / this process's shard of it
    full_state_dict(encoder)         the unsharded weights on the main process, in CPU memory, for an export
    save_sharded / load_sharded      every process writes / reads its own shards of the weights and the AdamW
                                     state with torch.distributed.checkpoint (DCP), inside a checkpoint folder (a
                                     write that fails on any process: an OSError on every process; a file that
                                     cannot be read on any process: a ValueError naming it, on every process)
    read_dcp_metadata                DCP's .metadata, unpickled admitting only DCP_METADATA_GLOBALS (see Security)

A sharded forward gathers each block's weights from every process, so every embedding pass (training,
evaluation, export) runs on all processes at once. The loss, the gradient cache and the cross-device negatives
are the same code as under DDP: the all-gather of embeddings is independent of how the weights are held. Gradient
accumulation turns FSDP's reduce-scatter off until a batch's last chunk (distributed.no_sync).

Security: DCP itself reads `.metadata` with pickle.load and the non-tensor entries of a `.distcp` (the optimizer's
param_groups) with torch.load(weights_only=False), either of which runs whatever code a hostile file holds, and the
checkpoint's manifest (checkpoint.py) guards against damage only: whoever plants a file can rewrite the manifest.
So load_sharded hands DCP a reader and a planner of its own: `.metadata` is unpickled admitting only the classes
DCP writes there (DCP_METADATA_GLOBALS: its metadata records, torch.Size, dtypes, the layout, a Path), setting
attributes only on the records the file builds, and naming shard files inside the folder only; every `.distcp`
entry is read with torch.load(weights_only=True). A file holding anything else is refused with
safe_loading.UnsafeCheckpointError naming it, on every process, before anything in it runs.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import io
import os
import pickle
from collections.abc import Callable

import torch
from torch import nn

from .distributed import on_process


def transformer_blocks(backbone: nn.Module) -> list[nn.Module]:
    """The modules Hugging Face keeps whole when it splits a model across devices (`_no_split_modules`: BertLayer,
    LlamaDecoderLayer...): one FSDP unit each, so one block's weights are gathered at a time."""
    names = set(getattr(backbone, "_no_split_modules", None) or [])
    blocks = [m for m in backbone.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"--fsdp: {type(backbone).__name__} names no transformer block class in _no_split_modules; "
                         "cannot tell where to shard it")
    return blocks


def shard(encoder: nn.Module) -> nn.Module:
    """Shard the encoder in place over the default process group: each transformer block, then the rest (the
    embeddings, final norm) as the root unit. Parameters become DTensors; build the optimizer afterwards."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError as exc:  # pragma: no cover - depends on the installed torch
        raise ImportError("--fsdp needs PyTorch's FSDP2 (torch.distributed.fsdp.fully_shard, torch >= 2.6)") from exc
    for block in transformer_blocks(encoder.backbone):
        fully_shard(block)
    fully_shard(encoder)
    return encoder


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective: every process calls it); a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local_value(tensor: torch.Tensor) -> torch.Tensor:
    """This process's shard of a DTensor; a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full_state_dict(encoder: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded weights of the encoder's backbone (names as backbone.state_dict() gives them), on the main
    process, in CPU memory; {} on the others. Every process must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(encoder, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    prefix = "backbone."
    return {name[len(prefix):]: value for name, value in state.items() if name.startswith(prefix)}


def save_sharded(folder: str, encoder: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write this process's shards of the weights and the AdamW state into `folder` (every process calls it;
    DCP writes one `__RANK_0.distcp` file per process and a `.metadata` file)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(encoder, optimizer)
    try:
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder)
    except CheckpointException as exc:
        raise _write_error(exc) from exc


def _write_error(exc: BaseException) -> BaseException:
    """The error to raise for DCP's CheckpointException from a save: the first process's OSError (a full disk, a quota,
    an I/O error on any process: DCP gathers each process's errors into one CheckpointException, a BaseException, on
    every process) as an OSError naming that process, which a checkpoint's write handles as its own failed write (the
    partial folder removed, the intact previous checkpoint named); anything else as DCP raised it."""
    for rank, error in _failures(exc):
        if isinstance(error, OSError):
            return OSError(error.errno, f"{error.strerror or error}{_on_process(rank)}")
    return exc


def _failures(exc: BaseException) -> list[tuple[int, BaseException]]:
    """(rank, exception) of each process that failed, by rank, from DCP's CheckpointException."""
    return [(rank, failure[0] if isinstance(failure, tuple) else failure)  # (exception, traceback summary)
            for rank, failure in sorted(exc.failures.items())]


def _on_process(rank: int) -> str:
    """distributed.on_process(rank) where there are processes to tell apart, else ''."""
    import torch.distributed as dist

    return on_process(rank) if dist.is_available() and dist.is_initialized() else ""


class _Unreadable(ValueError):
    """A file of a sharded checkpoint that cannot be read (missing, truncated, corrupted): raised where it is read,
    gathered by DCP to every process, and turned into load_sharded's error. Only its arguments travel (pickled)."""

    def __init__(self, file: str, why: str):
        super().__init__(file, why)
        self.file, self.why = file, why

    def __str__(self) -> str:
        return f"cannot read {self.file}: {self.why}"


def _why_unreadable(exc: BaseException) -> str:
    """Why a file could not be read, in a few words on one line."""
    if isinstance(exc, FileNotFoundError):
        return "it is missing"
    said = str(exc).strip().split("\n")[0].split(". ")[0]  # torch's zip reader goes on for sentences of advice
    return f"{type(exc).__name__}: {said}" if said else type(exc).__name__


def load_sharded(folder: str, encoder: nn.Module, optimizer: torch.optim.Optimizer, *,
                 instead: Callable[[], str]) -> None:
    """Read what save_sharded wrote into the sharded encoder and its optimizer (every process calls it). DCP's files
    are read through the restricted readers below: a file holding anything DCP does not write is refused with
    safe_loading.UnsafeCheckpointError (on every process) before anything in it runs. A file that cannot be read
    (missing, truncated, corrupted since the manifest was checked, or a disk error) raises on every process a
    ValueError naming the folder, the file and why, and saying what to do instead (`instead()`, called only then:
    a resume that reads every file does not depend on what it looks up)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from .safe_loading import UnsafeCheckpointError

    def unreadable(error: _Unreadable, where: str = "") -> ValueError:
        return ValueError(f"cannot resume from {folder}: its {os.path.basename(error.file)} cannot be read{where} "
                          f"({error.why}); {instead()}")

    reader_class, planner_class = _restricted_dcp_classes()
    try:  # reads .metadata now: every process reads it, and a refusal comes before any collective of dcp.load
        reader = reader_class(folder)
    except _Unreadable as exc:
        raise unreadable(exc) from exc
    model_state, optimizer_state = get_state_dict(encoder, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    try:
        dcp.load(state, storage_reader=reader, planner=planner_class(folder))
    except CheckpointException as exc:  # DCP gathers every process's exception into one, on every process
        failures = _failures(exc)
        refused = [error for _, error in failures if isinstance(error, UnsafeCheckpointError)]
        if refused:  # a refusal comes out as itself
            raise refused[0] from exc
        for rank, error in failures:
            if isinstance(error, _Unreadable):
                raise unreadable(error, _on_process(rank)) from exc
        raise
    set_state_dict(encoder, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


# ------------------------------------------------------------------------ reading DCP's files without running code

METADATA_FILE = ".metadata"

# Every global a DCP `.metadata` file may name: what DCP pickles there (torch 2.11 to 2.13), and why. Unpickling
# calls a global a file names (or sets attributes on it); restricted to these constructors of plain records and
# values, reading the file runs nothing else, and a file naming any other global (os.system, builtins.eval...) is
# refused by name before anything in it runs.
DCP_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", "Metadata"): "the file's root object",
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"): "a tensor's entry: size, dtype, chunks",
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"): "a chunk of a tensor: offsets and sizes",
    ("torch.distributed.checkpoint.metadata", "TensorProperties"): "a tensor's dtype, layout, memory format",
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): "TensorProperties' memory format, an Enum",
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"): "a non-tensor entry (the optimizer's "
                                                                       "param_groups)",
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"): "the keys of storage_data",
    ("torch.distributed.checkpoint.metadata", "StorageMeta"): "checkpoint_id, save_id",
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): "where an entry lies: shard file, offset, length",
    ("torch", "Size"): "tensor sizes and chunk offsets",
    ("torch.serialization", "_get_layout"): "TensorProperties' layout (torch.strided), rebuilt from its name",
    ("pathlib", "PosixPath"): "StorageMeta.checkpoint_id: the folder DCP wrote to, a Path",
    ("pathlib._local", "PosixPath"): "the same, pickled by Python >= 3.13",
    ("pathlib", "WindowsPath"): "the same, written on Windows",
    ("pathlib._local", "WindowsPath"): "the same, written on Windows by Python >= 3.13",
}
# and ("torch", NAME) for a dtype (torch.float32...): TensorProperties' dtype, pickled as the global that names it.


def read_dcp_metadata(folder: str, file_name: str = METADATA_FILE):
    """DCP's Metadata from `folder`/.metadata, unpickled admitting only DCP_METADATA_GLOBALS and dtypes, setting
    attributes only on the records the file itself builds, and pointing only at shard files inside the folder:
    anything else is refused with safe_loading.UnsafeCheckpointError naming the file, before it runs. A file missing
    or not DCP metadata (truncated, corrupted) raises a ValueError naming it (_Unreadable)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata

    from .safe_loading import UNTRUSTED, UnsafeCheckpointError, is_file_name

    file = os.path.join(folder, file_name)
    real_folder = os.path.realpath(folder)
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except _Refused as refused:
        raise UnsafeCheckpointError(f"refusing to load {file}: {refused}. {UNTRUSTED}") from None
    except Exception as exc:  # missing or damaged: the manifest catches those first, unless they come after its check
        raise _Unreadable(file, _why_unreadable(exc)) from exc
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise UnsafeCheckpointError(f"refusing to load {file}: it holds a {type(metadata).__name__}, not DCP's "
                                    f"Metadata. {UNTRUSTED}")
    checked = set()
    for info in metadata.storage_data.values():  # each shard file a file of the folder itself, not a link out of it
        name = info.relative_path if isinstance(info, _StorageInfo) else info
        if name in checked:
            continue
        if not (is_file_name(name) and os.path.dirname(os.path.realpath(os.path.join(folder, name))) == real_folder):
            raise UnsafeCheckpointError(f"refusing to load {file}: it points DCP at {name!r}, outside the checkpoint "
                                        f"folder. {UNTRUSTED}")
        checked.add(name)
    return metadata


class _Refused(Exception):
    """What _MetadataUnpickler refused, and why."""


class _MetadataUnpickler(pickle._Unpickler):
    """pickle's Python unpickler admitting only DCP_METADATA_GLOBALS and dtypes (find_class), and BUILD (which sets an
    object's attributes) only on instances of DCP's dataclasses: a file cannot change a class or a shared object either.
    (The C unpickler's BUILD cannot be restricted, hence the Python one: some 10 times slower, 0.6 s for a .metadata
    of 17,000 shard entries.)"""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file):
        super().__init__(file)
        self._records: set[type] = set()  # the dataclasses this file named: BUILD may set attributes of their instances

    def find_class(self, module: str, name: str):
        if (module, name) in DCP_METADATA_GLOBALS:
            found = getattr(importlib.import_module(module), name)
            if dataclasses.is_dataclass(found):
                self._records.add(found)
            return found
        dtype = vars(torch).get(name) if module == "torch" else None  # vars(): no lazy import by torch's __getattr__
        if isinstance(dtype, torch.dtype):
            return dtype
        raise _Refused(f"it names {module}.{name}, which DCP's metadata never holds, and unpickling it would call code "
                       "that came with the file")

    def load_build(self):
        target = self.stack[-2]  # BUILD: the state on top, the object to set it on below
        if type(target) not in self._records:
            raise _Refused(f"it sets attributes of {target!r}, which unpickling DCP's metadata never does (it would "
                           "change that object for the whole process)")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = load_build

    def persistent_load(self, pid):
        raise _Refused("it holds a persistent id, which DCP's metadata never does")


@functools.lru_cache(maxsize=None)
def _restricted_dcp_classes():
    """(reader, planner): DCP's FileSystemReader and DefaultLoadPlanner reading the checkpoint's files without running
    code from them. Built on first use, as importing torch.distributed.checkpoint takes a while and only --fsdp needs
    it. DCP itself reads .metadata with pickle.load, and the non-tensor entries of a .distcp with
    torch.load(weights_only=False); its tensor entries it reads with torch.load(weights_only=True) already."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    from .safe_loading import UnsafeCheckpointError, read_tensors_and_plain_values, refusal

    class RestrictedReader(FileSystemReader):
        def __init__(self, folder: str):
            super().__init__(folder)
            self.folder = str(folder)
            self.checked_metadata = read_dcp_metadata(self.folder)

        def read_metadata(self, *args, **kwargs):
            # as FileSystemReader.read_metadata, through read_dcp_metadata (DCP asks for a process's own __R.metadata
            # only when the shared one cannot be read)
            rank = kwargs.get("rank")
            metadata = (self.checked_metadata if rank is None
                        else read_dcp_metadata(self.folder, f"__{rank}{METADATA_FILE}"))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan, planner):
            # file by file (as DCP reads them), so that an error names the file it came from
            by_file: dict[str, list] = {}
            for item in plan.items:
                by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
            done = None
            for name, items in by_file.items():
                file = os.path.join(self.folder, name)
                try:
                    done = super().read_data(dataclasses.replace(plan, items=items), planner)
                except UnsafeCheckpointError:  # an entry RestrictedPlanner.load_bytes refused
                    raise
                except pickle.UnpicklingError as exc:  # a tensor entry that DCP's torch.load(weights_only=True) refused
                    raise refusal(file, exc) from None
                except Exception as exc:  # missing, truncated, corrupted, a disk error
                    raise _Unreadable(file, _why_unreadable(exc)) from exc
            return done if done is not None else super().read_data(plan, planner)  # nothing to read: DCP's Future

    class RestrictedPlanner(DefaultLoadPlanner):
        def __init__(self, folder: str):
            super().__init__()
            self.folder = str(folder)

        def load_bytes(self, read_item, value):
            file = os.path.join(self.folder, self.metadata.storage_data[read_item.storage_index].relative_path)
            plain = read_tensors_and_plain_values(value, name=file)
            # DCP's own load_bytes files the value into the state dict, unpickling it with weights_only=False: hand it
            # the value just read, pickled afresh (plain values only), rather than the file's bytes
            rewritten = io.BytesIO()
            torch.save(plain, rewritten)
            rewritten.seek(0)
            super().load_bytes(read_item, rewritten)

    return RestrictedReader, RestrictedPlanner

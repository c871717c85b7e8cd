"""What has passed its correctness run on a GPU, and the rule that says whether that covers this process.

`backend="auto"` computes a call on a GPU backend only when that backend's (op, code path) has passed a
correctness run (forward and backward against the float64 reference, every dtype, the half-precision rule) on
matching hardware and software; everything else runs on the PyTorch backend, which the CPU test suite verifies
end to end. An explicit `backend="triton"` or `"cuda"` runs whatever it is asked, warning once per (backend, op,
path) and process when it is not verified here.

Code paths. A GPU backend's op module lists the paths a call can take (`PATHS`: for example the Triton
similarity_xent's fused kernels, its dense scheme and its prefix kernels for dims) and, when there are several,
`code_path(*args)`, which names the one a call takes. Each is verified on its own: the autotuner bug of the dims
backward (docs/gpu-hazards.md) lived on one path of an op whose other paths were sound.

Sources of verifications, read once per process:
    * VERIFIED below: the project's table, extended by the commit that brings a GPU run's results
      (`scripts/gpu_check.sh first` writes the entries to add, as verified.json, beside its results);
    * the user's cache, CACHE_FILE in cache_dir(): `python -m angle_kernels.verify` checks the GPU backends on
      the local GPU and records what passed there (and removes what failed).

The match rule: an entry covers a call when its backend, op and path are the call's and every field of
MATCH_FIELDS[backend] equals this process's value (`identity`):
    * triton: the GPU's compute capability; torch's and Triton's major.minor versions; `source`, a fingerprint of
      the op's Triton code (its module in triton_ops/ and every triton_ops module it imports, byte for byte: any
      edit to a verified kernel voids its verification, which tests/test_verified.py reports).
    * cuda: the compute capability; torch's major.minor and the CUDA version it was built with; `build`, the
      fingerprint of the csrc/ sources the loaded extension was built from (compiled into it); `source`, the
      fingerprint of the op's module in cuda_ops/ (its schemas and autograd formula).
"""

from __future__ import annotations

import ast
import datetime
import hashlib
import importlib
import json
import os
import tempfile
from pathlib import Path

import torch

# The project's verifications: entries as `entry()` makes them, added by the commit that brings a GPU run's
# results (its verified.json), with the results folder as "evidence".
_EVERY_DTYPE = ["bfloat16", "float16", "float32", "float64"]
_RANKING_DTYPES = ["float32", "float64"]  # the ranking op takes fp32/fp64 scores (contract)
_H100 = {"capability": "9.0", "torch": "2.11", "gpu": "NVIDIA H100 80GB HBM3", "date": "2026-11-26"}
# H100, torch 2.11, Triton 3.6: `scripts/gpu_check.sh first` (its large-size checks; the op tests' failures were
# the tests' own, fixed and rerun by scripts/gpu_recheck.sh)
_H100_TRITON = {**_H100, "triton": "3.6", "evidence": "bench/results/h100-80gb-hbm3-2026-11-26/first"}
# The Triton similarity_xent (fused, dense, dims) and similarity_lse entries of that run (sources d9c821cf1acf786b
# and 0aeef789db8f43fa) were removed when the structure refactor moved their shared tiles into _similarity_tiles.py
# and the dense scheme's MIN_WIDTH went to 768: the next `scripts/gpu_check.sh first` verifies them again.
# The CUDA entries (H100, torch 2.11, CUDA 13.0, bench/results/h100-80gb-hbm3-2026-11-26/recheck: pair_scores full
# 24fec6476fc4a093, similarity_xent fused a9e5136ee9aae84f, ranking_loss sort 391fdec5b48e0388, all built from
# csrc/ f28761a549abfa30) were removed when the ranking term's kernels became a multi-block scan and pair_scores
# gained a vector path (2026-11-27; the build fingerprint covers all of csrc/): the next `first` verifies the
# rebuilt extension again.
VERIFIED: tuple[dict, ...] = (
    {"backend": "triton", "op": "pair_scores", "path": "full", "source": "e74e1b8edc21e65d",
     "dtypes": _EVERY_DTYPE, **_H100_TRITON},
    {"backend": "triton", "op": "pair_scores", "path": "dims", "source": "e74e1b8edc21e65d",
     "dtypes": _EVERY_DTYPE, **_H100_TRITON},
    {"backend": "triton", "op": "ranking_loss", "path": "pairwise", "source": "04d83fb661829764",
     "dtypes": _RANKING_DTYPES, **_H100_TRITON},
    {"backend": "triton", "op": "ranking_loss", "path": "sort", "source": "04d83fb661829764",
     "dtypes": _RANKING_DTYPES, **_H100_TRITON},
)

MATCH_FIELDS = {
    "triton": ("capability", "torch", "triton", "source"),
    "cuda": ("capability", "torch", "cuda", "build", "source"),
}
GPU_BACKENDS = tuple(MATCH_FIELDS)
CACHE_ENV = "ANGLE_KERNELS_CACHE_DIR"
CACHE_FILE = "verified.json"
CACHE_FORMAT = 1
_PACKAGE_DIR = Path(__file__).resolve().parent


def cache_dir() -> Path:
    """Where the user's verifications live: $ANGLE_KERNELS_CACHE_DIR, else $XDG_CACHE_HOME/angle_kernels, else
    ~/.cache/angle_kernels."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "angle_kernels"


# ---------------------------------------------------------------------------------------------------------
# This process's identity
# ---------------------------------------------------------------------------------------------------------
def _major_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


# The modules below the backends that hold code an op runs (docs/dispatch.md, "Layers"): an op module's imports of
# them count as its own. contract.py does not (yet): its constants and compute dtype reach the kernels too, but
# counting it would void every verification at once; to add with the next GPU verification run.
SHARED_BELOW_BACKENDS = ("_runtime", "normalisation", "formed_gradients")


def _backend_modules(backend: str, op: str) -> list[Path]:
    """The op's module in the backend's package and every module of that package it imports, transitively, with
    the shared modules below the backends (SHARED_BELOW_BACKENDS) they import."""
    package = _PACKAGE_DIR / f"{backend}_ops"
    todo, found = [package / f"{op}.py"], set()
    while todo:
        path = todo.pop()
        if path in found or not path.exists():
            continue
        found.add(path)
        in_backend = path.parent == package
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom) or node.level not in (1, 2):
                continue
            names = [node.module] if node.module else [alias.name for alias in node.names]
            names = [name.split(".")[0] for name in names]
            if in_backend and node.level == 1:  # from .x import y / from . import x
                todo += [package / f"{name}.py" for name in names]
            elif node.level == (2 if in_backend else 1):  # from ..normalisation import y
                todo += [_PACKAGE_DIR / f"{name}.py" for name in names if name in SHARED_BELOW_BACKENDS]
    return sorted(found)


def source_fingerprint(backend: str, op: str) -> str:
    """16 hex digits of SHA-256 over the op's modules in the backend's package (`_backend_modules`)."""
    digest = hashlib.sha256()
    for path in _backend_modules(backend, op):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _capability(device: torch.device) -> str:
    return ".".join(map(str, torch.cuda.get_device_capability(device)))


def identity(backend: str, op: str, device: torch.device) -> dict:
    """This process's values of MATCH_FIELDS[backend] for `op` on the CUDA `device`, plus the GPU's name."""
    ident = {"capability": _capability(device), "torch": _major_minor(torch.__version__),
             "source": source_fingerprint(backend, op), "gpu": torch.cuda.get_device_name(device)}
    if backend == "triton":
        import triton

        ident["triton"] = _major_minor(triton.__version__)
    else:
        from .cuda_ops import _extension

        ident["cuda"] = torch.version.cuda
        ident["build"] = _extension.build_fingerprint()
    return ident


# ---------------------------------------------------------------------------------------------------------
# Entries, the cache, the rule
# ---------------------------------------------------------------------------------------------------------
def entry(backend: str, op: str, path: str, ident: dict, evidence: str, dtypes=()) -> dict:
    """A verification: what passed (backend, op, path), where (`ident`), when, and what shows it."""
    fields = {name: ident[name] for name in MATCH_FIELDS[backend]}
    return {"backend": backend, "op": op, "path": path, **fields, "gpu": ident.get("gpu"),
            "dtypes": list(dtypes), "date": datetime.date.today().isoformat(), "evidence": evidence}


def covers(candidate: dict, backend: str, op: str, path: str, ident: dict) -> bool:
    """The match rule (module docstring)."""
    if (candidate.get("backend"), candidate.get("op"), candidate.get("path")) != (backend, op, path):
        return False
    return all(ident.get(name) is not None and candidate.get(name) == ident.get(name)
               for name in MATCH_FIELDS[backend])


def read_cache(path: Path | None = None) -> list[dict]:
    """The entries of the user's cache; [] when there is none. A file that is not this format's is ignored
    with a warning (a broken cache must not break a loss call)."""
    path = path or cache_dir() / CACHE_FILE
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") != CACHE_FORMAT or not isinstance(data.get("entries"), list):
            raise ValueError(f"not format {CACHE_FORMAT}")
        return [e for e in data["entries"] if isinstance(e, dict)]
    except (OSError, ValueError) as exc:
        import warnings

        warnings.warn(f"angle_kernels: ignoring the verification cache {path}: {exc}", RuntimeWarning, stacklevel=2)
        return []


def write_cache(passed: list[dict], failed: list[dict], path: Path | None = None) -> Path:
    """Record a verification run: `passed` entries replace the cache's entries for the same (backend, op, path)
    and identity; the identities of `failed` entries lose theirs. Written atomically."""
    path = path or cache_dir() / CACHE_FILE
    replaced = passed + failed

    def same(a: dict, b: dict) -> bool:
        return covers(a, b["backend"], b["op"], b["path"], b)

    kept = [old for old in read_cache(path) if not any(same(old, new) for new in replaced)]
    write_json_atomic(path, {"format": CACHE_FORMAT, "entries": kept + passed})
    return path


def write_json_atomic(path: Path, data) -> None:
    """`data` as JSON in `path` (its folder created), written aside and renamed: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".verified-", suffix=".json", delete=False,
                                     encoding="utf-8") as tmp:
        json.dump(data, tmp, indent=1)
    os.replace(tmp.name, path)


# Per process: the entries (table + cache, read at the first question), identities per (backend, op, device)
# and answers per (backend, op, path, device index). Plain dicts: after the first call of a kind, a lookup.
_entries: list[dict] | None = None
_identities: dict = {}
_answers: dict = {}


def entries() -> list[dict]:
    """VERIFIED and the user's cache."""
    global _entries
    if _entries is None:
        _entries = list(VERIFIED) + read_cache()
    return _entries


def forget() -> None:
    """Drop what this process has read and decided (after `write_cache`, or in tests)."""
    global _entries
    _entries = None
    _identities.clear()
    _answers.clear()


def is_verified(backend: str, op: str, path: str, device: torch.device) -> bool:
    """Whether a verification covers `backend`'s `op` on code path `path` on the CUDA `device`. A process that
    cannot tell its own identity (a query that fails) has nothing verified: the answer is then False."""
    key = (backend, op, path, device.index)
    if key not in _answers:
        ident_key = (backend, op, device.index)
        if ident_key not in _identities:
            try:
                _identities[ident_key] = identity(backend, op, device)
            except Exception as exc:  # noqa: BLE001 (a loss call must not fail on this question)
                _identities[ident_key] = {"gpu": f"a GPU whose identity is unknown ({type(exc).__name__}: {exc})"}
        ident = _identities[ident_key]
        _answers[key] = any(covers(e, backend, op, path, ident) for e in entries())
    return _answers[key]


def covers_every_path(backend: str, device: torch.device) -> bool:
    """Whether every code path of every op the backend implements is verified on the CUDA `device` (then
    backend="auto" computes everything there with it)."""
    return all(is_verified(backend, op, path, device) for op, paths in paths_of(backend).items() for path in paths)


def describe(backend: str, op: str, device: torch.device) -> str:
    """The identity a verification of `backend`'s `op` must match here, in words (for warnings)."""
    ident = _identities.get((backend, op, device.index)) or identity(backend, op, device)
    if "capability" not in ident:
        return ident["gpu"]
    return f"{ident['gpu']} (sm_{ident['capability'].replace('.', '')}), " + ", ".join(
        f"{name} {ident[name]}" for name in MATCH_FIELDS[backend] if name != "capability")


def stale_entries(table=None) -> list[dict]:
    """The table's entries whose `source` (and, for cuda, `build`: the csrc/ sources) no longer match this
    checkout's code (an edited verified kernel)."""
    from .cuda_ops._extension import csrc_fingerprint

    stale = []
    for e in VERIFIED if table is None else table:
        if e.get("source") != source_fingerprint(e["backend"], e["op"]) or (
                e["backend"] == "cuda" and e.get("build") != csrc_fingerprint()):
            stale.append(e)
    return stale


def paths_of(backend: str) -> dict[str, tuple[str, ...]]:
    """op -> the code paths its module in the backend's package declares (PATHS), for the ops it implements."""
    from . import contract

    found = {}
    for op in contract.OPS:
        try:
            module = importlib.import_module(f"angle_kernels.{backend}_ops.{op}")
        except ModuleNotFoundError:
            continue
        found[op] = tuple(module.PATHS)
    return found

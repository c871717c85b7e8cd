"""What has passed its correctness run on a GPU, and the rule that says whether that covers this process.

`backend="auto"` computes a call on a GPU backend only when that backend's (op, code path) has passed a
correctness run (forward and backward against the float64 reference, every dtype, the half-precision rule) on
matching hardware and software, or has passed a first-use check here (`angle_kernels.first_use`); everything else
runs on the PyTorch backend's default path, which the CPU test suite verifies end to end. An explicit
`backend="triton"` or `"cuda"` runs whatever it is asked, warning once per (backend, op, path) and process when it
is not verified here; an explicit "torch" takes its GPU path only where it is verified here.

Code paths. A GPU backend's op module lists the paths a call can take (`PATHS`: for example the Triton
similarity_xent's fused kernels, its dense scheme and its prefix kernels for dims) and, when there are several,
`code_path(*args)`, which names the one a call takes. Each is verified on its own: the autotuner bug of the dims
backward (docs/gpu-hazards.md) lived on one path of an op whose other paths were sound.

Sources of verifications, read once per process:
    * VERIFIED below: the project's table, extended by the commit that brings a GPU run's results
      (`scripts/gpu_check.sh first` writes the entries to add, as verified.json, beside its results): the
      large-size checks (`python -m angle_kernels.verify --sizes large`);
    * the user's cache (`angle_kernels.user_cache`, section "verified"): `python -m angle_kernels.verify` checks
      the GPU backends on the local GPU and records what passed there (and removes what failed).

The match rule: an entry covers a call when its backend, op and path are the call's and every field of
MATCH_FIELDS[backend] equals this process's value (`identity`):
    * every backend: the GPU's compute capability, torch's major.minor version, and `fingerprint`, the
      fingerprint of the code the path executes (`angle_kernels.fingerprints`: its Triton kernels and every
      launcher and helper they reach; docstrings, comments and moves between modules excluded), so an edit voids
      exactly the verifications of the paths that run the edited code;
    * triton: Triton's major.minor version;
    * cuda: the CUDA version torch was built with, and `build`, the fingerprint of the path's CUDA sources (the
      op's, or the path's own: fingerprints.csrc_source) the loaded extension reports it was built from
      (fingerprints.csrc_fingerprint, compiled into it);
    * torch: nothing more. Its GPU paths (16-bit products on a GPU: torch_ops/similarity_xent.py's "mixed") are
      verified like the GPU backends' paths; its default path (ALWAYS_ALLOWED), the same float32/float64
      arithmetic on every device (similarity_xent's in its softmax form on CPU tensors and its blocked form
      elsewhere, both held to the oracle by the CPU suite), needs no verification anywhere.

A path whose code passed the table's large-size checks on some GPU (CODE_FIELDS equal) may also compute on a GPU
or versions the table does not cover, after a check on its first call there: `checked_elsewhere` says whether it
may, `angle_kernels.first_use` runs the checks.
"""

from __future__ import annotations

import datetime
import importlib
from pathlib import Path

import torch

from . import fingerprints, user_cache

# The project's verifications: entries as `entry()` makes them, added by the commit that brings a GPU run's
# results (its verified.json), with the results folder as "evidence". Every one passed the large-size checks.
_EVERY_DTYPE = ["bfloat16", "float16", "float32", "float64"]
_RANKING_DTYPES = ["float32", "float64"]  # the ranking op takes fp32/fp64 scores (contract)
_H100 = {"capability": "9.0", "torch": "2.11", "gpu": "NVIDIA H100 80GB HBM3", "date": "2026-11-26", "sizes": "large"}
# H100, torch 2.11, Triton 3.6, sources at commit 7ab8295: `scripts/gpu_check.sh first` (its large-size checks;
# the op tests' failures were the tests' own, fixed and rerun by scripts/gpu_recheck.sh).
_H100_TRITON = {**_H100, "triton": "3.6", "evidence": "bench/results/h100-80gb-hbm3-2026-11-26/first"}
# The CUDA backend on the same machine, built from the same commit: scripts/gpu_recheck.sh.
_H100_CUDA = {**_H100, "cuda": "13.0", "evidence": "bench/results/h100-80gb-hbm3-2026-11-26/recheck"}
_H200 = {"capability": "9.0", "torch": "2.11", "gpu": "NVIDIA H200", "date": "2026-11-28", "sizes": "large",
         "evidence": "bench/results/h200-2026-11-28/first"}
_H200_CHECKS = {**_H200, "evidence": "bench/results/h200-2026-11-28/first-checks"}
_H200_DIMS = {**_H200, "date": "2026-12-04", "evidence": "bench/results/h200-2026-12-04/first"}
# Every entry of those runs, with the fingerprint of the code each path executed then (by the rule of
# angle_kernels.fingerprints, computed at 7ab8295 by scripts/compare_fingerprints.py; its output,
# docs/verification-history.md, compares each with this checkout's). Restored on 2026-11-28, after the rule
# changed from whole files to executed code: the Triton similarity_xent (fused, dense, dims) and similarity_lse
# entries (removed when the structure refactor moved their tiles to _similarity_tiles.py: the code they execute is
# unchanged, docstrings and one import aside; MIN_WIDTH chooses between paths and is part of none, see
# docs/verification.md) and the CUDA similarity_xent entry (removed with the whole-csrc/ build fingerprint when
# the other ops' CUDA sources changed: its own sources are unchanged). Not restored: the CUDA pair_scores and
# ranking_loss entries (their kernels were rewritten on 2026-11-27: csrc/pair_scores.cu's vector path,
# csrc/ranking_loss.cu's multi-block scan) wait for the next GPU run.
VERIFIED: tuple[dict, ...] = (
    {"backend": "triton", "op": "pair_scores", "path": "full", "fingerprint": "efb179d27d83ab85",
     "dtypes": _EVERY_DTYPE, **_H100_TRITON},
    {"backend": "triton", "op": "pair_scores", "path": "dims", "fingerprint": "11ab4505b78faacc",
     "dtypes": _EVERY_DTYPE, **_H100_TRITON},
    {"backend": "triton", "op": "ranking_loss", "path": "pairwise", "fingerprint": "a0e64ba30d279396",
     "dtypes": _RANKING_DTYPES, **_H100_TRITON},
    {"backend": "triton", "op": "ranking_loss", "path": "sort", "fingerprint": "9d8df70c3ad9fcb7",
     "dtypes": _RANKING_DTYPES, **_H100_TRITON},
    {"backend": "triton", "op": "similarity_xent", "path": "fused", "fingerprint": "45d6ada46e5358f5",
     "dtypes": _EVERY_DTYPE, **_H100_TRITON},
    {"backend": "triton", "op": "similarity_xent", "path": "dense", "fingerprint": "5ef298652026e4ee",
     "dtypes": _EVERY_DTYPE, **_H100_TRITON},
    {"backend": "triton", "op": "similarity_xent", "path": "dims", "fingerprint": "51903531b5c5fc92",
     "dtypes": _EVERY_DTYPE, **_H100_TRITON},
    {"backend": "triton", "op": "similarity_lse", "path": "fused", "fingerprint": "7734c06fbe9d86d2",
     "dtypes": _EVERY_DTYPE, **_H100_TRITON},
    {"backend": "cuda", "op": "similarity_xent", "path": "fused", "fingerprint": "9039d98ffeec4bf3",
     "build": "76c163ff636742a4", "dtypes": _EVERY_DTYPE, **_H100_CUDA},
    # H200, torch 2.11, Triton 3.6, sources at commit fd3308d: `scripts/gpu_check.sh first` (its large-size checks).
    # The same run passed every entry above again (same fingerprints, an sm_90 GPU like the H100: the entries above
    # cover it already) and verified these paths for the first time; the 16-bit products of the torch backend in
    # the dtypes they serve.
    {"backend": "torch", "op": "similarity_xent", "path": "mixed", "fingerprint": "b33166b630c71c45",
     "dtypes": ["bfloat16", "float16"], **_H200},
    {"backend": "triton", "op": "pair_scores", "path": "dims_one_read", "fingerprint": "fdceae6baa083c7a",
     "dtypes": _EVERY_DTYPE, **_H200, "triton": "3.6"},
    {"backend": "triton", "op": "similarity_xent", "path": "dense_dims", "fingerprint": "baec28435cd67c56",
     "dtypes": _EVERY_DTYPE, **_H200, "triton": "3.6"},
    # The same H200, sources at 14e83fd with 40ac9b5's fix of the checks' selection: `scripts/gpu_check.sh first
    # --skip triton_tests,headline` (its large-size checks of the paths above left out): the CUDA backend's rewritten
    # kernels and its dense scheme, and the Triton similarity_lse dense scheme.
    {"backend": "triton", "op": "similarity_lse", "path": "dense", "fingerprint": "81a85b600be697cc",
     "dtypes": _EVERY_DTYPE, **_H200_CHECKS, "triton": "3.6"},
    {"backend": "cuda", "op": "pair_scores", "path": "full", "fingerprint": "6a8db345bda6e7d2",
     "build": "f2009f8c30ce51fb", "dtypes": _EVERY_DTYPE, **_H200_CHECKS, "cuda": "13.0"},
    {"backend": "cuda", "op": "pair_scores", "path": "dims", "fingerprint": "827753944930c13a",
     "build": "f2009f8c30ce51fb", "dtypes": _EVERY_DTYPE, **_H200_CHECKS, "cuda": "13.0"},
    {"backend": "cuda", "op": "ranking_loss", "path": "sort", "fingerprint": "4b85a09f9216361e",
     "build": "d5b614b1855acd82", "dtypes": _RANKING_DTYPES, **_H200_CHECKS, "cuda": "13.0"},
    {"backend": "cuda", "op": "similarity_xent", "path": "dense", "fingerprint": "abc9b7c6cb7c3b46",
     "build": "41fc678dc111ff10", "dtypes": _EVERY_DTYPE, **_H200_CHECKS, "cuda": "13.0"},
    {"backend": "cuda", "op": "similarity_xent", "path": "dense_dims", "fingerprint": "8f6f75b12223eca5",
     "build": "41fc678dc111ff10", "dtypes": _EVERY_DTYPE, **_H200_CHECKS, "cuda": "13.0"},
    {"backend": "cuda", "op": "similarity_lse", "path": "dense", "fingerprint": "6711b448b53e809c",
     "build": "e218dc84321aba71", "dtypes": _EVERY_DTYPE, **_H200_CHECKS, "cuda": "13.0"},
    # The same H200 on 2026-12-04, sources at 97c3de1: `scripts/gpu_check.sh first --skip triton_tests,headline`
    # (its large-size checks of the paths above left out): similarity_lse with dims, whose float32 cases had failed
    # by their own float32 ties on 2026-11-28 (mended since: cosines exact in every dtype).
    {"backend": "triton", "op": "similarity_lse", "path": "dense_dims", "fingerprint": "b409e85b230bf86a",
     "dtypes": _EVERY_DTYPE, **_H200_DIMS, "triton": "3.6"},
    {"backend": "triton", "op": "similarity_lse", "path": "fused_prefixes", "fingerprint": "09b0e7b72e8d98c5",
     "dtypes": _EVERY_DTYPE, **_H200_DIMS, "triton": "3.6"},
    {"backend": "cuda", "op": "similarity_lse", "path": "dense_dims", "fingerprint": "6711b448b53e809c",
     "build": "e218dc84321aba71", "dtypes": _EVERY_DTYPE, **_H200_DIMS, "cuda": "13.0"},
)

MATCH_FIELDS = {
    "triton": ("capability", "torch", "triton", "fingerprint"),
    "cuda": ("capability", "torch", "cuda", "fingerprint", "build"),
    "torch": ("capability", "torch", "fingerprint"),
}
# The fields that say which code passed (the others say where it ran).
CODE_FIELDS = {"triton": ("fingerprint",), "cuda": ("fingerprint", "build"), "torch": ("fingerprint",)}
# The backends with GPU code paths that need a verification (the torch backend: its 16-bit products on a GPU).
GPU_BACKENDS = tuple(MATCH_FIELDS)
# The one path of a backend that computes anywhere without a verification: the torch backend's default arithmetic
# (products in float32 or float64, the same formulas on every device), which the CPU test suite verifies end to end.
ALWAYS_ALLOWED = {"torch": "default"}


def needs_verification(backend: str, path: str) -> bool:
    """Whether `backend`'s code path must be verified (or pass a first-use check) before "auto" computes with it on a
    GPU: every GPU backend's path but ALWAYS_ALLOWED's."""
    return ALWAYS_ALLOWED.get(backend) != path


# ---------------------------------------------------------------------------------------------------------
# This process's identity
# ---------------------------------------------------------------------------------------------------------
def _major_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def code_identity(backend: str, op: str, path: str) -> dict:
    """The CODE_FIELDS of this installation's code for a path (cuda: as the loaded extension reports its build;
    None when no extension is loaded)."""
    ident = {"fingerprint": fingerprints.path_fingerprint(backend, op, path)}
    if backend == "cuda":
        from .cuda_ops import _extension

        ident["build"] = (_extension.build_fingerprints() or {}).get(fingerprints.csrc_source(op, path))
    return ident


def identity(backend: str, op: str, path: str, device: torch.device) -> dict:
    """This process's values of MATCH_FIELDS[backend] for a code path on the CUDA `device`, plus the GPU's name."""
    ident = {"capability": _capability(device), "torch": _major_minor(torch.__version__),
             "gpu": torch.cuda.get_device_name(device), **code_identity(backend, op, path)}
    if backend == "triton":
        import triton

        ident["triton"] = _major_minor(triton.__version__)
    elif backend == "cuda":
        ident["cuda"] = torch.version.cuda
    return ident


def _capability(device: torch.device) -> str:
    return ".".join(map(str, torch.cuda.get_device_capability(device)))


# ---------------------------------------------------------------------------------------------------------
# Entries, the cache, the rule
# ---------------------------------------------------------------------------------------------------------
def entry(backend: str, op: str, path: str, ident: dict, evidence: str, dtypes=(), sizes: str = "standard") -> dict:
    """A verification: what passed (backend, op, path), where (`ident`), when, at which sizes ("large": the
    project's GPU run; "standard": `python -m angle_kernels.verify`'s default), and what shows it."""
    fields = {name: ident.get(name) for name in MATCH_FIELDS[backend]}
    return {"backend": backend, "op": op, "path": path, **fields, "gpu": ident.get("gpu"),
            "dtypes": list(dtypes), "sizes": sizes, "date": datetime.date.today().isoformat(), "evidence": evidence}


def _same_path(candidate: dict, backend: str, op: str, path: str) -> bool:
    return (candidate.get("backend"), candidate.get("op"), candidate.get("path")) == (backend, op, path)


def covers(candidate: dict, backend: str, op: str, path: str, ident: dict) -> bool:
    """The match rule (module docstring)."""
    return _same_path(candidate, backend, op, path) and all(
        ident.get(name) is not None and candidate.get(name) == ident.get(name) for name in MATCH_FIELDS[backend])


def same_code(candidate: dict, backend: str, op: str, path: str, ident: dict) -> bool:
    """Whether an entry verified the code this identity runs for the path, wherever it ran (CODE_FIELDS)."""
    return _same_path(candidate, backend, op, path) and all(
        ident.get(name) is not None and candidate.get(name) == ident.get(name) for name in CODE_FIELDS[backend])


def read_cache() -> list[dict]:
    """The entries `python -m angle_kernels.verify` recorded in the user's cache."""
    return user_cache.read()["verified"]


def write_cache(passed: list[dict], failed: list[dict]) -> Path:
    """Record a verification run in the user's cache: `passed` entries replace the entries for the same (backend,
    op, path) and identity; the identities of `failed` entries lose theirs. Returns the cache file."""
    replaced = passed + failed

    def change(contents: dict) -> None:
        kept = [old for old in contents["verified"]
                if not any(covers(old, new["backend"], new["op"], new["path"], new) for new in replaced)]
        contents["verified"] = kept + passed

    user_cache.update(change)
    return user_cache.cache_file()


# Per process: the entries (table + cache, read at the first question), identities per (backend, op, path,
# device) and answers per (backend, op, path, device index). Plain dicts: after the first call of a kind, a lookup.
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


def identity_here(backend: str, op: str, path: str, device: torch.device) -> dict:
    """`identity`, asked once per process and (backend, op, path, device); a process that cannot tell it (a query
    that fails) gets an identity without the match fields, which matches nothing."""
    key = (backend, op, path, device.index)
    if key not in _identities:
        try:
            _identities[key] = identity(backend, op, path, device)
        except Exception as exc:  # noqa: BLE001 (a loss call must not fail on this question)
            _identities[key] = {"gpu": f"a GPU whose identity is unknown ({type(exc).__name__}: {exc})"}
    return _identities[key]


def is_verified(backend: str, op: str, path: str, device: torch.device) -> bool:
    """Whether a verification covers `backend`'s `op` on code path `path` on the CUDA `device` (always, for a path
    that needs none: ALWAYS_ALLOWED)."""
    if not needs_verification(backend, path):
        return True
    key = (backend, op, path, device.index)
    if key not in _answers:
        ident = identity_here(backend, op, path, device)
        _answers[key] = any(covers(e, backend, op, path, ident) for e in entries())
    return _answers[key]


def checked_elsewhere(backend: str, op: str, path: str, device: torch.device) -> bool:
    """Whether the code this process runs for the path passed the project's large-size checks on some GPU (an
    entry of VERIFIED with the same CODE_FIELDS): such a path may compute here after a first-use check."""
    ident = identity_here(backend, op, path, device)
    return any(e.get("sizes") == "large" and same_code(e, backend, op, path, ident) for e in VERIFIED)


def covers_every_path(backend: str, device: torch.device) -> bool:
    """Whether every code path of every op the backend implements is verified on the CUDA `device` (then
    backend="auto" computes everything there with it), but those no call takes until a GPU run has verified them
    (triton_ops.paths_awaiting_verification, cuda_ops.paths_awaiting_verification)."""
    awaiting = set()
    if backend in ("triton", "cuda"):
        awaiting = importlib.import_module(f"angle_kernels.{backend}_ops").paths_awaiting_verification()
    return all(is_verified(backend, op, path, device) for op, paths in paths_of(backend).items() for path in paths
               if (op, path) not in awaiting)


def describe(backend: str, op: str, path: str, device: torch.device) -> str:
    """The identity a verification of `backend`'s code path must match here, in words (for warnings)."""
    ident = identity_here(backend, op, path, device)
    if "capability" not in ident:
        return ident["gpu"]
    return f"{ident['gpu']} (sm_{ident['capability'].replace('.', '')}), " + ", ".join(
        f"{name} {ident[name]}" for name in MATCH_FIELDS[backend] if name != "capability")


def stale_entries(table=None) -> list[dict]:
    """The table's entries whose code fields no longer match this checkout's code: the path's fingerprint and, for
    cuda, the path's CUDA sources (fingerprints.csrc_source; where csrc/ is present)."""
    stale = []
    for e in VERIFIED if table is None else table:
        current = {"fingerprint": fingerprints.path_fingerprint(e["backend"], e["op"], e["path"])}
        if e["backend"] == "cuda":
            try:
                current["build"] = fingerprints.csrc_fingerprint(fingerprints.csrc_source(e["op"], e["path"]))
            except FileNotFoundError:  # an installation without csrc/: the loaded extension reports its build
                current["build"] = e.get("build")
        if not same_code(e, e["backend"], e["op"], e["path"], current):
            stale.append(e)
    return stale


def paths_of(backend: str) -> dict[str, tuple[str, ...]]:
    """op -> the code paths its module in the backend's package declares (PATHS; "default" where it declares
    none), for the ops it implements. The op's module is named after the op, or as the package's OP_MODULES
    names it (the Triton similarity_xent's: similarity_xent_paths)."""
    from . import contract

    package = importlib.import_module(f"angle_kernels.{backend}_ops")
    modules = getattr(package, "OP_MODULES", {})
    found = {}
    for op in contract.OPS:
        try:
            module = importlib.import_module(f"angle_kernels.{backend}_ops.{modules.get(op, op)}")
        except ModuleNotFoundError:
            continue
        found[op] = tuple(getattr(module, "PATHS", ("default",)))
    return found

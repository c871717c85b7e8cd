"""`--profile`: where the time of one optimizer step goes.

The step's code marks its phases with `with phase("loss"):`. Outside a profiled step a phase is a bare `yield`
(no synchronisation, no timer); inside `profiling(device)` each phase synchronises the GPU at both ends, adds its
wall time to its name, and is also a `torch.profiler.record_function` range, so the same names show in a
torch.profiler or Nsight Systems trace. The phases of one optimizer step (every batch of --grad-accum, every chunk
of --chunk-size):

    data                 cut the batch, pad it, copy it to the device
    encoder forward      embed the texts (the gradient cache: without a graph)
    all-gather           join every process's embeddings and labels (forward only: its backward is in "loss")
    loss                 the loss on all embeddings, forward and backward to the embeddings
    encoder re-forward   the gradient cache only: embed each chunk again, with a graph, replaying its dropout
    encoder backward     backpropagate the embeddings' gradients through the encoder (DDP's all-reduce included)
    optimizer            unscale, gradient norm, clipping, AdamW, schedule, zero the gradients

The synchronisations serialise work the GPU would overlap, so a profiled step is a little slower than the others:
its shares are what to read, not its total.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

import torch

from .atomic_files import written_aside

PHASES = ("data", "encoder forward", "all-gather", "loss", "encoder re-forward", "encoder backward", "optimizer")

_active: StepProfile | None = None


class StepProfile:
    """Seconds and calls per phase of one profiled step."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.total = 0.0

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.calls[name] = self.calls.get(name, 0) + 1

    def rows(self) -> list[tuple[str, float, int]]:
        """(phase, seconds, calls) in step order, then the time no phase covers."""
        rows = [(name, self.seconds[name], self.calls[name]) for name in PHASES if name in self.seconds]
        rows.append(("other", max(0.0, self.total - sum(self.seconds.values())), 0))
        return rows

    def table(self, step: int) -> str:
        lines = [f"profile of step {step}: {self.total * 1e3:.1f} ms", f"{'phase':<20} {'ms':>10} {'share':>7} calls"]
        for name, seconds, calls in self.rows():
            share = seconds / self.total if self.total > 0 else 0.0
            lines.append(f"{name:<20} {seconds * 1e3:>10.1f} {share:>6.1%} {calls or '':>5}")
        return "\n".join(lines)

    def to_dict(self, step: int, **settings) -> dict:
        return {"step": step, "total_s": self.total, **settings,
                "phases": {name: {"seconds": seconds, "share": seconds / self.total if self.total > 0 else 0.0,
                                  "calls": calls} for name, seconds, calls in self.rows()}}

    def save(self, path: str, step: int, **settings) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with written_aside(path, encoding="utf-8") as f:
            json.dump(self.to_dict(step, **settings), f, indent=2)
            f.write("\n")


@contextlib.contextmanager
def phase(name: str):
    """Time the block as `name` when a step is being profiled; do nothing otherwise."""
    profile = _active
    if profile is None:
        yield
        return
    if name not in PHASES:
        raise ValueError(f"unknown phase {name!r}; the phases are {PHASES}")
    with torch.profiler.record_function(name):
        profile.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            profile.synchronize()
            profile.add(name, time.perf_counter() - start)


@contextlib.contextmanager
def profiling(device: torch.device, enabled: bool = True):
    """Inside (when enabled), phases are timed into the StepProfile it yields (None when not enabled)."""
    global _active
    if not enabled:
        yield None
        return
    if _active is not None:
        raise RuntimeError("a step is already being profiled")
    _active = profile = StepProfile(device)
    profile.synchronize()
    start = time.perf_counter()
    try:
        yield profile
    finally:
        profile.synchronize()
        profile.total = time.perf_counter() - start
        _active = None

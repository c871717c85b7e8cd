"""What the training loop does when a step or the machine fails (angle_train/README.md, "When things go wrong").

    non-finite step   a step whose embeddings, loss or gradient norm are not finite is skipped: no optimizer
                      update, the learning-rate schedule does not advance, its batches count as consumed; after
                      --max-bad-steps skips in a row (or at its last step, where no step of the run was taken)
                      the run stops with NonFiniteTrainingError (status 3 from the CLI), naming the last good
                      checkpoint: the newest one a finite step was taken from, which pruning keeps beyond
                      --keep-checkpoints (checkpoint.prune_checkpoints; the newer ones hold the weights that
                      failed, which the update before them may have made finite but huge).
                      Every process agrees (any_rank): one rank's NaN skips the step everywhere. No checkpoint or
                      export is written from non-finite weights (check_finite_weights).
    no dev score      a dev evaluation whose embeddings hold NaN or Inf (weights grown until the forward pass
                      overflows: finite themselves), or whose Spearman is undefined (cosines all equal), is never
                      a best model (trainer.improves), the first evaluation included; the log says why
                      (trainer.report_unscored) and the run goes on, its non-finite steps skipped as above.
    SIGTERM / SIGINT  StopSignals records the first signal (SIGHUP too, unless ignored: nohup); the loop finishes
                      the optimizer step in progress, writes a checkpoint and raises Preempted (status
                      EXIT_PREEMPTED = 75 from the CLI, "try again": resume with --resume auto). Every process
                      stops at the same step (any_rank). A second signal ends the process at once with the
                      signal's default action (a repeat of the first within StopSignals.SAME_REQUEST_S is the
                      same request, a SIGINT only under torchrun); the checkpoint folders are written as NAME.tmp
                      and renamed when complete, so nothing half-written is ever taken for a checkpoint. A signal
                      during the final export abandons it (final/ is written as final.tmp and swapped in once
                      complete, so no half export is left) and writes a checkpoint of the last step instead:
                      --resume auto then only exports.
    out of memory     the error names the batch, the texts per forward pass, the sequence length and what to
                      change (oom_message); with --auto-chunk the step is retried with half the chunk size
                      (the gradient cache makes the gradients independent of the chunk size). On a GPU that is
                      torch.OutOfMemoryError; on the CPU an allocation the allocator refuses (a RuntimeError:
                      is_out_of_memory), where the system lets it fail rather than ending the process (Linux's
                      overcommit and its out-of-memory killer often end the process first, which nothing inside
                      it can catch).
    full disk, damaged checkpoints: checkpoint.py.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time

import torch

EXIT_NON_FINITE = 3
EXIT_PREEMPTED = 75  # sysexits' EX_TEMPFAIL: a temporary failure, the caller is invited to try again (resume)


class NonFiniteTrainingError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient norm."""


class Preempted(RuntimeError):
    """The run stopped on SIGTERM / SIGINT / SIGHUP after writing a checkpoint to resume from."""

    def __init__(self, signal_name: str, checkpoint: str):
        super().__init__(f"stopped by {signal_name} after writing checkpoint {checkpoint}: resume with --resume auto "
                         "(or --resume PATH) and the same settings")
        self.signal_name, self.checkpoint = signal_name, checkpoint


def any_rank(flag: bool, dist_info, device: torch.device) -> bool:
    """Whether `flag` holds on any process (every process must call this at the same point)."""
    if not dist_info.enabled:
        return flag
    import torch.distributed as dist

    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def is_finite_step(loss: float, grad_norm: float, loss_scaling: bool) -> bool:
    """A step may update the weights: a finite loss, and a finite gradient norm unless fp16 loss scaling is on
    (then an overflowing gradient is the scaler's to handle: it skips the update and lowers the scale)."""
    return math.isfinite(loss) and (loss_scaling or math.isfinite(grad_norm))


class SkipNonFiniteEmbeddings:
    """The run's loss, which in training treats NaN/Inf embeddings (an fp16 activation overflow in the encoder on
    one bad batch, the usual cause) as a non-finite step: the loss is NaN, so the step is skipped and counts toward
    --max-bad-steps, where the loss's own input check would stop the run with a ValueError (which it keeps for
    direct callers). Called on every process's gathered embeddings, so every process decides alike. `seen`: the
    embeddings of the step in progress were not finite (reset by the loop before each step)."""

    def __init__(self, loss_fn):
        self.loss_fn, self.seen = loss_fn, False

    def __call__(self, labels, embeddings):
        if not bool(torch.isfinite(embeddings).all()):
            self.seen = True
            return embeddings.sum() * float("nan")  # NaN, with a graph: both backward passes run as usual
        return self.loss_fn(labels, embeddings)


def check_finite_weights(module: torch.nn.Module | None, what: str, *, state_dict: dict | None = None,
                         dist_info=None) -> None:
    """Refuse to write `what` (a checkpoint, an export) from a module holding a NaN or Inf trainable weight (or
    from a state_dict holding one). With dist_info, every process checks its own shards of a sharded (--fsdp)
    module and all of them refuse if any one finds one (every process must call it then)."""
    from .sharding import local_value

    if state_dict is not None:
        tensors = ((name, value) for name, value in state_dict.items() if value.is_floating_point())
    else:
        tensors = ((name, p) for name, p in module.named_parameters() if p.requires_grad)
    bad = next((name for name, value in tensors if not bool(torch.isfinite(local_value(value)).all())), None)
    if dist_info is not None and dist_info.enabled:
        import torch.distributed as dist

        names = [None] * dist_info.world_size
        dist.all_gather_object(names, bad)
        bad = next((name for name in names if name), None)
    if bad is not None:
        raise ValueError(f"refusing to write {what}: the trainable weight {bad} holds NaN or Inf values. The "
                         "earlier checkpoints are untouched; resume from the last one with a lower --lr")


class Interrupted(Exception):
    """A first SIGTERM / SIGINT inside StopSignals.interrupting(): the work there is abandoned at once."""


class StopSignals:
    """Inside the context, SIGTERM, SIGINT and SIGHUP set `requested` (the first signal's name) instead of ending
    the process (a SIGHUP ignored on entry, as nohup leaves it, stays ignored); a second one ends it at once,
    whatever handlers were installed before: SIGINT raises KeyboardInterrupt (Python's own behaviour), SIGTERM and
    SIGHUP take their default action (the process terminates).
    Inside `interrupting()` (the final export: long, and not worth finishing when a checkpoint resumes the run
    as well) the first signal raises Interrupted there and then. Once the run is complete (`complete()`: every step
    done and the final model, if any, in place) a first signal only says so: there is nothing left to checkpoint, and
    the run ends as it would have. A repeat of the first signal within SAME_REQUEST_S seconds is that request again,
    not a second one (a SIGINT only in a torchrun worker: elsewhere it is a second Ctrl-C). Outside the main thread
    (where Python cannot install handlers) a no-op."""

    # SIGHUP: a closed terminal or ssh session. torchrun passes it on to its processes, even when started with nohup
    # (its own handler replaces nohup's ignoring): they ended at once, with no checkpoint (none at all with the
    # default --save-every 0)
    SIGNALS = (signal.SIGTERM, signal.SIGINT) + ((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ())
    # A scheduler that signals every process of a job (Slurm's time limit and scancel, systemd's stop) reaches each
    # torchrun worker twice, directly and as torchrun passes it on, milliseconds apart: taken for a second signal, the
    # copy ended every worker mid-step and no checkpoint was written. A person sending it again to stop at once does so
    # after reading the first line; torchrun turns a second Ctrl-C into SIGTERM, another signal, which stops at once.
    SAME_REQUEST_S = 2.0
    # SIGINT is the keyboard's: a terminal sends it once to the processes in its foreground, and a second Ctrl-C is
    # a person's "stop now", however soon it comes. Only a torchrun worker (set by torchrun: TORCHELASTIC_RUN_ID) gets
    # copies of it, from a scheduler told to send it (Slurm's --signal=INT) and as torchrun passes it on; the keyboard's
    # reaches torchrun alone (its workers run in their own session), and it turns a second one into SIGTERM
    LAUNCHER_ENV = "TORCHELASTIC_RUN_ID"

    def __init__(self) -> None:
        self.requested: str | None = None
        self._requested_at = 0.0  # time.monotonic() of the first signal
        self._previous: dict = {}
        self._interrupting = False
        self._completed: str | None = None  # what the complete run left (complete())

    @contextlib.contextmanager
    def interrupting(self):
        """Inside: a first signal (or one that came before) raises Interrupted."""
        if self.requested is not None:
            raise Interrupted(self.requested)
        self._interrupting = True
        try:
            yield
        finally:
            self._interrupting = False

    def complete(self, what: str) -> None:
        """The run is complete (`what`: where its result is, for the message): a first signal from now on says so
        instead of promising a checkpoint."""
        self._completed = what

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS
                              if sig in (signal.SIGTERM, signal.SIGINT) or signal.getsignal(sig) != signal.SIG_IGN}
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None and issubclass(exc_type, Preempted) and self.requested is not None:
            self._absorb_late_copies()
        else:
            self._restore()

    def _absorb_late_copies(self) -> None:
        """Leaving on a preemption (the checkpoint written): the earlier handlers are back, but for the first
        signal's, whose copies may still be on their way (a launcher's, up to SAME_REQUEST_S late): a copy took the
        earlier handler's action (SIGTERM's default: exit status 143, not EXIT_PREEMPTED: a wrapper that requeues on
        75 lost the run). A copy within the window is the same request, said in a line; anything else puts the
        earlier handler back and takes its action, as if it had been back all along."""
        signum = signal.Signals[self.requested]
        earlier = self._previous.pop(signum, None)
        self._restore()
        if earlier is None:
            return

        def late(number, frame) -> None:
            if self._said_same_request(signal.Signals(number).name):
                return
            signal.signal(number, earlier)
            if callable(earlier):
                earlier(number, frame)
            elif earlier == signal.SIG_DFL:
                signal.raise_signal(number)

        signal.signal(signum, late)

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _said_same_request(self, name: str) -> bool:
        """Whether the signal `name` repeats the first one within SAME_REQUEST_S, as a copy of it does (a SIGINT only
        in a torchrun worker: LAUNCHER_ENV); if so, said in a line."""
        if not (name == self.requested and (name != "SIGINT" or self.LAUNCHER_ENV in os.environ)
                and time.monotonic() - self._requested_at < self.SAME_REQUEST_S):
            return False
        print(f"\n{name} again within {self.SAME_REQUEST_S:g} s: taken as the same request (a launcher such as "
              "torchrun passes on the signal this process got too); send it again later to stop at once", flush=True)
        return True

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self._said_same_request(name):
            return
        if self.requested is not None:
            print(f"\n{name} again: stopping at once (the last complete checkpoint is intact)", flush=True)
            self._restore()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        self.requested, self._requested_at = name, time.monotonic()
        if self._completed is not None:
            print(f"\n{name}: the run is complete ({self._completed}); nothing left to checkpoint, finishing up (send "
                  "it again to stop at once)", flush=True)
            return
        if self._interrupting:
            print(f"\n{name}: abandoning the final export, writing a checkpoint and stopping (send it again to stop "
                  "at once)", flush=True)
            raise Interrupted(name)
        print(f"\n{name}: finishing this optimizer step, then writing a checkpoint and stopping "
              f"(send it again to stop at once)", flush=True)


def ignore_stop_signals_while_exiting() -> None:
    """After a preemption, in a process that ends with EXIT_PREEMPTED: SIGTERM, SIGINT and SIGHUP are ignored from here
    to its end. A late copy of the signal (a launcher's) is the same request, but Python's finalization puts back
    the default action of every signal with a Python handler (StopSignals' included), and a copy arriving then
    terminated the process (status 143, not 75: a wrapper that requeues on 75 lost the run); an ignored signal stays
    ignored. The checkpoint is written: nothing is left to stop."""
    if threading.current_thread() is threading.main_thread():
        for sig in StopSignals.SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


# What the allocators that report a failed allocation as a plain RuntimeError say (torch.OutOfMemoryError is CUDA's).
OUT_OF_MEMORY_MARKERS = ("DefaultCPUAllocator: can't allocate memory", "MPS backend out of memory")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` reports memory running out: torch.OutOfMemoryError, or the CPU's (or Apple GPU's) RuntimeError."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in OUT_OF_MEMORY_MARKERS))


def oom_message(cfg, step: int, per_pass: int, rows: int) -> str:
    """What ran out of memory and what to change (per_pass: the per-pass budget, tokens with --chunk-tokens)."""
    mode = (f"the gradient cache with --chunk-tokens {cfg.chunk_tokens}" if cfg.chunk_tokens else
            f"the gradient cache with --chunk-size {cfg.chunk_size}" if cfg.chunk_size
            else "plain backprop (--chunk-size 0: the whole batch's activations at once)")
    unit = "tokens" if cfg.chunk_tokens else "texts"
    return (f"out of memory in optimizer step {step + 1}: --batch-size {cfg.batch_size} pairs ({rows} texts on this "
            f"process, {per_pass} {unit} per forward pass), --max-length {cfg.max_length}, {mode}. To fit: a "
            "smaller --chunk-size or --chunk-tokens (with the gradient cache memory follows the chunk, not the batch), "
            "--gradient-checkpointing 1, a shorter --max-length, or --auto-chunk 1 to halve the chunk size and "
            "retry the step automatically")

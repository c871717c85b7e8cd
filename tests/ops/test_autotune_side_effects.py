"""Autotuning's side effects: the first call of a new autotune key must give what one launch gives.

On a GPU, the first call of `triton.autotune` for a key runs every config several times on the very buffers of
the call, then resets the declared buffers once more and launches the chosen config for the result
(triton/runtime/autotuner.py, `Autotuner.run` and `_bench`: before each run its pre_hook zeroes `reset_to_zero`
and copies `restore_value`, after it the post_hook copies `restore_value` back). A kernel that adds into a
zeroed buffer without declaring it returns the sum of all those runs. The interpreter runs one config once, so
such a kernel passes every interpreter test: the Matryoshka (`dims`) backward of similarity_xent did, until its
launches declared their buffers.

Here every autotuned kernel (`_common.TunedKernel`) of each op is swapped for autotune_replay.ReplayedAutotuner,
which replays that sequence under the interpreter from the declarations triton.autotune itself receives
(`TunedKernel.tuning`): each config of the kernel's GPU list, RUNS_PER_CONFIG times, then the reset and the launch
of the last config. The result must equal a plain launch's. On a CUDA device the kernels get real autotuners over
every config instead (fresh ones, so every key is new, whatever ANGLE_KERNELS_AUTOTUNE says).
"""

from __future__ import annotations

import pytest
import torch

from angle_kernels.testing.helpers import TRITON_DEVICE, backend_or_skip

pytest.importorskip("triton")

from angle_kernels.triton_ops import _common  # noqa: E402
from angle_kernels.triton_ops import similarity_xent as xent_module  # noqa: E402
from autotune_replay import RUNS_PER_CONFIG, ReplayedAutotuner, install, like_a_first_call  # noqa: E402

# ----------------------------------------------------------------------------------------------------------
# The scenarios: every autotuned kernel of similarity_xent (full width, dims) and similarity_lse, forward and
# backward. Each returns the outputs and the gradients of its leaves.
# ----------------------------------------------------------------------------------------------------------
def _leaves(gen, *shapes, device, dtype):
    return [torch.randn(shape, generator=gen, dtype=torch.float64).to(device, dtype).requires_grad_()
            for shape in shapes]


def _backward(outputs, leaves, gen):
    weights = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device, o.dtype) for o in outputs]
    sum((o * w).sum() for o, w in zip(outputs, weights)).backward()
    return [o.detach() for o in outputs] + [leaf.grad for leaf in leaves]


def in_batch_negatives(ops, gen, device, dtype):
    (q,) = _leaves(gen, (24, 16), device=device, dtype=dtype)
    groups = torch.randint(0, 8, (24,), generator=gen).to(device)
    weights = (torch.rand(24, generator=gen) > 0.2).to(device, torch.float64 if dtype == torch.float64 else
                                                          torch.float32)
    loss = ops.similarity_xent(q, None, 20.0, "partner", row_weights=weights, exclude_diagonal=True,
                               group_ids=groups)
    return _backward([loss], [q], gen)


def contrastive_with_margin(ops, gen, device, dtype):
    q, c = _leaves(gen, (20, 16), (28, 16), device=device, dtype=dtype)
    return _backward([ops.similarity_xent(q, c, 20.0, "diagonal", margin=0.2)], [q, c], gen)


def matryoshka_in_batch(ops, gen, device, dtype):
    (q,) = _leaves(gen, (24, 24), device=device, dtype=dtype)
    losses = ops.similarity_xent(q, None, 20.0, "partner", exclude_diagonal=True, dims=(8, 16, 24))
    return _backward([losses], [q], gen)


def matryoshka_contrastive(ops, gen, device, dtype):
    q, c = _leaves(gen, (20, 24), (28, 24), device=device, dtype=dtype)
    return _backward([ops.similarity_xent(q, c, 20.0, "diagonal", margin=0.1, dims=(8, 24))], [q, c], gen)


def lse_with_filter_and_penalty(ops, gen, device, dtype):
    q, c = _leaves(gen, (20, 16), (30, 16), device=device, dtype=dtype)
    threshold = torch.full((20,), 0.3, dtype=torch.float64 if dtype == torch.float64 else torch.float32,
                           device=device)
    lse = ops.similarity_lse(q, c, 20.0, target_offset=0, period=10, exclude="none", penalty=1.5,
                             penalty_on="other", filter_q=q.detach(), filter_c=c.detach(),
                             filter_threshold=threshold, filter_keeps_target=True)
    return _backward([lse], [q, c], gen)


SCENARIOS = [in_batch_negatives, contrastive_with_margin, matryoshka_in_batch, matryoshka_contrastive,
             lse_with_filter_and_penalty]
DTYPES = [torch.float64] if TRITON_DEVICE.type == "cpu" else [torch.float64, torch.float32, torch.bfloat16]


def _run(scenario, ops, dtype, seed=0):
    return scenario(ops, torch.Generator().manual_seed(seed), TRITON_DEVICE, dtype)


def _max_rel_diff(got: list, want: list) -> float:
    return max(float((g.double() - w.double()).norm() / w.double().norm().clamp_min(1e-30)) for g, w in zip(got, want))


# Different configs sum in different orders; a missed reset is off by a factor of about 10.
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__)
def test_a_first_call_gives_what_one_launch_gives(scenario, dtype, monkeypatch):
    ops = backend_or_skip("triton").ops
    once = _run(scenario, ops, dtype)
    installed = install(monkeypatch, like_a_first_call)
    tuned = _run(scenario, ops, dtype)
    assert _max_rel_diff(tuned, once) <= TOLERANCE[dtype]
    if TRITON_DEVICE.type == "cpu":  # the replay really ran every config several times
        ran = [t.launcher.launches for t in installed if t.launcher.launches]
        assert ran and all(n == len(t.configs) * RUNS_PER_CONFIG + 1 for t, n in zip(
            [t for t in installed if t.launcher.launches], ran))


@pytest.mark.skipif(TRITON_DEVICE.type != "cpu", reason="the replay runs under the interpreter")
def test_the_replay_catches_an_undeclared_accumulation(monkeypatch):
    """Without their declarations the dims backward kernels return about ten runs' sum: the replay must see it
    (else the test above proves nothing)."""
    ops = backend_or_skip("triton").ops
    declared = [t for _, kernels in xent_module._PREFIX_TUNED.items() for t in kernels if t.tuning.reset_to_zero]
    assert declared, "the dims backward kernels no longer declare their zeroed buffers"
    once = _run(matryoshka_in_batch, ops, torch.float64)
    install(monkeypatch, lambda t: t._replace(launcher=ReplayedAutotuner(t._replace(tuning=_common.Tuning()))))
    replayed = _run(matryoshka_in_batch, ops, torch.float64)
    assert _max_rel_diff(replayed[:1], once[:1]) <= 1e-12  # the forward writes without reading: unaffected
    assert _max_rel_diff(replayed[1:], once[1:]) > 1.0  # the gradient is a sum of runs

"""The interpreter's skipped repatching (angle_kernels.testing.triton_interpreter) is on wherever the suite interprets
the kernels, skips what it says, and changes no value: outputs and gradients equal bit for bit with Triton's own
repatching, on kernels whose helpers are called in loops and from other modules (the one-read pair scores of every
prefix, the fused similarity_xent)."""

from __future__ import annotations

import pytest
import torch

from angle_kernels.testing import triton_interpreter
from angle_kernels.testing.helpers import TRITON_DEVICE, generator, outputs_and_grads, randn

pytest.importorskip("triton")
if TRITON_DEVICE.type != "cpu":
    pytest.skip("the kernels run compiled here: there is no interpreter", allow_module_level=True)

import triton.runtime.interpreter as interpreter  # noqa: E402

from angle_kernels.triton_ops._pair_scores_one_read import pair_scores as pair_scores_one_read  # noqa: E402
from angle_kernels.triton_ops.similarity_xent import similarity_xent  # noqa: E402


def test_the_suite_interprets_with_the_skip_on():
    """A Triton whose interpreter no longer has the functions the skip wraps switches it off (and the suite slows by a
    quarter or more): this says so."""
    assert triton_interpreter.is_skipping(), (
        "angle_kernels.testing.triton_interpreter could not wrap this Triton's interpreter: adapt it to "
        "triton.runtime.interpreter's _patch_lang and GridExecutor, or remove it")


def _one_read_pair_scores(x):
    return pair_scores_one_read(x, True, (4, 10, 22))


def _fused_xent(q):
    return similarity_xent(q, None, 20.0, "partner")


CALLS = {  # name: (function, input shape)
    "pair_scores_one_read": (_one_read_pair_scores, (3, 2, 22)),
    "similarity_xent": (_fused_xent, (6, 16)),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_no_value_changes(name):
    function, shape = CALLS[name]
    x = randn(generator("interpreter", name), *shape, dtype=torch.float32).requires_grad_()
    outputs, grads = outputs_and_grads(function, [x])
    with triton_interpreter.repatching_inside_kernels():
        assert not triton_interpreter.is_skipping()
        triton_outputs, triton_grads = outputs_and_grads(function, [x])
    assert triton_interpreter.is_skipping()
    assert grads[0].abs().sum() > 0  # the backward kernels ran
    for ours, theirs in zip(outputs + grads, triton_outputs + triton_grads, strict=True):
        assert torch.equal(ours, theirs), name


def _patches_during(function, x, monkeypatch) -> int:
    """How many times triton.language is patched (the core module's part of a patch) while function runs."""
    count = [0]
    patch_core = interpreter._patch_lang_core

    def counted(*args, **kwargs):
        count[0] += 1
        return patch_core(*args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(interpreter, "_patch_lang_core", counted)
        outputs_and_grads(function, [x])
    return count[0]


def test_a_launch_patches_the_language_at_most_twice(monkeypatch):
    """With the skip, a launch (a forward and a backward kernel here) patches the language at its start, and once more
    at most: at the first helper whose module sees a language module its kernel's does not (tl.core beside tl).
    Without it, again at every helper call. (Counted: the patches of each module, tl and tl.core.)"""
    x = randn(generator("interpreter", "count"), 3, 2, 22, dtype=torch.float32).requires_grad_()
    skipping = _patches_during(_one_read_pair_scores, x, monkeypatch)
    with triton_interpreter.repatching_inside_kernels():
        repatching = _patches_during(_one_read_pair_scores, x, monkeypatch)
    assert 2 <= skipping <= 2 * 2 * 2  # two launches, two patches, two language modules
    assert repatching > 50 * skipping

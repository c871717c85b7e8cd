"""The package's warnings are filed under the line that called into it (angle_kernels.user_warnings), whatever the
package's and torch's frames in between: a loss's option checks, a module's forward through nn.Module's call, the
distributed gathering, a backward hook run by autograd. (The GPU dispatcher's and first-use checks' warnings are held
to the same in tests/test_backend_choice.py and tests/ops/test_first_use.py, the sentence-transformers drop-ins' in
tests/integrations.)"""

from __future__ import annotations

import warnings

import pytest
import torch

import angle_kernels as ak
from angle_kernels import contract, distributed, inputs, user_warnings

GRADED = torch.tensor([0.1, 0.5, 0.5, 0.9]).repeat_interleave(2)


@pytest.fixture(autouse=True)
def every_warning_unsaid(monkeypatch):
    """Each case warns afresh: the once-per-process warnings' memories emptied for the test."""
    monkeypatch.setattr(inputs, "_said_no_effect", set())
    monkeypatch.setattr(distributed, "_warned_not_distributed", False)
    monkeypatch.setattr(contract, "_warned_backward_inside_autocast", False)


def _caught(call) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [w for w in caught if "angle_kernels" in str(w.message) or "AngleLoss" in str(w.message)
            or "gather_across_devices" in str(w.message)]


def _here(caught: list[warnings.WarningMessage]) -> None:
    """One warning, filed under this file's line."""
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert caught[0].filename == __file__, f"{caught[0].filename}:{caught[0].lineno}: {caught[0].message}"


def test_an_option_without_effect_in_a_functional_loss():
    q, p = torch.randn(2, 8, 16).unbind(0)
    _here(_caught(lambda: ak.multiple_negatives_ranking_loss(q, p, hardness_strength=1.0)))


def test_an_option_without_effect_in_a_modules_forward():
    """Through nn.Module's __call__ (torch's frames) and the module's forward (the package's)."""
    loss = ak.AngleLoss(cosine_w=1.0, ibn_w=0.0, angle_w=1.0, dataset_format="A", false_negative_margin=0.1)
    caught = _caught(lambda: loss(GRADED, torch.randn(8, 16)))
    _here(caught)
    assert "false_negative_margin=0.1 has no effect" in str(caught[0].message)


def test_a_keyword_the_module_ignores():
    _here(_caught(lambda: ak.AngleLoss(cosine_w=1.0, ibn_w=0.0, angle_w=1.0, dataset_format="A", tua=3.0)))


def test_gathering_without_a_process_group():
    q, p = torch.randn(2, 8, 16).unbind(0)
    caught = _caught(lambda: ak.multiple_negatives_ranking_loss(q, p, gather_across_devices=True))
    _here(caught)
    assert "torch.distributed is not initialised" in str(caught[0].message)


def test_backward_called_inside_autocast():
    """Raised by a hook that autograd's engine runs: filed under the backward() call that ran it."""
    y = torch.randn(8, 16, requires_grad=True)
    loss = ak.cosine_loss(GRADED, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        caught = _caught(loss.backward)
    _here(caught)
    assert "called inside a torch.autocast region" in str(caught[0].message)


def test_the_helper_names_its_callers_line():
    def inside():
        user_warnings.warn("angle_kernels: a note", RuntimeWarning)

    caught = _caught(inside)
    _here(caught)
    assert caught[0].lineno == inside.__code__.co_firstlineno + 1 and caught[0].category is RuntimeWarning

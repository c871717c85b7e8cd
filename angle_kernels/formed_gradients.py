"""A scalar loss whose forward forms its input gradients: the schedule of similarity_xent's block-of-rows schemes.

The loss is a scalar, so a forward that holds a block of whole rows of logits knows their gradients for
grad_loss = 1 as soon as it has their logsumexps: it forms them right away when autograd will ask for them
(`gradients_wanted`), and backward only scales them by grad_loss (`GradientsFormedInForward`). Used by the torch
backend's similarity_xent (torch_ops/similarity_xent.py, and on the CPU torch_ops/_similarity_xent_softmax.py) and
the Triton backend's dense scheme (triton_ops/similarity_xent_dense.py).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable


def gradients_wanted(q: torch.Tensor, c: torch.Tensor | None) -> bool:
    """Whether autograd will ask for this call's gradients: grad mode on and an input that requires them."""
    return torch.is_grad_enabled() and (q.requires_grad or (c is not None and c.requires_grad))


class GradientsFormedInForward(torch.autograd.Function):
    """A scalar loss whose forward (a subclass's) formed its input gradients for grad_loss = 1 when with_grad,
    saved them (dq, dc or None) with ctx.with_grad and ctx.input_dtypes; backward scales them by grad_loss.
    The torch backend's similarity_xent and the triton backend's dense scheme share this contract."""

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        if not ctx.with_grad:  # the launchers pass with_grad = gradients_wanted(...) whenever autograd records
            raise RuntimeError("similarity_xent: forward ran without its gradients (with_grad=False), so it has no "
                               "backward")
        dq, dc = ctx.saved_tensors
        q_dtype, c_dtype = ctx.input_dtypes
        scale = grad_loss.to(dq.dtype)
        return ((dq * scale).to(q_dtype), None if dc is None else (dc * scale).to(c_dtype),
                None, None, None, None, None, None, None)

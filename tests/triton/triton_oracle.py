"""Float64 oracle for the Triton tests: a literal transcription of the op contract in
angle_kernels/dispatch.py (full matrices, no tricks), plus the error helpers the tests share."""

from __future__ import annotations

import math
import zlib

import torch

from angle_kernels.triton_ops._common import interpreting

EPS = 1e-12

# Where the kernels run: "cpu" (CPU tensors through the Triton interpreter) or "cuda" (interpreter off, a real
# GPU), as the root conftest.py chose through TRITON_INTERPRET. The oracle always runs on CPU.
DEVICE = "cpu" if interpreting() else "cuda"


def seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (||out|| when ref is zero); NaN stays NaN and fails every `<`."""
    out = out.detach().to(torch.float64).reshape(-1)
    ref = ref.detach().to(torch.float64).reshape(-1)
    assert out.shape == ref.shape
    scale = torch.linalg.vector_norm(ref)
    diff = torch.linalg.vector_norm(out - ref)
    return float(diff / scale) if scale > 0 else float(diff)


def pair_scores(x: torch.Tensor):
    """cos and angle of pairs (x[g, 0], x[g, k]), in the dtype of x (float64 for the oracle)."""
    u = x[:, :1, :]
    v = x[:, 1:, :]
    d = x.shape[-1]
    p = torch.linalg.vector_norm(u, dim=-1).clamp_min(EPS) * torch.linalg.vector_norm(v, dim=-1).clamp_min(EPS)
    dot = (u * v).sum(-1)
    cos = dot / p
    if d % 2:
        return cos, None
    h = d // 2
    a, b, c, dd = u[..., :h], u[..., h:], v[..., :h], v[..., h:]
    angle = (dot + (b * c).sum(-1) - (a * dd).sum(-1)) / p
    return cos, angle


def ranking_loss(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log(1 + sum_{label_i < label_j} exp(s_i - s_j)) from the full N x N difference matrix."""
    smaller = labels[:, None] < labels[None, :]
    diffs = (scores[:, None] - scores[None, :])[smaller]
    return torch.logsumexp(torch.cat([scores.new_zeros(1), diffs]), dim=0)


def margin_logit(cos_t: torch.Tensor, margin: float) -> torch.Tensor:
    """cos(min(arccos(cos_t) + margin, pi)) with sin(theta) = sqrt(max(1 - cos^2, 1e-6))."""
    sin_t = (1 - cos_t * cos_t).clamp_min(1e-6).sqrt()
    value = cos_t * math.cos(margin) - sin_t * math.sin(margin)
    past_pi = cos_t < -math.cos(margin)
    return torch.where(past_pi, -torch.ones_like(value), value)


def similarity_xent(q, c, scale, target, row_weights=None, exclude_diagonal=False, margin=0.0, group_ids=None):
    symmetric = c is None
    c = q if symmetric else c
    m, mc = q.shape[0], c.shape[0]
    qn = q / torch.linalg.vector_norm(q, dim=1, keepdim=True).clamp_min(EPS)
    cn = c / torch.linalg.vector_norm(c, dim=1, keepdim=True).clamp_min(EPS)
    cos = qn @ cn.T
    rows = torch.arange(m, device=q.device)  # on q's device: bench/gpu_suite.py runs it on CUDA as the eager baseline
    t = rows ^ 1 if target == "partner" else rows
    logits = scale * cos
    if margin != 0.0:
        logits = logits.clone()
        logits[rows, t] = scale * margin_logit(cos[rows, t], margin)
    columns = torch.ones(m, mc, dtype=torch.bool, device=q.device)
    if exclude_diagonal:
        columns[rows, rows] = False
    positives = torch.zeros(m, mc, dtype=torch.bool, device=q.device)
    positives[rows, t] = True
    if group_ids is not None:
        g = group_ids
        positives |= ((g[None, :] == g[:, None]) | (g[None, :] == g[t][:, None])) & columns
    lse_all = torch.logsumexp(logits.masked_fill(~columns, -math.inf), dim=1)
    lse_pos = torch.logsumexp(logits.masked_fill(~positives, -math.inf), dim=1)
    w = torch.ones(m, dtype=logits.dtype, device=q.device) if row_weights is None else row_weights.to(logits.dtype)
    return (w * (lse_all - lse_pos)).sum() / m


def torch_ops_or_none():
    """angle_kernels.torch_ops when it exists and imports, else None (the lead writes it in parallel)."""
    try:
        import angle_kernels.torch_ops as ops
    except Exception:  # noqa: BLE001
        return None
    return ops

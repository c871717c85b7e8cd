"""A CPU model of the CUDA pair-score prefix kernels (dims), checked against the float64 reference.

The kernels of csrc/pair_scores.cu's "Nested prefixes (dims)" section cannot run without a GPU. This file transcribes
their index arithmetic and reductions into Python loops over lanes, chunks and elements, in the kernels' compute
type (NumPy float32 for float32, float16 and bfloat16 inputs, float64 for float64), and checks what the model
computes against `angle_kernels.float64_ops.pair_scores` on the truncated inputs (float64): values, gradients, and
that the backward writes every element of dx exactly once. It is a model of the kernels, not a proof: it runs the
transcription, not the compiled code, so it cannot see a compiler's choices (FMA contraction, which the GPU applies
to `a * b + c` and the model rounds twice; NaN handling of fmaxf), memory-model errors (a missing __syncwarp, races
between teams), out-of-bounds addresses the model never forms, or a transcription that drifted from the kernel.
To keep the two in step, MIRRORED lists source lines of the kernels this model copies, and a test checks that each
still occurs in csrc/pair_scores.cu: editing one of them fails it until the model is read against the edit.

What each part mirrors (csrc/pair_scores.cu; line numbers as of this file's writing, the names stay):
    * `Chunk` (lines 725-752: W elements a lane takes at a position, a 16-byte vector on the vector path, one
      element on the general path) and the path choice: `use_dims_vector_path` (lines 1196-1205: the full path's
      use_vector_path without the angle, every prefix a multiple of V, or of 2V with the angle), `vector_team_log2`
      (lines 1092-1096) of d_k / W (lines 1219 and 1261): `_path` and `vector_team_log2` here.
    * `_pair_scores_dims_fwd_kernel` (lines 772-905): `_forward_pair`, line for line: the running totals and
      exponents per team, each slice's lanes starting at the totals' exponents, the positions base = lo / W + rank,
      base += T * kDimsSliceStep with the loads of a step before their use and zeros past the slice, the
      per-position raise_exponent and rescale, the team_max / pow2 / team_sum merge (xor butterflies as
      __shfl_xor_sync does them), the totals brought to the new exponents; the cross sweep at the prefix's final
      scales with kDimsCrossStep positions; finish_pair at [i, G, K-1].
    * `_pair_scores_dims_bwd_kernel` (lines 920-1067): `_backward_group`: per slice, the team's coefficients (A, B,
      C, sv_s per pair; r beta, t beta, sv_i per prefix and pair; su per prefix) as the lanes compute them with
      pair_coefficients; the positions of kDimsBwdStep chunks; du, dv per partner with the rotated terms of each
      prefix i >= s (twin chunk, sign); the stores (counted: each dx element once), the zeros past d_k.
    * common.cuh's row scaling (lines 78-139: row_exponent, pow2, raise_exponent, scaled_eps, inv_clamped_norm,
      inv_sq_norm_or_zero) and pair_scores.cu's finish_pair (lines 89-107) and pair_coefficients (lines 111-126):
      the helpers below of those names (class Acc, finish_pair, pair_coefficients).
    * from_acc: round-to-nearest-even to x's dtype (torch's conversion is the same rounding).

Not modelled: the launchers' grid (blocks, idle teams and warps that exit: an idle team sweeps nothing and writes
nothing, so each team is run on its own), the block size the backward's shared memory allows (it changes how many
teams share a block, not what a team computes), and the binding's checks.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from angle_kernels import float64_ops

KERNEL_FILE = Path(__file__).resolve().parents[2] / "csrc" / "pair_scores.cu"
EPS = 1e-12
WARP = 32
MIN_VECTORS_PER_LANE = 8  # kMinVectorsPerLane
SLICE_STEP, CROSS_STEP, BWD_STEP = 4, 2, 2  # kDimsSliceStep, kDimsCrossStep, kDimsBwdStep
VECTOR_WIDTH = {torch.float32: 4, torch.float64: 2, torch.float16: 8, torch.bfloat16: 8}  # Vec16<T>::kSize

# Lines of csrc/pair_scores.cu the model transcribes (whitespace-normalised): each must still be in the kernel file.
MIRRORED = (
    "for (int64_t base = lo / W + rank; base < end; base += static_cast<int64_t>(team) * kDimsSliceStep) {",
    "int exp_u = exp_u_total, exp_v = exp_v_total;",
    "const int64_t end = active ? hi / W : 0;",
    "const acc fu = pow2<acc>(exp_u_total - team_exp_u), fv = pow2<acc>(exp_v_total - team_exp_v);",
    "uu_total = uu_total * (fu * fu) + uu;",
    "const int64_t half_end = active ? half / W : 0;",
    "for (int64_t base = rank; base < half_end; base += static_cast<int64_t>(team) * kDimsCrossStep) {",
    "cross += (b[e] * su) * (c[e] * sv);",
    "cross -= (a[e] * su) * (d[e] * sv);",
    "finish_pair(static_cast<int64_t>(i) * num_pairs + pair, uu_total, vv_total, uv_total, cross, exp_u_total,",
    "const acc r = su_i / su_s, t = coef[4] / sv_s;",
    "sum_a += (r * t) * coef[0];",
    "sum_b += (r * r) * coef[2];",
    "sum_c += (t * t) * coef[3];",
    "rot[0] = r * coef[1];",
    "rot[1] = t * coef[1];",
    "for (int64_t base = lo / W + rank; base < end; base += static_cast<int64_t>(team) * kDimsBwdStep) {",
    "du[j][e] += coef_a * c[e] - coef_b * a[j][e];",
    "dv[e] = coef_a * a[j][e] - coef_c * c[e];",
    "const int64_t twin = first ? col[j] + half : col[j] - half;",
    "const acc sign = first ? acc(-1) : acc(1);",
    "du[j][e] += rb * (tv[e] * sv_i);",
    "dv[e] -= tb * (tu[e] * su_i);",
    "for (int64_t pos = lo / W + rank; pos < dim / W; pos += team) {",
    "if (widths.width[i] % (with_angle ? 2 * V : V) != 0) return false;",
    "const int log2_team = vector_team_log2(widths.width[widths.count - 1] / (vec ? Vec16<scalar_t>::kSize : 1));",
    "while (log2_team < 5 && (int64_t{2} << log2_team) * kMinVectorsPerLane <= row_vectors) ++log2_team;",
    "constexpr int kDimsSliceStep = 4;",
    "constexpr int kDimsCrossStep = 2;",
    "constexpr int kDimsBwdStep = 2;",
    "const acc inv_p = inv_clamped_norm(norm_u, scale_u) * inv_clamped_norm(norm_v, scale_v);",
    "const acc projection = gs * cos + ga * w;",
)


# ---------------------------------------------------------------------------------------------------------
# common.cuh: the compute type's row scaling and clamps
# ---------------------------------------------------------------------------------------------------------
class Acc:
    """The compute type of one input dtype: its NumPy type and the bias of its exponent."""

    def __init__(self, dtype: torch.dtype):
        self.np = np.float64 if dtype == torch.float64 else np.float32
        self.bias = 1023 if dtype == torch.float64 else 127
        self.tiny = self.np(np.finfo(self.np).tiny)
        self.zero, self.one = self.np(0), self.np(1)

    def row_exponent(self, largest) -> int:  # row_exponent: max(0, floor(log2 largest)), at most bias - 1
        if largest == 0:
            return 0
        exponent = int(np.frexp(largest)[1]) - 1
        return min(max(exponent, 0), self.bias - 1)

    def pow2(self, e: int):  # pow2: 2^e from its bits, 0 below the normal range
        return self.zero if e + self.bias <= 0 else self.np(np.ldexp(self.one, e))

    def raise_exponent(self, exponent: int, largest) -> tuple[int, object]:
        raised = max(exponent, self.row_exponent(largest))
        return (exponent, self.one) if raised == exponent else (raised, self.pow2(exponent - raised))

    def scaled_eps(self, scale):
        return max(scale * self.np(EPS), self.tiny)

    def inv_clamped_norm(self, norm, scale):
        return self.one / max(norm, self.scaled_eps(scale))

    def inv_sq_norm_or_zero(self, norm, scale):
        return self.one / (norm * norm) if norm > self.scaled_eps(scale) else self.zero


def team_sum(values: list) -> list:
    """__shfl_xor_sync butterflies over a team: every lane ends with the same sum, in the GPU's order."""
    team = len(values)
    offset = team // 2
    while offset > 0:
        values = [values[lane] + values[lane ^ offset] for lane in range(team)]
        offset //= 2
    return values


def team_max(values: list) -> list:
    team = len(values)
    offset = team // 2
    while offset > 0:
        values = [max(values[lane], values[lane ^ offset]) for lane in range(team)]
        offset //= 2
    return values


# ---------------------------------------------------------------------------------------------------------
# The launchers' choices
# ---------------------------------------------------------------------------------------------------------
def vector_team_log2(row_chunks: int) -> int:
    log2_team = 0
    while log2_team < 5 and (2 << log2_team) * MIN_VECTORS_PER_LANE <= row_chunks:
        log2_team += 1
    return log2_team


def _path(x: torch.Tensor, dims, with_angle: bool) -> tuple[bool, int, int]:
    """(vector path, W, team size) as the launchers choose them (x's storage taken as 16-byte aligned, as torch's
    allocations are; a strided view of it is checked by its strides)."""
    v = VECTOR_WIDTH[x.dtype]
    groups, _, dim = x.shape
    stride_g, stride_k, stride_d = x.stride()
    vec = (stride_d == 1 and dim % v == 0 and x.storage_offset() % v == 0 and stride_k % v == 0
           and (groups <= 1 or stride_g % v == 0)
           and all(d % (2 * v if with_angle else v) == 0 for d in dims))
    width = v if vec else 1
    return vec, width, 1 << vector_team_log2(dims[-1] // width)


# ---------------------------------------------------------------------------------------------------------
# finish_pair and pair_coefficients
# ---------------------------------------------------------------------------------------------------------
def finish_pair(acc: Acc, uu, vv, uv, cross, exp_u, exp_v, with_angle):
    """(cos, angle, stats[6]) of one pair from its reduced sums."""
    scale_u, scale_v = acc.pow2(-exp_u), acc.pow2(-exp_v)
    norm_u, norm_v = acc.np(np.sqrt(uu)), acc.np(np.sqrt(vv))
    inv_p = acc.inv_clamped_norm(norm_u, scale_u) * acc.inv_clamped_norm(norm_v, scale_v)
    cos = uv * inv_p
    w = cross * inv_p if with_angle else acc.zero
    angle = cos + w if with_angle else acc.zero
    return cos, angle, (norm_u, norm_v, cos, w, scale_u, scale_v)


def pair_coefficients(acc: Acc, stats, grad_cos, grad_angle, with_angle):
    """(alpha, beta, gamma_u, gamma_v, s_v) of one pair from its stats and output gradients."""
    norm_u, norm_v, cos, w, scale_u, scale_v = stats
    ga = grad_angle if with_angle else acc.zero
    gs = grad_cos + ga
    inv_p = acc.inv_clamped_norm(norm_u, scale_u) * acc.inv_clamped_norm(norm_v, scale_v)
    projection = gs * cos + ga * w
    return (gs * inv_p, ga * inv_p, projection * acc.inv_sq_norm_or_zero(norm_u, scale_u),
            projection * acc.inv_sq_norm_or_zero(norm_v, scale_v), scale_v)


# ---------------------------------------------------------------------------------------------------------
# The kernels, per team
# ---------------------------------------------------------------------------------------------------------
def _chunk(row: np.ndarray, pos: int, width: int, acc: Acc) -> list:
    """C::load + C::unpack at chunk position pos (elements pos*W .. pos*W + W - 1 of the row, in the compute type)."""
    return [acc.np(value) for value in row[pos * width:(pos + 1) * width]]


def _forward_pair(acc: Acc, u: np.ndarray, v: np.ndarray, dims, with_angle: bool, width: int, team: int) -> list:
    """_pair_scores_dims_fwd_kernel for one active team: [(cos, angle, stats)] per prefix."""
    lanes = range(team)
    uu_total = vv_total = uv_total = acc.zero
    exp_u_total = exp_v_total = 0
    out, lo = [], 0
    for hi in dims:
        uu, vv, uv = [acc.zero] * team, [acc.zero] * team, [acc.zero] * team
        exp_u, exp_v = [exp_u_total] * team, [exp_v_total] * team
        end = hi // width
        for rank in lanes:
            s_u, s_v = acc.pow2(-exp_u[rank]), acc.pow2(-exp_v[rank])
            for base in range(lo // width + rank, end, team * SLICE_STEP):
                raw = []
                for j in range(SLICE_STEP):  # all of a step's loads first, zeros past the slice
                    pos = base + j * team
                    zeros = [acc.zero] * width
                    raw.append((_chunk(u, pos, width, acc), _chunk(v, pos, width, acc)) if pos < end
                               else (zeros, zeros))
                for a, c in raw:
                    largest_u = largest_v = acc.zero
                    for e in range(width):
                        largest_u = max(largest_u, abs(a[e]))
                        largest_v = max(largest_v, abs(c[e]))
                    exp_u[rank], fu = acc.raise_exponent(exp_u[rank], largest_u)
                    exp_v[rank], fv = acc.raise_exponent(exp_v[rank], largest_v)
                    if fu != acc.one or fv != acc.one:
                        uu[rank] *= fu * fu
                        vv[rank] *= fv * fv
                        uv[rank] *= fu * fv
                        s_u, s_v = acc.pow2(-exp_u[rank]), acc.pow2(-exp_v[rank])
                    for e in range(width):
                        ae, ce = a[e] * s_u, c[e] * s_v
                        uu[rank] += ae * ae
                        vv[rank] += ce * ce
                        uv[rank] += ae * ce
        team_exp_u, team_exp_v = team_max(exp_u)[0], team_max(exp_v)[0]
        for rank in lanes:
            fu, fv = acc.pow2(exp_u[rank] - team_exp_u), acc.pow2(exp_v[rank] - team_exp_v)
            uu[rank] *= fu * fu
            vv[rank] *= fv * fv
            uv[rank] *= fu * fv
        uu, vv, uv = team_sum(uu)[0], team_sum(vv)[0], team_sum(uv)[0]
        fu, fv = acc.pow2(exp_u_total - team_exp_u), acc.pow2(exp_v_total - team_exp_v)
        uu_total = uu_total * (fu * fu) + uu
        vv_total = vv_total * (fv * fv) + vv
        uv_total = uv_total * (fu * fv) + uv
        exp_u_total, exp_v_total = team_exp_u, team_exp_v

        cross = acc.zero
        if with_angle:
            half = hi // 2
            su, sv = acc.pow2(-exp_u_total), acc.pow2(-exp_v_total)
            half_end = half // width
            partial = [acc.zero] * team
            for rank in lanes:
                for base in range(rank, half_end, team * CROSS_STEP):
                    raw = []
                    for j in range(CROSS_STEP):
                        pos = base + j * team
                        zeros = [acc.zero] * width
                        raw.append((_chunk(u, pos, width, acc), _chunk(u[half:], pos, width, acc),
                                    _chunk(v, pos, width, acc), _chunk(v[half:], pos, width, acc)) if pos < half_end
                                   else (zeros,) * 4)
                    for a, b, c, d in raw:
                        for e in range(width):
                            partial[rank] += (b[e] * su) * (c[e] * sv)
                            partial[rank] -= (a[e] * su) * (d[e] * sv)
            cross = team_sum(partial)[0]
        out.append(finish_pair(acc, uu_total, vv_total, uv_total, cross, exp_u_total, exp_v_total, with_angle))
        lo = hi
    return out


def _backward_group(acc: Acc, rows: np.ndarray, stats, grad_cos, grad_angle, dims, with_angle: bool, width: int,
                    team: int, dx: np.ndarray, writes: np.ndarray) -> None:
    """_pair_scores_dims_bwd_kernel for one active team (group): writes rows' gradient into dx [K, D], counting
    the writes of each element. stats[i][p], grad_cos[i][p], grad_angle[i][p]: prefix i, pair p."""
    group_size, dim = rows.shape
    pairs = group_size - 1
    u = rows[0]

    def store(row: int, col: int, values):
        dx[row, col:col + width] = values
        writes[row, col:col + width] += 1

    lo = 0
    for s, hi in enumerate(dims):
        # the team's coefficients of slice s (shared memory), as its lanes compute them
        slice_coef = [None] * pairs
        rot_coef = {}
        prefix_su = {}
        for p in range(pairs):
            su_s, sv_s = stats[s][p][4], stats[s][p][5]
            sum_a = sum_b = sum_c = acc.zero
            for i in range(s, len(dims)):
                coef = pair_coefficients(acc, stats[i][p], grad_cos[i][p], grad_angle[i][p], with_angle)
                su_i = stats[i][p][4]
                r, t = su_i / su_s, coef[4] / sv_s
                sum_a += (r * t) * coef[0]
                sum_b += (r * r) * coef[2]
                sum_c += (t * t) * coef[3]
                rot_coef[i, p] = (r * coef[1], t * coef[1], coef[4])
                if p == 0:
                    prefix_su[i] = su_i
            slice_coef[p] = (sum_a, sum_b, sum_c, sv_s)
        su_s = prefix_su[s]
        end = hi // width
        for rank in range(team):
            for base in range(lo // width + rank, end, team * BWD_STEP):
                positions = [base + j * team for j in range(BWD_STEP)]
                inside = [pos < end for pos in positions]
                cols = [pos * width for pos in positions]
                a = [[value * su_s for value in (_chunk(u, pos, width, acc) if ok else [acc.zero] * width)]
                     for pos, ok in zip(positions, inside)]
                du = [[acc.zero] * width for _ in positions]
                for p in range(pairs):
                    v = rows[p + 1]
                    coef_a, coef_b, coef_c, sv_s = slice_coef[p]
                    raw_c = [_chunk(v, pos, width, acc) if ok else [acc.zero] * width
                             for pos, ok in zip(positions, inside)]
                    for j in range(BWD_STEP):
                        c = [value * sv_s for value in raw_c[j]]
                        dv = [acc.zero] * width
                        for e in range(width):
                            du[j][e] += coef_a * c[e] - coef_b * a[j][e]
                            dv[e] = coef_a * a[j][e] - coef_c * c[e]
                        if with_angle and inside[j]:
                            for i in range(s, len(dims)):
                                half = dims[i] // 2
                                first = cols[j] < half
                                twin = cols[j] + half if first else cols[j] - half
                                rb, tb, sv_i = rot_coef[i, p]
                                sign = -acc.one if first else acc.one
                                rb, tb, su_i = sign * rb, sign * tb, prefix_su[i]
                                tu = [acc.np(value) for value in u[twin:twin + width]]
                                tv = [acc.np(value) for value in v[twin:twin + width]]
                                for e in range(width):
                                    du[j][e] += rb * (tv[e] * sv_i)
                                    dv[e] -= tb * (tu[e] * su_i)
                        dv = [value * sv_s for value in dv]
                        if inside[j]:
                            store(p + 1, cols[j], dv)
                for j in range(BWD_STEP):
                    if inside[j]:
                        store(0, cols[j], [value * su_s for value in du[j]])
        lo = hi
    for rank in range(team):  # the columns no prefix contains
        for pos in range(lo // width + rank, dim // width, team):
            for row in range(group_size):
                store(row, pos * width, [acc.zero] * width)


def emulate(x: torch.Tensor, with_angle: bool, dims, grad_cos: torch.Tensor, grad_angle: torch.Tensor):
    """The kernels' (cos [k, G, K-1], angle, dx [G, K, D] in x's dtype, writes per dx element, vector path)."""
    acc = Acc(x.dtype)
    vec, width, team = _path(x, dims, with_angle)
    rows = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32).numpy()  # exact widening (unpack)
    groups, group_size, dim = x.shape
    k = len(dims)
    cos = np.zeros((k, groups, group_size - 1), dtype=acc.np)
    angle = np.zeros_like(cos)
    stats = [[[None] * (group_size - 1) for _ in range(groups)] for _ in range(k)]
    for g, p in itertools.product(range(groups), range(group_size - 1)):
        for i, (c, a, st) in enumerate(_forward_pair(acc, rows[g, 0], rows[g, p + 1], dims, with_angle, width, team)):
            cos[i, g, p], angle[i, g, p], stats[i][g][p] = c, a, st
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32  # the binding's .to(acc_dtype)
    gc, ga = grad_cos.to(compute).numpy(), grad_angle.to(compute).numpy()
    dx = np.full((groups, group_size, dim), np.nan, dtype=acc.np)
    writes = np.zeros((groups, group_size, dim), dtype=np.int64)
    for g in range(groups):
        _backward_group(acc, rows[g], [stats[i][g] for i in range(k)], gc[:, g], ga[:, g], dims, with_angle, width,
                        team, dx[g], writes[g])
    dx_out = torch.from_numpy(dx).to(x.dtype)  # from_acc: round to nearest even
    return torch.from_numpy(cos), torch.from_numpy(angle), dx_out, writes, vec


# ---------------------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------------------
def _reference(x: torch.Tensor, with_angle: bool, dims, grad_cos, grad_angle):
    """Values and dx of the float64 reference on the truncated inputs (each prefix its own call)."""
    exact = x.detach().double().requires_grad_()
    cos, angle = float64_ops.pair_scores(exact, with_angle, tuple(dims))
    (cos * grad_cos.double()).sum().add_((angle * grad_angle.double()).sum()).backward()
    return cos.detach(), angle.detach(), exact.grad


VALUE_TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2e-6, torch.float16: 2e-6}
GRAD_TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}


def _check(x, with_angle, dims, vector_path: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shape = (len(dims), x.shape[0], x.shape[1] - 1)
    grad_cos = torch.randn(shape, generator=gen, dtype=torch.float64)
    grad_angle = torch.randn(shape, generator=gen, dtype=torch.float64) if with_angle else torch.zeros(shape)
    cos, angle, dx, writes, vec = emulate(x, with_angle, dims, grad_cos, grad_angle)
    assert vec == vector_path, "the case takes the other path than it is written for"
    assert (writes == 1).all(), "the backward writes some dx element other than once"
    want_cos, want_angle, want_dx = _reference(x, with_angle, dims, grad_cos, grad_angle)
    assert float64_ops.rel_err(cos, want_cos) <= VALUE_TOL[x.dtype]
    assert float64_ops.rel_err(angle, want_angle) <= VALUE_TOL[x.dtype]
    assert float64_ops.rel_err(dx, want_dx) <= GRAD_TOL[x.dtype], float64_ops.rel_err(dx, want_dx)


def _inputs(groups, group_size, dim, dtype, seed=0, huge=()):
    """Random rows; `huge`: (group, row, first column, factor) scaling a row's columns from there on."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(groups, group_size, dim, generator=gen, dtype=torch.float64)
    for g, k, first, factor in huge:
        x[g, k, first:] *= factor
    return x.to(dtype)


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def test_the_model_mirrors_the_kernel_source():
    source = " ".join(KERNEL_FILE.read_text().split())
    stale = [line for line in MIRRORED if " ".join(line.split()) not in source]
    assert not stale, f"csrc/pair_scores.cu changed where this model copies it; read the model against: {stale}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dims_of", [lambda v: (2 * v,), lambda v: (2 * v, 4 * v, 10 * v),
                                     lambda v: (2 * v, 4 * v, 6 * v, 10 * v, 12 * v)], ids=["k1", "k3", "k5"])
def test_vector_path_with_the_angle(dtype, dims_of):
    """Prefixes of whole vector pairs (k = 1, 3, 5), K = 3, the last prefix short of D (zeros past it), slices of
    one to several positions per lane."""
    v = VECTOR_WIDTH[dtype]
    dims = dims_of(v)
    _check(_inputs(2, 3, 14 * v, dtype), True, dims, vector_path=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_vector_path_with_the_angle_and_a_team(dtype):
    """Teams of 4 lanes with the angle (K = 2, k = 3): the cross sweeps and the backward's positions spread over
    lanes, prefixes' halves split between them."""
    v = VECTOR_WIDTH[dtype]
    dims = (6 * v, 16 * v, 32 * v)
    assert vector_team_log2(dims[-1] // v) == 2
    _check(_inputs(3, 2, 34 * v, dtype, seed=5), True, dims, vector_path=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_vector_path_without_the_angle_and_a_wide_team(dtype):
    """Prefixes of whole vectors but odd multiples of them (no angle), and a row long enough for teams of 8 lanes:
    slices end inside a lane's step."""
    v = VECTOR_WIDTH[dtype]
    dims = (v, 3 * v, 9 * v, 33 * v, 64 * v)
    assert vector_team_log2(dims[-1] // v) == 3
    _check(_inputs(1, 2, 64 * v, dtype, seed=1), False, dims, vector_path=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_angle", [False, True])
def test_general_path_for_prefixes_off_the_vector_width(dtype, with_angle):
    """Prefixes that are not multiples of the vector width (of twice it with the angle), and an odd D without the
    angle: the general path, per element, K = 4, k = 3 and 5."""
    dims = (6, 14, 26) if with_angle else (3, 7, 13, 22, 29)
    dim = 30 if with_angle else 31
    _check(_inputs(2, 4, dim, dtype, seed=2), with_angle, dims, vector_path=False)


def test_general_path_for_strided_rows():
    """A view whose rows are not contiguous takes the general path (stride_d = 2), with the angle."""
    base = _inputs(2, 3, 64, torch.float32, seed=3)
    x = base[:, :, ::2]
    _check(x, True, (8, 16, 32), vector_path=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_angle", [False, True])
def test_huge_rows(dtype, with_angle):
    """Rows around 1e30 (their squares overflow float32): a whole partner, an anchor whose last slice alone is huge
    (its exponent rises after the first prefixes, which keep their own scales), and a partner huge from the middle
    of a vector's lanes on; on both paths."""
    v = VECTOR_WIDTH[dtype]
    huge = ((0, 1, 0, 1e30), (1, 0, 8 * v, 1e30), (1, 2, 3 * v + 1, 1e30))
    x = _inputs(2, 3, 12 * v, dtype, seed=4, huge=huge)
    _check(x, with_angle, (2 * v, 4 * v, 8 * v, 12 * v), vector_path=True)
    _check(x, with_angle, (2, 4 * v - 2, 8 * v + 2, 12 * v), vector_path=False)

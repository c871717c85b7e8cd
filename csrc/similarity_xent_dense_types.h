// The parameter types of the dense similarity_xent launchers (csrc/similarity_xent_dense.cu), shared with their
// binding (csrc/similarity_xent_dense.cpp): one definition of the tile problem for both sides, so that they cannot
// disagree on its layout. Host-safe and torch-free, like launcher_types.h, which it builds on.
#pragma once

#include <cstdint>

#include "dense_types.h"
#include "launcher_types.h"

namespace angle_kernels {

// The gradient kernel's tile: kXentGradRows rows by kXentGradCols columns per block (one column per thread). The
// binding sizes the per-tile radial partial sums by them: [column tiles, n_rows] and [row tiles, cols].
constexpr int kXentGradRows = 16;
constexpr int kXentGradCols = 256;

// One row block R = [row0, row0 + n_rows) of similarity_xent's logits against all `cols` columns, as the tile
// kernels read it. `acc` is the dot tile's type (float, or double for double inputs).
//   cosine   cos_ij = dots[i - row0, j] * row_inv[i] * col_inv[j]   (dots of the rows scaled by their powers of
//                                                                   two, inverse clamped norms of those rows)
//   target   t_i = i ^ 1 (partner_target) or i; columns C_i: every j < cols, without j == i (exclude_diagonal)
//   logit    l_ij = scale cos_ij, at the target scale cos(min(arccos(cos) + margin, pi)) (has_margin)
//   positive P_i = {t_i}, with groups [rows] also every j in C_i whose group is i's or t_i's
// The loss parameters come as doubles, so that the double kernels see cos(margin) to double precision.
template <typename acc>
struct XentTiles {
  const acc* dots;  // [n_rows, cols], rows ld_dots apart, unit column stride
  int64_t ld_dots;
  const acc* row_inv;     // [rows]
  const acc* col_inv;     // [cols]
  const int64_t* groups;  // [rows] (columns are rows: only without c), or null
  int64_t row0, n_rows, rows, cols;
  double scale, cos_margin, sin_margin;
  bool partner_target, exclude_diagonal, has_margin;
};

}  // namespace angle_kernels

// The parameter types of similarity_lse's launchers (csrc/similarity_lse.cu), shared with their binding
// (csrc/similarity_lse.cpp): one definition of the tile problem for both sides, so that they cannot disagree on
// its layout. Host-safe and torch-free, like launcher_types.h, which it builds on.
#pragma once

#include <cstdint>

#include "dense_types.h"
#include "launcher_types.h"

namespace angle_kernels {

// The options of the contract (angle_kernels/dispatch.py, similarity_lse), as the binding parses its strings.
enum LseExclude : int { kLseExcludeNone = 0, kLseExcludeTarget = 1, kLseExcludeOwn = 2 };
enum LsePenaltyOn : int { kLsePenaltyNone = 0, kLsePenaltyOther = 1, kLsePenaltyOwn = 2, kLsePenaltyAll = 3 };
// No filter; a filter on the block's own scores (filter_q, filter_c are q and c: no second tile); a filter on
// other embeddings, whose dots come in a tile of their own.
enum LseFilter : int { kLseFilterNone = 0, kLseFilterOwnScores = 1, kLseFilterSeparate = 2 };

// The gradient kernel's tile: kLseGradRows rows by kLseGradCols columns per block (one column per thread). The
// binding sizes the per-tile radial partial sums by them: [column tiles, n_rows] and [row tiles, cols].
constexpr int kLseGradRows = 16;
constexpr int kLseGradCols = 256;

// One row block R = [row0, row0 + n_rows) of similarity_lse's logits against all `cols` columns, as the tile
// kernels read it. `acc` is the score tile's type (float, or double for double inputs).
//   score    v_ij = dots[i - row0, j] * row_inv[i] * col_inv[j]        (the cosine, or s_i q_i . c_j: in the
//                                                                      anchor row's scale for dot products)
//   logit    l_ij = row_unscale[i] * (scale * v_ij + penalty * v_ij [j hard])
// The filter compares, in its own compute type (filter_fp64: double, else float), the filter's score with
// threshold[i]: for kLseFilterOwnScores the score v_ij itself (threshold in acc and in v's scale), for
// kLseFilterSeparate filter_dots[i - row0, j] * filter_row_inv[i] * filter_col_inv[j].
template <typename acc>
struct LseTiles {
  const acc* dots;  // [n_rows, cols], rows ld_dots apart, unit column stride
  int64_t ld_dots;
  const acc* row_inv;      // [rows]
  const acc* col_inv;      // [cols]
  const acc* row_unscale;  // [rows]
  int filter;              // LseFilter
  bool filter_fp64;
  bool filter_keeps_target;
  const void* filter_dots;  // kLseFilterSeparate: [n_rows, cols], rows ld_filter apart
  int64_t ld_filter;
  const void* filter_row_inv;  // kLseFilterSeparate: [rows]
  const void* filter_col_inv;  // kLseFilterSeparate: [cols]
  const void* threshold;       // [rows] (any filter)
  int64_t row0, n_rows, rows, cols, target_offset, period;
  double scale, penalty;
  int exclude;     // LseExclude
  int penalty_on;  // LsePenaltyOn (kLsePenaltyNone when penalty is 0)
};

}  // namespace angle_kernels

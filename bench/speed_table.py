"""Print the measured points of `angle_kernels.measured` from the op sweeps of GPU runs.

    python bench/speed_table.py RUN_DIR/second.json [MORE.json ...]

Reads the rows of the `op_sweep` and `cuda_op_sweep` steps of `gpu_suite.py second` (their JSON), keeps the points
where at least two backends were timed, and prints them as the Python literals `angle_kernels/measured.py` holds,
one tuple per (capability, dtype). Copy them into measured.py with the run's folder as the evidence comment.
"""

from __future__ import annotations

import collections
import json
import sys

# The op sweep's row names (bench_*.py OpBench names) -> (op, variant, size from the sweep's N): pairs for
# pair_scores, scores for the ranking term, logits M x Mc for similarity_xent (in-batch negatives: M = Mc = 2N;
# ArcCon: N x N; Matryoshka: N queries against 2N candidates).
SWEEP_ROWS = {
    "pair_scores": ("pair_scores", "full", lambda n: n),
    "pair_scores(dims)": ("pair_scores", "dims", lambda n: n),
    "ranking_loss": ("ranking_loss", "full", lambda n: n),
    "similarity_xent(ibn)": ("similarity_xent", "full", lambda n: 4 * n * n),
    "similarity_xent(arccon)": ("similarity_xent", "margin", lambda n: n * n),
    "similarity_xent(dims)": ("similarity_xent", "dims", lambda n: 2 * n * n),
}
# The dtype of the op's first input: the ranking term takes float32 scores whatever the sweep's dtype column says.
FIRST_INPUT_DTYPE = {"ranking_loss": "float32"}
STEPS = ("op_sweep", "cuda_op_sweep")


def points(paths: list[str]) -> dict[tuple[str, str], list[tuple]]:
    """(capability, dtype) -> sorted (op, variant, size, width, {backend[/path]: ms}) from the runs' JSON files."""
    times: dict[tuple, dict[str, float]] = collections.defaultdict(dict)
    for path in paths:
        with open(path, encoding="utf-8") as f:
            run = json.load(f)
        capability = run["steps"]["preflight"]["environment"].get("capability", "?")
        for step in STEPS:
            for row in run["steps"].get(step, {}).get("rows", []):
                if row.get("status") != "ok" or row["op"] not in SWEEP_ROWS:
                    continue
                op, variant, size = SWEEP_ROWS[row["op"]]
                dtype = FIRST_INPUT_DTYPE.get(op, row["dtype"])
                key = (capability, dtype, op, variant, size(row["n"]), row["d"])
                times[key][row["backend"].replace("-", "/")] = float(f"{row['ms']:.3g}")
    table: dict[tuple[str, str], list[tuple]] = collections.defaultdict(list)
    for (capability, dtype, *where), timed in sorted(times.items()):
        if len(timed) >= 2:
            table[(capability, dtype)].append((*where, timed))
    return table


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    for (capability, dtype), rows in points(argv).items():
        print(f"# capability {capability}, {dtype}")
        print("(")
        for row in rows:
            print(f"    {row!r},")
        print(")")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

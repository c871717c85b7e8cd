"""Print the measured points of `angle_kernels.measured` from the op sweeps of GPU runs.

    python bench/speed_table.py [--commit COMMIT] RUN_DIR/second.json [[--commit COMMIT] MORE.json ...]
    python bench/speed_table.py --decisions

Reads the rows of the `op_sweep` and `cuda_op_sweep` steps of `gpu_suite.py second` (their JSON), keeps the points
where at least two backends were timed, and prints them as the Python literals `angle_kernels/measured.py` holds,
one tuple per (capability, dtype). Copy them into measured.py with the runs' folders as the evidence comment. Pass
every op sweep of one GPU together, in the order they ran (a later run's time of the same backend and path at the
same point replaces an earlier one's): a command that swept one backend, or a few ops, gives no point or only
those ops' points on its own, and what replaces a GPU's points must hold them all (exit status 1 when no point).

Each time is keyed "backend/path", the code path it timed, and comes with the fingerprint of that path's code as
it ran (`angle_kernels.measured.code_fingerprint`'s rule), keyed the same way. Both come from the run's own rows
where the sweep recorded them (gpu_suite.py does); for a run that did not, the fingerprints are computed by the
same rule from the sources at the commit the run measured, read from git (`--commit COMMIT`, given before the run
files it applies to; the run's README names its commit), and the path is derived from the row (`derived_path`).

--decisions: for the points of measured.MEASURED, every set of backends `auto` may use and every call at a point
where the table's choice differs from auto's fixed order (measured.fixed_order: triton, cuda, torch's GPU path, its
default one, with measured.AFTER_TORCH's backends behind torch), with the times: what the table is worth against
the fixed order, as measured, and which of its times this checkout's code still matches.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import functools
import itertools
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's angle_kernels, not another one installed in the environment

from angle_kernels import fingerprints, measured  # noqa: E402

# The op sweep's row names (bench_*.py OpBench names) -> (op, variant, size from the sweep's N): pairs for
# pair_scores, scores for the ranking term, logits M x Mc for similarity_xent (in-batch negatives: M = Mc = 2N;
# ArcCon: N x N; Matryoshka: N queries against 2N candidates) and similarity_lse (N queries against 2N documents).
SWEEP_ROWS = {
    "pair_scores": ("pair_scores", "full", lambda n: n),
    "pair_scores(dims)": ("pair_scores", "dims", lambda n: n),
    "ranking_loss": ("ranking_loss", "full", lambda n: n),
    "similarity_xent(ibn)": ("similarity_xent", "full", lambda n: 4 * n * n),
    "similarity_xent(arccon)": ("similarity_xent", "margin", lambda n: n * n),
    "similarity_xent(dims)": ("similarity_xent", "dims", lambda n: 2 * n * n),
    "similarity_xent(one width)": ("similarity_xent", "full", lambda n: 2 * n * n),  # the dims rows' shape
    "similarity_lse": ("similarity_lse", "full", lambda n: 2 * n * n),
    "similarity_lse(dims)": ("similarity_lse", "dims", lambda n: 2 * n * n),
}
# The dtype of the op's first input: the ranking term takes float32 scores whatever the sweep's dtype column says.
FIRST_INPUT_DTYPE = {"ranking_loss": "float32"}
STEPS = ("op_sweep", "cuda_op_sweep")


# ---------------------------------------------------------------------------------------------------------
# The code a row timed: its path and that path's fingerprint
# ---------------------------------------------------------------------------------------------------------
def git_tree(commit: str, repo: Path = REPO) -> fingerprints.Tree:
    """The repository's files at `commit` (`git show COMMIT:path`, each file read once), for fingerprints.
    Raises ValueError when git does not know the commit."""
    resolved = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"],
                              capture_output=True, text=True)
    if resolved.returncode != 0:
        raise ValueError(f"--commit {commit}: not a commit of the repository at {repo}")
    full = resolved.stdout.strip()

    @functools.lru_cache(maxsize=None)
    def read(relative: str) -> str | None:
        shown = subprocess.run(["git", "-C", str(repo), "show", f"{full}:{relative}"], capture_output=True)
        return shown.stdout.decode("utf-8") if shown.returncode == 0 else None

    return fingerprints.Tree(read, f"commit {commit}")


def fingerprint_at(backend: str, op: str, path: str, tree: fingerprints.Tree) -> str | None:
    """The fingerprint of a path's code in `tree`, by measured.code_fingerprint's rule (None when the tree lacks
    the path's code)."""
    try:
        code = {"fingerprint": fingerprints.path_closure(backend, op, path, tree).fingerprint}
        if backend == "cuda":
            code["build"] = fingerprints.csrc_fingerprint(fingerprints.csrc_source(op, path), tree)
    except (KeyError, FileNotFoundError):
        return None
    return measured.joined_fingerprint(backend, code)


def derived_path(label: str, op: str, variant: str, size: int, tree: fingerprints.Tree | None) -> str:
    """The code path a row of a sweep that did not record it timed: the scheme a "triton-<scheme>" row forced, the
    one path of the torch backend and of the cuda backend's ops with one, the variant's path of the pair_scores of
    Triton and cuda and of Triton's similarity_xent dims, the cuda similarity_xent's fused kernels (its one path
    before its dense ones),
    and for the Triton ranking term the rule of its code_path (pairwise up to SMALL_N_MAX scores) as the tree
    states SMALL_N_MAX."""
    backend, _, scheme = label.partition("-")
    if scheme:
        return scheme
    if backend == "torch":
        return "default"
    paths = [path for (b, o, path) in fingerprints.PATH_CODE if (b, o) == (backend, op)]
    if len(paths) == 1:
        return paths[0]
    if (backend == "triton" or (backend, op) == ("cuda", "pair_scores")) and (variant == "dims" or op == "pair_scores"):
        return "dims" if variant == "dims" else "full"
    if (backend, op) == ("cuda", "similarity_xent"):  # runs before its dense paths, which record them: fused
        return "fused"
    if backend == "triton" and op == "ranking_loss" and tree is not None:
        return "pairwise" if size <= _module_constant(tree, "triton_ops/ranking_loss.py", "SMALL_N_MAX") else "sort"
    raise ValueError(f"a {label} {op} row without its code path: the run must record it")


def _module_constant(tree: fingerprints.Tree, relative: str, name: str):
    text = tree.read(f"{fingerprints.PACKAGE}/{relative}")
    for statement in ast.parse(text or "").body:
        if isinstance(statement, ast.Assign) and [getattr(t, "id", None) for t in statement.targets] == [name]:
            return ast.literal_eval(statement.value)
    raise ValueError(f"{relative} in {tree.name} does not assign {name}")


# ---------------------------------------------------------------------------------------------------------
# Runs -> points
# ---------------------------------------------------------------------------------------------------------
def points(runs: list[tuple[str, str | None]]) -> dict[tuple[str, str], list[tuple]]:
    """(capability, dtype) -> sorted (op, variant, size, width, {backend/path: ms}, {backend/path: fingerprint})
    from the runs' JSON files, each given with the commit it measured (None: its rows record paths and
    fingerprints)."""
    times: dict[tuple, dict[str, float]] = collections.defaultdict(dict)
    prints: dict[tuple, dict[str, str | None]] = collections.defaultdict(dict)
    computed: dict[tuple, str | None] = {}  # (commit, backend, op, path) -> fingerprint_at
    for path, commit in runs:
        with open(path, encoding="utf-8") as f:
            try:
                run = json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: not JSON ({exc}); give the second.json of a gpu_suite.py second "
                                 "run") from None
        if not isinstance(run, dict) or not isinstance(run.get("steps"), dict):
            raise ValueError(f"{path}: not a stage record of bench/gpu_suite.py (it has no steps); give the "
                             "second.json of a gpu_suite.py second run")
        tree = git_tree(commit) if commit else None
        environment = run["steps"].get("preflight", {}).get("environment")
        if not environment:
            raise ValueError(f"{path}: its preflight recorded no GPU (a record of a stage that started no CUDA build "
                             "before bench/gpu_suite.py recorded the machine in every stage): its times cannot be "
                             "told apart by GPU")
        capability = environment.get("capability", "?")
        for step in STEPS:
            for row in run["steps"].get(step, {}).get("rows", []):
                if row.get("status") != "ok" or row["op"] not in SWEEP_ROWS:
                    continue
                op, variant, size = SWEEP_ROWS[row["op"]]
                if "fingerprint" not in row and tree is None:
                    raise ValueError(f"{path}: its rows do not record the code they timed (path, fingerprint); give "
                                     "the commit it measured: --commit COMMIT before it")
                backend = row["backend"].partition("-")[0]
                code_path = row.get("path") or derived_path(row["backend"], op, variant, size(row["n"]), tree)
                if "fingerprint" in row:
                    fingerprint = row["fingerprint"]
                else:
                    if (commit, backend, op, code_path) not in computed:
                        computed[(commit, backend, op, code_path)] = fingerprint_at(backend, op, code_path, tree)
                    fingerprint = computed[(commit, backend, op, code_path)]
                dtype = FIRST_INPUT_DTYPE.get(op, row["dtype"])
                key = (capability, dtype, op, variant, size(row["n"]), row["d"])
                times[key][f"{backend}/{code_path}"] = float(f"{row['ms']:.3g}")
                prints[key][f"{backend}/{code_path}"] = fingerprint
    table: dict[tuple[str, str], list[tuple]] = collections.defaultdict(list)
    for (capability, dtype, *where), timed in sorted(times.items()):
        if len({key.partition("/")[0] for key in timed}) >= 2:
            table[(capability, dtype)].append((*where, timed, prints[(capability, dtype, *where)]))
    return table


def point_text(point: tuple, indent: str = "    ") -> str:
    """A point as measured.py writes it: its place, its times, its fingerprints, each on lines of its own within
    120 columns."""
    op, variant, size, width, times, prints = point

    def literal(value) -> str:  # the project's style: double-quoted strings
        return json.dumps(value) if isinstance(value, str) else repr(value)

    lines = [f"{indent}({literal(op)}, {literal(variant)}, {size}, {width},"]
    for mapping, end in ((times, ","), (prints, "),")):
        items = [f"{literal(key)}: {literal(value)}" for key, value in mapping.items()]
        line = indent + " {"
        for i, item in enumerate(items):
            piece = item + ("}" + end if i == len(items) - 1 else ",")
            if len(line) + 1 + len(piece) > 120 and not line.endswith("{"):
                lines.append(line)
                line = indent + "  "
            line += ("" if line.endswith(("{", "  ")) else " ") + piece
        lines.append(line)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# What the table decides that the fixed order would not
# ---------------------------------------------------------------------------------------------------------
ORDER = ("triton", "cuda")  # the GPU backends, in dispatch's order; torch's paths come after them


@dataclasses.dataclass(frozen=True, eq=False)
class _Timed:
    """A candidate of measured.fixed_order: a backend (`name`) on one of its timed paths (`key`, "backend/path")."""

    name: str
    key: str


@functools.lru_cache(maxsize=None)
def checkout_fingerprint(backend: str, op: str, path: str) -> str | None:
    """The fingerprint of this checkout's code for a path (the cuda paths' from csrc/, not a loaded extension)."""
    return fingerprint_at(backend, op, path, fingerprints.folder_tree())


def decisions(table: dict | None = None, here=checkout_fingerprint) -> list[dict]:
    """For every point of `table` (measured.MEASURED by default), every set of backends auto may use there (the
    GPU backends the point timed, each on one of its timed paths, and torch on every path the point timed, its GPU
    path before its default one, as dispatch offers them) in auto's fixed order (measured.fixed_order: AFTER_TORCH's
    backends behind torch): the calls where measured.fastest's rule at that point chooses another candidate than the
    first of that order. Each with the times, the time the table saves per call, and whether `here` (the
    fingerprint of a path's code: this checkout's by default) still matches every time it compared."""
    found = []
    for (capability, dtype), table_points in (table or measured.MEASURED).items():
        for op, variant, size, width, times, prints in table_points:
            by_backend = collections.defaultdict(list)
            for key in times:
                by_backend[key.partition("/")[0]].append(key)
            torch_keys = sorted(by_backend["torch"], key=lambda key: key == "torch/default")  # default last
            current = {key: prints.get(key) is not None and prints[key] == here(*_backend_path(key, op))
                       for key in times}
            gpu = [b for b in ORDER if b in by_backend]
            for count in range(1, len(gpu) + 1):
                for chosen in itertools.combinations(gpu, count):
                    for gpu_keys in itertools.product(*(by_backend[b] for b in chosen)):
                        offered = [_Timed(key.partition("/")[0], key) for key in (*gpu_keys, *torch_keys)]
                        keys = [candidate.key for candidate in measured.fixed_order(op, offered)]
                        compared = {key: times[key] for key in keys}
                        table_key = measured.point_choice(list(compared.items()))
                        if table_key == keys[0]:
                            continue
                        found.append({"capability": capability, "dtype": dtype, "op": op, "variant": variant,
                                      "size": size, "width": width, "times": compared, "fixed_order": keys[0],
                                      "table": table_key, "saves_ms": round(compared[keys[0]] - compared[table_key], 3),
                                      "matches_this_code": all(current[key] for key in keys)})
    return found


def _backend_path(key: str, op: str) -> tuple[str, str, str]:
    backend, _, path = key.partition("/")
    return backend, op, path


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    if argv == ["--decisions"]:
        for d in decisions():
            times = ", ".join(f"{k} {v:g}" for k, v in d["times"].items())
            dtype = str(d["dtype"]).removeprefix("torch.")
            print(f"{d['capability']} {dtype} {d['op']} {d['variant']} size {d['size']:,} width {d['width']}: "
                  f"{d['table']} rather than {d['fixed_order']} ({times}; saves {d['saves_ms']:g} ms per call; "
                  f"{'matches' if d['matches_this_code'] else 'does not match'} this checkout's code)")
        return 0
    if "--decisions" in argv:  # it was said to be an unknown option, in a list of the options that names it
        print(f"--decisions takes no other argument (it reads angle_kernels.measured's table, not run files); got "
              f"{' '.join(argv)}", file=sys.stderr)
        return 2
    runs, commit = [], None
    arguments = iter(argv)
    for argument in arguments:
        if argument == "--commit":
            commit = next(arguments, None)
            if commit is None:
                print("--commit needs a commit", file=sys.stderr)
                return 2
        elif argument.startswith("-"):
            print(f"{argument}: unknown option (the options: --commit COMMIT, --decisions, --help)", file=sys.stderr)
            return 2
        else:
            runs.append((argument, commit))
    try:
        table = points(runs)
    except (OSError, ValueError) as exc:  # a run file that is missing or not a stage record, a commit git lacks
        print(f"speed_table.py: {exc}", file=sys.stderr)
        return 2
    if not table:
        print("no point: every (op, size, width) these runs timed has one backend's times. A point needs two "
              "backends timed on the same GPU: pass every op sweep of that GPU together (e.g. the CUDA op sweep's "
              "second.json beside the Triton and torch op sweep's), and replace the GPU's points in measured.py with "
              "what they give together", file=sys.stderr)
        return 1
    for (capability, dtype), rows in table.items():
        print(f"# capability {capability}, {dtype}")
        print("(")
        for row in rows:
            print(point_text(row))
        print(")")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

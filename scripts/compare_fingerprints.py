"""Compare, by angle_kernels.fingerprints' rule, the code each GPU verification checked with the code at HEAD.

    python scripts/compare_fingerprints.py [--out docs/verification-history.md]

For every entry a GPU run verified (the `passed` entries of the runs in RUNS, as that run wrote them, under the
match rule of its day), this:
    1. confirms the commit the run checked: the run's own rule (the `source_fingerprint` and CUDA build fingerprint
       of `angle_kernels/verified.py` at that commit, run on that commit's files) must give the fingerprints the entry
       recorded, or the entry is reported as unconfirmed;
    2. computes the fingerprint of the path (and, for the CUDA backend, of the op's CUDA sources) by today's rule on
       that commit's files and on this checkout's, and names the definitions that differ.

An entry whose fingerprints are equal belongs in `angle_kernels.verified.VERIFIED` with its original evidence and
today's fingerprints; the others wait for a GPU run. The output is committed (docs/verification-history.md) beside
the table it justifies. Needs the repository's git history; run from anywhere inside the checkout.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from angle_kernels import fingerprints  # noqa: E402

# (the results folder, the file holding the run's passed entries, the commit whose sources it ran, as its README says)
RUNS = (
    ("bench/results/h100-80gb-hbm3-2026-11-26/first", "verified.json", "7ab8295"),
    ("bench/results/h100-80gb-hbm3-2026-11-26/recheck", "verify_cuda.json", "7ab8295"),
    ("bench/results/h200-2026-11-28/first", "verified.json", "fd3308d"),
    ("bench/results/h200-2026-11-28/first-checks", "verified.json", "40ac9b5"),
    ("bench/results/h200-2026-12-04/first", "verified.json", "97c3de1"),
)

_OLD_RULE = """
import json, sys
from angle_kernels import verified
from angle_kernels.cuda_ops import _extension
out = {}
for backend, op in json.loads(sys.argv[1]):
    out[f"{backend}/{op}"] = verified.source_fingerprint(backend, op)
out["csrc"] = _extension.csrc_fingerprint()
print(json.dumps(out))
"""


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def git_tree(commit: str) -> fingerprints.Tree:
    """The files of `commit`, read through git."""
    def read(relative: str) -> str | None:
        done = subprocess.run(["git", "show", f"{commit}:{relative}"], cwd=ROOT, capture_output=True, text=True)
        return done.stdout if done.returncode == 0 else None

    return fingerprints.Tree(read, f"commit {commit}")


def old_rule(commit: str, pairs: list[tuple[str, str]]) -> dict:
    """The fingerprints the commit's own verified.py computes on the commit's own files."""
    archive = subprocess.run(["git", "archive", commit, "angle_kernels", "csrc"], cwd=ROOT, capture_output=True,
                             check=True).stdout
    with tempfile.TemporaryDirectory() as folder:
        with tarfile.open(fileobj=BytesIO(archive)) as tar:
            tar.extractall(folder)
        done = subprocess.run([sys.executable, "-c", _OLD_RULE, json.dumps(pairs)], cwd=folder,
                              env={"PYTHONPATH": folder, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the rule of {commit} failed: {done.stderr[-2000:]}")
        return json.loads(done.stdout)


def differing_definitions(key: tuple, before: fingerprints.Tree, after: fingerprints.Tree) -> list[str]:
    """The names of the path's definitions whose canonical forms differ (or exist on one side only)."""
    def forms(tree):
        closure = fingerprints.path_closure(*key, tree=tree)
        source = tree.parsed
        found = {}
        for module, name in closure.members:
            for statement in source.module(module).defs[name]:
                text = fingerprints.canonical(fingerprints._normalised(copy.deepcopy(statement)))
                found.setdefault(name, set()).add(text)
        return found

    a, b = forms(before), forms(after)
    return sorted(name for name in set(a) | set(b) if a.get(name) != b.get(name))


def compare() -> list[dict]:
    head = git("rev-parse", "--short", "HEAD").strip()
    here = fingerprints.folder_tree(ROOT)
    rows = []
    for folder, name, commit in RUNS:
        entries = json.loads((ROOT / folder / name).read_text())["passed"]
        then = git_tree(commit)
        # entries of runs before the rule of executed code recorded whole-file fingerprints ("source"): the
        # commit's own rule reproduces them; later entries record the path's fingerprint by today's rule
        old = [e for e in entries if "fingerprint" not in e]
        recorded = old_rule(commit, sorted({(e["backend"], e["op"]) for e in old})) if old else {}
        for e in entries:
            key = (e["backend"], e["op"], e["path"])
            row = {"backend": e["backend"], "op": e["op"], "path": e["path"], "evidence": folder, "commit": commit,
                   "head": head, "recorded": {k: e[k] for k in ("source", "fingerprint", "build") if k in e},
                   "then": fingerprints.path_closure(*key, tree=then).fingerprint,
                   "now": fingerprints.path_closure(*key, tree=here).fingerprint,
                   "differs": differing_definitions(key, then, here)}
            if e["backend"] == "cuda":  # the path's CUDA sources (its op's unless CSRC_SOURCES names its own)
                source = fingerprints.csrc_source(e["op"], e["path"])
                row["build_then"] = fingerprints.csrc_fingerprint(source, then)
                row["build_now"] = fingerprints.csrc_fingerprint(source, here)
            if "fingerprint" in e:
                confirmed = row["then"] == e["fingerprint"] and row.get("build_then") == e.get("build")
            else:
                confirmed = recorded[f"{e['backend']}/{e['op']}"] == e["source"] and (
                    e["backend"] != "cuda" or recorded["csrc"] == e["build"])
            row["confirmed"] = confirmed
            if e["backend"] == "cuda":
                files_then, files_now = (fingerprints.csrc_files(source, tree) for tree in (then, here))
                row["differs"] += [f"csrc/{file}" for file in sorted(set(files_then) | set(files_now))
                                   if fingerprints.strip_c_comments(files_then.get(file, ""))
                                   != fingerprints.strip_c_comments(files_now.get(file, ""))]
            row["equal"] = confirmed and row["then"] == row["now"] and row.get("build_then") == row.get("build_now")
            rows.append(row)
    return rows


def render(rows: list[dict]) -> str:
    head = rows[0]["head"] if rows else "?"
    lines = [
        "# The verified GPU paths, by the fingerprint of the code they execute",
        "",
        "Written by `python scripts/compare_fingerprints.py` (do not edit): for each entry a GPU run verified, whether",
        "the run checked the commit its README names (that commit's own rule reproduces the entry's recorded",
        "fingerprints), and the fingerprint of the path's code by today's rule (`angle_kernels.fingerprints`) at that",
        f"commit and at the checkout the script ran on ({head}, with the changes of the commit that holds this file).",
        "Equal fingerprints: the code that passed is the code that runs, and the entry is in",
        "`angle_kernels.verified.VERIFIED` with its original evidence. docs/verification.md explains the rule.",
        "",
        "| backend | op | path | run | commit | confirmed | fingerprint then | now | CUDA sources then | now | "
        "verified today | what differs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        differs = ", ".join(f"`{name}`" for name in r["differs"][:8]) + (" ..." if len(r["differs"]) > 8 else "")
        run = "/".join(r["evidence"].split("/")[-2:])
        lines.append(
            f"| {r['backend']} | {r['op']} | {r['path']} | `{run}` | {r['commit']} | "
            f"{'yes' if r['confirmed'] else 'NO'} | {r['then']} | {r['now']} | "
            f"{r.get('build_then', '')} | {r.get('build_now', '')} | {'yes' if r['equal'] else 'no'} | "
            f"{differs or '(nothing)'} |")
    lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="write the table there (markdown) and the rows beside "
                        "it as .json")
    args = parser.parse_args(argv)
    rows = compare()
    text = render(rows)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(r["confirmed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

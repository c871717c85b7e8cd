"""Experiment tracking: where a run's metrics go besides OUTPUT_DIR/metrics.jsonl (always written), and the picture
of its training curves drawn at the end.

`--report-to` takes the Hugging Face Trainer's names and meaning: `none` (the default), `tensorboard`, `wandb`, or
`all` (both); several may be listed. Each reporter gets every metrics row the run writes (training rows: loss, lr,
grad_norm, pairs_per_s, tokens_per_s, peak_mem_gb, useful_tokens, ...; evaluation rows: dev_spearman and
dev_spearman@d per trained width), on the main process only:

    tensorboard  OUTPUT_DIR/tensorboard (`pip install tensorboard`; `tensorboard --logdir OUTPUT_DIR/tensorboard`)
    wandb        a Weights & Biases run in OUTPUT_DIR/wandb (`pip install wandb`), project $WANDB_PROJECT or
                 "angle-train". Online only with credentials (WANDB_API_KEY, or `wandb login`), else offline, so a
                 machine without network or account never waits on one (`wandb sync OUTPUT_DIR/wandb/offline-run-*`
                 uploads later); WANDB_MODE, when set, decides.

Both are optional extras (`pip install angle_kernels[tracking]`): asking for one that is not installed fails at
start-up, naming the package. At the end of a run `plot_curves` draws OUTPUT_DIR/curves.png from metrics.jsonl:
loss, learning rate and dev Spearman (one line per width) by step (matplotlib; skipped with a note without it).
"""

from __future__ import annotations

import json
import netrc
import os

REPORTERS = ("tensorboard", "wandb")
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
    offline: wandb would otherwise ask for a key on the terminal, or wait on a network that is not there."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        logged_in = netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        logged_in = False
    return "online" if logged_in else "offline"


class WandbReporter:
    def __init__(self, output_dir: str, config: dict):
        import wandb

        folder = os.path.join(output_dir, "wandb")
        os.makedirs(folder, exist_ok=True)
        self.mode = wandb_mode()
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "angle-train"), dir=output_dir, config=config,
                              mode=self.mode, name=os.path.basename(os.path.abspath(output_dir)))

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


def read_metrics(path: str) -> list[dict]:
    """The rows of a metrics.jsonl (a torn last line, from a killed run, is skipped)."""
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


def plot_curves(metrics_path: str, png_path: str) -> str | None:
    """Draw the training curves of a metrics.jsonl into png_path: loss and learning rate by step, and dev Spearman
    at every evaluated width when the run evaluated. Returns png_path, or None (with a note) without matplotlib or
    without a training row."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # a file, never a window
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: no curves.png (pip install matplotlib to have one)", flush=True)
        return None
    rows = read_metrics(metrics_path)
    train_rows = [row for row in rows if "loss" in row]
    eval_rows = [row for row in rows if "dev_spearman" in row]
    if not train_rows:
        return None
    panels = 3 if eval_rows else 2
    figure, axes = plt.subplots(1, panels, figsize=(5 * panels, 3.6), constrained_layout=True)
    steps = [row["step"] for row in train_rows]
    axes[0].plot(steps, [row["loss"] for row in train_rows], marker="." if len(steps) < 50 else None)
    axes[0].set(title="training loss", xlabel="step")
    axes[1].plot(steps, [row["lr"] for row in train_rows])
    axes[1].set(title="learning rate", xlabel="step")
    if eval_rows:
        widths = sorted({key for row in eval_rows for key in row if key.startswith("dev_spearman")},
                        key=lambda key: (key != "dev_spearman", -int(key.split("@")[1]) if "@" in key else 0))
        for key in widths:
            points = [(row["step"], row[key]) for row in eval_rows if key in row]
            label = "full width" if key == "dev_spearman" else f"first {key.split('@')[1]} features"
            axes[2].plot(*zip(*points), marker="o", label=label)
        axes[2].set(title="dev Spearman", xlabel="step")
        axes[2].legend(fontsize="small")
    for axis in axes:
        axis.grid(alpha=0.3)
    # the steps drawn, in the PNG's text chunk too: what a reader (or a test) checks without reading pixels
    drawn = {"steps": steps, "dev_steps": [row["step"] for row in eval_rows]}
    figure.savefig(png_path, dpi=110, metadata={CURVES_METADATA_KEY: json.dumps(drawn)})
    plt.close(figure)
    return png_path

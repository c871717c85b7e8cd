"""--report-to (tracking.py): each reporter gets the rows metrics.jsonl gets, read back from what it wrote; a
reporter that cannot run fails at start-up; curves.png shows the run's steps."""

import glob
import json
import struct
import time

import pytest
from train_helpers import make_encoder, run_config

from angle_train import tracking
from angle_train.tiny import demo_examples, demo_sts_examples
from angle_train.trainer import train


def _train(tmp_path, **settings):
    cfg = run_config(tmp_path, batch_size=8, max_steps=4, log_every=1, eval_every=2, **settings)
    train(cfg, model=make_encoder("bert"), train_examples=(demo_examples(64), "B"),
          dev_examples=demo_sts_examples(16))
    rows = tracking.read_metrics(str(tmp_path / "metrics.jsonl"))
    return [row for row in rows if "loss" in row], [row for row in rows if "dev_spearman" in row]


def test_report_to_names_are_checked_at_start_up(monkeypatch):
    assert tracking.resolve_report_to(["none"]) == [] and tracking.resolve_report_to("none") == []
    with pytest.raises(ValueError, match="unknown"):
        tracking.resolve_report_to(["tensorbord"])
    with pytest.raises(ValueError, match="leave it out"):
        tracking.resolve_report_to(["none", "wandb"])
    monkeypatch.setitem(tracking.PACKAGES, "wandb", ("no_such_module_here", "wandb"))
    with pytest.raises(ValueError, match="--report-to wandb needs the wandb package: pip install wandb"):
        tracking.resolve_report_to(["all"])


def test_tensorboard_gets_every_metrics_row(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train_rows, eval_rows = _train(tmp_path, report_to=["tensorboard"])
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    for key, rows in (("loss", train_rows), ("lr", train_rows), ("pairs_per_s", train_rows),
                      ("dev_spearman", eval_rows)):
        got = [(event.step, event.value) for event in events.Scalars(key)]
        assert got == [(row["step"], pytest.approx(row[key], rel=1e-6)) for row in rows], key


def _wandb_history(run_file: str) -> list[dict]:
    """The history rows of an offline wandb run, from its transaction log: a 7-byte header, then LevelDB log
    records (32 KiB blocks; each record a 7-byte header: crc, length, type 1 full / 2 first / 3 middle / 4 last)
    holding wandb's Record protobufs."""
    from wandb.proto import wandb_internal_pb2

    data, block, position, pending, rows = open(run_file, "rb").read(), 32768, 7, b"", []
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if position + 7 + length > len(data):  # a record still being written
            break
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def test_wandb_offline_gets_every_metrics_row(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))  # no credentials here: offline by itself
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert tracking.wandb_mode() == "offline"
    train_rows, eval_rows = _train(tmp_path, report_to=["wandb"])
    (run_file,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    deadline = time.monotonic() + 20  # wandb's service writes the file on its own: let it finish the last rows
    while True:
        logged = {}
        for row in _wandb_history(run_file):  # one row per step (an evaluation row joins its step's training row)
            if "_step" in row:  # wandb's own rows (system metrics) have none
                logged.setdefault(row["_step"], {}).update(row)
        if sorted(logged) == [1, 2, 3, 4] and "dev_spearman" in logged[4] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert sorted(logged) == [1, 2, 3, 4], logged
    for row in train_rows + eval_rows:
        for key, value in tracking.numeric(row).items():
            assert logged[row["step"]][key] == pytest.approx(value, rel=1e-9), (row["step"], key)


def test_curves_png_shows_the_runs_steps(tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image

    train_rows, eval_rows = _train(tmp_path)
    path = tmp_path / "curves.png"
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size[0] > 1000  # three panels
        drawn = json.loads(image.text[tracking.CURVES_METADATA_KEY])
    assert {key: drawn[key] for key in ("steps", "dev_steps")} == {"steps": [row["step"] for row in train_rows],
                                                                    "dev_steps": [row["step"] for row in eval_rows]}
    assert drawn["steps"] == [1, 2, 3, 4] and drawn["dev_steps"] == [2, 4]

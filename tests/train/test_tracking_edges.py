"""angle_train.tracking's reporters and curves at their edges (beyond test_tracking.py): the step as the x axis, never
a metric; wandb's online modes, credentials, server probe and project; the metrics rows it reads back; the dev
score axis. No network: the server probe and wandb itself are stood in for."""

from __future__ import annotations

import os
import sys

import pytest

def test_reporters_get_the_rows_numbers_without_the_step():
    """The step is the x axis each reporter is given, not a metric of its own; booleans count as 0 / 1, text is left
    out."""
    from angle_train.tracking import numeric

    assert numeric({"step": 3, "loss": 0.5, "skipped": True, "note": "x"}) == {"loss": 0.5, "skipped": 1.0}


@pytest.mark.parametrize("mode", ["online", "run", "shared"])
def test_every_online_wandb_mode_falls_back_offline_without_a_server(mode, monkeypatch, capsys):
    """WANDB_MODE online, run or shared all talk to the server: without one answering, the run logs offline instead
    of waiting on the network."""
    from angle_train import tracking

    monkeypatch.setenv("WANDB_MODE", mode)
    monkeypatch.setattr(tracking, "server_answers", lambda url, timeout: False)
    assert tracking.wandb_mode() == "offline"
    monkeypatch.setattr(tracking, "server_answers", lambda url, timeout: True)
    assert tracking.wandb_mode() == mode


def test_a_wandb_login_in_netrc_is_credentials(tmp_path, monkeypatch):
    """`wandb login` writes ~/.netrc, not WANDB_API_KEY: with it (and the server answering) the run is online; a
    login for another machine, or a ~/.netrc that netrc cannot parse, is no credentials (offline, not a crash)."""
    from angle_train import tracking

    for name in ("WANDB_MODE", "WANDB_API_KEY", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password 0123456789abcdef\n")
    os.chmod(tmp_path / ".netrc", 0o600)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(tracking, "server_answers", lambda url, timeout: True)
    assert tracking.wandb_mode() == "online"
    for other in ("machine example.org\n  login user\n  password x\n",
                  "machine api.wandb.ai\n  login user\n  frobnicate x\n"):
        (tmp_path / ".netrc").write_text(other)
        assert tracking.wandb_mode() == "offline", other


@pytest.mark.parametrize("url,port", [("http://wandb.local", 80), ("https://wandb.local", 443),
                                      ("http://wandb.local:8080", 8080), ("wandb.local", 443),
                                      ("wandb.local:8080", 8080)])
def test_the_wandb_server_probe_uses_the_urls_port(url, port, monkeypatch):
    """A local wandb server at http://host (WANDB_BASE_URL) listens on port 80: the probe must knock there; a URL
    without a scheme is an https one (its host and port, not a scheme named after the host)."""
    from angle_train import tracking

    knocked = []

    class Connection:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(tracking.socket, "create_connection",
                        lambda address, timeout: (knocked.append(address), Connection())[1])
    assert tracking.server_answers(url, 1.0)
    assert knocked == [("wandb.local", port)]


def test_a_step_that_is_a_boolean_is_no_metrics_row():
    """metrics_row takes a whole-number step only: JSON true is not step 1."""
    from angle_train.tracking import metrics_row

    assert metrics_row('{"step": 2, "loss": 1.0}') == {"step": 2, "loss": 1.0}
    assert metrics_row('{"step": true, "loss": 1.0}') is None


def test_a_metrics_line_is_strict_json_with_null_for_what_is_not_finite():
    """NaN, Infinity and -Infinity (json.dumps's defaults, which jq and JavaScript's JSON.parse refuse) are written as
    null, in nested values too; number_at reads null back as NaN, and takes no boolean for a number."""
    import json
    import math

    from angle_train.tracking import metrics_line, metrics_row, number_at

    row = {"step": 2, "loss": math.nan, "grad_norm": math.inf, "lr": -math.inf, "skipped": True,
           "dims": [1.0, math.nan], "scores": {"a": math.inf}, "note": "x"}
    line = metrics_line(row)
    assert line.endswith("\n") and line.count("\n") == 1
    assert json.loads(line, parse_constant=lambda constant: pytest.fail(f"{constant} in {line}")) == {
        "step": 2, "loss": None, "grad_norm": None, "lr": None, "skipped": True, "dims": [1.0, None],
        "scores": {"a": None}, "note": "x"}
    read = metrics_row(line)
    assert math.isnan(number_at(read, "loss")) and number_at(read, "skipped") is None
    assert number_at(read, "absent") is None and number_at(read, "note") is None
    assert math.isnan(number_at(metrics_row('{"step": 1, "loss": NaN}'), "loss"))  # a line written before the rule


def test_a_row_without_a_finite_loss_is_a_gap_in_the_loss_curve(tmp_path):
    """A row of skipped steps only holds a null loss: a point of the curve (a gap), its learning rate drawn."""
    drawn = _drawn(tmp_path, [{"step": 1, "loss": 1.0, "lr": 0.1}, {"step": 2, "loss": None, "lr": 0.1},
                              {"step": 3, "loss": 0.8, "lr": 0.1}])
    assert drawn["steps"] == drawn["lr_steps"] == [1, 2, 3]


def test_the_dev_axis_is_at_least_the_minimum_span_wide():
    """Scores a few ten-thousandths apart get an axis MIN_SCORE_SPAN wide, centred on them; a wider spread gets a 10%
    margin each side."""
    from angle_train.tracking import MIN_SCORE_SPAN, score_axis

    low, high = score_axis([0.5, 0.5002])
    assert high - low == pytest.approx(MIN_SCORE_SPAN) and (low + high) / 2 == pytest.approx(0.5001)
    assert score_axis([0.2, 0.6]) == pytest.approx((0.16, 0.64))


def test_wandb_runs_go_to_the_project_wandb_project_names(tmp_path, monkeypatch):
    """$WANDB_PROJECT names the run's project (else "angle-train"); the run is named after OUTPUT_DIR."""
    import types

    from angle_train import tracking

    calls = []
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(
        init=lambda **options: calls.append(options) or "run", Settings=dict))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "my-embeddings")
    tracking.WandbReporter(str(tmp_path / "run-7"), {"lr": 1e-4})
    monkeypatch.delenv("WANDB_PROJECT")
    tracking.WandbReporter(str(tmp_path / "run-8") + os.sep, {})  # --output-dir run-8/ names the run run-8 too
    assert [(c["project"], c["name"], c["mode"]) for c in calls] == [("my-embeddings", "run-7", "offline"),
                                                                      ("angle-train", "run-8", "offline")]


def test_a_wandb_mode_in_the_environment_is_checked_only_when_reporting_to_wandb(monkeypatch):
    """A WANDB_MODE that wandb does not take refuses --report-to wandb at start-up, and nothing else: a run that does
    not report to wandb starts whatever the environment says about it."""
    from angle_train import tracking

    monkeypatch.setenv("WANDB_MODE", "bogus")
    assert tracking.resolve_report_to(["none"]) == []
    monkeypatch.setitem(tracking.PACKAGES, "wandb", ("json", "wandb"))  # importable here, installed or not
    with pytest.raises(ValueError, match="WANDB_MODE=bogus is not a mode wandb takes"):
        tracking.resolve_report_to(["wandb"])


def test_the_wandb_server_is_given_wandb_probe_s_to_answer(monkeypatch):
    """The server probe waits WANDB_PROBE_S seconds, not wandb.init's longer WANDB_INIT_TIMEOUT_S, before the run
    goes offline."""
    from angle_train import tracking

    waited = []
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_BASE_URL", "http://wandb.local:8080")
    monkeypatch.setattr(tracking, "server_answers", lambda url, timeout: waited.append((url, timeout)) or True)
    assert tracking.wandb_mode() == "online"
    assert waited == [("http://wandb.local:8080", tracking.WANDB_PROBE_S)]


def test_a_wandb_server_url_whose_port_is_not_a_number_does_not_answer():
    """WANDB_BASE_URL with a port that is not a number is a server that does not answer (offline), not a crash."""
    from angle_train import tracking

    assert tracking.server_answers("http://wandb.local:port", 1.0) is False


def test_the_wandb_server_probe_gives_up_after_its_timeout(monkeypatch):
    """A connection (or name lookup) still pending after the timeout is a server that does not answer: the probe
    returns then and leaves it behind, rather than waiting for it."""
    import threading

    from angle_train import tracking

    released = threading.Event()

    class Connection:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def slow_connection(address, timeout):
        released.wait(30)
        return Connection()

    monkeypatch.setattr(tracking.socket, "create_connection", slow_connection)
    try:
        assert tracking.server_answers("https://wandb.local", 0.05) is False
    finally:
        released.set()


def test_an_offline_wandb_start_that_fails_is_not_retried(tmp_path, monkeypatch, capsys):
    """wandb.init failing offline is the run's error as it is: no second offline start, no note about online."""
    import types

    from angle_train import tracking

    modes = []

    def init(*, mode, **options):
        modes.append(mode)
        raise OSError("the folder is read-only")

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init, Settings=dict))
    monkeypatch.setenv("WANDB_MODE", "offline")
    with pytest.raises(OSError, match="read-only"):
        tracking.WandbReporter(str(tmp_path), {})
    assert modes == ["offline"] and "could not start online" not in capsys.readouterr().out


def test_every_reporter_asked_for_is_opened(monkeypatch):
    """--report-to all opens each reporter, in order, each given the output folder and the run's settings."""
    from angle_train import tracking

    for name in tracking.REPORTERS:
        monkeypatch.setitem(tracking.REPORTER_CLASSES, name, lambda output_dir, config, name=name: (name, output_dir,
                                                                                                     config))
    assert tracking.open_reporters(["tensorboard", "wandb"], "out", {"lr": 1}) == [("tensorboard", "out", {"lr": 1}),
                                                                                    ("wandb", "out", {"lr": 1})]


def test_a_line_that_is_not_utf8_is_no_metrics_row(tmp_path):
    """Bytes that are not UTF-8 in metrics.jsonl (a line torn by a kill) are skipped, not an error reading the rest."""
    from angle_train.tracking import metrics_row, read_metrics

    assert metrics_row(b'{"step": 1, "loss": \xff}') is None
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1, "loss": 1.0}\n{"step": 2, "lo\xe9\n{"step": 3}\n')
    assert read_metrics(str(tmp_path / "metrics.jsonl")) == [{"step": 1, "loss": 1.0}, {"step": 3}]


def _drawn(tmp_path, rows):
    """What plot_curves drew for these metrics rows (the PNG's metadata), or None where it drew nothing."""
    import json

    pytest.importorskip("matplotlib")
    from PIL import Image

    from angle_train import tracking

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    png = tmp_path / "curves.png"
    if tracking.plot_curves(str(tmp_path / "metrics.jsonl"), str(png)) is None:
        assert not png.exists()
        return None
    with Image.open(png) as image:
        return json.loads(image.text[tracking.CURVES_METADATA_KEY])


def test_damaged_rows_are_left_out_of_the_curves(tmp_path):
    """A training row without a learning rate, or holding true for a number, and a dev score of true are no points of
    the curves (hand-edited rows), not a crash or a point at 1."""
    drawn = _drawn(tmp_path, [{"step": 1, "loss": 1.0, "lr": 0.1}, {"step": 2, "loss": 0.9},
                              {"step": 3, "loss": True, "lr": 0.1}, {"step": 4, "loss": 0.8, "lr": True},
                              {"step": 2, "dev_spearman": 0.5}, {"step": 3, "dev_spearman": True}])
    assert (drawn["steps"], drawn["dev_steps"], drawn["lr_steps"]) == ([1], [2], [1])


def test_no_curves_without_a_training_row(tmp_path):
    """A run stopped after its first evaluation and before its first logged step draws no curves.png."""
    assert _drawn(tmp_path, [{"step": 0, "dev_spearman": 0.5}]) is None


def test_the_dev_axis_holds_every_trained_widths_scores(tmp_path):
    """The dev panel's axis spans the scores at every width drawn, the narrower widths' too, not the full width's
    alone."""
    drawn = _drawn(tmp_path, [{"step": 1, "loss": 1.0, "lr": 0.1},
                              {"step": 1, "dev_spearman": 0.80, "dev_spearman@16": 0.40},
                              {"step": 2, "dev_spearman": 0.82, "dev_spearman@16": 0.45}])
    low, high = drawn["dev_ylim"]
    assert drawn["dev_steps"] == [1, 2] and low < 0.40 and 0.82 < high


def test_curves_that_fail_to_be_drawn_leave_the_earlier_curves_png(tmp_path, monkeypatch):
    """A drawing that fails midway (a full disk) leaves the curves.png that was there, whole, and no curves.png.tmp."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure
    from train_helpers import full_disk_midway

    from angle_train import tracking

    assert _drawn(tmp_path, [{"step": 1, "loss": 1.0, "lr": 0.1}, {"step": 2, "loss": 0.9, "lr": 0.1}])["steps"] == \
        [1, 2]
    earlier = (tmp_path / "curves.png").read_bytes()
    full_disk_midway(monkeypatch, Figure, "savefig")
    with pytest.raises(OSError, match="No space left on device"):
        tracking.plot_curves(str(tmp_path / "metrics.jsonl"), str(tmp_path / "curves.png"))
    assert (tmp_path / "curves.png").read_bytes() == earlier
    assert sorted(os.listdir(tmp_path)) == ["curves.png", "metrics.jsonl"]

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
    """`wandb login` writes ~/.netrc, not WANDB_API_KEY: with it (and the server answering) the run is online."""
    from angle_train import tracking

    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password 0123456789abcdef\n")
    os.chmod(tmp_path / ".netrc", 0o600)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(tracking, "server_answers", lambda url, timeout: True)
    assert tracking.wandb_mode() == "online"
    (tmp_path / ".netrc").write_text("machine example.org\n  login user\n  password x\n")
    assert tracking.wandb_mode() == "offline"


@pytest.mark.parametrize("url,port", [("http://wandb.local", 80), ("https://wandb.local", 443),
                                      ("http://wandb.local:8080", 8080)])
def test_the_wandb_server_probe_uses_the_urls_port(url, port, monkeypatch):
    """A local wandb server at http://host (WANDB_BASE_URL) listens on port 80: the probe must knock there."""
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
    tracking.WandbReporter(str(tmp_path / "run-8"), {})
    assert [(c["project"], c["name"], c["mode"]) for c in calls] == [("my-embeddings", "run-7", "offline"),
                                                                      ("angle-train", "run-8", "offline")]

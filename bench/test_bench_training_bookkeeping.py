"""bench/bench_training.py's bookkeeping, which a rare GPU command relies on: a run forecast past what is left is not
started, a run short of its steps or killed at its own timeout is no measurement, abandoned rounds are neither done,
summarised nor compared, a resume abandons what a killed command left and merges what it did not, the budget counts
the start-up spent and leaves warm-ups their share, results.json is written after every run, and the command says
what is done or left. Stand-in runs and clocks; nothing trains."""

from __future__ import annotations

import math
import sys
import time
from types import SimpleNamespace

import pytest

import bench_training as bt


def _bench(runs, budget, run_timeout=1000.0):
    """A Benchmark with no data, models or processes: one setting "s", one contender "c" (angle-train, no flags),
    the recorded `runs`, and `budget` (a CommandBudget or None)."""
    b = object.__new__(bt.Benchmark)
    b.args = SimpleNamespace(run_timeout=run_timeout, pack_width=1, gpu=True)
    b.results = {"runs": list(runs), "settings": {}, "skipped": [], "not_run": []}
    b.contenders = {"c": ("ours", [])}
    b.budget, b.stopped, b.ran, b.failed = budget, None, 0, set()
    return b


SETTING = SimpleNamespace(name="s", chunk=0, model=None)


def test_a_run_forecast_past_what_is_left_is_not_started(monkeypatch):
    """With 50 s left and a recorded run of the same length that took 100 s, the run is not started (a run that
    would only be killed at the budget's end wastes the GPU's time): the command stops, saying why."""
    monkeypatch.setattr(bt, "run_child", lambda *a, **k: pytest.fail("a run that cannot fit was started"))
    done = {"setting": "s", "contender": "c", "steps": 2, "seconds": 100.0, "ok": True, "rep": 1}
    b = _bench([done], bt.CommandBudget(50.0, 20.0))
    assert b.run(SETTING, "c", 2, 2, "timed") is None
    assert b.stopped and "does not fit" in b.stopped and "~100 s" in b.stopped


def _runnable(monkeypatch, tmp_path, record, steps_done, budget=None, run_timeout=1000.0):
    """_bench whose one run's process is a stand-in returning `record`, the run's steps counted `steps_done`."""
    monkeypatch.setattr(bt, "COMMANDS", {"ours": lambda *a: ["stand-in"]})
    monkeypatch.setattr(bt, "steps_done", lambda kind, rec, workdir: steps_done)
    monkeypatch.setattr(bt, "in_process_steps", lambda *a: None)
    timeouts = []

    def run_child(argv, workdir, timeout, env=None):
        timeouts.append(timeout)
        return {"seconds": 1.0, "peak_rss_bytes": 1, "timed_out": False, "tail": ["x"], **record}

    monkeypatch.setattr(bt, "run_child", run_child)
    b = _bench([], budget, run_timeout=run_timeout)
    b.scratch, b.models, b.target, b.env = tmp_path, {None: "m"}, None, None
    b.save = lambda: None
    return b, timeouts


def test_a_run_that_exits_well_short_of_its_steps_is_not_ok(monkeypatch, tmp_path):
    """Exit 0 with fewer steps than asked (the data ran out, a trainer's early stop) is no measurement of S steps:
    the run is not ok, so the round is not recorded done and no step time comes from it."""
    b, _ = _runnable(monkeypatch, tmp_path, {"returncode": 0}, steps_done=1)
    record = b.run(SETTING, "c", 1, 2, "timed")
    assert record["ok"] is False and record["steps_done"] == 1
    b, _ = _runnable(monkeypatch, tmp_path, {"returncode": 0}, steps_done=2)
    assert b.run(SETTING, "c", 1, 2, "timed")["ok"] is True


def test_a_run_killed_at_its_own_run_timeout_is_a_failure_not_a_budget_stop(monkeypatch, tmp_path):
    """Killed at --run-timeout (not cut short by the time budget): a failed run (on a GPU not tried again in the
    setting), not "stopped" (which would stop the command and have every --resume run it, and hang, again)."""
    b, timeouts = _runnable(monkeypatch, tmp_path, {"returncode": -9, "timed_out": True}, steps_done=0,
                            run_timeout=30.0)
    record = b.run(SETTING, "c", 1, 2, "timed")
    assert timeouts == [30.0] and record is not None and "stopped" not in record and not record["ok"]
    assert b.stopped is None and b.failed == {("s", "c")}
    # cut short by the budget (a timeout below --run-timeout): stopped
    b, timeouts = _runnable(monkeypatch, tmp_path, {"returncode": -9, "timed_out": True}, steps_done=0,
                            budget=bt.CommandBudget(20.0, 5.0), run_timeout=30.0)
    assert b.run(SETTING, "c", 1, 2, "timed") is None and timeouts[0] <= 20.0
    assert b.results["runs"][-1]["stopped"] == "time budget" and b.stopped


def test_a_round_of_abandoned_runs_is_not_done():
    """A round's runs abandoned (its command stopped in it) count for nothing: the summary leaves them out, so the
    round is not done and --resume runs it again; once every run of it is recorded not abandoned, it is done."""
    def run(steps, **extra):
        return {"setting": "s", "contender": "c", "rep": 1, "steps": steps, "ok": True, **extra}

    b = _bench([run(1, abandoned=True), run(2, abandoned=True)], None)
    b.args.steps, b.args.steps_given = (1, 2), True
    b.unsupported = {}
    setting = SimpleNamespace(name="s", chunk=0, steps=None, token_budget=None)
    monkey_applies = bt.applies
    try:
        bt.applies = lambda flags, s: True
        assert not b.round_done(setting, 1) and b.left([(setting, 1)]) == ["s rep 1"]
        b.results["runs"] += [run(1), run(2)]
        assert b.round_done(setting, 1) and b.left([(setting, 1)]) == []
    finally:
        bt.applies = monkey_applies


def test_resume_abandons_the_runs_of_a_round_a_killed_command_left_unfinished(tmp_path):
    """A command killed from outside mid-round (its results.json saved after each run, nothing marked): --resume
    runs that round again whole, so the runs it left are abandoned (out of the summary and the loss comparison);
    a round recorded whole keeps its runs."""
    def run(rep, steps, contender):
        return {"setting": "s", "contender": contender, "rep": rep, "steps": steps, "ok": True, "seconds": 1.0,
                "kind": "ours"}

    setting = SimpleNamespace(name="s", chunk=0, steps=None)
    args = SimpleNamespace(time_budget=None, gpu=False, setting_list=[setting], steps=(1, 2), steps_given=True)
    partial = [run(1, 1, "a"), run(1, 1, "b"), run(1, 2, "a")]
    whole = [run(2, s, c) for s in (1, 2) for c in ("a", "b")]
    results = {"runs": partial + whole, "skipped": [], "settings": {}}
    b = bt.Benchmark(args, results, {"out": tmp_path, "scratch": tmp_path}, {"a": ("ours", []), "b": ("ours", [])},
                     {}, None, None, None, None, time.monotonic())
    assert all(r.get("abandoned") for r in partial) and not any(r.get("abandoned") for r in whole)
    assert b.round_done(setting, 2) and not b.round_done(setting, 1)
    assert [(r["rep"], r["steps"]) for r in bt.compared_runs(results, setting)] == [(2, 1)] * 2 + [(2, 2)] * 2


def test_a_round_whose_runs_and_warm_ups_exceed_a_command_is_too_long():
    """Runs forecast 35 s + 40 s fit a 100 s command alone, but not with the 30 s warm-up it needs before them: the
    round is passed (recorded not run) instead of being started, and stopped, by every command of that budget."""
    def run(steps, seconds):
        return {"setting": "s", "contender": "c", "rep": 1, "steps": steps, "ok": True, "seconds": seconds}

    b = _bench([run(1, 30.0), run(2, 35.0), run(3, 40.0)], bt.CommandBudget(100.0, 100.0 * bt.WARM_UP_SHARE))
    b.args.steps, b.args.steps_given, b.args.time_budget, b.args.warmup_runs = (2, 3), True, 100.0, 1
    b.unsupported, b.warmed, b.startup = {}, [], 0.0
    setting = SimpleNamespace(name="s", chunk=0, steps=None)
    assert b.round_forecast(setting) == (75.0, 30.0)
    why = b.too_long(setting)
    assert why is not None and "estimated 105 s with its warm-ups" in why
    b.warmed = ["s"]  # its warm-ups already run in this command: the round fits
    assert b.too_long(setting) is None


@pytest.mark.parametrize("budget,kept", [(200.0, True), (300.0, True), (600.0, False)])
def test_a_round_passed_as_too_long_is_tried_again_by_a_larger_budget_only(budget, kept):
    """results.json's not_run holds the rounds a command of --time-budget 300 could not run: a command of no larger
    budget passes them too, one of a larger budget (what "raise --time-budget" asks for) tries them again."""
    b = _bench([], bt.CommandBudget(budget, budget * bt.WARM_UP_SHARE))
    b.args.time_budget = budget
    b.results["not_run"] = [{"setting": "s", "rep": 1, "why": "too long", "time_budget": 300.0}]
    b.run_all([])
    assert b.results["not_run"] == ([{"setting": "s", "rep": 1, "why": "too long", "time_budget": 300.0}]
                                    if kept else [])
    assert b.passed(SETTING, 1) == kept


def test_the_summary_leaves_out_abandoned_rounds():
    """Step times and failures come from rounds recorded whole: an abandoned round's runs (its command stopped in
    it; it is run again) give no estimate, and its budget-killed run is no failure."""
    def run(contender, rep, steps, seconds, ok=True, **extra):
        return {"setting": "s", "contender": contender, "kind": "ours" if contender == "a" else "st", "rep": rep,
                "steps": steps, "seconds": seconds, "ok": ok, "peak_rss_bytes": 1, **extra}

    runs = [run(c, 1, s, 10.0 + 2.0 * (s - 1)) for s in (1, 2) for c in ("a", "b")]
    runs += [run("a", 2, 1, 10.0, abandoned=True), run("b", 2, 1, 10.0, abandoned=True),
             run("a", 2, 2, 20.0, abandoned=True),
             run("b", 2, 2, 5.0, ok=False, abandoned=True, stopped="time budget", timed_out=True, tail=["..."])]
    setting = SimpleNamespace(name="s", batch=4)
    results = {"runs": runs, "skipped": [], "settings": {"s": {"tokens_per_step": 40}}}
    rows = bt.summarise(results, [setting], {"a": ("ours", ()), "b": ("st", ())}, lambda s: (1, 2))
    assert {r["contender"]: r["estimates_s"] for r in rows} == {"a": [2.0], "b": [2.0]}
    assert all(r["failed_runs"] == 0 and "failure" not in r for r in rows)


def test_losses_are_compared_on_rounds_recorded_whole_only():
    """An abandoned round's runs (run again whole later) are out of the loss comparison, however far apart."""
    def run(kind, rep, losses, **extra):
        return {"setting": "s", "contender": kind, "kind": kind, "rep": rep, "steps": 2, "ok": True,
                "in_process": {"losses": losses}, "said": {"batch_order": "angle-train"}, **extra}

    results = {"settings": {"s": {}}, "runs": [run("ours", 1, [1.0, 1.0]), run("st", 1, [1.0, 1.0]),
                                               run("ours", 2, [1.0, 1.0], abandoned=True),
                                               run("st", 2, [2.0, 2.0], abandoned=True)]}
    agreement = bt.loss_agreement(results, [SimpleNamespace(name="s")])["s"]
    assert agreement["max_rel_diff"] == 0.0 and agreement["steps_compared"] == 2


def test_the_forecast_of_a_length_is_its_longest_run():
    """Several runs of the same length that ended well: the forecast is the longest (a run that cannot end in what is
    left is not started; the fastest would start runs the budget then kills)."""
    def run(steps, seconds):
        return {"steps": steps, "seconds": seconds, "ok": True}

    assert bt.forecast_seconds([run(2, 5.0), run(2, 9.0), run(2, 7.0)], 2) == 9.0


def test_the_command_budget_counts_the_start_up_already_spent(tmp_path):
    """--time-budget 100 after 30 s of start-up (imports, models, data): 70 s are left for the runs, so that the
    command ends inside the limit it was given (gpu_suite kills it past that)."""
    setting = SimpleNamespace(name="s", chunk=0, steps=None)
    args = SimpleNamespace(time_budget=100.0, gpu=True, setting_list=[setting], steps=(1, 2), steps_given=True)
    b = bt.Benchmark(args, {"runs": [], "skipped": [], "settings": {}}, {"out": tmp_path, "scratch": tmp_path},
                     {"c": ("ours", [])}, {}, None, None, None, None, time.monotonic() - 30.0)
    assert b.startup == pytest.approx(30.0, abs=1.0)
    assert 65.0 < b.budget.left("timed") <= 70.0
    assert b.budget.allowed["warm_up"] == pytest.approx(100.0 * bt.WARM_UP_SHARE)


def test_results_json_is_written_after_every_run(monkeypatch, tmp_path):
    """A command killed from outside (the GPU step's limit) keeps every run it finished: results.json is rewritten
    as each run ends, not only at the end."""
    import json

    b, _ = _runnable(monkeypatch, tmp_path, {"returncode": 0}, steps_done=2)
    del b.save  # the real one
    b.out = tmp_path
    b.run(SETTING, "c", 1, 2, "timed")
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [(r["setting"], r["contender"], r["steps"], r["ok"]) for r in saved["runs"]] == [("s", "c", 2, True)]


def test_the_timed_runs_may_take_the_warm_ups_unused_allowance():
    """CommandBudget: the warm-ups stay inside their third, the timed runs may take everything left before the
    end (a timed run needs its warm-up first: time kept back from it would be lost)."""
    budget = bt.CommandBudget(90.0, 30.0)
    assert 85.0 < budget.left("timed") <= 90.0 and 25.0 < budget.left("warm_up") <= 30.0
    budget.charge("warm_up", 10.0)  # the allowance charged, not the clock: what is left before the end is unchanged
    assert 85.0 < budget.left("timed") <= 90.0 and 15.0 < budget.left("warm_up") <= 20.0
    assert budget.summary()["timed"]["allowed_s"] == 90.0  # results.json's budgets: what the timed runs had


def test_equal_losses_are_zero_apart_even_at_zero():
    assert bt.relative_difference(0.0, 0.0) == 0.0 and bt.relative_difference(1.0, 1.0) == 0.0
    assert bt.relative_difference(1.0, 0.0) == math.inf


def test_a_warm_up_killed_by_the_budget_is_no_failure_in_the_summary():
    """A setting whose only run is a warm-up the time budget killed (stopped, left for --resume) has no row: it is
    not reported as a failed setting."""
    stopped = {"setting": "s", "contender": "a", "kind": "ours", "rep": 0, "steps": 1, "seconds": 9.0, "ok": False,
               "stopped": "time budget", "timed_out": True, "tail": ["..."], "peak_rss_bytes": 1}
    results = {"runs": [stopped], "skipped": [], "settings": {"s": {"tokens_per_step": 40}}}
    assert bt.summarise(results, [SimpleNamespace(name="s", batch=4)], {"a": ("ours", ())}, lambda s: (1, 2)) == []
    failed = {**stopped, "stopped": None, "timed_out": False, "tail": ["torch.OutOfMemoryError: CUDA out of memory"]}
    results["runs"] = [failed]
    (row,) = bt.summarise(results, [SimpleNamespace(name="s", batch=4)], {"a": ("ours", ())}, lambda s: (1, 2))
    assert row["failed_runs"] == 1 and row["failure"] == "out of memory"


def test_cpu_warm_ups_are_every_contenders_short_run():
    b = _bench([], None)
    b.args.gpu, b.args.steps, b.args.steps_given, b.args.warmup_runs = False, (2, 5), True, 1
    b.unsupported, b.warmed = {}, []
    setting = SimpleNamespace(name="s", chunk=0, steps=None)
    assert b.warm_ups_before(setting) == [("c", 2)]


def test_the_forecast_between_two_lengths_is_never_below_the_shorter_ones_time():
    """Two lengths known, the longer one faster (noise): a length between them is forecast at least the shorter's
    time, not the faster one's."""
    def run(steps, seconds):
        return {"steps": steps, "seconds": seconds, "ok": True}

    assert bt.forecast_seconds([run(2, 10.0), run(4, 8.0)], 3) == 10.0


def test_the_summary_reports_the_long_runs_rss_and_the_largest_peak_memory():
    def run(rep, steps, rss, memory):
        return {"setting": "s", "contender": "a", "kind": "ours", "rep": rep, "steps": steps,
                "seconds": 10.0 + steps, "ok": True, "peak_rss_bytes": rss,
                "in_process": {"step_s": [1.0, 0.5], "losses": [1.0, 1.0], "peak_memory_bytes": memory}}

    runs = [run(1, 1, 100, 5), run(1, 2, 300, 9), run(2, 1, 100, 6), run(2, 2, 300, 7)]
    results = {"runs": runs, "skipped": [], "settings": {"s": {"tokens_per_step": 40}}}
    (row,) = bt.summarise(results, [SimpleNamespace(name="s", batch=4)], {"a": ("ours", ())}, lambda s: (1, 2))
    assert row["peak_rss_bytes"] == 300 and row["peak_memory_bytes"] == 9


def test_a_resumable_command_says_done_or_what_is_left(tmp_path, monkeypatch, capsys):
    """The last line of a --resume / --time-budget command: "done" when nothing is left, else "left: ...". The
    GPU run's operator reads it."""
    import test_bench_training as tbt

    monkeypatch.setattr(bt, "run_child", tbt.stand_in_trainers([], clock=tbt.virtual_clock(monkeypatch)))
    out = tmp_path / "out"
    assert bt.main(tbt.resumable_gpu_command(out, "minilm-plain64", reps=1, budget=300)) == 0
    said = capsys.readouterr().out.strip().splitlines()
    assert said[-1].startswith("done: nothing left to run") and not any(line.startswith("left:") for line in said)


def test_given_steps_override_a_settings_own():
    b = _bench([], None)
    setting = SimpleNamespace(name="s", steps=(1, 3))
    b.args.steps, b.args.steps_given = (2, 4), True
    assert b.steps_of(setting) == (2, 4)
    b.args.steps_given = False
    assert b.steps_of(setting) == (1, 3)


def test_resume_refuses_results_whose_identity_lacks_a_key_now_part_of_it(tmp_path):
    """Results written before a key joined the identity (an older bench) were not made under it: refused."""
    import json

    path = tmp_path / "results.json"
    path.write_text(json.dumps({"identity": {"settings": 1}}))
    stored, why = bt.load_results(path, {"settings": 1, "pack_width": 64})
    assert stored is None and "pack_width" in why
    assert bt.load_results(path, {"settings": 1})[0] is not None


def test_resume_with_other_contenders_and_settings_summarises_them_all(tmp_path, monkeypatch):
    """--resume may name other contenders and settings (the identity fixes only what they are): the summary and
    the table cover every one measured, in either command."""
    import json

    import test_bench_training as tbt

    monkeypatch.setattr(bt, "run_child", tbt.stand_in_trainers([], clock=tbt.virtual_clock(monkeypatch)))
    out = tmp_path / "out"
    first = tbt.resumable_gpu_command(out, "minilm-plain64", reps=1, budget=600)
    assert bt.main(first) == 0
    second = [*first]
    second[second.index("--contenders") + 1] = "ours-padded,st"
    second[second.index("--settings") + 1] = "minilm-plain64,minilm-cached1k"
    assert bt.main(second) == 0
    results = json.loads((out / "results.json").read_text())
    rows = {(r["setting"], r["contender"]) for r in results["summary"]}
    # (minilm-plain64's round, not done for ours-padded, is run again whole: ours-packed's runs of it abandoned)
    assert set(results["contenders"]) == {"ours-packed", "ours-padded", "st"}
    assert ("minilm-plain64", "ours-padded") in rows and ("minilm-plain64", "st") in rows
    assert ("minilm-cached1k", "ours-padded") in rows and set(results["steps"]) >= {"minilm-plain64",
                                                                                   "minilm-cached1k"}


def test_a_resume_with_fewer_repetitions_keeps_the_count_its_results_hold(tmp_path, monkeypatch):
    """results.json's repetition count says how many repetitions its medians may hold: a --resume asking for fewer
    leaves the first command's larger count (and one asking for more raises it)."""
    import json

    import test_bench_training as tbt

    monkeypatch.setattr(bt, "run_child", tbt.stand_in_trainers([], clock=tbt.virtual_clock(monkeypatch)))
    out = tmp_path / "out"
    for reps, recorded in ((2, 2), (1, 2), (3, 3)):
        assert bt.main(tbt.resumable_gpu_command(out, "minilm-plain64", reps=reps, budget=600)) == 0
        assert json.loads((out / "results.json").read_text())["reps"] == recorded


@pytest.mark.parametrize("gpu", [True, False])
def test_only_a_gpu_run_stops_trying_a_contender_that_failed(tmp_path, gpu):
    """On a GPU a failed run (out of memory: a larger batch would too) takes its contender out of the setting for
    later commands; on CPU it is tried again (nothing there fails for the size of a batch)."""
    setting = SimpleNamespace(name="s", chunk=0, steps=None)
    args = SimpleNamespace(time_budget=None, gpu=gpu, setting_list=[setting], steps=(1, 2), steps_given=True)
    failed = {"setting": "s", "contender": "c", "rep": 1, "steps": 1, "ok": False, "seconds": 1.0}
    b = bt.Benchmark(args, {"runs": [failed], "skipped": [], "settings": {}}, {"out": tmp_path, "scratch": tmp_path},
                     {"c": ("ours", [])}, {}, None, None, None, None, time.monotonic())
    assert b.failed == ({("s", "c")} if gpu else set())
    assert b.active(setting) == ([] if gpu else ["c"])


def test_the_steps_a_run_made_are_read_from_angle_trains_summary_line(tmp_path):
    """angle-train's last line counts its steps ("done: 1 step | ...", "done: 2 steps | ..."); a run that never
    printed it (killed, failed) made none the benchmark can count."""
    for steps, line in ((1, "done: 1 step | loss 0.5000 (mean of the last 1 step) | 9.0 pairs/s"),
                        (12, "done: 12 steps | loss 0.5000 (mean of the last 4 steps) | 9.0 pairs/s")):
        record = {"tail": ["angle_train: ...", line, "curves.png written"]}
        assert bt.steps_done("ours", record, tmp_path) == steps and record["said"] == line
    assert bt.steps_done("ours", {"tail": ["Traceback (most recent call last):"]}, tmp_path) is None



def _summary_results():
    """One setting "s" (S1, S2 = 1, 3; 4 pairs, 40 tokens a step; angle-train's tokenising 0.5 s a step): "a"
    (angle-train) of per-repetition estimates 1.0, 1.5 and 4.0 s with its per-step logs and a warm-up run,
    sentence-transformers' "b" (3 s) and "c" (6 s), "d" whose only run failed and "e" skipped as unsupported."""
    def run(contender, rep, steps, seconds, ok=True, step_s=None, **extra):
        kind = "ours" if contender == "a" else "st"
        record = {"setting": "s", "contender": contender, "kind": kind, "rep": rep, "steps": steps,
                  "seconds": seconds, "ok": ok, "peak_rss_bytes": 5e8 if steps == 3 else 1e8, **extra}
        if step_s:
            record["in_process"] = {"step_s": step_s, "losses": [], "peak_memory_bytes": None}
        return record

    long_logs = {1: [6.0, 1.0, 2.0, 3.0], 2: [9.0, 3.0, 4.0], 3: [6.0, 5.0, 5.0, 5.0]}
    runs = [run("a", 0, 1, 30.0, step_s=[20.0])]
    for rep, estimate in ((1, 1.0), (2, 1.5), (3, 4.0)):
        runs += [run("a", rep, 1, 10.0, step_s=[4.0]), run("a", rep, 3, 10.0 + 2 * estimate, step_s=long_logs[rep])]
        runs += [run(c, rep, steps, 10.0 + (steps - 1) * e) for c, e in (("b", 3.0), ("c", 6.0)) for steps in (1, 3)]
    runs += [run("d", 1, 1, 1.0, ok=False, tail=["Traceback", "RuntimeError: boom"]),
             run("e", 1, 1, 1.0, ok=False, tail=["unsupported: an older sentence-transformers"])]
    stats = {"tokens_per_step": 40, "angle_train_tokenise_per_step_s": 0.5}
    results = {"runs": runs, "skipped": [{"setting": "s", "contender": "e", "why": "unsupported", "unsupported": True}],
               "settings": {"s": stats}}
    contenders = {name: ("ours" if name == "a" else "st", ()) for name in "abcde"}
    return results, bt.summarise(results, [SimpleNamespace(name="s", batch=4)], contenders, lambda s: (1, 3))



def test_the_summary_reports_the_median_step_its_spread_its_rates_and_the_ratio_to_sentence_transformers():
    """The figures the README's training table reports: the median of the per-repetition estimates (T(S2) - T(S1))
    / (S2 - S1) with their min and max, pairs and tokens per second, sentence-transformers' fastest over this, the
    same with angle-train's tokenising charged, and from the trainer's own logs its first steps and warm step."""
    _, rows = _summary_results()
    by = {r["contender"]: r for r in rows}
    assert list(by) == ["a", "b", "c", "d"]  # "e": skipped as unsupported, no row
    a = by["a"]
    assert a["estimates_s"] == pytest.approx([1.0, 1.5, 4.0])
    assert (a["step_s"], a["min_s"], a["max_s"]) == pytest.approx((1.5, 1.0, 4.0))
    assert a["pairs_per_s"] == pytest.approx(4 / 1.5) and a["tokens_per_s"] == pytest.approx(40 / 1.5)
    assert a["st_best_over_this"] == pytest.approx(3.0 / 1.5)
    assert a["step_s_tokenising_charged"] == pytest.approx(2.0)
    assert a["pairs_per_s_tokenising_charged"] == pytest.approx(2.0)
    assert a["st_best_over_this_tokenising_charged"] == pytest.approx(1.5)
    assert by["b"]["step_s_tokenising_charged"] == pytest.approx(3.0)  # sentence-transformers: nothing charged
    # first steps of the timed runs (4, 4, 4, 6, 9, 6), the median of each long run's later steps (2, 3.5, 5) and
    # the warm-up run's first step (empty caches)
    assert a["first_step_s"] == 5.0 and a["in_process_step_s"] == 3.5 and a["first_step_empty_caches_s"] == 20.0
    assert by["d"]["failed_runs"] == 1 and "step_s" not in by["d"] and by["d"]["failure"] == "RuntimeError: boom"



def test_the_cpu_table_prints_the_summary_as_measured():
    results, rows = _summary_results()
    results.update(machine={"cpu": "a CPU", "cpu_count": 2, "torch_threads": 2}, steps=[1, 3], reps=3,
                   contenders={}, versions={"torch": "x"}, command="bench")
    lines = bt.table_lines(rows, results)
    (a,) = [line for line in lines if line.startswith("| s | a |")]
    assert a.startswith("| s | a | 1.5 s (1 s - 4 s) | 2.7 | 2.0 | 26.7 | 500 MB | 2.00x | 1.50x |"), a
    assert "Step time = (T(3 steps) - T(1 steps)) / 2," in "\n".join(lines)
    # why the runs failed, as the GPU table says it (a ModuleNotFoundError of a missing sentence-transformers)
    assert "| s | d | no estimate (1 runs failed: RuntimeError: boom) |" in "\n".join(lines)



def test_the_gpu_table_counts_the_repetitions_and_says_where_a_contender_is_absent():
    results, rows = _summary_results()
    results["settings"]["t"] = {}
    results["skipped"].append({"setting": "t", "contender": "e", "why": "unsupported"})
    results.update(machine={"gpu": "a GPU"}, steps={}, reps=3, contenders={}, versions={"torch": "x"},
                   command="bench", models={}, data="generated",
                   shared={"device": "cuda", "precision": "bf16", "attention": "sdpa"})
    lines = bt.gpu_table_lines(rows, results)
    (a,) = [line for line in lines if line.startswith("| s | a |")]
    assert a.startswith("| s | a | 1.5 s (1 s - 4 s) | 3 | 3.5 s | 5 s | 20 s | 2.7 | 2.0 | 26.7 | n/a | 2.00x | "
                        "1.50x |"), a
    assert "Absent: e (every setting): unsupported" in lines



def test_losses_are_compared_between_runs_of_the_same_length_within_a_2_percent_target():
    """A pair is two runs of the same repetition and length (the same batches), within the target below 2 % apart;
    the difference is taken relative to sentence-transformers' loss."""
    def run(kind, rep, steps, losses):
        record = {"contender": kind, "kind": kind, "rep": rep, "steps": steps, "ok": True,
                  "in_process": {"losses": losses}}
        return {**record, "said": {"batch_order": "angle-train"}} if kind == "st" else record

    apart = bt.losses_apart([run("ours", 1, 2, [1.015625, 1.0]), run("ours", 1, 3, [9.0, 9.0, 9.0])],
                            [run("st", 1, 2, [1.0, 1.0])])
    assert apart["steps_compared"] == 2 and apart["within_target"] and apart["max_rel_diff"] == 0.015625
    assert bt.relative_difference(3.0, 2.0) == 0.5



def test_a_step_log_counts_only_when_it_has_every_step(tmp_path):
    """angle-train's metrics.jsonl gives each step's seconds as batch / pairs_per_s and its peak memory in GiB;
    a log short of a step, or an st-train report with fewer step times than steps, gives none."""
    import json

    (tmp_path / "run").mkdir()
    rows = [{"step": 1, "pairs_per_s": 2.0, "loss": 0.5, "peak_mem_gb": 1.5},
            {"step": 2, "pairs_per_s": 4.0, "loss": 0.4, "peak_mem_gb": 2.0}]
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    setting = SimpleNamespace(batch=8)
    logged = bt.in_process_steps("ours", {}, tmp_path, setting, 2)
    assert logged == {"step_s": [4.0, 2.0], "losses": [0.5, 0.4], "peak_memory_bytes": 2.0 * 2**30}
    assert bt.in_process_steps("ours", {}, tmp_path, setting, 3) is None
    rows[1]["loss"] = None  # a skipped step's loss, which metrics.jsonl holds as null: NaN, no agreement
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    losses = bt.in_process_steps("ours", {}, tmp_path, setting, 2)["losses"]
    assert losses[0] == 0.5 and math.isnan(losses[1]) and bt.relative_difference(losses[1], 0.4) == math.inf
    said = {"step_seconds": [1.0, 1.0], "losses": [0.5, 0.4], "peak_memory_bytes": 7}
    assert bt.in_process_steps("st", {"said": dict(said)}, tmp_path, setting, 3) is None
    assert bt.in_process_steps("st", {"said": dict(said)}, tmp_path, setting, 2)["step_s"] == [1.0, 1.0]



def test_the_command_line_defaults_and_refusals():
    """Three repetitions by default (one for --smoke); a CPU --smoke run warms up nothing, a --gpu --smoke one once;
    S1 must be below S2, a token budget at least 1 and --run-timeout above 0 (0 killed every run as it started, and
    the command exited 0 with a table of failed runs)."""
    _, args = bt.parse_args([])
    assert args.reps == 3 and args.warmup_runs == 1 and args.steps == (2, 6)
    _, smoke = bt.parse_args(["--smoke"])
    assert smoke.reps == 1 and smoke.warmup_runs == 0
    _, gpu_smoke = bt.parse_args(["--smoke", "--gpu", "--device", "cpu"])
    assert gpu_smoke.warmup_runs == 1
    for argv in (["--steps", "3,3"], ["--token-budget", "cached256=0"], ["--run-timeout", "0"],
                 ["--run-timeout", "-5"], ["--run-timeout", "nan"]):
        with pytest.raises(SystemExit):
            bt.parse_args(argv)



def test_the_forecast_of_a_length_ignores_longer_runs_killed_and_never_extrapolates_downwards():
    """A killed 10-step run says nothing of a 2-step run's time; two lengths whose longer one was faster per step
    forecast any length at the shorter one's time, never above it by a line through them."""
    def run(steps, seconds, ok=True):
        return {"steps": steps, "seconds": seconds, "ok": ok, "timed_out": not ok}

    assert bt.forecast_seconds([run(2, 5.0), run(10, 99.0, ok=False)], 2) == 5.0
    assert bt.forecast_seconds([run(2, 10.0), run(4, 8.0)], 8) == 10.0
    assert bt.forecast_seconds([run(2, 10.0), run(4, 8.0)], 1) == 10.0


def test_a_step_time_that_is_not_positive_is_said_to_be_no_estimate():
    """The long runs took less than the short ones (a shared machine's start-up noise, one repetition): the table said
    "-1.44e+04 ms (-1.44e+04 ms - -1.44e+04 ms)" as a step time."""
    assert bt.step_cell({"step_s": 1.5, "min_s": 1.0, "max_s": 4.0}) == "1.5 s (1 s - 4 s)"
    cell = bt.step_cell({"step_s": -14.4, "min_s": -14.4, "max_s": -14.4})
    assert cell.startswith("-14.4 s (-14.4 s - -14.4 s): no estimate, the long runs took no longer than the short")
    assert "more --steps" in cell


def test_st_train_without_sentence_transformers_says_its_contender_is_unsupported(tmp_path, monkeypatch, capsys):
    """sentence-transformers is optional: st-train failed with a ModuleNotFoundError traceback (exit 1), so every
    run of the contender was started again, in every setting, and failed the same way. Exit 4 (unsupported) has the
    benchmark record it once and skip it."""
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)  # its import fails, as where it is not installed
    argv = ["--model", "m", "--train-data", "d.jsonl", "--data-format", "A", "--max-length", "8", "--batch-size", "2",
            "--max-steps", "1", "--output-dir", str(tmp_path)]
    assert bt.st_train(argv) == bt.ST_UNSUPPORTED
    assert "unsupported: sentence-transformers cannot be imported (ModuleNotFoundError" in capsys.readouterr().out


def test_an_out_or_scratch_that_cannot_take_the_runs_is_refused(tmp_path, capsys):
    """--out naming a file failed in mkdir's traceback; --out naming a folder of committed results wrote the runs'
    data, models and results.json among them."""
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    committed = bt.harness.HERE / "results" / "cpu-2026-11-26-training"
    for argv, said in ((["--out", str(a_file)], f"--out {a_file}: is a file, not a folder"),
                       (["--scratch", str(a_file / "sub")], f"cannot create the folder: {a_file} is a file"),
                       (["--out", str(committed)], "would overwrite committed results")):
        with pytest.raises(SystemExit):
            bt.parse_args(argv)
        assert said in capsys.readouterr().err


def test_unknown_contenders_are_refused_before_any_folder_is_made(tmp_path, capsys):
    """--contenders naming one that does not exist was refused after --out and --scratch had been made: an empty
    folder was left behind (in bench/results/ where --out pointed there)."""
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    with pytest.raises(SystemExit):
        bt.main(["--contenders", "foo", "--out", str(out), "--scratch", str(scratch)])
    assert "--contenders: unknown ['foo']" in capsys.readouterr().err
    assert not out.exists() and not scratch.exists()

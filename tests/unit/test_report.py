"""Reading run directories (unmask/runs/report.py) and drawing them (plots.py), on run
directories written by hand: metrics history, status rules, the runs table, the end-of-run
summary, the figures and the PNG files."""

import json
import re
import sys

import pytest
import yaml

from unmask.errors import InputError
from unmask.runs.plots import (
    MISSING_MATPLOTLIB,
    X_LABEL,
    Run,
    build_figures,
    load_runs,
    plot_runs,
)
from unmask.runs.report import (
    find_runs,
    latest_records,
    read_history,
    run_info,
    run_summary,
    runs_table,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def record(step, loss, **extra):
    return {"step": step, "loss": loss, "learning_rate": 1e-3 * step,
            "tokens_per_second": 1000.0 + step, "tokens_seen": 160 * step, **extra}  # fmt: skip


def make_run(path, records, max_steps=6, checkpoints=(), final=False, lines=None):
    """A run directory as the trainer leaves it: config.yaml, metrics.jsonl (records, or raw
    lines), checkpoint-N/manifest.json and optionally final/config.json."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump({"train": {"max_steps": max_steps}}))
    text = "".join(json.dumps(r) + "\n" for r in records) if lines is None else lines
    (path / "metrics.jsonl").write_text(text)
    for step in checkpoints:
        (path / f"checkpoint-{step}").mkdir()
        (path / f"checkpoint-{step}" / "manifest.json").write_text(json.dumps({"files": {}}))
    if final:
        (path / "final").mkdir()
        (path / "final" / "config.json").write_text("{}")
    return path


def six_steps(**extra_at_end):
    rows = [record(s, 4.0 / s, grad_norm=2.0 / s) for s in range(1, 7)]
    rows[2]["eval_loss"] = 1.5
    rows[5]["eval_loss"] = 1.2
    rows[5].update(extra_at_end)
    return rows


# -- metrics history -----------------------------------------------------------------------
def test_resumed_steps_replace_the_crashed_attempts():
    first = [record(s, 9.0) for s in range(1, 6)]  # crashed after logging step 5
    resumed = [record(s, 1.0) for s in range(4, 7)]  # resumed from checkpoint-3
    heldout = {"step": 6, "heldout_exact_match": 0.5}  # logged alone at the last step
    kept = latest_records(first + resumed + [heldout])
    assert [r["step"] for r in kept] == [1, 2, 3, 4, 5, 6, 6]
    assert [r.get("loss") for r in kept] == [9.0, 9.0, 9.0, 1.0, 1.0, 1.0, None]
    # a resume at the step last logged (logging_steps > 1) replaces that record too
    assert [r["loss"] for r in latest_records([record(5, 9.0), record(5, 1.0)])] == [1.0]


@pytest.mark.parametrize(
    "lines, expected",
    [
        ("", "is empty"),
        ("\n\n", "is empty"),
        ('{"step": 1, "loss": 1.0}\n{"step": 2, "lo', "metrics.jsonl:2: not a JSON line"),
        ('{"step": 1}\n[1, 2]\n{"step": 3}\n', "metrics.jsonl:2: expected a JSON object"),
        ('{"loss": 1.0}\n', 'metrics.jsonl:1: expected a JSON object with an integer "step"'),
        ('{"step": 1, "loss": "low"}\n', "metrics.jsonl:1: loss is 'low', not a number"),
        (
            '{"step": 1, "loss": 1' + "0" * 400 + "}\n",
            "metrics.jsonl:1: loss is 1000000000000000000000000000000000000..., not a number",
        ),
        ('{"step": 1, "x": 1' + "0" * 5000 + "}\n", "metrics.jsonl:1: not a JSON line (Exceeds"),
    ],
)
def test_bad_metrics_name_the_file_and_line(tmp_path, lines, expected):
    run = make_run(tmp_path / "run", [], lines=lines)
    with pytest.raises(InputError, match=re.escape(expected)):
        read_history(run)


def test_a_cut_last_line_says_how_to_fix_it(tmp_path):
    run = make_run(tmp_path / "run", [], lines='{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    with pytest.raises(InputError, match="cut last line: delete it"):
        read_history(run)


def test_not_a_run_dir(tmp_path):
    with pytest.raises(InputError, match="not a folder"):
        read_history(tmp_path / "missing")
    with pytest.raises(InputError, match="holds no metrics.jsonl"):
        read_history(tmp_path)


def test_unknown_keys_are_ignored(tmp_path):
    run = make_run(tmp_path / "run", [record(1, 2.0, future_key="x", nested={"a": 1})])
    assert read_history(run)[0]["loss"] == 2.0


# -- status --------------------------------------------------------------------------------
def test_statuses(tmp_path):
    finished = make_run(tmp_path / "finished", six_steps(), checkpoints=(3, 6), final=True)
    stopped = make_run(tmp_path / "stopped", six_steps()[:3], checkpoints=(3,))
    crashed = make_run(tmp_path / "crashed", six_steps()[:5], checkpoints=(3,))
    make_run(tmp_path / "early", six_steps()[:2])
    # final/ from an earlier end, then resumed with more steps and crashed after step 7
    extended = make_run(tmp_path / "extended", six_steps() + [record(7, 0.5)], max_steps=8,
                        checkpoints=(6,), final=True)  # fmt: skip
    # max_steps -1: the planned total is the newest checkpoint's step
    epochs = make_run(tmp_path / "epochs", six_steps(), max_steps=-1, checkpoints=(6,),
                      final=True)  # fmt: skip
    unreadable = make_run(tmp_path / "bad", [], lines="not json\n")
    status = {p.name: run_info(p).status for p in sorted(tmp_path.iterdir())}
    assert status == {
        "bad": "unreadable",
        "crashed": "crashed",
        "early": "crashed",
        "epochs": "finished",
        "extended": "crashed",
        "finished": "finished",
        "stopped": "stopped at step 3",
    }
    info = run_info(finished)
    assert (info.last_step, info.planned_steps, info.loss) == (6, 6, pytest.approx(4 / 6))
    assert info.eval_loss == 1.2 and info.checkpoint.name == "checkpoint-6"
    assert run_info(crashed).checkpoint.name == "checkpoint-3"
    assert "metrics.jsonl:1" in run_info(unreadable).problem
    assert run_info(epochs).planned_steps == 6 and run_info(extended).planned_steps == 8
    assert run_info(stopped).eval_loss == 1.5


def test_runs_table_is_aligned(tmp_path):
    make_run(tmp_path / "a-long-run-name", six_steps(), checkpoints=(3, 6), final=True)
    make_run(tmp_path / "b", six_steps()[:5], checkpoints=(3,))
    make_run(tmp_path / "c", [], lines="{oops\n")
    (tmp_path / "not-a-run").mkdir()
    found = find_runs(tmp_path)
    assert [p.name for p in found] == ["a-long-run-name", "b", "c"]
    lines = runs_table([run_info(p) for p in found]).splitlines()
    header, rows, notes = lines[0], lines[1:4], lines[4:]
    expected = {  # column -> the cell of each row, starting where the header's name starts
        "status": ["finished", "crashed", "unreadable"],
        "checkpoint": ["checkpoint-6", "checkpoint-3", "-"],
        "last written": ["20", "20", "20"],
    }
    for column, cells in expected.items():
        for row, cell in zip(rows, cells):
            assert row[header.index(column) :].startswith(cell), (column, row)
    for column, cells in {
        "step": ["6/6", "5/6", "-/6"],
        "eval loss": ["1.2000", "1.5000", "-"],
    }.items():
        end = header.index(column) + len(column)  # numbers end where the header name ends
        for row, cell in zip(rows, cells):
            assert row[:end].endswith(cell), (column, row)
    assert rows[0].startswith(str(tmp_path / "a-long-run-name") + "  ") and "0.6667" in rows[0]
    assert len(notes) == 1
    assert notes[0].startswith(f"{tmp_path / 'c' / 'metrics.jsonl'}:1: not a JSON line")
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d \(\d+[smhd] ago\)$", rows[0])


def test_runs_table_shows_the_held_out_exact_match(tmp_path):
    """The last logged heldout_exact_match (the trainer logs it alone at the last step), as
    a percentage under `held-out`; `-` for a run that never measured it."""
    rows = six_steps() + [{"step": 6, "heldout_exact_match": 0.987}]
    make_run(tmp_path / "measured", rows, checkpoints=(6,), final=True)
    make_run(tmp_path / "plain", six_steps(), checkpoints=(6,), final=True)
    infos = [run_info(p) for p in find_runs(tmp_path)]
    assert [info.heldout for info in infos] == [0.987, None]
    header, measured, plain = runs_table(infos).splitlines()
    assert header.split() == ["run", "status", "step", "loss", "eval", "loss", "held-out",
                              "checkpoint", "last", "written"]  # fmt: skip
    end = header.index("held-out") + len("held-out")
    assert measured[:end].endswith(" 98.7%") and plain[:end].endswith(" -")
    assert infos[0].status == "finished"  # the held-out record at the last step changes nothing


def test_find_runs_includes_the_folder_itself_and_rejects_bad_folders(tmp_path):
    run = make_run(tmp_path / "run", six_steps())
    assert find_runs(run) == [run]
    assert find_runs(tmp_path) == [run]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert find_runs(empty) == []
    with pytest.raises(InputError, match="does not exist"):
        find_runs(tmp_path / "missing")
    with pytest.raises(InputError, match="is a file"):
        find_runs(run / "metrics.jsonl")


# -- summary -------------------------------------------------------------------------------
def test_summary_holds_the_numbers(tmp_path):
    rows = six_steps(skipped_steps=2, elapsed_seconds=125.0)
    rows[4]["skipped_steps"] = 1
    run = make_run(tmp_path / "run", rows, checkpoints=(3, 6), final=True)
    (run / "eval_results.json").write_text(
        json.dumps({"heldout_exact_match": 0.987, "num_examples": 300, "step": 6})
    )
    text = run_summary(run, prompt="rev 90417=")
    lines = text.splitlines()
    assert (
        lines[0] == f"unmask: run {run} done: 6 steps, 960 tokens seen in 2m05s (mean 1k tokens/s)"
    )
    assert "eval loss: final 1.2000 at step 6, best 1.2000 at step 6" in text
    assert "held-out exact match: 98.7% on 300 prompts" in text
    assert "skipped (non-finite) steps: 2" in text
    assert "checkpoints kept: checkpoint-3, checkpoint-6" in text
    assert f"final model: {run / 'final'}" in text
    assert f"unmask generate --model {run / 'final'} --prompt 'rev 90417='" in text
    assert lines[-1].strip() == f"unmask plot {run}"
    # the wall time given by the trainer wins over elapsed_seconds
    assert "in 1h01m" in run_summary(run, wall_seconds=3700)


def test_summary_of_a_plain_run(tmp_path):
    rows = [record(s, 1.0) for s in range(1, 4)]
    rows[1]["eval_loss"], rows[2]["eval_loss"] = 0.8, 0.9
    rows.append({"step": 3, "heldout_exact_match": 0.25})
    run = make_run(tmp_path / "run", rows, max_steps=3, checkpoints=(3,))
    text = run_summary(run)
    assert "in " not in text.splitlines()[0]  # no wall time known
    assert "best 0.8000 at step 2" in text and "final 0.9000 at step 3" in text
    assert "held-out exact match: 25.0%" in text and "skipped" not in text
    assert "final model: none" in text and f"--model {run / 'checkpoint-3'} --prompt ..." in text


# -- figures and PNGs ------------------------------------------------------------------------
def legend_texts(ax):
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_figures_labels_titles_legends(tmp_path):
    a = make_run(tmp_path / "a", six_steps(skipped_steps=1))
    b = make_run(tmp_path / "b", [record(s, 2.0) for s in range(1, 5)])  # no grad norm, no eval
    figures, notes = build_figures(load_runs([a, b]))
    assert list(figures) == ["loss", "learning_rate", "grad_norm", "tokens_per_second",
                             "skipped_steps"]  # fmt: skip
    titles = {name: fig.axes[0].get_title() for name, fig in figures.items()}
    assert titles == {
        "loss": "Loss: training (lines), eval (markers)",
        "learning_rate": "Learning rate",
        "grad_norm": "Gradient norm (before clipping)",
        "tokens_per_second": "Training throughput",
        "skipped_steps": "Skipped (non-finite) steps",
    }
    for fig in figures.values():
        assert fig.axes[0].get_xlabel() == X_LABEL
    loss = figures["loss"].axes[0]
    assert loss.get_ylabel() == "loss" and legend_texts(loss) == ["a", "a (eval)", "b"]
    assert loss.get_yscale() == "linear"  # 4.0 -> 0.67: a factor 6
    assert figures["tokens_per_second"].axes[0].get_ylabel() == "tokens / second"
    assert legend_texts(figures["grad_norm"].axes[0]) == ["a"]
    assert legend_texts(figures["skipped_steps"].axes[0]) == ["a"]
    assert notes == ["grad_norm.png leaves out b (never logged grad_norm)"]
    eval_line = loss.get_lines()[1]
    assert list(eval_line.get_xdata()) == [3, 6] and list(eval_line.get_ydata()) == [1.5, 1.2]


def test_log_scale_only_when_the_loss_spans_orders_of_magnitude(tmp_path):
    flat = Run("flat", [record(s, 3.0 - 0.1 * s) for s in range(1, 10)])
    falling = Run("falling", [record(s, 5.0 / s**2) for s in range(1, 10)])
    assert build_figures([flat])[0]["loss"].axes[0].get_yscale() == "linear"
    assert build_figures([falling])[0]["loss"].axes[0].get_yscale() == "log"
    assert build_figures([flat])[0]["learning_rate"].axes[0].get_yscale() == "linear"


def test_held_out_exact_match_is_its_own_plot(tmp_path):
    """heldout_exact_match.png: each run that measured it, a marker at its step (the legend
    gives the last value), on a 0-100% axis; runs that did not are named in a note; no
    note at all when no run measured it (eval.generate_accuracy off)."""
    a = make_run(tmp_path / "a", six_steps() + [{"step": 6, "heldout_exact_match": 0.875}])
    b = make_run(tmp_path / "b", [record(s, 2.0) for s in range(1, 4)]
                 + [{"step": 2, "heldout_exact_match": 0.25}, {"step": 3, "loss": 1.5},
                    {"step": 3, "heldout_exact_match": 0.5}])  # fmt: skip
    c = make_run(tmp_path / "c", six_steps())
    figures, notes = build_figures(load_runs([a, b, c]))
    assert list(figures)[-1] == "heldout_exact_match"
    ax = figures["heldout_exact_match"].axes[0]
    assert ax.get_title().startswith("Held-out exact match") and ax.get_xlabel() == X_LABEL
    assert legend_texts(ax) == ["a (87.5%)", "b (50.0%)"]
    lines = ax.get_lines()
    assert [list(line.get_xdata()) for line in lines] == [[6], [2, 3]]
    assert [list(line.get_ydata()) for line in lines] == [[0.875], [0.25, 0.5]]
    assert all(line.get_marker() == "o" for line in lines)
    assert ax.get_ylim() == pytest.approx((-0.03, 1.03))
    assert ax.yaxis.get_major_formatter()(0.5, 0) == "50%"
    assert "heldout_exact_match.png leaves out c (never logged heldout_exact_match)" in notes
    figures, notes = build_figures(load_runs([c]))
    assert "heldout_exact_match" not in figures and not any("heldout" in n for n in notes)


def test_left_out_quantities_are_said(tmp_path):
    run = make_run(tmp_path / "run", [record(s, 1.0) for s in range(1, 4)])
    figures, notes = build_figures(load_runs([run]))
    assert set(figures) == {"loss", "learning_rate", "tokens_per_second"}
    assert notes == ["no grad_norm.png: no run logged it",
                     "no skipped_steps.png: no run skipped a step"]  # fmt: skip


def test_same_names_are_told_apart_by_path(tmp_path):
    a = make_run(tmp_path / "x" / "run", six_steps())
    b = make_run(tmp_path / "y" / "run", six_steps())
    assert [r.label for r in load_runs([a, b])] == [str(a), str(b)]


def test_plot_runs_writes_valid_pngs(tmp_path):
    from matplotlib.image import imread

    a = make_run(tmp_path / "a", six_steps())
    lines = plot_runs([a])
    names = ["loss", "learning_rate", "grad_norm", "tokens_per_second"]
    assert lines == [f"wrote {a / 'plots' / n}.png" for n in names] + [
        "no skipped_steps.png: no run skipped a step"
    ]
    for name in names:
        path = a / "plots" / f"{name}.png"
        assert path.read_bytes()[:8] == PNG_SIGNATURE
        assert 10_000 < path.stat().st_size < 500_000
        assert imread(path).shape == (504, 840, 4)  # 7 x 4.2 inches at 120 dpi


@pytest.mark.parametrize("case", ["out_is_a_file", "second_run_bad", "no_matplotlib"])
def test_plot_runs_bad_input_writes_nothing(tmp_path, monkeypatch, case):
    a = make_run(tmp_path / "a", six_steps())
    runs, out = [a], None
    if case == "out_is_a_file":
        out = tmp_path / "file.png"
        out.write_text("x")
    elif case == "second_run_bad":
        runs.append(make_run(tmp_path / "b", [], lines=""))
    else:
        monkeypatch.setitem(sys.modules, "matplotlib", None)
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(InputError) as err:
        plot_runs(runs, out)
    assert sorted(tmp_path.rglob("*")) == before
    if case == "no_matplotlib":
        assert str(err.value) == MISSING_MATPLOTLIB


def test_non_finite_values_and_skipped_steps(tmp_path):
    rows = [record(s, 2.0 / s, skipped_steps=int(s >= 3)) for s in range(1, 6)]
    rows[2]["loss"] = float("nan")  # json writes NaN, which json reads back
    run = make_run(tmp_path / "run", rows)
    figures, _ = build_figures(load_runs([run]))
    assert figures["loss"].axes[0].get_yscale() == "linear"  # 2.0 -> 0.4, NaN ignored
    assert legend_texts(figures["skipped_steps"].axes[0]) == ["run"]
    assert "skipped (non-finite) steps: 1" in run_summary(run)


def test_resume_with_other_settings_keeps_the_old_config_and_lists_changes(tmp_path):
    from unmask.train.run_dir import CONFIG_HISTORY, write_config

    old = yaml.safe_dump({"train": {"max_steps": 100, "resume_from_checkpoint": None},
                          "optim": {"learning_rate": 0.003}})  # fmt: skip
    new = yaml.safe_dump({"train": {"max_steps": 200, "resume_from_checkpoint": True},
                          "optim": {"learning_rate": 0.003}})  # fmt: skip
    assert write_config(tmp_path, old, 0) == []
    assert write_config(tmp_path, new, 40) == ["train.max_steps: 100 -> 200"]
    assert (tmp_path / CONFIG_HISTORY / "step-40.yaml").read_text() == old
    assert (tmp_path / "config.yaml").read_text() == new
    assert write_config(tmp_path, new, 60) == []  # same settings: nothing kept
    assert len(list((tmp_path / CONFIG_HISTORY).iterdir())) == 1


def test_the_qk_clip_max_logit_is_plotted_for_runs_that_log_it(tmp_path):
    """qk_max_logit.png (optim.qk_clip_threshold): the logged max logit per step, on a log
    axis when it spans orders of magnitude (an exploding run); no note for runs without it."""
    clipped = make_run(tmp_path / "clipped", [
        {**record(s, 2.0), "qk_max_logit": value, "qk_clipped_heads": 1}
        for s, value in zip(range(1, 5), (3.0, 40.0, 900.0, 10.0))])  # fmt: skip
    plain = make_run(tmp_path / "plain", six_steps())
    figures, notes = build_figures(load_runs([clipped, plain]))
    ax = figures["qk_max_logit"].axes[0]
    assert ax.get_title().startswith("Largest pre-softmax attention logit")
    assert [list(line.get_ydata()) for line in ax.get_lines()] == [[3.0, 40.0, 900.0, 10.0]]
    assert ax.get_yscale() == "log"
    assert "qk_max_logit.png leaves out plain (never logged qk_max_logit)" in notes
    figures, notes = build_figures(load_runs([plain]))
    assert "qk_max_logit" not in figures and not any("qk_max_logit" in n for n in notes)


def test_the_heartbeat_decides_the_status(tmp_path):
    """runs/heartbeat.py's rule: a running heartbeat of a live pid on this host is
    `running` whatever the files say; of a dead pid, `crashed`; from another host, by the
    file's age against STALE_SECONDS; `stopped` / `finished` / `failed` as written."""
    import os
    import subprocess
    import sys
    import time

    from unmask.runs import heartbeat as hb

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    now = time.time()

    def status(**beat):
        run = make_run(tmp_path / f"r{len(list(tmp_path.iterdir()))}", six_steps()[:5],
                       checkpoints=(3,))  # fmt: skip
        record = {"status": "running", "pid": os.getpid(), "host": hb.this_host(),
                  "started": now, "updated": now, "step": 5, **beat}  # fmt: skip
        (run / hb.HEARTBEAT_FILE).write_text(json.dumps(record))
        return hb.run_status(heartbeat=hb.read_heartbeat(run), finished_files=False, saved=3,
                             last_logged=5, now=now)  # fmt: skip

    assert status() == "running"
    assert status(pid=dead.pid) == "crashed"
    # a live pid that started after the heartbeat: another process took the number
    assert status(started=hb.process_started(os.getpid()) - 60) == "crashed"
    assert status(host="another-node", pid=dead.pid, updated=now - 30) == "running"
    assert status(host="another-node", updated=now - hb.STALE_SECONDS - 1) == "crashed"
    assert status(status="stopped") == "stopped at step 3"
    assert status(status="finished") == "finished"
    assert status(status="failed") == "crashed"
    run = make_run(tmp_path / "live", six_steps()[:5], checkpoints=(3,))
    (run / hb.HEARTBEAT_FILE).write_text(json.dumps(
        {"status": "running", "pid": os.getpid(), "host": hb.this_host()}))  # fmt: skip
    assert run_info(run).status == "running"  # the files alone would say crashed


def test_the_heartbeat_thread_rewrites_the_file_and_ends_with_the_status(tmp_path):
    import time

    from unmask.runs.heartbeat import Heartbeat, read_heartbeat

    beat = Heartbeat(tmp_path, every=0.05)
    first = read_heartbeat(tmp_path)["updated"]
    beat.beat(7)
    time.sleep(0.3)
    record = read_heartbeat(tmp_path)
    assert record["status"] == "running" and record["step"] == 7 and record["updated"] > first
    beat.end("stopped")
    assert read_heartbeat(tmp_path)["status"] == "stopped"
    assert not beat._thread.is_alive()
    (tmp_path / "other").mkdir()
    with pytest.raises(RuntimeError), Heartbeat(tmp_path / "other", every=10) as other:
        other.beat(1)
        raise RuntimeError("boom")
    assert read_heartbeat(tmp_path / "other")["status"] == "failed"

"""`unmask plot` and `unmask runs` through the command line, on a real tiny run and on
copies of it made to look stopped and crashed; bad input is one line, exit code 2 and
nothing written."""

import json
import shutil
import sys

import pytest
from conftest import read_metrics

from unmask.cli import main
from unmask.runs.report import run_summary

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PLOTTED = ("loss", "learning_rate", "grad_norm", "tokens_per_second")

pytestmark = pytest.mark.usefixtures("one_thread")


def snapshot(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def run_main(argv, capsys):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out.strip().splitlines(), captured.err.strip().splitlines()


@pytest.fixture
def runs(tiny_config, tmp_path, capsys):
    """tmp_path/runs/ holding the real tiny run (6 steps, checkpoints 3 and 6, final/), a
    copy stopped after checkpoint-3 and a copy that crashed after logging step 5."""
    assert main(["train", str(tiny_config()), "optim.max_grad_norm=1.0"]) == 0
    capsys.readouterr()
    root = tmp_path / "runs"
    root.mkdir()
    real = shutil.move(tmp_path / "run", root / "finished")
    records = read_metrics(real)
    for name, last_step in (("stopped", 3), ("crashed", 5)):
        copy = root / name
        copy.mkdir()
        shutil.copy(real / "config.yaml", copy / "config.yaml")
        shutil.copytree(real / "checkpoint-3", copy / "checkpoint-3")
        kept = [r for r in records if r["step"] <= last_step]
        (copy / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    return root


def test_plot_a_real_run(runs, capsys):
    run = runs / "finished"
    code, out, err = run_main(["plot", str(run)], capsys)
    assert code == 0 and err == []
    assert out == [f"wrote {run / 'plots' / name}.png" for name in PLOTTED] + [
        "no skipped_steps.png: no run skipped a step"
    ]
    for name in PLOTTED:
        data = (run / "plots" / f"{name}.png").read_bytes()
        assert data[:8] == PNG_SIGNATURE and 10_000 < len(data) < 500_000


def test_plot_overlays_runs_into_out(runs, tmp_path, capsys):
    out_dir = tmp_path / "compare"
    argv = ["plot", str(runs / "finished"), str(runs / "crashed"), "--out", str(out_dir)]
    code, out, _ = run_main(argv, capsys)
    assert code == 0 and len(out) == 5
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(f"{n}.png" for n in PLOTTED)
    assert not (runs / "finished" / "plots").exists()


def test_runs_lists_statuses(runs, capsys):
    with open(runs / "stopped" / "metrics.jsonl", "a") as handle:  # as the trainer ends a run
        handle.write(json.dumps({"step": 3, "heldout_exact_match": 0.5}) + "\n")
    code, out, err = run_main(["runs", str(runs)], capsys)
    assert code == 0 and err == []
    header, *rows = out
    assert header.split() == ["run", "status", "step", "loss", "eval", "loss", "held-out",
                              "checkpoint", "last", "written"]  # fmt: skip
    by_name = {row.split()[0].rsplit("/", 1)[1]: row for row in rows}
    assert set(by_name) == {"finished", "stopped", "crashed"}
    assert " finished " in by_name["finished"] and " 6/6 " in by_name["finished"]
    assert "checkpoint-6" in by_name["finished"]
    assert " stopped at step 3 " in by_name["stopped"] and " 3/6 " in by_name["stopped"]
    end = header.index("held-out") + len("held-out")  # the column's numbers end with its name
    assert by_name["stopped"][:end].endswith(" 50.0%")
    assert by_name["finished"][:end].endswith(" -")  # the tiny run does not measure it
    assert " crashed " in by_name["crashed"] and " 5/6 " in by_name["crashed"]
    assert "checkpoint-3" in by_name["crashed"]
    final_eval = [r["eval_loss"] for r in read_metrics(runs / "finished") if "eval_loss" in r][-1]
    assert f"{final_eval:.4f}" in by_name["finished"]


def test_summary_of_a_real_run(runs):
    run = runs / "finished"
    records = read_metrics(run)
    text = run_summary(run, wall_seconds=42.0, prompt="rev 123=")
    assert text.splitlines()[0].startswith(
        f"unmask: run {run} done: 6 steps, 960 tokens seen in 0m42s"
    )
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert f"final {evals[-1]:.4f} at step 6" in text and f"best {min(evals):.4f}" in text
    assert "checkpoints kept: checkpoint-3, checkpoint-6" in text
    assert f"unmask generate --model {run / 'final'} --prompt 'rev 123='" in text


def test_runs_on_an_empty_folder(tmp_path, capsys):
    code, out, _ = run_main(["runs", str(tmp_path)], capsys)
    assert code == 0 and len(out) == 1 and out[0].startswith(f"no run directories in {tmp_path}")


def write_run(path, metrics_text):
    path.mkdir()
    (path / "metrics.jsonl").write_text(metrics_text)
    return path


GOOD = '{"step": 1, "loss": 2.0, "learning_rate": 0.001}\n'


@pytest.mark.parametrize(
    "case, message",
    [
        ("no_metrics", "is not a run directory: it holds no metrics.jsonl"),
        ("empty_metrics", "metrics.jsonl is empty"),
        ("corrupt_line", "metrics.jsonl:2: not a JSON line"),
        ("out_is_a_file", "is a file; give a folder for the PNGs"),
        ("missing_run", "is not a folder"),
        ("no_matplotlib", "unmask plot needs matplotlib: pip install 'unmask[plot]'"),
    ],
)
def test_plot_bad_input(tmp_path, capsys, monkeypatch, case, message):
    good = write_run(tmp_path / "good", GOOD)
    argv = ["plot", str(good)]
    if case == "no_metrics":
        (tmp_path / "other").mkdir()
        argv.append(str(tmp_path / "other"))
    elif case == "empty_metrics":
        argv.append(str(write_run(tmp_path / "empty", "")))
    elif case == "corrupt_line":
        argv.append(str(write_run(tmp_path / "corrupt", GOOD + "{not json\n" + GOOD)))
    elif case == "out_is_a_file":
        (tmp_path / "out.png").write_text("")
        argv += ["--out", str(tmp_path / "out.png")]
    elif case == "missing_run":
        argv.append(str(tmp_path / "nowhere"))
    else:
        monkeypatch.setitem(sys.modules, "matplotlib", None)
    before = snapshot(tmp_path)
    code, out, err = run_main(argv, capsys)
    assert code == 2 and out == [] and len(err) == 1
    assert err[0].startswith("unmask: error: ") and message in err[0]
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("make", ["missing", "file"])
def test_runs_bad_folder(tmp_path, capsys, make):
    folder = tmp_path / "runs"
    if make == "file":
        folder.write_text("")
    code, out, err = run_main(["runs", str(folder)], capsys)
    assert code == 2 and out == [] and len(err) == 1
    assert ("does not exist" if make == "missing" else "is a file") in err[0]

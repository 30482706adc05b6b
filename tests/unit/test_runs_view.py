"""The runs view of `unmask serve --runs DIR` (unmask/serve/runs_view.py), on run
directories written by hand: which metric keys are served, how long series are thinned,
the held-out exact match in the runs list."""

import json

import pytest

from unmask.serve.runs_view import MAX_KEYS, MAX_POINTS, curves, list_runs, metric_keys, thin


def write_run(path, records):
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_every_numeric_key_is_served_and_hostile_keys_are_not(tmp_path):
    records = [
        {"step": 1, "loss": 2.0, "learning_rate": 1e-3, "zeta": 1, "mfu": 0.4,
         "moe_load_max_over_mean/layer_0": 1.5, "note": "text", "flag": True,
         "nested": {"a": 1}, "<img src=x onerror=alert(1)>": 1, "a b": 2.0, "x" * 65: 1.0},
        {"step": 2, "eval_loss": 1.5, "loss": None},
        {"step": 2, "heldout_exact_match": 0.75},
    ]  # fmt: skip
    run = write_run(tmp_path / "run", records)
    # the known keys in report.NUMBER_KEYS' order, then the others by name
    assert metric_keys(records) == ["loss", "eval_loss", "learning_rate", "mfu",
                                    "heldout_exact_match", "moe_load_max_over_mean/layer_0",
                                    "zeta"]  # fmt: skip
    served = curves(run)
    assert served["metrics"] == {
        "loss": [[1, 2.0]],  # a null value is no point
        "eval_loss": [[2, 1.5]],
        "learning_rate": [[1, 1e-3]],
        "mfu": [[1, 0.4]],
        "heldout_exact_match": [[2, 0.75]],
        "moe_load_max_over_mean/layer_0": [[1, 1.5]],
        "zeta": [[1, 1.0]],
    }
    # each key's name on the page, from one table (words for a key it does not name)
    assert (
        served["labels"]["moe_load_max_over_mean/layer_0"] == "expert load (max / mean) (layer_0)"
    )
    assert (served["labels"]["eval_loss"], served["labels"]["zeta"]) == ("eval loss", "zeta")
    assert served["keys_left_out"] == 0 and served["thinned"] == []


def test_keys_and_points_are_capped(tmp_path):
    steps = 3 * MAX_POINTS + 7
    records = [{"step": s, "loss": 1.0 / s, **{f"k{i:03d}": float(i) for i in range(MAX_KEYS + 5)}}
               for s in range(1, steps + 1)]  # fmt: skip
    served = curves(write_run(tmp_path / "run", records))
    assert len(served["metrics"]) == MAX_KEYS and served["keys_left_out"] == 6
    assert next(iter(served["metrics"])) == "loss"  # known keys first: never the one left out
    loss = served["metrics"]["loss"]
    assert len(loss) == MAX_POINTS and "loss" in served["thinned"]
    assert loss[0] == [1, 1.0] and loss[-1] == [steps, 1.0 / steps]  # both ends kept
    gaps = {b[0] - a[0] for a, b in zip(loss, loss[1:])}
    assert gaps <= {3, 4}  # evenly spread


def test_thin_keeps_short_series_and_both_ends():
    assert thin([[1, 1.0]], 5) == [[1, 1.0]]
    points = [[s, float(s)] for s in range(10)]
    assert thin(points, 4) == [[0, 0.0], [3, 3.0], [6, 6.0], [9, 9.0]]
    assert thin(points, 1) == [[9, 9.0]] and thin(points, 0) == []


def test_huge_numbers_and_unreadable_runs(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1, "big": 1' + "0" * 400 + "}\n")
    assert curves(run)["metrics"]["big"] == [[1, float("inf")]]  # served as null
    bad = write_run(tmp_path / "bad", [])
    (bad / "metrics.jsonl").write_text("{oops\n")
    error = curves(bad)["error"]  # named by the run's folder: no path of the server's
    assert error.startswith("bad/metrics.jsonl:1: not a JSON line") and str(tmp_path) not in error
    assert curves(bad)["metrics"] == {}
    fresh = tmp_path / "fresh"  # a run that has not logged yet: nothing to draw, no error
    fresh.mkdir()
    (fresh / "config.yaml").write_text("train: {max_steps: 10}\n")
    assert curves(fresh) == {"metrics": {}, "labels": {}, "keys_left_out": 0, "thinned": []}


def test_the_runs_list_holds_the_held_out_exact_match(tmp_path):
    write_run(tmp_path / "measured", [{"step": 1, "loss": 2.0}, {"step": 1,
              "heldout_exact_match": 0.5}, {"step": 2, "loss": 1.0},
              {"step": 2, "heldout_exact_match": 0.875}])  # fmt: skip
    write_run(tmp_path / "plain", [{"step": 1, "loss": 2.0}])
    rows = {row["name"]: row for row in list_runs(tmp_path)}
    assert rows["measured"]["heldout_exact_match"] == pytest.approx(0.875)
    assert rows["plain"]["heldout_exact_match"] is None

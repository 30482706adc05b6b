"""The page's runs view: the run directories of `--runs DIR` as `unmask runs` reads them
(train/report.py), with tokens/s, an ETA and each run's curves from metrics.jsonl.

Runs are named by their folder's name under DIR; a request names a run, never a path, and
only names `find_runs` lists are answered.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from unmask.errors import InputError
from unmask.train.report import find_runs, last_value, read_history, run_info, series

#: a run whose files changed this recently and that is not finished is shown as running
RUNNING_SECONDS = 120.0


def _name(runs_dir: Path, path: Path) -> str:
    return "." if path == runs_dir else path.name


def run_dir(runs_dir: Path, name: str) -> Path | None:
    """The run directory named `name` (as list_runs names it), or None."""
    for path in find_runs(runs_dir):
        if _name(runs_dir, path) == name:
            return path
    return None


def _eta(records: list[dict], planned: int | None) -> float | None:
    """Seconds left at the pace of the logged elapsed_seconds (None: unknown)."""
    timed = [(r["step"], r["elapsed_seconds"]) for r in records if "elapsed_seconds" in r]
    if planned is None or len(timed) < 2:
        return None
    (s0, t0), (s1, t1) = timed[0], timed[-1]
    if s1 <= s0 or s1 >= planned:
        return None
    return (t1 - t0) / (s1 - s0) * (planned - s1)


def list_runs(runs_dir: Path) -> list[dict[str, Any]]:
    """One row per run: name, status (`running` when not finished and written within
    RUNNING_SECONDS), step, planned steps, loss, eval loss, tokens/s, ETA seconds."""
    rows = []
    now = time.time()
    for path in find_runs(runs_dir):
        info = run_info(path)
        try:
            records = read_history(path)
        except InputError:
            records = []
        status = info.status
        if status != "finished" and now - info.last_written < RUNNING_SECONDS:
            status = "running"
        rows.append({
            "name": _name(runs_dir, path), "status": status, "step": info.last_step,
            "planned_steps": info.planned_steps, "loss": info.loss,
            "eval_loss": info.eval_loss,
            "tokens_per_second": last_value(records, "tokens_per_second"),
            "eta_seconds": _eta(records, info.planned_steps) if status == "running" else None,
            "last_written": info.last_written,
        })  # fmt: skip
    return rows


def curves(path: Path) -> dict[str, Any]:
    """The run's loss and eval loss by step."""
    try:
        records = read_history(path)
    except InputError as err:
        return {"error": str(err), "loss": [], "eval_loss": []}
    out = {}
    for key in ("loss", "eval_loss"):
        steps, values = series(records, key)
        out[key] = [[s, v] for s, v in zip(steps, values)]
    return out

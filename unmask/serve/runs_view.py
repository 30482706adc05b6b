"""The page's runs view: the run directories of `--runs DIR` as `unmask runs` reads them
(runs/report.py), with tokens/s, an ETA, the held-out exact match and each run's curves
from metrics.jsonl: every numeric key it logged.

Runs are named by their folder's name under DIR; a request names a run, never a path, and
only names `find_runs` lists are answered. A metric key is data too: only keys of
METRIC_KEY are served, at most MAX_KEYS of them a run and MAX_POINTS points a key.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from unmask.errors import InputError
from unmask.runs.report import (
    HELDOUT_KEY,
    METRICS_FILE,
    NUMBER_KEYS,
    find_runs,
    last_value,
    read_history,
    run_info,
)

#: the metric keys served: letters, digits and _ . / - (moe_load_max_over_mean/layer_3)
METRIC_KEY = re.compile(r"[A-Za-z0-9_./-]{1,64}")
MAX_KEYS = 64  # a run's metrics served: the known ones first, then by name
MAX_POINTS = 1000  # a longer series is thinned evenly, keeping its first and last points
#: the page's name of each metric key the trainer logs (one table: the selector, the chart
#: titles, the tooltips, the CSV export); other keys get `metric_label`'s reading
METRIC_LABELS = {
    "loss": "loss", "eval_loss": "eval loss", HELDOUT_KEY: "held-out exact match",
    "learning_rate": "learning rate", "tokens_per_second": "tokens/s",
    "tokens_seen": "tokens seen", "grad_norm": "gradient norm", "mfu": "MFU",
    "mfu_model_only": "MFU (model only)", "elapsed_seconds": "wall time (s)",
    "save_stall_seconds": "checkpoint save stall (s)", "skipped_steps": "skipped steps",
    "skipped_in_a_row": "skipped steps in a row",
    "moe_load_max_over_mean": "expert load (max / mean)",
    "qk_max_logit": "QK max logit", "qk_clipped_heads": "QK-clipped heads",
    "reward_mean": "reward (mean)", "reward_std": "reward (std)", "kl": "KL",
}  # fmt: skip
#: unit suffixes of keys the table does not name: the words they are read as
_SUFFIXES = (("_per_second", "/s"), ("_seconds", " (s)"), ("_bytes", " (bytes)"))


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
    """One row per run: name, status (`unmask runs`'s: running, finished, stopped at step N,
    crashed; the rule is runs/heartbeat.py's `run_status`), step, planned steps, loss, eval
    loss, the last held-out exact match (heldout_exact_match, 0-1), tokens/s, ETA seconds."""
    rows = []
    for path in find_runs(runs_dir):
        info = run_info(path)
        try:
            records = read_history(path)
        except InputError:
            records = []
        status = info.status
        rows.append({
            "name": _name(runs_dir, path), "status": status, "step": info.last_step,
            "planned_steps": info.planned_steps, "loss": info.loss,
            "eval_loss": info.eval_loss, HELDOUT_KEY: info.heldout,
            "tokens_per_second": last_value(records, "tokens_per_second"),
            "eta_seconds": _eta(records, info.planned_steps) if status == "running" else None,
            "last_written": info.last_written,
        })  # fmt: skip
    return rows


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _float(value: int | float) -> float:
    try:
        return float(value)
    except OverflowError:  # an integer past float's range (JSON allows any)
        return math.inf if value > 0 else -math.inf


def thin(points: list, limit: int = MAX_POINTS) -> list:
    """At most limit points, evenly spread, the first and the last kept."""
    if len(points) <= limit:
        return points
    if limit < 2:
        return points[-limit:] if limit else []
    last = len(points) - 1
    return [points[round(i * last / (limit - 1))] for i in range(limit)]


def metric_keys(records: list[dict]) -> list[str]:
    """The keys of METRIC_KEY that some record gives a number: the known ones (NUMBER_KEYS)
    in their order, then the others by name; `step` is the x axis, not a metric."""
    found = {k for r in records for k, v in r.items() if _number(v) and METRIC_KEY.fullmatch(k)}
    found.discard("step")
    known = [k for k in NUMBER_KEYS if k in found]
    return known + sorted(found - set(known))


def metric_label(key: str) -> str:
    """The page's name of a metric key: METRIC_LABELS', else the key in words
    ("save_stall_seconds" -> "save stall (s)"; a "/part" kept: moe_load/layer_3)."""
    if key in METRIC_LABELS:
        return METRIC_LABELS[key]
    head, slash, rest = key.partition("/")
    if head in METRIC_LABELS:
        words = METRIC_LABELS[head]
    else:
        words, unit = head, ""
        for suffix, text in _SUFFIXES:
            if words.endswith(suffix) and len(words) > len(suffix):
                words, unit = words[: -len(suffix)], text
                break
        words = words.replace("_", " ") + unit
    return words + (f" ({rest})" if slash else "")


def curves(path: Path) -> dict[str, Any]:
    """The run's metrics by step: {"metrics": {key: [[step, value], ...]}} for every
    numeric key of metric_keys (at most MAX_KEYS; "keys_left_out" counts the others), each
    series thinned to MAX_POINTS ("thinned": the keys that were). NaN and inf stay floats:
    the route serves them as null."""
    empty = {"metrics": {}, "labels": {}, "keys_left_out": 0, "thinned": []}
    if not (path / METRICS_FILE).is_file():
        return empty  # a run that has not logged a step yet
    try:
        records = read_history(path)
    except InputError as err:  # named by the run's folder, not its path on the server
        return {**empty, "error": str(err).replace(str(path), path.name)}
    keys = metric_keys(records)
    metrics, thinned = {}, []
    for key in keys[:MAX_KEYS]:
        points = [[r["step"], _float(r[key])] for r in records if _number(r.get(key))]
        if len(points) > MAX_POINTS:
            thinned.append(key)
        metrics[key] = thin(points)
    return {"metrics": metrics, "labels": {key: metric_label(key) for key in metrics},
            "keys_left_out": max(0, len(keys) - MAX_KEYS), "thinned": thinned}  # fmt: skip

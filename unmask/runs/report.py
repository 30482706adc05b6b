"""What a run directory says about its run: the metrics history, the run's status
(`unmask runs`) and the end-of-run summary. Everything here only reads; plots.py draws.

A run directory (train.output_dir) holds config.yaml, metrics.jsonl (one JSON object per
logging step: `step`, `loss`, `learning_rate`, `tokens_per_second`, `tokens_seen`, and when
logged `grad_norm`, `eval_loss`, `heldout_exact_match`, `skipped_steps`,
`elapsed_seconds`; unknown keys are ignored), checkpoint-N/ folders (complete once they
hold manifest.json) and, once the run is done, final/.

Status of a run (`run_info`): `running`, `finished`, `stopped at step N` or `crashed`, by
the one rule of heartbeat.py (`run_status`), which `unmask runs` and the server's runs view
share. The trainer's heartbeat.json says whether a run is alive; a folder without one (a run
from before it existed) is judged from its files: `finished` when final/ holds a model and
the last logged step is the planned total (config.yaml's train.max_steps; when that is -1,
the newest checkpoint's step, since the trainer always saves at its last step); `stopped at
step N` when checkpoint-N is the newest complete checkpoint and nothing was logged after
it (resuming loses no logged work); else `crashed`.
"""

import json
import math
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from unmask.checkpoint import list_checkpoints
from unmask.errors import InputError
from unmask.runs.heartbeat import read_heartbeat, run_status

#: the file a run logs its metrics to, one JSON record per line
METRICS_FILE = "metrics.jsonl"


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


CONFIG_FILE = "config.yaml"
FINAL_DIR = "final"
EVAL_RESULTS = "eval_results.json"
PLOTS_DIR = "plots"  # `unmask plot`'s default output: not the run's own writing
HELDOUT_KEY = "heldout_exact_match"  # exact match of greedy answers to held-out prompts, 0-1
SKIP_KEYS = ("skipped_steps",)  # the running count of non-finite steps skipped
NUMBER_KEYS = ("loss", "eval_loss", "learning_rate", "tokens_per_second", "tokens_seen",
               "grad_norm", "mfu", "heldout_exact_match", "elapsed_seconds",
               *SKIP_KEYS)  # fmt: skip
_MODEL_FILES = ("config.json", "adapter_config.json")  # final/: an HF folder or an adapter


# -- metrics.jsonl -----------------------------------------------------------------------
def parse_metrics(path: Path) -> list[dict]:
    """Every record of a metrics.jsonl file, in file order. Blank lines are skipped; a line
    that is not a JSON object with an integer `step`, or whose known keys are not numbers,
    is an InputError naming the file and line."""
    path = Path(path)
    lines = path.read_bytes().splitlines()
    records = []
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(raw.decode("utf-8"))
        except ValueError as err:  # not UTF-8, not JSON, an integer of over 4300 digits
            cut = " (a run killed mid-write can leave a cut last line: delete it)"
            reason = getattr(err, "msg", None) or (
                "not UTF-8" if isinstance(err, UnicodeDecodeError) else str(err)
            )
            raise InputError(
                f"{where}: not a JSON line ({reason})" + (cut if number == len(lines) else "")
            ) from None
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            raise InputError(f'{where}: expected a JSON object with an integer "step"')
        for key in NUMBER_KEYS:
            value = record.get(key)
            if value is not None and (isinstance(value, bool) or not _is_number(value)):
                shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
                raise InputError(f"{where}: {key} is {shown}, not a number")
        records.append(record)
    return records


def _is_number(value) -> bool:
    """A float, or an int that float() takes (JSON's integers have no bound)."""
    return isinstance(value, float) or (isinstance(value, int) and abs(value) <= sys.float_info.max)


def latest_records(records: list[dict]) -> list[dict]:
    """The records of the run as it stands: a resumed run appends to metrics.jsonl from its
    checkpoint's step on, so the steps the crashed attempt logged after that checkpoint
    appear twice; the later ones win. A record starts a resumed attempt when its step is
    lower than the previous record's, or equal with a key in common (the held-out exact
    match is logged alone at the last step, so it does not)."""
    kept: list[dict] = []
    for record in records:
        if kept and _restarts(record, kept[-1]):
            kept = [r for r in kept if r["step"] < record["step"]]
        kept.append(record)
    return kept


def _restarts(record: dict, previous: dict) -> bool:
    if record["step"] != previous["step"]:
        return record["step"] < previous["step"]
    return bool((record.keys() & previous.keys()) - {"step"})


def read_history(run_dir: str | Path) -> list[dict]:
    """The records of a run directory's metrics.jsonl (`latest_records`). InputError when
    run_dir is not a run directory (no metrics.jsonl), the file is empty or a line is bad."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise InputError(
            f"{str(run_dir)!r} is not a folder; give a run directory (train.output_dir)"
        )
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise InputError(
            f"{str(run_dir)!r} is not a run directory: it holds no {METRICS_FILE}; "
            "give a train.output_dir"
        )
    records = latest_records(parse_metrics(path))
    if not records:
        raise InputError(f"{path} is empty: the run has not logged a step yet")
    return records


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one key over the records that hold it (null values left out)."""
    pairs = [(r["step"], float(r[key])) for r in records if r.get(key) is not None]
    return [s for s, _ in pairs], [v for _, v in pairs]


def last_value(records: list[dict], key: str):
    """The last logged value of key, or None."""
    values = series(records, key)[1]
    return values[-1] if values else None


def skipped_total(records: list[dict]) -> int:
    """Non-finite steps skipped: the largest logged `skipped_steps` count
    (the counts are running totals, like tokens_seen); 0 when never logged."""
    counts = [v for key in SKIP_KEYS for v in series(records, key)[1] if math.isfinite(v)]
    return int(max(counts, default=0))


# -- one run's status ----------------------------------------------------------------------
@dataclass
class RunInfo:
    """One row of `unmask runs`."""

    path: Path
    status: str
    last_step: int | None  # the last logged step
    planned_steps: int | None  # train.max_steps, or the newest checkpoint's step when -1
    loss: float | None  # the last logged training loss
    eval_loss: float | None  # the last logged eval loss
    checkpoint: Path | None  # the newest complete checkpoint
    last_written: float  # newest modification time of its files and folders (epoch seconds)
    problem: str | None = None  # why metrics.jsonl could not be read
    heldout: float | None = None  # the last logged heldout_exact_match (a fraction)


def is_run_dir(path: Path) -> bool:
    """A folder holding metrics.jsonl, config.yaml or a complete checkpoint-N/."""
    path = Path(path)
    return (
        (path / METRICS_FILE).is_file()
        or (path / CONFIG_FILE).is_file()
        or bool(list_checkpoints(path))
    )


def find_runs(folder: str | Path) -> list[Path]:
    """The run directories in folder (its subfolders, and folder itself when it is one),
    sorted by path. InputError when folder does not exist or is a file."""
    folder = Path(folder)
    if not folder.exists():
        raise InputError(
            f"{str(folder)!r} does not exist; give the folder that holds the run directories"
        )
    if not folder.is_dir():
        raise InputError(f"{str(folder)!r} is a file; give the folder that holds run directories")
    found = [folder] if is_run_dir(folder) else []
    return found + sorted(c for c in folder.iterdir() if c.is_dir() and is_run_dir(c))


def checkpoint_step(path: Path) -> int:
    """N of a checkpoint-N folder."""
    return int(Path(path).name.rsplit("-", 1)[1])


def planned_steps(run_dir: Path) -> int | None:
    """train.max_steps from the run's config.yaml when > 0, else None (unknown)."""
    try:
        config = yaml.safe_load((Path(run_dir) / CONFIG_FILE).read_text())
        steps = config["train"]["max_steps"]
    except (OSError, ValueError, yaml.YAMLError, KeyError, TypeError):  # ValueError: not UTF-8
        return None
    return steps if isinstance(steps, int) and steps > 0 else None


def final_model(run_dir: Path) -> Path | None:
    """run_dir/final when it holds a model (config.json, or a LoRA adapter's config)."""
    final = Path(run_dir) / FINAL_DIR
    return final if any((final / name).is_file() for name in _MODEL_FILES) else None


def run_info(run_dir: str | Path) -> RunInfo:
    """The status row of one run directory (see the module docstring for the rules). A bad
    metrics.jsonl does not raise: the row says `unreadable` and `problem` says why."""
    run_dir = Path(run_dir)
    records, problem = [], None
    if (run_dir / METRICS_FILE).is_file():
        try:
            records = latest_records(parse_metrics(run_dir / METRICS_FILE))
        except InputError as err:
            problem = str(err)
    checkpoints = list_checkpoints(run_dir)
    newest = checkpoints[-1] if checkpoints else None
    saved = checkpoint_step(newest) if newest is not None else None
    last = max((r["step"] for r in records), default=None)
    planned = planned_steps(run_dir) or saved
    heartbeat = read_heartbeat(run_dir)
    if problem is not None:
        status = "unreadable"
    else:
        finished = final_model(run_dir) is not None and last is not None and last == planned
        status = run_status(heartbeat=heartbeat, finished_files=finished, saved=saved,
                            last_logged=last)  # fmt: skip
    written = [p for p in run_dir.iterdir() if p.name != PLOTS_DIR] or [run_dir]
    return RunInfo(
        path=run_dir, status=status, last_step=last, planned_steps=planned,
        loss=last_value(records, "loss"), eval_loss=last_value(records, "eval_loss"),
        checkpoint=newest, last_written=max(p.lstat().st_mtime for p in written),
        problem=problem, heldout=last_value(records, HELDOUT_KEY),
    )  # fmt: skip


COLUMNS = ("run", "status", "step", "loss", "eval loss", "held-out", "checkpoint",
           "last written")  # fmt: skip
_RIGHT = {"step", "loss", "eval loss", "held-out"}  # numbers align right


def runs_table(infos: list[RunInfo], now: float | None = None) -> str:
    """The `unmask runs` table: a header and one aligned row per run (now: the time the
    ages are counted from, default the current time), then one line per unreadable
    metrics.jsonl saying why."""
    now = time.time() if now is None else now
    rows = [COLUMNS] + [_row(info, now) for info in infos]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = []
    for row in rows:
        cells = [
            cell.rjust(w) if name in _RIGHT else cell.ljust(w)
            for cell, w, name in zip(row, widths, COLUMNS)
        ]
        lines.append("  ".join(cells).rstrip())
    lines += [info.problem for info in infos if info.problem]  # each names its file and line
    return "\n".join(lines)


def _row(info: RunInfo, now: float) -> tuple[str, ...]:
    step = "-" if info.last_step is None else str(info.last_step)
    if info.planned_steps is not None:
        step += f"/{info.planned_steps}"
    stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime(info.last_written))
    return (
        str(info.path), info.status, step, _number(info.loss), _number(info.eval_loss),
        "-" if info.heldout is None else f"{info.heldout:.1%}",
        info.checkpoint.name if info.checkpoint is not None else "-",
        f"{stamp} ({_age(now - info.last_written)} ago)",
    )  # fmt: skip


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f}s"
    for unit, size in (("d", 86400), ("h", 3600)):
        if seconds >= size:
            return f"{seconds // size:.0f}{unit}"
    return f"{seconds // 60:.0f}m"


# -- the end-of-run summary ------------------------------------------------------------------
def run_summary(run_dir: str | Path, *, wall_seconds: float | None = None,
                prompt: str = "...") -> str:  # fmt: skip
    """A few lines to print when a run ends: steps, tokens seen, wall time, mean tokens/s,
    final and best eval loss (with the best one's step), skipped non-finite steps when any,
    the held-out exact match when measured, the checkpoints kept, final/, and the commands
    to try next (`unmask generate --model RUN/final --prompt PROMPT`, `unmask plot RUN`).

    Given as arguments: wall_seconds, the wall time of the run as the trainer measured it
    (None: the last `elapsed_seconds` in metrics.jsonl, else the wall time is left out);
    prompt, the example prompt of the generate command. Read from run_dir: metrics.jsonl
    (steps, tokens_seen, the mean of the logged tokens_per_second, eval losses, skip counts,
    heldout_exact_match), the complete checkpoint-N/ folders, final/ and eval_results.json
    (the held-out exact match and its number of prompts). InputError as `read_history`.
    """
    run_dir = Path(run_dir)
    records = read_history(run_dir)
    steps = max(r["step"] for r in records)
    head = f"unmask: run {run_dir} done: {steps} steps"
    tokens = last_value(records, "tokens_seen")
    if tokens is not None:
        head += f", {_count(tokens)} tokens seen"
    if wall_seconds is None:
        wall_seconds = last_value(records, "elapsed_seconds")
    if wall_seconds is not None:
        head += f" in {format_duration(wall_seconds)}"
    rates = [v for v in series(records, "tokens_per_second")[1] if math.isfinite(v)]
    if rates:
        head += f" (mean {_count(sum(rates) / len(rates))} tokens/s)"
    lines = [head]
    eval_steps, eval_losses = series(records, "eval_loss")
    if eval_losses:
        best = min(range(len(eval_losses)), key=lambda i: eval_losses[i])
        lines.append(f"  eval loss: final {eval_losses[-1]:.4f} at step {eval_steps[-1]}, "
                     f"best {eval_losses[best]:.4f} at step {eval_steps[best]}")  # fmt: skip
    accuracy = _heldout(run_dir, records)
    if accuracy:
        lines.append(f"  held-out exact match: {accuracy}")
    skipped = skipped_total(records)
    if skipped:
        lines.append(f"  skipped (non-finite) steps: {skipped}")
    checkpoints = list_checkpoints(run_dir)
    kept = ", ".join(p.name for p in checkpoints) or "none"
    lines.append(f"  checkpoints kept: {kept}")
    final = final_model(run_dir)
    model = final or (checkpoints[-1] if checkpoints else None)
    lines.append(f"  final model: {final if final else 'none (no final/ written)'}")
    if model is not None:
        lines.append(f"  next: unmask generate --model {shlex.quote(str(model))} "
                     f"--prompt {shlex.quote(prompt)}")  # fmt: skip
    indent = "        " if model is not None else "  next: "
    lines.append(f"{indent}unmask plot {shlex.quote(str(run_dir))}")
    return "\n".join(lines)


def _heldout(run_dir: Path, records: list[dict]) -> str | None:
    """'98.7% on 300 prompts' from eval_results.json, else the logged value, else None."""
    try:
        result = json.loads((run_dir / EVAL_RESULTS).read_text())
        return f"{result['heldout_exact_match']:.1%} on {result['num_examples']} prompts"
    except (OSError, ValueError, KeyError, TypeError):
        value = last_value(records, HELDOUT_KEY)
        return None if value is None else f"{value:.1%}"


def _count(value: float) -> str:
    """960, 12.3k, 5.76M, 1.20B."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= size:
            scaled = value / size
            return (f"{scaled:.0f}" if abs(scaled) >= 100 else f"{scaled:.3g}") + unit
    return f"{value:.0f}"

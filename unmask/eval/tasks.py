"""`unmask eval --tasks`: lm-eval tasks run in this process, the results file reproducible.

The same command twice writes the same bytes except the `wall_clock` entry (timestamps,
seconds, tokens per second): every seed is set from `--seed` (Python's `random`, numpy,
torch, lm-eval's few-shot sampler, the likelihood masks of request i: seed + i, the
generation draws), the results are written with sorted keys, plain Python numbers (float
repr, the shortest exact form), non-finite floats as strings, and nothing that names a
memory address (a task's Python function is written by its qualified name). Environment
dumps that change from run to run (lm-eval's git hash, date, `pretty_env_info`) are left
out; the package versions are written instead.

Tasks are names (lm-eval's own, or those of YAML files under `--include-path`) or paths of
task YAML files; local `dataset_path: json` data files need no network.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from unmask.errors import InputError, did_you_mean
from unmask.eval.presets import Preset

#: the packages whose versions decide the numbers (the results file's `versions`)
PACKAGES = ("unmask", "torch", "transformers", "lm_eval", "datasets", "tokenizers", "numpy")
#: task file endings: a task given with one is a path
TASK_FILE = (".yaml", ".yml")
#: lm-eval output types scored by likelihood
LIKELIHOOD_TYPES = ("loglikelihood", "loglikelihood_rolling", "multiple_choice")


@dataclass
class TaskRun:
    """What `run_tasks` needs besides the model: the tasks, the preset and lm-eval's knobs."""

    tasks: list[str]
    preset: Preset
    include_path: str | None = None
    limit: float | None = None
    num_fewshot: int | None = None
    seed: int = 0
    bootstrap_iters: int = 100000
    log_samples: bool = False
    system_instruction: str | None = None


def split_tasks(values: list[str]) -> list[str]:
    """`--tasks a,b --tasks c` -> [a, b, c]; empty items dropped."""
    return [t.strip() for value in values for t in value.split(",") if t.strip()]


def check_task_files(tasks: list[str], include_path: str | None) -> None:
    """Task paths and --include-path are checked before anything loads (one line each)."""
    if include_path is not None and not Path(include_path).is_dir():
        raise InputError(
            f"--include-path {include_path!r} is not a folder; give the folder that holds "
            "the task YAML files"
        )
    for task in tasks:
        if task.endswith(TASK_FILE) or "/" in task:
            if not Path(task).is_file():
                raise InputError(
                    f"task file {task!r} does not exist; give a task YAML file or a task "
                    "name (tasks in a folder: --include-path FOLDER)"
                )


def task_manager(tasks: list[str], include_path: str | None):
    """lm-eval's TaskManager: without lm-eval's own tasks when every named task is in the
    --include-path folder (or all are YAML paths): indexing lm-eval's thousands of task
    files takes half a minute. An unknown name: InputError."""
    from lm_eval.tasks import TaskManager

    names = [t for t in tasks if not (t.endswith(TASK_FILE) or "/" in t)]
    manager = TaskManager(include_path=include_path, include_defaults=False)
    if all(name in manager.all_tasks for name in names):
        return manager
    manager = TaskManager(include_path=include_path)
    for name in names:
        if name not in manager.all_tasks:
            where = f" or in {include_path!r}" if include_path else ""
            raise InputError(
                f"unknown task {name!r}{did_you_mean(name, manager.all_tasks)}: not an "
                f"lm-eval task{where}; give a task name, a task YAML file, or --include-path "
                "FOLDER"
            )
    return manager


def load_tasks(manager, tasks: list[str]) -> dict:
    """lm-eval's task dict; a task that cannot be built (bad YAML, a missing data file)
    is an InputError naming it. Quiet: no datasets progress bars, lm-eval's warnings only
    from the run on (bad input is one line)."""
    import datasets

    logger = logging.getLogger("lm_eval")
    level, bars = logger.level, datasets.is_progress_bar_enabled()
    logger.setLevel(logging.ERROR)
    datasets.disable_progress_bars()
    try:
        return manager.load(tasks)
    except InputError:
        raise
    except Exception as err:  # lm-eval and datasets raise many kinds
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise InputError(f"--tasks {','.join(tasks)}: could not load: {first}") from None
    finally:
        logger.setLevel(level)
        if bars:
            datasets.enable_progress_bars()


def check_modes(loaded: dict, preset: Preset) -> dict[str, str]:
    """{task: output type}; likelihood tasks under a generation preset are refused."""
    types = {name: task.OUTPUT_TYPE for name, task in sorted(loaded["tasks"].items())}
    if not preset.likelihood_tasks:
        scored = [name for name, kind in types.items() if kind in LIKELIHOOD_TYPES]
        if scored:
            raise InputError(
                f"task {scored[0]!r} is {types[scored[0]]} (scored by likelihood); --preset "
                f"{preset.name} scores by generation: use --preset base, or a generate_until "
                "task"
            )
    return types


def seed_everything(seed: int) -> None:
    """Python's random, numpy and torch (every device) from one seed."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run_tasks(lm, run: TaskRun, loaded: dict) -> dict[str, Any]:
    """lm-eval's evaluate() on the loaded tasks with every seed from run.seed (the module
    docstring); returns lm-eval's results dict."""
    from lm_eval.evaluator import evaluate

    for task in loaded["tasks"].values():
        if run.num_fewshot is not None and task.get_config("num_fewshot") != 0:
            task.set_config(key="num_fewshot", value=run.num_fewshot)
        elif task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=run.seed)
    seed_everything(run.seed)
    return evaluate(
        lm=lm, task_dict=loaded, limit=run.limit, bootstrap_iters=run.bootstrap_iters,
        log_samples=run.log_samples, system_instruction=run.system_instruction,
        apply_chat_template=run.preset.chat_template,
        fewshot_as_multiturn=run.preset.chat_template,
    )  # fmt: skip


def results_tree(
    results: dict[str, Any],
    lm,
    run: TaskRun,
    kinds: dict[str, str],
    defaults: dict[str, Any],
    flags: dict[str, Any],
    where: dict[str, Any],
    clock: Clock,
) -> dict[str, Any]:
    """The results file's tree: lm-eval's entries, then `unmask` (how it ran: `where` = the
    command, model, tokenizer, base and system instruction; the preset, every seed, the
    likelihood and sampling settings, the package versions), `throughput` (counts only)
    and `wall_clock` (the one entry that changes from run to run)."""
    seed, preset = run.seed, run.preset
    head = {
        **where, "device": str(lm.sm.device), "preset": preset.name, "mode": preset.mode,
        "chat_template": preset.chat_template,
        "chat_template_sha256": chat_template_sha(lm.sm.tokenizer)
        if preset.chat_template else None,
        "tasks": run.tasks, "task_output_types": kinds, "include_path": run.include_path,
        "limit": run.limit, "num_fewshot": run.num_fewshot,
        "bootstrap_iters": run.bootstrap_iters, "seed": seed,
        "seeds": {"python_random": seed, "numpy": seed, "torch": seed,
                  "fewshot_sampler": seed, "generation": seed,
                  "likelihood_masks": f"request i of a call: {seed} + i"},
        "likelihood": {"mc_num": lm.mc_num, "mc_batch_size": lm.mc_batch_size,
                       "check_greedy": lm.check_greedy, "max_length": lm.max_length,
                       "cfg_scale": lm.options.cfg_scale,
                       "shift_logits": lm.options.shift_logits},
        "generation_batch_size": lm.gen_batch_size,
        "sampling": lm.options.record(), "sampling_preset": defaults,
        "sampling_flags": flags, "generations": lm.generations,
        "versions": package_versions(),
    }  # fmt: skip
    stats = dict(lm.stats)
    seconds = stats.pop("generation_seconds")
    # answer tokens per forward per row: the parallelism AUP (aup.py) weighs accuracy by
    stats["tokens_per_forward"] = round(
        stats["generated_tokens"] / max(1, stats["row_forwards"]), 4
    )
    stats["counts"] = ("generated_tokens: answer tokens before the first EOS (no prompt, "
                       "canvas or padding); canvas_tokens: the masks decoded")  # fmt: skip
    wall = clock.entry(seconds, stats["generated_tokens"])
    return {**results, "unmask": head, "throughput": stats, "wall_clock": wall}


def package_versions() -> dict[str, str]:
    """Installed versions of PACKAGES and the Python version ("not installed" if absent)."""
    found = {}
    for name in PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "not installed"
    found["python"] = ".".join(map(str, sys.version_info[:3]))
    return found


def plain(value: Any) -> Any:
    """A JSON tree that serializes the same every run: str keys (sorted when written),
    lists for tuples and sets (sets sorted), Python numbers for numpy ones, non-finite floats
    as "nan" / "inf" / "-inf", functions by qualified name, anything else by its str (never
    a repr holding a memory address)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, set | frozenset):
        return sorted((plain(v) for v in value), key=repr)
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else str(value)
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        try:
            return plain(value.item())
        except (TypeError, ValueError):
            pass
    if callable(value):
        module = getattr(value, "__module__", None) or ""
        name = getattr(value, "__qualname__", None) or type(value).__name__
        return f"{module}.{name}" if module else name
    text = str(value)
    return text if " at 0x" not in text else type(value).__name__


def results_text(tree: dict[str, Any]) -> str:
    """The results file's text: sorted keys, two-space indents, a final newline."""
    return json.dumps(plain(tree), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def chat_template_sha(tokenizer) -> str | None:
    """sha256 of the tokenizer's chat template text (None without one)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return None
    text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def timestamp(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="seconds")


class Clock:
    """The wall-clock facts of a run: start and end time, seconds."""

    def __init__(self, now: Callable[[], float] = time.time) -> None:
        self.now = now
        self.started = now()

    def entry(self, generation_seconds: float, generated_tokens: int) -> dict[str, Any]:
        finished = self.now()
        return {
            "started_at": timestamp(self.started),
            "finished_at": timestamp(finished),
            "seconds": round(finished - self.started, 6),
            "generation_seconds": round(generation_seconds, 6),
            "generated_tokens_per_second": round(
                generated_tokens / generation_seconds, 3) if generation_seconds > 0 else None,
        }  # fmt: skip


def summary_lines(results: dict[str, Any]) -> list[str]:
    """One line per task and metric for stderr: `task: metric value (stderr)`."""
    lines = []
    for task, metrics in sorted(results.get("results", {}).items()):
        known = results.get("higher_is_better", {}).get(task, {})
        for key, value in sorted(metrics.items()):
            if key.split(",")[0] not in known or not isinstance(value, int | float):
                continue
            error = metrics.get(key.replace(",", "_stderr,", 1))
            shown = f" (stderr {error:.4g})" if isinstance(error, int | float) else ""
            lines.append(f"unmask: {task}: {key.split(',')[0]} {value:.4g}{shown}")
    return lines

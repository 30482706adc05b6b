"""`unmask eval --tasks` end to end: the lm-eval model built from the request, the tasks
loaded, checked against the preset and run, and the results file and summary lines built.

Imports the lm-eval adapter (harness.py), so importing this module needs lm-eval (the
`eval` extra): the CLI imports it only for --tasks, after every check of its flags.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unmask.checkpoint import resolve_model_folder
from unmask.errors import InputError
from unmask.eval import tasks as lm_tasks
from unmask.eval.harness import UnmaskLM, read_pictures
from unmask.eval.presets import PRESETS, preset_sampling
from unmask.models.diffusion_gemma_vision import require_vision
from unmask.parallel.threads import set_sampling_threads
from unmask.sampling.generation_file import saved_sampling

#: lm-eval's default bootstrap rounds for the stderr of non-mean metrics
BOOTSTRAP_ITERS = 100000
#: prompts decoded together by default
GEN_BATCH_SIZE = 16


@dataclass
class TaskRequest:
    """What `unmask eval --tasks` runs, its flags checked (None: the preset's or lm-eval's
    default)."""

    tasks: list[str]  # task names or task YAML files
    model: str
    preset: str | None = None  # base (default) or instruct
    include_path: str | None = None
    tokenizer: str | None = None
    base: str | None = None
    device: str = "auto"
    mask_id: int | None = None
    mc_num: int | None = None
    batch_size: int | None = None  # Monte Carlo rows per forward pass
    gen_batch_size: int | None = None
    seed: int = 0
    limit: float | None = None  # examples per task, or a fraction below 1
    num_fewshot: int | None = None
    bootstrap_iters: int | None = None
    log_samples: bool = False
    system_instruction: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # sampling flags given
    command_line: list[str] = field(default_factory=list)  # recorded in the results


@dataclass
class TaskResults:
    """The results file's tree and text (the same for the same command but `wall_clock`),
    how many tasks ran, and the lines for stderr."""

    tree: dict[str, Any]
    text: str
    tasks: int
    lines: list[str]


def picture_roots(loaded: dict) -> dict[str, Path]:
    """{task: the folder of its data file} for the tasks with pictures (doc_to_image) whose
    local data files are in one folder: their documents' relative picture paths start
    there (docs/multimodal.md, Evaluation)."""
    roots = {}
    for name, task in loaded["tasks"].items():
        if not getattr(task, "MULTIMODAL", False):
            continue
        files = (task.config.dataset_kwargs or {}).get("data_files")
        values = list(files.values()) if isinstance(files, dict) else [files]
        paths = [p for v in values for p in (v if isinstance(v, list) else [v]) if p]
        folders = {Path(str(p)).parent for p in paths}
        if len(folders) == 1:
            roots[name] = folders.pop()
    return roots


def check_pictures(lm: UnmaskLM, loaded: dict, limit: float | None) -> None:
    """Every picture the tasks' documents name (those --limit keeps) read before anything
    runs: a missing or unreadable one, or pictures for a model without a vision tower, is
    one line (InputError)."""
    for name, task in sorted(loaded["tasks"].items()):
        if not getattr(task, "MULTIMODAL", False):
            continue
        docs = list(task.eval_docs)
        if limit is not None:
            docs = docs[: int(limit) if limit >= 1 else math.ceil(len(docs) * limit)]
        root = lm.picture_roots.get(name, Path.cwd())
        for doc_id, doc in enumerate(docs):
            where = f"task {name!r} document {doc_id}"
            if read_pictures(task.doc_to_image(doc), root, where) is not None:
                require_vision(lm.sm.model)


def evaluate_tasks(request: TaskRequest) -> TaskResults:
    """Run the tasks with the preset (presets.py) in this process (tasks.py: every seed set,
    the results file). The model folder is read first, so a missing one is named before any
    task data is read."""
    preset = PRESETS[request.preset or "base"]
    clock = lm_tasks.Clock()
    saved = saved_sampling(resolve_model_folder(request.model))
    defaults = preset_sampling(preset, saved)
    names = request.tasks
    loaded = lm_tasks.load_tasks(lm_tasks.task_manager(names, request.include_path), names)
    kinds = lm_tasks.check_modes(loaded, preset)
    scored = [name for name, kind in kinds.items() if kind in lm_tasks.LIKELIHOOD_TYPES]
    if saved.get("uniform_canvas") and scored:
        raise InputError(
            f"task {scored[0]!r} is {kinds[scored[0]]} (scored by likelihood), which a "
            "uniform-canvas (diffusion_gemma) model does not give here (the MC estimator masks "
            "tokens; it has no [MASK]): use --preset instruct and generate_until tasks"
        )
    try:
        lm = UnmaskLM(pretrained=request.model, tokenizer=request.tokenizer, base=request.base,
                      device=request.device, mask_id=request.mask_id,
                      mc_num=request.mc_num or preset.mc_num,
                      mc_batch_size=request.batch_size or preset.mc_batch_size,
                      batch_size=request.gen_batch_size or GEN_BATCH_SIZE, seed=request.seed,
                      defaults=defaults, **request.sampling)  # fmt: skip
    except ValueError as err:
        raise InputError(str(err)) from None
    set_sampling_threads(lm.sm.model, lm.sm.device)
    lm.picture_roots = picture_roots(loaded)
    check_pictures(lm, loaded, request.limit)
    limit = request.limit
    limit = limit if limit is None or limit < 1 else int(limit)
    bootstrap = BOOTSTRAP_ITERS if request.bootstrap_iters is None else request.bootstrap_iters
    run = lm_tasks.TaskRun(names, preset, request.include_path, limit, request.num_fewshot,
                           request.seed, bootstrap, request.log_samples,
                           request.system_instruction)  # fmt: skip
    results = lm_tasks.run_tasks(lm, run, loaded)
    where = {"command": request.command_line, "model": request.model,
             "tokenizer": request.tokenizer, "base": request.base,
             "system_instruction": request.system_instruction}  # fmt: skip
    tree = lm_tasks.results_tree(results, lm, run, kinds, defaults, request.sampling, where,
                                 clock)  # fmt: skip
    lines = lm_tasks.summary_lines(results)
    stats = tree["throughput"]
    if stats["generation_requests"]:
        wall = tree["wall_clock"]
        lines.append(f"unmask: {stats['generated_tokens']} generated tokens for "
                     f"{stats['generation_requests']} prompt(s) in "
                     f"{wall['generation_seconds']:.2f}s: "
                     f"{wall['generated_tokens_per_second']} generated tokens/s, "
                     f"{stats['tokens_per_forward']} tokens per forward")  # fmt: skip
        if "edits" in stats:  # a decoder that edits its committed tokens (joint_threshold)
            lines[-1] += f", {stats['edits']} edits"
    return TaskResults(tree, lm_tasks.results_text(tree), len(kinds), lines)

"""`unmask eval`: likelihood scores of a file (--pairs, --ppl; unmask/eval/scores.py) or
lm-eval tasks with a preset (--tasks; unmask/eval/evaluate.py). This module checks which
flags go together and writes what eval/ returns; every check runs before the model loads."""

import argparse
import json
import sys
from pathlib import Path

from unmask.cli.flags import (
    SAMPLING_REFERENCE,
    add_base_flag,
    check_out_file,
    positive_int,
    read_text,
)
from unmask.cli.sampling_flags import add_sampling_flags, sampling_flags
from unmask.errors import InputError


def add_eval(sub: argparse._SubParsersAction) -> None:
    ev = sub.add_parser(
        "eval",
        help="likelihood scores (Monte Carlo ELBO) of answers or a text, or lm-eval tasks "
        "with a base / instruct preset",
        description="Score answers given prompts (--pairs: only answer tokens are masked) "
        "or a whole text (--ppl: every token masked), or run lm-eval tasks (--tasks) with a "
        "preset: base (likelihood) or instruct (generation with the chat template); records, "
        "fields and the results file: docs/sampling.md.",
        epilog=SAMPLING_REFERENCE,
    )
    ev.add_argument(
        "--model", required=True, help="checkpoint-N, run output_dir or exported folder"
    )
    what = ev.add_mutually_exclusive_group(required=True)
    what.add_argument("--ppl", metavar="FILE", help="text file scored unconditionally: every "
                      "token masked and scored, no prompt (a perplexity upper bound)")  # fmt: skip
    what.add_argument("--pairs", metavar="FILE", help="answers given prompts: jsonl of "
                      '{"prompt", "response" or "answer"}, or lines with --separator')  # fmt: skip
    what.add_argument("--tasks", metavar="TASKS", action="append", help="lm-eval tasks, "
                      "comma-separated (repeatable): names, or task YAML files")  # fmt: skip
    ev.add_argument("--separator", help="--pairs is a text file: each line split at the first "
                    "SEPARATOR, the prompt keeps it (e.g. '=')")  # fmt: skip
    ev.add_argument("--prompt-field", help="jsonl field of the prompt (default: prompt)")
    ev.add_argument("--answer-field", help="jsonl field of the answer (default: response, "
                    "else answer)")  # fmt: skip
    ev.add_argument("--eos", choices=("auto", "none", "eos", "pad"), help="EOS scored after "
                    "each answer: none, one (eos), or padding to --row-length (pad); default "
                    "auto: as the model's run config trained it")  # fmt: skip
    ev.add_argument("--row-length", type=positive_int, help="--eos pad: prompt + answer + EOS "
                    "padding in tokens (default: the run's data.packing_length)")  # fmt: skip
    ev.add_argument("--per-line", action="store_true", help="print one record per pair (or "
                    "per line of --ppl, each scored alone) before the summary")  # fmt: skip
    ev.add_argument("--out", metavar="FILE", help="--ppl / --pairs: write the per-line records "
                    "and the summary here (jsonl); --tasks: the results JSON")  # fmt: skip
    ev.add_argument("--tokenizer", help="tokenizer folder (default: the model folder)")
    add_base_flag(ev)
    ev.add_argument("--context", type=positive_int,
                    help="--ppl: tokens per scored chunk (default: 512)")  # fmt: skip
    ev.add_argument("--mc-num", type=positive_int, help="Monte Carlo rows per pair / chunk / "
                    "choice, rounded up to whole batches (default: 32; --tasks: the "
                    "preset's, 128)")  # fmt: skip
    ev.add_argument("--batch-size", type=positive_int, help="Monte Carlo rows per forward "
                    "pass: one independent draw, the stderr needs two or more (default: 16; "
                    "--tasks: the preset's, 32)")  # fmt: skip
    ev.add_argument("--mask-id", type=int, help="mask token id (default: the tokenizer's)")
    ev.add_argument("--device", default="auto", help="auto (cuda when visible), cpu or cuda")
    ev.add_argument("--seed", type=int, default=0, help="seed of every draw: the masking "
                    "draws (item i: seed + i), and with --tasks also generation, Python, "
                    "numpy, torch and the few-shot sampler")  # fmt: skip
    tasks = ev.add_argument_group("lm-eval tasks (--tasks)")
    tasks.add_argument("--preset", choices=("base", "instruct"), help="base (default): "
                       "likelihood, no chat template; instruct: generation with the chat "
                       "template (docs/sampling.md)")  # fmt: skip
    tasks.add_argument("--include-path", metavar="FOLDER", help="folder of task YAML files "
                       "(its tasks need no lm-eval download)")  # fmt: skip
    tasks.add_argument("--limit", type=float, help="examples per task (a fraction below 1)")
    tasks.add_argument("--num-fewshot", type=int, help="few-shot examples per prompt "
                       "(default: the task's)")  # fmt: skip
    tasks.add_argument("--bootstrap-iters", type=int, help="bootstrap rounds of the stderr "
                       "of non-mean metrics (default: 100000, lm-eval's)")  # fmt: skip
    tasks.add_argument("--log-samples", action="store_true", help="write every request's "
                       "prompt, response and score into the results file")  # fmt: skip
    tasks.add_argument("--system-instruction", help="system message of every prompt")
    tasks.add_argument("--gen-batch-size", type=positive_int, help="prompts decoded together "
                       "(default: 16)")  # fmt: skip
    add_sampling_flags(ev)
    ev.set_defaults(func=cmd_eval)


def _given(flags: dict) -> list[str]:
    return [name for name, value in flags.items() if value is not None]


def cmd_eval(ns: argparse.Namespace) -> int:
    """Likelihood scores of a file: answers given prompts (--pairs) or a text (--ppl);
    the modes, records and fields: unmask/eval/scores.py and docs/sampling.md. lm-eval
    tasks (--tasks): `eval_tasks`."""
    from unmask.eval import scores

    if ns.tasks:
        return eval_tasks(ns)
    given = _given({"--preset": ns.preset, "--include-path": ns.include_path,
                    "--limit": ns.limit, "--num-fewshot": ns.num_fewshot,
                    "--bootstrap-iters": ns.bootstrap_iters,
                    "--log-samples": ns.log_samples or None,
                    "--system-instruction": ns.system_instruction,
                    "--gen-batch-size": ns.gen_batch_size})  # fmt: skip
    given += ["--" + k.replace("_", "-") for k, v in sampling_flags(ns).items() if v is not None]
    if given:
        raise InputError(f"{', '.join(given)} apply to --tasks, not --ppl / --pairs")
    flag = "--pairs" if ns.pairs else "--ppl"
    path = Path(ns.pairs or ns.ppl)
    if ns.ppl:
        given = _given({"--separator": ns.separator, "--prompt-field": ns.prompt_field,
                        "--answer-field": ns.answer_field, "--eos": ns.eos,
                        "--row-length": ns.row_length})  # fmt: skip
        if given:
            raise InputError(f"{', '.join(given)} apply to --pairs, not --ppl")
    elif ns.context is not None:
        raise InputError("--context applies to --ppl (a text in chunks), not --pairs")
    if not path.is_file():
        raise InputError(f"{flag} {str(path)!r} does not exist; give a text file")
    if ns.out:
        check_out_file(Path(ns.out))
    text = read_text(path, flag)
    pairs = None
    if ns.pairs:
        pairs = scores.parse_pairs(text, str(path), ns.separator, ns.prompt_field or "prompt",
                                   ns.answer_field)  # fmt: skip
    request = scores.ScoreRequest(
        flag=flag,
        path=path,
        text=text,
        pairs=pairs,
        model=ns.model,
        tokenizer=ns.tokenizer,
        device=ns.device,
        mask_id=ns.mask_id,
        base=ns.base,
        mc_num=ns.mc_num or 32,
        batch_size=ns.batch_size or 16,
        seed=ns.seed,
        context=ns.context or 512,
        each_line=bool(ns.per_line or ns.out),
        eos=ns.eos,
        row_length=ns.row_length,
    )
    records, result = scores.score_file(request)
    lines = [json.dumps(r) + "\n" for r in [*records, result]]
    if ns.out:
        with open(ns.out, "w") as handle:
            handle.writelines(lines)
    sys.stdout.writelines(lines if ns.per_line else lines[-1:])
    print(scores.describe(result), file=sys.stderr)
    return 0


def eval_tasks(ns: argparse.Namespace) -> int:
    """lm-eval tasks with a preset, in this process (unmask/eval/evaluate.py); the results
    file is the same for the same command but for `wall_clock`. Every check of the flags
    runs before the model loads; the file is written last."""
    from unmask.eval import tasks as lm_tasks

    given = _given({"--ppl": ns.ppl, "--pairs": ns.pairs, "--separator": ns.separator,
                    "--prompt-field": ns.prompt_field, "--answer-field": ns.answer_field,
                    "--eos": ns.eos, "--row-length": ns.row_length, "--context": ns.context,
                    "--per-line": ns.per_line or None})  # fmt: skip
    if given:
        raise InputError(f"{', '.join(given)} apply to --ppl / --pairs, not --tasks")
    names = lm_tasks.split_tasks(ns.tasks)
    if not names:
        raise InputError("--tasks is empty; give task names or task YAML files, comma-separated")
    lm_tasks.check_task_files(names, ns.include_path)
    if ns.out:
        check_out_file(Path(ns.out))
    if not 0 <= ns.seed < 2**32:  # numpy's seeds
        raise InputError(f"--seed must be in 0..2**32 - 1 with --tasks (got {ns.seed})")
    if ns.num_fewshot is not None and ns.num_fewshot < 0:
        raise InputError(f"--num-fewshot must be >= 0 (got {ns.num_fewshot})")
    if ns.limit is not None and ns.limit <= 0:
        raise InputError(f"--limit must be > 0 (got {ns.limit:g}): examples per task, or a "
                         "fraction below 1")  # fmt: skip
    try:
        from unmask.eval.evaluate import TaskRequest, evaluate_tasks
    except ImportError:
        raise InputError("--tasks runs lm-eval, which is not installed: "
                         "pip install 'unmask[eval]'") from None  # fmt: skip
    request = TaskRequest(
        tasks=names,
        model=ns.model,
        preset=ns.preset,
        include_path=ns.include_path,
        tokenizer=ns.tokenizer,
        base=ns.base,
        device=ns.device,
        mask_id=ns.mask_id,
        mc_num=ns.mc_num,
        batch_size=ns.batch_size,
        gen_batch_size=ns.gen_batch_size,
        seed=ns.seed,
        limit=ns.limit,
        num_fewshot=ns.num_fewshot,
        bootstrap_iters=ns.bootstrap_iters,
        log_samples=ns.log_samples,
        system_instruction=ns.system_instruction,
        sampling={k: v for k, v in sampling_flags(ns).items() if v is not None},
        command_line=ns.command_line,
    )
    done = evaluate_tasks(request)
    if ns.out:
        Path(ns.out).write_text(done.text, encoding="utf-8")
        print(f"unmask: wrote the results of {done.tasks} task(s) to {ns.out}", file=sys.stderr)
    else:
        sys.stdout.write(done.text)
    for line in done.lines:
        print(line, file=sys.stderr)
    return 0

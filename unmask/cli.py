"""The command line: `unmask train | generate | eval | export | preprocess | plot | runs`.
The only module that reads argv.

Bad input (an InputError from anywhere, or a bad command line) becomes one line on stderr
and exit code 2, a run that cannot go on (RunStopped: non-finite losses, a full disk, a lost
peer process) one line and exit code 1; `--debug` also prints the traceback.
Each command imports what it needs inside its function (start-up time: `unmask generate`
does not load the trainer, `unmask train` not lm-eval); the layering needs none of it.
"""

import argparse
import json
import sys
import traceback
import types
from pathlib import Path
from typing import Literal, Union, get_args, get_origin

from unmask.errors import InputError, NothingToTrain, RunStopped
from unmask.sampling.config import SamplingConfig

REFERENCE = (
    "Every config key with its default and accepted values: docs/configuration.md "
    "(also `python -m unmask.config`); errors and what to do: docs/troubleshooting.md."
)
SAMPLING_REFERENCE = (
    "Every sampling option (the generation_config.json fields and these flags), the kinds of "
    "model folder read, and the likelihood estimator: docs/sampling.md; errors and what to "
    "do: docs/troubleshooting.md."
)


def _version() -> str:
    """'unmask X (torch Y)', read from the installed packages' metadata (no torch import)."""
    from importlib.metadata import PackageNotFoundError, version

    from unmask import __version__

    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "not installed"
    return f"unmask {__version__} (torch {torch_version})"


class UsageError(Exception):
    """A command line argparse refuses; main turns it into one line and exit code 2."""


class Parser(argparse.ArgumentParser):
    """argparse, but a bad command line is one line naming the --help to read, not the
    usage block followed by a SystemExit."""

    def error(self, message: str):
        raise UsageError(f"{message}; see `{self.prog} --help`")


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1 (got {text!r})")
    return value


def _split_train_args(args: list[str], config_flag: str | None) -> tuple[str | None, list[str]]:
    """`unmask train [FILE] [key=value ...]`: the one argument without '=' is the file."""
    files = [a for a in args if "=" not in a]
    overrides = [a for a in args if "=" in a]
    if config_flag is not None:
        files.insert(0, config_flag)
    if len(files) > 1:
        raise InputError(
            f"expected one config file, got {files}; overrides are written section.key=value"
        )
    return (files[0] if files else None), overrides


def cmd_train(ns: argparse.Namespace) -> int:
    from unmask.config import dump_config, load_config

    path, overrides = _split_train_args(ns.args, ns.config)
    cfg = load_config(path, overrides)
    if ns.print_config:  # what would run, written nowhere
        print(dump_config(cfg), end="")
        return 0
    if path is None:
        print("unmask: no config given, running the built-in quickstart", file=sys.stderr)
    from unmask.train.run_dir import resume_advice, resume_command
    from unmask.train.trainer import Trainer  # after the config: a typo is refused fast

    # what a stop prints (a signal, a lost peer, a second Ctrl-C): the user's own command
    ns.resume_command = resume_command(cfg.train.output_dir, path, overrides)
    trainer = Trainer(cfg)
    trainer.resume_command = ns.resume_command
    try:
        trainer.train()
    except KeyboardInterrupt:  # a second Ctrl-C: the newest complete checkpoint stays
        print(f"unmask: interrupted; {resume_advice(ns.resume_command)}", file=sys.stderr)
        return 130
    return trainer.exit_code  # 0, or 130 after a Ctrl-C stop (SIGTERM / SIGUSR1 stop: 0)


def cmd_generate(ns: argparse.Namespace) -> int:
    import torch

    from unmask.checkpoint import load_for_sampling
    from unmask.sampling.config import resolve_sampling
    from unmask.sampling.show import TerminalAnimation
    from unmask.sampling.texts import generate_texts, throughput, unknown_characters

    prompts = list(ns.prompt or [])
    if ns.prompts:
        prompts += _read_prompts(Path(ns.prompts))
    if not prompts:
        raise InputError("no prompts; give --prompt TEXT (repeatable) or --prompts FILE.jsonl")
    if ns.out:
        _check_out_file(Path(ns.out))
    sm = load_for_sampling(ns.model, ns.tokenizer, ns.device, ns.mask_id, base=ns.base)
    _auto_threads(sm)
    config = resolve_sampling(sm.saved, sampling_flags(ns))
    generator = (
        torch.Generator(device=sm.device).manual_seed(ns.seed) if ns.seed is not None else None
    )
    for prompt in prompts:
        ids = sm.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        unknown = unknown_characters(sm.tokenizer, prompt, ids)
        if unknown:
            print(f"unmask: warning: the tokenizer does not know {unknown!r} in prompt "
                  f"{prompt!r}; the model sees its unknown token there", file=sys.stderr)  # fmt: skip
    on_step = None
    if ns.show:
        on_step = TerminalAnimation(sm.tokenizer, sm.mask_id, sm.pad_id, sm.eos_id,
                                    delay=ns.show_delay)  # fmt: skip
    records = generate_texts(sm, prompts, config, ns.batch_size, generator, on_step)
    if ns.out:
        with open(ns.out, "w") as handle:
            handle.writelines(json.dumps(r) + "\n" for r in records)
        print(f"unmask: wrote {len(records)} record(s) to {ns.out}", file=sys.stderr)
    elif ns.jsonl:
        sys.stdout.writelines(json.dumps(r) + "\n" for r in records)
    else:  # the form depends on the flags only, never on how many prompts there are
        sys.stdout.writelines(r["prompt"] + r["completion"] + "\n" for r in records)
    print(f"unmask: {throughput(records)}", file=sys.stderr)
    return 0


def _auto_threads(sm) -> None:
    """A tiny model on a CPU gets one torch thread per idle core unless OMP_NUM_THREADS is set
    (train's `train.num_threads: auto`, unmask/parallel/threads.py): on a shared 2-core machine
    two threads made a quickstart-sized model's generation 2-40x slower."""
    from unmask.parallel.threads import set_threads

    set_threads("auto", sum(p.numel() for p in sm.model.parameters()), sm.device.type)


def _check_out_file(path: Path) -> None:
    """--out can be written once the samples are done (checked before the model loads)."""
    if path.is_dir():
        raise InputError(f"--out {str(path)!r} is a folder; give the path of a jsonl file")
    if not path.parent.is_dir():
        raise InputError(f"--out {str(path)!r}: folder {str(path.parent)!r} does not exist")


def _read_text(path: Path, flag: str) -> str:
    """A UTF-8 text file given as `flag`; anything else is an InputError naming it."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise InputError(
            f"{flag} {str(path)!r} is not UTF-8 text ({err.reason} at byte {err.start}); "
            "give a text file"
        ) from None


def _read_prompts(path: Path) -> list[str]:
    """Prompts from a jsonl file: one {"prompt": ...} object (or JSON string) per line."""
    if not path.is_file():
        raise InputError(f"--prompts {str(path)!r} does not exist; give a jsonl file")
    prompts = []
    for number, line in enumerate(_read_text(path, "--prompts").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise InputError(
                f'{path}:{number}: not JSON ({err}); write one {{"prompt": "..."}} per line'
            ) from None
        text = item.get("prompt") if isinstance(item, dict) else item
        if not isinstance(text, str):
            raise InputError(f'{path}:{number}: expected {{"prompt": "..."}} or a JSON string')
        prompts.append(text)
    return prompts


def cmd_eval(ns: argparse.Namespace) -> int:
    """Likelihood scores of a file: answers given prompts (--pairs) or a text (--ppl);
    the modes, records and fields: unmask/eval/scores.py and docs/sampling.md. lm-eval
    tasks (--tasks): `_eval_tasks`."""
    from unmask.checkpoint import load_for_sampling, resolve_model_folder
    from unmask.eval import scores
    from unmask.sampling.config import resolve_sampling

    if ns.tasks:
        return _eval_tasks(ns)
    task_flags = {"--preset": ns.preset, "--include-path": ns.include_path,
                  "--limit": ns.limit, "--num-fewshot": ns.num_fewshot,
                  "--bootstrap-iters": ns.bootstrap_iters,
                  "--log-samples": ns.log_samples or None,
                  "--system-instruction": ns.system_instruction,
                  "--gen-batch-size": ns.gen_batch_size}  # fmt: skip
    given = [name for name, value in task_flags.items() if value is not None]
    given += ["--" + k.replace("_", "-") for k, v in sampling_flags(ns).items() if v is not None]
    if given:
        raise InputError(f"{', '.join(given)} apply to --tasks, not --ppl / --pairs")
    ns.mc_num = ns.mc_num or 32
    ns.batch_size = ns.batch_size or 16
    flag = "--pairs" if ns.pairs else "--ppl"
    path = Path(ns.pairs or ns.ppl)
    pair_flags = {"--separator": ns.separator, "--prompt-field": ns.prompt_field,
                  "--answer-field": ns.answer_field, "--eos": ns.eos,
                  "--row-length": ns.row_length}  # fmt: skip
    if ns.ppl:
        given = [name for name, value in pair_flags.items() if value is not None]
        if given:
            raise InputError(f"{', '.join(given)} apply to --pairs, not --ppl")
    elif ns.context is not None:
        raise InputError("--context applies to --ppl (a text in chunks), not --pairs")
    if not path.is_file():
        raise InputError(f"{flag} {str(path)!r} does not exist; give a text file")
    if ns.out:
        _check_out_file(Path(ns.out))
    text = _read_text(path, flag)
    pairs = None
    if ns.pairs:
        pairs = scores.parse_pairs(text, str(path), ns.separator, ns.prompt_field or "prompt",
                                   ns.answer_field)  # fmt: skip
    sm = load_for_sampling(ns.model, ns.tokenizer, ns.device, ns.mask_id, base=ns.base)
    _auto_threads(sm)
    config = resolve_sampling(sm.saved)
    if config.block_causal:
        raise InputError(
            f"{flag}: likelihoods of block-causal (bd3lm) models are not implemented yet "
            "(the MC estimator is the bidirectional one)"
        )
    mc = scores.MonteCarlo(ns.mc_num, ns.batch_size, ns.seed, config.cfg_scale,
                           config.shift_logits)  # fmt: skip
    head = {"file": str(path), "mc_num": ns.mc_num, "batch_size": ns.batch_size, "seed": ns.seed}
    if pairs is not None:
        end = scores.choose_answer_end(ns.eos, ns.row_length, resolve_model_folder(ns.model))
        records = scores.score_pairs(sm, pairs, end, mc)
        result = {"summary": True, "mode": "pairs", **head,
                  "scores": "answers given prompts: answer tokens and their EOS tail masked "
                            "and scored, prompt clean",
                  "eos": end.end, "row_length": end.row_length, "eos_from": end.source,
                  "answer_tokens": sum(r["answer_tokens"] for r in records),
                  **scores.summary(records)}  # fmt: skip
    elif ns.per_line or ns.out:
        lines = [line for line in text.splitlines() if line.strip()]
        if not lines:
            raise InputError(f"--ppl {str(path)!r} holds no text; give a file with text")
        records = scores.score_lines(sm, lines, ns.context or 512, mc)
        result = {"summary": True, "mode": "text-lines", **head,
                  "scores": "each line on its own, every token masked and scored (no prompt)",
                  "context": ns.context or 512, **scores.summary(records)}  # fmt: skip
    else:
        ids = sm.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise InputError(f"--ppl {str(path)!r} holds no tokens; give a file with text to score")
        records, bound = [], scores.score_text(sm, ids, ns.context or 512, mc)
        result = {"summary": True, "mode": "text", **head,
                  "scores": "the whole file as one text, every token masked and scored "
                            "(no prompt)",
                  "ppl_upper_bound": bound.perplexity, "nelbo_per_token": bound.nll_per_token,
                  "stderr_per_token": bound.stderr_per_token, "tokens": bound.tokens,
                  "scored_tokens": bound.tokens, "nelbo": bound.nelbo, "stderr": bound.stderr,
                  "chunks": bound.chunks, "context": ns.context or 512}  # fmt: skip
    lines = [json.dumps(r) + "\n" for r in [*records, result]]
    if ns.out:
        with open(ns.out, "w") as handle:
            handle.writelines(lines)
    sys.stdout.writelines(lines if ns.per_line else lines[-1:])
    print(scores.describe(result), file=sys.stderr)
    return 0


def _eval_tasks(ns: argparse.Namespace) -> int:
    """lm-eval tasks with a preset (unmask/eval/presets.py), in this process; the results
    file (unmask/eval/tasks.py) is the same for the same command but for `wall_clock`.
    Every check runs before the model loads; the file is written last."""
    from unmask.checkpoint import resolve_model_folder
    from unmask.eval import tasks as lm_tasks
    from unmask.eval.presets import PRESETS, preset_sampling
    from unmask.sampling.config import saved_sampling

    pair_flags = {"--ppl": ns.ppl, "--pairs": ns.pairs, "--separator": ns.separator,
                  "--prompt-field": ns.prompt_field, "--answer-field": ns.answer_field,
                  "--eos": ns.eos, "--row-length": ns.row_length, "--context": ns.context,
                  "--per-line": ns.per_line or None}  # fmt: skip
    given = [name for name, value in pair_flags.items() if value is not None]
    if given:
        raise InputError(f"{', '.join(given)} apply to --ppl / --pairs, not --tasks")
    names = lm_tasks.split_tasks(ns.tasks)
    if not names:
        raise InputError("--tasks is empty; give task names or task YAML files, comma-separated")
    lm_tasks.check_task_files(names, ns.include_path)
    if ns.out:
        _check_out_file(Path(ns.out))
    if not 0 <= ns.seed < 2**32:  # numpy's seeds
        raise InputError(f"--seed must be in 0..2**32 - 1 with --tasks (got {ns.seed})")
    if ns.num_fewshot is not None and ns.num_fewshot < 0:
        raise InputError(f"--num-fewshot must be >= 0 (got {ns.num_fewshot})")
    if ns.limit is not None and ns.limit <= 0:
        raise InputError(f"--limit must be > 0 (got {ns.limit:g}): examples per task, or a "
                         "fraction below 1")  # fmt: skip
    try:
        from unmask.eval.harness import UnmaskLM
    except ImportError:
        raise InputError("--tasks runs lm-eval, which is not installed: "
                         "pip install 'unmask[eval]'") from None  # fmt: skip
    preset = PRESETS[ns.preset or "base"]
    clock = lm_tasks.Clock()
    # the model folder first (a missing one is named before any task data is read)
    defaults = preset_sampling(preset, saved_sampling(resolve_model_folder(ns.model)))
    loaded = lm_tasks.load_tasks(lm_tasks.task_manager(names, ns.include_path), names)
    kinds = lm_tasks.check_modes(loaded, preset)
    flags = {k: v for k, v in sampling_flags(ns).items() if v is not None}
    try:
        lm = UnmaskLM(pretrained=ns.model, tokenizer=ns.tokenizer, base=ns.base,
                      device=ns.device, mask_id=ns.mask_id,
                      mc_num=ns.mc_num or preset.mc_num,
                      mc_batch_size=ns.batch_size or preset.mc_batch_size,
                      batch_size=ns.gen_batch_size or 16, seed=ns.seed, defaults=defaults,
                      **flags)  # fmt: skip
    except ValueError as err:
        raise InputError(str(err)) from None
    _auto_threads(lm.sm)
    limit = ns.limit if ns.limit is None or ns.limit < 1 else int(ns.limit)
    bootstrap = 100000 if ns.bootstrap_iters is None else ns.bootstrap_iters
    run = lm_tasks.TaskRun(names, preset, ns.include_path, limit, ns.num_fewshot, ns.seed,
                           bootstrap, ns.log_samples, ns.system_instruction)  # fmt: skip
    results = lm_tasks.run_tasks(lm, run, loaded)
    where = {"command": ns.command_line, "model": ns.model, "tokenizer": ns.tokenizer,
             "base": ns.base, "system_instruction": ns.system_instruction}  # fmt: skip
    tree = lm_tasks.results_tree(results, lm, run, kinds, defaults, flags, where, clock)
    stats = tree["throughput"]
    text = lm_tasks.results_text(tree)
    if ns.out:
        Path(ns.out).write_text(text, encoding="utf-8")
        print(f"unmask: wrote the results of {len(kinds)} task(s) to {ns.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    for line in lm_tasks.summary_lines(results):
        print(line, file=sys.stderr)
    if stats["generation_requests"]:
        clock = tree["wall_clock"]
        print(f"unmask: {stats['generated_tokens']} generated tokens for "
              f"{stats['generation_requests']} prompt(s) in {clock['generation_seconds']:.2f}s: "
              f"{clock['generated_tokens_per_second']} generated tokens/s", file=sys.stderr)  # fmt: skip
    return 0


def cmd_export(ns: argparse.Namespace) -> int:
    from unmask.checkpoint import export_model

    out = export_model(ns.checkpoint, ns.out, dtype=ns.dtype, overwrite=ns.overwrite, base=ns.base)
    print(f"unmask: exported {ns.checkpoint} to {out}", file=sys.stderr)
    return 0


def cmd_preprocess(ns: argparse.Namespace) -> int:
    from unmask.data.preprocess import preprocess

    summary = preprocess(
        ns.input, ns.output_prefix, ns.tokenizer, workers=ns.workers, json_key=ns.json_key,
        append_eod=ns.append_eod, on_bad_record=ns.on_bad_record, overwrite=ns.overwrite,
        command=ns.command_line,
    )  # fmt: skip
    print(summary.line(), file=sys.stderr)
    return 0


def cmd_plot(ns: argparse.Namespace) -> int:
    from unmask.train.plots import plot_runs

    for line in plot_runs(ns.run_dirs, ns.out):
        print(line)
    return 0


def cmd_runs(ns: argparse.Namespace) -> int:
    from unmask.train.report import find_runs, run_info, runs_table

    found = find_runs(ns.folder)
    if not found:
        print(f"no run directories in {ns.folder} (a run directory holds metrics.jsonl, "
              "config.yaml or checkpoint-N/)")  # fmt: skip
        return 0
    print(runs_table([run_info(path) for path in found]))
    return 0


def add_base_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base", metavar="FOLDER", help="base model folder of an unmerged "
                        "LoRA adapter (default: the one the adapter records)")  # fmt: skip


SAMPLING_GROUP = "sampling options (default: the model folder's generation_config.json)"


# SamplingConfig fields with no flag: the step history is data for the Python API (--show
# draws it).
NO_FLAG = ("history",)


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per SamplingConfig field (--gen-length, --cache, --shift-logits/--no-...),
    typed and documented from the field; every default is None = "not given". Hooks are
    given as --logits-hook module:function. A field whose flag the command already has for
    itself (eval's --row-length) gets no flag there."""
    group = parser.add_argument_group(SAMPLING_GROUP)
    added = []
    for name, field in SamplingConfig.model_fields.items():
        if name in NO_FLAG:
            continue
        flag = "--" + name.replace("_", "-")
        if flag in parser._option_string_actions:
            continue
        added.append(name)
        default = field.get_default()
        doc = (field.description or "").split(". ")[0].rstrip(".")
        help_text = doc if default is None else f"{doc} (built-in default: {default})"
        kind = _flag_type(field.annotation)
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, dest=name,
                               help=help_text)  # fmt: skip
        elif isinstance(kind, tuple):
            group.add_argument(flag, choices=kind, dest=name, help=help_text)
        else:
            group.add_argument(flag, type=kind, dest=name, help=help_text)
    parser.set_defaults(sampling_fields=tuple(added))


def _flag_type(annotation):
    """bool, a tuple of choices (Literal), or the scalar type of an `X | None` annotation."""
    if get_origin(annotation) is Literal:
        return get_args(annotation)
    if get_origin(annotation) in (types.UnionType, Union):
        kinds = [a for a in get_args(annotation) if a is not type(None)]
        words = [w for a in kinds if get_origin(a) is Literal for w in get_args(a)]
        if words:  # a number or a word (--gen-length 64 / auto)
            return _number_or(kinds[0], words)
        annotation = kinds[0]
    return annotation


def _number_or(kind, words: list[str]):
    def parse(text: str):
        return text if text in words else kind(text)

    parse.__name__ = f"{kind.__name__} or {' or '.join(words)}"
    return parse


def sampling_flags(ns: argparse.Namespace) -> dict:
    """The sampling options given on the command line (None = not given)."""
    return {name: getattr(ns, name) for name in ns.sampling_fields}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="unmask", description="Train and sample masked-diffusion language models.",
                    epilog=REFERENCE)  # fmt: skip
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser(
        "train",
        help="train from a YAML config (no config: the built-in quickstart)",
        description="unmask train [CONFIG.yaml] [section.key=value ...]",
        epilog=REFERENCE,
    )
    train.add_argument("args", nargs="*", help="a config file and/or section.key=value overrides")
    train.add_argument("--config", help="config file (same as the positional form)")
    train.add_argument("--print-config", action="store_true",
                       help="print the resolved config (file + overrides + defaults) and exit")  # fmt: skip
    train.set_defaults(func=cmd_train)

    gen = sub.add_parser("generate", help="sample continuations from a trained model",
                         epilog=SAMPLING_REFERENCE)  # fmt: skip
    gen.add_argument("--model", required=True, help="checkpoint-N (one process or sharded, "
                     "LoRA or not), final/, run output_dir or exported folder")  # fmt: skip
    gen.add_argument("--prompt", action="append", help="text to continue (repeatable)")
    gen.add_argument("--prompts", help='jsonl file, one {"prompt": ...} per line')
    gen.add_argument("--out", help="write one jsonl record per prompt here")
    gen.add_argument("--jsonl", action="store_true", help="print jsonl records to stdout "
                     "(default: each prompt and its completion as one plain line, in order)")  # fmt: skip
    gen.add_argument("--show", action="store_true", help="animate the denoising (stderr)")
    gen.add_argument("--show-delay", type=float, default=0.05, help="seconds per frame")
    gen.add_argument("--tokenizer", help="tokenizer folder (default: the model folder)")
    add_base_flag(gen)
    add_sampling_flags(gen)
    gen.add_argument("--batch-size", type=positive_int, default=16, help="prompts decoded together")
    gen.add_argument("--mask-id", type=int, help="mask token id (default: the tokenizer's)")
    gen.add_argument("--device", default="auto", help="auto (cuda when visible), cpu or cuda")
    gen.add_argument("--seed", type=int, help="seed for temperature > 0")
    gen.set_defaults(func=cmd_generate)

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

    ex = sub.add_parser("export", help="write an HF folder (weights, tokenizer, defaults)",
                        epilog=SAMPLING_REFERENCE)  # fmt: skip
    ex.add_argument(
        "checkpoint",
        help="checkpoint-N (one process or sharded, LoRA or not), final/ or output_dir",
    )
    ex.add_argument("--out", required=True, help="new folder to write")
    ex.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    ex.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    add_base_flag(ex)
    ex.set_defaults(func=cmd_export)

    pre = sub.add_parser(
        "preprocess",
        help="tokenize raw text into a Megatron-compatible token store (PREFIX.bin/.idx)",
        description="Tokenize jsonl(.gz/.zst), txt, parquet or save_to_disk inputs into "
        "PREFIX.bin + PREFIX.idx (Megatron MMIDIDX) and a PREFIX.json sidecar (docs/data.md).",
    )
    pre.add_argument("--input", required=True, nargs="+", action="extend", metavar="PATH",
                     help="files, save_to_disk folders or quoted globs, in this order")  # fmt: skip
    pre.add_argument(
        "--output-prefix", required=True, metavar="PREFIX", help="writes PREFIX.bin/.idx/.json"
    )
    pre.add_argument("--tokenizer", required=True, metavar="DIR", help="char (the built-in "
                     "character tokenizer, data.tokenizer's default) or a local tokenizer folder "
                     "(a run's final/ or checkpoint-N/ holds its run's)")  # fmt: skip
    pre.add_argument("--workers", type=int, default=1, metavar="N", help="tokenizing processes")
    pre.add_argument("--json-key", default="text", metavar="KEY",
                     help="field holding the text (jsonl, parquet, save_to_disk)")  # fmt: skip
    pre.add_argument("--append-eod", action="store_true", help="end each document with EOS")
    pre.add_argument("--on-bad-record", choices=("error", "skip"), default="error",
                     help="a bad jsonl line or record: stop, or skip and count it")  # fmt: skip
    pre.add_argument("--overwrite", action="store_true", help="replace an existing store")
    pre.set_defaults(func=cmd_preprocess)

    plot = sub.add_parser(
        "plot",
        help="PNG curves of runs: loss, learning rate, grad norm, tokens/s, skipped steps",
        description="One PNG per quantity of metrics.jsonl, the runs overlaid (docs/operations.md).",
    )
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories to draw")
    plot.add_argument("--out", metavar="DIR", help="folder for the PNGs (default: RUN_DIR/plots "
                      "of the first run)")  # fmt: skip
    plot.set_defaults(func=cmd_plot)

    runs = sub.add_parser(
        "runs",
        help="list run directories: status, last loss and eval loss, newest checkpoint",
        description="Status rules (finished, stopped at step N, crashed): docs/operations.md.",
    )
    runs.add_argument("folder", nargs="?", default="runs", metavar="FOLDER",
                      help="folder holding run directories (default: runs)")  # fmt: skip
    runs.set_defaults(func=cmd_runs)
    for command in sub.choices.values():  # `unmask CMD ... --debug` works too
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="show the traceback of an error")  # fmt: skip
    return parser


def _resume_advice(command: str) -> str:
    from unmask.train.run_dir import resume_advice

    return resume_advice(command)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        ns, extra = parser.parse_known_args(argv)
        if extra:  # named with the subcommand whose --help lists what it takes
            raise UsageError(f"unrecognized arguments: {' '.join(extra)}; see "
                             f"`unmask {ns.command} --help`")  # fmt: skip
    except UsageError as exc:
        print(f"unmask: error: {exc}", file=sys.stderr)
        return 2
    ns.command_line = ["unmask", *(sys.argv[1:] if argv is None else argv)]
    try:
        return ns.func(ns)
    except InputError as exc:
        if ns.debug:
            traceback.print_exc()
        print(f"unmask: error: {exc}", file=sys.stderr)
        return 2
    except RunStopped as exc:
        if ns.debug:
            traceback.print_exc()
        command = getattr(ns, "resume_command", None)
        hint = f"; {_resume_advice(command)}" if exc.resume and command else ""
        print(f"unmask: stopped: {exc}{hint}", file=sys.stderr)
        return 1
    except NothingToTrain as exc:  # a finished run resumed: nothing was changed
        print(f"unmask: {exc}", file=sys.stderr)
        return 0
    except KeyboardInterrupt:
        hint = "; resume with train.resume_from_checkpoint=true" if ns.command == "train" else ""
        print(f"unmask: interrupted{hint}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""The command line: `unmask train | plan | generate | eval | export | preprocess | plot |
runs | serve`. The only package that reads argv. Plug-ins of installed packages (the
`unmask.plugins` entry points, unmask/plugins.py) are imported first.

One module per command family (train.py; plan.py; generate.py and evaluate.py, with
sampling_flags.py; preprocess.py; runs.py: export, plot, runs; serve.py), each with an `add_<command>`
that adds its subparser and a `cmd_<command>` that runs it; `COMMANDS` below lists them.
A new command: a new module with those two functions and one line in `COMMANDS`.

Bad input (an InputError from anywhere, or a bad command line) becomes one line on stderr
and exit code 2, a run that cannot go on (RunStopped: non-finite losses, a full disk, a lost
peer process) one line and exit code 1; `--debug` also prints the traceback.
Each command imports what it needs inside its function (start-up time: `unmask generate`
does not load the trainer, `unmask train` not lm-eval); the layering needs none of it.
"""

import argparse
import sys
import traceback

from unmask.cli import evaluate, generate, plan, preprocess, runs, serve, train
from unmask.cli.flags import REFERENCE, Parser, UsageError, version_line
from unmask.cli.sampling_flags import SAMPLING_GROUP, sampling_flags
from unmask.errors import InputError, NothingToTrain, RunStopped, did_you_mean
from unmask.plugins import load_plugins

#: each command's subparser, in the order `unmask --help` lists them
COMMANDS = (
    train.add_train,
    plan.add_plan,
    generate.add_generate,
    evaluate.add_eval,
    runs.add_export,
    preprocess.add_preprocess,
    runs.add_plot,
    runs.add_runs,
    serve.add_serve,
)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="unmask", description="Train and sample masked-diffusion language models.",
                    epilog=REFERENCE)  # fmt: skip
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", required=True)
    for add_command in COMMANDS:
        add_command(sub)
    for command in sub.choices.values():  # `unmask CMD ... --debug` works too
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="show the traceback of an error")  # fmt: skip
    return parser


def flag_hint(parser: argparse.ArgumentParser, command: str, extra: list[str]) -> str:
    """ " (did you mean '--temperature'?)" for the first unknown flag close to one the
    command takes ("" otherwise)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = [f for action in sub.choices[command]._actions for f in action.option_strings]
    for word in extra:
        if word.startswith("--"):
            hint = did_you_mean(word.split("=", 1)[0], flags)
            if hint:
                return hint
    return ""


def main(argv: list[str] | None = None) -> int:
    try:  # before the parser: a registered decoder is a --decoder choice
        load_plugins()
    except InputError as exc:
        print(f"unmask: error: {exc}", file=sys.stderr)
        return 2
    parser = build_parser()
    try:
        ns, extra = parser.parse_known_args(argv)
        if extra:  # named with the subcommand whose --help lists what it takes
            hint = flag_hint(parser, ns.command, extra)
            raise UsageError(f"unrecognized arguments: {' '.join(extra)}{hint}; see "
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
        hint = f"; {train.resume_hint(command)}" if exc.resume and command else ""
        print(f"unmask: stopped: {exc}{hint}", file=sys.stderr)
        return 1
    except NothingToTrain as exc:  # a finished run resumed: nothing was changed
        print(f"unmask: {exc}", file=sys.stderr)
        return 0
    except KeyboardInterrupt:
        hint = "; resume with train.resume_from_checkpoint=true" if ns.command == "train" else ""
        print(f"unmask: interrupted{hint}", file=sys.stderr)
        return 130


def entry() -> None:
    """The `unmask` command and `python -m unmask.cli`: main()'s exit code; a process that
    ran under a launcher leaves through `end_process` (gloo's threads and finalization)."""
    from unmask.parallel.mesh import end_process

    end_process(main())


__all__ = ["COMMANDS", "SAMPLING_GROUP", "build_parser", "entry", "main", "sampling_flags"]

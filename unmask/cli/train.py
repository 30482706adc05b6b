"""`unmask train [CONFIG.yaml] [section.key=value ...]`: one run of the training loop."""

import argparse
import sys

from unmask.cli.flags import REFERENCE
from unmask.errors import InputError


def add_train(sub: argparse._SubParsersAction) -> None:
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


def split_train_args(args: list[str], config_flag: str | None) -> tuple[str | None, list[str]]:
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

    path, overrides = split_train_args(ns.args, ns.config)
    cfg = load_config(path, overrides)
    if getattr(ns, "debug", False):  # tracebacks, and the start-up log's routing table
        cfg.train = cfg.train.model_copy(update={"log_level": "debug"})
    if ns.print_config:  # what would run, written nowhere
        print(dump_config(cfg), end="")
        return 0
    if path is None:
        print("unmask: no config given, running the built-in quickstart", file=sys.stderr)
    from unmask.train.run_dir import resume_advice, resume_command
    from unmask.train.trainer import Trainer  # after the config: a typo is refused fast

    # what a stop prints (a signal, a lost peer, a second Ctrl-C): the user's own command
    ns.resume_command = resume_command(cfg.train.output_dir, path, overrides)
    from unmask.plan.checkpointing import choose_for_trainer

    # activation_checkpointing auto: decided from the built model's planned memory
    trainer = Trainer(cfg, decide_checkpointing=choose_for_trainer)
    trainer.resume_command = ns.resume_command
    try:
        trainer.train()
    except KeyboardInterrupt:  # a second Ctrl-C: the newest complete checkpoint stays
        print(f"unmask: interrupted; {resume_advice(ns.resume_command)}", file=sys.stderr)
        return 130
    return trainer.exit_code  # 0, or 130 after a Ctrl-C stop (SIGTERM / SIGUSR1 stop: 0)


def resume_hint(command: str) -> str:
    """What a stopped run prints after its reason: the command that resumes it."""
    from unmask.train.run_dir import resume_advice

    return resume_advice(command)

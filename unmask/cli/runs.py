"""What is done with runs after training: `unmask export` (one HF folder), `unmask plot`
(metrics as PNGs), `unmask runs` (run directories and their status)."""

import argparse
import sys

from unmask.cli.flags import SAMPLING_REFERENCE, add_base_flag


def add_export(sub: argparse._SubParsersAction) -> None:
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


def cmd_export(ns: argparse.Namespace) -> int:
    from unmask.checkpoint import export_model

    out = export_model(ns.checkpoint, ns.out, dtype=ns.dtype, overwrite=ns.overwrite, base=ns.base)
    print(f"unmask: exported {ns.checkpoint} to {out}", file=sys.stderr)
    return 0


def add_plot(sub: argparse._SubParsersAction) -> None:
    plot = sub.add_parser(
        "plot",
        help="PNG curves of runs: loss, learning rate, grad norm, tokens/s, skipped steps, "
        "held-out exact match",
        description="One PNG per quantity of metrics.jsonl, the runs overlaid (docs/operations.md).",
    )
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories to draw")
    plot.add_argument("--out", metavar="DIR", help="folder for the PNGs (default: RUN_DIR/plots "
                      "of the first run)")  # fmt: skip
    plot.set_defaults(func=cmd_plot)


def cmd_plot(ns: argparse.Namespace) -> int:
    from unmask.runs.plots import plot_runs

    for line in plot_runs(ns.run_dirs, ns.out):
        print(line)
    return 0


def add_runs(sub: argparse._SubParsersAction) -> None:
    runs = sub.add_parser(
        "runs",
        help="list run directories: status, last loss, eval loss and held-out exact match, "
        "newest checkpoint",
        description="Status rules (running, finished, stopped at step N, crashed: the "
        "trainer's heartbeat.json): docs/operations.md.",
    )
    runs.add_argument("folder", nargs="?", default="runs", metavar="FOLDER",
                      help="folder holding run directories (default: runs)")  # fmt: skip
    runs.set_defaults(func=cmd_runs)


def cmd_runs(ns: argparse.Namespace) -> int:
    from unmask.runs.report import find_runs, run_info, runs_table

    found = find_runs(ns.folder)
    if not found:
        print(f"no run directories in {ns.folder} (a run directory holds metrics.jsonl, "
              "config.yaml or checkpoint-N/)")  # fmt: skip
        return 0
    print(runs_table([run_info(path) for path in found]))
    return 0

"""`unmask preprocess`: raw text tokenized into a Megatron-compatible token store."""

import argparse
import sys


def add_preprocess(sub: argparse._SubParsersAction) -> None:
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


def cmd_preprocess(ns: argparse.Namespace) -> int:
    from unmask.data.preprocess import preprocess

    summary = preprocess(
        ns.input, ns.output_prefix, ns.tokenizer, workers=ns.workers, json_key=ns.json_key,
        append_eod=ns.append_eod, on_bad_record=ns.on_bad_record, overwrite=ns.overwrite,
        command=ns.command_line,
    )  # fmt: skip
    print(summary.line(), file=sys.stderr)
    return 0

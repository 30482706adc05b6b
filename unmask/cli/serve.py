"""`unmask serve`: an OpenAI-compatible HTTP server for a trained model (docs/serving.md)."""

import argparse
import os
import signal
import sys
from pathlib import Path

from unmask.cli.flags import add_base_flag, nonnegative_int, positive_int

#: --one-thread-below's default (docs/serving.md, Threads)
ONE_THREAD_BELOW = 256


def add_serve(sub: argparse._SubParsersAction) -> None:
    srv = sub.add_parser(
        "serve",
        help="serve a model over HTTP (OpenAI completions and chat) with a web page",
        description="OpenAI-compatible routes, continuous batching at block boundaries, "
        "a playground and a runs view at / (docs/serving.md).",
    )
    srv.add_argument("--model", required=True, help="checkpoint-N, final/, run output_dir "
                     "or exported folder (fixed for the server's life)")  # fmt: skip
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: "
                     "this machine only)")  # fmt: skip
    srv.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free)")
    srv.add_argument("--max-batch", type=positive_int, default=32,
                     help="requests decoded together (default 32)")  # fmt: skip
    srv.add_argument("--max-queue", type=positive_int, default=64, help="requests waiting for "
                     "a slot before new ones get 429 (default 64)")  # fmt: skip
    srv.add_argument("--prefix-cache-mb", type=megabytes, default=512, metavar="MB",
                     help="MiB for the first forwards of repeated prompts (reused exactly; "
                     "docs/serving.md, Prefix cache); 0 = off (default 512)")  # fmt: skip
    srv.add_argument("--threads", type=positive_int, help="torch threads of a forward on a CPU "
                     "(default: OMP_NUM_THREADS, else one per idle core for a small model)")  # fmt: skip
    srv.add_argument("--one-thread-below", type=nonnegative_int, default=ONE_THREAD_BELOW,
                     metavar="POSITIONS", help="with more than one thread, forwards that feed "
                     "fewer positions (rows x columns) run on one thread; 0 = never "
                     f"(default {ONE_THREAD_BELOW})")  # fmt: skip
    srv.add_argument("--ignore-load", action="store_true", help="run big forwards on all "
                     "--threads even while other processes keep cores busy (default: on as "
                     "many as are idle, re-measured every second)")  # fmt: skip
    srv.add_argument("--runs", metavar="DIR", help="folder of run directories shown on the page")
    srv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route but "
                     "/health and the page itself (default: $UNMASK_API_KEY, else none)")  # fmt: skip
    srv.add_argument("--model-name", help="the name clients pass as `model` (default: the "
                     "model folder's name)")  # fmt: skip
    srv.add_argument("--tokenizer", help="tokenizer folder (default: the model folder)")
    srv.add_argument("--mask-id", type=int, help="mask token id (default: the tokenizer's)")
    srv.add_argument("--device", default="auto", help="auto (cuda when visible), cpu or cuda")
    srv.add_argument("--drain-timeout", type=float, default=60.0, help="seconds SIGTERM waits "
                     "for requests in flight (default 60)")  # fmt: skip
    add_base_flag(srv)
    srv.set_defaults(func=cmd_serve)


def megabytes(text: str) -> float:
    """An argparse type: a number of megabytes >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of megabytes >= 0 (got {text!r})")
    return value


def cmd_serve(ns: argparse.Namespace) -> int:
    # SIGTERM before the server runs (while the model loads): nothing to drain, a clean stop
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    from unmask.checkpoint import load_for_sampling
    from unmask.errors import InputError
    from unmask.parallel.threads import set_sampling_threads

    try:
        from unmask.serve import run_server
    except ModuleNotFoundError as err:  # starlette and uvicorn: the serve extra
        raise InputError(f"unmask serve needs {err.name}; pip install 'unmask[serve]'") from None

    sm = load_for_sampling(ns.model, ns.tokenizer, ns.device, ns.mask_id, base=ns.base)
    set_sampling_threads(sm.model, sm.device)
    if ns.threads is not None:
        import torch

        torch.set_num_threads(ns.threads)
    name = ns.model_name or Path(ns.model).resolve().name
    return run_server(sm, model_name=name, host=ns.host, port=ns.port,
                      max_batch=ns.max_batch, max_queue=ns.max_queue,
                      api_key=ns.api_key or os.environ.get("UNMASK_API_KEY") or None,
                      runs_dir=ns.runs, drain_seconds=ns.drain_timeout,
                      prefix_cache_bytes=int(ns.prefix_cache_mb * 2**20),
                      one_thread_below=ns.one_thread_below,
                      watch_load=not ns.ignore_load)  # fmt: skip

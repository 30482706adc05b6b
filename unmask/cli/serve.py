"""`unmask serve`: an OpenAI-compatible HTTP server for a trained model (docs/serving.md)."""

import argparse
import os
import re
import signal
import sys
from pathlib import Path

from unmask.cli.flags import add_base_flag, nonnegative_int, positive_int
from unmask.serve.protocol import Limits

#: --header-timeout's default (serve/server.py HEADER_SECONDS; not imported: uvicorn)
HEADER_SECONDS = 10.0

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
    srv.add_argument("--served-name", "--model-name", dest="model_name", metavar="NAME",
                     help="the model's id: clients pass it as `model`, /v1/models and the "
                     "page show it (default: the run's name: runs/NAME/final and "
                     "runs/NAME/checkpoint-N serve NAME, another folder its own name)")  # fmt: skip
    srv.add_argument("--tokenizer", help="tokenizer folder (default: the model folder)")
    srv.add_argument("--mask-id", type=int, help="mask token id (default: the tokenizer's)")
    srv.add_argument("--device", default="auto", help="auto (cuda when visible), cpu or cuda")
    srv.add_argument("--drain-timeout", type=float, default=60.0, help="seconds SIGTERM waits "
                     "for requests in flight (default 60)")  # fmt: skip
    limits = srv.add_argument_group("limits of one request (docs/serving.md, Security); "
                                    "over any: 400 before any work")  # fmt: skip
    limits.add_argument("--max-tokens", type=positive_int, default=Limits.max_tokens,
                        metavar="N", help="answer tokens (canvas) of one prompt "
                        f"(default {Limits.max_tokens}; the model's positions bound it too)")  # fmt: skip
    limits.add_argument("--max-steps", type=positive_int, default=Limits.max_steps, metavar="N",
                        help=f"denoising steps of one prompt (default {Limits.max_steps})")  # fmt: skip
    limits.add_argument("--max-prompts", type=positive_int, default=Limits.max_prompts,
                        metavar="N", help="prompts in one completions request "
                        f"(default {Limits.max_prompts})")  # fmt: skip
    limits.add_argument("--max-stop-chars", type=positive_int, default=Limits.max_stop_chars,
                        metavar="N", help="characters of one stop string (up to 4 strings; "
                        f"default {Limits.max_stop_chars})")  # fmt: skip
    limits.add_argument("--max-body-mb", type=megabytes, default=Limits.max_body_bytes / 2**20,
                        metavar="MB", help="MiB of one request body "
                        f"(default {Limits.max_body_bytes / 2**20:g})")  # fmt: skip
    limits.add_argument("--max-image-mb", type=megabytes,
                        default=Limits.max_image_bytes / 2**20, metavar="MB",
                        help="MiB of one picture (an image_url part; default "
                        f"{Limits.max_image_bytes / 2**20:g})")  # fmt: skip
    limits.add_argument("--max-image-pixels", type=positive_int,
                        default=Limits.max_image_pixels, metavar="N",
                        help="pixels (width x height) of one picture, read from its header "
                        f"before decoding (default {Limits.max_image_pixels})")  # fmt: skip
    limits.add_argument("--max-images", type=positive_int, default=Limits.max_images,
                        metavar="N", help="pictures in one request "
                        f"(default {Limits.max_images})")  # fmt: skip
    limits.add_argument("--header-timeout", type=seconds, default=HEADER_SECONDS,
                        metavar="S", help="seconds a connection may take to send a request's "
                        f"headers (default {HEADER_SECONDS:g}; its body: "
                        f"{Limits.body_seconds:g})")  # fmt: skip
    access = srv.add_argument_group("who may call it (docs/serving.md, Security)")
    access.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                        help="a Host name to answer besides the bound address and localhost "
                        "(repeatable; a name other than those is refused: DNS rebinding)")  # fmt: skip
    access.add_argument("--cors-origin", action="append", default=[], type=origin,
                        metavar="ORIGIN",
                        help="a web origin (https://app.example:3000) whose pages may call "
                        "the API (repeatable; default: only the server's own page)")  # fmt: skip
    access.add_argument("--allow-no-key", action="store_true", help="serve a --host beyond "
                        "this machine without --api-key (refused otherwise)")  # fmt: skip
    access.add_argument("--allow-remote-images", action="store_true", help="fetch http(s) "
                        "image_url parts (default: data: URLs only; the fetch has the "
                        "--max-image-mb cap and a 10 s timeout)")  # fmt: skip
    access.add_argument("--allow-train", action="store_true", help="let the page queue "
                        "training runs into --runs DIR, one at a time (docs/serving.md, "
                        "Training from the page); beyond this machine only with --api-key")  # fmt: skip
    add_base_flag(srv)
    srv.set_defaults(func=cmd_serve)


def seconds(text: str) -> float:
    """An argparse type: a number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0 (got {text!r})")
    return value


def origin(text: str) -> str:
    """A web origin as browsers send it: scheme://host[:port], nothing after."""
    from urllib.parse import urlsplit

    parts = urlsplit(text)
    if (
        parts.scheme not in ("http", "https")
        or not parts.netloc
        or text != (f"{parts.scheme}://{parts.netloc}")
    ):
        raise argparse.ArgumentTypeError(
            f"must be an origin such as https://app.example:3000 (got {text!r})"
        )
    return text


def megabytes(text: str) -> float:
    """An argparse type: a number of megabytes >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of megabytes >= 0 (got {text!r})")
    return value


def served_name(model: str | Path) -> str:
    """The id a model is served as: the run's name for a run's final/ or checkpoint-N/
    (runs/NAME/final -> NAME), else the folder's own name."""
    folder = Path(model).resolve()
    is_run_part = folder.name == "final" or re.fullmatch(r"checkpoint-\d+", folder.name)
    return folder.parent.name if is_run_part and folder.parent.name else folder.name


def cmd_serve(ns: argparse.Namespace) -> int:
    # SIGTERM before the server runs (while the model loads): nothing to drain, a clean stop
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    from unmask.checkpoint import load_for_sampling
    from unmask.errors import InputError
    from unmask.parallel.threads import set_sampling_threads

    try:
        from unmask.serve import run_server
        from unmask.serve.server import check_exposure, check_training, open_socket
    except ModuleNotFoundError as err:  # starlette and uvicorn: the serve extra
        raise InputError(f"unmask serve needs {err.name}; pip install 'unmask[serve]'") from None

    # what can be refused is refused before the model loads (minutes for a big one)
    api_key = ns.api_key or os.environ.get("UNMASK_API_KEY") or None
    check_training(ns.host, api_key, ns.allow_train, ns.runs)
    check_exposure(ns.host, api_key, ns.allow_no_key)
    if ns.runs is not None and not Path(ns.runs).is_dir():
        raise InputError(f"--runs {ns.runs!r} is not a folder; give the folder that holds the "
                         "run directories")  # fmt: skip
    if not 0 <= ns.port <= 65535:
        raise InputError(f"--port {ns.port} is not a port number (0-65535; 0: any free port)")
    sock = open_socket(ns.host, ns.port)
    sm = load_for_sampling(ns.model, ns.tokenizer, ns.device, ns.mask_id, base=ns.base)
    set_sampling_threads(sm.model, sm.device)
    if ns.threads is not None:
        import torch

        torch.set_num_threads(ns.threads)
    name = ns.model_name or served_name(ns.model)
    from unmask.sampling.config import resolve_sampling
    from unmask.sampling.run_origin import editing_notice, trained_edit_fraction
    from unmask.serve.chat import chat_notice

    sm.trained_edit_fraction = trained_edit_fraction(ns.model)  # requests' edits are warned of
    folder_edits = editing_notice(resolve_sampling(sm.saved), sm.trained_edit_fraction)
    notices = tuple(filter(None, [chat_notice(ns.model, sm.tokenizer), folder_edits]))
    limits = Limits(max_tokens=ns.max_tokens, max_steps=ns.max_steps,
                    max_prompts=ns.max_prompts, max_stop_chars=ns.max_stop_chars,
                    max_body_bytes=int(ns.max_body_mb * 2**20),
                    max_image_bytes=int(ns.max_image_mb * 2**20),
                    max_image_pixels=ns.max_image_pixels, max_images=ns.max_images,
                    remote_images=ns.allow_remote_images)  # fmt: skip
    return run_server(sm, model_name=name, host=ns.host, port=ns.port,
                      max_batch=ns.max_batch, max_queue=ns.max_queue, api_key=api_key,
                      runs_dir=ns.runs, drain_seconds=ns.drain_timeout,
                      prefix_cache_bytes=int(ns.prefix_cache_mb * 2**20),
                      one_thread_below=ns.one_thread_below,
                      watch_load=not ns.ignore_load, limits=limits,
                      allowed_hosts=ns.allowed_host, cors_origins=ns.cors_origin,
                      allow_no_key=ns.allow_no_key, header_seconds=ns.header_timeout,
                      allow_train=ns.allow_train,
                      sock=sock, notices=notices)  # fmt: skip

"""Start-up and shut-down: the model loaded once, the engine's thread, uvicorn on the host
and port given. SIGTERM (or Ctrl-C): uvicorn stops listening and waits up to
`drain_seconds` for the requests in flight, then the engine finishes what is left and the
process exits 0."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import torch
import uvicorn

from unmask.errors import InputError
from unmask.sampling.texts import SamplingModel
from unmask.serve.app import Server, build_app
from unmask.serve.engine import Engine


class _Server(uvicorn.Server):
    """uvicorn raises the signal it stopped on again once it has shut down (the process then
    dies of SIGTERM); a drained SIGTERM is a clean stop here: exit status 0."""

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]


def run_server(sm: SamplingModel, *, model_name: str, host: str = "127.0.0.1",
               port: int = 8000, max_batch: int = 32, max_queue: int = 64,
               api_key: str | None = None, runs_dir: str | Path | None = None,
               drain_seconds: float = 60.0, log_level: str = "warning",
               prefix_cache_bytes: int = 512 * 2**20, one_thread_below: int = 0,
               watch_load: bool = False) -> int:  # fmt: skip
    """Serve until SIGTERM / SIGINT; returns the exit code (0). prefix_cache_bytes: the
    bound of the engine's prefix cache (0: off; docs/serving.md, Prefix cache). The forwards
    run on torch's thread count, those that feed fewer than `one_thread_below` positions on
    one thread and, with watch_load, the others on no more than the idle cores
    (engine.Threaded; only on a CPU)."""
    if runs_dir is not None:
        runs_dir = Path(runs_dir)
        if not runs_dir.is_dir():
            raise InputError(f"--runs {str(runs_dir)!r} is not a folder; give the folder that "
                             "holds the run directories")  # fmt: skip
    if sm.device.type != "cpu":
        one_thread_below, watch_load = 0, False
    threads = torch.get_num_threads()
    engine = Engine(sm, max_batch=max_batch, max_queue=max_queue, threads=threads,
                    prefix_cache_bytes=prefix_cache_bytes,
                    one_thread_below=one_thread_below, watch_load=watch_load)  # fmt: skip
    server = Server(sm, engine, model_name, api_key=api_key, runs_dir=runs_dir)
    config = uvicorn.Config(build_app(server), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=drain_seconds, lifespan="off")  # fmt: skip
    small = ""
    if threads > 1 and one_thread_below > 0:
        small += f", one for forwards under {one_thread_below} positions"
    if threads > 1 and watch_load:
        small += ", no more than the cores idle of other work"
    print(f"unmask: serving {model_name!r} on http://{host}:{port} (max batch {max_batch}, "
          f"queue {max_queue}, prefix cache {prefix_cache_bytes / 2**20:g} MiB, {threads} torch "
          f"thread(s){small})",
          file=sys.stderr, flush=True)  # fmt: skip
    _Server(config).run()
    engine.close(timeout=drain_seconds)
    print("unmask: server stopped", file=sys.stderr, flush=True)
    return 0

"""Start-up and shut-down: the model loaded once, the engine's thread, uvicorn on the host
and port given. SIGTERM (or Ctrl-C): uvicorn stops listening and waits up to
`drain_seconds` for the requests in flight, then the engine finishes what is left and the
process exits 0.

The socket is bound before anything else (`open_socket`, before the model loads): a busy
port or a bad address is one line and exit 2, and the start line names the port really
bound (--port 0). A bind beyond this machine needs an API key (`check_exposure`)."""

from __future__ import annotations

import errno
import ipaddress
import json
import signal
import socket
import sys
from pathlib import Path

import torch
import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from unmask.errors import InputError
from unmask.sampling.texts import SamplingModel
from unmask.serve.app import Server, build_app
from unmask.serve.engine import Engine
from unmask.serve.guard import allowed_host_names, error_body, host_name
from unmask.serve.protocol import Limits
from unmask.serve.training import TrainQueue

#: seconds a connection may take to send a request's headers (--header-timeout)
HEADER_SECONDS = 10.0
#: seconds an idle keep-alive connection is held between requests
IDLE_SECONDS = 5


def is_loopback(host: str) -> bool:
    """Whether binding `host` exposes the server to this machine only."""
    name = host_name(host)
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def check_exposure(host: str, api_key: str | None, allow_no_key: bool) -> None:
    """InputError for a bind beyond this machine without an API key: anyone who can reach
    the port could generate and read the runs folder."""
    if not is_loopback(host) and api_key is None and not allow_no_key:
        raise InputError(
            f"--host {host} serves beyond this machine; give --api-key KEY (or set "
            "$UNMASK_API_KEY), or --allow-no-key to serve it to everyone who can reach the port"
        )


def check_training(host: str, api_key: str | None, allow_train: bool, runs_dir) -> None:
    """InputError for --allow-train without --runs (where its runs go), or on a bind beyond
    this machine without an API key, --allow-no-key or not: anyone who reached the port
    could run training jobs on this machine."""
    if not allow_train:
        return
    if runs_dir is None:
        raise InputError("--allow-train needs --runs DIR: the folder the page's runs are "
                         "written into")  # fmt: skip
    if api_key is None and not is_loopback(host):
        raise InputError(f"--allow-train on --host {host} needs --api-key KEY (or "
                         "$UNMASK_API_KEY): without one, anyone who reaches the port could "
                         "run training on this machine (--allow-no-key does not cover it)")  # fmt: skip


def open_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (not listening yet); InputError when the address is
    not this machine's or the port is taken."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]  # fmt: skip
    except (socket.gaierror, UnicodeError) as err:
        raise InputError(f"--host {host!r} is not an address to bind ({err})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise InputError(f"port {port} on {host} is in use (another server?); pick another "
                             "with --port N (0: any free port)") from None  # fmt: skip
        raise InputError(f"cannot bind {host}:{port} ({err.strerror})") from None
    return sock


def _timeout_response() -> bytes:
    body = json.dumps(error_body("the request's headers did not arrive in time",
                                 code="request_timeout")).encode()  # fmt: skip
    head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")  # fmt: skip
    return head.encode() + body


def header_deadline_protocol(seconds: float) -> type:
    """uvicorn's HTTP protocol with a deadline on request headers: a connection that has
    not sent a whole request's headers `seconds` after it opened (or after its last
    response) gets a 408 and is closed. uvicorn times out idle keep-alive connections but
    not one that trickles its headers in (a slow-headers attack holds a connection each)."""

    class HeaderDeadline(AutoHTTPProtocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._expect_headers()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._expect_headers()

        def _expect_headers(self) -> None:
            armed = self.cycle  # the request before the one whose headers are awaited

            def expire() -> None:
                waiting = self.cycle is armed and (armed is None or armed.response_complete)
                if waiting and not self.transport.is_closing():
                    self.transport.write(_timeout_response())
                    self.transport.close()

            self.loop.call_later(seconds, expire)

    return HeaderDeadline


class _Server(uvicorn.Server):
    """uvicorn raises the signal it stopped on again once it has shut down (the process then
    dies of SIGTERM); a drained SIGTERM is a clean stop here: exit status 0. `announce` runs
    once the socket listens and SIGTERM is handled, so a client (or a script) that waits for
    the "serving" line can connect, and stop it cleanly, at once."""

    def __init__(self, config: uvicorn.Config, announce) -> None:
        super().__init__(config)
        self.announce = announce

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started and not self.should_exit:
            self.announce()

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]


def run_server(sm: SamplingModel, *, model_name: str, host: str = "127.0.0.1",
               port: int = 8000, max_batch: int = 32, max_queue: int = 64,
               api_key: str | None = None, runs_dir: str | Path | None = None,
               drain_seconds: float = 60.0, log_level: str = "warning",
               prefix_cache_bytes: int = 512 * 2**20, one_thread_below: int = 0,
               watch_load: bool = False, limits: Limits | None = None,
               allowed_hosts: list[str] | tuple[str, ...] = (),
               cors_origins: list[str] | tuple[str, ...] = (), allow_no_key: bool = False,
               header_seconds: float = HEADER_SECONDS, allow_train: bool = False,
               sock: socket.socket | None = None, notices: tuple[str, ...] = ()) -> int:  # fmt: skip
    """Serve until SIGTERM / SIGINT; returns the exit code (0). prefix_cache_bytes: the
    bound of the engine's prefix cache (0: off; docs/serving.md, Prefix cache). The forwards
    run on torch's thread count, those that feed fewer than `one_thread_below` positions on
    one thread and, with watch_load, the others on no more than the idle cores
    (engine.Threaded; only on a CPU). limits: the most one request may ask (protocol.Limits);
    allowed_hosts, cors_origins: Host names and web origins added to the defaults
    (guard.py); allow_train: the page may queue training runs into runs_dir (training.py);
    sock: bound already by `open_socket` (None: bound here); notices: warnings about the
    model (chat.py), printed at start-up and shown by the page."""
    check_exposure(host, api_key, allow_no_key)
    check_training(host, api_key, allow_train, runs_dir)
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
    if sock is None:
        sock = open_socket(host, port)
    port = sock.getsockname()[1]
    server = Server(sm, engine, model_name, api_key=api_key, runs_dir=runs_dir, limits=limits,
                    allowed_hosts=allowed_host_names(host, allowed_hosts),
                    cors_origins=frozenset(cors_origins),
                    training=TrainQueue(runs_dir) if allow_train else None)  # fmt: skip
    config = uvicorn.Config(build_app(server), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=drain_seconds, lifespan="off",
                            http=header_deadline_protocol(header_seconds),
                            timeout_keep_alive=IDLE_SECONDS)  # fmt: skip
    small = ""
    if threads > 1 and one_thread_below > 0:
        small += f", one for forwards under {one_thread_below} positions"
    if threads > 1 and watch_load:
        small += ", no more than the cores idle of other work"
    server.notices = list(notices)

    def announce() -> None:  # once it listens (_Server.startup)
        shown = f"[{host}]" if ":" in host else host
        if api_key is None and not is_loopback(host):
            print(f"unmask: WARNING: {host} serves beyond this machine with no API key: anyone "
                  "who reaches the port can generate and read the runs folder", file=sys.stderr,
                  flush=True)  # fmt: skip
        print(f"unmask: serving {model_name!r} on http://{shown}:{port} (max batch {max_batch}, "
              f"queue {max_queue}, prefix cache {prefix_cache_bytes / 2**20:g} MiB, {threads} torch "
              f"thread(s){small})",
              file=sys.stderr, flush=True)  # fmt: skip
        for notice in notices:
            print(f"unmask: WARNING: {notice}", file=sys.stderr, flush=True)
        if allow_train:
            print(f"unmask: the page may queue training runs into {str(runs_dir)!r} (--allow-train)",
                  file=sys.stderr, flush=True)  # fmt: skip

    _Server(config, announce).run(sockets=[sock])
    if server.training is not None:  # the running job checkpoints and exits (bounded)
        server.training.close()
    engine.close(timeout=drain_seconds)
    print("unmask: server stopped", file=sys.stderr, flush=True)
    return 0

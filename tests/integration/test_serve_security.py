"""`unmask serve` driven by a hostile client: a real server on 127.0.0.1 (a subprocess), raw
HTTP from httpx and sockets. Malformed and oversized requests get OpenAI's error body with a
4xx, never a 500, and the big ones are refused within a second while /health answers;
memory stays flat over a thousand distinct prompts; cross-site and DNS-rebinding requests
are refused; a runs folder whose files hold anything is served as data. (The page's side, a
hostile run name drawn in a browser: test_serve_page.py.)"""

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import save_tiny_model
from test_serve import free_port, metric, start_server

pytestmark = pytest.mark.usefixtures("one_thread")

CORS = "http://app.example:3000"
BASE = {"model": "tiny", "prompt": "rev 12=", "max_tokens": 8}


def hostile_runs(root: Path) -> Path:
    """Runs whose files hold what a crashed, diverged or hostile run could leave."""
    diverged = root / "diverged"
    diverged.mkdir(parents=True)
    lines = [{"step": 1, "loss": 2.0, "tokens_per_second": 10.0, "elapsed_seconds": 1.0},
             {"step": 2, "loss": float("nan"), "eval_loss": float("inf")},
             {"step": 3, "loss": float("-inf"), "<img src=x onerror=alert(1)>": 1}]  # fmt: skip
    (diverged / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    odd = root / "odd bytes"
    odd.mkdir()
    (odd / "config.yaml").write_bytes(b"train: {max_steps: \xff\xfe}\n")  # not UTF-8
    (odd / "metrics.jsonl").write_bytes(b'{"step": 1, "loss": "high"}\n\xff\n')
    return root


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("security") / "model", seed=0)


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    runs = hostile_runs(tmp_path_factory.mktemp("runs"))
    proc, base = start_server(model_dir, "--runs", str(runs), "--cors-origin", CORS,
                              "--max-batch", "4", "--max-queue", "8", "--header-timeout", "1")  # fmt: skip
    yield proc, base
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0


@pytest.fixture(scope="module")
def server(served):
    return served[1]


def post(base: str, body=None, raw: bytes | None = None, headers: dict | None = None,
         route: str = "/v1/completions") -> httpx.Response:  # fmt: skip
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(base + route, content=content, timeout=60,
                      headers={"content-type": "application/json", **(headers or {})})  # fmt: skip


def assert_openai_error(response: httpx.Response, status: int, message: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert re.search(message, error["message"]), error["message"]


# the malformed requests of the hostile client: (body as bytes, expected message)
MALFORMED = [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (json.dumps({**BASE, "seed": 2**63}).encode(), r"seed.*<= 9223372036854775807"),
    (json.dumps({**BASE, "seed": -(2**63) - 1}).encode(), "seed"),
    (b'{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 8}', "lone UTF-16 surrogate"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}',
     "lone UTF-16 surrogate"),
    (json.dumps({**BASE, "unmask": {"confidence_eos_eot_inf": True}}).encode(),
     "needs the tokenizer's end-of-turn token id"),
    (b'{"model": "tiny", "prompt": "a", "max_tokens": 8, "unmask": {"threshold": NaN}}',
     "NaN is not JSON"),
    (b'{"model": "tiny", "prompt": "a", "max_tokens": 8, "unmask": {"cfg_scale": Infinity}}',
     "Infinity is not JSON"),
    (b'{"model": "tiny", "prompt": "a", "max_tokens": 8, "unmask": {"cfg_scale": 1e999}}',
     "finite number"),
    (json.dumps({**BASE, "max_tokens": "8"}).encode(), "max_tokens.*valid integer"),
    (json.dumps({**BASE, "stream": 1}).encode(), "stream.*valid boolean"),
    (json.dumps({**BASE, "unmask": {"steps": "8"}}).encode(), "steps.*valid integer"),
    (b'{"model": "tiny", "prompt": "a"', "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    (b"[]", "must be a JSON object"),
]  # fmt: skip


@pytest.mark.parametrize("raw,message", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_requests_get_400_not_500(server, raw, message):
    chat = b'"messages"' in raw
    response = post(server, raw=raw, route="/v1/chat/completions" if chat else "/v1/completions")
    assert_openai_error(response, 400, message)


def test_no_malformed_request_made_a_500(server):
    for raw, _ in MALFORMED:  # again, in one go (xdist may run the cases elsewhere)
        assert post(server, raw=raw).status_code == 400
    assert metric(server, 'requests_total{outcome="http_500"}') == 0
    assert metric(server, 'requests_total{outcome="failed"}') == 0
    ok = post(server, BASE)  # still serving
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


# oversized: each refused before it is tokenized or queued: (body, expected message)
OVERSIZED = [
    ({**BASE, "prompt": "x" * (10 * 2**20)}, "over this server's 4194304 bytes"),
    ({**BASE, "prompt": "x" * (3 * 2**20)}, "cannot fit the model's 4096 positions"),
    ({**BASE, "prompt": ["rev 1="] * 1000}, "1000 prompts .* over this server's 32"),
    ({**BASE, "prompt": ["rev 1="] * 30}, "can never fit this server's batch and queue"),
    ({**BASE, "unmask": {"steps": 10**9}}, r"unmask.steps \(1000000000\) is over .* 4096"),
    ({**BASE, "unmask": {"steps": 10**8}}, "is over this server's 4096"),
    ({**BASE, "max_tokens": 10**6}, r"canvas \(1000000 tokens\) is over this server's 4096"),
    ({**BASE, "stop": ["x" * 10_000]}, "longer than this server's 256 characters"),
    ({**BASE, "stop": ["a", "b", "c", "d", "e"]}, "up to 4"),
]  # fmt: skip


def test_oversized_requests_get_a_400_within_a_second_while_health_answers(server):
    health: list[float] = []
    stop = threading.Event()

    def watch() -> None:
        with httpx.Client(timeout=10) as client:
            while not stop.is_set():
                started = time.perf_counter()
                assert client.get(server + "/health").status_code == 200
                health.append(time.perf_counter() - started)
                time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for body, message in OVERSIZED:
            started = time.perf_counter()
            response = post(server, body)
            seconds = time.perf_counter() - started
            assert_openai_error(response, 400, message)
            assert seconds < 1.0, (message, seconds)
    finally:
        stop.set()
        watcher.join()
    assert health and max(health) < 1.0, max(health)


def test_a_body_over_the_limit_without_a_length_is_cut_off(server):
    """Chunked (no Content-Length): the server stops reading at the bound."""

    def chunks():
        for _ in range(10):
            yield b" " * 2**20

    started = time.perf_counter()
    response = httpx.post(server + "/v1/completions", content=chunks(), timeout=30,
                          headers={"content-type": "application/json"})  # fmt: skip
    assert_openai_error(response, 400, "over this server's 4194304 bytes")
    assert time.perf_counter() - started < 5


def test_memory_stays_flat_over_1000_distinct_prompts(model_dir):
    """The prefix cache on at its default size (512 MiB): a thousand distinct prompts add at
    most 50 MB of resident memory (before inference mode each cached result kept its
    forward's autograd graph: +132 MB with this model, unbounded)."""
    proc, base = start_server(model_dir)
    try:
        with httpx.Client(timeout=60) as client:

            def ask(i: int) -> None:
                body = {"model": "tiny", "prompt": f"rev {i:06d}=", "max_tokens": 4}
                assert client.post(base + "/v1/completions", json=body).status_code == 200

            with ThreadPoolExecutor(4) as pool:  # warm: allocator pools, first-call caches
                list(pool.map(ask, range(900_000, 900_100)))
            before = rss_mb(proc.pid)
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(ask, range(1000)))
            grown = rss_mb(proc.pid) - before
        assert metric(base, "prefix_cache_entries") == 1100  # every prompt cached
        assert metric(base, "prefix_cache_bytes") < 10 * 2**20
        assert grown <= 50, grown
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


# --------------------------------------------------------------- cross-site, rebinding


def test_cross_site_and_rebinding_requests_are_refused(server):
    # a form or no-cors fetch from any page the user visits: text/plain, a foreign Origin
    foreign = {"Origin": "http://evil.example", "content-type": "text/plain"}
    response = httpx.post(server + "/v1/completions", content=json.dumps(BASE), headers=foreign)
    assert_openai_error(response, 403, "web origin 'http://evil.example' is refused")
    plain = httpx.post(server + "/v1/completions", content=json.dumps(BASE),
                       headers={"content-type": "text/plain"})  # fmt: skip
    assert_openai_error(plain, 415, "Content-Type: application/json")
    # a DNS-rebinding page: same-origin to the browser, its own name in Host
    rebound = httpx.get(server + "/api/runs", headers={"Host": "evil.example:8000"})
    assert_openai_error(rebound, 400, "Host header 'evil.example:8000' does not name")
    for host in ("localhost", "127.0.0.1", server.removeprefix("http://")):
        assert httpx.get(server + "/health", headers={"Host": host}).status_code == 200
    # the page itself (same origin) is served
    port = server.rsplit(":", 1)[1]
    own = post(server, BASE, headers={"Origin": f"http://127.0.0.1:{port}"})
    assert own.status_code == 200


def test_preflights_are_answered_and_granted_to_configured_origins_only(server):
    ask = {"Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}  # fmt: skip
    refused = httpx.options(server + "/v1/completions", headers={"Origin": "http://evil.example",
                                                                 **ask})  # fmt: skip
    assert refused.status_code == 204
    assert "access-control-allow-origin" not in refused.headers
    granted = httpx.options(server + "/v1/completions", headers={"Origin": CORS, **ask})
    assert granted.status_code == 204
    assert granted.headers["access-control-allow-origin"] == CORS
    assert "POST" in granted.headers["access-control-allow-methods"]
    assert "Content-Type" in granted.headers["access-control-allow-headers"]
    response = post(server, BASE, headers={"Origin": CORS})
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == CORS


def test_every_response_carries_the_security_headers(server):
    for response in (httpx.get(server + "/"), httpx.get(server + "/health"),
                     httpx.get(server + "/nope"), post(server, raw=b"{")):  # fmt: skip
        policy = response.headers["content-security-policy"]
        assert "script-src 'self'" in policy and "unsafe-inline" not in policy
        assert "frame-ancestors 'none'" in policy
        assert response.headers["x-content-type-options"] == "nosniff"
    page = httpx.get(server + "/").text
    assert "<style" not in page and "<script>" not in page  # nothing inline to allow


def test_unknown_routes_and_wrong_methods_get_openai_error_bodies(server):
    assert_openai_error(httpx.get(server + "/v1/nothing"), 404, "no route '/v1/nothing'")
    wrong = httpx.delete(server + "/health")
    assert_openai_error(wrong, 405, "DELETE is not allowed on '/health'")
    assert "GET" in wrong.headers["allow"]
    assert_openai_error(httpx.get(server + "/v1/completions"), 405, "GET is not allowed")


def test_the_page_files_are_served_by_name_only(server):
    script = httpx.get(server + "/static/common.js")
    assert script.status_code == 200 and script.headers["content-type"].startswith(
        "text/javascript"
    )
    assert httpx.get(server + "/static/app.css").headers["content-type"].startswith("text/css")
    for name in ("index.html", "..%2Fapp.py", "%2E%2E", "nope.js", "__init__.py"):
        assert_openai_error(httpx.get(server + "/static/" + name), 404, "no page file|no route")


# ------------------------------------------------------------------------- a runs folder


def test_a_diverged_or_hostile_run_is_served_as_data(server):
    runs = httpx.get(server + "/api/runs")
    assert runs.status_code == 200, runs.text
    rows = {row["name"]: row for row in runs.json()["runs"]}
    assert rows["diverged"]["loss"] is None  # -inf at the last step: null
    assert rows["odd bytes"]["planned_steps"] is None and rows["odd bytes"]["loss"] is None
    curves = httpx.get(server + "/api/runs/diverged").json()["metrics"]
    assert curves["loss"] == [[1, 2.0], [2, None], [3, None]]
    assert curves["eval_loss"] == [[2, None]]
    assert all(math.isfinite(v) for s in curves.values() for _, v in s if v is not None)
    # an HTML metric key is not served at all (keys: letters, digits and _ . / - only)
    assert set(curves) == {"loss", "eval_loss", "tokens_per_second", "elapsed_seconds"}
    odd = httpx.get(server + "/api/runs/odd%20bytes")
    assert odd.status_code == 200 and "error" in odd.json()
    assert_openai_error(httpx.get(server + "/api/runs/%2E%2E"), 404, "no run named")


# --------------------------------------------------------------------------- connections


def test_slow_headers_are_timed_out(server):
    """--header-timeout 1: a connection that trickles its headers gets a 408 and is closed;
    one that sends them in time is answered."""
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as slow:
        started = time.perf_counter()
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        time.sleep(0.5)
        slow.sendall(b"X-Slow: 1\r\n")  # never the blank line
        reply = slow.recv(4096)
        assert reply.startswith(b"HTTP/1.1 408"), reply
        assert slow.recv(4096) == b""  # closed
        assert 0.9 < time.perf_counter() - started < 5
    assert httpx.get(server + "/health").status_code == 200


def serve_command(model_dir, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    return subprocess.run([sys.executable, "-m", "unmask", "serve", "--model", str(model_dir),
                           *flags], env=env, capture_output=True, text=True, timeout=120)  # fmt: skip


def test_a_busy_port_or_an_exposed_bind_is_one_line_and_exit_2(model_dir):
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        busy = serve_command(model_dir, "--port", str(port))
    assert busy.returncode == 2
    assert busy.stderr.strip() == (f"unmask: error: port {port} on 127.0.0.1 is in use "
                                   "(another server?); pick another with --port N (0: any "
                                   "free port)")  # fmt: skip
    assert "serving" not in busy.stdout + busy.stderr
    exposed = serve_command(model_dir, "--host", "0.0.0.0", "--port", "0")
    assert exposed.returncode == 2 and "Traceback" not in exposed.stderr
    assert "--host 0.0.0.0 serves beyond this machine; give --api-key KEY" in exposed.stderr
    bad = serve_command(model_dir, "--cors-origin", "http://a.example/path")
    assert bad.returncode == 2 and "must be an origin" in bad.stderr


def test_an_exposed_bind_with_no_key_warns_when_allowed(model_dir):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "unmask", "serve", "--model", str(model_dir), "--host", "0.0.0.0",
         "--port", str(port), "--allow-no-key"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        # a wildcard bind answers any Host name (the key, or the user's choice, guards it)
        response = httpx.get(f"http://127.0.0.1:{port}/health", headers={"Host": "box.lan"})
        assert response.status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    out = proc.stdout.read()
    assert "WARNING: 0.0.0.0 serves beyond this machine with no API key" in out

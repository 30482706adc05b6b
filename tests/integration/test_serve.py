"""`unmask serve` against the real `openai` client: a real uvicorn server on 127.0.0.1 (a
subprocess, `python -m unmask serve`), a tiny random model folder built in the test. The
oracle for every answer is `unmask generate` on the same prompt and options, run alone."""

import json
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
import openai
import pytest
from conftest import save_tiny_model

from unmask.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = {"block_length": 4}
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model_dir: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """`unmask serve` in a subprocess on a free port; (process, base URL) once /health
    answers."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "unmask", "serve", "--model", str(model_dir), "--model-name",
         "tiny", "--port", str(port), *flags],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300  # imports and the model load: slow on a loaded machine
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"unmask serve exited: {proc.stdout.read()}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("unmask serve did not answer /health in 300 s")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("serve") / "model", seed=0)


@pytest.fixture(scope="module")
def served(model_dir):
    """One server for the module (start-up is slow on a shared machine); the last test
    stops it with SIGTERM."""
    proc, base = start_server(model_dir, "--max-batch", "32", "--max-queue", "8",
                              "--api-key", KEY)  # fmt: skip
    yield proc, base
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


@pytest.fixture(scope="module")
def server(served):
    return served[1]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


def generate(model_dir, tmp_path, prompts, *flags) -> list[str]:
    """`unmask generate` of each prompt alone (--batch-size 1), in order."""
    src, dst = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    assert main(["generate", "--model", str(model_dir), "--prompts", str(src), "--out",
                 str(dst), "--batch-size", "1", *flags]) == 0  # fmt: skip
    return [json.loads(line)["completion"] for line in dst.read_text().splitlines()]


def metric(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics", headers=AUTH).text
    found = re.search(rf"^unmask_{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


# ------------------------------------------------------------------------ answers


def test_completions_equal_unmask_generate(client, model_dir, tmp_path):
    prompts = ["rev 123=", "sort 4=", "add 12+7="]
    expected = generate(model_dir, tmp_path, prompts, "--gen-length", "8", "--block-length", "4")
    for prompt, text in zip(prompts, expected):
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=8,
                                        extra_body={"unmask": BLOCK})  # fmt: skip
        assert out.choices[0].text == text
        assert out.usage.prompt_tokens == len(prompt)  # the char tokenizer: one per char
        assert out.choices[0].finish_reason in ("stop", "length")
    several = client.completions.create(model="tiny", prompt=prompts, max_tokens=8,
                                        extra_body={"unmask": BLOCK})  # fmt: skip
    assert [c.text for c in several.choices] == expected
    assert [c.index for c in several.choices] == [0, 1, 2]
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_unmask_options_reach_the_sampler(client, model_dir, tmp_path):
    """threshold decoding with the dual cache: the same flags of `unmask generate`."""
    options = {"block_length": 4, "threshold": 0.3, "cache": "dual"}
    expected = generate(model_dir, tmp_path, ["rev 90417="], "--gen-length", "12",
                        "--block-length", "4", "--threshold", "0.3", "--cache", "dual")  # fmt: skip
    out = client.completions.create(model="tiny", prompt="rev 90417=", max_tokens=12,
                                    extra_body={"unmask": options})  # fmt: skip
    assert out.choices[0].text == expected[0]


def test_streamed_blocks_concatenate_to_the_completion(client):
    kwargs = dict(model="tiny", prompt="rev 4567=", max_tokens=16, extra_body={"unmask": BLOCK})
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    texts = [c.choices[0].text for c in chunks]
    assert "".join(texts) == whole.choices[0].text
    assert len(chunks) <= 4 + 1  # one chunk per block of 4 tokens (while it is not over)
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    with_usage = list(client.completions.create(stream=True, stream_options={"include_usage":
                                                True}, **kwargs))  # fmt: skip
    assert with_usage[-1].choices == [] and with_usage[-1].usage == whole.usage


def test_chat_prompt_is_the_role_lines_template(client):
    """The char tokenizer has no chat template: the prompt is unmask's training format for
    chat data, "role: content" lines and "assistant: " (data/sft.py)."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                          extra_body={"unmask": BLOCK})  # fmt: skip
    plain = client.completions.create(model="tiny", prompt="system: be brief\nuser: hi\n"
                                       "assistant: ", max_tokens=8, extra_body={"unmask": BLOCK})  # fmt: skip
    assert chat.choices[0].message.content == plain.choices[0].text
    assert chat.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                            stream=True, extra_body={"unmask": BLOCK})  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == plain.choices[0].text


def test_a_model_never_trained_on_chat_is_named_at_start_and_in_info(server):
    # the tiny folder: the char tokenizer (no chat template) and no run config
    notices = httpx.get(server + "/api/info", headers=AUTH).json()["notices"]
    assert len(notices) == 1 and notices[0].startswith(
        "chat: this model's tokenizer has no chat template and no run config says it "
        "trained on chat rows")  # fmt: skip


def test_stop_strings_cut_the_text(client):
    kwargs = dict(model="tiny", prompt="sort 8=", max_tokens=16, extra_body={"unmask": BLOCK})
    full = client.completions.create(**kwargs).choices[0].text
    assert len(full) >= 6, full
    stop = full[4:6]
    cut = client.completions.create(stop=[stop, "never-there"], **kwargs).choices[0]
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"
    streamed = client.completions.create(stop=stop, stream=True, **kwargs)
    assert "".join(c.choices[0].text for c in streamed) == cut.text


def test_seeds_are_reproducible_and_match_generate(client, model_dir, tmp_path):
    kwargs = dict(model="tiny", prompt="rev 31=", max_tokens=8, temperature=1.0,
                  extra_body={"unmask": BLOCK})  # fmt: skip
    first = client.completions.create(seed=7, **kwargs).choices[0].text
    assert client.completions.create(seed=7, **kwargs).choices[0].text == first
    expected = generate(model_dir, tmp_path, ["rev 31="], "--gen-length", "8", "--block-length",
                        "4", "--temperature", "1.0", "--seed", "7")  # fmt: skip
    assert first == expected[0]
    others = {client.completions.create(seed=s, **kwargs).choices[0].text for s in (1, 2, 3)}
    assert others - {first}  # another seed, another draw


# ------------------------------------------------------------------- bad requests


BAD_REQUESTS = [
    (dict(extra_body={"bogus": 1}), openai.BadRequestError, "unknown field 'bogus'"),
    (dict(extra_body={"unmask": {"stepz": 4}}), openai.BadRequestError, "did you mean 'steps'"),
    (dict(extra_body={"unmask": {"logits_hook": "os:system"}}), openai.BadRequestError,
     "names code to run"),
    (dict(temperature=5.0), openai.BadRequestError, "temperature"),
    (dict(max_tokens=0), openai.BadRequestError, "max_tokens"),
    (dict(top_p=1.5), openai.BadRequestError, "top_p"),
    (dict(max_tokens=6, extra_body={"unmask": BLOCK}), openai.BadRequestError,
     "must be a multiple of block_length"),
    (dict(extra_body={"unmask": {"remasking": "nope"}}), openai.BadRequestError,
     "unknown remasking 'nope'"),
    (dict(prompt="x" * 4100), openai.BadRequestError, "exceed the model's 4096 positions"),
    (dict(model="gpt-4"), openai.NotFoundError, "model 'gpt-4' does not exist"),
    (dict(model="/etc/passwd"), openai.NotFoundError, "does not exist"),
    (dict(stop=["a", "b", "c", "d", "e"]), openai.BadRequestError, "up to 4"),
]  # fmt: skip


@pytest.mark.parametrize("change,error,message", BAD_REQUESTS)
def test_bad_requests_raise_the_clients_typed_errors(client, change, error, message):
    request = {"model": "tiny", "prompt": "rev 12=", "max_tokens": 8, **change}
    with pytest.raises(error, match=re.escape(message)) as caught:
        client.completions.create(**request)
    assert caught.value.body["type"] in ("invalid_request_error",)
    ok = client.completions.create(model="tiny", prompt="rev 12=", max_tokens=8)
    assert ok.choices[0].finish_reason in ("stop", "length")  # still serving


def test_malformed_json_gets_openais_error_body(client, server):
    response = httpx.post(server + "/v1/completions", content=b'{"model": "tiny", "prompt": ',
                          headers={"content-type": "application/json", **AUTH})  # fmt: skip
    assert response.status_code == 400
    error = client._make_status_error_from_response(response)  # the client's own mapping
    assert isinstance(error, openai.BadRequestError)
    assert "not valid JSON" in response.json()["error"]["message"]
    chat = httpx.post(server + "/v1/chat/completions", json={"model": "tiny", "messages": []},
                      headers=AUTH)  # fmt: skip
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"


def test_the_api_key_guards_every_route_but_health(server):
    stranger = openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="API key"):
        stranger.models.list()
    with pytest.raises(openai.AuthenticationError):
        stranger.completions.create(model="tiny", prompt="rev 1=", max_tokens=4)
    body = {"model": "tiny", "prompt": "rev 1=", "max_tokens": 4}
    assert httpx.post(server + "/v1/completions", json=body).status_code == 401  # no header
    for route in ("/metrics", "/api/info", "/api/runs"):
        assert httpx.get(server + route).status_code == 401, route
        assert httpx.get(server + route, headers={"Authorization": "Bearer x"}).status_code == 401
    assert httpx.get(server + "/metrics", headers=AUTH).status_code == 200
    assert httpx.get(server + "/health").json() == {"status": "ok"}
    page = httpx.get(server + "/")  # the page holds no data; its calls send the key
    assert page.status_code == 200 and "<title>unmask serve</title>" in page.text


# ------------------------------------------------------------- batching, streaming


def test_32_concurrent_greedy_requests_equal_32_generate_calls(client, server, model_dir,
                                                               tmp_path):  # fmt: skip
    """Batch invariance: mixed prompt lengths and canvases (4 to 16 tokens, blocks of 4),
    sent at once, give `unmask generate`'s tokens for each prompt alone; and the server
    did batch them (rows per forward > 1)."""
    prompts = [f"{task} {'9876543210'[: 1 + i % 7]}{'=' * (1 + i % 3)}"
               for i, task in enumerate(["rev", "sort", "add 1+", "rev 12"] * 8)]  # fmt: skip
    lengths = [4 * (1 + i % 4) for i in range(32)]
    expected = {}
    for length in sorted(set(lengths)):
        mine = [p for p, n in zip(prompts, lengths) if n == length]
        texts = generate(model_dir, tmp_path, mine, "--gen-length", str(length),
                         "--block-length", "4")  # fmt: skip
        expected.update({(p, length): t for p, t in zip(mine, texts)})
    forwards, rows = metric(server, "forward_passes_total"), metric(server, "row_forwards_total")

    def ask(i: int) -> str:
        out = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=lengths[i],
                                        extra_body={"unmask": BLOCK})  # fmt: skip
        return out.choices[0].text

    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(ask, range(32)))
    assert got == [expected[(p, n)] for p, n in zip(prompts, lengths)]
    forwards = metric(server, "forward_passes_total") - forwards
    rows = metric(server, "row_forwards_total") - rows
    assert rows / forwards > 2, (rows, forwards)  # rows shared forward passes


def test_a_two_thread_server_gives_one_threads_tokens(model_dir, tmp_path):
    """--threads 2 (--ignore-load: whatever else runs on the machine): 16 concurrent
    requests, their forwards on 2 threads, and a lone request, its forwards on 1
    (--one-thread-below 64), give `unmask generate`'s tokens on one thread."""
    prompts = [f"{task} {'9876543210'[: 1 + i % 7]}=" for i, task in
               enumerate(["rev", "sort", "add 1+", "rev 12"] * 4)]  # fmt: skip
    expected = generate(model_dir, tmp_path, prompts, "--gen-length", "8", "--block-length", "4")
    proc, base = start_server(model_dir, "--threads", "2", "--ignore-load",
                              "--one-thread-below", "64")  # fmt: skip
    try:
        api = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)

        def ask(prompt: str) -> str:
            return api.completions.create(model="tiny", prompt=prompt, max_tokens=8,
                                          extra_body={"unmask": BLOCK}).choices[0].text  # fmt: skip

        with ThreadPoolExecutor(16) as pool:
            got = list(pool.map(ask, prompts))
        two = metric(base, 'forwards_by_threads_total{threads="2"}')
        assert got == expected and two > 0
        one = metric(base, 'forwards_by_threads_total{threads="1"}')
        forwards = metric(base, "forward_passes_total")
        assert ask(prompts[0]) == expected[0]
        forwards = metric(base, "forward_passes_total") - forwards
        # 7 steps: the first forward is the prefix cache's (a repeated prompt)
        assert metric(base, 'forwards_by_threads_total{threads="1"}') - one == forwards == 7
        assert metric(base, 'forwards_by_threads_total{threads="2"}') == two
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    assert "2 torch thread(s), one for forwards under 64 positions)" in proc.stdout.read()


def test_repeated_prompts_reuse_the_prefix_cache_and_give_generates_tokens(
    client, server, model_dir, tmp_path
):
    """The module's server has the prefix cache (the default 512 MB): 3 prompts x 8 repeats
    sent at once (repeats inside one block call and across calls), then seeded temperature-1
    repeats, give `unmask generate`'s tokens (each prompt alone, no cache) and the tokens
    of a server started with --prefix-cache-mb 0; the first of each prompt computes its
    first forward (3 misses), the 21 others reuse it."""
    prompts = ["rev 7777=", "sort 60606=", "add 31+13="] * 8
    options = {"block_length": 4, "cache": "prefix"}
    flags = ["--gen-length", "8", "--block-length", "4", "--cache", "prefix"]
    expected = dict(zip(prompts[:3], generate(model_dir, tmp_path, prompts[:3], *flags)))
    seeded = [  # one call per prompt: `unmask generate --seed` seeds one generator per call
        generate(model_dir, tmp_path, [p], *flags, "--temperature", "1.0", "--seed", "5")[0]
        for p in prompts[:3]
    ]

    def ask(base: str, prompt: str, **extra) -> str:
        api = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
        out = api.completions.create(model="tiny", prompt=prompt, max_tokens=8,
                                     extra_body={"unmask": options}, **extra)  # fmt: skip
        return out.choices[0].text

    def load(base: str) -> tuple[list[str], list[str], tuple[float, float, float]]:
        """(greedy texts, seeded texts, (misses, hits, saved row forwards) they added)."""
        names = ("misses_total", "hits_total", "saved_row_forwards_total")
        before = [metric(base, f"prefix_cache_{n}") for n in names]
        with ThreadPoolExecutor(24) as pool:
            got = list(pool.map(lambda p: ask(base, p), prompts))
        warm = [ask(base, p, seed=5, temperature=1.0) for p in prompts[:3]]
        counts = tuple(metric(base, f"prefix_cache_{n}") - b for n, b in zip(names, before))
        return got, warm, counts

    got, warm, counts = load(server)
    assert got == [expected[p] for p in prompts] and warm == seeded
    # the seeded repeats reuse greedy's entries (temperature acts after the forward)
    assert counts == (3, 21 + 3, 21 + 3)  # each reuse: a row of a forward not computed
    assert metric(server, "prefix_cache_entries") >= 3
    assert 0 < metric(server, "prefix_cache_bytes") <= 512 * 2**20
    proc, off = start_server(model_dir, "--prefix-cache-mb", "0", "--api-key", KEY)
    try:
        assert load(off) == (got, warm, (0, 0, 0))
        assert metric(off, "prefix_cache_capacity_bytes") == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def test_a_client_that_disconnects_frees_its_slot(server, client):
    before = metric(server, 'requests_total{outcome="cancelled"}')
    forwards = metric(server, "forward_passes_total")
    body = {
        "model": "tiny",
        "prompt": "rev 1=",
        "max_tokens": 512,
        "stream": True,
        "unmask": {"block_length": 4},
    }  # 128 blocks: ~1000 forwards if it ran on
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=30,
                      headers=AUTH) as response:  # fmt: skip
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # the first block arrived; leave
    deadline = time.time() + 10
    while metric(server, "running_requests") and time.time() < deadline:
        time.sleep(0.1)
    assert metric(server, "running_requests") == 0
    assert metric(server, 'requests_total{outcome="cancelled"}') == before + 1
    assert metric(server, "forward_passes_total") - forwards < 100
    ok = client.completions.create(model="tiny", prompt="rev 12=", max_tokens=8)
    assert ok.choices[0].text is not None


def test_canvas_route_streams_every_step(server, client):
    """The playground's data: the answer canvas after each step, masks filling in."""
    frames, done = [], None
    body = {"prompt": "rev 123=", "max_tokens": 8, "unmask": {"block_length": 4}}
    with httpx.stream("POST", server + "/v1/unmask/canvas", json=body, timeout=30,
                      headers=AUTH) as response:  # fmt: skip
        for line in response.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                if event.get("done"):
                    done = event
                else:
                    frames.append(event["canvas"])
    assert len(frames) == 8  # steps = gen_length: one token per step
    masks = [sum(t is None for t in frame) for frame in frames]
    assert masks == list(range(7, -1, -1))
    text = client.completions.create(model="tiny", prompt="rev 123=", max_tokens=8,
                                     extra_body={"unmask": BLOCK}).choices[0].text  # fmt: skip
    assert done["text"] == text


# --------------------------------------------------------- queue bound, SIGTERM


def test_full_queue_gets_429_and_sigterm_drains_in_flight_requests(served, client):
    """32 running and 8 queued: the next request gets 429 with Retry-After; SIGTERM then
    stops new connections, the 40 finish with their answers, the process exits 0. (Last
    in the module: it stops the module's server.)"""
    proc, base = served
    body = dict(model="tiny", prompt="rev 12=", max_tokens=64, extra_body={"unmask": BLOCK})
    results: dict[int, str] = {}

    def ask(i: int) -> None:
        results[i] = client.completions.create(**body).choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(40)]
    for thread in threads:
        thread.start()
    deadline = time.time() + 30
    while time.time() < deadline:  # the engine admits waiting requests between blocks
        if metric(base, "running_requests") == 32 and metric(base, "queue_depth") == 8:
            break
        time.sleep(0.05)
    assert metric(base, "running_requests") == 32 and metric(base, "queue_depth") == 8
    with pytest.raises(openai.RateLimitError, match="queue is full") as caught:
        client.completions.create(**body)
    assert caught.value.response.headers["retry-after"] == "1"
    proc.send_signal(signal.SIGTERM)  # 32 running, 8 queued
    time.sleep(0.3)
    with pytest.raises(httpx.ConnectError):  # no new connection once draining
        httpx.get(base + "/health", timeout=2)
    for thread in threads:
        thread.join(120)
    assert proc.wait(60) == 0
    assert sorted(results) == list(range(40))
    assert len(set(results.values())) == 1  # all finished, the same greedy answer
    assert "server stopped" in proc.stdout.read()

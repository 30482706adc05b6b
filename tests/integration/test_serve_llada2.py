"""`unmask serve` on a folder in LLaDA2.0's released layout: a real server on 127.0.0.1 (a
subprocess), requests that join while others are being decoded (continuous batching: one
block call holds rows at different blocks, prompts of different lengths), each answered
as LLaDA2.0's own `generate` answers it (the written-out copy in
tests/unit/test_llada2_generate.py), with no sampling option and with LLaDA2's arguments
changed."""

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_serve import metric, start_server
from unit.test_llada2_generate import official_text, released_folder

from unmask.checkpoint import load_for_sampling

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["sort 31=", "add 12+7=", "hello there, how are you?", "sort 31="]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return released_folder(tmp_path_factory.mktemp("llada2") / "model")


@pytest.fixture(scope="module")
def server(folder):
    proc, base = start_server(folder, "--max-batch", "8", "--prefix-cache-mb", "16")
    yield base
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0


def ask_staggered(base: str, unmask: dict, max_tokens: int) -> list[str]:
    """Each prompt's completion, the requests sent 0.05 s apart (later ones join the
    batch while earlier ones are between blocks)."""

    def ask(i: int) -> str:
        time.sleep(0.05 * i)
        body = {"model": "tiny", "prompt": PROMPTS[i], "max_tokens": max_tokens,
                "unmask": unmask}  # fmt: skip
        reply = httpx.post(base + "/v1/completions", json=body, timeout=300)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(ask, range(len(PROMPTS))))


@pytest.mark.parametrize(
    ("unmask", "max_tokens", "arguments"),
    [
        ({}, 2048, {}),  # LLaDA2's defaults: gen_length 2048, block 32, steps 32, 0.95
        ({"block_length": 4, "block_steps": 2, "threshold": 0.7}, 30,
         {"block_length": 4, "steps": 2, "threshold": 0.7}),
        ({"block_length": 8, "block_steps": 16, "threshold": 0.9, "eos_early_stop": True}, 45,
         {"block_length": 8, "steps": 16, "threshold": 0.9, "eos_early_stop": True}),
    ],
)  # fmt: skip
def test_served_answers_are_llada2s_generate(server, folder, unmask, max_tokens, arguments):
    sm = load_for_sampling(folder, device="cpu")
    want = [official_text(sm, p, gen_length=max_tokens, **arguments) for p in PROMPTS]
    forwards, rows = metric(server, "forward_passes_total"), metric(server, "row_forwards_total")
    assert ask_staggered(server, unmask, max_tokens) == want
    forwards = metric(server, "forward_passes_total") - forwards
    if not arguments:  # LLaDA2's 2048-token default: the later requests join it mid-way
        # (the shorter decodes may end before the next request arrives on a busy machine;
        # the engine's rows at different blocks: test_llada2_folder.py, without timing)
        assert metric(server, "row_forwards_total") - rows > forwards  # rows were batched

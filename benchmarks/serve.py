"""`unmask serve` under load on loopback: output tokens/s with 32 concurrent clients vs one
client at a time, latency percentiles, tokens per forward, and the queue bound.

One server per thread setting (`python -m unmask serve --threads N`, a subprocess,
--max-batch 32; with N > 1 forwards under --one-thread-below positions run on one thread)
on 127.0.0.1; the real `openai` client in threads. Two workloads, the same requests but for
the cache: `plain` (a full forward over the canvas every step) and `dual cache` (a full
forward at each block start, then the 8 positions of the block only: Fast-dLLM's dual
cache, `"cache": "dual"`, on both sides of the ratio). Each round runs, for every server
and workload, in rotated order:
  - sequential: one client sends `--sequential-requests` requests one after another;
  - concurrent: 32 clients each send `--requests` requests back to back (a bounded loop:
    every client waits for its answer before sending the next);
reporting answer tokens per second of wall time (completion_tokens from each response),
p50 / p99 request latency, and from /metrics the positions committed per row per forward
(1.0: one token per step), the rows per forward call (the batch the engine ran) and the
share of forwards that ran on more than one thread, and the server process's CPU seconds
per answer token (/proc: all its threads).
The ratio (32 concurrent / one at a time) is taken per round, server and workload.
Then the prefix cache (on the first thread setting): two servers, `--prefix-cache-mb 512` (the default) and 0 (off), get
the same prompt again and again (one client, requests one after another; then 16 clients at
once), in rotated order each round; reported: row forwards per request (the work the cache
saves: a repeated prompt's first forward), the engine's decoding seconds per request, p50
latency, requests/s, and the hits and misses from /metrics, for the benchmark's short
request and for a long prompt (256 tokens) answered in one block with the prefix cache
mode (where the first forward, the only one over the whole canvas, is most of the work).
The answers with the cache on and off must be equal.
Then the bound: a server with --max-batch 32 --max-queue 8 gets 64 requests at once;
reported: how many were answered, how many got 429, and that none was lost or hung (every
request returns within the timeout, answered + 429 = 64).

Model: `--model FOLDER` (a trained quickstart model: runs/quickstart/final), else the
quickstart architecture (configs/quickstart.yaml: 4 layers, hidden 128) with random
weights and the char tokenizer, built in a temporary folder: speed depends on the
architecture and the canvas, not on the weights (a random model rarely emits EOS, so every
answer fills its canvas). Requests: synthetic prompts ("rev 90417="), max_tokens 32,
blocks of 8, one token per step, greedy.

Run: python benchmarks/serve.py            (writes benchmarks/results/serve.md)
     python benchmarks/serve.py --threads 1,2 (both thread settings, interleaved)
     python benchmarks/serve.py --quick    (tiny model, 1 round, fewer requests; prints only)
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import REPO, RESULTS, load_average, machine, publish, rotated, with_spread

#: the load's workloads: unmask options of every request
WORKLOADS = {"plain": {"block_length": 8}, "dual cache": {"block_length": 8, "cache": "dual"}}
PROMPTS = ["rev 90417=", "sort 5213=", "add 58+67=", "rev 123456=", "sort 98=", "add 12+7="]
#: the repeated-prompt scenarios: (name, prompt, max_tokens, unmask options)
LONG_PROMPT = ("system: answer with the digits reversed, nothing else. " * 5)[:246] + "rev 90417="
REPEATED = [
    ("short prompt (10 tokens), 32 tokens in blocks of 8, one token per step", PROMPTS[0], 32,
     {"block_length": 8}),
    ("long prompt (256 tokens), 32 tokens in one block, 8 steps, prefix cache mode",
     LONG_PROMPT, 32, {"block_length": 32, "steps": 8, "cache": "prefix"}),
]  # fmt: skip


def build_model(folder: Path, quick: bool) -> Path:
    """The quickstart architecture (quick: the tests' tiny one) with random weights and the
    char tokenizer, saved as an HF folder."""
    import torch
    import yaml

    from unmask.data.tokenizer import build_char_tokenizer, ensure_special_tokens
    from unmask.models import ModelConfig, build_model

    tokenizer = build_char_tokenizer()
    ensure_special_tokens(tokenizer)
    if quick:
        fields = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    else:
        quickstart = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
        fields = dict(quickstart["model"])
    fields["vocab_size"] = max(fields.get("vocab_size", 128), len(tokenizer))
    torch.manual_seed(0)
    model = build_model(ModelConfig(**fields))
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Served:
    """`unmask serve` in a subprocess; stopped with SIGTERM."""

    def __init__(self, model: Path, threads: int, *flags: str):
        """threads: --threads and OMP_NUM_THREADS of the server."""
        import httpx

        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": str(threads),
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "unmask", "serve", "--model", str(model), "--model-name",
             "bench", "--port", str(self.port), "--threads", str(threads), *flags],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        deadline = time.time() + 180
        while time.time() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"unmask serve exited: {self.proc.stdout.read()}")
            try:
                if httpx.get(self.base + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        self.proc.kill()
        sys.exit("unmask serve did not start in 180 s")

    def metrics(self) -> dict[str, float]:
        import httpx

        text = httpx.get(self.base + "/metrics").text
        found = {m.group(1): float(m.group(2))
                 for m in re.finditer(r"^unmask_(\w+) (\S+)$", text, re.M)}  # fmt: skip
        by_threads = r'^unmask_forwards_by_threads_total\{threads="(\d+)"\} (\S+)$'
        for m in re.finditer(by_threads, text, re.M):  # forwards_on_N
            found[f"forwards_on_{m.group(1)}"] = float(m.group(2))
        return found

    def cpu_seconds(self) -> float:
        """CPU seconds the server process has used (all its threads), from /proc."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(120)


def client(base: str):
    import openai

    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)


def ask(api, index: int, max_tokens: int, prompt: str | None = None,
        options: dict | None = None, texts: list | None = None) -> tuple[int, float]:  # fmt: skip
    """(completion tokens, seconds) of one greedy request (texts: the answer appended)."""
    start = time.perf_counter()
    out = api.completions.create(model="bench", prompt=prompt or PROMPTS[index % len(PROMPTS)],
                                 max_tokens=max_tokens,
                                 extra_body={"unmask": options or {"block_length": 8}})  # fmt: skip
    if texts is not None:
        texts.append(out.choices[0].text)
    return out.usage.completion_tokens, time.perf_counter() - start


def run_clients(worker, arguments: list[tuple]) -> float:
    """One thread per client, `worker(*args)` each; the wall seconds until all are done."""
    start = time.perf_counter()
    threads = [threading.Thread(target=worker, args=args) for args in arguments]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start


def repeated(served: Served, clients: int, requests: int, scenario: tuple) -> dict:
    """`clients` threads each sending the scenario's one prompt `requests` times."""
    _, prompt, max_tokens, options = scenario
    before = served.metrics()
    api = client(served.base)
    latencies, texts = [], []
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(requests):
            _, seconds = ask(api, 0, max_tokens, prompt, options, texts)
            with lock:
                latencies.append(seconds)

    wall = run_clients(worker, [()] * clients)
    after = served.metrics()
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    return {
        "fwd_req": delta["row_forwards_total"] / len(latencies),
        "busy_ms": 1000 * delta["busy_seconds_total"] / len(latencies),
        "p50": statistics.median(latencies),
        "req_s": len(latencies) / wall,
        "hits": delta["prefix_cache_hits_total"],
        "misses": delta["prefix_cache_misses_total"],
        "requests": len(latencies),
        "texts": sorted(set(texts)),
    }


def prefix_cache(model: Path, threads: int, rounds: int, sequential: int, concurrent: int
                 ) -> dict[tuple[str, str], dict[str, list[dict]]]:  # fmt: skip
    """Per (scenario, clients): the runs with the cache on and off, rounds interleaved."""
    servers = {"on": Served(model, threads, "--prefix-cache-mb", "512"),
               "off": Served(model, threads, "--prefix-cache-mb", "0")}  # fmt: skip
    for served in servers.values():  # warm-up (the cache is then warm for the repeats)
        for scenario in REPEATED:
            repeated(served, 1, 1, scenario)
    runs: dict[tuple[str, str], dict[str, list[dict]]] = {}
    loads = [("one at a time", 1, sequential), ("16 at once", 16, concurrent)]
    for round_index in range(rounds):
        for scenario in REPEATED:
            for name, clients, requests in loads:
                cell = runs.setdefault((scenario[0], name), {"on": [], "off": []})
                for mode in rotated(["on", "off"], round_index):
                    cell[mode].append(repeated(servers[mode], clients, requests, scenario))
    for served in servers.values():
        served.stop()
    return runs


def load(served: Served, clients: int, requests: int, max_tokens: int, options: dict) -> dict:
    """`clients` threads, each sending `requests` requests (unmask `options`) back to back."""
    before, cpu = served.metrics(), served.cpu_seconds()
    api = client(served.base)
    latencies: list[float] = []
    tokens = [0]
    lock = threading.Lock()

    def worker(c: int) -> None:
        for r in range(requests):
            n, seconds = ask(api, c * requests + r, max_tokens, options=options)
            with lock:
                latencies.append(seconds)
                tokens[0] += n

    wall = run_clients(worker, [(c,) for c in range(clients)])
    cpu = served.cpu_seconds() - cpu
    after = served.metrics()
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    latencies.sort()
    on = {k: v for k, v in delta.items() if k.startswith("forwards_on_")}  # by thread count
    return {
        "tok_s": tokens[0] / wall,
        "cpu_ms": 1000 * cpu / max(1, tokens[0]),
        "p50": statistics.median(latencies),
        "p99": latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))],
        "tok_fwd": delta["positions_decoded_total"] / max(1.0, delta["row_forwards_total"]),
        "rows_fwd": delta["row_forwards_total"] / max(1.0, delta["forward_passes_total"]),
        "multi": (sum(on.values()) - on.get("forwards_on_1", 0.0)) / max(1.0, sum(on.values())),
        "requests": len(latencies),
    }


def bound(model: Path, threads: int, max_tokens: int, burst: int = 64) -> dict:
    """`burst` requests at once at a server bounded to 32 running + 8 waiting."""
    import openai

    served = Served(model, threads, "--max-batch", "32", "--max-queue", "8")
    api = client(served.base)
    outcome: dict[int, str] = {}

    def one(i: int) -> None:
        try:
            ask(api, i, max_tokens)
            outcome[i] = "answered"
        except openai.RateLimitError:
            outcome[i] = "429"
        except Exception as err:  # counted: a lost request would show here
            outcome[i] = type(err).__name__

    threads_ = [threading.Thread(target=one, args=(i,)) for i in range(burst)]
    for thread in threads_:
        thread.start()
    for thread in threads_:
        thread.join(300)
    hung = sum(thread.is_alive() for thread in threads_)
    code = served.stop()
    values = list(outcome.values())
    return {"burst": burst, "answered": values.count("answered"), "429": values.count("429"),
            "other": len(values) - values.count("answered") - values.count("429"),
            "hung": hung, "exit": code}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model folder (default: the quickstart architecture, "
                        "random weights)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=4, help="requests per client")
    parser.add_argument("--sequential-requests", type=int, default=24,
                        help="requests of the one-at-a-time client")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=16, help="repeated-prompt requests of "
                        "the one-at-a-time client (each of 16 clients sends 1/8 of them)")  # fmt: skip
    parser.add_argument("--threads", default="1", help="server torch threads, a comma list "
                        "of settings measured side by side (e.g. 1,2)")  # fmt: skip
    parser.add_argument("--one-thread-below", help="the servers' --one-thread-below "
                        "(default: the server's)")  # fmt: skip
    parser.add_argument("--out", default=str(RESULTS / "serve.md"))
    parser.add_argument("--quick", action="store_true", help="tiny model, one round, fewer "
                        "requests, no results file (CI)")  # fmt: skip
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    args.load_before = load_average()  # other jobs' load moves every number here
    if args.quick:
        args.rounds, args.requests, args.sequential_requests, args.out = 1, 1, 4, None
        args.repeats = 4
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else build_model(Path(tmp) / "model", args.quick)
        small = [] if args.one_thread_below is None else ["--one-thread-below",
                                                          args.one_thread_below]  # fmt: skip
        servers = {t: Served(model, t, "--max-batch", "32", "--max-queue", "64", *small)
                   for t in threads}  # fmt: skip
        loads = {"one at a time": (1, args.sequential_requests),
                 "32 concurrent": (32, args.requests)}  # fmt: skip
        cells = [(t, w, name) for t in threads for w in WORKLOADS for name in loads]
        for served in servers.values():  # warm-up
            for options in WORKLOADS.values():
                load(served, 1, 2, args.max_tokens, options)
        runs: dict[tuple, list[dict]] = {cell: [] for cell in cells}
        for round_index in range(args.rounds):
            for t, w, name in rotated(cells, round_index):
                clients, requests = loads[name]
                runs[(t, w, name)].append(load(servers[t], clients, requests, args.max_tokens,
                                               WORKLOADS[w]))  # fmt: skip
        for served in servers.values():
            served.stop()
        cached = prefix_cache(model, threads[0], args.rounds, args.repeats,
                              max(1, args.repeats // 8))  # fmt: skip
        limits = bound(model, threads[0], args.max_tokens)
    publish(report(args, threads, runs, limits, cached), args.out)
    for (scenario, load_), cell in cached.items():
        if [r["texts"] for r in cell["on"]] != [r["texts"] for r in cell["off"]]:
            sys.exit(f"the prefix cache changed the answers: {scenario}, {load_}")
    if limits["hung"] or limits["other"] or limits["exit"] != 0:
        sys.exit(f"the queue bound lost or hung requests: {limits}")
    for (t, w), values in ratios(runs).items():
        print(f"{t} thread(s), {w}: 32 concurrent / one at a time: {with_spread(values)}x "
              "output tokens/s")  # fmt: skip


def ratios(runs: dict[tuple, list[dict]], key: str = "tok_s") -> dict[tuple, list[float]]:
    """Per (threads, workload): each round's 32-concurrent / one-at-a-time tokens/s (key
    cpu_ms: one-at-a-time / 32-concurrent CPU per token)."""
    out = {}
    for t, w, name in runs:
        if name == "32 concurrent":
            one, many = runs[(t, w, "one at a time")], runs[(t, w, name)]
            pairs = zip(one, many) if key == "tok_s" else zip(many, one)
            out[(t, w)] = [b[key] / a[key] for a, b in pairs]
    return out


def report(args, threads: list[int], runs: dict[tuple, list[dict]], limits: dict,
           cached: dict) -> str:  # fmt: skip
    model = args.model or ("tiny random model" if args.quick else
                           "quickstart architecture, random weights")  # fmt: skip
    lines = [
        "# Serving benchmark (`unmask serve`, loopback, CPU)",
        "",
        f"{machine('torch', 'uvicorn', 'openai')}; load average (1, 5, 15 min) before: "
        f"{args.load_before}, after: {load_average()}.",
        f"Model: {model}. Requests: max_tokens {args.max_tokens}, blocks of 8, one token per "
        f'step, greedy; workloads `plain` (no cache) and `dual cache` (`"cache": "dual"`); '
        f"servers with {' and '.join(map(str, threads))} torch thread(s) (--threads; "
        f"--one-thread-below {args.one_thread_below or 'default'}), --max-batch 32. "
        f"{args.rounds} interleaved round(s); median (min-max) over rounds.",
        "",
        "| threads | workload | clients | requests | output tok/s | p50 latency s "
        "| p99 latency s | server CPU ms/token | tok/forward | rows/forward "
        "| forwards on > 1 thread |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (t, w, name), rows in runs.items():

        def cell(key: str, fmt: str = "{:.2f}", rows=rows) -> str:
            return with_spread([r[key] for r in rows], fmt)

        lines.append(f"| {t} | {w} | {name} | {rows[0]['requests']} | {cell('tok_s', '{:.1f}')} "
                     f"| {cell('p50', '{:.3f}')} | {cell('p99', '{:.3f}')} | "
                     f"{cell('cpu_ms')} | {cell('tok_fwd')} | "
                     f"{cell('rows_fwd', '{:.1f}')} | {cell('multi', '{:.0%}')} |")  # fmt: skip
    lines += ["", "32 concurrent clients / one client at a time, output tokens/s (each round's "
              "ratio; target >= 4x); in brackets the same ratio of the server's CPU seconds "
              "per token (one at a time / 32 concurrent: what batching saves in work, less "
              "moved by other jobs' load than wall time):", ""]  # fmt: skip
    for (t, w), values in ratios(runs).items():
        cpu = ratios(runs, "cpu_ms")[(t, w)]
        lines.append(f"- {t} thread(s), {w}: **{with_spread(values)}x** "
                     f"(CPU per token: {with_spread(cpu)}x)")  # fmt: skip
    lines += [
        "",
        "Prefix cache: the same prompt again and again, a server with --prefix-cache-mb 512 "
        "(on, the default) and one with 0 (off), in rotated order each round; row forwards "
        "per request (what the cache saves: a repeated prompt's first forward), the engine's "
        "decoding seconds per request (/metrics busy seconds: no HTTP), p50 latency, "
        "requests/s; hits and misses of the runs with the cache on, summed over rounds.",
        "",
        "| prompt and request | clients | requests | row fwd/request on | off | engine ms/request "
        "on | off | p50 s on | off | requests/s on | off | on/off requests/s | hits / misses "
        "| same answers |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (scenario, load_), cell in cached.items():
        on, off = cell["on"], cell["off"]

        def both(key: str, fmt: str, on=on, off=off) -> str:
            return " | ".join(with_spread([r[key] for r in rows], fmt) for rows in (on, off))

        speedup = [a["req_s"] / b["req_s"] for a, b in zip(on, off)]
        same = [a["texts"] for a in on] == [b["texts"] for b in off]
        lines.append(
            f"| {scenario} | {load_} | {on[0]['requests']} | {both('fwd_req', '{:.2f}')} | "
            f"{both('busy_ms', '{:.1f}')} | {both('p50', '{:.3f}')} | {both('req_s', '{:.2f}')} | "
            f"**{with_spread(speedup)}x** | {sum(r['hits'] for r in on):.0f} / "
            f"{sum(r['misses'] for r in on):.0f} | {'yes' if same else 'NO'} |"
        )  # fmt: skip
    lines += [
        "",
        f"Queue bound (--max-batch 32 --max-queue 8, {limits['burst']} requests at once): "
        f"{limits['answered']} answered, {limits['429']} got 429 (Retry-After: 1), "
        f"{limits['other']} other errors, {limits['hung']} hung; the server exited "
        f"{limits['exit']} on SIGTERM.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

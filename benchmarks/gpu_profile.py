"""The phases of `python benchmarks/gpu.py --profile`: each runs in a process of its own
(`gpu.py --phase NAME`) and writes its results (JSON and a Markdown table) as it goes, so
a run cut off by its time limit keeps every phase that finished and what the cut one
measured.

- `env`: the machine (torch, CUDA, the GPU, its clocks from nvidia-smi) and GEMM rates:
  8192^3 in bf16, float32 and TF32; the LM head's shapes (256 x 4096 x 126,464) in bf16
  (bf16 result, float32 result through `out_dtype`) and float32; a Newton-Schulz-shaped
  product; a batch's host-to-device copy from pageable and pinned memory.
- `train-<case>` (benchmarks/gpu_train.py): the real Trainer on a config of configs/models/
  cut to a few layers: step times, MFU (counted, executed, against the datasheet peak and
  the measured GEMM rate) on the packed and the full-row data, the optimizer's share, a
  262,144-token projection, and on each model's first case the syncs, the matmul audit and
  a profiler summary.
- `sample`: the dense slice decoding 256 tokens in blocks of 32, one token per step (a
  fixed 32 forwards per block: random weights do not end rows early), batch 1 and 32, with
  no cache, the prefix cache and the dual cache: forwards/s and tokens/s.
- `serve`: `unmask serve` with that model on the GPU, 32 concurrent clients: tokens/s.
- `cuda-tests`: `pytest -m cuda` over the test files that hold CUDA tests (listed in its
  JSON); the phase fails when pytest does (a collection error included).

`--dry` runs every phase on the CPU with tiny shapes (CI runs it): the code paths, the
files and their format, in about a minute; no number of it means anything.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODELS = REPO / "configs" / "models"

#: what --dry makes of every case: a model a CPU trains in seconds, the case's own layout
DRY = ["train.float8=false", "model.hidden_size=64", "model.intermediate_size=128", "model.num_attention_heads=4",
       "model.num_key_value_heads=4", "model.num_hidden_layers=2", "model.vocab_size=512",
       "data.packing_length=64", "train.torch_compile=false", "train.bf16=false",
       "model.attn_implementation=sdpa", "data.synthetic_train_size=512"]  # fmt: skip


def _write(out: Path, name: str, result: dict, table: list[str]) -> None:
    """NAME.json and NAME.md, each replaced whole (a process killed mid-write leaves the
    previous version, never half a file)."""
    out.mkdir(parents=True, exist_ok=True)
    for path, text in ((out / f"{name}.json", json.dumps(result, indent=2, default=str)),
                       (out / f"{name}.md", "\n".join(table))):  # fmt: skip
        partial = path.with_name(path.name + ".partial")
        partial.write_text(text + "\n")
        partial.replace(path)


def _device(dry: bool):
    import torch

    if dry:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("gpu.py --profile: no CUDA device is visible; use --dry on a CPU")
    return torch.device("cuda")


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


class _Timer:
    """Seconds of device work between marks: CUDA events (read once, at the end) on a GPU,
    the wall clock on a CPU."""

    def __init__(self, device):
        import torch

        self.cuda = device.type == "cuda"
        self._event = (lambda: torch.cuda.Event(enable_timing=True)) if self.cuda else None

    def mark(self):
        if self.cuda:
            event = self._event()
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start, stop) -> float:
        return start.elapsed_time(stop) / 1e3 if self.cuda else stop - start


def _rate(fn, flops: float, device, repeats: int = 10) -> float:
    """TFLOP/s of fn (after 3 untimed calls), from the median of `repeats` timed calls."""
    timer = _Timer(device)
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = timer.mark()
        fn()
        stop = timer.mark()
        _sync(device)
        times.append(timer.seconds(start, stop))
    return flops / statistics.median(times) / 1e12


# --------------------------------------------------------------------------------- env


def phase_env(out: Path, dry: bool) -> dict:
    import torch

    device = _device(dry)
    result: dict = {"torch": torch.__version__, "cuda": torch.version.cuda,
                    "python": sys.version.split()[0],
                    "float32_matmul_precision": torch.get_float32_matmul_precision()}  # fmt: skip
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(0)
        result.update(device=props.name, multiprocessors=props.multi_processor_count,
                      memory_gib=round(props.total_memory / 2**30, 1))  # fmt: skip
        try:
            query = "name,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu"
            smi = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv"],
                                 capture_output=True, text=True, timeout=20)  # fmt: skip
            result["nvidia_smi"] = smi.stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as err:
            result["nvidia_smi"] = f"not read: {err}"
    else:
        result["device"] = "cpu (dry run)"
    n, rows, hidden, vocab = (256, 16, 64, 512) if dry else (8192, 256, 4096, 126_464)
    rates = {}
    for name, dtype, precision in (("bf16", torch.bfloat16, "highest"),
                                   ("float32", torch.float32, "highest"),
                                   ("tf32", torch.float32, "high")):  # fmt: skip
        torch.set_float32_matmul_precision(precision)
        a = torch.randn(n, n, device=device, dtype=dtype)
        rates[f"{n}^3 {name}"] = _rate(lambda a=a: a @ a, 2 * n**3, device)
    torch.set_float32_matmul_precision("highest")
    h = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
    w = torch.randn(vocab, hidden, device=device, dtype=torch.bfloat16)
    head = 2 * rows * hidden * vocab
    rates[f"head {rows}x{hidden}x{vocab} bf16"] = _rate(lambda: h @ w.T, head, device)
    try:
        rates[f"head {rows}x{hidden}x{vocab} bf16, float32 out"] = _rate(
            lambda: torch.mm(h, w.T, out_dtype=torch.float32), head, device)  # fmt: skip
    except (RuntimeError, TypeError) as err:
        rates[f"head {rows}x{hidden}x{vocab} bf16, float32 out"] = f"unavailable: {err}"[:120]
    hf, wf = h.float(), w.float()
    rates[f"head {rows}x{hidden}x{vocab} float32"] = _rate(lambda: hf @ wf.T, head, device)
    m, k = (64, 192) if dry else (4096, 12288)  # a Muon matrix's X X^T in Newton-Schulz
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    rates[f"NS X X^T {m}x{k} bf16"] = _rate(lambda: x @ x.T, 2 * m * m * k, device)
    result["tflops"] = {k: (round(v, 1 if v >= 1 else 4) if isinstance(v, float) else v)
                        for k, v in rates.items()}  # fmt: skip
    copies = {}
    batch = torch.randint(0, 1000, (2, 64 if dry else 4096))
    for name, source in (("pageable", batch),
                         ("pinned", batch.pin_memory() if device.type == "cuda" else batch)):  # fmt: skip
        timer = _Timer(device)
        start = timer.mark()
        for _ in range(20):
            source.to(device, non_blocking=True)
        stop = timer.mark()
        _sync(device)
        copies[name] = round(timer.seconds(start, stop) / 20 * 1e6, 1)
    result["batch_copy_us"] = copies
    table = [f"# GPU profile: environment ({result['device']})", "",
             f"torch {result['torch']}, CUDA {result['cuda']}, Python {result['python']}", "",
             "| GEMM | TFLOP/s |", "| --- | --- |"]  # fmt: skip
    table += [f"| {k} | {v} |" for k, v in result["tflops"].items()]
    table += ["", f"A (2, {batch.shape[1]}) batch to the device: {copies['pageable']} us from "
              f"pageable memory, {copies['pinned']} us pinned."]  # fmt: skip
    if "nvidia_smi" in result:
        table += ["", "```", result["nvidia_smi"], "```"]
    _write(out, "env", result, table)
    return result


# ------------------------------------------------------------------------------ sample


def _slice_model(dry: bool, device):
    import torch

    from unmask.config import load_config
    from unmask.models import build_model

    overrides = ["model.num_hidden_layers=4"] + (DRY if dry else [])
    cfg = load_config(MODELS / "llada_8b.yaml", overrides)
    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(cfg.model)
    dtype = torch.float32 if dry else torch.bfloat16
    return model.to(dtype).eval(), cfg


def phase_sample(out: Path, dry: bool) -> dict:
    import torch

    from unmask.sampling import SamplingConfig, sample

    device = _device(dry)
    model, cfg = _slice_model(dry, device)
    gen, block, prompt = (32, 8, 16) if dry else (256, 32, 64)
    rows = []
    for batch in (1, 32):
        ids = torch.randint(10, 1000 if not dry else 500, (batch, prompt), device=device)
        for cache in ("none", "prefix", "dual"):
            config = SamplingConfig(gen_length=gen, block_length=block, steps=gen, cache=cache)
            with torch.inference_mode():
                sample(model, ids, config, mask_id=cfg.model.vocab_size - 1)  # warm-up
                _sync(device)
                started = time.perf_counter()
                got = sample(model, ids, config, mask_id=cfg.model.vocab_size - 1)
                _sync(device)
            seconds = time.perf_counter() - started
            rows.append({"batch": batch, "cache": cache, "forwards": got.nfe,
                         "seconds": round(seconds, 4), "forwards_per_s": round(got.nfe / seconds, 1),
                         "tokens_per_s": round(batch * gen / seconds, 1)})  # fmt: skip
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    result = {"device": name, "gen_length": gen, "block_length": block, "prompt": prompt,
              "rows": rows}  # fmt: skip
    table = [f"# GPU profile: sampling, the dense slice ({name})", "",
             f"4-layer LLaDA-8B shape, random weights, {prompt}-token prompts, {gen} tokens in "
             f"blocks of {block}, one token per step (no early stop)", "",
             "| batch | cache | forwards | s | forwards/s | tokens/s |",
             "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    table += [f"| {r['batch']} | {r['cache']} | {r['forwards']} | {r['seconds']} | "
              f"{r['forwards_per_s']} | {r['tokens_per_s']} |" for r in rows]  # fmt: skip
    _write(out, "sample", result, table)
    return result


# ------------------------------------------------------------------------------- serve


def phase_serve(out: Path, dry: bool) -> dict:
    import threading

    import httpx
    import torch

    from unmask.data.tokenizer import build_char_tokenizer, ensure_special_tokens

    device = _device(dry)
    model, _ = _slice_model(dry, "cpu")
    tokenizer = build_char_tokenizer()
    ensure_special_tokens(tokenizer)
    gen, block, clients = (16, 8, 4) if dry else (256, 32, 32)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        model.float().save_pretrained(str(folder))
        tokenizer.save_pretrained(str(folder))
        port = _free_port()
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        }
        proc = subprocess.Popen([sys.executable, "-m", "unmask", "serve", "--model", str(folder),
                                 "--port", str(port), "--device", device.type, "--max-batch",
                                 str(clients), "--model-name", "slice"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + 120
            while True:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"unmask serve did not start: {proc.stdout.read()[-2000:]}")
                try:
                    if httpx.get(base + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.3)
            body = {"model": "slice", "prompt": "rev 90417=", "max_tokens": gen,
                    "unmask": {"block_length": block}}  # fmt: skip
            httpx.post(base + "/v1/completions", json=body, timeout=300)  # warm-up
            tokens = [0]
            lock = threading.Lock()

            def ask() -> None:
                got = httpx.post(base + "/v1/completions", json=body, timeout=300).json()
                with lock:
                    tokens[0] += got["usage"]["completion_tokens"]

            started = time.perf_counter()
            threads = [threading.Thread(target=ask) for _ in range(clients)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            concurrent_s = time.perf_counter() - started
            started = time.perf_counter()
            ask()
            alone_s = time.perf_counter() - started
        finally:
            proc.terminate()
            proc.wait(60)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    result = {"device": name, "clients": clients, "gen_length": gen, "block_length": block,
              "concurrent_tokens_per_s": round(tokens[0] / concurrent_s, 1),
              "one_request_s": round(alone_s, 3)}  # fmt: skip
    table = [f"# GPU profile: unmask serve, the dense slice ({name})", "",
             f"{clients} concurrent requests of {gen} tokens in blocks of {block} (one token per "
             f"step): {result['concurrent_tokens_per_s']} tokens/s; one request alone "
             f"{result['one_request_s']} s"]  # fmt: skip
    _write(out, "serve", result, table)
    return result


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -------------------------------------------------------------------------- cuda tests


def cuda_test_files() -> list[str]:
    """The test files that hold CUDA tests (they use conftest's CUDA marks or
    pytest.mark.cuda), relative to the repository."""
    marks = ("NEEDS_CUDA", "pytest.mark.cuda", "import CUDA", "CUDA,", ", CUDA")
    found = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        text = path.read_text()
        if any(mark in text for mark in marks):
            found.append(str(path.relative_to(REPO)))
    return found


def phase_cuda_tests(out: Path, dry: bool) -> dict:
    """`pytest -m cuda` over `cuda_test_files()` (on a CPU every such test skips: --dry
    checks they are collected); a pytest failure, collection errors included, fails the
    phase (exit 1) after its JSON is written."""
    files = cuda_test_files()
    args = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
            *files]  # fmt: skip
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=240, cwd=REPO)
        returncode, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired:
        returncode, tail = None, "timed out after 240 s"
    result = {"files": files, "returncode": returncode, "tail": tail}
    _write(out, "cuda-tests", result, ["# GPU profile: pytest -m cuda", "",
                                       f"Files: {' '.join(files)}", "", "```", tail, "```"])  # fmt: skip
    if returncode != 0:
        raise SystemExit(
            f"cuda-tests: pytest exited {returncode}: {tail.strip().splitlines()[-1:]}"
        )
    return result


PHASES = {"env": phase_env, "sample": phase_sample, "serve": phase_serve,
          "cuda-tests": phase_cuda_tests}  # fmt: skip


def run_phase(name: str, out: Path, dry: bool) -> dict:
    if name.startswith("train-"):
        from gpu_train import phase_train

        return phase_train(out, name.removeprefix("train-"), dry)
    return PHASES[name](out, dry)

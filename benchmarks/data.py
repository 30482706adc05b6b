"""Data pipeline on CPU: preprocessing throughput, loader wait per training step, start-up and
memory vs corpus size, resume vs start.

1. Preprocessing throughput. ~20 MB of synthetic English-like jsonl (words drawn from a fixed
   random vocabulary with Zipf frequencies, seeded; documents of log-normal length) and a
   byte-level BPE tokenizer trained on it (vocabulary 8000, saved as a transformers fast
   tokenizer folder). Tokens/s of (a) the tokenizer's own batch encode over all texts already
   in memory on one thread (TOKENIZERS_PARALLELISM=false), (b) the same with the library's
   default threads, (c) `unmask preprocess --workers 1` and (d) `--workers 2`, timed around
   the `preprocess(...)` call: reading the jsonl, tokenizing and writing the store, what a
   user waits for (`--workers 1` encodes on the tokenizer's own threads, each of N > 1
   workers on one). The batch encode is `encode_batch_fast` (no offsets: the call preprocess
   makes); plain `encode_batch` is measured too, for reference. Each measurement runs in its
   own subprocess, so imports and the environment are controlled.
2. Loader cost per training step. The quickstart model (char tokenizer) with packing_length
   256 and 16 rows per step on four source kinds (in-memory jsonl, a token store made by
   `unmask preprocess`, a stream over 4 jsonl shards, a blend of the store and the jsonl),
   each with dataloader_num_workers 0 and 2. A `Trainer` is built in this process, warmed up,
   then per step the time spent in `next(trainer.loader)` (the loop waiting for data) and the
   whole step (`next` + `trainer.train_step`) are recorded.
3. Start-up and peak memory vs corpus size. Two token stores of random char-tokenizer ids
   (10M and 500M tokens, documents of 200-3000 tokens) written with `IndexedWriter`; a fresh
   subprocess per measurement starts a clock before importing unmask, builds the trainer
   (quickstart model, the store, eval_split 8 documents, max_steps 1) and reports the seconds
   until the first `train_step` returns and its peak RSS (VmHWM) at that point.
4. Resume vs start. A run of N steps on the 10M store and on the jsonl stream saves a
   checkpoint at step N; fresh subprocesses then time to the first step of (a) a fresh start
   and (b) a resume from that checkpoint (output_dir a copy of the run).

Every part runs its variants in interleaved rounds (variant order rotated each round) and
reports medians with the min-max spread; ratios are per round, against a reference measured
in the same round. Torch runs on one thread (--threads): on a shared 2-core box two OpenMP
threads spin on each other.

Run: python benchmarks/data.py            (writes benchmarks/results/data.md; ~8 minutes on
                                          2 cores, 1.1 GB of temporary files)
     python benchmarks/data.py --quick    (smoke test of every part, ~1 minute; prints the
                                          report, writes no results file)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from common import REPO, load_average, machine, median_spread, publish, rotated

# The clock of the part 3 / 4 children, started before torch and unmask are imported: that
# is why those imports live inside the functions below, not up here.
_STARTED = time.perf_counter()

RESULTS = REPO / "benchmarks" / "results" / "data.md"


@dataclass(frozen=True)
class Sizes:
    corpus_bytes: int  # part 1 jsonl
    bpe_vocab: int
    encode_batch_rows: bool  # part 1: also plain encode_batch, as a reference
    loader_docs: int  # part 2 / 4 jsonl documents
    loader_batch: int  # part 2 rows per step
    loader_warmup: int
    loader_steps: int
    small_tokens: int  # part 3 stores
    large_tokens: int
    resume_steps: int  # part 4: N


FULL = Sizes(20_000_000, 8000, True, 4000, 16, 3, 15, 10_000_000, 500_000_000, 200)
QUICK = Sizes(1_000_000, 1000, False, 300, 4, 1, 2, 1_000_000, 20_000_000, 5)
#: the packages whose versions the report names
PACKAGES = ("torch", "tokenizers", "datasets")


# ------------------------------------------------------------------------------ helpers


def child_env(**overrides: str | None) -> dict[str, str]:
    """This process's environment with the repository first on PYTHONPATH; a None value
    removes a variable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "1"
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def run_child(kind: str, spec: dict, **env: str | None) -> dict:
    """Run `data.py --child KIND` in a fresh interpreter; its last stdout line is the result."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, json.dumps(spec)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=child_env(**env), cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"child {kind} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_config(data: dict, train: dict) -> dict:
    """A config tree: the quickstart's model, objective and optimizer, our data and train."""
    import yaml

    from unmask.config import quickstart_yaml

    tree = yaml.safe_load(quickstart_yaml())
    tree["data"] = {"packing": True, "packing_length": 256, **data}
    tree["train"] = {"disable_tqdm": True, "save_steps": 0, "logging_steps": 10**9, **train}
    tree["eval"] = {"generate_accuracy": False}
    return tree


# ----------------------------------------------------------------------- synthetic data


def write_text_jsonl(
    path: Path, seed: int, *, max_bytes: int = 0, max_docs: int = 0, batch: int = 500
) -> tuple[int, int]:
    """English-like documents (random words, Zipf frequencies, some commas and periods) as
    jsonl until max_bytes or max_docs; returns (documents, bytes)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    letters = list("etaoinshrdlcumwfgypbvkjxqz")
    freq = np.array([12.7, 9.1, 8.2, 7.5, 7.0, 6.7, 6.3, 6.1, 6.0, 4.3, 4.0, 2.8, 2.8, 2.4,
                     2.4, 2.2, 2.0, 2.0, 1.9, 1.5, 1.0, 0.8, 0.15, 0.15, 0.1, 0.07])  # fmt: skip
    vocab_rng = np.random.default_rng(1234)  # one vocabulary for every file
    lengths = np.clip(vocab_rng.poisson(4.5, 20000), 1, 14)
    words = ["".join(vocab_rng.choice(letters, n, p=freq / freq.sum())) for n in lengths]
    cdf = np.cumsum(1 / np.arange(1, len(words) + 1) ** 1.07)
    cdf /= cdf[-1]
    suffix = ("", ",", ".")
    docs = size = 0
    with open(path, "w") as out:
        while (max_bytes and size < max_bytes) or (max_docs and docs < max_docs):
            counts = np.clip(rng.lognormal(5.0, 0.9, batch).astype(int), 5, 5000)
            ids = np.searchsorted(cdf, rng.random(int(counts.sum()))).tolist()
            marks = rng.choice(3, len(ids), p=[0.86, 0.08, 0.06]).tolist()
            pieces = [words[i] + suffix[m] for i, m in zip(ids, marks)]
            start = 0
            for n in counts.tolist():
                line = json.dumps({"text": " ".join(pieces[start : start + n])}) + "\n"
                start += n
                out.write(line)
                docs, size = docs + 1, size + len(line)
                if (max_docs and docs >= max_docs) or (max_bytes and size >= max_bytes):
                    return docs, size
    return docs, size


def train_bpe(corpus: Path, folder: Path, vocab: int) -> None:
    """A byte-level BPE tokenizer trained on the corpus, saved as a transformers folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [json.loads(line)["text"] for line in corpus.open()]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<pad>", "<eos>", "<mask>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    core.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", mask_token="<mask>"
    )
    fast.save_pretrained(str(folder))


class Workspace:
    """Files shared by the parts, made on first use under one folder."""

    def __init__(self, root: Path, sizes: Sizes):
        self.root, self.sizes = root, sizes
        root.mkdir(parents=True, exist_ok=True)

    def char_tokenizer(self) -> Path:
        folder = self.root / "char_tokenizer"
        if not folder.is_dir():
            from unmask.data import build_char_tokenizer

            build_char_tokenizer().save_pretrained(str(folder))
        return folder

    def loader_corpus(self) -> dict[str, str]:
        """Parts 2 and 4: a jsonl file, the same documents as 4 shards, and their store."""
        folder = self.root / "loader"
        paths = {
            "jsonl": folder / "text.jsonl",
            "shards": folder / "shards",
            "store": folder / "store",
        }
        if not (folder / "done").exists():
            from unmask.data.preprocess import preprocess

            shutil.rmtree(folder, ignore_errors=True)
            paths["shards"].mkdir(parents=True)
            docs, size = write_text_jsonl(paths["jsonl"], seed=1, max_docs=self.sizes.loader_docs)
            lines = paths["jsonl"].read_text().splitlines(keepends=True)
            quarter = -(-len(lines) // 4)
            for i in range(4):
                shard = paths["shards"] / f"part-{i}.jsonl"
                shard.write_text("".join(lines[i * quarter : (i + 1) * quarter]))
            preprocess([str(paths["jsonl"])], str(paths["store"]), str(self.char_tokenizer()),
                       append_eod=True, progress=False)  # fmt: skip
            (folder / "done").write_text(json.dumps({"documents": docs, "bytes": size}))
            print(f"  loader corpus: {docs} documents, {size / 1e6:.1f} MB, 4 shards, store")
        return {k: str(v) for k, v in paths.items()}

    def random_store(self, tokens: int, name: str) -> dict:
        """A token store of random char-tokenizer ids written with IndexedWriter, in chunks;
        returns its prefix and counts."""
        prefix = self.root / name
        info_path = self.root / f"{name}.info.json"
        if info_path.exists():
            return json.loads(info_path.read_text())
        import numpy as np

        from unmask.data import IndexedWriter
        from unmask.data.indexed import token_dtype, tokenizer_fingerprint, vocab_size
        from unmask.data.tokenizer import load_local_tokenizer

        tok = load_local_tokenizer(str(self.char_tokenizer()))  # as the trainer will load it
        vocab = vocab_size(tok)
        rng = np.random.default_rng(tokens)
        started = time.perf_counter()
        with IndexedWriter(prefix, token_dtype(vocab), overwrite=True) as writer:
            while writer.num_tokens < tokens:
                lengths = rng.integers(200, 3001, 10_000)  # ~16M tokens per chunk
                lengths = lengths[np.cumsum(lengths) <= tokens - writer.num_tokens]
                if lengths.size == 0:
                    lengths = np.array([tokens - writer.num_tokens])
                ids = rng.integers(0, vocab, int(lengths.sum()), dtype=np.uint16)
                writer.add_documents(ids, lengths)
            writer.finish({"tokenizer": str(self.char_tokenizer()),
                           "tokenizer_fingerprint": tokenizer_fingerprint(tok),
                           "vocab_size": vocab, "append_eod": False})  # fmt: skip
        info = {
            "prefix": str(prefix),
            "tokens": writer.num_tokens,
            "documents": writer.num_documents,
            "bin_bytes": Path(str(prefix) + ".bin").stat().st_size,
        }
        info_path.write_text(json.dumps(info))
        seconds = time.perf_counter() - started
        print(f"  wrote {name}: {info['tokens']:,} tokens, {info['documents']:,} documents, "
              f"{info['bin_bytes'] / 1e9:.2f} GB in {seconds:.0f} s")  # fmt: skip
        return info


# ---------------------------------------------------------------------- child processes


def child_encode(spec: dict) -> dict:
    """Batch-encode every text of the corpus (read first, not timed) with the tokenizer's
    own `tokenizers.Tokenizer`; threads follow TOKENIZERS_PARALLELISM as set by the parent."""
    from tokenizers import Tokenizer

    texts = [json.loads(line)["text"] for line in open(spec["corpus"])]
    tokenizer = Tokenizer.from_file(str(Path(spec["tokenizer"]) / "tokenizer.json"))
    encode = getattr(tokenizer, spec["method"])
    start = time.perf_counter()
    encoded = encode(texts, add_special_tokens=False)
    seconds = time.perf_counter() - start
    return {"tokens": sum(len(e.ids) for e in encoded), "seconds": seconds}


def child_preprocess(spec: dict) -> dict:
    """One `preprocess(...)` call, timed whole (read, tokenize, write the store)."""
    import hashlib

    from unmask.data.preprocess import preprocess

    start = time.perf_counter()
    summary = preprocess([spec["corpus"]], spec["prefix"], spec["tokenizer"],
                         workers=spec["workers"], overwrite=True, progress=False)  # fmt: skip
    seconds = time.perf_counter() - start
    bin_path = Path(spec["prefix"] + ".bin")
    digest = hashlib.sha256(bin_path.read_bytes()).hexdigest()
    for path in summary.paths:
        path.unlink()
    return {"tokens": summary.tokens, "seconds": seconds, "sha256": digest}


def peak_rss_kib() -> int:
    """This process's peak RSS (VmHWM) in KiB. Not ru_maxrss: Linux carries that over an
    exec from the old address space, which under subprocess's vfork is the parent's, so a
    child would report at least the benchmark process's own peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def child_first_step(spec: dict) -> dict:
    """Seconds from this interpreter's first line to the first `train_step` returning (and
    to the end of the imports), and the peak RSS then (KiB)."""
    import torch

    torch.set_num_threads(spec["threads"])
    from unmask.config import validate_tree
    from unmask.train.trainer import Trainer

    imported = time.perf_counter() - _STARTED
    trainer = Trainer(validate_tree(spec["config"]))
    start_step = trainer.step
    trainer.train_step([next(trainer.loader)])
    seconds = time.perf_counter() - _STARTED
    peak_kib = peak_rss_kib()
    trainer.loader.close()
    return {"seconds": seconds, "imports": imported, "peak_rss_kib": peak_kib,
            "start_step": start_step,
            "ru_maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}  # fmt: skip


CHILDREN = {
    "encode": child_encode,
    "preprocess": child_preprocess,
    "first_step": child_first_step,
}


# ------------------------------------------------------------------ part 1: preprocessing


def part_preprocess(ws: Workspace, rounds: int) -> str:
    print("part 1: preprocessing throughput", flush=True)
    corpus = ws.root / "preprocess" / "corpus.jsonl"
    tokenizer = ws.root / "preprocess" / "bpe"
    corpus.parent.mkdir(exist_ok=True)
    started = time.perf_counter()
    docs, size = write_text_jsonl(corpus, seed=0, max_bytes=ws.sizes.corpus_bytes)
    print(f"  corpus: {docs} documents, {size / 1e6:.1f} MB "
          f"({time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip
    started = time.perf_counter()
    train_bpe(corpus, tokenizer, ws.sizes.bpe_vocab)
    print(f"  BPE tokenizer, vocabulary {ws.sizes.bpe_vocab} "
          f"({time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip

    base = {"corpus": str(corpus), "tokenizer": str(tokenizer)}
    one, default = {"TOKENIZERS_PARALLELISM": "false"}, {"TOKENIZERS_PARALLELISM": None}
    variants = {
        "a": ("encode_batch_fast, 1 thread", "encode",
              {**base, "method": "encode_batch_fast"}, one),
        "b": ("encode_batch_fast, default threads", "encode",
              {**base, "method": "encode_batch_fast"}, default),
        "a'": ("encode_batch (with offsets), 1 thread", "encode",
               {**base, "method": "encode_batch"}, one),
        "b'": ("encode_batch (with offsets), default threads", "encode",
               {**base, "method": "encode_batch"}, default),
        "c": ("unmask preprocess --workers 1", "preprocess",
              {**base, "workers": 1, "prefix": str(corpus.parent / "store")}, default),
        "d": ("unmask preprocess --workers 2", "preprocess",
              {**base, "workers": 2, "prefix": str(corpus.parent / "store")}, default),
    }  # fmt: skip
    if not ws.sizes.encode_batch_rows:
        del variants["a'"], variants["b'"]
    rates: dict[str, list[float]] = {k: [] for k in variants}
    tokens: dict[str, set] = {k: set() for k in variants}
    digests = set()
    for r in range(rounds):
        for key in rotated(list(variants), r):
            label, kind, spec, env = variants[key]
            out = run_child(kind, spec, **env)
            rates[key].append(out["tokens"] / out["seconds"])
            tokens[key].add(out["tokens"])
            digests.add(out.get("sha256"))
            print(f"  round {r + 1} ({key}) {label}: {rates[key][-1]:,.0f} tokens/s", flush=True)
    counts = set().union(*tokens.values())
    if len(counts) != 1 or len(digests - {None}) != 1:
        raise RuntimeError(f"token counts {counts} / store digests {digests} differ")

    lines = [
        "| | measurement | tokens/s (median) | min-max |",
        "|---|---|---|---|",
    ]
    for key, (label, *_rest) in variants.items():
        med, spread = median_spread([x / 1e6 for x in rates[key]], "{:.3f}M")
        lines.append(f"| ({key}) | {label} | {med} | {spread} |")
    lines += [
        "",
        "| ratio | what | median | min-max | target | met? |",
        "|---|---|---|---|---|---|",
    ]
    for num, den, target in (("c", "a", 0.8), ("d", "a", 1.6), ("c", "b", 0.8), ("d", "b", 1.6),
                             ("c", "a'", 0.8), ("d", "a'", 1.6), ("c", "b'", 0.8),
                             ("d", "b'", 1.6)):  # fmt: skip
        if den not in variants:
            continue
        per_round = [n / d for n, d in zip(rates[num], rates[den])]
        med, spread = median_spread(per_round, "{:.2f}x")
        met = "yes" if statistics.median(per_round) >= target else "**no**"
        what = f"{variants[num][0].removeprefix('unmask ')} / {variants[den][0]}"
        lines.append(f"| {num}/{den} | {what} | {med} | {spread} | >= {target}x | {met} |")
    b_over_a = [b / a for a, b in zip(rates["a"], rates["b"])]
    return "\n".join(
        [
            "## 1. Preprocessing throughput",
            "",
            f"Corpus: {docs:,} jsonl documents, {size / 1e6:.1f} MB, {counts.pop():,} tokens "
            f"with a byte-level BPE tokenizer of vocabulary {ws.sizes.bpe_vocab} trained on it. "
            "Every measurement produced the same token count, and the stores written with 1 "
            "and 2 workers are byte-identical.",
            "",
            *lines,
            "",
            "Method: each measurement in its own subprocess, (a)-(b') timing only the encode "
            "call over texts already in memory, (c)-(d) timing the whole `preprocess(...)` call "
            "(progress off: read jsonl, tokenize, write the store); 1 thread = "
            "TOKENIZERS_PARALLELISM=false, default = the variable unset. The issue's targets "
            "(>= 0.8x the batch encode with 1 worker, >= 1.6x with 2) are checked against each "
            "baseline; (a)/(b) use `encode_batch_fast`, the call preprocess itself makes, so "
            "they are the stricter baselines; (a')/(b') use `encode_batch`, which also "
            "computes offsets. `--workers 1` encodes in the main process on the tokenizer's own "
            "threads; `--workers 2` in 2 processes of one tokenizer thread each, while the main "
            f"process reads and writes. On these {os.cpu_count()} cores (b) runs at "
            f"{statistics.median(b_over_a):.2f}x (a), so d/b >= 1.6x would need "
            f"{1.6 * statistics.median(b_over_a):.1f}x one thread's rate.",
            "",
        ]
    )


# ------------------------------------------------------------------- part 2: loader wait


def _time_steps(trainer, warmup: int, steps: int) -> tuple[list[float], list[float]]:
    """(wait, step) seconds per timed step: wait = in next(loader), step = next + train_step."""
    waits, totals = [], []
    accumulation = trainer.cfg.train.gradient_accumulation_steps
    for i in range(warmup + steps):
        start = time.perf_counter()
        batches = [next(trainer.loader) for _ in range(accumulation)]
        fetched = time.perf_counter()
        trainer.train_step(batches)
        trainer.step += 1
        if i >= warmup:
            waits.append(fetched - start)
            totals.append(time.perf_counter() - start)
    return waits, totals


def _loader_claim(by_kind: dict[str, tuple[dict, dict]]) -> str:
    """The claim "the loader never blocks a training step in steady state" against the
    measurements: (0 workers, 2 workers) results per source kind."""
    step = statistics.median(x for _, two in by_kind.values() for x in two["step"])
    waits = [x for _, two in by_kind.values() for x in two["wait"]]
    fracs = [x for _, two in by_kind.values() for x in two["frac"]]
    longest = max(x for _, two in by_kind.values() for x in two["max"])

    def wait(results: dict) -> float:
        return statistics.median(results["wait"])

    faster = ", ".join(k for k, (zero, two) in by_kind.items() if wait(two) < wait(zero))
    slower = ", ".join(k for k, (zero, two) in by_kind.items() if wait(two) >= wait(zero))
    built = ", ".join(f"{k} {wait(zero) * 1e3:.1f} ms"
                      for k, (zero, _) in by_kind.items())  # fmt: skip
    return (
        f'The claim "the loader never blocks a training step in steady state" (2 workers): '
        f"not literally true, every step waits in `next`: {min(waits) * 1e3:.1f}-"
        f"{max(waits) * 1e3:.1f} ms per step on average over kinds and rounds, at most "
        f"{max(fracs):.2%} of a step; the longest single wait was {longest * 1e3:.1f} ms "
        f"({longest / step:.1%} of the median step of {step * 1e3:.0f} ms). Building the batch "
        f"in the training process instead (0 workers) costs per step: {built}. With workers "
        f"each step pays the hand-over of the batch from the worker process instead, so they "
        f"shorten the wait only where building a batch costs more than that "
        f"({faster or 'none'}) and lengthen it elsewhere ({slower or 'none'})."
    )


def part_loader(ws: Workspace, rounds: int, threads: int) -> str:
    print("part 2: loader cost per training step", flush=True)
    import gc

    import torch

    from unmask.config import validate_tree
    from unmask.train.trainer import Trainer

    torch.set_num_threads(threads)
    corpus = ws.loader_corpus()
    tokenizer = str(ws.char_tokenizer())
    kinds = {
        "jsonl, in memory": {"dataset": corpus["jsonl"]},
        "token store": {"dataset": corpus["store"]},
        "stream, 4 jsonl shards": {"dataset": corpus["shards"], "streaming": True},
        "blend: store + jsonl": {"sources": [{"path": corpus["store"]}, {"path": corpus["jsonl"]}]},
    }
    variants = [(kind, workers) for kind in kinds for workers in (0, 2)]
    results: dict[tuple, dict[str, list]] = {v: {"frac": [], "wait": [], "step": [], "max": []}
                                             for v in variants}  # fmt: skip
    sizes = ws.sizes
    for r in range(rounds):
        for kind, workers in rotated(variants, r):
            out_dir = ws.root / "loader-runs" / f"{list(kinds).index(kind)}-{workers}-{r}"
            config = run_config(
                {"tokenizer": tokenizer, **kinds[kind]},
                {"output_dir": str(out_dir), "max_steps": 10_000, "overwrite_output_dir": True,
                 "per_device_train_batch_size": sizes.loader_batch,
                 "dataloader_num_workers": workers},
            )  # fmt: skip
            trainer = Trainer(validate_tree(config))
            try:
                waits, totals = _time_steps(trainer, sizes.loader_warmup, sizes.loader_steps)
            finally:
                trainer.loader.close()
            del trainer
            gc.collect()
            got = results[(kind, workers)]
            got["frac"].append(sum(waits) / sum(totals))
            got["wait"].append(statistics.mean(waits))
            got["step"].append(statistics.mean(totals))
            got["max"].append(max(waits))
            print(f"  round {r + 1} {kind}, {workers} workers: step {got['step'][-1] * 1e3:.0f} "
                  f"ms, wait {got['wait'][-1] * 1e3:.2f} ms/step ({got['frac'][-1]:.2%}), max "
                  f"{got['max'][-1] * 1e3:.1f} ms", flush=True)  # fmt: skip

    lines = [
        "| source | workers | step ms | wait ms / step | wait / step | min-max "
        "| max single wait ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind, workers in variants:
        got = results[(kind, workers)]
        frac, spread = median_spread([100 * x for x in got["frac"]], "{:.2f}%")
        lines.append(
            f"| {kind} | {workers} | {statistics.median(got['step']) * 1e3:.0f} "
            f"| {statistics.median(got['wait']) * 1e3:.2f} | {frac} | {spread} "
            f"| {max(got['max']) * 1e3:.1f} |"
        )
    claim = _loader_claim({k: (results[(k, 0)], results[(k, 2)]) for k in kinds})
    return "\n".join(
        [
            "## 2. Loader cost per training step",
            "",
            *lines,
            "",
            claim,
            "",
            f"Method: the quickstart model (char tokenizer) with packing_length 256 and "
            f"{sizes.loader_batch} rows per step; a `Trainer` built in the benchmark process "
            f"per source, kind and round, {sizes.loader_warmup} warm-up steps, then "
            f"{sizes.loader_steps} timed steps: wait = seconds in `next(trainer.loader)`, step "
            "= that plus `trainer.train_step`; wait / step = sum of waits / sum of steps per "
            "round (median and min-max over rounds), max single wait over all rounds. Sources: "
            f"the same {sizes.loader_docs} synthetic documents as one jsonl file (tokenized "
            "into rows at start-up), a store made from it by `unmask preprocess --append-eod`, "
            "4 jsonl shards streamed (`data.streaming: true`), and a 1:1 blend of the store and "
            f"the jsonl. torch on {threads} thread(s); DataLoader workers on 1 thread each.",
            "",
        ]
    )


# -------------------------------------------------------------- part 3: start-up at scale


def part_scale(ws: Workspace, rounds: int, threads: int) -> str:
    print("part 3: start-up time and peak memory vs corpus size", flush=True)
    tokenizer = str(ws.char_tokenizer())
    stores = {
        "small": ws.random_store(ws.sizes.small_tokens, "scale-small"),
        "large": ws.random_store(ws.sizes.large_tokens, "scale-large"),
    }
    seconds: dict[str, list[float]] = {k: [] for k in stores}
    after: dict[str, list[float]] = {k: [] for k in stores}  # seconds after the imports
    peak: dict[str, list[float]] = {k: [] for k in stores}
    for r in range(rounds):
        for name in rotated(list(stores), r):
            out_dir = ws.root / "scale-runs" / f"{name}-{r}"
            config = run_config(
                {"dataset": stores[name]["prefix"], "tokenizer": tokenizer, "eval_split": 8},
                {"output_dir": str(out_dir), "max_steps": 1, "per_device_train_batch_size": 8},
            )
            out = run_child("first_step", {"config": config, "threads": threads})
            seconds[name].append(out["seconds"])
            after[name].append(out["seconds"] - out["imports"])
            peak[name].append(out["peak_rss_kib"] * 1024 / 1e6)
            print(f"  round {r + 1} {name}: {out['seconds']:.2f} s to the first step, peak RSS "
                  f"{peak[name][-1]:.0f} MB (ru_maxrss {out['ru_maxrss_kib'] * 1024 / 1e6:.0f} "
                  "MB)", flush=True)  # fmt: skip

    lines = [
        "| store | tokens | documents | .bin | time to first step s | min-max | of which after "
        "imports s | min-max | peak RSS MB | min-max |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, info in stores.items():
        t, t_spread = median_spread(seconds[name])
        u, u_spread = median_spread(after[name])
        m, m_spread = median_spread(peak[name], "{:.0f}")
        lines.append(
            f"| {name} | {info['tokens']:,} | {info['documents']:,} | "
            f"{info['bin_bytes'] / 1e6:,.0f} MB | {t} | {t_spread} | {u} | {u_spread} | {m} "
            f"| {m_spread} |"
        )
    ratios = [b / s for b, s in zip(seconds["large"], seconds["small"])]
    diffs = [b - s for b, s in zip(peak["large"], peak["small"])]
    ratio, ratio_spread = median_spread(ratios, "{:.2f}x")
    after_ratio = median_spread([b / s for b, s in zip(after["large"], after["small"])], "{:.2f}x")
    diff, diff_spread = median_spread(diffs, "{:+.0f}")
    ratio_met = "met" if statistics.median(ratios) <= 1.2 else "**missed**"
    diff_met = "met" if statistics.median(diffs) <= 100 else "**missed**"
    scale = stores["large"]["tokens"] / stores["small"]["tokens"]
    return "\n".join(
        [
            "## 3. Start-up time and peak memory vs corpus size",
            "",
            *lines,
            "",
            f"{scale:.0f}x the tokens: time to the first step {ratio} (per-round min-max "
            f"{ratio_spread}; target <= 1.2x: {ratio_met}), after the imports {after_ratio[0]} "
            f"({after_ratio[1]}); peak RSS {diff} MB (min-max {diff_spread}; target <= 100 MB: "
            f"{diff_met}).",
            "",
            "Method: stores of uint16 ids drawn at random below the char tokenizer's "
            "vocabulary, documents of 200-3000 tokens, written with `IndexedWriter` in chunks "
            "(sidecar with the tokenizer's fingerprint and vocabulary size). Per round and "
            "store a fresh subprocess starts its clock on its first line, before importing "
            "unmask or torch, builds `Trainer` (quickstart model, char tokenizer from a saved "
            "folder, packing_length 256, 8 rows per step, eval_split 8 documents, max_steps 1, "
            f"torch on {threads} thread(s)), runs one `train_step` and reports the elapsed "
            "seconds (and those after its imports: building the trainer, the first batch "
            "and step) and its peak RSS (VmHWM of /proc/self/status; `ru_maxrss` is not used: "
            "Linux carries it over the exec from the spawning process, so it would report the "
            "benchmark process's own peak). Peak RSS counts the pages of the memory-mapped "
            "store the process touched. MB = 10^6 bytes.",
            "",
        ]
    )


# ----------------------------------------------------------------- part 4: resume vs start


def _stream_position(shards: Path, tokens: int) -> str:
    """Where a char-tokenized stream (one token per character, EOS after each document) is
    after `tokens` training tokens, its eval hold-out documents skipped: shard and document."""
    from unmask.data.build import stream_eval_count

    held = stream_eval_count(0.05)  # data.eval_split's default, which part 4 keeps
    seen = 0
    files = sorted(shards.glob("*.jsonl"))
    for i, shard in enumerate(files):
        sizes = [len(json.loads(line)["text"]) + 1 for line in shard.open()]
        for j, size in enumerate(sizes):
            if held:
                held -= 1
                continue
            seen += size
            if seen >= tokens:
                return (f"{tokens:,} tokens in, in document {j + 1} of {len(sizes)} of shard "
                        f"{i + 1} of {len(files)}")  # fmt: skip
    return f"{tokens:,} tokens in, past the end of the stream (a second epoch)"


def part_resume(ws: Workspace, rounds: int, threads: int) -> str:
    print("part 4: resume vs start", flush=True)
    import torch

    from unmask.config import validate_tree
    from unmask.train.trainer import Trainer

    torch.set_num_threads(threads)
    n = ws.sizes.resume_steps
    tokenizer = str(ws.char_tokenizer())
    corpus = ws.loader_corpus()
    store = ws.random_store(ws.sizes.small_tokens, "scale-small")
    kinds = {
        f"token store, {store['tokens'] / 1e6:.0f}M tokens": {"dataset": store["prefix"]},
        "stream, 4 jsonl shards": {"dataset": corpus["shards"], "streaming": True},
    }
    common = {"max_steps": 2 * n, "per_device_train_batch_size": 8}
    runs = {}
    for kind, data in kinds.items():
        run_dir = ws.root / "resume" / f"{len(runs)}-run"
        config = run_config({"tokenizer": tokenizer, **data},
                            {**common, "output_dir": str(run_dir), "max_steps": n,
                             "save_steps": n, "eval_max_batches": 1})  # fmt: skip
        started = time.perf_counter()
        trainer = Trainer(validate_tree(config))
        trainer.train()
        runs[kind] = run_dir
        print(f"  {kind}: trained {trainer.step} steps, checkpoint-{n} "
              f"({time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip
        del trainer
    where = _stream_position(Path(corpus["shards"]), n * 8 * 256)

    seconds: dict[tuple, list[float]] = {(k, m): [] for k in kinds for m in ("start", "resume")}
    after = {key: [] for key in seconds}  # seconds after the imports
    imports = []
    for r in range(rounds):
        for kind, mode in rotated(list(seconds), r):
            out_dir = ws.root / "resume" / f"{list(kinds).index(kind)}-{mode}-{r}"
            train = {**common, "output_dir": str(out_dir)}
            if mode == "resume":
                shutil.copytree(runs[kind], out_dir)
                train["resume_from_checkpoint"] = str(out_dir / f"checkpoint-{n}")
            config = run_config({"tokenizer": tokenizer, **kinds[kind]}, train)
            out = run_child("first_step", {"config": config, "threads": threads})
            expected = n if mode == "resume" else 0
            if out["start_step"] != expected:
                raise RuntimeError(f"{kind} {mode}: started at step {out['start_step']}")
            seconds[(kind, mode)].append(out["seconds"])
            after[(kind, mode)].append(out["seconds"] - out["imports"])
            imports.append(out["imports"])
            print(f"  round {r + 1} {kind}, {mode}: {out['seconds']:.2f} s to the first step",
                  flush=True)  # fmt: skip

    lines = [
        "| source | (a) fresh start s | min-max | (b) resume s | min-max | b/a | min-max "
        "| target b/a <= 1 | after imports: (a) s | (b) s | b/a | min-max |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind in kinds:
        start, resume = seconds[(kind, "start")], seconds[(kind, "resume")]
        ratios = [b / a for a, b in zip(start, resume)]
        a, a_spread = median_spread(start)
        b, b_spread = median_spread(resume)
        ratio, ratio_spread = median_spread(ratios, "{:.2f}x")
        met = "met" if statistics.median(ratios) <= 1.0 else "**missed**"
        start_after, resume_after = after[(kind, "start")], after[(kind, "resume")]
        after_ratio = median_spread([b / a for a, b in zip(start_after, resume_after)], "{:.2f}x")
        lines.append(f"| {kind} | {a} | {a_spread} | {b} | {b_spread} | {ratio} "
                     f"| {ratio_spread} | {met} | {statistics.median(start_after):.2f} "
                     f"| {statistics.median(resume_after):.2f} | {after_ratio[0]} "
                     f"| {after_ratio[1]} |")  # fmt: skip
    middle = {key: statistics.median(values) for key, values in after.items()}
    extra = ", ".join(f"{k} {middle[(k, 'resume')] - middle[(k, 'start')]:+.2f} s" for k in kinds)
    return "\n".join(
        [
            "## 4. Resume vs start",
            "",
            *lines,
            "",
            f"Resume minus fresh start, medians after the imports: {extra}. The imports alone "
            f"(torch, unmask) took {min(imports):.2f}-{max(imports):.2f} s across these "
            f"children: differences in the totals below that {max(imports) - min(imports):.2f} "
            "s spread are within the imports' jitter; the after-imports columns isolate what "
            "start and resume do differently.",
            "",
            f"Method: one `Trainer.train()` run per source (quickstart model, char tokenizer, "
            f"packing_length 256, 8 rows per step, 0 loader workers) saves checkpoint-{n}; "
            "then per round fresh subprocesses time, from their first line to the first "
            "`train_step` returning (and from the end of its imports: building the trainer, "
            "restoring the checkpoint, the first batch and step), (a) a fresh start into an "
            f"empty output_dir and (b) a resume from checkpoint-{n} of a copy of the run dir "
            f"(same config, max_steps {2 * n}). The stream's checkpoint lies {where}: on "
            "resume, datasets re-reads that shard's Arrow tables up to the saved example index "
            "(skipping whole tables without decoding them to Python) instead of seeking; a "
            "resume also loads model, optimizer and RNG state, which a fresh start does not. "
            "The fresh start of the stream also reads its first documents for the eval "
            "hold-out, as the resume does.",
            "",
        ]
    )


# ------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: small sizes, 1 round")
    parser.add_argument("--parts", default="1,2,3,4", help="comma-separated parts to run")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--keep", action="store_true", help="keep the temporary files")
    parser.add_argument("--out", type=Path, default=None, help="folder for temporary files")
    parser.add_argument("--results", type=Path, default=None,
                        help=f"report path (default {RESULTS.relative_to(REPO)}; none with "
                        "--quick)")  # fmt: skip
    parser.add_argument("--child", nargs=2, metavar=("KIND", "SPEC"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, spec = args.child
        print(json.dumps(CHILDREN[kind](json.loads(spec))), flush=True)
        return

    os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "1"
    sizes = QUICK if args.quick else FULL
    rounds = args.rounds or (1 if args.quick else 3)
    parts = sorted({int(p) for p in args.parts.split(",")})
    base = args.out or Path(tempfile.mkdtemp(prefix="unmask-data-bench-"))
    ws = Workspace(base / "work", sizes)
    load_before = load_average()
    print(f"{machine(*PACKAGES)}; {rounds} round(s); temporary files in {ws.root}", flush=True)
    sections = []
    runners = {
        1: lambda: part_preprocess(ws, rounds),
        2: lambda: part_loader(ws, rounds, args.threads),
        3: lambda: part_scale(ws, rounds, args.threads),
        4: lambda: part_resume(ws, rounds, args.threads),
    }
    try:
        for part in parts:
            started = time.perf_counter()
            sections.append(runners[part]())
            print(f"  part {part}: {time.perf_counter() - started:.0f} s", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(ws.root, ignore_errors=True)
            if args.out is None:
                shutil.rmtree(base, ignore_errors=True)
    wall = time.perf_counter() - _STARTED
    header = [
        "# Data pipeline: preprocessing, loader wait, start-up at scale, resume",
        "",
        f"Written by `benchmarks/data.py{' --quick' if args.quick else ''}` on "
        f"{machine(*PACKAGES)}; "
        f"parts {','.join(map(str, parts))}, {rounds} interleaved round(s), {wall / 60:.1f} "
        f"minutes in all; load average {load_before} before, {load_average()} after. Medians "
        "with the min-max spread over rounds; ratios are per round, against a reference "
        "measured in the same round.",
        "",
    ]
    text = "\n".join(header + sections)
    publish(text, args.results or (None if args.quick else RESULTS))


if __name__ == "__main__":
    main()

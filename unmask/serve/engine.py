"""Continuous batching for `unmask serve`: one scheduler thread decodes a block at a time for
the requests being served, and requests join and leave between blocks.

A masked-diffusion answer is decoded block by block (sampling/generate.py); everything a
block's steps need is the canvas at its start: the prompt, the finished blocks and masks
for the current and later blocks. So the scheduler keeps, per request, only its prompt,
its finished blocks and its sampling config, and runs each block with the sampler's own
block decoder (the config's `BlockDecoder` on a `Canvas`, sampling/decoders.py: the code
`sample`, hence `unmask generate`, runs, no copy; one registered from outside the package
too). Rows of one block call may be at different blocks of different answers:
each row is laid out [left padding | prompt + finished blocks | current block | later
masks | right padding], aligned on the current block (with block_origin request a row's
blocks are counted from its prompt's first token, so its first block starts with the
prompt's tail: `_block_parts`), and padding is masked out of
attention with position ids counted over real tokens, as `sample` does for left-padded
prompts. Requests whose options change a block's steps (block length, steps per block,
remasking, threshold, temperature, ...) are decoded in separate calls, taken in turn.

Greedy rows give the tokens `unmask generate` gives for the prompt alone (batch
invariance: tests/integration/test_serve.py). A request with a `seed` owns its generator,
so it draws exactly what `unmask generate --seed` draws: a block row with one is decoded
alone, a canvas row joins its group (below). gen_length `auto` (a growing canvas), a
decoder that is not a block decoder (a `WholeDecoder`: left_to_right, blocks_from_start)
and joint_threshold with edit_scope all (it edits finished blocks) are decoded by
`sample` in one piece, alone.

DiffusionGemma's rows (decoder entropy_bound; any decoder declaring `serves_by_canvas`,
each canvas by its own `serve_canvas`) join and leave between canvases instead of blocks
(canvases.py): a row's prompt, pictures included, is encoded once when it joins, and each
turn denoises one canvas for every row of its group, seeded rows too (each row draws from
its own generator).

Prefix cache (`PrefixCache`, `--prefix-cache-mb`): the first forward of a prompt's first
block sees [prompt | masks], a canvas the prompt and a few options decide, so its result
(the block's logits and, with a cache mode, the K/V the forward stores) is kept, keyed by
the model, the prompt's tokens and every option that reaches the forward, and a request
with the same key reuses it instead of computing it (a row of a block call that repeats
another row's key copies that row's). Nothing after that forward is reused: every later
step sees answer tokens, and for a bidirectional model they change the prompt's K/V too.

Threads (`--threads`, `--one-thread-below`, `--ignore-load`): on a CPU a forward that
feeds few positions (one request's canvas) runs faster on one torch thread than on two
(OpenMP's start-up and barriers cost more than the split saves), while a batch's forward is
compute-bound and gains from every idle core. So with `threads` > 1 each forward that feeds
fewer than `one_thread_below` positions (rows x columns) runs on one thread and the others
on `threads`, or on as many as there are cores idle of other work (re-measured every
second): a thread that waits at OpenMP's barrier for a peer descheduled by another
process stalls the whole forward (docs/serving.md, Threads). Thread counts change how long
a forward takes, not what it returns: tests/unit/test_serve_engine.py pins the tokens of
two threads to one thread's.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from unmask.models.diffusion_gemma_vision import Images
from unmask.parallel.threads import IdleCores
from unmask.sampling.config import SamplingConfig
from unmask.sampling.decoders import decoder_class, decodes_by_block
from unmask.sampling.generate import (
    Canvas,
    GenerationOutput,
    canvas_blocks,
    end_of_turn_id,
    sample,
    special_ids,
)
from unmask.sampling.texts import SamplingModel, before_eos
from unmask.serve.canvases import append_canvas, run_canvas, start_row

#: SamplingConfig fields that do not change how one block is decoded (lengths: per row)
_PER_ROW = ("gen_length", "row_length", "steps", "gen_length_max", "auto_eos_threshold")


#: SamplingConfig fields that act only on the logits a forward returns (proposals,
#: confidences, commits) or on later steps: a block's first forward does not depend on them,
#: so the prefix cache's key leaves them out. Every other field is in the key (a new field
#: too, until it is listed here).
_AFTER_FORWARD = ("temperature", "top_p", "top_k", "eos_penalty", "logits_eos_inf",
                  "confidence_eos_eot_inf", "remasking", "schedule", "eps", "alg_temp",
                  "threshold", "sub_block_length", "factor", "cache_refresh", "ddpm_cache",
                  "steps", "row_length", "gen_length_max", "auto_eos_threshold",
                  "edit_threshold", "max_post_edit_steps", "penalty_lambda",
                  "joint_preset", "edit_scope", "block_steps", "minimal_topk", "fill_rule",
                  "eos_early_stop", "multinomial_draws")  # fmt: skip


@dataclass
class FirstForward:
    """What the first forward of a prompt's first block gives one row: the block's logits
    (Lb, V) and, with a cache mode, each layer's (K, V) of the row's real positions
    ((1, or 2 with CFG's unconditional row, Hkv, span, D)); None without."""

    logits: torch.Tensor
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None

    @property
    def nbytes(self) -> int:
        """Bytes the entry keeps alive: the whole storage under each tensor (a view of a
        bigger tensor holds all of it), each storage once. Made under inference mode, the
        tensors hold no autograd graph (its activations would be the bulk otherwise)."""
        tensors = [self.logits, *(t for pair in self.kv or [] for t in pair)]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(storages.values())


class PrefixCache:
    """Least-recently-used `FirstForward`s, at most `max_bytes` in all (an entry larger than
    that is not kept). Counters for /metrics: hits (a row reused a result: from the cache
    or from another row of its block call), misses (a row computed it), evictions."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple, FirstForward] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = self.evictions = 0

    def get(self, key: tuple) -> FirstForward | None:
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    @staticmethod
    def size(key: Any, entry: FirstForward) -> int:
        """The bytes an entry costs: its tensors' storages and its key (the prompt's
        token ids as a tuple of Python ints, the options' JSON)."""
        return entry.nbytes + _object_bytes(key)

    def put(self, key: tuple, entry: FirstForward) -> None:
        size = self.size(key, entry)
        if size > self.max_bytes:
            return
        old = self.entries.pop(key, None)
        if old is not None:
            self.bytes -= self.size(key, old)
        while self.bytes + size > self.max_bytes:
            dropped_key, dropped = self.entries.popitem(last=False)
            self.bytes -= self.size(dropped_key, dropped)
            self.evictions += 1
        self.entries[key] = entry
        self.bytes += size

    def __len__(self) -> int:
        return len(self.entries)


def _object_bytes(value: Any) -> int:
    """Bytes of a key made of tuples, strings and ints (each int counted as its own object,
    an upper bound: small ints are shared)."""
    if isinstance(value, tuple):
        return sys.getsizeof(value) + sum(_object_bytes(item) for item in value)
    return sys.getsizeof(value)


class Threaded:
    """`model` called with `threads` torch threads for a forward that feeds at least
    `one_thread_below` positions (rows x columns: guidance's unconditional rows count) and
    with one thread for a smaller one (0: always `threads`). With `idle` (a callable: the
    cores idle of other work now, or None: unknown), a big forward takes no more threads
    than that rounds to (at least 1). Attributes are the model's. torch.set_num_threads
    sets the calling thread's count (the engine's thread here)."""

    def __init__(self, model: torch.nn.Module, threads: int, one_thread_below: int,
                 idle: Callable[[], float | None] | None = None):  # fmt: skip
        self.model, self.threads, self.one_thread_below = model, threads, one_thread_below
        self.idle = idle
        self.calls: dict[int, int] = {}  # forwards by thread count (tests, /metrics)

    def threads_for(self, positions: int) -> int:
        if self.threads == 1 or positions < self.one_thread_below:
            return 1
        idle = None if self.idle is None else self.idle()
        return self.threads if idle is None else max(1, min(self.threads, round(idle)))

    def __call__(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        threads = self.threads_for(input_ids.numel())
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        self.calls[threads] = self.calls.get(threads, 0) + 1
        return self.model(input_ids, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["model"], name)


class QueueFull(Exception):
    """The queue holds its bound of requests (HTTP 429)."""


def _block_parts(job: Job, block: int) -> tuple[list[int], list[int], int]:
    """A job's current block call: (the tokens before the block, the tokens the block
    starts with, the masks after it). block_origin answer: the prompt and the finished
    blocks, nothing, the rest of gen_length; request: blocks counted from the prompt's first
    token, so the first holds the prompt's tail, and the canvas ends on the block boundary
    at or after prompt + gen_length (sampling/layout.py)."""
    cfg, tokens = job.config, job.prompt_ids + job.answer
    if cfg.block_origin == "answer":
        return tokens, [], cfg.gen_length - (job.block + 1) * block
    length = len(job.prompt_ids)
    begin = (length // block + job.block) * block
    total = -(-(length + cfg.gen_length) // block) * block
    return tokens[:begin], tokens[begin:], total - begin - block


class Draining(Exception):
    """The server is shutting down and takes no new request (HTTP 503)."""


@dataclass
class Job:
    """One prompt being answered. `emit(event)` is called from the scheduler thread with
    dicts: {"type": "block", "text": new text, maybe ""} after each finished block, {"type": "step",
    "canvas": [...]} after each step when `trace`, then {"type": "done", ...} or {"type":
    "error", "message": ...}."""

    prompt_ids: list[int]
    config: SamplingConfig
    emit: Callable[[dict[str, Any]], None]
    stops: tuple[str, ...] = ()
    seed: int | None = None
    trace: bool = False
    answer: list[int] = field(default_factory=list)  # tokens of the finished blocks
    block: int = 0
    sent: str = ""  # text already emitted in block events
    cancelled: bool = False
    served: float = 0.0  # when its last block was decoded (turns between groups)
    generator: torch.Generator | None = None
    forwards: int = 0
    edits: int = 0  # tokens of its answer the decoder replaced (joint_threshold's edits)
    notices: tuple[str, ...] = ()  # what the request's options were taken as (protocol.py)
    images: Images | None = None  # its pictures' patches (sampling/images.py)
    state: Any = None  # a canvas row's K/V and generator between canvases (canvases.py)

    def __post_init__(self):
        if self.seed is not None:
            self.generator = torch.Generator().manual_seed(self.seed)

    @property
    def by_canvas(self) -> bool:
        """Decoded canvas by canvas with other rows (canvases.py), each canvas by the
        decoder's own `serve_canvas`: a decoder that declares `serves_by_canvas`
        (entropy_bound: DiffusionGemma)."""
        return getattr(decoder_class(self.config), "serves_by_canvas", False)

    @property
    def auto(self) -> bool:
        """Decoded by `sample` in one piece: gen_length auto, a decoder that is not a
        block decoder (nor served by canvas), or joint_threshold's edit_scope all (its steps
        edit finished blocks, which the block calls keep as they were)."""
        if self.by_canvas:
            return False
        return (self.config.gen_length == "auto" or not decodes_by_block(self.config)
                or self.config.edit_scope == "all")  # fmt: skip

    @cached_property
    def group(self) -> tuple:
        """Rows with the same group share block calls (canvas rows: canvas calls; a seed
        is the row's own generator's there)."""
        if self.by_canvas:
            return ("canvas", *sorted(self.config.model_dump(exclude=set(_PER_ROW)).items()))
        if self.seed is not None or self.auto:
            return ("alone", id(self))
        options = self.config.model_dump(exclude=set(_PER_ROW))
        spb = self.config.steps_per_block()
        return (self.config.resolved_block_length, spb, *sorted(options.items()))


@dataclass
class Stats:
    """Counters for /metrics (read without the lock: plain ints and floats)."""

    requests: dict[str, int] = field(default_factory=dict)  # by outcome
    forwards: int = 0  # model forward calls
    row_forwards: int = 0  # forward calls times rows in them
    decoded: int = 0  # positions committed
    tokens: int = 0  # answer tokens returned (before EOS / stop)
    blocks: int = 0  # block calls
    saved_row_forwards: int = 0  # rows whose first forward the prefix cache gave
    prompts_encoded: int = 0  # canvas rows' prompts through the encoder (once per prompt)
    pictures_encoded: int = 0  # their pictures through the vision tower
    busy_seconds: float = 0.0
    started: float = field(default_factory=time.time)
    recent: deque = field(default_factory=lambda: deque(maxlen=256))  # (time, tokens)

    def count(self, outcome: str) -> None:
        self.requests[outcome] = self.requests.get(outcome, 0) + 1

    def tokens_per_second(self, window: float = 10.0) -> float:
        """Answer tokens finished in the last `window` seconds, per second."""
        now = time.time()
        return sum(n for t, n in list(self.recent) if now - t <= window) / window


class Engine:
    """The scheduler: `submit` queues a Job (QueueFull past `max_queue` waiting, Draining
    after `close`); a thread admits waiting jobs up to `max_batch` at each block boundary,
    decodes one block for one group, and drops finished and cancelled jobs.
    prefix_cache_bytes: the bound of the `PrefixCache` (0: none, every forward computed).
    threads: torch threads of a forward (None: torch's count when the engine is made);
    one_thread_below: forwards that feed fewer positions run on one thread (`Threaded`;
    0: every forward on `threads`); watch_load: the others on no more threads than there
    are cores idle of other work (`IdleCores`, re-measured every second)."""

    def __init__(self, sm: SamplingModel, max_batch: int = 32, max_queue: int = 64,
                 start: bool = True, prefix_cache_bytes: int = 0, threads: int | None = None,
                 one_thread_below: int = 0, watch_load: bool = False):  # fmt: skip
        self.sm, self.max_batch, self.max_queue = sm, max_batch, max_queue
        threads = threads or torch.get_num_threads()
        idle = IdleCores().idle if watch_load and threads > 1 else None
        self.model = Threaded(sm.model, threads, one_thread_below, idle)
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        # the cache is this engine's (one model); the key names the model all the same
        self.model_key = (id(sm.model), str(sm.device), sm.mask_id)
        self.eot_id = end_of_turn_id(sm.tokenizer)
        self.cond = threading.Condition()
        self.waiting: deque[Job] = deque()
        self.active: list[Job] = []
        self.closing = False
        self.stats = Stats()
        self.thread = threading.Thread(target=self._loop, name="unmask-serve", daemon=True)
        if start:  # start=False: a test drives run_block itself
            self.thread.start()

    # --------------------------------------------------------------------- the API side

    def submit(self, job: Job) -> None:
        with self.cond:
            if self.closing:
                raise Draining("the server is shutting down")
            free = max(0, self.max_batch - len(self.active))  # taken at the next block
            if len(self.waiting) >= self.max_queue + free:
                raise QueueFull(f"{len(self.waiting) - free} requests are waiting (the bound)")
            self.waiting.append(job)
            self.cond.notify()

    def cancel(self, job: Job) -> None:
        """The client is gone: the job leaves at the next block boundary."""
        job.cancelled = True
        with self.cond:
            if job in self.waiting:
                self.waiting.remove(job)
                self.stats.count("cancelled")

    def close(self, timeout: float = 30.0) -> None:
        """Refuse new jobs, finish the ones queued and running (up to timeout seconds)."""
        with self.cond:
            self.closing = True
            self.cond.notify()
        self.thread.join(timeout)

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    @property
    def running(self) -> int:
        return len(self.active)

    # ----------------------------------------------------------------- the scheduler side

    def _loop(self) -> None:
        # every forward of the server under inference mode: no autograd graph is built or
        # kept (a cached result would hold its forward's activations), and it is faster
        with torch.inference_mode():
            self._serve()

    def _serve(self) -> None:
        while True:
            with self.cond:
                while not self.waiting and not self.active and not self.closing:
                    self.cond.wait()
                if self.closing and not self.waiting and not self.active:
                    return
                while self.waiting and len(self.active) < self.max_batch:
                    self.active.append(self.waiting.popleft())
                for job in [j for j in self.active if j.cancelled]:
                    self.active.remove(job)
                    self.stats.count("cancelled")
                if not self.active:
                    continue
                first = min(self.active, key=lambda j: j.served)  # the longest unserved
                rows = [j for j in self.active if j.group == first.group]
            started = time.perf_counter()
            try:
                if first.auto:
                    self._run_whole(first)
                elif first.by_canvas:
                    self.run_canvas(rows)
                else:
                    self.run_block(rows)
            except Exception as err:  # a bad option the checks missed: those rows fail
                for job in rows:
                    job.emit({"type": "error", "message": f"{type(err).__name__}: {err}"})
                    job.block = -1
                    self.stats.count("failed")
            self.stats.busy_seconds += time.perf_counter() - started
            with self.cond:
                now = time.perf_counter()
                for job in rows:
                    job.served = now
                self.active = [j for j in self.active if j.block >= 0]

    def run_block(self, rows: list[Job]) -> None:
        """Decode the current block of every row (one group) with the sampler's decoder."""
        sm, cfg = self.sm, rows[0].config
        block = cfg.resolved_block_length
        steps_per_block = cfg.steps_per_block()
        # each row: the tokens before its block, the block's head (block_origin request: the
        # prompt's tail in the first block), the masks after the block
        parts = [_block_parts(job, block) for job in rows]
        start = max(len(prefix) for prefix, _, _ in parts)  # the block's first column
        width = start + block + max(after for _, _, after in parts)
        x = torch.full((len(rows), width), sm.pad_id, dtype=torch.long)
        valid = torch.zeros((len(rows), width), dtype=torch.bool)
        in_prompt = torch.zeros_like(valid)
        answer = torch.zeros_like(valid)  # each row's answer columns (eos_early_stop)
        for row, (job, (prefix, head, after)) in enumerate(zip(rows, parts)):
            left = start - len(prefix)
            x[row, left:start] = torch.tensor(prefix, dtype=torch.long)
            x[row, start : start + len(head)] = torch.tensor(head, dtype=torch.long)
            x[row, start + len(head) : start + block + after] = sm.mask_id
            valid[row, left : start + block + after] = True
            in_prompt[row, left : left + len(job.prompt_ids)] = True
            answer[row, left + len(job.prompt_ids) : start + block + after] = True
        heads = [len(head) for _, head, _ in parts]
        later = [after for _, _, after in parts]
        blocks = None
        if cfg.block_causal:  # a row's blocks are these shifted by its block index
            blocks = canvas_blocks(start, width - start, block, sm.device)
        canvas = Canvas(x.to(sm.device), valid.to(sm.device), in_prompt.to(sm.device),
                         sm.mask_id, cfg.cfg_scale, cfg.cache, blocks)  # fmt: skip
        special = special_ids(cfg, sm.eos_id, sm.pad_id, self.eot_id)
        decoder = decoder_class(cfg)(cfg, self.model, canvas, start, start + block,
                                     steps_per_block, sm.mask_id, special)  # fmt: skip
        if cfg.eos_early_stop and sm.eos_id is not None:
            decoder.stop_at_eos(sm.eos_id, answer.to(sm.device))
        keys = [self.prefix_key(job) for job in rows]
        saved = {"calls": 0, "rows": 0}  # forwards the prefix cache gave
        if any(key is not None for key in keys):

            def first_forward(store: bool, columns: slice) -> torch.Tensor:
                return self._first_forward(canvas, decoder.visible, keys, store, columns, saved)

            decoder.first_forward = first_forward
        out = GenerationOutput(x, start)
        traced = [row for row, job in enumerate(rows) if job.trace]
        decoder.trace = bool(traced)
        for step in range(decoder.max_steps):
            before = canvas.x[:, start : start + block].clone() if decoder.edits_tokens else None
            if not decoder.step(step, rows[0].generator, out):
                break
            if before is not None:  # a token replaced by another: an edit, counted per row
                now = canvas.x[:, start : start + block]
                edited = ((before != sm.mask_id) & (now != before)).sum(1).tolist()
                for job, count in zip(rows, edited):
                    job.edits += count
            for row in traced:
                current = canvas.x[row, start + heads[row] : start + block + later[row]].tolist()
                proposals = {}  # a decoder that keeps none (a registered one may not)
                if decoder.proposed is not None:
                    proposals = self._proposals(decoder, row, rows[row], later[row], heads[row])
                rows[row].emit({"type": "step", "canvas": rows[row].answer + current,
                                **proposals})  # fmt: skip
        out.nfe -= saved["calls"]  # the decoder counted the step-0 forward it asked for
        out.row_forwards -= saved["rows"]
        self.stats.saved_row_forwards += saved["rows"]
        self.stats.forwards += out.nfe
        self.stats.row_forwards += out.row_forwards
        self.stats.decoded += out.decoded
        self.stats.blocks += 1
        finished = canvas.x[:, start : start + block].tolist()
        for job, tokens, head in zip(rows, finished, heads):
            job.forwards += out.nfe
            job.answer += tokens[head:]
            job.block += 1
            full = len(job.answer) >= job.config.gen_length
            job.answer = job.answer[: job.config.gen_length]  # request origin: past the end
            ended = sm.eos_id is not None and sm.eos_id in job.answer
            self._advance(job, ended or full)

    @staticmethod
    def _proposals(decoder, row: int, job: Job, after: int, head: int = 0) -> dict[str, list]:
        """A traced step's proposals, aligned with its canvas: the token proposed at each
        position of the block that was masked before the step and its probability (None
        elsewhere: the finished blocks, the masks after the block); head: the block's
        first positions that are the prompt's (block_origin request), left out."""
        before = [None] * len(job.answer)
        tokens = decoder.proposed[row, head:].tolist()
        probs = decoder.proposal_p[row, head:].tolist()
        proposed = [t if p == p else None for t, p in zip(tokens, probs)]  # NaN: was not a mask
        probability = [round(p, 4) if p == p else None for p in probs]
        return {
            "proposed": before + proposed + [None] * after,
            "probability": before + probability + [None] * after,
        }

    def prefix_key(self, job: Job) -> tuple | None:
        """The prefix cache's key of a job's first forward, None when it is not cached (no
        cache, a block after the first, hooks (code: no key), a decoder decoding alone)."""
        cfg = job.config
        if self.prefix_cache is None or job.answer or job.block:
            return None
        if cfg.logits_hook or cfg.tokens_hook or job.auto:
            return None
        options = json.dumps(cfg.model_dump(exclude=set(_AFTER_FORWARD)), sort_keys=True)
        return (self.model_key, tuple(job.prompt_ids), options)

    def _first_forward(self, canvas: Canvas, visible: int, keys: list, store: bool,
                       columns: slice, saved: dict) -> torch.Tensor:  # fmt: skip
        """The block call's step-0 logits (B, Lb, V) (`columns` of the full forward), the
        K/V in canvas.cache when `store`: rows with a cached key take the cache's, rows that
        repeat an earlier row's key copy it, the others are computed (one forward for them)
        and their results cached."""
        cache, batch = self.prefix_cache, canvas.x.shape[0]
        given: dict[int, FirstForward] = {}
        computes: dict[tuple, int] = {}  # key -> the row of this call that computes it
        copies: dict[int, int] = {}
        computed = []
        for row, key in enumerate(keys):
            entry = None if key is None else cache.get(key)
            if entry is not None:
                given[row] = entry
            elif key is not None and key in computes:
                copies[row] = computes[key]
            else:
                computed.append(row)
                if key is not None:
                    computes[key] = row
        cache.hits += len(given) + len(copies)
        cache.misses += len(computes)
        logits: list[torch.Tensor | None] = [None] * batch
        sub = canvas
        if computed:
            if len(computed) < batch:  # a canvas of the rows computed
                idx = torch.tensor(computed, device=canvas.x.device)
                sub = Canvas(canvas.x[idx], canvas.valid[idx], canvas.prompt_valid[idx],
                              canvas.mask_id, canvas.cfg_scale, "prefix" if store else "none",
                              canvas.blocks)  # fmt: skip
            part = sub.forward(self.model, 0, visible, store, visible)[:, columns]
            for i, row in enumerate(computed):
                logits[row] = part[i]
            for key, row in computes.items():
                i = computed.index(row)
                kv = self._row_kv(sub, i, canvas.valid[row, :visible]) if store else None
                entry = FirstForward(part[i].clone(), kv)
                cache.put(key, entry)
                given.update({r: entry for r, source in copies.items() if source == row})
        else:
            saved["calls"] += 1
        saved["rows"] += batch - len(computed)
        for row, entry in given.items():
            logits[row] = entry.logits
        if store and len(computed) < batch:
            self._splice_kv(canvas, sub, computed, given, visible)
        return torch.stack(logits)

    @staticmethod
    def _row_kv(sub: Canvas, i: int, valid: torch.Tensor) -> list:
        """Row i's K/V (with CFG its unconditional row too) over its real positions."""
        left, span = int(valid.long().argmax()), int(valid.sum())
        rows = [i, i + sub.x.shape[0]] if sub.cfg_scale > 0 else [i]
        return [(k[rows, :, left : left + span], v[rows, :, left : left + span])  # copies
                for k, v in zip(sub.cache.keys, sub.cache.values)]  # fmt: skip

    @staticmethod
    def _splice_kv(canvas: Canvas, sub: Canvas, computed: list[int],
                   given: dict[int, FirstForward], visible: int) -> None:  # fmt: skip
        """canvas.cache: the computed rows' K/V (sub's) and the given rows' at their real
        positions (padding: zeros, which no real position attends)."""
        batch, guided = canvas.x.shape[0], canvas.cfg_scale > 0
        both = lambda rows: rows + [r + batch for r in rows] if guided else rows  # noqa: E731
        template = next(iter(given.values())).kv
        keys, values = [], []
        for layer, (k0, v0) in enumerate(template):
            k = k0.new_zeros((len(both([0])) * batch, k0.shape[1], visible, k0.shape[3]))
            v = v0.new_zeros((k.shape[0], v0.shape[1], visible, v0.shape[3]))
            if computed:
                k[both(computed)] = sub.cache.keys[layer]
                v[both(computed)] = sub.cache.values[layer]
            for row, entry in given.items():
                valid = canvas.valid[row, :visible]
                left, span = int(valid.long().argmax()), int(valid.sum())
                ek, ev = entry.kv[layer]
                assert ek.shape[2] == span, (ek.shape, span)  # the key fixes the layout
                k[both([row]), :, left : left + span] = ek
                v[both([row]), :, left : left + span] = ev
            keys.append(k)
            values.append(v)
        canvas.cache.keys, canvas.cache.values = keys, values

    def run_canvas(self, rows: list[Job]) -> None:
        """Denoise the next canvas of every row (one group; canvases.py): a row new to the
        batch has its prompt and pictures encoded first, once."""
        sm = self.sm
        for job in rows:
            if job.state is None:
                job.state = start_row(sm.model, job.prompt_ids, job.images, job.generator,
                                      sm.device)  # fmt: skip
                self.stats.prompts_encoded += 1
                if job.images is not None:
                    self.stats.pictures_encoded += job.images.pixel_values.shape[0]
        states = [job.state for job in rows]
        traced = [row for row, job in enumerate(rows) if job.trace]
        placeholder = next((i for i in (sm.mask_id, sm.pad_id) if i is not None), 0)
        nan = float("nan")

        def show(argmax: torch.Tensor, probability: torch.Tensor) -> None:
            for row in traced:
                job = rows[row]
                gen = job.config.gen_length
                canvas = (job.answer + argmax[row].tolist())[:gen]
                shown = (job.state.probability + probability[row].tolist())[:gen]
                rest = [placeholder] * (gen - len(canvas))
                job.emit({"type": "step", "canvas": canvas + rest,
                          "probability": [round(p, 4) if p == p else None
                                          for p in shown + [nan] * (gen - len(shown))]})  # fmt: skip

        canvas, joined = run_canvas(sm.model, states, rows[0].config, show if traced else None)
        counts = joined[2]
        self.stats.forwards += counts.nfe
        self.stats.row_forwards += counts.row_forwards
        self.stats.blocks += 1
        stops = [i for i in (sm.eos_id, self.eot_id) if i is not None]
        fill = next((i for i in (sm.eos_id, self.eot_id, sm.pad_id) if i is not None), 0)
        keep = []
        for row, (job, tokens) in enumerate(zip(rows, canvas.tolist())):
            job.forwards += counts.nfe
            gen = job.config.gen_length
            new = tokens[: gen - len(job.answer)]
            stop = next((i for i, t in enumerate(new) if t in stops), None)
            if stop is not None:  # as `sample` writes it: the stop token, then the fill
                new = new[: stop + 1]
            self.stats.decoded += len(new)
            job.answer += new
            job.block += 1
            ended = stop is not None or len(job.answer) >= gen
            if ended:
                job.answer += [fill] * (gen - len(job.answer))
            self._advance(job, ended)
            if job.block < 0:  # ended: EOS, the canvas full, or a stop string (_advance)
                job.state = None  # its K/V go
            else:
                keep.append(row)
        append_canvas(sm.model, states, canvas, joined, keep)

    def _run_whole(self, job: Job) -> None:
        """A job decoded in one call of `sample` (`Job.auto`)."""
        sm = self.sm
        prompt_len = len(job.prompt_ids)

        def on_step(canvas: torch.Tensor, probability: torch.Tensor | None = None) -> None:
            event = {"type": "step", "canvas": canvas[0, prompt_len:].tolist()}
            if probability is not None:  # entropy_bound: each shown token's probability
                event["probability"] = [round(p, 4) if p == p else None
                                        for p in probability[0].tolist()]  # fmt: skip
            job.emit(event)

        on_step.wants_probability = True  # a decoder that can, passes them (entropy_bound)

        ids = torch.tensor([job.prompt_ids], device=sm.device)
        out = sample(self.model, ids, job.config, mask_id=sm.mask_id, eos_id=sm.eos_id,
                     generator=job.generator,
                     on_step=on_step if job.trace else None, pad_id=sm.pad_id,
                     eot_id=self.eot_id,
                     images=None if job.images is None else job.images.to(sm.device))  # fmt: skip
        self.stats.forwards += out.nfe
        self.stats.row_forwards += out.row_forwards
        self.stats.decoded += out.decoded
        job.forwards += out.nfe
        job.edits += out.edits
        job.answer = out.answers[0].tolist()
        self._advance(job, True)

    def _advance(self, job: Job, last: bool) -> None:
        """After a block: emit the new text (held back where a stop string may be starting),
        or the whole answer when it ended (EOS, a stop string, the canvas full)."""
        sm = self.sm
        answer = before_eos(job.answer, sm.eos_id)
        text = sm.tokenizer.decode(answer, skip_special_tokens=True)
        reason = "stop" if last and len(answer) < len(job.answer) else "length"
        cut = min((i for i in (text.find(s) for s in job.stops) if i >= 0), default=-1)
        if cut >= 0:
            text, last, reason = text[:cut], True, "stop"
        if not last:
            hold = max((len(s) - 1 for s in job.stops), default=0)
            ready = text[: len(text) - hold] if hold else text
            new = ""  # a block with no new text still says it finished
            if ready.startswith(job.sent) and len(ready) > len(job.sent):
                new, job.sent = ready[len(job.sent) :], ready
            job.emit({"type": "block", "text": new})
            return
        if text.startswith(job.sent) and len(text) > len(job.sent):
            job.emit({"type": "block", "text": text[len(job.sent) :]})
            job.sent = text
        tokens = len(answer)
        if cut >= 0:  # the text before the stop string, tokenized again
            tokens = len(sm.tokenizer(text, add_special_tokens=False)["input_ids"])
        self.stats.tokens += tokens
        self.stats.recent.append((time.time(), tokens))
        self.stats.count("finished")
        job.emit({"type": "done", "text": text, "finish_reason": reason, "tokens": tokens,
                  "prompt_tokens": len(job.prompt_ids), "forwards": job.forwards,
                  "edits": job.edits})  # fmt: skip
        job.block = -1  # leaves the batch

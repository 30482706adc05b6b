"""The serving engine's block calls (unmask/serve/engine.py), driven by hand: rows that join
at different times, so one forward pass holds rows at different blocks of answers of
different lengths, decode exactly what `sample` decodes for each prompt alone."""

import sys

import pytest
import torch
from conftest import save_tiny_model

from unmask.checkpoint import load_for_sampling
from unmask.sampling import SamplingConfig, sample
from unmask.sampling.texts import before_eos
from unmask.serve.engine import Engine, FirstForward, Job, PrefixCache, Threaded

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["rev 90417=", "a", "sort 31=", "add 12+7=", "rev 5="]
LENGTHS = [12, 8, 16, 4, 12]
JOIN_AT = [0, 0, 1, 2, 2]  # the block call before which each row joins


@pytest.fixture(scope="module")
def sm(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("engine") / "model", seed=1)
    return load_for_sampling(folder, device="cpu")


def alone(sm, prompt: str, config: SamplingConfig) -> list[int]:
    ids = torch.tensor([sm.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    out = sample(sm.model, ids, config, mask_id=sm.mask_id, eos_id=sm.eos_id, pad_id=sm.pad_id)
    return before_eos(out.answers[0].tolist(), sm.eos_id)


@pytest.mark.parametrize(
    "options",
    [
        dict(block_length=4),
        dict(block_length=4, threshold=0.3, cache="dual"),
        dict(block_length=4, cfg_scale=1.0),
        dict(block_length=4, remasking="entropy", schedule="dream", cache="prefix"),
        dict(block_length=4, block_causal=True, cache="prefix"),
        dict(block_length=4, growing_canvas=True),
    ],
)
def test_rows_joining_between_blocks_decode_as_each_prompt_alone(sm, options):
    engine = Engine(sm, start=False)
    events: dict[int, list[dict]] = {i: [] for i in range(len(PROMPTS))}
    jobs = []
    for i, (prompt, length) in enumerate(zip(PROMPTS, LENGTHS)):
        config = SamplingConfig(gen_length=length, **options)
        ids = sm.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        jobs.append(Job(ids, config, emit=events[i].append))
    assert len({job.group for job in jobs}) == 1  # one group: they share block calls
    active, call, mixed = [], 0, False
    while call == 0 or active:
        active += [job for job, at in zip(jobs, JOIN_AT) if at == call]
        mixed |= len({job.block for job in active}) > 1
        engine.run_block(active)
        active = [job for job in active if job.block >= 0]
        call += 1
    assert mixed  # some call held rows at different blocks
    for i, (prompt, length) in enumerate(zip(PROMPTS, LENGTHS)):
        expected = alone(sm, prompt, SamplingConfig(gen_length=length, **options))
        done = events[i][-1]
        assert done["type"] == "done"
        assert done["text"] == sm.tokenizer.decode(expected, skip_special_tokens=True)
        assert before_eos(jobs[i].answer, sm.eos_id) == expected, i
        blocks = [e for e in events[i] if e["type"] == "block"]
        assert "".join(e["text"] for e in blocks) == done["text"]
    assert engine.stats.row_forwards > engine.stats.forwards  # rows shared forward passes


def test_a_traced_steps_proposals_and_probabilities_are_the_models(sm):
    """The playground's hover: at the first step each masked position's proposal is the
    argmax of the model's logits on [prompt | masks] (the mask token never proposed) and
    its probability softmax(logits)[proposal]; positions committed before a step carry
    none. Tracing changes no token."""
    prompt = sm.tokenizer("rev 4812=", add_special_tokens=False)["input_ids"]
    config = SamplingConfig(gen_length=8, block_length=4, steps=8)
    events: list[dict] = []
    engine = Engine(sm, start=False)
    job = Job(prompt, config, emit=events.append, trace=True)
    while job.block >= 0 and not any(e["type"] == "done" for e in events):
        engine.run_block([job])
    steps = [e for e in events if e["type"] == "step"]
    assert len(steps) == 8 and all(len(e["proposed"]) == 8 for e in steps)
    ids = torch.tensor([prompt + [sm.mask_id] * 8])
    with torch.no_grad():
        raw = sm.model(ids)[0, len(prompt) : len(prompt) + 4].double()
    logits = raw.clone()
    logits[:, sm.mask_id] = -torch.inf
    first = steps[0]
    assert first["proposed"][:4] == logits.argmax(-1).tolist()
    probs = torch.softmax(raw, -1)
    expected = probs.gather(-1, logits.argmax(-1)[:, None]).squeeze(-1)
    assert first["probability"][:4] == pytest.approx(expected.tolist(), abs=1e-4)
    assert first["proposed"][4:] == [None] * 4  # the next block: not yet proposed
    for before, after in zip(steps, steps[1:]):  # committed: no proposal after
        for i, token in enumerate(before["canvas"]):
            if token != sm.mask_id:
                assert after["proposed"][i] is None and after["probability"][i] is None
    untraced: list[dict] = []
    plain = Job(prompt, config, emit=untraced.append)
    while plain.block >= 0 and not any(e["type"] == "done" for e in untraced):
        engine.run_block([plain])
    assert plain.answer == job.answer


def test_stop_strings_hold_back_text_that_may_start_one(sm):
    """Streamed text never shows the start of a stop string that the next block completes,
    and the final text is cut before the first stop string."""
    engine = Engine(sm, start=False)
    config = SamplingConfig(gen_length=16, block_length=4)
    ids = sm.tokenizer("rev 90417=", add_special_tokens=False)["input_ids"]
    full = sm.tokenizer.decode(alone(sm, "rev 90417=", config), skip_special_tokens=True)
    assert len(full) >= 8, full
    stop = full[3:7]  # straddles the first two blocks' text
    events = []
    job = Job(ids, config, emit=events.append, stops=(stop,))
    while job.block >= 0:
        engine.run_block([job])
    assert events[-1]["text"] == full[: full.index(stop)]
    assert events[-1]["finish_reason"] == "stop"
    streamed = "".join(e["text"] for e in events if e["type"] == "block")
    assert streamed == events[-1]["text"]


# ------------------------------------------------------------------ the prefix cache

REPEATS = ["rev 90417=", "a", "rev 90417=", "sort 31=", "a", "rev 90417="]
REPEAT_LENGTHS = [12, 8, 12, 16, 8, 12]
REPEAT_JOIN_AT = [0, 0, 0, 1, 2, 2]  # rev twice in call 0, a and rev again in call 2


def drive(engine: Engine, jobs: list[Job], join_at: list[int]) -> None:
    """Block calls by hand, as the scheduler makes them: jobs join before call join_at."""
    active, call = [], 0
    while call <= max(join_at) or active:
        active += [job for job, at in zip(jobs, join_at) if at == call]
        if active:
            engine.run_block(active)
        active = [job for job in active if job.block >= 0]
        call += 1


def repeated_jobs(sm, options: dict) -> list[Job]:
    jobs = []
    for prompt, length in zip(REPEATS, REPEAT_LENGTHS):
        ids = sm.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        jobs.append(Job(ids, SamplingConfig(gen_length=length, **options), emit=lambda e: None))
    return jobs


CACHED_OPTIONS = [
    dict(block_length=4),
    dict(block_length=4, threshold=0.3, cache="dual"),
    dict(block_length=4, cfg_scale=1.0, cache="prefix"),
    dict(block_length=4, remasking="entropy", schedule="dream", cache="prefix"),
    dict(block_length=4, block_causal=True, cache="prefix"),
    dict(block_length=4, growing_canvas=True, cache="prefix"),
    dict(block_length=4, shift_logits=True, cache="dual"),
]


@pytest.mark.parametrize("options", CACHED_OPTIONS)
def test_prefix_cache_gives_the_tokens_of_no_cache(sm, options):
    """Repeated prompts joining at different block calls (a repeat inside one call, repeats
    in a later call): the same tokens with the cache as without, each the prompt's `sample`
    alone; 3 rows computed, 3 reused (one copied inside its call, two from the cache)."""
    off, on = Engine(sm, start=False), Engine(sm, start=False, prefix_cache_bytes=1 << 24)
    plain, cached = repeated_jobs(sm, options), repeated_jobs(sm, options)
    drive(off, plain, REPEAT_JOIN_AT)
    drive(on, cached, REPEAT_JOIN_AT)
    assert [job.answer for job in cached] == [job.answer for job in plain]
    for job, prompt, length in zip(cached, REPEATS, REPEAT_LENGTHS):
        expected = alone(sm, prompt, SamplingConfig(gen_length=length, **options))
        assert before_eos(job.answer, sm.eos_id) == expected
    cache = on.prefix_cache
    assert (cache.hits, cache.misses, len(cache)) == (3, 3, 3)
    assert on.stats.saved_row_forwards == 3
    assert off.stats.row_forwards - on.stats.row_forwards == 3
    assert off.prefix_cache is None and off.stats.saved_row_forwards == 0


@pytest.mark.parametrize("options", [dict(block_length=4), dict(block_length=4, cache="prefix")])
def test_prefix_cache_with_a_seed_draws_what_generate_draws(sm, options):
    """A greedy request fills the cache; a seeded temperature-1 request of the same prompt
    reuses its first forward (temperature is not in the key: it acts after the forward) and
    draws exactly the tokens of `sample` with that seed's generator, and of no cache."""
    ids = sm.tokenizer("rev 90417=", add_special_tokens=False)["input_ids"]
    greedy = SamplingConfig(gen_length=12, **options)
    warm = SamplingConfig(gen_length=12, temperature=1.0, **options)
    answers = {}
    for size in (0, 1 << 24):
        engine = Engine(sm, start=False, prefix_cache_bytes=size)
        first = Job(ids, greedy, emit=lambda e: None)
        drive(engine, [first], [0])
        job = Job(ids, warm, emit=lambda e: None, seed=7)
        drive(engine, [job], [0])
        answers[size] = job.answer
        if size:
            key = engine.prefix_key(Job(ids, greedy, emit=None))
            assert key is not None and engine.prefix_key(Job(ids, warm, emit=None)) == key
            assert (engine.prefix_cache.hits, engine.prefix_cache.misses) == (1, 1)
            assert engine.stats.forwards == first.forwards + job.forwards  # one call saved
    out = sample(sm.model, torch.tensor([ids]), warm, mask_id=sm.mask_id, eos_id=sm.eos_id,
                 pad_id=sm.pad_id, generator=torch.Generator().manual_seed(7))  # fmt: skip
    assert answers[1 << 24] == answers[0] == out.answers[0].tolist()


def test_prefix_cache_keys_every_option_the_forward_sees(sm, tmp_path):
    """Another prompt, canvas, block length, attention, guidance, cache mode or model gives
    another key; options that act only on the logits share one."""
    engine = Engine(sm, start=False, prefix_cache_bytes=1 << 20)
    ids = sm.tokenizer("rev 1=", add_special_tokens=False)["input_ids"]

    def key(prompt=ids, **options):
        return engine.prefix_key(Job(prompt, SamplingConfig(**options), emit=None))

    base = dict(gen_length=8, block_length=4)
    changed = [dict(gen_length=12), dict(block_length=8), dict(block_causal=True),
               dict(cfg_scale=1.0), dict(cache="prefix"), dict(shift_logits=True),
               dict(growing_canvas=True)]  # fmt: skip
    keys = {key(**base), key(prompt=ids[:-1], **base), *(key(**{**base, **c}) for c in changed)}
    assert len(keys) == 2 + len(changed)
    same = [dict(temperature=0.7), dict(threshold=0.9), dict(remasking="entropy"),
            dict(steps=4), dict(top_k=3), dict(eos_penalty=1.0), dict(cache_refresh=2)]  # fmt: skip
    assert {key(**{**base, **s}) for s in same} == {key(**base)}
    other = Engine(load_for_sampling(save_tiny_model(tmp_path / "other", seed=2), device="cpu"),
                   start=False, prefix_cache_bytes=1 << 20)  # fmt: skip
    assert other.prefix_key(Job(ids, SamplingConfig(**base), emit=None)) != key(**base)
    job = Job(ids, SamplingConfig(**base), emit=None)
    job.block = 1
    assert key(**base) is not None and engine.prefix_key(job) is None  # later blocks: never
    assert Engine(sm, start=False).prefix_key(Job(ids, SamplingConfig(**base), emit=None)) is None


def test_prefix_cache_evicts_the_least_recently_used_within_its_bound(sm):
    """Bytes never exceed the bound: the entry used longest ago goes first; an entry larger
    than the bound is not kept."""
    entry = lambda n: FirstForward(torch.zeros(n, dtype=torch.uint8), None)  # noqa: E731
    one = PrefixCache.size("a", entry(100))  # the tensor's 100 bytes and the key's
    assert one == 100 + sys.getsizeof("a")
    cache = PrefixCache(int(2.5 * one))
    cache.put("a", entry(100))
    cache.put("b", entry(100))
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("c", entry(100))
    assert list(cache.entries) == ["a", "c"] and cache.bytes == 2 * one and cache.evictions == 1
    cache.put("d", entry(400))  # over the bound: not kept
    assert list(cache.entries) == ["a", "c"] and cache.bytes == 2 * one
    # through the engine: one-block answers of prompts of one length, so entries of one size
    prompts = ["rev 11=", "rev 22=", "rev 11=", "rev 33=", "rev 11="]  # A B A C A
    config = SamplingConfig(gen_length=4, block_length=4, cache="prefix")
    counts = {}
    for room in (1.5, 2.5):  # entries the bound holds
        jobs = [Job(sm.tokenizer(p, add_special_tokens=False)["input_ids"], config,
                    emit=lambda e: None) for p in prompts]  # fmt: skip
        probe = Engine(sm, start=False, prefix_cache_bytes=1 << 24)
        drive(probe, jobs[:1], [0])
        size = probe.prefix_cache.bytes
        engine = Engine(sm, start=False, prefix_cache_bytes=int(room * size))
        jobs = [Job(job.prompt_ids, config, emit=lambda e: None) for job in jobs]
        drive(engine, jobs, list(range(len(jobs))))  # one prompt per block call
        cache = engine.prefix_cache
        assert cache.bytes <= cache.max_bytes and len(cache) == int(room)
        counts[room] = (cache.hits, cache.misses, cache.evictions)
    assert counts[1.5] == (0, 5, 4)  # each repeat came after its entry was evicted
    assert counts[2.5] == (2, 3, 1)  # C evicted B, the least recently used, not A


# ------------------------------------------------------------------------- threads


def test_threaded_runs_small_forwards_on_one_thread_and_big_ones_on_the_idle_cores(sm):
    idle = [None]
    threaded = Threaded(sm.model, 2, 100, idle=lambda: idle[0])
    assert [threaded.threads_for(n) for n in (1, 99, 100, 5000)] == [1, 1, 2, 2]
    for cores, expected in [(0.0, 1), (0.4, 1), (0.6, 1), (1.6, 2), (1.4, 1), (7.0, 2)]:
        idle[0] = cores  # rounded, at least 1, at most `threads`
        assert threaded.threads_for(100) == expected, cores
    assert Threaded(sm.model, 1, 0).threads_for(10**6) == 1
    assert Threaded(sm.model, 3, 0).threads_for(1) == 3  # 0: every forward on `threads`
    assert threaded.config is sm.model.config  # attributes are the model's


@pytest.mark.parametrize("options", [dict(block_length=4), dict(block_length=4, cache="dual")])
def test_two_threads_for_big_forwards_give_one_threads_tokens(tmp_path, options):
    """The quickstart's width (ops big enough to split over threads): 16 rows on 2 threads
    (forwards of 16 rows), the small ones on 1 (a row alone), decode what `sample` decodes
    for each prompt alone on one thread."""
    fields = dict(hidden_size=128, intermediate_size=384, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=2)  # fmt: skip
    wide = load_for_sampling(save_tiny_model(tmp_path / "wide", seed=3, **fields), device="cpu")
    prompts = [f"{task} {'9876543210'[: 1 + i % 7]}=" for i, task in
               enumerate(["rev", "sort", "add 1+", "rev 12"] * 4)]  # fmt: skip
    config = SamplingConfig(gen_length=8, **options)
    engine = Engine(wide, start=False, threads=2, one_thread_below=64)
    jobs = [Job(wide.tokenizer(p, add_special_tokens=False)["input_ids"], config,
                emit=lambda e: None) for p in prompts]  # fmt: skip
    lone = Job(jobs[0].prompt_ids, config, emit=lambda e: None)
    try:
        drive(engine, jobs + [lone], [0] * len(jobs) + [3])  # the lone row: after the batch
    finally:
        torch.set_num_threads(1)
    assert engine.model.calls[2] > 0 and engine.model.calls[1] > 0, engine.model.calls
    for job, prompt in zip(jobs, prompts):
        assert before_eos(job.answer, wide.eos_id) == alone(wide, prompt, config), prompt
    assert lone.answer == jobs[0].answer

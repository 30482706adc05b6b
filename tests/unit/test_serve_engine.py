"""The serving engine's block calls (unmask/serve/engine.py), driven by hand: rows that join
at different times, so one forward pass holds rows at different blocks of answers of
different lengths, decode exactly what `sample` decodes for each prompt alone."""

import pytest
import torch
from conftest import save_tiny_model

from unmask.checkpoint import load_for_sampling
from unmask.sampling import SamplingConfig, sample
from unmask.sampling.texts import before_eos
from unmask.serve.engine import Engine, Job

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

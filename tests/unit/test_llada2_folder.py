"""A folder in LLaDA2.0's released layout decodes as LLaDA2.0's own `generate` with no
sampling option given (the llada2_moe family's default decoding, models/families.py
`Family.decoding`): `unmask generate`, the server's continuous batching (rows joining at
different blocks) and its completions endpoint, against the written-out copy in
test_llada2_generate.py; options given still win."""

import asyncio
import json

import httpx
import pytest
import torch
from conftest import tiny_model
from test_llada2_generate import MOE, official_text, released_folder

from unmask.checkpoint import load_for_sampling
from unmask.cli import main
from unmask.sampling import sample
from unmask.sampling.config import FolderSampling, resolve_sampling
from unmask.sampling.generation_file import saved_sampling
from unmask.sampling.texts import before_eos

pytestmark = pytest.mark.usefixtures("one_thread")

#: prompts whose answers end (EOS) within a few blocks of LLaDA2's 2048-token default
PROMPTS = ["sort 31=", "add 12+7=", "hello there, how are you?"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return released_folder(tmp_path_factory.mktemp("llada2") / "model")


@pytest.fixture(scope="module")
def sm(folder):
    return load_for_sampling(folder, device="cpu")


@pytest.fixture(scope="module")
def expected(sm):
    """LLaDA2.0's generate at its defaults (gen_length 2048, block 32, steps 32, threshold
    0.95) on each prompt."""
    return [official_text(sm, p, gen_length=2048) for p in PROMPTS]


def generated(folder, tmp_path, *flags) -> list[str]:
    src, dst = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    assert main(["generate", "--model", str(folder), "--prompts", str(src), "--out", str(dst),
                 *flags]) == 0  # fmt: skip
    return [json.loads(line)["completion"] for line in dst.read_text().splitlines()]


def test_generate_with_no_options_is_llada2s_generate(folder, tmp_path, expected):
    assert generated(folder, tmp_path) == expected
    assert any(expected) and len(set(expected)) == len(expected)


def test_the_family_default_is_the_released_folders(folder, sm, tmp_path):
    """The folder's options are LLaDA2's generate's; a folder unmask wrote (tagged) keeps
    unmask's own defaults."""
    saved = saved_sampling(folder)
    assert isinstance(saved, FolderSampling)
    config = resolve_sampling(saved)
    assert (config.block_origin, config.block_causal, config.fill_rule) == ("request", True,
                                                                           "llada2")  # fmt: skip
    assert (config.gen_length, config.block_length, config.block_steps, config.threshold) == (
        2048, 32, 32, 0.95)  # fmt: skip
    tagged = tmp_path / "tagged"  # built by unmask: its config.json carries unmask's tag
    tiny_model(0, vocab_size=len(sm.tokenizer), **MOE).save_pretrained(str(tagged))
    assert resolve_sampling(saved_sampling(tagged)).block_origin == "answer"


def test_options_given_win(folder, sm, tmp_path):
    """Flags change LLaDA2's arguments; a decoder or steps over the whole answer replace its
    rule (a decoder keeps its canvas layout: blocks from the request, block-causal)."""
    want = [official_text(sm, p, gen_length=40, block_length=8, steps=4, threshold=0.7)
            for p in PROMPTS]  # fmt: skip
    flags = ["--gen-length", "40", "--block-length", "8", "--block-steps", "4",
             "--threshold", "0.7"]  # fmt: skip
    assert generated(folder, tmp_path, *flags) == want
    joint = resolve_sampling(saved_sampling(folder), {"decoder": "joint_threshold"})
    assert (joint.block_origin, joint.block_causal, joint.fill_rule) == ("request", True, None)
    plain = resolve_sampling(saved_sampling(folder), {"steps": 64})
    assert (plain.block_origin, plain.steps, plain.fill_rule) == ("answer", 64, None)


def test_the_engine_decodes_as_llada2_with_rows_joining_at_different_blocks(sm):
    """The server's block calls, rows joining at different times (so one call holds rows at
    different blocks of different answers, prompts of different lengths), decode each
    prompt as LLaDA2's generate decodes it alone."""
    from unmask.serve.engine import Engine, Job

    engine = Engine(sm, start=False)
    config = resolve_sampling(sm.saved, {"gen_length": 40, "block_length": 8,
                                         "block_steps": 4, "threshold": 0.7})  # fmt: skip
    events = {i: [] for i in range(len(PROMPTS))}
    jobs = []
    for i, prompt in enumerate(PROMPTS):
        ids = sm.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        jobs.append(Job(ids, config, emit=events[i].append))
    assert len({job.group for job in jobs}) == 1
    active, call, mixed = [], 0, False
    while call < len(jobs) or active:
        active += [job for job, at in zip(jobs, [0, 1, 2]) if at == call]
        mixed |= len({job.block for job in active}) > 1
        engine.run_block(active)
        active = [job for job in active if job.block >= 0]
        call += 1
    assert mixed
    for i, prompt in enumerate(PROMPTS):
        want = official_text(sm, prompt, gen_length=40, block_length=8, steps=4, threshold=0.7)
        assert events[i][-1]["type"] == "done" and events[i][-1]["text"] == want, i


def test_a_served_request_with_no_options_is_llada2s_generate(sm, expected):
    """A completions request with no sampling option (max_tokens LLaDA2's gen_length) is
    answered as LLaDA2's generate answers, requests decoded together."""
    from unmask.serve.app import Server, build_app
    from unmask.serve.engine import Engine

    engine = Engine(sm)
    app = build_app(Server(sm, engine, "tiny"))

    async def ask_all():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            bodies = [{"model": "tiny", "prompt": p, "max_tokens": 2048} for p in PROMPTS]
            return await asyncio.gather(*(client.post("/v1/completions", json=b, timeout=300)
                                          for b in bodies))  # fmt: skip

    try:
        replies = asyncio.run(ask_all())
    finally:
        engine.close()
    assert [r.status_code for r in replies] == [200] * len(PROMPTS), replies[0].text
    assert [r.json()["choices"][0]["text"] for r in replies] == expected


def test_lm_eval_generates_as_llada2s_generate(folder, sm):
    """The lm-eval adapter (hence `unmask eval`) on the folder: its family's decoding, the
    task's max_gen_toks as LLaDA2's gen_length, model_args changing LLaDA2's arguments."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from unmask.eval.harness import UnmaskLM

    lm = UnmaskLM.create_from_arg_string(f"pretrained={folder},block_steps=4,threshold=0.7,"
                                         "block_length=8")  # fmt: skip
    assert (lm.options.block_origin, lm.options.fill_rule) == ("request", "llada2")
    requests = [Instance("generate_until", {}, (p, {"until": ["\n"], "max_gen_toks": 37,
                                                     "temperature": 0.0}), i)
                for i, p in enumerate(PROMPTS)]  # fmt: skip
    texts = lm.generate_until(requests)
    want = [official_text(sm, p, gen_length=37, block_length=8, steps=4, threshold=0.7)
            for p in PROMPTS]  # fmt: skip
    assert texts == [w.split("\n")[0] for w in want]


def test_a_familys_default_takes_the_largest_part_that_fits():
    """LLaDA's generate.py defaults (gen_length = block_length = steps = 128): a length
    that whole blocks of 128 do not cut drops them (unmask's own: one block), one they do
    keeps them; a changed block keeps the rest."""
    folder = FolderSampling({}, {"gen_length": 128, "block_length": 128, "steps": 128})
    chosen = {}
    for given in ({}, {"gen_length": 64}, {"gen_length": 256}, {"block_length": 32}):
        config = resolve_sampling(folder, given)
        chosen[str(given)] = (config.gen_length, config.block_length, config.steps)
    assert chosen == {"{}": (128, 128, 128), "{'gen_length': 64}": (64, None, None),
                      "{'gen_length': 256}": (256, 128, 128),
                      "{'block_length': 32}": (128, 32, 128)}  # fmt: skip
    own = FolderSampling({"threshold": 0.5}, {"threshold": 0.9, "block_length": 8})
    assert resolve_sampling(own).threshold == 0.5  # the folder's own file wins


def staggered(engine, jobs, joins) -> bool:
    """Run the engine's block calls with job i joining at call joins[i]; whether some call
    held rows at different blocks."""
    active, call, mixed = [], 0, False
    while call <= max(joins) or active:
        active += [job for job, at in zip(jobs, joins) if at == call]
        mixed |= len({job.block for job in active}) > 1
        if active:
            engine.run_block(active)
        active = [job for job in active if job.block >= 0]
        call += 1
    return mixed


@pytest.mark.parametrize(
    "options",
    [
        {"decoder": "joint_threshold", "edit_threshold": 0.0, "max_post_edit_steps": 3},
        {"eos_early_stop": True},
        {"cache": "dual", "eos_early_stop": True},
    ],
)  # fmt: skip
def test_the_engine_honours_the_request_grid(sm, options):
    """Rows joining at different blocks, with joint_threshold (SGLang's layout), with LLaDA2's
    early stop, and with a cache and the prefix cache (a prompt asked twice): each answer is
    `sample`'s for the prompt alone."""
    from unmask.serve.engine import Engine, Job

    engine = Engine(sm, start=False, prefix_cache_bytes=1 << 24)
    given = {"gen_length": 30, "block_length": 8, "threshold": 0.7, **options}
    config = resolve_sampling(sm.saved, given)
    assert (config.block_origin, config.block_causal) == ("request", True)
    prompts = [*PROMPTS, PROMPTS[0]]
    events = {i: [] for i in range(len(prompts))}
    jobs = [Job(sm.tokenizer(p, add_special_tokens=False)["input_ids"], config,
                emit=events[i].append) for i, p in enumerate(prompts)]  # fmt: skip
    assert len({job.group for job in jobs}) == 1
    assert staggered(engine, jobs, [0, 1, 1, 2])
    if "cache" in options:
        assert engine.prefix_cache.hits >= 1
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([sm.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
        out = sample(sm.model, ids, config, mask_id=sm.mask_id, eos_id=sm.eos_id)
        answer = before_eos(out.answers[0].tolist(), sm.eos_id)
        want = sm.tokenizer.decode(answer, skip_special_tokens=True)
        assert events[i][-1]["type"] == "done" and events[i][-1]["text"] == want, i


def test_lm_eval_scores_likelihoods_as_before(folder):
    """The family's block-causal decoding is how LLaDA2 generates: likelihood tasks keep
    unmask's bidirectional estimator on the folder (block_causal given still refuses)."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from unmask.eval.harness import UnmaskLM

    lm = UnmaskLM.create_from_arg_string(f"pretrained={folder},mc_num=2,seed=1")
    assert lm.options.block_causal and not lm.scoring.block_causal
    ((score, _),) = lm.loglikelihood([Instance("loglikelihood", {}, ("sort 31=", "13"), 0)])
    assert score < 0
    refused = UnmaskLM.create_from_arg_string(f"pretrained={folder},block_causal=True")
    with pytest.raises(ValueError, match="likelihoods of block-causal"):
        refused.loglikelihood([Instance("loglikelihood", {}, ("a", "b"), 0)])


def test_an_exported_released_folder_keeps_its_familys_decoding_as_defaults(folder, tmp_path):
    """`unmask export` of a released folder decodes as the folder did (LLaDA2's generate
    with no options) and still takes another decoder (its family's rule stays a default,
    under "unmask_defaults", not an option the copy fixes)."""
    out = tmp_path / "exported"
    assert main(["export", str(folder), "--out", str(out)]) == 0
    data = json.loads((out / "generation_config.json").read_text())
    assert data["unmask_defaults"]["fill_rule"] == "llada2" and "fill_rule" not in data["unmask"]
    before, after = resolve_sampling(saved_sampling(folder)), resolve_sampling(saved_sampling(out))
    assert after == before
    joint = resolve_sampling(saved_sampling(out), {"decoder": "joint_threshold"})
    assert (joint.decoder, joint.block_origin, joint.fill_rule) == ("joint_threshold",
                                                                   "request", None)  # fmt: skip


def test_the_playground_offers_a_released_folder_llada21s_presets_and_the_masked_ones(folder):
    """A released LLaDA2 folder decodes with its family's rule by default, which a preset
    naming another decoder replaces (the rule is a default, not a fixed option)."""
    from unmask.serve.presets import playground

    offered = playground(saved_sampling(folder), "llada2_moe", False, [])
    names = [p["name"] for p in offered["presets"]]
    assert names == ["", "speedy", "quality", "llada", "dream", "fastdllm", "mdlm", "random"]
    assert offered["decoder"] == "masked"
